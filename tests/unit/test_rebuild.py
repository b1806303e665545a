"""HierarchicalSoftmax.rebuild_tree and tf_hsm.callbacks: what carries over to the new
tree (class rows exactly, internal rows, unigram biases, the optimizer's state), exact
log-probabilities on the new tree, training on after a rebuild inside `fit` with every
optimizer, saving, export and inference after it, vectors from an Embedding, errors."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_hsm
from oracle import log_prob_reference
from tf_hsm.keras import losses
from tf_hsm.keras import optimizers
from tf_hsm.keras.callbacks import RebuildTree
from tf_hsm.keras.callbacks import rebuild_tree
from tf_hsm.keras.layers import HierarchicalSoftmax

_CLASSES = 48
_SEQ = 5


def _counts(rng):
  counts = rng.zipf(1.4, size=_CLASSES).clip(max=1000).astype(np.float64)
  counts[3] = 0  # a class never seen: its bias must stay finite
  return counts


def _lm(tree, dim=8, use_bias=True):
  """A tiny [tokens, targets] -> log-prob model over the tree's classes."""
  tokens = keras.Input((_SEQ,), dtype="int32")
  targets = keras.Input((_SEQ,), dtype="int32")
  x = keras.layers.Embedding(tree.num_classes, dim, name="embedding")(tokens)
  x = keras.layers.Dense(12, activation="tanh", name="dense")(x)
  log_probs = HierarchicalSoftmax(tree, use_bias=use_bias, name="hsm")(x, targets)
  return keras.Model([tokens, targets], log_probs)


def _data(rng, n=64):
  x = rng.integers(0, _CLASSES, size=(n, _SEQ)).astype(np.int32)
  y = ((x * 7 + 3) % _CLASSES).astype(np.int32)  # a function of the input token
  return x, y


def _trained_layer(rng, tree=None, use_bias=True, dtype=None):
  """A HierarchicalSoftmax with random (as if trained) weights, built on dim 6."""
  tree = tree or tf_hsm.Tree.huffman(_counts(rng) + 1, branching=3)
  layer = HierarchicalSoftmax(tree, use_bias=use_bias, kernel_initializer="random_normal",
                              bias_initializer="random_normal", dtype=dtype)
  layer.build((None, 6))
  return layer


def _masses(tree, counts):
  """Class and node masses from the definition: a node's mass is that of the classes
  whose paths pass through it; a zero count counts half the smallest positive one."""
  mass = np.where(counts > 0, counts, 0.5 * counts[counts > 0].min())
  node_mass = np.zeros(tree.num_nodes)
  members = [[] for _ in range(tree.num_nodes)]
  for c in range(tree.num_classes):
    for node, _ in tree.path(c):
      node_mass[node] += mass[c]
      members[node].append(c)
  return mass, node_mass, members


def test_class_rows_move_exactly_and_the_rest_starts_from_the_counts(rng):
  layer = _trained_layer(rng)
  counts = _counts(rng)
  old_tree, old_kernel = layer.tree, layer.kernel.numpy()
  old_rows = old_kernel[old_tree.class_slot]
  tree = layer.rebuild_tree(counts=counts, branching=4, seed=3)
  assert layer.tree is tree and tree != old_tree
  assert tree == tf_hsm.Tree.from_vectors(old_rows, counts=counts, branching=4, seed=3)
  kernel, bias = layer.kernel.numpy(), layer.bias.numpy()
  assert kernel.shape == (tree.num_slots, 6) and bias.shape == (tree.num_slots,)
  assert [v.name for v in layer.weights] == ["kernel", "bias"]
  np.testing.assert_array_equal(kernel[tree.class_slot], old_rows)
  mass, node_mass, members = _masses(tree, counts)
  for node in range(1, tree.num_nodes):
    below = members[node]
    expected = (mass[below, None] * old_rows[below]).sum(0) / mass[below].sum()
    np.testing.assert_allclose(kernel[tree.node_slot[node]], expected, rtol=1e-5, atol=1e-6)
  for slot, child in enumerate(tree.slot_child):
    child_mass = mass[child] if child < _CLASSES else node_mass[child - _CLASSES]
    np.testing.assert_allclose(bias[slot], np.log(child_mass / node_mass[
        tree.slot_node[slot]]), rtol=1e-5, atol=1e-6)
  assert np.all(np.isfinite(bias))


