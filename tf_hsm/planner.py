"""Sizing an output layer before training: memory, FLOPs, rows touched and step time of
each candidate (full softmax, sampled softmax, hierarchical softmax over several trees),
and the one to use.

    report = tf_hsm.plan(10_000_000, 300, 3200, counts=counts, optimizer="lazy_adam",
                         memory_budget=24 * 2**30)
    print(report.to_markdown())

    python -m tf_hsm.plan --classes 10M --hidden 300 --tokens 3200 --optimizer lazy_adam \\
        --memory 24GiB --zipf 1.0

The figures are expected values for a step of `tokens_per_step` tokens drawn from
`counts`, computed from the trees themselves: a node's children are read (and get a
gradient row) when at least one token visits the node, which a step of T tokens does with
probability 1 - (1 - p)^T, p the node's probability. Step time is a roofline:
max(FLOPs / matmul rate, bytes / read bandwidth) plus a per-call overhead, with the
machine's rates measured once and cached (or given, to plan for another machine); the
hierarchical-softmax rows use a linear model of FLOPs, bytes and node visits fitted to
tf_hsm's own training steps, measured with the rates (`tf_hsm._tree_step_fit`).
"""

import dataclasses
import json
import math
import os
import re
import time

import numpy as np

from tf_hsm import _shard_layout
from tf_hsm.adaptive import TAILS as ADAPTIVE_TAILS
from tf_hsm.adaptive import choose_cutoffs, tail_widths
from tf_hsm.tree import Tree

# Optimizer slots per table element, and whether its sparse update is lazy (touched rows
# only) with tf_hsm's optimizers.
OPTIMIZERS = {"sgd": 0, "momentum": 1, "adagrad": 1, "adam": 2, "lazy_adam": 2}
DTYPE_BYTES = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2}
SAMPLED = 1024  # tf.nn.sampled_softmax_loss's samples in the sampled-softmax row
CALLS_PER_STEP = 3  # forward+backward op, optimizer update, the step's own function
DIV_VALUE = 4.0  # the adaptive rows' div_value: PyTorch's default, docs/adaptive.md's cases
# What a training step allocates beyond its tensors (the executor's buffers, the
# allocator's per-thread arenas): 20-80 MB measured over `--verify`'s cases on 2 vCPUs
# (the worker's peak RSS less its tensors), at most 150 MB for full softmax.
STEP_WORKSPACE_BYTES = 48 * 2**20


