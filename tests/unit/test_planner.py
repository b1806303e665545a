"""tf_hsm.plan: the arithmetic against hand-computed values, rows touched against a
sampled batch, the recommendation, the adaptive softmax rows, the command line, and
`--verify`'s predictions against the bench's measurements of a small case."""

import json
import subprocess
import sys

import numpy as np
import pytest

import tf_hsm
from tf_hsm import distribute
from tf_hsm import planning as planner
from tf_hsm.bench import plan_verify as planner_verify

MACHINE = {"matmul_flops": 200e9, "read_bytes": 20e9, "call_seconds": 100e-6}


def _row(report, prefix):
  return next(r for r in report.rows if r["method"].startswith(prefix))


def test_the_questions_24_gb():
  """10M classes x 300 in float32: 12 GB of table, 24 GB with a dense gradient (the
  biases add one column)."""
  report = tf_hsm.plan(10_000_000, 300, 256, machine=MACHINE, trees=())
  full = _row(report, "full softmax")
  assert full["param_bytes"] == 10_000_000 * 301 * 4
  assert full["param_bytes"] + full["grad_bytes"] == pytest.approx(24e9, rel=0.004)
  assert full["flops"] == 6 * 256 * 10_000_000 * 300
  # Adam's two slots: 36 GB with the table and a dense gradient... plus 12 more.
  adam = _row(tf_hsm.plan(10_000_000, 300, 256, optimizer="adam", machine=MACHINE,
                          trees=()), "full softmax")
  assert adam["slot_bytes"] == 2 * adam["param_bytes"]


def test_hierarchical_rows_are_sparse_and_measured_rows_agree(rng):
  num_classes, tokens = 50_000, 800
  counts = 1.0 / np.arange(1, num_classes + 1)
  report = tf_hsm.plan(num_classes, 64, tokens, counts=counts, optimizer="lazy_adam",
                       machine=MACHINE, trees=("two_level", "huffman8"))
  batches = [rng.choice(num_classes, tokens, p=counts / counts.sum()) for _ in range(6)]
  for prefix, tree in (("HierarchicalSoftmax two_level",
                        tf_hsm.Tree.two_level(num_classes, counts=counts)),
                       ("HierarchicalSoftmax huffman(8)",
                        tf_hsm.Tree.huffman(counts, branching=8))):
    row = _row(report, prefix)
    measured = np.mean([distribute.rows_per_shard(tree, b, 1).sum() for b in batches])
    assert row["rows_touched"] == pytest.approx(measured, rel=0.05)
    assert row["grad_bytes"] == pytest.approx(row["rows_touched"] * 65 * 4)
    assert row["slot_bytes"] == 2 * row["param_bytes"]
  full = _row(report, "full softmax")
  assert report.recommended.startswith("HierarchicalSoftmax")
  best = _row(report, report.recommended)
  assert best["step_seconds"] < full["step_seconds"]
  assert "Recommended: " in report.to_markdown()
  assert report.to_dict()["recommended"] == report.recommended


def test_a_budget_that_nothing_fits_says_so():
  # Without the adaptive rows: their narrow tails fit 10 MiB here (5.9 MB of weights).
  report = tf_hsm.plan(100_000, 128, 64, memory_budget=10 << 20, machine=MACHINE,
                       trees=("huffman2",), adaptive=())
  assert not any(r["fits"] for r in report.rows if r["exact"])
  assert "nothing exact fits" in report.reason
  sharded = tf_hsm.plan(100_000, 128, 64, memory_budget=60 << 20, num_shards=4,
                        machine=MACHINE, trees=("huffman2",), adaptive=())
  assert _row(sharded, "HierarchicalSoftmax")["fits"]


def test_bad_arguments():
  with pytest.raises(ValueError, match="num_classes"):
    tf_hsm.plan(0, 10, 10, machine=MACHINE)
  with pytest.raises(ValueError, match="optimizer"):
    tf_hsm.plan(100, 10, 10, optimizer="rmsprop", machine=MACHINE)
  with pytest.raises(ValueError, match="unknown tree"):
    tf_hsm.plan(100, 10, 10, machine=MACHINE, trees=("oak",))


def test_human_sizes():
  assert planner.parse_count("10M") == 10_000_000
  assert planner.parse_count("3200") == 3200
  assert planner.parse_bytes("24GiB") == 24 * 2**30
  assert planner.parse_bytes("12GB") == 12 * 10**9
  with pytest.raises(ValueError):
    planner.parse_bytes("lots")


def test_command_line():
  result = subprocess.run(
      [sys.executable, "-m", "tf_hsm.planning", "--classes", "20K", "--hidden", "64",
       "--tokens", "500", "--optimizer", "lazy_adam", "--memory", "1GiB", "--zipf", "1.0",
       "--machine", '{"matmul_flops": 2e11, "read_bytes": 2e10, "call_seconds": 1e-4}'],
      capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-2000:]
  assert "| full softmax |" in result.stdout and "Recommended:" in result.stdout


