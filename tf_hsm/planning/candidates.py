"""Sizing an output layer before training: memory, FLOPs, rows touched and step time of
each candidate (full softmax, sampled softmax, hierarchical softmax over several trees),
and the one to use.

    report = tf_hsm.plan(10_000_000, 300, 3200, counts=counts, optimizer="lazy_adam",
                         memory_budget=24 * 2**30)
    print(report.to_markdown())

    python -m tf_hsm.planning --classes 10M --hidden 300 --tokens 3200 --optimizer lazy_adam \\
        --memory 24GiB --zipf 1.0

The figures are expected values for a step of `tokens_per_step` tokens drawn from
`counts`, computed from the trees' shapes (`tree_work.huffman_work` and `layout_work`:
the same figures as the built `Tree`, without its paths, so 10M classes take seconds): a node's children are read (and get a
gradient row) when at least one token visits the node, which a step of T tokens does with
probability 1 - (1 - p)^T, p the node's probability. Step time is a roofline:
max(FLOPs / matmul rate, bytes / read bandwidth) plus a per-call overhead, with the
machine's rates measured once and cached (or given, to plan for another machine); the
hierarchical-softmax rows use a linear model of FLOPs, bytes and node visits fitted to
tf_hsm's own training steps, measured with the rates (`tf_hsm.planning.step_fit`).
"""

import dataclasses
import importlib
import math
import textwrap

import numpy as np

from tf_hsm.planning import body as body_lib
from tf_hsm.planning import machine as machine_lib
from tf_hsm.planning import quality as quality_lib
from tf_hsm.planning.costs import (DIV_VALUE, DTYPE_BYTES, OPTIMIZERS, TAILS,
                                   adaptive_cost, flat_softmax_cost, probabilities,
                                   pytorch_cutoffs, sampled_softmax_cost, tail_widths)
from tf_hsm.planning.cutoffs import checked_counts, choose_cutoffs
from tf_hsm.planning.pricing import memory_budget_bytes, price
# The tree names and their layouts are tree_candidates.py's, named here too (callers and
# tests read them as candidates.TREES, candidates.learned_layout, ...).
from tf_hsm.planning.tree_candidates import (  # noqa: F401
    CONTEXT_TREES, HSM_TREES, LEARNED_HEAD, MIXTURE_TREES, TREES, VECTOR_TREES,
    VECTORS_REBUILD_AFTER, _candidate_trees, _tree_label, _trees_and_text,
    learned_layout, vectors_layout)


# Rows whose predicted steps are within this fraction of the fastest are equally fast:
# the fitted step's own error is 0.85-1.41x, and a remeasured machine moves the rates by
# more than this. Among them the choice goes by kind (full softmax, then
# HierarchicalSoftmax, then AdaptiveSoftmax: layers of the model's full width before
# narrower ones), then the least peak memory, then the table order; so noise in the
# rates cannot flip the choice between two layers a few percent apart, and can only move
# a layer across the edge of the band.
STEP_TIE = 0.10
# The recommendation takes the most accurate layer (by the project's measured perplexity
# against full softmax, `tf_hsm.planning.quality`) whose whole step (the body's, with a
# model, and the output layer's) is within this fraction of the fastest whole step;
# measured perplexity ratios within QUALITY_TIE of the best count as equally accurate
# (then the fastest, as `STEP_TIE`). Only rows whose figures are alike are compared:
# measured at the vocabulary size nearest V, and after at least half the training of the
# longest-trained among them (`_comparable`).
QUALITY_MARGIN = 0.20
QUALITY_TIE = 0.005
# A more accurate layer this far beyond the margin (up to 1.3x the fastest) is named in
# the reason: whether it falls inside turns on a few % of the measured rates, so a
# re-measured machine may pick it (docs/planner.md, "What it recommends").
NEAR_MISS = 0.10


