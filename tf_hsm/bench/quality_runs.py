"""The planner's quality evidence, re-made: `python -m tf_hsm.bench.quality_runs CORPUS`.

Trains the demo's word-level LSTM language model (`python -m tf_hsm.demo`: Embedding ->
LSTM(128) -> the output layer, LazyAdam 6e-3, batch 64 x 32, 3 epochs, the first 300K
tokens) once per output layer the planner has a row for, one process after another
(pinned to one CPU with `taskset -c CPU` where taskset exists), and prints each layer's
best held-out perplexity against full softmax's: the figures of
`tf_hsm.planning.quality.EVIDENCE` and docs/planner.md's quality table.

CORPUS is one of

- `stdlib`: the demo's default corpus (the standard library's docstrings);
- `kjv`: the King James Bible, from Debian's `bible-kjv-text` read with `bible-kjv`'s
  `bible` command (`apt-get install -y bible-kjv`), one document per chapter, verse
  numbers and chapter headings removed (docs/demo.md);
- `fortunes`: Debian's `fortunes` package (`apt-get install -y fortunes`): every file of
  /usr/share/games/fortunes, one document per fortune (the '%' lines separate them);
- a path: a UTF-8 text file, as `python -m tf_hsm.demo --corpus` takes it.

Each row writes OUT/ROW/results.json (the demo's; OUT is demo_results/quality_runs/CORPUS
unless --out says); OUT/summary.json and OUT/summary.md hold the table; `--acceptance`
adds the planner's pick for the demo's model (OUT/acceptance.json). `--rows` runs some rows only (a summary then covers those found in OUT,
so rows can be re-run one at a time); `--dry-run` prints the commands.
"""

import argparse
import glob
import json
import math
import os
import shutil
import statistics
import subprocess
import sys

FORTUNES = "/usr/share/games/fortunes"
# row: (the `tf_hsm.planning.quality` kind, the demo's arguments). "{cbrt}" is replaced by
# ceil(V^(1/3)), the planner's three-level balanced tree's branching.
ROWS = {
    "full": ("full", ["--models", "full"]),
    "sampled": ("sampled", ["--models", "sampled"]),
    "learned": ("learned", ["--models", "hsm", "--tree", "learned"]),
    "two_level": ("two_level", ["--models", "hsm", "--tree", "two_level"]),
    "huffman2": ("huffman2", ["--models", "hsm", "--tree", "huffman", "--branching", "2"]),
    "huffman8": ("huffman8", ["--models", "hsm", "--tree", "huffman", "--branching", "8"]),
    "huffman32": ("huffman32", ["--models", "hsm", "--tree", "huffman",
                                "--branching", "32"]),
    "balanced": ("three_level", ["--models", "hsm", "--tree", "balanced",
                                 "--branching", "{cbrt}"]),
    "adaptive_demo": ("adaptive_demo", ["--models", "adaptive"]),
    "adaptive_flat": ("adaptive_flat", ["--models", "adaptive", "--cutoffs", "planned",
                                        "--div-value", "4", "--tail", "flat"]),
    "adaptive_two_level": ("adaptive_two_level", [
        "--models", "adaptive", "--cutoffs", "planned", "--div-value", "4",
        "--tail", "two_level"]),
    "adaptive_fixed": ("adaptive_fixed", ["--models", "adaptive", "--cutoffs", "pytorch",
                                          "--div-value", "4"]),
}


def kjv_text(path):
  """Writes the King James Bible as plain text (docs/demo.md's command)."""
  if not shutil.which("bible"):
    raise SystemExit("the `bible` command is missing: apt-get install -y bible-kjv "
                     "(it brings bible-kjv-text)")
  text = subprocess.run(["bible", "gen1:1-rev22:21"], capture_output=True, text=True,
                        check=True).stdout
  lines, prev = [], None
  for number, line in enumerate(text.split("\n")):
    # A chapter heading ("Genesis 1") follows a blank line: dropped.
    heading = (number > 0 and prev == "" and line[:1] not in ("", " ") and
               line.rsplit(" ", 1)[-1].isdigit())
    prev = line
    if heading:
      continue
    stripped = line.lstrip(" ")
    if stripped != line and stripped.split(" ", 1)[0].isdigit() and " " in stripped:
      line = stripped.split(" ", 1)[1]  # the verse number
    lines.append(line)
  with open(path, "w", encoding="utf-8") as f:
    f.write("\n".join(lines))


def fortunes_text(path):
  """Writes every fortune of /usr/share/games/fortunes as one document (blank lines
  between fortunes, none inside one)."""
  files = sorted(p for p in glob.glob(os.path.join(FORTUNES, "*"))
                 if os.path.isfile(p) and not os.path.islink(p) and
                 not p.endswith(".dat"))
  if not files:
    raise SystemExit(f"no fortunes under {FORTUNES}: apt-get install -y fortunes")
  documents = []
  for name in files:
    with open(name, encoding="utf-8", errors="replace") as f:
      for fortune in f.read().split("\n%\n"):
        lines = [line for line in fortune.split("\n") if line.strip() and line != "%"]
        if lines:
          documents.append("\n".join(lines))
  with open(path, "w", encoding="utf-8") as f:
    f.write("\n\n".join(documents) + "\n")


