"""Property-based tests (Hypothesis): random trees of any depth, branching and mix of leaf
depths, shapes including empty ones, both float dtypes and tables whole or in pieces.

The suite runs the "ci" profile (about 400 examples in all, ~10 s); set
HYPOTHESIS_PROFILE=long for a longer search.
"""

import os

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tf_hsm
from oracle import log_prob_reference, random_mixed_tree

settings.register_profile("ci", max_examples=100, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("long", max_examples=1000, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@st.composite
def problems(draw, max_tokens=24):
  """(tree, hidden, weights, biases, targets, dtype) with a tree drawn from a seed: random
  mixed trees (any depth up to 6, branching up to 20, leaves at mixed depths) or one of
  the builders."""
  seed = draw(st.integers(0, 2**32 - 1))
  rng = np.random.default_rng(seed)
  kind = draw(st.sampled_from(["mixed", "balanced", "huffman", "two_level", "single"]))
  if kind == "mixed":
    tree = random_mixed_tree(rng, max_depth=draw(st.integers(1, 6)),
                             max_branching=draw(st.integers(1, 20)),
                             p_internal=draw(st.floats(0.0, 0.7)), max_classes=120)
  elif kind == "balanced":
    tree = tf_hsm.Tree.balanced(draw(st.integers(1, 150)), draw(st.integers(2, 17)))
  elif kind == "huffman":
    tree = tf_hsm.Tree.huffman(rng.integers(1, 1000, draw(st.integers(2, 150))),
                               branching=draw(st.integers(2, 12)))
  elif kind == "two_level":
    tree = tf_hsm.Tree.two_level(draw(st.integers(1, 300)))
  else:
    tree = tf_hsm.Tree.from_nested([0])
  tokens = draw(st.integers(0, max_tokens))
  dim = draw(st.integers(0, 9))
  dtype = draw(st.sampled_from([np.float32, np.float64]))
  hidden = rng.normal(size=(tokens, dim)).astype(dtype)
  weights = (0.5 * rng.normal(size=(tree.num_slots, dim))).astype(dtype)
  biases = rng.normal(size=tree.num_slots).astype(dtype) if draw(st.booleans()) else None
  targets = rng.integers(0, tree.num_classes, tokens)
  return tree, hidden, weights, biases, targets, dtype


def _tol(dtype):
  return 1e-10 if dtype == np.float64 else 2e-4


def _pieces(table, count):
  """The table as `count` consecutive row ranges (some may be empty-free: at least one
  row each)."""
  count = max(1, min(count, len(table)))
  cuts = np.linspace(0, len(table), count + 1).astype(int)
  return [tf.Variable(table[a:b]) for a, b in zip(cuts[:-1], cuts[1:])]


@given(problems(), st.integers(1, 3))
def test_values_and_gradients_match_the_float64_reference(problem, pieces):
  tree, hidden, weights, biases, targets, dtype = problem
  ref, ref_dh, ref_dw, ref_db = log_prob_reference(hidden, weights, biases, tree, targets)
  tol = _tol(dtype)
  h = tf.constant(hidden)
  whole_w = tf.Variable(weights)
  split_w = _pieces(weights, pieces)
  for table, sources in ((whole_w, [whole_w]), (split_w, split_w)):
    with tf.GradientTape() as tape:
      tape.watch(h)
      out = tf_hsm.log_prob(h, table, biases, tree, targets)
      total = tf.reduce_sum(out)
    grads = tape.gradient(total, [h] + sources)
    np.testing.assert_allclose(out.numpy(), ref, rtol=tol, atol=tol)
    if len(targets):
      np.testing.assert_allclose(grads[0].numpy(), ref_dh, rtol=tol, atol=tol)
      dense = np.concatenate([
          np.zeros(s.shape, dtype) if g is None else tf.convert_to_tensor(g).numpy()
          for g, s in zip(grads[1:], sources)])
      np.testing.assert_allclose(dense, ref_dw, rtol=tol, atol=tol)


@given(problems(max_tokens=12))
def test_the_full_distribution_sums_to_one_and_agrees_with_log_prob(problem):
  tree, hidden, weights, biases, targets, dtype = problem
  full = tf_hsm.log_prob_all(hidden, weights, biases, tree).numpy()
  assert full.shape == (len(targets), tree.num_classes)
  tol = _tol(dtype)
  np.testing.assert_allclose(np.exp(full).sum(axis=-1), 1.0, rtol=tol * 10, atol=tol * 10)
  picked = full[np.arange(len(targets)), targets] if len(targets) else np.zeros(0)
  np.testing.assert_allclose(
      picked, tf_hsm.log_prob(hidden, weights, biases, tree, targets).numpy(), rtol=tol,
      atol=tol)


@given(problems(max_tokens=12), st.integers(1, 6))
def test_top_k_is_the_head_of_the_sorted_distribution(problem, k):
  tree, hidden, weights, biases, _, dtype = problem
  k = min(k, tree.num_classes)
  log_probs, classes = tf_hsm.top_k(hidden, weights, biases, tree, k)
  full = tf_hsm.log_prob_all(hidden, weights, biases, tree).numpy()
  expected = -np.sort(-full, axis=-1)[:, :k]
  tol = _tol(dtype)
  np.testing.assert_allclose(log_probs.numpy(), expected, rtol=tol, atol=tol)
  if len(full):
    np.testing.assert_allclose(np.take_along_axis(full, classes.numpy(), axis=-1),
                               log_probs.numpy(), rtol=tol, atol=tol)


@settings(max_examples=8)
@given(st.integers(0, 2**32 - 1))
def test_sample_frequencies_follow_the_distribution(seed):
  rng = np.random.default_rng(seed)
  tree = random_mixed_tree(rng, max_depth=4, max_branching=6, max_classes=12)
  dim = 3
  hidden = np.repeat(rng.normal(size=(1, dim)), 4000, axis=0).astype(np.float64)
  weights = rng.normal(size=(tree.num_slots, dim))
  probs = np.exp(tf_hsm.log_prob_all(hidden[:1], weights, None, tree).numpy()[0])
  draws = tf_hsm.sample(hidden, weights, None, tree, seed=seed % 1000).numpy()
  observed = np.bincount(draws, minlength=tree.num_classes)
  expected = probs * len(draws)
  keep = expected > 5  # the chi-square approximation needs enough counts per cell
  rest_observed = observed[~keep].sum()
  rest_expected = expected[~keep].sum()
  cells_o = np.append(observed[keep], rest_observed)
  cells_e = np.append(expected[keep], rest_expected)
  cells_o, cells_e = cells_o[cells_e > 0], cells_e[cells_e > 0]
  chi2 = ((cells_o - cells_e) ** 2 / cells_e).sum()
  dof = max(len(cells_e) - 1, 1)
  # Far beyond the 0.999 quantile for these degrees of freedom (at most ~12).
  assert chi2 < dof + 8 * np.sqrt(2 * dof) + 10, (chi2, dof)


@given(problems(max_tokens=6), st.sampled_from(["targets", "weights", "hidden"]))
def test_bad_inputs_raise_errors_that_name_them(problem, which):
  tree, hidden, weights, biases, targets, _ = problem
  if which == "targets":
    bad = np.full(max(len(targets), 1), tree.num_classes)
    hidden = np.zeros((len(bad), hidden.shape[1]), hidden.dtype)
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError), match="targets"):
      tf_hsm.log_prob(hidden, weights, biases, tree, bad)
  elif which == "weights":
    with pytest.raises(TypeError, match="weights"):
      tf_hsm.log_prob(hidden, weights.astype(np.int32), biases, tree, targets)
  else:
    with pytest.raises(TypeError, match="hidden"):
      tf_hsm.log_prob(hidden.astype(np.float16 if hidden.dtype == np.float64 else np.float64)
                      if hidden.dtype == np.float32 else hidden.astype(np.float32),
                      weights, biases, tree, targets)
