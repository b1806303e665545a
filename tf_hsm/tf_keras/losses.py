"""The loss of `tf_hsm.keras.losses` for tf_keras models (see there): `nll`, and
`NegativeLogLikelihood` as a `tf_keras.losses.Loss`."""

import tf_keras

from tf_hsm.frontend import hsm
@tf_keras.saving.register_keras_serializable(package="tf_hsm")
def nll(y_true, y_pred):
  """Negative log-likelihood per position, for `model.compile(loss=nll)`: `-y_pred`,
  masked where `y_true` marks padding (< 0); tf_keras averages it over valid positions."""
  return hsm.nll(y_true, y_pred)


@tf_keras.saving.register_keras_serializable(package="tf_hsm")
class NegativeLogLikelihood(tf_keras.losses.Loss):
  """`nll` as a `tf_keras.losses.Loss` object (for a name or a reduction)."""

  def __init__(self, reduction=tf_keras.losses.Reduction.AUTO, name="nll"):
    super().__init__(reduction=reduction, name=name)

  def call(self, y_true, y_pred):
    return nll(y_true, y_pred)
