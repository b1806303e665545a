"""Python wrappers and registered gradients of the tf_hsm ops."""

import tensorflow as tf

from tf_hsm.ops import compact as compact_tables
from tf_hsm.ops.custom_gradient import custom_gradient
from tf_hsm.ops import inputs
from tf_hsm.ops import loader
def _table_rows(tree, weights, biases, targets, skip_padding=False):
  """(weights, biases, tree_inputs, targets) for the ops: the tree's own tensors and the
  tables as given, or, where a table is held in pieces (a `ShardedVariable`, a list of
  row ranges, a row layout), the compact rows of the batch's paths and the batch tree
  over them (`tf_hsm.ops.compact`). With `skip_padding` the batch tree holds the real
  targets' paths alone (none for a batch of padding: no row is gathered, so none is in
  the gradient) and padding is -1 to the op, which walks nothing for it."""
  t = inputs.tree_tensors(tree)
  targets = inputs.class_ids(targets, "targets")
  if not compact_tables.is_split(weights, biases):
    return (weights, biases, (t["child_begin"], t["path_begin"], t["path_nodes"],
                              t["path_slots"]), targets)
  if not skip_padding:
    return compact_tables.compact_inputs(tree, t, weights, biases, targets, "targets")
  flat = tf.reshape(targets, [-1])
  where = tf.where(flat >= 0)  # [n, 1]: the real targets' positions
  weights, biases, tree_inputs, compact = compact_tables.compact_inputs(
      tree, t, weights, biases, tf.gather_nd(flat, where), "targets")
  compact = tf.tensor_scatter_nd_update(-tf.ones_like(flat), where,
                                        tf.cast(compact, flat.dtype))
  return weights, biases, tree_inputs, tf.reshape(compact, tf.shape(targets))


@inputs.accepts_ragged
def log_prob(hidden, weights, biases, tree, targets, skip_padding=False):
  """log P(targets | hidden) under a hierarchical softmax.

  log P(c | h) = sum over c's root-to-leaf path of z(slot taken) - logsumexp(z over the
  node's children), with z(s) = weights[s] . h + biases[s].

  Args:
    hidden: [..., D] float32/float64 (float16/bfloat16 are computed in float32), or a
      `tf.RaggedTensor` [batch, (time), D] whose per-token arguments are ragged alike;
      the outputs with a token axis are then ragged too.
    weights: [tree.num_slots, D] table, one row per tree edge.
    biases: [tree.num_slots] or None.
    tree: a `tf_hsm.Tree`.
    targets: int32/int64 class ids with hidden's leading shape.
    skip_padding: whether targets < 0 are padding: log-probability 0, no path walked,
      no gradient (no weight row is in the gradient for a padded token alone, so a
      LazyAdam moves none on its moments; a table in pieces gathers none for it either).
      Default False: they are an error.

  Returns:
    log-probabilities with the shape of `targets` and the dtype of `hidden`.
    The gradient for weights and biases is a `tf.IndexedSlices` over the touched rows.
    On the CPU, when a `tf.GradientTape` is recording where `log_prob` is called (eagerly,
    or traced inside the tape's block), the op also keeps what the gradient needs short of
    the upstream factor: the logits of the nodes of more than 8 children along the
    batch's paths (one per visit and child), the softmax coefficients of the steps through
    smaller nodes, and each token's gradient with respect to its hidden row (up to 2**25
    logits and coefficients in all, or as many as the weight gradient has values where
    that is more). The gradient then reads no weight row for the hidden
    gradient, computes no logit of a large node again and walks no path through small
    ones. Without a recording tape the forward skips that work; a gradient taken anyway (a
    `tf.function` called under a tape outside it) recomputes it, with the same bits.

  Raises:
    TypeError: wrong dtypes.
    tf.errors.InvalidArgumentError (or ValueError while tracing): targets outside
      [0, num_classes) (>= num_classes with skip_padding), shape mismatches, malformed
      tree tensors.
  """
  weights, biases, tree_inputs, targets = _table_rows(tree, weights, biases, targets,
                                                      skip_padding)
  hidden, weights, biases, out_dtype = inputs.dense_inputs(hidden, weights, biases)
  if tf.config.list_logical_devices("GPU") or not inputs.gradient_may_follow():
    # Nothing worth keeping when no tape can record.
    result = loader.ops().hsm_log_prob(hidden, weights, biases, targets, *tree_inputs,
                                       skip_padding=skip_padding)
  else:
    result = loader.ops().hsm_log_prob_saving_logits(hidden, weights, biases, targets,
                                                      *tree_inputs,
                                                      skip_padding=skip_padding)[0]
  return tf.cast(result, out_dtype) if result.dtype != out_dtype else result


