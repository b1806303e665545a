"""Output layers compared on a word-level language model: `python -m tf_hsm.demo`.

Trains the same Keras model (Embedding -> LSTM -> output layer) on the same data once
per output layer (--models): `tf_hsm.HierarchicalSoftmax` (`hsm-<tree>`; by default
over a two-level tree of the training word counts, rebuilt after epoch 1 into a tree
with the 128 most frequent words at the root and the rest grouped by the similarity of
their trained input embeddings, `--tree learned`), the exact full softmax (`full`:
`HierarchicalSoftmax(Tree.flat(vocab))`, one node over every word, without [tokens, vocab]
logits), TensorFlow's own `tf.nn.sampled_softmax_loss` with 1,024
log-uniform candidates (`sampled-1024`; the question every HSM user meets: why not that?)
and, on request, `tf_hsm.AdaptiveSoftmax` (`adaptive`). All use
`tf_hsm.optimizers.LazyAdam` (plain Adam on dense gradients), the same seed and the same
number of epochs, and all start from the unigram distribution of the training words
(biases only; see `tree_unigram_biases`; the adaptive softmax's tails have no biases, so
it starts uniform within each cluster). Held-out perplexity is exact for every model (the
sampled softmax is evaluated on its full logits). For each epoch it reports the held-out
perplexity and the training wall and CPU time, then a final table with each model's best
epoch. Results go to --out: `results.json`, `results.md` (the table) and `perplexity.png`
(held-out perplexity against training wall-clock time).

The default corpus needs no download: the docstrings and comments of the Python standard
library installed with the running interpreter (tests left out), plus the language
reference topics that `pydoc` ships (`pydoc_data.topics`), read in a fixed order. It is
real technical English, about 0.75M tokens and 19K distinct words with Python 3.11 (the
exact text depends on the Python version). `--corpus FILE` trains on a UTF-8 text file
instead (blank lines separate documents).

Text is lower-cased and split into words (letters, digits and underscores, so that
identifiers like `max_depth` stay whole) and single punctuation marks; `<eos>` ends each
document. Documents are shuffled with a fixed seed, cut to --max-tokens, and split into
blocks of 1,000 tokens (fewer in corpora under 50,000 tokens), every 10th of which is
held out. The vocabulary is `<unk>` plus the (at most --vocab - 1) most frequent training
words seen at least --min-count times, so `<unk>` occurs in training too. Perplexity is
exp(mean negative log-likelihood per held-out token), exact for every model (the HSM's and
the adaptive softmax's probabilities are normalised), with `<unk>` scored like any other
word.

Defaults and what they give: the vocabulary comes out at about 6,200 words (every word
seen twice in 270K training tokens; --vocab 10000 is a cap), the largest this corpus
supports honestly within a run of a few minutes on 2 CPU cores. `--max-tokens 0` (the
whole corpus, ~670K training tokens) fills the 10,000-word cap and widens the speed gap
between the models, at about six times the run time.
"""

import argparse
import ast
import collections
import json
import math
import os
import random
import re
import sys
import sysconfig
import time

import numpy as np

from tf_hsm.demo import bands
from tf_hsm.demo.trees import (LEARNED_HEAD, context_trees, head_two_level_tree,  # pylint: disable=unused-import
                               learned_head, learned_tree_callback, make_tree,
                               head_biases, planned_rebuild_callback, planned_tree,
                               tree_unigram_biases, unigram_log_probs)
from tf_hsm.planning.cli import percent_arg

DEFAULTS = {
    "tree": "learned",
    "vocab": 10000,
    "min_count": 2,
    "epochs": 3,
    "hidden": 128,
    "seq_len": 32,
    "batch": 64,
    "max_tokens": 300_000,
    "learning_rate": 6e-3,
    "seed": 0,
    "out": "demo_results",
    "models": ("hsm", "full", "sampled"),
    "num_sampled": 1024,
    "rebuild_from": "embedding",
}
MODELS = ("hsm", "full", "sampled", "adaptive")
UNK, EOS = "<unk>", "<eos>"
_HELD_OUT_BLOCK, _HELD_OUT_EVERY = 1000, 10
_WORD = re.compile(r"[a-z0-9_]+(?:'[a-z]+)?|[^\sa-z0-9_]")
_COMMENT = re.compile(r"[ \t]*#+[ \t]?(.*)")
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}


# ---------------------------------------------------------------------------------------
# Corpus
# ---------------------------------------------------------------------------------------

def _file_text(source):
  """The docstrings and comment blocks of one Python source, in source order."""
  try:
    module = ast.parse(source)
  except (SyntaxError, ValueError):
    return ""
  pieces = []
  for node in ast.walk(module):
    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
      doc = ast.get_docstring(node)
      if doc:
        pieces.append((node.body[0].lineno, doc))
  block, start = [], 0
  for number, line in enumerate(source.split("\n") + [""], start=1):
    match = _COMMENT.fullmatch(line)
    if match and not line.lstrip().startswith("#!"):
      if not block:
        start = number
      block.append(match.group(1))
    elif block:
      pieces.append((start, "\n".join(block)))
      block = []
  pieces.sort(key=lambda piece: piece[0])
  return "\n\n".join(text for _, text in pieces)


def stdlib_documents():
  """The default corpus: one document per standard-library module, then pydoc's topics.

  Reads every .py file under the interpreter's stdlib directory (sorted paths; tests
  and site-packages left out) and keeps its docstrings and comments.

  Returns:
    A list of non-empty strings, the same list every time on a given installation.
  """
  root = sysconfig.get_paths()["stdlib"]
  paths = []
  for directory, subdirs, files in os.walk(root):
    subdirs[:] = sorted(d for d in subdirs if d not in _SKIP_DIRS)
    paths += [os.path.join(directory, f) for f in sorted(files) if f.endswith(".py")]
  documents = []
  for path in paths:
    try:
      with open(path, encoding="utf-8") as f:
        text = _file_text(f.read())
    except (OSError, UnicodeDecodeError):
      continue
    if text.strip():
      documents.append(text)
  try:
    from pydoc_data import topics  # pylint: disable=g-import-not-at-top
    documents += [topics.topics[key] for key in sorted(topics.topics)]
  except ImportError:
    pass
  return documents


