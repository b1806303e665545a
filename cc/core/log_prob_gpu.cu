// CUDA kernels of the hierarchical-softmax log-probability and its gradient; the contract
// and the design are described in log_prob_gpu.h.
#include "cc/core/log_prob_gpu.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "cc/core/gpu_common.cuh"
#include "cc/core/gpu_compat.cuh"
#include "cc/core/gpu_tile.cuh"

namespace tf_hsm {
namespace gpu {
namespace {

// Nodes with at most this many children take a warp per visit, not a GEMM tile.
constexpr int64 kSmallSlots = 32;
// Slots per logits work item; wider nodes are split into chunks whose partial logsumexps
// are combined in a fixed order, so any branching factor fits and big nodes are spread
// over many blocks.
// 128 rather than 256: a 317-child node is then three near-even items, not a full one and
// a quarter, and a wide group is spread over twice the blocks. (Compile-time knob for
// comparing settings in the GPU harness.)
#ifndef TF_HSM_GPU_CHUNK_SLOTS
#define TF_HSM_GPU_CHUNK_SLOTS 128
#endif
constexpr int64 kChunkSlots = TF_HSM_GPU_CHUNK_SLOTS;
// Groups with at most this many tokens use 16-token tiles, the others 64-token tiles.
constexpr int64 kNarrowTokens = 16;
// Weight gradients of small nodes' slices of at most this many tokens: a warp per slice.
constexpr int64 kWarpGradTokens = 16;
constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / kWarpSize;
// Blocks per SM the tiled kernels are compiled for. In float32, tiles of at most 16 x 64
// outputs get four (at most 64 registers a thread): they stream weight rows for few tokens,
// and only more blocks keep enough loads in flight; 64 x 64 tiles get two (128 registers).
// One in float64.
#ifndef TF_HSM_GPU_SMALL_TILE_BLOCKS
#define TF_HSM_GPU_SMALL_TILE_BLOCKS 4
#endif
template <typename T, class C>
constexpr int TileMinBlocks() {
  return sizeof(T) == 4 ? (C::BM * C::BN <= 16 * 64 ? TF_HSM_GPU_SMALL_TILE_BLOCKS : 2) : 1;
}
#define TF_HSM_TILE_BOUNDS TF_HSM_LAUNCH_BOUNDS(kThreads, (TileMinBlocks<T, C>()))

using WideTile = TileConfig<64, 64, 16, 4, 4>;
using NarrowTile = TileConfig<16, 64, 16, 1, 4>;
using DwTile64 = TileConfig<64, 64, 16, 4, 4>;
using DwTile16 = TileConfig<16, 64, 16, 1, 4>;
using DwTile4 = TileConfig<4, 128, 16, 1, 2>;
static_assert(WideTile::kThreads == kThreads && NarrowTile::kThreads == kThreads &&
                  DwTile64::kThreads == kThreads && DwTile16::kThreads == kThreads &&
                  DwTile4::kThreads == kThreads,
              "every tiled kernel runs 256 threads");
static_assert(WideTile::BN == NarrowTile::BN && kChunkSlots % WideTile::BN == 0,
              "both logits tiles fold the same slot tiles, so their results agree");

// Kernels work on "visits": (group, hidden row) pairs whose logsumexp they compute. For
// log_prob and its gradient a visit is a plan entry (a token at a node); for candidates it
// is one distinct hidden row among a group's entries.
//
// A slice is a run of consecutive visits of one group processed together: the whole group,
// or (when the backward pass's coefficient buffer is too small for it) a range of it.
struct Slice {
  int64 visit0;       // first visit
  int64 count;        // visits
  int64 first_slot;   // the node's first child slot
  int64 num_slots;    // the node's children
  int64 coef;         // the slice's [count, num_slots] coefficient block in the buffer
  int64 row0;         // the group's first weight-gradient row (plan.group_row)
  int64 partial0;     // the partial logsumexps of visit0; num_chunks per visit
  int64 num_chunks;
  int64 offset;       // visit0 - the group's first visit (0: the slice starts a group)
};
constexpr int64 kSliceWords = sizeof(Slice) / sizeof(int64);
static_assert(sizeof(Slice) == 9 * sizeof(int64), "Slice is uploaded as int64 words");

// One tile of a tiled kernel: rows from m0, columns (or the slot chunk) n0.
struct Item {
  int64 slice, m0, n0;
};
constexpr int64 kItemWords = sizeof(Item) / sizeof(int64);
static_assert(sizeof(Item) == 3 * sizeof(int64), "Item is uploaded as int64 words");

// Everything the kernels read or write, as device pointers.
template <typename T>
struct Args {
  const T* hidden;
  const T* weights;
  const T* biases;  // may be null
  int64 dim;
  const Slice* slices;
  const Item* items;
  const int64* visit_row;    // the hidden row of each visit
  const int64* visit_slot;   // a slot the visit takes (its taken logit is kept)
  const int64* visit_slice;
  const int64* token_begin;    // forward: [num_tokens + 1]
  const int64* token_entries;  // forward: each token's plan entries, root first
  const int64* cand_visit;     // candidates: the visit of each plan entry
  const int64* cand_slot;      // candidates: the slot each plan entry takes
  int64 num_candidates;        // candidates: per hidden row (token = row * M + m)
  const int64* group_row;      // backward: plan.group_row
  const int64* group_first;    // backward: each group's first slot
  int64 num_groups;
  T* partial_max;
  T* partial_sum;
  T* taken;  // the taken logit of each visit
  T* lse;    // backward: the logsumexp of each visit
  T* coef;   // backward: logits, then coefficients, of the current wave
  const T* upstream;
  T* log_prob;
  T* d_hidden;
  T* weight_rows;
  T* bias_rows;  // may be null
  int64* row_ids;
};

// ---- Logits and partial logsumexps -------------------------------------------------------

// One item: tokens [m0, m0 + BM) of a slice against slot chunk n0 of its node. The chunk
// is folded 64 slots at a time into a running (max, sum of exp) per token, written as the
// partial of (visit, chunk). With kStore the logits are also kept in the coefficient
// buffer. The taken slot's logit is written by the one thread that computes it.
template <typename T, class C, bool kStore>
TF_HSM_GLOBAL void TF_HSM_TILE_BOUNDS LogitsTiledKernel(Args<T> a, int64 item_begin, int64 num_items) {
  static_assert(C::kThreadsN <= kWarpSize && (C::kThreadsN & (C::kThreadsN - 1)) == 0,
                "a tile row must be a power-of-two group of lanes");
  TF_HSM_SHARED TileSmem<T, C> smem;
  TF_HSM_SHARED const T* rows[C::BM];
  const int tid = ThreadX();
  const int tn = tid % C::kThreadsN;
  const int64 dim = a.dim;
  for (int64 it = BlockX(); it < num_items; it += GridX()) {
    const Item item = a.items[item_begin + it];
    const Slice sl = a.slices[item.slice];
    const int64 t0 = item.m0, chunk = item.n0;
    const int64 nt = Min64(C::BM, sl.count - t0);
    const int64 n_begin = chunk * kChunkSlots;
    const int64 n_end = Min64(sl.num_slots, n_begin + kChunkSlots);
    SyncThreads();  // the previous item is done with `rows`
    for (int r = tid; r < C::BM; r += C::kThreads) {
      rows[r] = r < nt ? a.hidden + a.visit_row[sl.visit0 + t0 + r] * dim : nullptr;
    }
    SyncThreads();

    T run_max[C::TM], run_sum[C::TM];
    int64 taken_slot[C::TM];
#pragma unroll
    for (int i = 0; i < C::TM; ++i) {
      const int r = C::Row(i);
      run_max[i] = NegInf<T>();
      run_sum[i] = T(0);
      taken_slot[i] = r < nt ? a.visit_slot[sl.visit0 + t0 + r] - sl.first_slot : -1;
    }
    for (int64 n0 = n_begin; n0 < n_end; n0 += C::BN) {
      T acc[C::TM][C::TN];
#pragma unroll
      for (int i = 0; i < C::TM; ++i)
#pragma unroll
        for (int j = 0; j < C::TN; ++j) acc[i][j] = T(0);
      const int64 nb = n_end - n0;
      TileProduct<T, C>(smem, GatheredRows<T>{rows, dim},
                        StridedRows<T>{a.weights + (sl.first_slot + n0) * dim, dim, nb, dim},
                        dim, acc);
#pragma unroll
      for (int i = 0; i < C::TM; ++i) {
        const int r = C::Row(i);
        T tile_max = NegInf<T>();
#pragma unroll
        for (int j = 0; j < C::TN; ++j) {
          const int c = C::Col(j);
          if (c < nb) {
            if (a.biases != nullptr) acc[i][j] += a.biases[sl.first_slot + n0 + c];
            tile_max = MaxIgnoringNan(tile_max, acc[i][j]);
          }
        }
        tile_max = GroupMax<C::kThreadsN>(tile_max);
        const T new_max = MaxIgnoringNan(run_max[i], tile_max);
        T tile_sum = T(0);
#pragma unroll
        for (int j = 0; j < C::TN; ++j) {
          if (C::Col(j) < nb) tile_sum += Exp(acc[i][j] - new_max);
        }
        tile_sum = GroupSum<C::kThreadsN>(tile_sum);
        run_sum[i] = run_sum[i] * Exp(run_max[i] - new_max) + tile_sum;
        run_max[i] = new_max;
        if (r < nt) {
#pragma unroll
          for (int j = 0; j < C::TN; ++j) {
            const int c = C::Col(j);
            if (c >= nb) continue;
            if (kStore) a.coef[sl.coef + (t0 + r) * sl.num_slots + n0 + c] = acc[i][j];
            if (n0 + c == taken_slot[i]) a.taken[sl.visit0 + t0 + r] = acc[i][j];
          }
        }
      }
    }
    if (tn == 0) {
#pragma unroll
      for (int i = 0; i < C::TM; ++i) {
        const int r = C::Row(i);
        if (r >= nt) continue;
        const int64 p = sl.partial0 + (t0 + r) * sl.num_chunks + chunk;
        a.partial_max[p] = run_max[i];
        a.partial_sum[p] = run_sum[i];
      }
    }
  }
}

// z = w . h (+ b) for a small node's child, as LogitsSmallKernel computes it: lane l sums
// d = l, l + 32, ... in order, then an xor butterfly; every lane returns the same bits.
template <typename T>
TF_HSM_DEVICE T WarpDot(const T* h, const T* w, int64 dim, const T* bias, int lane) {
  T s = T(0);
  for (int64 d = lane; d < dim; d += kWarpSize) s = Fma(h[d], w[d], s);
  s = GroupSum<kWarpSize>(s);
  if (bias != nullptr) s += *bias;
  return s;
}

// Visits of nodes with at most kSmallSlots children, a warp per visit: lanes split D for
// each child's dot product, lane j keeps logit j, and the logsumexp is one partial.
template <typename T, bool kStore>
TF_HSM_GLOBAL void LogitsSmallKernel(Args<T> a, int64 e_begin, int64 e_end) {
  const int lane = ThreadX() % kWarpSize;
  const int64 warps = GridX() * (BlockDimX() / kWarpSize);
  const int64 dim = a.dim;
  for (int64 e = e_begin + BlockX() * (BlockDimX() / kWarpSize) + ThreadX() / kWarpSize;
       e < e_end; e += warps) {
    const Slice sl = a.slices[a.visit_slice[e]];
    if (sl.num_slots > kSmallSlots) continue;
    const int64 r = e - sl.visit0;
    const T* h = a.hidden + a.visit_row[e] * dim;
    T mine = NegInf<T>();
    for (int64 j = 0; j < sl.num_slots; ++j) {
      const int64 slot = sl.first_slot + j;
      const T s = WarpDot(h, a.weights + slot * dim, dim,
                          a.biases != nullptr ? a.biases + slot : nullptr, lane);
      if (lane == j) mine = s;
    }
    const bool valid = lane < sl.num_slots;
    const T m = GroupMax<kWarpSize>(valid && !(mine != mine) ? mine : NegInf<T>());
    const T sum = GroupSum<kWarpSize>(valid ? Exp(mine - m) : T(0));
    if (lane == 0) {
      a.partial_max[sl.partial0 + r] = m;
      a.partial_sum[sl.partial0 + r] = sum;
    }
    if (lane == a.visit_slot[e] - sl.first_slot) a.taken[e] = mine;
    if (kStore && valid) a.coef[sl.coef + r * sl.num_slots + lane] = mine;
  }
}

// The logsumexp of visit v from its partials, combined in chunk order.
template <typename T>
TF_HSM_DEVICE T VisitLogSumExp(const Args<T>& a, int64 v) {
  const Slice& sl = a.slices[a.visit_slice[v]];
  const int64 base = sl.partial0 + (v - sl.visit0) * sl.num_chunks;
  T m = NegInf<T>(), s = T(0);
  for (int64 c = 0; c < sl.num_chunks; ++c) {
    const T cm = a.partial_max[base + c], cs = a.partial_sum[base + c];
    if (cm > m) {
      s = s * Exp(m - cm) + cs;
      m = cm;
    } else {
      s = s + cs * Exp(cm - m);
    }
  }
  return m + Log(s);
}

// log_prob[i] = sum over token i's entries, root first, of taken - logsumexp.
template <typename T>
TF_HSM_GLOBAL void FinishForwardKernel(Args<T> a, int64 num_tokens) {
  for (int64 i = BlockX() * BlockDimX() + ThreadX(); i < num_tokens;
       i += GridX() * BlockDimX()) {
    T sum = T(0);
    for (int64 k = a.token_begin[i]; k < a.token_begin[i + 1]; ++k) {
      const int64 e = a.token_entries[k];
      sum += a.taken[e] - VisitLogSumExp(a, e);
    }
    a.log_prob[i] = sum;
  }
}

// Candidates: out[t] for candidate token t = row * M + m, a warp per token: over its entries
// root first, the taken logit (recomputed exactly as the kernel that folded the visit's
// logsumexp computed it) minus the visit's logsumexp.
template <typename T>
TF_HSM_GLOBAL void FinishCandidatesKernel(Args<T> a, int64 num_tokens) {
  const int lane = ThreadX() % kWarpSize;
  const int64 warps = GridX() * (BlockDimX() / kWarpSize);
  const int64 dim = a.dim;
  for (int64 t = BlockX() * (BlockDimX() / kWarpSize) + ThreadX() / kWarpSize; t < num_tokens;
       t += warps) {
    const T* h = a.hidden + (t / a.num_candidates) * dim;
    T sum = T(0);
    for (int64 k = a.token_begin[t]; k < a.token_begin[t + 1]; ++k) {
      const int64 e = a.token_entries[k];
      const int64 v = a.cand_visit[e], slot = a.cand_slot[e];
      const Slice& sl = a.slices[a.visit_slice[v]];
      const T* w = a.weights + slot * dim;
      const T* b = a.biases != nullptr ? a.biases + slot : nullptr;
      // Every lane runs the chain (the loads are broadcasts) so that all stay converged.
      const T z = sl.num_slots <= kSmallSlots ? WarpDot(h, w, dim, b, lane) : ChainDot(h, w, dim, b);
      sum += z - VisitLogSumExp(a, v);
    }
    if (lane == 0) a.log_prob[t] = sum;
  }
}

// ---- Backward ------------------------------------------------------------------------

template <typename T>
TF_HSM_GLOBAL void LogSumExpKernel(Args<T> a, int64 e_begin, int64 e_end) {
  for (int64 e = e_begin + BlockX() * BlockDimX() + ThreadX(); e < e_end;
       e += GridX() * BlockDimX()) {
    a.lse[e] = VisitLogSumExp(a, e);
  }
}

// Kept logits -> upstream * (onehot(taken) - softmax), in place; a warp per visit.
template <typename T>
TF_HSM_GLOBAL void CoefficientKernel(Args<T> a, int64 e_begin, int64 e_end) {
  const int lane = ThreadX() % kWarpSize;
  const int64 warps = GridX() * (BlockDimX() / kWarpSize);
  for (int64 e = e_begin + BlockX() * (BlockDimX() / kWarpSize) + ThreadX() / kWarpSize;
       e < e_end; e += warps) {
    const Slice sl = a.slices[a.visit_slice[e]];
    T* z = a.coef + sl.coef + (e - sl.visit0) * sl.num_slots;
    const T up = a.upstream[a.visit_row[e]];
    const T lse = a.lse[e];
    const int64 taken = a.visit_slot[e] - sl.first_slot;
    for (int64 j = lane; j < sl.num_slots; j += kWarpSize) {
      T c = Exp(z[j] - lse) * -up;
      if (j == taken) c += up;
      z[j] = c;
    }
  }
}

// dh[token] += coef @ W_node for tokens [m0, m0 + BM) of a slice, dims [n0, n0 + BN).
template <typename T, class C>
TF_HSM_GLOBAL void TF_HSM_TILE_BOUNDS HiddenGradTiledKernel(Args<T> a, int64 item_begin, int64 num_items) {
  TF_HSM_SHARED TileSmem<T, C> smem;
  const int64 dim = a.dim;
  for (int64 it = BlockX(); it < num_items; it += GridX()) {
    const Item item = a.items[item_begin + it];
    const Slice sl = a.slices[item.slice];
    const int64 t0 = item.m0, d0 = item.n0, k = sl.num_slots;
    const int64 nt = Min64(C::BM, sl.count - t0);
    T acc[C::TM][C::TN];
    T* out[C::TM];
#pragma unroll
    for (int i = 0; i < C::TM; ++i) {
      const int r = C::Row(i);
      out[i] = r < nt ? a.d_hidden + a.visit_row[sl.visit0 + t0 + r] * dim + d0 : nullptr;
#pragma unroll
      for (int j = 0; j < C::TN; ++j) {
        const int c = C::Col(j);
        acc[i][j] = (out[i] != nullptr && d0 + c < dim) ? out[i][c] : T(0);
      }
    }
    TileProduct<T, C>(smem,
                      StridedRows<T>{a.coef + sl.coef + t0 * k, k, nt, k},
                      StridedCols<T>{a.weights + sl.first_slot * dim + d0, dim, dim - d0, k},
                      k, acc);
#pragma unroll
    for (int i = 0; i < C::TM; ++i) {
      if (out[i] == nullptr) continue;
#pragma unroll
      for (int j = 0; j < C::TN; ++j) {
        const int c = C::Col(j);
        if (d0 + c < dim) out[i][c] = acc[i][j];
      }
    }
  }
}

// The same for visits of small nodes, a warp per visit: lane d accumulates dims
// d, d + 32, ... over the node's slots in order (the chain of the tiled kernel).
template <typename T>
TF_HSM_GLOBAL void HiddenGradSmallKernel(Args<T> a, int64 e_begin, int64 e_end) {
  const int lane = ThreadX() % kWarpSize;
  const int64 warps = GridX() * (BlockDimX() / kWarpSize);
  const int64 dim = a.dim;
  for (int64 e = e_begin + BlockX() * (BlockDimX() / kWarpSize) + ThreadX() / kWarpSize;
       e < e_end; e += warps) {
    const Slice sl = a.slices[a.visit_slice[e]];
    if (sl.num_slots > kSmallSlots) continue;
    const T* c = a.coef + sl.coef + (e - sl.visit0) * sl.num_slots;
    const T* w = a.weights + sl.first_slot * dim;
    T* dh = a.d_hidden + a.visit_row[e] * dim;
    for (int64 d = lane; d < dim; d += kWarpSize) {
      T acc = dh[d];
      for (int64 j = 0; j < sl.num_slots; ++j) acc = Fma(c[j], w[j * dim + d], acc);
      dh[d] = acc;
    }
  }
}

// value(r, k) = hidden[token(k)][d0 + r], and 1 in column D when `ones` (for db).
template <typename T>
struct HiddenColumns {
  static constexpr bool kKFast = false;
  const T* hidden;
  const int64* visit_row;
  int64 visit0, count, dim, d0;
  bool ones;
  TF_HSM_DEVICE T Value(int r, int64 k) const {
    if (k >= count) return T(0);
    const int64 d = d0 + r;
    if (d < dim) return hidden[visit_row[visit0 + k] * dim + d];
    return (d == dim && ones) ? T(1) : T(0);
  }
};

// Weight-gradient rows [m0, m0 + BM) of a slice's node, columns [n0, n0 + BN) of
// [dW | db]: coef^T @ [H | 1] over the slice's tokens in order, continuing the chain of
// the group's earlier slices (offset > 0) from memory.
template <typename T, class C>
TF_HSM_GLOBAL void TF_HSM_TILE_BOUNDS WeightGradTiledKernel(Args<T> a, int64 item_begin, int64 num_items) {
  TF_HSM_SHARED TileSmem<T, C> smem;
  const int64 dim = a.dim;
  const bool bias = a.bias_rows != nullptr;
  for (int64 it = BlockX(); it < num_items; it += GridX()) {
    const Item item = a.items[item_begin + it];
    const Slice sl = a.slices[item.slice];
    const int64 j0 = item.m0, d0 = item.n0, k = sl.num_slots;
    T acc[C::TM][C::TN];
#pragma unroll
    for (int i = 0; i < C::TM; ++i) {
      const int64 j = j0 + C::Row(i);
#pragma unroll
      for (int jj = 0; jj < C::TN; ++jj) {
        const int64 d = d0 + C::Col(jj);
        T v = T(0);
        if (sl.offset > 0 && j < k) {
          if (d < dim) {
            v = a.weight_rows[(sl.row0 + j) * dim + d];
          } else if (d == dim && bias) {
            v = a.bias_rows[sl.row0 + j];
          }
        }
        acc[i][jj] = v;
      }
    }
    TileProduct<T, C>(smem, StridedCols<T>{a.coef + sl.coef + j0, k, k - j0, sl.count},
                      HiddenColumns<T>{a.hidden, a.visit_row, sl.visit0, sl.count, dim, d0,
                                       bias},
                      sl.count, acc);
#pragma unroll
    for (int i = 0; i < C::TM; ++i) {
      const int64 j = j0 + C::Row(i);
      if (j >= k) continue;
#pragma unroll
      for (int jj = 0; jj < C::TN; ++jj) {
        const int64 d = d0 + C::Col(jj);
        if (d < dim) {
          a.weight_rows[(sl.row0 + j) * dim + d] = acc[i][jj];
        } else if (d == dim && bias) {
          a.bias_rows[sl.row0 + j] = acc[i][jj];
        }
      }
    }
  }
}

// The same for a small node's short slice, a warp per slice: lane d accumulates columns
// d, d + 32, ... of each row over the slice's tokens in order (the tiled kernel's chains,
// the bias as fma(coef, 1, acc) like its column of ones), so either kernel gives the same
// bits.
template <typename T>
TF_HSM_GLOBAL void WeightGradWarpKernel(Args<T> a, int64 item_begin, int64 num_items) {
  const int lane = ThreadX() % kWarpSize;
  const int64 warps = GridX() * (BlockDimX() / kWarpSize);
  const int64 dim = a.dim;
  for (int64 it = BlockX() * (BlockDimX() / kWarpSize) + ThreadX() / kWarpSize; it < num_items;
       it += warps) {
    const Slice sl = a.slices[a.items[item_begin + it].slice];
    const int64 k = sl.num_slots;
    const T* coef = a.coef + sl.coef;
    const int64* rows = a.visit_row + sl.visit0;
    for (int64 j = 0; j < k; ++j) {
      T* dw = a.weight_rows + (sl.row0 + j) * dim;
      for (int64 d = lane; d < dim; d += kWarpSize) {
        T acc = sl.offset > 0 ? dw[d] : T(0);
        for (int64 t = 0; t < sl.count; ++t) acc = Fma(coef[t * k + j], a.hidden[rows[t] * dim + d], acc);
        dw[d] = acc;
      }
      if (a.bias_rows != nullptr && lane == 0) {
        T acc = sl.offset > 0 ? a.bias_rows[sl.row0 + j] : T(0);
        for (int64 t = 0; t < sl.count; ++t) acc = Fma(coef[t * k + j], T(1), acc);
        a.bias_rows[sl.row0 + j] = acc;
      }
    }
  }
}

// row_ids[r]: the slot of gradient row r (group g's rows are its node's slots in order).
TF_HSM_GLOBAL void RowIdsKernel(const int64* group_row, const int64* group_first,
                                int64 num_groups, int64* row_ids, int64 num_rows) {
  for (int64 r = BlockX() * BlockDimX() + ThreadX(); r < num_rows;
       r += GridX() * BlockDimX()) {
    int64 lo = 0, hi = num_groups;  // the last g with group_row[g] <= r
    while (hi - lo > 1) {
      const int64 mid = lo + (hi - lo) / 2;
      if (group_row[mid] <= r) {
        lo = mid;
      } else {
        hi = mid;
      }
    }
    row_ids[r] = group_first[lo] + (r - group_row[lo]);
  }
}

// ---- Host side ---------------------------------------------------------------------------

template <typename T>
Args<T> MakeArgs(const GpuLogProbPlan& plan, const SoftmaxParams<T>& p, void* workspace) {
  char* base = static_cast<char*>(workspace);
  Args<T> a;
  std::memset(&a, 0, sizeof(a));
  a.hidden = p.hidden;
  a.weights = p.weights;
  a.biases = p.biases;
  a.dim = p.dim;
  a.slices = reinterpret_cast<const Slice*>(base + plan.slices);
  a.items = reinterpret_cast<const Item*>(base + plan.items);
  a.visit_row = reinterpret_cast<const int64*>(base + plan.visit_row);
  a.visit_slot = reinterpret_cast<const int64*>(base + plan.visit_slot);
  a.visit_slice = reinterpret_cast<const int64*>(base + plan.visit_slice);
  a.token_begin = reinterpret_cast<const int64*>(base + plan.token_begin);
  a.token_entries = reinterpret_cast<const int64*>(base + plan.token_entries);
  a.cand_visit = reinterpret_cast<const int64*>(base + plan.cand_visit);
  a.cand_slot = reinterpret_cast<const int64*>(base + plan.cand_slot);
  a.num_candidates = plan.num_candidates;
  a.group_row = reinterpret_cast<const int64*>(base + plan.group_row);
  a.group_first = reinterpret_cast<const int64*>(base + plan.group_first);
  a.num_groups = plan.num_groups;
  a.partial_max = reinterpret_cast<T*>(base + plan.partial_max);
  a.partial_sum = reinterpret_cast<T*>(base + plan.partial_sum);
  a.taken = reinterpret_cast<T*>(base + plan.taken);
  a.lse = reinterpret_cast<T*>(base + plan.lse);
  a.coef = reinterpret_cast<T*>(base + plan.coef);
  return a;
}

std::string CheckCall(const GpuLogProbPlan& plan, GpuLogProbPlan::Mode mode, int64 value_bytes,
                      int64 dim, bool has_bias, const void* workspace) {
  static const char* kNeeds[] = {
      "LogProbForwardGpu needs a plan from PrepareLogProbGpu with backward = false",
      "LogProbBackwardGpu needs a plan from PrepareLogProbGpu with backward = true",
      "LogProbCandidatesGpu needs a plan from PrepareLogProbCandidatesGpu"};
  return CheckPlanCall(plan, mode, kNeeds[static_cast<int>(mode)], value_bytes, dim, has_bias,
                       workspace, plan.num_tokens > 0);
}

template <typename T, bool kStore>
std::string LaunchLogits(const Args<T>& a, const GpuLogProbPlan::Wave& w, cudaStream_t s) {
  TF_HSM_RETURN_IF_CUDA_ERROR(
      Launch(&LogitsTiledKernel<T, WideTile, kStore>, Blocks(w.logits_wide.count, 1),
             kThreads, s, a, w.logits_wide.begin, w.logits_wide.count),
      "LogitsTiledKernel (64 tokens)");
  TF_HSM_RETURN_IF_CUDA_ERROR(
      Launch(&LogitsTiledKernel<T, NarrowTile, kStore>, Blocks(w.logits_narrow.count, 1),
             kThreads, s, a, w.logits_narrow.begin, w.logits_narrow.count),
      "LogitsTiledKernel (16 tokens)");
  if (w.small_visits > 0) {
    TF_HSM_RETURN_IF_CUDA_ERROR(
        Launch(&LogitsSmallKernel<T, kStore>,
               Blocks(w.visit_end - w.visit_begin, kWarpsPerBlock), kThreads, s, a,
               w.visit_begin, w.visit_end),
        "LogitsSmallKernel");
  }
  return "";
}

// ---- The work lists (host) ---------------------------------------------------------------
// BuildWork, by phase: the visits, each group's chunks and partials, the slices and their
// waves with each wave's work items, then the workspace's layout and the uploaded words.

// The visits of a call: [begin()[g], begin()[g + 1]) are group g's, each with its hidden
// row and the slot it takes. For log_prob and its gradient they are the plan's entries;
// for candidates, one per distinct hidden row of a group (so a node's logsumexp is
// computed once per row however many of the row's candidates pass through it).
struct Visits {
  const VisitPlan* plan = nullptr;
  bool candidates = false;
  std::vector<int64> group_visits, visit_row, visit_slot;  // candidates only
  std::vector<int64> entry_visit;  // candidates: the visit of each plan entry
  const std::vector<int64>& begin() const { return candidates ? group_visits : plan->group_begin; }
  const std::vector<int64>& row() const { return candidates ? visit_row : plan->entry_token; }
  const std::vector<int64>& slot() const { return candidates ? visit_slot : plan->entry_slot; }
  int64 count() const { return static_cast<int64>(row().size()); }
};

void CollectVisits(const VisitPlan& plan, bool candidates, int64 num_candidates, Visits* v) {
  v->plan = &plan;
  v->candidates = candidates;
  if (!candidates) return;
  const int64 num_groups = plan.num_groups();
  v->group_visits.assign(num_groups + 1, 0);
  v->entry_visit.resize(plan.entry_token.size());
  for (int64 g = 0; g < num_groups; ++g) {
    v->group_visits[g] = static_cast<int64>(v->visit_row.size());
    // Entries are in token order, so a row's candidates in a group are adjacent.
    for (int64 e = plan.group_begin[g]; e < plan.group_begin[g + 1]; ++e) {
      const int64 row = plan.entry_token[e] / num_candidates;
      if (e == plan.group_begin[g] || row != v->visit_row.back()) {
        v->visit_row.push_back(row);
        v->visit_slot.push_back(plan.entry_slot[e]);
      }
      v->entry_visit[e] = static_cast<int64>(v->visit_row.size()) - 1;
    }
  }
  v->group_visits[num_groups] = static_cast<int64>(v->visit_row.size());
}

// Per group: its node's first slot, its slot chunks and its first partial logsumexp (one
// partial per (visit, chunk)).
struct Groups {
  std::vector<int64> first, chunks, partial;
  int64 num_partials = 0;
};

Groups LayOutGroups(const VisitPlan& plan, const TreeView& tree, const std::vector<int64>& vbegin) {
  const int64 num_groups = plan.num_groups();
  Groups gr;
  gr.first.resize(num_groups);
  gr.chunks.resize(num_groups);
  gr.partial.resize(num_groups);
  for (int64 g = 0; g < num_groups; ++g) {
    // The branching is the plan's row count: the node's entries in the tree, scattered over
    // megabytes for a large tree, are read once.
    gr.first[g] = tree.child_begin[plan.group_node[g]];
    const int64 k = plan.group_row[g + 1] - plan.group_row[g];
    gr.chunks[g] = k <= kSmallSlots ? 1 : CeilDiv(k, kChunkSlots);
    gr.partial[g] = gr.num_partials;
    gr.num_partials += (vbegin[g + 1] - vbegin[g]) * gr.chunks[g];
  }
  return gr;
}

// One wave's work items by kernel, before they are appended to the call's item list.
struct WaveLists {
  std::vector<Item> logits_wide, logits_narrow, dw[3], dw_warp;
  struct LevelLists {
    int64 level = -1, visit_begin = 0, visit_end = 0, small_visits = 0;
    std::vector<Item> dh_wide, dh_narrow;
  };
  std::vector<LevelLists> levels;
};

GpuLogProbPlan::Range Append(const std::vector<Item>& src, std::vector<Item>* items) {
  GpuLogProbPlan::Range r;
  r.begin = static_cast<int64>(items->size());
  r.count = static_cast<int64>(src.size());
  items->insert(items->end(), src.begin(), src.end());
  return r;
}

// Cuts each group into slices and the slices into waves whose coefficients fit the
// backward pass's budget (a forward or candidates call is one wave of whole groups), and
// lists each slice's work items: logits tiles, and for the backward the dh tiles of its
// level and the dW tiles (or a warp) of its rows.
class WaveBuilder {
 public:
  WaveBuilder(const Visits& visits, const Groups& groups, const VisitPlan& plan, int64 dim,
              bool has_bias, bool backward, int64 coef_budget, GpuLogProbPlan* gp)
      : visits_(visits), groups_(groups), plan_(plan), dim_(dim), has_bias_(has_bias),
        backward_(backward),
        budget_(backward ? std::max<int64>(coef_budget, 1) : std::numeric_limits<int64>::max()),
        gp_(gp) {
    visit_slice.resize(visits.count());
  }

