"""Cutoffs for `AdaptiveSoftmax` that minimise the step time `tf_hsm.planning` gives the
layer, as Grave et al. ("Efficient softmax approximation for GPUs") choose them with a
dynamic program, here with the rates of the machine the step runs on
(`tf_hsm.planning.Machine`).

The step is the one `tf_hsm.planning.costs.adaptive_cost` describes and
`tf_hsm.planning.pricing.price` times: the layer's forward and backward pass over T tokens whose targets follow the
class frequencies `counts`, and the optimizer's update. Its time is

    max(F, B) + S

with F the FLOPs over the matmul rate, B the bytes moved over the read bandwidth and S
the softmax cross-entropy's and the calls' seconds, each a sum over the tiers (the head,
then each cluster; `tf_hsm.planning.pricing.step_terms` of `adaptive_head_cost` and
`adaptive_cluster_cost`). A sum over tiers is what a dynamic program minimises; the max
is not. So the search minimises lambda F + (1 - lambda) B + S, which is a sum over tiers
and never more than the step time, exactly for each lambda, and moves lambda by
bisection towards the one whose cheapest layout has F = B: the cheapest layout for
lambda = 1 whose F is at least its B (or for lambda = 0 whose B is at least its F, or
any whose F = B) is the least step time there is. When no lambda gives such a layout
the answer is the fastest of the layouts the lambdas gave, which can miss a layout that
no weighting makes cheapest.

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

The dynamic program runs over a grid of candidate cut points (about `points_per_decade`
a decade, at two significant figures) for each number of clusters from 1 to
`max_clusters`. Ties go to fewer clusters, then to the smaller cut points.
"""

import math
import numbers

import numpy as np

from tf_hsm.planning import costs
from tf_hsm.planning import machine as machine_lib
from tf_hsm.planning import pricing
from tf_hsm.planning.costs import TAILS

# Halvings of the weight of FLOPs against bytes: it ends within 2^-20 of the balance.
BISECTIONS = 20


_INT64_MAX = float(np.iinfo(np.int64).max)
_SORT_HINT = ("renumber the classes by decreasing frequency (order = np.argsort(-counts, "
              "kind='stable'); class order[i] becomes class i: remap targets with "
              "np.argsort(order)), or give the counts in the class order the layer "
              "already uses")
_BINCOUNT_HINT = ("pass one frequency per class: counts = np.bincount(samples, "
                  "minlength=num_classes), then sort the classes by it")


def _looks_like_samples(values, total):
  """Whether an unsorted array of whole numbers looks like draws of class ids (what
  np.random.zipf returns) rather than one frequency a class: their sum overflows int64
  (no corpus has 9.2e18 tokens), or ids 1, 2, 3 dominate as a Zipf draw's do (the most
  common value is the smallest, 1, held by at least a tenth of the entries) with a
  largest value beyond the number of entries."""
  if not np.all(values == np.floor(values)):
    return False
  if total > _INT64_MAX:
    return True
  ones = np.count_nonzero(values == 1)
  return values.size >= 100 and ones >= 0.1 * values.size and \
      float(values.max()) > values.size


