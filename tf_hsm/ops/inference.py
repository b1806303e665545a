"""Inference with a hierarchical softmax: exact top-k, every class's log-probability,
ancestral sampling, and scoring of candidate classes.

All four run the C++ kernels of cc/core/inference_*.cc on the CPU. They have no gradient
(`tf.no_gradient` is registered for each op); use `tf_hsm.log_prob` to train.
"""

import math
import numbers

import numpy as np
import tensorflow as tf

from tf_hsm.ops import compact
from tf_hsm.ops import inputs as op_inputs
from tf_hsm.ops import loader
__all__ = ["top_k", "log_prob_all", "sample", "log_prob_candidates"]

_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1


def _tree_args(tree, slot_child=True):
  """The tree tensors in the order the inference ops take them."""
  t = op_inputs.tree_tensors(tree)
  args = [t["child_begin"], t["path_begin"], t["path_nodes"], t["path_slots"]]
  return args + [t["slot_child"]] if slot_child else args


def _whole(weights, biases):
  """The tables, a table held in pieces read whole: a search or sweep may visit any row
  (`log_prob_candidates`, which knows its rows, gathers only those)."""
  return (compact.whole_table(weights, "weights"),
          None if biases is None else compact.whole_table(biases, "biases"))


def _is_int(value):
  return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def check_k(k, num_classes):
  """ValueError unless `k` is a Python (or NumPy) integer in [1, num_classes]."""
  if not _is_int(k) or not 1 <= k <= num_classes:
    raise ValueError(f"k must be an integer in [1, num_classes] = [1, {num_classes}], "
                     f"got {k!r}")


def seed_tensor(seed):
  """A sampling seed as an int64 scalar tensor: a Python (or NumPy) int in the int64
  range, an integer scalar tensor, or None for one drawn from TensorFlow's global random
  state (`tf.random.set_seed` makes it reproducible)."""
  if seed is None:
    return tf.random.uniform([], minval=0, maxval=_INT64_MAX, dtype=tf.int64)
  if _is_int(seed):
    if not _INT64_MIN <= seed <= _INT64_MAX:
      raise ValueError(f"seed must fit in int64, got {seed}")
    return tf.constant(int(seed), tf.int64)
  seed = tf.cast(op_inputs.class_ids(seed, "seed"), tf.int64)
  if seed.shape.rank not in (None, 0):  # e.g. a [2] pair, as TF's stateless ops take
    raise ValueError(f"seed must be one integer (a scalar), got shape {seed.shape}")
  return seed


def _cast_back(result, out_dtype):
  return tf.cast(result, out_dtype) if result.dtype != out_dtype else result


def top_k(hidden, weights, biases, tree, k, return_num_expanded=False, exclude=None):
  """The k most probable classes of each row, exactly.

  Best-first (branch-and-bound) search over the tree: a priority queue holds nodes and
  classes keyed by the log-probability of the path to them, which only falls as the path
  descends. The best node is expanded (one log-softmax over its children) until k
  classes have left the queue; subtrees that cannot reach the top k are never expanded.
  The cost therefore depends on how peaked the distribution is: a few nodes per row for
  a confident model, every node when all classes are about equally likely.

  Ties: classes with equal log-probabilities are ordered by increasing class id; NaN
  log-probabilities (from NaN inputs) come last. The result is deterministic and does
  not depend on the number of threads. Rows are searched in groups of up to 64 that
  share each node's pass over its weights, so a row's number of expanded nodes, and the
  last bits of its log-probabilities, can depend on the other rows of the batch.

  Args:
    hidden: [..., D] float32/float64 (float16/bfloat16 are computed in float32), or a
      `tf.RaggedTensor` [batch, (time), D] whose per-token arguments are ragged alike;
      the outputs with a token axis are then ragged too.
    weights: [tree.num_slots, D] table, one row per tree edge.
    biases: [tree.num_slots] or None.
    tree: a `tf_hsm.Tree`.
    k: a Python int, 1 <= k <= tree.num_classes.
    return_num_expanded: also return the number of internal nodes each row's search
      expanded (the root included), a measure of the work done.
    exclude: None, or int class ids ``[..., n]`` that a row's top k must leave out
      ("do not recommend what the user already bought"), with hidden's leading shape
      (a dimension of 1 applies to every row along it: ``[1, n]`` for a batch ``[B,
      D]`` excludes the same ids everywhere); ragged like a ragged `hidden`. Ids < 0
      are ignored, so rows of different lengths pad with -1. The search finds the
      top ``k + n`` and drops the excluded ones, which is exact: at most n classes
      outrank the k best allowed ones. A row with fewer than k classes left gets class
      -1 with log-probability -inf in its last places.

  Returns:
    ``(log_probs, classes)``: ``[..., k]`` log-probabilities in decreasing order (dtype
    of `hidden`) and the int64 classes. With `return_num_expanded`, a third int64
    tensor with hidden's leading shape.

  Raises:
    TypeError: `tree` is not a Tree, or wrong dtypes.
    ValueError: `k` is not an integer in [1, num_classes]; an `exclude` whose rank is
      not hidden's or whose last dimension is not known.
    tf.errors.InvalidArgumentError: shape mismatches, malformed tree tensors, excluded
      ids >= num_classes.
  """
  if exclude is not None:
    return _top_k_excluding(hidden, weights, biases, tree, k, return_num_expanded, exclude)
  return _search(hidden, weights, biases, tree, k, return_num_expanded)


