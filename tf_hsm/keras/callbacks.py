"""Rebuilding a `HierarchicalSoftmax`'s tree in a Keras model that goes on training.

`HierarchicalSoftmax.rebuild_tree` moves one layer to a new tree; a compiled model needs
more than that, because its optimizer and its traced functions hold the layer's old
variables (the table changes shape with the tree, so the variables are new ones).
`rebuild_tree(model, layer)` does the whole job, and `RebuildTree` does it from a
callback at the end of a chosen epoch.

What Keras 3 does with the old variables, and what is done about it here:

* `fit` makes its train function once, before the first epoch, and calls
  `model.train_function` at every step: a function traced before the rebuild would go on
  reading and updating the old variables without any error. `model.make_train_function(
  force=True)` (and the test and predict ones) re-traces them, and `fit` picks the new
  train function up at its next step.
* A built optimizer refuses variables it was not built on ("Unknown variable"), and its
  state for the table has the old table's shape. The model gets a new optimizer of the
  same class and configuration, built on the model's variables as they are now, holding
  the old optimizer's state for every other variable (its step count and learning rate
  included) and, for the table and biases, the old state of the class rows moved with
  them (the new internal-node rows start as a fresh optimizer starts them). A new
  optimizer is built the way Keras builds one, so its variables sit where saving,
  loading, checkpoints and export expect them; the old optimizer object no longer
  trains the model.
"""

import time

import keras
import numpy as np
import tensorflow as tf

from tf_hsm.keras.layers import HierarchicalSoftmax


def rebuild_tree(model, layer=None, tree=None, *, counts=None, branching=2, seed=0,
                 vectors=None, head=0):
  """Rebuilds the tree of a `HierarchicalSoftmax` in `model`, which then trains with it.

  Calls `layer.rebuild_tree` (see there for how the new tree is made and how the new
  weights start), gives the model an optimizer for the new variables (see the module's
  docstring) and re-traces the model's train, test and predict functions. Works
  between `fit` calls and inside one (from a callback, as `RebuildTree` does); under the
  model's distribution strategy, the new variables are made in its scope.

  Args:
    model: the Keras model that holds the layer.
    layer: the `HierarchicalSoftmax`, or its name in `model`; None for the model's only
      one.
    tree, counts, branching, seed, head: as `HierarchicalSoftmax.rebuild_tree`.
    vectors: as `HierarchicalSoftmax.rebuild_tree`, or a Keras layer with an
      `embeddings` variable (an `Embedding`), or a function of no arguments that returns
      the vectors; read when the rebuild happens.

  Returns:
    The new tree.

  Raises:
    ValueError: a layer that is not a `HierarchicalSoftmax` of `model`, an optimizer
      whose state cannot be matched to the new variables, and whatever
      `HierarchicalSoftmax.rebuild_tree` raises.
  """
  layer = _find_layer(model, layer)
  vectors = _read_vectors(vectors)
  old_tree = layer.tree
  old = _variables_of(layer)
  strategy = getattr(model, "distribute_strategy", None) or tf.distribute.get_strategy()
  with strategy.scope():
    new_tree = layer.rebuild_tree(tree, counts=counts, branching=branching, seed=seed,
                                  vectors=vectors, head=head)
    new = _variables_of(layer)
    optimizer = getattr(model, "optimizer", None)
    if isinstance(optimizer, keras.optimizers.Optimizer) and optimizer.built:
      rows = (old_tree.class_slot, new_tree.class_slot)
      replacement = _rebuilt_optimizer(optimizer, list(zip(old, new)), rows, model)
      model.optimizer = replacement
      # What `model.save` writes as the compile config, and what `compile` holds on to:
      # the optimizer itself, not the loss-scale wrapper around it.
      compile_config = getattr(model, "_compile_config", None)
      if compile_config is not None and "optimizer" in getattr(compile_config, "config",
                                                               {}):
        compile_config.config["optimizer"] = getattr(replacement, "inner_optimizer",
                                                     replacement)
  for kind in ("train", "test", "predict"):
    if getattr(model, f"{kind}_function", None) is not None:
      getattr(model, f"make_{kind}_function")(force=True)
  return new_tree


