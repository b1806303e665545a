"""The demo's output-layer trees: each `--tree` kind built from the vocabulary's counts
(or the training text, or the planner's pick), the callbacks that rebuild them during
training, and the biases under which a tree starts as the unigram model."""

import math

import numpy as np

# The learned tree's default head (docs/demo.md: heads of 128-1,024 words measured).
LEARNED_HEAD = 128


def make_tree(kind, counts, head=0, branching=None):
  """The HSM's tree. "learned" starts from the two-level tree (without a head: it has
  one after the rebuild, see `learned_tree_callback`). With `head`, the two-level tree's
  root also holds the `head` most frequent words as leaves (the clusters then split the
  other words). `branching`: children per node of a "huffman" tree (`Tree.huffman(counts,
  branching=K)`, default 2) or a "balanced" one (default ceil(sqrt(V)))."""
  from tf_hsm.tree import Tree  # pylint: disable=g-import-not-at-top
  if kind == "learned":
    kind, head = "two_level", 0
  if head and kind == "two_level":
    return head_two_level_tree(counts, head)
  if kind == "huffman":
    return Tree.huffman(counts, branching=branching or 2)
  if kind == "two_level":
    return Tree.two_level(len(counts), counts)
  if kind == "balanced":
    return Tree.balanced(len(counts),
                         branching or max(2, math.ceil(math.sqrt(len(counts)))))
  raise ValueError(f"unknown tree kind {kind!r}")


def planned_tree(counts, hidden, tokens_per_step, machine=None, token_ids=None,
                 max_perplexity_increase=None):
  """(trees, rebuild, head, head_rank): the layer `tf_hsm.plan` recommends for this model's output layer
  among the exact softmax and the hierarchical rows (every tree it prices, those
  rebuilt from vectors during training and, given the training text's `token_ids`, the
  context trees and their mixtures included; the vocabulary's training counts, the
  LSTM's width, a batch's tokens, LazyAdam; `max_perplexity_increase` as `plan`'s), as
  the trees the layer starts on (several for a HierarchicalSoftmaxMixture) and the
  `RebuildTree` arguments that make it the recommended tree (None if it trains as
  built), a mixture's shared head (class ids, or None) and the rank at which its trees
  correct it (or None); prints the planner's table first."""
  import tf_hsm  # pylint: disable=g-import-not-at-top
  counts = np.asarray(counts, np.float64)
  report = tf_hsm.plan(len(counts), hidden, tokens_per_step, counts=counts,
                       optimizer="lazy_adam", machine=machine, adaptive=(),
                       token_ids=token_ids, max_perplexity_increase=max_perplexity_increase)
  print("the planner, for this output layer:\n" + report.to_markdown(), flush=True)
  row = next(r for r in report.rows if r["method"] == report.recommended)
  print(f"  --tree planned: {row['method']}, {1e3 * row['step_seconds']:.1f} ms a step "
        "predicted" + (f"; rebuilt by RebuildTree({report.layer.rebuild_schedule()})"
                       if report.layer.rebuild else ""), flush=True)
  return report.layer.trees, report.layer.rebuild, report.layer.head, report.layer.head_rank


