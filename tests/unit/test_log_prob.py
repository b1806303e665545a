"""tf_hsm.log_prob and its gradient against the float64 reference, on every tree kind."""

import numpy as np
import pytest
import tensorflow as tf

import tf_hsm
from oracle import (chain_tree, log_prob_reference, random_inputs, random_mixed_tree,
                    trees_of_every_kind)

import support



@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-10), (np.float32, 2e-4)])
@pytest.mark.parametrize("batch_shape", [(13,), (2, 3, 4)])
@pytest.mark.parametrize("bias", [True, False])
def test_matches_reference_on_every_tree_kind(rng, dtype, tol, batch_shape, bias):
  for name, tree in trees_of_every_kind(rng):
    dim = int(rng.integers(1, 40))
    hidden, weights, biases, targets = random_inputs(rng, tree, batch_shape, dim, dtype, bias)
    w = tf.Variable(weights)
    b = tf.Variable(biases) if bias else None
    h = tf.constant(hidden)
    with tf.GradientTape() as tape:
      tape.watch(h)
      out = tf_hsm.log_prob(h, w, b, tree, targets)
      total = tf.reduce_sum(out)
    grads = tape.gradient(total, [h, w] + ([b] if bias else []))
    ref, dh, dw, db = log_prob_reference(hidden, weights, biases, tree, targets)
    assert out.shape == batch_shape and out.dtype == dtype, name
    np.testing.assert_allclose(out.numpy().ravel(), ref, rtol=tol, atol=tol, err_msg=name)
    np.testing.assert_allclose(grads[0].numpy().reshape(dh.shape), dh, rtol=tol, atol=tol,
                               err_msg=name)
    np.testing.assert_allclose(support.dense(grads[1], dw.shape, sparse=True), dw, rtol=tol,
                               atol=tol, err_msg=name)
    if bias:
      np.testing.assert_allclose(support.dense(grads[2], db.shape, sparse=True), db, rtol=tol, atol=tol,
                                 err_msg=name)


def test_random_mixed_trees_many_seeds(rng):
  for _ in range(15):
    tree = random_mixed_tree(rng, max_depth=int(rng.integers(1, 9)),
                             max_branching=int(rng.integers(1, 51)))
    hidden, weights, biases, targets = random_inputs(rng, tree, (int(rng.integers(0, 40)),), 7,
                                               np.float64)
    out = tf_hsm.log_prob(hidden, weights, biases, tree, targets)
    ref = log_prob_reference(hidden, weights, biases, tree, targets)[0]
    np.testing.assert_allclose(out.numpy(), ref, rtol=1e-10, atol=1e-10)


def test_gradient_is_sparse_over_touched_rows_only(rng):
  tree = tf_hsm.Tree.two_level(400)
  hidden, weights, biases, _ = random_inputs(rng, tree, (5,), 8, np.float32)
  targets = np.array([0, 1, 2, 1, 0])  # all in the first cluster
  w, b = tf.Variable(weights), tf.Variable(biases)
  with tf.GradientTape() as tape:
    loss = -tf.reduce_sum(tf_hsm.log_prob(hidden, w, b, tree, targets))
  gw, gb = tape.gradient(loss, [w, b])
  assert isinstance(gw, tf.IndexedSlices) and isinstance(gb, tf.IndexedSlices)
  root = tree.child_range(0)
  cluster = tree.child_range(tree.path(0)[1][0])
  expected = list(range(*root)) + list(range(*cluster))
  assert sorted(gw.indices.numpy().tolist()) == expected
  assert gw.values.shape == (len(expected), 8)


def test_one_level_tree_is_log_softmax(rng):
  tree = tf_hsm.Tree.from_nested(list(range(50)))
  hidden, weights, biases, targets = random_inputs(rng, tree, (9,), 6, np.float64)
  logits = hidden @ weights.T + biases
  expected = tf.nn.log_softmax(logits).numpy()[np.arange(9), targets]
  np.testing.assert_allclose(tf_hsm.log_prob(hidden, weights, biases, tree, targets), expected,
                             rtol=1e-12)


