// Input validation and TreeView assembly shared by every tf_hsm OpKernel, so each op checks
// its tensors the same way and the kernels stay thin.
#ifndef TF_HSM_CC_KERNELS_HSM_INPUTS_H_
#define TF_HSM_CC_KERNELS_HSM_INPUTS_H_

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <vector>

#include "cc/core/log_prob.h"
#include "cc/core/tree_view.h"
#include "cc/core/visit_plan.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_var.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/platform/mutex.h"
#include "tensorflow/core/util/work_sharder.h"

namespace Eigen {
struct GpuDevice;
}  // namespace Eigen

namespace tf_hsm {

// The devices the kernels are templated on, as TensorFlow names them. GpuDevice is only
// declared here: its definition needs EIGEN_USE_GPU and the CUDA headers, and a kernel
// needs no more than its name to be templated on it.
using CPUDevice = ::Eigen::ThreadPoolDevice;
using GPUDevice = ::Eigen::GpuDevice;

// The dense softmax inputs (hidden, weights, biases at inputs 0..2) after validation.
struct SoftmaxInputs {
  const ::tensorflow::Tensor* hidden = nullptr;
  const ::tensorflow::Tensor* weights = nullptr;
  const ::tensorflow::Tensor* biases = nullptr;
  int64 num_tokens = 0;
  int64 dim = 0;
  bool has_bias = false;
};

// Validates hidden [..., D], weights [S, D], biases [S] or [0] at inputs 0..2.
::tensorflow::Status ReadSoftmaxInputs(::tensorflow::OpKernelContext* ctx, SoftmaxInputs* in);

// The same checks for tensors that do not come straight from inputs (variables).
::tensorflow::Status CheckSoftmaxTensors(const ::tensorflow::Tensor& hidden,
                                         const ::tensorflow::Tensor& weights,
                                         const ::tensorflow::Tensor& biases, SoftmaxInputs* in);

// The core's view of validated dense inputs.
template <typename T>
SoftmaxParams<T> ParamsOf(const SoftmaxInputs& in) {
  SoftmaxParams<T> params;
  params.hidden = in.hidden->flat<T>().data();
  params.weights = in.weights->flat<T>().data();
  params.biases = in.has_bias ? in.biases->flat<T>().data() : nullptr;
  params.dim = in.dim;
  return params;
}

// Validates the rank-1 int64 tree tensors child_begin, path_begin, path_nodes, path_slots at
// inputs first..first+3 (and slot_child at `slot_child_input` when >= 0) and fills *tree.
// Per-path offsets are checked lazily by the core (only those a batch reads).
::tensorflow::Status ReadTree(::tensorflow::OpKernelContext* ctx, int first, int slot_child_input,
                              int64 num_slots, TreeView* tree);

// The op's `skip_padding` attribute: whether a target < 0 is padding (a token of no
// steps) or an error. A failed read fails the kernel's construction.
inline Padding PaddingOf(::tensorflow::OpKernelConstruction* ctx) {
  bool skip = false;
  if (ctx->HasAttr("skip_padding")) {
    const ::tensorflow::Status read = ctx->GetAttr("skip_padding", &skip);
    if (!read.ok()) ctx->CtxFailure(read);
  }
  return skip ? Padding::kSkip : Padding::kError;
}

// Copies int32/int64 class ids into int64 and checks that the shape equals `batch`.
::tensorflow::Status ReadClassIds(const ::tensorflow::Tensor& ids, const char* name,
                                  const ::tensorflow::TensorShape& batch,
                                  std::vector<int64>* out);

// The arguments of the inference ops, checked the same way on every device.
// Hidden/weights/biases (inputs 0..2) and the tree starting at input first_tree (slot_child
// after its four tensors when with_slot_child), as the core's views.
template <typename T>
::tensorflow::Status ReadInference(::tensorflow::OpKernelContext* ctx, int first_tree,
                                   bool with_slot_child, SoftmaxInputs* in,
                                   SoftmaxParams<T>* params, TreeView* tree) {
  TF_RETURN_IF_ERROR(ReadSoftmaxInputs(ctx, in));
  TF_RETURN_IF_ERROR(ReadTree(ctx, first_tree, with_slot_child ? first_tree + 4 : -1,
                              in->weights->dim_size(0), tree));
  *params = ParamsOf<T>(*in);
  return ::tensorflow::Status();
}

// Hsm>TopK: k <= num_classes (the op's attribute already requires k >= 1).
::tensorflow::Status CheckTopK(int64 k, const TreeView& tree);

// Hsm>LogProbAll: class_range, a vector (begin, end) with 0 <= begin <= end <= C.
::tensorflow::Status ReadClassRange(const ::tensorflow::Tensor& range, const TreeView& tree,
                                    int64* begin, int64* end);

// Hsm>Sample: scalar seed and temperature, the temperature positive and finite.
template <typename T>
::tensorflow::Status ReadSampleArgs(const ::tensorflow::Tensor& seed,
                                    const ::tensorflow::Tensor& temperature,
                                    std::uint64_t* seed_value, T* temperature_value) {
  namespace errors = ::tensorflow::errors;
  if (!::tensorflow::TensorShapeUtils::IsScalar(seed.shape())) {
    return errors::InvalidArgument("seed must be a scalar, got shape ",
                                   seed.shape().DebugString());
  }
  if (!::tensorflow::TensorShapeUtils::IsScalar(temperature.shape())) {
    return errors::InvalidArgument("temperature must be a scalar, got shape ",
                                   temperature.shape().DebugString());
  }
  *seed_value = static_cast<std::uint64_t>(seed.scalar<int64_t>()());
  *temperature_value = temperature.scalar<T>()();
  if (!(*temperature_value > T(0)) || std::isinf(*temperature_value)) {
    return errors::InvalidArgument("temperature = ", *temperature_value,
                                   " must be positive and finite");
  }
  return ::tensorflow::Status();
}

// Hsm>LogProbCandidates: candidates [..., M] with hidden's leading shape `batch`, every id
// a class; copied into *ids (row-major) with *num_candidates = M.
::tensorflow::Status ReadCandidates(const ::tensorflow::Tensor& candidates,
                                    const ::tensorflow::TensorShape& batch,
                                    const TreeView& tree, std::vector<int64>* ids,
                                    int64* num_candidates);

// The CPU device's thread pool as the core's ParallelFor: the items are handed out from a
// shared counter, a few at a time (one at a time when each is costly), to the calling
// thread and all but one of the pool's threads, so that as many threads work as the pool
// has; a thread that gets fewer cycles takes fewer items. Eigen's ParallelFor hands out
// fixed blocks; one held up by the caller left a core idle (log_prob_all on a 2-level tree
// kept 1.82 of 2 cores busy, 1.93 this way).
ParallelFor CpuParallelFor(::tensorflow::OpKernelContext* ctx);

// An op output whose buffer is kept by the kernel and handed out again on the next call
// when nobody else holds it any more; its first dimension may vary from call to call.
// For the sparse weight gradient (80-800 MB per step at large vocabularies) and the
// logits a forward saves for its gradient (81 MB at 10M classes and 3,200 tokens): as a
// fresh allocation each step, glibc maps such a buffer from the OS and unmaps it on free,
// so every step pays a page fault and a page clear for all of it. A buffer still
// referenced (the caller kept last step's output) is never reused, so outputs never
// alias anything visible; small outputs are allocated normally.
class ReusableOutput {
 public:
  ::tensorflow::Status Allocate(::tensorflow::OpKernelContext* ctx, int index,
                                const ::tensorflow::TensorShape& shape, ::tensorflow::Tensor** out);

