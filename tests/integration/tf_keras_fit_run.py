"""tf_keras `model.fit` training a tf_hsm.tf_keras.HierarchicalSoftmax on a cluster, run
by test_tf_keras_fit.py in processes of their own that it bounds in time.

    tf_keras_fit_run.py ps        # 2 PS + 2 workers on 127.0.0.1 (LoopbackCluster)
    tf_keras_fit_run.py single    # the same models and steps in one process
    tf_keras_fit_run.py resume N  # LazyAdam's fit resumed from the backup `ps` made,
                                  # on N PS + 1 worker (N = 0: in one process); on
                                  # N PS also the AdaptiveSoftmax model's fit
    tf_keras_fit_run.py mirrored  # MirroredStrategy over 2 CPU devices, and one device
                                  # (HierarchicalSoftmax, AdaptiveSoftmax, the mixture)
    tf_keras_fit_run.py mwms I PORTS  # worker I of a 2-worker MultiWorkerMirroredStrategy
                                      # (HierarchicalSoftmax, AdaptiveSoftmax, the mixture)

Each prints one JSON line. The model: features -> Dense -> HierarchicalSoftmax (a
balanced row layout over 2 shards) trained on one fixed batch repeated, so that the
steps of asynchronous workers see the same data in any order. `ps` (first, on both
workers) and `single` also train, the same way, features -> Dense -> AdaptiveSoftmax
(two-level tails, a class order leaving id 0 out) with LazyAdam (`fit_adaptive`);
and features -> Dense -> HierarchicalSoftmaxMixture (two trees below a shared head) with
LazyAdam (`fit_mixture`; `resume N` too).

With TF_HSM_BACKUP set, `ps` then trains the same model with LazyAdam for
ADAM_EPOCHS epochs under tf_keras' `BackupAndRestore` (a checkpoint of the model and
the optimizer, the table and the slots in 2 pieces, at the end of each epoch), and
`resume N` continues that training to 2 x ADAM_EPOCHS epochs from the backup, its table
and slots in N pieces (the row layout stays the layer's, made for 2 shards: it is part
of the layer's config), reporting the values it restored.
"""

import contextlib

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import tf_keras  # noqa: E402

import tf_hsm  # noqa: E402
from tf_hsm import distribute  # noqa: E402
from tf_hsm import tf_keras as hk  # noqa: E402

V, F, D, B = 300, 16, 8, 64
EPOCHS, STEPS = 4, 8
LR = 0.05
ADAM_EPOCHS, ADAM_LR = 2, 0.01
# The AdaptiveSoftmax model: hidden width, cutoffs (head of 20 classes, clusters of 80
# and 199: id 0 is left out by the class order), div_value, LazyAdam's epochs and rate.
AD, CUTOFFS, DIV = 16, [20, 100], 2.0
ADAPTIVE_EPOCHS, ADAPTIVE_LR = 3, 0.01


def problem():
  counts = 1.0 / np.arange(1, V + 1)
  tree = tf_hsm.Tree.huffman(counts, branching=4)
  rng = np.random.default_rng(0)
  targets = rng.choice(V, B, p=counts / counts.sum()).astype(np.int32)
  centers = rng.normal(size=(V, F)).astype(np.float32)
  features = centers[targets] + 0.1 * rng.normal(size=(B, F)).astype(np.float32)
  layout = distribute.balanced_layout(tree, 2, B, counts=counts)
  return tree, layout, features, targets


def make_model(tree, layout, optimizer=None):
  """The model, with the same initial weights whatever the strategy (set after it is
  built: a partitioned table draws its initial pieces differently)."""
  features = tf_keras.Input((F,))
  targets = tf_keras.Input((), dtype="int32")
  dense = tf_keras.layers.Dense(D)
  output = hk.HierarchicalSoftmax(tree, row_layout=layout, name="hsm")
  model = tf_keras.Model([features, targets], output(dense(features), targets))
  rng = np.random.default_rng(1)
  dense.kernel.assign(rng.normal(size=(F, D)).astype(np.float32) * 0.3)
  output.kernel.assign(layout.stored(
      rng.normal(size=(tree.num_slots, D)).astype(np.float32) * 0.1))
  model.compile(optimizer=optimizer or hk.optimizers.SparseSGD(LR), loss=hk.losses.nll)
  return model


