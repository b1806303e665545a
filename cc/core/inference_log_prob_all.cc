// LogProbAll (see inference.h): one sweep over the nodes needed for a class range, level
// by level (the plan: inference_sweep_plan.h), in blocks of rows sharing every weight
// block.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "cc/core/inference.h"
#include "cc/core/inference_common.h"
#include "cc/core/inference_flat.h"
#include "cc/core/inference_sweep_plan.h"

namespace tf_hsm {
namespace inference_internal {
namespace {

constexpr int64 kBlockRows = 64;  // rows that share every weight block
constexpr int64 kSplitRows = 16;  // row tile when a level has few nodes
constexpr int64 kKeepLogits = int64{1} << 17;       // logits kept per node
constexpr int64 kNodeValueBudget = int64{1} << 24;  // node values per block
// Outputs of at least this many bytes are written past the caches, for runs of at least
// kStreamMinColumns classes, kStageColumns consecutive classes per row at a time (staged
// in L1 first).
constexpr int64 kStreamMinBytes = int64{32} << 20;
constexpr int64 kStreamMinColumns = 64;
constexpr int64 kStageColumns = 256;
// An item whose class children are scattered (not runs of consecutive classes within one
// node) but together cover a range of at least this many consecutive classes gathers
// their values first and writes the range as a run (see SweepItemRowsInLanes).
constexpr int64 kGatherMinClasses = 64;
constexpr int64 kChunkWork = int64{1} << 15;  // slots x (D + 4) per item

// Folds the logits zg[j * ld] (j < kb) of one row group into its running max m and sum of
// exp(z - m), lane by lane, given their max tile_max (of the non-NaN logits: -inf when
// there are none; a NaN logit reaches the sum): a larger max first rescales the sum.
// first: m and sum start here, which gives the bits of a fold into a max of -inf and a
// sum of +0 (whose rescale multiplies +0 by 0 or 1).
template <typename T>
inline void FoldLanes(const T* zg, int64 kb, int64 ld, simd::VecT<T> tile_max, bool first,
                      simd::VecT<T>* m, simd::VecT<T>* sum) {
  typedef simd::VecT<T> V;
  const V new_max = first ? tile_max : tile_max > *m ? tile_max : *m;
  // Lanes whose logits so far are all -inf (masked children) add exp(-inf - 0) = 0, not
  // exp(-inf - -inf) = NaN.
  const V shift = new_max == simd::Splat<T>(-std::numeric_limits<T>::infinity())
                      ? simd::Splat<T>(0) : new_max;
  V exps = {};
  for (int64 j = 0; j < kb; ++j) exps += simd::ExpVec(simd::Load(zg + j * ld) - shift);
  if (first) {
    *sum = exps;
  } else {
    const V scale = tile_max > *m ? simd::ExpVec(*m - new_max) : simd::Splat<T>(1);
    *sum = *sum * scale;
    *sum += exps;
  }
  *m = new_max;
}

struct SweepItem {
  int64 first;  // positions [first, last)
  int64 last;
  int64 row;    // rows [row, row + rows) of the block
  int64 rows;
};

// Processes the nodes at positions [it.first, it.last) for some rows of a block of fewer
// than kPackMinRows rows, row by row with the dot-product kernels: node values of those
// rows are in values[plan.value_row[q] * stride + row], the block's output rows in
// out[row * width + column].
template <typename T>
void SweepItemRun(const TreeView& t, const SoftmaxParams<T>& p, const SweepPlan& plan,
                  const SweepItem& it, const T* const* block_rows, int64 stride, T* values,
                  T* out, int64 width) {
  Scratch<T>& s = ThreadScratch<T>();
  const int64 nt = it.rows;
  const T* const* rows = block_rows + it.row;
  T* lse = Grow(&s.lse, nt);
  // Where the value of child `code` goes for row i of the item, or nullptr when the sweep
  // does not need it (a class outside the range, a node off every needed path).
  const int64 C = t.num_classes;
  auto target = [&](int64 code, int64 i) -> T* {
    if (code < C) {
      const int64 column = code - plan.class_begin;
      return code < plan.class_begin || code >= plan.class_end
                 ? nullptr : out + (it.row + i) * width + column;
    }
    const int64 q = plan.position[code - C];
    return q < 0 ? nullptr : values + plan.value_row[q] * stride + it.row + i;
  };
  for (int64 q = it.first; q < it.last; ++q) {
    const int64 n = plan.node[q];
    const int64 first = t.child_begin[n], K = t.child_begin[n + 1] - first;
    const int64* codes = t.slot_child + first;
    const int64 run = plan.run[q];
    const T* parent = values + plan.value_row[q] * stride + it.row;
    // When they fit, all the node's logits stay in scratch (ld = K); otherwise each tile's
    // raw logits are parked at their destinations and finished once the logsumexp is known.
    const bool kept = nt * K <= kKeepLogits;
    T* zs = kept ? Grow(&s.z, nt * K) : Grow(&s.z, nt * kSlotTile);
    if (kept) {
      NodeLogits(p, rows, nt, first, K, /*packed=*/false, zs, lse);
    } else {
      TiledLogSumExp(p, rows, nt, first, K, static_cast<const T*>(nullptr), /*keep_all=*/false,
                     zs, lse, [&](const T* tile, int64 ld, int64 k0, int64 kb) {
        for (int64 i = 0; i < nt; ++i) {
          const T* zi = tile + i * ld;
          if (run >= 0) {
            std::memcpy(out + (it.row + i) * width + run + k0, zi, kb * sizeof(T));
            continue;
          }
          for (int64 j = 0; j < kb; ++j) {
            T* o = target(codes[k0 + j], i);
            if (o != nullptr) *o = zi[j];
          }
        }
      });
    }
    for (int64 i = 0; i < nt; ++i) {
      const T a = parent[i], l = lse[i];
      if (run >= 0) {
        T* o = out + (it.row + i) * width + run;
        const T* z = kept ? zs + i * K : o;
        for (int64 j = 0; j < K; ++j) o[j] = a + (z[j] - l);
        continue;
      }
      for (int64 j = 0; j < K; ++j) {
        T* o = target(codes[j], i);
        if (o == nullptr) continue;
        const T z = kept ? zs[i * K + j] : *o;
        *o = a + (z - l);
      }
    }
  }
}

// SweepItemRun for a batch of 16 or more rows (the packed kernel), in the rows' direction:
// each node's logits are kept slot-major, zt[j * ld + r] with the item's rows padded to
// whole vectors (ld of them), so one vector holds one child's logits for kWidth rows.
// The logsumexp is then a lane-wise fold over the children (vector exp and log, no
// horizontal reductions), a node's values are whole vectors of `values` (its children's go
// to `child_values`: the same buffer, or a group's, see SubtreeGroups), and a run
// of consecutive classes is written to the output rows through kWidth x kWidth register
// transposes (staged and streamed past the caches when `stream`: see emit_streamed).
// Nodes of at most a tile of children that are stored one after the other
// (consecutive ids, as the small nodes of a level are) share one logits pass over their
// rows; the logits kernel sums each output in one chain over k, so its bits do not depend
// on that batching. A larger node is folded tile by tile (a tile's max, then the running
// sum rescaled), the same whether or not its logits fit in scratch.
template <typename T>
class LaneSweep {
 public:
  typedef simd::VecT<T> V;
  static constexpr int64 w = simd::Vec<T>::kWidth;
  static constexpr int64 kMaxGroups = kBlockRows / w;

