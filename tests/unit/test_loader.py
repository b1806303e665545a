"""The op library's loader: the CPU features it was built for are checked before loading."""

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
