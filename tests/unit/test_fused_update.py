"""`HierarchicalSoftmax(..., fused_update=True)`: `model.fit` with LazyAdam updates the
table inside the layer's backward pass, and ends where the unfused layer ends, bit for
bit; what it cannot fuse is refused by name, and outside `fit` it is the plain layer."""

import gc
import warnings
import weakref

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_hsm
from tf_hsm.keras import adam_step as fused_module

V, D, T = 60, 8, 7


def _tree(rng):
  return tf_hsm.Tree.huffman(rng.integers(1, 100, V), branching=4)


def _model(tree, fused, optimizer=None, **layer_args):
  keras.utils.set_random_seed(3)
  tokens = keras.Input([T], dtype="int32")
  targets = keras.Input([T], dtype="int32")
  hidden = keras.layers.Embedding(V, D)(tokens)
  hidden = keras.layers.Dense(D, activation="tanh")(hidden)
  layer = tf_hsm.HierarchicalSoftmax(tree, fused_update=fused, **layer_args)
  model = keras.Model([tokens, targets], layer(hidden, targets))
  rate = keras.optimizers.schedules.ExponentialDecay(0.05, 2, 0.7)
  model.compile(optimizer=optimizer or tf_hsm.optimizers.LazyAdam(rate),
                loss=tf_hsm.losses.nll)
  return model, layer


def _data(rng, batches=4):
  x = rng.integers(0, V, size=(2 * batches, T)).astype(np.int32)
  y = rng.integers(0, V, size=(2 * batches, T)).astype(np.int32)
  y[0, :3] = -1  # padding
  y[1, :2] = 0   # ignore_class
  weights = rng.random((2 * batches, T)).astype(np.float32)
  return x, y, weights


class _CountFusedSteps:
  """Counts the fused op's calls (one a trace, or one a step when eager)."""

  def __init__(self, monkeypatch):
    self.calls = 0
    original = fused_module.fused.adam_rows_step_from_logits

    def counted(*args, **kwargs):
      self.calls += 1
      return original(*args, **kwargs)
    monkeypatch.setattr(fused_module.fused, "adam_rows_step_from_logits", counted)


def _assert_same_state(a, b):
  for x, y in zip(a.weights + a.optimizer.variables, b.weights + b.optimizer.variables):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=x.path)


@pytest.mark.parametrize("eager", [False, True])
def test_fit_ends_where_the_gradient_ends_bit_for_bit(rng, monkeypatch, eager):
  tree = _tree(rng)
  x, y, weights = _data(rng)
  count = _CountFusedSteps(monkeypatch)
  plain, _ = _model(tree, False, ignore_class=0)
  fused, _ = _model(tree, True, ignore_class=0)
  start = [np.asarray(w) for w in fused.weights]
  for model in (plain, fused):
    model.run_eagerly = eager
    model.fit([x, y], y, sample_weight=weights, batch_size=2, epochs=2, verbose=0,
              shuffle=False)
  # One call a step eagerly; in a traced step, one a trace.
  assert count.calls == 8 if eager else count.calls > 0
  assert int(fused.optimizer.iterations) == 8
  _assert_same_state(plain, fused)
  moved = [not np.array_equal(w, np.asarray(v)) for w, v in zip(start, fused.weights)]
  assert all(moved)  # the table and biases trained, as every other variable


def test_rebuild_during_fit_matches(rng):
  tree = _tree(rng)
  x, y, _ = _data(rng)
  models = [_model(tree, fused) for fused in (False, True)]
  for model, layer in models:
    rebuild = tf_hsm.callbacks.RebuildTree(layer, after_batch=3, branching=3)
    model.fit([x, y], y, batch_size=2, epochs=2, verbose=0, shuffle=False,
              callbacks=[rebuild])
  assert models[1][1].tree is not tree  # rebuilt
  assert models[0][1].tree.num_slots == models[1][1].tree.num_slots
  _assert_same_state(models[0][0], models[1][0])