def weights(model):
  """The model's weights, whole (pieces joined), the layer's in slot order."""
  layer = model.get_layer("hsm")
  dense = model.layers[1]
  out = {}
  for name, variable in (("kernel", layer.kernel), ("bias", layer.bias),
                         ("dense_kernel", dense.kernel), ("dense_bias", dense.bias)):
    parts = distribute.pieces(variable)
    value = np.concatenate([p.numpy() for p in parts]) if parts else variable.numpy()
    if not name.startswith("dense") and layer.row_layout:
      value = value[layer.row_layout.slot_rows]
    out[name] = value.tolist()
  return out


def slots(model):
  """LazyAdam's slots of the model's weights, whole and in slot order: {"m": {name:
  value}, "v": ...} for the layer's kernel and bias and the Dense layer's kernel."""
  optimizer = model.optimizer
  layer = model.get_layer("hsm")
  dense = model.layers[1]
  out = {}
  for slot, values in (("m", optimizer._momentums), ("v", optimizer._velocities)):
    out[slot] = {}
    for name, variable in (("kernel", layer.kernel), ("bias", layer.bias),
                           ("dense", dense.kernel)):
      parts = distribute.pieces(variable) or [variable]
      value = np.concatenate(
          [values[optimizer._index_dict[optimizer._var_key(p)]].numpy() for p in parts])
      if name != "dense" and layer.row_layout:
        value = value[layer.row_layout.slot_rows]
      out[slot][name] = value.tolist()
  return out


class SlotInitialValues:
  """A variable creator that notes, for each optimizer slot made under it, where its
  initial value was computed and where the slot was placed: [name, the value's device,
  the slot's device]. A tensor made where the optimizer is built (the coordinator, under
  a ParameterServerStrategy) shows the coordinator's device."""

  def __init__(self):
    self.seen = []

  def __call__(self, next_creator, **kwargs):
    name = str(kwargs.get("name"))
    if not name.startswith(("m/", "v/")):
      return next_creator(**kwargs)
    record = [name, None, None]
    initial_value = kwargs.get("initial_value")
    if callable(initial_value):
      def computed(*args, **inner):
        value = initial_value(*args, **inner)
        record[1] = value.device
        return value
      kwargs["initial_value"] = computed
    else:
      record[1] = getattr(initial_value, "device", None)
    variable = next_creator(**kwargs)
    record[2] = variable.device
    self.seen.append(record)
    return variable


class Snapshot(tf_keras.callbacks.Callback):
  """Notes, when training begins (after BackupAndRestore restored its backup), the
  weights, LazyAdam's slots and the iteration count."""

  def __init__(self):
    super().__init__()
    self.values = None

  def on_train_begin(self, logs=None):
    self.values = {"weights": weights(self.model), "slots": slots(self.model),
                   "iterations": int(self.model.optimizer.iterations.numpy())}


def fit_with_backup(strategy, tree, layout, features, targets, backup, epochs):
  """LazyAdam's fit of the model under BackupAndRestore(backup) up to `epochs`: resumes
  from the backup when there is one. Returns the losses, the values when training began
  and when it ended, and how the slots' initial values were given."""
  def scope():
    return strategy.scope() if strategy else contextlib.nullcontext()

  with scope():
    model = make_model(tree, layout, hk.optimizers.LazyAdam(ADAM_LR))
  if strategy:
    data = tf_keras.utils.experimental.DatasetCreator(dataset_fn(features, targets))
  else:
    data = dataset_fn(features, targets)()
  snapshot = Snapshot()
  initial_values = SlotInitialValues()
  with scope(), tf.variable_creator_scope(initial_values):
    history = model.fit(data, epochs=epochs, steps_per_epoch=STEPS, verbose=0,
                        callbacks=[tf_keras.callbacks.BackupAndRestore(
                            backup, delete_checkpoint=False), snapshot])
  return {"losses": history.history["loss"], "begin": snapshot.values,
          "end": {"weights": weights(model), "slots": slots(model),
                  "iterations": int(model.optimizer.iterations.numpy())},
          "slot_initial_values": initial_values.seen,
          "table_pieces": [p.device for p in distribute.pieces(
              model.get_layer("hsm").kernel) or []]}


