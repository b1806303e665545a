"""tf_hsm.serving.export of an AdaptiveSoftmax model (two-level tree tails) whose input is
the hidden states themselves: the SavedModel where tf_hsm cannot be imported, TFLite with
builtins only in LiteRT, k > num_classes, hidden states of the wrong width."""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_hsm
from tf_hsm import serving
from test_serving_export import run_serving, sample_request

DIM = 8
CLASSES = 60


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
  rng = np.random.default_rng(6302)
  hidden_in = keras.Input([DIM], name="hidden")
  targets = keras.Input([], dtype="int32", name="targets")
  layer = tf_hsm.AdaptiveSoftmax(CLASSES, [10, 25], div_value=2.0, head_bias=True,
                                 tail="two_level")
  model = keras.Model([hidden_in, targets], layer(hidden_in, targets))
  for v in layer.weights:
    v.assign(2.0 * rng.normal(size=v.shape).astype(np.float32))
  folder = tmp_path_factory.mktemp("adaptive_export")
  path = str(folder / "saved_model")
  serving.export(model, path, k=100)       # clamped to the 60 classes
  converter = tf.lite.TFLiteConverter.from_saved_model(path, signature_keys=["top_k"])
  converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS]
  tflite = str(folder / "model.tflite")
  with open(tflite, "wb") as f:
    f.write(converter.convert())
  hidden = rng.normal(size=(7, DIM)).astype(np.float32)
  tgt = rng.integers(0, CLASSES, 7).astype(np.int32)
  tgt[0] = -1
  return dict(path=path, tflite=tflite, folder=str(folder), hidden=hidden, targets=tgt,
              log_prob=model([hidden, tgt]).numpy(), full=layer.log_prob_all(hidden).numpy())


def _check_top_k(out, e):
  assert out["top_k/classes"].shape == (7, CLASSES)      # k=100 clamped to 60
  np.testing.assert_allclose(out["top_k/log_probs"], -np.sort(-e["full"], -1), rtol=1e-5,
                             atol=1e-5)
  np.testing.assert_array_equal(np.sort(out["top_k/classes"], -1),
                                np.tile(np.arange(CLASSES), (7, 1)))


def test_the_saved_model_runs_where_tf_hsm_cannot_be_imported(exported):
  e = exported
  requests = {"top_k": {"hidden": e["hidden"]},
              "log_prob": {"hidden": e["hidden"], "targets": e["targets"]},
              "log_prob_all": {"hidden": e["hidden"]}}
  out = run_serving("tf", e["path"], requests, e["folder"])
  _check_top_k(out, e)
  np.testing.assert_allclose(out["log_prob/log_prob"], e["log_prob"], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(out["log_prob_all/log_probs"], e["full"], rtol=1e-5, atol=1e-5)
  wrong = run_serving("tf", e["path"], {"top_k": {"hidden": e["hidden"][:, :5]}},
                      e["folder"])
  assert "hidden must have shape [?, 8], got shape] [7 5]" in str(wrong["top_k/error"])


def test_litert_runs_the_top_k_signature(exported):
  e = exported
  out = run_serving("litert", e["tflite"], {"top_k": {"hidden": e["hidden"]}}, e["folder"])
  _check_top_k(out, e)
  # A wrong width: refused by the pack named after the input (docs/serving.md).
  for shape in ((9, 5), (8, 9)):   # (8, 9): 72 values, 9 rows of 8 to a FULLY_CONNECTED
    wrong = run_serving("litert", e["tflite"], {"top_k": {"hidden": np.ones(shape,
                                                                            np.float32)}},
                        e["folder"])
    assert "PACK" in str(wrong["top_k/error"])


def test_the_tflite_file_holds_no_custom_op(exported):
  with open(exported["tflite"], "rb") as f:
    data = f.read()
  assert b"Hsm" not in data and b"Flex" not in data
  assert os.path.getsize(exported["tflite"]) > 0


def test_bad_input_at_the_adaptive_signatures(exported):
  """The sweep's cases (tests/integration/test_serving_sweep.py) that depend on the layer:
  NaN rows, temperatures, the hidden states' width and the targets' shape; TensorFlow
  and XLA where tf_hsm cannot be imported, LiteRT for top_k."""
  e = exported
  nan = e["hidden"].copy()
  nan[2, 3] = np.nan

  requests = {"nan/top_k": {"hidden": nan}, "nan/sample": sample_request(hidden=nan),
              "zero/sample": sample_request(temperature=0.0, hidden=e["hidden"]),
              "tiny/sample": sample_request(temperature=1e-30, hidden=e["hidden"]),
              "narrow/log_prob": {"hidden": e["hidden"][:, :5], "targets": e["targets"]},
              "short/log_prob": {"hidden": e["hidden"], "targets": e["targets"][:5]}}
  for mode in ("tf", "xla"):
    out = run_serving(mode, e["path"], requests, e["folder"])
    classes = out["nan/top_k/classes"]
    assert (classes[2] == -1).all() and (np.delete(classes, 2, 0) >= 0).all()
    assert np.isnan(out["nan/top_k/log_probs"][2]).all()
    drawn = out["nan/sample/classes"]
    assert drawn[2] == -1 and (np.delete(drawn, 2) >= 0).all() and (drawn < CLASSES).all()
    assert ((out["tiny/sample/classes"] >= 0) & (out["tiny/sample/classes"] < CLASSES)).all()
    if mode == "tf":
      assert "temperature must be positive and finite" in str(out["zero/sample/error"])
      assert "hidden must have shape [?, 8]" in str(out["narrow/log_prob/error"])
      assert "targets must have one class id per position" in str(out["short/log_prob/error"])
    else:
      assert (out["zero/sample/classes"] == -1).all()
      assert "hidden_must_have_shape_Nx8" in str(out["narrow/log_prob/error"])
      assert "targets_must_have_the_positions_shape" in str(out["short/log_prob/error"])
  lite = run_serving("litert", e["tflite"], {"nan/top_k": {"hidden": nan}}, e["folder"])
  assert (lite["nan/top_k/classes"][2] == -1).all()
  assert (np.delete(lite["nan/top_k/classes"], 2, 0) >= 0).all()
