#!/usr/bin/env bash
# Builds and runs the standalone GPU harness (cc/tests/gpu_harness.cu): the CUDA kernels of
# cc/core/*.cu checked against the CPU core cc/core/*.cc (compiled by the host compiler
# through nvcc: the code the CPU op runs) and timed against their roofline. nvcc alone:
# no TensorFlow, no Bazel.
#
#   cc/gpu_harness.sh                  build, then run the correctness cases (needs a GPU)
#   cc/gpu_harness.sh --time           ... and time the benchmark scenarios
#   cc/gpu_harness.sh --compile-only   build only (works without a GPU)
#   cc/gpu_harness.sh --emulate        build with the host compiler and the CUDA emulator
#                                      (cc/tests/gpu_emulation.cuh) and run the same kernels
#                                      on the CPU: correctness, small cases (with --time, a
#                                      smoke run of the timing code on shrunk scenarios)
#   cc/gpu_harness.sh --emulate --asan the same under AddressSanitizer and UBSan (catches
#                                      out-of-bounds reads in the kernels)
# Every other argument goes to the harness: --quick | --full, --time | --time-only,
# --plan-only (the host side of each call at the timing scenarios' sizes; no GPU needed),
# --check-timed, --only SUBSTRING, --seed N, --json FILE, --repeats N, --verbose, --hash (a
# digest per case of the training and candidates work lists and outputs: run it before and
# after a change to cc/core/*.cu that must keep every bit, and diff the `hash` lines).
#
# Environment:
#   TF_HSM_NVCC         nvcc to use (default: nvcc on PATH, else /usr/local/cuda/bin/nvcc)
#   TF_HSM_CUDA_ARCHS   SM versions to build SASS for (default "80 90": A100, H100/H200;
#                       PTX of the last one is embedded too)
#   TF_HSM_MARCH        -march for the CPU core (default native; the core gets the op
#                       library's flags for it, cc/core_flags.sh, and -O3)
#   TF_HSM_NVCC_FLAGS   extra flags for the CUDA sources (nvcc's, or the host compiler's
#                       with --emulate), e.g. the tuning knobs
#                       -DTF_HSM_GPU_CHUNK_SLOTS=256 -DTF_HSM_GPU_SMALL_TILE_BLOCKS=2 of
#                       cc/core/log_prob_gpu.cu, -DTF_HSM_GPU_SELECT_PER_THREAD=32 of
#                       cc/core/inference_gpu.cu (use another TF_HSM_HARNESS_DIR per setting)
#   TF_HSM_CUBLAS       1 to time cuBLAS SGEMM as the FLOP ceiling (default: when found)
#   CXX                 host compiler for --emulate (default g++)
#   TF_HSM_HARNESS_DIR  build directory (default build/gpu_harness)
set -euo pipefail
cd "$(dirname "$0")/.."

compile_only=0
emulate=0
asan=0
args=()
for a in "$@"; do
  case "$a" in
    --compile-only) compile_only=1 ;;
    --emulate) emulate=1 ;;
    --asan) asan=1 ;;
    *) args+=("$a") ;;
  esac
done

say() { printf '[gpu_harness] %s\n' "$*" >&2; }

# The flags a core source gets beyond the core's (cc/BUILD's sparse_rows library: the
# optimizers' row updates round each product on its own).
core_extra() {
  case "$1" in
    cc/core/sparse_rows.cc) echo "-fno-math-errno -ffp-contract=off" ;;
  esac
}

