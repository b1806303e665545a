"""A `HierarchicalSoftmaxMixture` in stock TensorFlow ops: what `export` serves for one.

The mixture's probability (tf_hsm.keras.mixture) from its parts, each a hierarchical
softmax that `tf_hsm.serving.hsm` computes without tf_hsm:

    P(c | h) = sum_k pi_k(h) P_k(c | h),     pi(h) = softmax(G h + g)

and with a shared head (`head=...`), the head's exact softmax over its classes and a tail
slot, the trees over the other classes, scoring `h` or its `tail_dim` projection:

    P(c | h) = P_head(c | h)                                 c in the head
    P(c | h) = P_head(tail | h) sum_k pi_k(h) P_k(c | h)      c in the tail

and with `head_rank`, a head of each tree's own, the shared head's logits plus a rank-r
correction U_k (V_k h), mixed by the gate with the trees:

    P(c | h) = sum_k pi_k(h) P_head,k(c | h)                        c in the head
    P(c | h) = sum_k pi_k(h) P_head,k(tail | h) P_k(c | h)           c in the tail

`top_k` ranks `log_prob_all`, as the layer's does (every class of every tree is scored);
`sample` draws a tree from the gate, then a class from it (and the head's slot first),
each part from its own stream of the one seed.
"""

import numpy as np
import tensorflow as tf

from tf_hsm.serving import hsm
from tf_hsm.serving._tree import StockTree

__all__ = ["MixtureWeights", "log_prob", "log_prob_all", "top_k", "sample"]


class MixtureWeights:
  """A mixture's weights and trees as the stock-op functions read them.

  Attributes:
    gate_kernel, gate_bias: `[D, K]` and `[K]`.
    kernels, biases, trees: each component's table `[slots, d]`, biases (or None) and
      `StockTree`.
    tail_projection: `[D, d]` (the layer's `tail_dim`), or None.
    head: None, or (kernel, bias or None, StockTree) of the shared head's softmax over
      len(head) + 1 slots, the last the tail's.
    head_correction: None, or (V `[D, K r]`, U `[K, r, len(head) + 1]`) of `head_rank`.
    num_head: the head's classes (0 without one); num_classes: all of them.
    position: int32 `[num_classes]`, a class's place in [head..., tail...] (None without
      a head); order: the class at each place.
  """

  def __init__(self, gate_kernel, gate_bias, kernels, biases, trees, tail_projection=None,
               head=None, head_ids=None, head_correction=None):
    self.gate_kernel, self.gate_bias = gate_kernel, gate_bias
    self.head_correction = head_correction
    self.kernels, self.biases = list(kernels), list(biases)
    self.trees = [t if isinstance(t, StockTree) else StockTree(t) for t in trees]
    self.tail_projection, self.head = tail_projection, head
    tail_classes = self.trees[0].num_classes
    self.num_head = 0 if head_ids is None else len(head_ids)
    self.num_classes = tail_classes + self.num_head
    self.position = self.order = None
    if head_ids is not None:
      head_ids = np.asarray(head_ids, np.int64)
      order = np.concatenate([head_ids, np.setdiff1d(np.arange(self.num_classes), head_ids)])
      position = np.empty(self.num_classes, np.int32)
      position[order] = np.arange(self.num_classes)
      self.position, self.order = tf.constant(position), tf.constant(order)

  @classmethod
  def from_layer(cls, layer, variable):
    """The weights of a built `HierarchicalSoftmaxMixture`, each through
    `variable(value, name)` (export's copy into a tf.Variable)."""
    def table(part, name):
      if getattr(part, "row_layout", None) is not None:
        raise ValueError("export does not serve a HierarchicalSoftmaxMixture whose trees "
                         "have a row_layout")
      return (variable(part.kernel, f"{name}_kernel"),
              None if part.bias is None else variable(part.bias, f"{name}_bias"))
    tables = [table(c, f"tree_{i}") for i, c in enumerate(layer.components)]
    head = None
    if layer.head is not None:
      head = table(layer.head, "head") + (StockTree(layer.head.tree),)
    projection = getattr(layer, "tail_projection", None)
    correction = None
    if getattr(layer, "head_rank", None) is not None:
      correction = (variable(layer.head_correction_in, "head_correction_in"),
                    variable(layer.head_correction_out, "head_correction_out"))
    return cls(variable(layer.gate_kernel, "gate_kernel"),
               variable(layer.gate_bias, "gate_bias"), [t[0] for t in tables],
               [t[1] for t in tables], [c.tree for c in layer.components],
               None if projection is None else variable(projection, "tail_projection"),
               head, layer.head_ids, correction)

  def variables(self):
    """Every weight, for the module that saves them."""
    found = [self.gate_kernel, self.gate_bias, self.tail_projection] + self.kernels + \
        self.biases + ([] if self.head is None else list(self.head[:2])) + \
        list(self.head_correction or ())
    return [v for v in found if v is not None]

  def inputs(self, hidden):
    """(hidden in the tables' dtype, what the trees score)."""
    dtype = self.gate_kernel.dtype
    hidden = tf.convert_to_tensor(hidden)
    if hidden.dtype != dtype:
      hidden = tf.cast(hidden, dtype)
    scored = hidden if self.tail_projection is None else tf.tensordot(
        hidden, tf.convert_to_tensor(self.tail_projection), 1)
    return hidden, scored

  def log_gate(self, hidden):
    """log pi(hidden), `[..., K]`."""
    return tf.nn.log_softmax(self.gate_logits(hidden), -1)

  def gate_logits(self, hidden):
    return tf.tensordot(hidden, tf.convert_to_tensor(self.gate_kernel), 1) + self.gate_bias

  def components(self):
    return zip(self.kernels, self.biases, self.trees)

  def head_logits(self, hidden):
    """Each tree k's head logits W h + b + U_k (V_k h) (`head_correction`), `[..., K,
    len(head) + 1]`."""
    kernel, bias, _ = self.head
    logits = tf.tensordot(hidden, tf.transpose(tf.convert_to_tensor(kernel)), 1)
    if bias is not None:
      logits += bias
    v, u = (tf.convert_to_tensor(w) for w in self.head_correction)
    count, rank = u.shape[0], u.shape[1]
    low = tf.tensordot(hidden, v, 1)
    low = tf.reshape(low, tf.concat([tf.shape(low)[:-1], [count, rank]], 0))
    # [..., K, r] x [K, r, S] as K products: an einsum's batch matmul over a broadcast
    # leading shape is no TFLite builtin.
    corrections = tf.stack([tf.tensordot(low[..., k, :], u[k], 1) for k in range(count)],
                           -2)
    return tf.expand_dims(logits, -2) + corrections

  def head_log_probs(self, hidden):
    """log P_head,k(s | hidden) of each tree k's head and slot s, `[..., K,
    len(head) + 1]`."""
    return tf.nn.log_softmax(self.head_logits(hidden), -1)


