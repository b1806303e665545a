"""`HierarchicalSoftmax`, the Keras 3 layer over `tf_hsm.log_prob`."""

import contextlib
import weakref

import keras
import numpy as np
import tensorflow as tf

from tf_hsm.frontend import hsm
from tf_hsm.frontend import rebuild as frontend_rebuild
from tf_hsm.frontend import wiring
from tf_hsm.keras import adam_step as fused_update_op
from tf_hsm.ops import inputs
from tf_hsm.ops import loader  # Tables larger than this are initialised one block of rows at a time (see
# `_block_initializer`): a Keras random initializer computes its value with several
# table-sized temporaries, which at 10M x 300 (12 GB) would not fit beside the table.
_INIT_BLOCK_BYTES = 32 << 20

# A SavedModel that uses the Hsm> ops (from `model.export`) can only be loaded once they
# are registered; do that on import when the library is there, and leave the error for
# the first op call otherwise.
try:
  loader.ops()
except ImportError:
  pass


@keras.saving.register_keras_serializable(package="tf_hsm")
class HierarchicalSoftmax(keras.layers.Layer):
  """Hierarchical softmax output layer: `layer(hidden, targets)` -> log P(targets | hidden).

  Holds a `[tree.num_slots, D]` weight table (`kernel`, one row per tree edge) and, with
  `use_bias`, `[tree.num_slots]` biases. Only the rows on the targets' paths are read, so
  a step costs about depth x branching dot products per token instead of num_classes,
  and the table's gradient is a `tf.IndexedSlices` over the touched rows: pair the layer
  with `tf_hsm.optimizers.LazyAdam`, `SparseAdagrad` or `SparseSGD` to keep the update
  that sparse too.

  Padding: targets < 0 give log-probability 0 and no gradient, and so do targets equal
  to `ignore_class` (Keras' `ignore_class`, PyTorch's `ignore_index`) and positions where
  a Keras mask is 0 (the `mask` argument, or the mask of `hidden` propagated from an
  upstream layer such as `Embedding(mask_zero=True)`). The output carries the combined
  mask, so `tf_hsm.losses.nll` averages over real tokens only.

  Mixed precision (`mixed_float16`, `mixed_bfloat16`): the table stays float32 and is
  never cast (no O(table) copy per step); the low-precision hidden states are cast to
  float32, and the log-probabilities are computed and returned in float32, so that the
  loss keeps full precision. Under a float64 policy everything is float64.

  Inference: `top_k`, `log_prob_all` and `sample` run `tf_hsm.inference` on this
  layer's weights; `top_k` never returns `ignore_class` (`log_prob_all` and `sample`
  keep it as a class: never a target, training lowers its probability wherever its
  siblings are targets). In a model, the trained model
  cut at this layer predicts without targets: `tf_hsm.inference_model(model)`.

  Wiring: called inside a compiled model, the layer raises for a loss that reads class
  scores (use `tf_hsm.losses.nll`) and warns once when the optimizer would update the
  whole table (use `tf_hsm.optimizers.LazyAdam`, `SparseAdagrad` or `SparseSGD`).

  Args:
    tree: a `tf_hsm.Tree` (or its `get_config()` dict).
    use_bias: whether to add a bias per tree edge.
    kernel_initializer: initializer of the `[num_slots, D]` table; the default matches
      `keras.layers.Dense`'s, so it is a like-for-like replacement of a full softmax.
      A table over 32 MB is filled one block of rows at a time, in place, when the
      initializer draws each value independently (`VarianceScaling` and its Glorot, He
      and LeCun forms, `RandomUniform`, `RandomNormal`, `TruncatedNormal`): the values
      follow the distribution the initializer gives the whole table (its fans are the
      table's), reproducibly for a given seed, but are not the ones one call of the
      initializer would give. Other initializers are called on the whole table.
    bias_initializer, kernel_regularizer, bias_regularizer, kernel_constraint,
      bias_constraint: as in `keras.layers.Dense`. A regularizer or constraint acts on
      the whole table and makes its gradient (or update) dense.
    row_layout: a `tf_hsm.distribute.RowLayout` (or its `get_config()` dict): the table
      and biases store slot s in row `slot_rows[s]`, for example so that the equal row
      ranges of a table split over parameter servers carry equal traffic
      (`tf_hsm.distribute.balanced_layout`). Each call then gathers the rows of its
      batch's paths (the path a table in pieces always takes).
    ignore_class: None, or a class id that marks padding in the targets (e.g. 0 where
      `Embedding(mask_zero=True)` makes id 0 padding and the targets are padded with
      0): its positions get log-probability 0, no gradient and no weight in the loss,
      and `top_k` leaves it out. Give it a zero count when building the tree (so a
      Huffman tree puts it deep, where it costs nothing).
    fused_update: in `model.fit` with `tf_hsm.optimizers.LazyAdam`, update the table
      and its biases inside the layer's backward pass (the op of `tf_hsm.adam_step`)
      instead of handing their gradient to the optimizer: the same weights and moments
      bit for bit, without writing and reading back a gradient of one row per child of
      every visited node (a `fit` step 1.14-1.28x faster at V=1M, D=300, 3,200
      tokens). The optimizer must be the model's `LazyAdam` without amsgrad, weight
      decay, EMA, gradient accumulation, clipping or loss scaling (not
      `mixed_float16`), and no distribution strategy; the layer must be called once a
      step, and the table's gradient must be this layer's alone (a table tied to
      another layer's, or a loss term on it, is refused at the optimizer's update: it
      would be applied as a second step). Only Keras' own training step fuses (`fit`, `train_on_batch`):
      elsewhere (a custom loop, a `train_step` of your own, a frozen layer, a table
      off the CPU) the layer gives its gradient as usual; a custom loop fuses with
      `tf_hsm.adam_step`. Not with a `row_layout`, regularizers or constraints (which
      act on the whole table).
    **kwargs: base `keras.layers.Layer` arguments (name, dtype, trainable, ...).

  Call arguments:
    hidden: `[..., D]` float hidden states, e.g. `[B, D]` or `[B, T, D]`.
    targets: integer class ids with `hidden`'s leading shape; < 0 marks padding.
    mask: optional boolean mask with `targets`' shape; False marks padding.

  Returns:
    float32 (float64 under a float64 policy) log-probabilities with `targets`' shape.
  """

  def __init__(self, tree, use_bias=True, kernel_initializer="glorot_uniform",
               bias_initializer="zeros", kernel_regularizer=None, bias_regularizer=None,
               kernel_constraint=None, bias_constraint=None, row_layout=None,
               ignore_class=None, fused_update=False, **kwargs):
    super().__init__(**kwargs)
    self.tree = hsm.checked_tree(tree)
    self.row_layout = hsm.checked_row_layout(self.tree, row_layout)
    self.ignore_class = hsm.checked_ignore_class(self.tree, ignore_class)
    self.use_bias = bool(use_bias)
    self.kernel_initializer = keras.initializers.get(kernel_initializer)
    self.bias_initializer = keras.initializers.get(bias_initializer)
    self.kernel_regularizer = keras.regularizers.get(kernel_regularizer)
    self.bias_regularizer = keras.regularizers.get(bias_regularizer)
    self.kernel_constraint = keras.constraints.get(kernel_constraint)
    self.bias_constraint = keras.constraints.get(bias_constraint)
    self.fused_update = _checked_fused_update(fused_update, self)
    self.supports_masking = True
    # XLA cannot compile the custom op: keeps Keras' jit_compile="auto" (on by default
    # on GPU machines) from trying.
    self.supports_jit = False

  @property
  def num_classes(self):
    return self.tree.num_classes

  def build(self, hidden_shape, targets_shape=None):
    dim = hidden_shape[-1]
    if dim is None:
      raise ValueError("HierarchicalSoftmax needs a known last dimension of `hidden`, "
                       f"got shape {hidden_shape}")
    shape = (self.tree.num_slots, dim)
    block = _block_initializer(self.kernel_initializer, shape, self.variable_dtype)
    # autocast=False: under mixed precision the op reads the float32 table directly;
    # Keras' autocast would copy the whole table to float16/bfloat16 on every call.
    with hsm.initialized_in_pieces(self.kernel_initializer, shape, self.variable_dtype,
                                   keras.initializers):
      self.kernel = self.add_weight(
          name="kernel", shape=shape,
          initializer="zeros" if block else self.kernel_initializer,
          regularizer=self.kernel_regularizer, constraint=self.kernel_constraint,
          autocast=False)
    if block:
      _fill_by_blocks(self.kernel, block)
    if self.use_bias:
      with hsm.initialized_in_pieces(self.bias_initializer, (self.tree.num_slots,),
                                     self.variable_dtype, keras.initializers):
        self.bias = self.add_weight(
            name="bias", shape=(self.tree.num_slots,), initializer=self.bias_initializer,
            regularizer=self.bias_regularizer, constraint=self.bias_constraint,
            autocast=False)
    else:
      self.bias = None

  def _hidden(self, hidden):
    """hidden in the table's dtype: low-precision activations are computed in float32."""
    return hsm.hidden_in(hidden, self.kernel.dtype)

  def _tables(self):
    """(kernel, bias) as the ops take them: in the row layout, when there is one."""
    return hsm.tables(self.kernel, self.bias, self.row_layout)

  def _check_built(self, what):
    if not self.built:
      raise ValueError(f"HierarchicalSoftmax.{what} needs a built layer: call it on data "
                       "(or call build(hidden_shape)) first")

  _KERAS = "keras"

  def __call__(self, *args, **kwargs):
    hsm.refuse_other_keras("keras", "HierarchicalSoftmax", (args, kwargs))
    wiring.check_call(self, args, kwargs)
    wiring.check_model(self)
    return super().__call__(*args, **kwargs)

  def call(self, hidden, targets, mask=None, hidden_mask=None, training=None):
    # `hidden_mask` is filled in by Keras with the mask of `hidden` (multi-input layers
    # receive one `<argument>_mask` per tensor argument).
    op = self._fused_op() if self.fused_update and training and self.trainable else None
    return hsm.log_probs(hidden, targets, self.kernel, self.bias, self.tree,
                          self.row_layout, (mask, hidden_mask), self.ignore_class, self,
                          op=op)

  def _fused_op(self):
    """log_prob whose gradient applies the model's optimizer to the table
    (`fused_update`), or None outside Keras' own training step."""
    model = wiring.keras_train_step_model()
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
      return None
    if getattr(optimizer, "inner_optimizer", None) is not None:
      raise ValueError(
          f"{self.name}: fused_update cannot run under {type(optimizer).__name__} "
          "(mixed_float16's loss scaling): the table's update would see the scaled "
          "gradient and skip no overflowing step; use fused_update=False, or "
          "mixed_bfloat16")
    if tf.distribute.has_strategy():
      raise ValueError(f"{self.name}: fused_update updates one variable in place and "
                       "cannot run under a distribution strategy; use fused_update=False")
    self._check_one_fused_call(optimizer)
    if not optimizer.built:
      # What its first `apply` in the step would do (the table's update, in the backward
      # pass, comes before it), on the variables, not on this call's autocast values.
      with _no_autocast(), keras.name_scope(optimizer.name, caller=optimizer):
        optimizer.build(model.trainable_variables)
    return lambda *args, **kwargs: fused_update_op.log_prob_updating_table(
        *args, optimizer, **kwargs)

  def compute_mask(self, hidden, previous_mask=None):
    # `call` attaches the real mask (it depends on the targets) to its output.
    return None

  def _check_one_fused_call(self, optimizer):
    """ValueError at a second fused call in one training step (a shared layer): each
    call's backward pass would apply a whole update of the step."""
    if tf.inside_function():
      graph = tf.compat.v1.get_default_graph()
      same = getattr(self, "_fused_graph", lambda: None)() is graph
      self._fused_graph = weakref.ref(graph)
    else:
      step = int(optimizer.iterations.numpy())
      same = getattr(self, "_fused_step", None) == (id(optimizer), step)
      self._fused_step = (id(optimizer), step)
    if same:
      raise ValueError(f"{self.name}: a layer with fused_update updates its table once "
                       "for each call in a training step, and this step calls it twice; "
                       "use fused_update=False for a layer shared in the model")

  def top_k(self, hidden, k, exclude=None):
    """The k most probable classes: `tf_hsm.inference.top_k` with this layer's weights,
    leaving out `ignore_class` and `exclude` (class ids `[..., n]` per row; see
    `tf_hsm.inference.top_k`).

    Returns:
      (log_probs, classes), each `[..., k]`.
    """
    from tf_hsm.ops import inference  # pylint: disable=g-import-not-at-top
    self._check_built("top_k")
    exclude = hsm.with_ignored(exclude, self.ignore_class, hidden)
    return inference.top_k(self._hidden(hidden), *self._tables(), self.tree, k,
                           exclude=exclude)

  def log_prob_all(self, hidden, **kwargs):
    """log P(c | hidden) for every class c: `[..., num_classes]`.

    Keyword arguments go to `tf_hsm.inference.log_prob_all`.
    """
    from tf_hsm.ops import inference  # pylint: disable=g-import-not-at-top
    self._check_built("log_prob_all")
    return inference.log_prob_all(self._hidden(hidden), *self._tables(), self.tree,
                                  **kwargs)

  def sample(self, hidden, seed=None, temperature=1.0):
    """Draws one class per hidden state: `tf_hsm.inference.sample` with these weights."""
    from tf_hsm.ops import inference  # pylint: disable=g-import-not-at-top
    self._check_built("sample")
    return inference.sample(self._hidden(hidden), *self._tables(), self.tree,
                            seed=seed, temperature=temperature)

  def rebuild_tree(self, tree=None, *, counts=None, branching=2, seed=0, vectors=None,
                   head=0):
    """Moves the layer to a new tree, keeping what the trained weights say about classes.

    A tree built before training can only group classes by frequency or by id; after some
    training, the class rows (each class's row in its parent node,
    `kernel[tree.class_slot[c]]`) say which classes the model finds alike, and a tree that
    puts alike classes under one node can make its internal decisions easier to learn. By
    default the new tree is `Tree.from_vectors` of those rows; `vectors` (an input
    `Embedding` of the same vocabulary, the weights of a sampled-softmax warm-up) or a
    ready `tree` can be given instead.

    The new weights start from what transfers: each class keeps its row exactly (moved to
    its new slot); each internal node's row starts at the count-weighted mean of the class
    rows beneath it (right after a rebuild, held-out loss was 0.8-1.1 nats lower than
    with zero rows; docs/usage.md); the biases start at the unigram model of `counts` on the
    new tree (`bias[s] = log mass(child of s) - log mass(node owning s)`, a zero count
    taking half the smallest positive count; uniform without counts).

    The number of slots changes with the tree, so the layer gets new `kernel` and `bias`
    variables (same names, same place among the layer's weights). Whatever holds the old
    ones must be told: an optimizer built on them cannot update the new ones, and a
    function traced before the rebuild (a compiled model's train, test and predict
    functions) would go on reading and updating the old ones. In a Keras model, rebuild
    with `tf_hsm.callbacks.rebuild_tree(model, layer, ...)` or the
    `tf_hsm.callbacks.RebuildTree` callback, which also give the model an optimizer for
    the new variables and re-trace its functions. Under a distribution strategy, call
    this inside its `scope()`.

    Args:
      tree: the new `tf_hsm.Tree` over the same classes, or None to build one with
        `Tree.from_vectors(vectors, counts, branching, seed, head)`.
      counts: optional class frequencies [num_classes]: the new tree's masses and the
        initial biases.
      branching: children per node of the built tree (int >= 2, or a list per level).
      seed: seed of `Tree.from_vectors`.
      head: the number of most frequent classes (by `counts`) the built tree puts
        directly under its root (`Tree.from_vectors`); 0 for none.
      vectors: [num_classes, any dim] class vectors to build the tree from (a NumPy
        array, a tensor or a variable); None for the layer's own class rows.

    Returns:
      The new tree (also `self.tree`).

    Raises:
      ValueError: an unbuilt layer, a layer with a `row_layout` or a table held in
        pieces, both `tree` and `vectors`, a tree or vectors or counts that do not
        match the layer's classes.
    """
    self._check_built("rebuild_tree")
    tree, kernel_values, bias_values = frontend_rebuild.new_tree_and_weights(
        self.tree, self.kernel, self.row_layout, tree, counts=counts, branching=branching,
        seed=seed, vectors=vectors, head=head)
    self._replace_weights(tree, kernel_values, bias_values)
    return tree

  def _replace_weights(self, tree, kernel_values, bias_values):
    """Sets the tree and replaces `kernel` and `bias` by new variables holding the values.

    Removing the old variables first and adding the new ones in `build`'s order keeps
    the layer's weight order (kernel, bias), which saving and the optimizer's state
    follow. A built layer's state is locked against new variables; the lock is lifted
    for the swap, as Keras' own `quantize` does to replace a built layer's kernel.
    """
    dtype = self.kernel.dtype
    del self.kernel
    if self.use_bias:
      del self.bias
    self.tree = tree
    self._tracker.unlock()
    try:
      self.kernel = self.add_weight(
          name="kernel", shape=kernel_values.shape, initializer=_values(kernel_values),
          dtype=dtype, regularizer=self.kernel_regularizer,
          constraint=self.kernel_constraint, autocast=False)
      if self.use_bias:
        self.bias = self.add_weight(
            name="bias", shape=bias_values.shape, initializer=_values(bias_values),
            dtype=dtype, regularizer=self.bias_regularizer,
            constraint=self.bias_constraint, autocast=False)
    finally:
      self._tracker.lock()

  def get_config(self):
    config = super().get_config()
    config.update({
        "tree": self.tree.get_config(),
        "use_bias": self.use_bias,
        "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
        "bias_initializer": keras.initializers.serialize(self.bias_initializer),
        "kernel_regularizer": keras.regularizers.serialize(self.kernel_regularizer),
        "bias_regularizer": keras.regularizers.serialize(self.bias_regularizer),
        "kernel_constraint": keras.constraints.serialize(self.kernel_constraint),
        "bias_constraint": keras.constraints.serialize(self.bias_constraint),
        "row_layout": None if self.row_layout is None else self.row_layout.get_config(),
        "ignore_class": self.ignore_class,
        "fused_update": self.fused_update,
    })
    return config


