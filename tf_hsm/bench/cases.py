"""Benchmark inputs: scenarios, trees, Zipf targets and the work counts of a case.

NumPy and `tf_hsm.Tree` only: shared by the bench driver and its worker processes, so
that every process rebuilds exactly the same targets from a seed.
"""

import dataclasses
import os

import numpy as np

from tf_hsm.tree import Tree

# Tree kinds: key -> label used in tables and plots.
TREE_LABELS = {
    "two_level": "2-level",
    "three_level": "3-level K=47",
    "huffman": "Huffman-2",
    "freq_two_level": "freq-2-level",
    "huffman8": "Huffman-8",
    "vectors32_head256": "vectors 32-ary head 256",
}
# The trees from vectors (`vectors_tree`) are built from random Gaussian vectors of this
# width and seed: the shape a rebuild (`Tree.from_vectors`) gives, its mass balanced, not
# a trained similarity.
TREE_VECTOR_DIM = 16
TREE_VECTOR_SEED = 0
# Kinds that need more classes than their head holds.
TREE_MIN_CLASSES = {"vectors32_head256": 257}

# tf_hsm.nll_loss: the loss and its gradient from one op (a tf_hsm variant, compared with
# tf_hsm's log_prob + tape).
NLL_LOSS = "tf_hsm_nll_loss"
TRAIN_METHODS = ("tf_hsm", NLL_LOSS, "gather", "embedding_lookup", "map_fn", "dense_tree",
                 "full_softmax", "sampled_softmax")
# Inference methods of the topk scenario. tf_hsm_log_prob_all computes every class's
# log-probability for each row (its roofline: one read of the whole table, one write of
# the [rows, C] output).
LOG_PROB_ALL = "tf_hsm_log_prob_all"
TOPK_METHODS = ("tf_hsm_top_k", "dense_top_k", LOG_PROB_ALL)
# tf_hsm.sgd_step: forward, backward and SGD update fused, no gradient materialised. Runs
# in the memory scenario and, with --optimizer sgd, in every training scenario.
FUSED_SGD = "tf_hsm_sgd_step"
# tf_hsm.adam_step: the same with LazyAdam's row update. Runs when named and, with
# --optimizer lazy_adam, in every training scenario.
FUSED_ADAM = "tf_hsm_adam_step"
# HierarchicalSoftmax in a keras.Model compiled with tf_hsm.losses.nll: forward is the
# model's call, the step `model.train_on_batch` (forward, backward, the optimizer's update
# and Keras' own loss and metric bookkeeping, as `model.fit` runs each step). It always
# updates: with --optimizer, or tf_hsm.optimizers.SparseSGD when none is named.
KERAS_STEP = "tf_hsm_keras"
KERAS_DEFAULT_OPTIMIZER = "sparse_sgd"
# Methods a training scenario runs when named on the command line, beyond its own list.
EXTRA_TRAIN_METHODS = (FUSED_SGD, FUSED_ADAM, KERAS_STEP)
# The fused steps, and the --optimizer each implies.
FUSED_STEPS = {FUSED_SGD: "sgd", FUSED_ADAM: "lazy_adam"}
ALL_METHODS = TRAIN_METHODS + EXTRA_TRAIN_METHODS + TOPK_METHODS
# Methods over the [V, D] class table rather than the [S, D] slot table.
CLASS_TABLE_METHODS = ("full_softmax", "sampled_softmax", "dense_top_k")


@dataclasses.dataclass(frozen=True)
class Scenario:
  """One named scenario: every (V, T, tree) combination is a case.

  kind: "train" (log-prob fwd and fwd+bwd), "topk" (inference), or "mem" (fwd+bwd+SGD
  peak memory against the table size).
  """
  name: str
  kind: str
  vocab: tuple
  dim: int
  tokens: tuple
  trees: tuple
  methods: tuple = TRAIN_METHODS
  note: str = ""


# docs/performance.md, "Benchmark scenarios", plus the inference and memory scenarios.
FULL_SCENARIOS = {
    "A": Scenario("A", "train", (10_000,), 256, (1_120,), ("huffman", "two_level"),
                  note="PTB-like, 32x35 tokens"),
    "B": Scenario("B", "train", (100_000,), 512, (640, 2_560),
                  ("two_level", "three_level", "huffman"), note="32x20 and 128x20 tokens"),
    "C": Scenario("C", "train", (793_471,), 512, (320,),
                  ("two_level", "huffman", "freq_two_level"), note="One Billion Word vocab"),
    "D": Scenario("D", "train", (1_000_000, 3_000_000, 10_000_000), 300, (256, 3_200),
                  ("two_level", "huffman"), note="single output; 32x100 per timestep"),
    "E": Scenario("E", "train", (312_000,), 100, (1_024,), ("huffman",),
                  methods=TRAIN_METHODS + EXTRA_TRAIN_METHODS,
                  note="fastText-like; fastText's own step is an in-place SGD"),
    "topk": Scenario("topk", "topk", (1_000_000,), 64, (64,), ("two_level", "huffman"),
                     methods=TOPK_METHODS,
                     note="top-10 classes of 64 rows; log_prob_all of the same rows"),
    "mem": Scenario("mem", "mem", (2_000_000,), 300, (3_200,), ("two_level",),
                    methods=("tf_hsm", FUSED_SGD),
                    note="fwd+bwd+sparse SGD, peak RSS vs table"),
}

