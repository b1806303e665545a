"""tf_hsm.adam_step: LazyAdam's row update fused into the backward pass equals
`optimizer.apply_gradients` on log_prob's gradient, and Adam's formula from its
definition."""

import numpy as np
import pytest
import tensorflow as tf

import tf_hsm
from oracle import random_mixed_tree
from tf_hsm.keras import optimizers
from tf_hsm.ops.compact import ShardedVariable


def _trees(rng):
  # Mixed node sizes (walked nodes of <= 8 children and tiled ones), a two-level tree's
  # wide nodes, and a 32-ary Huffman tree.
  return [random_mixed_tree(rng), tf_hsm.Tree.two_level(2000),
          tf_hsm.Tree.huffman(rng.integers(1, 1000, size=700), branching=32)]


def _problem(rng, tree, dtype, dim=11):
  hidden = rng.normal(size=(4, 9, dim)).astype(dtype)
  targets = rng.integers(0, tree.num_classes, size=(4, 9))
  w0 = (0.3 * rng.normal(size=(tree.num_slots, dim))).astype(dtype)
  b0 = rng.normal(size=tree.num_slots).astype(dtype)
  scale = rng.random(size=(4, 9)).astype(dtype)
  scale[0, :3] = 0  # padding tokens
  return hidden, targets, w0, b0, scale


def _by_gradient(hidden, targets, tree, w, b, scale, optimizer):
  """The reference step: log_prob's gradient, applied by optimizer.apply_gradients."""
  h = tf.constant(hidden)
  with tf.GradientTape() as tape:
    tape.watch(h)
    lp = tf_hsm.log_prob(h, w, b, tree, targets)
    loss = -tf.reduce_sum(scale * lp)
  variables = [w] + ([] if b is None else [b])
  grads = tape.gradient(loss, [h] + variables)
  optimizer.apply_gradients(zip(grads[1:], variables))
  return lp, grads[0], grads[1:]


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_matches_lazy_adam_on_the_sparse_gradient_bit_for_bit(rng, bias, dtype):
  # A decaying rate: read at the step's own count, as apply_gradients reads it.
  rate = lambda: tf.keras.optimizers.schedules.ExponentialDecay(0.05, 1, 0.5)
  for tree in _trees(rng):
    hidden, _, w0, b0, scale = _problem(rng, tree, dtype)
    w_ref, b_ref = tf.Variable(w0), tf.Variable(b0)
    w, b = tf.Variable(w0), tf.Variable(b0)
    reference, fused = optimizers.LazyAdam(rate()), optimizers.LazyAdam(rate())
    for _ in range(3):  # the moments and the bias correction carry over
      # Other targets each step: rows visited before and not now keep their moments.
      targets = rng.integers(0, tree.num_classes, size=hidden.shape[:-1])
      lp_ref, dh_ref, _ = _by_gradient(hidden, targets, tree, w_ref,
                                       b_ref if bias else None, scale, reference)
      lp, dh = tf_hsm.adam_step(hidden, w, b if bias else None, tree, targets, fused,
                                loss_scale=scale)
      tol = 1e-12 if dtype == np.float64 else 1e-5
      np.testing.assert_allclose(lp.numpy(), lp_ref.numpy(), rtol=tol, atol=tol)
      np.testing.assert_array_equal(dh.numpy(), dh_ref.numpy())
    np.testing.assert_array_equal(w.numpy(), w_ref.numpy())
    np.testing.assert_array_equal(b.numpy(), b_ref.numpy() if bias else b0)
    for got, want in zip(fused.variables, reference.variables):
      np.testing.assert_array_equal(got.numpy(), want.numpy())
    assert int(fused.iterations.numpy()) == 3


