// Dot-product and multiply-add kernels over rows of a block: one token's path (rows
// scattered through memory), or rows against a contiguous block of weight rows. Every
// dot product is summed by the same sequence of operations whichever kernel computes
// it, so they give the same bits and DotBlock is free to choose among them.
#ifndef TF_HSM_CC_CORE_SIMD_DOT_H_
#define TF_HSM_CC_CORE_SIMD_DOT_H_

#include <cstring>
#include <type_traits>

#include "cc/core/prefetch.h"
#include "cc/core/simd_isa.h"
#include "cc/core/simd_vector.h"

namespace tf_hsm {
namespace simd {
// The instruction set's namespace: see simd_isa.h.
inline namespace TF_HSM_SIMD_ISA {

// out[r] = dot(h[0:d], rows[r][0:d]) for r < kRows: kRows independent accumulator chains
// over d sharing each load of h, then ReduceEach (per kWidth rows), so every sum is
// ReduceSum's tree whatever kRows is.
template <typename T, int kRows>
inline void DotGroup(const T* h, const T* const* rows, int64 d, T* out) {
  constexpr int64 w = Vec<T>::kWidth;
  const T* r[kRows];
  VecT<T> acc[kRows];
  for (int i = 0; i < kRows; ++i) {
    r[i] = rows[i];
    acc[i] = VecT<T>{};
  }
  int64 k = 0;
  for (; k + w <= d; k += w) {
    const VecT<T> hv = Load(h + k);
    for (int i = 0; i < kRows; ++i) acc[i] += hv * Load(r[i] + k);
  }
  if (k < d) {
    const VecT<T> hv = LoadPartial(h + k, d - k);
    for (int i = 0; i < kRows; ++i) acc[i] += hv * LoadPartial(r[i] + k, d - k);
  }
  constexpr int kPerReduce = kRows < w ? kRows : static_cast<int>(w);  // 8 rows, 4 lanes: two
  for (int g = 0; g < kRows; g += kPerReduce) {
    const VecT<T> sums = ReduceEach<T, kPerReduce>(acc + g);
    for (int i = 0; i < kPerReduce; ++i) out[g + i] = sums[i];
  }
}

// Calls group(std::integral_constant<int, kRows>{}, r) over rows [0, n) in consecutive
// groups of 8, then at most one each of 4, 2 and 1 rows: the row-group kernels below take
// their group size as a template argument, so each size is its own unrolled kernel.
template <typename F>
inline void InRowGroups(int64 n, F&& group) {
  int64 r = 0;
  for (; r + 8 <= n; r += 8) group(std::integral_constant<int, 8>{}, r);
  if (r + 4 <= n) {
    group(std::integral_constant<int, 4>{}, r);
    r += 4;
  }
  if (r + 2 <= n) {
    group(std::integral_constant<int, 2>{}, r);
    r += 2;
  }
  if (r < n) group(std::integral_constant<int, 1>{}, r);
}

// out[r] = dot(h[0:d], rows[r][0:d]) for r < n, for rows scattered through memory (the
// nodes on one token's path).
template <typename T>
void DotScattered(const T* h, const T* const* rows, int64 n, int64 d, T* out) {
  InRowGroups(n, [&](auto rows_in_group, int64 r) {
    DotGroup<T, decltype(rows_in_group)::value>(h, rows + r, d, out + r);
  });
}

// dh[0:d] += sum_r coef[r] * rows[r][0:d] for r < kRows, added in increasing r.
template <typename T, int kRows>
inline void AccumulateGroup(T* dh, const T* const* rows, const T* coef, int64 d) {
  constexpr int64 w = Vec<T>::kWidth;
  const T* r[kRows];
  T c[kRows];
  for (int i = 0; i < kRows; ++i) {
    r[i] = rows[i];
    c[i] = coef[i];
  }
  int64 k = 0;
  for (; k + w <= d; k += w) {
    VecT<T> out = Load(dh + k);
    for (int i = 0; i < kRows; ++i) out += c[i] * Load(r[i] + k);
    Store(dh + k, out);
  }
  if (k < d) {
    VecT<T> out = LoadPartial(dh + k, d - k);
    for (int i = 0; i < kRows; ++i) out += c[i] * LoadPartial(r[i] + k, d - k);
    StorePartial(dh + k, out, d - k);
  }
}

// dh[0:d] += sum_r coef[r] * rows[r][0:d] for r < n, added in increasing r: dh once per
// group of 8, 4, 2 or 1 rows instead of once per row.
template <typename T>
void AccumulateScattered(T* dh, const T* const* rows, const T* coef, int64 n, int64 d) {
  InRowGroups(n, [&](auto rows_in_group, int64 r) {
    AccumulateGroup<T, decltype(rows_in_group)::value>(dh, rows + r, coef + r, d);
  });
}

// out[i * ldo + j] = dot(a[i][0:d], b[j * ldb + 0:d]) for i < na, j < nb.
// a holds row pointers (token rows are scattered in the batch); b is a contiguous block of
// weight rows. Register tile of kRows x kCols dot products (16 in all), each a vector
// accumulator over d; out-of-range tile rows repeat the last row and are not stored.
template <typename T, int64 kRows = 4, int64 kCols = 4>
void DotRows(const T* const* a, int64 na, const T* b, int64 ldb, int64 nb, int64 d, T* out,
             int64 ldo) {
  static_assert(kRows * kCols % Vec<T>::kWidth == 0, "the tile must fill whole reductions");
  constexpr int64 w = Vec<T>::kWidth;
  const int64 full = d - d % w;
  const int64 rest = d - full;
  // Columns outer: each tile of kCols weight rows is read from memory once and then serves
  // every group of rows from L1. While the first row group runs, the next tile's weight
  // rows are requested, a line (vector) of each per step over k (the rows stream from
  // memory, and the hardware prefetchers stop at every 4 KB page).
  for (int64 j0 = 0; j0 < nb; j0 += kCols) {
    const T* br[kCols];
    const char* next[kCols];
    for (int64 c = 0; c < kCols; ++c) {
      br[c] = b + (j0 + c < nb ? j0 + c : nb - 1) * ldb;
      next[c] = reinterpret_cast<const char*>(b + (j0 + kCols + c < nb ? j0 + kCols + c : nb - 1) * ldb);
    }
    for (int64 i0 = 0; i0 < na; i0 += kRows) {
      const T* ar[kRows];
      for (int64 r = 0; r < kRows; ++r) ar[r] = a[i0 + r < na ? i0 + r : na - 1];
      const bool ask = kCols <= 8 && i0 == 0 && j0 + kCols < nb;
      VecT<T> acc[kRows * kCols] = {};
      for (int64 k = 0; k < full; k += w) {
        // A line per 64 bytes of k, whatever the vector width.
        if (ask && k * sizeof(T) % 64 == 0) {
          for (int64 c = 0; c < kCols; ++c) RequestLine(next[c] + k * sizeof(T));
        }
        VecT<T> av[kRows], bv[kCols];
        for (int64 r = 0; r < kRows; ++r) av[r] = InRegister(Load(ar[r] + k));
        for (int64 c = 0; c < kCols; ++c) bv[c] = InRegister(Load(br[c] + k));
        for (int64 r = 0; r < kRows; ++r)
          for (int64 c = 0; c < kCols; ++c) acc[r * kCols + c] += av[r] * bv[c];
      }
      if (rest) {
        if (ask) {
          for (int64 c = 0; c < kCols; ++c) RequestLine(next[c] + full * sizeof(T));
        }
        VecT<T> av[kRows], bv[kCols];
        for (int64 r = 0; r < kRows; ++r) av[r] = LoadPartial(ar[r] + full, rest);
        for (int64 c = 0; c < kCols; ++c) bv[c] = LoadPartial(br[c] + full, rest);
        for (int64 r = 0; r < kRows; ++r)
          for (int64 c = 0; c < kCols; ++c) acc[r * kCols + c] += av[r] * bv[c];
      }
      // Reduced kWidth at a time: lane q of a reduction is tile entry q.
      T sums[kRows * kCols];
      for (int64 q = 0; q < kRows * kCols; q += w) {
        const VecT<T> reduced = ReduceEach<T>(acc + q);
        std::memcpy(sums + q, &reduced, sizeof(reduced));
      }
      for (int64 r = 0; r < kRows && i0 + r < na; ++r)
        for (int64 c = 0; c < kCols && j0 + c < nb; ++c)
          out[(i0 + r) * ldo + j0 + c] = sums[r * kCols + c];
    }
  }
}

// One d-long dot product: whole vectors, then the masked tail, then one reduction. DotEach
// and DotColumns both produce every entry with it, so they give the same bits.
template <typename T>
inline T Dot(const T* a, const T* b, int64 d) {
  constexpr int64 w = Vec<T>::kWidth;
  const int64 full = d - d % w;
  VecT<T> acc = {};
  for (int64 k = 0; k < full; k += w) acc += Load(a + k) * Load(b + k);
  if (full < d) acc += LoadPartial(a + full, d - full) * LoadPartial(b + full, d - full);
  return ReduceSum<T>(acc);
}

// Asks for weight row j + kPrefetchAhead of b when it exists. A matrix-vector product
// streaming rows from memory has too little arithmetic per row to hide the misses, and
// the hardware prefetchers stop at every 4 KB page.
constexpr int64 kPrefetchAhead = 8;  // weight rows

template <typename T>
inline void PrefetchRowAhead(const T* b, int64 ldb, int64 j, int64 nb, int64 d) {
  if (j + kPrefetchAhead >= nb) return;
  const char* row = reinterpret_cast<const char*>(b + (j + kPrefetchAhead) * ldb);
  for (int64 o = 0; o < d * static_cast<int64>(sizeof(T)); o += 64) RequestLine<false, 2>(row + o);
}

// Same result layout as DotRows, one dot product at a time: for tiles with fewer than four
// rows or columns, where DotRows' 4 x 4 register tile would mostly compute padding. The
// first pass over b streams its rows from memory, so it prefetches them.
template <typename T>
void DotEach(const T* const* a, int64 na, const T* b, int64 ldb, int64 nb, int64 d, T* out,
             int64 ldo) {
  for (int64 i = 0; i < na; ++i) {
    for (int64 j = 0; j < nb; ++j) {
      if (i == 0) PrefetchRowAhead(b, ldb, j, nb, d);
      out[i * ldo + j] = Dot(a[i], b + j * ldb, d);
    }
  }
}

// DotEach's products and bits with the loops swapped: each weight row is loaded once
// and dotted with every row of a, so a block streamed from memory is read once for a
// handful of rows (DotEach reads it once per row; DotRows' 4 x 4 tile computes padding
// and spends as long reducing as multiplying at small d).
template <typename T>
void DotColumns(const T* const* a, int64 na, const T* b, int64 ldb, int64 nb, int64 d,
                T* out, int64 ldo) {
  for (int64 j = 0; j < nb; ++j) {
    PrefetchRowAhead(b, ldb, j, nb, d);
    for (int64 i = 0; i < na; ++i) out[i * ldo + j] = Dot(a[i], b + j * ldb, d);
  }
}

// out[i * ldo + j] = dot(a[i][0:d], b[j * ldb + 0:d]) for i < na, j < nb, by the kernel
// that suits the block's shape; they give the same bits, so the choice never changes a
// result. One to three rows stream the block once for all of them, one dot product at a
// time (DotColumns): the wider tiles (1 x 16, 2 x 8) spend as much on their reductions as
// on the products at small d, and their strided loads stream slower than consecutive rows
// (AMD EPYC, 1000 rows from memory: at D = 64, 12-17 us against 31-34 us for one or two
// rows; at D = 300 and 512, 61-140 us against 108-195 us for one to three). A 4 x 4
// register tile (DotRows) would otherwise be mostly padding below four rows or four
// columns (DotEach).
template <typename T>
void DotBlock(const T* const* a, int64 na, const T* b, int64 ldb, int64 nb, int64 d, T* out,
              int64 ldo) {
  if (na < 4 && nb >= 16) {
    DotColumns<T>(a, na, b, ldb, nb, d, out, ldo);
  } else if (na < 4 || nb < 4) {
    DotEach<T>(a, na, b, ldb, nb, d, out, ldo);
  } else {
    DotRows<T>(a, na, b, ldb, nb, d, out, ldo);
  }
}

}  // namespace TF_HSM_SIMD_ISA
}  // namespace simd
}  // namespace tf_hsm

#endif  // TF_HSM_CC_CORE_SIMD_DOT_H_