# --quick: the same scenarios, small enough that all of them run in ~2 minutes on 2 cores.
QUICK_SCENARIOS = {
    "A": Scenario("A", "train", (2_000,), 64, (128,), ("huffman",)),
    "B": Scenario("B", "train", (10_000,), 64, (64,), ("three_level",)),
    "C": Scenario("C", "train", (20_000,), 32, (64,), ("freq_two_level",)),
    "D": Scenario("D", "train", (50_000,), 32, (32,), ("two_level",)),
    "E": Scenario("E", "train", (20_000,), 32, (64,), ("huffman",),
                  methods=TRAIN_METHODS + EXTRA_TRAIN_METHODS),
    "topk": Scenario("topk", "topk", (100_000,), 64, (64,), ("two_level",),
                     methods=TOPK_METHODS),
    "mem": Scenario("mem", "mem", (200_000,), 64, (256,), ("two_level",),
                    methods=("tf_hsm", FUSED_SGD)),
}

SCENARIO_NAMES = tuple(FULL_SCENARIOS) + ("custom",)
TOPK_K = 10


# The bench's --optimizer choices, with the slot rows each reads and writes per touched
# row (for the roofline).
OPTIMIZER_SLOTS = {"sgd": 0, "sgd_momentum": 1, "adagrad": 1, "adam": 2, "sparse_sgd": 0,
                   "sparse_sgd_momentum": 1, "lazy_adam": 2, "sparse_adagrad": 1}


def step_optimizer(kind, method, optimizer):
  """The optimizer a method's timed step applies: a fused step's own (SGD, LazyAdam); the
  Keras step's --optimizer, SparseSGD by default; in the memory scenario --optimizer,
  Keras' SGD by default; elsewhere --optimizer."""
  if method in FUSED_STEPS:
    return FUSED_STEPS[method]
  if kind == "mem" and optimizer == "none":
    return "sgd"
  if method == KERAS_STEP and optimizer == "none":
    return KERAS_DEFAULT_OPTIMIZER
  return optimizer


def mutates_table(method, kind, optimizer):
  """Whether a method's timed step updates its table (an optimizer, the fused SGD step or
  the Keras step), so that it needs a table of its own."""
  if method in TOPK_METHODS:
    return False
  return method in EXTRA_TRAIN_METHODS or kind == "mem" or optimizer != "none"


def zipf_weights(num_classes):
  """Unnormalised Zipf(1) probabilities 1/rank of the frequency-sorted classes 0..V-1."""
  return 1.0 / np.arange(1, num_classes + 1, dtype=np.float64)


def zipf_targets(num_classes, num_tokens, seed):
  """Class ids drawn with P(c) proportional to 1/(c+1), by inverse CDF (fast at 10M);
  `seed` an int or a `np.random.Generator` (drawn from). Not `np.random.zipf(a)` clipped
  to the last class: its mass past V is most of it (at a = 1.0001 and V=1M, 72% of the
  draws), so a tree's targets would be one path, grouped at no cost."""
  cdf = np.cumsum(zipf_weights(num_classes))
  u = np.random.default_rng(seed).random(num_tokens) * cdf[-1]
  return np.minimum(np.searchsorted(cdf, u, side="right"), num_classes - 1).astype(np.int64)


def build_tree(kind, num_classes):
  """The tree of one kind over `num_classes` Zipf-sorted classes."""
  if kind == "two_level":
    return Tree.two_level(num_classes)
  if kind == "three_level":
    return Tree.balanced(num_classes, 47)
  if kind == "huffman":
    return Tree.huffman(zipf_weights(num_classes))
  if kind == "freq_two_level":
    return Tree.two_level(num_classes, counts=zipf_weights(num_classes))
  if kind == "huffman8":
    return Tree.huffman(zipf_weights(num_classes), branching=8)
  if kind == "vectors32_head256":
    return vectors_tree(num_classes, 32, 256)
  raise ValueError(f"unknown tree kind {kind!r}; known: {sorted(TREE_LABELS)}")


def vectors_tree(num_classes, branching, head):
  """`Tree.from_vectors` of TREE_VECTOR_DIM-wide Gaussian vectors (seed TREE_VECTOR_SEED)
  with Zipf(1) counts: the shape a rebuild gives, not a trained similarity."""
  rng = np.random.default_rng(TREE_VECTOR_SEED)
  vectors = rng.normal(size=(num_classes, TREE_VECTOR_DIM)).astype(np.float32)
  return Tree.from_vectors(vectors, zipf_weights(num_classes), branching, head=head)


