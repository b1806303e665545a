"""The planner's mixture rows: HierarchicalSoftmaxMixture of the left- and right-context
trees, a row only with the training text, priced as two context trees and a gate, its
evidence from linux-comments at 100K classes, recommended under a perplexity bound where
it is the fastest layer within it, and the layer it hands over built from that text."""

import numpy as np
import pytest

import support
import tf_hsm
from tf_hsm.planning import costs, quality

MACHINE = {"matmul_flops": 5e10, "read_bytes": 1e10, "call_seconds": 2e-4,
           "tree_step": (3e-11, 1e-10, 7e-11, 2e-7, 1e-8, 5e-4)}
MIXTURE = "HierarchicalSoftmaxMixture context(32, head=256), left and right"


def test_a_mixture_row_is_two_context_trees_and_a_gate():
  ids, counts = support.zipf_ids()
  plain = tf_hsm.plan(3_000, 128, 2048, counts=counts, machine=MACHINE, adaptive=())
  assert not any("Mixture" in r["method"] for r in plain.rows)
  report = tf_hsm.plan(3_000, 128, 2048, counts=counts, machine=MACHINE, adaptive=(),
                       token_ids=ids, optimizer="lazy_adam")
  rows = {r["method"]: r for r in report.rows}
  one, pair = rows["HierarchicalSoftmax context(32, head=256)"], rows[MIXTURE]
  gate = 128 * 2 + 2
  assert pair["param_bytes"] == 2 * one["param_bytes"] + 4 * gate
  assert pair["slot_bytes"] == 2 * one["slot_bytes"] + 2 * 4 * gate
  assert pair["rows_touched"] == 2 * one["rows_touched"]
  assert pair["flops"] == pytest.approx(2 * one["flops"] + 6.0 * 2048 * 128 * 2)
  # Each tree's fitted work, the calls of two ops and two updates, and the gate's: about
  # two trees' steps (the bench measures 2.1-2.2x one tree's forward and backward).
  assert 1.9 * one["step_seconds"] < pair["step_seconds"] < 2.5 * one["step_seconds"]
  markdown = report.to_markdown()
  assert "| HSM mixture32/256 |" in markdown and f"- HSM mixture32/256: {MIXTURE}" in markdown
  assert "| HSM mixture16/128 |" in markdown and "| HSM mixture3x16/128 |" in markdown
  three = rows[MIXTURE.replace("(32, head=256)", "(16, head=128)") + ", 3 trees"]
  two = rows[MIXTURE.replace("(32, head=256)", "(16, head=128)")]
  assert three["rows_touched"] == pytest.approx(1.5 * two["rows_touched"])
  assert three["param_bytes"] == pytest.approx(1.5 * (two["param_bytes"] - 4 * gate)
                                               + 4 * (128 * 3 + 3))


def test_mixture_cost_adds_the_trees_parts():
  one = costs.tree_cost(tf_hsm.Tree.huffman(np.arange(1, 50.0), branching=4), 16, 64,
                        np.full(49, 1 / 49))
  three = costs.mixture_cost([one] * 3, 16, 64)
  assert [p.name for p in three.parts] == ["table"] * 3 + ["gate"]
  assert three.parts[-1].elements == 3 * 17 and three.parts[-1].dense_grad
  for field in ("node_visits", "children_scored", "tree_bytes", "tree_flops",
                "rows_touched"):
    assert getattr(three, field) == 3 * getattr(one, field), field
  assert three.calls == one.calls + 4  # two more trees' ops and updates
  assert three.softmax_logits == 0  # the trees' ops do their own
  # Each tree's corrected head: K softmaxes of S = 8 slots over every token, in
  # TensorFlow's ops, and the corrections' products.
  ranked = costs.mixture_cost([one] * 3, 16, 64, head_cost=one, head_rank=2, head_slots=8)
  assert ranked.softmax_logits == 3 * 64 * 8
  assert ranked.parts[-1].name == "head corrections"
  assert ranked.parts[-1].elements == 3 * 2 * (16 + 8)


