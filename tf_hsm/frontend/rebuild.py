"""`rebuild_tree` for both Keras front ends: the new tree and the weights that carry over.

`new_tree_and_weights` is what `HierarchicalSoftmax.rebuild_tree` of `tf_hsm.keras` and
of `tf_hsm.tf_keras` compute before they swap their variables (see the Keras 3 layer's
docstring for how the tree is made and how the weights start).
"""

import time
import warnings

import numpy as np
import tensorflow as tf

from tf_hsm import distribute
from tf_hsm.frontend import hsm as frontend_hsm
from tf_hsm.tree import Tree
from tf_hsm.tree import vectors as tree_vectors
from tf_hsm.tree.checks import counts_array
from tf_hsm.tree.transfer import class_masses, transferred_weights


def new_tree_and_weights(tree_now, kernel, row_layout, tree=None, *, counts=None,
                         branching=2, seed=0, vectors=None, head=0):
  """(new tree, kernel values [S', D], bias values [S'] float64) for a rebuild.

  Args:
    tree_now: the layer's tree.
    kernel: the layer's table (its class rows are read).
    row_layout: the layer's `RowLayout` (a rebuild refuses one), or None.
    tree, counts, branching, seed, vectors, head: as `HierarchicalSoftmax.rebuild_tree`.

  Raises:
    ValueError: as `HierarchicalSoftmax.rebuild_tree`.
  """
  if row_layout is not None:
    raise ValueError("HierarchicalSoftmax.rebuild_tree does not support a row_layout "
                     "(it is made for one tree): rebuild without one")
  if distribute.pieces(kernel) is not None:
    raise ValueError("HierarchicalSoftmax.rebuild_tree does not support a table held "
                     "in pieces (a variable_partitioner)")
  num_classes = tree_now.num_classes
  if counts is not None:
    counts = counts_array(counts)
    if counts.shape[0] != num_classes:
      raise ValueError(f"counts has {counts.shape[0]} entries; the layer has "
                       f"{num_classes} classes")
  class_rows = tf.gather(kernel, tree_now.class_slot).numpy()
  if tree is None:
    if vectors is None:
      vectors = class_rows
    else:
      vectors = vectors_array(vectors, num_classes)
    tree = Tree.from_vectors(vectors, counts=counts, branching=branching, seed=seed,
                             head=head)
  elif vectors is not None:
    raise ValueError("give rebuild_tree a tree or the vectors to build one from, not "
                     "both")
  elif head:
    raise ValueError("head is an option of the tree rebuild_tree builds; a given tree "
                     "has its own root")
  elif not isinstance(tree, Tree):
    raise ValueError(f"tree must be a tf_hsm.Tree or None, got {type(tree).__name__}")
  elif tree.num_classes != num_classes:
    raise ValueError(f"the new tree has {tree.num_classes} classes; the layer has "
                     f"{num_classes}")
  mass = class_masses(counts, num_classes)
  kernel_values, bias_values = transferred_weights(tree, class_rows, mass)
  return tree, kernel_values, bias_values


def vectors_array(vectors, num_classes):
  """`vectors` as a 2-D NumPy array with a row per class (a NumPy array, memmaps
  included, is not copied); ValueError naming what does not fit."""
  if not isinstance(vectors, np.ndarray):
    try:
      vectors = vectors.numpy() if hasattr(vectors, "numpy") else np.asarray(vectors)
    except (TypeError, ValueError) as e:
      raise ValueError(f"vectors must be a 2-D array of numbers: {e}") from None
  check_vectors_shape(vectors.shape, num_classes)
  return vectors


def check_vectors_shape(shape, num_classes):
  """ValueError unless `shape` is [num_classes, dim] (a row count unknown until traced
  passes)."""
  if len(shape) != 2 or shape[0] is not None and shape[0] != num_classes:
    raise ValueError(f"vectors must have shape [num_classes, dim] = [{num_classes}, dim], "
                     f"one row per class, got shape {tuple(shape)}")


