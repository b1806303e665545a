// CUDA kernels of LogProbAll, Sample and TopK; the contract and the design are described in
// inference_gpu.h.
#include "cc/core/inference_gpu.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "cc/core/gpu_common.cuh"
#include "cc/core/gpu_compat.cuh"
#include "cc/core/gpu_tile.cuh"
#include "cc/core/sampling.h"
#include "cc/core/tree_checks.h"

namespace tf_hsm {
namespace gpu {
namespace {

constexpr int kThreads = 256;  // every kernel of this file; a power of two
constexpr int64 kMaxSampleBlocks = kMaxBlocks < 4096 ? kMaxBlocks : 4096;
constexpr int kWarpsPerBlock = kThreads / kWarpSize;
// The logits tiles: 16, 32 or 64 rows (the fewest that hold the wave's) x 64 slots.
using NarrowTile = TileConfig<16, 64, 16, 1, 4>;
using MidTile = TileConfig<32, 64, 16, 2, 4>;
using WideTile = TileConfig<64, 64, 16, 4, 4>;
static_assert(WideTile::kThreads == kThreads && MidTile::kThreads == kThreads &&
                  NarrowTile::kThreads == kThreads,
              "the tiled kernel runs 256 threads");
// TopK's selection: each block takes the top k of a chunk of kSelectChunk values (each
// thread holds kSelectPerThread of them) until one chunk per row is left. Larger k use the
// block-per-row selection. (32 a thread measured 3-5% faster top_k at V = 1M, k = 10 on an
// H100: within run-to-run spread, so not adopted.)
#ifdef TF_HSM_GPU_EMULATE
constexpr int kSelectPerThread = 1;  // so that the emulator's small trees take several steps
#elif defined(TF_HSM_GPU_SELECT_PER_THREAD)
constexpr int kSelectPerThread = TF_HSM_GPU_SELECT_PER_THREAD;
#else
constexpr int kSelectPerThread = 8;
#endif
constexpr int64 kSelectChunk = int64{kThreads} * kSelectPerThread;
constexpr int64 kMaxChunkedK = kSelectChunk / 8 < 256 ? kSelectChunk / 8 : 256;

// Everything the kernels read or write, as device pointers.
template <typename T>
struct Args {
  const T* hidden;
  const T* weights;
  const T* biases;  // may be null
  int64 dim;
  const int64* child_begin;  // [M + 1]
  const int64* slot_child;   // [S]
  int64 num_classes, num_positions, max_branching;
  int64 class_begin, class_end;
  // The needed nodes' slots, numbered in position order ("z slots"): node nodes[q]'s slots
  // are z slots zbegin[q] .. zbegin[q + 1] - 1; zslot[z] is the weight row of z slot z
  // (nullptr: the identity, when every node is needed and positions follow ids).
  int64 num_zslots;
  const int64* zslot;
  const int64* zbegin;  // [num_positions + 1]
  // Built on the device by ChildTablesKernel: for each class in the range its node's
  // position and its z slot; for each needed node its parent's position and its z slot.
  const int64* class_pos;
  const int64* class_zslot;
  const int64* parent_pos;
  const int64* node_zslot;
  T* node_values;  // [wave rows, num_positions]
  T* zvalues;      // [wave rows, num_zslots]: the logits
  T* scratch;      // Sample: [blocks, max_branching]
};

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

// zvalues[i, z] = w_slot . h_(row0 + i) (+ b_slot) for the wave's rows i < nrows and every z
// slot z: a tiled product of the rows with the gathered weight rows. Each value is one fma
// chain over d in order, then the bias, whatever the tile.
template <typename T, class C>
TF_HSM_GLOBAL void SlotLogitsKernel(Args<T> a, int64 row0, int64 nrows) {
  TF_HSM_SHARED TileSmem<T, C> smem;
  TF_HSM_SHARED const T* wrows[C::BN];
  const int tid = ThreadX();
  const int64 dim = a.dim, NS = a.num_zslots;
  const int64 row_tiles = CeilDiv(nrows, C::BM), tiles = row_tiles * CeilDiv(NS, C::BN);
  for (int64 t = BlockX(); t < tiles; t += GridX()) {
    // Consecutive blocks share a slot tile: its weight rows are read once from memory.
    const int64 r0 = t % row_tiles * C::BM, z0 = t / row_tiles * C::BN;
    const int64 nr = Min64(C::BM, nrows - r0), nz = Min64(C::BN, NS - z0);
    SyncThreads();  // the previous tile is done with `wrows`
    for (int c = tid; c < C::BN; c += C::kThreads) {
      if (c < nz) {
        wrows[c] = a.weights + (a.zslot != nullptr ? a.zslot[z0 + c] : z0 + c) * dim;
      } else {
        wrows[c] = nullptr;
      }
    }
    SyncThreads();
    T acc[C::TM][C::TN];
#pragma unroll
    for (int i = 0; i < C::TM; ++i)
#pragma unroll
      for (int j = 0; j < C::TN; ++j) acc[i][j] = T(0);
    TileProduct<T, C>(smem, StridedRows<T>{a.hidden + (row0 + r0) * dim, dim, nr, dim},
                      GatheredRows<T>{wrows, dim}, dim, acc);
#pragma unroll
    for (int i = 0; i < C::TM; ++i) {
      const int r = C::Row(i);
      if (r >= nr) continue;
      T* z = a.zvalues + (r0 + r) * NS + z0;
#pragma unroll
      for (int j = 0; j < C::TN; ++j) {
        const int c = C::Col(j);
        if (c >= nz) continue;
        T v = acc[i][j];
        if (a.biases != nullptr) {
          v += a.biases[a.zslot != nullptr ? a.zslot[z0 + c] : z0 + c];
        }
        z[c] = v;
      }
    }
  }
}

// The tables of a call, from the tree: for each z slot (a thread each), the needed node it
// belongs to (a binary search of zbegin), its weight row (stored in zslot unless that is
// the identity) and its child. A class in the range gets class_pos / class_zslot (its
// node's position, its own z slot); a needed node gets parent_pos / node_zslot likewise.
TF_HSM_GLOBAL void ChildTablesKernel(const int64* child_begin, const int64* slot_child,
                                     const int64* nodes, const int64* zbegin,
                                     const int64* position, int64 num_zslots, int64 num_positions,
                                     int64 num_classes, int64 class_begin, int64 class_end,
                                     int64* zslot, int64* class_pos, int64* class_zslot,
                                     int64* parent_pos, int64* node_zslot) {
  for (int64 z = BlockX() * kThreads + ThreadX(); z < num_zslots; z += GridX() * kThreads) {
    int64 lo = 0, hi = num_positions - 1;  // the last q with zbegin[q] <= z
    while (lo < hi) {
      const int64 mid = (lo + hi + 1) / 2;
      if (zbegin[mid] <= z) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    const int64 slot = child_begin[nodes[lo]] + (z - zbegin[lo]);
    if (zslot != nullptr) zslot[z] = slot;
    const int64 code = slot_child[slot];
    if (code < num_classes) {
      if (code >= class_begin && code < class_end) {
        class_pos[code - class_begin] = lo;
        class_zslot[code - class_begin] = z;
      }
    } else {
      const int64 q = position[code - num_classes];
      if (q >= 0) {
        parent_pos[q] = lo;
        node_zslot[q] = z;
      }
    }
  }
}

// One run of needed nodes of equal depth and branching class (positions [q_begin, q_begin +
// size)), after SlotLogitsKernel: for each (row, node) of the wave a group of `lanes`
// threads (a power of two <= 32, the node's branching rounded up) folds the node's logits into a
// logsumexp (each lane its strided share, then a fixed xor tree whose lane-0 result the
// group uses) and stores the node's "base", log P(node | row) - logsumexp, so that a child
// with logit z has log-probability base + z. The node's own log-probability is its
// parent's base (stored by the level before) plus its logit; the root's is 0.
template <typename T>
TF_HSM_GLOBAL void NormalizeNodesKernel(Args<T> a, int64 q_begin, int64 size, int lanes,
                                        int64 nrows) {
  const int lane = ThreadX() % kWarpSize, sub = lane % lanes;
  const int64 groups_per_warp = kWarpSize / lanes;
  const int64 items = nrows * size;
  const int64 warp_tasks = CeilDiv(items, groups_per_warp);
  const int64 NS = a.num_zslots;
  // Every lane of a warp runs the same iterations: the shuffles need the whole warp.
  for (int64 w = BlockX() * kWarpsPerBlock + ThreadX() / kWarpSize; w < warp_tasks;
       w += GridX() * kWarpsPerBlock) {
    // Row-major items: consecutive groups take consecutive nodes of a row.
    const int64 item = w * groups_per_warp + lane / lanes;
    const bool valid = item < items;
    int64 i = 0, q = 0, K = 0;
    const T* z = nullptr;
    if (valid) {
      i = item / size;
      q = q_begin + item % size;
      K = a.zbegin[q + 1] - a.zbegin[q];
      z = a.zvalues + i * NS + a.zbegin[q];
    }
    T m = NegInf<T>(), s = T(0);
    for (int64 j = sub; j < K; j += lanes) Fold(z[j], &m, &s);
    for (int h = 1; h < lanes; h *= 2) {
      const T m2 = ShflXor(m, h), s2 = ShflXor(s, h);
      Combine(&m, &s, m2, s2);
    }
    if (!valid || sub != 0) continue;
    T* vals = a.node_values + i * a.num_positions;
    const T own = q == 0 ? T(0) : vals[a.parent_pos[q]] + a.zvalues[i * NS + a.node_zslot[q]];
    vals[q] = own - (m + Log(s));
  }
}

// out[i * out_ld + c - class_begin] = base of c's node + c's logit, for the wave's rows and
// the classes in the range (a thread each, consecutive threads on consecutive classes).
template <typename T>
TF_HSM_GLOBAL void ClassValuesKernel(Args<T> a, int64 nrows, T* out, int64 out_ld) {
  const int64 width = a.class_end - a.class_begin, total = nrows * width;
  for (int64 e = BlockX() * kThreads + ThreadX(); e < total; e += GridX() * kThreads) {
    const int64 i = e / width, c = e % width;
    out[i * out_ld + c] = a.node_values[i * a.num_positions + a.class_pos[c]] +
                          a.zvalues[i * a.num_zslots + a.class_zslot[c]];
  }
}

// sampling::PickSlot (the CPU core's draw) with CUDA's exp.
struct ExpEach {
  template <typename T>
  TF_HSM_HOST_DEVICE void operator()(T* z, int64 K) const {
    for (int64 j = 0; j < K; ++j) z[j] = Exp(z[j]);
  }
};

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
        const int64 j = sampling::PickSlot(z, K, temperature, sampling::Uniform(seed, row, depth),
                                            ExpEach());
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

// Before(), with candidates of id < 0 (a chunk's empty places) after everything.
template <typename T>
TF_HSM_DEVICE bool BetterCandidate(T a, int64 ia, T b, int64 ib) {
  if (ib < 0) return ia >= 0;
  return ia >= 0 && Before(a, ia, b, ib);
}

// One step of TopK's selection. Row i's candidates are in_values[i * in_ld + e] with ids
// in_ids[i * in_ld + e] (in_ids null: the id is e) for e < n; a block per (row, chunk of
// kSelectChunk candidates) writes the chunk's best kk in output order to
// out_values[i * out_ld + chunk * kk + j] (id -1 where the chunk has fewer). Each of the kk
// rounds takes the best candidate strictly after the previous round's: every thread over
// the candidates it holds, then a fixed tree over lanes and over warps. With one chunk per
// row this is the final step: out_* are the outputs and num_expanded (if not null) is set.
template <typename T>
TF_HSM_GLOBAL void TopKChunkKernel(const T* in_values, const int64* in_ids, int64 n, int64 in_ld,
                                   int64 nrows, int64 kk, T* out_values, int64* out_ids,
                                   int64 out_ld, int64* num_expanded, int64 num_nodes) {
  TF_HSM_SHARED T wv[kWarpsPerBlock];
  TF_HSM_SHARED int64 wi[kWarpsPerBlock];
  const int tid = ThreadX(), lane = tid % kWarpSize, warp = tid / kWarpSize;
  const int64 chunks = CeilDiv(n, kSelectChunk);
  for (int64 b = BlockX(); b < nrows * chunks; b += GridX()) {
    const int64 i = b / chunks, chunk = b % chunks;
    T v[kSelectPerThread];
    int64 id[kSelectPerThread];
#pragma unroll
    for (int l = 0; l < kSelectPerThread; ++l) {
      const int64 e = chunk * kSelectChunk + int64{l} * kThreads + tid;
      v[l] = T(0);
      id[l] = -1;
      if (e < n) {
        v[l] = in_values[i * in_ld + e];
        id[l] = in_ids != nullptr ? in_ids[i * in_ld + e] : e;
      }
    }
    T prev = T(0);
    int64 prev_id = -1;
    for (int64 j = 0; j < kk; ++j) {
      T best = T(0);
      int64 best_id = -1;
#pragma unroll
      for (int l = 0; l < kSelectPerThread; ++l) {
        if (id[l] < 0 || (prev_id >= 0 && !Before(prev, prev_id, v[l], id[l]))) continue;
        if (BetterCandidate(v[l], id[l], best, best_id)) {
          best = v[l];
          best_id = id[l];
        }
      }
      for (int h = 1; h < kWarpSize; h *= 2) {
        const T ov = ShflXor(best, h);
        const int64 oi = ShflXor(best_id, h);
        if (BetterCandidate(ov, oi, best, best_id)) {
          best = ov;
          best_id = oi;
        }
      }
      if (lane == 0) {
        wv[warp] = best;
        wi[warp] = best_id;
      }
      SyncThreads();
      best = wv[0];
      best_id = wi[0];
      for (int w = 1; w < kWarpsPerBlock; ++w) {
        if (BetterCandidate(wv[w], wi[w], best, best_id)) {
          best = wv[w];
          best_id = wi[w];
        }
      }
      SyncThreads();  // everyone has read the warps' bests before the next round writes
      if (best_id < 0) {  // the chunk is exhausted (the same for every thread)
        if (tid == 0) {
          for (int64 j2 = j; j2 < kk; ++j2) out_ids[i * out_ld + chunk * kk + j2] = -1;
        }
        break;
      }
      if (tid == 0) {
        out_values[i * out_ld + chunk * kk + j] = best;
        out_ids[i * out_ld + chunk * kk + j] = best_id;
      }
      prev = best;
      prev_id = best_id;
    }
    if (tid == 0 && num_expanded != nullptr) num_expanded[i] = num_nodes;
  }
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
        if (BetterCandidate(x, c, best, best_id)) {
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
          if (BetterCandidate(ov, oi, sv[tid], si[tid])) {
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

// Checks the whole tree (every node's non-empty slot range, every child code, each class
// and each non-root node the child of exactly one node, child nodes numbered after their
// parent) and returns each node's parent (-1 for the root) and each class's node.
std::string CheckTree(const TreeView& t, std::vector<int64>* parent, std::vector<int64>* owner) {
  const int64 C = t.num_classes, M = t.num_nodes;
  std::string err = tree_checks::CheckNotEmpty(t);
  if (!err.empty()) return err;
  if (t.slot_child == nullptr) return "slot_child is required";
  parent->assign(M, -1);
  owner->assign(C, -1);
  for (int64 n = 0; n < M; ++n) {
    const int64 begin = t.child_begin[n], end = t.child_begin[n + 1];
    if (!tree_checks::ValidSlotRange(t, begin, end)) return tree_checks::BadSlotRange(t, n);
    for (int64 s = begin; s < end; ++s) {
      const int64 code = t.slot_child[s];
      err = tree_checks::BadChildCode(t, n, s, code);
      if (!err.empty()) return err;
      int64& slot_of = code < C ? (*owner)[code] : (*parent)[code - C];
      if (slot_of >= 0) return tree_checks::ReachedTwice(t, code);
      slot_of = n;
    }
  }
  for (int64 c = 0; c < C; ++c) {
    if ((*owner)[c] < 0) return tree_checks::NotReached(t, c);
  }
  for (int64 m = 1; m < M; ++m) {
    if ((*parent)[m] < 0) return tree_checks::NotReached(t, C + m);
  }
  return "";
}

// The tables ChildTablesKernel builds.
void ReserveChildTables(GpuInferencePlan* gp, int64* cursor) {
  const int64 width = std::max<int64>(gp->class_end - gp->class_begin, 1);
  const int64 P = std::max<int64>(gp->num_positions, 1);
  gp->class_pos = Reserve(cursor, width * sizeof(int64));
  gp->class_zslot = Reserve(cursor, width * sizeof(int64));
  gp->parent_pos = Reserve(cursor, P * sizeof(int64));
  gp->node_zslot = Reserve(cursor, P * sizeof(int64));
}

// Fills everything but the value buffers: the tree upload, the needed nodes and their levels.
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
  // The needed nodes' positions: ordered by depth (parents before children), then by the
  // threads a node's normalisation takes (a function of its branching alone, so a node's
  // values do not depend on which other nodes are needed), then by id. Each run of equal
  // (depth, lanes) is one launch of NormalizeNodesKernel. Counting sort: O(M) per call.
  std::vector<int64> depth(M, 0);
  for (int64 n = 1; n < M; ++n) depth[n] = depth[parent[n]] + 1;
  auto lanes_class = [&tree](int64 n) {
    const int64 K = tree.child_begin[n + 1] - tree.child_begin[n];
    int c = 0;
    while ((int64{1} << c) < K && (1 << c) < kWarpSize) ++c;
    return c;  // lanes = 2^c
  };
  constexpr int kLaneClasses = 6;  // 1, 2, ..., 32 lanes
  const int64 max_depth = M > 0 ? *std::max_element(depth.begin(), depth.end()) : 0;
  std::vector<int64> bucket_count((max_depth + 1) * kLaneClasses + 1, 0);
  int64 P = 0;
  for (int64 n = 0; n < M; ++n) {
    if (need[n]) {
      ++bucket_count[depth[n] * kLaneClasses + lanes_class(n) + 1];
      ++P;
    }
  }
  std::vector<int64> bucket_begin(bucket_count.size(), 0);
  for (size_t b = 1; b < bucket_count.size(); ++b) {
    bucket_begin[b] = bucket_begin[b - 1] + bucket_count[b];
    if (bucket_count[b] > 0) {
      gp.segment_begin.push_back(bucket_begin[b - 1]);
      gp.segment_lanes.push_back(1 << ((b - 1) % kLaneClasses));
    }
  }
  gp.segment_begin.push_back(P);
  std::vector<int64> nodes(P), position(M, -1);
  for (int64 n = 0; n < M; ++n) {
    if (need[n]) {
      const int64 q = bucket_begin[depth[n] * kLaneClasses + lanes_class(n)]++;
      nodes[q] = n;
      position[n] = q;
    }
  }
  gp.num_positions = P;
  // Their slots in position order are the z slots.
  std::vector<int64> zbegin(P + 1);
  for (int64 q = 0; q < P; ++q) {
    zbegin[q] = gp.num_zslots;
    gp.num_zslots += tree.child_begin[nodes[q] + 1] - tree.child_begin[nodes[q]];
  }
  zbegin[P] = gp.num_zslots;
  gp.zslot_identity =
      gp.num_zslots == S && std::is_sorted(nodes.begin(), nodes.end());

  const int64 w = sizeof(int64);
  gp.child_begin = Reserve(cursor, (M + 1) * w);
  gp.slot_child = Reserve(cursor, S * w);
  gp.nodes = Reserve(cursor, std::max<int64>(P, 1) * w);
  gp.position = Reserve(cursor, M * w);
  gp.zbegin = Reserve(cursor, (P + 1) * w);
  gp.staging.assign(*cursor / w, 0);
  int64* words = gp.staging.data();
  std::copy(tree.child_begin, tree.child_begin + M + 1, words + gp.child_begin / w);
  std::copy(tree.slot_child, tree.slot_child + S, words + gp.slot_child / w);
  std::copy(nodes.begin(), nodes.end(), words + gp.nodes / w);
  std::copy(position.begin(), position.end(), words + gp.position / w);
  std::copy(zbegin.begin(), zbegin.end(), words + gp.zbegin / w);
  // Built on the device (ChildTablesKernel), after the upload.
  gp.zslot = Reserve(cursor, (gp.zslot_identity ? 1 : gp.num_zslots) * w);
  return "";
}

std::string CheckCall(const GpuInferencePlan& plan, GpuInferencePlan::Mode mode,
                      int64 value_bytes, int64 dim, bool has_bias, const void* workspace) {
  static const char* kNeeds[] = {"LogProbAllGpu needs a plan from PrepareLogProbAllGpu",
                                 "SampleGpu needs a plan from PrepareSampleGpu",
                                 "TopKGpu needs a plan from PrepareTopKGpu"};
  return CheckPlanCall(plan, mode, kNeeds[static_cast<int>(mode)], value_bytes, dim, has_bias,
                       workspace, true);
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
  a.num_classes = plan.num_classes;
  a.num_positions = plan.num_positions;
  a.max_branching = plan.max_branching;
  a.class_begin = plan.class_begin;
  a.class_end = plan.class_end;
  a.num_zslots = plan.num_zslots;
  a.zslot = plan.zslot_identity ? nullptr : reinterpret_cast<const int64*>(base + plan.zslot);
  a.zbegin = reinterpret_cast<const int64*>(base + plan.zbegin);
  a.class_pos = reinterpret_cast<const int64*>(base + plan.class_pos);
  a.class_zslot = reinterpret_cast<const int64*>(base + plan.class_zslot);
  a.parent_pos = reinterpret_cast<const int64*>(base + plan.parent_pos);
  a.node_zslot = reinterpret_cast<const int64*>(base + plan.node_zslot);
  a.node_values = reinterpret_cast<T*>(base + plan.node_values);
  a.zvalues = reinterpret_cast<T*>(base + plan.zvalues);
  a.scratch = reinterpret_cast<T*>(base + plan.scratch);
  return a;
}

// The workspace's class and node tables (ChildTablesKernel), once per call.
std::string BuildChildTables(const GpuInferencePlan& plan, void* workspace, cudaStream_t stream) {
  char* base = static_cast<char*>(workspace);
  auto at = [base](int64 offset) { return reinterpret_cast<int64*>(base + offset); };
  TF_HSM_RETURN_IF_CUDA_ERROR(
      Launch(&ChildTablesKernel, Blocks(plan.num_zslots, kThreads), kThreads, stream,
             static_cast<const int64*>(at(plan.child_begin)),
             static_cast<const int64*>(at(plan.slot_child)),
             static_cast<const int64*>(at(plan.nodes)), static_cast<const int64*>(at(plan.zbegin)),
             static_cast<const int64*>(at(plan.position)), plan.num_zslots, plan.num_positions,
             plan.num_classes, plan.class_begin, plan.class_end,
             plan.zslot_identity ? static_cast<int64*>(nullptr) : at(plan.zslot),
             at(plan.class_pos), at(plan.class_zslot), at(plan.parent_pos), at(plan.node_zslot)),
      "ChildTablesKernel");
  return "";
}

template <typename T, class C>
std::string LaunchSlotLogits(const GpuInferencePlan& plan, const Args<T>& a, int64 r0, int64 nr,
                             cudaStream_t stream) {
  const int64 tiles = CeilDiv(nr, C::BM) * CeilDiv(plan.num_zslots, C::BN);
  TF_HSM_RETURN_IF_CUDA_ERROR(
      Launch(&SlotLogitsKernel<T, C>, Blocks(tiles, 1), kThreads, stream, a, r0, nr),
      "SlotLogitsKernel");
  return "";
}

// Rows per wave: at most `fit` (at least 1), balanced over the waves, from a multiple of
// the narrow tile's rows where more than one tile fits, so that the logits tiles are full.
int64 WaveRows(int64 num_rows, int64 fit) {
  if (num_rows <= 0) return 1;
  fit = std::max<int64>(1, std::min(num_rows, fit));
  if (fit > NarrowTile::BM) fit = fit / NarrowTile::BM * NarrowTile::BM;
  return CeilDiv(num_rows, CeilDiv(num_rows, fit));
}

// Log-probabilities of rows [r0, r0 + nr) (wave-local rows of node_values and zvalues):
// the logits of every needed slot, the nodes' bases level by level, then the classes.
template <typename T>
std::string RunLogProbAllWave(const GpuInferencePlan& plan, const Args<T>& a, int64 r0, int64 nr,
                              T* out, int64 out_ld, cudaStream_t stream) {
  std::string err;
  if (nr <= NarrowTile::BM) {
    err = LaunchSlotLogits<T, NarrowTile>(plan, a, r0, nr, stream);
  } else if (nr <= MidTile::BM) {
    err = LaunchSlotLogits<T, MidTile>(plan, a, r0, nr, stream);
  } else {
    err = LaunchSlotLogits<T, WideTile>(plan, a, r0, nr, stream);
  }
  if (!err.empty()) return err;
  for (size_t r = 0; r + 1 < plan.segment_begin.size(); ++r) {
    const int64 size = plan.segment_begin[r + 1] - plan.segment_begin[r];
    const int lanes = plan.segment_lanes[r];
    const int64 warps = CeilDiv(size * nr, kWarpSize / lanes);
    TF_HSM_RETURN_IF_CUDA_ERROR(
        Launch(&NormalizeNodesKernel<T>, Blocks(warps, kWarpsPerBlock), kThreads, stream, a,
               plan.segment_begin[r], size, lanes, nr),
        "NormalizeNodesKernel");
  }
  const int64 width = plan.class_end - plan.class_begin;
  TF_HSM_RETURN_IF_CUDA_ERROR(
      Launch(&ClassValuesKernel<T>, Blocks(nr * width, kThreads), kThreads, stream, a, nr,
             out, out_ld),
      "ClassValuesKernel");
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
  const int64 per_row = std::max<int64>(out->num_positions + out->num_zslots, 1);
  out->wave_rows = gpu::WaveRows(num_rows, budget / per_row);
  gpu::ReserveChildTables(out, &cursor);
  out->node_values = gpu::Reserve(&cursor, out->wave_rows * out->num_positions * sizeof(T));
  out->zvalues = gpu::Reserve(&cursor, out->wave_rows * out->num_zslots * sizeof(T));
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
  err = UploadStaging(plan.staging, workspace, stream, "uploading the tree");
  if (err.empty()) err = BuildChildTables(plan, workspace, stream);
  if (!err.empty()) return err;
  const Args<T> a = MakeArgs(plan, p, workspace);
  for (int64 r0 = 0; r0 < plan.num_rows && err.empty(); r0 += plan.wave_rows) {
    const int64 nr = Min64(plan.wave_rows, plan.num_rows - r0);
    err = RunLogProbAllWave<T>(plan, a, r0, nr, out + r0 * width, width, stream);
  }
  return err;
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
  err = UploadStaging(plan.staging, workspace, stream, "uploading the tree");
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
    return Message("k = ", k, " must be in [1, num_classes] = [1, ", tree.num_classes, "]");
  }
  out->k = k;
  const int64 C = out->num_classes;
  // The first selection step's candidates (k per chunk of classes, a value and an id each),
  // when there is more than one chunk and k is small enough for the chunked selection.
  const int64 chunks = gpu::CeilDiv(C, gpu::kSelectChunk);
  const int64 candidates_per_row = chunks > 1 && k <= gpu::kMaxChunkedK ? chunks * k : 0;
  const int64 candidate_elements =
      candidates_per_row * (1 + static_cast<int64>(sizeof(int64) / sizeof(T)));
  const int64 per_row = out->num_positions + out->num_zslots + C + 2 * candidate_elements;
  out->wave_rows = gpu::WaveRows(num_rows, budget / per_row);
  const int64 rows = out->wave_rows;
  gpu::ReserveChildTables(out, &cursor);
  out->node_values = gpu::Reserve(&cursor, rows * out->num_positions * sizeof(T));
  out->zvalues = gpu::Reserve(&cursor, rows * out->num_zslots * sizeof(T));
  out->all_values = gpu::Reserve(&cursor, rows * C * sizeof(T));
  for (int b = 0; b < 2; ++b) {
    out->candidate_values[b] = gpu::Reserve(&cursor, rows * candidates_per_row * sizeof(T));
    out->candidate_ids[b] = gpu::Reserve(&cursor, rows * candidates_per_row * sizeof(int64));
  }
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
  err = UploadStaging(plan.staging, workspace, stream, "uploading the tree");
  if (err.empty()) err = BuildChildTables(plan, workspace, stream);
  if (!err.empty()) return err;
  const Args<T> a = MakeArgs(plan, p, workspace);
  T* all = reinterpret_cast<T*>(static_cast<char*>(workspace) + plan.all_values);
  char* base = static_cast<char*>(workspace);
  const int64 C = plan.num_classes, k = plan.k;
  for (int64 r0 = 0; r0 < plan.num_rows; r0 += plan.wave_rows) {
    const int64 nr = Min64(plan.wave_rows, plan.num_rows - r0);
    err = RunLogProbAllWave<T>(plan, a, r0, nr, all, C, stream);
    if (!err.empty()) return err;
    if (k > kMaxChunkedK) {
      TF_HSM_RETURN_IF_CUDA_ERROR(Launch(&TopKSelectKernel<T>, Blocks(nr, 1), kThreads,
                                         stream, static_cast<const T*>(all), C, k,
                                         plan.num_nodes, r0, nr, log_probs, classes,
                                         num_expanded),
                                  "TopKSelectKernel");
      continue;
    }
    // Chunked selection: each step keeps k candidates per chunk until one chunk is left.
    const T* in_values = all;
    const int64* in_ids = nullptr;
    int64 n = C;
    for (int step = 0;; ++step) {
      const int64 chunks = CeilDiv(n, kSelectChunk);
      if (chunks == 1) {
        TF_HSM_RETURN_IF_CUDA_ERROR(
            Launch(&TopKChunkKernel<T>, Blocks(nr, 1), kThreads, stream, in_values,
                   in_ids, n, n, nr, k, log_probs + r0 * k,
                   classes + r0 * k, k, num_expanded + r0, plan.num_nodes),
            "TopKChunkKernel");
        break;
      }
      T* out_values = reinterpret_cast<T*>(base + plan.candidate_values[step % 2]);
      int64* out_ids = reinterpret_cast<int64*>(base + plan.candidate_ids[step % 2]);
      TF_HSM_RETURN_IF_CUDA_ERROR(
          Launch(&TopKChunkKernel<T>, Blocks(nr * chunks, 1), kThreads, stream,
                 in_values, in_ids, n, n, nr, k, out_values, out_ids,
                 chunks * k, static_cast<int64*>(nullptr), plan.num_nodes),
          "TopKChunkKernel");
      in_values = out_values;
      in_ids = out_ids;
      n = chunks * k;
    }
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
