"""The planner's hierarchical-softmax candidates: the tree names `plan` takes (`TREES`,
`CONTEXT_TREES`, `MIXTURE_TREES`), each name's shape priced without building the tree
(a `TreeWork`), how to build it, its `RebuildTree` arguments, and its row's label."""

import dataclasses
import math
import re

import numpy as np

from tf_hsm.planning.costs import mixture_cost, tree_cost
from tf_hsm.planning.tree_work import huffman_work, layout_work, vectors_work
from tf_hsm.tree import Tree
from tf_hsm.tree import builders
from tf_hsm.tree import context
from tf_hsm.tree import vectors as tree_vectors


HSM_TREES = ("two_level", "three_level", "huffman2", "huffman8", "huffman32")
# "learned": the demo's learned tree (a head of the most frequent classes at the root,
# the rest in about sqrt(V) similarity clusters, rebuilt from trained embeddings after
# epoch 1 by `tf_hsm.callbacks.RebuildTree`), priced as that shape with clusters of
# equal size (similarity clusters mix frequencies); its layer starts on the two-level
# tree of the counts.
# "vectorsK_headH": H frequent classes at the root, the rest K-ary by similarity: the
# layer starts on `Tree.huffman(counts, K)` and RebuildTree rebuilds it from the input
# embeddings (`Tree.from_vectors(..., branching=K, head=H)`) after VECTORS_REBUILD_AFTER
# batches; priced as that shape with a Huffman tree of the other classes under the root
# (`tree_work.vectors_work`; `from_vectors` balances mass as Huffman's merges do). The two measured
# at large vocabularies that train at least twice as fast as sampled softmax at V=1M
# (docs/planner.md, "Large vocabularies").
VECTOR_TREES = ("vectors32_head256", "vectors64_head256")
TREES = HSM_TREES + ("learned",) + VECTOR_TREES
# "contextK_headH": the same shape built before training from the words' left contexts in
# the training text (`Tree.from_context(token_ids, ..., branching=K, head=H)`, no
# rebuild; docs/planner.md, "Trees from contexts"): priced as the vectors rows, and a row
# only where `plan` is given the training text's `token_ids` to build it from.
# "mixtureK_headH": `HierarchicalSoftmaxMixture` of two such trees, one from the words'
# left contexts and one from their right (`Tree.from_context(..., side="right")`),
# mixed by a gate on the hidden state (docs/planner.md, "A mixture of two context
# trees"): priced as two of those trees and the gate, a row likewise only with the text.
# "mixtureNxK_headH": N such trees, left and right, then left and right again clustered
# from other seeds (seed i // 2 for the i-th), as the demo's `--mixture N`.
# "mixtureNxK_sharedH": N K-ary context trees over the classes below one shared head of
# the H most frequent (`HierarchicalSoftmaxMixture(head=...)`, the demo's
# `--shared-head`): the head's softmax priced once over every token, each tree over the
# tail's tokens only; "..._rankR" with each tree's correction of the head at rank R
# (`head_rank=R`, the demo's `--head-rank`).
CONTEXT_TREES = ("context32_head256",)
MIXTURE_TREES = ("mixture32_head256", "mixture16_head128", "mixture3x16_head128",
                 "mixture4x16_head128", "mixture16_shared128", "mixture3x16_shared128",
                 "mixture4x16_shared128", "mixture16_shared128_rank16",
                 "mixture3x16_shared128_rank16", "mixture4x16_shared128_rank16")
# A context row's name: (context|vectors|mixture[Nx])K_headH or
# mixture[Nx]K_sharedH[_rankR].
_HEAD_TREE_NAME = (r"(context|vectors|mixture(\d+x)?)\d+_head\d+|"
                   r"mixture(\d+x)?\d+_shared\d+(_rank\d+)?")
LEARNED_HEAD = 128
VECTORS_REBUILD_AFTER = 1000


