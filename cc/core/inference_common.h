// The inference core's shared pieces (cc/core/inference_*.cc; private to them): per-thread
// scratch, the logits kernels of a node's weight block (the row-panel kernel for 16 or
// more rows, the dot-product kernels otherwise), the node logsumexp built on them, and
// the checks of the untrusted tree tensors.
#ifndef TF_HSM_CC_CORE_INFERENCE_COMMON_H_
#define TF_HSM_CC_CORE_INFERENCE_COMMON_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "cc/core/log_prob.h"
#include "cc/core/sampling.h"
#include "cc/core/simd.h"
#include "cc/core/softmax_util.h"
#include "cc/core/tree_checks.h"
#include "cc/core/tree_view.h"

namespace tf_hsm {
namespace inference_internal {
// Per instruction set, like simd.h (see cc/core/simd_isa.h).
inline namespace TF_HSM_SIMD_ISA {

constexpr int64 kPackMinRows = 16;  // rows from which the row-panel kernel pays
constexpr int64 kLogitBudget = int64{1} << 20;  // TopK, Sample: logits kept per expansion batch

using sampling::Mix64;  // also TopK's hash

// Per-thread scratch, grown on demand and reused across calls (one per element type,
// shared by the four operations).
template <typename T>
struct Scratch {
  std::vector<T> z, lse, exps, row_max, row_sum, panels, stage, pair_rows, pair_biases;
  std::vector<T> class_values;  // LogProbAll: an item's class values, slot-major
  std::vector<T> node_values;   // LogProbAll's, kept by the calling thread for its next call
  std::vector<T> group_values;  // LogProbAll's subtree groups' (SubtreeGroups)
  std::vector<const T*> rows;
  std::vector<std::pair<int64, int64>> taken;
};

template <typename T>
Scratch<T>& ThreadScratch() {
  thread_local Scratch<T> scratch;
  return scratch;
}

// ---------------------------------------------------------------------------------------
// Shared numerics: logits tiles and an online logsumexp.
// ---------------------------------------------------------------------------------------

// The rows, packed in groups of kWidth for RowPanelDots: hp[(g * d + k) * kWidth + l] =
// rows[g * kWidth + l][k], zero past nr.
template <typename T>
void PackRows(const T* const* rows, int64 nr, int64 d, T* hp) {
  constexpr int64 w = simd::Vec<T>::kWidth;
  for (int64 g = 0; g * w < nr; ++g) {
    for (int64 l = 0; l < w; ++l) {
      const int64 r = g * w + l;
      T* dst = hp + g * d * w + l;
      if (r < nr) {
        for (int64 k = 0; k < d; ++k) dst[k * w] = rows[r][k];
      } else {
        for (int64 k = 0; k < d; ++k) dst[k * w] = T(0);
      }
    }
  }
}

namespace row_panel {

// kGroups row groups x kCols weight rows of the product. Each output is accumulated over k
// in kSplit interleaved partial sums (k mod kSplit, combined in a fixed order at the end):
// small tiles need the independent chains to keep the multiply-add units busy. The result
// goes to out[row * ld + column], or with kSlotMajor to out[column * ld + row] as whole
// vectors (lanes past `rows` then hold the zero padding's logits); slot-major outputs can
// also get bias[column] added and be folded into group_max[q], the lane-wise running max
// of row group q (a NaN never wins it), while they are still in registers. The cache
// lines [ahead, ahead_end) are requested into L2, one per step over k (the rest at the
// end): spread among the multiply-adds, they leave the fill buffers to the tile's own
// loads, which a burst of requests at the start of the tile held up.
template <typename T, int64 kGroups, int64 kCols, int64 kSplit, bool kSlotMajor>
inline void Tile(const T* panel, int64 d, const T* b, int64 ldb, int64 j0, int64 nb,
                 int64 rows, T* out, int64 ld, const T* bias = nullptr,
                 simd::VecT<T>* group_max = nullptr, const char* ahead = nullptr,
                 const char* ahead_end = nullptr) {
  typedef simd::VecT<T> V;
  constexpr int64 w = simd::Vec<T>::kWidth;
  constexpr int64 kLine = 64;
  const T* bc[kCols];
  for (int64 c = 0; c < kCols; ++c) bc[c] = b + std::min(j0 + c, nb - 1) * ldb;
  V acc[kSplit][kGroups][kCols] = {};
  int64 k = 0;
  for (; k + kSplit <= d; k += kSplit) {
    if (ahead < ahead_end) {
      RequestLine<false, 2>(ahead);
      ahead += kLine;
    }
    for (int64 u = 0; u < kSplit; ++u) {
      V hv[kGroups];
      for (int64 q = 0; q < kGroups; ++q) hv[q] = simd::Load(panel + (q * d + k + u) * w);
      for (int64 c = 0; c < kCols; ++c) {
        const T s = bc[c][k + u];
        for (int64 q = 0; q < kGroups; ++q) acc[u][q][c] += s * hv[q];
      }
    }
  }
  for (int64 u = 0; k < d; ++k, ++u) {
    for (int64 c = 0; c < kCols; ++c) {
      const T s = bc[c][k];
      for (int64 q = 0; q < kGroups; ++q) acc[u][q][c] += s * simd::Load(panel + (q * d + k) * w);
    }
  }
  for (; ahead < ahead_end; ahead += kLine) RequestLine<false, 2>(ahead);
  for (int64 half = kSplit / 2; half > 0; half /= 2)
    for (int64 u = 0; u < half; ++u)
      for (int64 q = 0; q < kGroups; ++q)
        for (int64 c = 0; c < kCols; ++c) acc[u][q][c] += acc[u + half][q][c];
  const int64 cols = std::min(kCols, nb - j0);
  if constexpr (kSlotMajor) {
    for (int64 q = 0; q < kGroups; ++q) {
      // The max is folded in a register: through group_max[q] (which may alias `out` as
      // far as the compiler knows) each fold waited for the previous one's store.
      V m = group_max != nullptr ? group_max[q] : V{};
      for (int64 c = 0; c < cols; ++c) {
        V z = acc[0][q][c];
        if (bias != nullptr) z += bias[j0 + c];
        simd::Store(out + (j0 + c) * ld + q * w, z);
        m = z > m ? z : m;
      }
      if (group_max != nullptr) group_max[q] = m;
    }
    return;
  }
  for (int64 q = 0; q < kGroups; ++q) {
    for (int64 c = 0; c < cols; ++c) {
      T lanes[w];
      std::memcpy(lanes, &acc[0][q][c], sizeof(lanes));
      for (int64 l = 0; l < std::min(w, rows - q * w); ++l) out[(q * w + l) * ld + j0 + c] = lanes[l];
    }
  }
}

}  // namespace row_panel

// out[r * ld + j] = sum_k rows[r][k] * b[j * ldb + k] for r < nr, j < nb, with the rows
// packed by PackRows: each vector holds kWidth rows and each weight element is broadcast,
// so the (much larger) weight block is never repacked. The summation order depends only
// on nb (the tile's width), never on the rows around an output. kSlotMajor: the same
// values at out[j * ld + r], ld a multiple of kWidth, rows padded to whole vectors, plus
// bias[j] when bias is given, and folded into group_max[g] for row group g when given.
// [ahead, ahead + ahead_bytes) is requested into L2 along the way (the caller's next weight
// block), spread over the first row groups' tiles so the loads overlap the arithmetic.
template <typename T, bool kSlotMajor = false>
void RowPanelDots(const T* hp, int64 nr, const T* b, int64 ldb, int64 nb, int64 d, T* out,
                  int64 ld, const void* ahead = nullptr, int64 ahead_bytes = 0,
                  const T* bias = nullptr, simd::VecT<T>* group_max = nullptr) {
  constexpr int64 w = simd::Vec<T>::kWidth;
  constexpr int64 kLine = 64;
  const int64 groups = (nr + w - 1) / w;
  const char* next = static_cast<const char*>(ahead);
  // The lines of part `part` of `parts` of [ahead, ahead + ahead_bytes), for the first row
  // groups' tiles to request (nothing for the other groups: g > 0).
  auto part = [&](int64 g, int64 i, int64 parts) -> std::pair<const char*, const char*> {
    if (g > 0 || next == nullptr) return {nullptr, nullptr};
    return {next + ahead_bytes * i / parts / kLine * kLine, next + ahead_bytes * (i + 1) / parts};
  };
  // Weight rows per tile: 8, or 5 for four row groups (20 accumulators, and each weight
  // element is loaded once for 64 float rows), or fewer for the small nodes of binary trees.
  auto columns = [&](auto group_tag, int64 g) {
    constexpr int64 G = decltype(group_tag)::value;
    constexpr int64 kCols = G == 4 ? 5 : 8;
    const T* panel = hp + g * d * w;
    T* o = out + (kSlotMajor ? g * w : g * w * ld);
    simd::VecT<T>* gmax = group_max == nullptr ? nullptr : group_max + g;
    const int64 rows = nr - g * w;
    // The split depends on nb only, so an output's bits do not depend on its row group.
    // Slot-major outputs always use one chain (kSplit 1), so their bits do not depend on
    // nb either (LogProbAll batches small nodes).
    if (!kSlotMajor && nb <= 2) {
      const auto [pf, pf_end] = part(g, 0, 1);
      row_panel::Tile<T, G, 2, 4, kSlotMajor>(panel, d, b, ldb, 0, nb, rows, o, ld, bias, gmax, pf, pf_end);
    } else if (!kSlotMajor && nb <= 4) {
      const auto [pf, pf_end] = part(g, 0, 1);
      row_panel::Tile<T, G, 4, 2, kSlotMajor>(panel, d, b, ldb, 0, nb, rows, o, ld, bias, gmax, pf, pf_end);
    } else {
      const int64 tiles = (nb + kCols - 1) / kCols;
      for (int64 j0 = 0; j0 < nb; j0 += kCols) {
        const auto [pf, pf_end] = part(g, j0 / kCols, tiles);
        row_panel::Tile<T, G, kCols, 1, kSlotMajor>(panel, d, b, ldb, j0, nb, rows, o, ld, bias, gmax, pf, pf_end);
      }
    }
  };
  int64 g = 0;
  // Slot-major outputs sum in one chain whatever the tile, so the wider tile is free to
  // take any four groups; the others keep the 8-column tile, whose split depends on nb.
  if constexpr (kSlotMajor) {
    for (; g + 4 <= groups; g += 4) columns(std::integral_constant<int64, 4>(), g);
  }
  for (; g + 2 <= groups; g += 2) columns(std::integral_constant<int64, 2>(), g);  // two groups
  if (g < groups) columns(std::integral_constant<int64, 1>(), g);                  // share loads
}

// z[r * ld + j] = weights[first + j] . rows[r] + biases[first + j] for r < nr, j < kb.
// `packed` is nullptr or the rows packed by PackRows (see PackedRows), for the row-panel
// kernel (worth it from about kPackMinRows rows); otherwise simd::DotBlock, whose kernels
// give identical bits whatever the tile. The row-panel kernel rounds differently, so
// every caller chooses it from quantities that do not depend on threading.
template <typename T>
void Logits(const SoftmaxParams<T>& p, const T* const* rows, int64 nr, int64 first, int64 kb,
            const T* packed, T* z, int64 ld) {
  const T* w = p.weights + first * p.dim;
  if (packed != nullptr) {
    RowPanelDots(packed, nr, w, p.dim, kb, p.dim, z, ld);
  } else {
    simd::DotBlock<T>(rows, nr, w, p.dim, kb, p.dim, z, ld);
  }
  if (p.biases != nullptr) {
    const T* b = p.biases + first;
    for (int64 r = 0; r < nr; ++r)
      for (int64 j = 0; j < kb; ++j) z[r * ld + j] += b[j];
  }
}

// lse[r] = logsumexp(z[r * ld + 0..K)) for r < nr, for nodes of at most kWidth children
// (binary trees are all such nodes): the exponentials of all rows in one vector pass, the
// sums in order. `exps` holds nr * K values.
template <typename T>
void SmallNodeLogSumExp(const T* z, int64 nr, int64 K, int64 ld, T* exps, T* lse) {
  for (int64 r = 0; r < nr; ++r) {
    const T* zr = z + r * ld;
    T m = -std::numeric_limits<T>::infinity();
    for (int64 j = 0; j < K; ++j) m = zr[j] > m ? zr[j] : m;
    lse[r] = m;
    for (int64 j = 0; j < K; ++j) exps[r * K + j] = zr[j] - m;
  }
  simd::ExpInPlace(exps, nr * K);
  for (int64 r = 0; r < nr; ++r) {
    T sum = 0;
    for (int64 j = 0; j < K; ++j) sum += exps[r * K + j];
    lse[r] += std::log(sum);
  }
}

// The rows packed for the packed kernel when `pack`, in per-thread scratch; else nullptr.
template <typename T>
const T* PackedRows(const T* const* rows, int64 nr, int64 d, bool pack) {
  if (!pack) return nullptr;
  constexpr int64 w = simd::Vec<T>::kWidth;
  T* hp = Grow(&ThreadScratch<T>().panels, (nr + w - 1) / w * w * d);
  PackRows(rows, nr, d, hp);
  return hp;
}

// The logits of node slots [first, first + K) for nr rows (packed: as for Logits), in
// tiles of kSlotTile slots, each folded into its rows' running logsumexp (FoldLogSumExp)
// as soon as it is computed; then lse[r] = the logsumexp of row r's K logits (lse ==
// nullptr: logits only). With keep_all, z holds every logit, row r's at z + r * K;
// otherwise one tile at a time, nr * kSlotTile values, a tile of kb slots at ld = kb.
// on_tile(tile, ld, k0, kb) sees each tile (slots first + k0, ..., first + k0 + kb - 1)
// before the next is computed.
template <typename T, typename OnTile>
void TiledLogSumExp(const SoftmaxParams<T>& p, const T* const* rows, int64 nr, int64 first,
                    int64 K, const T* packed, bool keep_all, T* z, T* lse, OnTile&& on_tile) {
  Scratch<T>& s = ThreadScratch<T>();
  T* row_max = Grow(&s.row_max, nr);
  T* row_sum = Grow(&s.row_sum, nr);
  for (int64 r = 0; r < nr; ++r) {
    row_max[r] = -std::numeric_limits<T>::infinity();
    row_sum[r] = 0;
  }
  for (int64 k0 = 0; k0 < K; k0 += kSlotTile) {
    const int64 kb = std::min(kSlotTile, K - k0);
    T* tile = keep_all ? z + k0 : z;
    const int64 ld = keep_all ? K : kb;
    Logits(p, rows, nr, first + k0, kb, packed, tile, ld);
    if (lse != nullptr) {
      for (int64 r = 0; r < nr; ++r) FoldLogSumExp(tile + r * ld, kb, &row_max[r], &row_sum[r]);
    }
    on_tile(tile, ld, k0, kb);
  }
  if (lse == nullptr) return;
  for (int64 r = 0; r < nr; ++r) lse[r] = row_max[r] + std::log(row_sum[r]);
}

// All K logits of one node for nr rows, z[r * K + j], and (when lse != nullptr) their
// logsumexp per row: SmallNodeLogSumExp for nodes of at most kWidth children, otherwise
// TiledLogSumExp. packed: the row-panel kernel (rows packed here, in scratch).
template <typename T>
void NodeLogits(const SoftmaxParams<T>& p, const T* const* rows, int64 nr, int64 first,
                int64 K, bool packed, T* z, T* lse) {
  const T* hp = PackedRows(rows, nr, p.dim, packed);
  if (K <= simd::Vec<T>::kWidth) {
    Logits(p, rows, nr, first, K, hp, z, K);
    if (lse != nullptr) SmallNodeLogSumExp(z, nr, K, K, Grow(&ThreadScratch<T>().exps, nr * K), lse);
    return;
  }
  TiledLogSumExp(p, rows, nr, first, K, hp, /*keep_all=*/true, z, lse,
                 [](const T*, int64, int64, int64) {});
}

// ---------------------------------------------------------------------------------------
// Tree checks (inference_common.cc). The tensors are untrusted; each offset is checked
// before it is used.
// ---------------------------------------------------------------------------------------

std::string CheckSizes(const TreeView& t, int64 num_rows, int64 dim, bool need_slot_child);

// Node n's slot range (n in [0, M) is the caller's to guarantee), checked to be a
// non-empty range of weight rows.
std::string NodeRange(const TreeView& t, int64 n, int64* begin, int64* end);

// True when child code `code` of node n is a class in [0, C) or C + m for a node
// n < m < M: the fast test for the sweeps over every slot; CheckChild says what is wrong.
// Without branches (negative codes wrap to huge unsigned values), so that a sweep of it
// vectorizes.
inline bool ValidChild(const TreeView& t, int64 n, int64 code) {
  const std::uint64_t u = static_cast<std::uint64_t>(code);
  const std::uint64_t later = static_cast<std::uint64_t>(t.num_classes + n + 1);
  return (u < static_cast<std::uint64_t>(t.num_classes)) |
         (u - later < static_cast<std::uint64_t>(t.num_nodes - n - 1));
}

// Checks one child code of node n: a class in [0, C), or C + m for a node n < m < M.
std::string CheckChild(const TreeView& t, int64 n, int64 slot, int64 code);

// Checks the child codes of node n's slots [begin, end).
std::string CheckChildren(const TreeView& t, int64 n, int64 begin, int64 end);

// The first non-empty message of a set of work items.
std::string FirstError(const std::vector<std::string>& errors);

}  // namespace TF_HSM_SIMD_ISA
}  // namespace inference_internal
}  // namespace tf_hsm

#endif  // TF_HSM_CC_CORE_INFERENCE_COMMON_H_