@dataclasses.dataclass
class Machine:
  """Rates used for step time: matmul FLOP/s, streaming read bytes/s, seconds per call,
  seconds per logit of TensorFlow's softmax cross-entropy (forward and backward: its
  exponentials and divisions, which the matmul and read rates do not bound; 0 for a
  machine given by its datasheet rates only), and `tree_step`: tf_hsm's training step
  fitted on this machine, seconds per each of TREE_STEP_TERMS (`tf_hsm._tree_step_fit`);
  None prices tf_hsm's rows with the roofline instead."""
  matmul_flops: float
  read_bytes: float
  call_seconds: float
  source: str = "given"
  softmax_seconds: float = 0.0
  tree_step: tuple = None

  @classmethod
  def measure(cls):
    """Measures this machine (about 20 s): an output layer's float32 matmuls, a large
    reduction, an empty tf.function call, TensorFlow's softmax cross-entropy, and
    tf_hsm's training step (`tf_hsm._tree_step_fit`)."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    def best(fn, repeats):
      fn()
      times = []
      for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
      return min(times)

    # The matmul rate of an output layer's three products (logits, and the gradients of
    # the table and of the hidden states), at a table larger than the caches: on 2 vCPUs
    # about half a square 1024 x 1024 product's rate.
    tokens, dim, rows = 640, 512, 32768
    h = tf.random.normal([tokens, dim])
    table = tf.random.normal([rows, dim])

    @tf.function
    def matmul():
      logits = tf.matmul(h, table, transpose_b=True)
      return (tf.matmul(logits, h, transpose_a=True)[:1, :1] +
              tf.matmul(logits, table)[:1, :1])

    seconds = best(lambda: matmul().numpy(), 3)
    matmul_flops = 6.0 * tokens * dim * rows / seconds
    big = tf.random.normal([64 << 20])  # 256 MiB
    read = tf.function(lambda: tf.reduce_sum(big))
    read_seconds = best(lambda: read().numpy(), 5)
    empty = tf.function(lambda: tf.constant(0))
    call = best(lambda: empty(), 50)
    logits = tf.random.normal([256, 32768])
    labels = tf.zeros([256], tf.int64)

    @tf.function
    def softmax():
      with tf.GradientTape() as tape:
        tape.watch(logits)
        loss = tf.reduce_sum(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=labels, logits=logits))
      return tape.gradient(loss, logits)[:1, :1]

    softmax_seconds = best(lambda: softmax().numpy(), 5) / (256 * 32768)
    from tf_hsm import _tree_step_fit  # pylint: disable=import-outside-toplevel
    return cls(matmul_flops, big.shape[0] * 4 / read_seconds, call, "measured",
               softmax_seconds, _tree_step_fit.measure())

  @classmethod
  def cached(cls, path=None, refresh=False):
    """The measured machine, from `path` (default: the user's cache directory) if it was
    measured there before for this CPU (and not `refresh`), else measured now and saved.
    Measure on a quiet machine: other jobs lower the rates."""
    path = path or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "tf_hsm",
        "machine.json")
    key = _cpu_key()
    try:
      with open(path) as f:
        saved = json.load(f)
      if saved.get("cpu") == key and not refresh:
        return cls(saved["matmul_flops"], saved["read_bytes"], saved["call_seconds"],
                   "cached", saved["softmax_seconds"], tuple(saved["tree_step"]))
    except (OSError, ValueError, KeyError):
      pass
    machine = cls.measure()
    try:
      os.makedirs(os.path.dirname(path), exist_ok=True)
      with open(path, "w") as f:
        json.dump(dict(dataclasses.asdict(machine), cpu=key), f)
    except OSError:
      pass
    return machine


def _cpu_key():
  try:
    with open("/proc/cpuinfo") as f:
      model = re.search(r"model name\s*:\s*(.*)", f.read())
    return f"{model.group(1) if model else 'unknown'} x{os.cpu_count()}"
  except OSError:
    return f"unknown x{os.cpu_count()}"


@dataclasses.dataclass
class Report:
  """The plan: `rows` (one dict per candidate), `recommended` (a row's `method`) and
  `reason` (one line)."""
  rows: list
  recommended: str
  reason: str
  settings: dict

  def to_dict(self):
    return {"rows": self.rows, "recommended": self.recommended, "reason": self.reason,
            "settings": self.settings}

  def to_markdown(self):
    s = self.settings
    lines = [
        f"V={s['num_classes']:,}, D={s['hidden']}, T={s['tokens_per_step']:,} tokens a "
        f"step, {s['optimizer']}, {s['dtype']}"
        + (f", {s['num_shards']} shards" if s["num_shards"] > 1 else "")
        + (f", budget {_size(s['memory_budget'])}" if s["memory_budget"] else ""),
        "",
        "| method | params | grad | slots | peak | per shard | rows touched | GFLOP | "
        "MB moved | step | fits |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in self.rows:
      lines.append(
          f"| {row['method']} | {_size(row['param_bytes'])} | {_size(row['grad_bytes'])} | "
          f"{_size(row['slot_bytes'])} | {_size(row['peak_bytes'])} | "
          f"{_size(row['per_shard_bytes'])} | {row['rows_touched']:,.0f} | "
          f"{row['flops'] / 1e9:,.2f} | {row['bytes_moved'] / 1e6:,.0f} | "
          f"{_seconds(row['step_seconds'])} | {'yes' if row['fits'] else 'no'} |")
    lines += ["", f"Recommended: {self.recommended}: {self.reason}"]
    return "\n".join(lines)


def _size(value):
  if value is None:
    return "-"
  for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if value >= scale:
      return f"{value / scale:.2f} {unit}"
  return f"{value:.0f} B"


def _seconds(value):
  return f"{value * 1e3:.1f} ms" if value < 1 else f"{value:.2f} s"


def _probabilities(num_classes, counts):
  return _shard_layout.class_probabilities(num_classes, counts)


TREES = ("two_level", "three_level", "huffman2", "huffman8", "huffman32")


def _candidate_trees(num_classes, counts, names):
  """(name, tree) for the hierarchical-softmax rows."""
  trees = []
  huffman_counts = counts if counts is not None else np.ones(num_classes)
  for name in names:
    if name == "two_level":
      trees.append(("two_level(counts)" if counts is not None else "two_level",
                    Tree.two_level(num_classes, counts=counts)))
    elif name == "three_level":
      branching = max(2, math.ceil(num_classes ** (1 / 3)))
      trees.append((f"balanced({branching}), three levels",
                    Tree.balanced(num_classes, branching)))
    elif re.fullmatch(r"huffman\d+", name):
      k = int(name[len("huffman"):])
      if 2 <= k < num_classes:
        trees.append((f"huffman({k})", Tree.huffman(huffman_counts, branching=k)))
    else:
      raise ValueError(f"unknown tree {name!r}; known: {', '.join(TREES)} (huffmanK for "
                       "any K)")
  return trees


# Nodes of at most this many children go through the op's walked-node path (one fused
# loop of dot products and softmax a node; cc/core/visit_plan.h's kWalkMaxBranching),
# larger ones through its tiled logits: the two run at different rates.
WALK_MAX_BRANCHING = 8


def _tree_costs(tree, probs, tokens):
  """(expected children scored per token, of which in nodes of at most
  WALK_MAX_BRANCHING children, expected distinct rows a step, expected nodes on a
  token's path)."""
  node_p = _shard_layout.node_probabilities(tree, probs)
  sizes = np.diff(tree.child_begin)
  per_token = float(np.dot(node_p, sizes))  # sum over path nodes of their children
  small = sizes <= WALK_MAX_BRANCHING
  per_token_small = float(np.dot(node_p[small], sizes[small]))
  rows = float(np.dot(sizes, _shard_layout.touch_probability(node_p, tokens)))
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


def _distinct(probs, draws):
  """Expected distinct classes among `draws` samples of `probs`."""
  return float(np.sum(_shard_layout.touch_probability(probs, draws)))


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


def moved_elements(part, optimizer):
  """Elements a step moves for one `Part` (NumPy arrays broadcast): those read, read
  again by the backward, the gradient written, and the optimizer's read-modify-write of
  the elements it updates and their slots (all of them for a dense gradient or an
  optimizer that is not lazy)."""
  slots = OPTIMIZERS[optimizer]
  lazy = optimizer in ("sgd", "adagrad", "lazy_adam")
  grad = part.elements if part.dense_grad else part.touched
  updated = part.touched if (lazy and not part.dense_grad) else part.elements
  return 2 * part.touched + grad + 2 * updated * (1 + slots)


def step_terms(cost, optimizer, dtype, machine):
  """The parts of a step's time that add over the pieces of a layer (NumPy arrays
  broadcast): (FLOPs / matmul rate, bytes moved / read bandwidth, softmax, call and
  tree seconds). A step takes max(first, second + hidden states) + third +
  CALLS_PER_STEP calls (`price`); a search over layouts adds them up tier by tier.
  On a machine with a fitted `tree_step`, the work of a tree's table (a two-level
  tail's) is priced by that fit in the third term, not by the roofline: it runs in
  tf_hsm's op, not in a matmul (its fixed cost is the call's)."""
  b = DTYPE_BYTES[dtype]
  fitted = machine.tree_step is not None and any(p.tree for p in cost.parts)
  moved = sum(moved_elements(p, optimizer) for p in cost.parts
              if not (fitted and p.tree)) * b
  flops = cost.flops - (cost.tree_flops if fitted else 0.0)
  other = cost.softmax_logits * machine.softmax_seconds + cost.calls * machine.call_seconds
  if fitted:
    tree_moved = sum(moved_elements(p, optimizer) for p in cost.parts if p.tree) * b
    amounts = tree_step_terms(cost.tree_flops, cost.small_node_flops, tree_moved,
                              cost.node_visits, cost.children_scored)[:-1]
    other = other + sum(c * a for c, a in zip(machine.tree_step, amounts))
  return flops / machine.matmul_flops, moved / machine.read_bytes, other


def fixed_step_terms(hidden, tokens_per_step, dtype, machine):
  """What every layer's step adds to `step_terms`: the hidden states and their gradient
  (bytes seconds), and CALLS_PER_STEP calls."""
  moved = 2 * int(tokens_per_step) * int(hidden) * DTYPE_BYTES[dtype]
  return moved / machine.read_bytes, CALLS_PER_STEP * machine.call_seconds


def _machine(machine):
  if isinstance(machine, dict):
    machine = Machine(**machine)
  return machine or Machine.cached()


def price(method, cost, hidden, tokens_per_step, optimizer="sgd", dtype="float32",
          machine=None, memory_budget=None, num_shards=1, exact=True):
  """A planner row (a dict of bytes, FLOPs and seconds) for one layer's `Cost`.

  Per step: the touched elements read by the forward and the backward, their gradient
  written, the optimizer's read-modify-write of the elements and their slots (every
  element of a part whose update is dense), plus the hidden states and their gradient.
  Step time: max(FLOPs / matmul rate, bytes / read bandwidth) + the softmax
  cross-entropy's time per logit + CALLS_PER_STEP calls (and the layer's own); for a
  tree's row on a machine with a fitted `tree_step`, that fit's FLOPs, bytes moved, node
  visits and fixed cost instead (its op and sparse update do not run at the roofline).
  The peak adds a tree's index arrays and STEP_WORKSPACE_BYTES to the tensors.
  """
  if optimizer not in OPTIMIZERS:
    raise ValueError(f"optimizer must be one of {sorted(OPTIMIZERS)}, got {optimizer!r}")
  if dtype not in DTYPE_BYTES:
    raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {dtype!r}")
  machine = _machine(machine)
  b = DTYPE_BYTES[dtype]
  slots = OPTIMIZERS[optimizer]
  elements = sum(p.elements for p in cost.parts)
  grad_elements = sum(p.elements if p.dense_grad else p.touched for p in cost.parts)
  param, grad = elements * b, grad_elements * b
  slot = slots * param
  activation_bytes = cost.activations * b
  peak = param + grad + slot + activation_bytes + cost.tree_bytes + STEP_WORKSPACE_BYTES
  moved = (sum(moved_elements(p, optimizer) for p in cost.parts) +
           2 * int(tokens_per_step) * int(hidden)) * b
  if machine.tree_step is not None and cost.parts and all(p.tree for p in cost.parts):
    # tf_hsm's op and sparse update, as fitted to its steps on this machine.
    seconds = float(np.dot(machine.tree_step,
                           tree_step_terms(cost.flops, cost.small_node_flops, moved,
                                           cost.node_visits, cost.children_scored)))
  else:
    flop_seconds, byte_seconds, other_seconds = step_terms(cost, optimizer, dtype, machine)
    hidden_seconds, call_seconds = fixed_step_terms(hidden, tokens_per_step, dtype,
                                                    machine)
    seconds = (max(flop_seconds, byte_seconds + hidden_seconds) + other_seconds +
               call_seconds)
  per_shard = (param + slot) / num_shards + (
      grad + activation_bytes + cost.tree_bytes + STEP_WORKSPACE_BYTES
      if num_shards == 1 else 0)
  budget_bytes = per_shard if num_shards > 1 else peak
  return {"method": method, "param_bytes": param, "grad_bytes": grad, "slot_bytes": slot,
          "activation_bytes": activation_bytes, "tree_bytes": cost.tree_bytes,
          "node_visits": cost.node_visits, "small_node_flops": cost.small_node_flops,
          "children_scored": cost.children_scored,
          "peak_bytes": peak,
          "per_shard_bytes": per_shard, "rows_touched": cost.rows_touched,
          "flops": cost.flops, "bytes_moved": moved, "softmax_logits": cost.softmax_logits,
          "step_seconds": seconds,
          "fits": memory_budget is None or budget_bytes <= memory_budget, "exact": exact}


def full_softmax_cost(num_classes, hidden, tokens_per_step):
  """A [V, D+1] table, every row read, a dense gradient, and [T, V] logits: once at the
  peak, as TensorFlow's fused softmax cross-entropy writes their gradient over them and
  the table's gradient is made from it."""
  V, D, T = num_classes, hidden, tokens_per_step
  return Cost([Part("table", V * (D + 1), V * (D + 1), True)], V, 6.0 * T * V * D,
              T * V + 2 * T * D, T * V)


def sampled_softmax_cost(num_classes, hidden, tokens_per_step, probs,
                         num_sampled=SAMPLED):
  """The true classes' and the sampled classes' rows, a sparse gradient."""
  V, D, T = num_classes, hidden, tokens_per_step
  rows = min(V, _distinct(probs, T) + num_sampled)
  return Cost([Part("table", V * (D + 1), rows * (D + 1), False)], rows,
              6.0 * T * (num_sampled + 1) * D, T * (num_sampled + 1) + 2 * T * D,
              T * (num_sampled + 1))


def tree_cost(tree, hidden, tokens_per_step, probs):
  """A hierarchical softmax over `tree`: the children of every visited node are read and
  get a gradient row (sparse); the op keeps the logits of its large nodes for the
  gradient, one per visit and child."""
  D, T = hidden, tokens_per_step
  per_token, per_token_small, touched, path_nodes = _tree_costs(tree, probs, T)
  return Cost([Part("table", tree.num_slots * (D + 1), touched * (D + 1), False, True)],
              touched, 6.0 * T * D * per_token, T * per_token + 3 * T * D,
              tree_flops=6.0 * T * D * per_token,
              node_visits=T * path_nodes, children_scored=T * per_token,
              small_node_flops=6.0 * T * D * per_token_small,
              tree_bytes=tree_bytes(tree))


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


def _short_list(values):
  return "[" + ", ".join(f"{v:,}" for v in values) + "]"


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
  seen = _shard_layout.touch_probability(q, T)
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
    rows = groups * seen + n * _shard_layout.touch_probability(q / groups, T)
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
                          "tree_flops", "tree_bytes")))


