#!/usr/bin/env bash
# Builds the framework-agnostic core (cc/core/*.cc) and its C++ tests with AddressSanitizer
# and UndefinedBehaviorSanitizer, and runs the tests: any report fails the run.
#
#   cc/sanitize.sh            (after ./configure.sh, whose target flags it reuses)
#
# The core gets the flags the op library gives it (read from .tf_hsm.bazelrc: -march, the
# FMA-chain tuning), at -O1 so that the sanitizers see through inlining; the tests are
# the ones tests/integration/test_cc_core.py and test_cc_inference.py run, empty shapes and
# tampered trees included. Objects go to build/sanitize/.
set -euo pipefail
cd "$(dirname "$0")/.."
out=build/sanitize
mkdir -p "$out"

# The core's per-file flags, as configure.sh wrote them for Bazel (commas escaped as \\,
# inside an option, plain commas between options).
line=$(grep -o 'per_file_copt=cc/core/[^@]*@.*' .tf_hsm.bazelrc 2>/dev/null || true)
if [ -z "$line" ]; then
  echo "sanitize: .tf_hsm.bazelrc has no core flags: run ./configure.sh first" >&2
  exit 2
fi
core_flags=$(printf '%s' "${line#*@}" | sed 's/\\\\,/\x01/g; s/,/ /g; s/\x01/,/g')
common="-std=c++17 -O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined \
  -fno-sanitize-recover=all -I. $core_flags"

pids=()
for src in cc/core/*.cc cc/tests/core_test.cc cc/tests/inference_test.cc; do
  extra=""
  # As in cc/BUILD: the optimizers' row updates round each product on its own.
  [ "$src" = cc/core/sparse_rows.cc ] && extra="-fno-math-errno -ffp-contract=off"
  # shellcheck disable=SC2086
  g++ $common $extra -c "$src" -o "$out/$(basename "$src" .cc).o" &
  pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid"; done

core_objects=$(ls "$out"/*.o | grep -v -e '/core_test.o$' -e '/inference_test.o$')
status=0
for test in core_test inference_test; do
  # shellcheck disable=SC2086
  g++ $common $core_objects "$out/$test.o" -lpthread -o "$out/$test"
  echo "== $test under ASan + UBSan"
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=0 UBSAN_OPTIONS=print_stacktrace=1 \
    "$out/$test" || status=1
done
exit $status
