"""`HierarchicalSoftmaxMixture`: a mixture of hierarchical softmaxes over different trees,
weighted by a gate on the hidden state (Keras 3).

One tree factors each class's probability through the clusters above it, and a cluster's
probability is one softmax's, log-linear in the hidden state: where the classes of a
cluster follow different contexts, no single cluster row scores them all. Two trees that
group the classes differently (from the words' left and right contexts, say) give each
class two such factorizations, and the mixture

    P(c | h) = sum_k pi_k(h) P_k(c | h),    pi(h) = softmax(G h + g)

is as normalised as each tree is, its log-probability exact. It costs each tree's step
once (about K x one tree's) and a [D, K] gate. With `head`, the frequent classes get
one exact softmax shared by the trees, which then cover the other classes and are
walked for those tokens only (`tf_hsm.frontend.mixture`): the heads' work once, not
K times. Measured on 100K-word corpora in docs/planner.md ("A mixture of trees").
"""

import keras

from tf_hsm.frontend import mixture
from tf_hsm.keras.layers import HierarchicalSoftmax


@keras.saving.register_keras_serializable(package="tf_hsm")
class HierarchicalSoftmaxMixture(mixture.MixtureParts, keras.layers.Layer):
  """`layer(hidden, targets)` -> log sum_k pi_k(hidden) P_k(targets | hidden).

  Each component is a `HierarchicalSoftmax` over its own tree of the same classes (with
  its own table); the gate is a `[D, K]` kernel and `[K]` bias, zero at the start (an
  even mixture). Padding is each component's: targets < 0, `ignore_class` and Keras
  masks give log-probability 0 and no gradient, and the output carries the mask, so
  `tf_hsm.losses.nll` averages over real tokens only. Train it as the single layer:
  `tf_hsm.losses.nll`, `tf_hsm.optimizers.LazyAdam` (each table's gradient is sparse).

  Inference: `log_prob_all` (each tree's full distribution, mixed), `top_k` on it and
  `sample` (a component from the gate, then a class from its tree);
  `tf_hsm.inference_model` cuts a model for `predict` with any of them, and
  `tf_hsm.serving.export` serves them in stock ops (`tf_hsm.serving.mixture`).

  Args:
    components: two or more `tf_hsm.Tree`s over the same classes (each made a
      `HierarchicalSoftmax` with the default arguments), or `HierarchicalSoftmax`
      layers (not yet built; their own initializers, `ignore_class` the same in all),
      or either's `get_config()` dict.
    gate_initializer: initializer of the gate's kernel (default zeros).
    head: optional class ids (distinct) scored by one softmax shared by the
      components, with a slot for the rest; the components' trees are then over the
      other classes, in increasing id order (`Tree.from_context(..., classes=
      HierarchicalSoftmaxMixture.tail_classes(head, V))`), and the layer is over
      len(head) + their classes. Default None: each tree over every class.
    head_bias_initializer: initializer of the head softmax's len(head) + 1 biases (the
      last the tail's); its table takes the first component's other settings.
    ignore_class: with `head`, a class id that counts as padding (the components'
      must then be None: their ids are tail positions). Without `head`, the
      components' own.
    tail_dim: with `head`, optional width d of what the trees score: a `[D, d]`
      projection of the hidden state (`tail_projection`, shared by the trees), as the
      adaptive softmax gives its rare classes fewer dimensions. The trees' tables are
      then d wide, which is what a tree step at V=1M costs (its rows are read and
      written once per token and level). Default None: the hidden state itself.
    tail_projection_initializer: initializer of that projection.
    num_classes: optional, the classes the layer is over, checked against what the parts
      make (len(head) + the trees' classes): trees built over all the classes below a
      head (`classes=` left out) are then an error, not a larger layer.
    head_rank: with `head`, optional rank r of a correction of the shared head per
      component: component k's head scores W h + b + U_k (V_k h) (`head_correction_in`
      V `[D, K r]`, glorot-uniform; `head_correction_out` U `[K, r, len(head) + 1]`,
      zeros, so each starts as the shared head), and the gate mixes the heads as it
      mixes the trees: a mixture of softmaxes over the frequent classes, as
      components with heads of their own give, for one head's product and K thin
      ones. The head's table then trains by its (dense) gradient, without the
      components' `fused_update`. Default None: one shared head.
    **kwargs: base `keras.layers.Layer` arguments (name, dtype, trainable, ...).

  Raises:
    TypeError, ValueError: fewer than two components, a component that is neither, trees
      over different numbers of classes, components with different `ignore_class`, a
      malformed `head`, `ignore_class` without `head` or beside the components' own,
      `tail_dim` or `head_rank` without `head` or not a positive int, `num_classes`
      unlike the parts'.
  """

  _COMPONENT, _KERAS, _KERAS_NAME = HierarchicalSoftmax, "keras", "Keras 3"
  _INITIALIZERS, _NO_CAST, _INPUT_CAST = keras.initializers, {"autocast": False}, "autocast"

  def __init__(self, components, gate_initializer="zeros", head=None,
               head_bias_initializer="zeros", ignore_class=None, tail_dim=None,
               tail_projection_initializer="glorot_uniform", num_classes=None,
               head_rank=None, **kwargs):
    mixture.refuse_component_arguments(kwargs, "keras")
    super().__init__(**kwargs)
    self._set_up(components, gate_initializer, head, head_bias_initializer, ignore_class,
                 tail_dim, tail_projection_initializer, num_classes, head_rank)
    self.supports_jit = False

  def __call__(self, *args, **kwargs):
    self._check_call(args, kwargs)
    return super().__call__(*args, **kwargs)

  def call(self, hidden, targets, mask=None, hidden_mask=None, training=None):
    # Keras fills `hidden_mask` with the mask of `hidden` (one `<argument>_mask` a tensor).
    return mixture.log_probs(self, hidden, targets, (mask, hidden_mask), training)
