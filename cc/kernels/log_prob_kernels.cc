// OpKernels for Hsm>LogProb, Hsm>LogProbSavingLogits, Hsm>LogProbGrad,
// Hsm>LogProbGradFromLogits and Hsm>LogProbAndGrad: validate, allocate, then call the
// device's functor (log_prob_kernels.h), which runs the core. One kernel class per op
// serves every device.
//
// On the GPU, the targets and the four tree tensors are HostMemory inputs: the visit plan
// (which tokens share which node) is built on the host from them, as on the CPU, and
// uploaded with the work lists in one asynchronous copy. hidden, weights, biases, upstream
// and all outputs stay on the GPU. TensorFlow copies targets produced on the GPU to the
// host before the op runs; the tree tensors are constants and stay on the host.
#define EIGEN_USE_THREADS
#if GOOGLE_CUDA
#define EIGEN_USE_GPU
#endif

#include "cc/kernels/log_prob_kernels.h"

#include <string>
#include <type_traits>
#include <vector>

#include "cc/core/log_prob.h"
#include "cc/core/visit_plan.h"
#include "cc/kernels/hsm_inputs.h"
#include "cc/kernels/tf_names.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/register_types.h"

namespace tf_hsm {

namespace functor {

template <typename T>
struct LogProbFunctor<CPUDevice, T> {
  // The CPU forward takes walked nodes along each token's path, so it leaves them out of
  // the groups.
  static constexpr PlanFor kPlanFor = PlanFor::kForward;
  Status operator()(OpKernelContext* ctx, const VisitPlan& plan, const TreeView& tree,
                    const SoftmaxParams<T>& params, const LogProbOutputs<T>& out) {
    LogProbForward<T>(plan, tree, params, CpuParallelFor(ctx), out.log_prob, out.saved_logits,
                      out.saved_directions);
    return Status();
  }
};

template <typename T>
struct LogProbGradFunctor<CPUDevice, T> {
  Status operator()(OpKernelContext* ctx, const VisitPlan& plan, const TreeView& tree,
                    const SoftmaxParams<T>& params, const T* upstream, LogProbGrads<T> grads) {
    const typename LeasePool<CoefficientStore<T>>::Lease store = stores_.Acquire();
    grads.coefficient_store = store.get();
    LogProbBackward<T>(plan, tree, params, upstream, CpuParallelFor(ctx), grads,
                       CoefficientBudget(plan, params.dim));
    return Status();
  }

 private:
  LeasePool<CoefficientStore<T>> stores_;
};

#if GOOGLE_CUDA
// Defined in log_prob_kernels_gpu.cc.
extern template struct LogProbFunctor<GPUDevice, float>;
extern template struct LogProbFunctor<GPUDevice, double>;
extern template struct LogProbGradFunctor<GPUDevice, float>;
extern template struct LogProbGradFunctor<GPUDevice, double>;
#endif  // GOOGLE_CUDA

}  // namespace functor

namespace {

// The large outputs (the saved logits, the weight-gradient rows) are ReusableOutputs on
// the CPU, where a fresh buffer of that size costs page faults in every step. The GPU
// allocator keeps freed memory in its own pool, so there they are allocated as usual.
template <typename Device>
Status AllocateLarge(OpKernelContext* ctx, ReusableOutput* reusable, int index,
                     const TensorShape& shape, Tensor** out) {
  if (std::is_same<Device, CPUDevice>::value) return reusable->Allocate(ctx, index, shape, out);
  return ctx->allocate_output(index, shape, out);
}

// Reads and checks the inputs both ops share and builds the visit plan.
template <typename T>
Status PrepareLogProb(OpKernelContext* ctx, PlanFor use, Padding padding, SoftmaxInputs* in,
                      SoftmaxParams<T>* params, TreeView* tree, VisitPlan* plan) {
  TF_RETURN_IF_ERROR(ReadSoftmaxInputs(ctx, in));
  TF_RETURN_IF_ERROR(ReadTree(ctx, 4, -1, in->weights->dim_size(0), tree));
  std::vector<int64> targets;
  TF_RETURN_IF_ERROR(ReadClassIds(ctx->input(3), "targets", BatchShape(*in->hidden), &targets));
  const std::string problem =
      BuildVisitPlan(*tree, targets.data(), in->num_tokens, plan, use, padding);
  if (!problem.empty()) return errors::InvalidArgument(problem);
  *params = ParamsOf<T>(*in);
  return Status();
}

// Hsm>LogProb, or with kSaving Hsm>LogProbSavingLogits (the grouped nodes' logits and the
// tokens' directions as second and third outputs, for the gradient op).
template <typename Device, typename T, bool kSaving>
class LogProbOp : public OpKernel {
 public:
  explicit LogProbOp(OpKernelConstruction* ctx) : OpKernel(ctx), padding_(PaddingOf(ctx)) {
    if (kSaving) OP_REQUIRES_OK(ctx, ctx->GetAttr("max_saved_logits", &max_saved_));
  }

