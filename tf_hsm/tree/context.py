"""Class vectors from a corpus before any training: each word's left contexts.

A hierarchical softmax predicts a word from what came before it, so words that follow
the same contexts belong under the same nodes. `context_vectors` gives each class the
distribution of the `lags` words before it (each among the `contexts` most frequent
classes, the rest pooled), square-rooted (the Hellinger transform, so that rare contexts
are not drowned by frequent ones), centred and reduced to `dims` principal directions
by a randomized SVD. One pass over the token ids and a few sparse products: seconds for
ten million tokens, with no model. `Tree.from_context` builds a tree from them
(`Tree.from_vectors`), to train on from the first step, without a rebuild.

Memory: the (class, context) pairs seen, a few arrays of at most lags x tokens entries,
and [num_classes, dims + 16] floats; never a dense [num_classes, contexts] matrix.
"""

import numpy as np

from tf_hsm.tree.checks import check_int

DIMS = 64  # the vectors' default width
_OVERSAMPLE = 16  # extra random directions of the randomized SVD
_CHUNK_VALUES = 1 << 23  # products (nonzeros x columns) held at a time: 64 MB of float64


def _checked_ids(token_ids, num_classes):
  ids = np.asarray(token_ids)
  if ids.ndim == 1 and ids.size < 2:
    raise ValueError(f"token_ids must hold at least 2 tokens (a class and one before it), "
                     f"got {ids.size}")
  if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
    raise ValueError(f"token_ids must be a 1-D integer array, got shape {ids.shape} and "
                     f"dtype {ids.dtype}")
  if ids.size and (ids.min() < 0 or ids.max() >= num_classes):
    raise ValueError(f"token_ids must lie in [0, {num_classes}), got values from "
                     f"{ids.min()} to {ids.max()}")
  return ids.astype(np.int64, copy=False)


class _Sparse:
  """A [rows, cols] matrix of the nonzeros (r, c, v), multiplied by dense matrices."""

  def __init__(self, r, c, v, shape):
    self.r, self.c, self.v, self.shape = r, c, v, shape
    order = np.argsort(c, kind="stable")
    self.rt, self.ct, self.vt = c[order], r[order], v[order]

  def dot(self, x):
    return _sorted_product(self.r, self.c, self.v, x, self.shape[0])

  def tdot(self, x):
    return _sorted_product(self.rt, self.ct, self.vt, x, self.shape[1])


def _sorted_product(rows, cols, vals, x, num_rows):
  """sum over nonzeros of vals * x[cols] into out[rows] (`rows` sorted), by chunks of
  nonzeros small enough that their products stay within _CHUNK_VALUES."""
  out = np.zeros((num_rows, x.shape[1]))
  chunk = max(1, _CHUNK_VALUES // x.shape[1])
  for s in range(0, rows.size, chunk):
    ids = rows[s:s + chunk]
    starts = np.flatnonzero(np.r_[True, ids[1:] != ids[:-1]])
    out[ids[starts]] += np.add.reduceat(vals[s:s + chunk, None] * x[cols[s:s + chunk]],
                                        starts, axis=0)
  return out


def _context_matrix(ids, num_classes, contexts, lags):
  """The Hellinger-transformed left-context distributions: class c's row holds, for each
  lag, sqrt(p(context | c)) over the `contexts` most frequent classes and one pooled
  column for the others."""
  width = contexts + 1
  # Every (class, lag, context) pair as one key, written into one array and sorted in
  # place: the counts of equal keys are the runs' lengths.
  pairs = [max(0, ids.size - lag) for lag in range(1, lags + 1)]
  keys = np.empty(sum(pairs), np.int64)
  at = 0
  for lag, n in zip(range(1, lags + 1), pairs):
    np.minimum(ids[:n], contexts, out=keys[at:at + n])
    keys[at:at + n] += ids[lag:] * (lags * width) + (lag - 1) * width
    at += n
  keys.sort()
  starts = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]])
  key, count = keys[starts], np.diff(np.r_[starts, keys.size])
  rows, cols = key // (lags * width), key % (lags * width)
  block = rows * lags + cols // width
  totals = np.bincount(block, weights=count, minlength=num_classes * lags)
  return _Sparse(rows, cols, np.sqrt(count / totals[block]), (num_classes, lags * width))


def context_vectors(token_ids, num_classes, contexts=2000, lags=2, dims=None, seed=0):
  """[num_classes, dims] vectors of the classes' left contexts in `token_ids`.

  Args:
    token_ids: 1-D integer array, the corpus as class ids in [0, num_classes), in order.
    num_classes: the number of classes.
    contexts: how many context classes are told apart: ids below `contexts`, so rank
      the ids by frequency (most frequent first) for these to be the frequent ones;
      every other context counts as one (at most num_classes are told apart).
    lags: how many preceding positions are contexts (each its own block of columns).
    dims: the vectors' width (the leading principal directions); None for DIMS, or
      fewer where the classes or context columns are fewer.
    seed: seed of the randomized SVD's directions.

  The same seed gives the same vectors with the same BLAS and thread count; the dense
  products and QR factorizations run in NumPy's BLAS, whose sums' order depends on its
  thread count, so the last bits, and the tree built from them, can differ with another.

  Returns:
    float64 [num_classes, dims]; a class never seen after another token has the zero
    distribution, which the centring maps to minus the mean.

  Raises:
    ValueError: token_ids not 1-D integers, out of range, or fewer than 2; a size
      argument not a positive int; dims larger than the context columns or the classes
      allow; sizes whose pairs would not fit int64 keys.
  """
  num_classes = check_int(num_classes, "num_classes", 1)
  # Context ids above the classes' would be columns no token fills.
  contexts = min(check_int(contexts, "contexts", 1), num_classes)
  lags = check_int(lags, "lags", 1)
  if num_classes * lags * (contexts + 1) >= 2**62:
    raise ValueError(f"num_classes x lags x (contexts + 1) must be below 2^62 (the pairs' "
                     f"keys are int64), got {num_classes} x {lags} x {contexts + 1}")
  widest = min(num_classes, lags * (contexts + 1))
  dims = min(DIMS, widest) if dims is None else check_int(dims, "dims", 1)
  seed = check_int(seed, "seed", 0)
  ids = _checked_ids(token_ids, num_classes)
  if dims > widest:
    raise ValueError(f"dims must be at most min(num_classes, lags * (contexts + 1)) = "
                     f"{widest}, got {dims}")
  m = _context_matrix(ids, num_classes, contexts, lags)
  mean = np.bincount(m.c, weights=m.v, minlength=m.shape[1]) / num_classes
  k = min(dims + _OVERSAMPLE, *m.shape)
  # The centred matrix m - 1 mean^T, applied without forming it.
  def dot(x):
    return m.dot(x) - mean @ x
  def tdot(q):
    return m.tdot(q) - np.outer(mean, q.sum(0))
  rng = np.random.default_rng(seed)
  q, _ = np.linalg.qr(dot(rng.standard_normal((m.shape[1], k))))
  q, _ = np.linalg.qr(dot(tdot(q)))  # one power iteration: the leading directions sharpen
  u, s, _ = np.linalg.svd(tdot(q).T, full_matrices=False)
  return (q @ u[:, :dims]) * s[:dims]


def mixture_sides(count):
  """(side, seed) of each of `count` context trees of a mixture: the left contexts, the
  right, then left and right again clustered from seed 1, 2, ... (the i-th tree's seed
  is i // 2): the demo's `--mixture N` and the planner's mixture rows alike."""
  return [(("left", "right")[i % 2], i // 2) for i in range(count)]
