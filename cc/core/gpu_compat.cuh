// The few CUDA constructs the tf_hsm GPU kernels use, behind names that also compile for
// the host emulator (cc/tests/gpu_emulation.cuh, selected by -DTF_HSM_GPU_EMULATE).
//
// The kernels never spell threadIdx, __syncthreads, __shfl_* or <<<>>> directly; they use
// ThreadX(), SyncThreads(), ShflXor() and Launch() from here. Built by nvcc these are the
// CUDA intrinsics; built by a host compiler with TF_HSM_GPU_EMULATE they run every CUDA
// thread of a block as a fiber, so the same kernel source can be executed and checked on
// a machine without a GPU (cc/gpu_harness.sh --emulate).
#ifndef TF_HSM_CC_CORE_GPU_COMPAT_CUH_
#define TF_HSM_CC_CORE_GPU_COMPAT_CUH_

#include <cmath>
#include <cstdint>

#include "cc/core/host_device.h"  // TF_HSM_HOST_DEVICE

#ifdef TF_HSM_GPU_EMULATE
// The emulator is test code: the harness's build includes it before each CUDA source
// (-include), so that the library's sources never name a file of the tests.
#ifndef TF_HSM_CC_TESTS_GPU_EMULATION_CUH_
#error "TF_HSM_GPU_EMULATE needs -include cc/tests/gpu_emulation.cuh (cc/gpu_harness.sh --emulate)"
#endif
#define TF_HSM_GLOBAL
#define TF_HSM_DEVICE inline
// Blocks run one at a time in the emulator, so a function-scope static is per block.
#define TF_HSM_SHARED static
#define TF_HSM_LAUNCH_BOUNDS(threads, min_blocks)
#else
#include <cuda_runtime.h>
#define TF_HSM_GLOBAL __global__
#define TF_HSM_DEVICE __device__ __forceinline__
#define TF_HSM_SHARED __shared__
#define TF_HSM_LAUNCH_BOUNDS(threads, min_blocks) __launch_bounds__(threads, min_blocks)
#endif

namespace tf_hsm {
namespace gpu {

using int64 = std::int64_t;

constexpr int kWarpSize = 32;

#ifdef TF_HSM_GPU_EMULATE

inline int ThreadX() { return static_cast<int>(::tf_hsm_emu::ThreadIdx().x); }
inline int BlockDimX() { return static_cast<int>(::tf_hsm_emu::BlockDim().x); }
inline int64 BlockX() { return ::tf_hsm_emu::BlockIdx().x; }
inline int64 GridX() { return ::tf_hsm_emu::GridDim().x; }
inline void SyncThreads() { ::tf_hsm_emu::SyncThreads(); }
inline void SyncWarp() { ::tf_hsm_emu::SyncWarp(); }
template <typename T>
inline T ShflXor(T v, int lane_mask) {
  return ::tf_hsm_emu::Shfl(v, ::tf_hsm_emu::LaneId() ^ lane_mask);
}
template <typename T>
inline T Shfl(T v, int src_lane) {
  return ::tf_hsm_emu::Shfl(v, src_lane);
}

#else

TF_HSM_DEVICE int ThreadX() { return static_cast<int>(threadIdx.x); }
TF_HSM_DEVICE int BlockDimX() { return static_cast<int>(blockDim.x); }
TF_HSM_DEVICE int64 BlockX() { return blockIdx.x; }
TF_HSM_DEVICE int64 GridX() { return gridDim.x; }
TF_HSM_DEVICE void SyncThreads() { __syncthreads(); }
TF_HSM_DEVICE void SyncWarp() { __syncwarp(); }
template <typename T>
TF_HSM_DEVICE T ShflXor(T v, int lane_mask) {
  return __shfl_xor_sync(0xffffffffu, v, lane_mask);
}
template <typename T>
TF_HSM_DEVICE T Shfl(T v, int src_lane) {
  return __shfl_sync(0xffffffffu, v, src_lane);
}

#endif

// Launches kernel<<<grid, block, 0, stream>>>(args...) and returns the launch error.
template <typename... Params, typename... Actual>
cudaError_t Launch(void (*kernel)(Params...), int64 grid, int block, cudaStream_t stream,
                   const Actual&... args) {
  if (grid <= 0) return cudaSuccess;
#ifdef TF_HSM_GPU_EMULATE
  (void)stream;
  return ::tf_hsm_emu::Launch(dim3(static_cast<unsigned>(grid)), dim3(block),
                              [&]() { kernel(args...); });
#else
  kernel<<<dim3(static_cast<unsigned>(grid)), dim3(block), 0, stream>>>(args...);
  return cudaGetLastError();
#endif
}

// Math that nvcc and the host compiler both provide, by type.
TF_HSM_DEVICE float Exp(float x) { return expf(x); }
TF_HSM_DEVICE double Exp(double x) { return exp(x); }
TF_HSM_DEVICE float Log(float x) { return logf(x); }
TF_HSM_DEVICE double Log(double x) { return log(x); }
// Fused multiply-add a * b + c with one rounding: every accumulation in the kernels goes
// through it, so an element's value depends only on the order of its terms.
TF_HSM_DEVICE float Fma(float a, float b, float c) { return fmaf(a, b, c); }
TF_HSM_DEVICE double Fma(double a, double b, double c) { return fma(a, b, c); }

template <typename T>
TF_HSM_DEVICE T NegInf() {
  return -static_cast<T>(HUGE_VAL);
}

// Maximum that ignores NaN in b (a is never NaN where this is used), like the CPU core's
// running max: NaN logits then reach only the sum of exponentials of their own row.
template <typename T>
TF_HSM_DEVICE T MaxIgnoringNan(T a, T b) {
  return b > a ? b : a;
}

// Sum and max over aligned groups of kWidth lanes (a power of two <= 32) by an xor
// butterfly: every lane of a group ends with the same bits, since each step adds the same
// two values in either order.
template <int kWidth, typename T>
TF_HSM_DEVICE T GroupSum(T v) {
#pragma unroll
  for (int m = kWidth / 2; m > 0; m /= 2) v += ShflXor(v, m);
  return v;
}

template <int kWidth, typename T>
TF_HSM_DEVICE T GroupMax(T v) {
#pragma unroll
  for (int m = kWidth / 2; m > 0; m /= 2) v = MaxIgnoringNan(v, ShflXor(v, m));
  return v;
}

TF_HSM_HOST_DEVICE int64 CeilDiv(int64 a, int64 b) { return (a + b - 1) / b; }
TF_HSM_HOST_DEVICE int64 Min64(int64 a, int64 b) { return a < b ? a : b; }

}  // namespace gpu
}  // namespace tf_hsm

#endif  // TF_HSM_CC_CORE_GPU_COMPAT_CUH_
