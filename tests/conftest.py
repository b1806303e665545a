"""Shared pytest set-up: quiet TensorFlow, fixed seeds, GPU-only cases skipped on CPU, and
the quick loop (`pytest -m "not slow"`): every test under tests/integration is marked
`slow` but the C++ core's unit tests, and so are the unit tests of `_SLOW_UNIT_TESTS`.
This folder is on sys.path for the tests: `oracle` and `support` import from here."""

import os
import zlib

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402


def pytest_configure(config):
  config.addinivalue_line("markers", "gpu: needs a CUDA GPU visible to TensorFlow")
  config.addinivalue_line(
      "markers", "slow: an integration test, or a unit test of more than a few seconds")


_TESTS = os.path.dirname(os.path.abspath(__file__))
_INTEGRATION = os.path.join(_TESTS, "integration")
# Integration tests in the quick loop: the C++ core's unit tests run the binaries that
# configure.sh (or `bazel build //cc:core_test //cc:inference_test`) left in bazel-bin,
# in seconds, and start no server.
_QUICK_INTEGRATION = ("test_cc_core.py", "test_cc_inference.py")
_SEARCH = "unit/test_serving_search.py::test_best_first_matches_the_op"
# Unit tests of many seconds each that the quick loop leaves out, each because a quick
# test checks the same code: another parameter of it, or the test named. The whole
# suite runs them. Keys are paths from tests/ with the test's name; a name without
# "[...]" stands for all its parameters.
_SLOW_UNIT_TESTS = (
    # The search with a small dense prefix on the six deepest trees; the default prefix
    # runs on every tree, these prefixes on the other eight.
    *(f"{_SEARCH}[{prefix}-{tree}]" for prefix in ("root_only", "prefix30")
      for tree in ("mixed", "mixed_deep", "huffman", "huffman3", "vectors",
                   "two_level_counts")),
    # chunks of 3 on the widest tree; every other tree takes the while_loop path too.
    "unit/test_serving.py::test_functions_match_the_op_and_the_reference[chunk3-mixed]",
    # XLA on two of the three trees; [two_level_counts-tree2] compiles the same functions.
    "unit/test_serving.py::test_under_xla_the_functions_give_the_same_results[mixed-tree0]",
    "unit/test_serving.py::test_under_xla_the_functions_give_the_same_results[huffman3-tree1]",
    # [graph] runs the same fallback; test_under_xla_the_same_results[fallback] under XLA.
    "unit/test_serving_search.py::test_a_static_batch_of_one_through_the_fallback[xla]",
    # The documents' blocks (10-30 s each): `pytest tests/unit/test_docs_code.py` after
    # editing them; the API they call is tested here.
    "unit/test_docs_code.py::test_code_blocks_run",
    # The rebuild with the other optimizers; [LazyAdam] runs, and
    # test_the_optimizer_state_moves_with_the_class_rows moves each one's state.
    *(f"unit/test_rebuild.py::test_fit_rebuilds_after_an_epoch_and_trains_on[{name}]"
      for name in ("SparseAdagrad", "SparseSGD_momentum", "keras_Adam")),
    # A process each: [plain] and [log_prob] run (nll_loss reads through log_prob).
    "unit/test_variables.py::test_reads_after_a_sparse_update_do_not_copy_the_table[nll_loss]",
    # float32 runs with every initializer.
    *(f"unit/test_variables.py::test_large_tables_are_filled_by_blocks_from_the_whole_"
      f"tables_distribution[float64-{name}]"
      for name in ("fan_out_untruncated", "glorot_uniform", "he_normal", "lecun_uniform",
                   "random_normal", "random_uniform", "truncated_normal")),
    # 10M classes; the builders' results are checked on small trees.
    "unit/test_tree.py::test_scale_two_level_10m_and_huffman_2m",
    # A fresh process; test_rebuild.py's test_save_load_and_export_after_a_rebuild saves,
    # reloads and exports in this one.
    "unit/test_layers.py::test_save_and_export_reload_in_a_fresh_process",
    # Fresh processes under TF_USE_LEGACY_KERAS=1; test_legacy_keras_every_import_form_is_
    # the_tf_keras_front_end resolves these names and every other one in one.
    "unit/test_tf_keras.py::test_legacy_keras_resolves_to_the_tf_keras_front_end",
    "unit/test_tf_keras_adaptive.py::test_legacy_keras_resolves_to_the_tf_keras_layer",
    "unit/test_tf_keras_mixture.py::test_legacy_keras_resolves_to_the_tf_keras_mixture",
)


def _key(item):
  return os.path.relpath(str(item.path), _TESTS).replace(os.sep, "/") + "::" + item.name


def _check_slow_keys(config, items):
  """A key naming no collected test, while its file was collected whole, is a renamed
  test or parameter: fail rather than let it back into the quick loop."""
  if any("::" in arg for arg in config.args):
    return
  keys = {_key(item) for item in items}
  files = {key.split("::")[0] for key in keys}
  stale = [k for k in _SLOW_UNIT_TESTS if k.split("::")[0] in files and
           not any(key == k or key.startswith(k + "[") for key in keys)]
  if stale:
    raise pytest.UsageError("tests/conftest.py's _SLOW_UNIT_TESTS names tests that do not "
                            "exist (renamed?): " + ", ".join(stale))


def _is_slow(item):
  if str(item.path).startswith(_INTEGRATION + os.sep):
    return item.path.name not in _QUICK_INTEGRATION
  key = _key(item)
  return any(key == k or key.split("[")[0] == k for k in _SLOW_UNIT_TESTS)


def pytest_collection_modifyitems(config, items):
  _check_slow_keys(config, items)
  for item in items:
    if _is_slow(item):
      item.add_marker(pytest.mark.slow)
  gpu_items = [item for item in items if "gpu" in item.keywords]
  if not gpu_items:
    return
  import tensorflow as tf
  if tf.config.list_physical_devices("GPU"):
    return
  skip = pytest.mark.skip(reason="no GPU visible to TensorFlow")
  for item in gpu_items:
    item.add_marker(skip)


@pytest.fixture
def rng(request):
  """A NumPy generator seeded from the test's name: fresh per test, reproducible."""
  seed = zlib.crc32(request.node.nodeid.encode())
  return np.random.default_rng(seed)
