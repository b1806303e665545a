"""Sizing an output layer before training: memory, FLOPs, rows touched and step time of
each candidate (full softmax, sampled softmax, hierarchical softmax over several trees),
and the one to use.

    report = tf_hsm.plan(10_000_000, 300, 3200, counts=counts, optimizer="lazy_adam",
                         memory_budget=24 * 2**30)
    print(report.to_markdown())

    python -m tf_hsm.planning --classes 10M --hidden 300 --tokens 3200 --optimizer lazy_adam \\
        --memory 24GiB --zipf 1.0

The figures are expected values for a step of `tokens_per_step` tokens drawn from
`counts`, computed from the trees themselves: a node's children are read (and get a
gradient row) when at least one token visits the node, which a step of T tokens does with
probability 1 - (1 - p)^T, p the node's probability. Step time is a roofline:
max(FLOPs / matmul rate, bytes / read bandwidth) plus a per-call overhead, with the
machine's rates measured once and cached (or given, to plan for another machine); the
hierarchical-softmax rows use a linear model of FLOPs, bytes and node visits fitted to
tf_hsm's own training steps, measured with the rates (`tf_hsm.planning.step_fit`).
"""

import dataclasses
import math
import re

import numpy as np

from tf_hsm.planning import machine as machine_lib
from tf_hsm.planning.costs import (DIV_VALUE, DTYPE_BYTES, OPTIMIZERS, TAILS,
                                   adaptive_cost, full_softmax_cost, probabilities,
                                   pytorch_cutoffs, sampled_softmax_cost, tail_widths,
                                   tree_cost)
from tf_hsm.planning.pricing import price
from tf_hsm.planning.cutoffs import choose_cutoffs
from tf_hsm.tree import Tree


