"""Where a table's rows are stored when the table is split into equal row ranges.

A tree's slots come in node blocks (a node's children), numbered breadth-first: the root
and the frequent classes' nodes, touched by almost every step, come first, so the first
row range of a table split by TensorFlow's partitioners serves most of every step's
reads and updates. A row layout stores the blocks in another order (each block stays
contiguous, so a node's children are still one run of rows) such that equal row ranges
carry about equal expected traffic: the number of distinct rows a step of T tokens
touches in each range. The tree, and the probabilities it defines, are unchanged; only
the row where each slot is stored moves.

A block's rows are touched together: when a step's tokens visit node n, every child of
n is read and gets a gradient row. With p(n) the probability that a token visits n (the
class probabilities of n's subtree), a step of T independent tokens touches n's block
with probability 1 - (1 - p(n))^T.
"""

import numpy as np


def class_probabilities(num_classes, counts):
  """Normalised class frequencies (uniform without counts)."""
  if counts is None:
    return np.full(num_classes, 1.0 / num_classes)
  counts = np.asarray(counts, np.float64)
  if counts.shape != (num_classes,):
    raise ValueError(f"counts must have one entry per class ({num_classes}), got shape "
                     f"{counts.shape}")
  if not np.all(np.isfinite(counts)) or np.any(counts < 0) or counts.sum() <= 0:
    raise ValueError("counts must be finite, non-negative and not all zero")
  return counts / counts.sum()


def node_probabilities(tree, class_probs):
  """p(n): the probability that a token's path visits internal node n."""
  lengths = np.diff(tree.path_begin)
  weights = np.repeat(class_probs, lengths)
  return np.bincount(tree.path_nodes, weights=weights, minlength=tree.num_nodes)


def block_touch_probabilities(tree, counts, tokens_per_step):
  """The probability that a step of `tokens_per_step` tokens touches each node's block."""
  if not isinstance(tokens_per_step, (int, np.integer)) or tokens_per_step < 1:
    raise ValueError(f"tokens_per_step must be a positive int, got {tokens_per_step!r}")
  return touch_probability(
      node_probabilities(tree, class_probabilities(tree.num_classes, counts)),
      tokens_per_step)


def touch_probability(p, draws):
  """1 - (1 - p)^draws, elementwise: the probability that an event of probability p
  happens at least once in `draws` independent draws."""
  p = np.clip(p, 0.0, 1.0 - 1e-16)
  return -np.expm1(draws * np.log1p(-p))


def equal_ranges(num_rows, num_shards):
  """Row offsets of `num_shards` equal ranges as TensorFlow's partitioners cut them (the
  first `num_rows % num_shards` ranges one row longer)."""
  if not isinstance(num_shards, (int, np.integer)) or not 1 <= num_shards <= num_rows:
    raise ValueError(f"num_shards must be an int in [1, {num_rows}], got {num_shards!r}")
  base, extra = divmod(num_rows, num_shards)
  sizes = [base + (1 if i < extra else 0) for i in range(num_shards)]
  return np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)


def balanced_block_order(block_sizes, block_loads, offsets):
  """An order of the blocks such that the equal row ranges `offsets` get about equal
  load: blocks by decreasing load, each into the range with the least load so far that
  still has room for it (or, where none has, the one with the most room left; the
  block then runs over into the next range). Deterministic: ties go to the lower
  range and the lower block id."""
  num_shards = len(offsets) - 1
  room = np.diff(offsets).astype(np.int64)
  load = np.zeros(num_shards)
  members = [[] for _ in range(num_shards)]
  for block in np.lexsort((np.arange(len(block_sizes)), -block_loads)):
    size = block_sizes[block]
    fits = np.flatnonzero(room >= size)
    if fits.size:
      target = fits[np.argmin(load[fits])]
    else:
      target = int(np.argmax(room))
    members[target].append(block)
    room[target] -= size
    load[target] += block_loads[block]
  # Within a range, the heaviest blocks in the middle, away from its edges, so that a
  # block running over from the previous range moves light rows, not heavy ones.
  order = []
  for blocks in members:
    by_load = sorted(blocks, key=lambda b: (-block_loads[b], b))
    order.extend(by_load[1::2][::-1] + by_load[0::2])
  return np.asarray(order, np.int64)


def slot_rows_of_order(tree, order):
  """slot_rows[s]: the table row that stores slot s when node blocks are stored in
  `order` (node ids)."""
  begin = tree.child_begin[:-1]
  sizes = np.diff(tree.child_begin)
  new_begin = np.zeros(tree.num_nodes, np.int64)
  new_begin[order] = np.concatenate([[0], np.cumsum(sizes[order])[:-1]])
  slot_rows = np.empty(tree.num_slots, np.int64)
  for_slot = np.repeat(np.arange(tree.num_nodes), sizes)
  slot_rows[:] = new_begin[for_slot] + np.arange(tree.num_slots) - begin[for_slot]
  return slot_rows


def balanced_slot_rows(tree, counts, num_shards, tokens_per_step):
  """slot_rows for `num_shards` equal row ranges and steps of `tokens_per_step` tokens."""
  touch = block_touch_probabilities(tree, counts, tokens_per_step)
  sizes = np.diff(tree.child_begin)
  offsets = equal_ranges(tree.num_slots, num_shards)
  order = balanced_block_order(sizes, sizes * touch, offsets)
  return slot_rows_of_order(tree, order)


def rows_touched_per_shard(tree, slot_rows, num_shards, targets):
  """The distinct table rows each of `num_shards` equal row ranges serves for a batch
  of `targets`: the rows it sends (the children of every node on the batch's paths) and
  the gradient rows it receives and updates (the same rows: every child of a visited
  node gets a gradient)."""
  classes = np.unique(np.asarray(targets).ravel())
  steps = np.concatenate([np.arange(tree.path_begin[c], tree.path_begin[c + 1])
                          for c in classes]) if classes.size else np.zeros(0, np.int64)
  nodes = np.unique(tree.path_nodes[steps])
  sizes = np.diff(tree.child_begin)[nodes]
  first = tree.child_begin[nodes]
  slots = np.repeat(first - np.concatenate([[0], np.cumsum(sizes)[:-1]]), sizes) + \
      np.arange(sizes.sum())
  rows = slot_rows[slots] if slot_rows is not None else slots
  offsets = equal_ranges(tree.num_slots, num_shards)
  return np.diff(np.searchsorted(np.sort(rows), offsets))
