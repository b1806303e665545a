"""The adaptive softmax's bench tools: `tf_hsm.bench.keras_fit` (a Keras model.fit step of
an output layer at any size) and PyTorch side by side in `tf_hsm.bench.adaptive`, which
also checks `AdaptiveSoftmax.from_torch_state_dict` against the real module when PyTorch
is importable (it is not a dependency: skipped without it)."""

import json
import sys

import numpy as np
import pytest

import tf_hsm
from tf_hsm.bench import adaptive as bench_adaptive
from tf_hsm.bench import keras_fit
from tf_hsm.bench.cases import zipf_weights

import support


def _keras_fit(**overrides):
  """The command's result, run as a user runs it: in a process of its own (in this
  one, memory freed by earlier tests is reused, and a small model need not raise the
  RSS above its baseline)."""
  args = dict(classes=3_000, hidden=32, tokens=128, features=16, layer="adaptive",
              tree="huffman32", tail="two_level", div_value=4.0, steps=4, batches=2)
  args.update(overrides)
  command = [sys.executable, "-m", "tf_hsm.bench.keras_fit", "--json"]
  for name, value in args.items():
    flag = f"--{name.replace('_', '-')}"
    command += [flag] if value is True else [flag, str(value)]
  out = support.run(command, timeout=300).stdout
  return json.loads(out.strip().splitlines()[-1])


@pytest.mark.parametrize("overrides", [
    {}, {"tail": "flat", "cutoffs": "200,1000"}, {"layer": "hsm", "tree": "huffman8"},
    {"layer": "hsm", "tree": "huffman8", "optimizer": "lazy_adam", "fused_update": True},
    {"layer": "mixture", "mixture": "3x4+64r2", "optimizer": "lazy_adam",
     "fused_update": True},
    {"layer": "mixture", "mixture": "2x8:16"}, {"layer": "sampled"}])
def test_keras_fit_reports_steps_weights_and_memory(overrides):
  result = _keras_fit(**overrides)
  assert result["peak_since"] == "the baseline"
  assert len(result["steps"]) == 4
  assert result["step_seconds"] > 0
  assert 0 < result["baseline_rss"] < result["peak_rss"]
  assert result["bound"] == pytest.approx(1.3 * result["weights_bytes"] + 2**30)
  if overrides.get("layer") == "hsm":
    tree = tf_hsm.Tree.huffman(zipf_weights(3_000), branching=8)
    assert result["weights_bytes"] == tree.num_slots * (32 + 1) * 4
    assert "HierarchicalSoftmax huffman8" in result["layout"]
    assert ("fused update" in result["layout"]) == bool(overrides.get("fused_update"))
  elif overrides.get("layer") == "mixture":
    assert f"HierarchicalSoftmaxMixture {overrides['mixture']} " in result["layout"]
    assert ("fused update" in result["layout"]) == bool(overrides.get("fused_update"))
    # At least a row and a bias a class in each tree: three trees over the 2,936
    # classes past the shared head, or two over all 3,000.
    trees, classes = (3, 2936) if "+" in overrides["mixture"] else (2, 3000)
    assert result["weights_bytes"] >= trees * classes * (32 + 1) * 4
  elif overrides.get("layer") == "sampled":
    assert result["weights_bytes"] == 3_000 * (32 + 1) * 4
    assert "sampled_softmax_loss, 1,024 samples" in result["layout"]
  else:
    assert "AdaptiveSoftmax" in result["layout"] and "cutoffs [" in result["layout"]
  if overrides.get("cutoffs"):
    # Head 200 + 2 cluster tokens at 32; clusters at widths 8 and 2 with projections.
    assert result["weights_bytes"] == 4 * (202 * 32 + (32 * 8 + 800 * 8) +
                                           (32 * 2 + 2000 * 2))


def test_keras_fit_command_line_refuses_too_few_steps():
  with pytest.raises(SystemExit):
    keras_fit.main(["--steps", "2"])


@pytest.mark.parametrize("argv, message", [
    (["--layer", "mixture", "--mixture", "2x4+8,3x4+8"], "takes one mixture"),
    (["--layer", "mixture", "--mixture", "1x4+8"], "2-8 trees"),
    (["--layer", "mixture", "--mixture", "2x4+8", "--classes", "8"],
     "needs more classes than its head of 8"),
    (["--layer", "sampled", "--optimizer", "lazy_adam", "--fused-update"],
     "--fused-update is for --layer hsm or mixture")])
def test_keras_fit_command_line_refuses_bad_mixtures_and_flags(argv, message, capsys):
  with pytest.raises(SystemExit):
    keras_fit.main(argv)
  assert message in capsys.readouterr().err


def test_torch_module_and_the_layer_from_its_state_dict_agree():
  torch = pytest.importorskip("torch")
  torch.manual_seed(3)
  cutoffs, dim, num_classes = [30, 120], 24, 400
  module = torch.nn.AdaptiveLogSoftmaxWithLoss(dim, num_classes, cutoffs, div_value=2.0,
                                               head_bias=True).double()
  rng = np.random.default_rng(0)
  hidden = rng.standard_normal((50, dim))
  targets = rng.integers(0, num_classes, 50)
  with torch.no_grad():
    expected_lp = module(torch.from_numpy(hidden), torch.from_numpy(targets)).output
    expected_all = module.log_prob(torch.from_numpy(hidden))
  layer = tf_hsm.AdaptiveSoftmax.from_torch_state_dict(
      {k: v.numpy() for k, v in module.state_dict().items()}, cutoffs, div_value=2.0,
      head_bias=True)
  np.testing.assert_allclose(layer(hidden, targets).numpy(), expected_lp.numpy(),
                             rtol=1e-10, atol=1e-10)
  np.testing.assert_allclose(layer.log_prob_all(hidden).numpy(), expected_all.numpy(),
                             rtol=1e-10, atol=1e-10)


def test_torch_step_runs_on_the_benchs_inputs():
  pytest.importorskip("torch")
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  hidden = tf.random.stateless_normal([64, 32], seed=[1, 2])
  targets = tf.constant(np.arange(64) * 7 % 500, tf.int64)
  step, params = bench_adaptive._torch_step(500, 32, [50, 200], hidden, targets)
  loss = step(hidden, targets)
  assert np.isfinite(loss) and loss > 0
  # Head 50 + 2 cluster tokens at 32; clusters at widths 8 and 2.
  assert params == 52 * 32 + (32 * 8 + 150 * 8) + (32 * 2 + 300 * 2)