def corpus_file(corpus, out):
  """The demo's `--corpus` argument for CORPUS (None: the standard library)."""
  if corpus == "stdlib":
    return None
  if corpus in ("kjv", "fortunes"):
    path = os.path.join(out, f"{corpus}.txt")
    (kjv_text if corpus == "kjv" else fortunes_text)(path)
    return path
  if not os.path.isfile(corpus):
    raise SystemExit(f"no such corpus: {corpus} (stdlib, kjv, fortunes or a file)")
  return corpus


def training_counts(corpus):
  """The class counts of the demo's vocabulary at its defaults (by the demo's ids)."""
  from tf_hsm.demo import run  # pylint: disable=g-import-not-at-top
  documents = run.file_documents(corpus) if corpus else run.stdlib_documents()
  train, _ = run.split_corpus(documents, run.DEFAULTS["max_tokens"], run.DEFAULTS["seed"])
  _, counts = run.build_vocab(train, run.DEFAULTS["vocab"], run.DEFAULTS["min_count"])
  return counts


def command(row, corpus, out, vocab, cpu):
  args = [a.replace("{cbrt}", str(max(2, math.ceil(vocab ** (1 / 3) - 1e-9))))
          for a in ROWS[row][1]]
  cmd = [sys.executable, "-m", "tf_hsm.demo", *args, "--quiet",
         "--out", os.path.join(out, row)]
  if corpus:
    cmd += ["--corpus", corpus]
  if cpu is not None and shutil.which("taskset"):
    cmd = ["taskset", "-c", str(cpu)] + cmd
  return cmd


def summary(out):
  """(rows, markdown): each row's best held-out perplexity in OUT, against full's."""
  found = {}
  for row in ROWS:
    path = os.path.join(out, row, "results.json")
    if os.path.exists(path):
      with open(path) as f:
        found[row] = json.load(f)
  full = None
  if "full" in found:
    full = min(found["full"]["models"][0]["held_out_perplexity"][1:])
  rows = []
  for row, result in found.items():
    model = result["models"][0]
    ppl = model["held_out_perplexity"][1:]
    cpu = model["train_cpu_seconds"]
    rows.append({
        "row": row, "kind": ROWS[row][0], "model": model["name"],
        "vocab_size": result["vocab_size"], "perplexity_per_epoch": ppl,
        "best": min(ppl), "ratio": None if full is None else min(ppl) / full,
        # The demo's figure: the median of the epochs after the first (tracing).
        "cpu_seconds_per_epoch": statistics.median(cpu[1:] if len(cpu) > 1 else cpu),
        "tree": result.get("tree"), "adaptive": result.get("adaptive"),
        "settings": result["settings"]})
  lines = ["| row (kind) | model | V | perplexity per epoch | best | vs full | CPU s/epoch "
           "| layout |", "|---|---|---|---|---|---|---|---|"]
  for r in rows:
    layout = ""
    if r["adaptive"]:
      a = r["adaptive"]
      layout = f"{a['tail']} tails, cutoffs {a['cutoffs']}, div {a['div_value']:g}"
    elif r["tree"] and r["model"].startswith("hsm"):
      layout = (f"{r['tree']['kind']}" + (f"({r['tree']['branching']})"
                                          if r['tree'].get('branching') else "") +
                f", {r['tree']['num_slots']:,} rows, depth {r['tree']['max_depth']}")
    ratio = "-" if r["ratio"] is None else f"{100 * (r['ratio'] - 1):+.1f}%"
    lines.append(f"| {r['row']} ({r['kind']}) | {r['model']} | {r['vocab_size']:,} | "
                 + ", ".join(f"{p:.1f}" for p in r["perplexity_per_epoch"])
                 + f" | {r['best']:.1f} | {ratio} | {r['cpu_seconds_per_epoch']:.1f} | "
                 f"{layout} |")
  return rows, "\n".join(lines)


