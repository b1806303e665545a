// Elementwise exp and log of vectors: vectorized polynomials for float, the C library's
// functions lane by lane for double.
#ifndef TF_HSM_CC_CORE_SIMD_MATH_H_
#define TF_HSM_CC_CORE_SIMD_MATH_H_

#include <cmath>
#include <cstring>
#include <limits>

#include "cc/core/simd_isa.h"
#include "cc/core/simd_vector.h"

namespace tf_hsm {
namespace simd {
// The instruction set's namespace: see simd_isa.h.
inline namespace TF_HSM_SIMD_ISA {

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

#endif  // TF_HSM_CC_CORE_SIMD_MATH_H_
