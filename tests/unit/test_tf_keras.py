"""tf_hsm in tf_keras ("Keras 2") models: `tf_hsm.tf_keras` against the Keras 3 front end
(same weights, same log-probabilities and gradients, same row updates), fit training
the layer, saving and loading, mixed precision, the tree rebuild, and the errors that
stop the two Keras from being mixed."""

import json
import os
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

tf_keras = pytest.importorskip("tf_keras")

import tf_hsm  # noqa: E402
from tf_hsm import keras as hk3  # noqa: E402
from tf_hsm import tf_keras as hk2  # noqa: E402

import support  # noqa: E402

V, D = 40, 6


def _tree():
  return tf_hsm.Tree.huffman(np.arange(1, V + 1, dtype=float), branching=3)


def _model(tree, optimizer=None, mask_zero=True):
  tokens = tf_keras.Input((None,), dtype="int32")
  targets = tf_keras.Input((None,), dtype="int32")
  hidden = tf_keras.layers.Embedding(V, D, mask_zero=mask_zero)(tokens)
  out = hk2.HierarchicalSoftmax(tree, name="hsm")(hidden, targets)
  model = tf_keras.Model([tokens, targets], out)
  model.compile(optimizer=optimizer or hk2.optimizers.LazyAdam(0.05), loss=hk2.losses.nll)
  return model


def _data(rng, n=64, t=5):
  x = rng.integers(1, V, (n, t)).astype(np.int32)
  y = ((x * 7) % V).astype(np.int32)
  return x, y


def test_same_weights_give_the_keras3_log_probs_and_gradients(rng):
  tree = _tree()
  hidden = tf.constant(rng.normal(size=(3, 4, D)), tf.float32)
  targets = tf.constant(rng.integers(0, V, (3, 4)), tf.int32)
  mask = tf.constant(rng.random((3, 4)) > 0.3)
  targets = tf.tensor_scatter_nd_update(targets, [[0, 0]], [-1])
  weights = tf.constant(rng.normal(size=(3, 4)), tf.float32)
  layer3, layer2 = hk3.HierarchicalSoftmax(tree), hk2.HierarchicalSoftmax(tree)
  layer3.build((None, D))
  layer2.build((None, D))
  layer2.set_weights([np.asarray(w) for w in layer3.get_weights()])
  results = []
  for layer in (layer3, layer2):
    with tf.GradientTape() as tape:
      tape.watch(hidden)
      out = layer(hidden, targets, mask=mask)
      loss = tf.reduce_sum(out * weights)
    grads = tape.gradient(loss, [hidden, layer.kernel, layer.bias])
    results.append((out.numpy(), out._keras_mask.numpy(), grads))
  (out3, mask3, grads3), (out2, mask2, grads2) = results
  np.testing.assert_array_equal(out2, out3)
  np.testing.assert_array_equal(mask2, mask3)
  assert not mask2[0, 0] and out2[0, 0] == 0.0
  assert isinstance(grads2[1], tf.IndexedSlices)
  for g2, g3 in zip(grads2, grads3):
    np.testing.assert_array_equal(support.dense(g2), support.dense(g3))


def test_fit_trains_the_layer(rng):
  model = _model(_tree())
  layer = model.get_layer("hsm")
  names = [v.name for v in model.trainable_variables]
  assert any(id(v) == id(layer.kernel) for v in model.trainable_variables), names
  assert not any("lambda" in type(sub).__name__.lower() for sub in model.layers)
  x, y = _data(rng)
  before = layer.kernel.numpy().copy()
  history = model.fit([x, y], y, epochs=3, batch_size=16, verbose=0)
  losses = history.history["loss"]
  assert losses[-1] < losses[0]
  assert np.abs(layer.kernel.numpy() - before).max() > 1e-3
  assert model.evaluate([x, y], y, verbose=0) < losses[0]
  assert model.predict([x, y], verbose=0).shape == x.shape


def test_loss_is_the_mean_over_valid_tokens(rng):
  model = _model(_tree())
  x, y = _data(rng, n=8)
  y[:, -2:] = -1  # padding targets
  x[0, 0] = 0     # masked by the embedding
  log_probs = model.predict([x, y], verbose=0)
  valid = (y >= 0) & (x != 0)
  expected = -log_probs[valid].mean()
  np.testing.assert_allclose(model.evaluate([x, y], y, batch_size=8, verbose=0), expected,
                             rtol=1e-5)