def test_a_rebuild_frees_the_table_and_optimizer_it_replaced(rng):
  """The fused step's traced gradient (tf_hsm.ops.custom_gradient, not TensorFlow's,
  which keeps every traced one for good) goes with its step: a rebuild frees the old
  table and LazyAdam's moments (3x the table)."""
  tree = _tree(rng)
  model, layer = _model(tree, True)
  x, y, _ = _data(rng)
  model.fit([x, y], y, batch_size=2, epochs=1, verbose=0)  # traced, built
  old = [weakref.ref(layer.kernel), weakref.ref(model.optimizer)]
  old += [weakref.ref(v) for v in model.optimizer.variables if len(v.shape) == 2]
  rebuild = tf_hsm.callbacks.RebuildTree(layer, after_batch=1, branching=3)
  model.fit([x, y], y, batch_size=2, epochs=1, verbose=0, callbacks=[rebuild])
  gc.collect()
  assert layer.tree is not tree  # rebuilt
  assert all(ref() is None for ref in old)


def test_outside_fit_the_gradient_is_the_tables(rng, monkeypatch):
  tree = _tree(rng)
  count = _CountFusedSteps(monkeypatch)
  layer = tf_hsm.HierarchicalSoftmax(tree, fused_update=True)
  hidden = tf.constant(rng.normal(size=(3, D)).astype(np.float32))
  targets = rng.integers(0, V, size=3)
  with tf.GradientTape() as tape:
    out = layer(hidden, targets, training=True)
  grads = tape.gradient(out, layer.trainable_weights)
  assert count.calls == 0
  assert all(g is not None and g.values.shape[0] > 0 for g in grads)


def test_a_compiled_model_in_a_custom_loop_gives_the_gradient(rng, monkeypatch):
  # Not Keras' own train step: the loop's optimizer, clipping or second tape could
  # differ from the model's, so the table's gradient is handed back as usual.
  tree = _tree(rng)
  x, y, _ = _data(rng, batches=1)
  count = _CountFusedSteps(monkeypatch)
  model, layer = _model(tree, True)
  with tf.GradientTape() as tape:
    loss = -tf.reduce_sum(model([x, y], training=True))
  grads = tape.gradient(loss, layer.trainable_weights)
  assert count.calls == 0 and all(g.values.shape[0] > 0 for g in grads)
  assert not model.optimizer.built


class _ClippingModel(keras.Model):
  """A train_step of the user's: clips each gradient before applying it."""

  def train_step(self, data):
    (x, y), _ = data
    with tf.GradientTape() as tape:
      loss = -tf.reduce_mean(self([x, y], training=True))
    variables = self.trainable_variables
    grads = [tf.clip_by_norm(tf.convert_to_tensor(g), 0.01)
             for g in tape.gradient(loss, variables)]
    self.optimizer.apply_gradients(zip(grads, variables))
    return {"loss": loss}


def test_a_train_step_of_ones_own_is_not_fused(rng, monkeypatch):
  tree = _tree(rng)
  x, y, _ = _data(rng, batches=2)
  count = _CountFusedSteps(monkeypatch)
  states = []
  for fused in (False, True):
    model, _ = _model(tree, fused)
    model = _ClippingModel(model.inputs, model.outputs, name="clipping")
    model.compile(optimizer=tf_hsm.optimizers.LazyAdam(0.05))
    model.fit([x, y], y, batch_size=2, epochs=1, verbose=0, shuffle=False)
    states.append(model)
  assert count.calls == 0
  _assert_same_state(*states)


def test_mixed_bfloat16(rng, monkeypatch):
  # The optimizer, built by the layer before the first step, holds float32 moments.
  tree = _tree(rng)
  x, y, _ = _data(rng, batches=2)
  count = _CountFusedSteps(monkeypatch)
  models = []
  keras.mixed_precision.set_global_policy("mixed_bfloat16")
  try:
    for fused in (False, True):
      model, _ = _model(tree, fused)
      model.fit([x, y], y, batch_size=2, epochs=1, verbose=0, shuffle=False)
      models.append(model)
  finally:
    keras.mixed_precision.set_global_policy("float32")
  assert count.calls > 0
  _assert_same_state(*models)


def test_a_forward_call_before_an_eager_fit(rng):
  tree = _tree(rng)
  x, y, _ = _data(rng, batches=2)
  model, _ = _model(tree, True)
  model.run_eagerly = True
  model([x[:2], y[:2]], training=True)  # outside a train step: not a step's call
  model.fit([x, y], y, batch_size=2, epochs=1, verbose=0)
  assert int(model.optimizer.iterations) == 2