@pytest.mark.parametrize("make_tree", [
    lambda rng: random_mixed_tree(rng),
    lambda rng: tf_hsm.Tree.huffman(rng.integers(1, 100, size=80)),
    lambda rng: chain_tree(5, 3),
])
def test_probabilities_over_all_classes_sum_to_one(rng, make_tree):
  tree = make_tree(rng)
  hidden, weights, biases, _ = random_inputs(rng, tree, (3,), 10, np.float64)
  classes = np.arange(tree.num_classes)
  for row in hidden:
    lp = tf_hsm.log_prob(np.repeat(row[None], tree.num_classes, 0), weights, biases, tree,
                         classes)
    np.testing.assert_allclose(np.exp(lp.numpy()).sum(), 1.0, rtol=1e-12)


def test_numerical_gradients(rng):
  tree = random_mixed_tree(rng, max_depth=4, max_branching=5, p_internal=0.5, max_classes=30)
  hidden, weights, biases, targets = random_inputs(rng, tree, (4,), 3, np.float64)
  for argnum in range(3):
    def f(*args):
      full = [hidden, weights, biases]
      full[argnum] = args[0]
      return tf_hsm.log_prob(full[0], full[1], full[2], tree, targets)
    theoretical, numerical = tf.test.compute_gradient(f, [[hidden, weights, biases][argnum]])
    np.testing.assert_allclose(theoretical[0], numerical[0], rtol=1e-6, atol=1e-7)


def test_int32_targets_and_tf_function(rng):
  tree = tf_hsm.Tree.balanced(30, 4)
  hidden, weights, biases, targets = random_inputs(rng, tree, (6,), 5, np.float32)
  f = tf.function(lambda h, y: tf_hsm.log_prob(h, weights, biases, tree, y))
  out32 = f(tf.constant(hidden), tf.constant(targets, tf.int32))
  out64 = tf_hsm.log_prob(hidden, weights, biases, tree, targets.astype(np.int64))
  np.testing.assert_array_equal(out32.numpy(), out64.numpy())


def test_low_precision_hidden_is_computed_in_float32(rng):
  tree = tf_hsm.Tree.balanced(40, 5)
  hidden, weights, biases, targets = random_inputs(rng, tree, (8,), 16, np.float32)
  for low in (tf.bfloat16, tf.float16):
    h = tf.cast(hidden, low)
    out = tf_hsm.log_prob(h, weights, biases, tree, targets)
    assert out.dtype == low
    ref = log_prob_reference(tf.cast(h, tf.float32).numpy(), weights, biases, tree, targets)[0]
    np.testing.assert_allclose(tf.cast(out, tf.float32).numpy(), ref, rtol=2e-2, atol=2e-2)


def test_empty_batch(rng):
  tree = tf_hsm.Tree.balanced(10, 3)
  weights = rng.normal(size=(tree.num_slots, 4)).astype(np.float32)
  w = tf.Variable(weights)
  with tf.GradientTape() as tape:
    out = tf_hsm.log_prob(np.zeros((0, 4), np.float32), w, None, tree, np.zeros(0, np.int64))
    loss = tf.reduce_sum(out)
  assert out.shape == (0,)
  g = tape.gradient(loss, w)
  assert g.values.shape[0] == 0


def test_nan_in_one_row_stays_in_that_row(rng):
  tree = tf_hsm.Tree.huffman(rng.integers(1, 50, size=40))
  hidden, weights, biases, targets = random_inputs(rng, tree, (6,), 4, np.float32)
  hidden[2, 1] = np.nan
  out = tf_hsm.log_prob(hidden, weights, biases, tree, targets).numpy()
  assert np.isnan(out[2]) and np.all(np.isfinite(np.delete(out, 2)))


def test_deterministic_bits_across_runs_and_thread_counts(rng):
  tree = tf_hsm.Tree.two_level(3000)
  hidden, weights, biases, targets = random_inputs(rng, tree, (700,), 33, np.float32)
  w, b = tf.Variable(weights), tf.Variable(biases)

  def run():
    h = tf.constant(hidden)
    with tf.GradientTape() as tape:
      tape.watch(h)
      loss = tf.reduce_sum(tf_hsm.log_prob(h, w, b, tree, targets))
    gh, gw, gb = tape.gradient(loss, [h, w, b])
    return [loss.numpy(), gh.numpy(), gw.values.numpy(), gw.indices.numpy(), gb.values.numpy()]

  first = run()
  for _ in range(2):
    for a, c in zip(first, run()):
      assert a.tobytes() == c.tobytes()


