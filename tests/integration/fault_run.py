"""Faults in a ParameterServerStrategy run on a loopback cluster of processes
(`tf_hsm.cluster.LoopbackCluster`); writes a JSON report. Run by tests/integration/test_faults.py.

    fault_run.py train CKPT_DIR OUT.json     2 PS + 2 workers: train, SIGKILL a worker
                                             mid-training, train on; checkpoint; then
                                             SIGKILL a parameter server
    fault_run.py resume CKPT OUT.json N      N PS (0: one process, no cluster): restore
                                             the checkpoint, evaluate, train on
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_hsm  # noqa: E402
from tf_hsm.cluster import LoopbackCluster  # noqa: E402

DIM, TOKENS, BATCHES = 16, 128, 4


def problem():
  rng = np.random.default_rng(5)
  counts = rng.zipf(1.3, 3000).astype(np.float64)
  tree = tf_hsm.Tree.huffman(counts, branching=8)
  targets = rng.choice(tree.num_classes, (BATCHES, TOKENS), p=counts / counts.sum())
  frequencies = rng.uniform(0.0, 1.0, DIM)
  hidden = np.sin(targets[..., None] * frequencies).astype(np.float32)
  table = (0.1 * rng.normal(size=(tree.num_slots, DIM))).astype(np.float32)
  return tree, hidden, targets, table


def build(strategy, table_init):
  with strategy.scope() if strategy else tf.init_scope():
    table = keras.Variable(table_init)
    optimizer = tf_hsm.optimizers.LazyAdam(0.05)
    optimizer.build([table])
  return table, optimizer


def step_function(strategy, tree, table, optimizer):
  def replica_step(hidden, targets):
    with tf.GradientTape() as tape:
      loss = tf_hsm.nll_loss(hidden, table, None, tree, targets)
    grads = tf_hsm.distribute.gradients(tape, loss, [table])
    optimizer.apply_gradients(zip(grads, [table]))
    return loss

  @tf.function
  def step(hidden, targets):
    if strategy is None:
      return replica_step(hidden, targets)
    return strategy.run(replica_step, args=(hidden, targets))
  return step


def run_steps(coordinator, step, hidden, targets, first, count):
  remotes = []
  for i in range(first, first + count):
    args = (tf.constant(hidden[i % BATCHES]), tf.constant(targets[i % BATCHES]))
    remotes.append(coordinator.schedule(step, args=args) if coordinator else step(*args))
  if coordinator:
    coordinator.join()
    return [float(remote.fetch()) for remote in remotes]
  return [float(loss) for loss in remotes]


def evaluate(tree, table, hidden, targets):
  return tf_hsm.log_prob(tf.constant(hidden.reshape(-1, DIM)), table, None, tree,
                         targets.reshape(-1)).numpy().tolist()


def strategy_for(cluster, num_ps):
  strategy = tf.distribute.experimental.ParameterServerStrategy(
      cluster.resolver(),
      variable_partitioner=tf.distribute.experimental.partitioners.FixedShardsPartitioner(
          num_ps))
  return strategy, tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)


def train(ckpt_dir, out):
  tree, hidden, targets, table_init = problem()
  report = {}
  with LoopbackCluster(num_ps=2, num_workers=2) as cluster:
    strategy, coordinator = strategy_for(cluster, 2)
    table, optimizer = build(strategy, table_init)
    step = step_function(strategy, tree, table, optimizer)
    losses = run_steps(coordinator, step, hidden, targets, 0, 12)
    cluster.kill("worker", 1)  # a machine lost mid-training
    losses += run_steps(coordinator, step, hidden, targets, 12, 28)
    report["losses"] = losses
    report["pieces"] = len(tf_hsm.distribute.pieces(table))
    report["eval"] = evaluate(tree, table, hidden, targets)
    report["ckpt"] = tf_hsm.distribute.checkpoint(table=table, optimizer=optimizer).write(
        os.path.join(ckpt_dir, "ckpt"))
    report["iterations"] = int(optimizer.iterations.numpy())
    cluster.kill("ps", 0)  # a parameter server lost: its pieces of the table are gone
    try:
      run_steps(coordinator, step, hidden, targets, 40, 2)
      report["after_ps_loss"] = "no error"
    except Exception as error:  # pylint: disable=broad-except
      report["after_ps_loss"] = type(error).__name__
  with open(out, "w") as f:
    json.dump(report, f)


def resume(ckpt, out, num_ps):
  tree, hidden, targets, table_init = problem()
  zeros = np.zeros_like(table_init)  # the restore must supply every value
  report = {}

  def body(strategy, coordinator):
    table, optimizer = build(strategy, zeros)
    status = tf_hsm.distribute.checkpoint(table=table, optimizer=optimizer).read(ckpt)
    status.assert_existing_objects_matched()
    parts = tf_hsm.distribute.pieces(table)
    report["pieces"] = 1 if parts is None else len(parts)
    report["eval"] = evaluate(tree, table, hidden, targets)
    report["iterations"] = int(optimizer.iterations.numpy())
    step = step_function(strategy, tree, table, optimizer)
    report["losses"] = run_steps(coordinator, step, hidden, targets, 0, 8)

  if num_ps == 0:
    body(None, None)
  else:
    with LoopbackCluster(num_ps=num_ps, num_workers=1) as cluster:
      body(*strategy_for(cluster, num_ps))
  with open(out, "w") as f:
    json.dump(report, f)


if __name__ == "__main__":
  if sys.argv[1] == "train":
    train(sys.argv[2], sys.argv[3])
  else:
    resume(sys.argv[2], sys.argv[3], int(sys.argv[4]))
  sys.stdout.flush()
  os._exit(0)  # the coordinator's threads (watching the lost servers) never end
