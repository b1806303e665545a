"""The tree arrays the stock-op functions read, as int32 tensors made once per tree.

Only the `Tree`'s public NumPy attributes are read (`num_classes`, `child_begin`,
`slot_child`, `slot_node`, `node_slot`, `class_slot`, `node_depth`, `max_depth`,
`max_branching`): nothing here imports tf_hsm or loads its op library.
"""

import numpy as np
import tensorflow as tf

_INT32_MAX = 2**31 - 1


class StockTree:
  """A tree's arrays as int32 constants (eager tensors, so that every function that
  uses them captures the same tensors, and a SavedModel stores each array once).

  Attributes:
    num_classes, num_nodes, num_slots, max_depth, max_branching: Python ints.
    level_bounds: Python list; the internal nodes of depth d are
      ``level_bounds[d] .. level_bounds[d + 1] - 1`` (breadth-first numbering).
    child_begin [M+1], slot_child [S], slot_node [S], node_slot [M] (root: -1),
    node_parent [M] (root: 0), class_slot [C]: int32 tensors.
  """

  def __init__(self, tree):
    c = int(tree.num_classes)
    child_begin = np.asarray(tree.child_begin)
    slot_child = np.asarray(tree.slot_child)
    slot_node = np.asarray(tree.slot_node)
    node_slot = np.asarray(tree.node_slot)
    class_slot = np.asarray(tree.class_slot)
    node_depth = np.asarray(tree.node_depth)
    m, s = child_begin.size - 1, slot_child.size
    if c + m > _INT32_MAX:
      raise ValueError(f"a tree of {c} classes and {m} nodes does not fit int32 codes")
    self.num_classes, self.num_nodes, self.num_slots = c, m, s
    self.max_depth = int(tree.max_depth)
    self.max_branching = int(tree.max_branching)
    # Breadth-first numbering: node depths never decrease with the node number.
    self.level_bounds = np.searchsorted(node_depth, np.arange(int(node_depth.max()) + 2),
                                        side="left").tolist()
    parent = np.where(node_slot >= 0, slot_node[np.maximum(node_slot, 0)], 0)
    with tf.init_scope():
      def const(array):
        return tf.constant(np.asarray(array, np.int32))
      self.child_begin = const(child_begin)
      self.slot_child = const(slot_child)
      self.slot_node = const(slot_node)
      self.node_slot = const(node_slot)
      self.node_parent = const(parent)
      self.class_slot = const(class_slot)
      # The parent node of each class, for log_prob_all.
      self.class_node = const(slot_node[class_slot])
      self.level_nodes = [const(np.arange(a, b)) for a, b in
                          zip(self.level_bounds[1:-1], self.level_bounds[2:])]
      self.level_slots = [const(node_slot[a:b]) for a, b in
                          zip(self.level_bounds[1:-1], self.level_bounds[2:])]
      self.level_parents = [const(parent[a:b]) for a, b in
                            zip(self.level_bounds[1:-1], self.level_bounds[2:])]
      # For log_prob: per slot, with one more entry (index S) for "above the root": the
      # parent node's slot (root: S), and the first slot and child count of the slot's
      # node (S: 0 children), so that each step up a path is one gather.
      count = np.diff(child_begin)
      self.slot_up = const(np.append(np.where(node_slot[slot_node] >= 0,
                                              node_slot[slot_node], s), s))
      self.slot_begin = const(np.append(child_begin[slot_node], 0))
      self.slot_count = const(np.append(count[slot_node], 0))
    self._arrays = (child_begin, slot_child, slot_node, node_slot)
    self._prefixes = {}

  def search_prefix(self, max_slots):
    """The `SearchPrefix` of the top levels whose slots number at most max_slots (at
    least the root's level), made once per budget."""
    max_slots = int(max_slots)
    if max_slots not in self._prefixes:
      self._prefixes[max_slots] = SearchPrefix(self, max_slots)
    return self._prefixes[max_slots]


class SearchPrefix:
  """The top levels of a tree that top_k's best-first search scores in one matmul.

  Attributes:
    depth: the internal nodes of depth < depth are expanded densely (depth >= 1).
    num_nodes, num_slots: the nodes of depth < depth, and their slots ``0..num_slots-1``.
    slot_node [num_slots]: int32 segment ids. level_slots / level_parents: per depth
      1..depth-1, the slots of that depth's nodes and their parents (the sweep down).
    class_slots [P] / classes [P]: the prefix's slots whose child is a class, in
      increasing class order; node_slots [Q] / nodes [Q]: those whose child is a node
      (of depth `depth`): the frontier the search starts from.
    branching: the most children of any node of depth >= depth (0: none).
    complete: True when the prefix holds every internal node.
  """

  def __init__(self, stock, max_slots):
    child_begin, slot_child, slot_node, node_slot = stock._arrays  # pylint: disable=protected-access
    c = stock.num_classes
    bounds = stock.level_bounds
    depth = 1
    while depth + 1 < len(bounds) and child_begin[bounds[depth + 1]] <= max_slots:
      depth += 1
    n0 = bounds[depth]
    s0 = int(child_begin[n0])
    self.depth, self.num_nodes, self.num_slots = depth, n0, s0
    self.complete = n0 == stock.num_nodes
    self.branching = 0 if self.complete else int(np.diff(child_begin)[n0:].max())
    child = slot_child[:s0]
    is_class = child < c
    class_slots = np.flatnonzero(is_class)
    class_slots = class_slots[np.argsort(child[class_slots], kind="stable")]
    node_slots = np.flatnonzero(child >= c + n0)   # nodes of depth `depth`
    parent = slot_node[np.maximum(node_slot, 0)]
    with tf.init_scope():
      def const(array):
        return tf.constant(np.asarray(array, np.int32))
      self.slot_node = const(slot_node[:s0])
      self.class_slots = const(class_slots)
      self.classes = const(child[class_slots])
      self.node_slots = const(node_slots)
      self.nodes = const(child[node_slots] - c)
      self.level_slots = [const(node_slot[bounds[d]:bounds[d + 1]]) for d in range(1, depth)]
      self.level_parents = [const(parent[bounds[d]:bounds[d + 1]]) for d in range(1, depth)]


def stock_tree(tree):
  """The `StockTree` of `tree` (a `tf_hsm.Tree`, or a `StockTree` returned as is),
  made once and kept on the tree object."""
  if isinstance(tree, StockTree):
    return tree
  for name in ("num_classes", "child_begin", "slot_child", "slot_node", "node_slot",
               "class_slot", "node_depth", "max_depth", "max_branching"):
    if not hasattr(tree, name):
      raise TypeError(f"tree must be a tf_hsm.Tree (or a StockTree), got "
                      f"{type(tree).__name__} without {name!r}")
  cached = tree.__dict__.get("_tf_hsm_stock_tree")
  if cached is None:
    cached = StockTree(tree)
    tree.__dict__["_tf_hsm_stock_tree"] = cached
  return cached
