"""`tf_hsm.adam_step`: a hierarchical-softmax training step with
`tf_hsm.optimizers.LazyAdam`'s update of the table fused into the backward pass
(`tf_hsm.ops.adam_step`, op Hsm>AdamStep), as `sgd_step` fuses SGD's: the optimizer's
side, its slots, its step's constants and its step count; and `log_prob_updating_table`,
the same update in the gradient of a layer's output (`HierarchicalSoftmax(...,
fused_update=True)` in `model.fit`)."""

import tensorflow as tf

from tf_hsm.keras import optimizers
from tf_hsm.ops import adam_step as fused
from tf_hsm.ops import compact as compact_tables
from tf_hsm.ops.custom_gradient import custom_gradient
from tf_hsm.ops import inputs
from tf_hsm.ops import training

# Keras optimizer settings that `apply_gradients` applies around the update (to whole
# variables, or to the gradient before it): the fused step cannot, so it refuses them.
_UNFUSED_SETTINGS = ("amsgrad", "weight_decay", "use_ema", "gradient_accumulation_steps",
                     "clipnorm", "clipvalue", "global_clipnorm", "loss_scale_factor")


@inputs.accepts_ragged
def adam_step(hidden, weights, biases, tree, targets, optimizer, loss_scale=None,
              skip_padding=False):
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
      1 / number of tokens (the mean). Zero for padding tokens (whose rows LazyAdam then
      still moves on their moments), or:
    skip_padding: whether targets < 0 are padding, as `nll_loss`'s: no path, no row
      updated for them, the default loss_scale the mean over the other tokens.

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
  hidden = _checked(optimizer, hidden, weights, biases)
  variables = _table_variables(weights, biases)
  if not optimizer.built:
    optimizer.build(variables)
  _check_own(optimizer, variables)
  targets = inputs.class_ids(targets, "targets")
  loss_scale = training._token_weights(loss_scale, targets, hidden.dtype, skip_padding)  # pylint: disable=protected-access
  if not training.fused_sgd_runs_on(inputs.tf_variable(weights).device):
    return _from_gradient(hidden, weights, biases, tree, targets, optimizer, loss_scale,
                          skip_padding)
  moments = [m for v in variables for m in _slots(optimizer, v)]
  log_probs, hidden_grad = fused.adam_rows_step(
      hidden, weights, biases, tree, targets, moments,
      optimizer.row_constants(hidden.dtype, optimizer.learning_rate), loss_scale,
      skip_padding)
  with tf.control_dependencies([log_probs, hidden_grad]):
    optimizer.iterations.assign_add(1)
  return log_probs, hidden_grad


def _checked(optimizer, hidden, weights, biases):
  """hidden as a tensor, once optimizer and the table are ones the fused op can update."""
  if not isinstance(optimizer, optimizers.LazyAdam):
    kind = type(optimizer)
    raise TypeError("optimizer must be a tf_hsm.optimizers.LazyAdam (Keras 3), got "
                    f"{kind.__module__}.{kind.__name__}" + (
                        " (tf_keras': with tf_keras use nll_loss and the optimizer's "
                        "apply_gradients)" if "tf_keras" in kind.__module__ else ""))
  used = [name for name in _UNFUSED_SETTINGS if getattr(optimizer, name, None)]
  if used:
    raise ValueError(f"the fused step applies LazyAdam's row update only; this optimizer "
                     f"also applies {', '.join(used)}: use the layer's fused_update=False "
                     "(or, for adam_step, nll_loss and optimizer.apply_gradients)")
  hidden = tf.convert_to_tensor(hidden)
  if hidden.dtype not in inputs.FLOAT_TYPES:
    raise TypeError(f"hidden must be float32 or float64, got {hidden.dtype.name}")
  if compact_tables.is_split(weights, biases):
    raise TypeError("the fused step updates one variable in place; for a table held in "
                    "pieces (a ShardedVariable or a list of row ranges) use nll_loss with "
                    "tf_hsm.optimizers.LazyAdam under the strategy that placed them")
  return hidden


