"""The planner's quality evidence, re-made: `python -m tf_hsm.bench.quality_runs CORPUS`.

Trains the demo's word-level LSTM language model (`python -m tf_hsm.demo`: Embedding ->
LSTM(128) -> the output layer, LazyAdam 6e-3, batch 64 x 32, 3 epochs, the first 300K
tokens) once per output layer the planner has a row for, one process after another
(pinned to one CPU with `taskset -c CPU` where taskset exists), and prints each layer's
best held-out perplexity against full softmax's: the figures of
`tf_hsm.planning.quality.EVIDENCE` and docs/planner.md's quality table.

CORPUS is one of `tf_hsm.bench.corpora`'s (`stdlib`, `kjv`, `fortunes`, and the large
vocabularies `linux-comments`, `debian-docs` and `project-docs`, prepared as that module
says, once, in demo_results/corpora) or a path: a UTF-8 text file, as `python -m tf_hsm.demo --corpus`
takes it. The large corpora train on their whole text with every word seen twice in
training as a class (`--max-tokens 0 --vocab 10000000`, `corpora.LARGE`); the others at
the demo's defaults.

Each row writes OUT/ROW/results.json (the demo's; OUT is demo_results/quality_runs/CORPUS
unless --out says); OUT/summary.json and OUT/summary.md hold the table; `--acceptance`
adds the planner's pick for the demo's model (OUT/acceptance.json). `--rows` runs some rows only (a summary then covers those found in OUT,
so rows can be re-run one at a time); `--dry-run` prints the commands.
"""

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys

from tf_hsm.bench import corpora
from tf_hsm.bench.corpora import corpus_file

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
    # The planner's trees from vectors: the demo's learned tree with their head and
    # branching (it starts on the two-level tree and is rebuilt after epoch 1).
    "vectors32_head256": ("vectors32_head256", ["--models", "hsm", "--tree", "learned",
                                                "--head", "256", "--width", "32"]),
    "vectors64_head256": ("vectors64_head256", ["--models", "hsm", "--tree", "learned",
                                                "--head", "256", "--width", "64"]),
    # The planner's tree from the words' left contexts, built before training.
    "context32_head256": ("context32_head256", ["--models", "hsm", "--tree", "context",
                                                "--branching", "32", "--head", "256"]),
    # The planner's mixtures of the left- and right-context trees.
    "mixture32_head256": ("mixture32_head256", ["--models", "hsm", "--tree", "context",
                                                "--branching", "32", "--head", "256",
                                                "--mixture"]),
    "mixture16_head128": ("mixture16_head128", ["--models", "hsm", "--tree", "context",
                                                "--branching", "16", "--head", "128",
                                                "--mixture"]),
    "mixture3x16_head128": ("mixture3x16_head128", ["--models", "hsm", "--tree", "context",
                                                    "--branching", "16", "--head", "128",
                                                    "--mixture", "3"]),
    "mixture4x16_head128": ("mixture4x16_head128", ["--models", "hsm", "--tree", "context",
                                                    "--branching", "16", "--head", "128",
                                                    "--mixture", "4"]),
    # The same trees over the classes below one shared head (--shared-head).
    "mixture16_shared128": ("mixture16_shared128", [
        "--models", "hsm", "--tree", "context", "--branching", "16", "--head", "128",
        "--mixture", "--shared-head"]),
    "mixture3x16_shared128": ("mixture3x16_shared128", [
        "--models", "hsm", "--tree", "context", "--branching", "16", "--head", "128",
        "--mixture", "3", "--shared-head"]),
    "mixture4x16_shared128": ("mixture4x16_shared128", [
        "--models", "hsm", "--tree", "context", "--branching", "16", "--head", "128",
        "--mixture", "4", "--shared-head"]),
    # Each tree correcting the shared head at rank 16 (--head-rank).
    "mixture16_shared128_rank16": ("mixture16_shared128_rank16", [
        "--models", "hsm", "--tree", "context", "--branching", "16", "--head", "128",
        "--mixture", "--shared-head", "--head-rank", "16"]),
    "mixture3x16_shared128_rank16": ("mixture3x16_shared128_rank16", [
        "--models", "hsm", "--tree", "context", "--branching", "16", "--head", "128",
        "--mixture", "3", "--shared-head", "--head-rank", "16"]),
    "mixture4x16_shared128_rank16": ("mixture4x16_shared128_rank16", [
        "--models", "hsm", "--tree", "context", "--branching", "16", "--head", "128",
        "--mixture", "4", "--shared-head", "--head-rank", "16"]),
}
# Rows with a head of 128-256 frequent words over 16- to 64-ary nodes (one tree or a
# mixture of several): run by default only on
# a vocabulary larger than HEAD_ROWS_MIN_VOCAB (on a smaller one the head would hold
# nearly every word, and the row would measure another layout).
HEAD_ROWS = [r for r in ROWS if r.startswith(("vectors", "context", "mixture"))]
HEAD_ROWS_MIN_VOCAB = 256 + 64
# The rows run by default on a smaller vocabulary (`default_rows`).
DEFAULT_ROWS = [r for r in ROWS if r not in HEAD_ROWS]
# --time-steps: each row trains this many epochs of N batches (a learned tree rebuilt
# after the first, re-traced in the second), evaluated on the first TIMING_EVAL_TOKENS
# held-out tokens; the last epoch's CPU time is the step's at the corpus's vocabulary
# (the perplexities are not quality figures).
TIMING_EPOCHS, TIMING_EVAL_TOKENS = 3, 20_000


