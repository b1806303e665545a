// log P(target | h) of a hierarchical softmax and its gradient on a CUDA GPU: the contract
// of log_prob.h (same formula, same sparse weight-gradient rows in plan.group_row order),
// computed by the kernels in log_prob_gpu.cu.
//
// Plain C++: no CUDA or TensorFlow header is needed to include this file (a stream is
// passed as the opaque CUstream_st*, which is what cudaStream_t is), so the TensorFlow
// kernels can call it while the CUDA code is compiled by nvcc alone.
//
// How a call goes:
//  1. The caller builds the VisitPlan on the host from host copies of the targets and the
//     tree (BuildVisitPlan also validates them), exactly as the CPU op does.
//  2. PrepareLogProbGpu turns the plan into work lists (which tile of which node each CUDA
//     block computes) and sizes a workspace. This is host work, O(visits).
//  3. The caller allocates workspace_bytes of device memory (any allocator; 16-byte
//     alignment is enough) and calls LogProbForwardGpu or LogProbBackwardGpu with device
//     pointers. One asynchronous host-to-device copy uploads the work lists, then the
//     kernels run on the given stream; nothing synchronises with the host.
// Building the plan on the host keeps the GPU code free of sorting and keeps the grouping
// identical to the CPU op; its cost is one pass over the batch's visits, and the targets
// and the tree must be in host memory (the TensorFlow kernels declare them HostMemory).
//
// The kernels:
//  - Forward: for each (path position, node) group, logits are tiles of a small GEMM
//    (64 or 16 tokens x 64 slots, over D in steps of 16) in shared memory with float32
//    (float) or float64 (double) accumulation; each tile folds into an online logsumexp,
//    and a node with more than 256 children is split into chunks of 256 slots whose
//    partial (max, sum) are combined in a fixed order, so no branching factor is too big
//    for shared memory. Nodes with at most 32 children use a warp per visit instead.
//  - Backward: logits are recomputed and kept as coefficients upstream * (onehot - p) in
//    a workspace buffer of at most coef_budget elements (larger batches run in waves of
//    whole (group, token range) slices; a single slice always fits). Then dh += coef @ W
//    level by level, and dW = coef^T @ [H | 1] (the column of ones gives db).
//  - Determinism: no atomics. Every output element is owned by one thread and is one
//    chain of fused multiply-adds in a fixed order: dh over (level, slot), dW and db over
//    the group's tokens in plan order, continued across waves through memory. Results are
//    bitwise reproducible run to run and equal (up to the sign of zeros) for any
//    coef_budget.
// All sizes and offsets are int64.
#ifndef TF_HSM_CC_CORE_LOG_PROB_GPU_H_
#define TF_HSM_CC_CORE_LOG_PROB_GPU_H_

#include <string>
#include <vector>

#include "cc/core/log_prob.h"
#include "cc/core/tree_view.h"
#include "cc/core/visit_plan.h"

struct CUstream_st;

namespace tf_hsm {

// A cudaStream_t.
using GpuStream = CUstream_st*;

// Default bound (elements) on the backward pass's coefficient buffer: 256 MB in float32.
constexpr int64 kDefaultGpuCoefBudget = int64{1} << 26;

// The host-side description of one forward or backward call; see PrepareLogProbGpu.
struct GpuLogProbPlan {
  struct Range {
    int64 begin = 0;  // first work item
    int64 count = 0;
  };
  // The part of a wave at one path position (tree level).
  struct Level {
    int64 entry_begin = 0, entry_end = 0;  // visits, a contiguous range of plan entries
    int64 small_entries = 0;               // of them, visits of nodes with <= 32 children
    Range dh_wide, dh_narrow;              // tiled dh work items
  };
  // Slices whose coefficients fit the buffer together, processed one after another.
  struct Wave {
    int64 entry_begin = 0, entry_end = 0;
    int64 small_entries = 0;
    int64 coef_elements = 0;
    Range logits_wide, logits_narrow;
    std::vector<Level> levels;
    Range dw[3];  // by node size: <= 4, <= 16, > 16 children
  };

  bool backward = false;
  bool has_bias = false;
  int64 value_bytes = 0;  // sizeof(T)
  int64 dim = 0;
  int64 num_tokens = 0, num_entries = 0, num_groups = 0, num_rows = 0, num_slices = 0;
  int64 num_partials = 0;

  // Uploaded to the start of the workspace (int64 words).
  std::vector<int64> staging;
  // Byte offsets of the arrays within the workspace.
  int64 slices = 0, items = 0, entry_token = 0, entry_slot = 0, entry_slice = 0;
  int64 token_begin = 0, token_entries = 0, group_row = 0, group_first = 0;
  int64 partial_max = 0, partial_sum = 0, taken = 0, lse = 0, coef = 0;
  int64 workspace_bytes = 0;
  std::vector<Wave> waves;
};

// Builds the work lists of a forward (backward = false) or backward call for plan, which
// must come from BuildVisitPlan on the same tree (it is not checked again). coef_budget
// bounds the backward pass's coefficient buffer in elements (at least one visit's worth is
// always used). Returns "" or a message.
template <typename T>
std::string PrepareLogProbGpu(const VisitPlan& plan, const TreeView& tree, int64 dim,
                              bool has_bias, bool backward, int64 coef_budget,
                              GpuLogProbPlan* out);

// log_prob[i] for every token (device pointers; p.biases may be null). workspace: at
// least plan.workspace_bytes of device memory. plan must be a forward plan.
template <typename T>
std::string LogProbForwardGpu(const GpuLogProbPlan& plan, const SoftmaxParams<T>& p,
                              T* log_prob, void* workspace, GpuStream stream);

// Gradients of sum_i upstream[i] * log_prob[i], as LogProbBackward (device pointers; rows
// plan.num_rows, bias_rows null without biases). plan must be a backward plan.
template <typename T>
std::string LogProbBackwardGpu(const GpuLogProbPlan& plan, const SoftmaxParams<T>& p,
                               const T* upstream, const LogProbGrads<T>& grads,
                               void* workspace, GpuStream stream);

}  // namespace tf_hsm

#endif  // TF_HSM_CC_CORE_LOG_PROB_GPU_H_
