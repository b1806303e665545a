// GPU OpKernels for Hsm>LogProbCandidates, Hsm>LogProbAll, Hsm>Sample and Hsm>TopK: the CPU
// kernels' validation on the host, then the CUDA core (LogProbCandidatesGpu in
// cc/core/log_prob_gpu.h; LogProbAllGpu, SampleGpu and TopKGpu in cc/core/inference_gpu.h)
// on the op's stream. The GPU TopK evaluates every class and selects the top k (same
// output order as the CPU's best-first search; num_expanded is then the number of
// internal nodes); see inference_gpu.h.
//
// Only the GPU build of the op library compiles this file with GOOGLE_CUDA (see
// log_prob_kernels_gpu.cc); in the CPU build it is an empty translation unit. The
// candidates, the tree tensors and the small scalar inputs (class_range, seed,
// temperature) are HostMemory inputs, as for Hsm>LogProb.
#if GOOGLE_CUDA
#define EIGEN_USE_GPU

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "cc/core/inference_gpu.h"
#include "cc/core/log_prob.h"
#include "cc/core/log_prob_gpu.h"
#include "cc/core/visit_plan.h"
#include "cc/kernels/hsm_inputs.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/register_types.h"
#include "tensorflow/core/framework/tensor.h"
#include "unsupported/Eigen/CXX11/Tensor"

namespace tf_hsm {

using ::tensorflow::DEVICE_GPU;
using ::tensorflow::DT_INT8;
using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Status;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShape;
namespace errors = ::tensorflow::errors;

namespace {

template <typename T>
class LogProbCandidatesGpuOp : public OpKernel {
 public:
  explicit LogProbCandidatesGpuOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    SoftmaxInputs in;
    SoftmaxParams<T> params;
    TreeView tree;
    OP_REQUIRES_OK(ctx, ReadInference(ctx, 4, false, &in, &params, &tree));
    const Tensor& candidates = ctx->input(3);
    std::vector<int64> ids;
    int64 num_candidates;
    OP_REQUIRES_OK(ctx, ReadCandidates(candidates, BatchShape(*in.hidden), tree, &ids,
                                       &num_candidates));
    VisitPlan plan;
    const std::string problem =
        BuildVisitPlan(tree, ids.data(), static_cast<int64>(ids.size()), &plan);
    OP_REQUIRES(ctx, problem.empty(), errors::InvalidArgument(problem));
    GpuLogProbPlan gpu_plan;
    std::string err = PrepareLogProbCandidatesGpu<T>(plan, tree, in.dim, in.has_bias,
                                                     num_candidates, &gpu_plan);
    OP_REQUIRES(ctx, err.empty(), errors::Internal(err));
    Tensor workspace;
    OP_REQUIRES_OK(ctx, ctx->allocate_temp(
                            DT_INT8, TensorShape({std::max<int64>(gpu_plan.workspace_bytes, 1)}),
                            &workspace));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, candidates.shape(), &out));
    err = LogProbCandidatesGpu<T>(gpu_plan, params, out->flat<T>().data(),
                                  workspace.flat<int8_t>().data(),
                                  ctx->eigen_gpu_device().stream());
    OP_REQUIRES(ctx, err.empty(), errors::Internal("Hsm>LogProbCandidates on GPU: ", err));
  }
};

Status WorkspaceFor(OpKernelContext* ctx, const GpuInferencePlan& plan, Tensor* workspace) {
  return ctx->allocate_temp(DT_INT8, TensorShape({std::max<int64>(plan.workspace_bytes, 16)}),
                            workspace);
}

template <typename T>
class TopKGpuOp : public OpKernel {
 public:
  explicit TopKGpuOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("k", &k_));
  }

  void Compute(OpKernelContext* ctx) override {
    SoftmaxInputs in;
    SoftmaxParams<T> params;
    TreeView tree;
    OP_REQUIRES_OK(ctx, ReadInference(ctx, 3, true, &in, &params, &tree));
    OP_REQUIRES_OK(ctx, CheckTopK(k_, tree));
    GpuInferencePlan plan;
    std::string err = PrepareTopKGpu<T>(tree, in.num_tokens, in.dim, in.has_bias, k_,
                                        kDefaultGpuInferenceBudget, &plan);
    OP_REQUIRES(ctx, err.empty(), errors::InvalidArgument(err));
    const TensorShape batch = BatchShape(*in.hidden);
    TensorShape out_shape = batch;
    out_shape.AddDim(k_);
    Tensor *log_probs, *classes, *expanded;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, out_shape, &log_probs));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, out_shape, &classes));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, batch, &expanded));
    if (in.num_tokens == 0) return;
    Tensor workspace;
    OP_REQUIRES_OK(ctx, WorkspaceFor(ctx, plan, &workspace));
    err = TopKGpu<T>(plan, params, log_probs->flat<T>().data(), classes->flat<int64_t>().data(),
                     expanded->flat<int64_t>().data(), workspace.flat<int8_t>().data(),
                     ctx->eigen_gpu_device().stream());
    OP_REQUIRES(ctx, err.empty(), errors::Internal("Hsm>TopK on GPU: ", err));
  }

 private:
  int64_t k_ = 0;
};

