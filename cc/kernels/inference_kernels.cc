// OpKernels for Hsm>TopK, Hsm>LogProbAll, Hsm>Sample and Hsm>LogProbCandidates: validate,
// allocate, then call the device's functor (inference_kernels.h), which runs the core;
// the core checks the rest. One kernel class, InferenceOp, reads the inputs all four share;
// each op adds its own arguments and outputs, and serves every device.
//
// On the GPU, the tree tensors, the candidates and the small scalar inputs (class_range,
// seed, temperature) are HostMemory inputs: they are validated, and the tree's work lists
// built, on the host (see log_prob_kernels.cc).
#define EIGEN_USE_THREADS
#if GOOGLE_CUDA
#define EIGEN_USE_GPU
#endif

#include "cc/kernels/inference_kernels.h"

#include <cstdint>
#include <string>
#include <vector>

#include "cc/core/inference.h"
#include "cc/kernels/hsm_inputs.h"
#include "cc/kernels/tf_names.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/register_types.h"

namespace tf_hsm {

namespace functor {
namespace {

Status FromCore(const std::string& problem) {
  return problem.empty() ? Status() : errors::InvalidArgument(problem);
}

}  // namespace

template <typename T>
struct TopKFunctor<CPUDevice, T> {
  Status operator()(OpKernelContext* ctx, const TreeView& tree, const SoftmaxParams<T>& params,
                    int64 num_rows, int64 k, T* log_probs, int64* classes,
                    int64* num_expanded) {
    return FromCore(TopK<T>(tree, params, num_rows, k, CpuParallelFor(ctx), log_probs, classes,
                            num_expanded));
  }
};

template <typename T>
struct LogProbAllFunctor<CPUDevice, T> {
  Status operator()(OpKernelContext* ctx, const TreeView& tree, const SoftmaxParams<T>& params,
                    int64 num_rows, int64 class_begin, int64 class_end, T* out) {
    return FromCore(LogProbAll<T>(tree, params, num_rows, class_begin, class_end,
                                  CpuParallelFor(ctx), out, &plan_cache_));
  }

 private:
  // The plan of the last whole tree, reused while the tree's values stay the same.
  SweepPlanCache plan_cache_;
};

template <typename T>
struct SampleFunctor<CPUDevice, T> {
  Status operator()(OpKernelContext* ctx, const TreeView& tree, const SoftmaxParams<T>& params,
                    int64 num_rows, std::uint64_t seed, T temperature, int64* classes) {
    return FromCore(Sample<T>(tree, params, num_rows, seed, temperature, CpuParallelFor(ctx),
                              classes));
  }
};

template <typename T>
struct LogProbCandidatesFunctor<CPUDevice, T> {
  Status operator()(OpKernelContext* ctx, const TreeView& tree, const SoftmaxParams<T>& params,
                    int64 num_rows, const int64* candidates, int64 num_candidates, T* out) {
    return FromCore(LogProbCandidates<T>(tree, params, num_rows, candidates, num_candidates,
                                         CpuParallelFor(ctx), out));
  }
};

#if GOOGLE_CUDA
// Defined in inference_kernels_gpu.cc.
#define TF_HSM_EXTERN_GPU(T)                                   \
  extern template struct TopKFunctor<GPUDevice, T>;            \
  extern template struct LogProbAllFunctor<GPUDevice, T>;      \
  extern template struct SampleFunctor<GPUDevice, T>;          \
  extern template struct LogProbCandidatesFunctor<GPUDevice, T>;
TF_HSM_EXTERN_GPU(float)
TF_HSM_EXTERN_GPU(double)
#undef TF_HSM_EXTERN_GPU
#endif  // GOOGLE_CUDA

}  // namespace functor

namespace {

// The kernel of every inference op: the softmax inputs and the tree read and checked the
// same way (ReadInference), then what the op adds (its arguments, outputs and functor
// call), Op::Run. Op names its tree's first input (kTreeInput) and whether the tree
// includes slot_child (kSlotChild); it is built with the kernel, so its attributes are
// read once and its functor lives as long as the kernel.
template <typename Op, typename T>
class InferenceOp : public OpKernel {
 public:
  explicit InferenceOp(OpKernelConstruction* ctx) : OpKernel(ctx), op_(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    SoftmaxInputs in;
    SoftmaxParams<T> params;
    TreeView tree;
    OP_REQUIRES_OK(ctx, ReadInference(ctx, Op::kTreeInput, Op::kSlotChild, &in, &params, &tree));
    OP_REQUIRES_OK(ctx, op_.Run(ctx, in, params, tree));
  }

