"""Keras 3 metrics for models whose output is tf_hsm's per-token log-probability.

`HierarchicalSoftmax(tree)(hidden, targets)` returns log P(target | hidden) for each
token, and 0.0 where the target is padding (targets < 0, `ignore_class`). So a model's
predictions say how likely the true class was, not which classes were likeliest:

- `Perplexity`: exp of the mean negative log-probability over the real tokens (targets
  >= 0, and not masked), in `model.compile(metrics=[tf_hsm.metrics.Perplexity()])`.
  Padding is excluded: exp(-mean(predictions)) over all positions counts every padded
  position as a certain prediction and comes out too low.
- `TopKAccuracy(k=5)`: whether the target is among the layer's k most probable
  classes, exactly (the layer's own `top_k`, a best-first search for
  `HierarchicalSoftmax`), as TensorFlow Recommenders' `FactorizedTopK` is for a
  retrieval model. In `model.compile(metrics=[...])` it finds the layer, its hidden
  states and targets on the model's output (`tf_hsm/frontend/metrics.py`); outside,
  `TopKAccuracy(layer, k).update_state(targets, hidden)` takes the hidden states
  (`top_k_accuracy` runs that over a dataset).

The arithmetic is shared with `tf_hsm.tf_keras.metrics` (`tf_hsm/frontend/metrics.py`).
"""

import sys

import keras
import tensorflow as tf

from tf_hsm.frontend import metrics as shared


class _Sums(keras.metrics.Metric):
  """Two float64 sums, and the clear error tf_keras' compile gets instead of its own."""

  def _sums(self, first, second):
    self._first = self.add_variable(shape=(), initializer="zeros", dtype="float64",
                                    name=first)
    self._second = self.add_variable(shape=(), initializer="zeros", dtype="float64",
                                     name=second)

  @property
  def variables(self):
    shared.refuse_tf_keras_compile(self, sys._getframe(1))  # pylint: disable=protected-access
    return super().variables

  def reset_state(self):
    self._first.assign(0.0)
    self._second.assign(0.0)


@keras.saving.register_keras_serializable(package="tf_hsm")
class Perplexity(_Sums):
  """exp(-sum(w log P) / sum(w)) over the real tokens: targets >= 0 (when y_true is
  the targets, shaped as the predictions), weighted by sample_weight and the output's
  Keras mask. Sums are kept in float64.

  Args:
    name, dtype: as `keras.metrics.Metric` (dtype: the result's).
  """

  def __init__(self, name="perplexity", dtype=None):
    super().__init__(name=name, dtype=dtype)
    self._sums("total", "count")

  @property
  def total(self):
    return self._first

  @property
  def count(self):
    return self._second

  def update_state(self, y_true, y_pred, sample_weight=None):
    """y_true: the targets (padding < 0), or anything of another shape (no padding);
    y_pred: log P(target) a token, e.g. `HierarchicalSoftmax`'s output."""
    total, count = shared.perplexity_terms(y_true, y_pred, sample_weight)
    self.total.assign_add(total)
    self.count.assign_add(count)

  def result(self):
    mean = tf.math.divide_no_nan(self.total, self.count)
    return tf.cast(tf.exp(mean), self.dtype)


@keras.saving.register_keras_serializable(package="tf_hsm")
class TopKAccuracy(_Sums):
  """The fraction of real tokens whose target is among the layer's `top_k(hidden, k)`
  classes: exact (the layer's search over all its classes, equal log-probabilities in
  increasing class order), not a sample. Padding (targets < 0, the layer's
  `ignore_class`, masked positions) does not count.

  In compile, with the model whose output is the tf_hsm layer's:

      model.compile(loss=tf_hsm.losses.nll, metrics=[tf_hsm.metrics.TopKAccuracy(k=5)])

  Each step then runs the layer's `top_k` on the batch as well (about as costly as
  `inference_model`'s prediction of the batch). In an evaluation loop, give the layer
  and the hidden states it is fed:

      metric = tf_hsm.metrics.TopKAccuracy(layer, k=5)
      for (tokens, targets), _ in dataset:
        metric.update_state(targets, hidden_model(tokens))

  Args:
    layer: None in compile (the metric finds the layer on the output), or a built
      `HierarchicalSoftmax` or `AdaptiveSoftmax` (anything with
      `top_k(hidden, k) -> (log_probs, classes)`). The config leaves the layer out.
    k: a positive int, at most the layer's number of classes.
  """

  def __init__(self, layer=None, k=5, name=None, dtype=None):
    shared.check_top_k_args(layer, k)
    super().__init__(name=name or f"top_{k}_accuracy", dtype=dtype)
    self.layer = layer
    self.k = k
    self._sums("hits", "count")

  @property
  def hits(self):
    return self._first

  @property
  def count(self):
    return self._second

  def update_state(self, y_true, y_pred, sample_weight=None):
    """y_true: targets `[...]` (padding < 0; unused in compile, where the layer's own
    targets count); y_pred: the model's output (in compile) or, with a layer, the
    hidden states it is fed `[..., D]`."""
    hits, count = shared.top_k_terms("keras", self.layer, self.k, y_true, y_pred,
                                     sample_weight)
    self.hits.assign_add(hits)
    self.count.assign_add(count)

  def result(self):
    return tf.cast(tf.math.divide_no_nan(self.hits, self.count), self.dtype)

  def get_config(self):
    # Without the layer: restored (with a saved model), the metric finds the layer on
    # the model's output, as in compile.
    return dict(super().get_config(), k=self.k)


def top_k_accuracy(hidden_model, layer, dataset, k=5):
  """Exact top-k accuracy over `dataset` (batches of `(inputs, targets)`, targets < 0
  padding): the layer's `top_k` on `hidden_model(inputs)`, the hidden states the layer
  is fed (e.g. `keras.Model(model.inputs, hidden)`). Returns a float."""
  return shared.accuracy_over(TopKAccuracy(layer, k), hidden_model, dataset)
