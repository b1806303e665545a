"""Bench results: per-method statistics, the markdown table, the JSON file and the plot."""

import json
import os

import numpy as np

from tf_hsm.bench import cases

GIB = 2**30


def time_stats(times):
  """Median and spread of timed runs, in seconds (None when there are none)."""
  if not times:
    return None
  t = np.asarray(times, np.float64)
  q1, med, q3 = np.percentile(t, [25, 50, 75])
  return {"median": float(med), "q1": float(q1), "q3": float(q3), "min": float(t.min()),
          "max": float(t.max()), "n": int(t.size)}


def summarize_method(case, method, row, optimizer):
  """Adds throughput, achieved rates and roofline fractions to one method's row."""
  ceilings = case.get("ceilings") or {}
  fwd, step = time_stats(row.get("fwd_times")), time_stats(row.get("step_times"))
  row["fwd"], row["step"] = fwd, step
  row["step_loop"] = time_stats(row.get("step_loop_times"))
  if "work" not in case:
    return row
  work = cases.method_work(method, case, optimizer)
  row["work"] = work
  rates = {}
  for kind, stats in (("fwd", fwd), ("step", step)):
    if not stats:
      continue
    seconds = stats["median"]
    flops, nbytes = work[kind + "_flops"], work[kind + "_bytes"]
    if method == "tf_hsm_top_k":  # its work depends on the search, not on the formulas
      flops = nbytes = None
    entry = {"tokens_per_s": case["tokens"] / seconds}
    if flops is not None:
      floor = cases.roofline_floor(flops, nbytes, ceilings.get("matmul_gflops"),
                                   ceilings.get("read_gbps"))
      entry.update(gflops=flops / seconds / 1e9, gbps=nbytes / seconds / 1e9,
                   floor_s=floor, roofline=None if floor is None else floor / seconds)
    rates[kind] = entry
  if row["step_loop"]:
    rates["step_loop"] = {"tokens_per_s": case["tokens"] / row["step_loop"]["median"]}
  row["rates"] = rates
  return row


def add_speedups(case):
  """Speed-up of tf_hsm (or tf_hsm_top_k) over every other method of the case."""
  methods = case["methods"]
  ref_name = "tf_hsm_top_k" if case["kind"] == "topk" else "tf_hsm"
  ref = methods.get(ref_name, {})
  for name, row in methods.items():
    if name == ref_name:
      continue
    if name in (*cases.FUSED_STEPS, cases.NLL_LOSS, cases.KERAS_STEP):  # tf_hsm variants
      row["faster_than_tf_hsm"] = {
          kind: ref[kind]["median"] / row[kind]["median"] for kind in ("fwd", "step")
          if ref.get(kind) and row.get(kind)}
      continue
    speedup = {}
    for kind in ("fwd", "step"):
      mine, theirs = ref.get(kind), row.get(kind)
      if mine and theirs:
        speedup[kind] = theirs["median"] / mine["median"]
    row["tf_hsm_speedup"] = speedup


def _fmt_ms(seconds):
  ms = seconds * 1e3
  return f"{ms:,.0f}" if ms >= 100 else f"{ms:.3g}"


def _ms(stats):
  if not stats:
    return "–"
  return (f"{_fmt_ms(stats['median'])} [{_fmt_ms(stats['q1'])}–{_fmt_ms(stats['q3'])}]")


def _num(value, fmt="{:.3g}"):
  return "–" if value is None else fmt.format(value)


def _mb(nbytes):
  return "–" if nbytes is None else f"{nbytes / 2**20:,.0f}"


def _status(row):
  status = row.get("status", "?")
  if status == "ok":
    return "ok"
  message = row.get("message", "")
  return f"**{status}**" + (f" ({message})" if message else "")


def case_title(case):
  parts = [f"{case['scenario']}", f"V={cases.fmt_count(case['vocab'])}", f"D={case['dim']}",
           f"{'rows' if case['kind'] == 'topk' else 'T'}={case['tokens']}",
           cases.TREE_LABELS.get(case["tree"], case["tree"])]
  if case.get("dtype", "float32") != "float32":
    parts.append(case["dtype"])
  return " · ".join(parts)