class RebuildTree(keras.callbacks.Callback):
  """Rebuilds a `HierarchicalSoftmax`'s tree once, at the end of epoch `after_epoch` (or
  of training batch `after_batch`).

  The first epochs train the class rows on the initial tree (a Huffman or two-level
  tree, say); the rebuild then groups the classes those rows (or `vectors`) show to be
  alike, and the remaining epochs train on that tree. See `rebuild_tree` for what
  carries over.

  Args:
    layer: the `HierarchicalSoftmax` or its name in the model.
    after_epoch: how many epochs of a `fit` call to train before the rebuild (epochs
      counted as Keras shows them, from 1); None for 1 unless `after_batch` is given.
      It happens once per callback object, also when `fit` is called again.
    after_batch: instead of `after_epoch`, how many training batches to train before
      the rebuild, counted from the first batch the callback sees (across epochs and
      `fit` calls); the rest of that epoch trains on the new tree.
    branching, counts, seed, head: as `HierarchicalSoftmax.rebuild_tree`.
    vectors: as `rebuild_tree`: None for the layer's own class rows; an array; a
      variable, an `Embedding` layer or a function of no arguments, read at the rebuild.

  Attributes:
    tree: the new tree once the rebuild has happened, None before.
    rebuild_seconds: (wall-clock, process CPU) seconds the rebuild took (the tree
      build, the new weights and optimizer; the re-tracing happens at the next step),
      None before.
  """

  def __init__(self, layer, after_epoch=None, branching=2, counts=None, seed=0,
               vectors=None, *, after_batch=None, head=0):
    super().__init__()
    if after_epoch is not None and after_batch is not None:
      raise ValueError("give RebuildTree after_epoch or after_batch, not both")
    if after_epoch is None and after_batch is None:
      after_epoch = 1
    for name, value in (("after_epoch", after_epoch), ("after_batch", after_batch)):
      if value is not None and (isinstance(value, bool) or
                                not isinstance(value, (int, np.integer)) or value < 1):
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if isinstance(head, bool) or not isinstance(head, (int, np.integer)) or head < 0:
      raise ValueError(f"head must be an integer >= 0, got {head!r}")
    if not isinstance(layer, (HierarchicalSoftmax, str)):
      raise ValueError("layer must be a tf_hsm.HierarchicalSoftmax or its name, got "
                       f"{type(layer).__name__}")
    self.layer = layer
    self.after_epoch = None if after_epoch is None else int(after_epoch)
    self.after_batch = None if after_batch is None else int(after_batch)
    self.head = int(head)
    self._before_epoch = self._in_epoch = 0  # training batches run, for after_batch
    self.branching = branching
    self.counts = counts
    self.seed = seed
    self.vectors = vectors
    self.tree = None
    self.rebuild_seconds = None

  def on_train_batch_end(self, batch, logs=None):
    # `batch` is the index in the epoch of the last batch run: with steps_per_execution
    # > 1, Keras calls this once per execution, so batches are counted from it.
    self._in_epoch = batch + 1
    if self.tree is None and self.after_batch is not None and \
        self._before_epoch + self._in_epoch >= self.after_batch:
      # Keras' fit looks `model.train_function` up at every step, so the next batch
      # already trains the new tree with the new optimizer.
      self._rebuild()

  def on_epoch_end(self, epoch, logs=None):
    self._before_epoch += self._in_epoch
    self._in_epoch = 0
    if self.tree is None and epoch + 1 == self.after_epoch:
      self._rebuild()

  def _rebuild(self):
    start = time.perf_counter(), time.process_time()
    self.tree = rebuild_tree(self.model, self.layer, counts=self.counts,
                             branching=self.branching, seed=self.seed,
                             vectors=self.vectors, head=self.head)
    self.rebuild_seconds = (time.perf_counter() - start[0],
                            time.process_time() - start[1])


