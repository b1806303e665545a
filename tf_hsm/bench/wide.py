"""Wide nodes at matrix-multiply speed: the exact softmax as a one-node tree
(`Tree.flat`), a node's rate against the machine's matmul rate, heads of frequent
classes, and a training step's memory at a million classes.

    python -m tf_hsm.bench.wide [--parts flat,rate,head,inference,memory] [--rounds 7]
        [--heads 32:1024,32:256,64:256,32:0] [--parts mixture --mixtures 32:256,3x16+128]
        [--parts width]

- flat: `nll_loss` forward and backward on `Tree.flat(V)` (V=100K, D=256, T=1,024)
  interleaved with TensorFlow's `matmul` + `sparse_softmax_cross_entropy_with_logits`
  and its gradient (hidden, table, biases): medians and their ratio.
- rate: the same step on a one-node tree of 4,096 children visited by 256 tokens
  (D=512), its 8 T K D operations a step (the forward's logits, and the gradient's
  logits again, hidden and table gradients) over the median, against the planner's
  matmul rate (`tf_hsm.planning.Machine.measure`) measured in the same process.
- head: at V=1M, D=300, T=3,200, Zipf(1) targets, `Tree.from_vectors` trees (16-dim
  Gaussian vectors: the shape a rebuild gives, mass-balanced, not trained similarity)
  of `HEAD_TREES` (32-ary with heads of 1,024, 256 and no frequent classes, 64-ary
  with 256; `--heads BRANCHING:HEAD,...` for others), and TF's `sampled_softmax_loss`
  (1,024 samples), interleaved.
- inference: on `Tree.flat(V)` (V=100K, D=256, 1,024 rows) `log_prob_all` and `top_k`
  (k=10) interleaved with TF's `log_softmax(matmul + b)` and `top_k(matmul + b)`, each
  output read back to NumPy (a 410 MB [rows x V] array for `log_prob_all` and TF's
  log-softmax alike).
- mixture (not among the default parts): at the head part's sizes,
  `HierarchicalSoftmaxMixture` of trees from vectors (the first as the head part's, the
  others of other vectors) of each `--mixtures` shape ([TREESx]BRANCHING:HEAD, two trees
  by default, each with its head; [TREESx]BRANCHING+HEAD[/DIM], the trees over the
  classes below one shared head of the HEAD most frequent, DIM wide if given; default
  32:256, 16:128 and 3x16+128),
  one tree of the first shape, and TF's sampled softmax, interleaved; for a shared head
  also its parts alone (the head over every token, one tree over the tail's tokens) and
  the rest of the mixture's step past them (the gathers, the gate, the mixing). It and
  the trained part refuse, before building anything, mixtures whose tables alone
  (`tables_bytes`) exceed the memory available.
- width (not among the default parts): a 16-ary tree from vectors over the 999,872
  classes below a head of 128 at V=1M, on 1,985 targets (the tail's share of T=3,200),
  forward, and forward and backward, at D=300, 150, 75 and 16, interleaved, and the
  line a + b D through the steps.
- memory: a process of its own per case (V=1M, D=300, T=3,200 and V=10M, D=300, T=256):
  VmHWM after set-up (table, batch, the op library loaded), then the growth of the peak
  over one step of `sgd_step`, and of `nll_loss` with its gradient (at V=1M only: two
  12 GB tables do not fit this project's 23 GiB machines).
"""

import argparse
import collections
import json
import re
import statistics
import subprocess
import sys
import time

import numpy as np
import tensorflow as tf

import tf_hsm
from tf_hsm.bench import cases
from tf_hsm.bench.watchdog import GB, mem_available_bytes
from tf_hsm.bench.worker import reset_peak_rss, status_bytes
from tf_hsm.planning import Machine


def _problem(rng, num_classes, dim, tokens, drawn_in_place=False):
  """hidden, table, biases, targets; with drawn_in_place the table is `_drawn_table`'s
  (no second copy while it is made, but a variable of unknown row count, which TF's
  sampled softmax refuses)."""
  hidden = tf.constant(rng.normal(size=(tokens, dim)).astype(np.float32) * 0.1)
  targets = tf.constant(cases.zipf_targets(num_classes, tokens, rng))
  table = (_drawn_table(num_classes, dim) if drawn_in_place else
           tf.Variable(tf.random.normal([num_classes, dim], stddev=0.01, seed=1)))
  return hidden, table, tf.Variable(tf.zeros([num_classes])), targets


