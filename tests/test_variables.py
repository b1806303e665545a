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
from tf_hsm import layers
from tf_hsm.layers import HierarchicalSoftmax

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


_MEMORY_HELPERS = """
import json
import numpy as np
import tensorflow as tf
import tf_hsm

def mb(field="VmRSS"):
  status = open("/proc/self/status").read()
  return int(status.split(field + ":")[1].split()[0]) / 1024

def reset_peak():
  with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # resets VmHWM to the current resident size
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