  LaneSweep(const TreeView& t, const SoftmaxParams<T>& p, const SweepPlan& plan,
            const SweepItem& it, const T* block_panels, int64 stride, const T* values,
            T* child_values, T* out, int64 width, bool stream)
      : t_(t), p_(p), plan_(plan), it_(it), stride_(stride), values_(values),
        child_values_(child_values), width_(width), stream_(stream),
        s_(ThreadScratch<T>()), nt_(it.rows), groups_((nt_ + w - 1) / w), ld_(groups_ * w),
        tail_(nt_ - (groups_ - 1) * w),
        // The item's rows start a row group (it.row is a multiple of kSplitRows), so they
        // are the block's panels from that group on.
        hp_(block_panels + it.row / w * p.dim * w),
        lse_(Grow(&s_.lse, ld_)),  // per row, for the transposed run writes
        parent_row_(Grow(&s_.row_max, ld_)),
        stage_(stream ? Grow(&s_.stage, w * kStageColumns) : nullptr),  // row-major pieces
        out_rows_(out + it.row * width), C_(t.num_classes) {
    ChooseGather();
  }

  void Run() {
    for (int64 q = it_.first; q < it_.last;) {
      const int64 n = plan_.node[q];
      const int64 K = t_.child_begin[n + 1] - t_.child_begin[n];
      q = K == 2 ? PairNodes(q) : K <= kSlotTile ? SmallNodes(q) : LargeNode(q);
    }
    if (gather_) {
      // The gathered classes, final values, written as one run.
      Node range;
      range.run = gather_lo_ - plan_.class_begin;
      gather_ = false;  // so that Emit writes the range as a run
      Emit(range, gathered_, 0, gather_count_, kFinal);
    }
    if (stream_) simd::StreamFence();  // before another thread reads the output
  }

