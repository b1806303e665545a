"""`stock_ops()`: tf_hsm's Keras layers computing with this package's stock-op functions,
so that what Keras traces inside it (`model.export`, `tf.saved_model.save`, a concrete
function) holds no `Hsm>` op and runs without the op library:

    with tf_hsm.serving.stock_ops():
      model.export("exported/")         # Keras' own export: the model's call, stock ops

That exports the model as it is called in training (targets in, log-probabilities out).
`tf_hsm.serving.export` writes the inference signatures (top-k, log_prob, log_prob_all,
sample) instead. Use it to export, not to train: the op library's gradients are the
fast ones.
"""

import contextlib
import threading

_STATE = threading.local()


@contextlib.contextmanager
def stock_ops():
  """Within it (in this thread), `HierarchicalSoftmax` calls compute with
  `tf_hsm.serving.log_prob`: same results to float rounding, no op library."""
  _STATE.depth = getattr(_STATE, "depth", 0) + 1
  try:
    yield
  finally:
    _STATE.depth -= 1


def active():
  """Whether a `stock_ops()` context is open in this thread."""
  return getattr(_STATE, "depth", 0) > 0
