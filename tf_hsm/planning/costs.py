"""The work of one training step of each kind of output layer, independent of the
machine: a `Cost` (its trained tensors, FLOPs, rows touched, activations) for full
softmax, sampled softmax, a hierarchical softmax over a tree, and an adaptive softmax's
head and clusters. `tf_hsm.planning.pricing` prices it on a machine."""

import dataclasses

import numpy as np

from tf_hsm.planning.tree_work import (WALK_MAX_BRANCHING, TreeWork, distinct,
                                       work_of_tree)
from tf_hsm.tree import shards

# only) with tf_hsm's optimizers.
OPTIMIZERS = {"sgd": 0, "momentum": 1, "adagrad": 1, "adam": 2, "lazy_adam": 2}
DTYPE_BYTES = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2}
SAMPLED = 1024  # tf.nn.sampled_softmax_loss's samples in the sampled-softmax row
CALLS_PER_STEP = 3  # forward+backward op, optimizer update, the step's own function
DIV_VALUE = 4.0  # the adaptive rows' div_value: PyTorch's default, docs/adaptive.md's cases
# What a training step allocates beyond its tensors (the executor's buffers, the
# allocator's per-thread arenas): 20-80 MB measured over `--verify`'s SGD cases on 2 vCPUs
# (the worker's peak RSS less its tensors), at most 150 MB for full softmax; case 1M
# (LazyAdam, V=1M) measured 0.27 GB (the tree) and 0.42 GB (sampled softmax) above the
# prediction with this allowance, within the 15% --verify allows.
STEP_WORKSPACE_BYTES = 48 * 2**20
# The adaptive softmax's tails: a flat table per cluster, or a two-level tree over it.
TAILS = ("flat", "two_level")