 private:
  // One node's children and the values that finish them: parent + (logit - lse).
  struct Node {
    const int64* codes;
    int64 run;
    V parent[kMaxGroups], lse[kMaxGroups];
  };
  // What zt holds for Emit: the node's logits, to be finished into its values; raw logits
  // parked at their destinations, finished in place later (so never streamed past the
  // caches); or final values (an item's gathered classes).
  enum Emitted { kLogits, kParked, kFinal };

  int64 GroupRows(int64 g) const { return g + 1 < groups_ ? w : tail_; }
  V LoadRows(const T* src, int64 g) const {
    return GroupRows(g) == w ? simd::Load(src + g * w) : simd::LoadPartial(src + g * w, tail_);
  }
  void StoreRows(T* dst, int64 g, V v) const {
    if (GroupRows(g) == w) {
      simd::Store(dst + g * w, v);
    } else {
      simd::StorePartial(dst + g * w, v, tail_);
    }
  }

  // Class values go straight to their output columns, a scalar store per row, unless the
  // item gathers them: when its class children are not all runs (a binary tree's nodes
  // each hold one or two classes, often in decreasing order) yet together cover consecutive
  // classes [gather_lo, gather_lo + gather_count) (as a frequency-ordered Huffman tree's
  // do), their values are put slot-major into `gathered`, a vector per row group, and the
  // range is written at the end like a run: transposed in registers and, for a large
  // output, streamed. Items holding a node whose logits are not all kept park raw values
  // in the output (see LargeNode), so they write directly.
  void ChooseGather() {
    int64 lo = plan_.class_end, hi = plan_.class_begin - 1, count = 0;
    bool scattered = false, kept_all = true;
    for (int64 q = it_.first; q < it_.last; ++q) {
      const int64 n = plan_.node[q], b = t_.child_begin[n], e = t_.child_begin[n + 1];
      kept_all = kept_all && (e - b) * ld_ <= kKeepLogits;
      if (plan_.run[q] >= 0) {  // classes class_begin + run, ... (no need to read them)
        lo = std::min(lo, plan_.class_begin + plan_.run[q]);
        hi = std::max(hi, plan_.class_begin + plan_.run[q] + (e - b) - 1);
        count += e - b;
        continue;
      }
      const int64 before = count;
      for (int64 sl = b; sl < e; ++sl) {
        const int64 code = t_.slot_child[sl];
        if (code >= plan_.class_begin && code < plan_.class_end) {
          lo = std::min(lo, code);
          hi = std::max(hi, code);
          ++count;
        }
      }
      scattered = scattered || count > before;
    }
    // The plan checked that each class of the range is reached once, so count classes
    // spanning count columns are exactly the range.
    if (kept_all && scattered && count >= kGatherMinClasses && hi - lo + 1 == count) {
      gather_ = true;
      gather_lo_ = lo;
      gather_count_ = count;
      gathered_ = Grow(&s_.class_values, count * ld_);
    }
  }

  void Start(int64 q, Node* node) const {
    const int64 n = plan_.node[q];
    node->codes = t_.slot_child + t_.child_begin[n];
    node->run = plan_.run[q];
    for (int64 g = 0; g < groups_; ++g) {
      node->parent[g] = LoadRows(values_ + plan_.value_row[q] * stride_ + it_.row, g);
    }
  }

  void SetLse(Node* node, const V* m, const V* sum) const {
    for (int64 g = 0; g < groups_; ++g) {
      node->lse[g] = m[g] + simd::LogVec(sum[g]);
      simd::Store(lse_ + g * w, node->lse[g]);
      simd::Store(parent_row_ + g * w, node->parent[g]);
    }
  }

  // Children j, ..., j + cols - 1 (cols <= kWidth) of the node for row group g, from their
  // logits zt[j' * ld + row], transposed in registers: put(row, v) gets them as lanes
  // [0, cols) of v.
  template <typename Put>
  void Transposed(const T* zt, int64 g, int64 j, int64 cols, Put&& put) const {
    V block[w];
    for (int64 c = 0; c < w; ++c) block[c] = c < cols ? simd::Load(zt + (j + c) * ld_ + g * w) : V{};
    simd::Transpose<T>(block);
    for (int64 r = 0; r < GroupRows(g); ++r) put(g * w + r, block[r]);
  }