def work_counts(tree, targets):
  """Exact work of one HSM step over `targets` (docs/performance.md roofline terms).

  Returns:
    dict with sum_k (sum over tokens and path nodes of the node's number of children),
    rows (distinct weight rows touched: the children of every visited node), nodes
    (distinct nodes visited), mean_depth.
  """
  widths = np.diff(tree.child_begin)
  class_cost = np.add.reduceat(widths[tree.path_nodes], tree.path_begin[:-1])
  unique = np.unique(targets)
  lengths = tree.class_depth[unique]
  offsets = np.cumsum(lengths) - lengths
  steps = np.arange(int(lengths.sum()), dtype=np.int64) + np.repeat(
      tree.path_begin[unique] - offsets, lengths)
  nodes = np.unique(tree.path_nodes[steps])
  return {
      "sum_k": int(class_cost[targets].sum()),
      "rows": int(widths[nodes].sum()),
      "nodes": int(nodes.size),
      "mean_depth": float(tree.class_depth[targets].mean()),
  }


def tree_summary(tree):
  depth = tree.class_depth
  return {
      "num_classes": tree.num_classes, "num_nodes": tree.num_nodes,
      "num_slots": tree.num_slots, "max_depth": tree.max_depth,
      "max_branching": tree.max_branching, "mean_class_depth": float(depth.mean()),
  }


def prepare_tree(kind, num_classes, path):
  """Builds a tree, saves it to `path` (workers load it) and returns its summary."""
  tree = build_tree(kind, num_classes)
  tmp = path + ".tmp"
  with open(tmp, "wb") as f:
    tree.save(f)
  os.replace(tmp, path)
  return tree, tree_summary(tree)


def case_work(tree, num_classes, num_tokens, seed, num_sampled):
  """Work counts of a case for every method family."""
  targets = zipf_targets(num_classes, num_tokens, seed)
  work = work_counts(tree, targets)
  work["unique_targets"] = int(np.unique(targets).size)
  work["sampled_rows"] = min(num_classes, work["unique_targets"] + int(num_sampled))
  return work


DTYPES = {"float32": 4, "float64": 8}  # --dtype choices and their bytes per element


def itemsize(case):
  """Bytes per element of a case's tables and hidden states (its --dtype)."""
  return DTYPES[case.get("dtype", "float32")]


def table_bytes(method, num_classes, num_slots, dim, itemsize=4):
  """Bytes of the parameter table(s) a method trains (weights and biases)."""
  rows = num_classes if method in CLASS_TABLE_METHODS else num_slots
  return rows * (dim + 1) * itemsize


def fmt_count(n):
  """10000 -> '10K', 793471 -> '793K', 10000000 -> '10M'."""
  for div, suffix in ((10**6, "M"), (10**3, "K")):
    if n >= div:
      value = n / div
      return f"{value:.3g}{suffix}" if value < 100 else f"{round(value)}{suffix}"
  return str(n)


def roofline_floor(flops, nbytes, gflops_rate, gbps_rate):
  """max(FLOPs / matmul rate, bytes / bandwidth), seconds (None without ceilings)."""
  if not gflops_rate or not gbps_rate:
    return None
  return max(flops / (gflops_rate * 1e9), nbytes / (gbps_rate * 1e9))


def method_work(method, case, optimizer):
  """(flops, bytes) of one method's forward and of its timed step, from docs/performance.md.

  HSM methods (tf_hsm and the exact baselines) are all charged the useful HSM work:
  forward 2*D*sum_k FLOPs, backward about twice that; bytes 4*D*|R| read forward, again
  backward, dW written, plus 4*T*D for h (8*T*D with dh), plus the optimizer's
  read-modify-write of the touched rows (and of its slot rows). Full softmax: 2*T*V*D
  forward, 6*T*V*D with backward; the whole table read twice and its dense gradient
  written. Sampled softmax: the HSM formulas with sum_k = T*(num_sampled+1) and R the
  true plus sampled rows.

  Returns:
    dict(fwd_flops, fwd_bytes, step_flops, step_bytes, rows).
  """
  d, t, v = case["dim"], case["tokens"], case["vocab"]
  work = case["work"]
  e = itemsize(case)
  opt_slots = OPTIMIZER_SLOTS.get(optimizer)
  if method == LOG_PROB_ALL:
    slots = case["tree_summary"]["num_slots"]
    rows, mults = slots, t * slots
    fwd_bytes = e * (d + 1) * slots + e * t * d + e * t * v
    step_bytes = fwd_bytes
  elif method in ("full_softmax", "dense_top_k"):
    rows, mults = v, t * v
    fwd_bytes = e * d * rows + e * t * d
    step_bytes = 3 * e * d * rows + 2 * e * t * d
  else:
    if method == "sampled_softmax":
      rows, mults = work["sampled_rows"], t * (min(v, case["num_sampled"]) + 1)
    else:
      rows, mults = work["rows"], work["sum_k"]
    fwd_bytes = e * d * rows + e * t * d
    step_bytes = 3 * e * d * rows + 2 * e * t * d
  if opt_slots is not None:
    step_bytes += 2 * e * d * rows * (1 + opt_slots)
  return {"fwd_flops": 2 * d * mults, "fwd_bytes": fwd_bytes,
          "step_flops": 6 * d * mults, "step_bytes": step_bytes, "rows": rows}