def adaptive_cost(num_classes, hidden, tokens_per_step, cutoffs, div_value=DIV_VALUE,
                  tail="flat", counts=None, head_bias=False):
  """The `Cost` of a step of `AdaptiveSoftmax(num_classes, cutoffs, div_value, tail)`:
  its head (`adaptive_head_cost`) and each cluster (`adaptive_cluster_cost`), cluster i
  holding the classes [cutoffs[i], cutoffs[i+1]) at width int(D // div_value^(i+1)).
  `tf_hsm.adaptive.choose_cutoffs` minimises the step time `price` gives for it."""
  if tail not in ADAPTIVE_TAILS:
    raise ValueError(f"tail must be one of {ADAPTIVE_TAILS}, got {tail!r}")
  V, D, T = int(num_classes), int(hidden), int(tokens_per_step)
  cutoffs = [int(c) for c in cutoffs]
  if not cutoffs or cutoffs != sorted(set(cutoffs)) or cutoffs[0] <= 0 or cutoffs[-1] >= V:
    raise ValueError(f"cutoffs must be increasing ints in (0, {V}), got {cutoffs}")
  probs = _probabilities(V, counts)
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


def _adaptive_layouts(V, D, T, probs, optimizer, dtype, machine, tails, cutoffs,
                      div_value):
  """(method, cutoffs, tail) of the adaptive rows: the given cutoffs for each tail, or
  the cutoffs `choose_cutoffs` picks for each tail and, to compare with, flat tails at
  PyTorch-style fixed cutoffs."""
  if cutoffs is not None:
    return [(f"AdaptiveSoftmax {tail}, cutoffs", list(cutoffs), tail) for tail in tails]
  layouts = []
  for tail in tails:
    try:
      chosen = choose_cutoffs(probs, D, T, div_value, tail, machine, optimizer=optimizer,
                              dtype=dtype)
    except ValueError:  # D too narrow for a cluster of min_width, or V too small
      continue
    layouts.append((f"AdaptiveSoftmax {tail}, chosen cutoffs", chosen, tail))
  fixed = pytorch_cutoffs(V, D, div_value)
  if fixed and "flat" in tails:
    layouts.append(("AdaptiveSoftmax flat, PyTorch-style fixed cutoffs", fixed, "flat"))
  return layouts


