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

import tensorflow as tf

from tf_hsm import _compact

__all__ = ["gradients", "pieces"]


def pieces(variable):
  """The row-range variables of a table held in pieces (a `ShardedVariable`, or a Keras
  variable holding one), in row order; None for a variable in one piece."""
  found = _compact.pieces(variable, "variable")
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
  offsets = _compact.row_offsets(parts, "variable", tf.TensorShape(parts[0].shape).rank)
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
