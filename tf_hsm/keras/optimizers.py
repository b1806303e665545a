"""Keras 3 optimizers that update only the rows of a table that a step touched.

Keras' own Adam, Adagrad and SGD with momentum turn a `tf.IndexedSlices` gradient (what
`tf_hsm.log_prob` and `tf.gather` / `keras.layers.Embedding` produce for their tables)
into an update of the whole variable, so a step costs O(table) however few rows it
touched. The optimizers here apply an IndexedSlices gradient to the touched rows only:
per-step work and memory are O(touched rows x D). On the CPU one op
(Hsm>SparseAdamRows, Hsm>SparseAdagradRows, Hsm>SparseSgdRows) updates each touched row
and its slots in one vectorised pass, in place; elsewhere (a variable on a GPU, or a step
compiled by XLA, which has no kernels for those ops) gathers, elementwise ops and
scatters do it. Dense gradients (every other variable of a model) go
through the parent class unchanged.

Rounding: each elementwise operation is the one Keras applies, in the same order. On the
gather/scatter path they are Keras' own TensorFlow ops, so the results are Keras' bit
for bit. The CPU ops round every operation correctly (they give the formula in NumPy
bit for bit), which TensorFlow's vectorised kernels do not always do for Adam's and
Adagrad's square roots and divisions: there they differ from Keras by an ulp or two in
places (the tests allow 2e-6 relative). SGD's products and differences are Keras' bits
on both paths.

All are drop-in replacements: same constructor arguments, same slot variables, same
checkpoint layout as `keras.optimizers.Adam` / `keras.optimizers.Adagrad` /
`keras.optimizers.SGD`.

Rows named more than once in one IndexedSlices are summed first, so a sparse gradient
means exactly what its dense equivalent (`tf.convert_to_tensor(grad)`) means. (Keras'
Adam and Adagrad, given such a gradient directly, square the duplicates separately and
get a different result from their own dense path.)

Caveats shared by all: Keras applies `weight_decay`, `use_ema` and
`gradient_accumulation_steps` to whole variables, so they bring back a per-step cost of
O(table). Regularise the table some other way, or accept that cost.
"""

import weakref

import keras
import tensorflow as tf
from keras import ops

from tf_hsm import distribute
from tf_hsm.frontend import hsm
from tf_hsm.frontend import rows as row_updates
from tf_hsm.ops import compact  # The row updates are shared with tf_hsm.tf_keras (tf_hsm/frontend/rows.py); these names
# stay here for the code and tests that reach them through this module.
_merge_duplicates = row_updates.merge_duplicates
_rows = row_updates.tf_rows
_by_piece = row_updates.by_piece


def _fused_ops(variables):
  """The op library where the fused row updates apply to `variables`, else None
  (`tf_hsm.frontend.rows.fused_ops`)."""
  return row_updates.fused_ops(variables)


class _SlotsInPieces:
  """Gives a table held in pieces (a `ShardedVariable`) slots held in the same pieces,
  slot piece i placed with table piece i, so that each piece's rows are updated where
  they live. (Keras colocates a slot with its whole variable, which for a
  `ShardedVariable` makes one slot the size of the whole table on one server.)"""

  def add_variable_from_reference(self, reference_variable, name=None,
                                  initializer="zeros"):
    parts = distribute.pieces(reference_variable)
    if parts is None:
      return super().add_variable_from_reference(reference_variable, name=name,
                                                 initializer=initializer)
    fill = keras.initializers.get(initializer)

    def create_in_pieces(next_creator, **kwargs):
      kwargs.pop("colocate_with", None)
      base = kwargs.get("name") or "slot"
      made = []
      for index, part in enumerate(parts):
        shape = tf.TensorShape(part.shape)
        args = dict(kwargs, shape=shape, name=f"{base}/part_{index}", colocate_with=part,
                    initial_value=lambda shape=shape, dtype=part.dtype: fill(shape, dtype))
        made.append(next_creator(**args))
      return compact.ShardedVariable(made)

    with tf.variable_creator_scope(create_in_pieces):
      return super().add_variable_from_reference(reference_variable, name=name,
                                                 initializer=initializer)

  def __str__(self):
    # What the other Keras prints when its `compile` is handed this optimizer.
    return hsm.other_keras_name("keras", "optimizers", type(self).__name__)

  def _distributed_tf_update_step(self, distribution, grads_and_vars, learning_rate):
    # Keras hands each variable to `distribution.extended.update`, which colocates the
    # update with the variable: a ShardedVariable cannot be colocated with as a whole
    # ("doesn't support being used as a reference"). Its update places itself, piece by
    # piece (`_by_piece`); the other variables go the Keras way.
    whole = []
    for grad, var in grads_and_vars:
      if distribute.pieces(var) is None:
        whole.append((grad, var))
      else:
        self.update_step(grad, var, learning_rate)
    if whole:
      super()._distributed_tf_update_step(distribution, whole, learning_rate)


