"""The machine the planner prices steps on: its measured rates (`Machine`), measured once
and cached per CPU, or given to plan for another machine.

Measuring needs TensorFlow and tf_hsm's op library, imported only then
(`Machine.measure`); everything else in `tf_hsm.planning` is NumPy.
"""

import dataclasses
import json
import math
import os
import re
import sys
import time

from tf_hsm.planning import tree_work


@dataclasses.dataclass
class Machine:
  """Rates used for step time: matmul FLOP/s, streaming read bytes/s, seconds per call,
  seconds per logit of TensorFlow's softmax cross-entropy (forward and backward: its
  exponentials and divisions, which the matmul and read rates do not bound; 0 for a
  machine given by its datasheet rates only), and `tree_step`: tf_hsm's training step
  fitted on this machine, seconds per each of TREE_STEP_TERMS (`tf_hsm.planning.step_fit`);
  None prices tf_hsm's rows with the roofline instead. `loop_step_seconds`: one
  iteration of a loop of small ops (`LOOP_PROBE`), the unit of the costs the roofline
  does not see in a model's body (`tf_hsm.planning.body`); None: the body's default.
  `sampled_logit_seconds`: seconds per logit of `tf.nn.sampled_softmax_loss`'s forward
  and backward beyond its matrix products (its sampler, biases, log Q, accidental hits,
  the joined true logit and the dense-label cross-entropy: ~7 ns a logit on 2 vCPUs,
  about three times the fused softmax's); None: `softmax_seconds`, as before it was
  measured.
  A `tree_step` of 6 coefficients (before slot bytes had their own) prices the slots at
  its bytes' rate (`tree_work.full_tree_step`)."""
  matmul_flops: float
  read_bytes: float
  call_seconds: float
  source: str = "given"
  softmax_seconds: float = 0.0
  tree_step: tuple = None
  loop_step_seconds: float = None
  sampled_logit_seconds: float = None

  def __post_init__(self):
    """Checks the rates (a negative or infinite one would price every row nonsense)."""
    self.tree_step = tree_work.full_tree_step(self.tree_step)
    if self.sampled_logit_seconds is None:
      self.sampled_logit_seconds = self.softmax_seconds
    for name in ("matmul_flops", "read_bytes"):
      _check_rate(name, getattr(self, name), positive=True)
    for name in ("call_seconds", "softmax_seconds", "sampled_logit_seconds",
                 "loop_step_seconds"):
      if name != "loop_step_seconds" or self.loop_step_seconds is not None:
        _check_rate(name, getattr(self, name), positive=False)
    for term, coefficient in zip(tree_work.TREE_STEP_TERMS, self.tree_step or ()):
      _check_rate(f"tree_step's {term!r} coefficient", coefficient, positive=False)

  @classmethod
  def measure(cls, progress=None):
    """Measures this machine (about 20 s): an output layer's float32 matmuls, a large
    reduction, an empty tf.function call, TensorFlow's softmax cross-entropy, the loop
    probe (`LOOP_PROBE`), and tf_hsm's training step (`tf_hsm.planning.step_fit`).
    `progress(text)`, if given, is called before each part."""
    progress = progress or (lambda text: None)
    progress("measuring this machine: importing TensorFlow")
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    progress("measuring this machine: matmul, read bandwidth, call overhead, softmax, "
             "a loop of small ops")

    def best(fn, repeats):
      fn()
      times = []
      for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
      return min(times)

    # The matmul rate of an output layer's three products (logits, and the gradients of
    # the table and of the hidden states), at a table larger than the caches: on 2 vCPUs
    # about half a square 1024 x 1024 product's rate.
    tokens, dim, rows = 640, 512, 32768
    h = tf.random.normal([tokens, dim])
    table = tf.random.normal([rows, dim])

    @tf.function
    def matmul():
      logits = tf.matmul(h, table, transpose_b=True)
      return (tf.matmul(logits, h, transpose_a=True)[:1, :1] +
              tf.matmul(logits, table)[:1, :1])

    seconds = best(lambda: matmul().numpy(), 3)
    matmul_flops = 6.0 * tokens * dim * rows / seconds
    big = tf.random.normal([64 << 20])  # 256 MiB
    read = tf.function(lambda: tf.reduce_sum(big))
    read_seconds = best(lambda: read().numpy(), 5)
    empty = tf.function(lambda: tf.constant(0))
    call = best(lambda: empty(), 50)
    logits = tf.random.normal([256, 32768])
    labels = tf.zeros([256], tf.int64)

    @tf.function
    def softmax():
      with tf.GradientTape() as tape:
        tape.watch(logits)
        loss = tf.reduce_sum(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=labels, logits=logits))
      return tape.gradient(loss, logits)[:1, :1]

    softmax_seconds = best(lambda: softmax().numpy(), 5) / (256 * 32768)
    sampled_seconds = best(_sampled_probe(tf), 5) / _SAMPLED_PROBE_LOGITS
    loop_step = best(_loop_probe(tf), 3) / LOOP_PROBE["iterations"]
    from tf_hsm.planning import step_fit  # pylint: disable=import-outside-toplevel
    return cls(matmul_flops, big.shape[0] * 4 / read_seconds, call, "measured",
               softmax_seconds, step_fit.measure(progress=progress), loop_step,
               sampled_seconds)

  @classmethod
  def cached(cls, path=None, refresh=False, name=None, progress=None):
    """This machine's rates from the cache file `path` (default:
    ~/.cache/tf_hsm/machine.json, or $XDG_CACHE_HOME/tf_hsm), under `name` (default
    `machine_name()`: the CPU model and count).

    Rates are measured only when the cache has none under `name` (the first run, or a
    cache written by an older tf_hsm without the fitted tree step, the loop probe,
    sampled softmax's rate or the slots' term of the tree step, or one whose values
    are not rates) or when `refresh` (`--remeasure`); either way `progress(text)` (default: a line on
    stderr) is told first, so a measurement is never taken silently, and the result is
    saved under `name` beside the other machines' entries. Otherwise the same cached figures every run: the planner's
    output is deterministic. Measure on a quiet machine: other jobs lower the rates.
    """
    progress = progress or _to_stderr  # a measurement (~20 s) is always announced
    path = path or cache_path()
    name = name or machine_name()
    entries = _read_cache(path)
    saved = entries.get(name)
    if saved is not None and not refresh:
      try:
        if len(saved["tree_step"]) != len(tree_work.TREE_STEP_TERMS):
          raise KeyError("tree_step")
        return cls(saved["matmul_flops"], saved["read_bytes"], saved["call_seconds"],
                   "cached", saved["softmax_seconds"], tuple(saved["tree_step"]),
                   saved["loop_step_seconds"], saved["sampled_logit_seconds"])
      except (KeyError, TypeError, ValueError):
        progress(f"the cached rates of {name!r} in {path} are incomplete (an older "
                 "tf_hsm) or not rates: measuring again")
    why = "--remeasure" if refresh else f"no rates cached for {name!r} in {path}"
    progress(f"measuring this machine ({why}; about 20 s, cached after)")
    machine = cls.measure(progress=progress)
    entries[name] = dict(dataclasses.asdict(machine),
                         measured_at=time.strftime("%Y-%m-%d %H:%M"))
    try:
      os.makedirs(os.path.dirname(path), exist_ok=True)
      with open(path, "w") as f:
        json.dump({"machines": entries}, f, indent=1)
    except OSError as error:
      progress(f"could not save the rates to {path}: {error}")
    return machine


