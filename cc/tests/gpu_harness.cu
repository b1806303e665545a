// Standalone checks and timings of the CUDA kernels (cc/core/*.cu) against the CPU core
// (cc/core/*.cc, the code the CPU op runs), built by nvcc alone: no TensorFlow, no Bazel.
// See cc/gpu_harness.sh for how to build and run it.
//
// Correctness, for every case in float64 and float32:
//  - random trees of every kind (random mixed, balanced, two-level, Huffman binary and
//    4-ary on Zipf counts, frequency-clustered, chains of single-child nodes, one very wide
//    node), depths 1-10 (Huffman trees deeper), branching up to 100K;
//  - log_prob, dh, the sparse dW / db rows and row_ids against the CPU core run in float64
//    on the same values (row ids must match exactly);
//  - outputs are poisoned (a signalling-NaN pattern) with guard regions before and after,
//    and the workspace is filled with NaN bytes: every output element must be written,
//    nothing outside them, and no uninitialised scratch may reach a result;
//  - the same call twice gives the same bits; a small coefficient budget (many waves)
//    gives the same values; NaN in one token's hidden state stays in that token.
//  - LogProbCandidatesGpu against the CPU core's LogProbCandidates, and bit for bit against
//    the forward kernel for candidates equal to the target.
//  - inference (cc/core/inference_gpu.h): LogProbAllGpu against the CPU core's LogProbAll in
//    float64 to tolerance, a random class_range in waves of one row bit for bit against the
//    full table; SampleGpu against the CPU core's Sample in the same precision with the same
//    seed (classes equal but for at most 1 + 1% of rows, whose uniform may fall within
//    rounding of a cumulative boundary); TopKGpu log-probs to tolerance against the CPU
//    core's best-first TopK, classes equal except for near ties (none allowed in float64),
//    each reported value that of its class, num_expanded = num_nodes, waves of one row bit
//    for bit; every output NaN-poisoned; a NaN row stays in its row (-1 for Sample).
// In the host emulator (--emulate builds) every GPU result is also recomputed under a
// shuffled and a reversed thread schedule and must match bit for bit (a missing barrier
// shows up there); --time there only smoke-tests the timing code on shrunk scenarios.
//
// Timing (--time, GPU only): the benchmark scenarios of docs/performance.md and the
// inference kernels (log_prob_all, top_k, sample) at the topk
// scenario's sizes, each call timed with cudaEvents (median of repeats after warm-up)
// against its roofline, using ceilings measured
// in the same run: an FMA-throughput kernel (and cuBLAS SGEMM when built with it) for
// FLOP/s and a device-to-device copy for bytes/s.
#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <numeric>
#include <queue>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "cc/core/gpu_compat.cuh"
#include "cc/core/inference.h"
#include "cc/core/inference_gpu.h"
#include "cc/core/log_prob.h"
#include "cc/core/log_prob_gpu.h"
#include "cc/core/tree_view.h"
#include "cc/core/visit_plan.h"

#ifdef TF_HSM_HAVE_CUBLAS
#include <cublas_v2.h>
#endif

namespace tf_hsm {
namespace harness {

#ifdef TF_HSM_GPU_EMULATE
constexpr bool kEmulated = true;
#else
constexpr bool kEmulated = false;
#endif

struct Options {
  bool quick = kEmulated;
  bool time = false;
  bool check = true;
  bool check_timed = false;
  bool plan_only = false;
  bool hash = false;
  bool verbose = false;
  std::uint64_t seed = 1;
  std::string only;  // run only cases whose name contains this
  std::string json;  // timing results, one JSON object per line
  int warmup = 3, repeats = 15;
};

int failures = 0;
int checks = 0;

#define HARNESS_EXPECT(cond, ...)                                      \
  do {                                                                 \
    ++checks;                                                          \
    if (!(cond)) {                                                     \
      ++failures;                                                      \
      std::fprintf(stderr, "FAILED (%s:%d) %s: ", __FILE__, __LINE__, #cond); \
      std::fprintf(stderr, __VA_ARGS__);                               \
      std::fprintf(stderr, "\n");                                      \
    }                                                                  \
  } while (0)

void CudaOrDie(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    std::fprintf(stderr, "CUDA error in %s: %s\n", what, cudaGetErrorString(err));
    std::exit(2);
  }
}

// ---- Trees -------------------------------------------------------------------------------

// A tree under construction: kids[n] lists node n's children in order; a code c >= 0 is
// class c, c < 0 is node -c - 1. Node 0 is the root; nodes need not be in BFS order.
struct Shape {
  std::vector<std::vector<int64>> kids;
  int64 num_classes = 0;
  int64 AddNode() {
    kids.emplace_back();
    return static_cast<int64>(kids.size()) - 1;
  }
};

int64 NodeCode(int64 node) { return -node - 1; }

// The layout contract of tree_view.h.
struct HostTree {
  std::vector<int64> child_begin, slot_child, path_begin, path_nodes, path_slots;
  int64 num_classes = 0;
  int64 max_depth = 0, max_branching = 0;
  TreeView view() const {
    TreeView v;
    v.num_classes = num_classes;
    v.num_nodes = static_cast<int64>(child_begin.size()) - 1;
    v.num_slots = static_cast<int64>(slot_child.size());
    v.path_length = static_cast<int64>(path_nodes.size());
    v.child_begin = child_begin.data();
    v.slot_child = slot_child.data();
    v.path_begin = path_begin.data();
    v.path_nodes = path_nodes.data();
    v.path_slots = path_slots.data();
    return v;
  }
  int64 num_slots() const { return static_cast<int64>(slot_child.size()); }
};

// Numbers the nodes breadth-first (children after their parent) and, when rng is given,
// relabels the classes at random so ids do not follow the tree order.
HostTree Layout(const Shape& shape, std::mt19937_64* rng) {
  const int64 C = shape.num_classes;
  std::vector<int64> label(C);
  std::iota(label.begin(), label.end(), 0);
  if (rng != nullptr) std::shuffle(label.begin(), label.end(), *rng);
  std::vector<int64> order{0}, new_id(shape.kids.size(), -1);
  new_id[0] = 0;
  for (size_t q = 0; q < order.size(); ++q) {
    for (int64 code : shape.kids[order[q]]) {
      if (code < 0) {
        const int64 child = -code - 1;
        new_id[child] = static_cast<int64>(order.size());
        order.push_back(child);
      }
    }
  }
  HostTree t;
  t.num_classes = C;
  const int64 M = static_cast<int64>(order.size());
  std::vector<int64> parent_slot(M, -1), slot_node, class_slot(C, -1);
  t.child_begin.push_back(0);
  for (int64 n = 0; n < M; ++n) {
    const auto& kids = shape.kids[order[n]];
    t.max_branching = std::max<int64>(t.max_branching, static_cast<int64>(kids.size()));
    for (int64 code : kids) {
      const int64 s = static_cast<int64>(t.slot_child.size());
      if (code >= 0) {
        t.slot_child.push_back(label[code]);
        class_slot[label[code]] = s;
      } else {
        const int64 child = new_id[-code - 1];
        t.slot_child.push_back(C + child);
        parent_slot[child] = s;
      }
      slot_node.push_back(n);
    }
    t.child_begin.push_back(static_cast<int64>(t.slot_child.size()));
  }
  t.path_begin.push_back(0);
  for (int64 c = 0; c < C; ++c) {
    if (class_slot[c] < 0) {
      std::fprintf(stderr, "internal error: class %" PRId64 " is not in the tree\n", c);
      std::exit(2);
    }
    std::vector<int64> steps;
    for (int64 s = class_slot[c]; s >= 0; s = parent_slot[slot_node[s]]) steps.push_back(s);
    std::reverse(steps.begin(), steps.end());
    for (int64 s : steps) {
      t.path_nodes.push_back(slot_node[s]);
      t.path_slots.push_back(s);
    }
    t.max_depth = std::max<int64>(t.max_depth, static_cast<int64>(steps.size()));
    t.path_begin.push_back(static_cast<int64>(t.path_nodes.size()));
  }
  return t;
}

// Breadth-first random growth: each node gets 1..max_branching children, each a new node
// with probability p_internal (while above max_depth and below max_classes), else a class.
Shape RandomShapeOnce(std::mt19937_64& rng, int64 max_branching, int max_depth,
                      double p_internal, int64 max_classes) {
  Shape s;
  s.AddNode();
  std::vector<int> depth{1};
  std::uniform_real_distribution<double> uniform(0, 1);
  for (size_t n = 0; n < s.kids.size(); ++n) {
    const int64 k = 1 + static_cast<int64>(rng() % max_branching);
    for (int64 j = 0; j < k; ++j) {
      if (depth[n] < max_depth && s.num_classes < max_classes && uniform(rng) < p_internal) {
        const int64 child = s.AddNode();
        depth.push_back(depth[n] + 1);
        s.kids[n].push_back(NodeCode(child));
      } else {
        s.kids[n].push_back(s.num_classes++);
      }
    }
  }
  return s;
}

// As above, retried until the tree has at least two classes and (below 3 levels) reaches
// its depth limit, so every case tests something.
Shape RandomShape(std::mt19937_64& rng, int64 max_branching, int max_depth, double p_internal,
                  int64 max_classes) {
  for (int attempt = 0;; ++attempt) {
    Shape s = RandomShapeOnce(rng, std::max<int64>(2, max_branching), max_depth, p_internal,
                              max_classes);
    if (s.num_classes < 2 && attempt < 1000) continue;
    if (attempt < 200 && max_depth <= 10 && max_classes > 50) {
      // Depth reached: some node at max_depth - 1 levels below the root.
      std::vector<int> depth(s.kids.size(), 0);
      int deepest = 1;
      depth[0] = 1;
      for (size_t n = 0; n < s.kids.size(); ++n)
        for (int64 code : s.kids[n])
          if (code < 0) deepest = std::max(deepest, depth[-code - 1] = depth[n] + 1);
      if (deepest < max_depth) continue;
    }
    return s;
  }
}

// Classes [lo, hi) under `node`, split into at most `branching` near-equal parts.
void SplitRange(Shape* s, int64 node, int64 lo, int64 hi, int64 branching) {
  const int64 n = hi - lo;
  if (n <= branching) {
    for (int64 c = lo; c < hi; ++c) s->kids[node].push_back(c);
    return;
  }
  for (int64 p = 0; p < branching; ++p) {
    const int64 a = lo + n * p / branching, b = lo + n * (p + 1) / branching;
    if (b - a == 1) {
      s->kids[node].push_back(a);
    } else if (b > a) {
      const int64 child = s->AddNode();
      s->kids[node].push_back(NodeCode(child));
      SplitRange(s, child, a, b, branching);
    }
  }
}

Shape BalancedShape(int64 num_classes, int64 branching) {
  Shape s;
  s.num_classes = num_classes;
  s.AddNode();
  SplitRange(&s, 0, 0, num_classes, branching);
  return s;
}

// A root with `groups` children, each a node holding a contiguous block of classes.
Shape TwoLevelShape(int64 num_classes, int64 groups) {
  Shape s;
  s.num_classes = num_classes;
  s.AddNode();
  for (int64 p = 0; p < groups; ++p) {
    const int64 a = num_classes * p / groups, b = num_classes * (p + 1) / groups;
    if (b - a == 1) {
      s.kids[0].push_back(a);
    } else if (b > a) {
      const int64 child = s.AddNode();
      s.kids[0].push_back(NodeCode(child));
      for (int64 c = a; c < b; ++c) s.kids[child].push_back(c);
    }
  }
  return s;
}

// Huffman tree on counts with the given branching (the first merge takes fewer nodes so
// that every later merge takes exactly `branching`).
Shape HuffmanShape(const std::vector<double>& counts, int64 branching) {
  Shape s;
  const int64 C = static_cast<int64>(counts.size());
  s.num_classes = C;
  s.AddNode();  // the root, filled last
  typedef std::pair<double, int64> Entry;  // (weight, code); ties broken by code
  std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> heap;
  for (int64 c = 0; c < C; ++c) heap.push({counts[c], c});
  if (C == 1) {
    s.kids[0].push_back(0);
    return s;
  }
  int64 take = branching == 2 ? 2 : (C - 2) % (branching - 1) + 2;
  while (true) {
    take = std::min<int64>(take, static_cast<int64>(heap.size()));
    const bool last = take == static_cast<int64>(heap.size());
    const int64 node = last ? 0 : s.AddNode();
    double w = 0;
    for (int64 j = 0; j < take; ++j) {
      w += heap.top().first;
      s.kids[node].push_back(heap.top().second);
      heap.pop();
    }
    if (last) break;
    heap.push({w, NodeCode(node)});
    take = branching;
  }
  return s;
}

// Two levels, classes sorted by decreasing count and cut into groups of about equal total
// count: frequent classes share a few small nodes.
Shape ClusteredShape(const std::vector<double>& counts, int64 groups) {
  const int64 C = static_cast<int64>(counts.size());
  std::vector<int64> order(C);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64 a, int64 b) { return counts[a] > counts[b]; });
  const double total = std::accumulate(counts.begin(), counts.end(), 0.0);
  Shape s;
  s.num_classes = C;
  s.AddNode();
  int64 node = -1;
  double acc = 0;
  int64 made = 0;
  for (int64 i = 0; i < C; ++i) {
    if (node < 0 || (acc >= total * made / groups && made < groups)) {
      node = s.AddNode();
      s.kids[0].push_back(NodeCode(node));
      ++made;
    }
    s.kids[node].push_back(order[i]);
    acc += counts[order[i]];
  }
  return s;
}