def log_prob_and_saved(hidden, weights, biases, tree, targets, skip_padding=False):
  """(log_prob, saved_logits, saved_directions) of Hsm>LogProbSavingLogits on the CPU: what
  a fused step after the forward pass reads instead of computing again (both saved
  tensors empty where too many to keep). hidden and the tables of one float type, one
  variable each (never in pieces)."""
  weights, biases, tree_inputs, targets = _table_rows(tree, weights, biases, targets,
                                                      skip_padding)
  hidden, weights, biases, _ = inputs.dense_inputs(hidden, weights, biases)
  return loader.ops().hsm_log_prob_saving_logits(hidden, weights, biases, targets,
                                                  *tree_inputs, skip_padding=skip_padding)


@tf.RegisterGradient("Hsm>LogProb")
def _log_prob_grad(op, upstream):
  hidden, weights, biases, targets = op.inputs[:4]
  tree_inputs = op.inputs[4:8]
  grads = loader.ops().hsm_log_prob_grad(hidden, weights, biases, targets, *tree_inputs,
                                          upstream, skip_padding=_skips_padding(op))
  return _input_grads(weights, biases, *grads) + [None] * 5


def _skips_padding(op):
  """The forward op's skip_padding, for its gradient op (graphs saved before the
  attribute get its default, False, when loaded)."""
  return op.get_attr("skip_padding")


@tf.RegisterGradient("Hsm>LogProbSavingLogits")
def _log_prob_saving_logits_grad(op, upstream, unused_saved_grad, unused_directions_grad):
  """Hsm>LogProbGrad's outputs, bit for bit, from the logits and directions the forward
  kept."""
  hidden, weights, biases, targets = op.inputs[:4]
  tree_inputs = op.inputs[4:8]
  if upstream is None:
    return [None] * 8
  grads = loader.ops().hsm_log_prob_grad_from_logits(hidden, weights, biases, targets,
                                                      *tree_inputs, upstream, op.outputs[1],
                                                      op.outputs[2],
                                                      skip_padding=_skips_padding(op))
  return _input_grads(weights, biases, *grads) + [None] * 5


@custom_gradient
def _refusing_identity(gradient):
  """The identity, whose own gradient raises NotImplementedError."""

  def second_order(unused_upstream):
    raise NotImplementedError(
        "tf_hsm computes first derivatives only: the gradient of a gradient of log_prob, "
        "nll_loss or sgd_step (a second derivative) is not implemented")

  return tf.identity(gradient), second_order


def _first_order_only(gradient):
  """A gradient the ops computed, made to refuse being differentiated again: the gradient
  ops declare no gradient of their own, so a second derivative through them (a gradient
  penalty on the hidden states, a Hessian-vector product) would otherwise be None, read
  by TensorFlow as zero. Executing eagerly with no tape that could record it, nothing can
  differentiate it, and it is returned as it is (the wrapper costs ~60 us an eager call)."""
  if tf.executing_eagerly() and not inputs.gradient_may_follow():
    return gradient
  return _refusing_identity(gradient)


def _input_grads(weights, biases, hidden_grad, weight_rows, bias_rows, row_ids):
  """[d hidden, d weights, d biases] from a gradient op's outputs: the table gradients as
  `tf.IndexedSlices` over the touched rows; an empty biases input beside a table with
  rows stands for "no bias" and gets no gradient (both empty: the compact problem of a
  batch of padding, whose biases get an empty gradient). Each refuses to be
  differentiated again (`_first_order_only`)."""
  dense_shape = tf.shape(weights, out_type=tf.int64)
  weight_grad = tf.IndexedSlices(_first_order_only(weight_rows), row_ids, dense_shape)
  no_bias = (biases.shape.rank == 1 and biases.shape[0] == 0 and
             weights.shape[0] != 0)
  bias_grad = None if no_bias else tf.IndexedSlices(_first_order_only(bias_rows), row_ids,
                                                    dense_shape[:1])
  return [_first_order_only(hidden_grad), weight_grad, bias_grad]