def check_vectors_given(vectors, num_classes):
  """What can be checked of a rebuild's `vectors` before it reads them: the shape of any
  but a layer or a function (read at the rebuild), and NumPy values or lists finite (a
  variable's values are the ones it holds when the rebuild runs)."""
  if vectors is None or callable(vectors) and not hasattr(vectors, "shape"):
    return
  if isinstance(vectors, (np.ndarray, list, tuple)):
    values = np.asarray(vectors) if isinstance(vectors, (list, tuple)) else vectors
    check_vectors_shape(values.shape, num_classes)
    if np.issubdtype(values.dtype, np.number):
      tree_vectors.check_finite(values)
  elif hasattr(vectors, "shape"):
    check_vectors_shape(tuple(vectors.shape), num_classes)


class FrontEnd:
  """What `rebuild_in_model` needs to know of a Keras front end: its
  `HierarchicalSoftmax` class, its Keras' base `Layer` class, and whether an optimizer
  is one of its Keras, built."""

  def __init__(self, layer_class, layer_base, built):
    self.layer_class = layer_class
    self.layer_base = layer_base
    self.built = built


def rebuild_in_model(model, layer, front, tree=None, *, counts=None, branching=2, seed=0,
                     vectors=None, head=0):
  """`tf_hsm.keras.callbacks.rebuild_tree` (see there) for the front end `front` (a
  `FrontEnd`): rebuilds the layer, gives the model an optimizer for the new variables
  and re-traces its train, test and predict functions."""
  layer = _find_layer(model, layer, front)
  vectors = _read_vectors(vectors, front)
  old_tree = layer.tree
  old = _variables_of(layer)
  strategy = getattr(model, "distribute_strategy", None) or tf.distribute.get_strategy()
  with strategy.scope():
    new_tree = layer.rebuild_tree(tree, counts=counts, branching=branching, seed=seed,
                                  vectors=vectors, head=head)
    new = _variables_of(layer)
    optimizer = getattr(model, "optimizer", None)
    if front.built(optimizer):
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




class RebuildSchedule:
  """The `RebuildTree` callback of both front ends, less its Keras base class: a subclass
  sets `front_end` (a `FrontEnd`) and derives from its Keras' `Callback` too."""

  front_end = None

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
    if not isinstance(layer, (self.front_end.layer_class, str)):
      raise ValueError("layer must be a tf_hsm.HierarchicalSoftmax or its name, got "
                       f"{type(layer).__name__}")
    self.layer = layer
    self.after_epoch = None if after_epoch is None else int(after_epoch)
    self.after_batch = None if after_batch is None else int(after_batch)
    self.head = int(head)
    self._before_epoch = self._in_epoch = 0  # training batches run, for after_batch
    self._epochs_seen = []  # this fit's epochs, for the warning of a schedule not met
    self.branching = branching
    self.counts = counts
    self.seed = seed
    self.vectors = vectors
    self.tree = None
    self.rebuild_seconds = None

  def set_model(self, model):
    # A model of the other Keras fails obscurely: tf_keras' `fit` asks each callback
    # which hooks it implements (an AttributeError about `_implements_train_batch_hooks`
    # from a Keras 3 callback), Keras 3's trains until the rebuild, which then refuses
    # the layer as not a HierarchicalSoftmax. Both hand the callback its model first:
    # the mistake is named here, with its fix.
    own = self.front_end.layer_base.__module__.split(".")[0]  # 'keras' or 'tf_keras'
    if not isinstance(model, self.front_end.layer_base):
      raise TypeError(f"RebuildTree got a {type(model).__module__.split('.')[0]} model: "
                      + frontend_hsm.other_keras_name(own, "callbacks", "RebuildTree"))
    super().set_model(model)

  def on_train_begin(self, logs=None):
    # What the rebuild would refuse, refused before the first epoch rather than after
    # the epochs it waits for: a layer name the model lacks, another layer's name, the
    # tree's options (counts, branching, seed, head), vectors of another shape or, as
    # NumPy values, not finite. Vectors read at the rebuild (an Embedding, a function, a
    # variable's values) are checked then.
    layer = _find_layer(self.model, self.layer, self.front_end)
    try:
      tree_vectors.checked_options(layer.num_classes, self.counts, self.branching,
                                   self.seed, self.head,
                                   f"the layer has {layer.num_classes} classes")
      check_vectors_given(self.vectors, layer.num_classes)  # a layer is read then
    except ValueError as e:
      raise ValueError(f"RebuildTree: {e}") from None
    self._epochs_seen = []

  def on_epoch_begin(self, epoch, logs=None):
    self._epochs_seen.append(epoch)

  def on_train_end(self, logs=None):
    if self.tree is not None:
      return
    when = (f"after_epoch={self.after_epoch}" if self.after_epoch is not None else
            f"after_batch={self.after_batch}")
    ran = (f"epochs {self._epochs_seen[0] + 1}-{self._epochs_seen[-1] + 1} (counted from "
           "each fit's initial_epoch)" if self._epochs_seen else "no epoch")
    warnings.warn(f"RebuildTree({when}) did not rebuild the tree in this fit: it ran "
                  f"{ran}; {self._before_epoch + self._in_epoch} batches so far in all "
                  "(after_batch counts across fits); the layer trained on its first tree",
                  stacklevel=2)

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
    self.tree = rebuild_in_model(self.model, self.layer, self.front_end, counts=self.counts,
                             branching=self.branching, seed=self.seed,
                             vectors=self.vectors, head=self.head)
    self.rebuild_seconds = (time.perf_counter() - start[0],
                            time.process_time() - start[1])


