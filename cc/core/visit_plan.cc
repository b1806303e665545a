#include "cc/core/visit_plan.h"

#include <algorithm>
#include <sstream>

#include "cc/core/prefetch.h"

namespace tf_hsm {
namespace {

template <typename... Args>
std::string Message(const Args&... args) {
  std::ostringstream s;
  (s << ... << args);
  return s.str();
}

// Per-thread storage of BuildVisitPlan's grouping, kept across calls of up to
// kKeptScratchSteps visits: its hash table is emptied slot by slot after use, so such a
// call neither allocates nor fills a table. A larger batch's storage (~50 bytes a visit)
// is released after its call rather than held by the thread.
constexpr int64 kKeptScratchSteps = int64{1} << 16;
struct GroupingScratch {
  struct Slot {
    int64 node;   // -1 when empty
    int64 group;  // its position is level[group]
    int64 count;  // visits
  };
  std::vector<Slot> slots;
  // Per group, in order of first visit: its slot in the table, its path position, and
  // its place in the plan.
  std::vector<int64> used, level, final;
  std::vector<int64> visit_group;  // per step: its group, or -1 when not grouped
  std::vector<int64> cursor;
};

GroupingScratch& ThreadGroupingScratch() {
  thread_local GroupingScratch scratch;
  return scratch;
}

}  // namespace

std::string BuildVisitPlan(const TreeView& tree, const int64* targets, int64 num_tokens,
                           VisitPlan* plan, PlanFor use) {
  const int64 C = tree.num_classes, M = tree.num_nodes, S = tree.num_slots;
  if (C < 1) return "the tree has no classes (path_begin needs at least 2 entries)";
  if (M < 1) return "the tree has no nodes (child_begin needs at least 2 entries)";
  plan->Clear();
  plan->num_tokens = num_tokens;
  plan->walked_groups = use == PlanFor::kBackward;

  // Validate targets and the paths they read; find each token's depth, and copy its path
  // next to the other tokens' (the later passes read it level by level). The paths of a
  // large tree sit at random places in memory, and so do their nodes' child_begin entries:
  // each token's path_begin is requested kAhead tokens before it is read, its path (every
  // cache line of it) kAhead / 2 tokens before, and the child_begin entries of its path
  // nodes kAhead / 4 tokens before.
  int64 max_depth = 0;
  int64 grouped_depth = 0;  // 1 + the last path position of a node that is not walked
  plan->token_step_begin.assign(num_tokens + 1, 0);
  constexpr int64 kAhead = 16;
  constexpr int64 kPerLine = 64 / sizeof(int64);
  auto valid_target = [&](int64 i) {
    return i < num_tokens && targets[i] >= 0 && targets[i] < C;
  };
  auto path_range = [&](int64 i, int64* b, int64* e) {
    if (!valid_target(i)) return false;
    *b = tree.path_begin[targets[i]];
    *e = tree.path_begin[targets[i] + 1];
    return *b >= 0 && *b < *e && *e <= tree.path_length;
  };
  for (int64 i = 0; i < num_tokens; ++i) {
    if (valid_target(i + kAhead)) RequestLine(tree.path_begin + targets[i + kAhead]);
    int64 ahead_b, ahead_e;
    if (path_range(i + kAhead / 2, &ahead_b, &ahead_e)) {
      for (int64 p = ahead_b; p < ahead_e; p += kPerLine) {
        RequestLine(tree.path_nodes + p);
        RequestLine(tree.path_slots + p);
      }
      RequestLine(tree.path_nodes + ahead_e - 1);
      RequestLine(tree.path_slots + ahead_e - 1);
    }
    if (path_range(i + kAhead / 4, &ahead_b, &ahead_e)) {
      for (int64 p = ahead_b; p < ahead_e; ++p) {
        const int64 n = tree.path_nodes[p];
        if (n >= 0 && n < M) RequestLine(tree.child_begin + n);
      }
    }
    const int64 t = targets[i];
    if (t < 0 || t >= C) {
      return Message("targets[", i, "] = ", t, " is not a class id in [0, ", C, ")");
    }
    const int64 b = tree.path_begin[t], e = tree.path_begin[t + 1];
    if (b < 0 || e <= b || e > tree.path_length) {
      return Message("malformed tree: path_begin[", t, ":", t + 2, "] = [", b, ", ", e,
                     "] is not a non-empty range within the ", tree.path_length,
                     " path steps");
    }
    const int64 step0 = plan->token_step_begin[i];
    if (static_cast<int64>(plan->step_node.size()) < step0 + (e - b)) {
      const int64 grown = std::max<int64>(2 * step0, step0 + (e - b));
      plan->step_node.resize(grown);
      plan->step_slot.resize(grown);
    }
    for (int64 p = b; p < e; ++p) {
      const int64 n = tree.path_nodes[p], s = tree.path_slots[p];
      plan->step_node[step0 + p - b] = n;
      plan->step_slot[step0 + p - b] = s;
      if (n < 0 || n >= M) {
        return Message("malformed tree: path_nodes[", p, "] = ", n, " is not a node in [0, ",
                       M, ")");
      }
      const int64 cb = tree.child_begin[n], ce = tree.child_begin[n + 1];
      if (cb < 0 || ce <= cb || ce > S) {
        return Message("malformed tree: child_begin[", n, ":", n + 2, "] = [", cb, ", ", ce,
                       "] is not a non-empty slot range within the ", S, " weight rows");
      }
      if (s < cb || s >= ce) {
        return Message("malformed tree: path_slots[", p, "] = ", s,
                       " is outside the slots [", cb, ", ", ce, ") of node ", n);
      }
      if (ce - cb <= kWalkMaxBranching) {
        plan->max_walked_branching = std::max(plan->max_walked_branching, ce - cb);
      } else {
        grouped_depth = std::max(grouped_depth, p - b + 1);
      }
    }
    plan->token_step_begin[i + 1] = step0 + (e - b);
    max_depth = std::max(max_depth, e - b);
  }

  plan->step_node.resize(plan->num_steps());
  plan->step_slot.resize(plan->num_steps());

  // Group in one pass over the visits in token order, keyed by (node, path position):
  // a group's number is the order of its first visit, and its entries come in token
  // order. A stable counting sort by position then gives the plan's order (level by level,
  // each level's groups in order of their first token), the same as grouping each level
  // on its own, without a pass per level over the tokens' scattered path copies. The
  // hash table is sized by the batch, not by the tree, so a call costs O(visits) however
  // many nodes the tree has; a malformed tree that repeats a node at two positions still
  // gets one group per position. A plan for the forward pass leaves the walked nodes out.
  const int64 levels = plan->walked_groups ? max_depth : grouped_depth;
  GroupingScratch& g = ThreadGroupingScratch();
  const int64 steps = plan->num_steps();
  int64 capacity = 16;
  while (capacity < 2 * steps) capacity *= 2;
  if (static_cast<int64>(g.slots.size()) < capacity) g.slots.assign(capacity, {-1, 0, 0});
  const uint64_t mask = static_cast<uint64_t>(capacity) - 1;
  // At most one group per step: the per-group vectors are sized once, and the table,
  // at least twice the steps, always has an empty slot to end a probe.
  g.used.resize(steps);
  g.level.resize(steps);
  g.visit_group.resize(steps);
  int64 groups = 0;
  for (int64 i = 0; i < num_tokens; ++i) {
    const int64 step0 = plan->token_step_begin[i];
    const int64 depth = std::min(plan->token_step_begin[i + 1] - step0, levels);
    for (int64 l = 0; l < depth; ++l) {
      const int64 n = plan->step_node[step0 + l];
      if (!plan->walked_groups && IsWalked(tree, n)) {
        g.visit_group[step0 + l] = -1;
        continue;
      }
      uint64_t h = (static_cast<uint64_t>(n) * 0x9E3779B97F4A7C15ull +
                    static_cast<uint64_t>(l) * 0xC2B2AE3D27D4EB4Full) >> 20 & mask;
      while (g.slots[h].node != -1 && (g.slots[h].node != n || g.level[g.slots[h].group] != l)) {
        h = (h + 1) & mask;
      }
      GroupingScratch::Slot& slot = g.slots[h];
      if (slot.node == -1) {
        slot = {n, groups, 0};
        g.used[groups] = static_cast<int64>(h);
        g.level[groups] = l;
        ++groups;
      }
      ++slot.count;
      g.visit_group[step0 + l] = slot.group;
    }
  }

  // Order the groups by position with a stable counting sort (final[q] is group q's place
  // in the plan), take each one's node and visit count from its slot, and empty the table
  // for the next call.
  plan->level_begin.assign(levels + 1, 0);
  for (int64 q = 0; q < groups; ++q) ++plan->level_begin[g.level[q] + 1];
  for (int64 l = 0; l < levels; ++l) plan->level_begin[l + 1] += plan->level_begin[l];
  g.final.resize(groups);
  g.cursor.assign(plan->level_begin.begin(), plan->level_begin.end() - 1);
  for (int64 q = 0; q < groups; ++q) g.final[q] = g.cursor[g.level[q]]++;
  plan->group_node.resize(groups);
  plan->group_begin.assign(groups + 1, 0);
  plan->group_row.assign(groups + 1, 0);
  for (int64 q = 0; q < groups; ++q) {
    GroupingScratch::Slot& slot = g.slots[g.used[q]];
    plan->group_node[g.final[q]] = slot.node;
    plan->group_begin[g.final[q] + 1] = slot.count;
    slot.node = -1;
  }
  for (int64 q = 0; q < groups; ++q) {
    const int64 n = plan->group_node[q];
    plan->group_begin[q + 1] += plan->group_begin[q];
    plan->group_row[q + 1] = plan->group_row[q] + tree.child_begin[n + 1] - tree.child_begin[n];
  }

  // Entries: each group's visits in token order.
  const int64 entries = plan->group_begin[groups];
  plan->entry_token.resize(entries);
  plan->entry_slot.resize(entries);
  g.cursor.assign(plan->group_begin.begin(), plan->group_begin.end() - 1);
  for (int64 i = 0; i < num_tokens; ++i) {
    const int64 step0 = plan->token_step_begin[i];
    const int64 depth = std::min(plan->token_step_begin[i + 1] - step0, levels);
    for (int64 l = 0; l < depth; ++l) {
      const int64 q = g.visit_group[step0 + l];
      if (q < 0) continue;
      const int64 e = g.cursor[g.final[q]]++;
      plan->entry_token[e] = i;
      plan->entry_slot[e] = plan->step_slot[step0 + l];
    }
  }
  if (steps > kKeptScratchSteps) g = GroupingScratch();
  return "";
}

}  // namespace tf_hsm
