"""The GPU build of the op library (`TF_HSM_CUDA=1 ./configure.sh`'s Bazel target) compiles,
loads into TensorFlow, and registers a GPU kernel for every op that the Python layer runs
on a GPU; the ops without one are exactly those it never places there. So a GPU build
cannot break, or lose a kernel, unseen on machines without a GPU.

The library is built once per session (`bazel build //cc:_hsm_ops_gpu.so`, incremental
after the first time) and loaded in a process of its own: the CPU library the other tests
load registers the same ops, and TensorFlow refuses an op registered twice.
"""

import json
import os
import shutil
import sys
import textwrap

import pytest

import support

ROOT = support.REPO

# Ops with GPU kernels, float32 and float64 each.
GPU_KERNELS = {"Hsm>LogProb", "Hsm>LogProbGrad", "Hsm>LogProbCandidates", "Hsm>TopK",
               "Hsm>LogProbAll", "Hsm>Sample"}
# Ops without one, and what tf_hsm runs instead where a GPU is visible or the table is
# on one (tf_hsm/ops/training.py, tf_hsm/frontend/rows.py).
CPU_ONLY = {
    "Hsm>LogProbSavingLogits": "log_prob calls Hsm>LogProb where a GPU is visible",
    "Hsm>LogProbGradFromLogits": "only the gradient of Hsm>LogProbSavingLogits",
    "Hsm>LogProbAndGrad": "nll_loss calls Hsm>LogProb where a GPU is visible",
    "Hsm>SgdStep": "sgd_step on a table off the CPU: sgd_step_from_gradient",
    "Hsm>AdamStep": "adam_step on a table off the CPU: log_prob's gradient and LazyAdam",
    "Hsm>AdamStepFromLogits": "fused_update with a table off the CPU: log_prob's gradient",
    "Hsm>SparseAdamRows": "rows.fused_ops: gathers and scatters off the CPU",
    "Hsm>SparseAdagradRows": "rows.fused_ops: gathers and scatters off the CPU",
    "Hsm>SparseSgdRows": "rows.fused_ops: gathers and scatters off the CPU",
}

_LIST_KERNELS = textwrap.dedent("""
    import json, sys
    import tensorflow as tf
    from tensorflow.core.framework import op_def_pb2
    from tensorflow.python.client import pywrap_tf_session
    from tensorflow.python.framework import kernels
    tf.load_op_library(sys.argv[1])  # as tf_hsm's loader loads it
    # The ops the library defines (the list tf.load_op_library makes its wrappers from).
    op_list = op_def_pb2.OpList()
    op_list.ParseFromString(pywrap_tf_session.TF_GetOpList(
        pywrap_tf_session.TF_LoadLibrary(sys.argv[1])))
    out = {}
    for op in op_list.op:
      out[op.name] = sorted(
          (k.device_type, ",".join(sorted(
              tf.as_dtype(c.allowed_values.list.type[0]).name
              for c in k.constraint if c.name == "T")))
          for k in kernels.get_registered_kernels_for_op(op.name).kernel)
    print("KERNELS " + json.dumps(out))
""")

def _nvcc():
  return os.environ.get("TF_HSM_NVCC") or shutil.which("nvcc")


@pytest.fixture(scope="session")
def gpu_library(tmp_path_factory):
  """The freshly built GPU library, copied out of Bazel's tree (a later build may
  replace it while the test reads it)."""
  bazel = shutil.which("bazel")
  if bazel is None or _nvcc() is None:
    pytest.skip("needs bazel and nvcc")
  defines = [f"--define=TF_HSM_NVCC={_nvcc()}", "--define=TF_HSM_CUDA_ARCHS=90"]
  support.run([bazel, "build", "--noshow_progress"] + defines + ["//cc:_hsm_ops_gpu.so"],
              timeout=1500, env=dict(os.environ))
  bin_dir = support.run([bazel, "info"] + defines + ["bazel-bin"], timeout=300,
                        env=dict(os.environ)).stdout.strip()
  copy = tmp_path_factory.mktemp("gpu_lib") / "_hsm_ops_gpu.so"
  shutil.copy(os.path.join(bin_dir, "cc", "_hsm_ops_gpu.so"), copy)
  return str(copy)


@pytest.fixture(scope="session")
def registered(gpu_library):
  """{op: [(device type, its T constraint)]} for every op the GPU library defines."""
  result = support.run([sys.executable, "-c", _LIST_KERNELS, gpu_library], timeout=300)
  line = [l for l in result.stdout.splitlines() if l.startswith("KERNELS ")]
  assert len(line) == 1, result.stdout[-2000:] + result.stderr[-4000:]
  return {op: [tuple(k) for k in kernels] for op, kernels in json.loads(line[0][8:]).items()}


def test_every_op_is_accounted_for(registered):
  assert set(registered) == GPU_KERNELS | set(CPU_ONLY)
  assert not GPU_KERNELS & set(CPU_ONLY)


def test_gpu_kernels_registered(registered):
  for op in sorted(GPU_KERNELS):
    gpu = sorted({t for device, t in registered[op] if device == "GPU"})
    assert gpu == ["float32", "float64"], (op, registered[op])


def test_cpu_only_ops_have_no_gpu_kernel(registered):
  # An op that gains a GPU kernel moves to GPU_KERNELS (and its Python fallback may go).
  for op in sorted(CPU_ONLY):
    assert not [k for k in registered[op] if k[0] == "GPU"], (op, CPU_ONLY[op])


def test_every_op_keeps_its_cpu_kernels(registered):
  for op, kernels in sorted(registered.items()):
    assert sorted({t for device, t in kernels if device == "CPU"}) == ["float32", "float64"], op

