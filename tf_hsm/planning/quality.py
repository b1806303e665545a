"""What each candidate output layer costs in accuracy: held-out perplexity against full
softmax's, from the project's own measurements (docs/demo.md, docs/adaptive.md and
docs/planner.md's quality table), never estimated. A layer the project has not measured
has no figure: its rows say "unknown".

The evidence is the demo's word-level LSTM language model (`python -m tf_hsm.demo`:
Embedding -> LSTM(128) -> the output layer, LazyAdam 6e-3, batch 64 x 32 tokens, 3
epochs, best held-out perplexity) on three corpora: the Python standard library's
docstrings (V=6,205), the King James Bible (V=4,989) and Debian's fortunes
(V=10,000), every row re-made by `python -m tf_hsm.bench.quality_runs CORPUS`; and at
large vocabularies the same model on two corpora of Debian's documentation and comments
(V=103,450 and 113,946), trained with PyTorch on a GPU (`tf_hsm.bench.quality_torch`:
full softmax at 100K classes is 3.4-5.8 CPU hours an epoch) and compared at equal
training tokens, every 2M tokens up to one epoch (the trees from contexts and their
mixtures: the demo on the CPU, against the same full-softmax figures). A layer's figure is the mean over the
corpora measured of its perplexity over full softmax's in the same setting: on a small
corpus its best of 3 epochs, on a large one its longest-trained checkpoint
(`longest_trained`: the gaps to full softmax grow with training, so an early checkpoint
would flatter a layer); `EVIDENCE` lists every figure with its source.

Quality depends on the vocabulary's size (a tree over a million classes is deeper than
one over 6,000), so a row of V classes takes the figures of the nearest measured size:
the corpora of the order of magnitude (rounded log10 of their V) nearest to V
(`nearest_figures`), and says which (`describe`, `column_note`). Every corpus is English
text for a word-level language model; a recommender's items are not measured.
"""

import dataclasses
import math
import re

STDLIB = "standard library (V=6,205)"
KJV = "King James Bible (V=4,989)"
FORTUNES = "fortunes (V=10,000)"
# The large vocabularies (`tf_hsm.bench.corpora`), trained with PyTorch on a GPU
# (`tf_hsm.bench.quality_torch`) and compared at equal training tokens: each checkpoint
# is a corpus of its own here, with its own full-softmax reference.
LINUX_2M = "linux-comments at 2.0M tokens (V=103,450)"
DEBIAN_2M = "debian-docs at 2.0M tokens (V=113,946)"
LINUX_4M = "linux-comments at 4.0M tokens (V=103,450)"
DEBIAN_4M = "debian-docs at 4.0M tokens (V=113,946)"
LINUX_6M = "linux-comments at 6.0M tokens (V=103,450)"
DEBIAN_6M = "debian-docs at 6.0M tokens (V=113,946)"
DEBIAN_10M = "debian-docs at 10.0M tokens (V=113,946)"
DEBIAN_12M = "debian-docs at 12.0M tokens (V=113,946)"
LINUX_EPOCH = "linux-comments after an epoch, 10.8M tokens (V=103,450)"
DEBIAN_EPOCH = "debian-docs after an epoch, 16.6M tokens (V=113,946)"
# Each corpus's classes (the demo's vocabulary with <unk>), for the lookup by size.
CORPUS_CLASSES = {STDLIB: 6_205, KJV: 4_989, FORTUNES: 10_000, LINUX_2M: 103_450,
                  DEBIAN_2M: 113_946, LINUX_4M: 103_450, DEBIAN_4M: 113_946,
                  LINUX_6M: 103_450, DEBIAN_6M: 113_946, DEBIAN_10M: 113_946,
                  DEBIAN_12M: 113_946, LINUX_EPOCH: 103_450, DEBIAN_EPOCH: 113_946}