def test_adaptive_rows_from_the_layers_structure():
  """V=100, D=16, cutoffs [10, 40], div 2, uniform classes: a head of 10 + 2 classes at
  width 16; cluster 0 (30 classes, q=0.3) at width 8, cluster 1 (60, q=0.6) at width 4."""
  T = 4
  cost = planner.adaptive_cost(100, 16, T, [10, 40], div_value=2.0, tail="flat")
  elements = 12 * 16 + (16 * 8 + 30 * 8) + (16 * 4 + 60 * 4)
  assert sum(p.elements for p in cost.parts) == elements == 864
  assert cost.flops == pytest.approx(6 * T * (12 * 16 + 0.3 * (16 * 8 + 30 * 8) +
                                              0.6 * (16 * 4 + 60 * 4)))
  assert cost.rows_touched == pytest.approx(12 + (1 - 0.7**T) * 30 + (1 - 0.4**T) * 60)
  assert cost.softmax_logits == pytest.approx(T * 12 + T * 0.3 * 30 + T * 0.6 * 60)
  report = tf_hsm.plan(100, 16, T, machine=MACHINE, trees=(), cutoffs=[10, 40],
                       div_value=2.0)
  flat = _row(report, "AdaptiveSoftmax flat")
  assert flat["param_bytes"] == flat["grad_bytes"] == 864 * 4  # every gradient dense
  assert "cutoffs [10, 40], div 2 (tail widths 8, 4)" in flat["method"]
  tree = _row(report, "AdaptiveSoftmax two_level")
  # Tree tails: per-edge biases, a gradient over the touched rows only.
  assert tree["grad_bytes"] < tree["param_bytes"]
  assert tree["flops"] < flat["flops"]


def test_pytorch_cutoffs_rule():
  assert planner.pytorch_cutoffs(100_000, 512) == [2000, 20000]
  assert planner.pytorch_cutoffs(1_000_000, 300) == [2000, 20000, 200000]
  assert planner.pytorch_cutoffs(10_000_000, 300) == [2000, 20000, 200000, 2000000]
  assert planner.pytorch_cutoffs(1_000_000, 16) == [2000, 20000]  # 16 // 4**3 == 0
  assert planner.pytorch_cutoffs(1000, 64) == [125, 500]
  with pytest.raises(ValueError, match="div_value"):
    tf_hsm.plan(1000, 16, 8, machine=MACHINE, div_value="4")
  with pytest.raises(ValueError, match="adaptive"):
    tf_hsm.plan(1000, 16, 8, machine=MACHINE, adaptive=("deep",))
  with pytest.raises(ValueError, match="cutoffs"):
    planner.adaptive_cost(100, 16, 4, [40, 10])


def test_verify_rows_are_the_planners_rows_of_the_bench_tree():
  case = planner_verify.Case("t", 20_000, 32, 64, "huffman")
  rows = planner_verify.predict(case, MACHINE)
  full = rows["full_softmax"]
  assert full["param_bytes"] == full["grad_bytes"] == 20_000 * 33 * 4
  assert full["activation_bytes"] == (64 * 20_000 + 2 * 64 * 32) * 4
  tree = tf_hsm.Tree.huffman(1.0 / np.arange(1, 20_001))
  assert rows["tf_hsm"]["param_bytes"] == tree.num_slots * 33 * 4
  with pytest.raises(ValueError, match="repeats"):
    planner_verify.run(["quick"], quick=True, repeats=0)
  with pytest.raises(ValueError, match="unknown case"):
    planner_verify.run(["Z"])


@pytest.mark.slow
def test_verify_quick_measures_near_the_prediction():
  """The bench's measurements of a small case against the planner's prediction, within
  bounds wide enough for a loaded 2-core machine (step times there move by 2x), narrow
  enough to catch a model that is badly wrong."""
  result = subprocess.run(
      [sys.executable, "-m", "tf_hsm.planning", "--verify", "--quick", "--json"],
      capture_output=True, text=True, timeout=900)
  assert result.returncode == 0, result.stderr[-3000:]
  report = json.loads(result.stdout)
  rows = {r["method"]: r for r in report["results"]}
  assert set(rows) == {"tf_hsm", "full_softmax"}
  for method, row in rows.items():
    assert row["status"] == "ok", row
    assert 1 / 4 < row["time_ratio"] < 4, (method, row["time_ratio"])
  # Full softmax's peak is its table, gradient and logits (0.15 GB): within 2x.
  assert 0.5 < rows["full_softmax"]["peak_ratio"] < 2
  # tf_hsm's 30 MB are within TensorFlow's own allocations: within 100 MB.
  tf_hsm_row = rows["tf_hsm"]
  assert abs(tf_hsm_row["measured_peak"] - tf_hsm_row["predicted_peak"]) < 100e6
  assert "| quick: V=50,000 D=128 T=512 two_level | full_softmax |" in \
      planner_verify.markdown(report)


