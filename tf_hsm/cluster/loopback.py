"""A loopback ParameterServerStrategy cluster of processes, and a training run on it.

    python -m tf_hsm.cluster --ps 4 --workers 2 --classes 2M --hidden 300 --tokens 3200
    python -m tf_hsm.cluster --mode fit ...   # tf_keras' model.fit instead of the loop

starts N parameter servers and M workers as processes on 127.0.0.1, trains an output
table of `--classes` x `--hidden` with LazyAdam (table and slots split over the
parameter servers, only each step's touched rows moving), then trains the same model in
one process, and reports steps/s, the rows each shard serves a step, and the peak RSS of
every process (VmHWM from /proc/<pid>/status). `LoopbackCluster` is what the tests use
to start, kill and restart servers; every process it starts ends when it is closed.
"""

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import numpy as np

_READY = "tf_hsm.cluster: serving"


def _free_port():
  with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    return sock.getsockname()[1]


def _die_with_parent():
  """Linux: the server gets SIGKILL when the process that started it ends, however it
  ends (a test killed for its time limit leaves no server behind)."""
  try:
    import ctypes  # pylint: disable=import-outside-toplevel
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
  except (OSError, AttributeError):
    pass


def serve(job, index, spec):
  """Runs one server of `spec` (a dict job -> addresses) until the process is killed.
  The op library is loaded first: a parameter server runs the optimizers' row updates
  and a worker the ops."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  from tf_hsm.ops import loader  # pylint: disable=import-outside-toplevel
  loader.ops()
  server = tf.distribute.Server(tf.train.ClusterSpec(spec), job_name=job,
                                task_index=index, protocol="grpc", start=True)
  print(_READY, flush=True)
  server.join()


def peak_rss_bytes(pid):
  """The peak resident set size of a running process (VmHWM), in bytes."""
  with open(f"/proc/{pid}/status") as status:
    match = re.search(r"VmHWM:\s+(\d+) kB", status.read())
  return int(match.group(1)) * 1024 if match else 0


class LoopbackCluster:
  """Parameter servers and workers as processes on 127.0.0.1.

  Use as a context manager: every process is killed on exit, also on an error.
  """

  def __init__(self, num_ps, num_workers, start_timeout=120):
    self.spec = {"worker": [f"127.0.0.1:{_free_port()}" for _ in range(num_workers)],
                 "ps": [f"127.0.0.1:{_free_port()}" for _ in range(num_ps)]}
    self.start_timeout = start_timeout
    self.processes = {}

  def __enter__(self):
    try:
      for job in ("ps", "worker"):
        for index in range(len(self.spec[job])):
          self.start(job, index)
    except BaseException:
      self.close()
      raise
    return self

  def __exit__(self, *unused):
    self.close()

  def start(self, job, index):
    """Starts (or starts again) one server and waits until it serves."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL=os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"))
    env.pop("TF_CONFIG", None)
    process = subprocess.Popen(
        [sys.executable, "-m", "tf_hsm.cluster", "--serve", job, str(index),
         json.dumps(self.spec)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        env=env, text=True, preexec_fn=_die_with_parent)
    self.processes[(job, index)] = process
    deadline = time.monotonic() + self.start_timeout
    while time.monotonic() < deadline:
      line = process.stdout.readline()
      if _READY in line:
        return process
      if not line and process.poll() is not None:
        break
    raise RuntimeError(f"{job} {index} did not start (exit code {process.poll()})")

  def kill(self, job, index):
    """Kills one server with SIGKILL, as a machine failure would."""
    process = self.processes[(job, index)]
    process.send_signal(signal.SIGKILL)
    process.wait()

  def resolver(self):
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    return tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(self.spec), rpc_layer="grpc")

  def peak_rss(self):
    """{(job, index): peak RSS in bytes} of the servers still running."""
    return {key: peak_rss_bytes(process.pid) for key, process in self.processes.items()
            if process.poll() is None}

  def close(self):
    _disconnect_context(self.spec)
    for process in self.processes.values():
      if process.poll() is None:
        process.kill()
    for process in self.processes.values():
      process.wait()
      if process.stdout:
        process.stdout.close()


