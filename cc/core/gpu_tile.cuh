// A block-level tile product for the GPU kernels: acc[BM x BN] += A[BM x K] * B[K x BN],
// the K dimension streamed through shared memory BK at a time. The operands are read
// through small "loader" structs, so the same loop serves gathered token rows, contiguous
// weight rows and transposed coefficient blocks.
//
// Each thread owns TM x TN outputs at rows tm + i * kThreadsM and columns
// tn + j * kThreadsN (tm = thread / kThreadsN, tn = thread % kThreadsN): the kThreadsN
// threads of one row are consecutive lanes, so row reductions are warp shuffles. Every
// output is a single chain acc = fma(a_k, b_k, acc) over k in increasing order, whatever
// the tile sizes: a result depends on the order of its terms only, and a chain can be
// paused (stored) and resumed (loaded) without changing a bit. Out-of-range operand
// elements read as zero, which leaves a chain's value unchanged.
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

  TF_HSM_DEVICE static int Row(int i) { return ThreadX() / kThreadsN + i * kThreadsM; }
  TF_HSM_DEVICE static int Col(int j) { return ThreadX() % kThreadsN + j * kThreadsN; }
};

// Operand tiles, k-major, with one padding column against shared-memory bank conflicts.
template <typename T, class C>
struct TileSmem {
  T a[C::BK][C::BM + 1];
  T b[C::BK][C::BN + 1];
};

// Loaders: Fill<R, BK, NT>(s, k0, tid) writes s[k][r] = value(r, k0 + k) for r < R,
// k < BK, sharing the R * BK elements among NT threads.

// value(r, k) = rows[r][k] (rows in shared memory; nullptr reads as a zero row), k < kmax.
// Consecutive threads take consecutive k: each row is read contiguously.
template <typename T>
struct GatheredRows {
  const T* const* rows;
  int64 kmax;
  template <int R, int BK, int NT>
  TF_HSM_DEVICE void Fill(T (&s)[BK][R + 1], int64 k0, int tid) const {
#pragma unroll
    for (int idx = tid; idx < R * BK; idx += NT) {
      const int r = idx / BK, k = idx % BK;
      const T* p = rows[r];
      s[k][r] = (p != nullptr && k0 + k < kmax) ? p[k0 + k] : T(0);
    }
  }
};

// value(r, k) = base[r * ld + k] for r < rows, k < kmax: a block of rows, k contiguous.
template <typename T>
struct StridedRows {
  const T* base;
  int64 ld, rows, kmax;
  template <int R, int BK, int NT>
  TF_HSM_DEVICE void Fill(T (&s)[BK][R + 1], int64 k0, int tid) const {
#pragma unroll
    for (int idx = tid; idx < R * BK; idx += NT) {
      const int r = idx / BK, k = idx % BK;
      s[k][r] = (r < rows && k0 + k < kmax) ? base[r * ld + k0 + k] : T(0);
    }
  }
};

// value(r, k) = base[k * ld + r] for r < cols, k < kmax: a block of rows read transposed,
// r contiguous.
template <typename T>
struct StridedCols {
  const T* base;
  int64 ld, cols, kmax;
  template <int R, int BK, int NT>
  TF_HSM_DEVICE void Fill(T (&s)[BK][R + 1], int64 k0, int tid) const {
#pragma unroll
    for (int idx = tid; idx < R * BK; idx += NT) {
      const int r = idx % R, k = idx / R;
      s[k][r] = (r < cols && k0 + k < kmax) ? base[(k0 + k) * ld + r] : T(0);
    }
  }
};

template <typename T, class C, class LoadA, class LoadB>
TF_HSM_DEVICE void TileProduct(TileSmem<T, C>& s, const LoadA& load_a, const LoadB& load_b,
                               int64 kred, T (&acc)[C::TM][C::TN]) {
  const int tid = ThreadX();
  const int tm = tid / C::kThreadsN, tn = tid % C::kThreadsN;
  for (int64 k0 = 0; k0 < kred; k0 += C::BK) {
    load_a.template Fill<C::BM, C::BK, C::kThreads>(s.a, k0, tid);
    load_b.template Fill<C::BN, C::BK, C::kThreads>(s.b, k0, tid);
    SyncThreads();
#pragma unroll
    for (int kk = 0; kk < C::BK; ++kk) {
      T av[C::TM], bv[C::TN];
#pragma unroll
      for (int i = 0; i < C::TM; ++i) av[i] = s.a[kk][tm + i * C::kThreadsM];
#pragma unroll
      for (int j = 0; j < C::TN; ++j) bv[j] = s.b[kk][tn + j * C::kThreadsN];
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
