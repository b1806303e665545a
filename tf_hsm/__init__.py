"""tf_hsm: hierarchical softmax for TensorFlow over class trees of any shape."""

from tf_hsm.tree import Tree
from tf_hsm.ops import log_prob, sgd_step

__all__ = ["Tree", "log_prob", "sgd_step"]
__version__ = "0.1.0"