def dataset_fn(features, targets):
  def fn(input_context=None):
    del input_context
    data = tf.data.Dataset.from_tensors(((features, targets), targets))
    return data.repeat()
  return fn


def recording(base):
  """The tf_hsm.tf_keras optimizer class `base`, noting in its class attribute `seen`,
  while tracing, the gradient each variable receives: (name, gradient type, device,
  shape)."""

  class Recorded(base):
    seen = []

    def update_step(self, gradient, variable):
      type(self).seen.append((variable.name, type(gradient).__name__, variable.device,
                              [int(d) for d in variable.shape]))
      return super().update_step(gradient, variable)

  return Recorded


Recording = recording(hk.optimizers.SparseSGD)
RecordingAdam = recording(hk.optimizers.LazyAdam)
SeenSGD = recording(hk.optimizers.SparseSGD)


def adaptive_problem():
  """Counts by id with counts[0] = 0 (id 0 is padding: the class order leaves it out),
  one fixed batch of targets drawn from them, and features near a centre per id."""
  counts = 1.0 / np.arange(1, V + 1)
  counts[0] = 0.0
  order = hk.AdaptiveSoftmax.frequency_order(counts)
  rng = np.random.default_rng(2)
  targets = rng.choice(V, B, p=counts / counts.sum()).astype(np.int32)
  centers = rng.normal(size=(V, F)).astype(np.float32)
  features = centers[targets] + 0.1 * rng.normal(size=(B, F)).astype(np.float32)
  return counts, order, features, targets


ADAPTIVE_TABLES = ("head_kernel", "tail_projection_0", "tail_kernel_0", "tail_bias_0",
                   "tail_projection_1", "tail_kernel_1", "tail_bias_1")


def adaptive_tables(layer):
  return dict(zip(ADAPTIVE_TABLES, (
      layer.head_kernel, layer.tail_projections[0], layer.tail_kernels[0],
      layer.tail_biases[0], layer.tail_projections[1], layer.tail_kernels[1],
      layer.tail_biases[1])))


def make_adaptive_model(counts, order, optimizer):
  """features -> Dense(AD) -> AdaptiveSoftmax(two-level tails, class_order), with the
  same initial weights whatever the strategy (set after it is built)."""
  features = tf_keras.Input((F,))
  targets = tf_keras.Input((), dtype="int32")
  dense = tf_keras.layers.Dense(AD, name="adaptive_dense")
  output = hk.AdaptiveSoftmax(V, CUTOFFS, div_value=DIV, tail="two_level", counts=counts,
                              class_order=order, name="adaptive")
  model = tf_keras.Model([features, targets], output(dense(features), targets))
  rng = np.random.default_rng(3)
  dense.kernel.assign(rng.normal(size=(F, AD)).astype(np.float32) * 0.3)
  for name, variable in adaptive_tables(output).items():
    scale = 0.0 if name.startswith("tail_bias") else 0.3
    variable.assign(rng.normal(size=variable.shape).astype(np.float32) * scale)
  model.compile(optimizer=optimizer, loss=hk.losses.nll)
  return model


def adaptive_weights(model):
  """The adaptive model's weights, whole (pieces joined)."""
  layer = model.get_layer("adaptive")
  dense = model.get_layer("adaptive_dense")
  out = {}
  for name, variable in dict(adaptive_tables(layer), dense_kernel=dense.kernel,
                             dense_bias=dense.bias).items():
    parts = distribute.pieces(variable)
    value = np.concatenate([p.numpy() for p in parts]) if parts else variable.numpy()
    out[name] = value.tolist()
  return out