  void AddGroup(int64 level, int64 g) {
    const int64 n = visits_.begin()[g + 1] - visits_.begin()[g];
    const int64 k = plan_.group_row[g + 1] - plan_.group_row[g];
    for (int64 offset = 0; offset < n;) {
      if (backward_ && used_ > 0 && budget_ - used_ < k) CloseWave();
      const int64 take = backward_ ? std::min(n - offset, std::max<int64>(1, (budget_ - used_) / k))
                                   : n - offset;
      const int64 s = AddSlice(g, k, offset, take);
      const bool small = k <= kSmallSlots, wide = n > kNarrowTokens;
      if (!small) AddLogitsItems(s, g, take, wide);
      if (backward_) AddBackwardItems(level, s, k, take, small, wide);
      offset += take;
    }
  }

  // Appends the open wave (if it has visits) to the plan and starts the next one.
  void CloseWave() {
    if (wave_.visit_end == wave_.visit_begin) return;
    wave_.coef_elements = used_;
    wave_.logits_wide = Append(lists_.logits_wide, &items);
    wave_.logits_narrow = Append(lists_.logits_narrow, &items);
    for (const auto& l : lists_.levels) {
      GpuLogProbPlan::Level level;
      level.visit_begin = l.visit_begin;
      level.visit_end = l.visit_end;
      level.small_visits = l.small_visits;
      level.dh_wide = Append(l.dh_wide, &items);
      level.dh_narrow = Append(l.dh_narrow, &items);
      wave_.levels.push_back(level);
    }
    for (int c = 0; c < 3; ++c) wave_.dw[c] = Append(lists_.dw[c], &items);
    wave_.dw_warp = Append(lists_.dw_warp, &items);
    gp_->waves.push_back(wave_);
    const int64 next = wave_.visit_end;
    wave_ = GpuLogProbPlan::Wave();
    wave_.visit_begin = wave_.visit_end = next;
    lists_ = WaveLists();
    used_ = 0;
  }