 private:
  Op op_;
};

// Hsm>TopK: log_probs and classes [..., k], num_expanded [...].
template <typename Device, typename T>
class TopK {
 public:
  static constexpr int kTreeInput = 3;
  static constexpr bool kSlotChild = true;

  explicit TopK(OpKernelConstruction* ctx) { OP_REQUIRES_OK(ctx, ctx->GetAttr("k", &k_)); }

  Status Run(OpKernelContext* ctx, const SoftmaxInputs& in, const SoftmaxParams<T>& params,
             const TreeView& tree) {
    TF_RETURN_IF_ERROR(CheckTopK(k_, tree));
    const TensorShape batch = BatchShape(*in.hidden);
    TensorShape out_shape = batch;
    out_shape.AddDim(k_);
    Tensor *log_probs, *classes, *expanded;
    TF_RETURN_IF_ERROR(ctx->allocate_output(0, out_shape, &log_probs));
    TF_RETURN_IF_ERROR(ctx->allocate_output(1, out_shape, &classes));
    TF_RETURN_IF_ERROR(ctx->allocate_output(2, batch, &expanded));
    return functor_(ctx, tree, params, in.num_tokens, k_, log_probs->flat<T>().data(),
                    classes->flat<int64_t>().data(), expanded->flat<int64_t>().data());
  }

 private:
  functor::TopKFunctor<Device, T> functor_;
  int64_t k_ = 0;
};

// Hsm>LogProbAll: [..., end - begin] for the classes of class_range (input 3).
template <typename Device, typename T>
class LogProbAll {
 public:
  static constexpr int kTreeInput = 4;
  static constexpr bool kSlotChild = true;

  explicit LogProbAll(OpKernelConstruction*) {}

  Status Run(OpKernelContext* ctx, const SoftmaxInputs& in, const SoftmaxParams<T>& params,
             const TreeView& tree) {
    int64 begin, end;
    TF_RETURN_IF_ERROR(ReadClassRange(ctx->input(3), tree, &begin, &end));
    TensorShape out_shape = BatchShape(*in.hidden);
    out_shape.AddDim(end - begin);
    Tensor* out;
    TF_RETURN_IF_ERROR(ctx->allocate_output(0, out_shape, &out));
    return functor_(ctx, tree, params, in.num_tokens, begin, end, out->flat<T>().data());
  }

 private:
  functor::LogProbAllFunctor<Device, T> functor_;
};

// Hsm>Sample: one class per row, from seed and temperature (inputs 3 and 4).
template <typename Device, typename T>
class Sample {
 public:
  static constexpr int kTreeInput = 5;
  static constexpr bool kSlotChild = true;

  explicit Sample(OpKernelConstruction*) {}

  Status Run(OpKernelContext* ctx, const SoftmaxInputs& in, const SoftmaxParams<T>& params,
             const TreeView& tree) {
    std::uint64_t seed;
    T temperature;
    TF_RETURN_IF_ERROR(ReadSampleArgs(ctx->input(3), ctx->input(4), &seed, &temperature));
    Tensor* classes;
    TF_RETURN_IF_ERROR(ctx->allocate_output(0, BatchShape(*in.hidden), &classes));
    return functor_(ctx, tree, params, in.num_tokens, seed, temperature,
                    classes->flat<int64_t>().data());
  }

 private:
  functor::SampleFunctor<Device, T> functor_;
};

// Hsm>LogProbCandidates: the log-probability of each candidate (input 3), in its shape.
// The walk from a class up needs no slot_child.
template <typename Device, typename T>
class LogProbCandidates {
 public:
  static constexpr int kTreeInput = 4;
  static constexpr bool kSlotChild = false;

  explicit LogProbCandidates(OpKernelConstruction*) {}

