"""What a tf_hsm layer says about the way it is wired into a model, in both Keras: a
warning (once) when the compiled optimizer would update the whole table, naming the
sparse one; errors that say what to pass for missing targets, targets of the wrong
shape, a loss that reads class scores or compares values, and a Keras 3 metric in a tf_keras model."""

import re
import warnings

import keras
import numpy as np
import pytest

import tf_hsm
from tf_hsm import keras as hk3
from tf_hsm.frontend import wiring

tf_keras = pytest.importorskip("tf_keras")
from tf_hsm import tf_keras as hk2  # noqa: E402

V, D, T = 30, 6, 4
FRONTS = {"keras": (keras, hk3, "tf_hsm.optimizers"),
          "tf_keras": (tf_keras, hk2, r"tf_hsm\.tf_keras\.optimizers")}


def _model(keras_module, layer):
  hidden = keras_module.Input((T, D))
  targets = keras_module.Input((T,), dtype="int32")
  return keras_module.Model([hidden, targets], layer(hidden, targets))


def _data(rng):
  return (rng.standard_normal((8, T, D)).astype(np.float32),
          rng.integers(0, V, (8, T)).astype(np.int32))


def _fit_warnings(model, data, epochs=2):
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    model.fit(list(data), data[1], epochs=epochs, batch_size=4, verbose=0)
  return [str(w.message) for w in caught if "updates every row" in str(w.message)]


@pytest.mark.parametrize("which", ["keras", "tf_keras"])
@pytest.mark.parametrize("optimizer, hint", [
    ("adam", "LazyAdam"), ("adagrad", "SparseAdagrad"), ("rmsprop", "SparseAdagrad")])
def test_a_dense_optimizer_warns_once_naming_the_sparse_one(rng, which, optimizer, hint):
  keras_module, front, package = FRONTS[which]
  model = _model(keras_module, front.HierarchicalSoftmax(tf_hsm.Tree.balanced(V, 3),
                                                         name="hsm"))
  model.compile(optimizer=optimizer, loss=front.losses.nll)
  found = _fit_warnings(model, _data(rng))
  assert len(found) == 1, found  # two epochs, two batches each: one warning
  assert "'hsm'" in found[0]
  assert re.search(rf"use {package}\.{hint}\b", found[0]), found[0]


@pytest.mark.parametrize("which", ["keras", "tf_keras"])
def test_sparse_optimizers_do_not_warn(rng, which):
  keras_module, front, _ = FRONTS[which]
  for optimizer in (front.optimizers.LazyAdam(1e-3), front.optimizers.SparseSGD(0.1, 0.9),
                    keras_module.optimizers.SGD(0.1)):
    model = _model(keras_module, front.HierarchicalSoftmax(tf_hsm.Tree.balanced(V, 3)))
    model.compile(optimizer=optimizer, loss=front.losses.nll)
    assert _fit_warnings(model, _data(rng), epochs=1) == []
  model = _model(keras_module, front.HierarchicalSoftmax(tf_hsm.Tree.balanced(V, 3)))
  model.compile(optimizer=keras_module.optimizers.SGD(0.1, momentum=0.9),
                loss=front.losses.nll)
  assert "SparseSGD" in _fit_warnings(model, _data(rng), epochs=1)[0]


@pytest.mark.parametrize("which", ["keras", "tf_keras"])
def test_adaptive_softmax_warns_for_tree_tails_only(rng, which):
  keras_module, front, _ = FRONTS[which]
  for tail, expected in (("flat", 0), ("two_level", 1)):
    model = _model(keras_module, front.AdaptiveSoftmax(V, [6, 15], div_value=2.0, tail=tail))
    model.compile(optimizer="adam", loss=front.losses.nll)
    assert len(_fit_warnings(model, _data(rng), epochs=1)) == expected, tail


def test_the_hint_unwraps_loss_scaling_and_reads_momentum():
  adam = keras.optimizers.Adam()
  assert wiring.dense_update_hint(keras.optimizers.LossScaleOptimizer(adam)) == "LazyAdam"
  assert wiring.dense_update_hint(keras.optimizers.SGD(momentum=0.5)) == "SparseSGD"
  assert wiring.dense_update_hint(keras.optimizers.SGD()) is None
  assert wiring.dense_update_hint(hk3.optimizers.LazyAdam()) is None
  assert wiring.dense_update_hint(tf_keras.optimizers.legacy.Adagrad()) is None
  assert wiring.dense_update_hint(tf_keras.optimizers.legacy.Adam()) == "LazyAdam"


@pytest.mark.parametrize("which", ["keras", "tf_keras"])
def test_missing_targets_say_what_to_pass(which):
  keras_module, front, _ = FRONTS[which]
  hidden = keras_module.Input((T, D))
  layer = front.HierarchicalSoftmax(tf_hsm.Tree.balanced(V, 3))
  for call in (lambda: layer(hidden), lambda: layer(hidden, None)):
    with pytest.raises(ValueError, match=r"needs the targets.*keras\.Input.*"
                                         r"inference_model\(model\)"):
      call()
  with pytest.raises(ValueError, match="needs the targets"):
    front.AdaptiveSoftmax(V, [6, 15], div_value=2.0)(hidden)


