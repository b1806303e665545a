"""The shared head of `HierarchicalSoftmaxMixture(head=...)`: one exact softmax over the
frequent classes and a tail slot, ahead of the mixture of tail trees.

A mixture's trees each score their own root for every token: with the frequent classes
at each root (a head of 128 and 16 subtrees, say) the roots are most of each tree's
work, written N times. Shared, the head is scored once (an exact softmax over the head
classes and one slot for the rest, the product full softmax computes for them), and each
tail tree only for the tokens of the tail:

    P(c | h) = P_head(c | h)                                      c in the head
    P(c | h) = P_head(tail | h) sum_k pi_k(h) P_k(c | h)           c in the tail

normalised as each part is. The tail trees are over the tail classes in increasing id
order (`Tree.from_context(..., classes=tail)` builds them); this module maps class ids
to head slots and tail positions and back.
"""

import keras
import numpy as np
import tensorflow as tf

from tf_hsm.keras.layers import HierarchicalSoftmax
from tf_hsm.tree import Tree


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


def head_layer(head_ids, component, bias_initializer, name):
  """An unbuilt `HierarchicalSoftmax` over `Tree.flat(len(head) + 1)` (the last slot the
  tail), with the settings of `component` (kernel initializer, regularizers,
  constraints, use_bias, fused update, dtype) but its own biases."""
  config = component.get_config()
  # Its own name, tree and biases; trainable as the mixture is (which sets it after).
  for key in ("name", "tree", "row_layout", "ignore_class", "bias_initializer", "trainable"):
    config.pop(key, None)
  config["bias_initializer"] = keras.initializers.serialize(
      keras.initializers.get(bias_initializer))
  return HierarchicalSoftmax(Tree.flat(len(head_ids) + 1), name=name, **config)


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
    """(head targets, tail targets): the head slot of each valid target (the tail slot,
    len(head), for a tail class) and -1 elsewhere; each valid tail target's position
    among the tail classes and -1 elsewhere (no tail tree's work for them)."""
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