@dataclasses.dataclass
class Layer:
  """The recommended layer: what to construct (a spec; `build()` constructs it).

  kind: "HierarchicalSoftmax", "HierarchicalSoftmaxMixture", "AdaptiveSoftmax", "full
    softmax" or "sampled softmax".
  method: its row's `method`. code: how to construct it, as Python.
  rebuild: for a tree rebuilt during training (the learned and vectors rows), the
    arguments of the `tf_hsm.callbacks.RebuildTree` that rebuilds it (`rebuild_callback`
    makes it); None for a layer trained as built.
  kwargs: for AdaptiveSoftmax, `tf_hsm.AdaptiveSoftmax(**kwargs)` (num_classes,
    cutoffs, div_value, tail, counts for a two-level tail, and class_order where the
    counts were not in frequency order); for HierarchicalSoftmax,
    `tf_hsm.HierarchicalSoftmax(**kwargs)` builds the tree on first access (`tree`);
    for full softmax likewise, over `Tree.flat(num_classes)` (the exact softmax); for
    HierarchicalSoftmaxMixture, `components`: its trees (`trees`), and `head`: the
    shared head's class ids where it has one (`head`), and `head_rank` where its trees
    correct it (`head_rank`).
  ignore_class: 0 where the counts give class 0 no count (the padding id of the
    README's models): `build()` passes `ignore_class=0` unless told otherwise, so the
    padding targets are left out of the loss and out of top_k; None otherwise.
  """
  kind: str
  method: str
  code: str
  cutoffs: list = None
  tail: str = None
  div_value: float = None
  num_classes: int = None
  rebuild: dict = dataclasses.field(default=None, repr=False, compare=False)
  _build: object = dataclasses.field(default=None, repr=False, compare=False)
  _counts: object = dataclasses.field(default=None, repr=False, compare=False)
  _tree: object = dataclasses.field(default=None, repr=False, compare=False)
  _class_order: object = dataclasses.field(default=None, repr=False, compare=False)
  head: object = dataclasses.field(default=None, repr=False, compare=False)
  ignore_class: int = None
  head_rank: int = None

  @property
  def tree(self):
    """The `Tree` of a HierarchicalSoftmax recommendation (built on first access: at
    10M classes a binary Huffman tree's paths hold a few GB), else None (a mixture's
    are `trees`, built only there)."""
    if self.kind == "HierarchicalSoftmaxMixture":
      return None
    return self._built()

  @property
  def trees(self):
    """The trees of a HierarchicalSoftmax(Mixture) or full-softmax recommendation, as a
    list (one but for a mixture), else []."""
    built = self._built()
    return [] if built is None else list(built) if isinstance(built, list) else [built]

  def _built(self):
    if self._tree is None and self._build is not None:
      self._tree = self._build()
    if self._tree is None and self.kind == "full softmax" and self.num_classes is not None:
      self._tree = importlib.import_module("tf_hsm.tree").Tree.flat(self.num_classes)
    return self._tree

  @property
  def kwargs(self):
    if self.kind == "HierarchicalSoftmaxMixture":
      kwargs = {"components": self.trees}
      if self.head is not None:
        kwargs["head"] = self.head
      if self.head_rank is not None:
        kwargs["head_rank"] = self.head_rank
      return kwargs
    if self.kind in ("HierarchicalSoftmax", "full softmax") and self.tree is not None:
      return {"tree": self.tree}
    if self.kind == "AdaptiveSoftmax":
      kwargs = {"num_classes": self.num_classes, "cutoffs": list(self.cutoffs),
                "div_value": self.div_value, "tail": self.tail}
      if self.tail == "two_level" and self._counts is not None:
        kwargs["counts"] = self._counts
      if self._class_order is not None:
        kwargs["class_order"] = self._class_order
      return kwargs
    return {}

  def build(self, **layer_kwargs):
    """The layer: `tf_hsm.HierarchicalSoftmax(**kwargs, **layer_kwargs)` or
    `tf_hsm.AdaptiveSoftmax(...)` likewise (for the Keras of `tf_hsm`'s top-level
    names: tf_keras under TF_USE_LEGACY_KERAS=1), `layer_kwargs` being the layer's
    other arguments (name, dtype, ...); for full softmax,
    `HierarchicalSoftmax(Tree.flat(num_classes))`, the exact softmax without [tokens,
    classes] logits; for HierarchicalSoftmaxMixture, the mixture of
    `HierarchicalSoftmax(tree, **component_kwargs)` over its trees, where
    `component_kwargs` are the arguments of `layer_kwargs` that the mixture does not
    take (fused_update, initializers, ignore_class, ...; dtype goes to both; with a
    shared head, ignore_class, head_bias_initializer, tail_dim,
    tail_projection_initializer and head_rank, the plan's by default, to the mixture).
    Imports TensorFlow."""
    if self.ignore_class is not None:
      layer_kwargs = {"ignore_class": self.ignore_class, **layer_kwargs}
    if self.kind == "HierarchicalSoftmaxMixture":
      return _mixture_layer(self.trees, layer_kwargs, self.head, self.head_rank)
    if self.kind in ("HierarchicalSoftmax", "AdaptiveSoftmax") or (
        self.kind == "full softmax" and self.num_classes is not None):
      # The package root, imported here: planning itself stays free of TensorFlow.
      tf_hsm = importlib.import_module("tf_hsm")
      kind = "AdaptiveSoftmax" if self.kind == "AdaptiveSoftmax" else "HierarchicalSoftmax"
      return getattr(tf_hsm, kind)(**self.kwargs, **layer_kwargs)
    raise ValueError(f"no layer to build for {self.method!r}: {self.kind} is never "
                     "recommended (its figures are approximate)")

  def rebuild_schedule(self):
    """The rebuild's arguments as text (counts left out), '' without one."""
    return ", ".join(f"{k}={v!r}" for k, v in (self.rebuild or {}).items()
                     if k != "counts")

  def rebuild_callback(self, layer, vectors=None):
    """The `tf_hsm.callbacks.RebuildTree` that turns the built layer into the
    recommended tree during training (pass it to `model.fit(callbacks=[...])`), or None
    for a layer trained as built. `layer`: the layer `build()` returned, in its model;
    `vectors`: what the tree is rebuilt from, the model's input embedding layer as the
    measurements did (None: the layer's own class rows). Imports TensorFlow."""
    if not self.rebuild:
      return None
    callbacks = importlib.import_module("tf_hsm").callbacks
    return callbacks.RebuildTree(layer, vectors=vectors, **self.rebuild)

  def to_dict(self):
    return {"kind": self.kind, "method": self.method, "code": self.code,
            "cutoffs": self.cutoffs, "tail": self.tail, "div_value": self.div_value,
            "rebuild": None if not self.rebuild else
                       {k: v for k, v in self.rebuild.items() if k != "counts"},
            "head": None if self.head is None else [int(c) for c in self.head],
            "head_rank": self.head_rank, "ignore_class": self.ignore_class}


# The mixture's own arguments (`HierarchicalSoftmaxMixture` and keras.layers.Layer's);
# `Layer.build` hands the others to each component.
_MIXTURE_ARGUMENTS = ("gate_initializer", "name", "dtype", "trainable", "num_classes")


def _mixture_layer(trees, layer_kwargs, head=None, head_rank=None):
  """`HierarchicalSoftmaxMixture` of `HierarchicalSoftmax` layers over `trees` (below the
  shared `head`, if given, each correcting it at `head_rank`, if given), the arguments
  split between them (`_MIXTURE_ARGUMENTS` to the mixture, and ignore_class with a
  head; the rest to each component, dtype to both)."""
  # The front end of tf_hsm's top-level names: tf_keras under TF_USE_LEGACY_KERAS.
  front_end = importlib.import_module(importlib.import_module("tf_hsm")._KERAS)  # pylint: disable=protected-access
  mine = _MIXTURE_ARGUMENTS + (("ignore_class", "head_bias_initializer", "tail_dim",
                                "tail_projection_initializer", "head_rank")
                               if head is not None else ())
  own = {k: v for k, v in layer_kwargs.items() if k in mine}
  each = {k: v for k, v in layer_kwargs.items() if k not in mine}
  if "dtype" in own:
    each["dtype"] = own["dtype"]
  if head is not None:
    own["head"] = head
  if head_rank is not None:  # the plan's, unless the caller gives another
    own.setdefault("head_rank", head_rank)
  components = [front_end.HierarchicalSoftmax(tree, **each) for tree in trees]
  return front_end.HierarchicalSoftmaxMixture(components, **own)


