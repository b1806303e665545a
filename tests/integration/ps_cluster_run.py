"""Runs training under ParameterServerStrategy on a loopback cluster of 2 workers and
2 parameter servers (in-process `tf.distribute.Server`s on 127.0.0.1, as in TensorFlow's
parameter-server tutorial), and the same training in one process; prints a JSON report.

Run by tests/integration/test_parameter_server.py in a subprocess of its own: connecting to a cluster
changes TensorFlow's eager context for the rest of the process, and the servers end with
it.
"""

import json
import os
import socket
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_hsm  # noqa: E402

NUM_WORKERS, NUM_PS = 2, 2
DIM, STEPS, BATCH = 8, 6, 32


def free_port():
  with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    return sock.getsockname()[1]


def start_cluster():
  spec = tf.train.ClusterSpec({
      "worker": [f"127.0.0.1:{free_port()}" for _ in range(NUM_WORKERS)],
      "ps": [f"127.0.0.1:{free_port()}" for _ in range(NUM_PS)]})
  config = tf.compat.v1.ConfigProto()
  # In-process servers share this process's threads: with fewer inter-op threads than
  # workers + 1 the workers' functions can wait on each other for ever (the tutorial's
  # advice for in-process clusters).
  config.inter_op_parallelism_threads = NUM_WORKERS + 1
  servers = [tf.distribute.Server(spec, job_name=job, task_index=index, config=config,
                                  protocol="grpc", start=True)
             for job, count in (("worker", NUM_WORKERS), ("ps", NUM_PS))
             for index in range(count)]
  resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(spec, rpc_layer="grpc")
  return servers, resolver


def make_problem():
  rng = np.random.default_rng(7)
  tree = tf_hsm.Tree.huffman(rng.zipf(1.3, 300).astype(np.float64), branching=4)
  features = rng.normal(size=(STEPS, BATCH, 5)).astype(np.float32)
  targets = rng.integers(0, tree.num_classes, (STEPS, BATCH))
  dense_init = rng.normal(size=(5, DIM)).astype(np.float32) * 0.3
  table_init = rng.normal(size=(tree.num_slots, DIM)).astype(np.float32) * 0.3
  return tree, features, targets, dense_init, table_init


OPTIMIZERS = {
    "lazy_adam": lambda: tf_hsm.optimizers.LazyAdam(0.05),
    "sparse_adagrad": lambda: tf_hsm.optimizers.SparseAdagrad(0.5),
    "sparse_sgd": lambda: tf_hsm.optimizers.SparseSGD(0.5, momentum=0.9),
}


def build(tree, dense_init, table_init, optimizer_name):
  dense = keras.layers.Dense(DIM, kernel_initializer=keras.initializers.Constant(dense_init))
  output = tf_hsm.HierarchicalSoftmax(
      tree, kernel_initializer=keras.initializers.Constant(table_init))
  dense.build((None, 5))
  output.build((None, DIM))
  optimizer = OPTIMIZERS[optimizer_name]()
  variables = dense.trainable_variables + output.trainable_variables
  optimizer.build(variables)
  return dense, output, optimizer, variables


def replica_step(dense, output, optimizer, variables, x, y):
  with tf.GradientTape() as tape:
    loss = -tf.reduce_mean(output(dense(x), y))
  grads = tf_hsm.distribute.gradients(tape, loss, variables)
  optimizer.apply_gradients(zip(grads, variables))
  return loss


def table_value(variable):
  parts = tf_hsm.distribute.pieces(variable)
  if parts is None:
    return np.asarray(variable.numpy() if hasattr(variable, "numpy") else variable)
  return np.concatenate([part.numpy() for part in parts])


def local_run(problem, optimizer_name):
  tree, features, targets, dense_init, table_init = problem
  dense, output, optimizer, variables = build(tree, dense_init, table_init, optimizer_name)
  step = tf.function(lambda x, y: replica_step(dense, output, optimizer, variables, x, y))
  losses = [float(step(features[i], targets[i])) for i in range(STEPS)]
  return losses, table_value(output.kernel), table_value(output.bias)


