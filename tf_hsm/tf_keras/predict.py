"""`inference_model` for tf_keras models (the code is `tf_hsm/frontend/predict.py`)."""

import tf_keras

from tf_hsm.frontend import predict


def inference_model(model, k=10):
  """The model that predicts the k most probable classes: `tf_hsm.keras.inference_model`
  (see there) for a functional tf_keras `model` with one tf_hsm.tf_keras output layer."""
  return predict.inference_model(model, k, tf_keras)
