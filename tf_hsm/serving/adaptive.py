"""`tf_hsm.AdaptiveSoftmax` inference in stock TensorFlow ops: log_prob, top_k,
log_prob_all and sample over a head and flat or tree tails.

Static shapes throughout (so that XLA and TFLite take it): every cluster is computed for
every row, where the layer's training call gathers each tier's rows. For a flat tail that
is the cluster's whole softmax per row (what `AdaptiveSoftmax.log_prob_all` costs); a
tree tail costs its path (log_prob) or its beam search (top_k).
"""

import numbers

import numpy as np
import tensorflow as tf

from tf_hsm.serving import hsm
from tf_hsm.serving._tree import stock_tree

__all__ = ["AdaptiveWeights", "ClassOrder", "adaptive_log_prob", "adaptive_top_k",
           "adaptive_log_prob_all", "adaptive_sample"]


class ClassOrder:
  """An `AdaptiveSoftmax`'s vocabulary ids and its classes: the layer's class r (its
  r-th most frequent, what the head and clusters are laid out by) is vocabulary id
  `order[r]`. Ids that `order` leaves out (padding, say id 0) are not classes.

  One piece of code for training and serving: stock gathers only (TFLite builtins).

  Args:
    order: 1-D distinct ints in [0, vocabulary_size), most frequent first, at least 2.
    vocabulary_size: V, the number of ids.
  """

  def __init__(self, order, vocabulary_size):
    vocabulary_size = int(vocabulary_size)
    try:
      order = np.asarray(order)
    except (TypeError, ValueError) as error:
      raise ValueError(f"class_order must be a list of int ids: {error}") from None
    if order.ndim != 1 or order.size < 2 or not (
        np.issubdtype(order.dtype, np.integer) or
        (order.dtype == object and all(isinstance(v, (int, np.integer)) for v in order))):
      raise ValueError("class_order must be a 1-D list of at least 2 int ids (the vocabulary "
                       f"ids from the most to the least frequent), got shape {order.shape} "
                       f"and dtype {order.dtype}")
    order = order.astype(np.int64)
    outside = (order < 0) | (order >= vocabulary_size)
    if outside.any():
      first = int(np.argmax(outside))
      raise ValueError(f"class_order must hold ids in [0, num_classes={vocabulary_size}): "
                       f"class_order[{first}] = {int(order[first])}")
    rank_of_id = np.full(vocabulary_size, -1, np.int64)
    rank_of_id[order] = np.arange(order.size)
    if np.count_nonzero(rank_of_id >= 0) != order.size:
      values, seen = np.unique(order, return_counts=True)
      raise ValueError(f"class_order must list each id once: {int(values[seen > 1][0])} "
                       "appears more than once")
    self.order = order
    self.rank_of_id = rank_of_id
    self.vocabulary_size = vocabulary_size

  @property
  def num_classes(self):
    """How many ids are classes (the layer's head and clusters share these)."""
    return int(self.order.size)

  def ranks(self, ids):
    """(ranks, is_class) of int `ids` in [0, V): is_class is False where an id is not a
    class (its rank is then 0, a safe index)."""
    ids = tf.convert_to_tensor(ids)
    ranks = tf.gather(tf.constant(self.rank_of_id, ids.dtype), ids)
    is_class = ranks >= 0
    return tf.where(is_class, ranks, tf.zeros_like(ranks)), is_class

  def ids(self, ranks):
    """The vocabulary ids of the layer's classes `ranks`."""
    ranks = tf.convert_to_tensor(ranks)
    return tf.gather(tf.constant(self.order, ranks.dtype), ranks)

  def columns(self, by_rank):
    """[N, num_classes] values by rank -> [N, V] by id, -inf at ids that are not classes."""
    safe = np.maximum(self.rank_of_id, 0)
    out = tf.gather(by_rank, tf.constant(safe, tf.int32), axis=-1)
    not_class = tf.constant(self.rank_of_id < 0)
    return tf.where(not_class, tf.constant(-np.inf, by_rank.dtype), out)


