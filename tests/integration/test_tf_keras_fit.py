"""tf_keras `model.fit` training tf_hsm.tf_keras.HierarchicalSoftmax on clusters of
processes on 127.0.0.1 (tf_keras_fit_run.py, each run a subprocess bounded in time):
ParameterServerStrategy (2 PS + 2 workers, table and slots in pieces, a balanced row
layout, a worker killed after epoch 2 of 4, a checkpoint restored into one process;
then LazyAdam under BackupAndRestore, its backup of 2 pieces resumed on 3 PS and in one
process; an AdaptiveSoftmax with two-level tails trained by LazyAdam on both workers,
and on 3 PS + 1 worker; a HierarchicalSoftmaxMixture on both workers and on 3 PS + 1
worker),
MultiWorkerMirroredStrategy over 2 worker processes (the three layers),
MirroredStrategy over 2 devices."""

import json
import os
import shutil
import socket
import subprocess
import sys

import numpy as np
import pytest

import support

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "tf_keras_fit_run.py")
STEPS = 32  # EPOCHS x STEPS of tf_keras_fit_run.py
ADAM_STEPS = 16  # ADAM_EPOCHS x STEPS of tf_keras_fit_run.py


def _json(result):
  return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def ps(tmp_path_factory):
  """The runs on 2 PS (one cluster for both trainings), then each resumption from a
  copy of the backup (BackupAndRestore overwrites it as it goes on)."""
  tmp = tmp_path_factory.mktemp("ps")
  ckpt, backup = str(tmp / "ckpt"), str(tmp / "backup")
  env = support.repo_env(TF_HSM_CKPT=ckpt, TF_HSM_KILL_WORKER="1", TF_HSM_BACKUP=backup)
  out = {"cluster": _json(support.run([SCRIPT, "ps"], timeout=300, env=env)),
         "single": _json(support.run([SCRIPT, "single", STEPS], timeout=120)),
         "restored": _json(support.run([SCRIPT, "single", 0, ckpt], timeout=120))}
  for num_ps, timeout in ((3, 240), (0, 120)):
    copy = str(tmp / f"backup_{num_ps}")
    shutil.copytree(backup, copy)
    out[f"resumed_{num_ps}"] = _json(support.run([SCRIPT, "resume", num_ps, copy],
                                                 timeout=timeout))
  return out


@pytest.mark.slow
def test_ps_fit_trains_and_equals_one_process(ps):
  cluster, single = ps["cluster"], ps["single"]
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
  cluster = ps["cluster"]
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
  cluster = ps["cluster"]
  assert len(cluster["losses"]) == 4 and np.isfinite(cluster["losses"]).all()


@pytest.mark.slow
def test_ps_checkpoint_restores_into_one_process(ps):
  cluster, restored = ps["cluster"], ps["restored"]
  for name in ("kernel", "bias", "dense_kernel", "dense_bias"):
    np.testing.assert_array_equal(np.array(restored["restored"][name]),
                                  np.array(cluster["final"][name]))


@pytest.mark.slow
def test_ps_fit_makes_each_slot_on_its_server(ps):
  # tf_keras would compute each slot's zeros on the coordinator and send them whole (a
  # piece-sized temporary on both sides); tf_hsm's optimizers give a callable that runs
  # where the slot is placed.
  adam = ps["cluster"]["adam"]
  seen = {name: (computed, placed) for name, computed, placed in
          adam["slot_initial_values"]}
  servers = set()
  for slot in ("m", "v"):
    for piece in range(2):
      assert f"{slot}/hsm/kernel/part_{piece}" in seen, sorted(seen)
  for name, (computed, placed) in seen.items():
    assert "/job:ps/" in placed, (name, placed)
    assert computed == placed, (name, computed, placed)
    if "hsm/kernel" in name:
      servers.add(placed.split("/device")[0])
  assert len(servers) == 2, seen  # the table's pieces' slots on both servers


