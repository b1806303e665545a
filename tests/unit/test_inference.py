"""tf_hsm.inference (top_k, log_prob_all, sample, log_prob_candidates) against brute force
over all classes, on every tree kind; sampling by a chi-square test; every bad input."""

import math

import numpy as np
import pytest
import tensorflow as tf

import tf_hsm
from oracle import chain_tree, log_prob_reference, trees_of_every_kind
from tf_hsm.ops import loader as _loader
from tf_hsm.ops.inference import log_prob_all, log_prob_candidates, sample, top_k

TOL = {np.float64: 1e-10, np.float32: 2e-4}


def all_log_probs(hidden, weights, biases, tree):
  """log P(c | h) for every row and class, in float64, straight from the definition.

  Returns [N, C] for hidden [..., D] flattened to N rows.
  """
  h = np.asarray(hidden, np.float64).reshape(-1, np.shape(hidden)[-1])
  z = h @ np.asarray(weights, np.float64).T
  if biases is not None:
    z = z + np.asarray(biases, np.float64)
  starts = tree.child_begin[:-1]
  sizes = np.diff(tree.child_begin)
  m = np.maximum.reduceat(z, starts, axis=1)
  lse = m + np.log(np.add.reduceat(np.exp(z - np.repeat(m, sizes, axis=1)), starts, axis=1))
  local = z - lse[:, tree.slot_node]
  return np.add.reduceat(local[:, tree.path_slots], tree.path_begin[:-1], axis=1)


def _inputs(rng, tree, batch_shape, dim, dtype, bias=True, scale=0.5):
  hidden = rng.normal(size=batch_shape + (dim,)).astype(dtype)
  weights = (scale * rng.normal(size=(tree.num_slots, dim))).astype(dtype)
  biases = rng.normal(size=tree.num_slots).astype(dtype) if bias else None
  return hidden, weights, biases


