"""A training loop with HierarchicalSoftmax and LazyAdam under
MultiWorkerMirroredStrategy, 2 worker processes on 127.0.0.1, against one process on the
combined batches
(tests/integration/mwms_worker.py). Every process started here is stopped here, also on failure."""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

import support

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "mwms_worker.py")


def _free_port():
  with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    return sock.getsockname()[1]


def _env(extra=None):
  env = support.repo_env()
  env.pop("TF_CONFIG", None)
  env.update(extra or {})
  return env


@pytest.mark.slow
def test_two_workers_equal_one_process_on_the_combined_batch(tmp_path):
  single = subprocess.run([sys.executable, SCRIPT, str(tmp_path / "single.npz"), "--single"],
                          env=_env(), capture_output=True, text=True, timeout=240)
  assert single.returncode == 0, single.stderr[-3000:]
  workers = [f"127.0.0.1:{_free_port()}" for _ in range(2)]
  processes = []
  try:
    for index in range(2):
      config = {"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}}
      processes.append(subprocess.Popen(
          [sys.executable, SCRIPT, str(tmp_path / "multi.npz")],
          env=_env({"TF_CONFIG": json.dumps(config)}), stdout=subprocess.PIPE,
          stderr=subprocess.PIPE, text=True))
    outputs = [process.communicate(timeout=240) for process in processes]
  finally:
    for process in processes:
      if process.poll() is None:
        process.kill()
        process.communicate()
  for process, (_, err) in zip(processes, outputs):
    assert process.returncode == 0, err[-3000:]
  one, two = np.load(tmp_path / "single.npz"), np.load(tmp_path / "multi.npz")
  assert "IndexedSlices" in two["gradient_kinds"]
  weights = sorted(key for key in one.files if key.startswith("w"))
  assert weights
  for key in weights:
    np.testing.assert_allclose(two[key], one[key], rtol=2e-5, atol=2e-6)
  np.testing.assert_allclose(two["loss"], one["loss"], rtol=2e-5)
