"""tf_hsm.layers.HierarchicalSoftmax and tf_hsm.losses: outputs, padding and masks, sparse
gradients, model.fit, saving and export in a fresh process, MirroredStrategy, mixed
precision, inference."""

import os
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_hsm
from tf_hsm.keras import losses
from tf_hsm.keras import optimizers
from tf_hsm.keras.layers import HierarchicalSoftmax

import support
from oracle import log_prob_reference

_REPO = support.REPO


def _tree(rng, num_classes=40):
  return tf_hsm.Tree.huffman(rng.integers(1, 100, size=num_classes), branching=3)


def _lm(tree, seq_len, dim=8, mask_zero=False):
  """A tiny [tokens, targets] -> log-prob model over the tree's classes."""
  tokens = keras.Input((seq_len,), dtype="int32")
  targets = keras.Input((seq_len,), dtype="int32")
  x = keras.layers.Embedding(tree.num_classes, dim, mask_zero=mask_zero, name="embedding")(
      tokens)
  x = keras.layers.Dense(16, activation="tanh", name="dense")(x)
  log_probs = HierarchicalSoftmax(tree, name="hsm")(x, targets)
  return keras.Model([tokens, targets], log_probs)



@pytest.mark.parametrize("batch_shape", [(7,), (3, 5)])
@pytest.mark.parametrize("use_bias", [True, False])
def test_output_is_the_op_on_the_layers_weights(rng, batch_shape, use_bias):
  tree = _tree(rng)
  layer = HierarchicalSoftmax(tree, use_bias=use_bias, bias_initializer="random_normal")
  hidden = rng.normal(size=batch_shape + (6,)).astype(np.float32)
  targets = rng.integers(0, tree.num_classes, size=batch_shape)
  out = layer(hidden, targets)
  assert layer.kernel.shape == (tree.num_slots, 6)
  assert (layer.bias is not None) == use_bias
  expected = tf_hsm.log_prob(hidden, layer.kernel, layer.bias, tree, targets)
  assert out.shape == batch_shape and out.dtype == tf.float32
  np.testing.assert_allclose(out.numpy(), expected.numpy(), rtol=1e-6, atol=1e-6)
  assert np.all(out.numpy() < 0)


def test_table_gradient_stays_indexed_slices(rng):
  tree = tf_hsm.Tree.two_level(400)
  layer = HierarchicalSoftmax(tree)
  hidden = tf.constant(rng.normal(size=(2, 3, 8)).astype(np.float32))
  targets = tf.constant([[0, 1, 2], [3, -1, 1]])
  layer(hidden, targets)
  with tf.GradientTape() as tape:
    loss = -tf.reduce_sum(layer(hidden, targets))
  grad_kernel, grad_bias = tape.gradient(loss, [layer.kernel, layer.bias])
  assert isinstance(grad_kernel, tf.IndexedSlices)
  assert isinstance(grad_bias, tf.IndexedSlices)
  # Only the root's children and the first cluster (classes 0..3 share it) are touched.
  assert grad_kernel.values.shape[0] < 2 * 21


def test_padding_targets_give_zero_and_no_gradient(rng):
  tree = _tree(rng)
  layer = HierarchicalSoftmax(tree, bias_initializer="random_normal")
  hidden = tf.constant(rng.normal(size=(4, 6, 5)).astype(np.float32))
  targets = rng.integers(0, tree.num_classes, size=(4, 6))
  targets[0, 2:] = -1
  targets[3, 0] = -7
  valid = targets >= 0
  with tf.GradientTape() as tape:
    tape.watch(hidden)
    out = layer(hidden, targets)
    loss = -tf.reduce_sum(out)
  dh, dw, db = tape.gradient(loss, [hidden, layer.kernel, layer.bias])
  np.testing.assert_array_equal(out.numpy()[~valid], 0.0)
  assert np.all(out.numpy()[valid] < 0)
  np.testing.assert_array_equal(dh.numpy()[~valid], 0.0)
  np.testing.assert_array_equal(out._keras_mask.numpy(), valid)
  # The table gradient equals the one from the valid positions alone.
  with tf.GradientTape() as tape:
    ref = tf_hsm.log_prob(tf.boolean_mask(hidden, valid), layer.kernel, layer.bias, tree,
                          targets[valid])
    ref_loss = -tf.reduce_sum(ref)
  rw, rb = tape.gradient(ref_loss, [layer.kernel, layer.bias])
  np.testing.assert_allclose(out.numpy()[valid], ref.numpy(), rtol=1e-6)
  for grad, reference in ((dw, rw), (db, rb)):
    np.testing.assert_allclose(support.dense(grad, sparse=True),
                               support.dense(reference, sparse=True), rtol=1e-5, atol=1e-6)


