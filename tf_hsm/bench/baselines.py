"""What TensorFlow users write today instead of tf_hsm: plain-TF reference implementations.

Every function takes the arguments of `tf_hsm.log_prob` (hidden [..., D], weights [S, D],
biases [S] or None, tree, targets [...]) and returns log P(targets | hidden) with the shape
of `targets`, differentiable with `tf.GradientTape`. They are the baselines of
`python -m tf_hsm.bench` and second opinions in the tests:

* `gather_log_prob`: `tf.gather` the children rows of every path node. Materialises
  [N, depth, branching, D]; variable depth and branching are padded to the tree's
  maximum, padded children get -inf logits and padded steps contribute 0.
* `embedding_lookup_log_prob`: the same math with `tf.nn.embedding_lookup`, the lookup
  placed on the CPU (where people put tables that do not fit on the accelerator).
* `map_fn_log_prob`: `tf.map_fn` over examples, each gathering its own path nodes' children.
* `dense_tree_log_prob`: every slot logit by one matmul [N, S], a per-node logsumexp with
  `tf.math.unsorted_segment_*`, then the path slots gathered.
* `full_softmax_log_prob`: a dense [C, D] class table and
  `tf.nn.sparse_softmax_cross_entropy_with_logits` (no tree).
* `sampled_softmax_loss`: `tf.nn.sampled_softmax_loss` (approximate; a loss, not a log-prob).

The padded index arrays are built from the tree once, cached on the tree object (as
`tf_hsm.ops` caches its tree tensors), so a timed call runs only the TF computation.
"""

import numpy as np
import tensorflow as tf

from tf_hsm.tree import Tree

__all__ = [
    "gather_log_prob", "embedding_lookup_log_prob", "map_fn_log_prob",
    "dense_tree_log_prob", "full_softmax_log_prob", "sampled_softmax_loss",
    "EXACT_BASELINES",
]

_CACHE_KEY = "_baseline_tensors"


# --------------------------------------------------------------------------- #
# Padded index arrays, built once per tree
# --------------------------------------------------------------------------- #


def _index_dtype(tree):
  """int32 when every slot/node/class id fits (halves the padded arrays), else int64."""
  largest = max(tree.num_slots, tree.num_nodes, tree.num_classes)
  return np.int32 if largest < 2**31 - 1 else np.int64


def _pad_rows(begin, values, num_rows, width, fill, dtype):
  """Scatters CSR rows (`values[begin[i]:begin[i+1]]`) into a [num_rows, width] array."""
  lengths = np.diff(begin)
  out = np.empty((num_rows, width), dtype)
  out[...] = np.asarray(fill, dtype).reshape(-1, 1) if np.ndim(fill) else fill
  rows = np.repeat(np.arange(num_rows, dtype=np.int64), lengths)
  cols = np.arange(values.size, dtype=np.int64) - np.repeat(begin[:-1], lengths)
  out[rows, cols] = values
  return out


def _build(tree, part):
  """NumPy arrays of one cache part.

  * "paths": class_nodes [C, L] (path nodes, padded with the root), class_pos [C, L]
    (position of the taken child within its node, padded with 0), class_depth [C].
  * "children": node_slots [M, B] (children slots, padded with the node's first slot),
    node_width [M].
  * "dense": class_slots [C, L] (taken slots, padded with slot 0), class_nodes, class_depth,
    slot_node [S].
  """
  idx = _index_dtype(tree)
  c, m = tree.num_classes, tree.num_nodes
  depth_max = tree.max_depth
  if part == "paths":
    pos = tree.path_slots - tree.child_begin[tree.path_nodes]
    return {
        "class_nodes": _pad_rows(tree.path_begin, tree.path_nodes, c, depth_max, 0, idx),
        "class_pos": _pad_rows(tree.path_begin, pos, c, depth_max, 0, idx),
        "class_depth": tree.class_depth.astype(idx),
    }
  if part == "children":
    first = tree.child_begin[:-1]
    slots = np.arange(tree.num_slots, dtype=np.int64)
    return {
        "node_slots": _pad_rows(tree.child_begin, slots, m, tree.max_branching, first, idx),
        "node_width": np.diff(tree.child_begin).astype(idx),
    }
  if part == "dense":
    return {
        "class_slots": _pad_rows(tree.path_begin, tree.path_slots, c, depth_max, 0, idx),
        "class_nodes": _pad_rows(tree.path_begin, tree.path_nodes, c, depth_max, 0, idx),
        "class_depth": tree.class_depth.astype(idx),
        "slot_node": tree.slot_node.astype(idx),
    }
  raise ValueError(f"unknown cache part {part!r}")