def test_training_loop_lowers_the_loss(rng):
  tree = tf_hsm.Tree.huffman(rng.zipf(1.5, size=500).clip(max=10_000))
  dim = 16
  features = rng.normal(size=(256, dim)).astype(np.float32)
  targets = (np.abs(features[:, 0] * 40).astype(np.int64) + 7 * (features[:, 1] > 0)) % 500
  w = tf.Variable(0.01 * rng.normal(size=(tree.num_slots, dim)).astype(np.float32))
  b = tf.Variable(np.zeros(tree.num_slots, np.float32))
  opt = tf.keras.optimizers.SGD(0.5)

  @tf.function
  def step(h, y):
    with tf.GradientTape() as tape:
      loss = -tf.reduce_mean(tf_hsm.log_prob(h, w, b, tree, y))
    grads = tape.gradient(loss, [w, b])
    assert isinstance(grads[0], tf.IndexedSlices)
    opt.apply_gradients(zip(grads, [w, b]))
    return loss

  losses = [float(step(features, targets)) for _ in range(60)]
  assert losses[-1] < 0.7 * losses[0], losses[::10]


def _random_batch(seed, tokens, dim, num_classes):
  """float32 hidden states [tokens, dim] and targets [tokens] drawn from `seed`."""
  r = np.random.default_rng(seed)
  return (tf.constant(r.normal(size=(tokens, dim)).astype(np.float32)),
          tf.constant(r.integers(0, num_classes, size=tokens)))


def _check_reused_buffer_keeps_held_outputs(output_of, compare=1000):
  """output_of(seed) returns an op output of 4 MB or more, which the kernel writes into a
  buffer it reuses once nothing else references it: an output the caller still holds must
  survive the next call, and a call that may reuse the buffer gives the same bits."""
  first = output_of(1)
  assert first.shape.num_elements() * 4 >= 4 << 20   # large enough to be reused
  kept = first.numpy().copy()
  second = output_of(2)
  np.testing.assert_array_equal(first.numpy(), kept)
  assert not np.array_equal(second.numpy()[:compare], kept[:compare])
  del first, second
  np.testing.assert_array_equal(output_of(1).numpy(), kept)   # may now reuse the buffer
  return kept


def test_reused_gradient_buffer_never_overwrites_a_held_gradient(rng):
  tree = tf_hsm.Tree.two_level(20_000)
  dim = 128
  w = tf.Variable(rng.normal(size=(tree.num_slots, dim)).astype(np.float32))
  b = tf.Variable(rng.normal(size=tree.num_slots).astype(np.float32))

  def weight_grad(seed):
    h, y = _random_batch(seed, 3000, dim, 20_000)
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(tf_hsm.log_prob(h, w, b, tree, y))
    return tape.gradient(loss, w)

  kept = _check_reused_buffer_keeps_held_outputs(lambda seed: weight_grad(seed).values, compare=100)
  step = tf.function(lambda: weight_grad(1).values)
  for _ in range(3):
    np.testing.assert_array_equal(step().numpy(), kept)


