"""`Perplexity` and `TopKAccuracy` for tf_keras models: `tf_hsm.keras.metrics` (see
there) as `tf_keras.metrics.Metric`s, over the same arithmetic
(`tf_hsm/frontend/metrics.py`). A Keras 3 metric cannot be compiled with a tf_keras
model (tf_keras reads its variables as its own)."""

import tensorflow as tf
import tf_keras

from tf_hsm.frontend import metrics as shared


class _Sums(tf_keras.metrics.Metric):
  """Two float64 sums."""

  def _sums(self, first, second):
    self._first = self.add_weight(name=first, shape=(), initializer="zeros",
                                  dtype=tf.float64)
    self._second = self.add_weight(name=second, shape=(), initializer="zeros",
                                   dtype=tf.float64)

  def reset_state(self):
    self._first.assign(0.0)
    self._second.assign(0.0)


@tf_keras.saving.register_keras_serializable(package="tf_hsm")
class Perplexity(_Sums):
  """exp of the mean -log P over the real tokens (`tf_hsm.keras.metrics.Perplexity`)."""

  def __init__(self, name="perplexity", dtype=None):
    super().__init__(name=name, dtype=dtype)
    self._sums("total", "count")

  def update_state(self, y_true, y_pred, sample_weight=None):
    total, count = shared.perplexity_terms(y_true, y_pred, sample_weight)
    return tf.group(self._first.assign_add(total), self._second.assign_add(count))

  def result(self):
    return tf.cast(tf.exp(tf.math.divide_no_nan(self._first, self._second)), self.dtype)


@tf_keras.saving.register_keras_serializable(package="tf_hsm")
class TopKAccuracy(_Sums):
  """Exact top-k accuracy (`tf_hsm.keras.metrics.TopKAccuracy`): `TopKAccuracy(k=5)` in
  `compile`, or `TopKAccuracy(layer, k).update_state(targets, hidden)`."""

  def __init__(self, layer=None, k=5, name=None, dtype=None):
    shared.check_top_k_args(layer, k)
    super().__init__(name=name or f"top_{k}_accuracy", dtype=dtype)
    # Not tracked: a tf_keras layer set as an attribute would become the metric's
    # sublayer, its table among the metric's weights.
    object.__setattr__(self, "layer", layer)
    self.k = k
    self._sums("hits", "count")

  def update_state(self, y_true, y_pred, sample_weight=None):
    hits, count = shared.top_k_terms("tf_keras", self.layer, self.k, y_true, y_pred,
                                     sample_weight)
    return tf.group(self._first.assign_add(hits), self._second.assign_add(count))

  def result(self):
    return tf.cast(tf.math.divide_no_nan(self._first, self._second), self.dtype)

  def get_config(self):
    # Without the layer: restored (with a saved model), the metric finds the layer on
    # the model's output, as in compile.
    return dict(super().get_config(), k=self.k)


def top_k_accuracy(hidden_model, layer, dataset, k=5):
  """Exact top-k accuracy over `dataset` (`tf_hsm.keras.metrics.top_k_accuracy`)."""
  return shared.accuracy_over(TopKAccuracy(layer, k), hidden_model, dataset)
