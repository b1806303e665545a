"""Wide nodes (cc/core/wide_node.h): a node of at least 1,024 children visited by at least
128 tokens of the batch is computed by partitions of its children, its logits recomputed
in the gradient from each token's log-sum-exp. `Tree.flat` (the exact softmax) against a
float64 dense softmax, wide nodes mixed with small ones in one tree against the float64
reference of tests/oracle.py, the gradient's bits from the forward's values and from
scratch, sgd_step, and numerical gradients."""

import numpy as np
import pytest
import tensorflow as tf

import tf_hsm
from oracle import log_prob_reference
from support import taped_log_prob as _taped
from tf_hsm.ops import loader as _loader
from tf_hsm.ops.inputs import tree_tensors


def _dense_softmax(hidden, weights, biases, targets):
  """log_softmax(W h + b)[target] and its gradients (upstream 1) in float64."""
  h, w, b = (np.asarray(v, np.float64) for v in (hidden, weights, biases))
  z = h @ w.T + b
  m = z.max(axis=1, keepdims=True)
  lse = m[:, 0] + np.log(np.exp(z - m).sum(axis=1))
  rows = np.arange(len(targets))
  coef = -np.exp(z - lse[:, None])
  coef[rows, targets] += 1.0
  return z[rows, targets] - lse, coef @ w, coef.T @ h, coef.sum(axis=0), z - lse[:, None]


def _inputs(rng, tree, tokens, dim, dtype):
  hidden = rng.normal(size=(tokens, dim)).astype(dtype)
  weights = (0.3 * rng.normal(size=(tree.num_slots, dim))).astype(dtype)
  biases = (0.1 * rng.normal(size=tree.num_slots)).astype(dtype)
  targets = rng.integers(0, tree.num_classes, size=tokens)
  return hidden, weights, biases, targets


@pytest.mark.parametrize("num_classes,tokens,dim", [
    (1, 5, 4), (2, 130, 3), (9, 40, 5), (1024, 128, 8), (1025, 300, 17), (3000, 127, 6),
    (4099, 257, 12), (100_000, 130, 4)])
@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-10), (np.float32, 2e-4)])
def test_flat_tree_is_the_full_softmax(rng, num_classes, tokens, dim, dtype, tol):
  tree = tf_hsm.Tree.flat(num_classes)
  assert (tree.num_nodes, tree.num_slots, tree.max_depth) == (1, num_classes, 1)
  hidden, weights, biases, targets = _inputs(rng, tree, tokens, dim, dtype)
  ref = _dense_softmax(hidden, weights, biases, targets)
  got = _taped(hidden, weights, biases, tree, targets)
  for g, r in zip(got, ref[:4]):
    np.testing.assert_allclose(g, r, rtol=tol, atol=tol * max(1.0, np.abs(r).max()))
  plain = tf_hsm.log_prob(hidden, weights, biases, tree, targets).numpy()  # no tape
  np.testing.assert_allclose(plain, ref[0], rtol=tol, atol=tol)
  if num_classes * tokens <= 2_000_000:
    all_lp = tf_hsm.log_prob_all(hidden, weights, biases, tree).numpy()
    np.testing.assert_allclose(all_lp, ref[4], rtol=tol, atol=tol * 10)
  k = min(5, num_classes)
  values, classes = tf_hsm.top_k(hidden[:16], weights, biases, tree, k)
  best = np.argsort(-ref[4][:16], axis=1, kind="stable")[:, :k]
  np.testing.assert_array_equal(classes.numpy(), best)
  np.testing.assert_allclose(values.numpy(), np.take_along_axis(ref[4][:16], best, 1),
                             rtol=tol, atol=tol * 10)


def _mixed_wide_tree():
  """A root of 1,100 classes and four nodes: two wide (2,000 and 1,030 children, the
  second below a node of 3), and small ones of 3 and 20."""
  counter = iter(range(10_000))
  leaves = lambda n: [next(counter) for _ in range(n)]  # noqa: E731
  nested = leaves(1100) + [leaves(2000), [leaves(1030), leaves(2), leaves(1)], leaves(20)]
  return tf_hsm.Tree.from_nested(nested)


def test_wide_nodes_mixed_with_small_ones_match_the_reference(rng):
  tree = _mixed_wide_tree()
  for dtype, tol in ((np.float64, 1e-10), (np.float32, 3e-4)):
    hidden, weights, biases, _ = _inputs(rng, tree, 600, 7, dtype)
    # Enough tokens through each wide node (at least 128) for its wide path.
    path_counts = np.array([len(tree.path(c)) for c in range(tree.num_classes)])
    targets = np.concatenate([rng.integers(0, tree.num_classes, 200),
                              rng.choice(np.flatnonzero(path_counts == 2), 200),
                              rng.choice(np.flatnonzero(path_counts == 3), 200)])
    ref = log_prob_reference(hidden, weights, biases, tree, targets)
    got = _taped(hidden, weights, biases, tree, targets)
    for g, r in zip(got, ref):
      np.testing.assert_allclose(g, r, rtol=tol, atol=tol * max(1.0, np.abs(r).max()))


