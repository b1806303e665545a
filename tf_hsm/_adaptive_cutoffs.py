"""Cutoffs for `AdaptiveSoftmax` that minimise a cost model of the training step, as
Grave et al. ("Efficient softmax approximation for GPUs") choose them with a dynamic
program, here with the rates of the machine the step runs on (`tf_hsm.planner.Machine`).

The step is the layer's forward and backward pass over T tokens whose targets follow the
class frequencies `counts`. Each tier (the head, then cluster i) costs

    FLOPs / matmul rate + bytes / read bandwidth + one call overhead

and the step costs the sum over tiers (a tier's matmuls and its cross-entropy run one
after the other, so their times add). With p the normalised counts, cluster i holding
the classes [a, b) at width d_i = int(D // div_value**(i + 1)) and t_i = T * p[a:b].sum()
expected tokens (the head sees all T and scores h = cutoffs[0] classes plus one token
per cluster at width D):

    head:       FLOPs 6 T (h + k) D
                bytes 4 [3 (h + k) D  +  4 T (h + k)]
    flat tail:  FLOPs 6 t D d  +  6 t n d                      (n = b - a)
                bytes 4 [3 D d  +  3 n d  +  4 t n]
    tree tail:  FLOPs 6 t D d  +  6 t (2 sqrt n) d
                bytes 4 [3 D d  +  3 r (d + 1)  +  4 t (2 sqrt n)]

6 = 2 FLOPs a multiply-add times three matmuls (the logits, their gradient with respect
to the input, and with respect to the weights). A table is read by the forward, read
again by the backward and its gradient written (3 passes); dense for the head and flat
tails, only the r touched rows for tree tails, where r = K + n (1 - (1 - 1/K)^t) for the
K = sqrt(n) equal-mass clusters of `Tree.two_level` (its K root rows are always read; a
cluster's rows when one of the t tokens falls in it). Logits are written, read by the
cross-entropy, their gradient written and read by the backward matmuls (4 passes). A
tree tail scores about 2 sqrt(n) rows a token (K at the root, n / K in the cluster),
which K = sqrt(n) minimises; that is `Tree.two_level`'s branching, so only the cutoffs
are searched.

The model prices speed only. Left alone it trades accuracy it cannot see for time: its
cheapest head holds a handful of classes (every token pays the head's full width D,
while a cluster's tokens pay D / div_value), and its cheapest layout spends clusters on
a class or two each so that the bulk of the vocabulary lands in the last, narrowest
cluster (a width of 1 or 2). Three bounds, not priced, keep the choice near what the
adaptive softmax is for: the head covers at least `min_head_mass` of the counts (half,
by default: the full-width head scores most tokens), each cluster holds at least as
many classes as the tier before it, and no cluster is narrower than `min_width` (4,
the narrowest tier of PyTorch's usual [2000, 20000, 200000] at D=300), which caps the
number of clusters.

The search runs a dynamic program over a grid of candidate cut points (about
`points_per_decade` a decade, at two significant figures) for each number of clusters
from 1 to `max_clusters`, and keeps the cheapest; for a number of clusters it is exact
on the grid. Ties go to the smaller cut points, then to fewer clusters.
"""

import math
import numbers

import numpy as np

BYTES = 4  # float32 tables, activations and gradients
TABLE_PASSES = 3  # read by the forward, read by the backward, gradient written
LOGIT_PASSES = 4  # written, read by the cross-entropy, gradient written, read back
MATMULS = 3  # forward, gradient of the input, gradient of the weights
TAILS = ("flat", "two_level")


def checked_counts(counts, num_classes=None):
  """float64 counts, validated: finite, non-negative, not all zero, non-increasing."""
  counts = np.asarray(counts, np.float64)
  if counts.ndim != 1 or counts.size < 2:
    raise ValueError(f"counts must be a 1-D array of at least 2 class frequencies, got "
                     f"shape {counts.shape}")
  if num_classes is not None and counts.shape != (num_classes,):
    raise ValueError(f"counts must have shape [{num_classes}], got {counts.shape}")
  # Two passes over the counts (they may hold 10M classes): a NaN or an infinity makes
  # the sum non-finite, and once they are non-increasing the last is the smallest.
  total = counts.sum()
  if not math.isfinite(total):
    raise ValueError("counts must be finite")
  rising = counts[1:] > counts[:-1]
  if rising.any():
    first = int(np.argmax(rising))
    raise ValueError("counts must be non-increasing (class ids sorted by decreasing "
                     f"frequency, as AdaptiveSoftmax requires): counts[{first + 1}] > "
                     f"counts[{first}]")
  if counts[-1] < 0 or total <= 0:
    raise ValueError("counts must be non-negative and not all zero")
  return counts


