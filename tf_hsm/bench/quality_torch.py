"""Output layers' quality at large vocabularies, trained on a GPU with PyTorch:
`python -m tf_hsm.bench.quality_torch prepare|run|summary`.

The quality runs of `tf_hsm.bench.quality_runs` train the demo's model with tf_hsm on the
CPU; at 100K+ classes the exact softmax there costs about 8 V D FLOPs a token (3.4 CPU
hours an epoch of `linux-comments`, 5.8 of `debian-docs`; every row on both, about 13
CPU hours). This command trains the same model on the same data with the same output
layers in PyTorch, where a GPU is (no TensorFlow needed there):

- the demo's model: Embedding(V, 128) -> LSTM(128) -> the output layer, Keras' initial
  values (Glorot uniform tables, orthogonal recurrent kernel, forget bias 1, embeddings
  uniform in +-0.05), biases at the unigram distribution as the demo sets them, LazyAdam
  6e-3 (Keras' update; only rows with a gradient move), batches of 64 sequences of 32
  tokens, shuffled each epoch;
- the output layers: the exact softmax; TensorFlow's `sampled_softmax_loss` (1,024
  unique log-uniform candidates, log Q subtracted, accidental hits removed; evaluated
  exactly); a hierarchical softmax over any `tf_hsm.Tree` (the trees are tf_hsm's, built
  by `tf_hsm.tree`, NumPy only; the log-probability is each path's sum of log-softmaxes
  over the path nodes' children, exact); PyTorch's adaptive softmax (the layout tf_hsm's
  `AdaptiveSoftmax` loads); and trees rebuilt from the input embeddings during training
  (`Tree.from_vectors`, weights carried over by `tf_hsm.tree.transfer`, as
  `tf_hsm.keras.callbacks.RebuildTree` does); the demo's trees from the words' left
  contexts (`Tree.from_context`, built once before training and kept beside the corpus's
  .npz);
- held-out perplexity (exact, every layer) every `--eval-every` training tokens on the
  first `--eval-tokens` held-out tokens, written as the run goes (a run cut by its time
  budget keeps its checkpoints), so layers are compared at equal training tokens.

`--hidden` sets the embedding's and LSTM's width, `--output-lr-scale` the output layer's
steps as a multiple of the learning rate (the demo's flags), `--seed` the initial values
and batch order. Matrix products use TF32 on the GPU (`--tf32`, default on; float32
accumulation), the same for every layer. `prepare` runs where tf_hsm's demo runs: it
tokenises a corpus with the demo's tokeniser, split and vocabulary (`tf_hsm.demo.run`)
and writes the ids, the counts and the adaptive layouts' cutoffs to one .npz; `run` and
`summary` need PyTorch and NumPy only.
"""

import argparse
import json
import math
import os
import subprocess
import sys
import time

import numpy as np

SEQ_LEN, BATCH, HIDDEN, LEARNING_RATE, NUM_SAMPLED = 32, 64, 128, 6e-3, 1024
# Row -> (layer kind, options). "rebuild": a tree rebuilt from the input embeddings after
# --rebuild-after batches, with (branching, head); "sqrt" is ceil(sqrt(V)) as the demo's
# learned tree, "learned_head" its head (min(128, V // 8)).
ROWS = {
    "full": ("full", {}),
    "sampled": ("sampled", {}),
    "two_level": ("tree", {"start": "two_level"}),
    "huffman8": ("tree", {"start": "huffman8"}),
    "huffman32": ("tree", {"start": "huffman32"}),
    "balanced": ("tree", {"start": "balanced"}),
    "learned": ("tree", {"start": "two_level", "rebuild": ("sqrt", "learned_head")}),
    "adaptive_flat": ("adaptive", {"cutoffs": "planned", "div_value": 4.0}),
    "adaptive_fixed": ("adaptive", {"cutoffs": "pytorch", "div_value": 4.0}),
    "adaptive_demo": ("adaptive", {"cutoffs": "demo", "div_value": 2.0}),
    "vectors32_head256": ("tree", {"start": "huffman32", "rebuild": (32, 256)}),
    "vectors32_head1024": ("tree", {"start": "huffman32", "rebuild": (32, 1024)}),
    "vectors32": ("tree", {"start": "huffman32", "rebuild": (32, 0)}),
    "vectors64_head256": ("tree", {"start": "huffman32", "rebuild": (64, 256)}),
    # Rebuilt twice: after --rebuild-after batches and after three times as many.
    "vectors32_head256_x2": ("tree", {"start": "huffman32", "rebuild": (32, 256),
                                      "rebuilds": 2}),
    # Built before training from the words' left contexts (the demo's --tree context),
    # (branching, head); never rebuilt.
    "context32_head256": ("tree", {"start": "context", "context": (32, 256)}),
    "context64_head256": ("tree", {"start": "context", "context": (64, 256)}),
    "context32_head1024": ("tree", {"start": "context", "context": (32, 1024)}),
}