def test_without_counts_the_biases_are_uniform_over_classes(rng):
  layer = _trained_layer(rng, use_bias=True)
  tree = layer.rebuild_tree()
  # Under zero weights the new layer is the uniform distribution.
  zeros = np.zeros((1, 6), np.float32)
  layer.kernel.assign(np.zeros(layer.kernel.shape, np.float32))
  np.testing.assert_allclose(layer.log_prob_all(zeros).numpy(),
                             np.full((1, tree.num_classes), -np.log(_CLASSES)), rtol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_log_probs_on_the_new_tree_match_the_reference(rng, dtype):
  layer = _trained_layer(rng, dtype=dtype)
  tree = layer.rebuild_tree(tf_hsm.Tree.balanced(_CLASSES, 5), counts=_counts(rng))
  assert layer.kernel.dtype == dtype and layer.kernel.shape[0] == tree.num_slots
  hidden = rng.normal(size=(4, 6)).astype(dtype)
  all_log_probs = layer.log_prob_all(hidden).numpy()
  assert all_log_probs.shape == (4, _CLASSES)
  np.testing.assert_allclose(np.exp(all_log_probs.astype(np.float64)).sum(-1), 1.0,
                             rtol=1e-5)
  classes = np.tile(np.arange(_CLASSES), 4)
  expected = log_prob_reference(np.repeat(hidden, _CLASSES, axis=0), layer.kernel.numpy(),
                                layer.bias.numpy(), tree, classes)[0].reshape(4, _CLASSES)
  tolerance = 1e-5 if dtype == "float32" else 1e-12
  np.testing.assert_allclose(all_log_probs, expected, rtol=tolerance, atol=tolerance)
  targets = rng.integers(0, _CLASSES, size=4)
  np.testing.assert_allclose(layer(hidden, targets).numpy(),
                             expected[np.arange(4), targets], rtol=tolerance,
                             atol=tolerance)
  log_probs, top = layer.top_k(hidden, 3)
  np.testing.assert_array_equal(top.numpy(), np.argsort(-expected, -1, kind="stable")[:, :3])
  np.testing.assert_allclose(log_probs.numpy(), np.sort(expected, -1)[:, ::-1][:, :3],
                             rtol=tolerance, atol=tolerance)
  samples = layer.sample(hidden, seed=5).numpy()
  assert samples.shape == (4,) and np.all((samples >= 0) & (samples < _CLASSES))


def test_layer_without_bias(rng):
  layer = _trained_layer(rng, use_bias=False)
  old_rows = layer.kernel.numpy()[layer.tree.class_slot]
  tree = layer.rebuild_tree(branching=2)
  assert layer.bias is None and [v.name for v in layer.weights] == ["kernel"]
  np.testing.assert_array_equal(layer.kernel.numpy()[tree.class_slot], old_rows)
  hidden = rng.normal(size=(2, 6)).astype(np.float32)
  np.testing.assert_allclose(np.exp(layer.log_prob_all(hidden).numpy()).sum(-1), 1.0,
                             rtol=1e-5)


def _snapshots(layer, store):
  """A callback that records the layer's tree and table at each epoch's end."""
  return keras.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: store.append(
      (layer.tree, layer.kernel.numpy().copy())))


