"""tf_hsm.nll_loss: the loss and its gradient from one op, against log_prob and the reference."""

import numpy as np
import pytest
import tensorflow as tf

import tf_hsm
from oracle import (learnable_problem, log_prob_reference, random_inputs, random_mixed_tree,
                    trees_of_every_kind)


def _loss_and_grads(loss_fn, h, w, b, multiplier=1.0):
  variables = [h, w] + ([b] if b is not None else [])
  with tf.GradientTape() as tape:
    tape.watch(h)
    loss = loss_fn() * multiplier if multiplier != 1.0 else loss_fn()
  return loss, tape.gradient(loss, variables)


def _assert_same_grads(got, want, name):
  np.testing.assert_array_equal(got[0].numpy(), want[0].numpy(), err_msg=name)
  for g, r in zip(got[1:], want[1:]):
    assert isinstance(g, tf.IndexedSlices), name
    np.testing.assert_array_equal(g.indices.numpy(), r.indices.numpy(), err_msg=name)
    np.testing.assert_array_equal(g.values.numpy(), r.values.numpy(), err_msg=name)


@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-10), (np.float32, 2e-4)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("in_function", [False, True])
def test_value_and_gradients_on_every_tree_kind(rng, dtype, tol, bias, in_function):
  for name, tree in trees_of_every_kind(rng):
    batch_shape = (int(rng.integers(1, 5)), int(rng.integers(1, 60)))
    hidden, weights, biases, targets = random_inputs(rng, tree, batch_shape, int(rng.integers(1, 30)),
                                               dtype, bias)
    h, w = tf.constant(hidden), tf.Variable(weights)
    b = tf.Variable(biases) if bias else None
    scale = rng.random(size=batch_shape).astype(dtype)
    scale[0, 0] = 0  # a padding token

    def fused():
      return tf_hsm.nll_loss(h, w, b, tree, targets, loss_scale=scale)

    def expression():
      return -tf.reduce_sum(scale * tf_hsm.log_prob(h, w, b, tree, targets))

    def run(loss_fn):
      if in_function:
        return tf.function(lambda: _loss_and_grads(loss_fn, h, w, b), autograph=False)()
      return _loss_and_grads(loss_fn, h, w, b)

    loss, grads = run(fused)
    ref_loss, ref_grads = run(expression)
    # Gradients: log_prob's, bit for bit. Value: the definition's, to rounding.
    _assert_same_grads(grads, ref_grads, name)
    ref = log_prob_reference(hidden, weights, biases, tree, targets)[0]
    want = -np.sum(scale.ravel().astype(np.float64) * ref)
    assert loss.dtype == dtype and loss.shape == ()
    np.testing.assert_allclose(loss.numpy(), want, rtol=tol, atol=tol, err_msg=name)
    np.testing.assert_allclose(loss.numpy(), ref_loss.numpy(), rtol=tol, atol=tol, err_msg=name)


def test_default_scale_is_the_mean(rng):
  tree = random_mixed_tree(rng, max_depth=5, max_branching=30)
  hidden, weights, biases, targets = random_inputs(rng, tree, (37,), 9, np.float64)
  loss = tf_hsm.nll_loss(hidden, weights, biases, tree, targets)
  ref = log_prob_reference(hidden, weights, biases, tree, targets)[0]
  np.testing.assert_allclose(loss.numpy(), -np.mean(ref), rtol=1e-12)


@pytest.mark.parametrize("multiplier", [2.5, -1.0])
def test_other_output_gradients_are_recomputed(rng, multiplier):
  # The op's gradient is for d loss = 1; a scaled loss takes the recomputing branch.
  for name, tree in trees_of_every_kind(rng):
    hidden, weights, biases, targets = random_inputs(rng, tree, (23,), 6, np.float32)
    h, w, b = tf.constant(hidden), tf.Variable(weights), tf.Variable(biases)
    fused = lambda: tf_hsm.nll_loss(h, w, b, tree, targets)
    expression = lambda: -tf.reduce_sum(tf.fill([23], np.float32(1 / 23)) *
                                        tf_hsm.log_prob(h, w, b, tree, targets))
    _, grads = _loss_and_grads(fused, h, w, b, multiplier)
    _, ref_grads = _loss_and_grads(expression, h, w, b, multiplier)
    _assert_same_grads(grads, ref_grads, name)