# ---------------------------------------------------------------------------------------
# prepare (where tf_hsm's demo runs)
# ---------------------------------------------------------------------------------------

def prepare(corpus, max_tokens, vocab, out, hidden=HIDDEN):
  """Tokenises CORPUS (a file; None: the standard library) as `python -m tf_hsm.demo
  --corpus CORPUS --max-tokens N --vocab VOCAB` does and writes OUT (.npz)."""
  from tf_hsm.demo import run  # pylint: disable=g-import-not-at-top
  documents = run.file_documents(corpus) if corpus else run.stdlib_documents()
  train, held_out = run.split_corpus(documents, max_tokens, run.DEFAULTS["seed"])
  words, counts = run.build_vocab(train, vocab, run.DEFAULTS["min_count"])
  cutoffs = {name: run.layout_cutoffs(name, counts, hidden, BATCH * SEQ_LEN, div_value=div,
                                      tail="flat")
             for name, div in (("planned", 4.0), ("pytorch", 4.0), ("demo", 2.0))}
  meta = {"corpus": os.path.basename(corpus or "stdlib"), "max_tokens": max_tokens,
          "vocab_size": len(words), "train_tokens": len(train),
          "held_out_tokens": len(held_out), "cutoffs": cutoffs}
  np.savez_compressed(out, train=run.encode(train, words).astype(np.uint32),
                      held_out=run.encode(held_out, words).astype(np.uint32),
                      counts=counts, meta=np.array(json.dumps(meta)))
  return meta


def load_corpus(path):
  with np.load(path) as f:
    meta = json.loads(str(f["meta"]))
    return (f["train"].astype(np.int64), f["held_out"].astype(np.int64),
            f["counts"].astype(np.float64), meta)


# ---------------------------------------------------------------------------------------
# The layers (PyTorch)
# ---------------------------------------------------------------------------------------

def _glorot(torch, rows, cols, generator):
  limit = math.sqrt(6.0 / (rows + cols))
  return (torch.rand(rows, cols, generator=generator, dtype=torch.float64) * 2 - 1) * limit


def start_tree(name, counts):
  """The tree a row starts from, by name (tf_hsm's builders)."""
  from tf_hsm.tree import Tree  # pylint: disable=g-import-not-at-top
  v = len(counts)
  if name == "two_level":
    return Tree.two_level(v, counts)
  if name.startswith("huffman"):
    return Tree.huffman(counts, branching=int(name[len("huffman"):]))
  if name == "balanced":  # the planner's three-level tree
    return Tree.balanced(v, max(2, math.ceil(v ** (1 / 3) - 1e-9)))
  raise ValueError(f"unknown tree {name!r}")


def context_tree_path(corpus, branching, head):
  """Where `context_tree` keeps CORPUS's tree: beside the .npz of `prepare`."""
  return f"{os.path.splitext(corpus)[0]}.context{branching}_head{head}.tree.npz"


def context_tree(corpus, branching, head):
  """`Tree.from_context` over CORPUS's training ids with the demo's arguments (`--tree
  context --branching B --head H`), read from `context_tree_path` when it is there, else
  built (NumPy; minutes at 100K classes) and written there."""
  from tf_hsm.tree import Tree  # pylint: disable=g-import-not-at-top
  path = context_tree_path(corpus, branching, head)
  if os.path.exists(path):
    return Tree.load(path)
  train, _, counts, _ = load_corpus(corpus)
  v = len(counts)
  tree = Tree.from_context(train, v, counts, branching=branching, head=min(head, v - 1))
  tree.save(path)
  return tree


