"""`tf_hsm.tf_keras.AdaptiveSoftmax` against the Keras 3 layer (same weights, same
log-probabilities, gradients and inference), trained by tf_keras' fit, saved and loaded,
under mixed precision, and the errors that stop the two Keras from being mixed."""

import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

tf_keras = pytest.importorskip("tf_keras")

from tf_hsm import keras as hk3  # noqa: E402
from tf_hsm import tf_keras as hk2  # noqa: E402

import support  # noqa: E402

V, D = 40, 8


def _counts():
  counts = np.concatenate([[0.0], np.random.default_rng(3).permutation(np.arange(1, V))])
  return counts ** 2


def _kwargs(tail, ordered):
  counts = _counts()
  if ordered:
    return dict(cutoffs=[5, 15], div_value=2.0, tail=tail, counts=counts, head_bias=True,
                class_order=hk2.AdaptiveSoftmax.frequency_order(counts))
  return dict(cutoffs=[5, 15], div_value=2.0, tail=tail, head_bias=True)


@pytest.mark.parametrize("tail", ["flat", "two_level"])
@pytest.mark.parametrize("ordered", [False, True])
def test_same_weights_give_the_keras3_results(rng, tail, ordered):
  layer3 = hk3.AdaptiveSoftmax(V, **_kwargs(tail, ordered))
  layer2 = hk2.AdaptiveSoftmax(V, **_kwargs(tail, ordered))
  layer3.build((None, D))
  layer2.build((None, D))
  assert [w.shape for w in layer2.weights] == [tuple(w.shape) for w in layer3.weights]
  layer2.set_weights([np.asarray(w) for w in layer3.get_weights()])
  hidden = tf.constant(rng.normal(size=(3, 4, D)), tf.float32)
  targets = tf.constant(rng.integers(0, V, (3, 4)), tf.int32)
  targets = tf.tensor_scatter_nd_update(targets, [[0, 0]], [-1])
  mask = tf.constant(rng.random((3, 4)) > 0.3)
  results = support.layer_results((layer3, layer2), hidden, targets, mask, 4, 5)
  (out3, mask3, grads3, top3, all3, drawn3), (out2, mask2, grads2, top2, all2, drawn2) = \
      results
  np.testing.assert_allclose(out2.numpy(), out3.numpy(), rtol=1e-6, atol=1e-7)
  np.testing.assert_array_equal(mask2.numpy(), mask3.numpy())
  assert len(grads2) == len(grads3) == 1 + len(layer3.weights)
  for g2, g3 in zip(grads2, grads3):
    np.testing.assert_allclose(support.dense(g2), support.dense(g3), rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(top2[1].numpy(), top3[1].numpy())
  np.testing.assert_allclose(all2.numpy(), all3.numpy(), rtol=1e-6, atol=1e-7)
  np.testing.assert_array_equal(drawn2.numpy(), drawn3.numpy())


def _model(tail="two_level", optimizer=None):
  counts = _counts()
  tokens = tf_keras.Input((None,), dtype="int32")
  targets = tf_keras.Input((None,), dtype="int32")
  hidden = tf_keras.layers.Embedding(V, D, mask_zero=True)(tokens)
  layer = hk2.AdaptiveSoftmax(V, cutoffs=[5, 15], div_value=2.0, tail=tail, counts=counts,
                              class_order=hk2.AdaptiveSoftmax.frequency_order(counts),
                              name="adaptive")
  model = tf_keras.Model([tokens, targets], layer(hidden, targets))
  model.compile(optimizer=optimizer or tf_keras.optimizers.Adam(0.05), loss=hk2.losses.nll)
  return model


def _data(rng, n=64, t=5):
  x = rng.integers(1, V, (n, t)).astype(np.int32)
  x[:, 4:] = 0
  y = np.where(x > 0, (x * 7) % (V - 1) + 1, 0).astype(np.int32)
  return x, y


@pytest.mark.parametrize("tail", ["flat", "two_level"])
def test_fit_trains_every_weight(rng, tail):
  model = _model(tail)
  layer = model.get_layer("adaptive")
  assert not any("lambda" in type(sub).__name__.lower() for sub in model.layers)
  ids = {id(v) for v in model.trainable_variables}
  assert all(id(w) in ids for w in layer.trainable_weights)
  before = [w.numpy().copy() for w in layer.trainable_weights]
  x, y = _data(rng)
  history = model.fit([x, y], y, epochs=4, batch_size=16, verbose=0)
  assert history.history["loss"][-1] < 0.8 * history.history["loss"][0]
  assert all(np.abs(w.numpy() - b).max() > 0
             for w, b in zip(layer.trainable_weights, before))
  log_probs = model.predict([x, y], verbose=0)
  assert (log_probs[y == 0] == 0).all() and (log_probs[y > 0] < 0).all()


@pytest.mark.parametrize("name", ["model.keras", "model.h5", "saved_model"])
def test_save_and_load(tmp_path, rng, name):
  model = _model()
  x, y = _data(rng, n=16)
  model.fit([x, y], y, epochs=1, batch_size=8, verbose=0)
  path = str(tmp_path / name)
  model.save(path, save_format="tf" if name == "saved_model" else None)
  loaded = tf_keras.models.load_model(path)
  layer = loaded.get_layer("adaptive")
  assert isinstance(layer, hk2.AdaptiveSoftmax)
  np.testing.assert_array_equal(layer.class_order.order,
                                model.get_layer("adaptive").class_order.order)
  np.testing.assert_array_equal(loaded.predict([x, y], verbose=0),
                                model.predict([x, y], verbose=0))


def test_mixed_precision_keeps_the_tables_float32(rng):
  tf_keras.mixed_precision.set_global_policy("mixed_float16")
  try:
    model = _model()
  finally:
    tf_keras.mixed_precision.set_global_policy("float32")
  layer = model.get_layer("adaptive")
  assert all(w.dtype == tf.float32 and not hasattr(w, "_variable") for w in layer.weights)
  assert model.output.dtype == tf.float32
  x, y = _data(rng, n=16)
  history = model.fit([x, y], y, epochs=2, batch_size=8, verbose=0)
  assert np.isfinite(history.history["loss"]).all()


def test_mixing_the_two_keras_says_which_to_use():
  with pytest.raises(TypeError, match=r"tf_hsm\.tf_keras\.AdaptiveSoftmax"):
    hk3.AdaptiveSoftmax(V, [5])(tf_keras.Input((D,)), tf_keras.Input((), dtype="int32"))
  with pytest.raises(TypeError, match=r"tf_hsm\.keras\.AdaptiveSoftmax"):
    hk2.AdaptiveSoftmax(V, [5])(keras.Input((D,)), keras.Input((), dtype="int32"))


def test_both_layers_have_the_same_public_methods():
  def public(cls):
    return {name for name in dir(cls) if not name.startswith("_")
            and name not in dir(keras.layers.Layer) and name not in dir(tf_keras.layers.Layer)}
  assert public(hk2.AdaptiveSoftmax) == public(hk3.AdaptiveSoftmax)
  assert {"choose_cutoffs", "frequency_order", "from_torch_state_dict", "top_k",
          "log_prob_all", "sample"} <= public(hk2.AdaptiveSoftmax)
  counts = 1e6 / np.arange(1, 2001)
  machine = {"matmul_flops": 2e10, "read_bytes": 5e9, "call_seconds": 2e-5}
  assert (hk2.AdaptiveSoftmax.choose_cutoffs(counts, 32, 256, machine=machine) ==
          hk3.AdaptiveSoftmax.choose_cutoffs(counts, 32, 256, machine=machine))


def test_legacy_keras_resolves_to_the_tf_keras_layer():
  code = "import tf_hsm; print(tf_hsm.AdaptiveSoftmax.__module__)"
  out = support.run([sys.executable, "-c", code], timeout=120,
                    env=support.repo_env(TF_USE_LEGACY_KERAS="1")).stdout.split()
  assert out == ["tf_hsm.tf_keras.adaptive"]


@pytest.mark.parametrize("initializer", ["glorot_uniform",
                                         tf_keras.initializers.GlorotUniform(seed=3)])
def test_each_table_draws_its_own_initial_values(initializer):
  layer = hk2.AdaptiveSoftmax(V, [5, 15], div_value=1.0, kernel_initializer=initializer)
  layer.build((None, D))  # the two tails' projections: [D, D] each
  first, second = (p.numpy() for p in layer.tail_projections)
  assert not np.array_equal(first, second)


def test_adaptive_top_k_exclude_is_the_best_allowed(rng):
  """Both front ends' AdaptiveSoftmax.top_k(exclude=...) against every class's
  log-probability (log_prob_all), ties by increasing id."""
  for front in (hk3, hk2):
    layer = front.AdaptiveSoftmax(30, [5, 12], div_value=2.0, tail="two_level",
                                  dtype="float64")
    hidden = rng.normal(size=(4, 3, 8))
    layer(hidden, np.zeros((4, 3), np.int32))
    everything = layer.log_prob_all(hidden).numpy()
    exclude = rng.integers(-1, 30, size=(4, 3, 4))
    values, classes = layer.top_k(hidden, 5, exclude=exclude)
    for i in range(4):
      for j in range(3):
        order = np.lexsort((np.arange(30), -everything[i, j]))
        expected = [c for c in order if c not in set(exclude[i, j].tolist())][:5]
        np.testing.assert_array_equal(classes.numpy()[i, j], expected)
        np.testing.assert_allclose(values.numpy()[i, j], everything[i, j, expected],
                                   rtol=1e-10)
    with pytest.raises(ValueError, match=r"exclude must be class ids \[\.\.\., n\]"):
      layer.top_k(hidden, 5, exclude=[1, 2])
    with pytest.raises(tf.errors.InvalidArgumentError, match="excluded id is >= num_classes"):
      layer.top_k(hidden, 5, exclude=np.full((4, 3, 1), 30))