@dataclasses.dataclass
class Report:
  """The plan: `rows` (one dict per candidate), `recommended` (a row's `method`),
  `reason` (one line), `layer` (the recommended `Layer`, ready to construct), and
  `notes` (rows left out and why, and the long names of the table's short ones)."""
  rows: list
  recommended: str
  reason: str
  settings: dict
  layer: Layer = None
  notes: list = dataclasses.field(default_factory=list)
  body: dict = None  # with a model: the body's figures (`tf_hsm.planning.body`)

  def to_dict(self):
    return {"rows": self.rows, "recommended": self.recommended, "reason": self.reason,
            "settings": self.settings, "body": self.body,
            "layer": self.layer.to_dict() if self.layer else None, "notes": self.notes}

  def __str__(self):
    # `print(report)` shows the table, as the command does, not the dataclass' fields.
    return self.to_markdown()

  def to_markdown(self):
    """The table (within 120 columns: short names, the long ones below it; the
    per-shard column only with shards, the slots column only with an optimizer that
    has slots), then the recommendation and the notes."""
    s = self.settings
    shards = s["num_shards"] > 1
    lines = [
        f"V={s['num_classes']:,}, D={s['hidden']}, T={s['tokens_per_step']:,} tokens a "
        f"step, {s['optimizer']}, {s['dtype']}"
        + (f", {s['num_shards']} shards" if shards else "")
        + (f", budget {_size(s['memory_budget'])}" if s["memory_budget"] else ""),
        ""]
    slots = any(row["slot_bytes"] for row in self.rows)  # no column of zeros (sgd)
    whole = self.body is not None
    header = ["method", "params", "grad"] + (["slots"] if slots else []) + ["peak"] + (
        ["per shard"] if shards else []) + ["rows", "GFLOP", "moved", "step"] + (
            ["whole", "whole peak"] if whole else []) + ["ppl+%", "fits"]
    lines += ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    farther = _farther_rows(self.rows)
    footnotes = []
    for row in self.rows:
      label = row.get("label", row["method"])
      if label != row["method"] and not (
          label.startswith("HSM ") and row["method"] == "HierarchicalSoftmax " + label[4:]):
        footnotes.append(f"- {label}: {row['method']}")
      cells = [label] + [_size(row[k], short=True) for k in (
          "param_bytes", "grad_bytes") + (("slot_bytes",) if slots else ()) +
                                                    ("peak_bytes",)] + (
              [_size(row["per_shard_bytes"], short=True)] if shards else []) + [
          _count(row["rows_touched"]), _count(row["flops"] / 1e9),
          _size(row["bytes_moved"], short=True), _seconds(row["step_seconds"], short=True)] + (
              [_seconds(row["whole_step_seconds"], short=True),
               _size(row["whole_peak_bytes"], short=True)] if whole else []) + [
          _quality_cell(row.get("quality"), row.get("quality_far"), _among(row, farther)),
          ("yes" if row["fits"] else "no") + ("" if row["exact"] else "*")]
      lines.append("| " + " | ".join(cells) + " |")
    text = ["HSM: HierarchicalSoftmax; rows: rows touched a step (expected); GFLOP: forward "
            "and backward; moved: bytes a step reads and writes; *: approximate, never "
            "recommended." + (" whole: with the body's step and memory." if whole else ""),
            quality_lib.column_note(s["num_classes"]),
            *(["^ (for ~, or after the figure): measured at a vocabulary size farther "
               "from this V's than the other figures, which the recommendation does not "
               "compare it with."]
              if farther else []),
            *footnotes, ""] + ([s["body"], ""] if whole else []) + [
            f"Recommended: {self.recommended}: {self.reason}"]
    if self.layer is not None and self.layer.code:
      text.append(f"Construct it: {self.layer.code}")
    text += [f"Note: {note}" for note in self.notes]
    lines.append("")
    for line in text:
      indent = "  " if line.startswith("- ") else ""
      lines += textwrap.wrap(line, 120, subsequent_indent=indent) or [""]
    return "\n".join(lines)


def _farther_rows(rows):
  """The rows whose measured quality comes from a vocabulary size farther from V than
  the nearest any row's does (`_comparable` sets them aside by that; full softmax, the
  reference at any V, never)."""
  measured = [r for r in rows if r.get("quality") is not None and
              r.get("quality_kind") != "full"]
  if not measured:
    return []
  nearest = min(map(_scale_gap, measured))
  return [r for r in measured if _scale_gap(r) > nearest + 1e-9]


def _scale_gap(row):
  """How far from V the vocabulary size of `row`'s quality figure is (0: at V)."""
  return row.get("quality_scale_gap") or 0.0


def _among(row, rows):
  """Whether `row` is one of `rows` (the same dict, not an equal one)."""
  return any(row is r for r in rows)


def _quality_cell(ratio, far=False, farther=False):
  """The ppl+% cell: one decimal below 5%, whole percents above (the table fits 120
  columns; the row's `quality` and the reason keep the figure); `~` and whole percents
  for a figure measured far from this V (`quality.FAR`): an ordering, not a decimal;
  `^` for a figure farther than the others (`_farther_rows`), in place of `~`."""
  if ratio is None:
    return "?"
  percent = (ratio - 1) * 100
  if far:
    return f"{'^' if farther else '~'}{percent:.0f}"
  return (f"{percent:.1f}" if abs(percent) < 5 else f"{percent:.0f}") + (
      "^" if farther else "")


def _size(value, short=False):
  if value is None:
    return "-"
  for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if value >= scale:
      return f"{_sig(value / scale)} {unit}" if short else f"{value / scale:.2f} {unit}"
  return f"{value:.0f} B"


def _sig(value):
  """Three significant figures, at most: 164, 11.2, 3.66."""
  return f"{value:.0f}" if value >= 100 else f"{value:.1f}" if value >= 10 else \
      f"{value:.2f}"


def _count(value):
  for unit, scale in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
    if value >= scale:
      return f"{_sig(value / scale)}{unit}"
  return f"{value:.0f}" if value >= 10 else f"{value:.2g}"


def _seconds(value, short=False):
  if short:
    return f"{_sig(value * 1e3)} ms" if value < 1 else f"{_sig(value)} s"
  return f"{value * 1e3:.1f} ms" if value < 1 else f"{value:.2f} s"


def _short_list(values):
  return "[" + ", ".join(f"{v:,}" for v in values) + "]"


