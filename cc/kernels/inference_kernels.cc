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
using ::tensorflow::TensorShapeUtils;
namespace errors = ::tensorflow::errors;

namespace {

// Reads hidden/weights/biases (inputs 0..2) and the tree starting at input first_tree;
// slot_child follows the four tree tensors when with_slot_child.
template <typename T>
Status ReadInference(OpKernelContext* ctx, int first_tree, bool with_slot_child,
                     SoftmaxInputs* in, SoftmaxParams<T>* params, TreeView* tree) {
  TF_RETURN_IF_ERROR(ReadSoftmaxInputs(ctx, in));
  TF_RETURN_IF_ERROR(ReadTree(ctx, first_tree, with_slot_child ? first_tree + 4 : -1,
                              in->weights->dim_size(0), tree));
  *params = ParamsOf<T>(*in);
  return Status();
}

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
    OP_REQUIRES(ctx, k_ <= tree.num_classes,
                errors::InvalidArgument("k = ", k_, " must be in [1, num_classes] = [1, ",
                                        tree.num_classes, "]"));
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
    const Tensor& range = ctx->input(3);
    OP_REQUIRES(ctx, range.dims() == 1 && range.NumElements() == 2,
                errors::InvalidArgument("class_range must be a vector (begin, end), got shape ",
                                        range.shape().DebugString()));
    const int64 begin = range.flat<int64_t>()(0), end = range.flat<int64_t>()(1);
    OP_REQUIRES(ctx, 0 <= begin && begin <= end && end <= tree.num_classes,
                errors::InvalidArgument("class_range = [", begin, ", ", end,
                                        ") must satisfy 0 <= begin <= end <= num_classes = ",
                                        tree.num_classes));
    TensorShape out_shape = BatchShape(*in.hidden);
    out_shape.AddDim(end - begin);
    Tensor* out;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, out_shape, &out));
    OP_REQUIRES_OK(ctx, FromCore(LogProbAll<T>(tree, params, in.num_tokens, begin, end,
                                               CpuParallelFor(ctx), out->flat<T>().data())));
  }
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
    const Tensor& seed = ctx->input(3);
    const Tensor& temperature = ctx->input(4);
    OP_REQUIRES(ctx, TensorShapeUtils::IsScalar(seed.shape()),
                errors::InvalidArgument("seed must be a scalar, got shape ",
                                        seed.shape().DebugString()));
    OP_REQUIRES(ctx, TensorShapeUtils::IsScalar(temperature.shape()),
                errors::InvalidArgument("temperature must be a scalar, got shape ",
                                        temperature.shape().DebugString()));
    Tensor* classes;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, BatchShape(*in.hidden), &classes));
    OP_REQUIRES_OK(ctx, FromCore(Sample<T>(tree, params, in.num_tokens,
                                           static_cast<std::uint64_t>(seed.scalar<int64_t>()()),
                                           temperature.scalar<T>()(), CpuParallelFor(ctx),
                                           classes->flat<int64_t>().data())));
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
    const TensorShape batch = BatchShape(*in.hidden);
    TensorShape lead = candidates.shape();
    if (lead.dims() > 0) lead.RemoveLastDims(1);
    OP_REQUIRES(ctx, candidates.dims() == batch.dims() + 1 && lead == batch,
                errors::InvalidArgument("candidates must have shape [..., M] with hidden's "
                                        "leading shape ", batch.DebugString(), ", got ",
                                        candidates.shape().DebugString()));
    std::vector<int64> ids;
    OP_REQUIRES_OK(ctx, ReadClassIds(candidates, "candidates", candidates.shape(), &ids));
    const int64 num_candidates = candidates.dim_size(candidates.dims() - 1);
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