def _tree_arrays(tree, part):
  """The padded index tensors of one part, created once per tree (under init_scope, on
  the CPU, so every tf.function captures the same eager tensors)."""
  if not isinstance(tree, Tree):
    raise TypeError(f"tree must be a tf_hsm.Tree, got {type(tree).__name__}")
  cache = tree.__dict__.setdefault(_CACHE_KEY, {})
  if part not in cache:
    arrays = _build(tree, part)
    with tf.init_scope(), tf.device("/cpu:0"):
      cache[part] = {name: tf.constant(value) for name, value in arrays.items()}
  return cache[part]


def _flat_inputs(hidden, weights, biases, targets):
  """hidden as [N, D], targets as [N], plus targets' shape to restore at the end."""
  weights = tf.convert_to_tensor(weights)
  hidden = tf.convert_to_tensor(hidden, dtype_hint=weights.dtype)
  if biases is not None:
    biases = tf.convert_to_tensor(biases, dtype_hint=weights.dtype)
  targets = tf.convert_to_tensor(targets)
  shape = tf.shape(targets)
  dim = tf.shape(weights)[-1]
  return tf.reshape(hidden, [-1, dim]), weights, biases, tf.reshape(targets, [-1]), shape


def _padded_log_prob(hidden, weights, biases, tree, targets, lookup):
  """The padded-gather formulation shared by the gather and embedding_lookup baselines.

  Args:
    lookup: fn(table, ids) -> rows, e.g. tf.gather.
  """
  h, weights, biases, y, shape = _flat_inputs(hidden, weights, biases, targets)
  paths = _tree_arrays(tree, "paths")
  kids = _tree_arrays(tree, "children")
  nodes = tf.gather(paths["class_nodes"], y)                  # [N, L]
  pos = tf.gather(paths["class_pos"], y)                      # [N, L]
  depth = tf.gather(paths["class_depth"], y)                  # [N]
  slots = tf.gather(kids["node_slots"], nodes)                # [N, L, B]
  width = tf.gather(kids["node_width"], nodes)                # [N, L]
  rows = lookup(weights, slots)                               # [N, L, B, D]
  logits = tf.einsum("nlbd,nd->nlb", rows, h)
  if biases is not None:
    logits += lookup(biases, slots)
  branching = tf.shape(slots, out_type=width.dtype)[-1]
  valid = tf.range(branching) < width[..., tf.newaxis]
  logits = tf.where(valid, logits, tf.constant(-np.inf, logits.dtype))
  lse = tf.reduce_logsumexp(logits, axis=-1)                  # [N, L]
  taken = tf.gather(logits, pos, batch_dims=2)                # [N, L]
  steps = tf.range(tf.shape(nodes, out_type=depth.dtype)[-1]) < depth[:, tf.newaxis]
  per_step = tf.where(steps, taken - lse, tf.zeros_like(lse))
  return tf.reshape(tf.reduce_sum(per_step, axis=-1), shape)


# --------------------------------------------------------------------------- #
# Exact hierarchical-softmax baselines
# --------------------------------------------------------------------------- #


def gather_log_prob(hidden, weights, biases, tree, targets):
  """HSM log-probabilities by `tf.gather` of every path node's children rows.

  Materialises a [N, max_depth, max_branching, D] tensor (and its gradient).

  Args:
    hidden: [..., D] float tensor.
    weights: [tree.num_slots, D] table, one row per tree edge.
    biases: [tree.num_slots] or None.
    tree: a `tf_hsm.Tree`.
    targets: int class ids with hidden's leading shape.

  Returns:
    log P(targets | hidden), shaped like `targets`.
  """
  return _padded_log_prob(hidden, weights, biases, tree, targets, tf.gather)


