"""The planner's context tree: a row only with the training text, priced as the trees
from vectors, its evidence from the CPU runs at 100K classes, and the layer it hands over
built from that text with no rebuild."""

import numpy as np
import pytest

import support
import tf_hsm
from tf_hsm.planning import candidates, quality

MACHINE = {"matmul_flops": 5e10, "read_bytes": 1e10, "call_seconds": 2e-4,
           "tree_step": (3e-11, 1e-10, 7e-11, 2e-7, 1e-8, 5e-4)}


def test_a_context_row_only_with_the_training_text():
  ids, counts = support.zipf_ids()
  plain = tf_hsm.plan(3_000, 128, 2048, counts=counts, machine=MACHINE, adaptive=())
  assert not any("context" in r["method"] for r in plain.rows)
  report = tf_hsm.plan(3_000, 128, 2048, counts=counts, machine=MACHINE, adaptive=(),
                       token_ids=ids)
  rows = {r["method"]: r for r in report.rows}
  context = rows["HierarchicalSoftmax context(32, head=256)"]
  vectors = rows["HierarchicalSoftmax vectors(32, head=256)"]
  # The same shape priced: the stand-in of a head over a Huffman tree of the rest.
  for column in ("step_seconds", "peak_bytes", "flops", "rows_touched"):
    assert context[column] == vectors[column], column
  assert context["quality_kind"] == "context32_head256"
  assert context["quality"] == pytest.approx(quality.quality_of("context32_head256",
                                                                3_000)[0])
  assert "| HSM context32/256 |" in report.to_markdown()
  # The other rows are what they were without the text.
  assert [r["method"] for r in plain.rows] == [m for m in rows if "context" not in m]


def test_planned_without_the_text_a_note_names_the_measured_text_trees():
  # At V=1M within +1% only full softmax is priced (a step of seconds): the note names
  # the mixtures measured within 1% that the text would add, with their figures.
  counts = 1.0 / np.arange(1, 1_000_001)
  report = tf_hsm.plan(1_000_000, 300, 3200, counts=counts, optimizer="lazy_adam",
                       machine=MACHINE, max_perplexity_increase=0.01)
  assert report.recommended == "full softmax"
  (note,) = [n for n in report.notes if n.startswith("not priced")]
  four = quality.quality_of("mixture4x16_shared128_rank16", 1_000_000)[0]
  assert f"mixture4x16_shared128_rank16 {four - 1:+.1%}" in note
  assert "context32_head256" not in note  # measured farther than 1% from full softmax
  assert "token_ids" in note and "--token-ids" in note
  assert "mixture4x16_head128 " in note  # four trees with heads of their own, -0.05%
  # With none within the bound, the most accurate alone.
  (best,) = candidates._text_trees_note(1_000_000, None, None, within=-1)  # pylint: disable=protected-access
  assert "mixture4x16_head128 " in best and "mixture4x16_shared128_rank16" not in best
  # With the text, or with trees of the caller's choosing, there is nothing to say.
  ids, small = support.zipf_ids()
  for kwargs in ({"token_ids": ids}, {"trees": ("huffman8",)}):
    other = tf_hsm.plan(3_000, 128, 2048, counts=small, machine=MACHINE, adaptive=(),
                        **kwargs)
    assert not any(n.startswith("not priced") for n in other.notes), kwargs
  # The names are those `trees` takes.
  shown = tf_hsm.plan(3_000, 128, 2048, counts=small, machine=MACHINE, adaptive=(),
                      token_ids=ids, trees=("mixture4x16_shared128_rank16",))
  assert any("mixture4x16+128r16" in r["label"] for r in shown.rows)


def test_the_context_evidence_is_the_cpu_runs_at_100k_classes():
  ratio, figures = quality.quality_of("context32_head256", 1_000_000)
  # Each corpus's longest-trained checkpoint: both epochs.
  assert {f.corpus for f in figures} == {quality.LINUX_EPOCH, quality.DEBIAN_EPOCH}
  assert ratio == pytest.approx((107.7 / 101.62 + 50.4 / 46.37) / 2)
  assert ratio < quality.quality_of("vectors32_head256", 1_000_000)[0]
  assert quality.kind_of("HierarchicalSoftmax context(32, head=256)") == \
      "context32_head256"
  assert quality.kind_of("HierarchicalSoftmax context(16, head=8)") is None  # unmeasured


def test_a_recommended_context_tree_is_built_from_the_text_and_not_rebuilt():
  ids, counts = support.zipf_ids()
  report = tf_hsm.plan(3_000, 128, 2048, counts=counts, optimizer="lazy_adam",
                       machine=dict(MACHINE, matmul_flops=1e8), adaptive=(),
                       trees=candidates.CONTEXT_TREES, token_ids=ids)
  layer = report.layer
  assert report.recommended == "HierarchicalSoftmax context(32, head=256)", report.reason
  assert layer.tree == tf_hsm.Tree.from_context(ids, 3_000, counts, branching=32,
                                                head=256)
  assert layer.rebuild is None and layer.rebuild_callback(None) is None
  assert layer.code == ("HierarchicalSoftmax(Tree.from_context(token_ids, num_classes, "
                        "counts, branching=32, head=256))")


@pytest.mark.parametrize("token_ids,message", [
    (None, "pass token_ids"),
    (np.zeros((2, 5), np.int64), "1-D array"),
    (np.array([1]), "at least 2"),
    (np.array([0.0, 1.0]), "integer"),
    (np.array([0, 3_000]), r"\[0, num_classes=3000\)"),
    (np.array([-1, 2]), r"\[0, num_classes=3000\)")])
def test_bad_training_text_is_named(token_ids, message):
  with pytest.raises(ValueError, match=message):
    tf_hsm.plan(3_000, 128, 2048, machine=MACHINE, adaptive=(),
                trees=("huffman8", "context32_head256"), token_ids=token_ids)


def test_command_line_token_ids(tmp_path, capsys):
  import json  # pylint: disable=g-import-not-at-top
  from tf_hsm.planning import cli  # pylint: disable=g-import-not-at-top
  ids, counts = support.zipf_ids()
  np.save(tmp_path / "ids.npy", ids)
  np.save(tmp_path / "counts.npy", counts)
  np.save(tmp_path / "floats.npy", ids.astype(np.float64))
  common = ["--counts", str(tmp_path / "counts.npy"), "--hidden", "128", "--tokens",
            "2048", "--machine", json.dumps(MACHINE), "--quiet"]
  assert cli.main(common + ["--token-ids", str(tmp_path / "ids.npy")]) == 0
  assert "| HSM context32/256 |" in capsys.readouterr().out
  for name, message in (("missing.npy", "no such file"), ("floats.npy", "integer")):
    assert cli.main(common + ["--token-ids", str(tmp_path / name)]) == 2
    assert message in capsys.readouterr().err


def test_recommend_tree_takes_the_text_for_a_context_tree():
  ids, counts = support.zipf_ids()
  tree, row = tf_hsm.planning.recommend_tree(3_000, 128, 2048, counts=counts,
                                             machine=MACHINE,
                                             trees=candidates.CONTEXT_TREES, token_ids=ids)
  assert tree == tf_hsm.Tree.from_context(ids, 3_000, counts, branching=32, head=256)
  assert row["method"] == "HierarchicalSoftmax context(32, head=256)"
  with pytest.raises(ValueError, match="pass token_ids"):
    tf_hsm.planning.recommend_tree(3_000, 128, 2048, machine=MACHINE,
                                   trees=candidates.CONTEXT_TREES)
