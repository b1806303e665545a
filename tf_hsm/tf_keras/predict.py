"""`inference_model` for tf_keras models (the code is `tf_hsm/frontend/predict.py`)."""

import tf_keras

from tf_hsm.frontend import predict


def inference_model(model, k=10, output="top_k", temperature=1.0):
  """The model that predicts without targets (the k most probable classes, every
  class's log-probability with output="log_prob_all", or a sample with
  output="sample"): `tf_hsm.keras.inference_model` (see there) for a functional
  tf_keras `model` with one tf_hsm.tf_keras output layer."""
  return predict.inference_model(model, k, tf_keras, output, temperature)
