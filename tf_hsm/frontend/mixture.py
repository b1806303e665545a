"""What both Keras' `HierarchicalSoftmaxMixture` compute and check: the gate, the
shared head's class map, the call, `log_prob_all`, `top_k` and `sample`, over a layer
of either Keras (its `components`, `head`, `gate_kernel`, ... as `tf_hsm.keras.mixture`
describes them).

    P(c | h) = sum_k pi_k(h) P_k(c | h),    pi(h) = softmax(G h + g)

and with a shared head (`head=...`), one exact softmax over the frequent classes and a
tail slot, the trees over the other classes and walked for the tail's tokens only:

    P(c | h) = P_head(c | h)                                      c in the head
    P(c | h) = P_head(tail | h) sum_k pi_k(h) P_k(c | h)           c in the tail

The tail trees are over the tail classes in increasing id order (`Tree.from_context(...,
classes=tail_classes(head, V))` builds them); `ClassMap` maps class ids to head slots
and tail positions and back.

With `head_rank=r` each component k has a head of its own, the shared head's logits plus
a rank-r correction (`head_correction_in` V `[D, K r]`, `head_correction_out` U
`[K, r, H + 1]`), and the gate mixes the heads too (a mixture of softmaxes over the
frequent classes, at the cost of one head and K thin products):

    P_head,k(s | h) = softmax(W h + b + U_k (V_k h))_s
    P(c | h) = sum_k pi_k(h) P_head,k(c | h)                       c in the head
    P(c | h) = sum_k pi_k(h) P_head,k(tail | h) P_k(c | h)          c in the tail
"""

import numpy as np
import tensorflow as tf

from tf_hsm.frontend import hsm, wiring
from tf_hsm.ops import inference
from tf_hsm.tree import Tree

# ------------------------------------------------------------------ the shared head


def checked_head(head, num_tail_classes):
  """(head ids as int64, tail ids as int64) of `num_tail_classes + len(head)` classes, or
  ValueError naming what is wrong with `head`."""
  ids = np.asarray(head)
  if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
    raise ValueError("head must be a non-empty 1-D sequence of integer class ids (the "
                     f"classes themselves, not their count), got shape {ids.shape} of "
                     f"{ids.dtype}")
  ids = ids.astype(np.int64)
  num_classes = ids.size + num_tail_classes
  if ids.min() < 0 or ids.max() >= num_classes:
    raise ValueError(f"head ids must be within [0, {num_classes}) (the head's "
                     f"{ids.size} classes and the trees' {num_tail_classes}), got "
                     f"{ids.min()}..{ids.max()}")
  if np.unique(ids).size != ids.size:
    raise ValueError("head holds a class id more than once")
  return ids, tail_classes(ids, num_classes)


def tail_classes(head, num_classes):
  """The classes a mixture with `head` leaves to its trees, increasing: the `classes`
  to build its tail trees over."""
  return np.setdiff1d(np.arange(num_classes, dtype=np.int64), np.asarray(head, np.int64))


def head_layer(head_ids, component, bias_initializer, name, initializers, scored_by_op=True):
  """An unbuilt HierarchicalSoftmax (the component's class) over `Tree.flat(len(head) +
  1)` (the last slot the tail), with the settings of `component` (kernel initializer,
  regularizers, constraints, use_bias, fused update, dtype) but its own biases; without
  a fused update where the mixture scores its table itself (`scored_by_op` False: with
  `head_rank`, its table trains by its gradient). `initializers`: the Keras'
  initializers module."""
  config = component.get_config()
  # Its own name, tree and biases; trainable as the mixture is (which sets it after).
  for key in ("name", "tree", "row_layout", "ignore_class", "bias_initializer", "trainable"):
    config.pop(key, None)
  config["bias_initializer"] = initializers.serialize(initializers.get(bias_initializer))
  if not scored_by_op:
    config["fused_update"] = False
  return type(component)(Tree.flat(len(head_ids) + 1), name=name, **config)