def test_reference_agrees_with_oracle(rng):
  tree = trees_of_every_kind(rng)[0][1]
  hidden, weights, biases = _inputs(rng, tree, (4,), 5, np.float64)
  ref = all_log_probs(hidden, weights, biases, tree)
  targets = rng.integers(0, tree.num_classes, size=4)
  expected = log_prob_reference(hidden, weights, biases, tree, targets)[0]
  np.testing.assert_allclose(ref[np.arange(4), targets], expected, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------
# log_prob_all
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("batch_shape", [(13,), (2, 3, 4)])
@pytest.mark.parametrize("bias", [True, False])
def test_log_prob_all_matches_reference(rng, dtype, batch_shape, bias):
  for name, tree in trees_of_every_kind(rng):
    hidden, weights, biases = _inputs(rng, tree, batch_shape, int(rng.integers(1, 40)), dtype,
                                      bias)
    out = log_prob_all(hidden, weights, biases, tree)
    assert out.shape == batch_shape + (tree.num_classes,) and out.dtype == dtype, name
    ref = all_log_probs(hidden, weights, biases, tree)
    np.testing.assert_allclose(out.numpy().reshape(ref.shape), ref, rtol=TOL[dtype],
                               atol=TOL[dtype], err_msg=name)


@pytest.mark.parametrize("rows", [5, 40])  # below and above the packed-kernel threshold
def test_log_prob_all_chunks_equal_slices(rng, rows):
  for name, tree in trees_of_every_kind(rng):
    hidden, weights, biases = _inputs(rng, tree, (rows,), 9, np.float32)
    full = log_prob_all(hidden, weights, biases, tree).numpy()
    c = tree.num_classes
    for begin, end in [(0, c), (0, 1), (c - 1, c), (c // 3, c // 3 + (c + 1) // 2), (c // 2, c // 2)]:
      part = log_prob_all(hidden, weights, biases, tree, class_range=(begin, end)).numpy()
      assert part.shape == (rows, end - begin)
      np.testing.assert_array_equal(part, full[:, begin:end], err_msg=f"{name} [{begin}, {end})")
    # Chunks cover the whole range.
    chunks = [log_prob_all(hidden, weights, biases, tree, class_range=(b, min(b + 37, c)))
              for b in range(0, c, 37)]
    np.testing.assert_array_equal(np.concatenate(chunks, axis=-1), full, err_msg=name)


def test_log_prob_all_keeps_a_plan_per_tree_not_per_shape(rng):
  # Huffman trees over the same number of classes have the same tensor sizes; eager calls
  # share one kernel, which keeps the last whole tree's plan. Alternating trees (and batch
  # sizes) must never reuse a plan made for another tree.
  # (Equal counts give a balanced tree, Zipf counts a deep one.)
  c = 300
  trees = [tf_hsm.Tree.huffman(np.ones(c)),
           tf_hsm.Tree.huffman(rng.zipf(1.5, size=c).astype(np.float64))]
  assert trees[0].num_slots == trees[1].num_slots
  assert trees[0].max_depth < trees[1].max_depth
  hidden, weights, biases = _inputs(rng, trees[0], (40,), 6, np.float32)
  first = None
  for i, rows in enumerate([40, 40, 40, 7, 40]):
    tree = trees[i % 2]
    out = log_prob_all(hidden[:rows], weights, biases, tree).numpy()
    ref = all_log_probs(hidden[:rows], weights, biases, tree)
    np.testing.assert_allclose(out, ref, rtol=2e-4, atol=2e-4, err_msg=f"call {i}")
    if i == 0:
      first = out
    elif i == 4:
      np.testing.assert_array_equal(out, first)  # the first tree again: the same bits


def test_log_prob_all_tensor_range_and_graph_shapes(rng):
  tree = tf_hsm.Tree.two_level(300)
  hidden, weights, biases = _inputs(rng, tree, (6,), 8, np.float32)
  full = log_prob_all(hidden, weights, biases, tree).numpy()
  out = log_prob_all(hidden, weights, biases, tree, class_range=tf.constant([10, 50]))
  np.testing.assert_array_equal(out.numpy(), full[:, 10:50])
  f = tf.function(lambda h, r: log_prob_all(h, weights, biases, tree, class_range=r))
  np.testing.assert_array_equal(f(hidden, tf.constant([3, 7], tf.int64)).numpy(), full[:, 3:7])
  g = tf.function(lambda h: log_prob_all(h, weights, biases, tree, class_range=(5, 25)))
  spec = g.get_concrete_function(tf.TensorSpec([None, 8], tf.float32)).structured_outputs
  assert spec.shape.as_list() == [None, 20]


def test_log_prob_all_sums_to_one_and_half_precision(rng):
  tree = tf_hsm.Tree.huffman(rng.zipf(1.5, size=500).astype(np.float64))
  hidden, weights, biases = _inputs(rng, tree, (3, 4), 16, np.float32)
  probs = np.exp(log_prob_all(hidden, weights, biases, tree).numpy().astype(np.float64))
  np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-4)
  half = log_prob_all(tf.cast(hidden, tf.float16), weights, biases, tree)
  assert half.dtype == tf.float16 and half.shape == (3, 4, tree.num_classes)


# ---------------------------------------------------------------------------------------
# top_k
# ---------------------------------------------------------------------------------------


def _check_top_k(values, classes, ref, k, tol, name):
  """values/classes [N, k] against the reference [N, C]."""
  assert values.shape == classes.shape == (ref.shape[0], k), name
  expected = -np.sort(-ref, axis=1)[:, :k]
  np.testing.assert_allclose(values, expected, rtol=tol, atol=tol, err_msg=name)
  picked = np.take_along_axis(ref, classes, axis=1)
  np.testing.assert_allclose(values, picked, rtol=tol, atol=tol, err_msg=name)
  assert (np.diff(values, axis=1) <= 0).all(), name
  for row in classes:
    assert len(set(row.tolist())) == k, name


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("batch_shape", [(11,), (2, 1, 3)])
@pytest.mark.parametrize("bias", [True, False])
def test_top_k_matches_brute_force(rng, dtype, batch_shape, bias):
  for name, tree in trees_of_every_kind(rng):
    hidden, weights, biases = _inputs(rng, tree, batch_shape, int(rng.integers(1, 30)), dtype,
                                      bias)
    ref = all_log_probs(hidden, weights, biases, tree)
    c = tree.num_classes
    for k in sorted({1, min(5, c), c}):
      values, classes = top_k(hidden, weights, biases, tree, k)
      assert values.shape == batch_shape + (k,) and values.dtype == dtype, name
      assert classes.dtype == tf.int64, name
      _check_top_k(values.numpy().reshape(-1, k), classes.numpy().reshape(-1, k), ref, k,
                   TOL[dtype], f"{name} k={k}")
      if k == c:  # every class, each once
        np.testing.assert_array_equal(np.sort(classes.numpy().reshape(-1, k), axis=1),
                                      np.tile(np.arange(c), (ref.shape[0], 1)))


def test_top_k_matches_the_training_op(rng):
  """Brute force through tf_hsm.log_prob evaluated on every class."""
  tree = tf_hsm.Tree.huffman(rng.zipf(1.3, size=200).astype(np.float64), branching=3)
  hidden, weights, biases = _inputs(rng, tree, (7,), 12, np.float32)
  c = tree.num_classes
  every = tf_hsm.log_prob(np.repeat(hidden, c, axis=0), weights, biases, tree,
                          np.tile(np.arange(c), 7)).numpy().reshape(7, c)
  values, classes = top_k(hidden, weights, biases, tree, 10)
  _check_top_k(values.numpy(), classes.numpy(), every.astype(np.float64), 10, 2e-4, "huffman3")


def test_top_k_tie_order():
  # Zero weights on a complete binary tree: all classes equally likely, smallest ids first.
  tree = tf_hsm.Tree.balanced(32, 2)
  values, classes = top_k(np.ones((3, 4), np.float32), np.zeros((tree.num_slots, 4), np.float32),
                          None, tree, 6)
  np.testing.assert_array_equal(classes.numpy(), np.tile(np.arange(6), (3, 1)))
  np.testing.assert_allclose(values.numpy(), np.log(1 / 32), rtol=1e-6)
  # Class 0 ties with class 1 but sits below a single-child node: still first.
  tree = tf_hsm.Tree.from_nested([1, [0]])
  _, classes = top_k(np.ones((1, 2)), np.zeros((tree.num_slots, 2)), None, tree, 2)
  np.testing.assert_array_equal(classes.numpy(), [[0, 1]])
  # Chains of single-child nodes.
  tree = chain_tree(7, 4)
  _, classes = top_k(np.ones((2, 3)), np.zeros((tree.num_slots, 3)), None, tree, 7)
  np.testing.assert_array_equal(classes.numpy(), np.tile(np.arange(7), (2, 1)))


def test_top_k_expands_few_nodes_when_peaked(rng):
  tree = tf_hsm.Tree.two_level(10_000)  # 100 clusters of 100
  hidden, weights, biases = _inputs(rng, tree, (32,), 16, np.float32, scale=1.0)
  values, classes, expanded = top_k(hidden, weights, biases, tree, 5, return_num_expanded=True)
  assert expanded.shape == (32,) and expanded.dtype == tf.int64
  expanded = expanded.numpy()
  assert (expanded >= 2).all() and expanded.mean() < 0.2 * tree.num_nodes, expanded
  _, _, everything = top_k(hidden[:3], weights, biases, tree, tree.num_classes,
                           return_num_expanded=True)
  np.testing.assert_array_equal(everything.numpy(), tree.num_nodes)
  ref = all_log_probs(hidden, weights, biases, tree)
  _check_top_k(values.numpy(), classes.numpy(), ref, 5, 2e-4, "two_level")


def test_top_k_is_deterministic_and_batch_independent(rng):
  tree = tf_hsm.Tree.two_level(3000)
  hidden, weights, biases = _inputs(rng, tree, (70,), 10, np.float32, scale=0.3)
  v1, c1 = top_k(hidden, weights, biases, tree, 8)
  v2, c2 = top_k(hidden, weights, biases, tree, 8)
  np.testing.assert_array_equal(v1.numpy(), v2.numpy())
  np.testing.assert_array_equal(c1.numpy(), c2.numpy())
  # A row alone gets the same classes (values agree to rounding: kernels differ by batch).
  v3, c3 = top_k(hidden[20:21], weights, biases, tree, 8)
  np.testing.assert_array_equal(c3.numpy()[0], c1.numpy()[20])
  np.testing.assert_allclose(v3.numpy()[0], v1.numpy()[20], rtol=1e-5, atol=1e-5)


def test_top_k_nan_row(rng):
  tree = tf_hsm.Tree.two_level(100)
  hidden, weights, biases = _inputs(rng, tree, (4,), 6, np.float32)
  hidden[2, 3] = np.nan
  values, classes = top_k(hidden, weights, biases, tree, 3)
  assert np.isnan(values.numpy()[2]).all() and not np.isnan(values.numpy()[[0, 1, 3]]).any()
  np.testing.assert_array_equal(classes.numpy()[2], [0, 1, 2])  # NaN ties: by class id


# ---------------------------------------------------------------------------------------
# sample
# ---------------------------------------------------------------------------------------


def _chi_square(samples, log_probs):
  """Pearson's statistic and degrees of freedom, classes expected < 5 times pooled."""
  n = samples.size
  counts = np.bincount(samples, minlength=log_probs.size).astype(np.float64)
  expected = n * np.exp(log_probs)
  small = expected < 5
  obs = np.append(counts[~small], counts[small].sum())
  exp = np.append(expected[~small], expected[small].sum())
  if exp[-1] == 0:
    obs, exp = obs[:-1], exp[:-1]
  return float(((obs - exp) ** 2 / exp).sum()), obs.size - 1


def _chi_square_limit(df, z=6.0):
  """Upper chi-square quantile at z standard deviations (Wilson-Hilferty): with z = 6 a
  correct sampler fails with probability about 1e-9. With no degree of freedom (one class
  holds all the mass) the statistic of a correct sampler is 0, up to rounding."""
  if df == 0:
    return 1e-6
  a = 2.0 / (9.0 * df)
  return df * (1 - a + z * math.sqrt(a)) ** 3


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("temperature", [1.0, 2.5, 0.6])
def test_sample_matches_the_distribution(rng, dtype, temperature):
  for name, tree in [("huffman", tf_hsm.Tree.huffman(rng.zipf(1.5, size=60).astype(float))),
                     ("mixed", trees_of_every_kind(rng)[1][1])]:
    hidden, weights, biases = _inputs(rng, tree, (1,), 6, dtype, scale=0.4)
    draws = 30_000
    samples = sample(np.repeat(hidden, draws, axis=0), weights, biases, tree, seed=1234,
                     temperature=temperature).numpy()
    assert samples.dtype == np.int64 and samples.shape == (draws,)
    assert samples.min() >= 0 and samples.max() < tree.num_classes
    # Tempering every node = the model with weights and biases divided by T.
    expected = all_log_probs(hidden, weights / temperature,
                             None if biases is None else biases / temperature, tree)[0]
    stat, df = _chi_square(samples, expected)
    assert stat < _chi_square_limit(df), (name, stat, df)
    # The test has power: the untempered distribution is rejected.
    if temperature != 1.0 and df > 0:
      wrong = all_log_probs(hidden, weights, biases, tree)[0]
      stat, df = _chi_square(samples, wrong)
      assert stat > _chi_square_limit(df), (name, "power", stat, df)


def test_sample_is_reproducible(rng):
  tree = tf_hsm.Tree.two_level(500)
  hidden, weights, biases = _inputs(rng, tree, (4, 25), 8, np.float32)
  a = sample(hidden, weights, biases, tree, seed=7).numpy()
  b = sample(hidden, weights, biases, tree, seed=7).numpy()
  c = sample(hidden, weights, biases, tree, seed=8).numpy()
  assert a.shape == (4, 25)
  np.testing.assert_array_equal(a, b)
  assert (a != c).any()
  # A row's sample depends on its position only: a prefix of the batch agrees.
  np.testing.assert_array_equal(sample(hidden[:1], weights, biases, tree, seed=7).numpy(), a[:1])
  # seed=None draws from TF's global random state.
  tf.random.set_seed(3)
  d = sample(hidden, weights, biases, tree).numpy()
  e = sample(hidden, weights, biases, tree).numpy()
  tf.random.set_seed(3)
  np.testing.assert_array_equal(sample(hidden, weights, biases, tree).numpy(), d)
  assert (d != e).any()
  f = tf.function(lambda h: sample(h, weights, biases, tree))
  assert (f(hidden).numpy() != f(hidden).numpy()).any()
  g = tf.function(lambda h, s: sample(h, weights, biases, tree, seed=s))
  np.testing.assert_array_equal(g(hidden, tf.constant(7, tf.int64)).numpy(), a)


def test_sample_small_temperature_is_greedy(rng):
  tree = tf_hsm.Tree.huffman(rng.zipf(1.5, size=300).astype(float), branching=4)
  hidden, weights, biases = _inputs(rng, tree, (50,), 8, np.float64)
  samples = sample(hidden, weights, biases, tree, seed=1, temperature=1e-9).numpy()
  # Greedy descent: at every node the child with the largest logit.
  z = hidden @ weights.T + biases
  for i in range(50):
    node, c = 0, None
    while c is None:
      begin, end = tree.child_range(node)
      child = int(tree.slot_child[begin + np.argmax(z[i, begin:end])])
      c, node = (child, None) if child < tree.num_classes else (None, child - tree.num_classes)
    assert samples[i] == c


def test_sample_masked_and_nan_rows(rng):
  tree = tf_hsm.Tree.two_level(40)
  hidden, weights, biases = _inputs(rng, tree, (400,), 5, np.float32)
  biases[tree.class_slot[3]] = -np.inf  # class 3 can never be drawn
  samples = sample(hidden, weights, biases, tree, seed=2).numpy()
  assert (samples != 3).all() and (samples >= 0).all()
  hidden[7, 0] = np.nan
  samples = sample(hidden, weights, biases, tree, seed=2).numpy()
  assert samples[7] == -1 and (np.delete(samples, 7) >= 0).all()


# ---------------------------------------------------------------------------------------
# log_prob_candidates
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("batch_shape", [(9,), (2, 3, 2)])
@pytest.mark.parametrize("bias", [True, False])
def test_log_prob_candidates_match_reference(rng, dtype, batch_shape, bias):
  for name, tree in trees_of_every_kind(rng):
    hidden, weights, biases = _inputs(rng, tree, batch_shape, int(rng.integers(1, 30)), dtype,
                                      bias)
    m = int(rng.integers(1, 8))
    candidates = rng.integers(0, tree.num_classes, size=batch_shape + (m,))
    candidates[..., 0] = candidates[..., -1]  # repeated candidates
    out = log_prob_candidates(hidden, weights, biases, tree, candidates.astype(np.int32))
    assert out.shape == candidates.shape and out.dtype == dtype, name
    ref = all_log_probs(hidden, weights, biases, tree)
    expected = np.take_along_axis(ref, candidates.reshape(ref.shape[0], m), axis=1)
    np.testing.assert_allclose(out.numpy().reshape(expected.shape), expected, rtol=TOL[dtype],
                               atol=TOL[dtype], err_msg=name)


def test_log_prob_candidates_many_rows_agree_with_log_prob(rng):
  tree = tf_hsm.Tree.two_level(2000)
  hidden, weights, biases = _inputs(rng, tree, (100,), 16, np.float32)
  candidates = rng.integers(0, 2000, size=(100, 20))
  out = log_prob_candidates(hidden, weights, biases, tree, candidates).numpy()
  single = tf_hsm.log_prob(np.repeat(hidden, 20, axis=0), weights, biases, tree,
                           candidates.reshape(-1)).numpy().reshape(100, 20)
  np.testing.assert_allclose(out, single, rtol=1e-5, atol=1e-5)
  empty = log_prob_candidates(hidden, weights, biases, tree, np.zeros((100, 0), np.int64))
  assert empty.shape == (100, 0)


# ---------------------------------------------------------------------------------------
# No gradients; bad inputs
# ---------------------------------------------------------------------------------------


def test_no_gradients(rng):
  tree = tf_hsm.Tree.two_level(50)
  hidden, weights, biases = _inputs(rng, tree, (3,), 4, np.float32)
  h = tf.constant(hidden)
  with tf.GradientTape(persistent=True) as tape:
    tape.watch(h)
    outs = [top_k(h, weights, biases, tree, 2)[0], log_prob_all(h, weights, biases, tree),
            log_prob_candidates(h, weights, biases, tree, np.zeros((3, 2), np.int64))]
  for out in outs:
    assert tape.gradient(out, h) is None


TREE = tf_hsm.Tree.balanced(20, 4)


def _args(n=5, d=6):
  rng = np.random.default_rng(0)
  return (rng.normal(size=(n, d)).astype(np.float32),
          rng.normal(size=(TREE.num_slots, d)).astype(np.float32),
          rng.normal(size=TREE.num_slots).astype(np.float32))


@pytest.mark.parametrize("k", [0, -1, 21, 2.5, True, None])
def test_bad_k(k):
  h, w, b = _args()
  with pytest.raises(ValueError, match="k must be an integer in"):
    top_k(h, w, b, TREE, k)


def test_k_attr_checked_by_the_kernel():
  h, w, b = _args()
  t = [TREE.child_begin, TREE.path_begin, TREE.path_nodes, TREE.path_slots, TREE.slot_child]
  with pytest.raises(tf.errors.InvalidArgumentError, match="k = 21 must be in"):
    _loader.ops().hsm_top_k(h, w, b, *t, k=21)


@pytest.mark.parametrize("temperature", [0.0, -1.0, float("nan"), float("inf")])
def test_bad_temperature(temperature):
  h, w, b = _args()
  with pytest.raises(ValueError, match="temperature must be positive and finite"):
    sample(h, w, b, TREE, seed=1, temperature=temperature)
  with pytest.raises(tf.errors.InvalidArgumentError, match="temperature"):
    sample(h, w, b, TREE, seed=1, temperature=tf.constant(temperature))


def test_bad_seed():
  h, w, b = _args()
  with pytest.raises(ValueError, match="seed must fit in int64"):
    sample(h, w, b, TREE, seed=2**64)
  with pytest.raises(TypeError, match="seed must be int32 or int64"):
    sample(h, w, b, TREE, seed=1.5)
  for pair in ([1, 2], tf.constant([1, 2])):
    with pytest.raises(ValueError, match=r"seed must be one integer \(a scalar\)"):
      sample(h, w, b, TREE, seed=pair)


@pytest.mark.parametrize("class_range", [(-1, 3), (3, 2), (0, 21), (1, 2, 3), (0.0, 2)])
def test_bad_class_range(class_range):
  h, w, b = _args()
  with pytest.raises(ValueError, match="class_range must be"):
    log_prob_all(h, w, b, TREE, class_range=class_range)


@pytest.mark.parametrize("class_range", [[-1, 3], [3, 2], [0, 21]])
def test_bad_class_range_tensor(class_range):
  h, w, b = _args()
  with pytest.raises((tf.errors.InvalidArgumentError, ValueError), match="class_range"):
    log_prob_all(h, w, b, TREE, class_range=tf.constant(class_range, tf.int64))
  with pytest.raises((tf.errors.InvalidArgumentError, ValueError), match="class_range"):
    log_prob_all(h, w, b, TREE, class_range=tf.constant([0, 1, 2], tf.int64))


@pytest.mark.parametrize("bad", [20, -1, 10**12])
def test_candidates_out_of_range(bad):
  h, w, b = _args()
  candidates = np.zeros((5, 3), np.int64)
  candidates[2, 1] = bad
  with pytest.raises(tf.errors.InvalidArgumentError,
                     match=rf"candidates\[2, 1\] = {bad} .*\[0, 20\)"):
    log_prob_candidates(h, w, b, TREE, candidates)


def test_candidates_shape_mismatch():
  h, w, b = _args()
  for shape in [(4, 3), (5,), (5, 3, 1)]:
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError)):
      log_prob_candidates(h, w, b, TREE, np.zeros(shape, np.int64))
  with pytest.raises(TypeError, match="candidates must be int32 or int64"):
    log_prob_candidates(h, w, b, TREE, np.zeros((5, 3), np.float32))