  std::vector<Slice> slices;
  std::vector<Item> items;
  std::vector<int64> visit_slice;

 private:
  // Visits [offset, offset + take) of group g as a new slice of the open wave; its index.
  int64 AddSlice(int64 g, int64 k, int64 offset, int64 take) {
    Slice sl;
    sl.visit0 = visits_.begin()[g] + offset;
    sl.count = take;
    sl.first_slot = groups_.first[g];
    sl.num_slots = k;
    sl.coef = backward_ ? used_ : 0;
    sl.row0 = plan_.group_row[g];
    sl.partial0 = groups_.partial[g] + offset * groups_.chunks[g];
    sl.num_chunks = groups_.chunks[g];
    sl.offset = offset;
    const int64 s = static_cast<int64>(slices.size());
    slices.push_back(sl);
    for (int64 v = sl.visit0; v < sl.visit0 + take; ++v) visit_slice[v] = s;
    if (backward_) used_ += take * k;
    wave_.visit_end = sl.visit0 + take;
    if (k <= kSmallSlots) wave_.small_visits += take;
    return s;
  }

  // A tile of tokens against each slot chunk (nodes of more than kSmallSlots children).
  void AddLogitsItems(int64 s, int64 g, int64 take, bool wide) {
    auto& dst = wide ? lists_.logits_wide : lists_.logits_narrow;
    const int64 bm = wide ? WideTile::BM : NarrowTile::BM;
    for (int64 t0 = 0; t0 < take; t0 += bm)
      for (int64 c = 0; c < groups_.chunks[g]; ++c) dst.push_back({s, t0, c});
  }

