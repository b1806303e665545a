"""tf_hsm.serving.export of a HierarchicalSoftmax model: the SavedModel loaded and run in a
process that cannot import tf_hsm (plain and under XLA), and converted to TFLite with the
builtin op set only and run by LiteRT's interpreter, against the op's answers; bad input
at the signatures. The layer has an `ignore_class` (never among the top k, padding in
log_prob) and the export a "top_k_excluding" signature.

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
EXCLUDE = 2


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


def sample_request(seed=5, temperature=1.0, **features):
  """A request to the "sample" signature: the features, `seed` int64 and `temperature`
  float32 scalars."""
  return dict(features, seed=np.array(seed, np.int64),
              temperature=np.array(temperature, np.float32))


def _path_slots(tree, c):
  """The slots (edges) on the path from the root to class c."""
  slots = [int(tree.class_slot[c])]
  node = int(tree.slot_node[slots[0]])
  while int(tree.node_slot[node]) >= 0:
    slots.append(int(tree.node_slot[node]))
    node = int(tree.slot_node[slots[-1]])
  return slots


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
  layer = tf_hsm.HierarchicalSoftmax(tree, ignore_class=0)
  model = keras.Model([tokens, targets], layer(x, targets))
  layer.kernel.assign(3.0 * rng.normal(size=layer.kernel.shape).astype(np.float32))
  bias = rng.normal(size=layer.bias.shape).astype(np.float32)
  bias[_path_slots(tree, 0)] += 3.0   # the ignored class among the best, to be left out
  layer.bias.assign(bias)
  folder = tmp_path_factory.mktemp("hsm_export")
  path = str(folder / "saved_model")
  chunk = hsm.CHUNK
  hsm.CHUNK = 4
  try:
    serving.export(model, path, k=K, max_exclude=EXCLUDE)
  finally:
    hsm.CHUNK = chunk
  tok = rng.integers(0, VOCAB, (4, 6)).astype(np.int32)
  tgt = rng.integers(0, tree.num_classes, (4, 6)).astype(np.int32)
  tgt[0, :2] = -1
  tgt[1, :2] = 0      # the ignore_class: padding, log-prob 0
  hidden = keras.Model(tokens, x)(tok)
  _, unrestricted = tf_hsm.top_k(hidden, layer.kernel, layer.bias, tree, K)
  # Else the export could return the ignored class and still pass.
  assert (unrestricted.numpy() == 0).any()
  exclude = np.full((4, 1, EXCLUDE), -1, np.int64)   # per sequence, padded with -1
  exclude[:, 0, 0] = unrestricted.numpy()[:, 0, 1]
  exclude[0, 0, 1] = unrestricted.numpy()[0, 1, 0]
  predicted = tf_hsm.inference_model(model, K).predict(tok, verbose=0)
  expected = {
      "log_prob": model([tok, tgt]).numpy(),
      "log_prob_all": tf_hsm.log_prob_all(hidden, layer.kernel, layer.bias, tree).numpy(),
      "top_k": (predicted["log_probs"], predicted["classes"]),
      "top_k_excluding": [t.numpy() for t in layer.top_k(hidden, K, exclude=exclude)],
  }
  return dict(path=path, folder=str(folder), tree=tree, tokens=tok, targets=tgt,
              exclude=exclude, expected=expected)


def _check_top(out, signature, expected):
  """The signature's classes and log_probs are the expected ones, classes in the same
  order except between values within 1e-4 of each other."""
  values, classes = out[f"{signature}/log_probs"], out[f"{signature}/classes"]
  assert classes.dtype == np.int64
  np.testing.assert_allclose(values, expected[0], rtol=1e-5, atol=1e-5)
  padded = np.pad(expected[0], [(0, 0), (0, 0), (1, 1)], constant_values=np.nan)
  with np.errstate(invalid="ignore"):
    near_tie = (np.abs(padded[..., 1:-1] - padded[..., :-2]) < 1e-4) | (
        np.abs(padded[..., 1:-1] - padded[..., 2:]) < 1e-4)
  assert not ((classes != expected[1]) & ~near_tie).any(), signature


def _check_answers(out, exp, full_tol=1e-5):
  np.testing.assert_allclose(out["log_prob/log_prob"], exp["log_prob"], rtol=1e-5,
                             atol=1e-5)
  _check_top(out, "top_k", exp["top_k"])
  _check_top(out, "top_k_excluding", exp["top_k_excluding"])
  if "log_prob_all/log_probs" in out:
    np.testing.assert_allclose(out["log_prob_all/log_probs"], exp["log_prob_all"],
                               rtol=full_tol, atol=full_tol)


def _requests(e, extra=True):
  requests = {"top_k": {"tokens": e["tokens"]},
              "top_k_excluding": {"tokens": e["tokens"], "exclude": e["exclude"]},
              "log_prob": {"tokens": e["tokens"], "targets": e["targets"]}}
  if extra:
    requests["log_prob_all"] = {"tokens": e["tokens"]}
    requests["sample"] = sample_request(3, tokens=e["tokens"])
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


def test_bad_exclude_at_the_saved_model_signature(exported):
  e = exported
  tok, num = e["tokens"], e["tree"].num_classes
  bad = {"width": np.zeros((4, 6, EXCLUDE + 1), np.int64),
         "rows": np.zeros((3, 1, EXCLUDE), np.int64),
         "range": np.full((1, 1, EXCLUDE), num, np.int64),
         "dtype": np.zeros((4, 6, EXCLUDE), np.int32)}
  requests = {f"{case}/top_k_excluding": {"tokens": tok, "exclude": ids}
              for case, ids in bad.items()}
  out = run_serving("tf", e["path"], requests, e["folder"])
  errors = {case: str(out[f"{case}/top_k_excluding/error"]) for case in bad}
  assert "exclude must have shape [?, ?, 2]" in errors["width"]
  assert "exclude must be [..., n] with leading shape] [4 6]" in errors["rows"]
  assert "exclude must be class ids < num_classes" in errors["range"]
  assert "int64" in errors["dtype"] or "int32" in errors["dtype"]


@pytest.fixture(scope="module")
def tflite_path(exported):
  converter = tf.lite.TFLiteConverter.from_saved_model(
      exported["path"], signature_keys=["top_k", "top_k_excluding", "log_prob"])
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
