"""Bad input gets a clear error naming the problem, never a crash."""

import numpy as np
import pytest
import tensorflow as tf

import tf_hsm

TREE = tf_hsm.Tree.balanced(20, 4)
D = 6


def _args(n=5):
  rng = np.random.default_rng(0)
  return (rng.normal(size=(n, D)).astype(np.float32),
          rng.normal(size=(TREE.num_slots, D)).astype(np.float32),
          rng.normal(size=TREE.num_slots).astype(np.float32),
          rng.integers(0, 20, size=n))


@pytest.mark.parametrize("bad", [20, -1, 10**12])
def test_targets_out_of_range(bad):
  h, w, b, y = _args()
  y[3] = bad
  with pytest.raises(tf.errors.InvalidArgumentError, match=rf"targets\[3\] = {bad} .*\[0, 20\)"):
    tf_hsm.log_prob(h, w, b, TREE, y)


def test_hidden_size_mismatch():
  h, w, b, y = _args()
  with pytest.raises((tf.errors.InvalidArgumentError, ValueError), match="D = 5|Dimension"):
    tf_hsm.log_prob(h[:, :5], w, b, TREE, y)


def test_weight_rows_mismatch():
  h, w, b, y = _args()
  with pytest.raises(tf.errors.InvalidArgumentError, match="slots .* weights has"):
    tf_hsm.log_prob(h, w[:-1], b[:-1], TREE, y)


def test_bias_length_mismatch():
  h, w, b, y = _args()
  with pytest.raises(tf.errors.InvalidArgumentError, match="biases must be a vector"):
    tf_hsm.log_prob(h, w, b[:-2], TREE, y)


def test_batch_mismatch():
  h, w, b, y = _args()
  with pytest.raises((tf.errors.InvalidArgumentError, ValueError), match="targets|Dimensions"):
    tf_hsm.log_prob(h, w, b, TREE, y[:4])


def test_batch_mismatch_in_graph_is_caught_at_construction():
  h, w, b, y = _args()
  f = tf.function(lambda h, y: tf_hsm.log_prob(h, w, b, TREE, y))
  with pytest.raises(ValueError):
    f.get_concrete_function(tf.TensorSpec([5, D]), tf.TensorSpec([4], tf.int64))


def test_wrong_dtypes():
  h, w, b, y = _args()
  with pytest.raises(TypeError, match="targets must be int32 or int64"):
    tf_hsm.log_prob(h, w, b, TREE, y.astype(np.float32))
  with pytest.raises(TypeError, match="same dtype"):
    tf_hsm.log_prob(h.astype(np.float64), w, b, TREE, y)


def _ops():
  from tf_hsm.ops import loader as _loader
  return _loader.ops()


def _raw(tree_arrays, n=5):
  h, w, b, y = _args(n)
  if n == 20:
    y = np.arange(20)  # every path is read
  cb, pb, pn, ps = tree_arrays
  return _ops().hsm_log_prob(h, w, b, y, cb, pb, pn, ps)


def _tree_arrays():
  return [np.array(TREE.child_begin), np.array(TREE.path_begin), np.array(TREE.path_nodes),
          np.array(TREE.path_slots)]


@pytest.mark.parametrize("index,position,value,pattern", [
    (0, 1, 10**9, "child_begin"),          # slot range beyond the weight rows
    (0, 2, -5, "child_begin"),            # negative / non-monotone offsets
    (1, 1, 10**9, "path_begin"),
    (2, 0, 99, "path_nodes"),              # node id out of range
    (2, 0, -1, "path_nodes"),
    (3, 0, 10**6, "path_slots"),           # slot outside its node
])
def test_malformed_tree_tensors(index, position, value, pattern):
  arrays = _tree_arrays()
  arrays[index][position] = value
  with pytest.raises(tf.errors.InvalidArgumentError, match=pattern):
    _raw(arrays, n=20)