def _drawn_table(num_classes, dim):
  """A [num_classes, dim] float32 variable drawn by TensorFlow inside a function, whose
  draw the assignment takes over without a copy: at V=10M the table is 12 GB, and drawn
  eagerly it is held twice (the draw and the variable's copy) while it is made."""
  table = tf.Variable(tf.zeros([0, dim]), shape=tf.TensorShape([None, dim]))

  @tf.function
  def draw():
    table.assign(tf.random.normal([num_classes, dim], stddev=0.01, seed=1))

  draw()
  return table




def _hsm_step(tree, hidden, table, biases, targets):
  @tf.function
  def step():
    with tf.GradientTape() as tape:
      tape.watch(hidden)
      loss = tf.reduce_mean(tf_hsm.nll_loss(hidden, table, biases, tree, targets))
    grads = tape.gradient(loss, [hidden, table, biases])
    return loss, grads[0], grads[1].values[:1, :1]  # the IndexedSlices as they are
  return step


def _dense_step(hidden, table, biases, targets):
  @tf.function
  def step():
    with tf.GradientTape() as tape:
      tape.watch(hidden)
      logits = tf.matmul(hidden, table, transpose_b=True) + biases
      loss = tf.reduce_mean(
          tf.nn.sparse_softmax_cross_entropy_with_logits(targets, logits))
    grads = tape.gradient(loss, [hidden, table, biases])
    return loss, grads[0], tf.convert_to_tensor(grads[1])[:1, :1]
  return step


def interleaved(methods, rounds):
  """{name: median seconds}: every method once a round, after one warm-up call each."""
  for fn in methods.values():
    [t.numpy() for t in fn()]
  times = {name: [] for name in methods}
  for _ in range(rounds):
    for name, fn in methods.items():
      start = time.perf_counter()
      [t.numpy() for t in fn()]
      times[name].append(time.perf_counter() - start)
  return {name: statistics.median(v) for name, v in times.items()}


def flat_part(rng, rounds):
  hidden, table, biases, targets = _problem(rng, 100_000, 256, 1024)
  tree = tf_hsm.Tree.flat(100_000)
  med = interleaved({"tf_hsm Tree.flat": _hsm_step(tree, hidden, table, biases, targets),
                     "TF matmul + softmax xent": _dense_step(hidden, table, biases, targets)},
                    rounds)
  ratio = med["TF matmul + softmax xent"] / med["tf_hsm Tree.flat"]
  return {"case": "V=100K D=256 T=1024", "ms": _ms(med), "speed vs TF": round(ratio, 3)}


def inference_part(rng, rounds):
  hidden, table, biases, _ = _problem(rng, 100_000, 256, 1024)
  tree = tf_hsm.Tree.flat(100_000)
  logits = lambda: tf.matmul(hidden, table, transpose_b=True) + biases  # noqa: E731
  med = interleaved({
      "tf_hsm log_prob_all": tf.function(
          lambda: [tf_hsm.log_prob_all(hidden, table, biases, tree)]),
      "TF log_softmax(matmul)": tf.function(lambda: [tf.nn.log_softmax(logits())]),
      "tf_hsm top_k": tf.function(lambda: list(tf_hsm.top_k(hidden, table, biases, tree, 10))),
      "TF top_k(matmul)": tf.function(lambda: list(tf.math.top_k(logits(), 10))),
  }, rounds)
  return {"case": "V=100K D=256 rows=1024", "ms": _ms(med),
          "log_prob_all speed vs TF": round(
              med["TF log_softmax(matmul)"] / med["tf_hsm log_prob_all"], 3),
          "top_k speed vs TF": round(med["TF top_k(matmul)"] / med["tf_hsm top_k"], 3)}


