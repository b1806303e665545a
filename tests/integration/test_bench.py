"""python -m tf_hsm.bench end to end on a tiny custom case, in subprocesses."""

import json
import os
import subprocess
import sys

import pytest

from tf_hsm.bench import cases

import support

_ROOT = support.REPO


def _bench(tmp_path, *args, timeout=600):
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
      "10", "--time-budget", "10", "--num-sampled", "16", "--methods",
      *cases.TRAIN_METHODS, cases.KERAS_STEP)
  methods = cases.TRAIN_METHODS + (cases.KERAS_STEP,)
  assert [c["tree"] for c in report["cases"]] == ["huffman"]
  for case in report["cases"]:
    assert case["ceilings"]["matmul_gflops"] > 0 and case["ceilings"]["read_gbps"] > 0
    assert case["work"]["sum_k"] > 0 and case["work"]["rows"] > 0
    assert set(case["methods"]) == set(methods)
    for name, row in case["methods"].items():
      assert row["status"] == "ok", (name, row)
      for kind in ("fwd", "step", "step_loop"):
        assert row[kind]["n"] == 10 and 0 < row[kind]["min"] <= row[kind]["median"], name
      assert row["rates"]["step_loop"]["tokens_per_s"] > 0
      assert row["memory"]["status"] == "ok"
      assert row["memory"]["peak_rss"] >= row["memory"]["baseline_rss"] > 0
      assert row["rates"]["step"]["tokens_per_s"] > 0
      if name in (cases.NLL_LOSS, cases.KERAS_STEP):  # tf_hsm variants
        assert row["faster_than_tf_hsm"]["step"] > 0
      elif name != "tf_hsm":
        assert row["tf_hsm_speedup"]["step"] > 0
  for name in methods:
    assert f"| {name} | ok |" in markdown
  assert "train_on_batch (+sparse_sgd) " in markdown
  assert markdown.strip() in proc.stdout
  with open(tmp_path / "bench.png", "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_float64_case_computes_and_measures_in_float64(tmp_path):
  # --dtype float64: every method's inputs, tables and outputs are float64 (the Keras
  # layer's too), the ceilings are measured in float64, and the report says so.
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  from tf_hsm.bench import methods as bench_methods  # pylint: disable=import-outside-toplevel
  methods = ("tf_hsm", cases.NLL_LOSS, cases.FUSED_SGD, cases.FUSED_ADAM, "gather",
             "full_softmax", "sampled_softmax")
  _, report, markdown = _bench(
      tmp_path, "--custom", "300,8,32", "--trees", "huffman", "--repeats", "3",
      "--time-budget", "10", "--num-sampled", "16", "--no-memory", "--no-plot",
      "--dtype", "float64", "--methods", *methods)
  (case,) = report["cases"]
  assert report["meta"]["dtype"] == case["dtype"] == "float64"
  assert {name: row["status"] for name, row in case["methods"].items()} == {
      name: "ok" for name in methods}
  assert "Huffman-2 · float64" in markdown
  tree_path = str(tmp_path / "tree.npz")
  cases.prepare_tree("huffman", 300, tree_path)
  spec = {"scenario": "custom", "kind": "train", "vocab": 300, "dim": 8, "tokens": 32,
          "tree": "huffman", "tree_path": tree_path, "seed": 3, "num_sampled": 16,
          "k": 10, "dtype": "float64"}
  inputs = bench_methods.CaseInputs(spec, list(methods) + [cases.KERAS_STEP])
  assert inputs.hidden.dtype == tf.float64
  assert inputs.keras_model.layers[-1].kernel.dtype == "float64"
  for name in methods + (cases.KERAS_STEP,):
    assert all(v.dtype == tf.float64 for v in inputs.tables(name)), name
    out = bench_methods.Method(name, inputs, spec).fwd()
    assert tf.nest.flatten(out)[0].dtype == tf.float64, name
  ceilings = bench_methods.measure_ceilings(quick=True, repeats=1, dtype="float64")
  assert ceilings["matmul_gflops"] > 0 and ceilings["read_mb"] == 64


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
  # The fused SGD step and the Keras step are not among a custom scenario's default
  # methods; naming them must add them (with tf_hsm, the reference), not silently drop
  # them.
  from tf_hsm.bench import cli, runner  # pylint: disable=import-outside-toplevel
  for named, expected in (
      ([cases.FUSED_SGD], ["tf_hsm", cases.FUSED_SGD]),
      ([cases.KERAS_STEP, "gather"], ["tf_hsm", cases.KERAS_STEP, "gather"]),
      ([cases.KERAS_STEP, cases.FUSED_SGD],
       ["tf_hsm", cases.FUSED_SGD, cases.KERAS_STEP]),
      ([cases.FUSED_ADAM, "sampled_softmax"],
       ["tf_hsm", cases.FUSED_ADAM, "sampled_softmax"])):
    args = cli.parse_args(["--custom", "300,8,32", "--methods", *named])
    (case,) = runner.expand_cases(cli._scenarios(args), args, "/nonexistent",
                                  cli.options_from_args(args))
    assert case["methods"] == expected, named
  # Scenario E lists both by default.
  args = cli.parse_args(["--scenario", "E"])
  (case,) = runner.expand_cases(cli._scenarios(args), args, "/nonexistent",
                                cli.options_from_args(args))
  assert {cases.FUSED_SGD, cases.KERAS_STEP} <= set(case["methods"])


@pytest.mark.parametrize("optimizer", ["none", "lazy_adam"])
def test_keras_step_trains_the_layer_of_the_case(tmp_path, optimizer):
  # The Keras method's forward is the layer's log-probabilities of the case's targets,
  # and its step is a real training step: the optimizer named (SparseSGD when none is),
  # the touched rows of the table change and the loss on the batch falls.
  import numpy as np  # pylint: disable=import-outside-toplevel
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  from tf_hsm import ops
  from tf_hsm.keras import optimizers  # pylint: disable=import-outside-toplevel
  from tf_hsm.bench import methods as bench_methods  # pylint: disable=import-outside-toplevel
  tree_path = str(tmp_path / "tree.npz")
  cases.prepare_tree("huffman", 300, tree_path)
  spec = {"scenario": "custom", "kind": "train", "vocab": 300, "dim": 8, "tokens": 64,
          "tree": "huffman", "tree_path": tree_path, "seed": 3, "num_sampled": 16,
          "k": 10, "optimizer": optimizer}
  inputs = bench_methods.CaseInputs(spec, ["tf_hsm", cases.KERAS_STEP])
  method = bench_methods.Method(cases.KERAS_STEP, inputs, spec)
  expected = {"none": optimizers.SparseSGD, "lazy_adam": optimizers.LazyAdam}[optimizer]
  assert type(method.optimizer) is expected  # pylint: disable=unidiomatic-typecheck
  layer = inputs.keras_model.layers[-1]
  kernel = layer.kernel.numpy()
  log_probs = method.fwd().numpy()
  reference = ops.log_prob(inputs.hidden, layer.kernel, layer.bias, inputs.tree,
                           inputs.targets).numpy()
  np.testing.assert_allclose(log_probs, reference, rtol=1e-6, atol=1e-6)
  assert np.isclose(-log_probs.mean(), method.step(), rtol=1e-5)
  method.optimizer.learning_rate.assign(0.05)
  for _ in range(5):
    loss = method.step()
  assert loss < -log_probs.mean()
  with tf.GradientTape() as tape:
    total = tf.reduce_sum(ops.log_prob(inputs.hidden, layer.kernel, layer.bias,
                                       inputs.tree, inputs.targets))
  touched = np.unique(tape.gradient(total, layer.kernel).indices.numpy())
  changed = np.flatnonzero(np.any(layer.kernel.numpy() != kernel, axis=1))
  np.testing.assert_array_equal(changed, touched)


def test_every_optimizer_choice_is_built_and_the_memory_scenario_takes_one():
  import keras  # pylint: disable=import-outside-toplevel
  from tf_hsm.keras import optimizers  # pylint: disable=import-outside-toplevel
  from tf_hsm.bench import methods as bench_methods  # pylint: disable=import-outside-toplevel
  for choice in ("sgd", "sgd_momentum", "adagrad", "adam", "sparse_sgd",
                 "sparse_sgd_momentum", "lazy_adam", "sparse_adagrad"):
    assert choice in cases.OPTIMIZER_SLOTS
    optimizer = bench_methods.make_optimizer(choice)
    assert isinstance(optimizer, keras.optimizers.Optimizer), choice
    assert (getattr(optimizer, "momentum", 0) == 0.9) == choice.endswith("_momentum")
  assert isinstance(bench_methods.make_optimizer("sparse_sgd"), optimizers.SparseSGD)
  # The memory scenario's step applies --optimizer, Keras' SGD when none is named; the
  # fused SGD step always its own SGD.
  assert cases.step_optimizer("mem", "tf_hsm", "none") == "sgd"
  assert cases.step_optimizer("mem", "tf_hsm", "sparse_sgd") == "sparse_sgd"
  assert cases.step_optimizer("train", "tf_hsm", "none") == "none"
  assert cases.step_optimizer("train", cases.FUSED_SGD, "lazy_adam") == "sgd"


def test_methods_that_do_not_fit_together_are_timed_apart(monkeypatch, tmp_path):
  # Without the memory probes (--no-memory) all methods share one timing process. When it
  # runs out of memory, the method dropped from it must still be timed in a process of its
  # own, and be reported out of memory only if it does not fit alone. Here the fake
  # children cannot hold tf_hsm's shared table and the fused step's own table together,
  # and `gather` never fits.
  from tf_hsm.bench import cli, runner, watchdog  # pylint: disable=import-outside-toplevel
  calls = []

  def fake_run_children(specs, *unused_args):
    ((_, spec, _),) = specs
    methods = spec["methods"]
    calls.append(list(methods))
    if "gather" in methods or {"tf_hsm", cases.FUSED_SGD} <= set(methods):
      return [{"status": "OOM", "message": "RSS passed the limit"}]
    return [{"status": "ok", "ceilings": {}, "methods": {m: {"median_ms": 1.0} for m in methods}}]

  monkeypatch.setattr(watchdog, "run_children", fake_run_children)
  args = cli.parse_args(["--custom", "300,8,32", "--no-memory", "--methods",
                         cases.NLL_LOSS, cases.FUSED_SGD, "gather"])
  opts = cli.options_from_args(args)
  (case,) = runner.expand_cases(cli._scenarios(args), args, "/nonexistent", opts)
  case["tree_summary"] = {"num_slots": 299, "max_depth": 9, "max_branching": 2}
  rows = {name: {"status": "ok"} for name in case["methods"]}
  runner.time_group(case, case["methods"], rows, str(tmp_path), opts, lambda *a: None)

  for name in ("tf_hsm", cases.NLL_LOSS, cases.FUSED_SGD):
    assert rows[name] == {"status": "ok", "median_ms": 1.0}, name
  assert rows["gather"]["status"] == "OOM"
  assert ["gather"] in calls  # reported out of memory only after failing alone
  assert "timed apart" in case["timing_note"] and "ran out of memory" in case["timing_note"]


def test_tables_that_cannot_fit_together_are_split_up_front_without_probes():
  # With --no-memory the grouping knows only the tables: two 12 GB tables (tf_hsm's shared
  # one, which nll_loss reads too, and the fused step's own) never share a process under
  # an 18 GB limit, and nll_loss joins tf_hsm's; small tables stay in one process.
  from tf_hsm.bench import cli, runner  # pylint: disable=import-outside-toplevel
  args = cli.parse_args(["--custom", "10000000,300,3200", "--no-memory", "--methods",
                         cases.NLL_LOSS, cases.FUSED_SGD])
  opts = cli.options_from_args(args)
  opts.limit_bytes = 18e9
  (case,) = runner.expand_cases(cli._scenarios(args), args, "/nonexistent", opts)
  case["tree_summary"] = {"num_slots": 10_003_163}
  methods = case["methods"]
  rows = {name: {"status": "ok"} for name in methods}
  assert methods == ["tf_hsm", cases.FUSED_SGD, cases.NLL_LOSS]
  assert runner.plan_timing_groups(case, methods, rows, opts) == [
      ["tf_hsm", cases.NLL_LOSS], [cases.FUSED_SGD]]
  case["tree_summary"] = {"num_slots": 1_000}
  assert runner.plan_timing_groups(case, methods, rows, opts) == [methods]


def test_heading_shows_the_spread_of_the_read_ceiling_when_runs_disagree():
  from tf_hsm.bench import report  # pylint: disable=import-outside-toplevel
  case = {"scenario": "custom", "vocab": 1000, "dim": 8, "tokens": 32, "tree": "huffman",
          "kind": "train", "methods": {},
          "ceilings": {"matmul_gflops": 400.0, "read_gbps": 65.3},
          "ceiling_runs": [{"matmul_gflops": 390.0, "read_gbps": 41.7},
                           {"matmul_gflops": 400.0, "read_gbps": 65.3}]}
  heading = report.case_markdown(case, "none").splitlines()[1]
  assert "matmul 400 GFLOP/s, read 65.3 GB/s (the case's 2 reads: 41.7–65.3 GB/s)" in heading
  case["ceiling_runs"][0]["read_gbps"] = 62.0  # within 10%: the best alone
  heading = report.case_markdown(case, "none").splitlines()[1]
  assert heading.endswith("read 65.3 GB/s")


def test_machine_line_tells_cpus_of_one_brand_apart(tmp_path):
  from tf_hsm.bench import cli  # pylint: disable=import-outside-toplevel
  meminfo = tmp_path / "meminfo"
  meminfo.write_text("MemTotal:       25165824 kB\n")
  entry = ("processor\t: {n}\nvendor_id\t: AuthenticAMD\ncpu family\t: {family}\n"
           "model\t\t: {model}\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse2 {flags}\n\n")
  cpuinfo = tmp_path / "cpuinfo"
  # Only the first processor's entry is read.
  cpuinfo.write_text(entry.format(n=0, family=25, model=1, flags="avx avx2 fma") +
                     entry.format(n=1, family=26, model=2, flags="avx2 avx512f"))
  line = cli._machine(str(cpuinfo), str(meminfo))  # pylint: disable=protected-access
  assert line.startswith("AMD EPYC (family 25, model 1; AVX2), ")
  assert line.endswith(" cores, 24 GiB RAM")
  cpuinfo.write_text(entry.format(n=0, family=26, model=2, flags="avx2 avx512f"))
  assert cli._machine(str(cpuinfo), str(meminfo)).startswith(  # pylint: disable=protected-access
      "AMD EPYC (family 26, model 2; AVX-512), ")
  assert cli._machine(str(tmp_path / "none"), str(meminfo)).startswith(  # pylint: disable=protected-access
      "unknown CPU, ")
