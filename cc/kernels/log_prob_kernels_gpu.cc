// GPU OpKernels for Hsm>LogProb and Hsm>LogProbGrad: the CPU kernels' validation and
// visit plan on the host, then the CUDA core (cc/core/log_prob_gpu.h) on the op's stream.
//
// Only the GPU build of the op library compiles this file with GOOGLE_CUDA (cc/BUILD
// target //cc:_hsm_ops_gpu.so, built by ./configure.sh with TF_HSM_CUDA=1); in the CPU
// build it is an empty translation unit.
//
// The targets and the four tree tensors are HostMemory inputs: the visit plan (which
// tokens share which node) is built on the host from them, as on the CPU, and uploaded
// with the work lists in one asynchronous copy. hidden, weights, biases, upstream and all
// outputs stay on the GPU. TensorFlow copies targets produced on the GPU to the host
// before the op runs; the tree tensors are constants and stay on the host.
#if GOOGLE_CUDA
#define EIGEN_USE_GPU

#include <algorithm>
#include <string>
#include <vector>

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

// Validates the inputs both ops share, builds the visit plan on the host and the GPU work
// lists, and allocates the workspace they need.
template <typename T>
Status PrepareGpuLogProb(OpKernelContext* ctx, bool backward, SoftmaxInputs* in,
                         SoftmaxParams<T>* params, VisitPlan* plan, GpuLogProbPlan* gpu_plan,
                         Tensor* workspace) {
  TF_RETURN_IF_ERROR(ReadSoftmaxInputs(ctx, in));
  TreeView tree;
  TF_RETURN_IF_ERROR(ReadTree(ctx, 4, -1, in->weights->dim_size(0), &tree));
  std::vector<int64> targets;
  TF_RETURN_IF_ERROR(ReadClassIds(ctx->input(3), "targets", BatchShape(*in->hidden), &targets));
  const std::string problem = BuildVisitPlan(tree, targets.data(), in->num_tokens, plan);
  if (!problem.empty()) return errors::InvalidArgument(problem);
  const std::string err = PrepareLogProbGpu<T>(*plan, tree, in->dim, in->has_bias, backward,
                                               kDefaultGpuCoefBudget, gpu_plan);
  if (!err.empty()) return errors::Internal(err);
  params->hidden = in->hidden->flat<T>().data();
  params->weights = in->weights->flat<T>().data();
  params->biases = in->has_bias ? in->biases->flat<T>().data() : nullptr;
  params->dim = in->dim;
  return ctx->allocate_temp(DT_INT8, TensorShape({std::max<int64>(gpu_plan->workspace_bytes, 1)}),
                            workspace);
}

GpuStream StreamOf(OpKernelContext* ctx) { return ctx->eigen_gpu_device().stream(); }

template <typename T>
class LogProbGpuOp : public OpKernel {
 public:
  explicit LogProbGpuOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    SoftmaxInputs in;
    SoftmaxParams<T> params;
    VisitPlan plan;
    GpuLogProbPlan gpu_plan;
    Tensor workspace;
    OP_REQUIRES_OK(ctx, PrepareGpuLogProb(ctx, false, &in, &params, &plan, &gpu_plan, &workspace));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, BatchShape(*in.hidden), &out));
    const std::string err = LogProbForwardGpu<T>(gpu_plan, params, out->flat<T>().data(),
                                                 workspace.flat<int8_t>().data(), StreamOf(ctx));
    OP_REQUIRES(ctx, err.empty(), errors::Internal("Hsm>LogProb on GPU: ", err));
  }
};

template <typename T>
class LogProbGradGpuOp : public OpKernel {
 public:
  explicit LogProbGradGpuOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    SoftmaxInputs in;
    SoftmaxParams<T> params;
    VisitPlan plan;
    GpuLogProbPlan gpu_plan;
    Tensor workspace;
    OP_REQUIRES_OK(ctx, PrepareGpuLogProb(ctx, true, &in, &params, &plan, &gpu_plan, &workspace));
    const Tensor& upstream = ctx->input(8);
    OP_REQUIRES(ctx, upstream.shape() == BatchShape(*in.hidden),
                errors::InvalidArgument("upstream gradient must have shape ",
                                        BatchShape(*in.hidden).DebugString(), ", got ",
                                        upstream.shape().DebugString()));
    const int64 rows = plan.num_rows();
    Tensor *hidden_grad, *weight_rows, *bias_rows, *row_ids;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, in.hidden->shape(), &hidden_grad));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({rows, in.dim}), &weight_rows));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, TensorShape({in.has_bias ? rows : 0}), &bias_rows));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(3, TensorShape({rows}), &row_ids));
    LogProbGrads<T> grads;
    grads.hidden = hidden_grad->flat<T>().data();
    grads.weight_rows = weight_rows->flat<T>().data();
    grads.bias_rows = in.has_bias ? bias_rows->flat<T>().data() : nullptr;
    grads.row_ids = row_ids->flat<int64_t>().data();
    const std::string err =
        LogProbBackwardGpu<T>(gpu_plan, params, upstream.flat<T>().data(), grads,
                              workspace.flat<int8_t>().data(), StreamOf(ctx));
    OP_REQUIRES(ctx, err.empty(), errors::Internal("Hsm>LogProbGrad on GPU: ", err));
  }
};

#define TF_HSM_HOST_TREE_INPUTS(builder)                                               \
  builder.HostMemory("targets")                                                        \
      .HostMemory("child_begin")                                                       \
      .HostMemory("path_begin")                                                        \
      .HostMemory("path_nodes")                                                        \
      .HostMemory("path_slots")
#define REGISTER_GPU(T)                                                                \
  REGISTER_KERNEL_BUILDER(                                                             \
      TF_HSM_HOST_TREE_INPUTS(Name("Hsm>LogProb").Device(DEVICE_GPU).TypeConstraint<T>("T")), \
      LogProbGpuOp<T>);                                                                \
  REGISTER_KERNEL_BUILDER(TF_HSM_HOST_TREE_INPUTS(                                     \
                              Name("Hsm>LogProbGrad").Device(DEVICE_GPU).TypeConstraint<T>("T")), \
                          LogProbGradGpuOp<T>);
REGISTER_GPU(float)
REGISTER_GPU(double)
#undef REGISTER_GPU
#undef TF_HSM_HOST_TREE_INPUTS

}  // namespace
}  // namespace tf_hsm

#endif  // GOOGLE_CUDA
