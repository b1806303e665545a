"""Tables held in pieces: a `tf.distribute` `ShardedVariable`, or a list of variables that
are consecutive row ranges of the table (parameter servers, or host memory beside an
accelerator).

The ops read only the rows a batch's paths touch. For a table in pieces those rows are
gathered from each piece where it lives (each gather runs on its piece's device, as
`tf.nn.embedding_lookup` does for a partitioned table) into one compact table, and the
op runs on that with a batch tree: the same tree restricted to the batch's classes,
whose nodes and slots are renumbered to index the compact table. Each token's arithmetic
is the one the whole table gives, so the results are the same bits. The gradient flows
back through the gathers: each piece receives a `tf.IndexedSlices` of its own touched
rows; no piece is read whole and no dense gradient of a piece is built.
"""

import tensorflow as tf

from tf_hsm.ops import inputs
try:  # ShardedVariable's home in TensorFlow 2.x; not part of the public API.
  from tensorflow.python.distribute.sharded_variable import ShardedVariable
except ImportError:  # pragma: no cover
  ShardedVariable = ()


class RowOrdered:
  """A table whose rows are stored in a row layout: slot s is row `slot_rows[s]` of
  `table` (a variable, a tensor, a `ShardedVariable` or a list of row ranges). Made by
  `tf_hsm.distribute.RowLayout.table`, which checks and holds `slot_rows_tensor`."""

  def __init__(self, table, slot_rows_tensor):
    self.table = table
    self.slot_rows_tensor = slot_rows_tensor


def pieces(table, name):
  """The variables of a table held in pieces, or None for a table in one piece.

  Accepts a `ShardedVariable`, a Keras variable holding one (what `add_weight` gives
  under a `ParameterServerStrategy` with a `variable_partitioner`), or a list or tuple of
  row ranges (variables or tensors) in order; and any of those, or a table in one piece,
  stored in a row layout (`RowOrdered`).
  """
  if isinstance(table, RowOrdered):
    return pieces(table.table, name) or [table.table]
  if isinstance(table, (list, tuple)):
    if not table:
      raise ValueError(f"{name} is an empty list: give the table's row ranges in order")
    return list(table)
  if isinstance(table, ShardedVariable):
    return list(table.variables)
  inner = getattr(table, "value", None)
  if isinstance(inner, ShardedVariable):
    return list(inner.variables)
  return None


def row_offsets(parts, name, rank):
  """Python ints [0, rows of piece 0, ..., total rows], checking the pieces agree."""
  offsets = [0]
  first = parts[0]
  for index, part in enumerate(parts):
    shape = tf.TensorShape(part.shape)
    if shape.rank != rank:
      raise ValueError(f"{name}: every row range must have rank {rank}; piece {index} has "
                       f"shape {shape}")
    if shape[0] is None:
      raise ValueError(f"{name}: piece {index} has an unknown number of rows")
    if rank == 2 and shape[1] != tf.TensorShape(first.shape)[1]:
      raise ValueError(f"{name}: pieces must share their row width; piece 0 has "
                       f"{tf.TensorShape(first.shape)[1]}, piece {index} has {shape[1]}")
    if tf.as_dtype(part.dtype) != tf.as_dtype(first.dtype):
      raise TypeError(f"{name}: pieces must share one dtype; piece 0 is "
                      f"{tf.as_dtype(first.dtype).name}, piece {index} is "
                      f"{tf.as_dtype(part.dtype).name}")
    offsets.append(offsets[-1] + int(shape[0]))
  return offsets


def gather_rows(parts, offsets, rows):
  """table[rows] of a table in pieces, `rows` ascending int64: each piece's share of the
  rows is a contiguous run of `rows`, gathered on that piece's device."""
  bounds = tf.searchsorted(rows, tf.constant(offsets, tf.int64), side="left")
  gathered = []
  for index, part in enumerate(parts):
    local = rows[bounds[index]:bounds[index + 1]] - offsets[index]
    with tf.device(getattr(part, "device", None)):
      gathered.append(tf.gather(part, local))
  return gathered[0] if len(gathered) == 1 else tf.concat(gathered, 0)


def _one_piece(part):
  """A piece as something tf.gather reads only rows of: the tf.Variable behind a Keras
  variable (gathering from the Keras variable would read it whole), else a tensor."""
  variable = inputs.tf_variable(part)
  if variable is not None:
    return variable
  return part if isinstance(part, (tf.Variable, tf.Tensor)) else tf.convert_to_tensor(part)


