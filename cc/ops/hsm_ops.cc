// Op registrations: shapes and documentation. Kernels live in cc/kernels/.
#include "cc/ops/shape_fns.h"
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace tf_hsm {

using ::tensorflow::Status;
using ::tensorflow::shape_inference::DimensionHandle;
using ::tensorflow::shape_inference::InferenceContext;
using ::tensorflow::shape_inference::ShapeHandle;


namespace {

// The inputs, and the type attributes they use, of the ops over a batch, the table and the
// tree: Hsm>LogProb, Hsm>LogProbSavingLogits, Hsm>LogProbGrad, Hsm>LogProbGradFromLogits
// and Hsm>LogProbAndGrad (a macro: REGISTER_OP's chained builder takes no helper call).
#define TF_HSM_LOG_PROB_INPUTS              \
  .Input("hidden: T")                        \
      .Input("weights: T")                   \
      .Input("biases: T")                    \
      .Input("targets: Tidx")                \
      .Input("child_begin: int64")           \
      .Input("path_begin: int64")            \
      .Input("path_nodes: int64")            \
      .Input("path_slots: int64")            \
      .Attr("T: {float, double}")            \
      .Attr("Tidx: {int32, int64} = DT_INT64") \
      .Attr("skip_padding: bool = false")

// Those inputs checked; *targets = the batch shape (hidden's leading dimensions).
Status TargetShape(InferenceContext* c, ShapeHandle* targets) {
  ShapeHandle batch;
  TF_RETURN_IF_ERROR(SoftmaxInputShapes(c, 4, 4, &batch));
  return c->Merge(batch, c->input(3), targets);
}

// Hsm>LogProb: log_prob with targets' shape (and Hsm>LogProbSavingLogits' first output).
Status LogProbShape(InferenceContext* c) {
  ShapeHandle targets;
  TF_RETURN_IF_ERROR(TargetShape(c, &targets));
  c->set_output(0, targets);
  return Status();
}

// Hsm>LogProbGrad's inputs (LogProb's plus upstream) and outputs from index `first` on:
// hidden_grad, weight_grad_rows, bias_grad_rows, row_ids. With first = 1, output 0 is
// log_prob (Hsm>LogProbAndGrad).
Status GradShapes(InferenceContext* c, int first) {
  ShapeHandle targets, unused;
  TF_RETURN_IF_ERROR(TargetShape(c, &targets));
  TF_RETURN_IF_ERROR(c->Merge(targets, c->input(8), &unused));
  if (first == 1) c->set_output(0, targets);
  c->set_output(first, c->input(0));
  DimensionHandle rows = c->UnknownDim();
  c->set_output(first + 1, c->Matrix(rows, c->Dim(c->input(1), 1)));
  c->set_output(first + 2, c->Vector(c->UnknownDim()));
  c->set_output(first + 3, c->Vector(rows));
  return Status();
}

}  // namespace

REGISTER_OP("Hsm>LogProb")
    TF_HSM_LOG_PROB_INPUTS
    .Output("log_prob: T")
    .SetShapeFn(LogProbShape)
    .Doc(R"doc(
Hierarchical-softmax log-probability of each target class.

log_prob[i] = sum over the steps (n, s) of targets[i]'s root-to-leaf path of
z_s - logsumexp over the children s' of node n of z_s', with z_s = weights[s] . hidden[i]
+ biases[s].

hidden: [..., D] hidden states.
weights: [num_slots, D], one row per tree edge (slot).
biases: [num_slots], or an empty vector for no bias.
targets: hidden's leading shape; class ids in [0, num_classes). With skip_padding, a
  target < 0 is padding: its log_prob is 0, it walks no path and gives no gradient (no
  weight row of the gradient is there for it alone); without, it is an error.
child_begin: [num_nodes + 1]; node n's children are slots [child_begin[n], child_begin[n+1]).
path_begin: [num_classes + 1]; class c's path is steps path_begin[c]..path_begin[c+1]-1.
path_nodes: [path_length]; the node visited at each path step, root first.
path_slots: [path_length]; the slot taken at each path step.
log_prob: targets' shape.
)doc");

REGISTER_OP("Hsm>LogProbSavingLogits")
    TF_HSM_LOG_PROB_INPUTS
    .Output("log_prob: T")
    .Output("saved_logits: T")
    .Output("saved_directions: T")
    .Attr("max_saved_logits: int >= -1 = -1")
    .SetShapeFn([](InferenceContext* c) {
      TF_RETURN_IF_ERROR(LogProbShape(c));
      c->set_output(1, c->Vector(c->UnknownDim()));
      c->set_output(2, c->UnknownShape());
      return Status();
    })
    .Doc(R"doc(
Hsm>LogProb (CPU) that also returns what Hsm>LogProbGradFromLogits needs, short of the
upstream gradient: the logits of the nodes with more than 8 children along the batch's
paths (one per visit and child), the softmax coefficients (onehot - softmax) of the steps
through smaller nodes (as many per path step as the most children of such a node on the
batch's paths), and each token's direction, the gradient of its log-probability with
respect to its hidden row. The gradient op then computes none of those logits again,
walks no path and reads no weight row for the hidden gradient. Both are empty when there
are more than max_saved_logits values (the gradient recomputes everything); -1, the
default, allows 2^25 values, or as many as the weight gradient will have (touched rows x
D) where that is more. log_prob equals Hsm>LogProb's up to rounding.

log_prob: targets' shape.
saved_logits: [n], n the number of logits and coefficients kept, or 0.
saved_directions: hidden's shape, or [0] with no saved logits.
)doc");

REGISTER_OP("Hsm>LogProbGradFromLogits")
    TF_HSM_LOG_PROB_INPUTS
    .Input("upstream: T")
    .Input("saved_logits: T")
    .Input("saved_directions: T")
    .Output("hidden_grad: T")
    .Output("weight_grad_rows: T")
    .Output("bias_grad_rows: T")
    .Output("row_ids: int64")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle unused;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(9), 1, &unused));
      return GradShapes(c, 0);
    })
    .Doc(R"doc(
Hsm>LogProbGrad given the saved_logits and saved_directions of Hsm>LogProbSavingLogits on
the same inputs: the same outputs, bit for bit, without computing those logits and
coefficients again or reading weight rows for hidden_grad (all of them computed when both
are empty).

upstream: targets' shape.
saved_logits: Hsm>LogProbSavingLogits' second output for these inputs.
saved_directions: its third output.
hidden_grad, weight_grad_rows, bias_grad_rows, row_ids: as Hsm>LogProbGrad.
)doc");

