"""The layer `export` serves, one class per kind: its weights copied into variables that
the SavedModel holds, and the four computations its signatures run (log_prob,
log_prob_all, top_k, sample) in stock ops.

`served_layer(layer)` chooses the kind once, by class name (tf_hsm is not imported
here: an export is read where it may not be installed).
"""

import tensorflow as tf

from tf_hsm.serving import adaptive as adaptive_serving
from tf_hsm.serving import hsm
from tf_hsm.serving import mixture as mixture_serving
from tf_hsm.serving._tree import StockTree

__all__ = ["served_kind", "served_layer", "saved_variable"]

_HSM, _ADAPTIVE, _MIXTURE = ("HierarchicalSoftmax", "AdaptiveSoftmax",
                             "HierarchicalSoftmaxMixture")


def saved_variable(value, name):
  """A non-trainable tf.Variable holding a copy of `value` (a Keras or tf variable)."""
  value = value.value if hasattr(value, "value") and not isinstance(value, tf.Variable) \
      else value
  return tf.Variable(tf.convert_to_tensor(value), trainable=False, name=name)


class ServedTree(tf.Module):
  """A `HierarchicalSoftmax`: its table, biases and tree."""

  def __init__(self, layer):
    super().__init__(name="served_tree")
    if getattr(layer, "row_layout", None) is not None:
      raise ValueError("export does not serve a HierarchicalSoftmax with a row_layout")
    self.num_classes = self.rankable_classes = layer.tree.num_classes
    self.dtype = tf.as_dtype(layer.kernel.dtype)
    self._tree = StockTree(layer.tree)
    self.weights_table = saved_variable(layer.kernel, "kernel")
    self.bias_table = None if layer.bias is None else saved_variable(layer.bias, "bias")

  def log_prob(self, hidden, targets):
    return hsm.log_prob(hidden, self.weights_table, self.bias_table, self._tree, targets)

  def log_prob_all(self, hidden):
    return hsm.log_prob_all(hidden, self.weights_table, self.bias_table, self._tree)

  def top_k(self, hidden, k, exclude=None):
    return hsm.top_k(hidden, self.weights_table, self.bias_table, self._tree, k,
                     exclude=exclude)

  def sample(self, hidden, seed, temperature):
    return hsm.sample(hidden, self.weights_table, self.bias_table, self._tree, seed,
                      temperature)


class ServedAdaptive(tf.Module):
  """An `AdaptiveSoftmax`: its head, clusters and class order. With a class order only
  the order's classes are ranked (`rankable_classes`)."""

  def __init__(self, layer):
    super().__init__(name="served_adaptive")
    w = adaptive_serving.AdaptiveWeights.from_layer(layer)
    self.num_classes = layer.num_classes
    self.rankable_classes = w.num_classes
    self.dtype = tf.as_dtype(layer.head_kernel.dtype)
    self._weights = adaptive_serving.AdaptiveWeights(
        w.num_classes, w.cutoffs, saved_variable(w.head_kernel, "head_kernel"),
        None if w.head_bias is None else saved_variable(w.head_bias, "head_bias"),
        [saved_variable(p, f"tail_projection_{i}") for i, p in enumerate(w.projections)],
        [saved_variable(t, f"tail_kernel_{i}") for i, t in enumerate(w.tail_kernels)],
        [None if b is None else saved_variable(b, f"tail_bias_{i}")
         for i, b in enumerate(w.tail_biases)],
        w.tail_trees, w.class_order)
    kept = self._weights
    self.saved = [v for v in [kept.head_kernel, kept.head_bias] + kept.projections
                  + kept.tail_kernels + kept.tail_biases if v is not None]

  def log_prob(self, hidden, targets):
    return adaptive_serving.adaptive_log_prob(self._weights, hidden, targets)

  def log_prob_all(self, hidden):
    return adaptive_serving.adaptive_log_prob_all(self._weights, hidden)

  def top_k(self, hidden, k, exclude=None):
    return adaptive_serving.adaptive_top_k(self._weights, hidden, k, exclude=exclude)

  def sample(self, hidden, seed, temperature):
    return adaptive_serving.adaptive_sample(self._weights, hidden, seed, temperature)


class ServedMixture(tf.Module):
  """A `HierarchicalSoftmaxMixture`: its gate, trees, shared head and projection."""

  def __init__(self, layer):
    super().__init__(name="served_mixture")
    self.num_classes = self.rankable_classes = layer.num_classes
    self.dtype = tf.as_dtype(layer.gate_kernel.dtype)
    self._weights = mixture_serving.MixtureWeights.from_layer(layer, saved_variable)
    self.saved = self._weights.variables()

  def log_prob(self, hidden, targets):
    return mixture_serving.log_prob(self._weights, hidden, targets)

  def log_prob_all(self, hidden):
    return mixture_serving.log_prob_all(self._weights, hidden)

  def top_k(self, hidden, k, exclude=None):
    return mixture_serving.top_k(self._weights, hidden, k, exclude=exclude)

  def sample(self, hidden, seed, temperature):
    return mixture_serving.sample(self._weights, hidden, seed, temperature)


# (class name, an attribute the layer has, its kind, its served class), by kind.
_SERVED = ((_HSM, "tree", "hsm", ServedTree),
           (_ADAPTIVE, "cluster_ranges", "adaptive", ServedAdaptive),
           (_MIXTURE, "components", "mixture", ServedMixture))


def _served_entry(layer):
  """`layer`'s row of `_SERVED` (by class name along the MRO: no tf_hsm import here),
  or None."""
  for cls in type(layer).__mro__:
    for entry in _SERVED:
      if cls.__name__ == entry[0] and hasattr(layer, entry[1]):
        return entry
  return None


def served_kind(layer):
  """"hsm", "adaptive", "mixture", or None where `layer` is none of tf_hsm's output
  layers."""
  entry = _served_entry(layer)
  return None if entry is None else entry[2]


def served_layer(layer):
  """The served copy of a tf_hsm output layer (`ServedTree`, `ServedAdaptive` or
  `ServedMixture`)."""
  entry = _served_entry(layer)
  if entry is None:
    raise ValueError(f"{type(layer).__name__} is not a tf_hsm output layer")
  return entry[3](layer)
