"""`inference_model` for tf_keras models (the code is `tf_hsm/frontend/predict.py`)."""

import tf_keras

from tf_hsm.frontend import predict


def inference_model(model, k=10):
  """The model that predicts: the trained `model`'s inputs other than the targets ->
  `{"classes": int64 [..., k], "log_probs": [..., k]}` (float32; float64 for a float64
  layer), the k most probable classes best first (exact: the layer's `top_k`), sharing
  `model`'s layers and weights.

      predictor = tf_hsm.inference_model(model, k=5)
      best = predictor.predict(tokens)["classes"]      # [batch, time, 5]

  Padded positions get predictions too (drop them with your mask). The predictor is for
  `predict` in this process; to keep it, save `model` (or, to serve without tf_hsm,
  `tf_hsm.serving.export(model, directory, k)`, which cuts the model the same way).

  Args:
    model: a functional tf_keras model with one `HierarchicalSoftmax` or
      `AdaptiveSoftmax`, called on hidden states and one of the model's inputs as its
      targets, whose output is the model's output.
    k: how many classes each position gets (clamped to the number of classes).
  """
  return predict.inference_model(model, k, tf_keras)