class TreeArrays:
  """A tf_hsm.Tree's paths as padded [V, L] tensors on a device: each step's node, its
  first slot, its width and the slot taken."""

  def __init__(self, torch, tree, device):
    v = tree.num_classes
    begin = tree.path_begin
    depth = np.diff(begin)
    steps = int(depth.max())
    col = np.arange(steps)
    valid = col[None, :] < depth[:, None]
    at = np.where(valid, begin[:-1, None] + col[None, :], 0)
    nodes = np.where(valid, tree.path_nodes[at], 0)
    slots = np.where(valid, tree.path_slots[at], 0)
    child_begin = np.asarray(tree.child_begin, np.int64)
    width = np.diff(child_begin)
    self.flat = tree.num_nodes == 1
    self.max_width = int(width.max())
    t = lambda a: torch.as_tensor(np.ascontiguousarray(a), device=device)
    self.valid, self.slot = t(valid), t(slots)
    self.first = t(child_begin[nodes])
    self.width = t(np.where(valid, width[nodes], 0))
    self.num_slots, self.num_classes = tree.num_slots, v


def tree_log_prob(torch, arrays, weight, bias, h, y):
  """log P(y | h) under the tree: per path step, the chosen slot's logit minus the
  log-sum-exp of its node's children's logits (all slots' logits from one product; a
  step's children gathered from them)."""
  logits = torch.addmm(bias, h, weight.t())
  if arrays.flat:  # one node: the slot of class c need not be c (a Huffman tree's order)
    return torch.log_softmax(logits, dim=1).gather(1, arrays.slot[y][:, :1])[:, 0]
  valid, slot = arrays.valid[y], arrays.slot[y]
  first, width = arrays.first[y], arrays.width[y]
  offsets = torch.arange(arrays.max_width, device=h.device)
  index = first[:, :, None] + offsets
  inside = offsets < width[:, :, None]
  index = torch.where(inside, index, torch.zeros_like(index))
  n = h.shape[0]
  children = logits.gather(1, index.view(n, -1)).view(index.shape)
  children = children.masked_fill(~inside, float("-inf"))
  lse = torch.logsumexp(children, dim=2)
  lse = torch.where(valid, lse, torch.zeros_like(lse))
  chosen = torch.where(valid, logits.gather(1, slot), torch.zeros_like(lse))
  return (chosen - lse).sum(dim=1)


def log_uniform_candidates(rng, num_sampled, range_max):
  """TensorFlow's LogUniformCandidateSampler with unique=True: ids drawn with P(k) =
  log((k + 2) / (k + 1)) / log(range_max + 1) until num_sampled are distinct; returns
  (ids, tries)."""
  log_range = math.log(range_max + 1)
  size = 4 * num_sampled
  while True:
    draws = (np.exp(rng.random(size) * log_range).astype(np.int64) - 1) % range_max
    _, first = np.unique(draws, return_index=True)
    if first.size >= num_sampled:
      first = np.sort(first)[:num_sampled]
      return draws[first], int(first[-1]) + 1
    size *= 4


def log_expected_count(ids, tries, range_max):
  p = (np.log(ids + 2.0) - np.log(ids + 1.0)) / math.log(range_max + 1)
  return np.log(-np.expm1(tries * np.log1p(-p)))


def sampled_log_prob(torch, weight, bias, h, y, rng):
  """Minus TensorFlow's sampled_softmax_loss (default arguments) per token."""
  v = weight.shape[0]
  ids, tries = log_uniform_candidates(rng, NUM_SAMPLED, v)
  y_np = y.cpu().numpy()
  dev = h.device
  sampled = torch.as_tensor(ids, device=dev)
  q_true = torch.as_tensor(log_expected_count(y_np, tries, v), device=dev, dtype=h.dtype)
  q_sampled = torch.as_tensor(log_expected_count(ids, tries, v), device=dev, dtype=h.dtype)
  true_logit = (h * weight[y]).sum(1) + bias[y] - q_true
  sampled_logits = torch.addmm(bias[sampled], h, weight[sampled].t()) - q_sampled
  hits = sampled[None, :] == y[:, None]
  sampled_logits = sampled_logits.masked_fill(hits, float("-inf"))
  both = torch.cat([true_logit[:, None], sampled_logits], dim=1)
  return torch.log_softmax(both, dim=1)[:, 0]