def test_the_mixture_evidence_is_linux_comments_after_an_epoch():
  ratio, figures = quality.quality_of("mixture32_head256", 1_000_000)
  assert [f.corpus for f in figures] == [quality.LINUX_EPOCH]
  assert ratio == pytest.approx(104.3 / 101.62)
  assert ratio < quality.quality_of("context32_head256", 1_000_000)[0]
  assert quality.quality_of("mixture3x16_head128")[0] == pytest.approx(102.66 / 101.62)
  assert quality.kind_of(MIXTURE) == "mixture32_head256"
  assert quality.kind_of(MIXTURE.replace("(32, head=256)", "(16, head=128)") +
                         ", 3 trees") == "mixture3x16_head128"
  assert quality.kind_of(MIXTURE + ", 3 trees") is None  # unmeasured
  assert quality.kind_of(MIXTURE.replace("(32, head=256)", "(8, head=2)")) is None
  assert quality.kind_of("HierarchicalSoftmax context(32, head=256)") == \
      "context32_head256"


def test_at_a_million_classes_a_bound_on_perplexity_recommends_a_mixture():
  """At V=1M, D=300, T=3,200, LazyAdam in 24 GiB with the training text: without a
  bound the rule's pick is a faster tree; within +0.2% of full softmax's perplexity the
  four-tree mixture is the only measured layer but full softmax, and far faster;
  within +1% four below a shared head that each corrects at rank 16, priced faster;
  among the trees with heads of their own, within +1.2% three are faster than four by
  more than the margin; within +1.5% three below a corrected shared head, priced faster
  than those three; within +3% the rule picks among the mixtures."""
  V = 1_000_000
  counts = 1.0 / np.arange(1, V + 1)
  ids = np.arange(2_000) % V
  common = {"counts": counts, "token_ids": ids, "optimizer": "lazy_adam",
            "memory_budget": 24 * 2**30, "machine": MACHINE, "adaptive": ()}
  free = tf_hsm.plan(V, 300, 3200, **common)
  assert free.recommended != MIXTURE
  four = tf_hsm.plan(V, 300, 3200, max_perplexity_increase=0.002, **common)
  assert four.recommended == MIXTURE.replace("(32, head=256)", "(16, head=128)") + \
      ", 4 trees", four.reason  # measured level with full softmax, far faster
  ranked_four = tf_hsm.plan(V, 300, 3200, max_perplexity_increase=0.01, **common)
  assert ranked_four.recommended == MIXTURE.replace(
      "(32, head=256)", "(16, shared head=128, rank 16)") + ", 4 trees", ranked_four.reason
  three = tf_hsm.plan(V, 300, 3200, max_perplexity_increase=0.012, **common,
                      trees=("mixture3x16_head128", "mixture4x16_head128"))
  assert three.recommended == MIXTURE.replace("(32, head=256)", "(16, head=128)") + \
      ", 3 trees", three.reason
  assert [t for t in three.layer.code.split("Tree.")[1:]] == [
      "from_context(token_ids, num_classes, counts, branching=16, head=128), ",
      "from_context(token_ids, num_classes, counts, branching=16, head=128, "
      "side='right'), ",
      "from_context(token_ids, num_classes, counts, branching=16, head=128, seed=1)])"]
  ranked = tf_hsm.plan(V, 300, 3200, max_perplexity_increase=0.015, **common)
  assert ranked.recommended == MIXTURE.replace("(32, head=256)", "(16, shared head=128, "
                                               "rank 16)") + ", 3 trees", ranked.reason
  assert ranked.layer.head_rank == 16 and "head=head, head_rank=16)" in ranked.layer.code
  assert ranked.to_dict()["layer"]["head_rank"] == 16
  assert ranked.rows[[r["method"] for r in ranked.rows].index(ranked.recommended)][
      "step_seconds"] < three.rows[[r["method"] for r in three.rows].index(
          three.recommended)]["step_seconds"]
  bound = tf_hsm.plan(V, 300, 3200, max_perplexity_increase=0.03, **common)
  assert bound.recommended.startswith("HierarchicalSoftmaxMixture"), bound.reason
  assert "of the layers within +3.0% perplexity" in bound.reason
  assert "linux-comments after an epoch" in bound.reason
  assert bound.layer.kind == "HierarchicalSoftmaxMixture" and bound.layer.rebuild is None