def test_frozen_layer_stays_frozen(rng, monkeypatch):
  tree = _tree(rng)
  x, y, _ = _data(rng)
  count = _CountFusedSteps(monkeypatch)
  model, layer = _model(tree, True)
  layer.trainable = False
  model.compile(optimizer=tf_hsm.optimizers.LazyAdam(0.1), loss=tf_hsm.losses.nll)
  before = [np.asarray(w) for w in layer.weights]
  model.fit([x, y], y, batch_size=2, epochs=1, verbose=0)
  assert count.calls == 0
  for b, w in zip(before, layer.weights):
    np.testing.assert_array_equal(b, np.asarray(w))


def test_direct_use_with_other_variables(rng):
  # The function under the layer, in a custom step: the optimizer applies the other
  # variables' gradients (and the table's empty ones) after the backward pass.
  tree = _tree(rng)
  h0 = rng.normal(size=(2, 5, D)).astype(np.float64)
  targets = rng.integers(0, V, size=(2, 5))
  scale = rng.random(size=(2, 5))
  states = []
  for fused in (False, True):
    proj = tf.Variable(np.eye(D) + 0.05)
    w = tf.Variable(np.full((tree.num_slots, D), 0.01) + np.arange(D) * 1e-3)
    b = tf.Variable(np.linspace(-1, 1, tree.num_slots))
    optimizer = tf_hsm.optimizers.LazyAdam(0.1)
    optimizer.build([proj, w, b])
    for _ in range(3):
      with tf.GradientTape() as tape:
        hidden = tf.tanh(tf.constant(h0) @ proj)
        if fused:
          lp = fused_module.log_prob_updating_table(hidden, w, b, tree, targets, optimizer)
        else:
          lp = tf_hsm.log_prob(hidden, w, b, tree, targets)
        loss = -tf.reduce_sum(scale * lp)
      grads = tape.gradient(loss, [proj, w, b])
      optimizer.apply_gradients(zip(grads, [proj, w, b]))
    states.append([v.numpy() for v in [proj, w, b] + optimizer.variables])
  for plain, fused in zip(*states):
    np.testing.assert_array_equal(plain, fused)


def test_ragged_hidden_matches_flat(rng):
  tree = _tree(rng)
  flat = rng.normal(size=(6, D)).astype(np.float32)
  targets = rng.integers(0, V, size=6)
  lengths = [4, 2]
  results = []
  for ragged in (False, True):
    w = tf.Variable(np.full((tree.num_slots, D), 0.02, np.float32))
    optimizer = tf_hsm.optimizers.LazyAdam(0.1)
    optimizer.build([w])
    h = tf.constant(flat)
    with tf.GradientTape() as tape:
      tape.watch(h)
      hidden = tf.RaggedTensor.from_row_lengths(h, lengths) if ragged else h
      y = tf.RaggedTensor.from_row_lengths(targets, lengths) if ragged else targets
      lp = fused_module.log_prob_updating_table(hidden, w, None, tree, y, optimizer)
      loss = -tf.reduce_sum(lp.flat_values if ragged else lp)
    results.append((tape.gradient(loss, h).numpy(), w.numpy()))
  np.testing.assert_array_equal(results[0][0], results[1][0])
  np.testing.assert_array_equal(results[0][1], results[1][1])


@pytest.mark.parametrize("args, match", [
    ({"kernel_regularizer": "l2"}, "kernel_regularizer"),
    ({"bias_constraint": "non_neg"}, "bias_constraint"),
    ({"fused_update": 1}, "must be True or False"),
])
def test_refused_at_construction(rng, args, match):
  tree = _tree(rng)
  kwargs = {"fused_update": True, **args}
  with pytest.raises((ValueError, TypeError), match=match):
    tf_hsm.HierarchicalSoftmax(tree, **kwargs)


def test_refused_with_a_row_layout(rng):
  tree = _tree(rng)
  layout = tf_hsm.distribute.balanced_layout(tree, 2, 64)
  with pytest.raises(ValueError, match="row_layout"):
    tf_hsm.HierarchicalSoftmax(tree, row_layout=layout, fused_update=True)


