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

import keras

from tf_hsm.frontend import rebuild as frontend_rebuild
from tf_hsm.keras.layers import HierarchicalSoftmax

_FRONT_END = frontend_rebuild.FrontEnd(
    HierarchicalSoftmax, keras.layers.Layer,
    lambda optimizer: isinstance(optimizer, keras.optimizers.Optimizer) and optimizer.built)


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
  return frontend_rebuild.rebuild_in_model(model, layer, _FRONT_END, tree, counts=counts,
                                   branching=branching, seed=seed, vectors=vectors,
                                   head=head)


class RebuildTree(frontend_rebuild.RebuildSchedule, keras.callbacks.Callback):
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
      `fit` calls); the rest of that epoch trains on the new tree. With
      `steps_per_execution=S` Keras calls callbacks every S batches: the rebuild comes
      at the first such call at or after batch `after_batch`.
    branching, counts, seed, head: as `HierarchicalSoftmax.rebuild_tree`.
    vectors: as `rebuild_tree`: None for the layer's own class rows; an array; a
      variable, an `Embedding` layer or a function of no arguments, read at the rebuild.

  Attributes:
    tree: the new tree once the rebuild has happened, None before.
    rebuild_seconds: (wall-clock, process CPU) seconds the rebuild took (the tree
      build, the new weights and optimizer; the re-tracing happens at the next step),
      None before.
  """

  front_end = _FRONT_END
