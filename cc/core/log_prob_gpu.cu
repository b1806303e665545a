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
#include "cc/core/log_prob_gpu_layout.cuh"

namespace tf_hsm {
namespace gpu {
namespace {

// The tile shapes, thresholds, slices and work items: log_prob_gpu_layout.cuh.

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

// What a logits kernel keeps in the coefficient buffer besides the partials: nothing (a
// forward), the logits (a backward wave, whose coefficients follow once every chunk is
// folded), or the coefficients themselves (a wide group's block of children, whose
// visits' log-sum-exps are already known).
enum class Keep { kNothing, kLogits, kCoefficients };

// upstream * (onehot(taken) - softmax) for one logit: CoefficientKernel's formula.
template <typename T>
TF_HSM_DEVICE T Coefficient(T z, T lse, T up, bool taken) {
  T c = Exp(z - lse) * -up;
  if (taken) c += up;
  return c;
}

// One item: tokens [m0, m0 + BM) of a slice against slot chunk n0 of its node. The chunk
// is folded 64 slots at a time into a running (max, sum of exp) per token, written as the
// partial of (visit, chunk), and the taken slot's logit is written by the one thread that
// computes it; kKeep says what else is kept. With Keep::kCoefficients the slice is a block
// of a wide group's children: only its coefficients are written.
template <typename T, class C, Keep kKeep>
TF_HSM_GLOBAL void TF_HSM_TILE_BOUNDS LogitsTiledKernel(Args<T> a, int64 item_begin, int64 num_items) {
  constexpr bool kFold = kKeep != Keep::kCoefficients;
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
    const int64 n_begin = chunk * sl.chunk_slots;
    const int64 n_end = Min64(sl.num_slots, n_begin + sl.chunk_slots);
    SyncThreads();  // the previous item is done with `rows`
    for (int r = tid; r < C::BM; r += C::kThreads) {
      rows[r] = r < nt ? a.hidden + a.visit_row[sl.visit0 + t0 + r] * dim : nullptr;
    }
    SyncThreads();

    T run_max[C::TM], run_sum[C::TM], row_lse[C::TM], row_up[C::TM];
    int64 taken_slot[C::TM];
#pragma unroll
    for (int i = 0; i < C::TM; ++i) {
      const int r = C::Row(i);
      const int64 v = sl.visit0 + t0 + r;
      run_max[i] = NegInf<T>();
      run_sum[i] = T(0);
      taken_slot[i] = r < nt ? a.visit_slot[v] - sl.first_slot : -1;
      row_lse[i] = kKeep == Keep::kCoefficients && r < nt ? a.lse[v] : T(0);
      row_up[i] = kKeep == Keep::kCoefficients && r < nt ? a.upstream[a.visit_row[v]] : T(0);
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
        if (kFold) {
          tile_max = GroupMax<C::kThreadsN>(tile_max);
          const T new_max = MaxIgnoringNan(run_max[i], tile_max);
          // While every logit so far is -inf (masked children) they add exp(-inf - 0) = 0,
          // not exp(-inf - -inf) = NaN, and the running sum is kept as it is (0, or NaN
          // from a NaN logit), as in the CPU core.
          const bool none = new_max == NegInf<T>();
          const T shift = none ? T(0) : new_max;
          T tile_sum = T(0);
#pragma unroll
          for (int j = 0; j < C::TN; ++j) {
            if (C::Col(j) < nb) tile_sum += Exp(acc[i][j] - shift);
          }
          tile_sum = GroupSum<C::kThreadsN>(tile_sum);
          run_sum[i] = (none ? run_sum[i] : run_sum[i] * Exp(run_max[i] - new_max)) + tile_sum;
          run_max[i] = new_max;
        }
        if (r < nt) {
#pragma unroll
          for (int j = 0; j < C::TN; ++j) {
            const int c = C::Col(j);
            if (c >= nb) continue;
            const bool taken = n0 + c == taken_slot[i];
            T* kept = a.coef + sl.coef + (t0 + r) * sl.num_slots + n0 + c;
            if (kKeep == Keep::kLogits) *kept = acc[i][j];
            if (kKeep == Keep::kCoefficients) {
              *kept = Coefficient(acc[i][j], row_lse[i], row_up[i], taken);
            } else if (taken) {
              a.taken[sl.visit0 + t0 + r] = acc[i][j];
            }
          }
        }
      }
    }
    if (kFold && tn == 0) {
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
    } else if (cs != T(0)) {  // a chunk of masked children adds nothing; NaN stays NaN
      s = s + cs * (cm == m ? T(1) : Exp(cm - m));
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
    for (int64 j = lane; j < sl.num_slots; j += kWarpSize) z[j] = Coefficient(z[j], lse, up, j == taken);
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

template <typename T, Keep kKeep>
std::string LaunchLogits(const Args<T>& a, const GpuLogProbPlan::Wave& w, cudaStream_t s) {
  TF_HSM_RETURN_IF_CUDA_ERROR(
      Launch(&LogitsTiledKernel<T, WideTile, kKeep>, Blocks(w.logits_wide.count, 1),
             kThreads, s, a, w.logits_wide.begin, w.logits_wide.count),
      "LogitsTiledKernel (64 tokens)");
  TF_HSM_RETURN_IF_CUDA_ERROR(
      Launch(&LogitsTiledKernel<T, NarrowTile, kKeep>, Blocks(w.logits_narrow.count, 1),
             kThreads, s, a, w.logits_narrow.begin, w.logits_narrow.count),
      "LogitsTiledKernel (16 tokens)");
  if (w.small_visits > 0) {  // never in a block of a wide group's children
    TF_HSM_RETURN_IF_CUDA_ERROR(
        Launch(&LogitsSmallKernel<T, kKeep == Keep::kLogits>,
               Blocks(w.visit_end - w.visit_begin, kWarpsPerBlock), kThreads, s, a,
               w.visit_begin, w.visit_end),
        "LogitsSmallKernel");
  }
  return "";
}


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
    err = LaunchLogits<T, Keep::kNothing>(a, w, stream);
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

// A wave's dh, level by level: within a level each token is in one group, so tiles own
// their rows; across levels (and waves) the chain continues in order.
template <typename T>
std::string LaunchHiddenGrad(const Args<T>& a, const GpuLogProbPlan::Wave& w, cudaStream_t stream) {
  for (const auto& l : w.levels) {
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
  return "";
}

// A wave's weight-gradient rows, by node size.
template <typename T>
std::string LaunchWeightGrad(const Args<T>& a, const GpuLogProbPlan::Wave& w, cudaStream_t stream) {
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
  return "";
}

// One wave of the backward pass, by its kind (GpuLogProbPlan::Wave): the coefficients of
// its slices (from kept logits, or computed in the logits tiles of a wide group's block of
// children), then dh and dW; a kLogSumExp wave only folds its group's log-sum-exps.
template <typename T>
std::string BackwardWave(const Args<T>& a, const GpuLogProbPlan::Wave& w, int64 dim,
                         cudaStream_t stream) {
  using Wave = GpuLogProbPlan::Wave;
  const int64 entries = w.visit_end - w.visit_begin;
  std::string err = w.kind == Wave::kSlotBlock   ? LaunchLogits<T, Keep::kCoefficients>(a, w, stream)
                    : w.kind == Wave::kLogSumExp ? LaunchLogits<T, Keep::kNothing>(a, w, stream)
                                                 : LaunchLogits<T, Keep::kLogits>(a, w, stream);
  if (!err.empty()) return err;
  if (w.kind != Wave::kSlotBlock) {
    TF_HSM_RETURN_IF_CUDA_ERROR(
        Launch(&LogSumExpKernel<T>, Blocks(entries, kThreads), kThreads, stream, a,
               w.visit_begin, w.visit_end),
        "LogSumExpKernel");
  }
  if (w.kind == Wave::kLogSumExp) return "";
  if (w.kind == Wave::kCoefficients) {
    TF_HSM_RETURN_IF_CUDA_ERROR(
        Launch(&CoefficientKernel<T>, Blocks(entries, kWarpsPerBlock), kThreads, stream, a,
               w.visit_begin, w.visit_end),
        "CoefficientKernel");
  }
  if (dim > 0) err = LaunchHiddenGrad(a, w, stream);
  return err.empty() ? LaunchWeightGrad(a, w, stream) : err;
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
    err = BackwardWave(a, w, dim, stream);
    if (!err.empty()) return err;
  }
  return "";
}

#define TF_HSM_INSTANTIATE(T)                                                                \
  template std::string LogProbForwardGpu<T>(const GpuLogProbPlan&, const SoftmaxParams<T>&,  \
                                            T*, void*, GpuStream);                           \
  template std::string LogProbBackwardGpu<T>(const GpuLogProbPlan&, const SoftmaxParams<T>&, \
                                             const T*, const LogProbGrads<T>&, void*,        \
                                             GpuStream);                                     \
  template std::string LogProbCandidatesGpu<T>(const GpuLogProbPlan&,                        \
                                               const SoftmaxParams<T>&, T*, void*, GpuStream);
TF_HSM_INSTANTIATE(float)
TF_HSM_INSTANTIATE(double)
#undef TF_HSM_INSTANTIATE

}  // namespace tf_hsm