# The training tokens of a large corpus's checkpoint (the small corpora's figures are
# each the best of 3 epochs, one figure a corpus).
CHECKPOINT_TOKENS = {LINUX_2M: 2.0e6, DEBIAN_2M: 2.0e6, LINUX_4M: 4.0e6, DEBIAN_4M: 4.0e6,
                     LINUX_6M: 6.0e6, DEBIAN_6M: 6.0e6, DEBIAN_10M: 10.0e6,
                     DEBIAN_12M: 12.0e6, LINUX_EPOCH: 10.8e6, DEBIAN_EPOCH: 16.6e6}
# A row whose V is more than this factor from every vocabulary its figures were
# measured at is marked `~` in the table: the figure orders layers, it does not give
# their cost at that V.
FAR = 3.0


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


# The large vocabularies' figures: docs/planner.md, "Large vocabularies" (run 1: every
# row, compared at 2.0M training tokens, the rows rebuilt from vectors not yet rebuilt
# there and left out; run 2: the trees from vectors, at 6.0M; run 3: four rows to the end
# of an epoch, and their checkpoints on the way, the references of run 4; run 4: the
# other rows for up to an epoch in 470 s each, at the last checkpoint each reached).
_GPU_RUNS = ("docs/planner.md, Large vocabularies (python -m tf_hsm.bench.quality_torch "
             "run, run {}, {}, row {}, NVIDIA H200, 2026-11-26)")
_PAIRS = "A mixture of two context trees (CPU)"
_SHARED = "A shared head over the mixture's trees (CPU)"
_RANKED = "The trees' own heads at low rank (CPU)"


def _cpu_run(section, corpus, flags, day):
  """Where a demo run's figure is documented, with its command (`python -m
  tf_hsm.bench.corpora CORPUS` writes the corpus; linux-comments' runs train on its
  first 12M tokens, debian-docs' on all of it)."""
  tokens, steps = (0, 1621) if corpus == "debian-docs" else (12_000_000, 1054)
  return (f"docs/planner.md, {section} (python -m tf_hsm.demo --corpus "
          f"demo_results/corpora/{corpus}.txt --max-tokens {tokens} --vocab 200000 "
          f"--models hsm --tree context {flags} --steps-per-epoch {steps} --epochs 5 "
          f"--eval-tokens 300000, AMD EPYC, 2026-11-{day})")


def _linux_mixture(section, trees, day, extra=""):
  """`_cpu_run` of a mixture of `trees` 16-ary context trees with heads of 128 on
  linux-comments, with the demo's `extra` flags."""
  return _cpu_run(section, "linux-comments",
                  f"--branching 16 --head 128 --mixture {trees}{extra}", day)


# Every figure: `python -m tf_hsm.bench.quality_runs CORPUS`, one row each (AMD EPYC, 2
# vCPUs, each run pinned to one; 2026-11-25), in docs/planner.md's quality table.
_RUNS = ("docs/planner.md, Quality (python -m tf_hsm.bench.quality_runs {}, row {}, "
         "2026-11-25)")
