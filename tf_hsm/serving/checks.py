"""What `export` checks: its own arguments (in Python, when exporting) and every
signature's inputs (in the graph, when a signature runs).

The signature checks have to hold in three runtimes that fail differently:

- TensorFlow (a loaded signature called as it is): a signature does not check its
  inputs' shapes against its spec there, so `tf.debugging.Assert` ops check them (and
  the values), with messages that name the input.
- XLA (a signature called inside `tf.function(jit_compile=True)`): XLA compiles asserts
  to nothing, but every shape is known when it compiles. Each input is stacked with
  zeros of its model's shape, the targets with zeros of the positions' shape, by pack
  ops named after the input: a wrong shape fails there when the call is traced or compiled. Values
  cannot fail under XLA; the functions then return what they document (NaN, -1).
- TFLite: the converter drops asserts and folds every shape its spec gives. The
  signatures' specs therefore leave every dimension unknown (only the rank is kept), so
  that the packs above stay in the flatbuffer and fail in LiteRT's interpreter (PACK)
  when an input's shape or the targets' shape is wrong.
"""

import numbers
import os

import numpy as np
import tensorflow as tf

__all__ = ["broadcast_rows", "check_k", "check_directory", "check_flag", "check_max_exclude",
           "check_model", "check_options", "conform", "runtime_shape", "same_positions",
           "signature_spec", "targets_below"]


# --------------------------------------------------------------------------- arguments

def check_k(k):
  """k as an int, or the error `inference_model` gives for the same k."""
  if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 1:
    raise ValueError(f"k must be an int >= 1, got {k!r}")
  return int(k)


def check_max_exclude(max_exclude):
  """max_exclude as an int >= 0 (the "top_k_excluding" signature's ids per row)."""
  if isinstance(max_exclude, bool) or not isinstance(max_exclude, numbers.Integral) or \
      max_exclude < 0:
    raise ValueError(f"max_exclude must be an int >= 0 (0: no top_k_excluding "
                     f"signature), got {max_exclude!r}")
  return int(max_exclude)


def check_flag(name, value, none_ok=False):
  """A signature's switch as a bool: any other value (the string "no", say, which is
  true) is an error rather than a signature added or left out by its truth."""
  if value is None and none_ok:
    return None
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{name} must be True or False{' or None' if none_ok else ''}, got "
                    f"{value!r}")
  return bool(value)


def check_options(k, log_prob_all, sample, max_exclude):
  """export's and ServingModule's options, checked: (k, log_prob_all, sample,
  max_exclude)."""
  return (check_k(k), check_flag("log_prob_all", log_prob_all, none_ok=True),
          check_flag("sample", sample), check_max_exclude(max_exclude))


def check_directory(directory):
  """The SavedModel's directory as a str, created; an error naming what is wrong with
  it otherwise (tf.saved_model.save would write a folder named 'None', or into the
  current directory for '')."""
  if isinstance(directory, bytes):
    directory = os.fsdecode(directory)
  if not isinstance(directory, (str, os.PathLike)):
    raise TypeError(f"directory must be a path (str or os.PathLike), got {directory!r}")
  directory = os.fspath(directory)
  if not directory.strip():
    raise ValueError("directory must name the folder to write the SavedModel to, got "
                     f"{directory!r}")
  if os.path.exists(directory) and not os.path.isdir(directory):
    raise ValueError(f"directory {directory!r} is a file; export writes a SavedModel "
                     "folder: pass a new or existing directory")
  try:
    os.makedirs(directory, exist_ok=True)
  except OSError as error:
    raise ValueError(f"cannot create the directory {directory!r}: {error}") from None
  if not os.access(directory, os.W_OK | os.X_OK):
    raise ValueError(f"cannot write to the directory {directory!r} (permission denied)")
  return directory


def _class_names(obj):
  return [(cls.__module__.split(".")[0], cls.__name__) for cls in type(obj).__mro__]


def check_model(model, who="export"):
  """An error unless `model` is a functional Keras model (Keras 3 or tf_keras): a layer
  or a subclassed model has no graph of layers to cut. `who`: the function named."""
  names = _class_names(model)
  keras_classes = [n for package, n in names if package in ("keras", "tf_keras")]
  if "Model" not in keras_classes:
    if "Layer" in keras_classes:
      raise TypeError(
          f"{who} takes a Keras model, got the layer {getattr(model, 'name', '')!r} "
          f"({type(model).__name__}): wrap it in a functional model, e.g. "
          "keras.Model([tokens, targets], layer(hidden, targets))")
    raise TypeError(f"{who} takes a functional Keras model, got {type(model).__name__}")
  if not getattr(model, "inputs", None) or not getattr(model, "outputs", None):
    raise TypeError(
        f"{who} needs a functional model (keras.Model(inputs, outputs)); "
        f"{type(model).__name__} is a subclassed model (or one never called on "
        "keras.Input), whose layers cannot be cut at the tf_hsm layer: build the same "
        "layers as a functional model, with the targets as one of its inputs, and pass "
        "that")


# --------------------------------------------------------------------------- signatures