def _check_rate(name, value, positive):
  """ValueError naming `name` unless `value` is a finite number > 0 (`positive`) or
  >= 0."""
  try:
    number = float(value)
  except (TypeError, ValueError):
    raise ValueError(f"Machine: {name} must be a number, got {value!r}") from None
  if not math.isfinite(number) or number < 0 or (positive and number == 0):
    raise ValueError(f"Machine: {name} must be a finite number "
                     f"{'> 0' if positive else '>= 0'}, got {value!r}")


# A recurrent layer's time step in miniature: a [8, 32] x [32, 128] product split into
# four gates and combined, in a tf.while_loop. Its FLOPs are negligible: an iteration
# costs the dispatch of its few small ops, as a body's recurrences, its layers' own ops
# and Keras' step do. Long (~0.1 s on a quiet core) so that other jobs' share of the CPU
# stretches it as it stretches a training step (a short probe runs between them).
LOOP_PROBE = {"iterations": 20_000, "rows": 8, "units": 32}


def _loop_probe(tf):
  """A function that runs LOOP_PROBE once (traced on the first call)."""
  rows, units = LOOP_PROBE["rows"], LOOP_PROBE["units"]
  start = tf.random.normal([rows, units])
  kernel = tf.random.normal([units, 4 * units]) * 0.1

  @tf.function
  def loop():
    def step(i, h):
      a, b, c, d = tf.split(tf.matmul(h, kernel), 4, axis=1)
      return i + 1, tf.sigmoid(a) * tf.tanh(b) + tf.sigmoid(c) * d
    return tf.while_loop(lambda i, h: i < LOOP_PROBE["iterations"], step,
                         (tf.constant(0), start))[1][:1, :1]

  return lambda: loop().numpy()


