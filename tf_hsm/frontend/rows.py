"""The optimizers' updates of the rows a sparse gradient touched, for both front ends.

`LazyAdam`, `SparseAdagrad` and `SparseSGD` of `tf_hsm.keras` (Keras 3) and of
`tf_hsm.tf_keras` compute their step's constants as their Keras parent does and hand
a `tf.IndexedSlices` gradient here: `adam_rows`, `adagrad_rows` and `sgd_rows` update
one table (or one piece of a table) and its slots in place, on the CPU with one fused op
of the library, elsewhere with gathers, elementwise ops and scatters (see
`tf_hsm/keras/optimizers.py` for the formulas and the rounding). `by_piece` applies one
of them to each piece of a table held in pieces.
"""

import tensorflow as tf

from tf_hsm import distribute
from tf_hsm.ops import compact
from tf_hsm.ops import inputs
from tf_hsm.ops import loader
def merge_duplicates(gradient, dtype):
  """Sums the rows of an IndexedSlices that share an index.

  Returns:
    (indices, values): unique row ids (in order of first appearance) and the summed
    rows, cast to `dtype`.
  """
  values = tf.cast(gradient.values, dtype)
  unique, position = tf.unique(gradient.indices)
  values = tf.math.unsorted_segment_sum(values, position, tf.shape(unique)[0])
  return unique, values


def tf_rows(variable):
  """The tf.Variable behind a Keras variable (scatter ops need it)."""
  found = inputs.tf_variable(variable)
  return variable if found is None else found


def fused_ops(variables):
  """The op library, where the fused row updates can apply to these variables (float32
  or float64 on the CPU, outside a function that XLA compiles, such as a Keras step
  compiled with jit_compile=True); None otherwise (the updates then use gathers and
  scatters, which XLA compiles)."""
  if inputs.in_xla_function():
    return None
  for variable in variables:
    if variable.dtype not in (tf.float32, tf.float64):
      return None
    if tf.DeviceSpec.from_string(variable.handle.device).device_type != "CPU":
      return None
  try:
    return loader.ops()
  except ImportError:
    return None


def by_piece(update, gradient, variable, slots, constants):
  """Applies `update(gradient, table, slots, constants)` to a table in one piece, or to
  each piece of a table held in pieces (a `ShardedVariable`) with its own rows of the
  gradient and its slots' matching pieces, on that piece's device."""
  parts = distribute.pieces(variable)
  if parts is None:
    update(gradient, tf_rows(variable), [tf_rows(slot) for slot in slots], constants)
    return
  slot_parts = [distribute.pieces(slot) for slot in slots]
  for slot, found in zip(slots, slot_parts):
    if found is None or len(found) != len(parts):
      raise ValueError(
          f"the optimizer's slot {getattr(slot, 'name', slot)} is not split like its table "
          f"({len(parts)} pieces): build the optimizer, and its slots, under the strategy "
          "scope that made the table")
  offsets = compact.row_offsets(parts, "variable", tf.TensorShape(parts[0].shape).rank)
  for index, (rows, values) in enumerate(distribute.split_rows(gradient, offsets)):
    with tf.device(parts[index].device):
      update(tf.IndexedSlices(values, rows), parts[index],
             [found[index] for found in slot_parts], constants)


_AUTO = object()


def _ops_for(fused, variables):
  return fused_ops(variables) if fused is _AUTO else fused


