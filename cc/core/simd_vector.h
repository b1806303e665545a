// Vector primitives of the kernels, written with GCC/Clang vector extensions: the vector
// type of each element type (Vec), whole, partial and streaming loads and stores, lane
// shuffles, reductions in a fixed order, and transposes. The compiler emits AVX-512,
// AVX2, AVX or SSE from the same source depending on -march (simd_isa.h).
#ifndef TF_HSM_CC_CORE_SIMD_VECTOR_H_
#define TF_HSM_CC_CORE_SIMD_VECTOR_H_

#include <cstdint>
#include <cstring>

#include "cc/core/simd_isa.h"

namespace tf_hsm {
namespace simd {
// The instruction set's namespace: see simd_isa.h.
inline namespace TF_HSM_SIMD_ISA {

template <typename T>
struct Vec;
template <>
struct Vec<float> {
  typedef float type __attribute__((vector_size(kVectorBytes)));
  typedef std::int32_t itype __attribute__((vector_size(kVectorBytes)));
  static constexpr int kWidth = kVectorBytes / 4;
};
template <>
struct Vec<double> {
  typedef double type __attribute__((vector_size(kVectorBytes)));
  typedef std::int64_t itype __attribute__((vector_size(kVectorBytes)));
  static constexpr int kWidth = kVectorBytes / 8;
};

template <typename T>
using VecT = typename Vec<T>::type;

template <typename T>
inline VecT<T> Load(const T* p) {
  VecT<T> v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// Loads n < kWidth elements, the rest zero. With AVX-512 or AVX2 a masked load (the
// masked-out lanes are never read, so no fault past the end); otherwise a copy, which for
// a size unknown at compile time is a library call on every tail of every dot product.
template <typename T>
inline VecT<T> LoadPartial(const T* p, int64 n) {
  VecT<T> v = {};
  std::memcpy(&v, p, n * sizeof(T));
  return v;
}

template <typename T>
inline void Store(T* p, VecT<T> v) {
  std::memcpy(p, &v, sizeof(v));
}

template <typename T>
inline void StorePartial(T* p, VecT<T> v, int64 n) {
  std::memcpy(p, &v, n * sizeof(T));
}

// A whole-vector store that bypasses the caches, to p aligned to the vector's size
// (callers start their streams at a 64-byte line and store whole vectors from there): for
// output written once and not read back soon, whose lines then need no read for
// ownership (on these machines a sequential stream of them runs at about 3x the bandwidth
// of ordinary stores). Call StreamFence() before another thread reads what was stored.
template <typename T>
inline void StoreStreaming(T* p, VecT<T> v) {
  Store(p, v);
}

// dst[0, n) = src[0, n), the 64-byte aligned stretch of dst written with StoreStreaming
// (its unaligned ends with ordinary stores): for a block of output rows of any width.
template <typename T>
inline void CopyStreaming(T* dst, const T* src, int64 n) {
  constexpr int64 w = Vec<T>::kWidth;
  int64 head = static_cast<int64>((64 - reinterpret_cast<std::uintptr_t>(dst) % 64) % 64 / sizeof(T));
  if (reinterpret_cast<std::uintptr_t>(dst) % sizeof(T) != 0 || head > n) head = n;
  std::memcpy(dst, src, head * sizeof(T));
  int64 i = head;
  for (; i + w <= n; i += w) StoreStreaming(dst + i, Load(src + i));
  std::memcpy(dst + i, src + i, (n - i) * sizeof(T));
}

inline void StreamFence() {
#if defined(TF_HSM_MASKED_PARTIALS) || defined(TF_HSM_AVX2_PARTIALS)
  _mm_sfence();
#endif
}

#ifdef TF_HSM_MASKED_PARTIALS
template <>
inline void StoreStreaming<float>(float* p, VecT<float> v) {
  _mm512_stream_ps(p, reinterpret_cast<__m512>(v));
}
template <>
inline void StoreStreaming<double>(double* p, VecT<double> v) {
  _mm512_stream_pd(p, reinterpret_cast<__m512d>(v));
}
#endif

#ifdef TF_HSM_MASKED_PARTIALS
template <>
inline VecT<float> LoadPartial<float>(const float* p, int64 n) {
  return reinterpret_cast<VecT<float>>(_mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), p));
}
template <>
inline VecT<double> LoadPartial<double>(const double* p, int64 n) {
  return reinterpret_cast<VecT<double>>(_mm512_maskz_loadu_pd(static_cast<__mmask8>((1u << n) - 1), p));
}
template <>
inline void StorePartial<float>(float* p, VecT<float> v, int64 n) {
  _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << n) - 1), reinterpret_cast<__m512>(v));
}
template <>
inline void StorePartial<double>(double* p, VecT<double> v, int64 n) {
  _mm512_mask_storeu_pd(p, static_cast<__mmask8>((1u << n) - 1), reinterpret_cast<__m512d>(v));
}
#endif