def test_explicit_mask_argument(rng):
  tree = _tree(rng)
  layer = HierarchicalSoftmax(tree)
  hidden = rng.normal(size=(3, 4, 5)).astype(np.float32)
  targets = rng.integers(0, tree.num_classes, size=(3, 4))
  mask = rng.random((3, 4)) < 0.6
  full = layer(hidden, targets).numpy()
  masked = layer(hidden, targets, mask=mask).numpy()
  np.testing.assert_array_equal(masked[mask], full[mask])
  np.testing.assert_array_equal(masked[~mask], 0.0)


def test_upstream_keras_mask_is_honoured_in_fit_and_evaluate(rng):
  tree = _tree(rng)
  model = _lm(tree, seq_len=6, mask_zero=True)
  model.compile(optimizer=optimizers.LazyAdam(0.01), loss=losses.nll)
  x = rng.integers(1, tree.num_classes, size=(32, 6))
  x[:, 4:] = 0  # padding by the embedding's mask
  y = rng.integers(0, tree.num_classes, size=(32, 6))
  y[:8, 3] = -1  # padding by the targets
  model.fit([x, y], y, batch_size=8, epochs=1, verbose=0)
  log_probs = model.predict([x, y], batch_size=8, verbose=0)
  valid = (x != 0) & (y >= 0)
  np.testing.assert_array_equal(log_probs[~valid], 0.0)
  assert np.all(log_probs[valid] < 0)
  loss = model.evaluate([x, y], y, batch_size=32, verbose=0)
  np.testing.assert_allclose(loss, -log_probs[valid].mean(), rtol=1e-5)


def test_nll_averages_over_valid_targets_only():
  y_pred = tf.constant([[-1.0, -2.0, 0.0], [-4.0, 0.0, 0.0]])
  y_true = tf.constant([[3, 1, -1], [2, -1, -1]])
  per_position = losses.nll(y_true, y_pred)
  np.testing.assert_array_equal(per_position.numpy(), -y_pred.numpy())
  np.testing.assert_array_equal(per_position._keras_mask.numpy(), y_true.numpy() >= 0)
  loss = losses.NegativeLogLikelihood()
  np.testing.assert_allclose(loss(y_true, y_pred).numpy(), (1 + 2 + 4) / 3, rtol=1e-6)
  # y_true that does not have y_pred's shape is ignored: the plain mean.
  np.testing.assert_allclose(loss(tf.zeros([2]), y_pred).numpy(), 7 / 6, rtol=1e-6)
  config = keras.saving.serialize_keras_object(loss)
  assert isinstance(keras.saving.deserialize_keras_object(config),
                    losses.NegativeLogLikelihood)
  config = keras.saving.serialize_keras_object(losses.nll)
  assert keras.saving.deserialize_keras_object(config) is losses.nll


def test_fit_learns_with_progress_bar_and_callbacks(rng, capsys):
  tree = _tree(rng)
  model = _lm(tree, seq_len=5)
  model.compile(optimizer=optimizers.LazyAdam(0.02), loss=losses.NegativeLogLikelihood())
  x = rng.integers(0, tree.num_classes, size=(96, 5))
  y = (x * 7 + 3) % tree.num_classes  # a deterministic function of the input token
  seen = []
  callback = keras.callbacks.LambdaCallback(
      on_epoch_end=lambda epoch, logs: seen.append(logs["loss"]))
  history = model.fit([x, y], y, batch_size=16, epochs=6, verbose=1,
                      validation_data=([x, y], y), callbacks=[callback])
  printed = capsys.readouterr().out
  assert "Epoch 6/6" in printed and "loss:" in printed
  assert seen == history.history["loss"]
  assert history.history["loss"][-1] < 0.7 * history.history["loss"][0]
  assert "val_loss" in history.history


