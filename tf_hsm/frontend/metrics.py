"""The metrics' arithmetic, for both Keras front ends (`tf_hsm.keras.metrics`,
`tf_hsm.tf_keras.metrics`): each front end's metric classes hold their sums in their
Keras' variables and add what these return. Sums are float64.

The top-k accuracy needs the hidden states the layer was fed, which the model's output
(one log-probability a token) does not determine. Compiled with the model, the metric
finds them on the output: the layer attaches itself, its hidden states and its targets
to the tensor it returns (`tf_hsm.frontend.hsm.attach_source`), and both Keras hand that
tensor to the compiled metrics as it is. Outside `compile` the metric is given the
hidden states directly.
"""

import tensorflow as tf

from tf_hsm.frontend import hsm

_PACKAGES = {"keras": "tf_hsm.keras.metrics", "tf_keras": "tf_hsm.tf_keras.metrics"}


def valid_weight(y_true, y_pred, sample_weight):
  """float64 weights of the real tokens: the output's Keras mask, targets >= 0 where
  y_true has y_pred's shape (otherwise every position), times sample_weight."""
  mask = getattr(y_pred, "_keras_mask", None)  # the tf_hsm layer's output mask
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


def perplexity_terms(y_true, y_pred, sample_weight):
  """(-sum(w log P), sum(w)) over a batch: what `Perplexity` adds to its sums."""
  weight = valid_weight(y_true, y_pred, sample_weight)
  y_pred = tf.convert_to_tensor(y_pred)
  log_p = tf.where(weight > 0, tf.cast(y_pred, tf.float64), tf.zeros_like(weight))
  return -tf.reduce_sum(weight * log_p), tf.reduce_sum(weight)


def check_top_k_args(layer, k):
  """The checks of `TopKAccuracy(layer, k)`'s arguments."""
  if isinstance(k, bool) or not isinstance(k, int) or k < 1:
    raise ValueError(f"k must be a positive int, got {k!r}")
  if isinstance(layer, int) and not isinstance(layer, bool):
    raise TypeError(f"TopKAccuracy(layer=None, k=5): the first argument is the tf_hsm "
                    f"layer (or None, in compile); got the int {layer}: pass k={layer}")
  if layer is not None and not hasattr(layer, "top_k"):
    raise TypeError("layer must have a top_k method (HierarchicalSoftmax, "
                    f"AdaptiveSoftmax), got {type(layer).__name__}")


def top_k_terms(own_keras, layer, k, y_true, y_pred, sample_weight):
  """(hits, count) of `TopKAccuracy` over a batch (float64 sums).

  Args:
    own_keras: the metric's Keras, 'keras' or 'tf_keras'.
    layer: the metric's layer, or None.
    k: how many classes count as a hit.
    y_true: the targets (padding < 0), or None in a model whose targets are an input only.
    y_pred: a tf_hsm layer's output (in compile), or, with `layer`, the hidden states
      the layer is fed.
    sample_weight: None or weights broadcastable to the targets.
  """
  source = hsm.source_of(y_pred)
  if source is not None:
    source_layer, hidden, targets = source
    _check_source(own_keras, layer, source_layer)
    layer = source_layer
    weight = valid_weight(targets, y_pred, sample_weight)
  elif layer is None:
    raise ValueError(
        "TopKAccuracy(k=...) without a layer reads the hidden states off the output of a "
        "tf_hsm layer (compile(metrics=[TopKAccuracy(k=5)]) with a model whose output "
        "is HierarchicalSoftmax's or AdaptiveSoftmax's), and this prediction is not one: "
        f"got {type(y_pred).__name__} of shape {getattr(y_pred, 'shape', None)}. Outside "
        "compile, give the layer and the hidden states: "
        "TopKAccuracy(layer, k).update_state(targets, hidden)")
  else:
    hidden, targets = y_pred, _checked_targets(y_true, layer.num_classes)
    weight = valid_weight(targets, tf.cast(targets, tf.float64), sample_weight)
    ignored = getattr(layer, "ignore_class", None)
    if ignored is not None:
      weight = weight * tf.cast(tf.not_equal(targets, tf.cast(ignored, targets.dtype)),
                                tf.float64)
  _, classes = layer.top_k(hidden, k)
  targets = tf.cast(tf.convert_to_tensor(targets), tf.int64)
  hit = tf.reduce_any(tf.equal(tf.cast(classes, tf.int64), targets[..., None]), axis=-1)
  return tf.reduce_sum(weight * tf.cast(hit, tf.float64)), tf.reduce_sum(weight)


def _checked_targets(targets, num_classes):
  """The targets given beside the hidden states, refused where they are not class ids:
  a float would be truncated and an id past the classes counted a miss, silently."""
  targets = tf.convert_to_tensor(targets)
  if not targets.dtype.is_integer:
    raise TypeError(f"TopKAccuracy's targets must be integer class ids, got "
                    f"{targets.dtype.name}")
  in_range = tf.debugging.assert_less(
      tf.cast(targets, tf.int64), tf.constant(num_classes, tf.int64),
      message=f"TopKAccuracy's targets must be < num_classes = {num_classes}")
  with tf.control_dependencies([in_range]):
    return tf.identity(targets)


def _check_source(own_keras, layer, source_layer):
  other = getattr(source_layer, "_KERAS", own_keras)
  if other != own_keras:
    raise TypeError(f"{_PACKAGES[own_keras]}.TopKAccuracy is a {own_keras} metric and was "
                    f"compiled with a {other} model: use {_PACKAGES[other]}.TopKAccuracy")
  if layer is not None and layer is not source_layer:
    raise ValueError(f"TopKAccuracy was given layer {layer.name!r}, but the model's "
                     f"output comes from {source_layer.name!r}: give that layer, or none "
                     "(in compile the metric finds the layer itself)")


def refuse_tf_keras_compile(metric, frame):
  """Raises where tf_keras' `compile` (the module `frame` runs in) reads a Keras 3
  metric's variables: tf_keras cannot use Keras 3 metrics, and its own error is an
  AttributeError about '_distribute_strategy'."""
  if frame.f_globals.get("__name__", "").startswith("tf_keras."):
    name = type(metric).__name__
    raise TypeError(f"tf_hsm.keras.metrics.{name} is a Keras 3 metric and was given to a "
                    f"tf_keras model: use tf_hsm.tf_keras.metrics.{name}")


def accuracy_over(metric, hidden_model, dataset):
  """`metric` (a `TopKAccuracy` with its layer) over `dataset`'s `(inputs, targets)`
  batches, fed `hidden_model(inputs)`: its result as a float."""
  for inputs, targets in dataset:
    metric.update_state(targets, hidden_model(inputs, training=False))
  return float(metric.result())