def _find_layer(model, layer, front):
  """The `HierarchicalSoftmax` of `model` that `layer` names (or is)."""
  if layer is None:
    found = [sub for sub in _all_layers(model) if isinstance(sub, front.layer_class)]
    if len(found) != 1:
      raise ValueError(f"the model has {len(found)} HierarchicalSoftmax layers: name the "
                       "one to rebuild")
    return found[0]
  if isinstance(layer, str):
    found = [sub for sub in _all_layers(model) if sub.name == layer]
    if not found:
      raise ValueError(f"the model has no layer named {layer!r}")
    layer = found[0]
  if not isinstance(layer, front.layer_class):
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


def _read_vectors(vectors, front):
  """Vectors given as something to read at the rebuild, read."""
  if isinstance(vectors, front.layer_base):
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
    def add_variable_from_reference(*args, **kwargs):
      # Keras 3 names the argument reference_variable, tf_keras model_variable.
      reference_variable = args[0] if args else kwargs.get(
          "reference_variable", kwargs.get("model_variable"))
      state = original(*args, **kwargs)
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
            f"optimizer variable {_path(state)} has shape {tuple(state.shape)}, its "
            f"counterpart {_path(new_state)} {tuple(new_state.shape)}: the state cannot be "
            "carried over; re-compile the model with a new optimizer after the rebuild")
      new_state.assign(state)
      continue
    old, new = pair
    if tuple(state.shape) != tuple(old.shape) or \
        tuple(new_state.shape) != tuple(new.shape):
      continue  # not row for row with the table: it starts afresh
    value = (new if _path(new_state).endswith("average") else new_state).numpy().copy()
    value[new_rows] = tf.gather(state, old_rows).numpy()
    new_state.assign(value)
  _carry_loss_scale(optimizer, fresh)
  return fresh


def _carry_loss_scale(optimizer, fresh):
  """The dynamic loss scale and its counter of a tf_keras `LossScaleOptimizer`, which
  keeps them outside its `variables` (Keras 3's are among them, carried above)."""
  state = getattr(optimizer, "_loss_scale", None)
  new_state = getattr(fresh, "_loss_scale", None)
  for name in ("current_loss_scale", "counter"):
    old, new = getattr(state, name, None), getattr(new_state, name, None)
    if isinstance(old, tf.Variable) and isinstance(new, tf.Variable):
      new.assign(old)


def _path(variable):
  """A Keras variable's path (Keras 3), or a TensorFlow variable's name (tf_keras)."""
  return getattr(variable, "path", None) or variable.name
