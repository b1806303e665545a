// The device halves of the Hsm>LogProb family's kernels (log_prob_kernels.cc). The kernels
// validate their inputs, build the visit plan and allocate their outputs the same way on
// every device; a functor per device then runs the core on them: the CPU core
// (cc/core/log_prob.h) on the op's thread pool, or the CUDA core (cc/core/log_prob_gpu.h)
// on the op's stream. A functor is a member of its kernel, so what it reuses across calls
// (the CPU backward's coefficient stores) lives as long as the kernel.
//
// The CPU functors are defined in log_prob_kernels.cc. The GPU functors exist only in the
// GPU build (GOOGLE_CUDA): declared here, defined in log_prob_kernels_gpu.cc.
#ifndef TF_HSM_CC_KERNELS_LOG_PROB_KERNELS_H_
#define TF_HSM_CC_KERNELS_LOG_PROB_KERNELS_H_

#include "cc/core/log_prob.h"
#include "cc/core/tree_view.h"
#include "cc/core/visit_plan.h"
#include "cc/kernels/hsm_inputs.h"
#include "tensorflow/core/framework/op_kernel.h"

namespace tf_hsm {
namespace functor {

// Where a forward writes: log_prob[num_tokens], and with saved_logits (nullptr: none) the
// grouped nodes' logits and the tokens' directions for the gradient op.
template <typename T>
struct LogProbOutputs {
  T* log_prob = nullptr;
  T* saved_logits = nullptr;
  T* saved_directions = nullptr;
};

// Each functor names kPlanFor, the PlanFor its device's forward needs the visit plan
// built for (the backward always takes PlanFor::kBackward), and is called as
//   LogProbFunctor:     Status (ctx, plan, tree, params, const LogProbOutputs<T>&)
//   LogProbGradFunctor: Status (ctx, plan, tree, params, upstream, LogProbGrads<T> grads)
template <typename Device, typename T>
struct LogProbFunctor;
template <typename Device, typename T>
struct LogProbGradFunctor;

#if GOOGLE_CUDA
// The GPU forward computes log_prob only (Hsm>LogProbSavingLogits has no GPU kernel). Its
// kernels reach every visited node through the plan's groups, walked nodes included.
template <typename T>
struct LogProbFunctor<GPUDevice, T> {
  static constexpr PlanFor kPlanFor = PlanFor::kBackward;
  ::tensorflow::Status operator()(::tensorflow::OpKernelContext* ctx, const VisitPlan& plan,
                                  const TreeView& tree, const SoftmaxParams<T>& params,
                                  const LogProbOutputs<T>& out);
};

// The GPU backward computes the sparse gradient only: no saved logits in, no log_prob out
// (Hsm>LogProbGradFromLogits and Hsm>LogProbAndGrad have no GPU kernels).
template <typename T>
struct LogProbGradFunctor<GPUDevice, T> {
  ::tensorflow::Status operator()(::tensorflow::OpKernelContext* ctx, const VisitPlan& plan,
                                  const TreeView& tree, const SoftmaxParams<T>& params,
                                  const T* upstream, const LogProbGrads<T>& grads);
};
#endif  // GOOGLE_CUDA

}  // namespace functor
}  // namespace tf_hsm

#endif  // TF_HSM_CC_KERNELS_LOG_PROB_KERNELS_H_
