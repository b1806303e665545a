"""The op library's loader: the newest build loads, and the CPU features and TensorFlow it
was built for are checked before loading."""

import datetime
import os

import pytest

from tf_hsm.ops import loader as _loader


def _write(path, text):
  path.write_text(text)
  return str(path)


def test_library_built_for_missing_cpu_features_is_an_import_error(tmp_path):
  library = str(tmp_path / "_hsm_ops.so")
  cpuinfo = _write(tmp_path / "cpuinfo", "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n")
  _write(tmp_path / "_hsm_ops.cpu", "march=native\nfeatures=avx avx2 avx512f avx512bw fma\n")
  with pytest.raises(ImportError, match=r"lacks \(avx512bw, avx512f\).*TF_HSM_MARCH=native"):
    _loader.check_cpu(library, cpuinfo)
  _write(tmp_path / "_hsm_ops.cpu", "march=x86-64-v3\nfeatures=avx avx2 fma\n")
  no_avx2 = _write(tmp_path / "old_cpuinfo", "flags\t\t: fpu sse2 avx\n")
  with pytest.raises(ImportError, match=r"lacks \(avx2, fma\).*TF_HSM_MARCH=native "
                     r"\./configure\.sh on this machine"):  # not the build that failed
    _loader.check_cpu(library, no_avx2)
  _write(tmp_path / "_hsm_ops.cpu", "march=haswell\nfeatures=avx avx2 fma\n")
  _loader.check_cpu(library, cpuinfo)  # all present
  _loader.check_cpu(library, str(tmp_path / "no_cpuinfo"))  # unreadable: not checked
  os.remove(tmp_path / "_hsm_ops.cpu")
  _write(tmp_path / "cpuinfo", "flags\t\t: fpu\n")
  _loader.check_cpu(library, cpuinfo)  # no record: not checked


def test_configure_records_the_features_of_this_machine():
  # The library in the package was built here, so this machine has every feature listed.
  library = _loader.PACKAGED_LIBRARY
  fields = _loader.build_record(library)
  assert fields is not None, "run ./configure.sh"
  assert fields["march"]
  flags = _loader._cpu_flags()  # pylint: disable=protected-access
  if flags is not None:
    assert set(fields["features"].split()) <= flags
    _loader.check_cpu(library)


def test_library_built_against_another_tensorflow_is_an_import_error(tmp_path):
  library = str(tmp_path / "_hsm_ops.so")
  _write(tmp_path / "_hsm_ops.cpu", "march=x86-64-v3\nfeatures=avx2\ntensorflow=2.21.0\n")
  with pytest.raises(ImportError, match=r"TensorFlow 2\.21\.0.*2\.22\.1.*tensorflow==2\.21\.\*"):
    _loader.check_tensorflow(library, "2.22.1")
  _loader.check_tensorflow(library, "2.21.3")  # the same release: ABI compatible
  _write(tmp_path / "_hsm_ops.cpu", "march=native\nfeatures=avx2\n")
  _loader.check_tensorflow(library, "2.22.1")  # an older record: not checked


def test_configure_records_the_tensorflow_it_built_against():
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  library = _loader.PACKAGED_LIBRARY
  assert _loader.build_record(library)["tensorflow"] == tf.__version__


def _checkout(tmp_path):
  """A checkout's layout: tf_hsm/, cc/BUILD and Bazel's output folder."""
  for folder in ("tf_hsm", "cc", "bazel-bin/cc"):
    (tmp_path / folder).mkdir(parents=True)
  (tmp_path / "cc" / "BUILD").write_text("")
  return str(tmp_path / "tf_hsm")


def _built_at(path, seconds):
  """Creates `path` if missing and sets its modification time."""
  with open(path, "ab"):
    pass
  os.utime(path, (seconds, seconds))