# A text file with more places outside UTF-8 than this share of its bytes is not read as
# text (it is another encoding, or not text); fewer are read as U+FFFD, with a warning.
MAX_NON_UTF8_SHARE = 0.01


def file_documents(path, warn=None):
  """A UTF-8 text file as documents: the pieces between blank lines (runs of them).

  A few places that are not UTF-8 (a stray Latin-1 character in a long document) are
  read as U+FFFD and `warn(text)` (default: a line on stderr) says how many and where
  the first is; more than MAX_NON_UTF8_SHARE of the bytes' count is an error.

  Raises:
    ValueError: the file cannot be read, or is not UTF-8 text; the message names it.
  """
  try:
    with open(path, "rb") as f:
      data = f.read()
  except OSError as error:
    raise ValueError(f"cannot read the corpus {path}: {error.strerror or error}") from None
  text = data.decode("utf-8", errors="replace")
  bad = text.count("\ufffd") - data.decode("utf-8", errors="ignore").count("\ufffd")
  if bad:
    try:
      data.decode("utf-8")
    except UnicodeDecodeError as error:
      first = error.start
    if bad > MAX_NON_UTF8_SHARE * len(data):
      raise ValueError(
          f"the corpus {path} is not UTF-8 text: {bad:,} places in its {len(data):,} "
          f"bytes are not UTF-8 (the first at byte {first:,}); convert it, e.g. iconv "
          f"-f latin1 -t utf-8")
    (warn or _warn)(f"the corpus {path}: {bad:,} places that are not UTF-8 (the first at "
                    f"byte {first:,}) are read as U+FFFD")
  return [d for d in re.split(r"\n\s*\n", text) if d.strip()]


def _warn(text):
  sys.stderr.write(f"warning: {text}\n")


def tokenize(text):
  """Lower-cased words (identifiers kept whole) and single punctuation marks."""
  return _WORD.findall(text.lower())


