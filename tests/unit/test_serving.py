"""tf_hsm.serving's stock-op functions against the op and a float64 reference: every kind of
tree, both dtypes, biases or none, padding, ties, k >= num_classes, the beam's retries, XLA,
and the AdaptiveSoftmax versions."""

import os

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tf_hsm
from oracle import log_prob_reference, random_inputs, random_mixed_tree, trees_of_every_kind
from tf_hsm import serving
from tf_hsm.serving import hsm

settings.register_profile("serving", max_examples=40, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow])

_TREES = trees_of_every_kind(np.random.default_rng(63))


def _rel(dtype):
  return 1e-5 if dtype == np.float32 else 1e-12


def _assert_same_top_k(values, classes, ref_full, k, tol):
  """The classes are the reference's wherever the k-th and (k+1)-th values differ by more
  than tol; the values match the sorted reference."""
  order = np.argsort(-ref_full, axis=-1, kind="stable")
  sorted_full = np.take_along_axis(ref_full, order, -1)
  np.testing.assert_allclose(values, sorted_full[:, :k], rtol=tol, atol=tol)
  for row in range(len(ref_full)):
    gap_ok = k == ref_full.shape[1] or sorted_full[row, k - 1] - sorted_full[row, k] > tol
    if gap_ok:
      assert set(classes[row].tolist()) == set(order[row, :k].tolist()), row
    np.testing.assert_allclose(ref_full[row, classes[row]], values[row], rtol=tol, atol=tol)


@pytest.fixture(params=[hsm.CHUNK, 3], ids=["chunk64", "chunk3"])
def chunk(request, monkeypatch):
  """Runs a test with the default chunk and with chunks of 3 children (the while_loop
  path on every tree with a node of more than 3 children)."""
  monkeypatch.setattr(hsm, "CHUNK", request.param)
  return request.param


@pytest.mark.parametrize("name,tree", _TREES, ids=[n for n, _ in _TREES])
def test_functions_match_the_op_and_the_reference(name, tree, chunk, rng):
  del name, chunk
  for dtype, bias in ((np.float32, True), (np.float64, False)):
    hidden, weights, biases, targets = random_inputs(rng, tree, (3, 4), 5, dtype, bias)
    targets[0, 0] = -1
    got = serving.log_prob(hidden, weights, biases, tree, targets).numpy()
    safe = np.maximum(targets, 0)
    op = tf_hsm.log_prob(hidden, weights, biases, tree, safe).numpy()
    op[0, 0] = 0.0
    ref = log_prob_reference(hidden, weights, biases, tree, safe)[0].reshape(3, 4)
    ref[0, 0] = 0.0
    assert got.dtype == dtype and got.shape == (3, 4)
    np.testing.assert_allclose(got, op, rtol=_rel(dtype), atol=_rel(dtype))
    np.testing.assert_allclose(got, ref, rtol=_rel(dtype), atol=_rel(dtype))
    full = serving.log_prob_all(hidden, weights, biases, tree).numpy()
    np.testing.assert_allclose(full, tf_hsm.log_prob_all(hidden, weights, biases, tree),
                               rtol=_rel(dtype), atol=_rel(dtype))
    for k in sorted({1, min(4, tree.num_classes), tree.num_classes}):
      values, classes = serving.top_k(hidden, weights, biases, tree, k)
      assert values.shape == (3, 4, k) and classes.dtype == tf.int64
      op_values, op_classes = tf_hsm.top_k(hidden, weights, biases, tree, k)
      np.testing.assert_allclose(values, op_values, rtol=_rel(dtype), atol=_rel(dtype))
      _assert_same_top_k(values.numpy().reshape(12, k), classes.numpy().reshape(12, k),
                         full.reshape(12, -1), k, 10 * _rel(dtype))
      tol = 10 * _rel(dtype)
      op_flat, flat = op_classes.numpy().reshape(12, k), classes.numpy().reshape(12, k)
      sorted_full = -np.sort(-full.reshape(12, -1), -1)
      for row in range(12):
        if k == tree.num_classes or sorted_full[row, k - 1] - sorted_full[row, k] > tol:
          assert set(op_flat[row]) == set(flat[row])