@pytest.mark.slow
@pytest.mark.parametrize("num_ps", [3, 0])
def test_ps_backup_resumes_in_another_number_of_pieces(ps, num_ps):
  """LazyAdam's fit backed up by BackupAndRestore with the table and slots in 2 pieces
  resumes on 3 parameter servers (num_ps=3) and in one process (0) with the weights,
  both moments and the iteration count it saved, and goes on training from them."""
  saved, resumed = ps["cluster"]["adam"], ps[f"resumed_{num_ps}"]
  servers = {d.split("/device")[0] for d in resumed["table_pieces"]}
  assert len(servers) == num_ps, resumed["table_pieces"]
  end, begin = saved["end"], resumed["begin"]
  assert begin["iterations"] == end["iterations"] > 0
  for name in ("kernel", "bias", "dense_kernel", "dense_bias"):
    np.testing.assert_array_equal(np.array(begin["weights"][name]),
                                  np.array(end["weights"][name]), err_msg=name)
  for slot in ("m", "v"):
    for name in ("kernel", "bias", "dense"):
      want = np.array(end["slots"][slot][name])
      assert np.count_nonzero(want) > 0, (slot, name)
      np.testing.assert_array_equal(np.array(begin["slots"][slot][name]), want,
                                    err_msg=f"{slot} of {name}")
  # The epochs after the backup's (2 of 4) ran, from where it stopped: the loss goes on
  # falling from the saved epochs' (4.0, 2.8 measured; 2.05, 1.53 after).
  assert len(resumed["losses"]) == 2 and np.isfinite(resumed["losses"]).all()
  assert resumed["losses"][0] < saved["losses"][-1] < saved["losses"][0]
  assert resumed["losses"][1] < resumed["losses"][0]
  assert resumed["end"]["iterations"] > begin["iterations"]


@pytest.mark.slow
def test_ps_backup_resumes_the_same_on_three_servers_and_in_one_process(ps):
  # One worker on 3 PS runs its steps in order, as one process does: the same state
  # restored (slots included) gives the same losses and weights.
  three, one = ps["resumed_3"], ps["resumed_0"]
  np.testing.assert_allclose(three["losses"], one["losses"], rtol=1e-5)
  for name in ("kernel", "bias"):
    np.testing.assert_allclose(np.array(three["end"]["weights"][name]),
                               np.array(one["end"]["weights"][name]), rtol=1e-4,
                               atol=1e-6, err_msg=name)


ADAPTIVE_BIG = ("head_kernel", "tail_kernel_0", "tail_bias_0", "tail_kernel_1",
                "tail_bias_1")


def _moved_and_off(run, single, name):
  start = np.array(single["initial"][name])
  np.testing.assert_array_equal(np.array(run["initial"][name]), start, err_msg=name)
  want = np.array(single["final"][name])
  return np.linalg.norm(want - start), np.linalg.norm(np.array(run["final"][name]) - want)