def _no_autocast():
  """A scope where a Keras variable's value is itself, not its mixed-precision cast."""
  try:
    from keras.src import backend  # pylint: disable=import-outside-toplevel
    return backend.AutocastScope(None)
  except (ImportError, AttributeError):
    return contextlib.nullcontext()


def _checked_fused_update(fused_update, layer):
  """`fused_update` as a bool, refused for a layer whose table the fused op cannot
  update alone."""
  if not isinstance(fused_update, (bool, np.bool_)):
    raise TypeError(f"fused_update must be True or False, got {fused_update!r}")
  if not fused_update:
    return False
  acting = [name for name in ("kernel_regularizer", "bias_regularizer",
                              "kernel_constraint", "bias_constraint")
            if getattr(layer, name) is not None]
  if layer.row_layout is not None:
    acting.insert(0, "row_layout")
  if acting:
    raise ValueError(f"fused_update cannot be combined with {', '.join(acting)} (they act "
                     "on the whole table, beside the update of the touched rows)")
  return True


_fan_divisor = hsm.fan_divisor


def _block_initializer(initializer, shape, dtype):
  """`rows -> values` of the next block of `rows` rows of a table `initializer` fills.

  The blocks draw from the distribution `initializer` has for the whole `shape`, each with
  fresh random bits. None where the table fits in one block, where `initializer` is not
  one whose values are drawn independently (Orthogonal, Identity, custom callables), or
  where the variable cannot be written as soon as it is created (while a function is
  traced, where its initial value is assigned only when the function runs; a Keras
  stateless scope, which defers its creation; a distribution strategy); the caller then
  calls `initializer` on the whole table.
  """
  rows, dim = shape
  if rows * dim * tf.as_dtype(dtype).size <= _INIT_BLOCK_BYTES:
    return None
  if tf.inside_function() or tf.distribute.has_strategy() or _in_stateless_scope():
    return None
  init = keras.initializers
  kind = type(initializer).__call__
  if kind not in (init.VarianceScaling.__call__, init.RandomUniform.__call__,
                  init.RandomNormal.__call__, init.TruncatedNormal.__call__):
    return None
  if kind is init.VarianceScaling.__call__ and (initializer.input_axes is not None or
                                                initializer.output_axes is not None):
    return None
  # One generator for all blocks, so that each block gets new bits: an integer seed
  # would give every block of the same size the same values. Its state is a variable,
  # made outside any function being traced, like the table's.
  seed = initializer.seed
  if not isinstance(seed, keras.random.SeedGenerator):
    with tf.init_scope():
      seed = keras.random.SeedGenerator(seed)
  if kind is init.VarianceScaling.__call__:
    full = _fan_divisor(initializer.mode, rows, dim)

    def block(block_rows):
      # Rescaled so that the block's scale over its own fans is the table's.
      scale = initializer.scale * _fan_divisor(initializer.mode, block_rows, dim) / full
      return init.VarianceScaling(scale=scale, mode=initializer.mode,
                                  distribution=initializer.distribution,
                                  seed=seed)((block_rows, dim), dtype=dtype)
    return block
  if kind is init.RandomUniform.__call__:
    block_init = init.RandomUniform(initializer.minval, initializer.maxval, seed=seed)
  elif kind is init.RandomNormal.__call__:
    block_init = init.RandomNormal(initializer.mean, initializer.stddev, seed=seed)
  else:
    block_init = init.TruncatedNormal(initializer.mean, initializer.stddev, seed=seed)
  return lambda block_rows: block_init((block_rows, dim), dtype=dtype)


