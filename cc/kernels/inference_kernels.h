// The device halves of the inference ops' kernels (inference_kernels.cc): Hsm>TopK,
// Hsm>LogProbAll, Hsm>Sample and Hsm>LogProbCandidates validate their inputs and allocate
// their outputs the same way on every device; a functor per device then runs the core on
// them: the CPU core (cc/core/inference.h) on the op's thread pool, or the CUDA core
// (cc/core/inference_gpu.h, cc/core/log_prob_gpu.h) on the op's stream. A functor is a
// member of its kernel, so what it reuses across calls (the CPU LogProbAll's sweep plan)
// lives as long as the kernel.
//
// The CPU functors are defined in inference_kernels.cc. The GPU functors exist only in the
// GPU build (GOOGLE_CUDA): declared here, defined in inference_kernels_gpu.cc.
//
// The calls, each returning a Status (rows: the tokens, hidden's leading dimensions):
//   TopKFunctor:              (ctx, tree, params, rows, k, log_probs, classes, num_expanded)
//   LogProbAllFunctor:        (ctx, tree, params, rows, class_begin, class_end, out)
//   SampleFunctor:            (ctx, tree, params, rows, seed, temperature, classes)
//   LogProbCandidatesFunctor: (ctx, tree, params, rows, candidates, num_candidates, out)
#ifndef TF_HSM_CC_KERNELS_INFERENCE_KERNELS_H_
#define TF_HSM_CC_KERNELS_INFERENCE_KERNELS_H_

#include <cstdint>

#include "cc/core/log_prob.h"
#include "cc/core/tree_view.h"
#include "cc/kernels/hsm_inputs.h"
#include "tensorflow/core/framework/op_kernel.h"

namespace tf_hsm {
namespace functor {

template <typename Device, typename T>
struct TopKFunctor;
template <typename Device, typename T>
struct LogProbAllFunctor;
template <typename Device, typename T>
struct SampleFunctor;
template <typename Device, typename T>
struct LogProbCandidatesFunctor;

#if GOOGLE_CUDA
// The GPU TopK evaluates every class and selects the top k (the CPU's output order;
// num_expanded is then the number of internal nodes); see cc/core/inference_gpu.h.
template <typename T>
struct TopKFunctor<GPUDevice, T> {
  ::tensorflow::Status operator()(::tensorflow::OpKernelContext* ctx, const TreeView& tree,
                                  const SoftmaxParams<T>& params, int64 num_rows, int64 k,
                                  T* log_probs, int64* classes, int64* num_expanded);
};

template <typename T>
struct LogProbAllFunctor<GPUDevice, T> {
  ::tensorflow::Status operator()(::tensorflow::OpKernelContext* ctx, const TreeView& tree,
                                  const SoftmaxParams<T>& params, int64 num_rows,
                                  int64 class_begin, int64 class_end, T* out);
};

template <typename T>
struct SampleFunctor<GPUDevice, T> {
  ::tensorflow::Status operator()(::tensorflow::OpKernelContext* ctx, const TreeView& tree,
                                  const SoftmaxParams<T>& params, int64 num_rows,
                                  std::uint64_t seed, T temperature, int64* classes);
};

template <typename T>
struct LogProbCandidatesFunctor<GPUDevice, T> {
  ::tensorflow::Status operator()(::tensorflow::OpKernelContext* ctx, const TreeView& tree,
                                  const SoftmaxParams<T>& params, int64 num_rows,
                                  const int64* candidates, int64 num_candidates, T* out);
};
#endif  // GOOGLE_CUDA

}  // namespace functor
}  // namespace tf_hsm

#endif  // TF_HSM_CC_KERNELS_INFERENCE_KERNELS_H_
