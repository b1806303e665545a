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
constexpr int64 kFlatItemRows = 192;  // rows of a work item (with a partition)
constexpr int64 kFlatTopKSpare = 8;  // TopK: logits kept per row and partition beyond k

// The partitions of K slots: 1 to kFlatMaxPartitions ranges of whole kSlotTile tiles.
std::vector<SlotRange> FlatPartitions(int64 K) {
  const int64 tiles = (K + kSlotTile - 1) / kSlotTile;
  return TileRanges(K, std::max<int64>(1, std::min({tiles, K / kFlatPartitionSlots,
                                                    kFlatMaxPartitions})));
}

// The logits of one partition's slots [begin, end) for rows [row_begin, row_end), tile by
// tile: each slot tile's weight rows are packed once and serve all those rows, in row
// tiles of kFlatRowTile. visit.Dest(r0, k0, kb, &ld) says where a tile's logits go (rows
// r0..., row stride ld); visit.Tile(r0, nr, z, ld, k0, kb) then sees them. The rows'
// running (max, sum) start here. A row's values do not depend on the rows around it.
template <typename T, class Visit>
void FlatPartitionTiles(const SoftmaxParams<T>& p, int64 row_begin, int64 row_end,
                        int64 begin, int64 end, T* row_max, T* row_sum, Visit& visit) {
  constexpr int64 lanes = simd::Vec<T>::kWidth;
  Scratch<T>& s = ThreadScratch<T>();
  T* panels = Grow(&s.panels, (kSlotTile + lanes - 1) / lanes * lanes * p.dim);
  const T** rows = Grow(&s.rows, kFlatRowTile);
  for (int64 r = row_begin; r < row_end; ++r) {
    row_max[r] = -std::numeric_limits<T>::infinity();
    row_sum[r] = 0;
  }
  for (int64 k0 = begin; k0 < end; k0 += kSlotTile) {
    const int64 kb = std::min(kSlotTile, end - k0);
    simd::PackPanels<T>(p.weights + k0 * p.dim, p.dim, kb, p.dim, panels);
    for (int64 r0 = row_begin; r0 < row_end; r0 += kFlatRowTile) {
      const int64 nr = std::min(kFlatRowTile, row_end - r0);
      for (int64 i = 0; i < nr; ++i) rows[i] = p.hidden + (r0 + i) * p.dim;
      int64 ld = 0;
      T* z = visit.Dest(r0, k0, kb, &ld);
      simd::DotRowsPacked<T>(rows, nr, panels, kb, p.dim, z, ld,
                             p.biases == nullptr ? nullptr : p.biases + k0);
      for (int64 i = 0; i < nr; ++i) FoldLogSumExp(z + i * ld, kb, &row_max[r0 + i], &row_sum[r0 + i]);
      visit.Tile(r0, nr, z, ld, k0, kb);
    }
  }
}

// The node's parameters (its slots are the table's rows child_begin[0], ...), its
// partitions, and each row's log-sum-exp from the partitions' folds, merged in order.
template <typename T>
struct FlatNode {
  FlatNode(const TreeView& tree, const SoftmaxParams<T>& p, int64 num_rows)
      : params(p), parts(FlatPartitions(tree.num_classes)), rows(num_rows),
        part_max(parts.size() * num_rows), part_sum(parts.size() * num_rows) {
    params.weights = p.weights + tree.child_begin[0] * p.dim;
    if (p.biases != nullptr) params.biases = p.biases + tree.child_begin[0];
  }
  int64 count() const { return static_cast<int64>(parts.size()); }
  // Work items of a partition and a block of kFlatItemRows rows (so that a narrow node
  // still gives every thread work); make_visit(q) makes a partition's visitor.
  template <class MakeVisit>
  void Run(const ParallelFor& parallel_for, MakeVisit&& make_visit) {
    const int64 K = parts.back().end;
    const int64 blocks = (rows + kFlatItemRows - 1) / kFlatItemRows;
    const int64 cost = 2 * std::min(rows, kFlatItemRows) * (K / count()) * params.dim;
    parallel_for(count() * blocks, cost, [&](int64 b, int64 e) {
      for (int64 item = b; item < e; ++item) {
        const int64 q = item / blocks, r0 = item % blocks * kFlatItemRows;
        auto visit = make_visit(q);
        FlatPartitionTiles(params, r0, std::min(rows, r0 + kFlatItemRows), parts[q].begin,
                           parts[q].end, part_max.data() + q * rows,
                           part_sum.data() + q * rows, visit);
      }
    });
  }
  std::vector<T> LogSumExps() const {
    std::vector<T> lse(rows);
    MergeLogSumExps(count(), rows, part_max.data(), part_sum.data(), lse.data());
    return lse;
  }
  SoftmaxParams<T> params;
  std::vector<SlotRange> parts;
  int64 rows;
  std::vector<T> part_max, part_sum;
};