@pytest.mark.parametrize("optimizer, error, match", [
    (lambda: keras.optimizers.Adam(0.1), TypeError, "must be a tf_hsm.optimizers.LazyAdam"),
    (lambda: tf_hsm.optimizers.LazyAdam(0.1, clipnorm=1.0), ValueError,
     "also applies clipnorm"),
    (lambda: keras.optimizers.LossScaleOptimizer(tf_hsm.optimizers.LazyAdam(0.1)),
     ValueError, "loss scaling"),
])
def test_refused_optimizers(rng, optimizer, error, match):
  tree = _tree(rng)
  x, y, _ = _data(rng, batches=1)
  model, _ = _model(tree, True, optimizer=optimizer())
  with pytest.raises(error, match=match), warnings.catch_warnings():
    warnings.simplefilter("ignore")  # Keras' Adam: the dense-update warning
    model.fit([x, y], y, batch_size=2, epochs=1, verbose=0)


@pytest.mark.parametrize("eager", [False, True])
def test_a_layer_called_twice_a_step_is_refused(rng, eager):
  tree = _tree(rng)
  tokens = keras.Input([T], dtype="int32")
  targets = keras.Input([T], dtype="int32")
  hidden = keras.layers.Embedding(V, D)(tokens)
  layer = tf_hsm.HierarchicalSoftmax(tree, fused_update=True)
  out = keras.layers.Add()([layer(hidden, targets),
                            layer(keras.layers.Dense(D)(hidden), targets)])
  model = keras.Model([tokens, targets], out)
  model.compile(optimizer=tf_hsm.optimizers.LazyAdam(0.1), loss=tf_hsm.losses.nll,
                run_eagerly=eager)
  x, y, _ = _data(rng, batches=1)
  with pytest.raises(ValueError, match="calls it twice"):
    model.fit([x, y], y, batch_size=2, epochs=1, verbose=0)


def test_refused_under_a_strategy(rng):
  tree = _tree(rng)
  x, y, _ = _data(rng, batches=1)
  with tf.distribute.OneDeviceStrategy("/cpu:0").scope():
    model, _ = _model(tree, True)
  with pytest.raises(ValueError, match="distribution strategy"):
    model.fit([x, y], y, batch_size=2, epochs=1, verbose=0)


def test_config_round_trip(rng):
  layer = tf_hsm.HierarchicalSoftmax(_tree(rng), fused_update=True)
  again = tf_hsm.HierarchicalSoftmax.from_config(layer.get_config())
  assert again.fused_update is True


def _op_problem(rng, tree, dtype):
  hidden = tf.constant(rng.normal(size=(5, 9, 11)).astype(dtype))
  targets = tf.constant(rng.integers(0, tree.num_classes, size=(5, 9)))
  w0 = (0.3 * rng.normal(size=(tree.num_slots, 11))).astype(dtype)
  b0 = rng.normal(size=tree.num_slots).astype(dtype)
  scale = tf.constant(rng.random(size=(5, 9)).astype(dtype))
  return hidden, targets, w0, b0, scale


def _op_step(hidden, targets, tree, w0, b0, scale, saved):
  """The table, biases and moments after one op step, and its hidden_grad: Hsm>AdamStep
  (saved None), or Hsm>AdamStepFromLogits after the saving forward (saved "kept"), or
  with no saved values (saved "none": computed again)."""
  from tf_hsm.ops import adam_step as ops_step, training  # pylint: disable=import-outside-toplevel
  variables = [tf.Variable(w0), tf.Variable(b0)]
  moments = [tf.Variable(np.full_like(x, 0.01)) for x in (w0, w0, b0, b0)]
  dtype = hidden.dtype
  constants = [tf.constant(c, dtype) for c in (0.01, 0.1, 0.001, 1e-7)]
  if saved is None:
    _, grad = ops_step.adam_rows_step(hidden, *variables, tree, targets, moments,
                                      constants, scale)
  else:
    _, logits, directions = training.log_prob_and_saved(hidden, *variables, tree, targets)
    if saved == "none":
      logits, directions = tf.zeros([0], dtype), tf.zeros([0], dtype)
    grad = ops_step.adam_rows_step_from_logits(hidden, *variables, tree, targets, moments,
                                               constants, scale, logits, directions)
  return [grad.numpy()] + [v.numpy() for v in variables + moments]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_from_logits_op_matches_the_fused_step(rng, dtype):
  # Mixed node sizes (walked nodes and grouped ones), a two-level tree's wide nodes.
  from oracle import random_mixed_tree  # pylint: disable=import-outside-toplevel
  for tree in (random_mixed_tree(rng), tf_hsm.Tree.two_level(2000),
               tf_hsm.Tree.huffman(rng.integers(1, 1000, size=700), branching=32)):
    problem = _op_problem(rng, tree, dtype)
    want = _op_step(*problem[:2], tree, *problem[2:], saved=None)
    for saved in ("kept", "none"):
      for got, expected in zip(_op_step(*problem[:2], tree, *problem[2:], saved=saved),
                               want):
        np.testing.assert_array_equal(got, expected)