def _planned_mixture(ids, counts):
  """A plan of the mixture row alone, on a machine whose matmuls are slow: it is picked."""
  report = tf_hsm.plan(3_000, 16, 256, counts=counts, optimizer="lazy_adam",
                       machine=dict(MACHINE, matmul_flops=1e8), adaptive=(),
                       trees=("mixture32_head256",), token_ids=ids)
  assert report.recommended == MIXTURE, report.reason
  return report.layer


def test_the_recommended_mixture_is_built_from_the_text():
  ids, counts = support.zipf_ids()
  layer = _planned_mixture(ids, counts)
  expected = [tf_hsm.Tree.from_context(ids, 3_000, counts, branching=32, head=256,
                                       side=side) for side in ("left", "right")]
  assert layer.trees == expected
  assert layer.code == (
      "HierarchicalSoftmaxMixture([Tree.from_context(token_ids, num_classes, counts, "
      "branching=32, head=256), Tree.from_context(token_ids, num_classes, counts, "
      "branching=32, head=256, side='right')])")
  assert layer.tree is None  # a mixture's trees are `trees`
  built = layer.build(name="output", fused_update=True, ignore_class=0)
  assert isinstance(built, tf_hsm.HierarchicalSoftmaxMixture) and built.name == "output"
  assert [c.tree for c in built.components] == expected
  assert all(c.fused_update and c.ignore_class == 0 for c in built.components)
  assert layer.kwargs == {"components": expected}
  assert any("fused_update=True" in note
             for note in tf_hsm.plan(3_000, 16, 256, counts=counts, optimizer="lazy_adam",
                                     machine=dict(MACHINE, matmul_flops=1e8), adaptive=(),
                                     trees=("mixture32_head256",), token_ids=ids).notes)


def test_the_built_mixture_trains():
  import keras  # pylint: disable=g-import-not-at-top
  ids, counts = support.zipf_ids()
  layer = _planned_mixture(ids, counts).build(dtype="float32")
  rng = np.random.default_rng(0)
  hidden = keras.Input((8,))
  targets = keras.Input((), dtype="int32")
  model = keras.Model([hidden, targets], layer(hidden, targets))
  model.compile(optimizer=tf_hsm.optimizers.LazyAdam(0.05), loss=tf_hsm.losses.nll)
  x = rng.normal(size=(256, 8)).astype(np.float32)
  y = rng.integers(0, 3_000, 256).astype(np.int32)
  before = [w.numpy().copy() for w in layer.weights]
  history = model.fit([x, y], y, batch_size=64, epochs=2, verbose=0)
  assert history.history["loss"][-1] < history.history["loss"][0]
  assert all(not np.array_equal(b, w.numpy()) for b, w in zip(before, layer.weights))


def test_recommend_tree_refuses_a_mixture():
  ids, counts = support.zipf_ids()
  with pytest.raises(ValueError, match="mixture32_head256 is a HierarchicalSoftmaxMixture "
                                       "of trees, not a tree"):
    tf_hsm.planning.recommend_tree(3_000, 128, 2048, counts=counts, machine=MACHINE,
                                   trees=("mixture32_head256",), token_ids=ids)
  with pytest.raises(ValueError, match="pass token_ids"):
    tf_hsm.plan(3_000, 128, 2048, machine=MACHINE, adaptive=(),
                trees=("mixture16_head128",))


def test_a_vocabulary_too_small_for_the_mixture_says_so():
  ids, counts = support.zipf_ids(classes=200, tokens=5_000)
  report = tf_hsm.plan(200, 16, 256, counts=counts, machine=MACHINE, adaptive=(),
                       token_ids=ids, trees=("mixture32_head256", "mixture1x8_head4",
                                             "huffman8"))
  assert not any("Mixture" in r["method"] for r in report.rows)
  assert "no mixture32_head256 row: it needs V > 288 classes" in report.notes
  assert "no mixture1x8_head4 row: a mixture has at least 2 trees" in report.notes