@op_inputs.accepts_ragged
def _search(hidden, weights, biases, tree, k, return_num_expanded=False):
  """`top_k` without exclusions: the op's best-first search."""
  tree_args = _tree_args(tree)
  check_k(k, tree.num_classes)
  hidden, weights, biases, out_dtype = op_inputs.dense_inputs(hidden, *_whole(weights, biases))
  log_probs, classes, expanded = loader.ops().hsm_top_k(hidden, weights, biases, *tree_args,
                                                         k=int(k))
  log_probs = _cast_back(log_probs, out_dtype)
  if return_num_expanded:
    return log_probs, classes, expanded
  return log_probs, classes


def _top_k_excluding(hidden, weights, biases, tree, k, return_num_expanded, exclude):
  """`top_k` with `exclude`: the top k + n, the excluded classes moved out of it."""
  if isinstance(hidden, tf.RaggedTensor):
    if not isinstance(exclude, tf.RaggedTensor) or exclude.ragged_rank != hidden.ragged_rank:
      raise TypeError("hidden is a tf.RaggedTensor, so exclude must be one too, with "
                      f"hidden's row partitions; got {type(exclude).__name__}")
    flat = _top_k_excluding(hidden.flat_values, weights, biases, tree, k,
                            return_num_expanded, exclude.flat_values)
    return tuple(hidden.with_flat_values(part) for part in flat)
  exclude = checked_exclude(exclude, hidden, tree.num_classes)
  n = exclude.shape[-1]
  check_k(k, tree.num_classes)
  if n == 0:
    return _search(hidden, weights, biases, tree, k, return_num_expanded)
  wide = min(k + n, tree.num_classes)
  log_probs, classes, expanded = _search(hidden, weights, biases, tree, wide, True)
  log_probs, classes = drop_excluded(log_probs, classes, exclude, k)
  if return_num_expanded:
    return log_probs, classes, expanded
  return log_probs, classes


def is_member(classes, exclude):
  """Whether each of `classes` [..., K] is among its row's `exclude` [..., n] (int64,
  leading shape broadcast to the rows'), by a binary search of the sorted exclude: memory
  and time (K + n) log n a row, where comparing every pair took [..., K, n] (40 GB for
  four rows excluding 100,000 ids)."""
  rows = tf.shape(classes)[:-1]
  ids = tf.sort(tf.broadcast_to(exclude, tf.concat([rows, tf.shape(exclude)[-1:]], 0)))
  # A first id no class equals keeps every row non-empty, so the search's index is valid.
  floor = tf.fill(tf.concat([rows, [1]], 0), tf.constant(np.iinfo(np.int64).min, tf.int64))
  ids = tf.concat([floor, ids], -1)
  at = tf.searchsorted(ids, classes, side="right") - 1
  return tf.gather(ids, at, batch_dims=classes.shape.rank - 1) == classes


