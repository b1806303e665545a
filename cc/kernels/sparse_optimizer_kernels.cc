// OpKernels for Hsm>SparseAdamRows and Hsm>SparseAdagradRows: the row updates of
// tf_hsm.optimizers' LazyAdam and SparseAdagrad, in place, under the variables' locks.
#include <algorithm>
#include <vector>

#include "cc/core/sparse_rows.h"
#include "cc/kernels/hsm_inputs.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_var.h"

namespace tf_hsm {

using ::tensorflow::DEVICE_CPU;
using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Status;
using ::tensorflow::Tensor;
using ::tensorflow::Var;
namespace errors = ::tensorflow::errors;

namespace {

// The variables at inputs [0, count), looked up, distinct, locked in address order (so
// that two ops locking the same variables cannot deadlock) and made safe to update in
// place; all must have the first one's shape, of rank >= 1.
template <typename T>
class LockedRows {
 public:
  LockedRows(OpKernelContext* ctx, const std::vector<const char*>& names) {
    vars_.resize(names.size());
    for (size_t i = 0; i < names.size(); ++i) {
      OP_REQUIRES_OK(ctx, LookupResource(ctx, HandleFromInput(ctx, i), &vars_[i]));
      for (size_t j = 0; j < i; ++j) {
        OP_REQUIRES(ctx, vars_[i].get() != vars_[j].get(),
                    errors::InvalidArgument(names[j], " and ", names[i],
                                            " must be different variables"));
      }
    }
    for (const auto& var : vars_) locked_.push_back(var->mu());
    std::sort(locked_.begin(), locked_.end());
    for (auto* mu : locked_) mu->lock();
    tensors_.resize(names.size());
    for (size_t i = 0; i < names.size(); ++i) {
      OP_REQUIRES_OK(ctx, ExclusiveTensor<T>(ctx, vars_[i].get(), names[i], "gradient",
                                             &tensors_[i]));
      OP_REQUIRES(ctx, tensors_[i]->dims() >= 1,
                  errors::InvalidArgument(names[i], " must have rank >= 1, got shape ",
                                          tensors_[i]->shape().DebugString()));
      OP_REQUIRES(ctx, tensors_[i]->shape() == tensors_[0]->shape(),
                  errors::InvalidArgument(names[i], " has shape ",
                                          tensors_[i]->shape().DebugString(), " but ",
                                          names[0], " has ",
                                          tensors_[0]->shape().DebugString()));
    }
    ok_ = true;
  }
  ~LockedRows() {
    for (auto* mu : locked_) mu->unlock();
  }
  bool ok() const { return ok_; }
  T* data(int i) const { return tensors_[i]->template flat<T>().data(); }
  const ::tensorflow::TensorShape& shape() const { return tensors_[0]->shape(); }
  int64 num_rows() const { return shape().dim_size(0); }
  // Elements per row (1 for a vector of biases).
  int64 width() const { return shape().num_elements() / std::max<int64>(1, num_rows()); }

 private:
  std::vector<::tensorflow::core::RefCountPtr<Var>> vars_;
  std::vector<::tensorflow::mutex*> locked_;
  std::vector<Tensor*> tensors_;
  bool ok_ = false;
};

// indices ([n], each a row of `shape`) and gradient ([n] + shape[1:]) at the given inputs,
// checked; the indices copied into *rows.
template <typename Tidx>
Status ReadSparseGradient(const Tensor& indices, const Tensor& gradient,
                          const ::tensorflow::TensorShape& shape, std::vector<int64>* rows) {
  if (indices.dims() != 1) {
    return errors::InvalidArgument("indices must be a vector, got shape ",
                                   indices.shape().DebugString());
  }
  ::tensorflow::TensorShape expected = shape;
  expected.set_dim(0, indices.dim_size(0));
  if (gradient.shape() != expected) {
    return errors::InvalidArgument("gradient must have shape ", expected.DebugString(),
                                   " (one row per index), got ",
                                   gradient.shape().DebugString());
  }
  const auto ids = indices.flat<Tidx>();
  const int64 num_rows = shape.dim_size(0);
  rows->resize(ids.size());
  for (int64 k = 0; k < ids.size(); ++k) {
    const int64 row = static_cast<int64>(ids(k));
    if (row < 0 || row >= num_rows) {
      return errors::InvalidArgument("indices[", k, "] = ", row, " is not a row of [0, ",
                                     num_rows, ")");
    }
    (*rows)[k] = row;
  }
  return Status();
}

template <typename T>
Status ReadScalar(const Tensor& t, const char* name, T* value) {
  if (t.dims() != 0) {
    return errors::InvalidArgument(name, " must be a scalar, got shape ", t.shape().DebugString());
  }
  *value = t.scalar<T>()();
  return Status();
}

// Inputs: var, m, v, v_hat (resources; v_hat only with amsgrad), indices, gradient, alpha,
// one_minus_beta_1, one_minus_beta_2, epsilon.
template <typename T, typename Tidx>
class SparseAdamRowsOp : public OpKernel {
 public:
  explicit SparseAdamRowsOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("amsgrad", &amsgrad_));
  }