@keras.saving.register_keras_serializable(package="tf_hsm")
class LazyAdam(_SlotsInPieces, keras.optimizers.Adam):
  """Adam that, for a sparse gradient, updates only the touched rows and their moments.

  For a dense gradient this is `keras.optimizers.Adam`, bit for bit. For a
  `tf.IndexedSlices` gradient (duplicate indices are summed first), the rows r it names
  get

      m[r] <- m[r] + (1 - beta_1) * (g[r] - m[r])
      v[r] <- v[r] + (1 - beta_2) * (g[r]^2 - v[r])        (v_hat[r] <- max(v_hat[r], v[r]))
      var[r] <- var[r] - alpha_t * m[r] / (sqrt(v[r]) + epsilon)
      alpha_t = learning_rate * sqrt(1 - beta_2^t) / (1 - beta_1^t)

  and every other row, with its m and v, is left alone ("lazy"): its moments do not
  decay on steps that do not touch it.

  Bias correction uses the optimizer's global step count t = iterations + 1, not a
  per-row count, as TensorFlow Addons' LazyAdam does. So a row touched on every step
  follows the trajectory Keras' Adam gives it (the same float operations in the same
  order; see the module's note on rounding), while a row touched rarely gets the bias
  correction of a long-running optimizer: its first updates are smaller than a fresh
  Adam's would be.

  Args: as `keras.optimizers.Adam`.
  """

  def update_step(self, gradient, variable, learning_rate):
    self._check_not_updated_in_backward(gradient, variable)
    if not isinstance(gradient, tf.IndexedSlices):
      return super().update_step(gradient, variable, learning_rate)
    index = self._get_variable_index(variable)
    slots = [self._momentums[index], self._velocities[index]]
    if self.amsgrad:
      slots.append(self._velocity_hats[index])
    _by_piece(self._sparse_rows, gradient, variable, slots,
              self.row_constants(variable.dtype, learning_rate))

  def row_constants(self, dtype, learning_rate):
    """(alpha, 1 - beta_1, 1 - beta_2, epsilon) of this step in `dtype`: the same scalar
    expressions as keras.optimizers.Adam.update_step, at t = iterations + 1 (what the
    row update and `tf_hsm.adam_step` apply)."""
    lr = ops.cast(learning_rate, dtype)
    local_step = ops.cast(self.iterations + 1, dtype)
    beta_1_power = ops.power(ops.cast(self.beta_1, dtype), local_step)
    beta_2_power = ops.power(ops.cast(self.beta_2, dtype), local_step)
    alpha = lr * ops.sqrt(1 - beta_2_power) / (1 - beta_1_power)
    return (alpha, tf.cast(1 - self.beta_1, dtype), tf.cast(1 - self.beta_2, dtype),
            tf.cast(self.epsilon, dtype))

  def updated_in_backward(self, variables):
    """Records that this step's backward pass has updated `variables` in place (a layer's
    `fused_update`): the gradient `apply_gradients` then gets for them must name no
    rows, or `update_step` raises (another use of the table, a tied weight or a loss on
    it, would otherwise be applied as a second step). The record is this step's: this
    traced function's, or the eager step's count."""
    step = _this_step(self)
    if getattr(self, "_updated_in_backward", (None,))[0] != step:
      self._updated_in_backward = (step, set())
    self._updated_in_backward[1].update(self._get_variable_index(v) for v in variables)

  def _check_not_updated_in_backward(self, gradient, variable):
    step, indices = getattr(self, "_updated_in_backward", (None, ()))
    if (not indices or _names_no_rows(gradient) or step != _this_step(self)
        or self._get_variable_index(variable) not in indices):
      return
    raise ValueError(
        f"{variable.name} is updated in the backward pass of a layer with "
        "fused_update=True, and the model gives it another gradient too (a weight tied to "
        "another layer's, a loss term on it): applying it would be a second step. Use "
        "fused_update=False for a table used elsewhere in the model")

  def _sparse_rows(self, gradient, table, slots, constants):
    """The update of one table (or one piece of it) and its slots' rows."""
    row_updates.adam_rows(gradient, table, slots, constants, amsgrad=self.amsgrad,
                        fused=_fused_ops([table] + list(slots)))


