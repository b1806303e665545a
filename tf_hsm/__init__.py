"""tf_hsm: hierarchical softmax for TensorFlow over class trees of any shape."""

from tf_hsm.tree import Tree
from tf_hsm.ops import log_prob, nll_loss, sgd_step
from tf_hsm.inference import log_prob_all, log_prob_candidates, sample, top_k
from tf_hsm.layers import HierarchicalSoftmax
from tf_hsm.adaptive import AdaptiveSoftmax
from tf_hsm.planner import plan
from tf_hsm import baselines, callbacks, distribute, losses, optimizers

__all__ = [
    "AdaptiveSoftmax",
    "HierarchicalSoftmax",
    "Tree",
    "baselines",
    "callbacks",
    "distribute",
    "log_prob",
    "log_prob_all",
    "log_prob_candidates",
    "losses",
    "nll_loss",
    "optimizers",
    "plan",
    "sample",
    "sgd_step",
    "top_k",
]
__version__ = "0.1.0"