  void Compute(OpKernelContext* ctx) override {
    SoftmaxInputs in;
    SoftmaxParams<T> params;
    TreeView tree;
    const PlanPool::Lease lease = plans_.Acquire();
    const VisitPlan& plan = *lease;
    OP_REQUIRES_OK(ctx, PrepareLogProb(ctx, Functor::kPlanFor, padding_, &in, &params, &tree,
                                       lease.get()));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, BatchShape(*in.hidden), &out));
    functor::LogProbOutputs<T> outputs;
    outputs.log_prob = out->flat<T>().data();
    if (kSaving) {
      const int64 total = SavedLogitsSize(plan, tree);
      const bool keep = total <= (max_saved_ < 0 ? CoefficientBudget(plan, in.dim) : max_saved_);
      Tensor *saved_out = nullptr, *directions_out = nullptr;
      OP_REQUIRES_OK(ctx, AllocateLarge<Device>(ctx, &saved_logits_, 1,
                                                TensorShape({keep ? total : 0}), &saved_out));
      OP_REQUIRES_OK(ctx, ctx->allocate_output(
                              2, keep ? in.hidden->shape() : TensorShape({0}), &directions_out));
      if (keep) {
        outputs.saved_logits = saved_out->flat<T>().data();
        outputs.saved_directions = directions_out->flat<T>().data();
      }
    }
    OP_REQUIRES_OK(ctx, functor_(ctx, plan, tree, params, outputs));
  }

 private:
  using Functor = functor::LogProbFunctor<Device, T>;
  Functor functor_;
  PlanPool plans_;
  ReusableOutput saved_logits_;
  int64_t max_saved_ = 0;
  const Padding padding_;
};

// Hsm>LogProbGrad; with kWithLogProb Hsm>LogProbAndGrad (log_prob first, from the
// backward's own logsumexps, then the same gradient outputs); with kFromSaved
// Hsm>LogProbGradFromLogits (inputs 9 and 10: the forward's saved logits and directions,
// or none).
template <typename Device, typename T, bool kWithLogProb, bool kFromSaved = false>
class LogProbGradOp : public OpKernel {
 public:
  explicit LogProbGradOp(OpKernelConstruction* ctx) : OpKernel(ctx), padding_(PaddingOf(ctx)) {}

  void Compute(OpKernelContext* ctx) override {
    SoftmaxInputs in;
    SoftmaxParams<T> params;
    TreeView tree;
    const PlanPool::Lease lease = plans_.Acquire();
    const VisitPlan& plan = *lease;
    OP_REQUIRES_OK(ctx, PrepareLogProb(ctx, PlanFor::kBackward, padding_, &in, &params, &tree,
                                       lease.get()));
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
      // A batch of padding alone (skip_padding) has no logits to keep: its forward's
      // directions (all zero) are then not needed either.
      const bool none = saved.NumElements() == 0 && (directions.NumElements() == 0 || expected == 0);
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
    OP_REQUIRES_OK(ctx, AllocateLarge<Device>(ctx, &weight_rows_, first + 1,
                                              TensorShape({rows, in.dim}), &weight_rows));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(first + 2, TensorShape({in.has_bias ? rows : 0}), &bias_rows));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(first + 3, TensorShape({rows}), &row_ids));
    grads.hidden = hidden_grad->flat<T>().data();
    grads.weight_rows = weight_rows->flat<T>().data();
    grads.bias_rows = in.has_bias ? bias_rows->flat<T>().data() : nullptr;
    grads.row_ids = row_ids->flat<int64_t>().data();
    OP_REQUIRES_OK(ctx, functor_(ctx, plan, tree, params, upstream.flat<T>().data(), grads));
  }

 private:
  functor::LogProbGradFunctor<Device, T> functor_;
  PlanPool plans_;
  ReusableOutput weight_rows_;
  const Padding padding_;
};

#define REGISTER_CPU(T)                                                                   \
  REGISTER_KERNEL_BUILDER(Name("Hsm>LogProb").Device(DEVICE_CPU).TypeConstraint<T>("T"),  \
                          (LogProbOp<CPUDevice, T, false>));                              \
  REGISTER_KERNEL_BUILDER(                                                                \
      Name("Hsm>LogProbSavingLogits").Device(DEVICE_CPU).TypeConstraint<T>("T"),          \
      (LogProbOp<CPUDevice, T, true>));                                                   \
  REGISTER_KERNEL_BUILDER(Name("Hsm>LogProbGrad").Device(DEVICE_CPU).TypeConstraint<T>("T"), \
                          (LogProbGradOp<CPUDevice, T, false>));                          \
  REGISTER_KERNEL_BUILDER(                                                                \
      Name("Hsm>LogProbGradFromLogits").Device(DEVICE_CPU).TypeConstraint<T>("T"),        \
      (LogProbGradOp<CPUDevice, T, false, true>));                                        \
  REGISTER_KERNEL_BUILDER(                                                                \
      Name("Hsm>LogProbAndGrad").Device(DEVICE_CPU).TypeConstraint<T>("T"),               \
      (LogProbGradOp<CPUDevice, T, true>));
REGISTER_CPU(float)
REGISTER_CPU(double)
#undef REGISTER_CPU

#if GOOGLE_CUDA
#define TF_HSM_HOST_TREE_INPUTS(builder) \
  builder.HostMemory("targets")          \
      .HostMemory("child_begin")         \
      .HostMemory("path_begin")          \
      .HostMemory("path_nodes")          \
      .HostMemory("path_slots")
#define REGISTER_GPU(T)                                                                   \
  REGISTER_KERNEL_BUILDER(                                                                \
      TF_HSM_HOST_TREE_INPUTS(Name("Hsm>LogProb").Device(DEVICE_GPU).TypeConstraint<T>("T")), \
      (LogProbOp<GPUDevice, T, false>));                                                  \
  REGISTER_KERNEL_BUILDER(TF_HSM_HOST_TREE_INPUTS(                                        \
                              Name("Hsm>LogProbGrad").Device(DEVICE_GPU).TypeConstraint<T>("T")), \
                          (LogProbGradOp<GPUDevice, T, false>));
REGISTER_GPU(float)
REGISTER_GPU(double)
#undef REGISTER_GPU
#undef TF_HSM_HOST_TREE_INPUTS
#endif  // GOOGLE_CUDA

}  // namespace
}  // namespace tf_hsm