def _frequency_order(counts, probs, tails, notes):
  """The class ids from the most to the least frequent where `counts` are not in that
  order (a tokenizer's ids, say), else None. The adaptive rows are priced on the
  classes in that order, and their layer takes it as its `class_order` (it keeps the
  ids and ranks them inside), as `AdaptiveSoftmax.frequency_order(counts,
  padding=())` gives it. Counts that are not frequencies at all (draws of class ids)
  leave the order alone: `_adaptive_layouts` says why there are no adaptive rows."""
  if counts is None or not tails or not np.any(probs[1:] > probs[:-1]):
    return None
  try:
    checked_counts(counts)
  except ValueError as error:
    if not str(error).startswith("counts must be non-increasing"):
      return None
  padding = _leading_padding(counts)
  if padding:
    notes.append(f"the counts are sorted by frequency after ids {_short_list(padding)} "
                 "(count 0: padding, say): the AdaptiveSoftmax rows rank the classes by "
                 "their counts, and their layer takes class_order=AdaptiveSoftmax."
                 "frequency_order(counts, padding=()), which ranks those ids last "
                 f"(padding={_short_list(padding)} would leave them out of the classes)")
  else:
    notes.append("the counts are not sorted by frequency (ids in a tokenizer's order): "
                 "the AdaptiveSoftmax rows rank the classes by their counts, and their "
                 "layer takes class_order=AdaptiveSoftmax.frequency_order(counts, "
                 "padding=()) (it keeps the ids; leave out padding ids with padding=[...])")
  return np.argsort(-probs, kind="stable")


def _leading_padding(counts):
  """The first ids where counts of 0 lead a list sorted by frequency after them (the
  README's padding id 0), else []."""
  counts = np.asarray(counts, np.float64)
  first = int(np.argmax(counts > 0)) if np.any(counts > 0) else 0
  rest = counts[first:]
  if first == 0 or np.any(rest[1:] > rest[:-1]):
    return []
  return list(range(first))


def _adaptive_layouts(V, D, T, probs, optimizer, dtype, machine, tails, cutoffs,
                      div_value, notes, counts=None):
  """(method, label, cutoffs, tail) of the adaptive rows: the given cutoffs for each
  tail, or the cutoffs `choose_cutoffs` picks for each tail and, to compare with, flat
  tails at PyTorch-style fixed cutoffs. A row that cannot be priced adds a note.
  `probs` and `counts` (as given, None for uniform) are in the classes' frequency
  order."""
  if not tails:
    return []
  try:
    # The head holds the first classes: they must be the most frequent. The counts as
    # given, not normalised, so that the note quotes the user's own values.
    checked_counts(probs if counts is None else counts)
  except ValueError as error:
    notes.append(f"no AdaptiveSoftmax rows: {error}")
    return []
  if cutoffs is not None:
    return [(f"AdaptiveSoftmax {tail}, cutoffs", f"adaptive {tail}", list(cutoffs), tail,
             div_value) for tail in tails]
  layouts = []
  for tail in tails:
    try:
      chosen = choose_cutoffs(probs, D, T, div_value, tail, machine, optimizer=optimizer,
                              dtype=dtype)
    except ValueError as error:  # D too narrow for a cluster of min_width, or V too small
      notes.append(f"no AdaptiveSoftmax {tail} row at chosen cutoffs: {error}")
      continue
    layouts.append((f"AdaptiveSoftmax {tail}, chosen cutoffs", f"adaptive {tail}", chosen,
                    tail, div_value))
  if "flat" in tails:
    fixed = pytorch_cutoffs(V, D, div_value)
    if fixed:
      layouts.append(("AdaptiveSoftmax flat, PyTorch-style fixed cutoffs",
                      "adaptive fixed", fixed, "flat", div_value))
    else:
      notes.append(f"no AdaptiveSoftmax row at PyTorch-style cutoffs: V={V} and D={D} "
                   f"leave no cluster a width of 1 or more at div_value {div_value:g}")
    demo = quality_lib.demo_cutoffs(V)
    if demo and min(tail_widths(D, len(demo), 2.0)) >= 1:
      # The layout whose quality the project measured (docs/demo.md).
      layouts.append(("AdaptiveSoftmax flat, the demo's cutoffs", "adaptive demo",
                      demo, "flat", 2.0))
  return layouts


def _quiet(text):
  del text


def _pick(candidates, key="step_seconds"):
  """The fastest of `candidates` (rows, in table order) by `key`, counting steps within
  STEP_TIE of the fastest as equal; of those, by kind (`_KINDS`), then the least peak
  memory, then the first."""
  fastest = min(r[key] for r in candidates)
  tied = [(i, r) for i, r in enumerate(candidates)
          if r[key] <= fastest * (1 + STEP_TIE)]
  return min(tied, key=lambda ir: (_kind_rank(ir[1]["method"]), ir[1]["peak_bytes"],
                                   ir[0]))[1]


_KINDS = ("full softmax", "HierarchicalSoftmax", "AdaptiveSoftmax")


def _kind_rank(method):
  return next((i for i, kind in enumerate(_KINDS) if method.startswith(kind)),
              len(_KINDS))