def _disconnect_context(spec):
  """Takes the servers of `spec` out of TensorFlow's eager context, if it is connected
  to them (a `ParameterServerStrategy` on the cluster connects it).

  The context tells every server it knows when a function it traced is deleted; once the
  servers have ended, each deletion (at the latest at the process's exit, one for every
  function and server) logs "Failed to remove function remotely ... Connection refused",
  which reads as a crash after a run that went well. Left with its own task only, the
  context deletes its functions locally, and runs on as a local one."""
  tensorflow = sys.modules.get("tensorflow")
  if tensorflow is None:
    return
  from tensorflow.core.protobuf import tensorflow_server_pb2  # pylint: disable=import-outside-toplevel
  from tensorflow.python.eager import context  # pylint: disable=import-outside-toplevel
  server_def = context.context().get_server_def()
  ours = {address for addresses in spec.values() for address in addresses}
  if server_def is None or not any(set(job.tasks.values()) & ours
                                   for job in server_def.cluster.job):
    return
  local = tensorflow_server_pb2.ServerDef()
  local.CopyFrom(server_def)
  del local.cluster.job[:]
  for job in server_def.cluster.job:
    if job.name == server_def.job_name:
      local.cluster.job.add().CopyFrom(job)
  try:
    context.context().update_server_def(local)
  except tensorflow.errors.OpError:
    pass  # a server already gone (killed as a failure): the messages are then expected


def _human(value):
  """'2M' -> 2000000, '3200' -> 3200."""
  match = re.fullmatch(r"([0-9.]+)([KMG]?)", str(value).strip(), re.IGNORECASE)
  if not match:
    raise argparse.ArgumentTypeError(f"not a count: {value!r}")
  scale = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9}[match.group(2).upper()]
  return int(float(match.group(1)) * scale)


def zipf_tree(num_classes, branching):
  from tf_hsm.tree import Tree  # pylint: disable=import-outside-toplevel
  counts = 1.0 / np.arange(1, num_classes + 1)
  return Tree.huffman(counts, branching=branching), counts


def partitioned_table(shape, stddev, name):
  """A Keras variable of random rows whose initial value is drawn shard by shard where
  each shard lives (a plain initial value would be computed whole and then sliced, a
  table-sized temporary on every parameter server)."""
  import keras  # pylint: disable=import-outside-toplevel
  import tensorflow as tf  # pylint: disable=import-outside-toplevel

  def draw(partition_shape=None, partition_offset=None):
    del partition_offset
    return tf.random.normal(partition_shape or shape, stddev=stddev)

  def creator(next_creator, **kwargs):
    kwargs.update(initial_value=draw, shape=shape, dtype=tf.float32)
    return next_creator(**kwargs)

  with tf.variable_creator_scope(creator):
    return keras.Variable(np.zeros(0, np.float32), shape=shape, name=name)


def settle(variables):
  """Returns once every variable (each piece of one in pieces) exists with its value:
  a read of one element of each waits for the operations that made it, on its server."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  from tf_hsm import distribute  # pylint: disable=import-outside-toplevel
  from tf_hsm.ops import inputs  # pylint: disable=import-outside-toplevel
  for variable in variables:
    for piece in distribute.pieces(variable) or [variable]:
      found = inputs.tf_variable(piece)  # a Keras 3 variable's tf.Variable
      piece = piece if found is None else found
      with tf.device(piece.device):  # only one element comes back
        element = tf.reshape(piece, [-1])[:1]
      element.numpy()


def train(args, strategy=None, coordinator=None, on_built=None):
  """Trains the output table for args.steps steps; returns (seconds per step, losses).
  `on_built()`, if given, is called once the table and the optimizer's slots exist,
  before the first step."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  import tf_hsm  # pylint: disable=import-outside-toplevel
  tree, counts = zipf_tree(args.classes, args.branching)
  layout = None
  if args.layout == "balanced" and strategy is not None:
    layout = tf_hsm.distribute.balanced_layout(tree, args.ps, args.tokens, counts=counts)
  scope = strategy.scope() if strategy else tf.init_scope()
  with scope:
    table = partitioned_table((tree.num_slots, args.hidden), 0.01, "table")
    optimizer = tf_hsm.optimizers.LazyAdam(1e-2)
    optimizer.build([table])
  if on_built:
    settle([table] + list(optimizer.variables))
    on_built()
  log_classes = float(np.log(args.classes))
  rng = np.random.default_rng(0)
  frequencies = tf.constant(rng.uniform(0.0, 1.0, args.hidden), tf.float32)
  phases = tf.constant(rng.uniform(0.0, 2 * np.pi, args.hidden), tf.float32)

  def replica_step(seed):
    # Log-uniform class ids: P(c) ~ 1 / (c + 1), Zipf(1), with no table of the classes.
    uniform = tf.random.stateless_uniform([args.tokens], [seed, 1], dtype=tf.float64)
    targets = tf.cast(tf.floor(tf.exp(uniform * log_classes)), tf.int64) - 1
    # Hidden states that carry the class (a fixed random phase per dimension, plus
    # noise), so that the loss can fall, with no table of them.
    hidden = tf.sin(tf.cast(targets[:, None], tf.float32) * frequencies + phases)
    hidden += 0.1 * tf.random.stateless_normal([args.tokens, args.hidden], [seed, 2])
    with tf.GradientTape() as tape:
      loss = tf_hsm.nll_loss(hidden, layout.table(table) if layout else table, None, tree,
                             targets)
    grads = tf_hsm.distribute.gradients(tape, loss, [table])
    optimizer.apply_gradients(zip(grads, [table]))
    return loss

  @tf.function
  def step(seed):
    if strategy is None:
      return replica_step(seed)
    return strategy.run(replica_step, args=(seed,))

  def run(seed):
    if coordinator is None:
      return step(tf.constant(seed, tf.int64))
    return coordinator.schedule(step, args=(tf.constant(seed, tf.int64),))

  run(0)  # traces, and for a cluster registers the function on the workers
  if coordinator is not None:
    coordinator.join()
  start = time.perf_counter()
  results = [run(seed) for seed in range(1, args.steps + 1)]
  if coordinator is not None:
    coordinator.join()
    results = [result.fetch() for result in results]
  seconds = (time.perf_counter() - start) / args.steps
  return seconds, [float(loss) for loss in results]


