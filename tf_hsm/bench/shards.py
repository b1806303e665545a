"""Per-shard traffic of a table split into equal row ranges, in the tree's own slot order
and in a balanced row layout (`tf_hsm.distribute.balanced_layout`).

    python -m tf_hsm.bench.shards --classes 1000000 --shards 4 --tokens 3200

For each tree, the distinct rows each shard serves a step (it gathers and sends them,
then receives and applies their gradient rows: the same rows, since every child of a
node on the batch's paths gets a gradient), averaged over Zipf-distributed batches, and
the busiest shard's load over the mean.
"""

import argparse
import sys
import time

import numpy as np

from tf_hsm import distribute
from tf_hsm.tree import Tree

TREES = {
    "two_level_counts": lambda v, counts, k: Tree.two_level(v, counts=counts),
    "two_level": lambda v, counts, k: Tree.two_level(v),
    "huffman": lambda v, counts, k: Tree.huffman(counts, branching=k),
}


def measure(num_classes, num_shards, tokens, trees=tuple(TREES), branching=32,
            exponent=1.0, batches=5, seed=0):
  """Rows: one dict per tree and layout with per-shard rows and max/mean."""
  counts = 1.0 / np.arange(1, num_classes + 1) ** exponent
  probs = counts / counts.sum()
  rng = np.random.default_rng(seed)
  steps = [rng.choice(num_classes, tokens, p=probs) for _ in range(batches)]
  rows = []
  for name in trees:
    tree = TREES[name](num_classes, counts, branching)
    start = time.perf_counter()
    layout = distribute.balanced_layout(tree, num_shards, tokens, counts=counts)
    layout_s = time.perf_counter() - start
    for label, chosen in (("tree order", None), ("balanced", layout)):
      per_shard = np.mean([distribute.rows_per_shard(tree, step, num_shards, chosen)
                           for step in steps], axis=0)
      rows.append({"tree": name if name != "huffman" else f"huffman{branching}",
                   "layout": label, "rows_per_shard": per_shard.tolist(),
                   "max_over_mean": float(per_shard.max() / per_shard.mean()),
                   "layout_s": layout_s if chosen is not None else 0.0})
  return rows


def markdown(rows, num_classes, num_shards, tokens):
  lines = [f"V={num_classes:,}, {num_shards} equal row ranges, {tokens:,} Zipf tokens a "
           "step: distinct rows each shard sends and updates",
           "",
           "| tree | layout | rows per shard | max/mean |",
           "| --- | --- | --- | --- |"]
  for row in rows:
    shards = " / ".join(f"{value / 1e3:.1f}K" for value in row["rows_per_shard"])
    lines.append(f"| {row['tree']} | {row['layout']} | {shards} | "
                 f"{row['max_over_mean']:.2f} |")
  return "\n".join(lines)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--classes", type=int, default=1_000_000)
  parser.add_argument("--shards", type=int, default=4)
  parser.add_argument("--tokens", type=int, default=3_200)
  parser.add_argument("--branching", type=int, default=32, help="of the Huffman tree")
  parser.add_argument("--zipf", type=float, default=1.0, help="exponent of the counts")
  parser.add_argument("--batches", type=int, default=5)
  args = parser.parse_args(argv)
  rows = measure(args.classes, args.shards, args.tokens, branching=args.branching,
                 exponent=args.zipf, batches=args.batches)
  print(markdown(rows, args.classes, args.shards, args.tokens))
  return 0


if __name__ == "__main__":
  sys.exit(main())
