"""Padding at no cost: `tf_hsm.log_prob(..., skip_padding=True)` walks no path for a
padded token, where a layer without it walks a stand-in class's path and throws the
result away.

    python -m tf_hsm.bench.padding [--rounds 7] [--padding 0.3]

At D=300, T=3,200, Zipf(1) targets, on a 16-ary tree from vectors below a head of the
128 most frequent classes at V=1M and on Huffman(8) at V=10K: forward and backward of
the summed log-probability over the real tokens, interleaved in one process, for

- the batch without padding, plain and with `skip_padding` (what the flag costs);
- the batch with a fraction `--padding` of its tokens padding (at random places),
  padded tokens walked as class 0 and masked after (what the layers did before), and
  skipped (-1 with `skip_padding`).

Prints a JSON line a case: medians in ms, the ratios, and whether each pair of steps
gave one loss.
"""

import argparse
import json

import numpy as np
import tensorflow as tf

import tf_hsm
from tf_hsm.bench import cases
from tf_hsm.bench.wide import interleaved

DIM, TOKENS = 300, 3200


def _step(tree, hidden, table, biases, targets, skip):
  real = targets >= 0
  walked = targets if skip else tf.where(real, targets, tf.zeros_like(targets))

  @tf.function
  def step():
    with tf.GradientTape() as tape:
      tape.watch(hidden)
      log_prob = tf_hsm.log_prob(hidden, table, biases, tree, walked, skip_padding=skip)
      loss = -tf.reduce_sum(tf.where(real, log_prob, tf.zeros_like(log_prob)))
    grads = tape.gradient(loss, [hidden, table, biases])
    return loss, grads[0], grads[1].values[:1, :1]
  return step


def padding_case(name, tree, num_classes, fraction, rounds, rng):
  """{case, ms, ratios} for one tree: the four steps interleaved."""
  hidden = tf.constant(rng.normal(size=(TOKENS, DIM)).astype(np.float32) * 0.1)
  table = tf.Variable(tf.random.normal([tree.num_slots, DIM], stddev=0.01, seed=1))
  biases = tf.Variable(tf.zeros([tree.num_slots]))
  full = cases.zipf_targets(num_classes, TOKENS, rng)
  padded = np.where(rng.random(TOKENS) < fraction, -1, full)
  full, padded = tf.constant(full), tf.constant(padded)
  methods = {
      "no padding": _step(tree, hidden, table, biases, full, False),
      "no padding, skip_padding": _step(tree, hidden, table, biases, full, True),
      "padding walked as class 0": _step(tree, hidden, table, biases, padded, False),
      "padding skipped": _step(tree, hidden, table, biases, padded, True)}
  med = interleaved(methods, rounds)
  loss = {k: float(fn()[0]) for k, fn in methods.items()}
  return {"case": f"{name}, D={DIM}, T={TOKENS}, {fraction:.0%} padding",
          "ms": {k: round(v * 1e3, 2) for k, v in med.items()},
          "skip_padding's cost without padding":
              round(med["no padding, skip_padding"] / med["no padding"], 3),
          "speed-up from skipping":
              round(med["padding walked as class 0"] / med["padding skipped"], 3),
          # The steps compute one loss two ways each: a check of what is timed.
          "same losses": bool(
              np.isclose(loss["no padding"], loss["no padding, skip_padding"], rtol=1e-5)
              and np.isclose(loss["padding walked as class 0"], loss["padding skipped"],
                             rtol=1e-5))}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--rounds", type=int, default=7, help="timed rounds (medians)")
  parser.add_argument("--padding", type=float, default=0.3,
                      help="the fraction of the tokens that are padding (default 0.3)")
  args = parser.parse_args(argv)
  if args.rounds < 1 or not 0.0 <= args.padding < 1.0:
    parser.error("--rounds must be >= 1 and --padding in [0, 1)")
  rng = np.random.default_rng(0)
  trees = (("V=1M, 16-ary from vectors, head 128",
            lambda: cases.vectors_tree(1_000_000, 16, 128), 1_000_000),
           ("V=10K, Huffman(8)",
            lambda: tf_hsm.Tree.huffman(cases.zipf_weights(10_000), 8), 10_000))
  for name, build, num_classes in trees:
    print(json.dumps(padding_case(name, build(), num_classes, args.padding, args.rounds,
                                  rng)), flush=True)


if __name__ == "__main__":
  main()