#ifdef TF_HSM_AVX2_PARTIALS
namespace internal {

// Lanes i < n of 8 (float) or 4 (double) set, for any n (n <= 0: none).
inline __m256i FirstLanes32(int64 n) {
  const int m = static_cast<int>(n < 0 ? 0 : n > 8 ? 8 : n);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(m), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline __m256i FirstLanes64(int64 n) {
  const long long m = n < 0 ? 0 : n > 4 ? 4 : n;
  return _mm256_cmpgt_epi64(_mm256_set1_epi64x(m), _mm256_setr_epi64x(0, 1, 2, 3));
}

}  // namespace internal

// A vector is one AVX register here (kVectorBytes).
template <>
inline VecT<float> LoadPartial<float>(const float* p, int64 n) {
  return reinterpret_cast<VecT<float>>(_mm256_maskload_ps(p, internal::FirstLanes32(n)));
}
template <>
inline void StorePartial<float>(float* p, VecT<float> v, int64 n) {
  _mm256_maskstore_ps(p, internal::FirstLanes32(n), reinterpret_cast<__m256>(v));
}
template <>
inline void StoreStreaming<float>(float* p, VecT<float> v) {
  _mm256_stream_ps(p, reinterpret_cast<__m256>(v));
}
template <>
inline VecT<double> LoadPartial<double>(const double* p, int64 n) {
  return reinterpret_cast<VecT<double>>(_mm256_maskload_pd(p, internal::FirstLanes64(n)));
}
template <>
inline void StorePartial<double>(double* p, VecT<double> v, int64 n) {
  _mm256_maskstore_pd(p, internal::FirstLanes64(n), reinterpret_cast<__m256d>(v));
}
template <>
inline void StoreStreaming<double>(double* p, VecT<double> v) {
  _mm256_stream_pd(p, reinterpret_cast<__m256d>(v));
}
#endif

// v, kept in a register from here on. A vector loaded once and used by several
// multiply-adds is otherwise often reloaded by each of them (GCC folds the load into every
// instruction as a memory operand): a 4 x 4 tile then issues 16 vector loads per 16
// multiply-adds instead of 4, and the loads rather than the multiply-adds set its speed.
// On the AMD EPYC, one core, data in L2: the dW, dh and 4 x 4 logits tiles went from
// 72-81, 76-78 and 38-44 to 96-106, 96-100 and 80-95 GFLOP/s (its multiply-add peak is
// ~114). No effect on the arithmetic: the same operations in the same order. Only with
// AVX-512: with AVX2 vectors (one 32-byte register each) it measured the same.
template <typename V>
inline V InRegister(V v) {
#if defined(TF_HSM_MASKED_PARTIALS) && defined(__GNUC__)
  static_assert(sizeof(V) == 64, "one AVX-512 register");
  __asm__("" : "+v"(v));
#endif
  return v;
}

template <typename T>
inline VecT<T> Splat(T x) {
  VecT<T> v = {};
  return v + x;
}

// Lane i of the result is lane i ^ kStride of v (kStride a power of two below kWidth): the
// partner exchange of a butterfly. The patterns are literal constants: built at run time,
// they cost a trip through the stack on every call.
template <typename T, int kStride>
inline VecT<T> SwapLanes(VecT<T> v) {
  static_assert(kStride >= 1 && kStride < Vec<T>::kWidth, "a stride within the vector");
  if constexpr (Vec<T>::kWidth == 16) {
    if constexpr (kStride == 8) {
      return __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    } else if constexpr (kStride == 4) {
      return __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    } else if constexpr (kStride == 2) {
      return __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    } else {
      return __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    }
  } else if constexpr (Vec<T>::kWidth == 8) {
    if constexpr (kStride == 4) {
      return __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
    } else if constexpr (kStride == 2) {
      return __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5);
    } else {
      return __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6);
    }
  } else if constexpr (Vec<T>::kWidth == 4) {
    if constexpr (kStride == 2) {
      return __builtin_shufflevector(v, v, 2, 3, 0, 1);
    } else {
      return __builtin_shufflevector(v, v, 1, 0, 3, 2);
    }
  } else {
    static_assert(Vec<T>::kWidth == 2, "vectors of 2, 4, 8 or 16 lanes");
    return __builtin_shufflevector(v, v, 1, 0);
  }
}

