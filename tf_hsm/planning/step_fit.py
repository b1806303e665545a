"""The step time of tf_hsm's training step on this machine, fitted to measured steps.

A roofline (FLOPs at the matmul rate, bytes at the read bandwidth) is a bound that
tf_hsm's step does not reach: the op's per-node matrix products run below a large GEMM's
rate (nodes of at most 8 children, walked one at a time, far below it), its gradient is
scattered rows, the optimizer's sparse update gathers and scatters them again, and a step
is a few dozen TensorFlow ops whose fixed cost dominates small batches. So the planner
times the step the way it runs: a few real training steps (`log_prob` forward and
backward with respect to the hidden states and the table, then `SparseSGD` on the
touched rows, in one `tf.function`: the bench's `sparse_sgd` step), on shapes chosen so
that each term dominates one of them, and fits seconds as a sum of

    FLOPs in nodes of more than 8 children, FLOPs in nodes of at most 8, bytes moved,
    node visits (a token's path nodes, summed over the step's tokens), children scored
    (their children: a logit, its exponential and gradient coefficient each), and 1

(`tf_hsm.planning.tree_work.TREE_STEP_TERMS`) times one coefficient each, by least squares on
relative error with the coefficients kept non-negative; the amounts are the planner's own
(`tf_hsm.planning.costs.tree_cost`, `moved_elements` for SGD, float32).
"""

import statistics
import time

import numpy as np

from tf_hsm.planning import costs
from tf_hsm.planning import tree_work
from tf_hsm.tree import Tree

# (classes, hidden, tokens, tree): what dominates each step's time.
SHAPES = (
    (1_000, 16, 16, "two_level"),         # the fixed cost: a handful of rows
    (4_096, 512, 8_192, "two_level"),     # large nodes' FLOPs: 128 children of 512 a token
    (300_000, 256, 128, "two_level"),     # bytes: ~60K rows of 257 read once each
    (100_000, 16, 2_048, "huffman2"),     # node visits: 17 a token, 2 children each
    (100_000, 256, 1_024, "huffman2"),    # small nodes' FLOPs
    (50_000, 128, 2_048, "two_level"),    # between them
    (400_000, 32, 4_096, "huffman32"),    # children scored at a narrow D
    (200_000, 128, 4_096, "huffman8"),
)
REPEATS = 7


def _tree(kind, num_classes, counts):
  if kind == "two_level":
    return Tree.two_level(num_classes)
  return Tree.huffman(counts, branching=int(kind[len("huffman"):]))


def _zipf(num_classes):
  return 1.0 / np.arange(1, num_classes + 1, dtype=np.float64)


def time_step(num_classes, hidden, tokens, kind, repeats=REPEATS, seed=0):
  """(median seconds of one training step, the tree) on Zipf(1) targets."""
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
  # SparseSGD's update, without Keras: the fused row update it runs on the CPU.
  library = loader.ops()
  learning_rate = tf.constant(1e-3, tf.float32)

  def sgd(gradient, variable):
    library.hsm_sparse_sgd_rows(variable.handle, variable.handle, gradient.indices,
                                gradient.values, learning_rate, tf.constant(0.0),
                                use_momentum=False, nesterov=False)

  @tf.function
  def step():
    with tf.GradientTape() as tape:
      tape.watch(h)
      loss = -tf.reduce_mean(ops.log_prob(h, w, b, tree, targets))
    dh, dw, db = tape.gradient(loss, [h, w, b])
    sgd(dw, w)
    sgd(db, b)
    return loss, dh

  step()[0].numpy()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    step()[0].numpy()
    times.append(time.perf_counter() - start)
  return statistics.median(times), tree


def features(tree, hidden, tokens, probs):
  """The amounts of `tf_hsm.planning.tree_work.tree_step_terms` (the constant left out) of a float32
  SGD step over `tree`, as the planner counts them."""
  cost = costs.tree_cost(tree, hidden, tokens, probs)
  moved = sum(costs.moved_elements(p, "sgd") for p in cost.parts)
  return tree_work.tree_step_terms(cost.flops, cost.small_node_flops,
                                 (moved + 2.0 * tokens * hidden) * 4.0,
                                 cost.node_visits, cost.children_scored)[:-1]


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
  for i, (num_classes, hidden, tokens, kind) in enumerate(shapes):
    if progress:
      progress(f"measuring this machine: tf_hsm's step {i + 1}/{len(shapes)} "
               f"(V={num_classes:,}, D={hidden}, T={tokens:,}, {kind})")
    seconds, tree = time_step(num_classes, hidden, tokens, kind, repeats)
    probs = _zipf(num_classes)
    rows.append(features(tree, hidden, tokens, probs / probs.sum()) + (seconds,))
  return fit(rows)