def test_adaptive_rows_at_the_chosen_cutoffs():
  """Without cutoffs=, each tail's row is at the cutoffs choose_cutoffs picks for the
  plan's step, optimizer and machine, and a flat row at PyTorch-style cutoffs, on the
  search's grid, is no faster than the chosen flat one."""
  counts = 1.0 / np.arange(1, 100_001)
  report = tf_hsm.plan(100_000, 300, 640, counts=counts, optimizer="lazy_adam",
                       machine=MACHINE, trees=())
  for tail in ("flat", "two_level"):
    chosen = tf_hsm.AdaptiveSoftmax.choose_cutoffs(counts, 300, 640, tail=tail,
                                                   machine=MACHINE, optimizer="lazy_adam")
    row = _row(report, f"AdaptiveSoftmax {tail}, chosen cutoffs")
    assert row["method"].startswith(
        f"AdaptiveSoftmax {tail}, chosen cutoffs [{', '.join(f'{c:,}' for c in chosen)}]")
  fixed = _row(report, "AdaptiveSoftmax flat, PyTorch-style fixed cutoffs [2,000, 20,000]")
  assert _row(report, "AdaptiveSoftmax flat, chosen")["step_seconds"] <= fixed["step_seconds"]


def test_tree_step_fit_recovers_its_coefficients():
  """The non-negative least squares behind the fitted tree step: exact data gives the
  coefficients back; a term the data make negative is dropped, not kept negative."""
  from tf_hsm.planning import step_fit as _tree_step_fit
  truth = (2e-11, 9e-11, 3e-10, 4e-7, 2e-8, 5e-4)
  amounts = [(1e6, 0, 1e5, 1e3, 1e4), (1e9, 0, 1e8, 2e3, 1e6), (0, 5e8, 4e8, 1e4, 3e5),
             (7e7, 1e6, 3e7, 4e4, 5e5), (2e9, 0, 1e7, 5e2, 2e6), (0, 4e6, 3e6, 2e4, 5e4),
             (3e8, 2e7, 5e6, 9e3, 8e5)]
  rows = [a + (float(np.dot(truth, a + (1.0,))),) for a in amounts]
  assert _tree_step_fit.fit(rows) == pytest.approx(truth, rel=1e-6)
  # Time falling with bytes: the bytes term goes to 0 and the rest are refitted.
  falling = [a + (1e-3 + 1e-11 * a[0] + 1e-10 * a[1] - 1e-12 * a[2],) for a in amounts]
  fitted = _tree_step_fit.fit(falling)
  assert fitted[2] == 0 and min(fitted) >= 0


def test_tree_rows_use_the_fitted_step_and_hold_the_tree():
  counts = 1.0 / np.arange(1, 30_001)
  tree = tf_hsm.Tree.huffman(counts, branching=2)
  coefficients = (2e-11, 9e-11, 3e-10, 4e-7, 2e-8, 5e-4)
  fitted = dict(MACHINE, tree_step=coefficients)
  roofline = _row(tf_hsm.plan(30_000, 64, 512, counts=counts, machine=MACHINE,
                              trees=("huffman2",), adaptive=()), "HierarchicalSoftmax")
  row = _row(tf_hsm.plan(30_000, 64, 512, counts=counts, machine=fitted,
                         trees=("huffman2",), adaptive=()), "HierarchicalSoftmax")
  probs = counts / counts.sum()
  depth = np.diff(tree.path_begin)
  assert row["node_visits"] == pytest.approx(512 * np.dot(probs, depth))
  # A binary tree: two children a node, every node walked (at most 8 children).
  assert row["children_scored"] == pytest.approx(2 * row["node_visits"])
  assert row["small_node_flops"] == pytest.approx(row["flops"])
  assert row["flops"] == pytest.approx(6 * 64 * row["children_scored"])
  expected = np.dot(coefficients, (0.0, row["flops"], row["bytes_moved"],
                                   row["node_visits"], row["children_scored"], 1.0))
  assert row["step_seconds"] == pytest.approx(expected)
  assert roofline["step_seconds"] != pytest.approx(expected)
  # The tree's int64 index arrays are part of the peak, beside the tensors.
  arrays = sum(a.nbytes for a in (tree.child_begin, tree.slot_child, tree.slot_node,
                                  tree.node_slot, tree.class_slot, tree.node_depth,
                                  tree.path_begin, tree.path_nodes, tree.path_slots))
  assert arrays < row["tree_bytes"] <= arrays + 8 * 30_000
  assert row["peak_bytes"] == pytest.approx(
      row["param_bytes"] + row["grad_bytes"] + row["slot_bytes"] + row["activation_bytes"]
      + row["tree_bytes"] + planner.STEP_WORKSPACE_BYTES)