def split_corpus(documents, max_tokens, seed=0):
  """Shuffles documents, tokenises up to max_tokens, and holds out every 10th block.

  Returns:
    (train, held_out): lists of tokens.
  """
  order = list(range(len(documents)))
  random.Random(seed).shuffle(order)
  tokens = []
  for i in order:
    tokens += tokenize(documents[i])
    tokens.append(EOS)
    if max_tokens and len(tokens) >= max_tokens:
      break
  if max_tokens:
    tokens = tokens[:max_tokens]
  # Blocks of 1,000 tokens, smaller for small corpora so that there are at least 50.
  size = max(1, min(_HELD_OUT_BLOCK, len(tokens) // 50))
  train, held_out = [], []
  for b, start in enumerate(range(0, len(tokens), size)):
    block = tokens[start:start + size]
    (held_out if b % _HELD_OUT_EVERY == _HELD_OUT_EVERY - 1 else train).extend(block)
  return train, held_out


def build_vocab(train_tokens, size, min_count=1):
  """`<unk>` (id 0) and the size - 1 most frequent training words (ties: alphabetical).

  Words seen fewer than `min_count` times are left to `<unk>`, so that `<unk>` occurs in
  training (a model cannot learn the probability of a word it never sees).

  Returns:
    (words, counts): the id -> word list and the training count of each id.
  """
  counts = collections.Counter(train_tokens)
  ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
  ranked = [item for item in ranked if item[0] != UNK and item[1] >= min_count]
  ranked = ranked[:max(size - 1, 1)]
  words = [UNK] + [w for w, _ in ranked]
  kept = sum(c for _, c in ranked)
  return words, np.array([len(train_tokens) - kept] + [c for _, c in ranked], np.float64)


def encode(tokens, words):
  index = {w: i for i, w in enumerate(words)}
  return np.array([index.get(t, 0) for t in tokens], np.int32)


def sequences(ids, seq_len):
  """Non-overlapping (input, next-word target) pairs, each [N, seq_len]."""
  n = (len(ids) - 1) // seq_len
  if n < 1:
    raise ValueError(f"{len(ids)} tokens are too few for sequences of length {seq_len}")
  x = ids[:n * seq_len].reshape(n, seq_len)
  y = ids[1:n * seq_len + 1].reshape(n, seq_len)
  return x, y


# ---------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------

def _body(keras, vocab_size, hidden, seq_len):
  tokens = keras.Input((seq_len,), dtype="int32", name="tokens")
  x = keras.layers.Embedding(vocab_size, hidden, name="embedding")(tokens)
  x = keras.layers.LSTM(hidden, return_sequences=True, name="lstm")(x)
  return tokens, x


def _compile(model, output_layer, learning_rate, output_lr_scale):
  """Compiles `model` as every model here is: tf_hsm's nll loss, LazyAdam at
  `learning_rate` with the layer named `output_layer` at `output_lr_scale` x it."""
  from tf_hsm.demo import optimizer as demo_optimizer  # pylint: disable=g-import-not-at-top
  from tf_hsm.keras import losses  # pylint: disable=g-import-not-at-top
  model.compile(optimizer=demo_optimizer.lazy_adam(learning_rate, output_layer,
                                                   output_lr_scale), loss=losses.nll)
  return model


def hsm_model(tree, counts, hidden, seq_len, learning_rate, name="hsm_lm",
              output_lr_scale=1.0, head=None, tail_dim=None, head_rank=None):
  """[tokens, targets] -> log P(targets), trained with tf_hsm.losses.nll.

  The biases start at the unigram distribution of `counts` (see `tree_unigram_biases`);
  the output layer's table trains at `output_lr_scale` x `learning_rate`
  (`tf_hsm.demo.optimizer`), as in every model here. `tree` may be a list of trees:
  the output layer is then their `HierarchicalSoftmaxMixture` (`--mixture`), with
  `head` (class ids) its shared head, the trees over the other classes
  (`--shared-head`), scoring a `tail_dim` projection of the hidden state where that is
  given (`--tail-dim`), each tree with a rank-`head_rank` correction of the head where
  that is given (`--head-rank`).
  """
  import keras  # pylint: disable=g-import-not-at-top
  from tf_hsm.keras.layers import HierarchicalSoftmax  # pylint: disable=g-import-not-at-top
  from tf_hsm.keras.mixture import HierarchicalSoftmaxMixture  # pylint: disable=g-import-not-at-top
  trees = tree if isinstance(tree, (list, tuple)) else [tree]
  if head is not None and len(trees) < 2:
    raise ValueError("a shared head is a mixture's: give two or more trees with it")
  tokens, x = _body(keras, len(counts), hidden, seq_len)
  targets = keras.Input((seq_len,), dtype="int32", name="targets")
  tree_counts = np.asarray(counts) if head is None else np.delete(counts, head)
  layers = [HierarchicalSoftmax(t, name="hsm" if len(trees) == 1 else f"tree_{k}",
                                bias_initializer=keras.initializers.Constant(
                                    tree_unigram_biases(t, tree_counts)))
            for k, t in enumerate(trees)]
  output = layers[0] if len(trees) == 1 else HierarchicalSoftmaxMixture(
      layers, name="hsm", head=head, head_bias_initializer=keras.initializers.Constant(
          head_biases(counts, head)) if head is not None else "zeros", tail_dim=tail_dim,
      num_classes=len(counts), head_rank=head_rank)
  log_probs = output(x, targets)
  return _compile(keras.Model([tokens, targets], log_probs, name=name), "hsm",
                  learning_rate, output_lr_scale)


def full_softmax_model(counts, hidden, seq_len, learning_rate, output_lr_scale=1.0):
  """The exact softmax over the vocabulary: `HierarchicalSoftmax(Tree.flat(V))`, one node
  whose children are all the words, so log P(target) = log_softmax(W h + b)[target],
  computed without [tokens, V] logits (a 100K-word vocabulary trains in the memory of its
  table). Trained with tf_hsm.losses.nll; the biases start at the log unigram
  distribution of `counts`, as the HSM's do."""
  from tf_hsm.tree import Tree  # pylint: disable=g-import-not-at-top
  return hsm_model(Tree.flat(len(counts)), counts, hidden, seq_len, learning_rate,
                   name="full_softmax_lm", output_lr_scale=output_lr_scale)


def sampled_softmax_model(counts, hidden, seq_len, learning_rate, num_sampled,
                          output_lr_scale=1.0):
  """[tokens, targets] -> per-token log-probabilities, trained with TensorFlow's own
  `tf.nn.sampled_softmax_loss` (`sampled_softmax_layer`) and evaluated exactly, so
  held-out perplexity is comparable with the other models'."""
  import keras  # pylint: disable=g-import-not-at-top
  tokens, x = _body(keras, len(counts), hidden, seq_len)
  targets = keras.Input((seq_len,), dtype="int32", name="targets")
  log_probs = sampled_softmax_layer(counts, num_sampled)(x, targets)
  return _compile(keras.Model([tokens, targets], log_probs, name="sampled_softmax_lm"),
                  "sampled_softmax", learning_rate, output_lr_scale)


def sampled_softmax_layer(counts, num_sampled, name="sampled_softmax"):
  """A Keras layer (hidden, targets) -> per-token log-probabilities over len(counts)
  classes: in training minus `tf.nn.sampled_softmax_loss` with `num_sampled`
  log-uniform candidates (as TF's word2vec and language model tutorials use), in
  evaluation the exact log-softmax of the full logits at the target. Its biases start at
  the log unigram distribution of `counts`, as the HSM's do."""
  import keras  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  class SampledSoftmax(keras.layers.Layer):

    def build(self, hidden_shape, targets_shape=None):
      self.kernel = self.add_weight(name="kernel", shape=(len(counts), hidden_shape[-1]),
                                    initializer="glorot_uniform")
      self.bias = self.add_weight(
          name="bias", shape=(len(counts),),
          initializer=keras.initializers.Constant(unigram_log_probs(counts)))

    def call(self, hidden, targets, training=None):
      flat = tf.reshape(hidden, [-1, hidden.shape[-1]])
      labels = tf.cast(tf.reshape(targets, [-1, 1]), tf.int64)
      if training:
        # Each candidate id is drawn log-uniformly: the classes are in decreasing
        # frequency order (build_vocab), as this sampler assumes.
        out = -tf.nn.sampled_softmax_loss(self.kernel, self.bias, labels, flat,
                                          num_sampled, len(counts))
      else:
        logits = tf.matmul(flat, self.kernel, transpose_b=True) + self.bias
        out = -tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels[:, 0],
                                                              logits=logits)
      return tf.reshape(out, tf.shape(targets))

  return SampledSoftmax(name=name)


def adaptive_cutoffs(vocab_size):
  """Head of the most frequent 1/8 of the vocabulary, then clusters up to 1/2 and the
  rest (the proportions of Grave et al.'s text8 setting)."""
  cutoffs = sorted({max(1, vocab_size // 8), max(2, vocab_size // 2)})
  return [c for c in cutoffs if c < vocab_size]


def layout_cutoffs(name, counts, hidden, tokens_per_step, div_value=2.0, tail="flat",
                   machine=None):
  """The adaptive softmax's cutoffs by name: "demo" (`adaptive_cutoffs`: 1/8 and 1/2 of
  the vocabulary), "planned" (those `tf_hsm.planning.cutoffs.choose_cutoffs` picks for
  this vocabulary's counts, `hidden`, `tokens_per_step` tokens a step, LazyAdam, the tail
  and div value, at this machine's cached rates: the planner's adaptive rows), "pytorch"
  (`tf_hsm.planning.pytorch_cutoffs`: the planner's "adaptive fixed" row), or a list of
  ints.

  The words are ids by decreasing training count but for `<unk>` (id 0, wherever its
  count ranks), so "planned" chooses on the counts sorted: the cutoffs count classes,
  and `<unk>` is in the head either way unless the head is smaller than its rank."""
  if not isinstance(name, str):
    return [int(c) for c in name]
  if name == "demo":
    return adaptive_cutoffs(len(counts))
  from tf_hsm import planning  # pylint: disable=g-import-not-at-top
  if name == "planned":
    from tf_hsm.planning.cutoffs import choose_cutoffs  # pylint: disable=g-import-not-at-top
    ranked = np.sort(np.asarray(counts, np.float64))[::-1]
    return list(choose_cutoffs(ranked, hidden, tokens_per_step,
                               div_value, tail, machine, optimizer="lazy_adam"))
  if name == "pytorch":
    return list(planning.pytorch_cutoffs(len(counts), hidden, div_value))
  raise ValueError(f"unknown cutoffs {name!r}: demo, planned, pytorch or a list of ints")


def adaptive_model(counts, hidden, seq_len, learning_rate, cutoffs=None, div_value=2.0,
                   tail="flat", output_lr_scale=1.0):
  """[tokens, targets] -> log P(targets) with `tf_hsm.AdaptiveSoftmax` (by default the
  demo's layout: flat tails, `adaptive_cutoffs`, div value 2); the head's biases start at
  the unigram masses of its words and clusters."""
  import keras  # pylint: disable=g-import-not-at-top
  from tf_hsm.keras.adaptive import AdaptiveSoftmax  # pylint: disable=g-import-not-at-top
  cutoffs = list(cutoffs) if cutoffs is not None else adaptive_cutoffs(len(counts))
  log_p = unigram_log_probs(counts)
  bounds = cutoffs + [len(counts)]
  head = list(log_p[:cutoffs[0]]) + [np.logaddexp.reduce(log_p[lo:hi])
                                     for lo, hi in zip(bounds[:-1], bounds[1:])]
  tokens, x = _body(keras, len(counts), hidden, seq_len)
  targets = keras.Input((seq_len,), dtype="int32", name="targets")
  tail_counts = None
  if tail == "two_level":
    # The tails' trees are built from the counts of their own classes; the layer checks
    # that all are non-increasing, which they are not where `<unk>` (id 0, in the head)
    # is rarer than a word: the head's counts, not used, are given as the largest.
    tail_counts = np.asarray(counts, np.float64).copy()
    tail_counts[:cutoffs[0]] = tail_counts.max()
  layer = AdaptiveSoftmax(len(counts), cutoffs, div_value=div_value, head_bias=True,
                          tail=tail, counts=tail_counts, name="adaptive")
  log_probs = layer(x, targets)
  layer.head_bias_weight.assign(np.asarray(head, np.float32))
  return _compile(keras.Model([tokens, targets], log_probs, name="adaptive_lm"),
                  "adaptive", learning_rate, output_lr_scale)


def _epoch_timer(keras, name):
  """A callback that times the training part of each epoch (held-out evaluation excluded).

  It records wall-clock seconds and the process's CPU seconds (all threads): on a shared
  machine the wall-clock time depends on the load, the CPU time much less. After each
  epoch with Keras' validation it prints the model's held-out perplexity at once, so a
  run of hours stopped early (or a full softmax given up on) leaves its epochs' figures
  in its log; the table comes only at the end.
  """

  class EpochTimer(keras.callbacks.Callback):

    def __init__(self):
      super().__init__()
      self.seconds, self.cpu_seconds, self._start, self._stop = [], [], None, None

    def on_epoch_begin(self, epoch, logs=None):
      self._start, self._stop = (time.perf_counter(), time.process_time()), None

    def on_test_begin(self, logs=None):
      if self._start is not None and self._stop is None:  # fit's validation begins
        self._stop = (time.perf_counter(), time.process_time())

    def on_epoch_end(self, epoch, logs=None):
      stop = self._stop or (time.perf_counter(), time.process_time())
      self.seconds.append(stop[0] - self._start[0])
      self.cpu_seconds.append(stop[1] - self._start[1])
      self._start = None
      if logs and "val_loss" in logs:
        print(f"   {name} after epoch {epoch + 1}: held-out perplexity "
              f"{_exp(logs['val_loss']):.2f} ({self.seconds[-1]:.1f} s, "
              f"{self.cpu_seconds[-1]:.1f} CPU s)", flush=True)

  return EpochTimer()


def train(name, model, train_data, held_out_data, epochs, batch, verbose=1, callbacks=(),
          steps_per_epoch=None, band_edges=None):
  """Fits the model, timing each epoch and evaluating held-out perplexity after it.

  Args:
    train_data, held_out_data: (inputs, targets) for `model.fit` / `model.evaluate`.

  Returns:
    A dict with the per-epoch history: train_seconds (training wall-clock per epoch,
    held-out evaluation excluded), tokens_per_second, train_loss, held_out_perplexity
    (its first entry is before training); with `band_edges`, held_out_bands (the
    held-out loss by rank band after each epoch, `tf_hsm.demo.bands`).
  """
  import keras  # pylint: disable=g-import-not-at-top
  (x, y), (hx, hy) = train_data, held_out_data
  report = None
  if band_edges is not None:
    report = bands.band_callback(keras, hx, hy, band_edges, 4 * batch)
  tokens = y.size if steps_per_epoch is None else min(
      y.size, steps_per_epoch * batch * y.shape[-1])
  initial = model.evaluate(hx, hy, batch_size=4 * batch, verbose=0)
  print(f"\n== {name}: {model.count_params():,} parameters, {tokens:,} training tokens, "
        f"held-out perplexity before training {_exp(initial):.1f}", flush=True)
  timer = _epoch_timer(keras, name)
  # With bands, their pass is the held-out evaluation (no validation beside it), before
  # any callback that rebuilds the tree at the epoch's end, as validation would be.
  validation = {} if report else {"validation_data": (hx, hy),
                                  "validation_batch_size": 4 * batch}
  fit = model.fit(x, y, batch_size=batch, epochs=epochs, shuffle=True, verbose=verbose,
                  steps_per_epoch=steps_per_epoch,
                  callbacks=[timer] + ([report] if report else []) + list(callbacks),
                  **validation)
  for callback in callbacks:
    # A rebuild at the end of an epoch runs after the timer stopped (fit's validation has
    # begun): its cost counts in that epoch's training time. One after a batch is timed
    # already; the re-tracing it causes happens at the next step, inside an epoch.
    if getattr(callback, "rebuild_seconds", None) and \
        getattr(callback, "after_epoch", None) is not None:
      epoch = callback.after_epoch - 1
      if epoch < len(timer.seconds):
        timer.seconds[epoch] += callback.rebuild_seconds[0]
        timer.cpu_seconds[epoch] += callback.rebuild_seconds[1]
  history = {"name": name, "train_tokens": int(tokens), "held_out_tokens": int(hy.size),
             "params": int(model.count_params()), "train_seconds": timer.seconds,
             "train_cpu_seconds": timer.cpu_seconds,
             "rebuild_seconds": next((list(c.rebuild_seconds) for c in callbacks
                                      if getattr(c, "rebuild_seconds", None)), None),
             "tokens_per_second": [tokens / s for s in timer.seconds],
             "train_loss": [float(v) for v in fit.history["loss"]],
             "held_out_perplexity": [_exp(v) for v in [initial] + (
                 report.losses if report else fit.history["val_loss"])]}
  if report is not None:
    history["held_out_bands"] = report.bands
  for epoch, (seconds, cpu) in enumerate(zip(timer.seconds, timer.cpu_seconds)):
    print(f"   {name} epoch {epoch + 1}: {seconds:.1f} s ({cpu:.1f} CPU s), "
          f"{tokens / seconds:,.0f} tokens/s, held-out perplexity "
          f"{history['held_out_perplexity'][epoch + 1]:.1f}")
  return history


def _exp(loss):
  return float(math.exp(min(loss, 700.0)))


# ---------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------

def table(histories):
  """The final comparison as a Markdown table, one row per model, against the full
  softmax (or the last model when there is none: the headers name the model the
  speed-up and the perplexity are against)."""
  base = next((h for h in histories if h["name"] == "full"), histories[-1])
  rows = [f"| model | params | s/epoch | CPU s/epoch | tokens/s | speed-up over "
          f"{base['name']} (wall, CPU) | held-out ppl per epoch | best ppl (epoch) | vs "
          f"{base['name']}'s best |",
          "|---|---|---|---|---|---|---|---|---|"]
  base_wall, base_cpu = _per_epoch(base, "train_seconds"), _per_epoch(base, "train_cpu_seconds")
  for h in histories:
    wall, cpu = _per_epoch(h, "train_seconds"), _per_epoch(h, "train_cpu_seconds")
    ppls = ", ".join(f"{p:.1f}" for p in h["held_out_perplexity"][1:])
    best = min(h["held_out_perplexity"][1:])
    best_epoch = h["held_out_perplexity"][1:].index(best) + 1
    base_best = min(base["held_out_perplexity"][1:])
    rows.append(
        f"| {h['name']} | {h['params']:,} | {wall:.1f} | {cpu:.1f} | "
        f"{h['train_tokens'] / wall:,.0f} | {base_wall / wall:.1f}x, {base_cpu / cpu:.1f}x | "
        f"{ppls} | {best:.1f} ({best_epoch}) | {100 * (best / base_best - 1):+.1f}% |")
  return "\n".join(rows)


def _per_epoch(history, key):
  """Median over the epochs after the first (which includes tracing), if there are any."""
  seconds = history[key]
  return max(float(np.median(seconds[1:] if len(seconds) > 1 else seconds)), 1e-6)


def _check_plotting():
  """ImportError before training, not after it, where matplotlib (the plot's, not the
  library's dependency: a wheel does not bring it) is missing."""
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top,unused-import
  except ImportError:
    raise ImportError("the demo plots held-out perplexity with matplotlib, which is not "
                      "installed: pip install matplotlib (or the wheel's extra, "
                      "'tf_hsm[demo]')") from None


def plot(histories, path):
  """Held-out perplexity against training CPU time (the process's, evaluation excluded):
  on a shared machine the fair measure of speed, where wall-clock time stretches with
  the load."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, ax = plt.subplots(figsize=(7, 4.5))
  for h in histories:
    seconds = np.concatenate([[0.0], np.cumsum(h["train_cpu_seconds"])])
    ax.plot(seconds, h["held_out_perplexity"], marker="o", label=h["name"])
  ax.set_yscale("log")
  ax.set_xlabel("training CPU time (s)")
  ax.set_ylabel("held-out perplexity")
  ax.set_title("Word-level LSTM language model: output layers compared")
  ax.grid(True, which="both", alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


# ---------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------

def parse_args(argv=None):
  p = argparse.ArgumentParser(
      prog="python -m tf_hsm.demo",
      description="Train a word-level LSTM language model with a hierarchical softmax "
                  "and with a full softmax, and compare held-out perplexity and speed.")
  p.add_argument("--tree", choices=("huffman", "two_level", "balanced", "learned",
                                    "context", "planned"),
                 default=DEFAULTS["tree"],
                 help="HSM tree: two_level (~sqrt(V) clusters of equal training-count "
                      "mass), huffman (binary Huffman tree of the training counts), "
                      "balanced (~sqrt(V) equal-size clusters of frequency-ranked words) "
                      "or learned (two_level, rebuilt after epoch 1 with Tree.from_vectors "
                      "from the trained input embeddings: --head frequent words at the "
                      "root, the rest in ~sqrt(V) x ~sqrt(V) similarity clusters), "
                      "context (Tree.from_context: built before training from the words' "
                      "left contexts in the training text, --branching-ary, default 32, "
                      "below --head frequent words) "
                      "or planned (the layer tf_hsm.plan recommends by its quality rule "
                      "for this vocabulary's counts and training text, --hidden and "
                      "--batch x --seq-len tokens a step with LazyAdam, within "
                      "--max-ppl-increase if given; its table is printed). "
                      "Default: %(default)s")
  p.add_argument("--mixture", type=int, nargs="?", const=2, default=None, metavar="N",
                 help="with --tree context: the output layer is a "
                      "HierarchicalSoftmaxMixture of N context trees (default 2): from "
                      "the words' left contexts, their right contexts, then left and "
                      "right again clustered from other seeds (about N times one tree's "
                      "step)")
  p.add_argument("--shared-head", action="store_true",
                 help="with --mixture and --head H: the H most frequent words are one "
                      "softmax shared by the trees, which group only the other words "
                      "(HierarchicalSoftmaxMixture(head=...)): the head's work once, "
                      "not once a tree")
  p.add_argument("--tail-dim", type=int, default=None, metavar="D",
                 help="with --shared-head: the trees score a D-wide projection of the "
                      "hidden state (the rare words' fewer dimensions, as the adaptive "
                      "softmax's)")
  p.add_argument("--head-rank", type=int, default=None, metavar="R",
                 help="with --shared-head: each tree's own head, the shared one plus a "
                      "rank-R correction, mixed by the gate (a mixture of softmaxes over "
                      "the frequent words for one head's step)")
  p.add_argument("--max-ppl-increase", type=percent_arg, default=None, metavar="PCT",
                 help="with --tree planned: the planner recommends among the layers "
                      "measured within PCT%% perplexity of full softmax (e.g. 10)")
  p.add_argument("--branching", type=int, default=None,
                 help="children per node of --tree huffman (Tree.huffman(counts, "
                      "branching=K); default 2, binary), --tree balanced (default "
                      "ceil(sqrt(V))) or --tree context (default 32)")
  p.add_argument("--head", type=int, default=None,
                 help="how many of the most frequent words sit directly under the root "
                      "(less than the vocabulary): of the rebuilt tree with --tree "
                      "learned (default: the smaller of %d and 1/8 of the vocabulary), "
                      "of the two-level tree with --tree two_level or of --tree context "
                      "(default: 0)"
                      % LEARNED_HEAD)
  p.add_argument("--rebuild-after-batches", type=int, default=None,
                 help="--tree learned: rebuild after this many training batches instead "
                      "of after epoch 1")
  p.add_argument("--rebuild-from", choices=("embedding", "rows"),
                 default=DEFAULTS["rebuild_from"],
                 help="--tree learned: the vectors the tree is rebuilt from, the input "
                      "embeddings or the HSM's own class rows (default: %(default)s)")
  p.add_argument("--width", type=int, default=None,
                 help="--tree learned: children per node of the rebuilt tree below its "
                      "head (default: ceil(sqrt(V)))")
  p.add_argument("--vocab", type=int, default=DEFAULTS["vocab"],
                 help="largest vocabulary size, <unk> included (default: %(default)s)")
  p.add_argument("--min-count", type=int, default=DEFAULTS["min_count"],
                 help="words seen fewer times in training are <unk> (default: "
                      "%(default)s)")
  p.add_argument("--epochs", type=int, default=DEFAULTS["epochs"],
                 help="default: %(default)s")
  p.add_argument("--hidden", type=int, default=DEFAULTS["hidden"],
                 help="embedding and LSTM size (default: %(default)s)")
  p.add_argument("--seq-len", type=int, default=DEFAULTS["seq_len"],
                 help="default: %(default)s")
  p.add_argument("--batch", type=int, default=DEFAULTS["batch"],
                 help="sequences per batch (default: %(default)s)")
  p.add_argument("--max-tokens", type=int, default=DEFAULTS["max_tokens"],
                 help="corpus tokens used, training plus held-out; 0 for all "
                      "(default: %(default)s)")
  p.add_argument("--corpus", default=None,
                 help="UTF-8 text file to train on instead of the Python stdlib docs")
  p.add_argument("--learning-rate", type=float, default=DEFAULTS["learning_rate"],
                 help="LazyAdam learning rate for both models (default: %(default)s)")
  p.add_argument("--output-lr-scale", type=float, default=1.0,
                 help="every model's output layer (its table and biases) trains at this "
                      "multiple of --learning-rate (default: %(default)s)")
  p.add_argument("--bands", action="store_true",
                 help="after each epoch also the held-out loss by word-frequency band "
                      "(tf_hsm.demo.bands; the epoch's held-out pass, by predict in "
                      "place of Keras' validation)")
  p.add_argument("--seed", type=int, default=DEFAULTS["seed"],
                 help="the held-out split's and, without --init-seed, the initial "
                      "values' seed (default: %(default)s)")
  p.add_argument("--init-seed", type=int, default=None,
                 help="the models' initial values and shuffling alone, the corpus split "
                      "kept (default: --seed): a second set of initial values on the same "
                      "held-out text")
  p.add_argument("--out", default=DEFAULTS["out"],
                 help="directory for results.json, results.md and perplexity.png "
                      "(default: %(default)s)")
  p.add_argument("--models", default=",".join(DEFAULTS["models"]),
                 help="output layers to train, in order, of " + ", ".join(MODELS) +
                      " (sampled: tf.nn.sampled_softmax_loss with --num-sampled "
                      "candidates; adaptive: tf_hsm.AdaptiveSoftmax). Default: "
                      "%(default)s")
  p.add_argument("--cutoffs", default="demo",
                 help="the adaptive softmax's cutoffs: demo (1/8 and 1/2 of the "
                      "vocabulary), planned (those the planner's choose_cutoffs picks "
                      "for this vocabulary, --hidden, --batch x --seq-len tokens a step "
                      "and LazyAdam, with --tail and --div-value, at this machine's "
                      "cached rates), pytorch (the planner's PyTorch-style fixed "
                      "cutoffs) or comma-separated ints (default: %(default)s)")
  p.add_argument("--div-value", type=float, default=2.0,
                 help="the adaptive softmax's div_value: cluster i is "
                      "int(hidden // div_value^(i+1)) wide (default: %(default)s)")
  p.add_argument("--tail", choices=("flat", "two_level"), default="flat",
                 help="the adaptive softmax's tails (default: %(default)s)")
  p.add_argument("--num-sampled", type=int, default=DEFAULTS["num_sampled"],
                 help="sampled softmax candidates per batch (default: %(default)s)")
  p.add_argument("--steps-per-epoch", type=int, default=None,
                 help="train this many batches an epoch instead of the whole training "
                      "split (a timing run: the CPU time of a step at the corpus's "
                      "vocabulary without its hours; default: the whole split)")
  p.add_argument("--eval-tokens", type=int, default=0,
                 help="evaluate on the first N held-out tokens only (0: all)")
  p.add_argument("--skip-full", action="store_true",
                 help="train only the HSM model (the same as --models hsm)")
  p.add_argument("--quiet", action="store_true", help="no Keras progress bars")
  return _checked(p, p.parse_args(argv))


def _checked(p, args):
  """`args` with --models and --cutoffs parsed, after `p.error` for any value that would
  train a wrong model or fail later."""
  args.models = ["hsm"] if args.skip_full else [m for m in args.models.split(",") if m]
  unknown = [m for m in args.models if m not in MODELS]
  if unknown or not args.models:
    p.error(f"--models takes a comma-separated list of {', '.join(MODELS)}; got "
            f"{unknown or 'none'}")
  if args.steps_per_epoch is not None and args.steps_per_epoch < 1:
    p.error("--steps-per-epoch must be positive")
  if args.eval_tokens < 0:
    p.error("--eval-tokens must be >= 0")
  if args.max_tokens < 0:
    p.error("--max-tokens must be >= 0 (0: the whole corpus)")
  if args.init_seed is not None and not 0 <= args.init_seed < 2**32:
    p.error(f"--init-seed must be in [0, 2**32), got {args.init_seed}")
  if not 0 <= args.seed < 2**32:
    p.error("--seed must be in [0, 2**32)")
  for name in ("vocab", "min_count", "epochs", "hidden", "seq_len", "batch", "num_sampled"):
    if getattr(args, name) < 1:
      p.error(f"--{name.replace('_', '-')} must be positive")
  if args.vocab < 2:
    p.error("--vocab must be at least 2 (<unk> and one word)")
  _check_tree_shape(p, args)
  if args.max_ppl_increase is not None and args.tree != "planned":
    p.error("--max-ppl-increase applies to --tree planned")
  for name in ("learning_rate", "output_lr_scale"):
    if not (getattr(args, name) > 0 and math.isfinite(getattr(args, name))):
      p.error(f"--{name.replace('_', '-')} must be a positive number")
  if not (args.div_value > 0 and math.isfinite(args.div_value)):
    p.error("--div-value must be a positive number")
  adaptive_flags = {"cutoffs": "--cutoffs", "div_value": "--div-value", "tail": "--tail"}
  given = [flag for name, flag in adaptive_flags.items()
           if getattr(args, name) != p.get_default(name)]
  if given and "adaptive" not in args.models:
    p.error(f"{', '.join(given)}: for the adaptive softmax, which --models "
            f"{','.join(args.models)} does not train (add adaptive)")
  if args.cutoffs not in ("demo", "planned", "pytorch"):
    try:
      args.cutoffs = [int(c) for c in args.cutoffs.split(",")]
    except ValueError:
      p.error("--cutoffs takes demo, planned, pytorch or comma-separated ints")
  return args


def _check_tree_shape(p, args):
  """`p.error` for a tree argument (--head, --branching, --width, --mixture, ...) that
  its --tree does not take, or out of range."""
  if args.head is not None and args.head < 0:
    p.error("--head must be >= 0")
  if args.head and args.tree not in ("two_level", "learned", "context"):
    p.error("--head applies to --tree two_level, learned and context")
  if args.rebuild_after_batches is not None and args.rebuild_after_batches < 1:
    p.error("--rebuild-after-batches must be positive")
  if args.width is not None and args.width < 2:
    p.error("--width must be at least 2")
  if args.branching is not None and (args.branching < 2 or
                                     args.tree not in ("huffman", "balanced", "context")):
    p.error("--branching takes an int >= 2, with --tree huffman, balanced or context")
  if args.mixture is not None and args.tree != "context":
    p.error("--mixture applies to --tree context")
  if args.mixture is not None and args.mixture < 2:
    p.error(f"--mixture takes at least 2 trees, got {args.mixture}")
  if args.shared_head and (args.mixture is None or not args.head):
    p.error("--shared-head takes --mixture N and --head H (the shared head's words)")
  if args.tail_dim is not None and (not args.shared_head or args.tail_dim < 1):
    p.error("--tail-dim takes an int >= 1, with --shared-head")
  if args.head_rank is not None and (not args.shared_head or args.head_rank < 1):
    p.error("--head-rank takes an int >= 1, with --shared-head")


def main(argv=None):
  args = parse_args(argv)
  _check_plotting()
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
  wall_start = time.perf_counter()
  import keras  # pylint: disable=g-import-not-at-top

  if args.corpus:
    try:
      documents, source = file_documents(args.corpus), args.corpus
    except ValueError as error:
      raise SystemExit(f"--corpus: {error}") from None
  else:
    documents = stdlib_documents()
    source = f"Python {sys.version.split()[0]} standard library docstrings and comments"
  train_tokens, held_out_tokens = split_corpus(documents, args.max_tokens, args.seed)
  words, counts = build_vocab(train_tokens, args.vocab, args.min_count)
  train_ids, held_out_ids = encode(train_tokens, words), encode(held_out_tokens, words)
  if held_out_ids.size < args.seq_len + 1:
    raise SystemExit(f"the corpus is too small: {len(held_out_tokens)} held-out tokens, "
                     f"need at least {args.seq_len + 1} (raise --max-tokens, or lower "
                     "--seq-len)")
  x, y = sequences(train_ids, args.seq_len)
  hx, hy = sequences(held_out_ids[:args.eval_tokens + 1] if args.eval_tokens else
                     held_out_ids, args.seq_len)
  unk_rate = float(np.mean(held_out_ids == 0))
  head = learned_head(len(words)) if args.head is None and args.tree == "learned" else \
      min(args.head or 0, len(words) - 1)
  rebuild, head_ids, head_rank = None, None, args.head_rank
  if args.tree == "planned":
    trees, rebuild, head_ids, head_rank = planned_tree(
        counts, args.hidden, args.batch * args.seq_len, token_ids=train_ids,
        max_perplexity_increase=args.max_ppl_increase)
  elif args.tree == "context":
    trees, head_ids = context_trees(train_ids, counts, head, args.branching or 32,
                                    args.mixture or 1, args.shared_head)
  else:
    trees = [make_tree(args.tree, counts, head, args.branching)]
  tree, mixture = trees[0], len(trees) > 1
  print(f"corpus: {source}\n  {len(train_tokens):,} training and {len(held_out_tokens):,} "
        f"held-out tokens; vocabulary {len(words):,} words incl. <unk> "
        f"({100 * unk_rate:.1f}% of held-out tokens are <unk>)\n"
        f"  HSM tree: {args.tree}"
        f"{f'({args.branching})' if args.branching else ''}, {tree.num_slots:,} weight "
        "rows, depth "
        f"{tree.max_depth}, max branching {tree.max_branching}"
        f"{f', head {head} words' if head else ''}" + (
            f"; mixed with a tree from right contexts, {trees[1].num_slots:,} weight rows"
            + (f", and {len(trees) - 2} more from other seeds" if len(trees) > 2 else "")
            if mixture else "") + (
                f"; the {len(head_ids)} most frequent words a head shared by the trees, "
                "which are over the others" if head_ids is not None else "") + (
                    f", scoring the hidden state's projection to {args.tail_dim} dimensions"
                    if args.tail_dim else "") + (
                        f", each tree's head corrected at rank {head_rank}"
                        if head_rank else ""), flush=True)

  # Progress bars where a person watches; one line per epoch in logs, where each bar's
  # redraws would otherwise become hundreds of lines.
  verbose = 0 if args.quiet else 1 if sys.stdout.isatty() else 2
  cutoffs = None
  if "adaptive" in args.models:
    cutoffs = layout_cutoffs(args.cutoffs, counts, args.hidden, args.batch * args.seq_len,
                             args.div_value, args.tail)
    if not cutoffs:
      raise SystemExit(f"--cutoffs {args.cutoffs} gives no tail cluster for a vocabulary "
                       f"of {len(words):,} words at --hidden {args.hidden} and --div-value "
                       f"{args.div_value:g}: give cutoffs as ints, or a smaller div value")
    named = args.cutoffs if isinstance(args.cutoffs, str) else "given"
    print(f"  adaptive softmax: {args.tail} tails, cutoffs {cutoffs} ({named}), div "
          f"{args.div_value:g}", flush=True)
  histories = []
  for kind in args.models:
    keras.utils.set_random_seed(args.seed if args.init_seed is None else args.init_seed)
    extra = []
    if kind == "hsm":
      name = f"hsm-{args.tree}" + ("-mixture" if mixture else "") + (
          "-shared-head" if head_ids is not None else "") + (
              f"-tail-dim-{args.tail_dim}" if args.tail_dim else "") + (
                  f"-head-rank-{head_rank}" if head_rank else "")
      model = hsm_model(trees, counts, args.hidden, args.seq_len, args.learning_rate,
                        output_lr_scale=args.output_lr_scale, head=head_ids,
                        tail_dim=args.tail_dim, head_rank=head_rank)
      data, held_out = ([x, y], y), ([hx, hy], hy)
      if args.tree == "learned":
        extra = [learned_tree_callback(model, counts, head, args.rebuild_after_batches,
                                       args.rebuild_from, args.width)]
      elif rebuild:
        extra = [planned_rebuild_callback(model, rebuild, args.rebuild_from)]
    elif kind == "full":
      name = "full"
      model = full_softmax_model(counts, args.hidden, args.seq_len, args.learning_rate,
                                 args.output_lr_scale)
      data, held_out = ([x, y], y), ([hx, hy], hy)
    elif kind == "sampled":
      num_sampled = min(args.num_sampled, len(words))
      name = f"sampled-{num_sampled}"
      model = sampled_softmax_model(counts, args.hidden, args.seq_len, args.learning_rate,
                                    num_sampled, args.output_lr_scale)
      data, held_out = ([x, y], y), ([hx, hy], hy)
    else:
      name = "adaptive"
      model = adaptive_model(counts, args.hidden, args.seq_len, args.learning_rate,
                             cutoffs, args.div_value, args.tail, args.output_lr_scale)
      data, held_out = ([x, y], y), ([hx, hy], hy)
    histories.append(train(name, model, data, held_out, args.epochs, args.batch, verbose,
                           extra, args.steps_per_epoch,
                           bands.band_edges(len(words)) if args.bands else None))

  report = table(histories)
  os.makedirs(args.out, exist_ok=True)
  settings = {k: v for k, v in vars(args).items() if k not in ("quiet",)}
  results = {"settings": settings, "corpus": source, "vocab_size": len(words),
             "train_batches_per_epoch": math.ceil(len(x) / args.batch),
             "held_out_unk_rate": unk_rate, "tree": {"kind": args.tree, "head": head,
                                                     "shared_head": None if head_ids is None
                                                     else len(head_ids),
                                                     "num_slots": tree.num_slots,
                                                     "max_depth": tree.max_depth,
                                                     "branching": args.branching,
                                                     "mixture_num_slots": trees[1].num_slots
                                                     if mixture else None},
             "adaptive": None if cutoffs is None else {
                 "cutoffs": cutoffs, "div_value": args.div_value, "tail": args.tail},
             "models": histories, "total_seconds": time.perf_counter() - wall_start}
  with open(os.path.join(args.out, "results.json"), "w") as f:
    json.dump(results, f, indent=2)
  with open(os.path.join(args.out, "results.md"), "w") as f:
    f.write(report + "\n")
  plot(histories, os.path.join(args.out, "perplexity.png"))  # after the figures are kept
  print(f"\n{report}\n\ns/epoch, CPU s/epoch: median training wall-clock and process CPU "
        "time of the epochs after the first (which includes tracing); held-out evaluation "
        "excluded.\nPerplexity: on "
        f"{hy.size:,} held-out tokens.\nWrote {args.out}/results.json, results.md and "
        f"perplexity.png; total {time.perf_counter() - wall_start:.0f} s.", flush=True)
  return results

