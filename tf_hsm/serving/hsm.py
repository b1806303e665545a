"""Hierarchical-softmax inference in stock TensorFlow ops: `log_prob`, `top_k`,
`log_prob_all` and `sample`, with the arguments and results of `tf_hsm.log_prob`,
`tf_hsm.top_k`, `tf_hsm.log_prob_all` and `tf_hsm.sample`.

Every op used here is one that TensorFlow, XLA and TFLite's builtin op set all accept:
gathers, (batch) matmuls, elementwise math, reductions, unsorted segment reductions,
`tf.math.top_k`, `tf.cond` and `tf.while_loop`. Python loops are unrolled at
trace time and bounded by the tree's max depth; `tf.while_loop`s walk the children of
wide nodes in chunks of `CHUNK` (bounded by ``ceil(max_branching / CHUNK)``), top_k's
search (at most `SEARCH_ITERATIONS`) and the rows it leaves unproved.

`top_k` is exact. It runs a batched best-first (branch-and-bound) search, as the op does:
the top levels of the tree are scored in one matmul, then a bounded `tf.while_loop`
expands every row's best frontier nodes (a node's path log-probability bounds every class
below it: log-probabilities only fall along a path, and the scores here are computed so
that this holds in floating point too) until no frontier node of any row can beat or tie
its k-th class. Rows without that proof (out of iterations, a node or a tied class that
the fixed-size state dropped) are searched again one at a time by the beam searches and,
failing those, the exhaustive `log_prob_all` + `tf.math.top_k`.
"""

import math
import numbers

import numpy as np
import tensorflow as tf

from tf_hsm.serving import checks
from tf_hsm.serving._tree import stock_tree

__all__ = ["log_prob", "top_k", "log_prob_all", "sample", "CHUNK"]

# Children of a node are scored in chunks of at most this many (one [N, items, CHUNK, D]
# gather at a time); nodes with more children are walked by a tf.while_loop.
CHUNK = 64
# The first beam's width: max(BEAM_FACTOR * k, BEAM_MIN); the retry's is WIDEN times that.
BEAM_FACTOR = 2
BEAM_MIN = 16
WIDEN = 8
# The best-first search (see `_best_first`): the top levels of at most PREFIX_SLOTS slots
# are scored in one matmul; then each iteration expands every row's best EXPAND frontier
# nodes (fewer where nodes are wide: EXPAND * branching <= EXPAND_SLOTS), for at most
# SEARCH_ITERATIONS iterations, keeping the FRONTIER best unexpanded nodes per row.
PREFIX_SLOTS = 1024
EXPAND = 8
EXPAND_SLOTS = 64
SEARCH_ITERATIONS = 16
# The frontier starts from the FRONTIER_START best of the prefix's nodes, and each
# iteration adds the KEEP_NODES best of its new nodes (the rest are remembered by their
# best score: a row whose k-th class does not beat it is not proved).
FRONTIER_START = 64
KEEP_NODES = 32
# The sizes above are for k up to SEARCH_K; a larger k multiplies EXPAND, EXPAND_SLOTS,
# FRONTIER_START and KEEP_NODES by ceil(k / SEARCH_K): the nodes at or above the k-th
# class grow with k, and a search too narrow for them left every row to the beams, one
# row at a time (at V=1M, k=100: 0.8 s a batch of 64, against 0.1 s sized by k).
SEARCH_K = 12
# The frontier's taken columns are found by a compare of [N, E, W] up to E * W of this.
TAKE_BY_COMPARE = 1 << 20

_LOW_PRECISION = (tf.float16, tf.bfloat16)


# --------------------------------------------------------------------------- inputs

def _inputs(hidden, weights, biases):
  """(flat hidden [N, D] in the table's dtype, leading shape, weights, biases, out dtype)."""
  weights = weights if isinstance(weights, tf.Variable) else tf.convert_to_tensor(weights)
  dtype = weights.dtype
  if dtype not in (tf.float32, tf.float64):
    raise TypeError(f"weights must be float32 or float64, got {dtype.name}")
  if weights.shape.rank is not None and weights.shape.rank != 2:
    raise ValueError(f"weights must be [num_slots, D], got shape {weights.shape}")
  hidden = tf.convert_to_tensor(hidden)
  out_dtype = hidden.dtype
  if hidden.dtype in _LOW_PRECISION:
    hidden = tf.cast(hidden, dtype)
  elif hidden.dtype != dtype:
    raise TypeError(f"hidden must have the weights' dtype {dtype.name} (or float16/bfloat16),"
                    f" got {hidden.dtype.name}")
  if hidden.shape.rank == 0:
    raise ValueError("hidden must be [..., D], got a scalar")
  dim = weights.shape[-1]
  if hidden.shape[-1] is not None and dim is not None and hidden.shape[-1] != dim:
    raise ValueError(f"hidden has width {hidden.shape[-1]}; the weights have D = {dim}")
  if biases is not None:
    biases = biases if isinstance(biases, tf.Variable) else tf.convert_to_tensor(biases)
    if biases.dtype != dtype:
      raise TypeError(f"biases must have the weights' dtype {dtype.name}, got "
                      f"{biases.dtype.name}")
  leading = tf.shape(hidden)[:-1]
  width = tf.shape(weights)[-1] if dim is None else dim
  return tf.reshape(hidden, [-1, width]), leading, weights, biases, out_dtype


def _cast_back(x, out_dtype):
  return tf.cast(x, out_dtype) if x.dtype != out_dtype else x


def _targets(targets):
  targets = tf.convert_to_tensor(targets)
  if not targets.dtype.is_integer:
    raise TypeError(f"targets must be int32/int64 class ids, got {targets.dtype.name}")
  return targets