def test_wide_gradient_has_the_same_bits_from_the_forward_values_and_from_scratch(rng):
  """The saving forward keeps one log-sum-exp per visit of a wide node (not its logits):
  the gradient from it is Hsm>LogProbGrad's bit for bit, on every call and thread count."""
  ops = _loader.ops()
  for tree in (tf_hsm.Tree.flat(5000), _mixed_wide_tree()):
    t = tree_tensors(tree)
    tree_inputs = (t["child_begin"], t["path_begin"], t["path_nodes"], t["path_slots"])
    hidden, weights, biases, targets = _inputs(rng, tree, 400, 9, np.float32)
    h, w, b, y = (tf.constant(v) for v in (hidden, weights, biases, targets))
    upstream = tf.constant(rng.normal(size=400).astype(np.float32))
    lp, saved, directions = ops.hsm_log_prob_saving_logits(h, w, b, y, *tree_inputs)
    if tree.num_nodes == 1:
      assert saved.shape == (400,)  # one log-sum-exp per token, not 400 x 5,000 logits
    ref = ops.hsm_log_prob_grad(h, w, b, y, *tree_inputs, upstream)
    again = ops.hsm_log_prob_grad_from_logits(h, w, b, y, *tree_inputs, upstream, saved,
                                              directions)
    for a, r in zip(again, ref):
      np.testing.assert_array_equal(a.numpy(), r.numpy())
    np.testing.assert_array_equal(ops.hsm_log_prob(h, w, b, y, *tree_inputs).numpy(), lp.numpy())
    fused = ops.hsm_log_prob_and_grad(h, w, b, y, *tree_inputs, upstream)
    for a, r in zip(fused[1:], ref):
      np.testing.assert_array_equal(a.numpy(), r.numpy())
    for a, r in zip(ops.hsm_log_prob_grad(h, w, b, y, *tree_inputs, upstream), ref):
      assert a.numpy().tobytes() == r.numpy().tobytes()


def test_sgd_step_on_a_flat_tree_is_one_sgd_update(rng):
  tree = tf_hsm.Tree.flat(2500)
  hidden, weights, biases, targets = _inputs(rng, tree, 300, 6, np.float64)
  w, b = tf.Variable(weights), tf.Variable(biases)
  lp, gh = tf_hsm.sgd_step(hidden, w, b, tree, targets, learning_rate=0.5)
  ref_lp, ref_dh, ref_dw, ref_db, _ = _dense_softmax(hidden, weights, biases, targets)
  n = len(targets)
  np.testing.assert_allclose(lp.numpy(), ref_lp, rtol=1e-10, atol=1e-10)
  np.testing.assert_allclose(gh.numpy(), -ref_dh / n, rtol=1e-10, atol=1e-12)
  np.testing.assert_allclose(w.numpy(), weights + 0.5 * ref_dw / n, rtol=1e-10, atol=1e-12)
  np.testing.assert_allclose(b.numpy(), biases + 0.5 * ref_db / n, rtol=1e-10, atol=1e-12)


def test_numerical_gradients_through_a_wide_node(rng):
  tree = tf_hsm.Tree.flat(1100)
  hidden, weights, biases, targets = _inputs(rng, tree, 130, 2, np.float64)
  upstream = rng.normal(size=130)

  def f(h):
    return tf.reduce_sum(tf_hsm.log_prob(h, weights, biases, tree, targets) * upstream)

  theoretical, numerical = tf.test.compute_gradient(f, [hidden])
  np.testing.assert_allclose(theoretical[0], numerical[0], rtol=1e-6, atol=1e-7)