class ClassMap:
  """Class ids to (head slot, tail position) and back, as constant tensors."""

  def __init__(self, head_ids, tail_ids):
    self.num_head = len(head_ids)
    self.num_classes = len(head_ids) + len(tail_ids)
    order = np.concatenate([head_ids, tail_ids])
    position = np.empty(self.num_classes, np.int64)
    position[order] = np.arange(self.num_classes)
    self._position = tf.constant(position)  # class -> its place in [head..., tail...]
    self._order = tf.constant(order)  # that place -> the class

  def split(self, targets, valid):
    """(head targets, tail targets, in_tail): the head slot of each valid target (the
    tail slot, len(head), for a tail class) and -1 elsewhere; each valid tail target's
    position among the tail classes and -1 elsewhere (no tail tree's work for them)."""
    targets = tf.cast(targets, tf.int64)
    position = tf.gather(self._position, tf.where(valid, targets, tf.zeros_like(targets)))
    in_tail = tf.logical_and(valid, position >= self.num_head)
    head = tf.where(valid, tf.minimum(position, self.num_head), tf.constant(-1, tf.int64))
    tail = tf.where(in_tail, position - self.num_head, tf.constant(-1, tf.int64))
    return head, tail, in_tail

  def assemble(self, head_log_probs, tail_log_probs):
    """[..., V] log-probabilities in class order from the head's [..., H + 1] and the
    tail's conditional [..., V - H] (log P(c | tail))."""
    joined = tf.concat([head_log_probs[..., :self.num_head],
                        head_log_probs[..., self.num_head:] + tail_log_probs], -1)
    return tf.gather(joined, self._position, axis=-1)

  def classes(self, head_draws, tail_draws):
    """Class ids of draws: a head slot below len(head) is its class, the tail slot the
    tail draw's class; -1 where either draw is -1 (no distribution)."""
    place = tf.where(head_draws < self.num_head, head_draws, self.num_head + tail_draws)
    defined = tf.logical_and(head_draws >= 0, tf.logical_or(head_draws < self.num_head,
                                                             tail_draws >= 0))
    return tf.where(defined, tf.gather(self._order, tf.where(defined, place,
                                                             tf.zeros_like(place))),
                    tf.constant(-1, tf.int64))


# ------------------------------------------------------------------ the layer's parts