def _ceiling_spread(case):
  """The range of the read bandwidths measured for the case (before and after each timing
  process), when they differ by more than 10%, else "": on a shared machine they can
  differ by half, and a traffic-bound case's roofline % moves with the one it uses."""
  reads = [r["read_gbps"] for r in case.get("ceiling_runs") or [] if r.get("read_gbps")]
  if len(reads) < 2 or max(reads) <= 1.1 * min(reads):
    return ""
  return f" (the case's {len(reads)} reads: {min(reads):.1f}–{max(reads):.1f} GB/s)"


def case_markdown(case, optimizer):
  """A heading with the case's work and ceilings, then one row per method."""
  lines = [f"### {case_title(case)}"]
  facts = []
  tree = case.get("tree_summary")
  work = case.get("work")
  if tree:
    facts.append(f"tree: {tree['num_nodes']:,} nodes, {tree['num_slots']:,} slots, depth "
                 f"≤{tree['max_depth']}, branching ≤{tree['max_branching']}")
  if work and case["kind"] != "topk":
    facts.append(f"ΣK={work['sum_k']:,}, |R|={work['rows']:,}, mean depth "
                 f"{work['mean_depth']:.2f}")
  ceilings = case.get("ceilings")
  if ceilings:
    facts.append(f"matmul {ceilings['matmul_gflops']:.0f} GFLOP/s, read "
                 f"{ceilings['read_gbps']:.1f} GB/s" + _ceiling_spread(case))
  if case.get("timing_note"):
    facts.append(case["timing_note"])
  if case.get("error"):
    facts.append(f"**{case['error']}**")
  if facts:
    lines.append("; ".join(facts))
  lines.append("")
  optimizer = cases.step_optimizer(case["kind"], None, optimizer)
  step_name = "fwd+bwd" + ("" if optimizer == "none" else f"+{optimizer}")
  topk = case["kind"] == "topk"
  header = ["method", "status", "fwd ms [IQR]", "" if topk else f"{step_name} ms [IQR]",
            "rows/s" if topk else "tokens/s", "GFLOP/s", "GB/s", "roofline %",
            "peak RSS MB (Δ)", "tf_hsm speed-up"]
  if topk:
    header[3] = "nodes expanded/row"
  else:
    header.insert(4, f"{step_name} in a loop: ms (tokens/s)")
  lines.append("| " + " | ".join(header) + " |")
  lines.append("|" + "---|" * len(header))
  for name, row in case["methods"].items():
    kind = "fwd" if topk else "step"
    rates = row.get("rates", {}).get(kind, {})
    mem = row.get("memory") or {}
    peak = mem.get("peak_rss")
    delta = None if peak is None or mem.get("baseline_rss") is None else (
        peak - mem["baseline_rss"])
    mem_cell = "–" if peak is None else f"{_mb(peak)} ({_mb(delta)})"
    if mem.get("status") not in (None, "ok"):
      mem_cell = f"{mem['status']}"
    speed = row.get("tf_hsm_speedup") or {}
    speed_cell = " / ".join(f"{k} ×{v:.3g}" for k, v in speed.items()) or "–"
    faster = row.get("faster_than_tf_hsm", {}).get("step")
    if faster and name == cases.KERAS_STEP:
      speed_cell = (f"train_on_batch (+{cases.step_optimizer(case['kind'], name, optimizer)}"
                    f") {1 / faster:.3g}× tf_hsm's time")
    elif faster:
      speed_cell = f"fused step ×{faster:.3g} faster than tf_hsm"
    third = (_num((row.get("info") or {}).get("nodes_expanded_per_row"), "{:.1f}") if topk
             else _ms(row.get("step")))
    roof = rates.get("roofline")
    cells = [name, _status(row), _ms(row.get("fwd")), third,
             _num(rates.get("tokens_per_s"), "{:,.0f}"), _num(rates.get("gflops")),
             _num(rates.get("gbps")), _num(None if roof is None else 100 * roof, "{:.2g}"),
             mem_cell, speed_cell]
    if not topk:
      loop = row.get("step_loop")
      loop_rate = (row.get("rates") or {}).get("step_loop", {}).get("tokens_per_s")
      cells.insert(4, "–" if not loop else
                   f"{_fmt_ms(loop['median'])} ({_num(loop_rate, '{:,.0f}')})")
    lines.append("| " + " | ".join(cells) + " |")
  if case["kind"] == "mem":
    lines.append("")
    lines.extend(mem_verdict(case))
  lines.append("")
  return "\n".join(lines)