  // The finished values of children [j0, j0 + kb) of a run node, a row group and
  // kStageColumns columns at a time: transposed into a row-major stage, then each row's
  // piece streamed out. Streamed stores that hop to another output row after every line
  // measured only 1.15x faster than ordinary ones (whose lines are first read for
  // ownership); runs of 4 or more lines per row, 2.3x, and the longer the runs the less
  // the stores wait. Blocks after the first start where row 0's output starts a line.
  void EmitStreamed(const Node& node, const T* zt, int64 j0, int64 kb, bool finish) const {
    const int64 misaligned = static_cast<int64>(
        reinterpret_cast<std::uintptr_t>(out_rows_ + node.run + j0) % 64 / sizeof(T));
    const int64 to_line = (w - misaligned) % w;
    for (int64 g = 0; g < groups_; ++g) {
      for (int64 cb = 0, ce = to_line == 0 ? kStageColumns : to_line + kStageColumns - w; cb < kb;
           cb = ce, ce += kStageColumns) {
        const int64 n = std::min(ce, kb) - cb;
        for (int64 jb = 0; jb < n; jb += w) {
          Transposed(zt, g, cb + jb, std::min(w, n - jb), [&](int64 row, V v) {
            simd::Store(stage_ + (row - g * w) * kStageColumns + jb,
                        finish ? parent_row_[row] + (v - lse_[row]) : v);
          });
        }
        for (int64 r = 0; r < GroupRows(g); ++r) {
          simd::CopyStreaming(out_rows_ + (g * w + r) * width_ + node.run + j0 + cb,
                              stage_ + r * kStageColumns, n);
        }
      }
    }
  }

  // Writes value v of child `code` for row group g: to the child node's row of
  // child_values (when it is on a path to the class range), or for a class of the range
  // to its gathered vectors or else its output column.
  void PutChild(int64 code, int64 g, V v) const {
    if (code >= C_) {
      const int64 position = plan_.position[code - C_];
      if (position >= 0) StoreRows(child_values_ + plan_.value_row[position] * stride_ + it_.row, g, v);
    } else if (code >= plan_.class_begin && code < plan_.class_end) {
      if (gather_) {
        simd::Store(gathered_ + (code - gather_lo_) * ld_ + g * w, v);
        return;
      }
      T* o = out_rows_ + (code - plan_.class_begin);
      for (int64 r = 0; r < GroupRows(g); ++r) o[(g * w + r) * width_] = v[r];
    }
  }

  // Writes the values of children [j0, j0 + kb) of the node from zt[(j - j0) * ld + r].
  void Emit(const Node& node, const T* zt, int64 j0, int64 kb, Emitted what) const {
    const bool finish = what == kLogits;
    if (node.run >= 0 && !gather_ && what != kParked && stream_ && kb >= kStreamMinColumns) {
      EmitStreamed(node, zt, j0, kb, finish);
      return;
    }
    if (node.run >= 0 && !gather_) {
      // Blocks of kWidth children, transposed in registers into pieces of output rows.
      for (int64 g = 0; g < groups_; ++g) {
        for (int64 jb = 0; jb < kb; jb += w) {
          const int64 cols = std::min(w, kb - jb);
          Transposed(zt, g, jb, cols, [&](int64 row, V v) {
            if (finish) v = parent_row_[row] + (v - lse_[row]);
            T* o = out_rows_ + row * width_ + node.run + j0 + jb;
            if (cols == w) {
              simd::Store(o, v);
            } else {
              simd::StorePartial(o, v, cols);
            }
          });
        }
      }
      return;
    }
    for (int64 j = 0; j < kb; ++j) {
      const T* zj = zt + j * ld_;
      for (int64 g = 0; g < groups_; ++g) {
        const V z = simd::Load(zj + g * w);
        PutChild(node.codes[j0 + j], g, finish ? node.parent[g] + (z - node.lse[g]) : z);
      }
    }
  }

  // The products of the rows with `count` weight-like rows b (ldb = dim) plus `bias`, into
  // zt, asking for the weight rows [end, end + ahead) along the way (each row once); and
  // each row group's max when group_max is given.
  void Dots(const T* b, int64 count, const T* bias, int64 end, int64 ahead, T* zt,
            V* group_max) {
    const int64 ahead_begin = std::max(end, prefetched_);
    prefetched_ = std::max(prefetched_, std::min(end + ahead, t_.num_slots));
    RowPanelDots<T, true>(hp_, nt_, b, p_.dim, count, p_.dim, zt, ld_,
                          p_.weights + ahead_begin * p_.dim,
                          std::max<int64>(0, prefetched_ - ahead_begin) * p_.dim *
                              static_cast<int64>(sizeof(T)),
                          bias, group_max);
  }
  // The logits of weight rows [first, first + count) with their biases, into zt, asking
  // along the way for the rows up to a tile past them (the next nodes of a level are
  // stored next).
  void Logits(int64 first, int64 count, T* zt, V* group_max) {
    Dots(p_.weights + first * p_.dim, count, p_.biases == nullptr ? nullptr : p_.biases + first,
         first + count, kSlotTile, zt, group_max);
  }

