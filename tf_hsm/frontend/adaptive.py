"""The adaptive softmax of Grave et al. (PyTorch's `nn.AdaptiveLogSoftmaxWithLoss`), with
tails that may be trees: everything of `AdaptiveSoftmax` but Keras itself, shared by the
Keras 3 layer (`tf_hsm.keras.AdaptiveSoftmax`) and the tf_keras one
(`tf_hsm.tf_keras.AdaptiveSoftmax`), which mix `AdaptiveSoftmaxCore` into their Keras
`Layer` and add only the weights' creation and the initializer's (de)serialisation.

The classes are split by `cutoffs` into a head (the `cutoffs[0]` most frequent classes)
and tail clusters `[cutoffs[i], cutoffs[i + 1])`. The head scores its classes and one
token per cluster on the full hidden state; cluster i scores its classes on the hidden
state projected to `int(D // div_value ** (i + 1))` dimensions, so rare classes cost
less compute and their rows less memory:

    log P(c) = head_log_softmax[c]                                  c in the head
    log P(c) = head_log_softmax[S + i] + tail_i(hidden @ P_i)[c]    c in cluster i

where S = cutoffs[0] and tail_i is a softmax over the cluster's classes (`tail="flat"`,
as PyTorch) or a hierarchical softmax over a `Tree.two_level` of them (`tail="two_level"`:
a cluster of n classes then costs about 2 sqrt(n) rows per token instead of n, and its
rows' gradient is a `tf.IndexedSlices` over the touched rows).

A `class_order` lets a model keep one vocabulary whose ids are not sorted by frequency
(say id 0 for padding, as `Embedding(mask_zero=True)` wants): the layer's class r is id
`class_order[r]`; targets are mapped to ranks on the way in, classes back to ids on the
way out (`tf_hsm.serving.adaptive.ClassOrder`, the same code the serving export runs).

Each tier is one batched computation over the tokens whose targets fall in it (found with
`tf.where`, no per-token Python): dense tiers use TensorFlow's matmul and fused softmax
cross-entropy, tree tiers `tf_hsm.log_prob` and `tf_hsm.inference`.

Tables in pieces (a `ShardedVariable` from a `ParameterServerStrategy` with a
`variable_partitioner`): a tree tier hands its kernel and bias, in pieces, to
`tf_hsm.log_prob`, which gathers only the rows the batch's paths touch from each piece
and gives each piece a `tf.IndexedSlices` of them (`tf_hsm/ops/compact.py`); the head,
flat tiers and projections are matmuls over all their rows, so TensorFlow reads their
pieces whole (concatenated) and each gets a dense gradient. `top_k`, `log_prob_all`
and `sample` read tree tiers' pieces whole too (a search may visit any row).
"""

import math
import numbers

import numpy as np
import tensorflow as tf

from tf_hsm.frontend import hsm
from tf_hsm.frontend import wiring
from tf_hsm.ops import inference
from tf_hsm.ops import log_prob
from tf_hsm.planning import cutoffs as cutoff_search
from tf_hsm.planning.costs import TAILS, tail_widths
from tf_hsm.serving.adaptive import ClassOrder
from tf_hsm.tree import Tree
from tf_hsm.tree import io as tree_io
from tf_hsm.tree.checks import counts_array

# Tokens a step assumed by cutoffs=None when tokens_per_step is not given.
DEFAULT_TOKENS_PER_STEP = 1024

_ORDER_HINT = ("; or keep the ids and give the layer class_order=AdaptiveSoftmax."
               "frequency_order(counts, padding=...) (counts then stay indexed by id; "
               "padding: the ids that are not classes, () if every id is one)")


def checked_cutoffs(cutoffs, num_classes, what="num_classes"):
  """`cutoffs` as a list of increasing ints in (0, num_classes); errors name the rule."""
  if isinstance(cutoffs, (str, bytes)) or not hasattr(cutoffs, "__iter__"):
    raise TypeError(f"cutoffs must be a list of ints, got {type(cutoffs).__name__}")
  values = list(cutoffs)
  if not values:
    raise ValueError("cutoffs must hold at least one class count (the head's size)")
  for value in values:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
      raise TypeError(f"cutoffs must be ints, got {value!r}")
  values = [int(v) for v in values]
  if values != sorted(set(values)) or values[0] <= 0 or values[-1] >= num_classes:
    raise ValueError("cutoffs should be a sequence of unique, positive integers sorted in "
                     f"increasing order, each smaller than {what}={num_classes}; got "
                     f"{values}")
  return values


