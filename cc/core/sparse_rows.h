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
#include <cstdint>
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

// Whether ForEachDistinctRow visits rows[0, n) in the gradient's order (true) or sorted by
// row (false), for a table of num_rows rows, with row_bytes per row in each of
// num_variables variables (the table and the optimizer's slots). A pass costs about its
// scattered accesses: the touched rows of a large table are cache and TLB misses however
// early they are requested (this machine kind reads scattered rows at ~5-7 GB/s against
// ~26 GB/s streaming). In the gradient's order the gradient is read front to back and
// the variables at scattered rows; sorted, the variables are walked in address order and
// the gradient read at scattered rows. Sorting can pay only where that walk is close to
// streaming (the touched rows are dense), there are several variables to walk against
// the one gradient, and the rows do not come in order already. Measured on the AMD EPYC
// (each order forced in turn in one process): with random row ids in a 1M x 300 table,
// SGD 4-13% faster in the gradient's order from 8K to 500K rows (32K within the noise),
// Adam 15% faster in it at 8K rows (150 KB apart), within the noise at 32K-100K, 7-13%
// slower at 226K-500K (5 KB apart and less). HSM gradients come in the backward's order,
// node by node: at scenario E (8,358 rows 30 KB apart, a quarter of the steps going
// back) the update took 1.4x less time in that order with SGD and with Adam; at D (95K
// rows 12.6 KB apart, ascending already) Adam's took 24 ms against 29 sorted, the sort
// and the gradient's requests costing more than they saved.
constexpr int64 kSortedVisitMaxGapBytes = 16 << 10;
inline bool VisitInGradientOrder(const int64* rows, int64 n, int64 num_rows, int64 row_bytes,
                                 int num_variables) {
  if (num_variables <= 1 || n <= 1) return true;
  const double mean_gap_bytes = static_cast<double>(num_rows) / n * row_bytes;
  if (mean_gap_bytes > kSortedVisitMaxGapBytes) return true;
  // Rows already in order, but for at most one step in eight going back.
  int64 descents = 0;
  for (int64 k = 1; k < n; ++k) descents += rows[k] < rows[k - 1];
  return descents * 8 <= n;
}

