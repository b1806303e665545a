// OpKernels for Hsm>LogProb, Hsm>LogProbSavingLogits, Hsm>LogProbGrad,
// Hsm>LogProbGradFromLogits and Hsm>LogProbAndGrad: validate, allocate, call the core.
#include "cc/core/log_prob.h"
#include "cc/core/visit_plan.h"
#include "cc/kernels/hsm_inputs.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/register_types.h"

namespace tf_hsm {

using ::tensorflow::DEVICE_CPU;
using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShape;
namespace errors = ::tensorflow::errors;

namespace {

// Reads and checks the inputs both ops share and builds the visit plan.
template <typename T>
::tensorflow::Status PrepareLogProb(OpKernelContext* ctx, PlanFor use, SoftmaxInputs* in,
                                   SoftmaxParams<T>* params, TreeView* tree, VisitPlan* plan) {
  TF_RETURN_IF_ERROR(ReadSoftmaxInputs(ctx, in));
  TF_RETURN_IF_ERROR(ReadTree(ctx, 4, -1, in->weights->dim_size(0), tree));
  std::vector<int64> targets;
  TF_RETURN_IF_ERROR(ReadClassIds(ctx->input(3), "targets", BatchShape(*in->hidden), &targets));
  const std::string problem = BuildVisitPlan(*tree, targets.data(), in->num_tokens, plan, use);
  if (!problem.empty()) return errors::InvalidArgument(problem);
  *params = ParamsOf<T>(*in);
  return ::tensorflow::Status();
}

// Hsm>LogProb, or with kSaving Hsm>LogProbSavingLogits (the grouped nodes' logits and the
// tokens' directions as second and third outputs, for the gradient op).
template <typename T, bool kSaving>
class LogProbOp : public OpKernel {
 public:
  explicit LogProbOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    if (kSaving) OP_REQUIRES_OK(ctx, ctx->GetAttr("max_saved_logits", &max_saved_));
  }

  void Compute(OpKernelContext* ctx) override {
    SoftmaxInputs in;
    SoftmaxParams<T> params;
    TreeView tree;
    const PlanPool::Lease lease = plans_.Acquire();
    const VisitPlan& plan = *lease;
    OP_REQUIRES_OK(ctx, PrepareLogProb(ctx, PlanFor::kForward, &in, &params, &tree, lease.get()));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, BatchShape(*in.hidden), &out));
    T* saved = nullptr;
    T* directions = nullptr;
    if (kSaving) {
      const int64 total = SavedLogitsSize(plan, tree);
      const bool keep = total <= (max_saved_ < 0 ? CoefficientBudget(plan, in.dim) : max_saved_);
      Tensor *saved_out = nullptr, *directions_out = nullptr;
      OP_REQUIRES_OK(ctx, saved_logits_.Allocate(ctx, 1, TensorShape({keep ? total : 0}), &saved_out));
      OP_REQUIRES_OK(ctx, ctx->allocate_output(
                              2, keep ? in.hidden->shape() : TensorShape({0}), &directions_out));
      if (keep) {
        saved = saved_out->flat<T>().data();
        directions = directions_out->flat<T>().data();
      }
    }
    LogProbForward<T>(plan, tree, params, CpuParallelFor(ctx), out->flat<T>().data(), saved,
                      directions);
  }

 private:
  PlanPool plans_;
  ReusableOutput saved_logits_;
  int64_t max_saved_ = 0;
};