def plan(num_classes=None, hidden=None, tokens_per_step=None, counts=None,
         optimizer="sgd", dtype="float32", memory_budget=None, num_shards=1, machine=None,
         trees=None, adaptive=TAILS, cutoffs=None, div_value=DIV_VALUE, progress=None,
         model=None, sequence_length=None, token_ids=None, max_perplexity_increase=None):
  """Plans the output layer of a model: one row per candidate and a recommendation.

  Args:
    num_classes: V (default with a `model` holding a tf_hsm layer: its num_classes).
    hidden: D, the hidden size (default with a `model`: its hidden states' width).
    tokens_per_step: T, the outputs a training step scores: batch x sequence length
      for a language model.
    counts: class frequencies [V] (uniform if None); class ids by decreasing frequency
      for the adaptive rows, whose head holds the first classes.
    optimizer: one of "sgd", "momentum", "adagrad", "adam", "lazy_adam" (the table's
      optimizer; tf_hsm's sparse ones update touched rows only).
    dtype: "float32", "float64", "bfloat16" or "float16" (the table's).
    memory_budget: bytes available per device (per parameter server with num_shards),
      a size as the command line takes it ('24GiB'), or None.
    num_shards: parameter servers the table and slots are split over.
    machine: a `Machine` (default: this machine's cached rates, measured once, saying
      so through `progress`), or a dict of its fields.
    trees: the trees of the hierarchical-softmax rows: "two_level" (equal-mass clusters
      with counts), "three_level" (balanced, branching V^(1/3)), "huffmanK" (K-ary
      Huffman on the counts), "learned", "vectorsK_headH", "contextK_headH" (built
      from `token_ids`), "mixtureK_headH" (a `HierarchicalSoftmaxMixture` of the
      left- and right-context trees of that shape, from `token_ids`) and
      "mixtureNxK_headH" (N such trees: left and right, then again from other seeds).
      Default: `TREES`, and `CONTEXT_TREES` and `MIXTURE_TREES` with `token_ids` (a
      note names the measured ones without). Priced from their shapes, never built; the
      recommended one is built when `report.layer.tree` (`trees` of a mixture) is read.
    adaptive: the tails of the `AdaptiveSoftmax` rows, of "flat" and "two_level" (() for
      none).
    cutoffs: the adaptive rows' cutoffs (default: for each tail those
      `tf_hsm.planning.cutoffs.choose_cutoffs` picks for this step, optimizer and machine, and
      one flat row at `pytorch_cutoffs`).
    div_value: the adaptive rows' div_value.
    progress: called with a line before each slow part (measuring, pricing a tree).
    model: a built Keras model, inspected by duck typing (`tf_hsm.planning.body`):
      the body up to the hidden states, or a model holding a HierarchicalSoftmax or
      AdaptiveSoftmax layer (its body: every other layer). Its step and memory are added
      to every row (`whole_step_seconds`, `whole_peak_bytes`); `report.body` holds its
      figures, a row per layer.
    sequence_length: with a `model` built for sequences of any length
      (`keras.Input([None])`), the length of a step's sequences (tokens_per_step is the
      batch times it). Needed where the body's cost depends on it (a recurrent or
      attention layer; a ValueError asks for it); otherwise the step's tokens are
      priced as one sequence.

  Returns:
    A `Report`. Every row carries `quality`: its measured perplexity against full
    softmax's (`tf_hsm.planning.quality`; None when the project has not measured that
    layer). The recommendation is the most accurate exact row that fits whose whole
    step is within QUALITY_MARGIN (20%) of the fastest whole step (ratios within
    QUALITY_TIE counting as equal, then the fastest), among the rows whose figures were
    measured at the vocabulary size nearest V and trained at least half as long as the
    longest-trained of them; rows of unknown quality are taken
    only when no row in the margin has a measured one, and then the fastest (steps
    within STEP_TIE equal; then full softmax before HierarchicalSoftmax before
    AdaptiveSoftmax, then the least peak memory). With none that fits, the exact one that
    needs the least memory. With `max_perplexity_increase` (a fraction: 0.1 is +10%
    perplexity against full softmax), the rule runs over the rows measured within it
    (full softmax always is); where none that fits is, over all (a note says so).
  """
  memory_budget = memory_budget_bytes(memory_budget)
  body, num_classes, hidden = _model_sizes(model, num_classes, hidden, tokens_per_step,
                                           counts, sequence_length)
  _check_plan_arguments(num_classes, hidden, tokens_per_step, num_shards, optimizer,
                        dtype, div_value, adaptive)
  text_note = _text_trees_note(num_classes, trees, token_ids)
  trees, token_ids = _trees_and_text(trees, token_ids, num_classes)
  _check_quality_bound(max_perplexity_increase)
  # A measurement of the machine is announced on stderr even without `progress`.
  machine = machine_lib.resolve(machine, progress)
  progress = progress or _quiet
  V, D, T = int(num_classes), int(hidden), int(tokens_per_step)
  probs = probabilities(V, counts)
  notes = []
  body_row = None
  if body is not None:
    body_row = body_lib.body_price(body, optimizer, dtype, machine)
    notes += body.notes
    if body.hidden != D:
      notes.append(f"the model's hidden states are {body.hidden} wide, planned at D={D}")

  def row(method, label, cost, exact=True):
    priced = price(method, cost, D, T, optimizer, dtype, machine, memory_budget,
                   num_shards, exact)
    priced["label"] = label
    return priced

  rows = [row("full softmax", "full softmax", flat_softmax_cost(V, D, T)),
          row("sampled softmax", "sampled", sampled_softmax_cost(V, D, T, probs),
              exact=False)]
  layers = [Layer("full softmax", "full softmax", f"HierarchicalSoftmax(Tree.flat({V}))",
                  num_classes=V), None]
  for tree in _candidate_trees(V, counts, trees, probs, T, progress, notes, token_ids):
    rows.append(row(f"{tree.kind} {tree.name}", _tree_label(tree.name),
                    tree.cost(D, T, probs)))
    layers.append(Layer(tree.kind, rows[-1]["method"], f"{tree.kind}({tree.code})",
                        _build=tree.build, rebuild=tree.rebuild, head=tree.head_ids,
                        head_rank=tree.head_rank))
  progress("choosing the adaptive softmax's cutoffs")
  order = _frequency_order(counts, probs, adaptive, notes)
  ranked = probs if order is None else probs[order]
  given = None if counts is None else np.asarray(counts, np.float64)
  for method, label, chosen, tail, div in _adaptive_layouts(
      V, D, T, ranked, optimizer, dtype, machine, adaptive, cutoffs, div_value, notes,
      given if order is None else given[order]):
    widths = ", ".join(map(str, tail_widths(D, len(chosen), div)))
    try:
      cost = adaptive_cost(V, D, T, chosen, div, tail,
                           counts if order is None else ranked)
    except ValueError as error:
      notes.append(f"no {method} {_short_list(chosen)} row: {error}")
      continue
    rows.append(row(f"{method} {_short_list(chosen)}, div {div:g} (tail widths "
                    f"{widths})", label, cost))
    rows[-1]["cutoffs"], rows[-1]["div_value"] = list(chosen), float(div)
    layers.append(Layer(
        "AdaptiveSoftmax", rows[-1]["method"],
        f"AdaptiveSoftmax(num_classes, cutoffs={list(chosen)}, div_value={div:g}, "
        f"tail={tail!r}" + (", counts=counts" if tail == "two_level" and
                            counts is not None else "") + (
            "" if order is None else
            ", class_order=AdaptiveSoftmax.frequency_order(counts, padding=())") + ")",
        list(chosen), tail, float(div), V, _counts=counts, _class_order=order))
  _add_quality_and_body(rows, body_row, V, notes)
  exact = _within_quality([r for r in rows if r["exact"] and r["fits"]],
                          max_perplexity_increase, notes)
  full = rows[0]
  if exact:
    best, reason = _choose(exact, full, body_row is not None)
    if max_perplexity_increase is not None and best["quality"] is not None and \
        best["quality"] <= 1 + max_perplexity_increase:
      reason = f"of the layers within {max_perplexity_increase:+.1%} perplexity, " + reason
  else:
    best = min((r for r in rows if r["exact"]), key=lambda r: r["per_shard_bytes"])
    reason = (f"nothing exact fits {_size(memory_budget)}; this one needs the least "
              f"({_size(best['per_shard_bytes'])}): add shards or memory")
  layer = _with_padding_id(layers[rows.index(best)], counts, notes, body)
  notes += _more_accurate_note(exact, best, rows[1]) + text_note
  notes += _fused_update_note(optimizer, layer)
  settings = {"num_classes": V, "hidden": D, "tokens_per_step": T, "optimizer": optimizer,
              "dtype": dtype, "memory_budget": memory_budget, "num_shards": num_shards,
              "machine": dataclasses.asdict(machine)}
  if max_perplexity_increase is not None:
    settings["max_perplexity_increase"] = float(max_perplexity_increase)
  if body_row is not None:
    settings["body"] = body_lib.describe(body_row)
  return Report(rows, best["method"], reason, settings, layer, notes, body_row)


