"""Faults on a loopback ParameterServerStrategy cluster of processes
(tests/integration/fault_run.py): a worker killed with SIGKILL mid-training, a checkpoint of the
sharded table and slots restored into another number of shards and into one process,
and a lost parameter server, after which training resumes from the checkpoint.

Each phase runs in a subprocess bounded in time; the servers it starts die with it
(`tf_hsm.cluster.LoopbackCluster`)."""

import json
import os

import numpy as np
import pytest

import support

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "fault_run.py")


def _run(*args):
  support.run([SCRIPT, *args], timeout=300)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  directory = tmp_path_factory.mktemp("faults")
  _run("train", directory, directory / "train.json")
  train = json.loads((directory / "train.json").read_text())
  results = {"train": train}
  for num_ps in (3, 0):
    out = directory / f"resume{num_ps}.json"
    _run("resume", train["ckpt"], out, num_ps)
    results[num_ps] = json.loads(out.read_text())
  return results


@pytest.mark.slow
def test_training_goes_on_after_a_worker_is_killed(runs):
  losses = runs["train"]["losses"]
  assert len(losses) == 40  # every step scheduled after the kill ran on the other worker
  assert np.mean(losses[-5:]) < 0.5 * np.mean(losses[:5])


@pytest.mark.slow
def test_a_lost_parameter_server_is_an_error_not_silent(runs):
  assert runs["train"]["after_ps_loss"] != "no error"


@pytest.mark.slow
@pytest.mark.parametrize("num_ps", [3, 0])
def test_checkpoint_restores_into_other_shard_counts(runs, num_ps):
  restored = runs[num_ps]
  assert runs["train"]["pieces"] == 2
  assert restored["pieces"] == (3 if num_ps else 1)
  np.testing.assert_array_equal(restored["eval"], runs["train"]["eval"])
  assert restored["iterations"] == runs["train"]["iterations"]


@pytest.mark.slow
def test_training_resumes_from_the_checkpoint(runs):
  first = runs["train"]["losses"]
  resumed = runs[3]["losses"]
  assert resumed[0] < 0.5 * np.mean(first[:5])  # not re-initialised
  assert resumed[-1] <= resumed[0]
  np.testing.assert_allclose(resumed, runs[0]["losses"], rtol=1e-5)