def test_tree_tensor_size_mismatch():
  arrays = _tree_arrays()
  arrays[3] = arrays[3][:-1]
  with pytest.raises(tf.errors.InvalidArgumentError, match="path_nodes has"):
    _raw(arrays)
  arrays = _tree_arrays()
  arrays[0] = arrays[0][:1]
  with pytest.raises(tf.errors.InvalidArgumentError, match="at least 2 entries"):
    _raw(arrays)


def test_not_a_tree():
  h, w, b, y = _args()
  with pytest.raises(TypeError, match="tf_hsm.Tree"):
    tf_hsm.log_prob(h, w, b, [[0, 1]], y)


def _xla_calls():
  h, w, b, y = _args()
  table = tf.Variable(w)
  return {
      "log_prob": lambda: tf_hsm.log_prob(h, w, b, TREE, y),
      "nll_loss": lambda: tf_hsm.nll_loss(h, w, b, TREE, y),
      "sgd_step": lambda: tf_hsm.sgd_step(h, table, None, TREE, y, 0.1),
      "top_k": lambda: tf_hsm.top_k(h, w, b, TREE, 3),
      "log_prob_all": lambda: tf_hsm.log_prob_all(h, w, b, TREE),
      "sample": lambda: tf_hsm.sample(h, w, b, TREE, seed=1),
      "log_prob_candidates": lambda: tf_hsm.log_prob_candidates(h, w, b, TREE, y[:, None]),
      # XLA compiles the functions a compiled function calls too.
      "nested": lambda: tf.function(lambda: tf_hsm.log_prob(h, w, b, TREE, y))(),
  }


@pytest.mark.parametrize("name", sorted(_xla_calls()))
def test_a_function_compiled_by_xla_is_told_why(name):
  """XLA's own message names the first op it cannot compile (a variable read, say), not
  tf_hsm; the wrappers say what is wrong when the function is traced."""
  call = _xla_calls()[name]
  with pytest.raises(ValueError, match="compiled by XLA.*jit_compile"):
    tf.function(call, jit_compile=True)()
  tf.function(call)()  # the same call without XLA runs


@pytest.mark.parametrize("name", ["log_prob", "nll_loss", "sgd_step"])
def test_a_second_derivative_is_refused_rather_than_zero(name):
  """The gradient ops declare no gradient of their own, which TensorFlow would read as a
  second derivative of zero (a gradient penalty on the hidden states silently doing
  nothing); it is refused instead."""
  h, w, b, y = _args()
  h = tf.constant(h)
  table = tf.Variable(w)
  with tf.GradientTape(persistent=True) as outer:
    outer.watch(h)
    with tf.GradientTape() as inner:
      inner.watch(h)
      if name == "log_prob":
        loss = -tf.reduce_sum(tf_hsm.log_prob(h, table, b, TREE, y))
      elif name == "nll_loss":
        loss = tf_hsm.nll_loss(h, table, b, TREE, y)
    if name == "sgd_step":
      loss, dh = tf_hsm.sgd_step(h, table, None, TREE, y, 0.1)
      loss, grads = tf.reduce_sum(loss), [dh]
    else:
      grads = inner.gradient(loss, [h, table])
    penalties = [tf.reduce_sum(tf.square(tf.convert_to_tensor(g))) for g in grads]
    plain = tf.reduce_sum(h * 2.0)
  # The outer tape differentiates what does not go through a gradient as before.
  np.testing.assert_array_equal(outer.gradient(plain, h), np.full(h.shape, 2.0))
  for penalty in penalties:
    with pytest.raises(NotImplementedError, match="first derivatives only"):
      outer.gradient(penalty, h)


def test_a_second_derivative_is_refused_in_a_function_too():
  h, w, b, y = _args()

  @tf.function
  def penalty_gradient(h):
    with tf.GradientTape() as outer:
      outer.watch(h)
      with tf.GradientTape() as inner:
        inner.watch(h)
        loss = tf_hsm.nll_loss(h, w, b, TREE, y)
      penalty = tf.reduce_sum(tf.square(inner.gradient(loss, h)))
    return outer.gradient(penalty, h)

  with pytest.raises(NotImplementedError, match="first derivatives only"):
    penalty_gradient(tf.constant(h))
