// Small dense kernels the hierarchical softmax is built from, written with GCC/Clang vector
// extensions: the compiler emits AVX-512, AVX2, AVX or SSE from the same source depending on
// -march, which keeps one portable code path. Every output element is produced by the same
// fixed sequence of operations whatever the blocking around it, so results are identical
// across thread counts and tilings. That includes fusing a * b + c into one FMA in every
// kernel or in none, which configure.sh makes sure of for GCC's AMD Zen tuning.
#ifndef TF_HSM_CC_CORE_SIMD_H_
#define TF_HSM_CC_CORE_SIMD_H_

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "cc/core/prefetch.h"

#if defined(__AVX512F__) && !defined(__CUDACC__)
#include <immintrin.h>
#define TF_HSM_MASKED_PARTIALS 1
#elif defined(__AVX2__) && !defined(__CUDACC__)
// AVX2 without AVX-512: partial loads and stores are masked moves (vmaskmov, which never
// touches a masked-out element) rather than library copies, streaming stores vmovntps.
#include <immintrin.h>
#define TF_HSM_AVX2_PARTIALS 1
#endif

// Everything here is compiled for the instruction set of the file that includes it, and
// lives in an inline namespace named after that instruction set. Without it, a binary that
// links files built with different -march flags (the core is built for the host, other
// code need not be) would hold two builds of each template under one name; the linker
// keeps one copy of each function the compiler did not inline, so one file's code would
// silently run the other's, with the other's arithmetic (FMA or not).
#if defined(__AVX512F__)
#define TF_HSM_SIMD_ISA isa_avx512
#elif defined(__AVX2__) && defined(__FMA__)
#define TF_HSM_SIMD_ISA isa_avx2_fma
#elif defined(__FMA__)
#define TF_HSM_SIMD_ISA isa_fma
#elif defined(__AVX2__)
#define TF_HSM_SIMD_ISA isa_avx2
#elif defined(__AVX__)
#define TF_HSM_SIMD_ISA isa_avx
#else
#define TF_HSM_SIMD_ISA isa_baseline
#endif