// depth levels, each node with `side` classes and one child node (the last: classes only);
// side = 0 gives single-child nodes.
Shape ChainShape(int depth, int64 side) {
  Shape s;
  s.AddNode();
  int64 node = 0;
  for (int d = 1; d <= depth; ++d) {
    for (int64 j = 0; j < side; ++j) s.kids[node].push_back(s.num_classes++);
    if (d == depth) {
      s.kids[node].push_back(s.num_classes++);
      if (side == 0) s.kids[node].push_back(s.num_classes++);
    } else {
      const int64 child = s.AddNode();
      s.kids[node].push_back(NodeCode(child));
      node = child;
    }
  }
  return s;
}

std::vector<double> ZipfCounts(int64 n, double exponent) {
  std::vector<double> c(n);
  for (int64 i = 0; i < n; ++i) c[i] = 1e9 / std::pow(static_cast<double>(i + 1), exponent);
  return c;
}

// ---- Data --------------------------------------------------------------------------------

struct Case {
  std::string name;
  HostTree tree;
  int64 tokens = 0, dim = 0;
  bool bias = true;
  double zipf = 1.0;      // target distribution exponent (0: uniform)
  bool ranked = false;    // class i the (i+1)-th likeliest target (else ranks shuffled)
  double weight_scale = 0.3;
  int64 budget = kDefaultGpuCoefBudget;
};

template <typename T>
struct Data {
  std::vector<T> hidden, weights, biases, upstream;
  std::vector<int64> targets;
};

// scale * N(0, 1) values; blocks of 1M values each get their own generator seeded from
// `rng` and are filled on all cores (a timing scenario's table has up to 400M values).
template <typename T>
void FillNormal(std::vector<T>* values, double scale, std::mt19937_64& rng) {
  constexpr int64 kBlock = int64{1} << 20;
  const int64 n = static_cast<int64>(values->size());
  std::vector<std::uint64_t> seeds((n + kBlock - 1) / kBlock);
  for (auto& s : seeds) s = rng();
  const int64 threads = std::min<int64>(static_cast<int64>(seeds.size()),
                                        std::max(1u, std::thread::hardware_concurrency()));
  std::vector<std::thread> pool;
  for (int64 k = 0; k < threads; ++k) {
    pool.emplace_back([&, k] {
      for (int64 b = k; b < static_cast<int64>(seeds.size()); b += threads) {
        std::mt19937_64 gen(seeds[b]);
        std::normal_distribution<double> normal(0, 1);
        for (int64 i = b * kBlock; i < std::min(n, (b + 1) * kBlock); ++i) {
          (*values)[i] = static_cast<T>(scale * normal(gen));
        }
      }
    });
  }
  for (auto& t : pool) t.join();
}

// The case's targets: Zipf over a random ranking of the classes.
std::vector<int64> MakeTargets(const Case& c, std::mt19937_64& rng) {
  const int64 C = c.tree.num_classes;
  std::vector<int64> rank(C);
  std::iota(rank.begin(), rank.end(), 0);
  if (!c.ranked) std::shuffle(rank.begin(), rank.end(), rng);
  std::vector<double> cdf(C);
  double total = 0;
  for (int64 i = 0; i < C; ++i) {
    total += c.zipf == 0 ? 1.0 : 1.0 / std::pow(static_cast<double>(i + 1), c.zipf);
    cdf[i] = total;
  }
  std::uniform_real_distribution<double> uniform(0, total);
  std::vector<int64> targets(c.tokens);
  for (auto& t : targets) {
    const int64 i = std::lower_bound(cdf.begin(), cdf.end(), uniform(rng)) - cdf.begin();
    t = rank[std::min(i, C - 1)];
  }
  return targets;
}

template <typename T>
Data<T> MakeData(const Case& c, std::mt19937_64& rng) {
  Data<T> d;
  std::normal_distribution<double> normal(0, 1);
  const int64 S = c.tree.num_slots();
  d.hidden.resize(c.tokens * c.dim);
  d.weights.resize(S * c.dim);
  d.biases.resize(c.bias ? S : 0);
  d.upstream.resize(c.tokens);
  for (auto& v : d.hidden) v = static_cast<T>(normal(rng));
  const double ws = c.weight_scale / std::sqrt(std::max<double>(1.0, c.dim / 16.0));
  FillNormal(&d.weights, ws, rng);
  for (auto& v : d.biases) v = static_cast<T>(normal(rng));
  for (auto& v : d.upstream) v = static_cast<T>(normal(rng));
  d.targets = MakeTargets(c, rng);
  return d;
}

template <typename To, typename From>
std::vector<To> Convert(const std::vector<From>& v) {
  return std::vector<To>(v.begin(), v.end());
}

// ---- CPU core ----------------------------------------------------------------------------

ParallelFor ThreadPoolFor() {
  return [](int64 total, int64, const std::function<void(int64, int64)>& work) {
    if (total <= 0) return;
    const int64 threads = std::min<int64>(total, std::max(1u, std::thread::hardware_concurrency()));
    if (threads == 1) {
      work(0, total);
      return;
    }
    std::vector<std::thread> pool;
    for (int64 k = 0; k < threads; ++k) {
      pool.emplace_back([&, k] { work(total * k / threads, total * (k + 1) / threads); });
    }
    for (auto& t : pool) t.join();
  };
}

template <typename T>
struct Result {
  std::vector<T> log_prob, d_hidden, d_rows, d_bias;
  std::vector<int64> row_ids;
  double forward_ms = 0, backward_ms = 0;
};

template <typename T>
Result<T> RunCpu(const Case& c, const VisitPlan& plan, const Data<T>& d) {
  SoftmaxParams<T> p;
  p.hidden = d.hidden.data();
  p.weights = d.weights.data();
  p.biases = c.bias ? d.biases.data() : nullptr;
  p.dim = c.dim;
  Result<T> r;
  const ParallelFor pf = ThreadPoolFor();
  r.log_prob.resize(c.tokens);
  LogProbForward<T>(plan, c.tree.view(), p, pf, r.log_prob.data());
  r.d_hidden.resize(c.tokens * c.dim);
  r.d_rows.resize(plan.num_rows() * c.dim);
  r.d_bias.resize(c.bias ? plan.num_rows() : 0);
  r.row_ids.resize(plan.num_rows());
  LogProbGrads<T> g;
  g.hidden = r.d_hidden.data();
  g.weight_rows = r.d_rows.data();
  g.bias_rows = c.bias ? r.d_bias.data() : nullptr;
  g.row_ids = r.row_ids.data();
  LogProbBackward<T>(plan, c.tree.view(), p, d.upstream.data(), pf, g);
  return r;
}

// ---- GPU ---------------------------------------------------------------------------------

template <typename T>
struct Poison;
template <>
struct Poison<float> {
  static constexpr std::uint32_t kBits = 0x7F8A5A5Bu;  // a signalling NaN no kernel makes
};
template <>
struct Poison<double> {
  static constexpr std::uint64_t kBits = 0x7FF15A5A5A5A5A5Bull;
};
template <>
struct Poison<int64> {
  static constexpr std::uint64_t kBits = 0x7A5A5A5A5A5A5A5Bull;
};

template <typename T>
T PoisonValue() {
  T v;
  const auto bits = Poison<T>::kBits;
  std::memcpy(&v, &bits, sizeof(T));
  return v;
}

template <typename T>
bool IsPoison(T v) {
  const auto bits = Poison<T>::kBits;
  return std::memcmp(&v, &bits, sizeof(T)) == 0;
}

constexpr int64 kGuard = 64;  // poisoned elements before and after every output

// --hash: a digest of everything the training and candidates calls of a case produce (the
// host work lists and the outputs' bits), printed per case, so that a change to the CUDA
// core that must keep every bit (a refactoring) is proved by diffing two runs' lines.
// FNV-1a over the bytes, in the order they are fed.
struct Digest {
  bool on = false;
  std::uint64_t value = 14695981039346656037ull;
  void Bytes(const void* p, size_t n) {
    if (!on) return;
    const unsigned char* b = static_cast<const unsigned char*>(p);
    for (size_t i = 0; i < n; ++i) value = (value ^ b[i]) * 1099511628211ull;
  }
  template <typename V>
  void Vector(const std::vector<V>& v) {
    const int64 n = static_cast<int64>(v.size());
    Bytes(&n, sizeof(n));
    if (n > 0) Bytes(v.data(), v.size() * sizeof(V));
  }
  void Word(int64 w) { Bytes(&w, sizeof(w)); }
  void Range(const GpuLogProbPlan::Range& r) {
    Word(r.begin);
    Word(r.count);
  }
  void Plan(const GpuLogProbPlan& gp) {
    for (int64 w : {int64{gp.mode}, int64{gp.has_bias}, gp.value_bytes, gp.dim, gp.num_tokens,
                    gp.num_groups, gp.num_rows, gp.num_slices, gp.num_partials, gp.num_visits,
                    gp.num_candidates, gp.slices, gp.items, gp.visit_row, gp.visit_slot,
                    gp.visit_slice, gp.token_begin, gp.token_entries, gp.group_row,
                    gp.group_first, gp.cand_visit, gp.cand_slot, gp.partial_max,
                    gp.partial_sum, gp.taken, gp.lse, gp.coef, gp.workspace_bytes}) {
      Word(w);
    }
    Vector(gp.staging);
    Word(static_cast<int64>(gp.waves.size()));
    for (const auto& w : gp.waves) {
      for (int64 x : {int64{w.kind}, w.visit_begin, w.visit_end, w.small_visits, w.coef_elements}) {
        Word(x);
      }
      for (const auto* r : {&w.logits_wide, &w.logits_narrow, &w.dw[0], &w.dw[1], &w.dw[2],
                            &w.dw_warp}) {
        Range(*r);
      }
      Word(static_cast<int64>(w.levels.size()));
      for (const auto& l : w.levels) {
        for (int64 x : {l.visit_begin, l.visit_end, l.small_visits}) Word(x);
        Range(l.dh_wide);
        Range(l.dh_narrow);
      }
    }
  }
};
Digest digest;

// A device array with poisoned guard regions on both sides.
template <typename T>
struct DeviceArray {
  T* base = nullptr;
  int64 size = 0;
  DeviceArray() = default;
  explicit DeviceArray(int64 n) : size(n) {
    CudaOrDie(cudaMalloc(&base, (n + 2 * kGuard) * sizeof(T)), "cudaMalloc");
  }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  ~DeviceArray() {
    if (base != nullptr) cudaFree(base);
  }
  T* data() const { return base + kGuard; }
  void Upload(const std::vector<T>& v) {
    CudaOrDie(cudaMemcpy(data(), v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice),
              "upload");
  }
  void Poison() {
    std::vector<T> p(size + 2 * kGuard, PoisonValue<T>());
    CudaOrDie(cudaMemcpy(base, p.data(), p.size() * sizeof(T), cudaMemcpyHostToDevice),
              "poison");
  }
  // Downloads the array; checks that the guards are intact and (if all_written) that no
  // element still holds the poison.
  std::vector<T> Download(const char* what, bool all_written) const {
    std::vector<T> all(size + 2 * kGuard);
    CudaOrDie(cudaMemcpy(all.data(), base, all.size() * sizeof(T), cudaMemcpyDeviceToHost),
              "download");
    int64 guard_hits = 0, unwritten = 0;
    for (int64 i = 0; i < kGuard; ++i) {
      guard_hits += !IsPoison(all[i]);
      guard_hits += !IsPoison(all[kGuard + size + i]);
    }
    if (all_written) {
      for (int64 i = 0; i < size; ++i) unwritten += IsPoison(all[kGuard + i]);
    }
    HARNESS_EXPECT(guard_hits == 0, "%s: %" PRId64 " writes outside the array", what, guard_hits);
    HARNESS_EXPECT(unwritten == 0, "%s: %" PRId64 " of %" PRId64 " elements never written",
                   what, unwritten, size);
    return std::vector<T>(all.begin() + kGuard, all.begin() + kGuard + size);
  }
};

