"""Training with the table in pieces: on parameter servers (`tf.distribute`
`ParameterServerStrategy` with a `variable_partitioner`), or as a list of row ranges.

The ops (`tf_hsm.log_prob`, `nll_loss`, `log_prob_candidates`) and `HierarchicalSoftmax`
take a table held as a `ShardedVariable` directly: they gather only the rows on the
batch's paths, each on its own parameter server, and each piece receives a
`tf.IndexedSlices` of its own touched rows. What TensorFlow does not do for a
`ShardedVariable` is take a gradient with respect to it (`tf.GradientTape.gradient`
asks every source for a resource handle, which a `ShardedVariable` does not have);
`gradients` here does, and gives one gradient per variable, ready for
`optimizer.apply_gradients(zip(grads, variables))`. The optimizers in
`tf_hsm.optimizers` keep their slots in pieces beside the table's (slot piece i on the
parameter server of table piece i) and update each piece's touched rows there.

A custom training loop with `tf.distribute.experimental.coordinator.ClusterCoordinator`:

    with strategy.scope():
      model = keras.Sequential([...])          # hidden layers
      output = tf_hsm.HierarchicalSoftmax(tree)
      optimizer = tf_hsm.optimizers.LazyAdam(1e-3)

    @tf.function
    def step(iterator):
      def replica_step(hidden_inputs, targets):
        with tf.GradientTape() as tape:
          log_probs = output(model(hidden_inputs), targets)
          loss = -tf.reduce_mean(log_probs)
        variables = model.trainable_variables + output.trainable_variables
        grads = tf_hsm.distribute.gradients(tape, loss, variables)
        optimizer.apply_gradients(zip(grads, variables))
        return loss
      return strategy.run(replica_step, args=next(iterator))

    coordinator.schedule(step, args=(per_worker_iterator,))
"""

import keras
import numpy as np
import tensorflow as tf

from tf_hsm.ops import compact
from tf_hsm.tree import shards as shard_layout

__all__ = ["RowLayout", "balanced_layout", "checkpoint", "gradients", "pieces",
           "rows_per_shard"]


def pieces(variable):
  """The row-range variables of a table held in pieces (a `ShardedVariable`, or a Keras
  variable holding one), in row order; None for a variable in one piece."""
  found = compact.pieces(variable, "variable")
  return None if isinstance(variable, (list, tuple)) else found


def gradients(tape, target, sources, output_gradients=None):
  """`tape.gradient(target, sources)` where some sources may be held in pieces.

  A source held in pieces gets one gradient for the whole variable: a
  `tf.IndexedSlices` over its global row ids when each piece's gradient is sparse (the
  rows the pieces' gathers touched, pieces in order), or a dense tensor otherwise. Other
  sources get what `tape.gradient` gives them.

  Args:
    tape: a `tf.GradientTape` that recorded `target`.
    target: a tensor (or nested structure) to differentiate.
    sources: a list of variables (tf.Variable, Keras variables, `ShardedVariable`s).
    output_gradients: as in `tf.GradientTape.gradient`.

  Returns:
    A list of gradients, one per source (None where the source is not connected).
  """
  sources = list(sources)
  flat, spans = [], []
  for source in sources:
    parts = pieces(source)
    if parts is None:
      spans.append(None)
      flat.append(source)
    else:
      spans.append((len(flat), len(parts)))
      flat.extend(parts)
  flat_grads = tape.gradient(target, flat, output_gradients=output_gradients)
  grads = []
  position = 0
  for source, span in zip(sources, spans):
    if span is None:
      grads.append(flat_grads[position])
      position += 1
      continue
    start, count = span
    parts = flat[start:start + count]
    grads.append(_join(parts, flat_grads[start:start + count]))
    position += count
  return grads


def _join(parts, grads):
  """One gradient for a variable from its pieces' gradients."""
  if all(grad is None for grad in grads):
    return None
  offsets = compact.row_offsets(parts, "variable", tf.TensorShape(parts[0].shape).rank)
  dense_shape = tf.constant([offsets[-1]] + tf.TensorShape(parts[0].shape).as_list()[1:],
                            tf.int64)
  if all(grad is None or isinstance(grad, tf.IndexedSlices) for grad in grads):
    values, indices = [], []
    for offset, grad in zip(offsets, grads):
      if grad is not None:
        values.append(grad.values)
        indices.append(tf.cast(grad.indices, tf.int64) + offset)
    return tf.IndexedSlices(tf.concat(values, 0), tf.concat(indices, 0), dense_shape)
  dense = []
  for part, grad in zip(parts, grads):
    dense.append(tf.zeros(part.shape, part.dtype) if grad is None
                 else tf.convert_to_tensor(grad))
  return tf.concat(dense, 0)


def split_rows(gradient, offsets):
  """A table's `tf.IndexedSlices` gradient split by piece: a list of (local row ids,
  rows), one per piece of row offsets `offsets` (a piece none of whose rows are named
  gets empty ones)."""
  indices = tf.cast(gradient.indices, tf.int64)
  if len(offsets) == 2:
    return [(indices, gradient.values)]
  owner = tf.searchsorted(tf.constant(offsets[1:-1], tf.int64), indices, side="right")
  owner = tf.cast(owner, tf.int32)
  count = len(offsets) - 1
  index_parts = tf.dynamic_partition(indices, owner, count)
  value_parts = tf.dynamic_partition(gradient.values, owner, count)
  return [(index_parts[i] - offsets[i], value_parts[i]) for i in range(count)]