class MixtureParts:
  """What both Keras' `HierarchicalSoftmaxMixture` hold and do beyond their own Keras'
  call signature: the parts (`_set_up`), the weights (`build`), the class counts, the
  inference methods and the config. A layer class lists it before its Keras' `Layer`
  and names its Keras (`_KERAS`), its HierarchicalSoftmax (`_COMPONENT`), initializers module
  (`_INITIALIZERS`) and the `add_weight` argument that keeps a weight from being cast
  (`_NO_CAST`)."""

  _COMPONENT = None
  _KERAS = None  # "keras" or "tf_keras"
  _KERAS_NAME = None
  _INITIALIZERS = None
  _NO_CAST = None  # {"autocast": False} or {"experimental_autocast": False}
  _INPUT_CAST = None  # the component's attribute that turns its input casting off

  def _set_up(self, components, gate_initializer, head, head_bias_initializer,
              ignore_class, tail_dim, tail_projection_initializer, num_classes=None,
              head_rank=None):
    inits = self._INITIALIZERS
    self.components = checked_components(components, self.name, self.dtype_policy,
                                         self._COMPONENT, self._KERAS_NAME)
    self.gate_initializer = inits.get(gate_initializer)
    self.head_ids, self.head, self.class_map = None, None, None
    self.head_bias_initializer = inits.get(head_bias_initializer)
    self._ignore_class = checked_ignore_class(ignore_class, head, self.components)
    self.tail_dim = checked_tail_dim(tail_dim, head)
    self.head_rank = checked_head_rank(head_rank, head)
    # Made here, as the projection's, only where it is used (see below).
    self.head_correction_initializer = (
        None if self.head_rank is None else inits.get("glorot_uniform"))
    # Made only where it is used: an initializer made without a seed draws one from
    # Python's generator, which would move every later seeded draw (the head's too).
    self.tail_projection_initializer = (
        None if self.tail_dim is None else inits.get(tail_projection_initializer))
    if self.tail_dim is not None:
      # The trees take the float32 projection as it is: Keras would round it to the
      # compute dtype (float16) at their call, and not in log_prob_all, which is no
      # call; their op computes in float32 either way.
      for component in self.components:
        setattr(component, self._INPUT_CAST, False)
    if head is not None:
      self.head_ids, tail = checked_head(head, self.components[0].num_classes)
      self.class_map = ClassMap(self.head_ids, tail)
      self.head = head_layer(self.head_ids, self.components[0], self.head_bias_initializer,
                             f"{self.name}_head", inits, scored_by_op=self.head_rank is None)
    self._declared_classes = checked_num_classes(num_classes, self.num_classes, head)
    if not self.trainable:  # Keras set it before the components existed
      for component in self.components + ([self.head] if self.head is not None else []):
        component.trainable = False
    self.supports_masking = True

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
    dim = int(dim)
    if self.head is not None:
      self._build_part(self.head, hidden_shape)
    tail_shape = tuple(hidden_shape[:-1]) + (self.tail_dim or dim,)
    for component in self.components:
      self._build_part(component, tail_shape)
    if self.head_rank is not None:
      # V draws, U starts at zero: every component's head starts as the shared one.
      self.head_correction_in = self.add_weight(
          name="head_correction_in", shape=(dim, len(self.components) * self.head_rank),
          initializer=self.head_correction_initializer, **self._NO_CAST)
      self.head_correction_out = self.add_weight(
          name="head_correction_out",
          shape=(len(self.components), self.head_rank, len(self.head_ids) + 1),
          initializer="zeros", **self._NO_CAST)
    if self.tail_dim is not None:
      self.tail_projection = self.add_weight(
          name="tail_projection", shape=(dim, self.tail_dim),
          initializer=self.tail_projection_initializer, **self._NO_CAST)
    self.gate_kernel = self.add_weight(name="gate_kernel", shape=(dim, len(self.components)),
                                       initializer=self.gate_initializer, **self._NO_CAST)
    self.gate_bias = self.add_weight(name="gate_bias", shape=(len(self.components),),
                                     initializer="zeros", **self._NO_CAST)
    self.built = True

  def _build_part(self, part, shape):
    part.build(shape)

  def _check_call(self, args, kwargs):
    """Refuses the other Keras' tensors, missing targets and targets not shaped as the
    hidden states' leading axes, before any part runs (with `head_rank` the shared
    head, whose call would check them, is not called)."""
    hsm.refuse_other_keras(self._KERAS, "HierarchicalSoftmaxMixture", (args, kwargs))
    wiring.check_call(self, args, kwargs)

  @staticmethod
  def tail_classes(head, num_classes):
    """The classes a mixture with `head` leaves to its trees, increasing: the `classes`
    to build its tail trees over (`Tree.from_context(..., classes=tail)`)."""
    return tail_classes(head, num_classes)

  def compute_mask(self, *unused_args, **unused_kwargs):
    # `call` attaches the real mask (it depends on the targets) to its output.
    return None

  def log_prob_all(self, hidden, **kwargs):
    """log P(c | hidden) for every class c: `[..., num_classes]` (each component's
    `log_prob_all`, keyword arguments passed on, mixed by the gate)."""
    return log_prob_all(self, hidden, **kwargs)

  def top_k(self, hidden, k, exclude=None):
    """The k most probable classes: (log_probs, classes), each `[..., k]`, from
    `log_prob_all`, leaving out `ignore_class` and `exclude` (class ids `[..., n]` per
    row, as `tf_hsm.inference.top_k`'s; ids < 0 exclude nothing). Where fewer than k
    classes are left, the last are class -1 at -inf, as the component's."""
    return top_k(self, hidden, k, exclude)

  def sample(self, hidden, seed=None, temperature=1.0):
    """Draws one class per hidden state, int64 `[...]`: a component from the gate, then
    a class from that component's tree (its `sample`), which is exact ancestral
    sampling of the mixture. With temperature T the gate's logits and every node's are
    divided by T: the mixture whose weights and biases are divided by T, as a
    component's temperature is. `seed`: an int (scalar) from which the gate's draw and
    each component's seed are derived (through Philox: seeds s and s + 1 share no
    component's stream), or None for fresh draws. A row whose gate logits are not all
    finite (NaN or infinite hidden states) gets -1, as a component's row without a
    distribution does."""
    return sample(self, hidden, seed, temperature)

  def get_config(self):
    config = super().get_config()
    serialize = self._INITIALIZERS.serialize
    config.update({
        "components": [c.get_config() for c in self.components],
        "gate_initializer": serialize(self.gate_initializer),
        "head": None if self.head_ids is None else self.head_ids.tolist(),
        "head_bias_initializer": serialize(self.head_bias_initializer),
        "ignore_class": self._ignore_class,
    })
    if self._declared_classes is not None:  # likewise
      config["num_classes"] = self._declared_classes
    if self.head_rank is not None:  # likewise
      config["head_rank"] = self.head_rank
    if self.tail_dim is not None:  # written only where set: older configs load as before
      config.update({"tail_dim": self.tail_dim,
                     "tail_projection_initializer": serialize(
                         self.tail_projection_initializer)})
    return config