def _make_model(torch, row, corpus, counts, meta, device, seed, hidden=HIDDEN):
  """(module, output-layer state) for ROW on CORPUS (a .npz of `prepare`): the embedding,
  the LSTM and the row's layer, `hidden` wide, initialised as Keras initialises the demo's
  model."""
  from tf_hsm.demo import run  # pylint: disable=g-import-not-at-top
  nn = torch.nn
  kind, options = ROWS[row]
  v = len(counts)
  g = torch.Generator().manual_seed(seed)
  model = nn.Module()
  model.embedding = nn.Embedding(v, hidden)
  model.lstm = nn.LSTM(hidden, hidden, batch_first=True)
  with torch.no_grad():
    model.embedding.weight.copy_((torch.rand(v, hidden, generator=g) * 2 - 1) * 0.05)
    # Keras: one [D, 4U] Glorot kernel, an orthogonal [U, 4U] recurrent kernel, the
    # forget gate's bias 1 (the gates' order i, f, c/g, o is the same).
    model.lstm.weight_ih_l0.copy_(_glorot(torch, hidden, 4 * hidden, g).t())
    q, r = torch.linalg.qr(torch.randn(4 * hidden, hidden, generator=g, dtype=torch.float64))
    model.lstm.weight_hh_l0.copy_(q * torch.sign(torch.diagonal(r)))
    model.lstm.bias_ih_l0.zero_()
    model.lstm.bias_hh_l0.zero_()
    model.lstm.bias_ih_l0[hidden:2 * hidden] = 1.0
  layer = {"kind": kind}
  if kind in ("full", "sampled"):
    model.weight = nn.Parameter(_glorot(torch, v, hidden, g).float())
    model.bias = nn.Parameter(torch.as_tensor(run.unigram_log_probs(counts),
                                              dtype=torch.float32))
    if kind == "full":
      from tf_hsm.tree import Tree  # pylint: disable=g-import-not-at-top
      layer["tree"] = Tree.flat(v)
  elif kind == "tree":
    tree = (context_tree(corpus, *options["context"]) if options["start"] == "context"
            else start_tree(options["start"], counts))
    model.weight = nn.Parameter(_glorot(torch, tree.num_slots, hidden, g).float())
    model.bias = nn.Parameter(torch.as_tensor(run.tree_unigram_biases(tree, counts),
                                              dtype=torch.float32))
    layer["tree"] = tree
  else:
    cutoffs = meta["cutoffs"][options["cutoffs"]]
    model.adaptive = nn.AdaptiveLogSoftmaxWithLoss(hidden, v, cutoffs,
                                                   div_value=options["div_value"],
                                                   head_bias=True)
    with torch.no_grad():
      for p in model.adaptive.parameters():
        if p.dim() == 2:
          p.copy_(_glorot(torch, p.shape[1], p.shape[0], g).t())
      log_p = run.unigram_log_probs(counts)
      bounds = list(cutoffs) + [v]
      head = list(log_p[:cutoffs[0]]) + [np.logaddexp.reduce(log_p[lo:hi])
                                         for lo, hi in zip(bounds[:-1], bounds[1:])]
      model.adaptive.head.bias.copy_(torch.as_tensor(head))
  model.to(device)
  if "tree" in layer:
    layer["arrays"] = TreeArrays(torch, layer["tree"], device)
  return model, layer


def _log_prob(torch, model, layer, tokens, targets, training, rng):
  """Per-token log P(target) (minus the sampled loss for `sampled` in training)."""
  h, _ = model.lstm(model.embedding(tokens))
  h = h.reshape(-1, h.shape[-1])
  y = targets.reshape(-1)
  if layer["kind"] == "sampled":
    if training:
      return sampled_log_prob(torch, model.weight, model.bias, h, y, rng)
    return torch.log_softmax(torch.addmm(model.bias, h, model.weight.t()), 1).gather(
        1, y[:, None])[:, 0]
  if layer["kind"] == "adaptive":
    return model.adaptive(h, y).output
  return tree_log_prob(torch, layer["arrays"], model.weight, model.bias, h, y)


