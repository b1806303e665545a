"""What a tf_hsm output layer checks about the way it is wired into a model, for both
Keras front ends: the arguments of its call (`check_call`), and, when the model that
runs it has been compiled, the loss and the optimizer it is trained with
(`check_model`). Keras' own errors for these mistakes come from deep inside Keras and
do not say what to pass; these do.

The layer finds the model that calls it through Keras' call context: Keras 3 keeps the
outermost layer being called (the model, in `fit`, `evaluate` and `predict`), tf_keras
the layer being called, which is the enclosing model until the tf_hsm layer's own call
starts. Neither is public API: where they are missing, the checks are skipped.
"""

import re
import sys
import warnings

# Losses that read the output as scores of every class; tf_hsm's output is one
# log-probability a token (log P(target)).
_CLASS_SCORE_LOSSES = frozenset([
    "sparse_categorical_crossentropy", "categorical_crossentropy",
    "binary_crossentropy", "categorical_focal_crossentropy",
    "sparse_categorical_focal_crossentropy", "binary_focal_crossentropy",
    "kl_divergence", "kld", "kullback_leibler_divergence", "categorical_hinge"])
# Losses that compare the output with the targets as values: with 1-D targets the
# shapes agree and such a loss would train log P(target) towards the class id.
_VALUE_LOSSES = frozenset([
    "mean_squared_error", "mse", "mean_absolute_error", "mae",
    "mean_absolute_percentage_error", "mape", "mean_squared_logarithmic_error", "msle",
    "huber", "huber_loss", "log_cosh", "logcosh", "cosine_similarity", "hinge",
    "squared_hinge", "poisson", "dice", "tversky", "circle"])

# Keras optimizers whose update of a tf.IndexedSlices gradient changes every row of the
# variable (moments or accumulators that decay or grow everywhere), by the class name,
# with the tf_hsm optimizer that updates the touched rows only.
_DENSE = {"Adam": "LazyAdam", "AdamW": "LazyAdam", "Adamax": "LazyAdam",
          "Nadam": "LazyAdam", "Lion": "LazyAdam", "Lamb": "LazyAdam",
          "Adagrad": "SparseAdagrad", "RMSprop": "SparseAdagrad",
          "Adadelta": "SparseAdagrad", "Ftrl": "SparseAdagrad",
          "Adafactor": "LazyAdam"}
# tf_keras' legacy optimizers apply sparse gradients with TensorFlow's sparse kernels
# (touched rows only) except for the Adam family, whose moments decay everywhere.
# The optimizers of _DENSE whose tf_hsm counterpart takes the same arguments.
_SAME_ARGUMENTS = frozenset(["Adam", "AdamW", "Nadam", "Adamax", "Lamb", "Adagrad"])
_DENSE_LEGACY = {"Adam": "LazyAdam", "Adamax": "LazyAdam", "Nadam": "LazyAdam"}

_PACKAGES = {"keras": ("tf_hsm.optimizers", "tf_hsm.losses", "tf_hsm.inference_model"),
             "tf_keras": ("tf_hsm.tf_keras.optimizers", "tf_hsm.tf_keras.losses",
                          "tf_hsm.tf_keras.inference_model")}


def _shape(value):
  """The static shape of `value` as a tuple, None where its rank is unknown."""
  shape = getattr(value, "shape", None)
  if shape is None:
    return None
  try:
    return tuple(None if d is None else int(d) for d in shape)
  except (TypeError, ValueError):  # a TensorShape of unknown rank
    return None


# What each layer's example in check_call's message is made with.
_FIRST_ARGUMENT = {"HierarchicalSoftmax": "tree", "HierarchicalSoftmaxMixture": "trees",
                   "AdaptiveSoftmax": "num_classes, cutoffs"}


def check_call(layer, args, kwargs):
  """Raises what to pass when `layer(hidden, targets)` lacks its targets or when the
  targets' shape is not `hidden`'s leading shape."""
  name, keras_name = type(layer).__name__, layer._KERAS  # pylint: disable=protected-access
  hidden = args[0] if args else kwargs.get("hidden")
  targets = args[1] if len(args) > 1 else kwargs.get("targets")
  if targets is None:
    raise ValueError(
        f"{name}(hidden, targets) needs the targets (the class ids it scores), got "
        f"{'None' if len(args) > 1 or 'targets' in kwargs else 'none'}: make them an "
        "input of the model, e.g. `targets = keras.Input([None], dtype=\"int32\")`, "
        f"`{name}({_FIRST_ARGUMENT.get(name, '...')})(hidden, targets)` and "
        "`keras.Model([tokens, targets], ...)`, "
        "then fit([x, y], y). To predict without targets, cut the trained model with "
        f"{_PACKAGES[keras_name][2]}(model) (top-k classes, or output=\"log_prob_all\" "
        "for every class's log-probability)")
  hidden_shape, targets_shape = _shape(hidden), _shape(targets)
  if hidden_shape is None or targets_shape is None:
    return
  leading = hidden_shape[:-1]
  mismatch = len(leading) != len(targets_shape) or any(
      a is not None and b is not None and a != b for a, b in zip(leading, targets_shape))
  if mismatch:
    hint = ""
    if list(targets_shape) == list(leading) + [1]:
      hint = (" Targets of one id each with a trailing axis of 1 (as CSV readers and "
              "TensorFlow Recommenders give them): drop that axis, e.g. an input "
              "keras.Input((), dtype=\"int64\") or tf.squeeze(targets, -1).")
    elif len(targets_shape) > len(leading):
      hint = (" For one prediction per time step the hidden states must be "
              "[batch, time, D] (e.g. an LSTM or GRU with return_sequences=True).")
    raise ValueError(
        f"{name}: targets must have hidden's shape without its last axis (one class id "
        f"per hidden state); got hidden {_text(hidden_shape)} and targets "
        f"{_text(targets_shape)}.{hint}")


