// The exact softmax's inference (a one-node tree whose children are the classes in order:
// Tree.flat) as blocked matrix products: the whole table is one node, so the sweep's row
// blocks and row-direction kernels (which stream the table once per 16 to 64 rows) give
// way to the log_prob core's outer-product tiles over all rows at once, each packed tile
// of weight rows serving every row. Private to the inference ops (cc/core/inference_*.cc).
#ifndef TF_HSM_CC_CORE_INFERENCE_FLAT_H_
#define TF_HSM_CC_CORE_INFERENCE_FLAT_H_

#include <vector>

#include "cc/core/inference_common.h"

namespace tf_hsm {
namespace inference_internal {
inline namespace TF_HSM_SIMD_ISA {

// Whether the blocked path serves this call: a tree of one node whose children are the
// classes 0, 1, ... in order, wider than a logits tile, and at least kPackMinRows rows
// (fewer use the sweep's kernels, chosen by the batch size alone as everywhere).
bool FlatPathFits(const TreeView& tree, int64 num_rows);

// LogProbAll's contract (inference.h) for a tree FlatPathFits accepts: out[r * width + c]
// = log P(class_begin + c | row r), width = class_end - class_begin. The node's slots are
// cut into partitions of whole tiles that depend on its width only; each writes its
// logits for every row straight into the output (its tiles outside the class range
// through scratch) while folding them into a (max, sum) per row, the partitions merge in
// their order, and a last pass subtracts each row's log-sum-exp in place.
template <typename T>
void FlatLogProbAll(const TreeView& tree, const SoftmaxParams<T>& p, int64 num_rows,
                    int64 class_begin, int64 class_end, const ParallelFor& parallel_for,
                    T* out);

// TopK takes FlatTopK for k up to this (its kept logits, rows x 8 partitions x (k + 8),
// are then bounded by the chunks of rows it is called on; a larger k is the search's).
constexpr int64 kFlatTopKMaxK = 1024;

// TopK's contract (inference.h) for a tree FlatPathFits accepts: one pass of the same
// products keeps each row's best k + 8 logits per partition besides its (max, sum); their
// values (computed as the search computes a class's: 0 + (logit - lse)) are then sorted
// by value and class. A row is left to the search, and returned, where that cannot be
// exact: a non-finite log-sum-exp (a NaN or infinite logit), or a partition that dropped a
// logit whose value reaches the k-th (ties at the k-th value beyond the spare entries).
// num_expanded is 1 (the root) for every row settled here.
template <typename T>
std::vector<int64> FlatTopK(const TreeView& tree, const SoftmaxParams<T>& p, int64 num_rows,
                            int64 k, const ParallelFor& parallel_for, T* log_probs,
                            int64* classes, int64* num_expanded);

}  // namespace TF_HSM_SIMD_ISA
}  // namespace inference_internal
}  // namespace tf_hsm

#endif  // TF_HSM_CC_CORE_INFERENCE_FLAT_H_
