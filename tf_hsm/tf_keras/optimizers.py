"""`LazyAdam`, `SparseAdagrad` and `SparseSGD` for tf_keras models: tf_keras' Adam, Adagrad
and SGD for dense gradients, and for a `tf.IndexedSlices` gradient the row updates of
`tf_hsm.keras.optimizers` (the same functions, `tf_hsm/frontend/rows.py`; see that
module for the formulas, the rounding and the caveats).

tf_keras' own Adam decays every row's moments on a sparse step, and its SGD with
momentum densifies the gradient: O(table) per step. Here only the touched rows and
their slots change. Under a `ParameterServerStrategy` with a `variable_partitioner`
tf_keras hands the optimizer each piece of a table as its own variable, with slots made
beside it, so each parameter server updates its own rows.
"""

import functools

import tensorflow as tf
import tf_keras

from tf_hsm.frontend import hsm
from tf_hsm.frontend import rows as row_updates


class _Rows:
  """What the three share: the slots of a variable, and their name in errors."""

  def _slot(self, slots, variable):
    return slots[self._index_dict[self._var_key(variable)]]

  def __str__(self):
    # What Keras 3 prints when its `compile` is handed this optimizer.
    return hsm.other_keras_name("tf_keras", "optimizers", type(self).__name__)


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
