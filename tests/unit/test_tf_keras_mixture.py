"""`tf_hsm.tf_keras.HierarchicalSoftmaxMixture` against the Keras 3 layer (same weights,
same log-probabilities, gradients and inference; with and without a shared head and a
`tail_dim`), trained by tf_keras' fit, saved and loaded, cut by `inference_model` and
served by the export, built by the planner under TF_USE_LEGACY_KERAS, and the errors
that stop the two Keras from being mixed."""

import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

tf_keras = pytest.importorskip("tf_keras")

import tf_hsm  # noqa: E402
from tf_hsm import keras as hk3  # noqa: E402
from tf_hsm import tf_keras as hk2  # noqa: E402
from tf_hsm.serving import ServingModule  # noqa: E402

import support  # noqa: E402

D = 6
MACHINE = {"matmul_flops": 5e10, "read_bytes": 1e10, "call_seconds": 2e-4,
           "tree_step": (3e-11, 1e-10, 7e-11, 2e-7, 1e-8, 5e-4)}


def _layers(rng, headed, tail_dim=None, head_rank=None):
  """(Keras 3 layer, tf_keras layer, V) of one configuration, the tf_keras one holding
  the Keras 3 one's weights (random, so that the gate and biases matter)."""
  num_head = 4 if headed else 0
  tail = 30
  trees = [tf_hsm.Tree.huffman(rng.integers(1, 50, tail), branching=b) for b in (2, 3, 5)]
  kwargs = {}
  if headed:
    kwargs = dict(head=rng.permutation(tail + num_head)[:num_head], ignore_class=None,
                  tail_dim=tail_dim, head_rank=head_rank)
  layer3 = hk3.HierarchicalSoftmaxMixture(trees, **kwargs)
  layer2 = hk2.HierarchicalSoftmaxMixture(trees, **kwargs)
  layer3.build((None, D))
  layer2.build((None, D))
  assert [w.shape for w in layer2.weights] == [tuple(w.shape) for w in layer3.weights]
  values = [rng.normal(size=w.shape).astype(np.float32) * 0.5 for w in layer3.weights]
  layer3.set_weights(values)
  layer2.set_weights(values)
  return layer3, layer2, tail + num_head


@pytest.mark.parametrize("headed,tail_dim,head_rank", [
    (False, None, None), (True, None, None), (True, 3, None), (True, None, 2)])
