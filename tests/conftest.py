"""Shared pytest set-up: quiet TensorFlow, fixed seeds, GPU-only cases skipped on CPU, and
every test under tests/integration marked `slow` (so `pytest -m "not slow"` is the quick
loop). This folder is on sys.path for the tests: `oracle` and `support` import from here."""

import os
import zlib

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402


def pytest_configure(config):
  config.addinivalue_line("markers", "gpu: needs a CUDA GPU visible to TensorFlow")
  config.addinivalue_line(
      "markers", "slow: an integration test, or a unit test of more than a few seconds")


_INTEGRATION = os.path.join(os.path.dirname(os.path.abspath(__file__)), "integration")


def pytest_collection_modifyitems(config, items):
  for item in items:
    if str(item.path).startswith(_INTEGRATION + os.sep):
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
