"""Held-out loss by word frequency (`--bands`): where one output layer loses against
another.

The demo's word ids are ranks (`build_vocab`: `<unk>` is 0, then the words by decreasing
training count), so a band of ranks is a band of frequencies. After each epoch the
callback scores the held-out tokens (`model.predict`: every model here outputs log
P(target) a token) and records, for each band, its tokens and their mean loss in nats,
and the mean loss of all of them: with `--bands` this pass is the epoch's held-out
evaluation (Keras' validation is not run beside it).
Two runs' gap in log perplexity is then the sum over bands of (share of tokens) x
(difference of mean loss), which `compare` splits by band:

    python -m tf_hsm.demo.bands RUN_A/results.json RUN_B/results.json [--epoch N]
        [--model-a NAME] [--model-b NAME]
"""

import argparse
import json
import os

import numpy as np

# The first band's end and the factor between the ends of successive bands: with a head
# of 256 classes (the trees of docs/planner.md), the first band is the head.
FIRST = 256
FACTOR = 4


def band_edges(num_classes, first=FIRST, factor=FACTOR):
  """Rank bands for a vocabulary of `num_classes` ids: [0, 1, first, first * factor, ...,
  num_classes] (band i is ids edges[i] <= id < edges[i + 1]; `<unk>` alone first)."""
  if num_classes < 2:
    raise ValueError(f"num_classes must be at least 2, got {num_classes}")
  if first < 2 or factor < 2:
    raise ValueError(f"first and factor must be at least 2, got {first} and {factor}")
  edges, end = [0, 1], int(first)
  while end < num_classes:
    edges.append(end)
    end *= int(factor)
  return edges + [int(num_classes)]


def band_losses(log_probs, targets, edges):
  """[{"first", "end", "tokens", "loss"}] a band: its held-out tokens and their mean
  -log P (nats; None for a band with no token). Non-finite log-probabilities are kept
  (they make the band's loss infinite or NaN, as they would make the perplexity)."""
  log_probs = np.asarray(log_probs, np.float64).reshape(-1)
  targets = np.asarray(targets).reshape(-1)
  if log_probs.shape != targets.shape:
    raise ValueError(f"log_probs and targets differ in size: {log_probs.size} and "
                     f"{targets.size}")
  band = np.searchsorted(np.asarray(edges[1:-1]), targets, side="right")
  rows = []
  for i, (first, end) in enumerate(zip(edges[:-1], edges[1:])):
    chosen = log_probs[band == i]
    rows.append({"first": int(first), "end": int(end), "tokens": int(chosen.size),
                 "loss": float(-chosen.mean()) if chosen.size else None})
  return rows


def band_callback(keras, inputs, targets, edges, batch_size):
  """A Keras callback that records `band_losses` on the held-out `inputs` after every
  epoch, in its `bands` list (one list of rows an epoch), and the mean loss of all the
  tokens in `losses` (nats; the held-out loss Keras' validation would report)."""

  class BandReport(keras.callbacks.Callback):

    def __init__(self):
      super().__init__()
      self.bands, self.losses = [], []

    def on_epoch_end(self, epoch, logs=None):
      log_probs = np.asarray(self.model.predict(inputs, batch_size=batch_size, verbose=0),
                             np.float64)
      self.bands.append(band_losses(log_probs, targets, edges))
      self.losses.append(float(-log_probs.mean()))
      print("   held-out loss by rank band: " + ", ".join(
          f"{row['first']}-{row['end'] - 1} {row['loss']:.3f}"
          for row in self.bands[-1] if row["tokens"]), flush=True)

  return BandReport()


def compare(bands_a, bands_b):
  """Per band of two runs' `band_losses` (the same held-out tokens and edges): share of
  the tokens, the two mean losses, and the band's part of the gap in log perplexity
  (share x (loss_b - loss_a)); the parts sum to loss_b - loss_a over all tokens."""
  total = sum(row["tokens"] for row in bands_a)
  rows = []
  for a, b in zip(bands_a, bands_b):
    if (a["first"], a["end"], a["tokens"]) != (b["first"], b["end"], b["tokens"]):
      raise ValueError(f"the runs' bands differ: {a} and {b} (not the same held-out "
                       "tokens or vocabulary)")
    if not a["tokens"]:
      continue
    share = a["tokens"] / total
    rows.append({"first": a["first"], "end": a["end"], "share": share, "loss_a": a["loss"],
                 "loss_b": b["loss"], "part": share * (b["loss"] - a["loss"])})
  return rows


def _run_bands(path, epoch, model=None):
  """(model name, its band rows at `epoch`) from a demo's results.json: the model named
  `model`, or the first with bands."""
  try:
    with open(path) as f:
      results = json.load(f)
  except (OSError, ValueError) as e:
    raise SystemExit(f"cannot read the demo's results from {path}: {e}") from e
  found = [(m["name"], m["held_out_bands"]) for m in results["models"]
           if m.get("held_out_bands") and model in (None, m["name"])]
  if not found:
    raise SystemExit(f"{path} has no held-out bands" + (f" for model {model}" if model
                                                        else "") +
                     ": run the demo with --bands")
  name, per_epoch = found[0]
  if not 1 <= epoch <= len(per_epoch):
    raise SystemExit(f"{path}: --epoch must be 1-{len(per_epoch)}, got {epoch}")
  return name, per_epoch[epoch - 1]


def main(argv=None):
  p = argparse.ArgumentParser(prog="python -m tf_hsm.demo.bands", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("run_a", help="results.json of the reference run (first model with bands)")
  p.add_argument("run_b", help="results.json of the run compared with it")
  p.add_argument("--epoch", type=int, default=1, help="which epoch's bands (default 1)")
  p.add_argument("--model-a", default=None, help="the model of run_a (default: the first "
                                                 "with bands)")
  p.add_argument("--model-b", default=None, help="the model of run_b (likewise)")
  args = p.parse_args(argv)
  name_a, a = _run_bands(args.run_a, args.epoch, args.model_a)
  name_b, b = _run_bands(args.run_b, args.epoch, args.model_b)
  rows = compare(a, b)
  if name_a == name_b:  # one model in two runs: name the runs' folders too
    name_a, name_b = (f"{name} ({os.path.basename(os.path.dirname(os.path.abspath(path)))})"
                      for name, path in ((name_a, args.run_a), (name_b, args.run_b)))
  print(f"| ranks | share of tokens | {name_a} loss | {name_b} loss | part of the gap |\n"
        "| --- | --- | --- | --- | --- |")
  for row in rows:
    print(f"| {row['first']:,}-{row['end'] - 1:,} | {100 * row['share']:.1f}% | "
          f"{row['loss_a']:.4f} | {row['loss_b']:.4f} | {row['part']:+.4f} |")
  gap = sum(row["part"] for row in rows)
  print(f"\nGap in log perplexity {gap:+.4f} nats ({100 * np.expm1(gap):+.2f}% perplexity).")
  return rows


if __name__ == "__main__":
  main()