class AdaptiveWeights:
  """What the serving functions read of an `AdaptiveSoftmax`: its tables (variables or
  tensors), cutoffs and tail trees.

  Attributes:
    num_classes: the number of classes. cutoffs: list of ints (head size first), in the
    layer's class order. head_kernel [H, D], head_bias [H] or None, projections [D, d_i],
    tail_kernels [rows_i, d_i], tail_biases [rows_i] or None each, tail_trees: None (flat
    tails) or a `StockTree` per cluster. class_order: None (ids are the classes) or a
    `ClassOrder` (ids in [0, vocabulary_size) in and out). vocabulary_size: the ids
    accepted (num_classes without a class order).
  """

  def __init__(self, num_classes, cutoffs, head_kernel, head_bias, projections,
               tail_kernels, tail_biases=None, tail_trees=None, class_order=None):
    self.num_classes = int(num_classes)
    self.class_order = class_order
    self.vocabulary_size = (self.num_classes if class_order is None
                            else class_order.vocabulary_size)
    self.cutoffs = [int(c) for c in cutoffs]
    bounds = self.cutoffs + [self.num_classes]
    self.cluster_ranges = [(bounds[i], bounds[i + 1]) for i in range(len(self.cutoffs))]
    self.head_kernel = head_kernel
    self.head_bias = head_bias
    self.projections = list(projections)
    self.tail_kernels = list(tail_kernels)
    self.tail_biases = list(tail_biases) if tail_biases is not None else [None] * len(
        self.cutoffs)
    self.tail_trees = (None if tail_trees is None
                       else [stock_tree(t) for t in tail_trees])

  @classmethod
  def from_layer(cls, layer):
    """The weights of a built `tf_hsm.AdaptiveSoftmax` (read by attribute, so that no
    tf_hsm module is imported here)."""
    if not getattr(layer, "built", False):
      raise ValueError("the AdaptiveSoftmax layer is not built")
    order = getattr(layer, "class_order", None)
    return cls(layer.num_classes if order is None else order.num_classes, layer.cutoffs,
               layer.head_kernel, layer.head_bias_weight, layer.tail_projections,
               layer.tail_kernels, layer.tail_biases,
               layer.tail_trees if layer.tail == "two_level" else None, order)


def _flat(weights, hidden):
  hidden = tf.convert_to_tensor(hidden)
  dtype = weights.head_kernel.dtype
  out_dtype = hidden.dtype
  if hidden.dtype != dtype:
    if hidden.dtype in (tf.float16, tf.bfloat16, tf.float32, tf.float64):
      hidden = tf.cast(hidden, dtype)
    else:
      raise TypeError(f"hidden must be floating point, got {hidden.dtype.name}")
  dim = weights.head_kernel.shape[-1]
  if hidden.shape.rank is not None and hidden.shape[-1] is not None and \
      hidden.shape[-1] != dim:
    raise ValueError(f"hidden has width {hidden.shape[-1]}; the layer has D = {dim}")
  return tf.reshape(hidden, [-1, dim]), tf.shape(hidden)[:-1], out_dtype


def _head(weights, flat):
  logits = tf.matmul(flat, weights.head_kernel, transpose_b=True)
  if weights.head_bias is not None:
    logits = logits + weights.head_bias
  return tf.nn.log_softmax(logits)


def _cluster_all(weights, i, projected):
  """[N, cluster size] log P(class | cluster i)."""
  if weights.tail_trees is None:
    return tf.nn.log_softmax(tf.matmul(projected, weights.tail_kernels[i], transpose_b=True))
  return hsm.log_prob_all(projected, weights.tail_kernels[i], weights.tail_biases[i],
                          weights.tail_trees[i])


