// The GPU functors of the Hsm>LogProb family (log_prob_kernels.h): the CUDA core
// (cc/core/log_prob_gpu.h) turns the kernel's visit plan into work lists on the host, then
// runs on the op's stream in a workspace allocated here.
//
// Only the GPU build of the op library compiles this file with GOOGLE_CUDA (cc/BUILD
// target //cc:_hsm_ops_gpu.so, built by ./configure.sh with TF_HSM_CUDA=1); in the CPU
// build it is an empty translation unit.
#if GOOGLE_CUDA
#define EIGEN_USE_GPU

#include <algorithm>
#include <string>

#include "cc/core/log_prob.h"
#include "cc/core/log_prob_gpu.h"
#include "cc/core/visit_plan.h"
#include "cc/kernels/hsm_inputs.h"
#include "cc/kernels/log_prob_kernels.h"
#include "cc/kernels/tf_names.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"
#include "unsupported/Eigen/CXX11/Tensor"

namespace tf_hsm {
namespace functor {

namespace {

// The work lists of a forward or backward call and the workspace they need.
template <typename T>
Status PrepareGpu(OpKernelContext* ctx, const VisitPlan& plan, const TreeView& tree,
                  const SoftmaxParams<T>& params, bool backward, GpuLogProbPlan* gpu_plan,
                  Tensor* workspace) {
  const std::string err = PrepareLogProbGpu<T>(plan, tree, params.dim, params.biases != nullptr,
                                               backward, kDefaultGpuCoefBudget, gpu_plan);
  if (!err.empty()) return errors::Internal(err);
  return ctx->allocate_temp(DT_INT8, TensorShape({std::max<int64>(gpu_plan->workspace_bytes, 1)}),
                            workspace);
}

GpuStream StreamOf(OpKernelContext* ctx) { return ctx->eigen_gpu_device().stream(); }

}  // namespace

template <typename T>
Status LogProbFunctor<GPUDevice, T>::operator()(OpKernelContext* ctx, const VisitPlan& plan,
                                                const TreeView& tree,
                                                const SoftmaxParams<T>& params,
                                                const LogProbOutputs<T>& out) {
  if (out.saved_logits != nullptr) {
    return errors::Unimplemented("the GPU forward does not save logits");
  }
  GpuLogProbPlan gpu_plan;
  Tensor workspace;
  TF_RETURN_IF_ERROR(PrepareGpu(ctx, plan, tree, params, false, &gpu_plan, &workspace));
  const std::string err = LogProbForwardGpu<T>(gpu_plan, params, out.log_prob,
                                               workspace.flat<int8_t>().data(), StreamOf(ctx));
  if (!err.empty()) return errors::Internal(ctx->op_kernel().type_string(), " on GPU: ", err);
  return Status();
}

template <typename T>
Status LogProbGradFunctor<GPUDevice, T>::operator()(OpKernelContext* ctx, const VisitPlan& plan,
                                                    const TreeView& tree,
                                                    const SoftmaxParams<T>& params,
                                                    const T* upstream,
                                                    const LogProbGrads<T>& grads) {
  if (grads.saved_logits != nullptr || grads.log_prob_from_backward != nullptr) {
    return errors::Unimplemented(
        "the GPU backward neither reads saved logits nor writes log_prob");
  }
  GpuLogProbPlan gpu_plan;
  Tensor workspace;
  TF_RETURN_IF_ERROR(PrepareGpu(ctx, plan, tree, params, true, &gpu_plan, &workspace));
  const std::string err = LogProbBackwardGpu<T>(gpu_plan, params, upstream, grads,
                                                workspace.flat<int8_t>().data(), StreamOf(ctx));
  if (!err.empty()) return errors::Internal(ctx->op_kernel().type_string(), " on GPU: ", err);
  return Status();
}

template struct LogProbFunctor<GPUDevice, float>;
template struct LogProbFunctor<GPUDevice, double>;
template struct LogProbGradFunctor<GPUDevice, float>;
template struct LogProbGradFunctor<GPUDevice, double>;

}  // namespace functor
}  // namespace tf_hsm

#endif  // GOOGLE_CUDA