def plan(num_classes, hidden, tokens_per_step, counts=None, optimizer="sgd",
         dtype="float32", memory_budget=None, num_shards=1, machine=None, trees=TREES,
         adaptive=ADAPTIVE_TAILS, cutoffs=None, div_value=DIV_VALUE):
  """Plans the output layer of a model: one row per candidate and a recommendation.

  Args:
    num_classes: V.
    hidden: D, the hidden size.
    tokens_per_step: T, tokens (outputs) in a training step.
    counts: class frequencies [V] (uniform if None); class ids by decreasing frequency
      for the adaptive rows, whose head holds the first classes.
    optimizer: one of "sgd", "momentum", "adagrad", "adam", "lazy_adam" (the table's
      optimizer; tf_hsm's sparse ones update touched rows only).
    dtype: "float32", "float64", "bfloat16" or "float16" (the table's).
    memory_budget: bytes available per device (per parameter server with num_shards),
      or None.
    num_shards: parameter servers the table and slots are split over.
    machine: a `Machine` (default: measured once and cached), or a dict of its fields.
    trees: the trees of the hierarchical-softmax rows: "two_level" (equal-mass clusters
      with counts), "three_level" (balanced, branching V^(1/3)), "huffmanK" (K-ary
      Huffman on the counts). Building them is most of the planner's time at 10M classes.
    adaptive: the tails of the `AdaptiveSoftmax` rows, of "flat" and "two_level" (() for
      none).
    cutoffs: the adaptive rows' cutoffs (default: for each tail those
      `tf_hsm.adaptive.choose_cutoffs` picks for this step, optimizer and machine, and
      one flat row at `pytorch_cutoffs`).
    div_value: the adaptive rows' div_value.

  Returns:
    A `Report`.
  """
  for name, value in (("num_classes", num_classes), ("hidden", hidden),
                      ("tokens_per_step", tokens_per_step), ("num_shards", num_shards)):
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
      raise ValueError(f"{name} must be a positive int, got {value!r}")
  if num_classes < 2:
    raise ValueError("num_classes must be at least 2")
  if optimizer not in OPTIMIZERS:
    raise ValueError(f"optimizer must be one of {sorted(OPTIMIZERS)}, got {optimizer!r}")
  if dtype not in DTYPE_BYTES:
    raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {dtype!r}")
  if (isinstance(div_value, bool) or not isinstance(div_value, (int, float, np.number)) or
      not math.isfinite(div_value) or div_value <= 0):
    raise ValueError(f"div_value must be a positive number, got {div_value!r}")
  if isinstance(adaptive, str):
    raise TypeError(f"adaptive must be a list of tails, got {adaptive!r}")
  for tail in adaptive:
    if tail not in ADAPTIVE_TAILS:
      raise ValueError(f"adaptive tails must be of {ADAPTIVE_TAILS}, got {tail!r}")
  machine = _machine(machine)
  V, D, T = int(num_classes), int(hidden), int(tokens_per_step)
  probs = _probabilities(V, counts)

  def row(method, cost, exact=True):
    return price(method, cost, D, T, optimizer, dtype, machine, memory_budget, num_shards,
                 exact)

  rows = [row("full softmax", full_softmax_cost(V, D, T)),
          row("sampled softmax", sampled_softmax_cost(V, D, T, probs), exact=False)]
  for name, tree in _candidate_trees(V, counts, trees):
    rows.append(row(f"HierarchicalSoftmax {name}", tree_cost(tree, D, T, probs)))
  for method, chosen, tail in _adaptive_layouts(V, D, T, probs, optimizer, dtype, machine,
                                                adaptive, cutoffs, div_value):
    widths = ", ".join(map(str, tail_widths(D, len(chosen), div_value)))
    rows.append(row(f"{method} {_short_list(chosen)}, div {div_value:g} (tail widths "
                    f"{widths})", adaptive_cost(V, D, T, chosen, div_value, tail, counts)))
  exact = [r for r in rows if r["exact"] and r["fits"]]
  if exact:
    best = min(exact, key=lambda r: r["step_seconds"])
    full = rows[0]
    reason = (f"the fastest exact layer that fits: {_seconds(best['step_seconds'])} a step "
              f"({full['step_seconds'] / best['step_seconds']:.0f}x full softmax), "
              f"{best['rows_touched']:,.0f} rows touched, peak {_size(best['peak_bytes'])}")
    recommended = best["method"]
  else:
    smallest = min(rows, key=lambda r: r["per_shard_bytes"])
    recommended = smallest["method"]
    reason = (f"nothing exact fits {_size(memory_budget)}; this one needs the least "
              f"({_size(smallest['per_shard_bytes'])}): add shards or memory")
  settings = {"num_classes": V, "hidden": D, "tokens_per_step": T, "optimizer": optimizer,
              "dtype": dtype, "memory_budget": memory_budget, "num_shards": num_shards,
              "machine": dataclasses.asdict(machine)}
  return Report(rows, recommended, reason, settings)