template <typename T>
struct DeviceInputs {
  DeviceArray<T> hidden, weights, biases, upstream;
  DeviceInputs(const Data<T>& d)
      : hidden(d.hidden.size()), weights(d.weights.size()), biases(d.biases.size()),
        upstream(d.upstream.size()) {
    hidden.Upload(d.hidden);
    weights.Upload(d.weights);
    biases.Upload(d.biases);
    upstream.Upload(d.upstream);
  }
};

struct DeviceBuffer {
  void* ptr = nullptr;
  explicit DeviceBuffer(int64 bytes) {
    CudaOrDie(cudaMalloc(&ptr, std::max<int64>(bytes, 1)), "cudaMalloc workspace");
    // NaN bytes: a kernel that reads scratch it never wrote produces NaN in a result.
    CudaOrDie(cudaMemset(ptr, 0xFF, std::max<int64>(bytes, 1)), "cudaMemset workspace");
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { cudaFree(ptr); }
};

// Median of `repeats` timings of call() (after `warmup` untimed calls), in ms.
double TimeCalls(const std::function<std::string()>& call, int warmup, int repeats) {
  for (int i = 0; i < warmup; ++i) {
    const std::string err = call();
    if (!err.empty()) {
      std::fprintf(stderr, "%s\n", err.c_str());
      std::exit(2);
    }
  }
  cudaEvent_t start, stop;
  CudaOrDie(cudaEventCreate(&start), "cudaEventCreate");
  CudaOrDie(cudaEventCreate(&stop), "cudaEventCreate");
  std::vector<double> ms;
  for (int i = 0; i < repeats; ++i) {
    CudaOrDie(cudaEventRecord(start, nullptr), "cudaEventRecord");
    const std::string err = call();
    CudaOrDie(cudaEventRecord(stop, nullptr), "cudaEventRecord");
    CudaOrDie(cudaEventSynchronize(stop), "cudaEventSynchronize");
    if (!err.empty()) {
      std::fprintf(stderr, "%s\n", err.c_str());
      std::exit(2);
    }
    float t = 0;
    CudaOrDie(cudaEventElapsedTime(&t, start, stop), "cudaEventElapsedTime");
    ms.push_back(t);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(ms.begin(), ms.end());
  return ms.empty() ? 0 : ms[ms.size() / 2];
}

template <typename T>
Result<T> RunGpu(const Case& c, const VisitPlan& plan, DeviceInputs<T>& in, int64 budget,
                 bool expect_finite, const Options* timing) {
  Result<T> r;
  SoftmaxParams<T> p;
  p.hidden = in.hidden.data();
  p.weights = in.weights.data();
  p.biases = c.bias ? in.biases.data() : nullptr;
  p.dim = c.dim;
  const TreeView tree = c.tree.view();

  GpuLogProbPlan fwd, bwd;
  std::string err = PrepareLogProbGpu<T>(plan, tree, c.dim, c.bias, false, budget, &fwd);
  HARNESS_EXPECT(err.empty(), "%s: %s", c.name.c_str(), err.c_str());
  err = PrepareLogProbGpu<T>(plan, tree, c.dim, c.bias, true, budget, &bwd);
  HARNESS_EXPECT(err.empty(), "%s: %s", c.name.c_str(), err.c_str());
  digest.Plan(fwd);
  digest.Plan(bwd);

  DeviceArray<T> log_prob(c.tokens), d_hidden(c.tokens * c.dim);
  DeviceArray<T> d_rows(plan.num_rows() * c.dim), d_bias(c.bias ? plan.num_rows() : 0);
  DeviceArray<int64> row_ids(plan.num_rows());
  for (auto* a : {&log_prob, &d_hidden, &d_rows, &d_bias}) a->Poison();
  row_ids.Poison();
  DeviceBuffer ws_fwd(fwd.workspace_bytes), ws_bwd(bwd.workspace_bytes);

  LogProbGrads<T> g;
  g.hidden = d_hidden.data();
  g.weight_rows = d_rows.data();
  g.bias_rows = c.bias ? d_bias.data() : nullptr;
  g.row_ids = row_ids.data();
  auto forward = [&]() { return LogProbForwardGpu<T>(fwd, p, log_prob.data(), ws_fwd.ptr, nullptr); };
  auto backward = [&]() {
    return LogProbBackwardGpu<T>(bwd, p, in.upstream.data(), g, ws_bwd.ptr, nullptr);
  };
  err = forward();
  HARNESS_EXPECT(err.empty(), "%s forward: %s", c.name.c_str(), err.c_str());
  err = backward();
  HARNESS_EXPECT(err.empty(), "%s backward: %s", c.name.c_str(), err.c_str());
  CudaOrDie(cudaDeviceSynchronize(), "kernels");
  const std::string what = c.name + (sizeof(T) == 4 ? " float32" : " float64");
  r.log_prob = log_prob.Download((what + " log_prob").c_str(), true);
  r.d_hidden = d_hidden.Download((what + " d_hidden").c_str(), true);
  r.d_rows = d_rows.Download((what + " weight_rows").c_str(), true);
  r.d_bias = d_bias.Download((what + " bias_rows").c_str(), true);
  r.row_ids = row_ids.Download((what + " row_ids").c_str(), true);
  for (const auto* v : {&r.log_prob, &r.d_hidden, &r.d_rows, &r.d_bias}) digest.Vector(*v);
  digest.Vector(r.row_ids);
  (void)expect_finite;
  if (timing != nullptr) {
    r.forward_ms = TimeCalls(forward, timing->warmup, timing->repeats);
    r.backward_ms = TimeCalls(backward, timing->warmup, timing->repeats);
  }
  return r;
}

// log P of M candidates per token (candidate 0 is the token's target), on the GPU and with
// the CPU core's LogProbCandidates in float64.
template <typename T>
void CheckCandidates(const Case& c, const Data<T>& d, DeviceInputs<T>& in,
                     const Result<T>& forward, std::mt19937_64& rng, const std::string& what);
template <typename T>
void CheckInference(const Case& c, const Data<T>& d, DeviceInputs<T>& in, std::mt19937_64& rng,
                    const std::string& what);

// ---- Comparisons -------------------------------------------------------------------------

double Rms(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x * x;
  return v.empty() ? 0 : std::sqrt(s / v.size());
}

// |got - want| <= rtol * (|want| + rms(want)) elementwise; NaN must match NaN.
template <typename T>
double Compare(const std::string& what, const std::vector<T>& got, const std::vector<double>& want,
               double rtol) {
  HARNESS_EXPECT(got.size() == want.size(), "%s: %zu values, want %zu", what.c_str(),
                 got.size(), want.size());
  if (got.size() != want.size()) return INFINITY;
  const double scale = Rms(want);
  double worst = 0;
  int64 bad = 0, first_bad = -1;
  for (size_t i = 0; i < got.size(); ++i) {
    const double g = got[i], w = want[i];
    if (std::isnan(w) || std::isnan(g)) {
      if (std::isnan(w) != std::isnan(g)) {
        ++bad;
        if (first_bad < 0) first_bad = static_cast<int64>(i);
      }
      continue;
    }
    const double err = std::fabs(g - w) / (std::fabs(w) + scale + 1e-300);
    worst = std::max(worst, err);
    if (!(err <= rtol)) {
      ++bad;
      if (first_bad < 0) first_bad = static_cast<int64>(i);
    }
  }
  HARNESS_EXPECT(bad == 0, "%s: %" PRId64 " of %zu values off (first [%" PRId64 "]: %.9g vs %.9g)",
                 what.c_str(), bad, got.size(), first_bad,
                 first_bad >= 0 ? static_cast<double>(got[first_bad]) : 0.0,
                 first_bad >= 0 ? want[first_bad] : 0.0);
  return worst;
}

template <typename T>
bool SameBits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

// Equal values (+0 == -0, NaN == NaN).
template <typename T>
bool SameValues(const std::vector<T>& a, const std::vector<T>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!(a[i] == b[i]) && !(a[i] != a[i] && b[i] != b[i])) return false;
  }
  return true;
}

template <typename T>
void ExpectSame(const std::string& what, const Result<T>& a, const Result<T>& b, bool bits) {
  auto same = [bits](const auto& x, const auto& y) { return bits ? SameBits(x, y) : SameValues(x, y); };
  HARNESS_EXPECT(same(a.log_prob, b.log_prob), "%s: log_prob differs", what.c_str());
  HARNESS_EXPECT(same(a.d_hidden, b.d_hidden), "%s: d_hidden differs", what.c_str());
  HARNESS_EXPECT(same(a.d_rows, b.d_rows), "%s: weight rows differ", what.c_str());
  HARNESS_EXPECT(same(a.d_bias, b.d_bias), "%s: bias rows differ", what.c_str());
  HARNESS_EXPECT(a.row_ids == b.row_ids, "%s: row ids differ", what.c_str());
}

int64 CoefElements(const VisitPlan& plan, const HostTree& tree) {
  int64 total = 0;
  for (int64 g = 0; g < plan.num_groups(); ++g) {
    const int64 n = plan.group_node[g];
    total += (plan.group_begin[g + 1] - plan.group_begin[g]) *
             (tree.child_begin[n + 1] - tree.child_begin[n]);
  }
  return total;
}

// Every `stride`-th target made padding (Padding::kSkip, as the op's skip_padding), its
// upstream NaN: the kernels give those tokens log-probability 0 and a zero hidden
// gradient (whatever their upstream) and no weight row of their own, the others what the
// CPU core gives them.
template <typename T>
void CheckPaddedEvery(const Case& c, const Data<T>& data, const std::string& what,
                      int64 stride) {
  Data<T> padded = data;
  for (int64 i = 0; i < c.tokens; i += stride) {
    padded.targets[i] = -1;
    padded.upstream[i] = std::numeric_limits<T>::quiet_NaN();
  }
  VisitPlan plan;
  const std::string err = BuildVisitPlan(c.tree.view(), padded.targets.data(), c.tokens, &plan,
                                         PlanFor::kBackward, Padding::kSkip);
  HARNESS_EXPECT(err.empty(), "%s padded: %s", what.c_str(), err.c_str());
  if (!err.empty()) return;
  const Data<double> data64{Convert<double>(padded.hidden), Convert<double>(padded.weights),
                            Convert<double>(padded.biases), Convert<double>(padded.upstream),
                            padded.targets};
  const Result<double> ref = RunCpu<double>(c, plan, data64);
  DeviceInputs<T> in(padded);
  const Result<T> gpu = RunGpu<T>(c, plan, in, c.budget, true, nullptr);
  const double rtol = sizeof(T) == 8 ? 1e-9 : 1e-3;
  Compare(what + " padded log_prob", gpu.log_prob, ref.log_prob, rtol);
  Compare(what + " padded d_hidden", gpu.d_hidden, ref.d_hidden, rtol);
  Compare(what + " padded weight_rows", gpu.d_rows, ref.d_rows, rtol);
  Compare(what + " padded bias_rows", gpu.d_bias, ref.d_bias, rtol);
  HARNESS_EXPECT(gpu.row_ids == ref.row_ids, "%s padded: row ids differ", what.c_str());
  for (int64 i = 0; i < c.tokens; i += stride) {
    bool zero = gpu.log_prob[i] == T(0) && ref.log_prob[i] == 0.0;
    for (int64 d = 0; d < c.dim; ++d) {
      zero = zero && gpu.d_hidden[i * c.dim + d] == T(0) && ref.d_hidden[i * c.dim + d] == 0.0;
    }
    HARNESS_EXPECT(zero, "%s padded: token %lld has a value or a gradient", what.c_str(),
                   static_cast<long long>(i));
  }
}

// Padding among real targets, and a batch of padding alone.
template <typename T>
void CheckPadding(const Case& c, const Data<T>& data, const std::string& what) {
  CheckPaddedEvery(c, data, what + " (every third padded)", 3);
  CheckPaddedEvery(c, data, what + " (all padded)", 1);
}