def _with_padding_id(layer, counts, notes, body=None):
  """`layer` with the ignore_class of the model's tf_hsm layer (`body`'s), or, planned
  without one, with ignore_class=0 where class 0 has no count (the padding id of the
  README's models, whose targets would otherwise train it as a class and make it a
  top prediction), and a note saying so; `layer` as it is otherwise. An
  AdaptiveSoftmax leaves padding out through its class order instead (the counts'
  note says how)."""
  if layer.kind not in ("HierarchicalSoftmax", "HierarchicalSoftmaxMixture",
                        "full softmax"):
    return layer
  uncounted = counts is not None and np.asarray(counts)[0] == 0
  if body is not None and body.has_ignore_class:
    ignore = body.ignore_class  # the model's own choice stands: class 0 may be a cold item
    if ignore is None:
      if uncounted:
        notes.append("class 0 has no count; the model's layer keeps it a class "
                     "(ignore_class=None) and so does build(): if it is padding, pass "
                     "ignore_class=0")
      return layer
  elif uncounted:
    ignore = 0
    notes.append("class 0 has no count (padding, say): build() passes ignore_class=0, "
                 "so its targets are left out of the loss and it out of top_k's classes "
                 "(pass ignore_class=None to keep it a class)")
  else:
    return layer
  if ";" not in layer.code and layer.kind != "HierarchicalSoftmaxMixture":
    code = layer.code[:-1] + f", ignore_class={ignore})"  # HierarchicalSoftmax(tree, ...)
  else:  # a rebuild after the layer, or a mixture (build() gives it where it belongs)
    code = layer.code + f"; built with ignore_class={ignore}"
  return dataclasses.replace(layer, code=code, ignore_class=ignore)


def _text_trees_note(num_classes, trees, token_ids, within=0.01):
  """[why the table has no trees from contexts]: planned with the default `trees` and
  without the training text, the layers built from it (`CONTEXT_TREES`,
  `MIXTURE_TREES`) are not priced; those the project measured within `within` of full
  softmax's perplexity (else the most accurate one), by the names `trees` takes, and
  how to add them. [] otherwise, or if none was measured."""
  if trees is not None or token_ids is not None:
    return []
  measured = {kind: quality_lib.quality_of(kind, num_classes)
              for kind in CONTEXT_TREES + MIXTURE_TREES}
  measured = {kind: q for kind, q in measured.items() if q[0] is not None}
  if not measured:
    return []
  best = min(ratio for ratio, _ in measured.values())
  near = sorted((q[0], kind) for kind, q in measured.items()
                if q[0] <= max(best, 1 + within))
  sizes = quality_lib.sizes_text([f for _, kind in near for f in measured[kind][1]])
  return ["not priced: the trees built from the training text and their mixtures; "
          + ", ".join(f"{kind} {ratio - 1:+.1%}" for ratio, kind in near)
          + f" perplexity against full softmax (measured at {sizes}); pass token_ids, the "
          f"training text as class ids (--token-ids FILE.npy), to price them"]


def _more_accurate_note(exact, best, sampled, most=3):
  """[the trade the pick leaves]: the exact rows slower than `best` that are more
  accurate than every faster one (up to `most`, by step), each with its measured
  quality and its step over best's, and sampled softmax's for comparison; [] where no
  comparable row is more accurate. Only figures alike are compared (`_comparable`)."""
  key = "whole_step_seconds"
  if best not in exact or best["quality"] is None:
    return []
  slower = sorted((r for r in exact if r[key] > best[key] and r["quality"] is not None),
                  key=lambda r: r[key])
  compared, _ = _comparable([best] + slower)
  frontier, top = [], best["quality"] / (1 + QUALITY_TIE)
  for r in (r for r in slower if _among(r, compared)):
    if r["quality"] < top:
      frontier.append(r)
      top = r["quality"] / (1 + QUALITY_TIE)
  if not frontier:
    return []
  ratio = lambda r: r[key] / best[key]
  step = lambda r: (f"{_seconds(r[key])}, "
                    f"{ratio(r):{'.1f' if ratio(r) < 10 else ',.0f'}}x its step")
  if len(frontier) > most:  # the nearest, and the most accurate
    frontier = frontier[:most - 1] + frontier[-1:]
  trade = [f"{r['label']} ({r['quality'] - 1:+.1%} perplexity, {step(r)})"
           for r in frontier]
  # Sampled softmax beside them, faster or slower, more or less accurate than the pick.
  beside = ""
  if sampled.get("quality") is not None and sampled in _comparable([best, sampled])[0]:
    beside = (f" (sampled softmax, approximate: {sampled['quality'] - 1:+.1%}, "
              f"{step(sampled)})")
  return [f"more accurate than the pick ({best['quality'] - 1:+.1%}), and slower: "
          + "; ".join(trade) + beside]


def _fused_update_note(optimizer, layer):
  """[the note that a recommended tree trains faster in `fit` with `fused_update`], for
  LazyAdam; [] otherwise."""
  if optimizer != "lazy_adam" or layer is None or layer.kind not in (
      "HierarchicalSoftmax", "HierarchicalSoftmaxMixture", "full softmax"):
    return []
  return ["in Keras 3's model.fit with LazyAdam, layer.build(fused_update=True) applies "
          "the table's update inside the layer's backward pass: the same weights, no "
          "gradient of the table written (a fit step 1.14-1.28x faster at V=1M, D=300, "
          "T=3,200); the step is priced here unfused (docs/usage.md, \"Fused update in "
          "model.fit\")"]


