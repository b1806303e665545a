"""What a user does with a plan: prints it, builds the recommended layer from it, and
plans with counts in a tokenizer's id order (the adaptive rows then rank the classes by
frequency and their layer takes `class_order`, as `AdaptiveSoftmax` does)."""

import json

import numpy as np
import pytest

import tf_hsm
from tf_hsm.planning import candidates
from tf_hsm.planning import cli

MACHINE = {"matmul_flops": 200e9, "read_bytes": 20e9, "call_seconds": 100e-6}
V = 20_000
COUNTS = 1e6 / np.arange(1, V + 1)  # class 0 the most frequent
BY_ID = COUNTS[np.random.default_rng(0).permutation(V)]  # the same, in a tokenizer's order


def test_print_report_is_the_table(capsys):
  report = tf_hsm.plan(V, 64, 512, counts=COUNTS, machine=MACHINE, trees=("huffman8",),
                       adaptive=())
  print(report)
  out = capsys.readouterr().out
  assert out == report.to_markdown() + "\n"
  assert out.startswith("V=20,000, D=64") and "| method |" in out and "Report(" not in out


def test_layer_builds_what_it_describes():
  pytest.importorskip("keras")
  hsm = tf_hsm.plan(V, 64, 512, counts=COUNTS, machine=MACHINE, trees=("huffman8",),
                    adaptive=()).layer
  layer = hsm.build(name="output")
  assert isinstance(layer, tf_hsm.HierarchicalSoftmax) and layer.name == "output"
  assert layer.tree is hsm.tree
  adaptive = tf_hsm.plan(V, 64, 512, counts=COUNTS, machine=MACHINE, trees=(),
                         adaptive=("flat",)).layer
  built = adaptive.build()
  assert isinstance(built, tf_hsm.AdaptiveSoftmax)
  assert list(built.cutoffs)[:len(adaptive.cutoffs)] == adaptive.cutoffs
  full = tf_hsm.plan(1000, 64, 512, machine=MACHINE, trees=(), adaptive=()).layer
  assert full.kind == "full softmax" and full.code == "HierarchicalSoftmax(Tree.flat(1000))"
  exact = full.build()
  assert isinstance(exact, tf_hsm.HierarchicalSoftmax)
  assert exact.tree == tf_hsm.Tree.flat(1000)
  sampled = tf_hsm.planning.Layer("sampled softmax", "sampled softmax", "")
  with pytest.raises(ValueError, match="never recommended"):
    sampled.build()


def test_a_padding_id_of_no_count_is_the_layers_ignore_class():
  """Counts with class 0 at 0 (the README's padding id): the layer the plan builds
  leaves its targets out of the loss and it out of top_k, as its code says; the caller
  decides."""
  padded = np.concatenate([[0.0], COUNTS[:-1]])
  plan = tf_hsm.plan(V, 64, 512, counts=padded, machine=MACHINE, trees=("huffman8",),
                     adaptive=())
  assert plan.layer.code.endswith(", ignore_class=0)"), plan.layer.code
  assert any("ignore_class=0" in note for note in plan.notes)
  unpadded = tf_hsm.plan(V, 64, 512, counts=COUNTS, machine=MACHINE, trees=("huffman8",),
                         adaptive=()).layer
  assert unpadded.ignore_class is None and "ignore_class" not in unpadded.code
  pytest.importorskip("keras")
  assert plan.layer.build().ignore_class == 0
  assert plan.layer.build(ignore_class=None).ignore_class is None
  assert unpadded.build().ignore_class is None
  # A code that goes on after the layer (a rebuild), or a mixture's, says it at the end.
  for code in ("HierarchicalSoftmax(tree); rebuilt by RebuildTree(layer, head=128)",
               "HierarchicalSoftmaxMixture([tree, tree])"):
    kind = code.split("(")[0]
    padded_layer = candidates._with_padding_id(tf_hsm.planning.Layer(kind, kind, code),
                                               padded, [])
    assert padded_layer.code == code + "; built with ignore_class=0"


@pytest.mark.parametrize("ignore_class", [None, 0, 7])
def test_a_planned_models_ignore_class_stands(ignore_class):
  """With model=, the pick keeps the model's layer's ignore_class: class 0 of no count
  may be a new item, which ignore_class=0 would never learn nor recommend."""
  keras = pytest.importorskip("keras")
  padded = np.concatenate([[0.0], COUNTS[:-1]])
  features = keras.Input((16,))
  targets = keras.Input((), dtype="int64")
  hidden = keras.layers.Dense(64)(features)
  layer = tf_hsm.HierarchicalSoftmax(tf_hsm.Tree.huffman(padded + 1, 8),
                                     ignore_class=ignore_class)
  model = keras.Model([features, targets], layer(hidden, targets))
  plan = tf_hsm.plan(model=model, tokens_per_step=512, counts=padded, machine=MACHINE,
                     trees=("huffman8",), adaptive=())
  assert plan.layer.ignore_class == ignore_class
  assert plan.layer.build().ignore_class == ignore_class
  assert ("ignore_class=" in plan.layer.code) == (ignore_class is not None)
  assert any("pass ignore_class=0" in note for note in plan.notes) == (ignore_class is None)