def test_from_logits_op_refuses_values_of_other_inputs(rng):
  from tf_hsm.ops import adam_step as ops_step, training  # pylint: disable=import-outside-toplevel
  tree = _tree(rng)
  hidden, targets, w0, b0, scale = _op_problem(rng, tree, np.float32)
  w, b = tf.Variable(w0), tf.Variable(b0)
  moments = [tf.Variable(np.zeros_like(x)) for x in (w0, w0, b0, b0)]
  constants = [tf.constant(c, tf.float32) for c in (0.01, 0.1, 0.001, 1e-7)]
  _, logits, directions = training.log_prob_and_saved(hidden, w, b, tree, targets)
  cases = [(logits[:-1], directions, "saved_logits must be the forward's"),
           (logits, directions[:-1], "saved_directions must have hidden's shape"),
           (logits, tf.zeros([0]), "saved_directions must have hidden's shape"),
           (tf.zeros([0]), directions, "saved_logits is empty but saved_directions")]
  for bad_logits, bad_directions, match in cases:
    with pytest.raises(tf.errors.InvalidArgumentError, match=match):
      ops_step.adam_rows_step_from_logits(hidden, w, b, tree, targets, moments, constants,
                                          scale, bad_logits, bad_directions)
  np.testing.assert_array_equal(w.numpy(), w0)  # refused before any update


class _TiedEmbedding(keras.layers.Layer):
  """Embeds tokens with the rows of another layer's table: its gradient is a second one
  of that table."""

  def __init__(self, owner, **kwargs):
    super().__init__(**kwargs)
    self.owner = owner

  def call(self, tokens):
    return keras.ops.take(self.owner.kernel, tokens, axis=0)


class _TablePenalty(keras.layers.Layer):
  """Passes its input on, adding a loss on another layer's table (a dense gradient)."""

  def __init__(self, owner, **kwargs):
    super().__init__(**kwargs)
    self.owner = owner

  def call(self, hidden):
    self.add_loss(1e-3 * keras.ops.sum(keras.ops.square(self.owner.kernel)))
    return hidden


def _tied_model(tree, fused, eager, tie):
  keras.utils.set_random_seed(3)
  tokens = keras.Input([T], dtype="int32")
  targets = keras.Input([T], dtype="int32")
  layer = tf_hsm.HierarchicalSoftmax(tree, fused_update=fused)
  layer.build([None, T, D])
  hidden = keras.layers.Embedding(V, D)(tokens)
  if tie == "rows":
    hidden = hidden + _TiedEmbedding(layer)(tokens)
  if tie == "loss":
    hidden = _TablePenalty(layer)(hidden)
  model = keras.Model([tokens, targets], layer(hidden, targets))
  model.compile(optimizer=tf_hsm.optimizers.LazyAdam(0.05), loss=tf_hsm.losses.nll,
                run_eagerly=eager)
  return model


@pytest.mark.parametrize("eager", [False, True])
@pytest.mark.parametrize("tie", ["rows", "loss"])
def test_a_second_gradient_of_the_table_is_refused(rng, eager, tie):
  tree = _tree(rng)
  x, y, _ = _data(rng, batches=1)
  with pytest.raises(ValueError, match="another gradient too"):
    _tied_model(tree, True, eager, tie).fit([x, y], y, batch_size=2, epochs=1,
                                            verbose=0)
  # Unfused, the same model trains with both gradients.
  _tied_model(tree, False, eager, tie).fit([x, y], y, batch_size=2, epochs=1, verbose=0)