template <typename T>
class LogProbAllGpuOp : public OpKernel {
 public:
  explicit LogProbAllGpuOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    SoftmaxInputs in;
    SoftmaxParams<T> params;
    TreeView tree;
    OP_REQUIRES_OK(ctx, ReadInference(ctx, 4, true, &in, &params, &tree));
    int64 begin, end;
    OP_REQUIRES_OK(ctx, ReadClassRange(ctx->input(3), tree, &begin, &end));
    GpuInferencePlan plan;
    std::string err = PrepareLogProbAllGpu<T>(tree, in.num_tokens, in.dim, in.has_bias, begin,
                                              end, kDefaultGpuInferenceBudget, &plan);
    OP_REQUIRES(ctx, err.empty(), errors::InvalidArgument(err));
    TensorShape out_shape = BatchShape(*in.hidden);
    out_shape.AddDim(end - begin);
    Tensor* out;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, out_shape, &out));
    if (out->NumElements() == 0) return;
    Tensor workspace;
    OP_REQUIRES_OK(ctx, WorkspaceFor(ctx, plan, &workspace));
    err = LogProbAllGpu<T>(plan, params, out->flat<T>().data(), workspace.flat<int8_t>().data(),
                           ctx->eigen_gpu_device().stream());
    OP_REQUIRES(ctx, err.empty(), errors::Internal("Hsm>LogProbAll on GPU: ", err));
  }
};

template <typename T>
class SampleGpuOp : public OpKernel {
 public:
  explicit SampleGpuOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    SoftmaxInputs in;
    SoftmaxParams<T> params;
    TreeView tree;
    OP_REQUIRES_OK(ctx, ReadInference(ctx, 5, true, &in, &params, &tree));
    std::uint64_t seed;
    T temp;
    OP_REQUIRES_OK(ctx, ReadSampleArgs(ctx->input(3), ctx->input(4), &seed, &temp));
    GpuInferencePlan plan;
    std::string err = PrepareSampleGpu<T>(tree, in.num_tokens, in.dim, in.has_bias, &plan);
    OP_REQUIRES(ctx, err.empty(), errors::InvalidArgument(err));
    Tensor* classes;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, BatchShape(*in.hidden), &classes));
    if (in.num_tokens == 0) return;
    Tensor workspace;
    OP_REQUIRES_OK(ctx, WorkspaceFor(ctx, plan, &workspace));
    err = SampleGpu<T>(plan, params, seed, temp,
                       classes->flat<int64_t>().data(), workspace.flat<int8_t>().data(),
                       ctx->eigen_gpu_device().stream());
    OP_REQUIRES(ctx, err.empty(), errors::Internal("Hsm>Sample on GPU: ", err));
  }
};

#define TF_HSM_TREE_HOST_MEMORY    \
  HostMemory("child_begin")        \
      .HostMemory("path_begin")    \
      .HostMemory("path_nodes")    \
      .HostMemory("path_slots")    \
      .HostMemory("slot_child")

#define REGISTER_GPU(T)                                                                   \
  REGISTER_KERNEL_BUILDER(Name("Hsm>LogProbCandidates")                                   \
                              .Device(DEVICE_GPU)                                         \
                              .TypeConstraint<T>("T")                                     \
                              .HostMemory("candidates")                                   \
                              .HostMemory("child_begin")                                  \
                              .HostMemory("path_begin")                                   \
                              .HostMemory("path_nodes")                                   \
                              .HostMemory("path_slots"),                                  \
                          LogProbCandidatesGpuOp<T>);                               \
  REGISTER_KERNEL_BUILDER(                                                                \
      Name("Hsm>TopK").Device(DEVICE_GPU).TypeConstraint<T>("T").TF_HSM_TREE_HOST_MEMORY, \
      TopKGpuOp<T>);                                                                      \
  REGISTER_KERNEL_BUILDER(Name("Hsm>LogProbAll")                                          \
                              .Device(DEVICE_GPU)                                         \
                              .TypeConstraint<T>("T")                                     \
                              .HostMemory("class_range")                                  \
                              .TF_HSM_TREE_HOST_MEMORY,                                   \
                          LogProbAllGpuOp<T>);                                            \
  REGISTER_KERNEL_BUILDER(Name("Hsm>Sample")                                              \
                              .Device(DEVICE_GPU)                                         \
                              .TypeConstraint<T>("T")                                     \
                              .HostMemory("seed")                                         \
                              .HostMemory("temperature")                                  \
                              .TF_HSM_TREE_HOST_MEMORY,                                   \
                          SampleGpuOp<T>);
REGISTER_GPU(float)
REGISTER_GPU(double)
#undef REGISTER_GPU
#undef TF_HSM_TREE_HOST_MEMORY

}  // namespace
}  // namespace tf_hsm

#endif  // GOOGLE_CUDA
