"""The planner's quality evidence looked up by vocabulary size: a row takes the figures
of the measured vocabulary size nearest to its V, and says which."""

import numpy as np
import pytest

import tf_hsm
from tf_hsm.planning import candidates
from tf_hsm.planning import quality

SMALL, LARGE = "small corpus (V=6,000)", "large corpus (V=150,000)"
MACHINE = {"matmul_flops": 200e9, "read_bytes": 20e9, "call_seconds": 100e-6}


@pytest.fixture
def two_sizes(monkeypatch):
  """Evidence at two vocabulary sizes: huffman8 +10% at 6K and +2% at 150K; two_level
  measured at 6K only."""
  monkeypatch.setattr(quality, "CORPUS_CLASSES", {SMALL: 6_000, LARGE: 150_000})
  monkeypatch.setattr(quality, "FULL", {SMALL: 100.0, LARGE: 200.0})
  monkeypatch.setattr(quality, "EVIDENCE", (
      quality.Figure("full", SMALL, 100.0, "test"),
      quality.Figure("full", LARGE, 200.0, "test"),
      quality.Figure("huffman8", SMALL, 110.0, "test"),
      quality.Figure("huffman8", LARGE, 204.0, "test"),
      quality.Figure("two_level", SMALL, 103.0, "test")))


@pytest.mark.parametrize("num_classes, expected", [
    (1_000, 1.10), (6_000, 1.10), (30_000, 1.10), (40_000, 1.02), (150_000, 1.02),
    (1_000_000, 1.02), (10_000_000, 1.02)])
def test_the_nearest_measured_size_gives_the_figure(two_sizes, num_classes, expected):
  ratio, figures = quality.quality_of("huffman8", num_classes)
  assert ratio == pytest.approx(expected)
  assert len(figures) == 1


def test_without_a_size_every_figure_counts(two_sizes):
  ratio, figures = quality.quality_of("huffman8")
  assert ratio == pytest.approx((1.10 + 1.02) / 2) and len(figures) == 2


def test_a_kind_measured_at_one_size_only_keeps_it_and_says_how_far(two_sizes):
  ratio, figures = quality.quality_of("two_level", 1_000_000)
  assert ratio == pytest.approx(1.03) and figures[0].corpus == SMALL
  text = quality.describe("two_level", 1_000_000)
  assert "V=6,000" in text and "167x fewer classes than this row's 1,000,000" in text
  assert quality.is_far_kind("two_level", 1_000_000)
  assert "7x fewer classes" in quality.describe("huffman8", 1_000_000)
  # Near its measured size it is not marked.
  assert "fewer" not in quality.describe("two_level", 8_000)
  assert not quality.is_far_kind("two_level", 8_000)


def test_far_marks_only_beyond_the_factor(two_sizes):
  assert not quality.is_far_kind("huffman8", 150_000 * 3)
  assert quality.is_far_kind("huffman8", 150_000 * 3 + 1)
  assert quality.is_far_kind("huffman8", 6_000 // 3 - 1)
  assert not quality.is_far_kind("full", 10_000_000)  # the reference, 1 at any V


def test_same_magnitude_corpora_are_averaged():
  """The project's three corpora (V=4,989-10,000) are one size: all three count."""
  ratio, figures = quality.quality_of("huffman8", 8_000)
  assert {f.corpus for f in figures} == {quality.STDLIB, quality.KJV, quality.FORTUNES}
  assert ratio == pytest.approx(np.mean([f.ratio for f in figures]))


def test_bad_sizes_and_unknown_corpora_are_named():
  with pytest.raises(ValueError, match="num_classes must be a positive number"):
    quality.quality_of("huffman8", 0)
  with pytest.raises(ValueError, match="'nowhere' has no vocabulary size"):
    quality.classes_of("nowhere")
  assert quality.quality_of("huffman5", 1_000) == (None, [])
  assert quality.describe("huffman5", 1_000) == "not measured"


def test_column_note_names_the_corpora_and_the_distance():
  small = quality.column_note(6_000)
  # The trees from vectors were measured at large vocabularies only: their figures come
  # from there at any V, and the note's range says so.
  assert "English text" in small and "V=4,989-113,946" in small and "fewer" not in small
  assert "recommender" in small  # never English figures silently for other data
  large = quality.column_note(150_000)
  # Each large corpus once, with the range of its checkpoints the rows take.
  assert "debian-docs at 4.0M-16.6M training tokens" in large, large
  assert "linux-comments at 4.0M-10.8M training tokens" in large, large
  far = quality.column_note(1_000_000)
  assert "9x fewer classes than the table's V=1,000,000" in far and "~" in far


def test_plan_rows_carry_the_size_they_were_measured_at(two_sizes):
  counts = 1.0 / np.arange(1, 200_001)
  report = tf_hsm.plan(200_000, 64, 512, counts=counts, machine=MACHINE,
                       trees=("huffman8", "two_level"), adaptive=())
  rows = {r["quality_kind"]: r for r in report.rows}
  assert rows["huffman8"]["quality"] == pytest.approx(1.02)
  assert not rows["huffman8"]["quality_far"]
  assert rows["two_level"]["quality"] == pytest.approx(1.03)
  assert rows["two_level"]["quality_far"]
  assert "33x fewer classes" in rows["two_level"]["quality_evidence"]
  table = report.to_markdown()
  # two_level's figure, far and farther than huffman8's, is marked ^ in place of ~.
  assert "| ^3 |" in table and "| 2.0 |" in table
  assert "ppl+%: measured perplexity" in table.replace("\n", " ")


def test_quality_cell_marks_far_figures():
  assert candidates._quality_cell(1.078, True) == "~8"
  assert candidates._quality_cell(1.031, True) == "~3"
  assert candidates._quality_cell(1.046) == "4.6" and candidates._quality_cell(None) == "?"