EVIDENCE = (
    Figure("full", STDLIB, 79.5, _RUNS.format("stdlib", "full")),
    Figure("full", KJV, 52.5, _RUNS.format("kjv", "full")),
    Figure("full", FORTUNES, 120.3, _RUNS.format("fortunes", "full")),
    Figure("sampled", STDLIB, 79.2, _RUNS.format("stdlib", "sampled")),
    Figure("sampled", KJV, 52.8, _RUNS.format("kjv", "sampled")),
    Figure("sampled", FORTUNES, 117.9, _RUNS.format("fortunes", "sampled")),
    Figure("learned", STDLIB, 80.0, _RUNS.format("stdlib", "learned")),
    Figure("learned", KJV, 52.9, _RUNS.format("kjv", "learned")),
    Figure("learned", FORTUNES, 119.1, _RUNS.format("fortunes", "learned")),
    Figure("two_level", STDLIB, 82.4, _RUNS.format("stdlib", "two_level")),
    Figure("two_level", KJV, 54.9, _RUNS.format("kjv", "two_level")),
    Figure("two_level", FORTUNES, 123.2, _RUNS.format("fortunes", "two_level")),
    Figure("huffman2", STDLIB, 90.1, _RUNS.format("stdlib", "huffman2")),
    Figure("huffman2", KJV, 59.6, _RUNS.format("kjv", "huffman2")),
    Figure("huffman2", FORTUNES, 130.2, _RUNS.format("fortunes", "huffman2")),
    Figure("huffman8", STDLIB, 87.3, _RUNS.format("stdlib", "huffman8")),
    Figure("huffman8", KJV, 57.0, _RUNS.format("kjv", "huffman8")),
    Figure("huffman8", FORTUNES, 126.2, _RUNS.format("fortunes", "huffman8")),
    Figure("huffman32", STDLIB, 84.0, _RUNS.format("stdlib", "huffman32")),
    Figure("huffman32", KJV, 55.3, _RUNS.format("kjv", "huffman32")),
    Figure("huffman32", FORTUNES, 123.8, _RUNS.format("fortunes", "huffman32")),
    Figure("three_level", STDLIB, 84.6, _RUNS.format("stdlib", "balanced")),
    Figure("three_level", KJV, 55.3, _RUNS.format("kjv", "balanced")),
    Figure("three_level", FORTUNES, 123.2, _RUNS.format("fortunes", "balanced")),
    Figure("adaptive_demo", STDLIB, 80.6, _RUNS.format("stdlib", "adaptive_demo")),
    Figure("adaptive_demo", KJV, 52.8, _RUNS.format("kjv", "adaptive_demo")),
    Figure("adaptive_demo", FORTUNES, 121.4, _RUNS.format("fortunes", "adaptive_demo")),
    Figure("adaptive_flat", STDLIB, 80.8, _RUNS.format("stdlib", "adaptive_flat")),
    Figure("adaptive_flat", KJV, 53.5, _RUNS.format("kjv", "adaptive_flat")),
    Figure("adaptive_flat", FORTUNES, 118.1, _RUNS.format("fortunes", "adaptive_flat")),
    Figure("adaptive_two_level", STDLIB, 86.7,
           _RUNS.format("stdlib", "adaptive_two_level")),
    Figure("adaptive_two_level", KJV, 57.1, _RUNS.format("kjv", "adaptive_two_level")),
    Figure("adaptive_two_level", FORTUNES, 123.5,
           _RUNS.format("fortunes", "adaptive_two_level")),
    Figure("adaptive_fixed", STDLIB, 81.2, _RUNS.format("stdlib", "adaptive_fixed")),
    Figure("adaptive_fixed", KJV, 52.7, _RUNS.format("kjv", "adaptive_fixed")),
    Figure("adaptive_fixed", FORTUNES, 123.4, _RUNS.format("fortunes", "adaptive_fixed")),
) + tuple(
    Figure(kind, corpus, ppl, _GPU_RUNS.format(run, corpus.split(" ")[0], row))
    for run, corpus, rows in (
        (1, LINUX_2M, {"full": 157.79, "sampled": 161.21, "two_level": 165.03,
                       "huffman8": 173.87, "huffman32": 166.26, "balanced": 163.71,
                       "adaptive_flat": 159.97, "adaptive_fixed": 157.95,
                       "adaptive_demo": 155.14}),
        (1, DEBIAN_2M, {"full": 86.86, "sampled": 88.53, "two_level": 91.12,
                        "huffman8": 97.68, "huffman32": 92.25, "balanced": 89.96,
                        "adaptive_flat": 86.78, "adaptive_fixed": 85.71,
                        "adaptive_demo": 84.20}),
        (2, LINUX_6M, {"full": 116.50, "sampled": 119.93, "vectors32_head256": 122.42,
                       "vectors32_head1024": 119.39, "vectors64_head256": 120.71}),
        (2, DEBIAN_6M, {"full": 60.40, "sampled": 61.94, "vectors32_head256": 63.95,
                        "vectors32_head1024": 62.42, "vectors64_head256": 63.23}),
        (3, LINUX_EPOCH, {"full": 101.62, "sampled": 105.35, "adaptive_fixed": 105.28,
                          "vectors64_head256": 107.44}),
        (3, DEBIAN_EPOCH, {"full": 46.37, "sampled": 48.05, "adaptive_fixed": 49.11,
                           "vectors64_head256": 51.10}),
        (3, LINUX_4M, {"full": 129.32, "sampled": 132.89}),
        (3, DEBIAN_4M, {"full": 68.09, "sampled": 69.61}),
        (3, DEBIAN_10M, {"full": 52.54, "sampled": 54.40}),
        (3, DEBIAN_12M, {"full": 49.99, "sampled": 51.94}),
        (4, LINUX_EPOCH, {"two_level": 113.22, "huffman8": 122.46, "huffman32": 114.65,
                          "balanced": 112.29, "learned": 108.49,
                          "vectors32_head256": 109.26, "vectors32_head1024": 106.58}),
        (4, LINUX_4M, {"adaptive_flat": 133.38, "adaptive_demo": 128.62}),
        (4, DEBIAN_4M, {"adaptive_flat": 69.40, "adaptive_demo": 66.38}),
        (4, DEBIAN_10M, {"huffman8": 66.48, "learned": 56.81, "vectors32_head256": 57.13}),
        (4, DEBIAN_12M, {"two_level": 57.05, "huffman32": 58.88, "balanced": 56.89,
                         "vectors32_head1024": 53.25}))
    for row, ppl in rows.items()
    for kind in ["three_level" if row == "balanced" else row]) + tuple(
    # The context tree on the CPU with tf_hsm, against the GPU runs' full softmax (the
    # CPU runs of the other rows ended within 0.3% of PyTorch's for the same models).
    Figure("context32_head256", corpus, ppl, _cpu_run(
        "Trees from contexts, on the CPU", name, "--branching 32 --head 256", 26))
    for corpus, name, ppl in ((LINUX_EPOCH, "linux-comments", 107.7),
                              (DEBIAN_10M, "debian-docs", 54.9),
                              (DEBIAN_EPOCH, "debian-docs", 50.4))) + (
    # The mixture on linux-comments alone: the debian-docs corpus it was run on was
    # built again with one document fewer, another held-out split than full softmax's.
    Figure("mixture32_head256", LINUX_EPOCH, 104.3, _cpu_run(
        _PAIRS, "linux-comments", "--branching 32 --head 256 --mixture", 27)),
    Figure("mixture16_head128", LINUX_EPOCH, 105.1, _linux_mixture(_PAIRS, 2, 27)),
    Figure("mixture3x16_head128", LINUX_EPOCH, 102.66, _linux_mixture(_PAIRS, 3, 27)),
    Figure("mixture4x16_head128", LINUX_EPOCH, 101.57, _linux_mixture(_PAIRS, 4, 27)),
    Figure("mixture16_shared128", LINUX_EPOCH, 105.36,
           _linux_mixture(_SHARED, 2, 27, " --shared-head")),
    Figure("mixture3x16_shared128", LINUX_EPOCH, 103.35,
           _linux_mixture(_SHARED, 3, 27, " --shared-head")),
    # The first code's run (the trees then also walked the head's tokens); four trees
    # were not run again, three ended the same within the runs' spread.
    Figure("mixture4x16_shared128", LINUX_EPOCH, 103.36,
           _linux_mixture(_SHARED, 4, 27, " --shared-head")),
    # Each tree's correction of the shared head (docs/planner.md, "The trees' own heads
    # at low rank"): the default seed's, as the rows above.
    Figure("mixture16_shared128_rank16", LINUX_EPOCH, 105.05,
           _linux_mixture(_RANKED, 2, 28, " --shared-head --head-rank 16")),
    Figure("mixture3x16_shared128_rank16", LINUX_EPOCH, 103.11,
           _linux_mixture(_RANKED, 3, 28, " --shared-head --head-rank 16")),
    Figure("mixture4x16_shared128_rank16", LINUX_EPOCH, 101.91,
           _linux_mixture(_RANKED, 4, 28, " --shared-head --head-rank 16")))