template <typename T>
void CheckCase(const Case& c, std::mt19937_64& rng, const Options& opt) {
  const Data<T> data = MakeData<T>(c, rng);
  const std::string what = c.name + (sizeof(T) == 4 ? " float32" : " float64");
  VisitPlan plan;
  const std::string err = BuildVisitPlan(c.tree.view(), data.targets.data(), c.tokens, &plan);
  HARNESS_EXPECT(err.empty(), "%s: %s", what.c_str(), err.c_str());
  if (!err.empty()) return;
  const auto t0 = std::chrono::steady_clock::now();
  const Data<double> data64{Convert<double>(data.hidden), Convert<double>(data.weights),
                            Convert<double>(data.biases), Convert<double>(data.upstream),
                            data.targets};
  const Result<double> ref = RunCpu<double>(c, plan, data64);
  const double cpu_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  DeviceInputs<T> in(data);
  digest = Digest{opt.hash};
  const auto t1 = std::chrono::steady_clock::now();
  const Result<T> gpu = RunGpu<T>(c, plan, in, c.budget, true, nullptr);
  const double gpu_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
  const double rtol = sizeof(T) == 8 ? 1e-9 : 1e-3;
  double worst = 0;
  worst = std::max(worst, Compare(what + " log_prob", gpu.log_prob, ref.log_prob, rtol));
  worst = std::max(worst, Compare(what + " d_hidden", gpu.d_hidden, ref.d_hidden, rtol));
  worst = std::max(worst, Compare(what + " weight_rows", gpu.d_rows, ref.d_rows, rtol));
  worst = std::max(worst, Compare(what + " bias_rows", gpu.d_bias, ref.d_bias, rtol));
  HARNESS_EXPECT(gpu.row_ids == ref.row_ids, "%s: row ids differ from the CPU core", what.c_str());

  // Run to run: the same bits (checked here, so not hashed again).
  digest.on = false;
  const Result<T> again = RunGpu<T>(c, plan, in, c.budget, true, nullptr);
  digest.on = opt.hash;
  ExpectSame(what + " (second run)", gpu, again, true);
  // A budget that forces many waves and split groups: the same values. (Groups split by
  // tokens, or, where a block of kChunkSlots children for all of the group's visits fits,
  // by children: GpuLogProbPlan::Wave::kSlotBlock, as flat_wide_group's.)
  const int64 coef = CoefElements(plan, c.tree);
  if (coef > 1) {
    const int64 small = std::max<int64>(1, coef / 7);
    const Result<T> waves = RunGpu<T>(c, plan, in, small, true, nullptr);
    ExpectSame(what + " (coef budget " + std::to_string(small) + ")", gpu, waves, false);
  }
  CheckCandidates<T>(c, data, in, gpu, rng, what);
  CheckPadding<T>(c, data, what);
  if (opt.hash) std::printf("hash %-44s %016" PRIx64 "\n", what.c_str(), digest.value);
  digest.on = false;
  CheckInference<T>(c, data, in, rng, what);
#ifdef TF_HSM_GPU_EMULATE
  // Another thread interleaving must not change a bit.
  tf_hsm_emu::SetSchedule(tf_hsm_emu::Schedule::kShuffled, rng());
  const Result<T> shuffled = RunGpu<T>(c, plan, in, c.budget, true, nullptr);
  tf_hsm_emu::SetSchedule(tf_hsm_emu::Schedule::kForward);
  ExpectSame(what + " (shuffled thread schedule)", gpu, shuffled, true);
  tf_hsm_emu::SetSchedule(tf_hsm_emu::Schedule::kReverse);
  const Result<T> reversed = RunGpu<T>(c, plan, in, c.budget, true, nullptr);
  tf_hsm_emu::SetSchedule(tf_hsm_emu::Schedule::kForward);
  ExpectSame(what + " (reversed thread schedule)", gpu, reversed, true);
#endif
  if (opt.verbose || failures > 0) {
    std::printf("  %-44s C=%-7" PRId64 " depth=%-3" PRId64 " K<=%-7" PRId64 " T=%-5" PRId64
                " D=%-4" PRId64 " rows=%-8" PRId64 " max rel err %.2e  (cpu %.2fs, gpu %.2fs)\n",
                what.c_str(), c.tree.num_classes, c.tree.max_depth, c.tree.max_branching,
                c.tokens, c.dim, plan.num_rows(), worst, cpu_s, gpu_s);
    std::fflush(stdout);
  }
}

template <typename T>
void CheckCandidates(const Case& c, const Data<T>& d, DeviceInputs<T>& in,
                     const Result<T>& forward, std::mt19937_64& rng, const std::string& what) {
  const int64 M = 1 + static_cast<int64>(rng() % 5), N = c.tokens, C = c.tree.num_classes;
  std::vector<int64> cand(N * M);
  for (int64 i = 0; i < N; ++i) {
    cand[i * M] = d.targets[i];
    for (int64 m = 1; m < M; ++m) {
      // Repeats of the target and of each other, and other classes.
      const int64 r = static_cast<int64>(rng() % 4);
      cand[i * M + m] = r == 0 ? d.targets[i] : (r == 1 ? cand[i * M + m - 1] : static_cast<int64>(rng() % C));
    }
  }
  VisitPlan plan;
  const std::string err = BuildVisitPlan(c.tree.view(), cand.data(), N * M, &plan);
  HARNESS_EXPECT(err.empty(), "%s candidates: %s", what.c_str(), err.c_str());
  if (!err.empty()) return;
  // The CPU core in float64.
  const std::vector<double> h64 = Convert<double>(d.hidden), w64 = Convert<double>(d.weights),
                            b64 = Convert<double>(d.biases);
  SoftmaxParams<double> p64{h64.data(), w64.data(), c.bias ? b64.data() : nullptr, c.dim};
  std::vector<double> ref(N * M);
  const std::string cpu_err =
      LogProbCandidates<double>(c.tree.view(), p64, N, cand.data(), M, ThreadPoolFor(), ref.data());
  HARNESS_EXPECT(cpu_err.empty(), "%s candidates (CPU): %s", what.c_str(), cpu_err.c_str());
  // The GPU.
  GpuLogProbPlan gp;
  std::string gerr = PrepareLogProbCandidatesGpu<T>(plan, c.tree.view(), c.dim, c.bias, M, &gp);
  HARNESS_EXPECT(gerr.empty(), "%s candidates: %s", what.c_str(), gerr.c_str());
  digest.Plan(gp);
  DeviceArray<T> out(N * M);
  out.Poison();
  DeviceBuffer ws(gp.workspace_bytes);
  SoftmaxParams<T> p{in.hidden.data(), in.weights.data(), c.bias ? in.biases.data() : nullptr,
                     c.dim};
  gerr = LogProbCandidatesGpu<T>(gp, p, out.data(), ws.ptr, nullptr);
  HARNESS_EXPECT(gerr.empty(), "%s candidates: %s", what.c_str(), gerr.c_str());
  CudaOrDie(cudaDeviceSynchronize(), "candidates");
  const std::vector<T> got = out.Download((what + " candidates").c_str(), true);
  digest.Vector(got);
  Compare(what + " candidates (M=" + std::to_string(M) + ")", got, ref,
          sizeof(T) == 8 ? 1e-9 : 1e-3);
  // Candidate 0 is the target: the same bits as the forward kernel.
  int64 differ = 0;
  for (int64 i = 0; i < N; ++i) {
    differ += std::memcmp(&got[i * M], &forward.log_prob[i], sizeof(T)) != 0;
  }
  HARNESS_EXPECT(differ == 0, "%s candidates: %" PRId64 " of %" PRId64
                 " targets differ from LogProbForwardGpu", what.c_str(), differ, N);
}

// ---- Inference: LogProbAllGpu, SampleGpu and TopKGpu against the CPU core ---------------

template <typename T>
SoftmaxParams<T> DeviceParams(const Case& c, DeviceInputs<T>& in) {
  return SoftmaxParams<T>{in.hidden.data(), in.weights.data(),
                          c.bias ? in.biases.data() : nullptr, c.dim};
}

// Every class's log-probability for classes [begin, end), NaN-poisoned output.
template <typename T>
std::vector<T> RunLogProbAllGpu(const Case& c, DeviceInputs<T>& in, int64 begin, int64 end,
                                int64 budget, const std::string& what) {
  GpuInferencePlan gp;
  std::string err = PrepareLogProbAllGpu<T>(c.tree.view(), c.tokens, c.dim, c.bias, begin, end,
                                            budget, &gp);
  HARNESS_EXPECT(err.empty(), "%s: %s", what.c_str(), err.c_str());
  DeviceArray<T> out(c.tokens * (end - begin));
  out.Poison();
  DeviceBuffer ws(gp.workspace_bytes);
  if (err.empty()) {
    err = LogProbAllGpu<T>(gp, DeviceParams(c, in), out.data(), ws.ptr, nullptr);
    HARNESS_EXPECT(err.empty(), "%s: %s", what.c_str(), err.c_str());
  }
  CudaOrDie(cudaDeviceSynchronize(), "LogProbAllGpu");
  return out.Download(what.c_str(), true);
}

template <typename T>
std::vector<int64> RunSampleGpu(const Case& c, DeviceInputs<T>& in, std::uint64_t seed,
                                T temperature, const std::string& what) {
  GpuInferencePlan gp;
  std::string err = PrepareSampleGpu<T>(c.tree.view(), c.tokens, c.dim, c.bias, &gp);
  HARNESS_EXPECT(err.empty(), "%s: %s", what.c_str(), err.c_str());
  DeviceArray<int64> out(c.tokens);
  out.Poison();
  DeviceBuffer ws(gp.workspace_bytes);
  if (err.empty()) {
    err = SampleGpu<T>(gp, DeviceParams(c, in), seed, temperature, out.data(), ws.ptr, nullptr);
    HARNESS_EXPECT(err.empty(), "%s: %s", what.c_str(), err.c_str());
  }
  CudaOrDie(cudaDeviceSynchronize(), "SampleGpu");
  return out.Download(what.c_str(), true);
}

template <typename T>
struct TopKOut {
  std::vector<T> log_probs;
  std::vector<int64> classes, expanded;
};

template <typename T>
TopKOut<T> RunTopKGpu(const Case& c, DeviceInputs<T>& in, int64 k, int64 budget,
                      const std::string& what) {
  GpuInferencePlan gp;
  std::string err = PrepareTopKGpu<T>(c.tree.view(), c.tokens, c.dim, c.bias, k, budget, &gp);
  HARNESS_EXPECT(err.empty(), "%s: %s", what.c_str(), err.c_str());
  DeviceArray<T> lp(c.tokens * k);
  DeviceArray<int64> cls(c.tokens * k), expanded(c.tokens);
  lp.Poison();
  cls.Poison();
  expanded.Poison();
  DeviceBuffer ws(gp.workspace_bytes);
  if (err.empty()) {
    err = TopKGpu<T>(gp, DeviceParams(c, in), lp.data(), cls.data(), expanded.data(), ws.ptr,
                     nullptr);
    HARNESS_EXPECT(err.empty(), "%s: %s", what.c_str(), err.c_str());
  }
  CudaOrDie(cudaDeviceSynchronize(), "TopKGpu");
  TopKOut<T> r;
  r.log_probs = lp.Download((what + " log_probs").c_str(), true);
  r.classes = cls.Download((what + " classes").c_str(), true);
  r.expanded = expanded.Download((what + " num_expanded").c_str(), true);
  return r;
}

