#include "cc/core/visit_plan.h"

#include <algorithm>
#include <sstream>

namespace tf_hsm {
namespace {

template <typename... Args>
std::string Message(const Args&... args) {
  std::ostringstream s;
  (s << ... << args);
  return s.str();
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
  plan->level_begin.push_back(0);
  plan->group_begin.push_back(0);
  plan->group_row.push_back(0);

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
    if (valid_target(i + kAhead)) __builtin_prefetch(tree.path_begin + targets[i + kAhead]);
    int64 ahead_b, ahead_e;
    if (path_range(i + kAhead / 2, &ahead_b, &ahead_e)) {
      for (int64 p = ahead_b; p < ahead_e; p += kPerLine) {
        __builtin_prefetch(tree.path_nodes + p);
        __builtin_prefetch(tree.path_slots + p);
      }
      __builtin_prefetch(tree.path_nodes + ahead_e - 1);
      __builtin_prefetch(tree.path_slots + ahead_e - 1);
    }
    if (path_range(i + kAhead / 4, &ahead_b, &ahead_e)) {
      for (int64 p = ahead_b; p < ahead_e; ++p) {
        const int64 n = tree.path_nodes[p];
        if (n >= 0 && n < M) __builtin_prefetch(tree.child_begin + n);
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

  // Group level by level. Nodes are mapped to this level's groups through a small
  // open-addressing table sized by the batch, not by the tree, so a call costs
  // O(visits) however many nodes the tree has. A malformed tree that repeats a node at two
  // positions still gets separate groups, one per level. A plan for the forward pass
  // leaves the walked nodes out.
  const int64 levels = plan->walked_groups ? max_depth : grouped_depth;
  std::vector<int64> table_node, table_group, used;
  std::vector<int64> level_tokens, level_groups, counts;
  // The tokens whose paths reach this level, in token order.
  std::vector<int64> active(num_tokens);
  for (int64 i = 0; i < num_tokens; ++i) active[i] = i;
  for (int64 level = 0; level < levels; ++level) {
    const int64 first_group = plan->num_groups();
    level_tokens.clear();
    level_groups.clear();
    active.erase(std::remove_if(active.begin(), active.end(), [&](int64 i) {
                   return plan->token_step_begin[i + 1] - plan->token_step_begin[i] <= level;
                 }),
                 active.end());
    const int64 visits = static_cast<int64>(active.size());
    int64 capacity = 16;
    while (capacity < 2 * visits) capacity *= 2;
    if (static_cast<int64>(table_node.size()) < capacity) {
      table_node.assign(capacity, -1);
      table_group.resize(capacity);
    }
    const uint64_t mask = static_cast<uint64_t>(capacity) - 1;
    used.clear();
    for (const int64 i : active) {
      const int64 n = plan->step_node[plan->token_step_begin[i] + level];
      if (!plan->walked_groups && IsWalked(tree, n)) continue;
      uint64_t h = (static_cast<uint64_t>(n) * 0x9E3779B97F4A7C15ull) >> 20 & mask;
      while (table_node[h] != -1 && table_node[h] != n) h = (h + 1) & mask;
      if (table_node[h] == -1) {
        table_node[h] = n;
        table_group[h] = plan->num_groups();
        used.push_back(static_cast<int64>(h));
        plan->group_node.push_back(n);
        counts.push_back(0);
      }
      const int64 g = table_group[h];
      ++counts[g];
      level_tokens.push_back(i);
      level_groups.push_back(g);
    }
    for (int64 h : used) table_node[h] = -1;
    // Counting sort of this level's visits by group, stable in token order.
    const int64 entry_base = static_cast<int64>(plan->entry_token.size());
    std::vector<int64> cursor(plan->num_groups() - first_group);
    int64 offset = entry_base;
    for (int64 g = first_group; g < plan->num_groups(); ++g) {
      cursor[g - first_group] = offset;
      offset += counts[g];
      plan->group_begin.push_back(offset);
      const int64 n = plan->group_node[g];
      plan->group_row.push_back(plan->group_row.back() + tree.child_begin[n + 1] -
                                tree.child_begin[n]);
    }
    plan->entry_token.resize(offset);
    plan->entry_slot.resize(offset);
    for (size_t v = 0; v < level_tokens.size(); ++v) {
      const int64 i = level_tokens[v];
      const int64 e = cursor[level_groups[v] - first_group]++;
      plan->entry_token[e] = i;
      plan->entry_slot[e] = plan->step_slot[plan->token_step_begin[i] + level];
    }
    plan->level_begin.push_back(plan->num_groups());
  }
  return "";
}

}  // namespace tf_hsm
