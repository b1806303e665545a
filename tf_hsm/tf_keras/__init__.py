"""The tf_keras ("Keras 2") front end: tf_hsm in `tf_keras` models, and so in `tf.keras`
models under `TF_USE_LEGACY_KERAS=1`.

layers.py (`HierarchicalSoftmax`), mixture.py (`HierarchicalSoftmaxMixture`), adaptive.py
(`AdaptiveSoftmax`), losses.py (`nll`), optimizers.py (`LazyAdam`, `SparseAdagrad`,
`SparseSGD`: touched rows only), metrics.py (`Perplexity`, `TopKAccuracy`) and
callbacks.py (`RebuildTree`), with predict.py (`inference_model`), are thin tf_keras
classes over the helpers that `tf_hsm.keras` (Keras 3) calls too (`tf_hsm/frontend/`):
the same op calls, tree handling, tables in pieces and row updates. This package imports `tf_keras` directly, so it needs no environment variable.

Keep each model in one Keras: a Keras 3 tf_hsm layer called on tf_keras tensors (or the
reverse) raises a TypeError that names the class to use, and so does `compile` given
the other Keras' optimizer (its error names it), and so does `fit` given the other
Keras' `RebuildTree`. Under `TF_USE_LEGACY_KERAS=1` every public Keras name of tf_hsm is
this package's, whatever the import form: `tf_hsm.HierarchicalSoftmax`,
`tf_hsm.callbacks`, `from tf_hsm.optimizers import LazyAdam`, `tf_hsm.metrics`, ...
(`tf_hsm/__init__.py`; `tf_hsm.frontend.keras_package()`).

Under `tf.distribute`, `model.fit` trains the layer with `ParameterServerStrategy`
(table and slots in pieces, only touched rows moving), `MultiWorkerMirroredStrategy`
and `MirroredStrategy` (docs/distributed.md).
"""

try:
  import tf_keras as _tf_keras  # pylint: disable=unused-import
except ImportError:
  raise ImportError("tf_hsm.tf_keras is the front end for tf_keras, which is not "
                    "installed: pip install tf-keras of TensorFlow's release (or the "
                    "wheel's extra, 'tf_hsm[tf_keras]')") from None

from tf_hsm.tf_keras import callbacks, losses, metrics, optimizers  # pylint: disable=g-import-not-at-top
from tf_hsm.tf_keras.adaptive import AdaptiveSoftmax
from tf_hsm.tf_keras.layers import HierarchicalSoftmax
from tf_hsm.tf_keras.mixture import HierarchicalSoftmaxMixture
from tf_hsm.tf_keras.predict import inference_model

__all__ = ["AdaptiveSoftmax", "HierarchicalSoftmax", "HierarchicalSoftmaxMixture", "callbacks",
           "inference_model", "losses", "metrics", "optimizers"]
