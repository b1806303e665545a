// LogProbAll's plan of the tree (see inference_sweep_plan.h): built from the tree
// tensors, which are untrusted, checking every offset the sweep will read.
#include "cc/core/inference_sweep_plan.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <mutex>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

namespace tf_hsm {

SweepPlanCache::SweepPlanCache() = default;
SweepPlanCache::~SweepPlanCache() = default;

std::shared_ptr<const SweepPlanCache::Entry> SweepPlanCache::Get() const {
  std::lock_guard<std::mutex> lock(mu_);
  return entry_;
}

void SweepPlanCache::Put(std::shared_ptr<const Entry> entry) {
  std::lock_guard<std::mutex> lock(mu_);
  entry_ = std::move(entry);
}

namespace inference_internal {
inline namespace TF_HSM_SIMD_ISA {
namespace {

constexpr int64 kGroupValueBudget = int64{1} << 18;  // values per subtree group: 1 MB in float

// Whether n values at a equal those at b, compared in parallel chunks.
bool SameValues(const int64* a, const int64* b, int64 n, const ParallelFor& parallel_for) {
  constexpr int64 kChunk = int64{1} << 16;
  const int64 chunks = (n + kChunk - 1) / kChunk;
  std::atomic<bool> differ{false};
  parallel_for(chunks, kChunk, [&](int64 begin, int64 end) {
    for (int64 c = begin; c < end && !differ.load(std::memory_order_relaxed); ++c) {
      const int64 first = c * kChunk, count = std::min(kChunk, n - first);
      if (std::memcmp(a + first, b + first, count * sizeof(int64)) != 0) {
        differ.store(true, std::memory_order_relaxed);
      }
    }
  });
  return !differ.load();
}

// The walk of BuildSweepPlan for the whole class range (every node needed), in parallel
// chunks of nodes: checks each node's slot range and child codes, and gives each node
// its run (or -1) and each child node its parent. Once every class and every node but the
// root is known to be reached, a child reached twice means more class children than
// classes, or more node children than nodes less the root: counting them stands for the
// serial walk's duplicate checks (the caller checks the nodes' parents). False when any
// check fails: the serial walk then names the problem (the first in id order), so
// messages do not depend on the threads.
bool WalkWholeTree(const TreeView& t, const ParallelFor& parallel_for, std::vector<int64>* run,
                   std::vector<int64>* parent) {
  const int64 C = t.num_classes, M = t.num_nodes;
  // Chunks of about kChunkNodes nodes, or fewer where the nodes are wide: a 2-level tree
  // of 1M classes has 1,001 nodes but 1M slots to check, which one chunk left to one thread.
  constexpr int64 kChunkNodes = int64{1} << 14, kChunkSlots = int64{1} << 15;
  const int64 chunks = std::min(M, std::max((M + kChunkNodes - 1) / kChunkNodes,
                                            (t.num_slots + kChunkSlots - 1) / kChunkSlots));
  auto chunk_first = [&](int64 c) { return c * M / chunks; };
  std::vector<unsigned char> seen(C, 0), ok(chunks, 0);
  std::vector<int64> class_children(chunks, 0), node_children(chunks, 0);
  run->assign(M, -1);
  parent->assign(M, -1);
  int64* run_of = run->data();
  int64* parent_of = parent->data();
  // Chunks only store to seen[] and parent[] entries that no other chunk stores to in a
  // well-formed tree; in a malformed one the stores may collide (relaxed atomics) and
  // the counts below reject it.
  parallel_for(chunks, kChunkSlots * 4, [&](int64 chunk_begin, int64 chunk_end) {
    for (int64 c = chunk_begin; c < chunk_end; ++c) {
      int64 classes = 0, nodes = 0;
      for (int64 n = chunk_first(c), n_end = chunk_first(c + 1); n < n_end; ++n) {
        const int64 begin = t.child_begin[n], end = t.child_begin[n + 1];
        if (begin < 0 || end <= begin || end > t.num_slots) return;
        const int64 first = t.slot_child[begin], K = end - begin;
        if (first >= 0 && first <= C - K) {
          bool apart = false;
          for (int64 s = begin; s < end; ++s) apart |= t.slot_child[s] != first + (s - begin);
          if (!apart) {
            for (int64 i = 0; i < K; ++i) __atomic_store_n(&seen[first + i], 1, __ATOMIC_RELAXED);
            run_of[n] = first;
            classes += K;
            continue;
          }
        }
        for (int64 s = begin; s < end; ++s) {
          const int64 code = t.slot_child[s];
          if (!ValidChild(t, n, code)) return;
          if (code < C) {
            __atomic_store_n(&seen[code], 1, __ATOMIC_RELAXED);
            ++classes;
          } else {
            __atomic_store_n(&parent_of[code - C], n, __ATOMIC_RELAXED);
            ++nodes;
          }
        }
      }
      class_children[c] = classes;
      node_children[c] = nodes;
      ok[c] = 1;
    }
  });
  if (std::memchr(ok.data(), 0, chunks) != nullptr || std::memchr(seen.data(), 0, C) != nullptr) {
    return false;
  }
  const int64 classes = std::accumulate(class_children.begin(), class_children.end(), int64{0});
  const int64 nodes = std::accumulate(node_children.begin(), node_children.end(), int64{0});
  return classes == C && nodes == M - 1;
}

// Puts the needed nodes in sweep order (by depth, ids increasing within a depth) from the
// walk's results in id order: depth and parent per node id (M of them), a run per needed
// node, `needed` per node id (nullptr: all). Takes over the walk's vectors.
void OrderSweepPlan(int64 M, bool full, bool by_depth, const std::vector<int64>& level_size,
                    std::vector<int64>* depth, std::vector<int64>* run_in_id_order,
                    std::vector<int64>* parent_node, const unsigned char* needed,
                    SweepPlan* plan) {
  // A counting sort, unless the ids are in that order already (breadth-first numbering, as
  // every builder's), when a node's position is its rank among the needed nodes, and with
  // every node needed its id.
  const int64 levels = static_cast<int64>(level_size.size());
  plan->level_begin.assign(levels + 1, 0);
  for (int64 d = 0; d < levels; ++d) plan->level_begin[d + 1] = plan->level_begin[d] + level_size[d];
  if (full && by_depth) {
    plan->node.resize(M);
    std::iota(plan->node.begin(), plan->node.end(), int64{0});
    plan->position = plan->node;
    plan->run.swap(*run_in_id_order);
    plan->parent.swap(*parent_node);  // positions are ids
    return;
  }
  const int64 count = plan->level_begin[levels];
  std::vector<int64> cursor(plan->level_begin.begin(), plan->level_begin.end() - 1);
  plan->node.assign(count, 0);
  plan->run.assign(count, -1);
  plan->parent.assign(count, -1);
  // position[n] takes over depth's storage: depth[n] is read just before it is replaced.
  plan->position.swap(*depth);
  std::vector<int64>& position = plan->position;
  for (int64 n = 0, i = 0; n < M; ++n) {
    if (needed != nullptr && !needed[n]) {
      position[n] = -1;
      continue;
    }
    const int64 q = by_depth ? i : cursor[position[n]]++;
    plan->node[q] = n;
    plan->run[q] = (*run_in_id_order)[i++];
    position[n] = q;
    if ((*parent_node)[n] >= 0) plan->parent[q] = position[(*parent_node)[n]];  // set: ids ascend
  }
}

// Groups of the plan below level L, each of L's nodes a group, when the groups' values fit
// kGroupValueBudget for row blocks of `block` rows and every group's nodes are consecutive
// on every level; false otherwise.
bool GroupBelow(const SweepPlan& plan, int64 L, int64 block, SubtreeGroups* groups) {
  const int64 levels = static_cast<int64>(plan.level_begin.size()) - 1;
  const auto& lb = plan.level_begin;
  const int64 G = lb[L + 1] - lb[L], span = levels - L;
  std::vector<int64> begin(G * span, 0), end(G * span, 0);
  int64 cap = 1;
  for (int64 g = 0; g < G; ++g) {
    begin[g * span] = lb[L] + g;
    end[g * span] = lb[L] + g + 1;
  }
  // Level by level, the parents of a level's nodes in position order must not go back:
  // then each group's nodes follow its parents', and g, the group whose range on the
  // level above holds the parent, only moves forward.
  for (int64 i = 1; i < span; ++i) {
    for (int64 q = lb[L + i], g = 0, last_parent = -1; q < lb[L + i + 1]; ++q) {
      const int64 parent = plan.parent[q];
      if (parent < last_parent) return false;
      last_parent = parent;
      while (end[g * span + i - 1] <= parent) ++g;  // the parent is on level L + i - 1
      if (begin[g * span + i] == end[g * span + i]) begin[g * span + i] = end[g * span + i] = q;
      end[g * span + i] = q + 1;
      cap = std::max(cap, q + 1 - begin[g * span + i]);
    }
  }
  if (2 * cap * block > kGroupValueBudget) return false;
  groups->level = L;
  groups->span = span;
  groups->cap = cap;
  groups->begin.swap(begin);
  groups->end.swap(end);
  return true;
}

}  // namespace

bool PlanFits(const SweepPlanCache::Entry& e, const TreeView& t, bool packed, int64 block,
              const ParallelFor& parallel_for) {
  return e.num_classes == t.num_classes &&
         static_cast<int64>(e.child_begin.size()) == t.num_nodes + 1 &&
         static_cast<int64>(e.slot_child.size()) == t.num_slots && e.packed == packed &&
         e.block == block &&
         SameValues(e.child_begin.data(), t.child_begin, t.num_nodes + 1, parallel_for) &&
         SameValues(e.slot_child.data(), t.slot_child, t.num_slots, parallel_for);
}

int64 PlanBytes(const TreeView& t, const SweepPlan& plan) {
  const int64 values = (t.num_nodes + 1) + t.num_slots + plan.node.size() + plan.position.size() +
                       plan.run.size() + plan.parent.size() + plan.value_row.size();
  return values * static_cast<int64>(sizeof(int64));
}

std::string BuildSweepPlan(const TreeView& t, int64 class_begin, int64 class_end,
                           const ParallelFor& parallel_for, SweepPlan* plan) {
  const int64 C = t.num_classes, M = t.num_nodes;
  const int64 width = class_end - class_begin;
  const bool full = class_begin == 0 && class_end == C;
  plan->class_begin = class_begin;
  plan->class_end = class_end;
  std::vector<int64> depth, run_in_id_order, parent_node;
  std::vector<int64> level_size;  // needed nodes per depth
  bool by_depth = true;  // the needed nodes' depths never decrease with their ids
  int64 last_depth = 0;
  // Counts a needed node of depth d, the needed nodes taken in id order.
  auto count_depth = [&](int64 d) {
    by_depth = by_depth && d >= last_depth;
    last_depth = d;
    if (d >= static_cast<int64>(level_size.size())) level_size.resize(d + 1, 0);
    ++level_size[d];
  };
  if (full && WalkWholeTree(t, parallel_for, &run_in_id_order, &parent_node)) {
    // Parents come first in id order, so one pass gives the depths; a node without a
    // parent (besides the root) means another was reached twice.
    depth.resize(M);
    depth[0] = 0;
    count_depth(0);
    bool reached = true;
    for (int64 n = 1; n < M; ++n) {
      const int64 pn = parent_node[n];
      reached = reached && pn >= 0;
      depth[n] = depth[pn < 0 ? 0 : pn] + 1;
      count_depth(depth[n]);
    }
    if (reached) {
      OrderSweepPlan(M, true, by_depth, level_size, &depth, &run_in_id_order, &parent_node,
                     nullptr, plan);
      return "";
    }
    level_size.clear();
    by_depth = true;
    last_depth = 0;
  }
  std::vector<unsigned char> needed(M, full ? 1 : 0);
  needed[0] = 1;
  if (!full) {
    for (int64 c = class_begin; c < class_end; ++c) {
      const int64 b = t.path_begin[c], e = t.path_begin[c + 1];
      if (!tree_checks::ValidPathRange(t, b, e)) return tree_checks::BadPathRange(t, c);
      for (int64 q = b; q < e; ++q) {
        const int64 n = t.path_nodes[q];
        if (!tree_checks::ValidNode(t, n)) return tree_checks::BadPathNode(t, q);
        needed[n] = 1;
      }
    }
  }
  // Walk the needed nodes in id order (parents first), giving each child its depth.
  depth.assign(M, -1);
  parent_node.assign(M, -1);
  run_in_id_order.clear();
  std::vector<unsigned char> seen(width, 0);
  run_in_id_order.reserve(full ? M : 0);
  depth[0] = 0;
  for (int64 n = 0; n < M; ++n) {
    if (!needed[n]) continue;
    if (depth[n] < 0) {
      return tree_checks::NotReached(t, C + n);
    }
    int64 begin = t.child_begin[n], end = t.child_begin[n + 1];
    if (!tree_checks::ValidSlotRange(t, begin, end)) return tree_checks::BadSlotRange(t, n);
    count_depth(depth[n]);
    // The common leaf node, a run of consecutive classes of the range none of which was
    // seen before, is checked and marked as a block (branch-free compares, one memchr and
    // one memset); anything else, including a duplicate, takes the loop below.
    const int64 first = t.slot_child[begin], K = end - begin;
    if (first >= class_begin && first <= class_end - K) {
      bool apart = false;
      for (int64 s = begin; s < end; ++s) apart |= t.slot_child[s] != first + (s - begin);
      unsigned char* mark = seen.data() + (first - class_begin);
      if (!apart && std::memchr(mark, 1, K) == nullptr) {
        std::memset(mark, 1, K);
        run_in_id_order.push_back(first - class_begin);
        continue;
      }
    }
    // Not a run: either its children are not consecutive classes of the range, or one of
    // them was seen before, which the loop reports.
    for (int64 s = begin; s < end; ++s) {
      const int64 code = t.slot_child[s];
      if (!ValidChild(t, n, code)) return CheckChild(t, n, s, code);
      if (code < C) {
        if (code >= class_begin && code < class_end && seen[code - class_begin]++) {
          return tree_checks::ReachedTwice(t, code);
        }
        continue;
      }
      const int64 m = code - C;
      if (!needed[m]) continue;
      if (depth[m] >= 0) {
        return tree_checks::ReachedTwice(t, code);
      }
      depth[m] = depth[n] + 1;
      parent_node[m] = n;
    }
    run_in_id_order.push_back(-1);
  }
  if (const void* gap = std::memchr(seen.data(), 0, width)) {
    const int64 c = static_cast<const unsigned char*>(gap) - seen.data();
    return tree_checks::NotReached(t, class_begin + c);
  }
  OrderSweepPlan(M, full, by_depth, level_size, &depth, &run_in_id_order, &parent_node,
                 needed.data(), plan);
  return "";
}

void FindSubtreeGroups(const SweepPlan& plan, int64 block, SubtreeGroups* groups) {
  constexpr int64 kMinGroups = 64;
  const int64 levels = static_cast<int64>(plan.level_begin.size()) - 1;
  const auto& lb = plan.level_begin;
  int64 widest = 0;
  for (int64 d = 0; d < levels; ++d) widest = std::max(widest, lb[d + 1] - lb[d]);
  const int64 cap_goal = std::max<int64>(1, kGroupValueBudget / (4 * block));
  int64 L = 1;
  while (L + 2 < levels && lb[L + 1] - lb[L] < std::max(kMinGroups, widest / cap_goal)) ++L;
  for (int64 tries = 0; tries < 3 && L + 2 < levels; ++tries, ++L) {
    if (GroupBelow(plan, L, block, groups)) return;
  }
}

void AssignValueRows(const SubtreeGroups& groups, SweepPlan* plan) {
  const int64 levels = static_cast<int64>(plan->level_begin.size()) - 1;
  const int64 shared = groups.level < 0 ? levels : groups.level + 1;
  const auto& lb = plan->level_begin;
  int64 widest = 0;
  for (int64 d = 0; d < shared; ++d) widest = std::max(widest, lb[d + 1] - lb[d]);
  plan->value_row.resize(lb[levels]);
  plan->value_rows = 0;
  for (int64 d = 0; d < shared; ++d) {
    for (int64 q = lb[d]; q < lb[d + 1]; ++q) {
      plan->value_row[q] = q - lb[d] + (d % 2) * widest;
      plan->value_rows = std::max(plan->value_rows, plan->value_row[q] + 1);
    }
  }
  for (int64 g = 0; g < groups.count(); ++g) {
    for (int64 i = 1; i < groups.span; ++i) {
      const int64 d = groups.level + i, b = groups.begin[g * groups.span + i];
      for (int64 q = b; q < groups.end[g * groups.span + i]; ++q) {
        plan->value_row[q] = q - b + (d % 2) * groups.cap;
      }
    }
  }
}

}  // namespace TF_HSM_SIMD_ISA
}  // namespace inference_internal
}  // namespace tf_hsm