@pytest.mark.parametrize("op", ["top_k", "log_prob_all", "sample", "log_prob_candidates"])
def test_shape_and_type_mismatches(op):
  h, w, b = _args()
  calls = {
      "top_k": lambda h, w, b, t: top_k(h, w, b, t, 2),
      "log_prob_all": log_prob_all,
      "sample": lambda h, w, b, t: sample(h, w, b, t, seed=1),
      "log_prob_candidates": lambda h, w, b, t: log_prob_candidates(
          h, w, b, t, np.zeros((5, 2), np.int64)),
  }
  call = calls[op]
  with pytest.raises((tf.errors.InvalidArgumentError, ValueError), match="D = 5|Dimension"):
    call(h[:, :5], w, b, TREE)
  with pytest.raises(tf.errors.InvalidArgumentError, match="slots .* weights has"):
    call(h, w[:-1], b[:-1], TREE)
  with pytest.raises(tf.errors.InvalidArgumentError, match="biases must be a vector"):
    call(h, w, b[:-2], TREE)
  with pytest.raises(TypeError, match="same dtype"):
    call(h.astype(np.float64), w, b, TREE)
  with pytest.raises(TypeError, match="tf_hsm.Tree"):
    call(h, w, b, [[0, 1]])


def _raw_calls(arrays):
  """Each op on the raw tree arrays [child_begin, path_begin, path_nodes, path_slots,
  slot_child], reading the whole tree."""
  h, w, b = _args()
  ops = _loader.ops()
  return {
      "top_k": lambda: ops.hsm_top_k(h, w, b, *arrays, k=20),
      "log_prob_all": lambda: ops.hsm_log_prob_all(h, w, b, np.array([0, 20]), *arrays),
      "log_prob_all_chunk": lambda: ops.hsm_log_prob_all(h, w, b, np.array([0, 20]) // 2,
                                                         *arrays),
      "sample": lambda: ops.hsm_sample(h, w, b, np.int64(1), np.float32(1), *arrays),
      "log_prob_candidates": lambda: ops.hsm_log_prob_candidates(
          h, w, b, np.tile(np.arange(20), (5, 1)), *arrays[:4]),
  }