@pytest.mark.parametrize("name", ["model.keras", "model.h5", "saved_model"])
def test_save_and_load(tmp_path, rng, name):
  model = _model(_tree())
  x, y = _data(rng, n=16)
  model.fit([x, y], y, epochs=1, batch_size=8, verbose=0)
  path = str(tmp_path / name)
  model.save(path, save_format="tf" if name == "saved_model" else None)
  loaded = tf_keras.models.load_model(path)
  assert isinstance(loaded.get_layer("hsm"), hk2.HierarchicalSoftmax)
  np.testing.assert_array_equal(loaded.predict([x, y], verbose=0),
                                model.predict([x, y], verbose=0))
  if name != "model.h5":
    assert isinstance(loaded.optimizer, hk2.optimizers.LazyAdam)


@pytest.mark.parametrize("make", ["LazyAdam", "SparseAdagrad", "SparseSGD"])
def test_row_updates_are_the_keras3_ones(rng, make):
  kwargs = {"SparseSGD": {"momentum": 0.9}}.get(make, {})
  table = rng.normal(size=(10, 3)).astype(np.float32)
  grads = [tf.IndexedSlices(tf.constant(rng.normal(size=(4, 3)), tf.float32),
                            tf.constant(rng.integers(0, 10, 4)), tf.constant([10, 3]))
           for _ in range(3)]
  results = []
  for module, make_var in ((hk3.optimizers, keras.Variable), (hk2.optimizers, tf.Variable)):
    variable = make_var(table.copy())
    optimizer = getattr(module, make)(0.1, **kwargs)
    for grad in grads:
      optimizer.apply_gradients([(grad, variable)])
    results.append(np.asarray(variable))
  np.testing.assert_allclose(results[1], results[0], rtol=2e-6, atol=1e-7)
  untouched = np.setdiff1d(np.arange(10), np.concatenate([g.indices for g in grads]))
  np.testing.assert_array_equal(results[1][untouched], table[untouched])


def test_mixed_precision_keeps_the_table_float32(rng):
  tf_keras.mixed_precision.set_global_policy("mixed_float16")
  try:
    model = _model(_tree())
  finally:
    tf_keras.mixed_precision.set_global_policy("float32")
  layer = model.get_layer("hsm")
  assert layer.kernel.dtype == tf.float32
  assert not hasattr(layer.kernel, "_variable")  # not an AutoCastVariable
  assert model.output.dtype == tf.float32
  x, y = _data(rng, n=16)
  history = model.fit([x, y], y, epochs=2, batch_size=8, verbose=0)
  assert np.isfinite(history.history["loss"]).all()


def test_rebuild_tree_callback(rng):
  model = _model(_tree())
  x, y = _data(rng)
  callback = hk2.callbacks.RebuildTree("hsm", after_epoch=1)
  history = model.fit([x, y], y, epochs=2, batch_size=16, verbose=0, callbacks=[callback])
  layer = model.get_layer("hsm")
  assert callback.tree is not None and layer.tree is callback.tree
  assert layer.kernel.shape[0] == callback.tree.num_slots
  assert any(v is layer.kernel for v in model.trainable_variables)
  assert np.isfinite(history.history["loss"]).all()
  before = layer.kernel.numpy().copy()
  model.fit([x, y], y, epochs=1, batch_size=16, verbose=0)
  assert np.abs(layer.kernel.numpy() - before).max() > 0


@pytest.mark.parametrize("when", [{"after_epoch": 1}, {"after_batch": 3}])
def test_mixed_float16_rebuild_gives_the_loss_scale_optimizer_the_new_table(rng, when):
  # The loss-scale wrapper keeps no variable index of its own: the rebuild took it for an
  # optimizer not yet built, kept it, and the next step failed on the new kernel
  # ("The optimizer cannot recognize variable kernel:0").
  tf_keras.mixed_precision.set_global_policy("mixed_float16")
  try:
    model = _model(_tree())
  finally:
    tf_keras.mixed_precision.set_global_policy("float32")
  old_optimizer = model.optimizer
  x, y = _data(rng)
  scales = []  # the loss scale and its counter at each step's start
  spy = tf_keras.callbacks.LambdaCallback(on_train_batch_begin=lambda batch, logs: scales.append(
      (float(model.optimizer.loss_scale), int(model.optimizer.dynamic_counter.numpy()))))
  old_optimizer.build(model.trainable_variables)
  old_optimizer._loss_scale.current_loss_scale.assign(256.0)  # pylint: disable=protected-access
  callback = hk2.callbacks.RebuildTree("hsm", **when)
  history = model.fit([x, y], y, epochs=2, batch_size=16, verbose=0,
                      callbacks=[callback, spy])
  layer = model.get_layer("hsm")
  assert callback.tree is not None and layer.tree is callback.tree
  assert model.optimizer is not old_optimizer
  assert isinstance(model.optimizer, tf_keras.mixed_precision.LossScaleOptimizer)
  assert isinstance(model.optimizer.inner_optimizer, hk2.optimizers.LazyAdam)
  # The scale goes on where it was across the rebuild (no overflow here: 256, and a
  # counter of the steps), not back to 32,768 and 0.
  assert [s for s, _ in scales] == [256.0] * len(scales)
  assert [c for _, c in scales] == list(range(len(scales)))
  assert np.isfinite(history.history["loss"]).all()
  before = layer.kernel.numpy().copy()
  model.fit([x, y], y, epochs=1, batch_size=16, verbose=0)
  assert np.abs(layer.kernel.numpy() - before).max() > 0