# TF's sampled softmax at a width where its products cost nothing: what is left is its
# cost per logit. The bench's construction of it (tf_hsm.bench.baselines) took 5.0-6.4 ns
# a logit (medians) at every shape tried from T=512 to 3,200, 256 to 4,096 samples and
# V=100K to 1M on 2 vCPUs; this probe, tf.nn.sampled_softmax_loss itself, 6.9-7.4.
_SAMPLED_PROBE = {"classes": 100_000, "dim": 8, "tokens": 1024, "sampled": 1024}
_SAMPLED_PROBE_LOGITS = _SAMPLED_PROBE["tokens"] * (_SAMPLED_PROBE["sampled"] + 1)


def _sampled_probe(tf):
  """A function that runs one forward and backward of `tf.nn.sampled_softmax_loss` at
  `_SAMPLED_PROBE`'s shape (traced on the first call)."""
  probe = _SAMPLED_PROBE
  weights = tf.random.normal([probe["classes"], probe["dim"]]) * 0.01
  biases = tf.zeros([probe["classes"]])
  hidden = tf.random.normal([probe["tokens"], probe["dim"]])
  labels = tf.random.uniform([probe["tokens"], 1], 0, probe["classes"], tf.int64)

  @tf.function
  def step():
    with tf.GradientTape() as tape:
      tape.watch([weights, biases, hidden])
      loss = tf.reduce_sum(tf.nn.sampled_softmax_loss(
          weights, biases, labels, hidden, probe["sampled"], probe["classes"], seed=7))
    grads = tape.gradient(loss, [weights, biases, hidden])
    return loss + tf.reduce_sum(grads[2][:1]) + tf.reduce_sum(grads[0].values[:1])

  return lambda: step().numpy()


def _to_stderr(text):
  sys.stderr.write(f"tf_hsm.planning: {text}\n")
  sys.stderr.flush()


def cache_path():
  """Where `Machine.cached` keeps the measured rates."""
  return os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")),
                      "tf_hsm", "machine.json")


def _read_cache(path):
  """{name: fields} of the cache file; a file of the older one-machine format (its
  fields and "cpu", the CPU key) reads as one entry under that key."""
  try:
    with open(path) as f:
      saved = json.load(f)
  except (OSError, ValueError):
    return {}
  if not isinstance(saved, dict):
    return {}
  if isinstance(saved.get("machines"), dict):
    return dict(saved["machines"])
  if "cpu" in saved:
    return {saved["cpu"]: saved}
  return {}


def machine_name():
  """The default key of this machine's cached rates: its CPU model and count (machines
  alike in both run at about the same rates; containers' host names change)."""
  return _cpu_key()


def _cpu_key():
  try:
    with open("/proc/cpuinfo") as f:
      model = re.search(r"model name\s*:\s*(.*)", f.read())
    return f"{model.group(1) if model else 'unknown'} x{os.cpu_count()}"
  except OSError:
    return f"unknown x{os.cpu_count()}"


def resolve(machine, progress=None):
  """`machine` as a `Machine`: a dict of its fields, or None for this machine's cached
  rates (measured now when there are none, telling `progress`).

  Raises:
    TypeError: if machine is neither.
  """
  if isinstance(machine, dict):
    machine = Machine(**machine)
  if machine is None:
    machine = Machine.cached(progress=progress)
  if not isinstance(machine, Machine):
    raise TypeError(f"machine must be a tf_hsm.planning.Machine or a dict of its fields, "
                    f"got {type(machine).__name__}")
  return machine