def rate_part(rng, rounds):
  width, dim, tokens = 4096, 512, 256
  machine = Machine.measure()
  hidden, table, biases, targets = _problem(rng, width, dim, tokens)
  step = _hsm_step(tf_hsm.Tree.flat(width), hidden, table, biases, targets)
  med = interleaved({"wide node": step}, rounds)["wide node"]
  rate = 8.0 * tokens * width * dim / med
  return {"case": f"K={width} T={tokens} D={dim}", "ms": round(med * 1e3, 2),
          "GFLOP/s": round(rate / 1e9, 1),
          "machine matmul GFLOP/s": round(machine.matmul_flops / 1e9, 1),
          "fraction": round(rate / machine.matmul_flops, 3)}


def _sampled_step(hidden, table, biases, targets, num_sampled=1024, optimizer=None):
  """TF's sampled softmax forward and backward; with `optimizer` (built here) its update
  of the table and biases too."""
  from tf_hsm.bench import baselines  # pylint: disable=import-outside-toplevel
  if optimizer is not None:
    optimizer.build([table, biases])

  @tf.function
  def step():
    with tf.GradientTape() as tape:
      tape.watch(hidden)
      loss = tf.reduce_mean(baselines.sampled_softmax_loss(hidden, table, biases, targets,
                                                           num_sampled, seed=7))
    grads = tape.gradient(loss, [hidden, table, biases])
    if optimizer is not None:
      optimizer.apply_gradients(zip(grads[1:], [table, biases]))
    return loss, grads[0], grads[1].values[:1, :1]
  return step


# (branching, head) of the trees from vectors timed by the head part: the rows of
# `tf_hsm.bench.quality_torch` (vectors32_head1024, vectors32_head256, vectors64_head256,
# vectors32) at V=1M.
HEAD_TREES = ((32, 1024), (32, 256), (64, 256), (32, 0))


def head_part(rng, rounds, trees=HEAD_TREES):
  """Trees from vectors (`trees`, (branching, head) pairs: by default 32- and 64-ary,
  heads of 0, 256 and 1,024 frequent classes), and TF's sampled softmax (1,024
  samples), interleaved."""
  classes, dim, tokens = 1_000_000, 300, 3200
  targets = tf.constant(cases.zipf_targets(classes, tokens, rng))
  methods = {}
  for branching, head in trees:
    tree = cases.vectors_tree(classes, branching, head)
    hidden, table, biases, _ = _problem(rng, tree.num_slots, dim, tokens)
    methods[f"{branching}-ary, head {head}"] = _hsm_step(tree, hidden, table, biases,
                                                        targets)
  hidden, table, biases, _ = _problem(rng, classes, dim, tokens)
  methods["sampled softmax 1024"] = _sampled_step(hidden, table, biases, targets)
  med = interleaved(methods, rounds)
  result = {"case": "V=1M D=300 T=3200", "ms": _ms(med), "speed vs sampled": _vs_sampled(med)}
  if (32, 1024) in trees and (32, 0) in trees:
    result["head 1024 / no head"] = round(med["32-ary, head 1024"] / med["32-ary, head 0"],
                                          3)
  return result


class MixtureShape(collections.namedtuple("MixtureShape",
                                          "count branching head shared tail_dim head_rank",
                                          defaults=(False, None, None))):
  """A mixture the mixture part times: `count` trees of `branching`, each with a head of
  `head` frequent classes at its root, or (`shared`) over the other classes below one
  shared head of `head` (`HierarchicalSoftmaxMixture(head=...)`), scoring a `tail_dim`
  projection of the hidden state where that is given, each tree correcting the shared
  head at rank `head_rank` where that is given."""

  def __new__(cls, *args, **kwargs):
    shape = super().__new__(cls, *args, **kwargs)
    for name in ("tail_dim", "head_rank"):
      if getattr(shape, name) is not None and not shape.shared:
        raise ValueError(f"a mixture's {name} ({getattr(shape, name)}) is of the trees "
                         "below a shared head: give shared=True")
    return shape

  def __str__(self):
    dim = "" if self.tail_dim is None else f"/{self.tail_dim}"
    rank = "" if self.head_rank is None else f"r{self.head_rank}"
    return (f"{self.count}x{self.branching}+{self.head}{dim}{rank}" if self.shared
            else f"{self.count}x{self.branching}:{self.head}")

  def label(self):
    count = _COUNTS.get(self.count, self.count)
    dim = "" if self.tail_dim is None else f", d={self.tail_dim}"
    rank = "" if self.head_rank is None else f", heads of rank {self.head_rank}"
    return (f"shared head {self.head} + {count} {self.branching}-ary{dim}{rank}"
            if self.shared else f"mixture of {count} {self.branching}:{self.head}")