def _cpu_embedding_lookup(table, ids):
  with tf.device("/cpu:0"):
    return tf.nn.embedding_lookup(table, ids)


def embedding_lookup_log_prob(hidden, weights, biases, tree, targets):
  """`gather_log_prob` with `tf.nn.embedding_lookup` on the CPU device.

  The usual workaround when the [N, depth, branching, D] gather runs out of accelerator
  memory: the table and the lookup stay on the host. Arguments as in `gather_log_prob`.
  """
  return _padded_log_prob(hidden, weights, biases, tree, targets, _cpu_embedding_lookup)


def map_fn_log_prob(hidden, weights, biases, tree, targets, parallel_iterations=1):
  """HSM log-probabilities by `tf.map_fn` over examples (serial by default).

  Each example gathers the children rows of its own path nodes, [L, B, D]. Fits in memory
  where `gather_log_prob` does not, at the price of a loop over the examples.

  Args:
    hidden, weights, biases, tree, targets: as in `gather_log_prob`.
    parallel_iterations: passed to `tf.map_fn`; 1 is what users write to bound memory.

  Returns:
    log P(targets | hidden), shaped like `targets`.
  """
  h, weights, biases, y, shape = _flat_inputs(hidden, weights, biases, targets)
  paths = _tree_arrays(tree, "paths")
  kids = _tree_arrays(tree, "children")
  steps_all = tf.range(tree.max_depth, dtype=paths["class_depth"].dtype)
  branch_all = tf.range(tree.max_branching, dtype=kids["node_width"].dtype)

  def one_example(args):
    h_i, y_i = args
    nodes = paths["class_nodes"][y_i]                        # [L]
    pos = paths["class_pos"][y_i]                            # [L]
    slots = tf.gather(kids["node_slots"], nodes)             # [L, B]
    width = tf.gather(kids["node_width"], nodes)             # [L]
    logits = tf.linalg.matvec(tf.gather(weights, slots), h_i)  # [L, B]
    if biases is not None:
      logits += tf.gather(biases, slots)
    valid = branch_all < width[:, tf.newaxis]
    logits = tf.where(valid, logits, tf.constant(-np.inf, logits.dtype))
    lse = tf.reduce_logsumexp(logits, axis=-1)
    taken = tf.gather(logits, pos, batch_dims=1)
    steps = steps_all < paths["class_depth"][y_i]
    return tf.reduce_sum(tf.where(steps, taken - lse, tf.zeros_like(lse)))

  out = tf.map_fn(one_example, (h, y), fn_output_signature=h.dtype,
                  parallel_iterations=parallel_iterations)
  return tf.reshape(out, shape)


def dense_tree_log_prob(hidden, weights, biases, tree, targets):
  """HSM log-probabilities from all S slot logits: one matmul, per-node logsumexp, gather.

  Computes z = weights @ h for every slot ([S, N], as much work as a full softmax over S
  rows), the stable logsumexp of every node's children with `tf.math.unsorted_segment_max`
  / `unsorted_segment_sum` over the slot -> node ids, then gathers the path slots.

  Arguments and result as in `gather_log_prob`.
  """
  h, weights, biases, y, shape = _flat_inputs(hidden, weights, biases, targets)
  dense = _tree_arrays(tree, "dense")
  slot_node = dense["slot_node"]
  num_nodes = tree.num_nodes
  logits = tf.matmul(weights, h, transpose_b=True)              # [S, N]
  if biases is not None:
    logits += biases[:, tf.newaxis]
  node_max = tf.stop_gradient(tf.math.unsorted_segment_max(logits, slot_node, num_nodes))
  shifted = tf.exp(logits - tf.gather(node_max, slot_node))
  lse = tf.math.log(tf.math.unsorted_segment_sum(shifted, slot_node, num_nodes)) + node_max
  slots = tf.gather(dense["class_slots"], y)                    # [N, L]
  nodes = tf.gather(dense["class_nodes"], y)                    # [N, L]
  depth = tf.gather(dense["class_depth"], y)                    # [N]
  example = tf.broadcast_to(tf.range(tf.shape(y, out_type=slots.dtype)[0])[:, tf.newaxis],
                            tf.shape(slots, out_type=slots.dtype))
  taken = tf.gather_nd(logits, tf.stack([slots, example], axis=-1))
  node_lse = tf.gather_nd(lse, tf.stack([nodes, example], axis=-1))
  steps = tf.range(tf.shape(slots, out_type=depth.dtype)[-1]) < depth[:, tf.newaxis]
  per_step = tf.where(steps, taken - node_lse, tf.zeros_like(node_lse))
  return tf.reshape(tf.reduce_sum(per_step, axis=-1), shape)


