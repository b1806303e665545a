"""`HierarchicalSoftmaxMixture(head=...)`: the shared head of frequent classes ahead of
the mixture of tail trees, checked against a float64 reference written from the
definition on fresh random trees and head sets, numerical gradients, normalisation,
sampling, padding, training and saving, and its errors."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_hsm
from tf_hsm.demo import trees as demo_trees
from tf_hsm.keras import mixture_head
from tf_hsm.keras.mixture import HierarchicalSoftmaxMixture

import oracle
import support

D = 5


def _headed(rng, dtype="float64", count=3, **kwargs):
  """(layer, V): a mixture of `count` random trees over the tail of V classes, with a
  random head of 1-6 class ids in random order."""
  first = oracle.random_mixed_tree(rng, max_depth=4, max_branching=6, max_classes=30)
  tail_size = first.num_classes
  trees = [first] + [tf_hsm.Tree.huffman(rng.integers(1, 50, tail_size), branching=k)
                     for k in range(2, count + 1)]
  num_head = int(rng.integers(1, 7))
  head = rng.permutation(tail_size + num_head)[:num_head]
  layer = HierarchicalSoftmaxMixture(trees, head=head, dtype=dtype, **kwargs)
  return layer, tail_size + num_head


def _reference(hidden, layer, targets):
  """log P(target | h) from the definition in float64: the head softmax's probability
  for a head class; the tail slot's times the gate's mixture of the trees' for a tail
  class (a tree's class j is the j-th tail class by id), the trees scoring h P where
  the layer has a `tail_dim` projection P."""
  h = np.asarray(hidden, np.float64).reshape(-1, D)
  scored = h if layer.tail_dim is None else h @ np.asarray(layer.tail_projection, np.float64)
  y = np.asarray(targets).reshape(-1)
  head = list(layer.head_ids)
  tail = np.setdiff1d(np.arange(layer.num_classes), head)
  head_logits = h @ np.asarray(layer.head.kernel, np.float64).T + np.asarray(layer.head.bias)
  count = len(layer.components)
  # [N, K, H + 1]: component k's head, the shared one plus U_k (V_k h) with head_rank.
  head_logits = np.repeat(head_logits[:, None], count, 1)
  if layer.head_rank is not None:
    v = np.asarray(layer.head_correction_in, np.float64)
    u = np.asarray(layer.head_correction_out, np.float64)
    for k in range(count):
      head_logits[:, k] += (h @ v[:, k * layer.head_rank:(k + 1) * layer.head_rank]) @ u[k]
  head_lp = head_logits - np.log(np.exp(head_logits).sum(-1, keepdims=True))
  gate = h @ np.asarray(layer.gate_kernel, np.float64) + np.asarray(layer.gate_bias)
  log_gate = gate - np.log(np.exp(gate).sum(-1, keepdims=True))
  out = np.zeros(len(y))
  for i, c in enumerate(y):
    if c < 0:
      continue
    if c in head:
      slot, parts = head.index(c), np.zeros(count)
    else:
      position = int(np.searchsorted(tail, c))
      slot = len(head)
      parts = np.array([oracle.log_prob_reference(
          scored[i:i + 1], np.asarray(k.kernel), np.asarray(k.bias), k.tree,
          np.array([position]))[0][0] for k in layer.components])
    if layer.head_rank is None:  # one head: P_head(slot) sum_k pi_k P_k(c)
      out[i] = head_lp[i, 0, slot] + np.log(np.exp(parts + log_gate[i]).sum())
    else:  # sum_k pi_k P_head,k(slot) P_k(c)
      out[i] = np.log(np.exp(parts + log_gate[i] + head_lp[i, :, slot]).sum())
  return out.reshape(np.shape(targets))


def _randomised(layer, rng, scale=0.7):
  for weight in layer.weights:
    weight.assign(rng.normal(size=weight.shape) * scale)


@pytest.mark.parametrize("case,tail_dim,head_rank", [
    (0, None, None), (1, None, None), (2, None, None), (3, 3, None), (4, 1, None),
    (5, None, 1), (6, None, 3), (7, 2, 2)])
def test_matches_the_definition_in_float64(rng, case, tail_dim, head_rank):
  del case  # fresh trees and a fresh head each time
  layer, num_classes = _headed(rng, tail_dim=tail_dim, head_rank=head_rank)
  hidden = rng.normal(size=(3, 5, D))
  targets = rng.integers(0, num_classes, size=(3, 5))
  targets[0, :2] = -1  # padding
  targets[1, :len(layer.head_ids)] = layer.head_ids[:5]  # every head class is seen
  layer(hidden, targets)
  _randomised(layer, rng)
  out = layer(hidden, targets)
  assert layer.num_classes == num_classes and out.dtype == tf.float64
  np.testing.assert_allclose(out, _reference(hidden, layer, targets), rtol=1e-12,
                             atol=1e-12)
  np.testing.assert_array_equal(out._keras_mask, targets >= 0)  # pylint: disable=protected-access


@pytest.mark.parametrize("tail_dim,head_rank", [(None, None), (3, None), (None, 2), (2, 1)])
def test_gradients_match_numerical_ones(rng, tail_dim, head_rank):
  layer, num_classes = _headed(rng, count=2, tail_dim=tail_dim, head_rank=head_rank)
  hidden = tf.Variable(rng.normal(size=(8, D)))
  targets = rng.integers(0, num_classes, size=8)
  targets[:2] = layer.head_ids[0]
  targets[3] = -1
  layer(hidden, targets)
  _randomised(layer, rng)
  loss = lambda: tf.reduce_sum(layer(hidden, targets) * np.arange(1.0, 9.0))
  variables = [hidden, layer.gate_kernel, layer.gate_bias, layer.head.kernel,
               layer.head.bias, layer.components[1].kernel, layer.components[0].bias]
  if tail_dim is not None:
    variables.append(layer.tail_projection)
    assert layer.components[1].kernel.shape[-1] == tail_dim
  if head_rank is not None:
    variables += [layer.head_correction_in, layer.head_correction_out]
  oracle.assert_gradients_match(loss, variables)


@pytest.mark.parametrize("tail_dim,head_rank", [(None, None), (2, None), (None, 2)])
def test_log_prob_all_is_normalised_and_top_k_reads_it(rng, tail_dim, head_rank):
  layer, num_classes = _headed(rng, tail_dim=tail_dim, head_rank=head_rank)
  hidden = rng.normal(size=(2, 3, D))
  targets = rng.integers(0, num_classes, size=(2, 3))
  layer(hidden, targets)
  _randomised(layer, rng)
  every = np.array(layer.log_prob_all(hidden))
  assert every.shape == (2, 3, num_classes)
  np.testing.assert_allclose(np.exp(every).sum(-1), 1.0, rtol=1e-12)
  everything = np.broadcast_to(np.arange(num_classes), (2, 3, num_classes))
  np.testing.assert_allclose(
      every, [[_reference(hidden[i, j][None].repeat(num_classes, 0), layer,
                          everything[i, j]) for j in range(3)] for i in range(2)],
      rtol=1e-12, atol=1e-12)
  k = min(4, num_classes)
  values, classes = layer.top_k(hidden, k)
  np.testing.assert_array_equal(classes, np.argsort(-every, -1, kind="stable")[..., :k])
  np.testing.assert_allclose(values, np.sort(every, -1)[..., ::-1][..., :k], rtol=1e-12)


def test_top_k_of_a_nan_row_is_no_ranking(rng):
  """A row of NaN hidden states: classes -1 and log-probabilities NaN, as the export's
  top_k, with ignore_class and exclude too (tf.math.top_k ranked an excluded class's
  -inf first there); the other rows as without it."""
  layer, num_classes = _headed(rng, ignore_class=0)
  hidden = rng.normal(size=(3, D))
  layer(hidden, np.ones(3, np.int64))
  want = layer.top_k(hidden, 3, exclude=[[1], [2], [3]])
  hidden[1] = np.nan
  values, classes = layer.top_k(hidden, 3, exclude=[[1], [2], [3]])
  np.testing.assert_array_equal(classes[1], [-1, -1, -1])
  assert np.all(np.isnan(values[1]))
  for row in (0, 2):
    np.testing.assert_array_equal(classes[row], want[1][row])
    np.testing.assert_array_equal(values[row], want[0][row])


@pytest.mark.parametrize("tail_dim,head_rank", [(None, None), (2, None), (None, 2)])
def test_sample_draws_the_layer_s_distribution(rng, tail_dim, head_rank):
  layer, num_classes = _headed(rng, dtype="float32", tail_dim=tail_dim, head_rank=head_rank)
  hidden = rng.normal(size=(1, D)).astype(np.float32)
  layer(hidden, np.zeros(1, np.int64))
  _randomised(layer, rng, scale=0.5)
  want = np.exp(np.asarray(layer.log_prob_all(hidden), np.float64)[0])
  draws = np.asarray(layer.sample(np.repeat(hidden, 40_000, 0), seed=5))
  assert draws.min() >= 0 and draws.max() < num_classes
  got = np.bincount(draws, minlength=num_classes) / draws.size
  bound = 4.5 * np.sqrt(want * (1 - want) / draws.size) + 1e-4
  assert np.all(np.abs(got - want) <= bound), np.abs(got - want) / bound
  np.testing.assert_array_equal(layer.sample(hidden, seed=3), layer.sample(hidden, seed=3))
  bad = np.full((2, D), np.nan, np.float32)
  np.testing.assert_array_equal(layer.sample(bad, seed=1), [-1, -1])


@pytest.mark.parametrize("head_rank", [None, 2])
def test_padding_ignore_class_and_keras_masks_give_zero_and_no_gradient(rng, head_rank):
  layer, num_classes = _headed(rng, ignore_class=0, head_rank=head_rank)
  hidden = tf.Variable(rng.normal(size=(6, D)))
  targets = np.array([0, -1, 1, 2, layer.head_ids[0], num_classes - 1])
  mask = np.array([True, True, True, False, True, True])
  layer(hidden, targets)
  with tf.GradientTape() as tape:
    out = layer(hidden, targets, mask=mask)
    total = tf.reduce_sum(out)
  grad = np.asarray(tf.convert_to_tensor(tape.gradient(total, hidden)))
  padded = (targets < 0) | (targets == 0) | ~mask
  np.testing.assert_array_equal(out._keras_mask, ~padded)  # pylint: disable=protected-access
  assert np.all(np.asarray(out)[padded] == 0) and np.all(np.asarray(out)[~padded] < 0)
  assert np.all(grad[padded] == 0) and np.all(np.abs(grad[~padded]).sum(-1) > 0)


@pytest.mark.parametrize("tail_dim,head_rank", [(None, None), (4, None), (None, 3)])
def test_fit_trains_the_head_the_trees_and_the_gate_and_a_saved_model_loads(rng, tmp_path,
                                                                             tail_dim,
                                                                             head_rank):
  layer, num_classes = _headed(rng, dtype="float32", name="mixture", tail_dim=tail_dim,
                               head_rank=head_rank)
  keras.utils.set_random_seed(1)
  tokens = keras.Input([6], dtype="int32")
  targets = keras.Input([6], dtype="int32")
  hidden = keras.layers.Embedding(num_classes, 8)(tokens)
  model = keras.Model([tokens, targets], layer(hidden, targets))
  model.compile(optimizer=tf_hsm.optimizers.LazyAdam(0.05), loss=tf_hsm.losses.nll)
  x = rng.integers(0, num_classes, size=(32, 6)).astype(np.int32)
  y = (x + 1) % num_classes
  again = support.trained_and_reloaded(model, [x, y], y, str(tmp_path / "headed.keras"))
  loaded = again.get_layer("mixture")
  np.testing.assert_array_equal(loaded.head_ids, layer.head_ids)
  assert loaded.num_classes == num_classes and loaded.tail_dim == tail_dim
  assert loaded.head_rank == head_rank
  if head_rank is not None:
    assert np.abs(np.asarray(layer.head_correction_out)).sum() > 0  # moved from zero


@pytest.mark.parametrize("tail_dim,head_rank", [(None, None), (2, None), (None, 2)])
def test_inference_model_top_k_on_a_headed_mixture(rng, tail_dim, head_rank):
  layer, num_classes = _headed(rng, dtype="float32", name="mixture", tail_dim=tail_dim,
                               head_rank=head_rank)
  hidden_in = keras.Input([D])
  targets = keras.Input([], dtype="int32")
  model = keras.Model([hidden_in, targets], layer(hidden_in, targets))
  hidden = rng.normal(size=(4, D)).astype(np.float32)
  best = tf_hsm.inference_model(model, k=3).predict(hidden, verbose=0)
  every = np.asarray(layer.log_prob_all(hidden))
  np.testing.assert_array_equal(best["classes"], np.argsort(-every, -1, kind="stable")[:, :3])
  drawn = tf_hsm.inference_model(model, output="sample").predict(hidden, verbose=0)
  assert drawn.shape == (4,) and np.all((drawn >= 0) & (drawn < num_classes))


@pytest.mark.parametrize("head,kwargs,error,message", [
    ([0, 0], {}, ValueError, "more than once"),
    ([], {}, ValueError, "non-empty 1-D"),
    ([0.5], {}, ValueError, "integer class ids"),
    ([99], {}, ValueError, "within"),
    ([-1], {}, ValueError, "within"),
    (None, {"ignore_class": 0}, ValueError, "with a head only"),
    ([1], {"ignore_class": 1.5}, TypeError, "int class id"),
    ([1], {"ignore_class": 50}, ValueError, "within"),
    (None, {"tail_dim": 4}, ValueError, "tail_dim needs a head"),
    ([1], {"tail_dim": 0}, ValueError, "positive int"),
    ([1], {"tail_dim": 2.0}, TypeError, "positive int"),
    ([1], {"tail_dim": True}, TypeError, "positive int"),
    (None, {"head_rank": 2}, ValueError, "head_rank needs a head"),
    ([1], {"head_rank": 0}, ValueError, "positive int"),
    ([1], {"head_rank": 2.0}, TypeError, "positive int"),
    ([1], {"num_classes": 8}, ValueError, "trees over 8 make 9"),
    ([1], {"num_classes": 9.0}, TypeError, "num_classes must be an int"),
    (None, {"num_classes": 9}, ValueError, "trees are over 8 classes"),
])
def test_bad_heads_are_named(head, kwargs, error, message):
  trees = [tf_hsm.Tree.huffman(np.arange(1, 9), 2), tf_hsm.Tree.huffman(np.arange(1, 9), 3)]
  with pytest.raises(error, match=message):
    HierarchicalSoftmaxMixture(trees, head=head, **kwargs)


def test_components_with_their_own_ignore_class_are_refused_beside_a_head():
  trees = [tf_hsm.Tree.huffman(np.arange(1, 9), 2), tf_hsm.Tree.huffman(np.arange(1, 9), 3)]
  components = [tf_hsm.HierarchicalSoftmax(t, ignore_class=0) for t in trees]
  with pytest.raises(ValueError, match="components' ignore_class must be None"):
    HierarchicalSoftmaxMixture(components, head=[3])


def test_head_rank_beside_fused_updates_trains_the_head_by_its_gradient(rng):
  """The trees' tables by their fused update, the corrected heads' table (scored in
  the mixture, not by the op) by LazyAdam's step of its gradient: every weight moves."""
  num_classes = 20
  trees = [tf_hsm.Tree.huffman(rng.integers(1, 50, num_classes - 3), branching=b)
           for b in (2, 3)]
  components = [tf_hsm.HierarchicalSoftmax(t, fused_update=True) for t in trees]
  layer = HierarchicalSoftmaxMixture(components, head=[3, 0, 7], head_rank=2, name="mixture")
  assert not layer.head.fused_update and all(c.fused_update for c in layer.components)
  tokens = keras.Input([6], dtype="int32")
  targets = keras.Input([6], dtype="int32")
  hidden = keras.layers.Embedding(num_classes, 8)(tokens)
  model = keras.Model([tokens, targets], layer(hidden, targets))
  model.compile(optimizer=tf_hsm.optimizers.LazyAdam(0.05), loss=tf_hsm.losses.nll)
  start = [np.asarray(w) for w in model.weights]
  x = rng.integers(0, num_classes, size=(32, 6)).astype(np.int32)
  history = model.fit([x, (x + 1) % num_classes], (x + 1) % num_classes, batch_size=8,
                      epochs=6, verbose=0)
  assert history.history["loss"][-1] < 0.8 * history.history["loss"][0]
  assert all(not np.array_equal(s, np.asarray(w)) for s, w in zip(start, model.weights))


def test_num_classes_given_is_checked_and_kept_in_the_config():
  trees = [tf_hsm.Tree.huffman(np.arange(1, 9), 2), tf_hsm.Tree.huffman(np.arange(1, 9), 3)]
  layer = HierarchicalSoftmaxMixture(trees, head=[1, 4], num_classes=10)
  assert layer.num_classes == 10
  again = HierarchicalSoftmaxMixture.from_config(layer.get_config())
  assert again.num_classes == 10 and again.get_config()["num_classes"] == 10
  assert "num_classes" not in HierarchicalSoftmaxMixture(trees, head=[1]).get_config()


def test_targets_beyond_the_classes_are_named(rng):
  layer, num_classes = _headed(rng)
  hidden = rng.normal(size=(2, D))
  with pytest.raises(tf.errors.InvalidArgumentError, match="num_classes"):
    layer(hidden, np.array([0, num_classes]))
  with pytest.raises(TypeError, match="integer class ids"):
    layer(hidden, np.array([0.0, 1.0]))


def test_targets_beyond_the_classes_are_named_in_fit():
  """In fit's graph the check runs before the class map's gather, whose own error
  ("indices[...] = 1000 is not in [0, 1000)", naming a GatherV2) would come first."""
  num_classes, head = 1000, np.arange(1, 33)
  tail = HierarchicalSoftmaxMixture.tail_classes(head, num_classes)
  layer = HierarchicalSoftmaxMixture([tf_hsm.Tree.balanced(len(tail), 8)] * 2, head=head,
                                     ignore_class=0)
  tokens, targets = keras.Input([None], dtype="int32"), keras.Input([None], dtype="int32")
  model = keras.Model([tokens, targets],
                      layer(keras.layers.Embedding(num_classes, D)(tokens), targets))
  model.compile(optimizer="sgd", loss=tf_hsm.losses.nll)
  x = np.random.default_rng(0).integers(1, num_classes, size=(64, 8))
  y = np.roll(x, -1, 1)
  y[0, 0] = num_classes
  with pytest.raises(tf.errors.InvalidArgumentError, match="targets must be < num_classes"):
    model.fit([x, y], y, epochs=1, verbose=0)


@pytest.mark.parametrize("head_rank", [None, 2])
def test_targets_not_shaped_as_the_hidden_states_are_refused(rng, head_rank):
  """With head_rank the shared head's own call (and its check) does not run: the
  mixture checks the shapes itself, statically and, for dimensions known only at run
  time, before its flattened gathers would pair hidden states with other tokens'
  targets."""
  layer, num_classes = _headed(rng, head_rank=head_rank)
  hidden = tf.constant(rng.normal(size=(4, 5, D)))
  targets = tf.constant(rng.integers(0, num_classes, size=(4, 5)))
  layer(hidden, targets)
  for bad in (targets[..., None], tf.transpose(targets)):
    with pytest.raises(ValueError, match="targets must have hidden's shape"):
      layer(hidden, bad)
  with pytest.raises(ValueError, match="return_sequences=True"):
    layer(hidden[:, 0], targets)
  call = tf.function(layer, input_signature=[tf.TensorSpec([None, None, D], tf.float64),
                                             tf.TensorSpec([None, None], tf.int64)])
  np.testing.assert_allclose(call(hidden, targets), layer(hidden, targets))
  with pytest.raises(tf.errors.InvalidArgumentError, match="targets must have hidden"):
    call(hidden, tf.transpose(targets))
  # Ranks unknown until run time: [4] against [4, 5] would broadcast as dimensions.
  unranked = tf.function(layer, input_signature=[tf.TensorSpec(None, tf.float64),
                                                 tf.TensorSpec(None, tf.int64)])
  with pytest.raises(tf.errors.InvalidArgumentError, match="targets must have hidden"):
    unranked(hidden[:, :4], targets[:, 0])


def test_tail_trees_from_context_are_over_the_classes_given():
  ids = np.random.default_rng(0).zipf(1.3, 5000) % 60
  counts = np.bincount(ids, minlength=60)
  trees, head = demo_trees.context_trees(ids, counts, 6, 4, count=2, shared_head=True)
  np.testing.assert_array_equal(head, np.argsort(-counts, kind="stable")[:6])
  assert all(t.num_classes == 54 for t in trees)
  assert all(t.max_branching == 4 for t in trees)
  np.testing.assert_array_equal(mixture_head.tail_classes(head, 60),
                                np.setdiff1d(np.arange(60), head))
  np.testing.assert_array_equal(HierarchicalSoftmaxMixture.tail_classes(head, 60),
                                mixture_head.tail_classes(head, 60))
  biases = demo_trees.head_biases(counts, head)
  np.testing.assert_allclose(np.exp(biases).sum(), 1.0, rtol=1e-12)
  for bad in ([3, 2], [0, 60], [[1, 2]]):
    with pytest.raises(ValueError, match="classes must be"):
      tf_hsm.Tree.from_context(ids, 60, counts, branching=4, classes=bad)


def test_the_trees_see_only_the_tail_s_tokens(rng):
  """A head or padded token walks no tree: no tree's gradient names a row for it (a
  LazyAdam would move such rows on their moments alone)."""
  layer, _ = _headed(rng, dtype="float32")
  hidden = tf.constant(rng.normal(size=(4, D)).astype(np.float32))
  targets = np.array([layer.head_ids[0], -1, layer.head_ids[-1], -1])
  layer(hidden, targets)
  with tf.GradientTape() as tape:
    total = tf.reduce_sum(layer(hidden, targets))
  grads = tape.gradient(total, [c.kernel for c in layer.components] + [layer.head.kernel])
  for grad in grads[:-1]:
    assert grad is None or int(tf.size(tf.convert_to_tensor(grad.indices))) == 0
  assert np.abs(np.asarray(tf.convert_to_tensor(grads[-1]))).sum() > 0


def test_masked_positions_may_hold_any_id_and_hidden_masks_count(rng):
  layer, num_classes = _headed(rng)
  hidden = rng.normal(size=(1, 3, D))
  targets = np.array([[1, num_classes + 5, 2]])
  out = layer(hidden, targets, mask=np.array([[True, False, True]]))
  np.testing.assert_array_equal(out._keras_mask, [[True, False, True]])  # pylint: disable=protected-access
  out = layer(hidden, np.array([[1, 2, 3]]), hidden_mask=np.array([[True, True, False]]))
  assert float(np.asarray(out)[0, 2]) == 0.0 and np.all(np.asarray(out)[0, :2] < 0)


def test_log_prob_all_names_keywords_it_cannot_take_with_a_head(rng):
  layer, num_classes = _headed(rng)
  layer(rng.normal(size=(1, D)), np.array([0]))
  with pytest.raises(ValueError, match="with a head takes no class_range"):
    layer.log_prob_all(rng.normal(size=(1, D)), class_range=(0, 2))


def test_frozen_with_a_head_trains_nothing(rng):
  first = tf_hsm.HierarchicalSoftmax(tf_hsm.Tree.huffman(np.arange(1, 9), 2), trainable=False)
  layer = HierarchicalSoftmaxMixture([first, tf_hsm.Tree.huffman(np.arange(1, 9), 3)],
                                     head=[0, 5])
  assert layer.head.trainable  # not component 0's setting: the mixture's
  frozen = HierarchicalSoftmaxMixture([tf_hsm.Tree.huffman(np.arange(1, 9), 2),
                                       tf_hsm.Tree.huffman(np.arange(1, 9), 3)],
                                      head=[0, 5], trainable=False, tail_dim=3)
  frozen(rng.normal(size=(2, D)).astype(np.float32), np.array([0, 3]))
  assert not frozen.trainable_weights and not frozen.head.trainable
  assert len(frozen.non_trainable_weights) == 9  # projection, gate (2), head and trees (2 each)


@pytest.mark.parametrize("head_rank", [None, 2])
def test_mixed_float16_scores_in_float32_with_a_tail_projection(rng, head_rank):
  layer, num_classes = _headed(rng, dtype="mixed_float16", tail_dim=2, head_rank=head_rank)
  hidden = tf.constant(rng.normal(size=(6, D)), tf.float16)
  targets = rng.integers(0, num_classes, size=6)
  targets[0] = layer.head_ids[0]
  layer(hidden, targets)
  assert layer.tail_projection.dtype == tf.float32
  if head_rank is not None:
    assert layer.head_correction_in.dtype == layer.head_correction_out.dtype == tf.float32
  _randomised(layer, rng, scale=0.5)
  with tf.GradientTape() as tape:
    tape.watch(hidden)
    out = layer(hidden, targets)
    total = tf.reduce_sum(out)
  assert out.dtype == tf.float32
  # The head and gate read the float16 hidden state, the trees its float32 projection
  # (not rounded to float16 at their call: the same values as log_prob_all's).
  np.testing.assert_allclose(out, _reference(np.asarray(hidden, np.float64), layer, targets),
                             rtol=2e-5, atol=2e-5)
  every = np.asarray(layer.log_prob_all(hidden))
  np.testing.assert_allclose(np.asarray(out), every[np.arange(6), targets], rtol=1e-5,
                             atol=1e-5)
  grad = np.asarray(tape.gradient(total, hidden), np.float32)
  assert np.all(np.isfinite(grad)) and np.all(np.abs(grad).sum(-1) > 0)
  every = layer.log_prob_all(hidden)
  np.testing.assert_allclose(np.exp(np.asarray(every, np.float64)).sum(-1), 1.0, rtol=1e-5)


@pytest.mark.parametrize("head_rank", [None, 2])
def test_sampling_s_edges_in_the_layer_and_its_stock_ops(rng, head_rank):
  """A -inf head bias only masks its class; a tiny temperature draws the best class, not
  -1 (the logits less their largest first); under XLA an unusable temperature gives -1
  (the export's promise); with or without the trees' corrected heads."""
  from tf_hsm.serving import mixture as stock  # pylint: disable=import-outside-toplevel
  layer, _ = _headed(rng, dtype="float32", head_rank=head_rank)
  hidden = rng.normal(size=(6, D)).astype(np.float32)
  layer(hidden, np.zeros(6, np.int64))
  _randomised(layer, rng, scale=0.5)
  weights = stock.MixtureWeights.from_layer(layer, lambda v, name: tf.Variable(np.asarray(v)))
  masked, best = layer.head_ids[0], layer.head_ids[-1]
  bias = np.asarray(layer.head.bias).copy()
  bias[0] = -np.inf
  layer.head.bias.assign(bias)
  weights.head[1].assign(bias)
  for drawn in (layer.sample(hidden, seed=2), stock.sample(weights, hidden, 2)):
    drawn = np.asarray(drawn)
    assert np.all(drawn >= 0) and masked not in drawn
  bias[:] = 0.0
  bias[len(layer.head_ids) - 1] = 200.0  # the last head class's slot
  layer.head.bias.assign(bias)
  weights.head[1].assign(bias)
  for drawn in (layer.sample(hidden, seed=2, temperature=1e-37),
                stock.sample(weights, hidden, 2, 1e-37)):
    np.testing.assert_array_equal(drawn, np.full(6, best))
  under_xla = tf.function(lambda h, t: stock.sample(weights, h, tf.constant(3, tf.int64), t),
                          jit_compile=True)
  np.testing.assert_array_equal(under_xla(hidden, tf.constant(np.inf, tf.float32)),
                                np.full(6, -1))


@pytest.mark.parametrize("head_rank", [None, 3])
def test_a_log_probability_is_never_above_zero(rng, head_rank):
  """Large logits in float32: the target's log-probability (its slot's logit read from
  the logits its normaliser sums) never exceeds 0."""
  layer, num_classes = _headed(rng, dtype="float32", head_rank=head_rank)
  hidden = rng.normal(size=(400, D)).astype(np.float32) * 3
  layer(hidden, np.zeros(400, np.int64))
  _randomised(layer, rng, scale=2.0)
  targets = np.argmax(np.asarray(layer.log_prob_all(hidden)), -1)
  assert np.asarray(layer(hidden, targets)).max() <= 0.0