MIXTURE_TREES = (MixtureShape(2, 32, 256, False), MixtureShape(2, 16, 128, False),
                 MixtureShape(3, 16, 128, True))
_COUNTS = {2: "two", 3: "three", 4: "four"}
MAX_MIXTURE_TREES = 8  # each tree of V=1M holds a [1M, 300] table: 1.2 GB


def _mixture_step(trees, hidden, targets, head=None, tail_dim=None, head_rank=None,
                  optimizer=None):
  """`HierarchicalSoftmaxMixture` over `trees` (with the shared `head`, `tail_dim` and
  `head_rank`, if given), forward and backward as `_hsm_step`; with `optimizer` (built
  here) its update of every weight too."""
  from tf_hsm.keras.mixture import HierarchicalSoftmaxMixture  # pylint: disable=import-outside-toplevel
  layer = HierarchicalSoftmaxMixture(list(trees), head=head, tail_dim=tail_dim,
                                     head_rank=head_rank)
  layer.build(hidden.shape)
  if optimizer is not None:
    optimizer.build(layer.trainable_variables)

  @tf.function
  def step():
    with tf.GradientTape() as tape:
      tape.watch(hidden)
      loss = -tf.reduce_mean(layer(hidden, targets))
    grads = tape.gradient(loss, [hidden] + layer.trainable_variables)
    if optimizer is not None:
      optimizer.apply_gradients(zip(grads[1:], layer.trainable_variables))
    # The tables' IndexedSlices as they are; a row of each dense gradient (the gate's,
    # the corrected heads' table), so that no product of the backward is pruned.
    tables = [g.values[:1] if isinstance(g, tf.IndexedSlices) else g[:1] for g in grads[1:]]
    return (loss, grads[0], *tables)
  step.layer = layer  # for a look at what it trains
  return step


def mixture_trees(rng, shape, classes, first=None):
  """(trees, shared head ids or None) of `shape`: with heads of their own, `first` (by
  default `cases.vectors_tree` of the shape's branching and head) and others from other
  Gaussian vectors; with a shared head, all from Gaussian vectors over the classes past
  the head (the Zipf classes are ranked: the head is the most frequent), `first` unused."""
  weights = cases.zipf_weights(classes)
  if not shape.shared:
    if first is None:
      first = cases.vectors_tree(classes, shape.branching, shape.head)
    return [first] + [tf_hsm.Tree.from_vectors(
        rng.normal(size=(classes, cases.TREE_VECTOR_DIM)).astype(np.float32), weights,
        shape.branching, head=shape.head) for _ in range(shape.count - 1)], None
  return [tf_hsm.Tree.from_vectors(
      rng.normal(size=(classes - shape.head, cases.TREE_VECTOR_DIM)).astype(np.float32),
      weights[shape.head:], shape.branching) for _ in range(shape.count)], np.arange(
          shape.head)


def _mixture_inputs(rng, classes, dim, tokens):
  """(targets, hidden) of the mixture and trained parts: Zipf(1) targets, then small
  Gaussian hidden states, drawn from `rng` in that order."""
  targets = tf.constant(cases.zipf_targets(classes, tokens, rng))
  return targets, tf.constant(rng.normal(size=(tokens, dim)).astype(np.float32) * 0.1)


