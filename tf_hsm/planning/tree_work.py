"""What a tree costs a training step, independent of the machine: the children its
tokens' paths score, the rows they touch and the index bytes it holds (expected values
for a step of T tokens drawn from the class probabilities), and the terms
`Machine.tree_step` prices them by."""

import numpy as np

from tf_hsm.tree import shards

# Nodes of at most this many children go through the op's walked-node path (one fused
# loop of dot products and softmax a node; cc/core/visit_plan.h's kWalkMaxBranching),
# larger ones through its tiled logits: the two run at different rates.
WALK_MAX_BRANCHING = 8


def tree_costs(tree, probs, tokens):
  """(expected children scored per token, of which in nodes of at most
  WALK_MAX_BRANCHING children, expected distinct rows a step, expected nodes on a
  token's path)."""
  node_p = shards.node_probabilities(tree, probs)
  sizes = np.diff(tree.child_begin)
  per_token = float(np.dot(node_p, sizes))  # sum over path nodes of their children
  small = sizes <= WALK_MAX_BRANCHING
  per_token_small = float(np.dot(node_p[small], sizes[small]))
  rows = float(np.dot(sizes, shards.touch_probability(node_p, tokens)))
  return per_token, per_token_small, rows, float(node_p.sum())


TREE_STEP_TERMS = ("FLOPs in large nodes", "FLOPs in small nodes", "bytes moved",
                   "node visits", "children scored", "step")


def tree_step_terms(flops, small_node_flops, bytes_moved, node_visits, children_scored):
  """The amounts `Machine.tree_step` prices, one coefficient each (TREE_STEP_TERMS)."""
  return (flops - small_node_flops, small_node_flops, bytes_moved, node_visits,
          children_scored, 1.0)


def tree_bytes(tree):
  """Bytes of a tree's index arrays (int64: slots, nodes, classes and path steps), which
  the ops read in place: a deep tree over many classes holds a table's worth."""
  return float(sum(getattr(tree, name).nbytes for name in (
      "child_begin", "slot_child", "slot_node", "node_slot", "class_slot", "node_depth",
      "path_begin", "path_nodes", "path_slots", "_class_depth")))


def distinct(probs, draws):
  """Expected distinct classes among `draws` samples of `probs`."""
  return float(np.sum(shards.touch_probability(probs, draws)))

