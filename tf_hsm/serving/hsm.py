"""Hierarchical-softmax inference in stock TensorFlow ops: `log_prob`, `top_k`,
`log_prob_all` and `sample`, with the arguments and results of `tf_hsm.log_prob`,
`tf_hsm.top_k`, `tf_hsm.log_prob_all` and `tf_hsm.sample`.

Every op used here is one that TensorFlow, XLA and TFLite's builtin op set all accept:
gathers, (batch) matmuls, elementwise math, reductions, unsorted segment reductions,
`tf.math.top_k`, `tf.cond` and `tf.while_loop`. Python loops are unrolled at trace time
and bounded by the tree's max depth; `tf.while_loop`s only walk the children of wide
nodes in chunks of `CHUNK` (bounded by ``ceil(max_branching / CHUNK)``).

`top_k` is exact. It runs a level-synchronous beam search whose every row carries a proof:
the best score it pruned bounds every class below the pruned item (log-probabilities only
fall along a path, and the scores here are computed so that this holds in floating point
too), so a row whose k-th score beats that bound has its exact top k. Rows without the
proof are searched again with an 8x wider beam, and rows failing that too get the
exhaustive `log_prob_all` + `tf.math.top_k`.
"""

import tensorflow as tf

from tf_hsm.serving._tree import stock_tree

__all__ = ["log_prob", "top_k", "log_prob_all", "sample", "CHUNK"]

# Children of a node are scored in chunks of at most this many (one [N, items, CHUNK, D]
# gather at a time); nodes with more children are walked by a tf.while_loop.
CHUNK = 64
# The first beam's width: max(BEAM_FACTOR * k, BEAM_MIN); the retry's is WIDEN times that.
BEAM_FACTOR = 2
BEAM_MIN = 16
WIDEN = 8

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
  z = tf.squeeze(tf.matmul(rows, h[:, :, None]), -1)      # [N, X]
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
  """[N, max_depth] slots of each target's path, leaf first, -1 past the root."""
  slot = tf.gather(tree.class_slot, targets)
  steps = []
  for _ in range(tree.max_depth):
    steps.append(slot)
    node = tf.gather(tree.slot_node, tf.maximum(slot, 0))
    parent_slot = tf.gather(tree.node_slot, node)
    slot = tf.where(slot >= 0, parent_slot, slot)
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
  on_path = slots >= 0
  node = tf.gather(tree.slot_node, tf.maximum(slots, 0))
  begin = tf.gather(tree.child_begin, node)
  count = tf.where(on_path, tf.gather(tree.child_begin, node + 1) - begin,
                   tf.zeros_like(begin))
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


def top_k(hidden, weights, biases, tree, k):
  """The k most probable classes of each row, exactly, as `tf_hsm.top_k`.

  Args:
    hidden: [..., D] float32/float64 (float16/bfloat16 are computed in the table's dtype).
    weights: [tree.num_slots, D]; biases: [tree.num_slots] or None.
    tree: a `tf_hsm.Tree` (or its `StockTree`).
    k: a Python int >= 1. Unlike the op, k > num_classes is accepted and clamped: the
      result then has num_classes columns.

  Returns:
    ``(log_probs, classes)``: ``[..., min(k, C)]`` log-probabilities in decreasing order
    (hidden's dtype) and int64 classes; equal log-probabilities in increasing class order.
    The classes are the op's wherever the k-th and (k+1)-th log-probabilities are not
    tied. NaN inputs give unspecified classes.
  """
  tree = stock_tree(tree)
  if isinstance(k, bool) or not isinstance(k, int) or k < 1:
    raise ValueError(f"k must be a Python int >= 1, got {k!r}")
  k = min(k, tree.num_classes)
  h, leading, weights, biases, out_dtype = _inputs(hidden, weights, biases)
  best, classes = _search(tree, h, weights, biases, k, beam_widths(k, tree.num_classes))
  shape = tf.concat([leading, [k]], 0)
  return (_cast_back(tf.reshape(best, shape), out_dtype),
          tf.reshape(tf.cast(classes, tf.int64), shape))


# --------------------------------------------------------------------------- sample

def sample(hidden, weights, biases, tree, seed, temperature=1.0):
  """One class per row, drawn from the hierarchical softmax (ancestral sampling with the
  Gumbel-max trick at each node), reproducible for a seed.

  Not the op's random stream: the same distribution, other draws.

  Args:
    hidden, weights, biases, tree: as `log_prob`.
    seed: int scalar (Python int or tensor).
    temperature: positive float (Python number or scalar tensor); every node's logits
      are divided by it.

  Returns:
    int64 classes with hidden's leading shape.
  """
  tree = stock_tree(tree)
  h, leading, weights, biases, _ = _inputs(hidden, weights, biases)
  dtype = h.dtype
  c = tree.num_classes
  n = tf.shape(h)[0]
  seed = tf.cast(seed, tf.int64)
  temperature = tf.cast(temperature, dtype)
  code = tf.fill([n], tf.constant(c, tf.int32))
  for depth in range(tree.max_depth):
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

    def body(ch, w, state, begin=begin, count=count, gumbel=gumbel):
      best, best_code = state
      slots, valid, pos = _chunk_slots(begin, count, ch, w)             # [N, W]
      z = _logits(h, weights, biases, slots) / temperature
      g = z + tf.gather(gumbel, pos, axis=1)
      g = tf.where(valid, g, tf.constant(-float("inf"), dtype))
      arg = tf.argmax(g, -1, output_type=tf.int32)
      top = tf.reduce_max(g, -1)
      child = tf.gather(tree.slot_child, tf.gather(slots, arg[:, None], batch_dims=1)[:, 0])
      better = top > best
      return tf.where(better, top, best), tf.where(better, child, best_code)

    init = (tf.fill([n], tf.constant(-float("inf"), dtype)), code)
    _, chosen = _walk_chunks(tree, count, body, init)
    code = tf.where(is_node, chosen, code)
  return tf.reshape(tf.cast(code, tf.int64), leading)