def mixture_part(rng, rounds, shapes=MIXTURE_TREES, classes=1_000_000, dim=300,
                 tokens=3200):
  """`HierarchicalSoftmaxMixture` of trees from vectors of each shape in `shapes`
  ((trees, branching, head) triples: the first tree as the head part's, the others of
  other vectors), one tree of the first shape, and TF's sampled softmax (1,024 samples),
  interleaved, at V=1M, D=300, T=3,200, Zipf(1) targets (the sizes are arguments for
  the tests). For a shared head also its parts alone (`_shared_head_parts`: "MIXTURE:
  its head", "MIXTURE: one tree, tail tokens", in "ms" but not in "speed vs sampled")
  and "shared head's rest" (`_shared_head_rest`). The parts draw from `rng` too: the
  mixtures after a shared head get other trees than before they were timed."""
  targets, hidden = _mixture_inputs(rng, classes, dim, tokens)
  methods, parts = {}, set()
  for index, shape in enumerate(MixtureShape(*s) for s in shapes):
    # The first shape's tree is timed alone; a mixture with its own heads starts on it.
    first = (cases.vectors_tree(classes, shape.branching, shape.head)
             if index == 0 or not shape.shared else None)
    if index == 0:
      _, table, biases, _ = _problem(rng, first.num_slots, dim, tokens)
      methods[f"one tree {shape.branching}:{shape.head}"] = _hsm_step(
          first, hidden, table, biases, targets)
    trees, head = mixture_trees(rng, shape, classes, first)
    methods[shape.label()] = _mixture_step(trees, hidden, targets, head, shape.tail_dim,
                                           shape.head_rank)
    if shape.shared:
      shared_parts = _shared_head_parts(rng, shape, trees[0], hidden, targets)
      methods.update(shared_parts)
      parts.update(shared_parts)
  _, table, biases, _ = _problem(rng, classes, dim, tokens)
  methods["sampled softmax 1024"] = _sampled_step(hidden, table, biases, targets)
  med = interleaved(methods, rounds)
  return {"case": f"V={classes:,} D={dim} T={tokens:,}", "ms": _ms(med),
          "speed vs sampled": _vs_sampled(med, parts),
          "shared head's rest": _shared_head_rest(shapes, med)}


def trained_part(rng, rounds, shapes=MIXTURE_TREES, classes=1_000_000, dim=300,
                 tokens=3200):
  """Each mixture of `shapes` trained as a custom loop trains it (forward, backward and
  `tf_hsm.optimizers.LazyAdam`'s update of every weight: the rows the trees' paths
  touch with their two slots, the head and the gate) beside TF's sampled softmax (1,024)
  with the same update, interleaved, at V=1M, D=300, T=3,200, Zipf(1) targets: what the
  planner prices as a step with the optimizer. Each mixture holds its tables and slots
  (3.8 GB a 16-ary tree at V=1M): run few a process (`check_tables_fit`)."""
  from tf_hsm.keras import optimizers  # pylint: disable=import-outside-toplevel
  targets, hidden = _mixture_inputs(rng, classes, dim, tokens)
  methods = {}
  for shape in (MixtureShape(*s) for s in shapes):
    trees, head = mixture_trees(rng, shape, classes)
    methods[shape.label()] = _mixture_step(trees, hidden, targets, head, shape.tail_dim,
                                           shape.head_rank, optimizers.LazyAdam(1e-3))
  _, table, biases, _ = _problem(rng, classes, dim, tokens)
  methods["sampled softmax 1024"] = _sampled_step(hidden, table, biases, targets,
                                                  optimizer=optimizers.LazyAdam(1e-3))
  med = interleaved(methods, rounds)
  return {"case": f"V={classes:,} D={dim} T={tokens:,}, Zipf(1) targets, LazyAdam's update",
          "ms": _ms(med), "speed vs sampled": _vs_sampled(med)}


def _tree_bytes(shape, classes, dim, trained):
  """About the bytes of one float32 tree table of `shape` (n b / (b - 1) rows over its n
  classes, `tail_dim` wide where given), times 3 with LazyAdam's two slots."""
  rows = (classes - shape.head if shape.shared else classes) * shape.branching / (
      shape.branching - 1)
  return 4 * rows * (shape.tail_dim or dim) * (3 if trained else 1)


def tables_bytes(shapes, classes=1_000_000, dim=300, trained=False):
  """What the float32 tables of the mixture part (`trained`: the trained part, each
  table with LazyAdam's two slots) hold at the least: each mixture's trees and sampled
  softmax's [classes, dim] table; in the mixture part also the lone tree's table (its
  own, beside the first mixture's) and, for a shared head, the table of the tree its
  parts time alone (`_shared_head_parts`). The process's peak is above it (the step's
  tensors, TensorFlow's own)."""
  shapes = [MixtureShape(*s) for s in shapes]
  need = sum(s.count * _tree_bytes(s, classes, dim, trained) for s in shapes)
  need += 4 * classes * dim * (3 if trained else 1)
  if not trained and shapes:
    lone = shapes[0]._replace(shared=False, tail_dim=None, head_rank=None)
    need += _tree_bytes(lone, classes, dim, trained) + sum(
        _tree_bytes(s, classes, dim, trained) for s in shapes if s.shared)
  return need


