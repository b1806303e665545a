// The TensorFlow names every kernel file uses, declared once in namespace tf_hsm so a
// kernel reads as OpKernelContext, Status, errors::InvalidArgument rather than spelling
// ::tensorflow:: each time. Only the kernels' .cc files include it: the headers they
// share (hsm_inputs.h, the functor headers) keep the qualified names, so the short ones
// never reach a file that includes those.
#ifndef TF_HSM_CC_KERNELS_TF_NAMES_H_
#define TF_HSM_CC_KERNELS_TF_NAMES_H_

#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_var.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor_shape.h"
#include "tensorflow/core/framework/types.h"
#include "tensorflow/core/lib/core/errors.h"

namespace tf_hsm {

using ::tensorflow::DEVICE_CPU;
using ::tensorflow::DEVICE_GPU;
using ::tensorflow::DT_INT32;
using ::tensorflow::DT_INT64;
using ::tensorflow::DT_INT8;
using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Status;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShape;
using ::tensorflow::Var;
namespace errors = ::tensorflow::errors;

}  // namespace tf_hsm

#endif  // TF_HSM_CC_KERNELS_TF_NAMES_H_
