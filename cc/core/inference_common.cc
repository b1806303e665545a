// The inference core's checks of the untrusted tree tensors (see inference_common.h).
#include "cc/core/inference_common.h"

#include <string>
#include <vector>

namespace tf_hsm {
namespace inference_internal {
inline namespace TF_HSM_SIMD_ISA {

std::string CheckSizes(const TreeView& t, int64 num_rows, int64 dim, bool need_slot_child) {
  std::string err = tree_checks::CheckNotEmpty(t);
  if (!err.empty()) return err;
  if (num_rows < 0 || dim < 0) return Message("invalid sizes: ", num_rows, " rows of dimension ", dim);
  if (need_slot_child && t.slot_child == nullptr) return "slot_child is required";
  return "";
}

std::string NodeRange(const TreeView& t, int64 n, int64* begin, int64* end) {
  *begin = t.child_begin[n];
  *end = t.child_begin[n + 1];
  return tree_checks::ValidSlotRange(t, *begin, *end) ? "" : tree_checks::BadSlotRange(t, n);
}

std::string CheckChild(const TreeView& t, int64 n, int64 slot, int64 code) {
  if (ValidChild(t, n, code)) return "";
  return tree_checks::BadChildCode(t, n, slot, code);
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