out="${TF_HSM_HARNESS_DIR:-build/gpu_harness}"
march="${TF_HSM_MARCH:-native}"
# The CPU core is compiled as for the op library (cc/BUILD, .tf_hsm.bazelrc): its -march,
# FMA and tuning flags and -O3, and sparse_rows.cc with the flags of its own library. It
# is the code the CPU op runs only then: fusing a * b + c into one FMA or not depends on
# those flags, and so do the bits the harness compares with.
mapfile -t core_flags < <(CC="${CXX:-g++}" cc/core_flags.sh "$march")
core_opt=-O3
core_cc=(cc/core/*.cc)
cuda_src=(cc/core/*.cu cc/tests/gpu_harness.cu)
headers=(cc/core/*.h cc/core/*.cuh cc/tests/gpu_emulation.cuh)

if [ "$emulate" = 1 ]; then
  cxx="${CXX:-g++}"
  mode="emulate"
  flags=(-std=c++17 -O2 "-march=$march" -I. -DTF_HSM_GPU_EMULATE -U_FORTIFY_SOURCE -Wall
         -Wno-unknown-pragmas)
  link_flags=()
  if [ "$asan" = 1 ]; then
    mode="emulate_asan"
    flags+=(-O1 -g -fsanitize=address,undefined -fno-omit-frame-pointer)
    core_opt=-O1  # as the sanitizers want it
    link_flags=(-fsanitize=address,undefined)
    # Fibers switch stacks behind ASan's back; these keep it quiet and correct.
    export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_stack_use_after_return=0:detect_leaks=0}"
    export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
  fi
  objdir="$out/$mode"
  cc_cmd() { "$cxx" "${flags[@]}" "${core_flags[@]}" "$core_opt" $(core_extra "$1") -c "$1" -o "$2"; }
  cu_cmd() { "$cxx" "${flags[@]}" ${TF_HSM_NVCC_FLAGS:-} -include cc/tests/gpu_emulation.cuh -x c++ -c "$1" -o "$2"; }
  link_cmd() { "$cxx" "${link_flags[@]}" -o "$1" "${@:2}" -lpthread; }
else
  nvcc="${TF_HSM_NVCC:-}"
  if [ -z "$nvcc" ]; then
    nvcc=$(command -v nvcc || true)
    [ -z "$nvcc" ] && [ -x /usr/local/cuda/bin/nvcc ] && nvcc=/usr/local/cuda/bin/nvcc
  fi
  if [ -z "$nvcc" ]; then
    say "nvcc not found: set TF_HSM_NVCC, or use --emulate to run the kernels on the CPU"
    exit 2
  fi
  mode="cuda"
  objdir="$out/cuda"
  gencode=()
  archs=(${TF_HSM_CUDA_ARCHS:-80 90})
  for sm in "${archs[@]}"; do gencode+=(-gencode "arch=compute_$sm,code=sm_$sm"); done
  last="${archs[${#archs[@]}-1]}"
  gencode+=(-gencode "arch=compute_$last,code=compute_$last")
  cuda_root=$("$nvcc" --dryrun -c -x cu /dev/null 2>&1 | sed -n 's/^#\$ TOP=//p' | head -1)
  link_extra=()
  cublas=()
  want_cublas="${TF_HSM_CUBLAS:-auto}"
  if [ "$want_cublas" != 0 ] && [ -n "$cuda_root" ] && [ -f "$cuda_root/include/cublas_v2.h" ] \
     && ls "$cuda_root"/lib64/libcublas.so* "$cuda_root"/targets/*/lib/libcublas.so* >/dev/null 2>&1; then
    cublas=(-DTF_HSM_HAVE_CUBLAS)
    link_extra=(-lcublas)
  elif [ "$want_cublas" = 1 ]; then
    say "TF_HSM_CUBLAS=1 but cuBLAS was not found next to $nvcc"; exit 2
  fi
  flags=(-std=c++17 -O3 -I. -lineinfo "${cublas[@]}" ${TF_HSM_NVCC_FLAGS:-})
  # The CPU core with the host compiler itself: nvcc's -Xcompiler would split
  # -mtune-ctrl's list at its commas.
  cc_cmd() { "${CXX:-g++}" -std=c++17 "$core_opt" -I. "${core_flags[@]}" $(core_extra "$1") -c "$1" -o "$2"; }
  cu_cmd() { "$nvcc" "${flags[@]}" "${gencode[@]}" -c "$1" -o "$2"; }
  link_cmd() { "$nvcc" "${gencode[@]}" -o "$1" "${@:2}" "${link_extra[@]}"; }
  say "nvcc: $nvcc ($("$nvcc" --version | sed -n 's/.*release \([0-9.]*\).*/\1/p')), SM ${archs[*]}"
fi

mkdir -p "$objdir"
# Rebuild an object when its source, any core header, this script or the flags changed.
stamp="$objdir/flags"
flag_text="$mode ${flags[*]} ${TF_HSM_NVCC_FLAGS:-} ${gencode[*]:-} ${core_flags[*]} $core_opt"
if [ "$(cat "$stamp" 2>/dev/null)" != "$flag_text" ]; then
  rm -f "$objdir"/*.o
  printf '%s' "$flag_text" > "$stamp"
fi
newest_dep=$(ls -t "${headers[@]}" "$0" | head -1)

pids=()
objs=()
built=()
build() {  # build <kind> <source>
  local src="$2" obj
  obj="$objdir/$(echo "$src" | tr '/.' '__').o"
  objs+=("$obj")
  if [ -f "$obj" ] && [ "$obj" -nt "$src" ] && [ "$obj" -nt "$newest_dep" ]; then return; fi
  local log="$obj.log"
  built+=("$obj")
  if [ "$1" = cc ]; then
    ( cc_cmd "$src" "$obj" ) >"$log" 2>&1 &
  else
    ( cu_cmd "$src" "$obj" ) >"$log" 2>&1 &
  fi
  pids+=($!)
}
for s in "${core_cc[@]}"; do build cc "$s"; done
for s in "${cuda_src[@]}"; do build cu "$s"; done

say "building ($mode) in $objdir"
status=0
for i in "${!pids[@]}"; do
  if ! wait "${pids[$i]}"; then
    status=1
    rm -f "${built[$i]}"
  fi
  [ -s "${built[$i]}.log" ] && cat "${built[$i]}.log" >&2
done
if [ "$status" != 0 ]; then
  say "build failed"
  exit 1
fi
binary="$out/gpu_harness_$mode"
link_cmd "$binary" "${objs[@]}"
say "built $binary"

if [ "$compile_only" = 1 ]; then exit 0; fi
if [ "$emulate" = 1 ]; then
  exec "$binary" --quick "${args[@]+"${args[@]}"}"
fi
exec "$binary" "${args[@]+"${args[@]}"}"