 private:
  ::tensorflow::mutex mu_;
  ::tensorflow::Tensor buffer_ TF_GUARDED_BY(mu_);
};

// Objects a kernel keeps across calls so that their storage is reused: each call leases
// one for as long as the returned pointer lives, so concurrent calls never share one. For
// visit plans (BuildVisitPlan clears a plan's vectors rather than replacing them:
// allocated afresh, they were about a third of the time of building the plan of a
// 1K-token batch through a deep tree) and the backward's coefficient stores.
template <typename X>
class LeasePool {
 public:
  struct Return {
    LeasePool* pool;
    void operator()(X* x) const {
      ::tensorflow::mutex_lock lock(pool->mu_);
      pool->free_.emplace_back(x);
    }
  };
  using Lease = std::unique_ptr<X, Return>;
  Lease Acquire() {
    std::unique_ptr<X> x;
    {
      ::tensorflow::mutex_lock lock(mu_);
      if (!free_.empty()) {
        x = std::move(free_.back());
        free_.pop_back();
      }
    }
    if (x == nullptr) x = std::make_unique<X>();
    return Lease(x.release(), Return{this});
  }

 private:
  ::tensorflow::mutex mu_;
  std::vector<std::unique_ptr<X>> free_ TF_GUARDED_BY(mu_);
};
using PlanPool = LeasePool<VisitPlan>;

// The variable's tensor, made safe to update in place: if a reader still shares its buffer
// (and the variable is not in copy-on-read mode, where readers copy instead), the buffer
// is copied first, as TensorFlow's own training ops do, so the reader keeps its values.
// The caller holds the variable's lock. `dtype_source` names the input whose dtype T is.
template <typename T>
::tensorflow::Status ExclusiveTensor(::tensorflow::OpKernelContext* ctx, ::tensorflow::Var* var,
                                    const char* name, const char* dtype_source,
                                    ::tensorflow::Tensor** out) {
  namespace errors = ::tensorflow::errors;
  ::tensorflow::Tensor* t = var->tensor();
  if (!t->IsInitialized()) return errors::FailedPrecondition(name, " is not initialized");
  const ::tensorflow::DataType dtype = ::tensorflow::DataTypeToEnum<T>::value;
  if (t->dtype() != dtype) {
    return errors::InvalidArgument(name, " has dtype ", ::tensorflow::DataTypeString(t->dtype()),
                                   " but ", dtype_source, " has ",
                                   ::tensorflow::DataTypeString(dtype));
  }
  if (!var->copy_on_read_mode.load() && !t->RefCountIsOne()) {
    ::tensorflow::Tensor copy;
    TF_RETURN_IF_ERROR(ctx->allocate_temp(t->dtype(), t->shape(), &copy));
    if (t->NumElements() > 0) {
      std::memcpy(copy.flat<T>().data(), t->flat<T>().data(), t->NumElements() * sizeof(T));
    }
    *t = copy;
  }
  *out = t;
  return ::tensorflow::Status();
}

// hidden's shape without its last dimension.
::tensorflow::TensorShape BatchShape(const ::tensorflow::Tensor& hidden);

}  // namespace tf_hsm

#endif  // TF_HSM_CC_KERNELS_HSM_INPUTS_H_
