"""Shared pytest set-up: quiet TensorFlow, fixed seeds, GPU-only cases skipped on CPU."""

import os
import zlib

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402


def pytest_configure(config):
  config.addinivalue_line("markers", "gpu: needs a CUDA GPU visible to TensorFlow")
  config.addinivalue_line("markers", "slow: takes more than a few seconds")


def pytest_collection_modifyitems(config, items):
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
