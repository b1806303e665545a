// Wide groups: a node with many children visited by many tokens of the batch (the root
// of a flat tree, which is the exact softmax; a head of frequent classes; the root of a
// two-level tree). Private to the log_prob core (cc/core/log_prob.cc and
// cc/core/log_prob_backward.cc).
//
// A wide group's slots are split into a few partitions of whole logits tiles, a number
// that depends on the node's width only (so results never depend on the threads). The
// threads take partitions: each runs, per tile of its slots, all of the group's tokens
// against that tile's weight rows, whose packed panels stay in cache while every token
// tile reuses them; it owns its slots' weight-gradient rows (no reduction over threads)
// and keeps its own share of the tokens' hidden gradient, which is summed over the
// partitions in their order. The forward keeps a running (max, sum) per token and
// partition, merged in partition order; the gradient recomputes each tile of logits
// from the log-sum-exp instead of keeping [tokens x children] values.
#ifndef TF_HSM_CC_CORE_WIDE_NODE_H_
#define TF_HSM_CC_CORE_WIDE_NODE_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "cc/core/log_prob_internal.h"

namespace tf_hsm {
namespace log_prob_internal {
inline namespace TF_HSM_SIMD_ISA {

constexpr int64 kWideTokenTile = 64;    // tokens per logits tile of a wide group
constexpr int64 kWideMaxPartitions = 8;
constexpr int64 kWidePartitionSlots = 512;  // about this many slots a partition, at least

// The partitions of a node of K slots: between 2 and kWideMaxPartitions ranges of whole
// kSlotTile tiles, as equal as the tiles allow.
inline std::vector<SlotRange> WidePartitions(int64 K) {
  const int64 tiles = (K + kSlotTile - 1) / kSlotTile;
  return TileRanges(K, std::min(tiles, std::clamp<int64>(K / kWidePartitionSlots, 2,
                                                         kWideMaxPartitions)));
}

// One partition's slots [range) folded into its running (max, sum) for every token of
// the group, slot tile by slot tile; taken[r] receives the entry's own logit when its
// slot lies in the range.
template <typename T>
void WidePartitionFold(const SoftmaxParams<T>& p, const VisitPlan& plan, int64 e0, int64 n,
                       const NodeBlock<T>& blk, SlotRange range, std::uint64_t call,
                       T* row_max, T* row_sum, T* taken) {
  Scratch<T>& s = ThreadScratch<T>();
  const T** rows = Grow(&s.rows, n);
  for (int64 r = 0; r < n; ++r) rows[r] = p.hidden + plan.entry_token[e0 + r] * p.dim;
  T* tile = Grow(&s.tile, kWideTokenTile * kSlotTile);
  StartLogSumExp(n, row_max, row_sum);
  // Slot tiles outside, token tiles inside, so a tile's packed rows serve every token.
  for (int64 k0 = range.begin; k0 < range.end; k0 += kSlotTile) {
    const int64 kb = std::min(kSlotTile, range.end - k0);
    for (int64 t0 = 0; t0 < n; t0 += kWideTokenTile) {
      TileFold<T> fold;
      fold.entry_slot = plan.entry_slot.data() + e0 + t0;
      fold.taken = taken != nullptr ? taken + t0 : nullptr;
      FoldLogitsTile(p, rows + t0, std::min(kWideTokenTile, n - t0), blk, k0, kb, tile, kb,
                     call, static_cast<const T*>(nullptr), row_max + t0, row_sum + t0, fold);
    }
  }
}

// lse[r] (and taken[r], the entry's own logit, where taken is set) for the n entries
// [e0, e0 + n) of a wide group: the partitions in parallel, merged in their order.
template <typename T>
void WideLogSumExp(const SoftmaxParams<T>& p, const VisitPlan& plan, int64 e0, int64 n,
                   const NodeBlock<T>& blk, const ParallelFor& parallel_for,
                   std::uint64_t call, T* lse, T* taken) {
  const std::vector<SlotRange> parts = WidePartitions(blk.size);
  const int64 P = static_cast<int64>(parts.size());
  std::vector<T> part_max(P * n), part_sum(P * n);
  parallel_for(P, 2 * n * (blk.size / P) * p.dim, [&](int64 begin, int64 end) {
    for (int64 q = begin; q < end; ++q) {
      WidePartitionFold(p, plan, e0, n, blk, parts[q], call, part_max.data() + q * n,
                        part_sum.data() + q * n, taken);
    }
  });
  MergeLogSumExps(P, n, part_max.data(), part_sum.data(), lse);
}

}  // namespace TF_HSM_SIMD_ISA
}  // namespace log_prob_internal
}  // namespace tf_hsm

#endif  // TF_HSM_CC_CORE_WIDE_NODE_H_
