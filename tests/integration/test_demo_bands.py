"""tf_hsm.demo.bands: the held-out loss by word-frequency band, and the demo's --bands."""

import json
import math

import numpy as np
import pytest

from tf_hsm.demo import bands
from tf_hsm.demo import run as demo

import support


def test_band_edges():
  assert bands.band_edges(2) == [0, 1, 2]
  assert bands.band_edges(256) == [0, 1, 256]
  assert bands.band_edges(300) == [0, 1, 256, 300]
  assert bands.band_edges(100_000) == [0, 1, 256, 1024, 4096, 16384, 65536, 100_000]
  assert bands.band_edges(50, first=4, factor=2) == [0, 1, 4, 8, 16, 32, 50]
  with pytest.raises(ValueError, match="num_classes must be at least 2"):
    bands.band_edges(1)
  with pytest.raises(ValueError, match="first and factor must be at least 2"):
    bands.band_edges(100, factor=1)


def test_band_losses_match_a_loop_over_the_tokens():
  rng = np.random.default_rng(0)
  targets = rng.integers(0, 40, size=(25, 7))
  targets[targets == 20] = 3  # band 16-31 keeps ids, band 32-39 too; none is empty...
  log_probs = -rng.random((25, 7)) * 5
  edges = [0, 1, 4, 16, 32, 40, 50]  # ...but 40-49 is
  rows = bands.band_losses(log_probs, targets, edges)
  assert [(r["first"], r["end"]) for r in rows] == list(zip(edges[:-1], edges[1:]))
  assert sum(r["tokens"] for r in rows) == targets.size
  for row in rows:
    chosen = [-lp for lp, t in zip(log_probs.ravel(), targets.ravel())
              if row["first"] <= t < row["end"]]
    assert row["tokens"] == len(chosen)
    if chosen:
      assert row["loss"] == pytest.approx(sum(chosen) / len(chosen), rel=1e-12)
    else:
      assert row["loss"] is None
  with pytest.raises(ValueError, match="differ in size"):
    bands.band_losses(log_probs[:, :3], targets, edges)


def test_compare_splits_the_gap_by_band():
  rng = np.random.default_rng(1)
  targets = rng.integers(0, 30, size=500)
  a, b = -rng.random(500) * 4, -rng.random(500) * 4
  edges = [0, 1, 4, 16, 30]
  rows = bands.compare(bands.band_losses(a, targets, edges),
                       bands.band_losses(b, targets, edges))
  assert sum(r["share"] for r in rows) == pytest.approx(1.0)
  assert sum(r["part"] for r in rows) == pytest.approx(np.mean(-b) - np.mean(-a), rel=1e-9)
  other = bands.band_losses(b, (targets + 1) % 30, edges)
  with pytest.raises(ValueError, match="bands differ"):
    bands.compare(bands.band_losses(a, targets, edges), other)


def test_demo_records_bands_that_add_up_to_its_perplexity(tmp_path, capsys):
  corpus = support.zipf_corpus(tmp_path / "corpus.txt")
  out = tmp_path / "results"
  flags = ["--corpus", str(corpus), "--max-tokens", "900", "--epochs", "2", "--hidden",
           "16", "--seq-len", "5", "--batch", "4", "--quiet", "--vocab", "20", "--tree",
           "huffman", "--models", "hsm,full"]
  results = demo.main(flags + ["--bands", "--out", str(out)])
  # <unk> (id 0, the words past the 19 most frequent) is a band of its own.
  assert "held-out loss by rank band: 0-0 " in capsys.readouterr().out
  edges = bands.band_edges(results["vocab_size"])
  for model in results["models"]:
    assert len(model["held_out_bands"]) == 2
    for epoch, rows in enumerate(model["held_out_bands"]):
      assert [(r["first"], r["end"]) for r in rows] == list(zip(edges[:-1], edges[1:]))
      tokens = sum(r["tokens"] for r in rows)
      mean = sum(r["tokens"] * r["loss"] for r in rows if r["tokens"]) / tokens
      # The bands' pass is the held-out evaluation: their tokens' mean is its loss.
      assert math.exp(mean) == pytest.approx(model["held_out_perplexity"][epoch + 1],
                                             rel=1e-9)
  # ...and it gives the perplexities Keras' validation gives, in the same training.
  plain = demo.main(flags + ["--out", str(tmp_path / "plain")])
  for model, other in zip(results["models"], plain["models"]):
    assert model["name"] == other["name"] and "held_out_bands" not in other
    np.testing.assert_allclose(model["held_out_perplexity"], other["held_out_perplexity"],
                               rtol=1e-4)
  capsys.readouterr()
  results_path = str(out / "results.json")
  rows = bands.main([results_path, results_path, "--epoch", "2", "--model-a", "full",
                     "--model-b", "hsm-huffman"])
  printed = capsys.readouterr().out
  assert "| ranks | share of tokens | full loss | hsm-huffman loss |" in printed
  full, hsm = results["models"][1], results["models"][0]
  gap = math.log(hsm["held_out_perplexity"][2] / full["held_out_perplexity"][2])
  assert sum(r["part"] for r in rows) == pytest.approx(gap, abs=1e-4)
  with open(out / "results.json") as f:
    assert json.load(f)["models"][0]["held_out_bands"] == results["models"][0][
        "held_out_bands"]
  with pytest.raises(SystemExit, match="no held-out bands for model sampled"):
    bands.main([results_path, results_path, "--model-a", "sampled"])
  with pytest.raises(SystemExit, match="--epoch must be 1-2"):
    bands.main([results_path, results_path, "--epoch", "3"])
  copy = tmp_path / "again" / "results.json"
  copy.parent.mkdir()
  copy.write_text((out / "results.json").read_text())
  bands.main([results_path, str(copy), "--model-a", "full", "--model-b", "full"])
  assert "| full (results) loss | full (again) loss |" in capsys.readouterr().out
  with pytest.raises(SystemExit, match="cannot read the demo's results from"):
    bands.main([results_path, str(out / "missing.json")])


def test_bands_score_an_epoch_before_its_rebuild(tmp_path, capsys):
  """The learned tree is rebuilt at the end of epoch 1: the bands' pass, like Keras'
  validation, scores the tree the epoch trained, not the rebuilt one."""
  corpus = support.zipf_corpus(tmp_path / "corpus.txt")
  flags = ["--corpus", str(corpus), "--max-tokens", "900", "--epochs", "2", "--hidden",
           "16", "--seq-len", "5", "--batch", "4", "--quiet", "--vocab", "20", "--tree",
           "learned", "--models", "hsm"]
  with_bands = demo.main(flags + ["--bands", "--out", str(tmp_path / "bands")])["models"]
  plain = demo.main(flags + ["--out", str(tmp_path / "plain")])["models"]
  assert with_bands[0]["rebuild_seconds"] and plain[0]["rebuild_seconds"]
  np.testing.assert_allclose(with_bands[0]["held_out_perplexity"],
                             plain[0]["held_out_perplexity"], rtol=2e-6)
  rows = with_bands[0]["held_out_bands"][0]
  mean = sum(r["tokens"] * r["loss"] for r in rows if r["tokens"]) / sum(
      r["tokens"] for r in rows)
  # (Scored after the rebuild, epoch 1's bands were 2.6e-5 off here: the tiny model's
  # rebuilt tree starts from rows that keep most of its probabilities.)
  assert math.exp(mean) == pytest.approx(plain[0]["held_out_perplexity"][1], rel=2e-6)
  capsys.readouterr()