// LogProbAll to tolerance against the CPU core in float64 (a class range: the full table's
// bits); Sample against the CPU core's Sample in the same precision, same seed (equal
// classes but for rows whose uniform falls within rounding of a boundary: at most 1 + 1%);
// TopK log-probs to tolerance and classes equal, except where two classes' float64
// log-probabilities are within tolerance (a near tie that rounding may order either way).
// Each also run to run, in waves of one row, and (emulated) under other thread schedules.
template <typename T>
void CheckInference(const Case& c, const Data<T>& d, DeviceInputs<T>& in, std::mt19937_64& rng,
                    const std::string& what) {
  const TreeView view = c.tree.view();
  const int64 N = c.tokens, C = c.tree.num_classes, M = view.num_nodes;
  const double rtol = sizeof(T) == 8 ? 1e-9 : 1e-3;
  const std::vector<double> h64 = Convert<double>(d.hidden), w64 = Convert<double>(d.weights),
                            b64 = Convert<double>(d.biases);
  const SoftmaxParams<double> p64{h64.data(), w64.data(), c.bias ? b64.data() : nullptr, c.dim};

  // LogProbAll.
  std::vector<double> all64(N * C);
  std::string err = LogProbAll<double>(view, p64, N, 0, C, ThreadPoolFor(), all64.data());
  HARNESS_EXPECT(err.empty(), "%s log_prob_all (CPU): %s", what.c_str(), err.c_str());
  const std::vector<T> all =
      RunLogProbAllGpu<T>(c, in, 0, C, kDefaultGpuInferenceBudget, what + " log_prob_all");
  Compare(what + " log_prob_all", all, all64, rtol);
  HARNESS_EXPECT(SameBits(all, RunLogProbAllGpu<T>(c, in, 0, C, kDefaultGpuInferenceBudget,
                                                   what + " log_prob_all again")),
                 "%s log_prob_all: a second run differs", what.c_str());
  const int64 b = static_cast<int64>(rng() % C);
  const int64 e = b + static_cast<int64>(rng() % (C - b + 1));
  const std::vector<T> part = RunLogProbAllGpu<T>(c, in, b, e, 1, what + " log_prob_all range");
  int64 part_differ = 0;
  for (int64 i = 0; i < N; ++i)
    for (int64 j = 0; j < e - b; ++j)
      part_differ += std::memcmp(&part[i * (e - b) + j], &all[i * C + b + j], sizeof(T)) != 0;
  HARNESS_EXPECT(part_differ == 0,
                 "%s log_prob_all class_range [%" PRId64 ", %" PRId64 ") in waves of one row: %"
                 PRId64 " values differ from the full table", what.c_str(), b, e, part_differ);

  // Sample.
  const std::uint64_t seed = rng();
  const T temperature = rng() % 2 ? T(1) : T(0.7);
  std::vector<int64> want(N);
  const SoftmaxParams<T> pt{d.hidden.data(), d.weights.data(),
                            c.bias ? d.biases.data() : nullptr, c.dim};
  err = Sample<T>(view, pt, N, seed, temperature, ThreadPoolFor(), want.data());
  HARNESS_EXPECT(err.empty(), "%s sample (CPU): %s", what.c_str(), err.c_str());
  const std::vector<int64> got = RunSampleGpu<T>(c, in, seed, temperature, what + " sample");
  int64 differ = 0, invalid = 0;
  for (int64 i = 0; i < N; ++i) {
    differ += got[i] != want[i];
    invalid += !(got[i] >= 0 && got[i] < C) && got[i] != want[i];
  }
  HARNESS_EXPECT(invalid == 0, "%s sample: %" PRId64 " invalid classes", what.c_str(), invalid);
  HARNESS_EXPECT(differ <= 1 + N / 100, "%s sample: %" PRId64 " of %" PRId64
                 " classes differ from the CPU core's", what.c_str(), differ, N);
  HARNESS_EXPECT(got == RunSampleGpu<T>(c, in, seed, temperature, what + " sample again"),
                 "%s sample: a second run differs", what.c_str());

  // TopK: a small k (the chunked selection, in one step or several) and a large one (up to
  // 400: past the chunked selection's limit, where a block per row selects).
  const int64 small_k =
      C <= 64 && rng() % 2 ? C : 1 + static_cast<int64>(rng() % std::min<int64>(C, 8));
  const int64 large_k = std::min<int64>(C, 1 + static_cast<int64>(rng() % 400));
  TopKOut<T> top;
  std::string tk;
  int64 k = 0;
  for (const int64 each_k : {large_k, small_k}) {
    k = each_k;
    std::vector<double> lp64(N * k);
    std::vector<int64> cls64(N * k), expanded64(N);
    err = TopK<double>(view, p64, N, k, ThreadPoolFor(), lp64.data(), cls64.data(),
                       expanded64.data());
    HARNESS_EXPECT(err.empty(), "%s top_k (CPU): %s", what.c_str(), err.c_str());
    tk = what + " top_k (k=" + std::to_string(k) + ")";
    top = RunTopKGpu<T>(c, in, k, kDefaultGpuInferenceBudget, tk);
    Compare(tk + " log_probs", top.log_probs, lp64, rtol);
    int64 wrong = 0, ties = 0;
    for (int64 i = 0; i < N; ++i) {
      for (int64 j = 0; j < k; ++j) {
        const int64 g = top.classes[i * k + j];
        if (g < 0 || g >= C) {
          ++wrong;
          continue;
        }
        for (int64 j2 = 0; j2 < j; ++j2) wrong += top.classes[i * k + j2] == g;
        const double v = all64[i * C + g];
        const double tol = rtol * (std::fabs(v) + 1);
        wrong += !(std::fabs(top.log_probs[i * k + j] - v) <= tol);  // the value is g's
        if (g != cls64[i * k + j]) {
          if (std::fabs(v - lp64[i * k + j]) <= tol) {
            ++ties;
          } else {
            ++wrong;
          }
        }
      }
      wrong += top.expanded[i] != M;
    }
    HARNESS_EXPECT(wrong == 0, "%s: %" PRId64 " wrong classes", tk.c_str(), wrong);
    if (sizeof(T) == 8) {
      HARNESS_EXPECT(ties == 0, "%s: %" PRId64 " classes differ (near ties) in float64", tk.c_str(),
                     ties);
    }
    const TopKOut<T> waves = RunTopKGpu<T>(c, in, k, 1, tk + " in waves of one row");
    HARNESS_EXPECT(SameBits(top.log_probs, waves.log_probs) && top.classes == waves.classes,
                   "%s: waves of one row differ", tk.c_str());
  }
#ifdef TF_HSM_GPU_EMULATE
  for (auto schedule : {tf_hsm_emu::Schedule::kShuffled, tf_hsm_emu::Schedule::kReverse}) {
    tf_hsm_emu::SetSchedule(schedule, rng());
    const std::vector<T> all2 =
        RunLogProbAllGpu<T>(c, in, 0, C, kDefaultGpuInferenceBudget, what + " log_prob_all");
    const std::vector<int64> got2 = RunSampleGpu<T>(c, in, seed, temperature, what + " sample");
    const TopKOut<T> top2 = RunTopKGpu<T>(c, in, k, kDefaultGpuInferenceBudget, tk);
    tf_hsm_emu::SetSchedule(tf_hsm_emu::Schedule::kForward);
    HARNESS_EXPECT(SameBits(all, all2) && got == got2 && SameBits(top.log_probs, top2.log_probs) &&
                       top.classes == top2.classes,
                   "%s inference: another thread schedule changes a result", what.c_str());
  }
#endif
}

// NaN in one row's hidden state: only that row is NaN (LogProbAll), class -1 (Sample), NaN
// values and classes in id order (TopK), as the CPU core does.
void CheckInferenceNanRow(std::mt19937_64& rng) {
  Case c;
  c.name = "nan_row_inference";
  c.tree = Layout(RandomShape(rng, 40, 3, 0.3, 300), &rng);
  c.tokens = 20;
  c.dim = 13;
  Data<float> d = MakeData<float>(c, rng);
  for (int64 k = 0; k < c.dim; k += 4) d.hidden[7 * c.dim + k] = NAN;
  DeviceInputs<float> in(d);
  const TreeView view = c.tree.view();
  const int64 N = c.tokens, C = c.tree.num_classes, k = std::min<int64>(C, 5);
  const std::vector<float> all = RunLogProbAllGpu<float>(c, in, 0, C, kDefaultGpuInferenceBudget,
                                                         "nan_row log_prob_all");
  int64 bad = 0;
  for (int64 i = 0; i < N; ++i)
    for (int64 j = 0; j < C; ++j) bad += std::isnan(all[i * C + j]) != (i == 7);
  HARNESS_EXPECT(bad == 0, "nan_row log_prob_all: %" PRId64 " values with NaN in the wrong row", bad);
  const SoftmaxParams<float> p{d.hidden.data(), d.weights.data(), d.biases.data(), c.dim};
  std::vector<int64> want(N);
  Sample<float>(view, p, N, 42, 1.0f, ThreadPoolFor(), want.data());
  const std::vector<int64> got = RunSampleGpu<float>(c, in, 42, 1.0f, "nan_row sample");
  HARNESS_EXPECT(got[7] == -1 && want[7] == -1, "nan_row sample: class %" PRId64 " (CPU %" PRId64
                 ")", got[7], want[7]);
  std::vector<float> lp(N * k);
  std::vector<int64> cls(N * k), expanded(N);
  TopK<float>(view, p, N, k, ThreadPoolFor(), lp.data(), cls.data(), expanded.data());
  const TopKOut<float> top = RunTopKGpu<float>(c, in, k, kDefaultGpuInferenceBudget, "nan_row top_k");
  bad = 0;
  for (int64 j = 0; j < k; ++j) {
    bad += !std::isnan(top.log_probs[7 * k + j]) || top.classes[7 * k + j] != cls[7 * k + j];
  }
  HARNESS_EXPECT(bad == 0, "nan_row top_k: row 7 differs from the CPU core (%" PRId64 ")", bad);
}

// Children masked with a bias of -inf: 90% of a one-node tree's 1,100 children, so the
// first chunks and tiles hold no finite logit, and targets among the others. The GPU's
// log-probabilities and gradients are finite and match the CPU core in float64 (chunks
// of masked children fold to (max -inf, sum 0), not NaN), with the default budget and
// with the groups cut by blocks of children.
template <typename T>
void CheckMaskedChildren(std::mt19937_64& rng) {
  Case c;
  c.name = "masked_children";
  c.tree = Layout(TwoLevelShape(1100, 1100), &rng);
  c.tokens = 140;
  c.dim = 8;
  Data<T> d = MakeData<T>(c, rng);
  const int64 masked = 990;
  for (int64 j = 0; j < masked; ++j) d.biases[j] = -std::numeric_limits<T>::infinity();
  for (auto& t : d.targets) {
    t = c.tree.slot_child[masked + static_cast<int64>(rng() % (1100 - masked))];
  }
  const std::string what = std::string("masked_children") + (sizeof(T) == 4 ? " float32" : " float64");
  VisitPlan plan;
  const std::string err = BuildVisitPlan(c.tree.view(), d.targets.data(), c.tokens, &plan);
  HARNESS_EXPECT(err.empty(), "%s: %s", what.c_str(), err.c_str());
  if (!err.empty()) return;
  const Data<double> d64{Convert<double>(d.hidden), Convert<double>(d.weights),
                         Convert<double>(d.biases), Convert<double>(d.upstream), d.targets};
  const Result<double> ref = RunCpu<double>(c, plan, d64);
  DeviceInputs<T> in(d);
  const double rtol = sizeof(T) == 8 ? 1e-9 : 1e-3;
  const int64 coef = CoefElements(plan, c.tree);
  const auto finite = [](const auto& v) {
    return std::all_of(v.begin(), v.end(), [](auto x) { return std::isfinite(x); });
  };
  HARNESS_EXPECT(finite(ref.log_prob) && finite(ref.d_hidden), "%s: the CPU core is not finite",
                 what.c_str());
  for (const int64 budget : {c.budget, std::max<int64>(1, coef / 7)}) {
    const Result<T> gpu = RunGpu<T>(c, plan, in, budget, true, nullptr);
    const std::string at = what + " (coef budget " + std::to_string(budget) + ")";
    HARNESS_EXPECT(finite(gpu.log_prob) && finite(gpu.d_hidden), "%s: not finite", at.c_str());
    Compare(at + " log_prob", gpu.log_prob, ref.log_prob, rtol);
    Compare(at + " d_hidden", gpu.d_hidden, ref.d_hidden, rtol);
    Compare(at + " weight_rows", gpu.d_rows, ref.d_rows, rtol);
    Compare(at + " bias_rows", gpu.d_bias, ref.d_bias, rtol);
  }
  // A NaN logit among the masked children: every log-probability NaN, as one NaN makes a
  // log-sum-exp NaN (its chunk's max stays -inf, its sum is NaN).
  for (int64 k = 0; k < c.dim; ++k) d.weights[500 * c.dim + k] = NAN;
  DeviceInputs<T> nan_in(d);
  const Result<T> nan_out = RunGpu<T>(c, plan, nan_in, c.budget, false, nullptr);
  const bool all_nan = std::all_of(nan_out.log_prob.begin(), nan_out.log_prob.end(),
                                   [](T x) { return std::isnan(x); });
  HARNESS_EXPECT(all_nan, "%s: a NaN among masked children did not make every log_prob NaN",
                 what.c_str());
}

