"""TF side of the bench: a case's inputs, every method's timed functions, machine ceilings."""

import inspect
import time

import numpy as np
import tensorflow as tf

from tf_hsm.bench import cases
from tf_hsm.bench import baselines
from tf_hsm.ops import log_prob, nll_loss
from tf_hsm.tree import Tree

_LOG_PROB_FNS = {
    "tf_hsm": log_prob,
    "gather": baselines.gather_log_prob,
    "embedding_lookup": baselines.embedding_lookup_log_prob,
    "map_fn": baselines.map_fn_log_prob,
    "dense_tree": baselines.dense_tree_log_prob,
}


def force(outputs):
  """Waits for a function's results by reading every output tensor on the host (Python
  numbers, such as `train_on_batch`'s losses, are already there)."""
  for t in tf.nest.flatten(outputs, expand_composites=True):
    if hasattr(t, "numpy"):
      t.numpy()


def _first_row_sum(grad):
  """Sum of the first row of a dense or IndexedSlices gradient (0 when it has none)."""
  values = grad.values if isinstance(grad, tf.IndexedSlices) else grad
  return tf.reduce_sum(values[:1])


def timed_call(fn):
  start = time.perf_counter()
  force(fn())
  return time.perf_counter() - start


def mutates_table(method, spec):
  """cases.mutates_table for a worker's case spec."""
  return cases.mutates_table(method, spec["kind"], spec.get("optimizer", "none"))


class CaseInputs:
  """Hidden states, targets and the parameter tables of one case.

  Only the tables the methods need are created: the [S, D] slot table (+ biases) for the
  tree methods, the [V, D] class table for full/sampled softmax and dense top-k. Methods
  that only read a table share one; a method whose step updates its table gets its own:
  a sparse update (Keras SGD's scatter_sub of an IndexedSlices gradient, for one) switches
  a TF resource variable to copy-on-read, after which every plain read (the baselines')
  copies the whole table, which would then be charged to every method sharing it.
  """

  def __init__(self, spec, methods):
    needs_tree = any(m not in cases.CLASS_TABLE_METHODS for m in methods)
    self.tree = Tree.load(spec["tree_path"]) if needs_tree else None
    self.spec = spec
    v, d, t = spec["vocab"], spec["dim"], spec["tokens"]
    seed = spec["seed"]
    self.dtype = tf.as_dtype(spec.get("dtype", "float32"))
    self.targets = tf.constant(cases.zipf_targets(v, t, seed))
    self.hidden = tf.random.stateless_normal([t, d], seed=[seed, 1], dtype=self.dtype)
    self._tables = {}
    for m in methods:
      if m == cases.KERAS_STEP:
        self.keras_model = self._keras_model()
      else:
        self.tables(m)

  def tables(self, method):
    """(weights, biases) variables for `method`, created on first use."""
    spec = self.spec
    by_class = method in cases.CLASS_TABLE_METHODS
    key = (by_class, method if mutates_table(method, spec) else None)
    if key not in self._tables:
      rows = spec["vocab"] if by_class else self.tree.num_slots
      self._tables[key] = self._table(rows, spec["dim"], spec["seed"] + 2 + by_class,
                                      self.dtype)
    return self._tables[key]

  def _keras_model(self):
    """keras.Model([hidden, targets]) -> HierarchicalSoftmax log-probabilities, built here
    (its table with the other methods' tables, before the memory probe's baseline) and
    compiled by `Method`."""
    import keras  # pylint: disable=import-outside-toplevel
    from tf_hsm.keras.layers import HierarchicalSoftmax  # pylint: disable=import-outside-toplevel
    hidden = keras.Input((self.spec["dim"],), dtype=self.dtype.name, name="hidden")
    targets = keras.Input((), dtype="int64", name="targets")
    layer = HierarchicalSoftmax(self.tree, kernel_initializer=keras.initializers.RandomUniform(
        0.0, 1.0, seed=self.spec["seed"] + 2), dtype=self.dtype.name)
    return keras.Model([hidden, targets], layer(hidden, targets))

  @staticmethod
  def _table(rows, dim, seed, dtype):
    """[rows, dim] weights uniform in [0, 1) and zero biases, as variables of `dtype`.

    One random op straight into the variable: no temporaries of the table's size (scaling
    the values would hold three copies at once), and no sparse op, which would put the
    variable in copy-on-read mode.
    """
    weights = tf.Variable(tf.raw_ops.StatelessRandomUniform(
        shape=[rows, dim], seed=[seed, 0], dtype=dtype))
    biases = tf.Variable(tf.zeros([rows], dtype))
    return weights, biases


