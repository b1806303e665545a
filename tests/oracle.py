"""Float64 references written straight from the definition, random trees of every kind, and
a small learnable problem for the training tests.

Shared by the op tests and the baseline tests.
"""

import numpy as np
import tensorflow as tf

from tf_hsm.tree import Tree


def random_inputs(rng, tree, batch_shape, dim, dtype, bias=True):
  """hidden [*batch_shape, dim], weights [num_slots, dim], biases (or None), targets."""
  hidden = rng.normal(size=batch_shape + (dim,)).astype(dtype)
  weights = (0.5 * rng.normal(size=(tree.num_slots, dim))).astype(dtype)
  biases = rng.normal(size=tree.num_slots).astype(dtype) if bias else None
  targets = rng.integers(0, tree.num_classes, size=batch_shape)
  return hidden, weights, biases, targets


def learnable_problem(rng):
  """A small problem a few optimizer steps visibly improve: a 2-level tree over 1,000
  classes whose targets depend on the features, and fresh tf.Variable weights and biases.

  Returns (tree, features [512, 16], targets [512], weights, biases)."""
  tree = Tree.two_level(1000)
  features = rng.normal(size=(512, 16)).astype(np.float32)
  targets = (np.abs(features[:, 0]) * 300).astype(np.int64) % 1000
  weights = tf.Variable(0.01 * rng.normal(size=(tree.num_slots, 16)).astype(np.float32))
  biases = tf.Variable(np.zeros(tree.num_slots, np.float32))
  return tree, features, targets, weights, biases


def random_mixed_tree(rng, max_depth=8, max_branching=50, p_internal=0.3, max_classes=400):
  """A random tree whose nodes mix classes and sub-nodes (single-child nodes included),
  given to Tree.from_parents with shuffled class and node indices."""
  children = [[]]  # per internal node: list of ("c", ordinal) / ("n", node)
  depth = [0]
  num_classes = 0
  n = 0
  while n < len(children):
    for _ in range(int(rng.integers(1, max_branching + 1))):
      if depth[n] + 1 < max_depth and num_classes < max_classes and rng.random() < p_internal:
        children[n].append(("n", len(children)))
        children.append([])
        depth.append(depth[n] + 1)
      else:
        children[n].append(("c", num_classes))
        num_classes += 1
    n += 1
  num_nodes = len(children)
  class_perm = rng.permutation(num_classes)
  node_perm = rng.permutation(num_nodes)  # node k gets parents-index C + node_perm[k]
  parents = np.full(num_classes + num_nodes, -1, dtype=np.int64)
  for k, kids in enumerate(children):
    for kind, idx in kids:
      if kind == "c":
        parents[class_perm[idx]] = num_classes + node_perm[k]
      else:
        parents[num_classes + node_perm[idx]] = num_classes + node_perm[k]
  return Tree.from_parents(parents)


def chain_tree(num_classes, chain_length):
  """Every class hangs below its own chain of single-child nodes under the root."""
  nested = []
  for c in range(num_classes):
    item = c
    for _ in range(chain_length):
      item = [item]
    nested.append(item)
  return Tree.from_nested(nested)


def trees_of_every_kind(rng):
  """(name, tree) pairs covering every builder and shape the ops must handle."""
  counts = rng.zipf(1.3, size=300).astype(np.float64)
  return [
      ("mixed", random_mixed_tree(rng)),
      ("mixed_deep", random_mixed_tree(rng, max_depth=8, max_branching=4, p_internal=0.6)),
      ("mixed_wide", random_mixed_tree(rng, max_depth=3, max_branching=50, p_internal=0.1)),
      ("balanced", Tree.balanced(97, 4)),
      # Walked nodes of 7 children: a step wider than a float64 vector with AVX2 (4 lanes).
      ("balanced7", Tree.balanced(60, 7)),
      ("binary", Tree.balanced(64, 2)),
      ("huffman", Tree.huffman(counts)),
      ("huffman3", Tree.huffman(counts, branching=3)),
      ("two_level", Tree.two_level(200)),
      ("two_level_counts", Tree.two_level(300, counts=counts)),
      ("vectors", Tree.from_vectors(rng.standard_normal((300, 6)), counts=counts,
                                    branching=[7, 3])),
      ("chains", chain_tree(7, 4)),
      ("one_level", Tree.from_nested(list(range(13)))),
      ("single_class", Tree.from_nested([0])),
  ]


def log_prob_reference(hidden, weights, biases, tree, targets):
  """log P(target | h) and its gradients (upstream gradient 1) in float64.

  Returns (log_prob [N], d_hidden [N, D], d_weights [S, D], d_biases [S]).
  """
  shape = np.shape(hidden)
  h = np.asarray(hidden, np.float64).reshape(int(np.prod(shape[:-1])), shape[-1])
  w = np.asarray(weights, np.float64)
  b = np.zeros(len(w)) if biases is None else np.asarray(biases, np.float64)
  y = np.asarray(targets).reshape(-1)
  out = np.zeros(len(y))
  dh = np.zeros_like(h)
  dw = np.zeros_like(w)
  db = np.zeros_like(b)
  for i, c in enumerate(y):
    for node, slot in tree.path(int(c)):
      begin, end = tree.child_range(node)
      z = w[begin:end] @ h[i] + b[begin:end]
      m = z.max()
      lse = m + np.log(np.exp(z - m).sum())
      out[i] += z[slot - begin] - lse
      coef = -np.exp(z - lse)
      coef[slot - begin] += 1.0
      dh[i] += coef @ w[begin:end]
      dw[begin:end] += np.outer(coef, h[i])
      db[begin:end] += coef
  return out, dh, dw, db


def numerical_gradient(loss, variable, step=1e-6):
  """d loss() / d variable by central differences, one entry at a time (float64
  variables; `loss` reads the variable's current value)."""
  start = np.asarray(variable)
  numeric = np.zeros(start.shape)
  for j in range(start.size):
    delta = np.zeros(start.shape)
    delta.reshape(-1)[j] = step
    variable.assign(start + delta)
    up = float(loss())
    variable.assign(start - delta)
    numeric.reshape(-1)[j] = (up - float(loss())) / (2 * step)
    variable.assign(start)
  return numeric


def assert_gradients_match(loss, variables, rtol=1e-6, atol=1e-7):
  """The tape's gradient of `loss()` to each of `variables` (float64) equals its
  central differences (`numerical_gradient`)."""
  with tf.GradientTape() as tape:
    total = loss()
  analytic = [tf.convert_to_tensor(g) for g in tape.gradient(total, variables)]
  for variable, grad in zip(variables, analytic):
    np.testing.assert_allclose(grad, numerical_gradient(loss, variable), rtol=rtol,
                               atol=atol, err_msg=variable.name)
