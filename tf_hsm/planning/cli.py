"""`python -m tf_hsm.planning`: the planner's table for a model's output layer, or with
`--verify` the bench's measurements beside the planner's figures."""

import argparse
import json
import re
import sys

import numpy as np

from tf_hsm.planning.candidates import plan
from tf_hsm.planning.costs import DTYPE_BYTES, OPTIMIZERS
from tf_hsm.planning.machine import Machine


def parse_count(text):
  """'10M' -> 10000000, '3200' -> 3200, '1.5K' -> 1500."""
  match = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]?)\s*", str(text), re.IGNORECASE)
  if not match:
    raise ValueError(f"not a count: {text!r}")
  return int(float(match.group(1)) * {"": 1, "K": 10**3, "M": 10**6, "G": 10**9,
                                       "T": 10**12}[match.group(2).upper()])


def parse_bytes(text):
  """'24GiB' -> 24 * 2**30, '12GB' -> 12e9, '512MiB', '1000' (bytes)."""
  match = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]?)(i?)B?\s*", str(text), re.IGNORECASE)
  if not match:
    raise ValueError(f"not a size: {text!r}")
  power = " KMGT".index(match.group(2).upper() or " ")
  base = 1024 if match.group(3) else 1000
  return int(float(match.group(1)) * base**power)


def main(argv=None):
  argv = sys.argv[1:] if argv is None else list(argv)
  parser = argparse.ArgumentParser(prog="python -m tf_hsm.planning",
                                   description=__doc__)
  parser.add_argument("--classes", type=parse_count, required=True)
  parser.add_argument("--hidden", type=parse_count, required=True)
  parser.add_argument("--tokens", type=parse_count, required=True)
  parser.add_argument("--optimizer", default="sgd", choices=sorted(OPTIMIZERS))
  parser.add_argument("--dtype", default="float32", choices=sorted(DTYPE_BYTES))
  parser.add_argument("--memory", type=parse_bytes, default=None,
                      help="budget per device (per shard with --shards), e.g. 24GiB")
  group = parser.add_mutually_exclusive_group()
  group.add_argument("--counts", help="a .npy or text file of class counts")
  group.add_argument("--zipf", type=float, help="counts ~ 1 / rank^s")
  parser.add_argument("--shards", type=int, default=1)
  parser.add_argument("--machine", help="JSON with matmul_flops, read_bytes, call_seconds")
  parser.add_argument("--remeasure", action="store_true",
                      help="measure this machine again instead of using the cached rates")
  parser.add_argument("--json", action="store_true", help="print the report as JSON")
  parser.add_argument("--verify", action="store_true",
                      help="run the bench's cases and print predicted beside measured "
                           "figures (python -m tf_hsm.planning --verify --help)")
  args = parser.parse_args(argv)
  if args.verify:  # __main__ hands --verify to the bench before this parser sees it
    parser.error("--verify runs the bench: python -m tf_hsm.planning --verify")
  counts = None
  if args.counts:
    counts = np.load(args.counts) if args.counts.endswith(".npy") else np.loadtxt(args.counts)
  elif args.zipf is not None:
    counts = 1.0 / np.arange(1, args.classes + 1) ** args.zipf
  machine = json.loads(args.machine) if args.machine else (
      Machine.cached(refresh=True) if args.remeasure else None)
  report = plan(args.classes, args.hidden, args.tokens, counts=counts,
                optimizer=args.optimizer, dtype=args.dtype, memory_budget=args.memory,
                num_shards=args.shards, machine=machine)
  print(json.dumps(report.to_dict(), indent=1) if args.json else report.to_markdown())
  return 0