def test_targets_at_or_past_num_classes_give_nan(rng):
  tree = tf_hsm.Tree.balanced(20, 3)
  hidden, weights, biases, _ = random_inputs(rng, tree, (3,), 4, np.float32)
  out = serving.log_prob(hidden, weights, biases, tree, [5, 20, 99]).numpy()
  assert np.isfinite(out[0]) and np.isnan(out[1:]).all()


def test_k_past_num_classes_is_clamped(rng):
  tree = tf_hsm.Tree.huffman(rng.integers(1, 50, 7), branching=3)
  hidden, weights, biases, _ = random_inputs(rng, tree, (5,), 3, np.float32)
  values, classes = serving.top_k(hidden, weights, biases, tree, 50)
  assert values.shape == (5, 7)
  full = tf_hsm.log_prob_all(hidden, weights, biases, tree).numpy()
  np.testing.assert_array_equal(np.sort(classes.numpy(), -1), np.tile(np.arange(7), (5, 1)))
  np.testing.assert_allclose(values, -np.sort(-full, -1), rtol=1e-5, atol=1e-6)
  with pytest.raises(ValueError, match="k"):
    serving.top_k(hidden, weights, biases, tree, 0)


@pytest.mark.parametrize("name,tree", [t for t in _TREES if t[0] in
                                       ("mixed", "huffman", "two_level", "chains")])
def test_ties_come_in_increasing_class_order_as_the_op_gives_them(name, tree):
  del name
  hidden = np.ones((2, 3), np.float32)
  weights = np.zeros((tree.num_slots, 3), np.float32)   # every node uniform
  k = min(5, tree.num_classes)
  values, classes = serving.top_k(hidden, weights, None, tree, k)
  op_values, op_classes = tf_hsm.top_k(hidden, weights, None, tree, k)
  np.testing.assert_allclose(values, op_values, rtol=1e-5, atol=1e-6)
  # Where the op's k-th value is not tied with the (k+1)-th, its classes, in its order.
  full = tf_hsm.log_prob_all(hidden, weights, None, tree).numpy()
  for row in range(2):
    ranked = np.lexsort((np.arange(full.shape[1]), -full[row]))
    np.testing.assert_array_equal(classes[row], ranked[:k])
    np.testing.assert_array_equal(op_classes[row], ranked[:k])


@pytest.mark.parametrize("widths", [(1, 1, 2), (1, 1, 100)], ids=["twice_too_narrow",
                                                                  "retry_suffices"])
def test_rows_the_beam_cannot_prove_are_searched_again(widths, monkeypatch, rng):
  factor, minimum, widen = widths
  monkeypatch.setattr(hsm, "BEAM_FACTOR", factor)
  monkeypatch.setattr(hsm, "BEAM_MIN", minimum)
  monkeypatch.setattr(hsm, "WIDEN", widen)
  tree = random_mixed_tree(rng, max_depth=5, max_branching=6, p_internal=0.5)
  hidden, weights, biases, _ = random_inputs(rng, tree, (40,), 6, np.float64)
  hidden[:20] *= 0.05      # nearly uniform rows: narrow beams cannot prove them
  k = 3
  values, classes = serving.top_k(hidden, weights, biases, tree, k)
  full = tf_hsm.log_prob_all(hidden, weights, biases, tree).numpy()
  _assert_same_top_k(values.numpy(), classes.numpy(), full, k, 1e-10)


@pytest.mark.parametrize("name,tree", [t for t in _TREES if t[0] in
                                       ("mixed", "huffman3", "two_level_counts")])
