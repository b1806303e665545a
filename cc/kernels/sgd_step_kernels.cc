// OpKernels for Hsm>SgdStep, Hsm>AdamStep and Hsm>AdamStepFromLogits: the backward pass
// with the optimizer's update applied in place to the table's resource variables (and
// Adam's moments), row block by row block, under the variables' locks.
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "cc/core/log_prob.h"
#include "cc/core/sparse_rows.h"
#include "cc/core/visit_plan.h"
#include "cc/kernels/hsm_inputs.h"
#include "cc/kernels/locked_variables.h"
#include "cc/kernels/tf_names.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_var.h"

namespace tf_hsm {

namespace {

// Inputs of the ops: hidden, weights, biases, targets, the tree's four arrays,
// loss_scale; then SgdStep's learning_rate, or AdamStep's m, v, bias_m, bias_v, alpha,
// one_minus_beta_1, one_minus_beta_2 and epsilon; then AdamStepFromLogits' saved logits
// and directions.
constexpr int kLossScale = 8;
constexpr int kAdamSlots = 9;
constexpr int kAdamScalars = 13;
constexpr int kSavedLogits = 17;

enum class Fused { kSgd, kAdam, kAdamFromLogits };

template <typename T>
class FusedStepOp : public OpKernel {
 public:
  FusedStepOp(OpKernelConstruction* ctx, Fused kind)
      : OpKernel(ctx),
        adam_(kind != Fused::kSgd),
        from_logits_(kind == Fused::kAdamFromLogits),
        padding_(PaddingOf(ctx)) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("use_bias", &use_bias_));
  }

  void Compute(OpKernelContext* ctx) override {
    // Variables: weights, [biases], then with Adam m, v, [bias_m, bias_v].
    std::vector<int> inputs = {1};
    std::vector<const char*> names = {"weights"};
    std::vector<int> like = {-1};
    if (use_bias_) inputs.push_back(2), names.push_back("biases"), like.push_back(-1);
    const int bias_at = use_bias_ ? 1 : -1;
    if (adam_) {
      for (int k = 0; k < 2; ++k) {
        inputs.push_back(kAdamSlots + k), names.push_back(k ? "v" : "m"), like.push_back(0);
      }
      for (int k = 0; use_bias_ && k < 2; ++k) {
        inputs.push_back(kAdamSlots + 2 + k);
        names.push_back(k ? "bias_v" : "bias_m");
        like.push_back(bias_at);
      }
    }
    LockedVariables<T> vars(ctx, inputs, names, like, "hidden");
    if (!vars.ok()) return;
    Tensor no_bias(::tensorflow::DataTypeToEnum<T>::value, ::tensorflow::TensorShape({0}));
    const Tensor& weights = *vars.tensor(0);
    const Tensor& biases = use_bias_ ? *vars.tensor(bias_at) : no_bias;
    SoftmaxInputs in;
    OP_REQUIRES_OK(ctx, CheckSoftmaxTensors(ctx->input(0), weights, biases, &in));
    OP_REQUIRES(ctx, !use_bias_ || in.has_bias,
                errors::InvalidArgument("biases must have one entry per weight row"));
    TreeView tree;
    OP_REQUIRES_OK(ctx, ReadTree(ctx, 4, -1, weights.dim_size(0), &tree));
    const auto batch = BatchShape(*in.hidden);
    std::vector<int64> targets;
    OP_REQUIRES_OK(ctx, ReadClassIds(ctx->input(3), "targets", batch, &targets));
    const Tensor& scale = ctx->input(kLossScale);
    OP_REQUIRES(ctx, scale.shape() == batch,
                errors::InvalidArgument("loss_scale must have shape ", batch.DebugString(),
                                        ", got ", scale.shape().DebugString()));
    LogProbGrads<T> grads;
    grads.sgd_update = true;
    grads.sgd_weights = vars.data(0);
    grads.sgd_biases = use_bias_ ? vars.data(bias_at) : nullptr;
    OP_REQUIRES_OK(ctx, adam_ ? SetAdam(ctx, vars, &grads) : SetSgd(ctx, &grads));
    const PlanPool::Lease lease = plans_.Acquire();
    const std::string problem = BuildVisitPlan(tree, targets.data(), in.num_tokens, lease.get(),
                                               PlanFor::kBackward, padding_);
    OP_REQUIRES(ctx, problem.empty(), errors::InvalidArgument(problem));

    Tensor *log_prob = nullptr, *hidden_grad;
    if (from_logits_) {
      OP_REQUIRES_OK(ctx, SetSaved(ctx, *lease, tree, in, &grads));
    } else {
      OP_REQUIRES_OK(ctx, ctx->allocate_output(0, batch, &log_prob));
    }
    OP_REQUIRES_OK(ctx, ctx->allocate_output(from_logits_ ? 0 : 1, in.hidden->shape(),
                                             &hidden_grad));
    // The table is read and updated in place: params.weights aliases grads.sgd_weights.
    const SoftmaxParams<T> params = ParamsOf<T>(in);
    // d loss / d log_prob = -loss_scale.
    std::vector<T> upstream(in.num_tokens);
    const T* s = scale.flat<T>().data();
    for (int64 i = 0; i < in.num_tokens; ++i) upstream[i] = -s[i];
    grads.hidden = hidden_grad->flat<T>().data();
    // The log-probabilities from the logsumexps the update needs anyway (no forward pass
    // over the grouped nodes, as in nll_loss); the rows are read before they are updated.
    // After a saving forward pass, which returned them, none.
    if (log_prob != nullptr) grads.log_prob_from_backward = log_prob->flat<T>().data();
    const typename LeasePool<CoefficientStore<T>>::Lease store = stores_.Acquire();
    grads.coefficient_store = store.get();
    LogProbBackward<T>(*lease, tree, params, upstream.data(), CpuParallelFor(ctx), grads,
                       CoefficientBudget(*lease, in.dim));
  }

