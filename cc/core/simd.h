// Small dense kernels the hierarchical softmax is built from, written with GCC/Clang vector
// extensions: the compiler emits AVX-512, AVX2, AVX or SSE from the same source depending on
// -march, which keeps one portable code path. Every output element is produced by the same
// fixed sequence of operations whatever the blocking around it, so results are identical
// across thread counts and tilings. That includes fusing a * b + c into one FMA in every
// kernel or in none, which configure.sh makes sure of for GCC's AMD Zen tuning.
#ifndef TF_HSM_CC_CORE_SIMD_H_
#define TF_HSM_CC_CORE_SIMD_H_

// The pieces, one job each:
//   simd_isa.h     the instruction set (-march) and the inline namespace named after it
//   simd_vector.h  vector types, loads and stores, shuffles, reductions, transposes
//   simd_math.h    exp and log of vectors
//   simd_dot.h     dot-product and multiply-add kernels (DotBlock picks one for a block)
//   simd_tiles.h   register-tiled kernels over packed panels and row slices
#include "cc/core/simd_dot.h"
#include "cc/core/simd_isa.h"
#include "cc/core/simd_math.h"
#include "cc/core/simd_tiles.h"
#include "cc/core/simd_vector.h"

#endif  // TF_HSM_CC_CORE_SIMD_H_