def dense_exclude(exclude, hidden, known_n=True):
  """A `tf.RaggedTensor` of per-row histories for a dense `hidden` as the dense
  `[..., n]` the searches take: padded with -1, which excludes nothing. With `known_n`
  (the tree's search sizes its list by k + n), ValueError where the longest history is
  not known when traced."""
  if isinstance(exclude, tf.RaggedTensor) and not isinstance(hidden, tf.RaggedTensor):
    padded = exclude.to_tensor(default_value=-1)
    if known_n and padded.shape[-1] is None:
      raise ValueError("exclude is a tf.RaggedTensor of histories, whose longest length is "
                       "not known when traced (in a tf.function or Keras' predict): the "
                       "search's width, k + n, must be; pad it to a fixed n, e.g. "
                       "exclude.to_tensor(-1, shape=[None, n]) (-1 excludes nothing)")
    return padded
  return exclude


def checked_exclude(exclude, hidden, num_classes):
  """`exclude` as int64 class ids `[..., n]` of `hidden`'s rank with a known n (else
  ValueError), checked below `num_classes` when it runs: the one check of `top_k`'s
  `exclude` for the tree's op, the adaptive softmax and the mixture."""
  exclude = tf.cast(op_inputs.class_ids(dense_exclude(exclude, hidden), "exclude"), tf.int64)
  check_exclude_rank(exclude, tf.convert_to_tensor(hidden).shape.rank)
  return below_num_classes(exclude, num_classes)


def check_exclude_rank(exclude, hidden_rank, known_n=True):
  """ValueError unless `exclude` has `hidden`'s rank (a batch of sequences' exclude
  [B, n] would otherwise broadcast along the time axis where B is T) and, with
  `known_n` (the tree's search sizes its list by it), a known n."""
  if exclude.shape.rank != hidden_rank or (known_n and exclude.shape[-1] is None):
    raise ValueError(f"exclude must be class ids [..., n] with hidden's leading shape "
                     f"and a known n, got shape {exclude.shape} for hidden of rank "
                     f"{hidden_rank} (for the same ids on every row of a [B, D] batch: "
                     "shape [1, n]; of a [B, T, D] one: [B, 1, n] or [1, 1, n])")


def below_num_classes(exclude, num_classes):
  """`exclude` (int64 ids) under a check, when it runs, that every id is < num_classes."""
  with tf.control_dependencies([tf.debugging.assert_less(
      exclude, tf.constant(num_classes, tf.int64),
      message=f"top_k: an excluded id is >= num_classes = {num_classes}")]):
    return tf.identity(exclude)


def check_exclude_shape(exclude, rows_shape):
  """ValueError naming `exclude` where its leading shape cannot broadcast to the rows'
  (else the comparison below fails without naming it, or eagerly gives one bool)."""
  if isinstance(exclude, tf.RaggedTensor):
    return
  rows, given = tf.TensorShape(rows_shape), tf.TensorShape(exclude.shape)
  if rows.rank is None or given.rank is None:
    return
  if given.rank == 0:
    raise ValueError("exclude must be class ids [..., n], got a scalar")
  given = given[:-1]
  fits = given.rank <= rows.rank and all(
      g is None or r is None or g in (1, r)
      for g, r in zip(reversed(given.as_list()), reversed(rows.as_list())))
  if not fits:
    raise ValueError(f"exclude must be class ids [..., n] whose leading shape broadcasts "
                     f"to the rows' {rows.as_list()}, got shape {exclude.shape.as_list()}")


def drop_excluded(log_probs, classes, exclude, k):
  """The best k of a top list `(log_probs, classes)` `[..., K]` that are not in `exclude`
  `[..., n]` (int64; broadcast against the rows), in the list's order; -inf and class -1
  where fewer than k are left."""
  check_exclude_shape(exclude, classes.shape[:-1])
  classes = tf.cast(classes, tf.int64)
  wide = classes.shape[-1]
  excluded = is_member(classes, exclude)
  # Allowed classes first, each group in the list's order (best first, ties by id).
  key = tf.range(wide, dtype=tf.int64) + wide * tf.cast(excluded, tf.int64)
  order = tf.argsort(key, axis=-1, stable=True)[..., :k]
  batch_dims = classes.shape.rank - 1
  picked = [tf.gather(x, order, batch_dims=batch_dims)
            for x in (log_probs, classes, excluded)]
  return (tf.where(picked[2], tf.constant(-np.inf, log_probs.dtype), picked[0]),
          tf.where(picked[2], tf.constant(-1, tf.int64), picked[1]))


