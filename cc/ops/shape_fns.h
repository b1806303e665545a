// Shape-function pieces shared by every tf_hsm op registration.
#ifndef TF_HSM_CC_OPS_SHAPE_FNS_H_
#define TF_HSM_CC_OPS_SHAPE_FNS_H_

#include "tensorflow/core/framework/shape_inference.h"

namespace tf_hsm {

// Checks hidden [..., D], weights [S, D], biases [S] or [0] at inputs 0..2 and the rank-1
// tree tensors at inputs [first_tree, first_tree + num_tree). Sets *batch to hidden's
// leading shape.
inline ::tensorflow::Status SoftmaxInputShapes(
    ::tensorflow::shape_inference::InferenceContext* c, int first_tree, int num_tree,
    ::tensorflow::shape_inference::ShapeHandle* batch) {
  using ::tensorflow::shape_inference::DimensionHandle;
  using ::tensorflow::shape_inference::ShapeHandle;
  ShapeHandle hidden, weights, biases;
  TF_RETURN_IF_ERROR(c->WithRankAtLeast(c->input(0), 1, &hidden));
  TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 2, &weights));
  TF_RETURN_IF_ERROR(c->WithRank(c->input(2), 1, &biases));
  DimensionHandle dim;
  TF_RETURN_IF_ERROR(c->Merge(c->Dim(hidden, -1), c->Dim(weights, 1), &dim));
  for (int i = first_tree; i < first_tree + num_tree; ++i) {
    ShapeHandle unused;
    TF_RETURN_IF_ERROR(c->WithRank(c->input(i), 1, &unused));
  }
  return c->Subshape(hidden, 0, -1, batch);
}

}  // namespace tf_hsm

#endif  // TF_HSM_CC_OPS_SHAPE_FNS_H_
