"""`python -m tf_hsm.planning --verify`: the planner's predictions beside the bench's
measurements of the same cases.

    python -m tf_hsm.planning --verify                      # B, D, E, mem, 10M, 1M
    python -m tf_hsm.planning --verify --cases B E --repeats 5
    python -m tf_hsm.planning --verify --quick              # one small case, about a minute

Each case runs through the bench's own machinery (`tf_hsm.bench.runner`: a memory probe
per method in a fresh worker process under the RSS watchdog, then the methods timed
interleaved in one process), with the case's optimizer: the planner's `sgd` as the
bench's `sparse_sgd` (tf_hsm.optimizers.SparseSGD: touched rows only for a sparse
gradient, a dense update for a dense one), `lazy_adam` as itself (case 1M: a tree of the
planner's vectors32/256 kind, as `Tree.from_vectors` builds it, beside sampled softmax,
the tree timed as `log_prob` with a tape and as `nll_loss`: a language model at a
million classes as it is trained). The planner prices the bench's tree (the same
builder, Zipf(1) class probabilities) at the machine's rates measured just before and
just after the case (the faster of the two): on a shared machine the cached rates may be
from another load.

Compared:
* peak: the planner's peak (tables, gradient, slots, activations) against what the
  case adds to its worker process: peak RSS minus the RSS before the tree, inputs and
  tables were made (TensorFlow already imported). Within 15% passes.
* step: the planner's step time against the median of the bench's steps run back to
  back (a training loop). Within a factor of 1.5 passes.
A method the bench does not run because it cannot fit the memory limit agrees with the
planner when the planner says it does not fit either.
"""

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import types

from tf_hsm import planning as planner
from tf_hsm.bench import cli
from tf_hsm.bench import worker
from tf_hsm.bench.watchdog import GB, limit_gb_or_default

PEAK_TOLERANCE = 0.15
TIME_FACTOR = 1.5
# The bench's names for the planner's optimizers.
BENCH_OPTIMIZERS = {"sgd": "sparse_sgd", "lazy_adam": "lazy_adam"}


@dataclasses.dataclass(frozen=True)
class Case:
  """One verified case: the bench's V, D, T and tree kind, and its methods."""
  name: str
  vocab: int
  dim: int
  tokens: int
  tree: str
  methods: tuple = ("tf_hsm", "full_softmax")
  note: str = ""
  optimizer: str = "sgd"  # the planner's name (BENCH_OPTIMIZERS: the bench's)

  def __post_init__(self):
    if self.optimizer not in BENCH_OPTIMIZERS:
      raise ValueError(f"optimizer must be one of {sorted(BENCH_OPTIMIZERS)} (the ones the "
                       f"bench and the planner share), got {self.optimizer!r}")


CASES = {
    "B": Case("B", 100_000, 512, 640, "two_level", note="the bench's B"),
    "D": Case("D", 1_000_000, 300, 256, "two_level", note="the bench's D"),
    "E": Case("E", 312_000, 100, 1_024, "huffman", note="fastText-like, binary Huffman"),
    "mem": Case("mem", 2_000_000, 300, 3_200, "two_level", note="the bench's mem"),
    "10M": Case("10M", 10_000_000, 300, 3_200, "two_level", note="the bench's D at 10M"),
    "1M": Case("1M", 1_000_000, 300, 3_200, "vectors32_head256",
               methods=("tf_hsm", "tf_hsm_nll_loss", "sampled_softmax"),
               optimizer="lazy_adam",
               note="a from_vectors tree (32-ary, head 256) against sampled softmax, LazyAdam"),
}
# Small enough for a test, large enough that full softmax's FLOPs and logits, not the
# per-call overhead and TensorFlow's own memory, are most of its figures.
QUICK_CASES = {"quick": Case("quick", 50_000, 128, 512, "two_level")}
PREDICTED_NAMES = {"tf_hsm": "HierarchicalSoftmax", "tf_hsm_nll_loss": "HierarchicalSoftmax",
                   "full_softmax": "full softmax", "sampled_softmax": "sampled softmax"}