  // A run of two-child nodes from position q stored one after the other (a binary tree's
  // levels); returns the position after it. Their softmax depends only on d = z1 - z0:
  // log p0 = -softplus(d), log p1 = -softplus(-d), with softplus(x) = max(x, 0) +
  // log(1 + exp(-|x|)). So one dot product per node, with the difference of its two weight
  // rows, replaces two, and one exp and one log replace two exps, a log and a max.
  // d = +-inf gives the masked child -inf and the other 0; a NaN d (both logits -inf, or a
  // NaN) gives NaN to both, as the general path does.
  int64 PairNodes(int64 q) {
    const int64 first = t_.child_begin[plan_.node[q]];
    int64 last = q + 1;
    while (last < it_.last && last - q < kSlotTile && plan_.node[last] == plan_.node[last - 1] + 1 &&
           t_.child_begin[plan_.node[last] + 1] - t_.child_begin[plan_.node[last]] == 2) {
      ++last;
    }
    const int64 pairs = last - q, dim = p_.dim;
    const T* wp = p_.weights + first * dim;  // the run's 2 * pairs slots are consecutive
    T* diff = Grow(&s_.pair_rows, pairs * dim);
    for (int64 i = 0; i < pairs; ++i) {
      for (int64 k = 0; k < dim; ++k) diff[i * dim + k] = wp[(2 * i + 1) * dim + k] - wp[2 * i * dim + k];
    }
    T* bias_diff = nullptr;
    if (p_.biases != nullptr) {
      bias_diff = Grow(&s_.pair_biases, pairs);
      for (int64 i = 0; i < pairs; ++i) bias_diff[i] = p_.biases[first + 2 * i + 1] - p_.biases[first + 2 * i];
    }
    T* zd = Grow(&s_.z, pairs * ld_);
    Dots(diff, pairs, bias_diff, first + 2 * pairs, 2 * kSlotTile, zd, nullptr);
    const V zero = {};
    Node node;
    for (int64 i = 0; q < last; ++q, ++i) {
      Start(q, &node);
      for (int64 g = 0; g < groups_; ++g) {
        const V d = simd::Load(zd + i * ld_ + g * w);
        const V l = simd::LogOnePlusUnitVec(simd::ExpVec(d < zero ? d : -d));
        PutChild(node.codes[0], g, node.parent[g] - ((d > zero ? d : zero) + l));
        PutChild(node.codes[1], g, node.parent[g] - ((d < zero ? -d : zero) + l));
      }
    }
    return last;
  }

  // A batch of small nodes from position q stored one after the other: one logits pass,
  // then each node's max, sum and values (a NaN logit loses the max; the sum carries it).
  // Returns the position after the batch.
  int64 SmallNodes(int64 q) {
    const T ninf = -std::numeric_limits<T>::infinity();
    const int64 first = t_.child_begin[plan_.node[q]];
    int64 last = q + 1, slots = t_.child_begin[plan_.node[q] + 1] - first;
    for (; last < it_.last && plan_.node[last] == plan_.node[last - 1] + 1; ++last) {
      const int64 k = t_.child_begin[plan_.node[last] + 1] - t_.child_begin[plan_.node[last]];
      // Two-child nodes always take PairNodes, so that a node's values do not depend on
      // the nodes batched with it (a class range's plan has fewer).
      if (k == 2 || slots + k > kSlotTile) break;
      slots += k;
    }
    T* zs = Grow(&s_.z, slots * ld_);
    Logits(first, slots, zs, nullptr);
    Node node;
    V m[kMaxGroups], sum[kMaxGroups];
    for (; q < last; ++q) {
      const int64 b = t_.child_begin[plan_.node[q]], k = t_.child_begin[plan_.node[q] + 1] - b;
      const T* zn = zs + (b - first) * ld_;
      Start(q, &node);
      for (int64 g = 0; g < groups_; ++g) {
        V mg = simd::Splat<T>(ninf);
        for (int64 j = 0; j < k; ++j) {
          const V z = simd::Load(zn + j * ld_ + g * w);
          mg = z > mg ? z : mg;
        }
        FoldLanes<T>(zn + g * w, k, ld_, mg, /*first=*/true, &m[g], &sum[g]);
      }
      SetLse(&node, m, sum);
      Emit(node, zn, 0, k, kLogits);
    }
    return last;
  }

