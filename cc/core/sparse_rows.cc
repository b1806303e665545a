// The row updates of cc/core/sparse_rows.h. Built with -fno-math-errno, so that std::sqrt
// may be a vector instruction (correctly rounded all the same), and -ffp-contract=off, so
// that no product and sum are fused into one rounding (see cc/BUILD).
#include "cc/core/sparse_rows.h"

#include <algorithm>
#include <cmath>

namespace tf_hsm {

// The row updates read each gradient element as 0 + g[i]: ForEachDistinctRow passes a
// row named once as it is, and this gives the bits of the merged sum (0 + g) it stands
// for, -0 included.
template <typename T>
void AdamRow(const T* g, int64 n, const AdamStep<T>& s, T* w, T* m, T* v, T* v_hat) {
  for (int64 i = 0; i < n; ++i) {
    const T gi = T(0) + g[i];
    const T mi = m[i] + (gi - m[i]) * s.one_minus_beta_1;
    const T vi = v[i] + (gi * gi - v[i]) * s.one_minus_beta_2;
    m[i] = mi;
    v[i] = vi;
  }
  if (v_hat != nullptr) {
    for (int64 i = 0; i < n; ++i) {
      // tf.maximum: NaN if either is NaN.
      const T a = v_hat[i], b = v[i];
      v_hat[i] = a != a || b != b ? a + b : std::max(a, b);
    }
  }
  const T* second = v_hat != nullptr ? v_hat : v;
  for (int64 i = 0; i < n; ++i) {
    w[i] = w[i] - (m[i] * s.alpha) / (std::sqrt(second[i]) + s.epsilon);
  }
}

template <typename T>
void SgdRow(const T* g, int64 n, const SgdStep<T>& s, T* w, T* m) {
  if (m == nullptr) {
    for (int64 i = 0; i < n; ++i) w[i] = w[i] - (T(0) + g[i]) * s.learning_rate;
    return;
  }
  if (s.nesterov) {
    for (int64 i = 0; i < n; ++i) {
      const T step = (T(0) + g[i]) * s.learning_rate;
      const T mi = m[i] * s.momentum - step;
      m[i] = mi;
      w[i] = w[i] + (mi * s.momentum - step);
    }
    return;
  }
  for (int64 i = 0; i < n; ++i) {
    const T mi = m[i] * s.momentum - (T(0) + g[i]) * s.learning_rate;
    m[i] = mi;
    w[i] = w[i] + mi;
  }
}

template <typename T>
void AdagradRow(const T* g, int64 n, T learning_rate, T epsilon, T* w, T* acc) {
  for (int64 i = 0; i < n; ++i) {
    const T gi = T(0) + g[i];
    const T a = acc[i] + gi * gi;
    acc[i] = a;
    w[i] = w[i] - (learning_rate * gi) / std::sqrt(a + epsilon);
  }
}

template <typename T>
void SumRows(const T* g, int64 width, const int64* ks, int64 count, T* out) {
  std::fill(out, out + width, T(0));
  for (int64 j = 0; j < count; ++j) {
    const T* row = g + ks[j] * width;
    for (int64 i = 0; i < width; ++i) out[i] = out[i] + row[i];
  }
}

template void SumRows<float>(const float*, int64, const int64*, int64, float*);
template void SumRows<double>(const double*, int64, const int64*, int64, double*);
template void AdamRow<float>(const float*, int64, const AdamStep<float>&, float*, float*,
                             float*, float*);
template void AdamRow<double>(const double*, int64, const AdamStep<double>&, double*,
                              double*, double*, double*);
template void SgdRow<float>(const float*, int64, const SgdStep<float>&, float*, float*);
template void SgdRow<double>(const double*, int64, const SgdStep<double>&, double*, double*);
template void AdagradRow<float>(const float*, int64, float, float, float*, float*);
template void AdagradRow<double>(const double*, int64, double, double, double*, double*);

}  // namespace tf_hsm
