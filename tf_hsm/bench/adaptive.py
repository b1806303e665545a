"""Forward+backward time of `tf_hsm.AdaptiveSoftmax` beside a full softmax, on the
shapes PyTorch's `nn.AdaptiveLogSoftmaxWithLoss` was measured at on this machine kind.

    python -m tf_hsm.bench.adaptive [--cases B,D] [--rounds 15] [--full]
        [--cutoffs 2000,20000] [--choose [--tails flat,two_level] [--machine JSON]]

A step is the mean log-probability of Zipf(1) targets and its gradient with respect to
the hidden states and every weight (no optimizer update), in a `tf.function`. The
methods run interleaved, one call each per round; the median is reported.
When PyTorch is importable (it is not a dependency: `pip install torch` beside tf_hsm),
its `nn.AdaptiveLogSoftmaxWithLoss` at the same cutoffs, div value and inputs runs
interleaved with ours (forward, `loss.backward()`, as many threads as TensorFlow's pool);
otherwise `--torch off` is implied and the figures measured on this machine kind are
printed instead (PyTorch 2.13 CPU, 2 threads: B 84.7 ms, D 438 ms).

`--cutoffs` times given cutoffs instead of the case's. `--choose` times, for each tail,
the cutoffs `tf_hsm.adaptive.choose_cutoffs` picks for the case (its counts, D, T and
div value 4, on this machine's rates measured at the start) beside the case's own
(PyTorch's usual ones) and one more hand-picked set, all interleaved, and prints the
cost model's predicted step time beside each median.
"""

import argparse
import dataclasses
import importlib.util
import json
import os
import statistics
import time

import numpy as np
import tensorflow as tf

from tf_hsm.keras.adaptive import AdaptiveSoftmax, choose_cutoffs, step_cost
from tf_hsm.bench import cases
from tf_hsm.bench.methods import force
from tf_hsm.planning import Machine

CASES = {
    # name: (classes, hidden, tokens, cutoffs, PyTorch's ms on this machine kind)
    "B": (100_000, 512, 640, [2000, 20000], 84.7),
    "D": (1_000_000, 300, 256, [2000, 20000, 200000], 438.0),
}
# A second hand-picked set per case for --choose: a smaller head and one more cluster at
# B, a larger head and one cluster fewer at D.
OTHER_CUTOFFS = {"B": [500, 5000, 50000], "D": [4000, 40000]}
DIV_VALUE = 4.0


def _adaptive_step(num_classes, dim, cutoffs, tail, counts):
  layer = AdaptiveSoftmax(num_classes, cutoffs, div_value=DIV_VALUE, tail=tail,
                          counts=counts)
  layer.build((None, dim))

  @tf.function
  def step(hidden, targets):
    with tf.GradientTape() as tape:
      tape.watch(hidden)
      loss = -tf.reduce_mean(layer(hidden, targets))
    return loss, tape.gradient(loss, [hidden] + layer.trainable_variables)

  return step, sum(int(np.prod(v.shape)) for v in layer.weights)


def _full_step(num_classes, dim):
  kernel = tf.Variable(tf.random.normal([dim, num_classes], stddev=0.02))
  bias = tf.Variable(tf.zeros([num_classes]))

  @tf.function
  def step(hidden, targets):
    with tf.GradientTape() as tape:
      tape.watch(hidden)
      logits = tf.matmul(hidden, kernel) + bias
      loss = tf.reduce_mean(
          tf.nn.sparse_softmax_cross_entropy_with_logits(labels=targets, logits=logits))
    return loss, tape.gradient(loss, [hidden, kernel, bias])

  return step, num_classes * (dim + 1)


def torch_available():
  return importlib.util.find_spec("torch") is not None


def _torch_step(num_classes, dim, cutoffs, hidden, targets):
  """PyTorch's `AdaptiveLogSoftmaxWithLoss` step on the same inputs, as a callable of
  the (ignored) TensorFlow inputs returning the loss as a float: forward, backward with
  respect to the hidden states and every weight, gradients dropped between calls."""
  import torch  # pylint: disable=import-outside-toplevel
  torch.manual_seed(0)
  torch.set_num_threads(os.cpu_count() or 1)
  module = torch.nn.AdaptiveLogSoftmaxWithLoss(dim, num_classes, list(cutoffs),
                                               div_value=DIV_VALUE, head_bias=False)
  h = torch.from_numpy(hidden.numpy()).requires_grad_(True)
  t = torch.from_numpy(targets.numpy())

  def step(unused_hidden, unused_targets):
    h.grad = None
    module.zero_grad(set_to_none=True)
    loss = -module(h, t).output.mean()
    loss.backward()
    return float(loss.detach())

  return step, sum(p.numel() for p in module.parameters())


def _interleaved(steps, hidden, targets, rounds):
  """{name: median ms} of steps {name: (step, ...)}, one call each per round."""
  times = {name: [] for name in steps}
  for step, _ in steps.values():  # trace and warm up
    force(step(hidden, targets))
  for _ in range(rounds):
    for name, (step, _) in steps.items():
      start = time.perf_counter()
      force(step(hidden, targets))
      times[name].append(time.perf_counter() - start)
  return {name: 1e3 * statistics.median(times[name]) for name in steps}