def acceptance(corpus, out):
  """The planner's pick for the demo's model on this corpus (docs/planner.md, "On the
  demo's model: the acceptance"), beside the perplexities and CPU times measured in OUT.

  `tf_hsm.plan(model=hsm_model, tokens_per_step=2048, counts=..., optimizer=
  "lazy_adam")` at this machine's cached rates, with the corpus's real training counts
  renumbered by decreasing frequency (the demo's ids are, but for `<unk>` at 0; the
  adaptive rows need them sorted).

  Returns:
    A dict: the pick, the fastest row, their predicted whole steps, and for every row
    measured in OUT its best perplexity and CPU s an epoch.
  """
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tf_hsm  # pylint: disable=g-import-not-at-top
  from tf_hsm.demo import run  # pylint: disable=g-import-not-at-top
  counts = np.sort(training_counts(corpus))[::-1]
  d, seq, batch = run.DEFAULTS["hidden"], run.DEFAULTS["seq_len"], run.DEFAULTS["batch"]
  model = run.hsm_model(tf_hsm.Tree.two_level(len(counts), counts), counts, d, seq,
                        run.DEFAULTS["learning_rate"])
  report = tf_hsm.plan(model=model, tokens_per_step=batch * seq, counts=counts,
                       optimizer="lazy_adam")
  measured = {r["kind"]: r for r in summary(out)[0]}
  exact = [r for r in report.rows if r["exact"] and r["fits"]]
  fastest = min(exact, key=lambda r: r["whole_step_seconds"])
  pick = next(r for r in report.rows if r["method"] == report.recommended)

  def figures(row):
    m = measured.get(row["quality_kind"])
    return {"label": row["label"], "method": row["method"], "kind": row["quality_kind"],
            "whole_step_ms": 1e3 * row["whole_step_seconds"],
            "quality": row["quality"], "cutoffs": row.get("cutoffs"),
            "perplexity": m and m["best"], "cpu_seconds_per_epoch":
                m and m["cpu_seconds_per_epoch"]}

  rows = [figures(r) for r in exact]
  return {"vocab_size": len(counts), "body_ms": 1e3 * pick["body_seconds"],
          "pick": figures(pick), "fastest": figures(fastest), "rows": rows,
          "reason": report.reason, "table": report.to_markdown()}


def main(argv=None):
  p = argparse.ArgumentParser(prog="python -m tf_hsm.bench.quality_runs",
                              description=__doc__.split("\n\n")[0])
  p.add_argument("corpus", help="stdlib, kjv, fortunes or a UTF-8 text file")
  p.add_argument("--rows", default=",".join(ROWS),
                 help="comma-separated rows to run, of " + ", ".join(ROWS) +
                      " (default: all)")
  p.add_argument("--out", default=None,
                 help="directory for the results (default: demo_results/quality_runs/CORPUS)")
  p.add_argument("--cpu", type=int, default=None,
                 help="the CPU every run is pinned to with taskset (default: the last "
                      "CPU this process may run on; -1: not pinned)")
  p.add_argument("--dry-run", action="store_true",
                 help="print the commands only (the corpus file is still prepared: the "
                      "rows' tree sizes come from its vocabulary)")
  p.add_argument("--acceptance", action="store_true",
                 help="then the planner's pick for the demo's model on this corpus "
                      "(real counts, cached rates) beside the measured rows, written to "
                      "OUT/acceptance.json (with --rows '': that alone)")
  args = p.parse_args(argv)
  rows = [r for r in args.rows.split(",") if r]
  unknown = [r for r in rows if r not in ROWS]
  if unknown or not (rows or args.acceptance):
    p.error(f"--rows takes rows of {', '.join(ROWS)}; got {unknown or 'none'}")
  allowed = sorted(os.sched_getaffinity(0))
  if args.cpu is None:
    args.cpu = allowed[-1]
  elif args.cpu >= 0 and args.cpu not in allowed:
    p.error(f"--cpu {args.cpu}: this process may run on CPUs {allowed} only")
  name = os.path.splitext(os.path.basename(args.corpus))[0]
  out = args.out or os.path.join("demo_results", "quality_runs", name)
  os.makedirs(out, exist_ok=True)
  corpus = corpus_file(args.corpus, out)
  vocab = len(training_counts(corpus)) if any("{cbrt}" in " ".join(ROWS[r][1])
                                         for r in rows) else 0
  for row in rows:
    cmd = command(row, corpus, out, vocab, None if args.cpu < 0 else args.cpu)
    print("$ " + " ".join(cmd), flush=True)
    if not args.dry_run:
      subprocess.run(cmd, check=True)
  if args.dry_run:
    return 0
  found, table = summary(out)
  with open(os.path.join(out, "summary.json"), "w") as f:
    json.dump(found, f, indent=2)
  with open(os.path.join(out, "summary.md"), "w") as f:
    f.write(table + "\n")
  print(table, flush=True)
  if args.acceptance:
    result = acceptance(corpus, out)
    with open(os.path.join(out, "acceptance.json"), "w") as f:
      json.dump(result, f, indent=2)
    print(result["table"], flush=True)
    for row in result["rows"]:
      print(f"{row['label']:22} whole step {row['whole_step_ms']:6.1f} ms, "
            f"perplexity {row['perplexity'] or '-'}, CPU s/epoch "
            f"{row['cpu_seconds_per_epoch'] or '-'}, cutoffs {row['cutoffs'] or ''}")
    print(f"pick: {result['pick']['label']}; fastest: {result['fastest']['label']}",
          flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
