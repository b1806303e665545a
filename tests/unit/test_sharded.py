"""Tables held in pieces (a ShardedVariable, or a list of row ranges): every op and its
gradients equal the whole table's, bit for bit, and each piece's gradient names only its
own touched rows."""

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.distribute.sharded_variable import ShardedVariable

import tf_hsm
from oracle import random_inputs, random_mixed_tree, trees_of_every_kind

import support


def _cuts(rng, rows, count):
  """Row offsets of `count` consecutive ranges of unequal sizes covering `rows` rows."""
  inner = np.sort(rng.choice(np.arange(1, rows), count - 1, replace=False))
  return [0, *inner.tolist(), rows]


def _split(array, offsets, as_list):
  parts = [tf.Variable(array[a:b]) for a, b in zip(offsets[:-1], offsets[1:])]
  return parts if as_list else ShardedVariable(parts)



def _trees(rng):
  return [tree for _, tree in trees_of_every_kind(rng)][:6] + [random_mixed_tree(rng)]


@pytest.mark.parametrize("count", [1, 2, 3, 7])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_training_ops_on_pieces_equal_whole_table(rng, count, dtype):
  for index, tree in enumerate(_trees(rng)):
    if tree.num_slots < count:
      continue
    hidden, weights, biases, targets = random_inputs(rng, tree, (37,), 6, dtype)
    offsets = _cuts(rng, tree.num_slots, count)
    as_list = index % 2 == 0
    w_parts, b_parts = _split(weights, offsets, as_list), _split(biases, offsets, as_list)
    pieces = list(w_parts) if as_list else w_parts.variables
    bias_pieces = list(b_parts) if as_list else b_parts.variables
    whole_w, whole_b = tf.Variable(weights), tf.Variable(biases)
    hidden = tf.constant(hidden)
    for op in (tf_hsm.log_prob, tf_hsm.nll_loss):
      with tf.GradientTape(persistent=True) as tape:
        tape.watch(hidden)
        expected = op(hidden, whole_w, whole_b, tree, targets)
        got = op(hidden, w_parts, b_parts, tree, targets)
      np.testing.assert_array_equal(got.numpy(), expected.numpy())
      ref = tape.gradient(expected, [hidden, whole_w, whole_b])
      grads = tape.gradient(got, [hidden] + pieces + bias_pieces)
      np.testing.assert_array_equal(grads[0].numpy(), ref[0].numpy())
      piece_grads = grads[1:1 + count]
      bias_grads = grads[1 + count:]
      for grad in piece_grads + bias_grads:
        assert grad is None or isinstance(grad, tf.IndexedSlices)
      np.testing.assert_array_equal(
          np.concatenate([support.dense(g, p.shape) for g, p in zip(piece_grads, pieces)]),
          support.dense(ref[1], weights.shape))
      np.testing.assert_array_equal(
          np.concatenate([support.dense(g, p.shape) for g, p in zip(bias_grads, bias_pieces)]),
          support.dense(ref[2], biases.shape))
      # Only touched rows, each once, travel to a piece.
      for grad, piece in zip(piece_grads, pieces):
        if grad is not None:
          ids = grad.indices.numpy()
          assert len(np.unique(ids)) == len(ids) <= piece.shape[0]


def test_pieces_get_only_the_rows_of_the_batch_paths(rng):
  tree = tf_hsm.Tree.two_level(400)
  hidden, weights, _, targets = random_inputs(rng, tree, (5,), 4, np.float32)
  pieces = [tf.Variable(weights[a:b]) for a, b in zip(*(lambda o: (o[:-1], o[1:]))(
      _cuts(rng, tree.num_slots, 3)))]
  with tf.GradientTape() as tape:
    loss = tf_hsm.nll_loss(hidden, pieces, None, tree, targets)
  grads = tape.gradient(loss, pieces)
  touched = set()
  for cls in targets:
    for node, _ in tree.path(int(cls)):
      touched.update(range(*tree.child_range(node)))
  offset, got = 0, set()
  for grad, piece in zip(grads, pieces):
    if grad is not None:
      got.update((grad.indices.numpy() + offset).tolist())
    offset += piece.shape[0]
  assert got == touched