@pytest.mark.parametrize("make_optimizer", [
    lambda: optimizers.LazyAdam(0.02),
    lambda: optimizers.SparseAdagrad(0.3),
    lambda: optimizers.SparseSGD(0.1, momentum=0.9),
    lambda: keras.optimizers.Adam(0.02),
], ids=["LazyAdam", "SparseAdagrad", "SparseSGD_momentum", "keras_Adam"])
def test_fit_rebuilds_after_an_epoch_and_trains_on(rng, make_optimizer):
  keras.utils.set_random_seed(int(rng.integers(2**31)))  # initial weights and shuffling
  tree = tf_hsm.Tree.huffman(_counts(rng) + 1)
  model = _lm(tree)
  layer = model.get_layer("hsm")
  model.compile(optimizer=make_optimizer(), loss=losses.nll)
  x, y = _data(rng)
  rebuild = RebuildTree(layer, after_epoch=1, branching=4, counts=_counts(rng))
  before, after = [], []  # the layer at each epoch's end, before and after the callback
  history = model.fit([x, y], y, batch_size=16, epochs=3, verbose=0,
                      validation_data=([x, y], y),
                      callbacks=[_snapshots(layer, before), rebuild,
                                 _snapshots(layer, after)])
  loss, val_loss = history.history["loss"], history.history["val_loss"]
  assert np.all(np.isfinite(loss)) and np.all(np.isfinite(val_loss))
  assert rebuild.tree is not None and layer.tree is rebuild.tree and rebuild.tree != tree
  assert before[0][0] is tree
  assert after[0][0] is before[1][0] is before[2][0] is rebuild.tree
  # The epochs after the rebuild train the new table, and the loss goes on falling.
  assert after[0][1].shape == (rebuild.tree.num_slots, 12)
  assert not np.array_equal(after[0][1], before[1][1])
  assert not np.array_equal(before[1][1], before[2][1])
  assert loss[2] < loss[1] and val_loss[2] < val_loss[1]
  # The model's loss is the new layer's: predict and evaluate use the new tree too.
  out = model.predict([x, y], verbose=0)
  hidden = keras.Model(model.inputs, model.get_layer("dense").output)([x, y])
  np.testing.assert_allclose(out, tf_hsm.log_prob(hidden, layer.kernel, layer.bias,
                                                  rebuild.tree, y).numpy(),
                             rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(model.evaluate([x, y], y, verbose=0), -out.mean(), rtol=1e-5)


def test_the_optimizer_state_moves_with_the_class_rows(rng):
  model = _lm(tf_hsm.Tree.huffman(_counts(rng) + 1, branching=3))
  layer = model.get_layer("hsm")
  old_optimizer = optimizers.LazyAdam(0.02)
  model.compile(optimizer=old_optimizer, loss=losses.nll)
  x, y = _data(rng)
  model.fit([x, y], y, batch_size=16, epochs=1, verbose=0)
  old_tree = layer.tree
  before = {v.path: v.numpy() for v in old_optimizer.variables}
  tree = rebuild_tree(model, "hsm", branching=2)
  optimizer = model.optimizer
  assert optimizer is not old_optimizer and isinstance(optimizer, optimizers.LazyAdam)
  assert optimizer.get_config() == old_optimizer.get_config()
  assert [v.path for v in optimizer.variables] == list(before)
  for variable in optimizer.variables:
    old = before[variable.path]
    if variable.path.startswith(f"{optimizer.name}/hsm_"):
      new = variable.numpy()
      assert new.shape[0] == tree.num_slots
      np.testing.assert_array_equal(new[tree.class_slot], old[old_tree.class_slot])
      np.testing.assert_array_equal(new[tree.node_slot[1:]], 0.0)
    else:
      np.testing.assert_array_equal(variable.numpy(), old)  # the step count included
  history = model.fit([x, y], y, batch_size=16, epochs=2, verbose=0)
  assert np.all(np.isfinite(history.history["loss"]))
  assert old_optimizer.iterations.numpy() == 4 and optimizer.iterations.numpy() == 12


def test_mixed_float16_rebuilds_the_loss_scale_optimizer(rng):
  keras.mixed_precision.set_global_policy("mixed_float16")
  try:
    model = _lm(tf_hsm.Tree.huffman(_counts(rng) + 1))
    model.compile(optimizer=optimizers.LazyAdam(0.02), loss=losses.nll)
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    x, y = _data(rng, 32)
    rebuild = RebuildTree("hsm", after_epoch=1, branching=3)
    history = model.fit([x, y], y, batch_size=16, epochs=2, verbose=0, callbacks=[rebuild])
    layer = model.get_layer("hsm")
    assert layer.kernel.dtype == "float32" and layer.tree is rebuild.tree
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    assert isinstance(model.optimizer.inner_optimizer, optimizers.LazyAdam)
    assert np.all(np.isfinite(history.history["loss"]))
    assert model.optimizer.iterations.numpy() == 4
  finally:
    keras.mixed_precision.set_global_policy("float32")


def test_adagrad_accumulators_of_new_rows_start_at_their_initial_value(rng):
  model = _lm(tf_hsm.Tree.two_level(_CLASSES))
  model.compile(optimizer=optimizers.SparseAdagrad(0.3, initial_accumulator_value=0.25),
                loss=losses.nll)
  x, y = _data(rng, 32)
  model.fit([x, y], y, batch_size=16, epochs=1, verbose=0)
  tree = rebuild_tree(model, branching=3)
  accumulators = {v.path: v.numpy() for v in model.optimizer.variables}
  table = accumulators[f"{model.optimizer.name}/hsm_kernel_accumulator"]
  np.testing.assert_array_equal(table[tree.node_slot[1:]], 0.25)
  assert np.all(table[tree.class_slot] >= 0.25)


def test_save_load_and_export_after_a_rebuild(rng, tmp_path):
  model = _lm(tf_hsm.Tree.balanced(_CLASSES, 3))
  model.compile(optimizer=optimizers.LazyAdam(0.02), loss=losses.nll)
  x, y = _data(rng, 32)
  model.fit([x, y], y, batch_size=16, epochs=2, verbose=0,
            callbacks=[RebuildTree("hsm", after_epoch=1, counts=_counts(rng))])
  layer = model.get_layer("hsm")
  expected = model.predict([x, y], verbose=0)
  model.save(tmp_path / "m.keras")
  loaded = keras.models.load_model(tmp_path / "m.keras")
  assert loaded.get_layer("hsm").tree == layer.tree
  np.testing.assert_array_equal(loaded.predict([x, y], verbose=0), expected)
  hidden = rng.normal(size=(3, 12)).astype(np.float32)
  np.testing.assert_array_equal(loaded.get_layer("hsm").log_prob_all(hidden).numpy(),
                                layer.log_prob_all(hidden).numpy())
  assert len(loaded.optimizer.variables) == len(model.optimizer.variables)
  for ours, theirs in zip(model.optimizer.variables, loaded.optimizer.variables):
    np.testing.assert_array_equal(theirs.numpy(), ours.numpy())
  # Both go on training alike from there.
  model.fit([x, y], y, batch_size=16, epochs=1, verbose=0, shuffle=False)
  loaded.fit([x, y], y, batch_size=16, epochs=1, verbose=0, shuffle=False)
  np.testing.assert_allclose(loaded.get_layer("hsm").kernel.numpy(), layer.kernel.numpy(),
                             rtol=1e-5, atol=1e-6)
  model.export(str(tmp_path / "exported"), verbose=False)
  served = tf.saved_model.load(str(tmp_path / "exported"))
  np.testing.assert_allclose(served.serve([tf.constant(x), tf.constant(y)]).numpy(),
                             model.predict([x, y], verbose=0), rtol=1e-6, atol=1e-6)
  checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
  checkpoint.save(str(tmp_path / "checkpoint" / "ckpt"))


def test_vectors_from_an_embedding(rng):
  model = _lm(tf_hsm.Tree.huffman(_counts(rng) + 1))
  model.compile(optimizer=optimizers.LazyAdam(0.02), loss=losses.nll)
  x, y = _data(rng, 32)
  embedding = model.get_layer("embedding")
  seen = []
  rebuild = RebuildTree("hsm", after_epoch=2, branching=3, seed=4, vectors=embedding)
  record = keras.callbacks.LambdaCallback(
      on_epoch_end=lambda epoch, logs: seen.append(embedding.embeddings.numpy().copy()))
  history = model.fit([x, y], y, batch_size=16, epochs=3, verbose=0,
                      callbacks=[record, rebuild])
  assert np.all(np.isfinite(history.history["loss"]))
  # Built from the embedding as it was at the end of epoch 2, not as it was given.
  assert rebuild.tree == tf_hsm.Tree.from_vectors(seen[1], branching=3, seed=4)
  # The layer's method takes the embedding's variable (or an array) directly.
  counts = _counts(rng)
  tree = model.get_layer("hsm").rebuild_tree(vectors=embedding.embeddings, counts=counts)
  assert tree == tf_hsm.Tree.from_vectors(embedding.embeddings.numpy(), counts=counts)
  # ... and the model's function a function that returns them.
  tree = rebuild_tree(model, vectors=lambda: seen[0], seed=1)
  assert tree == tf_hsm.Tree.from_vectors(seen[0], seed=1)


def test_rebuild_part_way_through_an_epoch_with_a_head(rng):
  model = _lm(tf_hsm.Tree.two_level(_CLASSES))
  model.compile(optimizer=optimizers.LazyAdam(0.02), loss=losses.nll)
  x, y = _data(rng, 64)
  counts = _counts(rng)
  embedding = model.get_layer("embedding")
  seen = []
  record = keras.callbacks.LambdaCallback(
      on_train_batch_end=lambda batch, logs: seen.append(embedding.embeddings.numpy()))
  rebuild = RebuildTree("hsm", after_batch=3, branching=3, counts=counts, head=5,
                        vectors=embedding)
  layer = model.get_layer("hsm")
  before = []  # the table after each batch
  keep = keras.callbacks.LambdaCallback(
      on_train_batch_end=lambda batch, logs: before.append(layer.kernel.numpy().copy()))
  history = model.fit([x, y], y, batch_size=16, epochs=1, verbose=0,
                      callbacks=[record, rebuild, keep])
  assert np.all(np.isfinite(history.history["loss"]))
  # Built once, from the embedding as it was after the third batch of epoch 1.
  assert rebuild.tree is layer.tree
  assert len(rebuild.rebuild_seconds) == 2 and min(rebuild.rebuild_seconds) >= 0
  assert rebuild.tree == tf_hsm.Tree.from_vectors(seen[2], counts=counts, branching=3,
                                                  head=5)
  top = np.argsort(-counts, kind="stable")[:5]
  assert np.all(rebuild.tree.class_depth[top] == 1)
  # The table changed at the third batch, and the fourth already trained the new one.
  assert before[1].shape == (tf_hsm.Tree.two_level(_CLASSES).num_slots, 12)
  assert before[2].shape == (rebuild.tree.num_slots, 12)
  assert not np.array_equal(before[3], before[2])
  # The layer's method takes the head too; a given tree has its own.
  tree = layer.rebuild_tree(counts=counts, head=2, seed=1)
  assert tree == tf_hsm.Tree.from_vectors(
      tf.gather(layer.kernel, tree.class_slot).numpy(), counts=counts, seed=1, head=2)
  with pytest.raises(ValueError, match="a given tree has its own root"):
    layer.rebuild_tree(tf_hsm.Tree.two_level(_CLASSES), head=2)


def test_after_batch_counts_batches_across_epochs_and_executions(rng):
  tree = tf_hsm.Tree.two_level(_CLASSES)
  model = _lm(tree)
  # Two batches an execution: Keras calls on_train_batch_end at batches 2 and 4.
  model.compile(optimizer=optimizers.LazyAdam(0.02), loss=losses.nll,
                steps_per_execution=2)
  x, y = _data(rng, 64)
  rebuild = RebuildTree("hsm", after_batch=6, branching=3)
  trees = []
  record = keras.callbacks.LambdaCallback(
      on_epoch_end=lambda epoch, logs: trees.append(model.get_layer("hsm").tree))
  history = model.fit([x, y], y, batch_size=16, epochs=3, verbose=0,
                      callbacks=[rebuild, record])
  assert np.all(np.isfinite(history.history["loss"]))
  # Four batches an epoch: the sixth is in epoch 2, so epoch 1 ended on the old tree.
  assert trees[0] is tree and trees[1] is rebuild.tree is trees[2]


def test_rebuild_between_fit_calls_with_a_given_tree(rng):
  model = _lm(tf_hsm.Tree.two_level(_CLASSES))
  model.compile(optimizer=optimizers.SparseSGD(0.3, momentum=0.5), loss=losses.nll)
  x, y = _data(rng, 32)
  model.fit([x, y], y, batch_size=16, epochs=1, verbose=0)
  model.predict([x, y], verbose=0)
  new_tree = tf_hsm.Tree.balanced(_CLASSES, 4)
  assert rebuild_tree(model, tree=new_tree) is new_tree
  out = model.predict([x, y], verbose=0)  # the predict function traced again
  hidden = keras.Model(model.inputs, model.get_layer("dense").output)([x, y])
  layer = model.get_layer("hsm")
  np.testing.assert_allclose(out, tf_hsm.log_prob(hidden, layer.kernel, layer.bias,
                                                  new_tree, y).numpy(), rtol=1e-5,
                             atol=1e-5)
  before = layer.kernel.numpy()
  model.fit([x, y], y, batch_size=16, epochs=1, verbose=0)
  assert not np.array_equal(layer.kernel.numpy(), before)


def test_fit_refuses_a_rebuild_it_cannot_make_before_training(rng):
  """A layer name the model lacks, another kind of layer, the tree's options (counts of
  another length or negative, a branching of 1, a head without counts or of every
  class), vectors of another row count: named when fit starts, not after the epochs the
  rebuild waits for."""
  model = _lm(tf_hsm.Tree.two_level(_CLASSES))
  model.compile(optimizer=optimizers.SparseSGD(0.3), loss=losses.nll)
  x, y = _data(rng, 32)
  seen = []
  count = keras.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: seen.append(epoch))
  for callback, message in ((RebuildTree("HSM", after_epoch=3), "no layer named 'HSM'"),
                            (RebuildTree("dense"), "got Dense"),
                            (RebuildTree("hsm", counts=np.ones(3)),
                             "counts has 3 entries; the layer has 48"),
                            (RebuildTree("hsm", counts=-np.ones(_CLASSES), after_epoch=3),
                             "RebuildTree: counts.* is negative"),
                            (RebuildTree("hsm", branching=1, after_epoch=3),
                             "RebuildTree: branching must be >= 2"),
                            (RebuildTree("hsm", head=4, after_epoch=3), "head needs counts"),
                            (RebuildTree("hsm", head=_CLASSES, counts=np.ones(_CLASSES),
                                         after_epoch=3), "head must be less than"),
                            (RebuildTree("hsm", vectors=np.ones((_CLASSES - 1, 4)),
                                         after_epoch=3),
                             r"vectors must have shape \[num_classes, dim\] = \[48, dim\]"),
                            (RebuildTree("hsm", vectors=[[1.0, 2.0]] * (_CLASSES + 1),
                                         after_epoch=3), r"got shape \(49, 2\)"),
                            (RebuildTree("hsm", vectors=tf.ones([_CLASSES, 2, 1]),
                                         after_epoch=3), r"got shape \(48, 2, 1\)"),
                            (RebuildTree("hsm", vectors=np.full((_CLASSES, 2), np.nan),
                                         after_epoch=3), "vectors must be finite")):
    with pytest.raises(ValueError, match=message):
      model.fit([x, y], y, batch_size=16, epochs=3, verbose=0, callbacks=[callback, count])
  assert not seen