def learned_head(vocab_size):
  """The default head of a learned tree: LEARNED_HEAD words, at most 1/8 of the
  vocabulary (the adaptive softmax's head here), so that a small vocabulary keeps most
  of its words in the similarity tree below."""
  return min(LEARNED_HEAD, vocab_size // 8)


def head_two_level_tree(counts, head):
  """A root with the `head` most frequent classes as leaves and, as its other children,
  the clusters of `Tree.two_level` over the rest: the layout of an adaptive softmax,
  with frequency clusters; against the learned tree it shows what grouping the rest by
  similarity adds to the head."""
  from tf_hsm.tree import vectors as tree_vectors  # pylint: disable=g-import-not-at-top
  from tf_hsm.tree import Tree  # pylint: disable=g-import-not-at-top
  counts = np.asarray(counts, np.float64)
  c = len(counts)
  top = tree_vectors.head_classes(counts, head)
  rest = np.setdiff1d(np.arange(c), top)
  sub = Tree.two_level(len(rest), counts[rest])
  # The sub-tree's parents (entries: its classes, then C_sub + node), renumbered into
  # the whole tree's entries (classes, then C + node); the roots coincide.
  entry = np.concatenate([rest, c + np.arange(sub.num_nodes)])
  parents = np.full(c + sub.num_nodes, -1, np.int64)
  parents[entry[sub.slot_child]] = c + sub.slot_node
  parents[top] = c
  return Tree.from_parents(parents, num_classes=c)


def learned_tree_callback(model, counts, head=0, after_batches=None, vectors="embedding",
                          width=None):
  """Rebuilds the HSM's tree from trained vectors (`Tree.from_vectors`) and trains on
  with it: after epoch 1, or after `after_batches` training batches.

  The tree has about sqrt(V) children per node (`width`), whose siblings are similar
  words, and the `head` most frequent words directly under the root. `vectors`:
  "embedding" for the input embeddings (which put words used alike near each other) or
  "rows" for the HSM layer's own class rows."""
  from tf_hsm.keras.callbacks import RebuildTree  # pylint: disable=g-import-not-at-top
  width = width or max(2, math.ceil(math.sqrt(len(counts))))
  source = model.get_layer("embedding") if vectors == "embedding" else None
  when = {"after_batch": after_batches} if after_batches else {"after_epoch": 1}
  return RebuildTree(model.get_layer("hsm"), branching=[width, width], counts=counts,
                     vectors=source, head=head, **when)


def planned_rebuild_callback(model, rebuild, vectors="embedding"):
  """The RebuildTree of a planned tree that is rebuilt during training (`rebuild`: its
  arguments from the planner's `Layer.rebuild`), from the input embeddings or the HSM's
  rows (`vectors`), as `learned_tree_callback`."""
  from tf_hsm.keras.callbacks import RebuildTree  # pylint: disable=g-import-not-at-top
  source = model.get_layer("embedding") if vectors == "embedding" else None
  return RebuildTree(model.get_layer("hsm"), vectors=source, **rebuild)


def unigram_log_probs(counts):
  """log of the smoothed unigram distribution (counts + 0.5, normalised)."""
  counts = np.asarray(counts, np.float64) + 0.5
  return np.log(counts / counts.sum())


def tree_unigram_biases(tree, counts):
  """Per-slot biases under which the HSM, with zero weights, is the unigram model.

  bias[s] = log mass(child of s) - log mass(node owning s), masses summed from the
  smoothed counts, so that the path sum of log-probabilities is log p(class).
  """
  c = tree.num_classes
  mass = np.empty(c + tree.num_nodes, np.float64)
  mass[:c] = np.asarray(counts, np.float64) + 0.5
  child_begin, slot_child = tree.child_begin, tree.slot_child
  for node in range(tree.num_nodes - 1, -1, -1):  # BFS order: children come later
    mass[c + node] = mass[slot_child[child_begin[node]:child_begin[node + 1]]].sum()
  owner = mass[c + tree.slot_node]
  return np.log(mass[slot_child]) - np.log(owner)


def context_trees(token_ids, counts, head, branching, count=1, shared_head=False):
  """(trees, head ids or None): `count` trees from contexts (`Tree.from_context`: the
  left contexts, the right ones, then left and right again clustered from other
  seeds). With `shared_head`, the `head` most frequent classes are the
  `HierarchicalSoftmaxMixture`'s shared head and the trees are over the other classes
  (`classes=`); otherwise each tree has them at its own root."""
  from tf_hsm.keras import mixture_head  # pylint: disable=g-import-not-at-top
  from tf_hsm.tree import Tree  # pylint: disable=g-import-not-at-top
  from tf_hsm.tree import context  # pylint: disable=g-import-not-at-top
  from tf_hsm.tree import vectors as tree_vectors  # pylint: disable=g-import-not-at-top
  num_classes = len(counts)
  head_ids = tree_vectors.head_classes(counts, head) if shared_head else None
  tail = None if head_ids is None else mixture_head.tail_classes(head_ids, num_classes)
  trees = [Tree.from_context(token_ids, num_classes, counts, head=0 if shared_head else head,
                             branching=branching, seed=seed, side=side, classes=tail)
           for side, seed in context.mixture_sides(count)]
  return trees, head_ids


def head_biases(counts, head_ids):
  """The shared head's len(head) + 1 biases under which it starts as the unigram model:
  each head class's share, and the tail's (the rest's counts summed) last."""
  from tf_hsm.tree import Tree  # pylint: disable=g-import-not-at-top
  counts = np.asarray(counts, np.float64)
  rest = counts.sum() - counts[head_ids].sum()
  return tree_unigram_biases(Tree.flat(len(head_ids) + 1),
                             np.append(counts[head_ids], rest))