# ------------------------------------------------------------------ the arguments


def check_dense(what, *tensors):
  hsm.refuse_ragged(*tensors, who=f"HierarchicalSoftmaxMixture.{what} takes")


def check_built(layer, what):
  if not layer.built:
    raise ValueError(f"HierarchicalSoftmaxMixture.{what} needs a built layer: call it "
                     "on data (or call build(hidden_shape)) first")


def checked_ignore_class(ignore_class, head, components):
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


def checked_num_classes(num_classes, made, head):
  """The num_classes a user gave (or None), checked against the classes the parts make:
  trees over all the classes below a head would make a layer of num_classes + len(head)
  classes, their class j silently the tail's j-th."""
  if num_classes is None:
    return None
  if isinstance(num_classes, bool) or not isinstance(num_classes, (int, np.integer)):
    raise TypeError(f"num_classes must be an int, got {num_classes!r}")
  if num_classes != made:
    if head is None:
      raise ValueError(f"num_classes = {num_classes}, but the trees are over {made} classes")
    raise ValueError(
        f"num_classes = {num_classes}, but the head's {len(head)} classes and trees over "
        f"{made - len(head)} make {made}: below a head the trees are over the other "
        "classes alone (Tree.from_context(..., classes=HierarchicalSoftmaxMixture"
        ".tail_classes(head, num_classes)))")
  return int(num_classes)


_COMPONENT_ARGUMENTS = frozenset([
    "fused_update", "row_layout", "use_bias", "kernel_initializer", "bias_initializer",
    "kernel_regularizer", "bias_regularizer", "kernel_constraint", "bias_constraint"])


def refuse_component_arguments(kwargs, keras_name):
  """ValueError for a tree layer's own arguments given to the mixture (Keras would name
  them only as unrecognized): they go to each component (`keras_name`: "keras" or
  "tf_keras", whose HierarchicalSoftmax has no fused_update)."""
  given = sorted(_COMPONENT_ARGUMENTS & set(kwargs))
  if not given:
    return
  if "fused_update" in given and keras_name == "tf_keras":
    raise ValueError("fused_update is Keras 3's (tf_hsm.keras.HierarchicalSoftmax) and "
                     "each tree's own; tf_keras' layers have none")
  verb = "is" if len(given) == 1 else "are"
  # A row_layout is of one tree's slots: one passed to every tree (as build() would) fits
  # none but its own.
  planned = "" if "row_layout" in given else " (plan(...).layer.build() passes it so)"
  raise ValueError(
      f"{', '.join(given)} {verb} each tree's own: give the mixture HierarchicalSoftmax "
      f"layers made with it, e.g. components=[HierarchicalSoftmax(tree, "
      f"{given[0]}=...) for tree in trees]{planned}")


def checked_tail_dim(tail_dim, head):
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


def checked_head_rank(head_rank, head):
  """`head_rank` as an int, or None; TypeError/ValueError where it cannot be."""
  if head_rank is None:
    return None
  if isinstance(head_rank, bool) or not isinstance(head_rank, (int, np.integer)):
    raise TypeError(f"head_rank must be a positive int (the rank of each component's "
                    f"correction of the shared head), got {head_rank!r}")
  if head_rank < 1:
    raise ValueError(f"head_rank must be a positive int (the rank of each component's "
                     f"correction of the shared head), got {head_rank}")
  if head is None:
    raise ValueError("head_rank needs a head: it corrects the shared head once per "
                     "component")
  return int(head_rank)


