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
//    and a node with more than 128 children is split into chunks of 128 slots
//    (kChunkSlots in log_prob_gpu_layout.cuh; wider for a node of more than 32K children,
//    so that a visit's partials stay bounded) whose partial (max, sum) are combined in a fixed
//    order, so no branching factor is too big for shared memory. Nodes with at most 32 children use a warp per visit instead.
//  - Backward: logits are recomputed and kept as coefficients upstream * (onehot - p) in
//    a workspace buffer of at most coef_budget elements (larger batches run in waves of
//    whole (group, token range) slices; a single slice always fits). Then dh += coef @ W
//    level by level, and dW = coef^T @ [H | 1] (the column of ones gives db); short
//    slices of small nodes (binary trees' deep levels) take a warp each instead of tiles.
//    A wide group whose coefficients exceed the budget (Tree.flat, a wide head) is cut by
//    children instead of tokens: its log-sum-exps first, then blocks of children against
//    all of its visits (GpuLogProbPlan::Wave), so its rows are read twice, not once per
//    token range, and the tiles stay 64 tokens tall. Token ranges remain for a group
//    whose visits alone exceed the budget at kChunkSlots children.
//  - Determinism: no atomics. Every output element is owned by one thread and is one
//    chain of fused multiply-adds in a fixed order: dh over (level, slot), dW and db over
//    the group's tokens in plan order, continued across waves through memory. Results are
//    bitwise reproducible run to run and equal (up to the sign of zeros) for any
//    coef_budget.
//  - Candidates (LogProbCandidatesGpu): the forward kernels over the distinct (row, node)
//    visits of the candidates, then each candidate's path summed root first.
// Numerics: float32 accumulation for float, expf/logf of CUDA's math library; results agree
// with the CPU core to rounding (the harness checks 1e-3 relative in float32, 1e-9 in
// float64), not bitwise (the CPU core sums in other orders and has its own float exp).
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

// The host-side description of one forward, backward or candidates call; see
// PrepareLogProbGpu and PrepareLogProbCandidatesGpu.
struct GpuLogProbPlan {
  struct Range {
    int64 begin = 0;  // first work item
    int64 count = 0;
  };
  // The part of a wave at one path position (tree level).
  struct Level {
    int64 visit_begin = 0, visit_end = 0;  // a contiguous range of visits
    int64 small_visits = 0;                // of them, visits of nodes with <= 32 children
    Range dh_wide, dh_narrow;              // tiled dh work items
  };
  // Slices whose coefficients fit the buffer together, processed one after another.
  struct Wave {
    // kCoefficients: logits kept, then the log-sum-exps, coefficients, dh and dW of the
    // wave's slices. A wide group (one whose [visits x children] coefficients exceed the
    // budget) takes a kLogSumExp wave (its logits folded into each visit's log-sum-exp,
    // nothing kept) and then one kSlotBlock wave per block of its children: the block's
    // logits recomputed for all of the group's visits and turned into coefficients as
    // they are computed, then dh and the block's dW, so the node's rows are read twice
    // and no buffer grows with its width.
    enum Kind { kCoefficients, kLogSumExp, kSlotBlock };
    Kind kind = kCoefficients;
    int64 visit_begin = 0, visit_end = 0;
    int64 small_visits = 0;
    int64 coef_elements = 0;
    Range logits_wide, logits_narrow;
    std::vector<Level> levels;
    Range dw[3];    // tiled, by node size: <= 4, <= 16, > 16 children
    Range dw_warp;  // a warp per slice: small nodes, at most 16 tokens
  };

  enum Mode { kForward, kBackward, kCandidates };
  Mode mode = kForward;
  bool has_bias = false;
  int64 value_bytes = 0;  // sizeof(T)
  int64 dim = 0;
  int64 num_tokens = 0, num_groups = 0, num_rows = 0, num_slices = 0, num_partials = 0;
  // Visits: (group, hidden row) pairs whose logsumexp is computed; one per plan entry,
  // except for candidates (one per distinct row of a group).
  int64 num_visits = 0;
  int64 num_candidates = 0;  // kCandidates: candidates per hidden row

  // Uploaded to the start of the workspace (int64 words).
  std::vector<int64> staging;
  // Byte offsets of the arrays within the workspace.
  int64 slices = 0, items = 0, visit_row = 0, visit_slot = 0, visit_slice = 0;
  int64 token_begin = 0, token_entries = 0, group_row = 0, group_first = 0;
  int64 cand_visit = 0, cand_slot = 0;
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

// The contract of LogProbCandidates (inference.h) on the GPU: out[i * M + m] =
// log P(candidates[i * M + m] | hidden row i), M = num_candidates. plan comes from
// BuildVisitPlan with the candidates as targets (candidate (i, m) is token i * M + m), as
// the CPU core builds it. A node's logsumexp is computed once per hidden row however many
// of the row's candidates pass through it; a candidate equal to a LogProbForwardGpu target
// gets the same bits.
template <typename T>
std::string PrepareLogProbCandidatesGpu(const VisitPlan& plan, const TreeView& tree, int64 dim,
                                        bool has_bias, int64 num_candidates,
                                        GpuLogProbPlan* out);

template <typename T>
std::string LogProbCandidatesGpu(const GpuLogProbPlan& plan, const SoftmaxParams<T>& p, T* out,
                                 void* workspace, GpuStream stream);

}  // namespace tf_hsm

#endif  // TF_HSM_CC_CORE_LOG_PROB_GPU_H_