def fused_sgd_available():
  from tf_hsm import ops  # pylint: disable=import-outside-toplevel
  return hasattr(ops, "sgd_step")


def fused_adam_available():
  """Whether the loaded op library has the fused Adam step (one built before it has
  not)."""
  from tf_hsm.ops import loader  # pylint: disable=import-outside-toplevel
  return hasattr(loader.ops(), "hsm_adam_step")


def make_optimizer(name):
  """A Keras optimizer by name (None for "none"); lazy_adam, sparse_adagrad and
  sparse_sgd[_momentum] are tf_hsm.optimizers' row-sparse versions; the _momentum forms
  use momentum 0.9."""
  if name in (None, "none"):
    return None
  import keras  # pylint: disable=import-outside-toplevel
  from tf_hsm.keras import optimizers  # pylint: disable=import-outside-toplevel
  classes = {"sgd": keras.optimizers.SGD, "adagrad": keras.optimizers.Adagrad,
             "adam": keras.optimizers.Adam, "lazy_adam": optimizers.LazyAdam,
             "sparse_adagrad": optimizers.SparseAdagrad, "sparse_sgd": optimizers.SparseSGD}
  if name.endswith("_momentum"):
    return classes[name[:-len("_momentum")]](learning_rate=1e-3, momentum=0.9)
  return classes[name](learning_rate=1e-3)


def _top_k_op():
  """tf_hsm.inference.top_k, or None while that module does not exist."""
  try:
    from tf_hsm.ops import inference  # pylint: disable=import-outside-toplevel
  except ImportError:
    return None
  return getattr(inference, "top_k", None)


def top_k_available():
  return _top_k_op() is not None


def _top_k_call(op, h, w, b, tree, k):
  """Calls top_k asking for the number of expanded nodes when the API offers it."""
  params = inspect.signature(op).parameters
  for flag in ("return_num_expanded", "return_expanded", "return_stats", "with_stats"):
    if flag in params:
      return op(h, w, b, tree, k, **{flag: True})
  return op(h, w, b, tree, k)


