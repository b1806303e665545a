"""Builds the standalone CUDA harness (cc/gpu_harness.sh) and runs the CUDA kernels in its
host emulator, so the GPU code is compiled and executed on machines without a GPU.

- test_harness_compiles: nvcc builds the kernels (SM 80 and 90), the harness and the CPU
  core it compares against; skipped when nvcc is missing.
- test_kernels_in_emulator: the same kernel source built by the host compiler with
  cc/tests/gpu_emulation.cuh (every CUDA thread a fiber) and checked against the CPU core
  on the quick cases, under three thread schedules; needs only g++.
- test_widened_chunks_in_emulator: the wide cases again, built with the knob that widens a
  node's chunks set small, so that the path very wide nodes take at full size runs.
- test_host_plans_without_gpu: --plan-only, the host side of a call timed at full size.
- test_timing_code_in_emulator: --time-only on shrunk scenarios, training and inference.
- test_harness_on_gpu: the real thing, when a GPU and nvcc are present.
Neither TensorFlow nor PyTorch is involved.
"""

import os
import shutil
import subprocess

import pytest

import support

ROOT = support.REPO
SCRIPT = os.path.join(ROOT, "cc", "gpu_harness.sh")


def _nvcc():
  return os.environ.get("TF_HSM_NVCC") or shutil.which("nvcc")


def _run(args, timeout, **env):
  result = support.run([SCRIPT] + args, timeout, cwd=ROOT, env=dict(os.environ, **env),
                       check=False)
  print(result.stdout[-4000:])
  print(result.stderr[-4000:])
  return result


def _run_clean(args, timeout, **env):
  """Runs the harness and asserts that it succeeded with no failed check."""
  result = _run(args, timeout, **env)
  assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
  assert ", 0 failed" in result.stdout
  return result


needs_host_compiler = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None,
                                         reason="no host C++ compiler")


@pytest.mark.slow
@pytest.mark.skipif(_nvcc() is None, reason="nvcc not found")
def test_harness_compiles():
  result = _run(["--compile-only"], timeout=600)
  assert result.returncode == 0, result.stderr[-4000:]
  assert os.path.exists(os.path.join(ROOT, "build", "gpu_harness", "gpu_harness_cuda"))


@pytest.mark.slow
@needs_host_compiler
def test_kernels_in_emulator():
  _run_clean(["--emulate", "--quick"], timeout=900)


@pytest.mark.slow
@needs_host_compiler
def test_widened_chunks_in_emulator():
  # At full size a node's chunks widen past 256 of them (32,768 children: a 1M-class flat
  # tree); with at most 4 the quick cases' wide nodes of 1,100-1,500 children widen theirs.
  result = _run_clean(
      ["--emulate", "--quick", "--only", "wide"], timeout=900,
      TF_HSM_NVCC_FLAGS="-DTF_HSM_GPU_MAX_CHUNKS=4",
      TF_HSM_HARNESS_DIR=os.path.join(ROOT, "build", "gpu_harness_small_chunks"))
  for case in ("wide_root", "flat_wide_group"):
    assert "[PASS] " + case in result.stdout, case


def _host_plan_line(case):
  """--plan-only's line for one timing scenario: the host side of a call at its full size
  (visit plan, work lists, workspaces); no kernel runs."""
  result = _run_clean(["--emulate", "--plan-only", "--only", case, "--repeats", "1"],
                      timeout=900)
  lines = [l for l in result.stdout.splitlines() if case in l]
  assert len(lines) == 1, result.stdout[-4000:]
  return lines[0]


@pytest.mark.slow
@needs_host_compiler
def test_host_plans_without_gpu():
  # Every class of the 317-group two-level tree is two levels down: 2 entries a token.
  line = _host_plan_line("B_two_level_317_T640")
  assert "entries=1280 " in line, line


@pytest.mark.slow
@needs_host_compiler
def test_flat_million_classes_workspace_is_bounded():
  # Tree.flat(1M) at T=3,200, D=300: the forward keeps 253 partials a visit (not 7,813:
  # ~6.5 MB), the backward its 256 MB coefficient budget plus the work lists, in one
  # log-sum-exp wave and 48 blocks of children (its logits alone would be 12.8 GB).
  line = _host_plan_line("F_flat_V1M_T3200")
  words = line.split()
  forward_mb = float(words[words.index("forward") + 1])
  backward_mb = float(words[words.index("backward") + 1])
  assert forward_mb < 10, line
  assert 268 < backward_mb < 300, line
  assert "in 49 waves" in line, line


@pytest.mark.slow
@needs_host_compiler
def test_timing_code_in_emulator():
  # The timing path on scenarios shrunk 32x (times meaningless): every training and
  # inference case runs, its outputs poisoned and guarded, and prints its line.
  result = _run_clean(["--emulate", "--time-only"], timeout=900)
  for case in ("B_two_level_317_T4096", "C_two_level_891_T2560", "infer_two_level_1000_V1M",
               "infer_huffman_V1M", "infer_two_level_317_V100K"):
    assert case in result.stdout, case


def _has_gpu():
  smi = shutil.which("nvidia-smi")
  if smi is None:
    return False
  return subprocess.run([smi, "-L"], capture_output=True).returncode == 0


@pytest.mark.slow
@pytest.mark.skipif(_nvcc() is None or not _has_gpu(), reason="needs nvcc and a CUDA GPU")
def test_harness_on_gpu():
  _run_clean(["--quick"], timeout=900)