def check_tables_fit(shapes, trained, available=None):
  """ValueError naming the mixtures' tables and the memory available where the tables
  alone (`tables_bytes`, at V=1M, D=300) exceed it: a process that would be killed
  building them is told so before it starts."""
  available = mem_available_bytes() if available is None else available
  need = tables_bytes(shapes, trained=trained)
  if available is None or need <= available:
    return
  each = ", ".join(f"{s} {s.count * _tree_bytes(s, 1_000_000, 300, trained) / GB:.1f}"
                   for s in (MixtureShape(*s) for s in shapes))
  slots = " with LazyAdam's slots" if trained else ""
  besides = ("sampled softmax's" if trained else
             "sampled softmax's, the lone tree's and the shared heads' parts'")
  raise ValueError(
      f"the {'trained' if trained else 'mixture'} part's tables alone hold {need / GB:.1f} "
      f"GB{slots} (GB a mixture: {each}; {besides} besides), "
      f"more than the {available / GB:.1f} GB available: time fewer --mixtures a process")


def _vs_sampled(med, left_out=()):
  """{method: sampled softmax's median / its median} of the methods in `med` but
  sampled softmax and `left_out`."""
  sampled = med["sampled softmax 1024"]
  return {name: round(sampled / s, 2) for name, s in med.items()
          if name != "sampled softmax 1024" and name not in left_out}


def _shared_head_parts(rng, shape, tree, hidden, targets):
  """{name: step} of a shared-head mixture's parts, each timed alone: its head (the
  exact softmax over the head's classes and the tail slot, every token) and one of its
  trees on the tail's tokens (their hidden states, or random ones `tail_dim` wide)."""
  label = shape.label()
  head_targets = tf.minimum(targets, shape.head)  # the Zipf classes are ranked
  _, table, biases, _ = _problem(rng, shape.head + 1, hidden.shape[-1], 1)
  in_tail = tf.where(targets >= shape.head)[:, 0]
  tail_hidden = tf.gather(hidden, in_tail)
  if shape.tail_dim is not None:
    tail_hidden = tf.constant(rng.normal(size=(int(in_tail.shape[0]), shape.tail_dim)
                                         ).astype(np.float32) * 0.1)
  _, tree_table, tree_biases, _ = _problem(rng, tree.num_slots, tail_hidden.shape[-1], 1)
  return {f"{label}: its head": _hsm_step(tf_hsm.Tree.flat(shape.head + 1), hidden,
                                          table, biases, head_targets),
          f"{label}: one tree, tail tokens": _hsm_step(
              tree, tail_hidden, tree_table, tree_biases,
              tf.gather(targets, in_tail) - shape.head)}


def _shared_head_rest(shapes, med):
  """{mixture: ms} of each shared-head mixture's step past its head and its trees, each
  timed alone (the class map, the gathers, the gate, the mixing, and with `tail_dim`
  the projection): the median step less the head's and `count` times the one tree's
  medians. Each part timed alone pays a call of its own (a `tf.function`, its checks),
  which the mixture pays once: the rest reads low by `count` such calls."""
  rest = {}
  for shape in (MixtureShape(*s) for s in shapes):
    if shape.shared:
      label = shape.label()
      rest[label] = round(1e3 * (med[label] - med[f"{label}: its head"] - shape.count
                                 * med[f"{label}: one tree, tail tokens"]), 2)
  return rest


def _forward(tree, hidden, table, biases, targets):
  @tf.function
  def step():
    return (tf.reduce_sum(tf_hsm.log_prob(hidden, table, biases, tree, targets)),)
  return step


