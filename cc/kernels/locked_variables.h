// The resource variables a kernel updates in place: looked up, checked distinct, locked in
// address order (two kernels over the same variables cannot deadlock) and made safe to
// update in place; shared by the fused training steps and the sparse optimizers' row
// updates.
#ifndef TF_HSM_CC_KERNELS_LOCKED_VARIABLES_H_
#define TF_HSM_CC_KERNELS_LOCKED_VARIABLES_H_

#include <algorithm>
#include <vector>

#include "cc/kernels/hsm_inputs.h"
#include "cc/kernels/tf_names.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_var.h"

namespace tf_hsm {

// The variables at `inputs`, called `names` in errors; variable i must have the shape of
// variable like[i] (-1: any). Their dtype must be T, that of the input `dtype_source`.
// ok() is false when the kernel's context holds the error.
template <typename T>
class LockedVariables {
 public:
  LockedVariables(OpKernelContext* ctx, const std::vector<int>& inputs,
                  const std::vector<const char*>& names, const std::vector<int>& like,
                  const char* dtype_source) {
    vars_.resize(inputs.size());
    for (size_t i = 0; i < inputs.size(); ++i) {
      OP_REQUIRES_OK(ctx, LookupResource(ctx, HandleFromInput(ctx, inputs[i]), &vars_[i]));
      for (size_t j = 0; j < i; ++j) {
        OP_REQUIRES(ctx, vars_[i].get() != vars_[j].get(),
                    errors::InvalidArgument(names[j], " and ", names[i],
                                            " must be different variables"));
      }
    }
    for (const auto& var : vars_) locked_.push_back(var->mu());
    std::sort(locked_.begin(), locked_.end());
    for (auto* mu : locked_) mu->lock();
    tensors_.resize(inputs.size());
    for (size_t i = 0; i < inputs.size(); ++i) {
      OP_REQUIRES_OK(ctx, ExclusiveTensor<T>(ctx, vars_[i].get(), names[i], dtype_source,
                                             &tensors_[i]));
      if (like[i] < 0) continue;
      const Tensor& model = *tensors_[like[i]];
      OP_REQUIRES(ctx, tensors_[i]->shape() == model.shape(),
                  errors::InvalidArgument(names[i], " has shape ",
                                          tensors_[i]->shape().DebugString(), " but ",
                                          names[like[i]], " has ",
                                          model.shape().DebugString()));
    }
    ok_ = true;
  }
  ~LockedVariables() {
    for (auto* mu : locked_) mu->unlock();
  }
  LockedVariables(const LockedVariables&) = delete;
  LockedVariables& operator=(const LockedVariables&) = delete;

  bool ok() const { return ok_; }
  Tensor* tensor(int i) const { return tensors_[i]; }
  T* data(int i) const { return tensors_[i]->template flat<T>().data(); }

 private:
  std::vector<::tensorflow::core::RefCountPtr<Var>> vars_;
  std::vector<::tensorflow::mutex*> locked_;
  std::vector<Tensor*> tensors_;
  bool ok_ = false;
};

// *value = the scalar tensor t, named `name` in the error if it is not a scalar.
template <typename T>
Status ReadScalar(const Tensor& t, const char* name, T* value) {
  if (t.dims() != 0) {
    return errors::InvalidArgument(name, " must be a scalar, got shape ", t.shape().DebugString());
  }
  *value = t.scalar<T>()();
  return Status();
}

}  // namespace tf_hsm

#endif  // TF_HSM_CC_KERNELS_LOCKED_VARIABLES_H_