def test_models_with_the_layer_are_not_xla_compiled(rng):
  model = _lm(_tree(rng), seq_len=3)
  with pytest.warns(UserWarning):
    model.compile(optimizer="sgd", loss=losses.nll, jit_compile=True)
  assert model.jit_compile is False


def test_config_round_trip(rng):
  tree = _tree(rng)
  layer = HierarchicalSoftmax(tree, use_bias=False, kernel_regularizer="l2",
                              kernel_initializer="random_normal", name="out")
  hidden = rng.normal(size=(4, 6)).astype(np.float32)
  targets = rng.integers(0, tree.num_classes, size=4)
  out = layer(hidden, targets)
  config = keras.saving.serialize_keras_object(layer)
  restored = keras.saving.deserialize_keras_object(config)
  assert isinstance(restored, HierarchicalSoftmax)
  assert restored.tree == tree and restored.use_bias is False and restored.name == "out"
  assert isinstance(restored.kernel_regularizer, keras.regularizers.L2)
  assert restored.built  # from the build config that serialization records
  restored.set_weights(layer.get_weights())
  np.testing.assert_array_equal(restored(hidden, targets).numpy(), out.numpy())
  # from_config directly, with the tree given as its config dict.
  again = HierarchicalSoftmax.from_config(layer.get_config())
  assert again.tree == tree


def test_constructor_errors(rng):
  with pytest.raises(TypeError, match="tf_hsm.Tree"):
    HierarchicalSoftmax(list(range(5)))
  layer = HierarchicalSoftmax(_tree(rng))
  with pytest.raises(ValueError, match="last dimension"):
    layer.build((None, None))
  with pytest.raises(ValueError, match="built"):
    HierarchicalSoftmax(_tree(rng)).top_k(np.zeros((1, 3), np.float32), 2)


def test_ragged_batches_are_refused_by_name(rng):
  """The layers take padded batches (their outputs carry Keras masks); the ops take
  ragged ones. Named, rather than a conversion's error about len()."""
  layer = HierarchicalSoftmax(_tree(rng))
  layer.build((None, 3))
  ragged = tf.RaggedTensor.from_row_lengths(tf.zeros((3, 3)), [1, 2])
  for call in (lambda: layer(ragged, tf.ragged.constant([[1], [0, 2]])),
               lambda: layer(tf.zeros((2, 1, 3)), tf.ragged.constant([[1], [0]])),
               lambda: layer.log_prob_all(ragged), lambda: layer.top_k(ragged, 2),
               lambda: layer.sample(ragged)):
    with pytest.raises(TypeError, match="layers take dense hidden states.*pad ragged"):
      call()


def _run_fresh(script, *args, timeout):
  """Runs a Python script in a fresh process with this checkout importable; asserts that
  it succeeded."""
  env = dict(os.environ, PYTHONPATH=_REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
             TF_CPP_MIN_LOG_LEVEL="2")
  result = subprocess.run([sys.executable, "-c", script, *args], env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)
  assert result.returncode == 0, result.stderr[-3000:]


_RELOAD_SCRIPT = textwrap.dedent("""
    import sys
    import numpy as np
    import tensorflow as tf
    import keras
    import tf_hsm
    import tf_hsm.layers, tf_hsm.losses, tf_hsm.optimizers
    directory = sys.argv[1]
    x = np.load(directory + "/x.npy")
    y = np.load(directory + "/y.npy")
    model = keras.models.load_model(directory + "/m.keras")
    assert type(model.optimizer).__name__ == "LazyAdam", type(model.optimizer)
    assert model.optimizer.iterations.numpy() == 2
    np.save(directory + "/keras_out.npy", model.predict([x, y], verbose=0))
    served = tf.saved_model.load(directory + "/exported")
    np.save(directory + "/export_out.npy",
            served.serve([tf.constant(x), tf.constant(y)]).numpy())
""")


