// Unit tests of the framework-agnostic core: log-probabilities and gradients against a
// long-double reference written from the definition, on random trees of mixed shape;
// bit-identical results across thread counts and coefficient budgets; input validation.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "cc/core/log_prob.h"
#include "cc/core/simd.h"
#include "cc/core/sparse_rows.h"
#include "cc/core/visit_plan.h"
#include "cc/tests/test_util.h"

namespace tf_hsm {
namespace {

using namespace ::tf_hsm::testing;  // NOLINT: the shared test vocabulary

// Reference log P and gradients in long double, straight from the definition.
struct Reference {
  std::vector<long double> log_prob, d_hidden, d_weights, d_biases;
};

template <typename T>
Reference ReferenceOf(const Layout& t, const std::vector<T>& h, const std::vector<T>& w,
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

template <typename T>
struct Run {
  std::vector<T> log_prob, d_hidden, d_rows, d_bias_rows;
  std::vector<int64> row_ids;
};

template <typename T>
Run<T> RunCore(const Layout& t, const std::vector<T>& h, const std::vector<T>& w,
               const std::vector<T>* b, const std::vector<int64>& targets,
               const std::vector<T>& upstream, int64 D, const ParallelFor& pf, int64 budget,
               int64 rows_offset = 0, bool save_logits = false,
               PlanFor forward_use = PlanFor::kBackward, CoefficientStore<T>* store = nullptr) {
  VisitPlan plan, forward_plan;
  const std::string err = BuildVisitPlan(t.view(), targets.data(), targets.size(), &plan);
  EXPECT(err.empty(), "%s", err.c_str());
  // The forward's own plan, as the ops build it (kForward leaves walked nodes ungrouped).
  BuildVisitPlan(t.view(), targets.data(), targets.size(), &forward_plan, forward_use);
  SoftmaxParams<T> p;
  p.hidden = h.data();
  p.weights = w.data();
  p.biases = b ? b->data() : nullptr;
  p.dim = D;
  Run<T> run;
  run.log_prob.resize(targets.size());
  // save_logits: the backward takes the forward's logits of grouped nodes, unit coefficients
  // of walked steps and directions.
  std::vector<T> saved(save_logits ? SavedLogitsSize(forward_plan, t.view()) : 0);
  EXPECT(!save_logits || SavedLogitsSize(plan, t.view()) == static_cast<int64>(saved.size()),
         "the forward's and the backward's plans count different saved values");
  std::vector<T> directions(save_logits ? h.size() : 0);
  LogProbForward<T>(forward_plan, t.view(), p, pf, run.log_prob.data(),
                    save_logits ? saved.data() : nullptr, save_logits ? directions.data() : nullptr);
  run.d_hidden.resize(h.size());
  // The weight-gradient rows start rows_offset elements past a 64-byte boundary (aligned
  // rows are written with streaming stores).
  const int64 per_line = 64 / static_cast<int64>(sizeof(T));
  std::vector<T> storage(plan.num_rows() * D + 2 * per_line);
  T* rows = storage.data() + (per_line - reinterpret_cast<std::uintptr_t>(storage.data()) % 64 / sizeof(T)) % per_line + rows_offset;
  run.d_bias_rows.resize(plan.num_rows());
  run.row_ids.resize(plan.num_rows());
  LogProbGrads<T> g;
  g.hidden = run.d_hidden.data();
  g.weight_rows = rows;
  g.bias_rows = b ? run.d_bias_rows.data() : nullptr;
  g.row_ids = run.row_ids.data();
  g.saved_logits = save_logits ? saved.data() : nullptr;
  g.saved_directions = save_logits ? directions.data() : nullptr;
  g.coefficient_store = store;
  LogProbBackward<T>(plan, t.view(), p, upstream.data(), pf, g, budget);
  run.d_rows.assign(rows, rows + plan.num_rows() * D);
  return run;
}

template <typename T>
void CheckAgainstReference(std::mt19937_64& rng, const Layout& t, int64 N, int64 D,
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

// Standard-normal hidden rows, weights, biases and upstream gradients, uniform targets.
template <typename T>
struct Inputs {
  std::vector<T> h, w, b, up;
  std::vector<int64> targets;
};

template <typename T>
Inputs<T> RandomInputs(std::mt19937_64& rng, const Layout& t, int64 N, int64 D) {
  std::normal_distribution<float> normal(0, 1);
  const int64 S = static_cast<int64>(t.slot_child.size());
  Inputs<T> in{std::vector<T>(N * D), std::vector<T>(S * D), std::vector<T>(S), std::vector<T>(N),
               std::vector<int64>(N)};
  for (auto* values : {&in.h, &in.w, &in.b, &in.up})
    for (auto& v : *values) v = normal(rng);
  for (auto& v : in.targets) v = rng() % t.num_classes;
  return in;
}

void TestAgainstReference() {
  std::mt19937_64 rng(1);
  for (int trial = 0; trial < 30; ++trial) {
    const int64 branching = 1 + trial % 7 * 8;  // 1 .. 49
    const Layout t = RandomLayout(rng, branching, 1 + trial % 8, 0.4, 400);
    const int64 D = 1 + rng() % 40;
    const int64 N = rng() % 70;
    CheckAgainstReference<double>(rng, t, N, D, trial % 2 == 0, 1e-10, "double");
    CheckAgainstReference<float>(rng, t, N, D, trial % 3 == 0, 2e-4, "float");
  }
  // D = 0: the logits are the biases alone (hidden and its gradient are empty).
  for (int trial = 0; trial < 4; ++trial) {
    const Layout t = RandomLayout(rng, 2 + trial * 5, 1 + trial, 0.3, 200);
    CheckAgainstReference<double>(rng, t, 1 + rng() % 50, 0, true, 1e-10, "D=0 double");
  }
  // One wide node: more children than a slot tile (online logsumexp across tiles).
  const Layout wide = RandomLayout(rng, 700, 1, 0.0, 1000);
  CheckAgainstReference<double>(rng, wide, 150, 33, true, 1e-10, "wide double");
  CheckAgainstReference<float>(rng, wide, 150, 33, true, 2e-4, "wide float");
  // Rows a power of two of bytes apart (1 KB): the gradient kernels' packed paths.
  CheckAgainstReference<float>(rng, wide, 100, 256, true, 2e-4, "wide float D=256");
  // Walked (binary) nodes with rows wider than the dW pass keeps in registers at once
  // (8 vectors), ending in a partial vector; many tokens share the nodes near the root.
  const Layout binary = Balanced(300, 2);
  CheckAgainstReference<double>(rng, binary, 200, 77, true, 1e-10, "binary double D=77");
  CheckAgainstReference<float>(rng, binary, 200, 300, true, 2e-4, "binary float D=300");
  {
    const Inputs<float> in = RandomInputs<float>(rng, binary, 200, 300);
    const auto& [h, w, b, up, targets] = in;
    const Run<float> a = RunCore<float>(binary, h, w, &b, targets, up, 300, SerialFor, kDefaultCoefBudget);
    const Run<float> c = RunCore<float>(binary, h, w, &b, targets, up, 300, ThreadedFor(3), 0);
    EXPECT(SameBits(a.d_rows, c.d_rows), "binary D=300: d_rows depend on threads or budget");
    EXPECT(SameBits(a.d_bias_rows, c.d_bias_rows), "binary D=300: d_bias depends on threads or budget");
  }
}

void TestDeterminism() {
  std::mt19937_64 rng(2);
  for (int trial = 0; trial < 6; ++trial) {
    const Layout t = RandomLayout(rng, 300, 4, 0.05, 3000);
    const int64 N = 500, D = 37;
    const Inputs<float> in = RandomInputs<float>(rng, t, N, D);
    const auto& [h, w, b, up, targets] = in;
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
        // The backward given the forward's saved logits and directions: the same gradients
        // to the bit; the forward's values (computed in the backward's token tiles) equal
        // to rounding and the same whatever the threads.
        const Run<float> s = RunCore<float>(t, h, w, &b, targets, up, D, ThreadedFor(threads), budget, 0, true, PlanFor::kForward);
        const Run<float> s1 = RunCore<float>(t, h, w, &b, targets, up, D, SerialFor, budget, 0, true);
        // The plain forward on a plan that leaves walked nodes ungrouped: the same bits.
        const Run<float> f = RunCore<float>(t, h, w, &b, targets, up, D, ThreadedFor(threads), budget, 0, false, PlanFor::kForward);
        EXPECT(SameBits(a.log_prob, f.log_prob), "log_prob differs on a forward plan (threads %d)", threads);
        EXPECT(SameBits(a.d_hidden, s.d_hidden), "d_hidden differs with saved logits (threads %d budget %ld)", threads, (long)budget);
        EXPECT(SameBits(a.d_rows, s.d_rows), "d_rows differ with saved logits (threads %d budget %ld)", threads, (long)budget);
        EXPECT(SameBits(a.d_bias_rows, s.d_bias_rows), "d_bias differs with saved logits (threads %d budget %ld)", threads, (long)budget);
        EXPECT(SameBits(s1.log_prob, s.log_prob), "saving forward's log_prob depends on threads (%d)", threads);
        for (int64 i = 0; i < N; ++i) {
          EXPECT(std::fabs(s.log_prob[i] - a.log_prob[i]) <= 1e-5f * (1 + std::fabs(a.log_prob[i])),
                 "saving forward's log_prob[%ld] %.9g vs %.9g", (long)i, s.log_prob[i], a.log_prob[i]);
        }
      }
    }
  }
}

// A coefficient store kept across calls, as the ops keep one, gives the bits of a store
// of the call's own, whatever an earlier call of another batch size left in it (NaN here).
void TestCoefficientStoreReused() {
  std::mt19937_64 rng(13);
  const Layout t = RandomLayout(rng, 300, 3, 0.05, 3000);
  const int64 D = 40;
  CoefficientStore<float> store;
  bool first = true;
  for (int64 N : {400, 60, 900}) {
    const Inputs<float> in = RandomInputs<float>(rng, t, N, D);
    const auto& [h, w, b, up, targets] = in;
    const Run<float> own = RunCore<float>(t, h, w, &b, targets, up, D, ThreadedFor(2), kDefaultCoefBudget);
    const Run<float> kept = RunCore<float>(t, h, w, &b, targets, up, D, ThreadedFor(2), kDefaultCoefBudget, 0,
                                           false, PlanFor::kBackward, &store);
    EXPECT(SameBits(own.d_hidden, kept.d_hidden), "d_hidden differs with a reused store (N %ld)", (long)N);
    EXPECT(SameBits(own.d_rows, kept.d_rows), "d_rows differ with a reused store (N %ld)", (long)N);
    EXPECT(SameBits(own.d_bias_rows, kept.d_bias_rows), "d_bias differs with a reused store (N %ld)", (long)N);
    if (first) EXPECT(store.capacity > 0, "the backward did not keep its coefficients in the given store");
    first = false;
    std::fill(store.data.get(), store.data.get() + store.capacity, std::numeric_limits<float>::quiet_NaN());
  }
}

// Gradient rows written with streaming stores (aligned rows of whole vectors) are the
// same bits as rows stored normally (an unaligned buffer), with and without threads.
template <typename T>
void CheckStreamedRows(std::mt19937_64& rng, int64 D) {
  const Layout t = RandomLayout(rng, 200, 3, 0.05, 3000);
  const int64 N = 300;
  const Inputs<T> in = RandomInputs<T>(rng, t, N, D);
  const auto& [h, w, b, up, targets] = in;
  const Run<T> plain = RunCore<T>(t, h, w, &b, targets, up, D, SerialFor, kDefaultCoefBudget, 1);
  for (int threads : {1, 3}) {
    const Run<T> streamed = RunCore<T>(t, h, w, &b, targets, up, D,
                                       threads == 1 ? SerialFor : ThreadedFor(threads), kDefaultCoefBudget, 0);
    EXPECT(SameBits(plain.d_rows, streamed.d_rows), "streamed gradient rows differ (D %ld, threads %d)",
           (long)D, threads);
    EXPECT(SameBits(plain.d_hidden, streamed.d_hidden), "d_hidden differs (D %ld)", (long)D);
  }
}

// CoefficientBudget: the default, or the weight gradient's size where that is larger.
void TestCoefficientBudget() {
  const Layout t = Balanced(100, 10);
  const std::vector<int64> targets = {0, 55, 99};
  VisitPlan plan;
  BuildVisitPlan(t.view(), targets.data(), 3, &plan);
  const int64 rows = plan.num_rows();
  EXPECT(rows == 10 + 3 * 10, "%ld rows", (long)rows);
  EXPECT(CoefficientBudget(plan, 300) == kDefaultCoefBudget, "budget %ld at D = 300",
         (long)CoefficientBudget(plan, 300));
  const int64 wide = kDefaultCoefBudget / rows + 1;
  EXPECT(CoefficientBudget(plan, wide) == rows * wide, "budget %ld at D = %ld",
         (long)CoefficientBudget(plan, wide), (long)wide);
}

void TestStreamedGradientRows() {
  std::mt19937_64 rng(9);
  CheckStreamedRows<float>(rng, 32);
  CheckStreamedRows<float>(rng, 80);
  CheckStreamedRows<double>(rng, 24);
}

// A call sees the weights as they are now, even at the same address as a previous call's
// (packed copies of them are cached per thread within a call only).
void TestWeightsChangedBetweenCalls() {
  std::mt19937_64 rng(11);
  const Layout t = Balanced(50, 50);  // one node, so every call packs the same block
  const int64 N = 100, D = 24;        // many tokens per group: the packed kernel
  Inputs<float> in = RandomInputs<float>(rng, t, N, D);
  RunCore<float>(t, in.h, in.w, &in.b, in.targets, in.up, D, SerialFor, kDefaultCoefBudget);
  for (auto& v : in.w) v = 0.5f * v + 0.25f;
  const std::vector<float> moved = in.w;  // the same values at another address
  const Run<float> again = RunCore<float>(t, in.h, in.w, &in.b, in.targets, in.up, D, SerialFor, kDefaultCoefBudget);
  const Run<float> fresh = RunCore<float>(t, in.h, moved, &in.b, in.targets, in.up, D, SerialFor, kDefaultCoefBudget);
  EXPECT(SameBits(again.log_prob, fresh.log_prob), "log_prob used the previous call's weights");
  EXPECT(SameBits(again.d_hidden, fresh.d_hidden), "d_hidden used the previous call's weights");
  EXPECT(SameBits(again.d_rows, fresh.d_rows), "d_rows used the previous call's weights");
}

// In-place SGD gives the table that applying the sparse gradient rows would give, the
// same hidden gradient and (as the fused op's output, log_prob_from_backward) the
// forward's log-probabilities to rounding, taken before the rows are updated.
void TestInPlaceSgd() {
  std::mt19937_64 rng(5);
  std::normal_distribution<double> normal(0, 1);
  for (int trial = 0; trial < 8; ++trial) {
    const Layout t = RandomLayout(rng, 1 + trial * 20, 1 + trial % 5, 0.3, 2000);
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
      LogProbGrads<double> g;
      g.log_prob_from_backward = lp.data();
      g.hidden = dh.data();
      g.sgd_update = true;
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
      for (int64 i = 0; i < N; ++i) {
        EXPECT(std::fabs(lp[i] - ref.log_prob[i]) <= 1e-12 * (1 + std::fabs(ref.log_prob[i])),
               "log_prob[%ld] %.17g vs %.17g in SGD mode", (long)i, lp[i], ref.log_prob[i]);
      }
    }
  }
}

// log_prob_from_backward: the loss value from the backward's own logsumexps. The gradients
// are the plain backward's, bit for bit; the values match the forward's to rounding and the
// definition's; and they do not depend on threads or the coefficient budget.
template <typename T>
void CheckLogProbFromBackward(std::mt19937_64& rng, const Layout& t, int64 N, int64 D, double tol,
                              const char* what) {
  const Inputs<T> in = RandomInputs<T>(rng, t, N, D);
  const auto& [h, w, b, up, targets] = in;
  const Reference ref = ReferenceOf<T>(t, h, w, &b, targets, up, D);
  const Run<T> plain = RunCore<T>(t, h, w, &b, targets, up, D, SerialFor, kDefaultCoefBudget);
  VisitPlan plan;
  BuildVisitPlan(t.view(), targets.data(), N, &plan);
  SoftmaxParams<T> p;
  p.hidden = h.data();
  p.weights = w.data();
  p.biases = b.data();
  p.dim = D;
  std::vector<T> first;
  for (int threads : {1, 3}) {
    for (int64 budget : {kDefaultCoefBudget, int64{0}}) {
      std::vector<T> lp(N, T(-7)), dh(N * D), rows(plan.num_rows() * D), bias_rows(plan.num_rows());
      std::vector<int64> ids(plan.num_rows());
      LogProbGrads<T> g;
      g.hidden = dh.data();
      g.weight_rows = rows.data();
      g.bias_rows = bias_rows.data();
      g.row_ids = ids.data();
      g.log_prob_from_backward = lp.data();
      LogProbBackward<T>(plan, t.view(), p, up.data(), threads == 1 ? SerialFor : ThreadedFor(threads), g, budget);
      EXPECT(SameBits(dh, plain.d_hidden), "%s: d_hidden differs", what);
      EXPECT(SameBits(rows, plain.d_rows), "%s: weight rows differ", what);
      EXPECT(SameBits(bias_rows, plain.d_bias_rows), "%s: bias rows differ", what);
      for (int64 i = 0; i < N; ++i) {
        const double scale = 1 + std::fabs(static_cast<double>(ref.log_prob[i]));
        EXPECT(std::fabs(lp[i] - plain.log_prob[i]) <= tol * scale, "%s: log_prob[%ld] %.9g vs forward %.9g",
               what, (long)i, (double)lp[i], (double)plain.log_prob[i]);
        EXPECT(std::fabs(lp[i] - static_cast<double>(ref.log_prob[i])) <= tol * scale,
               "%s: log_prob[%ld] %.9g vs reference %.9g", what, (long)i, (double)lp[i], (double)ref.log_prob[i]);
      }
      if (first.empty()) first = lp;
      EXPECT(SameBits(lp, first), "%s: log_prob depends on threads (%d) or budget (%ld)", what, threads, (long)budget);
    }
  }
}

void TestLogProbFromBackward() {
  std::mt19937_64 rng(17);
  for (int trial = 0; trial < 10; ++trial) {
    // Small branchings give walked nodes, large ones grouped nodes with several token tiles.
    const Layout t = RandomLayout(rng, 1 + trial * 37, 1 + trial % 6, 0.3, 2500);
    const int64 N = 1 + rng() % 400, D = 1 + rng() % 40;
    CheckLogProbFromBackward<double>(rng, t, N, D, 1e-11, "double");
    CheckLogProbFromBackward<float>(rng, t, N, D, 1e-4, "float");
  }
  CheckLogProbFromBackward<float>(rng, Balanced(4000, 2), 300, 9, 1e-4, "binary float");
  CheckLogProbFromBackward<float>(rng, Balanced(5000, 70), 700, 16, 1e-4, "2-level float");
}

void TestNanStaysInItsRow() {
  std::mt19937_64 rng(3);
  const Layout t = RandomLayout(rng, 10, 3, 0.3, 200);
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

// The plan against one built from its definition, level by level: level l's groups are
// the nodes at path position l in order of their first token, each group's entries are its
// tokens in token order; a forward plan leaves out walked nodes and the positions after
// the last grouped one. One plan is reused across batches of growing and shrinking size
// (the largest, ~100K visits, is past the size whose grouping storage a thread keeps), on
// trees of mixed branching, and on a malformed one that repeats a node along a path.
void TestVisitPlanStructure() {
  std::mt19937_64 rng(9);
  auto check = [](const Layout& t, const std::vector<int64>& targets, PlanFor use,
                  VisitPlan* plan, const char* what) {
    const TreeView v = t.view();
    const int64 N = static_cast<int64>(targets.size());
    const std::string err = BuildVisitPlan(v, targets.data(), N, plan, use);
    EXPECT(err.empty(), "%s: %s", what, err.c_str());
    auto branching = [&](int64 n) { return t.child_begin[n + 1] - t.child_begin[n]; };
    int64 levels = 0;
    for (int64 i = 0; i < N; ++i) {
      const int64 b = t.path_begin[targets[i]], e = t.path_begin[targets[i] + 1];
      for (int64 q = b; q < e; ++q) {
        if (use == PlanFor::kBackward || branching(t.path_nodes[q]) > kWalkMaxBranching) {
          levels = std::max(levels, q - b + 1);
        }
      }
    }
    std::vector<int64> level_begin = {0}, group_node, group_begin = {0}, group_row = {0};
    std::vector<int64> entry_token, entry_slot;
    for (int64 l = 0; l < levels; ++l) {
      std::vector<int64> nodes;
      std::vector<std::vector<int64>> tokens;
      for (int64 i = 0; i < N; ++i) {
        const int64 b = t.path_begin[targets[i]], e = t.path_begin[targets[i] + 1];
        if (l >= e - b) continue;
        const int64 n = t.path_nodes[b + l];
        if (use == PlanFor::kForward && branching(n) <= kWalkMaxBranching) continue;
        const size_t g = std::find(nodes.begin(), nodes.end(), n) - nodes.begin();
        if (g == nodes.size()) {
          nodes.push_back(n);
          tokens.emplace_back();
        }
        tokens[g].push_back(i);
      }
      for (size_t g = 0; g < nodes.size(); ++g) {
        group_node.push_back(nodes[g]);
        group_row.push_back(group_row.back() + branching(nodes[g]));
        for (int64 i : tokens[g]) {
          entry_token.push_back(i);
          entry_slot.push_back(t.path_slots[t.path_begin[targets[i]] + l]);
        }
        group_begin.push_back(static_cast<int64>(entry_token.size()));
      }
      level_begin.push_back(static_cast<int64>(group_node.size()));
    }
    EXPECT(plan->level_begin == level_begin, "%s: level_begin differs", what);
    EXPECT(plan->group_node == group_node, "%s: group_node differs", what);
    EXPECT(plan->group_begin == group_begin, "%s: group_begin differs", what);
    EXPECT(plan->group_row == group_row, "%s: group_row differs", what);
    EXPECT(plan->entry_token == entry_token, "%s: entry_token differs", what);
    EXPECT(plan->entry_slot == entry_slot, "%s: entry_slot differs", what);
    for (int64 i = 0; i < N; ++i) {
      const int64 b = t.path_begin[targets[i]], e = t.path_begin[targets[i] + 1];
      const int64 s0 = plan->token_step_begin[i];
      EXPECT(plan->token_step_begin[i + 1] - s0 == e - b, "%s: token %ld's steps", what, (long)i);
      for (int64 q = b; q < e; ++q) {
        EXPECT(plan->step_node[s0 + q - b] == t.path_nodes[q] &&
               plan->step_slot[s0 + q - b] == t.path_slots[q], "%s: token %ld's path copy", what, (long)i);
      }
    }
  };
  VisitPlan plan;
  int64 most_steps = 0;
  for (int trial = 0; trial < 4; ++trial) {
    // Binary-deep, mixed (walked and grouped nodes on one path) and wide-shallow trees.
    const Layout t = trial == 0 ? RandomLayout(rng, 2, 24, 0.9, 4000)
                     : trial == 3 ? RandomLayout(rng, 300, 3, 0.1, 3000)
                                  : RandomLayout(rng, 20, 8, 0.3, 3000);
    for (const int64 N : {int64{700}, int64{1}, int64{9000}, int64{0}, int64{300}}) {
      std::vector<int64> targets(N);
      // Zipf-like: a few classes take most tokens, so groups are of very unequal sizes.
      for (auto& y : targets) y = static_cast<int64>(std::pow(rng() % 1000 / 1000.0, 3) * t.num_classes);
      for (const PlanFor use : {PlanFor::kBackward, PlanFor::kForward}) {
        check(t, targets, use, &plan, use == PlanFor::kBackward ? "backward plan" : "forward plan");
        most_steps = std::max(most_steps, plan.num_steps());
      }
    }
  }
  EXPECT(most_steps > int64{1} << 16, "the largest batch has %ld visits", (long)most_steps);
  // A malformed tree whose first class's path visits its first node twice (the slots stay
  // valid, so the plan is built): one group per position.
  Layout c = RandomLayout(rng, 3, 6, 0.7, 200);
  const int64 b = c.path_begin[0];
  EXPECT(c.path_begin[1] - b >= 2, "the first class's path has 2+ steps");
  c.path_nodes[b + 1] = c.path_nodes[b];
  c.path_slots[b + 1] = c.path_slots[b];
  const std::vector<int64> targets = {0, 1, 0};
  check(c, targets, PlanFor::kBackward, &plan, "repeated node");
  EXPECT(plan.level_begin[2] - plan.level_begin[1] >= 1 &&
         plan.group_node[plan.level_begin[1]] == c.path_nodes[b], "repeated node: its second group");
}

// ForEachDistinctRow, in both visiting orders and on any threads: every row named gets
// exactly one update, with 0 + the sum of its gradient rows in the order they are named
// (the bits of tf.unique + unsorted_segment_sum), and no other row gets one.
void TestForEachDistinctRow() {
  std::mt19937_64 rng(7);
  bool saw_gradient_order = false, saw_sorted = false;
  for (int trial = 0; trial < 24; ++trial) {
    // Few rows (many repeats, dense) or many (sparse); 1 or 3 variables per row.
    const int64 num_rows = trial % 2 == 0 ? 40 : 200000;
    const int num_variables = trial % 4 < 2 ? 1 : 3;
    const int64 n = 1 + static_cast<int64>(rng() % 3000), width = 1 + static_cast<int64>(rng() % 19);
    std::vector<int64> rows(n);
    for (auto& r : rows) r = static_cast<int64>(rng() % num_rows);
    // Some dense multi-variable cases name their rows in order (as an HSM gradient of a
    // two-level tree does): visited in the gradient's order, repeats adjacent.
    const bool ascending = trial % 8 == 6;
    if (ascending) std::sort(rows.begin(), rows.end());
    std::vector<float> g(n * width);
    std::normal_distribution<float> normal;
    for (auto& x : g) x = rng() % 7 == 0 ? -0.0f : normal(rng);
    // Expected: the merge's sums, in the order of k.
    std::vector<float> want(num_rows * width, 0.0f);
    std::vector<int> want_named(num_rows, 0);
    for (int64 k = 0; k < n; ++k) {
      want_named[rows[k]] = 1;
      for (int64 i = 0; i < width; ++i) want[rows[k] * width + i] = want[rows[k] * width + i] + g[k * width + i];
    }
    const bool in_gradient_order =
        VisitInGradientOrder(rows.data(), n, num_rows, width * static_cast<int64>(sizeof(float)),
                             num_variables);
    (in_gradient_order ? saw_gradient_order : saw_sorted) = true;
    EXPECT(!ascending || in_gradient_order, "rows in order should be visited in that order");
    for (int threads : {0, 2, 5}) {
      std::vector<float> got(num_rows * width, 1.0f);
      std::vector<std::atomic<int>> updates(num_rows);
      std::atomic<bool> bad_request(false);
      const ParallelFor parallel_for = threads == 0 ? ParallelFor(SerialFor) : ThreadedFor(threads);
      ForEachDistinctRow(rows.data(), n, num_rows, g.data(), width, 10 * width, num_variables,
                         parallel_for,
                         [&](int64 row, const float* g_row) {
                           ++updates[row];
                           for (int64 i = 0; i < width; ++i) got[row * width + i] = 0.0f + g_row[i];
                         },
                         [&](int64 row) {
                           if (row < 0 || row >= num_rows) bad_request = true;
                         });
      EXPECT(!bad_request, "a request outside [0, %ld)", (long)num_rows);
      int64 wrong_count = 0, wrong_bits = 0;
      for (int64 r = 0; r < num_rows; ++r) {
        wrong_count += updates[r] != want_named[r];
        if (want_named[r]) {
          wrong_bits += std::memcmp(&got[r * width], &want[r * width], width * sizeof(float)) != 0;
        }
      }
      EXPECT(wrong_count == 0, "%ld rows not updated exactly once (%s order, %d threads)",
             (long)wrong_count, in_gradient_order ? "gradient" : "sorted", threads);
      EXPECT(wrong_bits == 0, "%ld rows with other sums (%s order, %d threads)", (long)wrong_bits,
             in_gradient_order ? "gradient" : "sorted", threads);
    }
  }
  EXPECT(saw_gradient_order && saw_sorted, "both orders should have been tested");
}

void TestValidation() {
  std::mt19937_64 rng(4);
  Layout t = RandomLayout(rng, 5, 3, 0.5, 50);
  VisitPlan plan;
  std::vector<int64> bad = {0, t.num_classes};
  std::string err = BuildVisitPlan(t.view(), bad.data(), 2, &plan);
  EXPECT(err.find("targets[1]") != std::string::npos, "message: %s", err.c_str());
  bad = {-1};
  err = BuildVisitPlan(t.view(), bad.data(), 1, &plan);
  EXPECT(err.find("targets[0] = -1") != std::string::npos, "message: %s", err.c_str());
  // Corrupt a path slot: it must be caught, not read out of bounds.
  std::vector<int64> ok = {0};
  Layout c = t;
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

void TestLogAndTranspose() {
  // The vectorized float log against std::log from subnormals to the largest float (at
  // most 1 ulp), plus special values; the register transposes on a numbered matrix.
  typedef simd::VecT<float> V;
  constexpr int fw = simd::Vec<float>::kWidth, dw = simd::Vec<double>::kWidth;
  std::vector<float> x;
  for (float v = 1e-44f; v < 3e38f; v = std::max(v * 1.0013f, std::nextafter(v, INFINITY))) x.push_back(v);
  for (float v = 0.5f; v < 2.5f; v += 1.1e-5f) x.push_back(v);
  while (x.size() % fw != 0) x.push_back(1.0f);
  for (size_t i = 0; i < x.size(); i += fw) {
    const V y = simd::LogVec(simd::Load(&x[i]));
    for (int k = 0; k < fw; ++k) {
      const double want = std::log(static_cast<double>(x[i + k]));
      const double ulp = std::fabs(std::nextafter(static_cast<float>(want), INFINITY) - static_cast<float>(want));
      EXPECT(std::fabs(y[k] - want) <= ulp, "log(%g) = %.9g want %.9g", x[i + k], y[k], want);
    }
  }
  // Special values, a vector at a time (vectors of 4 floats with SSE alone).
  float special[16] = {0.0f, -0.0f, -1.0f, INFINITY, NAN, -INFINITY, 1.0f};
  float y[16];
  for (int i = 0; i < 16; i += fw) simd::Store(y + i, simd::LogVec(simd::Load(special + i)));
  EXPECT(y[0] == -INFINITY && y[1] == -INFINITY, "log(0) = %g, log(-0) = %g", y[0], y[1]);
  EXPECT(std::isnan(y[2]) && std::isnan(y[4]) && std::isnan(y[5]), "log of a negative or NaN");
  EXPECT(y[3] == INFINITY && y[6] == 0.0f, "log(inf) = %g, log(1) = %g", y[3], y[6]);
  // log(1 + u) for u in [0, 1] (softplus's log): within 1 ulp of the log of the rounded
  // 1 + u, as LogVec(1 + u) is. (Not its bits: where FMA is available the compiler may
  // contract the shared polynomial differently in the two inlined contexts.)
  std::vector<float> u = {0.0f, 1e-30f, 1e-8f, 5.9e-8f, 6e-8f, 1.2e-7f, 0.41421354f, 0.41421357f,
                          0.4142136f, 1.0f};
  for (float v = 1e-7f; v < 1.0f; v += 3.7e-6f) u.push_back(v);
  while (u.size() % fw != 0) u.push_back(0.5f);
  for (size_t i = 0; i < u.size(); i += fw) {
    const V a = simd::LogOnePlusUnitVec(simd::Load(&u[i]));
    for (int k = 0; k < fw; ++k) {
      const double want = std::log(static_cast<double>(u[i + k] + 1.0f));
      const double ulp = std::fabs(std::nextafter(static_cast<float>(want), INFINITY) - static_cast<float>(want));
      EXPECT(std::fabs(a[k] - want) <= ulp, "log(1 + %g) = %.9g want %.9g", u[i + k], a[k], want);
    }
  }
  const V nan_in = {NAN, 0.25f};
  EXPECT(std::isnan(simd::LogOnePlusUnitVec(nan_in)[0]), "log(1 + NaN) is not NaN");
  V m[fw];
  for (int i = 0; i < fw; ++i)
    for (int j = 0; j < fw; ++j) m[i][j] = static_cast<float>(i * fw + j);
  simd::Transpose<float>(m);
  simd::VecT<double> d[dw];
  for (int i = 0; i < dw; ++i)
    for (int j = 0; j < dw; ++j) d[i][j] = i * dw + j;
  simd::Transpose<double>(d);
  bool ok = true;
  for (int i = 0; i < fw; ++i)
    for (int j = 0; j < fw; ++j) ok = ok && m[i][j] == j * fw + i;
  for (int i = 0; i < dw; ++i)
    for (int j = 0; j < dw; ++j) ok = ok && d[i][j] == j * dw + i;
  EXPECT(ok, "Transpose");
}

// The matrix kernels of the gradient, dh += coef @ W (AccumulateRows) and dW += coef^T @ H
// (AccumulateTransposed), against a long-double reference over shapes with and without
// column tails (D not a multiple of the vector blocks) and row tails. Rows a power of two
// of bytes apart share L1 sets and are copied next to each other before use; the same
// values laid out with a padded stride are not, and must give the same bits.
template <typename T>
void CheckAccumulateKernels(std::mt19937_64& rng, int64 na, int64 nb, int64 D, const char* what) {
  std::normal_distribution<double> normal(0, 1);
  const int64 pad = 16;  // floats: a stride of D + pad breaks the power-of-two spacing
  std::vector<T> coef(na * nb), a_rows(na * D), b_rows(nb * D), a_pad(na * (D + pad)), b_pad(nb * (D + pad));
  for (auto& v : coef) v = static_cast<T>(normal(rng));
  for (int64 i = 0; i < na; ++i)
    for (int64 k = 0; k < D; ++k) a_rows[i * D + k] = a_pad[i * (D + pad) + k] = static_cast<T>(normal(rng));
  for (int64 j = 0; j < nb; ++j)
    for (int64 k = 0; k < D; ++k) b_rows[j * D + k] = b_pad[j * (D + pad) + k] = static_cast<T>(normal(rng));
  std::vector<const T*> a_ptr(na), a_pad_ptr(na);
  for (int64 i = 0; i < na; ++i) {
    a_ptr[i] = a_rows.data() + i * D;
    a_pad_ptr[i] = a_pad.data() + i * (D + pad);
  }
  const T tol = sizeof(T) == 4 ? T(2e-5) : T(1e-12);
  // dh: out[i] = start[i] + sum_j coef[i][j] b[j].
  std::vector<T> start(na * D);
  for (auto& v : start) v = static_cast<T>(normal(rng));
  std::vector<T> dh = start, dh_pad = start;
  std::vector<T*> dh_ptr(na), dh_pad_ptr(na);
  for (int64 i = 0; i < na; ++i) {
    dh_ptr[i] = dh.data() + i * D;
    dh_pad_ptr[i] = dh_pad.data() + i * D;
  }
  simd::AccumulateRows<T>(dh_ptr.data(), na, coef.data(), nb, b_rows.data(), D, nb, D);
  simd::AccumulateRows<T>(dh_pad_ptr.data(), na, coef.data(), nb, b_pad.data(), D + pad, nb, D);
  bool same = true, close = true;
  for (int64 i = 0; i < na; ++i) {
    for (int64 k = 0; k < D; ++k) {
      long double want = start[i * D + k], scale = std::fabs(want);
      for (int64 j = 0; j < nb; ++j) {
        want += (long double)coef[i * nb + j] * b_rows[j * D + k];
        scale += std::fabs((long double)coef[i * nb + j] * b_rows[j * D + k]);
      }
      close = close && std::fabs(dh[i * D + k] - want) <= tol * (1 + scale);
      same = same && dh[i * D + k] == dh_pad[i * D + k];
    }
  }
  EXPECT(close, "%s: AccumulateRows na=%ld nb=%ld D=%ld off the reference", what, (long)na, (long)nb, (long)D);
  EXPECT(same, "%s: AccumulateRows na=%ld nb=%ld D=%ld depends on the row stride", what, (long)na, (long)nb, (long)D);
  // dW: out[j] = sum_i coef[i][j] a[i] (overwrite), then += the same again.
  for (bool overwrite : {true, false}) {
    std::vector<T> dw(nb * D, T(1)), dw_pad(nb * D, T(1));
    simd::AccumulateTransposed<T>(dw.data(), D, nb, coef.data(), nb, a_ptr.data(), na, D, overwrite);
    simd::AccumulateTransposed<T>(dw_pad.data(), D, nb, coef.data(), nb, a_pad_ptr.data(), na, D, overwrite);
    same = close = true;
    for (int64 j = 0; j < nb; ++j) {
      for (int64 k = 0; k < D; ++k) {
        long double want = overwrite ? 0 : 1, scale = 1;
        for (int64 i = 0; i < na; ++i) {
          want += (long double)coef[i * nb + j] * a_rows[i * D + k];
          scale += std::fabs((long double)coef[i * nb + j] * a_rows[i * D + k]);
        }
        close = close && std::fabs(dw[j * D + k] - want) <= tol * scale;
        same = same && dw[j * D + k] == dw_pad[j * D + k];
      }
    }
    EXPECT(close, "%s: AccumulateTransposed na=%ld nb=%ld D=%ld overwrite=%d off the reference", what,
           (long)na, (long)nb, (long)D, (int)overwrite);
    EXPECT(same, "%s: AccumulateTransposed na=%ld nb=%ld D=%ld depends on the row stride", what,
           (long)na, (long)nb, (long)D);
  }
  // StreamTransposed: AccumulateTransposed's overwrite bits, written as one contiguous
  // block wherever it starts relative to a 64-byte line, and nothing outside the block.
  if (D < simd::Vec<T>::kWidth) return;
  std::vector<T> want(nb * D);
  simd::AccumulateTransposed<T>(want.data(), D, nb, coef.data(), nb, a_ptr.data(), na, D, true);
  std::vector<T> doubled(na * 2 * D);
  const int64 lanes = simd::Vec<T>::kWidth;
  for (int64 offset = 0; offset < lanes; offset += (offset < 3 ? 1 : 5)) {
    std::vector<T> storage(nb * D + 3 * lanes, T(7));
    const int64 to_line = (lanes - reinterpret_cast<std::uintptr_t>(storage.data()) % 64 / sizeof(T)) % lanes;
    T* buffer = storage.data() + to_line;  // 64-byte aligned, nb * D + 2 * lanes long
    simd::StreamTransposed<T>(buffer + offset, nb, coef.data(), nb, a_ptr.data(), na, D, doubled.data());
    simd::StreamFence();
    bool inside = true, outside = true;
    for (int64 f = 0; f < nb * D + 2 * lanes; ++f) {
      if (f >= offset && f < offset + nb * D) {
        inside = inside && std::memcmp(&buffer[f], &want[f - offset], sizeof(T)) == 0;
      } else {
        outside = outside && buffer[f] == T(7);
      }
    }
    EXPECT(inside, "%s: StreamTransposed na=%ld nb=%ld D=%ld offset %ld differs from AccumulateTransposed",
           what, (long)na, (long)nb, (long)D, (long)offset);
    EXPECT(outside, "%s: StreamTransposed na=%ld nb=%ld D=%ld offset %ld wrote outside its block", what,
           (long)na, (long)nb, (long)D, (long)offset);
  }
}

// |got - a . b| within tol times (1 + sum_k |a_k b_k|), a . b summed in long double.
template <typename T>
bool DotCloseToReference(T got, const T* a, const T* b, int64 D, T tol) {
  long double want = 0, scale = 0;
  for (int64 k = 0; k < D; ++k) {
    want += (long double)a[k] * b[k];
    scale += std::fabs((long double)a[k] * b[k]);
  }
  return std::fabs(got - want) <= tol * (1 + scale);
}

// The logits kernel of large groups, out[i][j] = a[i] . b[j] from packed panels, against a
// long-double reference over row counts around its 6- and 4-row tiles, slot counts around
// its 4-panel tiles and D around the vector width (D = 0: every output 0). The panels
// must be the rows transposed to the element, zero past nb. Each
// output must not depend on where its row falls among the tiles: every row computed alone
// must give the same bits, and with biases (and a wider output stride) the bits of adding
// them to the finished sums.
template <typename T>
void CheckDotRowsPacked(std::mt19937_64& rng, int64 na, int64 nb, int64 D, const char* what) {
  constexpr int64 w = simd::Vec<T>::kWidth;
  std::normal_distribution<double> normal(0, 1);
  std::vector<T> a_rows(na * D), b_rows(nb * D), panels((nb + w - 1) / w * w * std::max<int64>(D, 1));
  for (auto& v : a_rows) v = static_cast<T>(normal(rng));
  for (auto& v : b_rows) v = static_cast<T>(normal(rng));
  std::vector<const T*> a_ptr(na);
  for (int64 i = 0; i < na; ++i) a_ptr[i] = a_rows.data() + i * D;
  simd::PackPanels<T>(b_rows.data(), D, nb, D, panels.data());
  bool packed = true;
  for (int64 j = 0; j < (nb + w - 1) / w * w; ++j) {
    for (int64 k = 0; k < D; ++k) {
      const T want = j < nb ? b_rows[j * D + k] : T(0);
      packed = packed && panels[((j / w) * D + k) * w + j % w] == want;
    }
  }
  EXPECT(packed, "%s: PackPanels nb=%ld D=%ld: not the rows transposed", what, (long)nb, (long)D);
  const int64 wide = nb + 5;
  std::vector<T> out(na * nb, T(7)), out_wide(na * wide, T(7)), alone(nb, T(7)), bias(nb);
  for (auto& v : bias) v = static_cast<T>(normal(rng));
  simd::DotRowsPacked<T>(a_ptr.data(), na, panels.data(), nb, D, out.data(), nb);
  simd::DotRowsPacked<T>(a_ptr.data(), na, panels.data(), nb, D, out_wide.data(), wide, bias.data());
  const T tol = sizeof(T) == 4 ? T(2e-5) : T(1e-12);
  bool close = true, same = true, untouched = true;
  for (int64 i = 0; i < na; ++i) {
    simd::DotRowsPacked<T>(a_ptr.data() + i, 1, panels.data(), nb, D, alone.data(), nb);
    for (int64 j = 0; j < nb; ++j) {
      close = close && DotCloseToReference(out[i * nb + j], a_rows.data() + i * D, b_rows.data() + j * D, D, tol);
      // With the biases: the bits of adding them to the finished sums.
      same = same && out[i * nb + j] == alone[j] && out[i * nb + j] + bias[j] == out_wide[i * wide + j];
    }
    for (int64 j = nb; j < wide; ++j) untouched = untouched && out_wide[i * wide + j] == T(7);
  }
  EXPECT(close, "%s: DotRowsPacked na=%ld nb=%ld D=%ld off the reference", what, (long)na, (long)nb, (long)D);
  EXPECT(same, "%s: DotRowsPacked na=%ld nb=%ld D=%ld: a row's bits depend on its tile or stride", what,
         (long)na, (long)nb, (long)D);
  EXPECT(untouched, "%s: DotRowsPacked na=%ld nb=%ld D=%ld wrote past column nb", what, (long)na, (long)nb,
         (long)D);
}

void TestDotRowsPacked() {
  std::mt19937_64 rng(11);
  for (int64 D : {0, 1, 63, 64, 65, 129, 300, 512}) {
    for (int64 na : {1, 4, 5, 6, 7, 10, 16, 23, 64}) {
      for (int64 nb : {1, 15, 16, 17, 64, 65, 128}) {
        CheckDotRowsPacked<float>(rng, na, nb, D, "float");
        if (D % 2 == 1) CheckDotRowsPacked<double>(rng, na, nb, D, "double");
      }
    }
  }
}

// The dot-product kernels (DotEach, DotColumns, DotRows with each register tile, and
// DotScattered's row groups) against a long-double reference and against each other: callers switch
// between them by tile shape and count on the same bits from all of them.
template <typename T>
void CheckDotKernelsAgree(std::mt19937_64& rng, int64 na, int64 nb, int64 D, const char* what) {
  std::normal_distribution<double> normal(0, 1);
  std::vector<T> a_rows(na * D), b_rows(nb * D);
  for (auto& v : a_rows) v = static_cast<T>(normal(rng));
  for (auto& v : b_rows) v = static_cast<T>(normal(rng));
  std::vector<const T*> a_ptr(na), b_ptr(nb);
  for (int64 i = 0; i < na; ++i) a_ptr[i] = a_rows.data() + i * D;
  for (int64 j = 0; j < nb; ++j) b_ptr[j] = b_rows.data() + j * D;
  std::vector<T> each(na * nb), columns(na * nb), r1x16(na * nb), r2x8(na * nb), r4x4(na * nb),
      group(na * nb);
  simd::DotEach<T>(a_ptr.data(), na, b_rows.data(), D, nb, D, each.data(), nb);
  simd::DotColumns<T>(a_ptr.data(), na, b_rows.data(), D, nb, D, columns.data(), nb);
  simd::DotRows<T, 1, 16>(a_ptr.data(), na, b_rows.data(), D, nb, D, r1x16.data(), nb);
  simd::DotRows<T, 2, 8>(a_ptr.data(), na, b_rows.data(), D, nb, D, r2x8.data(), nb);
  simd::DotRows<T, 4, 4>(a_ptr.data(), na, b_rows.data(), D, nb, D, r4x4.data(), nb);
  for (int64 i = 0; i < na; ++i) simd::DotScattered<T>(a_ptr[i], b_ptr.data(), nb, D, group.data() + i * nb);
  const T tol = sizeof(T) == 4 ? T(2e-5) : T(1e-12);
  bool close = true;
  for (int64 i = 0; i < na; ++i) {
    for (int64 j = 0; j < nb; ++j) {
      close = close && DotCloseToReference(each[i * nb + j], &a_rows[i * D], &b_rows[j * D], D, tol);
    }
  }
  EXPECT(close, "%s: DotEach na=%ld nb=%ld D=%ld off the reference", what, (long)na, (long)nb, (long)D);
  const std::pair<const char*, const std::vector<T>*> others[] = {
      {"DotColumns", &columns}, {"DotRows 1x16", &r1x16}, {"DotRows 2x8", &r2x8},
      {"DotRows 4x4", &r4x4}, {"DotScattered", &group}};
  for (const auto& other : others) {
    EXPECT(std::memcmp(each.data(), other.second->data(), each.size() * sizeof(T)) == 0,
           "%s: %s na=%ld nb=%ld D=%ld does not give DotEach's bits", what, other.first, (long)na,
           (long)nb, (long)D);
  }
}

void TestDotKernelsAgree() {
  std::mt19937_64 rng(13);
  for (int64 D : {1, 15, 16, 17, 64, 100, 300}) {
    for (int64 na : {1, 2, 3, 4, 5, 9}) {
      for (int64 nb : {1, 7, 8, 16, 17, 130}) {
        CheckDotKernelsAgree<float>(rng, na, nb, D, "float");
        if (D % 2 == 1) CheckDotKernelsAgree<double>(rng, na, nb, D, "double");
      }
    }
  }
}

void TestAccumulateKernels() {
  std::mt19937_64 rng(7);
  for (int64 D : {1, 17, 64, 100, 256, 300, 512}) {
    for (int64 na : {1, 2, 3, 5, 12, 16, 64}) {
      for (int64 nb : {1, 3, 16, 61, 128}) {
        CheckAccumulateKernels<float>(rng, na, nb, D, "float");
        if (D % 3 == 1) CheckAccumulateKernels<double>(rng, na, nb, D, "double");
      }
    }
  }
}

}  // namespace
}  // namespace tf_hsm

int main() {
  using tf_hsm::testing::NamedTest;
  static const NamedTest tests[] = {
      {"exp", tf_hsm::TestExp},
      {"log_and_transpose", tf_hsm::TestLogAndTranspose},
      {"accumulate_kernels", tf_hsm::TestAccumulateKernels},
      {"dot_rows_packed", tf_hsm::TestDotRowsPacked},
      {"dot_kernels_agree", tf_hsm::TestDotKernelsAgree},
      {"against_reference", tf_hsm::TestAgainstReference},
      {"determinism", tf_hsm::TestDeterminism},
      {"streamed_gradient_rows", tf_hsm::TestStreamedGradientRows},
      {"coefficient_store_reused", tf_hsm::TestCoefficientStoreReused},
      {"coefficient_budget", tf_hsm::TestCoefficientBudget},
      {"weights_changed_between_calls", tf_hsm::TestWeightsChangedBetweenCalls},
      {"nan_stays_in_its_row", tf_hsm::TestNanStaysInItsRow},
      {"in_place_sgd", tf_hsm::TestInPlaceSgd},
      {"log_prob_from_backward", tf_hsm::TestLogProbFromBackward},
      {"visit_plan_structure", tf_hsm::TestVisitPlanStructure},
      {"validation", tf_hsm::TestValidation},
      {"for_each_distinct_row", tf_hsm::TestForEachDistinctRow},
  };
  return tf_hsm::testing::RunTests(tests);
}