tf.no_gradient("Hsm>LogProbGrad")
tf.no_gradient("Hsm>LogProbGradFromLogits")


def _token_weights(loss_scale, targets, dtype, skip_padding=False):
  """loss_scale broadcast to targets' shape; by default 1 / number of tokens (the mean),
  of the real tokens (targets >= 0) with `skip_padding`."""
  if loss_scale is None:
    count = tf.cast(tf.size(targets), dtype) if not skip_padding else tf.reduce_sum(
        tf.cast(targets >= 0, dtype))
    return tf.fill(tf.shape(targets), 1.0 / tf.maximum(count, 1.0))
  scale = inputs.number_arg(loss_scale, dtype, "loss_scale", scalar=False)
  try:
    fits = tf.broadcast_static_shape(scale.shape, targets.shape).is_compatible_with(
        targets.shape)
  except ValueError:
    fits = False
  if not fits:
    raise ValueError(f"loss_scale of shape {scale.shape} does not broadcast to targets' "
                     f"shape {targets.shape}")
  return tf.broadcast_to(scale, tf.shape(targets))


@inputs.accepts_ragged
def nll_loss(hidden, weights, biases, tree, targets, loss_scale=None, skip_padding=False):
  """The training loss -sum(loss_scale * log_prob), computed with its gradient in one pass.

  The value equals `-tf.reduce_sum(loss_scale * log_prob(...))` up to rounding, and its
  gradients (hidden, and `tf.IndexedSlices` for weights and biases) equal that
  expression's bit for bit. On the CPU one op computes the log-probabilities from the
  logsumexps the gradient needs anyway, so each touched weight row is read once per step
  instead of once by the forward and again by the gradient; in a step that returns the
  loss this saves the whole forward pass. The gradient is computed for the loss itself:
  `tape.gradient(loss, ...)` uses it as is, and any other output gradient (the loss scaled
  by another op, a second loss sharing the log-probabilities) is recomputed exactly.
  Where a GPU is visible the loss is computed as the expression above (the GPU kernels).

  Args:
    hidden: [..., D] float32/float64 (float16/bfloat16 are computed in float32), or a
      `tf.RaggedTensor` [batch, (time), D] whose per-token arguments are ragged alike;
      the outputs with a token axis are then ragged too.
    weights: [tree.num_slots, D] table.
    biases: [tree.num_slots] or None.
    tree: a `tf_hsm.Tree`.
    targets: int32/int64 class ids with hidden's leading shape.
    loss_scale: weight of each token's negative log-likelihood, broadcastable to targets'
      shape; default 1 / number of tokens (the mean). Zero for padding tokens (whose
      targets must then still be valid class ids), or:
    skip_padding: whether targets < 0 are padding, as `log_prob`'s: no work, no
      gradient row, and the default loss_scale the mean over the other tokens.

  Returns:
    The scalar loss, in the weights' dtype.

  Raises:
    as `log_prob`.
  """
  weights, biases, tree_inputs, targets = _table_rows(tree, weights, biases, targets,
                                                      skip_padding)
  hidden, weights, biases, _ = inputs.dense_inputs(hidden, weights, biases)
  scale = _token_weights(loss_scale, targets, weights.dtype, skip_padding)
  if tf.config.list_logical_devices("GPU"):
    log_probs = loader.ops().hsm_log_prob(hidden, weights, biases, targets, *tree_inputs,
                                          skip_padding=skip_padding)
  else:
    log_probs = _log_probs_with_gradient(hidden, weights, biases, targets, tree_inputs,
                                         tf.negative(scale), skip_padding)
  # d loss / d log_probs = -scale exactly: the upstream the op was given.
  return tf.negative(tf.reduce_sum(scale * log_probs))