@dataclasses.dataclass
class Report:
  """The plan: `rows` (one dict per candidate), `recommended` (a row's `method`) and
  `reason` (one line)."""
  rows: list
  recommended: str
  reason: str
  settings: dict

  def to_dict(self):
    return {"rows": self.rows, "recommended": self.recommended, "reason": self.reason,
            "settings": self.settings}

  def to_markdown(self):
    s = self.settings
    lines = [
        f"V={s['num_classes']:,}, D={s['hidden']}, T={s['tokens_per_step']:,} tokens a "
        f"step, {s['optimizer']}, {s['dtype']}"
        + (f", {s['num_shards']} shards" if s["num_shards"] > 1 else "")
        + (f", budget {_size(s['memory_budget'])}" if s["memory_budget"] else ""),
        "",
        "| method | params | grad | slots | peak | per shard | rows touched | GFLOP | "
        "MB moved | step | fits |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in self.rows:
      lines.append(
          f"| {row['method']} | {_size(row['param_bytes'])} | {_size(row['grad_bytes'])} | "
          f"{_size(row['slot_bytes'])} | {_size(row['peak_bytes'])} | "
          f"{_size(row['per_shard_bytes'])} | {row['rows_touched']:,.0f} | "
          f"{row['flops'] / 1e9:,.2f} | {row['bytes_moved'] / 1e6:,.0f} | "
          f"{_seconds(row['step_seconds'])} | {'yes' if row['fits'] else 'no'} |")
    lines += ["", f"Recommended: {self.recommended}: {self.reason}"]
    return "\n".join(lines)


def _size(value):
  if value is None:
    return "-"
  for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if value >= scale:
      return f"{value / scale:.2f} {unit}"
  return f"{value:.0f} B"


def _seconds(value):
  return f"{value * 1e3:.1f} ms" if value < 1 else f"{value:.2f} s"


TREES = ("two_level", "three_level", "huffman2", "huffman8", "huffman32")


def _candidate_trees(num_classes, counts, names):
  """(name, tree) for the hierarchical-softmax rows."""
  trees = []
  huffman_counts = counts if counts is not None else np.ones(num_classes)
  for name in names:
    if name == "two_level":
      trees.append(("two_level(counts)" if counts is not None else "two_level",
                    Tree.two_level(num_classes, counts=counts)))
    elif name == "three_level":
      branching = max(2, math.ceil(num_classes ** (1 / 3)))
      trees.append((f"balanced({branching}), three levels",
                    Tree.balanced(num_classes, branching)))
    elif re.fullmatch(r"huffman\d+", name):
      k = int(name[len("huffman"):])
      if 2 <= k < num_classes:
        trees.append((f"huffman({k})", Tree.huffman(huffman_counts, branching=k)))
    else:
      raise ValueError(f"unknown tree {name!r}; known: {', '.join(TREES)} (huffmanK for "
                       "any K)")
  return trees




def _short_list(values):
  return "[" + ", ".join(f"{v:,}" for v in values) + "]"


def _adaptive_layouts(V, D, T, probs, optimizer, dtype, machine, tails, cutoffs,
                      div_value):
  """(method, cutoffs, tail) of the adaptive rows: the given cutoffs for each tail, or
  the cutoffs `choose_cutoffs` picks for each tail and, to compare with, flat tails at
  PyTorch-style fixed cutoffs."""
  if cutoffs is not None:
    return [(f"AdaptiveSoftmax {tail}, cutoffs", list(cutoffs), tail) for tail in tails]
  layouts = []
  for tail in tails:
    try:
      chosen = choose_cutoffs(probs, D, T, div_value, tail, machine, optimizer=optimizer,
                              dtype=dtype)
    except ValueError:  # D too narrow for a cluster of min_width, or V too small
      continue
    layouts.append((f"AdaptiveSoftmax {tail}, chosen cutoffs", chosen, tail))
  fixed = pytorch_cutoffs(V, D, div_value)
  if fixed and "flat" in tails:
    layouts.append(("AdaptiveSoftmax flat, PyTorch-style fixed cutoffs", fixed, "flat"))
  return layouts


def plan(num_classes, hidden, tokens_per_step, counts=None, optimizer="sgd",
         dtype="float32", memory_budget=None, num_shards=1, machine=None, trees=TREES,
         adaptive=TAILS, cutoffs=None, div_value=DIV_VALUE):
  """Plans the output layer of a model: one row per candidate and a recommendation.

  Args:
    num_classes: V.
    hidden: D, the hidden size.
    tokens_per_step: T, tokens (outputs) in a training step.
    counts: class frequencies [V] (uniform if None); class ids by decreasing frequency
      for the adaptive rows, whose head holds the first classes.
    optimizer: one of "sgd", "momentum", "adagrad", "adam", "lazy_adam" (the table's
      optimizer; tf_hsm's sparse ones update touched rows only).
    dtype: "float32", "float64", "bfloat16" or "float16" (the table's).
    memory_budget: bytes available per device (per parameter server with num_shards),
      or None.
    num_shards: parameter servers the table and slots are split over.
    machine: a `Machine` (default: measured once and cached), or a dict of its fields.
    trees: the trees of the hierarchical-softmax rows: "two_level" (equal-mass clusters
      with counts), "three_level" (balanced, branching V^(1/3)), "huffmanK" (K-ary
      Huffman on the counts). Building them is most of the planner's time at 10M classes.
    adaptive: the tails of the `AdaptiveSoftmax` rows, of "flat" and "two_level" (() for
      none).
    cutoffs: the adaptive rows' cutoffs (default: for each tail those
      `tf_hsm.planning.cutoffs.choose_cutoffs` picks for this step, optimizer and machine, and
      one flat row at `pytorch_cutoffs`).
    div_value: the adaptive rows' div_value.

  Returns:
    A `Report`.
  """
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
  machine = machine_lib.resolve(machine)
  V, D, T = int(num_classes), int(hidden), int(tokens_per_step)
  probs = probabilities(V, counts)

  def row(method, cost, exact=True):
    return price(method, cost, D, T, optimizer, dtype, machine, memory_budget, num_shards,
                 exact)

  rows = [row("full softmax", full_softmax_cost(V, D, T)),
          row("sampled softmax", sampled_softmax_cost(V, D, T, probs), exact=False)]
  for name, tree in _candidate_trees(V, counts, trees):
    rows.append(row(f"HierarchicalSoftmax {name}", tree_cost(tree, D, T, probs)))
  for method, chosen, tail in _adaptive_layouts(V, D, T, probs, optimizer, dtype, machine,
                                                adaptive, cutoffs, div_value):
    widths = ", ".join(map(str, tail_widths(D, len(chosen), div_value)))
    rows.append(row(f"{method} {_short_list(chosen)}, div {div_value:g} (tail widths "
                    f"{widths})", adaptive_cost(V, D, T, chosen, div_value, tail, counts)))
  exact = [r for r in rows if r["exact"] and r["fits"]]
  if exact:
    best = min(exact, key=lambda r: r["step_seconds"])
    full = rows[0]
    reason = (f"the fastest exact layer that fits: {_seconds(best['step_seconds'])} a step "
              f"({full['step_seconds'] / best['step_seconds']:.0f}x full softmax), "
              f"{best['rows_touched']:,.0f} rows touched, peak {_size(best['peak_bytes'])}")
    recommended = best["method"]
  else:
    smallest = min(rows, key=lambda r: r["per_shard_bytes"])
    recommended = smallest["method"]
    reason = (f"nothing exact fits {_size(memory_budget)}; this one needs the least "
              f"({_size(smallest['per_shard_bytes'])}): add shards or memory")
  settings = {"num_classes": V, "hidden": D, "tokens_per_step": T, "optimizer": optimizer,
              "dtype": dtype, "memory_budget": memory_budget, "num_shards": num_shards,
              "machine": dataclasses.asdict(machine)}
  return Report(rows, recommended, reason, settings)


def recommend_tree(num_classes, hidden, tokens_per_step, counts=None, optimizer="sgd",
                   dtype="float32", memory_budget=None, machine=None, trees=TREES):
  """The `HierarchicalSoftmax` tree the planner prices fastest among `trees` (as `plan`
  builds them) that fits `memory_budget`, or the smallest when none fits.

  Returns:
    (tree, row): the `tf_hsm.Tree` and its planner row (a dict, as in `plan`'s rows).
  """
  V, D, T = int(num_classes), int(hidden), int(tokens_per_step)
  probs = probabilities(V, counts)
  machine = machine_lib.resolve(machine)
  candidates = [(tree, price(f"HierarchicalSoftmax {name}", tree_cost(tree, D, T, probs),
                             D, T, optimizer, dtype, machine, memory_budget))
                for name, tree in _candidate_trees(V, counts, trees)]
  if not candidates:
    raise ValueError(f"no tree among {list(trees)} can be built for {V} classes")
  fitting = [c for c in candidates if c[1]["fits"]]
  if fitting:
    return min(fitting, key=lambda c: c[1]["step_seconds"])
  return min(candidates, key=lambda c: c[1]["peak_bytes"])

