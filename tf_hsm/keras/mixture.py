"""`HierarchicalSoftmaxMixture`: a mixture of hierarchical softmaxes over different trees,
weighted by a gate on the hidden state (Keras 3).

One tree factors each class's probability through the clusters above it, and a cluster's
probability is one softmax's, log-linear in the hidden state: where the classes of a
cluster follow different contexts, no single cluster row scores them all. Two trees that
group the classes differently (from the words' left and right contexts, say) give each
class two such factorizations, and the mixture

    P(c | h) = sum_k pi_k(h) P_k(c | h),    pi(h) = softmax(G h + g)

is as normalised as each tree is, its log-probability exact. It costs each tree's step
once (about K x one tree's) and a [D, K] gate. With `head`, the frequent classes get
one exact softmax shared by the trees, which then cover the other classes and are
walked for those tokens only (`tf_hsm.keras.mixture_head`): the heads' work once, not
K times. Measured on 100K-word corpora in docs/planner.md ("A mixture of trees").
"""

import keras
import numpy as np
import tensorflow as tf

from tf_hsm.frontend import hsm
from tf_hsm.keras import mixture_head
from tf_hsm.keras.layers import HierarchicalSoftmax
from tf_hsm.ops import inference
from tf_hsm.tree import Tree


@keras.saving.register_keras_serializable(package="tf_hsm")
class HierarchicalSoftmaxMixture(keras.layers.Layer):
  """`layer(hidden, targets)` -> log sum_k pi_k(hidden) P_k(targets | hidden).

  Each component is a `HierarchicalSoftmax` over its own tree of the same classes (with
  its own table); the gate is a `[D, K]` kernel and `[K]` bias, zero at the start (an
  even mixture). Padding is each component's: targets < 0, `ignore_class` and Keras
  masks give log-probability 0 and no gradient, and the output carries the mask, so
  `tf_hsm.losses.nll` averages over real tokens only. Train it as the single layer:
  `tf_hsm.losses.nll`, `tf_hsm.optimizers.LazyAdam` (each table's gradient is sparse).

  Inference: `log_prob_all` (each tree's full distribution, mixed), `top_k` on it and
  `sample` (a component from the gate, then a class from its tree);
  `tf_hsm.inference_model` cuts a model for `predict` with any of them, and
  `tf_hsm.serving.export` serves them in stock ops (`tf_hsm.serving.mixture`).

  Args:
    components: two or more `tf_hsm.Tree`s over the same classes (each made a
      `HierarchicalSoftmax` with the default arguments), or `HierarchicalSoftmax`
      layers (not yet built; their own initializers, `ignore_class` the same in all),
      or either's `get_config()` dict.
    gate_initializer: initializer of the gate's kernel (default zeros).
    head: optional class ids (distinct) scored by one softmax shared by the
      components, with a slot for the rest; the components' trees are then over the
      other classes, in increasing id order (`Tree.from_context(..., classes=
      tf_hsm.keras.mixture_head.tail_classes(head, V))`), and the layer is over
      len(head) + their classes. Default None: each tree over every class.
    head_bias_initializer: initializer of the head softmax's len(head) + 1 biases (the
      last the tail's); its table takes the first component's other settings.
    ignore_class: with `head`, a class id that counts as padding (the components'
      must then be None: their ids are tail positions). Without `head`, the
      components' own.
    tail_dim: with `head`, optional width d of what the trees score: a `[D, d]`
      projection of the hidden state (`tail_projection`, shared by the trees), as the
      adaptive softmax gives its rare classes fewer dimensions. The trees' tables are
      then d wide, which is what a tree step at V=1M costs (its rows are read and
      written once per token and level). Default None: the hidden state itself.
    tail_projection_initializer: initializer of that projection.
    **kwargs: base `keras.layers.Layer` arguments (name, dtype, trainable, ...).

  Raises:
    TypeError, ValueError: fewer than two components, a component that is neither, trees
      over different numbers of classes, components with different `ignore_class`, a
      malformed `head`, `ignore_class` without `head` or beside the components' own,
      `tail_dim` without `head` or not a positive int.
  """

  def __init__(self, components, gate_initializer="zeros", head=None,
               head_bias_initializer="zeros", ignore_class=None, tail_dim=None,
               tail_projection_initializer="glorot_uniform", **kwargs):
    super().__init__(**kwargs)
    self.components = _checked_components(components, self.name, self.dtype_policy)
    self.gate_initializer = keras.initializers.get(gate_initializer)
    self.head_ids, self.head, self._class_map = None, None, None
    self.head_bias_initializer = keras.initializers.get(head_bias_initializer)
    self._ignore_class = _checked_ignore_class(ignore_class, head, self.components)
    self.tail_dim = _checked_tail_dim(tail_dim, head)
    # Made only where it is used: an initializer made without a seed draws one from
    # Python's generator, which would move every later seeded draw (the head's too).
    self.tail_projection_initializer = (
        None if self.tail_dim is None else keras.initializers.get(tail_projection_initializer))
    if self.tail_dim is not None:
      # The trees take the float32 projection as it is: Keras would round it to the
      # compute dtype (float16) at their call, and not in log_prob_all, which is no
      # call; their op computes in float32 either way.
      for component in self.components:
        component.autocast = False
    if head is not None:
      self.head_ids, tail = mixture_head.checked_head(head, self.components[0].num_classes)
      self._class_map = mixture_head.ClassMap(self.head_ids, tail)
      self.head = mixture_head.head_layer(self.head_ids, self.components[0],
                                          self.head_bias_initializer, f"{self.name}_head")
    if not self.trainable:  # Keras set it before the components existed
      for component in self._parts():
        component.trainable = False
    self.supports_masking = True
    self.supports_jit = False

  def _parts(self):
    """The components, and the head's softmax where there is one."""
    return self.components + ([self.head] if self.head is not None else [])

  @property
  def num_classes(self):
    return self.components[0].num_classes + (0 if self.head_ids is None else
                                             len(self.head_ids))

  @property
  def ignore_class(self):
    return self._ignore_class if self.head is not None else self.components[0].ignore_class

  def build(self, hidden_shape, targets_shape=None):
    dim = hidden_shape[-1]
    if dim is None:
      raise ValueError("HierarchicalSoftmaxMixture needs a known last dimension of "
                       f"`hidden`, got shape {hidden_shape}")
    if self.head is not None:
      self.head.build(hidden_shape)
    tail_shape = tuple(hidden_shape[:-1]) + (self.tail_dim or dim,)
    for component in self.components:
      component.build(tail_shape)
    if self.tail_dim is not None:
      self.tail_projection = self.add_weight(
          name="tail_projection", shape=(dim, self.tail_dim),
          initializer=self.tail_projection_initializer, autocast=False)
    self.gate_kernel = self.add_weight(name="gate_kernel", shape=(dim, len(self.components)),
                                       initializer=self.gate_initializer, autocast=False)
    self.gate_bias = self.add_weight(name="gate_bias", shape=(len(self.components),),
                                     initializer="zeros", autocast=False)

  def _gate_logits(self, hidden):
    """G hidden + g, `[..., K]`, in the tables' dtype."""
    hidden = hsm.hidden_in(hidden, self.gate_kernel.dtype)
    return tf.tensordot(hidden, self.gate_kernel, 1) + self.gate_bias

  def _tail_input(self, hidden):
    """What the trees score: `hidden`, or its projection with `tail_dim`."""
    if self.tail_dim is None:
      return hidden
    return tf.tensordot(hsm.hidden_in(hidden, self.tail_projection.dtype),
                        self.tail_projection, 1)

  def _log_gate(self, hidden):
    """log pi(hidden), `[..., K]`, in the tables' dtype."""
    return tf.nn.log_softmax(self._gate_logits(hidden), axis=-1)

  def call(self, hidden, targets, mask=None, hidden_mask=None, training=None):
    _check_dense("call", hidden, targets)
    mask = hsm.combined_mask((mask, hidden_mask))
    if self.head is not None:
      out, valid = self._headed_call(hidden, targets, mask, training)
    else:
      parts = [c(hidden, targets, mask=mask, training=training) for c in self.components]
      valid = parts[0]._keras_mask  # pylint: disable=protected-access
      mixed = tf.reduce_logsumexp(tf.stack(parts, -1) + self._log_gate(hidden), -1)
      out = tf.where(valid, mixed, tf.zeros_like(mixed))
    out._keras_mask = valid  # how Keras attaches a mask to a tensor (masking guide)
    hsm.attach_source(out, self, hidden, targets)  # for TopKAccuracy in compile
    return out

  def _headed_call(self, hidden, targets, mask, training):
    """(log P(targets), valid) with the shared head: the head's softmax for every
    token, the trees and the gate for the tail's tokens only, gathered (no tree walks a
    path, nor names a row in its gradient, for a head or padded token)."""
    targets = tf.convert_to_tensor(targets)
    if not targets.dtype.is_integer:
      raise TypeError(f"targets must be integer class ids, got {targets.dtype.name}")
    targets = tf.cast(targets, tf.int64)
    valid = hsm.combined_mask((mask,), targets >= 0)
    if self.ignore_class is not None:
      valid = tf.logical_and(valid, targets != self.ignore_class)
    tf.debugging.assert_less(tf.where(valid, targets, tf.zeros_like(targets)),
                             tf.constant(self.num_classes, tf.int64),
                             message=f"targets must be < num_classes = {self.num_classes}")
    head_targets, tail_targets, in_tail = self._class_map.split(targets, valid)
    head = self.head(hidden, head_targets, training=training)
    hidden = tf.convert_to_tensor(hidden)
    flat_hidden = tf.reshape(hidden, [-1, tf.shape(hidden)[-1]])
    where = tf.where(tf.reshape(in_tail, [-1]))  # [n, 1]: the tail's tokens
    tail_hidden = tf.gather_nd(flat_hidden, where)
    tail_input = self._tail_input(tail_hidden)
    parts = [c(tail_input, tf.gather_nd(tf.reshape(tail_targets, [-1]), where),
               training=training) for c in self.components]
    mixed = tf.reduce_logsumexp(tf.stack(parts, -1) + self._log_gate(tail_hidden), -1)
    mixed = tf.reshape(tf.scatter_nd(where, mixed, tf.size(in_tail, out_type=tf.int64)[None]),
                       tf.shape(in_tail))
    out = head + tf.cast(mixed, head.dtype)
    return tf.where(valid, out, tf.zeros_like(out)), valid

  def compute_mask(self, hidden, previous_mask=None):
    # `call` attaches the real mask (it depends on the targets) to its output.
    return None

  def log_prob_all(self, hidden, **kwargs):
    """log P(c | hidden) for every class c: `[..., num_classes]` (each component's
    `log_prob_all`, keyword arguments passed on, mixed by the gate)."""
    self._check_built("log_prob_all")
    _check_dense("log_prob_all", hidden)
    if self.head is not None and kwargs:
      raise ValueError(f"HierarchicalSoftmaxMixture.log_prob_all with a head takes no "
                       f"{', '.join(sorted(kwargs))}: the head's slots and the trees' "
                       "classes are not one range of ids")
    tail_input = self._tail_input(hidden)
    parts = tf.stack([c.log_prob_all(tail_input, **kwargs) for c in self.components], -1)
    mixed = tf.reduce_logsumexp(parts + self._log_gate(hidden)[..., None, :], -1)
    if self.head is None:
      return mixed
    return self._class_map.assemble(self.head.log_prob_all(hidden, **kwargs), mixed)

  def top_k(self, hidden, k, exclude=None):
    """The k most probable classes: (log_probs, classes), each `[..., k]`, from
    `log_prob_all`, leaving out `ignore_class` and `exclude` (class ids `[..., n]` per
    row, as `tf_hsm.inference.top_k`'s; ids < 0 exclude nothing). Where fewer than k
    classes are left, the last are class -1 at -inf, as the component's."""
    self._check_built("top_k")
    _check_dense("top_k", hidden)
    inference.check_k(k, self.num_classes)
    log_probs = self.log_prob_all(hidden)
    left_out = hsm.with_ignored(exclude, self.ignore_class, hidden)
    if left_out is not None:
      log_probs = self._excluded(log_probs, left_out)
    values, classes = tf.math.top_k(log_probs, k)
    classes = tf.where(tf.math.is_inf(values), tf.constant(-1, classes.dtype), classes)
    return values, tf.cast(classes, tf.int64)

  def _excluded(self, log_probs, left_out):
    """`log_probs` [..., V] with -inf at each row's ids of `left_out` ([..., n], a
    dimension of 1 for every row along it; ids < 0 leave nothing out), scattered into
    the rows: no [..., n, V] tensor."""
    left_out = tf.cast(tf.convert_to_tensor(left_out), tf.int64)
    tf.debugging.assert_less(left_out, tf.constant(self.num_classes, tf.int64),
                             message=f"exclude ids must be < num_classes = "
                                     f"{self.num_classes}")
    rows = tf.reshape(log_probs, [-1, self.num_classes])
    ids = tf.reshape(tf.broadcast_to(left_out, tf.concat(
        [tf.shape(log_probs, out_type=tf.int64)[:-1], tf.shape(left_out,
                                                                out_type=tf.int64)[-1:]],
        0)), [tf.shape(rows)[0], -1])
    row = tf.broadcast_to(tf.range(tf.shape(ids, out_type=tf.int64)[0])[:, None],
                          tf.shape(ids))
    keep = ids >= 0
    where = tf.stack([row[keep], ids[keep]], -1)
    rows = tf.tensor_scatter_nd_update(
        rows, where, tf.fill(tf.shape(where)[:1], tf.constant(-float("inf"), rows.dtype)))
    return tf.reshape(rows, tf.shape(log_probs))

  def sample(self, hidden, seed=None, temperature=1.0):
    """Draws one class per hidden state, int64 `[...]`: a component from the gate, then
    a class from that component's tree (its `sample`), which is exact ancestral
    sampling of the mixture. With temperature T the gate's logits and every node's are
    divided by T: the mixture whose weights and biases are divided by T, as a
    component's temperature is. `seed`: an int (scalar) from which the gate's draw and
    each component's seed are derived, or None for fresh draws. A row whose gate logits
    are not all finite (NaN or infinite hidden states) gets -1, as a component's row
    without a distribution does."""
    self._check_built("sample")
    _check_dense("sample", hidden)
    K = len(self.components)
    # Each component's seed from (seed, k) through Philox: seeds s and s + 1 share no
    # component's stream. None: one drawn, as the component's.
    seed = inference.seed_tensor(seed)
    seeds = [tf.random.stateless_uniform([], tf.stack([seed, tf.constant(k, tf.int64)]),
                                         minval=None, maxval=None, dtype=tf.int64)
             for k in range(K)]
    # Each component checks the temperature (and draws its class) first.
    tail_input = self._tail_input(hidden)
    draws = tf.stack([c.sample(tail_input, seed=s, temperature=temperature)
                      for c, s in zip(self.components, seeds)], -1)
    logits = self._gate_logits(hidden)
    # A row without a distribution (a NaN or infinite gate logit) gets -1, as a
    # component's; the largest logit subtracted first, so a small T cannot overflow.
    defined = tf.reduce_all(tf.math.is_finite(logits), -1)
    logits = (logits - tf.reduce_max(logits, -1, keepdims=True)) / tf.cast(temperature,
                                                                          logits.dtype)
    rows = tf.reshape(tf.where(defined[..., None], logits, tf.zeros_like(logits)), [-1, K])
    chosen = tf.random.stateless_categorical(rows, 1,
                                             tf.stack([seed, tf.constant(-1, tf.int64)]))
    chosen = tf.reshape(chosen, tf.shape(logits)[:-1])
    drawn = tf.reduce_sum(draws * tf.one_hot(chosen, K, dtype=tf.int64), -1)
    drawn = tf.where(defined, drawn, tf.constant(-1, tf.int64))
    if self.head is None:
      return drawn
    # The head's slot first (its own seed, from (seed, -2)): the tail's draw where it is
    # the tail slot.
    head_seed = tf.random.stateless_uniform([], tf.stack([seed, tf.constant(-2, tf.int64)]),
                                            minval=None, maxval=None, dtype=tf.int64)
    return self._class_map.classes(
        self.head.sample(hidden, seed=head_seed, temperature=temperature), drawn)

  def _check_built(self, what):
    if not self.built:
      raise ValueError(f"HierarchicalSoftmaxMixture.{what} needs a built layer: call it "
                       "on data (or call build(hidden_shape)) first")

  def get_config(self):
    config = super().get_config()
    config.update({
        "components": [c.get_config() for c in self.components],
        "gate_initializer": keras.initializers.serialize(self.gate_initializer),
        "head": None if self.head_ids is None else self.head_ids.tolist(),
        "head_bias_initializer": keras.initializers.serialize(self.head_bias_initializer),
        "ignore_class": self._ignore_class,
    })
    if self.tail_dim is not None:  # written only where set: older configs load as before
      config.update({"tail_dim": self.tail_dim,
                     "tail_projection_initializer": keras.initializers.serialize(
                         self.tail_projection_initializer)})
    return config