@pytest.mark.slow
def test_ps_fit_trains_adaptive_softmax_with_tables_in_pieces(ps):
  """tf_hsm.tf_keras.AdaptiveSoftmax (two-level tails, a class order leaving id 0 out)
  trained by LazyAdam with `fit` on the module's cluster (2 PS + 2 workers, before the
  HierarchicalSoftmax runs) and on 3 PS + 1 worker (the `resume` cluster), against one
  process running the same 24 steps on the same fixed batch.

  Tolerance. One worker runs its steps in order, so that run equals one process up to
  rounding (measured: the same losses, weights equal to 0 of the distance moved; the
  test allows 1e-4). Two workers differ from one process only by concurrency: a step
  reads weights up to a step stale, and, unlike SparseSGD's updates (which add to the
  variable: the HierarchicalSoftmax case measured 1.6e-3), Adam's read-modify-write of
  the variable and its moments by two workers at once can interleave. Over 4 runs of
  the 2-worker fit the final weights were 3.3e-3 to 1.06e-1 of the distance they moved
  away from one process's (L2 norms per weight; 3.0e-2 to 3.9e-2 at a rate of 0.003);
  the test allows 0.25: a piece that missed its updates or got them twice would be
  off by about the whole distance (half for one of two pieces)."""
  cluster, one_worker = ps["cluster"]["adaptive"], ps["resumed_3"]["adaptive"]
  single = ps["single"]["adaptive"]
  # The big tables (and the rest: FixedShardsPartitioner splits every variable) are in
  # pieces, one per server.
  for run, num_ps in ((cluster, 2), (one_worker, 3)):
    for name in ADAPTIVE_BIG:
      devices = {device.split("/device")[0] for device, _ in run["pieces"][name]}
      assert len(run["pieces"][name]) == num_ps and len(devices) == num_ps, (
          name, run["pieces"][name])
  # Two-level tails: each piece of a kernel and a bias receives a tf.IndexedSlices of
  # its touched rows, applied on its server; the head (a softmax over all its rows) and
  # the projections are read whole and receive dense gradients.
  updates = [u for u in cluster["updates"] if u[0].startswith("adaptive/")]
  for name in ADAPTIVE_BIG + ("tail_projection_0", "tail_projection_1"):
    mine = [u for u in updates if u[0].startswith(f"adaptive/{name}/part_")]
    assert len({u[0] for u in mine}) == 2, (name, mine)
    sparse = name.startswith(("tail_kernel", "tail_bias"))
    assert all((kind == "IndexedSlices") == sparse for _, kind, _, _ in mine), mine
    placed = {f"adaptive/{name}/part_{i}:0": device
              for i, (device, _) in enumerate(cluster["pieces"][name])}
    assert all(placed[u[0]] == u[2] for u in mine), (mine, placed)
  # The batch touches a part of each tail's rows (rows per half of the table): 45 + 31
  # of 89 and 67 + 33 of 214.
  sizes = [len(np.array(single["final"][f"tail_kernel_{i}"])) for i in range(2)]
  for rows, size in zip(cluster["tail_rows"], sizes):
    assert sum(rows) < size, (rows, size)
  # The loss falls (measured 5.4-5.8, 3.5-3.6, 2.4 over the 3 epochs; one process 5.42,
  # 3.51, 2.36) and the weights are one process's.
  assert one_worker["iterations"] == single["iterations"] == 24
  for run in (cluster, one_worker):
    assert run["losses"][-1] < 0.6 * run["losses"][0], run["losses"]
  np.testing.assert_allclose(one_worker["losses"], single["losses"], rtol=1e-5)
  for name in single["final"]:
    moved, off = _moved_and_off(one_worker, single, name)
    assert moved > 0.1 and off < 1e-4 * moved, (name, off, moved)
    moved, off = _moved_and_off(cluster, single, name)
    assert off < 0.25 * moved, (name, off, moved)


def _check_mixture_pieces(run, num_ps):
  """Each of the mixture's tables in num_ps pieces, one a server, and each tree's
  pieces updated by `tf.IndexedSlices` (the rows its batch touched) on their server."""
  for name in ("head_kernel", "dense_kernel", "tree_0_kernel", "tree_1_kernel"):
    servers = {device.split("/device")[0] for device in run["pieces"][name]}
    assert len(run["pieces"][name]) == num_ps and len(servers) == num_ps, (name, run["pieces"])
  trees = [u for u in run["updates"] if "/mixture_tree_" in u[0]]
  placed = {f"mixture/mixture_tree_{i}/{part}/part_{k}:0": device
            for i in range(2) for part in ("kernel", "bias")
            for k, device in enumerate(run["pieces"][f"tree_{i}_{part}"])}
  assert {u[0] for u in trees} == set(placed), trees  # 2 trees x (kernel, bias) x pieces
  assert all(kind == "IndexedSlices" for _, kind, _, _ in trees), trees
  assert all(placed[name] == device for name, _, device, _ in trees), (trees, placed)
  assert run["losses"][-1] < 0.6 * run["losses"][0], run["losses"]