# full softmax's best held-out perplexity on each corpus, the denominator of every ratio.
FULL = {f.corpus: f.perplexity for f in EVIDENCE if f.kind == "full"}
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
    "adaptive_flat": "AdaptiveSoftmax, flat tails, div 4, at the cutoffs the planner "
                     "chooses for the step (choose_cutoffs)",
    "adaptive_two_level": "AdaptiveSoftmax, two-level tails, div 4, at the cutoffs the "
                          "planner chooses for the step (choose_cutoffs)",
    "adaptive_fixed": "AdaptiveSoftmax, flat tails, div 4, PyTorch-style fixed cutoffs "
                      "(2,000 x 10^i)",
    "vectors32_head256": "HierarchicalSoftmax, a tree from vectors: the 256 most frequent "
                         "classes at the root, the rest 32-ary by similarity, rebuilt from "
                         "the input embeddings after 1,000 batches (RebuildTree)",
    "vectors64_head256": "HierarchicalSoftmax, a tree from vectors: head of 256, the rest "
                         "64-ary by similarity, rebuilt after 1,000 batches",
    "vectors32_head1024": "HierarchicalSoftmax, a tree from vectors: head of 1,024, the "
                          "rest 32-ary by similarity, rebuilt after 1,000 batches",
    "context32_head256": "HierarchicalSoftmax, a tree from the words' left contexts "
                         "(Tree.from_context), built before training: head of 256, the "
                         "rest 32-ary, never rebuilt",
    "mixture32_head256": "HierarchicalSoftmaxMixture of two trees from contexts "
                         "(Tree.from_context, side left and right), each a head of 256 "
                         "over 32-ary clusters, mixed by a gate on the hidden state",
    "mixture16_head128": "HierarchicalSoftmaxMixture of two trees from contexts, left "
                         "and right, each a head of 128 over 16-ary clusters",
    "mixture3x16_head128": "HierarchicalSoftmaxMixture of three trees from contexts (left, "
                           "right, and left clustered from another seed), each a head of "
                           "128 over 16-ary clusters",
    "mixture4x16_head128": "HierarchicalSoftmaxMixture of four trees from contexts (left "
                           "and right, then both again clustered from another seed), "
                           "each a head of 128 over 16-ary clusters",
    "mixture16_shared128": "HierarchicalSoftmaxMixture(head=...): the 128 most frequent "
                           "classes one softmax shared by two 16-ary trees from contexts "
                           "(left and right) over the other classes",
    "mixture3x16_shared128": "HierarchicalSoftmaxMixture(head=...): the 128 most frequent "
                             "classes one softmax shared by three 16-ary trees from "
                             "contexts (left, right, left from another seed) over the "
                             "other classes",
    "mixture4x16_shared128": "HierarchicalSoftmaxMixture(head=...): a shared head of 128 "
                             "over four 16-ary trees from contexts of the other classes",
    "mixture16_shared128_rank16": "HierarchicalSoftmaxMixture(head=..., head_rank=16): "
                                  "two 16-ary context trees below a shared head of 128, "
                                  "each correcting it at rank 16",
    "mixture3x16_shared128_rank16": "HierarchicalSoftmaxMixture(head=..., head_rank=16): "
                                    "three 16-ary context trees below a shared head of "
                                    "128, each correcting it at rank 16",
    "mixture4x16_shared128_rank16": "HierarchicalSoftmaxMixture(head=..., head_rank=16): "
                                    "four 16-ary context trees below a shared head of "
                                    "128, each correcting it at rank 16",
}