def checked_components(components, name, dtype_policy, layer_class, keras_name):
  """The components as unbuilt `layer_class` (the Keras' HierarchicalSoftmax, named
  `keras_name` in errors) layers over one set of classes."""
  if isinstance(components, (Tree, dict, layer_class)) or not hasattr(components, "__len__"):
    raise TypeError("components must be a list of two or more Trees or HierarchicalSoftmax "
                    f"layers, got {type(components).__name__}")
  if len(components) < 2:
    raise ValueError(f"a mixture needs two or more components, got {len(components)}")
  layers = []
  for index, component in enumerate(components):
    if isinstance(component, dict) and "tree" in component:
      component = layer_class.from_config(component)
    elif isinstance(component, (Tree, dict)):
      component = layer_class(component, name=f"{name}_tree_{index}", dtype=dtype_policy)
    if not isinstance(component, layer_class):
      raise TypeError(f"components[{index}] must be a Tree or a HierarchicalSoftmax "
                      f"({keras_name}), got {type(component).__name__}")
    if component.built:
      raise ValueError(f"components[{index}] is built already: give the mixture unbuilt "
                       "layers (it builds them on its hidden states)")
    if any(component is other for other in layers):
      raise ValueError(f"components[{index}] is components[{layers.index(component)}] "
                       "again: each component is a layer of its own")
    layers.append(component)
  _check_alike(layers, dtype_policy)
  return layers


def _check_alike(layers, dtype_policy):
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
    raise ValueError("the components must share one ignore_class, got "
                     f"{sorted(ignored, key=str)}")


# ------------------------------------------------------------------ the computations


def gate_logits(layer, hidden):
  """G hidden + g, `[..., K]`, in the tables' dtype."""
  hidden = hsm.hidden_in(hidden, layer.gate_kernel.dtype)
  return tf.tensordot(hidden, layer.gate_kernel, 1) + layer.gate_bias


def log_gate(layer, hidden):
  """log pi(hidden), `[..., K]`, in the tables' dtype."""
  return tf.nn.log_softmax(gate_logits(layer, hidden), axis=-1)


def tail_input(layer, hidden):
  """What the trees score: `hidden`, or its projection with `tail_dim`."""
  if layer.tail_dim is None:
    return hidden
  return tf.tensordot(hsm.hidden_in(hidden, layer.tail_projection.dtype),
                      layer.tail_projection, 1)


def log_probs(layer, hidden, targets, masks, training):
  """The layer's output, with its Keras mask and source attached (`hsm.log_probs`')."""
  check_dense("call", hidden, targets)
  mask = hsm.combined_mask(masks)
  if layer.head is not None:
    out, valid = _headed_call(layer, hidden, targets, mask, training)
  else:
    parts = [c(hidden, targets, mask=mask, training=training) for c in layer.components]
    valid = parts[0]._keras_mask  # pylint: disable=protected-access
    mixed = tf.reduce_logsumexp(tf.stack(parts, -1) + log_gate(layer, hidden), -1)
    out = tf.where(valid, mixed, tf.zeros_like(mixed))
  out._keras_mask = valid  # how Keras attaches a mask to a tensor (masking guide)
  hsm.attach_source(out, layer, hidden, targets)  # for TopKAccuracy in compile
  return out


