"""Forward+backward time of `tf_hsm.AdaptiveSoftmax` beside a full softmax, on the
shapes PyTorch's `nn.AdaptiveLogSoftmaxWithLoss` was measured at on this machine kind.

    python -m tf_hsm.bench.adaptive [--cases B,D] [--rounds 15] [--full]

A step is the mean log-probability of Zipf(1) targets and its gradient with respect to
the hidden states and every weight (no optimizer update), in a `tf.function`. The
methods run interleaved, one call each per round; the median is reported.
PyTorch's figures on this machine kind (2.13 CPU, 2 threads, the same step): B 84.7 ms,
D 438 ms; they are printed beside ours, not re-measured (PyTorch is not a dependency).
"""

import argparse
import statistics
import time

import numpy as np
import tensorflow as tf

from tf_hsm.adaptive import AdaptiveSoftmax
from tf_hsm.bench.methods import force

CASES = {
    # name: (classes, hidden, tokens, cutoffs, PyTorch's ms on this machine kind)
    "B": (100_000, 512, 640, [2000, 20000], 84.7),
    "D": (1_000_000, 300, 256, [2000, 20000, 200000], 438.0),
}


def _zipf_targets(num_classes, tokens, rng):
  probs = 1.0 / np.arange(1, num_classes + 1)
  return rng.choice(num_classes, tokens, p=probs / probs.sum())


def _adaptive_step(num_classes, dim, cutoffs, tail, counts):
  layer = AdaptiveSoftmax(num_classes, cutoffs, div_value=4.0, tail=tail, counts=counts)
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


def measure(case, rounds=15, full=False, seed=0):
  """{method: (median ms, parameters)} for one case."""
  num_classes, dim, tokens, cutoffs, _ = CASES[case]
  rng = np.random.default_rng(seed)
  counts = 1.0 / np.arange(1, num_classes + 1)
  hidden = tf.constant(rng.standard_normal((tokens, dim)), tf.float32)
  targets = tf.constant(_zipf_targets(num_classes, tokens, rng))
  steps = {
      "adaptive flat": _adaptive_step(num_classes, dim, cutoffs, "flat", counts),
      "adaptive two_level": _adaptive_step(num_classes, dim, cutoffs, "two_level", counts),
  }
  if full:
    steps["full softmax"] = _full_step(num_classes, dim)
  times = {name: [] for name in steps}
  for step, _ in steps.values():  # trace and warm up
    force(step(hidden, targets))
  for _ in range(rounds):
    for name, (step, _) in steps.items():
      start = time.perf_counter()
      force(step(hidden, targets))
      times[name].append(time.perf_counter() - start)
  return {name: (1e3 * statistics.median(times[name]), steps[name][1]) for name in steps}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--cases", default="B,D")
  parser.add_argument("--rounds", type=int, default=15)
  parser.add_argument("--full", action="store_true",
                      help="also time a full softmax (seconds a step at D)")
  args = parser.parse_args(argv)
  print("| case | method | fwd+bwd ms (median) | parameters | PyTorch adaptive ms |")
  print("| --- | --- | --- | --- | --- |")
  for case in args.cases.split(","):
    if case not in CASES:
      parser.error(f"unknown case {case!r}; known: {', '.join(CASES)}")
    for name, (ms, params) in measure(case, args.rounds, args.full).items():
      print(f"| {case} | {name} | {ms:.1f} | {params / 1e6:.1f}M | {CASES[case][4]} |",
            flush=True)


if __name__ == "__main__":
  main()
