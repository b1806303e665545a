"""plan(..., max_perplexity_increase=...): the rule over the layers whose comparable
measured perplexity lies within the bound (full softmax always does)."""

import numpy as np
import pytest

import tf_hsm
from tf_hsm.planning import cli

MACHINE = {"matmul_flops": 2e11, "read_bytes": 2.75e10, "call_seconds": 2e-4,
           "tree_step": (3e-11, 1e-10, 7e-11, 2e-7, 1e-8, 5e-4)}
COUNTS = 1.0 / np.arange(1, 1_000_001)


def _plan(bound, **kwargs):
  return tf_hsm.plan(1_000_000, 300, 3200, counts=COUNTS, optimizer="lazy_adam",
                     memory_budget=24 << 30, machine=MACHINE,
                     max_perplexity_increase=bound, **kwargs)


def test_the_bound_keeps_the_rule_to_layers_measured_within_it():
  free = _plan(None)
  by_method = {r["method"]: r for r in free.rows}
  assert by_method[free.recommended]["quality"] > 1.10  # a fast tree, far behind
  for bound in (0.0, 0.05, 0.10, 0.30):
    report = _plan(bound)
    best = next(r for r in report.rows if r["method"] == report.recommended)
    assert best["exact"] and best["quality"] <= 1 + bound, (bound, report.reason)
    assert report.reason.startswith(f"of the layers within {bound:+.1%} perplexity")
    # No layer within the bound with a comparable figure is faster by more than the rule's
    # margin: the choice is the rule's among them.
    faster = [r for r in report.rows if r["exact"] and r["quality"] is not None and
              r["quality"] <= 1 + bound and r["quality_tokens"] == best["quality_tokens"]
              and r["whole_step_seconds"] * (1 + tf_hsm.planning.QUALITY_MARGIN) <
              best["whole_step_seconds"]]
    assert not faster, (bound, [r["method"] for r in faster])
  assert _plan(0.0).recommended == "full softmax"
  assert _plan(0.1).to_dict()["settings"]["max_perplexity_increase"] == 0.1
  assert _plan(0.10).recommended == "HierarchicalSoftmax vectors(32, head=256)"


def test_an_early_figure_does_not_vouch_for_a_layer():
  # The demo's adaptive layout was measured after 4M tokens only (-1.5% there, behind
  # full softmax after an epoch in its kin's runs): within +1% only full softmax counts.
  report = _plan(0.01)
  early = next(r for r in report.rows if r["label"] == "adaptive demo")
  assert early["quality"] < 1.0 and report.recommended == "full softmax"


def test_with_nothing_within_the_bound_the_rule_runs_over_all_with_a_note():
  # With Adam's slots full softmax needs ~4.5 GiB, Huffman(8) (+23.5%) ~4.1.
  report = tf_hsm.plan(1_000_000, 300, 3200, counts=COUNTS, machine=MACHINE,
                       optimizer="lazy_adam", memory_budget=int(4.3 * 2 ** 30),
                       trees=("huffman8",), adaptive=(), max_perplexity_increase=0.05)
  assert not report.rows[0]["fits"]
  assert report.recommended == "HierarchicalSoftmax huffman(8)"
  assert any("no layer that fits was measured within +5.0%" in n for n in report.notes)
  assert not report.reason.startswith("of the layers within")


def test_recommend_tree_takes_the_bound():
  trees = ("huffman8", "vectors32_head256")
  _, free = tf_hsm.planning.recommend_tree(1_000_000, 300, 3200, counts=COUNTS,
                                           optimizer="lazy_adam", machine=MACHINE,
                                           trees=trees)
  _, bounded = tf_hsm.planning.recommend_tree(1_000_000, 300, 3200, counts=COUNTS,
                                              optimizer="lazy_adam", machine=MACHINE,
                                              trees=trees, max_perplexity_increase=0.1)
  assert free["method"] == "HierarchicalSoftmax huffman(8)"
  assert bounded["method"] == "HierarchicalSoftmax vectors(32, head=256)"


@pytest.mark.parametrize("bound", [-0.1, float("nan"), float("inf"), True, "10%"])
def test_a_bad_bound_is_named(bound):
  with pytest.raises(ValueError, match="max_perplexity_increase must be a fraction"):
    tf_hsm.plan(1_000, 64, 64, machine=MACHINE, max_perplexity_increase=bound)