def _headed_call(layer, hidden, targets, mask, training):
  """(log P(targets), valid) with the shared head: the head's softmax for every
  token, the trees and the gate for the tail's tokens only, gathered (no tree walks a
  path, nor names a row in its gradient, for a head or padded token)."""
  targets = tf.convert_to_tensor(targets)
  if not targets.dtype.is_integer:
    raise TypeError(f"targets must be integer class ids, got {targets.dtype.name}")
  targets = tf.cast(targets, tf.int64)
  valid = hsm.combined_mask((mask,), targets >= 0)
  if layer.ignore_class is not None:
    valid = tf.logical_and(valid, targets != layer.ignore_class)
  in_range = tf.debugging.assert_less(
      tf.where(valid, targets, tf.zeros_like(targets)),
      tf.constant(layer.num_classes, tf.int64),
      message=f"targets must be < num_classes = {layer.num_classes}")
  hidden = tf.convert_to_tensor(hidden)
  # The static check (`_check_call`) cannot see dimensions unknown until run time; the
  # flattened gathers below would pair the wrong hidden states with the targets.
  leading, shape = tf.shape(hidden, out_type=tf.int64)[:-1], tf.shape(targets, tf.int64)
  same = tf.cond(tf.equal(tf.size(leading), tf.size(shape)),  # the ranks, then the sizes
                 lambda: tf.reduce_all(tf.equal(leading, shape)), lambda: tf.constant(False))
  same_shape = tf.debugging.Assert(same, [
      "HierarchicalSoftmaxMixture: targets must have hidden's shape without its last "
      "axis (one class id per hidden state); got hidden's leading shape", leading,
      "and targets'", shape])
  with tf.control_dependencies([in_range, same_shape]):  # before the class map's gather
    targets = tf.identity(targets)
  head_targets, tail_targets, in_tail = layer.class_map.split(targets, valid)
  flat_hidden = tf.reshape(hidden, [-1, tf.shape(hidden)[-1]])
  where = tf.where(tf.reshape(in_tail, [-1]))  # [n, 1]: the tail's tokens
  tail_hidden = tf.gather_nd(flat_hidden, where)
  scored = tail_input(layer, tail_hidden)
  parts = tf.stack([c(scored, tf.gather_nd(tf.reshape(tail_targets, [-1]), where),
                      training=training) for c in layer.components], -1)  # [n, K]
  if layer.head_rank is not None:
    out = _corrected_heads_call(layer, flat_hidden, head_targets, where, parts)
  else:
    head = layer.head(hidden, head_targets, training=training)
    mixed = tf.reduce_logsumexp(parts + log_gate(layer, tail_hidden), -1)
    mixed = tf.reshape(tf.scatter_nd(where, mixed,
                                     tf.size(in_tail, out_type=tf.int64)[None]),
                       tf.shape(in_tail))
    out = head + tf.cast(mixed, head.dtype)
  return tf.where(valid, out, tf.zeros_like(out)), valid


def _corrected_heads_call(layer, flat, head_targets, where, parts):
  """log sum_k pi_k P_head,k(slot) P_k(c) (the last factor 1 for a head class) of every
  token (`flat`: the hidden states as [N, D]), from the tail tokens' tree
  log-probabilities `parts` [n, K] at `where`."""
  count = len(layer.components)
  full = _corrected_head_logits(layer, flat)  # [K, N, S]
  slots = tf.broadcast_to(tf.reshape(tf.maximum(head_targets, 0), [1, -1]),
                          tf.shape(full)[:2])
  # The slot's logit read from the logits the log-sum-exp sums (never above it).
  at_slot = tf.gather(full, slots, axis=2, batch_dims=2)
  heads = tf.transpose(at_slot - tf.reduce_logsumexp(full, -1))  # [N, K]
  tails = tf.scatter_nd(where, tf.cast(parts, heads.dtype),
                        tf.stack([tf.shape(flat, out_type=tf.int64)[0], count]))
  out = tf.reduce_logsumexp(log_gate(layer, flat) + heads + tails, -1)
  return tf.reshape(out, tf.shape(head_targets))


def _corrected_head_logits(layer, hidden):
  """Each component's head logits W h + b + U_k (V_k h), `[K, N, S]`, of 2-D `hidden`,
  in the tables' dtype."""
  head = layer.head
  hidden = hsm.hidden_in(hidden, head.kernel.dtype)
  shared = tf.matmul(hidden, head.kernel, transpose_b=True)
  if head.bias is not None:
    shared += head.bias
  low = tf.reshape(tf.matmul(hidden, layer.head_correction_in),
                   [-1, len(layer.components), layer.head_rank])
  # K-major: one batched product with U [K, r, S] (an einsum over [N, K, r] ran 8-10x
  # slower on the CPU).
  return tf.expand_dims(shared, 0) + tf.matmul(tf.transpose(low, [1, 0, 2]),
                                               layer.head_correction_out)


def _corrected_head_log_probs(layer, hidden):
  """log P_head,k(s | hidden) for each component k and head slot s, `[..., K, H + 1]`:
  the shared head's logits plus component k's rank-r correction U_k (V_k hidden), as
  a softmax."""
  hidden = tf.convert_to_tensor(hidden)
  logits = _corrected_head_logits(layer, tf.reshape(hidden, [-1, tf.shape(hidden)[-1]]))
  heads = tf.transpose(tf.nn.log_softmax(logits, -1), [1, 0, 2])  # [N, K, S]
  return tf.reshape(heads, tf.concat([tf.shape(hidden)[:-1], tf.shape(heads)[1:]], 0))