// LogProbAll's tiles: inside the class range straight into the output, otherwise through
// scratch with the range's columns copied.
template <typename T>
struct OutputTiles {
  T* Dest(int64 r0, int64 k0, int64 kb, int64* ld) {
    if (k0 >= class_begin && k0 + kb <= class_end) {
      *ld = class_end - class_begin;
      return out + r0 * *ld + (k0 - class_begin);
    }
    *ld = kSlotTile;
    return scratch;
  }
  void Tile(int64 r0, int64 nr, const T* z, int64 ld, int64 k0, int64 kb) {
    const int64 width = class_end - class_begin;
    const int64 lo = std::max(k0, class_begin), hi = std::min(k0 + kb, class_end);
    if (z != scratch || lo >= hi) return;
    for (int64 i = 0; i < nr; ++i) {
      std::memcpy(out + (r0 + i) * width + (lo - class_begin), z + i * ld + (lo - k0),
                  (hi - lo) * sizeof(T));
    }
  }
  T* out;
  int64 class_begin, class_end;
  T* scratch;
};

// Each row's best logits of one partition, for TopK: at most `cap` (logit, slot) pairs
// per row, best first (larger logit, then smaller slot; slots come in increasing order),
// and whether the row dropped any (then its last kept logit bounds what it dropped).
template <typename T>
struct BestTiles {
  T* Dest(int64, int64, int64, int64* ld) {
    *ld = kSlotTile;
    return scratch;
  }
  void Tile(int64 r0, int64 nr, const T* z, int64 ld, int64 k0, int64 kb) {
    for (int64 i = 0; i < nr; ++i) {
      const int64 r = r0 + i;
      T* bz = best_z + r * cap;
      int64* bs = best_slot + r * cap;
      int64& n = count[r];
      const T* zr = z + i * ld;
      for (int64 j = 0; j < kb; ++j) {
        const T v = zr[j];
        if (n == cap) {
          dropped[r] = 1;
          if (!(v > bz[cap - 1])) continue;
          --n;
        }
        int64 at = n++;
        for (; at > 0 && v > bz[at - 1]; --at) {
          bz[at] = bz[at - 1];
          bs[at] = bs[at - 1];
        }
        bz[at] = v;
        bs[at] = k0 + j;
      }
    }
  }
  int64 cap;
  T* best_z;
  int64* best_slot;
  int64* count;
  char* dropped;
  T* scratch;
};

}  // namespace

bool FlatPathFits(const TreeView& tree, int64 num_rows) {
  if (tree.num_nodes != 1 || num_rows < kPackMinRows) return false;
  // The tree is untrusted: its one node's slots must lie in the table before they are read.
  const int64 first = tree.child_begin[0], K = tree.child_begin[1] - first;
  if (!tree_checks::ValidSlotRange(tree, first, tree.child_begin[1]) || K <= kSlotTile ||
      K != tree.num_classes) {
    return false;
  }
  for (int64 j = 0; j < K; ++j) {
    if (tree.slot_child[tree.child_begin[0] + j] != j) return false;
  }
  return true;
}