def _model_sizes(model, num_classes, hidden, tokens_per_step, counts, sequence_length):
  """(the body's cost or None, num_classes, hidden): the sizes a `model` gives where
  they are not given."""
  if model is None:
    if sequence_length is not None:
      raise ValueError("sequence_length is for plan(model=...): without a model, "
                       "tokens_per_step alone sizes the output layer")
    return None, num_classes, hidden
  if tokens_per_step is None:
    raise ValueError("tokens_per_step is required with a model: the outputs a "
                     "training step scores (batch x sequence length)")
  body = body_lib.body_cost(model, tokens_per_step, sequence_length)
  if hidden is None:
    hidden = body.hidden
  if num_classes is None:
    num_classes = body.num_classes
    if num_classes is None and counts is not None:
      num_classes = len(counts)
  if num_classes is None:
    raise ValueError("num_classes is required: the model holds no tf_hsm output layer "
                     "to read it from")
  return body, num_classes, hidden


def _check_quality_bound(bound):
  if bound is not None and (isinstance(bound, bool) or not isinstance(
      bound, (int, float, np.integer, np.floating)) or not 0 <= bound < math.inf):
    raise ValueError("max_perplexity_increase must be a fraction >= 0 (0.1: +10% "
                     f"perplexity against full softmax) or None, got {bound!r}")


def _within_quality(rows, bound, notes):
  """The rows measured within `bound` (a fraction over full softmax's perplexity), or all
  of `rows` with a note where `bound` is None or none of them is. Only figures that
  `_comparable` compares vouch for a row (an early or far figure can flatter it); full
  softmax is always within."""
  if bound is None:
    return rows
  compared = _comparable([r for r in rows if r["quality"] is not None])[0]
  within = [r for r in rows if r["method"] == "full softmax" or (
      _among(r, compared) and r["quality"] <= 1 + bound)]
  if within:
    return within
  if rows:
    notes.append(f"no layer that fits was measured within {bound:+.1%} perplexity: the "
                 "recommendation is the rule's over every layer")
  return rows


def _check_plan_arguments(num_classes, hidden, tokens_per_step, num_shards, optimizer,
                          dtype, div_value, adaptive):
  for name, value in (("num_classes", num_classes), ("hidden", hidden),
                      ("tokens_per_step", tokens_per_step), ("num_shards", num_shards)):
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
      raise ValueError(f"{name} must be a positive int, got {value!r}")
  if num_classes < 2:
    raise ValueError("num_classes must be at least 2")
  if optimizer not in OPTIMIZERS:
    raise ValueError(f"optimizer must be one of {sorted(OPTIMIZERS)}, got {optimizer!r}")
  if dtype not in DTYPE_BYTES:
    raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {dtype!r}")
  if (isinstance(div_value, bool) or not isinstance(div_value, (int, float, np.number)) or
      not math.isfinite(div_value) or div_value <= 0):
    raise ValueError(f"div_value must be a positive number, got {div_value!r}")
  if isinstance(adaptive, str):
    raise TypeError(f"adaptive must be a list of tails, got {adaptive!r}")
  for tail in adaptive:
    if tail not in TAILS:
      raise ValueError(f"adaptive tails must be of {TAILS}, got {tail!r}")


def _add_quality_and_body(rows, body_row, num_classes, notes):
  """Adds to each row its measured quality (`tf_hsm.planning.quality`) and the whole
  step and peak with the model's body; notes the rows of unknown quality."""
  for r in rows:
    kind = quality_lib.kind_of(r["method"], r.get("cutoffs"), r.get("div_value"),
                               num_classes)
    # The evidence of the measured vocabulary size nearest to this V, which it names.
    r["quality"], _ = quality_lib.quality_of(kind, num_classes) if kind else (None, [])
    r["quality_kind"] = kind
    r["quality_evidence"] = (quality_lib.describe(kind, num_classes) if kind else
                             "not measured")
    r["quality_far"] = bool(kind) and quality_lib.is_far_kind(kind, num_classes)
    r["quality_scale_gap"] = quality_lib.scale_gap(kind, num_classes) if kind else None
    r["quality_tokens"] = quality_lib.training_tokens(kind, num_classes) if kind else None
    r["body_seconds"] = body_row["step_seconds"] if body_row else 0.0
    r["whole_step_seconds"] = r["step_seconds"] + r["body_seconds"]
    # One step's workspace: the body's peak adds its tensors only.
    r["whole_peak_bytes"] = r["peak_bytes"] + (body_row["peak_bytes"] if body_row else 0)
  unknown = [r["label"] for r in rows if r["quality"] is None]
  if unknown:
    notes.append("quality not measured (no documented perplexity; docs/planner.md, "
                 "Quality): " + ", ".join(unknown))


def _quality_pick(exact, key="whole_step_seconds"):
  """(row, measured): the quality rule, shared by `plan` and `recommend_tree`. Of
  `exact` (rows carrying `quality` and `key`), the most accurate whose `key` is within
  QUALITY_MARGIN of the fastest (ratios within QUALITY_TIE of the best count as equal,
  then the fastest by `_pick`); rows of unknown quality only when none in the margin
  has a measured one, and then the fastest (`_pick`). Only rows whose figures are alike
  are compared (`_comparable`). `measured`: whether the row was chosen by its quality."""
  fastest = min(r[key] for r in exact)
  margin = [r for r in exact if r[key] <= fastest * (1 + QUALITY_MARGIN)]
  known = _comparable([r for r in margin if r["quality"] is not None])[0]
  if not known:
    return _pick(margin, key), False
  top = min(r["quality"] for r in known)
  return _pick([r for r in known if r["quality"] <= top * (1 + QUALITY_TIE)], key), True


def _comparable(known):
  """(compared, set aside) of rows with measured quality: compared, those measured at the
  vocabulary size nearest V (`quality_scale_gap`: a tree's cost in perplexity grows with
  V, so a 6K-word figure would flatter a row against one measured at 100K) and trained
  at least half as long as the longest-trained of those (`quality_tokens`: the gaps to
  full softmax grow with training, so a figure after 4M tokens would flatter a row
  against one after an epoch)."""
  if not known:
    return [], []
  near = [r for r in known if _scale_gap(r) <= min(map(_scale_gap, known)) + 1e-9]
  tokens = lambda r: r.get("quality_tokens") or math.inf
  longest = max(map(tokens, near))
  compared = [r for r in near if tokens(r) >= 0.5 * longest]
  return compared, [r for r in known if not _among(r, compared)]


