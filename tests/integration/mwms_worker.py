"""One worker of a MultiWorkerMirroredStrategy training loop (TF_CONFIG names the
cluster and this worker; each worker takes its share of every global batch), or with
--single, the same training in one process on the whole batches. (Keras 3's `model.fit`
fails under MultiWorkerMirroredStrategy before the first step, whatever the model:
keras-team/keras#20585.) Writes the trained weights to the .npz file given as the argument.

Run by tests/integration/test_multi_worker.py, which starts the workers as processes on 127.0.0.1.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_hsm  # noqa: E402

GLOBAL_BATCH, STEPS, DIM = 32, 5, 8


def problem():
  rng = np.random.default_rng(11)
  tree = tf_hsm.Tree.huffman(rng.zipf(1.3, 200).astype(np.float64), branching=4)
  features = rng.normal(size=(GLOBAL_BATCH * STEPS, 5)).astype(np.float32)
  targets = rng.integers(0, tree.num_classes, GLOBAL_BATCH * STEPS)
  dense_init = rng.normal(size=(5, DIM)).astype(np.float32) * 0.3
  table_init = rng.normal(size=(tree.num_slots, DIM)).astype(np.float32) * 0.3
  return tree, features, targets, dense_init, table_init


def build(tree, dense_init, table_init):
  dense = keras.layers.Dense(DIM, kernel_initializer=keras.initializers.Constant(dense_init))
  output = tf_hsm.HierarchicalSoftmax(
      tree, kernel_initializer=keras.initializers.Constant(table_init))
  dense.build((None, 5))
  output.build((None, DIM))
  optimizer = tf_hsm.optimizers.LazyAdam(0.05)
  variables = dense.trainable_variables + output.trainable_variables
  optimizer.build(variables)
  return dense, output, optimizer, variables


def main():
  out_path = sys.argv[1]
  single = "--single" in sys.argv
  # The strategy comes first: it configures collective ops, which must happen before
  # TensorFlow's runtime starts (a dataset or a tensor would start it).
  strategy = tf.distribute.get_strategy() if single else (
      tf.distribute.MultiWorkerMirroredStrategy())
  task = json.loads(os.environ.get("TF_CONFIG", "{}")).get("task", {}).get("index", 0)
  workers = strategy.num_replicas_in_sync
  tree, features, targets, dense_init, table_init = problem()
  with strategy.scope():
    dense, output, optimizer, variables = build(tree, dense_init, table_init)
  # What the sparse optimizer receives for the table: IndexedSlices, combined across
  # workers without a dense [rows, D] tensor.
  seen = []
  original = optimizer.update_step

  def recording_update_step(gradient, variable, learning_rate):
    seen.append(type(gradient).__name__)
    return original(gradient, variable, learning_rate)

  optimizer.update_step = recording_update_step

  @tf.function
  def step(x, y):
    def replica_step(x, y):
      with tf.GradientTape() as tape:
        # Each worker's share of the global batch's mean: summed across workers by
        # the optimizer's all-reduce, the gradient of the global mean.
        loss = -tf.reduce_sum(output(dense(x), y)) / GLOBAL_BATCH
      grads = tape.gradient(loss, variables)
      optimizer.apply_gradients(zip(grads, variables))
      return loss
    return strategy.run(replica_step, args=(x, y))

  share = GLOBAL_BATCH // workers
  losses = []
  for i in range(STEPS):
    rows = slice(i * GLOBAL_BATCH + task * share, i * GLOBAL_BATCH + (task + 1) * share)
    losses.append(strategy.reduce("SUM", step(features[rows], targets[rows]), axis=None))
  weights = {f"w{i}": v.numpy() for i, v in enumerate(variables)}
  if task == 0:
    np.savez(out_path, loss=np.array([float(loss) for loss in losses]),
             gradient_kinds=np.array(sorted(set(seen))), **weights)


if __name__ == "__main__":
  main()
