// Software requests for cache lines that the hardware's prefetchers cannot foresee: rows
// at scattered places of a large table, asked for a little before they are used.
#ifndef TF_HSM_CC_CORE_PREFETCH_H_
#define TF_HSM_CC_CORE_PREFETCH_H_

#include <cstdint>

#include "cc/core/tree_view.h"

namespace tf_hsm {

// Asks for the cache line that holds p: to read (kForUpdate false) or to update in place,
// with __builtin_prefetch's temporal locality (3: keep it in every cache level).
//
// Every request in the library goes through here, for the empty volatile asm after the
// prefetch: GCC counts a prefetch as free of side effects, and C++ lets it assume that a
// loop ends (-ffinite-loops), so a loop that only requests lines is dead code to it. It
// deleted such loops: the sparse optimizers' requests for the rows they update (passed to
// ForEachDistinctRow as a lambda) were missing from the built op library altogether. The
// asm keeps each request and the loop around it, and emits no instruction.
template <bool kForUpdate = false, int kLocality = 3>
inline void RequestLine(const void* p) {
  __builtin_prefetch(p, kForUpdate ? 1 : 0, kLocality);
  asm volatile("" : : "r"(p));
}

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
      RequestLine<true>(c);
    } else {
      RequestLine(c);
    }
  }
}

}  // namespace tf_hsm

#endif  // TF_HSM_CC_CORE_PREFETCH_H_