def fit_adaptive(strategy):
  """The adaptive model trained by LazyAdam for ADAPTIVE_EPOCHS x STEPS steps on one
  fixed batch: under `strategy` (a DatasetCreator), or in one process (None)."""
  counts, order, features, targets = adaptive_problem()
  scope = strategy.scope() if strategy else contextlib.nullcontext()
  with scope:
    model = make_adaptive_model(counts, order, RecordingAdam(ADAPTIVE_LR))
  layer = model.get_layer("adaptive")
  result = {"initial": adaptive_weights(model)}
  if strategy:
    data = tf_keras.utils.experimental.DatasetCreator(dataset_fn(features, targets))
    history = model.fit(data, epochs=ADAPTIVE_EPOCHS, steps_per_epoch=STEPS, verbose=0)
  else:
    data = tf.data.Dataset.from_tensors(((features, targets), targets))
    history = model.fit(data.repeat(ADAPTIVE_EPOCHS * STEPS), epochs=ADAPTIVE_EPOCHS,
                        steps_per_epoch=STEPS, verbose=0)
  result["losses"] = history.history["loss"]
  result["final"] = adaptive_weights(model)
  result["iterations"] = int(model.optimizer.iterations.numpy())
  result["updates"] = list(RecordingAdam.seen)
  result["pieces"] = {name: [(p.device, [int(d) for d in p.shape])
                             for p in distribute.pieces(variable) or []]
                      for name, variable in adaptive_tables(layer).items()}
  # The rows of each two-level tail (a tree over its cluster) that the batch's paths
  # touch in each half of its table: what each piece sends and has updated a step.
  ranks = layer.class_order.rank_of_id[targets]
  result["tail_rows"] = []
  for i, (lo, hi) in enumerate(layer.cluster_ranges):
    local = ranks[(ranks >= lo) & (ranks < hi)] - lo
    result["tail_rows"].append(
        distribute.rows_per_shard(layer.tail_trees[i], local, 2).tolist())
  return result


MIXTURE_HEAD, MIXTURE_EPOCHS, MIXTURE_LR = 20, 3, 0.01


def make_mixture_model(optimizer):
  """features -> Dense(D) -> HierarchicalSoftmaxMixture (Huffman trees of 4 and 8 over
  the classes below a shared head of the 20 most frequent), with the same initial
  weights whatever the strategy (set after it is built). Returns (model, its tables by
  name)."""
  counts = 1.0 / np.arange(1, V + 1)
  trees = [tf_hsm.Tree.huffman(counts[MIXTURE_HEAD:], branching=b) for b in (4, 8)]
  features = tf_keras.Input((F,))
  targets = tf_keras.Input((), dtype="int32")
  dense = tf_keras.layers.Dense(D, name="mixture_dense")
  output = hk.HierarchicalSoftmaxMixture(trees, head=np.arange(MIXTURE_HEAD), name="mixture")
  model = tf_keras.Model([features, targets], output(dense(features), targets))
  tables = {"head_kernel": output.head.kernel, "head_bias": output.head.bias,
            "gate_kernel": output.gate_kernel, "gate_bias": output.gate_bias,
            "dense_kernel": dense.kernel}
  for i, component in enumerate(output.components):
    tables[f"tree_{i}_kernel"], tables[f"tree_{i}_bias"] = component.kernel, component.bias
  rng = np.random.default_rng(4)
  for name, variable in tables.items():
    variable.assign(rng.normal(size=variable.shape).astype(np.float32) * 0.3)
  model.compile(optimizer=optimizer, loss=hk.losses.nll)
  return model, tables


def fit_mixture(strategy):
  """The mixture model trained by LazyAdam for MIXTURE_EPOCHS x STEPS steps on one fixed
  batch (`problem()`'s), under `strategy` (a DatasetCreator) or in one process (None):
  losses, initial and final tables (whole), and the tables' pieces."""
  _, _, features, targets = problem()
  scope = strategy.scope() if strategy else contextlib.nullcontext()
  RecordingAdam.seen.clear()
  with scope:
    model, tables = make_mixture_model(RecordingAdam(MIXTURE_LR))

  def whole():
    return {name: np.concatenate([p.numpy() for p in distribute.pieces(v)]).tolist()
            if distribute.pieces(v) else v.numpy().tolist() for name, v in tables.items()}

  result = {"initial": whole()}
  if strategy:
    data = tf_keras.utils.experimental.DatasetCreator(dataset_fn(features, targets))
  else:
    data = dataset_fn(features, targets)()
  history = model.fit(data, epochs=MIXTURE_EPOCHS, steps_per_epoch=STEPS, verbose=0)
  result.update(losses=history.history["loss"], final=whole(),
                iterations=int(model.optimizer.iterations.numpy()),
                updates=[u for u in RecordingAdam.seen if u[0].startswith("mixture/")],
                pieces={name: [p.device for p in distribute.pieces(v) or []]
                        for name, v in tables.items()})
  return result