class Method:
  """The timed functions of one method on one case.

  fwd: the forward (log-probs, loss, or top-k); step: forward + backward (+ the optimizer
  update), or None for inference methods. Both are callables without arguments:
  tf.functions, except the Keras step, which is `train_on_batch` as a user calls it.
  """

  def __init__(self, name, inputs, spec):
    self.name = name
    self.info = {}
    tree, y, h = inputs.tree, inputs.targets, inputs.hidden
    optimizer = cases.step_optimizer(spec["kind"], name, spec.get("optimizer", "none"))
    self.step = None
    if name in cases.TOPK_METHODS:
      self.fwd = self._top_k_fn(name, inputs, spec)
      return
    if name == cases.KERAS_STEP:
      self._keras_fns(inputs, optimizer)
      return
    w, b = inputs.tables(name)
    if name == cases.FUSED_SGD:
      from tf_hsm import ops  # pylint: disable=import-outside-toplevel
      self.fwd = tf.function(lambda: log_prob(h, w, b, tree, y))
      self.step = tf.function(lambda: ops.sgd_step(h, w, b, tree, y, 1e-3))
      return
    if name == cases.FUSED_ADAM:
      from tf_hsm.keras import adam_step  # pylint: disable=import-outside-toplevel
      self.optimizer = make_optimizer("lazy_adam")
      self.fwd = tf.function(lambda: log_prob(h, w, b, tree, y))
      self.step = tf.function(lambda: adam_step.adam_step(h, w, b, tree, y, self.optimizer))
      return
    if name == cases.NLL_LOSS:
      # Its forward is log_prob's; the timed step takes the loss's gradient.
      fwd = lambda: log_prob(h, w, b, tree, y)
      loss_fn = lambda: nll_loss(h, w, b, tree, y)
    elif name in _LOG_PROB_FNS:
      fn = _LOG_PROB_FNS[name]
      loss_fn = lambda: -tf.reduce_mean(fn(h, w, b, tree, y))
      fwd = lambda: fn(h, w, b, tree, y)
    elif name == "full_softmax":
      fwd = lambda: baselines.full_softmax_log_prob(h, w, b, y)
      loss_fn = lambda: -tf.reduce_mean(fwd())
    elif name == "sampled_softmax":
      num_sampled = spec["num_sampled"]
      fwd = lambda: baselines.sampled_softmax_loss(h, w, b, y, num_sampled, seed=7)
      loss_fn = lambda: tf.reduce_mean(fwd())
    else:
      raise ValueError(f"unknown method {name!r}")
    self.fwd = tf.function(fwd)
    opt = make_optimizer(optimizer)
    self.optimizer = opt

    @tf.function
    def step():
      with tf.GradientTape() as tape:
        tape.watch(h)
        loss = loss_fn()
      dh, dw, db = tape.gradient(loss, [h, w, b])
      if opt is None:
        # Every gradient is computed, but only a one-row checksum of each table gradient
        # leaves the function: copying a whole table gradient to the host would time the
        # copy, not the method.
        return loss, dh, _first_row_sum(dw), _first_row_sum(db)
      opt.apply_gradients([(dw, w), (db, b)])
      return loss, dh

    self.step = step

  def _keras_fns(self, inputs, optimizer):
    """The Keras model's call (fwd) and one `train_on_batch` (step) on the case's batch."""
    from tf_hsm.keras import losses  # pylint: disable=import-outside-toplevel
    model, h, y = inputs.keras_model, inputs.hidden, inputs.targets
    model.compile(optimizer=make_optimizer(optimizer), loss=losses.nll)
    self.optimizer = model.optimizer
    self.fwd = tf.function(lambda: model([h, y]))
    self.step = lambda: model.train_on_batch([h, y], y)

  def _top_k_fn(self, name, inputs, spec):
    h, k = inputs.hidden, spec.get("k", cases.TOPK_K)
    w, b = inputs.tables(name)
    if name == "dense_top_k":

      def dense():
        logits = tf.matmul(h, w, transpose_b=True) + b
        values, classes = tf.math.top_k(logits, k)
        return values - tf.reduce_logsumexp(logits, axis=-1, keepdims=True), classes

      return tf.function(dense)
    if name == cases.LOG_PROB_ALL:
      from tf_hsm.ops import inference  # pylint: disable=import-outside-toplevel
      tree = inputs.tree
      # One column leaves the function: copying [rows, C] to the host would time the copy.
      return tf.function(lambda: inference.log_prob_all(h, w, b, tree)[:, :1])
    op = _top_k_op()
    if op is None:
      raise NotImplementedError("tf_hsm.inference.top_k is not available")
    tree = inputs.tree
    fn = tf.function(lambda: _top_k_call(op, h, w, b, tree, k))
    outputs = fn()
    if isinstance(outputs, (tuple, list)) and len(outputs) >= 3:
      expanded = np.asarray(outputs[2].numpy(), np.float64)
      self.info["nodes_expanded_per_row"] = float(expanded.mean())
    return fn


def measure_ceilings(quick=False, repeats=None, max_bytes=None, dtype="float32"):
  """The machine's matmul rate (a large tf.matmul) and memory read bandwidth (a reduce over
  an array far larger than the caches), best of `repeats`, in this process.

  Args:
    quick: smaller sizes and fewer repeats.
    repeats: timed runs of each (default 5; quick 3).
    max_bytes: cap on the reduced array's size (it shares the process's memory limit).
    dtype: the element type of both (the case's --dtype).

  Returns:
    dict(matmul_gflops, read_gbps, matmul_n, read_mb).
  """
  repeats = repeats or (3 if quick else 5)
  n = 1024 if quick else 2048
  dtype = tf.as_dtype(dtype)
  a = tf.random.stateless_uniform([n, n], seed=[1, 2], dtype=dtype)
  b = tf.random.stateless_uniform([n, n], seed=[3, 4], dtype=dtype)
  matmul = tf.function(lambda: tf.matmul(a, b))
  size = dtype.size
  words = (64 if quick else 256) * 2**20 // size
  if max_bytes:
    words = int(max(2**22 // size, min(words, max_bytes // size)))
  # One buffer; random ops would hold temporaries as large.
  x = tf.fill([words], tf.constant(1.0, dtype))
  reduce = tf.function(lambda: tf.reduce_sum(x))
  force(matmul())
  force(reduce())
  t_mm = min(timed_call(matmul) for _ in range(repeats))
  t_rd = min(timed_call(reduce) for _ in range(repeats))
  return {"matmul_gflops": 2 * n**3 / t_mm / 1e9, "read_gbps": size * words / t_rd / 1e9,
          "matmul_n": n, "read_mb": size * words / 2**20}