def _tree_arrays():
  return [np.array(TREE.child_begin), np.array(TREE.path_begin), np.array(TREE.path_nodes),
          np.array(TREE.path_slots), np.array(TREE.slot_child)]


@pytest.mark.parametrize("index,position,value,pattern,ops", [
    (4, 0, 10**6, "slot_child", ["top_k", "log_prob_all", "sample"]),
    (4, 1, -2, "slot_child", ["top_k", "log_prob_all", "sample"]),
    (4, 0, 20, "numbered after its parent", ["top_k", "log_prob_all", "sample"]),  # the root
    (0, 1, 10**9, "child_begin", ["top_k", "log_prob_all", "sample", "log_prob_candidates"]),
    (0, 2, -5, "child_begin", ["top_k", "log_prob_all", "sample", "log_prob_candidates"]),
    (1, 1, 10**9, "path_begin", ["log_prob_all_chunk", "log_prob_candidates"]),
    (2, 0, 99, "path_nodes", ["log_prob_all_chunk", "log_prob_candidates"]),
    (3, 0, 10**6, "path_slots", ["log_prob_candidates"]),
])
def test_malformed_tree_tensors(index, position, value, pattern, ops):
  arrays = _tree_arrays()
  arrays[index][position] = value
  calls = _raw_calls(arrays)
  for op in ops:
    with pytest.raises(tf.errors.InvalidArgumentError, match=pattern):
      calls[op]()


