#!/usr/bin/env bash
# Prints the compiler flags of the op library's core (cc/core) and of its C++ tests, one
# per line, for -march=MARCH (default native):
#
#   cc/core_flags.sh [MARCH]
#
# configure.sh hands them to Bazel (.tf_hsm.bazelrc); cc/gpu_harness.sh compiles the CPU
# core it checks the CUDA kernels against with them, so that both run the code the op runs.
# The compiler is $CC (default gcc), as for Bazel.
#
# The kernels promise the same bits whichever of them computes a value (a dot product by
# one row or in a tile, a token's walk or the weight gradient's recomputation), which
# needs the compiler to fuse a * b + c into one FMA everywhere or nowhere. GCC's tuning
# for AMD Zen (-mtune=znver*, what -march=native picks there) splits FMAs that form a
# loop-carried chain of 128- or 256-bit vectors, and only those: whether a product is
# fused then depends on the loop around it. -mtune-ctrl turns that off where the compiler
# knows it.
# -march=native names a different instruction set on each kind of machine but the same
# flag to Bazel, which would reuse objects compiled on another kind (a checkout shared by
# several machines): a digest of the compiler's target macros joins the flags, so that a
# new target rebuilds the core. (An unused definition; it changes no code.)
set -euo pipefail
march="${1:-native}"
cc="${CC:-gcc}"
target=$("$cc" -march="$march" -dM -E -x c /dev/null 2>/dev/null | sort | cksum |
  cut -d' ' -f1 || true)
echo "-march=$march"
echo "-DTF_HSM_TARGET=${target:-unknown}"
fma_chains=""
for knob in avoid_fma_chains avoid_fma256_chains avoid_fma512_chains; do
  if echo 'int x;' | "$cc" -mtune-ctrl="^$knob" -x c++ -c - -o /dev/null 2>/dev/null; then
    fma_chains="${fma_chains:+$fma_chains,}^$knob"
  fi
done
if [ -n "$fma_chains" ]; then echo "-mtune-ctrl=$fma_chains"; fi
