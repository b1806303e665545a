"""Running the bench: listing its cases, building their trees, probing and timing methods.

Every measurement runs in a worker process (`tf_hsm.bench.worker`) started through
`tf_hsm.bench.watchdog`; this module decides what runs where and collects the results.
"""

import dataclasses
import os
import time

from tf_hsm.bench import report as report_lib
from tf_hsm.bench import watchdog
from tf_hsm.bench import cases
from tf_hsm.bench.watchdog import GB

# Trees up to this many classes are built in the driver; larger ones in a watched child.
_IN_PROCESS_TREE_CLASSES = 2_000_000


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
  e = cases.itemsize(case)
  table = cases.table_bytes(method, v, s, d, e)
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
  out = []
  for sc in scenarios:
    for v in sc.vocab:
      for kind in sc.trees:
        tree_path = os.path.join(tree_dir, f"{kind}_{v}.npz")
        base = {"scenario": sc.name, "kind": sc.kind, "vocab": v, "dim": sc.dim,
                "tree": kind, "tree_path": tree_path, "seed": opts.seed, "dtype": opts.dtype,
                "num_sampled": opts.num_sampled, "k": cases.TOPK_K, "note": sc.note}
        methods = list(sc.methods)
        # The fused SGD step and the Keras step are training methods of every training
        # scenario when asked for by name (the fused step also when --optimizer sgd
        # implies it); E lists both by default.
        if sc.kind == "train":
          wanted = [m for m in cases.EXTRA_TRAIN_METHODS if m in (args.methods or ())]
          for fused, optimizer in cases.FUSED_STEPS.items():
            if opts.optimizer == optimizer and fused not in wanted:
              wanted.insert(0, fused)
          for m in reversed(wanted):
            if m not in methods:
              methods.insert(1, m)   # next to tf_hsm, whose variants they are
        methods = [m for m in methods if not args.methods or m in args.methods]
        if sc.kind != "topk" and "tf_hsm" not in methods:
          methods.insert(0, "tf_hsm")   # the reference for every speed-up
        if not methods:
          continue
        for t in sc.tokens:
          out.append(dict(base, tokens=t, methods=methods))
  return out


def prepare_trees(case_list, workdir, opts, progress):
  """Builds every tree once (large ones in a watched child) and counts each case's work."""
  by_tree = {}
  for case in case_list:
    by_tree.setdefault((case["tree"], case["vocab"], case["tree_path"]), []).append(case)
  for (kind, v, path), group in by_tree.items():
    tokens = sorted({c["tokens"] for c in group})
    start = time.monotonic()
    if v <= _IN_PROCESS_TREE_CLASSES:
      tree, summary = cases.prepare_tree(kind, v, path)
      work = {str(t): cases.case_work(tree, v, t, opts.seed, opts.num_sampled)
              for t in tokens}
      del tree  # forked workers would carry it in their RSS
      result = {"status": "ok", "tree_summary": summary, "work": work}
    else:
      spec = {"mode": "prepare", "tree": kind, "vocab": v, "tree_path": path,
              "seed": opts.seed, "num_sampled": opts.num_sampled, "token_counts": tokens}
      result = watchdog.run_children([(f"tree {kind} V={v}", spec, None)], workdir,
                                     opts.limit_bytes, opts.timeout_s, 1, progress, opts.spawn)[0]
    progress(f"  tree {cases.TREE_LABELS.get(kind, kind)} V={cases.fmt_count(v)}: "
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
  tables = sum(cases.table_bytes(m, case["vocab"], tree.get("num_slots", case["vocab"]),
                                 case["dim"], cases.itemsize(case)) for m in methods)
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
    by_class = m in cases.CLASS_TABLE_METHODS
    return (by_class, m if cases.mutates_table(m, case["kind"], opts.optimizer) else None)

  def estimate(group):
    tables = {table_key(m): cases.table_bytes(m, v, s, d, cases.itemsize(case)) for m in group}
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
    timing = watchdog.run_children([("timing " + ",".join(remaining), spec, timeout)],
                                   workdir, opts.limit_bytes, timeout, 1, progress,
                                   opts.spawn)[0]
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
    step = {cases.FUSED_SGD: "sgd_step", cases.FUSED_ADAM: "adam_step"}.get(name)
    if step and not available.get(step):
      row.update(status="skipped", message=f"tf_hsm.{step} not available (an op library "
                 "built before it: rebuild with ./configure.sh)")
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
    probes = watchdog.run_children(specs, workdir, opts.limit_bytes / opts.jobs,
                                   opts.timeout_s, opts.jobs, progress, spawn)
    for name, probe in zip(list(runnable), probes):
      probe["table_bytes"] = cases.table_bytes(name, case["vocab"],
                                               case["tree_summary"]["num_slots"], case["dim"],
                                               cases.itemsize(case))
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
                                cases.step_optimizer(case["kind"], name, opts.optimizer))
  report_lib.add_speedups(case)