def test_duplicated_class_in_slot_child():
  arrays = _tree_arrays()
  slot_child = arrays[4]
  leaves = np.flatnonzero(slot_child < 20)
  slot_child[leaves[1]] = slot_child[leaves[0]]
  calls = _raw_calls(arrays)
  for op in ["top_k", "log_prob_all"]:
    with pytest.raises(tf.errors.InvalidArgumentError, match="malformed tree"):
      calls[op]()
  calls["sample"]()  # may or may not meet the duplicate; must not crash


def test_slot_child_size_mismatch():
  arrays = _tree_arrays()
  arrays[4] = arrays[4][:-1]
  with pytest.raises(tf.errors.InvalidArgumentError, match="slot_child must be a vector"):
    _raw_calls(arrays)["top_k"]()


# ---------------------------------------------------------------------------------------
# top_k with exclusions
# ---------------------------------------------------------------------------------------


def _best_allowed(ref_row, banned, k):
  """The k best classes of a float64 row outside `banned`, ties by increasing id."""
  order = np.lexsort((np.arange(ref_row.size), -ref_row))
  allowed = [c for c in order if c not in banned]
  return allowed[:k]


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_top_k_exclude_is_the_best_allowed(rng, dtype):
  for name, tree in trees_of_every_kind(rng):
    c = tree.num_classes
    if c < 4:
      continue
    hidden, weights, biases = _inputs(rng, tree, (3, 4), 6, dtype)
    ref = all_log_probs(hidden, weights, biases, tree).reshape(3, 4, c)
    n = 3
    exclude = rng.integers(-1, c, size=(3, 4, n))  # -1: no id there
    k = min(4, c - n)
    values, classes = top_k(hidden, weights, biases, tree, k, exclude=exclude)
    assert values.shape == (3, 4, k) and classes.shape == (3, 4, k), name
    for i in range(3):
      for j in range(4):
        expected = _best_allowed(ref[i, j], set(exclude[i, j].tolist()), k)
        np.testing.assert_array_equal(classes.numpy()[i, j], expected, err_msg=name)
        np.testing.assert_allclose(values.numpy()[i, j], ref[i, j, expected],
                                   rtol=TOL[dtype], atol=TOL[dtype], err_msg=name)


