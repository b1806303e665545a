#include "cc/core/inference.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <sstream>
#include <type_traits>
#include <utility>
#include <vector>

#include "cc/core/simd.h"
#include "cc/core/softmax_util.h"
#include "cc/core/visit_plan.h"

namespace tf_hsm {
namespace {

constexpr int64 kMinSearchRows = 16;    // rows one TopK work item searches together:
constexpr int64 kMaxSearchRows = 64;    //   see SearchRowsPerItem
constexpr int64 kSampleRows = 64;       // rows one Sample work item walks together
constexpr int64 kBlockRows = 64;        // LogProbAll rows that share every weight block
constexpr int64 kSplitRows = 16;        // LogProbAll row tile when a level has few nodes
constexpr int64 kCandidateRows = 64;    // LogProbCandidates rows per work item
constexpr int64 kPackMinRows = 16;      // rows from which the row-panel kernel pays
constexpr int64 kLogitBudget = int64{1} << 20;      // logits kept per expansion batch
constexpr int64 kKeepLogits = int64{1} << 17;       // LogProbAll: logits kept per node
constexpr int64 kNodeValueBudget = int64{1} << 24;  // LogProbAll node values per block
constexpr int64 kGroupValueBudget = int64{1} << 18;  // per subtree group: 1 MB in float
// LogProbAll: outputs of at least this many bytes are written past the caches, for runs of
// at least kStreamMinColumns classes, kStageColumns consecutive classes per row at a time
// (staged in L1 first).
constexpr int64 kStreamMinBytes = int64{32} << 20;
constexpr int64 kStreamMinColumns = 64;
constexpr int64 kStageColumns = 256;
// LogProbAll: an item whose class children are scattered (not runs of consecutive classes
// within one node) but together cover a range of at least this many consecutive classes
// gathers their values first and writes the range as a run (see SweepItemRowsInLanes).
constexpr int64 kGatherMinClasses = 64;
constexpr int64 kChunkWork = int64{1} << 15;        // LogProbAll: slots x (D + 4) per item

template <typename... Args>
std::string Message(const Args&... args) {
  std::ostringstream s;
  (s << ... << args);
  return s.str();
}

// The splitmix64 finaliser: a bijection of 64-bit words that mixes every input bit.
inline std::uint64_t Mix64(std::uint64_t z) {
  z += 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// Per-thread scratch, grown on demand and reused across calls.
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

// All K logits of one node for nr rows, z[r * K + j], and (when lse != nullptr) their
// logsumexp per row, folded tile by tile.
template <typename T>
void NodeLogits(const SoftmaxParams<T>& p, const T* const* rows, int64 nr, int64 first,
                int64 K, bool packed, T* z, T* lse) {
  Scratch<T>& s = ThreadScratch<T>();
  const T* hp = PackedRows(rows, nr, p.dim, packed);
  if (K <= simd::Vec<T>::kWidth) {
    Logits(p, rows, nr, first, K, hp, z, K);
    if (lse != nullptr) SmallNodeLogSumExp(z, nr, K, K, Grow(&s.exps, nr * K), lse);
    return;
  }
  T* row_max = Grow(&s.row_max, nr);
  T* row_sum = Grow(&s.row_sum, nr);
  for (int64 r = 0; r < nr; ++r) {
    row_max[r] = -std::numeric_limits<T>::infinity();
    row_sum[r] = 0;
  }
  for (int64 k0 = 0; k0 < K; k0 += kSlotTile) {
    const int64 kb = std::min(kSlotTile, K - k0);
    Logits(p, rows, nr, first + k0, kb, hp, z + k0, K);
    if (lse == nullptr) continue;
    for (int64 r = 0; r < nr; ++r) FoldLogSumExp(z + r * K + k0, kb, &row_max[r], &row_sum[r]);
  }
  if (lse == nullptr) return;
  for (int64 r = 0; r < nr; ++r) lse[r] = row_max[r] + std::log(row_sum[r]);
}

// ---------------------------------------------------------------------------------------
// Tree checks. The tensors are untrusted; each offset is checked before it is used.
// ---------------------------------------------------------------------------------------

std::string CheckSizes(const TreeView& t, int64 num_rows, int64 dim, bool need_slot_child) {
  if (t.num_classes < 1) return "the tree has no classes (path_begin needs at least 2 entries)";
  if (t.num_nodes < 1) return "the tree has no nodes (child_begin needs at least 2 entries)";
  if (num_rows < 0 || dim < 0) return Message("invalid sizes: ", num_rows, " rows of dimension ", dim);
  if (need_slot_child && t.slot_child == nullptr) return "slot_child is required";
  return "";
}

// Node n's slot range (n in [0, M) is the caller's to guarantee), checked to be a
// non-empty range of weight rows.
std::string NodeRange(const TreeView& t, int64 n, int64* begin, int64* end) {
  *begin = t.child_begin[n];
  *end = t.child_begin[n + 1];
  if (*begin < 0 || *end <= *begin || *end > t.num_slots) {
    return Message("malformed tree: child_begin[", n, ":", n + 2, "] = [", *begin, ", ", *end,
                   "] is not a non-empty slot range within the ", t.num_slots, " weight rows");
  }
  return "";
}

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
std::string CheckChild(const TreeView& t, int64 n, int64 slot, int64 code) {
  if (ValidChild(t, n, code)) return "";
  const int64 C = t.num_classes, M = t.num_nodes;
  if (code < 0 || code >= C + M) {
    return Message("malformed tree: slot_child[", slot, "] = ", code,
                   " is outside [0, num_classes + num_nodes) = [0, ", C + M, ")");
  }
  if (code >= C && code - C <= n) {
    return Message("malformed tree: slot_child[", slot, "] = ", code, " makes node ", code - C,
                   " a child of node ", n, "; a child node must be numbered after its parent");
  }
  return "";
}

std::string CheckChildren(const TreeView& t, int64 n, int64 begin, int64 end) {
  // One vectorized sweep; the slot at fault is only looked for once one is known to be there.
  bool valid = true;
  for (int64 s = begin; s < end; ++s) valid &= ValidChild(t, n, t.slot_child[s]);
  if (valid) return "";
  for (int64 s = begin; s < end; ++s) {
    if (!ValidChild(t, n, t.slot_child[s])) return CheckChild(t, n, s, t.slot_child[s]);
  }
  return "";
}

// The first non-empty message of a set of work items.
std::string FirstError(const std::vector<std::string>& errors) {
  for (const std::string& e : errors)
    if (!e.empty()) return e;
  return "";
}

// (node, row) requests of one round, grouped by node (rows in increasing order), so that
// rows at the same node share its weight block.
struct Request {
  int64 node;
  int64 row;
};

void SortRequests(std::vector<Request>* req) {
  std::sort(req->begin(), req->end(), [](const Request& a, const Request& b) {
    return a.node != b.node ? a.node < b.node : a.row < b.row;
  });
}

// ---------------------------------------------------------------------------------------
// TopK: best-first search.
// ---------------------------------------------------------------------------------------

template <typename T>
struct Entry {
  T value;       // log-probability of the path to this node or class
  int64 code;    // class c as c, node m as C + m
  int64 record;  // nodes: the row's Record of the node; classes: -1
};

// True when a leaves the queue before b: larger value first and NaN last; at equal values
// nodes before classes (a node's subtree may hold a class of the same value, e.g. below a
// single-child node, with a smaller id), then increasing code. A strict total order on
// classes, so the output never depends on the order in which they were queued.
template <typename T>
inline bool Before(const Entry<T>& a, const Entry<T>& b, int64 C) {
  const bool a_nan = std::isnan(a.value), b_nan = std::isnan(b.value);
  if (a_nan != b_nan) return b_nan;
  if (!a_nan) {
    if (a.value > b.value) return true;
    if (a.value < b.value) return false;
  }
  const bool a_node = a.code >= C, b_node = b.code >= C;
  if (a_node != b_node) return a_node;
  return a.code < b.code;
}

// True when nothing at or below e can be among the top k, given the k-th best class
// queued so far. A class's log-probability is never above its ancestors' (each step adds
// z - lse <= 0, also in floating point), so a node is cut only when strictly below.
template <typename T>
inline bool CannotReach(const Entry<T>& e, const Entry<T>& kth, int64 C) {
  if (e.code < C) return Before(kth, e, C);
  const bool e_nan = std::isnan(e.value), k_nan = std::isnan(kth.value);
  if (e_nan) return !k_nan;
  if (k_nan) return false;
  return kth.value > e.value;
}

// A node queued for one row. The records of one node form a list (newest first), so
// that when any row expands the node, the other rows that queued it are found at once.
template <typename T>
struct Record {
  int64 row;
  int64 next;      // next record of the same node, or -1
  T value;         // the node's path log-probability for this row
  bool alive;      // still queued: neither expanded nor dropped for this row
  bool requested;  // the row's own search asked for it this round
};

// Node -> index of its newest record, by open addressing (a table per work item, sized by
// the number of nodes queued, not by the tree).
class NodeIndex {
 public:
  void Reset() {
    if (keys_.size() != kInitial || count_ > 0) {
      keys_.assign(kInitial, -1);
      heads_.assign(kInitial, -1);
    }
    count_ = 0;
  }
  int64 Get(int64 node) const {
    const size_t mask = keys_.size() - 1;
    for (size_t i = Mix64(node) & mask;; i = (i + 1) & mask) {
      if (keys_[i] == node) return heads_[i];
      if (keys_[i] < 0) return -1;
    }
  }
  // The head slot of node, inserted (as -1) when absent.
  int64& Head(int64 node) {
    if (2 * (count_ + 1) > static_cast<int64>(keys_.size())) Rehash(2 * keys_.size());
    const size_t mask = keys_.size() - 1;
    size_t i = Mix64(node) & mask;
    for (; keys_[i] != node; i = (i + 1) & mask) {
      if (keys_[i] < 0) {
        keys_[i] = node;
        ++count_;
        break;
      }
    }
    return heads_[i];
  }

 private:
  static constexpr size_t kInitial = 1024;  // a power of two
  void Rehash(size_t size) {
    std::vector<int64> keys(size, -1), heads(size, -1);
    for (size_t j = 0; j < keys_.size(); ++j) {
      if (keys_[j] < 0) continue;
      size_t i = Mix64(keys_[j]) & (size - 1);
      while (keys[i] >= 0) i = (i + 1) & (size - 1);
      keys[i] = keys_[j];
      heads[i] = heads_[j];
    }
    keys_.swap(keys);
    heads_.swap(heads);
  }
  std::vector<int64> keys_, heads_;
  int64 count_ = 0;
};

template <typename T>
struct RowSearch {
  std::vector<Entry<T>> queue;  // heap; front = the next to leave
  std::vector<Entry<T>> best;   // the best <= k classes queued so far; front = the worst
  int64 found = 0;
  int64 expanded = 0;
  bool done = false;
};

template <typename T>
struct SearchScratch {
  std::vector<RowSearch<T>> rows;
  std::vector<Record<T>> records;
  NodeIndex index;
  std::vector<int64> requested_nodes, expand_rows, expand_records, seen;
};

// Queues the children of a node expanded for row r (path log-probability `parent`),
// except those that cannot reach the row's top k.
template <typename T>
void PushChildren(SearchScratch<T>* ss, int64 r, T parent, const T* z, T lse,
                  const int64* codes, int64 K, int64 C, int64 k) {
  RowSearch<T>* rs = &ss->rows[r];
  auto later = [C](const Entry<T>& a, const Entry<T>& b) { return Before(b, a, C); };
  auto earlier = [C](const Entry<T>& a, const Entry<T>& b) { return Before(a, b, C); };
  // Children strictly below the k-th best class queued so far are cut by one comparison;
  // the rest (NaN included) go through the exact test.
  bool full = static_cast<int64>(rs->best.size()) == k;
  T bound = full ? rs->best.front().value : -std::numeric_limits<T>::infinity();
  constexpr int64 kBlock = simd::Vec<T>::kWidth;
  for (int64 j = 0; j < K; ++j) {
    if (full && j % kBlock == 0) {
      // Whole blocks of children below the bound are skipped by one vector test (the
      // bound only rises, so a block below it now stays below it).
      const int64 stop = std::min(K, j + kBlock);
      bool any = false;
      for (int64 i = j; i < stop; ++i) any |= !(parent + (z[i] - lse) < bound);
      if (!any) {
        j = stop - 1;
        continue;
      }
    }
    Entry<T> e{parent + (z[j] - lse), codes[j], -1};
    if (e.value < bound) continue;
    if (full && CannotReach(e, rs->best.front(), C)) continue;
    if (e.code >= C) {
      int64& head = ss->index.Head(e.code - C);
      e.record = static_cast<int64>(ss->records.size());
      ss->records.push_back(Record<T>{r, head, e.value, true, false});
      head = e.record;
    }
    rs->queue.push_back(e);
    std::push_heap(rs->queue.begin(), rs->queue.end(), later);
    if (e.code >= C) continue;
    if (full) {
      std::pop_heap(rs->best.begin(), rs->best.end(), earlier);
      rs->best.back() = e;
    } else {
      rs->best.push_back(e);
    }
    std::push_heap(rs->best.begin(), rs->best.end(), earlier);
    full = static_cast<int64>(rs->best.size()) == k;
    if (full) bound = rs->best.front().value;
  }
}

// Searches rows [row0, row0 + nr) together, in rounds. Each round, every unfinished row
// moves the classes at the top of its queue to the output and requests the node now at
// the top: the node a search of the row on its own would expand next. Each requested
// node is then expanded for its requesters and also for every other row of the item that
// has it queued and can still use it (it is not below the row's k-th best class queued so
// far; rows without k classes yet are not included, as nearly every node looks useful to
// them), so rows share the pass over the node's weights: when the distribution is flat
// and every row must expand most nodes, each node's weights are read once per item.
// Expanding a queued node early leaves the result unchanged: the queue still covers every
// class not yet output, and classes leave it in the same order. The set of expanded
// nodes (num_expanded) depends on which rows share an item, never on threads.
template <typename T>
std::string SearchRows(const TreeView& t, const SoftmaxParams<T>& p, int64 k, int64 row0,
                       int64 nr, T* log_probs, int64* classes, int64* num_expanded) {
  const int64 C = t.num_classes, M = t.num_nodes;
  thread_local SearchScratch<T> ss;
  Scratch<T>& s = ThreadScratch<T>();
  if (static_cast<int64>(ss.rows.size()) < nr) ss.rows.resize(nr);
  ss.records.clear();
  ss.index.Reset();
  auto later = [C](const Entry<T>& a, const Entry<T>& b) { return Before(b, a, C); };
  for (int64 r = 0; r < nr; ++r) {
    RowSearch<T>& rs = ss.rows[r];
    int64& head = ss.index.Head(0);
    const int64 rec = static_cast<int64>(ss.records.size());
    ss.records.push_back(Record<T>{r, head, T(0), true, false});
    head = rec;
    rs.queue.assign(1, Entry<T>{T(0), C, rec});  // the root
    rs.best.clear();
    rs.found = rs.expanded = 0;
    rs.done = false;
  }
  std::vector<int64>& nodes = ss.requested_nodes;
  for (;;) {
    nodes.clear();
    for (int64 r = 0; r < nr; ++r) {
      RowSearch<T>& rs = ss.rows[r];
      if (rs.done) continue;
      T* out_lp = log_probs + (row0 + r) * k;
      int64* out_cls = classes + (row0 + r) * k;
      while (!rs.queue.empty()) {
        const Entry<T>& top = rs.queue.front();
        if (top.code >= C && ss.records[top.record].alive) break;
        if (top.code < C) {
          out_lp[rs.found] = top.value;
          out_cls[rs.found] = top.code;
          ++rs.found;
        }
        std::pop_heap(rs.queue.begin(), rs.queue.end(), later);
        rs.queue.pop_back();
        if (rs.found == k) break;
      }
      if (rs.found == k) {
        rs.done = true;
        num_expanded[row0 + r] = rs.expanded;
        // A class reached twice can only come from a malformed tree.
        ss.seen.assign(out_cls, out_cls + k);
        std::sort(ss.seen.begin(), ss.seen.end());
        const auto twice = std::adjacent_find(ss.seen.begin(), ss.seen.end());
        if (twice != ss.seen.end()) {
          return Message("malformed tree: class ", *twice, " is the child of more than one slot");
        }
        continue;
      }
      if (rs.queue.empty()) {
        return Message("malformed tree: only ", rs.found,
                       " classes are reachable from the root through slot_child, fewer than k = ", k);
      }
      std::pop_heap(rs.queue.begin(), rs.queue.end(), later);
      const Entry<T> e = rs.queue.back();
      rs.queue.pop_back();
      ss.records[e.record].requested = true;
      nodes.push_back(e.code - C);
    }
    if (nodes.empty()) return "";
    std::sort(nodes.begin(), nodes.end());
    nodes.erase(std::unique(nodes.begin(), nodes.end()), nodes.end());
    for (const int64 n : nodes) {
      int64 begin, end;
      std::string err = NodeRange(t, n, &begin, &end);
      if (err.empty()) err = CheckChildren(t, n, begin, end);
      if (!err.empty()) return err;
      // The rows to expand n for: its requesters and the rows that can still use it.
      std::vector<int64>& rows_of = ss.expand_rows;
      std::vector<int64>& recs = ss.expand_records;
      rows_of.clear();
      recs.clear();
      for (int64 rec = ss.index.Get(n); rec >= 0; rec = ss.records[rec].next) {
        Record<T>& rd = ss.records[rec];
        if (!rd.alive) continue;
        RowSearch<T>& rs = ss.rows[rd.row];
        const bool useful = !rs.done && (rd.requested ||
            static_cast<int64>(rs.best.size()) < k ||
            !CannotReach(Entry<T>{rd.value, C + n, rec}, rs.best.front(), C));
        if (!useful) {
          rd.alive = false;  // of no use to the row, now or later
          continue;
        }
        // Share only once the row has a bound (k classes queued): before that every
        // queued node looks useful, and most are not.
        if (!rd.requested && static_cast<int64>(rs.best.size()) < k) continue;
        rd.alive = false;
        if (++rs.expanded > M) {
          return Message("malformed tree: the search expanded more than the ", M,
                         " internal nodes; some node is the child of more than one slot");
        }
        recs.push_back(rec);
      }
      // Records are newest first; expand in row order.
      std::sort(recs.begin(), recs.end(), [&](int64 a, int64 b) {
        return ss.records[a].row < ss.records[b].row;
      });
      const int64 K = end - begin;
      const int64 count = static_cast<int64>(recs.size());
      const int64 batch = std::max<int64>(1, std::min<int64>(count, kLogitBudget / K));
      for (int64 b0 = 0; b0 < count; b0 += batch) {
        const int64 nb = std::min<int64>(batch, count - b0);
        const T** rows = Grow(&s.rows, nb);
        for (int64 i = 0; i < nb; ++i) {
          rows[i] = p.hidden + (row0 + ss.records[recs[b0 + i]].row) * p.dim;
        }
        T* z = Grow(&s.z, nb * K);
        T* lse = Grow(&s.lse, nb);
        NodeLogits(p, rows, nb, begin, K, nb >= kPackMinRows, z, lse);
        for (int64 i = 0; i < nb; ++i) {
          const Record<T>& rd = ss.records[recs[b0 + i]];
          PushChildren(&ss, rd.row, rd.value, z + i * K, lse[i], t.slot_child + begin, K, C, k);
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------
// Sample: ancestral sampling with a counter-based generator.
// ---------------------------------------------------------------------------------------

// A uniform double in [0, 1) for (seed, row, step).
inline double Uniform(std::uint64_t seed, int64 row, int64 step) {
  const std::uint64_t x = Mix64(Mix64(Mix64(seed) + static_cast<std::uint64_t>(row)) +
                                static_cast<std::uint64_t>(step));
  return static_cast<double>(x >> 11) * 0x1.0p-53;
}

// Draws j with probability softmax(z / temperature)[j] by inverting the cumulative sum
// (accumulated in double) at u in [0, 1). z is overwritten. -1 when the logits hold NaN
// or +inf, or are all -inf (a -inf logit alone just masks its child).
template <typename T>
int64 PickSlot(T* z, int64 K, T temperature, double u) {
  T m = -std::numeric_limits<T>::infinity();
  for (int64 j = 0; j < K; ++j) {
    if (std::isnan(z[j])) return -1;
    m = z[j] > m ? z[j] : m;
  }
  if (std::isinf(m)) return -1;  // some logit +inf, or all -inf
  for (int64 j = 0; j < K; ++j) z[j] = (z[j] - m) / temperature;
  simd::ExpInPlace(z, K);
  double total = 0;
  for (int64 j = 0; j < K; ++j) total += z[j];
  const double target = u * total;
  double acc = 0;
  int64 last = -1;
  for (int64 j = 0; j < K; ++j) {
    if (!(z[j] > 0)) continue;
    acc += z[j];
    last = j;
    if (acc > target) return j;
  }
  return last;  // u * total rounded up to total
}

struct SampleState {
  int64 node;
  int64 depth;
  bool done;
};

template <typename T>
std::string SampleRows(const TreeView& t, const SoftmaxParams<T>& p, std::uint64_t seed,
                       T temperature, int64 row0, int64 nr, int64* classes) {
  const int64 C = t.num_classes;
  Scratch<T>& s = ThreadScratch<T>();
  thread_local std::vector<SampleState> state;
  thread_local std::vector<Request> req;
  state.assign(nr, SampleState{0, 0, false});
  for (;;) {
    req.clear();
    for (int64 r = 0; r < nr; ++r)
      if (!state[r].done) req.push_back({state[r].node, r});
    if (req.empty()) return "";
    SortRequests(&req);
    for (size_t g0 = 0, g1; g0 < req.size(); g0 = g1) {
      for (g1 = g0 + 1; g1 < req.size() && req[g1].node == req[g0].node;) ++g1;
      const int64 n = req[g0].node;
      int64 begin, end;
      std::string err = NodeRange(t, n, &begin, &end);
      if (err.empty()) err = CheckChildren(t, n, begin, end);
      if (!err.empty()) return err;
      const int64 K = end - begin;
      const int64 batch = std::max<int64>(1, std::min<int64>(g1 - g0, kLogitBudget / K));
      for (size_t b0 = g0; b0 < g1; b0 += batch) {
        const int64 nb = std::min<int64>(batch, g1 - b0);
        const T** rows = Grow(&s.rows, nb);
        for (int64 i = 0; i < nb; ++i) rows[i] = p.hidden + (row0 + req[b0 + i].row) * p.dim;
        T* z = Grow(&s.z, nb * K);
        // Always the dot-product kernels, whose bits do not depend on the other rows: a
        // row's sample then depends on nothing but its own inputs, position and seed.
        NodeLogits(p, rows, nb, begin, K, false, z, static_cast<T*>(nullptr));
        for (int64 i = 0; i < nb; ++i) {
          const int64 r = req[b0 + i].row;
          SampleState& st = state[r];
          const int64 j = PickSlot(z + i * K, K, temperature, Uniform(seed, row0 + r, st.depth));
          const int64 code = j < 0 ? -1 : t.slot_child[begin + j];
          if (code < C) {
            classes[row0 + r] = code;
            st.done = true;
          } else {
            st.node = code - C;
            ++st.depth;
          }
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------
// LogProbAll: one sweep over the needed nodes, level by level.
// ---------------------------------------------------------------------------------------

// The needed nodes in processing order (by depth, then id) and, for every child slot of
// each, where its value goes.
struct SweepPlan {
  int64 class_begin = 0, class_end = 0;
  std::vector<int64> node;         // [P] needed nodes; position 0 is the root
  std::vector<int64> level_begin;  // [levels + 1] position ranges of equal depth
  std::vector<int64> position;     // [M] position of each needed node, -1 for the others
  // [P] c >= 0 when every child of the node is a class of the range, in consecutive
  // columns c, c + 1, ... (a cluster of consecutive classes); else -1.
  std::vector<int64> run;
  std::vector<int64> parent;  // [P] the position of each needed node's parent (root: -1)
  // [P] the row of the node values that holds each needed node's log-probabilities: two
  // levels' worth of rows, alternating by depth, since a level's values are read by that
  // level and written by the one above it (a binary tree's values would otherwise take P
  // rows). Below a split level (see SubtreeGroups), rows within the node's group.
  std::vector<int64> value_row;
  int64 value_rows = 0;  // of the rows shared by all (above the split level, if any)
};

// Deep trees with wide levels (a binary tree over 1M classes has 250K nodes on one level)
// would need tens of MB of node values per row block, visited once per level from DRAM.
// Below a split level L, the subtrees of L's nodes are independent: each group of them is
// swept to the bottom by one thread, level by level, with its values in a small per-thread
// buffer, cache-resident. Needs the nodes of a group to be consecutive positions on every
// level (true of breadth-first numbered trees, as every builder makes); else none.
struct SubtreeGroups {
  int64 level = -1;  // L; -1: no groups, every level is swept across the whole tree
  int64 span = 0;    // levels L, L + 1, ..., L + span - 1
  int64 cap = 0;     // the most nodes of one group on one level
  std::vector<int64> begin, end;  // [G * span] positions of group g on level L + i
  int64 count() const { return span == 0 ? 0 : static_cast<int64>(begin.size()) / span; }
};

}  // namespace

// A plan of a whole tree with the tree arrays it was made from, for row blocks of `block`
// rows with the packed kernel or not (the subtree groups depend on both).
struct SweepPlanCache::Entry {
  int64 num_classes = 0;
  bool packed = false;
  int64 block = 0;
  std::vector<int64> child_begin, slot_child;  // [num_nodes + 1], [num_slots]
  SweepPlan plan;
  SubtreeGroups groups;
};

SweepPlanCache::SweepPlanCache() = default;
SweepPlanCache::~SweepPlanCache() = default;

std::shared_ptr<const SweepPlanCache::Entry> SweepPlanCache::Get() const {
  std::lock_guard<std::mutex> lock(mu_);
  return entry_;
}

void SweepPlanCache::Put(std::shared_ptr<const Entry> entry) {
  std::lock_guard<std::mutex> lock(mu_);
  entry_ = std::move(entry);
}

namespace {

// Whether n values at a equal those at b, compared in parallel chunks.
bool SameValues(const int64* a, const int64* b, int64 n, const ParallelFor& parallel_for) {
  constexpr int64 kChunk = int64{1} << 16;
  const int64 chunks = (n + kChunk - 1) / kChunk;
  std::atomic<bool> differ{false};
  parallel_for(chunks, kChunk, [&](int64 begin, int64 end) {
    for (int64 c = begin; c < end && !differ.load(std::memory_order_relaxed); ++c) {
      const int64 first = c * kChunk, count = std::min(kChunk, n - first);
      if (std::memcmp(a + first, b + first, count * sizeof(int64)) != 0) {
        differ.store(true, std::memory_order_relaxed);
      }
    }
  });
  return !differ.load();
}

// Whether the cached plan was made from this tree, for these row blocks.
bool PlanFits(const SweepPlanCache::Entry& e, const TreeView& t, bool packed, int64 block,
              const ParallelFor& parallel_for) {
  return e.num_classes == t.num_classes &&
         static_cast<int64>(e.child_begin.size()) == t.num_nodes + 1 &&
         static_cast<int64>(e.slot_child.size()) == t.num_slots && e.packed == packed &&
         e.block == block &&
         SameValues(e.child_begin.data(), t.child_begin, t.num_nodes + 1, parallel_for) &&
         SameValues(e.slot_child.data(), t.slot_child, t.num_slots, parallel_for);
}

int64 PlanBytes(const TreeView& t, const SweepPlan& plan) {
  const int64 values = (t.num_nodes + 1) + t.num_slots + plan.node.size() + plan.position.size() +
                       plan.run.size() + plan.parent.size() + plan.value_row.size();
  return values * static_cast<int64>(sizeof(int64));
}

// The walk of BuildSweepPlan for the whole class range (every node needed), in parallel
// chunks of nodes: checks each node's slot range and child codes, and gives each node
// its run (or -1) and each child node its parent. Once every class and every node but the
// root is known to be reached, a child reached twice means more class children than
// classes, or more node children than nodes less the root: counting them stands for the
// serial walk's duplicate checks (the caller checks the nodes' parents). False when any
// check fails: the serial walk then names the problem (the first in id order), so
// messages do not depend on the threads.
bool WalkWholeTree(const TreeView& t, const ParallelFor& parallel_for, std::vector<int64>* run,
                   std::vector<int64>* parent) {
  const int64 C = t.num_classes, M = t.num_nodes;
  // Chunks of about kChunkNodes nodes, or fewer where the nodes are wide: a 2-level tree
  // of 1M classes has 1,001 nodes but 1M slots to check, which one chunk left to one thread.
  constexpr int64 kChunkNodes = int64{1} << 14, kChunkSlots = int64{1} << 15;
  const int64 chunks = std::min(M, std::max((M + kChunkNodes - 1) / kChunkNodes,
                                            (t.num_slots + kChunkSlots - 1) / kChunkSlots));
  auto chunk_first = [&](int64 c) { return c * M / chunks; };
  std::vector<unsigned char> seen(C, 0), ok(chunks, 0);
  std::vector<int64> class_children(chunks, 0), node_children(chunks, 0);
  run->assign(M, -1);
  parent->assign(M, -1);
  int64* run_of = run->data();
  int64* parent_of = parent->data();
  // Chunks only store to seen[] and parent[] entries that no other chunk stores to in a
  // well-formed tree; in a malformed one the stores may collide (relaxed atomics) and
  // the counts below reject it.
  parallel_for(chunks, kChunkSlots * 4, [&](int64 chunk_begin, int64 chunk_end) {
    for (int64 c = chunk_begin; c < chunk_end; ++c) {
      int64 classes = 0, nodes = 0;
      for (int64 n = chunk_first(c), n_end = chunk_first(c + 1); n < n_end; ++n) {
        const int64 begin = t.child_begin[n], end = t.child_begin[n + 1];
        if (begin < 0 || end <= begin || end > t.num_slots) return;
        const int64 first = t.slot_child[begin], K = end - begin;
        if (first >= 0 && first <= C - K) {
          bool apart = false;
          for (int64 s = begin; s < end; ++s) apart |= t.slot_child[s] != first + (s - begin);
          if (!apart) {
            for (int64 i = 0; i < K; ++i) __atomic_store_n(&seen[first + i], 1, __ATOMIC_RELAXED);
            run_of[n] = first;
            classes += K;
            continue;
          }
        }
        for (int64 s = begin; s < end; ++s) {
          const int64 code = t.slot_child[s];
          if (!ValidChild(t, n, code)) return;
          if (code < C) {
            __atomic_store_n(&seen[code], 1, __ATOMIC_RELAXED);
            ++classes;
          } else {
            __atomic_store_n(&parent_of[code - C], n, __ATOMIC_RELAXED);
            ++nodes;
          }
        }
      }
      class_children[c] = classes;
      node_children[c] = nodes;
      ok[c] = 1;
    }
  });
  if (std::memchr(ok.data(), 0, chunks) != nullptr || std::memchr(seen.data(), 0, C) != nullptr) {
    return false;
  }
  const int64 classes = std::accumulate(class_children.begin(), class_children.end(), int64{0});
  const int64 nodes = std::accumulate(node_children.begin(), node_children.end(), int64{0});
  return classes == C && nodes == M - 1;
}

// Puts the needed nodes in sweep order (by depth, ids increasing within a depth) from the
// walk's results in id order: depth and parent per node id (M of them), a run per needed
// node, `needed` per node id (nullptr: all). Takes over the walk's vectors.
void OrderSweepPlan(int64 M, bool full, bool by_depth, const std::vector<int64>& level_size,
                    std::vector<int64>* depth, std::vector<int64>* run_in_id_order,
                    std::vector<int64>* parent_node, const unsigned char* needed,
                    SweepPlan* plan) {
  // A counting sort, unless the ids are in that order already (breadth-first numbering, as
  // every builder's), when a node's position is its rank among the needed nodes, and with
  // every node needed its id.
  const int64 levels = static_cast<int64>(level_size.size());
  plan->level_begin.assign(levels + 1, 0);
  for (int64 d = 0; d < levels; ++d) plan->level_begin[d + 1] = plan->level_begin[d] + level_size[d];
  if (full && by_depth) {
    plan->node.resize(M);
    std::iota(plan->node.begin(), plan->node.end(), int64{0});
    plan->position = plan->node;
    plan->run.swap(*run_in_id_order);
    plan->parent.swap(*parent_node);  // positions are ids
    return;
  }
  const int64 count = plan->level_begin[levels];
  std::vector<int64> cursor(plan->level_begin.begin(), plan->level_begin.end() - 1);
  plan->node.assign(count, 0);
  plan->run.assign(count, -1);
  plan->parent.assign(count, -1);
  // position[n] takes over depth's storage: depth[n] is read just before it is replaced.
  plan->position.swap(*depth);
  std::vector<int64>& position = plan->position;
  for (int64 n = 0, i = 0; n < M; ++n) {
    if (needed != nullptr && !needed[n]) {
      position[n] = -1;
      continue;
    }
    const int64 q = by_depth ? i : cursor[position[n]]++;
    plan->node[q] = n;
    plan->run[q] = (*run_in_id_order)[i++];
    position[n] = q;
    if ((*parent_node)[n] >= 0) plan->parent[q] = position[(*parent_node)[n]];  // set: ids ascend
  }
}

// Finds the nodes needed for classes [class_begin, class_end) and checks every offset the
// sweep will read: each needed node's slot range and child codes, each child node numbered
// after its parent and reached once, each class of the range reached exactly once.
std::string BuildSweepPlan(const TreeView& t, int64 class_begin, int64 class_end,
                           const ParallelFor& parallel_for, SweepPlan* plan) {
  const int64 C = t.num_classes, M = t.num_nodes;
  const int64 width = class_end - class_begin;
  const bool full = class_begin == 0 && class_end == C;
  plan->class_begin = class_begin;
  plan->class_end = class_end;
  std::vector<int64> depth, run_in_id_order, parent_node;
  std::vector<int64> level_size;  // needed nodes per depth
  bool by_depth = true;  // the needed nodes' depths never decrease with their ids
  int64 last_depth = 0;
  // Counts a needed node of depth d, the needed nodes taken in id order.
  auto count_depth = [&](int64 d) {
    by_depth = by_depth && d >= last_depth;
    last_depth = d;
    if (d >= static_cast<int64>(level_size.size())) level_size.resize(d + 1, 0);
    ++level_size[d];
  };
  if (full && WalkWholeTree(t, parallel_for, &run_in_id_order, &parent_node)) {
    // Parents come first in id order, so one pass gives the depths; a node without a
    // parent (besides the root) means another was reached twice.
    depth.resize(M);
    depth[0] = 0;
    count_depth(0);
    bool reached = true;
    for (int64 n = 1; n < M; ++n) {
      const int64 pn = parent_node[n];
      reached = reached && pn >= 0;
      depth[n] = depth[pn < 0 ? 0 : pn] + 1;
      count_depth(depth[n]);
    }
    if (reached) {
      OrderSweepPlan(M, true, by_depth, level_size, &depth, &run_in_id_order, &parent_node,
                     nullptr, plan);
      return "";
    }
    level_size.clear();
    by_depth = true;
    last_depth = 0;
  }
  std::vector<unsigned char> needed(M, full ? 1 : 0);
  needed[0] = 1;
  if (!full) {
    for (int64 c = class_begin; c < class_end; ++c) {
      const int64 b = t.path_begin[c], e = t.path_begin[c + 1];
      if (b < 0 || e <= b || e > t.path_length) {
        return Message("malformed tree: path_begin[", c, ":", c + 2, "] = [", b, ", ", e,
                       "] is not a non-empty range within the ", t.path_length, " path steps");
      }
      for (int64 q = b; q < e; ++q) {
        const int64 n = t.path_nodes[q];
        if (n < 0 || n >= M) {
          return Message("malformed tree: path_nodes[", q, "] = ", n, " is not a node in [0, ",
                         M, ")");
        }
        needed[n] = 1;
      }
    }
  }
  // Walk the needed nodes in id order (parents first), giving each child its depth.
  depth.assign(M, -1);
  parent_node.assign(M, -1);
  run_in_id_order.clear();
  std::vector<unsigned char> seen(width, 0);
  run_in_id_order.reserve(full ? M : 0);
  depth[0] = 0;
  for (int64 n = 0; n < M; ++n) {
    if (!needed[n]) continue;
    if (depth[n] < 0) {
      return Message("malformed tree: node ", n,
                     " is not reached from the root through slot_child");
    }
    int64 begin = t.child_begin[n], end = t.child_begin[n + 1];
    if (begin < 0 || end <= begin || end > t.num_slots) return NodeRange(t, n, &begin, &end);
    count_depth(depth[n]);
    // The common leaf node, a run of consecutive classes of the range none of which was
    // seen before, is checked and marked as a block (branch-free compares, one memchr and
    // one memset); anything else, including a duplicate, takes the loop below.
    const int64 first = t.slot_child[begin], K = end - begin;
    if (first >= class_begin && first <= class_end - K) {
      bool apart = false;
      for (int64 s = begin; s < end; ++s) apart |= t.slot_child[s] != first + (s - begin);
      unsigned char* mark = seen.data() + (first - class_begin);
      if (!apart && std::memchr(mark, 1, K) == nullptr) {
        std::memset(mark, 1, K);
        run_in_id_order.push_back(first - class_begin);
        continue;
      }
    }
    // Not a run: either its children are not consecutive classes of the range, or one of
    // them was seen before, which the loop reports.
    for (int64 s = begin; s < end; ++s) {
      const int64 code = t.slot_child[s];
      if (!ValidChild(t, n, code)) return CheckChild(t, n, s, code);
      if (code < C) {
        if (code >= class_begin && code < class_end && seen[code - class_begin]++) {
          return Message("malformed tree: class ", code, " is the child of more than one slot");
        }
        continue;
      }
      const int64 m = code - C;
      if (!needed[m]) continue;
      if (depth[m] >= 0) {
        return Message("malformed tree: node ", m, " is the child of more than one slot");
      }
      depth[m] = depth[n] + 1;
      parent_node[m] = n;
    }
    run_in_id_order.push_back(-1);
  }
  if (const void* gap = std::memchr(seen.data(), 0, width)) {
    const int64 c = static_cast<const unsigned char*>(gap) - seen.data();
    return Message("malformed tree: class ", class_begin + c,
                   " is not reached from the root through slot_child");
  }
  OrderSweepPlan(M, full, by_depth, level_size, &depth, &run_in_id_order, &parent_node,
                 needed.data(), plan);
  return "";
}

// Groups of the plan below level L, each of L's nodes a group, when the groups' values fit
// kGroupValueBudget for row blocks of `block` rows and every group's nodes are consecutive
// on every level; false otherwise.
bool GroupBelow(const SweepPlan& plan, int64 L, int64 block, SubtreeGroups* groups) {
  const int64 levels = static_cast<int64>(plan.level_begin.size()) - 1;
  const auto& lb = plan.level_begin;
  const int64 G = lb[L + 1] - lb[L], span = levels - L;
  std::vector<int64> begin(G * span, 0), end(G * span, 0);
  int64 cap = 1;
  for (int64 g = 0; g < G; ++g) {
    begin[g * span] = lb[L] + g;
    end[g * span] = lb[L] + g + 1;
  }
  // Level by level, the parents of a level's nodes in position order must not go back:
  // then each group's nodes follow its parents', and g, the group whose range on the
  // level above holds the parent, only moves forward.
  for (int64 i = 1; i < span; ++i) {
    for (int64 q = lb[L + i], g = 0, last_parent = -1; q < lb[L + i + 1]; ++q) {
      const int64 parent = plan.parent[q];
      if (parent < last_parent) return false;
      last_parent = parent;
      while (end[g * span + i - 1] <= parent) ++g;  // the parent is on level L + i - 1
      if (begin[g * span + i] == end[g * span + i]) begin[g * span + i] = end[g * span + i] = q;
      end[g * span + i] = q + 1;
      cap = std::max(cap, q + 1 - begin[g * span + i]);
    }
  }
  if (2 * cap * block > kGroupValueBudget) return false;
  groups->level = L;
  groups->span = span;
  groups->cap = cap;
  groups->begin.swap(begin);
  groups->end.swap(end);
  return true;
}

// Finds the subtree groups for row blocks of `block` rows, if any: L is the first level
// with two levels below it and at least kMinGroups nodes, and enough that groups of equal
// width would take half the budget on the widest level below (larger groups read longer
// runs of weight rows per level; 1/4 measured 8% slower on a 1M-class binary tree);
// subtrees are not equal, so up to two levels further down are tried too.
void FindSubtreeGroups(const SweepPlan& plan, int64 block, SubtreeGroups* groups) {
  constexpr int64 kMinGroups = 64;
  const int64 levels = static_cast<int64>(plan.level_begin.size()) - 1;
  const auto& lb = plan.level_begin;
  int64 widest = 0;
  for (int64 d = 0; d < levels; ++d) widest = std::max(widest, lb[d + 1] - lb[d]);
  const int64 cap_goal = std::max<int64>(1, kGroupValueBudget / (4 * block));
  int64 L = 1;
  while (L + 2 < levels && lb[L + 1] - lb[L] < std::max(kMinGroups, widest / cap_goal)) ++L;
  for (int64 tries = 0; tries < 3 && L + 2 < levels; ++tries, ++L) {
    if (GroupBelow(plan, L, block, groups)) return;
  }
}

// The plan's value rows: levels above the split level (all levels without groups) share
// rows across the tree, those below it rows within their group (2 * cap of them).
void AssignValueRows(const SubtreeGroups& groups, SweepPlan* plan) {
  const int64 levels = static_cast<int64>(plan->level_begin.size()) - 1;
  const int64 shared = groups.level < 0 ? levels : groups.level + 1;
  const auto& lb = plan->level_begin;
  int64 widest = 0;
  for (int64 d = 0; d < shared; ++d) widest = std::max(widest, lb[d + 1] - lb[d]);
  plan->value_row.resize(lb[levels]);
  plan->value_rows = 0;
  for (int64 d = 0; d < shared; ++d) {
    for (int64 q = lb[d]; q < lb[d + 1]; ++q) {
      plan->value_row[q] = q - lb[d] + (d % 2) * widest;
      plan->value_rows = std::max(plan->value_rows, plan->value_row[q] + 1);
    }
  }
  for (int64 g = 0; g < groups.count(); ++g) {
    for (int64 i = 1; i < groups.span; ++i) {
      const int64 d = groups.level + i, b = groups.begin[g * groups.span + i];
      for (int64 q = b; q < groups.end[g * groups.span + i]; ++q) {
        plan->value_row[q] = q - b + (d % 2) * groups.cap;
      }
    }
  }
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
  const T* hp = nullptr;  // the unpacked kernels
  T* exps = Grow(&s.exps, std::max(kSlotTile, nt * simd::Vec<T>::kWidth));
  T* row_max = Grow(&s.row_max, nt);
  T* row_sum = Grow(&s.row_sum, nt);
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
    for (int64 i = 0; i < nt; ++i) {
      row_max[i] = -std::numeric_limits<T>::infinity();
      row_sum[i] = 0;
    }
    // When they fit, all the node's logits stay in scratch (ld = K); otherwise each tile's
    // raw logits are parked at their destinations and finished once the logsumexp is known.
    const bool kept = nt * K <= kKeepLogits;
    T* zs = kept ? Grow(&s.z, nt * K) : Grow(&s.z, nt * kSlotTile);
    const bool small = K <= simd::Vec<T>::kWidth;
    if (small) {
      Logits(p, rows, nt, first, K, hp, zs, K);
      SmallNodeLogSumExp(zs, nt, K, K, exps, lse);
    }
    for (int64 k0 = 0; k0 < K && !small; k0 += kSlotTile) {
      const int64 kb = std::min(kSlotTile, K - k0);
      T* tile = kept ? zs + k0 : zs;
      const int64 ld = kept ? K : kb;
      Logits(p, rows, nt, first + k0, kb, hp, tile, ld);
      for (int64 i = 0; i < nt; ++i) FoldLogSumExp(tile + i * ld, kb, &row_max[i], &row_sum[i]);
      if (kept) continue;
      for (int64 i = 0; i < nt; ++i) {
        const T* zi = tile + i * kb;
        if (run >= 0) {
          std::memcpy(out + (it.row + i) * width + run + k0, zi, kb * sizeof(T));
          continue;
        }
        for (int64 j = 0; j < kb; ++j) {
          T* o = target(codes[k0 + j], i);
          if (o != nullptr) *o = zi[j];
        }
      }
    }
    if (!small) {
      for (int64 i = 0; i < nt; ++i) lse[i] = row_max[i] + std::log(row_sum[i]);
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
void SweepItemRowsInLanes(const TreeView& t, const SoftmaxParams<T>& p, const SweepPlan& plan,
                          const SweepItem& it, const T* block_panels, int64 stride,
                          const T* values, T* child_values, T* out, int64 width, bool stream) {
  typedef simd::VecT<T> V;
  constexpr int64 w = simd::Vec<T>::kWidth;
  constexpr int64 kMaxGroups = kBlockRows / w;
  const T ninf = -std::numeric_limits<T>::infinity();
  Scratch<T>& s = ThreadScratch<T>();
  const int64 nt = it.rows, groups = (nt + w - 1) / w, ld = groups * w;
  const int64 tail = nt - (groups - 1) * w;  // rows of the last group
  auto group_rows = [&](int64 g) { return g + 1 < groups ? w : tail; };
  auto load_rows = [&](const T* src, int64 g) {
    return group_rows(g) == w ? simd::Load(src + g * w) : simd::LoadPartial(src + g * w, tail);
  };
  auto store_rows = [&](T* dst, int64 g, V v) {
    if (group_rows(g) == w) {
      simd::Store(dst + g * w, v);
    } else {
      simd::StorePartial(dst + g * w, v, tail);
    }
  };
  // The item's rows start a row group (it.row is a multiple of kSplitRows), so they are
  // the block's panels from that group on.
  const T* hp = block_panels + it.row / w * p.dim * w;
  T* lse = Grow(&s.lse, ld);          // per row, for the transposed run writes
  T* parent_row = Grow(&s.row_max, ld);
  T* stage = stream ? Grow(&s.stage, w * kStageColumns) : nullptr;  // row-major pieces
  T* out_rows = out + it.row * width;
  const int64 C = t.num_classes;
  // Class values go straight to their output columns, a scalar store per row, unless the
  // item gathers them: when its class children are not all runs (a binary tree's nodes
  // each hold one or two classes, often in decreasing order) yet together cover consecutive
  // classes [gather_lo, gather_lo + gather_count) (as a frequency-ordered Huffman tree's
  // do), their values are put slot-major into `gathered`, a vector per row group, and the
  // range is written at the end like a run: transposed in registers and, for a large
  // output, streamed. Items holding a node whose logits are not all kept park raw values
  // in the output (see below), so they write directly.
  bool gather = false;
  int64 gather_lo = 0, gather_count = 0;
  T* gathered = nullptr;
  {
    int64 lo = plan.class_end, hi = plan.class_begin - 1, count = 0;
    bool scattered = false, kept_all = true;
    for (int64 q = it.first; q < it.last; ++q) {
      const int64 n = plan.node[q], b = t.child_begin[n], e = t.child_begin[n + 1];
      kept_all = kept_all && (e - b) * ld <= kKeepLogits;
      if (plan.run[q] >= 0) {  // classes class_begin + run, ... (no need to read them)
        lo = std::min(lo, plan.class_begin + plan.run[q]);
        hi = std::max(hi, plan.class_begin + plan.run[q] + (e - b) - 1);
        count += e - b;
        continue;
      }
      const int64 before = count;
      for (int64 sl = b; sl < e; ++sl) {
        const int64 code = t.slot_child[sl];
        if (code >= plan.class_begin && code < plan.class_end) {
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
      gather = true;
      gather_lo = lo;
      gather_count = count;
      gathered = Grow(&s.class_values, count * ld);
    }
  }

  // One node's children and the values that finish them: parent + (logit - lse).
  struct Node {
    const int64* codes;
    int64 run;
    V parent[kMaxGroups], lse[kMaxGroups];
  };
  auto start = [&](int64 q, Node* node) {
    const int64 n = plan.node[q];
    node->codes = t.slot_child + t.child_begin[n];
    node->run = plan.run[q];
    for (int64 g = 0; g < groups; ++g) node->parent[g] = load_rows(values + plan.value_row[q] * stride + it.row, g);
  };
  auto set_lse = [&](Node* node, const V* m, const V* sum) {
    for (int64 g = 0; g < groups; ++g) {
      node->lse[g] = m[g] + simd::LogVec(sum[g]);
      simd::Store(lse + g * w, node->lse[g]);
      simd::Store(parent_row + g * w, node->parent[g]);
    }
  };
  // Children j, ..., j + cols - 1 (cols <= kWidth) of the node for row group g, from their
  // logits zt[j' * ld + row], transposed in registers: put(row, v) gets them as lanes
  // [0, cols) of v.
  auto transposed = [&](const T* zt, int64 g, int64 j, int64 cols, auto&& put) {
    V block[w];
    for (int64 c = 0; c < w; ++c) block[c] = c < cols ? simd::Load(zt + (j + c) * ld + g * w) : V{};
    simd::Transpose<T>(block);
    for (int64 r = 0; r < group_rows(g); ++r) put(g * w + r, block[r]);
  };
  // The finished values of children [j0, j0 + kb) of a run node, a row group and
  // kStageColumns columns at a time: transposed into a row-major stage, then each row's
  // piece streamed out. Streamed stores that hop to another output row after every line
  // measured only 1.15x faster than ordinary ones (whose lines are first read for
  // ownership); runs of 4 or more lines per row, 2.3x, and the longer the runs the less
  // the stores wait. Blocks after the first start where row 0's output starts a line.
  auto emit_streamed = [&](const Node& node, const T* zt, int64 j0, int64 kb, bool finish) {
    const int64 misaligned =
        static_cast<int64>(reinterpret_cast<std::uintptr_t>(out_rows + node.run + j0) % 64 / sizeof(T));
    const int64 to_line = (w - misaligned) % w;
    for (int64 g = 0; g < groups; ++g) {
      for (int64 cb = 0, ce = to_line == 0 ? kStageColumns : to_line + kStageColumns - w; cb < kb;
           cb = ce, ce += kStageColumns) {
        const int64 n = std::min(ce, kb) - cb;
        for (int64 jb = 0; jb < n; jb += w) {
          transposed(zt, g, cb + jb, std::min(w, n - jb), [&](int64 row, V v) {
            simd::Store(stage + (row - g * w) * kStageColumns + jb, finish ? parent_row[row] + (v - lse[row]) : v);
          });
        }
        for (int64 r = 0; r < group_rows(g); ++r) {
          simd::CopyStreaming(out_rows + (g * w + r) * width + node.run + j0 + cb,
                              stage + r * kStageColumns, n);
        }
      }
    }
  };
  // Writes value v of child `code` for row group g: to the child node's row of
  // `child_values` (when it is on a path to the class range), or for a class of the range
  // to its gathered vectors or else its output column.
  auto put_child = [&](int64 code, int64 g, V v) {
    if (code >= C) {
      const int64 position = plan.position[code - C];
      if (position >= 0) store_rows(child_values + plan.value_row[position] * stride + it.row, g, v);
    } else if (code >= plan.class_begin && code < plan.class_end) {
      if (gather) {
        simd::Store(gathered + (code - gather_lo) * ld + g * w, v);
        return;
      }
      T* o = out_rows + (code - plan.class_begin);
      for (int64 r = 0; r < group_rows(g); ++r) o[(g * w + r) * width] = v[r];
    }
  };
  // What zt holds for emit: the node's logits, to be finished into its values; raw logits
  // parked at their destinations, finished in place later (so never streamed past the
  // caches); or final values (an item's gathered classes).
  enum Emitted { kLogits, kParked, kFinal };
  // Writes the values of children [j0, j0 + kb) of the node from zt[(j - j0) * ld + r].
  auto emit = [&](const Node& node, const T* zt, int64 j0, int64 kb, Emitted what) {
    const bool finish = what == kLogits;
    auto value = [&](V z, int64 g) { return finish ? node.parent[g] + (z - node.lse[g]) : z; };
    if (node.run >= 0 && !gather && what != kParked && stream && kb >= kStreamMinColumns) {
      emit_streamed(node, zt, j0, kb, finish);
      return;
    }
    if (node.run >= 0 && !gather) {
      // Blocks of kWidth children, transposed in registers into pieces of output rows.
      for (int64 g = 0; g < groups; ++g) {
        for (int64 jb = 0; jb < kb; jb += w) {
          const int64 cols = std::min(w, kb - jb);
          transposed(zt, g, jb, cols, [&](int64 row, V v) {
            if (finish) v = parent_row[row] + (v - lse[row]);
            T* o = out_rows + row * width + node.run + j0 + jb;
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
      const T* zj = zt + j * ld;
      for (int64 g = 0; g < groups; ++g) put_child(node.codes[j0 + j], g, value(simd::Load(zj + g * w), g));
    }
  };
  // The logits of weight rows [first, first + count) with their biases, into zt, asking
  // along the way for the rows up to a tile past them (the next nodes of a level are
  // stored next), each row once; and each row group's max when group_max is given.
  int64 prefetched = 0;
  // The products of the rows with `count` weight-like rows b (ldb = dim) plus `bias`, into
  // zt, asking for the weight rows [end, end + ahead) along the way (each row once).
  auto dots = [&](const T* b, int64 count, const T* bias, int64 end, int64 ahead, T* zt,
                  V* group_max) {
    const int64 ahead_begin = std::max(end, prefetched);
    prefetched = std::max(prefetched, std::min(end + ahead, t.num_slots));
    RowPanelDots<T, true>(hp, nt, b, p.dim, count, p.dim, zt, ld, p.weights + ahead_begin * p.dim,
                          std::max<int64>(0, prefetched - ahead_begin) * p.dim * static_cast<int64>(sizeof(T)),
                          bias, group_max);
  };
  auto logits = [&](int64 first, int64 count, T* zt, V* group_max) {
    dots(p.weights + first * p.dim, count, p.biases == nullptr ? nullptr : p.biases + first,
         first + count, kSlotTile, zt, group_max);
  };

  for (int64 q = it.first; q < it.last;) {
    const int64 n = plan.node[q];
    const int64 first = t.child_begin[n], K = t.child_begin[n + 1] - first;
    Node node;
    V m[kMaxGroups], sum[kMaxGroups];
    if (K == 2) {
      // A run of two-child nodes stored one after the other (a binary tree's levels). Their
      // softmax depends only on d = z1 - z0: log p0 = -softplus(d), log p1 = -softplus(-d),
      // with softplus(x) = max(x, 0) + log(1 + exp(-|x|)). So one dot product per node, with
      // the difference of its two weight rows, replaces two, and one exp and one log
      // replace two exps, a log and a max. d = +-inf gives the masked child -inf and the
      // other 0; a NaN d (both logits -inf, or a NaN) gives NaN to both, as the general
      // path does.
      int64 last = q + 1;
      while (last < it.last && last - q < kSlotTile && plan.node[last] == plan.node[last - 1] + 1 &&
             t.child_begin[plan.node[last] + 1] - t.child_begin[plan.node[last]] == 2) {
        ++last;
      }
      const int64 pairs = last - q, dim = p.dim;
      const T* wp = p.weights + first * dim;  // the run's 2 * pairs slots are consecutive
      T* diff = Grow(&s.pair_rows, pairs * dim);
      for (int64 i = 0; i < pairs; ++i) {
        for (int64 k = 0; k < dim; ++k) diff[i * dim + k] = wp[(2 * i + 1) * dim + k] - wp[2 * i * dim + k];
      }
      T* bias_diff = nullptr;
      if (p.biases != nullptr) {
        bias_diff = Grow(&s.pair_biases, pairs);
        for (int64 i = 0; i < pairs; ++i) bias_diff[i] = p.biases[first + 2 * i + 1] - p.biases[first + 2 * i];
      }
      T* zd = Grow(&s.z, pairs * ld);
      dots(diff, pairs, bias_diff, first + 2 * pairs, 2 * kSlotTile, zd, nullptr);
      const V zero = {};
      for (int64 i = 0; q < last; ++q, ++i) {
        start(q, &node);
        for (int64 g = 0; g < groups; ++g) {
          const V d = simd::Load(zd + i * ld + g * w);
          const V l = simd::LogOnePlusUnitVec(simd::ExpVec(d < zero ? d : -d));
          put_child(node.codes[0], g, node.parent[g] - ((d > zero ? d : zero) + l));
          put_child(node.codes[1], g, node.parent[g] - ((d < zero ? -d : zero) + l));
        }
      }
      continue;
    }
    if (K <= kSlotTile) {
      // A batch of small nodes stored one after the other: one logits pass, then each
      // node's max, sum and values (a NaN logit loses the max; the sum carries it).
      int64 last = q + 1, slots = K;
      for (; last < it.last && plan.node[last] == plan.node[last - 1] + 1; ++last) {
        const int64 k = t.child_begin[plan.node[last] + 1] - t.child_begin[plan.node[last]];
        // Two-child nodes always take the path above, so that a node's values do not
        // depend on the nodes batched with it (a class range's plan has fewer).
        if (k == 2 || slots + k > kSlotTile) break;
        slots += k;
      }
      T* zs = Grow(&s.z, slots * ld);
      logits(first, slots, zs, nullptr);
      for (; q < last; ++q) {
        const int64 b = t.child_begin[plan.node[q]], k = t.child_begin[plan.node[q] + 1] - b;
        const T* zn = zs + (b - first) * ld;
        start(q, &node);
        for (int64 g = 0; g < groups; ++g) {
          V mg = simd::Splat<T>(ninf), sg = {};
          for (int64 j = 0; j < k; ++j) {
            const V z = simd::Load(zn + j * ld + g * w);
            mg = z > mg ? z : mg;
          }
          for (int64 j = 0; j < k; ++j) sg += simd::ExpVec(simd::Load(zn + j * ld + g * w) - mg);
          m[g] = mg;
          sum[g] = sg;
        }
        set_lse(&node, m, sum);
        emit(node, zn, 0, k, kLogits);
      }
      continue;
    }
    start(q, &node);
    for (int64 g = 0; g < groups; ++g) {
      m[g] = simd::Splat<T>(ninf);
      sum[g] = V{};
    }
    // With every logit kept, each value is written once, finished; otherwise each tile's
    // raw logits are parked at their destinations and finished there at the end.
    const bool kept = K * ld <= kKeepLogits;
    T* zs = Grow(&s.z, (kept ? K : kSlotTile) * ld);
    for (int64 k0 = 0; k0 < K; k0 += kSlotTile) {
      const int64 kb = std::min(kSlotTile, K - k0);
      T* zt = kept ? zs + k0 * ld : zs;
      V tile_max[kMaxGroups];
      for (int64 g = 0; g < groups; ++g) tile_max[g] = simd::Splat<T>(ninf);
      logits(first + k0, kb, zt, tile_max);
      for (int64 g = 0; g < groups; ++g) {
        const T* zg = zt + g * w;
        const V new_max = tile_max[g] > m[g] ? tile_max[g] : m[g];
        const V scale = tile_max[g] > m[g] ? simd::ExpVec(m[g] - new_max) : simd::Splat<T>(1);
        V exps = {};
        for (int64 j = 0; j < kb; ++j) exps += simd::ExpVec(simd::Load(zg + j * ld) - new_max);
        sum[g] = sum[g] * scale;
        sum[g] += exps;
        m[g] = new_max;
      }
      if (!kept) emit(node, zt, k0, kb, kParked);
    }
    set_lse(&node, m, sum);
    ++q;
    if (kept) {
      emit(node, zs, 0, K, kLogits);
      continue;
    }
    // Finish the parked values in place.
    if (node.run >= 0) {
      for (int64 r = 0; r < nt; ++r) {
        T* o = out_rows + r * width + node.run;
        for (int64 j = 0; j < K; ++j) o[j] = parent_row[r] + (o[j] - lse[r]);
      }
      continue;
    }
    for (int64 j = 0; j < K; ++j) {
      const int64 code = node.codes[j];
      if (code >= C) {
        const int64 position = plan.position[code - C];
        if (position < 0) continue;
        T* dst = child_values + plan.value_row[position] * stride + it.row;
        for (int64 g = 0; g < groups; ++g) store_rows(dst, g, node.parent[g] + (load_rows(dst, g) - node.lse[g]));
      } else if (code >= plan.class_begin && code < plan.class_end) {
        T* o = out_rows + (code - plan.class_begin);
        for (int64 r = 0; r < nt; ++r) o[r * width] = parent_row[r] + (o[r * width] - lse[r]);
      }
    }
  }
  if (gather) {
    // The gathered classes, final values, written as one run.
    Node range;
    range.run = gather_lo - plan.class_begin;
    gather = false;  // so that emit writes the range as a run
    emit(range, gathered, 0, gather_count, kFinal);
  }
  if (stream) simd::StreamFence();  // before another thread reads the output
}

// ---------------------------------------------------------------------------------------
// LogProbCandidates helpers.
// ---------------------------------------------------------------------------------------

struct CandidateItem {
  int64 group;
  int64 first;  // unique rows [first, first + count) of the group
  int64 count;
};

// Rows per TopK work item. The rows of an item share each node's pass over its weights, so
// where those passes stream from memory, larger items read less of the table (64 rows,
// 2-level tree over 1M classes, D = 64: 2,032 node passes in 16-row items, 1,516 in
// 32-row items, 974 in one item), but an item is one thread's work: half the rows, within
// [kMinSearchRows, kMaxSearchRows], keeps two items from 32 rows on. Small nodes gain
// little from the sharing (a binary tree's are two rows) and searches of more rows expand
// more of them, so trees whose nodes average under kShareBytes of weights keep the
// smallest items. Neither depends on threads, nor then does num_expanded.
constexpr int64 kShareBytes = int64{1} << 15;

int64 SearchRowsPerItem(const TreeView& t, int64 dim, int64 elem_bytes, int64 num_rows) {
  const int64 mean_node_bytes = t.num_slots / std::max<int64>(1, t.num_nodes) * dim * elem_bytes;
  if (mean_node_bytes < kShareBytes) return kMinSearchRows;
  return std::min(kMaxSearchRows, std::max(kMinSearchRows, (num_rows + 1) / 2));
}

}  // namespace

template <typename T>
std::string TopK(const TreeView& tree, const SoftmaxParams<T>& p, int64 num_rows, int64 k,
                 const ParallelFor& parallel_for, T* log_probs, int64* classes,
                 int64* num_expanded) {
  std::string err = CheckSizes(tree, num_rows, p.dim, true);
  if (!err.empty()) return err;
  if (k < 1 || k > tree.num_classes) {
    return Message("k = ", k, " must be in [1, num_classes] = [1, ", tree.num_classes, "]");
  }
  const int64 per_item = SearchRowsPerItem(tree, p.dim, sizeof(T), num_rows);
  const int64 items = (num_rows + per_item - 1) / per_item;
  std::vector<std::string> errors(items);
  const int64 root_slots = std::max<int64>(1, std::min<int64>(tree.num_slots, 1 << 12));
  const int64 cost = per_item * (p.dim + 8) * root_slots * 4;
  parallel_for(items, cost, [&](int64 begin, int64 end) {
    for (int64 i = begin; i < end; ++i) {
      const int64 row0 = i * per_item;
      errors[i] = SearchRows(tree, p, k, row0, std::min(per_item, num_rows - row0),
                             log_probs, classes, num_expanded);
    }
  });
  return FirstError(errors);
}

template <typename T>
std::string LogProbAll(const TreeView& tree, const SoftmaxParams<T>& p, int64 num_rows,
                       int64 class_begin, int64 class_end, const ParallelFor& parallel_for,
                       T* out, SweepPlanCache* cache) {
  std::string err = CheckSizes(tree, num_rows, p.dim, true);
  if (!err.empty()) return err;
  if (class_begin < 0 || class_end < class_begin || class_end > tree.num_classes) {
    return Message("class_range = [", class_begin, ", ", class_end,
                   ") must satisfy 0 <= begin <= end <= num_classes = ", tree.num_classes);
  }
  const int64 width = class_end - class_begin;
  if (width == 0 || num_rows == 0) return "";
  // Rows per block: up to 64, fewer when the node values would take more than
  // kNodeValueBudget (every block reads the whole table).
  // The kernel is chosen by the batch size alone, so that a row's values do not depend
  // on the blocks and tiles around it (a chunk equals the slice of the full result).
  const bool packed = num_rows >= kPackMinRows;
  int64 block = std::min(num_rows, kBlockRows);
  const bool whole_tree = class_begin == 0 && class_end == tree.num_classes;
  std::shared_ptr<const SweepPlanCache::Entry> planned;
  if (cache != nullptr && whole_tree) {
    planned = cache->Get();
    if (planned != nullptr && !PlanFits(*planned, tree, packed, block, parallel_for)) {
      planned = nullptr;
    }
  }
  if (planned == nullptr) {
    auto fresh = std::make_shared<SweepPlanCache::Entry>();
    err = BuildSweepPlan(tree, class_begin, class_end, parallel_for, &fresh->plan);
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
    planned = std::move(fresh);
  }
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
  // Work items of the group sweep: groups [group_items[i], group_items[i + 1]), about
  // kGroupItems of them, cut where the groups' weight rows (counted as the slots from a
  // level's first node to its last; the nodes are consecutive) reach equal shares.
  std::vector<int64> group_items = {0};
  int64 group_work = 0;  // slot-dimensions below the split level
  {
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
    group_work = total * (p.dim + 4);
    for (int64 g = 0, sum = 0; g < G; ++g) {
      sum += slots[g];
      const int64 share = static_cast<int64>(group_items.size());
      if (sum * kGroupItems >= share * total || g + 1 == G) group_items.push_back(g + 1);
    }
  }
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

template <typename T>
std::string Sample(const TreeView& tree, const SoftmaxParams<T>& p, int64 num_rows,
                   std::uint64_t seed, T temperature, const ParallelFor& parallel_for,
                   int64* classes) {
  std::string err = CheckSizes(tree, num_rows, p.dim, true);
  if (!err.empty()) return err;
  if (!(temperature > 0) || std::isinf(temperature)) {
    return Message("temperature = ", temperature, " must be positive and finite");
  }
  const int64 items = (num_rows + kSampleRows - 1) / kSampleRows;
  std::vector<std::string> errors(items);
  const int64 root_slots = std::max<int64>(1, std::min<int64>(tree.num_slots, 1 << 12));
  const int64 cost = kSampleRows * (p.dim + 8) * root_slots * 4;
  parallel_for(items, cost, [&](int64 begin, int64 end) {
    for (int64 i = begin; i < end; ++i) {
      const int64 row0 = i * kSampleRows;
      errors[i] = SampleRows(tree, p, seed, temperature, row0,
                             std::min(kSampleRows, num_rows - row0), classes);
    }
  });
  return FirstError(errors);
}

template <typename T>
std::string LogProbCandidates(const TreeView& tree, const SoftmaxParams<T>& p,
                              int64 num_rows, const int64* candidates, int64 num_candidates,
                              const ParallelFor& parallel_for, T* out) {
  std::string err = CheckSizes(tree, num_rows, p.dim, false);
  if (!err.empty()) return err;
  if (num_candidates < 0) return Message("invalid number of candidates ", num_candidates);
  const int64 total = num_rows * num_candidates;
  for (int64 i = 0; i < total; ++i) {
    const int64 c = candidates[i];
    if (c < 0 || c >= tree.num_classes) {
      return Message("candidates[", i / num_candidates, ", ", i % num_candidates, "] = ", c,
                     " is not a class id in [0, ", tree.num_classes,
                     ") (indices over hidden's flattened leading dimensions)");
    }
  }
  // Candidate (row, m) is token row * num_candidates + m of a visit plan, whose groups
  // then hold each node's visits in row order.
  VisitPlan plan;
  err = BuildVisitPlan(tree, candidates, total, &plan);
  if (!err.empty()) return err;
  const int64 G = plan.num_groups();
  // Distinct rows of each group and the entries of each.
  std::vector<int64> group_first(G + 1, 0), urow, urow_entry;
  for (int64 g = 0; g < G; ++g) {
    group_first[g] = static_cast<int64>(urow.size());
    for (int64 e = plan.group_begin[g]; e < plan.group_begin[g + 1]; ++e) {
      const int64 row = plan.entry_token[e] / num_candidates;
      if (e == plan.group_begin[g] || row != urow.back()) {
        urow.push_back(row);
        urow_entry.push_back(e);
      }
    }
  }
  group_first[G] = static_cast<int64>(urow.size());
  urow_entry.push_back(static_cast<int64>(plan.entry_token.size()));

  std::vector<CandidateItem> items;
  int64 work = 0;
  for (int64 g = 0; g < G; ++g) {
    const int64 n = plan.group_node[g];
    const int64 K = tree.child_begin[n + 1] - tree.child_begin[n];
    const int64 u = group_first[g + 1] - group_first[g];
    for (int64 o = 0; o < u; o += kCandidateRows) items.push_back({g, o, std::min(kCandidateRows, u - o)});
    work += u * K * (p.dim + 4);
  }
  std::vector<T> entry_value(plan.entry_token.size());
  const int64 cost = items.empty() ? 0 : 2 * work / static_cast<int64>(items.size());
  parallel_for(static_cast<int64>(items.size()), cost, [&](int64 begin, int64 end) {
    Scratch<T>& s = ThreadScratch<T>();
    for (int64 i = begin; i < end; ++i) {
      const CandidateItem& it = items[i];
      const int64 n = plan.group_node[it.group];
      const int64 first = tree.child_begin[n], K = tree.child_begin[n + 1] - first;
      const int64 u0 = group_first[it.group] + it.first;
      const T** rows = Grow(&s.rows, it.count);
      for (int64 r = 0; r < it.count; ++r) rows[r] = p.hidden + urow[u0 + r] * p.dim;
      T* tile = Grow(&s.z, it.count * kSlotTile);
      T* row_max = Grow(&s.row_max, it.count);
      T* row_sum = Grow(&s.row_sum, it.count);
      for (int64 r = 0; r < it.count; ++r) {
        row_max[r] = -std::numeric_limits<T>::infinity();
        row_sum[r] = 0;
      }
      // This item's entries by slot, so each tile hands out its taken logits in one sweep.
      std::vector<std::pair<int64, int64>>& taken = s.taken;  // (slot, entry)
      taken.clear();
      for (int64 e = urow_entry[u0]; e < urow_entry[u0 + it.count]; ++e) {
        taken.push_back({plan.entry_slot[e], e});
      }
      std::sort(taken.begin(), taken.end());
      size_t next = 0;
      const T* hp = PackedRows(rows, it.count, p.dim, it.count >= kPackMinRows);
      for (int64 k0 = 0; k0 < K; k0 += kSlotTile) {
        const int64 kb = std::min(kSlotTile, K - k0);
        Logits(p, rows, it.count, first + k0, kb, hp, tile, kb);
        for (; next < taken.size() && taken[next].first < first + k0 + kb; ++next) {
          const int64 e = taken[next].second;
          const int64 r = std::upper_bound(urow_entry.begin() + u0, urow_entry.begin() + u0 + it.count, e) -
                          (urow_entry.begin() + u0) - 1;
          entry_value[e] = tile[r * kb + taken[next].first - first - k0];
        }
        for (int64 r = 0; r < it.count; ++r) FoldLogSumExp(tile + r * kb, kb, &row_max[r], &row_sum[r]);
      }
      for (int64 r = 0; r < it.count; ++r) {
        const T lse = row_max[r] + std::log(row_sum[r]);
        for (int64 e = urow_entry[u0 + r]; e < urow_entry[u0 + r + 1]; ++e) entry_value[e] -= lse;
      }
    }
  });
  // Sum each candidate's steps root first (entries are stored level by level).
  std::fill(out, out + total, T(0));
  for (size_t e = 0; e < plan.entry_token.size(); ++e) out[plan.entry_token[e]] += entry_value[e];
  return "";
}

#define TF_HSM_INSTANTIATE(T)                                                               \
  template std::string TopK<T>(const TreeView&, const SoftmaxParams<T>&, int64, int64,       \
                               const ParallelFor&, T*, int64*, int64*);                      \
  template std::string LogProbAll<T>(const TreeView&, const SoftmaxParams<T>&, int64, int64, \
                                     int64, const ParallelFor&, T*, SweepPlanCache*);        \
  template std::string Sample<T>(const TreeView&, const SoftmaxParams<T>&, int64,           \
                                 std::uint64_t, T, const ParallelFor&, int64*);              \
  template std::string LogProbCandidates<T>(const TreeView&, const SoftmaxParams<T>&, int64, \
                                            const int64*, int64, const ParallelFor&, T*);
TF_HSM_INSTANTIATE(float)
TF_HSM_INSTANTIATE(double)
#undef TF_HSM_INSTANTIATE

}  // namespace tf_hsm
