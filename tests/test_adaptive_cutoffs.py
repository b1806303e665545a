"""Tests for the cost model that chooses AdaptiveSoftmax's cutoffs: its figures against
hand-computed values, the search against brute force over the same grid, the direction
of its choices, and the layer with cutoffs=None."""

import itertools
import math

import keras
import numpy as np
import pytest

from tf_hsm.adaptive import AdaptiveSoftmax, choose_cutoffs, step_cost
from tf_hsm._adaptive_cutoffs import candidate_cuts
from tf_hsm.planner import Machine

MACHINE = Machine(matmul_flops=1e9, read_bytes=1e8, call_seconds=1e-5)
FAST = Machine(matmul_flops=3e11, read_bytes=8e9, call_seconds=5e-5)


def zipf(num_classes):
  return 1.0 / np.arange(1, num_classes + 1)


def test_step_cost_by_hand_flat():
  counts = [5, 4, 3, 2, 2, 1, 1, 1, 1, 0]  # sum 20; the cluster [4, 10) holds 6 of it
  cost = step_cost(counts, [4], dim=8, tokens_per_step=4, div_value=2.0, tail="flat",
                   machine=MACHINE)
  head, tail = cost["tiers"]
  # Head: 4 classes + 1 cluster token, width 8, all 4 tokens.
  assert (head["classes"], head["width"], head["tokens"]) == (5, 8, 4.0)
  assert head["flops"] == 6 * 4 * 5 * 8
  assert head["bytes"] == 4 * (3 * 5 * 8 + 4 * 4 * 5)
  # Cluster: 6 classes at width 8 // 2 = 4, reached by 4 * 6 / 20 = 1.2 tokens.
  assert (tail["classes"], tail["width"]) == (6, 4)
  assert tail["tokens"] == pytest.approx(1.2)
  assert tail["flops"] == pytest.approx(6 * 1.2 * 8 * 4 + 6 * 1.2 * 6 * 4)
  assert tail["bytes"] == pytest.approx(4 * (3 * 8 * 4 + 3 * 6 * 4 + 4 * 1.2 * 6))
  want = (960 / 1e9 + 800 / 1e8 + 1e-5) + (403.2 / 1e9 + 787.2 / 1e8 + 1e-5)
  assert cost["seconds"] == pytest.approx(want, rel=1e-12)
  assert cost["flops"] == pytest.approx(960 + 403.2)


def test_step_cost_by_hand_two_level():
  counts = [5, 4, 3, 2, 2, 1, 1, 1, 1, 0]
  cost = step_cost(counts, [4], dim=8, tokens_per_step=4, div_value=2.0,
                   tail="two_level", machine=MACHINE)
  tail = cost["tiers"][1]
  groups = math.sqrt(6)
  touched = groups + 6 * (1 - (1 - 1 / groups) ** 1.2)
  assert tail["flops"] == pytest.approx(6 * 1.2 * 8 * 4 + 6 * 1.2 * 2 * groups * 4)
  assert tail["bytes"] == pytest.approx(
      4 * (3 * 8 * 4 + 3 * touched * 5 + 4 * 1.2 * 2 * groups))


