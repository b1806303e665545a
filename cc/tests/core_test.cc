// Unit tests of the framework-agnostic core: log-probabilities and gradients against a
// long-double reference written from the definition, on random trees of mixed shape;
// bit-identical results across thread counts and coefficient budgets; input validation.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "cc/core/log_prob.h"
#include "cc/core/simd.h"
#include "cc/core/visit_plan.h"

namespace tf_hsm {
namespace {

int failures = 0;
#define EXPECT(cond, ...)                                           \
  do {                                                              \
    if (!(cond)) {                                                  \
      ++failures;                                                   \
      std::fprintf(stderr, "%s:%d: FAILED %s: ", __FILE__, __LINE__, #cond); \
      std::fprintf(stderr, __VA_ARGS__);                            \
      std::fprintf(stderr, "\n");                                   \
    }                                                               \
  } while (0)

// A tree in the layout contract, built here independently of the Python builders.
struct OwnedTree {
  std::vector<int64> child_begin, slot_child, path_begin, path_nodes, path_slots;
  int64 num_classes = 0;
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
};

// Random tree: nodes are expanded breadth-first; each gets 1..max_branching children, each
// child a new internal node with probability p_internal (below max_depth) or a class.
OwnedTree RandomTree(std::mt19937_64& rng, int64 max_branching, int max_depth,
                     double p_internal, int64 max_classes) {
  std::vector<std::vector<int64>> children(1);  // codes: >= 0 class ordinal, < 0 -(node+1)
  std::vector<int> depth(1, 0);
  int64 classes = 0;
  for (size_t n = 0; n < children.size(); ++n) {
    const int64 k = 1 + static_cast<int64>(rng() % max_branching);
    for (int64 j = 0; j < k; ++j) {
      const bool internal = depth[n] + 1 < max_depth && classes < max_classes &&
                            std::uniform_real_distribution<double>(0, 1)(rng) < p_internal;
      if (internal) {
        children[n].push_back(-static_cast<int64>(children.size()) - 1);
        children.emplace_back();
        depth.push_back(depth[n] + 1);
      } else {
        children[n].push_back(classes++);
      }
    }
  }
  // Shuffle class ids so they do not follow the tree order.
  std::vector<int64> class_id(classes);
  for (int64 c = 0; c < classes; ++c) class_id[c] = c;
  std::shuffle(class_id.begin(), class_id.end(), rng);
  OwnedTree t;
  t.num_classes = classes;
  const int64 M = static_cast<int64>(children.size());
  std::vector<int64> parent_slot(M, -1);
  std::vector<int64> class_slot(classes), slot_node;
  t.child_begin.push_back(0);
  for (int64 n = 0; n < M; ++n) {
    for (int64 code : children[n]) {
      const int64 s = static_cast<int64>(t.slot_child.size());
      if (code >= 0) {
        t.slot_child.push_back(class_id[code]);
        class_slot[class_id[code]] = s;
      } else {
        t.slot_child.push_back(classes + (-code - 1));
        parent_slot[-code - 1] = s;
      }
      slot_node.push_back(n);
    }
    t.child_begin.push_back(static_cast<int64>(t.slot_child.size()));
  }
  t.path_begin.push_back(0);
  for (int64 c = 0; c < classes; ++c) {
    std::vector<std::pair<int64, int64>> steps;
    for (int64 s = class_slot[c]; s >= 0; s = parent_slot[slot_node[s]]) {
      steps.push_back({slot_node[s], s});
    }
    std::reverse(steps.begin(), steps.end());
    for (auto& st : steps) {
      t.path_nodes.push_back(st.first);
      t.path_slots.push_back(st.second);
    }
    t.path_begin.push_back(static_cast<int64>(t.path_nodes.size()));
  }
  return t;
}

// Reference log P and gradients in long double, straight from the definition.
struct Reference {
  std::vector<long double> log_prob, d_hidden, d_weights, d_biases;
};

template <typename T>
Reference ReferenceOf(const OwnedTree& t, const std::vector<T>& h, const std::vector<T>& w,
                      const std::vector<T>* b, const std::vector<int64>& targets,
                      const std::vector<T>& upstream, int64 D) {
  const int64 N = static_cast<int64>(targets.size()), S = static_cast<int64>(t.slot_child.size());
  Reference r;
  r.log_prob.assign(N, 0);
  r.d_hidden.assign(N * D, 0);
  r.d_weights.assign(S * D, 0);
  r.d_biases.assign(S, 0);
  for (int64 i = 0; i < N; ++i) {
    for (int64 p = t.path_begin[targets[i]]; p < t.path_begin[targets[i] + 1]; ++p) {
      const int64 n = t.path_nodes[p];
      const int64 cb = t.child_begin[n], ce = t.child_begin[n + 1];
      std::vector<long double> z(ce - cb);
      long double m = -INFINITY;
      for (int64 s = cb; s < ce; ++s) {
        long double acc = b ? (*b)[s] : 0;
        for (int64 d = 0; d < D; ++d) acc += (long double)h[i * D + d] * w[s * D + d];
        z[s - cb] = acc;
        m = std::max(m, acc);
      }
      long double sum = 0;
      for (auto v : z) sum += std::exp(v - m);
      const long double lse = m + std::log(sum);
      r.log_prob[i] += z[t.path_slots[p] - cb] - lse;
      for (int64 s = cb; s < ce; ++s) {
        const long double coef = upstream[i] * ((s == t.path_slots[p]) - std::exp(z[s - cb] - lse));
        for (int64 d = 0; d < D; ++d) {
          r.d_hidden[i * D + d] += coef * w[s * D + d];
          r.d_weights[s * D + d] += coef * h[i * D + d];
        }
        r.d_biases[s] += coef;
      }
    }
  }
  return r;
}

// A ParallelFor on `threads` std::threads that hands out single items round-robin, so
// work is split very differently from the serial run.
ParallelFor ThreadedFor(int threads) {
  return [threads](int64 total, int64, const std::function<void(int64, int64)>& work) {
    std::atomic<int64> next(0);
    std::vector<std::thread> pool;
    for (int k = 0; k < threads; ++k) {
      pool.emplace_back([&] {
        for (int64 i = next++; i < total; i = next++) work(i, i + 1);
      });
    }
    for (auto& th : pool) th.join();
  };
}

template <typename T>
struct Run {
  std::vector<T> log_prob, d_hidden, d_rows, d_bias_rows;
  std::vector<int64> row_ids;
};

template <typename T>
Run<T> RunCore(const OwnedTree& t, const std::vector<T>& h, const std::vector<T>& w,
               const std::vector<T>* b, const std::vector<int64>& targets,
               const std::vector<T>& upstream, int64 D, const ParallelFor& pf, int64 budget) {
  VisitPlan plan;
  const std::string err = BuildVisitPlan(t.view(), targets.data(), targets.size(), &plan);
  EXPECT(err.empty(), "%s", err.c_str());
  SoftmaxParams<T> p;
  p.hidden = h.data();
  p.weights = w.data();
  p.biases = b ? b->data() : nullptr;
  p.dim = D;
  Run<T> run;
  run.log_prob.resize(targets.size());
  LogProbForward<T>(plan, t.view(), p, pf, run.log_prob.data());
  run.d_hidden.resize(h.size());
  run.d_rows.resize(plan.num_rows() * D);
  run.d_bias_rows.resize(plan.num_rows());
  run.row_ids.resize(plan.num_rows());
  LogProbGrads<T> g;
  g.hidden = run.d_hidden.data();
  g.weight_rows = run.d_rows.data();
  g.bias_rows = b ? run.d_bias_rows.data() : nullptr;
  g.row_ids = run.row_ids.data();
  LogProbBackward<T>(plan, t.view(), p, upstream.data(), pf, g, budget);
  return run;
}

template <typename T>
void CheckAgainstReference(std::mt19937_64& rng, const OwnedTree& t, int64 N, int64 D,
                           bool bias, double tol, const char* what) {
  std::normal_distribution<double> normal(0, 1);
  std::vector<T> h(N * D), w(t.slot_child.size() * D), b(t.slot_child.size()), up(N);
  for (auto& v : h) v = normal(rng);
  for (auto& v : w) v = 0.3 * normal(rng);
  for (auto& v : b) v = normal(rng);
  for (auto& v : up) v = normal(rng);
  std::vector<int64> targets(N);
  for (auto& v : targets) v = rng() % t.num_classes;
  const Reference ref = ReferenceOf<T>(t, h, w, bias ? &b : nullptr, targets, up, D);
  const Run<T> run = RunCore<T>(t, h, w, bias ? &b : nullptr, targets, up, D, SerialFor,
                                kDefaultCoefBudget);
  auto close = [tol](long double a, long double r) {
    return std::fabs((double)(a - r)) <= tol * (1 + std::fabs((double)r));
  };
  for (int64 i = 0; i < N; ++i) {
    EXPECT(close(run.log_prob[i], ref.log_prob[i]), "%s log_prob[%ld] %g vs %g", what, (long)i,
           (double)run.log_prob[i], (double)ref.log_prob[i]);
  }
  for (int64 i = 0; i < N * D; ++i) {
    EXPECT(close(run.d_hidden[i], ref.d_hidden[i]), "%s d_hidden[%ld] %g vs %g", what, (long)i,
           (double)run.d_hidden[i], (double)ref.d_hidden[i]);
  }
  // Scatter the sparse rows into a dense gradient, then compare everything (untouched rows
  // must be exactly zero in the reference too).
  std::vector<long double> dw(w.size(), 0), db(b.size(), 0);
  for (size_t r = 0; r < run.row_ids.size(); ++r) {
    for (int64 d = 0; d < D; ++d) dw[run.row_ids[r] * D + d] += run.d_rows[r * D + d];
    if (bias) db[run.row_ids[r]] += run.d_bias_rows[r];
  }
  for (size_t i = 0; i < dw.size(); ++i) {
    EXPECT(close(dw[i], ref.d_weights[i]), "%s d_weights[%zu] %g vs %g", what, i,
           (double)dw[i], (double)ref.d_weights[i]);
  }
  if (bias) {
    for (size_t i = 0; i < db.size(); ++i) {
      EXPECT(close(db[i], ref.d_biases[i]), "%s d_biases[%zu] %g vs %g", what, i,
             (double)db[i], (double)ref.d_biases[i]);
    }
  }
  // Row ids are unique in a valid tree.
  std::vector<int64> ids = run.row_ids;
  std::sort(ids.begin(), ids.end());
  EXPECT(std::adjacent_find(ids.begin(), ids.end()) == ids.end(), "%s duplicate row ids", what);
}

void TestAgainstReference() {
  std::mt19937_64 rng(1);
  for (int trial = 0; trial < 30; ++trial) {
    const int64 branching = 1 + trial % 7 * 8;  // 1 .. 49
    const OwnedTree t = RandomTree(rng, branching, 1 + trial % 8, 0.4, 400);
    const int64 D = 1 + rng() % 40;
    const int64 N = rng() % 70;
    CheckAgainstReference<double>(rng, t, N, D, trial % 2 == 0, 1e-10, "double");
    CheckAgainstReference<float>(rng, t, N, D, trial % 3 == 0, 2e-4, "float");
  }
  // One wide node: more children than a slot tile (online logsumexp across tiles).
  const OwnedTree wide = RandomTree(rng, 700, 1, 0.0, 1000);
  CheckAgainstReference<double>(rng, wide, 150, 33, true, 1e-10, "wide double");
  CheckAgainstReference<float>(rng, wide, 150, 33, true, 2e-4, "wide float");
}

template <typename T>
bool SameBits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

void TestDeterminism() {
  std::mt19937_64 rng(2);
  std::normal_distribution<float> normal(0, 1);
  for (int trial = 0; trial < 6; ++trial) {
    const OwnedTree t = RandomTree(rng, 300, 4, 0.05, 3000);
    const int64 N = 500, D = 37;
    std::vector<float> h(N * D), w(t.slot_child.size() * D), b(t.slot_child.size()), up(N);
    for (auto& v : h) v = normal(rng);
    for (auto& v : w) v = normal(rng);
    for (auto& v : b) v = normal(rng);
    for (auto& v : up) v = normal(rng);
    std::vector<int64> targets(N);
    for (auto& v : targets) v = rng() % t.num_classes;
    const Run<float> a = RunCore<float>(t, h, w, &b, targets, up, D, SerialFor, kDefaultCoefBudget);
    // Threads hand out items one by one; budget 0 forces the recompute path for dW.
    for (int threads : {2, 5}) {
      for (int64 budget : {kDefaultCoefBudget, int64{0}}) {
        const Run<float> c = RunCore<float>(t, h, w, &b, targets, up, D, ThreadedFor(threads), budget);
        EXPECT(SameBits(a.log_prob, c.log_prob), "log_prob differs (threads %d budget %ld)", threads, (long)budget);
        EXPECT(SameBits(a.d_hidden, c.d_hidden), "d_hidden differs (threads %d budget %ld)", threads, (long)budget);
        EXPECT(SameBits(a.d_rows, c.d_rows), "d_rows differ (threads %d budget %ld)", threads, (long)budget);
        EXPECT(SameBits(a.d_bias_rows, c.d_bias_rows), "d_bias differs (threads %d budget %ld)", threads, (long)budget);
        EXPECT(a.row_ids == c.row_ids, "row ids differ");
      }
    }
  }
}

// In-place SGD gives the table that applying the sparse gradient rows would give, and the
// same hidden gradient.
void TestInPlaceSgd() {
  std::mt19937_64 rng(5);
  std::normal_distribution<double> normal(0, 1);
  for (int trial = 0; trial < 8; ++trial) {
    const OwnedTree t = RandomTree(rng, 1 + trial * 20, 1 + trial % 5, 0.3, 2000);
    const int64 N = 1 + rng() % 300, D = 1 + rng() % 70;
    const int64 S = static_cast<int64>(t.slot_child.size());
    std::vector<double> h(N * D), w(S * D), b(S), up(N);
    for (auto& v : h) v = normal(rng);
    for (auto& v : w) v = 0.3 * normal(rng);
    for (auto& v : b) v = normal(rng);
    for (auto& v : up) v = normal(rng);
    std::vector<int64> targets(N);
    for (auto& v : targets) v = rng() % t.num_classes;
    const double lr = 0.37;
    for (int64 budget : {kDefaultCoefBudget, int64{0}}) {
      const Run<double> ref = RunCore<double>(t, h, w, &b, targets, up, D, SerialFor, budget);
      std::vector<double> w_ref = w, b_ref = b;
      for (size_t r = 0; r < ref.row_ids.size(); ++r) {
        for (int64 d = 0; d < D; ++d) w_ref[ref.row_ids[r] * D + d] -= lr * ref.d_rows[r * D + d];
        b_ref[ref.row_ids[r]] -= lr * ref.d_bias_rows[r];
      }
      std::vector<double> w_sgd = w, b_sgd = b, dh(N * D), lp(N);
      VisitPlan plan;
      BuildVisitPlan(t.view(), targets.data(), N, &plan);
      SoftmaxParams<double> p;
      p.hidden = h.data();
      p.weights = w_sgd.data();  // aliases the table being updated, as in the op
      p.biases = b_sgd.data();
      p.dim = D;
      LogProbForward<double>(plan, t.view(), p, ThreadedFor(3), lp.data());
      LogProbGrads<double> g;
      g.hidden = dh.data();
      g.sgd_weights = w_sgd.data();
      g.sgd_biases = b_sgd.data();
      g.sgd_learning_rate = lr;
      LogProbBackward<double>(plan, t.view(), p, up.data(), ThreadedFor(3), g, budget);
      for (size_t i = 0; i < w.size(); ++i) {
        EXPECT(std::fabs(w_sgd[i] - w_ref[i]) <= 1e-12 * (1 + std::fabs(w_ref[i])),
               "w[%zu] %.17g vs %.17g", i, w_sgd[i], w_ref[i]);
      }
      for (size_t i = 0; i < b.size(); ++i) {
        EXPECT(std::fabs(b_sgd[i] - b_ref[i]) <= 1e-12 * (1 + std::fabs(b_ref[i])), "b[%zu]", i);
      }
      EXPECT(SameBits(dh, ref.d_hidden), "dh differs in SGD mode");
      EXPECT(SameBits(lp, ref.log_prob), "log_prob differs in SGD mode");
    }
  }
}

void TestNanStaysInItsRow() {
  std::mt19937_64 rng(3);
  const OwnedTree t = RandomTree(rng, 10, 3, 0.3, 200);
  const int64 N = 8, D = 5;
  std::vector<float> h(N * D, 0.5f), w(t.slot_child.size() * D, 0.1f), up(N, 1.0f);
  h[3 * D + 2] = NAN;
  std::vector<int64> targets(N);
  for (auto& v : targets) v = rng() % t.num_classes;
  const Run<float> r = RunCore<float>(t, h, w, nullptr, targets, up, D, SerialFor, kDefaultCoefBudget);
  for (int64 i = 0; i < N; ++i) {
    EXPECT(std::isnan(r.log_prob[i]) == (i == 3), "row %ld nan=%d", (long)i, (int)std::isnan(r.log_prob[i]));
  }
}

void TestValidation() {
  std::mt19937_64 rng(4);
  OwnedTree t = RandomTree(rng, 5, 3, 0.5, 50);
  VisitPlan plan;
  std::vector<int64> bad = {0, t.num_classes};
  std::string err = BuildVisitPlan(t.view(), bad.data(), 2, &plan);
  EXPECT(err.find("targets[1]") != std::string::npos, "message: %s", err.c_str());
  bad = {-1};
  err = BuildVisitPlan(t.view(), bad.data(), 1, &plan);
  EXPECT(err.find("targets[0] = -1") != std::string::npos, "message: %s", err.c_str());
  // Corrupt a path slot: it must be caught, not read out of bounds.
  std::vector<int64> ok = {0};
  OwnedTree c = t;
  c.path_slots[c.path_begin[0]] = 1 << 30;
  err = BuildVisitPlan(c.view(), ok.data(), 1, &plan);
  EXPECT(err.find("path_slots") != std::string::npos, "message: %s", err.c_str());
  c = t;
  c.path_nodes[c.path_begin[0]] = -3;
  err = BuildVisitPlan(c.view(), ok.data(), 1, &plan);
  EXPECT(err.find("path_nodes") != std::string::npos, "message: %s", err.c_str());
  c = t;
  c.path_begin[1] = c.path_begin[0];
  err = BuildVisitPlan(c.view(), ok.data(), 1, &plan);
  EXPECT(err.find("path_begin") != std::string::npos, "message: %s", err.c_str());
  c = t;
  c.child_begin[1] = 1 << 30;
  std::vector<int64> all(t.num_classes);
  for (int64 i = 0; i < t.num_classes; ++i) all[i] = i;
  err = BuildVisitPlan(c.view(), all.data(), t.num_classes, &plan);
  EXPECT(err.find("child_begin") != std::string::npos, "message: %s", err.c_str());
  // Empty batch.
  err = BuildVisitPlan(t.view(), nullptr, 0, &plan);
  EXPECT(err.empty() && plan.num_groups() == 0, "empty batch: %s", err.c_str());
}

void TestExp() {
  // The vectorized float exp against std::exp over a wide range, plus special values.
  std::vector<float> x, y;
  for (float v = -100.f; v < 100.f; v += 0.0137f) x.push_back(v);
  x.push_back(NAN);
  x.push_back(INFINITY);
  x.push_back(-INFINITY);
  y = x;
  simd::ExpInPlace(y.data(), static_cast<int64>(y.size()));
  for (size_t i = 0; i < x.size(); ++i) {
    const double want = std::exp((double)x[i]);
    if (std::isnan(x[i])) {
      EXPECT(std::isnan(y[i]), "exp(nan)");
    } else if (want < 1.2e-38) {
      EXPECT(y[i] <= 1.2e-38f, "exp(%g) = %g", x[i], y[i]);
    } else if (want > 3.4028234e38) {
      EXPECT(std::isinf(y[i]), "exp(%g) = %g", x[i], y[i]);
    } else {
      EXPECT(std::fabs(y[i] - want) <= 4e-7 * want, "exp(%g) = %.9g want %.9g", x[i], y[i], want);
    }
  }
}

}  // namespace
}  // namespace tf_hsm

int main() {
  struct { const char* name; void (*fn)(); } tests[] = {
      {"exp", tf_hsm::TestExp},
      {"against_reference", tf_hsm::TestAgainstReference},
      {"determinism", tf_hsm::TestDeterminism},
      {"nan_stays_in_its_row", tf_hsm::TestNanStaysInItsRow},
      {"in_place_sgd", tf_hsm::TestInPlaceSgd},
      {"validation", tf_hsm::TestValidation},
  };
  int passed = 0, failed = 0;
  for (auto& t : tests) {
    const int before = tf_hsm::failures;
    t.fn();
    const bool ok = tf_hsm::failures == before;
    std::printf("[%s] %s\n", ok ? "PASS" : "FAIL", t.name);
    (ok ? passed : failed)++;
  }
  std::printf("%d passed, %d failed\n", passed, failed);
  return failed == 0 ? 0 : 1;
}
