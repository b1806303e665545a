"""`HierarchicalSoftmaxMixture`: checked against a float64 reference written from the
definition on fresh random trees, numerical gradients, training in `model.fit`, saving,
inference, and its errors."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_hsm
from tf_hsm.keras import adam_step as fused_module
from tf_hsm.keras.mixture import HierarchicalSoftmaxMixture

import oracle
import support

D = 5


def _trees(rng):
  """Two trees over the same classes, grouped differently: a random mixed tree, and a
  3-ary Huffman tree of random counts."""
  first = oracle.random_mixed_tree(rng, max_depth=4, max_branching=6, max_classes=40)
  counts = rng.integers(1, 50, first.num_classes)
  return first, tf_hsm.Tree.huffman(counts, branching=3)


def _reference(hidden, layer, targets):
  """log sum_k softmax(h G + g)_k P_k(target | h), from the definition, in float64."""
  h = np.asarray(hidden, np.float64).reshape(-1, D)
  y = np.asarray(targets).reshape(-1)
  parts = []
  for c in layer.components:
    bias = None if c.bias is None else np.asarray(c.bias)
    parts.append(oracle.log_prob_reference(h, np.asarray(c.kernel), bias, c.tree,
                                           np.maximum(y, 0))[0])
  logits = h @ np.asarray(layer.gate_kernel, np.float64) + np.asarray(layer.gate_bias)
  log_gate = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  mixed = np.log(np.exp(np.stack(parts, -1) + log_gate).sum(-1))
  return np.where(y >= 0, mixed, 0.0).reshape(np.shape(targets))


def _randomised(layer, rng):
  for weight in layer.weights:
    weight.assign(rng.normal(size=weight.shape) * 0.7)


@pytest.mark.parametrize("case", range(3))
def test_matches_the_definition_in_float64(rng, case):
  del case  # a fresh pair of random trees each time
  trees = _trees(rng)
  layer = HierarchicalSoftmaxMixture(list(trees) + [trees[0]], dtype="float64")
  hidden = rng.normal(size=(3, 4, D))
  targets = rng.integers(0, trees[0].num_classes, size=(3, 4))
  targets[0, :2] = -1  # padding
  layer(hidden, targets)
  _randomised(layer, rng)
  out = layer(hidden, targets)
  assert out.dtype == tf.float64
  np.testing.assert_allclose(out, _reference(hidden, layer, targets), rtol=1e-12,
                             atol=1e-12)
  np.testing.assert_array_equal(out._keras_mask, targets >= 0)  # pylint: disable=protected-access


def test_gradients_match_numerical_ones(rng):
  trees = _trees(rng)
  layer = HierarchicalSoftmaxMixture(trees, dtype="float64")
  hidden = tf.Variable(rng.normal(size=(6, D)))
  targets = rng.integers(0, trees[0].num_classes, size=6)
  targets[1] = -1
  layer(hidden, targets)
  _randomised(layer, rng)
  loss = lambda: tf.reduce_sum(layer(hidden, targets) * np.arange(1.0, 7.0))
  variables = [hidden, layer.gate_kernel, layer.gate_bias, layer.components[1].kernel,
               layer.components[0].bias]
  oracle.assert_gradients_match(loss, variables)


def _model(trees, layer=None):
  keras.utils.set_random_seed(1)
  tokens = keras.Input([6], dtype="int32")
  targets = keras.Input([6], dtype="int32")
  hidden = keras.layers.Embedding(trees[0].num_classes, 8, mask_zero=True)(tokens)
  layer = layer or HierarchicalSoftmaxMixture(trees, name="mixture")
  model = keras.Model([tokens, targets], layer(hidden, targets))
  model.compile(optimizer=tf_hsm.optimizers.LazyAdam(0.05), loss=tf_hsm.losses.nll)
  return model, layer


def test_fit_trains_every_part_and_a_saved_model_gives_the_same_output(rng, tmp_path):
  trees = _trees(rng)
  model, layer = _model(trees)
  x = rng.integers(0, trees[0].num_classes, size=(32, 6)).astype(np.int32)
  y = (x + 1) % trees[0].num_classes
  support.trained_and_reloaded(model, [x, y], y, str(tmp_path / "mixture.keras"),
                               _no_dense_warning)
  # x == 0 is masked by the embedding: those positions are 0 and carry no loss.
  assert np.all(model.predict([x, y], verbose=0)[x == 0] == 0.0)


class _no_dense_warning:  # pylint: disable=invalid-name
  """Fails on the warning that an optimizer updates a whole table."""

  def __enter__(self):
    import warnings  # pylint: disable=import-outside-toplevel
    self._catch = warnings.catch_warnings(record=True)
    self._seen = self._catch.__enter__()
    warnings.simplefilter("always")

  def __exit__(self, *exc):
    self._catch.__exit__(*exc)
    assert not [w for w in self._seen if "updates every row" in str(w.message)]


def test_fused_update_components_train_as_unfused(rng, monkeypatch):
  trees = _trees(rng)
  x = rng.integers(0, trees[0].num_classes, size=(16, 6)).astype(np.int32)
  y = (x + 1) % trees[0].num_classes
  ends, calls = [], []
  original = fused_module.fused.adam_rows_step_from_logits
  monkeypatch.setattr(fused_module.fused, "adam_rows_step_from_logits",
                      lambda *args: calls.append(1) or original(*args))
  for fused in (False, True):
    keras.utils.set_random_seed(1)  # Keras draws an initializer's seed when it is made
    components = [tf_hsm.HierarchicalSoftmax(t, fused_update=fused) for t in trees]
    model, _ = _model(trees, HierarchicalSoftmaxMixture(components, name="mixture"))
    model.fit([x, y], y, batch_size=8, epochs=2, verbose=0, shuffle=False)
    ends.append([np.asarray(w) for w in model.weights + model.optimizer.variables])
  assert len(calls) >= 2  # each tree's update ran in its backward pass
  # The same updates; the hidden states' gradient sums three parts (two trees, the
  # gate) in an order of TensorFlow's choosing, so the two runs part by an ulp or so.
  for plain, fused in zip(*ends):
    np.testing.assert_allclose(plain, fused, rtol=1e-5, atol=1e-7)


def test_log_prob_all_and_top_k(rng):
  trees = _trees(rng)
  components = [tf_hsm.HierarchicalSoftmax(t, ignore_class=0, dtype="float64")
                for t in trees]
  layer = HierarchicalSoftmaxMixture(components, dtype="float64")
  hidden = rng.normal(size=(4, D))
  targets = rng.integers(1, trees[0].num_classes, size=4)
  layer(hidden, targets)
  _randomised(layer, rng)
  every = np.array(layer.log_prob_all(hidden))
  np.testing.assert_allclose(np.exp(every).sum(-1), 1.0, rtol=1e-12)
  np.testing.assert_allclose(every[np.arange(4), targets], layer(hidden, targets),
                             rtol=1e-12)
  values, classes = layer.top_k(hidden, 3)
  every[:, 0] = -np.inf  # ignore_class is never a prediction
  want = np.argsort(-every, axis=-1)[:, :3]
  np.testing.assert_array_equal(classes, want)
  np.testing.assert_allclose(values, np.take_along_axis(every, want, -1), rtol=1e-12)
  # exclude: per-row ids (-1 excludes nothing) beside ignore_class.
  exclude = np.stack([want[:, 0], np.full(4, -1)], -1)
  values, classes = layer.top_k(hidden, 3, exclude=exclude)
  every[np.arange(4), want[:, 0]] = -np.inf
  np.testing.assert_array_equal(classes, np.argsort(-every, axis=-1)[:, :3])
  # A dimension of 1 applies to every row; rows of more dimensions alike.
  _, shared = layer.top_k(hidden, 3, exclude=want[:1, :1])
  _, square = layer.top_k(np.reshape(hidden, (2, 2, -1)), 3,
                          exclude=np.broadcast_to(want[:1, :1], (2, 2, 1)))
  np.testing.assert_array_equal(np.reshape(square, (4, 3)), shared)
  assert not np.any(np.asarray(shared) == want[0, 0])
  with pytest.raises(tf.errors.InvalidArgumentError,
                     match=f"excluded id is >= num_classes = {trees[0].num_classes}"):
    layer.top_k(hidden, 3, exclude=np.full((4, 1), trees[0].num_classes))
  # Asked for every class: the left-out ones come last, as class -1 at -inf.
  values, classes = layer.top_k(hidden, trees[0].num_classes)
  np.testing.assert_array_equal(classes[:, -1], -1)
  assert np.all(np.isneginf(values[:, -1])) and np.all(np.isfinite(values[:, :-1]))


def test_refused_by_name(rng):
  trees = _trees(rng)
  other = tf_hsm.Tree.huffman(np.ones(trees[0].num_classes + 1))
  with pytest.raises(ValueError, match="two or more components"):
    HierarchicalSoftmaxMixture([trees[0]])
  with pytest.raises(TypeError, match="list of two or more"):
    HierarchicalSoftmaxMixture(trees[0])
  with pytest.raises(TypeError, match=r"components\[1\] must be a Tree"):
    HierarchicalSoftmaxMixture([trees[0], "huffman"])
  with pytest.raises(ValueError, match="over the same classes"):
    HierarchicalSoftmaxMixture([trees[0], other])
  with pytest.raises(ValueError, match="share one ignore_class"):
    HierarchicalSoftmaxMixture([tf_hsm.HierarchicalSoftmax(trees[0], ignore_class=0),
                                tf_hsm.HierarchicalSoftmax(trees[1])])
  with pytest.raises(ValueError, match="tables are float64 and the mixture's float32"):
    HierarchicalSoftmaxMixture([trees[0], tf_hsm.HierarchicalSoftmax(trees[1],
                                                                     dtype="float64")])
  twice = tf_hsm.HierarchicalSoftmax(trees[1])
  with pytest.raises(ValueError, match=r"components\[1\] is components\[0\] again"):
    HierarchicalSoftmaxMixture([twice, twice])
  built = tf_hsm.HierarchicalSoftmax(trees[1])
  built.build((None, D))
  with pytest.raises(ValueError, match="built already"):
    HierarchicalSoftmaxMixture([trees[0], built])
  # A tree layer's own arguments, named where they go (Keras would call them unknown).
  with pytest.raises(ValueError, match=r"fused_update is each tree's own: .*"
                                       r"HierarchicalSoftmax\(tree, fused_update=\.\.\.\)"):
    HierarchicalSoftmaxMixture(trees, fused_update=True)
  with pytest.raises(ValueError, match="kernel_initializer, use_bias are each tree's own"):
    HierarchicalSoftmaxMixture(trees, use_bias=False, kernel_initializer="zeros")
  layer = HierarchicalSoftmaxMixture(trees)
  with pytest.raises(ValueError, match="needs a built layer"):
    layer.log_prob_all(np.zeros((1, D), np.float32))
  ragged = tf.ragged.constant([[[0.0] * D], [[1.0] * D] * 2], ragged_rank=1)
  with pytest.raises(TypeError, match="dense hidden states"):
    layer(ragged, tf.ragged.constant([[1], [2, 3]]))


def test_inference_model_cuts_a_mixture(rng):
  trees = _trees(rng)
  model, layer = _model(trees)
  x = rng.integers(0, trees[0].num_classes, size=(4, 6)).astype(np.int32)
  hidden = next(l for l in model.layers if isinstance(l, keras.layers.Embedding))(x)
  k = min(3, trees[0].num_classes)
  best = tf_hsm.inference_model(model, k=3).predict(x, verbose=0)  # clamped, as the layer's
  log_probs, classes = layer.top_k(hidden, k)
  np.testing.assert_array_equal(best["classes"], classes.numpy())
  np.testing.assert_allclose(best["log_probs"], log_probs.numpy(), rtol=1e-5, atol=1e-6)
  every = tf_hsm.inference_model(model, output="log_prob_all").predict(x, verbose=0)
  np.testing.assert_allclose(every, layer.log_prob_all(hidden).numpy(), rtol=1e-5,
                             atol=1e-6)
  drawn = tf_hsm.inference_model(model, output="sample").predict(x, verbose=0)
  assert drawn.shape == (4, 6) and drawn.min() >= 0 and drawn.max() < trees[0].num_classes


def _randomized(layer, rng, scale=1.0):
  for weight in layer.weights:
    weight.assign(scale * rng.normal(size=weight.shape).astype(np.float32))
  return layer


def _frequencies(classes, num_classes):
  return np.bincount(np.asarray(classes), minlength=num_classes) / np.size(classes)


def test_sample_draws_the_mixture_and_at_a_temperature_its_tempered_model(rng):
  """Frequencies of 40,000 draws at one hidden state against the layer's distribution
  (log_prob_all, itself checked against the float64 reference); at temperature 0.5
  against the mixture whose every weight and bias is doubled."""
  trees = _trees(rng)
  layer = HierarchicalSoftmaxMixture(trees)
  layer.build((None, D))
  _randomized(layer, np.random.default_rng(3))
  cool = HierarchicalSoftmaxMixture(trees)
  cool.build((None, D))
  for source, target in zip(layer.weights, cool.weights):
    target.assign(2.0 * source.numpy())
  h = rng.normal(size=(1, D)).astype(np.float32)
  hidden = np.repeat(h, 40_000, axis=0)
  C = trees[0].num_classes
  for model, temperature, seed in ((layer, 1.0, 3), (cool, 0.5, 4)):
    drawn = layer.sample(hidden, seed=seed, temperature=temperature).numpy()
    expected = np.exp(model.log_prob_all(h).numpy()[0])
    assert np.abs(_frequencies(drawn, C) - expected).sum() < 0.05, temperature
  np.testing.assert_array_equal(layer.sample(hidden[:50], seed=7),
                                layer.sample(hidden[:50], seed=7))
  assert not np.array_equal(layer.sample(hidden[:200], seed=7),
                            layer.sample(hidden[:200], seed=8))
  assert layer.sample(hidden[:6].reshape(2, 3, D), seed=tf.constant(1)).shape == (2, 3)
  # Consecutive seeds draw independently: two draws agree as often as sum p^2 says.
  agree = np.mean(np.asarray(layer.sample(hidden[:20_000], seed=10)) ==
                  np.asarray(layer.sample(hidden[:20_000], seed=11)))
  p = np.exp(layer.log_prob_all(h).numpy()[0])
  assert abs(agree - np.sum(p * p)) < 0.02, (agree, np.sum(p * p))
  # No distribution: -1; a tiny temperature does not overflow the gate.
  broken = np.array([[np.nan] * D, [np.inf] * D, h[0]], np.float32)
  np.testing.assert_array_equal(layer.sample(broken, seed=1)[:2], [-1, -1])
  assert np.all(np.asarray(layer.sample(np.repeat(h, 8, 0), seed=1, temperature=1e-37)) >= 0)
  np.testing.assert_array_equal(layer.top_k(h, np.int64(2))[1], layer.top_k(h, 2)[1])


@pytest.mark.parametrize("kwargs,error,message", [
    ({"seed": 2**63}, ValueError, "seed must fit in int64"),
    ({"seed": np.uint64(2**64 - 1)}, ValueError, "seed must fit in int64"),
    ({"seed": 1.5}, TypeError, "seed must be int32 or int64, got float32"),
    ({"seed": tf.constant([1, 2])}, ValueError, "one integer"),
    ({"temperature": 0.0}, ValueError, "temperature must be positive")])
def test_sample_names_bad_arguments(rng, kwargs, error, message):
  layer = HierarchicalSoftmaxMixture(_trees(rng))
  with pytest.raises(ValueError, match="needs a built layer"):
    layer.sample(np.zeros((1, D), np.float32))
  layer.build((None, D))
  with pytest.raises(error, match=message):
    layer.sample(np.zeros((2, D), np.float32), **kwargs)
  ragged = tf.ragged.constant([[[0.0] * D], [[1.0] * D] * 2], ragged_rank=1)
  for call in (layer.sample, layer.log_prob_all, lambda h: layer.top_k(h, 1)):
    with pytest.raises(TypeError, match="takes dense hidden states"):
      call(ragged)
  C = layer.num_classes
  for k in (0, C + 1, 2.0, True):
    with pytest.raises(ValueError, match=rf"k must be an integer in \[1, num_classes\] = "
                                         rf"\[1, {C}\]"):
      layer.top_k(np.zeros((2, D), np.float32), k)


def test_frozen_at_construction_trains_nothing_of_its_own(rng, tmp_path):
  trees = _trees(rng)
  x = rng.integers(0, trees[0].num_classes, size=(16, 6)).astype(np.int32)
  y = (x + 1) % trees[0].num_classes
  components = [tf_hsm.HierarchicalSoftmax(trees[0]),
                tf_hsm.HierarchicalSoftmax(trees[1], fused_update=True)]
  model, layer = _model(trees, HierarchicalSoftmaxMixture(components, trainable=False))
  start = [np.asarray(w) for w in layer.weights]
  model.fit([x, y], y, batch_size=8, epochs=1, verbose=0)
  assert all(np.array_equal(s, np.asarray(w)) for s, w in zip(start, layer.weights))
  path = str(tmp_path / "frozen.keras")
  model.save(path)
  again = keras.models.load_model(path).get_layer(layer.name)
  assert not any(c.trainable for c in again.components)


def test_compiled_top_k_accuracy_reads_the_mixture(rng):
  trees = _trees(rng)
  model, layer = _model(trees)
  model.compile(optimizer=tf_hsm.optimizers.LazyAdam(0.05), loss=tf_hsm.losses.nll,
                metrics=[tf_hsm.metrics.TopKAccuracy(k=3)])
  x = rng.integers(1, trees[0].num_classes, size=(8, 6)).astype(np.int32)
  y = (x + 1) % trees[0].num_classes
  got = model.evaluate([x, y], y, verbose=0, return_dict=True)
  embedding = next(l for l in model.layers if isinstance(l, keras.layers.Embedding))
  hidden = embedding(x)
  every = np.asarray(layer.log_prob_all(hidden))
  top = np.argsort(-every, axis=-1)[..., :3]
  want = np.mean(np.any(top == y[..., None], axis=-1))
  assert [v for k, v in got.items() if "top" in k][0] == pytest.approx(want)


@pytest.mark.parametrize("ignore_class", [None, 0])
def test_exclude_without_the_time_axis_is_named_where_batch_is_time(rng, ignore_class):
  """Hidden states [B, T, D] with exclude [B, n], B == T: the ids would broadcast along
  the time axis (row b's ids excluded at step b of every sequence) or fail in a concat;
  both layers name the shape instead."""
  trees = [tf_hsm.Tree.huffman(rng.integers(1, 50, 30), branching=3),
           tf_hsm.Tree.balanced(30, 4)]
  hidden = tf.constant(rng.standard_normal((5, 5, D)), tf.float32)
  targets = tf.ones([5, 5], tf.int32)
  mixture = HierarchicalSoftmaxMixture(
      [tf_hsm.HierarchicalSoftmax(t, ignore_class=ignore_class) for t in trees])
  tree_layer = tf_hsm.HierarchicalSoftmax(trees[0], ignore_class=ignore_class)
  for layer in (mixture, tree_layer):
    layer(hidden, targets)
    with pytest.raises(ValueError, match=r"exclude must be class ids.*shape \(5, 1\) for "
                                         r"hidden of rank 3.*\[B, 1, n\]"):
      layer.top_k(hidden, 3, exclude=np.ones((5, 1), np.int64))
    _, classes = layer.top_k(hidden, 3, exclude=np.ones((5, 1, 1), np.int64))
    assert not np.any(np.asarray(classes) == 1)
  # The mixture scatters its exclusions: an n unknown when traced is fine there.
  search = tf.function(lambda h, e: mixture.top_k(h, 3, exclude=e), input_signature=[
      tf.TensorSpec([None, None, D]), tf.TensorSpec([None, None, None], tf.int64)])
  assert not np.any(search(hidden, np.ones((5, 1, 2), np.int64))[1].numpy() == 1)
