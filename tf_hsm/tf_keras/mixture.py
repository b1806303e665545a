"""`HierarchicalSoftmaxMixture` for tf_keras models: the tf_keras twin of
`tf_hsm.keras.HierarchicalSoftmaxMixture`, over the same helpers
(`tf_hsm/frontend/mixture.py`)."""

import tensorflow as tf
import tf_keras

from tf_hsm.frontend import mixture
from tf_hsm.frontend import wiring
from tf_hsm.tf_keras.layers import HierarchicalSoftmax


@tf_keras.saving.register_keras_serializable(package="tf_hsm")
class HierarchicalSoftmaxMixture(mixture.MixtureParts, tf_keras.layers.Layer):
  """`layer(hidden, targets)` -> log sum_k pi_k(hidden) P_k(targets | hidden), in a
  tf_keras model.

  What `tf_hsm.keras.HierarchicalSoftmaxMixture` (Keras 3) is, with the same arguments,
  weights (each component's `kernel` and `bias`, `gate_kernel` [D, K], `gate_bias`
  [K], the shared head's table, and `tail_projection`, `head_correction_in` and
  `head_correction_out` where set), outputs, masking and inference (`log_prob_all`, `top_k`, `sample`); see that class. Its components are
  tf_keras `HierarchicalSoftmax` layers (or Trees, made into them), its weights are
  never cast under mixed precision, and tf_keras' optimizers train it (tf_hsm's
  `LazyAdam` moves the touched rows only: each table's gradient is sparse).
  """

  _COMPONENT, _KERAS, _KERAS_NAME = HierarchicalSoftmax, "tf_keras", "tf_keras"
  _INITIALIZERS, _NO_CAST = tf_keras.initializers, {"experimental_autocast": False}
  _INPUT_CAST = "_autocast"

  def __init__(self, components, gate_initializer="zeros", head=None,
               head_bias_initializer="zeros", ignore_class=None, tail_dim=None,
               tail_projection_initializer="glorot_uniform", num_classes=None,
               head_rank=None, **kwargs):
    mixture.refuse_component_arguments(kwargs, "tf_keras")
    super().__init__(**kwargs)
    self._set_up(components, gate_initializer, head, head_bias_initializer, ignore_class,
                 tail_dim, tail_projection_initializer, num_classes, head_rank)

  def build(self, hidden_shape, targets_shape=None):
    super().build(tf.TensorShape(hidden_shape), targets_shape)

  def _build_part(self, part, shape):
    # In the part's own name scope, as tf_keras builds a layer it calls: else every
    # part's weights are named "<mixture>/kernel:0", which HDF5 files cannot hold twice.
    with tf.name_scope(part.name):
      part.build(shape)

  def __call__(self, *args, **kwargs):
    self._check_call(args, kwargs)
    # tf_keras names the innermost layer being called to the components' checks (this
    # one): the model's loss and optimizer are checked here.
    wiring.check_model(self)
    return super().__call__(*args, **kwargs)

  def call(self, hidden, targets, mask=None, training=None):
    # tf_keras fills `mask` with the mask of `hidden` (its first argument) unless it is
    # given; given, it is combined with that one, as Keras 3 combines them.
    return mixture.log_probs(self, hidden, targets,
                             (mask, getattr(hidden, "_keras_mask", None)), training)

  def compute_output_signature(self, input_signature):
    return tf.TensorSpec(input_signature.shape[:-1], tf.float64
                         if self.dtype == "float64" else tf.float32)
