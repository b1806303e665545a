// Software requests for cache lines that the hardware's prefetchers cannot foresee: rows
// at scattered places of a large table, asked for a little before they are used.
#ifndef TF_HSM_CC_CORE_PREFETCH_H_
#define TF_HSM_CC_CORE_PREFETCH_H_

#include "cc/core/tree_view.h"

namespace tf_hsm {

// Asks for every cache line of [p, p + bytes), to read, or to update in place (the lines
// are then requested for writing, so that the update does not wait to own them).
inline void RequestLines(const void* p, int64 bytes, bool for_update) {
  if (bytes <= 0) return;
  const char* const first = static_cast<const char*>(p);
  // A range that does not start on a line boundary ends in one more line than bytes / 64.
  const char* const last = first + bytes - 1;
  for (const char* c = first; c <= last; c += 64) {
    if (for_update) {
      __builtin_prefetch(c, 1, 3);
    } else {
      __builtin_prefetch(c);
    }
  }
  if (for_update) {
    __builtin_prefetch(last, 1, 3);
  } else {
    __builtin_prefetch(last);
  }
}

}  // namespace tf_hsm

#endif  // TF_HSM_CC_CORE_PREFETCH_H_