def test_top_k_exclude_broadcasts_and_runs_out(rng):
  tree = tf_hsm.Tree.huffman(np.arange(12, 0, -1.0), branching=3)
  hidden, weights, biases = _inputs(rng, tree, (5,), 4, np.float64)
  ref = all_log_probs(hidden, weights, biases, tree)
  # [1, n]: the same ids left out of every row.
  values, classes = top_k(hidden, weights, biases, tree, 3, exclude=[[0, 5]])
  for row in range(5):
    np.testing.assert_array_equal(classes.numpy()[row], _best_allowed(ref[row], {0, 5}, 3))
  # 10 of 12 classes excluded, k = 4: two classes, then -1 with -inf.
  values, classes = top_k(hidden, weights, biases, tree, 4,
                          exclude=np.tile(np.arange(10), (5, 1)))
  np.testing.assert_array_equal(classes.numpy()[:, 2:], -1)
  assert np.all(np.isneginf(values.numpy()[:, 2:]))
  for row in range(5):
    np.testing.assert_array_equal(classes.numpy()[row, :2], _best_allowed(ref[row],
                                                                          set(range(10)), 2))
  # No ids: the plain search.
  plain = top_k(hidden, weights, biases, tree, 3)
  empty = top_k(hidden, weights, biases, tree, 3, exclude=np.zeros((5, 0), np.int64))
  np.testing.assert_array_equal(plain[1].numpy(), empty[1].numpy())