def log_prob(weights, hidden, targets):
  """log P(targets | hidden), `[...]`: targets < 0 are padding (0), targets >=
  num_classes NaN (`export` checks them where TensorFlow runs)."""
  hidden, scored = weights.inputs(hidden)
  log_gate = weights.log_gate(hidden)
  targets = tf.cast(tf.convert_to_tensor(targets), tf.int64)
  valid = tf.logical_and(targets >= 0, targets < weights.num_classes)
  tree_targets, head_lp = targets, None
  if weights.head is not None:
    place = tf.cast(tf.gather(weights.position, tf.where(valid, targets,
                                                         tf.zeros_like(targets))), tf.int64)
    in_tail = tf.logical_and(valid, place >= weights.num_head)
    head_slot = tf.where(valid, tf.minimum(place, weights.num_head), -tf.ones_like(place))
    tree_targets = tf.where(in_tail, place - weights.num_head, -tf.ones_like(place))
    if weights.head_correction is not None:
      return _corrected_log_prob(weights, hidden, scored, log_gate, targets, head_slot,
                                 tree_targets)
    head_lp = hsm.log_prob(hidden, *weights.head, head_slot)
  else:
    in_tail = valid
    tree_targets = tf.where(valid, targets, -tf.ones_like(targets))
  parts = tf.stack([hsm.log_prob(scored, w, b, t, tree_targets)
                    for w, b, t in weights.components()], -1)
  mixed = _logsumexp(parts + log_gate)
  out = tf.where(in_tail, mixed, tf.zeros_like(mixed))
  if head_lp is not None:
    out = tf.where(valid, head_lp + out, tf.zeros_like(out))
  return tf.where(targets >= weights.num_classes, tf.constant(float("nan"), out.dtype), out)


