"""tf_hsm.serving.export of a HierarchicalSoftmax model: the SavedModel loaded and run in a
process that cannot import tf_hsm (plain and under XLA), and converted to TFLite with the
builtin op set only and run by LiteRT's interpreter, against the op's answers; bad input
at the signatures.

One small model for the module; its chunk size is set to 4 while exporting, so that the
nodes of more than 4 children go through the tf.while_loop path (the unrolled one is
exported by tests/integration/test_serving_adaptive_export.py).
"""

import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_hsm
from oracle import random_mixed_tree
from tf_hsm import serving
from tf_hsm.serving import hsm

HELPER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "serving_load.py")
K = 5
VOCAB = 40


def run_serving(mode, model_path, requests, workdir, timeout=300):
  """Runs tests/integration/serving_load.py in a fresh `python -I` process in `workdir`; returns its
  outputs as {"<signature>/<name>": array}."""
  inputs = os.path.join(workdir, f"in_{mode}.npz")
  outputs = os.path.join(workdir, f"out_{mode}.npz")
  np.savez(inputs, **{f"{s}/{n}": v for s, kw in requests.items() for n, v in kw.items()})
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
  done = subprocess.run([sys.executable, "-I", HELPER, mode, model_path, inputs, outputs],
                        cwd=workdir, env=env, capture_output=True, text=True,
                        timeout=timeout, check=False)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  with np.load(outputs) as f:
    return dict(f.items())


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
  rng = np.random.default_rng(6301)
  tree = random_mixed_tree(rng, max_depth=4, max_branching=12, p_internal=0.4,
                           max_classes=150)
  while tree.num_classes < 40 or tree.max_depth < 3:
    tree = random_mixed_tree(rng, max_depth=4, max_branching=12, p_internal=0.4,
                             max_classes=150)
  tokens = keras.Input([None], dtype="int32", name="tokens")
  targets = keras.Input([None], dtype="int32", name="targets")
  x = keras.layers.Embedding(VOCAB, 8)(tokens)
  x = keras.layers.Dense(8, activation="tanh")(x)
  layer = tf_hsm.HierarchicalSoftmax(tree)
  model = keras.Model([tokens, targets], layer(x, targets))
  layer.kernel.assign(3.0 * rng.normal(size=layer.kernel.shape).astype(np.float32))
  layer.bias.assign(rng.normal(size=layer.bias.shape).astype(np.float32))
  folder = tmp_path_factory.mktemp("hsm_export")
  path = str(folder / "saved_model")
  chunk = hsm.CHUNK
  hsm.CHUNK = 4
  try:
    serving.export(model, path, k=K)
  finally:
    hsm.CHUNK = chunk
  tok = rng.integers(0, VOCAB, (4, 6)).astype(np.int32)
  tgt = rng.integers(0, tree.num_classes, (4, 6)).astype(np.int32)
  tgt[0, :2] = -1
  hidden = keras.Model(tokens, x)(tok)
  op_values, op_classes = tf_hsm.top_k(hidden, layer.kernel, layer.bias, tree, K)
  expected = {
      "log_prob": model([tok, tgt]).numpy(),
      "log_prob_all": tf_hsm.log_prob_all(hidden, layer.kernel, layer.bias, tree).numpy(),
      "top_k_values": op_values.numpy(), "top_k_classes": op_classes.numpy(),
  }
  return dict(path=path, folder=str(folder), tree=tree, tokens=tok, targets=tgt,
              expected=expected)


def _check_answers(out, exp, full_tol=1e-5):
  np.testing.assert_allclose(out["log_prob/log_prob"], exp["log_prob"], rtol=1e-5,
                             atol=1e-5)
  np.testing.assert_allclose(out["top_k/log_probs"], exp["top_k_values"], rtol=1e-5,
                             atol=1e-5)
  assert out["top_k/classes"].dtype == np.int64
  full = exp["log_prob_all"].reshape(-1, exp["log_prob_all"].shape[-1])
  ranked = -np.sort(-full, -1)
  classes = out["top_k/classes"].reshape(-1, K)
  op_classes = exp["top_k_classes"].reshape(-1, K)
  for row in range(len(full)):
    if ranked[row, K - 1] - ranked[row, K] > 1e-4:
      assert set(classes[row]) == set(op_classes[row]), row
  if "log_prob_all/log_probs" in out:
    np.testing.assert_allclose(out["log_prob_all/log_probs"], exp["log_prob_all"],
                               rtol=full_tol, atol=full_tol)


