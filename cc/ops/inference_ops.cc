// Registrations of the inference ops: shapes and documentation. Kernels live in
// cc/kernels/inference_kernels.cc. None of these ops has a gradient.
#include "cc/ops/shape_fns.h"
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/tensor.h"

namespace tf_hsm {

using ::tensorflow::Status;
using ::tensorflow::shape_inference::DimensionHandle;
using ::tensorflow::shape_inference::InferenceContext;
using ::tensorflow::shape_inference::ShapeHandle;


#define TF_HSM_TREE_DOC                                                                    \
  "child_begin: [num_nodes + 1]; node n's children are slots [child_begin[n], "           \
  "child_begin[n+1]).\n"                                                                   \
  "path_begin: [num_classes + 1]; class c's path is steps path_begin[c]..path_begin[c+1]-1.\n" \
  "path_nodes: [path_length]; the node visited at each path step, root first.\n"          \
  "path_slots: [path_length]; the slot taken at each path step.\n"

#define TF_HSM_DENSE_DOC                                                                   \
  "hidden: [..., D] hidden states.\n"                                                      \
  "weights: [num_slots, D], one row per tree edge (slot).\n"                               \
  "biases: [num_slots], or an empty vector for no bias.\n"

#define TF_HSM_SLOT_CHILD_DOC                                                              \
  "slot_child: [num_slots]; the child behind each slot: class c as c, internal node m as " \
  "num_classes + m (children are numbered after their parent).\n"

REGISTER_OP("Hsm>TopK")
    .Input("hidden: T")
    .Input("weights: T")
    .Input("biases: T")
    .Input("child_begin: int64")
    .Input("path_begin: int64")
    .Input("path_nodes: int64")
    .Input("path_slots: int64")
    .Input("slot_child: int64")
    .Output("log_probs: T")
    .Output("classes: int64")
    .Output("num_expanded: int64")
    .Attr("k: int >= 1")
    .Attr("T: {float, double}")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle batch, out;
      TF_RETURN_IF_ERROR(SoftmaxInputShapes(c, 3, 5, &batch));
      int64_t k;
      TF_RETURN_IF_ERROR(c->GetAttr("k", &k));
      TF_RETURN_IF_ERROR(c->Concatenate(batch, c->Vector(k), &out));
      c->set_output(0, out);
      c->set_output(1, out);
      c->set_output(2, batch);
      return Status();
    })
    .Doc("The k most probable classes of each hidden row, exactly, by best-first search "
         "over the tree: nodes are expanded in decreasing order of their path "
         "log-probability until k classes are final.\n\n" TF_HSM_DENSE_DOC TF_HSM_TREE_DOC
         TF_HSM_SLOT_CHILD_DOC
         "k: the number of classes per row, 1 <= k <= num_classes.\n"
         "log_probs: [..., k] log-probabilities, decreasing along the last axis.\n"
         "classes: [..., k] the classes; equal log-probabilities are ordered by increasing "
         "class id, NaN log-probabilities come last.\n"
         "num_expanded: hidden's leading shape; internal nodes each row's search expanded "
         "(the root included).\n");

