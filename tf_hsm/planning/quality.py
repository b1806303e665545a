"""What each candidate output layer costs in accuracy: held-out perplexity against full
softmax's, from the project's own measurements (docs/demo.md, docs/adaptive.md and
docs/planner.md's quality table), never estimated. A layer the project has not measured
has no figure: its rows say "unknown".

The evidence is the demo's word-level LSTM language model (`python -m tf_hsm.demo`:
Embedding -> LSTM(128) -> the output layer, LazyAdam 6e-3, batch 64 x 32 tokens, 3
epochs, best held-out perplexity) on two corpora: the Python standard library's
docstrings (V=6,205) and the King James Bible (V=4,989). A layer's figure is the mean
over the corpora measured of its best perplexity over full softmax's in the same
setting; `EVIDENCE` lists every figure with its source.
"""

import dataclasses
import re

STDLIB = "standard library (V=6,205)"
KJV = "King James Bible (V=4,989)"
# full softmax's best held-out perplexity on each corpus (docs/demo.md).
FULL = {STDLIB: 79.4, KJV: 52.5}


@dataclasses.dataclass(frozen=True)
class Figure:
  """One measured best held-out perplexity: the layer (a `kind` key), the corpus, the
  figure and where it is documented."""
  kind: str
  corpus: str
  perplexity: float
  source: str

  @property
  def ratio(self):
    return self.perplexity / FULL[self.corpus]


_DEMO = "docs/demo.md, Results"
EVIDENCE = (
    Figure("full", STDLIB, 79.4, _DEMO),
    Figure("full", KJV, 52.5, _DEMO),
    Figure("sampled", STDLIB, 79.5, _DEMO),
    Figure("sampled", KJV, 52.8, _DEMO),
    Figure("two_level", STDLIB, 82.5, _DEMO),
    Figure("two_level", KJV, 54.9, _DEMO),
    Figure("learned", STDLIB, 80.1, _DEMO),
    Figure("learned", KJV, 52.9, _DEMO),
    Figure("adaptive_demo", STDLIB, 80.6, _DEMO + "; docs/adaptive.md"),
    Figure("adaptive_demo", KJV, 52.8, _DEMO),
    Figure("three_level", STDLIB, 84.4, "docs/demo.md, The planner's tree (balanced(19))"),
    Figure("huffman2", STDLIB, 90.1, "docs/planner.md, Quality (demo --tree huffman, "
           "2026-11-25)"),
    Figure("huffman8", STDLIB, 87.3, "docs/planner.md, Quality (8-ary Huffman in the "
           "demo, 2026-11-25)"),
    Figure("huffman32", STDLIB, 84.0, "docs/planner.md, Quality (32-ary Huffman in the "
           "demo, 2026-11-25)"),
)
# What the kinds are, for the table and the notes.
KINDS = {
    "full": "full softmax",
    "sampled": "sampled softmax, 1,024 log-uniform samples",
    "two_level": "HierarchicalSoftmax, two-level tree of the counts (equal mass)",
    "three_level": "HierarchicalSoftmax, balanced tree of frequency-ranked ids, branching "
                   "V^(1/3)",
    "huffman2": "HierarchicalSoftmax, binary Huffman tree",
    "huffman8": "HierarchicalSoftmax, 8-ary Huffman tree",
    "huffman32": "HierarchicalSoftmax, 32-ary Huffman tree",
    "learned": "HierarchicalSoftmax, learned tree: a head of the 128 most frequent classes "
               "at the root, the rest rebuilt by similarity after epoch 1",
    "adaptive_demo": "AdaptiveSoftmax, flat tails, cutoffs [V/8, V/2], div 2 (the demo's)",
}


def quality_of(kind):
  """(mean perplexity ratio against full softmax, [figures]) of a kind key, or (None,
  []) when the project has no measurement of it."""
  figures = [f for f in EVIDENCE if f.kind == kind]
  if not figures:
    return None, []
  return sum(f.ratio for f in figures) / len(figures), figures


def kind_of(method, cutoffs=None, div_value=None, num_classes=None):
  """The `EVIDENCE` kind of a planner row's method (and, for an adaptive row, its
  layout), or None: a layer whose quality was not measured."""
  if method == "full softmax":
    return "full"
  if method.startswith("sampled softmax"):
    return "sampled"
  match = re.match(r"HierarchicalSoftmax (\w+)(?:\((\d+)\))?", method)
  if match:
    name, arg = match.groups()
    if name == "two_level":
      return "two_level"
    if name == "balanced":
      return "three_level"
    if name == "huffman":
      return f"huffman{arg}"
    if name == "learned":
      return "learned"
    return None
  if method.startswith("AdaptiveSoftmax flat") and cutoffs is not None and (
      num_classes is not None and div_value == 2.0 and
      list(cutoffs) == demo_cutoffs(num_classes)):
    return "adaptive_demo"
  return None


def demo_cutoffs(num_classes):
  """The demo's adaptive cutoffs: the most frequent 1/8 of the classes, then up to 1/2."""
  cutoffs = sorted({max(1, num_classes // 8), max(2, num_classes // 2)})
  return [c for c in cutoffs if c < num_classes]


def describe(kind):
  """One line of evidence: the figures and their ratios."""
  ratio, figures = quality_of(kind)
  if ratio is None:
    return "not measured"
  return "; ".join(f"{f.corpus.split(' (')[0]} {f.perplexity:g} ({f.ratio - 1:+.1%})"
                   for f in figures)