// NaN in one token's hidden state: only that token's log-probability is NaN.
void CheckNanStaysInItsRow(std::mt19937_64& rng) {
  Case c;
  c.name = "nan_row";
  c.tree = Layout(RandomShape(rng, 40, 3, 0.3, 300), &rng);
  c.tokens = 40;
  c.dim = 19;
  Data<float> d = MakeData<float>(c, rng);
  for (int64 k = 0; k < c.dim; k += 5) d.hidden[7 * c.dim + k] = NAN;
  VisitPlan plan;
  BuildVisitPlan(c.tree.view(), d.targets.data(), c.tokens, &plan);
  DeviceInputs<float> in(d);
  GpuLogProbPlan fwd;
  PrepareLogProbGpu<float>(plan, c.tree.view(), c.dim, c.bias, false, kDefaultGpuCoefBudget, &fwd);
  DeviceArray<float> out(c.tokens);
  out.Poison();
  DeviceBuffer ws(fwd.workspace_bytes);
  SoftmaxParams<float> p{in.hidden.data(), in.weights.data(), in.biases.data(), c.dim};
  const std::string err = LogProbForwardGpu<float>(fwd, p, out.data(), ws.ptr, nullptr);
  HARNESS_EXPECT(err.empty(), "nan_row: %s", err.c_str());
  const std::vector<float> lp = out.Download("nan_row log_prob", true);
  for (int64 i = 0; i < c.tokens; ++i) {
    HARNESS_EXPECT(std::isnan(lp[i]) == (i == 7), "nan_row: token %" PRId64 " isnan=%d", i,
                   static_cast<int>(std::isnan(lp[i])));
  }
}

// A batch of padding alone against the tree a table in pieces gets for it: the batch tree
// of no real target, one node of no children and no slot (tf_hsm/ops/compact.py), and
// weight and bias tables of no row. Every token gets log-probability 0 and a zero hidden
// gradient (its upstream NaN), and no weight row is in the gradient, on the GPU as in the
// CPU core; no kernel launches over an empty grid or reads past the empty tables.
template <typename T>
void CheckEmptyBatchTree(std::mt19937_64& rng) {
  Case c;
  c.name = "empty_batch_tree";
  c.tree.child_begin = {0, 0};
  c.tree.path_begin = {0, 0};
  c.tree.num_classes = 1;
  c.tokens = 6;
  c.dim = 5;
  Data<T> d;
  std::normal_distribution<double> normal(0, 1);
  d.hidden.resize(c.tokens * c.dim);
  for (auto& v : d.hidden) v = static_cast<T>(normal(rng));
  d.upstream.assign(c.tokens, std::numeric_limits<T>::quiet_NaN());
  d.targets.assign(c.tokens, -1);
  const std::string what = c.name + (sizeof(T) == 4 ? " float32" : " float64");
  VisitPlan plan;
  const std::string err = BuildVisitPlan(c.tree.view(), d.targets.data(), c.tokens, &plan,
                                         PlanFor::kBackward, Padding::kSkip);
  HARNESS_EXPECT(err.empty(), "%s: %s", what.c_str(), err.c_str());
  if (!err.empty()) return;
  HARNESS_EXPECT(plan.num_rows() == 0, "%s: %" PRId64 " rows planned", what.c_str(),
                 plan.num_rows());
  const Result<T> cpu = RunCpu<T>(c, plan, d);
  DeviceInputs<T> in(d);
  const Result<T> gpu = RunGpu<T>(c, plan, in, c.budget, true, nullptr);
  for (const Result<T>* r : {&cpu, &gpu}) {
    const bool zero = std::all_of(r->log_prob.begin(), r->log_prob.end(),
                                  [](T x) { return x == T(0); }) &&
                      std::all_of(r->d_hidden.begin(), r->d_hidden.end(),
                                  [](T x) { return x == T(0); });
    HARNESS_EXPECT(zero && r->d_rows.empty() && r->row_ids.empty(),
                   "%s (%s): a padded token has a value, a gradient or a row", what.c_str(),
                   r == &cpu ? "CPU" : "GPU");
  }
}

// ---- The cases ---------------------------------------------------------------------------

std::vector<Case> CorrectnessCases(std::mt19937_64& rng, bool quick) {
  std::vector<Case> cases;
  auto add = [&](const std::string& name, HostTree tree, int64 tokens, int64 dim, bool bias) {
    Case c;
    c.name = name;
    c.tree = std::move(tree);
    c.tokens = tokens;
    c.dim = dim;
    c.bias = bias;
    cases.push_back(std::move(c));
  };
  const int64 s = quick ? 1 : 4;  // size multiplier
  // Random mixed trees: leaves and internal children at one node, depths 1..10.
  const int64 branchings[] = {300, 2, 3, 5, 8, 17, 33, 70, 4, 6};
  for (int depth = 1; depth <= 10; ++depth) {
    const int64 b = branchings[depth - 1];
    const int64 dims[] = {1, 7, 16, 33, 64};
    add("random_mixed_d" + std::to_string(depth) + "_b" + std::to_string(b),
        Layout(RandomShape(rng, b, depth, depth == 1 ? 0.0 : std::min(0.85, 3.0 / (1 + b)), 400 * s), &rng),
        (quick ? 24 : 150) + static_cast<int64>(rng() % (30 * s)), dims[depth % 5],
        depth % 3 != 0);
  }
  add("balanced_b2", Layout(BalancedShape(quick ? 200 : 1000, 2), &rng), 40 * s, 24, true);
  add("balanced_b5", Layout(BalancedShape(quick ? 300 : 3000, 5), &rng), 40 * s, 40, false);
  add("balanced_b47_3level", Layout(BalancedShape(quick ? 3000 : 100000, 47), &rng), 50 * s,
      quick ? 16 : 64, true);
  add("two_level_sqrt", Layout(TwoLevelShape(quick ? 2500 : 100000, quick ? 50 : 317), &rng),
      60 * s, quick ? 20 : 128, true);
  add("huffman_b2", Layout(HuffmanShape(ZipfCounts(quick ? 500 : 10000, 1.0), 2), nullptr),
      60 * s, 20, true);
  add("huffman_b4", Layout(HuffmanShape(ZipfCounts(quick ? 500 : 10000, 1.0), 4), nullptr),
      60 * s, 12, false);
  add("clustered_two_level", Layout(ClusteredShape(ZipfCounts(quick ? 2000 : 50000, 1.0),
                                                   quick ? 20 : 200), &rng),
      70 * s, 24, true);
  add("chain_single_children_d10", Layout(ChainShape(10, 0), &rng), 30 * s, 9, true);
  add("chain_side3_d10", Layout(ChainShape(10, 3), &rng), 30 * s, 17, false);
  add("wide_root", Layout(TwoLevelShape(quick ? 1500 : 100000, quick ? 1500 : 100000), &rng),
      quick ? 20 : 300, quick ? 8 : 64, true);
  add("wide_under_single_child_root", Layout(TwoLevelShape(quick ? 700 : 30000, 1), &rng),
      quick ? 20 : 200, quick ? 8 : 32, true);
  add("wide_inner", Layout(TwoLevelShape(quick ? 1200 : 200000, 2), &rng), quick ? 20 : 300,
      quick ? 8 : 48, false);
  add("one_token", Layout(RandomShape(rng, 60, 4, 0.4, 500), &rng), 1, 10, true);
  add("no_tokens", Layout(RandomShape(rng, 10, 3, 0.4, 100), &rng), 0, 10, true);
  add("zero_dim_with_bias", Layout(RandomShape(rng, 50, 3, 0.4, 300), &rng), 30, 0, true);
  add("zero_dim_no_bias", Layout(RandomShape(rng, 50, 3, 0.4, 300), &rng), 30, 0, false);
  // Every token in one wide group: many 64-token tiles, chunks and long dW chains.
  add("many_tokens_one_node", Layout(TwoLevelShape(quick ? 600 : 5000, 1), &rng),
      quick ? 150 : 3000, quick ? 10 : 96, true);
  // A one-node tree (Tree.flat) past the CPU core's wide-group thresholds (>= 1,024
  // children, >= 128 tokens): the CPU reference takes its partitioned path, which
  // recomputes the logits from each visit's log-sum-exp in the gradient.
  add("flat_wide_group", Layout(TwoLevelShape(quick ? 1100 : 20000, quick ? 1100 : 20000), &rng),
      quick ? 140 : 600, quick ? 8 : 64, true);
  // The same with at most 16 tokens (16-token tiles in every wave, blocks of children too).
  add("flat_few_tokens", Layout(TwoLevelShape(quick ? 1100 : 20000, quick ? 1100 : 20000), &rng),
      12, quick ? 8 : 64, false);
  if (!quick) {
    add("wide_100k_big_dim", Layout(TwoLevelShape(100000, 1), &rng), 257, 300, true);
    add("huffman_b2_d512", Layout(HuffmanShape(ZipfCounts(100000, 1.0), 2), nullptr), 640, 512,
        true);
  }
  return cases;
}

// ---- Timing ------------------------------------------------------------------------------

#ifndef TF_HSM_GPU_EMULATE
// FMA throughput: independent chains per thread, so latency is hidden.
__global__ void FmaPeakKernel(float* out, int iterations, float x) {
  float a[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) a[k] = x + k + threadIdx.x;
  for (int i = 0; i < iterations; ++i) {
#pragma unroll
    for (int k = 0; k < 8; ++k) a[k] = fmaf(a[k], 0.9999f, 0.0001f);
  }
  float s = 0;
#pragma unroll
  for (int k = 0; k < 8; ++k) s += a[k];
  if (s == 1234.5f) out[threadIdx.x] = s;  // never true; keeps the work
}
#endif

struct Ceilings {
  double flops = 0;      // FLOP/s, FMA-throughput kernel
  double sgemm = 0;      // FLOP/s, cuBLAS (0 when not built with it)
  double bandwidth = 0;  // bytes/s, device-to-device copy
  std::string device;
};

Ceilings MeasureCeilings(const Options& opt) {
  Ceilings c;
#ifndef TF_HSM_GPU_EMULATE
  cudaDeviceProp prop;
  CudaOrDie(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  c.device = prop.name;
  float* sink = nullptr;
  CudaOrDie(cudaMalloc(&sink, 1024 * sizeof(float)), "cudaMalloc");
  const int blocks = prop.multiProcessorCount * 8, threads = 256, iterations = 1 << 14;
  const double fma_ms = TimeCalls(
      [&]() {
        FmaPeakKernel<<<blocks, threads>>>(sink, iterations, 1.0f);
        return std::string(cudaGetErrorString(cudaGetLastError())) == "no error"
                   ? std::string()
                   : std::string("FmaPeakKernel failed");
      },
      opt.warmup, opt.repeats);
  c.flops = 2.0 * 8 * iterations * blocks * threads / (fma_ms * 1e-3);
  cudaFree(sink);
  size_t free_bytes = 0, total_bytes = 0;
  CudaOrDie(cudaMemGetInfo(&free_bytes, &total_bytes), "cudaMemGetInfo");
  const size_t bytes = std::min<size_t>(size_t{1} << 30, free_bytes / 4);
  void *a = nullptr, *b = nullptr;
  CudaOrDie(cudaMalloc(&a, bytes), "cudaMalloc");
  CudaOrDie(cudaMalloc(&b, bytes), "cudaMalloc");
  CudaOrDie(cudaMemset(a, 0, bytes), "cudaMemset");
  const double copy_ms = TimeCalls(
      [&]() {
        const cudaError_t e = cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, nullptr);
        return e == cudaSuccess ? std::string() : std::string(cudaGetErrorString(e));
      },
      opt.warmup, opt.repeats);
  c.bandwidth = 2.0 * bytes / (copy_ms * 1e-3);
  cudaFree(a);
  cudaFree(b);
#ifdef TF_HSM_HAVE_CUBLAS
  {
    const int n = 8192;
    float *x = nullptr, *y = nullptr, *z = nullptr;
    CudaOrDie(cudaMalloc(&x, sizeof(float) * n * n), "cudaMalloc");
    CudaOrDie(cudaMalloc(&y, sizeof(float) * n * n), "cudaMalloc");
    CudaOrDie(cudaMalloc(&z, sizeof(float) * n * n), "cudaMalloc");
    cudaMemset(x, 0, sizeof(float) * n * n);
    cudaMemset(y, 0, sizeof(float) * n * n);
    cublasHandle_t handle;
    cublasCreate(&handle);
    cublasSetMathMode(handle, CUBLAS_PEDANTIC_MATH);  // plain FP32, like the HSM kernels
    const float one = 1, zero = 0;
    const double ms = TimeCalls(
        [&]() {
          cublasSgemm(handle, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &one, x, n, y, n, &zero, z, n);
          return std::string();
        },
        opt.warmup, opt.repeats);
    c.sgemm = 2.0 * n * n * n / (ms * 1e-3);
    cublasDestroy(handle);
    cudaFree(x);
    cudaFree(y);
    cudaFree(z);
  }
#endif
#else
  (void)opt;
  c.device = "host emulator";
#endif
  return c;
}