class LazyAdam:
  """Keras' Adam update (epsilon 1e-7); for the tables (embeddings, output rows and
  biases) only the rows whose gradient is not all zero move, as tf_hsm's LazyAdam moves
  the rows of its IndexedSlices. The output layer's steps are `output_scale` x the
  learning rate's (the demo's `--output-lr-scale`; the moments are the same)."""

  def __init__(self, torch, model, learning_rate, output_scale=1.0):
    self.torch, self.lr, self.step = torch, learning_rate, 0
    self.model, self.output_scale = model, output_scale
    # Dense as in the Keras model: the LSTM and the adaptive tails' projections (the
    # variables tf_hsm's layers read whole); the rest are tables read by rows.
    dense = lambda n: n.startswith("lstm") or (".tail." in n and n.endswith(".0.weight"))
    self.dense = [p for n, p in model.named_parameters() if dense(n)]
    self.rows = [p for n, p in model.named_parameters() if not dense(n)]
    self.state = {}

  def reset(self, params):
    for p in params:
      self.state.pop(id(p), None)

  @staticmethod
  def _moments(state, p):
    if id(p) not in state:
      state[id(p)] = (p.new_zeros(p.shape), p.new_zeros(p.shape))
    return state[id(p)]

  def apply(self):
    torch = self.torch
    self.step += 1
    b1, b2, eps = 0.9, 0.999, 1e-7
    base = self.lr * math.sqrt(1 - b2 ** self.step) / (1 - b1 ** self.step)
    # The output layer's variables, named afresh each step (a rebuild replaces them).
    output = {id(p) for n, p in self.model.named_parameters()
              if n in ("weight", "bias") or n.startswith("adaptive.")}
    with torch.no_grad():
      dense = {id(p) for p in self.dense}
      for p in self.dense + self.rows:
        if p.grad is None:
          continue
        alpha = base * (self.output_scale if id(p) in output else 1.0)
        m, v = self._moments(self.state, p)
        g = p.grad
        if id(p) in dense:
          m.mul_(b1).add_(g, alpha=1 - b1)
          v.mul_(b2).addcmul_(g, g, value=1 - b2)
          p.addcdiv_(m, v.sqrt().add_(eps), value=-alpha)
          continue
        touched = (g != 0).reshape(g.shape[0], -1).any(dim=1).nonzero()[:, 0]
        gi = g[touched]
        mi = m[touched].mul_(b1).add_(gi, alpha=1 - b1)
        vi = v[touched].mul_(b2).addcmul_(gi, gi, value=1 - b2)
        m[touched], v[touched] = mi, vi
        p[touched] -= alpha * mi / (vi.sqrt() + eps)


def rebuild(torch, model, layer, optimizer, counts, branching, head, seed=0):
  """Rebuilds the row's tree from the input embeddings (`Tree.from_vectors`) and starts
  the new table from the old class rows (`tf_hsm.tree.transfer`), with fresh moments."""
  from tf_hsm.tree import Tree  # pylint: disable=g-import-not-at-top
  from tf_hsm.tree.transfer import class_masses, transferred_weights  # pylint: disable=g-import-not-at-top
  old = layer["tree"]
  vectors = model.embedding.weight.detach().cpu().double().numpy()
  tree = Tree.from_vectors(vectors, counts=counts, branching=branching, seed=seed,
                           head=head)
  class_rows = model.weight.detach().cpu().numpy()[old.class_slot]
  kernel, bias = transferred_weights(tree, class_rows, class_masses(counts, len(counts)))
  optimizer.reset([model.weight, model.bias])
  optimizer.rows = [p for p in optimizer.rows if p is not model.weight and p is not model.bias]
  device = model.weight.device
  model.weight = torch.nn.Parameter(torch.as_tensor(kernel, dtype=torch.float32, device=device))
  model.bias = torch.nn.Parameter(torch.as_tensor(bias, dtype=torch.float32, device=device))
  optimizer.rows += [model.weight, model.bias]
  layer["tree"], layer["arrays"] = tree, TreeArrays(torch, tree, device)
  return tree


