// Small helpers shared by the CPU cores of the training and inference ops.
#ifndef TF_HSM_CC_CORE_SOFTMAX_UTIL_H_
#define TF_HSM_CC_CORE_SOFTMAX_UTIL_H_

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "cc/core/simd.h"
#include "cc/core/tree_view.h"

namespace tf_hsm {
// Per instruction set, like simd.h (see simd_isa.h).
inline namespace TF_HSM_SIMD_ISA {

// Weight rows per logits tile of a large node, in the training and the inference ops: a
// node's logits are computed and folded into its logsumexp in chunks of this many rows
// (a 128-row tile of D <= 1K floats stays in L2).
constexpr int64 kSlotTile = 128;

// Grows per-thread scratch on demand (never shrinks) and returns its data.
template <typename T>
T* Grow(std::vector<T>* v, int64 n) {
  if (static_cast<int64>(v->size()) < n) v->resize(n);
  return v->data();
}

// Folds n more logits into a running (max, sum of exp(z - max)), vectorized: the lane
// sums are combined in a fixed order. A NaN logit makes the sum NaN (the max ignores it),
// so NaN reaches exactly the rows it came from. One pass for the sum: each vector's
// exponentials are added as they are computed. The lanes past n hold -inf, so they add
// exp(-inf) = +0; while the max is -inf (every logit so far -inf) the terms are taken
// against 0, so they add +0 too, and a NaN among them still makes the sum NaN.
template <typename T>
void FoldLogSumExp(const T* z, int64 n, T* row_max, T* row_sum) {
  typedef simd::VecT<T> V;
  constexpr int64 w = simd::Vec<T>::kWidth;
  const T ninf = -std::numeric_limits<T>::infinity();
  V vmax = simd::Splat<T>(ninf);
  int64 j = 0;
  for (; j + w <= n; j += w) {
    const V v = simd::Load(z + j);
    vmax = v > vmax ? v : vmax;
  }
  V tail = simd::Splat<T>(ninf);
  if (j < n) {
    std::memcpy(&tail, z + j, (n - j) * sizeof(T));
    vmax = tail > vmax ? tail : vmax;
  }
  T lanes[w];
  std::memcpy(lanes, &vmax, sizeof(vmax));
  T chunk_max = ninf;
  for (int64 l = 0; l < w; ++l) chunk_max = lanes[l] > chunk_max ? lanes[l] : chunk_max;
  T m = *row_max;
  if (chunk_max > m) {
    *row_sum *= std::exp(m - chunk_max);
    m = chunk_max;
  }
  // A row whose logits so far are all -inf (masked children) sums exp(z - 0) = 0 for
  // them, not exp(-inf - -inf) = NaN, so later finite logits still give its sum.
  const V mv = simd::Splat<T>(m == ninf ? T(0) : m);
  V acc = {};
  for (j = 0; j + w <= n; j += w) acc += simd::ExpVec(simd::Load(z + j) - mv);
  if (j < n) acc += simd::ExpVec(tail - mv);
  *row_sum += simd::ReduceSum<T>(acc);
  *row_max = m;
}

// A range of a node's slots.
struct SlotRange {
  int64 begin;
  int64 end;
};

// K slots cut into `parts` ranges of whole kSlotTile tiles, as equal as the tiles allow
// (parts at most the number of tiles).
inline std::vector<SlotRange> TileRanges(int64 K, int64 parts) {
  const int64 tiles = (K + kSlotTile - 1) / kSlotTile;
  std::vector<SlotRange> out;
  for (int64 q = 0; q < parts; ++q) {
    out.push_back({tiles * q / parts * kSlotTile, std::min(K, tiles * (q + 1) / parts * kSlotTile)});
  }
  return out;
}

// lse[r] for n rows from P partial (max, sum) folds of their logits, part q's at
// part_max[q * n + r] and part_sum[q * n + r], merged in part order (a part with no
// finite logits has max -inf and adds nothing). A NaN in any part's max or sum makes
// lse NaN, as one NaN logit makes a whole log-sum-exp NaN: a part whose other logits
// are all -inf can keep max -inf and still carry its NaN in the sum.
template <typename T>
void MergeLogSumExps(int64 P, int64 n, const T* part_max, const T* part_sum, T* lse) {
  const T ninf = -std::numeric_limits<T>::infinity();
  for (int64 r = 0; r < n; ++r) {
    T m = ninf;
    bool nan = false;
    for (int64 q = 0; q < P; ++q) {
      m = std::max(m, part_max[q * n + r]);
      nan |= std::isnan(part_max[q * n + r]) || std::isnan(part_sum[q * n + r]);
    }
    if (nan) {
      lse[r] = std::numeric_limits<T>::quiet_NaN();
      continue;
    }
    T sum = 0;
    for (int64 q = 0; q < P; ++q) {
      const T mq = part_max[q * n + r];
      if (mq != ninf) sum += part_sum[q * n + r] * std::exp(mq - m);
    }
    lse[r] = m + std::log(sum);
  }
}

}  // namespace TF_HSM_SIMD_ISA
}  // namespace tf_hsm

#endif  // TF_HSM_CC_CORE_SOFTMAX_UTIL_H_