# --------------------------------------------------------------------------- #
# Flat softmax baselines (no tree)
# --------------------------------------------------------------------------- #


def full_softmax_log_prob(hidden, class_weights, class_biases, targets):
  """Exact log P(targets | hidden) of a flat softmax over a dense [C, D] class table.

  Args:
    hidden: [..., D] float tensor.
    class_weights: [C, D] table, row c for class c.
    class_biases: [C] or None.
    targets: int class ids with hidden's leading shape.

  Returns:
    log-probabilities shaped like `targets` (= -sparse softmax cross-entropy).
  """
  h, class_weights, class_biases, y, shape = _flat_inputs(hidden, class_weights,
                                                          class_biases, targets)
  logits = tf.matmul(h, class_weights, transpose_b=True)        # [N, C]
  if class_biases is not None:
    logits += class_biases
  xent = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
  return tf.reshape(-xent, shape)


def sampled_softmax_loss(hidden, class_weights, class_biases, targets, num_sampled,
                         seed=None):
  """`tf.nn.sampled_softmax_loss` per example: an approximate training loss.

  Classes are sampled from TF's default log-uniform (Zipfian) candidate sampler, which
  assumes classes sorted by decreasing frequency. The result is a loss (about
  -log P(target) plus sampling error), not a log-probability; the table's gradient is a
  `tf.IndexedSlices` over the true and sampled rows.

  Args:
    hidden: [..., D] float tensor.
    class_weights: [C, D] table.
    class_biases: [C] or None (zeros are used).
    targets: int class ids with hidden's leading shape.
    num_sampled: number of negative classes sampled per batch.
    seed: optional sampler seed.

  Returns:
    the per-example loss, shaped like `targets`.
  """
  h, class_weights, class_biases, y, shape = _flat_inputs(hidden, class_weights,
                                                          class_biases, targets)
  num_classes = class_weights.shape[0]
  if num_classes is None:
    raise ValueError("class_weights needs a static number of rows")
  if class_biases is None:
    class_biases = tf.zeros([num_classes], class_weights.dtype)
  labels = tf.cast(y, tf.int64)[:, tf.newaxis]
  num_sampled = min(int(num_sampled), num_classes)
  # The sampler tf.nn.sampled_softmax_loss uses by default, called here so that its
  # expected counts can take the table's dtype: the loss subtracts their logarithms from
  # the logits, and the sampler's float32 counts fail against a float64 table.
  sampled, true_count, sampled_count = tf.random.log_uniform_candidate_sampler(
      labels, num_true=1, num_sampled=num_sampled, unique=True, range_max=num_classes,
      seed=seed)
  loss = tf.nn.sampled_softmax_loss(
      weights=class_weights, biases=class_biases, labels=labels, inputs=h,
      num_sampled=num_sampled, num_classes=num_classes,
      sampled_values=(sampled, tf.cast(true_count, class_weights.dtype),
                      tf.cast(sampled_count, class_weights.dtype)))
  return tf.reshape(loss, shape)


# The baselines that compute exactly what tf_hsm.log_prob computes, by name.
EXACT_BASELINES = {
    "gather": gather_log_prob,
    "embedding_lookup": embedding_lookup_log_prob,
    "map_fn": map_fn_log_prob,
    "dense_tree": dense_tree_log_prob,
}
