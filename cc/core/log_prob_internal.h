// What the CPU log_prob core shares between its two files, private to them: the forward
// (cc/core/log_prob.cc) and the backward (cc/core/log_prob_backward.cc, which also runs
// the part of the backward that the saving forward asks for). Per-thread scratch, a node's
// weight block, the walk of a token's steps through small nodes, the logits kernels and the
// one tile loop that folds a node's logits into its logsumexp (for the forward, the
// backward and the wide groups of wide_node.h), the token-tile work items, the sum of the grouped entries'
// values, where the saving forward keeps its values, and the backward pass's options.
//
// Not an anonymous namespace: the per-thread scratch, the packed-panel cache and the call
// counter are each one for both files, as they were when the two passes shared one file.
#ifndef TF_HSM_CC_CORE_LOG_PROB_INTERNAL_H_
#define TF_HSM_CC_CORE_LOG_PROB_INTERNAL_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "cc/core/log_prob.h"
#include "cc/core/prefetch.h"
#include "cc/core/simd.h"
#include "cc/core/softmax_util.h"
#include "cc/core/walk_softmax.h"

namespace tf_hsm {
namespace log_prob_internal {
// Per instruction set, like simd.h (see cc/core/simd_isa.h).
inline namespace TF_HSM_SIMD_ISA {

using walk_softmax::WalkSoftmaxAll;
using walk_softmax::WalkStep;

constexpr int64 kPackMinTokens = 16;  // fewer tokens use the unpacked dot-product kernel

// Per-thread scratch, grown on demand and reused, so no work item allocates per token.
template <typename T>
struct Scratch {
  std::vector<T> tile, row_max, row_sum, taken_logit, lse, panels, sgd_rows, sgd_bias,
      dh_acc, logits, doubled_rows, exps;
  std::vector<WalkStep<T>> walk_steps;
  std::vector<T> walk_z, walk_coef, visit_upstream;
  std::vector<const T*> walk_rows, visit_coefs;
  std::vector<const T*> rows;
  std::vector<T*> out_rows;
};

template <typename T>
Scratch<T>& ThreadScratch() {
  thread_local Scratch<T> scratch;
  return scratch;
}

// The weight block of one node.
template <typename T>
struct NodeBlock {
  int64 first_slot;
  int64 size;
};

template <typename T>
NodeBlock<T> BlockOf(const TreeView& tree, int64 node) {
  return {tree.child_begin[node], tree.child_begin[node + 1] - tree.child_begin[node]};
}

// Asks the memory system for a node's rows of `table` (to read, or to update in place),
// which are scattered cache misses in a large table.
template <typename T>
void RequestRows(const T* table, const NodeBlock<T>& blk, int64 dim, bool for_update) {
  RequestLines(table + blk.first_slot * dim, blk.size * dim * static_cast<int64>(sizeof(T)),
               for_update);
}

// What WalkPath computes for token i's steps through small nodes.
template <typename T>
struct WalkOutputs {
  bool value = false;  // return the sum of the steps' log-probability terms
  // The gradient pass: the steps' unit coefficients (onehot(taken) - softmax) and, where
  // direction is set (null when D = 0), direction += every step's unit coef @ W (the
  // gradient of the token's log-probability with respect to its hidden row).
  bool coefficients = false;
  T* direction = nullptr;
  // With coefficients, where they are kept: step s = plan.token_step_begin[i] + l stores
  // its unit coefficients at kept_coefs[s * stride]. Null: not kept.
  T* kept_coefs = nullptr;
  int64 stride = 0;
};

// Token i's steps through small nodes, in path order (see WalkOutputs). The steps are
// gathered first, their rows requested from memory all at once (they sit at random places
// in the table); then all their logits, all the softmaxes, and the direction.
template <typename T>
T WalkPath(const VisitPlan& plan, const TreeView& tree, const SoftmaxParams<T>& p, int64 i,
           const WalkOutputs<T>& out) {
  const int64 D = p.dim;
  const int64 depth = plan.token_step_begin[i + 1] - plan.token_step_begin[i];
  const int64 step0 = plan.token_step_begin[i];
  const bool grad = out.coefficients;
  Scratch<T>& s = ThreadScratch<T>();
  WalkStep<T>* steps = Grow(&s.walk_steps, depth);
  const T** rows = Grow(&s.walk_rows, depth * kWalkMaxBranching);
  int64 num_steps = 0, n = 0;
  for (int64 l = 0; l < depth; ++l) {
    const int64 node = plan.step_node[step0 + l];
    const NodeBlock<T> blk = BlockOf<T>(tree, node);
    const int64 first = blk.first_slot, k = blk.size;
    if (k > kWalkMaxBranching) continue;
    const T* w = p.weights + first * D;
    RequestRows(p.weights, blk, D, false);
    steps[num_steps++] = {n, k, plan.step_slot[step0 + l] - first,
                          p.biases != nullptr ? p.biases + first : nullptr,
                          grad && out.kept_coefs != nullptr
                              ? out.kept_coefs + (step0 + l) * out.stride : nullptr};
    for (int64 j = 0; j < k; ++j) rows[n++] = w + j * D;
  }
  T* z = Grow(&s.walk_z, n);
  T* c = grad ? Grow(&s.walk_coef, n) : nullptr;
  const T* h = p.hidden + i * D;
  simd::DotScattered<T>(h, rows, n, D, z);
  T total = 0;
  WalkSoftmaxAll<T>(steps, num_steps, z, out.value, grad, &total, c);
  if (grad && out.direction != nullptr) simd::AccumulateScattered<T>(out.direction, rows, c, n, D);
  return total;
}

// Each call of LogProbForward / LogProbBackward takes a new number, so that per-thread
// caches of packed weights never outlive the call whose weights they copied.
inline std::atomic<std::uint64_t> call_counter{0};

// Most weight values of a block packed whole by BlockPanels (1 MiB of floats); a larger
// block is packed a tile at a time, so the scratch stays bounded whatever the width (a
// flat tree's one node at V = 1M, D = 300 would otherwise copy the 1.2 GB table per
// thread). Packing a tile costs D * kb moves against the 2 * nt * kb * D operations of the
// logits it serves: under 4% from the 16 tokens that use the packed kernel.
constexpr int64 kWholePackMaxValues = int64{1} << 18;

// The panels (simd::PackPanels) of the block's slots [k0, k0 + kb), k0 a multiple of the
// vector width: a slice of the whole block's panels, packed once per thread and call (a
// large group is split into token tiles that the same thread mostly takes one after the
// other, and each used to repack the block), or for a block of more than
// kWholePackMaxValues the tile's own, packed when the tile changes. The values are the
// same either way. Rows updated in place (sgd_step) are never read again in the same
// call, so a copy stays valid for the call.
template <typename T>
const T* BlockPanels(const SoftmaxParams<T>& p, const NodeBlock<T>& blk, int64 k0, int64 kb,
                     std::uint64_t call) {
  struct Cache {
    std::uint64_t call = 0;
    const T* weights = nullptr;
    int64 first_slot = -1, size = 0, dim = 0;
  };
  thread_local Cache cache;
  constexpr int64 lanes = simd::Vec<T>::kWidth;
  const bool whole = blk.size * p.dim <= kWholePackMaxValues;
  const int64 first = whole ? blk.first_slot : blk.first_slot + k0;
  const int64 size = whole ? blk.size : kb;
  T* panels = Grow(&ThreadScratch<T>().panels, (size + lanes - 1) / lanes * lanes * p.dim);
  if (cache.call != call || cache.weights != p.weights || cache.first_slot != first ||
      cache.size != size || cache.dim != p.dim) {
    simd::PackPanels<T>(p.weights + first * p.dim, p.dim, size, p.dim, panels);
    cache = {call, p.weights, first, size, p.dim};
  }
  return whole ? panels + k0 / lanes * lanes * p.dim : panels;
}

// tile[r * ld + j] = z_{first_slot + j}(h_r) for r < nt, j < kb. With enough tokens to
// amortise it, the weight rows are first packed into panels for the outer-product kernel;
// the choice depends only on nt, which the plan fixes, so results never depend on threads.
// Otherwise simd::DotBlock, whose kernels all give the same bits.
// k0 is a multiple of kWidth whenever nt >= kPackMinTokens (tiles of kSlotTile or
// dW chunks of a multiple of 16 slots), so a tile's panels are a slice of the block's.
// With `saved` (the first entry's logits as LogProbForward saved them, saved[r * size + j]
// for slot j of the block) they are copied instead: the forward computed them with the
// same token tiles, hence the same kernels and bits.
template <typename T>
void Logits(const SoftmaxParams<T>& p, const T* const* rows, int64 nt,
            const NodeBlock<T>& blk, int64 k0, int64 kb, T* tile, int64 ld, std::uint64_t call,
            const T* saved = nullptr) {
  if (saved != nullptr) {
    for (int64 r = 0; r < nt; ++r) std::memcpy(tile + r * ld, saved + r * blk.size + k0, kb * sizeof(T));
    return;
  }
  const int64 first_slot = blk.first_slot + k0;
  const T* w = p.weights + first_slot * p.dim;
  const T* biases = p.biases == nullptr ? nullptr : p.biases + first_slot;
  static_assert(kPackMinTokens >= 4, "the packed kernel for blocks of four rows or more");
  if (nt >= kPackMinTokens && blk.size >= 4) {
    const T* panels = BlockPanels(p, blk, k0, kb, call);
    simd::DotRowsPacked<T>(rows, nt, panels, kb, p.dim, tile, ld, biases);  // adds them
    return;
  }
  simd::DotBlock<T>(rows, nt, w, p.dim, kb, p.dim, tile, ld);
  if (biases != nullptr) {
    for (int64 r = 0; r < nt; ++r)
      for (int64 j = 0; j < kb; ++j) tile[r * ld + j] += biases[j];
  }
}

// A node's logsumexp is folded tile by tile into a running (max, sum of exp(z - max)) per
// row: started at (-inf, 0) and finished as max + log(sum). The forward, the backward and
// the wide groups all fold through FoldLogitsTile, so the numerics are written here once.
template <typename T>
void StartLogSumExp(int64 n, T* row_max, T* row_sum) {
  for (int64 r = 0; r < n; ++r) {
    row_max[r] = -std::numeric_limits<T>::infinity();
    row_sum[r] = 0;
  }
}

template <typename T>
void FinishLogSumExp(int64 n, const T* row_max, const T* row_sum, T* lse) {
  for (int64 r = 0; r < n; ++r) lse[r] = row_max[r] + std::log(row_sum[r]);
}

// What folding a tile gives besides the rows' running (max, sum).
template <typename T>
struct TileFold {
  // taken[r] = the logit of slot entry_slot[r] (row r's own), when it lies in the tile.
  const int64* entry_slot = nullptr;
  T* taken = nullptr;
  // The one-pass backward's: exps[r * kSlotTile + j] = exp(z_j - the row's max after the
  // tile), for the caller's sum of exp * W rows; acc_rows[r] (acc_dim values, when set) is
  // that sum so far, rescaled with the running sum whenever the max grows.
  T* exps = nullptr;
  T* const* acc_rows = nullptr;
  int64 acc_dim = 0;
};

// Folds one row's n logits into (max, sum) keeping their exponentials in exps: the max
// grows first (rescaling the sum and acc, if set, by exp(old - new)), then the
// exponentials are written and added to the sum in slot order. (FoldLogSumExp adds them
// in vector lanes without writing them; the two orders round differently, and each path
// keeps the bits it has always had.)
template <typename T>
void FoldKeepingExps(const T* z, int64 n, T* row_max, T* row_sum, T* exps, T* acc,
                     int64 acc_dim) {
  T chunk_max = -std::numeric_limits<T>::infinity();
  for (int64 j = 0; j < n; ++j) chunk_max = z[j] > chunk_max ? z[j] : chunk_max;
  if (chunk_max > *row_max) {
    const T scale = std::exp(*row_max - chunk_max);
    *row_sum *= scale;
    if (acc != nullptr) {
      for (int64 d = 0; d < acc_dim; ++d) acc[d] *= scale;
    }
    *row_max = chunk_max;
  }
  // All logits so far -inf (masked children): their exponentials are 0, not NaN.
  const T shift = *row_max == -std::numeric_limits<T>::infinity() ? T(0) : *row_max;
  for (int64 j = 0; j < n; ++j) exps[j] = z[j] - shift;
  simd::ExpInPlace(exps, n);
  T sum = *row_sum;
  for (int64 j = 0; j < n; ++j) sum += exps[j];
  *row_sum = sum;
}

// One tile of logits, slots [k0, k0 + kb) of blk for rows[0..nt), into z (row r at
// z + r * ld; copied from `saved` when set, see Logits), each row then folded into
// (row_max[r], row_sum[r]) with what `fold` asks for besides.
template <typename T>
void FoldLogitsTile(const SoftmaxParams<T>& p, const T* const* rows, int64 nt,
                    const NodeBlock<T>& blk, int64 k0, int64 kb, T* z, int64 ld,
                    std::uint64_t call, const T* saved, T* row_max, T* row_sum,
                    const TileFold<T>& fold) {
  Logits(p, rows, nt, blk, k0, kb, z, ld, call, saved);
  for (int64 r = 0; r < nt; ++r) {
    const T* zr = z + r * ld;
    if (fold.taken != nullptr) {
      const int64 taken = fold.entry_slot[r] - blk.first_slot - k0;
      if (taken >= 0 && taken < kb) fold.taken[r] = zr[taken];
    }
    if (fold.exps == nullptr) {
      FoldLogSumExp(zr, kb, &row_max[r], &row_sum[r]);
    } else {
      FoldKeepingExps(zr, kb, &row_max[r], &row_sum[r], fold.exps + r * kSlotTile,
                      fold.acc_rows != nullptr ? fold.acc_rows[r] : nullptr, fold.acc_dim);
    }
  }
}

// The tile loop over a whole node for rows[0..nt): lse[r] = the logsumexp of row r's
// logits. keep: every logit kept, row r's at keep + r * blk.size; null: one tile at a time
// in scratch. after_tile(k0, kb) sees each tile (its fold.exps) before the next is
// computed. Returns the rows' sums (per-thread scratch, valid until the next call).
template <typename T, typename AfterTile>
const T* FoldNodeTiles(const SoftmaxParams<T>& p, const T* const* rows, int64 nt,
                       const NodeBlock<T>& blk, T* keep, std::uint64_t call, const T* saved,
                       const TileFold<T>& fold, T* lse, AfterTile&& after_tile) {
  Scratch<T>& s = ThreadScratch<T>();
  T* tile = keep != nullptr ? nullptr : Grow(&s.tile, nt * kSlotTile);
  T* row_max = Grow(&s.row_max, nt);
  T* row_sum = Grow(&s.row_sum, nt);
  StartLogSumExp(nt, row_max, row_sum);
  const int64 ld = keep != nullptr ? blk.size : kSlotTile;
  for (int64 k0 = 0; k0 < blk.size; k0 += kSlotTile) {
    const int64 kb = std::min(kSlotTile, blk.size - k0);
    FoldLogitsTile(p, rows, nt, blk, k0, kb, keep != nullptr ? keep + k0 : tile, ld, call, saved,
                   row_max, row_sum, fold);
    after_tile(k0, kb);
  }
  FinishLogSumExp(nt, row_max, row_sum, lse);
  return row_sum;
}

// For the tokens entries[0..nt) of a group: log-sum-exp over the node's slots and the
// taken logit. When keep != nullptr, the logits are also written to keep[r * K + j].
template <typename T>
void NodeLogSumExp(const SoftmaxParams<T>& p, const VisitPlan& plan, int64 e0, int64 nt,
                   const NodeBlock<T>& blk, T* keep, T* lse, T* taken_logit,
                   std::uint64_t call, const T* saved = nullptr) {
  const T** rows = Grow(&ThreadScratch<T>().rows, nt);
  for (int64 r = 0; r < nt; ++r) rows[r] = p.hidden + plan.entry_token[e0 + r] * p.dim;
  TileFold<T> fold;
  fold.entry_slot = plan.entry_slot.data() + e0;
  fold.taken = taken_logit;
  FoldNodeTiles(p, rows, nt, blk, keep, call, saved, fold, lse, [](int64, int64) {});
}

// Work items: (group, first entry offset within the group) in tiles of `tile` tokens.
struct Item {
  int64 group;
  int64 offset;
  int64 count;
};

// Rough scalar operations per token of a walk, for the thread pool's shard sizes.
inline int64 WalkCostPerToken(const VisitPlan& plan, int64 dim) {
  if (plan.num_tokens == 0) return 0;
  return 6 * dim * (1 + plan.num_steps() / plan.num_tokens);
}

// Nodes of at least kWideMinSlots children visited by at least kWideMinTokens tokens of
// the batch form wide groups (cc/core/wide_node.h): computed a partition of slots per
// thread instead of a tile of tokens per thread. The choice depends on the plan only.
constexpr int64 kWideMinSlots = 1024;
constexpr int64 kWideMinTokens = 128;

inline bool IsWideGroup(const VisitPlan& plan, const TreeView& tree, int64 g) {
  const int64 node = plan.group_node[g];
  return tree.child_begin[node + 1] - tree.child_begin[node] >= kWideMinSlots &&
         plan.group_begin[g + 1] - plan.group_begin[g] >= kWideMinTokens;
}

// Walked groups (small nodes) and wide groups are left out.
inline std::vector<Item> TokenTiles(const VisitPlan& plan, const TreeView& tree,
                                    int64 g_begin, int64 g_end, int64 tile) {
  std::vector<Item> items;
  for (int64 g = g_begin; g < g_end; ++g) {
    if (IsWalked(tree, plan.group_node[g]) || IsWideGroup(plan, tree, g)) continue;
    const int64 n = plan.group_begin[g + 1] - plan.group_begin[g];
    for (int64 o = 0; o < n; o += tile) items.push_back({g, o, std::min(tile, n - o)});
  }
  return items;
}

// log_prob[i] = the sum of entry_value over token i's visits of grouped nodes, root first
// (entries are stored level by level), so every caller sums in the same order.
template <typename T>
void SumGroupedEntries(const VisitPlan& plan, const TreeView& tree,
                       const std::vector<T>& entry_value, T* log_prob) {
  std::fill(log_prob, log_prob + plan.num_tokens, T(0));
  for (int64 g = 0; g < plan.num_groups(); ++g) {
    if (IsWalked(tree, plan.group_node[g])) continue;
    for (int64 e = plan.group_begin[g]; e < plan.group_begin[g + 1]; ++e) {
      log_prob[plan.entry_token[e]] += entry_value[e];
    }
  }
}

// Where the saving forward keeps the grouped nodes' logits: group g's entry e (in plan
// order) and slot j of its node at offsets[g] + (e - plan.group_begin[g]) * K + j, K the
// node's number of children; a wide group keeps only each entry's log-sum-exp, at
// offsets[g] + (e - plan.group_begin[g]), and its gradient recomputes the logits. The walked steps' unit coefficients follow from
// offsets[num_groups]: step s's at offsets[num_groups] + s * plan.max_walked_branching.
inline std::vector<int64> SavedLogitOffsets(const VisitPlan& plan, const TreeView& tree) {
  std::vector<int64> offsets(plan.num_groups() + 1, 0);
  for (int64 g = 0; g < plan.num_groups(); ++g) {
    const int64 node = plan.group_node[g];
    const int64 n = IsWalked(tree, node) ? 0 : plan.group_begin[g + 1] - plan.group_begin[g];
    const int64 per_entry =
        IsWideGroup(plan, tree, g) ? 1 : tree.child_begin[node + 1] - tree.child_begin[node];
    offsets[g + 1] = offsets[g] + n * per_entry;
  }
  return offsets;
}

// What one run of the backward pass computes.
enum class BackwardMode {
  // LogProbBackward: dh, and the weight and bias gradient rows or, with
  // LogProbGrads::sgd_update, the in-place SGD update of the table.
  kGradient,
  // The forward pass of a log_prob whose gradient comes later: the part of the backward
  // that needs no upstream gradient. The log-probabilities go to
  // grads.log_prob_from_backward, the grouped nodes' logits and the walked steps' unit
  // coefficients to BackwardOptions::saved_out (SavedLogitOffsets), the tokens'
  // directions to grads.hidden; no weight gradient. The gradient given these reads no
  // weight row for dh and walks no path, and every output has the bits of the backward
  // that computes them itself.
  kSaveForGradient,
};

template <typename T>
struct BackwardOptions {
  BackwardMode mode = BackwardMode::kGradient;
  // Most softmax coefficients kept between the phases of a level (CoefficientBudget).
  int64 coef_budget = kDefaultCoefBudget;
  T* saved_out = nullptr;  // kSaveForGradient: SavedLogitsSize(plan, tree) values
};

// Runs BackwardPass (cc/core/log_prob_backward.cc) over a plan, for T float or double:
// the saving forward's pass.
template <typename T>
void RunBackwardPass(const VisitPlan& plan, const TreeView& tree, const SoftmaxParams<T>& p,
                     const T* upstream, const ParallelFor& parallel_for,
                     const LogProbGrads<T>& grads, const BackwardOptions<T>& options);

}  // namespace TF_HSM_SIMD_ISA
}  // namespace log_prob_internal
}  // namespace tf_hsm

#endif  // TF_HSM_CC_CORE_LOG_PROB_INTERNAL_H_
