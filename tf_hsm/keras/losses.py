"""Keras losses for models whose output is already a log-probability.

`HierarchicalSoftmax` returns log P(target | hidden); training maximises it, so the loss
is its negative mean over the tokens that are not padding. Use it with `model.fit` by
feeding the targets both as a model input (the layer needs them) and as `y` (or compile
with `loss=NegativeLogLikelihood()`, which needs no `y`: `model.fit([x, y])`):

    tokens = keras.Input((None,), dtype="int32")
    targets = keras.Input((None,), dtype="int32")
    hidden = keras.layers.LSTM(256, return_sequences=True)(
        keras.layers.Embedding(vocab, 128)(tokens))
    log_probs = tf_hsm.HierarchicalSoftmax(tree)(hidden, targets)
    model = keras.Model([tokens, targets], log_probs)
    model.compile(optimizer=tf_hsm.optimizers.LazyAdam(1e-3), loss=tf_hsm.losses.nll)
    model.fit([x, y], y, epochs=...)

Padding is excluded from the mean in two ways, either of which suffices: targets < 0 in
`y`, and the Keras mask that `HierarchicalSoftmax` puts on its output (targets < 0, its
`ignore_class`, and any mask from upstream layers, e.g. `Embedding(mask_zero=True)`).
A class-score loss such as "sparse_categorical_crossentropy" is an error that names `nll`
(the layer raises it when the compiled model first runs).
"""

import keras

from tf_hsm.frontend import hsm
@keras.saving.register_keras_serializable(package="tf_hsm")
def nll(y_true, y_pred):
  """Negative log-likelihood per position, for `model.compile(loss=nll)`.

  Keras averages the result over the positions that are not masked ("sum over batch
  size" reduction with a mask gives the mean over valid positions), so the training loss
  is each batch's mean negative log-likelihood per token. Over several batches with
  different numbers of real tokens, `fit` and `evaluate` report the mean of those batch
  means, so exp(loss) is close to, not equal to, the perplexity: `tf_hsm.keras.metrics.
  Perplexity` counts every token once.

  Args:
    y_true: the targets, or anything (e.g. zeros) if there is no padding. When it has
      the shape of `y_pred`, positions where it is negative are padding and masked out;
      otherwise it is ignored.
    y_pred: log-probabilities, e.g. the output of `HierarchicalSoftmax`.

  Returns:
    -y_pred, carrying a Keras mask when `y_true` marks padding.
  """
  return hsm.nll(y_true, y_pred)


@keras.saving.register_keras_serializable(package="tf_hsm")
class NegativeLogLikelihood(keras.losses.Loss):
  """`nll` as a `keras.losses.Loss` object (for a name, a reduction or a dtype), which
  also needs no `y`: `model.fit([x, targets])` trains a model whose targets are an input
  (Keras 3 hands a function loss such as `nll` a missing `y` as None, which fails before
  the loss runs: "None values not supported"; give `y` there, or use this class).
  Padding is then known from the output's mask only (targets < 0, upstream masks).

  Args:
    reduction: as `keras.losses.Loss`; the default averages over valid positions.
    name: the loss's name.
    dtype: the loss's computation dtype (float32 by default, also under mixed precision).
  """

  def __init__(self, reduction="sum_over_batch_size", name="nll", dtype=None):
    super().__init__(name=name, reduction=reduction, dtype=dtype)

  def __call__(self, y_true, y_pred, sample_weight=None):
    if y_true is None:  # fit without y: the targets are a model input
      y_true = 0  # a scalar, which `nll` ignores
    return super().__call__(y_true, y_pred, sample_weight)

  def call(self, y_true, y_pred):
    return nll(y_true, y_pred)
