// CUDA kernels of LogProbAll, Sample and TopK; the contract and the design are described in
// inference_gpu.h.
#include "cc/core/inference_gpu.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "cc/core/gpu_compat.cuh"

namespace tf_hsm {
namespace gpu {
namespace {

constexpr int kThreads = 256;  // every kernel of this file; a power of two
#ifdef TF_HSM_GPU_EMULATE
constexpr int64 kMaxBlocks = 5;  // so that the emulator exercises the grid-stride loops
#else
constexpr int64 kMaxBlocks = int64{1} << 20;
#endif
constexpr int64 kMaxSampleBlocks = kMaxBlocks < 4096 ? kMaxBlocks : 4096;
constexpr int64 kAlign = 256;  // workspace sub-buffer alignment (bytes)

template <typename... Parts>
std::string Message(const Parts&... parts) {
  std::ostringstream s;
  (s << ... << parts);
  return s.str();
}

// Everything the kernels read or write, as device pointers.
template <typename T>
struct Args {
  const T* hidden;
  const T* weights;
  const T* biases;  // may be null
  int64 dim;
  const int64* child_begin;  // [M + 1]
  const int64* slot_child;   // [S]
  const int64* nodes;        // the needed nodes, increasing
  const int64* position;     // [M]: index in nodes, or -1
  int64 num_classes, num_positions, max_branching;
  int64 class_begin, class_end;
  T* node_values;  // [wave rows, num_positions]
  T* scratch;      // Sample: [blocks, max_branching]
};

// z = w . h (+ b): one fma chain over d in order, then the bias.
template <typename T>
TF_HSM_DEVICE T ChainDot(const T* h, const T* w, int64 dim, const T* bias) {
  T s = T(0);
  for (int64 d = 0; d < dim; ++d) s = Fma(h[d], w[d], s);
  if (bias != nullptr) s += *bias;
  return s;
}

// Folds z into a running (max, sum of exp(z - max)). NaN makes the sum NaN (the max ignores
// it); -inf adds nothing; +inf makes the sum NaN, as in the CPU core.
template <typename T>
TF_HSM_DEVICE void Fold(T z, T* m, T* s) {
  if (z > *m) {
    *s = *s * Exp(*m - z) + Exp(z - z);
    *m = z;
  } else if (z != NegInf<T>()) {
    *s += Exp(z - *m);
  }
}

// (m1, s1) combined with (m2, s2); a zero sum adds nothing, a NaN sum stays NaN.
template <typename T>
TF_HSM_DEVICE void Combine(T* m1, T* s1, T m2, T s2) {
  if (m2 > *m1) {
    *s1 = (*s1 == T(0) ? T(0) : *s1 * Exp(*m1 - m2)) + s2;
    *m1 = m2;
  } else {
    *s1 = *s1 + (s2 == T(0) ? T(0) : s2 * Exp(m2 - *m1));
  }
}

// The block's logsumexp from every thread's (m, s): a fixed-shape tree over thread ids.
template <typename T>
TF_HSM_DEVICE T BlockLogSumExp(T m, T s) {
  TF_HSM_SHARED T sm[kThreads];
  TF_HSM_SHARED T ss[kThreads];
  const int tid = ThreadX();
  sm[tid] = m;
  ss[tid] = s;
  SyncThreads();
  for (int h = kThreads / 2; h > 0; h /= 2) {
    if (tid < h) {
      T a = sm[tid], b = ss[tid];
      Combine(&a, &b, sm[tid + h], ss[tid + h]);
      sm[tid] = a;
      ss[tid] = b;
    }
    SyncThreads();
  }
  const T lse = sm[0] + Log(ss[0]);
  SyncThreads();  // everyone has read before the next call writes
  return lse;
}

// Rows [row0, row0 + nrows), a block per row: out[(row - row0) * out_ld + c - class_begin]
// = log P(c | row) for the classes in [class_begin, class_end).
template <typename T>
TF_HSM_GLOBAL void LogProbAllKernel(Args<T> a, int64 row0, int64 nrows, T* out, int64 out_ld) {
  const int tid = ThreadX();
  const int64 C = a.num_classes, dim = a.dim;
  for (int64 i = BlockX(); i < nrows; i += GridX()) {
    const T* h = a.hidden + (row0 + i) * dim;
    T* vals = a.node_values + i * a.num_positions;
    T* o = out + i * out_ld;
    // Where child `code`'s value goes, or nullptr when it is not needed.
    auto target = [&](int64 code) -> T* {
      if (code < C) {
        return code >= a.class_begin && code < a.class_end ? o + (code - a.class_begin) : nullptr;
      }
      const int64 q = a.position[code - C];
      return q < 0 ? nullptr : vals + q;
    };
    for (int64 q = 0; q < a.num_positions; ++q) {
      const int64 n = a.nodes[q];
      const int64 first = a.child_begin[n], K = a.child_begin[n + 1] - first;
      // Pass 1: logits, parked at their destinations, folded into this thread's logsumexp.
      T m = NegInf<T>(), s = T(0);
      for (int64 j = tid; j < K; j += kThreads) {
        const int64 slot = first + j;
        const T z = ChainDot(h, a.weights + slot * dim, dim,
                             a.biases != nullptr ? a.biases + slot : nullptr);
        Fold(z, &m, &s);
        T* t = target(a.slot_child[slot]);
        if (t != nullptr) *t = z;
      }
      // Also orders the previous node's writes (this node's parent value) before pass 2.
      const T lse = BlockLogSumExp(m, s);
      const T parent = q == 0 ? T(0) : vals[q];
      // Pass 2: the same thread finishes the values it parked.
      for (int64 j = tid; j < K; j += kThreads) {
        T* t = target(a.slot_child[first + j]);
        if (t != nullptr) *t = parent + (*t - lse);
      }
    }
  }
}

// The splitmix64 finaliser and the CPU core's uniform double in [0, 1) for (seed, row, step).
TF_HSM_HOST_DEVICE std::uint64_t Mix64(std::uint64_t z) {
  z += 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

TF_HSM_HOST_DEVICE double Uniform(std::uint64_t seed, int64 row, int64 step) {
  const std::uint64_t x = Mix64(Mix64(Mix64(seed) + static_cast<std::uint64_t>(row)) +
                                static_cast<std::uint64_t>(step));
  return static_cast<double>(x >> 11) * 0x1.0p-53;
}

// The CPU core's PickSlot: j with probability softmax(z / temperature)[j], by the
// cumulative sum in double at u; -1 for NaN or +inf logits or all -inf. Overwrites z.
template <typename T>
TF_HSM_DEVICE int64 PickSlot(T* z, int64 K, T temperature, double u) {
  T m = NegInf<T>();
  for (int64 j = 0; j < K; ++j) {
    if (z[j] != z[j]) return -1;
    m = z[j] > m ? z[j] : m;
  }
  if (m == NegInf<T>() || m == -NegInf<T>()) return -1;
  double total = 0;
  for (int64 j = 0; j < K; ++j) {
    z[j] = Exp((z[j] - m) / temperature);
    total += static_cast<double>(z[j]);
  }
  const double target = u * total;
  double acc = 0;
  int64 last = -1;
  for (int64 j = 0; j < K; ++j) {
    if (!(z[j] > T(0))) continue;
    acc += static_cast<double>(z[j]);
    last = j;
    if (acc > target) return j;
  }
  return last;
}

// A block per row walks from the root to a class.
template <typename T>
TF_HSM_GLOBAL void SampleKernel(Args<T> a, std::uint64_t seed, T temperature, int64 num_rows,
                                int64* classes) {
  TF_HSM_SHARED int64 picked;
  const int tid = ThreadX();
  const int64 C = a.num_classes, dim = a.dim;
  T* z = a.scratch + BlockX() * a.max_branching;
  for (int64 row = BlockX(); row < num_rows; row += GridX()) {
    const T* h = a.hidden + row * dim;
    int64 node = 0;
    for (int64 depth = 0;; ++depth) {
      const int64 first = a.child_begin[node], K = a.child_begin[node + 1] - first;
      for (int64 j = tid; j < K; j += kThreads) {
        const int64 slot = first + j;
        z[j] = ChainDot(h, a.weights + slot * dim, dim,
                        a.biases != nullptr ? a.biases + slot : nullptr);
      }
      SyncThreads();
      if (tid == 0) {
        const int64 j = PickSlot(z, K, temperature, Uniform(seed, row, depth));
        picked = j < 0 ? -1 : a.slot_child[first + j];
      }
      SyncThreads();
      // `picked` is rewritten only after the next node's first barrier, which every thread
      // reaches after reading it here.
      const int64 code = picked;
      if (code < C) {
        if (tid == 0) classes[row] = code;
        break;
      }
      node = code - C;
    }
    SyncThreads();  // thread 0 is done with `picked` and z before the next row
  }
}

// True when (a, ia) comes before (b, ib) in TopK's output order: larger value first, NaN
// last, equal values (and NaNs among themselves) by increasing class id.
template <typename T>
TF_HSM_DEVICE bool Before(T a, int64 ia, T b, int64 ib) {
  const bool a_nan = a != a, b_nan = b != b;
  if (a_nan != b_nan) return b_nan;
  if (!a_nan) {
    if (a > b) return true;
    if (a < b) return false;
  }
  return ia < ib;
}

// Top k of each row of all[nrows, C], a block per row: k rounds of a block-wide arg-best
// over the classes strictly after the previous pick.
template <typename T>
TF_HSM_GLOBAL void TopKSelectKernel(const T* all, int64 C, int64 k, int64 num_nodes, int64 row0,
                                    int64 nrows, T* log_probs, int64* classes,
                                    int64* num_expanded) {
  TF_HSM_SHARED T sv[kThreads];
  TF_HSM_SHARED int64 si[kThreads];
  const int tid = ThreadX();
  for (int64 i = BlockX(); i < nrows; i += GridX()) {
    const T* v = all + i * C;
    const int64 row = row0 + i;
    T prev = T(0);
    int64 prev_id = -1;
    for (int64 j = 0; j < k; ++j) {
      T best = T(0);
      int64 best_id = -1;
      for (int64 c = tid; c < C; c += kThreads) {
        const T x = v[c];
        if (prev_id >= 0 && !Before(prev, prev_id, x, c)) continue;
        if (best_id < 0 || Before(x, c, best, best_id)) {
          best = x;
          best_id = c;
        }
      }
      sv[tid] = best;
      si[tid] = best_id;
      SyncThreads();
      for (int hh = kThreads / 2; hh > 0; hh /= 2) {
        if (tid < hh) {
          const T ov = sv[tid + hh];
          const int64 oi = si[tid + hh];
          if (oi >= 0 && (si[tid] < 0 || Before(ov, oi, sv[tid], si[tid]))) {
            sv[tid] = ov;
            si[tid] = oi;
          }
        }
        SyncThreads();
      }
      prev = sv[0];
      prev_id = si[0];
      SyncThreads();  // everyone has read the winner before the next round writes
      if (tid == 0) {
        log_probs[row * k + j] = prev;
        classes[row * k + j] = prev_id;
      }
    }
    if (tid == 0) num_expanded[row] = num_nodes;
  }
}

// ---- Host side ---------------------------------------------------------------------------

std::string CudaMessage(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return "";
  return std::string("CUDA error in ") + what + ": " + cudaGetErrorString(err);
}

#define TF_HSM_RETURN_IF_CUDA_ERROR(call, what)           \
  do {                                                    \
    const std::string message_ = CudaMessage(call, what); \
    if (!message_.empty()) return message_;               \
  } while (0)

// Checks the whole tree (every node's non-empty slot range, every child code, each class
// and each non-root node the child of exactly one node, child nodes numbered after their
// parent) and returns each node's parent (-1 for the root) and each class's node.
std::string CheckTree(const TreeView& t, std::vector<int64>* parent, std::vector<int64>* owner) {
  const int64 C = t.num_classes, M = t.num_nodes, S = t.num_slots;
  if (C < 1) return "the tree has no classes (path_begin needs at least 2 entries)";
  if (M < 1) return "the tree has no nodes (child_begin needs at least 2 entries)";
  if (t.slot_child == nullptr) return "slot_child is required";
  parent->assign(M, -1);
  owner->assign(C, -1);
  for (int64 n = 0; n < M; ++n) {
    const int64 begin = t.child_begin[n], end = t.child_begin[n + 1];
    if (begin < 0 || end <= begin || end > S) {
      return Message("malformed tree: child_begin[", n, ":", n + 2, "] = [", begin, ", ", end,
                     "] is not a non-empty slot range within the ", S, " weight rows");
    }
    for (int64 s = begin; s < end; ++s) {
      const int64 code = t.slot_child[s];
      if (code < 0 || code >= C + M) {
        return Message("malformed tree: slot_child[", s, "] = ", code,
                       " is outside [0, num_classes + num_nodes) = [0, ", C + M, ")");
      }
      if (code >= C && code - C <= n) {
        return Message("malformed tree: slot_child[", s, "] = ", code, " makes node ", code - C,
                       " a child of node ", n, "; a child node must be numbered after its parent");
      }
      int64& slot_of = code < C ? (*owner)[code] : (*parent)[code - C];
      if (slot_of >= 0) {
        return Message("malformed tree: ", code < C ? "class " : "node ",
                       code < C ? code : code - C, " is the child of two slots");
      }
      slot_of = n;
    }
  }
  for (int64 c = 0; c < C; ++c) {
    if ((*owner)[c] < 0) return Message("malformed tree: class ", c, " is no node's child");
  }
  for (int64 m = 1; m < M; ++m) {
    if ((*parent)[m] < 0) return Message("malformed tree: node ", m, " is no node's child");
  }
  return "";
}

// Fills everything but the value buffers: the tree upload and the needed nodes.
std::string PrepareCommon(const TreeView& tree, int64 num_rows, int64 dim, bool has_bias,
                          int64 value_bytes, int64 class_begin, int64 class_end,
                          GpuInferencePlan* out, int64* cursor) {
  GpuInferencePlan& gp = *out;
  if (num_rows < 0 || dim < 0) {
    return Message("invalid sizes: ", num_rows, " rows of dimension ", dim);
  }
  std::vector<int64> parent, owner;
  std::string err = CheckTree(tree, &parent, &owner);
  if (!err.empty()) return err;
  const int64 C = tree.num_classes, M = tree.num_nodes, S = tree.num_slots;
  if (class_begin < 0 || class_end < class_begin || class_end > C) {
    return Message("class_range = [", class_begin, ", ", class_end,
                   ") must satisfy 0 <= begin <= end <= num_classes = ", C);
  }
  gp.has_bias = has_bias;
  gp.value_bytes = value_bytes;
  gp.dim = dim;
  gp.num_rows = num_rows;
  gp.num_classes = C;
  gp.num_nodes = M;
  gp.num_slots = S;
  gp.class_begin = class_begin;
  gp.class_end = class_end;
  for (int64 n = 0; n < M; ++n) {
    gp.max_branching = std::max(gp.max_branching, tree.child_begin[n + 1] - tree.child_begin[n]);
  }
  // Needed nodes: those on the path of some class in the range.
  std::vector<char> need(M, 0);
  for (int64 c = class_begin; c < class_end; ++c) {
    for (int64 n = owner[c]; n >= 0 && !need[n]; n = parent[n]) need[n] = 1;
  }
  std::vector<int64> nodes, position(M, -1);
  for (int64 n = 0; n < M; ++n) {
    if (need[n]) {
      position[n] = static_cast<int64>(nodes.size());
      nodes.push_back(n);
    }
  }
  gp.num_positions = static_cast<int64>(nodes.size());

  auto reserve = [cursor](int64 bytes) {
    const int64 at = *cursor;
    *cursor += (bytes + kAlign - 1) / kAlign * kAlign;
    return at;
  };
  const int64 w = sizeof(int64);
  gp.child_begin = reserve((M + 1) * w);
  gp.slot_child = reserve(S * w);
  gp.nodes = reserve(std::max<int64>(gp.num_positions, 1) * w);
  gp.position = reserve(M * w);
  gp.staging.assign(*cursor / w, 0);
  int64* words = gp.staging.data();
  std::copy(tree.child_begin, tree.child_begin + M + 1, words + gp.child_begin / w);
  std::copy(tree.slot_child, tree.slot_child + S, words + gp.slot_child / w);
  std::copy(nodes.begin(), nodes.end(), words + gp.nodes / w);
  std::copy(position.begin(), position.end(), words + gp.position / w);
  return "";
}

int64 Reserve(int64* cursor, int64 bytes) {
  const int64 at = *cursor;
  *cursor += (bytes + kAlign - 1) / kAlign * kAlign;
  return at;
}

std::string CheckCall(const GpuInferencePlan& plan, GpuInferencePlan::Mode mode,
                      int64 value_bytes, int64 dim, bool has_bias, const void* workspace) {
  if (plan.mode != mode) {
    static const char* kNeeds[] = {"LogProbAllGpu needs a plan from PrepareLogProbAllGpu",
                                   "SampleGpu needs a plan from PrepareSampleGpu",
                                   "TopKGpu needs a plan from PrepareTopKGpu"};
    return kNeeds[static_cast<int>(mode)];
  }
  if (plan.value_bytes != value_bytes) return "the plan was prepared for another value type";
  if (plan.dim != dim) return "the plan was prepared for another hidden size";
  if (plan.has_bias != has_bias) return "the plan was prepared with a different bias setting";
  if (workspace == nullptr || reinterpret_cast<std::uintptr_t>(workspace) % 16 != 0) {
    return "the workspace must be a 16-byte aligned device buffer";
  }
  return "";
}

template <typename T>
Args<T> MakeArgs(const GpuInferencePlan& plan, const SoftmaxParams<T>& p, void* workspace) {
  char* base = static_cast<char*>(workspace);
  Args<T> a;
  std::memset(&a, 0, sizeof(a));
  a.hidden = p.hidden;
  a.weights = p.weights;
  a.biases = p.biases;
  a.dim = p.dim;
  a.child_begin = reinterpret_cast<const int64*>(base + plan.child_begin);
  a.slot_child = reinterpret_cast<const int64*>(base + plan.slot_child);
  a.nodes = reinterpret_cast<const int64*>(base + plan.nodes);
  a.position = reinterpret_cast<const int64*>(base + plan.position);
  a.num_classes = plan.num_classes;
  a.num_positions = plan.num_positions;
  a.max_branching = plan.max_branching;
  a.class_begin = plan.class_begin;
  a.class_end = plan.class_end;
  a.node_values = reinterpret_cast<T*>(base + plan.node_values);
  a.scratch = reinterpret_cast<T*>(base + plan.scratch);
  return a;
}

std::string Upload(const GpuInferencePlan& plan, void* workspace, cudaStream_t stream) {
  TF_HSM_RETURN_IF_CUDA_ERROR(
      cudaMemcpyAsync(workspace, plan.staging.data(), plan.staging.size() * sizeof(int64),
                      cudaMemcpyHostToDevice, stream),
      "uploading the tree");
  return "";
}

}  // namespace
}  // namespace gpu

template <typename T>
std::string PrepareLogProbAllGpu(const TreeView& tree, int64 num_rows, int64 dim, bool has_bias,
                                 int64 class_begin, int64 class_end, int64 budget,
                                 GpuInferencePlan* out) {
  *out = GpuInferencePlan();
  out->mode = GpuInferencePlan::kLogProbAll;
  int64 cursor = 0;
  std::string err = gpu::PrepareCommon(tree, num_rows, dim, has_bias, sizeof(T), class_begin,
                                       class_end, out, &cursor);
  if (!err.empty()) return err;
  const int64 per_row = std::max<int64>(out->num_positions, 1);
  out->wave_rows = std::max<int64>(1, std::min(num_rows, budget / per_row));
  out->node_values = gpu::Reserve(&cursor, out->wave_rows * per_row * sizeof(T));
  out->workspace_bytes = cursor;
  return "";
}

template <typename T>
std::string LogProbAllGpu(const GpuInferencePlan& plan, const SoftmaxParams<T>& p, T* out,
                          void* workspace, CUstream_st* stream) {
  using namespace gpu;  // NOLINT: the kernels and helpers of this file
  std::string err = CheckCall(plan, GpuInferencePlan::kLogProbAll, sizeof(T), p.dim,
                              p.biases != nullptr, workspace);
  if (!err.empty()) return err;
  const int64 width = plan.class_end - plan.class_begin;
  if (plan.num_rows == 0 || width == 0) return "";
  err = Upload(plan, workspace, stream);
  if (!err.empty()) return err;
  const Args<T> a = MakeArgs(plan, p, workspace);
  for (int64 r0 = 0; r0 < plan.num_rows; r0 += plan.wave_rows) {
    const int64 nr = Min64(plan.wave_rows, plan.num_rows - r0);
    TF_HSM_RETURN_IF_CUDA_ERROR(Launch(&LogProbAllKernel<T>, Min64(nr, kMaxBlocks), kThreads,
                                       stream, a, r0, nr, out + r0 * width, width),
                                "LogProbAllKernel");
  }
  return "";
}

template <typename T>
std::string PrepareSampleGpu(const TreeView& tree, int64 num_rows, int64 dim, bool has_bias,
                             GpuInferencePlan* out) {
  *out = GpuInferencePlan();
  out->mode = GpuInferencePlan::kSample;
  int64 cursor = 0;
  // No class range: only the tree upload is needed.
  std::string err = gpu::PrepareCommon(tree, num_rows, dim, has_bias, sizeof(T), 0, 0, out, &cursor);
  if (!err.empty()) return err;
  out->sample_blocks = std::max<int64>(1, std::min(num_rows, gpu::kMaxSampleBlocks));
  out->scratch = gpu::Reserve(&cursor, out->sample_blocks * out->max_branching * sizeof(T));
  out->workspace_bytes = cursor;
  return "";
}

template <typename T>
std::string SampleGpu(const GpuInferencePlan& plan, const SoftmaxParams<T>& p,
                      std::uint64_t seed, T temperature, int64* classes, void* workspace,
                      CUstream_st* stream) {
  using namespace gpu;  // NOLINT: the kernels and helpers of this file
  if (!(temperature > 0) || std::isinf(temperature)) {
    return Message("temperature = ", temperature, " must be positive and finite");
  }
  std::string err = CheckCall(plan, GpuInferencePlan::kSample, sizeof(T), p.dim,
                              p.biases != nullptr, workspace);
  if (!err.empty() || plan.num_rows == 0) return err;
  err = Upload(plan, workspace, stream);
  if (!err.empty()) return err;
  const Args<T> a = MakeArgs(plan, p, workspace);
  TF_HSM_RETURN_IF_CUDA_ERROR(Launch(&SampleKernel<T>, plan.sample_blocks, kThreads, stream, a,
                                     seed, temperature, plan.num_rows, classes),
                              "SampleKernel");
  return "";
}

template <typename T>
std::string PrepareTopKGpu(const TreeView& tree, int64 num_rows, int64 dim, bool has_bias,
                           int64 k, int64 budget, GpuInferencePlan* out) {
  *out = GpuInferencePlan();
  out->mode = GpuInferencePlan::kTopK;
  int64 cursor = 0;
  std::string err = gpu::PrepareCommon(tree, num_rows, dim, has_bias, sizeof(T), 0,
                                       tree.num_classes, out, &cursor);
  if (!err.empty()) return err;
  if (k < 1 || k > tree.num_classes) {
    return gpu::Message("k = ", k, " must be in [1, num_classes] = [1, ", tree.num_classes, "]");
  }
  out->k = k;
  const int64 per_row = out->num_positions + out->num_classes;
  out->wave_rows = std::max<int64>(1, std::min(num_rows, budget / per_row));
  out->node_values = gpu::Reserve(&cursor, out->wave_rows * out->num_positions * sizeof(T));
  out->all_values = gpu::Reserve(&cursor, out->wave_rows * out->num_classes * sizeof(T));
  out->workspace_bytes = cursor;
  return "";
}

template <typename T>
std::string TopKGpu(const GpuInferencePlan& plan, const SoftmaxParams<T>& p, T* log_probs,
                    int64* classes, int64* num_expanded, void* workspace, CUstream_st* stream) {
  using namespace gpu;  // NOLINT: the kernels and helpers of this file
  std::string err = CheckCall(plan, GpuInferencePlan::kTopK, sizeof(T), p.dim,
                              p.biases != nullptr, workspace);
  if (!err.empty() || plan.num_rows == 0) return err;
  err = Upload(plan, workspace, stream);
  if (!err.empty()) return err;
  const Args<T> a = MakeArgs(plan, p, workspace);
  T* all = reinterpret_cast<T*>(static_cast<char*>(workspace) + plan.all_values);
  const int64 C = plan.num_classes;
  for (int64 r0 = 0; r0 < plan.num_rows; r0 += plan.wave_rows) {
    const int64 nr = Min64(plan.wave_rows, plan.num_rows - r0);
    TF_HSM_RETURN_IF_CUDA_ERROR(Launch(&LogProbAllKernel<T>, Min64(nr, kMaxBlocks), kThreads,
                                       stream, a, r0, nr, all, C),
                                "LogProbAllKernel (top k)");
    TF_HSM_RETURN_IF_CUDA_ERROR(Launch(&TopKSelectKernel<T>, Min64(nr, kMaxBlocks), kThreads,
                                       stream, static_cast<const T*>(all), C, plan.k,
                                       plan.num_nodes, r0, nr, log_probs, classes, num_expanded),
                                "TopKSelectKernel");
  }
  return "";
}

#define TF_HSM_INSTANTIATE(T)                                                                 \
  template std::string PrepareLogProbAllGpu<T>(const TreeView&, int64, int64, bool, int64,    \
                                               int64, int64, GpuInferencePlan*);              \
  template std::string LogProbAllGpu<T>(const GpuInferencePlan&, const SoftmaxParams<T>&, T*, \
                                        void*, CUstream_st*);                                 \
  template std::string PrepareSampleGpu<T>(const TreeView&, int64, int64, bool,               \
                                           GpuInferencePlan*);                                \
  template std::string SampleGpu<T>(const GpuInferencePlan&, const SoftmaxParams<T>&,         \
                                    std::uint64_t, T, int64*, void*, CUstream_st*);           \
  template std::string PrepareTopKGpu<T>(const TreeView&, int64, int64, bool, int64, int64,   \
                                         GpuInferencePlan*);                                  \
  template std::string TopKGpu<T>(const GpuInferencePlan&, const SoftmaxParams<T>&, T*,       \
                                  int64*, int64*, void*, CUstream_st*);
TF_HSM_INSTANTIATE(float)
TF_HSM_INSTANTIATE(double)
#undef TF_HSM_INSTANTIATE

}  // namespace tf_hsm
