"""tf_keras `model.fit` training tf_hsm.tf_keras.HierarchicalSoftmax on clusters of
processes on 127.0.0.1 (tf_keras_fit_run.py, each run a subprocess bounded in time):
ParameterServerStrategy (2 PS + 2 workers, table and slots in pieces, a balanced row
layout, a worker killed after epoch 2 of 4, a checkpoint restored into one process),
MultiWorkerMirroredStrategy over 2 worker processes, MirroredStrategy over 2 devices."""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

import support

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "tf_keras_fit_run.py")
STEPS = 32  # EPOCHS x STEPS of tf_keras_fit_run.py


def _json(result):
  return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def ps(tmp_path_factory):
  ckpt = str(tmp_path_factory.mktemp("ckpt") / "ckpt")
  env = support.repo_env(TF_HSM_CKPT=ckpt, TF_HSM_KILL_WORKER="1")
  cluster = _json(support.run([SCRIPT, "ps"], timeout=300, env=env))
  single = _json(support.run([SCRIPT, "single", STEPS], timeout=120))
  restored = _json(support.run([SCRIPT, "single", 0, ckpt], timeout=120))
  return cluster, single, restored


@pytest.mark.slow
def test_ps_fit_trains_and_equals_one_process(ps):
  cluster, single, _ = ps
  assert cluster["losses"][-1] < cluster["losses"][0]
  for name in ("kernel", "bias"):
    start = np.array(single["initial"][name])
    np.testing.assert_array_equal(np.array(cluster["initial"][name]), start)
    got, want = np.array(cluster["final"][name]), np.array(single["final"][name])
    moved = np.linalg.norm(want - start)
    assert moved > 0.1
    # Asynchronous steps read weights up to a step stale: measured 1.6e-3 (kernel) and
    # 1.0e-3 (bias) of the distance the weights moved.
    assert np.linalg.norm(got - want) < 0.02 * moved, (name, np.linalg.norm(got - want),
                                                       moved)


@pytest.mark.slow
def test_ps_fit_moves_only_touched_rows_of_each_piece(ps):
  cluster, _, _ = ps
  servers = {"/job:ps/replica:0/task:0", "/job:ps/replica:0/task:1"}
  assert {d.split("/device")[0] for d in cluster["table_pieces"]} == servers
  table = [u for u in cluster["updates"] if u[0].startswith("hsm/")]
  assert table and all(kind == "IndexedSlices" for _, kind, _, _ in table), table
  assert {device.split("/device")[0] for _, _, device, _ in table} == servers
  # The balanced layout splits the batch's rows about evenly (tree order does not).
  rows = cluster["rows_per_shard"]
  assert max(rows) < 1.3 * min(rows) and sum(rows) < cluster["num_slots"]


@pytest.mark.slow
def test_ps_fit_survives_a_killed_worker(ps):
  cluster, _, _ = ps
  assert len(cluster["losses"]) == 4 and np.isfinite(cluster["losses"]).all()


@pytest.mark.slow
def test_ps_checkpoint_restores_into_one_process(ps):
  cluster, _, restored = ps
  for name in ("kernel", "bias"):
    np.testing.assert_array_equal(np.array(restored["restored"][name]),
                                  np.array(cluster["final"][name]))


def _free_ports(n):
  socks = [socket.socket() for _ in range(n)]
  for s in socks:
    s.bind(("127.0.0.1", 0))
  ports = [s.getsockname()[1] for s in socks]
  for s in socks:
    s.close()
  return ports


@pytest.mark.slow
def test_mwms_fit_equals_one_process_on_the_combined_batch():
  ports = ",".join(str(p) for p in _free_ports(2))
  processes = [subprocess.Popen([sys.executable, SCRIPT, "mwms", str(i), ports],
                                env=support.repo_env(), text=True, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE) for i in range(2)]
  outs = []
  try:
    for process in processes:
      out, err = process.communicate(timeout=240)
      assert process.returncode == 0, err[-3000:]
      outs.append(json.loads(out.strip().splitlines()[-1]))
  finally:
    for process in processes:
      if process.poll() is None:
        process.kill()
        process.communicate()
  mirrored = _json(support.run([SCRIPT, "mirrored"], timeout=180))
  one = mirrored["one"]
  for out in outs + [{"weights": mirrored["two"], "seen": mirrored["seen"]}]:
    assert all(kind == "IndexedSlices" for name, kind in out["seen"] if "hsm" in name)
    for name in ("kernel", "bias"):
      np.testing.assert_allclose(np.array(out["weights"][name]), np.array(one[name]),
                                 rtol=2e-5, atol=2e-6)
