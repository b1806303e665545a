"""Benchmark tf_hsm against what TensorFlow users write today.

    python -m tf_hsm.bench                       # scenarios A-E, topk, mem of PERFORMANCE.md
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
  plus tokens/s, achieved GFLOP/s and GB/s by PERFORMANCE.md's formulas, the fraction
  of the roofline given the matmul rate and memory bandwidth measured in the same
  process, and the speed-up of tf_hsm over every baseline.

Writes bench.md (also printed), bench.json and bench.png (log-log time per token against V)
to --out.
"""

import argparse
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from tf_hsm import _bench_report as report_lib
from tf_hsm import _bench_setup as setup

GB = 1e9
_PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Trees up to this many classes are built in the driver; larger ones in a watched child.
_IN_PROCESS_TREE_CLASSES = 2_000_000


# --------------------------------------------------------------------------- #
# Child processes under an RSS watchdog
# --------------------------------------------------------------------------- #


def _rss_bytes(pid):
  try:
    with open(f"/proc/{pid}/status") as f:
      for line in f:
        if line.startswith("VmRSS:"):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  return None


def _mem_available_bytes():
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  return None


class Child:
  """One worker job, killed when its RSS passes `limit_bytes` or it runs longer than
  `timeout_s`.

  spawn="fork": a fork of this process runs `_bench_worker.main` (this process imported
  TensorFlow but never ran an op, so the child starts TF's runtime fresh) — saves the
  seconds of importing TF per job. spawn="exec": a new interpreter,
  `python -m tf_hsm._bench_worker SPEC`.
  """

  def __init__(self, spec, workdir, limit_bytes, timeout_s, label, spawn="fork"):
    self.label = label
    self.limit, self.timeout = limit_bytes, timeout_s
    fd, self.spec_path = tempfile.mkstemp(suffix=".json", dir=workdir)
    self.result_path = self.spec_path[:-5] + ".result.json"
    self.log_path = self.spec_path[:-5] + ".log"
    with os.fdopen(fd, "w") as f:
      json.dump(dict(spec, result_path=self.result_path), f)
    self.start = time.monotonic()
    self.max_rss = 0
    self.killed_for = None
    self.result = None
    self.returncode = None
    if spawn == "fork":
      self.pid = self._fork()
    else:
      env = dict(os.environ)
      env["PYTHONPATH"] = os.pathsep.join(
          [_PACKAGE_PARENT] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
      env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
      with open(self.log_path, "w") as log:
        self._popen = subprocess.Popen(
            [sys.executable, "-m", "tf_hsm._bench_worker", self.spec_path],
            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=_PACKAGE_PARENT)
      self.pid = self._popen.pid

  def _fork(self):
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
      return pid
    code = 1
    try:  # The child: never returns into the driver.
      fd = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
      os.dup2(fd, 1)
      os.dup2(fd, 2)
      os.close(fd)
      from tf_hsm import _bench_worker  # pylint: disable=import-outside-toplevel
      _bench_worker.main([_bench_worker.__file__, self.spec_path])
      code = 0
    except BaseException:  # pylint: disable=broad-except
      import traceback  # pylint: disable=import-outside-toplevel
      traceback.print_exc()
    finally:
      try:
        sys.stdout.flush()
        sys.stderr.flush()
      finally:
        os._exit(code)  # pylint: disable=protected-access

  def poll(self):
    """Checks the child once; returns its result dict when it has ended, else None."""
    if self.result is not None:
      return self.result
    pid, status, usage = os.wait4(self.pid, os.WNOHANG)
    if pid == 0:
      rss = _rss_bytes(self.pid)
      if rss is not None:
        self.max_rss = max(self.max_rss, rss)
        if rss > self.limit and self.killed_for is None:
          self.killed_for = ("OOM", f"RSS {rss / GB:.2f} GB passed the limit "
                                    f"{self.limit / GB:.2f} GB")
          self._kill()
      if (time.monotonic() - self.start > self.timeout and self.killed_for is None):
        self.killed_for = ("timeout", f"no result after {self.timeout:.0f} s")
        self._kill()
      return None
    self.returncode = os.waitstatus_to_exitcode(status)
    if hasattr(self, "_popen"):
      self._popen.returncode = self.returncode
    self.result = self._collect(usage.ru_maxrss * 1024)
    return self.result

  def _kill(self):
    try:
      os.kill(self.pid, signal.SIGKILL)
    except ProcessLookupError:
      pass

  def _log_tail(self, chars=3000):
    """The end of the child's output, without TF's start-up chatter."""
    try:
      with open(self.log_path, errors="replace") as f:
        text = f.read()
    except OSError:
      return ""
    noise = ("cuda", "Extension modules:", "oneDNN", "cpu_feature_guard", "To enable the",
             "absl::InitializeLog")
    lines = [l for l in text.splitlines()
             if l.strip() and not any(n.lower() in l.lower() for n in noise)]
    return "\n".join(lines)[-chars:]

  def _collect(self, child_maxrss):
    seconds = time.monotonic() - self.start
    if self.killed_for is not None:
      status, message = self.killed_for
      result = {"status": status, "message": message}
    elif os.path.exists(self.result_path):
      with open(self.result_path) as f:
        result = json.load(f)
    else:
      code = self.returncode
      tail = self._log_tail()
      oom_words = ("bad_alloc", "out of memory", "resource_exhausted", "oom")
      if code == -signal.SIGKILL or any(w in tail.lower() for w in oom_words):
        result = {"status": "OOM", "message": f"killed (exit {code}); likely the kernel "
                                              "OOM killer or an allocation failure"}
      else:
        last = tail.splitlines()[-1] if tail else ""
        result = {"status": "error", "message": f"worker exited with {code}: {last[-200:]}"}
    result["wall_s"] = seconds
    result["watchdog_max_rss"] = self.max_rss
    result["child_maxrss"] = child_maxrss
    if result.get("status") == "error" and "log_tail" not in result:
      result["log_tail"] = self._log_tail()
    return result


def run_children(specs, workdir, limit_bytes, timeout_s, jobs, progress, spawn):
  """Runs the specs, `jobs` at a time, each under the watchdog; results in order."""
  pending = list(enumerate(specs))
  running, results = [], [None] * len(specs)
  while pending or running:
    while pending and len(running) < jobs:
      i, (label, spec, timeout) = pending.pop(0)
      running.append((i, Child(spec, workdir, limit_bytes, timeout or timeout_s, label,
                                spawn)))
    time.sleep(0.02)
    for item in list(running):
      i, child = item
      result = child.poll()
      if result is not None:
        results[i] = result
        running.remove(item)
        progress(f"    {child.label}: {result.get('status')} "
                 f"({result['wall_s']:.1f} s{_peak_note(result)})")
  return results


def _peak_note(result):
  peak = result.get("peak_rss")
  return f", peak RSS {peak / GB:.2f} GB" if peak else ""


# --------------------------------------------------------------------------- #
# Cases
# --------------------------------------------------------------------------- #


@dataclasses.dataclass
class Options:
  quick: bool
  repeats: int
  optimizer: str
  num_sampled: int
  seed: int
  limit_bytes: float
  timeout_s: float
  time_budget_s: float
  jobs: int
  memory: bool
  spawn: str
  dtype: str = "float32"


def min_memory_estimate(method, case):
  """A lower bound of a method's memory for one fwd+bwd step (tables, gradients and the
  largest intermediates that must coexist), to skip runs that cannot fit."""
  d, t, v = case["dim"], case["tokens"], case["vocab"]
  tree = case["tree_summary"]
  s, depth, branching = tree["num_slots"], tree["max_depth"], tree["max_branching"]
  e = setup.itemsize(case)
  table = setup.table_bytes(method, v, s, d, e)
  if method == "full_softmax":
    return 2 * table + 2 * e * t * v            # table, dense gradient, logits, their grad
  if method == "dense_tree":
    return 2 * table + 2 * e * t * s
  if method in ("gather", "embedding_lookup"):
    return table + 2 * e * t * depth * branching * d   # gathered rows and their gradient
  if method == "dense_top_k":
    return table + e * t * v
  return table


def expand_cases(scenarios, args, tree_dir, opts):
  """Lists every case (scenario x vocabulary x tree x token count) and its methods."""
  cases = []
  for sc in scenarios:
    for v in sc.vocab:
      for kind in sc.trees:
        tree_path = os.path.join(tree_dir, f"{kind}_{v}.npz")
        base = {"scenario": sc.name, "kind": sc.kind, "vocab": v, "dim": sc.dim,
                "tree": kind, "tree_path": tree_path, "seed": opts.seed, "dtype": opts.dtype,
                "num_sampled": opts.num_sampled, "k": setup.TOPK_K, "note": sc.note}
        methods = list(sc.methods)
        # The fused SGD step and the Keras step are training methods of every training
        # scenario when asked for by name (the fused step also when --optimizer sgd
        # implies it); E lists both by default.
        if sc.kind == "train":
          wanted = [m for m in setup.EXTRA_TRAIN_METHODS if m in (args.methods or ())]
          if opts.optimizer == "sgd" and setup.FUSED_SGD not in wanted:
            wanted.insert(0, setup.FUSED_SGD)
          for m in reversed(wanted):
            if m not in methods:
              methods.insert(1, m)   # next to tf_hsm, whose variants they are
        methods = [m for m in methods if not args.methods or m in args.methods]
        if sc.kind != "topk" and "tf_hsm" not in methods:
          methods.insert(0, "tf_hsm")   # the reference for every speed-up
        if not methods:
          continue
        for t in sc.tokens:
          cases.append(dict(base, tokens=t, methods=methods))
  return cases


def prepare_trees(cases, workdir, opts, progress):
  """Builds every tree once (large ones in a watched child) and counts each case's work."""
  by_tree = {}
  for case in cases:
    by_tree.setdefault((case["tree"], case["vocab"], case["tree_path"]), []).append(case)
  for (kind, v, path), group in by_tree.items():
    tokens = sorted({c["tokens"] for c in group})
    start = time.monotonic()
    if v <= _IN_PROCESS_TREE_CLASSES:
      tree, summary = setup.prepare_tree(kind, v, path)
      work = {str(t): setup.case_work(tree, v, t, opts.seed, opts.num_sampled)
              for t in tokens}
      del tree  # forked workers would carry it in their RSS
      result = {"status": "ok", "tree_summary": summary, "work": work}
    else:
      spec = {"mode": "prepare", "tree": kind, "vocab": v, "tree_path": path,
              "seed": opts.seed, "num_sampled": opts.num_sampled, "token_counts": tokens}
      result = run_children([(f"tree {kind} V={v}", spec, None)], workdir,
                            opts.limit_bytes, opts.timeout_s, 1, progress, opts.spawn)[0]
    progress(f"  tree {setup.TREE_LABELS.get(kind, kind)} V={setup.fmt_count(v)}: "
             f"{result['status']} ({time.monotonic() - start:.1f} s)")
    for case in group:
      if result["status"] == "ok":
        case["tree_summary"] = result["tree_summary"]
        case["work"] = result["work"][str(case["tokens"])]
      else:
        case["error"] = (f"tree build {result['status']}: {result.get('message', '')}")


def _spec(case, opts, mode, methods):
  keys = ("scenario", "kind", "vocab", "dim", "tokens", "tree", "tree_path", "seed",
          "num_sampled", "k", "dtype")
  spec = {key: case[key] for key in keys}
  spec.update(mode=mode, methods=list(methods), optimizer=opts.optimizer,
              repeats=opts.repeats, time_budget_s=opts.time_budget_s, quick=opts.quick,
              memory_limit_bytes=opts.limit_bytes)
  return spec


def _child_timeout(case, methods, opts, work_s):
  """Seconds a child gets: `work_s` plus an allowance for loading the tree and filling the
  tables (~10 s per GB or per million classes on this machine kind), at most --timeout."""
  tree = case.get("tree_summary") or {}
  tables = sum(setup.table_bytes(m, case["vocab"], tree.get("num_slots", case["vocab"]),
                                 case["dim"], setup.itemsize(case)) for m in methods)
  allowance = 60 + 10 * tables / GB + 10 * case["vocab"] / 1e6
  return min(opts.timeout_s, work_s + allowance)


def plan_timing_groups(case, runnable, rows, opts):
  """Packs the methods into few timing processes that fit the memory limit (one, unless
  the tables are large), keeping the given order within each.

  A group's estimate is conservative: the largest set-up RSS of its members' probes, plus
  the tables that set-up did not hold (one per table kind for methods that only read it,
  one per method for methods that update theirs), plus every member's growth over its
  set-up. Without probes (--no-memory) the estimate is the group's tables alone, a lower
  bound, so only tables that cannot fit together are split up front; `time_group`'s retry
  splits what else runs out of memory.
  """
  mems = {m: rows[m].get("memory") or {} for m in runnable}
  if len(runnable) < 2:
    return [runnable] if runnable else []
  probed = all(mem.get("status") == "ok" for mem in mems.values())
  v, d = case["vocab"], case["dim"]
  s = case["tree_summary"]["num_slots"]

  def table_key(m):
    by_class = m in setup.CLASS_TABLE_METHODS
    return (by_class, m if setup.mutates_table(m, case["kind"], opts.optimizer) else None)

  def estimate(group):
    tables = {table_key(m): setup.table_bytes(m, v, s, d, setup.itemsize(case)) for m in group}
    if not probed:
      return sum(tables.values())
    largest = max(group, key=lambda m: mems[m]["baseline_rss"])
    tables.pop(table_key(largest))
    return (mems[largest]["baseline_rss"] + sum(tables.values()) +
            sum(mems[m]["peak_rss"] - mems[m]["baseline_rss"] for m in group))

  # First fit: a method joins the first group it fits beside, so that methods sharing a
  # table (tf_hsm and nll_loss) are timed side by side wherever the order puts them.
  groups = []
  for m in runnable:
    fitting = next((g for g in groups if estimate(g + [m]) <= opts.limit_bytes), None)
    if fitting is None:
      groups.append([m])
    else:
      fitting.append(m)
  return groups


def time_group(case, methods, rows, workdir, opts, progress):
  """Times `methods` in one process. If that process runs out of memory, the hungriest
  method is set aside and the rest are timed again; the methods set aside are then timed
  in a process of their own (the same way), so that a method is reported out of memory
  only when it does not fit alone, not when it merely did not fit beside the others."""
  remaining = list(methods)
  set_aside = []
  while remaining:
    timeout = _child_timeout(case, remaining, opts, 3 * opts.time_budget_s * len(remaining))
    spec = _spec(case, opts, "time", remaining)
    timing = run_children([("timing " + ",".join(remaining), spec, timeout)], workdir,
                          opts.limit_bytes, timeout, 1, progress, opts.spawn)[0]
    if timing["status"] == "ok":
      if not case.get("ceilings"):
        case["ceilings"] = timing["ceilings"]
      case.setdefault("ceiling_runs", []).extend(timing.get("ceiling_runs") or [])
      case["tf_version"] = timing.get("tf_version")
      case.setdefault("timing_phases", []).append(
          dict(timing.get("phases") or {}, wall_s=timing.get("wall_s"), methods=remaining,
               max_rss=timing.get("watchdog_max_rss")))
      for name, res in timing["methods"].items():
        info = dict(rows[name].get("info") or {}, **(res.pop("info", None) or {}))
        rows[name].update(res)
        if info:
          rows[name]["info"] = info
      break

    if len(remaining) == 1:
      rows[remaining[0]].update(status=timing["status"], message=timing.get("message", ""))
      break
    case.setdefault("timing_failures", []).append(
        {k: timing.get(k) for k in ("status", "message", "log_tail", "traceback")})
    if timing["status"] != "OOM":
      # A crash or time-out of the shared process: give every method a process of its own.
      case["timing_note"] = (f"the shared timing process failed ({timing['status']}: "
                             f"{timing.get('message', '')[:120]}); methods timed one by one")
      for name in remaining:
        time_group(case, [name], rows, workdir, opts, progress)
      break

    def hunger(name):
      mem = rows[name].get("memory") or {}
      return mem.get("peak_rss") or min_memory_estimate(name, case)

    # Of equally hungry methods the last is set aside, so that the reference (tf_hsm, the
    # first) keeps as many methods beside it as fit.
    worst = max(reversed(remaining), key=hunger)
    remaining.remove(worst)
    set_aside.append(worst)

  if set_aside:
    timed_with = [m for m in methods if m not in set_aside]
    note = (f"{', '.join(set_aside)} timed apart from {', '.join(timed_with)}: the shared "
            "timing process ran out of memory")
    case["timing_note"] = f"{case['timing_note']}; {note}" if case.get("timing_note") else note
    time_group(case, set_aside, rows, workdir, opts, progress)


def run_case(case, workdir, opts, progress, available):
  """Probes and times every method of one case; fills case["methods"]."""
  rows = {name: {"status": "ok"} for name in case["methods"]}
  case["methods"] = rows
  if case.get("error"):
    for row in rows.values():
      row.update(status="skipped", message=case["error"])
    return
  # Methods that cannot run at all.
  runnable = []
  for name, row in rows.items():
    if name == "tf_hsm_top_k" and not available["top_k"]:
      row.update(status="skipped", message="tf_hsm.inference.top_k not available")
      continue
    if name == setup.FUSED_SGD and not available["sgd_step"]:
      row.update(status="skipped", message="tf_hsm.sgd_step not available")
      continue
    need = min_memory_estimate(name, case)
    if need > opts.limit_bytes:
      row.update(status="OOM", message=f"not run: needs ≥ {need / GB:.1f} GB "
                                       f"> limit {opts.limit_bytes / GB:.1f} GB")
      row["memory"] = {"status": "OOM", "estimated_min_bytes": need}
      continue
    runnable.append(name)
  # Peak memory, one subprocess per method.
  if opts.memory and runnable:
    specs = [(f"{name} memory", _spec(case, opts, "probe", [name]),
              _child_timeout(case, [name], opts, opts.time_budget_s)) for name in runnable]
    # The memory scenario's verdict is about a whole training process: a fresh one.
    spawn = "exec" if case["kind"] == "mem" else opts.spawn
    probes = run_children(specs, workdir, opts.limit_bytes / opts.jobs, opts.timeout_s,
                          opts.jobs, progress, spawn)
    for name, probe in zip(list(runnable), probes):
      probe["table_bytes"] = setup.table_bytes(name, case["vocab"],
                                               case["tree_summary"]["num_slots"], case["dim"],
                                               setup.itemsize(case))
      rows[name]["memory"] = probe
      if probe.get("info"):
        rows[name]["info"] = probe["info"]
      if probe["status"] != "ok":
        rows[name].update(status=probe["status"], message=probe.get("message", ""))
        runnable.remove(name)
      elif probe["first_call_s"] > 2 * opts.time_budget_s + 30:  # + tracing, start-up
        rows[name].update(status="timeout", message=(
            f"one call took {probe['first_call_s']:.3g} s in the memory probe, more than "
            f"the time budget of {opts.time_budget_s:.0f} s for {opts.repeats} repeats"))
        runnable.remove(name)
  # Timing: the methods that fit in one process, round-robin.
  groups = plan_timing_groups(case, runnable, rows, opts)
  if len(groups) > 1:
    case["timing_note"] = ("timed in " + " + ".join("{" + ", ".join(g) + "}" for g in groups)
                           + ": their tables together exceed the memory limit")
  for group in groups:
    time_group(case, group, rows, workdir, opts, progress)
  for name, row in rows.items():
    report_lib.summarize_method(case, name, row,
                                setup.step_optimizer(case["kind"], name, opts.optimizer))
  report_lib.add_speedups(case)


# --------------------------------------------------------------------------- #
# Command line
# --------------------------------------------------------------------------- #


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
          f"{n}: V={','.join(setup.fmt_count(v) for v in s.vocab)} D={s.dim} "
          f"T={','.join(map(str, s.tokens))} trees={','.join(s.trees)}"
          for n, s in setup.FULL_SCENARIOS.items()) +
      "; custom: --custom V,D,T with --trees")
  p.add_argument("--scenario", action="append", nargs="+", metavar="NAME",
                 help=f"scenarios to run (default: all of {', '.join(setup.FULL_SCENARIOS)})")
  p.add_argument("--quick", action="store_true",
                 help="small sizes, few repeats: every scenario in a few minutes")
  p.add_argument("--repeats", type=int, help="timed runs per method (default 15; quick 10)")
  p.add_argument("--methods", action="append", nargs="+", metavar="METHOD",
                 help=f"methods to run, of {', '.join(setup.ALL_METHODS)} "
                      "(tf_hsm is always included as the reference)")
  p.add_argument("--trees", action="append", nargs="+", metavar="TREE",
                 help=f"restrict trees to these kinds, of {', '.join(setup.TREE_LABELS)}")
  p.add_argument("--custom", metavar="V,D,T",
                 help="adds scenario 'custom' with these sizes (trees from --trees, "
                      "default two_level)")
  p.add_argument("--optimizer", default="none",
                 choices=("none",) + tuple(setup.OPTIMIZER_SLOTS),
                 help="also apply this optimizer in the timed fwd+bwd step (Keras "
                      "optimizers; sparse_sgd, lazy_adam and sparse_adagrad from "
                      "tf_hsm.optimizers; the _momentum forms with momentum 0.9)")
  p.add_argument("--dtype", choices=tuple(setup.DTYPES), default="float32",
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
    if name not in setup.SCENARIO_NAMES:
      p.error(f"unknown scenario {name!r}; known: {', '.join(setup.SCENARIO_NAMES)}")
  for name in args.methods:
    if name not in setup.ALL_METHODS:
      p.error(f"unknown method {name!r}; known: {', '.join(setup.ALL_METHODS)}")
  for name in args.trees:
    if name not in setup.TREE_LABELS:
      p.error(f"unknown tree {name!r}; known: {', '.join(setup.TREE_LABELS)}")
  if args.custom:
    try:
      v, d, t = (int(x) for x in args.custom.split(","))
    except ValueError:
      p.error("--custom takes V,D,T, e.g. 50000,128,512")
    if min(v, d, t) < 1:
      p.error("--custom sizes must be positive")
    args.custom = (v, d, t)
    if "custom" not in args.scenario:
      args.scenario.append("custom")
  elif "custom" in args.scenario:
    p.error("scenario 'custom' needs --custom V,D,T")
  if args.repeats is not None and args.repeats < 1:
    p.error("--repeats must be >= 1")
  return args


def _scenarios(args):
  table = setup.QUICK_SCENARIOS if args.quick else setup.FULL_SCENARIOS
  names = args.scenario or list(setup.FULL_SCENARIOS)
  out = []
  for name in names:
    if name == "custom":
      v, d, t = args.custom
      sc = setup.Scenario("custom", "train", (v,), d, (t,), tuple(args.trees or ["two_level"]))
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
  limit_gb = args.memory_limit_gb
  if limit_gb is None:
    limit_gb = 18.0
    available = _mem_available_bytes()
    if available:
      limit_gb = max(1.0, min(limit_gb, available / GB - 1.0))
  return Options(
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
    from tf_hsm import _bench_methods  # pylint: disable=import-outside-toplevel
    available = {"top_k": _bench_methods.top_k_available(),
                 "sgd_step": _bench_methods.fused_sgd_available()}
    report = {"meta": {
        "argv": sys.argv[1:] if argv is None else list(argv), "quick": quick,
        "machine": _machine(), "tf_version": tf.__version__,
        "optimizer": opts.optimizer, "dtype": opts.dtype, "repeats": opts.repeats,
        "num_sampled": opts.num_sampled, "memory_limit_gb": limit_gb,
        "probe_memory_limit_gb": limit_gb / opts.jobs, "time_budget_s": opts.time_budget_s,
        "timeout_s": opts.timeout_s, "available": available,
        "started": time.strftime("%Y-%m-%d %H:%M:%S")}, "cases": []}
    scenarios = _scenarios(args)
    cases = expand_cases(scenarios, args, workdir, opts)
    progress(f"tf_hsm bench: {len(cases)} cases, memory limit {limit_gb:.1f} GB per "
             f"process, {opts.repeats} repeats")
    prepare_trees(cases, workdir, opts, progress)
    for i, case in enumerate(cases):
      progress(f"[{i + 1}/{len(cases)}] {report_lib.case_title(case)}: "
               f"{', '.join(case['methods'])}")
      try:
        run_case(case, workdir, opts, progress, available)
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