@pytest.mark.parametrize("which", ["keras", "tf_keras"])
def test_targets_of_another_shape_say_so(which):
  keras_module, front, _ = FRONTS[which]
  hidden = keras_module.Input((D,))
  targets = keras_module.Input((T,), dtype="int32")
  with pytest.raises(ValueError, match=r"got hidden \[None, 6\] and targets \[None, 4\].*"
                                       "return_sequences=True"):
    front.HierarchicalSoftmax(tf_hsm.Tree.balanced(V, 3))(hidden, targets)
  sequence = keras_module.Input((T + 1, D))
  with pytest.raises(ValueError, match=r"hidden \[None, 5, 6\] and targets \[None, 4\]"):
    front.AdaptiveSoftmax(V, [6, 15], div_value=2.0)(sequence, targets)
  # Labels [batch, 1] beside hidden [batch, D]: drop the axis, nothing recurrent.
  labels = keras_module.Input((1,), dtype="int64")
  with pytest.raises(ValueError, match=r"trailing axis of 1.*tf\.squeeze") as raised:
    front.HierarchicalSoftmax(tf_hsm.Tree.balanced(V, 3))(hidden, labels)
  assert "return_sequences" not in str(raised.value)


@pytest.mark.parametrize("which", ["keras", "tf_keras"])
@pytest.mark.parametrize("loss", ["sparse_categorical_crossentropy", "object"])
def test_a_class_score_loss_names_nll(rng, which, loss):
  keras_module, front, _ = FRONTS[which]
  if loss == "object":
    loss = keras_module.losses.SparseCategoricalCrossentropy()
  model = _model(keras_module, front.HierarchicalSoftmax(tf_hsm.Tree.balanced(V, 3)))
  model.compile(optimizer=front.optimizers.LazyAdam(), loss=loss)
  package = "tf_hsm.losses" if which == "keras" else r"tf_hsm\.tf_keras\.losses"
  with pytest.raises(ValueError, match=rf"'sparse_categorical_crossentropy'.*outputs log P"
                                       rf"\(target\).*loss={package}\.nll"):
    model.fit(list(_data(rng)), _data(rng)[1], verbose=0)


@pytest.mark.parametrize("which", ["keras", "tf_keras"])
@pytest.mark.parametrize("loss", ["mse", "object"])
def test_a_loss_of_values_names_nll(rng, which, loss):
  """With 1-D targets the output's shape is the targets': "mse" would train log
  P(target) towards the class id without an error of Keras'."""
  keras_module, front, _ = FRONTS[which]
  if loss == "object":
    loss = keras_module.losses.MeanAbsoluteError()
  hidden = keras_module.Input((D,))
  targets = keras_module.Input((), dtype="int32")
  layer = front.HierarchicalSoftmax(tf_hsm.Tree.balanced(V, 3))
  model = keras_module.Model([hidden, targets], layer(hidden, targets))
  model.compile(optimizer=front.optimizers.LazyAdam(), loss=loss)
  x, y = _data(rng)
  with pytest.raises(ValueError, match=r"'(mse|mean_absolute_error)'\) compares the model's "
                                       r"output with the targets.*outputs log P\(target\)"):
    model.fit([x[:, 0], y[:, 0]], y[:, 0], verbose=0)


def test_a_keras3_metric_in_a_tf_keras_model_names_the_tf_keras_one():
  model = _model(tf_keras, hk2.HierarchicalSoftmax(tf_hsm.Tree.balanced(V, 3)))
  with pytest.raises(TypeError, match=r"use tf_hsm\.tf_keras\.metrics\.Perplexity"):
    model.compile(loss=hk2.losses.nll, metrics=[hk3.metrics.Perplexity()])


def test_the_loss_is_checked_through_an_inner_model_and_not_for_an_added_loss(rng):
  """An outer model whose output is an inner model's that ends in the layer is checked;
  a subclassed model using the layer as an added loss beside a classifier head trains."""
  tree = tf_hsm.Tree.balanced(V, 3)
  hidden, targets = keras.Input((D,)), keras.Input((), dtype="int32")
  inner = keras.Model([hidden, targets], hk3.HierarchicalSoftmax(tree)(hidden, targets))
  x, t = keras.Input((D,)), keras.Input((), dtype="int32")
  outer = keras.Model([x, t], inner([keras.layers.Dense(D)(x), t]))
  outer.compile(optimizer=hk3.optimizers.LazyAdam(), loss="mse")
  h, y = _data(rng)
  with pytest.raises(ValueError, match="'mse'.*compares the model's output"):
    outer.fit([h[:, 0], y[:, 0]], y[:, 0], verbose=0)

  class WithAddedLoss(keras.Model):

    def __init__(self):
      super().__init__()
      self.hsm = hk3.HierarchicalSoftmax(tree)
      self.head = keras.layers.Dense(3, activation="softmax")

    def call(self, inputs):
      features, ids = inputs
      self.add_loss(-keras.ops.mean(self.hsm(features, ids)))
      return self.head(features)

  model = WithAddedLoss()
  model.compile(optimizer=hk3.optimizers.LazyAdam(),
                loss="sparse_categorical_crossentropy")
  model.fit([h[:, 0], y[:, 0]], y[:, 0] % 3, verbose=0)


@pytest.mark.parametrize("which", ["keras", "tf_keras"])
def test_a_mixture_names_a_wrong_loss_and_a_dense_optimizer(rng, which):
  """tf_keras names the mixture, not the model, to its components: the mixture checks."""
  keras_module, front, package = FRONTS[which]
  trees = [tf_hsm.Tree.balanced(V, 3), tf_hsm.Tree.balanced(V, 5)]
  model = _model(keras_module, front.HierarchicalSoftmaxMixture(trees))
  model.compile(optimizer=front.optimizers.LazyAdam(), loss="mse")
  with pytest.raises(ValueError, match="'mse'.*compares the model's output"):
    model.fit(list(_data(rng)), _data(rng)[1], verbose=0)
  model = _model(keras_module, front.HierarchicalSoftmaxMixture(trees))
  model.compile(optimizer=keras_module.optimizers.Adam(), loss=front.losses.nll)
  caught = _fit_warnings(model, _data(rng), epochs=1)
  assert caught and re.search(rf"use {package}\.LazyAdam", caught[0]), caught
