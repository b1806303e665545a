"""`python -m tf_hsm.planning`: the planner's table for a model's output layer, or with
`--verify` the bench's measurements beside the planner's figures.

Errors (a bad size, a missing or malformed counts file, counts of the wrong length)
print one line and exit with status 2; progress goes to stderr (--quiet: none)."""

import argparse
import json
import math
import os
import re
import sys

import numpy as np

from tf_hsm.planning.candidates import plan
from tf_hsm.planning.costs import DTYPE_BYTES, OPTIMIZERS
from tf_hsm.planning.machine import Machine
from tf_hsm.planning.pricing import parse_bytes


def parse_count(text):
  """'10M' -> 10000000, '3200' -> 3200, '1.5K' -> 1500."""
  match = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]?)\s*", str(text), re.IGNORECASE)
  if not match:
    raise ValueError(f"not a count: {text!r}")
  return int(float(match.group(1)) * {"": 1, "K": 10**3, "M": 10**6, "G": 10**9,
                                       "T": 10**12}[match.group(2).upper()])


class _Parser(argparse.ArgumentParser):
  """argparse, with its errors on one line (no usage block)."""

  def error(self, message):
    self.exit(2, f"{self.prog}: error: {message} (--help for the options)\n")


def _count_arg(text):
  try:
    value = parse_count(text)
  except ValueError:
    raise argparse.ArgumentTypeError(
        f"not a count: {text!r} (a number with an optional K, M, G or T: 10M, 1.5K, "
        "3200)") from None
  if value < 1:
    raise argparse.ArgumentTypeError(f"must be at least 1, got {text!r}")
  return value


def _bytes_arg(text):
  try:
    return parse_bytes(text)
  except ValueError:
    raise argparse.ArgumentTypeError(
        f"not a size: {text!r} (e.g. 24GiB, 12GB, 512MiB, or bytes)") from None


def _read(flag, path, what, load):
  """load(path), or a ValueError with a one-line message naming `flag`, the file and
  `what` it should hold."""
  if not os.path.exists(path):
    raise ValueError(f"{flag}: no such file: {path}")
  try:
    return load(path)
  except (OSError, ValueError, EOFError) as error:
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    raise ValueError(f"{flag}: cannot read {path} as {what}: {first}") from None


def _load_counts(path, num_classes):
  """The counts of a .npy file or a text file (one number a line, or whitespace
  separated), checked for length; ValueError with a one-line message otherwise."""
  counts = _read("--counts", path, "class counts",
                 lambda p: np.load(p, allow_pickle=False) if p.endswith(".npy") else
                 np.loadtxt(p, dtype=np.float64, ndmin=1))
  if counts.ndim != 1:
    raise ValueError(f"--counts: {path} holds an array of shape {counts.shape}; expected "
                     "one count a class")
  if num_classes is not None and counts.size != num_classes:
    raise ValueError(f"--counts: {path} holds {counts.size:,} counts but --classes is "
                     f"{num_classes:,}")
  return counts


def percent_arg(text):
  """An argparse type: a percentage ("10" or "10%") as a fraction (0.1); the planner's
  --max-ppl-increase and the demo's."""
  try:
    value = float(text.strip().rstrip("%"))
  except ValueError:
    value = math.nan
  if not 0 <= value < math.inf:
    raise argparse.ArgumentTypeError(f"not a percentage >= 0: {text!r} (e.g. 10 or 10%)")
  return value / 100


def _load_token_ids(path):
  """The training text's class ids of a .npy file (`plan`'s token_ids; it checks them);
  ValueError with a one-line message where the file cannot be read."""
  return _read("--token-ids", path, "a .npy array",
               lambda p: np.load(p, allow_pickle=False, mmap_mode="r"))


class _Progress:
  """Progress on stderr: one line rewritten in place on a terminal, a line each
  otherwise."""

  def __init__(self, stream=None, quiet=False):
    self.stream = stream or sys.stderr
    self.quiet = quiet
    self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
    self.width = 0

  def __call__(self, text):
    if self.quiet:
      return
    text = f"tf_hsm.planning: {text}"
    if self.tty:
      self.stream.write("\r" + text.ljust(self.width))
      self.width = len(text)
    else:
      self.stream.write(text + "\n")
    self.stream.flush()

  def done(self):
    if self.tty and self.width and not self.quiet:
      self.stream.write("\r" + " " * self.width + "\r")
      self.stream.flush()


