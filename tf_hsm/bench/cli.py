"""Benchmark tf_hsm against what TensorFlow users write today.

    python -m tf_hsm.bench                       # scenarios A-E, topk, mem of docs/performance.md
    python -m tf_hsm.bench --quick               # all of them, small, in a few minutes
    python -m tf_hsm.bench --scenario B --methods gather map_fn --repeats 20
    python -m tf_hsm.bench --custom 50000,128,512 --trees two_level huffman

For every scenario x vocabulary x tree x token count (a "case"):
* each method is first run once in its own subprocess to measure its peak RSS
  (VmHWM; the process's RSS after importing TF and building inputs is reported too), under
  an RSS watchdog (--memory-limit-gb) and a time-out: out-of-memory and time-outs become
  results ("OOM", "timeout"), never a crash of the bench;
* the methods that fit are then timed in one process, interleaved round-robin so that
  noise hits all of them alike: forward and forward+backward (+ optimizer step), median
  and IQR over --repeats runs after warm-up, each call a tf.function whose outputs are
  read on the host (the Keras method's step is `train_on_batch`, as a user calls it);
  plus tokens/s, achieved GFLOP/s and GB/s by docs/performance.md's formulas, the fraction
  of the roofline given the matmul rate and memory bandwidth measured in the same
  process, and the speed-up of tf_hsm over every baseline.

Writes bench.md (also printed), bench.json and bench.png (log-log time per token against V)
to --out.
"""

import argparse
import dataclasses
import os
import shutil
import sys
import tempfile
import time

from tf_hsm.bench import report as report_lib
from tf_hsm.bench import runner
from tf_hsm.bench import cases
from tf_hsm.bench.watchdog import GB, limit_gb_or_default


def _split(values):
  out = []
  for value in values or []:
    out.extend(v for v in value.replace(",", " ").split() if v)
  return out