@inputs.accepts_ragged
def log_prob_updating_table(hidden, weights, biases, tree, targets, optimizer,
                            skip_padding=False):
  """log_prob(hidden, weights, biases, tree, targets), whose gradient updates the table.

  For a table that `optimizer` trains together with other variables (a model's, in
  `model.fit`): the forward pass is `log_prob`'s; the backward pass, given the loss's
  gradient g with respect to the log-probabilities, applies LazyAdam's update of the
  gradient -sum(g * log_prob) would give the table, in place, fused into the op that
  computes hidden's gradient (as `adam_step` with loss_scale = -g), and gives weights
  and biases empty gradients (`tf.IndexedSlices` of no rows), whose update in
  `optimizer.apply_gradients` changes nothing and which counts the step as usual. The
  table, its biases and their moments then end as they would with the gradient
  applied, bit for bit: the update uses the step count and learning rate that
  `apply_gradients` uses in the same training step.

  Taking the gradient is the update: take it once a step, apply the optimizer to the
  other variables in the same step (as `model.fit` does), and give the table no other
  gradient (it would be applied as a second step: the optimizer's `update_step` refuses
  one, `LazyAdam.updated_in_backward`). Where the fused op does not run (a
  table off the CPU) this is `log_prob` and its gradient is the table's.

  With `skip_padding`, targets < 0 are padding, as `log_prob`'s: 0, and no update.

  Raises:
    TypeError, ValueError: as `adam_step`, for the optimizer and the table; ValueError
      where the optimizer has not been built for the table's variables (the layer
      builds the model's before its first fused step).
  """
  hidden = _checked(optimizer, hidden, weights, biases)
  targets = inputs.class_ids(targets, "targets")
  if not training.fused_sgd_runs_on(inputs.tf_variable(weights).device):
    return training.log_prob(hidden, weights, biases, tree, targets, skip_padding)
  variables = _table_variables(weights, biases)
  moments = [m for v in variables for m in _slots(optimizer, v)]

  # The tables enter as tensors read without a copy (`inputs.read_table`), not as
  # variables the function captures: tf.custom_gradient reads a captured variable
  # plainly, and after the step's sparse update that read copies the whole table.
  tables = [inputs.read_table(v) for v in variables]

  @custom_gradient
  def forward(hidden, *tables):
    # The forward keeps its logits and directions; the update reads them.
    log_probs, saved_logits, saved_directions = training.log_prob_and_saved(
        hidden, tables[0], tables[1] if len(tables) > 1 else None, tree, targets,
        skip_padding)

    def backward(upstream):
      constants = optimizer.row_constants(hidden.dtype, optimizer.learning_rate)
      # Reading the forward's outputs orders the update after the forward's read of the
      # table. (The upstream gradient of a mean loss does not depend on log_probs: with
      # it alone, the update could run first, or beside the read, and copy the table.)
      hidden_grad = fused.adam_rows_step_from_logits(
          hidden, weights, biases, tree, targets, moments, constants, -upstream,
          saved_logits, saved_directions, skip_padding)
      optimizer.updated_in_backward(variables)
      return [hidden_grad] + [_no_rows(v) for v in variables]
    return log_probs, backward
  return forward(hidden, *tables)


def _table_variables(weights, biases):
  return [weights] + ([] if biases is None else [biases])


def _no_rows(variable):
  """A gradient of `variable` that names none of its rows (its static shape: reading
  the variable for its shape could copy it)."""
  shape = [int(d) for d in variable.shape]
  return tf.IndexedSlices(tf.zeros([0] + shape[1:], variable.dtype),
                          tf.zeros([0], tf.int64), tf.constant(shape, tf.int64))


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
  """[m, v]: `optimizer`'s moments of `variable`; ValueError if it has none."""
  try:
    index = optimizer._get_variable_index(variable)  # pylint: disable=protected-access
  except KeyError:
    raise ValueError(f"the optimizer has no moments for {variable.name}: build it for "
                     "the table's variables first") from None
  return [optimizer._momentums[index], optimizer._velocities[index]]  # pylint: disable=protected-access


def _from_gradient(hidden, weights, biases, tree, targets, optimizer, loss_scale,
                   skip_padding):
  """adam_step where the fused op does not run: log_prob's gradient, then
  `optimizer.apply_gradients` (which counts the step)."""
  with tf.GradientTape() as tape:
    tape.watch(hidden)
    log_probs = training.log_prob(hidden, weights, biases, tree, targets, skip_padding)
    loss = -tf.reduce_sum(loss_scale * log_probs)
  variables = _table_variables(weights, biases)
  hidden_grad, *table_grads = tape.gradient(loss, [hidden] + variables)
  optimizer.apply_gradients(zip(table_grads, variables))
  return log_probs, hidden_grad