  // The slice's dh work in its level's lists, and its dW work.
  void AddBackwardItems(int64 level, int64 s, int64 k, int64 take, bool small, bool wide) {
    const Slice& sl = slices[s];
    if (lists_.levels.empty() || lists_.levels.back().level != level) {
      lists_.levels.emplace_back();
      lists_.levels.back().level = level;
      lists_.levels.back().visit_begin = sl.visit0;
    }
    auto& lv = lists_.levels.back();
    lv.visit_end = sl.visit0 + take;
    if (small) {
      lv.small_visits += take;
    } else {
      auto& dst = wide ? lv.dh_wide : lv.dh_narrow;
      const int64 bm = wide ? WideTile::BM : NarrowTile::BM;
      for (int64 t0 = 0; t0 < take; t0 += bm)
        for (int64 d0 = 0; d0 < dim_; d0 += WideTile::BN) dst.push_back({s, t0, d0});
    }
    if (small && take <= kWarpGradTokens) {
      lists_.dw_warp.push_back({s, 0, 0});
      return;
    }
    // Tiles by node size: <= 4, <= 16, > 16 rows.
    static constexpr int64 kRows[3] = {DwTile4::BM, DwTile16::BM, DwTile64::BM};
    static constexpr int64 kCols[3] = {DwTile4::BN, DwTile16::BN, DwTile64::BN};
    const int cfg = k <= kRows[0] ? 0 : (k <= kRows[1] ? 1 : 2);
    const int64 cols = dim_ + (has_bias_ ? 1 : 0);
    for (int64 j0 = 0; j0 < k; j0 += kRows[cfg])
      for (int64 d0 = 0; d0 < cols; d0 += kCols[cfg]) lists_.dw[cfg].push_back({s, j0, d0});
  }

