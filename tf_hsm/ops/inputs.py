"""Input handling shared by the op wrappers, the inference ops, the Keras layer and the
optimizers: tree tensors, table reads, dtype rules, ragged batches, XLA detection."""

import functools
import inspect

import numpy as np
import tensorflow as tf

from tf_hsm.tree import Tree

FLOAT_TYPES = (tf.float32, tf.float64)
LOW_PRECISION = (tf.float16, tf.bfloat16)


# Tree arrays at least this large are shared with TensorFlow rather than copied.
SHARE_MIN_BYTES = 1 << 20
# TensorFlow's CPU kernels require their buffers aligned to Eigen's widest vectors.
TENSOR_ALIGNMENT = 64


def shared_tensor(array):
  """An int64 tensor holding `array`'s values in memory that NumPy shares.

  Returns (tensor, view): `view` is a read-only array of the same values, backed by the
  tensor's buffer, to stand in for `array` so that the values are held once. (The
  `tf.constant` copies of a 10M-class two-level tree's arrays added 938 MiB of RSS.)
  """
  raw = np.empty(array.nbytes + TENSOR_ALIGNMENT, np.uint8)
  offset = (-raw.ctypes.data) % TENSOR_ALIGNMENT
  values = raw[offset:offset + array.nbytes].view(np.int64)
  values[...] = array
  # DLPack hands TensorFlow the buffer without a copy; it exports writable arrays only,
  # so the tree gets a read-only view of them.
  tensor = tf.experimental.dlpack.from_dlpack(values.__dlpack__())
  view = values.view()
  view.flags.writeable = False
  return tensor, view


def in_xla_function():
  """Whether the function being traced will be compiled by XLA: `tf.function(jit_compile=
  True)`, or a Keras step compiled with `jit_compile=True` (this library's ops have CPU and
  CUDA kernels, none for XLA). False when executing eagerly."""
  enclosing = getattr(tf.__internal__, "get_enclosing_xla_context", None)
  return enclosing is not None and enclosing() is not None


def tree_tensors(tree):
  """The tree's int64 arrays as tensors, created once per tree and reused.

  They are made under init_scope so that every tf.function captures the same eager
  tensors instead of embedding large constants in each graph. Large arrays are shared
  with the tree (`shared_tensor`), which then holds the tensors' buffers in their place.
  Every op wrapper starts here, so this is also where a function compiled by XLA is told
  that it cannot hold them (XLA's own message names whichever op it meets first, such as
  a variable read, not tf_hsm).
  """
  if not isinstance(tree, Tree):
    raise TypeError(f"tree must be a tf_hsm.Tree, got {type(tree).__name__}")
  if in_xla_function():
    raise ValueError(
        "tf_hsm's ops cannot run in a function compiled by XLA (tf.function(jit_compile="
        "True), or a Keras model compiled with jit_compile=True): they have CPU and CUDA "
        "kernels, none for XLA. Call them from a tf.function without jit_compile; Keras 3 "
        "models with a tf_hsm layer turn jit_compile off, tf_keras models do not: compile "
        "them without jit_compile=True.")
  cached = tree.__dict__.get("_tf_tensors")
  if cached is None:
    cached = {}
    with tf.init_scope(), tf.device("/cpu:0"):
      for name in ("child_begin", "slot_child", "path_begin", "path_nodes", "path_slots"):
        array = np.ascontiguousarray(getattr(tree, name), np.int64)
        if array.nbytes >= SHARE_MIN_BYTES:
          cached[name], tree.__dict__[name] = shared_tensor(array)
        else:
          cached[name] = tf.constant(array, dtype=tf.int64)
        del array  # the replaced array is freed now, before the next one is copied
    tree.__dict__["_tf_tensors"] = cached
  return cached