def corpus_settings(name):
  """The demo's --max-tokens and --vocab for corpus NAME: its defaults (the first 300K
  tokens, at most 10,000 words), or a large corpus's whole text and every word seen
  twice in training (`tf_hsm.bench.corpora.LARGE`)."""
  from tf_hsm.demo import run  # pylint: disable=g-import-not-at-top
  return corpora.LARGE.get(name, {"max_tokens": run.DEFAULTS["max_tokens"],
                                  "vocab": run.DEFAULTS["vocab"]})


def training_counts(corpus, settings=None):
  """The class counts of the demo's vocabulary (by the demo's ids) at SETTINGS
  (`corpus_settings`; default: the demo's)."""
  from tf_hsm.demo import run  # pylint: disable=g-import-not-at-top
  settings = settings or corpus_settings(None)
  documents = run.file_documents(corpus) if corpus else run.stdlib_documents()
  train, _ = run.split_corpus(documents, settings["max_tokens"], run.DEFAULTS["seed"])
  _, counts = run.build_vocab(train, settings["vocab"], run.DEFAULTS["min_count"])
  return counts


def default_rows(vocab):
  """The rows `--rows` runs by default on a vocabulary of `vocab` classes: every row,
  the HEAD_ROWS only above HEAD_ROWS_MIN_VOCAB."""
  return list(ROWS) if vocab > HEAD_ROWS_MIN_VOCAB else list(DEFAULT_ROWS)


def command(row, corpus, out, vocab, cpu, settings=None, time_steps=None):
  args = [a.replace("{cbrt}", str(max(2, math.ceil(vocab ** (1 / 3) - 1e-9))))
          for a in ROWS[row][1]]
  cmd = [sys.executable, "-m", "tf_hsm.demo", *args, "--quiet",
         "--out", os.path.join(out, row)]
  if corpus:
    cmd += ["--corpus", corpus]
  if settings and settings != corpus_settings(None):
    cmd += ["--max-tokens", str(settings["max_tokens"]), "--vocab", str(settings["vocab"])]
  if time_steps:
    cmd += ["--steps-per-epoch", str(time_steps), "--epochs", str(TIMING_EPOCHS),
            "--eval-tokens", str(TIMING_EVAL_TOKENS)]
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
    # The demo's figure: the median of the epochs after the first (tracing); a timing
    # run's last epoch of --steps-per-epoch batches (after tracing and a rebuild's
    # re-tracing), scaled to the whole split's.
    per_epoch = statistics.median(cpu[1:] if len(cpu) > 1 else cpu)
    steps = result["settings"].get("steps_per_epoch")
    if steps and result.get("train_batches_per_epoch"):
      per_epoch = cpu[-1] * result["train_batches_per_epoch"] / steps
    rows.append({
        "row": row, "kind": ROWS[row][0], "model": model["name"],
        "vocab_size": result["vocab_size"], "perplexity_per_epoch": ppl,
        "best": min(ppl), "ratio": None if full is None else min(ppl) / full,
        "cpu_seconds_per_epoch": per_epoch, "timed_steps": steps,
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
                 + f" | {r['best']:.1f} | {ratio} | {r['cpu_seconds_per_epoch']:.1f}"
                 + ("*" if r["timed_steps"] else "") + " | "
                 f"{layout} |")
  return rows, "\n".join(lines)


def acceptance(corpus, out, settings=None):
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
  counts = np.sort(training_counts(corpus, settings))[::-1]
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
  p.add_argument("corpus", help=", ".join(corpora.NAMES) + " or a UTF-8 text file")
  p.add_argument("--rows", default=None,
                 help="comma-separated rows to run, of " + ", ".join(ROWS) +
                      " (default: all; the vectors and context rows only on a "
                      f"vocabulary of more than {HEAD_ROWS_MIN_VOCAB} words)")
  p.add_argument("--max-tokens", type=int, default=None,
                 help="the corpus's first N tokens (default: the demo's 300K, the whole "
                      "text for a large corpus)")
  p.add_argument("--time-steps", type=int, default=None,
                 help="a timing run: each row trains %d epochs of N batches (evaluated on "
                      "%d held-out tokens); the summary's CPU s/epoch scales the last "
                      "epoch's to the whole split" % (TIMING_EPOCHS, TIMING_EVAL_TOKENS))
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
  rows = None if args.rows is None else [r for r in args.rows.split(",") if r]
  unknown = [r for r in rows or () if r not in ROWS]
  if unknown or not (rows is None or rows or args.acceptance):
    p.error(f"--rows takes rows of {', '.join(ROWS)}; got {unknown or 'none'}")
  allowed = sorted(os.sched_getaffinity(0))
  if args.cpu is None:
    args.cpu = allowed[-1]
  elif args.cpu >= 0 and args.cpu not in allowed:
    p.error(f"--cpu {args.cpu}: this process may run on CPUs {allowed} only")
  name = os.path.splitext(os.path.basename(args.corpus))[0]
  out = args.out or os.path.join("demo_results", "quality_runs", name)
  os.makedirs(out, exist_ok=True)
  # A large corpus is prepared once, where `python -m tf_hsm.bench.corpora` writes it.
  corpus = corpus_file(args.corpus, corpora.DEFAULT_OUT if args.corpus in corpora.LARGE
                       else out)
  settings = dict(corpus_settings(args.corpus))
  if args.max_tokens is not None:
    settings["max_tokens"] = args.max_tokens
  vocab = len(training_counts(corpus, settings)) if rows is None or any(
      "{cbrt}" in " ".join(ROWS[r][1]) for r in rows) else 0
  if rows is None:
    rows = default_rows(vocab)
  for row in rows:
    cmd = command(row, corpus, out, vocab, None if args.cpu < 0 else args.cpu, settings,
                  args.time_steps)
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
    result = acceptance(corpus, out, settings)
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