def test_keras3_rebuild_callback_in_a_tf_keras_model_says_which_to_use(rng):
  model = _model(_tree())
  x, y = _data(rng, n=16)
  with pytest.raises(TypeError, match=r"tf_keras model.*tf_hsm\.tf_keras\.callbacks\."
                     r"RebuildTree"):
    model.fit([x, y], y, epochs=1, verbose=0,
              callbacks=[hk3.callbacks.RebuildTree("hsm")])


def test_tf_keras_rebuild_callback_in_a_keras3_model_says_which_to_use(rng):
  tokens, targets = keras.Input((None,), dtype="int32"), keras.Input((None,), dtype="int32")
  hidden = keras.layers.Embedding(V, D)(tokens)
  model = keras.Model([tokens, targets],
                      hk3.HierarchicalSoftmax(_tree(), name="hsm")(hidden, targets))
  model.compile(optimizer=hk3.optimizers.LazyAdam(0.05), loss=hk3.losses.nll)
  x, y = _data(rng, n=16)
  with pytest.raises(TypeError, match=r"keras model.*tf_hsm\.keras\.callbacks\."
                     r"RebuildTree"):
    model.fit([x, y], y, epochs=1, verbose=0,
              callbacks=[hk2.callbacks.RebuildTree("hsm")])


# Under TF_USE_LEGACY_KERAS=1, every way of naming a public Keras name of tf_hsm, in
# an order where a `from tf_hsm.X import` comes before `tf_hsm.X` (which kept the
# Keras 3 module), then a tf.keras model's fit with the callback of the form
# docs/usage.md writes.
LEGACY_NAMES = """
import json, numpy as np, tensorflow as tf
from tf_hsm.callbacks import RebuildTree
from tf_hsm.losses import nll
from tf_hsm.optimizers import LazyAdam
from tf_hsm.metrics import Perplexity
from tf_hsm.layers import HierarchicalSoftmax
from tf_hsm.adaptive import AdaptiveSoftmax
import tf_hsm
import tf_hsm.callbacks as callbacks_module
from tf_hsm import losses, optimizers, metrics
found = {
    "from tf_hsm.callbacks": RebuildTree.__module__, "from tf_hsm.losses": nll.__module__,
    "from tf_hsm.optimizers": LazyAdam.__module__,
    "from tf_hsm.metrics": Perplexity.__module__,
    "from tf_hsm.layers": HierarchicalSoftmax.__module__,
    "from tf_hsm.adaptive": AdaptiveSoftmax.__module__,
    "import tf_hsm.callbacks as": callbacks_module.__name__,
    "from tf_hsm import losses": losses.__name__,
    "from tf_hsm import optimizers": optimizers.__name__,
    "from tf_hsm import metrics": metrics.__name__}
for name in ("callbacks", "losses", "optimizers", "metrics", "layers", "adaptive"):
  found["tf_hsm." + name] = getattr(tf_hsm, name).__name__
for name in ("HierarchicalSoftmax", "HierarchicalSoftmaxMixture", "AdaptiveSoftmax",
             "inference_model"):
  found["tf_hsm." + name] = getattr(tf_hsm, name).__module__
V = 40
tree = tf_hsm.Tree.huffman(np.arange(1, V + 1, dtype=float), branching=3)
tokens = tf.keras.Input((None,), dtype="int32")
targets = tf.keras.Input((None,), dtype="int32")
hidden = tf.keras.layers.Embedding(V, 6)(tokens)
model = tf.keras.Model([tokens, targets], HierarchicalSoftmax(tree, name="hsm")(hidden,
                                                                               targets))
model.compile(optimizer=LazyAdam(0.05), loss=nll)
x = np.random.default_rng(0).integers(1, V, (32, 5)).astype(np.int32)
callback = RebuildTree("hsm", after_epoch=1)
model.fit([x, x], x, epochs=2, batch_size=16, verbose=0, callbacks=[callback])
found["rebuilt"] = callback.tree is not None and model.get_layer("hsm").tree is callback.tree
print(json.dumps(found))
"""