# The bench's methods over the case's tree: log_prob with a tape, and nll_loss.
TREE_METHODS = ("tf_hsm", "tf_hsm_nll_loss")


def case_costs(case):
  """{bench method: the planner's `Cost`} for `case`, the bench's tree built once."""
  from tf_hsm.bench import cases as bench_cases  # pylint: disable=import-outside-toplevel
  tree = (bench_cases.build_tree(case.tree, case.vocab)
          if set(TREE_METHODS) & set(case.methods) else None)
  return {method: _cost_of(case, method, tree) for method in case.methods}


def predict(case, machine, memory_budget=None, costs=None):
  """{bench method: planner row} for `case`, over the tree the bench builds (`costs`:
  `case_costs(case)`, when already computed)."""
  costs = costs or case_costs(case)
  return {method: _price(case, method, costs[method], machine, memory_budget)
          for method in case.methods}


def _price(case, method, cost, machine, memory_budget=None):
  """The planner's row for one bench method of `case` at `machine`'s rates."""
  return planner.price(
      PREDICTED_NAMES[method] + (f" {case.tree}" if method in TREE_METHODS else ""),
      cost, case.dim, case.tokens, case.optimizer, "float32", machine, memory_budget,
      exact=method != "sampled_softmax")


def _limit_bytes(limit_gb):
  """The bench's default memory limit (18 GB, less when less is available now)."""
  return limit_gb_or_default(limit_gb) * GB


def measure(case, repeats, quick, limit_bytes, workdir, progress):
  """Runs `case` through the bench; returns the bench's case dict."""
  from tf_hsm.bench import cases as bench_cases  # pylint: disable=import-outside-toplevel
  from tf_hsm.bench import runner  # pylint: disable=import-outside-toplevel
  opts = runner.Options(
      quick=quick, repeats=repeats, optimizer=BENCH_OPTIMIZERS[case.optimizer],
      num_sampled=1024, seed=1234,
      limit_bytes=limit_bytes, timeout_s=600 if quick else 1800,
      # A full softmax step at D takes 10-30 s on a loaded 2-core machine: room for its
      # repeats.
      time_budget_s=30 if quick else 900, jobs=1, memory=True,
      # A fresh interpreter per worker: the driver may have run TensorFlow (measuring the
      # machine), and a fork would also carry the driver's memory into the child's RSS.
      spawn="exec")
  scenario = bench_cases.Scenario(case.name, "train", (case.vocab,), case.dim,
                                  (case.tokens,), (case.tree,), methods=case.methods)
  args = types.SimpleNamespace(methods=list(case.methods))
  (bench_case,) = runner.expand_cases([scenario], args, workdir, opts)
  runner.prepare_trees([bench_case], workdir, opts, progress)
  runner.run_case(bench_case, workdir, opts, progress, {"top_k": False, "sgd_step": False})
  bench_case.pop("tree_path", None)
  return bench_case


def _gb(value):
  return "–" if value is None else f"{value / 1e9:.2f} GB"


def _time(seconds):
  if seconds is None:
    return "–"
  return f"{seconds * 1e3:,.1f} ms" if seconds < 10 else f"{seconds:.2f} s"