def read_table(table):
  """The value of a table that may be a variable, read without a copy of the whole table.

  After a sparse update or gather (`scatter_sub`, an Embedding lookup, the optimizers in
  `tf_hsm.optimizers`, Keras' SGD), TensorFlow puts a variable in copy-on-read mode, where
  every plain read copies all of it: a 1.2 GB copy per call at 1M x 300. The ops read the
  whole table, so they switch it back to copy-on-write first (as TensorFlow's own
  checkpointing does). A later sparse update copies the table only if a reader still
  holds it; within a training step the readers are done by then.
  """
  variable = tf_variable(table)
  read_no_copy = getattr(variable, "read_value_no_copy", None)
  return table if read_no_copy is None else read_no_copy()


def tf_variable(value):
  """The tf.Variable of a tf.Variable or of a Keras 3 variable; None for anything else."""
  if isinstance(value, tf.Variable):
    return value
  inner = getattr(value, "value", None)
  return inner if isinstance(inner, tf.Variable) else None


def dense_inputs(hidden, weights, biases):
  """Converts hidden/weights/biases to tensors of one float type.

  float16/bfloat16 hidden states are computed in float32 (the kernels accumulate in the
  float32 of the weight table); the result is cast back by the caller.
  """
  weights = tf.convert_to_tensor(read_table(weights))
  if weights.dtype not in FLOAT_TYPES:
    raise TypeError(f"weights must be float32 or float64, got {weights.dtype.name}")
  hidden = tf.convert_to_tensor(hidden)
  out_dtype = hidden.dtype
  if hidden.dtype in LOW_PRECISION:
    hidden = tf.cast(hidden, weights.dtype)
  elif hidden.dtype != weights.dtype:
    raise TypeError(f"hidden ({hidden.dtype.name}) and weights ({weights.dtype.name}) "
                    "must have the same dtype")
  if biases is None:
    biases = tf.zeros([0], weights.dtype)
  else:
    biases = tf.convert_to_tensor(read_table(biases), dtype_hint=weights.dtype)
    if biases.dtype != weights.dtype:
      raise TypeError(f"biases ({biases.dtype.name}) and weights ({weights.dtype.name}) "
                      "must have the same dtype")
  return hidden, weights, biases, out_dtype


def class_ids(ids, name):
  ids = tf.convert_to_tensor(ids)
  if ids.dtype not in (tf.int32, tf.int64):
    raise TypeError(f"{name} must be int32 or int64, got {ids.dtype.name}")
  return ids


# Arguments that hold one entry per token, like hidden's rows.
PER_TOKEN_ARGS = ("targets", "candidates", "loss_scale")