def mem_verdict(case):
  """The memory scenario's target: peak RSS <= 1.3 x table + 1 GiB."""
  out = []
  for name, row in case["methods"].items():
    mem = row.get("memory") or {}
    table = mem.get("table_bytes")
    if mem.get("status") != "ok" or not table:
      out.append(f"- {name}: peak RSS not measured ({mem.get('status', 'n/a')})")
      continue
    limit = 1.3 * table + GIB
    peak = mem["peak_rss"]
    verdict = "meets" if peak <= limit else "MISSES"
    out.append(f"- {name}: weight table {table / GIB:.2f} GiB, peak RSS of a fresh process "
               f"{peak / GIB:.2f} GiB "
               f"= {peak / table:.2f}× table (Δ over set-up "
               f"{(peak - mem['baseline_rss']) / GIB:.2f} GiB); target ≤ 1.3× table + 1 GiB "
               f"= {limit / GIB:.2f} GiB: {verdict}")
  return out


def markdown(report):
  meta = report["meta"]
  lines = [f"## tf_hsm bench{' (--quick)' if meta['quick'] else ''}", "",
           f"{meta['machine']}; TensorFlow {meta.get('tf_version', '?')}; optimizer "
           f"{meta['optimizer']}; {meta['repeats']} timed runs per method after warm-up, "
           "methods interleaved round-robin; times are medians [IQR]. GFLOP/s and GB/s "
           "count the useful work of docs/performance.md's formulas (HSM baselines are charged "
           "the HSM work); roofline % = floor / median time. Peak RSS: whole process, "
           "from its own subprocess (Δ: above the set-up with TF, inputs and tables); "
           f"memory limit {meta['memory_limit_gb']:.1f} GB per process.", ""]
  for case in report["cases"]:
    lines.append(case_markdown(case, meta["optimizer"]))
  if "wall_s" in meta:
    lines.append(f"Wall time: {meta['wall_s']:.0f} s")
  return "\n".join(lines)


def write_json(report, path):
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(report, f, indent=1, default=float)
  os.replace(tmp, path)


def plot(report, path):
  """Log-log fwd+bwd time per token against V, one line per method (train cases)."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

  points = {}  # method -> V -> [seconds per token]
  for case in report["cases"]:
    if case["kind"] != "train":
      continue
    for name, row in case["methods"].items():
      step = row.get("step")
      if step:
        points.setdefault(name, {}).setdefault(case["vocab"], []).append(
            step["median"] / case["tokens"])
  fig, ax = plt.subplots(figsize=(7.5, 5))
  for name in cases.ALL_METHODS:
    if name not in points:
      continue
    xs = sorted(points[name])
    ys = [1e6 * float(np.median(points[name][x])) for x in xs]
    ax.plot(xs, ys, marker="o", label=name, linewidth=2.5 if name == "tf_hsm" else 1.2)
  ax.set_xscale("log")
  ax.set_yscale("log")
  ax.set_xlabel("vocabulary size V (classes)")
  ax.set_ylabel("fwd+bwd time per token (µs)")
  ax.set_title("tf_hsm bench: median over trees and T at each V\n"
               "(D and T as in each scenario; OOM / timeout points absent)", fontsize=10)
  ax.grid(True, which="both", alpha=0.3)
  if points:
    ax.legend(fontsize=8)
  else:
    ax.text(0.5, 0.5, "no successful timings", transform=ax.transAxes, ha="center")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
