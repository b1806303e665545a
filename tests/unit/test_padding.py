"""Padding costs nothing: `tf_hsm.log_prob(..., skip_padding=True)` walks no path for a
target < 0 (log-probability 0, no gradient, no weight row of the gradient for it alone),
and `HierarchicalSoftmax` gives the op its padding that way, so a LazyAdam (plain or
fused) never moves a row that only padding visits. Checked against the op on the real
tokens alone and against the float64 reference, on fresh random trees."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_hsm

import oracle

D = 5


def _problem(rng, tokens=9):
  tree = oracle.random_mixed_tree(rng, max_depth=5, max_branching=12, max_classes=60)
  weights = rng.normal(size=(tree.num_slots, D))
  biases = rng.normal(size=tree.num_slots)
  hidden = rng.normal(size=(tokens, D))
  targets = rng.integers(0, tree.num_classes, tokens)
  targets[rng.random(tokens) < 0.4] = -1
  targets[0] = -1
  return tree, weights, biases, hidden, targets


def _value_and_grads(hidden, weights, biases, tree, targets, scale, **kwargs):
  hidden, weights, biases = (tf.Variable(x) for x in (hidden, weights, biases))
  with tf.GradientTape() as tape:
    out = tf_hsm.log_prob(hidden, weights, biases, tree, targets, **kwargs)
    total = tf.reduce_sum(out * scale)
  d_hidden, d_weights, d_biases = tape.gradient(total, [hidden, weights, biases])
  return out.numpy(), tf.convert_to_tensor(d_hidden).numpy(), d_weights, d_biases


@pytest.mark.parametrize("case", range(4))
def test_padding_is_skipped_and_the_rest_is_the_op_on_the_real_tokens(rng, case):
  del case  # a fresh tree each time
  tree, weights, biases, hidden, targets = _problem(rng)
  real = targets >= 0
  scale = rng.uniform(0.5, 2.0, len(targets))
  out, d_hidden, d_weights, d_biases = _value_and_grads(hidden, weights, biases, tree,
                                                        targets, scale, skip_padding=True)
  want, want_hidden, want_weights, want_biases = _value_and_grads(
      hidden[real], weights, biases, tree, targets[real], scale[real])
  np.testing.assert_array_equal(out[~real], 0.0)
  np.testing.assert_array_equal(out[real], want)
  np.testing.assert_array_equal(d_hidden[~real], 0.0)
  np.testing.assert_array_equal(d_hidden[real], want_hidden)
  # The same rows, no more: none for a padded token alone.
  np.testing.assert_array_equal(d_weights.indices, want_weights.indices)
  np.testing.assert_array_equal(d_weights.values, want_weights.values)
  np.testing.assert_array_equal(d_biases.values, want_biases.values)
  reference = oracle.log_prob_reference(hidden[real], weights, biases, tree, targets[real])
  np.testing.assert_allclose(out[real], reference[0], rtol=1e-12, atol=1e-12)


def test_without_a_tape_too(rng):
  tree, weights, biases, hidden, targets = _problem(rng)
  out = tf_hsm.log_prob(hidden, weights, biases, tree, targets, skip_padding=True).numpy()
  real = targets >= 0
  np.testing.assert_array_equal(out[~real], 0.0)
  np.testing.assert_allclose(out[real], oracle.log_prob_reference(
      hidden[real], weights, biases, tree, targets[real])[0], rtol=1e-12, atol=1e-12)


def test_a_batch_of_padding_alone(rng):
  tree, weights, biases, hidden, _ = _problem(rng)
  targets = -np.ones(len(hidden), np.int64)
  out, d_hidden, d_weights, _ = _value_and_grads(hidden, weights, biases, tree, targets,
                                                 1.0, skip_padding=True)
  assert not out.any() and not d_hidden.any() and d_weights.indices.shape == (0,)
  assert not tf_hsm.log_prob(hidden, weights, biases, tree, targets,
                             skip_padding=True).numpy().any()


def test_padding_is_still_an_error_without_skip_padding(rng):
  tree, weights, biases, hidden, targets = _problem(rng)
  with pytest.raises(tf.errors.InvalidArgumentError,
                     match=r"is not a class id.*\(targets < 0 are padding with skip_padding"):
    tf_hsm.log_prob(hidden, weights, biases, tree, targets)
  with pytest.raises(tf.errors.InvalidArgumentError, match="is not a class id"):
    tf_hsm.log_prob(hidden, weights, biases, tree,
                    np.where(targets < 0, tree.num_classes, targets), skip_padding=True)


def _fit(tree, x, y, fused):
  """The table after `fit` with LazyAdam on batches of 4 (hidden states as inputs)."""
  keras.utils.set_random_seed(5)
  hidden = keras.Input([D])
  targets = keras.Input([], dtype="int32")
  layer = tf_hsm.HierarchicalSoftmax(tree, fused_update=fused)
  model = keras.Model([hidden, targets], layer(hidden, targets))
  model.compile(optimizer=tf_hsm.optimizers.LazyAdam(0.1), loss=tf_hsm.losses.nll)
  model.fit([x, y], y, batch_size=4, epochs=1, shuffle=False, verbose=0)
  return layer.kernel.numpy()


@pytest.mark.parametrize("fused", [False, True])
def test_lazy_adam_moves_no_row_that_only_padding_visits(rng, fused):
  """Class 0's path is trained in the first batch; the second holds it only as padding
  (the layer's old way gave the op class 0 there, and LazyAdam moved those rows on
  their moments). The table ends as with the padding left out of the batch."""
  tree = tf_hsm.Tree.balanced(27, 3)  # classes 18-26 share only the root with class 0
  x = rng.normal(size=(8, D)).astype(np.float32)
  y = np.array([0, 0, 5, 9, 20, -1, -1, 26], np.int32)
  padded = _fit(tree, x, y, fused)
  first = _fit(tree, x[:4], y[:4], fused)  # the first batch alone
  class_zero_only = np.setdiff1d(_path_rows(tree, 0), np.concatenate(
      [_path_rows(tree, c) for c in (20, 26)]))
  assert class_zero_only.size
  np.testing.assert_array_equal(padded[class_zero_only], first[class_zero_only])


def _path_rows(tree, c):
  """Every weight row of the nodes on class c's path (the rows its step reads)."""
  begin, end = tree.path_begin[c], tree.path_begin[c + 1]
  return np.concatenate([np.arange(tree.child_begin[n], tree.child_begin[n + 1])
                         for n in tree.path_nodes[begin:end]])