def _text(shape):
  return "[" + ", ".join("None" if d is None else str(d) for d in shape) + "]"


def calling_model(keras_name):
  """(model, training) of the model whose call is running the layer about to be called,
  or (None, None) where no model calls it (or Keras' call context is not there)."""
  try:
    if keras_name == "keras":
      from keras.src.backend.common import global_state  # pylint: disable=import-outside-toplevel
      context = global_state.get_global_attribute("current_call_ctx")
      model = getattr(context, "entry_layer", None)
    else:
      from tf_keras.src.engine import base_layer_utils  # pylint: disable=import-outside-toplevel
      context = base_layer_utils.call_context()
      model = context.layer
    return model, getattr(context, "training", None)
  except (ImportError, AttributeError):
    return None, None


def keras_train_step_model():
  """The model whose own `train_step` is running (Keras 3's, TensorFlow backend, not an
  override: the step `fit` and `train_on_batch` take, whose gradient goes as taken, once,
  to `model.optimizer`), found on the call stack; None elsewhere (a custom loop, a
  `train_step` of the user's, or where Keras' trainer is not there)."""
  try:
    from keras.src.backend.tensorflow import trainer  # pylint: disable=import-outside-toplevel
    code = trainer.TensorFlowTrainer.train_step.__code__
  except (ImportError, AttributeError):
    return None
  frame = sys._getframe(1)  # pylint: disable=protected-access
  while frame is not None:
    if frame.f_code is code:
      return frame.f_locals.get("self")
    frame = frame.f_back
  return None


def _loss_name(loss):
  """A loss's Keras name in snake case ('sparse_categorical_crossentropy'), or None."""
  if isinstance(loss, str):
    return loss.lower()
  fn = getattr(loss, "fn", None)  # Keras' LossFunctionWrapper (the Loss classes)
  if callable(fn) and hasattr(fn, "__name__"):
    return fn.__name__
  if hasattr(loss, "get_config") or not hasattr(loss, "__name__"):
    return re.sub(r"(?<!^)(?=[A-Z])", "_", type(loss).__name__).lower()
  return loss.__name__


def check_model(layer, sparse_table=True):
  """At the call of `layer` inside a compiled model: raises for a loss that expects
  class scores, and warns once when the optimizer would update the whole table.

  Args:
    layer: the tf_hsm layer about to be called.
    sparse_table: whether the layer has a table whose gradient is a tf.IndexedSlices.
  """
  keras_name = layer._KERAS  # pylint: disable=protected-access
  model, training = calling_model(keras_name)
  if model is None or model is layer:
    return
  _check_loss(layer, model, keras_name)
  if training and sparse_table and layer.trainable:
    optimizer = getattr(model, "optimizer", None)
    _check_replicated_optimizer(layer, optimizer, keras_name)
    _warn_dense_optimizer(layer, optimizer, keras_name)


def _check_replicated_optimizer(layer, optimizer, keras_name):
  """ValueError for a Keras 3 optimizer other than SGD (whose update is linear in the
  gradient; Adam's squares it) under more than one replica: Keras 3
  applies the replicas' summed tf.IndexedSlices, whose rows repeat once per replica,
  slice by slice (the square of each replica's row, not of their sum), so the table and,
  through it, the whole model would train otherwise than on one device. tf_keras sums
  repeated rows first; tf_hsm's optimizers do too."""
  inner = _unwrapped(optimizer)
  kind = type(inner)
  # SGD (with momentum too) is linear in the gradient: repeated rows add up. Every
  # other Keras 3 optimizer is taken as not (Adam's squares, Muon's orthogonalization,
  # a schedule-free average...), a list of names being bound to miss new ones.
  if keras_name != "keras" or inner is None or kind.__module__.startswith("tf_hsm."):
    return
  # The Keras class it is or extends; a subclass of Keras' base class alone is the user's.
  keras_class = next((c for c in kind.__mro__ if c.__module__.startswith("keras.")), None)
  if keras_class is None or keras_class.__name__ in ("SGD", "Optimizer", "TFOptimizer",
                                                     "BaseOptimizer"):
    return
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  replicas = tf.distribute.get_strategy().num_replicas_in_sync
  if replicas <= 1:
    return
  twin = _DENSE[keras_class.__name__] if keras_class.__name__ in _SAME_ARGUMENTS else None
  named = f"keras.optimizers.{keras_class.__name__}" + (
      "" if kind is keras_class else f" ({kind.__name__})")
  raise ValueError(
      f"{named} cannot train {type(layer).__name__} {layer.name!r} over {replicas} "
      "replicas: Keras 3 applies the replicas' sparse gradients of its table row by row "
      "without summing the rows they share, so the update differs from one device's. "
      + (f"Use tf_hsm.optimizers.{twin} (the same arguments; it sums them)" if twin else
         "Use tf_hsm.optimizers.LazyAdam, SparseAdagrad or SparseSGD (they sum them)")
      + ", or keras.optimizers.SGD.")