def parse_args(argv):
  p = argparse.ArgumentParser(
      prog="python -m tf_hsm.bench", description=__doc__.split("\n\n")[0],
      formatter_class=argparse.RawDescriptionHelpFormatter,
      epilog="scenarios: " + "; ".join(
          f"{n}: V={','.join(cases.fmt_count(v) for v in s.vocab)} D={s.dim} "
          f"T={','.join(map(str, s.tokens))} trees={','.join(s.trees)}"
          for n, s in cases.FULL_SCENARIOS.items()) +
      "; custom: --custom V,D,T with --trees")
  p.add_argument("--scenario", action="append", nargs="+", metavar="NAME",
                 help=f"scenarios to run (default: all of {', '.join(cases.FULL_SCENARIOS)})")
  p.add_argument("--quick", action="store_true",
                 help="small sizes, few repeats: every scenario in a few minutes")
  p.add_argument("--repeats", type=int, help="timed runs per method (default 15; quick 10)")
  p.add_argument("--methods", action="append", nargs="+", metavar="METHOD",
                 help=f"methods to run, of {', '.join(cases.ALL_METHODS)} "
                      "(tf_hsm is always included as the reference)")
  p.add_argument("--trees", action="append", nargs="+", metavar="TREE",
                 help=f"restrict trees to these kinds, of {', '.join(cases.TREE_LABELS)}")
  p.add_argument("--custom", metavar="V,D,T",
                 help="adds scenario 'custom' with these sizes (trees from --trees, "
                      "default two_level)")
  p.add_argument("--optimizer", default="none",
                 choices=("none",) + tuple(cases.OPTIMIZER_SLOTS),
                 help="also apply this optimizer in the timed fwd+bwd step (Keras "
                      "optimizers; sparse_sgd, lazy_adam and sparse_adagrad from "
                      "tf_hsm.optimizers; the _momentum forms with momentum 0.9)")
  p.add_argument("--dtype", choices=tuple(cases.DTYPES), default="float32",
                 help="type of the tables and hidden states, and of the matmul and read "
                      "that measure the machine's ceilings (default float32)")
  p.add_argument("--num-sampled", type=int, default=1024,
                 help="negative classes of sampled softmax (default 1024)")
  p.add_argument("--out", default="bench_results", help="output directory")
  p.add_argument("--memory-limit-gb", type=float,
                 help="RSS limit per child process (default: 18, or less when the machine "
                      "has less available)")
  p.add_argument("--timeout", type=float,
                 help="seconds per child process (default 1800; quick 120)")
  p.add_argument("--time-budget", type=float,
                 help="seconds of timed runs per method and case; slower methods are "
                      "reported as 'timeout' (default 300; quick 3)")
  p.add_argument("--jobs", type=int,
                 help="memory probes run at once, sharing the memory limit (default 1; "
                      "quick 2)")
  p.add_argument("--no-memory", action="store_true",
                 help="skip the per-method peak-memory subprocesses")
  p.add_argument("--spawn", choices=("fork", "exec"), default="fork",
                 help="how worker processes start: fork this process (TF imported, no op "
                      "run yet; fast) or exec a fresh interpreter (default fork)")
  p.add_argument("--no-plot", action="store_true")
  p.add_argument("--seed", type=int, default=1234)
  args = p.parse_args(argv)
  args.scenario = _split(sum(args.scenario or [], []))
  args.methods = _split(sum(args.methods or [], []))
  args.trees = _split(sum(args.trees or [], []))
  for name in args.scenario:
    if name not in cases.SCENARIO_NAMES:
      p.error(f"unknown scenario {name!r}; known: {', '.join(cases.SCENARIO_NAMES)}")
  for name in args.methods:
    if name not in cases.ALL_METHODS:
      p.error(f"unknown method {name!r}; known: {', '.join(cases.ALL_METHODS)}")
  for name in args.trees:
    if name not in cases.TREE_LABELS:
      p.error(f"unknown tree {name!r}; known: {', '.join(cases.TREE_LABELS)}")
  if args.custom:
    try:
      v, d, t = (int(x) for x in args.custom.split(","))
    except ValueError:
      p.error("--custom takes V,D,T, e.g. 50000,128,512")
    if min(v, d, t) < 1:
      p.error("--custom sizes must be positive")
    args.custom = (v, d, t)
    for name in args.trees:
      if v < cases.TREE_MIN_CLASSES.get(name, 1):
        p.error(f"--custom V={v}: tree {name} needs at least "
                f"{cases.TREE_MIN_CLASSES[name]} classes")
    if "custom" not in args.scenario:
      args.scenario.append("custom")
  elif "custom" in args.scenario:
    p.error("scenario 'custom' needs --custom V,D,T")
  if args.repeats is not None and args.repeats < 1:
    p.error("--repeats must be >= 1")
  return args


def _scenarios(args):
  table = cases.QUICK_SCENARIOS if args.quick else cases.FULL_SCENARIOS
  names = args.scenario or list(cases.FULL_SCENARIOS)
  out = []
  for name in names:
    if name == "custom":
      v, d, t = args.custom
      sc = cases.Scenario("custom", "train", (v,), d, (t,), tuple(args.trees or ["two_level"]))
    else:
      sc = table[name]
      if args.trees:
        trees = tuple(k for k in sc.trees if k in args.trees) or tuple(args.trees)
        sc = dataclasses.replace(sc, trees=trees)
    out.append(sc)
  return out


def _machine(cpuinfo="/proc/cpuinfo", meminfo="/proc/meminfo"):
  """The CPU, cores and memory, for the report's first line. Virtual machines often name
  the CPU only by its brand ("AMD EPYC"), so the family and model numbers and the widest
  vector extension follow the name: machines of one name but another generation then
  read apart."""
  fields = {}
  try:
    with open(cpuinfo) as f:
      for line in f:
        if not line.strip():
          break  # the first processor's entry is enough
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
  except OSError:
    pass
  model = fields.get("model name", "unknown CPU")
  details = []
  if "cpu family" in fields and "model" in fields:
    details.append(f"family {fields['cpu family']}, model {fields['model']}")
  flags = fields.get("flags", "").split()
  if flags:
    details.append("AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags
                   else "no AVX2")
  if details:
    model += f" ({'; '.join(details)})"
  total = None
  try:
    with open(meminfo) as f:
      total = int(f.readline().split()[1]) * 1024
  except (OSError, ValueError, IndexError):
    pass
  mem = f", {total / 2**30:.0f} GiB RAM" if total else ""
  return f"{model}, {os.cpu_count()} cores{mem}"


