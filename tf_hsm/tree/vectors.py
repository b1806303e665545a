"""Trees from class vectors: nodes that split the classes by similarity, with the classes'
probability mass balanced so that paths stay about as short as a Huffman tree's.

A node with classes S and k child slots:

1. classes whose mass is at least 1/k of S's become leaf children of the node (as a
   Huffman tree puts frequent classes high);
2. the rest are split into the remaining g slots by recursive bisection: 2-means on a
   sample of the group's vectors gives a direction (between the two centroids), the
   group is sorted by its projection on it, and cut where the mass splits as the slots
   do (floor(g/2) : ceil(g/2)). So each child holds classes that lie together along the
   directions that separate them most, and about its share of the mass.

With `head` = H, the root first takes the H most frequent classes as leaf children and
splits the rest as above: the layout of an adaptive softmax (Grave et al., 2017), whose
frequent words get an exact softmax at the root, with similarity clusters below it. The
root then scores H + k children a token.

Each level reads every class vector once, in chunks (no copy of the vectors), so time
is O(V D depth) and memory beyond the vectors O(V) (index arrays and projections).
"""

import numpy as np

from tf_hsm.tree.checks import check_int, counts_array
from tf_hsm.tree.transfer import class_masses

_SAMPLE = 2048  # vectors a 2-means direction is fitted on
_ITERATIONS = 8
_CHUNK = 1 << 18  # rows projected at a time


def _direction(points, w, rng):
  """A unit vector separating `points` (rows, float64) into two groups: the difference
  of the centroids of a 2-means weighted by `w`. Each iteration is two matrix-vector
  products: a point is nearer centroid 1 when its projection on (c1 - c0) passes the
  midpoint, and each centroid is a weighted sum over its side."""
  first, second = rng.choice(len(points), 2, replace=False)
  centers = points[[first, second]]
  total = w @ points
  mass = w.sum()
  side = None
  for _ in range(_ITERATIONS):
    gap = centers[1] - centers[0]
    threshold = 0.5 * (centers[1] @ centers[1] - centers[0] @ centers[0])
    new_side = points @ gap > threshold
    if side is not None and np.array_equal(side, new_side):
      break
    side = new_side
    upper = w[side]
    upper_mass = upper.sum()
    if upper_mass <= 0 or upper_mass >= mass:
      break
    upper_sum = upper @ points[side]
    centers = np.stack([(total - upper_sum) / (mass - upper_mass), upper_sum / upper_mass])
  direction = centers[1] - centers[0]
  norm = np.linalg.norm(direction)
  if not np.isfinite(norm) or norm == 0:
    # Identical vectors: any fixed direction sorts them.
    direction = np.zeros(points.shape[1])
    if direction.size:
      direction[0] = 1.0
    return direction
  return direction / norm


def _projection(vectors, members, weights, rng):
  """Each member's coordinate along a direction that splits the group by similarity."""
  if members.size > _SAMPLE:
    sample = np.sort(rng.choice(members, _SAMPLE, replace=False))
    points = np.asarray(vectors[sample], np.float64)
  else:
    sample = members
    points = np.asarray(vectors[members], np.float64)
  direction = _direction(points, weights[sample] + 1e-12, rng)
  if sample is members:
    return points @ direction
  out = np.empty(members.size)
  for start in range(0, members.size, _CHUNK):
    rows = members[start:start + _CHUNK]
    out[start:start + _CHUNK] = np.asarray(vectors[rows], np.float64) @ direction
  return out


def _bisect(vectors, members, weights, groups, rng):
  """`members` split into `groups` lists of about equal mass, by recursive bisection along
  2-means directions."""
  if groups == 1 or members.size <= 1:
    return [members]
  if members.size <= groups:
    return [members[i:i + 1] for i in range(members.size)]
  order = members[np.argsort(_projection(vectors, members, weights, rng), kind="stable")]
  left_groups = groups // 2
  mass = np.cumsum(weights[order])
  target = mass[-1] * left_groups / groups
  cut = int(np.searchsorted(mass, target, side="left")) + 1
  # Each side keeps at least as many classes as it has groups.
  cut = min(max(cut, left_groups), order.size - (groups - left_groups))
  return (_bisect(vectors, order[:cut], weights, left_groups, rng) +
          _bisect(vectors, order[cut:], weights, groups - left_groups, rng))


def head_classes(counts, head):
  """The `head` most frequent classes (ties: lower id first), in that order."""
  return np.argsort(-np.asarray(counts, np.float64), kind="stable")[:head]


