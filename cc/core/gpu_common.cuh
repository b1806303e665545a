// Helpers shared by the CUDA cores (log_prob_gpu.cu, inference_gpu.cu): launch and
// workspace limits, the workspace layout, CUDA error messages, the upload of a plan's
// staging words, and the one-chain dot product both cores' logits are defined by.
#ifndef TF_HSM_CC_CORE_GPU_COMMON_CUH_
#define TF_HSM_CC_CORE_GPU_COMMON_CUH_

#include <cstdint>
#include <string>
#include <vector>

#include "cc/core/gpu_compat.cuh"

namespace tf_hsm {
namespace gpu {

// Grid-stride loops take over beyond this many blocks. The emulator gets few, so that it
// exercises those loops on small cases.
#ifdef TF_HSM_GPU_EMULATE
constexpr int64 kMaxBlocks = 5;
#else
constexpr int64 kMaxBlocks = int64{1} << 20;
#endif

// Alignment (bytes) of every sub-buffer of a workspace.
constexpr int64 kAlign = 256;

// Places a sub-buffer of `bytes` at *cursor, moves *cursor past it (rounded up to kAlign)
// and returns its offset.
inline int64 Reserve(int64* cursor, int64 bytes) {
  const int64 at = *cursor;
  *cursor += (bytes + kAlign - 1) / kAlign * kAlign;
  return at;
}

// "" on success, else the error named with the call it came from.
inline std::string CudaMessage(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return "";
  return std::string("CUDA error in ") + what + ": " + cudaGetErrorString(err);
}

#define TF_HSM_RETURN_IF_CUDA_ERROR(call, what)           \
  do {                                                    \
    const std::string message_ = CudaMessage(call, what); \
    if (!message_.empty()) return message_;               \
  } while (0)

// Copies a plan's staging words (the work lists, or the tree) to the start of the
// workspace on `stream`. From pageable memory: the call returns once the data is staged,
// so the plan may be destroyed right after.
inline std::string UploadStaging(const std::vector<int64>& staging, void* workspace,
                                 cudaStream_t stream, const char* what) {
  TF_HSM_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(workspace, staging.data(),
                                              staging.size() * sizeof(int64),
                                              cudaMemcpyHostToDevice, stream),
                              what);
  return "";
}

// The grid for `work` items at `per_block` a block, at most kMaxBlocks.
inline int64 Blocks(int64 work, int64 per_block) {
  return Min64(CeilDiv(work, per_block), kMaxBlocks);
}

// "" if `plan` (a GpuLogProbPlan or a GpuInferencePlan) suits the call: prepared for its
// mode (else `needs`, which names the plan the call needs), for values of value_bytes, for
// this hidden size and bias setting; and, when the call runs kernels (`runs`), the
// workspace is a 16-byte aligned buffer.
template <class Plan>
std::string CheckPlanCall(const Plan& plan, typename Plan::Mode mode, const char* needs,
                          int64 value_bytes, int64 dim, bool has_bias, const void* workspace,
                          bool runs) {
  if (plan.mode != mode) return needs;
  if (plan.value_bytes != value_bytes) return "the plan was prepared for another value type";
  if (plan.dim != dim) return "the plan was prepared for another hidden size";
  if (plan.has_bias != has_bias) return "the plan was prepared with a different bias setting";
  if (runs && (workspace == nullptr || reinterpret_cast<std::uintptr_t>(workspace) % 16 != 0)) {
    return "the workspace must be a 16-byte aligned device buffer";
  }
  return "";
}

// z = w . h (+ b) as the tile product computes it: one fma chain over d in order from
// zero, then the bias.
template <typename T>
TF_HSM_DEVICE T ChainDot(const T* h, const T* w, int64 dim, const T* bias) {
  T s = T(0);
  for (int64 d = 0; d < dim; ++d) s = Fma(h[d], w[d], s);
  if (bias != nullptr) s += *bias;
  return s;
}

}  // namespace gpu
}  // namespace tf_hsm

#endif  // TF_HSM_CC_CORE_GPU_COMMON_CUH_