def test_a_planned_adaptive_model_leaves_padding_to_the_pick():
  """An AdaptiveSoftmax has no ignore_class (it orders its classes): a tree picked for
  its model leaves a padding id of no count out, as when planned without a model."""
  keras = pytest.importorskip("keras")
  padded = np.concatenate([[0.0], COUNTS[:-1]])
  features = keras.Input((16,))
  targets = keras.Input((), dtype="int64")
  hidden = keras.layers.Dense(64)(features)
  order = tf_hsm.AdaptiveSoftmax.frequency_order(padded)
  layer = tf_hsm.AdaptiveSoftmax(V, [2000], class_order=order)
  model = keras.Model([features, targets], layer(hidden, targets))
  plan = tf_hsm.plan(model=model, tokens_per_step=512, counts=padded, machine=MACHINE,
                     trees=("huffman8",), adaptive=())
  assert plan.layer.ignore_class == 0 and plan.layer.code.endswith(", ignore_class=0)")


def test_counts_in_id_order_keep_the_adaptive_rows_with_a_class_order():
  sorted_report = tf_hsm.plan(V, 128, 640, counts=COUNTS, machine=MACHINE, trees=())
  report = tf_hsm.plan(V, 128, 640, counts=BY_ID, machine=MACHINE, trees=())
  methods = [row["method"] for row in report.rows]
  assert methods == [row["method"] for row in sorted_report.rows]
  assert sum(m.startswith("AdaptiveSoftmax") for m in methods) >= 3
  for row, same in zip(report.rows, sorted_report.rows):
    assert row["step_seconds"] == pytest.approx(same["step_seconds"], rel=1e-9)
  assert any("class_order" in note and "not sorted by frequency" in note
             for note in report.notes)
  layer = report.layer
  assert layer.kind == "AdaptiveSoftmax", report.recommended
  order = layer.kwargs["class_order"]
  np.testing.assert_array_equal(order, np.argsort(-BY_ID, kind="stable"))
  assert "class_order=AdaptiveSoftmax.frequency_order(counts, padding=())" in layer.code
  pytest.importorskip("keras")
  built = layer.build()
  np.testing.assert_array_equal(built.class_order.order, order)
  np.testing.assert_array_equal(
      order, tf_hsm.AdaptiveSoftmax.frequency_order(BY_ID, padding=()))


def test_counts_that_are_samples_still_say_why_there_are_no_adaptive_rows():
  samples = np.random.default_rng(1).zipf(1.3, size=V).astype(np.float64)
  report = tf_hsm.plan(V, 128, 640, counts=samples, machine=MACHINE, trees=())
  assert not any(row["method"].startswith("AdaptiveSoftmax") for row in report.rows)
  assert any(note.startswith("no AdaptiveSoftmax rows: counts look like samples")
             for note in report.notes), report.notes


def test_command_line_counts_in_id_order(tmp_path, capsys):
  path = tmp_path / "counts.txt"
  np.savetxt(path, np.round(BY_ID))  # whole counts, as a tokenizer's table gives them
  code = cli.main(["--counts", str(path), "--hidden", "128", "--tokens", "640",
                   "--machine", json.dumps(MACHINE), "--quiet", "--json"])
  assert code == 0
  report = json.loads(capsys.readouterr().out)
  assert any(row["method"].startswith("AdaptiveSoftmax") for row in report["rows"])
  assert any("class_order" in note for note in report["notes"])


def test_figures_farther_than_the_others_are_marked():
  """A figure measured at a vocabulary size farther from V than the others' is marked
  `^` (in place of `~`, or after it), as the recommendation sets it aside; full
  softmax, the reference at any V, never."""
  from tf_hsm.planning import candidates  # pylint: disable=import-outside-toplevel
  rows = [{"quality": 1.0, "quality_kind": "full", "quality_scale_gap": 2.3},
          {"quality": 1.235, "quality_kind": "huffman8", "quality_scale_gap": 1.0},
          {"quality": 1.117, "quality_kind": "huffman2", "quality_scale_gap": 2.3},
          {"quality": None, "quality_kind": None, "quality_scale_gap": None}]
  assert candidates._farther_rows(rows) == [rows[2]]  # pylint: disable=protected-access
  cell = candidates._quality_cell  # pylint: disable=protected-access
  assert (cell(1.117, True, True), cell(1.117, True), cell(1.117, False, True),
          cell(1.03, False, True), cell(None, False, True)) == ("^12", "~12", "12^", "3.0^", "?")
  report = tf_hsm.plan(1_000_000, 300, 3200, optimizer="lazy_adam",
                       counts=1.0 / np.arange(1, 1_000_001), memory_budget=24 * 2**30)
  farther = [r for r in report.rows if r["label"] == "HSM huffman(2)"]
  assert farther and farther[0] in candidates._farther_rows(report.rows)  # pylint: disable=protected-access
  table = report.to_markdown().splitlines()
  line = next(l for l in table if l.startswith("| HSM huffman(2) |"))
  assert line.split(" | ")[-2].startswith("^"), line
  assert not any("^" in l.split(" | ")[-2] for l in table if l.startswith("| HSM huffman(8) |"))