def signature_spec(model_input):
  """The spec a signature declares for a model input (a symbolic Keras tensor): its
  dtype and rank, every dimension unknown (see the module's docstring: `conform` checks
  them)."""
  return tf.TensorSpec([None] * len(model_input.shape), tf.as_dtype(model_input.dtype),
                       name=model_input.name)


def _shape_text(dims):
  if not dims:
    return "[] (a scalar)"
  return "[" + ", ".join("?" if d is None else str(d) for d in dims) + "]"


def runtime_shape(x):
  """x's shape when the graph runs. A loaded signature called outside a tf.function
  takes inputs of any shape, while graph optimization folds `tf.shape` of an input to
  what the graph was traced with; a PlaceholderWithDefault of unknown shape hides that
  (it runs as an identity)."""
  hidden = tf.raw_ops.PlaceholderWithDefault(input=x, shape=tf.TensorShape(None))
  return tf.shape(hidden, out_type=tf.int32)


def conform(x, dims, name):
  """x with the shape `dims` (a list: ints and None for any size), or an error naming
  `name`: an assert where TensorFlow runs, a reshape named after the input elsewhere.
  (A spec's fully known shape, a scalar's, is folded in however it is read: declare
  such inputs with an unknown shape.)"""
  rank = len(dims)
  shape = runtime_shape(x)
  ok = tf.equal(tf.size(shape), rank)
  static = [(i, d) for i, d in enumerate(dims) if d is not None]
  if static:
    padded = tf.concat([shape, tf.ones([rank], tf.int32)], 0)  # indexable at any rank
    same = tf.reduce_all(tf.equal(tf.gather(padded, [i for i, _ in static]),
                                  [d for _, d in static]))
    ok = tf.logical_and(ok, same)
  x = _asserted(x, ok, [f"{name} must have shape {_shape_text(dims)}, got shape", shape],
                f"check_{name}_shape")
  # A pack needs equal shapes: it fails when XLA compiles a wrong shape, and in LiteRT
  # (where a reshape would read extra dimensions of size 1 as the declared shape).
  shape = runtime_shape(x)
  wanted = tf.stack([shape[i] if d is None else tf.constant(d, tf.int32)
                     for i, d in enumerate(dims)]) if dims else tf.zeros([0], tf.int32)
  label = "x".join("N" if d is None else str(d) for d in dims)
  label = f"must_have_shape_{label}" if dims else "must_be_a_scalar"
  return _first(tf.stack([x, tf.zeros(wanted, x.dtype)], name=f"{name}_{label}"))


def _asserted(value, ok, data, name):
  """`value` after a `tf.debugging.Assert(ok, data, name=name)` (the assert runs where
  TensorFlow runs; XLA and LiteRT drop it)."""
  check = tf.debugging.Assert(ok, data, name=name)
  with tf.control_dependencies([check]):
    return tf.identity(value)


def _first(packed):
  # A gather, not packed[0]: grappler rewrites a slice of a pack into the packed input,
  # which would drop the pack and let the input bypass the assert above.
  return tf.gather(packed, 0)


def same_positions(targets, leading, name):
  """targets, checked to have the shape `leading` (the hidden states' positions)."""
  shape = runtime_shape(targets)
  leading = tf.cast(leading, tf.int32)
  ok = tf.logical_and(tf.equal(tf.size(shape), tf.size(leading)),
                      tf.reduce_all(tf.equal(
                          tf.concat([shape, leading], 0)[:tf.size(leading)], leading)))
  targets = _asserted(
      targets, ok, [f"{name} must have one class id per position, shape", leading, "(the "
                    "positions the other inputs give), got shape", shape],
      f"check_{name}_positions")
  # A pack needs equal shapes in XLA and in LiteRT too (where the assert is gone).
  return _first(tf.stack([targets, tf.zeros(leading, targets.dtype)],
                         name=f"{name}_must_have_the_positions_shape"))


def targets_below(targets, num_classes, name):
  """targets (or excluded ids), checked to be < num_classes where TensorFlow runs
  (elsewhere the log-probability functions give such targets NaN, and an excluded id out
  of range matches no class)."""
  flat = tf.reshape(tf.cast(targets, tf.int64), [-1])
  return _asserted(
      targets, tf.reduce_all(flat < num_classes),
      [f"{name} must be class ids < num_classes = {num_classes} (or < 0 for padding), "
       "got", tf.reduce_max(flat)], f"check_{name}_range")


def broadcast_rows(ids, leading, name):
  """ids [..., n] broadcast to [*leading, n]: each leading dimension must be leading's
  or 1 (an assert where TensorFlow runs; the broadcast itself fails under XLA, when it
  compiles, and in LiteRT)."""
  shape = runtime_shape(ids)
  leading = tf.cast(leading, tf.int32)
  rows = shape[:-1]
  ok = tf.logical_and(tf.equal(tf.size(rows), tf.size(leading)), tf.reduce_all(
      tf.logical_or(tf.equal(rows, 1), tf.equal(rows, leading))))
  ids = _asserted(
      ids, ok, [f"{name} must be [..., n] with leading shape", leading, "(the positions; 1 "
                "in a dimension applies to every row along it), got shape", shape],
      f"check_{name}_rows")
  return tf.broadcast_to(ids, tf.concat([leading, shape[-1:]], 0),
                         name=f"{name}_must_broadcast_to_the_positions")