@pytest.mark.parametrize("count", [2, 3])
def test_inference_ops_on_pieces_equal_whole_table(rng, count):
  tree = random_mixed_tree(rng)
  hidden, weights, biases, _ = random_inputs(rng, tree, (9,), 5, np.float32)
  offsets = _cuts(rng, tree.num_slots, count)
  w_parts, b_parts = _split(weights, offsets, False), _split(biases, offsets, True)
  candidates = rng.integers(0, tree.num_classes, (9, 4))
  k = min(3, tree.num_classes)
  for whole, split in [
      (tf_hsm.log_prob_candidates(hidden, weights, biases, tree, candidates),
       tf_hsm.log_prob_candidates(hidden, w_parts, b_parts, tree, candidates)),
      (tf_hsm.log_prob_all(hidden, weights, biases, tree),
       tf_hsm.log_prob_all(hidden, w_parts, b_parts, tree)),
      (tf_hsm.top_k(hidden, weights, biases, tree, k)[1],
       tf_hsm.top_k(hidden, w_parts, b_parts, tree, k)[1]),
      (tf_hsm.sample(hidden, weights, biases, tree, seed=3),
       tf_hsm.sample(hidden, w_parts, b_parts, tree, seed=3))]:
    np.testing.assert_array_equal(split.numpy(), whole.numpy())


def test_layer_reads_a_sharded_kernel(rng):
  tree = tf_hsm.Tree.huffman(rng.integers(1, 50, 120), branching=3)
  layer = tf_hsm.HierarchicalSoftmax(tree)
  hidden = tf.constant(rng.normal(size=(8, 6)), tf.float32)
  targets = rng.integers(0, tree.num_classes, 8)
  expected = layer(hidden, targets)
  offsets = _cuts(rng, tree.num_slots, 3)
  kernel = ShardedVariable([tf.Variable(layer.kernel.numpy()[a:b])
                            for a, b in zip(offsets[:-1], offsets[1:])])
  got = tf_hsm.log_prob(hidden, kernel, layer.bias, tree, targets)
  np.testing.assert_array_equal(got.numpy(), expected.numpy())


def test_gradients_join_pieces_into_one_gradient(rng):
  tree = tf_hsm.Tree.balanced(60, 4)
  hidden, weights, _, targets = random_inputs(rng, tree, (11,), 3, np.float64)
  offsets = _cuts(rng, tree.num_slots, 3)
  sharded = _split(weights, offsets, False)
  whole = tf.Variable(weights)
  other = tf.Variable(np.ones(3))
  with tf.GradientTape(persistent=True) as tape:
    got = tf_hsm.nll_loss(hidden * other, sharded, None, tree, targets)
    expected = tf_hsm.nll_loss(hidden * other, whole, None, tree, targets)
  joined, other_grad = tf_hsm.distribute.gradients(tape, got, [sharded, other])
  ref, ref_other = tape.gradient(expected, [whole, other])
  assert isinstance(joined, tf.IndexedSlices)
  np.testing.assert_array_equal(tf.convert_to_tensor(joined).numpy(),
                                tf.convert_to_tensor(ref).numpy())
  np.testing.assert_array_equal(other_grad.numpy(), ref_other.numpy())


