// LogProbAll's plan of the tree (cc/core/inference_sweep_plan.cc; private to the
// inference core): the nodes needed for a class range in sweep order, checked, with where
// each child's value goes, and the subtree groups that keep deep trees' values in cache.
#ifndef TF_HSM_CC_CORE_INFERENCE_SWEEP_PLAN_H_
#define TF_HSM_CC_CORE_INFERENCE_SWEEP_PLAN_H_

#include <string>
#include <vector>

#include "cc/core/inference.h"
#include "cc/core/inference_common.h"
#include "cc/core/tree_view.h"

namespace tf_hsm {
namespace inference_internal {
inline namespace TF_HSM_SIMD_ISA {

// The needed nodes in processing order (by depth, then id) and, for every child slot of
// each, where its value goes.
struct SweepPlan {
  int64 class_begin = 0, class_end = 0;
  std::vector<int64> node;         // [P] needed nodes; position 0 is the root
  std::vector<int64> level_begin;  // [levels + 1] position ranges of equal depth
  std::vector<int64> position;     // [M] position of each needed node, -1 for the others
  // [P] c >= 0 when every child of the node is a class of the range, in consecutive
  // columns c, c + 1, ... (a cluster of consecutive classes); else -1.
  std::vector<int64> run;
  std::vector<int64> parent;  // [P] the position of each needed node's parent (root: -1)
  // [P] the row of the node values that holds each needed node's log-probabilities: two
  // levels' worth of rows, alternating by depth, since a level's values are read by that
  // level and written by the one above it (a binary tree's values would otherwise take P
  // rows). Below a split level (see SubtreeGroups), rows within the node's group.
  std::vector<int64> value_row;
  int64 value_rows = 0;  // of the rows shared by all (above the split level, if any)
};

// Deep trees with wide levels (a binary tree over 1M classes has 250K nodes on one level)
// would need tens of MB of node values per row block, visited once per level from DRAM.
// Below a split level L, the subtrees of L's nodes are independent: each group of them is
// swept to the bottom by one thread, level by level, with its values in a small per-thread
// buffer, cache-resident. Needs the nodes of a group to be consecutive positions on every
// level (true of breadth-first numbered trees, as every builder makes); else none.
struct SubtreeGroups {
  int64 level = -1;  // L; -1: no groups, every level is swept across the whole tree
  int64 span = 0;    // levels L, L + 1, ..., L + span - 1
  int64 cap = 0;     // the most nodes of one group on one level
  std::vector<int64> begin, end;  // [G * span] positions of group g on level L + i
  int64 count() const { return span == 0 ? 0 : static_cast<int64>(begin.size()) / span; }
};

// Finds the nodes needed for classes [class_begin, class_end) and checks every offset the
// sweep will read: each needed node's slot range and child codes, each child node numbered
// after its parent and reached once, each class of the range reached exactly once.
std::string BuildSweepPlan(const TreeView& t, int64 class_begin, int64 class_end,
                           const ParallelFor& parallel_for, SweepPlan* plan);

// Finds the subtree groups for row blocks of `block` rows, if any: L is the first level
// with two levels below it and at least kMinGroups nodes, and enough that groups of equal
// width would take half the budget on the widest level below (larger groups read longer
// runs of weight rows per level; 1/4 measured 8% slower on a 1M-class binary tree);
// subtrees are not equal, so up to two levels further down are tried too.
void FindSubtreeGroups(const SweepPlan& plan, int64 block, SubtreeGroups* groups);

// The plan's value rows: levels above the split level (all levels without groups) share
// rows across the tree, those below it rows within their group (2 * cap of them).
void AssignValueRows(const SubtreeGroups& groups, SweepPlan* plan);

}  // namespace TF_HSM_SIMD_ISA
}  // namespace inference_internal

// A plan of a whole tree with the tree arrays it was made from, for row blocks of `block`
// rows with the packed kernel or not (the subtree groups depend on both).
struct SweepPlanCache::Entry {
  int64 num_classes = 0;
  bool packed = false;
  int64 block = 0;
  std::vector<int64> child_begin, slot_child;  // [num_nodes + 1], [num_slots]
  inference_internal::SweepPlan plan;
  inference_internal::SubtreeGroups groups;
};

namespace inference_internal {
inline namespace TF_HSM_SIMD_ISA {

// Whether the cached plan was made from this tree, for these row blocks.
bool PlanFits(const SweepPlanCache::Entry& e, const TreeView& t, bool packed, int64 block,
              const ParallelFor& parallel_for);

// Bytes a cached plan holds, the tree copies included.
int64 PlanBytes(const TreeView& t, const SweepPlan& plan);

}  // namespace TF_HSM_SIMD_ISA
}  // namespace inference_internal
}  // namespace tf_hsm

#endif  // TF_HSM_CC_CORE_INFERENCE_SWEEP_PLAN_H_
