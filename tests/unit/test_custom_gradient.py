"""The op wrappers' custom gradients, traced: the same gradients as eagerly, by a tape
inside the function and by TensorFlow's symbolic gradient of the function from outside;
and a traced step, dropped, leaves nothing behind (tf.custom_gradient's registry kept
every traced graph, and the variables it captured, for the life of the process)."""

import gc
import weakref

import numpy as np
import pytest
import tensorflow as tf

import tf_hsm

V, D, N = 40, 6, 9


def _problem(rng):
  tree = tf_hsm.Tree.huffman(rng.integers(1, 50, V), branching=3)
  weights = tf.Variable(rng.standard_normal((tree.num_slots, D)).astype(np.float32))
  biases = tf.Variable(rng.standard_normal(tree.num_slots).astype(np.float32))
  hidden = tf.constant(rng.standard_normal((N, D)).astype(np.float32))
  targets = tf.constant(rng.integers(0, V, N))
  return tree, weights, biases, hidden, targets


def _dense(gradient):
  return tf.convert_to_tensor(gradient).numpy()


def test_traced_gradients_are_the_eager_ones(rng):
  tree, weights, biases, hidden, targets = _problem(rng)

  def gradients(hidden):
    with tf.GradientTape() as tape:
      tape.watch(hidden)
      loss = tf_hsm.nll_loss(hidden, weights, biases, tree, targets)
    return tape.gradient(loss, [hidden, weights, biases])

  eager = [_dense(g) for g in gradients(hidden)]
  traced = [_dense(g) for g in tf.function(gradients)(hidden)]
  for a, b in zip(eager, traced):
    np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7)
  # From outside the function: TensorFlow differentiates its graph symbolically.
  loss_fn = tf.function(lambda h: tf_hsm.nll_loss(h, weights, biases, tree, targets))
  with tf.GradientTape() as tape:
    tape.watch(hidden)
    loss = loss_fn(hidden)
  outside = [_dense(g) for g in tape.gradient(loss, [hidden, weights, biases])]
  for a, b in zip(eager, outside):
    np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("fused", [False, True])
def test_a_dropped_traced_step_frees_its_graph_and_table(rng, fused):
  keras = pytest.importorskip("keras")
  tree, _, _, hidden, targets = _problem(rng)
  layer = tf_hsm.HierarchicalSoftmax(tree, fused_update=fused)
  inputs = keras.Input((D,))
  ids = keras.Input((), dtype="int64")
  model = keras.Model([inputs, ids], layer(inputs, ids))
  model.compile(optimizer=tf_hsm.optimizers.LazyAdam(0.01), loss=tf_hsm.losses.nll)
  before = {id(g) for g in _func_graphs()}
  model.fit([hidden, targets], targets, verbose=0)
  graphs = [weakref.ref(g) for g in _func_graphs() if id(g) not in before]
  table = weakref.ref(layer.kernel)
  assert graphs and table() is not None
  del model, layer, inputs, ids
  gc.collect()
  assert [g() for g in graphs] == [None] * len(graphs)
  assert table() is None


def _func_graphs():
  gc.collect()
  return [o for o in gc.get_objects() if type(o).__name__ == "FuncGraph"]