def test_save_and_export_reload_in_a_fresh_process(rng, tmp_path):
  tree = _tree(rng)
  model = _lm(tree, seq_len=4)
  model.compile(optimizer=optimizers.LazyAdam(0.01), loss=losses.nll)
  x = rng.integers(0, tree.num_classes, size=(8, 4)).astype(np.int32)
  y = rng.integers(0, tree.num_classes, size=(8, 4)).astype(np.int32)
  y[0, 1] = -1
  model.fit([x, y], y, batch_size=4, epochs=1, verbose=0)
  expected = model.predict([x, y], verbose=0)
  model.save(tmp_path / "m.keras")
  model.export(str(tmp_path / "exported"), verbose=False)
  np.save(tmp_path / "x.npy", x)
  np.save(tmp_path / "y.npy", y)
  _run_fresh(_RELOAD_SCRIPT, str(tmp_path), timeout=120)
  np.testing.assert_array_equal(np.load(tmp_path / "keras_out.npy"), expected)
  np.testing.assert_allclose(np.load(tmp_path / "export_out.npy"), expected, rtol=1e-6,
                             atol=1e-6)


# Two logical CPUs must be set before TensorFlow starts, hence a fresh process. It builds
# the model with this file's _tree and _lm (the tests directory is argv[2]).
_MIRRORED_SCRIPT = textwrap.dedent("""
    import os
    import sys
    import numpy as np
    import tensorflow as tf
    cpus = tf.config.list_physical_devices("CPU")
    tf.config.set_logical_device_configuration(
        cpus[0], [tf.config.LogicalDeviceConfiguration()] * 2)
    import keras
    from tf_hsm.keras import losses, optimizers
    sys.path[:0] = [sys.argv[2], os.path.dirname(sys.argv[2])]  # tests/unit, tests/
    from test_layers import _lm, _tree

    make_optimizer = {"SparseSGD": lambda: optimizers.SparseSGD(0.5),
                      "LazyAdam": lambda: optimizers.LazyAdam(0.05),
                      "SparseAdagrad": lambda: optimizers.SparseAdagrad(0.5),
                      "keras.SGD": lambda: keras.optimizers.SGD(0.5, momentum=0.9),
                      "keras.Adam": lambda: keras.optimizers.Adam(0.05)}[sys.argv[1]]
    rng = np.random.default_rng(3)
    tree = _tree(rng)
    x = rng.integers(0, tree.num_classes, size=(8, 5)).astype(np.int32)
    y = rng.integers(0, tree.num_classes, size=(8, 5)).astype(np.int32)
    keras.utils.set_random_seed(1)
    single = _lm(tree, seq_len=5)
    initial = single.get_weights()
    single.compile(optimizer=make_optimizer(), loss=losses.nll)
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
      mirrored = _lm(tree, seq_len=5)
      mirrored.set_weights(initial)
      mirrored.compile(optimizer=make_optimizer(), loss=losses.nll)
    # Two steps of 4 sequences: each replica takes 2 of them a step.
    single.fit([x, y], y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    if sys.argv[1] == "keras.Adam":  # squares each replica's rows: refused by name
      try:
        mirrored.fit([x, y], y, batch_size=4, epochs=1, shuffle=False, verbose=0)
      except ValueError as e:
        assert "cannot train HierarchicalSoftmax" in str(e) and "LazyAdam" in str(e), e
        sys.exit(0)
      raise AssertionError("keras.optimizers.Adam trained over two replicas")
    mirrored.fit([x, y], y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    for before, one, two in zip(initial, single.get_weights(), mirrored.get_weights()):
      assert not np.allclose(before, one), "a variable did not move"
      np.testing.assert_allclose(two, one, rtol=1e-5, atol=1e-6)
""")


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["SparseSGD", "LazyAdam", "SparseAdagrad",
                                       "keras.SGD", "keras.Adam"])