def brute_force(counts, dim, tokens, div_value, tail, machine, max_clusters,
                min_head_mass, min_width, points_per_decade):
  """The cheapest cutoffs on the grid, by trying every allowed combination."""
  num_classes = len(counts)
  mass = np.concatenate([[0.0], np.cumsum(counts)]) / np.sum(counts)
  best = None
  for clusters in range(1, max_clusters + 1):
    if int(dim // div_value ** clusters) < min_width:
      break
    for cuts in itertools.combinations(
        candidate_cuts(num_classes, points_per_decade).tolist(), clusters):
      bounds = list(cuts) + [num_classes]
      sizes = [bounds[0]] + list(np.diff(bounds))
      if any(b < a for a, b in zip(sizes, sizes[1:])):
        continue
      if mass[cuts[0]] < min_head_mass - 1e-12:
        continue
      seconds = step_cost(counts, list(cuts), dim, tokens, div_value, tail,
                          machine)["seconds"]
      if best is None or seconds < best[0]:
        best = (seconds, list(cuts))
  return best


@pytest.mark.parametrize("trial", range(12))
def test_search_finds_the_grid_minimum(trial):
  rng = np.random.default_rng(trial)
  num_classes = int(rng.integers(20, 3000))
  counts = np.sort(rng.pareto(1.0, num_classes) + rng.random())[::-1]
  dim = int(rng.integers(8, 600))
  tokens = int(rng.integers(1, 2000))
  div_value = float(rng.choice([1.5, 2.0, 4.0]))
  tail = ["flat", "two_level"][trial % 2]
  machine = Machine(10 ** rng.uniform(9, 12), 10 ** rng.uniform(8, 11),
                    10 ** rng.uniform(-6, -3))
  min_head_mass = [0.0, 0.3, 0.5][trial % 3]
  min_width = [1, 4][trial % 4 // 2]
  got = choose_cutoffs(counts, dim, tokens, div_value, tail, machine, max_clusters=4,
                       min_head_mass=min_head_mass, min_width=min_width,
                       points_per_decade=5)
  seconds, want = brute_force(counts, dim, tokens, div_value, tail, machine, 4,
                              min_head_mass, min_width, 5)
  got_seconds = step_cost(counts, got, dim, tokens, div_value, tail, machine)["seconds"]
  assert got == want or got_seconds == pytest.approx(seconds, rel=1e-12)
  assert got == choose_cutoffs(counts, dim, tokens, div_value, tail, machine,
                               max_clusters=4, min_head_mass=min_head_mass,
                               min_width=min_width, points_per_decade=5)


def test_head_shrinks_as_its_flops_cost_more():
  counts = zipf(100_000)
  free = dict(min_head_mass=0.0, min_width=1)
  # A slower matmul makes the full-width head dearer against the flat tails' bytes.
  heads = [choose_cutoffs(counts, 512, 640, 4.0, "flat",
                          Machine(rate, 8e9, 5e-5), **free)[0]
           for rate in (1e13, 1e12, 1e11, 1e10, 1e9)]
  assert heads == sorted(heads, reverse=True) and heads[0] > 10 * heads[-1]
  # So does a wider hidden state.
  heads = [choose_cutoffs(counts, dim, 640, 4.0, "flat", FAST, **free)[0]
           for dim in (64, 256, 1024, 4096)]
  assert heads == sorted(heads, reverse=True) and heads[0] > 10 * heads[-1]


@pytest.mark.parametrize("tail", ["flat", "two_level"])
def test_dearer_calls_mean_fewer_tiers(tail):
  counts = zipf(100_000)
  free = dict(min_head_mass=0.0, min_width=1)
  clusters = [len(choose_cutoffs(counts, 512, 640, 4.0, tail,
                                 Machine(3e11, 8e9, call), **free))
              for call in (1e-6, 1e-4, 1e-2, 1.0)]
  assert clusters == sorted(clusters, reverse=True) and clusters[-1] == 1


def test_bounds_hold():
  counts = zipf(1_000_000)
  mass = np.cumsum(counts) / counts.sum()
  for tail in ("flat", "two_level"):
    cutoffs = choose_cutoffs(counts, 300, 256, 4.0, tail, FAST)
    assert mass[cutoffs[0] - 1] >= 0.5
    assert len(cutoffs) <= 3  # 300 // 4**4 = 1 < min_width
    sizes = np.diff([0] + cutoffs + [1_000_000])
    assert np.all(np.diff(sizes) >= 0)
    free = choose_cutoffs(counts, 300, 256, 4.0, tail, FAST, min_head_mass=0.0,
                          min_width=1)
    assert (step_cost(counts, free, 300, 256, 4.0, tail, FAST)["seconds"] <=
            step_cost(counts, cutoffs, 300, 256, 4.0, tail, FAST)["seconds"])


def test_grid():
  cuts = candidate_cuts(100_000)
  assert cuts[0] == 1 and cuts[-1] < 100_000
  assert {2000, 20000, 10, 100}.issubset(set(cuts.tolist()))
  assert np.all(np.diff(cuts) > 0)
  assert candidate_cuts(2).tolist() == [1]


@pytest.mark.slow
def test_ten_million_classes_in_a_second():
  import time  # pylint: disable=import-outside-toplevel
  counts = zipf(10_000_000)
  start = time.perf_counter()
  choose_cutoffs(counts, 300, 3200, 4.0, "two_level", FAST)
  assert time.perf_counter() - start < 3.0  # < 1 s on a quiet machine


@pytest.mark.parametrize("tail", ["flat", "two_level"])
def test_layer_chooses_and_round_trips(tail, tmp_path):
  counts = zipf(3000)
  layer = AdaptiveSoftmax(3000, counts=counts, tail=tail, tokens_per_step=64,
                          machine=FAST)
  with pytest.raises(ValueError, match="built"):
    layer.get_config()
  layer.build((None, 64))
  assert layer.cutoffs == choose_cutoffs(counts, 64, 64, 4.0, tail, FAST)
  config = layer.get_config()
  assert config["cutoffs"] == layer.cutoffs
  again = AdaptiveSoftmax.from_config(config)
  assert again.get_config() == config
  assert again.cutoffs == layer.cutoffs
  # Saved and loaded inside a model, the layer keeps its cutoffs and outputs.
  hidden = keras.Input((64,))
  targets = keras.Input((), dtype="int32")
  model = keras.Model([hidden, targets], layer(hidden, targets))
  path = str(tmp_path / "model.keras")
  model.save(path)
  loaded = keras.models.load_model(path)
  rng = np.random.default_rng(0)
  x = rng.standard_normal((8, 64)).astype(np.float32)
  y = rng.integers(0, 3000, 8)
  np.testing.assert_array_equal(loaded.predict([x, y], verbose=0),
                                model.predict([x, y], verbose=0))
  assert loaded.layers[-1].cutoffs == layer.cutoffs
  assert AdaptiveSoftmax.choose_cutoffs(counts, 64, 64, tail=tail,
                                        machine=FAST) == layer.cutoffs


@pytest.mark.parametrize("kwargs, error, message", [
    ({"num_classes": 10}, ValueError, "cutoffs.*counts"),
    ({"num_classes": 10, "cutoffs": None}, ValueError, "cutoffs.*counts"),
    ({"num_classes": 3, "counts": [1, 2, 3]}, ValueError, "counts must be non-increasing"),
    ({"num_classes": 3, "counts": [3, 2]}, ValueError, "counts must have shape"),
    ({"num_classes": 3, "counts": [3, np.nan, 1]}, ValueError, "counts must be finite"),
    ({"num_classes": 3, "counts": [0, 0, 0]}, ValueError, "counts must be non-negative"),
    ({"num_classes": 3, "counts": [3, 2, 1], "tokens_per_step": 0}, ValueError,
     "tokens_per_step"),
    ({"num_classes": 3, "counts": [3, 2, 1], "tail": "two_level",
      "tail_trees": []}, ValueError, "tail_trees"),
])
def test_layer_errors(kwargs, error, message):
  with pytest.raises(error, match=message):
    AdaptiveSoftmax(**kwargs)


@pytest.mark.parametrize("kwargs, message", [
    ({"dim": 0}, "dim"),
    ({"tokens_per_step": 2.5}, "tokens_per_step"),
    ({"div_value": -1}, "div_value"),
    ({"tail": "deep"}, "tail"),
    ({"max_clusters": 0}, "max_clusters"),
    ({"min_head_mass": 1.0}, "min_head_mass"),
    ({"min_width": 0}, "min_width"),
    ({"points_per_decade": 0}, "points_per_decade"),
    ({"dim": 3, "min_width": 4}, "min_width"),
])
def test_chooser_errors(kwargs, message):
  args = dict(counts=zipf(100), dim=32, tokens_per_step=16, machine=FAST)
  args.update(kwargs)
  with pytest.raises(ValueError, match=message):
    choose_cutoffs(**args)
  with pytest.raises(TypeError, match="machine"):
    choose_cutoffs(zipf(100), 32, 16, machine="fast")
  with pytest.raises(ValueError, match="cutoffs"):
    step_cost(zipf(100), [50, 20], 32, 16, machine=FAST)