def frequency_order(counts, padding=(0,)):
  """The ids of a vocabulary from the most to the least frequent (ties by id), leaving
  out the ids in `padding`: what `AdaptiveSoftmax(class_order=...)` takes.

  Args:
    counts: one frequency per vocabulary id, `[V]`.
    padding: the ids that are not classes, an id or a list of them. The default,
      (0,), is for the vocabularies of `Embedding(mask_zero=True)`, whose id 0 is
      padding: where id 0 is a real class, pass () (or None), which keeps every id.

  Raises:
    ValueError: counts that are not a non-empty 1-D array of finite, non-negative
      numbers; padding ids outside the vocabulary.
  """
  # 1-D, finite and non-negative, as the layer's `counts`: a NaN would rank last unnamed.
  counts = counts_array(counts).astype(np.float64)
  order = np.argsort(-counts, kind="stable")
  padding = _padding_ids(padding)
  outside = padding[(padding < 0) | (padding >= counts.size)]
  if outside.size:
    raise ValueError(f"padding ids must be ids of the vocabulary, in [0, {counts.size}); "
                     f"got {outside.tolist()}")
  return order[~np.isin(order, padding)]


def _padding_ids(padding):
  """`frequency_order`'s padding as an int64 array: None, an id, or a list of ids."""
  if padding is None:
    return np.zeros(0, np.int64)
  if isinstance(padding, numbers.Integral) and not isinstance(padding, bool):
    return np.asarray([padding], np.int64)
  try:
    ids = np.asarray(list(padding))
  except TypeError:
    ids = None
  if ids is None or (ids.size and (ids.ndim != 1 or ids.dtype.kind not in "iu")):
    raise TypeError(f"padding must be an id or a list of ids (the ids that are not "
                    f"classes), got {padding!r}")
  return ids.astype(np.int64)


def _ranked_counts(counts, class_order, num_ranked):
  """The counts in the layer's class order, checked (non-increasing)."""
  if class_order is not None:
    counts = np.asarray(counts, np.float64)
    if counts.shape != (class_order.vocabulary_size,):
      raise ValueError(f"with a class_order, counts must have one entry per id: shape "
                       f"[{class_order.vocabulary_size}], got {counts.shape}")
    counts = counts[class_order.order]
  try:
    return cutoff_search.checked_counts(counts, num_ranked)
  except ValueError as error:
    if class_order is None and "non-increasing" in str(error):
      raise ValueError(str(error) + _ORDER_HINT) from None
    if class_order is not None and "non-increasing" in str(error):
      raise ValueError("counts[class_order] must be non-increasing: class_order must "
                       "list the ids from the most to the least frequent (as "
                       f"frequency_order(counts) does); {error}") from None
    raise


def _decoded_order(config):
  """The ids of a class order's config (`_adaptive_config`'s dict)."""
  if config.get("encoding") != tree_io.CONFIG_ENCODING or "ids" not in config:
    raise ValueError(f"class_order must be a list of ids or the dict get_config writes "
                     f"(encoding {tree_io.CONFIG_ENCODING!r} and ids), got keys "
                     f"{sorted(config)}")
  return tree_io.decode_ints(config["ids"], "ids", owner="class_order")


def _positive_number(name, value):
  if (isinstance(value, bool) or not isinstance(value, numbers.Real) or
      not math.isfinite(value) or value <= 0):
    raise ValueError(f"{name} must be a positive finite number, got {value!r}")
  return float(value)