def test_mirrored_strategy_trains_as_one_device(optimizer):
  """Under tf.distribute.MirroredStrategy over two CPUs, the replicas' sparse table
  gradients are combined and applied by the sparse optimizers (and Keras' SGD, linear in
  the gradient) to the mirrored variables: the weights after two steps are those of the
  same steps on one device. Keras 3's Adam, which would square each replica's rows
  apart (and train otherwise than on one device), is refused by name."""
  _run_fresh(_MIRRORED_SCRIPT, optimizer, os.path.dirname(os.path.abspath(__file__)),
             timeout=300)


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_mixed_precision_trains_with_a_float32_table(rng, policy):
  keras.mixed_precision.set_global_policy(policy)
  try:
    tree = _tree(rng)
    model = _lm(tree, seq_len=5)
    layer = model.get_layer("hsm")
    sparse_steps = []

    class Spy(optimizers.LazyAdam):

      def update_step(self, gradient, variable, learning_rate):
        if variable.shape == layer.kernel.shape:
          sparse_steps.append(isinstance(gradient, tf.IndexedSlices))
        return super().update_step(gradient, variable, learning_rate)

    model.compile(optimizer=Spy(0.02), loss=losses.nll)
    x = rng.integers(0, tree.num_classes, size=(64, 5))
    y = (x + 1) % tree.num_classes
    history = model.fit([x, y], y, batch_size=16, epochs=4, verbose=0)
    assert layer.kernel.dtype == "float32" and layer.compute_dtype != "float32"
    assert sparse_steps and all(sparse_steps)
    out = model([x[:4], y[:4]])
    assert out.dtype == tf.float32
    assert np.all(np.isfinite(history.history["loss"]))
    assert history.history["loss"][-1] < history.history["loss"][0]
    # The float32 log-probs agree with the op on float32-rounded activations.
    hidden = keras.Model(model.inputs, model.get_layer("dense").output)([x[:4], y[:4]])
    assert hidden.dtype != tf.float32
    ref = tf_hsm.log_prob(tf.cast(hidden, tf.float32), layer.kernel, layer.bias, tree, y[:4])
    np.testing.assert_allclose(out.numpy(), ref.numpy(), rtol=1e-5, atol=1e-5)
  finally:
    keras.mixed_precision.set_global_policy("float32")


def test_float64_policy(rng):
  tree = _tree(rng)
  layer = HierarchicalSoftmax(tree, dtype="float64")
  hidden = rng.normal(size=(3, 4))
  targets = rng.integers(0, tree.num_classes, size=3)
  out = layer(hidden, targets)
  assert layer.kernel.dtype == "float64" and out.dtype == tf.float64


def test_inference_methods_use_the_layers_weights(rng):
  inference = pytest.importorskip("tf_hsm.ops.inference")
  tree = _tree(rng, num_classes=30)
  layer = HierarchicalSoftmax(tree, kernel_initializer="random_normal",
                              bias_initializer="random_normal")
  hidden = rng.normal(size=(5, 4)).astype(np.float32)
  targets = np.arange(5)
  layer(hidden, targets)
  all_log_probs = layer.log_prob_all(hidden).numpy()
  assert all_log_probs.shape == (5, tree.num_classes)
  np.testing.assert_allclose(
      all_log_probs, inference.log_prob_all(hidden, layer.kernel, layer.bias, tree).numpy())
  np.testing.assert_allclose(np.exp(all_log_probs).sum(-1), 1.0, rtol=1e-5)
  np.testing.assert_allclose(all_log_probs[np.arange(5), targets],
                             layer(hidden, targets).numpy(), rtol=1e-5, atol=1e-6)
  log_probs, classes = layer.top_k(hidden, 3)
  np.testing.assert_array_equal(classes.numpy(), np.argsort(-all_log_probs, -1)[:, :3])
  np.testing.assert_allclose(log_probs.numpy(), np.sort(all_log_probs, -1)[:, ::-1][:, :3],
                             rtol=1e-5, atol=1e-6)
  samples = layer.sample(hidden, seed=3).numpy()
  assert samples.shape == (5,) and np.all((samples >= 0) & (samples < tree.num_classes))
  np.testing.assert_array_equal(layer.sample(hidden, seed=3).numpy(), samples)


def test_ignore_class_is_padding_in_float64(rng):
  """Targets equal to ignore_class: log-probability 0, no gradient, out of the mask; the
  rest is the float64 definition, value and gradients."""
  counts = np.r_[0.0, rng.integers(1, 100, size=29)]  # id 0: padding, never a target
  tree = tf_hsm.Tree.huffman(counts, branching=3)
  layer = HierarchicalSoftmax(tree, ignore_class=0, bias_initializer="random_normal",
                              dtype="float64")
  hidden = tf.constant(rng.normal(size=(3, 5, 4)))
  targets = rng.integers(1, 30, size=(3, 5))
  targets[0, 3:] = 0
  targets[2, 0] = 0
  real = targets != 0
  with tf.GradientTape() as tape:
    tape.watch(hidden)
    out = layer(hidden, targets)
    loss = tf.reduce_sum(out)
  dh, dw, db = tape.gradient(loss, [hidden, layer.kernel, layer.bias])
  expected, rdh, rdw, rdb = log_prob_reference(
      hidden.numpy()[real], layer.kernel.numpy(), layer.bias.numpy(), tree, targets[real])
  np.testing.assert_array_equal(out.numpy()[~real], 0.0)
  np.testing.assert_array_equal(out._keras_mask.numpy(), real)
  np.testing.assert_allclose(out.numpy()[real], expected, rtol=1e-12)
  np.testing.assert_array_equal(dh.numpy()[~real], 0.0)
  np.testing.assert_allclose(dh.numpy()[real], rdh, rtol=1e-10, atol=1e-12)
  np.testing.assert_allclose(support.dense(dw, sparse=True), rdw, rtol=1e-10, atol=1e-12)
  np.testing.assert_allclose(support.dense(db, sparse=True), rdb, rtol=1e-10, atol=1e-12)
  # The loss averages over the real targets only.
  assert float(tf.reduce_mean(losses.nll(targets, out)[real])) == pytest.approx(
      -expected.mean(), rel=1e-12)


