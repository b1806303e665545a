"""What the two Keras front ends share: `tf_hsm.keras` (Keras 3) and `tf_hsm.tf_keras`
(tf_keras, "Keras 2") are thin classes over these Keras-agnostic helpers, which import
TensorFlow and NumPy only:

- hsm.py: the layer's tree and row layout checks, its call (masks, padding, dtypes, the
  table in pieces), its initial values drawn piece by piece on parameter servers, and
  the errors that stop a layer of one Keras from being used in a model of the other;
- rows.py: the optimizers' updates of a table's touched rows (and of a table in pieces);
- rebuild.py: the new tree and the weights that carry over in `rebuild_tree`;
- wiring.py: the errors for a layer wired wrongly (missing targets, targets of another
  shape, a class-score loss) and the warning for an optimizer that updates a whole table;
- metrics.py: the metrics' sums (perplexity, top-k accuracy in and out of `compile`);
- predict.py and adaptive.py: `inference_model` and the adaptive softmax's core.

`keras_package()` says which front end `tf_hsm.HierarchicalSoftmax` and the other
top-level Keras names resolve to: `tf_hsm.tf_keras` where `TF_USE_LEGACY_KERAS` is set
(as `tf.keras` then is tf_keras), `tf_hsm.keras` otherwise.
"""

import os


def legacy_keras():
  """Whether `tf.keras` is tf_keras in this process (TensorFlow's own rule)."""
  return os.environ.get("TF_USE_LEGACY_KERAS", "").strip().lower() in ("1", "true", "yes")


def keras_package():
  """'tf_hsm.tf_keras' under TF_USE_LEGACY_KERAS=1, 'tf_hsm.keras' otherwise."""
  return "tf_hsm.tf_keras" if legacy_keras() else "tf_hsm.keras"