def log_prob_all(layer, hidden, **kwargs):
  """log P(c | hidden) for every class c: `[..., num_classes]` (each component's
  `log_prob_all`, keyword arguments passed on, mixed by the gate)."""
  check_built(layer, "log_prob_all")
  check_dense("log_prob_all", hidden)
  if layer.head is not None and kwargs:
    raise ValueError(f"HierarchicalSoftmaxMixture.log_prob_all with a head takes no "
                     f"{', '.join(sorted(kwargs))}: the head's slots and the trees' "
                     "classes are not one range of ids")
  scored = tail_input(layer, hidden)
  if layer.head_rank is not None:
    return _corrected_heads_log_prob_all(layer, hidden, scored)
  parts = tf.stack([c.log_prob_all(scored, **kwargs) for c in layer.components], -1)
  mixed = tf.reduce_logsumexp(parts + log_gate(layer, hidden)[..., None, :], -1)
  if layer.head is None:
    return mixed
  return layer.class_map.assemble(layer.head.log_prob_all(hidden, **kwargs), mixed)


def _corrected_heads_log_prob_all(layer, hidden, scored):
  """`log_prob_all` with `head_rank`: each component's head and tree joined in class
  order, then mixed by the gate."""
  heads = _corrected_head_log_probs(layer, hidden)  # [..., K, H + 1]
  joined = tf.stack([layer.class_map.assemble(heads[..., k, :],
                                              tf.cast(c.log_prob_all(scored), heads.dtype))
                     for k, c in enumerate(layer.components)], -1)  # [..., V, K]
  return tf.reduce_logsumexp(joined + tf.expand_dims(log_gate(layer, hidden), -2), -1)


def top_k(layer, hidden, k, exclude=None):
  """The k most probable classes: (log_probs, classes), each `[..., k]`, from
  `log_prob_all`, leaving out `ignore_class` and `exclude` (class ids `[..., n]` per
  row, as `tf_hsm.inference.top_k`'s; ids < 0 exclude nothing). Where fewer than k
  classes are left, the last are class -1 at -inf, as the component's; a row with a NaN
  log-probability has no ranking: classes -1, log-probabilities NaN (as the export's)."""
  check_built(layer, "top_k")
  check_dense("top_k", hidden)
  inference.check_k(k, layer.num_classes)
  log_probs_all = log_prob_all(layer, hidden)
  left_out = hsm.with_ignored(exclude, layer.ignore_class, hidden, known_n=False)
  if left_out is not None:
    log_probs_all = _excluded(log_probs_all, left_out, layer.num_classes)
  values, classes = tf.math.top_k(log_probs_all, k)
  classes = tf.where(tf.math.is_inf(values), tf.constant(-1, classes.dtype), classes)
  # tf.math.top_k ranks NaN anywhere (an excluded -inf first, seen): no ranking there.
  unranked = tf.reduce_any(tf.math.is_nan(log_probs_all), -1, keepdims=True)
  values = tf.where(unranked, tf.constant(np.nan, values.dtype), values)
  classes = tf.where(unranked, tf.constant(-1, classes.dtype), classes)
  return values, tf.cast(classes, tf.int64)


def _excluded(log_probs_all, left_out, num_classes):
  """`log_probs_all` [..., V] with -inf at each row's ids of `left_out` ([..., n], a
  dimension of 1 for every row along it; ids < 0 leave nothing out), scattered into
  the rows: no [..., n, V] tensor."""
  left_out = inference.below_num_classes(
      tf.cast(tf.convert_to_tensor(left_out), tf.int64), num_classes)
  rows = tf.reshape(log_probs_all, [-1, num_classes])
  ids = tf.reshape(tf.broadcast_to(left_out, tf.concat(
      [tf.shape(log_probs_all, out_type=tf.int64)[:-1],
       tf.shape(left_out, out_type=tf.int64)[-1:]], 0)), [tf.shape(rows)[0], -1])
  row = tf.broadcast_to(tf.range(tf.shape(ids, out_type=tf.int64)[0])[:, None],
                        tf.shape(ids))
  keep = ids >= 0
  where = tf.stack([row[keep], ids[keep]], -1)
  rows = tf.tensor_scatter_nd_update(
      rows, where, tf.fill(tf.shape(where)[:1], tf.constant(-float("inf"), rows.dtype)))
  return tf.reshape(rows, tf.shape(log_probs_all))


