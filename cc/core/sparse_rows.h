// Row updates of the sparse optimizers (tf_hsm.optimizers.LazyAdam and SparseAdagrad) in
// one pass over each touched row, instead of a gather, ~10 whole-batch elementwise ops and
// a scatter per slot. Each element goes through the same float operations, in the same
// order, as Keras' Adam and Adagrad apply to it (the build uses no FMA contraction), so a
// row gets the bits Keras' dense update would give it.
#ifndef TF_HSM_CC_CORE_SPARSE_ROWS_H_
#define TF_HSM_CC_CORE_SPARSE_ROWS_H_

#include <algorithm>
#include <cmath>
#include <vector>

#include "cc/core/tree_view.h"

namespace tf_hsm {

// Scalars of one Adam step, computed by the caller as Keras computes them.
template <typename T>
struct AdamStep {
  T alpha;             // learning_rate * sqrt(1 - beta_2^t) / (1 - beta_1^t)
  T one_minus_beta_1;  // 1 - beta_1
  T one_minus_beta_2;  // 1 - beta_2
  T epsilon;
};

// m <- m + (g - m)(1 - beta_1); v <- v + (g^2 - v)(1 - beta_2); with v_hat (AMSGrad)
// v_hat <- max(v_hat, v), used in v's place; w <- w - (m alpha) / (sqrt(v) + epsilon).
// Defined in sparse_rows.cc, which is built to vectorise the square roots.
template <typename T>
void AdamRow(const T* g, int64 n, const AdamStep<T>& s, T* w, T* m, T* v, T* v_hat);

// acc <- acc + g^2; w <- w - (learning_rate g) / sqrt(acc + epsilon).
template <typename T>
void AdagradRow(const T* g, int64 n, T learning_rate, T epsilon, T* w, T* acc);

// Calls update(k, row) for every k in [0, n) with row = rows[k] (each in [0, num_rows)),
// with every row's updates made by one thread in the order of k, so that the result is
// that of the serial loop, repeated rows included, on any thread count: the rows are
// split into ranges, the k of each range listed in order, and the ranges run in parallel.
template <typename Update>
void ForEachRowInOrder(const int64* rows, int64 n, int64 num_rows, int64 cost_per_row,
                       const ParallelFor& parallel_for, const Update& update) {
  if (n <= 0) return;
  const int64 num_ranges = std::min<int64>(num_rows, 256);
  auto range_of = [&](int64 row) { return row * num_ranges / num_rows; };
  std::vector<int64> begin(num_ranges + 1, 0);
  for (int64 k = 0; k < n; ++k) ++begin[range_of(rows[k]) + 1];
  for (int64 r = 0; r < num_ranges; ++r) begin[r + 1] += begin[r];
  std::vector<int64> order(n);
  std::vector<int64> fill(begin.begin(), begin.end() - 1);
  for (int64 k = 0; k < n; ++k) order[fill[range_of(rows[k])]++] = k;
  const int64 cost = std::max<int64>(1, n / num_ranges) * cost_per_row;
  parallel_for(num_ranges, cost, [&](int64 first, int64 last) {
    for (int64 r = first; r < last; ++r) {
      for (int64 j = begin[r]; j < begin[r + 1]; ++j) update(order[j], rows[order[j]]);
    }
  });
}

}  // namespace tf_hsm

#endif  // TF_HSM_CC_CORE_SPARSE_ROWS_H_