def classes_of(corpus):
  """The vocabulary size a corpus's figures were measured at."""
  if corpus not in CORPUS_CLASSES:
    raise ValueError(f"corpus {corpus!r} has no vocabulary size in CORPUS_CLASSES")
  return CORPUS_CLASSES[corpus]


def nearest_figures(figures, num_classes=None):
  """The figures of the corpora whose order of magnitude of V (rounded log10) is nearest
  to NUM_CLASSES' (ties: the larger), or all of them without NUM_CLASSES."""
  if num_classes is None or not figures:
    return list(figures)
  if not num_classes >= 1:
    raise ValueError(f"num_classes must be a positive number, got {num_classes!r}")
  target = math.log10(num_classes)
  scales = {round(math.log10(classes_of(f.corpus))) for f in figures}
  scale = min(scales, key=lambda s: (abs(s - target), -s))
  return [f for f in figures if round(math.log10(classes_of(f.corpus))) == scale]


def longest_trained(figures):
  """Of each large corpus's checkpoints among FIGURES, the one with the most training
  tokens (a small corpus's single figure stays)."""
  latest = {}
  for f in figures:
    corpus = f.corpus.split(" ")[0] if f.corpus in CHECKPOINT_TOKENS else f.corpus
    tokens = CHECKPOINT_TOKENS.get(f.corpus, 0.0)
    if corpus not in latest or tokens > CHECKPOINT_TOKENS.get(latest[corpus].corpus, 0.0):
      latest[corpus] = f
  return [f for f in figures if f in latest.values()]