def test_sum_of_two_losses_on_one_call(rng):
  # The log-probabilities also feed a second term: their upstream is then no longer the
  # loss's, and the gradient must still be exact.
  tree = tf_hsm.Tree.two_level(500)
  hidden, weights, biases, targets = random_inputs(rng, tree, (40,), 8, np.float64)
  h, w, b = tf.constant(hidden), tf.Variable(weights), tf.Variable(biases)
  with tf.GradientTape() as tape:
    tape.watch(h)
    loss = tf_hsm.nll_loss(h, w, b, tree, targets)
    total = loss + tf.square(loss)
  grads = tape.gradient(total, [h, w, b])
  with tf.GradientTape() as tape:
    tape.watch(h)
    ref_loss = -tf.reduce_mean(tf_hsm.log_prob(h, w, b, tree, targets))
    ref_total = ref_loss + tf.square(ref_loss)
  ref_grads = tape.gradient(ref_total, [h, w, b])
  np.testing.assert_allclose(grads[0].numpy(), ref_grads[0].numpy(), rtol=1e-10, atol=1e-12)
  for g, r in zip(grads[1:], ref_grads[1:]):
    np.testing.assert_array_equal(g.indices.numpy(), r.indices.numpy())
    np.testing.assert_allclose(g.values.numpy(), r.values.numpy(), rtol=1e-10, atol=1e-12)


def test_low_precision_hidden(rng):
  tree = tf_hsm.Tree.huffman(rng.random(300) + 0.1)
  hidden, weights, biases, targets = random_inputs(rng, tree, (19,), 5, np.float32)
  h = tf.constant(hidden.astype(np.float16))
  w = tf.Variable(weights)
  with tf.GradientTape() as tape:
    tape.watch(h)
    loss = tf_hsm.nll_loss(h, w, biases, tree, targets)
  dh, dw = tape.gradient(loss, [h, w])
  assert loss.dtype == tf.float32 and dh.dtype == tf.float16
  ref = log_prob_reference(hidden.astype(np.float16).astype(np.float64), weights, biases, tree,
                           targets)[0]
  np.testing.assert_allclose(loss.numpy(), -np.mean(ref), rtol=1e-4)
  assert isinstance(dw, tf.IndexedSlices)


def test_training_lowers_the_loss(rng):
  tree, features, targets, w, b = learnable_problem(rng)
  optimizer = tf.keras.optimizers.Adam(0.05)

  @tf.function
  def step():
    with tf.GradientTape() as tape:
      loss = tf_hsm.nll_loss(features, w, b, tree, targets)
    optimizer.apply_gradients(zip(tape.gradient(loss, [w, b]), [w, b]))
    return loss

  losses = [float(step()) for _ in range(30)]
  assert losses[-1] < 0.7 * losses[0], losses


def test_bad_arguments(rng):
  tree = tf_hsm.Tree.two_level(100)
  hidden, weights, biases, targets = random_inputs(rng, tree, (10,), 4, np.float32)
  with pytest.raises(tf.errors.InvalidArgumentError, match="targets"):
    tf_hsm.nll_loss(hidden, weights, biases, tree, np.full(10, 100))
  with pytest.raises((tf.errors.InvalidArgumentError, ValueError)):
    tf_hsm.nll_loss(hidden, weights, biases, tree, targets, loss_scale=np.ones(3, np.float32))
  with pytest.raises(TypeError):
    tf_hsm.nll_loss(hidden.astype(np.float64), weights, biases, tree, targets)
  with pytest.raises(tf.errors.InvalidArgumentError):
    tf_hsm.nll_loss(hidden, weights[:, :3], biases, tree, targets)