def width_part(rng, rounds, widths=(300, 150, 75, 16), classes=999_872, tokens=1985):
  """One 16-ary tree from vectors over `classes` (a tail tree below a shared head of
  128 at V=1M), on `tokens` targets (the tail's share of T=3,200 Zipf(1) tokens), at
  each of `widths`, forward and forward with backward, interleaved: how a tree step
  grows with its rows' width (what a narrower `tail_dim` or narrower rows could save)
  and what it costs without width."""
  tree = cases.vectors_tree(classes, 16, 0)
  targets = tf.constant(cases.zipf_targets(classes, tokens, rng))
  methods = {}
  for dim in widths:
    hidden, table, biases, _ = _problem(rng, tree.num_slots, dim, tokens)
    methods[f"D={dim} forward"] = _forward(tree, hidden, table, biases, targets)
    methods[f"D={dim} forward and backward"] = _hsm_step(tree, hidden, table, biases,
                                                         targets)
  med = interleaved(methods, rounds)
  steps = [med[f"D={dim} forward and backward"] for dim in widths]
  slope, intercept = np.polyfit(np.asarray(widths, np.float64), steps, 1)
  return {"case": f"16-ary over {classes:,} classes, T={tokens:,}", "ms": _ms(med),
          "step ms = a + b D": {"a": round(intercept * 1e3, 2),
                                "b": round(slope * 1e3, 4)}}


def parse_heads(text):
  """"32:1024,64:256" -> ((32, 1024), (64, 256)); ValueError naming a bad entry."""
  trees = []
  for entry in text.split(","):
    try:
      branching, head = (int(v) for v in entry.split(":"))
    except ValueError:
      raise ValueError(f"--heads takes BRANCHING:HEAD pairs, got {entry!r}") from None
    if branching < 2 or head < 0:
      raise ValueError(f"--heads needs a branching of at least 2 and a head of at least "
                       f"0, got {entry!r}")
    trees.append((branching, head))
  return tuple(trees)


def parse_mixtures(text):
  """"32:256,3x16+128/64r8" -> (MixtureShape(2, 32, 256, False), MixtureShape(3, 16,
  128, True, 64, 8)): [TREESx]BRANCHING:HEAD (each tree with its head) or
  [TREESx]BRANCHING+HEAD[/DIM][rRANK] (a shared head; the trees DIM wide, each
  correcting the head at RANK), two trees where the count is left out; ValueError
  naming a bad entry."""
  mixtures = []
  for entry in text.split(","):
    match = re.fullmatch(r"(?:(\d+)x)?(\d+)(?::(\d+)|\+(\d+)(?:/(\d+))?(?:r(\d+))?)",
                         entry)
    if not match or any(match.group(g) is not None and int(match.group(g)) < 1
                        for g in (5, 6)):
      raise ValueError("--mixtures takes [TREESx]BRANCHING:HEAD or "
                       f"[TREESx]BRANCHING+HEAD[/DIM][rRANK] (DIM, RANK >= 1), got "
                       f"{entry!r}")
    count, branching, own_head, shared_head, dim, rank = match.groups()
    shared = shared_head is not None
    count, branching, head = int(count or 2), int(branching), int(shared_head or own_head)
    if not 2 <= count <= MAX_MIXTURE_TREES or branching < 2:
      raise ValueError(f"--mixtures needs 2-{MAX_MIXTURE_TREES} trees of a branching of "
                       f"at least 2, got {entry!r}")
    if shared and head < 1:
      raise ValueError(f"--mixtures needs a shared head of at least 1 class, got {entry!r}")
    mixtures.append(MixtureShape(count, branching, head, shared,
                                 None if dim is None else int(dim),
                                 None if rank is None else int(rank)))
  return tuple(mixtures)


def _ms(medians):
  return {name: round(s * 1e3, 1) for name, s in medians.items()}


