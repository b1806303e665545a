// The inference core's checks of the untrusted tree tensors (see inference_common.h).
#include "cc/core/inference_common.h"

#include <string>
#include <vector>

namespace tf_hsm {
namespace inference_internal {
inline namespace TF_HSM_SIMD_ISA {

std::string CheckSizes(const TreeView& t, int64 num_rows, int64 dim, bool need_slot_child) {
  if (t.num_classes < 1) return "the tree has no classes (path_begin needs at least 2 entries)";
  if (t.num_nodes < 1) return "the tree has no nodes (child_begin needs at least 2 entries)";
  if (num_rows < 0 || dim < 0) return Message("invalid sizes: ", num_rows, " rows of dimension ", dim);
  if (need_slot_child && t.slot_child == nullptr) return "slot_child is required";
  return "";
}

std::string NodeRange(const TreeView& t, int64 n, int64* begin, int64* end) {
  *begin = t.child_begin[n];
  *end = t.child_begin[n + 1];
  if (*begin < 0 || *end <= *begin || *end > t.num_slots) {
    return Message("malformed tree: child_begin[", n, ":", n + 2, "] = [", *begin, ", ", *end,
                   "] is not a non-empty slot range within the ", t.num_slots, " weight rows");
  }
  return "";
}

std::string CheckChild(const TreeView& t, int64 n, int64 slot, int64 code) {
  if (ValidChild(t, n, code)) return "";
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

std::string CheckChildren(const TreeView& t, int64 n, int64 begin, int64 end) {
  // One vectorized sweep; the slot at fault is only looked for once one is known to be there.
  bool valid = true;
  for (int64 s = begin; s < end; ++s) valid &= ValidChild(t, n, t.slot_child[s]);
  if (valid) return "";
  for (int64 s = begin; s < end; ++s) {
    if (!ValidChild(t, n, t.slot_child[s])) return CheckChild(t, n, s, t.slot_child[s]);
  }
  return "";
}

std::string FirstError(const std::vector<std::string>& errors) {
  for (const std::string& e : errors)
    if (!e.empty()) return e;
  return "";
}

}  // namespace TF_HSM_SIMD_ISA
}  // namespace inference_internal
}  // namespace tf_hsm
