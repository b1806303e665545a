"""Keras' own `model.export` inside `tf_hsm.serving.stock_ops()`: the SavedModel holds no
tf_hsm op, and its endpoint gives the model's log-probabilities in a process that cannot
import tf_hsm, and under XLA there."""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_hsm
from test_serving_export import run_serving

VOCAB = 60


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
  rng = np.random.default_rng(5)
  tree = tf_hsm.Tree.huffman(rng.integers(1, 100, VOCAB).astype(float), branching=3)
  tokens = keras.Input([None], dtype="int32", name="tokens")
  targets = keras.Input([None], dtype="int32", name="targets")
  hidden = keras.layers.Dense(12)(keras.layers.Embedding(VOCAB, 8)(tokens))
  model = keras.Model([tokens, targets], tf_hsm.HierarchicalSoftmax(tree)(hidden, targets))
  model.get_layer(index=-1).set_weights(
      [w + rng.normal(size=w.shape) for w in model.get_layer(index=-1).get_weights()])
  directory = str(tmp_path_factory.mktemp("keras_export") / "model")
  with tf_hsm.serving.stock_ops():
    model.export(directory)
  x = rng.integers(0, VOCAB, (3, 7)).astype(np.int32)
  y = rng.integers(0, VOCAB, (3, 7)).astype(np.int32)
  y[0, 5:] = -1  # padding: log-probability 0
  return directory, {"tokens": x, "targets": y}, model([x, y]).numpy(), model


def test_the_export_holds_no_tf_hsm_op(exported):
  directory = exported[0]
  with open(os.path.join(directory, "saved_model.pb"), "rb") as f:
    assert b"Hsm>" not in f.read()


@pytest.mark.parametrize("mode", ["tf", "xla"])
def test_the_endpoint_gives_the_models_log_probs_without_tf_hsm(exported, mode, tmp_path):
  directory, inputs, expected, _ = exported
  out = run_serving(mode, directory, {"serve": inputs}, str(tmp_path))
  assert "serve/error" not in out, out.get("serve/error")
  np.testing.assert_allclose(out["serve/output_0"], expected, rtol=1e-5, atol=1e-6)
  assert (out["serve/output_0"][0, 5:] == 0).all()


def _op_types(model, inputs):
  spec = [tf.TensorSpec([None, None], tf.int32)] * 2
  graph = tf.function(lambda x, y: model([x, y])).get_concrete_function(*spec).graph
  return {op.type for op in graph.get_operations()}


def test_only_inside_the_context_the_layer_traces_stock_ops(exported):
  _, inputs, _, model = exported
  with tf_hsm.serving.stock_ops():
    inside = _op_types(model, inputs)
  outside = _op_types(model, inputs)
  assert not any(t.startswith("Hsm>") for t in inside), sorted(inside)
  assert any(t.startswith("Hsm>") for t in outside), sorted(outside)
