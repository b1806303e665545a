"""tf_hsm: hierarchical softmax for TensorFlow over class trees of any shape.

The package by concern (each subpackage's docstring says where to start):

- `tf_hsm.tree`: the class tree, NumPy only;
- `tf_hsm.ops`: the compiled ops and their gradients (TensorFlow);
- `tf_hsm.distribute`: tables in pieces over `tf.distribute`;
- `tf_hsm.frontend`: what the two Keras front ends share (the layer's call, the
  optimizers' row updates, the tree rebuild), in TensorFlow alone;
- `tf_hsm.keras`: the Keras 3 layers, losses, optimizers, metrics and callbacks;
  `tf_hsm.tf_keras`: the same for tf_keras (Keras 2) models;
- `tf_hsm.serving`: inference in stock TensorFlow ops, and the export that needs no
  tf_hsm;
- `tf_hsm.planning`: sizing an output layer before training, NumPy only;
- the commands: `python -m tf_hsm.bench`, `tf_hsm.demo`, `tf_hsm.cluster`,
  `tf_hsm.planning`.

The public names below are resolved on first use, so that `import tf_hsm.tree` or
`import tf_hsm.planning` loads neither TensorFlow nor Keras. Where TensorFlow or Keras is
already imported, `import tf_hsm` imports the Keras layers at once, which registers them
for `keras.models.load_model` (`import tf_hsm.keras` does it in any order).
"""

import importlib
import importlib.abc
import importlib.util
import os
import sys

__version__ = "0.1.0"

# The Keras front end the top-level names resolve to: tf_keras (Keras 2) where
# TF_USE_LEGACY_KERAS selects it for tf.keras too, else Keras 3. Both are always
# importable by name: tf_hsm.keras and tf_hsm.tf_keras.
_KERAS = ("tf_hsm.tf_keras" if os.environ.get("TF_USE_LEGACY_KERAS", "").strip().lower()
          in ("1", "true", "yes") else "tf_hsm.keras")

# Public name -> (module, attribute; None for the module itself).
_PUBLIC = {
    "Tree": ("tf_hsm.tree", "Tree"),
    "log_prob": ("tf_hsm.ops", "log_prob"),
    "nll_loss": ("tf_hsm.ops", "nll_loss"),
    "sgd_step": ("tf_hsm.ops", "sgd_step"),
    "adam_step": ("tf_hsm.keras.adam_step", "adam_step"),
    "top_k": ("tf_hsm.ops", "top_k"),
    "log_prob_all": ("tf_hsm.ops", "log_prob_all"),
    "sample": ("tf_hsm.ops", "sample"),
    "log_prob_candidates": ("tf_hsm.ops", "log_prob_candidates"),
    "HierarchicalSoftmax": (_KERAS, "HierarchicalSoftmax"),
    "HierarchicalSoftmaxMixture": (_KERAS, "HierarchicalSoftmaxMixture"),
    "AdaptiveSoftmax": (_KERAS, "AdaptiveSoftmax"),
    "inference_model": (_KERAS + ".predict", "inference_model"),
    "plan": ("tf_hsm.planning", "plan"),
    "losses": (_KERAS + ".losses", None),
    "optimizers": (_KERAS + ".optimizers", None),
    "callbacks": (_KERAS + ".callbacks", None),
    "metrics": (_KERAS + ".metrics", None),
    "distribute": ("tf_hsm.distribute", None),
    "serving": ("tf_hsm.serving", None),
    "keras": ("tf_hsm.keras", None),
    "tf_keras": ("tf_hsm.tf_keras", None),
    "inference": ("tf_hsm.ops.inference", None),
    "adaptive": (_KERAS + ".adaptive", None),
    "planner": ("tf_hsm.planning", None),
    "baselines": ("tf_hsm.bench.baselines", None),
}

# Module paths of the flat package this one grew from, still importable
# (`from tf_hsm.layers import HierarchicalSoftmax`): each is the module it became, of
# the same front end as the top-level names. Importing one also sets the attribute
# `tf_hsm.<name>` to it (`tf_hsm.metrics` joins them, so that every public module has
# both forms), so `from tf_hsm.callbacks import RebuildTree` and
# `tf_hsm.callbacks` agree under TF_USE_LEGACY_KERAS=1 too (a Keras 3 callback in a
# tf_keras model's `fit` fails in tf_keras' callback list).
_MOVED = {
    "tf_hsm.layers": _KERAS + ".layers",
    "tf_hsm.adaptive": _KERAS + ".adaptive",
    "tf_hsm.losses": _KERAS + ".losses",
    "tf_hsm.optimizers": _KERAS + ".optimizers",
    "tf_hsm.callbacks": _KERAS + ".callbacks",
    "tf_hsm.metrics": _KERAS + ".metrics",
    "tf_hsm.inference": "tf_hsm.ops.inference",
    "tf_hsm.planner": "tf_hsm.planning",
    "tf_hsm.baselines": "tf_hsm.bench.baselines",
}

# `from tf_hsm import *`: the functions, classes and modules a model uses (not the old
# module paths kept for compatibility, nor the tf_keras front end, which needs tf-keras).
__all__ = sorted(name for name in _PUBLIC
                 if name not in ("inference", "adaptive", "planner", "baselines",
                                 "tf_keras"))


def __getattr__(name):
  if name not in _PUBLIC:
    raise AttributeError(f"module 'tf_hsm' has no attribute {name!r}")
  module_name, attribute = _PUBLIC[name]
  module = importlib.import_module(module_name)
  value = module if attribute is None else getattr(module, attribute)
  globals()[name] = value
  return value


def __dir__():
  return sorted(set(globals()) | set(_PUBLIC))


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
  """Imports an old module path as the module it moved to (the same module object)."""

  def find_spec(self, fullname, path=None, target=None):
    del path, target
    if fullname in _MOVED:
      return importlib.util.spec_from_loader(fullname, self)
    return None

  def create_module(self, spec):
    module = importlib.import_module(_MOVED[spec.name])
    spec.loader_state = module.__spec__
    return module

  def exec_module(self, module):
    # Already executed under its own name; the import system has just set its __spec__
    # to the old path's, so it gets its own back.
    module.__spec__ = module.__spec__.loader_state


if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
  sys.meta_path.append(_MovedModules())


if sys.modules.get("keras") is not None or sys.modules.get("tensorflow") is not None:
  importlib.import_module(_KERAS)