# --------------------------------------------------------------------------- kernels

def _logits(h, weights, biases, slots):
  """z[n, x] = weights[slots[n, x]] . h[n] + biases[slots[n, x]]; slots [N, X] valid."""
  rows = tf.gather(weights, slots)                        # [N, X, D]
  # A product and a sum: on CPU a batch of matrix-vector products costs far more.
  z = tf.reduce_sum(rows * h[:, None, :], -1)             # [N, X]
  if biases is not None:
    z = z + tf.gather(biases, slots)
  return z


def _lse_finish(m, s):
  """log-sum-exp from a running max and the sum of exp(z - max): max(log(s), 0) keeps
  every log-softmax <= 0 in floating point (s >= 1 in exact arithmetic)."""
  return m + tf.maximum(tf.math.log(s), tf.zeros_like(s))


def _chunk_slots(begin, count, chunk, width):
  """(slots [..., width] clamped to valid rows, valid mask, positions) of chunk `chunk`."""
  pos = chunk * width + tf.range(width, dtype=tf.int32)
  valid = pos < count[..., None]
  slots = tf.where(valid, begin[..., None] + pos, tf.zeros_like(pos))
  return slots, valid, pos


def _walk_chunks(tree, count, body, state):
  """Runs body(chunk, state) over the chunks of CHUNK children that `count` needs:
  unrolled when the widest node fits one chunk, a tf.while_loop otherwise."""
  width = min(tree.max_branching, CHUNK)
  chunks = -(-tree.max_branching // width)
  if chunks == 1:
    return body(tf.constant(0, tf.int32), width, state)
  needed = (tf.reduce_max(tf.concat([tf.reshape(count, [-1]), [0]], 0)) + width - 1) // width

  def cond(c, *unused):
    return c < needed

  def step(c, *s):
    return (c + 1,) + tuple(body(c, width, tuple(s)))

  out = tf.while_loop(cond, step, (tf.constant(0, tf.int32),) + tuple(state),
                      maximum_iterations=chunks)
  return tuple(out[1:])


def _node_lse(tree, h, weights, biases, begin, count, extra=None):
  """log-sum-exp over each item's children ([N, X] nodes given by begin/count), and,
  with `extra` [N, X] positions, the logit of that child too."""
  dtype = h.dtype
  n_shape = tf.shape(begin)
  neg_inf = tf.fill(n_shape, tf.constant(-float("inf"), dtype))
  zeros = tf.zeros(n_shape, dtype)

  def body(c, width, state):
    m, s, picked = state
    slots, valid, pos = _chunk_slots(begin, count, c, width)  # [N, X, W]
    # Reshapes to shapes known when tracing: XLA needs them inside a while loop.
    items = begin.shape[-1]
    z = tf.reshape(_logits(h, weights, biases, tf.reshape(slots, [-1, items * width])),
                   [-1, items, width])
    z = tf.where(valid, z, tf.constant(-float("inf"), dtype))
    m_new = tf.maximum(m, tf.reduce_max(z, -1))
    safe = tf.where(tf.math.is_finite(m_new), m_new, tf.zeros_like(m_new))
    s = s * tf.exp(tf.where(tf.math.is_finite(m), m, safe) - safe) + tf.reduce_sum(
        tf.exp(z - safe[..., None]), -1)
    if extra is not None:
      picked = picked + tf.reduce_sum(tf.where(pos == extra[..., None], z, tf.zeros_like(z)),
                                      -1)
    return m_new, s, picked

  m, s, picked = _walk_chunks(tree, count, body, (neg_inf, zeros, zeros))
  return _lse_finish(m, s), picked


# --------------------------------------------------------------------------- log_prob

def _path_slots(tree, targets):
  """[N, max_depth] slots of each target's path, leaf first, num_slots past the root
  (one gather of `slot_up` per step)."""
  slot = tf.gather(tree.class_slot, targets)
  steps = [slot]
  for _ in range(tree.max_depth - 1):
    slot = tf.gather(tree.slot_up, slot)
    steps.append(slot)
  return tf.stack(steps, axis=1)


def log_prob(hidden, weights, biases, tree, targets):
  """log P(targets | hidden), as `tf_hsm.log_prob`, in stock TensorFlow ops.

  Args:
    hidden: [..., D] float32/float64 (float16/bfloat16 are computed in the table's dtype).
    weights: [tree.num_slots, D] table, one row per tree edge (a tensor or a variable).
    biases: [tree.num_slots] or None.
    tree: a `tf_hsm.Tree` (or the `StockTree` of one).
    targets: int32/int64 class ids with hidden's leading shape. Targets < 0 are padding:
      log-probability 0 (as `tf_hsm.HierarchicalSoftmax` gives). Targets >= num_classes
      give NaN (no op here can raise inside TFLite; `export` adds a check where
      TensorFlow runs).

  Returns:
    log-probabilities with targets' shape and hidden's dtype.
  """
  tree = stock_tree(tree)
  h, leading, weights, biases, out_dtype = _inputs(hidden, weights, biases)
  targets = tf.reshape(tf.cast(_targets(targets), tf.int32), [-1])
  too_big = targets >= tree.num_classes
  valid = tf.logical_and(targets >= 0, tf.logical_not(too_big))
  safe = tf.where(valid, targets, tf.zeros_like(targets))
  slots = _path_slots(tree, safe)                              # [N, L]
  on_path = slots < tree.num_slots
  begin = tf.gather(tree.slot_begin, slots)
  count = tf.gather(tree.slot_count, slots)                    # 0 past the root
  lse, picked = _node_lse(tree, h, weights, biases, begin, count, extra=slots - begin)
  steps = tf.where(on_path, picked - lse, tf.zeros_like(lse))
  out = tf.reduce_sum(steps, -1)
  out = tf.where(valid, out, tf.zeros_like(out))
  out = tf.where(too_big, tf.constant(float("nan"), out.dtype), out)
  return _cast_back(tf.reshape(out, leading), out_dtype)


# --------------------------------------------------------------------------- log_prob_all

def _all_classes(tree, h, weights, biases):
  """[N, C] log-probabilities of every class (flat hidden)."""
  dtype = h.dtype
  logits = tf.matmul(weights, h, transpose_b=True)                   # [S, N]
  if biases is not None:
    logits = logits + tf.cast(biases, dtype)[:, None]
  m = tf.math.unsorted_segment_max(logits, tree.slot_node, tree.num_nodes)   # [M, N]
  m = tf.where(tf.math.is_finite(m), m, tf.zeros_like(m))
  s = tf.math.unsorted_segment_sum(tf.exp(logits - tf.gather(m, tree.slot_node)),
                                   tree.slot_node, tree.num_nodes)
  lse = _lse_finish(m, s)
  step = logits - tf.gather(lse, tree.slot_node)                      # [S, N]
  node_lp = tf.zeros([1, tf.shape(h)[0]], dtype)                     # the root
  for slots, parents in zip(tree.level_slots, tree.level_parents):
    level = tf.gather(node_lp, parents) + tf.gather(step, slots)
    node_lp = tf.concat([node_lp, level], 0)
  out = tf.gather(node_lp, tree.class_node) + tf.gather(step, tree.class_slot)  # [C, N]
  return tf.transpose(out)


def log_prob_all(hidden, weights, biases, tree):
  """log P(c | hidden) for every class c, as `tf_hsm.log_prob_all` (without class_range).

  One matmul against the whole table, a log-softmax per node (unsorted segment
  reductions) and a sweep down the tree's levels.

  Returns:
    [..., num_classes] log-probabilities, hidden's dtype.
  """
  tree = stock_tree(tree)
  h, leading, weights, biases, out_dtype = _inputs(hidden, weights, biases)
  out = _all_classes(tree, h, weights, biases)
  return _cast_back(tf.reshape(out, tf.concat([leading, [tree.num_classes]], 0)), out_dtype)


# --------------------------------------------------------------------------- top_k

def _beam(tree, h, weights, biases, width):
  """A beam search of `width` items per row over all levels.

  Returns (codes [N, width] int32: classes, -1 for empty; scores [N, width]; bound [N]:
  the best score pruned, -inf when nothing was)."""
  dtype = h.dtype
  c = tree.num_classes
  n = tf.shape(h)[0]
  neg_inf = tf.constant(-float("inf"), dtype)
  codes = tf.concat([tf.fill([n, 1], tf.constant(c, tf.int32)),
                     tf.fill([n, width - 1], tf.constant(-1, tf.int32))], 1)
  scores = tf.concat([tf.zeros([n, 1], dtype), tf.fill([n, width - 1], neg_inf)], 1)
  bound = tf.fill([n], neg_inf)
  keep = width + 1
  for _ in range(tree.max_depth):
    is_node = codes >= c
    node = tf.where(is_node, codes - c, tf.zeros_like(codes))
    begin = tf.gather(tree.child_begin, node)
    count = tf.where(is_node, tf.gather(tree.child_begin, node + 1) - begin,
                     tf.zeros_like(begin))
    # The classes already in the beam compete with the new children.
    carried = tf.where(is_node, neg_inf, scores)
    carried_codes = tf.where(is_node, tf.constant(-1, tf.int32), codes)
    best, best_codes = _top(carried, carried_codes, keep)
    chunk = min(tree.max_branching, CHUNK)

    def candidates(ch, w, lse, begin=begin, count=count, scores=scores):
      """(candidate scores, codes) [N, B * w] of chunk ch; lse None: from this chunk."""
      slots, valid, _ = _chunk_slots(begin, count, ch, w)            # [N, B, W]
      z = tf.reshape(_logits(h, weights, biases, tf.reshape(slots, [-1, width * w])),
                     [-1, width, w])
      z = tf.where(valid, z, neg_inf)
      if lse is None:
        m = tf.reduce_max(z, -1)
        m = tf.where(tf.math.is_finite(m), m, tf.zeros_like(m))
        lse = _lse_finish(m, tf.reduce_sum(tf.exp(z - m[..., None]), -1))
      cand = scores[..., None] + (z - lse[..., None])
      cand = tf.where(valid, cand, neg_inf)
      cand_codes = tf.where(valid, tf.gather(tree.slot_child, slots), -tf.ones_like(slots))
      return tf.reshape(cand, [-1, width * w]), tf.reshape(cand_codes, [-1, width * w])

    if -(-tree.max_branching // chunk) == 1:
      cand, cand_codes = candidates(tf.constant(0, tf.int32), chunk, None)
      best, best_codes = _top(tf.concat([best, cand], 1),
                              tf.concat([best_codes, cand_codes], 1), keep)
    else:
      lse, _ = _node_lse(tree, h, weights, biases, begin, count)

      def body(ch, w, state, lse=lse, candidates=candidates):
        cand, cand_codes = candidates(ch, w, lse)
        return _top(tf.concat([state[0], cand], 1), tf.concat([state[1], cand_codes], 1),
                    keep)

      best, best_codes = _walk_chunks(tree, count, body, (best, best_codes))
    codes, scores = best_codes[:, :width], best[:, :width]
    bound = tf.maximum(bound, best[:, width])
  return codes, scores, bound


def _top(values, codes, keep):
  """The `keep` best (values, codes) of each row; fewer columns are padded with -inf."""
  have = values.shape[1]
  if have is not None and have < keep:
    pad = keep - have
    values = tf.concat([values, tf.fill([tf.shape(values)[0], pad],
                                        tf.constant(-float("inf"), values.dtype))], 1)
    codes = tf.concat([codes, tf.fill([tf.shape(codes)[0], pad], -1)], 1)
  best, where = tf.math.top_k(values, keep, sorted=True)
  return best, tf.gather(codes, where, batch_dims=1)


def _finish(codes, scores, k):
  """The best k of a beam, equal scores in increasing class order."""
  big = tf.constant(2**31 - 1, tf.int32)
  key = tf.where(codes < 0, big, codes)
  _, order = tf.math.top_k(-key, codes.shape[1])              # by class, ascending
  codes = tf.gather(codes, order, batch_dims=1)
  scores = tf.gather(scores, order, batch_dims=1)
  best, where = tf.math.top_k(scores, k)
  return best, tf.gather(codes, where, batch_dims=1)


def _exhaustive(tree, h, weights, biases, k):
  best, classes = tf.math.top_k(_all_classes(tree, h, weights, biases), k)
  return best, tf.cast(classes, tf.int32)


def _proven(best, bound, k):
  return best[:, k - 1] > bound


def _sorted_by_class(values, codes):
  """values and codes reordered so that codes increase (empty codes, -1, last)."""
  big = tf.constant(2**31 - 1, tf.int32)
  _, order = tf.math.top_k(-tf.where(codes < 0, big, codes), codes.shape[1])
  return tf.gather(values, order, batch_dims=1), tf.gather(codes, order, batch_dims=1)


def _pad_to(values, codes, width):
  """values, codes with at least `width` columns (padding: -inf, -1)."""
  have = values.shape[1]
  if have >= width:
    return values, codes
  n = tf.shape(values)[0]
  return (tf.concat([values, tf.fill([n, width - have],
                                     tf.constant(-float("inf"), values.dtype))], 1),
          tf.concat([codes, tf.fill([n, width - have], tf.constant(-1, codes.dtype))], 1))


def _prefix_scores(prefix, h, weights, biases):
  """[N, prefix.num_slots] path log-probabilities of the prefix's slots' children."""
  dtype = h.dtype
  rows = tf.range(prefix.num_slots, dtype=tf.int32)
  logits = tf.matmul(tf.gather(weights, rows), h, transpose_b=True)     # [S0, N]
  if biases is not None:
    logits = logits + tf.gather(biases, rows)[:, None]
  m = tf.math.unsorted_segment_max(logits, prefix.slot_node, prefix.num_nodes)
  m = tf.where(tf.math.is_finite(m), m, tf.zeros_like(m))
  s = tf.math.unsorted_segment_sum(tf.exp(logits - tf.gather(m, prefix.slot_node)),
                                   prefix.slot_node, prefix.num_nodes)
  step = logits - tf.gather(_lse_finish(m, s), prefix.slot_node)       # [S0, N]
  node_lp = tf.zeros([1, tf.shape(h)[0]], dtype)
  for slots, parents in zip(prefix.level_slots, prefix.level_parents):
    node_lp = tf.concat([node_lp, tf.gather(node_lp, parents) + tf.gather(step, slots)], 0)
  return tf.transpose(tf.gather(node_lp, prefix.slot_node) + step)


def search_sizes(tree, k):
  """(prefix, expand, start, keep, iterations) of the best-first search: the
  `SearchPrefix`, the nodes each row expands per iteration, the frontier's columns
  taken from the prefix and per iteration, the iteration bound."""
  scale = max(1, -(-int(k) // SEARCH_K))
  prefix = tree.search_prefix(PREFIX_SLOTS)
  expand = max(1, min(EXPAND * scale, EXPAND_SLOTS * scale // max(1, prefix.branching)))
  start = max(expand, min(FRONTIER_START * scale, int(prefix.nodes.shape[0])))
  keep = max(1, min(KEEP_NODES * scale, expand * prefix.branching))
  return prefix, expand, start, keep, SEARCH_ITERATIONS


def _best_first(tree, h, weights, biases, k):
  """Best-first (branch-and-bound) search of every row's top k.

  Per row: the best k classes found so far (`found`), the best value of any class that
  `found` could not keep (`dropped`), and a frontier of unexpanded nodes scored by their
  path log-probability, which bounds every class below them (every step adds
  z - lse <= 0, also in floating point). The top levels (`SearchPrefix`) are scored in
  one matmul; then each iteration takes the best `expand` frontier nodes of every row
  whose best one is not below its k-th class, scores their children (one gather of
  their weight rows, one batched product, a log-softmax per node), merges the classes
  into `found` and writes the nodes into the frontier's block for that iteration (the
  frontier has a fixed capacity: the prefix's nodes and `expand * branching` columns
  per iteration; it is never full).

  A row is proved when no frontier node is at or above its k-th class (so no class
  below one can beat or tie it) and no dropped class ties it (the tie order, increasing
  class, is then only needed inside `found`).

  Returns (values [N, k], classes [N, k] int32, proved [N] bool, iterations run): where
  proved, the row's exact top k, equal values in increasing class order.
  """
  dtype = h.dtype
  c = tree.num_classes
  prefix, expand, start, keep, iterations = search_sizes(tree, k)
  neg_inf = tf.constant(-float("inf"), dtype)
  n = tf.shape(h)[0]
  scores = _prefix_scores(prefix, h, weights, biases)                   # [N, S0]
  cls_v, cls_c = _pad_to(tf.gather(scores, prefix.class_slots, axis=1),
                         tf.tile(prefix.classes[None], [n, 1]), k + 1)
  found_v, found_c = _top(cls_v, cls_c, k + 1)
  dropped = found_v[:, k]
  found_v, found_c = found_v[:, :k], found_c[:, :k]
  if prefix.complete:
    found_v, found_c = _sorted_by_class(found_v, found_c)
    best, where = tf.math.top_k(found_v, k)
    return best, tf.gather(found_c, where, batch_dims=1), tf.fill([n], True), tf.constant(
        0, tf.int32)
  branching = prefix.branching
  block = expand * branching
  width = start + iterations * keep
  node_v = tf.gather(scores, prefix.node_slots, axis=1)
  node_v = tf.where(node_v >= found_v[:, k - 1:], node_v, neg_inf)
  fr_v, fr_n = _top(node_v, tf.tile(prefix.nodes[None], [n, 1]), start + 1)
  lost = fr_v[:, start]
  fr_v, fr_n = _pad_to(fr_v[:, :start], fr_n[:, :start], width)
  column = tf.range(width, dtype=tf.int32)

  def state(found_v, dropped, lost, fr_v):
    """(open: a frontier node not below the k-th class; stuck: a class that ties the
    k-th was dropped, or a node not below it lost: more search cannot prove the row)."""
    kth = found_v[:, k - 1]
    top = tf.reduce_max(fr_v, -1)
    is_open = tf.logical_and(top >= kth, top > neg_inf)
    stuck = tf.logical_and(tf.maximum(dropped, lost) >= kth, kth > neg_inf)
    return is_open, stuck

  def cond(i, found_v, found_c, dropped, lost, fr_v, fr_n):
    del found_c, fr_n
    is_open, stuck = state(found_v, dropped, lost, fr_v)
    return tf.logical_and(i < iterations,
                          tf.reduce_any(tf.logical_and(is_open, tf.logical_not(stuck))))

  def body(i, found_v, found_c, dropped, lost, fr_v, fr_n):
    is_open, stuck = state(found_v, dropped, lost, fr_v)
    active = tf.logical_and(is_open, tf.logical_not(stuck))
    kth = found_v[:, k - 1]
    sel_v, sel_at, taken = _take_best(fr_v, expand, column)
    go = tf.logical_and(tf.logical_and(active[:, None], sel_v > neg_inf),
                        sel_v >= kth[:, None])
    node = tf.where(go, tf.gather(fr_n, sel_at, batch_dims=1), tf.zeros_like(sel_at))
    # The selected of active rows leave the frontier (those not expanded are below the
    # k-th class).
    fr_v = tf.where(tf.logical_and(active[:, None], taken), neg_inf, fr_v)
    begin = tf.gather(tree.child_begin, node)
    count = tf.where(go, tf.gather(tree.child_begin, node + 1) - begin, tf.zeros_like(begin))
    pos = tf.range(branching, dtype=tf.int32)
    valid = pos < count[..., None]                                          # [N, E, B]
    slots = tf.where(valid, begin[..., None] + pos, tf.zeros_like(pos))
    z = tf.reshape(_logits(h, weights, biases, tf.reshape(slots, [-1, block])),
                   [-1, expand, branching])
    z = tf.where(valid, z, neg_inf)
    m = tf.reduce_max(z, -1)
    m = tf.where(tf.math.is_finite(m), m, tf.zeros_like(m))
    lse = _lse_finish(m, tf.reduce_sum(tf.exp(z - m[..., None]), -1))
    cand = tf.reshape(tf.where(valid, sel_v[..., None] + (z - lse[..., None]), neg_inf),
                      [-1, block])
    child = tf.reshape(tf.gather(tree.slot_child, slots), [-1, block])
    valid = tf.reshape(valid, [-1, block])
    is_class = tf.logical_and(valid, child < c)
    found_v, found_c = _top(tf.concat([found_v, tf.where(is_class, cand, neg_inf)], 1),
                            tf.concat([found_c, tf.where(is_class, child, -tf.ones_like(child))],
                                      1), k + 1)
    dropped = tf.maximum(dropped, found_v[:, k])
    found_v, found_c = found_v[:, :k], found_c[:, :k]
    kth = found_v[:, k - 1]
    # The best `keep` children that are nodes (not below the k-th class) take this
    # iteration's columns of the frontier.
    is_node = tf.logical_and(tf.logical_and(valid, child >= c), cand >= kth[:, None])
    new_v, new_n = _top(tf.where(is_node, cand, neg_inf),
                        tf.where(is_node, child - c, -tf.ones_like(child)), keep + 1)
    lost = tf.maximum(lost, new_v[:, keep])
    mine = tf.logical_and(column >= start, tf.equal((column - start) // keep, i))[None]
    tiles = width // keep + 1
    fr_v = tf.where(mine, tf.tile(new_v[:, :keep], [1, tiles])[:, -width:], fr_v)
    fr_n = tf.where(mine, tf.tile(new_n[:, :keep], [1, tiles])[:, -width:], fr_n)
    out = (found_v, found_c, dropped, lost, fr_v, fr_n)
    for new_t, old_t in zip(out, shapes):
      new_t.set_shape(old_t)       # the batch size, where known, is kept
    return (i + 1,) + out

  init = (found_v, found_c, dropped, lost, fr_v, fr_n)
  shapes = [t.shape for t in init]
  steps, found_v, found_c, dropped, lost, fr_v, _ = tf.while_loop(
      cond, body, (tf.constant(0, tf.int32),) + init, maximum_iterations=iterations)
  is_open, _ = state(found_v, dropped, lost, fr_v)
  kth = found_v[:, k - 1]
  bound = tf.maximum(dropped, lost)
  # Nothing left at or above the k-th class (all -inf: every class found, or -inf ties).
  proved = tf.logical_and(tf.logical_not(is_open),
                          tf.logical_or(bound < kth, bound == neg_inf))
  found_v, found_c = _sorted_by_class(found_v, found_c)
  best, where = tf.math.top_k(found_v, k)
  return best, tf.gather(found_c, where, batch_dims=1), proved, steps


def _take_best(values, count, column):
  """(the `count` best values [N, E], their columns, a mask [N, W] of those columns) of
  `values` [N, W]; `column` is range(W). Not a scatter, which XLA needs the shape of at
  compile time where the rows' count is not always one (a batch of an Embedding's
  lookups). For a small E a compare of every taken column with every column, [N, E, W]
  (at V=1M, k=10, a batch of 64 under XLA: 14.8 ms a search, against 53.9 ms by the
  sorts); for a large one, where the compare grows as k squared, each column's rank in
  the values' order, a second sort (its inverse permutation)."""
  width = int(values.shape[-1])
  if count * width <= TAKE_BY_COMPARE:
    best, at = tf.math.top_k(values, count)
    return best, at, tf.reduce_any(tf.equal(at[:, :, None], column[None, None, :]), axis=1)
  ordered, order = tf.math.top_k(values, width)     # stable: ties by column
  rank = tf.math.top_k(-order, width).indices
  return ordered[:, :count], order[:, :count], rank < count


def _search(tree, h, weights, biases, k, widths):
  """(log_probs, classes int32) for the first beam width of `widths` that proves each
  row's top k, the exhaustive computation where none does."""
  if not widths:
    return _exhaustive(tree, h, weights, biases, k)
  codes, scores, bound = _beam(tree, h, weights, biases, widths[0])
  best, classes = _finish(codes, scores, k)
  if widths[0] >= tree.num_classes:   # nothing can have been pruned
    return best, classes
  ok = _proven(best, bound, k)

  def retry():
    again, again_classes = _search(tree, h, weights, biases, k, widths[1:])
    return (tf.where(ok[:, None], best, again),
            tf.where(ok[:, None], classes, again_classes))

  return tf.cond(tf.reduce_all(ok), lambda: (best, classes), retry)


def beam_widths(k, num_classes):
  """The beam widths top_k tries before the exhaustive search."""
  first = min(max(BEAM_FACTOR * k, BEAM_MIN), num_classes)
  if first >= num_classes:
    return [num_classes]
  return [first, min(first * WIDEN, num_classes)]


def _top_k_rows(tree, h, weights, biases, k):
  """(log_probs, classes int32) [N, k]: the best-first search, then, one row at a time
  (a tf.while_loop over the rows it did not prove, run only when there are any), the
  beam searches and the exhaustive pass."""
  best, classes, proved, _ = _best_first(tree, h, weights, biases, k)
  widths = beam_widths(k, tree.num_classes)
  rows = tf.range(tf.shape(h)[0], dtype=tf.int32)

  def cond(pending, best, classes):
    del best, classes
    return tf.reduce_any(pending)

  def body(pending, best, classes):
    row = tf.argmax(tf.cast(pending, tf.int32), output_type=tf.int32)
    one_v, one_c = _search(tree, tf.gather(h, row[None]), weights, biases, k, widths)
    here = tf.equal(rows, row)
    new_v = tf.where(here[:, None], one_v, best)
    new_c = tf.where(here[:, None], one_c, classes)
    new_v.set_shape(best.shape)    # a static batch of 1 is kept
    new_c.set_shape(classes.shape)
    return tf.logical_and(pending, tf.logical_not(here)), new_v, new_c

  _, best, classes = tf.while_loop(cond, body, (tf.logical_not(proved), best, classes))
  return best, classes


def top_k(hidden, weights, biases, tree, k, exclude=None):
  """The k most probable classes of each row, exactly, as `tf_hsm.top_k`.

  Args:
    hidden: [..., D] float32/float64 (float16/bfloat16 are computed in the table's dtype).
    weights: [tree.num_slots, D]; biases: [tree.num_slots] or None.
    tree: a `tf_hsm.Tree` (or its `StockTree`).
    k: a Python int >= 1. Unlike the op, k > num_classes is accepted and clamped: the
      result then has num_classes columns.
    exclude: None, or int class ids [..., n] a row leaves out, as `tf_hsm.top_k`'s:
      hidden's rank, each leading dimension hidden's or 1 (1 applies to every row along
      it), n known; ids < 0 are padding. The top k + n are searched and the excluded
      ones dropped; a row with fewer than k classes left ends in class -1 with -inf.

  Returns:
    ``(log_probs, classes)``: ``[..., min(k, C)]`` log-probabilities in decreasing order
    (hidden's dtype) and int64 classes; equal log-probabilities in increasing class order.
    The classes are the op's wherever the k-th and (k+1)-th log-probabilities are not
    tied. A row with a NaN log-probability (a NaN or infinite hidden state, or logits
    that overflow) has no ranking: its classes are all -1 and its log-probabilities
    NaN, so that no id outside [0, num_classes) is ever returned.

  Raises:
    TypeError, ValueError: as `tf_hsm.top_k` (an `exclude` that is not integer, of
      another rank than hidden's, or of unknown n); InvalidArgumentError where
      TensorFlow runs: exclude's leading shape does not broadcast to hidden's, or an
      excluded id >= num_classes (elsewhere such ids match no class).
  """
  tree = stock_tree(tree)
  if isinstance(k, bool) or not isinstance(k, int) or k < 1:
    raise ValueError(f"k must be a Python int >= 1, got {k!r}")
  k = min(k, tree.num_classes)
  rank = tf.convert_to_tensor(hidden).shape.rank
  h, leading, weights, biases, out_dtype = _inputs(hidden, weights, biases)
  ids = None if exclude is None else exclusions(exclude, rank, leading, tree.num_classes)
  wide = k if ids is None else min(k + ids.shape[-1], tree.num_classes)
  best, classes = _top_k_flat(tree, h, weights, biases, wide)
  if ids is not None:
    best, classes = drop_excluded(best, classes, ids, k)
  shape = tf.concat([leading, [k]], 0)
  return _cast_back(tf.reshape(best, shape), out_dtype), tf.reshape(classes, shape)


def at_least_one_row(h):
  """(`h` [N, D] with a row of zeros below it where N is 0, N). An empty batch is ranked
  as one row: the search's ops refuse zero rows in LiteRT and under XLA (which compiles
  for the batch's static size), and LiteRT's default delegate, once it has run a batch of
  zero rows through a mixture's ranking, ranked the next new batch size wrongly."""
  n = tf.shape(h)[0]
  zeros = tf.zeros(tf.stack([tf.maximum(1 - n, 0), tf.shape(h)[1]]), h.dtype)
  return tf.concat([h, zeros], 0), n


def _top_k_flat(tree, h, weights, biases, k):
  """(log_probs, int64 classes) [N, k] of the rows h [N, D]; NaN rows -1 and NaN."""
  padded, n = at_least_one_row(h)
  best, classes = _top_k_rows(tree, padded, weights, biases, k)
  best, classes = no_class_where_nan(best[:n], tf.cast(classes[:n], tf.int64),
                                     tree.num_classes)
  return best, classes


def exclusions(exclude, rank, leading, num_classes):
  """`exclude` ([..., n] int class ids) checked against hidden's `rank` and broadcast to
  its `leading` shape: int64 [N, n], one row per row of hidden."""
  exclude = tf.convert_to_tensor(exclude)
  if not exclude.dtype.is_integer:
    raise TypeError(f"exclude must be int class ids, got {exclude.dtype.name}")
  if rank is None:
    raise ValueError("exclude needs a hidden of known rank")
  n = exclude.shape[-1] if exclude.shape.rank else None
  if exclude.shape.rank != rank or n is None:
    raise ValueError(f"exclude must be class ids [..., n] with hidden's rank {rank} and a "
                     f"known n, got shape {exclude.shape} (for the same ids on every row "
                     f"of a [B, D] batch: shape [1, n])")
  exclude = checks.targets_below(tf.cast(exclude, tf.int64), num_classes, "exclude")
  exclude = checks.broadcast_rows(exclude, leading, "exclude")
  return tf.reshape(exclude, [-1, n])


def drop_excluded(values, classes, exclude, k):
  """The best k of top lists (values, int64 classes) [N, K] that are not in `exclude`
  [N, n] (ids < 0 match nothing), in the lists' order; -inf and class -1 where fewer
  than k are left."""
  wide = classes.shape[-1]
  hit = tf.logical_and(tf.equal(classes[:, :, None], exclude[:, None, :]),
                       exclude[:, None, :] >= 0)
  excluded = tf.reduce_any(hit, -1)
  # Allowed entries first, each group in the list's order: the k smallest keys (unique),
  # by tf.math.top_k, which TFLite's builtins have (argsort is not one).
  key = tf.range(wide, dtype=tf.int32) + wide * tf.cast(excluded, tf.int32)
  _, order = tf.math.top_k(-key, k)
  picked = [tf.gather(x, order, batch_dims=1) for x in (values, classes, excluded)]
  return (tf.where(picked[2], tf.constant(-np.inf, values.dtype), picked[0]),
          tf.where(picked[2], tf.constant(-1, tf.int64), picked[1]))


def no_class_where_nan(values, classes, num_classes):
  """(values, classes) [N, k] with the rows that hold a NaN value, or a class outside
  [0, num_classes), set to NaN and -1."""
  bad = tf.reduce_any(tf.logical_or(
      tf.math.is_nan(values), tf.logical_or(classes < 0, classes >= num_classes)), -1)
  return (tf.where(bad[:, None], tf.constant(float("nan"), values.dtype), values),
          tf.where(bad[:, None], -tf.ones_like(classes), classes))


# --------------------------------------------------------------------------- sample

def sample_arguments(seed, temperature, dtype):
  """(seed int64 scalar, temperature in `dtype`, ok: whether the temperature is usable).

  A Python temperature is checked here (ValueError, as `tf_hsm.sample`); a tensor by an
  assert where TensorFlow runs, and by `ok` where asserts are dropped (XLA): the draws
  are then -1."""
  if isinstance(seed, bool) or isinstance(temperature, (bool, np.bool_)):
    raise TypeError("seed must be an int and temperature a float, got a bool")
  tiny = float(np.finfo(dtype.as_numpy_dtype).tiny)
  if isinstance(temperature, numbers.Real):
    if not (math.isfinite(temperature) and temperature > 0):
      raise ValueError(f"temperature must be positive and finite, got {temperature!r}")
    if temperature < tiny:
      raise ValueError(f"temperature {temperature!r} is below the smallest normal "
                       f"{dtype.name} ({tiny:g}): TensorFlow's CPU kernels read subnormal "
                       "numbers as 0")
  seed, temperature = tf.convert_to_tensor(seed), tf.convert_to_tensor(temperature)
  if not seed.dtype.is_integer:
    raise TypeError(f"seed must be an int scalar, got {seed.dtype.name}")
  if not temperature.dtype.is_floating:
    raise TypeError(f"temperature must be a float scalar, got {temperature.dtype.name}")
  for value, name in ((seed, "seed"), (temperature, "temperature")):
    if value.shape.rank not in (None, 0):
      raise ValueError(f"{name} must be a scalar, got shape {value.shape}")
  seed = tf.cast(checks.conform(seed, [], "seed"), tf.int64)
  temperature = tf.cast(checks.conform(temperature, [], "temperature"), dtype)
  ok = tf.logical_and(tf.math.is_finite(temperature), temperature >= tiny)
  check = tf.debugging.Assert(
      ok, [f"temperature must be positive and finite (and at least {tiny:g}, the smallest "
           f"normal {dtype.name}); for the most probable class use top_k; got", temperature],
      name="check_temperature")
  with tf.control_dependencies([check]):
    return seed, tf.identity(temperature), ok


def bad_logits(z, valid):
  """[N] whether a row's valid logits hold a NaN or +inf (no distribution to draw
  from, as `tf_hsm.sample` decides; a -inf logit only masks its child)."""
  bad = tf.logical_or(tf.math.is_nan(z), tf.equal(z, float("inf")))
  return tf.reduce_any(tf.logical_and(valid, bad), -1)

def sample(hidden, weights, biases, tree, seed, temperature=1.0):
  """One class per row, drawn from the hierarchical softmax (ancestral sampling with the
  Gumbel-max trick at each node), reproducible for a seed.

  Not the op's random stream: the same distribution, other draws.

  Args:
    hidden, weights, biases, tree: as `log_prob`.
    seed: int scalar (Python int or tensor).
    temperature: positive and finite float, at least the smallest normal number of the
      table's dtype (Python number or scalar tensor); every node's logits are divided by
      it. 0 is refused, as by `tf_hsm.sample`: the most probable class is `top_k`'s
      first. A Python number is checked here (ValueError); a tensor by an assert
      (InvalidArgumentError), or, where asserts are dropped (XLA), every draw is -1.

  Returns:
    int64 classes with hidden's leading shape. A row whose logits at a visited node are
    NaN or +inf, or all -inf, has no distribution and gets -1 (as with `tf_hsm.sample`).
  """
  tree = stock_tree(tree)
  h, leading, weights, biases, _ = _inputs(hidden, weights, biases)
  seed, temperature, usable = sample_arguments(seed, temperature, h.dtype)
  c = tree.num_classes
  code = tf.fill([tf.shape(h)[0]], tf.constant(c, tf.int32))
  bad = tf.fill(tf.shape(code), tf.logical_not(usable))
  for depth in range(tree.max_depth):
    code, bad = _sample_level(tree, h, weights, biases, seed, temperature, depth, code, bad)
  code = tf.where(tf.logical_or(bad, code >= c), -tf.ones_like(code), code)
  return tf.reshape(tf.cast(code, tf.int64), leading)


def _sample_level(tree, h, weights, biases, seed, temperature, depth, code, bad):
  """One step down the tree: (codes, bad rows) after drawing each node's child."""
  dtype = h.dtype
  c = tree.num_classes
  n = tf.shape(h)[0]
  is_node = code >= c
  node = tf.where(is_node, code - c, tf.zeros_like(code))
  begin = tf.gather(tree.child_begin, node)
  count = tf.where(is_node, tf.gather(tree.child_begin, node + 1) - begin,
                   tf.zeros_like(begin))
  width = min(tree.max_branching, CHUNK)
  chunks = -(-tree.max_branching // width)
  # Every child position's uniform, drawn before any loop: XLA needs the shapes of
  # random ops known when compiling, which a while loop's body does not give.
  noise = tf.random.stateless_uniform(
      tf.stack([n, chunks * width]), tf.stack([seed, tf.constant(depth, tf.int64)]),
      minval=tf.constant(1e-12, dtype), maxval=tf.constant(1.0, dtype), dtype=dtype)
  gumbel = -tf.math.log(-tf.math.log(noise))

  neg_inf = tf.constant(-float("inf"), dtype)

  def body(ch, w, state):
    # Gumbel-max over (z - m) / temperature, m the running max of the node's logits (the
    # best kept so far is rescaled when m grows): z / temperature alone overflows to
    # +-inf for small temperatures, where the draw should approach the most probable.
    best, best_code, m, broken = state
    slots, valid, pos = _chunk_slots(begin, count, ch, w)             # [N, W]
    z = _logits(h, weights, biases, slots)
    broken = tf.logical_or(broken, bad_logits(z, valid))
    z = tf.where(valid, z, neg_inf)
    m_new = tf.maximum(m, tf.reduce_max(z, -1))
    shift = tf.where(tf.math.is_finite(m_new), m_new, tf.zeros_like(m_new))
    best = tf.where(tf.equal(m, m_new), best, best + (m - shift) / temperature)
    g = (z - shift[:, None]) / temperature + tf.gather(gumbel, pos, axis=1)
    g = tf.where(valid, g, neg_inf)
    arg = tf.argmax(g, -1, output_type=tf.int32)
    top = tf.reduce_max(g, -1)
    child = tf.gather(tree.slot_child, tf.gather(slots, arg[:, None], batch_dims=1)[:, 0])
    better = top > best
    return tf.where(better, top, best), tf.where(better, child, best_code), m_new, broken

  init = (tf.fill([n], neg_inf), code, tf.fill([n], neg_inf), bad)
  _, chosen, _, bad = _walk_chunks(tree, count, body, init)
  # A node whose children are all -inf keeps its own code: -1 at the end.
  return tf.where(is_node, chosen, code), bad
