"""The hierarchical softmax layer's work, for both Keras front ends.

`tf_hsm.keras.HierarchicalSoftmax` (Keras 3) and `tf_hsm.tf_keras.HierarchicalSoftmax`
(tf_keras) hold their weights the way their Keras does and call these: the tree and row
layout checks of the constructor, `log_probs` for `call`, `tables` and `hidden_in` for
inference, `initialized_in_pieces` for tables made under a `ParameterServerStrategy`
with a `variable_partitioner`, and `refuse_other_keras` for a layer handed the tensors of
the other Keras.
"""

import contextlib

import numpy as np
import tensorflow as tf

from tf_hsm import distribute
from tf_hsm.ops import inference
from tf_hsm.ops import log_prob
from tf_hsm.serving import hsm as stock_hsm
from tf_hsm.serving import stock
from tf_hsm.tree import Tree


def checked_tree(tree):
  """`tree` (a `tf_hsm.Tree` or its `get_config()` dict) as a Tree; TypeError otherwise."""
  if isinstance(tree, dict):
    tree = Tree.from_config(tree)
  if not isinstance(tree, Tree):
    raise TypeError(f"tree must be a tf_hsm.Tree, got {type(tree).__name__}")
  return tree


def checked_row_layout(tree, row_layout):
  """`row_layout` (a `RowLayout`, its config dict or None) checked against `tree`."""
  if isinstance(row_layout, dict):
    row_layout = distribute.RowLayout(tree, **row_layout)
  if row_layout is not None and not isinstance(row_layout, distribute.RowLayout):
    raise TypeError("row_layout must be a tf_hsm.distribute.RowLayout or None, got "
                    f"{type(row_layout).__name__}")
  if row_layout is not None and row_layout.slot_rows.size != tree.num_slots:
    raise ValueError(f"row_layout has {row_layout.slot_rows.size} rows; the tree has "
                     f"{tree.num_slots} slots")
  return row_layout


def refuse_ragged(*tensors, who="tf_hsm's layers take"):
  """TypeError where a layer is given a `tf.RaggedTensor` (the ops take them; the layers,
  whose outputs carry Keras masks, take padded batches); `who` names the refuser."""
  if any(isinstance(t, tf.RaggedTensor) for t in tensors):
    raise TypeError(f"{who} dense hidden states [..., D] (and targets): pad ragged ones "
                    "(hidden.to_tensor(), targets.to_tensor(-1): targets < 0 or a Keras "
                    "mask mark the padding); the ops (tf_hsm.log_prob, tf_hsm.top_k, ...) "
                    "take tf.RaggedTensor as they are")


def hidden_in(hidden, dtype):
  """`hidden` in the table's dtype: low-precision activations are computed in float32."""
  refuse_ragged(hidden)
  hidden = tf.convert_to_tensor(hidden)
  dtype = tf.as_dtype(dtype)
  return hidden if hidden.dtype == dtype else tf.cast(hidden, dtype)


def tables(kernel, bias, row_layout):
  """(kernel, bias) as the ops take them: in the row layout, when there is one."""
  if row_layout is None:
    return kernel, bias
  return row_layout.table(kernel), None if bias is None else row_layout.table(bias)


def log_probs(hidden, targets, kernel, bias, tree, row_layout=None, masks=(),
              ignore_class=None, layer=None, op=None):
  """The layer's output: log P(targets | hidden), 0 at padding, with its Keras mask.

  Args:
    hidden: `[..., D]` hidden states (cast to the table's dtype).
    targets: integer class ids with `hidden`'s leading shape; < 0 marks padding.
    kernel, bias: the layer's table and biases (a variable, a table in pieces).
    tree: the `tf_hsm.Tree`.
    row_layout: the layer's `RowLayout`, or None.
    masks: Keras masks (None or boolean-like, `targets`' shape); False marks padding.
    ignore_class: a class id that marks padding too, or None.
    layer: the calling layer, attached to the output with its hidden states (for the
      top-k metric compiled with the model, which sees only the output).
    op: None for `tf_hsm.log_prob`, or a function `op(hidden, kernel, bias, tree,
      targets, skip_padding=...)` of the same value with another gradient.

  Returns:
    The log-probabilities, `targets`' shape, with `_keras_mask` (the valid positions)
    attached, as both Keras read a mask off a tensor.
  """
  refuse_ragged(hidden, targets)
  targets = tf.convert_to_tensor(targets)
  valid = targets >= 0
  if ignore_class is not None:
    valid = tf.logical_and(valid, tf.not_equal(targets, tf.cast(ignore_class, targets.dtype)))
  valid = combined_mask(masks, valid)
  if stock.active():  # tf_hsm.serving.stock_ops(): what is traced needs no op library
    if row_layout is not None or distribute.pieces(kernel) is not None:
      raise ValueError("tf_hsm.serving.stock_ops() exports a table held in one variable; "
                       "this layer's is in pieces or a row layout: restore it into one "
                       "process first (tf_hsm.distribute.checkpoint)")
    out = stock_hsm.log_prob(hidden_in(hidden, kernel.dtype), kernel, bias, tree,
                             tf.where(valid, targets, tf.zeros_like(targets)))
    out = tf.where(valid, out, tf.zeros_like(out))  # it walked class 0's path there
  else:
    # Padding is -1 to the op, which walks no path for it: no work, and no weight row in
    # the gradient for it alone (which a LazyAdam would move on its moments).
    padded_targets = tf.where(valid, targets, -tf.ones_like(targets))
    out = (op or log_prob)(hidden_in(hidden, kernel.dtype),
                           *tables(kernel, bias, row_layout), tree, padded_targets,
                           skip_padding=True)
  out._keras_mask = valid  # how Keras attaches a mask to a tensor (masking guide)
  if layer is not None:
    attach_source(out, layer, hidden, targets)
  return out


