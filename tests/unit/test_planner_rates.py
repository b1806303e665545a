"""The planner's rates for what its roofline and its SGD-fitted tree step mispriced at
V=1M: the optimizer's slots in a tree's step (a coefficient of their own) and
`tf.nn.sampled_softmax_loss`'s ops per logit (a rate of their own)."""

import numpy as np
import pytest

import tf_hsm
from tf_hsm import planning as planner
from tf_hsm.planning import step_fit, tree_work

COUNTS = 1.0 / np.arange(1, 20_001)
TREE = tf_hsm.Tree.huffman(COUNTS, branching=8)
PROBS = COUNTS / COUNTS.sum()
SEVEN = (2e-11, 9e-11, 3e-10, 1e-10, 4e-7, 2e-8, 5e-4)


def _tree_row(machine, optimizer):
  cost = planner.tree_cost(TREE, 64, 512, PROBS)
  return planner.price("tree", cost, 64, 512, optimizer, "float32", machine)


def test_slots_are_priced_by_their_own_coefficient():
  machine = planner.Machine(1e11, 1e10, 1e-4, tree_step=SEVEN)
  sgd, adam = _tree_row(machine, "sgd"), _tree_row(machine, "lazy_adam")
  touched = sum(p.touched for p in planner.tree_cost(TREE, 64, 512, PROBS).parts)
  # Adam's two slots: each touched element's m and v read and written.
  assert adam["slot_bytes_moved"] == pytest.approx(2 * 2 * touched * 4)
  assert sgd["slot_bytes_moved"] == 0
  # The rest of what the two move is the same: the difference is the slots' term alone.
  assert (adam["bytes_moved"] - adam["slot_bytes_moved"] ==
          pytest.approx(sgd["bytes_moved"]))
  assert adam["step_seconds"] - sgd["step_seconds"] == pytest.approx(
      SEVEN[3] * adam["slot_bytes_moved"])


def test_a_fit_of_six_terms_prices_the_slots_as_bytes():
  """A machine given (or cached) with the six coefficients of before: its slots cost
  what they did, the bytes' rate."""
  six = SEVEN[:3] + SEVEN[4:]
  machine = planner.Machine(1e11, 1e10, 1e-4, tree_step=six)
  assert machine.tree_step == SEVEN[:3] + SEVEN[2:3] + SEVEN[4:]
  row = _tree_row(machine, "lazy_adam")
  before = np.dot(six, (row["flops"] - row["small_node_flops"], row["small_node_flops"],
                        row["bytes_moved"], row["node_visits"], row["children_scored"],
                        1.0))
  assert row["step_seconds"] == pytest.approx(before)
  with pytest.raises(ValueError, match="7 coefficients.*got 5"):
    planner.Machine(1e11, 1e10, 1e-4, tree_step=SEVEN[:5])


def test_sampled_softmax_logits_at_their_own_rate():
  V, D, T = 100_000, 128, 1024
  probs = 1.0 / np.arange(1, V + 1)
  probs /= probs.sum()
  cost = planner.sampled_softmax_cost(V, D, T, probs)
  assert cost.sampled_logits == T * 1025 and cost.softmax_logits == 0
  slow = planner.Machine(1e11, 1e10, 1e-4, softmax_seconds=2e-9,
                         sampled_logit_seconds=6e-9)
  old = planner.Machine(1e11, 1e10, 1e-4, softmax_seconds=2e-9)
  assert old.sampled_logit_seconds == 2e-9  # not measured: the softmax's rate, as before
  seconds = [planner.price("s", cost, D, T, "lazy_adam", "float32", m)["step_seconds"]
             for m in (slow, old)]
  assert seconds[0] - seconds[1] == pytest.approx(T * 1025 * 4e-9)
  # The full softmax's logits stay at the fused softmax's rate.
  full = planner.full_softmax_cost(V, D, T)
  assert (planner.price("f", full, D, T, "sgd", "float32", slow)["step_seconds"] ==
          planner.price("f", full, D, T, "sgd", "float32", old)["step_seconds"])


def test_fit_features_split_the_slots_off():
  sgd = step_fit.features(TREE, 64, 512, PROBS, "sgd")
  adam = step_fit.features(TREE, 64, 512, PROBS, "lazy_adam")
  assert len(sgd) == len(tree_work.TREE_STEP_TERMS) - 1
  slot = tree_work.TREE_STEP_TERMS.index("slot bytes moved")
  assert sgd[slot] == 0 and adam[slot] > 0
  assert [a for i, a in enumerate(adam) if i != slot] == pytest.approx(
      [a for i, a in enumerate(sgd) if i != slot])


def test_fit_recovers_seven_coefficients_from_sgd_and_adam_steps():
  """Shapes stepped with SGD and with Adam pin the slots' coefficient apart from the
  bytes'."""
  amounts = [(1e6, 0, 1e5, 0, 1e3, 1e4), (1e9, 0, 1e8, 0, 2e3, 1e6),
             (0, 5e8, 4e8, 0, 1e4, 3e5), (7e7, 1e6, 3e7, 0, 4e4, 5e5),
             (2e9, 0, 1e7, 0, 5e2, 2e6), (0, 4e6, 3e6, 0, 2e4, 5e4),
             (3e8, 2e7, 5e6, 0, 9e3, 8e5), (3e8, 2e7, 5e6, 1e7, 9e3, 8e5),
             (1e6, 0, 1e5, 2e5, 1e3, 1e4)]
  rows = [a + (float(np.dot(SEVEN, a + (1.0,))),) for a in amounts]
  assert step_fit.fit(rows) == pytest.approx(SEVEN, rel=1e-6)


def test_time_step_runs_each_optimizer_and_names_a_wrong_one():
  for optimizer in step_fit.OPTIMIZERS:
    seconds, tree = step_fit.time_step(2_000, 16, 64, "huffman8", repeats=1,
                                       optimizer=optimizer)
    assert seconds > 0 and tree.num_classes == 2_000
  with pytest.raises(ValueError, match="optimizer must be one of"):
    step_fit.time_step(2_000, 16, 64, "huffman8", repeats=1, optimizer="adam")


def test_the_sampled_probe_runs():
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  from tf_hsm.planning import machine  # pylint: disable=import-outside-toplevel
  probe = machine._sampled_probe(tf)  # pylint: disable=protected-access
  assert np.isfinite(probe())


@pytest.mark.parametrize("fields, named", [
    (dict(matmul_flops=-1.0), "matmul_flops must be a finite number > 0"),
    (dict(read_bytes=0.0), "read_bytes must be a finite number > 0"),
    (dict(call_seconds=float("nan")), "call_seconds must be a finite number >= 0"),
    (dict(softmax_seconds=-1e-9), "softmax_seconds must be"),
    (dict(sampled_logit_seconds=float("inf")), "sampled_logit_seconds must be"),
    (dict(loop_step_seconds="fast"), "loop_step_seconds must be a number"),
    (dict(tree_step=SEVEN[:6] + (-1.0,)), "tree_step's 'step' coefficient must be"),
    (dict(tree_step=("x",) * 7), "tree_step must be numbers"),
])
def test_a_machine_with_a_rate_that_prices_nonsense_is_refused(fields, named):
  """A negative matmul rate priced a step at 176 million seconds, silently."""
  rates = dict(matmul_flops=1e11, read_bytes=1e10, call_seconds=1e-4)
  with pytest.raises(ValueError, match=named):
    planner.Machine(**dict(rates, **fields))
  planner.Machine(**rates, loop_step_seconds=None, tree_step=SEVEN)  # the defaults pass