def checked_counts(counts, num_classes=None):
  """float64 class frequencies, validated for `AdaptiveSoftmax` and `choose_cutoffs`:
  a 1-D array of finite, non-negative numbers, not all zero, non-increasing (class ids
  sorted by decreasing frequency), one a class.

  The messages name the problem and its fix: draws of class ids passed as counts
  (`np.random.zipf(1.2, size=100_000)`: use `np.bincount`), counts in another class
  order (sort the classes by frequency), sums beyond int64 (taken in float64 here;
  counts whose int64 sum overflows are almost always samples), NaNs, infinities and
  negative entries (with the index of the first).

  Raises:
    ValueError: as above; the message starts with "counts must ..." or "counts look
      like samples".
  """
  try:
    counts = np.asarray(counts, np.float64)
  except (TypeError, ValueError) as error:
    raise ValueError(f"counts must be numbers (one frequency a class): {error}") from None
  if counts.ndim != 1 or counts.size < 2:
    raise ValueError(f"counts must be a 1-D array of at least 2 class frequencies, got "
                     f"shape {counts.shape}")
  # One pass finds NaNs and infinities (the sum is not finite), in float64: integer
  # counts whose int64 sum would overflow sum here without wrapping to a negative.
  total = float(counts.sum())
  if not math.isfinite(total):
    bad = np.flatnonzero(~np.isfinite(counts))
    if bad.size:
      raise ValueError(f"counts must be finite: counts[{int(bad[0])}] is "
                       f"{counts[bad[0]]}")
    raise ValueError("counts must be finite: their sum overflows float64 (scale them "
                     "down: only their ratios matter)")
  negative = counts < 0
  if negative.any():
    first = int(np.argmax(negative))
    raise ValueError("counts must be non-negative and not all zero: "
                     f"counts[{first}] = {counts[first]:g}")
  if total <= 0:
    raise ValueError("counts must be non-negative and not all zero: they are all zero")
  rising = counts[1:] > counts[:-1]
  sorted_ = not rising.any()
  if num_classes is not None and counts.shape != (num_classes,):
    hint = (f"; they look like samples of class ids, not frequencies: {_BINCOUNT_HINT}"
            if not sorted_ and _looks_like_samples(counts, total) else "")
    raise ValueError(f"counts must have shape [{num_classes}], got {counts.shape}{hint}")
  if not sorted_:
    if _looks_like_samples(counts, total):
      why = ("their sum, " + f"{total:.3g}, is beyond int64"
             if total > _INT64_MAX else
             f"{np.count_nonzero(counts == 1):,} of the {counts.size:,} are 1 and the "
             f"largest is {counts.max():.3g}")
      raise ValueError(f"counts look like samples (draws of class ids, as "
                       f"np.random.zipf returns), not frequencies: {why}. "
                       f"{_BINCOUNT_HINT[0].upper()}{_BINCOUNT_HINT[1:]}")
    first = int(np.argmax(rising))
    whole = np.all(counts == np.floor(counts))
    raise ValueError("counts must be non-increasing (class ids sorted by decreasing "
                     f"frequency, as AdaptiveSoftmax requires): counts[{first + 1}] = "
                     f"{counts[first + 1]:g} > counts[{first}] = {counts[first]:g}. To fix: "
                     f"{_SORT_HINT}" + (
                         ". If they are samples of class ids rather than one frequency a "
                         "class, count them first: np.bincount(samples)" if whole else ""))
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


def _checked(dim, tokens_per_step, div_value, tail, machine, optimizer, dtype):
  dim = _positive_int("dim", dim)
  tokens = _positive_int("tokens_per_step", tokens_per_step)
  if (isinstance(div_value, bool) or not isinstance(div_value, numbers.Real) or
      not math.isfinite(div_value) or div_value <= 0):
    raise ValueError(f"div_value must be a positive finite number, got {div_value!r}")
  if tail not in TAILS:
    raise ValueError(f"tail must be one of {TAILS}, got {tail!r}")
  if optimizer not in costs.OPTIMIZERS:
    raise ValueError(f"optimizer must be one of {sorted(costs.OPTIMIZERS)}, got "
                     f"{optimizer!r}")
  if dtype not in costs.DTYPE_BYTES:
    raise ValueError(f"dtype must be one of {sorted(costs.DTYPE_BYTES)}, got {dtype!r}")
  machine = machine_lib.resolve(machine)
  return dim, tokens, float(div_value), machine