def adaptive_log_prob(weights, hidden, targets):
  """log P(targets | hidden) under the adaptive softmax, as `AdaptiveSoftmax(hidden,
  targets)` returns it (targets < 0 give 0; targets >= num_classes give NaN).

  Args:
    weights: an `AdaptiveWeights`.
    hidden: [..., D] float. targets: int class ids with hidden's leading shape.
  """
  flat, leading, out_dtype = _flat(weights, hidden)
  targets = tf.convert_to_tensor(targets)
  if not targets.dtype.is_integer:
    raise TypeError(f"targets must be integer class ids, got {targets.dtype.name}")
  targets = tf.reshape(tf.cast(targets, tf.int32), [-1])
  too_big = targets >= weights.vocabulary_size
  valid = tf.logical_and(targets >= 0, tf.logical_not(too_big))
  safe = tf.where(valid, targets, tf.zeros_like(targets))
  if weights.class_order is not None:  # ids that are not classes count as padding
    safe, is_class = weights.class_order.ranks(safe)
    valid = tf.logical_and(valid, is_class)
  # 0: head, i + 1: cluster i (a sum of comparisons: TFLite has no searchsorted).
  tier = tf.reduce_sum(tf.cast(safe[:, None] >= tf.constant(weights.cutoffs, tf.int32),
                               tf.int32), -1)
  head = _head(weights, flat)
  head_index = tf.where(tier == 0, safe, weights.cutoffs[0] + tier - 1)
  out = tf.gather(head, head_index, batch_dims=1)
  for i, (lo, hi) in enumerate(weights.cluster_ranges):
    projected = tf.matmul(flat, weights.projections[i])
    here = tier == i + 1
    local = tf.where(here, safe - lo, tf.zeros_like(safe))
    if weights.tail_trees is None:
      tail = tf.gather(_cluster_all(weights, i, projected), local, batch_dims=1)
    else:
      tail = hsm.log_prob(projected, weights.tail_kernels[i], weights.tail_biases[i],
                          weights.tail_trees[i], local)
    out = out + tf.where(here, tail, tf.zeros_like(tail))
  out = tf.where(valid, out, tf.zeros_like(out))
  out = tf.where(too_big, tf.fill(tf.shape(out), tf.constant(float("nan"), out.dtype)), out)
  out = tf.reshape(out, leading)
  return tf.cast(out, out_dtype) if out_dtype in (tf.float16, tf.bfloat16) else out


def adaptive_log_prob_all(weights, hidden):
  """log P(c | hidden) for every class: [..., num_classes]."""
  flat, leading, _ = _flat(weights, hidden)
  head = _head(weights, flat)
  parts = [head[:, :weights.cutoffs[0]]]
  for i in range(len(weights.cluster_ranges)):
    projected = tf.matmul(flat, weights.projections[i])
    token = weights.cutoffs[0] + i
    parts.append(_cluster_all(weights, i, projected) + head[:, token:token + 1])
  out = tf.concat(parts, -1)
  if weights.class_order is not None:
    out = weights.class_order.columns(out)
  return tf.reshape(out, tf.concat([leading, [weights.vocabulary_size]], 0))


def adaptive_top_k(weights, hidden, k, exclude=None):
  """The k most probable classes, exactly, as `AdaptiveSoftmax.top_k`: each tier's own
  top k (a tree tier by `tf_hsm.serving.top_k`), merged. k > num_classes is clamped.
  `exclude`: None, or class ids [..., n] a row leaves out, as `tf_hsm.serving.top_k`'s
  (vocabulary ids with a class order).

  Returns:
    (log_probs, int64 classes), each [..., min(k, num_classes)], best first, equal
    values in increasing class order (the layer's order: frequency rank with a class
    order). A row with a NaN log-probability (a NaN or infinite hidden state) gets
    classes -1 and log-probabilities NaN.
  """
  if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 1:
    raise ValueError(f"k must be an int >= 1, got {k!r}")
  k = min(int(k), weights.num_classes)
  rank = tf.convert_to_tensor(hidden).shape.rank
  flat, leading, _ = _flat(weights, hidden)
  ids = None if exclude is None else hsm.exclusions(exclude, rank, leading,
                                                    weights.vocabulary_size)
  wide = k if ids is None else min(k + ids.shape[-1], weights.num_classes)
  best, chosen = _top_rows(weights, flat, wide)
  if ids is not None:
    best, chosen = hsm.drop_excluded(best, chosen, ids, k)
  shape = tf.concat([leading, [k]], 0)
  return tf.reshape(best, shape), tf.reshape(chosen, shape)