  const Visits& visits_;
  const Groups& groups_;
  const VisitPlan& plan_;
  const int64 dim_;
  const bool has_bias_, backward_;
  const int64 budget_;
  GpuLogProbPlan* gp_;
  GpuLogProbPlan::Wave wave_;
  WaveLists lists_;
  int64 used_ = 0;  // coefficient elements of the open wave
};

// Byte offsets of the arrays in the workspace: the uploaded arrays first, then the
// device-only scratch. Returns the bytes uploaded.
int64 LayOutWorkspace(int64 value_bytes, int64 num_items, int64 num_entries, GpuLogProbPlan* gp) {
  const bool backward = gp->mode == GpuLogProbPlan::kBackward;
  const int64 num_visits = gp->num_visits;
  int64 cursor = 0;
  auto reserve = [&cursor](int64 bytes) { return Reserve(&cursor, bytes); };
  const int64 w = sizeof(int64);
  gp->slices = reserve(gp->num_slices * kSliceWords * w);
  gp->items = reserve(num_items * kItemWords * w);
  gp->visit_row = reserve(num_visits * w);
  gp->visit_slot = reserve(num_visits * w);
  gp->visit_slice = reserve(num_visits * w);
  if (!backward) {
    gp->token_begin = reserve((gp->num_tokens + 1) * w);
    gp->token_entries = reserve(num_entries * w);
  } else {
    gp->group_row = reserve((gp->num_groups + 1) * w);
    gp->group_first = reserve(gp->num_groups * w);
  }
  if (gp->mode == GpuLogProbPlan::kCandidates) {
    gp->cand_visit = reserve(num_entries * w);
    gp->cand_slot = reserve(num_entries * w);
  }
  const int64 staging_bytes = cursor;
  gp->partial_max = reserve(gp->num_partials * value_bytes);
  gp->partial_sum = reserve(gp->num_partials * value_bytes);
  gp->taken = reserve(num_visits * value_bytes);
  if (backward) {
    gp->lse = reserve(num_visits * value_bytes);
    int64 coef = 0;
    for (const auto& wv : gp->waves) coef = std::max(coef, wv.coef_elements);
    gp->coef = reserve(coef * value_bytes);
  }
  gp->workspace_bytes = cursor;
  return staging_bytes;
}

// Each token's entries in plan order, which is root first: token_begin and token_entries.
void FillTokenEntries(const VisitPlan& plan, int64* begin, int64* entries) {
  const int64 num_entries = static_cast<int64>(plan.entry_token.size());
  const int64 num_tokens = plan.num_tokens;
  for (int64 e = 0; e < num_entries; ++e) ++begin[plan.entry_token[e] + 1];
  for (int64 i = 0; i < num_tokens; ++i) begin[i + 1] += begin[i];
  std::vector<int64> next(begin, begin + num_tokens);
  for (int64 e = 0; e < num_entries; ++e) entries[next[plan.entry_token[e]]++] = e;
}

// The uploaded words, at the offsets LayOutWorkspace chose.
void FillStaging(const VisitPlan& plan, const Visits& visits, const Groups& groups,
                 const WaveBuilder& built, int64 staging_bytes, GpuLogProbPlan* gp) {
  const int64 w = sizeof(int64);
  gp->staging.assign(staging_bytes / w, 0);
  int64* words = gp->staging.data();
  if (!built.slices.empty()) {
    std::memcpy(words + gp->slices / w, built.slices.data(), built.slices.size() * sizeof(Slice));
  }
  if (!built.items.empty()) {
    std::memcpy(words + gp->items / w, built.items.data(), built.items.size() * sizeof(Item));
  }
  std::copy(visits.row().begin(), visits.row().end(), words + gp->visit_row / w);
  std::copy(visits.slot().begin(), visits.slot().end(), words + gp->visit_slot / w);
  std::copy(built.visit_slice.begin(), built.visit_slice.end(), words + gp->visit_slice / w);
  if (gp->mode != GpuLogProbPlan::kBackward) {
    FillTokenEntries(plan, words + gp->token_begin / w, words + gp->token_entries / w);
  } else {
    std::copy(plan.group_row.begin(), plan.group_row.end(), words + gp->group_row / w);
    std::copy(groups.first.begin(), groups.first.end(), words + gp->group_first / w);
  }
  if (gp->mode == GpuLogProbPlan::kCandidates) {
    std::copy(visits.entry_visit.begin(), visits.entry_visit.end(), words + gp->cand_visit / w);
    std::copy(plan.entry_slot.begin(), plan.entry_slot.end(), words + gp->cand_slot / w);
  }
}

// The work of one call, built on the host (see the phases above). Kernels see "visits":
// (group, hidden row) pairs whose logsumexp they compute.
template <typename T>
std::string BuildWork(const VisitPlan& plan, const TreeView& tree, int64 dim, bool has_bias,
                      GpuLogProbPlan::Mode mode, int64 coef_budget, int64 num_candidates,
                      GpuLogProbPlan* out) {
  *out = GpuLogProbPlan();
  GpuLogProbPlan& gp = *out;
  if (dim < 0) return "the hidden size must not be negative";
  const bool candidates = mode == GpuLogProbPlan::kCandidates;
  if (candidates && num_candidates < 1 && plan.num_tokens > 0) {
    return "the number of candidates per row must be positive";
  }
  gp.mode = mode;
  gp.has_bias = has_bias;
  gp.value_bytes = sizeof(T);
  gp.dim = dim;
  gp.num_tokens = plan.num_tokens;
  gp.num_groups = plan.num_groups();
  gp.num_rows = plan.num_rows();
  gp.num_candidates = candidates ? num_candidates : 0;

  Visits visits;
  CollectVisits(plan, candidates, num_candidates, &visits);
  gp.num_visits = visits.count();
  const Groups groups = LayOutGroups(plan, tree, visits.begin());
  gp.num_partials = groups.num_partials;

  WaveBuilder built(visits, groups, plan, dim, has_bias, mode == GpuLogProbPlan::kBackward,
                    coef_budget, &gp);
  for (int64 level = 0; level < plan.num_levels(); ++level) {
    for (int64 g = plan.level_begin[level]; g < plan.level_begin[level + 1]; ++g) {
      built.AddGroup(level, g);
    }
  }
  built.CloseWave();
  gp.num_slices = static_cast<int64>(built.slices.size());

  const int64 num_entries = static_cast<int64>(plan.entry_token.size());
  const int64 staging_bytes =
      LayOutWorkspace(sizeof(T), static_cast<int64>(built.items.size()), num_entries, &gp);
  FillStaging(plan, visits, groups, built, staging_bytes, &gp);
  return "";
}

}  // namespace
}  // namespace gpu

template <typename T>
std::string PrepareLogProbGpu(const VisitPlan& plan, const TreeView& tree, int64 dim,
                              bool has_bias, bool backward, int64 coef_budget,
                              GpuLogProbPlan* out) {
  return gpu::BuildWork<T>(plan, tree, dim, has_bias,
                           backward ? GpuLogProbPlan::kBackward : GpuLogProbPlan::kForward,
                           coef_budget, 0, out);
}

template <typename T>
std::string PrepareLogProbCandidatesGpu(const VisitPlan& plan, const TreeView& tree, int64 dim,
                                        bool has_bias, int64 num_candidates,
                                        GpuLogProbPlan* out) {
  return gpu::BuildWork<T>(plan, tree, dim, has_bias, GpuLogProbPlan::kCandidates, 0,
                           num_candidates, out);
}

namespace gpu {
namespace {

// LogProbForwardGpu and LogProbCandidatesGpu: the logits kernels over every wave, then the
// kernel that sums each token's path (the forward reads the kept taken logits, a thread a
// token; candidates recompute each taken logit, a warp a token). mode says which.
template <typename T>
std::string LogitsThenPathsGpu(GpuLogProbPlan::Mode mode, const GpuLogProbPlan& plan,
                               const SoftmaxParams<T>& p, T* out, void* workspace,
                               cudaStream_t stream) {
  std::string err = CheckCall(plan, mode, sizeof(T), p.dim, p.biases != nullptr, workspace);
  if (!err.empty() || plan.num_tokens == 0) return err;
  err = UploadStaging(plan.staging, workspace, stream, "uploading the work lists");
  if (!err.empty()) return err;
  Args<T> a = MakeArgs(plan, p, workspace);
  a.log_prob = out;
  for (const auto& w : plan.waves) {
    err = LaunchLogits<T, false>(a, w, stream);
    if (!err.empty()) return err;
  }
  if (mode == GpuLogProbPlan::kCandidates) {
    TF_HSM_RETURN_IF_CUDA_ERROR(
        Launch(&FinishCandidatesKernel<T>, Blocks(plan.num_tokens, kWarpsPerBlock), kThreads,
               stream, a, plan.num_tokens),
        "FinishCandidatesKernel");
  } else {
    TF_HSM_RETURN_IF_CUDA_ERROR(
        Launch(&FinishForwardKernel<T>, Blocks(plan.num_tokens, kThreads), kThreads, stream, a,
               plan.num_tokens),
        "FinishForwardKernel");
  }
  return "";
}

}  // namespace
}  // namespace gpu

template <typename T>
std::string LogProbCandidatesGpu(const GpuLogProbPlan& plan, const SoftmaxParams<T>& p, T* out,
                                 void* workspace, GpuStream stream) {
  return gpu::LogitsThenPathsGpu<T>(GpuLogProbPlan::kCandidates, plan, p, out, workspace, stream);
}

template <typename T>
std::string LogProbForwardGpu(const GpuLogProbPlan& plan, const SoftmaxParams<T>& p,
                              T* log_prob, void* workspace, GpuStream stream) {
  return gpu::LogitsThenPathsGpu<T>(GpuLogProbPlan::kForward, plan, p, log_prob, workspace,
                                    stream);
}

template <typename T>
std::string LogProbBackwardGpu(const GpuLogProbPlan& plan, const SoftmaxParams<T>& p,
                               const T* upstream, const LogProbGrads<T>& grads,
                               void* workspace, GpuStream stream) {
  using namespace gpu;  // NOLINT: the kernels and launch helpers of this file
  std::string err =
      CheckCall(plan, GpuLogProbPlan::kBackward, sizeof(T), p.dim, p.biases != nullptr, workspace);
  if (!err.empty() || plan.num_tokens == 0) return err;
  if ((grads.bias_rows != nullptr) != plan.has_bias) {
    return "bias_rows must be given exactly when there are biases";
  }
  err = UploadStaging(plan.staging, workspace, stream, "uploading the work lists");
  if (!err.empty()) return err;
  Args<T> a = MakeArgs(plan, p, workspace);
  a.upstream = upstream;
  a.d_hidden = grads.hidden;
  a.weight_rows = grads.weight_rows;
  a.bias_rows = grads.bias_rows;
  a.row_ids = grads.row_ids;
  const int64 dim = p.dim;
  TF_HSM_RETURN_IF_CUDA_ERROR(
      cudaMemsetAsync(grads.hidden, 0, plan.num_tokens * dim * sizeof(T), stream),
      "clearing the hidden gradient");
  TF_HSM_RETURN_IF_CUDA_ERROR(
      Launch(&RowIdsKernel, Blocks(plan.num_rows, kThreads), kThreads, stream, a.group_row,
             a.group_first, plan.num_groups, grads.row_ids, plan.num_rows),
      "RowIdsKernel");
  for (const auto& w : plan.waves) {
    err = LaunchLogits<T, true>(a, w, stream);
    if (!err.empty()) return err;
    const int64 entries = w.visit_end - w.visit_begin;
    TF_HSM_RETURN_IF_CUDA_ERROR(
        Launch(&LogSumExpKernel<T>, Blocks(entries, kThreads), kThreads, stream, a,
               w.visit_begin, w.visit_end),
        "LogSumExpKernel");
    TF_HSM_RETURN_IF_CUDA_ERROR(
        Launch(&CoefficientKernel<T>, Blocks(entries, kWarpsPerBlock), kThreads, stream, a,
               w.visit_begin, w.visit_end),
        "CoefficientKernel");
    // dh level by level: within a level each token is in one group, so tiles own their
    // rows; across levels the chain continues in order.
    for (const auto& l : w.levels) {
      if (dim == 0) break;
      TF_HSM_RETURN_IF_CUDA_ERROR(
          Launch(&HiddenGradTiledKernel<T, WideTile>, Blocks(l.dh_wide.count, 1), kThreads,
                 stream, a, l.dh_wide.begin, l.dh_wide.count),
          "HiddenGradTiledKernel (64 tokens)");
      TF_HSM_RETURN_IF_CUDA_ERROR(
          Launch(&HiddenGradTiledKernel<T, NarrowTile>, Blocks(l.dh_narrow.count, 1),
                 kThreads, stream, a, l.dh_narrow.begin, l.dh_narrow.count),
          "HiddenGradTiledKernel (16 tokens)");
      if (l.small_visits > 0) {
        TF_HSM_RETURN_IF_CUDA_ERROR(
            Launch(&HiddenGradSmallKernel<T>,
                   Blocks(l.visit_end - l.visit_begin, kWarpsPerBlock), kThreads, stream, a,
                   l.visit_begin, l.visit_end),
            "HiddenGradSmallKernel");
      }
    }
    TF_HSM_RETURN_IF_CUDA_ERROR(
        Launch(&WeightGradTiledKernel<T, DwTile4>, Blocks(w.dw[0].count, 1), kThreads,
               stream, a, w.dw[0].begin, w.dw[0].count),
        "WeightGradTiledKernel (4 slots)");
    TF_HSM_RETURN_IF_CUDA_ERROR(
        Launch(&WeightGradTiledKernel<T, DwTile16>, Blocks(w.dw[1].count, 1), kThreads,
               stream, a, w.dw[1].begin, w.dw[1].count),
        "WeightGradTiledKernel (16 slots)");
    TF_HSM_RETURN_IF_CUDA_ERROR(
        Launch(&WeightGradTiledKernel<T, DwTile64>, Blocks(w.dw[2].count, 1), kThreads,
               stream, a, w.dw[2].begin, w.dw[2].count),
        "WeightGradTiledKernel (64 slots)");
    TF_HSM_RETURN_IF_CUDA_ERROR(
        Launch(&WeightGradWarpKernel<T>, Blocks(w.dw_warp.count, kWarpsPerBlock), kThreads,
               stream, a, w.dw_warp.begin, w.dw_warp.count),
        "WeightGradWarpKernel");
  }
  return "";
}

#define TF_HSM_INSTANTIATE(T)                                                                \
  template std::string PrepareLogProbGpu<T>(const VisitPlan&, const TreeView&, int64, bool,  \
                                            bool, int64, GpuLogProbPlan*);                   \
  template std::string LogProbForwardGpu<T>(const GpuLogProbPlan&, const SoftmaxParams<T>&,  \
                                            T*, void*, GpuStream);                           \
  template std::string LogProbBackwardGpu<T>(const GpuLogProbPlan&, const SoftmaxParams<T>&, \
                                             const T*, const LogProbGrads<T>&, void*,        \
                                             GpuStream);                                     \
  template std::string PrepareLogProbCandidatesGpu<T>(const VisitPlan&, const TreeView&,     \
                                                      int64, bool, int64, GpuLogProbPlan*);  \
  template std::string LogProbCandidatesGpu<T>(const GpuLogProbPlan&,                        \
                                               const SoftmaxParams<T>&, T*, void*, GpuStream);
TF_HSM_INSTANTIATE(float)
TF_HSM_INSTANTIATE(double)
#undef TF_HSM_INSTANTIATE

}  // namespace tf_hsm
