#!/usr/bin/env bash
# Sets up everything tf_hsm needs on a fresh Debian/Ubuntu machine and builds the ops.
#
#   ./configure.sh
#
# - Python: the active virtualenv if there is one, else .venv at the repository root
#   (created here), with the pinned requirements.txt installed.
# - Bazel: Debian's bazel-bootstrap when `bazel` is missing (run as root, or install it).
# - Writes .tf_hsm.bazelrc pointing Bazel at that environment's TensorFlow (its headers,
#   library and compile flags are read from tf.sysconfig at build time).
# - Builds the op library and the C++ tests, and places the library in tf_hsm/.
#
# Environment: TF_HSM_MARCH (default "native") sets -march for the core's vectorised
# kernels and the C++ tests of them (so the tests run the instruction set that ships);
# TF_HSM_MARCH=x86-64-v2 (say) builds a library that runs on older CPUs.
# Safe to run again: a second run only checks, and rebuilds what changed.
set -euo pipefail
cd "$(dirname "$0")"
root=$(pwd)

say() { printf '[configure] %s\n' "$*"; }

# ./configure.sh --wheel: the same set-up, a library built for a portable x86-64 level
# (TF_HSM_MARCH, default x86-64-v3: AVX2 and FMA), then dist/tf_hsm-*.whl. A later plain
# ./configure.sh rebuilds the library for this machine again.
wheel=0
for arg in "$@"; do
  case "$arg" in
    --wheel) wheel=1 ;;
    *) say "unknown argument '$arg' (the only one is --wheel)"; exit 2 ;;
  esac
done

as_root() {
  if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else
    say "need root to run: $*"; exit 1; fi
}