def evaluate(torch, model, layer, data, device):
  """Held-out perplexity (exact log-probabilities) over DATA = (inputs, targets)."""
  x, y = data
  total = 0.0
  with torch.no_grad():
    for i in range(0, len(x), BATCH):
      xb = torch.as_tensor(x[i:i + BATCH], device=device)
      yb = torch.as_tensor(y[i:i + BATCH], device=device)
      total += float(_log_prob(torch, model, layer, xb, yb, False, None).double().sum())
  return math.exp(min(700.0, -total / y.size))


def _rebuild_shape(option, counts):
  width, head = option
  v = len(counts)
  sqrt = max(2, math.ceil(math.sqrt(v)))
  branching = [sqrt, sqrt] if width == "sqrt" else int(width)
  # A head at most 1/8 of the classes (the demo's rule for its learned tree), so that a
  # small vocabulary keeps most of its classes in the similarity tree below.
  head = min(128 if head == "learned_head" else int(head), v // 8)
  return branching, head


def train_row(args):
  """Trains one row on one corpus for at most --seconds, writing --out as it goes."""
  import torch  # pylint: disable=g-import-not-at-top
  started = time.monotonic()
  torch.backends.cuda.matmul.allow_tf32 = args.tf32
  torch.backends.cudnn.allow_tf32 = args.tf32
  device = torch.device(args.device)
  train, held_out, counts, meta = load_corpus(args.corpus)
  from tf_hsm.demo import run  # pylint: disable=g-import-not-at-top
  x, y = run.sequences(train, SEQ_LEN)
  held = run.sequences(held_out[:args.eval_tokens + 1], SEQ_LEN)
  model, layer = _make_model(torch, args.row, args.corpus, counts, meta, device, args.seed,
                             args.hidden)
  optimizer = LazyAdam(torch, model, LEARNING_RATE, args.output_lr_scale)
  options = ROWS[args.row][1]
  rng = np.random.default_rng(args.seed)
  record = {"row": args.row, "corpus": meta["corpus"], "vocab_size": len(counts),
            "train_tokens": int(y.size), "eval_tokens": int(held[1].size),
            "eval_every": args.eval_every, "rebuild_after": args.rebuild_after,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "tf32": args.tf32, "hidden": args.hidden,
            "output_lr_scale": args.output_lr_scale, "seed": args.seed, "checkpoints": [],
            "rebuilds": [], "tree": None}

  def checkpoint(tokens, epoch, regular=True):
    t0 = time.monotonic()
    ppl = evaluate(torch, model, layer, held, device)
    record["checkpoints"].append({"tokens": tokens, "epoch": epoch, "perplexity": ppl,
                                  "step": tokens // args.eval_every if regular else None,
                                  "seconds": time.monotonic() - started,
                                  "eval_seconds": time.monotonic() - t0})
    if "tree" in layer:
      t = layer["tree"]
      record["tree"] = {"num_slots": int(t.num_slots), "max_depth": int(t.max_depth),
                        "max_branching": int(t.max_branching)}
    with open(args.out, "w") as f:
      json.dump(record, f, indent=1)
    print(f"{args.row} {meta['corpus']}: {tokens:,} tokens, perplexity {ppl:.2f}, "
          f"{time.monotonic() - started:.0f} s", flush=True)
    return time.monotonic() - t0

  eval_cost = checkpoint(0, 0)
  tokens, batches, next_eval = 0, 0, args.eval_every
  for epoch in range(1, args.epochs + 1):
    order = rng.permutation(len(x))
    for i in range(0, len(order) - BATCH + 1, BATCH):
      if time.monotonic() - started + 1.5 * eval_cost > args.seconds:
        break
      xb = torch.as_tensor(x[order[i:i + BATCH]], device=device)
      yb = torch.as_tensor(y[order[i:i + BATCH]], device=device)
      loss = -_log_prob(torch, model, layer, xb, yb, True, rng).mean()
      model.zero_grad(set_to_none=True)
      loss.backward()
      optimizer.apply()
      tokens += yb.numel()
      batches += 1
      if "rebuild" in options and batches in (args.rebuild_after, 3 * args.rebuild_after)[
          :options.get("rebuilds", 1)]:
        t0 = time.monotonic()
        branching, head = _rebuild_shape(options["rebuild"], counts)
        rebuild(torch, model, layer, optimizer, counts, branching, head)
        record["rebuilds"].append({"batches": batches, "branching": branching,
                                   "head": head, "seconds": time.monotonic() - t0})
      if tokens >= next_eval:
        eval_cost = checkpoint(tokens, epoch)
        next_eval += args.eval_every
    else:
      continue
    break
  if not record["checkpoints"] or record["checkpoints"][-1]["tokens"] != tokens:
    checkpoint(tokens, epoch, regular=False)
  return record


# ---------------------------------------------------------------------------------------
# run: every row on every corpus, as processes sharing the device
# ---------------------------------------------------------------------------------------

def run_all(args):
  """Starts `row` jobs, at most --jobs at a time, each with --seconds; returns when all
  have ended (a job past its time by 120 s is killed; its checkpoints stay)."""
  rows = [r for r in args.rows.split(",") if r]
  jobs = [(c, r) for r in rows for c in args.corpora]
  os.makedirs(args.out, exist_ok=True)
  for c, r in jobs:  # each context tree built once, before the rows that read it start
    if ROWS[r][1].get("start") == "context":
      context_tree(c, *ROWS[r][1]["context"])
  running, status = [], {}
  while jobs or running:
    while jobs and len(running) < args.jobs:
      corpus, row = jobs.pop(0)
      name = f"{os.path.splitext(os.path.basename(corpus))[0]}.{row}"
      cmd = [sys.executable, "-m", "tf_hsm.bench.quality_torch", "row", corpus, row,
             "--out", os.path.join(args.out, name + ".json"), "--seconds", str(args.seconds),
             "--device", args.device, "--eval-every", str(args.eval_every),
             "--eval-tokens", str(args.eval_tokens), "--rebuild-after",
             str(args.rebuild_after), "--epochs", str(args.epochs), "--hidden",
             str(args.hidden), "--output-lr-scale", str(args.output_lr_scale), "--seed",
             str(args.seed)]
      if not args.tf32:
        cmd.append("--no-tf32")
      log = open(os.path.join(args.out, name + ".log"), "w")
      running.append((name, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT),
                      time.monotonic(), log))
    time.sleep(1)
    for job in list(running):
      name, proc, started, log = job
      if proc.poll() is None and time.monotonic() - started > args.seconds + 120:
        proc.kill()
      if proc.poll() is not None:
        status[name] = proc.returncode
        log.close()
        running.remove(job)
  with open(os.path.join(args.out, "status.json"), "w") as f:
    json.dump(status, f, indent=1)
  return 0 if all(code == 0 for code in status.values()) else 1