// Within every aligned span of kSpan lanes, each lane becomes the sum of the span's lanes:
// lane i += lane i ^ half for half = kSpan / 2, ..., 1. Every lane of a span gets the same
// bits (addition commutes), and the order is ReduceSum's restricted to the span, so a span
// whose other lanes are +0 sums to exactly what ReduceSum gives for the whole vector.
template <typename T, int kSpan>
inline VecT<T> SpanSum(VecT<T> v) {
  if constexpr (kSpan > 1) {
    v = SpanSum<T, kSpan / 2>(v + SwapLanes<T, kSpan / 2>(v));
  }
  return v;
}

// Sum of the lanes, always in the same order: lane i += lane i ^ half for half = w/2, ...,
// 1, as lane shuffles and vector adds rather than a scalar loop through memory.
template <typename T>
inline T ReduceSum(VecT<T> v) {
  return SpanSum<T, Vec<T>::kWidth>(v)[0];
}

// Sums each of kWidth vectors: lane k of the result is the sum of the lanes of v[k].
// A fixed tree of lane shuffles and adds (about 3 operations per vector instead of a
// scalar loop per vector), so dot products pay little for their horizontal reduction.
// Each pass halves the lanes per group and doubles the groups: combining a and b puts a's
// partial sums in the low half of the result and b's in the high half. The shuffle
// patterns are literal constants (computed at run time they would cost more than the
// reduction itself).
namespace internal {

template <typename T, int kHalf>
inline VecT<T> CombinePair(VecT<T> a, VecT<T> b) {
  if constexpr (Vec<T>::kWidth == 16) {
    if constexpr (kHalf == 8) {
      return __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
             __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    } else if constexpr (kHalf == 4) {
      return __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
             __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    } else if constexpr (kHalf == 2) {
      return __builtin_shufflevector(a, b, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
             __builtin_shufflevector(a, b, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    } else {
      return __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
             __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    }
  } else if constexpr (Vec<T>::kWidth == 8) {
    if constexpr (kHalf == 4) {
      return __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11) +
             __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15);
    } else if constexpr (kHalf == 2) {
      return __builtin_shufflevector(a, b, 0, 1, 4, 5, 8, 9, 12, 13) +
             __builtin_shufflevector(a, b, 2, 3, 6, 7, 10, 11, 14, 15);
    } else {
      return __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14) +
             __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15);
    }
  } else if constexpr (Vec<T>::kWidth == 4) {
    if constexpr (kHalf == 2) {
      return __builtin_shufflevector(a, b, 0, 1, 4, 5) + __builtin_shufflevector(a, b, 2, 3, 6, 7);
    } else {
      return __builtin_shufflevector(a, b, 0, 2, 4, 6) + __builtin_shufflevector(a, b, 1, 3, 5, 7);
    }
  } else {
    static_assert(Vec<T>::kWidth == 2, "vectors of 2, 4, 8 or 16 lanes");
    return __builtin_shufflevector(a, b, 0, 2) + __builtin_shufflevector(a, b, 1, 3);
  }
}

// One pass with kHalf lanes per group over kCount vectors (combined in pairs), or over a
// single vector combined with itself once the pairs have run out, then the next pass.
template <typename T, int kHalf, int kCount>
inline VecT<T> ReducePasses(VecT<T>* level) {
  if constexpr (kCount > 1) {
    for (int k = 0; k < kCount / 2; ++k) {
      level[k] = CombinePair<T, kHalf>(level[2 * k], level[2 * k + 1]);
    }
  } else {
    level[0] = CombinePair<T, kHalf>(level[0], level[0]);
  }
  if constexpr (kHalf == 1) {
    return level[0];
  } else {
    return ReducePasses<T, kHalf / 2, (kCount > 1 ? kCount / 2 : 1)>(level);
  }
}

constexpr int PowerOfTwoAtLeast(int n) { return n <= 1 ? 1 : 2 * PowerOfTwoAtLeast((n + 1) / 2); }

}  // namespace internal

// Lane k of the result is the sum of the lanes of v[k], for k < kCount <= kWidth (lanes
// from kCount on are unspecified). Each sum is the same pairwise tree as ReduceSum's.
template <typename T, int kCount = Vec<T>::kWidth>
inline VecT<T> ReduceEach(const VecT<T>* v) {
  constexpr int w = Vec<T>::kWidth;
  static_assert(kCount >= 1 && kCount <= w, "one vector per result lane");
  constexpr int padded = internal::PowerOfTwoAtLeast(kCount);
  VecT<T> level[padded];
  for (int k = 0; k < kCount; ++k) level[k] = v[k];
  for (int k = kCount; k < padded; ++k) level[k] = VecT<T>{};
  return internal::ReducePasses<T, w / 2, padded>(level);
}