def compare(case, bench_case, predicted, machine, costs=None):
  """One result per method: predicted and measured peak and step, verdicts, and why a
  miss missed (`costs`: `case_costs(case)`, when already computed)."""
  out = []
  ceilings = bench_case.get("ceilings") or {}
  for method, row in bench_case["methods"].items():
    pred = predicted[method]
    mem = row.get("memory") or {}
    loop = row.get("step_loop") or row.get("step") or {}
    result = {"case": case.name, "vocab": case.vocab, "dim": case.dim,
              "tokens": case.tokens, "tree": case.tree, "method": method,
              "optimizer": case.optimizer, "status": row.get("status"),
              "message": row.get("message", ""),
              "predicted_peak": pred["peak_bytes"], "predicted_step": pred["step_seconds"],
              "predicted_fits": pred["fits"], "peak_rss": mem.get("peak_rss"),
              "measured_peak": None, "measured_step": loop.get("median"),
              "ceilings": ceilings, "why": []}
    warm = (row.get("warm_call_s") or {}).get("step")
    if result["measured_step"] is None and warm:
      # The bench's time budget stopped the repeats: its one warm-up call is the figure.
      result["measured_step"] = warm
      result["why"].append(f"step: one call, not a median (the bench: {row['message']})")
    if mem.get("status") == "ok" and mem.get("start_rss") is not None:
      result["measured_peak"] = mem["peak_rss"] - mem["start_rss"]
      result["setup"] = mem["baseline_rss"] - mem["start_rss"]
      result["growth"] = mem["peak_rss"] - mem["baseline_rss"]
    if row.get("status") != "ok" and result["measured_peak"] is None:
      # Not run (or killed) for memory: the planner agrees when it says it cannot fit.
      oom = row.get("status") == "OOM"
      result["peak_ok"] = oom and not pred["fits"]
      result["time_ok"] = None
      result["why"].append(
          f"the bench: {row.get('status')} ({row.get('message', '')}); the planner: "
          f"peak {_gb(pred['peak_bytes'])}, " + ("fits" if pred["fits"] else
                                                  "does not fit") + " the limit")
      out.append(result)
      continue
    peak_ratio = (None if result["measured_peak"] is None
                  else result["measured_peak"] / pred["peak_bytes"])
    time_ratio = (None if result["measured_step"] is None
                  else result["measured_step"] / pred["step_seconds"])
    result["peak_ratio"], result["time_ratio"] = peak_ratio, time_ratio
    result["peak_ok"] = peak_ratio is not None and abs(peak_ratio - 1) <= PEAK_TOLERANCE
    result["time_ok"] = time_ratio is not None and (
        1 / TIME_FACTOR <= time_ratio <= TIME_FACTOR)
    if peak_ratio is not None and not result["peak_ok"]:
      result["why"].append(
          f"peak: set-up (tree, inputs, tables) {_gb(result['setup'])} against "
          f"{_gb(pred['param_bytes'] + pred.get('tree_bytes', 0.0))} of tables and tree "
          f"arrays predicted; the step added "
          f"{_gb(result['growth'])} against {_gb(pred['grad_bytes'] + pred['activation_bytes'])}"
          f" predicted (gradient {_gb(pred['grad_bytes'])}, activations "
          f"{_gb(pred['activation_bytes'])})")
    if time_ratio is not None and not result["time_ok"]:
      compute = pred["flops"] / machine.matmul_flops
      traffic = pred["bytes_moved"] / machine.read_bytes
      seconds = result["measured_step"]
      if pred.get("node_visits") and machine.tree_step is not None:
        terms = zip(planner.TREE_STEP_TERMS, machine.tree_step,
                    planner.tree_step_terms(pred["flops"], pred["small_node_flops"],
                                            pred["bytes_moved"] - pred["slot_bytes_moved"],
                                            pred["node_visits"], pred["children_scored"],
                                            pred["slot_bytes_moved"]))
        result["why"].append("step: the fitted model's terms: " + "; ".join(
            f"{name} {_time(coefficient * amount)}" for name, coefficient, amount in terms))
        out.append(result)
        continue
      why = (f"step: the model is {'compute' if compute >= traffic else 'traffic'}-bound "
             f"({pred['flops'] / 1e9:,.2f} GFLOP at {machine.matmul_flops / 1e9:.0f} GFLOP/s"
             f" = {_time(compute)}; {pred['bytes_moved'] / 1e6:,.0f} MB at "
             f"{machine.read_bytes / 1e9:.1f} GB/s = {_time(traffic)}; softmax "
             f"cross-entropy {pred['softmax_logits'] / 1e6:,.1f}M logits = "
             f"{_time(pred['softmax_logits'] * machine.softmax_seconds)}; sampled "
             f"softmax's {pred['sampled_logits'] / 1e6:,.1f}M logits = "
             f"{_time(pred['sampled_logits'] * machine.sampled_logit_seconds)}; calls "
             f"{_time(planner.CALLS_PER_STEP * machine.call_seconds)}); measured "
             f"{pred['flops'] / seconds / 1e9:,.1f} GFLOP/s and "
             f"{pred['bytes_moved'] / seconds / 1e9:.1f} GB/s of that work")
      if ceilings.get("matmul_gflops"):
        rates = planner.Machine(ceilings["matmul_gflops"] * 1e9,
                                ceilings["read_gbps"] * 1e9, machine.call_seconds,
                                "the bench's", machine.softmax_seconds,
                                sampled_logit_seconds=machine.sampled_logit_seconds)
        cost = costs[method] if costs else _cost_of(case, method)
        again = _price(case, method, cost, rates)["step_seconds"]
        why += (f"; at the rates the bench measured in the run ({ceilings['matmul_gflops']:.0f}"
                f" GFLOP/s, {ceilings['read_gbps']:.1f} GB/s) the model gives {_time(again)}")
      result["why"].append(why)
    out.append(result)
  return out


