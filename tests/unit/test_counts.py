"""`tf_hsm.planning.cutoffs.checked_counts`, which AdaptiveSoftmax and choose_cutoffs call:
each mistake gets a message that names it and its fix."""

import numpy as np
import pytest

from tf_hsm.planning.cutoffs import checked_counts


def test_valid_counts_come_back_as_float64():
  counts = checked_counts([5, 3, 3, 1, 0])
  assert counts.dtype == np.float64
  np.testing.assert_array_equal(counts, [5, 3, 3, 1, 0])
  assert checked_counts(np.array([0.5, 0.25, 0.25]), 3).shape == (3,)


def test_zipf_draws_are_recognised_as_samples():
  """The reported mistake: np.random.zipf's draws passed as counts. Their int64 sum
  overflows (to a negative or a wrapped value); the message says what they are and how
  to count them, not that they are not sorted."""
  draws = np.random.default_rng(0).zipf(1.2, size=100_000)
  with np.errstate(over="ignore"):
    assert draws.sum() < draws.astype(np.float64).sum()  # the int64 sum wraps
  with pytest.raises(ValueError, match=r"counts look like samples.*np\.bincount"):
    checked_counts(draws)
  with pytest.raises(ValueError, match=r"shape \[50000\].*samples.*np\.bincount"):
    checked_counts(draws, 50_000)


def test_samples_without_overflow_get_the_bincount_hint():
  draws = np.random.default_rng(1).zipf(2.0, size=10_000)
  with pytest.raises(ValueError, match=r"counts .*(samples|np\.bincount)"):
    checked_counts(draws)


def test_counts_of_samples_sorted_are_accepted():
  draws = np.random.default_rng(2).zipf(1.5, size=50_000)
  draws = draws[draws <= 1000] - 1
  frequencies = np.sort(np.bincount(draws, minlength=1000))[::-1]
  assert checked_counts(frequencies, 1000).sum() == draws.size


def test_int64_sum_overflow_of_real_counts_is_summed_in_float64():
  counts = np.array([2**62, 2**62, 2**61, 7], np.int64)
  with np.errstate(over="ignore"):
    assert counts.sum() < 0  # int64 wraps
  checked = checked_counts(counts)
  assert checked.sum() == pytest.approx(2.0**63 + 2.0**61)


def test_unsorted_counts_say_how_to_sort():
  with pytest.raises(ValueError, match=r"counts must be non-increasing.*counts\[2\] = 7 > "
                                       r"counts\[1\] = 3.*np\.argsort\(-counts"):
    checked_counts([10.5, 3, 7])


@pytest.mark.parametrize("counts, message", [
    ([3, np.nan, 1], r"counts must be finite: counts\[1\] is nan"),
    ([3, np.inf, 1], r"counts must be finite: counts\[1\] is inf"),
    ([1e308, 1e308], r"counts must be finite: their sum overflows"),
    ([3, -1, 0], r"counts must be non-negative.*counts\[1\] = -1"),
    ([0, 0, 0], r"counts must be non-negative and not all zero"),
    ([[3, 2], [1, 0]], r"counts must be a 1-D array"),
    ([3], r"counts must be a 1-D array of at least 2"),
    (["a", "b"], r"counts must be numbers"),
])
def test_bad_values_name_the_entry(counts, message):
  with pytest.raises(ValueError, match=message):
    checked_counts(counts)


def test_wrong_length():
  with pytest.raises(ValueError, match=r"counts must have shape \[4\], got \(3,\)$"):
    checked_counts([3, 2, 1], 4)


def test_the_planner_notes_unsorted_counts_and_keeps_the_adaptive_rows():
  """plan() with counts in a tokenizer's id order: the adaptive rows rank the classes by
  their counts (their layer takes class_order), and a note says so, in the table too."""
  from tf_hsm import planning
  counts = np.random.default_rng(3).permutation(1.0 / np.arange(1, 2001))
  report = planning.plan(2000, 64, 256, counts=counts, trees=("huffman2",),
                         machine={"matmul_flops": 2e11, "read_bytes": 2e10,
                                  "call_seconds": 1e-4})
  assert any(r["method"].startswith("AdaptiveSoftmax") for r in report.rows)
  assert any(n.startswith("the counts are not sorted by frequency") and "class_order" in n
             for n in report.notes)
  text = " ".join(report.to_markdown().split())
  assert all(" ".join(n.split()) in text for n in report.notes)

def test_the_planner_notes_counts_sorted_after_padding_ids():
  """Counts sorted by frequency after a padding id of count 0 (the README's id 0): the
  note says so and what class_order does with those ids, rather than "not sorted"."""
  from tf_hsm import planning
  counts = np.r_[0.0, 1.0 / np.arange(1, 2000)]
  report = planning.plan(2000, 64, 256, counts=counts, trees=("huffman2",),
                         machine={"matmul_flops": 2e11, "read_bytes": 2e10,
                                  "call_seconds": 1e-4})
  sorted_notes = [n for n in report.notes if "sorted by frequency" in n]
  assert len(sorted_notes) == 1, report.notes
  assert sorted_notes[0].startswith("the counts are sorted by frequency after ids [0]")
  assert "padding=[0] would leave them out" in sorted_notes[0]
  assert any(r["method"].startswith("AdaptiveSoftmax") for r in report.rows)