class AdaptiveSoftmaxCore:
  """The adaptive softmax without Keras: mixed in before a Keras `Layer` by each front end.

  The front end provides `_KERAS` ('keras' or 'tf_keras', for the mixed-Keras error) and
  `_add_table(name, shape, initializer)`, and calls `_init_adaptive` from `__init__`.
  Argument and weight documentation: `tf_hsm.keras.AdaptiveSoftmax`.
  """

  _KERAS = None
  frequency_order = staticmethod(frequency_order)

  @staticmethod
  def choose_cutoffs(counts, dim, tokens_per_step, div_value=4.0, tail="flat",
                     machine=None, **kwargs):
    """The cutoffs a layer with cutoffs=None would choose:
    `tf_hsm.planning.cutoffs.choose_cutoffs` (the cost model, its arguments and bounds
    are described there and in docs/adaptive.md).

    Args:
      counts: class frequencies `[num_classes]`, non-increasing.
      dim: D, the hidden size.
      tokens_per_step: T, tokens (targets) a training step.
      div_value: the layer's div_value.
      tail: the layer's tail, "flat" or "two_level".
      machine: a `tf_hsm.planning.Machine` (or a dict of its fields); default: this
        machine's cached rates.
      **kwargs: `max_clusters`, `min_head_mass`, `min_width`, `points_per_decade`.

    Returns:
      The cutoffs, a list of increasing ints.
    """
    return cutoff_search.choose_cutoffs(counts, dim, tokens_per_step,
                                        div_value=div_value, tail=tail, machine=machine,
                                        **kwargs)

  def _init_adaptive(self, num_classes, cutoffs, div_value, head_bias, tail, counts,
                     tail_trees, tokens_per_step, machine, class_order):
    if isinstance(num_classes, bool) or not isinstance(num_classes, numbers.Integral):
      raise TypeError(f"num_classes must be an int, got {num_classes!r}")
    if num_classes < 2:
      raise ValueError(f"num_classes must be >= 2, got {num_classes}")
    self.num_classes = int(num_classes)
    if isinstance(class_order, dict):  # as get_config writes it
      class_order = _decoded_order(class_order)
    self.class_order = (None if class_order is None
                        else ClassOrder(class_order, self.num_classes))
    if cutoffs is None and counts is None:
      raise ValueError("AdaptiveSoftmax needs cutoffs, or counts to choose them from: "
                       "give cutoffs=[...] (the head's size, then each cluster's first "
                       "class), or counts=[one frequency per class] with cutoffs=None")
    self.div_value = _positive_number("div_value", div_value)
    self.head_bias = bool(head_bias)
    if tail not in TAILS:
      raise ValueError(f"tail must be one of {TAILS}, got {tail!r}")
    self.tail = tail
    if tail_trees is not None and tail != "two_level":
      raise ValueError('tail_trees is only for tail="two_level"')
    self.cutoffs = self.cluster_ranges = self.tail_trees = None
    self._pending = None
    if cutoffs is None:
      if tail_trees is not None:
        raise ValueError("tail_trees needs the cutoffs they were built for: give cutoffs")
      if tokens_per_step is None:
        tokens_per_step = DEFAULT_TOKENS_PER_STEP
      if (isinstance(tokens_per_step, bool) or
          not isinstance(tokens_per_step, numbers.Integral) or tokens_per_step < 1):
        raise ValueError(f"tokens_per_step must be a positive int, got {tokens_per_step!r}")
      # Chosen in build, where D is known.
      self._pending = dict(counts=self._counts_by_rank(counts),
                           tokens_per_step=int(tokens_per_step), machine=machine)
    else:
      what = "num_classes" if self.class_order is None else "len(class_order)"
      # Counts are checked whatever the tail (flat tails do not use them, but counts
      # out of order mean class ids the layer will misread).
      self._set_cutoffs(checked_cutoffs(cutoffs, self.num_ranked, what),
                        None if counts is None else self._counts_by_rank(counts),
                        tail_trees)
    self.supports_masking = True
    self.supports_jit = False  # the tree tails' ops have no XLA kernel

  @property
  def num_ranked(self):
    """The number of classes the head and clusters share (num_classes without a class
    order, the ids it lists with one)."""
    return self.num_classes if self.class_order is None else self.class_order.num_classes

  def _counts_by_rank(self, counts):
    return _ranked_counts(counts, self.class_order, self.num_ranked)

  def _set_cutoffs(self, cutoffs, counts, tail_trees):
    """Sets the cutoffs, cluster ranges and (two-level tails) the trees, which group
    each cluster's classes by `counts` (in the layer's class order)."""
    self.cutoffs = cutoffs
    bounds = self.cutoffs + [self.num_ranked]
    self.cluster_ranges = [(bounds[i], bounds[i + 1]) for i in range(len(self.cutoffs))]
    if self.tail != "two_level":
      return
    if tail_trees is not None:
      trees = [t if isinstance(t, Tree) else Tree.from_config(t) for t in tail_trees]
      if [t.num_classes for t in trees] != [hi - lo for lo, hi in self.cluster_ranges]:
        raise ValueError("tail_trees do not match the clusters' sizes")
    else:
      trees = [Tree.two_level(hi - lo, counts=None if counts is None else counts[lo:hi])
               for lo, hi in self.cluster_ranges]
    self.tail_trees = trees

  @property
  def head_size(self):
    if self.cutoffs is None:
      raise ValueError("AdaptiveSoftmax chooses its cutoffs when built: build it first")
    return self.cutoffs[0] + len(self.cluster_ranges)

  def _build_adaptive(self, hidden_shape, initializer):
    dim = hidden_shape[-1]
    if dim is None:
      raise ValueError("AdaptiveSoftmax needs a known last dimension of `hidden`, got "
                       f"shape {hidden_shape}")
    dim = int(dim)
    if self.cutoffs is None:
      pending = self._pending
      cutoffs = cutoff_search.choose_cutoffs(
          pending["counts"], dim, pending["tokens_per_step"], div_value=self.div_value,
          tail=self.tail, machine=pending["machine"])
      self._set_cutoffs(cutoffs, pending["counts"], None)
      self._pending = None
    widths = tail_widths(dim, len(self.cluster_ranges), self.div_value)
    if min(widths) < 1:
      i = widths.index(min(widths))
      raise ValueError(f"cluster {i} would have width int({dim} // {self.div_value:g}**"
                       f"{i + 1}) = 0: use a smaller div_value or fewer cutoffs")
    self.tail_dims = widths
    self.head_kernel = self._add_table("head_kernel", (self.head_size, dim), initializer)
    self.head_bias_weight = (self._add_table("head_bias", (self.head_size,), "zeros")
                             if self.head_bias else None)
    self.tail_projections, self.tail_kernels, self.tail_biases = [], [], []
    for i, ((lo, hi), width) in enumerate(zip(self.cluster_ranges, widths)):
      rows = hi - lo if self.tail == "flat" else self.tail_trees[i].num_slots
      self.tail_projections.append(
          self._add_table(f"tail_projection_{i}", (dim, width), initializer))
      self.tail_kernels.append(self._add_table(f"tail_kernel_{i}", (rows, width),
                                               initializer))
      self.tail_biases.append(self._add_table(f"tail_bias_{i}", (rows,), "zeros")
                              if self.tail == "two_level" else None)
    self.built = True

  # ------------------------------------------------------------------ helpers

  def _flat_hidden(self, hidden):
    hidden = hsm.hidden_in(hidden, self.head_kernel.dtype)
    dim = self.head_kernel.shape[-1]
    if hidden.shape.rank is not None and (hidden.shape.rank == 0 or
                                          hidden.shape[-1] not in (None, dim)):
      raise ValueError(f"hidden size mismatch: hidden has shape {hidden.shape.as_list()} "
                       f"but the layer was built for D = {dim}")
    with tf.control_dependencies([tf.debugging.assert_equal(
        tf.shape(hidden)[-1], dim, message=f"hidden size mismatch: the layer was built "
                                           f"for D = {dim}")]):
      hidden = tf.identity(hidden)
    return tf.reshape(hidden, [-1, dim]), tf.shape(hidden)[:-1]

  def _head_logits(self, hidden):
    logits = tf.matmul(hidden, self.head_kernel, transpose_b=True)
    if self.head_bias_weight is not None:
      logits += self.head_bias_weight
    return logits

  def _tail_logits(self, i, projected):
    return tf.matmul(projected, self.tail_kernels[i], transpose_b=True)

  def _check_built(self, what):
    if not self.built:
      raise ValueError(f"AdaptiveSoftmax.{what} needs a built layer: call it on data (or "
                       "call build(hidden_shape)) first")

  def _ids(self, ranks):
    return ranks if self.class_order is None else self.class_order.ids(ranks)

  # ------------------------------------------------------------------ training

  def __call__(self, *args, **kwargs):
    hsm.refuse_other_keras(self._KERAS, "AdaptiveSoftmax", (args, kwargs))
    wiring.check_call(self, args, kwargs)
    # Only a tree tail's table gets a sparse gradient; the head and flat tails are
    # read whole by their softmax.
    wiring.check_model(self, sparse_table=self.tail != "flat")
    return super().__call__(*args, **kwargs)

  def _valid_targets(self, targets, masks):
    """(flat targets as the layer's classes, where they count): padding (< 0), masked
    positions and ids a class order leaves out do not count."""
    hsm.refuse_ragged(targets)
    targets = tf.convert_to_tensor(targets)
    if not targets.dtype.is_integer:
      raise TypeError(f"targets must be integer class ids, got {targets.dtype.name}")
    flat = tf.cast(tf.reshape(targets, [-1]), tf.int64)
    valid = tf.logical_and(flat >= 0, flat < self.num_classes)
    # Targets past the last class are an error, as in the other ops.
    tf.debugging.assert_less(flat, tf.constant(self.num_classes, tf.int64),
                             message="AdaptiveSoftmax: a target is >= num_classes")
    for extra in masks:
      if extra is not None:
        valid = tf.logical_and(valid, tf.reshape(tf.cast(extra, tf.bool), [-1]))
    safe = tf.where(valid, flat, tf.zeros_like(flat))
    if self.class_order is not None:
      safe, is_class = self.class_order.ranks(safe)
      valid = tf.logical_and(valid, is_class)
    return safe, valid

  def call(self, hidden, targets, mask=None, hidden_mask=None):
    flat, leading = self._flat_hidden(hidden)
    safe, valid = self._valid_targets(targets, (mask, hidden_mask))
    cutoffs = tf.constant(self.cutoffs, tf.int64)
    # 0: head, i + 1: cluster i
    tier = tf.searchsorted(cutoffs, safe, side="right", out_type=tf.int64)
    head_index = tf.where(tier == 0, safe, self.cutoffs[0] + tier - 1)
    out = -tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=head_index, logits=self._head_logits(flat))
    for i, (lo, _) in enumerate(self.cluster_ranges):
      rows = tf.where(tf.logical_and(valid, tier == i + 1))
      projected = tf.matmul(tf.gather_nd(flat, rows), self.tail_projections[i])
      local = tf.gather_nd(safe, rows) - lo
      if self.tail == "flat":
        tail = -tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=local, logits=self._tail_logits(i, projected))
      else:
        tail = log_prob(projected, self.tail_kernels[i], self.tail_biases[i],
                        self.tail_trees[i], local)
      out = tf.tensor_scatter_nd_add(out, rows, tail)
    out = tf.where(valid, out, tf.zeros_like(out))
    out = tf.reshape(out, leading)
    valid = tf.reshape(valid, leading)
    out._keras_mask = valid  # how Keras attaches a mask to a tensor (masking guide)
    hsm.attach_source(out, self, hidden, targets)
    return out

  def compute_mask(self, hidden, previous_mask=None):
    return None  # `call` attaches the real mask, which depends on the targets

  # ------------------------------------------------------------------ inference

  def _cluster_log_probs(self, i, projected):
    """[N, cluster size] log P(class | cluster i, hidden)."""
    if self.tail == "flat":
      return tf.nn.log_softmax(self._tail_logits(i, projected))
    return inference.log_prob_all(projected, self.tail_kernels[i], self.tail_biases[i],
                                  self.tail_trees[i])

  def log_prob_all(self, hidden):
    """log P(c | hidden) for every class c: `[..., num_classes]` (PyTorch's `log_prob`);
    -inf at the ids a class order leaves out."""
    self._check_built("log_prob_all")
    flat, leading = self._flat_hidden(hidden)
    head = tf.nn.log_softmax(self._head_logits(flat))
    parts = [head[:, :self.cutoffs[0]]]
    for i in range(len(self.cluster_ranges)):
      projected = tf.matmul(flat, self.tail_projections[i])
      token = self.cutoffs[0] + i
      parts.append(self._cluster_log_probs(i, projected) + head[:, token:token + 1])
    out = tf.concat(parts, axis=-1)
    if self.class_order is not None:
      out = self.class_order.columns(out)
    return tf.reshape(out, tf.concat([leading, [self.num_classes]], 0))

  def top_k(self, hidden, k, exclude=None):
    """The k most probable classes, exactly: `(log_probs, classes)`, each `[..., k]`,
    best first; equal values in increasing class order (by frequency rank with a class
    order, whose classes are returned as vocabulary ids).

    The best k of all classes are among the best k of each tier (a cluster's classes
    all share its head token's log-probability), so each tier contributes its own top k
    (a tree tier by `tf_hsm.inference.top_k`'s search) and one `tf.math.top_k` merges.

    `exclude`: class ids `[..., n]` a row leaves out, as in `tf_hsm.inference.top_k`
    (the top k + n, the excluded ones dropped).
    """
    self._check_built("top_k")
    if isinstance(k, bool) or not isinstance(k, numbers.Integral):
      raise TypeError(f"k must be an int, got {k!r}")
    if not 1 <= k <= self.num_ranked:
      raise ValueError(f"k must be in [1, the number of classes={self.num_ranked}], got "
                       f"{k}")
    if exclude is None:
      return self._top_k(hidden, k)
    exclude = inference.checked_exclude(exclude, hidden, self.num_classes)
    n = exclude.shape[-1]
    log_probs, classes = self._top_k(hidden, min(k + n, self.num_ranked))
    return inference.drop_excluded(log_probs, classes, exclude, k)

  def _top_k(self, hidden, k):
    flat, leading = self._flat_hidden(hidden)
    head = tf.nn.log_softmax(self._head_logits(flat))
    values, classes = tf.math.top_k(head[:, :self.cutoffs[0]], min(k, self.cutoffs[0]))
    values, classes = [values], [tf.cast(classes, tf.int64)]
    for i, (lo, hi) in enumerate(self.cluster_ranges):
      projected = tf.matmul(flat, self.tail_projections[i])
      kk = min(k, hi - lo)
      if self.tail == "flat":
        tier_values, tier_classes = tf.math.top_k(
            tf.nn.log_softmax(self._tail_logits(i, projected)), kk)
      else:
        tier_values, tier_classes = inference.top_k(
            projected, self.tail_kernels[i], self.tail_biases[i], self.tail_trees[i], kk)
      token = self.cutoffs[0] + i
      values.append(tier_values + head[:, token:token + 1])
      classes.append(tf.cast(tier_classes, tf.int64) + lo)
    best, where = tf.math.top_k(tf.concat(values, -1), k)
    chosen = self._ids(tf.gather(tf.concat(classes, -1), where, batch_dims=1))
    shape = tf.concat([leading, [k]], 0)
    return tf.reshape(best, shape), tf.reshape(chosen, shape)

  def sample(self, hidden, seed=None, temperature=1.0):
    """One class per hidden state: the head's tempered softmax picks a head class or a
    cluster, the cluster's tempered softmax (or tree) picks its class. int64, with
    hidden's leading shape. For a seed the result is reproducible."""
    self._check_built("sample")
    temperature = _positive_number("temperature", temperature)
    if seed is None:
      seed = tf.random.uniform([], 0, 2**31 - 1, tf.int64)
    seed = tf.cast(seed, tf.int64)
    flat, leading = self._flat_hidden(hidden)
    dtype = flat.dtype

    def draw(logits, stream):
      return tf.random.stateless_categorical(
          logits / tf.cast(temperature, dtype), 1, seed=tf.stack([seed, stream]),
          dtype=tf.int64)[:, 0]

    head_choice = draw(self._head_logits(flat), 0)
    choice = head_choice
    for i, (lo, _) in enumerate(self.cluster_ranges):
      rows = tf.where(head_choice == self.cutoffs[0] + i)
      projected = tf.matmul(tf.gather_nd(flat, rows), self.tail_projections[i])
      if self.tail == "flat":
        local = draw(self._tail_logits(i, projected), i + 1)
      else:
        local = inference.sample(projected, self.tail_kernels[i], self.tail_biases[i],
                                 self.tail_trees[i], seed=seed * 7919 + i + 1,
                                 temperature=temperature)
      choice = tf.tensor_scatter_nd_update(choice, rows, local + lo)
    return tf.reshape(self._ids(choice), leading)

  # ------------------------------------------------------------------ PyTorch, config

  @classmethod
  def from_torch_state_dict(cls, state_dict, cutoffs, div_value=4.0, head_bias=False,
                            **kwargs):
    """The layer holding the weights of a PyTorch `nn.AdaptiveLogSoftmaxWithLoss`.

    Args:
      state_dict: a mapping from PyTorch's parameter names (`head.weight`, `head.bias`,
        `tail.{i}.0.weight`, `tail.{i}.1.weight`) to arrays (NumPy arrays, or anything
        `np.asarray` reads, such as `module.state_dict()`'s CPU tensors).
      cutoffs, div_value, head_bias: the PyTorch module's arguments. PyTorch's classes
        are the layer's ranks: the layer has no `class_order` (to serve ids in another
        order, map them to the module's class ids before and after).
      **kwargs: further layer arguments: `name`, `dtype`, `trainable`.

    Returns:
      A built layer (flat tails) whose outputs equal the module's.
    """
    unknown = sorted(set(kwargs) - {"name", "dtype", "trainable"})
    if unknown:
      raise TypeError(f"from_torch_state_dict takes name, dtype and trainable besides the "
                      f"module's arguments, got {', '.join(unknown)} (PyTorch's module "
                      "has flat tails and its classes in rank order: no tail, "
                      "class_order or counts)")
    arrays = {name: np.asarray(value) for name, value in state_dict.items()}
    cutoffs = list(cutoffs)
    last = f"tail.{len(cutoffs) - 1}.1.weight"
    for name in ["head.weight", last] + (["head.bias"] if head_bias else []):
      if name not in arrays:
        raise ValueError(f"state_dict has no {name!r} (keys: {sorted(arrays)})")
    _check_no_unused_torch_keys(arrays, len(cutoffs), head_bias)
    num_classes = cutoffs[-1] + arrays[last].shape[0]
    dim = arrays["head.weight"].shape[1]
    dtype = "float64" if arrays["head.weight"].dtype == np.float64 else "float32"
    layer = cls(num_classes, cutoffs, div_value=div_value, head_bias=head_bias,
                dtype=kwargs.pop("dtype", dtype), **kwargs)
    layer.build((None, dim))
    _check_torch_shapes(layer, arrays, cutoffs, div_value, head_bias)
    layer.head_kernel.assign(arrays["head.weight"])
    if head_bias:
      layer.head_bias_weight.assign(arrays["head.bias"])
    for i in range(len(cutoffs)):
      layer.tail_projections[i].assign(arrays[f"tail.{i}.0.weight"].T)
      layer.tail_kernels[i].assign(arrays[f"tail.{i}.1.weight"])
    return layer

  def _adaptive_config(self):
    """The layer's own config entries (the front end adds the initializer's)."""
    if self.cutoffs is None:
      raise ValueError("AdaptiveSoftmax with cutoffs=None has no config before it is "
                       "built: its cutoffs are chosen in build, when D is known")
    return {
        "num_classes": self.num_classes,
        "cutoffs": list(self.cutoffs),
        "div_value": self.div_value,
        "head_bias": self.head_bias,
        "tail": self.tail,
        "tail_trees": (None if self.tail_trees is None
                       else [t.get_config() for t in self.tail_trees]),
        # Compact, as a tree's config is: a JSON list of 1M ids would be ~7 MB of
        # Python ints that Keras walks one by one when it loads the layer.
        "class_order": (None if self.class_order is None else
                        {"encoding": tree_io.CONFIG_ENCODING,
                         "ids": tree_io.encode_ints(self.class_order.order)}),
    }


