"""`AdaptiveSoftmax`: the adaptive softmax of Grave et al. (PyTorch's
`nn.AdaptiveLogSoftmaxWithLoss`) as a Keras 3 layer, with tails that may be trees.

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

Each tier is one batched computation over the tokens whose targets fall in it (found with
`tf.where`, no per-token Python): dense tiers use TensorFlow's matmul and fused softmax
cross-entropy, tree tiers `tf_hsm.log_prob` and `tf_hsm.inference`.
"""

import math
import numbers

import keras
import numpy as np
import tensorflow as tf

from tf_hsm.frontend import hsm
from tf_hsm.planning import cutoffs as cutoff_search
from tf_hsm.ops import inference
from tf_hsm.planning.costs import TAILS, tail_widths  # noqa: F401 (public here)
from tf_hsm.planning.cutoffs import choose_cutoffs, step_cost  # noqa: F401 (public here)
from tf_hsm.ops import log_prob
from tf_hsm.tree import Tree

# Tokens a step assumed by cutoffs=None when tokens_per_step is not given.
DEFAULT_TOKENS_PER_STEP = 1024


def _checked_cutoffs(cutoffs, num_classes):
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
                     f"increasing order, each smaller than num_classes={num_classes}; got "
                     f"{values}")
  return values


@keras.saving.register_keras_serializable(package="tf_hsm")
class AdaptiveSoftmax(keras.layers.Layer):
  """Adaptive softmax output layer: `layer(hidden, targets)` -> log P(targets | hidden).

  Weights (PyTorch's names in brackets; tables hold one row per class or tree edge):
    head_kernel `[cutoffs[0] + n_clusters, D]` [`head.weight`], head_bias (with
    `head_bias=True`) [`head.bias`]; for cluster i: `tail_projection_i` `[D, d_i]`
    [`tail.{i}.0.weight`, transposed], `tail_kernel_i` `[rows_i, d_i]` [`tail.{i}.1.weight`]
    and, for tree tails, `tail_bias_i` `[rows_i]`.

  Padding and masks behave as in `tf_hsm.HierarchicalSoftmax`: targets < 0 and masked
  positions give 0 and no gradient, and the output carries the mask.

  Args:
    num_classes: number of classes V.
    cutoffs: increasing ints in (0, V): the head holds classes [0, cutoffs[0]), cluster i
      the classes [cutoffs[i], cutoffs[i + 1]) (the last one up to V). Class ids should
      be sorted by decreasing frequency. None (with `counts`): chosen when the layer is
      built (D is known then) by `choose_cutoffs` for `tokens_per_step` tokens a step on
      `machine`, and recorded in `cutoffs` (so `get_config` and saving carry them).
    div_value: cluster i works at width int(D // div_value ** (i + 1)).
    head_bias: whether the head has biases (PyTorch's default: no).
    tail: "flat" (an exact softmax within each cluster, as PyTorch) or "two_level" (each
      cluster is a `Tree.two_level` over its classes, with per-edge biases).
    counts: optional class frequencies `[num_classes]`: the two-level tail trees group
      classes into clusters of about equal mass; with cutoffs=None, they must be
      non-increasing, and choose the cutoffs.
    kernel_initializer: initializer of every table and projection.
    tokens_per_step: with cutoffs=None, the tokens (targets) a training step holds
      (default `DEFAULT_TOKENS_PER_STEP`); otherwise unused.
    machine: with cutoffs=None, the `tf_hsm.planning.Machine` (or a dict of its fields)
      to choose for (default: this machine, measured once and cached); otherwise unused.
    **kwargs: base `keras.layers.Layer` arguments; `tail_trees` (the trees' configs) is
      how `get_config` carries the trees.

  Call arguments:
    hidden: `[..., D]` float hidden states. targets: int class ids, `hidden`'s leading
    shape; < 0 marks padding. mask: optional boolean mask with `targets`' shape.
  """

  def __init__(self, num_classes, cutoffs=None, div_value=4.0, head_bias=False,
               tail="flat", counts=None, kernel_initializer="glorot_uniform",
               tail_trees=None, tokens_per_step=None, machine=None, **kwargs):
    super().__init__(**kwargs)
    if isinstance(num_classes, bool) or not isinstance(num_classes, numbers.Integral):
      raise TypeError(f"num_classes must be an int, got {num_classes!r}")
    if num_classes < 2:
      raise ValueError(f"num_classes must be >= 2, got {num_classes}")
    self.num_classes = int(num_classes)
    if cutoffs is None and counts is None:
      raise ValueError("AdaptiveSoftmax needs cutoffs, or counts to choose them from: "
                       "give cutoffs=[...] (the head's size, then each cluster's first "
                       "class), or counts=[one frequency per class] with cutoffs=None")
    if (isinstance(div_value, bool) or not isinstance(div_value, numbers.Real) or
        not math.isfinite(div_value) or div_value <= 0):
      raise ValueError(f"div_value must be a positive finite number, got {div_value!r}")
    self.div_value = float(div_value)
    self.head_bias = bool(head_bias)
    if tail not in TAILS:
      raise ValueError(f"tail must be one of {TAILS}, got {tail!r}")
    self.tail = tail
    self.kernel_initializer = keras.initializers.get(kernel_initializer)
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
      counts = cutoff_search.checked_counts(counts, self.num_classes)
      # Chosen in build, where D is known.
      self._pending = dict(counts=counts, tokens_per_step=int(tokens_per_step),
                           machine=machine)
    else:
      self._set_cutoffs(_checked_cutoffs(cutoffs, self.num_classes), counts, tail_trees)
    self.supports_masking = True
    self.supports_jit = False  # the tree tails' ops have no XLA kernel

  def _set_cutoffs(self, cutoffs, counts, tail_trees):
    self.cutoffs = cutoffs
    bounds = self.cutoffs + [self.num_classes]
    self.cluster_ranges = [(bounds[i], bounds[i + 1]) for i in range(len(self.cutoffs))]
    if self.tail != "two_level":
      return
    if tail_trees is not None:
      trees = [t if isinstance(t, Tree) else Tree.from_config(t) for t in tail_trees]
      if [t.num_classes for t in trees] != [hi - lo for lo, hi in self.cluster_ranges]:
        raise ValueError("tail_trees do not match the clusters' sizes")
    else:
      if counts is not None:
        counts = np.asarray(counts, np.float64)
        if counts.shape != (self.num_classes,):
          raise ValueError(f"counts must have shape [{self.num_classes}], got "
                           f"{counts.shape}")
      trees = [Tree.two_level(hi - lo, counts=None if counts is None else counts[lo:hi])
               for lo, hi in self.cluster_ranges]
    self.tail_trees = trees

  @staticmethod
  def choose_cutoffs(counts, dim, tokens_per_step, div_value=4.0, tail="flat",
                     machine=None, **kwargs):
    """The cutoffs a layer with cutoffs=None would choose: `tf_hsm.adaptive.choose_cutoffs`
    (the cost model, its arguments and bounds are described there and in
    docs/adaptive.md).

    Args:
      counts: class frequencies `[num_classes]`, non-increasing.
      dim: D, the hidden size.
      tokens_per_step: T, tokens (targets) a training step.
      div_value: the layer's div_value.
      tail: the layer's tail, "flat" or "two_level".
      machine: a `tf_hsm.planning.Machine` (or a dict of its fields); default: this
        machine, measured once and cached.
      **kwargs: `max_clusters`, `min_head_mass`, `min_width`, `points_per_decade`.

    Returns:
      The cutoffs, a list of increasing ints.
    """
    return choose_cutoffs(counts, dim, tokens_per_step, div_value=div_value, tail=tail,
                          machine=machine, **kwargs)

  @property
  def head_size(self):
    if self.cutoffs is None:
      raise ValueError("AdaptiveSoftmax chooses its cutoffs when built: build it first")
    return self.cutoffs[0] + len(self.cluster_ranges)

  def build(self, hidden_shape, targets_shape=None):
    dim = hidden_shape[-1]
    if dim is None:
      raise ValueError("AdaptiveSoftmax needs a known last dimension of `hidden`, got "
                       f"shape {hidden_shape}")
    if self.cutoffs is None:
      pending = self._pending
      cutoffs = choose_cutoffs(pending["counts"], int(dim), pending["tokens_per_step"],
                               div_value=self.div_value, tail=self.tail,
                               machine=pending["machine"])
      self._set_cutoffs(cutoffs, pending["counts"], None)
      self._pending = None
    widths = tail_widths(dim, len(self.cluster_ranges), self.div_value)
    if min(widths) < 1:
      i = widths.index(min(widths))
      raise ValueError(f"cluster {i} would have width int({dim} // {self.div_value:g}**"
                       f"{i + 1}) = 0: use a smaller div_value or fewer cutoffs")
    self.tail_dims = widths
    self.head_kernel = self.add_weight(name="head_kernel", shape=(self.head_size, dim),
                                       initializer=self.kernel_initializer)
    self.head_bias_weight = (self.add_weight(name="head_bias", shape=(self.head_size,),
                                             initializer="zeros")
                             if self.head_bias else None)
    self.tail_projections, self.tail_kernels, self.tail_biases = [], [], []
    for i, ((lo, hi), width) in enumerate(zip(self.cluster_ranges, widths)):
      rows = hi - lo if self.tail == "flat" else self.tail_trees[i].num_slots
      self.tail_projections.append(self.add_weight(
          name=f"tail_projection_{i}", shape=(dim, width),
          initializer=self.kernel_initializer))
      self.tail_kernels.append(self.add_weight(
          name=f"tail_kernel_{i}", shape=(rows, width),
          initializer=self.kernel_initializer))
      self.tail_biases.append(
          self.add_weight(name=f"tail_bias_{i}", shape=(rows,), initializer="zeros")
          if self.tail == "two_level" else None)
    self.built = True

  # ------------------------------------------------------------------ helpers

  def _flat_hidden(self, hidden):
    hidden = tf.convert_to_tensor(hidden)
    dtype = tf.as_dtype(self.head_kernel.dtype)
    if hidden.dtype != dtype:
      hidden = tf.cast(hidden, dtype)
    dim = self.head_kernel.shape[-1]
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

  # ------------------------------------------------------------------ training

  def __call__(self, *args, **kwargs):
    hsm.refuse_other_keras("keras", "AdaptiveSoftmax", (args, kwargs))
    return super().__call__(*args, **kwargs)

  def call(self, hidden, targets, mask=None, hidden_mask=None):
    targets = tf.convert_to_tensor(targets)
    if not targets.dtype.is_integer:
      raise TypeError(f"targets must be integer class ids, got {targets.dtype.name}")
    flat, leading = self._flat_hidden(hidden)
    targets_flat = tf.cast(tf.reshape(targets, [-1]), tf.int64)
    valid = tf.logical_and(targets_flat >= 0, targets_flat < self.num_classes)
    # Targets past the last class are an error, as in the other ops.
    tf.debugging.assert_less(targets_flat, tf.constant(self.num_classes, tf.int64),
                             message="AdaptiveSoftmax: a target is >= num_classes")
    for extra in (mask, hidden_mask):
      if extra is not None:
        valid = tf.logical_and(valid, tf.reshape(tf.cast(extra, tf.bool), [-1]))
    safe = tf.where(valid, targets_flat, tf.zeros_like(targets_flat))
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
    """log P(c | hidden) for every class c: `[..., num_classes]` (PyTorch's `log_prob`)."""
    self._check_built("log_prob_all")
    flat, leading = self._flat_hidden(hidden)
    head = tf.nn.log_softmax(self._head_logits(flat))
    parts = [head[:, :self.cutoffs[0]]]
    for i in range(len(self.cluster_ranges)):
      projected = tf.matmul(flat, self.tail_projections[i])
      token = self.cutoffs[0] + i
      parts.append(self._cluster_log_probs(i, projected) + head[:, token:token + 1])
    out = tf.concat(parts, axis=-1)
    return tf.reshape(out, tf.concat([leading, [self.num_classes]], 0))

  def top_k(self, hidden, k):
    """The k most probable classes, exactly: `(log_probs, classes)`, each `[..., k]`,
    best first; equal values in increasing class order.

    The best k of all classes are among the best k of each tier (a cluster's classes
    all share its head token's log-probability), so each tier contributes its own top k
    (a tree tier by `tf_hsm.inference.top_k`'s search) and one `tf.math.top_k` merges.
    """
    self._check_built("top_k")
    if isinstance(k, bool) or not isinstance(k, numbers.Integral):
      raise TypeError(f"k must be an int, got {k!r}")
    if not 1 <= k <= self.num_classes:
      raise ValueError(f"k must be in [1, num_classes={self.num_classes}], got {k}")
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
    chosen = tf.gather(tf.concat(classes, -1), where, batch_dims=1)
    shape = tf.concat([leading, [k]], 0)
    return tf.reshape(best, shape), tf.reshape(chosen, shape)

  def sample(self, hidden, seed=None, temperature=1.0):
    """One class per hidden state: the head's tempered softmax picks a head class or a
    cluster, the cluster's tempered softmax (or tree) picks its class. int64, with
    hidden's leading shape. For a seed the result is reproducible."""
    self._check_built("sample")
    if (isinstance(temperature, bool) or not isinstance(temperature, numbers.Real) or
        not math.isfinite(temperature) or temperature <= 0):
      raise ValueError(f"temperature must be a positive finite number, got "
                       f"{temperature!r}")
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
    return tf.reshape(choice, leading)

  # ------------------------------------------------------------------ PyTorch, config

  @classmethod
  def from_torch_state_dict(cls, state_dict, cutoffs, div_value=4.0, head_bias=False,
                            **kwargs):
    """The layer holding the weights of a PyTorch `nn.AdaptiveLogSoftmaxWithLoss`.

    Args:
      state_dict: a mapping from PyTorch's parameter names (`head.weight`, `head.bias`,
        `tail.{i}.0.weight`, `tail.{i}.1.weight`) to arrays (NumPy arrays, or anything
        `np.asarray` reads, such as `module.state_dict()`'s CPU tensors).
      cutoffs, div_value, head_bias: the PyTorch module's arguments.
      **kwargs: further layer arguments (name, dtype).

    Returns:
      A built `AdaptiveSoftmax` (flat tails) whose outputs equal the module's.
    """
    arrays = {name: np.asarray(value) for name, value in state_dict.items()}
    cutoffs = list(cutoffs)
    last = f"tail.{len(cutoffs) - 1}.1.weight"
    for name in ["head.weight", last] + (["head.bias"] if head_bias else []):
      if name not in arrays:
        raise ValueError(f"state_dict has no {name!r} (keys: {sorted(arrays)})")
    num_classes = cutoffs[-1] + arrays[last].shape[0]
    dim = arrays["head.weight"].shape[1]
    dtype = "float64" if arrays["head.weight"].dtype == np.float64 else "float32"
    layer = cls(num_classes, cutoffs, div_value=div_value, head_bias=head_bias,
                dtype=kwargs.pop("dtype", dtype), **kwargs)
    layer.build((None, dim))
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
    layer.head_kernel.assign(arrays["head.weight"])
    if head_bias:
      layer.head_bias_weight.assign(arrays["head.bias"])
    for i in range(len(cutoffs)):
      layer.tail_projections[i].assign(arrays[f"tail.{i}.0.weight"].T)
      layer.tail_kernels[i].assign(arrays[f"tail.{i}.1.weight"])
    return layer

  def get_config(self):
    if self.cutoffs is None:
      raise ValueError("AdaptiveSoftmax with cutoffs=None has no config before it is "
                       "built: its cutoffs are chosen in build, when D is known")
    config = super().get_config()
    config.update({
        "num_classes": self.num_classes,
        "cutoffs": list(self.cutoffs),
        "div_value": self.div_value,
        "head_bias": self.head_bias,
        "tail": self.tail,
        "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
        "tail_trees": (None if self.tail_trees is None
                       else [t.get_config() for t in self.tail_trees]),
    })
    return config
