// GPU OpKernel for Hsm>LogProbCandidates: the CPU kernel's validation and visit plan on the
// host, then the CUDA core (LogProbCandidatesGpu in cc/core/log_prob_gpu.h) on the op's
// stream. Hsm>TopK, Hsm>LogProbAll and Hsm>Sample have no GPU kernel yet: TensorFlow runs
// them on the CPU (copying hidden there) when they are placed on a GPU.
//
// Only the GPU build of the op library compiles this file with GOOGLE_CUDA (see
// log_prob_kernels_gpu.cc); in the CPU build it is an empty translation unit. The
// candidates and the tree tensors are HostMemory inputs, as for Hsm>LogProb.
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
    OP_REQUIRES_OK(ctx, ReadSoftmaxInputs(ctx, &in));
    TreeView tree;
    OP_REQUIRES_OK(ctx, ReadTree(ctx, 4, -1, in.weights->dim_size(0), &tree));
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
    for (int64 i = 0; i < static_cast<int64>(ids.size()); ++i) {
      OP_REQUIRES(ctx, ids[i] >= 0 && ids[i] < tree.num_classes,
                  errors::InvalidArgument(
                      "candidates[", i / num_candidates, ", ", i % num_candidates, "] = ",
                      ids[i], " is not a class id in [0, ", tree.num_classes,
                      ") (indices over hidden's flattened leading dimensions)"));
    }
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
    SoftmaxParams<T> params;
    params.hidden = in.hidden->flat<T>().data();
    params.weights = in.weights->flat<T>().data();
    params.biases = in.has_bias ? in.biases->flat<T>().data() : nullptr;
    params.dim = in.dim;
    err = LogProbCandidatesGpu<T>(gpu_plan, params, out->flat<T>().data(),
                                  workspace.flat<int8_t>().data(),
                                  ctx->eigen_gpu_device().stream());
    OP_REQUIRES(ctx, err.empty(), errors::Internal("Hsm>LogProbCandidates on GPU: ", err));
  }
};

#define REGISTER_GPU(T)                                                                   \
  REGISTER_KERNEL_BUILDER(Name("Hsm>LogProbCandidates")                                   \
                              .Device(DEVICE_GPU)                                         \
                              .TypeConstraint<T>("T")                                     \
                              .HostMemory("candidates")                                   \
                              .HostMemory("child_begin")                                  \
                              .HostMemory("path_begin")                                   \
                              .HostMemory("path_nodes")                                   \
                              .HostMemory("path_slots"),                                  \
                          LogProbCandidatesGpuOp<T>);
REGISTER_GPU(float)
REGISTER_GPU(double)
#undef REGISTER_GPU

}  // namespace
}  // namespace tf_hsm

#endif  // GOOGLE_CUDA
