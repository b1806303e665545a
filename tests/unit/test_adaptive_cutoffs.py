"""Tests for the cost model that chooses AdaptiveSoftmax's cutoffs: its figures against
hand-computed values, the search against brute force over the same grid, the direction
of its choices, and the layer with cutoffs=None."""

import itertools

import keras
import numpy as np
import pytest

import tf_hsm

from tf_hsm.keras.adaptive import AdaptiveSoftmax, choose_cutoffs, step_cost
from tf_hsm.planning.cutoffs import candidate_cuts
from tf_hsm.planning import Machine

MACHINE = Machine(matmul_flops=1e9, read_bytes=1e8, call_seconds=1e-5)
FAST = Machine(matmul_flops=3e11, read_bytes=8e9, call_seconds=5e-5)


def zipf(num_classes):
  return 1.0 / np.arange(1, num_classes + 1)


def test_step_cost_by_hand_flat():
  counts = [5, 4, 3, 2, 2, 1, 1, 1, 1, 0]  # sum 20; the cluster [4, 10) holds 6 of it
  row = step_cost(counts, [4], dim=8, tokens_per_step=4, div_value=2.0, tail="flat",
                  machine=MACHINE)
  # Head: 4 classes + 1 cluster token = 5 rows at width 8, all 4 tokens. Cluster: 6
  # classes at width 8 // 2 = 4 behind a [8, 4] projection, q = 6 / 20 = 0.3, so 1.2
  # tokens and its tensors read with probability 1 - 0.7^4.
  seen = 1 - 0.7**4
  assert row["flops"] == pytest.approx(6 * 4 * 5 * 8 + 6 * (1.2 * 8 * 4 + 1.2 * 6 * 4))
  assert row["param_bytes"] == row["grad_bytes"] == 4 * (40 + 32 + 24)
  # SGD, dense gradients: each part read twice (touched), gradient and update written
  # (1 + 2 passes over all of it); the hidden states and their gradient, 2 x 4 x 8.
  moved = (2 * 40 + 3 * 40) + (2 * 32 * seen + 3 * 32) + (2 * 24 * seen + 3 * 24) + 64
  assert row["bytes_moved"] == pytest.approx(4 * moved)
  assert row["softmax_logits"] == pytest.approx(4 * 5 + 1.2 * 6)
  # Bytes bound it here; 3 calls a step and one a tier.
  assert 4 * moved / 1e8 > 1363.2 / 1e9
  assert row["step_seconds"] == pytest.approx(4 * moved / 1e8 + 5 * 1e-5, rel=1e-12)


def test_step_cost_by_hand_two_level():
  counts = [5, 4, 3, 2, 2, 1, 1, 1, 1, 0]
  row = step_cost(counts, [4], dim=8, tokens_per_step=4, div_value=2.0,
                  tail="two_level", machine=MACHINE, optimizer="lazy_adam")
  # Tree.two_level over 6 classes: 3 groups of 2, equal mass 0.1 each; a token scores
  # 3 + 2 rows. Rows touched: the root's 3 when the cluster is, a group's 2 when a token
  # falls in it.
  seen, group = 1 - 0.7**4, 1 - 0.9**4
  touched = 3 * seen + 6 * group
  assert row["rows_touched"] == pytest.approx(5 + touched)
  assert row["flops"] == pytest.approx(6 * 4 * 5 * 8 + 6 * (1.2 * 8 * 4 + 1.2 * 5 * 4))
  assert row["param_bytes"] == 4 * (40 + 32 + 9 * 5)
  assert row["grad_bytes"] == pytest.approx(4 * (40 + 32 + touched * 5))
  # lazy_adam (2 slots): dense parts updated whole, the tree's table at its touched rows.
  moved = ((2 * 40 + 40 + 6 * 40) + (2 * 32 * seen + 32 + 6 * 32) +
           (2 * 5 * touched + 5 * touched + 6 * 5 * touched) + 64)
  assert row["bytes_moved"] == pytest.approx(4 * moved)
  assert row["step_seconds"] == pytest.approx(4 * moved / 1e8 + 5 * 1e-5, rel=1e-12)


def test_two_level_in_closed_form_against_the_built_trees():
  """The planner prices a two-level tail as Tree.two_level's equal-mass groups in closed
  form; the trees built over the clusters of Zipf counts score and touch about as many
  rows."""
  from tf_hsm import planning as planner  # pylint: disable=import-outside-toplevel
  counts = zipf(1_000_000)
  probs = counts / counts.sum()
  for lo, hi, tokens in ((2000, 20000, 3200), (20000, 200000, 256),
                         (200000, 1_000_000, 3200)):
    q = probs[lo:hi].sum()
    cost = planner.adaptive_cluster_cost(hi - lo, q, 300, tokens, 4, "two_level")
    tree = tf_hsm.Tree.two_level(hi - lo, counts=counts[lo:hi])
    node_p = distribute_node_probabilities(tree, probs[lo:hi])
    sizes = np.diff(tree.child_begin)
    scored = float(np.dot(node_p, sizes)) / q
    touched = float(np.dot(sizes, -np.expm1(tokens * np.log1p(-node_p))))
    closed = (cost.flops / 6 / (tokens * q) - 300 * 4) / 4  # rows a token scores
    assert closed == pytest.approx(scored, rel=0.05)
    assert float(cost.rows_touched) == pytest.approx(touched, rel=0.1)


