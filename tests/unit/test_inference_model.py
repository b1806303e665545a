"""`inference_model` (trained model -> top-k predictions) in both Keras, against the
layer's own `top_k` and `log_prob_all` (float32 and the full distribution), and what it
shares with the serving export: the same cut, the same classes. Also `model.fit([x, y])`
without a separate `y`."""

import keras
import numpy as np
import pytest

import tf_hsm
from tf_hsm import keras as hk3
from tf_hsm.serving import ServingModule

tf_keras = pytest.importorskip("tf_keras")
from tf_hsm import tf_keras as hk2  # noqa: E402

V, D, T = 37, 8, 5


def _layer(front, kind):
  if kind == "hsm":
    return front.HierarchicalSoftmax(tf_hsm.Tree.huffman(np.arange(V, 0, -1.0), branching=3),
                                     name="output")
  return front.AdaptiveSoftmax(V, [6, 20], div_value=2.0, tail="two_level", name="output")


def _model(keras_module, front, kind):
  tokens = keras_module.Input((None,), dtype="int32", name="tokens")
  targets = keras_module.Input((None,), dtype="int32", name="targets")
  hidden = keras_module.layers.Embedding(V, D, mask_zero=True, name="embedding")(tokens)
  hidden = keras_module.layers.Dense(D, activation="tanh", name="body")(hidden)
  model = keras_module.Model([tokens, targets], _layer(front, kind)(hidden, targets))
  model.compile(optimizer=keras_module.optimizers.Adam(0.05), loss=front.losses.nll)
  return model


@pytest.mark.parametrize("kind", ["hsm", "adaptive"])
@pytest.mark.parametrize("which", ["keras", "tf_keras"])
def test_predicts_the_layers_top_k(rng, which, kind):
  keras_module, front = (keras, hk3) if which == "keras" else (tf_keras, hk2)
  model = _model(keras_module, front, kind)
  x = rng.integers(1, V, (16, T)).astype(np.int32)
  y = ((x * 5) % V).astype(np.int32)
  model.fit([x, y], y, epochs=2, batch_size=8, verbose=0)
  predictor = front.inference_model(model, k=4)
  assert [t.name.split(":")[0] for t in predictor.inputs] == ["tokens"]
  out = predictor.predict(x, verbose=0)
  assert out["classes"].shape == (16, T, 4) and out["log_probs"].shape == (16, T, 4)
  hidden = model.get_layer("body")(model.get_layer("embedding")(x))
  layer = model.get_layer("output")
  everything = layer.log_prob_all(hidden).numpy()
  np.testing.assert_allclose(np.exp(everything).sum(-1), 1.0, rtol=1e-4)
  best = np.sort(everything, -1)[..., ::-1][..., :4]
  np.testing.assert_allclose(out["log_probs"], best, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.take_along_axis(everything, out["classes"], -1),
                             out["log_probs"], rtol=1e-5, atol=1e-5)
  # The serving export cuts the same model the same way (stock ops, no tf_hsm op).
  served = ServingModule(model, k=4).top_k(tokens=x)
  np.testing.assert_array_equal(served["classes"].numpy(), out["classes"])
  # The trained weights are shared, not copied.
  assert any(w is layer.weights[0] for w in predictor.weights)


def test_fit_without_y_with_the_loss_object(rng):
  tokens = keras.Input((None,), dtype="int32")
  targets = keras.Input((None,), dtype="int32")
  hidden = keras.layers.Embedding(V, D, mask_zero=True)(tokens)
  model = keras.Model([tokens, targets], _layer(hk3, "hsm")(hidden, targets))
  model.compile(optimizer=keras.optimizers.Adam(0.05),
                loss=hk3.losses.NegativeLogLikelihood())
  x = rng.integers(1, V, (32, T)).astype(np.int32)
  x[:, 3:] = 0
  y = ((x * 5) % V).astype(np.int32)
  without_y = model.evaluate([x, y], verbose=0)
  np.testing.assert_allclose(without_y, model.evaluate([x, y], y, verbose=0), rtol=1e-6)
  log_probs = model.predict([x, y], verbose=0)
  np.testing.assert_allclose(without_y, -log_probs[x > 0].mean(), rtol=1e-5)
  history = model.fit([x, y], epochs=3, batch_size=8, verbose=0)
  assert history.history["loss"][-1] < history.history["loss"][0]