def test_pieces_that_do_not_make_the_table_are_errors(rng):
  tree = tf_hsm.Tree.balanced(30, 3)
  hidden, weights, _, targets = random_inputs(rng, tree, (4,), 3, np.float32)
  with pytest.raises(ValueError, match="weights has 20 rows in all"):
    tf_hsm.log_prob(hidden, [tf.Variable(weights[:20])], None, tree, targets)
  with pytest.raises(ValueError, match="share their row width"):
    tf_hsm.log_prob(hidden, [tf.Variable(weights[:20]), tf.Variable(weights[20:, :2])],
                    None, tree, targets)
  with pytest.raises(ValueError, match="empty list"):
    tf_hsm.log_prob(hidden, [], None, tree, targets)
  with pytest.raises(tf.errors.InvalidArgumentError, match="targets must be in"):
    tf_hsm.log_prob(hidden, [tf.Variable(weights)], None, tree, targets + 100)
  with pytest.raises(TypeError, match="sgd_step updates one variable"):
    tf_hsm.sgd_step(hidden, [tf.Variable(weights)], None, tree, targets, 0.1)


def test_pieces_in_a_function_and_an_empty_batch(rng):
  tree = tf_hsm.Tree.huffman(rng.integers(1, 30, 40))
  hidden, weights, biases, targets = random_inputs(rng, tree, (6,), 4, np.float32)
  pieces = [tf.Variable(weights[:10]), tf.Variable(weights[10:])]

  @tf.function
  def loss(h, y):
    return tf_hsm.nll_loss(h, pieces, None, tree, y)

  np.testing.assert_array_equal(loss(hidden, targets).numpy(),
                                tf_hsm.nll_loss(hidden, weights, None, tree, targets).numpy())
  empty = tf_hsm.log_prob(hidden[:0], pieces, None, tree, targets[:0])
  assert empty.shape == (0,)


@pytest.mark.parametrize("as_list", [True, False])
def test_a_table_stored_in_a_row_layout_gives_the_same_bits(rng, as_list):
  counts = rng.zipf(1.2, 500).astype(np.float64)
  tree = tf_hsm.Tree.huffman(counts, branching=4)
  layout = tf_hsm.distribute.balanced_layout(tree, 3, 64, counts=counts)
  hidden, weights, biases, targets = random_inputs(rng, tree, (64,), 5, np.float64)
  offsets = [int(o) for o in np.linspace(0, tree.num_slots, 4).astype(int)]
  w_parts = _split(layout.stored(weights), offsets, as_list)
  b_parts = _split(layout.stored(biases), offsets, as_list)
  pieces = list(w_parts) if as_list else w_parts.variables
  whole_w = tf.Variable(weights)
  hidden = tf.constant(hidden)
  for op in (tf_hsm.log_prob, tf_hsm.nll_loss):
    with tf.GradientTape(persistent=True) as tape:
      expected = op(hidden, whole_w, biases, tree, targets)
      got = op(hidden, layout.table(w_parts), layout.table(b_parts), tree, targets)
    np.testing.assert_array_equal(got.numpy(), expected.numpy())
    ref = support.dense(tape.gradient(expected, whole_w), weights.shape)
    grads = tape.gradient(got, pieces)
    stored = np.concatenate([support.dense(g, p.shape) for g, p in zip(grads, pieces)])
    np.testing.assert_array_equal(stored[layout.slot_rows], ref)
  for whole, split in [
      (tf_hsm.log_prob_all(hidden, weights, biases, tree),
       tf_hsm.log_prob_all(hidden, layout.table(w_parts), layout.table(b_parts), tree)),
      (tf_hsm.top_k(hidden, weights, biases, tree, 3)[1],
       tf_hsm.top_k(hidden, layout.table(w_parts), layout.table(b_parts), tree, 3)[1])]:
    np.testing.assert_array_equal(split.numpy(), whole.numpy())


