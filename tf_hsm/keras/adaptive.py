"""`AdaptiveSoftmax`: the adaptive softmax of Grave et al. (PyTorch's
`nn.AdaptiveLogSoftmaxWithLoss`) as a Keras 3 layer, with tails that may be trees.

The layer is `tf_hsm.frontend.adaptive.AdaptiveSoftmaxCore` (the math, the class order,
inference, PyTorch weights; shared with the tf_keras layer) on a Keras 3 `Layer`; this
file adds only the weights' creation and the initializer in the config.
"""

import keras

from tf_hsm.frontend import adaptive as core
from tf_hsm.frontend import hsm
from tf_hsm.planning.costs import TAILS, tail_widths  # noqa: F401 (public here)
from tf_hsm.planning.cutoffs import choose_cutoffs, step_cost  # noqa: F401 (public here)

DEFAULT_TOKENS_PER_STEP = core.DEFAULT_TOKENS_PER_STEP
frequency_order = core.frequency_order


@keras.saving.register_keras_serializable(package="tf_hsm")
class AdaptiveSoftmax(core.AdaptiveSoftmaxCore, keras.layers.Layer):
  """Adaptive softmax output layer: `layer(hidden, targets)` -> log P(targets | hidden).

  Weights (PyTorch's names in brackets; tables hold one row per class or tree edge):
    head_kernel `[cutoffs[0] + n_clusters, D]` [`head.weight`], head_bias (with
    `head_bias=True`) [`head.bias`]; for cluster i: `tail_projection_i` `[D, d_i]`
    [`tail.{i}.0.weight`, transposed], `tail_kernel_i` `[rows_i, d_i]` [`tail.{i}.1.weight`]
    and, for tree tails, `tail_bias_i` `[rows_i]`.

  Padding and masks behave as in `tf_hsm.HierarchicalSoftmax`: targets < 0 and masked
  positions give 0 and no gradient, and the output carries the mask.

  Args:
    num_classes: number of class ids V (targets are ids in [0, V)).
    cutoffs: increasing ints in (0, number of classes): the head holds the classes
      [0, cutoffs[0]), cluster i the classes [cutoffs[i], cutoffs[i + 1]) (the last one
      up to the number of classes), counted in frequency order: class ids sorted by
      decreasing frequency, or the positions in `class_order`. None (with `counts`):
      chosen when the layer is built (D is known then) by `choose_cutoffs` for
      `tokens_per_step` tokens a step on `machine`, and recorded in `cutoffs` (so
      `get_config` and saving carry them).
    div_value: cluster i works at width int(D // div_value ** (i + 1)).
    head_bias: whether the head has biases (PyTorch's default: no).
    tail: "flat" (an exact softmax within each cluster, as PyTorch) or "two_level" (each
      cluster is a `Tree.two_level` over its classes, with per-edge biases, or the tree
      `tail_trees` gives it).
    counts: optional class frequencies: `[num_classes]`, one per id. Without a
      `class_order` they must be non-increasing (ids sorted by frequency). They choose
      the cutoffs (with cutoffs=None) and group the two-level tails' classes.
    class_order: optional ids, most frequent first (`AdaptiveSoftmax.frequency_order(
      counts)`): for a vocabulary whose ids are not sorted by frequency. The layer's
      class r is id `class_order[r]`: targets are ids, `top_k` and `sample` return ids,
      `log_prob_all` is indexed by id. Ids left out (id 0 as padding, for
      `Embedding(mask_zero=True)`) are not classes: as targets they count as padding
      (0, no gradient, masked), `log_prob_all` gives them -inf, `top_k` never returns
      them.
    kernel_initializer: initializer of every table and projection.
    tokens_per_step: with cutoffs=None, the tokens (targets) a training step holds
      (default `DEFAULT_TOKENS_PER_STEP`); otherwise unused.
    machine: with cutoffs=None, the `tf_hsm.planning.Machine` (or a dict of its fields)
      to choose for (default: this machine's cached rates); otherwise unused.
    tail_trees: with tail="two_level" and `cutoffs`: a `tf_hsm.Tree` (or its config)
      per cluster, over its classes (class j of cluster i is the layer's class
      `cutoffs[i] + j`), in place of the two-level trees; `get_config` carries them.
    **kwargs: base `keras.layers.Layer` arguments.

  Call arguments:
    hidden: `[..., D]` float hidden states. targets: int class ids, `hidden`'s leading
    shape; < 0 marks padding. mask: optional boolean mask with `targets`' shape.
  """

  _KERAS = "keras"

  def __init__(self, num_classes, cutoffs=None, div_value=4.0, head_bias=False,
               tail="flat", counts=None, kernel_initializer="glorot_uniform",
               tail_trees=None, tokens_per_step=None, machine=None, class_order=None,
               **kwargs):
    super().__init__(**kwargs)
    self.kernel_initializer = keras.initializers.get(kernel_initializer)
    self._init_adaptive(num_classes, cutoffs, div_value, head_bias, tail, counts,
                        tail_trees, tokens_per_step, machine, class_order)

  def _add_table(self, name, shape, initializer):
    # autocast=False: under mixed precision the tables stay float32 in `call` (and the
    # log-probabilities float32), as in HierarchicalSoftmax.
    return self.add_weight(
        name=name, shape=shape, autocast=False,
        initializer=hsm.initializer_for_table(initializer, len(self.weights)))

  def build(self, hidden_shape, targets_shape=None):
    self._build_adaptive(hidden_shape, self.kernel_initializer)

  def get_config(self):
    config = super().get_config()
    config.update(self._adaptive_config())
    config["kernel_initializer"] = keras.initializers.serialize(self.kernel_initializer)
    return config