def train_fit(args, strategy=None, on_built=None):
  """`--mode fit`: tf_keras' `model.fit` trains a tf_hsm.tf_keras.HierarchicalSoftmax
  (under the strategy's scope: table and LazyAdam's slots in pieces) on the same
  synthetic data as `train`, through a `DatasetCreator` on a cluster; returns (seconds
  per step, the loss of each of its 2 epochs). `on_built` as in `train` (the optimizer
  is then built before `fit`, as `fit` would build it, under the strategy's scope)."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  import tf_keras  # pylint: disable=import-outside-toplevel
  from tf_hsm import distribute  # pylint: disable=import-outside-toplevel
  from tf_hsm import tf_keras as hk  # pylint: disable=import-outside-toplevel
  tree, counts = zipf_tree(args.classes, args.branching)
  layout = None
  if args.layout == "balanced" and strategy is not None:
    layout = distribute.balanced_layout(tree, args.ps, args.tokens, counts=counts)
  log_classes = float(np.log(args.classes))
  rng = np.random.default_rng(0)
  frequencies = rng.uniform(0.0, 1.0, args.hidden).astype(np.float32)
  phases = rng.uniform(0.0, 2 * np.pi, args.hidden).astype(np.float32)

  def batch(seed):
    uniform = tf.random.stateless_uniform([args.tokens], [seed, 1], dtype=tf.float64)
    targets = tf.cast(tf.floor(tf.exp(uniform * log_classes)), tf.int32) - 1
    hidden = tf.sin(tf.cast(targets[:, None], tf.float32) * frequencies + phases)
    hidden += 0.1 * tf.random.stateless_normal([args.tokens, args.hidden], [seed, 2])
    return (hidden, targets), targets

  def dataset_fn(input_context=None):
    del input_context
    return tf.data.Dataset.range(1, 1 << 30).map(batch).prefetch(2)

  scope = strategy.scope() if strategy else tf.init_scope()
  with scope:
    hidden = tf_keras.Input((args.hidden,))
    targets = tf_keras.Input((), dtype="int32")
    output = hk.HierarchicalSoftmax(tree, use_bias=False, row_layout=layout,
                                    kernel_initializer=tf_keras.initializers.RandomNormal(
                                        stddev=0.01, seed=0))
    model = tf_keras.Model([hidden, targets], output(hidden, targets))
    model.compile(optimizer=hk.optimizers.LazyAdam(1e-2), loss=hk.losses.nll)
    if on_built:
      model.optimizer.build(model.trainable_variables)
  if on_built:
    settle(model.trainable_variables + list(model.optimizer.variables))
    on_built()
  data = tf_keras.utils.experimental.DatasetCreator(dataset_fn) if strategy else \
      dataset_fn()
  per_epoch = max(1, args.steps // 2)
  model.fit(data, epochs=1, steps_per_epoch=1, verbose=0)  # traces, registers
  start = time.perf_counter()
  history = model.fit(data, epochs=2, steps_per_epoch=per_epoch, verbose=0)
  seconds = (time.perf_counter() - start) / (2 * per_epoch)
  return seconds, [float(loss) for loss in history.history["loss"]]


def _train(args, strategy=None, coordinator=None, on_built=None):
  if args.mode == "fit":
    return train_fit(args, strategy, on_built)
  return train(args, strategy, coordinator, on_built)


def _single(args):
  seconds, losses = _train(args)
  print(json.dumps({"seconds_per_step": seconds, "losses": losses,
                    "peak_rss": peak_rss_bytes(os.getpid())}))


def _cluster(args):
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  with LoopbackCluster(args.ps, args.workers) as cluster:
    strategy = tf.distribute.experimental.ParameterServerStrategy(
        cluster.resolver(),
        variable_partitioner=tf.distribute.experimental.partitioners.FixedShardsPartitioner(
            args.ps))
    coordinator = None if args.mode == "fit" else \
        tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
    built = {}

    def on_built():
      built.update({f"{job} {index}": value
                    for (job, index), value in cluster.peak_rss().items()},
                   coordinator=peak_rss_bytes(os.getpid()))

    seconds, losses = _train(args, strategy, coordinator, on_built)
    rss = {f"{job} {index}": value for (job, index), value in cluster.peak_rss().items()}
  rss["coordinator"] = peak_rss_bytes(os.getpid())
  return {"seconds_per_step": seconds, "losses": losses, "peak_rss": rss,
          "peak_rss_built": built}


def report(args, cluster_result, single_result):
  from tf_hsm import distribute  # pylint: disable=import-outside-toplevel
  tree, counts = zipf_tree(args.classes, args.branching)
  rng = np.random.default_rng(0)
  steps = [rng.choice(args.classes, args.tokens, p=counts / counts.sum())
           for _ in range(3)]
  layout = None
  if args.layout == "balanced":
    layout = distribute.balanced_layout(tree, args.ps, args.tokens, counts=counts)
  per_shard = np.mean([distribute.rows_per_shard(tree, s, args.ps, layout) for s in steps],
                      0)
  table_bytes = tree.num_slots * args.hidden * 4
  gib = 2.0**30
  how = "tf_keras model.fit" if args.mode == "fit" else "custom loop"
  lines = [
      f"{how}: V={args.classes:,}, D={args.hidden}, {args.branching}-ary Huffman tree, "
      f"T={args.tokens:,} Zipf tokens a step, LazyAdam: table + slots "
      f"{3 * table_bytes / gib:.2f} GiB",
      "",
      "| run | steps/s | peak RSS |",
      "| --- | --- | --- |",
      f"| one process | {1 / single_result['seconds_per_step']:.2f} | "
      f"{single_result['peak_rss'] / gib:.2f} GiB |",
      f"| {args.ps} PS + {args.workers} workers | "
      f"{1 / cluster_result['seconds_per_step']:.2f} | "
      + ", ".join(f"{name} {value / gib:.2f} GiB"
                  for name, value in sorted(cluster_result["peak_rss"].items())) + " |",
      "",
      "Peak RSS once the table and the optimizer's slots exist, before the first step: "
      + ", ".join(f"{name} {value / gib:.2f} GiB"
                  for name, value in sorted(cluster_result["peak_rss_built"].items())),
      f"Distinct rows each parameter server sends and updates a step ({args.layout} "
      "layout): "
      + " / ".join(f"{value / 1e3:.1f}K" for value in per_shard),
      f"Loss, first and last {'epoch' if args.mode == 'fit' else 'step'}: cluster {cluster_result['losses'][0]:.4f} -> "
      f"{cluster_result['losses'][-1]:.4f}; one process {single_result['losses'][0]:.4f}"
      f" -> {single_result['losses'][-1]:.4f}"]
  return "\n".join(lines)


def main(argv=None):
  argv = sys.argv[1:] if argv is None else argv
  if argv[:1] == ["--serve"]:
    serve(argv[1], int(argv[2]), json.loads(argv[3]))
    return 0
  parser = argparse.ArgumentParser(prog="python -m tf_hsm.cluster",
                                   description=__doc__.split("\n\n")[0])
  parser.add_argument("--ps", type=int, default=4)
  parser.add_argument("--workers", type=int, default=2)
  parser.add_argument("--classes", type=_human, default=2_000_000)
  parser.add_argument("--hidden", type=int, default=300)
  parser.add_argument("--tokens", type=_human, default=3_200)
  parser.add_argument("--branching", type=int, default=32)
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--layout", choices=("tree", "balanced"), default="balanced",
                      help="row layout of the table on the parameter servers")
  parser.add_argument("--mode", choices=("loop", "fit"), default="loop",
                      help="loop: a custom training loop on a ClusterCoordinator (Keras 3 "
                      "optimizer); fit: tf_keras' model.fit with tf_hsm.tf_keras (the "
                      "losses reported are then the 2 epochs')")
  parser.add_argument("--single", action="store_true", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.single:
    _single(args)
    return 0
  cluster_result = _cluster(args)
  single = subprocess.run([sys.executable, "-m", "tf_hsm.cluster", "--single"] + argv,
                          capture_output=True, text=True, check=True)
  single_result = json.loads(single.stdout.strip().splitlines()[-1])
  print(report(args, cluster_result, single_result))
  return 0