def _set_aside_note(exact, key, best):
  """The measured rows in the margin that `_comparable` did not compare, and why."""
  fastest = min(r[key] for r in exact)
  margin = [r for r in exact if r[key] <= fastest * (1 + QUALITY_MARGIN)]
  _, aside = _comparable([r for r in margin if r["quality"] is not None])
  if not aside:
    return ""
  why = lambda r: ("measured at a vocabulary size farther from this V's"
                   if _scale_gap(r) > _scale_gap(best) + 1e-9 else
                   f"measured after {r['quality_tokens'] / 1e6:.1f}M training tokens only")
  return "; not compared: " + ", ".join(
      f"{r['label']} ({r['quality'] - 1:+.1%}, {why(r)})" for r in aside)


def _near_miss_note(exact, key, best):
  """The most accurate row just outside the margin (within NEAR_MISS beyond it) whose
  figure is comparable with `best`'s and better, named with its quality and step."""
  fastest = min(r[key] for r in exact)
  near = [r for r in exact if r["quality"] is not None and
          fastest * (1 + QUALITY_MARGIN) < r[key] <= fastest * (1 + QUALITY_MARGIN + NEAR_MISS)]
  compared, _ = _comparable([best] + near)
  better = [r for r in compared if r is not best and
            r["quality"] < best["quality"] / (1 + QUALITY_TIE)]
  if not better:
    return ""
  r = min(better, key=lambda r: (r["quality"], r[key]))
  return (f"; just outside the margin: {r['label']} ({r['quality'] - 1:+.1%} perplexity, "
          f"{_seconds(r[key])}, {r[key] / fastest - 1:+.0%} over the fastest)")


def _choose(exact, full, whole):
  """(row, one-line reason): `_quality_pick` of `exact` by whole step, and why."""
  key = "whole_step_seconds"
  step = "whole step" if whole else "step"
  fastest = min(r[key] for r in exact)
  best, measured = _quality_pick(exact, key)
  if not measured:
    return best, (
        f"no layer within {QUALITY_MARGIN:.0%} of the fastest {step} has a measured "
        f"quality: the fastest, {_seconds(best[key])} a {step} "
        f"({full[key] / best[key]:.1f}x full softmax), peak {_size(best['peak_bytes'])}, "
        "quality unknown")
  faster = [r for r in exact if r[key] < best[key] * (1 - 1e-9)]
  worse = ""
  if faster:
    quickest = min(faster, key=lambda r: r[key])
    worse = (f"; the fastest, {quickest['label']} ({_seconds(quickest[key])}), "
             + ("quality unknown" if quickest["quality"] is None else
                f"{quickest['quality'] - 1:+.1%} perplexity")
             + (" at a vocabulary size farther from this V's"
                if _among(quickest, _farther_rows(exact)) else ""))
  return best, (
      f"the most accurate measured layer within {QUALITY_MARGIN:.0%} of the fastest "
      f"{step}: {best['quality'] - 1:+.1%} perplexity against full softmax "
      f"({best['quality_evidence']}), {_seconds(best[key])} a {step} "
      f"({best[key] / fastest - 1:+.0%} over the fastest){worse}"
      f"{_near_miss_note(exact, key, best)}{_set_aside_note(exact, key, best)}")


def recommend_tree(num_classes, hidden, tokens_per_step, counts=None, optimizer="sgd",
                   dtype="float32", memory_budget=None, machine=None, trees=HSM_TREES,
                   progress=None, token_ids=None, max_perplexity_increase=None):
  """The `HierarchicalSoftmax` tree to use, chosen by `plan`'s rule (the same code,
  `_quality_pick`) among the hierarchical rows alone: of `trees` (as `plan` takes them)
  that fit `memory_budget`, the most accurate by the project's measured perplexity
  against full softmax (`tf_hsm.planning.quality`) among those whose predicted step is
  within QUALITY_MARGIN (20%) of the fastest's, ratios within QUALITY_TIE counting as
  equal, then the faster (steps within STEP_TIE equal, then the least peak memory);
  trees of unknown quality only when none within the margin has a measured one, and
  then the fastest. When none fits, the smallest. Only that tree is built. ("learned"
  is not among the defaults: its layer starts on the two-level tree, which is what it
  would return, and needs `tf_hsm.callbacks.RebuildTree` to become the learned tree.)
  `token_ids`: the training text, for a context tree among `trees`, and
  `max_perplexity_increase`, the bound on the trees' measured perplexity, as `plan`'s.

  Returns:
    (tree, row): the `tf_hsm.Tree` and its planner row (a dict, as in `plan`'s rows,
    with `quality`, None where not measured).

  Raises:
    ValueError: if no tree of `trees` can be built for `num_classes`, or a context tree
      is asked for without `token_ids`.
  """
  V, D, T = int(num_classes), int(hidden), int(tokens_per_step)
  trees, token_ids = _trees_and_text(trees, token_ids, V, mixtures=False)
  mixtures = [name for name in trees if name.startswith("mixture")]
  if mixtures:
    raise ValueError(f"{mixtures[0]} is a HierarchicalSoftmaxMixture of trees, not a "
                     "tree: tf_hsm.plan(...) prices and recommends it")
  _check_quality_bound(max_perplexity_increase)
  memory_budget = memory_budget_bytes(memory_budget)
  probs = probabilities(V, counts)
  machine = machine_lib.resolve(machine, progress)
  progress = progress or _quiet
  notes = []
  candidates = [(tree, price(f"HierarchicalSoftmax {tree.name}",
                             tree.cost(D, T, probs), D, T, optimizer, dtype,
                             machine, memory_budget))
                for tree in _candidate_trees(V, counts, trees, probs, T, progress, notes,
                                             token_ids)]
  if not candidates:
    raise ValueError(f"no tree among {list(trees)} can be built for {V} classes: "
                     + "; ".join(notes))
  rows = [row for _, row in candidates]
  for row in rows:
    row["label"] = row["method"]
  _add_quality_and_body(rows, None, V, notes)
  fitting = _within_quality([row for row in rows if row["fits"]], max_perplexity_increase,
                            notes)
  best = _quality_pick(fitting)[0] if fitting else min(rows, key=lambda r: r["peak_bytes"])
  tree = next(t for t, row in candidates if row is best)
  return tree.build(), best
