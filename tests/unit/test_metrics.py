"""tf_hsm.keras.metrics against float64 computations from their definitions, with
padding (targets < 0): Perplexity in model.compile/evaluate, TopKAccuracy on hidden
states."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_hsm
from tf_hsm.keras import losses
from tf_hsm.keras import metrics
from tests.oracle import log_prob_reference

B, T, D, V = 4, 6, 8, 40


def _data(rng):
  hidden = rng.standard_normal((B, T, D)).astype(np.float32)
  targets = rng.integers(0, V, (B, T)).astype(np.int32)
  targets[0, 4:] = -1  # padding at the ends of two sequences
  targets[2, 1:] = -1
  return hidden, targets


def _model(tree):
  hidden_in = keras.Input((T, D))
  targets_in = keras.Input((T,), dtype="int32")
  layer = tf_hsm.HierarchicalSoftmax(tree)
  model = keras.Model([hidden_in, targets_in], layer(hidden_in, targets_in))
  return model, layer


def test_perplexity_in_compile_matches_float64(rng):
  tree = tf_hsm.Tree.huffman(1.0 / np.arange(1, V + 1), branching=3)
  hidden, targets = _data(rng)
  model, layer = _model(tree)
  model.compile(loss=losses.nll, metrics=[metrics.Perplexity()])
  results = model.evaluate([hidden, targets], targets, batch_size=2, verbose=0,
                           return_dict=True)
  real = targets >= 0
  log_p = log_prob_reference(hidden[real], layer.kernel.numpy(), layer.bias.numpy(), tree,
                             targets[real])[0]
  expected = np.exp(-log_p.mean())
  assert results["perplexity"] == pytest.approx(expected, rel=1e-5)
  # The wrong recipe: predict gives 0.0 at padding, so exp(-mean) over all positions
  # is lower than the perplexity.
  predicted = model.predict([hidden, targets], verbose=0)
  assert np.all(predicted[~real] == 0.0)
  assert np.exp(-predicted.mean()) < expected * 0.9
  assert np.exp(-predicted[real].mean()) == pytest.approx(expected, rel=1e-5)


def test_perplexity_update_state_weights_and_reset():
  metric = metrics.Perplexity()
  log_p = np.log([[0.5, 0.25, 1.0], [0.1, 1.0, 1.0]]).astype(np.float32)
  targets = np.array([[3, 1, -1], [7, -1, -1]])
  metric.update_state(targets, log_p)
  expected = np.exp(-np.mean(np.log([0.5, 0.25, 0.1])))
  assert float(metric.result()) == pytest.approx(expected, rel=1e-6)
  metric.update_state(targets, log_p, sample_weight=np.array([0.0, 1.0]))
  assert float(metric.result()) == pytest.approx(np.exp(
      -(np.log(0.5) + np.log(0.25) + 2 * np.log(0.1)) / 4), rel=1e-6)
  metric.reset_state()
  assert float(metric.result()) == 1.0  # no tokens: exp(0)
  config = metric.get_config()
  assert keras.saving.deserialize_keras_object(
      keras.saving.serialize_keras_object(metric)).name == config["name"]


def _all_log_probs(hidden, kernel, bias, tree):
  """[N, V] float64 log P(c | h) from the definition (the oracle's path products)."""
  n = hidden.shape[0]
  out = np.empty((n, tree.num_classes))
  for c in range(tree.num_classes):
    out[:, c] = log_prob_reference(hidden, kernel, bias, tree, np.full(n, c))[0]
  return out


@pytest.mark.parametrize("k", [1, 3, 10])
def test_top_k_accuracy_is_exact(rng, k):
  tree = tf_hsm.Tree.two_level(V, counts=1.0 / np.arange(1, V + 1))
  hidden, targets = _data(rng)
  hidden *= 3.0
  model, layer = _model(tree)
  model([hidden, targets])  # builds the layer
  kernel = layer.kernel.numpy() * 5.0  # spread the log-probabilities: no near-ties
  layer.kernel.assign(kernel)
  real = targets >= 0
  scores = _all_log_probs(hidden[real], kernel, layer.bias.numpy(), tree)
  order = np.lexsort((np.broadcast_to(np.arange(V), scores.shape), -scores), axis=-1)
  expected = np.mean([t in row[:k] for t, row in zip(targets[real], order)])
  metric = metrics.TopKAccuracy(layer, k=k)
  metric.update_state(targets[:2], hidden[:2])
  metric.update_state(targets[2:], hidden[2:])
  assert float(metric.result()) == pytest.approx(expected, abs=1e-7)
  assert metric.name == f"top_{k}_accuracy"
  dataset = [((hidden[i:i + 2], targets[i:i + 2]), targets[i:i + 2]) for i in (0, 2)]
  hidden_model = lambda inputs, training=False: inputs[0]  # noqa: E731
  assert metrics.top_k_accuracy(hidden_model, layer, [(x, y) for x, y in dataset],
                                k=k) == pytest.approx(expected, abs=1e-7)


def test_top_k_accuracy_arguments():
  with pytest.raises(ValueError, match="k must be a positive int"):
    metrics.TopKAccuracy(object(), k=0)
  with pytest.raises(TypeError, match="top_k"):
    metrics.TopKAccuracy(object(), k=2)