def step_cost(counts, cutoffs, dim, tokens_per_step, div_value=4.0, tail="flat",
              machine=None, optimizer="sgd", dtype="float32", head_bias=False):
  """The planner's row for one training step of an `AdaptiveSoftmax` at `cutoffs`:
  `pricing.price` of `costs.adaptive_cost`, the figures `choose_cutoffs`
  minimises (`step_seconds`).

  Args:
    counts: class frequencies `[num_classes]`, non-increasing (class ids sorted by
      decreasing frequency).
    cutoffs: the layer's cutoffs (increasing ints in (0, num_classes)).
    dim: D, the hidden size.
    tokens_per_step: T, tokens (targets) a step.
    div_value: cluster i has width int(D // div_value ** (i + 1)).
    tail: "flat" or "two_level".
    machine: a `tf_hsm.planning.Machine` (or a dict of its fields); default: this
      machine's rates, measured once and cached.
    optimizer, dtype: the table's, as `tf_hsm.plan` takes them.
    head_bias: whether the head has a bias.

  Returns:
    A dict, a planner row: `step_seconds`, `flops`, `bytes_moved`, `peak_bytes`, ...

  Raises:
    ValueError: for invalid arguments; the message names the argument.
  """
  counts = checked_counts(counts)
  dim, tokens, div_value, machine = _checked(dim, tokens_per_step, div_value, tail,
                                             machine, optimizer, dtype)
  cost = costs.adaptive_cost(counts.size, dim, tokens, cutoffs, div_value, tail, counts,
                               head_bias)
  return pricing.price(f"AdaptiveSoftmax {tail}", cost, dim, tokens, optimizer, dtype,
                       machine)


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
                   max_clusters=4, min_head_mass=0.5, min_width=4, points_per_decade=24,
                   optimizer="sgd", dtype="float32", head_bias=False):
  """The cutoffs (and so the number of clusters) that minimise `step_cost`'s step time.

  Args:
    counts: class frequencies `[num_classes]`, non-increasing (class ids sorted by
      decreasing frequency, as `AdaptiveSoftmax` requires).
    dim: D, the hidden size.
    tokens_per_step: T, tokens (targets) a training step.
    div_value: cluster i has width int(D // div_value ** (i + 1)); numbers of clusters
      that would leave a width of 0 are not considered.
    tail: "flat" or "two_level", the layer's `tail`.
    machine: a `tf_hsm.planning.Machine` (or a dict of its fields); default: this
      machine's rates, measured once and cached.
    max_clusters: the most tail clusters considered (1 to this).
    min_head_mass: the least fraction of the counts the head covers, in [0, 1); 0 lets
      the cost model alone place the head.
    min_width: the narrowest cluster allowed (a positive int); 1 lets the cost model
      alone pick the number of clusters.
    points_per_decade: density of the grid of candidate cut points (`candidate_cuts`).
    optimizer, dtype: the table's, as `tf_hsm.plan` takes them (the update of a flat
      tail's dense table is part of the step).
    head_bias: whether the head has a bias.

  Returns:
    The cutoffs, a list of increasing ints: the fastest on the grid (see the module's
    doc for when the search can miss it) among those whose head covers
    `min_head_mass`, whose clusters are no narrower than `min_width`, and whose tiers
    each hold at least as many classes as the one before. Deterministic for given
    arguments and machine.

  Raises:
    ValueError: for invalid arguments; the message names the argument.
  """
  counts = checked_counts(counts)
  dim, tokens, div_value, machine = _checked(dim, tokens_per_step, div_value, tail,
                                             machine, optimizer, dtype)
  max_clusters = _positive_int("max_clusters", max_clusters)
  min_width = _positive_int("min_width", min_width)
  if (isinstance(min_head_mass, bool) or not isinstance(min_head_mass, numbers.Real) or
      not 0 <= min_head_mass < 1):
    raise ValueError(f"min_head_mass must be a number in [0, 1), got {min_head_mass!r}")
  num_classes = counts.size
  cuts = candidate_cuts(num_classes, points_per_decade)
  ends = np.append(cuts, num_classes)  # a cluster ends at a later cut or at V
  mass = _mass_before(counts, ends)  # mass[k]: the fraction below ends[k]
  widths = [w for w in costs.tail_widths(dim, max_clusters, div_value) if w >= min_width]
  size = ends[None, :] - cuts[:, None]  # [j, k]: the cluster [cuts[j], ends[k])
  share = np.maximum(mass[None, :] - mass[:cuts.size, None], 0.0)
  # Tiers grow: a cluster holds at least as many classes as the tier before it. After
  # the cluster [cuts[j], cuts[k]) the next one ends at ends[l] with l >= follow[j, k].
  follow = np.searchsorted(ends, 2 * cuts[None, :] - cuts[:, None])
  starts = np.broadcast_to(np.arange(cuts.size)[None, :], follow.shape)
  follows = follow < ends.size
  follow = np.minimum(follow, ends.size - 1)
  head_first = np.searchsorted(ends, 2 * cuts)  # cluster 0 ends at ends[head_first[j]]..
  head_valid = (head_first < ends.size) & (mass[:cuts.size] >= min_head_mass - 1e-12)
  head_first = np.minimum(head_first, ends.size - 1)
  if not widths or not head_valid.any():
    raise ValueError(f"no cutoffs possible: dim={dim} with div_value={div_value:g} leaves "
                     f"no cluster a width of min_width={min_width} or more, or no cut point "
                     f"leaves the head min_head_mass={min_head_mass} and a larger cluster")

  def terms(cost):
    return np.stack(np.broadcast_arrays(*pricing.step_terms(cost, optimizer, dtype,
                                                            machine)))

  hidden_seconds, call_seconds = pricing.fixed_step_terms(dim, tokens, dtype, machine)
  # [3, j, k]: cluster i = [cuts[j], ends[k])'s (F, B, S); [3, j]: the head's with
  # cutoffs[0] = cuts[j] and c clusters, the hidden states' bytes with it.
  tiers = [np.where(size > 0, terms(costs.adaptive_cluster_cost(
      np.maximum(size, 1), share, dim, tokens, width, tail)), np.inf) for width in widths]
  heads = [terms(costs.adaptive_head_cost(cuts + c, dim, tokens, head_bias)) +
           np.array([0.0, hidden_seconds, call_seconds])[:, None]
           for c in range(1, len(widths) + 1)]

  def layouts(weight):
    """For each number of clusters, the cutoffs that minimise weight F + (1 - weight) B
    + S, and their (F, B, S)."""
    mix = np.array([weight, 1.0 - weight, 1.0])
    found = []
    for clusters in range(1, len(widths) + 1):
      # after[j, k]: the least cost of clusters i.. with cluster i = [cuts[j], ends[k]);
      # then[i][j, k]: where cluster i + 1 ends in that case.
      then = [None] * clusters
      after = None
      for i in reversed(range(clusters)):
        with np.errstate(invalid="ignore"):  # 0 x inf where a cluster is empty
          cost = np.where(size > 0, np.tensordot(mix, tiers[i], 1), np.inf)
        if i == clusters - 1:
          cost[:, :-1] = np.inf  # only the last cluster ends at V
        else:
          low, low_at = _suffix_min(after)
          cost[:, :-1] += np.where(follows, low[starts, follow], np.inf)
          cost[:, -1] = np.inf
          then[i] = low_at[starts, follow]
        after = cost
      low, low_at = _suffix_min(after)
      total = mix @ heads[clusters - 1] + low[np.arange(cuts.size), head_first]
      total = np.where(head_valid, total, np.inf)
      j = int(np.argmin(total))
      if not np.isfinite(total[j]):
        continue
      path = [(j, int(low_at[j, head_first[j]]))]  # (start, end) of each cluster
      for i in range(clusters - 1):
        j, k = path[-1]
        path.append((k, int(then[i][j, k])))
      spent = heads[clusters - 1][:, path[0][0]] + sum(
          tiers[i][:, j, k] for i, (j, k) in enumerate(path))
      found.append(([int(cuts[j]) for j, _ in path], spent))
    return found

  seconds = {}  # the step time of every layout found, by its cutoffs

  def slope(weight):
    """F - B of the layout that minimises the weighted sum: the slope, in the weight, of
    that minimum (a lower bound on the step time, greatest where the slope is 0)."""
    found = layouts(weight)
    for cutoffs, spent in found:
      seconds[tuple(cutoffs)] = max(spent[0], spent[1]) + spent[2]
    if not found:
      return 0.0
    mix = np.array([weight, 1.0 - weight, 1.0])
    _, spent = min(found, key=lambda f: (float(mix @ f[1]), len(f[0]), f[0]))
    return spent[0] - spent[1]

  low, high = 0.0, 1.0
  if slope(1.0) < 0 and slope(0.0) > 0:
    for _ in range(BISECTIONS):
      middle = 0.5 * (low + high)
      step = slope(middle)
      if step == 0:
        break
      if step > 0:
        low = middle
      else:
        high = middle
  if not seconds:
    raise ValueError(f"no cutoffs possible: dim={dim} with div_value={div_value:g} leaves "
                     f"no cluster a width of min_width={min_width} or more, or no cut point "
                     f"leaves the head min_head_mass={min_head_mass} and a larger cluster")
  return list(min(seconds, key=lambda c: (seconds[c], len(c), c)))


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