REGISTER_OP("Hsm>LogProbGrad")
    TF_HSM_LOG_PROB_INPUTS
    .Input("upstream: T")
    .Output("hidden_grad: T")
    .Output("weight_grad_rows: T")
    .Output("bias_grad_rows: T")
    .Output("row_ids: int64")
    .SetShapeFn([](InferenceContext* c) { return GradShapes(c, 0); })
    .Doc(R"doc(
Gradient of sum(upstream * Hsm>LogProb(...)). The weight and bias gradients are sparse:
row r of weight_grad_rows (and bias_grad_rows, empty when biases is empty) is the gradient
of row row_ids[r]; every child slot of every node the batch visits appears once.

upstream: targets' shape.
hidden_grad: hidden's shape.
weight_grad_rows: [num_rows, D].
bias_grad_rows: [num_rows], or [0] without biases.
row_ids: [num_rows] int64 weight-row ids.
)doc");

REGISTER_OP("Hsm>LogProbAndGrad")
    TF_HSM_LOG_PROB_INPUTS
    .Input("upstream: T")
    .Output("log_prob: T")
    .Output("hidden_grad: T")
    .Output("weight_grad_rows: T")
    .Output("bias_grad_rows: T")
    .Output("row_ids: int64")
    .SetShapeFn([](InferenceContext* c) { return GradShapes(c, 1); })
    .Doc(R"doc(
Hsm>LogProb and the gradient of sum(upstream * log_prob) in one pass (CPU): the values come
from the logsumexps the gradient computes anyway, so the weight rows are read once rather
than once more by a separate forward. log_prob equals Hsm>LogProb's up to rounding; the
gradients are Hsm>LogProbGrad's, bit for bit. For a loss whose value and gradient are both
wanted (the per-token upstream weights must be known before the backward pass).

upstream: targets' shape.
log_prob: targets' shape.
hidden_grad, weight_grad_rows, bias_grad_rows, row_ids: as Hsm>LogProbGrad.
)doc");

#undef TF_HSM_LOG_PROB_INPUTS

// The fused training steps' shapes (inputs hidden, weights, biases, targets, the tree's
// four arrays, loss_scale, then the step's own): log_prob takes the batch shape, shared
// by targets and loss_scale, hidden_grad hidden's; inputs [scalars_begin, scalars_end)
// are scalars. FusedStepInputs checks the inputs (*batch: the batch shape).
static Status FusedStepInputs(InferenceContext* c, int scalars_begin, int scalars_end,
                              ShapeHandle* batch) {
  ShapeHandle hidden, unused;
  TF_RETURN_IF_ERROR(c->WithRankAtLeast(c->input(0), 1, &hidden));
  TF_RETURN_IF_ERROR(c->Subshape(hidden, 0, -1, batch));
  TF_RETURN_IF_ERROR(c->Merge(*batch, c->input(3), batch));
  TF_RETURN_IF_ERROR(c->Merge(*batch, c->input(8), batch));
  for (int i = 4; i < 8; ++i) TF_RETURN_IF_ERROR(c->WithRank(c->input(i), 1, &unused));
  for (int i = scalars_begin; i < scalars_end; ++i) {
    TF_RETURN_IF_ERROR(c->WithRank(c->input(i), 0, &unused));
  }
  return Status();
}

