// The checks of the untrusted tree tensors (TreeView) that more than one part of the core
// makes, each with its one message: the training plan (visit_plan.cc), the inference plans
// (inference_*.cc) and the CUDA inference's host-side check (inference_gpu.cu). A caller
// tests the condition itself where it sits in a hot loop, and takes the message from here.
#ifndef TF_HSM_CC_CORE_TREE_CHECKS_H_
#define TF_HSM_CC_CORE_TREE_CHECKS_H_

#include <sstream>
#include <string>

#include "cc/core/tree_view.h"

namespace tf_hsm {

template <typename... Args>
std::string Message(const Args&... args) {
  std::ostringstream s;
  (s << ... << args);
  return s.str();
}

namespace tree_checks {

// The tree must have at least one class and one node (every other check indexes them).
inline std::string CheckNotEmpty(const TreeView& t) {
  if (t.num_classes < 1) return "the tree has no classes (path_begin needs at least 2 entries)";
  if (t.num_nodes < 1) return "the tree has no nodes (child_begin needs at least 2 entries)";
  return "";
}

// Class c's path [b, e) = path_begin[c:c+2] must be a non-empty range of path steps.
inline bool ValidPathRange(const TreeView& t, int64 b, int64 e) {
  return b >= 0 && b < e && e <= t.path_length;
}
inline std::string BadPathRange(const TreeView& t, int64 c) {
  return Message("malformed tree: path_begin[", c, ":", c + 2, "] = [", t.path_begin[c], ", ",
                 t.path_begin[c + 1], "] is not a non-empty range within the ", t.path_length,
                 " path steps");
}

// path_nodes[p] must be a node.
inline bool ValidNode(const TreeView& t, int64 n) { return n >= 0 && n < t.num_nodes; }
inline std::string BadPathNode(const TreeView& t, int64 p) {
  return Message("malformed tree: path_nodes[", p, "] = ", t.path_nodes[p],
                 " is not a node in [0, ", t.num_nodes, ")");
}

// Node n's slots [b, e) = child_begin[n:n+2] must be a non-empty range of weight rows.
inline bool ValidSlotRange(const TreeView& t, int64 b, int64 e) {
  return b >= 0 && b < e && e <= t.num_slots;
}
inline std::string BadSlotRange(const TreeView& t, int64 n) {
  return Message("malformed tree: child_begin[", n, ":", n + 2, "] = [", t.child_begin[n], ", ",
                 t.child_begin[n + 1], "] is not a non-empty slot range within the ",
                 t.num_slots, " weight rows");
}

// path_slots[p] must be one of the slots of the step's node n.
inline std::string BadPathSlot(const TreeView& t, int64 p, int64 n) {
  return Message("malformed tree: path_slots[", p, "] = ", t.path_slots[p],
                 " is outside the slots [", t.child_begin[n], ", ", t.child_begin[n + 1],
                 ") of node ", n);
}

// slot_child[slot] = code of node n must be a class in [0, C) or C + m for a node
// n < m < M; "" when it is.
inline std::string BadChildCode(const TreeView& t, int64 n, int64 slot, int64 code) {
  const int64 C = t.num_classes, M = t.num_nodes;
  if (code < 0 || code >= C + M) {
    return Message("malformed tree: slot_child[", slot, "] = ", code,
                   " is outside [0, num_classes + num_nodes) = [0, ", C + M, ")");
  }
  if (code >= C && code - C <= n) {
    return Message("malformed tree: slot_child[", slot, "] = ", code, " makes node ", code - C,
                   " a child of node ", n, "; a child node must be numbered after its parent");
  }
  return "";
}

// A class or node (child code `code`) that two slots name as their child.
inline std::string ReachedTwice(const TreeView& t, int64 code) {
  const bool is_class = code < t.num_classes;
  return Message("malformed tree: ", is_class ? "class " : "node ",
                 is_class ? code : code - t.num_classes, " is the child of more than one slot");
}

// A class or node (child code `code`) that no slot reached from the root names.
inline std::string NotReached(const TreeView& t, int64 code) {
  const bool is_class = code < t.num_classes;
  return Message("malformed tree: ", is_class ? "class " : "node ",
                 is_class ? code : code - t.num_classes,
                 " is not reached from the root through slot_child");
}

}  // namespace tree_checks
}  // namespace tf_hsm

#endif  // TF_HSM_CC_CORE_TREE_CHECKS_H_
