"""`inference_model` for Keras 3 models (the code is `tf_hsm/frontend/predict.py`)."""

import keras

from tf_hsm.frontend import predict


def inference_model(model, k=10, output="top_k", temperature=1.0):
  """The model that predicts without targets: the trained `model`'s inputs other than
  the targets -> `{"classes": int64 [..., k], "log_probs": [..., k]}` (float32; float64
  for a float64 layer), the k most probable classes best first (exact: the layer's
  `top_k`, which leaves out a `HierarchicalSoftmax`'s `ignore_class`), sharing `model`'s
  layers and weights. With `output="log_prob_all"` it predicts every class's
  log-probability, `[..., num_classes]` (what a `Dense` + softmax model's `predict`
  gives, as logs); with `output="sample"`, one class drawn per position, int64 `[...]`.

      predictor = tf_hsm.inference_model(model, k=5)
      best = predictor.predict(tokens)["classes"]      # [batch, time, 5]

  Padded positions get predictions too (drop them with your mask). The predictor is for
  `predict` in this process; to keep it, save `model` (or, to serve without tf_hsm,
  `tf_hsm.serving.export(model, directory, k)`, which cuts the model the same way).

  Args:
    model: a functional Keras 3 model with one `HierarchicalSoftmax`,
      `AdaptiveSoftmax` or `HierarchicalSoftmaxMixture`, called on hidden states and
      one of the model's inputs as its targets, whose output is the model's output.
    k: how many classes each position gets (clamped to the number of classes).
    output: "top_k", "log_prob_all" or "sample".
    temperature: the sampling temperature, for output="sample".
  """
  return predict.inference_model(model, k, keras, output, temperature)
