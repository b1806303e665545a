"""Speed of tf_hsm.serving against the op and against a dense top-k, in one process:
`python -m tf_hsm.serving.bench [--classes 1000000] [--dim 300] [--reps 15]`.

A Huffman tree (branching 8) over Zipf(1) counts; weights N(0, 1/D); hidden states made
to point at a Zipf-drawn class (the sum of its path's rows, times `--peak`, plus noise),
so that each row is as confident as a trained model's (`--peak 0` gives flat rows, where
the search's proofs fail and top_k falls back to the beams and the exhaustive pass); where
top_k's rows were proved is printed per batch. Methods are timed
interleaved (one call of each in turn, `--reps` rounds) inside tf.function, with and
without XLA; the medians are printed in ms. Then the exported SavedModel's size and load
time, and the largest table LiteRT's 2 GB flatbuffer admits.

This module times the op as well, so (unlike the rest of tf_hsm.serving) it imports tf_hsm.
"""

import argparse
import os
import shutil
import statistics
import tempfile
import time

import numpy as np
import tensorflow as tf

from tf_hsm.serving import hsm

FLATBUFFER_LIMIT = 2**31


def _tree_and_weights(classes, dim, seed):
  import tf_hsm  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(seed)
  counts = 1.0 / np.arange(1, classes + 1)
  tree = tf_hsm.Tree.huffman(counts, branching=8)
  weights = rng.standard_normal((tree.num_slots, dim), np.float32) / np.float32(np.sqrt(dim))
  biases = np.zeros(tree.num_slots, np.float32)
  return tree, counts, weights, biases


def _hidden(tree, counts, weights, batch, peak, rng):
  dim = weights.shape[1]
  hidden = rng.standard_normal((batch, dim)).astype(np.float32) / np.float32(np.sqrt(dim))
  if peak:
    p = counts / counts.sum()
    for row, c in enumerate(rng.choice(len(counts), size=batch, p=p)):
      slots = [s for _, s in tree.path(int(c))]
      hidden[row] += peak * weights[slots].sum(0)
  return hidden


def search_stages(stock, hidden, weights, biases, k):
  """Where top_k's rows were proved: the best-first search (with its iterations), then
  each beam, then the exhaustive pass (percent of rows)."""
  # pylint: disable=protected-access
  _, _, proved, steps = hsm._best_first(stock, hidden, weights, biases, k)
  proved = proved.numpy()
  rows = max(1, proved.size)
  parts = [f"best-first {100 * proved.sum() / rows:.0f}% in {int(steps)} iterations"]
  rest = ~proved
  for width in hsm.beam_widths(k, stock.num_classes):
    if not rest.any() or width >= stock.num_classes:
      break
    codes, scores, bound = hsm._beam(stock, hidden, weights, biases, width)
    best, _ = hsm._finish(codes, scores, k)
    ok = hsm._proven(best, bound, k).numpy()
    parts.append(f"beam {width} {100 * (rest & ok).sum() / rows:.0f}%")
    rest &= ~ok
  parts.append(f"exhaustive {100 * rest.sum() / rows:.0f}%")
  return ", ".join(parts)