@op_inputs.accepts_ragged
def log_prob_all(hidden, weights, biases, tree, class_range=None):
  """log P(c | hidden) for every class c, or for the classes of a range.

  One pass per row: each internal node's log-softmax is computed once and added to its
  parent's path log-probability, sweeping the tree level by level; rows are processed in
  blocks that share each weight block. With `class_range` only the nodes on paths to the
  classes in the range are evaluated, so a very large output can be produced in chunks,
  e.g. ``for b in range(0, C, chunk): log_prob_all(..., class_range=(b, min(b + chunk,
  C)))``; each chunk equals the matching slice of the full result bit for bit.

  Args:
    hidden: [..., D] float32/float64 (float16/bfloat16 are computed in float32), or a
      `tf.RaggedTensor` [batch, (time), D] whose per-token arguments are ragged alike;
      the outputs with a token axis are then ragged too.
    weights: [tree.num_slots, D] table, one row per tree edge.
    biases: [tree.num_slots] or None.
    tree: a `tf_hsm.Tree`.
    class_range: None for all classes, or ``(begin, end)`` with
      ``0 <= begin <= end <= num_classes`` (Python ints or an int tensor of shape [2]).

  Returns:
    ``[..., end - begin]`` log-probabilities (``[..., num_classes]`` without a range);
    entry j of the last axis is class ``begin + j``. Dtype of `hidden`.

  Raises:
    TypeError: `tree` is not a Tree, or wrong dtypes.
    ValueError: a Python `class_range` that is not two integers within the bounds.
    tf.errors.InvalidArgumentError: a tensor `class_range` out of bounds, shape
      mismatches, malformed tree tensors.
  """
  tree_args = _tree_args(tree)
  c = tree.num_classes
  if class_range is None:
    class_range = (0, c)
  if isinstance(class_range, (tuple, list)):
    if (len(class_range) != 2 or not all(_is_int(v) for v in class_range) or
        not 0 <= class_range[0] <= class_range[1] <= c):
      raise ValueError(f"class_range must be (begin, end) with 0 <= begin <= end <= "
                       f"num_classes = {c}, got {class_range!r}")
    class_range = tf.constant([int(v) for v in class_range], tf.int64)
  else:
    class_range = tf.cast(op_inputs.class_ids(class_range, "class_range"), tf.int64)
  hidden, weights, biases, out_dtype = op_inputs.dense_inputs(hidden, *_whole(weights, biases))
  result = loader.ops().hsm_log_prob_all(hidden, weights, biases, class_range, *tree_args)
  return _cast_back(result, out_dtype)


def check_python_temperature(temperature, dtype):
  """ValueError for a Python `temperature` that `sample` cannot use with tables of
  `dtype`: not positive and finite, or below its smallest normal number (a bool or a
  tensor is left to `number_arg` and the op)."""
  if not isinstance(temperature, numbers.Real) or isinstance(temperature, (bool, np.bool_)):
    return
  if not (math.isfinite(temperature) and temperature > 0):
    raise ValueError(f"temperature must be positive and finite, got {temperature!r}")
  dtype = tf.as_dtype(dtype)
  tiny = float(np.finfo(dtype.as_numpy_dtype).tiny)
  if temperature < tiny:
    raise ValueError(
        f"temperature {temperature!r} is below the smallest normal {dtype.name} "
        f"({tiny:g}): TensorFlow's CPU kernels read subnormal numbers as 0")