static Status FusedStepShape(InferenceContext* c, int scalars_begin, int scalars_end) {
  ShapeHandle batch;
  TF_RETURN_IF_ERROR(FusedStepInputs(c, scalars_begin, scalars_end, &batch));
  c->set_output(0, batch);
  c->set_output(1, c->input(0));
  return Status();
}

REGISTER_OP("Hsm>SgdStep")
    .Input("hidden: T")
    .Input("weights: resource")
    .Input("biases: resource")
    .Input("targets: Tidx")
    .Input("child_begin: int64")
    .Input("path_begin: int64")
    .Input("path_nodes: int64")
    .Input("path_slots: int64")
    .Input("loss_scale: T")
    .Input("learning_rate: T")
    .Output("log_prob: T")
    .Output("hidden_grad: T")
    .Attr("T: {float, double}")
    .Attr("Tidx: {int32, int64} = DT_INT64")
    .Attr("use_bias: bool")
    .Attr("skip_padding: bool = false")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) { return FusedStepShape(c, 9, 10); })
    .Doc(R"doc(
One fused training step of the hierarchical softmax with in-place SGD on the table.

With loss = -sum(loss_scale * log_prob), updates every weight row (and bias) the batch
visits as W[s] -= learning_rate * dloss/dW[s], without materialising any gradient tensor,
and returns the log-probabilities before the update and dloss/dhidden, so the rest of a
model can be trained from it. The variables are locked for the step.

hidden: [..., D] hidden states.
weights: a resource variable [num_slots, D] of dtype T.
biases: a resource variable [num_slots] of dtype T; ignored unless use_bias.
targets: hidden's leading shape; class ids in [0, num_classes), or < 0 for padding (no
  path, no update) with skip_padding.
loss_scale: targets' shape; the weight of each token's negative log-likelihood.
learning_rate: scalar.
log_prob: targets' shape, before the update.
hidden_grad: hidden's shape, dloss/dhidden.
)doc");

// The inputs of the fused Adam steps, as Hsm>AdamStep documents them.
#define TF_HSM_ADAM_STEP_INPUTS                  \
  .Input("hidden: T")                            \
      .Input("weights: resource")                \
      .Input("biases: resource")                 \
      .Input("targets: Tidx")                    \
      .Input("child_begin: int64")               \
      .Input("path_begin: int64")                \
      .Input("path_nodes: int64")                \
      .Input("path_slots: int64")                \
      .Input("loss_scale: T")                    \
      .Input("m: resource")                      \
      .Input("v: resource")                      \
      .Input("bias_m: resource")                 \
      .Input("bias_v: resource")                 \
      .Input("alpha: T")                         \
      .Input("one_minus_beta_1: T")              \
      .Input("one_minus_beta_2: T")              \
      .Input("epsilon: T")

REGISTER_OP("Hsm>AdamStep")
    TF_HSM_ADAM_STEP_INPUTS
    .Output("log_prob: T")
    .Output("hidden_grad: T")
    .Attr("T: {float, double}")
    .Attr("Tidx: {int32, int64} = DT_INT64")
    .Attr("use_bias: bool")
    .Attr("skip_padding: bool = false")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) { return FusedStepShape(c, 13, 17); })
    .Doc(R"doc(
One fused training step of the hierarchical softmax with Adam's update in place (the row
update of tf_hsm.optimizers.LazyAdam) on the table and its moments.

With loss = -sum(loss_scale * log_prob), every weight row (and bias) the batch visits,
and its rows of m and v (bias_m, bias_v), get
  m <- m + (g - m) one_minus_beta_1, v <- v + (g^2 - v) one_minus_beta_2,
  w <- w - (m alpha) / (sqrt(v) + epsilon)
with g = dloss/dw, without materialising any gradient tensor; returns the
log-probabilities before the update and dloss/dhidden. The variables are locked.

m, v: resource variables of weights' shape; bias_m, bias_v: of biases' (ignored unless
use_bias).
alpha: learning_rate * sqrt(1 - beta_2^t) / (1 - beta_1^t), as Keras' Adam computes it.
)doc");

