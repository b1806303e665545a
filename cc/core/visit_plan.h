// Groups the (token, path position) visits of a batch by tree node, so that all tokens
// passing through one node are processed as one small dense block against that node's
// weight rows (the root is a single block over the whole batch).
#ifndef TF_HSM_CC_CORE_VISIT_PLAN_H_
#define TF_HSM_CC_CORE_VISIT_PLAN_H_

#include <string>
#include <vector>

#include "cc/core/tree_view.h"

namespace tf_hsm {

// Nodes with at most this many children are "walked": the kernels take each token's path
// through them on its own instead of grouping the tokens per node (their blocks are too
// small to repay a group's bookkeeping, and a deep binary tree would pay one thread-pool
// synchronisation per level).
constexpr int64 kWalkMaxBranching = 8;

inline bool IsWalked(const TreeView& tree, int64 node) {
  return tree.child_begin[node + 1] - tree.child_begin[node] <= kWalkMaxBranching;
}

// Visits grouped by (path position, node). Levels are path positions 0, 1, ...; within a
// level a token visits at most one group, which is what makes the backward pass's dh
// accumulation race-free. Groups are numbered in order of first appearance in the batch and
// entries keep token order, so the plan never depends on threading.
struct VisitPlan {
  int64 num_tokens = 0;
  std::vector<int64> level_begin;  // [levels + 1], ranges of groups
  std::vector<int64> group_node;   // [groups]
  std::vector<int64> group_begin;  // [groups + 1], ranges of entries
  std::vector<int64> group_row;    // [groups + 1], prefix sums of the nodes' branching
  std::vector<int64> entry_token;  // [entries]
  std::vector<int64> entry_slot;   // [entries], the slot taken at this visit
  // Per token, for kernels that walk a token's path instead of visiting groups: its steps
  // are [token_step_begin[i], token_step_begin[i + 1]), copies of its path in the tree.
  std::vector<int64> token_step_begin;  // [tokens + 1], prefix sums of the path lengths
  std::vector<int64> step_node;         // [steps], path_nodes of each token's path
  std::vector<int64> step_slot;         // [steps], path_slots of each token's path
  // The most children of a walked node on the batch's paths; 0 when no path has one.
  int64 max_walked_branching = 0;
  // Whether the walked nodes' visits are grouped too (PlanFor::kBackward).
  bool walked_groups = true;

  // Empties every vector, keeping its storage (BuildVisitPlan starts with this, so a plan
  // reused across calls allocates nothing once it has grown). step_node and step_slot keep
  // their size too: BuildVisitPlan overwrites them and grows them only when a batch has more
  // steps than the last, so that a reused plan does not zero-fill them in every call.
  void Clear() {
    num_tokens = 0;
    max_walked_branching = 0;
    for (std::vector<int64>* v : {&level_begin, &group_node, &group_begin, &group_row,
                                  &entry_token, &entry_slot, &token_step_begin}) {
      v->clear();
    }
  }

  int64 num_levels() const { return static_cast<int64>(level_begin.size()) - 1; }
  int64 num_groups() const { return static_cast<int64>(group_node.size()); }
  int64 num_rows() const { return group_row.empty() ? 0 : group_row.back(); }
  int64 num_steps() const { return token_step_begin.empty() ? 0 : token_step_begin.back(); }
};

// What a plan is for. The backward pass gives every visited node its weight-gradient rows
// through the groups, walked nodes included; the forward pass reads walked nodes only
// along each token's path, so its plan leaves them out of the groups (for a deep binary
// tree, all the grouping work).
enum class PlanFor { kBackward, kForward };

// What a target < 0 is: an error, or (kSkip) padding, a token of no steps, which every
// kernel then gives log-probability 0, a zero hidden gradient and no weight row.
enum class Padding { kError, kSkip };

// Builds the plan for targets[0..num_tokens). Checks every target and every tree offset the
// batch reads, so that no later step can read out of bounds; returns a message naming the
// problem, or "" on success. *plan is overwritten; its vectors keep their storage, so a
// caller building many plans can reuse one.
std::string BuildVisitPlan(const TreeView& tree, const int64* targets, int64 num_tokens,
                           VisitPlan* plan, PlanFor use = PlanFor::kBackward,
                           Padding padding = Padding::kError);

}  // namespace tf_hsm

#endif  // TF_HSM_CC_CORE_VISIT_PLAN_H_
