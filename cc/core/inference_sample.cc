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
          const int64 j = PickSlot(z + i * K, K, temperature, sampling::Uniform(seed, row0 + r, st.depth));
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