@pytest.mark.parametrize("schedule,fits", [
    ({"after_epoch": 5}, [{"epochs": 2}]),
    ({"after_batch": 100}, [{"epochs": 2}]),
    ({"after_epoch": 1}, [{"epochs": 3, "initial_epoch": 2}]),
    ({"after_epoch": 3}, [{"epochs": 2}, {"epochs": 2}]),
])
def test_a_schedule_that_never_comes_warns(rng, schedule, fits):
  model = _lm(tf_hsm.Tree.two_level(_CLASSES))
  model.compile(optimizer=optimizers.SparseSGD(0.3), loss=losses.nll)
  x, y = _data(rng, 32)
  rebuild = RebuildTree("hsm", **schedule)
  for fit in fits:
    with pytest.warns(UserWarning, match="did not rebuild the tree in this fit"):
      model.fit([x, y], y, batch_size=16, verbose=0, callbacks=[rebuild], **fit)
  assert rebuild.tree is None


def test_errors_name_the_problem(rng):
  with pytest.raises(ValueError, match="built"):
    HierarchicalSoftmax(tf_hsm.Tree.two_level(_CLASSES)).rebuild_tree()
  layer = _trained_layer(rng)
  tree, kernel = layer.tree, layer.kernel
  with pytest.raises(ValueError, match=r"vectors must have shape \[num_classes, dim\] = "
                     r"\[48, dim\].*\(47, 4\)"):
    layer.rebuild_tree(vectors=np.zeros((_CLASSES - 1, 4)))
  with pytest.raises(ValueError, match="vectors must have shape"):
    layer.rebuild_tree(vectors=np.zeros(_CLASSES))
  with pytest.raises(ValueError, match="vectors must be finite"):
    layer.rebuild_tree(vectors=np.full((_CLASSES, 2), np.nan))
  with pytest.raises(ValueError, match="not both"):
    layer.rebuild_tree(tf_hsm.Tree.two_level(_CLASSES), vectors=np.zeros((_CLASSES, 2)))
  with pytest.raises(ValueError, match="the new tree has 10 classes; the layer has 48"):
    layer.rebuild_tree(tf_hsm.Tree.two_level(10))
  with pytest.raises(ValueError, match="tree must be a tf_hsm.Tree"):
    layer.rebuild_tree("balanced")
  with pytest.raises(ValueError, match="counts has 3 entries; the layer has 48"):
    layer.rebuild_tree(counts=[1, 2, 3])
  with pytest.raises(ValueError, match="negative"):
    layer.rebuild_tree(counts=-np.ones(_CLASSES))
  with pytest.raises(ValueError, match="branching"):
    layer.rebuild_tree(branching=1)
  # A failed rebuild changes nothing.
  assert layer.tree is tree and layer.kernel is kernel
  laid_out = HierarchicalSoftmax(tree, row_layout=tf_hsm.distribute.RowLayout(
      tree, np.arange(tree.num_slots)[::-1], 1))
  laid_out.build((None, 6))
  with pytest.raises(ValueError, match="row_layout"):
    laid_out.rebuild_tree()
  with pytest.raises(ValueError, match="after_epoch must be an integer >= 1"):
    RebuildTree("hsm", after_epoch=0)
  with pytest.raises(ValueError, match="after_batch must be an integer >= 1"):
    RebuildTree("hsm", after_batch=0)
  with pytest.raises(ValueError, match="after_epoch or after_batch, not both"):
    RebuildTree("hsm", after_epoch=1, after_batch=5)
  with pytest.raises(ValueError, match="head must be an integer >= 0"):
    RebuildTree("hsm", head=-1)
  with pytest.raises(ValueError, match="head must be less than the number of classes"):
    layer.rebuild_tree(counts=np.ones(_CLASSES), head=_CLASSES)
  with pytest.raises(ValueError, match="head needs counts"):
    layer.rebuild_tree(head=3)
  with pytest.raises(ValueError, match="HierarchicalSoftmax or its name"):
    RebuildTree(keras.layers.Dense(3))
  model = _lm(tf_hsm.Tree.two_level(_CLASSES))
  with pytest.raises(ValueError, match="no layer named 'output'"):
    rebuild_tree(model, "output")
  with pytest.raises(ValueError, match="must be a tf_hsm.HierarchicalSoftmax, got Dense"):
    rebuild_tree(model, "dense")
  with pytest.raises(ValueError, match="is not part of the model"):
    rebuild_tree(model, layer)
  with pytest.raises(ValueError, match="has no `embeddings` variable"):
    rebuild_tree(model, vectors=model.get_layer("dense"))
