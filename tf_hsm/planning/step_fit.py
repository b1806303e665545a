"""The step time of tf_hsm's training step on this machine, fitted to measured steps.

A roofline (FLOPs at the matmul rate, bytes at the read bandwidth) is a bound that
tf_hsm's step does not reach: the op's per-node matrix products run below a large GEMM's
rate (nodes of at most 8 children, walked one at a time, far below it), its gradient is
scattered rows, the optimizer's sparse update gathers and scatters them again, and a step
is a few dozen TensorFlow ops whose fixed cost dominates small batches. So the planner
times the step the way it runs: a few real training steps (`log_prob` forward and
backward with respect to the hidden states and the table, then `SparseSGD`'s or
`LazyAdam`'s fused update of the touched rows, in one `tf.function`: the bench's
`sparse_sgd` and `lazy_adam` steps), on shapes chosen so that each term dominates one of
them, and fits seconds as a sum of

    FLOPs in nodes of more than 8 children, FLOPs in nodes of at most 8, bytes moved
    (but the slots'), the slots' bytes read and written, node visits (a token's path
    nodes, summed over the step's tokens), children scored (their children: a logit,
    its exponential and gradient coefficient each), and 1

(`tf_hsm.planning.tree_work.TREE_STEP_TERMS`) times one coefficient each, by least squares on
relative error with the coefficients kept non-negative; the amounts are the planner's own
(`tf_hsm.planning.costs.tree_cost`, `moved_elements` and `slot_elements`, float32). Two
shapes run twice, with SGD and with Adam: their difference is the slots'.
"""

import statistics
import time

import numpy as np

from tf_hsm.planning import costs
from tf_hsm.planning import tree_work
from tf_hsm.tree import Tree

# (classes, hidden, tokens, tree, optimizer): what dominates each step's time.
SHAPES = (
    (1_000, 16, 16, "two_level", "sgd"),         # the fixed cost: a handful of rows
    (4_096, 512, 8_192, "two_level", "sgd"),     # large nodes' FLOPs: 128 children of 512
    (300_000, 256, 128, "two_level", "sgd"),     # bytes: ~60K rows of 257 read once each
    (100_000, 16, 2_048, "huffman2", "sgd"),     # node visits: 17 a token, 2 children each
    (100_000, 256, 1_024, "huffman2", "sgd"),    # small nodes' FLOPs
    (50_000, 128, 2_048, "two_level", "sgd"),    # between them
    (400_000, 32, 4_096, "huffman32", "sgd"),    # children scored at a narrow D
    (200_000, 128, 4_096, "huffman8", "sgd"),
    (300_000, 256, 128, "two_level", "lazy_adam"),  # the slots' bytes: twice the rows'
    (200_000, 128, 4_096, "huffman8", "lazy_adam"),
)
OPTIMIZERS = ("sgd", "lazy_adam")
REPEATS = 7


def _tree(kind, num_classes, counts):
  if kind == "two_level":
    return Tree.two_level(num_classes)
  return Tree.huffman(counts, branching=int(kind[len("huffman"):]))


def _zipf(num_classes):
  return 1.0 / np.arange(1, num_classes + 1, dtype=np.float64)


def time_step(num_classes, hidden, tokens, kind, repeats=REPEATS, seed=0,
              optimizer="sgd"):
  """(median seconds of one training step, the tree) on Zipf(1) targets, updated by
  `optimizer` (OPTIMIZERS)."""
  if optimizer not in OPTIMIZERS:
    raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  from tf_hsm import ops  # pylint: disable=import-outside-toplevel
  from tf_hsm.ops import loader  # pylint: disable=import-outside-toplevel
  counts = _zipf(num_classes)
  tree = _tree(kind, num_classes, counts)
  rng = np.random.default_rng(seed)
  cdf = np.cumsum(counts)
  targets = tf.constant(np.minimum(np.searchsorted(cdf, rng.random(tokens) * cdf[-1]),
                                   num_classes - 1), tf.int64)
  h = tf.constant(rng.standard_normal((tokens, hidden)).astype(np.float32) * 0.1)
  w = tf.Variable(rng.standard_normal((tree.num_slots, hidden)).astype(np.float32) * 0.01)
  b = tf.Variable(tf.zeros([tree.num_slots]))
  update = _row_update(tf, loader.ops(), optimizer, [w, b])

  @tf.function
  def step():
    with tf.GradientTape() as tape:
      tape.watch(h)
      loss = -tf.reduce_mean(ops.log_prob(h, w, b, tree, targets))
    dh, dw, db = tape.gradient(loss, [h, w, b])
    update(dw, w)
    update(db, b)
    return loss, dh

  step()[0].numpy()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    step()[0].numpy()
    times.append(time.perf_counter() - start)
  return statistics.median(times), tree