apt_updated=0
apt_install() {
  if ! command -v apt-get >/dev/null; then
    say "apt-get not found: install $* with your package manager, then rerun."; exit 1
  fi
  if [ "$apt_updated" = 0 ]; then as_root apt-get update -qq; apt_updated=1; fi
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

# --- Python environment -----------------------------------------------------------------
if [ -n "${VIRTUAL_ENV:-}" ]; then
  python="$VIRTUAL_ENV/bin/python"
  say "using the active virtualenv $VIRTUAL_ENV"
else
  if [ ! -x .venv/bin/python ]; then
    say "creating .venv"
    if ! python3 -m venv .venv 2>/dev/null; then
      rm -rf .venv
      apt_install python3-venv
      python3 -m venv .venv
    fi
  fi
  python="$root/.venv/bin/python"
fi
stamp="$("$python" -c 'import sys; print(sys.prefix)')/.tf_hsm_requirements"
if ! cmp -s requirements.txt "$stamp" 2>/dev/null; then
  say "installing requirements.txt"
  "$python" -m pip install -q --upgrade pip
  "$python" -m pip install -q -r requirements.txt
  cp requirements.txt "$stamp"
else
  say "requirements already installed"
fi

# --- Bazel ------------------------------------------------------------------------------
if ! command -v bazel >/dev/null; then
  say "installing Bazel (Debian package bazel-bootstrap)"
  apt_install bazel-bootstrap || {
    say "could not install bazel-bootstrap: install Bazel 4.x (https://bazel.build) and rerun."
    exit 1; }
fi

# --- Bazel configuration ----------------------------------------------------------------
if [ "$wheel" = 1 ]; then march="${TF_HSM_MARCH:-x86-64-v3}"; else march="${TF_HSM_MARCH:-native}"; fi
# The core's flags (cc/core_flags.sh says why each): --per_file_copt splits its options at
# commas; a backslash keeps one, and reading the rc file takes one backslash away, hence
# two before each comma inside an option (-mtune-ctrl's list).
core_copts=$(cc/core_flags.sh "$march" | sed 's/,/\\\\,/g' | paste -sd, -)
config=$(cat <<CONF
# Written by ./configure.sh; do not edit.
build --repo_env=TF_HSM_PYTHON=$python
build --per_file_copt=cc/core/.*,cc/tests/.*@$core_copts
CONF
)
if [ "$config" != "$(cat .tf_hsm.bazelrc 2>/dev/null)" ]; then
  printf '%s\n' "$config" > .tf_hsm.bazelrc
  say "wrote .tf_hsm.bazelrc"
fi

# --- Build ------------------------------------------------------------------------------
say "building the op library"
build_log=$(mktemp)
if ! bazel build --noshow_progress //cc:_hsm_ops.so //cc:core_test //cc:inference_test \
    >"$build_log" 2>&1; then
  grep -vE '^(INFO|Loading|Analyzing)' "$build_log" || true; rm -f "$build_log"
  say "the build failed; see the messages above (bazel build //cc:_hsm_ops.so)"; exit 1
fi
rm -f "$build_log"
if ! cmp -s bazel-bin/cc/_hsm_ops.so tf_hsm/_hsm_ops.so; then
  install -m 0755 bazel-bin/cc/_hsm_ops.so tf_hsm/_hsm_ops.so
fi
# The CPU features the core was compiled for (-march=$march), named as in /proc/cpuinfo:
# tf_hsm/ops/loader.py checks them before loading the library, which on a machine without
# them (one built on an AVX-512 machine, run on an AVX2 one) would stop the process with
# an illegal instruction.
features=$("${CC:-gcc}" -march="$march" -dM -E -x c /dev/null 2>/dev/null |
  sed -n -E 's/^#define __(SSE4_2|AVX|AVX2|FMA|F16C|BMI|BMI2|AVX512F|AVX512BW|AVX512DQ|AVX512VL|AVX512CD)__ 1$/\1/p' |
  tr 'A-Z' 'a-z' | sed 's/^bmi$/bmi1/' | sort | tr '\n' ' ' || true)
# The TensorFlow it was built against: its ABI, which the loader checks as well.
tf_version=$("$python" -c 'import tensorflow as tf; print(tf.__version__)' 2>/dev/null)
printf 'march=%s\nfeatures=%s\ntensorflow=%s\n' "$march" "${features% }" "$tf_version" \
  > tf_hsm/_hsm_ops.cpu

# --- CUDA kernels (opt-in) ---------------------------------------------------------------
# TF_HSM_CUDA=1 also compiles the CUDA core (cc/core/*.cu) and every kernel file with
# GOOGLE_CUDA (the GPU functors in cc/kernels/*_gpu.cc, the GPU registrations), and installs
# the CPU+GPU library //cc:_hsm_ops_gpu.so as tf_hsm/_hsm_ops.so. Unset or 0: the
# CPU-only library above. Opt-in because the GPU kernels can only be run where a GPU and a
# GPU TensorFlow are (this project's build machines have neither; the CUDA core is checked
# there with cc/gpu_harness.sh --emulate and on GPU machines with cc/gpu_harness.sh).
#   TF_HSM_NVCC        nvcc to use (default: nvcc on PATH). Its CUDA runtime is linked
#                      statically, so the driver must support that CUDA version (13.x: R580+).
#   TF_HSM_CUDA_ARCHS  SM versions (default "80 90": A100, H100/H200; PTX of the last too).
case "${TF_HSM_CUDA:-0}" in
  1)
    nvcc="${TF_HSM_NVCC:-$(command -v nvcc || true)}"
    if [ -z "$nvcc" ] || [ ! -x "$nvcc" ]; then
      say "TF_HSM_CUDA=1 but nvcc was not found: set TF_HSM_NVCC"; exit 1
    fi
    archs="${TF_HSM_CUDA_ARCHS:-80 90}"
    say "building the GPU kernels with $nvcc for SM ${archs}"
    cuda_log=$(mktemp)
    if ! bazel build --noshow_progress "--define=TF_HSM_NVCC=$nvcc" \
        "--define=TF_HSM_CUDA_ARCHS=$(echo "$archs" | tr -s ' ' ',')" //cc:_hsm_ops_gpu.so \
        >"$cuda_log" 2>&1; then
      grep -vE '^(INFO|Loading|Analyzing)' "$cuda_log" || true; rm -f "$cuda_log"
      say "the GPU build failed (bazel build //cc:_hsm_ops_gpu.so)"; exit 1
    fi
    rm -f "$cuda_log"
    install -m 0755 bazel-bin/cc/_hsm_ops_gpu.so tf_hsm/_hsm_ops.so
    ;;
  0)
    if command -v nvcc >/dev/null; then
      say "nvcc found; GPU kernels not built (TF_HSM_CUDA=1 ./configure.sh builds them)"
    fi
    ;;
  *) say "TF_HSM_CUDA must be 0 or 1, got '${TF_HSM_CUDA}'"; exit 1 ;;
esac
# --- end of CUDA kernels ----------------------------------------------------------------

# Make `import tf_hsm` work from any directory in this environment (a .pth entry for
# this checkout, so rebuilds need no reinstall).
site=$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if [ "$root" != "$(cat "$site/tf_hsm.pth" 2>/dev/null)" ]; then
  printf '%s\n' "$root" > "$site/tf_hsm.pth"
fi

(cd / && "$python" -c "import tf_hsm, tf_hsm.ops.loader as l; l.ops()") 2>/dev/null \
  && say "ready: $python -c 'import tf_hsm'" \
  || { say "the library was built but does not load"; "$python" -c "import tf_hsm.ops.loader as l; l.ops()"; exit 1; }

# --- The wheel (--wheel) -----------------------------------------------------------------
if [ "$wheel" = 1 ]; then
  say "building the wheel (library for -march=$march)"
  # setuptools stages the package in build/lib.<platform>-<python>: what a module left
  # there from an earlier build would ship again.
  rm -rf build/lib build/lib.* build/bdist.*
  "$python" -m pip wheel -q --no-deps --no-build-isolation -w dist . \
    || { say "the wheel build failed (pip wheel . )"; exit 1; }
  say "wrote $(ls -t dist/tf_hsm-*.whl | head -n 1)"
fi