def _log_probs_with_gradient(hidden, weights, biases, targets, tree_inputs, expected,
                             skip_padding):
  """Hsm>LogProbAndGrad's log-probabilities, differentiable through its own gradient
  outputs (_log_prob_and_grad_grad). The op runs inside a custom gradient whose only
  output is the log-probabilities: recorded as the op itself, its four gradient outputs
  would each get a zeros tensor from the tape's backward pass, for want of an incoming
  gradient (one the size of the weight gradient: at V=1M, D=300 a second 1.2 GB)."""
  outputs = []

  @custom_gradient
  def log_probs_of(hidden, weights, biases):
    outputs.extend(loader.ops().hsm_log_prob_and_grad(hidden, weights, biases, targets,
                                                      *tree_inputs, expected,
                                                      skip_padding=skip_padding))

    def gradient(upstream):
      grads = _own_or_recomputed(upstream, expected, outputs[1:], lambda: (
          loader.ops().hsm_log_prob_grad(hidden, weights, biases, targets, *tree_inputs,
                                         upstream, skip_padding=skip_padding)))
      return _input_grads(weights, biases, *grads)

    return tf.identity(outputs[0]), gradient

  return log_probs_of(hidden, weights, biases)


def _own_or_recomputed(upstream, expected, own, recompute):
  """A gradient op's outputs for `upstream`: `own` (computed for `expected`) when the two
  are equal, else `recompute()`."""
  return tf.cond(tf.reduce_all(tf.equal(upstream, expected)), lambda: list(own),
                 lambda: list(recompute()))


@tf.RegisterGradient("Hsm>LogProbAndGrad")
def _log_prob_and_grad_grad(op, upstream, *unused_output_grads):
  """The op's own gradient outputs when `upstream` is the gradient it was computed for,
  otherwise Hsm>LogProbGrad of `upstream` (the gradient outputs are not differentiable)."""
  hidden, weights, biases, targets = op.inputs[:4]
  tree_inputs = op.inputs[4:8]
  expected = op.inputs[8]
  if upstream is None:
    return [None] * 9

  grads = _own_or_recomputed(upstream, expected, op.outputs[1:], lambda: (
      loader.ops().hsm_log_prob_grad(hidden, weights, biases, targets, *tree_inputs,
                                     upstream, skip_padding=_skips_padding(op))))
  return _input_grads(weights, biases, *grads) + [None] * 6