template <typename T>
void FlatLogProbAll(const TreeView& tree, const SoftmaxParams<T>& p, int64 num_rows,
                    int64 class_begin, int64 class_end, const ParallelFor& parallel_for,
                    T* out) {
  const int64 width = class_end - class_begin;
  FlatNode<T> node(tree, p, num_rows);
  node.Run(parallel_for, [&](int64) {
    return OutputTiles<T>{out, class_begin, class_end,
                          Grow(&ThreadScratch<T>().z, kFlatRowTile * kSlotTile)};
  });
  const std::vector<T> lse = node.LogSumExps();
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

template <typename T>
std::vector<int64> FlatTopK(const TreeView& tree, const SoftmaxParams<T>& p, int64 num_rows,
                            int64 k, const ParallelFor& parallel_for, T* log_probs,
                            int64* classes, int64* num_expanded) {
  // The spare entries make a tie at the k-th value, which the check below sends to the
  // search, rare.
  const int64 cap = k + kFlatTopKSpare;
  FlatNode<T> node(tree, p, num_rows);
  const int64 P = node.count();
  std::vector<T> best_z(P * num_rows * cap);
  std::vector<int64> best_slot(P * num_rows * cap), count(P * num_rows, 0);
  std::vector<char> dropped(P * num_rows, 0);
  node.Run(parallel_for, [&](int64 q) {
    const int64 at = q * num_rows;
    return BestTiles<T>{cap, best_z.data() + at * cap, best_slot.data() + at * cap,
                        count.data() + at, dropped.data() + at,
                        Grow(&ThreadScratch<T>().z, kFlatRowTile * kSlotTile)};
  });
  const std::vector<T> lse = node.LogSumExps();
  std::vector<int64> search;  // rows the exact selection below cannot settle
  std::vector<std::pair<T, int64>> pool;
  for (int64 r = 0; r < num_rows; ++r) {
    num_expanded[r] = 1;
    const T l = lse[r];
    pool.clear();
    for (int64 q = 0; q < P; ++q) {
      const int64 a = q * num_rows + r;
      for (int64 i = 0; i < count[a]; ++i) {
        pool.emplace_back(T(0) + (best_z[a * cap + i] - l), best_slot[a * cap + i]);
      }
    }
    // Values fall with the logits, so each partition's top cap by logit holds its top k
    // by value; sorted by value, then slot.
    std::partial_sort(pool.begin(), pool.begin() + k, pool.end(), [](const auto& x, const auto& y) {
      return x.first > y.first || (x.first == y.first && x.second < y.second);
    });
    bool exact = std::isfinite(l);
    for (int64 q = 0; q < P && exact; ++q) {
      const int64 a = q * num_rows + r;
      // What a partition dropped is at most its last kept value: it must be below the k-th.
      if (dropped[a]) exact = T(0) + (best_z[a * cap + cap - 1] - l) < pool[k - 1].first;
    }
    if (!exact) {
      search.push_back(r);
      continue;
    }
    for (int64 j = 0; j < k; ++j) {
      log_probs[r * k + j] = pool[j].first;
      classes[r * k + j] = pool[j].second;
    }
  }
  return search;
}

template void FlatLogProbAll<float>(const TreeView&, const SoftmaxParams<float>&, int64, int64,
                                    int64, const ParallelFor&, float*);
template void FlatLogProbAll<double>(const TreeView&, const SoftmaxParams<double>&, int64,
                                     int64, int64, const ParallelFor&, double*);
template std::vector<int64> FlatTopK<float>(const TreeView&, const SoftmaxParams<float>&, int64,
                                            int64, const ParallelFor&, float*, int64*, int64*);
template std::vector<int64> FlatTopK<double>(const TreeView&, const SoftmaxParams<double>&,
                                             int64, int64, const ParallelFor&, double*, int64*,
                                             int64*);

}  // namespace TF_HSM_SIMD_ISA
}  // namespace inference_internal
}  // namespace tf_hsm
