"""Tests for Tree.from_vectors: valid layout, similar classes grouped, paths about as
short as a Huffman tree's, deterministic for a seed, errors named."""

import numpy as np
import pytest

from tf_hsm.planning.tree_work import tree_costs as _tree_costs
from tf_hsm.tree import Tree
from test_tree import check_invariants


def clustered(rng, clusters, per_cluster, dim, spread=0.05):
  """Vectors in `clusters` tight groups, shuffled; returns (vectors, group of each)."""
  centers = rng.standard_normal((clusters, dim))
  group = rng.permutation(np.repeat(np.arange(clusters), per_cluster))
  return centers[group] + spread * rng.standard_normal((group.size, dim)), group


def sibling_purity(tree, group, first_node=0):
  """Fraction of pairs of sibling classes (leaves of one node from `first_node` on, in
  BFS order: 1 leaves out the root) that share a group."""
  same = total = 0
  for node in range(first_node, tree.num_nodes):
    leaves = [c for c in tree.children(node) if c < tree.num_classes]
    for i, a in enumerate(leaves):
      for b in leaves[i + 1:]:
        total += 1
        same += int(group[a] == group[b])
  return same / total


def path_cost(tree, counts):
  """Expected children scored per token (the op's work)."""
  return _tree_costs(tree, counts / counts.sum(), 1)[0]


@pytest.mark.parametrize("branching", [2, 4, 32])
def test_groups_similar_classes_and_keeps_paths_short(branching):
  rng = np.random.default_rng(branching)
  vectors, group = clustered(rng, 40, 50, 16)
  counts = rng.zipf(1.5, size=vectors.shape[0]).astype(np.float64)
  tree = Tree.from_vectors(vectors, counts, branching=branching)
  check_invariants(tree)
  assert tree.max_branching <= branching
  huffman = Tree.huffman(counts, branching=branching)
  assert path_cost(tree, counts) <= 1.10 * path_cost(huffman, counts)
  if branching < 32:  # clusters of 50 fill 32-wide nodes with more than one cluster
    assert sibling_purity(tree, group) > 0.85
    assert sibling_purity(huffman, group) < 0.2


def test_uniform_counts_give_a_near_balanced_tree():
  rng = np.random.default_rng(1)
  vectors = rng.standard_normal((1000, 8))
  tree = Tree.from_vectors(vectors, branching=10)
  check_invariants(tree)
  assert tree.max_depth == 3
  assert np.all(tree.class_depth == 3)


@pytest.mark.parametrize("branching, head", [(2, 0), (32, 0), (32, 64)])
def test_unseen_classes_do_not_make_a_chain(branching, head):
  # Classes of count 0 (a vocabulary's words absent from the text) whose untrained
  # vectors lie together: they weigh half the smallest positive count, so their group is
  # split in balance, not a class at a time (a chain over a thousand deep before).
  rng = np.random.default_rng(3)
  classes = 5000
  counts = np.floor(1e6 / np.arange(1, classes + 1) ** 1.1)
  unseen = rng.random(classes) < 0.3
  counts[unseen] = 0
  vectors = rng.standard_normal((classes, 16))
  vectors[unseen] = rng.uniform(-0.05, 0.05, size=(unseen.sum(), 16))
  tree = Tree.from_vectors(vectors, counts, branching=branching, head=head)
  check_invariants(tree)
  assert tree.max_depth <= Tree.huffman(counts, branching).max_depth
  # All counts zero: the classes weigh alike, a balanced tree.
  flat_counts = Tree.from_vectors(vectors, np.zeros(classes), branching=branching)
  assert flat_counts.max_depth == int(np.ceil(np.log(classes) / np.log(branching) - 1e-9))


def test_branching_per_level():
  rng = np.random.default_rng(2)
  vectors, _ = clustered(rng, 10, 60, 5)
  tree = Tree.from_vectors(vectors, branching=[3, 5, 2])
  check_invariants(tree)
  assert len(tree.children(0)) == 3
  depth_of_node = tree.node_depth
  for node in range(tree.num_nodes):
    limit = [3, 5, 2][min(int(depth_of_node[node]), 2)]
    assert len(tree.children(node)) <= limit