def test_top_k_exclude_takes_histories_of_any_length(rng):
  # Per-row histories as a ragged [B, (n)] beside dense hidden states: padded with -1,
  # which excludes nothing; ids repeated within a row are one exclusion.
  tree = tf_hsm.Tree.huffman(np.arange(30, 0, -1.0), branching=4)
  hidden, weights, biases = _inputs(rng, tree, (3,), 5, np.float64)
  ref = all_log_probs(hidden, weights, biases, tree)
  rows = [[4, 4, 9, 0], [], [29]]
  histories = tf.ragged.constant(rows, dtype=tf.int64)
  _, classes = top_k(hidden, weights, biases, tree, 5, exclude=histories)
  for row, banned in enumerate(rows):
    np.testing.assert_array_equal(classes.numpy()[row], _best_allowed(ref[row], set(banned), 5))
  layer = tf_hsm.HierarchicalSoftmax(tree, ignore_class=0)
  layer.build((None, 5))
  _, by_layer = layer.top_k(hidden, 3, exclude=histories)
  _, padded = layer.top_k(hidden, 3, exclude=histories.to_tensor(-1))
  np.testing.assert_array_equal(by_layer.numpy(), padded.numpy())
  # Traced, the longest history is unknown, and the search's width k + n must be known.
  traced = tf.function(lambda ids: top_k(hidden, weights, biases, tree, 5, exclude=ids))
  with pytest.raises(ValueError, match=r"RaggedTensor.*to_tensor\(-1, shape=\[None, n\]\)"):
    traced(histories)
  # The layer's top_k pads the histories (and adds its ignore_class) before the search:
  # the same message, not the generic one about a known n.
  traced_layer = tf.function(lambda ids: layer.top_k(hidden, 3, exclude=ids))
  with pytest.raises(ValueError, match=r"RaggedTensor.*to_tensor\(-1, shape=\[None, n\]\)"):
    traced_layer(histories)
  from tf_hsm import tf_keras as hk2  # pylint: disable=import-outside-toplevel
  legacy = hk2.HierarchicalSoftmax(tree, ignore_class=0)
  legacy.build((None, 5))
  with pytest.raises(ValueError, match=r"RaggedTensor.*to_tensor\(-1, shape=\[None, n\]\)"):
    tf.function(lambda ids: legacy.top_k(hidden, 3, exclude=ids))(histories)
  # A mixture ranks log_prob_all, whatever the histories' longest length: it takes them.
  mixture = tf_hsm.HierarchicalSoftmaxMixture(
      [tree, tf_hsm.Tree.balanced(30, 3)], dtype="float64")
  mixture.build((None, 5))
  _, traced_mixture = tf.function(lambda ids: mixture.top_k(hidden, 3, exclude=ids))(histories)
  _, padded_mixture = mixture.top_k(hidden, 3, exclude=histories.to_tensor(-1))
  np.testing.assert_array_equal(traced_mixture.numpy(), padded_mixture.numpy())