def _best(first, second):
  """The faster rates of two measurements of the machine: other jobs only slow it."""
  return planner.Machine(max(first.matmul_flops, second.matmul_flops),
                         max(first.read_bytes, second.read_bytes),
                         min(first.call_seconds, second.call_seconds), "measured",
                         min(first.softmax_seconds, second.softmax_seconds),
                         _faster_fit(first.tree_step, second.tree_step),
                         _smaller(first.loop_step_seconds, second.loop_step_seconds),
                         _smaller(first.sampled_logit_seconds,
                                  second.sampled_logit_seconds))


def _smaller(first, second):
  """The smaller of two optional figures (None: not measured)."""
  known = [value for value in (first, second) if value is not None]
  return min(known) if known else None


def _faster_fit(first, second):
  """Of two fitted tree steps, the one with the smaller total over its own terms at a
  mid-sized step (1 GFLOP in large nodes, 0.1 in small ones, 100 MB, 10K visits, 1M
  children, 100 MB of slots): its coefficients stay one fit's."""
  if first is None or second is None:
    return first or second
  probe = planner.tree_step_terms(1.1e9, 1e8, 1e8, 1e4, 1e6, 1e8)
  return min(first, second, key=lambda c: sum(a * b for a, b in zip(c, probe)))


def _cost_of(case, method, tree=None):
  """The planner's cost of one bench method on `case` (`tree`: the case's, when built)."""
  from tf_hsm.bench import cases as bench_cases  # pylint: disable=import-outside-toplevel
  if method == "full_softmax":
    return planner.full_softmax_cost(case.vocab, case.dim, case.tokens)
  probs = bench_cases.zipf_weights(case.vocab)
  probs /= probs.sum()
  if method == "sampled_softmax":
    return planner.sampled_softmax_cost(case.vocab, case.dim, case.tokens, probs)
  if method not in TREE_METHODS:
    raise ValueError(f"no planner row for the bench's method {method!r}")
  if tree is None:
    tree = bench_cases.build_tree(case.tree, case.vocab)
  return planner.tree_cost(tree, case.dim, case.tokens, probs)


