// OpKernels for Hsm>TopK, Hsm>LogProbAll, Hsm>Sample and Hsm>LogProbCandidates:
// validate, allocate, call the core (cc/core/inference.h), which checks the rest.
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

namespace {

Status FromCore(const std::string& problem) {
  return problem.empty() ? Status() : errors::InvalidArgument(problem);
}

template <typename T>
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
    OP_REQUIRES_OK(ctx, FromCore(TopK<T>(tree, params, in.num_tokens, k_, CpuParallelFor(ctx),
                                         log_probs->flat<T>().data(),
                                         classes->flat<int64_t>().data(),
                                         expanded->flat<int64_t>().data())));
  }

 private:
  int64_t k_ = 0;
};

template <typename T>
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
    OP_REQUIRES_OK(ctx, FromCore(LogProbAll<T>(tree, params, in.num_tokens, begin, end,
                                               CpuParallelFor(ctx), out->flat<T>().data(),
                                               &plan_cache_)));
  }

 private:
  // The plan of the last whole tree, reused while the tree's values stay the same.
  SweepPlanCache plan_cache_;
};

template <typename T>
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
    OP_REQUIRES_OK(ctx, FromCore(Sample<T>(tree, params, in.num_tokens, seed, temperature,
                                           CpuParallelFor(ctx), classes->flat<int64_t>().data())));
  }
};

template <typename T>
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
    OP_REQUIRES_OK(ctx, FromCore(LogProbCandidates<T>(tree, params, in.num_tokens, ids.data(),
                                                      num_candidates, CpuParallelFor(ctx),
                                                      out->flat<T>().data())));
  }
};

#define REGISTER_CPU(T)                                                                    \
  REGISTER_KERNEL_BUILDER(Name("Hsm>TopK").Device(DEVICE_CPU).TypeConstraint<T>("T"),      \
                          TopKOp<T>);                                                      \
  REGISTER_KERNEL_BUILDER(Name("Hsm>LogProbAll").Device(DEVICE_CPU).TypeConstraint<T>("T"), \
                          LogProbAllOp<T>);                                                \
  REGISTER_KERNEL_BUILDER(Name("Hsm>Sample").Device(DEVICE_CPU).TypeConstraint<T>("T"),    \
                          SampleOp<T>);                                                    \
  REGISTER_KERNEL_BUILDER(                                                                 \
      Name("Hsm>LogProbCandidates").Device(DEVICE_CPU).TypeConstraint<T>("T"),            \
      LogProbCandidatesOp<T>);
REGISTER_CPU(float)
REGISTER_CPU(double)
#undef REGISTER_CPU

}  // namespace
}  // namespace tf_hsm