@pytest.mark.parametrize("builder", ["two_level_counts", "two_level", "huffman16"])
def test_balanced_layout_evens_out_the_rows_each_shard_serves(rng, builder):
  num_classes, tokens, shards = 40_000, 1_000, 4
  counts = 1.0 / np.arange(1, num_classes + 1)
  tree = {"two_level_counts": lambda: tf_hsm.Tree.two_level(num_classes, counts=counts),
          "two_level": lambda: tf_hsm.Tree.two_level(num_classes),
          "huffman16": lambda: tf_hsm.Tree.huffman(counts, branching=16)}[builder]()
  layout = tf_hsm.distribute.balanced_layout(tree, shards, tokens, counts=counts)
  assert sorted(layout.slot_rows.tolist()) == list(range(tree.num_slots))
  # Each node's children stay one run of rows.
  for node in rng.integers(0, tree.num_nodes, 20):
    begin, end = tree.child_range(int(node))
    rows = layout.slot_rows[begin:end]
    np.testing.assert_array_equal(rows, rows[0] + np.arange(end - begin))
  batches = [rng.choice(num_classes, tokens, p=counts / counts.sum()) for _ in range(4)]
  naive = np.mean([tf_hsm.distribute.rows_per_shard(tree, b, shards) for b in batches], 0)
  balanced = np.mean([tf_hsm.distribute.rows_per_shard(tree, b, shards, layout)
                      for b in batches], 0)
  assert balanced.max() / balanced.mean() <= 1.15
  assert balanced.max() / balanced.mean() < naive.max() / naive.mean()


def test_row_layout_checks_its_input(rng):
  tree = tf_hsm.Tree.balanced(20, 3)
  with pytest.raises(ValueError, match="num_shards"):
    tf_hsm.distribute.balanced_layout(tree, 0, 10)
  with pytest.raises(ValueError, match="tokens_per_step"):
    tf_hsm.distribute.balanced_layout(tree, 2, 0)
  with pytest.raises(ValueError, match="counts must have one entry per class"):
    tf_hsm.distribute.balanced_layout(tree, 2, 10, counts=np.ones(3))
  with pytest.raises(ValueError, match="permutation"):
    tf_hsm.distribute.RowLayout(tree, np.zeros(tree.num_slots), 2)


def test_shards_bench_reports_both_layouts(capsys):
  from tf_hsm.bench import shards  # pylint: disable=import-outside-toplevel
  assert shards.main(["--classes", "20000", "--shards", "3", "--tokens", "500",
                      "--branching", "8", "--batches", "2"]) == 0
  out = capsys.readouterr().out
  for tree in ("two_level_counts", "two_level", "huffman8"):
    assert f"| {tree} | tree order |" in out and f"| {tree} | balanced |" in out


def test_layer_with_a_row_layout(rng):
  counts = rng.zipf(1.2, 300).astype(np.float64)
  tree = tf_hsm.Tree.huffman(counts, branching=4)
  layout = tf_hsm.distribute.balanced_layout(tree, 2, 32, counts=counts)
  plain = tf_hsm.HierarchicalSoftmax(tree)
  laid = tf_hsm.HierarchicalSoftmax(tree, row_layout=layout)
  hidden = tf.constant(rng.normal(size=(16, 6)), tf.float32)
  targets = rng.integers(0, tree.num_classes, 16)
  plain.build(hidden.shape)
  laid.build(hidden.shape)
  laid.kernel.assign(layout.stored(plain.kernel.numpy()))
  laid.bias.assign(layout.stored(rng.normal(size=tree.num_slots).astype(np.float32)))
  plain.bias.assign(laid.bias.numpy()[layout.slot_rows])
  with tf.GradientTape(persistent=True) as tape:
    expected, got = plain(hidden, targets), laid(hidden, targets)
  np.testing.assert_array_equal(got.numpy(), expected.numpy())
  ref = tf.convert_to_tensor(tape.gradient(expected, plain.kernel)).numpy()
  grad = tf.convert_to_tensor(tape.gradient(got, laid.kernel)).numpy()
  np.testing.assert_array_equal(grad[layout.slot_rows], ref)
  np.testing.assert_array_equal(laid.top_k(hidden, 3)[1].numpy(),
                                plain.top_k(hidden, 3)[1].numpy())
  again = tf_hsm.HierarchicalSoftmax.from_config(laid.get_config())
  np.testing.assert_array_equal(again.row_layout.slot_rows, layout.slot_rows)
  with pytest.raises(TypeError, match="row_layout"):
    tf_hsm.HierarchicalSoftmax(tree, row_layout=[1, 2])