def _corrected_log_prob(weights, hidden, scored, log_gate, targets, head_slot,
                       tree_targets):
  """`log_prob` with each tree's own corrected head: log sum_k pi_k P_head,k(slot)
  P_k(c), P_k(c) 1 for a head class (a tree's log_prob of target -1 is 0)."""
  heads = weights.head_log_probs(hidden)  # [..., K, S]
  slot = tf.where(head_slot >= 0, head_slot, tf.zeros_like(head_slot))
  at_slot = _picked(heads, tf.expand_dims(slot, -1), weights.num_head + 1)
  parts = tf.stack([hsm.log_prob(scored, w, b, t, tree_targets)
                    for w, b, t in weights.components()], -1)
  out = _logsumexp(parts + log_gate + at_slot)
  out = tf.where(head_slot >= 0, out, tf.zeros_like(out))
  return tf.where(targets >= weights.num_classes, tf.constant(float("nan"), out.dtype), out)


def log_prob_all(weights, hidden):
  """log P(c | hidden) for every class c: `[..., num_classes]`."""
  hidden, scored = weights.inputs(hidden)
  log_gate = weights.log_gate(hidden)
  if weights.head_correction is not None:
    heads = weights.head_log_probs(hidden)  # [..., K, S]
    joined = tf.stack([_joined(weights, heads[..., k, :], hsm.log_prob_all(scored, w, b, t))
                       for k, (w, b, t) in enumerate(weights.components())], -1)
    return _logsumexp(joined + tf.expand_dims(log_gate, -2))
  parts = tf.stack([hsm.log_prob_all(scored, w, b, t) for w, b, t in weights.components()],
                   -1)
  # expand_dims, not [..., None, :]: a strided slice with a new axis is no TFLite builtin.
  mixed = _logsumexp(parts + tf.expand_dims(log_gate, -2))
  if weights.head is None:
    return mixed
  return _joined(weights, hsm.log_prob_all(hidden, *weights.head), mixed)


def _joined(weights, head, tail):
  """[..., V] in class order from the head's [..., S] and the tail's [..., V - S + 1]."""
  joined = tf.concat([head[..., :weights.num_head], head[..., weights.num_head:] + tail],
                     -1)
  return tf.gather(joined, weights.position, axis=-1)


def _logsumexp(x):
  """log sum exp over the last axis, NaN where a term is: TFLite's max skips NaN, so
  its logsumexp of a NaN row is a finite value."""
  nan = tf.reduce_any(tf.math.is_nan(x), -1)
  out = tf.reduce_logsumexp(x, -1)
  return tf.where(nan, tf.constant(float("nan"), x.dtype), out)


def top_k(weights, hidden, k, exclude=None):
  """The k (a Python int >= 1, clamped to num_classes) most probable classes of each row
  from `log_prob_all`: (log_probs, int64 classes) `[..., k]`, best first, ties in
  increasing class order; `exclude` as `tf_hsm.serving.hsm.top_k`'s. A row with a NaN
  log-probability gets classes -1 and NaN; where fewer than k classes are left, the last
  are class -1 at -inf."""
  k = min(k, weights.num_classes)
  hidden = tf.convert_to_tensor(hidden)
  rank, leading = hidden.shape.rank, tf.shape(hidden)[:-1]
  rows, n = hsm.at_least_one_row(tf.reshape(hidden, tf.stack([-1, tf.shape(hidden)[-1]])))
  every = log_prob_all(weights, rows)
  ids = None if exclude is None else hsm.exclusions(exclude, rank, leading,
                                                    weights.num_classes)
  wide = k if ids is None else min(k + ids.shape[-1], weights.num_classes)
  best, classes = tf.math.top_k(every, wide)
  best, classes = hsm.no_class_where_nan(best[:n], tf.cast(classes[:n], tf.int64),
                                         weights.num_classes)
  if ids is not None:
    best, classes = hsm.drop_excluded(best, classes, ids, k)
  classes = tf.where(tf.equal(best, -np.inf), -tf.ones_like(classes), classes)
  shape = tf.concat([leading, [k]], 0)
  return tf.reshape(best, shape), tf.reshape(classes, shape)


def _part_seed(seed, part):
  """The seed of a part's draws (tree k: part k, the head: -2), from (seed, part) through
  Philox, as the layer derives its components' seeds: seeds s and s' share no part's
  stream, however far apart (an arithmetic mix of the two would wrap around)."""
  return tf.random.stateless_uniform([], tf.stack([seed, tf.constant(part, tf.int64)]),
                                     minval=None, maxval=None, dtype=tf.int64)


