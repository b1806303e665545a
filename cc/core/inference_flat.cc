// The exact softmax's inference as blocked matrix products (see inference_flat.h).
#include "cc/core/inference_flat.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "cc/core/simd_tiles.h"

namespace tf_hsm {
namespace inference_internal {
inline namespace TF_HSM_SIMD_ISA {
namespace {

constexpr int64 kFlatRowTile = 96;  // rows per product with a packed slot tile: whole 6-row tiles
constexpr int64 kFlatMaxPartitions = 8;
constexpr int64 kFlatPartitionSlots = 4096;  // about this many slots a partition, at least

// The partitions of K slots: 1 to kFlatMaxPartitions ranges of whole kSlotTile tiles.
std::vector<std::pair<int64, int64>> FlatPartitions(int64 K) {
  const int64 tiles = (K + kSlotTile - 1) / kSlotTile;
  const int64 parts = std::max<int64>(
      1, std::min({tiles, K / kFlatPartitionSlots, kFlatMaxPartitions}));
  std::vector<std::pair<int64, int64>> out;
  for (int64 q = 0; q < parts; ++q) {
    out.emplace_back(tiles * q / parts * kSlotTile,
                     std::min(K, tiles * (q + 1) / parts * kSlotTile));
  }
  return out;
}

// One partition's slots [begin, end): each slot tile's weight rows packed once, then the
// logits of every row against them (rows in tiles of kFlatRowTile) written to the output
// columns they own, or to scratch and copied for a tile that reaches outside the class
// range, and folded into the rows' running (max, sum).
template <typename T>
void FlatPartition(const SoftmaxParams<T>& p, int64 num_rows, int64 begin, int64 end,
                   int64 class_begin, int64 class_end, T* out, T* row_max, T* row_sum) {
  constexpr int64 lanes = simd::Vec<T>::kWidth;
  Scratch<T>& s = ThreadScratch<T>();
  const int64 width = class_end - class_begin;
  T* panels = Grow(&s.panels, (kSlotTile + lanes - 1) / lanes * lanes * p.dim);
  T* scratch = Grow(&s.z, kFlatRowTile * kSlotTile);
  const T** rows = Grow(&s.rows, kFlatRowTile);
  for (int64 r = 0; r < num_rows; ++r) {
    row_max[r] = -std::numeric_limits<T>::infinity();
    row_sum[r] = 0;
  }
  for (int64 k0 = begin; k0 < end; k0 += kSlotTile) {
    const int64 kb = std::min(kSlotTile, end - k0);
    simd::PackPanels<T>(p.weights + k0 * p.dim, p.dim, kb, p.dim, panels);
    const bool inside = k0 >= class_begin && k0 + kb <= class_end;
    const int64 lo = std::max(k0, class_begin), hi = std::min(k0 + kb, class_end);
    for (int64 r0 = 0; r0 < num_rows; r0 += kFlatRowTile) {
      const int64 nr = std::min(kFlatRowTile, num_rows - r0);
      for (int64 i = 0; i < nr; ++i) rows[i] = p.hidden + (r0 + i) * p.dim;
      T* z = inside ? out + r0 * width + (k0 - class_begin) : scratch;
      const int64 ld = inside ? width : kSlotTile;
      simd::DotRowsPacked<T>(rows, nr, panels, kb, p.dim, z, ld,
                             p.biases == nullptr ? nullptr : p.biases + k0);
      for (int64 i = 0; i < nr; ++i) {
        FoldLogSumExp(z + i * ld, kb, &row_max[r0 + i], &row_sum[r0 + i]);
        if (!inside && lo < hi) {
          std::memcpy(out + (r0 + i) * width + (lo - class_begin), z + i * ld + (lo - k0),
                      (hi - lo) * sizeof(T));
        }
      }
    }
  }
}

}  // namespace

bool FlatPathFits(const TreeView& tree, int64 num_rows) {
  if (tree.num_nodes != 1 || num_rows < kPackMinRows) return false;
  const int64 K = tree.child_begin[1] - tree.child_begin[0];
  if (K <= kSlotTile || K != tree.num_classes) return false;
  for (int64 j = 0; j < K; ++j) {
    if (tree.slot_child[tree.child_begin[0] + j] != j) return false;
  }
  return true;
}

template <typename T>
void FlatLogProbAll(const TreeView& tree, const SoftmaxParams<T>& p, int64 num_rows,
                    int64 class_begin, int64 class_end, const ParallelFor& parallel_for,
                    T* out) {
  const int64 K = tree.num_classes, width = class_end - class_begin;
  // The node's slots are the table's rows child_begin[0], ...: offset the parameters once.
  SoftmaxParams<T> node = p;
  node.weights = p.weights + tree.child_begin[0] * p.dim;
  if (p.biases != nullptr) node.biases = p.biases + tree.child_begin[0];
  const std::vector<std::pair<int64, int64>> parts = FlatPartitions(K);
  const int64 P = static_cast<int64>(parts.size());
  std::vector<T> part_max(P * num_rows), part_sum(P * num_rows);
  parallel_for(P, 2 * num_rows * (K / P) * p.dim, [&](int64 b, int64 e) {
    for (int64 q = b; q < e; ++q) {
      FlatPartition(node, num_rows, parts[q].first, parts[q].second, class_begin, class_end,
                    out, part_max.data() + q * num_rows, part_sum.data() + q * num_rows);
    }
  });
  std::vector<T> lse(num_rows);
  MergeLogSumExps(P, num_rows, part_max.data(), part_sum.data(), lse.data());
  // Every class value is the root's (zero) plus its logit's distance from the row's
  // log-sum-exp, as the sweep writes it.
  parallel_for(num_rows, 2 * width, [&](int64 b, int64 e) {
    for (int64 r = b; r < e; ++r) {
      T* o = out + r * width;
      const T l = lse[r];
      for (int64 j = 0; j < width; ++j) o[j] = T(0) + (o[j] - l);
    }
  });
}

template void FlatLogProbAll<float>(const TreeView&, const SoftmaxParams<float>&, int64, int64,
                                    int64, const ParallelFor&, float*);
template void FlatLogProbAll<double>(const TreeView&, const SoftmaxParams<double>&, int64,
                                     int64, int64, const ParallelFor&, double*);

}  // namespace TF_HSM_SIMD_ISA
}  // namespace inference_internal
}  // namespace tf_hsm
