"""What a tree costs a training step, independent of the machine: the children its
tokens' paths score, the rows they touch and the index bytes it holds (expected values
for a step of T tokens drawn from the class probabilities), and the terms
`Machine.tree_step` prices them by."""

import typing

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
                   "slot bytes moved", "node visits", "children scored", "step")


def tree_step_terms(flops, small_node_flops, bytes_moved, node_visits, children_scored,
                    slot_bytes_moved=0.0):
  """The amounts `Machine.tree_step` prices, one coefficient each (TREE_STEP_TERMS).

  `bytes_moved` is everything the step moves but the optimizer's slots, whose read and
  write (`slot_bytes_moved`, `tf_hsm.planning.costs.slot_elements`) have a coefficient of
  their own, fitted on steps updated by Adam (`step_fit.SHAPES`) rather than assumed to
  cost what the rest of an SGD step's bytes do: the fused row update streams them beside
  a row it already holds."""
  return (flops - small_node_flops, small_node_flops, bytes_moved, slot_bytes_moved,
          node_visits, children_scored, 1.0)


def full_tree_step(coefficients):
  """`coefficients` as one per TREE_STEP_TERMS: a fit of the terms before slot bytes had
  their own (6 coefficients) prices them at its bytes' rate, as it did."""
  if coefficients is None:
    return None
  try:
    coefficients = tuple(float(c) for c in coefficients)
  except (TypeError, ValueError):
    raise ValueError(f"tree_step must be numbers, one per {TREE_STEP_TERMS}, got "
                     f"{coefficients!r}") from None
  if len(coefficients) == len(TREE_STEP_TERMS) - 1:
    coefficients = coefficients[:3] + coefficients[2:3] + coefficients[3:]
  if len(coefficients) != len(TREE_STEP_TERMS):
    raise ValueError(f"tree_step needs {len(TREE_STEP_TERMS)} coefficients, one per "
                     f"{TREE_STEP_TERMS}, got {len(coefficients)}")
  return coefficients


def tree_bytes(tree):
  """Bytes of a tree's index arrays (int64: slots, nodes, classes and path steps), which
  the ops read in place: a deep tree over many classes holds a table's worth."""
  return float(sum(getattr(tree, name).nbytes for name in (
      "child_begin", "slot_child", "slot_node", "node_slot", "class_slot", "node_depth",
      "path_begin", "path_nodes", "path_slots", "_class_depth")))


def distinct(probs, draws):
  """Expected distinct classes among `draws` samples of `probs`."""
  return float(np.sum(shards.touch_probability(probs, draws)))



class TreeWork(typing.NamedTuple):
  """What `tree_costs` and `tree_bytes` give for one tree, without the tree: computed
  from a tree (`work_of_tree`), from its layout alone (`layout_work`: no paths) or, for
  a Huffman tree, from the builder's merges alone (`huffman_work`: no layout), which
  is how the planner prices a 10M-class tree in a second and a few hundred MB."""
  num_classes: int
  num_nodes: int
  per_token: float  # expected children scored a token: sum_n p(n) K(n)
  per_token_small: float  # ... in nodes of at most WALK_MAX_BRANCHING children
  rows: float  # expected distinct rows a step: sum_n K(n) (1 - (1 - p(n))^T)
  path_nodes: float  # expected nodes on a token's path: sum_n p(n)
  path_steps: int  # P: the length of all the classes' paths together

  @property
  def num_slots(self):
    return self.num_classes + self.num_nodes - 1

  @property
  def tree_bytes(self):
    """`tree_bytes` of the tree: its int64 arrays (child_begin M+1, slot_child and
    slot_node S each, node_slot and node_depth M each, class_slot and class depths C
    each, path_begin C+1, path_nodes and path_slots P each)."""
    C, M, S, P = self.num_classes, self.num_nodes, self.num_slots, self.path_steps
    return 8.0 * ((M + 1) + 2 * S + 2 * M + 2 * C + (C + 1) + 2 * P)


def _work(num_classes, node_p, sizes, path_steps, tokens):
  sizes = sizes.astype(np.float64)  # float64 dot products run in BLAS, mixed ones do not
  small = sizes <= WALK_MAX_BRANCHING
  per_token = float(np.dot(node_p, sizes))
  if small.all():
    per_token_small = per_token
  else:
    per_token_small = float(np.dot(node_p, np.where(small, sizes, 0.0)))
  return TreeWork(int(num_classes), int(sizes.size), per_token, per_token_small,
                  float(np.dot(sizes, shards.touch_probability(node_p, tokens))),
                  float(node_p.sum()), int(path_steps))


def work_of_tree(tree, probs, tokens):
  """The `TreeWork` of a built `Tree` (its paths: the reference the others match)."""
  node_p = shards.node_probabilities(tree, probs)
  return _work(tree.num_classes, node_p, np.diff(tree.child_begin),
               tree.path_nodes.size, tokens)


