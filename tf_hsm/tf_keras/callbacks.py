"""Rebuilding a tf_keras `HierarchicalSoftmax`'s tree in a model that goes on training:
`rebuild_tree(model, layer)` and the `RebuildTree` callback of `tf_hsm.keras.callbacks`
(see there), for tf_keras models. The same code (`tf_hsm/frontend/rebuild.py`): the new
tree and carried-over weights, a new optimizer of the same class holding the old one's
state (the class rows' moved with them), and re-traced train, test and predict
functions."""

import tf_keras

from tf_hsm.frontend import rebuild as frontend_rebuild
from tf_hsm.tf_keras.layers import HierarchicalSoftmax


def _built(optimizer):
  # A mixed_float16 model's LossScaleOptimizer keeps no variable index of its own: its
  # inner optimizer's says whether it is built.
  inner = getattr(optimizer, "inner_optimizer", optimizer)
  return isinstance(inner, tf_keras.optimizers.Optimizer) and \
      bool(getattr(inner, "_index_dict", None))


_FRONT_END = frontend_rebuild.FrontEnd(HierarchicalSoftmax, tf_keras.layers.Layer, _built)


def rebuild_tree(model, layer=None, tree=None, *, counts=None, branching=2, seed=0,
                 vectors=None, head=0):
  """Rebuilds the tree of a tf_hsm.tf_keras `HierarchicalSoftmax` in `model`, which then
  trains with it: `tf_hsm.keras.callbacks.rebuild_tree` for tf_keras (same arguments)."""
  return frontend_rebuild.rebuild_in_model(model, layer, _FRONT_END, tree, counts=counts,
                                   branching=branching, seed=seed, vectors=vectors,
                                   head=head)


class RebuildTree(frontend_rebuild.RebuildSchedule, tf_keras.callbacks.Callback):
  """Rebuilds a `HierarchicalSoftmax`'s tree once, at the end of epoch `after_epoch` (or
  of training batch `after_batch`): `tf_hsm.keras.callbacks.RebuildTree` for tf_keras
  (same arguments and attributes)."""

  front_end = _FRONT_END