def test_reused_saved_logits_buffer_never_overwrites_held_logits(rng):
  # The logits the forward saves for its gradient reuse a buffer the same way.
  from tf_hsm.ops import loader as _loader
  from tf_hsm.ops.inputs import tree_tensors
  tree = tf_hsm.Tree.two_level(20_000)
  t = tree_tensors(tree)
  tree_inputs = (t["child_begin"], t["path_begin"], t["path_nodes"], t["path_slots"])
  dim = 16
  w = tf.constant(rng.normal(size=(tree.num_slots, dim)).astype(np.float32))
  b = tf.constant(rng.normal(size=tree.num_slots).astype(np.float32))

  def saved_logits(seed):
    h, y = _random_batch(seed, 8000, dim, 20_000)
    return _loader.ops().hsm_log_prob_saving_logits(h, w, b, y, *tree_inputs)[1]

  _check_reused_buffer_keeps_held_outputs(saved_logits)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_gradient_from_the_forward_logits_is_the_recomputed_one(rng, dtype):
  """On the CPU log_prob keeps the grouped nodes' logits, the walked steps' coefficients
  and the tokens' directions for its gradient: the gradient is Hsm>LogProbGrad's (which
  computes them again) bit for bit; over the size limit the forward keeps none of them and
  the gradient op recomputes them; wrong-sized inputs are refused. The trees: mixed node
  sizes, grouped nodes only, and walked nodes only (binary Huffman, 4-ary balanced)."""
  from tf_hsm.ops import loader as _loader
  from tf_hsm.ops.inputs import tree_tensors
  ops = _loader.ops()
  huffman = tf_hsm.Tree.huffman(rng.zipf(1.3, size=2000).astype(np.float64))
  for tree in [random_mixed_tree(rng), tf_hsm.Tree.two_level(3000), tf_hsm.Tree.balanced(500, 30),
               huffman, tf_hsm.Tree.balanced(700, 4)]:
    t = tree_tensors(tree)
    tree_inputs = (t["child_begin"], t["path_begin"], t["path_nodes"], t["path_slots"])
    hidden, weights, biases, targets = random_inputs(rng, tree, (7, 40), 19, dtype, True)
    h, w, b, y = (tf.constant(v) for v in (hidden, weights, biases, targets))
    upstream = tf.constant(rng.normal(size=(7, 40)).astype(dtype))
    with tf.GradientTape() as tape:
      tape.watch([h, w, b])
      lp = tf_hsm.log_prob(h, w, b, tree, y)
    grads = tape.gradient(lp, [h, w, b], output_gradients=upstream)
    ref = ops.hsm_log_prob_grad(h, w, b, y, *tree_inputs, upstream)
    np.testing.assert_array_equal(grads[0].numpy(), ref[0].numpy())
    np.testing.assert_array_equal(grads[1].values.numpy(), ref[1].numpy())
    np.testing.assert_array_equal(grads[2].values.numpy(), ref[2].numpy())
    np.testing.assert_array_equal(grads[1].indices.numpy(), ref[3].numpy())
    lp_saving, saved, directions = ops.hsm_log_prob_saving_logits(h, w, b, y, *tree_inputs)
    assert saved.shape[0] > 0 and directions.shape == h.shape
    np.testing.assert_array_equal(lp_saving.numpy(), lp.numpy())
    _, none_kept, no_directions = ops.hsm_log_prob_saving_logits(h, w, b, y, *tree_inputs,
                                                                 max_saved_logits=0)
    assert none_kept.shape == (0,) and no_directions.shape == (0,)
    for kept, dirs in ((saved, directions), (none_kept, no_directions)):
      again = ops.hsm_log_prob_grad_from_logits(h, w, b, y, *tree_inputs, upstream, kept, dirs)
      for a, r in zip(again, ref):
        np.testing.assert_array_equal(a.numpy(), r.numpy())
    with pytest.raises(tf.errors.InvalidArgumentError, match="saved_logits must be"):
      ops.hsm_log_prob_grad_from_logits(h, w, b, y, *tree_inputs, upstream, saved[1:], directions)
    with pytest.raises(tf.errors.InvalidArgumentError, match="saved_directions must have"):
      ops.hsm_log_prob_grad_from_logits(h, w, b, y, *tree_inputs, upstream, saved, directions[1:])
    with pytest.raises(tf.errors.InvalidArgumentError, match="saved_directions must have"):
      ops.hsm_log_prob_grad_from_logits(h, w, b, y, *tree_inputs, upstream, none_kept, directions)