def _check_dense(what, *tensors):
  if any(isinstance(t, tf.RaggedTensor) for t in tensors):
    raise TypeError(f"HierarchicalSoftmaxMixture.{what} takes dense hidden states (and "
                    "targets): pad them (targets < 0 or a Keras mask mark the padding)")


def _checked_ignore_class(ignore_class, head, components):
  """The mixture's own ignore_class (with a head), or ValueError where it cannot be."""
  if head is not None and components[0].ignore_class is not None:
    raise ValueError("with a head, the components' ignore_class must be None (their ids "
                     "are positions among the tail classes): give it to the mixture")
  if ignore_class is None:
    return None
  if head is None:
    raise ValueError("ignore_class is the mixture's with a head only: without one, give "
                     "it to the components")
  if isinstance(ignore_class, bool) or not isinstance(ignore_class, (int, np.integer)):
    raise TypeError(f"ignore_class must be an int class id, got {ignore_class!r}")
  num_classes = components[0].num_classes + len(head)
  if not 0 <= ignore_class < num_classes:
    raise ValueError(f"ignore_class must be within [0, {num_classes}), got {ignore_class}")
  return int(ignore_class)


def _checked_tail_dim(tail_dim, head):
  """`tail_dim` as an int, or None; TypeError/ValueError where it cannot be."""
  if tail_dim is None:
    return None
  if isinstance(tail_dim, bool) or not isinstance(tail_dim, (int, np.integer)):
    raise TypeError(f"tail_dim must be a positive int (the trees' width), got {tail_dim!r}")
  if tail_dim < 1:
    raise ValueError(f"tail_dim must be a positive int (the trees' width), got {tail_dim}")
  if head is None:
    raise ValueError("tail_dim needs a head: the projection is of what the trees below "
                     "the shared head score")
  return int(tail_dim)