def layout_work(child_begin, slot_child, num_classes, probs, tokens):
  """The `TreeWork` of a BFS layout (`tf_hsm.tree.builders`' `(child_begin, slot_child,
  num_classes)`), without deriving its paths: node masses and class counts summed up
  the tree one level at a time (BFS numbers a level contiguously, parents first)."""
  child_begin = np.asarray(child_begin, np.int64)
  slot_child = np.asarray(slot_child, np.int64)
  C = int(num_classes)
  sizes = np.diff(child_begin)
  M = sizes.size
  slot_node = np.repeat(np.arange(M, dtype=np.int64), sizes)
  internal = slot_child >= C
  node_parent = slot_node[internal]  # of nodes 1..M-1, in order (BFS), non-decreasing
  class_node = slot_node[~internal]
  classes = slot_child[~internal]
  del slot_node
  node_p = np.bincount(class_node, weights=np.asarray(probs, np.float64)[classes],
                       minlength=M)
  below = np.bincount(class_node, minlength=M).astype(np.float64)  # classes under n
  del class_node, classes
  bounds = [0, 1]  # level d holds nodes bounds[d] .. bounds[d+1]-1
  while bounds[-1] < M:
    bounds.append(1 + int(np.searchsorted(node_parent, bounds[-1], side="left")))
  for lo, hi in reversed(list(zip(bounds[1:-1], bounds[2:]))):
    parents = node_parent[lo - 1:hi - 1]
    first = int(parents[0])
    node_p[first:lo] += np.bincount(parents - first, weights=node_p[lo:hi],
                                    minlength=lo - first)
    below[first:lo] += np.bincount(parents - first, weights=below[lo:hi],
                                   minlength=lo - first)
  return _work(C, node_p, sizes, round(float(below.sum())), tokens)


def _huffman_nodes(counts, branching, probs):
  """(classes, node probabilities, children per node, path steps) of
  `Tree.huffman(counts, branching)`, its nodes in merge order (the root last), from the
  merges alone.

  The builder's own merges (`tf_hsm.tree.builders.huffman_merges`: the same batches and
  ties, so the same tree), keeping each merged node's weight, its number of children
  and the number of classes below it instead of the nodes themselves: a node's
  probability is its weight's share, and the classes' path steps add up to the
  classes below every node. O(C) memory in a few arrays, no layout and no paths.
  """
  from tf_hsm.tree.builders import group_sums, huffman_merges  # NumPy only
  from tf_hsm.tree.checks import check_int, counts_array  # NumPy only
  k = check_int(branching, "branching", 2)
  w = counts_array(counts)
  n = w.size
  if n == 1:
    return 1, np.ones(1), np.ones(1, np.int64), 1
  # Sorted ascending (ties in any order: only weights are kept). Counts given by
  # decreasing frequency, as a vocabulary's usually are, need no sort.
  if n > 1 and np.all(w[1:] <= w[:-1]):
    leaf_w = w[::-1].copy()
  else:
    leaf_w = np.sort(w, kind="stable")
  del w
  first, merged_w, batches = huffman_merges(leaf_w, k)
  m = merged_w.size
  merged_n = np.empty(m, np.int64)  # classes below each merged node
  merged_n[0] = first
  for start, groups, is_leaf, index in batches:
    if is_leaf is True:
      sel_n = np.ones(groups * k, np.int64)
    elif is_leaf is False:
      sel_n = merged_n[index]
    else:
      sel_n = np.where(is_leaf, 1, merged_n[np.where(is_leaf, 0, index)])
    group_sums(sel_n, groups, k, merged_n[start:start + groups])
  total = float(np.sum(np.asarray(probs, np.float64)))
  weight = float(merged_w[-1])  # the root's: every class
  node_p = merged_w.astype(np.float64) * (total / weight) if weight > 0 else \
      merged_n / n * total
  sizes = np.full(m, k, np.int64)
  sizes[0] = first
  return n, node_p, sizes, int(merged_n.sum())


def huffman_work(counts, branching, probs, tokens):
  """The `TreeWork` of `Tree.huffman(counts, branching)`, from the merges alone
  (`_huffman_nodes`): O(C) memory in a few arrays, no layout and no paths."""
  n, node_p, sizes, steps = _huffman_nodes(counts, branching, probs)
  return _work(n, node_p, sizes, steps, tokens)


def vectors_work(counts, branching, head, probs, tokens):
  """The `TreeWork` the planner prices a tree from vectors at (`Tree.from_vectors(...,
  branching=K, head=H)`, whose splits balance mass as Huffman's merges do): the H most
  frequent classes as leaves of the root beside the root's children of the K-ary
  Huffman tree of the other classes (`candidates.vectors_layout` builds that layout).
  From the other classes' merges: the root is visited by every token and scores H more
  children; every other node is the Huffman tree's."""
  w = np.asarray(counts, np.float64)
  probs = np.asarray(probs, np.float64)
  v = w.size
  rest = np.ones(v, bool)
  if head:
    # The H largest counts, ties to the lower id (as the builders' stable sorts).
    top = np.argpartition(-w, head - 1)[:head] if head < v else np.arange(v)
    cut = w[top].min()
    above = np.flatnonzero(w > cut)
    tied = np.flatnonzero(w == cut)[:head - above.size]
    rest[above] = rest[tied] = False
  n, node_p, sizes, steps = _huffman_nodes(w[rest], branching, probs[rest])
  node_p, sizes = node_p.copy(), sizes.copy()
  node_p[-1] = float(probs.sum())
  sizes[-1] += v - n
  return _work(v, node_p, sizes, steps + (v - n), tokens)