def _part_seed(seed, part):
  """A part's seed from (seed, part) through Philox: seeds s and s + 1 share no part's
  stream (component k: part k; the gate -1, the head -2)."""
  return tf.random.stateless_uniform([], tf.stack([seed, tf.constant(part, tf.int64)]),
                                     minval=None, maxval=None, dtype=tf.int64)


def sample(layer, hidden, seed=None, temperature=1.0):
  """Draws one class per hidden state, int64 `[...]`: a component from the gate, then
  a class from that component's tree (its `sample`), which is exact ancestral
  sampling of the mixture (see the layers' `sample`)."""
  check_built(layer, "sample")
  check_dense("sample", hidden)
  count = len(layer.components)
  seed = inference.seed_tensor(seed)  # None: one drawn, as the component's
  # Each component checks the temperature (and draws its class) first.
  scored = tail_input(layer, hidden)
  draws = tf.stack([c.sample(scored, seed=_part_seed(seed, k), temperature=temperature)
                    for k, c in enumerate(layer.components)], -1)
  logits = gate_logits(layer, hidden)
  # A row without a distribution (a NaN or infinite gate logit) gets -1, as a
  # component's; the largest logit subtracted first, so a small T cannot overflow.
  defined = tf.reduce_all(tf.math.is_finite(logits), -1)
  logits = (logits - tf.reduce_max(logits, -1, keepdims=True)) / tf.cast(temperature,
                                                                        logits.dtype)
  rows = tf.reshape(tf.where(defined[..., None], logits, tf.zeros_like(logits)),
                    [-1, count])
  chosen = tf.random.stateless_categorical(rows, 1,
                                           tf.stack([seed, tf.constant(-1, tf.int64)]))
  chosen = tf.reshape(chosen, tf.shape(logits)[:-1])
  drawn = tf.reduce_sum(draws * tf.one_hot(chosen, count, dtype=tf.int64), -1)
  drawn = tf.where(defined, drawn, tf.constant(-1, tf.int64))
  if layer.head is None:
    return drawn
  # The head's slot first (its own seed): the tail's draw where it is the tail slot.
  if layer.head_rank is None:
    slot = layer.head.sample(hidden, seed=_part_seed(seed, -2), temperature=temperature)
  else:  # from the chosen component's own head
    slot = _corrected_head_sample(layer, hidden, chosen, _part_seed(seed, -2), temperature)
  return layer.class_map.classes(slot, drawn)


def _corrected_head_sample(layer, hidden, chosen, seed, temperature):
  """A head slot of each row from the head of its `chosen` component, at `temperature`
  (int64 `[...]`): its logits less their largest, divided by the temperature (a small
  one cannot overflow); -1 where a logit is NaN or +inf or all are -inf (a -inf logit
  alone only masks its slot, as a node's in `tf_hsm.sample`)."""
  logits = _corrected_head_logits(layer, tf.reshape(hidden, [-1, tf.shape(hidden)[-1]]))
  rows = tf.gather(tf.transpose(logits, [1, 0, 2]), tf.reshape(chosen, [-1]), axis=1,
                   batch_dims=1)  # [N, S]
  top = tf.reduce_max(rows, -1, keepdims=True)
  bad = tf.logical_or(tf.math.is_nan(rows), tf.equal(rows, float("inf")))
  defined = tf.logical_and(tf.logical_not(tf.reduce_any(bad, -1)),
                           tf.math.is_finite(top[:, 0]))
  shifted = (rows - tf.where(defined[:, None], top, tf.zeros_like(top))) / tf.cast(
      temperature, rows.dtype)
  slots = tf.random.stateless_categorical(
      tf.where(defined[:, None], shifted, tf.zeros_like(shifted)), 1,
      tf.stack([seed, tf.constant(0, tf.int64)]))[:, 0]
  slots = tf.where(defined, slots, tf.constant(-1, tf.int64))
  return tf.reshape(slots, tf.shape(chosen))