def _check_no_unused_torch_keys(arrays, num_tails, head_bias):
  """ValueError naming the state_dict's keys a module of these arguments does not hold:
  each would be left out of the layer silently (a head.bias without head_bias=True
  changes every output)."""
  expected = {"head.weight"} | ({"head.bias"} if head_bias else set()) | {
      f"tail.{i}.{j}.weight" for i in range(num_tails) for j in (0, 1)}
  unused = sorted(set(arrays) - expected)
  if unused:
    hint = (": the module was made with head_bias=True; pass it too"
            if "head.bias" in unused else "")
    raise ValueError(f"state_dict holds {unused}, which a module of these arguments "
                     f"(cutoffs of {num_tails} tails, head_bias={head_bias}) does not "
                     f"have{hint}")


def _check_torch_shapes(layer, arrays, cutoffs, div_value, head_bias):
  expected = {"head.weight": layer.head_kernel.shape}
  if head_bias:
    expected["head.bias"] = layer.head_bias_weight.shape
  for i in range(len(cutoffs)):
    expected[f"tail.{i}.0.weight"] = tuple(reversed(layer.tail_projections[i].shape))
    expected[f"tail.{i}.1.weight"] = layer.tail_kernels[i].shape
  for name, shape in expected.items():
    if name not in arrays:
      raise ValueError(f"state_dict has no {name!r}")
    if tuple(arrays[name].shape) != tuple(shape):
      raise ValueError(f"{name} has shape {tuple(arrays[name].shape)}, expected "
                       f"{tuple(shape)} for cutoffs {cutoffs} and div_value {div_value}")
