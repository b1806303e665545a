#include "cc/core/inference.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>
#include <vector>

#include "cc/core/simd.h"
#include "cc/core/visit_plan.h"

namespace tf_hsm {
namespace {

constexpr int64 kSlotTile = 128;        // weight rows per logits tile (as in log_prob.cc)
constexpr int64 kSearchRows = 16;       // rows one TopK work item searches together
constexpr int64 kSampleRows = 64;       // rows one Sample work item walks together
constexpr int64 kBlockRows = 64;        // LogProbAll rows that share every weight block
constexpr int64 kSplitRows = 16;        // LogProbAll row tile when a level has few nodes
constexpr int64 kCandidateRows = 64;    // LogProbCandidates rows per work item
constexpr int64 kLogitBudget = int64{1} << 20;      // logits kept per expansion batch
constexpr int64 kNodeValueBudget = int64{1} << 24;  // LogProbAll node values per block
constexpr int64 kChunkWork = int64{1} << 15;        // LogProbAll: slots x (D + 4) per item

template <typename... Args>
std::string Message(const Args&... args) {
  std::ostringstream s;
  (s << ... << args);
  return s.str();
}

template <typename T>
T* Grow(std::vector<T>* v, int64 n) {
  if (static_cast<int64>(v->size()) < n) v->resize(n);
  return v->data();
}

// ---------------------------------------------------------------------------------------
// Shared numerics: logits tiles and the online logsumexp, in the order log_prob.cc uses.
// ---------------------------------------------------------------------------------------

// z[r * ld + j] = weights[first + j] . rows[r] + biases[first + j] for r < nr, j < kb.
template <typename T>
void Logits(const SoftmaxParams<T>& p, const T* const* rows, int64 nr, int64 first, int64 kb,
            T* z, int64 ld) {
  simd::DotRows<T>(rows, nr, p.weights + first * p.dim, p.dim, kb, p.dim, z, ld);
  if (p.biases != nullptr) {
    const T* b = p.biases + first;
    for (int64 r = 0; r < nr; ++r)
      for (int64 j = 0; j < kb; ++j) z[r * ld + j] += b[j];
  }
}

// Folds n more logits into a running (max, sum of exp(z - max)). A NaN logit makes the
// sum NaN (the max ignores it), so NaN reaches exactly the rows it came from.
template <typename T>
void FoldLogSumExp(const T* z, int64 n, T* exps, T* row_max, T* row_sum) {
  T m = *row_max;
  T chunk_max = -std::numeric_limits<T>::infinity();
  for (int64 j = 0; j < n; ++j) chunk_max = z[j] > chunk_max ? z[j] : chunk_max;
  if (chunk_max > m) {
    *row_sum *= std::exp(m - chunk_max);
    m = chunk_max;
  }
  for (int64 j = 0; j < n; ++j) exps[j] = z[j] - m;
  simd::ExpInPlace(exps, n);
  T s = *row_sum;
  for (int64 j = 0; j < n; ++j) s += exps[j];
  *row_sum = s;
  *row_max = m;
}

// Per-thread scratch, grown on demand and reused across calls.
template <typename T>
struct Scratch {
  std::vector<T> z, lse, exps, row_max, row_sum;
  std::vector<const T*> rows;
};

template <typename T>
Scratch<T>& ThreadScratch() {
  thread_local Scratch<T> scratch;
  return scratch;
}

// All K logits of one node for nr rows, z[r * K + j], and (when lse != nullptr) their
// logsumexp per row, folded tile by tile.
template <typename T>
void NodeLogits(const SoftmaxParams<T>& p, const T* const* rows, int64 nr, int64 first,
                int64 K, T* z, T* lse) {
  Scratch<T>& s = ThreadScratch<T>();
  T* exps = Grow(&s.exps, kSlotTile);
  T* row_max = Grow(&s.row_max, nr);
  T* row_sum = Grow(&s.row_sum, nr);
  for (int64 r = 0; r < nr; ++r) {
    row_max[r] = -std::numeric_limits<T>::infinity();
    row_sum[r] = 0;
  }
  for (int64 k0 = 0; k0 < K; k0 += kSlotTile) {
    const int64 kb = std::min(kSlotTile, K - k0);
    Logits(p, rows, nr, first + k0, kb, z + k0, K);
    if (lse == nullptr) continue;
    for (int64 r = 0; r < nr; ++r) FoldLogSumExp(z + r * K + k0, kb, exps, &row_max[r], &row_sum[r]);
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

// Checks one child code of node n: a class in [0, C), or C + m for a node n < m < M.
std::string CheckChild(const TreeView& t, int64 n, int64 slot, int64 code) {
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
  for (int64 s = begin; s < end; ++s) {
    std::string err = CheckChild(t, n, s, t.slot_child[s]);
    if (!err.empty()) return err;
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
template <typename T>
struct Request {
  int64 node;
  int64 row;
  T value;  // the path log-probability of the node (TopK)
};

template <typename T>
void SortRequests(std::vector<Request<T>>* req) {
  std::sort(req->begin(), req->end(), [](const Request<T>& a, const Request<T>& b) {
    return a.node != b.node ? a.node < b.node : a.row < b.row;
  });
}

// ---------------------------------------------------------------------------------------
// TopK: best-first search.
// ---------------------------------------------------------------------------------------

template <typename T>
struct Entry {
  T value;     // log-probability of the path to this node or class
  int64 code;  // class c as c, node m as C + m
};

// True when a leaves the queue before b: larger value first and NaN last; at equal values
// nodes before classes (a node's subtree may hold a class of the same value, e.g. below a
// single-child node, with a smaller id), then increasing code. A strict total order, so
// the output never depends on the queue's history.
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
  std::vector<Request<T>> requests;
  std::vector<int64> seen;
};

template <typename T>
void PushChildren(RowSearch<T>* rs, T parent, const T* z, T lse, const int64* codes, int64 K,
                  int64 C, int64 k) {
  auto later = [C](const Entry<T>& a, const Entry<T>& b) { return Before(b, a, C); };
  auto earlier = [C](const Entry<T>& a, const Entry<T>& b) { return Before(a, b, C); };
  for (int64 j = 0; j < K; ++j) {
    const Entry<T> e{parent + (z[j] - lse), codes[j]};
    const bool full = static_cast<int64>(rs->best.size()) == k;
    if (full && CannotReach(e, rs->best.front(), C)) continue;
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
  }
}

// Searches rows [row0, row0 + nr) in rounds: each round every unfinished row moves its
// final classes to the output and asks for its best node to be expanded; the requests are
// grouped by node so rows at the same node share one pass over its weights. Which nodes a
// row expands, and in which order, is exactly that of a search of the row on its own.
template <typename T>
std::string SearchRows(const TreeView& t, const SoftmaxParams<T>& p, int64 k, int64 row0,
                       int64 nr, T* log_probs, int64* classes, int64* num_expanded) {
  const int64 C = t.num_classes, M = t.num_nodes;
  thread_local SearchScratch<T> ss;
  Scratch<T>& s = ThreadScratch<T>();
  if (static_cast<int64>(ss.rows.size()) < nr) ss.rows.resize(nr);
  auto later = [C](const Entry<T>& a, const Entry<T>& b) { return Before(b, a, C); };
  for (int64 r = 0; r < nr; ++r) {
    RowSearch<T>& rs = ss.rows[r];
    rs.queue.assign(1, Entry<T>{T(0), C});  // the root
    rs.best.clear();
    rs.found = rs.expanded = 0;
    rs.done = false;
  }
  std::vector<Request<T>>& req = ss.requests;
  for (;;) {
    req.clear();
    for (int64 r = 0; r < nr; ++r) {
      RowSearch<T>& rs = ss.rows[r];
      if (rs.done) continue;
      T* out_lp = log_probs + (row0 + r) * k;
      int64* out_cls = classes + (row0 + r) * k;
      while (!rs.queue.empty() && rs.queue.front().code < C) {
        std::pop_heap(rs.queue.begin(), rs.queue.end(), later);
        out_lp[rs.found] = rs.queue.back().value;
        out_cls[rs.found] = rs.queue.back().code;
        rs.queue.pop_back();
        if (++rs.found == k) break;
      }
      if (rs.found == k) {
        rs.done = true;
        num_expanded[row0 + r] = rs.expanded;
        // A class reached twice can only come from a malformed tree.
        std::vector<int64>& seen = ss.seen;
        seen.assign(out_cls, out_cls + k);
        std::sort(seen.begin(), seen.end());
        const auto twice = std::adjacent_find(seen.begin(), seen.end());
        if (twice != seen.end()) {
          return Message("malformed tree: class ", *twice,
                         " is the child of more than one slot");
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
      if (++rs.expanded > M) {
        return Message("malformed tree: the search expanded more than the ", M,
                       " internal nodes; some node is the child of more than one slot");
      }
      req.push_back({e.code - C, r, e.value});
    }
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
        T* lse = Grow(&s.lse, nb);
        NodeLogits(p, rows, nb, begin, K, z, lse);
        for (int64 i = 0; i < nb; ++i) {
          PushChildren(&ss.rows[req[b0 + i].row], req[b0 + i].value, z + i * K, lse[i],
                       t.slot_child + begin, K, C, k);
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------
// Sample: ancestral sampling with a counter-based generator.
// ---------------------------------------------------------------------------------------

// The splitmix64 finaliser: a bijection of 64-bit words that mixes every input bit.
inline std::uint64_t Mix64(std::uint64_t z) {
  z += 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

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
  thread_local std::vector<Request<T>> req;
  state.assign(nr, SampleState{0, 0, false});
  for (;;) {
    req.clear();
    for (int64 r = 0; r < nr; ++r)
      if (!state[r].done) req.push_back({state[r].node, r, T(0)});
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
        NodeLogits(p, rows, nb, begin, K, z, static_cast<T*>(nullptr));
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
  std::vector<int64> node;         // [P] needed nodes; position 0 is the root
  std::vector<int64> level_begin;  // [levels + 1] position ranges of equal depth
  std::vector<int64> dest_begin;   // [P] offset of the node's first slot in dest
  // Per child slot: c >= 0 writes output column c; -1 is not needed; -2 - q writes the
  // value of the node at position q.
  std::vector<int64> dest;
};

std::string BuildSweepPlan(const TreeView& t, int64 class_begin, int64 class_end,
                           SweepPlan* plan) {
  const int64 C = t.num_classes, M = t.num_nodes;
  const int64 width = class_end - class_begin;
  const bool full = class_begin == 0 && class_end == C;
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
  // Walk the needed nodes in id order (parents first): depth of each, and the slots'
  // destinations with child nodes still as -2 - node.
  std::vector<int64> depth(M, -1), offset(M, -1);
  std::vector<unsigned char> seen(width, 0);
  depth[0] = 0;
  int64 max_depth = 0, count = 0;
  plan->dest.clear();
  for (int64 n = 0; n < M; ++n) {
    if (!needed[n]) continue;
    if (depth[n] < 0) {
      return Message("malformed tree: node ", n,
                     " is not reached from the root through slot_child");
    }
    int64 begin, end;
    std::string err = NodeRange(t, n, &begin, &end);
    if (!err.empty()) return err;
    offset[n] = static_cast<int64>(plan->dest.size());
    ++count;
    for (int64 s = begin; s < end; ++s) {
      const int64 code = t.slot_child[s];
      err = CheckChild(t, n, s, code);
      if (!err.empty()) return err;
      int64 d = -1;
      if (code < C) {
        if (code >= class_begin && code < class_end) {
          if (seen[code - class_begin]++) {
            return Message("malformed tree: class ", code, " is the child of more than one slot");
          }
          d = code - class_begin;
        }
      } else if (needed[code - C]) {
        const int64 m = code - C;
        if (depth[m] >= 0) {
          return Message("malformed tree: node ", m, " is the child of more than one slot");
        }
        depth[m] = depth[n] + 1;
        max_depth = std::max(max_depth, depth[m]);
        d = -2 - m;
      }
      plan->dest.push_back(d);
    }
  }
  for (int64 c = 0; c < width; ++c) {
    if (!seen[c]) {
      return Message("malformed tree: class ", class_begin + c,
                     " is not reached from the root through slot_child");
    }
  }
  // Order by depth (a counting sort, ids increasing within a depth).
  plan->level_begin.assign(max_depth + 2, 0);
  for (int64 n = 0; n < M; ++n)
    if (needed[n]) ++plan->level_begin[depth[n] + 1];
  for (int64 d = 0; d <= max_depth; ++d) plan->level_begin[d + 1] += plan->level_begin[d];
  std::vector<int64> cursor(plan->level_begin.begin(), plan->level_begin.end() - 1);
  plan->node.assign(count, 0);
  plan->dest_begin.assign(count, 0);
  // position[n] reuses depth's storage: depth[n] is read just before it is replaced.
  std::vector<int64>& position = depth;
  for (int64 n = 0; n < M; ++n) {
    if (!needed[n]) continue;
    const int64 q = cursor[depth[n]]++;
    plan->node[q] = n;
    plan->dest_begin[q] = offset[n];
    position[n] = q;
  }
  for (int64& d : plan->dest)
    if (d <= -2) d = -2 - position[-2 - d];
  return "";
}

struct SweepItem {
  int64 first;  // positions [first, last)
  int64 last;
  int64 row;    // rows [row, row + rows) of the block
  int64 rows;
};

// Processes the nodes at positions [it.first, it.last) for some rows of a block:
// node values of those rows are in values[q * stride + row], the block's output rows in
// out[row * width + column].
template <typename T>
void SweepItemRun(const TreeView& t, const SoftmaxParams<T>& p, const SweepPlan& plan,
                  const SweepItem& it, const T* const* block_rows, int64 stride, T* values,
                  T* out, int64 width) {
  Scratch<T>& s = ThreadScratch<T>();
  const int64 nt = it.rows;
  const T* const* rows = block_rows + it.row;
  T* tile = Grow(&s.z, nt * kSlotTile);
  T* exps = Grow(&s.exps, kSlotTile);
  T* row_max = Grow(&s.row_max, nt);
  T* row_sum = Grow(&s.row_sum, nt);
  T* lse = Grow(&s.lse, nt);
  // Where slot destination d of row i goes.
  auto target = [&](int64 d, int64 i) -> T* {
    return d >= 0 ? out + (it.row + i) * width + d : values + (-2 - d) * stride + it.row + i;
  };
  for (int64 q = it.first; q < it.last; ++q) {
    const int64 n = plan.node[q];
    const int64 first = t.child_begin[n], K = t.child_begin[n + 1] - first;
    const int64* dest = plan.dest.data() + plan.dest_begin[q];
    const T* parent = values + q * stride + it.row;
    for (int64 i = 0; i < nt; ++i) {
      row_max[i] = -std::numeric_limits<T>::infinity();
      row_sum[i] = 0;
    }
    const bool one_tile = K <= kSlotTile;
    for (int64 k0 = 0; k0 < K; k0 += kSlotTile) {
      const int64 kb = std::min(kSlotTile, K - k0);
      Logits(p, rows, nt, first + k0, kb, tile, kb);
      for (int64 i = 0; i < nt; ++i) FoldLogSumExp(tile + i * kb, kb, exps, &row_max[i], &row_sum[i]);
      if (one_tile) break;
      // Several tiles: park the raw logits at their destinations, finish below.
      for (int64 i = 0; i < nt; ++i)
        for (int64 j = 0; j < kb; ++j)
          if (dest[k0 + j] != -1) *target(dest[k0 + j], i) = tile[i * kb + j];
    }
    for (int64 i = 0; i < nt; ++i) lse[i] = row_max[i] + std::log(row_sum[i]);
    for (int64 i = 0; i < nt; ++i) {
      for (int64 j = 0; j < K; ++j) {
        if (dest[j] == -1) continue;
        T* o = target(dest[j], i);
        const T z = one_tile ? tile[i * K + j] : *o;
        *o = parent[i] + (z - lse[i]);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------
// LogProbCandidates helpers.
// ---------------------------------------------------------------------------------------

struct CandidateItem {
  int64 group;
  int64 first;  // unique rows [first, first + count) of the group
  int64 count;
};

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
  const int64 items = (num_rows + kSearchRows - 1) / kSearchRows;
  std::vector<std::string> errors(items);
  const int64 root_slots = std::max<int64>(1, std::min<int64>(tree.num_slots, 1 << 12));
  const int64 cost = kSearchRows * (p.dim + 8) * root_slots * 4;
  parallel_for(items, cost, [&](int64 begin, int64 end) {
    for (int64 i = begin; i < end; ++i) {
      const int64 row0 = i * kSearchRows;
      errors[i] = SearchRows(tree, p, k, row0, std::min(kSearchRows, num_rows - row0),
                             log_probs, classes, num_expanded);
    }
  });
  return FirstError(errors);
}

template <typename T>
std::string LogProbAll(const TreeView& tree, const SoftmaxParams<T>& p, int64 num_rows,
                       int64 class_begin, int64 class_end, const ParallelFor& parallel_for,
                       T* out) {
  std::string err = CheckSizes(tree, num_rows, p.dim, true);
  if (!err.empty()) return err;
  if (class_begin < 0 || class_end < class_begin || class_end > tree.num_classes) {
    return Message("class_range = [", class_begin, ", ", class_end,
                   ") must satisfy 0 <= begin <= end <= num_classes = ", tree.num_classes);
  }
  const int64 width = class_end - class_begin;
  if (width == 0 || num_rows == 0) return "";
  SweepPlan plan;
  err = BuildSweepPlan(tree, class_begin, class_end, &plan);
  if (!err.empty()) return err;
  const int64 P = static_cast<int64>(plan.node.size());
  const int64 levels = static_cast<int64>(plan.level_begin.size()) - 1;

  // Node chunks of each level, of about kChunkWork slot-dimensions each.
  std::vector<int64> chunk_begin;      // position boundaries
  std::vector<int64> level_chunks(levels + 1, 0);  // chunk ranges per level
  std::vector<int64> chunk_work;
  for (int64 l = 0; l < levels; ++l) {
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
  level_chunks[levels] = static_cast<int64>(chunk_work.size());
  chunk_begin.push_back(P);

  int64 block = std::min(num_rows, kBlockRows);
  if (block * P > kNodeValueBudget) block = std::max<int64>(std::min<int64>(block, 4), kNodeValueBudget / P);
  std::vector<T> values(P * block);
  std::vector<const T*> rows(block);
  std::vector<SweepItem> items;
  for (int64 r0 = 0; r0 < num_rows; r0 += block) {
    const int64 nr = std::min(block, num_rows - r0);
    for (int64 i = 0; i < nr; ++i) rows[i] = p.hidden + (r0 + i) * p.dim;
    std::fill(values.begin(), values.begin() + nr, T(0));  // the root
    for (int64 l = 0; l < levels; ++l) {
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
          SweepItemRun(tree, p, plan, items[i], rows.data(), block, values.data(),
                       out + r0 * width, width);
        }
      });
    }
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
      T* exps = Grow(&s.exps, kSlotTile);
      T* row_max = Grow(&s.row_max, it.count);
      T* row_sum = Grow(&s.row_sum, it.count);
      for (int64 r = 0; r < it.count; ++r) {
        row_max[r] = -std::numeric_limits<T>::infinity();
        row_sum[r] = 0;
      }
      for (int64 k0 = 0; k0 < K; k0 += kSlotTile) {
        const int64 kb = std::min(kSlotTile, K - k0);
        Logits(p, rows, it.count, first + k0, kb, tile, kb);
        for (int64 r = 0; r < it.count; ++r) FoldLogSumExp(tile + r * kb, kb, exps, &row_max[r], &row_sum[r]);
      }
      for (int64 r = 0; r < it.count; ++r) {
        const T lse = row_max[r] + std::log(row_sum[r]);
        for (int64 e = urow_entry[u0 + r]; e < urow_entry[u0 + r + 1]; ++e) {
          T z;
          Logits(p, rows + r, 1, plan.entry_slot[e], 1, &z, 1);
          entry_value[e] = z - lse;
        }
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
                                     int64, const ParallelFor&, T*);                         \
  template std::string Sample<T>(const TreeView&, const SoftmaxParams<T>&, int64,           \
                                 std::uint64_t, T, const ParallelFor&, int64*);              \
  template std::string LogProbCandidates<T>(const TreeView&, const SoftmaxParams<T>&, int64, \
                                            const int64*, int64, const ParallelFor&, T*);
TF_HSM_INSTANTIATE(float)
TF_HSM_INSTANTIATE(double)
#undef TF_HSM_INSTANTIATE

}  // namespace tf_hsm
