// A block-level tile product for the GPU kernels: acc[BM x BN] += A[BM x K] * B[K x BN],
// the K dimension streamed through shared memory BK at a time. The operands are read
// through small "loader" structs, so the same loop serves gathered token rows, contiguous
// weight rows and transposed coefficient blocks.
//
// Each thread owns TM x TN outputs: rows tm * TM + i and columns tn * TN + j, where
// tm = thread / kThreadsN and tn = thread % kThreadsN. The kThreadsN threads of one row are
// consecutive lanes, so row reductions are warp shuffles, and a thread's TM (TN) operands
// of one k step are contiguous in shared memory, so they load as 128-bit words. The next
// k step's operands are fetched from global memory into registers while the current one
// is computed.
//
// Every output is a single chain acc = fma(a_k, b_k, acc) over k in increasing order,
// whatever the tile sizes: a result depends on the order of its terms only, and a chain
// can be paused (stored) and resumed (loaded) without changing it. Out-of-range operand
// elements read as zero, which leaves a chain's value unchanged (a -0 may become +0).
#ifndef TF_HSM_CC_CORE_GPU_TILE_CUH_
#define TF_HSM_CC_CORE_GPU_TILE_CUH_

#include "cc/core/gpu_compat.cuh"

namespace tf_hsm {
namespace gpu {

template <int kBM, int kBN, int kBK, int kTM, int kTN>
struct TileConfig {
  static constexpr int BM = kBM, BN = kBN, BK = kBK, TM = kTM, TN = kTN;
  static constexpr int kThreadsM = BM / TM;
  static constexpr int kThreadsN = BN / TN;
  static constexpr int kThreads = kThreadsM * kThreadsN;
  static_assert(BM % TM == 0 && BN % TN == 0, "a thread tile must divide the block tile");
  static_assert(kThreads % 32 == 0 && kThreads <= 1024, "whole warps, at most 1024 threads");

  TF_HSM_DEVICE static int Row(int i) { return ThreadX() / kThreadsN * TM + i; }
  TF_HSM_DEVICE static int Col(int j) { return ThreadX() % kThreadsN * TN + j; }
};

// Operand tiles, k-major. Rows are padded by 16 bytes (against bank conflicts when a tile
// is stored k-fastest) and stay 16-byte aligned for vector loads.
template <typename T, class C>
struct TileSmem {
  static constexpr int kPad = 16 / sizeof(T);
  alignas(16) T a[C::BK][C::BM + kPad];
  alignas(16) T b[C::BK][C::BN + kPad];
};

// Loaders: Value(r, k) is element (r, k) of the operand (row r of the tile, reduction index
// k), zero out of range. kKFast says which index consecutive threads should take so that
// their global loads are contiguous.

// value(r, k) = rows[r][k] (rows in shared memory; nullptr reads as a zero row), k < kmax.
template <typename T>
struct GatheredRows {
  static constexpr bool kKFast = true;
  const T* const* rows;
  int64 kmax;
  TF_HSM_DEVICE T Value(int r, int64 k) const {
    const T* p = rows[r];
    return (p != nullptr && k < kmax) ? p[k] : T(0);
  }
};

// value(r, k) = base[r * ld + k] for r < rows, k < kmax: a block of rows, k contiguous.
template <typename T>
struct StridedRows {
  static constexpr bool kKFast = true;
  const T* base;
  int64 ld, rows, kmax;
  TF_HSM_DEVICE T Value(int r, int64 k) const {
    return (r < rows && k < kmax) ? base[r * ld + k] : T(0);
  }
};

// value(r, k) = base[k * ld + r] for r < cols, k < kmax: a block of rows read transposed,
// r contiguous.
template <typename T>
struct StridedCols {
  static constexpr bool kKFast = false;
  const T* base;
  int64 ld, cols, kmax;
  TF_HSM_DEVICE T Value(int r, int64 k) const {
    return (r < cols && k < kmax) ? base[k * ld + r] : T(0);
  }
};

// Moves one operand's R x BK tile: global -> registers (Fetch), registers -> shared (Store).
template <typename T, int R, int BK, int NT, class Load>
struct Stage {
  static constexpr int kPerThread = (R * BK + NT - 1) / NT;
  T reg[kPerThread] = {};
  TF_HSM_DEVICE static void Split(int idx, int* r, int* k) {
    if (Load::kKFast) {
      *r = idx / BK;
      *k = idx % BK;
    } else {
      *r = idx % R;
      *k = idx / R;
    }
  }
  TF_HSM_DEVICE void Fetch(const Load& load, int64 k0, int tid) {
#pragma unroll
    for (int l = 0; l < kPerThread; ++l) {
      const int idx = tid + l * NT;
      if (R * BK % NT == 0 || idx < R * BK) {
        int r, k;
        Split(idx, &r, &k);
        reg[l] = load.Value(r, k0 + k);
      }
    }
  }
  template <int kLd>
  TF_HSM_DEVICE void Store(T (&s)[BK][kLd], int tid) const {
#pragma unroll
    for (int l = 0; l < kPerThread; ++l) {
      const int idx = tid + l * NT;
      if (R * BK % NT == 0 || idx < R * BK) {
        int r, k;
        Split(idx, &r, &k);
        s[k][r] = reg[l];
      }
    }
  }
};

template <typename T, class C, class LoadA, class LoadB>
TF_HSM_DEVICE void TileProduct(TileSmem<T, C>& s, const LoadA& load_a, const LoadB& load_b,
                               int64 kred, T (&acc)[C::TM][C::TN]) {
  const int tid = ThreadX();
  const int tm = tid / C::kThreadsN, tn = tid % C::kThreadsN;
  Stage<T, C::BM, C::BK, C::kThreads, LoadA> stage_a;
  Stage<T, C::BN, C::BK, C::kThreads, LoadB> stage_b;
  if (kred > 0) {
    stage_a.Fetch(load_a, 0, tid);
    stage_b.Fetch(load_b, 0, tid);
  }
  for (int64 k0 = 0; k0 < kred; k0 += C::BK) {
    stage_a.Store(s.a, tid);
    stage_b.Store(s.b, tid);
    SyncThreads();
    if (k0 + C::BK < kred) {  // in flight while this step computes
      stage_a.Fetch(load_a, k0 + C::BK, tid);
      stage_b.Fetch(load_b, k0 + C::BK, tid);
    }
#pragma unroll
    for (int kk = 0; kk < C::BK; ++kk) {
      T av[C::TM], bv[C::TN];
#pragma unroll
      for (int i = 0; i < C::TM; ++i) av[i] = s.a[kk][tm * C::TM + i];
#pragma unroll
      for (int j = 0; j < C::TN; ++j) bv[j] = s.b[kk][tn * C::TN + j];
#pragma unroll
      for (int i = 0; i < C::TM; ++i)
#pragma unroll
        for (int j = 0; j < C::TN; ++j) acc[i][j] = Fma(av[i], bv[j], acc[i][j]);
    }
    SyncThreads();
  }
}

}  // namespace gpu
}  // namespace tf_hsm

#endif  // TF_HSM_CC_CORE_GPU_TILE_CUH_
