// Row updates of the sparse optimizers (tf_hsm.optimizers.LazyAdam, SparseAdagrad and
// SparseSGD) in one pass over each touched row, instead of merging repeated rows
// (tf.unique and a segment sum), a gather, a few whole-batch elementwise ops and a scatter
// per slot. Each element goes through the same float operations, in the same order, as
// Keras' Adam, Adagrad and SGD apply to it (the build uses no FMA contraction), so a row
// gets the bits Keras' dense update would give it.
#ifndef TF_HSM_CC_CORE_SPARSE_ROWS_H_
#define TF_HSM_CC_CORE_SPARSE_ROWS_H_

#include <algorithm>
#include <cmath>
#include <vector>

#include "cc/core/prefetch.h"
#include "cc/core/tree_view.h"

namespace tf_hsm {

// How far ahead ForEachDistinctRow requests the rows it updates, in bytes of one variable.
constexpr int64 kRequestAheadBytes = 2048;

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

// Scalars of one SGD step.
template <typename T>
struct SgdStep {
  T learning_rate;
  T momentum;     // used only with a momentum row
  bool nesterov;  // likewise
};

// Without a momentum row (m == nullptr): w <- w - g learning_rate. With one:
// m <- m momentum - g learning_rate, then w <- w + m, or with nesterov
// w <- w + (m momentum - g learning_rate).
template <typename T>
void SgdRow(const T* g, int64 n, const SgdStep<T>& s, T* w, T* m);

// acc <- acc + g^2; w <- w - (learning_rate g) / sqrt(acc + epsilon).
template <typename T>
void AdagradRow(const T* g, int64 n, T learning_rate, T epsilon, T* w, T* acc);

// out <- 0 + g[ks[0]] + g[ks[1]] + ..., rows of `width` elements, added in the order of
// ks, as tf.math.unsorted_segment_sum adds the rows of one segment.
template <typename T>
void SumRows(const T* g, int64 width, const int64* ks, int64 count, T* out);

// Calls update(row, g_row) once for every distinct row named in rows[0, n) (each in
// [0, num_rows)), with g_row the sum (SumRows) of the gradient rows g[k] (each `width`
// elements) of all k that name it, in the order of k: the rows of a sparse gradient
// merged as tf.unique + tf.math.unsorted_segment_sum merge them, without building the
// merged gradient. A row named once is passed as g[k] itself, not copied: the sum would
// be 0 + g[k], which differs from g[k] only where an element is -0, so the updates read
// 0 + g_row[i] (the sum's bits either way; a sum never ends in -0). Copying every row
// through a buffer made the update of a large table ~5x slower on the AMD EPYC: the
// table's rows, waited on from memory, were read right after the buffer was written.
// The rows are split into ranges run in parallel, so the result is the same on any
// thread count. request(row) is called a few entries before update(row), for
// the caller to ask for the row's lines (RequestLines): the touched rows of a large table
// are cache misses at scattered places, and the update would otherwise wait on each one.
template <typename T, typename Update, typename Request>
void ForEachDistinctRow(const int64* rows, int64 n, int64 num_rows, const T* g, int64 width,
                        int64 cost_per_row, const ParallelFor& parallel_for,
                        const Update& update, const Request& request) {
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
  const int64 row_bytes = width * static_cast<int64>(sizeof(T));
  // Entries requested ahead of their update: about kRequestAheadBytes of each variable.
  const int64 ahead = std::clamp<int64>(kRequestAheadBytes / std::max<int64>(1, row_bytes), 2, 16);
  parallel_for(num_ranges, cost, [&](int64 first, int64 last) {
    std::vector<T> sum(width);
    for (int64 r = first; r < last; ++r) {
      int64* ks = order.data() + begin[r];
      const int64 count = begin[r + 1] - begin[r];
      // Stable: the k naming one row stay in increasing order.
      std::stable_sort(ks, ks + count, [&](int64 a, int64 b) { return rows[a] < rows[b]; });
      int64 requested = 0;
      for (int64 j = 0; j < count;) {
        int64 end = j + 1;
        while (end < count && rows[ks[end]] == rows[ks[j]]) ++end;
        for (; requested < std::min(count, end + ahead); ++requested) {
          request(rows[ks[requested]]);
          RequestLines(g + ks[requested] * width, row_bytes, false);
        }
        if (end - j == 1) {
          update(rows[ks[j]], g + ks[j] * width);
        } else {
          SumRows(g, width, ks + j, end - j, sum.data());
          update(rows[ks[j]], static_cast<const T*>(sum.data()));
        }
        j = end;
      }
    }
  });
}

}  // namespace tf_hsm

#endif  // TF_HSM_CC_CORE_SPARSE_ROWS_H_