def cluster_run(strategy, coordinator, problem, optimizer_name):
  tree, features, targets, dense_init, table_init = problem
  with strategy.scope():
    dense, output, optimizer, variables = build(tree, dense_init, table_init,
                                                optimizer_name)

  @tf.function
  def step(x, y):
    return strategy.run(
        lambda a, b: replica_step(dense, output, optimizer, variables, a, b), args=(x, y))

  losses = []
  for i in range(STEPS):  # one step at a time: the same order of updates as one process
    remote = coordinator.schedule(step, args=(tf.constant(features[i]),
                                              tf.constant(targets[i])))
    coordinator.join()
    losses.append(float(remote.fetch()))
  kernel_pieces = tf_hsm.distribute.pieces(output.kernel)
  placement = {
      "table": [part.device for part in kernel_pieces],
      "slots": [[part.device for part in tf_hsm.distribute.pieces(slot)]
                for slot in optimizer.variables if tf_hsm.distribute.pieces(slot)],
      "slot_rows": [[int(part.shape[0]) for part in tf_hsm.distribute.pieces(slot)]
                    for slot in optimizer.variables if tf_hsm.distribute.pieces(slot)],
      "table_rows": [int(part.shape[0]) for part in kernel_pieces],
  }
  return losses, table_value(output.kernel), table_value(output.bias), placement


def plain_ops_run(strategy, coordinator, problem):
  """nll_loss on a table made with keras.Variable (a ShardedVariable inside), trained
  with SparseSGD. (Keras optimizers take Keras variables: a bare ShardedVariable has no
  `constraint` for them to read.)"""
  tree, features, targets, _, table_init = problem
  with strategy.scope():
    table = keras.Variable(table_init)
    optimizer = tf_hsm.optimizers.SparseSGD(0.5)
    optimizer.build([table])

  @tf.function
  def step(x, y):
    def replica(a, b):
      hidden = tf.matmul(a, tf.ones([5, DIM]) * 0.2)
      with tf.GradientTape() as tape:
        loss = tf_hsm.nll_loss(hidden, table, None, tree, b)
      grad, = tf_hsm.distribute.gradients(tape, loss, [table])
      optimizer.apply_gradients([(grad, table)])
      return loss
    return strategy.run(replica, args=(x, y))

  losses = []
  for i in range(STEPS):
    remote = coordinator.schedule(step, args=(tf.constant(features[i]),
                                              tf.constant(targets[i])))
    coordinator.join()
    losses.append(float(remote.fetch()))
  return type(table.value).__name__, losses


def layer_init(strategy):
  """A HierarchicalSoftmax built under the strategy with a random initializer: each
  piece drawn where it lives, from the whole table's distribution."""
  tree = tf_hsm.Tree.two_level(20_000)
  with strategy.scope():
    layer = tf_hsm.HierarchicalSoftmax(
        tree, kernel_initializer=keras.initializers.GlorotUniform(seed=4),
        bias_initializer=keras.initializers.Constant(0.5))
    layer.build((None, 32))
  pieces = [part.numpy() for part in tf_hsm.distribute.pieces(layer.kernel)]
  bias = np.concatenate([part.numpy() for part in tf_hsm.distribute.pieces(layer.bias)])
  limit = float(np.sqrt(6.0 / (tree.num_slots + 32)))
  return {"limit": limit, "max_abs": [float(np.abs(p).max()) for p in pieces],
          "std": [float(p.std()) for p in pieces],
          "first_rows_equal": bool(np.array_equal(pieces[0][:5], pieces[1][:5])),
          "bias": [float(bias.min()), float(bias.max())]}


def main():
  problem = make_problem()
  report = {"local": {}, "cluster": {}}
  for name in OPTIMIZERS:
    losses, kernel, bias = local_run(problem, name)
    report["local"][name] = {"losses": losses, "kernel": kernel.tolist(),
                             "bias": bias.tolist()}
  servers, resolver = start_cluster()
  strategy = tf.distribute.experimental.ParameterServerStrategy(
      resolver,
      variable_partitioner=tf.distribute.experimental.partitioners.FixedShardsPartitioner(
          NUM_PS))
  coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
  for name in OPTIMIZERS:
    losses, kernel, bias, placement = cluster_run(strategy, coordinator, problem, name)
    report["cluster"][name] = {"losses": losses, "kernel": kernel.tolist(),
                               "bias": bias.tolist(), "placement": placement}
  kind, losses = plain_ops_run(strategy, coordinator, problem)
  report["plain_ops"] = {"table_type": kind, "losses": losses}
  report["layer_init"] = layer_init(strategy)
  json.dump(report, sys.stdout)
  sys.stdout.flush()
  del servers
  os._exit(0)  # the servers' threads never end on their own


if __name__ == "__main__":
  main()
