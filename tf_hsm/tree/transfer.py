"""The weights a rebuilt tree starts from, NumPy only: the class rows carried over, each
internal node's row the mass-weighted mean of the rows beneath it, biases of the unigram
model. `HierarchicalSoftmax.rebuild_tree` (through `tf_hsm.frontend.rebuild`) and the
PyTorch quality runs (`tf_hsm.bench.quality_torch`) start a new tree from them."""

import numpy as np


def class_masses(counts, num_classes):
  """float64 class masses: the counts, a zero count taking half the smallest positive
  one (so that every class keeps a finite bias), all ones without counts or when all are
  zero."""
  if counts is None:
    return np.ones(num_classes)
  mass = np.asarray(counts, np.float64)
  positive = mass[mass > 0]
  if positive.size == 0:
    return np.ones(num_classes)
  return np.where(mass > 0, mass, 0.5 * positive.min())


def transferred_weights(tree, class_rows, mass):
  """(kernel [S, D] in the class rows' dtype, bias [S] float64) for `tree`: the class
  rows at their slots, each internal node's row the mass-weighted mean of the class rows
  beneath it, and the biases of the unigram model of `mass`.

  Internal nodes are numbered breadth first, so the nodes of one depth are consecutive
  and own one consecutive range of slots: summing level by level from the deepest,
  `np.add.reduceat` over that range gives every node of the level its sums at once.
  """
  c, m = tree.num_classes, tree.num_nodes
  dim = class_rows.shape[1]
  node_mass = np.zeros(m)
  node_sum = np.zeros((m, dim))
  depth = tree.node_depth
  child_begin, slot_child = tree.child_begin, tree.slot_child
  for level in range(int(depth.max()), -1, -1):
    nodes = np.flatnonzero(depth == level)
    first, stop = int(child_begin[nodes[0]]), int(child_begin[nodes[-1] + 1])
    children = slot_child[first:stop]
    is_class = children < c
    child_mass = np.empty(children.size)
    child_mass[is_class] = mass[children[is_class]]
    child_mass[~is_class] = node_mass[children[~is_class] - c]
    child_sum = np.empty((children.size, dim))
    leaves = children[is_class]
    child_sum[is_class] = class_rows[leaves] * mass[leaves, None]
    child_sum[~is_class] = node_sum[children[~is_class] - c]
    starts = child_begin[nodes] - first
    node_mass[nodes] = np.add.reduceat(child_mass, starts)
    node_sum[nodes] = np.add.reduceat(child_sum, starts, axis=0)
  kernel = np.empty((tree.num_slots, dim), class_rows.dtype)
  kernel[tree.class_slot] = class_rows
  kernel[tree.node_slot[1:]] = node_sum[1:] / node_mass[1:, None]
  child_mass = np.where(slot_child < c, mass[np.minimum(slot_child, c - 1)],
                        node_mass[np.maximum(slot_child - c, 0)])
  bias = np.log(child_mass) - np.log(node_mass[tree.slot_node])
  return kernel, bias