// Transposes the kWidth x kWidth matrix whose row r is v[r], in place: afterwards lane c
// of v[r] is what lane r of v[c] was. Stage h exchanges bit h of the row index with bit h
// of the lane index (rows r and r + h trade the off-diagonal h x h blocks), so log2(kWidth)
// stages of two-vector shuffles with literal patterns do it, with no trip through memory.
namespace internal {

template <typename T, int kHalf>
inline void TransposeStage(VecT<T>* v) {
  constexpr int w = Vec<T>::kWidth;
  for (int r = 0; r < w; ++r) {
    if (r & kHalf) continue;
    const VecT<T> a = v[r], b = v[r + kHalf];
    if constexpr (w == 16 && kHalf == 8) {
      v[r] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
      v[r + kHalf] = __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    } else if constexpr (w == 16 && kHalf == 4) {
      v[r] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27);
      v[r + kHalf] = __builtin_shufflevector(a, b, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
    } else if constexpr (w == 16 && kHalf == 2) {
      v[r] = __builtin_shufflevector(a, b, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29);
      v[r + kHalf] = __builtin_shufflevector(a, b, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
    } else if constexpr (w == 16) {
      v[r] = __builtin_shufflevector(a, b, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30);
      v[r + kHalf] = __builtin_shufflevector(a, b, 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
    } else if constexpr (w == 2) {
      v[r] = __builtin_shufflevector(a, b, 0, 2);
      v[r + kHalf] = __builtin_shufflevector(a, b, 1, 3);
    } else if constexpr (w == 4 && kHalf == 2) {
      v[r] = __builtin_shufflevector(a, b, 0, 1, 4, 5);
      v[r + kHalf] = __builtin_shufflevector(a, b, 2, 3, 6, 7);
    } else if constexpr (w == 4) {
      v[r] = __builtin_shufflevector(a, b, 0, 4, 2, 6);
      v[r + kHalf] = __builtin_shufflevector(a, b, 1, 5, 3, 7);
    } else if constexpr (kHalf == 4) {
      v[r] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11);
      v[r + kHalf] = __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15);
    } else if constexpr (kHalf == 2) {
      v[r] = __builtin_shufflevector(a, b, 0, 1, 8, 9, 4, 5, 12, 13);
      v[r + kHalf] = __builtin_shufflevector(a, b, 2, 3, 10, 11, 6, 7, 14, 15);
    } else {
      v[r] = __builtin_shufflevector(a, b, 0, 8, 2, 10, 4, 12, 6, 14);
      v[r + kHalf] = __builtin_shufflevector(a, b, 1, 9, 3, 11, 5, 13, 7, 15);
    }
  }
}

}  // namespace internal

template <typename T>
inline void Transpose(VecT<T>* v) {
  constexpr int w = Vec<T>::kWidth;
  static_assert(w == 2 || w == 4 || w == 8 || w == 16, "vectors of 2, 4, 8 or 16 lanes");
  if constexpr (w >= 16) internal::TransposeStage<T, 8>(v);
  if constexpr (w >= 8) internal::TransposeStage<T, 4>(v);
  if constexpr (w >= 4) internal::TransposeStage<T, 2>(v);
  internal::TransposeStage<T, 1>(v);
}

// Within every aligned span of kSpan lanes, the largest lane, by SpanSum's tree with
// v = s > v ? s : v in place of the add: a NaN partner never wins, so the span's first lane
// is its largest non-NaN lane unless that lane itself is NaN.
template <typename T, int kSpan>
inline VecT<T> SpanMax(VecT<T> v) {
  if constexpr (kSpan > 1) {
    const VecT<T> s = SwapLanes<T, kSpan / 2>(v);
    v = SpanMax<T, kSpan / 2>(s > v ? s : v);
  }
  return v;
}

// Largest lane, by the same tree as ReduceSum. A NaN lane loses every comparison.
template <typename T>
inline T ReduceMax(VecT<T> v) {
  return SpanMax<T, Vec<T>::kWidth>(v)[0];
}

// The lane indices 0, 1, ..., kWidth - 1.
template <typename T>
inline typename Vec<T>::itype Iota() {
  static const typename Vec<T>::itype iota = [] {
    typename Vec<T>::itype v;
    for (int i = 0; i < Vec<T>::kWidth; ++i) v[i] = i;
    return v;
  }();
  return iota;
}

}  // namespace TF_HSM_SIMD_ISA
}  // namespace simd
}  // namespace tf_hsm

#endif  // TF_HSM_CC_CORE_SIMD_VECTOR_H_