def parents_from_vectors(vectors, counts, branching, seed, head=0):
  """The `parents` array (classes, then internal nodes; see `Tree.from_parents`) of a
  tree over the rows of `vectors`. `branching` is an int, or a list of ints per level
  (the last one for every deeper level); `head` classes (the most frequent) are leaf
  children of the root in addition to its `branching` slots. A zero count weighs half
  the smallest positive one (`class_masses`): a group of unseen classes (a vocabulary's
  words absent from the text, their untrained rows alike) has no mass to balance, and
  its cuts would peel a class at a time, a chain as deep as the group is large."""
  num_classes = vectors.shape[0]
  weights = class_masses(counts, num_classes)
  per_level = list(branching) if isinstance(branching, (list, tuple)) else [branching]
  rng = np.random.default_rng(seed)
  class_parent = np.full(num_classes, -1, np.int64)
  node_parent = [-1]  # entry index (num_classes + node) of each internal node's parent
  members = np.arange(num_classes, dtype=np.int64)
  if head:
    top = head_classes(weights, head)
    class_parent[top] = num_classes  # the root's entry
    members = np.setdiff1d(members, top, assume_unique=True)
  stack = [(members, 0, 0)]  # (classes, node, depth)
  while stack:
    members, node, depth = stack.pop()
    k = per_level[min(depth, len(per_level) - 1)]
    entry = num_classes + node
    if members.size <= k:
      class_parent[members] = entry
      continue
    total = weights[members].sum()
    heavy = members[weights[members] >= total / k] if total > 0 else members[:0]
    heavy = heavy[np.argsort(-weights[heavy], kind="stable")][:k - 1]
    if heavy.size:
      class_parent[heavy] = entry
      members = np.setdiff1d(members, heavy, assume_unique=True)
    for group in _bisect(vectors, members, weights, k - heavy.size, rng):
      if group.size == 1:
        class_parent[group] = entry
        continue
      child = len(node_parent)
      node_parent.append(entry)
      stack.append((group, child, depth + 1))
  return np.concatenate([class_parent, np.asarray(node_parent, np.int64)])


def checked_arguments(vectors, counts, branching, seed, head=0):
  """(vectors, counts, branching, seed, head) checked: ValueError for anything
  malformed. The vectors are not copied (a NumPy memmap stays one); their values are
  checked finite a chunk at a time."""
  if not hasattr(vectors, "shape") or not hasattr(vectors, "dtype"):
    vectors = np.asarray(vectors)
  if len(vectors.shape) != 2 or vectors.shape[0] < 1:
    raise ValueError(f"vectors must be a 2-D array [num_classes, dim] with at least one "
                     f"row, got shape {tuple(vectors.shape)}")
  if not (np.issubdtype(vectors.dtype, np.floating) or np.issubdtype(vectors.dtype,
                                                                     np.integer)):
    raise ValueError(f"vectors must be numbers, got dtype {vectors.dtype}")
  check_finite(vectors)
  return (vectors,) + checked_options(vectors.shape[0], counts, branching, seed, head,
                                      f"vectors has {vectors.shape[0]} rows")


def check_finite(vectors):
  """ValueError naming the rows where `vectors` ([rows, dim] numbers) holds a NaN or an
  infinity, read a chunk at a time (a memmap is never read whole)."""
  for start in range(0, vectors.shape[0], _CHUNK):
    if not np.all(np.isfinite(vectors[start:start + _CHUNK])):
      raise ValueError("vectors must be finite (a NaN or infinity was found in rows "
                       f"{start}..{min(start + _CHUNK, vectors.shape[0]) - 1})")


def checked_options(num_classes, counts, branching, seed, head, classes=None):
  """(counts, branching, seed, head) of a tree over `num_classes` classes, checked
  (ValueError for anything malformed) without the vectors: what a rebuild can check
  before training, its vectors read only when it runs. `classes` says where the number
  of classes comes from in errors (default "there are N classes")."""
  if counts is not None:
    counts = counts_array(counts)
    if counts.shape[0] != num_classes:
      raise ValueError(f"counts has {counts.shape[0]} entries; "
                       f"{classes or f'there are {num_classes} classes'}")
  levels = list(branching) if isinstance(branching, (list, tuple)) else [branching]
  if not levels:
    raise ValueError("branching must be an int >= 2 or a non-empty list of them")
  levels = [check_int(k, "branching", minimum=2) for k in levels]
  head = check_int(head, "head", minimum=0)
  if head and counts is None:
    raise ValueError("head needs counts: it takes the most frequent classes")
  if head and head >= num_classes:
    raise ValueError(f"head must be less than the number of classes ({num_classes}), "
                     f"got {head}")
  return counts, levels if isinstance(branching, (list, tuple)) else levels[0], \
      check_int(seed, "seed"), head
