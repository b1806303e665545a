#include "cc/core/visit_plan.h"

#include <algorithm>

#include "cc/core/prefetch.h"
#include "cc/core/tree_checks.h"

namespace tf_hsm {
namespace {

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

namespace {

// Asks for what token i + kAhead and the tokens before it will read: each token's
// path_begin kAhead tokens before it is read, its path (every cache line of it) kAhead / 2
// tokens before, and the child_begin entries of its path nodes kAhead / 4 tokens before.
// (The paths of a large tree sit at random places in memory, and so do their nodes'
// child_begin entries.) Reads only what it checks first.
void RequestPathsAhead(const TreeView& tree, const int64* targets, int64 num_tokens, int64 i) {
  constexpr int64 kAhead = 16;
  constexpr int64 kPerLine = 64 / sizeof(int64);
  auto valid_target = [&](int64 j) {
    return j < num_tokens && targets[j] >= 0 && targets[j] < tree.num_classes;
  };
  auto path_range = [&](int64 j, int64* b, int64* e) {
    if (!valid_target(j)) return false;
    *b = tree.path_begin[targets[j]];
    *e = tree.path_begin[targets[j] + 1];
    return tree_checks::ValidPathRange(tree, *b, *e);
  };
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
      if (tree_checks::ValidNode(tree, n)) RequestLine(tree.child_begin + n);
    }
  }
}

// Validates the targets and the paths they read, and copies each token's path next to
// the other tokens' (the later passes read it level by level). Sets the plan's
// token_step_begin, step_node, step_slot and max_walked_branching, *max_depth and
// *grouped_depth (1 + the last path position of a node that is not walked).
std::string CopyPaths(const TreeView& tree, const int64* targets, int64 num_tokens,
                      Padding padding, VisitPlan* plan, int64* max_depth,
                      int64* grouped_depth) {
  *max_depth = 0;
  *grouped_depth = 0;
  plan->token_step_begin.assign(num_tokens + 1, 0);
  for (int64 i = 0; i < num_tokens; ++i) {
    RequestPathsAhead(tree, targets, num_tokens, i);
    const int64 t = targets[i];
    if (t < 0 && padding == Padding::kSkip) {  // no steps
      plan->token_step_begin[i + 1] = plan->token_step_begin[i];
      continue;
    }
    if (t < 0 || t >= tree.num_classes) {
      return Message("targets[", i, "] = ", t, " is not a class id in [0, ", tree.num_classes, ")",
                     t < 0 ? " (targets < 0 are padding with skip_padding=True)" : "");
    }
    const int64 b = tree.path_begin[t], e = tree.path_begin[t + 1];
    if (!tree_checks::ValidPathRange(tree, b, e)) return tree_checks::BadPathRange(tree, t);
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
      if (!tree_checks::ValidNode(tree, n)) return tree_checks::BadPathNode(tree, p);
      const int64 cb = tree.child_begin[n], ce = tree.child_begin[n + 1];
      if (!tree_checks::ValidSlotRange(tree, cb, ce)) return tree_checks::BadSlotRange(tree, n);
      if (s < cb || s >= ce) return tree_checks::BadPathSlot(tree, p, n);
      if (ce - cb <= kWalkMaxBranching) {
        plan->max_walked_branching = std::max(plan->max_walked_branching, ce - cb);
      } else {
        *grouped_depth = std::max(*grouped_depth, p - b + 1);
      }
    }
    plan->token_step_begin[i + 1] = step0 + (e - b);
    *max_depth = std::max(*max_depth, e - b);
  }
  plan->step_node.resize(plan->num_steps());
  plan->step_slot.resize(plan->num_steps());
  return "";
}

// Groups the visits of the first `levels` path positions in one pass in token order,
// keyed by (node, path position): a group's number is the order of its first visit, and
// its entries come in token order. The hash table is sized by the batch, not by the tree,
// so a call costs O(visits) however many nodes the tree has; a malformed tree that repeats
// a node at two positions still gets one group per position. A plan for the forward pass
// leaves the walked nodes out. Returns the number of groups; g holds each one's slot and
// position, and each visit's group.
int64 GroupVisits(const TreeView& tree, const VisitPlan& plan, int64 levels,
                  GroupingScratch* scratch) {
  GroupingScratch& g = *scratch;
  const int64 steps = plan.num_steps();
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
  for (int64 i = 0; i < plan.num_tokens; ++i) {
    const int64 step0 = plan.token_step_begin[i];
    const int64 depth = std::min(plan.token_step_begin[i + 1] - step0, levels);
    for (int64 l = 0; l < depth; ++l) {
      const int64 n = plan.step_node[step0 + l];
      if (!plan.walked_groups && IsWalked(tree, n)) {
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
  return groups;
}

// Orders the groups by position with a stable counting sort (final[q] is group q's place
// in the plan): level by level, each level's groups in order of their first token, the
// same as grouping each level on its own. Takes each one's node and visit count from its
// slot, and empties the table for the next call.
void OrderGroups(const TreeView& tree, int64 levels, int64 groups, GroupingScratch* scratch,
                 VisitPlan* plan) {
  GroupingScratch& g = *scratch;
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
}

// Entries: each group's visits in token order.
void FillEntries(int64 levels, GroupingScratch* scratch, VisitPlan* plan) {
  GroupingScratch& g = *scratch;
  const int64 entries = plan->group_begin[plan->num_groups()];
  plan->entry_token.resize(entries);
  plan->entry_slot.resize(entries);
  g.cursor.assign(plan->group_begin.begin(), plan->group_begin.end() - 1);
  for (int64 i = 0; i < plan->num_tokens; ++i) {
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
}

}  // namespace

std::string BuildVisitPlan(const TreeView& tree, const int64* targets, int64 num_tokens,
                           VisitPlan* plan, PlanFor use, Padding padding) {
  std::string err = tree_checks::CheckNotEmpty(tree);
  if (!err.empty()) return err;
  plan->Clear();
  plan->num_tokens = num_tokens;
  plan->walked_groups = use == PlanFor::kBackward;
  int64 max_depth, grouped_depth;
  err = CopyPaths(tree, targets, num_tokens, padding, plan, &max_depth, &grouped_depth);
  if (!err.empty()) return err;
  // Grouping in token order, then a stable counting sort by position, gives the plan's
  // order without a pass per level over the tokens' scattered path copies.
  const int64 levels = plan->walked_groups ? max_depth : grouped_depth;
  GroupingScratch& g = ThreadGroupingScratch();
  const int64 groups = GroupVisits(tree, *plan, levels, &g);
  OrderGroups(tree, levels, groups, &g, plan);
  FillEntries(levels, &g, plan);
  if (plan->num_steps() > kKeptScratchSteps) g = GroupingScratch();
  return "";
}

}  // namespace tf_hsm
