"""`inference_model`: from a trained model (inputs and targets -> log-probabilities) to
the model that predicts (inputs -> the k most probable classes and their
log-probabilities), for either Keras. The model is cut at its tf_hsm layer by the serving
export's `ModelCut`, so what `predict` returns here is what `tf_hsm.serving.export`'s
"top_k" signature serves (the export in stock ops, this model with tf_hsm's op)."""

import numbers

from tf_hsm.frontend.hsm import front_end_package
from tf_hsm.serving.export import ModelCut, keras_of


def inference_model(model, k, keras_module):
  """The prediction model of `model` (see the front ends' `inference_model`).

  Args:
    model: a functional model of `keras_module` with one tf_hsm output layer, called on
      hidden states and one of the model's inputs as its targets, whose output is the
      model's output.
    k: how many classes each position gets, best first.
    keras_module: `keras` or `tf_keras`, the model's Keras.

  Returns:
    A `keras_module.Model` from the model's inputs other than the targets to
    `{"classes": int [..., k], "log_probs": float [..., k]}` (k clamped to the number of
    classes, as the export clamps it), sharing the model's layers and weights.
  """
  own, theirs = keras_module.__name__, keras_of(model).__name__
  if own != theirs:
    raise TypeError(f"{front_end_package(own)}.inference_model takes {own} models; this "
                    f"is a {theirs} model: use {front_end_package(theirs)}.inference_model")
  if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 1:
    raise ValueError(f"k must be an int >= 1, got {k!r}")
  cut = ModelCut(model)
  classes = getattr(cut.layer, "num_ranked", None) or cut.layer.num_classes
  k = min(int(k), classes)

  class TopK(keras_module.layers.Layer):
    """The output layer's `top_k` as a layer of the prediction model."""

    def __init__(self, output_layer, **kwargs):
      super().__init__(**kwargs)
      self.output_layer = output_layer  # tracked: its weights are the model's

    def call(self, hidden, mask=None):  # pylint: disable=unused-argument
      # Padded positions get predictions too; the caller knows its padding.
      log_probs, classes = self.output_layer.top_k(hidden, k)
      return {"classes": classes, "log_probs": log_probs}

    def compute_mask(self, inputs, mask=None):
      return None

  outputs = TopK(cut.layer, name=f"{cut.layer.name}_top_{k}")(cut.hidden)
  return keras_module.Model(cut.feature_inputs, outputs)