def memory_case(classes, dim, tokens, mode):
  """Run in a process of its own: the growth of the peak (VmHWM) over one training step,
  from after the set-up (the table, the batch, and one step on a 10-class tree that loads
  the op library), in bytes. One step: at V=1M, T=3,200 it is 7.7 TFLOP."""
  rng = np.random.default_rng(0)
  hidden, table, biases, targets = _problem(rng, classes, dim, tokens, drawn_in_place=True)

  def step(tree, table, biases, targets):
    if mode == "sgd_step":
      return tf_hsm.sgd_step(hidden, table, biases, tree, targets, 0.1)[0].numpy()
    with tf.GradientTape() as tape:
      tape.watch(hidden)
      loss = tf.reduce_mean(tf_hsm.nll_loss(hidden, table, biases, tree, targets))
    grads = tape.gradient(loss, [hidden, table, biases])
    return [g.values[:1].numpy() if isinstance(g, tf.IndexedSlices) else g[:1].numpy()
            for g in grads]

  small = [tf.Variable(tf.zeros([10, dim])), tf.Variable(tf.zeros([10]))]
  step(tf_hsm.Tree.flat(10), *small, tf.zeros([tokens], tf.int64))
  base = status_bytes("VmHWM")
  reset = reset_peak_rss()
  base = status_bytes("VmHWM") if reset else base
  start = time.perf_counter()
  step(tf_hsm.Tree.flat(classes), table, biases, targets)
  return {"case": f"V={classes} D={dim} T={tokens}", "mode": mode,
          "table GiB": round(classes * dim * 4 / 2**30, 3),
          "peak growth GiB": round((status_bytes("VmHWM") - base) / 2**30, 3),
          "process peak GiB": round(status_bytes("VmHWM") / 2**30, 3),
          "peak reset at the baseline": reset,
          "step s": round(time.perf_counter() - start, 3)}


def memory_part():
  """At V=10M only sgd_step: with its gradient the step holds two 12 GB tables, more than
  this project's 23 GiB machines have."""
  out = []
  for classes, dim, tokens, modes in ((1_000_000, 300, 3200, ("sgd_step", "gradient")),
                                      (10_000_000, 300, 256, ("sgd_step",))):
    for mode in modes:
      cmd = [sys.executable, "-m", "tf_hsm.bench.wide", "--memory-case",
             f"{classes},{dim},{tokens},{mode}"]
      done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
      if done.returncode != 0:
        out.append({"case": f"V={classes} T={tokens}", "mode": mode,
                    "error": done.stderr.strip().splitlines()[-1:]})
        continue
      out.append(json.loads(done.stdout.strip().splitlines()[-1]))
  return out


PARTS = {"flat": flat_part, "rate": rate_part, "head": head_part,
         "inference": inference_part}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--parts", default="flat,rate,head,inference,memory",
                      help="comma-separated, of flat, rate, head, inference, memory, "
                           "mixture (forward and backward), trained (with LazyAdam's "
                           "update), width")
  parser.add_argument("--rounds", type=int, default=7, help="timed rounds (medians)")
  parser.add_argument("--heads", default=",".join(f"{b}:{h}" for b, h in HEAD_TREES),
                      help="the head part's trees, BRANCHING:HEAD pairs (default: %(default)s)")
  parser.add_argument("--mixtures", default=",".join(map(str, MIXTURE_TREES)),
                      help="the mixture part's mixtures, [TREESx]BRANCHING:HEAD (each "
                           "tree with a head of HEAD classes at its root) or "
                           "[TREESx]BRANCHING+HEAD[/DIM][rRANK] (the trees below one "
                           "shared head, DIM wide, each correcting it at RANK); two trees "
                           "without TREESx; default: %(default)s")
  parser.add_argument("--memory-case", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  try:
    heads, mixtures = parse_heads(args.heads), parse_mixtures(args.mixtures)
    for part in {"mixture", "trained"} & set(args.parts.split(",")):
      check_tables_fit(mixtures, trained=part == "trained")
  except ValueError as e:
    parser.error(str(e))
  if args.memory_case:
    classes, dim, tokens, mode = args.memory_case.split(",")
    print(json.dumps(memory_case(int(classes), int(dim), int(tokens), mode)))
    return
  parts = args.parts.split(",")
  unknown = sorted(set(parts) - set(PARTS) - {"memory", "mixture", "trained", "width"})
  if unknown or args.rounds < 1:
    parser.error(f"unknown parts {unknown} (of flat, rate, head, inference, memory, "
                 "mixture, trained, width)" if unknown
                 else "--rounds must be >= 1")
  rng = np.random.default_rng(0)
  for part in parts:
    if part == "memory":
      result = memory_part()
    elif part == "head":
      result = head_part(rng, args.rounds, heads)
    elif part == "mixture":
      result = mixture_part(rng, args.rounds, mixtures)
    elif part == "trained":
      result = trained_part(rng, args.rounds, mixtures)
    elif part == "width":
      result = width_part(rng, args.rounds)
    else:
      result = PARTS[part](rng, args.rounds)
    print(json.dumps({part: result}), flush=True)


if __name__ == "__main__":
  main()