def test_a_table_in_pieces_walks_no_path_for_padding(rng):
  """Pieces (here a list of row ranges) take the compact path: its batch tree is built
  from the real targets alone, and padding is -1 to the op there too. A batch of padding
  alone gathers no row: its gradients hold none."""
  tree, weights, biases, hidden, targets = _problem(rng, tokens=12)
  cut = tree.num_slots // 2
  pieces = [tf.Variable(weights[:cut]), tf.Variable(weights[cut:])]
  real = targets >= 0
  for batch in (targets, -np.ones_like(targets)):
    with tf.GradientTape() as tape:
      out = tf_hsm.log_prob(hidden, pieces, biases, tree, batch, skip_padding=True)
    grads = tape.gradient(out, pieces)
    rows = np.sort(np.concatenate([np.asarray(g.indices) + offset for g, offset in
                                   zip(grads, (0, cut)) if g is not None]))
    kept = batch >= 0
    np.testing.assert_array_equal(np.unique(rows), np.unique(np.concatenate(
        [_path_rows(tree, c) for c in batch[kept]] + [np.zeros(0, np.int64)])))
    np.testing.assert_array_equal(out.numpy()[~kept], 0.0)
  assert rows.size == 0  # the batch of padding alone
  out = tf_hsm.log_prob(hidden, pieces, biases, tree, targets, skip_padding=True).numpy()
  np.testing.assert_allclose(out[real], oracle.log_prob_reference(
      hidden[real], weights, biases, tree, targets[real])[0], rtol=1e-12, atol=1e-12)


