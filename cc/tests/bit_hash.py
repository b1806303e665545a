"""sha256 of the outputs of every tf_hsm op over many trees, dtypes and batch sizes.

Proves that a change to cc/ keeps every output bit: run it once with the library before
the change and once with the library after, and compare the printed hashes.

    .venv/bin/python cc/tests/bit_hash.py --lib /tmp/baseline_lib/_hsm_ops.so > old.txt
    .venv/bin/python cc/tests/bit_hash.py --lib bazel-bin/cc/_hsm_ops.so > new.txt
    diff old.txt new.txt

The library is loaded through the tf_hsm package itself (its loader takes the
_hsm_ops.so beside it): the package named by --package (default: the repository's
tf_hsm/) is copied to a temporary directory with the given library beside it, so the
library in tf_hsm/ is never replaced. Use one --package for both runs (a copy of tf_hsm/
taken once) when the Python package may change between them. Only the top-level tf_hsm
names are used. One line per case (its hash), then the hash of all of them.
"""

import argparse
import hashlib
import os
import shutil
import sys
import tempfile

import numpy as np

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _import_tf_hsm(lib, package):
  """tf_hsm imported from a copy of `package` with `lib` as its library."""
  work = tempfile.mkdtemp(prefix="bit_hash_")
  dest = os.path.join(work, "tf_hsm")
  shutil.copytree(package, dest, ignore=shutil.ignore_patterns("__pycache__", "_hsm_ops.*"))
  shutil.copy(lib, os.path.join(dest, "_hsm_ops.so"))
  record = os.path.splitext(lib)[0] + ".cpu"
  if os.path.exists(record):
    shutil.copy(record, os.path.join(dest, "_hsm_ops.cpu"))
  sys.path.insert(0, work)
  import tf_hsm  # pylint: disable=import-outside-toplevel
  assert os.path.dirname(tf_hsm.__file__) == dest, tf_hsm.__file__
  return tf_hsm


def _mixed_parents(rng, num_classes, fanouts):
  """A from_parents array: internal nodes with the given numbers of children (classes and
  internal nodes mixed, so depths vary), built top-down; the classes fill the rest."""
  num_internal = len(fanouts)
  parents = np.full(num_classes + num_internal, -2, np.int64)
  parents[num_classes] = -1
  # Each internal node j > 0 hangs under a random earlier internal node with room left.
  room = list(fanouts)
  for j in range(1, num_internal):
    open_nodes = [i for i in range(j) if room[i] > 1]
    parent = open_nodes[rng.randint(len(open_nodes))]
    room[parent] -= 1
    parents[num_classes + j] = num_classes + parent
  slots = [i for i in range(num_internal) for _ in range(room[i])]
  assert len(slots) == num_classes, (len(slots), num_classes)
  order = rng.permutation(num_classes)
  for c, i in zip(order, slots):
    parents[c] = num_classes + i
  return parents


def _trees(tf_hsm):
  rng = np.random.RandomState(7)
  trees = []
  for b in range(2, 28):
    trees.append((f"balanced(C,{b})", tf_hsm.Tree.balanced(int(b ** 2.5) + 3 * b + 1, b)))
  trees.append(("balanced(1,2)", tf_hsm.Tree.balanced(1, 2)))
  trees.append(("balanced(5000,300)", tf_hsm.Tree.balanced(5000, 300)))
  # One node over 2^20 / 64 children: a one-tile group too large for the one-pass backward.
  trees.append(("balanced(20000,20000)", tf_hsm.Tree.balanced(20000, 20000)))
  # Levels whose coefficients pass the backward's budget (recomputed for dW).
  trees.append(("balanced(150000,150000)", tf_hsm.Tree.balanced(150000, 150000)))
  trees.append(("two_level(1000)", tf_hsm.Tree.two_level(1000)))
  trees.append(("two_level(3000,zipf)",
                tf_hsm.Tree.two_level(3000, 1.0 / np.arange(1, 3001) ** 1.1)))
  counts = rng.zipf(1.3, 4000).astype(np.float64)
  for b in (2, 8, 32):
    trees.append((f"huffman(4000,{b})", tf_hsm.Tree.huffman(counts, b)))
  trees.append(("huffman(300,3)", tf_hsm.Tree.huffman(rng.rand(300), 3)))
  # A node with one child, under a root of several.
  trees.append(("single_child", tf_hsm.Tree.from_parents([5, 4, 4, 4, -1, 4])))
  fanout_sets = [
      [3, 40, 2, 9, 8, 1, 17, 5, 2, 300, 12, 4],
      [200, 2, 2, 2, 2, 33, 7, 90, 1, 3, 65, 8, 8, 11],
      [6, 5, 4, 3, 2, 9, 10, 129, 2, 2, 2, 2, 2, 2, 2, 2, 2],
  ]
  for n, fanouts in enumerate(fanout_sets):
    num_classes = sum(fanouts) - (len(fanouts) - 1)
    trees.append((f"mixed{n}", tf_hsm.Tree.from_parents(_mixed_parents(rng, num_classes,
                                                                        fanouts))))
  deep = [2] * 40 + [30, 9, 8, 70]
  trees.append(("mixed_deep", tf_hsm.Tree.from_parents(
      _mixed_parents(rng, sum(deep) - (len(deep) - 1), deep))))
  return trees


_BATCHES = (1, 2, 5, 17, 63, 64, 65, 130, 200, 300)
_DIMS = (1, 3, 8, 16, 33, 64, 100)