def quality_of(kind, num_classes=None):
  """(mean perplexity ratio against full softmax, [figures]) of a kind key at the
  measured vocabulary size nearest to NUM_CLASSES (`nearest_figures`; all sizes when
  None), each large corpus's longest-trained checkpoint, or (None, []) when the project
  has no measurement of it."""
  figures = longest_trained(
      nearest_figures([f for f in EVIDENCE if f.kind == kind], num_classes))
  if not figures:
    return None, []
  return sum(f.ratio for f in figures) / len(figures), figures


def training_tokens(kind, num_classes):
  """The fewest training tokens among KIND's figures at NUM_CLASSES (`quality_of`; a
  small corpus's best-of-3-epochs figure counts as fully trained, inf), or None when
  KIND was not measured."""
  _, figures = quality_of(kind, num_classes)
  if not figures:
    return None
  return min(CHECKPOINT_TOKENS.get(f.corpus, math.inf) for f in figures)


def scale_gap(kind, num_classes):
  """How many orders of magnitude (log10) lie between NUM_CLASSES and the vocabulary
  size whose figures `quality_of` takes for KIND (0 without NUM_CLASSES), or None when
  KIND was not measured."""
  _, figures = quality_of(kind, num_classes)
  if not figures:
    return None
  if num_classes is None:
    return 0.0
  scale = round(math.log10(classes_of(figures[0].corpus)))
  return abs(scale - math.log10(num_classes))


def measured_range(figures):
  """(smallest, largest) vocabulary the figures were measured at."""
  sizes = [classes_of(f.corpus) for f in figures]
  return min(sizes), max(sizes)


def is_far(figures, num_classes):
  """Whether NUM_CLASSES is more than FAR times from every vocabulary of FIGURES."""
  low, high = measured_range(figures)
  return num_classes > high * FAR or num_classes < low / FAR


def sizes_text(figures):
  """The vocabulary sizes FIGURES were measured at, as text: "V=103,450-113,946"."""
  low, high = measured_range(figures)
  return f"V={low:,}" if low == high else f"V={low:,}-{high:,}"


def _distance(figures, num_classes, whose="this row's "):
  """How far NUM_CLASSES is from the figures' vocabularies, in words ('' if near)."""
  if num_classes is None or not is_far(figures, num_classes):
    return ""
  low, high = measured_range(figures)
  factor = num_classes / high if num_classes > high else low / num_classes
  side = "fewer" if num_classes > high else "more"
  return f", {factor:,.0f}x {side} classes than {whose}{num_classes:,}"


