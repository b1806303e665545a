"""The Keras 3 front end: layers.py (`HierarchicalSoftmax`), mixture.py
(`HierarchicalSoftmaxMixture`: a gated mixture of trees), adaptive.py
(`AdaptiveSoftmax`), losses.py (`nll`), optimizers.py (`LazyAdam`, `SparseAdagrad`,
`SparseSGD`: touched rows only), metrics.py (`Perplexity`, `TopKAccuracy`) and
callbacks.py (`RebuildTree`); predict.py (`inference_model`: inputs -> top-k classes).

The layers call the ops of `tf_hsm.ops`; `AdaptiveSoftmax` asks `tf_hsm.planning` for
its cutoffs. Start at layers.py.
"""

from tf_hsm.keras import callbacks, losses, metrics, optimizers
from tf_hsm.keras.adaptive import AdaptiveSoftmax
from tf_hsm.keras.layers import HierarchicalSoftmax
from tf_hsm.keras.mixture import HierarchicalSoftmaxMixture
from tf_hsm.keras.predict import inference_model

__all__ = ["AdaptiveSoftmax", "HierarchicalSoftmax", "HierarchicalSoftmaxMixture",
           "callbacks", "inference_model", "losses", "metrics", "optimizers"]
