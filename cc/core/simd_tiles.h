// Register-tiled kernels of the training step: logits of many rows against a block of
// weight rows packed into column panels (an outer product, no horizontal reductions),
// and the gradient's dh += coef @ W and dW += coef^T @ H, tiled so that each output is
// summed in one fixed order whatever the tile around it.
#ifndef TF_HSM_CC_CORE_SIMD_TILES_H_
#define TF_HSM_CC_CORE_SIMD_TILES_H_

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cc/core/prefetch.h"
#include "cc/core/simd_isa.h"
#include "cc/core/simd_vector.h"

namespace tf_hsm {
namespace simd {
// The instruction set's namespace: see simd_isa.h.
inline namespace TF_HSM_SIMD_ISA {

// How many vectors wide (at most max) a register tile of `rows` rows can be while its
// accumulators stay in registers with 4 to spare for the operands: 4 with AVX-512's 32
// registers; with AVX2's 16, 2 for 6 rows and 3 for 4. The tiles using it sum every output
// element in the same order whatever their width, so the choice never changes a result.
template <typename T>
constexpr int64 TileVectors(int64 rows, int64 max) {
  const int64 per_vector = (static_cast<int64>(sizeof(VecT<T>)) + kRegisterBytes - 1) / kRegisterBytes;
  const int64 fit = (kVectorRegisters - 4) / (rows * per_vector);
  return fit < 1 ? 1 : fit > max ? max : fit;
}

// Copies weight rows b[0..nb) x [0, d) into column panels of kWidth rows each, transposed:
// panels[(p * d + k) * kWidth + c] = b[(p * kWidth + c) * ldb + k] (zero past nb). The
// outer-product kernel below then streams one panel vector per k. Each kWidth x kWidth
// block goes through registers (Transpose): element by element, packing a cluster of 316
// rows of D = 512 took ~100 us, longer than the logits it served for up to ~24 tokens.
template <typename T>
void PackPanels(const T* b, int64 ldb, int64 nb, int64 d, T* panels) {
  constexpr int64 w = Vec<T>::kWidth;
  for (int64 j0 = 0; j0 < nb; j0 += w) {
    T* panel = panels + (j0 / w) * d * w;
    const int64 cols = nb - j0 < w ? nb - j0 : w;
    for (int64 k = 0; k < d; k += w) {
      const int64 n = d - k < w ? d - k : w;
      VecT<T> v[w];
      for (int64 c = 0; c < w; ++c) {
        if (c >= cols) {  // past the last row: zero (and no address past the block formed)
          v[c] = VecT<T>{};
          continue;
        }
        const T* src = b + (j0 + c) * ldb + k;
        v[c] = n == w ? Load(src) : LoadPartial(src, n);
      }
      Transpose<T>(v);
      for (int64 r = 0; r < n; ++r) Store(panel + (k + r) * w, v[r]);
    }
  }
}

namespace internal {

// kRows token rows x kPanels panels of the product, summed over k in increasing order, then
// bias[j] if given.
template <typename T, int64 kRows, int64 kPanels>
inline void OuterTile(const T* const* ar, const T* panels, int64 d, int64 p0, int64 nb,
                      int64 rows, T* out, int64 ldo, const T* bias) {
  constexpr int64 w = Vec<T>::kWidth;
  auto columns = [&](int64 q) {
    const int64 j = (p0 + q) * w;
    return nb - j < w ? nb - j : w;
  };
  VecT<T> acc[kRows][kPanels] = {};
  const T* pp = panels + p0 * d * w;
  for (int64 k = 0; k < d; ++k) {
    VecT<T> bv[kPanels];
    for (int64 q = 0; q < kPanels; ++q) bv[q] = Load(pp + (q * d + k) * w);
    for (int64 r = 0; r < kRows; ++r) {
      const T s = ar[r][k];
      for (int64 q = 0; q < kPanels; ++q) acc[r][q] += s * bv[q];
    }
  }
  if (bias != nullptr) {
    for (int64 q = 0; q < kPanels; ++q) {
      const T* bq = bias + (p0 + q) * w;
      const VecT<T> bv = columns(q) == w ? Load(bq) : LoadPartial(bq, columns(q));
      for (int64 r = 0; r < rows; ++r) acc[r][q] += bv;
    }
  }
  for (int64 r = 0; r < rows; ++r) {
    for (int64 q = 0; q < kPanels; ++q) {
      T* o = out + r * ldo + (p0 + q) * w;
      if (columns(q) == w) {
        Store(o, acc[r][q]);
      } else {
        StorePartial(o, acc[r][q], columns(q));
      }
    }
  }
}

}  // namespace internal

// Same result as DotRows (out[i * ldo + j] = dot(a[i], b_j), plus bias[j] when bias is
// given, added to the finished sum as a separate pass would) from packed panels, as an
// outer product: no horizontal reductions, tiles of 6 rows x 4 panels (24 accumulators;
// 4 rows for a last group of at most 4). Each output is summed over k in increasing order
// wherever it sits in the tile, in registers over the whole of k. (Summing k in blocks of
// 64 with the partial sums parked in out, so that the slices every row group shares stay
// in L1, was 13-17% slower on the AMD EPYC: 64 rows x 128 slots at D = 128-512, the
// panels in L2 and the rows scattered, 87-92 against 98-108 GFLOP/s on one core.)
template <typename T>
void DotRowsPacked(const T* const* a, int64 na, const T* panels, int64 nb, int64 d, T* out,
                   int64 ldo, const T* bias = nullptr) {
  constexpr int64 w = Vec<T>::kWidth;
  constexpr int64 kPanels = TileVectors<T>(6, 4);
  const int64 num_panels = (nb + w - 1) / w;
  auto tiles = [&](auto panels_tag, int64 p0) {
    constexpr int64 P = decltype(panels_tag)::value;
    auto group = [&](auto rows_tag, int64 i0) {
      constexpr int64 R = decltype(rows_tag)::value;
      const T* ar[R];
      for (int64 r = 0; r < R; ++r) ar[r] = a[i0 + r < na ? i0 + r : na - 1];
      const int64 rows = na - i0 < R ? na - i0 : R;
      internal::OuterTile<T, R, P>(ar, panels, d, p0, nb, rows, out + i0 * ldo, ldo, bias);
    };
    int64 i0 = 0;
    for (; na - i0 > 4; i0 += 6) group(std::integral_constant<int64, 6>(), i0);
    if (i0 < na) group(std::integral_constant<int64, 4>(), i0);
  };
  int64 p0 = 0;
  for (; p0 + kPanels <= num_panels; p0 += kPanels) tiles(std::integral_constant<int64, kPanels>(), p0);
  for (; p0 < num_panels; ++p0) tiles(std::integral_constant<int64, 1>(), p0);
}

// Whether more than 8 of the n row addresses start in one of the 64 sets of a 64-byte-line
// L1 (the 8 ways of the smaller ones): rows a power of two of bytes apart, e.g. D = 512
// floats, do, and then slices of them read together evict each other and come from L2.
template <typename RowAt>
inline bool RowsShareL1Sets(int64 n, RowAt row_at) {
  int count[64] = {};
  for (int64 i = 0; i < n; ++i) {
    if (++count[(reinterpret_cast<std::uintptr_t>(row_at(i)) >> 6) & 63] > 8) return true;
  }
  return false;
}

// Copies the column slices [k, k + kVecs kWidth) of n rows, row_at(i), next to each other:
// row i's slice to packed[i * kVecs * kWidth, ...).
template <typename T, int64 kVecs, typename RowAt>
inline void PackSlices(int64 n, RowAt row_at, int64 k, T* packed) {
  constexpr int64 w = Vec<T>::kWidth;
  for (int64 i = 0; i < n; ++i)
    for (int64 v = 0; v < kVecs; ++v) Store(packed + (i * kVecs + v) * w, Load(row_at(i) + k + v * w));
}

namespace internal {

// out[i0 + r][k, k + kVecs * kWidth) += sum_j coef[(i0 + r) * ldc + j] * bk[j * ldb ...]
// for r < kRows, summed in increasing j: kRows x kVecs independent accumulator chains.
// bk is the block's column k (b + k), or a packed copy of that slice. With kPartial the
// last vector has only `last` lanes (the columns past d).
template <typename T, int64 kRows, int64 kVecs, bool kPartial = false>
inline void AccumulateRowsBlock(T* const* out, int64 i0, const T* coef, int64 ldc, const T* bk,
                                int64 ldb, int64 nb, int64 k, int64 last = 0) {
  constexpr int64 w = Vec<T>::kWidth;
  auto load = [&](const T* src, int64 v) {
    return kPartial && v == kVecs - 1 ? LoadPartial(src + v * w, last) : Load(src + v * w);
  };
  VecT<T> acc[kRows][kVecs];
  for (int64 r = 0; r < kRows; ++r)
    for (int64 v = 0; v < kVecs; ++v) acc[r][v] = load(out[i0 + r] + k, v);
  for (int64 j = 0; j < nb; ++j) {
    const T* bj = bk + j * ldb;
    T c[kRows];
    for (int64 r = 0; r < kRows; ++r) c[r] = coef[(i0 + r) * ldc + j];
    for (int64 v = 0; v < kVecs; ++v) {
      const VecT<T> bv = InRegister(load(bj, v));
      for (int64 r = 0; r < kRows; ++r) acc[r][v] += c[r] * bv;
    }
  }
  for (int64 r = 0; r < kRows; ++r) {
    for (int64 v = 0; v < kVecs; ++v) {
      if (kPartial && v == kVecs - 1) {
        StorePartial(out[i0 + r] + k + v * w, acc[r][v], last);
      } else {
        Store(out[i0 + r] + k + v * w, acc[r][v]);
      }
    }
  }
}

}  // namespace internal

// out[i][0:d] += sum_j coef[i * ldc + j] * b[j * ldb + 0:d] for i < na (out holds row
// pointers), j < nb, summed in increasing j. This is dh += coef @ W_block.
template <typename T>
void AccumulateRows(T* const* out, int64 na, const T* coef, int64 ldc, const T* b, int64 ldb,
                    int64 nb, int64 d) {
  constexpr int64 w = Vec<T>::kWidth;
  constexpr int64 kVecs = TileVectors<T>(4, 4);
  const int64 full_rows = na - na % 4, full_k = d - d % (kVecs * w);
  // Groups of four rows, column blocks outer: every row group reads the block's slice of
  // b from L1, unless the rows of b share L1 sets (RowsShareL1Sets): the slices are then
  // first copied next to each other (1.45x faster for 128 rows of 2 KB and 64 rows).
  constexpr int64 kSlice = kVecs * w, kMaxPacked = 128, kLine = 64 / sizeof(T);
  alignas(64) T packed[kMaxPacked * kSlice];
  auto b_row = [&](int64 j) { return b + j * ldb; };
  const bool pack = nb <= kMaxPacked && full_rows >= 12 &&  // fewer groups: the copy does not pay
                    RowsShareL1Sets(nb, b_row);
  for (int64 k = 0; k < full_k; k += kSlice) {
    if (pack) PackSlices<T, kVecs>(nb, b_row, k, packed);
    const T* bk = pack ? packed : b + k;
    const int64 ldk = pack ? kSlice : ldb;
    for (int64 i0 = 0; i0 < full_rows; i0 += 4) {
      // Request the next block's slices of its four output rows (rows of scattered tokens,
      // often not in L2): each block starts by loading them, which the out-of-order window
      // cannot reach from the block before. At B's root, dh 1.08x the speed.
      const bool last = i0 + 4 >= full_rows;
      const int64 ni = last ? 0 : i0 + 4, nk = last ? k + kSlice : k;
      if (nk < full_k) {
        for (int64 r = 0; r < 4; ++r)
          for (int64 l = 0; l < kSlice; l += kLine) RequestLine<true>(out[ni + r] + nk + l);
      }
      internal::AccumulateRowsBlock<T, 4, kVecs>(out, i0, coef, ldc, bk, ldk, nb, k);
    }
  }
  for (int64 i0 = 0; i0 < na; i0 += 4) {
    const int64 rows = na - i0 < 4 ? na - i0 : 4;
    int64 k = rows == 4 ? full_k : 0;
    // One to three rows: still at least 8 independent chains (a single token's row would
    // otherwise wait on one multiply-add chain per vector).
    auto blocks = [&](auto rows_tag, auto vecs_tag) {
      constexpr int64 kRows = decltype(rows_tag)::value, kVecs = decltype(vecs_tag)::value;
      for (; k + kVecs * w <= d; k += kVecs * w) {
        internal::AccumulateRowsBlock<T, kRows, kVecs>(out, i0, coef, ldc, b + k, ldb, nb, k);
      }
    };
    if (rows == 3) {
      blocks(std::integral_constant<int64, 3>(), std::integral_constant<int64, 4>());
    } else if (rows == 2) {
      blocks(std::integral_constant<int64, 2>(), std::integral_constant<int64, 4>());
      blocks(std::integral_constant<int64, 2>(), std::integral_constant<int64, 2>());
    } else if (rows == 1) {
      blocks(std::integral_constant<int64, 1>(), std::integral_constant<int64, 8>());
      blocks(std::integral_constant<int64, 1>(), std::integral_constant<int64, 4>());
    }
    // The columns left (fewer than a block's vectors): one block of them all, the last vector
    // partial, so that they too run rows x vectors chains (one vector at a time, the tail
    // of D = 300 took longer than the 256 columns before it).
    if (k == d) continue;
    const int64 vecs = (d - k + w - 1) / w, last = d - k - (vecs - 1) * w;
    auto tail = [&](auto rows_tag) {
      constexpr int64 R = decltype(rows_tag)::value;
      switch (vecs) {
        case 1: internal::AccumulateRowsBlock<T, R, 1, true>(out, i0, coef, ldc, b + k, ldb, nb, k, last); break;
        case 2: internal::AccumulateRowsBlock<T, R, 2, true>(out, i0, coef, ldc, b + k, ldb, nb, k, last); break;
        case 3: internal::AccumulateRowsBlock<T, R, 3, true>(out, i0, coef, ldc, b + k, ldb, nb, k, last); break;
        default: internal::AccumulateRowsBlock<T, R, 4, true>(out, i0, coef, ldc, b + k, ldb, nb, k, last); break;
      }
    };
    switch (rows) {
      case 1: tail(std::integral_constant<int64, 1>()); break;
      case 2: tail(std::integral_constant<int64, 2>()); break;
      case 3: tail(std::integral_constant<int64, 3>()); break;
      default: tail(std::integral_constant<int64, 4>()); break;
    }
  }
}

// out[j * ldo + 0:d] += sum_i coef[i * ldc + j] * a[i][0:d] for j < nb, i < na, summed in
// increasing i. This is dW_block += coef^T @ H. With overwrite, out's old contents are
// neither read nor needed: the sums start from +0, exactly as if out had been zeroed.
// With stream (overwrite only; out and ldo aligned to 64 bytes), whole vectors are stored
// past the caches (StoreStreaming; the caller fences).
template <typename T>
void AccumulateTransposed(T* out, int64 ldo, int64 nb, const T* coef, int64 ldc,
                          const T* const* a, int64 na, int64 d, bool overwrite = false,
                          bool stream = false) {
  constexpr int64 w = Vec<T>::kWidth;
  constexpr int64 kCols = 4, kVecs = TileVectors<T>(kCols, 4);  // independent accumulator chains
  const int64 full_cols = nb - nb % kCols, full_k = d - d % (kVecs * w);
  auto store = [&](T* o, VecT<T> v) {
    if (stream) {
      StoreStreaming(o, v);
    } else {
      Store(o, v);
    }
  };
  // Output rows [j0, j0 + 4) x columns [k, k + kVecs kWidth), summed over every a[i]; the
  // slice of a[i] is read at src(i) (a[i] + k, or its packed copy), token i's coefficients
  // of those rows at cj + i * cs (in coef, or in the panels below).
  auto tile = [&](int64 j0, int64 k, auto&& src, const T* cj, int64 cs) {
    VecT<T> acc[kCols][kVecs];
    for (int64 c = 0; c < kCols; ++c)
      for (int64 v = 0; v < kVecs; ++v)
        acc[c][v] = overwrite ? VecT<T>{} : Load(out + (j0 + c) * ldo + k + v * w);
    for (int64 i = 0; i < na; ++i) {
      VecT<T> av[kVecs];
      const T* ai = src(i);
      for (int64 v = 0; v < kVecs; ++v) av[v] = InRegister(Load(ai + v * w));
      const T* ci = cj + i * cs;
      for (int64 c = 0; c < kCols; ++c)
        for (int64 v = 0; v < kVecs; ++v) acc[c][v] += ci[c] * av[v];
    }
    for (int64 c = 0; c < kCols; ++c)
      for (int64 v = 0; v < kVecs; ++v) store(out + (j0 + c) * ldo + k + v * w, acc[c][v]);
  };
  // Output rows [j0, j0 + cols), columns from k on, one vector at a time (coefficients as
  // for `tile`).
  auto rest = [&](int64 j0, int64 cols, int64 k, const T* cj, int64 cs) {
    for (; k < d; k += w) {
      const int64 n = d - k < w ? d - k : w;
      VecT<T> acc[kCols];
      for (int64 c = 0; c < cols; ++c) {
        T* o = out + (j0 + c) * ldo + k;
        acc[c] = overwrite ? VecT<T>{} : n == w ? Load(o) : LoadPartial(o, n);
      }
      for (int64 i = 0; i < na; ++i) {
        const VecT<T> av = n == w ? Load(a[i] + k) : LoadPartial(a[i] + k, n);
        const T* ci = cj + i * cs;
        for (int64 c = 0; c < cols; ++c) acc[c] += ci[c] * av;
      }
      for (int64 c = 0; c < cols; ++c) {
        T* o = out + (j0 + c) * ldo + k;
        if (n == w) {
          store(o, acc[c]);
        } else {
          StorePartial(o, acc[c], n);
        }
      }
    }
  };
  if (stream) {
    // Each output row written in order (streamed lines then leave one row at a time).
    for (int64 j0 = 0; j0 < full_cols; j0 += kCols) {
      for (int64 k = 0; k < full_k; k += kVecs * w) {
        tile(j0, k, [&](int64 i) { return a[i] + k; }, coef + j0, ldc);
      }
      rest(j0, kCols, full_k, coef + j0, ldc);
    }
  } else {
    // The coefficients of each group of kCols output rows copied next to each other (panel
    // p holds coef[i][p kCols + c] at p * na * kCols + i * kCols + c): a tile then reads
    // its tokens' coefficients in order, where in coef each token's sit on a line of their
    // own, ldc apart. The root's dW chunks at V=1M, D=300, 40,000 tokens, one core, the
    // kernel alone over the step's data: 74-76 -> 94-97 GFLOP/s. The values and the order
    // of the sums are unchanged, so are the bits.
    static thread_local std::vector<T> panels;
    if (static_cast<int64>(panels.size()) < na * full_cols) panels.resize(na * full_cols);
    for (int64 i = 0; i < na; ++i) {
      for (int64 j0 = 0; j0 < full_cols; j0 += kCols) {
        for (int64 c = 0; c < kCols; ++c) panels[j0 * na + i * kCols + c] = coef[i * ldc + j0 + c];
      }
    }
    auto panel = [&](int64 j0) { return panels.data() + j0 * na; };
    // Column blocks outer: the a[i] slices of a block are read by every group of output
    // rows, from L1, unless the rows share L1 sets (RowsShareL1Sets): the slices are then
    // first copied next to each other (1.25x faster for 64 rows of 2 KB, 16 output rows).
    constexpr int64 kSlice = kVecs * w, kMaxPacked = 64;
    alignas(64) T packed[kMaxPacked * kSlice];
    auto a_row = [&](int64 i) { return a[i]; };
    const bool pack = na <= kMaxPacked && full_cols > kCols && RowsShareL1Sets(na, a_row);
    for (int64 k = 0; k < full_k; k += kSlice) {
      if (pack) {
        PackSlices<T, kVecs>(na, a_row, k, packed);
        for (int64 j0 = 0; j0 < full_cols; j0 += kCols) {
          tile(j0, k, [&](int64 i) { return packed + i * kSlice; }, panel(j0), kCols);
        }
      } else {
        for (int64 j0 = 0; j0 < full_cols; j0 += kCols) {
          tile(j0, k, [&](int64 i) { return a[i] + k; }, panel(j0), kCols);
        }
      }
    }
    for (int64 j0 = 0; j0 < full_cols; j0 += kCols) rest(j0, kCols, full_k, panel(j0), kCols);
  }
  if (full_cols < nb) rest(full_cols, nb - full_cols, 0, coef + full_cols, ldc);
}

// The bits of AccumulateTransposed(out, d, nb, coef, ldc, a, na, d, overwrite = true) for
// an output block whose nb rows of d are one contiguous stretch: every 64-byte line of it
// is stored past the caches straight from registers (StoreStreaming; the caller fences),
// its unaligned ends with ordinary stores. AccumulateTransposed can stream only rows that
// are whole vectors; for other widths (D = 300) staging the block and copying it out cost
// clusters that got a few tokens as much again as the streaming itself. A vector that runs
// from row j into row j + 1 takes its lanes' coefficients from both rows and its columns
// from `doubled` (scratch of na * 2 * d elements: each a[i] twice in a row). Each element
// is still summed over i in increasing order from +0. Needs d >= kWidth, so that a vector
// spans at most two rows.
template <typename T>
void StreamTransposed(T* out, int64 nb, const T* coef, int64 ldc, const T* const* a, int64 na,
                      int64 d, T* doubled) {
  constexpr int64 w = Vec<T>::kWidth;
  typedef typename Vec<T>::itype I;
  for (int64 i = 0; i < na; ++i) {
    std::memcpy(doubled + i * 2 * d, a[i], d * sizeof(T));
    std::memcpy(doubled + i * 2 * d + d, a[i], d * sizeof(T));
  }
  // The vector whose lane 0 is element (j, c) of the block.
  auto vector_at = [&](int64 j, int64 c) {
    const int64 in_row = d - c;  // lanes [0, in_row) are row j's, the rest row j + 1's
    VecT<T> acc{};
    if (in_row >= w) {
      for (int64 i = 0; i < na; ++i) acc += coef[i * ldc + j] * Load(doubled + i * 2 * d + c);
      return acc;
    }
    typedef typename std::conditional<sizeof(T) == 4, std::int32_t, std::int64_t>::type Lane;
    const I first_row = Iota<T>() < static_cast<Lane>(in_row);
    const int64 next = j + 1 < nb ? j + 1 : j;  // past the block: lanes that are not stored
    for (int64 i = 0; i < na; ++i) {
      const VecT<T> ci = first_row ? Splat<T>(coef[i * ldc + j]) : Splat<T>(coef[i * ldc + next]);
      acc += ci * Load(doubled + i * 2 * d + c);
    }
    return acc;
  };
  const int64 n = nb * d;
  int64 head = static_cast<int64>((64 - reinterpret_cast<std::uintptr_t>(out) % 64) % 64 / sizeof(T));
  if (reinterpret_cast<std::uintptr_t>(out) % sizeof(T) != 0 || head > n) head = n;
  int64 f = 0, j = 0, c = 0;
  auto advance = [&](int64 by) {  // by <= w <= d: at most one row boundary
    c += by;
    if (c >= d) {
      c -= d;
      ++j;
    }
  };
  while (f < head) {  // head < w unless the block is not aligned to its element size
    const int64 m = head - f < w ? head - f : w;
    StorePartial(out + f, vector_at(j, c), m);
    advance(m);
    f += m;
  }
  for (; f + w <= n; f += w) {
    StoreStreaming(out + f, vector_at(j, c));
    advance(w);
  }
  if (f < n) StorePartial(out + f, vector_at(j, c), n - f);
}

}  // namespace TF_HSM_SIMD_ISA
}  // namespace simd
}  // namespace tf_hsm

#endif  // TF_HSM_CC_CORE_SIMD_TILES_H_
