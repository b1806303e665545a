// Sample (see inference.h): ancestral sampling with a counter-based generator.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "cc/core/inference.h"
#include "cc/core/inference_common.h"

namespace tf_hsm {
namespace inference_internal {
namespace {

constexpr int64 kSampleRows = 64;  // rows one Sample work item walks together

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

// sampling::PickSlot with the vector exp of the CPU core.
template <typename T>
int64 PickSlot(T* z, int64 K, T temperature, double u) {
  return sampling::PickSlot(z, K, temperature, u, [](T* e, int64 n) { simd::ExpInPlace(e, n); });
}

// Nodes of more than this many children are drawn from without keeping a row's logits
// (WideDraws): such a node's kept logits would leave room for fewer than 16 rows, and
// each batch of rows reads the node's weights once more.
constexpr int64 kWideSampleSlots = kLogitBudget / 16;

// Each row's PickSlot draw at the node of slots [begin, begin + K), its logits computed
// tile by tile in three passes instead of kept: their maximum; the sum of
// exp((z - max) / temperature) in slot order, in double; the slot where the running sum
// passes u * total. The rows share each pass over the node's weights, and every row gets
// PickSlot's slot bit for bit: the same maximum, the same exponentials (element by
// element), summed in the same order, with the dot-product kernels' own bits.
template <typename T>
void WideDraws(const SoftmaxParams<T>& p, const T* const* rows, int64 nb, int64 begin,
               int64 K, T temperature, const double* u, int64* picked) {
  const T inf = std::numeric_limits<T>::infinity();
  T* z = Grow(&ThreadScratch<T>().z, nb * kSlotTile);
  std::vector<T> m(nb, -inf);
  std::vector<double> sum(nb, 0.0), target(nb, 0.0);
  std::vector<char> done(nb, 0);
  std::fill(picked, picked + nb, int64{-1});
  // Runs on_row(r, logits, k0, kb) over every tile, for the rows not done.
  auto pass = [&](auto&& on_row) {
    for (int64 k0 = 0; k0 < K; k0 += kSlotTile) {
      const int64 kb = std::min(kSlotTile, K - k0);
      Logits(p, rows, nb, begin + k0, kb, static_cast<const T*>(nullptr), z, kb);
      for (int64 r = 0; r < nb; ++r) {
        if (!done[r]) on_row(r, z + r * kb, k0, kb);
      }
    }
  };
  pass([&](int64 r, const T* zr, int64, int64 kb) {
    for (int64 j = 0; j < kb; ++j) {
      if (zr[j] != zr[j]) done[r] = 1;  // NaN: -1
      m[r] = zr[j] > m[r] ? zr[j] : m[r];
    }
  });
  for (int64 r = 0; r < nb; ++r) done[r] = done[r] || m[r] == -inf || m[r] == inf;
  auto exps = [&](int64 r, T* zr, int64 kb) {
    for (int64 j = 0; j < kb; ++j) zr[j] = (zr[j] - m[r]) / temperature;
    simd::ExpInPlace(zr, kb);
  };
  pass([&](int64 r, const T* zr, int64, int64 kb) {
    exps(r, const_cast<T*>(zr), kb);
    for (int64 j = 0; j < kb; ++j) sum[r] += static_cast<double>(zr[j]);
  });
  std::vector<double> acc(nb, 0.0);
  for (int64 r = 0; r < nb; ++r) target[r] = u[r] * sum[r];
  std::vector<char> drawn(done);
  pass([&](int64 r, const T* zr, int64 k0, int64 kb) {
    if (drawn[r]) return;
    exps(r, const_cast<T*>(zr), kb);
    for (int64 j = 0; j < kb; ++j) {
      if (!(zr[j] > T(0))) continue;
      acc[r] += static_cast<double>(zr[j]);
      picked[r] = k0 + j;  // the last positive slot, where u * total rounds up to total
      if (acc[r] > target[r]) {
        drawn[r] = 1;
        return;
      }
    }
  });
}

struct SampleState {
  int64 node;
  int64 depth;
  bool done;
};

// The slot each of the nb rows draws at the node of slots [begin, begin + K): PickSlot
// over its kept logits, or WideDraws for a wide node.
template <typename T>
void DrawSlots(const SoftmaxParams<T>& p, const T* const* rows, int64 nb, int64 begin,
               int64 K, T temperature, const double* u, int64* picked) {
  if (K > kWideSampleSlots) {
    WideDraws(p, rows, nb, begin, K, temperature, u, picked);
    return;
  }
  T* z = Grow(&ThreadScratch<T>().z, nb * K);
  // Always the dot-product kernels, whose bits do not depend on the other rows: a row's
  // sample then depends on nothing but its own inputs, position and seed.
  NodeLogits(p, rows, nb, begin, K, false, z, static_cast<T*>(nullptr));
  for (int64 i = 0; i < nb; ++i) picked[i] = PickSlot(z + i * K, K, temperature, u[i]);
}

template <typename T>
std::string SampleRows(const TreeView& t, const SoftmaxParams<T>& p, std::uint64_t seed,
                       T temperature, int64 row0, int64 nr, int64* classes) {
  const int64 C = t.num_classes;
  Scratch<T>& s = ThreadScratch<T>();
  thread_local std::vector<SampleState> state;
  thread_local std::vector<Request> req;
  thread_local std::vector<double> u;
  thread_local std::vector<int64> picked;
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
      const int64 batch = K > kWideSampleSlots
                              ? static_cast<int64>(g1 - g0)
                              : std::max<int64>(1, std::min<int64>(g1 - g0, kLogitBudget / K));
      for (size_t b0 = g0; b0 < g1; b0 += batch) {
        const int64 nb = std::min<int64>(batch, g1 - b0);
        const T** rows = Grow(&s.rows, nb);
        u.resize(nb);
        picked.resize(nb);
        for (int64 i = 0; i < nb; ++i) {
          const int64 r = req[b0 + i].row;
          rows[i] = p.hidden + (row0 + r) * p.dim;
          u[i] = sampling::Uniform(seed, row0 + r, state[r].depth);
        }
        DrawSlots(p, rows, nb, begin, K, temperature, u.data(), picked.data());
        for (int64 i = 0; i < nb; ++i) {
          SampleState& st = state[req[b0 + i].row];
          const int64 code = picked[i] < 0 ? -1 : t.slot_child[begin + picked[i]];
          if (code < C) {
            classes[row0 + req[b0 + i].row] = code;
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

}  // namespace
}  // namespace inference_internal

template <typename T>
std::string Sample(const TreeView& tree, const SoftmaxParams<T>& p, int64 num_rows,
                   std::uint64_t seed, T temperature, const ParallelFor& parallel_for,
                   int64* classes) {
  using namespace inference_internal;
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

template std::string Sample<float>(const TreeView&, const SoftmaxParams<float>&, int64,
                                   std::uint64_t, float, const ParallelFor&, int64*);
template std::string Sample<double>(const TreeView&, const SoftmaxParams<double>&, int64,
                                    std::uint64_t, double, const ParallelFor&, int64*);

}  // namespace tf_hsm
