"""Tests for tf_hsm.AdaptiveSoftmax against a float64 NumPy reference written from the
definition of PyTorch's nn.AdaptiveLogSoftmaxWithLoss (and, for tree tails, from the
hierarchical softmax's definition)."""

import numpy as np
import pytest
import tensorflow as tf
import keras

import tf_hsm
from oracle import log_prob_reference
from tf_hsm.keras.adaptive import AdaptiveSoftmax


def log_softmax(x):
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def torch_state_dict(rng, num_classes, dim, cutoffs, div_value, head_bias):
  """Random weights named and shaped as PyTorch's module holds them."""
  bounds = list(cutoffs) + [num_classes]
  state = {"head.weight": rng.standard_normal((cutoffs[0] + len(cutoffs), dim)) * 0.5}
  if head_bias:
    state["head.bias"] = rng.standard_normal(cutoffs[0] + len(cutoffs)) * 0.5
  for i in range(len(cutoffs)):
    width = int(dim // (div_value ** (i + 1)))
    state[f"tail.{i}.0.weight"] = rng.standard_normal((width, dim)) * 0.5
    state[f"tail.{i}.1.weight"] = rng.standard_normal((bounds[i + 1] - bounds[i], width))
  return state


def reference_log_probs(state, hidden, cutoffs, num_classes, head_bias):
  """PyTorch's documented log_prob: head log-softmax for the shortlist, head cluster
  token + cluster log-softmax of tail_i(hidden) for the rest. float64."""
  head = hidden @ state["head.weight"].T
  if head_bias:
    head = head + state["head.bias"]
  head = log_softmax(head)
  out = [head[:, :cutoffs[0]]]
  for i in range(len(cutoffs)):
    tail = (hidden @ state[f"tail.{i}.0.weight"].T) @ state[f"tail.{i}.1.weight"].T
    out.append(log_softmax(tail) + head[:, cutoffs[0] + i:cutoffs[0] + i + 1])
  return np.concatenate(out, -1)


CASES = [  # num_classes, dim, cutoffs, div_value, head_bias
    (50, 16, [10, 30], 4.0, False),
    (97, 33, [5, 20, 60], 2.0, True),
    (12, 8, [11], 1.0, True),
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_matches_pytorch_definition(rng, case, dtype):
  num_classes, dim, cutoffs, div_value, head_bias = case
  state = torch_state_dict(rng, num_classes, dim, cutoffs, div_value, head_bias)
  layer = AdaptiveSoftmax.from_torch_state_dict(
      {k: v.astype(dtype) for k, v in state.items()}, cutoffs, div_value, head_bias)
  hidden = rng.standard_normal((3, 7, dim))
  ref = reference_log_probs(state, hidden.reshape(-1, dim), cutoffs, num_classes,
                            head_bias).reshape(3, 7, num_classes)
  tol = dict(rtol=1e-5, atol=1e-5) if dtype == "float32" else dict(rtol=1e-12, atol=1e-12)
  hidden_t = tf.constant(hidden, dtype)
  all_lp = layer.log_prob_all(hidden_t).numpy()
  np.testing.assert_allclose(all_lp, ref, **tol)
  np.testing.assert_allclose(np.exp(all_lp).sum(-1), 1.0, rtol=1e-5)
  targets = rng.integers(0, num_classes, (3, 7))
  targets[0, :2] = -1  # padding
  got = layer(hidden_t, tf.constant(targets)).numpy()
  want = np.take_along_axis(ref, np.maximum(targets, 0)[..., None], -1)[..., 0]
  want[targets < 0] = 0
  np.testing.assert_allclose(got, want, **tol)


def test_gradients_match_numerical(rng):
  state = torch_state_dict(rng, 40, 12, [6, 20], 2.0, True)
  layer = AdaptiveSoftmax.from_torch_state_dict(state, [6, 20], 2.0, True)
  hidden = tf.constant(rng.standard_normal((9, 12)))
  targets = tf.constant(np.array([0, 5, 6, 19, 20, 39, 3, 25, -1]))

  def loss(h):
    return tf.reduce_sum(layer(h, targets) * tf.range(1, 10, dtype=tf.float64))

  theoretical, numerical = tf.test.compute_gradient(loss, [hidden], delta=1e-6)
  np.testing.assert_allclose(theoretical[0], numerical[0], rtol=1e-6, atol=1e-7)
  with tf.GradientTape() as tape:
    value = loss(hidden)
  grads = tape.gradient(value, layer.trainable_variables)
  assert all(g is not None for g in grads)
  grads = {v.path: g for v, g in zip(layer.trainable_variables, grads)}
  # A weight's gradient by finite differences: the head's and a tail's table.
  for var in (layer.head_kernel, layer.tail_kernels[1], layer.tail_projections[0]):
    grad = tf.convert_to_tensor(grads[var.path]).numpy()
    base = var.numpy()
    index = tuple(rng.integers(0, s) for s in base.shape)
    eps = 1e-6
    bumped = base.copy()
    bumped[index] += eps
    var.assign(bumped)
    up = loss(hidden).numpy()
    bumped[index] -= 2 * eps
    var.assign(bumped)
    down = loss(hidden).numpy()
    var.assign(base)
    np.testing.assert_allclose(grad[index], (up - down) / (2 * eps), rtol=1e-5, atol=1e-8)


def tree_tail_reference(layer, hidden):
  """float64 log P(c) of a layer with tree tails, from the definitions."""
  head = hidden @ layer.head_kernel.numpy().T
  head = log_softmax(head)
  out = [head[:, :layer.cutoffs[0]]]
  for i, (lo, hi) in enumerate(layer.cluster_ranges):
    projected = hidden @ layer.tail_projections[i].numpy()
    tree = layer.tail_trees[i]
    cols = []
    for c in range(hi - lo):
      cols.append(log_prob_reference(projected, layer.tail_kernels[i].numpy(),
                                     layer.tail_biases[i].numpy(), tree,
                                     np.full(len(hidden), c))[0])
    out.append(np.stack(cols, -1) + head[:, layer.cutoffs[0] + i:layer.cutoffs[0] + i + 1])
  return np.concatenate(out, -1)


def randomize(layer, rng):
  for var in layer.weights:
    var.assign(rng.standard_normal(var.shape) * 0.5)


@pytest.mark.parametrize("tail", ["flat", "two_level", "given trees"])
def test_inference_is_exact(rng, tail):
  counts = 1.0 / np.arange(1, 301)
  given = {}
  if tail == "given trees":  # any tree a cluster, over its classes in rank order
    given = {"tail_trees": [tf_hsm.Tree.huffman(rng.random(60) + 0.1, 3),
                            tf_hsm.Tree.balanced(220, 4)]}
  layer = AdaptiveSoftmax(300, [20, 80], div_value=2.0, tail=tail.replace(
      "given trees", "two_level"), counts=counts, dtype="float64", **given)
  if given:
    assert [t.num_slots for t in layer.tail_trees] == [
        t.num_slots for t in given["tail_trees"]]
    again = AdaptiveSoftmax.from_config(layer.get_config())
    assert [t.get_config() for t in again.tail_trees] == [
        t.get_config() for t in given["tail_trees"]]
  layer.build((None, 16))
  randomize(layer, rng)
  hidden = rng.standard_normal((11, 16))
  if tail != "flat":
    ref = tree_tail_reference(layer, hidden)
  else:
    state = {"head.weight": layer.head_kernel.numpy()}
    for i in range(2):
      state[f"tail.{i}.0.weight"] = layer.tail_projections[i].numpy().T
      state[f"tail.{i}.1.weight"] = layer.tail_kernels[i].numpy()
    ref = reference_log_probs(state, hidden, [20, 80], 300, False)
  all_lp = layer.log_prob_all(tf.constant(hidden)).numpy()
  np.testing.assert_allclose(all_lp, ref, rtol=1e-10, atol=1e-10)
  targets = rng.integers(0, 300, 11)
  np.testing.assert_allclose(layer(tf.constant(hidden), tf.constant(targets)).numpy(),
                             ref[np.arange(11), targets], rtol=1e-10, atol=1e-10)
  for k in (1, 5, 30, 300):
    values, classes = layer.top_k(tf.constant(hidden), k)
    order = np.argsort(-ref, axis=-1, kind="stable")[:, :k]
    np.testing.assert_allclose(values.numpy(), np.take_along_axis(ref, order, -1),
                               rtol=1e-10, atol=1e-10)
    np.testing.assert_array_equal(classes.numpy(), order)


@pytest.mark.parametrize("tail", ["flat", "two_level"])
def test_sample_follows_the_distribution(rng, tail):
  layer = AdaptiveSoftmax(30, [4, 12], div_value=2.0, tail=tail, dtype="float64")
  layer.build((None, 8))
  randomize(layer, rng)
  hidden = np.repeat(rng.standard_normal((1, 8)), 20000, axis=0)
  draws = layer.sample(tf.constant(hidden), seed=3).numpy()
  assert draws.shape == (20000,) and draws.min() >= 0 and draws.max() < 30
  probs = np.exp(layer.log_prob_all(tf.constant(hidden[:1])).numpy()[0])
  freq = np.bincount(draws, minlength=30) / draws.size
  assert np.all(np.abs(freq - probs) <= 5 * np.sqrt(probs / 20000) + 1e-3), (freq, probs)
  again = layer.sample(tf.constant(hidden), seed=3).numpy()
  np.testing.assert_array_equal(draws, again)
  cold = layer.sample(tf.constant(hidden[:50]), seed=4, temperature=1e-3).numpy()
  assert np.all(cold == np.argmax(probs))


@pytest.mark.parametrize("tail", ["flat", "two_level"])
def test_trains_in_keras_and_saves(rng, tail, tmp_path):
  vocab, dim = 60, 16
  tokens = keras.Input((5,), dtype="int32")
  targets = keras.Input((5,), dtype="int32")
  hidden = keras.layers.Embedding(vocab, dim)(tokens)
  log_probs = AdaptiveSoftmax(vocab, [8, 24], div_value=2.0, tail=tail)(hidden, targets)
  model = keras.Model([tokens, targets], log_probs)
  model.compile(optimizer=tf_hsm.optimizers.LazyAdam(0.05), loss=tf_hsm.losses.nll)
  x = rng.integers(0, vocab, (64, 5))
  y = (x * 7 + 3) % vocab
  history = model.fit([x, y], np.zeros((64, 5)), epochs=15, batch_size=16, verbose=0)
  assert history.history["loss"][-1] < 0.5 * history.history["loss"][0]
  path = str(tmp_path / "model.keras")
  model.save(path)
  loaded = keras.models.load_model(path)
  np.testing.assert_array_equal(loaded.predict([x, y], verbose=0),
                                model.predict([x, y], verbose=0))
  layer = loaded.layers[-1]
  assert isinstance(layer, AdaptiveSoftmax) and layer.tail == tail


def test_tree_tails_send_sparse_gradients(rng):
  layer = AdaptiveSoftmax(5000, [100, 1000], tail="two_level", counts=1 / np.arange(1, 5001))
  hidden = tf.constant(rng.standard_normal((8, 32)), tf.float32)
  with tf.GradientTape() as tape:
    loss = -tf.reduce_sum(layer(hidden, tf.constant(rng.integers(0, 5000, 8))))
  grads = dict(zip([v.path for v in layer.trainable_variables],
                   tape.gradient(loss, layer.trainable_variables)))
  for i in range(2):
    kernel = grads[layer.tail_kernels[i].path]
    assert isinstance(kernel, tf.IndexedSlices)
    assert kernel.values.shape[0] < layer.tail_kernels[i].shape[0] / 4


def test_widths_and_memory():
  layer = AdaptiveSoftmax(100000, [2000, 20000], div_value=4.0)
  layer.build((None, 512))
  assert layer.tail_dims == [128, 32]
  assert layer.head_kernel.shape == (2002, 512)
  assert layer.tail_kernels[1].shape == (80000, 32)


@pytest.mark.parametrize("kwargs, error, message", [
    ({"num_classes": 10, "cutoffs": [5, 3]}, ValueError, "increasing"),
    ({"num_classes": 10, "cutoffs": [0, 3]}, ValueError, "positive"),
    ({"num_classes": 10, "cutoffs": [5, 10]}, ValueError, "smaller than num_classes"),
    ({"num_classes": 10, "cutoffs": []}, ValueError, "at least one"),
    ({"num_classes": 10, "cutoffs": 5}, TypeError, "list of ints"),
    ({"num_classes": 10, "cutoffs": [2.5]}, TypeError, "ints"),
    ({"num_classes": 10, "cutoffs": [5], "div_value": 0}, ValueError, "div_value"),
    ({"num_classes": 10, "cutoffs": [5], "tail": "deep"}, ValueError, "tail"),
    ({"num_classes": 1, "cutoffs": [5]}, ValueError, "num_classes"),
    ({"num_classes": 10, "cutoffs": [5], "tail": "two_level", "counts": [1, 2]},
     ValueError, "counts"),
])
def test_bad_arguments(kwargs, error, message):
  with pytest.raises(error, match=message):
    AdaptiveSoftmax(**kwargs)


def test_bad_calls(rng):
  layer = AdaptiveSoftmax(20, [5, 10], div_value=4.0)
  with pytest.raises(ValueError, match="needs a built layer"):
    layer.top_k(tf.zeros((2, 8)), 3)
  with pytest.raises(ValueError, match="width"):
    layer.build((None, 8))  # 8 // 16 = 0
  layer = AdaptiveSoftmax(20, [5, 10], div_value=2.0)
  layer.build((None, 8))
  with pytest.raises(ValueError, match="k must be"):
    layer.top_k(tf.zeros((2, 8)), 21)
  with pytest.raises(ValueError, match="temperature"):
    layer.sample(tf.zeros((2, 8)), temperature=0.0)
  with pytest.raises(tf.errors.InvalidArgumentError, match="num_classes"):
    layer(tf.zeros((2, 8)), tf.constant([1, 20]))
  with pytest.raises(TypeError, match="targets"):
    layer(tf.zeros((2, 8)), tf.constant([1.0, 2.0]))
  # Hidden states of another width, named (not a reshape's or a loss's shape error).
  with pytest.raises(ValueError, match="hidden size mismatch.*built for D = 8"):
    layer(tf.zeros((2, 9)), tf.constant([1, 2]))
  for method in (layer.log_prob_all, lambda h: layer.top_k(h, 2), layer.sample):
    with pytest.raises(ValueError, match=r"hidden has shape \[3, 6\].*D = 8"):
      method(tf.zeros((3, 6)))
  # Ragged batches: the layers take padded ones (the ops take ragged ones).
  ragged = tf.RaggedTensor.from_row_lengths(tf.zeros((3, 8)), [1, 2])
  for call in (lambda: layer(ragged, tf.ragged.constant([[1], [2, 3]])),
               lambda: layer.top_k(ragged, 2), lambda: layer.log_prob_all(ragged)):
    with pytest.raises(TypeError, match="layers take dense hidden states"):
      call()
  state = torch_state_dict(rng, 20, 8, [5, 10], 2.0, False)
  del state["tail.0.0.weight"]
  with pytest.raises(ValueError, match="tail.0.0.weight"):
    AdaptiveSoftmax.from_torch_state_dict(state, [5, 10], 2.0)
  state = torch_state_dict(rng, 20, 16, [5, 10], 2.0, False)
  with pytest.raises(ValueError, match="shape"):
    AdaptiveSoftmax.from_torch_state_dict(state, [5, 10], 4.0)
  for extra in ({"tail": "two_level"}, {"class_order": np.arange(20)}):
    with pytest.raises(TypeError, match="takes name, dtype and trainable.*got " +
                       next(iter(extra))):
      AdaptiveSoftmax.from_torch_state_dict(state, [5, 10], 4.0, **extra)
  # Weights the arguments leave no place for are named, not dropped: a head.bias without
  # head_bias=True (every output would differ from the module's), a third tail.
  state = torch_state_dict(rng, 20, 8, [5, 10], 2.0, True)
  with pytest.raises(ValueError, match=r"\['head.bias'\].*pass it too"):
    AdaptiveSoftmax.from_torch_state_dict(state, [5, 10], 2.0)
  state = torch_state_dict(rng, 20, 8, [5, 10, 15], 2.0, False)
  with pytest.raises(ValueError, match="tail.2.0.weight"):
    AdaptiveSoftmax.from_torch_state_dict(state, [5, 10], 2.0)


@pytest.mark.parametrize("initializer", ["glorot_uniform", keras.initializers.RandomNormal(),
                                         keras.initializers.GlorotUniform(seed=3)])
def test_each_table_draws_its_own_initial_values(initializer):
  layer = AdaptiveSoftmax(40, [5, 15], div_value=1.0, kernel_initializer=initializer)
  layer.build((None, 8))  # the two tails' projections are [8, 8] each, the head [7, 8]
  first, second = (p.numpy() for p in layer.tail_projections)
  assert not np.array_equal(first, second)
  head, tail = layer.head_kernel.numpy().ravel(), layer.tail_kernels[0].numpy().ravel()
  assert abs(np.corrcoef(head[:40], tail[:40])[0, 1]) < 0.9


@pytest.mark.parametrize("tail", ["flat", "two_level"])
def test_mixed_precision_keeps_the_tables_and_log_probs_float32(tail, rng):
  keras.mixed_precision.set_global_policy("mixed_float16")
  try:
    hidden = keras.Input((8,))
    targets = keras.Input((), dtype="int32")
    layer = AdaptiveSoftmax(40, [4, 12], div_value=2.0, tail=tail)
    model = keras.Model([hidden, targets], layer(hidden, targets))
  finally:
    keras.mixed_precision.set_global_policy("float32")
  assert all(w.dtype == "float32" for w in layer.weights)
  x = rng.normal(size=(6, 8)).astype(np.float32)
  y = rng.integers(0, 40, 6).astype(np.int32)
  out = model([x, y])
  assert out.dtype == tf.float32
  np.testing.assert_allclose(np.exp(layer.log_prob_all(x).numpy()).sum(-1), 1.0, rtol=1e-5)