  void Compute(OpKernelContext* ctx) override {
    AdamStep<T> step;
    OP_REQUIRES_OK(ctx, ReadScalar(ctx->input(6), "alpha", &step.alpha));
    OP_REQUIRES_OK(ctx, ReadScalar(ctx->input(7), "one_minus_beta_1", &step.one_minus_beta_1));
    OP_REQUIRES_OK(ctx, ReadScalar(ctx->input(8), "one_minus_beta_2", &step.one_minus_beta_2));
    OP_REQUIRES_OK(ctx, ReadScalar(ctx->input(9), "epsilon", &step.epsilon));
    std::vector<const char*> names = {"var", "m", "v"};
    if (amsgrad_) names.push_back("v_hat");
    LockedRows<T> vars(ctx, names);
    if (!vars.ok()) return;
    std::vector<int64> rows;
    OP_REQUIRES_OK(ctx, ReadSparseGradient<Tidx>(ctx->input(4), ctx->input(5), vars.shape(),
                                                 &rows));
    const int64 width = vars.width();
    const T* g = ctx->input(5).flat<T>().data();
    T *w = vars.data(0), *m = vars.data(1), *v = vars.data(2);
    T* v_hat = amsgrad_ ? vars.data(3) : nullptr;
    ForEachDistinctRow(rows.data(), rows.size(), vars.num_rows(), g, width, 12 * width,
                       CpuParallelFor(ctx), [&](int64 row, const T* g_row) {
                         const int64 at = row * width;
                         AdamRow(g_row, width, step, w + at, m + at, v + at,
                                 v_hat == nullptr ? nullptr : v_hat + at);
                       });
  }

 private:
  bool amsgrad_ = false;
};

// Inputs: var, accumulator (resources), indices, gradient, learning_rate, epsilon.
template <typename T, typename Tidx>
class SparseAdagradRowsOp : public OpKernel {
 public:
  explicit SparseAdagradRowsOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    T learning_rate, epsilon;
    OP_REQUIRES_OK(ctx, ReadScalar(ctx->input(4), "learning_rate", &learning_rate));
    OP_REQUIRES_OK(ctx, ReadScalar(ctx->input(5), "epsilon", &epsilon));
    LockedRows<T> vars(ctx, {"var", "accumulator"});
    if (!vars.ok()) return;
    std::vector<int64> rows;
    OP_REQUIRES_OK(ctx, ReadSparseGradient<Tidx>(ctx->input(2), ctx->input(3), vars.shape(),
                                                 &rows));
    const int64 width = vars.width();
    const T* g = ctx->input(3).flat<T>().data();
    T *w = vars.data(0), *acc = vars.data(1);
    ForEachDistinctRow(rows.data(), rows.size(), vars.num_rows(), g, width, 8 * width,
                       CpuParallelFor(ctx), [&](int64 row, const T* g_row) {
                         AdagradRow(g_row, width, learning_rate, epsilon, w + row * width,
                                    acc + row * width);
                       });
  }
};

}  // namespace

#define REGISTER_CPU(T, Tidx)                                                            \
  REGISTER_KERNEL_BUILDER(Name("Hsm>SparseAdamRows")                                     \
                              .Device(DEVICE_CPU)                                        \
                              .TypeConstraint<T>("T")                                    \
                              .TypeConstraint<Tidx>("Tidx"),                             \
                          SparseAdamRowsOp<T, Tidx>);                                    \
  REGISTER_KERNEL_BUILDER(Name("Hsm>SparseAdagradRows")                                  \
                              .Device(DEVICE_CPU)                                        \
                              .TypeConstraint<T>("T")                                    \
                              .TypeConstraint<Tidx>("Tidx"),                             \
                          SparseAdagradRowsOp<T, Tidx>);
REGISTER_CPU(float, ::tensorflow::int32)
REGISTER_CPU(float, ::tensorflow::int64)
REGISTER_CPU(double, ::tensorflow::int32)
REGISTER_CPU(double, ::tensorflow::int64)
#undef REGISTER_CPU

}  // namespace tf_hsm