def distribute_node_probabilities(tree, class_probs):
  """p(n), the probability a token's path visits node n, from the tree's paths."""
  lengths = np.diff(tree.path_begin)
  return np.bincount(tree.path_nodes, weights=np.repeat(class_probs, lengths),
                     minlength=tree.num_nodes)


def brute_force(counts, dim, tokens, div_value, tail, machine, max_clusters,
                min_head_mass, min_width, points_per_decade, optimizer):
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
      seconds = step_cost(counts, list(cuts), dim, tokens, div_value, tail, machine,
                          optimizer)["step_seconds"]
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
                    10 ** rng.uniform(-6, -3), softmax_seconds=10 ** rng.uniform(-10, -8))
  if trial % 4 == 1:  # two-level tails priced by a fitted tf_hsm step
    machine.tree_step = tuple(10 ** rng.uniform([-12, -11, -11, -8, -9, -4],
                                                 [-10, -9, -9, -6, -7, -3]))
  optimizer = ["sgd", "lazy_adam", "adam"][trial % 3]
  min_head_mass = [0.0, 0.3, 0.5][trial % 3]
  min_width = [1, 4][trial % 4 // 2]
  got = choose_cutoffs(counts, dim, tokens, div_value, tail, machine, max_clusters=4,
                       min_head_mass=min_head_mass, min_width=min_width,
                       points_per_decade=5, optimizer=optimizer)
  seconds, want = brute_force(counts, dim, tokens, div_value, tail, machine, 4,
                              min_head_mass, min_width, 5, optimizer)
  got_seconds = step_cost(counts, got, dim, tokens, div_value, tail, machine,
                          optimizer)["step_seconds"]
  assert got == want or got_seconds == pytest.approx(seconds, rel=1e-12)
  assert got == choose_cutoffs(counts, dim, tokens, div_value, tail, machine,
                               max_clusters=4, min_head_mass=min_head_mass,
                               min_width=min_width, points_per_decade=5,
                               optimizer=optimizer)


def test_head_shrinks_as_its_flops_cost_more():
  counts = zipf(100_000)
  free = dict(min_head_mass=0.0, min_width=1)
  # A wider hidden state makes the full-width head dearer against the narrow tails.
  heads = [choose_cutoffs(counts, dim, 640, 4.0, "flat", FAST, **free)[0]
           for dim in (64, 256, 1024, 4096)]
  assert heads == sorted(heads, reverse=True) and heads[0] > heads[-1]


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
    assert (step_cost(counts, free, 300, 256, 4.0, tail, FAST)["step_seconds"] <=
            step_cost(counts, cutoffs, 300, 256, 4.0, tail, FAST)["step_seconds"])


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


def test_two_level_tails_priced_by_the_fitted_tree_step():
  """With a fitted tf_hsm step, a two-level tail's table is priced by the fit (in the
  additive term), its projection still by the roofline; flat tails are unchanged."""
  from tf_hsm import planning as planner  # pylint: disable=import-outside-toplevel
  fitted = Machine(1e10, 1e9, 1e-4, tree_step=(1e-11, 1e-10, 1e-10, 1e-7, 1e-8, 1e-3))
  plain = Machine(1e10, 1e9, 1e-4)
  cost = planner.adaptive_cluster_cost(40_000, 0.2, 256, 1000, 64, "two_level")
  f0, b0, s0 = planner.step_terms(cost, "sgd", "float32", plain)
  f1, b1, s1 = planner.step_terms(cost, "sgd", "float32", fitted)
  tokens = 1000 * 0.2
  projection_flops = 6 * tokens * 256 * 64
  assert f1 == pytest.approx(projection_flops / 1e10)
  assert f0 == pytest.approx(cost.flops / 1e10) and cost.tree_flops == pytest.approx(
      cost.flops - projection_flops)
  table = next(p for p in cost.parts if p.tree)
  table_bytes = planner.moved_elements(table, "sgd") * 4
  assert b1 == pytest.approx(b0 - table_bytes / 1e9)
  groups = 200  # ceil(sqrt(40,000))
  amounts = (cost.tree_flops, 0.0, table_bytes, 0.0, 2 * tokens, tokens * (groups + 200))
  assert s1 - s0 == pytest.approx(sum(c * a for c, a in zip(fitted.tree_step, amounts)))
  assert cost.tree_bytes == 8 * (9 * 40_000 + 4 * groups)
  flat = planner.adaptive_cluster_cost(40_000, 0.2, 256, 1000, 64, "flat")
  assert planner.step_terms(flat, "sgd", "float32", fitted) == \
      planner.step_terms(flat, "sgd", "float32", plain)
