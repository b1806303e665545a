"""Finds and loads the compiled op library, once."""

import functools
import os

import tensorflow as tf

_LIBRARY = "_hsm_ops.so"
# The library sits at the top of the package (tf_hsm/_hsm_ops.so), where configure.sh and
# the wheel put it.
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGED_LIBRARY = os.path.join(_PACKAGE_DIR, _LIBRARY)
_CANDIDATES = (
    PACKAGED_LIBRARY,
    os.path.join(os.path.dirname(_PACKAGE_DIR), "bazel-bin", "cc", _LIBRARY),
)


def _cpu_flags(cpuinfo="/proc/cpuinfo"):
  """This machine's CPU feature flags, or None where they cannot be read (not Linux)."""
  try:
    with open(cpuinfo) as f:
      for line in f:
        if line.startswith("flags"):
          return set(line.split(":", 1)[1].split())
  except OSError:
    pass
  return None


def build_record(library):
  """What configure.sh recorded beside `library` (`_hsm_ops.cpu`): {"march": ...,
  "features": "avx avx2 ..."}, or None without that file."""
  record = os.path.splitext(library)[0] + ".cpu"
  if not os.path.exists(record):
    return None
  with open(record) as f:
    return dict(line.rstrip("\n").split("=", 1) for line in f if "=" in line)


def check_cpu(library, cpuinfo="/proc/cpuinfo"):
  """Raises ImportError when `library` was compiled for CPU features this machine lacks.

  configure.sh writes them beside the library (`_hsm_ops.cpu`). Loaded anyway, such a
  library stops the process with an illegal instruction at its first op: one built with
  the default TF_HSM_MARCH=native on an AVX-512 machine, then run on an AVX2 one that
  shares the file system, say. Without that file, or without /proc/cpuinfo, nothing is
  checked.
  """
  fields = build_record(library)
  have = _cpu_flags(cpuinfo)
  if fields is None or have is None:
    return
  missing = sorted(set(fields.get("features", "").split()) - have)
  if missing:
    raise ImportError(
        f"{library} was built for CPU features this machine lacks ({', '.join(missing)}): "
        f"it was configured on another kind of machine (TF_HSM_MARCH="
        f"{fields.get('march', '?')}). Rebuild it here with ./configure.sh, or, for one "
        "library shared by several kinds of machines, for the oldest of them, e.g. "
        "TF_HSM_MARCH=x86-64-v3 ./configure.sh (AVX2 and FMA).")


def check_tensorflow(library, version=None):
  """Raises ImportError when `library` was built against another TensorFlow release than
  the one running (a custom op library is tied to the ABI of the TensorFlow it was
  compiled against; loaded into another it fails with undefined symbols, or worse)."""
  fields = build_record(library)
  built = (fields or {}).get("tensorflow", "")
  running = version or tf.__version__
  if built and built.split(".")[:2] != running.split(".")[:2]:
    raise ImportError(
        f"{library} was built against TensorFlow {built}, but TensorFlow {running} is "
        f"running: install tensorflow=={'.'.join(built.split('.')[:2])}.* (as the tf_hsm "
        "wheel requires), or rebuild the library against this TensorFlow with "
        "./configure.sh.")


@functools.lru_cache(maxsize=None)
def ops():
  """Returns the generated op module of the tf_hsm library.

  Raises:
    ImportError: when the library has not been built yet, was built for CPU features
      this machine lacks, or against another TensorFlow release.
  """
  for path in _CANDIDATES:
    if os.path.exists(path):
      check_tensorflow(path)
      check_cpu(path)
      return tf.load_op_library(path)
  raise ImportError(
      "The tf_hsm op library is not built: none of\n  " + "\n  ".join(_CANDIDATES) +
      "\nexists. Build it from the repository root with `./configure.sh` "
      "(or `bazel build //cc:_hsm_ops.so` after configuring).")