def recommend_tree(num_classes, hidden, tokens_per_step, counts=None, optimizer="sgd",
                   dtype="float32", memory_budget=None, machine=None, trees=TREES):
  """The `HierarchicalSoftmax` tree the planner prices fastest among `trees` (as `plan`
  builds them) that fits `memory_budget`, or the smallest when none fits.

  Returns:
    (tree, row): the `tf_hsm.Tree` and its planner row (a dict, as in `plan`'s rows).
  """
  V, D, T = int(num_classes), int(hidden), int(tokens_per_step)
  probs = _probabilities(V, counts)
  machine = _machine(machine)
  candidates = [(tree, price(f"HierarchicalSoftmax {name}", tree_cost(tree, D, T, probs),
                             D, T, optimizer, dtype, machine, memory_budget))
                for name, tree in _candidate_trees(V, counts, trees)]
  if not candidates:
    raise ValueError(f"no tree among {list(trees)} can be built for {V} classes")
  fitting = [c for c in candidates if c[1]["fits"]]
  if fitting:
    return min(fitting, key=lambda c: c[1]["step_seconds"])
  return min(candidates, key=lambda c: c[1]["peak_bytes"])


def parse_count(text):
  """'10M' -> 10000000, '3200' -> 3200, '1.5K' -> 1500."""
  match = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]?)\s*", str(text), re.IGNORECASE)
  if not match:
    raise ValueError(f"not a count: {text!r}")
  return int(float(match.group(1)) * {"": 1, "K": 10**3, "M": 10**6, "G": 10**9,
                                       "T": 10**12}[match.group(2).upper()])


