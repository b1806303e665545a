"""`tf_hsm.adam_step`: a hierarchical-softmax training step with
`tf_hsm.optimizers.LazyAdam`'s update of the table fused into the backward pass
(`tf_hsm.ops.adam_step`, op Hsm>AdamStep), as `sgd_step` fuses SGD's: the optimizer's
side, its slots, its step's constants and its step count."""

import tensorflow as tf

from tf_hsm.keras import optimizers
from tf_hsm.ops import adam_step as fused
from tf_hsm.ops import compact as compact_tables
from tf_hsm.ops import inputs
from tf_hsm.ops import training

# Keras optimizer settings that `apply_gradients` applies around the update (to whole
# variables, or to the gradient before it): the fused step cannot, so it refuses them.
_UNFUSED_SETTINGS = ("amsgrad", "weight_decay", "use_ema", "gradient_accumulation_steps",
                     "clipnorm", "clipvalue", "global_clipnorm", "loss_scale_factor")


@inputs.accepts_ragged
def adam_step(hidden, weights, biases, tree, targets, optimizer, loss_scale=None):
  """One hierarchical-softmax training step with LazyAdam's update of the table, fused.

  What `optimizer.apply_gradients` does with the gradient of
  loss = -sum(loss_scale * log_prob(hidden, weights, biases, tree, targets)) for
  [weights, biases], without materialising that gradient: every weight row (and bias)
  the batch visits, and its rows of the optimizer's moments, get LazyAdam's update
  in the backward pass as each row's gradient is complete, and `optimizer.iterations`
  counts the step. The table's gradient (one row per child of every visited node) is
  never written and read back, which at V=1M, D=300, 3,200 tokens is most of a LazyAdam
  step's traffic beyond the moments'. The table, its biases, the moments and
  hidden_grad end as `log_prob`'s gradient and `optimizer.apply_gradients` leave them,
  bit for bit on the CPU; log_prob comes from the backward's own logsumexps, equal to
  `log_prob(...)` up to rounding (as `nll_loss`'s and `sgd_step`'s).

  Args:
    hidden: [..., D] float32/float64 hidden states, or a `tf.RaggedTensor` [batch,
      (time), D] with targets (and loss_scale) ragged alike.
    weights: a variable [tree.num_slots, D] of hidden's dtype.
    biases: a variable [tree.num_slots], or None.
    tree: a `tf_hsm.Tree`.
    targets: int32/int64 class ids with hidden's leading shape.
    optimizer: a `tf_hsm.optimizers.LazyAdam` (Keras 3) of this table alone, built for
      [weights, biases] or not yet built (then built for them); its learning rate (or
      schedule), betas and epsilon are used. Its step count is the table's: one that
      also updates other variables (the rest of a model, whose `apply_gradients` would
      count a second step a step) is refused.
    loss_scale: weight of each token's negative log-likelihood, targets' shape; default
      1 / number of tokens (the mean). Zero for padding tokens.

  Returns:
    (log_prob, hidden_grad), as `sgd_step`: the log-probabilities before the update and
    dloss/dhidden, to continue backpropagation into the model below.

  Raises:
    TypeError: if optimizer is not a Keras 3 `tf_hsm.optimizers.LazyAdam`.
    TypeError: also for a table held in pieces (`nll_loss` and LazyAdam update those).
    ValueError: if it applies amsgrad, weight decay, EMA, gradient accumulation,
      clipping or loss scaling (which `apply_gradients` applies beside the row update:
      use `nll_loss` and `optimizer.apply_gradients`), or was built for other variables
      or more.

  A table placed off the CPU (on a GPU), where the fused op has no kernel, is updated by
  `log_prob`'s gradient and `optimizer.apply_gradients` instead: the same update.
  """
  if not isinstance(optimizer, optimizers.LazyAdam):
    raise TypeError("optimizer must be a tf_hsm.optimizers.LazyAdam (Keras 3), got "
                    f"{type(optimizer).__name__}")
  used = [name for name in _UNFUSED_SETTINGS if getattr(optimizer, name, None)]
  if used:
    raise ValueError(f"adam_step fuses LazyAdam's row update only; this optimizer also "
                     f"applies {', '.join(used)}: use nll_loss and "
                     "optimizer.apply_gradients")
  hidden = tf.convert_to_tensor(hidden)
  if hidden.dtype not in inputs.FLOAT_TYPES:
    raise TypeError(f"hidden must be float32 or float64, got {hidden.dtype.name}")
  if compact_tables.is_split(weights, biases):
    raise TypeError("adam_step updates one variable in place; for a table held in pieces "
                    "(a ShardedVariable or a list of row ranges) use nll_loss with "
                    "tf_hsm.optimizers.LazyAdam under the strategy that placed them")
  variables = [weights] + ([] if biases is None else [biases])
  if not optimizer.built:
    optimizer.build(variables)
  _check_own(optimizer, variables)
  targets = inputs.class_ids(targets, "targets")
  loss_scale = training._token_weights(loss_scale, targets, hidden.dtype)  # pylint: disable=protected-access
  if not training.fused_sgd_runs_on(inputs.tf_variable(weights).device):
    return _from_gradient(hidden, weights, biases, tree, targets, optimizer, loss_scale)
  moments = [m for v in variables for m in _slots(optimizer, v)]
  log_probs, hidden_grad = fused.adam_rows_step(
      hidden, weights, biases, tree, targets, moments,
      optimizer.row_constants(hidden.dtype, optimizer.learning_rate), loss_scale)
  with tf.control_dependencies([log_probs, hidden_grad]):
    optimizer.iterations.assign_add(1)
  return log_probs, hidden_grad


def _check_own(optimizer, variables):
  """ValueError unless `optimizer` updates exactly `variables` (each step it counts is
  then one of theirs)."""
  for variable in variables:
    try:
      optimizer._get_variable_index(variable)  # pylint: disable=protected-access
    except KeyError:
      raise ValueError(f"the optimizer was built for other variables than "
                       f"{variable.name}: give adam_step an optimizer of this table's "
                       "own") from None
  others = len(optimizer._trainable_variables) - len(variables)  # pylint: disable=protected-access
  if others:
    raise ValueError(f"the optimizer also updates {others} other variables: adam_step "
                     "counts a step of it, and their apply_gradients would count another "
                     "(a wrong bias correction for both); give the table an optimizer of "
                     "its own")


def _slots(optimizer, variable):
  """[m, v]: `optimizer`'s moments of `variable` (one of those `_check_own` checked)."""
  index = optimizer._get_variable_index(variable)  # pylint: disable=protected-access
  return [optimizer._momentums[index], optimizer._velocities[index]]  # pylint: disable=protected-access


def _from_gradient(hidden, weights, biases, tree, targets, optimizer, loss_scale):
  """adam_step where the fused op does not run: log_prob's gradient, then
  `optimizer.apply_gradients` (which counts the step)."""
  with tf.GradientTape() as tape:
    tape.watch(hidden)
    log_probs = training.log_prob(hidden, weights, biases, tree, targets)
    loss = -tf.reduce_sum(loss_scale * log_probs)
  variables = [weights] + ([] if biases is None else [biases])
  hidden_grad, *table_grads = tape.gradient(loss, [hidden] + variables)
  optimizer.apply_gradients(zip(table_grads, variables))
  return log_probs, hidden_grad