// Calls update(row, g_row) once for every distinct row named in rows[0, n) (each in
// [0, num_rows)), with g_row the sum (SumRows) of the gradient rows g[k] (each `width`
// elements) of all k that name it, in the order of k: the rows of a sparse gradient
// merged as tf.unique + tf.math.unsorted_segment_sum merge them, without building the
// merged gradient. A row named once is passed as g[k] itself, not copied: the sum would
// be 0 + g[k], which differs from g[k] only where an element is -0, so the updates read
// 0 + g_row[i] (the sum's bits either way; a sum never ends in -0). Copying every row
// through a buffer made the update of a large table ~5x slower on the AMD EPYC: the
// table's rows, waited on from memory, were read right after the buffer was written.
// Rows are visited in the order VisitInGradientOrder picks for num_variables variables;
// each row is updated by one thread with the same sum, so the result is the same on any
// thread count and in either order. request(row) is called a few entries before
// update(row), for the caller to ask for the row's lines (RequestLines): the touched
// rows of a large table are cache misses at scattered places, and the update would
// otherwise wait on each one. A row visited right after the row before it in the table
// is not requested: the hardware's prefetcher streams such runs already, and at D (95K
// rows a step in runs of ~1,000) requesting them made LazyAdam's update ~10% slower.
template <typename T, typename Update, typename Request>
void ForEachDistinctRow(const int64* rows, int64 n, int64 num_rows, const T* g, int64 width,
                        int64 cost_per_row, int num_variables, const ParallelFor& parallel_for,
                        const Update& update, const Request& request) {
  if (n <= 0) return;
  const int64 row_bytes = width * static_cast<int64>(sizeof(T));
  // Entries requested ahead of their update: about kRequestAheadBytes of each variable.
  const int64 ahead = std::clamp<int64>(kRequestAheadBytes / std::max<int64>(1, row_bytes), 2, 16);
  // Sorts ks[0, count) by (row, k): the k naming one row become adjacent, in increasing
  // order. (A key unique to each entry: no stable sort and its buffer needed.)
  auto sort_by_row = [rows](int64* ks, int64 count) {
    std::sort(ks, ks + count, [rows](int64 a, int64 b) {
      return rows[a] < rows[b] || (rows[a] == rows[b] && a < b);
    });
  };
  // The end of the run of ks[j, stop) naming the same row as ks[j].
  auto run_end = [rows](const int64* ks, int64 j, int64 stop) {
    int64 end = j + 1;
    while (end < stop && rows[ks[end]] == rows[ks[j]]) ++end;
    return end;
  };
  // Updates the row that ks[0, count) name (in increasing k): straight from its gradient
  // row when one k names it, else from the sum of theirs, made in *sum.
  auto update_run = [&](const int64* ks, int64 count, std::vector<T>* sum) {
    if (count == 1) {
      update(rows[ks[0]], g + ks[0] * width);
      return;
    }
    sum->resize(width);
    SumRows(g, width, ks, count, sum->data());
    update(rows[ks[0]], static_cast<const T*>(sum->data()));
  };

  if (VisitInGradientOrder(rows, n, num_rows, row_bytes, num_variables)) {
    // The rows named more than once, found with a bit per table row (78 KB for 624K rows)
    // rather than by sorting every entry: for E's 8,358 entries the pass without its
    // updates took 0.04 ms this way and 0.14 ms sorting. Usually there are none (an HSM
    // gradient names each row once).
    const int64 words = (num_rows + 63) / 64;
    std::vector<uint64_t> seen(words, 0), repeated;
    for (int64 k = 0; k < n; ++k) {
      const int64 w = rows[k] >> 6;
      const uint64_t bit = uint64_t{1} << (rows[k] & 63);
      if ((seen[w] & bit) != 0) {
        if (repeated.empty()) repeated.assign(words, 0);
        repeated[w] |= bit;
      }
      seen[w] |= bit;
    }
    // first[k] (only when some row is repeated): kOnce when rows[k] is named only by k;
    // for a repeated row, the position in repeats[] of its run at the run's first
    // (smallest) k, and kLater at the run's other k, which that first k's update covers.
    constexpr int64 kOnce = -1, kLater = -2;
    std::vector<int64> first, repeats;
    if (!repeated.empty()) {
      first.assign(n, kOnce);
      for (int64 k = 0; k < n; ++k) {
        if ((repeated[rows[k] >> 6] >> (rows[k] & 63)) & 1) repeats.push_back(k);
      }
      sort_by_row(repeats.data(), static_cast<int64>(repeats.size()));
      const int64 count = static_cast<int64>(repeats.size());
      for (int64 j = 0; j < count;) {
        const int64 end = run_end(repeats.data(), j, count);
        first[repeats[j]] = j;
        for (int64 i = j + 1; i < end; ++i) first[repeats[i]] = kLater;
        j = end;
      }
    }
    auto role = [&](int64 k) { return first.empty() ? kOnce : first[k]; };
    parallel_for(n, cost_per_row, [&](int64 lo, int64 hi) {
      std::vector<T> sum;
      int64 requested = lo;
      for (int64 k = lo; k < hi; ++k) {
        for (; requested < std::min(hi, k + 1 + ahead); ++requested) {
          const bool follows = requested > lo && rows[requested] == rows[requested - 1] + 1;
          if (role(requested) != kLater && !follows) request(rows[requested]);
        }
        const int64 j = role(k);
        if (j == kOnce) {
          update_run(&k, 1, &sum);
        } else if (j != kLater) {
          const int64 stop = static_cast<int64>(repeats.size());
          update_run(repeats.data() + j, run_end(repeats.data(), j, stop) - j, &sum);
        }
      }
    });
    return;
  }

  // In row order: the entries bucketed by ranges of rows (up to 256 ranges of 2^shift
  // rows), each range sorted and updated by one thread.
  int shift = 0;
  while ((num_rows - 1) >> shift >= 256) ++shift;
  const int64 num_ranges = ((num_rows - 1) >> shift) + 1;
  std::vector<int64> begin(num_ranges + 1, 0);
  for (int64 k = 0; k < n; ++k) ++begin[(rows[k] >> shift) + 1];
  for (int64 r = 0; r < num_ranges; ++r) begin[r + 1] += begin[r];
  std::vector<int64> order(n);
  std::vector<int64> fill(begin.begin(), begin.end() - 1);
  for (int64 k = 0; k < n; ++k) order[fill[rows[k] >> shift]++] = k;
  const int64 cost = std::max<int64>(1, n / num_ranges) * cost_per_row;
  parallel_for(num_ranges, cost, [&](int64 lo, int64 hi) {
    std::vector<T> sum;
    for (int64 r = lo; r < hi; ++r) {
      int64* ks = order.data() + begin[r];
      const int64 count = begin[r + 1] - begin[r];
      sort_by_row(ks, count);
      int64 requested = 0;
      for (int64 j = 0; j < count;) {
        const int64 end = run_end(ks, j, count);
        for (; requested < std::min(count, end + ahead); ++requested) {
          const bool follows = requested > 0 && rows[ks[requested]] == rows[ks[requested - 1]] + 1;
          if (!follows) request(rows[ks[requested]]);
          RequestLines(g + ks[requested] * width, row_bytes, false);
        }
        update_run(ks + j, end - j, &sum);
        j = end;
      }
    }
  });
}

}  // namespace tf_hsm

#endif  // TF_HSM_CC_CORE_SPARSE_ROWS_H_
