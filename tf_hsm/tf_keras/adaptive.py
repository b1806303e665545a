"""`AdaptiveSoftmax` for tf_keras models: the tf_keras twin of
`tf_hsm.keras.AdaptiveSoftmax`, over the same core (`tf_hsm/frontend/adaptive.py`)."""

import tensorflow as tf
import tf_keras

from tf_hsm.frontend import adaptive as core


@tf_keras.saving.register_keras_serializable(package="tf_hsm")
class AdaptiveSoftmax(core.AdaptiveSoftmaxCore, tf_keras.layers.Layer):
  """Adaptive softmax output layer for tf_keras: `layer(hidden, targets)` ->
  log P(targets | hidden).

  What `tf_hsm.keras.AdaptiveSoftmax` (Keras 3) is, with the same arguments (cutoffs or
  counts, div_value, head_bias, flat or two-level tails, class_order), weights (PyTorch's
  layout: `from_torch_state_dict`), outputs, masking and methods (`top_k`,
  `log_prob_all`, `sample`); see that class. Under mixed precision the tables stay
  float32 and are never cast (made with `experimental_autocast=False`), and the
  log-probabilities are float32.
  """

  _KERAS = "tf_keras"
  frequency_order = staticmethod(core.frequency_order)

  def __init__(self, num_classes, cutoffs=None, div_value=4.0, head_bias=False,
               tail="flat", counts=None, kernel_initializer="glorot_uniform",
               tail_trees=None, tokens_per_step=None, machine=None, class_order=None,
               **kwargs):
    super().__init__(**kwargs)
    self.kernel_initializer = tf_keras.initializers.get(kernel_initializer)
    self._init_adaptive(num_classes, cutoffs, div_value, head_bias, tail, counts,
                        tail_trees, tokens_per_step, machine, class_order)

  def _add_table(self, name, shape, initializer):
    if isinstance(initializer, tf_keras.initializers.Initializer):
      # A tf_keras initializer called twice unseeded repeats its values: one per table.
      initializer = initializer.__class__.from_config(initializer.get_config())
    return self.add_weight(name=name, shape=shape, initializer=initializer,
                           experimental_autocast=False)

  def build(self, hidden_shape, targets_shape=None):
    self._build_adaptive(tf.TensorShape(hidden_shape), self.kernel_initializer)

  def compute_output_signature(self, input_signature):
    return tf.TensorSpec(input_signature.shape[:-1], tf.float64
                         if self.dtype == "float64" else tf.float32)

  def get_config(self):
    config = super().get_config()
    config.update(self._adaptive_config())
    config["kernel_initializer"] = tf_keras.initializers.serialize(self.kernel_initializer)
    return config