@op_inputs.accepts_ragged
def sample(hidden, weights, biases, tree, seed=None, temperature=1.0):
  """One class per row, sampled from the hierarchical softmax.

  Ancestral sampling: starting at the root, a child of the current node is drawn from
  ``softmax(logits / temperature)`` over the node's children until a class is reached.
  (With temperature T every node's softmax is tempered, which is the distribution of the
  model with weights and biases divided by T.)

  Reproducibility: the uniform number used by row i (counting over hidden's flattened
  leading dimensions) at path depth d is a hash of (seed, i, d), so for a given seed the
  result depends only on the inputs, never on threading or on the other rows. A row's
  sample does depend on its position i.

  Args:
    hidden: [..., D] float32/float64 (float16/bfloat16 are computed in float32), or a
      `tf.RaggedTensor` [batch, (time), D] whose per-token arguments are ragged alike;
      the outputs with a token axis are then ragged too.
    weights: [tree.num_slots, D] table, one row per tree edge.
    biases: [tree.num_slots] or None.
    tree: a `tf_hsm.Tree`.
    seed: a Python int in the int64 range or an int scalar tensor. None draws a fresh
      seed on each call from TensorFlow's global random state (`tf.random.uniform`), so
      `tf.random.set_seed` makes a program's samples reproducible, and each call of a
      `tf.function` gets new samples.
    temperature: positive and finite; a Python number or a float scalar tensor. Small
      values approach greedy descent, large values uniform choices at each node.

  Returns:
    int64 classes with hidden's leading shape. A row whose logits at a visited node are
    NaN or +inf, or all -inf, has no well-defined distribution and gets -1 (a -inf logit
    alone, e.g. a -inf bias, only masks its child).

  Raises:
    TypeError: `tree` is not a Tree, or wrong dtypes.
    ValueError: a `seed` that is not a scalar, a Python `seed` outside the int64 range,
      or a Python `temperature` that is not positive and finite.
    tf.errors.InvalidArgumentError: a tensor temperature that is not positive and
      finite, shape mismatches, malformed tree tensors.
  """
  tree_args = _tree_args(tree)
  hidden, weights, biases, out_dtype = op_inputs.dense_inputs(hidden, *_whole(weights, biases))
  del out_dtype  # the result is int64
  seed = seed_tensor(seed)
  check_python_temperature(temperature, weights.dtype)
  temperature = op_inputs.number_arg(temperature, weights.dtype, "temperature")
  return loader.ops().hsm_sample(hidden, weights, biases, seed, temperature, *tree_args)


@op_inputs.accepts_ragged
def log_prob_candidates(hidden, weights, biases, tree, candidates):
  """log P(candidate | hidden) for several candidate classes per row (reranking).

  Equivalent to `tf_hsm.log_prob` with each row repeated once per candidate, but a
  node's log-sum-exp is computed once per row however many of the row's candidates pass
  through it, and rows at the same node share its weight block.

  Args:
    hidden: [..., D] float32/float64 (float16/bfloat16 are computed in float32), or a
      `tf.RaggedTensor` [batch, (time), D] whose per-token arguments are ragged alike;
      the outputs with a token axis are then ragged too.
    weights: [tree.num_slots, D] table, one row per tree edge.
    biases: [tree.num_slots] or None.
    tree: a `tf_hsm.Tree`.
    candidates: int32/int64 ``[..., M]`` class ids in [0, num_classes), whose leading
      shape is hidden's.

  Returns:
    log-probabilities with the shape of `candidates` and the dtype of `hidden`.

  Raises:
    TypeError: `tree` is not a Tree, or wrong dtypes.
    tf.errors.InvalidArgumentError (or ValueError while tracing): candidates outside
      [0, num_classes), shape mismatches, malformed tree tensors.
  """
  tree_args = _tree_args(tree, slot_child=False)
  candidates = op_inputs.class_ids(candidates, "candidates")
  if compact.is_split(weights, biases):
    weights, biases, tree_args, candidates = compact.compact_inputs(
        tree, op_inputs.tree_tensors(tree), weights, biases, candidates, "candidates")
  hidden, weights, biases, out_dtype = op_inputs.dense_inputs(hidden, weights, biases)
  result = loader.ops().hsm_log_prob_candidates(hidden, weights, biases, candidates,
                                                 *tree_args)
  return _cast_back(result, out_dtype)


for _op in ("Hsm>TopK", "Hsm>LogProbAll", "Hsm>Sample", "Hsm>LogProbCandidates"):
  tf.no_gradient(_op)
del _op