def test_under_xla_the_functions_give_the_same_results(name, tree, rng):
  del name
  hidden, weights, biases, targets = random_inputs(rng, tree, (6,), 5, np.float32)
  k = min(4, tree.num_classes)

  def run(hidden):
    return (serving.log_prob(hidden, weights, biases, tree, targets),
            serving.top_k(hidden, weights, biases, tree, k),
            serving.log_prob_all(hidden, weights, biases, tree),
            serving.sample(hidden, weights, biases, tree, seed=3))

  eager = run(tf.constant(hidden))
  xla = tf.function(run, jit_compile=True)(tf.constant(hidden))
  np.testing.assert_allclose(xla[0], eager[0], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(xla[1][0], eager[1][0], rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(xla[1][1], eager[1][1])
  np.testing.assert_allclose(xla[2], eager[2], rtol=1e-5, atol=1e-5)
  assert ((xla[3].numpy() >= 0) & (xla[3].numpy() < tree.num_classes)).all()


def test_sample_follows_the_distribution(rng):
  tree = random_mixed_tree(rng, max_depth=4, max_branching=5, max_classes=10)
  hidden = np.repeat(rng.normal(size=(1, 3)), 4000, axis=0)
  weights = rng.normal(size=(tree.num_slots, 3))
  probs = np.exp(tf_hsm.log_prob_all(hidden[:1], weights, None, tree).numpy()[0])
  draws = serving.sample(hidden, weights, None, tree, seed=7).numpy()
  again = serving.sample(hidden, weights, None, tree, seed=7).numpy()
  np.testing.assert_array_equal(draws, again)
  observed = np.bincount(draws, minlength=tree.num_classes)
  expected = probs * len(draws)
  keep = expected > 5
  cells_o = np.append(observed[keep], observed[~keep].sum())
  cells_e = np.append(expected[keep], expected[~keep].sum())
  cells_o, cells_e = cells_o[cells_e > 0], cells_e[cells_e > 0]
  chi2 = ((cells_o - cells_e) ** 2 / cells_e).sum()
  dof = max(len(cells_e) - 1, 1)
  assert chi2 < dof + 8 * np.sqrt(2 * dof) + 10, (chi2, dof)


def test_empty_batches_and_wrong_widths(rng):
  tree = tf_hsm.Tree.two_level(30)
  _, weights, biases, _ = random_inputs(rng, tree, (1,), 4, np.float32)
  empty = np.zeros((0, 4), np.float32)
  assert serving.log_prob(empty, weights, biases, tree, np.zeros(0, np.int64)).shape == (0,)
  values, classes = serving.top_k(empty, weights, biases, tree, 3)
  assert values.shape == (0, 3) and classes.shape == (0, 3)
  assert serving.log_prob_all(empty, weights, biases, tree).shape == (0, 30)
  with pytest.raises(ValueError, match="width"):
    serving.top_k(np.zeros((2, 5), np.float32), weights, biases, tree, 3)
  with pytest.raises(TypeError, match="targets"):
    serving.log_prob(np.zeros((2, 4), np.float32), weights, biases, tree, [0.5, 1.0])


# --------------------------------------------------------------------------- Hypothesis

@st.composite
def problems(draw):
  seed = draw(st.integers(0, 2**32 - 1))
  rng = np.random.default_rng(seed)
  kind = draw(st.sampled_from(["mixed", "balanced", "huffman", "two_level"]))
  if kind == "mixed":
    tree = random_mixed_tree(rng, max_depth=draw(st.integers(1, 6)),
                             max_branching=draw(st.integers(1, 20)),
                             p_internal=draw(st.floats(0.0, 0.7)), max_classes=120)
  elif kind == "balanced":
    tree = tf_hsm.Tree.balanced(draw(st.integers(1, 150)), draw(st.integers(2, 17)))
  elif kind == "huffman":
    tree = tf_hsm.Tree.huffman(rng.integers(1, 1000, draw(st.integers(2, 150))),
                               branching=draw(st.integers(2, 12)))
  else:
    tree = tf_hsm.Tree.two_level(draw(st.integers(1, 300)))
  tokens = draw(st.integers(0, 12))
  dim = draw(st.integers(1, 9))
  dtype = draw(st.sampled_from([np.float32, np.float64]))
  scale = draw(st.sampled_from([0.1, 1.0, 4.0]))
  hidden = (scale * rng.normal(size=(tokens, dim))).astype(dtype)
  weights = (0.5 * rng.normal(size=(tree.num_slots, dim))).astype(dtype)
  biases = rng.normal(size=tree.num_slots).astype(dtype) if draw(st.booleans()) else None
  targets = rng.integers(0, tree.num_classes, tokens)
  return tree, hidden, weights, biases, targets, dtype


@settings(settings.get_profile("serving"))
@given(problems(), st.integers(1, 8))
def test_random_problems_match_the_op(problem, k):
  tree, hidden, weights, biases, targets, dtype = problem
  tol = _rel(dtype) * 10
  np.testing.assert_allclose(serving.log_prob(hidden, weights, biases, tree, targets),
                             tf_hsm.log_prob(hidden, weights, biases, tree, targets),
                             rtol=tol, atol=tol)
  full = tf_hsm.log_prob_all(hidden, weights, biases, tree).numpy()
  values, classes = serving.top_k(hidden, weights, biases, tree, k)
  k = min(k, tree.num_classes)
  _assert_same_top_k(values.numpy(), classes.numpy(), full, k, tol)


# --------------------------------------------------------------------------- adaptive

def _adaptive_layer(tail, rng, dtype="float32"):
  layer = tf_hsm.AdaptiveSoftmax(60, [10, 25], div_value=2.0, head_bias=True, tail=tail,
                                 dtype=dtype)
  layer.build((None, 8))
  for v in layer.weights:
    v.assign(rng.normal(size=v.shape).astype(dtype))
  return layer


@pytest.mark.parametrize("tail", ["flat", "two_level"])
def test_adaptive_functions_match_the_layer(tail, rng):
  layer = _adaptive_layer(tail, rng)
  weights = serving.AdaptiveWeights.from_layer(layer)
  hidden = rng.normal(size=(3, 5, 8)).astype(np.float32)
  targets = rng.integers(0, 60, (3, 5))
  targets[0, 0] = -1
  np.testing.assert_allclose(serving.adaptive_log_prob(weights, hidden, targets),
                             layer(hidden, targets), rtol=1e-5, atol=1e-5)
  bad = serving.adaptive_log_prob(weights, hidden[0], [0, 60, 1, 2, 3]).numpy()
  assert np.isnan(bad[1]) and np.isfinite(bad[[0, 2, 3, 4]]).all()
  full = layer.log_prob_all(hidden).numpy()
  np.testing.assert_allclose(serving.adaptive_log_prob_all(weights, hidden), full,
                             rtol=1e-5, atol=1e-5)
  for k in (1, 7, 60, 100):
    values, classes = serving.adaptive_top_k(weights, hidden, k)
    kk = min(k, 60)
    assert values.shape == (3, 5, kk)
    _assert_same_top_k(values.numpy().reshape(15, kk), classes.numpy().reshape(15, kk),
                       full.reshape(15, 60), kk, 1e-4)
  draws = serving.adaptive_sample(weights, hidden, seed=1).numpy()
  assert draws.shape == (3, 5) and ((draws >= 0) & (draws < 60)).all()
  xla = tf.function(lambda h: serving.adaptive_top_k(weights, h, 7), jit_compile=True)
  np.testing.assert_array_equal(xla(tf.constant(hidden))[1],
                                serving.adaptive_top_k(weights, hidden, 7)[1])


def test_the_serving_package_imports_no_op_wrapper():
  """tf_hsm.serving's own modules import only NumPy, TensorFlow and each other."""
  folder = os.path.dirname(serving.__file__)
  for name in os.listdir(folder):
    if not name.endswith(".py") or name == "bench.py":  # the bench times the op too
      continue
    with open(os.path.join(folder, name)) as f:
      for line in f:
        stripped = line.strip()
        if stripped.startswith(("import ", "from ")) and "tf_hsm" in stripped:
          assert stripped.startswith("from tf_hsm.serving"), (name, stripped)