def adam_rows(gradient, table, slots, constants, amsgrad=False, fused=_AUTO):
  """LazyAdam's update of one table's touched rows and their moments.

  Args:
    gradient: a `tf.IndexedSlices` of the table's rows (duplicates summed here).
    table: the tf.Variable.
    slots: [m, v] and, with `amsgrad`, v_hat: tf.Variables shaped like `table`.
    constants: (alpha, 1 - beta_1, 1 - beta_2, epsilon) in the table's dtype.
    amsgrad: whether to keep and use the running maximum v_hat.
    fused: the op library to update with (`fused_ops`, the default, finds it), or None
      for the gathers and scatters.
  """
  alpha, one_minus_beta_1, one_minus_beta_2, epsilon = constants
  dtype = table.dtype
  m, v = slots[0], slots[1]
  v_hat = slots[2] if amsgrad else None
  fused = _ops_for(fused, [table] + list(slots))
  if fused is not None:
    # One pass over each touched row, repeated rows summed as merge_duplicates sums
    # them; the same operations as below, element by element.
    fused.hsm_sparse_adam_rows(table.handle, m.handle, v.handle,
                               (v_hat if amsgrad else v).handle, gradient.indices,
                               tf.cast(gradient.values, dtype), alpha, one_minus_beta_1,
                               one_minus_beta_2, epsilon, amsgrad=amsgrad)
    return
  indices, grad = merge_duplicates(gradient, dtype)
  m_rows = tf.gather(m, indices)
  v_rows = tf.gather(v, indices)
  m_rows = m_rows + (grad - m_rows) * one_minus_beta_1
  v_rows = v_rows + (tf.square(grad) - v_rows) * one_minus_beta_2
  m.scatter_update(tf.IndexedSlices(m_rows, indices))
  v.scatter_update(tf.IndexedSlices(v_rows, indices))
  if amsgrad:
    v_rows = tf.maximum(tf.gather(v_hat, indices), v_rows)
    v_hat.scatter_update(tf.IndexedSlices(v_rows, indices))
  step = (m_rows * alpha) / (tf.sqrt(v_rows) + epsilon)
  table.scatter_sub(tf.IndexedSlices(step, indices))


def adagrad_rows(gradient, table, slots, constants, fused=_AUTO):
  """SparseAdagrad's update of one table's touched rows and accumulator rows.

  `slots`: [accumulator]; `constants`: (learning_rate, epsilon) in the table's dtype;
  `fused` as in `adam_rows`.
  """
  lr, epsilon = constants
  dtype = table.dtype
  acc = slots[0]
  fused = _ops_for(fused, [table, acc])
  if fused is not None:
    fused.hsm_sparse_adagrad_rows(table.handle, acc.handle, gradient.indices,
                                  tf.cast(gradient.values, dtype), lr, epsilon)
    return
  indices, grad = merge_duplicates(gradient, dtype)
  acc_rows = tf.gather(acc, indices) + tf.square(grad)
  acc.scatter_update(tf.IndexedSlices(acc_rows, indices))
  step = (lr * grad) / tf.sqrt(acc_rows + epsilon)
  table.scatter_sub(tf.IndexedSlices(step, indices))


def sgd_rows(gradient, table, slots, constants, nesterov=False, fused=_AUTO):
  """SparseSGD's update of one table's touched rows (and momentum rows).

  `slots`: [momentum], or [] without momentum; `constants`: (learning_rate, momentum)
  in the table's dtype; `fused` as in `adam_rows`.
  """
  lr, momentum = constants
  dtype = table.dtype
  use_momentum = bool(slots)
  m = slots[0] if use_momentum else None
  fused = _ops_for(fused, [table] + list(slots))
  if fused is not None:
    fused.hsm_sparse_sgd_rows(table.handle, (m if use_momentum else table).handle,
                              gradient.indices, tf.cast(gradient.values, dtype), lr,
                              momentum, use_momentum=use_momentum,
                              nesterov=bool(nesterov))
    return
  indices, grad = merge_duplicates(gradient, dtype)
  step = grad * lr
  if not use_momentum:
    table.scatter_sub(tf.IndexedSlices(step, indices))
    return
  m_rows = tf.gather(m, indices) * momentum - step
  m.scatter_update(tf.IndexedSlices(m_rows, indices))
  if nesterov:
    table.scatter_add(tf.IndexedSlices(m_rows * momentum - step, indices))
  else:
    table.scatter_add(tf.IndexedSlices(m_rows, indices))