def attach_source(out, layer, hidden, targets):
  """Lets a metric compiled with the model find the layer and the hidden states behind
  its output (the output alone, one log-probability a token, cannot say which classes
  ranked highest). Keras hands a model's output tensor to its compiled metrics as it
  came out of the layer, as it does for the `_keras_mask` attribute."""
  out._tf_hsm_source = (layer, hidden, targets)  # pylint: disable=protected-access


def source_of(output):
  """(layer, hidden, targets) attached by `attach_source`, or None."""
  return getattr(output, "_tf_hsm_source", None)


def checked_ignore_class(tree, ignore_class):
  """`ignore_class` (None or a class id of `tree`) as an int or None."""
  if ignore_class is None:
    return None
  if isinstance(ignore_class, (bool, np.bool_)) or not isinstance(
      ignore_class, (int, np.integer)) or not 0 <= ignore_class < tree.num_classes:
    raise ValueError(f"ignore_class must be None or a class id in [0, "
                     f"{tree.num_classes}), got {ignore_class!r}")
  return int(ignore_class)


def combined_mask(masks, valid=None):
  """`valid` AND every Keras mask of `masks` (None or boolean-like; None ones left out),
  or None where there is neither."""
  for extra in masks:
    if extra is not None:
      extra = tf.cast(extra, tf.bool)
      valid = extra if valid is None else tf.logical_and(valid, extra)
  return valid


def with_ignored(exclude, ignore_class, hidden, known_n=True):
  """`exclude` ([..., n] class ids per row of `hidden`, or None; `hidden`'s rank) with
  `ignore_class` added to every row, for the layers' top_k (ragged like a ragged
  `hidden`). `known_n`: the layer's search needs a known n (a tree's; a mixture ranks
  `log_prob_all` and takes any)."""
  if exclude is not None:
    exclude = inference.dense_exclude(exclude, hidden, known_n)
    if not isinstance(exclude, tf.RaggedTensor):
      exclude = tf.convert_to_tensor(exclude)
      if not isinstance(hidden, tf.RaggedTensor):
        inference.check_exclude_rank(exclude, tf.convert_to_tensor(hidden).shape.rank,
                                     known_n=False)
  if ignore_class is None:
    return exclude
  if isinstance(hidden, tf.RaggedTensor):
    rows = tf.shape(hidden.flat_values, out_type=tf.int64)[:1]
    ignored = hidden.with_flat_values(
        tf.fill(tf.concat([rows, [1]], 0), tf.constant(ignore_class, tf.int64)))
  else:
    leading = tf.shape(tf.convert_to_tensor(hidden))[:-1]
    ignored = tf.fill(tf.concat([leading, [1]], 0), tf.constant(ignore_class, tf.int64))
  if exclude is None:
    return ignored
  if isinstance(exclude, tf.RaggedTensor):
    exclude = tf.cast(exclude, tf.int64)
  else:
    exclude = tf.cast(exclude, tf.int64)
    inference.check_exclude_shape(exclude, ignored.shape[:-1])
    # Dimensions of 1 apply to every row: spelled out, to sit beside the per-row id.
    if exclude.shape.rank == ignored.shape.rank:
      exclude = tf.broadcast_to(exclude, tf.concat([tf.shape(ignored)[:-1],
                                                    tf.shape(exclude)[-1:]], 0))
  return tf.concat([exclude, ignored], -1)


def partitioning_strategy():
  """Whether the strategy in scope creates variables in pieces (a ParameterServerStrategy
  with a `variable_partitioner`; the attribute is not public API)."""
  if not tf.distribute.has_strategy():
    return False
  extended = tf.distribute.get_strategy().extended
  return getattr(extended, "_variable_partitioner", None) is not None


