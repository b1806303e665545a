"""`HierarchicalSoftmax` for tf_keras models: the tf_keras twin of
`tf_hsm.keras.HierarchicalSoftmax`, over the same helpers (`tf_hsm/frontend/hsm.py`)."""

import tensorflow as tf
import tf_keras

from tf_hsm.frontend import hsm as frontend_hsm
from tf_hsm.frontend import rebuild
from tf_hsm.frontend import wiring
from tf_hsm.ops import loader  # As in the Keras 3 layer: a SavedModel with Hsm> ops loads only once they are registered.
try:
  loader.ops()
except ImportError:
  pass


@tf_keras.saving.register_keras_serializable(package="tf_hsm")
class HierarchicalSoftmax(tf_keras.layers.Layer):
  """Hierarchical softmax output layer for tf_keras: `layer(hidden, targets)` ->
  log P(targets | hidden).

  What `tf_hsm.keras.HierarchicalSoftmax` (Keras 3) is, with the same arguments, weights
  (`kernel` [num_slots, D], `bias` [num_slots]), outputs, masking, mixed precision (the
  table stays float32 and is never cast: its weights are made with
  `experimental_autocast=False`), row layouts and tables in pieces; see that class.
  Differences: a table over 32 MB made outside a strategy is initialised whole (the
  Keras 3 layer fills it block by block), and `top_k`, `log_prob_all` and `sample` are
  the same methods.

  Under a `ParameterServerStrategy` with a `variable_partitioner`, `kernel` and `bias`
  are `ShardedVariable`s: the model's `trainable_variables` hold their pieces, each on
  its parameter server, and each piece's gradient is a `tf.IndexedSlices` of the rows
  its server sent, so tf_keras' `model.fit` trains the layer with slots made beside
  each piece by the optimizer.
  """

  def __init__(self, tree, use_bias=True, kernel_initializer="glorot_uniform",
               bias_initializer="zeros", kernel_regularizer=None, bias_regularizer=None,
               kernel_constraint=None, bias_constraint=None, row_layout=None,
               ignore_class=None, fused_update=False, **kwargs):
    if fused_update is not False:
      raise ValueError("fused_update is Keras 3's (tf_hsm.HierarchicalSoftmax with "
                       "tf_hsm.optimizers.LazyAdam): tf_keras' layer hands its table's "
                       "gradient to the optimizer; leave fused_update=False")
    super().__init__(**kwargs)
    self.tree = frontend_hsm.checked_tree(tree)
    self.row_layout = frontend_hsm.checked_row_layout(self.tree, row_layout)
    self.ignore_class = frontend_hsm.checked_ignore_class(self.tree, ignore_class)
    self.use_bias = bool(use_bias)
    self.kernel_initializer = tf_keras.initializers.get(kernel_initializer)
    self.bias_initializer = tf_keras.initializers.get(bias_initializer)
    self.kernel_regularizer = tf_keras.regularizers.get(kernel_regularizer)
    self.bias_regularizer = tf_keras.regularizers.get(bias_regularizer)
    self.kernel_constraint = tf_keras.constraints.get(kernel_constraint)
    self.bias_constraint = tf_keras.constraints.get(bias_constraint)
    self.supports_masking = True

  @property
  def num_classes(self):
    return self.tree.num_classes

  def _weight(self, name, shape, initializer, regularizer, constraint):
    with frontend_hsm.initialized_in_pieces(initializer, shape, self.dtype or tf.float32,
                                            tf_keras.initializers):
      return self.add_weight(name=name, shape=shape, initializer=initializer,
                             regularizer=regularizer, constraint=constraint,
                             experimental_autocast=False)

  def build(self, hidden_shape):
    hidden_shape = tf.TensorShape(hidden_shape)
    dim = hidden_shape[-1]
    if dim is None:
      raise ValueError("HierarchicalSoftmax needs a known last dimension of `hidden`, "
                       f"got shape {hidden_shape}")
    self.kernel = self._weight("kernel", (self.tree.num_slots, int(dim)),
                               self.kernel_initializer, self.kernel_regularizer,
                               self.kernel_constraint)
    self.bias = self._weight("bias", (self.tree.num_slots,), self.bias_initializer,
                             self.bias_regularizer, self.bias_constraint) \
        if self.use_bias else None
    self.built = True

  _KERAS = "tf_keras"

  def __call__(self, *args, **kwargs):
    frontend_hsm.refuse_other_keras("tf_keras", "HierarchicalSoftmax", (args, kwargs))
    wiring.check_call(self, args, kwargs)
    wiring.check_model(self)
    return super().__call__(*args, **kwargs)

  def call(self, hidden, targets, mask=None):
    # tf_keras fills `mask` with the mask of `hidden` (its first argument) unless it is
    # given; given, it is combined with that one, as Keras 3 combines them.
    return frontend_hsm.log_probs(hidden, targets, self.kernel, self.bias, self.tree,
                                  self.row_layout, (mask, getattr(hidden, "_keras_mask", None)),
                                  self.ignore_class, self)

  def compute_mask(self, inputs, mask=None):
    # `call` attaches the real mask (it depends on the targets) to its output.
    return None

  def compute_output_signature(self, input_signature):
    return tf.TensorSpec(input_signature.shape[:-1], tf.float64
                         if self.dtype == "float64" else tf.float32)

  def _check_built(self, what):
    if not self.built:
      raise ValueError(f"HierarchicalSoftmax.{what} needs a built layer: call it on data "
                       "(or call build(hidden_shape)) first")

  def _args(self, hidden):
    return (frontend_hsm.hidden_in(hidden, self.kernel.dtype),
            *frontend_hsm.tables(self.kernel, self.bias, self.row_layout), self.tree)

  def top_k(self, hidden, k, exclude=None):
    """The k most probable classes: (log_probs, classes), each `[..., k]`, leaving out
    `ignore_class` and `exclude` (`tf_hsm.keras.HierarchicalSoftmax.top_k`)."""
    from tf_hsm.ops import inference  # pylint: disable=g-import-not-at-top
    self._check_built("top_k")
    exclude = frontend_hsm.with_ignored(exclude, self.ignore_class, hidden)
    return inference.top_k(*self._args(hidden), k, exclude=exclude)

  def log_prob_all(self, hidden, **kwargs):
    """log P(c | hidden) for every class c: `[..., num_classes]`."""
    from tf_hsm.ops import inference  # pylint: disable=g-import-not-at-top
    self._check_built("log_prob_all")
    return inference.log_prob_all(*self._args(hidden), **kwargs)

  def sample(self, hidden, seed=None, temperature=1.0):
    """Draws one class per hidden state."""
    from tf_hsm.ops import inference  # pylint: disable=g-import-not-at-top
    self._check_built("sample")
    return inference.sample(*self._args(hidden), seed=seed, temperature=temperature)

  def rebuild_tree(self, tree=None, *, counts=None, branching=2, seed=0, vectors=None,
                   head=0):
    """Moves the layer to a new tree: `tf_hsm.keras.HierarchicalSoftmax.rebuild_tree`.

    In a model, use `tf_hsm.tf_keras.callbacks.rebuild_tree` or `RebuildTree`, which
    also give the model an optimizer for the new variables.
    """
    self._check_built("rebuild_tree")
    tree, kernel_values, bias_values = rebuild.new_tree_and_weights(
        self.tree, self.kernel, self.row_layout, tree, counts=counts, branching=branching,
        seed=seed, vectors=vectors, head=head)
    dtype = self.kernel.dtype
    del self.kernel
    if self.use_bias:
      del self.bias
    self.tree = tree
    self.kernel = self.add_weight(
        name="kernel", shape=kernel_values.shape, dtype=dtype,
        initializer=tf.constant_initializer(kernel_values.astype(dtype.as_numpy_dtype)),
        regularizer=self.kernel_regularizer, constraint=self.kernel_constraint,
        experimental_autocast=False)
    if self.use_bias:
      self.bias = self.add_weight(
          name="bias", shape=bias_values.shape, dtype=dtype,
          initializer=tf.constant_initializer(bias_values.astype(dtype.as_numpy_dtype)),
          regularizer=self.bias_regularizer, constraint=self.bias_constraint,
          experimental_autocast=False)
    return tree

  def get_config(self):
    config = super().get_config()
    config.update({
        "tree": self.tree.get_config(),
        "use_bias": self.use_bias,
        "kernel_initializer": tf_keras.initializers.serialize(self.kernel_initializer),
        "bias_initializer": tf_keras.initializers.serialize(self.bias_initializer),
        "kernel_regularizer": tf_keras.regularizers.serialize(self.kernel_regularizer),
        "bias_regularizer": tf_keras.regularizers.serialize(self.bias_regularizer),
        "kernel_constraint": tf_keras.constraints.serialize(self.kernel_constraint),
        "bias_constraint": tf_keras.constraints.serialize(self.bias_constraint),
        "row_layout": None if self.row_layout is None else self.row_layout.get_config(),
        "ignore_class": self.ignore_class,
    })
    return config