def gather_table(table, name, num_rows, rank, rows):
  """The compact table: `table[rows]` whether it is in pieces or whole, and whether its
  rows are stored in slot order or in a row layout."""
  if isinstance(table, RowOrdered):
    if table.slot_rows_tensor.shape[0] != num_rows:
      raise ValueError(f"{name}'s row layout has {table.slot_rows_tensor.shape[0]} rows; "
                       f"the tree has {num_rows} slots")
    stored = tf.gather(table.slot_rows_tensor, rows)
    order = tf.argsort(stored)
    gathered = gather_table(table.table, name, num_rows, rank, tf.gather(stored, order))
    return tf.gather(gathered, tf.math.invert_permutation(order))
  parts = pieces(table, name)
  if parts is None:
    parts = [table]
  parts = [_one_piece(part) for part in parts]
  offsets = row_offsets(parts, name, rank)
  if offsets[-1] != num_rows:
    raise ValueError(f"{name} has {offsets[-1]} rows in all; the tree has {num_rows} slots")
  return gather_rows(parts, offsets, rows)


def batch_tree(tree_tensors, classes):
  """The tree restricted to the paths of `classes`, renumbered for a compact table.

  Args:
    tree_tensors: the tree's tensors (`inputs.tree_tensors`).
    classes: int64 class ids, any shape, already checked to be in range.

  Returns:
    (tree_inputs, rows, compact_classes): the four tree tensors the ops take
    (child_begin, path_begin, path_nodes, path_slots) of the batch tree; `rows`, the
    ascending slot ids of the original table that the batch tree's slots stand for (the
    children of every node on the batch's paths); and `classes` renumbered to the batch
    tree's classes (the distinct classes, in order of first appearance).
  """
  child_begin = tree_tensors["child_begin"]
  path_begin = tree_tensors["path_begin"]
  flat = tf.reshape(classes, [-1])
  distinct, class_index = tf.unique(flat, out_idx=tf.int64)
  begin = tf.gather(path_begin, distinct)
  end = tf.gather(path_begin, distinct + 1)
  steps = tf.ragged.range(begin, end).flat_values
  nodes = tf.gather(tree_tensors["path_nodes"], steps)
  slots = tf.gather(tree_tensors["path_slots"], steps)
  # Nodes in ascending order have ascending, disjoint child ranges, so the compact rows
  # come out ascending too and each piece's share of them is one contiguous run. The
  # root (node 0) stays node 0.
  touched = tf.sort(tf.unique(nodes)[0])
  compact_node = tf.searchsorted(touched, nodes, out_type=tf.int64)
  first = tf.gather(child_begin, touched)
  last = tf.gather(child_begin, touched + 1)
  zero = tf.zeros([1], tf.int64)
  compact_begin = tf.concat([zero, tf.cumsum(last - first)], 0)
  rows = tf.ragged.range(first, last).flat_values
  compact_slots = tf.gather(compact_begin, compact_node) + slots - tf.gather(first,
                                                                             compact_node)
  compact_path_begin = tf.concat([zero, tf.cumsum(end - begin)], 0)
  tree_inputs = (_at_least_two(compact_begin), _at_least_two(compact_path_begin),
                 compact_node, compact_slots)
  return tree_inputs, rows, tf.reshape(class_index, tf.shape(classes))


def _at_least_two(offsets):
  """Offsets of an empty batch ([0]) made those of one empty node or class ([0, 0]): the
  ops take a tree of at least one node and one class."""
  missing = tf.maximum(0, 2 - tf.size(offsets))
  return tf.concat([offsets, tf.fill([missing], offsets[-1])], 0)


def check_classes(classes, num_classes, name):
  """`classes` as int64, with an error naming `name` where one is outside the tree."""
  classes = tf.cast(classes, tf.int64)
  checks = [tf.debugging.assert_non_negative(
                classes, message=f"{name} must be in [0, num_classes={num_classes})"),
            tf.debugging.assert_less(
                classes, tf.constant(num_classes, tf.int64),
                message=f"{name} must be in [0, num_classes={num_classes})")]
  with tf.control_dependencies(checks):
    return tf.identity(classes)


def is_split(weights, biases):
  """Whether either table is held in pieces (the ops then take the compact path)."""
  return (pieces(weights, "weights") is not None or
          (biases is not None and pieces(biases, "biases") is not None))


def compact_inputs(tree, tree_tensors, weights, biases, classes, name):
  """(weights, biases, tree_inputs, classes) of the compact problem for `classes`."""
  classes = check_classes(classes, tree.num_classes, name)
  tree_inputs, rows, compact_classes = batch_tree(tree_tensors, classes)
  weights = gather_table(weights, "weights", tree.num_slots, 2, rows)
  if biases is not None:
    biases = gather_table(biases, "biases", tree.num_slots, 1, rows)
  return weights, biases, tree_inputs, compact_classes


def whole_table(table, name):
  """A table in pieces read whole (for the inference ops that may visit every row), in
  slot order."""
  if isinstance(table, RowOrdered):
    return tf.gather(tf.convert_to_tensor(whole_table(table.table, name)),
                     table.slot_rows_tensor)
  parts = pieces(table, name)
  if parts is None:
    return table
  parts = [_one_piece(part) for part in parts]
  row_offsets(parts, name, tf.TensorShape(parts[0].shape).rank)
  return tf.concat([tf.convert_to_tensor(part) for part in parts], 0)