def run_ps():
  from tf_hsm.cluster import LoopbackCluster  # pylint: disable=import-outside-toplevel
  tree, layout, features, targets = problem()
  result = {}
  with LoopbackCluster(2, 2) as cluster:
    strategy = tf.distribute.experimental.ParameterServerStrategy(
        cluster.resolver(),
        variable_partitioner=tf.distribute.experimental.partitioners.FixedShardsPartitioner(
            2))
    # The AdaptiveSoftmax model and the mixture first, while both workers run.
    result["adaptive"] = fit_adaptive(strategy)
    result["mixture"] = fit_mixture(strategy)
    with strategy.scope():
      model = make_model(tree, layout, Recording(LR))
    layer = model.get_layer("hsm")
    result["table_pieces"] = [p.device for p in distribute.pieces(layer.kernel)]
    result["trainable"] = [(v.name, v.device) for v in model.trainable_variables]
    initial = weights(model)
    data = tf_keras.utils.experimental.DatasetCreator(dataset_fn(features, targets))

    class KillWorker(tf_keras.callbacks.Callback):
      def on_epoch_end(self, epoch, logs=None):
        if epoch == 1 and os.environ.get("TF_HSM_KILL_WORKER"):
          cluster.kill("worker", 1)

    history = model.fit(data, epochs=EPOCHS, steps_per_epoch=STEPS, verbose=0,
                        callbacks=[KillWorker()])
    result["losses"] = history.history["loss"]
    result["updates"] = Recording.seen
    result["initial"] = initial
    result["final"] = weights(model)
    result["iterations"] = int(model.optimizer.iterations.numpy())
    # A checkpoint of the table in 2 pieces, restored by `single --restore`.
    path = os.environ.get("TF_HSM_CKPT")
    if path:
      tf.train.Checkpoint(model=model).write(path)
    # LazyAdam under BackupAndRestore, restored by `resume N`, on the same cluster
    # (worker 1 stays dead: the other worker runs it).
    backup = os.environ.get("TF_HSM_BACKUP")
    if backup:
      result["adam"] = fit_with_backup(strategy, tree, layout, features, targets, backup,
                                       ADAM_EPOCHS)
  result["rows_per_shard"] = distribute.rows_per_shard(tree, targets, 2, layout).tolist()
  result["rows_per_shard_tree_order"] = distribute.rows_per_shard(tree, targets, 2).tolist()
  result["num_slots"] = tree.num_slots
  print(json.dumps(result))


def run_single(steps, restore=None):
  tree, layout, features, targets = problem()
  model = make_model(tree, layout)
  result = {"initial": weights(model)}
  if restore:
    tf.train.Checkpoint(model=model).read(restore).expect_partial()
    result["restored"] = weights(model)
    print(json.dumps(result))
    return
  data = tf.data.Dataset.from_tensors(((features, targets), targets)).repeat(steps)
  history = model.fit(data, epochs=1, verbose=0)
  result["losses"] = history.history["loss"]
  result["final"] = weights(model)
  result["adaptive"] = fit_adaptive(None)
  result["mixture"] = fit_mixture(None)
  print(json.dumps(result))


def run_resume(num_ps, backup):
  """Resumes the LazyAdam training that `ps` backed up (2 pieces) with the table and
  slots in `num_ps` pieces on num_ps parameter servers and 1 worker, or in one process
  (num_ps = 0)."""
  from tf_hsm.cluster import LoopbackCluster  # pylint: disable=import-outside-toplevel
  tree, layout, features, targets = problem()
  if num_ps == 0:
    result = fit_with_backup(None, tree, layout, features, targets, backup,
                             2 * ADAM_EPOCHS)
  else:
    with LoopbackCluster(num_ps, 1) as cluster:
      strategy = tf.distribute.experimental.ParameterServerStrategy(
          cluster.resolver(),
          variable_partitioner=tf.distribute.experimental.partitioners
          .FixedShardsPartitioner(num_ps))
      result = fit_with_backup(strategy, tree, layout, features, targets, backup,
                               2 * ADAM_EPOCHS)
      # The AdaptiveSoftmax model with its tables in num_ps pieces and one worker, which
      # runs the steps in order (no concurrent updates): what `single` computes.
      result["adaptive"] = fit_adaptive(strategy)
      result["mixture"] = fit_mixture(strategy)  # likewise
  print(json.dumps(result))