REGISTER_OP("Hsm>LogProbAll")
    .Input("hidden: T")
    .Input("weights: T")
    .Input("biases: T")
    .Input("class_range: int64")
    .Input("child_begin: int64")
    .Input("path_begin: int64")
    .Input("path_nodes: int64")
    .Input("path_slots: int64")
    .Input("slot_child: int64")
    .Output("log_probs: T")
    .Attr("T: {float, double}")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle batch, range, out;
      TF_RETURN_IF_ERROR(SoftmaxInputShapes(c, 4, 5, &batch));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(3), 1, &range));
      DimensionHandle two;
      TF_RETURN_IF_ERROR(c->WithValue(c->Dim(range, 0), 2, &two));
      DimensionHandle width = c->UnknownDim();
      const ::tensorflow::Tensor* value = c->input_tensor(3);
      if (value != nullptr && value->NumElements() == 2) {
        const auto v = value->flat<int64_t>();
        if (v(0) >= 0 && v(1) >= v(0)) width = c->MakeDim(v(1) - v(0));
      }
      TF_RETURN_IF_ERROR(c->Concatenate(batch, c->Vector(width), &out));
      c->set_output(0, out);
      return Status();
    })
    .Doc("log P(c | hidden) for every class c in class_range, each node's log-softmax "
         "computed once per row and accumulated down the tree. Only the nodes on paths to "
         "classes in the range are evaluated.\n\n" TF_HSM_DENSE_DOC
         "class_range: [2] int64 (begin, end) with 0 <= begin <= end <= num_classes.\n"
         TF_HSM_TREE_DOC TF_HSM_SLOT_CHILD_DOC
         "log_probs: [..., end - begin]; log_probs[..., j] is class begin + j.\n");

REGISTER_OP("Hsm>Sample")
    .Input("hidden: T")
    .Input("weights: T")
    .Input("biases: T")
    .Input("seed: int64")
    .Input("temperature: T")
    .Input("child_begin: int64")
    .Input("path_begin: int64")
    .Input("path_nodes: int64")
    .Input("path_slots: int64")
    .Input("slot_child: int64")
    .Output("classes: int64")
    .Attr("T: {float, double}")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle batch, unused;
      TF_RETURN_IF_ERROR(SoftmaxInputShapes(c, 5, 5, &batch));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(3), 0, &unused));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(4), 0, &unused));
      c->set_output(0, batch);
      return Status();
    })
    .Doc("One class per hidden row by ancestral sampling: from the root, a child of the "
         "current node is drawn from softmax(logits / temperature) until a class is "
         "reached. The uniform number of row i (flattened) at path depth d is a "
         "splitmix64 hash of (seed, i, d), so the result depends only on the inputs and "
         "the seed. A row with NaN or +inf logits at a node it visits, or with all of a "
         "node's logits -inf, gets class -1.\n\n" TF_HSM_DENSE_DOC
         "seed: int64 scalar.\n"
         "temperature: scalar, positive and finite.\n" TF_HSM_TREE_DOC TF_HSM_SLOT_CHILD_DOC
         "classes: hidden's leading shape, int64.\n");

REGISTER_OP("Hsm>LogProbCandidates")
    .Input("hidden: T")
    .Input("weights: T")
    .Input("biases: T")
    .Input("candidates: Tidx")
    .Input("child_begin: int64")
    .Input("path_begin: int64")
    .Input("path_nodes: int64")
    .Input("path_slots: int64")
    .Output("log_probs: T")
    .Attr("T: {float, double}")
    .Attr("Tidx: {int32, int64} = DT_INT64")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle batch, candidates, lead, unused;
      TF_RETURN_IF_ERROR(SoftmaxInputShapes(c, 4, 4, &batch));
      TF_RETURN_IF_ERROR(c->WithRankAtLeast(c->input(3), 1, &candidates));
      TF_RETURN_IF_ERROR(c->Subshape(candidates, 0, -1, &lead));
      TF_RETURN_IF_ERROR(c->Merge(batch, lead, &unused));
      c->set_output(0, candidates);
      return Status();
    })
    .Doc("log P(candidates[..., m] | hidden[...]) for several candidate classes per row; "
         "a node's log-sum-exp is computed once per row however many candidates share "
         "it.\n\n" TF_HSM_DENSE_DOC
         "candidates: [..., M] class ids in [0, num_classes); the leading shape is "
         "hidden's.\n" TF_HSM_TREE_DOC
         "log_probs: candidates' shape.\n");

#undef TF_HSM_TREE_DOC
#undef TF_HSM_DENSE_DOC
#undef TF_HSM_SLOT_CHILD_DOC

}  // namespace tf_hsm