def accepts_ragged(fn):
  """Lets an op wrapper take hidden states as a `tf.RaggedTensor` [batch, (time), D]: the
  outputs of sequences of different lengths, one per time step. Its per-token arguments
  (targets, candidates, a loss_scale that is not a scalar) must then be ragged alike, with
  the same row partitions. The wrapper runs on the flat values (one row per token, as for
  a dense batch), and every output with a token axis comes back ragged like hidden (a
  scalar, such as nll_loss's, as it is)."""
  signature = inspect.signature(fn)

  @functools.wraps(fn)
  def wrapper(*args, **kwargs):
    bound = signature.bind(*args, **kwargs)
    values = bound.arguments
    hidden = values["hidden"]
    ragged = [name for name in PER_TOKEN_ARGS
              if isinstance(values.get(name), tf.RaggedTensor)]
    for name, value in values.items():
      if isinstance(value, tf.SparseTensor):
        raise TypeError(f"{name} must be a dense or ragged tensor, got a tf.SparseTensor "
                        "(tf.sparse.to_dense makes it dense)")
    if not isinstance(hidden, tf.RaggedTensor):
      if ragged:
        raise TypeError(f"{ragged[0]} is a tf.RaggedTensor but hidden is not: pass hidden "
                        "ragged alike (one row per token), or both dense")
      return fn(*args, **kwargs)
    if hidden.flat_values.shape.rank != 2:
      raise ValueError("a ragged hidden must have one uniform dimension, D, after its "
                       f"ragged ones; got shape {hidden.shape}")
    checks = []
    for name in PER_TOKEN_ARGS:
      if name not in values or values[name] is None:
        continue
      value = values[name]
      if not isinstance(value, tf.RaggedTensor):
        if name == "loss_scale" and tf.convert_to_tensor(value).shape.rank == 0:
          continue  # a scalar applies to every token
        raise TypeError(f"hidden is a tf.RaggedTensor, so {name} must be one too, with "
                        f"hidden's row partitions; got {type(value).__name__}")
      if value.ragged_rank != hidden.ragged_rank:
        raise ValueError(f"{name} has ragged rank {value.ragged_rank} but hidden has "
                         f"{hidden.ragged_rank}: they must share their row partitions")
      for ours, theirs in zip(value.nested_row_splits, hidden.nested_row_splits):
        checks.append(tf.debugging.assert_equal(
            tf.cast(ours, tf.int64), tf.cast(theirs, tf.int64),
            message=f"{name} and hidden must have the same row lengths"))
      values[name] = value.flat_values
    values["hidden"] = hidden.flat_values
    if checks:
      with tf.control_dependencies(checks):
        values["hidden"] = tf.identity(values["hidden"])
    result = fn(*bound.args, **bound.kwargs)
    return tf.nest.map_structure(
        lambda out: hidden.with_flat_values(out) if out.shape.rank else out, result)

  return wrapper


def gradient_may_follow():
  """Whether a gradient tape is recording here (always True if TensorFlow cannot say)."""
  try:
    from tensorflow.python.eager import record  # pylint: disable=import-outside-toplevel
    return bool(record.could_possibly_record())
  except (ImportError, AttributeError):
    return True


def variable_handle(variable, name):
  """The resource handle of a tf.Variable or a Keras 3 variable."""
  found = tf_variable(variable)
  if found is None:
    raise TypeError(f"{name} must be a tf.Variable or keras.Variable, got "
                    f"{type(variable).__name__}")
  return found.handle


def _is_bool(value):
  return isinstance(value, (bool, np.bool_)) or (
      isinstance(value, (tf.Tensor, tf.Variable, np.ndarray)) and value.dtype in (
          tf.bool, np.bool_))


def number_arg(value, dtype, name, scalar=True):
  """A numeric argument (learning_rate, temperature, loss_scale) in the computation's
  dtype.

  A Python or NumPy number becomes a constant of `dtype` directly, so a float64
  computation uses the float64 value (0.1 is not rounded to float32 on the way, and
  5e-324 stays positive); in float16/bfloat16 it is rounded as TensorFlow's own ops
  round it. A tensor is cast. Booleans, strings and other non-numbers are a TypeError
  naming the argument; with `scalar`, a value of known rank > 0 is a ValueError.
  """
  dtype = tf.as_dtype(dtype)
  if _is_bool(value):
    raise TypeError(f"{name} must be a number, got a bool ({value!r})")
  if isinstance(value, (int, float, np.integer, np.floating)):
    return tf.constant(value, dtype)
  if isinstance(value, (str, bytes)):
    raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
  try:
    tensor = value if isinstance(value, (tf.Tensor, tf.Variable)) else \
        tf.convert_to_tensor(value, dtype_hint=dtype)
  except (TypeError, ValueError) as error:
    raise TypeError(f"{name} must be a number or a numeric tensor, got "
                    f"{type(value).__name__}: {error}") from None
  if not (tensor.dtype.is_floating or tensor.dtype.is_integer):
    raise TypeError(f"{name} must be numeric, got a {tensor.dtype.name} tensor")
  if scalar and tensor.shape.rank not in (None, 0):
    raise ValueError(f"{name} must be a scalar, got shape {tensor.shape}")
  return tf.cast(tensor, dtype)