class RowLayout:
  """Where each slot's row is stored in a table split into equal row ranges.

  `balanced_layout` makes one whose ranges carry about equal expected traffic. Store the
  table in it (`stored`, or initialise the variable in any way: the order of random
  initial rows does not matter) and hand the ops `layout.table(variable)`; the ops read
  and update slot s at row `slot_rows[s]`, and the probabilities are the tree's.

  Attributes:
    slot_rows: int64 [num_slots], a permutation: slot s is stored at row slot_rows[s].
    num_shards: the number of equal row ranges it was made for.
  """

  def __init__(self, tree, slot_rows, num_shards):
    slot_rows = np.asarray(slot_rows)
    if slot_rows.shape != (tree.num_slots,) or not np.array_equal(
        np.sort(slot_rows), np.arange(tree.num_slots)):
      raise ValueError(f"slot_rows must be a permutation of 0..{tree.num_slots - 1} (one "
                       "row per slot of the tree)")
    self.tree = tree
    self.slot_rows = slot_rows.astype(np.int64)
    self.num_shards = int(num_shards)
    self._slot_rows_tensor = None

  def get_config(self):
    return {"slot_rows": self.slot_rows.tolist(), "num_shards": self.num_shards}

  def stored(self, values):
    """`values` ([num_slots, ...] in slot order, a NumPy array) in this layout's rows."""
    values = np.asarray(values)
    out = np.empty_like(values)
    out[self.slot_rows] = values
    return out

  def table(self, table):
    """`table` (a variable, `ShardedVariable`, list of row ranges or tensor whose rows are
    stored in this layout) as the ops take it."""
    if self._slot_rows_tensor is None:
      # Made once, outside any function being traced, so that functions capture it
      # instead of embedding it as a constant.
      with tf.init_scope(), tf.device("/cpu:0"):
        self._slot_rows_tensor = tf.constant(self.slot_rows)
    return compact.RowOrdered(table, self._slot_rows_tensor)


def balanced_layout(tree, num_shards, tokens_per_step, counts=None):
  """A row layout in which `num_shards` equal row ranges (as TensorFlow's partitioners
  cut a table, `FixedShardsPartitioner(num_shards)`) each serve about the same number of
  distinct rows a step: the rows each parameter server gathers and sends, and the
  gradient rows it receives and updates.

  Node blocks (a node's children) stay contiguous; the blocks, heaviest expected traffic
  first, go to the range with the least traffic so far that has room (see
  `tf_hsm/tree/shards.py`). At V=1M, 4 shards, 3,200 Zipf(1) tokens a step, the
  busiest shard serves 1.02-1.05x the mean, against 1.42-2.31x in the tree's own order
  (`rows_per_shard`; docs/distributed.md).

  Args:
    tree: a `tf_hsm.Tree`.
    num_shards: the number of equal row ranges the table will be split into.
    tokens_per_step: tokens in a training step (the batch's targets).
    counts: class frequencies [num_classes] (uniform if None).

  Returns:
    A `RowLayout`.
  """
  return RowLayout(tree, shard_layout.balanced_slot_rows(tree, counts, num_shards,
                                                          tokens_per_step), num_shards)


def rows_per_shard(tree, targets, num_shards, layout=None):
  """The distinct rows each of `num_shards` equal row ranges serves for one step on
  `targets`: it gathers and sends them, then receives their gradient rows and updates
  them (the same rows: every child of a node on the batch's paths gets a gradient).

  Args:
    tree: a `tf_hsm.Tree`.
    targets: the step's class ids (array-like).
    num_shards: number of equal row ranges.
    layout: a `RowLayout`, or None for the tree's own slot order.

  Returns:
    int64 array [num_shards].
  """
  slot_rows = None if layout is None else layout.slot_rows
  return shard_layout.rows_touched_per_shard(tree, slot_rows, num_shards, targets)


def checkpoint(**objects):
  """A `tf.train.Checkpoint` of Keras variables, layers, models and optimizers, some of
  whose variables may be held in pieces (`ShardedVariable`s).

  `tf.train.Checkpoint(model=..., optimizer=...)` cannot save a Keras variable holding a
  `ShardedVariable` ("'ShardedVariable' object has no attribute 'device'": the Keras
  wrapper hides the pieces' own saving). This one tracks the TensorFlow variables under
  them, each object's variables in order, so a checkpoint written with the table in N
  pieces restores into M pieces, or into one, with the same values (TensorFlow saves a
  `ShardedVariable` as slices of one variable).

  Args:
    **objects: name -> a Keras variable, or anything with a `variables` list (a layer,
      a model, an optimizer). Restore into the same structure built again, under any
      partitioning.

  Returns:
    A `tf.train.Checkpoint`; use its `write`/`read` (or `save`/`restore`).
  """
  def underlying(variable):
    inner = getattr(variable, "value", None)
    return inner if isinstance(inner, (tf.Variable, compact.ShardedVariable)) else variable

  tracked = {}
  for name, obj in objects.items():
    if isinstance(obj, (keras.Variable, tf.Variable, compact.ShardedVariable)):
      tracked[name] = underlying(obj)
    elif hasattr(obj, "variables"):
      tracked[name] = [underlying(variable) for variable in obj.variables]
    else:
      raise TypeError(f"{name}: expected a variable, or an object with `variables` (a "
                      f"layer, model or optimizer), got {type(obj).__name__}")
  return tf.train.Checkpoint(**tracked)