def test_ignore_class_is_never_a_top_k_class(rng):
  tree = tf_hsm.Tree.balanced(12, 3)
  layer = HierarchicalSoftmax(tree, ignore_class=0, dtype="float64")
  hidden = rng.normal(size=(4, 5))
  layer(hidden, np.zeros(4, np.int32))
  bias = np.zeros(tree.num_slots)
  for _, slot in tree.path(0):
    bias[slot] = 50.0  # class 0 the likeliest by far
  layer.bias.assign(bias)
  everything = layer.log_prob_all(hidden).numpy()
  assert np.all(np.argmax(everything, -1) == 0)
  values, classes = layer.top_k(hidden, 4)
  order = np.argsort(-everything, axis=-1, kind="stable")[:, 1:5]
  np.testing.assert_array_equal(classes.numpy(), order)
  np.testing.assert_allclose(values.numpy(), np.take_along_axis(everything, order, -1),
                             rtol=1e-12)
  _, classes = layer.top_k(hidden, 4, exclude=order[:, :1])
  np.testing.assert_array_equal(classes.numpy(), np.argsort(-everything, -1,
                                                            kind="stable")[:, 2:6])


def test_ignore_class_config_and_errors():
  tree = tf_hsm.Tree.balanced(12, 3)
  layer = HierarchicalSoftmax(tree, ignore_class=3)
  assert HierarchicalSoftmax.from_config(layer.get_config()).ignore_class == 3
  for bad in (12, -1, 1.5, True):
    with pytest.raises(ValueError, match=r"ignore_class must be None or a class id in \[0, 12\)"):
      HierarchicalSoftmax(tree, ignore_class=bad)


def test_ignore_class_with_an_exclusion_for_every_row(rng):
  tree = tf_hsm.Tree.balanced(12, 3)
  layer = HierarchicalSoftmax(tree, ignore_class=0, dtype="float64")
  hidden = rng.normal(size=(2, 3, 5))
  layer(hidden, np.zeros((2, 3), np.int32))
  everything = layer.log_prob_all(hidden).numpy()
  _, classes = layer.top_k(hidden, 4, exclude=[[[4, 7]]])  # [1, 1, n]: every row
  for row, scores in zip(classes.numpy().reshape(-1, 4), everything.reshape(-1, 12)):
    order = np.lexsort((np.arange(12), -scores))
    np.testing.assert_array_equal(row, [c for c in order if c not in (0, 4, 7)][:4])


@pytest.mark.parametrize("loss", [losses.nll, losses.NegativeLogLikelihood()])
def test_the_loss_averages_over_targets_that_are_not_ignore_class(rng, loss):
  tree = tf_hsm.Tree.balanced(20, 3)
  hidden = rng.standard_normal((4, 5, 6)).astype(np.float32)
  targets = rng.integers(1, 20, (4, 5)).astype(np.int32)
  targets[:, 3:] = 0
  hidden_in, targets_in = keras.Input((5, 6)), keras.Input((5,), dtype="int32")
  model = keras.Model([hidden_in, targets_in],
                      HierarchicalSoftmax(tree, ignore_class=0)(hidden_in, targets_in))
  model.compile(loss=loss)
  log_p = model.predict([hidden, targets], verbose=0)
  assert model.evaluate([hidden, targets], targets, verbose=0) == pytest.approx(
      -log_p[targets > 0].mean(), rel=1e-6)