def fan_divisor(mode, rows, dim):
  """What `VarianceScaling` divides its scale by for a [rows, dim] table."""
  if mode == "fan_in":
    return max(1.0, rows)
  if mode == "fan_out":
    return max(1.0, dim)
  return max(1.0, (rows + dim) / 2.0)


def piece_sampler(kind, params, shape, dtype):
  """`draw(partition_shape, partition_offset)`: the rows at `partition_offset` of a table
  of `shape` filled by an initializer described as `kind` and `params`, from the
  distribution it gives the whole table (its fans are the table's), drawn by a
  stateless generator keyed by the seed and the piece's first row.

  Args:
    kind: "constant" (params: value), "variance_scaling" (scale, mode, distribution,
      seed), "uniform" (minval, maxval, seed), "normal" or "truncated_normal" (mean,
      stddev, seed); None gives None (an initializer whose values are not drawn
      independently: the caller initialises the whole table).
    params: a dict of the above; a seed that is not an int draws a fresh one.
    shape: the whole table's shape.
    dtype: the table's dtype.
  """
  dtype = tf.as_dtype(dtype)
  if kind is None:
    return None
  if kind == "constant":
    value = params["value"]
    return lambda piece_shape, offset: tf.fill(piece_shape, tf.cast(value, dtype))
  seed = params.get("seed")
  seed = seed if isinstance(seed, int) else int(np.random.randint(0, 2**31 - 1))

  def keyed(offset):
    return tf.constant([seed, offset], tf.int64)

  if kind == "variance_scaling":
    if len(shape) != 2:
      return None
    scale = params["scale"] / fan_divisor(params["mode"], shape[0], shape[1])
    distribution = params["distribution"]
    if distribution == "truncated_normal":
      stddev = np.sqrt(scale) / 0.87962566103423978
      return lambda s, o: tf.random.stateless_truncated_normal(s, keyed(o), stddev=stddev,
                                                               dtype=dtype)
    if distribution in ("untruncated_normal", "normal"):
      return lambda s, o: tf.random.stateless_normal(s, keyed(o), stddev=np.sqrt(scale),
                                                     dtype=dtype)
    limit = np.sqrt(3.0 * scale)
    return lambda s, o: tf.random.stateless_uniform(s, keyed(o), -limit, limit, dtype=dtype)
  if kind == "uniform":
    return lambda s, o: tf.random.stateless_uniform(
        s, keyed(o), params["minval"], params["maxval"], dtype=dtype)
  if kind == "normal":
    return lambda s, o: tf.random.stateless_normal(
        s, keyed(o), params["mean"], params["stddev"], dtype=dtype)
  if kind == "truncated_normal":
    return lambda s, o: tf.random.stateless_truncated_normal(
        s, keyed(o), params["mean"], params["stddev"], dtype=dtype)
  return None


def initializer_for_table(initializer, index):
  """A fresh copy of `initializer` (Keras 3 or tf_keras) for a layer's table number
  `index`, so that one initializer argument shared by several tables does not give them
  the same values: both Keras repeat an initializer object's draws when it is called
  again (unseeded: tf_keras; Keras 3 too), and a seeded copy would repeat its seed, so a
  given seed becomes seed + index. Strings and callables that are not initializer
  objects are returned as they are."""
  if not (hasattr(initializer, "get_config") and hasattr(initializer, "from_config")):
    return initializer
  config = dict(initializer.get_config())
  if config.get("seed") is not None and isinstance(config["seed"], int):
    config["seed"] = config["seed"] + index
  return type(initializer).from_config(config)


def describe_initializer(initializer, module):
  """(kind, params) of `piece_sampler` for an initializer of `module` (Keras 3's
  `keras.initializers` or `tf_keras.initializers`: their classes and attributes agree);
  (None, None) for one whose values are not drawn independently."""
  kind = type(initializer).__call__
  if kind is module.Zeros.__call__:
    return "constant", {"value": 0.0}
  if kind is module.Ones.__call__:
    return "constant", {"value": 1.0}
  if isinstance(initializer, module.Constant):
    value = getattr(initializer, "value", None)
    if value is None or np.ndim(value) != 0:
      return None, None
    return "constant", {"value": value}
  seed = {"seed": getattr(initializer, "seed", None)}
  if kind is module.VarianceScaling.__call__:
    if getattr(initializer, "input_axes", None) is not None or \
        getattr(initializer, "output_axes", None) is not None:
      return None, None
    return "variance_scaling", dict(seed, scale=initializer.scale, mode=initializer.mode,
                                    distribution=initializer.distribution)
  if kind is module.RandomUniform.__call__:
    return "uniform", dict(seed, minval=initializer.minval, maxval=initializer.maxval)
  if kind is module.RandomNormal.__call__:
    return "normal", dict(seed, mean=initializer.mean, stddev=initializer.stddev)
  if kind is module.TruncatedNormal.__call__:
    return "truncated_normal", dict(seed, mean=initializer.mean, stddev=initializer.stddev)
  return None, None