def test_adam_from_its_definition_in_float64(rng):
  """One step from zero moments, written from Adam's formula: the visited rows (every
  child of every node on the batch's paths) move, the others do not."""
  tree = random_mixed_tree(rng)
  hidden, targets, w0, b0, scale = _problem(rng, tree, np.float64)
  # Values float32 holds exactly: Keras keeps its betas and rate in float32.
  lr, beta_1, beta_2, eps = 0.0625, 0.875, 1 - 2.0**-9, 2.0**-20
  probe = tf.Variable(w0)
  with tf.GradientTape() as tape:
    loss = -tf.reduce_sum(scale * tf_hsm.log_prob(hidden, probe, None, tree, targets))
  grad = tape.gradient(loss, probe)
  rows = np.unique(grad.indices.numpy())
  g = tf.convert_to_tensor(grad).numpy()[rows]
  m, v = (1 - beta_1) * g, (1 - beta_2) * g * g
  alpha = lr * np.sqrt(1 - beta_2) / (1 - beta_1)
  expected = w0.copy()
  expected[rows] -= alpha * m / (np.sqrt(v) + eps)
  w = tf.Variable(w0)
  optimizer = optimizers.LazyAdam(lr, beta_1=beta_1, beta_2=beta_2, epsilon=eps)
  tf_hsm.adam_step(hidden, w, None, tree, targets, optimizer, loss_scale=scale)
  np.testing.assert_allclose(w.numpy(), expected, rtol=1e-6, atol=1e-12)
  untouched = np.setdiff1d(np.arange(tree.num_slots), rows)
  np.testing.assert_array_equal(w.numpy()[untouched], w0[untouched])
  np.testing.assert_allclose(optimizer._momentums[0].numpy()[rows], m, rtol=1e-12)  # pylint: disable=protected-access


def test_in_a_function_training_lowers_the_loss(rng):
  tree = tf_hsm.Tree.huffman(rng.integers(1, 100, size=300), branching=8)
  hidden = tf.constant(rng.normal(size=(64, 8)), tf.float32)
  targets = tf.constant(rng.integers(0, 30, size=64))  # a learnable few classes
  w = tf.Variable(0.01 * rng.normal(size=(tree.num_slots, 8)).astype(np.float32))
  b = tf.Variable(tf.zeros([tree.num_slots]))
  optimizer = optimizers.LazyAdam(0.05)
  step = tf.function(lambda: tf_hsm.adam_step(hidden, w, b, tree, targets, optimizer)[0])
  first = -float(tf.reduce_mean(step()))
  for _ in range(30):
    last = -float(tf.reduce_mean(step()))
  assert last < 0.5 * first and int(optimizer.iterations.numpy()) == 31


def test_off_the_cpu_it_steps_through_the_gradient_alike(rng, monkeypatch):
  """Where the fused op has no kernel (a table on a GPU) the step goes through log_prob's
  gradient and apply_gradients: the same results (forced here on the CPU)."""
  from tf_hsm.ops import training  # pylint: disable=import-outside-toplevel
  tree = random_mixed_tree(rng)
  hidden, targets, w0, b0, scale = _problem(rng, tree, np.float64)
  results = []
  for fused in (True, False):
    monkeypatch.setattr(training, "fused_sgd_runs_on", lambda device, fused=fused: fused)
    w, b, optimizer = tf.Variable(w0), tf.Variable(b0), optimizers.LazyAdam(0.05)
    for _ in range(2):
      lp, dh = tf_hsm.adam_step(hidden, w, b, tree, targets, optimizer, loss_scale=scale)
    results.append([lp.numpy(), dh.numpy(), w.numpy(), b.numpy(),
                    optimizer.iterations.numpy()])
  for got, want in zip(*results):
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_what_it_cannot_fuse_is_refused_by_name(rng):
  tree = tf_hsm.Tree.two_level(50)
  hidden, targets, w0, b0, _ = _problem(rng, tree, np.float32)
  w, b = tf.Variable(w0), tf.Variable(b0)
  args = (hidden, w, b, tree, targets)
  with pytest.raises(TypeError, match="must be a tf_hsm.optimizers.LazyAdam"):
    tf_hsm.adam_step(*args, tf.keras.optimizers.Adam(0.1))
  with pytest.raises(TypeError, match="tf_keras' LazyAdam|with tf_keras use nll_loss"):
    tf_hsm.adam_step(*args, tf_hsm.tf_keras.optimizers.LazyAdam(0.1))
  for settings, named in (({"amsgrad": True}, "amsgrad"),
                          ({"weight_decay": 0.01}, "weight_decay"),
                          ({"clipnorm": 1.0}, "clipnorm")):
    with pytest.raises(ValueError, match=f"also applies {named}"):
      tf_hsm.adam_step(*args, optimizers.LazyAdam(0.1, **settings))
  other = optimizers.LazyAdam(0.1)
  other.build([tf.Variable(w0)])
  with pytest.raises(ValueError, match="built for other variables"):
    tf_hsm.adam_step(*args, other)
  # One optimizer for the table and the rest of a model would count two steps a step.
  shared = optimizers.LazyAdam(0.1)
  shared.build([w, b, tf.Variable(np.ones(3, np.float32))])
  with pytest.raises(ValueError, match="also updates 1 other variables"):
    tf_hsm.adam_step(*args, shared)
  with pytest.raises(tf.errors.InvalidArgumentError, match="weights and biases must be "
                     "different variables"):
    tf_hsm.adam_step(hidden, w, w, tree, targets, optimizers.LazyAdam(0.1))
  pieces = ShardedVariable([tf.Variable(w0[:20]), tf.Variable(w0[20:])])
  with pytest.raises(TypeError, match="table held in pieces"):
    tf_hsm.adam_step(hidden, pieces, b, tree, targets, optimizers.LazyAdam(0.1))