// Hsm>LogProbGrad; with kWithLogProb Hsm>LogProbAndGrad (log_prob first, from the
// backward's own logsumexps, then the same gradient outputs); with kFromSaved
// Hsm>LogProbGradFromLogits (inputs 9 and 10: the forward's saved logits and directions,
// or none).
template <typename T, bool kWithLogProb, bool kFromSaved = false>
class LogProbGradOp : public OpKernel {
 public:
  explicit LogProbGradOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    SoftmaxInputs in;
    SoftmaxParams<T> params;
    TreeView tree;
    const PlanPool::Lease lease = plans_.Acquire();
    const VisitPlan& plan = *lease;
    OP_REQUIRES_OK(ctx, PrepareLogProb(ctx, PlanFor::kBackward, &in, &params, &tree, lease.get()));
    const Tensor& upstream = ctx->input(8);
    OP_REQUIRES(ctx, upstream.shape() == BatchShape(*in.hidden),
                errors::InvalidArgument("upstream gradient must have shape ",
                                        BatchShape(*in.hidden).DebugString(), ", got ",
                                        upstream.shape().DebugString()));
    constexpr int first = kWithLogProb ? 1 : 0;  // index of hidden_grad
    const int64 rows = plan.num_rows();
    LogProbGrads<T> grads;
    if (kFromSaved) {
      const Tensor& saved = ctx->input(9);
      const int64 expected = SavedLogitsSize(plan, tree);
      OP_REQUIRES(ctx, saved.dims() == 1 && (saved.NumElements() == 0 || saved.NumElements() == expected),
                  errors::InvalidArgument("saved_logits must be the forward's ", expected,
                                          " logits of these inputs (or empty), got shape ",
                                          saved.shape().DebugString()));
      const Tensor& directions = ctx->input(10);
      const bool none = saved.NumElements() == 0 && directions.NumElements() == 0;
      OP_REQUIRES(ctx, none || (saved.NumElements() > 0 && directions.shape() == in.hidden->shape()),
                  errors::InvalidArgument("saved_directions must have hidden's shape ",
                                          in.hidden->shape().DebugString(),
                                          " with saved_logits (or both be empty), got ",
                                          directions.shape().DebugString()));
      if (!none) {
        grads.saved_logits = saved.flat<T>().data();
        grads.saved_directions = directions.flat<T>().data();
      }
    }
    if (kWithLogProb) {
      Tensor* log_prob = nullptr;
      OP_REQUIRES_OK(ctx, ctx->allocate_output(0, BatchShape(*in.hidden), &log_prob));
      grads.log_prob_from_backward = log_prob->flat<T>().data();
    }
    Tensor *hidden_grad, *weight_rows, *bias_rows, *row_ids;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(first, in.hidden->shape(), &hidden_grad));
    OP_REQUIRES_OK(ctx, weight_rows_.Allocate(ctx, first + 1, TensorShape({rows, in.dim}), &weight_rows));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(first + 2, TensorShape({in.has_bias ? rows : 0}), &bias_rows));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(first + 3, TensorShape({rows}), &row_ids));
    grads.hidden = hidden_grad->flat<T>().data();
    grads.weight_rows = weight_rows->flat<T>().data();
    grads.bias_rows = in.has_bias ? bias_rows->flat<T>().data() : nullptr;
    grads.row_ids = row_ids->flat<int64_t>().data();
    const typename LeasePool<CoefficientStore<T>>::Lease store = stores_.Acquire();
    grads.coefficient_store = store.get();
    LogProbBackward<T>(plan, tree, params, upstream.flat<T>().data(), CpuParallelFor(ctx), grads,
                       CoefficientBudget(plan, in.dim));
  }

 private:
  PlanPool plans_;
  LeasePool<CoefficientStore<T>> stores_;
  ReusableOutput weight_rows_;
};

#define REGISTER_CPU(T)                                                                  \
  REGISTER_KERNEL_BUILDER(                                                               \
      Name("Hsm>LogProb").Device(DEVICE_CPU).TypeConstraint<T>("T"), (LogProbOp<T, false>)); \
  REGISTER_KERNEL_BUILDER(                                                               \
      Name("Hsm>LogProbSavingLogits").Device(DEVICE_CPU).TypeConstraint<T>("T"),         \
      (LogProbOp<T, true>));                                                             \
  REGISTER_KERNEL_BUILDER(Name("Hsm>LogProbGrad").Device(DEVICE_CPU).TypeConstraint<T>("T"), \
                          (LogProbGradOp<T, false>));                                     \
  REGISTER_KERNEL_BUILDER(                                                               \
      Name("Hsm>LogProbGradFromLogits").Device(DEVICE_CPU).TypeConstraint<T>("T"),       \
      (LogProbGradOp<T, false, true>));                                                  \
  REGISTER_KERNEL_BUILDER(                                                               \
      Name("Hsm>LogProbAndGrad").Device(DEVICE_CPU).TypeConstraint<T>("T"),              \
      (LogProbGradOp<T, true>));
REGISTER_CPU(float)
REGISTER_CPU(double)
#undef REGISTER_CPU

}  // namespace
}  // namespace tf_hsm