def main(argv=None):
  argv = sys.argv[1:] if argv is None else list(argv)
  parser = _Parser(
      prog="python -m tf_hsm.planning",
      description="Sizes a model's output layer before training: memory, rows touched, "
                  "FLOPs and step time of full, sampled, hierarchical (tf_hsm's trees) "
                  "and adaptive softmax, and the layer to use. Counts accept K, M, G, T "
                  "(10M = 10,000,000); sizes KB/MB/GB (powers of 1000) or KiB/MiB/GiB "
                  "(powers of 1024). --verify runs the bench instead "
                  "(python -m tf_hsm.planning --verify --help).")
  parser.add_argument("--classes", type=_count_arg,
                      help="V, the number of output classes, e.g. 10M (default with "
                           "--counts: the number of counts)")
  parser.add_argument("--hidden", type=_count_arg, required=True,
                      help="D, the width of the hidden states fed to the layer, e.g. 300")
  parser.add_argument("--tokens", type=_count_arg, required=True,
                      help="T, the outputs a training step scores: batch size x sequence "
                           "length for a language model (e.g. 32 x 100 = 3200)")
  parser.add_argument("--optimizer", default="sgd", choices=sorted(OPTIMIZERS),
                      help="the table's optimizer: its slots (adam 2, momentum 1) count "
                           "in memory, lazy ones update touched rows only (default sgd)")
  parser.add_argument("--dtype", default="float32", choices=sorted(DTYPE_BYTES),
                      help="the table's element type (default float32)")
  parser.add_argument("--memory", type=_bytes_arg, default=None,
                      help="memory budget per device (per shard with --shards), e.g. "
                           "24GiB; leave TensorFlow's own ~0.6 GB out of it")
  group = parser.add_mutually_exclusive_group()
  group.add_argument("--counts", metavar="FILE",
                     help="class frequencies, one a class in class-id order: a .npy file "
                          "or a text file of numbers. Ids in any order (a tokenizer's): "
                          "the AdaptiveSoftmax rows rank them by frequency and their "
                          "layer takes class_order (a note says so)")
  group.add_argument("--zipf", type=float, metavar="S",
                     help="class frequencies 1 / rank^S, class 0 the most frequent "
                          "(1.0 is typical of words); default: uniform")
  parser.add_argument("--max-ppl-increase", type=percent_arg, metavar="PCT",
                      help="recommend among the layers measured within PCT%% perplexity "
                           "of full softmax (e.g. 10), the rule's choice over all "
                           "where none fits")
  parser.add_argument("--token-ids", metavar="FILE.npy",
                      help="the training text as class ids in order (a 1-D integer .npy): "
                           "adds the rows of a tree built from the words' contexts "
                           "(Tree.from_context, context32/256) and of mixtures of such "
                           "trees (left and right contexts, HierarchicalSoftmaxMixture)")
  parser.add_argument("--shards", type=_count_arg, default=1,
                      help="parameter servers the table and slots are split over "
                           "(default 1)")
  parser.add_argument("--machine", metavar="JSON",
                      help="plan for another machine: a JSON object (or a file holding "
                           "one) with matmul_flops, read_bytes, call_seconds and "
                           "optionally softmax_seconds, sampled_logit_seconds, tree_step "
                           "and loop_step_seconds")
  parser.add_argument("--machine-name", metavar="NAME",
                      help="the key of this machine's rates in the cache (default: its "
                           "CPU model and count)")
  parser.add_argument("--remeasure", action="store_true",
                      help="measure this machine again (about 20 s; on a quiet machine) "
                           "and cache the rates; without it the cached rates are used, "
                           "and measured only if there are none")
  parser.add_argument("--json", action="store_true", help="print the report as JSON")
  parser.add_argument("--quiet", action="store_true", help="no progress on stderr")
  parser.add_argument("--verify", action="store_true",
                      help="run the bench's cases and print predicted beside measured "
                           "figures (python -m tf_hsm.planning --verify --help)")
  args = parser.parse_args(argv)
  if args.verify:  # __main__ hands --verify to the bench before this parser sees it
    parser.error("--verify runs the bench: python -m tf_hsm.planning --verify")
  if args.classes is None and not args.counts:
    parser.error("--classes is required (or --counts FILE, whose length it then is)")
  if args.zipf is not None and not (np.isfinite(args.zipf) and args.zipf >= 0):
    parser.error(f"--zipf must be a number >= 0, got {args.zipf}")
  progress = _Progress(quiet=args.quiet)
  try:
    counts = None
    if args.counts:
      progress(f"reading {args.counts}")
      counts = _load_counts(args.counts, args.classes)
    elif args.zipf is not None:
      counts = 1.0 / np.arange(1, args.classes + 1, dtype=np.float64) ** args.zipf
    num_classes = args.classes if args.classes is not None else int(counts.size)
    if args.machine:
      text = args.machine
      if not text.lstrip().startswith("{"):
        if not os.path.exists(text):
          raise ValueError(f"--machine: not a JSON object and no such file: {text}")
        with open(text) as f:
          text = f.read()
      try:
        machine = json.loads(text)
      except ValueError as error:
        raise ValueError(f"--machine: not valid JSON: {error}") from None
      if not isinstance(machine, dict):
        raise ValueError("--machine: expected a JSON object of the machine's rates")
      try:
        machine = Machine(**machine)
      except TypeError as error:
        raise ValueError(f"--machine: {error}") from None
    else:
      machine = Machine.cached(refresh=args.remeasure, name=args.machine_name,
                               progress=progress)
    token_ids = _load_token_ids(args.token_ids) if args.token_ids else None
    report = plan(num_classes, args.hidden, args.tokens, counts=counts,
                  optimizer=args.optimizer, dtype=args.dtype, memory_budget=args.memory,
                  num_shards=args.shards, machine=machine, progress=progress,
                  token_ids=token_ids, max_perplexity_increase=args.max_ppl_increase)
  except (ValueError, TypeError, OSError) as error:
    progress.done()
    message = " ".join(str(error).split())
    sys.stderr.write(f"{parser.prog}: error: {message}\n")
    return 2
  progress.done()
  print(json.dumps(report.to_dict(), indent=1) if args.json else report.to_markdown())
  return 0
