// LogProbCandidates (see inference.h): the log-probabilities of given classes, each node's
// logsumexp computed once per row for all the row's candidates through it.
#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "cc/core/inference.h"
#include "cc/core/inference_common.h"
#include "cc/core/visit_plan.h"

namespace tf_hsm {
namespace inference_internal {
namespace {

constexpr int64 kCandidateRows = 64;  // rows per work item

struct CandidateItem {
  int64 group;
  int64 first;  // unique rows [first, first + count) of the group
  int64 count;
};

}  // namespace
}  // namespace inference_internal

template <typename T>
std::string LogProbCandidates(const TreeView& tree, const SoftmaxParams<T>& p,
                              int64 num_rows, const int64* candidates, int64 num_candidates,
                              const ParallelFor& parallel_for, T* out) {
  using namespace inference_internal;
  std::string err = CheckSizes(tree, num_rows, p.dim, false);
  if (!err.empty()) return err;
  if (num_candidates < 0) return Message("invalid number of candidates ", num_candidates);
  const int64 total = num_rows * num_candidates;
  for (int64 i = 0; i < total; ++i) {
    const int64 c = candidates[i];
    if (c < 0 || c >= tree.num_classes) {
      return Message("candidates[", i / num_candidates, ", ", i % num_candidates, "] = ", c,
                     " is not a class id in [0, ", tree.num_classes,
                     ") (indices over hidden's flattened leading dimensions)");
    }
  }
  // Candidate (row, m) is token row * num_candidates + m of a visit plan, whose groups
  // then hold each node's visits in row order.
  VisitPlan plan;
  err = BuildVisitPlan(tree, candidates, total, &plan);
  if (!err.empty()) return err;
  const int64 G = plan.num_groups();
  // Distinct rows of each group and the entries of each.
  std::vector<int64> group_first(G + 1, 0), urow, urow_entry;
  for (int64 g = 0; g < G; ++g) {
    group_first[g] = static_cast<int64>(urow.size());
    for (int64 e = plan.group_begin[g]; e < plan.group_begin[g + 1]; ++e) {
      const int64 row = plan.entry_token[e] / num_candidates;
      if (e == plan.group_begin[g] || row != urow.back()) {
        urow.push_back(row);
        urow_entry.push_back(e);
      }
    }
  }
  group_first[G] = static_cast<int64>(urow.size());
  urow_entry.push_back(static_cast<int64>(plan.entry_token.size()));

  std::vector<CandidateItem> items;
  int64 work = 0;
  for (int64 g = 0; g < G; ++g) {
    const int64 n = plan.group_node[g];
    const int64 K = tree.child_begin[n + 1] - tree.child_begin[n];
    const int64 u = group_first[g + 1] - group_first[g];
    for (int64 o = 0; o < u; o += kCandidateRows) items.push_back({g, o, std::min(kCandidateRows, u - o)});
    work += u * K * (p.dim + 4);
  }
  std::vector<T> entry_value(plan.entry_token.size());
  const int64 cost = items.empty() ? 0 : 2 * work / static_cast<int64>(items.size());
  parallel_for(static_cast<int64>(items.size()), cost, [&](int64 begin, int64 end) {
    Scratch<T>& s = ThreadScratch<T>();
    for (int64 i = begin; i < end; ++i) {
      const CandidateItem& it = items[i];
      const int64 n = plan.group_node[it.group];
      const int64 first = tree.child_begin[n], K = tree.child_begin[n + 1] - first;
      const int64 u0 = group_first[it.group] + it.first;
      const T** rows = Grow(&s.rows, it.count);
      for (int64 r = 0; r < it.count; ++r) rows[r] = p.hidden + urow[u0 + r] * p.dim;
      T* tile = Grow(&s.z, it.count * kSlotTile);
      T* lse = Grow(&s.lse, it.count);
      // This item's entries by slot, so each tile hands out its taken logits in one sweep.
      std::vector<std::pair<int64, int64>>& taken = s.taken;  // (slot, entry)
      taken.clear();
      for (int64 e = urow_entry[u0]; e < urow_entry[u0 + it.count]; ++e) {
        taken.push_back({plan.entry_slot[e], e});
      }
      std::sort(taken.begin(), taken.end());
      size_t next = 0;
      const T* hp = PackedRows(rows, it.count, p.dim, it.count >= kPackMinRows);
      TiledLogSumExp(p, rows, it.count, first, K, hp, /*keep_all=*/false, tile, lse,
                     [&](const T* z, int64 ld, int64 k0, int64 kb) {
        for (; next < taken.size() && taken[next].first < first + k0 + kb; ++next) {
          const int64 e = taken[next].second;
          const int64 r = std::upper_bound(urow_entry.begin() + u0, urow_entry.begin() + u0 + it.count, e) -
                          (urow_entry.begin() + u0) - 1;
          entry_value[e] = z[r * ld + taken[next].first - first - k0];
        }
      });
      for (int64 r = 0; r < it.count; ++r) {
        for (int64 e = urow_entry[u0 + r]; e < urow_entry[u0 + r + 1]; ++e) entry_value[e] -= lse[r];
      }
    }
  });
  // Sum each candidate's steps root first (entries are stored level by level).
  std::fill(out, out + total, T(0));
  for (size_t e = 0; e < plan.entry_token.size(); ++e) out[plan.entry_token[e]] += entry_value[e];
  return "";
}

#define TF_HSM_INSTANTIATE(T)                                                               \

template std::string LogProbCandidates<float>(const TreeView&, const SoftmaxParams<float>&, int64,
                                              const int64*, int64, const ParallelFor&, float*);
template std::string LogProbCandidates<double>(const TreeView&, const SoftmaxParams<double>&,
                                               int64, const int64*, int64, const ParallelFor&,
                                               double*);

}  // namespace tf_hsm
