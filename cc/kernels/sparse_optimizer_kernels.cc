// OpKernels for Hsm>SparseAdamRows, Hsm>SparseAdagradRows and Hsm>SparseSgdRows: the row
// updates of tf_hsm.optimizers' LazyAdam, SparseAdagrad and SparseSGD, in place, under the
// variables' locks.
#include <algorithm>
#include <vector>

#include "cc/core/prefetch.h"
#include "cc/core/sparse_rows.h"
#include "cc/kernels/hsm_inputs.h"
#include "cc/kernels/locked_variables.h"
#include "cc/kernels/tf_names.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_var.h"

namespace tf_hsm {

namespace {

// The variables at inputs [0, count) (`LockedVariables`), all of the first one's shape,
// of rank >= 1.
template <typename T>
class LockedRows {
 public:
  LockedRows(OpKernelContext* ctx, const std::vector<const char*>& names)
      : vars_(ctx, Range(names.size()), names, Like(names.size()), "gradient") {
    if (!vars_.ok()) return;
    OP_REQUIRES(ctx, shape().dims() >= 1,
                errors::InvalidArgument(names[0], " must have rank >= 1, got shape ",
                                        shape().DebugString()));
    ok_ = true;
  }
  bool ok() const { return ok_; }
  T* data(int i) const { return vars_.data(i); }
  const TensorShape& shape() const { return vars_.tensor(0)->shape(); }
  int64 num_rows() const { return shape().dim_size(0); }
  // Elements per row (1 for a vector of biases).
  int64 width() const { return shape().num_elements() / std::max<int64>(1, num_rows()); }

 private:
  static std::vector<int> Range(size_t n) {
    std::vector<int> out(n);
    for (size_t i = 0; i < n; ++i) out[i] = static_cast<int>(i);
    return out;
  }
  static std::vector<int> Like(size_t n) {
    std::vector<int> out(n, 0);
    out[0] = -1;
    return out;
  }

  LockedVariables<T> vars_;
  bool ok_ = false;
};

// indices ([n], each a row of `shape`) and gradient ([n] + shape[1:]) at the given inputs,
// checked; the indices copied into *rows.
template <typename Tidx>
Status ReadSparseGradient(const Tensor& indices, const Tensor& gradient,
                          const TensorShape& shape, std::vector<int64>* rows) {
  if (indices.dims() != 1) {
    return errors::InvalidArgument("indices must be a vector, got shape ",
                                   indices.shape().DebugString());
  }
  TensorShape expected = shape;
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

// The update of every op here: locks the variables at inputs [0, names.size()), reads the
// sparse gradient (indices at input indices_input, the gradient rows after them) and
// calls update(g_row, row_data, width) once per distinct row named, with g_row its summed
// gradient and row_data[i] its row in variable i.
constexpr size_t kMaxVariables = 4;  // Adam's var, m, v and v_hat
template <typename T, typename Tidx, typename Update>
void UpdateNamedRows(OpKernelContext* ctx, const std::vector<const char*>& names,
                     int indices_input, int64 cost_per_element, const Update& update) {
  OP_REQUIRES(ctx, names.size() <= kMaxVariables,
              errors::Internal("at most ", kMaxVariables, " variables per row update"));
  LockedRows<T> vars(ctx, names);
  if (!vars.ok()) return;
  const Tensor& indices = ctx->input(indices_input);
  const Tensor& gradient = ctx->input(indices_input + 1);
  std::vector<int64> rows;
  OP_REQUIRES_OK(ctx, ReadSparseGradient<Tidx>(indices, gradient, vars.shape(), &rows));
  const int64 width = vars.width();
  std::vector<T*> data(names.size());
  for (size_t i = 0; i < names.size(); ++i) data[i] = vars.data(i);
  ForEachDistinctRow(rows.data(), rows.size(), vars.num_rows(), gradient.flat<T>().data(),
                     width, cost_per_element * width, static_cast<int>(names.size()),
                     CpuParallelFor(ctx),
                     [&](int64 row, const T* g_row) {
                       T* row_data[kMaxVariables];
                       for (size_t i = 0; i < data.size(); ++i) {
                         row_data[i] = data[i] + row * width;
                       }
                       update(g_row, row_data, width);
                     },
                     [&](int64 row) {
                       for (T* d : data) RequestLines(d + row * width, width * sizeof(T), true);
                     });
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
    const bool amsgrad = amsgrad_;
    UpdateNamedRows<T, Tidx>(ctx, names, 4, 12, [&](const T* g, T* const* row, int64 width) {
      AdamRow(g, width, step, row[0], row[1], row[2], amsgrad ? row[3] : nullptr);
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
    UpdateNamedRows<T, Tidx>(ctx, {"var", "accumulator"}, 2, 8,
                             [&](const T* g, T* const* row, int64 width) {
                               AdagradRow(g, width, learning_rate, epsilon, row[0], row[1]);
                             });
  }
};

// Inputs: var, momentum_var (resources; momentum_var only with use_momentum), indices,
// gradient, learning_rate, momentum.
template <typename T, typename Tidx>
class SparseSgdRowsOp : public OpKernel {
 public:
  explicit SparseSgdRowsOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("use_momentum", &use_momentum_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("nesterov", &nesterov_));
  }

  void Compute(OpKernelContext* ctx) override {
    SgdStep<T> step;
    step.nesterov = nesterov_;
    OP_REQUIRES_OK(ctx, ReadScalar(ctx->input(4), "learning_rate", &step.learning_rate));
    OP_REQUIRES_OK(ctx, ReadScalar(ctx->input(5), "momentum", &step.momentum));
    std::vector<const char*> names = {"var"};
    if (use_momentum_) names.push_back("momentum_var");
    const bool use_momentum = use_momentum_;
    UpdateNamedRows<T, Tidx>(ctx, names, 2, 6, [&](const T* g, T* const* row, int64 width) {
      SgdRow(g, width, step, row[0], use_momentum ? row[1] : nullptr);
    });
  }

 private:
  bool use_momentum_ = false;
  bool nesterov_ = false;
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
                          SparseAdagradRowsOp<T, Tidx>);                                 \
  REGISTER_KERNEL_BUILDER(Name("Hsm>SparseSgdRows")                                      \
                              .Device(DEVICE_CPU)                                        \
                              .TypeConstraint<T>("T")                                    \
                              .TypeConstraint<Tidx>("Tidx"),                             \
                          SparseSgdRowsOp<T, Tidx>);
REGISTER_CPU(float, ::tensorflow::int32)
REGISTER_CPU(float, ::tensorflow::int64)
REGISTER_CPU(double, ::tensorflow::int32)
REGISTER_CPU(double, ::tensorflow::int64)
#undef REGISTER_CPU

}  // namespace tf_hsm