def every(rows):
  """The runs' --eval-every (recorded with each run)."""
  return next(iter(rows.values()))["eval_every"]


def summary(out):
  """Per corpus, each row's perplexity at the most training tokens every row reached
  (the rows compared at equal tokens) and at its last checkpoint, against full's."""
  found = {}
  for name in sorted(os.listdir(out)):
    if name.endswith(".json") and name != "status.json":
      with open(os.path.join(out, name)) as f:
        r = json.load(f)
      found.setdefault(r["corpus"], {})[r["row"]] = r
  lines = []
  for corpus, rows in found.items():
    # The checkpoints every --eval-every tokens that every row reached: the rows are
    # compared at the last of them (the first batch past it).
    regular = lambda r: {c["step"]: c for c in r["checkpoints"] if c.get("step") is not None}
    step = min(max(regular(r)) for r in rows.values())
    at = lambda r, _: regular(r)[step]
    common = at(next(iter(rows.values())), None)["tokens"]
    full = rows.get("full")
    ref = at(full, common)["perplexity"] if full else None
    some = next(iter(rows.values()))
    lines += [f"\n{corpus}: V = {some['vocab_size']:,}, D = {some.get('hidden', HIDDEN)}, "
              f"output layer's rate x{some.get('output_lr_scale', 1.0):g}, "
              f"{some['train_tokens']:,} training "
              f"tokens an epoch, perplexity on {some['eval_tokens']:,} held-out tokens; "
              f"rows compared at about {common:,} training tokens", "",
              "| row | tree after training | perplexity at common tokens | vs full | last "
              "checkpoint: tokens, perplexity |", "|---|---|---|---|---|"]
    for row in ROWS:
      if row not in rows:
        continue
      r = rows[row]
      c, last = at(r, common), r["checkpoints"][-1]
      vs = "-" if ref is None else f"{100 * (c['perplexity'] / ref - 1):+.1f}%"
      t = r["tree"]
      tree = "" if not t else (f"{t['num_slots']:,} rows, depth {t['max_depth']}, widest "
                               f"{t['max_branching']:,}")
      lines.append(f"| {row} | {tree} | {c['perplexity']:.2f} ({c['tokens']:,}) | {vs} | "
                   f"{last['tokens']:,}, {last['perplexity']:.2f} |")
    lines += ["", "Held-out perplexity by millions of training tokens (regular checkpoints):", ""]
    steps = sorted({k for r in rows.values() for k in regular(r) if k})
    lines += ["| row | " + " | ".join(f"{k * every(rows) / 1e6:g}M" for k in steps) + " |",
              "|---|" + "---|" * len(steps)]
    for row in ROWS:
      if row in rows:
        got = regular(rows[row])
        lines.append(f"| {row} | " + " | ".join(
            f"{got[k]['perplexity']:.2f}" if k in got else "" for k in steps) + " |")
  return found, "\n".join(lines)


