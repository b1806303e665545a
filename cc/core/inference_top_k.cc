// TopK (see inference.h): best-first search over the tree, rows searched in groups that
// share each expanded node's pass over its weights.
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "cc/core/inference.h"
#include "cc/core/inference_common.h"
#include "cc/core/inference_flat.h"

namespace tf_hsm {
namespace inference_internal {
namespace {

constexpr int64 kMinSearchRows = 16;  // rows one TopK work item searches together:
constexpr int64 kMaxSearchRows = 64;  //   see SearchRowsPerItem

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

// Nodes of more than this many children are expanded without keeping the rows' logits
// (ExpandWide): kept, they would leave room for fewer than kMinSearchRows rows, and each
// batch of rows reads the node's weights once more (a flat tree at V = 1M read its 1.2 GB
// table once per row).
constexpr int64 kWideExpandSlots = kLogitBudget / kMinSearchRows;

// Expands the wide node of slots [begin, begin + K) for the records recs, all their rows
// together in two passes over the node's weights: the log-sum-exps, then the logits again
// tile by tile, each tile's children pushed as they come. PushChildren sees the children
// in slot order, in slices that start at whole vector blocks, so it queues exactly what
// it queues given all K logits at once.
template <typename T>
void ExpandWide(SearchScratch<T>* ss, const TreeView& t, const SoftmaxParams<T>& p,
                int64 row0, const std::vector<int64>& recs, int64 begin, int64 K, int64 k) {
  Scratch<T>& s = ThreadScratch<T>();
  const int64 nb = static_cast<int64>(recs.size());
  const T** rows = Grow(&s.rows, nb);
  for (int64 i = 0; i < nb; ++i) rows[i] = p.hidden + (row0 + ss->records[recs[i]].row) * p.dim;
  const T* packed = PackedRows(rows, nb, p.dim, nb >= kPackMinRows);
  T* z = Grow(&s.z, nb * kSlotTile);
  T* lse = Grow(&s.lse, nb);
  TiledLogSumExp(p, rows, nb, begin, K, packed, /*keep_all=*/false, z, lse,
                 [](const T*, int64, int64, int64) {});
  static_assert(kSlotTile % simd::Vec<T>::kWidth == 0, "tiles start at whole vector blocks");
  for (int64 k0 = 0; k0 < K; k0 += kSlotTile) {
    const int64 kb = std::min(kSlotTile, K - k0);
    Logits(p, rows, nb, begin + k0, kb, packed, z, kb);
    for (int64 i = 0; i < nb; ++i) {
      const int64 row = ss->records[recs[i]].row;  // copied: pushing may move the records
      const T value = ss->records[recs[i]].value;
      PushChildren(ss, row, value, z + i * kb, lse[i], t.slot_child + begin + k0, kb,
                   t.num_classes, k);
    }
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
          return tree_checks::ReachedTwice(t, *twice);
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
      if (K > kWideExpandSlots) {
        ExpandWide(&ss, t, p, row0, recs, begin, K, k);
        continue;
      }
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
}  // namespace inference_internal

template <typename T>
std::string TopK(const TreeView& tree, const SoftmaxParams<T>& p, int64 num_rows, int64 k,
                 const ParallelFor& parallel_for, T* log_probs, int64* classes,
                 int64* num_expanded) {
  using namespace inference_internal;
  std::string err = CheckSizes(tree, num_rows, p.dim, true);
  if (!err.empty()) return err;
  if (k < 1 || k > tree.num_classes) {
    return Message("k = ", k, " must be in [1, num_classes] = [1, ", tree.num_classes, "]");
  }
  if (k <= kFlatTopKMaxK && FlatPathFits(tree, num_rows)) {  // the exact softmax
    // In chunks of rows whose kept logits (8 partitions x (k + 8) a row) stay under 2^21.
    const int64 chunk = std::max(kPackMinRows, (int64{1} << 21) / (8 * (k + 8)));
    std::vector<int64> rows;
    for (int64 r0 = 0; r0 < num_rows; r0 += chunk) {
      SoftmaxParams<T> part = p;
      part.hidden = p.hidden + r0 * p.dim;
      const int64 n = std::min(chunk, num_rows - r0);
      // A last chunk of fewer than kPackMinRows rows takes the search (FlatPathFits).
      if (n < kPackMinRows) {
        for (int64 r = r0; r < num_rows; ++r) rows.push_back(r);
        break;
      }
      for (int64 r : FlatTopK(tree, part, n, k, parallel_for, log_probs + r0 * k,
                              classes + r0 * k, num_expanded + r0)) {
        rows.push_back(r0 + r);
      }
    }
    std::vector<std::string> errors(rows.size());
    parallel_for(static_cast<int64>(rows.size()), tree.num_slots * (p.dim + 8) * 4,
                 [&](int64 begin, int64 end) {
      for (int64 i = begin; i < end; ++i) {
        errors[i] = SearchRows(tree, p, k, rows[i], 1, log_probs, classes, num_expanded);
      }
    });
    return FirstError(errors);
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

template std::string TopK<float>(const TreeView&, const SoftmaxParams<float>&, int64, int64,
                                 const ParallelFor&, float*, int64*, int64*);
template std::string TopK<double>(const TreeView&, const SoftmaxParams<double>&, int64, int64,
                                  const ParallelFor&, double*, int64*, int64*);

}  // namespace tf_hsm