def _find_layer(model, layer):
  """The `HierarchicalSoftmax` of `model` that `layer` names (or is)."""
  if layer is None:
    found = [sub for sub in _all_layers(model) if isinstance(sub, HierarchicalSoftmax)]
    if len(found) != 1:
      raise ValueError(f"the model has {len(found)} HierarchicalSoftmax layers: name the "
                       "one to rebuild")
    return found[0]
  if isinstance(layer, str):
    found = [sub for sub in _all_layers(model) if sub.name == layer]
    if not found:
      raise ValueError(f"the model has no layer named {layer!r}")
    layer = found[0]
  if not isinstance(layer, HierarchicalSoftmax):
    raise ValueError(f"layer must be a tf_hsm.HierarchicalSoftmax, got "
                     f"{type(layer).__name__}")
  if layer.built and not any(v is layer.kernel for v in model.weights):
    raise ValueError(f"layer {layer.name!r} is not part of the model")
  return layer


def _all_layers(model):
  """The model's layers, those of nested models included."""
  out = []
  stack = list(getattr(model, "layers", []))
  while stack:
    sub = stack.pop(0)
    out.append(sub)
    stack.extend(getattr(sub, "layers", []))
  return out


def _read_vectors(vectors):
  """Vectors given as something to read at the rebuild, read."""
  if isinstance(vectors, keras.layers.Layer):
    if not hasattr(vectors, "embeddings"):
      raise ValueError(f"vectors: layer {vectors.name!r} has no `embeddings` variable")
    return vectors.embeddings
  if callable(vectors) and not hasattr(vectors, "shape"):
    return vectors()
  return vectors


def _variables_of(layer):
  return [layer.kernel] + ([layer.bias] if layer.use_bias else [])


def _rebuilt_optimizer(optimizer, replaced, rows, model):
  """A new optimizer like `optimizer`, built on its variables with `replaced` (old, new)
  pairs swapped, holding `optimizer`'s state (see the module's docstring).

  Keras builds an optimizer's state variable by variable in the order of the variables
  it is built on, so the new optimizer's i-th variable is the counterpart of the old
  one's. State made for a replaced variable (through `add_variable_from_reference`,
  as Keras' optimizers make theirs) takes the old state's class rows at their new slots
  (`rows`: old and new class slots) and keeps its fresh value elsewhere; an EMA average
  (Keras' `use_ema`) starts elsewhere at the new weights, as Keras starts it at the
  weights on the first step.
  """
  built_on = getattr(optimizer, "_trainable_variables", None) or model.trainable_variables
  swap = {id(old): new for old, new in replaced}
  variables = [swap.get(id(v), v) for v in built_on]
  new_ids = {id(new): old for old, new in replaced}
  fresh = optimizer.__class__.from_config(optimizer.get_config())
  made_for = {}  # id(state variable) -> (old, new) model variable it belongs to
  spied = [fresh] + ([fresh.inner_optimizer] if hasattr(fresh, "inner_optimizer") else [])

  def spy(original):
    def add_variable_from_reference(reference_variable, *args, **kwargs):
      state = original(reference_variable, *args, **kwargs)
      if id(reference_variable) in new_ids:
        made_for[id(state)] = (new_ids[id(reference_variable)], reference_variable)
      return state
    return add_variable_from_reference

  for opt in spied:
    opt.add_variable_from_reference = spy(opt.add_variable_from_reference)
  try:
    fresh.build(variables)
  finally:
    for opt in spied:
      del opt.add_variable_from_reference
  before, after = optimizer.variables, fresh.variables
  if len(before) != len(after):
    raise ValueError(
        f"optimizer {optimizer.name} has {len(before)} variables, but a new one built on "
        f"the rebuilt model has {len(after)}: its state cannot be carried over; "
        "re-compile the model with a new optimizer after the rebuild")
  old_rows, new_rows = rows
  for state, new_state in zip(before, after):
    pair = made_for.get(id(new_state))
    if pair is None:
      if tuple(state.shape) != tuple(new_state.shape):
        raise ValueError(
            f"optimizer variable {state.path} has shape {tuple(state.shape)}, its "
            f"counterpart {new_state.path} {tuple(new_state.shape)}: the state cannot be "
            "carried over; re-compile the model with a new optimizer after the rebuild")
      new_state.assign(state)
      continue
    old, new = pair
    if tuple(state.shape) != tuple(old.shape) or \
        tuple(new_state.shape) != tuple(new.shape):
      continue  # not row for row with the table: it starts afresh
    value = (new if new_state.name.endswith("average") else new_state).numpy().copy()
    value[new_rows] = tf.gather(state, old_rows).numpy()
    new_state.assign(value)
  return fresh