def test_the_newest_build_loads(tmp_path):
  paths = _loader.candidates(_checkout(tmp_path))
  packaged, bazel = paths
  assert packaged == str(tmp_path / "tf_hsm" / "_hsm_ops.so")
  assert bazel == str(tmp_path / "bazel-bin" / "cc" / "_hsm_ops.so")
  _built_at(bazel, 1000)
  assert _loader.choose(paths) == bazel  # built by Bazel, never installed
  _built_at(packaged, 2000)
  assert _loader.choose(paths) == packaged  # configure.sh installed its build
  _built_at(bazel, 3000)
  assert _loader.choose(paths) == bazel  # `bazel build` after an edit
  _built_at(packaged, 3000)
  assert _loader.choose(paths) == packaged  # a tie: the copy with its record beside it
  # A GPU library that a test built in bazel-bin is not what the checkout configured.
  _built_at(str(tmp_path / "bazel-bin" / "cc" / "_hsm_ops_gpu.so"), 4000)
  assert _loader.choose(_loader.candidates(str(tmp_path / "tf_hsm"))) == packaged


def test_a_wheel_loads_its_packaged_library(tmp_path):
  (tmp_path / "tf_hsm").mkdir()  # site-packages: no cc/BUILD beside the package
  paths = _loader.candidates(str(tmp_path / "tf_hsm"))
  assert paths == (str(tmp_path / "tf_hsm" / "_hsm_ops.so"),)
  with pytest.raises(ImportError, match=r"(?s)not built.*_hsm_ops\.so\nexists.*"
                     r"\./configure\.sh.*bazel build //cc:_hsm_ops\.so"):
    _loader.choose(paths)


def test_bazel_outputs_are_checked_against_the_configure_record(tmp_path):
  _, bazel = _loader.candidates(_checkout(tmp_path))
  record = _write(tmp_path / "tf_hsm" / "_hsm_ops.cpu",
                  "march=native\nfeatures=avx2 avx512f\ntensorflow=2.21.0\n")
  assert _loader.record_path(bazel) == record
  assert _loader.build_record(bazel)["features"] == "avx2 avx512f"
  cpuinfo = _write(tmp_path / "cpuinfo", "flags\t\t: avx2\n")
  with pytest.raises(ImportError, match=r"bazel-bin/cc/_hsm_ops\.so was built .*\(avx512f\)"):
    _loader.check_cpu(bazel, cpuinfo)
  with pytest.raises(ImportError, match=r"TensorFlow 2\.21\.0"):
    _loader.check_tensorflow(bazel, "2.22.0")
  elsewhere = str(tmp_path / "cc" / "_hsm_ops.so")  # not Bazel's output: its own record
  assert _loader.record_path(elsewhere) == str(tmp_path / "cc" / "_hsm_ops.cpu")
  assert _loader.build_record(elsewhere) is None


def test_newer_sources_are_the_edits_the_build_lacks(tmp_path):
  root = tmp_path
  _checkout(root)
  library = str(root / "bazel-bin" / "cc" / "_hsm_ops.so")
  for folder in ("core", "kernels", "ops", "tests"):
    (root / "cc" / folder).mkdir()
  _built_at(library, 2000)
  for name, seconds in (("core/old.cc", 1000), ("core/new.h", 3000),
                        ("kernels/new.cc", 3000), ("ops/old.cc", 2000),
                        ("core/new_gpu.cu", 3000), ("tests/new_test.cc", 3000)):
    _built_at(str(root / "cc" / name), seconds)
  # .cu files are not in the CPU library, nor are the tests.
  assert _loader.newer_sources(library, str(root)) == ["cc/core/new.h", "cc/kernels/new.cc"]


def test_the_loaded_library_is_the_one_chosen():
  loaded = _loader.loaded_library()
  assert loaded.path == _loader.choose(_loader.candidates())
  assert loaded.built == datetime.datetime.fromtimestamp(
      os.path.getmtime(loaded.path)).astimezone()
  assert loaded.newer_sources == _loader.newer_sources(loaded.path)
  assert _loader.build_record(loaded.path) is not None, "run ./configure.sh"


def test_a_library_that_does_not_load_is_an_import_error_saying_why(tmp_path):
  # A library copied without its build record skips the checks: dlopen's own failure
  # (an undefined symbol of another TensorFlow, here a file that is no library) is named.
  library = _write(tmp_path / "_hsm_ops.so", "not a shared object")
  with pytest.raises(ImportError, match=r"does not load into this TensorFlow .*undefined "
                     r"symbol means .*another TensorFlow release.*GLIBC"):
    _loader.load_checked(library)
