"""Slots masked with a bias of -inf (classes a model must never predict, a node's children
left out of its softmax): a node whose first tiles of children are all masked folds
(max -inf, sum 0) from them, so the ops give the float64 reference's values, not NaN,
on every path (few rows, the blocked one-node path, wide groups, small nodes), and a NaN
logit among masked children still makes the node's log-sum-exp NaN."""

import numpy as np
import pytest

import tf_hsm
from oracle import log_prob_reference
from support import taped_log_prob as _taped


def _masked_biases(rng, tree, dtype, share=0.75):
  """Biases with the first SHARE of every node's children (at least one left) at -inf."""
  biases = rng.normal(size=tree.num_slots).astype(dtype)
  for node in range(tree.num_nodes):
    begin, end = tree.child_range(node)
    biases[begin:begin + min(int(share * (end - begin)), end - begin - 1)] = -np.inf
  return biases


def _reachable_classes(tree, biases):
  return np.array([c for c in range(tree.num_classes)
                   if all(np.isfinite(biases[slot]) for _, slot in tree.path(c))])


def _log_prob_all_reference(hidden, weights, biases, tree):
  """Every class's log-probability in float64, node by node."""
  h, w, b = (np.asarray(v, np.float64) for v in (hidden, weights, biases))
  node_lsm = []
  for node in range(tree.num_nodes):
    begin, end = tree.child_range(node)
    z = h @ w[begin:end].T + b[begin:end]
    m = z.max(axis=1, keepdims=True)
    node_lsm.append(z - (m + np.log(np.exp(z - m).sum(axis=1, keepdims=True))))
  out = np.zeros((len(h), tree.num_classes))
  for c in range(tree.num_classes):
    for node, slot in tree.path(c):
      out[:, c] += node_lsm[node][:, slot - tree.child_range(node)[0]]
  return out


TREES = {
    "flat_2000": lambda: tf_hsm.Tree.flat(2000),
    "nested": lambda: tf_hsm.Tree.from_nested([list(range(300)), [300, 301, 302], 303,
                                               list(range(304, 1604))]),
    "two_level": lambda: tf_hsm.Tree.two_level(3000),
    "balanced_200": lambda: tf_hsm.Tree.balanced(6000, 200),  # nodes wider than a tile
    "huffman8": lambda: tf_hsm.Tree.huffman(np.arange(1, 500, dtype=np.float64), 8),
    "binary": lambda: tf_hsm.Tree.huffman(np.arange(1, 300, dtype=np.float64)),
}


@pytest.mark.parametrize("name", sorted(TREES))
@pytest.mark.parametrize("rows", [8, 200])  # 200: blocked one-node path and wide groups
@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-9), (np.float32, 2e-4)])
def test_masked_children_give_the_reference(rng, name, rows, dtype, tol):
  tree = TREES[name]()
  hidden = rng.normal(size=(rows, 6)).astype(dtype)
  weights = (0.4 * rng.normal(size=(tree.num_slots, 6))).astype(dtype)
  biases = _masked_biases(rng, tree, dtype)
  targets = rng.choice(_reachable_classes(tree, biases), size=rows)
  ref = log_prob_reference(hidden, weights, biases, tree, targets)
  got, gh, gw, gb = _taped(hidden, weights, biases, tree, targets)
  for g, r in zip((got, gh, gw, gb), ref):
    assert np.isfinite(g).all()
    np.testing.assert_allclose(g, r, rtol=tol, atol=tol * max(1.0, np.abs(r).max()))
  some = slice(0, 40)
  all_ref = _log_prob_all_reference(hidden[some], weights, biases, tree)
  all_got = tf_hsm.log_prob_all(hidden[some], weights, biases, tree).numpy()
  np.testing.assert_array_equal(np.isneginf(all_got), np.isneginf(all_ref))
  finite = np.isfinite(all_ref)
  np.testing.assert_allclose(all_got[finite], all_ref[finite], rtol=tol, atol=10 * tol)
  values, classes = (t.numpy() for t in tf_hsm.top_k(hidden[some], weights, biases, tree, 5))
  best = np.argsort(-all_ref, axis=1, kind="stable")[:, :5]
  np.testing.assert_array_equal(classes, best)
  np.testing.assert_allclose(values, np.take_along_axis(all_ref, best, 1), rtol=tol,
                             atol=10 * tol)
  drawn = tf_hsm.sample(hidden, weights, biases, tree, seed=3).numpy()
  assert np.isin(drawn, _reachable_classes(tree, biases)).all()  # never a masked class


@pytest.mark.parametrize("rows", [8, 200])
def test_a_nan_logit_among_masked_children_makes_the_node_nan(rng, rows):
  # Every class masked but class 0, and one masked class's row NaN: its logit is NaN in
  # partitions of logits that are otherwise all -inf. A dense log_softmax is NaN; so are
  # the ops, whether the node is swept or cut into partitions and merged.
  tree = tf_hsm.Tree.flat(20_000)
  hidden = rng.normal(size=(rows, 5))
  weights = 0.3 * rng.normal(size=(20_000, 5))
  biases = np.full(20_000, -np.inf)
  biases[0] = 0.1
  clean = tf_hsm.log_prob_all(hidden, weights, biases, tree).numpy()
  assert (clean[:, 0] == 0).all() and np.isneginf(clean[:, 1:]).all()
  weights[17_000] = np.nan
  assert np.isnan(tf_hsm.log_prob_all(hidden, weights, biases, tree).numpy()).all()
  assert np.isnan(tf_hsm.top_k(hidden, weights, biases, tree, 3)[0].numpy()).all()
  targets = np.zeros(rows, np.int64)
  assert np.isnan(tf_hsm.log_prob(hidden, weights, biases, tree, targets).numpy()).all()
