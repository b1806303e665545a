// OpKernel for Hsm>SgdStep: the forward pass, then the backward pass with in-place SGD on
// the table's resource variables, under their locks.
#include <cstring>
#include <optional>

#include "cc/core/log_prob.h"
#include "cc/core/visit_plan.h"
#include "cc/kernels/hsm_inputs.h"
#include "cc/kernels/tf_names.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_var.h"

namespace tf_hsm {

namespace {

template <typename T>
class SgdStepOp : public OpKernel {
 public:
  explicit SgdStepOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("use_bias", &use_bias_));
  }

  void Compute(OpKernelContext* ctx) override {
    ::tensorflow::core::RefCountPtr<Var> weights_var, biases_var;
    OP_REQUIRES_OK(ctx, LookupResource(ctx, HandleFromInput(ctx, 1), &weights_var));
    if (use_bias_) {
      OP_REQUIRES_OK(ctx, LookupResource(ctx, HandleFromInput(ctx, 2), &biases_var));
      OP_REQUIRES(ctx, biases_var.get() != weights_var.get(),
                  errors::InvalidArgument("weights and biases must be different variables"));
    }
    ::tensorflow::mutex_lock weights_lock(*weights_var->mu());
    std::optional<::tensorflow::mutex_lock> biases_lock;
    if (use_bias_) {
      biases_lock.emplace(*biases_var->mu());
    }
    Tensor* weights = nullptr;
    Tensor* biases = nullptr;
    OP_REQUIRES_OK(ctx, ExclusiveTensor<T>(ctx, weights_var.get(), "weights", "hidden", &weights));
    Tensor no_bias(::tensorflow::DataTypeToEnum<T>::value, ::tensorflow::TensorShape({0}));
    if (use_bias_) {
      OP_REQUIRES_OK(ctx, ExclusiveTensor<T>(ctx, biases_var.get(), "biases", "hidden", &biases));
    } else {
      biases = &no_bias;
    }

    SoftmaxInputs in;
    OP_REQUIRES_OK(ctx, CheckSoftmaxTensors(ctx->input(0), *weights, *biases, &in));
    OP_REQUIRES(ctx, !use_bias_ || in.has_bias,
                errors::InvalidArgument("biases must have one entry per weight row"));
    TreeView tree;
    OP_REQUIRES_OK(ctx, ReadTree(ctx, 4, -1, weights->dim_size(0), &tree));
    const auto batch = BatchShape(*in.hidden);
    std::vector<int64> targets;
    OP_REQUIRES_OK(ctx, ReadClassIds(ctx->input(3), "targets", batch, &targets));
    const Tensor& scale = ctx->input(8);
    const Tensor& learning_rate = ctx->input(9);
    OP_REQUIRES(ctx, scale.shape() == batch,
                errors::InvalidArgument("loss_scale must have shape ", batch.DebugString(),
                                        ", got ", scale.shape().DebugString()));
    OP_REQUIRES(ctx, learning_rate.dims() == 0,
                errors::InvalidArgument("learning_rate must be a scalar, got shape ",
                                        learning_rate.shape().DebugString()));
    const PlanPool::Lease lease = plans_.Acquire();
    const VisitPlan& plan = *lease;
    const std::string problem = BuildVisitPlan(tree, targets.data(), in.num_tokens, lease.get());
    OP_REQUIRES(ctx, problem.empty(), errors::InvalidArgument(problem));

    Tensor *log_prob, *hidden_grad;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, batch, &log_prob));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, in.hidden->shape(), &hidden_grad));
    T* w = weights->flat<T>().data();
    T* b = use_bias_ ? biases->flat<T>().data() : nullptr;
    // The table is read and updated in place: params.weights aliases grads.sgd_weights.
    const SoftmaxParams<T> params = ParamsOf<T>(in);
    const ParallelFor parallel_for = CpuParallelFor(ctx);
    // d loss / d log_prob = -loss_scale.
    std::vector<T> upstream(in.num_tokens);
    const T* s = scale.flat<T>().data();
    for (int64 i = 0; i < in.num_tokens; ++i) upstream[i] = -s[i];
    LogProbGrads<T> grads;
    grads.hidden = hidden_grad->flat<T>().data();
    grads.sgd_update = true;
    grads.sgd_weights = w;
    grads.sgd_biases = b;
    grads.sgd_learning_rate = learning_rate.scalar<T>()();
    // The log-probabilities from the logsumexps the update needs anyway (no forward pass
    // over the grouped nodes, as in nll_loss); the rows are read before they are updated.
    grads.log_prob_from_backward = log_prob->flat<T>().data();
    const typename LeasePool<CoefficientStore<T>>::Lease store = stores_.Acquire();
    grads.coefficient_store = store.get();
    LogProbBackward<T>(plan, tree, params, upstream.data(), parallel_for, grads,
                       CoefficientBudget(plan, in.dim));
  }

 private:
  bool use_bias_ = false;
  PlanPool plans_;
  LeasePool<CoefficientStore<T>> stores_;
};

#define REGISTER_CPU(T)                                                                   \
  REGISTER_KERNEL_BUILDER(Name("Hsm>SgdStep").Device(DEVICE_CPU).TypeConstraint<T>("T"), \
                          SgdStepOp<T>);
REGISTER_CPU(float)
REGISTER_CPU(double)
#undef REGISTER_CPU

}  // namespace
}  // namespace tf_hsm