def test_same_weights_give_the_keras3_results(rng, headed, tail_dim, head_rank):
  layer3, layer2, num_classes = _layers(rng, headed, tail_dim, head_rank)
  hidden = tf.constant(rng.normal(size=(3, 4, D)), tf.float32)
  targets = rng.integers(0, num_classes, (3, 4)).astype(np.int32)
  targets[0, 0] = -1
  targets = tf.constant(targets)
  mask = tf.constant(rng.random((3, 4)) > 0.3)
  results = support.layer_results((layer3, layer2), hidden, targets, mask, 5, 7)
  (out3, mask3, grads3, top3, all3, drawn3), (out2, mask2, grads2, top2, all2, drawn2) = \
      results
  np.testing.assert_allclose(out2.numpy(), out3.numpy(), rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(mask2.numpy(), mask3.numpy())
  assert out3.numpy()[0, 0] == 0 and (out3.numpy()[mask.numpy() & (targets.numpy() >= 0)]
                                      < 0).all()
  for g2, g3 in zip(grads2, grads3):
    np.testing.assert_allclose(tf.convert_to_tensor(g2).numpy(),
                               tf.convert_to_tensor(g3).numpy(), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(all2.numpy(), all3.numpy(), rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(np.exp(all2.numpy()).sum(-1), 1.0, rtol=1e-5)
  np.testing.assert_array_equal(top2[1].numpy(), top3[1].numpy())
  np.testing.assert_array_equal(drawn2.numpy(), drawn3.numpy())


def _model(trees, **kwargs):
  tokens = tf_keras.Input((None,), dtype="int32", name="tokens")
  targets = tf_keras.Input((None,), dtype="int32", name="targets")
  hidden = tf_keras.layers.Embedding(trees[0].num_classes + len(kwargs.get("head", ())), D,
                                     mask_zero=True)(tokens)
  layer = hk2.HierarchicalSoftmaxMixture(trees, name="mixture", **kwargs)
  model = tf_keras.Model([tokens, targets], layer(hidden, targets))
  model.compile(optimizer=hk2.optimizers.LazyAdam(0.05), loss=hk2.losses.nll)
  return model


@pytest.mark.parametrize("name", ["model.keras", "model.h5", "saved_model"])
def test_fit_trains_every_part_and_a_saved_model_gives_the_same_output(rng, tmp_path, name):
  trees = [tf_hsm.Tree.huffman(rng.integers(1, 50, 26), branching=b) for b in (2, 4)]
  model = _model(trees, head=[3, 7, 1, 0], tail_dim=4, head_rank=2)
  layer = model.get_layer("mixture")
  ids = {id(v) for v in model.trainable_variables}
  assert all(id(w) in ids for w in layer.trainable_weights)
  x = rng.integers(0, 30, size=(32, 6)).astype(np.int32)
  y = (x + 1) % 30
  before = [w.numpy().copy() for w in model.weights]
  history = model.fit([x, y], y, batch_size=8, epochs=8, verbose=0)
  assert history.history["loss"][-1] < 0.7 * history.history["loss"][0]
  assert all(not np.array_equal(b, w.numpy()) for b, w in zip(before, model.weights))
  # x == 0 is masked by the embedding: those positions are 0 and carry no loss.
  assert np.all(model.predict([x, y], verbose=0)[x == 0] == 0.0)
  path = str(tmp_path / name)
  model.save(path, save_format="tf" if name == "saved_model" else None)
  loaded = tf_keras.models.load_model(path)
  assert isinstance(loaded.get_layer("mixture"), hk2.HierarchicalSoftmaxMixture)
  np.testing.assert_array_equal(loaded.predict([x, y], verbose=0),
                                model.predict([x, y], verbose=0))


def test_inference_model_and_the_export_serve_it(rng):
  trees = [tf_hsm.Tree.huffman(rng.integers(1, 50, 26), branching=b) for b in (2, 4)]
  model = _model(trees, head=[3, 7, 1, 0])
  x = rng.integers(1, 30, size=(4, 5)).astype(np.int32)
  model.fit([x, x], x, epochs=1, verbose=0)
  layer = model.get_layer("mixture")
  predicted = hk2.inference_model(model, k=3).predict(x, verbose=0)
  served = ServingModule(model, k=3).top_k(tokens=tf.constant(x))
  np.testing.assert_array_equal(served["classes"].numpy(), predicted["classes"])
  np.testing.assert_allclose(served["log_probs"].numpy(), predicted["log_probs"],
                             rtol=1e-5, atol=1e-5)
  assert layer.num_classes == 30


def test_an_explicit_mask_joins_the_hidden_states_mask_as_in_keras3(rng):
  """Embedding(mask_zero) masks token 0; an explicit mask masks position 3 too: both
  layers of tf_keras give 0 at both, as Keras 3's do."""
  trees = [tf_hsm.Tree.huffman(rng.integers(1, 50, 26), branching=b) for b in (2, 4)]
  x = rng.integers(1, 26, (4, 6)).astype(np.int32)
  x[:, 0] = 0
  y = rng.integers(0, 26, (4, 6)).astype(np.int32)
  explicit = np.ones((4, 6), bool)
  explicit[:, 3] = False
  for package, front_end in ((keras, hk3), (tf_keras, hk2)):
    for output in (front_end.HierarchicalSoftmaxMixture(trees),
                   front_end.HierarchicalSoftmax(trees[0])):
      tokens = package.Input((None,), dtype="int32")
      targets = package.Input((None,), dtype="int32")
      mask = package.Input((None,), dtype="bool")
      hidden = package.layers.Embedding(26, D, mask_zero=True)(tokens)
      model = package.Model([tokens, targets, mask], output(hidden, targets, mask=mask))
      out = model.predict([x, y, explicit], verbose=0)
      assert (out[:, 0] == 0).all() and (out[:, 3] == 0).all(), (package.__name__, output)
      assert (np.delete(out, [0, 3], 1) < 0).all()


def test_mixing_the_two_keras_is_refused_by_name():
  tree = tf_hsm.Tree.huffman(np.arange(1, 9), branching=2)
  trees = [tree, tf_hsm.Tree.huffman(np.arange(1, 9), branching=3)]
  with pytest.raises(TypeError, match=r"in a keras \(Keras 3\) model use "
                                      r"tf_hsm\.keras\.HierarchicalSoftmaxMixture"):
    hk2.HierarchicalSoftmaxMixture(trees, head=[0])(keras.Input((D,)),
                                                    keras.Input((), dtype="int32"))
  with pytest.raises(TypeError, match=r"use tf_hsm\.tf_keras\.HierarchicalSoftmaxMixture"):
    hk3.HierarchicalSoftmaxMixture(trees, head=[0])(tf_keras.Input((D,)),
                                                    tf_keras.Input((), dtype="int32"))
  with pytest.raises(TypeError, match=r"components\[0\] must be a Tree or a "
                                      r"HierarchicalSoftmax \(tf_keras\), got "
                                      "HierarchicalSoftmax"):
    hk2.HierarchicalSoftmaxMixture([hk3.HierarchicalSoftmax(tree), tree])
  with pytest.raises(TypeError, match=r"\(Keras 3\)"):
    hk3.HierarchicalSoftmaxMixture([hk2.HierarchicalSoftmax(tree), tree])
  with pytest.raises(ValueError, match="fused_update is Keras 3's"):
    hk2.HierarchicalSoftmaxMixture(trees, fused_update=True)


def test_targets_not_shaped_as_the_hidden_states_are_refused_in_tf_keras(rng):
  """The shared head corrected at low rank never calls the head, whose call checks the
  shapes: the mixture does, as the Keras 3 one does."""
  _, layer2, num_classes = _layers(rng, headed=True, head_rank=2)
  with pytest.raises(ValueError, match="trailing axis of 1"):
    layer2(tf_keras.Input((7, D)), tf_keras.Input((7, 1), dtype="int32"))
  with pytest.raises(ValueError, match="return_sequences=True"):
    layer2(rng.normal(size=(4, D)).astype(np.float32),
           rng.integers(0, num_classes, size=(4, 7)))


def test_both_layers_have_the_same_public_methods():
  def public(cls):
    return {name for name in dir(cls) if not name.startswith("_")
            and name not in dir(keras.layers.Layer) and name not in dir(tf_keras.layers.Layer)}
  assert public(hk2.HierarchicalSoftmaxMixture) == public(hk3.HierarchicalSoftmaxMixture)


def test_the_planner_builds_the_tf_keras_mixture_under_legacy_keras(monkeypatch):
  ids, counts = support.zipf_ids()
  monkeypatch.setattr(tf_hsm, "_KERAS", "tf_hsm.tf_keras")
  report = tf_hsm.plan(3_000, 16, 256, counts=counts, machine=MACHINE,
                       adaptive=(), token_ids=ids, trees=("mixture16_shared128",))
  layer = report.layer.build(dtype="float32")
  assert isinstance(layer, hk2.HierarchicalSoftmaxMixture)
  assert all(isinstance(c, hk2.HierarchicalSoftmax) for c in layer.components)
  hidden = tf_keras.Input((8,))
  targets = tf_keras.Input((), dtype="int32")
  model = tf_keras.Model([hidden, targets], layer(hidden, targets))
  model.compile(optimizer=hk2.optimizers.LazyAdam(0.05), loss=hk2.losses.nll)
  rng = np.random.default_rng(0)
  x = rng.normal(size=(128, 8)).astype(np.float32)
  y = rng.integers(0, 3_000, 128).astype(np.int32)
  history = model.fit([x, y], y, batch_size=64, epochs=2, verbose=0)
  assert history.history["loss"][-1] < history.history["loss"][0]


def test_legacy_keras_resolves_to_the_tf_keras_mixture():
  code = "import tf_hsm; print(tf_hsm.HierarchicalSoftmaxMixture.__module__)"
  out = support.run([sys.executable, "-c", code], timeout=120,
                    env=support.repo_env(TF_USE_LEGACY_KERAS="1")).stdout.split()
  assert out == ["tf_hsm.tf_keras.mixture"]