def sample(weights, hidden, seed, temperature=1.0):
  """One class per row, int64 `[...]`: a tree from the gate (Gumbel-max over its logits
  divided by the temperature, from (seed, -1)), a class from that tree (`hsm.sample`,
  seeded by `_part_seed`), and with a head the head's slot first. -1 where a row has no
  distribution (a NaN or infinite gate logit, or a part's -1)."""
  hidden, scored = weights.inputs(hidden)
  seed, temperature, usable = hsm.sample_arguments(seed, temperature, hidden.dtype)
  count = len(weights.kernels)
  draws = tf.stack([hsm.sample(scored, w, b, t, _part_seed(seed, k), temperature)
                    for k, (w, b, t) in enumerate(weights.components())], -1)
  logits = weights.gate_logits(hidden)
  defined = tf.logical_and(tf.reduce_all(tf.math.is_finite(logits), -1), usable)
  logits = tf.where(defined[..., None], logits, tf.zeros_like(logits))
  noise = tf.random.stateless_uniform(
      tf.shape(logits), tf.stack([seed, tf.constant(-1, tf.int64)]),
      minval=tf.constant(1e-12, logits.dtype), maxval=tf.constant(1.0, logits.dtype),
      dtype=logits.dtype)
  shifted = (logits - tf.reduce_max(logits, -1, keepdims=True)) / temperature
  chosen = tf.argmax(shifted - tf.math.log(-tf.math.log(noise)), -1)
  drawn = tf.reduce_sum(draws * tf.one_hot(chosen, count, dtype=tf.int64), -1)
  drawn = tf.where(defined, drawn, -tf.ones_like(drawn))
  if weights.head is None:
    return drawn
  if weights.head_correction is None:
    slot = hsm.sample(hidden, *weights.head, _part_seed(seed, -2), temperature)
  else:
    slot = _corrected_head_sample(weights, hidden, chosen, _part_seed(seed, -2), temperature,
                                  usable)
  place = tf.where(slot < weights.num_head, slot, weights.num_head + drawn)
  known = tf.logical_and(slot >= 0, tf.logical_or(slot < weights.num_head, drawn >= 0))
  return tf.where(known, tf.gather(weights.order, tf.where(known, place,
                                                           tf.zeros_like(place))),
                  -tf.ones_like(place))


def _corrected_head_sample(weights, hidden, chosen, seed, temperature, usable):
  """A head slot from the head of each row's `chosen` tree: Gumbel-max over its logits
  less their largest, divided by the temperature (a small one cannot overflow); -1
  where a logit is NaN or +inf, all are -inf, or the temperature is not `usable` (a
  -inf logit alone only masks its slot, as `hsm.sample`'s)."""
  logits = _picked(tf.linalg.matrix_transpose(weights.head_logits(hidden)),
                   tf.expand_dims(chosen, -1), len(weights.kernels))
  top = tf.reduce_max(logits, -1, keepdims=True)
  valid = tf.ones_like(logits, tf.bool)
  defined = tf.logical_and(tf.logical_and(
      tf.logical_not(hsm.bad_logits(logits, valid)), tf.math.is_finite(top[..., 0])), usable)
  shifted = (logits - tf.where(tf.expand_dims(defined, -1), top, tf.zeros_like(top))) / \
      temperature
  noise = tf.random.stateless_uniform(
      tf.shape(shifted), tf.stack([seed, tf.constant(0, tf.int64)]),
      minval=tf.constant(1e-12, shifted.dtype), maxval=tf.constant(1.0, shifted.dtype),
      dtype=shifted.dtype)
  slot = tf.argmax(shifted - tf.math.log(-tf.math.log(noise)), -1)
  return tf.where(defined, slot, -tf.ones_like(slot))


def _picked(values, index, depth):
  """values[..., j, index] over the last axis (of size `depth`), with `index` [..., 1]:
  by a one-hot select, as LiteRT's builtins take it (a -inf elsewhere stays out)."""
  chosen = tf.expand_dims(tf.equal(tf.range(depth, dtype=index.dtype), index), -2)
  return tf.reduce_sum(tf.where(chosen, values, tf.zeros_like(values)), -1)