 private:
  // The forward's saved logits and directions (inputs kSavedLogits and after), checked
  // as Hsm>LogProbGradFromLogits checks them; both empty: none kept.
  ::tensorflow::Status SetSaved(OpKernelContext* ctx, const VisitPlan& plan,
                                const TreeView& tree, const SoftmaxInputs& in,
                                LogProbGrads<T>* grads) {
    const Tensor& saved = ctx->input(kSavedLogits);
    const Tensor& directions = ctx->input(kSavedLogits + 1);
    const int64 expected = SavedLogitsSize(plan, tree);
    if (saved.dims() != 1 || (saved.NumElements() != 0 && saved.NumElements() != expected)) {
      return errors::InvalidArgument("saved_logits must be the forward's ", expected,
                                     " logits of these inputs (or empty), got shape ",
                                     saved.shape().DebugString());
    }
    // A batch of padding alone (skip_padding) has no logits: its directions are not read.
    const bool none = saved.NumElements() == 0 && (directions.NumElements() == 0 || expected == 0);
    if (!none && saved.NumElements() == 0) {
      return errors::InvalidArgument("saved_logits is empty but saved_directions is not: "
                                     "give both of the forward's, or neither");
    }
    if (!none && directions.shape() != in.hidden->shape()) {
      return errors::InvalidArgument("saved_directions must have hidden's shape ",
                                     in.hidden->shape().DebugString(),
                                     " with saved_logits (or both be empty), got ",
                                     directions.shape().DebugString());
    }
    if (!none) {
      grads->saved_logits = saved.flat<T>().data();
      grads->saved_directions = directions.flat<T>().data();
    }
    return ::tensorflow::Status();
  }

  ::tensorflow::Status SetSgd(OpKernelContext* ctx, LogProbGrads<T>* grads) {
    return ReadScalar(ctx->input(kLossScale + 1), "learning_rate", &grads->sgd_learning_rate);
  }

  ::tensorflow::Status SetAdam(OpKernelContext* ctx, const LockedVariables<T>& vars,
                               LogProbGrads<T>* grads) {
    const int slots = use_bias_ ? 2 : 1;  // weights, [biases], then the moments
    grads->adam_update = true;
    grads->adam_m = vars.data(slots);
    grads->adam_v = vars.data(slots + 1);
    if (use_bias_) {
      grads->adam_bias_m = vars.data(slots + 2);
      grads->adam_bias_v = vars.data(slots + 3);
    }
    AdamStep<T>& step = grads->adam_step;
    const std::pair<const char*, T*> scalars[] = {
        {"alpha", &step.alpha},
        {"one_minus_beta_1", &step.one_minus_beta_1},
        {"one_minus_beta_2", &step.one_minus_beta_2},
        {"epsilon", &step.epsilon}};
    for (int k = 0; k < 4; ++k) {
      TF_RETURN_IF_ERROR(
          ReadScalar(ctx->input(kAdamScalars + k), scalars[k].first, scalars[k].second));
    }
    return ::tensorflow::Status();
  }

  const bool adam_;
  const bool from_logits_;  // after a saving forward pass: its values in, no log_prob out
  const Padding padding_;  // skip_padding: targets < 0 walk nothing and update nothing
  bool use_bias_ = false;
  PlanPool plans_;
  LeasePool<CoefficientStore<T>> stores_;
};

template <typename T>
class SgdStepOp : public FusedStepOp<T> {
 public:
  explicit SgdStepOp(OpKernelConstruction* ctx) : FusedStepOp<T>(ctx, Fused::kSgd) {}
};

template <typename T>
class AdamStepOp : public FusedStepOp<T> {
 public:
  explicit AdamStepOp(OpKernelConstruction* ctx) : FusedStepOp<T>(ctx, Fused::kAdam) {}
};

template <typename T>
class AdamStepFromLogitsOp : public FusedStepOp<T> {
 public:
  explicit AdamStepFromLogitsOp(OpKernelConstruction* ctx)
      : FusedStepOp<T>(ctx, Fused::kAdamFromLogits) {}
};

#define REGISTER_CPU(T)                                                                    \
  REGISTER_KERNEL_BUILDER(Name("Hsm>SgdStep").Device(DEVICE_CPU).TypeConstraint<T>("T"),  \
                          SgdStepOp<T>);                                                   \
  REGISTER_KERNEL_BUILDER(Name("Hsm>AdamStep").Device(DEVICE_CPU).TypeConstraint<T>("T"), \
                          AdamStepOp<T>);                                                  \
  REGISTER_KERNEL_BUILDER(                                                                 \
      Name("Hsm>AdamStepFromLogits").Device(DEVICE_CPU).TypeConstraint<T>("T"),            \
      AdamStepFromLogitsOp<T>);
REGISTER_CPU(float)
REGISTER_CPU(double)
#undef REGISTER_CPU

}  // namespace
}  // namespace tf_hsm