def test_command_line_percent(capsys):
  import json  # pylint: disable=g-import-not-at-top
  common = ["--classes", "1M", "--hidden", "300", "--tokens", "3200", "--optimizer",
            "lazy_adam", "--memory", "24GiB", "--zipf", "1.0", "--machine",
            json.dumps(MACHINE), "--quiet"]
  for text in ("10", "10%"):
    assert cli.main(common + ["--max-ppl-increase", text]) == 0
    assert "Recommended: HierarchicalSoftmax vectors(32, head=256)" in \
        capsys.readouterr().out
  with pytest.raises(SystemExit):
    cli.main(common + ["--max-ppl-increase", "-5"])
  assert "not a percentage" in capsys.readouterr().err


def test_a_better_layer_just_outside_the_margin_is_named():
  """At 100K classes Huffman(32) (+15.3%) sat at +21% over the fastest step, where a
  re-measured machine had it at +13% and picked it: the reason names such a row."""
  from tf_hsm.planning import candidates  # pylint: disable=import-outside-toplevel

  def row(label, seconds, quality, gap=0.0, tokens=10e6):
    return {"label": label, "method": "HierarchicalSoftmax " + label,
            "whole_step_seconds": seconds, "quality": quality, "peak_bytes": 1,
            "quality_evidence": "measured", "quality_scale_gap": gap,
            "quality_tokens": tokens}

  full = row("full", 10.0, 1.0)
  fast, near = row("huffman8", 0.0124, 1.235), row("huffman32", 0.0150, 1.153)
  far = row("vectors", 0.0263, 1.081)  # 2.1x the fastest: not named
  best, reason = candidates._choose([fast, near, far, full], full, False)  # pylint: disable=protected-access
  assert best is fast
  assert "just outside the margin: huffman32 (+15.3% perplexity, 15.0 ms, +21% over" in reason
  assert "vectors" not in reason
  # A near row measured farther from this V (or for less training) is not compared.
  aside = row("huffman32", 0.0150, 1.153, gap=1.0)
  assert "just outside" not in candidates._choose([fast, aside, full], full, False)[1]  # pylint: disable=protected-access
  # Nor one that is no better than the pick.
  worse = row("two_level", 0.0150, 1.30)
  assert "just outside" not in candidates._choose([fast, worse, full], full, False)[1]  # pylint: disable=protected-access


def test_the_trade_the_pick_leaves_is_noted():
  """The note lists, by step, the slower layers that are each more accurate than every
  faster one, and sampled softmax's figure beside them."""
  from tf_hsm.planning import candidates  # pylint: disable=import-outside-toplevel

  def row(label, seconds, quality, gap=0.0):
    return {"label": label, "whole_step_seconds": seconds, "quality": quality,
            "quality_scale_gap": gap, "quality_tokens": 10e6}

  fast, best = row("huffman2", 0.010, 1.30), row("huffman8", 0.0124, 1.235)
  rows = [fast, best, row("huffman32", 0.0150, 1.153), row("wider", 0.030, 1.20),
          row("vectors", 0.0263, 1.081), row("vectors64", 0.040, 1.080),  # no better
          row("far", 0.016, 1.01, gap=1.0),  # measured farther from V: not compared
          row("unknown", 0.017, None), row("learned", 0.39, 1.074),
          row("full", 10.0, 1.0)]
  sampled = row("sampled", 0.0534, 1.036)
  (note,) = candidates._more_accurate_note(rows, best, sampled)  # pylint: disable=protected-access
  assert note.startswith("more accurate than the pick (+23.5%), and slower: huffman32 "
                         "(+15.3% perplexity, 15.0 ms, 1.2x its step); vectors (+8.1% "
                         "perplexity, 26.3 ms, 2.1x its step); full (+0.0% perplexity")
  for left_out in ("huffman2", "wider", "vectors64", "far", "unknown", "learned"):
    assert left_out not in note  # faster, no better, not comparable, or past three
  assert note.endswith("x its step) (sampled softmax, approximate: +3.6%, 53.4 ms, 4.3x "
                       "its step)")
  assert candidates._more_accurate_note([best, fast], best, sampled) == []  # pylint: disable=protected-access
  # At V=1M the planner notes it under the pick.
  report = _plan(None)
  assert any(n.startswith("more accurate than the pick") and "HSM vectors32/256" in n
             for n in report.notes), report.notes