def _uniform(seed, row, step):
  """sampling::Uniform (cc/core/sampling.h): splitmix64 of (seed, row, step)."""
  mask = (1 << 64) - 1

  def mix(z):
    z = (z + 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return z ^ (z >> 31)

  return (mix((mix((mix(seed & mask) + row) & mask) + step) & mask) >> 11) * 2.0**-53


def test_sampling_a_wide_node_inverts_its_cumulative_softmax(rng):
  """Nodes of more than 65,536 children draw from their logits tile by tile: each row's
  class is where the cumulative softmax passes the row's uniform number."""
  tree = tf_hsm.Tree.flat(70_000)
  hidden, weights, biases, _ = _inputs(rng, tree, 40, 5, np.float64)
  *_, log_p = _dense_softmax(hidden, weights, biases, np.zeros(40, np.int64))
  for temperature in (1.0, 0.5):
    got = tf_hsm.sample(hidden, weights, biases, tree, seed=123, temperature=temperature)
    p = np.exp(log_p / temperature)
    cumulative = np.cumsum(p / p.sum(axis=1, keepdims=True), axis=1)
    u = np.array([_uniform(123, i, 0) for i in range(40)])
    want = [np.searchsorted(cumulative[i], u[i], side="right") for i in range(40)]
    np.testing.assert_array_equal(got.numpy(), want)
    first = tf_hsm.sample(hidden[:8], weights, biases, tree, seed=123, temperature=temperature)
    np.testing.assert_array_equal(first.numpy(), want[:8])  # a row's draw is its own
  nan_row = hidden.copy()
  nan_row[3] = np.nan
  got = tf_hsm.sample(nan_row, weights, biases, tree, seed=5).numpy()
  assert got[3] == -1 and (got[np.arange(40) != 3] >= 0).all()


def test_log_prob_all_of_a_flat_tree_in_class_ranges(rng):
  # From 16 rows a one-node tree's log_prob_all goes by blocked products over all rows
  # (cc/core/inference_flat.cc): a chunk of classes is the slice of the whole result bit
  # for bit, tiles cut by the range or not, and a NaN row stays in its row.
  tree = tf_hsm.Tree.flat(3001)
  hidden, weights, biases, _ = _inputs(rng, tree, 40, 7, np.float32)
  ref = _dense_softmax(hidden, weights, biases, np.zeros(40, np.int64))[4]
  full = tf_hsm.log_prob_all(hidden, weights, biases, tree).numpy()
  np.testing.assert_allclose(full, ref, rtol=2e-4, atol=2e-3)
  for begin, end in [(0, 1), (5, 130), (127, 129), (128, 256), (1000, 3001), (3000, 3001)]:
    chunk = tf_hsm.log_prob_all(hidden, weights, biases, tree, class_range=(begin, end))
    np.testing.assert_array_equal(chunk.numpy(), full[:, begin:end])
  hidden[3] = np.nan
  with_nan = tf_hsm.log_prob_all(hidden, weights, biases, tree).numpy()
  assert np.isnan(with_nan[3]).all()
  np.testing.assert_array_equal(np.delete(with_nan, 3, 0), np.delete(full, 3, 0))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_top_k_of_a_flat_tree_orders_ties_by_class(rng, dtype):
  # From 16 rows a one-node tree's top_k keeps each partition's best k + 8 logits in one
  # pass of blocked products; ties at the k-th value beyond those go to the search. Both
  # give the k best by value, equal values by increasing class, and a NaN row stays in
  # its row.
  tree = tf_hsm.Tree.flat(20_000)  # four partitions of slots
  hidden, weights, biases, _ = _inputs(rng, tree, 24, 5, dtype)
  biases[:50] = -np.inf  # masked classes
  tied = np.array([10, 5010, 10_010, 15_010, 19_990] + list(range(7000, 7030)))
  weights[tied] = 3 * weights[tied[0]]
  biases[tied] = 2.0
  for k in (3, 12, 40):
    values, classes = (t.numpy() for t in tf_hsm.top_k(hidden, weights, biases, tree, k))
    ref = _dense_softmax(hidden, weights, biases, np.zeros(24, np.int64))[4]
    best = np.argsort(-ref, axis=1, kind="stable")[:, :k]
    np.testing.assert_array_equal(classes, best)
    tol = 1e-10 if dtype == np.float64 else 2e-4
    np.testing.assert_allclose(values, np.take_along_axis(ref, best, 1), rtol=tol, atol=tol)
    for row_values in values:  # equal float values are listed by increasing class
      assert (np.diff(row_values) <= 0).all()
  hidden[7] = np.nan
  values_nan, classes_nan = (t.numpy() for t in tf_hsm.top_k(hidden, weights, biases, tree, 40))
  assert np.isnan(values_nan[7]).all()
  np.testing.assert_array_equal(np.delete(classes_nan, 7, 0), np.delete(classes, 7, 0))


def test_top_k_of_a_flat_tree_keeps_ties_that_rounding_makes(rng):
  # Logits a few float32 ulps apart that round to one log-probability: the partition that
  # holds them keeps only its k + 8 largest logits (the largest classes), so a tie at the
  # k-th value among the ones it dropped must go to the search, which lists the tied
  # classes from the smallest id.
  tree = tf_hsm.Tree.flat(20_000)
  hidden = rng.normal(size=(16, 4)).astype(np.float32)
  weights = np.zeros((20_000, 4), np.float32)
  biases = np.zeros(20_000, np.float32)
  biases[3] = 24.0  # the log-sum-exp is 24 to float32's precision
  tied = np.arange(7000, 7030)
  biases[tied] = 0.5 + np.arange(30) * np.spacing(np.float32(0.5))  # z increases with class
  values, classes = (t.numpy() for t in tf_hsm.top_k(hidden, weights, biases, tree, 3))
  all_lp = tf_hsm.log_prob_all(hidden, weights, biases, tree).numpy()
  tied_values = all_lp[0, tied]
  assert len(np.unique(tied_values)) < len(tied)  # rounding made ties
  order = sorted(tied, key=lambda c: (-all_lp[0, c], c))
  expected = [3] + order[:2]
  assert expected[1] < 7019  # a class the partition dropped
  for row in range(16):
    np.testing.assert_array_equal(classes[row], expected)
    np.testing.assert_array_equal(values[row], all_lp[row, expected])
