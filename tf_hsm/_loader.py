"""Finds and loads the compiled op library, once."""

import functools
import os

import tensorflow as tf

_LIBRARY = "_hsm_ops.so"
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_CANDIDATES = (
    os.path.join(_PACKAGE_DIR, _LIBRARY),
    os.path.join(os.path.dirname(_PACKAGE_DIR), "bazel-bin", "cc", _LIBRARY),
)


@functools.lru_cache(maxsize=None)
def ops():
  """Returns the generated op module of the tf_hsm library.

  Raises:
    ImportError: when the library has not been built yet.
  """
  for path in _CANDIDATES:
    if os.path.exists(path):
      return tf.load_op_library(path)
  raise ImportError(
      "The tf_hsm op library is not built: none of\n  " + "\n  ".join(_CANDIDATES) +
      "\nexists. Build it from the repository root with `./configure.sh` "
      "(or `bazel build //cc:_hsm_ops.so` after configuring).")