def _mass_before(counts, points):
  """The fraction of the counts below each of the increasing class ids `points`."""
  points = np.asarray(points, np.int64)
  sums = np.add.reduceat(counts, np.concatenate([[0], points[:-1]]))
  return np.cumsum(sums) / counts.sum()


def _positive_int(name, value):
  if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
    raise ValueError(f"{name} must be a positive int, got {value!r}")
  return int(value)


def _checked(dim, tokens_per_step, div_value, tail, machine):
  dim = _positive_int("dim", dim)
  tokens = _positive_int("tokens_per_step", tokens_per_step)
  if (isinstance(div_value, bool) or not isinstance(div_value, numbers.Real) or
      not math.isfinite(div_value) or div_value <= 0):
    raise ValueError(f"div_value must be a positive finite number, got {div_value!r}")
  if tail not in TAILS:
    raise ValueError(f"tail must be one of {TAILS}, got {tail!r}")
  from tf_hsm.planner import Machine  # pylint: disable=import-outside-toplevel
  if isinstance(machine, dict):
    machine = Machine(**machine)
  if machine is None:
    machine = Machine.cached()
  if not isinstance(machine, Machine):
    raise TypeError(f"machine must be a tf_hsm.planner.Machine or a dict of its fields, "
                    f"got {type(machine).__name__}")
  return dim, tokens, float(div_value), machine


