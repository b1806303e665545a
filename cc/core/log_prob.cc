#include "cc/core/log_prob.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cc/core/log_prob_internal.h"
#include "cc/core/softmax_util.h"
#include "cc/core/wide_node.h"

namespace tf_hsm {
namespace log_prob_internal {
inline namespace TF_HSM_SIMD_ISA {
namespace {

// The forward keeps no logits, so its items can be larger than the backward's (kTokenTile,
// log_prob_backward.cc): fewer, longer work items for the large groups.
constexpr int64 kForwardTokenTile = 256;

// log_prob[i] = the sum of token i's steps through grouped nodes (zero if none).
template <typename T>
void GroupedForward(const VisitPlan& plan, const TreeView& tree, const SoftmaxParams<T>& p,
                    const ParallelFor& parallel_for, T* log_prob, std::uint64_t call) {
  const int64 num_entries = static_cast<int64>(plan.entry_token.size());
  std::vector<T> entry_value(num_entries);
  // Grouped nodes. No level ordering is needed: every entry writes only its own value.
  const std::vector<Item> items = TokenTiles(plan, tree, 0, plan.num_groups(), kForwardTokenTile);
  int64 total_cost = 0;
  for (const Item& it : items) {
    total_cost += it.count * BlockOf<T>(tree, plan.group_node[it.group]).size * p.dim;
  }
  const int64 cost = items.empty() ? 0 : 2 * total_cost / static_cast<int64>(items.size());
  parallel_for(static_cast<int64>(items.size()), cost, [&](int64 begin, int64 end) {
    for (int64 i = begin; i < end; ++i) {
      const Item& it = items[i];
      const int64 e0 = plan.group_begin[it.group] + it.offset;
      Scratch<T>& s = ThreadScratch<T>();
      T* lse = Grow(&s.lse, it.count);
      T* taken = Grow(&s.taken_logit, it.count);
      const NodeBlock<T> blk = BlockOf<T>(tree, plan.group_node[it.group]);
      NodeLogSumExp(p, plan, e0, it.count, blk, static_cast<T*>(nullptr), lse, taken, call);
      for (int64 r = 0; r < it.count; ++r) entry_value[e0 + r] = taken[r] - lse[r];
    }
  });
  // Wide groups, one at a time, each by partitions of its slots over the threads.
  for (int64 g = 0; g < plan.num_groups(); ++g) {
    if (!IsWideGroup(plan, tree, g)) continue;
    const int64 e0 = plan.group_begin[g], n = plan.group_begin[g + 1] - e0;
    std::vector<T> lse(n), taken(n, T(0));
    WideLogSumExp(p, plan, e0, n, BlockOf<T>(tree, plan.group_node[g]), parallel_for, call,
                  lse.data(), taken.data());
    for (int64 r = 0; r < n; ++r) entry_value[e0 + r] = taken[r] - lse[r];
  }
  SumGroupedEntries(plan, tree, entry_value, log_prob);
}

}  // namespace
}  // namespace TF_HSM_SIMD_ISA
}  // namespace log_prob_internal

using log_prob_internal::BackwardMode;
using log_prob_internal::BackwardOptions;
using log_prob_internal::call_counter;
using log_prob_internal::GroupedForward;
using log_prob_internal::RunBackwardPass;
using log_prob_internal::SavedLogitOffsets;
using log_prob_internal::WalkCostPerToken;
using log_prob_internal::WalkOutputs;
using log_prob_internal::WalkPath;

int64 SavedLogitsSize(const VisitPlan& plan, const TreeView& tree) {
  return SavedLogitOffsets(plan, tree).back() + plan.num_steps() * plan.max_walked_branching;
}

template <typename T>
void LogProbForward(const VisitPlan& plan, const TreeView& tree, const SoftmaxParams<T>& p,
                    const ParallelFor& parallel_for, T* log_prob, T* saved_logits,
                    T* saved_directions) {
  if (saved_logits != nullptr) {
    // The walked steps' coefficients take max_walked_branching values a path step; a step
    // through a smaller node, or a grouped one, leaves the rest of its stride unwritten.
    // Zeros there make the output the same bits on every call (the backward never reads
    // them): a few values a token, against the grouped logits' one per visit and child.
    const int64 walked_begin = SavedLogitOffsets(plan, tree).back();
    std::fill(saved_logits + walked_begin, saved_logits + SavedLogitsSize(plan, tree), T(0));
    // Everything as the backward computes it, up to the upstream gradient.
    LogProbGrads<T> grads;
    grads.hidden = saved_directions;
    grads.log_prob_from_backward = log_prob;
    BackwardOptions<T> options;
    options.mode = BackwardMode::kSaveForGradient;
    options.coef_budget = 0;
    options.saved_out = saved_logits;
    RunBackwardPass<T>(plan, tree, p, nullptr, parallel_for, grads, options);
    return;
  }
  GroupedForward(plan, tree, p, parallel_for, log_prob, ++call_counter);
  if (plan.max_walked_branching == 0) return;
  // Then each token's walked steps, in path order.
  WalkOutputs<T> value_only;
  value_only.value = true;
  parallel_for(plan.num_tokens, WalkCostPerToken(plan, p.dim), [&](int64 begin, int64 end) {
    for (int64 i = begin; i < end; ++i) log_prob[i] += WalkPath<T>(plan, tree, p, i, value_only);
  });
}

#define TF_HSM_INSTANTIATE(T)                                                             \
  template void LogProbForward<T>(const VisitPlan&, const TreeView&, const SoftmaxParams<T>&, \
                                  const ParallelFor&, T*, T*, T*);
TF_HSM_INSTANTIATE(float)
TF_HSM_INSTANTIATE(double)
#undef TF_HSM_INSTANTIATE

}  // namespace tf_hsm