def _mirrored_problem():
  tree, layout, features, targets = problem()
  data = tf.data.Dataset.from_tensor_slices(((features, targets), targets)).batch(B)
  return tree, layout, data.repeat(STEPS)


def _fit_under(strategy, tree, layout, data):
  with strategy.scope():
    model = make_model(tree, layout, SeenSGD(LR))
  model.fit(data, epochs=1, verbose=0)
  return weights(model)


def _fit_adaptive_under(strategy, options=None):
  """The adaptive model trained by SparseSGD for STEPS steps of one fixed batch (split
  over the replicas under a MirroredStrategy, or over the workers with `options`'
  sharding): its whole weights."""
  counts, order, features, targets = adaptive_problem()
  with strategy.scope():
    model = make_adaptive_model(counts, order, SeenSGD(LR))
  data = tf.data.Dataset.from_tensor_slices(((features, targets), targets)).batch(B)
  data = data.repeat(STEPS)
  model.fit(data if options is None else data.with_options(options), epochs=1, verbose=0)
  return adaptive_weights(model)


def _fit_mixture_under(strategy, options=None):
  """The mixture model trained by SparseSGD for STEPS steps of one fixed batch (split
  over the replicas, or over the workers with `options`' sharding): its whole tables."""
  _, _, features, targets = problem()
  with strategy.scope():
    model, tables = make_mixture_model(SeenSGD(LR))
  data = tf.data.Dataset.from_tensor_slices(((features, targets), targets)).batch(B)
  data = data.repeat(STEPS)
  model.fit(data if options is None else data.with_options(options), epochs=1, verbose=0)
  return {name: v.numpy().tolist() for name, v in tables.items()}


def run_mirrored():
  cpu = tf.config.list_physical_devices("CPU")[0]
  tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
  tree, layout, data = _mirrored_problem()
  one = _fit_under(tf.distribute.get_strategy(), tree, layout, data)
  SeenSGD.seen.clear()
  mirrored = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
  two = _fit_under(mirrored, tree, layout, data)
  seen = list(SeenSGD.seen)
  adaptive_one = _fit_adaptive_under(tf.distribute.get_strategy())
  SeenSGD.seen.clear()
  adaptive_two = _fit_adaptive_under(mirrored)
  adaptive_seen = list(SeenSGD.seen)
  mixture_one = _fit_mixture_under(tf.distribute.get_strategy())
  SeenSGD.seen.clear()
  mixture_two = _fit_mixture_under(mirrored)
  print(json.dumps({"one": one, "two": two, "seen": seen, "adaptive_one": adaptive_one,
                    "adaptive_two": adaptive_two, "adaptive_seen": adaptive_seen,
                    "mixture_one": mixture_one, "mixture_two": mixture_two,
                    "mixture_seen": SeenSGD.seen}))


def run_mwms(index, ports):
  ports = ports.split(",")
  os.environ["TF_CONFIG"] = json.dumps({
      "cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]},
      "task": {"type": "worker", "index": int(index)}})
  strategy = tf.distribute.MultiWorkerMirroredStrategy()
  tree, layout, data = _mirrored_problem()
  options = tf.data.Options()
  options.experimental_distribute.auto_shard_policy = \
      tf.data.experimental.AutoShardPolicy.DATA
  result = _fit_under(strategy, tree, layout, data.with_options(options))
  seen = list(SeenSGD.seen)
  SeenSGD.seen.clear()
  adaptive = _fit_adaptive_under(strategy, options)
  adaptive_seen = list(SeenSGD.seen)
  SeenSGD.seen.clear()
  mixture = _fit_mixture_under(strategy, options)
  print(json.dumps({"weights": result, "seen": seen, "adaptive": adaptive,
                    "adaptive_seen": adaptive_seen, "mixture": mixture,
                    "mixture_seen": SeenSGD.seen}))


if __name__ == "__main__":
  mode = sys.argv[1]
  if mode == "ps":
    run_ps()
  elif mode == "single":
    run_single(int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else None)
  elif mode == "resume":
    run_resume(int(sys.argv[2]), sys.argv[3])
  elif mode == "mirrored":
    run_mirrored()
  else:
    run_mwms(sys.argv[2], sys.argv[3])