def test_a_padded_token_s_gradient_is_zero_whatever_its_upstream(rng):
  """NaN or infinite upstream at padding (a 0/0 loss weight, say) gives a zero hidden
  gradient there, as the GPU kernels, which never read it."""
  for tree in (tf_hsm.Tree.huffman(rng.integers(1, 50, 40), 2), tf_hsm.Tree.flat(300)):
    tokens = 200  # a wide group at the flat tree's root
    hidden = tf.Variable(rng.normal(size=(tokens, D)).astype(np.float32))
    weights = rng.normal(size=(tree.num_slots, D)).astype(np.float32)
    targets = rng.integers(0, tree.num_classes, tokens)
    targets[::3] = -1
    upstream = np.ones(tokens, np.float32)
    upstream[0], upstream[3] = np.nan, np.inf
    with tf.GradientTape() as tape:
      out = tf_hsm.log_prob(hidden, weights, None, tree, targets, skip_padding=True)
    d_hidden = tape.gradient(out, hidden, output_gradients=tf.constant(upstream)).numpy()
    assert not d_hidden[::3].any() and np.isfinite(d_hidden).all()


def test_nll_loss_sgd_step_and_adam_step_skip_padding(rng):
  tree, weights, biases, hidden, targets = _problem(rng)
  real = targets >= 0
  hidden = hidden.astype(np.float32)
  weights, biases = weights.astype(np.float32), biases.astype(np.float32)
  # nll_loss: the mean over the real tokens, their rows only.
  losses, rows = [], []
  for h, t, skip in ((hidden, targets, True), (hidden[real], targets[real], False)):
    w = tf.Variable(weights)
    with tf.GradientTape() as tape:
      loss = tf_hsm.nll_loss(h, w, biases, tree, t, skip_padding=skip)
    losses.append(loss.numpy())
    rows.append(np.sort(tape.gradient(loss, w).indices.numpy()))
  np.testing.assert_allclose(losses[0], losses[1], rtol=1e-6)
  np.testing.assert_array_equal(rows[0], rows[1])
  # sgd_step and adam_step: the table as after a step on the real tokens alone.
  for step in ("sgd", "adam"):
    tables = []
    for h, t, skip in ((hidden, targets, True), (hidden[real], targets[real], False)):
      w, b = tf.Variable(weights), tf.Variable(biases)
      if step == "sgd":
        tf_hsm.sgd_step(h, w, b, tree, t, 0.5, skip_padding=skip)
      else:
        tf_hsm.adam_step(h, w, b, tree, t, tf_hsm.optimizers.LazyAdam(0.1),
                         skip_padding=skip)
      tables.append(w.numpy())
    np.testing.assert_allclose(tables[0], tables[1], rtol=1e-6, atol=1e-7, err_msg=step)
  # A batch of padding alone moves nothing, and counts the step.
  w, b = tf.Variable(weights), tf.Variable(biases)
  optimizer = tf_hsm.optimizers.LazyAdam(0.1)
  tf_hsm.adam_step(hidden, w, b, tree, targets[real][:1].repeat(len(targets)), optimizer)
  moved = w.numpy()
  tf_hsm.adam_step(hidden, w, b, tree, -np.ones_like(targets), optimizer, skip_padding=True)
  np.testing.assert_array_equal(w.numpy(), moved)
  assert int(optimizer.iterations) == 2


def test_a_batch_of_padding_alone_gathers_no_row_of_a_row_layout(rng):
  """A layer whose table has a row layout (the compact path, as a table in pieces) given
  padding alone: zeros, and gradients of no row for the kernel and the biases (each an
  empty IndexedSlices: no bias row moves on an optimizer's moments either)."""
  counts = rng.integers(1, 50, 40).astype(float)
  tree = tf_hsm.Tree.huffman(counts, 3)
  layout = tf_hsm.distribute.balanced_layout(tree, 2, 16, counts=counts)
  layer = tf_hsm.keras.HierarchicalSoftmax(tree, row_layout=layout)
  hidden = tf.constant(rng.normal(size=(4, 6, D)), tf.float32)
  layer.build(hidden.shape)
  for dtype in (np.int64, np.int32):
    with tf.GradientTape() as tape:
      out = layer(hidden, tf.constant(-np.ones((4, 6), dtype)))
    grads = tape.gradient(out, layer.trainable_weights)
    np.testing.assert_array_equal(out.numpy(), 0.0)
    assert [type(g).__name__ for g in grads] == ["IndexedSlices", "IndexedSlices"]
    assert all(g.indices.shape[0] == 0 for g in grads)
  targets = rng.integers(0, 40, (4, 6)).astype(np.int32)
  targets[0] = -1
  out = layer(hidden, tf.constant(targets)).numpy()  # int32 targets, some padding
  assert (out[0] == 0).all() and (out[1:] < 0).all()
