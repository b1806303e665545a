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


def test_top_k_accuracy_refuses_targets_that_are_not_class_ids(rng):
  """Beside hidden states (no layer output to read them from), a target past the
  classes would count as a miss and a float be truncated: each is named instead."""
  tree = tf_hsm.Tree.two_level(V, counts=1.0 / np.arange(1, V + 1))
  hidden, targets = _data(rng)
  model, layer = _model(tree)
  model([hidden, targets])
  metric = metrics.TopKAccuracy(layer, k=2)
  with pytest.raises(tf.errors.InvalidArgumentError, match=f"< num_classes = {V}"):
    metric.update_state(np.where(targets >= 0, V + 7, targets), hidden)
  with pytest.raises(TypeError, match="integer class ids, got float"):
    metric.update_state(targets + 0.5, hidden)
  metric.update_state(targets, hidden)  # padding (< 0) is still skipped
  assert 0.0 <= float(metric.result()) <= 1.0


def test_top_k_accuracy_arguments():
  with pytest.raises(ValueError, match="k must be a positive int"):
    metrics.TopKAccuracy(object(), k=0)
  with pytest.raises(TypeError, match="top_k"):
    metrics.TopKAccuracy(object(), k=2)


tf_keras = pytest.importorskip("tf_keras")
from tf_hsm import tf_keras as hk2  # noqa: E402
from tf_hsm.tf_keras import metrics as tf_keras_metrics  # noqa: E402

FRONTS = {"keras": (keras, tf_hsm.keras, metrics),
          "tf_keras": (tf_keras, hk2, tf_keras_metrics)}


def _expected_top_k(layer, hidden, targets, k, weight):
  """float64 top-k accuracy from every class's log-probability (the layer's
  log_prob_all cast up; ties by increasing id), over the positions weight marks."""
  scores = np.asarray(layer.log_prob_all(hidden), np.float64).reshape(-1, V)
  order = np.lexsort((np.broadcast_to(np.arange(V), scores.shape), -scores), axis=-1)
  hits = np.array([t in row[:k] for t, row in zip(targets.reshape(-1), order)])
  weight = weight.reshape(-1)
  return float((hits * weight).sum() / weight.sum())


@pytest.mark.parametrize("which", ["keras", "tf_keras"])
@pytest.mark.parametrize("kind", ["hsm", "adaptive"])
def test_top_k_accuracy_in_compile_is_exact(rng, which, kind):
  keras_module, front, module = FRONTS[which]
  hidden, targets = _data(rng)
  hidden *= 3.0
  hidden_in = keras_module.Input((T, D))
  targets_in = keras_module.Input((T,), dtype="int32")
  layer = (front.HierarchicalSoftmax(tf_hsm.Tree.two_level(V), ignore_class=5)
           if kind == "hsm" else front.AdaptiveSoftmax(V, [8, 20], div_value=2.0,
                                                        tail="two_level"))
  model = keras_module.Model([hidden_in, targets_in], layer(hidden_in, targets_in))
  model.compile(loss=front.losses.nll,
                metrics=[module.TopKAccuracy(k=3), module.TopKAccuracy(layer, k=1),
                         module.Perplexity()])
  targets[1, :3] = 5  # the ignored class, for the HierarchicalSoftmax
  results = model.evaluate([hidden, targets], targets, batch_size=2, verbose=0,
                           return_dict=True)
  real = (targets >= 0) & ((targets != 5) if kind == "hsm" else True)
  for k in (3, 1):
    assert results[f"top_{k}_accuracy"] == pytest.approx(
        _expected_top_k(layer, hidden, targets, k, real.astype(float)), abs=1e-6)
  log_p = np.asarray(model.predict([hidden, targets], verbose=0), np.float64)
  assert results["perplexity"] == pytest.approx(np.exp(-log_p[real].mean()), rel=1e-5)
  # The same metric outside compile, given the layer and the hidden states.
  metric = module.TopKAccuracy(layer, k=3)
  metric.update_state(targets, hidden)
  assert float(metric.result()) == pytest.approx(results["top_3_accuracy"], abs=1e-6)


@pytest.mark.parametrize("which", ["keras", "tf_keras"])
def test_top_k_accuracy_without_a_tf_hsm_output_says_so(which):
  _, _, module = FRONTS[which]
  metric = module.TopKAccuracy(k=2)
  with pytest.raises(ValueError, match=r"without a layer reads the hidden states off the "
                                       r"output of a tf_hsm layer"):
    metric.update_state(np.zeros((2, 3), np.int32), np.zeros((2, 3), np.float32))
  with pytest.raises(TypeError, match=r"pass k=5"):
    module.TopKAccuracy(5)
  config = metric.get_config()
  assert config["k"] == 2 and type(metric).from_config(config).k == 2


def test_tf_keras_perplexity_matches_float64(rng):
  tree = tf_hsm.Tree.huffman(1.0 / np.arange(1, V + 1), branching=3)
  hidden, targets = _data(rng)
  hidden_in = tf_keras.Input((T, D))
  targets_in = tf_keras.Input((T,), dtype="int32")
  layer = hk2.HierarchicalSoftmax(tree)
  model = tf_keras.Model([hidden_in, targets_in], layer(hidden_in, targets_in))
  model.compile(loss=hk2.losses.nll, metrics=[tf_keras_metrics.Perplexity()])
  results = model.evaluate([hidden, targets], targets, batch_size=2, verbose=0,
                           return_dict=True)
  real = targets >= 0
  log_p = log_prob_reference(hidden[real], layer.kernel.numpy(), layer.bias.numpy(), tree,
                             targets[real])[0]
  assert results["perplexity"] == pytest.approx(np.exp(-log_p.mean()), rel=1e-5)
