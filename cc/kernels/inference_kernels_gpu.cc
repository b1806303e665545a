// The GPU functors of the inference ops (inference_kernels.h): LogProbCandidatesGpu of
// cc/core/log_prob_gpu.h, LogProbAllGpu, SampleGpu and TopKGpu of cc/core/inference_gpu.h,
// each prepared on the host, then run on the op's stream in a workspace allocated here.
//
// Only the GPU build of the op library compiles this file with GOOGLE_CUDA (see
// log_prob_kernels_gpu.cc); in the CPU build it is an empty translation unit.
#if GOOGLE_CUDA
#define EIGEN_USE_GPU

#include <algorithm>
#include <cstdint>
#include <string>

#include "cc/core/inference_gpu.h"
#include "cc/core/log_prob.h"
#include "cc/core/log_prob_gpu.h"
#include "cc/core/visit_plan.h"
#include "cc/kernels/hsm_inputs.h"
#include "cc/kernels/inference_kernels.h"
#include "cc/kernels/tf_names.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"
#include "unsupported/Eigen/CXX11/Tensor"

namespace tf_hsm {
namespace functor {

namespace {

// A Prepare*Gpu's message: the inference cores validate the whole tree there.
Status FromPrepare(const std::string& err) {
  return err.empty() ? Status() : errors::InvalidArgument(err);
}

// A *Gpu call's message, named after the op.
Status FromRun(OpKernelContext* ctx, const std::string& err) {
  return err.empty() ? Status()
                     : errors::Internal(ctx->op_kernel().type_string(), " on GPU: ", err);
}

Status WorkspaceFor(OpKernelContext* ctx, const GpuInferencePlan& plan, Tensor* workspace) {
  return ctx->allocate_temp(DT_INT8, TensorShape({std::max<int64>(plan.workspace_bytes, 16)}),
                            workspace);
}

GpuStream StreamOf(OpKernelContext* ctx) { return ctx->eigen_gpu_device().stream(); }

}  // namespace

template <typename T>
Status TopKFunctor<GPUDevice, T>::operator()(OpKernelContext* ctx, const TreeView& tree,
                                             const SoftmaxParams<T>& params, int64 num_rows,
                                             int64 k, T* log_probs, int64* classes,
                                             int64* num_expanded) {
  GpuInferencePlan plan;
  TF_RETURN_IF_ERROR(FromPrepare(PrepareTopKGpu<T>(tree, num_rows, params.dim,
                                                   params.biases != nullptr, k,
                                                   kDefaultGpuInferenceBudget, &plan)));
  if (num_rows == 0) return Status();
  Tensor workspace;
  TF_RETURN_IF_ERROR(WorkspaceFor(ctx, plan, &workspace));
  return FromRun(ctx, TopKGpu<T>(plan, params, log_probs, classes, num_expanded,
                                 workspace.flat<int8_t>().data(), StreamOf(ctx)));
}

template <typename T>
Status LogProbAllFunctor<GPUDevice, T>::operator()(OpKernelContext* ctx, const TreeView& tree,
                                                   const SoftmaxParams<T>& params,
                                                   int64 num_rows, int64 class_begin,
                                                   int64 class_end, T* out) {
  GpuInferencePlan plan;
  TF_RETURN_IF_ERROR(FromPrepare(PrepareLogProbAllGpu<T>(tree, num_rows, params.dim,
                                                         params.biases != nullptr, class_begin,
                                                         class_end, kDefaultGpuInferenceBudget,
                                                         &plan)));
  if (num_rows * (class_end - class_begin) == 0) return Status();
  Tensor workspace;
  TF_RETURN_IF_ERROR(WorkspaceFor(ctx, plan, &workspace));
  return FromRun(ctx, LogProbAllGpu<T>(plan, params, out, workspace.flat<int8_t>().data(),
                                       StreamOf(ctx)));
}

template <typename T>
Status SampleFunctor<GPUDevice, T>::operator()(OpKernelContext* ctx, const TreeView& tree,
                                               const SoftmaxParams<T>& params, int64 num_rows,
                                               std::uint64_t seed, T temperature,
                                               int64* classes) {
  GpuInferencePlan plan;
  TF_RETURN_IF_ERROR(FromPrepare(
      PrepareSampleGpu<T>(tree, num_rows, params.dim, params.biases != nullptr, &plan)));
  if (num_rows == 0) return Status();
  Tensor workspace;
  TF_RETURN_IF_ERROR(WorkspaceFor(ctx, plan, &workspace));
  return FromRun(ctx, SampleGpu<T>(plan, params, seed, temperature, classes,
                                   workspace.flat<int8_t>().data(), StreamOf(ctx)));
}

// Candidates go through the log_prob core's visit plan, candidate (i, m) as token
// i * num_candidates + m.
template <typename T>
Status LogProbCandidatesFunctor<GPUDevice, T>::operator()(OpKernelContext* ctx,
                                                          const TreeView& tree,
                                                          const SoftmaxParams<T>& params,
                                                          int64 num_rows,
                                                          const int64* candidates,
                                                          int64 num_candidates, T* out) {
  VisitPlan plan;
  const std::string problem = BuildVisitPlan(tree, candidates, num_rows * num_candidates, &plan);
  if (!problem.empty()) return errors::InvalidArgument(problem);
  GpuLogProbPlan gpu_plan;
  const std::string err = PrepareLogProbCandidatesGpu<T>(
      plan, tree, params.dim, params.biases != nullptr, num_candidates, &gpu_plan);
  if (!err.empty()) return errors::Internal(err);
  Tensor workspace;
  TF_RETURN_IF_ERROR(ctx->allocate_temp(
      DT_INT8, TensorShape({std::max<int64>(gpu_plan.workspace_bytes, 1)}), &workspace));
  return FromRun(ctx, LogProbCandidatesGpu<T>(gpu_plan, params, out,
                                              workspace.flat<int8_t>().data(), StreamOf(ctx)));
}

#define TF_HSM_INSTANTIATE_GPU(T)                     \
  template struct TopKFunctor<GPUDevice, T>;          \
  template struct LogProbAllFunctor<GPUDevice, T>;    \
  template struct SampleFunctor<GPUDevice, T>;        \
  template struct LogProbCandidatesFunctor<GPUDevice, T>;
TF_HSM_INSTANTIATE_GPU(float)
TF_HSM_INSTANTIATE_GPU(double)
#undef TF_HSM_INSTANTIATE_GPU

}  // namespace functor
}  // namespace tf_hsm

#endif  // GOOGLE_CUDA