@contextlib.contextmanager
def initialized_in_pieces(initializer, shape, dtype, module):
  """Under a strategy that creates variables in pieces, makes the variable created here
  draw its initial value piece by piece from the distribution `initializer` (of Keras
  `module`: `keras.initializers` or `tf_keras.initializers`) gives the whole table, each
  piece on its own parameter server (`piece_sampler`). (Given a Keras initializer,
  TensorFlow computes the whole table on every server and slices it: a table-sized
  temporary each, 12 GB at 10M x 300.) Elsewhere, or for an initializer whose values
  are not drawn independently, nothing changes."""
  sampler = None
  if partitioning_strategy():
    sampler = piece_sampler(*describe_initializer(initializer, module), shape, dtype)
  if sampler is None:
    yield
    return

  def draw(partition_shape=None, partition_offset=None):
    piece = tuple(partition_shape) if partition_shape is not None else tuple(shape)
    offset = int(partition_offset[0]) if partition_offset is not None else 0
    return sampler(piece, offset)

  def creator(next_creator, **kwargs):
    kwargs.update(initial_value=draw, shape=shape, dtype=tf.as_dtype(dtype))
    return next_creator(**kwargs)

  with tf.variable_creator_scope(creator):
    yield


# The front ends by the module their symbolic tensors come from.
_FRONT_ENDS = {
    "keras": ("Keras 3", "tf_hsm.keras", "a keras (Keras 3) model"),
    "tf_keras": ("tf_keras", "tf_hsm.tf_keras",
                 "a tf_keras model (tf.keras under TF_USE_LEGACY_KERAS=1)"),
}


def front_end_package(keras_name):
  """tf_hsm's front end for Keras `keras_name` ('keras' or 'tf_keras')."""
  return _FRONT_ENDS[keras_name][1]


def _symbolic_keras(value):
  """'keras' or 'tf_keras' for a symbolic tensor of that Keras (a functional model's
  KerasTensor), None otherwise."""
  for cls in type(value).__mro__:
    if cls.__name__ != "KerasTensor":
      continue
    top = cls.__module__.split(".")[0]
    if top in _FRONT_ENDS:
      return top
  return None


def refuse_other_keras(own, layer_name, values):
  """Raises TypeError when a tf_hsm layer of Keras `own` ('keras' or 'tf_keras') is
  called on the symbolic tensors of the other Keras: tf_keras would wrap the layer's
  ops into TFOpLambda layers whose table is not among the model's weights, and the
  layer would never train (or a Keras 3 model would fail obscurely)."""
  for value in tf.nest.flatten(values):
    found = _symbolic_keras(value)
    if found is not None and found != own:
      _, package, where = _FRONT_ENDS[found]
      mine = _FRONT_ENDS[own][0]
      raise TypeError(
          f"{_FRONT_ENDS[own][1]}.{layer_name} is a {mine} layer and was called on "
          f"{_FRONT_ENDS[found][0]} tensors: in {where} use {package}.{layer_name}. "
          f"(A {mine} layer in a {_FRONT_ENDS[found][0]} model would not train: its "
          "weights would not be the model's.)")


def other_keras_name(own, kind, name):
  """How a tf_hsm object of Keras `own` names itself where the other Keras may print it
  (an optimizer the other Keras' `compile` cannot use prints it in its error)."""
  other = "tf_keras" if own == "keras" else "keras"
  return (f"{_FRONT_ENDS[own][1]}.{kind}.{name} (a {_FRONT_ENDS[own][0]} {kind[:-1]}; "
          f"in {_FRONT_ENDS[other][2]} use {_FRONT_ENDS[other][1]}.{kind}.{name})")


def nll(y_true, y_pred):
  """`-y_pred`, masked where `y_true` (when it has `y_pred`'s rank) is negative: the
  per-position loss of both front ends' `losses.nll` (their Keras averages it over the
  positions that are not masked)."""
  y_pred = tf.convert_to_tensor(y_pred)
  losses = tf.negative(y_pred)
  if y_true is not None and len(y_true.shape) == len(y_pred.shape):
    # Keras reads a loss's mask from this attribute and averages over the valid entries.
    losses._keras_mask = tf.greater_equal(y_true, tf.zeros((), y_true.dtype))
  return losses