@inputs.accepts_ragged
def sgd_step(hidden, weights, biases, tree, targets, learning_rate, loss_scale=None,
             skip_padding=False):
  """One fused hierarchical-softmax training step with in-place SGD on the table.

  Computes log P(targets | hidden), then updates every visited weight row (and bias) in
  place, W[s] -= learning_rate * dloss/dW[s] with loss = -sum(loss_scale * log_prob),
  without materialising a gradient: a step needs no memory beyond the table, the batch and
  a bounded scratch, and no optimizer pass over gradient rows. The update equals what
  `tf.keras.optimizers.SGD(learning_rate)` does with the gradient of `log_prob`.

  Args:
    hidden: [..., D] float32/float64 hidden states, or a `tf.RaggedTensor`
      [batch, (time), D] with targets (and loss_scale) ragged alike.
    weights: a `tf.Variable` (or Keras variable) [tree.num_slots, D] of hidden's dtype.
    biases: a variable [tree.num_slots], or None.
    tree: a `tf_hsm.Tree`.
    targets: int32/int64 class ids with hidden's leading shape.
    learning_rate: scalar.
    loss_scale: weight of each token's negative log-likelihood, targets' shape; default
      1 / number of tokens (the mean). Zero for padding tokens, or:
    skip_padding: whether targets < 0 are padding, as `nll_loss`'s.

  Returns:
    (log_prob, hidden_grad): log-probabilities before the update (targets' shape) and
    dloss/dhidden (hidden's shape), to continue backpropagation into the model below, e.g.
    `tape.gradient(hidden, model_vars, output_gradients=hidden_grad)`. As in `nll_loss`,
    log_prob comes from the logsumexps the update computes anyway, with no separate
    forward pass: it equals `log_prob(...)` up to rounding, and hidden_grad equals the
    gradient of `log_prob` bit for bit.

  A table placed off the CPU (on a GPU) is updated from the gradient instead, with the
  ops that have GPU kernels (`sgd_step_from_gradient`): the same results, log_prob then
  equal to `log_prob(...)` bit for bit, with the gradient rows materialised for the
  scatter.
  """
  t = inputs.tree_tensors(tree)
  hidden = tf.convert_to_tensor(hidden)
  if hidden.dtype not in inputs.FLOAT_TYPES:
    raise TypeError(f"hidden must be float32 or float64, got {hidden.dtype.name}")
  targets = inputs.class_ids(targets, "targets")
  loss_scale = _token_weights(loss_scale, targets, hidden.dtype, skip_padding)
  if compact_tables.is_split(weights, biases):
    raise TypeError("sgd_step updates one variable in place; for a table held in pieces "
                    "(a ShardedVariable or a list of row ranges) use nll_loss with "
                    "tf_hsm.optimizers.SparseSGD, which updates each piece's touched rows")
  weights_handle = inputs.variable_handle(weights, "weights")
  biases_handle = weights_handle if biases is None else inputs.variable_handle(biases, "biases")
  if not fused_sgd_runs_on(inputs.tf_variable(weights).device):
    tree_inputs = (t["child_begin"], t["path_begin"], t["path_nodes"], t["path_slots"])
    log_probs, hidden_grad = sgd_step_from_gradient(
        hidden, weights, biases, tree_inputs, targets, loss_scale,
        inputs.number_arg(learning_rate, hidden.dtype, "learning_rate"), skip_padding)
    return log_probs, _first_order_only(hidden_grad)
  log_probs, hidden_grad = loader.ops().hsm_sgd_step(
      hidden, weights_handle, biases_handle, targets, t["child_begin"], t["path_begin"],
      t["path_nodes"], t["path_slots"], loss_scale,
      inputs.number_arg(learning_rate, hidden.dtype, "learning_rate"),
      use_bias=biases is not None, skip_padding=skip_padding)
  return log_probs, _first_order_only(hidden_grad)


tf.no_gradient("Hsm>SgdStep")


def fused_sgd_runs_on(device):
  """Whether Hsm>SgdStep has a kernel on `device`, a variable's device string: the fused
  step is CPU code (its update runs inside the CPU core's backward pass, row block by row
  block); a variable not yet placed ("") is on the CPU. Elsewhere sgd_step takes
  `sgd_step_from_gradient`."""
  return tf.DeviceSpec.from_string(device or "").device_type in (None, "CPU")


def sgd_step_from_gradient(hidden, weights, biases, tree_inputs, targets, loss_scale,
                           learning_rate, skip_padding=False):
  """sgd_step for a table on a device without the fused op (a GPU): Hsm>LogProb and
  Hsm>LogProbGrad with upstream -loss_scale, which have kernels there, then
  W[s] -= learning_rate * dW[s] (and the biases alike) by a scatter on the touched rows.

  Unlike the fused step it materialises the gradient rows (one row per child of every
  visited node) for the scatter. log_prob equals `log_prob(...)` bit for bit, hidden_grad
  equals its gradient bit for bit, and the table ends where Keras SGD would put it with
  that gradient (the fused CPU step may round W - lr * dW in one step where this rounds
  the product first). The values are read before the rows are written: the scatters
  depend on both ops.
  """
  table = inputs.tf_variable(weights)
  bias_table = None if biases is None else inputs.tf_variable(biases)
  hidden, weight_values, bias_values, _ = inputs.dense_inputs(hidden, table, bias_table)
  ops = loader.ops()
  log_probs = ops.hsm_log_prob(hidden, weight_values, bias_values, targets, *tree_inputs,
                               skip_padding=skip_padding)
  hidden_grad, weight_rows, bias_rows, row_ids = ops.hsm_log_prob_grad(
      hidden, weight_values, bias_values, targets, *tree_inputs, tf.negative(loss_scale),
      skip_padding=skip_padding)
  with tf.control_dependencies([log_probs, hidden_grad]):
    table.scatter_sub(tf.IndexedSlices(learning_rate * weight_rows, row_ids))
    if bias_table is not None:
      bias_table.scatter_sub(tf.IndexedSlices(learning_rate * bias_rows, row_ids))
  return log_probs, hidden_grad