def _check_loss(layer, model, keras_name):
  loss = getattr(model, "loss", None)
  if loss is None or isinstance(loss, (dict, list, tuple)):
    return  # several outputs: which loss is the layer's is the model's business
  name = _loss_name(loss)
  if not _outputs_layer(model, layer):
    return  # another output's loss (the layer's may be an added loss), or unknown
  if name in _CLASS_SCORE_LOSSES or name in _VALUE_LOSSES:
    losses, predictor = _PACKAGES[keras_name][1], _PACKAGES[keras_name][2]
    reads = ("reads the model's output as scores of every class" if name in
             _CLASS_SCORE_LOSSES else "compares the model's output with the targets")
    raise ValueError(
        f"compile(loss={name!r}) {reads}, but "
        f"{type(layer).__name__} {layer.name!r} outputs log P(target) for each target "
        f"(its targets are an input of the model): compile with loss={losses}.nll "
        "(the same cross-entropy, padding excluded). For every class's log-probability "
        f"after training, use {predictor}(model, output=\"log_prob_all\").")


def _outputs_layer(model, layer):
  """Whether the model's output is known to be `layer`'s (or its mixture's, or an inner
  model's holding it); False too where the model does not say (a subclassed model's
  outputs are not symbolic)."""
  for output in getattr(model, "outputs", None) or ():
    history = getattr(output, "_keras_history", None)
    # Keras 3 names the producer `operation`, tf_keras `layer`.
    producer = getattr(history, "operation", None) or getattr(history, "layer", None)
    # The layer itself, or a mixture or an inner model holding it.
    inside = getattr(producer, "_flatten_layers", lambda: ())()
    if producer is layer or any(c is layer for c in inside):
      return True
  return False


def _unwrapped(optimizer):
  """The optimizer a LossScaleOptimizer (mixed_float16) wraps."""
  inner = getattr(optimizer, "inner_optimizer", None)
  return optimizer if inner is None else inner


def dense_update_hint(optimizer):
  """The tf_hsm optimizer to use instead of `optimizer`, where `optimizer` would update
  every row of a table for a sparse gradient; None where it updates only touched rows
  (tf_hsm's, Keras' SGD without momentum, tf_keras' legacy Adagrad and SGD)."""
  optimizer = _unwrapped(optimizer)
  if optimizer is None or type(optimizer).__module__.startswith("tf_hsm."):
    return None
  for cls in type(optimizer).__mro__:
    module = cls.__module__
    if not (module.startswith("keras.") or module.startswith("tf_keras.")):
      continue
    table = _DENSE_LEGACY if ".legacy." in module else _DENSE
    if cls.__name__ in table:
      return table[cls.__name__]
    if cls.__name__ == "SGD" and ".legacy." not in module:
      momentum = getattr(optimizer, "momentum", 0.0)
      return "SparseSGD" if _value(momentum) != 0.0 else None
  return None


def _value(number):
  try:
    return float(number)
  except (TypeError, ValueError):
    return 1.0  # a schedule or tensor: assume momentum is in use


def _warn_dense_optimizer(layer, optimizer, keras_name):
  hint = dense_update_hint(optimizer)
  if hint is None:
    return
  warned = layer.__dict__.setdefault("_tf_hsm_warned_optimizers", set())
  if id(optimizer) in warned:
    return
  warned.add(id(optimizer))
  kind = type(_unwrapped(optimizer))
  package = _PACKAGES[keras_name][0]
  warnings.warn(
      f"{kind.__module__.split('.')[0]}.optimizers.{kind.__name__} updates every row of "
      f"the table of {type(layer).__name__} {layer.name!r} on every step (its slots "
      "change for untouched rows too), though the table's gradient touches only the batch's "
      f"rows: use {package}.{hint} (the same arguments), which updates the touched rows "
      "only (docs/usage.md, \"Keras\", measures the difference).", UserWarning,
      stacklevel=3)