namespace tf_hsm {
namespace simd {
inline namespace TF_HSM_SIMD_ISA {

using int64 = std::int64_t;

template <typename T>
struct Vec;
// The machine's vector registers: how many, and how wide (register-tile sizes).
#if defined(__AVX512F__)
constexpr int64 kVectorRegisters = 32, kRegisterBytes = 64;
#elif defined(__AVX__)
constexpr int64 kVectorRegisters = 16, kRegisterBytes = 32;
#else
constexpr int64 kVectorRegisters = 16, kRegisterBytes = 16;
#endif
// On x86 a vector is one register: 64 bytes with AVX-512, 32 with AVX or AVX2, 16 with
// SSE alone. GCC lowers comparisons and selects (x > y ? x : y) of vectors wider than a
// register to scalar code with branches, which made the exp, log and softmax kernels the
// slowest part of a step (E's backward: 2.7 ms with 64-byte vectors, 1.0-1.3 ms with
// 32-byte ones, on a Zen 3 EPYC), and builds their splats and register tiles through the
// stack (float64 at B, T=2,560, on an AVX2 build: 525 ms a step with 64-byte vectors).
// A vector can then be narrower than a walked node of up to 8 children: the walk's
// softmax takes such steps one lane at a time (WalkSoftmaxAll). Elsewhere (no x86 vector
// extension detected, e.g. another architecture) vectors stay 64 bytes.
#if defined(__SSE2__)
constexpr int kVectorBytes = static_cast<int>(kRegisterBytes);
#else
constexpr int kVectorBytes = 64;
#endif
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

// exp(x) elementwise over n values in place. float: a vectorized Cody-Waite range reduction
// with a degree-6 polynomial (max error ~2 ulp); NaN stays NaN, x < -87.3 gives 0, x > 88.7
// gives inf. double keeps std::exp, whose accuracy the float64 gradient checks rely on.
inline void ExpInPlace(double* x, int64 n) {
  for (int64 i = 0; i < n; ++i) x[i] = std::exp(x[i]);
}

// exp of every lane; double lanes go through std::exp (see ExpInPlace).
inline Vec<double>::type ExpVec(Vec<double>::type x) {
  for (int i = 0; i < Vec<double>::kWidth; ++i) x[i] = std::exp(x[i]);
  return x;
}

#ifdef TF_HSM_MASKED_PARTIALS
// AVX-512: the same reduction and polynomial, with n rounded by vrndscaleps and the 2^n
// applied by vscalefps, which is exact and overflows to inf by itself (x is clamped just
// above log(FLT_MAX) so that it does); about half the instructions of the portable
// version. min/max take x as the second operand so a NaN lane stays NaN.
inline Vec<float>::type ExpVec(Vec<float>::type x) {
  const __m512 hi = _mm512_set1_ps(88.8f), lo = _mm512_set1_ps(-87.3365f);
  __m512 v = reinterpret_cast<__m512>(x);
  const __mmask16 keep = _mm512_cmp_ps_mask(v, lo, _CMP_NLT_UQ);  // not below lo (or NaN)
  v = _mm512_max_ps(lo, _mm512_min_ps(hi, v));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(v, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), v);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return reinterpret_cast<Vec<float>::type>(_mm512_maskz_scalef_ps(keep, p, n));
}
#else
inline Vec<float>::type ExpVec(Vec<float>::type x) {
  typedef Vec<float>::type V;
  typedef Vec<float>::itype I;
  const V hi = Splat<float>(88.7228f), lo = Splat<float>(-87.3365f);
  const I is_nan = x != x;
  const I too_big = x > hi;
  const I too_small = x < lo;
  x = x > hi ? hi : x;
  x = x < lo ? lo : x;
  // n = round(x / ln 2), r = x - n ln 2 (ln 2 split in two for accuracy).
  const V fx = __builtin_convertvector(
      __builtin_convertvector(x * 1.44269504088896341f + (x >= 0 ? Splat<float>(0.5f) : Splat<float>(-0.5f)), I), V);
  V r = x - fx * 0.693359375f;
  r = r - fx * -2.12194440e-4f;
  V p = Splat<float>(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  // Scale by 2^n in two halves: 2^128 (x near 88.7) and 2^-126 have no normal float.
  const I n = __builtin_convertvector(fx, I);
  const I n1 = n >> 1;
  const I bits1 = (n1 + 127) << 23, bits2 = (n - n1 + 127) << 23;
  V scale1, scale2;
  std::memcpy(&scale1, &bits1, sizeof(scale1));
  std::memcpy(&scale2, &bits2, sizeof(scale2));
  V y = p * scale1 * scale2;
  const V inf = Splat<float>(std::numeric_limits<float>::infinity());
  y = too_small ? Splat<float>(0.0f) : y;
  y = too_big ? inf : y;
  y = is_nan ? x : y;
  return y;
}
#endif

// Natural log of every lane. float: x = m * 2^e with m in [sqrt(1/2), sqrt(2)), then
// log(x) = e ln 2 + log(m), log(m) = f - f^2/2 + f^3 P(f) for f = m - 1 with the degree-8
// minimax P of the Cephes library (max error ~1 ulp); ln 2 is split in two so e ln 2 adds
// no rounding of its own. Subnormals are scaled up first; 0 gives -inf, a negative or NaN
// lane NaN, +inf stays +inf. double lanes go through std::log.
inline Vec<double>::type LogVec(Vec<double>::type x) {
  for (int i = 0; i < Vec<double>::kWidth; ++i) x[i] = std::log(x[i]);
  return x;
}

// log(m) + e ln 2 for m in [sqrt(1/2), sqrt(2)] and a whole number e (as a float): the
// polynomial of LogVec.
inline Vec<float>::type LogReduced(Vec<float>::type m, Vec<float>::type ef) {
  typedef Vec<float>::type V;
  const V f = m - 1.0f;
  const V f2 = f * f;
  V poly = Splat<float>(7.0376836292e-2f);
  poly = poly * f - 1.1514610310e-1f;
  poly = poly * f + 1.1676998740e-1f;
  poly = poly * f - 1.2420140846e-1f;
  poly = poly * f + 1.4249322787e-1f;
  poly = poly * f - 1.6668057665e-1f;
  poly = poly * f + 2.0000714765e-1f;
  poly = poly * f - 2.4999993993e-1f;
  poly = poly * f + 3.3333331174e-1f;
  V y = poly * f * f2;
  y = y + ef * -2.12194440e-4f;
  y = y - 0.5f * f2;
  V r = f + y;
  return r + ef * 0.693359375f;
}

inline Vec<float>::type LogVec(Vec<float>::type x) {
  typedef Vec<float>::type V;
  typedef Vec<float>::itype I;
  const I tiny = x < std::numeric_limits<float>::min();
  V xs = tiny ? x * 8388608.0f : x;  // 2^23 brings a subnormal into the normal range
  I bits;
  std::memcpy(&bits, &xs, sizeof(bits));
  I e = ((bits >> 23) & 0xff) - 127;
  e = tiny ? e - 23 : e;
  const I mant_bits = (bits & 0x007fffff) | 0x3f800000;  // the same mantissa, exponent 0
  V m;
  std::memcpy(&m, &mant_bits, sizeof(m));
  const I above = m > 1.41421356237f;
  m = above ? m * 0.5f : m;
  e = above ? e + 1 : e;
  V r = LogReduced(m, __builtin_convertvector(e, V));
  const V inf = Splat<float>(std::numeric_limits<float>::infinity());
  const V nan = Splat<float>(std::numeric_limits<float>::quiet_NaN());
  r = x == inf ? inf : r;
  r = x == 0.0f ? -inf : r;
  r = x < 0.0f || x != x ? nan : r;
  return r;
}

// log(1 + u) of every lane for u in [0, 1] (NaN stays NaN): 1 + u is in [1, 2], so the
// reduction to [sqrt(1/2), sqrt(2)] is one halving, without LogVec's checks for zero,
// subnormals, negatives and inf. The sum 1 + u rounds as LogVec's argument would, and the
// result is within 1 ulp of the log of that rounded sum (core_test checks it). double
// lanes go through std::log1p.
inline Vec<double>::type LogOnePlusUnitVec(Vec<double>::type u) {
  for (int i = 0; i < Vec<double>::kWidth; ++i) u[i] = std::log1p(u[i]);
  return u;
}

inline Vec<float>::type LogOnePlusUnitVec(Vec<float>::type u) {
  typedef Vec<float>::type V;
  const V y = u + 1.0f;
  const auto above = y > 1.41421356237f;
  return LogReduced(above ? y * 0.5f : y, above ? Splat<float>(1.0f) : Splat<float>(0.0f));
}

inline void ExpInPlace(float* x, int64 n) {
  constexpr int64 w = Vec<float>::kWidth;
  int64 i = 0;
  for (; i + w <= n; i += w) Store(x + i, ExpVec(Load(x + i)));
  if (i < n) StorePartial(x + i, ExpVec(LoadPartial(x + i, n - i)), n - i);
}

}  // namespace TF_HSM_SIMD_ISA
}  // namespace simd
}  // namespace tf_hsm

#endif  // TF_HSM_CC_CORE_SIMD_H_
