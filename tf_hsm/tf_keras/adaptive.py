"""`AdaptiveSoftmax` for tf_keras models: the tf_keras twin of
`tf_hsm.keras.AdaptiveSoftmax`, over the same core (`tf_hsm/frontend/adaptive.py`)."""

import tensorflow as tf
import tf_keras

from tf_hsm.frontend import adaptive as core
from tf_hsm.frontend import hsm as frontend_hsm


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

  Under a `ParameterServerStrategy` with a `variable_partitioner` the tables are
  `ShardedVariable`s (the model's `trainable_variables` hold their pieces, each on its
  parameter server), each drawn piece by piece on its server as `HierarchicalSoftmax`'s
  are, and tf_keras' `model.fit` trains them: a two-level tail's kernel and bias pieces
  receive a `tf.IndexedSlices` of the rows the batch's paths touch (gathered from each
  piece where it lives), while the head, the flat tails and the projections are read
  whole and get dense gradients (every row of a softmax gets one).
  """

  _KERAS = "tf_keras"

  def __init__(self, num_classes, cutoffs=None, div_value=4.0, head_bias=False,
               tail="flat", counts=None, kernel_initializer="glorot_uniform",
               tail_trees=None, tokens_per_step=None, machine=None, class_order=None,
               **kwargs):
    super().__init__(**kwargs)
    self.kernel_initializer = tf_keras.initializers.get(kernel_initializer)
    self._init_adaptive(num_classes, cutoffs, div_value, head_bias, tail, counts,
                        tail_trees, tokens_per_step, machine, class_order)

  def _add_table(self, name, shape, initializer):
    initializer = frontend_hsm.initializer_for_table(tf_keras.initializers.get(initializer),
                                                     len(self.weights))
    # Under a strategy that makes tables in pieces, each piece is drawn on its server
    # (the whole table is never computed on the coordinator and sent).
    with frontend_hsm.initialized_in_pieces(initializer, shape, self.dtype or tf.float32,
                                            tf_keras.initializers):
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
