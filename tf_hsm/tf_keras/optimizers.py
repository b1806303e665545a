"""`LazyAdam`, `SparseAdagrad` and `SparseSGD` for tf_keras models: tf_keras' Adam, Adagrad
and SGD for dense gradients, and for a `tf.IndexedSlices` gradient the row updates of
`tf_hsm.keras.optimizers` (the same functions, `tf_hsm/frontend/rows.py`; see that
module for the formulas, the rounding and the caveats).

tf_keras' own Adam decays every row's moments on a sparse step, and its SGD with
momentum densifies the gradient: O(table) per step. Here only the touched rows and
their slots change. Under a `ParameterServerStrategy` with a `variable_partitioner`
tf_keras hands the optimizer each piece of a table as its own variable, with slots made
beside it, so each parameter server updates its own rows.

Their slots' initial values are computed where each slot is placed. tf_keras computes a
slot's zeros (Adagrad's accumulator: its fill) as a tensor where the optimizer is built,
which under a `ParameterServerStrategy` is the coordinator, and sends it whole to the
parameter server: for each slot of each piece, a piece-sized tensor on the coordinator,
its serialized copy in transit, and its received copy beside the new variable on the
server, which raised the peak memory of both (docs/distributed.md, "A cluster of
processes").
"""

import functools

import tensorflow as tf
import tf_keras

from tf_hsm.frontend import hsm
from tf_hsm.frontend import rows as row_updates


class _Rows:
  """What the three share: the slots of a variable, slots initialised where they are
  placed, and their name in errors."""

  def add_variable_from_reference(self, model_variable, variable_name, shape=None,
                                  initial_value=None):
    # tf_keras would make `tf.zeros(shape)` here, where the optimizer is built, and
    # send it to the slot's device; a callable initial value runs where the variable is
    # placed (beside `model_variable`, on its parameter server). DTensor (a mesh) keeps
    # tf_keras' own path.
    if initial_value is None and not getattr(self, "_mesh", None):
      shape = model_variable.shape if shape is None else tf.TensorShape(shape)
      if shape.is_fully_defined():
        initial_value = _Fill(shape, getattr(model_variable, "true_dtype",
                                             model_variable.dtype), 0)
    return super().add_variable_from_reference(model_variable, variable_name, shape,
                                               initial_value)

  def _slot(self, slots, variable):
    return slots[self._index_dict[self._var_key(variable)]]

  def __str__(self):
    # What Keras 3 prints when its `compile` is handed this optimizer.
    return hsm.other_keras_name("tf_keras", "optimizers", type(self).__name__)


class _Fill:
  """An initial value computed when called, on the device the variable is placed on:
  `shape` filled with `value`."""

  def __init__(self, shape, dtype, value):
    self.shape, self.dtype, self.value = tf.TensorShape(shape), tf.as_dtype(dtype), value

  def __call__(self):
    return tf.fill(self.shape, tf.constant(self.value, self.dtype))


@tf_keras.saving.register_keras_serializable(package="tf_hsm")
class LazyAdam(_Rows, tf_keras.optimizers.Adam):
  """Adam that, for a sparse gradient, updates only the touched rows and their moments
  (`tf_hsm.keras.optimizers.LazyAdam`). Args: as `tf_keras.optimizers.Adam`."""

  def update_step(self, gradient, variable):
    if not isinstance(gradient, tf.IndexedSlices):
      return super().update_step(gradient, variable)
    dtype = variable.dtype
    # The same scalar expressions as tf_keras.optimizers.Adam.update_step.
    lr = tf.cast(self.learning_rate, dtype)
    local_step = tf.cast(self.iterations + 1, dtype)
    beta_1_power = tf.pow(tf.cast(self.beta_1, dtype), local_step)
    beta_2_power = tf.pow(tf.cast(self.beta_2, dtype), local_step)
    alpha = lr * tf.sqrt(1 - beta_2_power) / (1 - beta_1_power)
    epsilon = self.epsilon * tf.sqrt(1 - beta_2_power) if self.adaptive_epsilon \
        else self.epsilon
    slots = [self._slot(self._momentums, variable), self._slot(self._velocities, variable)]
    if self.amsgrad:
      slots.append(self._slot(self._velocity_hats, variable))
    constants = (alpha, tf.cast(1 - self.beta_1, dtype), tf.cast(1 - self.beta_2, dtype),
                 tf.cast(epsilon, dtype))
    row_updates.by_piece(functools.partial(row_updates.adam_rows, amsgrad=self.amsgrad), gradient,
                   variable, slots, constants)


@tf_keras.saving.register_keras_serializable(package="tf_hsm")
class SparseAdagrad(_Rows, tf_keras.optimizers.Adagrad):
  """Adagrad that, for a sparse gradient, updates only the touched rows and accumulators
  (`tf_hsm.keras.optimizers.SparseAdagrad`). Args: as `tf_keras.optimizers.Adagrad`."""

  def build(self, var_list):
    # tf_keras.optimizers.Adagrad.build, but each accumulator's initial fill is computed
    # on its variable's device (there it is a whole tensor made where the optimizer is
    # built; see the module's docstring).
    tf_keras.optimizers.Optimizer.build(self, var_list)
    if getattr(self, "_built", False):
      return
    self._built = True
    self._accumulators = []
    for var in var_list:
      dtype = getattr(var, "true_dtype", var.dtype)
      initial = _Fill(var.shape, dtype, self.initial_accumulator_value) \
          if var.shape.is_fully_defined() and not getattr(self, "_mesh", None) else \
          tf_keras.initializers.Constant(self.initial_accumulator_value)(shape=var.shape,
                                                                         dtype=var.dtype)
      self._accumulators.append(
          self.add_variable_from_reference(var, "accumulator", initial_value=initial))

  def update_step(self, gradient, variable):
    if not isinstance(gradient, tf.IndexedSlices):
      return super().update_step(gradient, variable)
    dtype = variable.dtype
    constants = (tf.cast(self.learning_rate, dtype), tf.cast(self.epsilon, dtype))
    row_updates.by_piece(row_updates.adagrad_rows, gradient, variable,
                   [self._slot(self._accumulators, variable)], constants)


@tf_keras.saving.register_keras_serializable(package="tf_hsm")
class SparseSGD(_Rows, tf_keras.optimizers.SGD):
  """SGD that, for a sparse gradient, updates only the touched rows (and their momentum)
  (`tf_hsm.keras.optimizers.SparseSGD`). Args: as `tf_keras.optimizers.SGD`."""

  def update_step(self, gradient, variable):
    if not isinstance(gradient, tf.IndexedSlices):
      return super().update_step(gradient, variable)
    dtype = variable.dtype
    slots = [self._slot(self.momentums, variable)] if self.momentum != 0 else []
    constants = (tf.cast(self.learning_rate, dtype), tf.cast(self.momentum, dtype))
    row_updates.by_piece(functools.partial(row_updates.sgd_rows, nesterov=bool(self.nesterov)),
                   gradient, variable, slots, constants)
