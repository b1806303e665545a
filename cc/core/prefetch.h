// Software requests for cache lines that the hardware's prefetchers cannot foresee: rows
// at scattered places of a large table, asked for a little before they are used.
#ifndef TF_HSM_CC_CORE_PREFETCH_H_
#define TF_HSM_CC_CORE_PREFETCH_H_

#include <cstdint>

#include "cc/core/tree_view.h"

namespace tf_hsm {

// Asks for every cache line of [p, p + bytes), to read, or to update in place (the lines
// are then requested for writing, so that the update does not wait to own them).
inline void RequestLines(const void* p, int64 bytes, bool for_update) {
  if (bytes <= 0) return;
  // From the line that holds the first byte to the one that holds the last: a range that
  // does not start on a line boundary spans one more line than bytes / 64.
  const std::uintptr_t first = reinterpret_cast<std::uintptr_t>(p) & ~std::uintptr_t{63};
  const std::uintptr_t last = reinterpret_cast<std::uintptr_t>(p) + bytes - 1;
  for (std::uintptr_t line = first; line <= last; line += 64) {
    const char* const c = reinterpret_cast<const char*>(line);
    if (for_update) {
      __builtin_prefetch(c, 1, 3);
    } else {
      __builtin_prefetch(c);
    }
  }
}

}  // namespace tf_hsm

#endif  // TF_HSM_CC_CORE_PREFETCH_H_
