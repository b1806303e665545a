// OpKernels for Hsm>TopK, Hsm>LogProbAll, Hsm>Sample and Hsm>LogProbCandidates: validate,
// allocate, then call the device's functor (inference_kernels.h), which runs the core;
// the core checks the rest. One kernel class per op serves every device.
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
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/register_types.h"

namespace tf_hsm {

using ::tensorflow::DEVICE_CPU;
using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Status;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShape;
namespace errors = ::tensorflow::errors;

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

template <typename Device, typename T>
class TopKOp : public OpKernel {
 public:
  explicit TopKOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("k", &k_));
  }

  void Compute(OpKernelContext* ctx) override {
    SoftmaxInputs in;
    SoftmaxParams<T> params;
    TreeView tree;
    OP_REQUIRES_OK(ctx, ReadInference(ctx, 3, true, &in, &params, &tree));
    OP_REQUIRES_OK(ctx, CheckTopK(k_, tree));
    const TensorShape batch = BatchShape(*in.hidden);
    TensorShape out_shape = batch;
    out_shape.AddDim(k_);
    Tensor *log_probs, *classes, *expanded;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, out_shape, &log_probs));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, out_shape, &classes));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(2, batch, &expanded));
    OP_REQUIRES_OK(ctx, functor_(ctx, tree, params, in.num_tokens, k_,
                                 log_probs->flat<T>().data(), classes->flat<int64_t>().data(),
                                 expanded->flat<int64_t>().data()));
  }

 private:
  functor::TopKFunctor<Device, T> functor_;
  int64_t k_ = 0;
};

template <typename Device, typename T>
class LogProbAllOp : public OpKernel {
 public:
  explicit LogProbAllOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    SoftmaxInputs in;
    SoftmaxParams<T> params;
    TreeView tree;
    OP_REQUIRES_OK(ctx, ReadInference(ctx, 4, true, &in, &params, &tree));
    int64 begin, end;
    OP_REQUIRES_OK(ctx, ReadClassRange(ctx->input(3), tree, &begin, &end));
    TensorShape out_shape = BatchShape(*in.hidden);
    out_shape.AddDim(end - begin);
    Tensor* out;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, out_shape, &out));
    OP_REQUIRES_OK(ctx, functor_(ctx, tree, params, in.num_tokens, begin, end,
                                 out->flat<T>().data()));
  }

 private:
  functor::LogProbAllFunctor<Device, T> functor_;
};

template <typename Device, typename T>
class SampleOp : public OpKernel {
 public:
  explicit SampleOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    SoftmaxInputs in;
    SoftmaxParams<T> params;
    TreeView tree;
    OP_REQUIRES_OK(ctx, ReadInference(ctx, 5, true, &in, &params, &tree));
    std::uint64_t seed;
    T temperature;
    OP_REQUIRES_OK(ctx, ReadSampleArgs(ctx->input(3), ctx->input(4), &seed, &temperature));
    Tensor* classes;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, BatchShape(*in.hidden), &classes));
    OP_REQUIRES_OK(ctx, functor_(ctx, tree, params, in.num_tokens, seed, temperature,
                                 classes->flat<int64_t>().data()));
  }

 private:
  functor::SampleFunctor<Device, T> functor_;
};

template <typename Device, typename T>
class LogProbCandidatesOp : public OpKernel {
 public:
  explicit LogProbCandidatesOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

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
    Tensor* out;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, candidates.shape(), &out));
    OP_REQUIRES_OK(ctx, functor_(ctx, tree, params, in.num_tokens, ids.data(), num_candidates,
                                 out->flat<T>().data()));
  }

 private:
  functor::LogProbCandidatesFunctor<Device, T> functor_;
};

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
using ::tensorflow::DEVICE_GPU;
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