  // A node of more than a tile of children, folded tile by tile (a tile's max, then the
  // running sum rescaled). With every logit kept, each value is written once, finished;
  // otherwise each tile's raw logits are parked at their destinations and finished there
  // at the end. Returns q + 1.
  int64 LargeNode(int64 q) {
    const T ninf = -std::numeric_limits<T>::infinity();
    const int64 n = plan_.node[q];
    const int64 first = t_.child_begin[n], K = t_.child_begin[n + 1] - first;
    Node node;
    V m[kMaxGroups], sum[kMaxGroups];
    Start(q, &node);
    const bool kept = K * ld_ <= kKeepLogits;
    T* zs = Grow(&s_.z, (kept ? K : kSlotTile) * ld_);
    for (int64 k0 = 0; k0 < K; k0 += kSlotTile) {
      const int64 kb = std::min(kSlotTile, K - k0);
      T* zt = kept ? zs + k0 * ld_ : zs;
      V tile_max[kMaxGroups];
      for (int64 g = 0; g < groups_; ++g) tile_max[g] = simd::Splat<T>(ninf);
      Logits(first + k0, kb, zt, tile_max);
      for (int64 g = 0; g < groups_; ++g) {
        FoldLanes<T>(zt + g * w, kb, ld_, tile_max[g], /*first=*/k0 == 0, &m[g], &sum[g]);
      }
      if (!kept) Emit(node, zt, k0, kb, kParked);
    }
    SetLse(&node, m, sum);
    if (kept) {
      Emit(node, zs, 0, K, kLogits);
    } else {
      FinishParked(node, K);
    }
    return q + 1;
  }

  // Finishes a large node's parked values in place.
  void FinishParked(const Node& node, int64 K) const {
    if (node.run >= 0) {
      for (int64 r = 0; r < nt_; ++r) {
        T* o = out_rows_ + r * width_ + node.run;
        for (int64 j = 0; j < K; ++j) o[j] = parent_row_[r] + (o[j] - lse_[r]);
      }
      return;
    }
    for (int64 j = 0; j < K; ++j) {
      const int64 code = node.codes[j];
      if (code >= C_) {
        const int64 position = plan_.position[code - C_];
        if (position < 0) continue;
        T* dst = child_values_ + plan_.value_row[position] * stride_ + it_.row;
        for (int64 g = 0; g < groups_; ++g) {
          StoreRows(dst, g, node.parent[g] + (LoadRows(dst, g) - node.lse[g]));
        }
      } else if (code >= plan_.class_begin && code < plan_.class_end) {
        T* o = out_rows_ + (code - plan_.class_begin);
        for (int64 r = 0; r < nt_; ++r) o[r * width_] = parent_row_[r] + (o[r * width_] - lse_[r]);
      }
    }
  }