def parse_bytes(text):
  """'24GiB' -> 24 * 2**30, '12GB' -> 12e9, '512MiB', '1000' (bytes)."""
  match = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]?)(i?)B?\s*", str(text), re.IGNORECASE)
  if not match:
    raise ValueError(f"not a size: {text!r}")
  power = " KMGT".index(match.group(2).upper() or " ")
  base = 1024 if match.group(3) else 1000
  return int(float(match.group(1)) * base**power)


def main(argv=None):
  import argparse  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  argv = sys.argv[1:] if argv is None else list(argv)
  if "--verify" in argv:
    from tf_hsm import planner_verify  # pylint: disable=import-outside-toplevel
    return planner_verify.main([a for a in argv if a != "--verify"])
  parser = argparse.ArgumentParser(prog="python -m tf_hsm.plan",
                                   description=__doc__.split("\n\n")[0])
  parser.add_argument("--classes", type=parse_count, required=True)
  parser.add_argument("--hidden", type=parse_count, required=True)
  parser.add_argument("--tokens", type=parse_count, required=True)
  parser.add_argument("--optimizer", default="sgd", choices=sorted(OPTIMIZERS))
  parser.add_argument("--dtype", default="float32", choices=sorted(DTYPE_BYTES))
  parser.add_argument("--memory", type=parse_bytes, default=None,
                      help="budget per device (per shard with --shards), e.g. 24GiB")
  group = parser.add_mutually_exclusive_group()
  group.add_argument("--counts", help="a .npy or text file of class counts")
  group.add_argument("--zipf", type=float, help="counts ~ 1 / rank^s")
  parser.add_argument("--shards", type=int, default=1)
  parser.add_argument("--machine", help="JSON with matmul_flops, read_bytes, call_seconds")
  parser.add_argument("--remeasure", action="store_true",
                      help="measure this machine again instead of using the cached rates")
  parser.add_argument("--json", action="store_true", help="print the report as JSON")
  parser.add_argument("--verify", action="store_true",
                      help="run the bench's cases and print predicted beside measured "
                           "figures (python -m tf_hsm.plan --verify --help)")
  args = parser.parse_args(argv)
  counts = None
  if args.counts:
    counts = np.load(args.counts) if args.counts.endswith(".npy") else np.loadtxt(args.counts)
  elif args.zipf is not None:
    counts = 1.0 / np.arange(1, args.classes + 1) ** args.zipf
  machine = json.loads(args.machine) if args.machine else (
      Machine.cached(refresh=True) if args.remeasure else None)
  report = plan(args.classes, args.hidden, args.tokens, counts=counts,
                optimizer=args.optimizer, dtype=args.dtype, memory_budget=args.memory,
                num_shards=args.shards, machine=machine)
  print(json.dumps(report.to_dict(), indent=1) if args.json else report.to_markdown())
  return 0
