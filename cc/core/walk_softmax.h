// The softmax of a token's steps through walked nodes (at most kWalkMaxBranching
// children, visit_plan.h): several steps packed into the lanes of one vector, so that the
// max, the exponential, the sum and the log are paid once per vector, with the same bits
// for a step alone or in any batch. Used by log_prob.cc's forward and by
// log_prob_backward.cc's backward and fused SGD.
#ifndef TF_HSM_CC_CORE_WALK_SOFTMAX_H_
#define TF_HSM_CC_CORE_WALK_SOFTMAX_H_

#include <cstdint>

#include "cc/core/simd.h"
#include "cc/core/softmax_util.h"
#include "cc/core/visit_plan.h"

namespace tf_hsm {
namespace walk_softmax {

// One step of a token's walk through a small node: its k <= kWalkMaxBranching weight rows
// are rows [row0, row0 + k) of the walk's row list, b its biases (or null), taken the
// child taken, coef where its coefficients go (or null).
template <typename T>
struct WalkStep {
  int64 row0;
  int64 k;
  int64 taken;
  const T* b;
  T* coef;
};

// dst[0, kSpan) = src[0, k) followed by zeros, for k <= kSpan. With AVX-512 a masked load
// and store; otherwise element by element: AVX2's masked stores to the stack, read back by
// a whole-vector load, were the softmax's slowest instructions on a Zen 3 EPYC (its share
// of E's backward, one thread: 8.8-8.9% of the samples with them, 7.4-7.5% without).
template <typename T, int kSpan>
inline void FillSpan(T* dst, const T* src, int64 k) {
#ifdef TF_HSM_MASKED_PARTIALS
  simd::StorePartial(dst, simd::LoadPartial(src, k), kSpan);
#else
  for (int q = 0; q < kSpan; ++q) dst[q] = q < k ? src[q] : T(0);
#endif
}

// The softmax of steps steps[0..n) of one token, whose logits z[row] are computed: each
// step has at most kSpan rows and more than kSpan / 2, and n <= kWidth / kSpan. Step j
// sits in lanes [j * kSpan, j * kSpan + k_j) of one vector, so the max, the exp, the sum and
// the log are paid once per vector rather than once per step.
//
// Each step adds z[taken] - logsumexp(z) to *total (in step order) when want_value. With
// grad, it writes the unit coefficients onehot(taken) - softmax(z) to coef[row] and, when
// set, to step.coef (the gradient of the step's term with respect to z; the upstream
// factor is applied later, as for grouped nodes). Every lane goes through the same
// operations wherever it sits (SpanMax / SpanSum sum within the span in a fixed tree), so
// a step gives the same bits alone or in any batch: the dW pass may recompute one step's
// coefficients by itself.
template <typename T, int kSpan>
void WalkSoftmax(const WalkStep<T>* steps, int64 n, const T* z_rows, bool want_value,
                 bool grad, T* total, T* coef_rows) {
  using V = simd::VecT<T>;
  using I = typename simd::Vec<T>::itype;
  using Lane = std::remove_reference_t<decltype(I{}[0])>;
  constexpr int kLanes = simd::Vec<T>::kWidth;
  // Assembled span by span (FillSpan and whole-span fills): written as loops over k,
  // these copies of a few elements compile to library calls.
  alignas(64) T lanes[kLanes] = {};
  alignas(64) T bias[kLanes] = {};
  alignas(64) Lane span_k[kLanes] = {}, span_taken[kLanes];
  for (int64 j = 0; j < n; ++j) {
    const WalkStep<T>& st = steps[j];
    FillSpan<T, kSpan>(lanes + j * kSpan, z_rows + st.row0, st.k);
    if (st.b != nullptr) FillSpan<T, kSpan>(bias + j * kSpan, st.b, st.k);
    for (int q = 0; q < kSpan; ++q) {
      span_k[j * kSpan + q] = static_cast<Lane>(st.k);
      span_taken[j * kSpan + q] = static_cast<Lane>(st.taken);
    }
  }
  for (int64 q = n * kSpan; q < kLanes; ++q) span_taken[q] = -1;
  V z = simd::Load(lanes);
  if (steps[0].b != nullptr) z += simd::Load(bias);  // biases are all or none
  I k_of_lane, taken_of_lane;
  std::memcpy(&k_of_lane, span_k, sizeof(k_of_lane));
  std::memcpy(&taken_of_lane, span_taken, sizeof(taken_of_lane));
  const I in_span = simd::Iota<T>() & (kSpan - 1);
  const I valid = in_span < k_of_lane;
  const I taken = in_span == taken_of_lane;
  const V m = simd::SpanMax<T, kSpan>(valid ? z : simd::Splat<T>(-std::numeric_limits<T>::infinity()));
  // A NaN logit never wins the max; it reaches e, hence the sum, and so the value and dh.
  V e = simd::ExpVec(z - m);
  e = valid ? e : V{};
  const V sum = simd::SpanSum<T, kSpan>(e);
  if (want_value) {
    const V value = z - (m + simd::LogVec(sum));
    for (int64 j = 0; j < n; ++j) *total += value[j * kSpan + steps[j].taken];
  }
  if (!grad) return;
  V c = e * (simd::Splat<T>(-1) / sum);
  c += taken ? simd::Splat<T>(1) : V{};
  simd::Store(lanes, c);
  for (int64 j = 0; j < n; ++j) {
    const WalkStep<T>& st = steps[j];
    const V cj = simd::LoadPartial(lanes + j * kSpan, st.k);
    simd::StorePartial(coef_rows + st.row0, cj, st.k);
    if (st.coef != nullptr) simd::StorePartial(st.coef, cj, st.k);
  }
}

// One step wider than a vector (a node of 5 to 8 children in 4-lane vectors: double with
// AVX or AVX2, float with SSE alone; of 3 to 8 in 2-lane ones, double with SSE alone):
// WalkSoftmax's operations one lane at a time, the max and the sum in row order.
// Such steps always come here, so a step still gives the same bits alone or in a batch.
template <typename T>
void WalkSoftmaxByLane(const WalkStep<T>& st, const T* z_rows, bool want_value, bool grad,
                       T* total, T* coef_rows) {
  T z[kWalkMaxBranching], e[kWalkMaxBranching];
  T m = -std::numeric_limits<T>::infinity();
  for (int64 q = 0; q < st.k; ++q) {
    z[q] = z_rows[st.row0 + q] + (st.b != nullptr ? st.b[q] : T(0));
    m = z[q] > m ? z[q] : m;  // a NaN logit never wins, as in SpanMax
  }
  T sum = 0;
  for (int64 q = 0; q < st.k; ++q) {
    e[q] = std::exp(z[q] - m);
    sum += e[q];
  }
  if (want_value) *total += z[st.taken] - (m + std::log(sum));
  if (!grad) return;
  const T scale = T(-1) / sum;
  for (int64 q = 0; q < st.k; ++q) {
    const T c = e[q] * scale + (q == st.taken ? T(1) : T(0));
    coef_rows[st.row0 + q] = c;
    if (st.coef != nullptr) st.coef[q] = c;
  }
}

// WalkSoftmax where a span of kSpan lanes fits a vector; otherwise each step by lane.
template <typename T, int kSpan>
void WalkSoftmaxOfSpan(const WalkStep<T>* steps, int64 n, const T* z_rows, bool want_value,
                       bool grad, T* total, T* coef_rows) {
  if constexpr (kSpan <= simd::Vec<T>::kWidth) {
    WalkSoftmax<T, kSpan>(steps, n, z_rows, want_value, grad, total, coef_rows);
  } else {
    for (int64 j = 0; j < n; ++j) {
      WalkSoftmaxByLane<T>(steps[j], z_rows, want_value, grad, total, coef_rows);
    }
  }
}

// The lanes a step of k rows takes in WalkSoftmax: k rounded up to a power of two.
constexpr int64 WalkSpan(int64 k) { return k <= 1 ? 1 : k <= 2 ? 2 : k <= 4 ? 4 : 8; }
static_assert(kWalkMaxBranching <= 8, "WalkSpan covers nodes of up to 8 children");

// WalkSoftmax over steps[0..n), in batches of consecutive steps of one span.
template <typename T>
void WalkSoftmaxAll(const WalkStep<T>* steps, int64 n, const T* z_rows, bool want_value,
                    bool grad, T* total, T* coef_rows) {
  constexpr int64 kLanes = simd::Vec<T>::kWidth;
  for (int64 s = 0; s < n;) {
    const int64 span = WalkSpan(steps[s].k);
    int64 count = 1;
    while (s + count < n && (count + 1) * span <= kLanes && WalkSpan(steps[s + count].k) == span) ++count;
    const WalkStep<T>* batch = steps + s;
    switch (span) {
      case 1: WalkSoftmaxOfSpan<T, 1>(batch, count, z_rows, want_value, grad, total, coef_rows); break;
      case 2: WalkSoftmaxOfSpan<T, 2>(batch, count, z_rows, want_value, grad, total, coef_rows); break;
      case 4: WalkSoftmaxOfSpan<T, 4>(batch, count, z_rows, want_value, grad, total, coef_rows); break;
      default: WalkSoftmaxOfSpan<T, 8>(batch, count, z_rows, want_value, grad, total, coef_rows); break;
    }
    s += count;
  }
}

// The unit coefficients of one walked step alone (the dW pass, when they were not kept):
// the same bits as the walk gave them.
template <typename T>
void WalkStepCoefficients(const T* h, const T* w, const T* b, int64 k, int64 taken, int64 D,
                          T* coef) {
  const T* rows[kWalkMaxBranching];
  T z[kWalkMaxBranching], c[kWalkMaxBranching];
  for (int64 j = 0; j < k; ++j) rows[j] = w + j * D;
  simd::DotScattered<T>(h, rows, k, D, z);
  const WalkStep<T> step = {0, k, taken, b, coef};
  WalkSoftmaxAll<T>(&step, 1, z, false, true, nullptr, c);
}

}  // namespace walk_softmax
}  // namespace tf_hsm

#endif  // TF_HSM_CC_CORE_WALK_SOFTMAX_H_