def _widths(dim, count, div_value):
  return [int(dim // (div_value ** (i + 1))) for i in range(count)]


def _seconds(flops, moved, calls, machine):
  return flops / machine.matmul_flops + moved / machine.read_bytes + \
      calls * machine.call_seconds


def _head(classes, dim, tokens):
  """(FLOPs, bytes) of the head: `classes` rows at width `dim`, every token."""
  flops = 2.0 * MATMULS * tokens * classes * dim
  moved = BYTES * (TABLE_PASSES * classes * dim + LOGIT_PASSES * tokens * classes)
  return flops, moved


def _tail(size, tokens, dim, width, tail):
  """(FLOPs, bytes) of a cluster of `size` classes reached by `tokens` expected tokens
  (NumPy arrays broadcast)."""
  size = np.asarray(size, np.float64)
  tokens = np.asarray(tokens, np.float64)
  projection_flops = 2.0 * MATMULS * tokens * dim * width
  projection_bytes = BYTES * TABLE_PASSES * dim * width
  if tail == "flat":
    flops = projection_flops + 2.0 * MATMULS * tokens * size * width
    moved = projection_bytes + BYTES * (TABLE_PASSES * size * width +
                                        LOGIT_PASSES * tokens * size)
    return flops, moved
  groups = np.sqrt(size)
  scored = 2.0 * groups  # rows a token scores: the root's groups, then its group's classes
  touched = groups + size * -np.expm1(tokens * np.log1p(-np.minimum(1.0 / groups,
                                                                   1.0 - 1e-16)))
  touched = np.minimum(touched, groups + size)
  flops = projection_flops + 2.0 * MATMULS * tokens * scored * width
  moved = projection_bytes + BYTES * (TABLE_PASSES * touched * (width + 1) +
                                      LOGIT_PASSES * tokens * scored)
  return flops, moved


def step_cost(counts, cutoffs, dim, tokens_per_step, div_value=4.0, tail="flat",
              machine=None):
  """The cost model's figures for one forward+backward step of an `AdaptiveSoftmax`.

  Args:
    counts: class frequencies `[num_classes]`, non-increasing (class ids sorted by
      decreasing frequency).
    cutoffs: the layer's cutoffs (increasing ints in (0, num_classes)).
    dim: D, the hidden size.
    tokens_per_step: T, tokens (targets) a step.
    div_value: cluster i has width int(D // div_value ** (i + 1)).
    tail: "flat" or "two_level".
    machine: a `tf_hsm.planner.Machine` (or a dict of its fields); default: this
      machine's rates, measured once and cached.

  Returns:
    A dict: `seconds`, `flops`, `bytes` for the step and `tiers`, one dict per tier
    (head first) with `classes`, `width`, `tokens`, `flops`, `bytes`, `seconds`.

  Raises:
    ValueError: for invalid arguments; the message names the argument.
  """
  counts = checked_counts(counts)
  dim, tokens, div_value, machine = _checked(dim, tokens_per_step, div_value, tail,
                                             machine)
  num_classes = counts.size
  cutoffs = [int(c) for c in cutoffs]
  if (not cutoffs or cutoffs != sorted(set(cutoffs)) or cutoffs[0] <= 0 or
      cutoffs[-1] >= num_classes):
    raise ValueError(f"cutoffs must be unique increasing ints in (0, {num_classes}), got "
                     f"{cutoffs}")
  widths = _widths(dim, len(cutoffs), div_value)
  if min(widths) < 1:
    raise ValueError(f"cutoffs: {len(cutoffs)} clusters leave a width of 0 at D={dim}, "
                     f"div_value={div_value:g}")
  bounds = cutoffs + [num_classes]
  mass = dict(zip([0] + bounds, [0.0] + list(_mass_before(counts, bounds))))
  tiers = []
  head_classes = cutoffs[0] + len(cutoffs)
  flops, moved = _head(head_classes, dim, tokens)
  tiers.append({"classes": head_classes, "width": dim, "tokens": float(tokens),
                "flops": float(flops), "bytes": float(moved)})
  for i, width in enumerate(widths):
    lo, hi = bounds[i], bounds[i + 1]
    reach = tokens * (mass[hi] - mass[lo])
    flops, moved = _tail(hi - lo, reach, dim, width, tail)
    tiers.append({"classes": hi - lo, "width": width, "tokens": float(reach),
                  "flops": float(flops), "bytes": float(moved)})
  for tier in tiers:
    tier["seconds"] = _seconds(tier["flops"], tier["bytes"], 1, machine)
  return {"seconds": sum(t["seconds"] for t in tiers),
          "flops": sum(t["flops"] for t in tiers),
          "bytes": sum(t["bytes"] for t in tiers), "tiers": tiers}


def candidate_cuts(num_classes, points_per_decade=24):
  """The grid searched: about `points_per_decade` log-spaced values a decade, rounded to
  two significant figures, in [1, num_classes - 1]."""
  points_per_decade = _positive_int("points_per_decade", points_per_decade)
  top = math.log10(max(num_classes - 1, 1))
  raw = 10.0 ** (np.arange(0, math.floor(top * points_per_decade) + 1) / points_per_decade)
  scale = 10.0 ** (np.floor(np.log10(raw)) - 1)
  cuts = np.unique(np.maximum(np.round(raw / scale) * scale, 1).astype(np.int64))
  return cuts[(cuts >= 1) & (cuts <= num_classes - 1)]


def choose_cutoffs(counts, dim, tokens_per_step, div_value=4.0, tail="flat", machine=None,
                   max_clusters=4, min_head_mass=0.5, min_width=4, points_per_decade=24):
  """The cutoffs (and so the number of clusters) that minimise `step_cost`.

  Args:
    counts: class frequencies `[num_classes]`, non-increasing (class ids sorted by
      decreasing frequency, as `AdaptiveSoftmax` requires).
    dim: D, the hidden size.
    tokens_per_step: T, tokens (targets) a training step.
    div_value: cluster i has width int(D // div_value ** (i + 1)); numbers of clusters
      that would leave a width of 0 are not considered.
    tail: "flat" or "two_level", the layer's `tail`.
    machine: a `tf_hsm.planner.Machine` (or a dict of its fields); default: this
      machine's rates, measured once and cached.
    max_clusters: the most tail clusters considered (1 to this).
    min_head_mass: the least fraction of the counts the head covers, in [0, 1); 0 lets
      the cost model alone place the head.
    min_width: the narrowest cluster allowed (a positive int); 1 lets the cost model
      alone pick the number of clusters.
    points_per_decade: density of the grid of candidate cut points (`candidate_cuts`).

  Returns:
    The cutoffs, a list of increasing ints: the cheapest on the grid for the cost model
    among those whose head covers `min_head_mass`, whose clusters are no narrower than
    `min_width`, and whose tiers each hold at least as many classes as the one before.
    Deterministic for given arguments and machine.

  Raises:
    ValueError: for invalid arguments; the message names the argument.
  """
  counts = checked_counts(counts)
  dim, tokens, div_value, machine = _checked(dim, tokens_per_step, div_value, tail,
                                             machine)
  max_clusters = _positive_int("max_clusters", max_clusters)
  min_width = _positive_int("min_width", min_width)
  if (isinstance(min_head_mass, bool) or not isinstance(min_head_mass, numbers.Real) or
      not 0 <= min_head_mass < 1):
    raise ValueError(f"min_head_mass must be a number in [0, 1), got {min_head_mass!r}")
  num_classes = counts.size
  cuts = candidate_cuts(num_classes, points_per_decade)
  ends = np.append(cuts, num_classes)  # a cluster ends at a later cut or at V
  mass = _mass_before(counts, ends)  # mass[k]: the fraction below ends[k]
  widths = _widths(dim, max_clusters, div_value)
  size = ends[None, :] - cuts[:, None]  # [j, k]: the cluster [cuts[j], ends[k])
  reach = tokens * np.maximum(mass[None, :] - mass[:cuts.size, None], 0.0)
  # Tiers grow: a cluster holds at least as many classes as the tier before it. After
  # the cluster [cuts[j], cuts[k]) the next one ends at ends[l] with l >= follow[j, k].
  follow = np.searchsorted(ends, 2 * cuts[None, :] - cuts[:, None])
  starts = np.broadcast_to(np.arange(cuts.size)[None, :], follow.shape)
  follows = follow < ends.size
  follow = np.minimum(follow, ends.size - 1)
  head_first = np.searchsorted(ends, 2 * cuts)  # cluster 0 ends at ends[head_first[j]]..
  head_valid = (head_first < ends.size) & (mass[:cuts.size] >= min_head_mass - 1e-12)
  head_first = np.minimum(head_first, ends.size - 1)
  best = None
  for clusters in range(1, max_clusters + 1):
    if widths[clusters - 1] < min_width:
      break
    # after[j, k]: the cheapest cost of clusters i.. with cluster i = [cuts[j], ends[k]);
    # then[i][j, k]: where cluster i + 1 ends in that case.
    then = [None] * clusters
    after = None
    for i in reversed(range(clusters)):
      flops, moved = _tail(np.maximum(size, 1), reach, dim, widths[i], tail)
      cost = np.where(size > 0, _seconds(flops, moved, 1, machine), np.inf)
      if i == clusters - 1:
        cost[:, :-1] = np.inf  # only the last cluster ends at V
      else:
        low, low_at = _suffix_min(after)
        cost[:, :-1] += np.where(follows, low[starts, follow], np.inf)
        cost[:, -1] = np.inf
        then[i] = low_at[starts, follow]
      after = cost
    low, low_at = _suffix_min(after)
    head_flops, head_moved = _head(cuts + clusters, dim, tokens)
    total = _seconds(head_flops, head_moved, 1, machine) + low[np.arange(cuts.size),
                                                               head_first]
    total = np.where(head_valid, total, np.inf)
    j = int(np.argmin(total))
    if not np.isfinite(total[j]) or (best is not None and total[j] >= best[0]):
      continue
    best = (float(total[j]), [int(cuts[j])])
    k = int(low_at[j, head_first[j]])
    for i in range(clusters - 1):
      best[1].append(int(cuts[k]))
      j, k = k, int(then[i][j, k])
  if best is None:
    raise ValueError(f"no cutoffs possible: dim={dim} with div_value={div_value:g} leaves "
                     f"no cluster a width of min_width={min_width} or more, or no cut point "
                     f"leaves the head min_head_mass={min_head_mass} and a larger cluster")
  return best[1]


def _suffix_min(cost):
  """Per row, the least of cost[r, c:] and where it is (the first such column)."""
  low = np.minimum.accumulate(cost[:, ::-1], axis=1)[:, ::-1]
  # The first column holding each suffix's minimum: the latest c' >= c where the
  # running minimum (from the right) last changed.
  cols = np.arange(cost.shape[1])
  is_new = np.ones(cost.shape, bool)
  is_new[:, :-1] = cost[:, :-1] <= low[:, 1:]
  at = np.where(is_new, cols[None, :], cost.shape[1])
  at = np.minimum.accumulate(at[:, ::-1], axis=1)[:, ::-1]
  return low, at