@pytest.mark.slow
def test_ps_fit_trains_a_mixture_with_tables_in_pieces(ps):
  """tf_hsm.tf_keras.HierarchicalSoftmaxMixture (two Huffman trees below a shared head of
  20) trained by LazyAdam with `fit` on 3 PS + 1 worker (the `resume` cluster), against
  one process running the same 24 steps on the same fixed batch: every table in pieces
  on the servers, each tree's pieces updated by the rows its batch touched, and, the
  worker running its steps in order, one process's losses and weights (measured: equal
  to the bit)."""
  run, single = ps["resumed_3"]["mixture"], ps["single"]["mixture"]
  _check_mixture_pieces(run, 3)
  assert run["iterations"] == single["iterations"] == 24
  np.testing.assert_allclose(run["losses"], single["losses"], rtol=1e-5)
  for name in single["final"]:
    moved, off = _moved_and_off(run, single, name)
    assert moved > 0.1 and off < 1e-4 * moved, (name, off, moved)


@pytest.mark.slow
def test_ps_fit_trains_a_mixture_on_two_workers(ps):
  """The same mixture trained on the module's cluster (2 PS + 2 workers, both running):
  its tables in 2 pieces, updated as on 3 PS, and its weights one process's up to what
  two workers' concurrent Adam steps change (the AdaptiveSoftmax test's tolerance and
  its reasons: a piece that missed its updates or got them twice would be off by about
  the whole distance it moved; measured over two runs: 2.3e-3 to 8.7e-3 of it)."""
  run, single = ps["cluster"]["mixture"], ps["single"]["mixture"]
  _check_mixture_pieces(run, 2)
  assert run["iterations"] == single["iterations"] == 24
  for name in single["final"]:
    moved, off = _moved_and_off(run, single, name)
    assert off < 0.25 * moved, (name, off, moved)


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
    assert all(kind == "IndexedSlices" for name, kind, *_ in out["seen"] if "hsm" in name)
    for name in ("kernel", "bias"):
      np.testing.assert_allclose(np.array(out["weights"][name]), np.array(one[name]),
                                 rtol=2e-5, atol=2e-6)
  # The AdaptiveSoftmax (two-level tails, a class order) under MirroredStrategy and
  # MultiWorkerMirroredStrategy: its tree tails' gradients combined as IndexedSlices, the
  # weights those of one device on the combined batch.
  for seen, weights in [(mirrored["adaptive_seen"], mirrored["adaptive_two"])] + [
      (out["adaptive_seen"], out["adaptive"]) for out in outs]:
    seen = {name: kind for name, kind, *_ in seen}
    assert any("tail_kernel" in name for name in seen), seen
    assert all(kind == "IndexedSlices" for name, kind in seen.items()
               if "tail_kernel" in name or "tail_bias" in name), seen
    for name, value in mirrored["adaptive_one"].items():
      # float32 sums in another order: an absolute tolerance of the weights' scale.
      scale = np.abs(np.array(value)).max()
      np.testing.assert_allclose(np.array(weights[name]), np.array(value), rtol=2e-5,
                                 atol=2e-6 * max(scale, 1.0), err_msg=name)
  # The HierarchicalSoftmaxMixture (two trees below a shared head) likewise: its trees'
  # and head's gradients combined as IndexedSlices, one device's weights.
  for seen, weights in [(mirrored["mixture_seen"], mirrored["mixture_two"])] + [
      (out["mixture_seen"], out["mixture"]) for out in outs]:
    seen = {name: kind for name, kind, *_ in seen}
    trees = {name: kind for name, kind in seen.items() if "mixture_tree_" in name}
    tables = {name.split(":")[0].replace("/replica_1", "") for name in trees}
    assert len(tables) == 4 and set(trees.values()) == {"IndexedSlices"}, seen
    for name, value in mirrored["mixture_one"].items():
      scale = np.abs(np.array(value)).max()
      np.testing.assert_allclose(np.array(weights[name]), np.array(value), rtol=2e-5,
                                 atol=2e-6 * max(scale, 1.0), err_msg=name)