def _positive_int(text):
  value = int(text)
  if value < 1:
    raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
  return value


def _positive_float(text):
  value = float(text)
  if not (value > 0 and math.isfinite(value)):
    raise argparse.ArgumentTypeError(f"must be a positive finite number, got {text}")
  return value


def main(argv=None):
  p = argparse.ArgumentParser(prog="python -m tf_hsm.bench.quality_torch",
                              description=__doc__.split("\n\n")[0])
  sub = p.add_subparsers(dest="command", required=True)
  prep = sub.add_parser("prepare", help="a corpus's ids, counts and cutoffs as .npz")
  prep.add_argument("corpus", help="a tf_hsm.bench.corpora name or a UTF-8 text file")
  prep.add_argument("out", help="the .npz to write")
  prep.add_argument("--max-tokens", type=int, default=0, help="0: the whole corpus")
  prep.add_argument("--vocab", type=int, default=10_000_000,
                    help="at most this many classes (default: every word seen twice)")
  for name in ("row", "run"):
    q = sub.add_parser(name)
    if name == "row":
      q.add_argument("corpus", help="a .npz of `prepare`")
      q.add_argument("row", choices=list(ROWS))
      q.add_argument("--out", required=True)
    else:
      q.add_argument("corpora", nargs="+", help=".npz files of `prepare`")
      q.add_argument("--rows", default=",".join(ROWS))
      q.add_argument("--out", default=os.path.join("demo_results", "quality_torch"))
      q.add_argument("--jobs", type=int, default=4, help="rows trained at once")
    q.add_argument("--seconds", type=float, default=600.0, help="a row's time budget")
    q.add_argument("--epochs", type=int, default=3)
    q.add_argument("--device", default="cuda")
    q.add_argument("--eval-every", type=int, default=2_000_000)
    q.add_argument("--eval-tokens", type=int, default=500_000)
    q.add_argument("--rebuild-after", type=int, default=1000,
                   help="training batches before a tree is rebuilt from the embeddings")
    q.add_argument("--seed", type=int, default=0)
    q.add_argument("--hidden", type=_positive_int, default=HIDDEN,
                   help="the embedding's and LSTM's width (the demo's --hidden)")
    q.add_argument("--output-lr-scale", type=_positive_float, default=1.0,
                   help="the output layer's steps at this multiple of the learning rate "
                        "(the demo's --output-lr-scale)")
    q.add_argument("--no-tf32", dest="tf32", action="store_false")
  summ = sub.add_parser("summary")
  summ.add_argument("out")
  args = p.parse_args(argv)
  if args.command == "prepare":
    from tf_hsm.bench.corpora import DEFAULT_OUT, LARGE, corpus_file  # pylint: disable=g-import-not-at-top
    path = corpus_file(args.corpus, DEFAULT_OUT if args.corpus in LARGE else
                       os.path.dirname(os.path.abspath(args.out)))
    print(json.dumps(prepare(path, args.max_tokens, args.vocab, args.out)), flush=True)
    return 0
  if args.command == "row":
    train_row(args)
    return 0
  if args.command == "run":
    return run_all(args)
  print(summary(args.out)[1])
  return 0


if __name__ == "__main__":
  sys.exit(main())