def _this_step(optimizer):
  """What tells one training step from another: the traced function being built, or
  (eagerly) the optimizer's step count."""
  if tf.inside_function():
    return weakref.ref(tf.compat.v1.get_default_graph())
  return int(optimizer.iterations.numpy())


def _names_no_rows(gradient):
  """Whether `gradient` is an IndexedSlices of no rows, known when traced (a sum with
  another use's gradient has rows, or no static count, or is dense)."""
  return (isinstance(gradient, tf.IndexedSlices)
          and tf.compat.dimension_value(gradient.indices.shape[0]) == 0)


@keras.saving.register_keras_serializable(package="tf_hsm")
class SparseAdagrad(_SlotsInPieces, keras.optimizers.Adagrad):
  """Adagrad that, for a sparse gradient, updates only the touched rows and accumulators.

  Adagrad leaves a row with zero gradient unchanged anyway, so this is
  `keras.optimizers.Adagrad` applied to the densified gradient (duplicate indices
  summed; see the module's note on rounding), only without touching the other rows:

      acc[r] <- acc[r] + g[r]^2
      var[r] <- var[r] - learning_rate * g[r] / sqrt(acc[r] + epsilon)

  Dense gradients go through `keras.optimizers.Adagrad` unchanged.

  Args: as `keras.optimizers.Adagrad`.
  """

  def update_step(self, gradient, variable, learning_rate):
    if not isinstance(gradient, tf.IndexedSlices):
      return super().update_step(gradient, variable, learning_rate)
    dtype = variable.dtype
    lr = ops.cast(learning_rate, dtype)
    epsilon = tf.cast(self.epsilon, dtype)
    acc = self._accumulators[self._get_variable_index(variable)]
    _by_piece(self._sparse_rows, gradient, variable, [acc], (lr, epsilon))

  def _sparse_rows(self, gradient, table, slots, constants):
    """The update of one table (or one piece of it) and its accumulator's rows."""
    row_updates.adagrad_rows(gradient, table, slots, constants,
                           fused=_fused_ops([table] + list(slots)))


@keras.saving.register_keras_serializable(package="tf_hsm")
class SparseSGD(_SlotsInPieces, keras.optimizers.SGD):
  """SGD that, for a sparse gradient, updates only the touched rows (and their momentum).

  For a dense gradient this is `keras.optimizers.SGD`, bit for bit. For a
  `tf.IndexedSlices` gradient (duplicate indices are summed first), the rows r it names
  get what Keras' SGD gives them:

      without momentum:  var[r] <- var[r] - g[r] * learning_rate
      with momentum:     m[r] <- m[r] * momentum - g[r] * learning_rate
                         var[r] <- var[r] + m[r]
           nesterov:     var[r] <- var[r] + (m[r] * momentum - g[r] * learning_rate)

  Without momentum, Keras' SGD already updates only the touched rows; this one does it
  in one pass, in place, with no scaled copy of the gradient. With momentum, Keras' SGD
  densifies the gradient and updates every row and its momentum on every step (an
  untouched row keeps moving by its decaying momentum). Here a row's momentum changes,
  and the row moves, only on the steps that touch it ("lazy", as the sparse momentum
  update of TensorFlow 1's `MomentumOptimizer`). So a row touched on every step follows
  Keras' trajectory, while a row touched now and then keeps its momentum undecayed
  until it is touched again.

  Args: as `keras.optimizers.SGD`.
  """

  def update_step(self, gradient, variable, learning_rate):
    if not isinstance(gradient, tf.IndexedSlices):
      return super().update_step(gradient, variable, learning_rate)
    dtype = variable.dtype
    lr = ops.cast(learning_rate, dtype)
    momentum = tf.cast(self.momentum, dtype)
    slots = [self.momentums[self._get_variable_index(variable)]] if self.momentum != 0 else []
    _by_piece(self._sparse_rows, gradient, variable, slots, (lr, momentum))

  def _sparse_rows(self, gradient, table, slots, constants):
    """The update of one table (or one piece of it) and its momentum's rows."""
    row_updates.sgd_rows(gradient, table, slots, constants, nesterov=bool(self.nesterov),
                       fused=_fused_ops([table] + list(slots)))