def run(names=None, quick=False, repeats=None, memory_limit_gb=None, machine=None,
        progress=None):
  """Measures and predicts the named cases (default: all of CASES, or QUICK_CASES).

  Returns:
    dict(machine=..., results=[one dict per case and method]).
  """
  table = QUICK_CASES if quick else CASES
  names = list(names or table)
  for name in names:
    if name not in table:
      raise ValueError(f"unknown case {name!r}; known: {', '.join(table)}")
  if repeats is None:
    repeats = 5 if quick else 7
  if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
    raise ValueError(f"repeats must be a positive int, got {repeats!r}")
  if memory_limit_gb is not None and (
      isinstance(memory_limit_gb, bool) or not isinstance(memory_limit_gb, (int, float))
      or not memory_limit_gb > 0):
    raise ValueError(f"memory_limit_gb must be a positive number, got {memory_limit_gb!r}")
  if isinstance(machine, dict):
    machine = planner.Machine(**machine)
  progress = progress or (lambda message: print(message, file=sys.stderr, flush=True))
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  machine_line = cli._machine()  # pylint: disable=protected-access
  report = {"machine": machine_line, "tf_version": tf.__version__,
            "rates": None if machine is None else dataclasses.asdict(machine),
            "repeats": repeats, "quick": quick, "results": []}
  workdir = tempfile.mkdtemp(prefix="tf_hsm_plan_verify_")
  try:
    for name in names:
      case = table[name]
      limit = _limit_bytes(memory_limit_gb)
      progress(f"{name}: V={case.vocab:,} D={case.dim} T={case.tokens:,} {case.tree}, "
               f"memory limit {limit / 1e9:.1f} GB")
      before = machine or planner.Machine.measure()
      bench_case = measure(case, repeats, quick, limit, workdir, progress)
      rates = machine or _best(before, planner.Machine.measure())
      costs = case_costs(case)
      predicted = predict(case, rates, limit, costs)
      for result in compare(case, bench_case, predicted, rates, costs):
        result.update(limit_bytes=limit, rates=dataclasses.asdict(rates))
        report["results"].append(result)
  finally:
    shutil.rmtree(workdir, ignore_errors=True)
  return report


def _ratio(value):
  return "–" if value is None else f"{value:.2f}"


def _verdict(result):
  if result["time_ok"] is None:
    return "agrees (not run, does not fit)" if result["peak_ok"] else "**disagrees**"
  parts = [("peak ok" if result["peak_ok"] else "**peak misses**"),
           ("step ok" if result["time_ok"] else "**step misses**")]
  return ", ".join(parts)


