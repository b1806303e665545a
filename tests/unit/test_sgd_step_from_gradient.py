"""sgd_step where the fused op has no kernel (a table on a GPU): Hsm>LogProb and
Hsm>LogProbGrad, then a scatter on the touched rows (`training.sgd_step_from_gradient`).
Run here on the CPU, where both paths exist, against Keras SGD on log_prob's gradient and
against the fused step."""

import numpy as np
import pytest
import tensorflow as tf

import tf_hsm
from oracle import random_mixed_tree
from tf_hsm.ops import training


def _tree_inputs(tree):
  t = tf_hsm.ops.inputs.tree_tensors(tree)
  return (t["child_begin"], t["path_begin"], t["path_nodes"], t["path_slots"])


def _case(rng, tree, dtype, dim=11):
  hidden = rng.normal(size=(4, 9, dim)).astype(dtype)
  targets = rng.integers(0, tree.num_classes, size=(4, 9))
  w0 = (0.3 * rng.normal(size=(tree.num_slots, dim))).astype(dtype)
  b0 = rng.normal(size=tree.num_slots).astype(dtype)
  scale = rng.random(size=(4, 9)).astype(dtype)
  return hidden, targets, w0, b0, scale


def _from_gradient(hidden, w, b, tree, targets, lr, scale, dtype):
  return training.sgd_step_from_gradient(
      tf.constant(hidden), w, b, _tree_inputs(tree), tf.constant(targets, tf.int64),
      tf.constant(scale), tf.constant(lr, dtype))


def _keras_sgd(hidden, w0, b0, tree, targets, lr, scale):
  """(log_prob without a tape, d loss / d hidden, weights, biases) after Keras SGD on
  log_prob's gradient; b0 None for no biases."""
  tables = [tf.Variable(w0)] + ([] if b0 is None else [tf.Variable(b0)])
  h = tf.constant(hidden)
  bias_table = tables[1] if len(tables) > 1 else None
  plain = tf_hsm.log_prob(h, tables[0], bias_table, tree, targets)
  with tf.GradientTape() as tape:
    tape.watch(h)
    loss = -tf.reduce_sum(scale * tf_hsm.log_prob(h, tables[0], bias_table, tree, targets))
  grads = tape.gradient(loss, [h] + tables)
  tf.keras.optimizers.SGD(lr).apply_gradients(zip(grads[1:], tables))
  return [plain, grads[0]] + tables + ([None] if b0 is None else [])


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_equals_keras_sgd_on_the_gradient(rng, bias, dtype):
  for tree in [random_mixed_tree(rng), tf_hsm.Tree.two_level(2000), tf_hsm.Tree.flat(300)]:
    hidden, targets, w0, b0, scale = _case(rng, tree, dtype)
    want = _keras_sgd(hidden, w0, b0 if bias else None, tree, targets, 0.3, scale)
    w, b = tf.Variable(w0), (tf.Variable(b0) if bias else None)
    # Keras keeps its learning rate in float32 whatever the variables' dtype.
    got = list(_from_gradient(hidden, w, b, tree, targets, np.float32(0.3), scale, dtype))
    got += [w, b]
    for name, g, r in zip(["log_prob", "hidden_grad", "weights", "biases"], got, want):
      if r is not None:
        np.testing.assert_array_equal(np.asarray(g), np.asarray(r), err_msg=name)


def test_agrees_with_the_fused_step_in_a_function(rng):
  tree = tf_hsm.Tree.huffman(rng.integers(1, 1000, size=500))
  hidden, targets, w0, b0, scale = _case(rng, tree, np.float64)
  w_fused, b_fused = tf.Variable(w0), tf.Variable(b0)
  lp_fused, dh_fused = tf_hsm.sgd_step(hidden, w_fused, b_fused, tree, targets, 0.5,
                                       loss_scale=scale)
  w, b = tf.Variable(w0), tf.Variable(b0)
  # Traced: the reads must still come before the scatters.
  step = tf.function(
      lambda: _from_gradient(hidden, w, b, tree, targets, 0.5, scale, np.float64))
  lp, dh = step()
  np.testing.assert_allclose(lp.numpy(), lp_fused.numpy(), rtol=1e-12, atol=1e-12)
  np.testing.assert_array_equal(dh.numpy(), dh_fused.numpy())
  np.testing.assert_allclose(w.numpy(), w_fused.numpy(), rtol=1e-12, atol=1e-12)
  np.testing.assert_allclose(b.numpy(), b_fused.numpy(), rtol=1e-12, atol=1e-12)
  assert not np.array_equal(w.numpy(), w0)  # the step did update the table


def test_chosen_by_the_table_device():
  assert training.fused_sgd_runs_on("")
  assert training.fused_sgd_runs_on("/job:localhost/replica:0/task:0/device:CPU:0")
  assert not training.fused_sgd_runs_on("/job:localhost/replica:0/task:0/device:GPU:0")
  assert not training.fused_sgd_runs_on("/device:GPU:1")
  with tf.device("/CPU:0"):
    w = tf.Variable(np.zeros((3, 2)))
  assert training.fused_sgd_runs_on(w.device)


def test_gpu_table_takes_the_gradient_path(rng, monkeypatch):
  # tf_hsm.sgd_step with the device check answering "GPU": the fused op is not called.
  tree = random_mixed_tree(rng)
  hidden, targets, w0, b0, scale = _case(rng, tree, np.float64)
  w_ref = tf.Variable(w0)
  lp_ref, dh_ref = _from_gradient(hidden, w_ref, None, tree, targets, 0.25, scale, np.float64)
  monkeypatch.setattr(training, "fused_sgd_runs_on", lambda device: False)

  def no_fused(*args, **kwargs):
    raise AssertionError("Hsm>SgdStep called for a table off the CPU")

  monkeypatch.setattr(tf_hsm.ops.loader.ops(), "hsm_sgd_step", no_fused)
  w = tf.Variable(w0)
  lp, dh = tf_hsm.sgd_step(hidden, w, None, tree, targets, 0.25, loss_scale=scale)
  np.testing.assert_array_equal(lp.numpy(), lp_ref.numpy())
  np.testing.assert_array_equal(dh.numpy(), dh_ref.numpy())
  np.testing.assert_array_equal(w.numpy(), w_ref.numpy())