REGISTER_OP("Hsm>AdamStepFromLogits")
    TF_HSM_ADAM_STEP_INPUTS
    .Input("saved_logits: T")
    .Input("saved_directions: T")
    .Output("hidden_grad: T")
    .Attr("T: {float, double}")
    .Attr("Tidx: {int32, int64} = DT_INT64")
    .Attr("use_bias: bool")
    .Attr("skip_padding: bool = false")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle unused;
      TF_RETURN_IF_ERROR(FusedStepInputs(c, 13, 17, &unused));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(17), 1, &unused));
      c->set_output(0, c->input(0));
      return Status();
    })
    .Doc(R"doc(
Hsm>AdamStep's update and hidden_grad after a forward pass that kept its values: the
saved_logits and saved_directions of Hsm>LogProbSavingLogits on the same inputs, the
table unchanged since (both empty where it kept none: everything is then computed
again). The step of a layer whose loss gradient is known only after its forward pass.
)doc");

#undef TF_HSM_ADAM_STEP_INPUTS

// Shapes are checked by the kernels: the variables' shapes are not known here.
REGISTER_OP("Hsm>SparseAdamRows")
    .Input("var: resource")
    .Input("m: resource")
    .Input("v: resource")
    .Input("v_hat: resource")
    .Input("indices: Tidx")
    .Input("gradient: T")
    .Input("alpha: T")
    .Input("one_minus_beta_1: T")
    .Input("one_minus_beta_2: T")
    .Input("epsilon: T")
    .Attr("T: {float, double}")
    .Attr("Tidx: {int32, int64} = DT_INT64")
    .Attr("amsgrad: bool = false")
    .SetIsStateful()
    .SetShapeFn(::tensorflow::shape_inference::NoOutputs)
    .Doc(R"doc(
Adam's update of the rows a sparse gradient names, in place; other rows are left alone.

Rows that indices names more than once are summed first (from zero, in the order of
indices, as tf.math.unsorted_segment_sum sums them). For each distinct row r, with g the
summed gradient row: m[r] += (g - m[r]) * one_minus_beta_1,
v[r] += (g * g - v[r]) * one_minus_beta_2, with amsgrad v_hat[r] = max(v_hat[r], v[r])
used in place of v[r], then var[r] -= (m[r] * alpha) / (sqrt(v[r]) + epsilon), each
operation rounded as written. The variables are locked for the update.

var, m, v: resource variables of dtype T and one shape, of rank >= 1.
v_hat: a fourth such variable; read only with amsgrad.
indices: [n] rows of var.
gradient: [n] + var's shape without its first dimension.
alpha: scalar, learning_rate * sqrt(1 - beta_2^t) / (1 - beta_1^t).
)doc");

REGISTER_OP("Hsm>SparseAdagradRows")
    .Input("var: resource")
    .Input("accumulator: resource")
    .Input("indices: Tidx")
    .Input("gradient: T")
    .Input("learning_rate: T")
    .Input("epsilon: T")
    .Attr("T: {float, double}")
    .Attr("Tidx: {int32, int64} = DT_INT64")
    .SetIsStateful()
    .SetShapeFn(::tensorflow::shape_inference::NoOutputs)
    .Doc(R"doc(
Adagrad's update of the rows a sparse gradient names, in place; other rows are left alone.

Rows that indices names more than once are summed first (from zero, in the order of
indices, as tf.math.unsorted_segment_sum sums them). For each distinct row r, with g the
summed gradient row: accumulator[r] += g * g, then
var[r] -= (learning_rate * g) / sqrt(accumulator[r] + epsilon), each operation rounded as
written. The variables are locked for the update.

var, accumulator: resource variables of dtype T and one shape, of rank >= 1.
indices: [n] rows of var.
gradient: [n] + var's shape without its first dimension.
)doc");

REGISTER_OP("Hsm>SparseSgdRows")
    .Input("var: resource")
    .Input("momentum_var: resource")
    .Input("indices: Tidx")
    .Input("gradient: T")
    .Input("learning_rate: T")
    .Input("momentum: T")
    .Attr("T: {float, double}")
    .Attr("Tidx: {int32, int64} = DT_INT64")
    .Attr("use_momentum: bool = false")
    .Attr("nesterov: bool = false")
    .SetIsStateful()
    .SetShapeFn(::tensorflow::shape_inference::NoOutputs)
    .Doc(R"doc(
SGD's update of the rows a sparse gradient names, in place; other rows are left alone.

Rows that indices names more than once are summed first (from zero, in the order of
indices, as tf.math.unsorted_segment_sum sums them). For each distinct row r, with g the
summed gradient row: without use_momentum, var[r] -= g * learning_rate; with it,
momentum_var[r] = momentum_var[r] * momentum - g * learning_rate, then
var[r] += momentum_var[r], or with nesterov
var[r] += momentum_var[r] * momentum - g * learning_rate; each operation rounded as
written. The variables are locked for the update.

var: a resource variable of dtype T, of rank >= 1.
momentum_var: a second such variable of var's shape; read only with use_momentum.
indices: [n] rows of var.
gradient: [n] + var's shape without its first dimension.
)doc");

}  // namespace tf_hsm
