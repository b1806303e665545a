"""One bench job in its own process: `python -m tf_hsm.bench.worker SPEC.json`.

Modes (spec["mode"]):
* "prepare": build a large tree, save it, count the case's work.
* "probe": run one method's step once and report its peak RSS (VmHWM, reset after set-up
  so the set-up's transient peak does not hide the method's), with the RSS before the
  set-up (start_rss) and after it (baseline_rss).
* "time": time every given method, interleaved round-robin, plus the machine ceilings.

The result is written as JSON to spec["result_path"]. An out-of-memory error inside
TensorFlow becomes status "OOM"; the driver turns kills (its RSS watchdog, the kernel's
OOM killer) and time-outs into results too.
"""

import faulthandler
import gc
import json
import os
import resource
import sys
import time
import traceback


def status_bytes(field):
  """A field of /proc/self/status ("VmRSS", "VmHWM") in bytes; None if it is absent."""
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith(field + ":"):
        return int(line.split()[1]) * 1024
  return None


def reset_peak_rss():
  """Resets VmHWM (and ru_maxrss) to the current RSS; False where the kernel refuses."""
  try:
    with open("/proc/self/clear_refs", "w") as f:
      f.write("5")
    return True
  except OSError:
    return False


def _peak_rss():
  hwm = status_bytes("VmHWM")
  return hwm if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _is_oom(error):
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  return isinstance(error, (MemoryError, tf.errors.ResourceExhaustedError)) or (
      "out of memory" in str(error).lower() or "oom" in type(error).__name__.lower())


def _error_result(error):
  """status and a one-line message: TF's first line plus its root-cause line (TF buries
  it under a Python stack: "OOM when allocating tensor ...", "Cannot parse tensor ...")."""
  status = "OOM" if _is_oom(error) else "error"
  skip = ("File ", "Detected at node", "[[", "Hint:", "dtype", "tensor_shape", "dim {",
          "size:", "}")
  lines = [l.strip() for l in str(error).splitlines()]
  lines = [l for l in lines if l and not l.startswith(skip)]
  message = type(error).__name__ + ": " + " … ".join(
      dict.fromkeys(lines[:1] + lines[-1:]))  # first and last, once each
  return {"status": status, "message": message[:300]}


def prepare(spec):
  from tf_hsm.bench import cases  # pylint: disable=import-outside-toplevel
  tree, summary = cases.prepare_tree(spec["tree"], spec["vocab"], spec["tree_path"])
  work = {str(t): cases.case_work(tree, spec["vocab"], t, spec["seed"], spec["num_sampled"])
          for t in spec["token_counts"]}
  return {"status": "ok", "tree_summary": summary, "work": work}


def probe(spec):
  from tf_hsm.bench import methods as bm  # pylint: disable=import-outside-toplevel
  method = spec["methods"][0]
  # The process before the case's tree, inputs and tables (TensorFlow imported): what
  # the case adds to a process is peak_rss - start_rss.
  start_rss = status_bytes("VmRSS")
  inputs = bm.CaseInputs(spec, [method])
  gc.collect()
  setup_peak = _peak_rss()
  reset = reset_peak_rss()
  baseline = status_bytes("VmRSS")
  start = time.perf_counter()
  m = bm.Method(method, inputs, spec)
  seconds = bm.timed_call(m.step or m.fwd)
  result = {"first_call_s": seconds, "build_and_first_call_s": time.perf_counter() - start}
  if bm.mutates_table(method, spec):
    # The steady state differs from the first step: a sparse update switches the table
    # to copy-on-read, so the second step's plain reads (the baselines') copy it.
    result["second_call_s"] = bm.timed_call(m.step)
  result.update(status="ok", start_rss=start_rss, baseline_rss=baseline,
                peak_rss=_peak_rss(), setup_peak_rss=setup_peak, peak_reset=reset,
                info=m.info)
  return result