def _in_stateless_scope():
  """Whether Keras defers variable creation here (its check is not public API)."""
  try:
    from keras.src.backend import in_stateless_scope  # pylint: disable=import-outside-toplevel
    return bool(in_stateless_scope())
  except (ImportError, AttributeError):
    return True


def _fill_by_blocks(variable, block):
  """Writes `block(rows)` into consecutive row blocks of the 2-D `variable`, in place.

  The raw op writes through the handle: slicing the variable first would read it into a
  tensor that shares its buffer, and the write would then copy the whole table. The
  write puts the variable in copy-on-read mode, which a read without a copy ends, so
  that later plain reads of the new table do not copy it either.
  """
  rows, dim = variable.shape
  block_rows = max(1, _INIT_BLOCK_BYTES // (dim * tf.as_dtype(variable.dtype).size))
  with tf.init_scope():
    handle = variable.value.handle
    for start in range(0, rows, block_rows):
      stop = min(rows, start + block_rows)
      tf.raw_ops.ResourceStridedSliceAssign(ref=handle, begin=[start, 0], end=[stop, dim],
                                            strides=[1, 1], value=block(stop - start))
    inputs.read_table(variable)


def _values(array):
  """An initializer that gives a variable these values."""
  def initializer(shape, dtype=None):
    dtype = tf.as_dtype(dtype or keras.config.floatx())
    return tf.constant(np.asarray(array, dtype.as_numpy_dtype).reshape(shape))
  return initializer