  Status Run(OpKernelContext* ctx, const SoftmaxInputs& in, const SoftmaxParams<T>& params,
             const TreeView& tree) {
    const Tensor& candidates = ctx->input(3);
    std::vector<int64> ids;
    int64 num_candidates;
    TF_RETURN_IF_ERROR(ReadCandidates(candidates, BatchShape(*in.hidden), tree, &ids,
                                      &num_candidates));
    Tensor* out;
    TF_RETURN_IF_ERROR(ctx->allocate_output(0, candidates.shape(), &out));
    return functor_(ctx, tree, params, in.num_tokens, ids.data(), num_candidates,
                    out->flat<T>().data());
  }

 private:
  functor::LogProbCandidatesFunctor<Device, T> functor_;
};

template <typename Device, typename T>
using TopKOp = InferenceOp<TopK<Device, T>, T>;
template <typename Device, typename T>
using LogProbAllOp = InferenceOp<LogProbAll<Device, T>, T>;
template <typename Device, typename T>
using SampleOp = InferenceOp<Sample<Device, T>, T>;
template <typename Device, typename T>
using LogProbCandidatesOp = InferenceOp<LogProbCandidates<Device, T>, T>;

#define REGISTER_CPU(T)                                                                    \
  REGISTER_KERNEL_BUILDER(Name("Hsm>TopK").Device(DEVICE_CPU).TypeConstraint<T>("T"),      \
                          (TopKOp<CPUDevice, T>));                                         \
  REGISTER_KERNEL_BUILDER(Name("Hsm>LogProbAll").Device(DEVICE_CPU).TypeConstraint<T>("T"), \
                          (LogProbAllOp<CPUDevice, T>));                                   \
  REGISTER_KERNEL_BUILDER(Name("Hsm>Sample").Device(DEVICE_CPU).TypeConstraint<T>("T"),    \
                          (SampleOp<CPUDevice, T>));                                       \
  REGISTER_KERNEL_BUILDER(                                                                 \
      Name("Hsm>LogProbCandidates").Device(DEVICE_CPU).TypeConstraint<T>("T"),            \
      (LogProbCandidatesOp<CPUDevice, T>));
REGISTER_CPU(float)
REGISTER_CPU(double)
#undef REGISTER_CPU

#if GOOGLE_CUDA
#define TF_HSM_TREE_HOST_MEMORY \
  HostMemory("child_begin")     \
      .HostMemory("path_begin") \
      .HostMemory("path_nodes") \
      .HostMemory("path_slots")
#define REGISTER_GPU(T)                                                                   \
  REGISTER_KERNEL_BUILDER(Name("Hsm>LogProbCandidates")                                   \
                              .Device(DEVICE_GPU)                                         \
                              .TypeConstraint<T>("T")                                     \
                              .HostMemory("candidates")                                   \
                              .TF_HSM_TREE_HOST_MEMORY,                                   \
                          (LogProbCandidatesOp<GPUDevice, T>));                           \
  REGISTER_KERNEL_BUILDER(Name("Hsm>TopK")                                                \
                              .Device(DEVICE_GPU)                                         \
                              .TypeConstraint<T>("T")                                     \
                              .TF_HSM_TREE_HOST_MEMORY.HostMemory("slot_child"),          \
                          (TopKOp<GPUDevice, T>));                                        \
  REGISTER_KERNEL_BUILDER(Name("Hsm>LogProbAll")                                          \
                              .Device(DEVICE_GPU)                                         \
                              .TypeConstraint<T>("T")                                     \
                              .HostMemory("class_range")                                  \
                              .TF_HSM_TREE_HOST_MEMORY.HostMemory("slot_child"),          \
                          (LogProbAllOp<GPUDevice, T>));                                  \
  REGISTER_KERNEL_BUILDER(Name("Hsm>Sample")                                              \
                              .Device(DEVICE_GPU)                                         \
                              .TypeConstraint<T>("T")                                     \
                              .HostMemory("seed")                                         \
                              .HostMemory("temperature")                                  \
                              .TF_HSM_TREE_HOST_MEMORY.HostMemory("slot_child"),          \
                          (SampleOp<GPUDevice, T>));
REGISTER_GPU(float)
REGISTER_GPU(double)
#undef REGISTER_GPU
#undef TF_HSM_TREE_HOST_MEMORY
#endif  // GOOGLE_CUDA

}  // namespace
}  // namespace tf_hsm
