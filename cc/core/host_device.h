// TF_HSM_HOST_DEVICE: a function that both the CPU core and the CUDA kernels run, written
// once. Compiled by nvcc it is __host__ __device__; by a host compiler (the CPU core, the
// op library, and the CUDA emulator of cc/tests/gpu_emulation.cuh) an inline function.
#ifndef TF_HSM_CC_CORE_HOST_DEVICE_H_
#define TF_HSM_CC_CORE_HOST_DEVICE_H_

#if defined(__CUDACC__) && !defined(TF_HSM_GPU_EMULATE)
#define TF_HSM_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define TF_HSM_HOST_DEVICE inline
#endif

#endif  // TF_HSM_CC_CORE_HOST_DEVICE_H_
