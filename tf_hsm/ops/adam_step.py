"""Hsm>AdamStep's wrapper (and Hsm>AdamStepFromLogits', the same after a saving forward
pass): a hierarchical-softmax training step with Adam's row update of the table and its
moments fused into the backward pass, as `sgd_step` fuses SGD's. The
optimizer's side (its slots, its step's constants, its step count) is
`tf_hsm.keras.adam_step`'s, which users call as `tf_hsm.adam_step`."""

import tensorflow as tf

from tf_hsm.ops import inputs
from tf_hsm.ops import loader
from tf_hsm.ops import training


def adam_rows_step(hidden, weights, biases, tree, targets, moments, constants,
                   loss_scale, skip_padding=False):
  """(log_prob, hidden_grad) of one fused step on the CPU.

  Args:
    hidden: [..., D] float32/float64 tensor.
    weights, biases: the table's variables (biases may be None), updated in place.
    tree: a `tf_hsm.Tree`.
    targets: int class ids with hidden's leading shape.
    moments: [m, v] of weights, then [m, v] of biases when there are biases: variables
      of their shapes, updated in place.
    constants: (alpha, 1 - beta_1, 1 - beta_2, epsilon) in hidden's dtype.
    loss_scale: each token's weight in loss = -sum(loss_scale * log_prob), targets'
      shape.
    skip_padding: whether targets < 0 are padding (no path, no update).
  """
  log_probs, hidden_grad = loader.ops().hsm_adam_step(
      *_step_inputs(hidden, weights, biases, tree, targets, moments, constants,
                    loss_scale), use_bias=biases is not None, skip_padding=skip_padding)
  return log_probs, training._first_order_only(hidden_grad)  # pylint: disable=protected-access


def adam_rows_step_from_logits(hidden, weights, biases, tree, targets, moments, constants,
                               loss_scale, saved_logits, saved_directions,
                               skip_padding=False):
  """hidden_grad of `adam_rows_step`'s update after a forward pass that saved its values
  (`training.log_prob_and_saved` on the same inputs and `skip_padding`, the table
  unchanged since): the update reads them instead of computing the logits and paths
  again. With `skip_padding`, targets < 0 update nothing."""
  hidden_grad = loader.ops().hsm_adam_step_from_logits(
      *_step_inputs(hidden, weights, biases, tree, targets, moments, constants,
                    loss_scale), saved_logits, saved_directions,
      use_bias=biases is not None, skip_padding=skip_padding)
  return training._first_order_only(hidden_grad)  # pylint: disable=protected-access


def _step_inputs(hidden, weights, biases, tree, targets, moments, constants, loss_scale):
  """The fused Adam ops' inputs before their own: tensors, handles and constants."""
  t = inputs.tree_tensors(tree)
  weights_handle = inputs.variable_handle(weights, "weights")
  biases_handle = (weights_handle if biases is None
                   else inputs.variable_handle(biases, "biases"))
  handles = [m.handle for m in moments]
  if biases is None:  # the op's bias moments are read only with use_bias
    handles += handles
  return (hidden, weights_handle, biases_handle, targets, t["child_begin"],
          t["path_begin"], t["path_nodes"], t["path_slots"], loss_scale, *handles[:4],
          *constants)


tf.no_gradient("Hsm>AdamStep")
tf.no_gradient("Hsm>AdamStepFromLogits")
