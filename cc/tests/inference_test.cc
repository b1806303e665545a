// Unit tests of the inference core (cc/core/inference.h): top-k, all log-probabilities,
// sampling and candidate log-probabilities against a long-double reference written from
// the definition, on random trees of mixed shape; tie order; results independent of the
// thread count; a chi-square test of the sampler; and every malformed input the core
// must reject without reading out of bounds.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "cc/core/inference.h"
#include "cc/tests/test_util.h"

namespace tf_hsm {
namespace {

using namespace ::tf_hsm::testing;  // NOLINT: the shared test vocabulary

template <typename T>
struct Problem {
  int64 N = 0, D = 0;
  std::vector<T> h, w, b;
  bool bias = false;
  SoftmaxParams<T> params() const {
    SoftmaxParams<T> p;
    p.hidden = h.data();
    p.weights = w.data();
    p.biases = bias ? b.data() : nullptr;
    p.dim = D;
    return p;
  }
};

template <typename T>
Problem<T> RandomProblem(std::mt19937_64& rng, const Layout& t, int64 N, int64 D, bool bias,
                         double scale) {
  std::normal_distribution<double> normal(0, 1);
  Problem<T> pr;
  pr.N = N;
  pr.D = D;
  pr.bias = bias;
  pr.h.resize(N * D);
  pr.w.resize(t.num_slots() * D);
  pr.b.resize(t.num_slots());
  for (auto& v : pr.h) v = normal(rng);
  for (auto& v : pr.w) v = scale * normal(rng);
  for (auto& v : pr.b) v = normal(rng);
  return pr;
}

// log P(c | h_i) for every row and class, in long double, from the definition: a sweep
// over the nodes in id order (parents first).
template <typename T>
std::vector<long double> Reference(const Layout& t, const Problem<T>& pr, double temperature = 1) {
  const int64 C = t.num_classes, M = t.num_nodes(), D = pr.D;
  std::vector<long double> out(pr.N * C), node(M);
  for (int64 i = 0; i < pr.N; ++i) {
    node[0] = 0;
    for (int64 n = 0; n < M; ++n) {
      const int64 b = t.child_begin[n], e = t.child_begin[n + 1];
      std::vector<long double> z(e - b);
      long double m = -INFINITY;
      for (int64 s = b; s < e; ++s) {
        long double acc = pr.bias ? pr.b[s] : 0;
        for (int64 d = 0; d < D; ++d) acc += (long double)pr.h[i * D + d] * pr.w[s * D + d];
        z[s - b] = acc / temperature;
        m = std::max(m, z[s - b]);
      }
      long double sum = 0;
      for (auto v : z) sum += std::exp(v - m);
      const long double lse = m + std::log(sum);
      for (int64 s = b; s < e; ++s) {
        const long double v = node[n] + z[s - b] - lse;
        const int64 code = t.slot_child[s];
        if (code < C) {
          out[i * C + code] = v;
        } else {
          node[code - C] = v;
        }
      }
    }
  }
  return out;
}

bool Close(long double a, long double ref, double tol) {
  return std::fabs((double)(a - ref)) <= tol * (1 + std::fabs((double)ref));
}

template <typename T>
struct TopKResult {
  std::vector<T> log_probs;
  std::vector<int64> classes, expanded;
  std::string err;
};

template <typename T>
TopKResult<T> RunTopK(const Layout& t, const Problem<T>& pr, int64 k, const ParallelFor& pf) {
  TopKResult<T> r;
  r.log_probs.resize(pr.N * k);
  r.classes.resize(pr.N * k);
  r.expanded.resize(pr.N);
  r.err = TopK<T>(t.view(), pr.params(), pr.N, k, pf, r.log_probs.data(), r.classes.data(),
                  r.expanded.data());
  return r;
}

template <typename T>
std::vector<T> RunAll(const Layout& t, const Problem<T>& pr, int64 begin, int64 end,
                      const ParallelFor& pf, std::string* err = nullptr,
                      SweepPlanCache* cache = nullptr) {
  std::vector<T> out(pr.N * std::max<int64>(end - begin, 0));
  const std::string e =
      LogProbAll<T>(t.view(), pr.params(), pr.N, begin, end, pf, out.data(), cache);
  if (err != nullptr) *err = e;
  EXPECT(err != nullptr || e.empty(), "LogProbAll: %s", e.c_str());
  return out;
}

// ---------------------------------------------------------------------------------------

template <typename T>
void CheckTopK(std::mt19937_64& rng, const Layout& t, int64 N, int64 D, bool bias, double tol,
               const char* what) {
  const Problem<T> pr = RandomProblem<T>(rng, t, N, D, bias, 0.5);
  const std::vector<long double> ref = Reference(t, pr);
  const int64 C = t.num_classes;
  for (int64 k : {int64{1}, std::min<int64>(5, C), C}) {
    const TopKResult<T> r = RunTopK(t, pr, k, SerialFor);
    EXPECT(r.err.empty(), "%s: %s", what, r.err.c_str());
    for (int64 i = 0; i < N; ++i) {
      std::vector<long double> sorted(ref.begin() + i * C, ref.begin() + (i + 1) * C);
      std::sort(sorted.rbegin(), sorted.rend());
      std::vector<char> used(C, 0);
      for (int64 j = 0; j < k; ++j) {
        const T v = r.log_probs[i * k + j];
        const int64 c = r.classes[i * k + j];
        EXPECT(c >= 0 && c < C && !used[c], "%s row %ld: class %ld repeated or invalid", what,
               (long)i, (long)c);
        if (c < 0 || c >= C) continue;
        used[c] = 1;
        EXPECT(j == 0 || r.log_probs[i * k + j - 1] >= v, "%s: not sorted", what);
        EXPECT(Close(v, ref[i * C + c], tol), "%s k=%ld row %ld: class %ld value %g ref %g", what,
               (long)k, (long)i, (long)c, (double)v, (double)ref[i * C + c]);
        EXPECT(Close(v, sorted[j], tol), "%s k=%ld row %ld rank %ld: %g vs sorted ref %g", what,
               (long)k, (long)i, (long)j, (double)v, (double)sorted[j]);
      }
      EXPECT(r.expanded[i] >= 1 && r.expanded[i] <= t.num_nodes(), "%s: expanded %ld of %ld",
             what, (long)r.expanded[i], (long)t.num_nodes());
      if (k == C) {
        EXPECT(r.expanded[i] == t.num_nodes(), "%s: k = C expanded %ld of %ld nodes", what,
               (long)r.expanded[i], (long)t.num_nodes());
      }
    }
  }
}

void TestTopKAgainstReference() {
  std::mt19937_64 rng(11);
  for (int trial = 0; trial < 24; ++trial) {
    const int64 branching = 1 + trial % 6 * 9;  // 1 .. 46
    const Layout t = RandomLayout(rng, branching, 1 + trial % 7, 0.35, 300);
    const int64 D = 1 + rng() % 24, N = rng() % 40;
    CheckTopK<double>(rng, t, N, D, trial % 2 == 0, 1e-10, "double");
    CheckTopK<float>(rng, t, N, D, trial % 3 == 0, 2e-4, "float");
  }
  const Layout wide = RandomLayout(rng, 600, 2, 0.01, 3000);  // nodes wider than a tile
  CheckTopK<double>(rng, wide, 20, 9, true, 1e-10, "wide double");
  CheckTopK<float>(rng, wide, 20, 9, true, 2e-4, "wide float");
  // Nodes of ~38 KB of float weights: 70 rows search in two items of 35 that share passes.
  CheckTopK<float>(rng, wide, 70, 16, true, 2e-4, "wide float, 35-row items");
}

void TestTopKTies() {
  // All-zero weights on a complete binary tree: every class has the same log-probability
  // bit for bit, so the smallest ids come first.
  const Layout t = Balanced(32, 2);
  Problem<float> pr;
  pr.N = 3;
  pr.D = 4;
  pr.h.assign(pr.N * pr.D, 1.0f);
  pr.w.assign(t.num_slots() * pr.D, 0.0f);
  const TopKResult<float> r = RunTopK(t, pr, 7, SerialFor);
  EXPECT(r.err.empty(), "%s", r.err.c_str());
  for (int64 i = 0; i < pr.N; ++i)
    for (int64 j = 0; j < 7; ++j)
      EXPECT(r.classes[i * 7 + j] == j, "tie order: row %ld rank %ld class %ld", (long)i,
             (long)j, (long)r.classes[i * 7 + j]);
  // Root -> [class 1, node 1 -> [class 0]]: class 0 ties with class 1 but sits below a
  // node of the same value, which must be expanded before class 1 is final.
  const Layout chain = MakeLayout(2, {0, 2, 3}, {1, 3, 0});
  Problem<double> pc;
  pc.N = 1;
  pc.D = 2;
  pc.h = {0.5, -1};
  pc.w.assign(chain.num_slots() * pc.D, 0.0);
  const TopKResult<double> rc = RunTopK(chain, pc, 2, SerialFor);
  EXPECT(rc.err.empty(), "%s", rc.err.c_str());
  EXPECT(rc.classes[0] == 0 && rc.classes[1] == 1, "chain tie order %ld %ld",
         (long)rc.classes[0], (long)rc.classes[1]);
  EXPECT(rc.log_probs[0] == rc.log_probs[1], "chain tie values");
}

void TestTopKPrunes() {
  // Peaked logits on a two-level tree: the search must expand far fewer nodes than exist.
  std::mt19937_64 rng(12);
  std::vector<int64> cb = {0}, sc;
  const int64 clusters = 40, per = 50, C = clusters * per;
  for (int64 j = 0; j < clusters; ++j) sc.push_back(C + 1 + j);
  cb.push_back(clusters);
  for (int64 j = 0; j < clusters; ++j) {
    for (int64 c = 0; c < per; ++c) sc.push_back(j * per + c);
    cb.push_back(static_cast<int64>(sc.size()));
  }
  const Layout t = MakeLayout(C, cb, sc);
  const Problem<float> pr = RandomProblem<float>(rng, t, 64, 16, true, 1.0);
  const TopKResult<float> r = RunTopK(t, pr, 5, SerialFor);
  EXPECT(r.err.empty(), "%s", r.err.c_str());
  double mean = 0;
  for (int64 e : r.expanded) mean += e / 64.0;
  EXPECT(mean < 0.5 * t.num_nodes(), "mean expanded %g of %ld nodes", mean, (long)t.num_nodes());
  std::printf("  two-level %ld classes, k=5: %.2f of %ld nodes expanded per row\n", (long)C, mean,
              (long)t.num_nodes());
}

template <typename T>
void CheckLogProbAll(std::mt19937_64& rng, const Layout& t, int64 N, int64 D, bool bias,
                     double tol, const char* what, bool with_top_k = true) {
  const Problem<T> pr = RandomProblem<T>(rng, t, N, D, bias, 0.5);
  const std::vector<long double> ref = Reference(t, pr);
  const int64 C = t.num_classes;
  const std::vector<T> all = RunAll(t, pr, 0, C, SerialFor);
  for (int64 i = 0; i < N * C; ++i) {
    EXPECT(Close(all[i], ref[i], tol), "%s [%ld] %g vs %g", what, (long)i, (double)all[i],
           (double)ref[i]);
  }
  // Chunks are the slices of the full result, bit for bit.
  for (int trial = 0; trial < 3; ++trial) {
    int64 b = rng() % (C + 1), e = rng() % (C + 1);
    if (b > e) std::swap(b, e);
    const std::vector<T> part = RunAll(t, pr, b, e, ThreadedFor(3));
    bool same = true;
    for (int64 i = 0; i < N; ++i)
      for (int64 c = b; c < e; ++c)
        same = same && std::memcmp(&part[i * (e - b) + c - b], &all[i * C + c], sizeof(T)) == 0;
    EXPECT(same, "%s chunk [%ld, %ld) differs from the full result", what, (long)b, (long)e);
  }
  // From 16 rows on (the packed kernel) a row's values do not depend on the rows batched
  // with it: its first 16 rows alone give the same bits as within all N (tiles of one,
  // two and four row groups).
  if (N > 16) {
    Problem<T> head = pr;
    head.N = 16;
    head.h.resize(16 * D);
    const std::vector<T> alone = RunAll(t, head, 0, C, ThreadedFor(2));
    EXPECT(std::memcmp(alone.data(), all.data(), alone.size() * sizeof(T)) == 0,
           "%s: the first 16 rows alone differ from the same rows among %ld", what, (long)N);
  }
  // TopK with k = C sees the same values; bit for bit when fewer than 16 rows share a
  // node (neither uses the packed kernel then, and the dot-product kernels agree).
  if (N > 0 && with_top_k) {
    const TopKResult<T> r = RunTopK(t, pr, C, ThreadedFor(2));
    bool same = true, close = true;
    for (int64 i = 0; i < N; ++i) {
      for (int64 j = 0; j < C; ++j) {
        const T a = r.log_probs[i * C + j], b = all[i * C + r.classes[i * C + j]];
        same = same && a == b;
        close = close && Close(a, b, tol);
      }
    }
    EXPECT(close, "%s: top_k values differ from log_prob_all", what);
    EXPECT(same || N >= 16, "%s: top_k values differ from log_prob_all in the last bits", what);
  }
}

// The tree with class c renamed C - 1 - c: a binary tree's two-class nodes then hold their
// classes in decreasing order (not runs), as a Huffman tree over classes ordered by
// decreasing frequency does, while every subtree still covers consecutive classes.
Layout ReversedClasses(const Layout& t) {
  std::vector<int64> slots = t.slot_child;
  for (int64& code : slots) code = code < t.num_classes ? t.num_classes - 1 - code : code;
  return MakeLayout(t.num_classes, t.child_begin, slots);
}

// The tree with node order[i] renumbered i (order[0] must be the root, parents before
// children).
Layout RenumberedNodes(const Layout& t, const std::vector<int64>& order) {
  const int64 C = t.num_classes, M = t.num_nodes();
  std::vector<int64> id(M), begin = {0}, slots;
  for (int64 i = 0; i < M; ++i) id[order[i]] = i;
  for (int64 n : order) {
    for (int64 s = t.child_begin[n]; s < t.child_begin[n + 1]; ++s) {
      const int64 code = t.slot_child[s];
      slots.push_back(code < C ? code : C + id[code - C]);
    }
    begin.push_back(static_cast<int64>(slots.size()));
  }
  return MakeLayout(C, begin, slots);
}

// The tree with the nodes of each level renumbered in a random order (parents still
// before children): a level's nodes are then not consecutive per subtree.
Layout ShuffledLevels(std::mt19937_64& rng, const Layout& t) {
  const int64 C = t.num_classes, M = t.num_nodes();
  std::vector<int64> depth(M, 0), order;
  for (int64 n = 0; n < M; ++n)
    for (int64 s = t.child_begin[n]; s < t.child_begin[n + 1]; ++s)
      if (t.slot_child[s] >= C) depth[t.slot_child[s] - C] = depth[n] + 1;
  for (int64 d = 0, n = 0; n < M; ++d) {
    const size_t first = order.size();
    for (int64 m = 0; m < M; ++m)
      if (depth[m] == d) order.push_back(m), ++n;
    std::shuffle(order.begin() + first, order.end(), rng);
  }
  return RenumberedNodes(t, order);
}

// The tree with its nodes numbered depth-first (preorder): a node's depth then does not
// grow with its id.
Layout DepthFirstNodes(const Layout& t) {
  const int64 C = t.num_classes;
  std::vector<int64> order, stack = {0};
  while (!stack.empty()) {
    const int64 n = stack.back();
    stack.pop_back();
    order.push_back(n);
    for (int64 s = t.child_begin[n + 1] - 1; s >= t.child_begin[n]; --s) {
      if (t.slot_child[s] >= C) stack.push_back(t.slot_child[s] - C);
    }
  }
  return RenumberedNodes(t, order);
}

void TestLogProbAll() {
  std::mt19937_64 rng(13);
  for (int trial = 0; trial < 20; ++trial) {
    const Layout t = RandomLayout(rng, 1 + trial % 5 * 11, 1 + trial % 6, 0.4, 400);
    const int64 D = 1 + rng() % 30, N = rng() % 90;  // up to two row blocks
    CheckLogProbAll<double>(rng, t, N, D, trial % 2 == 1, 1e-10, "double");
    CheckLogProbAll<float>(rng, t, N, D, trial % 3 == 1, 2e-4, "float");
  }
  const Layout wide = RandomLayout(rng, 700, 2, 0.02, 5000);
  CheckLogProbAll<double>(rng, wide, 70, 7, true, 1e-10, "wide double");
  CheckLogProbAll<float>(rng, wide, 70, 7, false, 2e-4, "wide float");
  CheckLogProbAll<float>(rng, Balanced(1000, 2), 5, 3, true, 2e-4, "binary float");
  // 16 or more rows take the rows-in-lanes sweep: runs of consecutive classes (written
  // through register transposes), a partial last row group, a second row block, and flat
  // roots too wide for their logits to stay in scratch.
  CheckLogProbAll<float>(rng, Balanced(3000, 60), 40, 9, true, 2e-4, "runs float");
  CheckLogProbAll<double>(rng, Balanced(3000, 60), 70, 9, false, 1e-10, "runs double");
  CheckLogProbAll<float>(rng, Balanced(1000, 2), 17, 4, true, 2e-4, "binary float, 17 rows");
  CheckLogProbAll<float>(rng, Balanced(9000, 9000), 40, 5, true, 2e-4, "flat float");
  CheckLogProbAll<double>(rng, Balanced(9000, 9000), 20, 5, true, 1e-10, "flat double");
  // Outputs of 32 MB or more are written past the caches, staged 64 classes at a time; an
  // odd number of classes starts the output rows at every alignment.
  CheckLogProbAll<float>(rng, Balanced((int64{1} << 19) + 9, 725), 16, 3, true, 2e-4,
                         "streamed float");
  CheckLogProbAll<double>(rng, Balanced((int64{1} << 18) + 9, 513), 16, 3, false, 1e-10,
                          "streamed double");
  // Levels of many chunks keep whole row blocks together: tiles of four row groups (with
  // a partial last group for double), streamed too.
  CheckLogProbAll<float>(rng, Balanced(3000, 60), 70, 60, true, 2e-4, "many chunks float");
  CheckLogProbAll<double>(rng, Balanced(3000, 60), 61, 60, false, 1e-10, "many chunks double");
  CheckLogProbAll<float>(rng, Balanced((int64{1} << 17) + 9, 362), 64, 3, true, 2e-4,
                         "streamed float, 64 rows", /*with_top_k=*/false);
  CheckLogProbAll<float>(rng, Balanced((int64{1} << 18) + 9, 513), 40, 3, false, 2e-4,
                         "streamed float, 40 rows (a partial group)", /*with_top_k=*/false);
  // A root as wide, whose children are a node and classes in descending order (no run).
  const int64 wide_c = 9000;
  std::vector<int64> wide_slots = {wide_c + 1};
  for (int64 c = wide_c - 1; c >= 2; --c) wide_slots.push_back(c);
  wide_slots.push_back(0);
  wide_slots.push_back(1);
  const Layout scattered = MakeLayout(wide_c, {0, wide_c - 1, wide_c + 1}, wide_slots);
  CheckLogProbAll<float>(rng, scattered, 33, 4, true, 2e-4, "wide scattered float");
  // Deep binary trees with 64 or more nodes on a level are swept subtree by subtree below
  // it (per-thread node values); with classes in decreasing order, an item's classes are
  // gathered and written as one range. Levels numbered out of subtree order have no
  // such groups.
  const Layout binary = Balanced(3000, 2), reversed = ReversedClasses(binary);
  CheckLogProbAll<float>(rng, reversed, 40, 5, true, 2e-4, "reversed binary float");
  CheckLogProbAll<double>(rng, reversed, 20, 5, false, 1e-10, "reversed binary double");
  CheckLogProbAll<float>(rng, binary, 64, 5, true, 2e-4, "binary float, 64 rows");
  CheckLogProbAll<double>(rng, reversed, 70, 3, true, 1e-10,
                          "reversed binary double, 70 rows (a second block of 6)");
  CheckLogProbAll<float>(rng, ShuffledLevels(rng, reversed), 40, 5, true, 2e-4,
                         "shuffled-levels reversed binary float");
  CheckLogProbAll<float>(rng, DepthFirstNodes(reversed), 40, 5, true, 2e-4,
                         "depth-first reversed binary float");
  CheckLogProbAll<double>(rng, DepthFirstNodes(RandomLayout(rng, 4, 6, 0.5, 300)), 7, 3, true,
                          1e-10, "depth-first random double");
  // The same values, column for column, whichever way the classes are numbered; with
  // 2^19 + 9 classes and 16 rows the output is streamed (gathered ranges and runs).
  {
    const Layout big = Balanced((int64{1} << 19) + 9, 2), big_reversed = ReversedClasses(big);
    const int64 C = big.num_classes;
    const Problem<float> pr = RandomProblem<float>(rng, big, 16, 3, true, 0.5);
    const std::vector<float> a = RunAll(big, pr, 0, C, ThreadedFor(2));
    const std::vector<float> b = RunAll(big_reversed, pr, 0, C, ThreadedFor(3));
    bool same = true;
    for (int64 i = 0; i < pr.N; ++i)
      for (int64 c = 0; c < C; ++c)
        same = same && std::memcmp(&a[i * C + c], &b[i * C + C - 1 - c], sizeof(float)) == 0;
    EXPECT(same, "streamed binary: reversed class numbering changes the values");
    double mass = 0;
    for (int64 c = 0; c < C; ++c) mass += std::exp(static_cast<double>(a[c]));
    EXPECT(std::fabs(mass - 1) < 1e-3, "streamed binary: row 0 sums to %g", mass);
  }
}

// A kept plan serves only the tree it was made from. Every call below gives the bits of
// planning afresh: the same tree again, other trees of the same sizes written over it in
// place (the same addresses), other batch sizes; a malformed tree written in place is
// still rejected.
void CheckPlanCacheSequence(std::mt19937_64& rng, const std::vector<Layout>& trees,
                            const char* what) {
  Layout t = trees[0];  // the cache sees t's buffers throughout
  const int64* const begin_at = t.child_begin.data();
  const int64* const slots_at = t.slot_child.data();
  SweepPlanCache cache;
  for (size_t i = 0; i < trees.size(); ++i) {
    const Layout& next = trees[i];
    EXPECT(next.child_begin.size() == t.child_begin.size() &&
               next.slot_child.size() == t.slot_child.size(),
           "%s: tree %zu has other sizes", what, i);
    std::copy(next.child_begin.begin(), next.child_begin.end(), t.child_begin.begin());
    std::copy(next.slot_child.begin(), next.slot_child.end(), t.slot_child.begin());
    // The first call meets the plan kept for the tree before (same rows per block); then
    // a kept plan is reused, replaced for another block size, and made again.
    for (int64 rows : {40, 40, 7, 40}) {
      const Problem<float> pr = RandomProblem<float>(rng, t, rows, 5, true, 0.5);
      const std::vector<float> fresh = RunAll(t, pr, 0, t.num_classes, ThreadedFor(2));
      const std::vector<float> kept =
          RunAll(t, pr, 0, t.num_classes, ThreadedFor(3), nullptr, &cache);
      EXPECT(std::memcmp(fresh.data(), kept.data(), fresh.size() * sizeof(float)) == 0,
             "%s: tree %zu, %ld rows: the cached plan changes the values", what, i, (long)rows);
    }
  }
  EXPECT(t.child_begin.data() == begin_at && t.slot_child.data() == slots_at,
         "%s: the trees were not written in place", what);
  t.slot_child[t.num_slots() / 2] = t.num_classes + t.num_nodes();  // no such node
  const Problem<float> pr = RandomProblem<float>(rng, t, 40, 5, true, 0.5);
  std::string err;
  RunAll(t, pr, 0, t.num_classes, ThreadedFor(2), &err, &cache);
  EXPECT(err.find("malformed tree") != std::string::npos,
         "%s: a malformed tree written over a kept plan's: %s", what, err.c_str());
}

void TestLogProbAllPlanCache() {
  std::mt19937_64 rng(29);
  // Binary trees of one size differ in slot_child only; these 2-level trees (clusters of
  // 3 and 5 classes, then 5 and 3) in child_begin as well.
  const Layout binary = Balanced(3000, 2);
  CheckPlanCacheSequence(rng, {binary, ReversedClasses(binary), ShuffledLevels(rng, binary),
                               binary}, "binary");
  const Layout three_five = MakeLayout(8, {0, 2, 5, 10}, {9, 10, 0, 1, 2, 3, 4, 5, 6, 7});
  const Layout five_three = MakeLayout(8, {0, 2, 7, 10}, {9, 10, 0, 1, 2, 3, 4, 5, 6, 7});
  CheckPlanCacheSequence(rng, {three_five, five_three, three_five}, "2-level");

  // One cache shared by two threads (a TF kernel may run on several at once), each with
  // its own tree of the same sizes: they keep replacing each other's plan.
  const Layout trees[2] = {binary, ShuffledLevels(rng, binary)};
  const Problem<float> pr = RandomProblem<float>(rng, binary, 40, 5, true, 0.5);
  std::vector<float> fresh[2];
  for (int i = 0; i < 2; ++i) fresh[i] = RunAll(trees[i], pr, 0, binary.num_classes, SerialFor);
  SweepPlanCache shared;
  std::atomic<int> wrong{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < 2; ++i) {
    threads.emplace_back([&, i] {
      for (int rep = 0; rep < 20; ++rep) {
        std::string err;
        const std::vector<float> out =
            RunAll(trees[i], pr, 0, binary.num_classes, SerialFor, &err, &shared);
        if (!err.empty() ||
            std::memcmp(out.data(), fresh[i].data(), out.size() * sizeof(float)) != 0) {
          wrong.fetch_add(1);
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT(wrong.load() == 0, "a shared cache gave %d wrong results of 40", wrong.load());
}

// Upper quantile of chi-square with df degrees of freedom at z standard deviations
// (Wilson-Hilferty); z = 6 puts a false failure near 1e-9.
double ChiSquareThreshold(double df, double z) {
  const double a = 2.0 / (9.0 * df);
  return df * std::pow(1 - a + z * std::sqrt(a), 3);
}

template <typename T>
void CheckSampleDistribution(std::mt19937_64& rng, const Layout& t, double temperature,
                             const char* what) {
  const int64 C = t.num_classes, D = 6, draws = 40000;
  Problem<T> one = RandomProblem<T>(rng, t, 1, D, true, 0.7);
  Problem<T> pr = one;
  pr.N = draws;
  pr.h.resize(draws * D);
  for (int64 i = 0; i < draws; ++i) std::copy(one.h.begin(), one.h.end(), pr.h.begin() + i * D);
  std::vector<int64> out(draws);
  const std::string err = Sample<T>(t.view(), pr.params(), draws, 12345, T(temperature),
                                    ThreadedFor(2), out.data());
  EXPECT(err.empty(), "%s", err.c_str());
  const std::vector<long double> ref = Reference(t, one, temperature);
  std::vector<double> count(C, 0);
  for (int64 c : out) {
    EXPECT(c >= 0 && c < C, "%s: sampled %ld", what, (long)c);
    if (c >= 0 && c < C) ++count[c];
  }
  // Pool classes with expected count < 5 into one bin.
  double chi2 = 0, pooled_obs = 0, pooled_exp = 0;
  int64 bins = 0;
  for (int64 c = 0; c < C; ++c) {
    const double expected = draws * std::exp((double)ref[c]);
    if (expected < 5) {
      pooled_obs += count[c];
      pooled_exp += expected;
      continue;
    }
    chi2 += (count[c] - expected) * (count[c] - expected) / expected;
    ++bins;
  }
  if (pooled_exp > 0) {
    chi2 += (pooled_obs - pooled_exp) * (pooled_obs - pooled_exp) / std::max(pooled_exp, 1.0);
    ++bins;
  }
  const double limit = ChiSquareThreshold(std::max<int64>(bins - 1, 1), 6);
  EXPECT(chi2 < limit, "%s: chi-square %g over %ld bins exceeds %g", what, chi2, (long)bins, limit);
  std::printf("  %s: chi-square %.1f, %ld bins, threshold %.1f\n", what, chi2, (long)bins, limit);
}

void TestSample() {
  std::mt19937_64 rng(14);
  // Random trees with 30..80 classes.
  auto tree = [&rng](int64 branching, int64 depth) {
    for (;;) {
      Layout t = RandomLayout(rng, branching, depth, 0.5, 60);
      if (t.num_classes >= 30 && t.num_classes <= 80) return t;
    }
  };
  CheckSampleDistribution<double>(rng, tree(8, 4), 1.0, "double T=1");
  CheckSampleDistribution<float>(rng, tree(8, 4), 1.0, "float T=1");
  CheckSampleDistribution<float>(rng, tree(6, 5), 2.5, "float T=2.5");
  CheckSampleDistribution<double>(rng, tree(3, 8), 0.5, "double deep T=0.5");
  CheckSampleDistribution<float>(rng, RandomLayout(rng, 200, 1, 0.0, 200), 0.7, "float wide T=0.7");
  // Reproducible, and independent of threads; another seed gives other samples.
  const Layout t = RandomLayout(rng, 20, 4, 0.4, 500);
  const Problem<float> pr = RandomProblem<float>(rng, t, 300, 8, true, 0.5);
  std::vector<int64> a(pr.N), b(pr.N), c(pr.N);
  Sample<float>(t.view(), pr.params(), pr.N, 7, 1.0f, SerialFor, a.data());
  Sample<float>(t.view(), pr.params(), pr.N, 7, 1.0f, ThreadedFor(3), b.data());
  Sample<float>(t.view(), pr.params(), pr.N, 8, 1.0f, SerialFor, c.data());
  EXPECT(a == b, "samples depend on threads");
  EXPECT(a != c, "seed has no effect");
  // A tiny temperature samples the mode of each node's softmax.
  Sample<float>(t.view(), pr.params(), pr.N, 9, 1e-30f, SerialFor, c.data());
  const std::vector<long double> ref = Reference(t, pr, 1e-6);
  for (int64 i = 0; i < pr.N; ++i) {
    EXPECT(c[i] >= 0 && ref[i * t.num_classes + c[i]] > -1e-3, "row %ld: greedy class %ld",
           (long)i, (long)c[i]);
  }
}

template <typename T>
void CheckCandidates(std::mt19937_64& rng, const Layout& t, int64 N, int64 Mc, double tol,
                     const char* what) {
  const Problem<T> pr = RandomProblem<T>(rng, t, N, 1 + rng() % 20, rng() % 2, 0.5);
  const std::vector<long double> ref = Reference(t, pr);
  std::vector<int64> cand(N * Mc);
  for (auto& c : cand) c = rng() % t.num_classes;
  if (N * Mc > 1) cand[1] = cand[0];  // repeated candidates
  std::vector<T> out(N * Mc), out2(N * Mc);
  std::string err = LogProbCandidates<T>(t.view(), pr.params(), N, cand.data(), Mc, SerialFor,
                                         out.data());
  EXPECT(err.empty(), "%s", err.c_str());
  for (int64 i = 0; i < N; ++i)
    for (int64 m = 0; m < Mc; ++m)
      EXPECT(Close(out[i * Mc + m], ref[i * t.num_classes + cand[i * Mc + m]], tol),
             "%s (%ld, %ld): %g vs %g", what, (long)i, (long)m, (double)out[i * Mc + m],
             (double)ref[i * t.num_classes + cand[i * Mc + m]]);
  err = LogProbCandidates<T>(t.view(), pr.params(), N, cand.data(), Mc, ThreadedFor(3),
                             out2.data());
  EXPECT(SameBits(out, out2), "%s: candidates depend on threads", what);
}

void TestCandidates() {
  std::mt19937_64 rng(15);
  for (int trial = 0; trial < 16; ++trial) {
    const Layout t = RandomLayout(rng, 1 + trial % 4 * 15, 1 + trial % 6, 0.4, 300);
    const int64 N = rng() % 80, Mc = rng() % 9;
    CheckCandidates<double>(rng, t, N, Mc, 1e-10, "double");
    CheckCandidates<float>(rng, t, N, Mc, 2e-4, "float");
  }
  CheckCandidates<float>(rng, RandomLayout(rng, 500, 2, 0.02, 3000), 70, 30, 2e-4, "wide");
}

void TestDeterminism() {
  std::mt19937_64 rng(16);
  const Layout t = RandomLayout(rng, 40, 4, 0.2, 3000);
  const Problem<float> pr = RandomProblem<float>(rng, t, 150, 19, true, 0.3);
  const TopKResult<float> a = RunTopK(t, pr, 9, SerialFor);
  const std::vector<float> all_a = RunAll(t, pr, 0, t.num_classes, SerialFor);
  for (int threads : {2, 5}) {
    const TopKResult<float> b = RunTopK(t, pr, 9, ThreadedFor(threads));
    EXPECT(SameBits(a.log_probs, b.log_probs) && a.classes == b.classes &&
               a.expanded == b.expanded,
           "top_k depends on threads (%d)", threads);
    EXPECT(SameBits(all_a, RunAll(t, pr, 0, t.num_classes, ThreadedFor(threads))),
           "log_prob_all depends on threads (%d)", threads);
  }
  // Wide nodes, where rows search in larger items (here 3 of 64 rows and one of 22).
  const Layout wide = RandomLayout(rng, 600, 2, 0.01, 3000);
  const Problem<float> pw = RandomProblem<float>(rng, wide, 214, 16, true, 0.5);
  const TopKResult<float> wa = RunTopK(wide, pw, 9, SerialFor);
  for (int threads : {2, 5}) {
    const TopKResult<float> wb = RunTopK(wide, pw, 9, ThreadedFor(threads));
    EXPECT(wa.err.empty() && SameBits(wa.log_probs, wb.log_probs) && wa.classes == wb.classes &&
               wa.expanded == wb.expanded,
           "top_k over wide nodes depends on threads (%d)", threads);
  }
}

void TestNonFinite() {
  std::mt19937_64 rng(17);
  const Layout t = RandomLayout(rng, 10, 3, 0.4, 100);
  Problem<float> pr = RandomProblem<float>(rng, t, 6, 5, true, 0.5);
  pr.h[2 * pr.D + 1] = NAN;
  const TopKResult<float> r = RunTopK(t, pr, 3, SerialFor);
  EXPECT(r.err.empty(), "%s", r.err.c_str());
  for (int64 i = 0; i < pr.N; ++i)
    EXPECT(std::isnan(r.log_probs[i * 3]) == (i == 2), "top_k nan row %ld", (long)i);
  const std::vector<float> all = RunAll(t, pr, 0, t.num_classes, SerialFor);
  for (int64 i = 0; i < pr.N; ++i)
    EXPECT(std::isnan(all[i * t.num_classes]) == (i == 2), "log_prob_all nan row %ld", (long)i);
  std::vector<int64> s(pr.N);
  Sample<float>(t.view(), pr.params(), pr.N, 1, 1.0f, SerialFor, s.data());
  for (int64 i = 0; i < pr.N; ++i)
    EXPECT((s[i] == -1) == (i == 2), "sample nan row %ld -> %ld", (long)i, (long)s[i]);
  // A -inf bias masks its class for sampling and top-k.
  Problem<float> masked = RandomProblem<float>(rng, t, 200, 5, true, 0.5);
  const int64 slot = t.path_slots[t.path_begin[0 + 1] - 1];  // class 0's last slot
  masked.b[slot] = -INFINITY;
  std::vector<int64> sm(masked.N);
  Sample<float>(t.view(), masked.params(), masked.N, 3, 1.0f, SerialFor, sm.data());
  for (int64 c : sm) EXPECT(c != 0 && c >= 0, "masked class sampled: %ld", (long)c);
  // log_prob_all with 16 or more rows (the packed sweep), on a binary tree (the two-child
  // nodes' path, where d = z1 - z0 is +-inf) and a mixed one: a NaN row is NaN throughout
  // and only there; a -inf bias gives its class -inf and its siblings all of the mass.
  for (const Layout& l : {Balanced(64, 2), t}) {
    const int64 C = l.num_classes;
    Problem<float> big = RandomProblem<float>(rng, l, 20, 5, true, 0.5);
    big.h[2 * big.D + 1] = NAN;
    big.b[l.path_slots[l.path_begin[1] - 1]] = -INFINITY;  // class 0's last slot
    const std::vector<float> a = RunAll(l, big, 0, C, ThreadedFor(2));
    for (int64 i = 0; i < big.N; ++i) {
      double mass = 0;
      bool nan = true, any_nan = false;
      for (int64 c = 0; c < C; ++c) {
        nan = nan && std::isnan(a[i * C + c]);
        any_nan = any_nan || std::isnan(a[i * C + c]);
        mass += std::exp(static_cast<double>(a[i * C + c]));
      }
      if (i == 2) {
        EXPECT(nan, "log_prob_all packed: row 2 (NaN input) not NaN throughout");
        continue;
      }
      EXPECT(!any_nan && a[i * C] == -INFINITY && std::fabs(mass - 1) < 1e-4,
             "log_prob_all packed, row %ld: class 0 %g, total probability %g", (long)i,
             (double)a[i * C], mass);
    }
  }
}

// The whole range's plan checks a large tree's nodes in parallel chunks (2^14 nodes each)
// and names a problem as the serial walk does, the first in id order, for any thread
// count: a node or class made a child twice from another chunk (leaving another
// unreached, or not: an extra slot), and two problems in different chunks.
void TestValidationLargeTree(std::mt19937_64& rng) {
  auto has = [](const std::string& s, const char* what) { return s.find(what) != std::string::npos; };
  const Layout big = Balanced(40000, 2);
  const int64 Cb = big.num_classes;
  auto errors = [&](const Layout& l, const ParallelFor& pf) {
    const Problem<float> pl = RandomProblem<float>(rng, l, 2, 3, true, 0.5);
    std::string e;
    RunAll(l, pl, 0, Cb, pf, &e);
    return e;
  };
  EXPECT(errors(big, ThreadedFor(3)).empty(), "well-formed large tree");
  // Node 5's first slot takes over a node (or class) that is a child in the last chunk.
  auto from_last_chunk = [&](bool node) {
    for (int64 s = big.num_slots() - 1; s >= 0; --s)
      if ((big.slot_child[s] >= Cb) == node) return big.slot_child[s];
    return int64{-1};
  };
  Layout twice = big;
  twice.slot_child[twice.child_begin[5]] = from_last_chunk(true);
  Layout class_twice = big;
  class_twice.slot_child[class_twice.child_begin[5]] = from_last_chunk(false);
  Layout two_problems = class_twice;
  two_problems.slot_child[two_problems.num_slots() - 1] = -7;
  // Node 5 with one slot more, repeating such a child: nothing is left unreached.
  auto extra_slot = [&](int64 code) {
    Layout l = big;
    l.slot_child.insert(l.slot_child.begin() + l.child_begin[6], code);
    for (int64 n = 6; n <= l.num_nodes(); ++n) ++l.child_begin[n];
    return l;
  };
  Layout extra_node = extra_slot(from_last_chunk(true));
  Layout extra_class = extra_slot(from_last_chunk(false));
  for (const Layout* l : {&twice, &class_twice, &two_problems, &extra_node, &extra_class}) {
    const std::string serial = errors(*l, SerialFor);
    EXPECT(has(serial, "malformed tree"), "large tree: %s", serial.c_str());
    for (int threads : {2, 3}) {
      const std::string e = errors(*l, ThreadedFor(threads));
      EXPECT(e == serial, "large tree, %d threads: '%s' vs serial '%s'", threads, e.c_str(),
             serial.c_str());
    }
  }
}

void TestValidation() {
  std::mt19937_64 rng(18);
  const Layout t = RandomLayout(rng, 6, 3, 0.5, 40);
  const int64 C = t.num_classes;
  const Problem<float> pr = RandomProblem<float>(rng, t, 5, 3, true, 0.5);
  auto topk_err = [&](const Layout& l, int64 k) { return RunTopK(l, pr, k, SerialFor).err; };
  auto all_err = [&](const Layout& l, int64 b, int64 e) {
    std::string err;
    RunAll(l, pr, b, e, SerialFor, &err);
    return err;
  };
  auto sample_err = [&](const Layout& l, float temp) {
    std::vector<int64> out(pr.N);
    return Sample<float>(l.view(), pr.params(), pr.N, 1, temp, SerialFor, out.data());
  };
  auto has = [](const std::string& s, const char* what) { return s.find(what) != std::string::npos; };
  EXPECT(has(topk_err(t, 0), "k = 0"), "k=0");
  EXPECT(has(topk_err(t, C + 1), "k = "), "k=C+1");
  EXPECT(topk_err(t, C).empty(), "k=C");
  EXPECT(has(all_err(t, -1, 3), "class_range"), "range -1");
  EXPECT(has(all_err(t, 3, 2), "class_range"), "range reversed");
  EXPECT(has(all_err(t, 0, C + 1), "class_range"), "range beyond C");
  EXPECT(all_err(t, 2, 2).empty(), "empty range");
  for (float temp : {0.0f, -1.0f, NAN, INFINITY})
    EXPECT(has(sample_err(t, temp), "temperature"), "temperature %g", temp);
  std::vector<int64> cand = {0, C, 1, 2, 3, 4, 0, 1, 2, 3};
  std::vector<float> out(10);
  std::string err = LogProbCandidates<float>(t.view(), pr.params(), 5, cand.data(), 2, SerialFor,
                                             out.data());
  EXPECT(has(err, "candidates[0, 1]"), "candidate out of range: %s", err.c_str());
  cand[1] = -4;
  err = LogProbCandidates<float>(t.view(), pr.params(), 5, cand.data(), 2, SerialFor, out.data());
  EXPECT(has(err, "= -4"), "negative candidate: %s", err.c_str());

  // Malformed trees: every op reports it, none reads out of bounds (run under ASan to be
  // sure; here at least nothing crashes).
  auto check_all_ops = [&](const Layout& bad, const char* pattern, const char* what) {
    const std::string e1 = topk_err(bad, bad.num_classes), e2 = all_err(bad, 0, bad.num_classes);
    const std::string e3 = sample_err(bad, 1.0f);
    EXPECT(has(e1, pattern), "%s top_k: %s", what, e1.c_str());
    EXPECT(has(e2, pattern), "%s log_prob_all: %s", what, e2.c_str());
    (void)e3;  // sampling may not reach the bad node; it must only not crash
  };
  Layout bad = t;
  bad.slot_child[0] = C + bad.num_nodes();
  check_all_ops(bad, "slot_child[0]", "code past the end");
  bad = t;
  bad.slot_child[0] = -1;
  check_all_ops(bad, "slot_child[0]", "negative code");
  bad = t;
  bad.slot_child[0] = C;  // the root as its own child
  check_all_ops(bad, "numbered after its parent", "cycle");
  bad = t;
  bad.child_begin[1] = 1 << 30;
  check_all_ops(bad, "child_begin", "slot range");
  bad = t;
  bad.child_begin[1] = bad.child_begin[0];
  check_all_ops(bad, "child_begin", "empty node");
  // A one-node tree (the exact softmax, blocked products from 16 rows) whose node's slot
  // range leaves the table: the blocked path declines it, the search reports it.
  const Layout flat = Balanced(300, 300);
  const Problem<float> rows16 = RandomProblem<float>(rng, flat, 16, 3, true, 0.5);
  EXPECT(flat.num_nodes() == 1 && RunTopK(flat, rows16, 5, SerialFor).err.empty(), "flat tree");
  for (int64 first : {int64{-1}, int64{0}}) {
    Layout bad_flat = flat;
    bad_flat.child_begin = {first, first + 300};
    if (first == 0) bad_flat.slot_child.resize(200);  // the node names 100 slots too many
    std::string e_all;
    RunAll(bad_flat, rows16, 0, 300, SerialFor, &e_all);
    const std::string e_top = RunTopK(bad_flat, rows16, 5, SerialFor).err;
    EXPECT(has(e_all, "child_begin"), "flat tree from slot %ld: log_prob_all: %s", (long)first,
           e_all.c_str());
    EXPECT(has(e_top, "child_begin"), "flat tree from slot %ld: top_k: %s", (long)first,
           e_top.c_str());
  }
  // A class listed twice (another one is then missing).
  bad = t;
  std::vector<int64> class_slots;
  for (int64 s = 0; s < bad.num_slots(); ++s)
    if (bad.slot_child[s] < C) class_slots.push_back(s);
  bad.slot_child[class_slots[1]] = bad.slot_child[class_slots[0]];
  EXPECT(has(all_err(bad, 0, C), "class"), "duplicate class");
  EXPECT(!topk_err(bad, C).empty(), "duplicate class top_k");
  // Leaf nodes whose children are runs of consecutive classes (checked as blocks): a run
  // repeated by another node, and one overlapping another's.
  for (const int64 shift : {0, 2}) {
    // The root over three runs, 0-3, 4-7, 8-11; the second becomes 0-3 or 2-5.
    std::vector<int64> codes = {13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11};
    for (int64 j = 0; j < 4; ++j) codes[7 + j] = j + shift;
    const Layout runs = MakeLayout(12, {0, 3, 7, 11, 15}, codes);
    const std::string e = all_err(runs, 0, 12);
    EXPECT(has(e, "more than one slot"), "repeated run (shift %ld): %s", (long)shift, e.c_str());
  }
  // A node listed twice: some other node becomes unreachable.
  bad = t;
  std::vector<int64> node_slots;
  for (int64 s = 0; s < bad.num_slots(); ++s)
    if (bad.slot_child[s] >= C) node_slots.push_back(s);
  if (node_slots.size() >= 2) {
    bad.slot_child[node_slots.back()] = bad.slot_child[node_slots[node_slots.size() - 2]];
    EXPECT(has(all_err(bad, 0, C), "node"), "duplicate node: %s", all_err(bad, 0, C).c_str());
  }
  TestValidationLargeTree(rng);
  // Chunked mode reads the paths: corrupt one.
  bad = t;
  bad.path_nodes[bad.path_begin[1]] = 1 << 30;
  EXPECT(has(all_err(bad, 1, 2), "path_nodes"), "path node");
  bad = t;
  bad.path_begin[1] = -5;
  EXPECT(has(all_err(bad, 0, 1), "path_begin"), "path begin");
  bad = t;
  bad.path_slots[bad.path_begin[0]] = 1 << 30;
  cand = {0};
  err = LogProbCandidates<float>(bad.view(), pr.params(), 1, cand.data(), 1, SerialFor, out.data());
  EXPECT(has(err, "path_slots"), "candidates path slot: %s", err.c_str());
  // No slot_child.
  TreeView v = t.view();
  v.slot_child = nullptr;
  std::vector<float> lp(pr.N);
  std::vector<int64> cl(pr.N), ex(pr.N);
  EXPECT(has(TopK<float>(v, pr.params(), pr.N, 1, SerialFor, lp.data(), cl.data(), ex.data()),
             "slot_child"),
         "missing slot_child");
}

}  // namespace
}  // namespace tf_hsm

int main() {
  using tf_hsm::testing::NamedTest;
  static const NamedTest tests[] = {
      {"top_k_against_reference", tf_hsm::TestTopKAgainstReference},
      {"top_k_ties", tf_hsm::TestTopKTies},
      {"top_k_prunes", tf_hsm::TestTopKPrunes},
      {"log_prob_all", tf_hsm::TestLogProbAll},
      {"log_prob_all_plan_cache", tf_hsm::TestLogProbAllPlanCache},
      {"sample", tf_hsm::TestSample},
      {"candidates", tf_hsm::TestCandidates},
      {"determinism", tf_hsm::TestDeterminism},
      {"non_finite", tf_hsm::TestNonFinite},
      {"validation", tf_hsm::TestValidation},
  };
  return tf_hsm::testing::RunTests(tests);
}