def test_mixture_names_zero_trees_refused_two_trees_spelled_twice_once():
  ids, counts = support.zipf_ids()
  report = tf_hsm.plan(3_000, 16, 256, counts=counts, machine=MACHINE, adaptive=(),
                       token_ids=ids, trees=("mixture0x16_head128", "mixture00x8_head4",
                                             "mixture2x16_head128", "mixture16_head128"))
  assert "no mixture0x16_head128 row: a mixture has at least 2 trees" in report.notes
  assert "no mixture00x8_head4 row: a mixture has at least 2 trees" in report.notes
  mixtures = [r["method"] for r in report.rows if "Mixture" in r["method"]]
  assert mixtures == [MIXTURE.replace("(32, head=256)", "(16, head=128)")]
  with pytest.raises(TypeError, match="a list of tree names"):
    tf_hsm.plan(3_000, 16, 256, machine=MACHINE, adaptive=(), trees="huffman8")


def test_recommend_tree_leaves_the_mixtures_out_of_its_defaults():
  ids, counts = support.zipf_ids()
  tree, row = tf_hsm.planning.recommend_tree(3_000, 128, 2048, counts=counts,
                                             machine=MACHINE, trees=None, token_ids=ids)
  assert isinstance(tree, tf_hsm.Tree) and row["method"].startswith("HierarchicalSoftmax ")


def test_under_tf_keras_the_mixture_rows_are_priced_too(monkeypatch):
  ids, counts = support.zipf_ids()
  monkeypatch.setattr(tf_hsm, "_KERAS", "tf_hsm.tf_keras")
  report = tf_hsm.plan(3_000, 16, 256, counts=counts, machine=MACHINE, adaptive=(),
                       token_ids=ids)
  assert any("Mixture" in r["method"] for r in report.rows)
  assert not any("no mixture rows" in n for n in report.notes)


def test_a_model_holding_a_mixture_is_planned_by_its_body():
  """plan(model=...) reads a model whose output layer is a mixture as one holding a
  HierarchicalSoftmax: the body is the rest, V the mixture's classes."""
  import keras  # pylint: disable=g-import-not-at-top
  ids, counts = support.zipf_ids()
  tokens = keras.Input((8,), dtype="int32")
  targets = keras.Input((8,), dtype="int32")
  hidden = keras.layers.Embedding(3_000, 16)(tokens)
  output = _planned_mixture(ids, counts).build()
  model = keras.Model([tokens, targets], output(hidden, targets))
  report = tf_hsm.plan(model=model, tokens_per_step=256, counts=counts, machine=MACHINE,
                       adaptive=())
  assert report.settings["num_classes"] == 3_000 and report.settings["hidden"] == 16
  assert [layer["kind"] for layer in report.body["layers"]] == ["Embedding"]


SHARED = "HierarchicalSoftmaxMixture context(16, shared head=128), left and right, 3 trees"


def test_a_shared_head_row_prices_the_head_once_and_the_trees_over_the_tail():
  ids, counts = support.zipf_ids()
  report = tf_hsm.plan(3_000, 128, 2048, counts=counts, machine=MACHINE, adaptive=(),
                       token_ids=ids, optimizer="lazy_adam",
                       trees=("mixture3x16_head128", "mixture3x16_shared128"))
  rows = {r["method"]: r for r in report.rows}
  shared = rows[SHARED]
  apart = rows[SHARED.replace("shared head", "head")]
  gate, head_table = 128 * 3 + 3, 129 * 129
  # Three tables of the 2,872 tail classes' 16-ary trees, the head's 129 rows, the gate.
  tail = tf_hsm.Tree.huffman(np.delete(counts, np.argsort(-counts, kind="stable")[:128]),
                             branching=16)
  assert shared["param_bytes"] == pytest.approx(
      4 * (3 * tail.num_slots * 129 + head_table + gate), rel=0.01)
  assert shared["flops"] < 0.75 * apart["flops"]
  assert shared["step_seconds"] < apart["step_seconds"]
  assert "| HSM mixture3x16+128 |" in report.to_markdown()
  assert quality.kind_of(SHARED) == "mixture3x16_shared128"
  assert quality.quality_of("mixture3x16_shared128")[0] == pytest.approx(103.35 / 101.62)
  assert quality.kind_of(SHARED.replace("3 trees", "5 trees")) is None  # unmeasured