def kind_of(method, cutoffs=None, div_value=None, num_classes=None):
  """The `EVIDENCE` kind of a planner row's method (and, for an adaptive row, its
  layout), or None: a layer whose quality was not measured."""
  if method == "full softmax":
    return "full"
  if method.startswith("sampled softmax"):
    return "sampled"
  match = re.match(r"HierarchicalSoftmaxMixture context\((\d+), (shared )?head=(\d+)"
                   r"(?:, rank (\d+))?\), left and right(?:, (\d+) trees)?$", method)
  if match:
    k, shared, head, rank, count = match.groups()
    kind = (f"mixture{count + 'x' if count else ''}{k}_{'shared' if shared else 'head'}{head}"
            + (f"_rank{rank}" if rank else ""))
    return kind if any(f.kind == kind for f in EVIDENCE) else None
  match = re.match(r"HierarchicalSoftmax (vectors|context)\((\d+), head=(\d+)\)", method)
  if match:
    kind = "{}{}_head{}".format(*match.groups())
    return kind if any(f.kind == kind for f in EVIDENCE) else None
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
  if div_value == 4.0:
    # The planner's layouts, measured at the cutoffs it chose for the demo's step.
    for prefix, kind in (("AdaptiveSoftmax flat, chosen cutoffs", "adaptive_flat"),
                         ("AdaptiveSoftmax two_level, chosen cutoffs",
                          "adaptive_two_level"),
                         ("AdaptiveSoftmax flat, PyTorch-style fixed cutoffs",
                          "adaptive_fixed")):
      if method.startswith(prefix):
        return kind
  return None


def demo_cutoffs(num_classes):
  """The demo's adaptive cutoffs: the most frequent 1/8 of the classes, then up to 1/2."""
  cutoffs = sorted({max(1, num_classes // 8), max(2, num_classes // 2)})
  return [c for c in cutoffs if c < num_classes]


def describe(kind, num_classes=None):
  """One line of evidence: the vocabulary size it was measured at (and how far that is
  from NUM_CLASSES), then the figures and their ratios."""
  ratio, figures = quality_of(kind, num_classes)
  if ratio is None:
    return "not measured"
  return (f"measured on English text at {sizes_text(figures)}"
          f"{_distance(figures, num_classes)}: "
          + "; ".join(f"{f.corpus.split(' (')[0]} {f.perplexity:g} ({f.ratio - 1:+.1%})"
                      for f in figures))


def is_far_kind(kind, num_classes):
  """Whether KIND's figures at NUM_CLASSES (`quality_of`) were measured FAR away (never
  for full softmax: it is the reference, 1 at any V)."""
  _, figures = quality_of(kind, num_classes)
  if kind == "full":
    return False
  return bool(figures) and is_far(figures, num_classes)


def _corpus_names(figures):
  """The corpora of FIGURES, a large corpus once with its checkpoints' range of training
  tokens ("linux-comments at 4.0M-10.8M training tokens")."""
  tokens = {}
  for f in figures:
    name = f.corpus.split(" (")[0]
    if f.corpus in CHECKPOINT_TOKENS:
      name = f.corpus.split(" ")[0]
      tokens.setdefault(name, set()).add(CHECKPOINT_TOKENS[f.corpus])
    else:
      tokens.setdefault(name, set())
  return {name if not t else
          f"{name} at {min(t) / 1e6:.1f}M" + (f"-{max(t) / 1e6:.1f}M" if len(t) > 1 else "")
          + " training tokens" for name, t in tokens.items()}


def column_note(num_classes):
  """Where the table's ppl+% figures come from at NUM_CLASSES classes: the corpora and
  their sizes (each kind's nearest, `quality_of`), and how far from NUM_CLASSES."""
  figures = [f for kind in sorted({f.kind for f in EVIDENCE})
             for f in quality_of(kind, num_classes)[1]]
  if not figures:
    return "ppl+%: not measured for any layer"
  corpora = ", ".join(sorted(_corpus_names(figures)))
  far = is_far(figures, num_classes)
  whose = "the table's V="
  return ("ppl+%: measured perplexity over full softmax's, in % (?: not measured), "
          f"from word-level language models on English text ({corpora}; "
          f"{sizes_text(figures)}{_distance(figures, num_classes, whose)}"
          + ("; ~: the figure orders the layers, it is not their cost at this V" if far
             else "")
          + "); other data, a recommender's items, is not measured.")
