"""Keras 3 metrics for models whose output is tf_hsm's per-token log-probability.

`HierarchicalSoftmax(tree)(hidden, targets)` returns log P(target | hidden) for each
token, and 0.0 where the target is padding (targets < 0). So a model's predictions say
how likely the true class was, not which classes were likeliest:

- `Perplexity`: exp of the mean negative log-probability over the real tokens (targets
  >= 0, and not masked), in `model.compile(metrics=[tf_hsm.metrics.Perplexity()])`.
  Padding is excluded: exp(-mean(predictions)) over all positions counts every padded
  position as a certain prediction and comes out too low.
- `TopKAccuracy(layer, k)`: whether the target is among the layer's k most probable
  classes, exactly (the layer's own `top_k`, a best-first search for
  `HierarchicalSoftmax`). It needs the hidden states, which the model's output (one
  log-probability a token) does not determine, so it is updated with
  `update_state(targets, hidden)` in an evaluation loop (`top_k_accuracy` runs one over
  a dataset), not through `model.compile`: a compiled metric sees only y_true and the
  model's output.
"""

import keras
import tensorflow as tf


def _valid(y_true, y_pred, sample_weight):
  """float64 weights of the real tokens: targets >= 0 where y_true has y_pred's shape
  (otherwise every position), times sample_weight (Keras passes the output's mask in
  it)."""
  mask = getattr(y_pred, "_keras_mask", None)  # HierarchicalSoftmax's output mask
  y_pred = tf.convert_to_tensor(y_pred)
  weight = tf.ones_like(y_pred, tf.float64)
  if mask is not None:
    weight = weight * tf.cast(mask, tf.float64)
  if y_true is not None:
    y_true = tf.convert_to_tensor(y_true)
    if y_true.shape.rank == y_pred.shape.rank:
      weight = tf.cast(y_true >= 0, tf.float64) * weight
  if sample_weight is not None:
    sample_weight = tf.cast(sample_weight, tf.float64)
    weight = weight * tf.broadcast_to(
        tf.reshape(sample_weight, tf.concat(
            [tf.shape(sample_weight), tf.ones([tf.rank(weight) - tf.rank(sample_weight)],
                                              tf.int32)], 0)), tf.shape(weight))
  return weight


@keras.saving.register_keras_serializable(package="tf_hsm")
class Perplexity(keras.metrics.Metric):
  """exp(-sum(w log P) / sum(w)) over the real tokens: targets >= 0 (when y_true is
  the targets, shaped as the predictions), weighted by sample_weight and the output's
  Keras mask. Sums are kept in float64.

  Args:
    name, dtype: as `keras.metrics.Metric` (dtype: the result's).
  """

  def __init__(self, name="perplexity", dtype=None):
    super().__init__(name=name, dtype=dtype)
    self.total = self.add_variable(shape=(), initializer="zeros", dtype="float64",
                                   name="total")
    self.count = self.add_variable(shape=(), initializer="zeros", dtype="float64",
                                   name="count")

  def update_state(self, y_true, y_pred, sample_weight=None):
    """y_true: the targets (padding < 0), or anything of another shape (no padding);
    y_pred: log P(target) a token, e.g. `HierarchicalSoftmax`'s output."""
    y_pred = tf.convert_to_tensor(y_pred)
    weight = _valid(y_true, y_pred, sample_weight)
    log_p = tf.where(weight > 0, tf.cast(y_pred, tf.float64), tf.zeros_like(weight))
    self.total.assign_add(-tf.reduce_sum(weight * log_p))
    self.count.assign_add(tf.reduce_sum(weight))

  def result(self):
    mean = tf.math.divide_no_nan(self.total, self.count)
    return tf.cast(tf.exp(mean), self.dtype)

  def reset_state(self):
    self.total.assign(0.0)
    self.count.assign(0.0)


class TopKAccuracy(keras.metrics.Metric):
  """The fraction of real tokens whose target is among `layer.top_k(hidden, k)`'s
  classes: exact (the layer's search over all its classes, equal log-probabilities in
  increasing class order), not a sample.

  Update it with the hidden states the layer is fed, not the model's output:

      metric = tf_hsm.metrics.TopKAccuracy(layer, k=5)
      for (tokens, targets), _ in dataset:
        metric.update_state(targets, hidden_model(tokens))
      metric.result()

  (`top_k_accuracy` is that loop.) Not for `model.compile(metrics=...)`: see the
  module's doc. Not serializable (it holds a layer).

  Args:
    layer: a built `HierarchicalSoftmax` or `AdaptiveSoftmax` (anything with
      `top_k(hidden, k) -> (log_probs, classes)`).
    k: a positive int, at most the layer's number of classes.
  """

  def __init__(self, layer, k=5, name=None, dtype=None):
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
      raise ValueError(f"k must be a positive int, got {k!r}")
    if not hasattr(layer, "top_k"):
      raise TypeError(f"layer must have a top_k method (HierarchicalSoftmax, "
                      f"AdaptiveSoftmax), got {type(layer).__name__}")
    super().__init__(name=name or f"top_{k}_accuracy", dtype=dtype)
    self.layer = layer
    self.k = k
    self.hits = self.add_variable(shape=(), initializer="zeros", dtype="float64",
                                  name="hits")
    self.count = self.add_variable(shape=(), initializer="zeros", dtype="float64",
                                   name="count")

  def update_state(self, y_true, hidden, sample_weight=None):
    """y_true: targets `[...]` (padding < 0); hidden: the layer's input `[..., D]`."""
    y_true = tf.convert_to_tensor(y_true)
    hidden = tf.convert_to_tensor(hidden)
    _, classes = self.layer.top_k(hidden, self.k)
    hit = tf.reduce_any(tf.equal(tf.cast(classes, tf.int64),
                                 tf.cast(y_true, tf.int64)[..., None]), axis=-1)
    weight = _valid(y_true, tf.cast(y_true, tf.float64), sample_weight)
    self.hits.assign_add(tf.reduce_sum(weight * tf.cast(hit, tf.float64)))
    self.count.assign_add(tf.reduce_sum(weight))

  def result(self):
    return tf.cast(tf.math.divide_no_nan(self.hits, self.count), self.dtype)

  def reset_state(self):
    self.hits.assign(0.0)
    self.count.assign(0.0)


def top_k_accuracy(hidden_model, layer, dataset, k=5):
  """Exact top-k accuracy over `dataset` (batches of `(inputs, targets)`, targets < 0
  padding): the layer's `top_k` on `hidden_model(inputs)`, the hidden states the layer
  is fed (e.g. `keras.Model(model.inputs, hidden)`). Returns a float."""
  metric = TopKAccuracy(layer, k)
  for inputs, targets in dataset:
    metric.update_state(targets, hidden_model(inputs, training=False))
  return float(metric.result())