def _inputs(case, seed):
  num_classes, dim, tokens, _, _ = CASES[case]
  rng = np.random.default_rng(seed)
  hidden = tf.constant(rng.standard_normal((tokens, dim)), tf.float32)
  targets = tf.constant(cases.zipf_targets(num_classes, tokens, rng))
  return 1.0 / np.arange(1, num_classes + 1), hidden, targets


def measure(case, rounds=15, full=False, seed=0, cutoffs=None, torch=False):
  """{method: (median ms, parameters)} for one case (at `cutoffs`, default the case's);
  with `torch`, PyTorch's adaptive softmax too ("PyTorch adaptive")."""
  num_classes, dim, _, case_cutoffs, _ = CASES[case]
  cutoffs = case_cutoffs if cutoffs is None else cutoffs
  counts, hidden, targets = _inputs(case, seed)
  steps = {
      "adaptive flat": _adaptive_step(num_classes, dim, cutoffs, "flat", counts),
      "adaptive two_level": _adaptive_step(num_classes, dim, cutoffs, "two_level", counts),
  }
  if torch:
    steps["PyTorch adaptive"] = _torch_step(num_classes, dim, cutoffs, hidden, targets)
  if full:
    steps["full softmax"] = _full_step(num_classes, dim)
  medians = _interleaved(steps, hidden, targets, rounds)
  return {name: (medians[name], steps[name][1]) for name in steps}


def compare_cutoffs(case, machine, tails=("flat", "two_level"), rounds=15, seed=0):
  """Rows (tail, source, cutoffs, predicted ms, measured median ms): the cost model's
  choice beside the case's cutoffs and OTHER_CUTOFFS, every step interleaved."""
  num_classes, dim, tokens, case_cutoffs, _ = CASES[case]
  counts, hidden, targets = _inputs(case, seed)
  configs = []
  for tail in tails:
    chosen = choose_cutoffs(counts, dim, tokens, DIV_VALUE, tail, machine)
    for source, cutoffs in (("model", chosen), ("PyTorch's", case_cutoffs),
                            ("other", OTHER_CUTOFFS[case])):
      predicted = step_cost(counts, cutoffs, dim, tokens, DIV_VALUE, tail, machine)
      configs.append((tail, source, cutoffs, 1e3 * predicted["step_seconds"]))
  steps = {i: _adaptive_step(num_classes, dim, cutoffs, tail, counts)
           for i, (tail, _, cutoffs, _) in enumerate(configs)}
  medians = _interleaved(steps, hidden, targets, rounds)
  return [config + (medians[i],) for i, config in enumerate(configs)]


def _int_list(text):
  return [int(v) for v in text.split(",") if v.strip()]


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--cases", default="B,D")
  parser.add_argument("--rounds", type=int, default=15)
  parser.add_argument("--full", action="store_true",
                      help="also time a full softmax (seconds a step at D)")
  parser.add_argument("--cutoffs", type=_int_list,
                      help="time these cutoffs (e.g. 2000,20000) instead of the case's")
  parser.add_argument("--choose", action="store_true",
                      help="time the cost model's cutoffs beside two hand-picked sets")
  parser.add_argument("--tails", default="flat,two_level", help="tails for --choose")
  parser.add_argument("--machine",
                      help="JSON with matmul_flops, read_bytes, call_seconds for --choose "
                      "(default: measured at the start)")
  parser.add_argument("--torch", choices=("auto", "on", "off"), default="auto",
                      help="time PyTorch's adaptive softmax beside ours: when importable "
                      "(auto), always (on: an error without it), never")
  args = parser.parse_args(argv)
  if args.torch == "on" and not torch_available():
    parser.error("--torch on: PyTorch is not importable (pip install torch)")
  use_torch = args.torch == "on" or (args.torch == "auto" and torch_available())
  case_names = args.cases.split(",")
  for case in case_names:
    if case not in CASES:
      parser.error(f"unknown case {case!r}; known: {', '.join(CASES)}")
  if args.choose:
    machine = (Machine(**json.loads(args.machine)) if args.machine else Machine.measure())
    print(f"machine: {json.dumps(dataclasses.asdict(machine))}\n")
    print("| case | tail | cutoffs | from | predicted ms | measured ms (median) | "
          "measured / model's |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for case in case_names:
      rows = compare_cutoffs(case, machine, args.tails.split(","), args.rounds)
      model = {tail: ms for tail, source, _, _, ms in rows if source == "model"}
      for tail, source, cutoffs, predicted, ms in rows:
        print(f"| {case} | {tail} | {cutoffs} | {source} | {predicted:.1f} | {ms:.1f} | "
              f"{ms / model[tail]:.2f} |", flush=True)
    return
  torch_column = ("PyTorch adaptive ms, measured beside" if use_torch else
                  "PyTorch adaptive ms, measured before on this machine kind")
  print(f"| case | method | cutoffs | fwd+bwd ms (median) | parameters | {torch_column} |")
  print("| --- | --- | --- | --- | --- | --- |")
  for case in case_names:
    cutoffs = args.cutoffs or CASES[case][3]
    results = measure(case, args.rounds, args.full, cutoffs=cutoffs, torch=use_torch)
    reference = results["PyTorch adaptive"][0] if use_torch else CASES[case][4]
    for name, (ms, params) in results.items():
      shown = "-" if name == "full softmax" else cutoffs
      print(f"| {case} | {name} | {shown} | {ms:.1f} | {params / 1e6:.1f}M | "
            f"{reference:.1f} ({reference / ms:.1f}x this) |", flush=True)


if __name__ == "__main__":
  main()