def test_the_cut_names_what_it_needs():
  hidden = keras.Input((D,))
  targets = keras.Input((), dtype="int32")
  out = _layer(hk3, "hsm")(hidden, targets)
  with pytest.raises(ValueError, match="one output must be the tf_hsm layer"):
    hk3.inference_model(keras.Model([hidden, targets], [out, out * 2.0]))
  other = keras.Input((), dtype="int32")
  derived = keras.layers.Identity()(other)
  model = keras.Model([hidden, other], _layer(hk3, "hsm")(hidden, derived))
  with pytest.raises(ValueError, match="targets must be one of the model's inputs"):
    hk3.inference_model(model)
  with pytest.raises(ValueError, match="inference_model needs a model .* found none"):
    hk3.inference_model(keras.Model(hidden, keras.layers.Dense(3)(hidden)))
  # The cut is export's; its errors name the function the user called.
  with pytest.raises(TypeError, match=r"^tf_hsm(\.keras)?\.inference_model takes a Keras "
                                      "model, got the layer 'output'"):
    hk3.inference_model(model.get_layer("output"))


def test_the_other_keras_and_k_are_named_or_clamped():
  model = _model(tf_keras, hk2, "hsm")
  with pytest.raises(TypeError, match=r"use tf_hsm\.tf_keras\.inference_model"):
    hk3.inference_model(model)
  with pytest.raises(TypeError, match=r"use tf_hsm\.keras\.inference_model"):
    hk2.inference_model(_model(keras, hk3, "hsm"))
  with pytest.raises(ValueError, match="k must be an int >= 1, got 0"):
    hk2.inference_model(model, k=0)
  # When the prediction model is made, not inside Keras' shape inference of its layer.
  for temperature in (0, -1.0, float("nan")):
    with pytest.raises(ValueError, match="^temperature must be positive and finite"):
      hk2.inference_model(model, output="sample", temperature=temperature)
  with pytest.raises(ValueError, match="below the smallest normal float32"):
    hk2.inference_model(model, output="sample", temperature=1e-40)
  with pytest.raises(TypeError, match="got a bool"):
    hk3.inference_model(_model(keras, hk3, "hsm"), output="sample", temperature=True)
  out = hk2.inference_model(model, k=100).predict(np.ones((2, 3), np.int32), verbose=0)
  assert out["classes"].shape == (2, 3, V)  # clamped, as the export clamps


def test_a_subclassed_tf_keras_model_is_cut_as_tf_keras(rng):
  class Subclassed(tf_keras.Model):
    pass

  tokens = tf_keras.Input((None,), dtype="int32")
  targets = tf_keras.Input((None,), dtype="int32")
  hidden = tf_keras.layers.Embedding(V, D)(tokens)
  model = Subclassed([tokens, targets], _layer(hk2, "adaptive")(hidden, targets))
  x = rng.integers(0, V, (3, T)).astype(np.int32)
  out = hk2.inference_model(model, k=2).predict(x, verbose=0)
  assert out["classes"].shape == (3, T, 2)
  np.testing.assert_array_equal(ServingModule(model, k=2).top_k(x)["classes"].numpy(),
                                out["classes"])


@pytest.mark.parametrize("kind", ["hsm", "adaptive"])
@pytest.mark.parametrize("which", ["keras", "tf_keras"])
def test_predicts_the_distribution_and_samples_without_targets(rng, which, kind):
  keras_module, front = (keras, hk3) if which == "keras" else (tf_keras, hk2)
  model = _model(keras_module, front, kind)
  x = rng.integers(1, V, (16, T)).astype(np.int32)
  y = ((x * 5) % V).astype(np.int32)
  model.fit([x, y], y, epochs=8, batch_size=8, verbose=0)  # a peaked distribution
  x = x[:6]
  layer = model.get_layer("output")
  hidden = model.get_layer("body")(model.get_layer("embedding")(x))
  everything = front.inference_model(model, output="log_prob_all")
  assert [t.name.split(":")[0] for t in everything.inputs] == ["tokens"]
  out = everything.predict(x, verbose=0)
  assert out.shape == (6, T, V)
  np.testing.assert_allclose(out, layer.log_prob_all(hidden).numpy(), rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(np.exp(out.astype(np.float64)).sum(-1), 1.0, rtol=1e-4)
  # The targets' log-probabilities the training model gives are columns of it.
  np.testing.assert_allclose(np.take_along_axis(out, y[:6, ..., None], -1)[..., 0],
                             model.predict([x, y[:6]], verbose=0), rtol=1e-5, atol=1e-5)
  # Samples follow the distribution: 2,000 draws at each of the first row's positions
  # (a frequency's standard deviation is at most 0.011).
  draws = front.inference_model(model, output="sample").predict(
      np.tile(x[:1], (2000, 1)), verbose=0)
  assert draws.shape == (2000, T) and draws.dtype == np.int64
  for t in range(T):
    frequency = np.bincount(draws[:, t], minlength=V) / 2000.0
    np.testing.assert_allclose(frequency, np.exp(out[0, t]), atol=0.06)
  assert np.exp(out[0]).max() > 0.15  # trained: far from uniform (1/37)
  with pytest.raises(ValueError, match=r"output must be one of \('top_k', 'log_prob_all', "
                                       r"'sample'\), got 'probs'"):
    front.inference_model(model, output="probs")