def options_from_args(args):
  """The run's Options: the command line's values, else the defaults (--quick's or the
  full run's); the memory limit defaults to 18 GB, less on a machine with less free."""
  quick = args.quick
  limit_gb = limit_gb_or_default(args.memory_limit_gb)
  return runner.Options(
      quick=quick, repeats=args.repeats or (10 if quick else 15),
      optimizer=args.optimizer, num_sampled=args.num_sampled, seed=args.seed,
      limit_bytes=limit_gb * GB, timeout_s=args.timeout or (120 if quick else 1800),
      time_budget_s=args.time_budget or (3 if quick else 300),
      jobs=max(1, args.jobs or (2 if quick else 1)), memory=not args.no_memory,
      spawn=args.spawn, dtype=args.dtype)


def main(argv=None):
  args = parse_args(sys.argv[1:] if argv is None else argv)
  wall_start = time.monotonic()
  quick = args.quick
  opts = options_from_args(args)
  limit_gb = opts.limit_bytes / GB

  def progress(message):
    print(message, file=sys.stderr, flush=True)

  os.makedirs(args.out, exist_ok=True)
  paths = {ext: os.path.join(args.out, f"bench.{ext}") for ext in ("json", "md", "png")}
  workdir = tempfile.mkdtemp(prefix="tf_hsm_bench_")
  try:
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    from tf_hsm.bench import methods  # pylint: disable=import-outside-toplevel
    available = {"top_k": methods.top_k_available(),
                 "sgd_step": methods.fused_sgd_available(),
                 "adam_step": methods.fused_adam_available()}
    report = {"meta": {
        "argv": sys.argv[1:] if argv is None else list(argv), "quick": quick,
        "machine": _machine(), "tf_version": tf.__version__,
        "optimizer": opts.optimizer, "dtype": opts.dtype, "repeats": opts.repeats,
        "num_sampled": opts.num_sampled, "memory_limit_gb": limit_gb,
        "probe_memory_limit_gb": limit_gb / opts.jobs, "time_budget_s": opts.time_budget_s,
        "timeout_s": opts.timeout_s, "available": available,
        "started": time.strftime("%Y-%m-%d %H:%M:%S")}, "cases": []}
    scenarios = _scenarios(args)
    case_list = runner.expand_cases(scenarios, args, workdir, opts)
    progress(f"tf_hsm bench: {len(case_list)} cases, memory limit {limit_gb:.1f} GB per "
             f"process, {opts.repeats} repeats")
    runner.prepare_trees(case_list, workdir, opts, progress)
    for i, case in enumerate(case_list):
      progress(f"[{i + 1}/{len(case_list)}] {report_lib.case_title(case)}: "
               f"{', '.join(case['methods'])}")
      try:
        runner.run_case(case, workdir, opts, progress, available)
      except Exception as e:  # pylint: disable=broad-except
        case["error"] = f"bench error: {type(e).__name__}: {e}"
        progress("    " + case["error"])
        if not isinstance(case["methods"], dict):
          case["methods"] = {m: {"status": "error"} for m in case["methods"]}
      case.pop("tree_path", None)
      report["cases"].append(case)
      report_lib.write_json(report, paths["json"])
    report["meta"]["wall_s"] = time.monotonic() - wall_start
    text = report_lib.markdown(report)
    with open(paths["md"], "w") as f:
      f.write(text + "\n")
    report_lib.write_json(report, paths["json"])
    if not args.no_plot:
      report_lib.plot(report, paths["png"])
    print(text)
    progress(f"wrote {', '.join(p for k, p in paths.items() if k != 'png' or not args.no_plot)}"
             f" in {report['meta']['wall_s']:.0f} s")
  finally:
    shutil.rmtree(workdir, ignore_errors=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())