def _checked_components(components, name, dtype_policy):
  """The components as unbuilt `HierarchicalSoftmax` layers over one set of classes."""
  if isinstance(components, (Tree, dict, HierarchicalSoftmax)) or not hasattr(
      components, "__len__"):
    raise TypeError("components must be a list of two or more Trees or HierarchicalSoftmax "
                    f"layers, got {type(components).__name__}")
  if len(components) < 2:
    raise ValueError(f"a mixture needs two or more components, got {len(components)}")
  layers = []
  for index, component in enumerate(components):
    if isinstance(component, dict) and "tree" in component:
      component = HierarchicalSoftmax.from_config(component)
    elif isinstance(component, (Tree, dict)):
      component = HierarchicalSoftmax(component, name=f"{name}_tree_{index}",
                                      dtype=dtype_policy)
    if not isinstance(component, HierarchicalSoftmax):
      raise TypeError(f"components[{index}] must be a Tree or a HierarchicalSoftmax "
                      f"(Keras 3), got {type(component).__name__}")
    if component.built:
      raise ValueError(f"components[{index}] is built already: give the mixture unbuilt "
                       "layers (it builds them on its hidden states)")
    if any(component is other for other in layers):
      raise ValueError(f"components[{index}] is components[{layers.index(component)}] "
                       "again: each component is a layer of its own")
    layers.append(component)
  classes = {c.num_classes for c in layers}
  if len(classes) > 1:
    raise ValueError(f"the components' trees must be over the same classes, got "
                     f"{sorted(classes)} classes")
  dtypes = {c.dtype_policy.variable_dtype for c in layers} - {dtype_policy.variable_dtype}
  if dtypes:
    raise ValueError(f"the components' tables are {', '.join(sorted(dtypes))} and the "
                     f"mixture's {dtype_policy.variable_dtype}: give them one dtype")
  ignored = {c.ignore_class for c in layers}
  if len(ignored) > 1:
    raise ValueError(f"the components must share one ignore_class, got {sorted(ignored, key=str)}")
  return layers
