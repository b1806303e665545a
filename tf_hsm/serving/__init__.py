"""Serving without the op library: tf_hsm's inference in stock TensorFlow ops, and an
export that writes a SavedModel needing nothing of tf_hsm (docs/serving.md).

This package imports only NumPy and TensorFlow (Keras inside `export`), reads trees
through their public NumPy attributes, and never loads tf_hsm's op library.
"""

from tf_hsm.serving.hsm import log_prob, log_prob_all, sample, top_k
from tf_hsm.serving.adaptive import (adaptive_log_prob, adaptive_log_prob_all,
                                     adaptive_sample, adaptive_top_k, AdaptiveWeights)
from tf_hsm.serving.export import export, ServingModule
from tf_hsm.serving._tree import StockTree, stock_tree
from tf_hsm.serving.stock import stock_ops

__all__ = [
    "AdaptiveWeights",
    "ServingModule",
    "StockTree",
    "adaptive_log_prob",
    "adaptive_log_prob_all",
    "adaptive_sample",
    "adaptive_top_k",
    "export",
    "log_prob",
    "log_prob_all",
    "sample",
    "stock_ops",
    "stock_tree",
    "top_k",
]
