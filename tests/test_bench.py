"""python -m tf_hsm.bench end to end on a tiny custom case, in subprocesses."""

import json
import os
import subprocess
import sys

import pytest

from tf_hsm import _bench_setup as setup

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bench(tmp_path, *args, timeout=150):
  env = dict(os.environ, PYTHONPATH=_ROOT, TF_CPP_MIN_LOG_LEVEL="2")
  proc = subprocess.run(
      [sys.executable, "-m", "tf_hsm.bench", "--out", str(tmp_path), *args],
      cwd=_ROOT, env=env, capture_output=True, text=True, timeout=timeout)
  assert proc.returncode == 0, proc.stderr[-3000:]
  with open(tmp_path / "bench.json") as f:
    report = json.load(f)
  markdown = (tmp_path / "bench.md").read_text()
  return proc, report, markdown


def test_tiny_custom_case_reports_every_method(tmp_path):
  proc, report, markdown = _bench(
      tmp_path, "--custom", "300,8,32", "--trees", "huffman", "--repeats",
      "10", "--time-budget", "10", "--num-sampled", "16")
  assert [c["tree"] for c in report["cases"]] == ["huffman"]
  for case in report["cases"]:
    assert case["ceilings"]["matmul_gflops"] > 0 and case["ceilings"]["read_gbps"] > 0
    assert case["work"]["sum_k"] > 0 and case["work"]["rows"] > 0
    assert set(case["methods"]) == set(setup.TRAIN_METHODS)
    for name, row in case["methods"].items():
      assert row["status"] == "ok", (name, row)
      for kind in ("fwd", "step", "step_loop"):
        assert row[kind]["n"] == 10 and 0 < row[kind]["min"] <= row[kind]["median"], name
      assert row["rates"]["step_loop"]["tokens_per_s"] > 0
      assert row["memory"]["status"] == "ok"
      assert row["memory"]["peak_rss"] >= row["memory"]["baseline_rss"] > 0
      assert row["rates"]["step"]["tokens_per_s"] > 0
      if name == setup.NLL_LOSS:  # a tf_hsm variant, compared with tf_hsm
        assert row["faster_than_tf_hsm"]["step"] > 0
      elif name != "tf_hsm":
        assert row["tf_hsm_speedup"]["step"] > 0
  for name in setup.TRAIN_METHODS:
    assert f"| {name} | ok |" in markdown
  assert markdown.strip() in proc.stdout
  with open(tmp_path / "bench.png", "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("spawn", ["fork", "exec"])
def test_out_of_memory_is_a_result(tmp_path, spawn):
  _, report, markdown = _bench(
      tmp_path, "--custom", "200,4,16", "--methods", "gather", "full_softmax",
      "--memory-limit-gb", "0.01", "--spawn", spawn, "--no-plot")
  (case,) = report["cases"]
  assert set(case["methods"]) == {"tf_hsm", "gather", "full_softmax"}
  for row in case["methods"].values():
    assert row["status"] == "OOM" and row["memory"]["status"] == "OOM"
    assert "limit" in row["message"]
  assert markdown.count("**OOM**") == 3


def test_bad_arguments_exit_with_usage_error(tmp_path):
  env = dict(os.environ, PYTHONPATH=_ROOT, TF_CPP_MIN_LOG_LEVEL="2")
  proc = subprocess.run([sys.executable, "-m", "tf_hsm.bench", "--scenario", "Z"],
                        cwd=_ROOT, env=env, capture_output=True, text=True, timeout=60)
  assert proc.returncode == 2 and "unknown scenario" in proc.stderr


def test_methods_named_on_the_command_line_are_run():
  # The fused SGD step is not among a custom scenario's default methods; naming it
  # must add it (with tf_hsm, the reference), not silently drop it.
  from tf_hsm import bench
  args = bench.parse_args(["--custom", "300,8,32", "--methods", setup.FUSED_SGD])
  (case,) = bench.expand_cases(bench._scenarios(args), args, "/nonexistent",
                               bench.options_from_args(args))
  assert case["methods"] == ["tf_hsm", setup.FUSED_SGD]


def test_every_optimizer_choice_is_built_and_the_memory_scenario_takes_one():
  import keras  # pylint: disable=import-outside-toplevel
  from tf_hsm import _bench_methods, optimizers  # pylint: disable=import-outside-toplevel
  for choice in ("sgd", "sgd_momentum", "adagrad", "adam", "sparse_sgd",
                 "sparse_sgd_momentum", "lazy_adam", "sparse_adagrad"):
    assert choice in setup.OPTIMIZER_SLOTS
    optimizer = _bench_methods.make_optimizer(choice)
    assert isinstance(optimizer, keras.optimizers.Optimizer), choice
    assert (getattr(optimizer, "momentum", 0) == 0.9) == choice.endswith("_momentum")
  assert isinstance(_bench_methods.make_optimizer("sparse_sgd"), optimizers.SparseSGD)
  # The memory scenario's step applies --optimizer, Keras' SGD when none is named; the
  # fused SGD step always its own SGD.
  assert setup.step_optimizer("mem", "tf_hsm", "none") == "sgd"
  assert setup.step_optimizer("mem", "tf_hsm", "sparse_sgd") == "sparse_sgd"
  assert setup.step_optimizer("train", "tf_hsm", "none") == "none"
  assert setup.step_optimizer("train", setup.FUSED_SGD, "lazy_adam") == "sgd"
