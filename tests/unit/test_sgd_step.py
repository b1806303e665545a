"""tf_hsm.sgd_step: the fused in-place SGD step equals Keras SGD on log_prob's gradient."""

import numpy as np
import pytest
import tensorflow as tf

import tf_hsm
from oracle import learnable_problem, random_mixed_tree


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-12), (np.float32, 1e-5)])
def test_matches_sgd_on_the_sparse_gradient(rng, bias, dtype, tol):
  for tree in [random_mixed_tree(rng), tf_hsm.Tree.two_level(2000), tf_hsm.Tree.huffman(
      rng.integers(1, 1000, size=500))]:
    dim, lr = 11, 0.3
    hidden = rng.normal(size=(4, 9, dim)).astype(dtype)
    targets = rng.integers(0, tree.num_classes, size=(4, 9))
    w0 = (0.3 * rng.normal(size=(tree.num_slots, dim))).astype(dtype)
    b0 = rng.normal(size=tree.num_slots).astype(dtype)
    scale = rng.random(size=(4, 9)).astype(dtype)

    # Reference: the op's gradient, applied by Keras SGD.
    w_ref, b_ref = tf.Variable(w0), tf.Variable(b0)
    h = tf.constant(hidden)
    with tf.GradientTape() as tape:
      tape.watch(h)
      lp_ref = tf_hsm.log_prob(h, w_ref, b_ref if bias else None, tree, targets)
      loss = -tf.reduce_sum(scale * lp_ref)
    variables = [w_ref, b_ref] if bias else [w_ref]
    grads = tape.gradient(loss, [h] + variables)
    tf.keras.optimizers.SGD(lr).apply_gradients(zip(grads[1:], variables))

    w, b = tf.Variable(w0), tf.Variable(b0)
    # Keras keeps its learning rate in float32 whatever the variables' dtype; a Python
    # float would be used in float64 here.
    lp, dh = tf_hsm.sgd_step(hidden, w, b if bias else None, tree, targets,
                             np.float32(lr), loss_scale=scale)
    # log_prob from the update's own logsumexps (exponentials summed in other tiles).
    np.testing.assert_allclose(lp.numpy(), lp_ref.numpy(), rtol=tol, atol=tol)
    np.testing.assert_array_equal(dh.numpy(), grads[0].numpy())
    np.testing.assert_allclose(w.numpy(), w_ref.numpy(), rtol=tol, atol=tol)
    np.testing.assert_allclose(b.numpy(), b_ref.numpy() if bias else b0, rtol=tol, atol=tol)


def test_training_with_sgd_step_lowers_the_loss(rng):
  tree, features, targets, w, b = learnable_problem(rng)
  step = tf.function(lambda: tf_hsm.sgd_step(features, w, b, tree, targets, 1.0))
  losses = [-float(tf.reduce_mean(step()[0])) for _ in range(40)]
  assert all(b < a for a, b in zip(losses, losses[1:])), losses[::8]
  assert losses[-1] < 0.8 * losses[0], losses[::8]


def test_keras_variables_and_errors(rng):
  tree = tf_hsm.Tree.balanced(30, 4)
  w = tf.keras.Variable(np.zeros((tree.num_slots, 5), np.float32))
  lp, dh = tf_hsm.sgd_step(np.ones((3, 5), np.float32), w, None, tree, [0, 1, 2], 0.1)
  # Zero weights: every node is uniform over its children.
  expected = [-sum(np.log(np.subtract(*tree.child_range(n)[::-1])) for n, _ in tree.path(c))
              for c in range(3)]
  np.testing.assert_allclose(lp.numpy(), expected, rtol=1e-6)
  assert np.any(w.numpy() != 0)
  with pytest.raises(tf.errors.InvalidArgumentError, match=r"targets\[1\] = 30"):
    tf_hsm.sgd_step(np.ones((2, 5), np.float32), w, None, tree, [0, 30], 0.1)
  with pytest.raises(tf.errors.InvalidArgumentError, match="has dtype double"):
    tf_hsm.sgd_step(np.ones((2, 5), np.float32), tf.Variable(np.zeros((tree.num_slots, 5))),
                    None, tree, [0, 1], 0.1)
  with pytest.raises(TypeError, match="tf.Variable"):
    tf_hsm.sgd_step(np.ones((2, 5), np.float32), np.zeros((tree.num_slots, 5)), None, tree,
                    [0, 1], 0.1)


@pytest.mark.parametrize("bias", [True, False])
def test_a_hidden_size_of_zero_updates_only_the_biases(rng, bias):
  tree = tf_hsm.Tree.huffman(rng.integers(1, 50, 30), branching=3)
  targets = rng.integers(0, tree.num_classes, 7)
  b0 = rng.normal(size=tree.num_slots).astype(np.float32)
  weights = tf.Variable(np.zeros((tree.num_slots, 0), np.float32))
  biases = tf.Variable(b0)
  hidden = tf.zeros([7, 0])
  lp, dh = tf_hsm.sgd_step(hidden, weights, biases if bias else None, tree, targets, 0.5)
  expected = tf_hsm.log_prob(hidden, weights, b0 if bias else None, tree, targets)
  np.testing.assert_allclose(lp.numpy(), expected.numpy(), rtol=1e-6)
  assert dh.shape == (7, 0)
  assert weights.shape == (tree.num_slots, 0)
  assert (not np.array_equal(biases.numpy(), b0)) == bias
