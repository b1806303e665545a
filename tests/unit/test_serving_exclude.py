"""tf_hsm.serving.top_k and adaptive_top_k with `exclude`: the answers of
`tf_hsm.top_k(..., exclude=...)` and `AdaptiveSoftmax.top_k(..., exclude=...)` (per-row
ids, padding, dimensions of 1, rows left with fewer than k classes, NaN rows), under
XLA, and the errors that name a bad `exclude`."""

import numpy as np
import pytest
import tensorflow as tf

import tf_hsm
from oracle import random_inputs, trees_of_every_kind
from tf_hsm import serving

_TREES = trees_of_every_kind(np.random.default_rng(63))
_TOL = 1e-4


def _assert_same(values, classes, expected_values, expected_classes):
  """Equal values (-inf included); equal classes except where a value ties its
  neighbour within the tolerance (the order of near-ties is not the op's to fix)."""
  values, classes = np.asarray(values), np.asarray(classes)
  expected_values, expected_classes = np.asarray(expected_values), np.asarray(
      expected_classes)
  np.testing.assert_allclose(values, expected_values, rtol=_TOL, atol=_TOL)
  padded = np.pad(values, [(0, 0)] * (values.ndim - 1) + [(1, 1)],
                  constant_values=np.nan)
  with np.errstate(invalid="ignore"):  # -inf - -inf
    near_tie = (np.abs(padded[..., 1:-1] - padded[..., :-2]) < _TOL) | (
        np.abs(padded[..., 1:-1] - padded[..., 2:]) < _TOL)
  differ = classes != expected_classes
  assert not (differ & ~near_tie).any(), (classes[differ], expected_classes[differ])


def _row_exclusions(rng, shape, n, num_classes, best):
  """Ids [..., n]: some of each row's best classes (so that excluding them matters),
  some others, some padding."""
  ids = rng.integers(0, num_classes, shape + (n,))
  ids[..., : min(n, best.shape[-1])] = best[..., :n]
  ids[rng.random(ids.shape) < 0.2] = -1
  return ids


@pytest.mark.parametrize("name,tree", _TREES[:4], ids=[n for n, _ in _TREES[:4]])
def test_exclude_matches_the_op(name, tree, rng):
  del name
  hidden, weights, biases, _ = random_inputs(rng, tree, (2, 3), 6, np.float32, True)
  hidden *= 3.0
  num = tree.num_classes
  _, best = tf_hsm.top_k(hidden, weights, biases, tree, min(4, num))
  cases = [_row_exclusions(rng, (2, 3), 4, num, best.numpy()),   # per row
           _row_exclusions(rng, (2, 1), 3, num, best.numpy()[:, :1]),  # per batch row
           np.array([[[0, num - 1]]]),                             # the same everywhere
           np.zeros((2, 3, 0), np.int64)]                          # nothing
  for exclude in cases:
    for k in sorted({1, min(3, num), num}):
      values, classes = serving.top_k(hidden, weights, biases, tree, k, exclude=exclude)
      expected = tf_hsm.top_k(hidden, weights, biases, tree, k, exclude=exclude)
      _assert_same(values, classes, *expected)
      left = np.broadcast_to(exclude, (2, 3, exclude.shape[-1]))
      hit = (classes.numpy()[..., None] == left[..., None, :]) & (left[..., None, :] >= 0)
      assert not hit.any()
  # Every class but one excluded: the row ends in -1 and -inf.
  values, classes = serving.top_k(hidden[:1, :1], weights, biases, tree, 2,
                                  exclude=np.arange(1, num)[None, None])
  assert classes.numpy().tolist() == [[[0, -1]]] and values.numpy()[0, 0, 1] == -np.inf


def test_exclude_keeps_nan_rows_without_a_ranking(rng):
  _, tree = _TREES[0]
  hidden, weights, biases, _ = random_inputs(rng, tree, (3,), 5, np.float32, True)
  hidden[1, 0] = np.nan
  values, classes = serving.top_k(hidden, weights, biases, tree, 2,
                                  exclude=[[-1, 0]] * 3)
  assert (classes.numpy()[1] == -1).all() and np.isnan(values.numpy()[1]).all()
  assert (classes.numpy()[[0, 2]] >= 1).all()


def test_exclude_under_xla(rng):
  _, tree = _TREES[1]
  hidden, weights, biases, _ = random_inputs(rng, tree, (5,), 4, np.float32, True)
  exclude = rng.integers(-1, tree.num_classes, (5, 3))
  xla = tf.function(lambda h, e: serving.top_k(h, weights, biases, tree, 3, exclude=e),
                    jit_compile=True)
  got = xla(tf.constant(hidden), tf.constant(exclude))
  expected = tf_hsm.top_k(hidden, weights, biases, tree, 3, exclude=exclude)
  _assert_same(*got, *expected)


def test_bad_exclude_is_named(rng):
  _, tree = _TREES[0]
  hidden, weights, biases, _ = random_inputs(rng, tree, (4,), 4, np.float32, True)
  top = lambda exclude: serving.top_k(hidden, weights, biases, tree, 2, exclude=exclude)
  with pytest.raises(TypeError, match="exclude must be int class ids"):
    top([[0.5]])
  with pytest.raises(ValueError, match="exclude must be class ids .* rank 2"):
    top([1, 2])
  with pytest.raises(tf.errors.InvalidArgumentError, match="exclude must be class ids <"):
    top([[tree.num_classes]])
  with pytest.raises(tf.errors.InvalidArgumentError,
                     match=r"exclude must be \[\.\.\., n\] with leading shape"):
    top(np.zeros((3, 1), np.int64))


def _adaptive_layer(rng):
  order = rng.permutation(60)
  layer = tf_hsm.AdaptiveSoftmax(60, [10, 25], div_value=2.0, head_bias=True,
                                 tail="two_level", class_order=order.tolist())
  layer.build((None, 8))
  for v in layer.weights:
    v.assign(rng.normal(size=v.shape).astype("float32"))
  return layer


def test_adaptive_exclude_matches_the_layer(rng):
  layer = _adaptive_layer(rng)
  weights = serving.AdaptiveWeights.from_layer(layer)
  hidden = rng.normal(size=(2, 3, 8)).astype(np.float32)
  _, best = layer.top_k(hidden, 4)
  exclude = _row_exclusions(rng, (2, 3), 4, 60, best.numpy())
  for k in (1, 5, 60):
    got = serving.adaptive_top_k(weights, hidden, k, exclude=exclude)
    _assert_same(*got, *layer.top_k(hidden, k, exclude=exclude))