def time_case(spec):
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  from tf_hsm.bench import methods as bm  # pylint: disable=import-outside-toplevel
  repeats, budget, quick = spec["repeats"], spec["time_budget_s"], spec["quick"]
  phases = {}
  clock = time.perf_counter()
  ceiling_bytes = spec.get("memory_limit_bytes", 2**40) / 16
  dtype = spec.get("dtype", "float32")
  ceilings = [bm.measure_ceilings(quick, max_bytes=ceiling_bytes, dtype=dtype)]
  gc.collect()
  phases["ceilings_s"] = time.perf_counter() - clock
  inputs = bm.CaseInputs(spec, spec["methods"])
  phases["setup_s"] = time.perf_counter() - clock - phases["ceilings_s"]
  results, live = {}, {}
  m = fns = None
  for name in spec["methods"]:
    clock = time.perf_counter()
    try:
      m = bm.Method(name, inputs, spec)
      fns = [("fwd", m.fwd)] + ([("step", m.step)] if m.step is not None else [])
      first = {kind: bm.timed_call(fn) for kind, fn in fns}   # traces
      res = {"status": "ok", "first_call_s": first, "info": m.info,
             "fwd_times": [], "step_times": [], "step_loop_times": []}
      # The first call also traces: only skip the warm-up call when it is far too slow.
      warm = first
      if sum(first.values()) <= 2 * budget + 30:
        warm = {kind: bm.timed_call(fn) for kind, fn in fns}  # warm-up, estimates the cost
        res["warm_call_s"] = warm
      estimate = repeats * sum(warm.values())
      if estimate > budget:
        res.update(status="timeout", message=(
            f"{repeats} repeats would take ~{estimate:.0f} s > budget {budget:.0f} s "
            f"(one call: " + ", ".join(f"{k} {v:.3g} s" for k, v in warm.items()) + ")"))
      else:
        live[name] = fns
      results[name] = res
    except Exception as e:  # pylint: disable=broad-except
      results[name] = _error_result(e)
      if results[name]["status"] == "error":
        results[name]["traceback"] = traceback.format_exc(limit=4)[-1500:]
    results[name]["warm_up_s"] = time.perf_counter() - clock
    m = fns = None  # methods that will not be timed release their memory
    gc.collect()
  names = list(live)
  clock = time.perf_counter()
  gc.collect()
  gc.disable()
  try:
    for r in range(repeats):
      order = names[r % len(names):] + names[:r % len(names)] if names else []
      for kind in ("fwd", "step"):
        for name in order:
          fn = dict(live[name]).get(kind)
          if fn is not None:
            results[name][kind + "_times"].append(bm.timed_call(fn))
      gc.collect()
    # Then each method's step back to back, as a training loop calls it: `repeats` calls
    # after one that follows the other methods (not timed). The round-robin above times
    # every call just after other methods' calls, which have replaced the data in the
    # caches; here the step finds what its previous call left there.
    for name in names:
      fn = dict(live[name]).get("step")
      if fn is None:
        continue
      bm.timed_call(fn)
      results[name]["step_loop_times"] = [bm.timed_call(fn) for _ in range(repeats)]
      gc.collect()
  finally:
    gc.enable()
  phases["timed_loop_s"] = time.perf_counter() - clock
  live = inputs = m = fns = None  # free the tables before the last ceilings
  gc.collect()
  ceilings.append(bm.measure_ceilings(quick, max_bytes=ceiling_bytes, dtype=dtype))
  best = {key: max(c[key] for c in ceilings) for key in ("matmul_gflops", "read_gbps")}
  return {"status": "ok", "methods": results, "ceilings": best, "ceiling_runs": ceilings,
          "phases": phases,
          "tf_version": tf.__version__, "threads": os.cpu_count()}


def main(argv):
  faulthandler.enable()  # a crash in a kernel leaves a Python stack in the log
  with open(argv[1]) as f:
    spec = json.load(f)
  try:  # If memory runs out machine-wide, this process should be the one to go.
    with open("/proc/self/oom_score_adj", "w") as f:
      f.write("1000")
  except OSError:
    pass
  try:
    result = {"prepare": prepare, "probe": probe, "time": time_case}[spec["mode"]](spec)
  except Exception as e:  # pylint: disable=broad-except
    result = _error_result(e)
    result["traceback"] = traceback.format_exc(limit=6)[-2000:]
  tmp = spec["result_path"] + ".tmp"
  with open(tmp, "w") as f:
    json.dump(result, f)
  os.replace(tmp, spec["result_path"])


if __name__ == "__main__":
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  main(sys.argv)
