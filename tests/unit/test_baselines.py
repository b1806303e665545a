"""The plain-TF baselines against tf_hsm.log_prob: same log-probabilities and gradients."""

import numpy as np
import pytest
import tensorflow as tf

import tf_hsm
from tf_hsm.bench import baselines
from tf_hsm.tree import Tree
from oracle import trees_of_every_kind

import support

TOL = 1e-10



def _inputs(rng, tree, batch_shape, dim, bias=True):
  hidden = rng.normal(size=batch_shape + (dim,))
  weights = 0.5 * rng.normal(size=(tree.num_slots, dim))
  biases = rng.normal(size=tree.num_slots) if bias else None
  targets = rng.integers(0, tree.num_classes, size=batch_shape)
  return hidden, weights, biases, targets


def _value_and_grads(fn, hidden, weights, biases, *args):
  """fn's output and the gradients of sum(output * r) (a random upstream) wrt its floats."""
  h, w = tf.constant(hidden), tf.Variable(weights)
  b = None if biases is None else tf.Variable(biases)
  with tf.GradientTape() as tape:
    tape.watch(h)
    out = fn(h, w, b, *args)
    upstream = tf.cast(tf.reshape(tf.range(tf.size(out)) % 5 + 1, tf.shape(out)), out.dtype)
    total = tf.reduce_sum(out * upstream)
  grads = tape.gradient(total, [h, w] + ([b] if b is not None else []))
  shapes = [hidden.shape, weights.shape] + ([biases.shape] if b is not None else [])
  return out.numpy(), [support.dense(g, s) for g, s in zip(grads, shapes)]


@pytest.mark.parametrize("name", sorted(baselines.EXACT_BASELINES))
def test_exact_baselines_match_op_on_every_tree_kind(rng, name):
  fn = baselines.EXACT_BASELINES[name]
  for i, (kind, tree) in enumerate(trees_of_every_kind(rng)):
    bias = i % 3 != 0
    batch_shape = (2, 3) if i % 2 else (7,)
    hidden, weights, biases, targets = _inputs(rng, tree, batch_shape, 5, bias)
    ref, ref_grads = _value_and_grads(tf_hsm.log_prob, hidden, weights, biases, tree,
                                      targets)
    out, grads = _value_and_grads(fn, hidden, weights, biases, tree, targets)
    assert out.shape == batch_shape, kind
    np.testing.assert_allclose(out, ref, rtol=TOL, atol=TOL, err_msg=f"{name} {kind}")
    for which, g, r in zip(("hidden", "weights", "biases"), grads, ref_grads):
      np.testing.assert_allclose(g, r, rtol=TOL, atol=TOL, err_msg=f"{name} {kind} {which}")


@pytest.mark.parametrize("name", sorted(baselines.EXACT_BASELINES))
def test_exact_baselines_in_tf_function_float32(rng, name):
  tree = Tree.huffman(rng.zipf(1.5, size=60).astype(np.float64))
  hidden, weights, biases, targets = _inputs(rng, tree, (9,), 8)
  hidden, weights, biases = (x.astype(np.float32) for x in (hidden, weights, biases))
  fn = tf.function(lambda h, w, b, y: baselines.EXACT_BASELINES[name](h, w, b, tree, y))
  out = fn(hidden, weights, biases, targets).numpy()
  ref = tf_hsm.log_prob(hidden, weights, biases, tree, targets).numpy()
  assert out.dtype == np.float32
  np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4)


def test_padded_arrays_are_cached_on_the_tree(rng):
  tree = Tree.two_level(50)
  hidden, weights, biases, targets = _inputs(rng, tree, (4,), 3)
  baselines.gather_log_prob(hidden, weights, biases, tree, targets)
  cached = tree.__dict__["_baseline_tensors"]["paths"]["class_nodes"]
  baselines.embedding_lookup_log_prob(hidden, weights, biases, tree, targets)
  assert tree.__dict__["_baseline_tensors"]["paths"]["class_nodes"] is cached


@pytest.mark.parametrize("bias", [True, False])
def test_full_softmax_matches_op_on_one_level_tree(rng, bias):
  tree = Tree.from_nested([4, 0, 2, 1, 3, 6, 5, 8, 7, 9, 10, 12, 11])
  hidden, weights, biases, targets = _inputs(rng, tree, (3, 4), 6, bias)
  ref, ref_grads = _value_and_grads(tf_hsm.log_prob, hidden, weights, biases, tree, targets)
  # Row c of the class table is the slot that leads to class c.
  order = tree.class_slot
  out, grads = _value_and_grads(
      baselines.full_softmax_log_prob, hidden, weights[order],
      None if biases is None else biases[order], targets)
  np.testing.assert_allclose(out, ref, rtol=TOL, atol=TOL)
  np.testing.assert_allclose(grads[0], ref_grads[0], rtol=TOL, atol=TOL)
  for g, r in zip(grads[1:], ref_grads[1:]):
    np.testing.assert_allclose(g, r[order], rtol=TOL, atol=TOL)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("bias", [True, False])
def test_sampled_softmax_is_finite_with_sparse_table_gradient(rng, bias, dtype):
  num_classes, dim = 500, 8
  hidden = tf.constant(rng.normal(size=(4, 5, dim)).astype(dtype))
  table = tf.Variable((0.1 * rng.normal(size=(num_classes, dim))).astype(dtype))
  biases = tf.Variable(np.zeros(num_classes, dtype)) if bias else None
  targets = rng.integers(0, num_classes, size=(4, 5))
  with tf.GradientTape() as tape:
    loss = baselines.sampled_softmax_loss(hidden, table, biases, targets, num_sampled=16,
                                          seed=3)
    total = tf.reduce_sum(loss)
  assert loss.shape == (4, 5) and loss.dtype == dtype
  assert np.isfinite(loss.numpy()).all() and (loss.numpy() > 0).all()
  grad = tape.gradient(total, table)
  assert isinstance(grad, tf.IndexedSlices)
  assert np.isfinite(grad.values.numpy()).all()
  # Only the true and sampled rows are touched.
  assert len(np.unique(grad.indices.numpy())) <= 20 + 16


def test_baselines_reject_non_tree(rng):
  with pytest.raises(TypeError, match="tf_hsm.Tree"):
    baselines.gather_log_prob(np.zeros((2, 3)), np.zeros((4, 3)), None, "tree", [0, 1])
