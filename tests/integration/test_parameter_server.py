"""Training under ParameterServerStrategy with the table and the optimizers' slots sharded
on 2 parameter servers of a loopback cluster (tests/integration/ps_cluster_run.py, run in a
subprocess of its own that this test bounds in time and always ends)."""

import json
import os

import numpy as np
import pytest

import support

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def report():
  result = support.run([os.path.join(HERE, "ps_cluster_run.py")], timeout=300)
  return json.loads(result.stdout)


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["lazy_adam", "sparse_adagrad", "sparse_sgd"])
def test_cluster_training_equals_one_process(report, optimizer):
  local, cluster = report["local"][optimizer], report["cluster"][optimizer]
  np.testing.assert_allclose(cluster["losses"], local["losses"], rtol=1e-6)
  np.testing.assert_allclose(cluster["kernel"], local["kernel"], rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(cluster["bias"], local["bias"], rtol=1e-6, atol=1e-7)
  assert cluster["losses"][-1] < cluster["losses"][0]


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["lazy_adam", "sparse_adagrad", "sparse_sgd"])
def test_table_and_slots_are_split_over_both_servers(report, optimizer):
  placement = report["cluster"][optimizer]["placement"]
  assert {device.split("/device")[0] for device in placement["table"]} == {
      "/job:ps/replica:0/task:0", "/job:ps/replica:0/task:1"}
  assert placement["slots"], "no slot in pieces"
  for devices, rows in zip(placement["slots"], placement["slot_rows"]):
    if len(rows) == len(placement["table_rows"]) and rows == placement["table_rows"]:
      assert devices == placement["table"]  # slot piece i beside table piece i


@pytest.mark.slow
def test_plain_ops_train_a_sharded_variable(report):
  assert report["plain_ops"]["table_type"] == "ShardedVariable"
  losses = report["plain_ops"]["losses"]
  assert losses[-1] < losses[0]


@pytest.mark.slow
def test_layer_draws_each_piece_of_its_table_where_it_lives(report):
  init = report["layer_init"]
  limit = init["limit"]
  for max_abs, std in zip(init["max_abs"], init["std"]):
    assert max_abs <= limit
    np.testing.assert_allclose(std, limit / np.sqrt(3.0), rtol=0.02)
  assert not init["first_rows_equal"]
  assert init["bias"] == [0.5, 0.5]
