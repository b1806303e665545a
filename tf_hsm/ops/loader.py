"""Finds, checks and loads the compiled op library, once.

Which file loads: of these two, the newer (last modified), or the one that exists:
  tf_hsm/_hsm_ops.so          the packaged copy: configure.sh installs its build here, and
                              the wheel carries it;
  bazel-bin/cc/_hsm_ops.so    in a checkout, Bazel's output.
configure.sh installs what it built, so right after it the packaged copy is the newer;
after an edit, `bazel build //cc:_hsm_ops.so` leaves a newer file in bazel-bin, and the
next Python process loads that one, with nothing to copy. A wheel has no bazel-bin, so
the packaged copy loads. On a tie the packaged copy wins (its build record sits beside
it). The CPU+GPU library (bazel-bin/cc/_hsm_ops_gpu.so) loads only once `TF_HSM_CUDA=1
./configure.sh` installs it, since tests build it too; where it is installed, rebuild it
that way after an edit, as a newer CPU-only bazel-bin/cc/_hsm_ops.so would load instead.

`loaded_library()` says which file loaded, when it was built (its modification time) and
which sources under cc/ changed after that (a build to run before the results mean
anything).
"""

import collections
import datetime
import functools
import glob
import os

import tensorflow as tf

_LIBRARY = "_hsm_ops.so"
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGED_LIBRARY = os.path.join(_PACKAGE_DIR, _LIBRARY)
# The sources //cc:_hsm_ops.so is built from (cc/BUILD), relative to the checkout.
_SOURCES = ("cc/core/*.cc", "cc/core/*.h", "cc/kernels/*.cc", "cc/kernels/*.h",
            "cc/ops/*.cc", "cc/ops/*.h")


def candidates(package_dir=_PACKAGE_DIR):
  """The op libraries that may load, for the package at `package_dir`: its packaged copy,
  then, when the package sits in a checkout (cc/BUILD beside it), Bazel's output."""
  packaged = os.path.join(package_dir, _LIBRARY)
  root = os.path.dirname(package_dir)
  if not os.path.exists(os.path.join(root, "cc", "BUILD")):
    return (packaged,)
  return (packaged, os.path.join(root, "bazel-bin", "cc", _LIBRARY))


def choose(paths):
  """The newest of `paths` that exists (the first of those tied); ImportError when none
  does, naming them and the commands that build one."""
  existing = [p for p in paths if os.path.exists(p)]
  if not existing:
    raise ImportError(
        "The tf_hsm op library is not built: none of\n  " + "\n  ".join(paths) +
        "\nexists. Build it from the repository root with `./configure.sh`, which builds "
        "and installs tf_hsm/_hsm_ops.so; after editing cc/, `bazel build "
        "//cc:_hsm_ops.so` rebuilds bazel-bin/cc/_hsm_ops.so, which loads when newer.")
  # max() keeps the first of equal keys: the packaged copy on a tie.
  return max(existing, key=os.path.getmtime)


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


def record_path(library):
  """Where the build record of `library` is: beside it (`_hsm_ops.cpu`), or, for Bazel's
  outputs in a checkout (bazel-bin/cc/), the one configure.sh wrote in tf_hsm/. Bazel
  builds them with the flags configure.sh wrote to .tf_hsm.bazelrc in the same run as that
  record (the -march, the TensorFlow to build against), so it describes them too."""
  beside = os.path.splitext(library)[0] + ".cpu"
  folder = os.path.dirname(library)
  if os.path.exists(beside) or not folder.endswith(os.path.join("bazel-bin", "cc")):
    return beside
  return os.path.join(os.path.dirname(os.path.dirname(folder)), "tf_hsm", "_hsm_ops.cpu")


def build_record(library):
  """What configure.sh recorded for `library` (see `record_path`): {"march": ...,
  "features": "avx avx2 ...", "tensorflow": ...}, or None without a record."""
  record = record_path(library)
  if not os.path.exists(record):
    return None
  with open(record) as f:
    return dict(line.rstrip("\n").split("=", 1) for line in f if "=" in line)


def check_cpu(library, cpuinfo="/proc/cpuinfo"):
  """Raises ImportError when `library` was compiled for CPU features this machine lacks.

  configure.sh records them (`_hsm_ops.cpu`, see `record_path`). Loaded anyway, such a
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
    march = fields.get("march", "?")
    fix = ("TF_HSM_MARCH=x86-64-v3 ./configure.sh (AVX2 and FMA)" if march != "x86-64-v3"
           else "TF_HSM_MARCH=native ./configure.sh on this machine: the portable build "
           "(a wheel's) needs AVX2 and FMA")
    raise ImportError(
        f"{library} was built for CPU features this machine lacks ({', '.join(missing)}): "
        f"it was configured on another kind of machine (TF_HSM_MARCH={march}). Rebuild "
        "it here with ./configure.sh, or, for one library shared by several kinds of "
        f"machines, for the oldest of them, e.g. {fix}.")


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
        f"running: install tensorflow=={'.'.join(built.split('.')[:2])}.* (the release "
        "it was built against), or rebuild the library against this TensorFlow with "
        "./configure.sh.")


Library = collections.namedtuple("Library", "path built newer_sources")
Library.__doc__ = """The op library a process loaded.

path: the file; built: when it was built, its modification time (a local datetime);
newer_sources: the sources of //cc:_hsm_ops.so (cc/core, cc/kernels, cc/ops; relative to
the checkout, none in a wheel) modified after it: an edit the loaded build does not hold."""


@functools.lru_cache(maxsize=None)
def _load():
  path = choose(candidates())
  check_tensorflow(path)
  check_cpu(path)
  return path, load_checked(path)


def load_checked(path):
  """`tf.load_op_library(path)`, its dlopen failure an ImportError saying what it means
  (the checks above need the build record, which a library copied alone lacks)."""
  try:
    return tf.load_op_library(path)
  except tf.errors.NotFoundError as e:  # dlopen's: undefined symbols, a missing library
    raise ImportError(
        f"{path} does not load into this TensorFlow {tf.__version__}: {e}. An undefined "
        "symbol means it was built against another TensorFlow release (its build record, "
        f"{os.path.basename(record_path(path))} beside it, would say which); a missing "
        "GLIBC or GLIBCXX version, on an older system than the one that built it. "
        "Rebuild it here with ./configure.sh.") from None


def ops():
  """Returns the generated op module of the tf_hsm library (the file `choose` picks).

  Raises:
    ImportError: when the library has not been built yet, was built for CPU features
      this machine lacks, or against another TensorFlow release.
  """
  return _load()[1]


def loaded_library():
  """The `Library` this process loaded (loading it if no op has run yet)."""
  path = _load()[0]
  built = datetime.datetime.fromtimestamp(os.path.getmtime(path)).astimezone()
  return Library(path, built, newer_sources(path))


def newer_sources(library, root=os.path.dirname(_PACKAGE_DIR)):
  """The sources of the op library under `root` (a checkout) modified after `library`,
  relative to `root`; empty where there is no cc/ (a wheel)."""
  built = os.path.getmtime(library)
  found = (p for pattern in _SOURCES for p in glob.glob(os.path.join(root, pattern)))
  return sorted(os.path.relpath(p, root) for p in found if os.path.getmtime(p) > built)