def _time(fns, reps):
  for fn in fns.values():   # trace and warm up
    fn()
    fn()
  times = {name: [] for name in fns}
  for _ in range(reps):
    for name, fn in fns.items():
      start = time.perf_counter()
      out = fn()
      tf.nest.map_structure(lambda t: t.numpy() if hasattr(t, "numpy") else t, out)
      times[name].append(time.perf_counter() - start)
  return {name: 1e3 * statistics.median(t) for name, t in times.items()}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--classes", type=int, default=1_000_000)
  parser.add_argument("--dim", type=int, default=300)
  parser.add_argument("--k", type=int, default=10)
  parser.add_argument("--reps", type=int, default=15)
  parser.add_argument("--peak", type=float, default=3.0)
  parser.add_argument("--batches", default="1,64")
  parser.add_argument("--no-export", action="store_true")
  args = parser.parse_args(argv)
  import tf_hsm  # pylint: disable=import-outside-toplevel
  start = time.perf_counter()
  tree, counts, weights_np, biases_np = _tree_and_weights(args.classes, args.dim, 0)
  print(f"tree: {tree!r}, built with weights in {time.perf_counter() - start:.1f} s")
  weights = tf.Variable(weights_np)
  biases = tf.Variable(biases_np)
  dense = tf.Variable(weights_np[tree.class_slot])      # [V, D]: one row per class
  dense_bias = tf.Variable(np.zeros(args.classes, np.float32))
  del weights_np
  stock = hsm.stock_tree(tree)
  k = args.k
  rng = np.random.default_rng(1)
  for batch in [int(b) for b in args.batches.split(",")]:
    hidden = tf.constant(_hidden(tree, counts, weights.numpy(),
                                 batch, args.peak, rng))
    targets = tf.constant(rng.integers(0, args.classes, batch))
    fns = {}
    for xla in (False, True):
      tag = "_xla" if xla else ""
      fns["stock_top_k" + tag] = tf.function(
          lambda: hsm.top_k(hidden, weights, biases, stock, k), jit_compile=xla)
      fns["dense_top_k" + tag] = tf.function(
          lambda: tf.math.top_k(tf.nn.log_softmax(
              tf.matmul(hidden, dense, transpose_b=True) + dense_bias), k),
          jit_compile=xla)
      fns["stock_log_prob" + tag] = tf.function(
          lambda: hsm.log_prob(hidden, weights, biases, stock, targets), jit_compile=xla)
    fns["op_top_k"] = tf.function(lambda: tf_hsm.top_k(hidden, weights, biases, tree, k))
    fns["op_log_prob"] = tf.function(
        lambda: tf_hsm.log_prob(hidden, weights, biases, tree, targets))
    medians = _time(fns, args.reps)
    stages = search_stages(stock, tf.cast(hidden, tf.float32), weights, biases, k)
    print(f"\nbatch {batch} (V={args.classes}, D={args.dim}, k={k}, peak={args.peak}); "
          f"rows proved: {stages}; median ms of {args.reps}:")
    for name, ms in medians.items():
      print(f"  {name:22s} {ms:9.3f}")
    for a, b in (("dense_top_k", "stock_top_k"), ("stock_top_k", "op_top_k"),
                 ("stock_log_prob", "op_log_prob"), ("dense_top_k_xla", "stock_top_k_xla"),
                 ("stock_top_k_xla", "op_top_k"), ("stock_log_prob_xla", "op_log_prob")):
      print(f"  {a} / {b}: {medians[a] / medians[b]:.2f}x")
  if not args.no_export:
    _export_figures(tree, weights, biases, args)
  _flatbuffer_limits(args.dim)


def _export_figures(tree, weights, biases, args):
  import keras  # pylint: disable=import-outside-toplevel
  import tf_hsm  # pylint: disable=import-outside-toplevel
  from tf_hsm import serving  # pylint: disable=import-outside-toplevel
  hidden_in = keras.Input([args.dim], name="hidden")
  targets = keras.Input([], dtype="int32", name="targets")
  layer = tf_hsm.HierarchicalSoftmax(tree)
  model = keras.Model([hidden_in, targets], layer(hidden_in, targets))
  layer.kernel.assign(weights)
  layer.bias.assign(biases)
  folder = tempfile.mkdtemp(prefix="tf_hsm_serving_bench_")
  try:
    start = time.perf_counter()
    serving.export(model, folder, k=args.k, log_prob_all=False, sample=False)
    written = time.perf_counter() - start
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(folder)
               for f in files)
    start = time.perf_counter()
    loaded = tf.saved_model.load(folder)
    load = time.perf_counter() - start
    start = time.perf_counter()
    loaded.signatures["top_k"](hidden=tf.zeros([1, args.dim]))
    first = time.perf_counter() - start
    print(f"\nSavedModel at V={args.classes}: {size / 2**20:.0f} MiB, written in "
          f"{written:.1f} s, loaded in {load:.1f} s, first top_k call {first:.1f} s")
  finally:
    shutil.rmtree(folder, ignore_errors=True)


def _flatbuffer_limits(dim):
  print("\nLiteRT's flatbuffer holds the table as constants; 2 GiB admits (8-ary Huffman "
        "tree, float32, S ~ 8/7 C slots):")
  for d in sorted({dim, 128, 256, 512}):
    per_class = 8 / 7 * (d * 4 + 4 * 4)   # the row, and ~4 int32 tree entries a slot
    print(f"  D={d}: up to ~{FLATBUFFER_LIMIT / per_class / 1e6:.2f}M classes")


if __name__ == "__main__":
  main()