def _requests(e, extra=True):
  requests = {"top_k": {"tokens": e["tokens"]},
              "log_prob": {"tokens": e["tokens"], "targets": e["targets"]}}
  if extra:
    requests["log_prob_all"] = {"tokens": e["tokens"]}
    requests["sample"] = {"tokens": e["tokens"], "seed": np.array(3, np.int64),
                          "temperature": np.array(1.0, np.float32)}
  return requests


@pytest.mark.parametrize("mode", ["tf", "xla"])
def test_the_saved_model_runs_where_tf_hsm_cannot_be_imported(exported, mode):
  e = exported
  out = run_serving(mode, e["path"], _requests(e), e["folder"])
  _check_answers(out, e["expected"])
  draws = out["sample/classes"]
  assert draws.shape == e["tokens"].shape
  assert ((draws >= 0) & (draws < e["tree"].num_classes)).all()


def test_the_saved_model_has_no_tf_hsm_op(exported):
  with open(os.path.join(exported["path"], "saved_model.pb"), "rb") as f:
    assert b"Hsm>" not in f.read()


def test_bad_input_at_the_saved_model_signatures(exported):
  e = exported
  tok = e["tokens"]
  bad_targets = e["targets"].copy()
  bad_targets[1, 1] = e["tree"].num_classes
  requests = {
      "log_prob": {"tokens": tok, "targets": bad_targets},
      "top_k": {"tokens": np.zeros((0, 6), np.int32)},
      "log_prob_all": {"tokens": tok.astype(np.float32)},
  }
  out = run_serving("tf", e["path"], requests, e["folder"])
  assert "InvalidArgumentError" in str(out["log_prob/error"])
  assert "num_classes" in str(out["log_prob/error"])
  assert out["top_k/classes"].shape == (0, 6, K)
  assert "log_prob_all/error" in out      # float tokens: the signature refuses them


@pytest.fixture(scope="module")
def tflite_path(exported):
  converter = tf.lite.TFLiteConverter.from_saved_model(exported["path"],
                                                       signature_keys=["top_k", "log_prob"])
  converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS]
  path = os.path.join(exported["folder"], "model.tflite")
  with open(path, "wb") as f:
    f.write(converter.convert())
  return path


def test_tflite_with_builtins_only_runs_in_litert(exported, tflite_path):
  e = exported
  out = run_serving("litert", tflite_path, _requests(e, extra=False), e["folder"])
  _check_answers(out, e["expected"])


def test_bad_input_in_litert(exported, tflite_path):
  e = exported
  bad_targets = e["targets"].copy()
  bad_targets[1, 1] = e["tree"].num_classes
  bad_targets[2, 2] = 10**6
  requests = {
      "log_prob": {"tokens": e["tokens"], "targets": bad_targets},
      "top_k": {"tokens": np.zeros((0, 6), np.int32)},
  }
  out = run_serving("litert", tflite_path, requests, e["folder"])
  log_prob = out["log_prob/log_prob"]
  # Documented: targets >= num_classes give NaN in TFLite (no assert op there).
  assert np.isnan(log_prob[1, 1]) and np.isnan(log_prob[2, 2])
  good = np.ones_like(log_prob, bool)
  good[1, 1] = good[2, 2] = False
  np.testing.assert_allclose(log_prob[good], e["expected"]["log_prob"][good], rtol=1e-5,
                             atol=1e-5)
  assert out["top_k/classes"].shape == (0, 6, K)
  wrong_dtype = run_serving("litert", tflite_path,
                            {"top_k": {"tokens": e["tokens"].astype(np.float32)}},
                            e["folder"])
  assert "top_k/error" in wrong_dtype