def _digest(values):
  h = hashlib.sha256()
  for v in values:
    if v is None:
      h.update(b"none")
      continue
    if hasattr(v, "indices") and hasattr(v, "values"):  # IndexedSlices
      h.update(np.ascontiguousarray(v.indices.numpy()).tobytes())
      v = v.values
    a = np.ascontiguousarray(v.numpy() if hasattr(v, "numpy") else v)
    h.update(str(a.dtype).encode() + str(a.shape).encode() + a.tobytes())
  return h.hexdigest()


def _case(tf, tf_hsm, tree, dtype, batch, dim, use_bias, seed, big):
  """{op name: digest} for one tree and input set."""
  rng = np.random.RandomState(seed)
  hidden = tf.constant((rng.randn(batch, dim) / np.sqrt(dim)).astype(dtype))
  weights = tf.constant(rng.randn(tree.num_slots, dim).astype(dtype))
  biases = tf.constant(rng.randn(tree.num_slots).astype(dtype)) if use_bias else None
  targets = tf.constant(rng.randint(0, tree.num_classes, batch), tf.int64)
  scale = tf.constant(rng.rand(batch).astype(dtype))
  out = {}
  out["log_prob"] = _digest([tf_hsm.log_prob(hidden, weights, biases, tree, targets)])
  params = [hidden, weights] + ([biases] if use_bias else [])
  upstream = tf.constant(rng.randn(batch).astype(dtype))
  with tf.GradientTape() as tape:
    tape.watch(params)
    lp = tf_hsm.log_prob(hidden, weights, biases, tree, targets)  # saving the logits
  out["log_prob_taped"] = _digest([lp])
  out["log_prob_grads"] = _digest(tape.gradient(lp, params, output_gradients=upstream))
  with tf.GradientTape(persistent=True) as tape:
    tape.watch(params)
    loss = tf_hsm.nll_loss(hidden, weights, biases, tree, targets, loss_scale=scale)
    loss3 = loss * 3  # another upstream: the gradient is recomputed from scratch
  out["nll_loss"] = _digest([loss])
  out["nll_loss_grads"] = _digest(tape.gradient(loss, params))
  out["nll_loss_grads_recomputed"] = _digest(tape.gradient(loss3, params))
  del tape
  w_var = tf.Variable(weights)
  b_var = tf.Variable(biases) if use_bias else None
  lp_sgd, h_grad = tf_hsm.sgd_step(hidden, w_var, b_var, tree, targets, 0.5, loss_scale=scale)
  out["sgd_step"] = _digest([lp_sgd, h_grad, w_var, b_var])
  k = min(5, tree.num_classes)
  out["top_k"] = _digest(list(tf_hsm.top_k(hidden, weights, biases, tree, k,
                                           return_num_expanded=True)))
  if big:
    out["log_prob_all"] = _digest([tf_hsm.log_prob_all(
        hidden, weights, biases, tree, class_range=(7, min(tree.num_classes, 3000)))])
  else:
    out["log_prob_all"] = _digest([tf_hsm.log_prob_all(hidden, weights, biases, tree)])
    lo, hi = tree.num_classes // 3, max(tree.num_classes // 3, 2 * tree.num_classes // 3)
    out["log_prob_all_range"] = _digest([tf_hsm.log_prob_all(
        hidden, weights, biases, tree, class_range=(lo, hi))])
  out["sample"] = _digest([tf_hsm.sample(hidden, weights, biases, tree, seed=1234 + seed),
                           tf_hsm.sample(hidden, weights, biases, tree, seed=99,
                                         temperature=0.7)])
  m = 1 + seed % 4
  candidates = tf.constant(rng.randint(0, tree.num_classes, (batch, m)), tf.int64)
  out["log_prob_candidates"] = _digest([tf_hsm.log_prob_candidates(
      hidden, weights, biases, tree, candidates)])
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--lib", default=os.path.join(_REPO, "tf_hsm", "_hsm_ops.so"),
                      help="the op library to hash (default: tf_hsm/_hsm_ops.so)")
  parser.add_argument("--package", default=os.path.join(_REPO, "tf_hsm"),
                      help="the tf_hsm package directory to load it with")
  parser.add_argument("--per-op", action="store_true", help="one line per op and case")
  args = parser.parse_args()
  lib = os.path.abspath(args.lib)
  tf_hsm = _import_tf_hsm(lib, os.path.abspath(args.package))
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  total = hashlib.sha256()
  num_cases = 0
  for t, (name, tree) in enumerate(_trees(tf_hsm)):
    big = tree.num_slots > 10000
    for v, (dtype, use_bias) in enumerate([(np.float32, True), (np.float32, False),
                                           (np.float64, True), (np.float64, False)]):
      n = 4 * t + v
      batch = _BATCHES[n % len(_BATCHES)]
      dim = _DIMS[(n // 3) % len(_DIMS)]
      if big:
        dim = min(dim, 16)
      if tree.num_slots > 100000:
        batch = 300
      digests = _case(tf, tf_hsm, tree, dtype, batch, dim, use_bias, n, big)
      label = f"{name} {np.dtype(dtype).name} T={batch} D={dim} bias={int(use_bias)}"
      line = hashlib.sha256("".join(f"{k}={d}" for k, d in sorted(digests.items())).encode())
      print(f"{label}: {line.hexdigest()[:24]}", flush=True)
      if args.per_op:
        for k, d in sorted(digests.items()):
          print(f"    {k}: {d[:24]}")
      total.update(line.digest())
      num_cases += 1
  print(f"{num_cases} cases, {len(_trees(tf_hsm))} trees; all: {total.hexdigest()}")


if __name__ == "__main__":
  main()