def test_deterministic_for_a_seed_and_memmap_input(tmp_path):
  rng = np.random.default_rng(3)
  vectors, _ = clustered(rng, 30, 100, 12)
  counts = rng.zipf(1.2, size=vectors.shape[0]).astype(np.float64)
  first = Tree.from_vectors(vectors, counts, branching=4, seed=5)
  assert Tree.from_vectors(vectors.copy(), counts, branching=4, seed=5) == first
  path = tmp_path / "vectors.npy"
  np.save(path, vectors.astype(np.float32))
  mapped = np.load(path, mmap_mode="r")
  from_map = Tree.from_vectors(mapped, counts, branching=4, seed=5)
  check_invariants(from_map)
  assert Tree.from_vectors(np.asarray(mapped), counts, branching=4, seed=5) == from_map


@pytest.mark.parametrize("head", [1, 25, 199])
def test_head_classes_are_children_of_the_root(head):
  rng = np.random.default_rng(head)
  vectors, group = clustered(rng, 20, 10, 6)
  counts = rng.zipf(1.3, size=vectors.shape[0]).astype(np.float64)
  tree = Tree.from_vectors(vectors, counts, branching=4, seed=2, head=head)
  check_invariants(tree)
  assert tree == Tree.from_vectors(vectors, counts, branching=4, seed=2, head=head)
  top = np.argsort(-counts, kind="stable")[:head]  # ties: the lower id
  root_leaves = {c for c in tree.children(0) if c < tree.num_classes}
  assert set(top.tolist()) <= root_leaves
  assert len(tree.children(0)) <= head + 4
  assert np.all(tree.class_depth[top] == 1)
  if head < 100:  # the rest are still split by similarity below the root
    assert tree != Tree.from_vectors(vectors, counts, branching=4, seed=2)
    # Below the root, siblings share a cluster about as often as without a head (0.78
    # on these clusters), a Huffman tree's about 0.05.
    assert sibling_purity(tree, group, first_node=1) > 0.6


def test_small_and_degenerate_inputs():
  assert Tree.from_vectors(np.zeros((1, 3))).num_classes == 1
  two = Tree.from_vectors(np.zeros((2, 0)))
  assert two.num_classes == 2 and two.num_nodes == 1
  same = Tree.from_vectors(np.ones((50, 4)), branching=3)  # identical vectors
  check_invariants(same)
  assert same.num_classes == 50
  zero_counts = Tree.from_vectors(np.eye(9), counts=np.zeros(9), branching=2)
  check_invariants(zero_counts)
  ints = Tree.from_vectors(np.arange(12).reshape(6, 2), branching=2)
  check_invariants(ints)


@pytest.mark.parametrize("vectors, kwargs, message", [
    (np.zeros(5), {}, "2-D"),
    (np.zeros((0, 3)), {}, "at least one row"),
    (np.array([[0.0, np.nan]]), {}, "finite"),
    (np.array([["a", "b"]]), {}, "numbers"),
    (np.zeros((4, 2)), {"counts": [1, 2, 3]}, "counts has 3"),
    (np.zeros((4, 2)), {"counts": [1, -2, 3, 4]}, "counts"),
    (np.zeros((4, 2)), {"branching": 1}, "branching"),
    (np.zeros((4, 2)), {"branching": []}, "branching"),
    (np.zeros((4, 2)), {"branching": [4, 1]}, "branching"),
    (np.zeros((4, 2)), {"branching": 2.5}, "branching"),
    (np.zeros((4, 2)), {"seed": "x"}, "seed"),
    (np.zeros((4, 2)), {"counts": [1, 2, 3, 4], "head": -1}, "head must be >= 0"),
    (np.zeros((4, 2)), {"counts": [1, 2, 3, 4], "head": 4},
     r"head must be less than the number of classes \(4\), got 4"),
    (np.zeros((4, 2)), {"counts": [1, 2, 3, 4], "head": 1.5}, "head must be an integer"),
    (np.zeros((4, 2)), {"counts": [1, 2, 3, 4], "head": True}, "head must be an integer"),
    (np.zeros((4, 2)), {"head": 2}, "head needs counts"),
])
def test_errors_name_the_argument(vectors, kwargs, message):
  with pytest.raises((ValueError, TypeError), match=message):
    Tree.from_vectors(vectors, **kwargs)