def test_legacy_keras_every_import_form_is_the_tf_keras_front_end(tmp_path):
  script = tmp_path / "legacy_names.py"
  script.write_text(LEGACY_NAMES)
  out = support.run([script], timeout=300,
                    env=support.repo_env(TF_USE_LEGACY_KERAS="1")).stdout
  found = json.loads(out.strip().splitlines()[-1])
  assert found.pop("rebuilt") is True
  wrong = {form: module for form, module in found.items()
           if not module.startswith("tf_hsm.tf_keras.")}
  assert not wrong, wrong


def test_keras3_layer_on_tf_keras_tensors_says_which_to_use():
  hidden = tf_keras.Input((D,))
  targets = tf_keras.Input((), dtype="int32")
  with pytest.raises(TypeError, match=r"tf_hsm\.tf_keras\.HierarchicalSoftmax"):
    hk3.HierarchicalSoftmax(_tree())(hidden, targets)


def test_tf_keras_layer_on_keras3_tensors_says_which_to_use():
  hidden = keras.Input((D,))
  targets = keras.Input((), dtype="int32")
  with pytest.raises(TypeError, match=r"tf_hsm\.keras\.HierarchicalSoftmax"):
    hk2.HierarchicalSoftmax(_tree())(hidden, targets)


def test_fused_update_is_keras3s():
  with pytest.raises(ValueError, match="fused_update is Keras 3's"):
    hk2.HierarchicalSoftmax(_tree(), fused_update=True)
  # A Keras 3 layer's config (fused_update=False) loads.
  config = hk3.HierarchicalSoftmax(_tree()).get_config()
  assert hk2.HierarchicalSoftmax(_tree(), fused_update=config["fused_update"]).tree


def test_keras3_optimizer_in_a_tf_keras_model_says_which_to_use():
  with pytest.raises(ValueError, match=r"tf_hsm\.tf_keras\.optimizers\.LazyAdam"):
    _model(_tree(), optimizer=hk3.optimizers.LazyAdam(0.01))


def test_tf_keras_optimizer_in_a_keras3_model_says_which_to_use():
  hidden = keras.Input((D,))
  model = keras.Model(hidden, keras.layers.Dense(2)(hidden))
  with pytest.raises(ValueError, match=r"tf_hsm\.keras\.optimizers\.SparseSGD"):
    model.compile(optimizer=hk2.optimizers.SparseSGD(0.01), loss="mse")


def test_legacy_keras_resolves_to_the_tf_keras_front_end():
  code = ("import tf_hsm.frontend as f, importlib; "
          "m = importlib.import_module(f.keras_package()); "
          "print(m.__name__, m.HierarchicalSoftmax.__module__)")
  out = support.run([sys.executable, "-c", code], timeout=120,
                    env=support.repo_env(TF_USE_LEGACY_KERAS="1")).stdout.split()
  assert out == ["tf_hsm.tf_keras", "tf_hsm.tf_keras.layers"]


def test_importable_without_legacy_keras():
  assert os.environ.get("TF_USE_LEGACY_KERAS") in (None, "", "0")
  assert hk2.HierarchicalSoftmax.__module__ == "tf_hsm.tf_keras.layers"


def test_tf_keras_package_holds_every_public_module():
  for name in ("callbacks", "losses", "metrics", "optimizers"):
    assert name in hk2.__all__ and getattr(hk2, name).__name__ == f"tf_hsm.tf_keras.{name}"


def test_jit_compile_is_refused_by_a_message_that_fits_tf_keras(rng):
  """tf_keras, unlike Keras 3, compiles the step with XLA when asked: the ops' error
  must say to compile without it (not that the model already turned it off)."""
  model = _model(_tree())
  model.compile(optimizer=hk2.optimizers.LazyAdam(0.01), loss=hk2.losses.nll,
                jit_compile=True)
  x, y = _data(rng, n=8)
  with pytest.raises(ValueError, match="tf_keras models do not: compile them without "
                                       "jit_compile=True"):
    model.fit([x, y], y, epochs=1, verbose=0)