def markdown(report):
  rates = report["rates"]
  lines = [
      f"{report['machine']}; TensorFlow {report['tf_version']}; planner rates: " + (
          "measured before and after each case, the faster of the two (below)"
          if rates is None else _rates(rates)) + "; "
      "optimizer: sgd (the bench's sparse_sgd) but where a case names another; "
      f"measured step: median of "
      f"{report['repeats']} steps back to back; peak: the worker's peak RSS less its RSS "
      "before the case's tree, inputs and tables (the whole process's in brackets).",
      "",
      "| case | method | peak predicted | peak measured (process) | ratio | step predicted "
      "| step measured | ratio | verdict |",
      "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
  for r in report["results"]:
    title = f"{r['case']}: V={r['vocab']:,} D={r['dim']} T={r['tokens']:,} {r['tree']}" + (
        "" if r.get("optimizer", "sgd") == "sgd" else f", {r['optimizer']}")
    measured_peak = ("–" if r["measured_peak"] is None else
                     f"{_gb(r['measured_peak'])} ({_gb(r['peak_rss'])})")
    if r["time_ok"] is None:
      measured_peak = f"not run: {r['status']}"
    lines.append(
        f"| {title} | {r['method']} | {_gb(r['predicted_peak'])} | {measured_peak} | "
        f"{_ratio(r.get('peak_ratio'))} | {_time(r['predicted_step'])} | "
        f"{_time(r['measured_step'])} | {_ratio(r.get('time_ratio'))} | {_verdict(r)} |")
  notes = [r for r in report["results"] if r["why"]]
  if notes:
    lines += ["", "Why:"]
    for r in notes:
      for why in r["why"]:
        lines.append(f"- {r['case']} {r['method']}: {why}")
  by_case = {}
  for r in report["results"]:
    by_case[r["case"]] = r
  lines += ["", "Rates:"]
  for name, r in by_case.items():
    c = r["ceilings"]
    lines.append(f"- {name}: planner {_rates(r['rates'])}" + (
        f"; the bench's timing process {c['matmul_gflops']:.0f} GFLOP/s, "
        f"{c['read_gbps']:.1f} GB/s" if c else ""))
  return "\n".join(lines)


def _rates(rates):
  return (f"matmul {rates['matmul_flops'] / 1e9:.0f} GFLOP/s, read "
          f"{rates['read_bytes'] / 1e9:.1f} GB/s, {rates['call_seconds'] * 1e6:.0f} µs a "
          f"call, softmax {rates['softmax_seconds'] * 1e9:.1f} ns a logit"
          + (f", sampled softmax {rates['sampled_logit_seconds'] * 1e9:.1f} ns a logit"
             if rates.get("sampled_logit_seconds") else "")
          + (f", {rates['loop_step_seconds'] * 1e6:.1f} µs a loop step"
             if rates.get("loop_step_seconds") else ""))


# ---------------------------------------------------------------------------------------
# Whole models: the body's step and the output layer's, in `model.fit`.
# ---------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class BodyCase:
  """A whole model measured in `model.fit`: its body, the output layer's V and tree, the
  batch and the optimizer (the planner's name)."""
  name: str
  vocab: int
  batch: int
  seq: int  # positions a sequence (1: one output a row)
  tree: str = "two_level"
  optimizer: str = "lazy_adam"
  note: str = ""

  @property
  def tokens(self):
    return self.batch * self.seq


BODY_CASES = {
    "lstm": BodyCase("lstm", 20_000, 64, 32, note="Embedding(128) -> LSTM(128), the "
                     "demo's language model at V=20K"),
    "transformer": BodyCase("transformer", 20_000, 32, 64, note="Embedding(128) -> a "
                            "Transformer block (MultiHeadAttention 4 x 32, LayerNorm, "
                            "Dense 512 -> 128, LayerNorm)"),
    "mlp": BodyCase("mlp", 100_000, 1024, 1, note="a recommender tower: 256 features "
                    "-> Dense 512 -> 256 -> 128"),
}


def build_body_model(case):
  """The case's Keras model (its body -> HierarchicalSoftmax over a tree of Zipf(1)
  counts), compiled with the case's optimizer, and its counts."""
  import keras  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from tf_hsm.keras import losses, optimizers  # pylint: disable=import-outside-toplevel
  from tf_hsm.keras.layers import HierarchicalSoftmax  # pylint: disable=import-outside-toplevel
  from tf_hsm.tree import Tree  # pylint: disable=import-outside-toplevel
  keras.utils.set_random_seed(0)
  counts = 1.0 / np.arange(1, case.vocab + 1)
  if case.name == "mlp":
    inputs = keras.Input((256,), name="features")
    x = keras.layers.Dense(512, activation="relu")(inputs)
    x = keras.layers.Dense(256, activation="relu")(x)
    x = keras.layers.Dense(128)(x)
    targets = keras.Input((), dtype="int32", name="targets")
  else:
    inputs = keras.Input((case.seq,), dtype="int32", name="tokens")
    x = keras.layers.Embedding(case.vocab, 128)(inputs)
    if case.name == "lstm":
      x = keras.layers.LSTM(128, return_sequences=True)(x)
    else:
      a = keras.layers.MultiHeadAttention(4, 32)(x, x)
      x = keras.layers.LayerNormalization()(keras.layers.Add()([x, a]))
      f = keras.layers.Dense(512, activation="relu")(x)
      f = keras.layers.Dense(128)(f)
      x = keras.layers.LayerNormalization()(keras.layers.Add()([x, f]))
    targets = keras.Input((case.seq,), dtype="int32", name="targets")
  tree = (Tree.two_level(case.vocab, counts=counts) if case.tree == "two_level" else
          Tree.huffman(counts, branching=int(case.tree[len("huffman"):] or 2)))
  out = HierarchicalSoftmax(tree, name="hsm")(x, targets)
  model = keras.Model([inputs, targets], out)
  opt = {"lazy_adam": lambda: optimizers.LazyAdam(1e-3),
         "sgd": lambda: optimizers.SparseSGD(0.1)}[case.optimizer]()
  model.compile(optimizer=opt, loss=losses.nll)
  return model, counts


def _measure_apart():
  """`planner.Machine.measure()` in a child process (its 256 MiB probe and tf_hsm steps
  stay out of this process's peak)."""
  import subprocess  # pylint: disable=import-outside-toplevel
  code = ("import dataclasses, json; from tf_hsm.planning import Machine; "
          "print(json.dumps(dataclasses.asdict(Machine.measure())))")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       check=True, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
  fields = json.loads(out.stdout.strip().splitlines()[-1])
  fields["tree_step"] = tuple(fields["tree_step"])
  return planner.Machine(**fields)


def body_worker(name, steps):
  """In a fresh process: the planner's whole-model figures for the case, then its
  `model.fit` steps timed and its peak RSS less the RSS before the model was built."""
  import time  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  import keras  # pylint: disable=import-outside-toplevel
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  del tf
  case = BODY_CASES[name]
  rng = np.random.default_rng(0)
  n = case.batch * steps
  counts = 1.0 / np.arange(1, case.vocab + 1)
  cdf = np.cumsum(counts) / counts.sum()
  shape = (n,) if case.seq == 1 else (n, case.seq)
  y = np.minimum(np.searchsorted(cdf, rng.random(shape)), case.vocab - 1).astype(np.int32)
  x = (rng.standard_normal((n, 256)).astype(np.float32) if name == "mlp" else
       np.minimum(np.searchsorted(cdf, rng.random(shape)), case.vocab - 1).astype(np.int32))
  # The machine's rates in this process's conditions (load, CPU affinity), measured in
  # a child process before and after the steps so that its memory is not this one's.
  before = _measure_apart()
  # TensorFlow, the data; not the model, not the step. The peak from here on: VmHWM
  # reset, so that a transient before (making the data) is not counted.
  start_rss = worker.status_bytes("VmRSS")
  peak_reset = worker.reset_peak_rss()
  model, counts = build_body_model(case)
  times = []

  class Timer(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
      self.t = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
      times.append(time.perf_counter() - self.t)

  model.fit([x, y], y, batch_size=case.batch, epochs=1, verbose=0, shuffle=False,
            callbacks=[Timer()])
  measured = sorted(times[2:])
  peak_rss = worker.status_bytes("VmHWM")
  after = _measure_apart()
  machine = _best(before, after)  # the faster: other jobs only slow the machine
  return {"case": name, "steps": len(times),
          "measured_step": measured[len(measured) // 2],
          "measured_peak": peak_rss - start_rss, "peak_rss": peak_rss,
          "peak_since": "the model" if peak_reset else "the process's start",
          "planned": _plan_body(case, model, counts, machine),
          "rates": dataclasses.asdict(machine)}


def _plan_body(case, model, counts, machine=None):
  """The planner's figures for the whole model: the body, the output layer's row for
  the case's tree, their sum."""
  report = planner.plan(model=model, tokens_per_step=case.tokens, counts=counts,
                        optimizer=case.optimizer, machine=machine, trees=(case.tree,),
                        adaptive=())
  row = next(r for r in report.rows if r["method"].startswith("HierarchicalSoftmax"))
  return {"body": {k: v for k, v in report.body.items() if k != "layers"},
          "body_layers": report.body["layers"], "output": row,
          "predicted_step": row["whole_step_seconds"],
          "predicted_peak": row["whole_peak_bytes"], "notes": report.notes}


def run_bodies(names=None, steps=40, progress=None):
  """Each body case in a fresh process (`body_worker`); one result a case."""
  import subprocess  # pylint: disable=import-outside-toplevel
  names = list(names or BODY_CASES)
  progress = progress or (lambda message: print(message, file=sys.stderr, flush=True))
  results = []
  for name in names:
    if name not in BODY_CASES:
      raise ValueError(f"unknown body case {name!r}; known: {', '.join(BODY_CASES)}")
    progress(f"{name}: {BODY_CASES[name].note}, model.fit for {steps} steps")
    out = subprocess.run(
        [sys.executable, "-m", "tf_hsm.bench.plan_verify", "--body-worker", name,
         "--steps", str(steps)], capture_output=True, text=True, check=False,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    if out.returncode:
      raise RuntimeError(f"body case {name} failed:\n{out.stderr[-3000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["time_ratio"] = result["measured_step"] / result["planned"]["predicted_step"]
    result["peak_ratio"] = result["measured_peak"] / result["planned"]["predicted_peak"]
    result["time_ok"] = 1 / TIME_FACTOR <= result["time_ratio"] <= TIME_FACTOR
    result["peak_ok"] = abs(result["peak_ratio"] - 1) <= PEAK_TOLERANCE
    results.append(result)
  return results


def bodies_markdown(results):
  lines = ["| model | body step predicted | output layer | whole step predicted | "
           "measured | ratio | peak predicted | measured | ratio | verdict |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
  for r in results:
    p = r["planned"]
    lines.append(
        f"| {r['case']}: {BODY_CASES[r['case']].note} | {_time(p['body']['step_seconds'])}"
        f" | {_time(p['output']['step_seconds'])} | {_time(p['predicted_step'])} | "
        f"{_time(r['measured_step'])} | {r['time_ratio']:.2f} | "
        f"{_gb(p['predicted_peak'])} | {_gb(r['measured_peak'])}"
        + ("" if r.get("peak_since", "the model") == "the model" else
           f" (since {r['peak_since']}: the kernel refused the reset)")
        + f" | {r['peak_ratio']:.2f}"
        f" | {'step ok' if r['time_ok'] else '**step misses**'}, "
        f"{'peak ok' if r['peak_ok'] else '**peak misses**'} |")
  lines += ["", "Body layers (predicted):"]
  for r in results:
    lines.append(f"- {r['case']}: " + "; ".join(
        f"{l['name']} ({l['priced_as']}) {_time(l['step_seconds'])}"
        for l in r["planned"]["body_layers"]))
  return "\n".join(lines)


def main(argv=None):
  parser = argparse.ArgumentParser(prog="python -m tf_hsm.planning --verify",
                                   description=__doc__.split("\n\n")[0])
  parser.add_argument("--cases", nargs="+", metavar="CASE",
                      help=f"cases to run, of {', '.join(CASES)} (default: all; with "
                           f"--quick: {', '.join(QUICK_CASES)})")
  parser.add_argument("--quick", action="store_true",
                      help="one small case (V=50K, D=128, T=512), about a minute")
  parser.add_argument("--repeats", type=int, help="timed steps per method (default 7; "
                                                  "quick 5)")
  parser.add_argument("--memory-limit-gb", type=float,
                      help="RSS limit per worker (default 18 GB, less when less is free)")
  parser.add_argument("--machine", help="JSON with matmul_flops, read_bytes, call_seconds"
                      " (and softmax_seconds): predict with these rates instead of the "
                      "rates measured around each case")
  parser.add_argument("--json", action="store_true", help="print the results as JSON")
  parser.add_argument("--save", metavar="FILE", help="also write the results as JSON")
  parser.add_argument("--bodies", nargs="*", metavar="MODEL",
                      help="instead: whole models in model.fit (of "
                           f"{', '.join(BODY_CASES)}; default all), the planner's body "
                           "and output layer beside the measured step and peak")
  parser.add_argument("--steps", type=int, default=40,
                      help="model.fit steps a body case (default 40; median after 2)")
  parser.add_argument("--body-worker", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.body_worker:
    print(json.dumps(body_worker(args.body_worker, args.steps), default=float))
    return 0
  if args.bodies is not None:
    results = run_bodies(args.bodies, args.steps)
    if args.save:
      with open(args.save, "w") as f:
        json.dump(results, f, indent=1, default=float)
    print(json.dumps(results, indent=1, default=float) if args.json else
          bodies_markdown(results))
    return 0
  names = [n for value in args.cases or [] for n in value.replace(",", " ").split()]
  table = QUICK_CASES if args.quick else CASES
  for name in names:
    if name not in table:
      parser.error(f"unknown case {name!r}; known: {', '.join(table)}")
  machine = json.loads(args.machine) if args.machine else None
  try:
    report = run(names, args.quick, args.repeats, args.memory_limit_gb, machine)
  except ValueError as e:
    parser.error(str(e))
  if args.save:
    with open(args.save, "w") as f:
      json.dump(report, f, indent=1, default=float)
  print(json.dumps(report, indent=1, default=float) if args.json else markdown(report))
  return 0


if __name__ == "__main__":
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  sys.exit(main())