def test_log_prob_keeps_nothing_without_a_recording_tape(rng):
  """Without a recording tape log_prob runs the plain forward; a tf.function traced that
  way and differentiated under a tape outside it gets the same gradient bits as log_prob
  under a tape (which keeps logits and directions), and the same values to rounding."""
  tree = tf_hsm.Tree.two_level(3000)
  hidden, weights, biases, targets = random_inputs(rng, tree, (5, 30), 23, np.float32, True)
  h, w, b, y = (tf.constant(v) for v in (hidden, weights, biases, targets))
  upstream = tf.constant(rng.normal(size=(5, 30)).astype(np.float32))
  traced = tf.function(lambda x: tf_hsm.log_prob(x, w, b, tree, y))
  op_types = {op.type for op in traced.get_concrete_function(h).graph.get_operations()}
  assert "Hsm>LogProb" in op_types and "Hsm>LogProbSavingLogits" not in op_types
  with tf.GradientTape() as tape:
    tape.watch([h, w])
    plain = traced(h)
  plain_grads = tape.gradient(plain, [h, w], output_gradients=upstream)
  with tf.GradientTape() as tape:
    tape.watch([h, w])
    kept = tf_hsm.log_prob(h, w, b, tree, y)
  kept_grads = tape.gradient(kept, [h, w], output_gradients=upstream)
  np.testing.assert_allclose(plain.numpy(), kept.numpy(), rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(plain_grads[0].numpy(), kept_grads[0].numpy())
  np.testing.assert_array_equal(plain_grads[1].values.numpy(), kept_grads[1].values.numpy())
  np.testing.assert_array_equal(plain_grads[1].indices.numpy(), kept_grads[1].indices.numpy())


def test_large_tree_arrays_are_shared_with_their_tensors(rng, monkeypatch):
  """The ops' tensors of a large tree's arrays use the tree's own buffers (one copy of
  the values, not two); the arrays keep their values and stay read-only, and the op's
  results are those of copied tensors, bit for bit."""
  from tf_hsm.ops import inputs as _inputs  # pylint: disable=import-outside-toplevel
  num_classes = 200_000  # path arrays of 400K int64 values: over the sharing threshold
  shared, copied = tf_hsm.Tree.two_level(num_classes), tf_hsm.Tree.two_level(num_classes)
  before = {name: getattr(shared, name).copy() for name in ("slot_child", "path_nodes")}
  tensors = _inputs.tree_tensors(shared)
  for name, values in before.items():
    array = getattr(shared, name)
    np.testing.assert_array_equal(array, values)
    assert not array.flags.writeable
    assert array.ctypes.data % _inputs.TENSOR_ALIGNMENT == 0
    # Write through a private alias of the buffer: the tensor sees it.
    alias = np.ndarray(array.shape, np.int64, buffer=array.base,
                       offset=array.ctypes.data - array.base.ctypes.data)
    alias[3] += 1
    assert int(tensors[name][3]) == values[3] + 1
    alias[3] -= 1
  monkeypatch.setattr(_inputs, "SHARE_MIN_BYTES", 1 << 62)  # copies for the second tree
  _inputs.tree_tensors(copied)
  hidden = tf.constant(rng.normal(size=(64, 8)), tf.float32)
  weights = tf.constant(rng.normal(size=(shared.num_slots, 8)), tf.float32)
  targets = tf.constant(rng.integers(0, num_classes, 64))
  results = []
  for tree in (shared, copied):
    with tf.GradientTape() as tape:
      tape.watch([hidden, weights])
      out = tf_hsm.log_prob(hidden, weights, None, tree, targets)
    d_hidden, d_weights = tape.gradient(out, [hidden, weights])
    results.append([out.numpy(), d_hidden.numpy(), d_weights.values.numpy()])
  for a, b in zip(*results):
    np.testing.assert_array_equal(a, b)
  assert shared == copied


def test_saved_logits_are_the_same_bits_on_every_call(rng):
  """Every value of the forward's saved_logits output is written (a walked step through
  a node smaller than the widest walked one used to leave part of its stride as whatever
  the buffer held)."""
  from tf_hsm.ops import loader as _loader  # pylint: disable=import-outside-toplevel
  from tf_hsm.ops.inputs import tree_tensors  # pylint: disable=import-outside-toplevel
  counts = rng.zipf(1.3, 500).astype(np.float64)
  for tree in (tf_hsm.Tree.huffman(counts, branching=16), tf_hsm.Tree.balanced(300, 12)):
    t = tree_tensors(tree)
    tree_inputs = (t["child_begin"], t["path_begin"], t["path_nodes"], t["path_slots"])
    hidden, weights, biases, targets = random_inputs(rng, tree, (200,), 17, np.float32)
    first = _loader.ops().hsm_log_prob_saving_logits(hidden, weights, biases, targets,
                                                      *tree_inputs)[1].numpy()
    for _ in range(3):
      tf.fill([first.size + 7], np.float32(np.nan))  # leaves NaNs in freed buffers
      again = _loader.ops().hsm_log_prob_saving_logits(hidden, weights, biases, targets,
                                                        *tree_inputs)[1].numpy()
      np.testing.assert_array_equal(again.view(np.uint32), first.view(np.uint32))