// A timing case with biases; `shrink` > 1 divides T (rows) and D (for a smoke run of the
// timing code in the emulator; the callers divide V).
Case TimingCase(const std::string& name, HostTree tree, int64 tokens, int64 dim, int64 shrink) {
  Case c;
  c.name = name;
  c.tree = std::move(tree);
  c.tokens = std::max<int64>(1, tokens / shrink);
  c.dim = std::max<int64>(1, dim / shrink);
  c.bias = true;
  return c;
}

// The scenarios of docs/performance.md and docs/gpu.md; `shrink` > 1 divides V, T and D.
std::vector<Case> TimingCases(std::mt19937_64& rng, int64 shrink) {
  std::vector<Case> cases;
  auto add = [&](const std::string& name, HostTree tree, int64 tokens, int64 dim) {
    cases.push_back(TimingCase(name, std::move(tree), tokens, dim, shrink));
  };
  // Scenario B: V = 100K, D = 512, T = 640 and 2560 (and 4096, where the GPU roofline target
  // is set).
  {
    const int64 V = 100000 / shrink;
    const HostTree two = Layout(TwoLevelShape(V, 317 / shrink), &rng);
    const HostTree three = Layout(BalancedShape(V, 47), &rng);
    const HostTree huff = Layout(HuffmanShape(ZipfCounts(V, 1.0), 2), nullptr);
    for (int64 T : {640, 2560, 4096}) {
      add("B_two_level_317_T" + std::to_string(T), two, T, 512);
      add("B_three_level_47_T" + std::to_string(T), three, T, 512);
      add("B_huffman_T" + std::to_string(T), huff, T, 512);
    }
  }
  // Scenario C: V = 793471, D = 512, T = 320 (and 2560, where the full-softmax comparison's
  // target is set).
  {
    const int64 V = 793471 / shrink;
    const std::vector<double> counts = ZipfCounts(V, 1.0);
    const HostTree two = Layout(TwoLevelShape(V, 891 / shrink), &rng);
    add("C_two_level_891", two, 320, 512);
    add("C_two_level_891_T2560", two, 2560, 512);
    add("C_huffman", Layout(HuffmanShape(counts, 2), nullptr), 320, 512);
    add("C_clustered_891", Layout(ClusteredShape(counts, 891 / shrink), nullptr), 320, 512);
  }
  // Scenario D: V = 1M, D = 300, T = 256, 3200 and 4096.
  {
    const int64 V = 1000000 / shrink;
    const HostTree two = Layout(TwoLevelShape(V, 1000 / shrink), &rng);
    const HostTree huff = Layout(HuffmanShape(ZipfCounts(V, 1.0), 2), nullptr);
    for (int64 T : {256, 3200, 4096}) {
      add("D_two_level_1000_T" + std::to_string(T), two, T, 300);
      add("D_huffman_T" + std::to_string(T), huff, T, 300);
    }
  }
  // The exact softmax as a one-node tree (Tree.flat): V = 100K, D = 256, T = 1,024 (the CPU
  // bench's comparison with TF's dense softmax) and V = 1M, D = 300, T = 3,200, where the
  // backward's coefficients exceed the budget and go by blocks of children.
  add("F_flat_V100K_T1024", Layout(TwoLevelShape(100000 / shrink, 100000 / shrink), &rng), 1024,
      256);
  add("F_flat_V1M_T3200", Layout(TwoLevelShape(1000000 / shrink, 1000000 / shrink), &rng), 3200,
      300);
  // Scenario M, V = 1M, D = 300, T = 3,200 (last: the cases before it keep their data): a
  // 16-ary Huffman tree on the Zipf counts with targets drawn by those counts (the shape of
  // one tree of a mixture, frequent classes near the root), and the shared head of 128
  // classes and the tail's slot as a one-node tree scoring every token.
  {
    const int64 V = 1000000 / shrink;
    add("mixture_tree16_T3200", Layout(HuffmanShape(ZipfCounts(V, 1.0), 16), nullptr), 3200,
        300);
    cases.back().ranked = true;
    add("mixture_head129_T3200", Layout(TwoLevelShape(129, 129), nullptr), 3200, 300);
  }
  return cases;
}

void TimeCase(const Case& c, std::mt19937_64& rng, const Options& opt, const Ceilings& ceil,
              FILE* json) {
  const Data<float> data = MakeData<float>(c, rng);
  VisitPlan plan;
  const auto h0 = std::chrono::steady_clock::now();
  const std::string err = BuildVisitPlan(c.tree.view(), data.targets.data(), c.tokens, &plan);
  GpuLogProbPlan fwd;
  PrepareLogProbGpu<float>(plan, c.tree.view(), c.dim, c.bias, false, kDefaultGpuCoefBudget, &fwd);
  const double host_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - h0).count();
  if (!err.empty()) {
    std::fprintf(stderr, "%s: %s\n", c.name.c_str(), err.c_str());
    ++failures;
    return;
  }
  DeviceInputs<float> in(data);
  const Result<float> gpu = RunGpu<float>(c, plan, in, c.budget, true, &opt);
  if (opt.check_timed) {
    const Data<double> d64{Convert<double>(data.hidden), Convert<double>(data.weights),
                           Convert<double>(data.biases), Convert<double>(data.upstream),
                           data.targets};
    const Result<double> ref = RunCpu<double>(c, plan, d64);
    Compare(c.name + " log_prob", gpu.log_prob, ref.log_prob, 1e-3);
    Compare(c.name + " d_hidden", gpu.d_hidden, ref.d_hidden, 1e-3);
    Compare(c.name + " weight_rows", gpu.d_rows, ref.d_rows, 1e-3);
  }
  // Roofline counts as in docs/performance.md.
  double visits_k = 0;  // sum over visits of the node's branching
  for (int64 g = 0; g < plan.num_groups(); ++g) {
    const int64 n = plan.group_node[g];
    visits_k += static_cast<double>(plan.group_begin[g + 1] - plan.group_begin[g]) *
                (c.tree.child_begin[n + 1] - c.tree.child_begin[n]);
  }
  const double D = c.dim, T = c.tokens, R = plan.num_rows();
  const double fwd_flops = 2 * D * visits_k, bwd_flops = 2 * fwd_flops;
  const double fwd_bytes = 4 * D * R + 4 * T * D;
  const double bwd_bytes = 4 * D * R + 4 * D * R + 8 * T * D;
  const double peak = ceil.sgemm > 0 ? ceil.sgemm : ceil.flops;
  const double fwd_floor = 1e3 * std::max(fwd_flops / peak, fwd_bytes / ceil.bandwidth);
  const double bwd_floor = 1e3 * std::max(bwd_flops / peak, bwd_bytes / ceil.bandwidth);
  std::printf("  %-26s V=%-7" PRId64 " D=%-4" PRId64 " T=%-5" PRId64 " rows=%-8" PRId64
              " | fwd %8.3f ms (floor %7.3f, %5.1f%%) | bwd %8.3f ms (floor %7.3f, %5.1f%%)"
              " | host plan %.2f ms\n",
              c.name.c_str(), c.tree.num_classes, c.dim, c.tokens, plan.num_rows(),
              gpu.forward_ms, fwd_floor, 100 * fwd_floor / gpu.forward_ms, gpu.backward_ms,
              bwd_floor, 100 * bwd_floor / gpu.backward_ms, host_ms);
  std::fflush(stdout);
  if (json != nullptr) {
    std::fprintf(json,
                 "{\"case\": \"%s\", \"device\": \"%s\", \"classes\": %" PRId64
                 ", \"dim\": %" PRId64 ", \"tokens\": %" PRId64 ", \"rows\": %" PRId64
                 ", \"max_depth\": %" PRId64 ", \"forward_ms\": %.4f, \"backward_ms\": %.4f"
                 ", \"forward_floor_ms\": %.4f, \"backward_floor_ms\": %.4f"
                 ", \"forward_flops\": %.6g, \"backward_flops\": %.6g"
                 ", \"forward_bytes\": %.6g, \"backward_bytes\": %.6g, \"host_plan_ms\": %.4f"
                 ", \"peak_flops\": %.6g, \"fma_flops\": %.6g, \"sgemm_flops\": %.6g"
                 ", \"bandwidth\": %.6g}\n",
                 c.name.c_str(), ceil.device.c_str(), c.tree.num_classes, c.dim, c.tokens,
                 plan.num_rows(), c.tree.max_depth, gpu.forward_ms, gpu.backward_ms, fwd_floor,
                 bwd_floor, fwd_flops, bwd_flops, fwd_bytes, bwd_bytes, host_ms, peak,
                 ceil.flops, ceil.sgemm, ceil.bandwidth);
    std::fflush(json);
  }
}

// The inference kernels at the `topk` scenario's sizes (V = 1M, D = 64, 64 rows, 2-level and
// binary Huffman) and at B's (V = 100K, D = 512, 640 rows); `shrink` as above.
std::vector<Case> InferenceTimingCases(int64 shrink, std::mt19937_64& rng) {
  std::vector<Case> cases;
  cases.push_back(TimingCase("infer_two_level_1000_V1M",
                             Layout(TwoLevelShape(1000000 / shrink, 1000 / shrink), &rng), 64,
                             64, shrink));
  cases.push_back(TimingCase("infer_huffman_V1M",
                             Layout(HuffmanShape(ZipfCounts(1000000 / shrink, 1.0), 2), nullptr),
                             64, 64, shrink));
  cases.push_back(TimingCase("infer_two_level_317_V100K",
                             Layout(TwoLevelShape(100000 / shrink, 317 / shrink), &rng), 640,
                             512, shrink));
  return cases;
}