def test_ragged_sequences_step_as_their_flat_tokens(rng):
  tree = tf_hsm.Tree.huffman(rng.integers(1, 100, size=200), branching=8)
  lengths = [3, 0, 5, 2]
  flat_h = rng.normal(size=(sum(lengths), 6))
  flat_y = rng.integers(0, tree.num_classes, size=sum(lengths))
  w0 = 0.1 * rng.normal(size=(tree.num_slots, 6))
  hidden = tf.RaggedTensor.from_row_lengths(flat_h, lengths)
  targets = tf.RaggedTensor.from_row_lengths(flat_y, lengths)
  w_ragged, w_flat = tf.Variable(w0), tf.Variable(w0)
  lp, dh = tf_hsm.adam_step(hidden, w_ragged, None, tree, targets, optimizers.LazyAdam(0.1))
  lp_flat, dh_flat = tf_hsm.adam_step(flat_h, w_flat, None, tree, flat_y,
                                      optimizers.LazyAdam(0.1))
  assert isinstance(lp, tf.RaggedTensor) and isinstance(dh, tf.RaggedTensor)
  np.testing.assert_array_equal(lp.flat_values.numpy(), lp_flat.numpy())
  np.testing.assert_array_equal(dh.flat_values.numpy(), dh_flat.numpy())
  np.testing.assert_array_equal(w_ragged.numpy(), w_flat.numpy())


def test_a_hidden_size_of_zero_gives_the_biases_adams_update(rng):
  """With D=0 the table and its moments are empty (null data): the biases must still get
  Adam's update, not SGD's at a learning rate of 0."""
  tree = tf_hsm.Tree.huffman(rng.integers(1, 50, 30), branching=3)
  targets = rng.integers(0, tree.num_classes, 7)
  b0 = rng.normal(size=tree.num_slots).astype(np.float32)
  results = []
  for fused in (True, False):
    weights = tf.Variable(np.zeros((tree.num_slots, 0), np.float32))
    biases, optimizer = tf.Variable(b0), optimizers.LazyAdam(0.1)
    if fused:
      lp, dh = tf_hsm.adam_step(tf.zeros([7, 0]), weights, biases, tree, targets, optimizer)
      assert dh.shape == (7, 0)
    else:
      _by_gradient(np.zeros((7, 0), np.float32), targets, tree, weights, biases,
                   np.full(7, 1 / 7, np.float32), optimizer)
    results.append(biases.numpy())
  assert not np.array_equal(results[0], b0)
  np.testing.assert_allclose(results[0], results[1], rtol=1e-6)
