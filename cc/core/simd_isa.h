// Which instruction set the vector kernels (cc/core/simd_*.h) are compiled for, chosen
// from the compiler's target macros (-march): the partial-load and streaming-store
// intrinsics available, the inline namespace every piece of the kernels lives in, and the
// register file the register tiles are sized for.
#ifndef TF_HSM_CC_CORE_SIMD_ISA_H_
#define TF_HSM_CC_CORE_SIMD_ISA_H_

#include <cstdint>

#if defined(__AVX512F__) && !defined(__CUDACC__)
#include <immintrin.h>
#define TF_HSM_MASKED_PARTIALS 1
#elif defined(__AVX2__) && !defined(__CUDACC__)
// AVX2 without AVX-512: partial loads and stores are masked moves (vmaskmov, which never
// touches a masked-out element) rather than library copies, streaming stores vmovntps.
#include <immintrin.h>
#define TF_HSM_AVX2_PARTIALS 1
#endif

// Every piece of the kernels (simd_*.h, and the headers built on them) is compiled for the
// instruction set of the file that includes it, and lives in an inline namespace named
// after that instruction set, TF_HSM_SIMD_ISA. Without it, a binary that
// links files built with different -march flags (the core is built for the host, other
// code need not be) would hold two builds of each template under one name; the linker
// keeps one copy of each function the compiler did not inline, so one file's code would
// silently run the other's, with the other's arithmetic (FMA or not).
#if defined(__AVX512F__)
#define TF_HSM_SIMD_ISA isa_avx512
#elif defined(__AVX2__) && defined(__FMA__)
#define TF_HSM_SIMD_ISA isa_avx2_fma
#elif defined(__FMA__)
#define TF_HSM_SIMD_ISA isa_fma
#elif defined(__AVX2__)
#define TF_HSM_SIMD_ISA isa_avx2
#elif defined(__AVX__)
#define TF_HSM_SIMD_ISA isa_avx
#else
#define TF_HSM_SIMD_ISA isa_baseline
#endif

namespace tf_hsm {
namespace simd {
inline namespace TF_HSM_SIMD_ISA {

using int64 = std::int64_t;

// The machine's vector registers: how many, and how wide (register-tile sizes).
#if defined(__AVX512F__)
constexpr int64 kVectorRegisters = 32, kRegisterBytes = 64;
#elif defined(__AVX__)
constexpr int64 kVectorRegisters = 16, kRegisterBytes = 32;
#else
constexpr int64 kVectorRegisters = 16, kRegisterBytes = 16;
#endif
// On x86 a vector is one register: 64 bytes with AVX-512, 32 with AVX or AVX2, 16 with
// SSE alone. GCC lowers comparisons and selects (x > y ? x : y) of vectors wider than a
// register to scalar code with branches, which made the exp, log and softmax kernels the
// slowest part of a step (E's backward: 2.7 ms with 64-byte vectors, 1.0-1.3 ms with
// 32-byte ones, on a Zen 3 EPYC), and builds their splats and register tiles through the
// stack (float64 at B, T=2,560, on an AVX2 build: 525 ms a step with 64-byte vectors).
// A vector can then be narrower than a walked node of up to 8 children: the walk's
// softmax takes such steps one lane at a time (WalkSoftmaxAll). Elsewhere (no x86 vector
// extension detected, e.g. another architecture) vectors stay 64 bytes.
#if defined(__SSE2__)
constexpr int kVectorBytes = static_cast<int>(kRegisterBytes);
#else
constexpr int kVectorBytes = 64;
#endif

}  // namespace TF_HSM_SIMD_ISA
}  // namespace simd
}  // namespace tf_hsm

#endif  // TF_HSM_CC_CORE_SIMD_ISA_H_