def _top_rows(weights, flat, k):
  """(log_probs, int64 class ids) [N, k] of the rows flat [N, D]."""
  head = _head(weights, flat)
  values, classes = tf.math.top_k(head[:, :weights.cutoffs[0]], min(k, weights.cutoffs[0]))
  values, classes = [values], [tf.cast(classes, tf.int64)]
  for i, (lo, hi) in enumerate(weights.cluster_ranges):
    projected = tf.matmul(flat, weights.projections[i])
    kk = min(k, hi - lo)
    if weights.tail_trees is None:
      tier_values, tier_classes = tf.math.top_k(_cluster_all(weights, i, projected), kk)
    else:
      tier_values, tier_classes = hsm.top_k(projected, weights.tail_kernels[i],
                                            weights.tail_biases[i], weights.tail_trees[i],
                                            kk)
    token = weights.cutoffs[0] + i
    values.append(tier_values + head[:, token:token + 1])
    classes.append(tf.cast(tier_classes, tf.int64) + lo)
  values = tf.concat(values, -1)
  best, where = tf.math.top_k(values, k)
  chosen = tf.gather(tf.concat(classes, -1), where, batch_dims=1)
  # A NaN anywhere in a row (a tier's top-k gives its NaN rows -1, which + lo would
  # read as a class) leaves the row without a ranking: NaN and -1, as hsm.top_k.
  nan_row = tf.reduce_any(tf.math.is_nan(values), -1)
  chosen = tf.where(nan_row[:, None], tf.zeros_like(chosen), chosen)
  if weights.class_order is not None:
    chosen = weights.class_order.ids(chosen)
  best = tf.where(nan_row[:, None], tf.constant(float("nan"), best.dtype), best)
  return hsm.no_class_where_nan(best, chosen, weights.vocabulary_size)


def adaptive_sample(weights, hidden, seed, temperature=1.0):
  """One class per row: the head's tempered softmax picks a head class or a cluster, the
  cluster's its class (Gumbel-max draws keyed by `seed`). int64, hidden's leading shape.

  `temperature` as `tf_hsm.serving.sample` (positive and finite; where asserts are
  dropped, a bad one gives -1 everywhere). A row whose head logits, or whose chosen
  cluster's logits, hold a NaN or +inf, or are all -inf, gets -1."""
  flat, leading, _ = _flat(weights, hidden)
  dtype = flat.dtype
  seed, temperature, usable = hsm.sample_arguments(seed, temperature, dtype)

  def draw(logits, stream):
    """(choice, bad): the Gumbel-max draw of each row and whether it has none."""
    bad = tf.logical_or(hsm.bad_logits(logits, tf.ones_like(logits, tf.bool)),
                        tf.reduce_all(tf.equal(logits, -float("inf")), -1))
    # Shifted by the row's max before tempering: logits / temperature alone overflow
    # for small temperatures, where the draw should approach the most probable.
    m = tf.reduce_max(logits, -1, keepdims=True)
    logits = (logits - tf.where(tf.math.is_finite(m), m, tf.zeros_like(m))) / temperature
    u = tf.random.stateless_uniform(tf.shape(logits), tf.stack([seed, stream]),
                                    minval=tf.constant(1e-12, dtype),
                                    maxval=tf.constant(1.0, dtype), dtype=dtype)
    noisy = logits - tf.math.log(-tf.math.log(u))
    return tf.argmax(noisy, -1, output_type=tf.int32), bad

  head_logits = tf.matmul(flat, weights.head_kernel, transpose_b=True)
  if weights.head_bias is not None:
    head_logits = head_logits + weights.head_bias
  choice, bad = draw(head_logits, tf.constant(0, tf.int64))
  bad = tf.logical_or(bad, tf.logical_not(usable))
  for i, (lo, _) in enumerate(weights.cluster_ranges):
    projected = tf.matmul(flat, weights.projections[i])
    if weights.tail_trees is None:
      local, broken = draw(tf.matmul(projected, weights.tail_kernels[i], transpose_b=True),
                           tf.constant(i + 1, tf.int64))
    else:
      local = tf.cast(hsm.sample(projected, weights.tail_kernels[i], weights.tail_biases[i],
                                 weights.tail_trees[i], seed * 7919 + i + 1, temperature),
                      tf.int32)
      broken = local < 0
    here = tf.equal(choice, weights.cutoffs[0] + i)
    bad = tf.logical_or(bad, tf.logical_and(here, broken))
    choice = tf.where(here, local + lo, choice)
  choice = tf.where(bad, tf.zeros_like(choice), choice)  # a safe index for the order
  if weights.class_order is not None:
    choice = weights.class_order.ids(choice)
  choice = tf.where(bad, -tf.ones_like(choice), choice)
  return tf.reshape(tf.cast(choice, tf.int64), leading)
