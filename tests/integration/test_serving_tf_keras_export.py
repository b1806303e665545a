"""tf_hsm.serving.export of tf_keras models (Keras 2): a HierarchicalSoftmax model and an
AdaptiveSoftmax whose vocabulary keeps id 0 for padding (`class_order`), each loaded in a
process that cannot import tf_hsm; the adaptive one also converted to TFLite with the
builtin op set only and run by LiteRT. Answers against the trained tf_keras models."""

import numpy as np
import pytest
import tensorflow as tf

import tf_hsm
from tf_hsm import serving
from test_serving_export import run_serving

tf_keras = pytest.importorskip("tf_keras")
from tf_hsm import tf_keras as hk2  # noqa: E402

VOCAB, DIM, K = 50, 8, 4


def _model(kind, rng):
  tokens = tf_keras.Input((None,), dtype="int32", name="tokens")
  targets = tf_keras.Input((None,), dtype="int32", name="targets")
  hidden = tf_keras.layers.Embedding(VOCAB, DIM, mask_zero=True)(tokens)
  hidden = tf_keras.layers.Dense(DIM, activation="tanh")(hidden)
  if kind == "hsm":
    layer = hk2.HierarchicalSoftmax(tf_hsm.Tree.huffman(np.arange(VOCAB, 0, -1.0), 4))
  else:
    counts = np.concatenate([[0.0], rng.permutation(np.arange(1.0, VOCAB))])
    layer = hk2.AdaptiveSoftmax(VOCAB, [6, 20], div_value=2.0, tail="two_level",
                                counts=counts,
                                class_order=hk2.AdaptiveSoftmax.frequency_order(counts))
  model = tf_keras.Model([tokens, targets], layer(hidden, targets))
  model.compile(optimizer=tf_keras.optimizers.Adam(0.05), loss=hk2.losses.nll)
  x = rng.integers(1, VOCAB, (32, 6)).astype(np.int32)
  y = ((x * 3) % (VOCAB - 1) + 1).astype(np.int32)
  model.fit([x, y], y, epochs=2, batch_size=8, verbose=0)
  return model, x[:4], y[:4]


@pytest.fixture(scope="module", params=["hsm", "adaptive"])
def exported(request, tmp_path_factory):
  rng = np.random.default_rng(6403)
  model, x, y = _model(request.param, rng)
  y[0, :2] = 0 if request.param == "adaptive" else -1  # padding: 0 (the order leaves it out) or < 0
  folder = tmp_path_factory.mktemp(f"tf_keras_{request.param}")
  path = str(folder / "saved_model")
  serving.export(model, path, k=K)
  expected = hk2.inference_model(model, k=K).predict(x, verbose=0)
  return dict(kind=request.param, path=path, folder=str(folder), x=x, y=y,
              log_prob=model.predict([x, y], verbose=0), expected=expected)


def test_the_export_runs_where_tf_hsm_cannot_be_imported(exported):
  e = exported
  out = run_serving("tf", e["path"], {"top_k": {"tokens": e["x"]},
                                      "log_prob": {"tokens": e["x"], "targets": e["y"]}},
                    e["folder"])
  np.testing.assert_array_equal(out["top_k/classes"], e["expected"]["classes"])
  np.testing.assert_allclose(out["top_k/log_probs"], e["expected"]["log_probs"], rtol=1e-5,
                             atol=1e-5)
  np.testing.assert_allclose(out["log_prob/log_prob"], e["log_prob"], rtol=1e-5, atol=1e-5)
  assert (out["log_prob/log_prob"][0, :2] == 0).all()
  if e["kind"] == "adaptive":
    assert (out["top_k/classes"] != 0).all()  # padding is not a class


@pytest.mark.parametrize("exported", ["adaptive"], indirect=True)
def test_litert_runs_the_class_ordered_adaptive_softmax(exported):
  e = exported
  converter = tf.lite.TFLiteConverter.from_saved_model(e["path"], signature_keys=["top_k"])
  converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS]
  tflite = f"{e['folder']}/model.tflite"
  with open(tflite, "wb") as f:
    f.write(converter.convert())
  out = run_serving("litert", tflite, {"top_k": {"tokens": e["x"]}}, e["folder"])
  np.testing.assert_array_equal(out["top_k/classes"], e["expected"]["classes"])
