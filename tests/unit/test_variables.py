"""Tables held in variables: the ops read them without copying the whole table after a
sparse update, and HierarchicalSoftmax fills a large table block by block in place."""

import json
import os
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_hsm
from tf_hsm.keras import layers
from tf_hsm.keras.layers import HierarchicalSoftmax

import support

_REPO = support.REPO


_MEMORY_HELPERS = """
import json
import numpy as np
import tensorflow as tf
import tf_hsm
from tf_hsm.bench.worker import reset_peak_rss, status_bytes

def mb(field="VmRSS"):
  return status_bytes(field) / 2**20

def reset_peak():
  assert reset_peak_rss(), "the kernel refused to reset the peak RSS"
"""


def _run_script(script):
  """Runs `script` after `_MEMORY_HELPERS` in a fresh Python process; returns the JSON
  object it prints last."""
  env = dict(os.environ, PYTHONPATH=_REPO, TF_CPP_MIN_LOG_LEVEL="3")
  source = _MEMORY_HELPERS + textwrap.dedent(script)
  result = subprocess.run([sys.executable, "-c", source], env=env,
                          capture_output=True, text=True, timeout=300, check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  return json.loads(result.stdout.strip().splitlines()[-1])


_READ_AFTER_SPARSE_UPDATE = """
tree = tf_hsm.Tree.two_level(200_000)
dim = 256
table = tf.Variable(tf.zeros([tree.num_slots, dim]))
hidden = tf.random.normal([16, dim])
targets = tf.range(16, dtype=tf.int64) * 1000
reads = {
    "plain": lambda: tf.convert_to_tensor(table),
    "log_prob": lambda: tf_hsm.log_prob(hidden, table, None, tree, targets),
    "nll_loss": tf.function(lambda: tf_hsm.nll_loss(hidden, table, None, tree, targets)),
}
read = reads[READ]
read()  # traced, and its working memory allocated, before the measurement
rows = tf.IndexedSlices(tf.ones([3, dim]), tf.constant([0, 5, 900], tf.int64))
reset_peak()
before = mb()
for _ in range(3):
  table.scatter_sub(rows)  # back to copy-on-read mode
  read()
# The peak, so that a copy freed when the call returns counts too.
print(json.dumps(dict(table=tree.num_slots * dim * 4 / 2**20, growth=mb("VmHWM") - before)))
"""


@pytest.mark.parametrize("read", ["plain", "log_prob", "nll_loss"])
def test_reads_after_a_sparse_update_do_not_copy_the_table(read):
  # A sparse update puts the variable in copy-on-read mode, where a plain read copies
  # the whole table ("plain", checked so that the test can tell); the ops' reads must not.
  # One process per read: TensorFlow's allocator keeps a freed copy's memory for reuse.
  result = _run_script(f"READ = {read!r}\n" + _READ_AFTER_SPARSE_UPDATE)
  if read == "plain":
    assert result["growth"] > 0.8 * result["table"], result
  else:
    assert result["growth"] < 0.3 * result["table"], result


def test_a_sparse_update_after_a_read_leaves_the_reader_its_values(rng):
  # The ops read the table without a copy; a sparse update made while a reader (here the
  # tape's saved inputs) still holds it must then copy it, not change what it holds.
  tree = tf_hsm.Tree.two_level(60)
  init = rng.normal(size=(tree.num_slots, 8)).astype(np.float32)
  table = tf.Variable(init)
  table.scatter_sub(tf.IndexedSlices(tf.ones([1, 8]), tf.constant([0], tf.int64)))
  before = table.numpy()
  hidden = tf.constant(rng.normal(size=(5, 8)), tf.float32)
  targets = tf.constant(rng.integers(0, 60, 5), tf.int64)
  with tf.GradientTape() as tape:
    tape.watch(hidden)
    log_probs = tf_hsm.log_prob(hidden, table, None, tree, targets)
  table.scatter_sub(tf.IndexedSlices(tf.fill([tree.num_slots, 8], 3.0),
                                     tf.range(tree.num_slots, dtype=tf.int64)))
  grad = tape.gradient(log_probs, hidden)
  with tf.GradientTape() as tape:
    tape.watch(hidden)
    expected = tf_hsm.log_prob(hidden, tf.constant(before), None, tree, targets)
  np.testing.assert_array_equal(grad.numpy(), tape.gradient(expected, hidden).numpy())
  np.testing.assert_array_equal(table.numpy(), before - 3.0)
  after = tf_hsm.log_prob(hidden, table, None, tree, targets)
  np.testing.assert_array_equal(
      after.numpy(), tf_hsm.log_prob(hidden, tf.constant(before - 3.0), None, tree,
                                     targets).numpy())


# Initializers HierarchicalSoftmax fills by blocks, with the distribution each gives the
# whole [rows, dim] table, from the definitions: ("uniform", low, high),
# ("normal", mean, stddev) or ("truncated", mean, stddev of the normal before the
# truncation at 2 stddevs).
_TRUNCATED_STD = 0.87962566103423978  # std of a standard normal truncated to [-2, 2]
_BLOCKWISE = {
    "glorot_uniform": lambda rows, dim: ("uniform", -np.sqrt(6 / (rows + dim)),
                                         np.sqrt(6 / (rows + dim))),
    "he_normal": lambda rows, dim: ("truncated", 0.0, np.sqrt(2 / rows) / _TRUNCATED_STD),
    "lecun_uniform": lambda rows, dim: ("uniform", -np.sqrt(3 / rows), np.sqrt(3 / rows)),
    "fan_out_untruncated": lambda rows, dim: ("normal", 0.0, np.sqrt(2.5 / dim)),
    "random_uniform": lambda rows, dim: ("uniform", -0.3, 0.2),
    "random_normal": lambda rows, dim: ("normal", 0.1, 0.05),
    "truncated_normal": lambda rows, dim: ("truncated", -0.2, 0.1),
}


def _initializer(name, seed):
  init = keras.initializers
  made = {
      "glorot_uniform": lambda: init.GlorotUniform(seed),
      "he_normal": lambda: init.HeNormal(seed),
      "lecun_uniform": lambda: init.LecunUniform(seed),
      "fan_out_untruncated": lambda: init.VarianceScaling(2.5, "fan_out",
                                                          "untruncated_normal", seed),
      "random_uniform": lambda: init.RandomUniform(-0.3, 0.2, seed),
      "random_normal": lambda: init.RandomNormal(0.1, 0.05, seed),
      "truncated_normal": lambda: init.TruncatedNormal(-0.2, 0.1, seed),
  }
  return made[name]()


def _kernel(tree, dim, initializer, dtype="float32"):
  layer = HierarchicalSoftmax(tree, kernel_initializer=initializer, dtype=dtype)
  layer.build((None, dim))
  return layer, layer.kernel.numpy()


@pytest.fixture
def small_blocks(monkeypatch):
  """Blocks of 1 KB, so that a small table is filled in many of them."""
  monkeypatch.setattr(layers, "_INIT_BLOCK_BYTES", 1024)


@pytest.mark.parametrize("name", sorted(_BLOCKWISE))
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_large_tables_are_filled_by_blocks_from_the_whole_tables_distribution(
    small_blocks, name, dtype):
  tree = tf_hsm.Tree.two_level(4000)
  dim = 24
  layer, kernel = _kernel(tree, dim, _initializer(name, seed=11), dtype)
  assert kernel.dtype == dtype and len(layer.weights) == 2
  rows = tree.num_slots
  kind, a, b = _BLOCKWISE[name](rows, dim)
  values = kernel.astype(np.float64).ravel()
  if kind == "uniform":
    assert a <= values.min() < a + 0.01 * (b - a) and b - 0.01 * (b - a) < values.max() <= b
    mean, std = (a + b) / 2, (b - a) / np.sqrt(12)
  elif kind == "normal":
    mean, std = a, b
  else:
    assert np.all(np.abs(values - a) <= 2 * b * (1 + 1e-6))
    mean, std = a, b * _TRUNCATED_STD
  # ~100K values: the sample mean and std are within 1% of std of the true ones.
  assert abs(values.mean() - mean) < 0.02 * std
  assert abs(values.std() / std - 1) < 0.02
  # Every block has its own values (8 rows of 24 float32 per 1 KB block).
  block_rows = 1024 // (dim * np.dtype(dtype).itemsize)
  firsts = kernel[::block_rows][:50]
  assert len({row.tobytes() for row in firsts}) == len(firsts)


def test_block_fills_are_reproducible_for_a_seed(small_blocks):
  tree = tf_hsm.Tree.two_level(500)
  _, first = _kernel(tree, 16, keras.initializers.GlorotUniform(seed=3))
  _, again = _kernel(tree, 16, keras.initializers.GlorotUniform(seed=3))
  _, other = _kernel(tree, 16, keras.initializers.GlorotUniform(seed=4))
  np.testing.assert_array_equal(first, again)
  assert not np.any(first == other)


def test_tables_of_one_block_get_the_initializers_own_values():
  tree = tf_hsm.Tree.two_level(500)
  initializer = keras.initializers.GlorotUniform(seed=5)
  _, kernel = _kernel(tree, 16, initializer)
  np.testing.assert_array_equal(kernel, initializer((tree.num_slots, 16)).numpy())


@pytest.mark.parametrize("initializer", [
    keras.initializers.Orthogonal(seed=2), keras.initializers.Constant(0.25),
    keras.initializers.VarianceScaling(seed=2, input_axes=[0], output_axes=[1]),
    lambda shape, dtype=None: tf.reshape(tf.range(np.prod(shape), dtype=dtype), shape)])
def test_other_initializers_are_called_on_the_whole_table(small_blocks, initializer):
  tree = tf_hsm.Tree.two_level(300)
  _, kernel = _kernel(tree, 16, initializer)
  np.testing.assert_array_equal(kernel,
                                np.asarray(initializer((tree.num_slots, 16), "float32")))


def test_a_functional_model_fills_its_layer_by_blocks(small_blocks):
  tree = tf_hsm.Tree.two_level(2000)
  hidden = keras.Input((16,))
  targets = keras.Input((), dtype="int64")
  layer = HierarchicalSoftmax(tree, kernel_initializer=keras.initializers.GlorotUniform(7))
  keras.Model([hidden, targets], layer(hidden, targets))
  _, blockwise = _kernel(tree, 16, keras.initializers.GlorotUniform(7))
  whole = keras.initializers.GlorotUniform(7)((tree.num_slots, 16)).numpy()
  assert not np.array_equal(blockwise, whole)
  np.testing.assert_array_equal(layer.kernel.numpy(), blockwise)


def test_a_layer_first_built_in_a_function_gets_the_whole_table_initializer(small_blocks,
                                                                            rng):
  # While a function is traced the new variable gets its value only when the function
  # runs, so it cannot be filled by blocks then.
  tree = tf_hsm.Tree.two_level(2000)
  initializer = keras.initializers.GlorotUniform(seed=8)
  layer = HierarchicalSoftmax(tree, kernel_initializer=initializer)
  hidden = tf.constant(rng.normal(size=(4, 16)), tf.float32)
  targets = tf.constant([0, 1, 2, 3], tf.int64)
  log_probs = tf.function(layer)(hidden, targets)
  kernel = layer.kernel.numpy()
  np.testing.assert_array_equal(kernel, initializer((tree.num_slots, 16)).numpy())
  np.testing.assert_array_equal(log_probs.numpy(),
                                tf_hsm.log_prob(hidden, kernel, layer.bias, tree, targets))


def test_block_fill_peaks_near_the_table_and_leaves_plain_reads_uncopied():
  # One call of a Keras random initializer holds ~3 table-sized tensors besides the table.
  result = _run_script("""
  import keras
  from tf_hsm.keras.layers import HierarchicalSoftmax, _INIT_BLOCK_BYTES
  tree = tf_hsm.Tree.two_level(300_000)
  layer = HierarchicalSoftmax(tree)
  reset_peak()
  before = mb()
  layer.build((None, 256))
  build = mb("VmHWM") - before
  reset_peak()
  before = mb()
  held = [layer.kernel.value.read_value() for _ in range(3)]
  reads = mb("VmHWM") - before
  print(json.dumps(dict(table=tree.num_slots * 256 * 4 / 2**20, build=build, reads=reads,
                        block=_INIT_BLOCK_BYTES / 2**20)))
  """)
  assert result["build"] < result["table"] + 6 * result["block"], result
  assert result["reads"] < 0.3 * result["table"], result