  const TreeView& t_;
  const SoftmaxParams<T>& p_;
  const SweepPlan& plan_;
  const SweepItem& it_;
  const int64 stride_;
  const T* const values_;
  T* const child_values_;
  const int64 width_;
  const bool stream_;
  Scratch<T>& s_;
  const int64 nt_, groups_, ld_;
  const int64 tail_;  // rows of the last group
  const T* const hp_;
  T* const lse_;
  T* const parent_row_;
  T* const stage_;
  T* const out_rows_;
  const int64 C_;
  bool gather_ = false;
  int64 gather_lo_ = 0, gather_count_ = 0;
  T* gathered_ = nullptr;
  int64 prefetched_ = 0;
};

template <typename T>
void SweepItemRowsInLanes(const TreeView& t, const SoftmaxParams<T>& p, const SweepPlan& plan,
                          const SweepItem& it, const T* block_panels, int64 stride,
                          const T* values, T* child_values, T* out, int64 width, bool stream) {
  LaneSweep<T>(t, p, plan, it, block_panels, stride, values, child_values, out, width, stream)
      .Run();
}

// The sweep plan for [class_begin, class_end): the cache's when it holds one that fits
// (whole-tree calls only), else a new one, kept in the cache when it is small enough.
std::string GetSweepPlan(const TreeView& tree, int64 class_begin, int64 class_end, bool packed,
                         int64 block, const ParallelFor& parallel_for, SweepPlanCache* cache,
                         std::shared_ptr<const SweepPlanCache::Entry>* planned) {
  const bool whole_tree = class_begin == 0 && class_end == tree.num_classes;
  if (cache != nullptr && whole_tree) {
    *planned = cache->Get();
    if (*planned != nullptr && PlanFits(**planned, tree, packed, block, parallel_for)) return "";
  }
  auto fresh = std::make_shared<SweepPlanCache::Entry>();
  std::string err = BuildSweepPlan(tree, class_begin, class_end, parallel_for, &fresh->plan);
  if (!err.empty()) return err;
  if (packed) FindSubtreeGroups(fresh->plan, block, &fresh->groups);
  AssignValueRows(fresh->groups, &fresh->plan);
  if (cache != nullptr && whole_tree &&
      PlanBytes(tree, fresh->plan) <= SweepPlanCache::kMaxCachedPlanBytes) {
    fresh->num_classes = tree.num_classes;
    fresh->packed = packed;
    fresh->block = block;
    fresh->child_begin.assign(tree.child_begin, tree.child_begin + tree.num_nodes + 1);
    fresh->slot_child.assign(tree.slot_child, tree.slot_child + tree.num_slots);
    cache->Put(fresh);
  }
  *planned = std::move(fresh);
  return "";
}

// Work items of the group sweep: groups [items[i], items[i + 1]), about kGroupItems of
// them, cut where the groups' weight rows (counted as the slots from a level's first node
// to its last; the nodes are consecutive) reach equal shares. Returns the slot-dimensions
// below the split level.
int64 GroupItems(const TreeView& tree, const SweepPlan& plan, const SubtreeGroups& groups,
                 int64 dim, std::vector<int64>* items) {
  constexpr int64 kGroupItems = 64;
  const int64 G = groups.count(), span = groups.span;
  std::vector<int64> slots(G, 0);
  int64 total = 0;
  for (int64 g = 0; g < G; ++g) {
    for (int64 i = 0; i < span && groups.begin[g * span + i] < groups.end[g * span + i]; ++i) {
      slots[g] += tree.child_begin[plan.node[groups.end[g * span + i] - 1] + 1] -
                  tree.child_begin[plan.node[groups.begin[g * span + i]]];
    }
    total += slots[g];
  }
  items->assign(1, 0);
  for (int64 g = 0, sum = 0; g < G; ++g) {
    sum += slots[g];
    const int64 share = static_cast<int64>(items->size());
    if (sum * kGroupItems >= share * total || g + 1 == G) items->push_back(g + 1);
  }
  return total * (dim + 4);
}

}  // namespace
}  // namespace inference_internal

template <typename T>
std::string LogProbAll(const TreeView& tree, const SoftmaxParams<T>& p, int64 num_rows,
                       int64 class_begin, int64 class_end, const ParallelFor& parallel_for,
                       T* out, SweepPlanCache* cache) {
  using namespace inference_internal;
  std::string err = CheckSizes(tree, num_rows, p.dim, true);
  if (!err.empty()) return err;
  if (class_begin < 0 || class_end < class_begin || class_end > tree.num_classes) {
    return Message("class_range = [", class_begin, ", ", class_end,
                   ") must satisfy 0 <= begin <= end <= num_classes = ", tree.num_classes);
  }
  const int64 width = class_end - class_begin;
  if (width == 0 || num_rows == 0) return "";
  if (FlatPathFits(tree, num_rows)) {  // the exact softmax: blocked products
    FlatLogProbAll(tree, p, num_rows, class_begin, class_end, parallel_for, out);
    return "";
  }
  // Rows per block: up to 64, fewer when the node values would take more than
  // kNodeValueBudget (every block reads the whole table).
  // The kernel is chosen by the batch size alone, so that a row's values do not depend
  // on the blocks and tiles around it (a chunk equals the slice of the full result).
  const bool packed = num_rows >= kPackMinRows;
  int64 block = std::min(num_rows, kBlockRows);
  std::shared_ptr<const SweepPlanCache::Entry> planned;
  err = GetSweepPlan(tree, class_begin, class_end, packed, block, parallel_for, cache, &planned);
  if (!err.empty()) return err;
  const SweepPlan& plan = planned->plan;
  const SubtreeGroups& groups = planned->groups;
  const int64 levels = static_cast<int64>(plan.level_begin.size()) - 1;
  if (block * plan.value_rows > kNodeValueBudget) {
    block = std::max<int64>(std::min<int64>(block, 4), kNodeValueBudget / plan.value_rows);
  }
  // A large output is not read back soon enough to stay in the caches.
  const bool stream = num_rows * width * static_cast<int64>(sizeof(T)) >= kStreamMinBytes;
  // Per-thread scratch kept for the next call: a binary tree's takes up to kNodeValueBudget
  // values (64 MB in float) without subtree groups, whose fresh pages cost more to map
  // than the sweep spends on them. Every value a level reads was written by the level
  // above; the root's row is set below.
  T* values = Grow(&ThreadScratch<T>().node_values, plan.value_rows * block);
  const int64 swept_levels = groups.level < 0 ? levels : groups.level;

  // Node chunks of each level swept across the tree, of about kChunkWork slot-dimensions.
  std::vector<int64> chunk_begin;      // position boundaries
  std::vector<int64> level_chunks(swept_levels + 1, 0);  // chunk ranges per level
  std::vector<int64> chunk_work;
  for (int64 l = 0; l < swept_levels; ++l) {
    level_chunks[l] = static_cast<int64>(chunk_work.size());
    int64 work = 0;
    for (int64 q = plan.level_begin[l]; q < plan.level_begin[l + 1]; ++q) {
      if (work == 0) chunk_begin.push_back(q);
      const int64 n = plan.node[q];
      work += (tree.child_begin[n + 1] - tree.child_begin[n]) * (p.dim + 4);
      if (work >= kChunkWork || q + 1 == plan.level_begin[l + 1]) {
        chunk_work.push_back(work);
        work = 0;
      }
    }
  }
  level_chunks[swept_levels] = static_cast<int64>(chunk_work.size());
  chunk_begin.push_back(plan.level_begin[swept_levels]);
  // Work items of the group sweep (GroupItems).
  std::vector<int64> group_items;
  const int64 group_work = GroupItems(tree, plan, groups, p.dim, &group_items);
  std::vector<const T*> rows(block);
  constexpr int64 w = simd::Vec<T>::kWidth;
  static_assert(kSplitRows % w == 0, "row tiles must start row groups");
  std::vector<T> panels(packed ? (block + w - 1) / w * w * p.dim : 0);
  std::vector<SweepItem> items;
  for (int64 r0 = 0; r0 < num_rows; r0 += block) {
    const int64 nr = std::min(block, num_rows - r0);
    for (int64 i = 0; i < nr; ++i) rows[i] = p.hidden + (r0 + i) * p.dim;
    if (packed) PackRows(rows.data(), nr, p.dim, panels.data());  // once, for every item
    std::fill(values, values + nr, T(0));  // the root
    for (int64 l = 0; l < swept_levels; ++l) {
      const int64 c0 = level_chunks[l], c1 = level_chunks[l + 1];
      // Few chunks: split the rows too, so that every thread has work.
      const int64 tile = c1 - c0 < 4 && nr > kSplitRows ? kSplitRows : nr;
      items.clear();
      int64 work = 0;
      for (int64 c = c0; c < c1; ++c) {
        for (int64 i = 0; i < nr; i += tile) {
          items.push_back({chunk_begin[c], chunk_begin[c + 1], i, std::min(tile, nr - i)});
        }
        work += chunk_work[c];
      }
      const int64 cost = 2 * work * nr / static_cast<int64>(items.size());
      parallel_for(static_cast<int64>(items.size()), cost, [&](int64 begin, int64 end) {
        for (int64 i = begin; i < end; ++i) {
          if (packed) {
            SweepItemRowsInLanes(tree, p, plan, items[i], panels.data(), block, values, values,
                                 out + r0 * width, width, stream);
          } else {
            SweepItemRun(tree, p, plan, items[i], rows.data(), block, values,
                         out + r0 * width, width);
          }
        }
      });
    }
    if (groups.level < 0) continue;
    // Each group from the split level down, its values below that level in the thread's
    // buffer (2 * cap rows of `block`), in work items of consecutive groups and about equal
    // work: subtrees differ in size many times over (a Huffman tree's frequent side is
    // shallow), and items of equally many groups left a thread idle for 13% of the time.
    const int64 items_count = static_cast<int64>(group_items.size()) - 1, span = groups.span;
    parallel_for(items_count, 2 * group_work * nr / items_count, [&](int64 begin, int64 end) {
      T* local = Grow(&ThreadScratch<T>().group_values, 2 * groups.cap * block);
      for (int64 g = group_items[begin]; g < group_items[end]; ++g) {
        for (int64 i = 0; i < span; ++i) {
          const SweepItem item{groups.begin[g * span + i], groups.end[g * span + i], 0, nr};
          if (item.first == item.last) break;  // the group has no nodes this deep
          SweepItemRowsInLanes(tree, p, plan, item, panels.data(), block, i == 0 ? values : local,
                               local, out + r0 * width, width, stream);
        }
      }
    });
  }
  return "";
}

template std::string LogProbAll<float>(const TreeView&, const SoftmaxParams<float>&, int64, int64,
                                       int64, const ParallelFor&, float*, SweepPlanCache*);
template std::string LogProbAll<double>(const TreeView&, const SoftmaxParams<double>&, int64,
                                        int64, int64, const ParallelFor&, double*, SweepPlanCache*);

}  // namespace tf_hsm
