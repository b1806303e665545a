"""`inference_model`: from a trained model (inputs and targets -> log-probabilities) to
the model that predicts (inputs -> the k most probable classes and their
log-probabilities), for either Keras. The model is cut at its tf_hsm layer by the serving
export's `ModelCut`, so what `predict` returns here is what `tf_hsm.serving.export`'s
"top_k" signature serves (the export in stock ops, this model with tf_hsm's op)."""

import numbers

import numpy as np

from tf_hsm.frontend.hsm import front_end_package
from tf_hsm.ops import inference
from tf_hsm.serving.export import ModelCut, keras_of


OUTPUTS = ("top_k", "log_prob_all", "sample")


def inference_model(model, k, keras_module, output="top_k", temperature=1.0):
  """The prediction model of `model` (see the front ends' `inference_model`).

  Args:
    model: a functional model of `keras_module` with one tf_hsm output layer, called on
      hidden states and one of the model's inputs as its targets, whose output is the
      model's output.
    k: how many classes each position gets, best first (output "top_k").
    keras_module: `keras` or `tf_keras`, the model's Keras.
    output: "top_k", "log_prob_all" (every class's log-probability) or "sample" (one
      class drawn per position).
    temperature: the sampling temperature (output "sample").

  Returns:
    A `keras_module.Model` from the model's inputs other than the targets to
    `{"classes": int [..., k], "log_probs": float [..., k]}` (k clamped to the number of
    classes, as the export clamps it), to `[..., num_classes]` log-probabilities, or to
    int64 classes `[...]`, sharing the model's layers and weights.
  """
  own, theirs = keras_module.__name__, keras_of(model).__name__
  if own != theirs:
    raise TypeError(f"{front_end_package(own)}.inference_model takes {own} models; this "
                    f"is a {theirs} model: use {front_end_package(theirs)}.inference_model")
  if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 1:
    raise ValueError(f"k must be an int >= 1, got {k!r}")
  if output not in OUTPUTS:
    raise ValueError(f"output must be one of {OUTPUTS}, got {output!r}")
  cut = ModelCut(model, who=f"{front_end_package(own)}.inference_model")
  if output == "sample":  # here, not under Keras' "could not infer the output shape"
    if isinstance(temperature, (bool, np.bool_)):
      raise TypeError("temperature must be a float, got a bool")
    inference.check_python_temperature(
        temperature, getattr(cut.layer, "variable_dtype", None) or cut.layer.dtype)
  classes = getattr(cut.layer, "num_ranked", None) or cut.layer.num_classes
  k = min(int(k), classes)
  predict = {"top_k": lambda layer, hidden: _top_k(layer.top_k(hidden, k)),
             "log_prob_all": lambda layer, hidden: layer.log_prob_all(hidden),
             "sample": lambda layer, hidden: layer.sample(hidden,
                                                          temperature=temperature)}[output]

  class Predict(keras_module.layers.Layer):
    """The output layer's inference as a layer of the prediction model."""

    def __init__(self, output_layer, **kwargs):
      super().__init__(**kwargs)
      self.output_layer = output_layer  # tracked: its weights are the model's

    def call(self, hidden, mask=None):  # pylint: disable=unused-argument
      # Padded positions get predictions too; the caller knows its padding.
      return predict(self.output_layer, hidden)

    def compute_mask(self, inputs, mask=None):
      return None

  suffix = f"top_{k}" if output == "top_k" else output
  outputs = Predict(cut.layer, name=f"{cut.layer.name}_{suffix}")(cut.hidden)
  return keras_module.Model(cut.feature_inputs, outputs)


def _top_k(result):
  log_probs, classes = result
  return {"classes": classes, "log_probs": log_probs}