def _row_update(tf, library, optimizer, variables):
  """update(gradient, variable): SparseSGD's or LazyAdam's fused row update (the one
  they run on the CPU) of one of `variables`, without Keras."""
  learning_rate = tf.constant(1e-3, tf.float32)
  if optimizer == "sgd":
    return lambda gradient, variable: library.hsm_sparse_sgd_rows(
        variable.handle, variable.handle, gradient.indices, gradient.values,
        learning_rate, tf.constant(0.0), use_momentum=False, nesterov=False)
  slots = {v.ref(): [tf.Variable(tf.zeros_like(v)) for _ in range(2)] for v in variables}

  def adam(gradient, variable):
    m, v = slots[variable.ref()]
    library.hsm_sparse_adam_rows(variable.handle, m.handle, v.handle, v.handle,
                                 gradient.indices, gradient.values, learning_rate,
                                 tf.constant(0.1), tf.constant(0.001),
                                 tf.constant(1e-7), amsgrad=False)
  return adam


def features(tree, hidden, tokens, probs, optimizer="sgd"):
  """The amounts of `tf_hsm.planning.tree_work.tree_step_terms` (the constant left out)
  of a float32 step over `tree` updated by `optimizer`, as the planner counts them."""
  cost = costs.tree_cost(tree, hidden, tokens, probs)
  moved = sum(costs.moved_elements(p, optimizer) for p in cost.parts)
  slot = sum(costs.slot_elements(p, optimizer) for p in cost.parts)
  return tree_work.tree_step_terms(cost.flops, cost.small_node_flops,
                                   (moved - slot + 2.0 * tokens * hidden) * 4.0,
                                   cost.node_visits, cost.children_scored,
                                   slot * 4.0)[:-1]


def fit(rows):
  """Non-negative least squares of seconds on (amounts..., 1) for `rows` of
  (amounts..., seconds): drops a coefficient that comes out negative and refits.
  Returns one coefficient an amount, then the constant's."""
  x = np.array([list(r[:-1]) + [1.0] for r in rows], np.float64)
  y = np.array([r[-1] for r in rows], np.float64)
  # Relative errors matter (a 1 ms step as much as a 100 ms one): weight each row by
  # 1 / its time. Scale the columns so that the solve is well conditioned.
  x, y = x / y[:, None], np.ones_like(y)
  scale = np.maximum(np.abs(x).max(axis=0), 1e-30)
  keep = list(range(x.shape[1]))
  while True:
    solution, *_ = np.linalg.lstsq(x[:, keep] / scale[keep], y, rcond=None)
    if (solution >= 0).all() or len(keep) == 1:
      break
    keep.pop(int(np.argmin(solution)))
  coefficients = np.zeros(x.shape[1])
  coefficients[keep] = np.maximum(solution, 0) / scale[keep]
  return tuple(float(c) for c in coefficients)


def measure(shapes=SHAPES, repeats=REPEATS, progress=None):
  """The coefficients of `tf_hsm.planning.tree_work.TREE_STEP_TERMS` fitted to `shapes`
  (`progress(text)` told before each)."""
  rows = []
  for i, (num_classes, hidden, tokens, kind, optimizer) in enumerate(shapes):
    if progress:
      progress(f"measuring this machine: tf_hsm's step {i + 1}/{len(shapes)} "
               f"(V={num_classes:,}, D={hidden}, T={tokens:,}, {kind}, {optimizer})")
    seconds, tree = time_step(num_classes, hidden, tokens, kind, repeats,
                              optimizer=optimizer)
    probs = _zipf(num_classes)
    rows.append(features(tree, hidden, tokens, probs / probs.sum(), optimizer) +
                (seconds,))
  return fit(rows)