def tail_widths(dim, num_clusters, div_value):
  """Each cluster's projected width, as PyTorch computes it: int(D // div_value**(i+1))."""
  return [int(dim // (div_value ** (i + 1))) for i in range(num_clusters)]


def probabilities(num_classes, counts):
  """The class probabilities of `counts` (uniform if None)."""
  return shards.class_probabilities(num_classes, counts)


@dataclasses.dataclass
class Part:
  """One trained tensor of an output layer: its elements (weights and biases), the
  elements a step is expected to read (and, for a sparse gradient, to get a gradient
  for), and whether its gradient is dense (every element, every step)."""
  name: str
  elements: float
  touched: float
  dense_grad: bool
  tree: bool = False  # a tree's table, read and updated by tf_hsm's op and optimizers


@dataclasses.dataclass
class Cost:
  """The work of one training step of an output layer, independent of the element size,
  the optimizer and the machine: its trained tensors (`parts`), the table rows it touches
  (all parts together, for the report), its FLOPs (forward and backward), the elements
  it holds for the backward (logits, their gradient, hidden states), the logits that go
  through TensorFlow's softmax cross-entropy (tf_hsm's op does its own), the calls it
  makes beyond `CALLS_PER_STEP` (an adaptive softmax runs each tier's kernels apart), and
  the logits of `tf.nn.sampled_softmax_loss` (`sampled_logits`: its true and sampled
  logits go through a chain of TensorFlow ops of their own, priced per logit apart), and
  for a tree: the nodes its tokens' paths visit, the children those nodes score (a
  logit, its exponential and its gradient coefficient each) and the FLOPs in nodes of at
  most WALK_MAX_BRANCHING children (what tf_hsm's fitted step time counts beside FLOPs
  and bytes), and the bytes of its index arrays (held at the peak)."""
  parts: list
  rows_touched: float
  flops: float
  activations: float
  softmax_logits: float = 0.0
  calls: float = 0.0
  node_visits: float = 0.0
  children_scored: float = 0.0
  small_node_flops: float = 0.0
  tree_flops: float = 0.0
  tree_bytes: float = 0.0
  sampled_logits: float = 0.0


def moved_elements(part, optimizer):
  """Elements a step moves for one `Part` (NumPy arrays broadcast): those read, read
  again by the backward, the gradient written, and the optimizer's read-modify-write of
  the elements it updates and their slots (all of them for a dense gradient or an
  optimizer that is not lazy)."""
  grad = part.elements if part.dense_grad else part.touched
  return 2 * part.touched + grad + 2 * _updated(part, optimizer) + slot_elements(
      part, optimizer)


def slot_elements(part, optimizer):
  """Of `moved_elements`, the optimizer's slots' read and write (NumPy arrays
  broadcast): 2 x the elements it updates x its slots."""
  return 2 * _updated(part, optimizer) * OPTIMIZERS[optimizer]


def _updated(part, optimizer):
  """The elements of `part` the optimizer updates: the touched ones for a lazy optimizer
  and a sparse gradient, else all."""
  lazy = optimizer in ("sgd", "adagrad", "lazy_adam")
  return part.touched if (lazy and not part.dense_grad) else part.elements


def full_softmax_cost(num_classes, hidden, tokens_per_step):
  """TensorFlow's dense softmax (`matmul` + `sparse_softmax_cross_entropy_with_logits`):
  a [V, D+1] table, every row read, a dense gradient, and [T, V] logits: once at the
  peak, as the fused softmax cross-entropy writes their gradient over them and the
  table's gradient is made from it. What `bench.plan_verify` measures as full softmax."""
  V, D, T = num_classes, hidden, tokens_per_step
  return Cost([Part("table", V * (D + 1), V * (D + 1), True)], V, 6.0 * T * V * D,
              T * V + 2 * T * D, T * V)


def flat_softmax_cost(num_classes, hidden, tokens_per_step):
  """The exact softmax as tf_hsm computes it, a one-node tree (`Tree.flat`): the planner's
  full-softmax row. The [V, D+1] table, every row read and given a gradient row each step
  (a dense gradient), and no [T, V] logits: the node's children are taken in tiles
  against all the tokens, a log-sum-exp kept per token and the logits recomputed by the
  gradient (cc/core/wide_node.h). 8 T V D FLOPs (the forward's logits, then the
  gradient's logits, hidden and table gradients), priced at the matmul rate: the tiles
  are small matrix products."""
  V, D, T = num_classes, hidden, tokens_per_step
  return Cost([Part("table", V * (D + 1), V * (D + 1), True)], V, 8.0 * T * V * D,
              T + 3 * T * D)


def sampled_softmax_cost(num_classes, hidden, tokens_per_step, probs,
                         num_sampled=SAMPLED):
  """The true classes' and the sampled classes' rows, a sparse gradient, and T x
  (num_sampled + 1) logits through `tf.nn.sampled_softmax_loss`'s own ops (the sampler,
  its biases, log Q subtracted, accidental hits masked, the true logit joined, a
  cross-entropy with dense labels: `Cost.sampled_logits`)."""
  V, D, T = num_classes, hidden, tokens_per_step
  rows = min(V, distinct(probs, T) + num_sampled)
  return Cost([Part("table", V * (D + 1), rows * (D + 1), False)], rows,
              6.0 * T * (num_sampled + 1) * D, T * (num_sampled + 1) + 2 * T * D,
              sampled_logits=T * (num_sampled + 1))


def tree_cost(tree, hidden, tokens_per_step, probs):
  """A hierarchical softmax over `tree` (a `Tree`, or its `TreeWork` computed without
  building it: `tree_work.huffman_work`, `tree_work.layout_work`): the children of every
  visited node are read and get a gradient row (sparse); the op keeps the logits of its
  large nodes for the gradient, one per visit and child."""
  D, T = hidden, tokens_per_step
  work = tree if isinstance(tree, TreeWork) else work_of_tree(tree, probs, T)
  per_token = work.per_token
  return Cost([Part("table", work.num_slots * (D + 1), work.rows * (D + 1), False, True)],
              work.rows, 6.0 * T * D * per_token, T * per_token + 3 * T * D,
              tree_flops=6.0 * T * D * per_token,
              node_visits=T * work.path_nodes, children_scored=T * per_token,
              small_node_flops=6.0 * T * D * work.per_token_small,
              tree_bytes=work.tree_bytes)


def mixture_cost(tree_costs, hidden, tokens_per_step, head_cost=None, head_rank=None,
                 head_slots=None):
  """`HierarchicalSoftmaxMixture` of the trees whose `tree_cost`s are given: each tree's
  step as its own (a table each, its op and its update a call each), and a [D, K]
  gate with its [K] bias (a dense gradient) whose K log-probabilities a token adds to
  its K trees' and sums by a log-sum-exp (kept for the backward, with its gradient).
  With `head_cost` (the shared head's softmax, a tree of one node), that step too: the
  trees' costs are then of the tail's tokens alone. With `head_rank` r, each tree's
  correction of the head's `head_slots` logits: V `[D, K r]` and U `[K, r, S]` (dense
  gradients), their products forward and backward, and the K heads' `[K, T, S]`
  logits, each row a softmax in TensorFlow's ops (priced per logit as its softmax
  cross-entropy's: at V=1M that is most of what the corrections cost, 3.7-6.2 ms a step
  measured for two and three trees)."""
  D, T, K = int(hidden), int(tokens_per_step), len(tree_costs)
  gate = K * (D + 1)
  parts = list(tree_costs) + ([head_cost] if head_cost is not None else [])
  total = lambda field: sum(getattr(c, field) for c in parts)
  own = [Part("gate", gate, gate, True)]
  flops, activations, softmax_logits = 6.0 * T * D * K, 2 * T * K, 0.0
  if head_rank:
    corrections = K * head_rank * (D + head_slots)
    own.append(Part("head corrections", corrections, corrections, True))
    flops += 6.0 * T * corrections
    activations += T * K * (head_rank + head_slots)
    softmax_logits = float(K * T * head_slots)
  return Cost([p for c in parts for p in c.parts] + own,
              total("rows_touched"), total("flops") + flops,
              total("activations") + activations,
              softmax_logits=total("softmax_logits") + softmax_logits,
              calls=total("calls") + 2 * (len(parts) - 1) + (2 if head_rank else 0),
              node_visits=total("node_visits"), children_scored=total("children_scored"),
              small_node_flops=total("small_node_flops"), tree_flops=total("tree_flops"),
              tree_bytes=total("tree_bytes"))


def pytorch_cutoffs(num_classes, hidden, div_value=DIV_VALUE):
  """PyTorch-style fixed cutoffs, for comparison with the chosen ones: 2,000 x 10^i below
  V (a 2,000-class head, then clusters ten times larger each), as docs/adaptive.md's
  measured cases use them ([2000, 20000] at V=100K, [2000, 20000, 200000] at V=1M);
  clusters whose width int(D // div_value^(i+1)) would be 0 are merged into the one
  before. Below 2,001 classes, the demo's [V/8, V/2]. [] when V is too small for a
  tail."""
  cutoffs = []
  cutoff = 2000
  while cutoff < num_classes:
    cutoffs.append(cutoff)
    cutoff *= 10
  if not cutoffs:
    cutoffs = sorted({c for c in (num_classes // 8, num_classes // 2) if 0 < c})
  widths = tail_widths(hidden, len(cutoffs), div_value)
  return [c for c, w in zip(cutoffs, widths) if w >= 1]


def adaptive_head_cost(head_classes, hidden, tokens_per_step, head_bias=False):
  """The `Cost` of an adaptive softmax's head (NumPy arrays of `head_classes` broadcast):
  H = cutoffs[0] + n_clusters rows at width D score every token, a dense gradient, the
  [T, H] logits through the cross-entropy (once at the peak, as `full_softmax_cost`),
  the hidden states, one call."""
  H = np.asarray(head_classes, np.float64)
  D, T = int(hidden), int(tokens_per_step)
  elements = H * (D + bool(head_bias))
  return Cost([Part("head", elements, elements, True)], H, 6.0 * T * H * D,
              T * H + 2.0 * T * D, T * H, 1.0)


def adaptive_cluster_cost(size, mass, hidden, tokens_per_step, width, tail, index=0):
  """The `Cost` of one tail cluster of `size` classes holding `mass` of the probability,
  at `width` (NumPy arrays of `size` and `mass` broadcast, so that the cutoff search
  prices every candidate cluster at once).

  Its tokens (T mass of them, expected) are projected to the width through a dense
  [D, width] projection and scored against the cluster's table: every row (flat, a dense
  gradient) or the path of a `Tree.two_level` over its classes (two_level: per-edge
  biases, a sparse gradient). The tensors are read when one of the step's T tokens
  falls in the cluster, with probability 1 - (1 - mass)^T. The two-level tree is taken
  in closed form, as `Tree.two_level` builds it: K = ceil(sqrt(n)) groups of equal mass,
  so a token scores K + n / K rows, the root's K rows are read with the cluster and a
  group's rows when a token falls in it (probability 1 - (1 - mass / K)^T). One call.
  """
  n = np.asarray(size, np.float64)
  q = np.asarray(mass, np.float64)
  D, T, d = int(hidden), int(tokens_per_step), int(width)
  seen = shards.touch_probability(q, T)
  tokens = T * q
  projection = Part(f"projection {index}", np.full_like(seen, D * d), seen * D * d, True)
  macs = tokens * D * d
  # Its tokens' hidden states gathered, projected, and the projection's gradient.
  activations = tokens * (D + 2 * d)
  if tail == "flat":
    table = Part(f"tail {index}", n * d, seen * n * d, True)
    rows = seen * n
    macs = macs + tokens * n * d
    activations = activations + tokens * n  # its logits, their gradient written over them
    logits = tokens * n
  else:
    groups = np.ceil(np.sqrt(n))
    scored = groups + n / groups
    rows = groups * seen + n * shards.touch_probability(q / groups, T)
    table = Part(f"tail {index}", (groups + n) * (d + 1), rows * (d + 1), False, True)
    macs = macs + tokens * scored * d
    activations = activations + tokens * scored
    logits = np.zeros_like(seen)
    # tf_hsm's op on the tail's tree: two nodes a token (the root of K children, a group
    # of n / K), either walked when it has at most WALK_MAX_BRANCHING children.
    walked = (groups * (groups <= WALK_MAX_BRANCHING) +
              n / groups * (n / groups <= WALK_MAX_BRANCHING))
    return Cost([projection, table], rows, 6.0 * macs, activations, logits, 1.0,
                node_visits=2.0 * tokens, children_scored=tokens * scored,
                small_node_flops=6.0 * tokens * walked * d,
                tree_flops=6.0 * tokens * scored * d,
                # Its int64 index arrays (`tree_bytes`): a path of 2 steps (node and
                # slot each) per class, its slot, depth and path offset, and 2 entries
                # per slot.
                tree_bytes=8.0 * (9.0 * n + 4.0 * groups))
  return Cost([projection, table], rows, 6.0 * macs, activations, logits, 1.0)


def _total(costs):
  return Cost([Part(p.name, float(p.elements), float(p.touched), p.dense_grad, p.tree)
               for c in costs for p in c.parts],
              *(float(sum(getattr(c, f) for c in costs))
                for f in ("rows_touched", "flops", "activations", "softmax_logits",
                          "calls", "node_visits", "children_scored", "small_node_flops",
                          "tree_flops", "tree_bytes", "sampled_logits")))


def adaptive_cost(num_classes, hidden, tokens_per_step, cutoffs, div_value=DIV_VALUE,
                  tail="flat", counts=None, head_bias=False):
  """The `Cost` of a step of `AdaptiveSoftmax(num_classes, cutoffs, div_value, tail)`:
  its head (`adaptive_head_cost`) and each cluster (`adaptive_cluster_cost`), cluster i
  holding the classes [cutoffs[i], cutoffs[i+1]) at width int(D // div_value^(i+1)).
  `tf_hsm.planning.cutoffs.choose_cutoffs` minimises the step time `pricing.price`
  gives for it."""
  if tail not in TAILS:
    raise ValueError(f"tail must be one of {TAILS}, got {tail!r}")
  V, D, T = int(num_classes), int(hidden), int(tokens_per_step)
  cutoffs = [int(c) for c in cutoffs]
  if not cutoffs or cutoffs != sorted(set(cutoffs)) or cutoffs[0] <= 0 or cutoffs[-1] >= V:
    raise ValueError(f"cutoffs must be increasing ints in (0, {V}), got {cutoffs}")
  probs = probabilities(V, counts)
  widths = tail_widths(D, len(cutoffs), div_value)
  if min(widths) < 1:
    raise ValueError(f"div_value {div_value:g} leaves a cluster of width 0 at D={D}")
  bounds = cutoffs + [V]
  mass = np.add.reduceat(probs, bounds[:-1])
  costs = [adaptive_head_cost(cutoffs[0] + len(cutoffs), D, T, head_bias)]
  for i, width in enumerate(widths):
    costs.append(adaptive_cluster_cost(bounds[i + 1] - bounds[i], mass[i], D, T, width,
                                       tail, i))
  return _total(costs)