def test_top_k_exclude_many_ids_is_exact_in_little_memory(rng):
  # Most of the classes excluded from every row: the membership test sorts the ids
  # instead of comparing every candidate with every id ([rows, k + n, n] booleans: 40 GB
  # here, four rows of 100,000 ids).
  classes = 100_050
  tree = tf_hsm.Tree.huffman(rng.random(classes) + 0.1, branching=8)
  hidden, weights, biases = _inputs(rng, tree, (4,), 6, np.float64)
  ref = tf_hsm.log_prob_all(hidden, weights, biases, tree).numpy()
  exclude = np.stack([rng.permutation(classes)[:100_000] for _ in range(4)])
  exclude[:, :5] = -1  # padding among the ids
  _, classes = top_k(hidden, weights, biases, tree, 8, exclude=exclude)
  for row in range(4):
    kept = _best_allowed(ref[row], set(exclude[row].tolist()), 8)
    np.testing.assert_array_equal(classes.numpy()[row, :len(kept)], kept)
    np.testing.assert_array_equal(classes.numpy()[row, len(kept):], -1)


def test_top_k_exclude_ragged_and_errors(rng):
  tree = tf_hsm.Tree.balanced(20, 4)
  hidden, weights, biases = _inputs(rng, tree, (5,), 4, np.float32)
  ragged = tf.RaggedTensor.from_row_lengths(hidden, [2, 3])
  exclude = np.array([[1, 2], [3, -1], [0, 0], [7, 8], [9, 10]])
  flat = top_k(hidden, weights, biases, tree, 3, exclude=exclude)
  out = top_k(ragged, weights, biases, tree, 3,
              exclude=tf.RaggedTensor.from_row_lengths(exclude, [2, 3]))
  np.testing.assert_array_equal(out[1].flat_values.numpy(), flat[1].numpy())
  with pytest.raises(TypeError, match="exclude must be one too"):
    top_k(ragged, weights, biases, tree, 3, exclude=exclude)
  with pytest.raises(ValueError, match=r"exclude must be class ids \[\.\.\., n\]"):
    top_k(hidden, weights, biases, tree, 3, exclude=[1, 2])
  with pytest.raises(tf.errors.InvalidArgumentError, match="excluded id is >= num_classes"):
    top_k(hidden, weights, biases, tree, 3, exclude=[[20]])
  with pytest.raises(TypeError, match="exclude must be int32 or int64"):
    top_k(hidden, weights, biases, tree, 3, exclude=[[1.0]])
  # Rows of ids for other rows than the batch's (6 for 5) are named, by the op and by
  # the layers (whose ignore_class joins each row).
  with pytest.raises(ValueError, match=r"broadcasts to the rows' \[5\], got shape \[6, 2\]"):
    top_k(hidden, weights, biases, tree, 3, exclude=np.zeros([6, 2], np.int64))
  layer = tf_hsm.HierarchicalSoftmax(tree, ignore_class=0)
  layer.build((None, 4))
  for shape in ([6, 2], [3, 5, 2]):
    with pytest.raises(ValueError, match="broadcasts to the rows'|of rank 2"):
      layer.top_k(hidden, 3, exclude=np.zeros(shape, np.int64))