def test_the_recommended_shared_head_mixture_is_built_over_the_tail():
  ids, counts = support.zipf_ids()
  report = tf_hsm.plan(3_000, 16, 256, counts=counts, optimizer="lazy_adam",
                       machine=dict(MACHINE, matmul_flops=1e8), adaptive=(),
                       trees=("mixture3x16_shared128",), token_ids=ids)
  assert report.recommended == SHARED, report.reason
  head = np.argsort(-counts, kind="stable")[:128]
  np.testing.assert_array_equal(report.layer.head, head)
  tail = np.setdiff1d(np.arange(3_000), head)
  assert report.layer.trees[1] == tf_hsm.Tree.from_context(ids, 3_000, counts, branching=16,
                                                           side="right", classes=tail)
  built = report.layer.build(name="output", fused_update=True, ignore_class=0)
  assert isinstance(built, tf_hsm.HierarchicalSoftmaxMixture) and built.num_classes == 3_000
  np.testing.assert_array_equal(built.head_ids, head)
  assert built.ignore_class == 0 and all(c.ignore_class is None and c.fused_update
                                         for c in built.components)
  assert report.layer.build(head_rank=2).head_rank == 2
  narrow = report.layer.build(tail_dim=4, tail_projection_initializer="zeros")
  narrow.build((None, 16))
  assert narrow.tail_dim == 4 and narrow.tail_projection.shape == (16, 4)
  assert all(c.kernel.shape[-1] == 4 for c in narrow.components)
  assert set(report.layer.kwargs) == {"components", "head"}
  assert report.to_dict()["layer"]["head"] == head.tolist()


RANKED = SHARED.replace("shared head=128", "shared head=128, rank 16")


def test_a_row_whose_trees_correct_the_head_prices_the_corrections_and_builds_them():
  ids, counts = support.zipf_ids()
  report = tf_hsm.plan(3_000, 16, 256, counts=counts, optimizer="lazy_adam",
                       machine=dict(MACHINE, matmul_flops=1e8), adaptive=(),
                       trees=("mixture3x16_shared128", "mixture3x16_shared128_rank16"),
                       token_ids=ids)
  rows = {r["method"]: r for r in report.rows}
  # V [16, 3 x 16] and U [3, 16, 129] beside the shared head's row's tables.
  assert rows[RANKED]["param_bytes"] - rows[SHARED]["param_bytes"] == pytest.approx(
      4 * 3 * 16 * (16 + 129))
  assert rows[RANKED]["step_seconds"] > rows[SHARED]["step_seconds"]
  assert "| HSM mixture3x16+128r16 |" in report.to_markdown()
  assert quality.kind_of(RANKED) == "mixture3x16_shared128_rank16"
  assert quality.quality_of("mixture3x16_shared128_rank16")[0] == pytest.approx(
      103.11 / 101.62)
  assert quality.kind_of(RANKED.replace("rank 16", "rank 8")) is None  # unmeasured
  report = tf_hsm.plan(3_000, 16, 256, counts=counts, optimizer="lazy_adam",
                       machine=dict(MACHINE, matmul_flops=1e8), adaptive=(),
                       trees=("mixture3x16_shared128_rank16",), token_ids=ids)
  assert report.recommended == RANKED, report.reason
  built = report.layer.build(name="output", fused_update=True)
  assert built.head_rank == 16 and all(c.fused_update for c in built.components)
  assert not built.head.fused_update  # its table trains by its gradient
  assert report.layer.kwargs["head_rank"] == 16
  assert report.layer.build(head_rank=4).head_rank == 4  # the caller's, over the plan's


def test_a_rank_below_one_is_no_row():
  ids, counts = support.zipf_ids()
  report = tf_hsm.plan(3_000, 16, 256, counts=counts, machine=MACHINE, adaptive=(),
                       trees=("mixture3x16_shared128_rank0",), token_ids=ids)
  assert any("a head's correction has a rank of at least 1" in n for n in report.notes)