def learned_layout(num_classes, counts):
  """The learned tree's shape: (child_begin, slot_child, num_classes, head, width)."""
  C = int(num_classes)
  head = min(LEARNED_HEAD, C // 8)
  width = max(2, math.ceil(math.sqrt(C)))
  order = (np.arange(C) if counts is None else
           np.argsort(-np.asarray(counts, np.float64), kind="stable"))
  top, rest = order[:head], order[head:]
  K = max(1, min(width, rest.size))
  members = [rest[i::K] for i in range(K)]
  sizes = np.array([m.size for m in members], np.int64)
  child_begin = np.concatenate([[0, K + head], K + head + np.cumsum(sizes)])
  slot_child = np.concatenate([C + np.arange(1, K + 1), top] + members).astype(np.int64)
  return child_begin, slot_child, C, head, width


def vectors_layout(num_classes, counts, branching, head):
  """The shape a tree from vectors is priced as: the `head` most frequent classes as leaf
  children of the root beside the root's children of `branching`-ary Huffman tree of
  the other classes. (child_begin, slot_child, num_classes)."""
  C = int(num_classes)
  w = np.ones(C) if counts is None else np.asarray(counts, np.float64)
  order = np.argsort(-w, kind="stable")
  top, rest = order[:head], np.sort(order[head:])
  sub_begin, sub_child, n = builders.huffman(w[rest], branching)
  sub_begin, sub_child = np.asarray(sub_begin, np.int64), np.asarray(sub_child, np.int64)
  mapped = np.where(sub_child < n, rest[np.minimum(sub_child, n - 1)], sub_child - n + C)
  r = int(sub_begin[1])
  child_begin = np.concatenate([[0], sub_begin[1:] + len(top)])
  slot_child = np.concatenate([mapped[:r], top, mapped[r:]]).astype(np.int64)
  return child_begin, slot_child, C


@dataclasses.dataclass
class _TreeCandidate:
  name: str  # as the row's method shows it
  code: str  # how to build it
  work: object  # its TreeWork
  build: object  # () -> the Tree, or for a mixture the list of its trees
  rebuild: dict = None  # RebuildTree's arguments (but the layer and vectors), if any
  trees: int = 1  # a HierarchicalSoftmaxMixture's trees, each of `work`'s shape
  head_work: object = None  # a shared head's TreeWork (one node), for a mixture
  head_ids: object = None  # the shared head's classes
  head_rank: int = None  # each tree's correction of the shared head, its rank

  def cost(self, hidden, tokens_per_step, probs):
    one = tree_cost(self.work, hidden, tokens_per_step, probs)
    if self.trees == 1:
      return one
    head = None if self.head_work is None else tree_cost(self.head_work, hidden,
                                                         tokens_per_step, probs)
    return mixture_cost([one] * self.trees, hidden, tokens_per_step, head, self.head_rank,
                        None if self.head_ids is None else len(self.head_ids) + 1)

  @property
  def kind(self):
    return "HierarchicalSoftmax" if self.trees == 1 else "HierarchicalSoftmaxMixture"


def _candidate_trees(num_classes, counts, names, probs, tokens, progress, notes,
                     token_ids=None):
  """The hierarchical-softmax candidates: each tree's `TreeWork` from its shape alone
  (the layout of a two-level or balanced tree, a Huffman tree's merges), never its
  paths: the `Tree` is built only for the one recommended (a context tree from
  `token_ids`)."""
  found = []
  huffman_counts = counts if counts is not None else np.ones(num_classes)
  for i, name in enumerate(names):
    progress(f"pricing tree {i + 1}/{len(names)}: {name}")
    if name == "two_level":
      layout = builders.two_level(num_classes, counts)
      found.append(_TreeCandidate(
          "two_level(counts)" if counts is not None else "two_level",
          "Tree.two_level(num_classes, counts=counts)" if counts is not None else
          "Tree.two_level(num_classes)", layout_work(*layout, probs, tokens),
          lambda: Tree.two_level(num_classes, counts=counts)))
    elif name == "three_level":
      branching = max(2, math.ceil(num_classes ** (1 / 3)))
      layout = builders.balanced(num_classes, branching)
      found.append(_TreeCandidate(
          f"balanced({branching})", f"Tree.balanced(num_classes, {branching})",
          layout_work(*layout, probs, tokens),
          lambda b=branching: Tree.balanced(num_classes, b)))
    elif name == "learned":
      *layout, head, width = learned_layout(num_classes, counts)
      found.append(_TreeCandidate(
          f"learned(head={head}, width={width})",
          "Tree.two_level(num_classes, counts=counts)); rebuilt after epoch 1 by "
          f"tf_hsm.callbacks.RebuildTree(layer, branching=[{width}, {width}], "
          f"counts=counts, vectors=embedding_layer, head={head}, after_epoch=1",
          layout_work(*layout, probs, tokens),
          lambda: Tree.two_level(num_classes, counts=counts),
          {"branching": [width, width], "counts": counts, "head": head,
           "after_epoch": 1}))
    elif re.fullmatch(_HEAD_TREE_NAME, name):
      rank = re.findall(r"_rank(\d+)$", name)
      *count, k, head = map(int, re.findall(r"\d+", re.sub(r"_rank\d+$", "", name)))
      if count and count[0] < 2:
        notes.append(f"no {name} row: a mixture has at least 2 trees")
        continue
      if not (2 <= k and 0 <= head and head + k < num_classes):
        notes.append(f"no {name} row: it needs V > {head + k} classes")
        continue
      if "_shared" in name and head < 1:
        notes.append(f"no {name} row: a shared head holds at least 1 class")
        continue
      if rank and int(rank[0]) < 1:
        notes.append(f"no {name} row: a head's correction has a rank of at least 1")
        continue
      if "_shared" in name:
        found.append(_shared_mixture((count or [2])[0], k, head, num_classes, counts,
                                     probs, tokens, token_ids,
                                     int(rank[0]) if rank else None))
        continue
      work = vectors_work(huffman_counts, k, head, probs, tokens)
      found.append(_context_mixture((count or [2])[0], k, head, num_classes, counts, work,
                                    token_ids)
                   if name.startswith("mixture") else
                   _head_tree(name.startswith("context"), k, head, num_classes, counts,
                              work, token_ids))
    elif re.fullmatch(r"huffman\d+", name):
      k = int(name[len("huffman"):])
      if not 2 <= k < num_classes:
        notes.append(f"no huffman({k}) row: a {k}-ary tree needs 2 <= K < V={num_classes}")
        continue
      found.append(_TreeCandidate(
          f"huffman({k})", f"Tree.huffman(counts, branching={k})",
          huffman_work(huffman_counts, k, probs, tokens),
          lambda k=k: Tree.huffman(huffman_counts, branching=k)))
    else:
      raise ValueError(f"unknown tree {name!r}; known: {', '.join(TREES)} (huffmanK for "
                       "any K)")
    layout = None
  return found


def _head_tree(from_context, k, head, num_classes, counts, work, token_ids):
  """The candidate of a head over K-ary similarity clusters: built from the training
  text's contexts before training, or rebuilt from the input embeddings during it
  (started on the K-ary Huffman tree of the counts)."""
  if from_context:
    return _TreeCandidate(
        f"context({k}, head={head})",
        f"Tree.from_context(token_ids, num_classes, counts, branching={k}, head={head})",
        work, lambda: Tree.from_context(token_ids, num_classes, counts, branching=k,
                                        head=head))
  huffman_counts = counts if counts is not None else np.ones(num_classes)
  return _TreeCandidate(
      f"vectors({k}, head={head})",
      f"Tree.huffman(counts, branching={k})); rebuilt after {VECTORS_REBUILD_AFTER:,} "
      f"batches by tf_hsm.callbacks.RebuildTree(layer, branching={k}, counts=counts, "
      f"vectors=embedding_layer, head={head}, after_batch={VECTORS_REBUILD_AFTER}",
      work, lambda: Tree.huffman(huffman_counts, branching=k),
      {"branching": k, "counts": counts, "head": head,
       "after_batch": VECTORS_REBUILD_AFTER})


def _context_trees(count, k, num_classes, counts, token_ids, given, **kwargs):
  """(build, code) of `count` K-ary context trees (`context.mixture_sides`), each
  `Tree.from_context(..., **kwargs)`, `given` the keyword arguments as the code shows
  them."""
  sides = context.mixture_sides(count)

  def build():
    return [Tree.from_context(token_ids, num_classes, counts, branching=k, side=side,
                              seed=seed, **kwargs) for side, seed in sides]
  code = ", ".join(f"Tree.from_context(token_ids, num_classes, counts, branching={k}, "
                   f"{given}" + (", side='right'" if side == "right" else "")
                   + (f", seed={seed}" if seed else "") + ")" for side, seed in sides)
  return build, code


def _context_mixture(count, k, head, num_classes, counts, work, token_ids):
  """The candidate of `HierarchicalSoftmaxMixture` over `count` trees of the words'
  contexts (each a head over K-ary clusters, built before training)."""
  build, code = _context_trees(count, k, num_classes, counts, token_ids, f"head={head}",
                               head=head)
  name = f"context({k}, head={head}), left and right" + (
      f", {count} trees" if count > 2 else "")
  return _TreeCandidate(name, f"[{code}]", work, build, trees=count)


def _shared_mixture(count, k, head, num_classes, counts, probs, tokens, token_ids,
                    rank=None):
  """The candidate of `HierarchicalSoftmaxMixture(head=...)`: the `head` most frequent
  classes one softmax (and the tail's slot), `count` K-ary context trees over the others,
  each priced over the tail's tokens; with `rank`, each tree's correction of the head
  (`head_rank=rank`)."""
  # The head is the most frequent classes: by the text's own counts where none are given
  # (as `Tree.from_context` counts them).
  weights = np.asarray(counts if counts is not None else np.bincount(
      np.asarray(token_ids, np.int64), minlength=num_classes), np.float64)
  probs = np.asarray(probs, np.float64)
  head_ids = tree_vectors.head_classes(weights, head)
  tail = np.setdiff1d(np.arange(num_classes), head_ids)
  head_probs = np.append(probs[head_ids], probs[tail].sum())
  head_work = layout_work([0, head + 1], np.arange(head + 1), head + 1, head_probs, tokens)
  work = vectors_work(weights[tail], k, 0, probs[tail], tokens)
  build, code = _context_trees(count, k, num_classes, counts, token_ids, "classes=tail",
                               classes=tail)
  ranked = "" if rank is None else f", rank {rank}"
  name = f"context({k}, shared head={head}{ranked}), left and right" + (
      f", {count} trees" if count > 2 else "")
  # How to build it, spelled out: `head` the most frequent classes, `tail` the others.
  code = (f"[{code}], head=head{'' if rank is None else f', head_rank={rank}'}) with "
          f"head = np.argsort(-counts, kind='stable')[:{head}], "
          "tail = tf_hsm.HierarchicalSoftmaxMixture.tail_classes(head, num_classes")
  return _TreeCandidate(name, code, work, build, trees=count, head_work=head_work,
                        head_ids=head_ids, head_rank=rank)


def _tree_label(name):
  """A tree row's label in the table: "HSM learned", "HSM vectors32/256" (branching /
  head), "HSM huffman(8)", "HSM mixture32/256" (of the left- and right-context trees)."""
  if ", left and right" in name:
    count = re.findall(r", (\d+) trees$", name)
    return "HSM mixture" + "".join(f"{n}x" for n in count) + re.sub(
        r"context\((\d+), (shared )?head=(\d+)(?:, rank (\d+))?\).*",
        lambda m: f"{m[1]}{'+' if m[2] else '/'}{m[3]}{f'r{m[4]}' if m[4] else ''}", name)
  if name.startswith(("learned", "two_level")):
    return "HSM " + re.sub(r"\(.*", "", name)
  return "HSM " + re.sub(r"(vectors|context)\((\d+), head=(\d+)\)", r"\1\2/\3", name)


def _trees_and_text(trees, token_ids, num_classes, mixtures=True):
  """(tree names, token ids as an int64 array or None): `plan`'s default trees (the
  mixtures' with `mixtures`), checked against the training text a context tree is built from; a
  mixture of two spelled "mixture2xK_headH" is "mixtureK_headH", once."""
  text = () if token_ids is None else CONTEXT_TREES + (MIXTURE_TREES if mixtures else ())
  names = TREES + text if trees is None else trees
  if isinstance(names, str) or any(not isinstance(n, str) for n in names):
    raise TypeError(f"trees must be a list of tree names (str), got {names!r}")
  names = tuple(dict.fromkeys(re.sub(r"^mixture2x", "mixture", n) for n in names))
  context = [n for n in names if re.fullmatch(_HEAD_TREE_NAME, n)
             and not n.startswith("vectors")]
  if token_ids is None:
    if context:
      raise ValueError(f"the {context[0]} row is built from the training text: pass "
                       "token_ids (the training corpus as class ids, in order)")
    return names, None
  ids = np.asarray(token_ids)
  if ids.ndim != 1 or ids.size < 2 or not np.issubdtype(ids.dtype, np.integer):
    raise ValueError("token_ids must be a 1-D array of at least 2 integer class ids, got "
                     f"shape {ids.shape}, dtype {ids.dtype}")
  if ids.min() < 0 or ids.max() >= num_classes:
    raise ValueError(f"token_ids must lie in [0, num_classes={num_classes}), got "
                     f"[{ids.min()}, {ids.max()}]")
  return names, ids.astype(np.int64, copy=False)