// log_prob_all (every class), top_k (k = 10) and sample of one case, each timed like the
// training kernels (median of cudaEvent-timed calls, the upload of the tree included)
// against its floor: log_prob_all and top_k evaluate every node for every row
// (2 D N S FLOPs; the table, the rows and, for log_prob_all, the N x V output move once);
// sample evaluates the nodes on each row's sampled path (counted after the run).
void TimeInferenceCase(const Case& c, std::mt19937_64& rng, const Options& opt,
                       const Ceilings& ceil, FILE* json) {
  const Data<float> data = MakeData<float>(c, rng);
  DeviceInputs<float> in(data);
  const TreeView view = c.tree.view();
  const int64 N = c.tokens, C = c.tree.num_classes, S = view.num_slots, k = std::min<int64>(10, C);
  const double D = static_cast<double>(c.dim);
  const SoftmaxParams<float> p = DeviceParams(c, in);
  GpuInferencePlan all_plan, top_plan, sample_plan;
  std::string err = PrepareLogProbAllGpu<float>(view, N, c.dim, c.bias, 0, C,
                                                kDefaultGpuInferenceBudget, &all_plan);
  if (err.empty()) {
    err = PrepareTopKGpu<float>(view, N, c.dim, c.bias, k, kDefaultGpuInferenceBudget, &top_plan);
  }
  if (err.empty()) err = PrepareSampleGpu<float>(view, N, c.dim, c.bias, &sample_plan);
  HARNESS_EXPECT(err.empty(), "%s: %s", c.name.c_str(), err.c_str());
  if (!err.empty()) return;
  DeviceArray<float> all(N * C), top_lp(N * k);
  DeviceArray<int64> top_cls(N * k), expanded(N), sampled(N);
  all.Poison();
  top_lp.Poison();
  for (auto* a : {&top_cls, &expanded, &sampled}) a->Poison();
  DeviceBuffer ws_all(all_plan.workspace_bytes), ws_top(top_plan.workspace_bytes),
      ws_sample(sample_plan.workspace_bytes);
  const std::uint64_t seed = rng();
  const double all_ms = TimeCalls(
      [&]() { return LogProbAllGpu<float>(all_plan, p, all.data(), ws_all.ptr, nullptr); },
      opt.warmup, opt.repeats);
  const double top_ms = TimeCalls(
      [&]() {
        return TopKGpu<float>(top_plan, p, top_lp.data(), top_cls.data(), expanded.data(),
                              ws_top.ptr, nullptr);
      },
      opt.warmup, opt.repeats);
  const double sample_ms = TimeCalls(
      [&]() {
        return SampleGpu<float>(sample_plan, p, seed, 1.0f, sampled.data(), ws_sample.ptr,
                                nullptr);
      },
      opt.warmup, opt.repeats);
  CudaOrDie(cudaDeviceSynchronize(), "inference kernels");
  if (opt.check_timed) {
    // The timed outputs against the CPU core in float64: log_prob_all to tolerance, top_k's
    // values to tolerance and its classes' own log-probabilities equal to its values.
    const std::vector<double> h64 = Convert<double>(data.hidden),
                              w64 = Convert<double>(data.weights),
                              b64 = Convert<double>(data.biases);
    const SoftmaxParams<double> p64{h64.data(), w64.data(), c.bias ? b64.data() : nullptr,
                                    c.dim};
    std::vector<double> all64(N * C), lp64(N * k);
    std::vector<int64> cls64(N * k), expanded64(N);
    err = LogProbAll<double>(view, p64, N, 0, C, ThreadPoolFor(), all64.data());
    if (err.empty()) {
      err = TopK<double>(view, p64, N, k, ThreadPoolFor(), lp64.data(), cls64.data(),
                         expanded64.data());
    }
    HARNESS_EXPECT(err.empty(), "%s (CPU): %s", c.name.c_str(), err.c_str());
    Compare(c.name + " log_prob_all", all.Download((c.name + " all").c_str(), true), all64, 1e-3);
    const std::vector<float> top_values = top_lp.Download((c.name + " top_k").c_str(), true);
    Compare(c.name + " top_k log_probs", top_values, lp64, 1e-3);
    const std::vector<int64> top_classes = top_cls.Download((c.name + " top_k").c_str(), true);
    int64 wrong = 0;
    for (int64 i = 0; i < N * k; ++i) {
      const int64 g = top_classes[i];
      wrong += g < 0 || g >= C ||
               !(std::fabs(top_values[i] - all64[i / k * C + g]) <= 1e-3 * (std::fabs(lp64[i]) + 1));
    }
    HARNESS_EXPECT(wrong == 0, "%s top_k: %" PRId64 " classes whose log-probability is not the "
                   "value given", c.name.c_str(), wrong);
  }
  // The sampled paths' branching, for sample's floor.
  const std::vector<int64> classes = sampled.Download((c.name + " sample").c_str(), true);
  double path_k = 0;
  for (const int64 cls : classes) {
    if (cls < 0 || cls >= C) continue;
    for (int64 q = view.path_begin[cls]; q < view.path_begin[cls + 1]; ++q) {
      const int64 node = view.path_nodes[q];
      path_k += static_cast<double>(view.child_begin[node + 1] - view.child_begin[node]);
    }
  }
  const double peak = ceil.sgemm > 0 ? ceil.sgemm : ceil.flops;
  auto floor_ms = [&](double flops, double bytes) {
    return 1e3 * std::max(flops / peak, bytes / ceil.bandwidth);
  };
  const double every_node = 2 * D * N * S;
  const double all_floor = floor_ms(every_node, 4 * (D * S + S + D * N + double(N) * C));
  const double top_floor = floor_ms(every_node, 4 * (D * S + S + D * N));
  const double sample_floor = floor_ms(2 * D * path_k, 4 * (D + 1) * path_k + 4 * D * N);
  std::printf("  %-26s V=%-7" PRId64 " D=%-4" PRId64 " rows=%-4" PRId64
              " | log_prob_all %8.3f ms (%5.1f%%) | top_k %8.3f ms (%5.1f%%)"
              " | sample %7.3f ms (%5.1f%%)\n",
              c.name.c_str(), C, c.dim, N, all_ms, 100 * all_floor / all_ms, top_ms,
              100 * top_floor / top_ms, sample_ms, 100 * sample_floor / sample_ms);
  std::fflush(stdout);
  if (json != nullptr) {
    std::fprintf(json,
                 "{\"case\": \"%s\", \"device\": \"%s\", \"classes\": %" PRId64
                 ", \"dim\": %" PRId64 ", \"rows\": %" PRId64
                 ", \"log_prob_all_ms\": %.4f, \"log_prob_all_floor_ms\": %.4f"
                 ", \"top_k_ms\": %.4f, \"top_k_floor_ms\": %.4f, \"k\": %" PRId64
                 ", \"sample_ms\": %.4f, \"sample_floor_ms\": %.4f}\n",
                 c.name.c_str(), ceil.device.c_str(), C, c.dim, N, all_ms, all_floor, top_ms,
                 top_floor, k, sample_ms, sample_floor);
    std::fflush(json);
  }
}

// The host side of a GPU call at the timing scenarios' full sizes: the visit plan and the
// forward and backward work lists (what each op call builds before its kernels). No kernel
// runs, so this works in the emulator build and on a machine without a GPU.
void TimeHostPlans(std::mt19937_64& rng, const Options& opt) {
  auto median_ms = [&](const std::function<void()>& work) {
    std::vector<double> ms;
    for (int r = 0; r < std::max(1, opt.repeats); ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      work();
      ms.push_back(
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(ms.begin(), ms.end());
    return ms[ms.size() / 2];
  };
  std::printf("host plans (median of %d): visit plan | forward work lists | backward work lists"
              " | workspaces\n",
              std::max(1, opt.repeats));
  for (const Case& c : TimingCases(rng, 1)) {
    if (!opt.only.empty() && c.name.find(opt.only) == std::string::npos) continue;
    const std::vector<int64> targets = MakeTargets(c, rng);
    VisitPlan plan;
    std::string err;
    const double plan_ms = median_ms(
        [&]() { err = BuildVisitPlan(c.tree.view(), targets.data(), c.tokens, &plan); });
    HARNESS_EXPECT(err.empty(), "%s: %s", c.name.c_str(), err.c_str());
    if (!err.empty()) continue;
    GpuLogProbPlan fwd, bwd;
    const double fwd_ms = median_ms([&]() {
      err = PrepareLogProbGpu<float>(plan, c.tree.view(), c.dim, c.bias, false,
                                     kDefaultGpuCoefBudget, &fwd);
    });
    const double bwd_ms = median_ms([&]() {
      err = PrepareLogProbGpu<float>(plan, c.tree.view(), c.dim, c.bias, true,
                                     kDefaultGpuCoefBudget, &bwd);
    });
    HARNESS_EXPECT(err.empty(), "%s: %s", c.name.c_str(), err.c_str());
    std::printf("  %-26s T=%-5" PRId64 " entries=%-7zu groups=%-7" PRId64
                " | %7.3f ms | %7.3f ms | %7.3f ms | forward %.1f MB, backward %.1f MB in %zu"
                " waves\n",
                c.name.c_str(), c.tokens, plan.entry_token.size(), plan.num_groups(), plan_ms,
                fwd_ms, bwd_ms, fwd.workspace_bytes / 1e6, bwd.workspace_bytes / 1e6,
                bwd.waves.size());
    std::fflush(stdout);
  }
}

// The checks of special inputs (a NaN row, masked children, an empty batch tree), each named like a case so
// that --only selects it.
void CheckSpecialInputs(std::mt19937_64& rng, const Options& opt) {
  const auto selected = [&](const char* name) {
    return opt.only.empty() || std::string(name).find(opt.only) != std::string::npos;
  };
  const auto report = [](const char* name, int before) {
    std::printf("[%s] %s\n", failures == before ? "PASS" : "FAIL", name);
  };
  if (selected("nan_row")) {
    int before = failures;
    CheckNanStaysInItsRow(rng);
    report("nan_row", before);
    before = failures;
    CheckInferenceNanRow(rng);
    report("nan_row_inference", before);
  }
  if (selected("empty_batch_tree")) {
    const int before = failures;
    CheckEmptyBatchTree<double>(rng);
    CheckEmptyBatchTree<float>(rng);
    report("empty_batch_tree", before);
  }
  if (selected("masked_children")) {
    const int before = failures;
    CheckMaskedChildren<double>(rng);
    CheckMaskedChildren<float>(rng);
    report("masked_children", before);
  }
}

int Main(int argc, char** argv) {
  Options opt;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--quick") {
      opt.quick = true;
    } else if (a == "--full") {
      opt.quick = false;
    } else if (a == "--time") {
      opt.time = true;
    } else if (a == "--time-only") {
      opt.time = true;
      opt.check = false;
    } else if (a == "--plan-only") {
      opt.plan_only = true;
      opt.check = false;
    } else if (a == "--hash") {
      opt.hash = true;
    } else if (a == "--check-timed") {
      opt.check_timed = true;
    } else if (a == "--verbose" || a == "-v") {
      opt.verbose = true;
    } else if (a == "--seed") {
      opt.seed = std::strtoull(value().c_str(), nullptr, 10);
    } else if (a == "--only") {
      opt.only = value();
    } else if (a == "--json") {
      opt.json = value();
    } else if (a == "--repeats") {
      opt.repeats = std::atoi(value().c_str());
    } else if (a == "--warmup") {
      opt.warmup = std::atoi(value().c_str());
    } else {
      std::fprintf(stderr,
                   "usage: gpu_harness [--quick|--full] [--time|--time-only|--plan-only]\n"
                   "                   [--check-timed] [--hash]\n"
                   "                   [--only SUBSTRING] [--seed N] [--json FILE]\n"
                   "                   [--repeats N] [--warmup N] [--verbose]\n");
      return 2;
    }
  }
  std::printf("tf_hsm GPU harness (%s), %s cases, seed %" PRIu64 "\n",
              kEmulated ? "host emulator" : "CUDA", opt.quick ? "quick" : "full", opt.seed);
  std::mt19937_64 rng(opt.seed);
  if (opt.check) {
    const std::vector<Case> cases = CorrectnessCases(rng, opt.quick);
    for (const Case& c : cases) {
      if (!opt.only.empty() && c.name.find(opt.only) == std::string::npos) continue;
      const int before = failures;
      CheckCase<double>(c, rng, opt);
      CheckCase<float>(c, rng, opt);
      std::printf("[%s] %s\n", failures == before ? "PASS" : "FAIL", c.name.c_str());
      std::fflush(stdout);
    }
    CheckSpecialInputs(rng, opt);
  }
  if (opt.plan_only) TimeHostPlans(rng, opt);
  if (opt.time) {
    if (kEmulated) {
      // A smoke run of the timing code on scenarios shrunk 32x: the times mean nothing.
      std::printf("timing in the host emulator: scenarios shrunk 32x, times meaningless\n");
      Ceilings ceil;
      ceil.flops = 1e12;
      ceil.bandwidth = 1e11;
      ceil.device = "host emulator";
      Options quick = opt;
      quick.warmup = 0;
      quick.repeats = 1;
      FILE* json = opt.json.empty() ? nullptr : std::fopen(opt.json.c_str(), "w");
      for (const Case& c : TimingCases(rng, 32)) {
        if (!opt.only.empty() && c.name.find(opt.only) == std::string::npos) continue;
        TimeCase(c, rng, quick, ceil, json);
      }
      for (const Case& c : InferenceTimingCases(32, rng)) {
        if (!opt.only.empty() && c.name.find(opt.only) == std::string::npos) continue;
        TimeInferenceCase(c, rng, quick, ceil, json);
      }
      if (json != nullptr) std::fclose(json);
    } else {
      const Ceilings ceil = MeasureCeilings(opt);
      std::printf("device %s: FMA kernel %.1f TFLOP/s, cuBLAS SGEMM %s, copy %.0f GB/s\n",
                  ceil.device.c_str(), ceil.flops / 1e12,
                  ceil.sgemm > 0 ? (std::to_string(ceil.sgemm / 1e12) + " TFLOP/s").c_str()
                                 : "not built",
                  ceil.bandwidth / 1e9);
      FILE* json = opt.json.empty() ? nullptr : std::fopen(opt.json.c_str(), "w");
      for (const Case& c : TimingCases(rng, 1)) {
        if (!opt.only.empty() && c.name.find(opt.only) == std::string::npos) continue;
        TimeCase(c, rng, opt, ceil, json);
      }
      for (const Case& c : InferenceTimingCases(1, rng)) {
        if (!opt.only.empty() && c.name.find(opt.only) == std::string::npos) continue;
        TimeInferenceCase(c, rng, opt, ceil, json);
      }
      if (json != nullptr) std::fclose(json);
    }
  }
  std::printf("%d checks, %d failed\n", checks, failures);
  return failures == 0 ? 0 : 1;
}

}  // namespace harness
}  // namespace tf_hsm

int main(int argc, char** argv) { return tf_hsm::harness::Main(argc, argv); }
