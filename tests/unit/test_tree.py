"""Tests for tf_hsm.tree.Tree: layout invariants, builders, errors, persistence.

The invariant checker re-derives every array from ``child_begin`` and
``slot_child`` with plain Python loops, independently of the vectorized code
under test; the Huffman and from_parents builders are compared against slow,
obviously-correct reference implementations.
"""

import collections
import heapq
import io
import math
import pickle
import time

import numpy as np
import pytest

from tf_hsm.tree import Tree

# --------------------------------------------------------------------------- #
# Slow references
# --------------------------------------------------------------------------- #

ARRAYS = ("child_begin", "slot_child", "slot_node", "node_slot", "class_slot",
          "node_depth", "path_begin", "path_nodes", "path_slots")


def check_invariants(tree):
    """Re-derives the whole layout with Python loops and compares it to `tree`."""
    c, m, s = tree.num_classes, tree.num_nodes, tree.num_slots
    for name in ARRAYS + ("class_depth",):
        arr = getattr(tree, name)
        assert isinstance(arr, np.ndarray), name
        assert arr.dtype == np.int64, name
        assert arr.ndim == 1, name
        assert not arr.flags.writeable, name
    assert all(type(v) is int for v in (c, m, s, tree.max_depth, tree.max_branching))
    assert c >= 1 and m >= 1
    assert s == c + m - 1

    begin = tree.child_begin.tolist()
    codes = tree.slot_child.tolist()
    assert len(begin) == m + 1 and len(codes) == s
    assert begin[0] == 0 and begin[-1] == s
    assert all(begin[n] < begin[n + 1] for n in range(m)), "every node has a child"

    # Owner of each slot; who points at each class / node.
    slot_node = [None] * s
    for n in range(m):
        for slot in range(begin[n], begin[n + 1]):
            slot_node[slot] = n
    class_slot = [None] * c
    node_slot = [None] * m
    node_slot[0] = -1
    for slot, code in enumerate(codes):
        assert 0 <= code < c + m and code != c
        if code < c:
            assert class_slot[code] is None, "class appears twice"
            class_slot[code] = slot
        else:
            assert node_slot[code - c] is None, "node appears twice"
            node_slot[code - c] = slot
    assert None not in class_slot and None not in node_slot

    # BFS numbering, children in slot order: a queue walk must meet the
    # internal nodes exactly as 1, 2, ..., M-1.
    queue = [0]
    for node in queue:
        for slot in range(begin[node], begin[node + 1]):
            if codes[slot] >= c:
                assert codes[slot] - c == len(queue), "not BFS order"
                queue.append(codes[slot] - c)
    assert queue == list(range(m))

    parent = [None] + [slot_node[node_slot[n]] for n in range(1, m)]
    node_depth = [0] * m
    for n in range(1, m):
        assert parent[n] < n
        node_depth[n] = node_depth[parent[n]] + 1

    path_begin = [0]
    path_nodes, path_slots = [], []
    for cls in range(c):
        steps = []
        slot = class_slot[cls]
        while True:
            node = slot_node[slot]
            steps.append((node, slot))
            if node == 0:
                break
            slot = node_slot[node]
        steps.reverse()
        assert steps[-1][1] == class_slot[cls] and codes[steps[-1][1]] == cls
        for node, slot in steps:
            assert begin[node] <= slot < begin[node + 1]
        path_nodes += [n for n, _ in steps]
        path_slots += [sl for _, sl in steps]
        path_begin.append(len(path_nodes))
        assert tree.path(cls) == steps
        assert all(type(a) is int and type(b) is int for a, b in tree.path(cls))

    assert tree.slot_node.tolist() == slot_node
    assert tree.node_slot.tolist() == node_slot
    assert tree.class_slot.tolist() == class_slot
    assert tree.node_depth.tolist() == node_depth
    assert tree.path_begin.tolist() == path_begin
    assert tree.path_nodes.tolist() == path_nodes
    assert tree.path_slots.tolist() == path_slots
    depths = [path_begin[i + 1] - path_begin[i] for i in range(c)]
    assert tree.class_depth.tolist() == depths
    assert tree.max_depth == max(depths)
    assert tree.max_branching == max(begin[n + 1] - begin[n] for n in range(m))
    assert tree.num_steps == len(path_nodes)

    for n in range(m):
        rng = tree.child_range(n)
        assert rng == (begin[n], begin[n + 1]) and all(type(v) is int for v in rng)
        assert tree.children(n) == codes[begin[n]:begin[n + 1]]
    expected_parents = ([c + slot_node[class_slot[i]] for i in range(c)] + [-1]
                        + [c + parent[n] for n in range(1, m)])
    assert tree.parents().tolist() == expected_parents


def check_round_trips(tree):
    """Every representation rebuilds the same tree."""
    assert Tree.from_nested(tree.to_nested()) == tree
    assert Tree.from_paths(tree.to_paths()) == tree
    assert Tree.from_config(tree.get_config()) == tree
    assert pickle.loads(pickle.dumps(tree)) == tree
    # from_parents reorders children (leaves first, by index), so compare the
    # trees up to child order.
    again = Tree.from_parents(tree.parents())
    assert canonical(again) == canonical(tree)
    assert Tree.from_parents(again.parents()) == again


def canonical(tree):
    """A child-order-independent form: nested tuples with sorted children."""
    def canon(node):
        if isinstance(node, int):
            return (node,)
        kids = sorted(canon(k) for k in node)
        return (min(k[0] for k in kids), tuple(kids))
    return canon(tree.to_nested())


def canonical_from_parents(parents, c):
    """`canonical` computed straight from a parent array (slow, recursive)."""
    kids = collections.defaultdict(list)
    root = None
    for i, p in enumerate(parents):
        if p < 0:
            root = i
        else:
            kids[p].append(i)

    def canon(i):
        if i < c:
            return (i,)
        sub = sorted(canon(k) for k in kids[i])
        return (min(k[0] for k in sub), tuple(sub))
    return canon(root)


def ref_from_parents(parents, c):
    """BFS layout from a parent array, children by increasing entry index."""
    n = len(parents)
    kids = {i: [] for i in range(c, n)}
    root = None
    for i, p in enumerate(parents):
        if p < 0:
            root = i
        else:
            kids[p].append(i)
    queue = [root]
    new_id = {root: 0}
    child_begin, slot_child = [0], []
    for node in queue:
        for ch in kids[node]:
            if ch < c:
                slot_child.append(ch)
            else:
                new_id[ch] = len(queue)
                queue.append(ch)
                slot_child.append(c + new_id[ch])
        child_begin.append(len(slot_child))
    return child_begin, slot_child


def ref_huffman_nested(counts, k):
    """Sequential two-queue k-ary Huffman with the documented tie-breaking."""
    n = len(counts)
    if n == 1:
        return [0]
    order = sorted(range(n), key=lambda i: (counts[i], i))
    leaves = collections.deque((counts[i], i) for i in order)
    merged = collections.deque()
    take = 2 + (n - 2) % (k - 1)
    while True:
        group = []
        for _ in range(take):
            if leaves and (not merged or leaves[0][0] <= merged[0][0]):
                group.append(leaves.popleft())
            else:
                group.append(merged.popleft())
        node = (sum(w for w, _ in group), [obj for _, obj in group])
        if not leaves and not merged:
            return node[1]
        merged.append(node)
        take = k


def ref_huffman_cost(counts, k):
    """Optimal sum(count * depth) by the textbook heap method with dummy zeros."""
    if len(counts) == 1:
        return counts[0]
    heap = list(counts)
    while (len(heap) - 1) % (k - 1):
        heap.append(0)
    heapq.heapify(heap)
    cost = 0
    while len(heap) > 1:
        total = sum(heapq.heappop(heap) for _ in range(k))
        cost += total
        heapq.heappush(heap, total)
    return cost


def expected_depth(tree, counts):
    return int(np.dot(np.asarray(counts, np.int64), tree.class_depth))


def random_parents(rng, max_depth=8, max_branching=50, max_items=400):
    """A random parent array: mixed leaves/internal children, chains of
    single-child nodes, random depth; class ids and internal indices shuffled."""
    children = [[]]  # per node: list of ("leaf", None) / ("node", index)
    depth = [0]
    queue = [0]
    items = 1
    for node in queue:
        r = rng.random()
        if r < 0.3:
            fan = 1
        elif r < 0.9:
            fan = int(rng.integers(2, 6))
        else:
            fan = int(rng.integers(1, max_branching + 1))
        p_internal = 0.0 if depth[node] + 1 >= max_depth or items > max_items else (
            0.9 if fan == 1 else 0.3)
        for _ in range(fan):
            items += 1
            if rng.random() < p_internal:
                children.append([])
                depth.append(depth[node] + 1)
                children[node].append(("node", len(children) - 1))
                queue.append(len(children) - 1)
            else:
                children[node].append(("leaf", None))
    m = len(children)
    c = sum(kind == "leaf" for kids in children for kind, _ in kids)
    class_ids = rng.permutation(c)
    node_index = c + rng.permutation(m)  # entry index of generated node i
    parents = np.full(c + m, -7, np.int64)
    leaf = 0
    for i, kids in enumerate(children):
        for kind, j in kids:
            if kind == "leaf":
                parents[class_ids[leaf]] = node_index[i]
                leaf += 1
            else:
                parents[node_index[j]] = node_index[i]
    parents[node_index[0]] = -1
    assert (parents >= -1).all()
    return parents, c


# --------------------------------------------------------------------------- #
# The contract on hand-written trees
# --------------------------------------------------------------------------- #

NESTED = [[0, 1], [2, [3, 4]], 5]


def test_layout_of_documented_example():
    tree = Tree.from_nested(NESTED)
    check_invariants(tree)
    assert tree.num_classes == 6 and tree.num_nodes == 4 and tree.num_slots == 9
    # Root slots 0..2: node 1, node 2, class 5; node 1: classes 0, 1; node 2:
    # class 2 then node 3; node 3: classes 3, 4.
    assert tree.child_begin.tolist() == [0, 3, 5, 7, 9]
    assert tree.slot_child.tolist() == [7, 8, 5, 0, 1, 2, 9, 3, 4]
    assert tree.path(4) == [(0, 1), (2, 6), (3, 8)]
    assert tree.path(5) == [(0, 2)]
    assert tree.class_depth.tolist() == [2, 2, 2, 3, 3, 1]
    assert tree.node_depth.tolist() == [0, 1, 1, 2]
    assert tree.max_depth == 3 and tree.max_branching == 3
    assert tree.children(2) == [2, 9]
    assert tree.parents().tolist() == [7, 7, 8, 9, 9, 6, -1, 6, 6, 8]
    assert tree.to_paths() == [[0, 0], [0, 1], [1, 0], [1, 1, 0], [1, 1, 1], [2]]
    assert tree.to_nested() == NESTED
    check_round_trips(tree)


def test_same_tree_from_nested_paths_and_parents():
    # Leaves before internal children, so from_parents' order matches.
    nested = [5, [0, 1], [2, [3, 4]]]
    paths = [[1, 0], [1, 1], [2, 0], [2, 1, 0], [2, 1, 1], [0]]
    # C = 6; internal entries: 6 root, 7 = [0, 1], 8 = [2, [3, 4]], 9 = [3, 4].
    parents = [7, 7, 8, 9, 9, 6, -1, 6, 6, 8]
    a = Tree.from_nested(nested)
    b = Tree.from_paths(paths)
    c = Tree.from_parents(parents)
    d = Tree.from_parents(parents, num_classes=6)
    # The same tree with the internal entries in another order.
    perm = {6: 8, 7: 6, 8: 9, 9: 7}
    shuffled = [0] * 10
    for i, p in enumerate(parents):
        shuffled[perm.get(i, i)] = perm.get(p, p)
    e = Tree.from_parents(shuffled)
    assert a == b == c == d == e
    assert hash(a) == hash(b) == hash(e)
    check_invariants(a)
    assert Tree.from_paths(np.array([[0, 0], [0, 1], [1, 0]])) == Tree.from_nested([[0, 1], [2]])


def test_single_child_chains_and_mixed_children():
    tree = Tree.from_nested([[[[0]]], 1, [[2, [3]]]])
    check_invariants(tree)
    check_round_trips(tree)
    assert tree.class_depth.tolist() == [4, 1, 3, 4]
    single = Tree.from_nested([0])
    check_invariants(single)
    assert (single.num_classes, single.num_nodes, single.num_slots) == (1, 1, 1)
    assert single.path(0) == [(0, 0)]
    assert Tree.from_nested(([0, 1],)) == Tree.from_nested([[0, 1]])


# --------------------------------------------------------------------------- #
# balanced / two_level
# --------------------------------------------------------------------------- #

def ref_balanced_nested(c, b):
    items = list(range(c))
    while True:
        items = [items[i:i + b] for i in range(0, len(items), b)]
        if len(items) == 1:
            return items[0]


@pytest.mark.parametrize("c,b", [(1, 2), (2, 2), (3, 2), (5, 2), (8, 2), (9, 3), (10, 3),
                                 (16, 4), (17, 4), (7, 7), (8, 7), (100, 10), (101, 10),
                                 (50, 64), (1000, 3)])
def test_balanced(c, b):
    tree = Tree.balanced(c, b)
    check_invariants(tree)
    assert tree.to_nested() == ref_balanced_nested(c, b)
    depth = 1
    while b ** depth < c:
        depth += 1
    assert tree.class_depth.tolist() == [depth] * c
    assert tree.max_branching == min(b, c)
    check_round_trips(tree)
    # Leaves come before internal children here, so from_parents is exact.
    assert Tree.from_parents(tree.parents()) == tree


@pytest.mark.parametrize("args", [(0, 2), (-3, 2), (5, 1), (5, 0), (5, -2), (2.5, 2),
                                  (5, 2.0), ("5", 2), (True, 2), (5, None)])
def test_balanced_errors(args):
    with pytest.raises(ValueError):
        Tree.balanced(*args)


@pytest.mark.parametrize("c", list(range(1, 30)) + [99, 100, 101, 1000, 4097])
def test_two_level_uniform(c):
    tree = Tree.two_level(c)
    k = math.ceil(math.sqrt(c))
    assert tree.num_nodes == k + 1
    assert tree.children(0) == list(range(c + 1, c + k + 1))
    sizes = np.diff(tree.child_begin)[1:]
    assert sizes.min() >= 1 and sizes.max() - sizes.min() <= 1
    assert tree.slot_child[k:].tolist() == list(range(c))  # consecutive classes
    assert (tree.class_depth == 2).all()
    if c <= 1000:
        check_invariants(tree)
    assert Tree.from_parents(tree.parents()) == tree


def cluster_of(tree):
    """Cluster (1..K) of each class in a two-level tree."""
    return tree.slot_node[tree.class_slot]


@pytest.mark.parametrize("seed", range(6))
def test_two_level_counts(seed):
    rng = np.random.default_rng(seed)
    c = int(rng.integers(1, 3000))
    kind = seed % 3
    if kind == 0:  # Zipf-like, shuffled ids
        counts = (1e6 / np.arange(1, c + 1)).astype(np.int64)[rng.permutation(c)]
    elif kind == 1:  # many ties and zeros
        counts = rng.integers(0, 4, c)
    else:  # float probabilities with a zero tail
        counts = rng.random(c) ** 4
        counts[rng.random(c) < 0.3] = 0.0
    tree = Tree.two_level(c, counts)
    if c <= 1000:
        check_invariants(tree)
    assert (tree.class_depth == 2).all()
    k_target = math.ceil(math.sqrt(c))
    clusters = tree.num_nodes - 1
    sizes = np.diff(tree.child_begin)[1:]
    assert sizes.min() >= 1  # no empty cluster
    assert sizes.max() <= 2 * math.ceil(c / k_target)
    assert k_target / 2 <= clusters <= 2.5 * k_target + 1
    # Class ids are preserved, listed by decreasing count (stable).
    order = np.argsort(-np.asarray(counts, np.float64), kind="stable")
    assert tree.slot_child[clusters:].tolist() == order.tolist()
    # Frequent classes sit in small clusters, rare ones in large clusters.
    cl = cluster_of(tree)
    if kind == 0:
        assert sizes[cl[order[0]] - 1] <= sizes[cl[order[-1]] - 1]
    # Roughly equal mass: no multi-class cluster is much heavier than 1/K.
    p = np.asarray(counts, np.float64) / max(float(np.sum(counts)), 1e-300)
    mass = np.bincount(cl - 1, weights=p, minlength=clusters)
    assert (mass[sizes > 1] <= 2.0 / k_target + 1e-12).all()


def test_two_level_counts_extremes():
    c = 1000
    # All zero: like equal counts, i.e. like no counts.
    assert Tree.two_level(c, np.zeros(c)) == Tree.two_level(c)
    equal = Tree.two_level(c, np.ones(c, np.int64))
    sizes = np.diff(equal.child_begin)[1:]
    assert sizes.size == 32 and sizes.max() - sizes.min() <= 1
    assert equal.slot_child[32:].tolist() == list(range(c))
    assert Tree.two_level(1, [5]) == Tree.two_level(1)
    # A zero-count half does not collapse into one giant cluster.
    counts = np.concatenate([1.0 / np.arange(1, 501), np.zeros(500)])
    tree = Tree.two_level(c, counts)
    assert tree.max_branching <= 2 * math.ceil(c / 32)
    # A single dominant class gets a cluster of its own.
    counts = np.ones(c)
    counts[123] = 1e6
    tree = Tree.two_level(c, counts)
    assert tree.children(1) == [123]


@pytest.mark.parametrize("counts", [[1, 2], [1, 2, 3, 4], [-1, 2, 3], [1, np.nan, 3],
                                    [1, np.inf, 3], [[1, 2, 3]], ["a", "b", "c"]])
def test_two_level_errors(counts):
    with pytest.raises(ValueError):
        Tree.two_level(3, counts)


@pytest.mark.parametrize("c", [0, -1, 1.5, None])
def test_two_level_bad_num_classes(c):
    with pytest.raises(ValueError):
        Tree.two_level(c)


# --------------------------------------------------------------------------- #
# huffman
# --------------------------------------------------------------------------- #

@pytest.mark.parametrize("k", [2, 3, 5])
def test_huffman_matches_reference_and_is_optimal(k):
    rng = np.random.default_rng(k)
    for trial in range(60):
        n = int(rng.integers(1, 70))
        high = [2, 5, 100, 10**6][trial % 4]  # small ranges force many ties
        counts = rng.integers(0, high, n)
        tree = Tree.huffman(counts, k)
        assert tree == Tree.from_nested(ref_huffman_nested(counts.tolist(), k)), counts
        assert expected_depth(tree, counts) == ref_huffman_cost(counts.tolist(), k)
        fans = np.diff(tree.child_begin)
        # No dummy slots: every node is full except at most the first merge.
        assert (fans <= k).all() and np.count_nonzero(fans < k) <= 1
        if trial < 15:
            check_invariants(tree)
            check_round_trips(tree)


def test_huffman_known_shapes():
    assert Tree.huffman([7]) == Tree.from_nested([0])
    assert Tree.huffman([3, 1]) == Tree.from_nested([1, 0])
    assert Tree.huffman([5, 1, 1, 2, 3, 8, 13]).to_nested() == [6, [5, [0, [4, [3, [1, 2]]]]]]
    # k = 3, n = 7: the first merge takes 2 + 5 % 2 = 3 items.
    assert Tree.huffman([5, 1, 1, 2, 3, 8, 13], 3).to_nested() == [5, [4, [1, 2, 3], 0], 6]
    # 4 items, k = 3: (4-1) % 2 = 1, so the first merge takes only 2.
    tree = Tree.huffman([1, 1, 1, 1], 3)
    assert sorted(np.diff(tree.child_begin).tolist()) == [2, 3]
    assert tree.num_slots == 4 + 2 - 1
    # Equal counts, power of two: a perfect binary tree.
    assert (Tree.huffman(np.ones(64, np.int64)).class_depth == 6).all()
    assert (Tree.huffman(np.ones(81, np.int64), 3).class_depth == 4).all()


def test_huffman_deterministic_and_dtype_independent():
    rng = np.random.default_rng(7)
    counts = rng.integers(0, 50, 500)
    a = Tree.huffman(counts)
    assert a == Tree.huffman(counts.copy())
    assert a == Tree.huffman(counts.tolist())
    assert a == Tree.huffman(counts.astype(np.float64))
    assert a == Tree.huffman(counts.astype(np.uint32))
    probs = rng.random(300)
    tree = Tree.huffman(probs, 4)
    check_invariants(tree)
    # Float weights: still optimal (compare costs with a tolerance).
    ref = ref_huffman_cost(probs.tolist(), 4)
    assert abs(float(np.dot(probs, tree.class_depth)) - ref) <= 1e-9 * ref
    # Huge integer counts do not overflow.
    big = Tree.huffman(np.array([2**62, 2**62, 1, 3], np.int64))
    check_invariants(big)


@pytest.mark.parametrize("args", [([],), ([[1, 2]],), ([1, -2],), ([1, np.nan],),
                                  ([1, np.inf],), ([1, 2], 1), ([1, 2], 0), ([1, 2], 2.5),
                                  (["x", "y"],), (np.array([1, 2], dtype=object),)])
def test_huffman_errors(args):
    with pytest.raises(ValueError):
        Tree.huffman(*args)


# --------------------------------------------------------------------------- #
# from_parents, random trees
# --------------------------------------------------------------------------- #

@pytest.mark.parametrize("seed", range(25))
def test_random_trees_from_parents(seed):
    rng = np.random.default_rng(seed)
    parents, c = random_parents(rng, max_depth=int(rng.integers(1, 9)))
    tree = Tree.from_parents(parents)
    assert tree.num_classes == c
    assert tree == Tree.from_parents(parents, num_classes=c)
    assert tree == Tree.from_parents(parents.tolist())
    child_begin, slot_child = ref_from_parents(parents.tolist(), c)
    assert tree.child_begin.tolist() == child_begin
    assert tree.slot_child.tolist() == slot_child
    check_invariants(tree)
    check_round_trips(tree)
    # The same tree as the input, up to child order and node numbering.
    assert canonical(tree) == canonical_from_parents(parents.tolist(), c)


def test_from_parents_does_not_touch_input():
    parents = np.array([2, 2, -1], np.int64)
    tree = Tree.from_parents(parents)
    assert parents.flags.writeable
    parents[0] = 5  # our arrays are copies
    assert tree.parents().tolist() == [2, 2, -1]


@pytest.mark.parametrize("parents,num_classes,match", [
    ([2, 2, 2], None, "no root"),
    ([2, 3, -1, -1], None, "several roots"),
    ([3, 3, 4, -1, -1], None, "several roots"),
    ([2, -2, -1], None, "out of range"),
    ([2, 3, -1], None, "out of range"),
    ([2, 9, -1], None, "out of range"),
    ([3, 0, 3, -1], 2, "is a class"),
    ([-1, 2, -1], 1, "class 0 has parent -1"),
    ([3, -1, 3, -1], 2, "class 1 has parent -1"),
    ([2, 3, -1, 4, 3], 2, "not reachable"),        # nodes 3 <-> 4 form a cycle
    ([2, 2, -1, 3], 2, "not reachable"),           # node 3 is its own parent
    ([2, 2, -1, 2], 2, "no children"),             # node 3 is a childless leaf-node
    ([-1], None, "at least one class"),
    ([], None, "at least one class"),
    ([-1, -1], None, "no classes"),
    ([0, -1], None, "smallest parent index is 0"),
    ([1, -1], 2, "no internal nodes"),
    ([1.0, -1.0], None, "integers"),
    ([[1, -1]], None, "1-D"),
    ([1, -1], 0, ">= 1"),
])
def test_from_parents_errors(parents, num_classes, match):
    with pytest.raises(ValueError, match=match):
        Tree.from_parents(parents, num_classes=num_classes)


def test_from_parents_cycle_messages():
    # Root 4 with classes 0, 1; nodes 5 and 6 point at each other and own class 2, 3.
    with pytest.raises(ValueError, match=r"not reachable.*\[5, 6\]"):
        Tree.from_parents([4, 4, 5, 6, -1, 6, 5])


# --------------------------------------------------------------------------- #
# from_paths / from_nested errors
# --------------------------------------------------------------------------- #

@pytest.mark.parametrize("paths,match", [
    ([], "empty"),
    ([[0], []], "class 1 has an empty path"),
    ([[0], [0, 1]], "prefix"),
    ([[0, 0], [0]], "prefix"),
    ([[0], [0]], "same path"),
    ([[0, 1], [1], [0, 1]], "same path"),
    ([[0, 0], [0, 1], [2]], r"positions \[0, 2\], which are not 0..k-1"),
    ([[1]], "0..k-1"),
    ([[0, 0], [0, 2], [1]], r"prefix \[0\].*not 0..k-1"),
    ([[0], [5]], "only 2 classes"),
    ([[0], [-1]], "negative"),
    ([[0], [1.5]], "integers"),
    ([[0], 1], "sequence"),
    (None, "sequence"),
])
def test_from_paths_errors(paths, match):
    with pytest.raises(ValueError, match=match):
        Tree.from_paths(paths)


@pytest.mark.parametrize("nested,match", [
    ([0, 2], "class 2 is out of range and class 1 is missing"),
    ([1], "out of range"),
    ([0, [0]], "more than once"),
    ([0, []], "empty list"),
    ([], "empty list"),
    ([[[]]], "empty list"),
    ([0, "1"], "ints"),
    ([0, 1.0], "ints"),
    ([0, None], "ints"),
    ([0, True], "ints"),
    ([0, -1], "negative"),
    (5, "list or tuple"),
    ([[[0]]], None),  # valid: a chain
])
def test_from_nested_errors(nested, match):
    if match is None:
        Tree.from_nested(nested)
        return
    with pytest.raises(ValueError, match=match):
        Tree.from_nested(nested)


def test_from_nested_rejects_shared_and_cyclic_lists():
    loop = [0]
    loop.append(loop)
    with pytest.raises(ValueError, match="twice"):
        Tree.from_nested(loop)
    shared = [1]
    with pytest.raises(ValueError, match="twice"):
        Tree.from_nested([0, shared, shared])


def test_nested_accepts_numpy_ints():
    assert Tree.from_nested([np.int64(1), [np.int32(0)]]) == Tree.from_nested([1, [0]])


# --------------------------------------------------------------------------- #
# The internal constructor rejects broken layouts
# --------------------------------------------------------------------------- #

@pytest.mark.parametrize("child_begin,slot_child,c,match", [
    ([0], [], 1, "at least 2"),
    ([1, 2], [0], 1, r"child_begin\[0\]"),
    ([0, 2, 2, 3], [0, 4, 1], 2, "node 1 has no children"),
    ([0, 2], [0, 1], 1, "slots"),
    ([0, 2, 3], [0, 3], 2, "slot_child has"),
    ([0, 2], [0, 5], 2, "outside"),
    ([0, 2, 3], [0, 2, 1], 2, "root"),
    ([0, 2, 3], [0, 0, 1], 2, "child of 2 slots"),
    ([0, 2, 3, 4], [4, 3, 0, 1], 2, "BFS order"),       # nodes listed 2 then 1
    ([0, 2, 3], [0, 1, 3], 2, "not numbered before"),   # node 1 is its own child
    ([0, 2, 3], [3.0, 0.0, 1.0], 2, "integers"),
])
def test_from_layout_errors(child_begin, slot_child, c, match):
    with pytest.raises(ValueError, match=match):
        Tree._from_layout(child_begin, slot_child, c)


def test_no_public_constructor_and_read_only():
    with pytest.raises(TypeError):
        Tree()
    tree = Tree.balanced(10, 3)
    for name in ARRAYS + ("class_depth",):
        with pytest.raises(ValueError):
            getattr(tree, name)[0] = 1
    # The caller's arrays are not frozen by the constructor.
    cb, sc = np.array([0, 2]), np.array([0, 1])
    Tree._from_layout(cb, sc, 2)
    assert cb.flags.writeable and sc.flags.writeable


def test_queries_validate_arguments():
    tree = Tree.from_nested(NESTED)
    for bad in (-1, 4, 10):
        with pytest.raises(ValueError, match="out of range"):
            tree.child_range(bad)
        with pytest.raises(ValueError, match="out of range"):
            tree.children(bad)
    for bad in (-1, 6):
        with pytest.raises(ValueError, match="out of range"):
            tree.path(bad)
    for bad in (1.5, "0", None):
        with pytest.raises(ValueError):
            tree.child_range(bad)
        with pytest.raises(ValueError):
            tree.path(bad)
    assert tree.child_range(np.int64(3)) == (7, 9)
    assert tree.path(np.int32(5)) == [(0, 2)]


def test_equality_hash_repr_describe():
    a, b = Tree.balanced(9, 3), Tree.balanced(9, 3)
    assert a == b and not a != b and hash(a) == hash(b)
    assert a != Tree.balanced(9, 4) and a != Tree.balanced(8, 3)
    assert a != "tree" and a != None  # noqa: E711
    assert len({a, b, Tree.balanced(9, 4)}) == 2
    assert repr(a) == "Tree(num_classes=9, num_nodes=4, max_depth=2, max_branching=3)"
    text = a.describe()
    assert "9 classes" in text and "4 internal nodes" in text and "12 slots" in text


# --------------------------------------------------------------------------- #
# save / load
# --------------------------------------------------------------------------- #

def test_save_load_round_trip(tmp_path):
    rng = np.random.default_rng(3)
    trees = [Tree.from_nested(NESTED), Tree.from_nested([0]), Tree.balanced(100, 7),
             Tree.two_level(50, rng.integers(0, 9, 50)), Tree.huffman(rng.integers(1, 99, 77), 3),
             Tree.from_parents(random_parents(rng)[0])]
    for i, tree in enumerate(trees):
        path = tmp_path / f"tree{i}.bin"  # no .npz suffix: saved at exactly this path
        tree.save(path)
        assert path.exists()
        loaded = Tree.load(path)
        assert loaded == tree
        for name in ARRAYS:
            assert np.array_equal(getattr(loaded, name), getattr(tree, name))
        assert Tree.load(str(path)) == tree
    buf = io.BytesIO()
    trees[2].save(buf)
    buf.seek(0)
    assert Tree.load(buf) == trees[2]


def test_load_rejects_foreign_and_corrupt_files(tmp_path):
    good = tmp_path / "good.npz"
    tree = Tree.from_nested(NESTED)
    tree.save(good)
    data = good.read_bytes()

    def write(name, content):
        path = tmp_path / name
        path.write_bytes(content)
        return path

    cases = {
        "random.bin": bytes(range(256)) * 4,
        "empty.bin": b"",
        "truncated.npz": data[: len(data) // 2],
    }
    for name, content in cases.items():
        with pytest.raises(ValueError):
            Tree.load(write(name, content))

    npy = tmp_path / "plain.npy"
    np.save(npy, np.arange(3))
    with pytest.raises(ValueError, match="not a tf_hsm tree"):
        Tree.load(npy)

    def savez(name, **arrays):
        path = tmp_path / name
        with open(path, "wb") as f:
            np.savez(f, **arrays)
        return path

    fields = dict(format=np.array("tf_hsm.Tree"), version=np.array(1),
                  num_classes=np.array(6), child_begin=tree.child_begin,
                  slot_child=tree.slot_child)
    assert Tree.load(savez("ok.npz", **fields)) == tree
    with pytest.raises(ValueError, match="missing"):
        Tree.load(savez("foreign.npz", x=np.arange(3)))
    with pytest.raises(ValueError, match="not a tf_hsm tree"):
        Tree.load(savez("fmt.npz", **{**fields, "format": np.array("other")}))
    with pytest.raises(ValueError, match="version 2"):
        Tree.load(savez("newer.npz", **{**fields, "version": np.array(2)}))
    with pytest.raises(ValueError, match="invalid tree"):
        bad = tree.slot_child.copy()
        bad[0], bad[1] = bad[1], bad[0]  # breaks BFS order
        Tree.load(savez("layout.npz", **{**fields, "slot_child": bad}))
    with pytest.raises(ValueError, match="invalid num_classes"):
        Tree.load(savez("nc.npz", **{**fields, "num_classes": np.array([6])}))
    with pytest.raises(ValueError):
        Tree.load(savez("float.npz", **{**fields, "child_begin": tree.child_begin * 1.0}))
    with pytest.raises(FileNotFoundError):
        Tree.load(tmp_path / "missing.npz")


def test_get_config_is_json_serializable():
    import json
    tree = Tree.huffman([1, 2, 3, 4, 5], 3)
    config = json.loads(json.dumps(tree.get_config()))
    assert Tree.from_config(config) == tree
    with pytest.raises(ValueError, match="missing"):
        Tree.from_config({"num_classes": 3})


def test_config_of_large_trees_is_compact():
    # A JSON list would take ~9 bytes per slot (9 MB here); the encoded layout of
    # the usual builders' trees is a small fraction of that.
    import json
    tree = Tree.two_level(1_000_000)
    text = json.dumps(tree.get_config())
    assert len(text) < 100_000
    assert Tree.from_config(json.loads(text)) == tree
    counts = np.random.default_rng(0).zipf(1.3, 100_000)
    huffman = Tree.huffman(counts)
    text = json.dumps(huffman.get_config())
    assert len(text) < 3 * huffman.num_slots
    assert Tree.from_config(json.loads(text)) == huffman


def test_config_with_plain_lists_still_loads():
    # The format of earlier versions (and the easiest to write by hand).
    tree = Tree.from_nested([[0, 1], 2, [3, [4, 5]]])
    config = {"num_classes": 6, "child_begin": tree.child_begin.tolist(),
              "slot_child": tree.slot_child.tolist()}
    assert Tree.from_config(config) == tree


def test_config_errors_name_the_problem():
    good = Tree.balanced(7, 3).get_config()
    other = Tree.balanced(8, 3).get_config()
    cases = [
        ([good["child_begin"]], "must be a dict"),
        ({**good, "encoding": "json"}, "unknown encoding 'json'"),
        ({**good, "child_begin": "not base64!"}, "child_begin is corrupt"),
        ({**good, "slot_child": "AAAA"}, "slot_child is corrupt"),
        ({**good, "slot_child": [0, 1, 2]}, "slot_child must be a string"),
        # Valid deflate data whose length is not a whole number of int64 values.
        ({**good, "slot_child": "eJxjYGAAAAADAAE="}, "whole number of int64"),
        ({**good, "slot_child": other["slot_child"]}, "slot_child has 11 entries"),
        ({**good, "num_classes": 8}, "with 8 classes"),
    ]
    for config, message in cases:
        with pytest.raises(ValueError, match=message):
            Tree.from_config(config)


# --------------------------------------------------------------------------- #
# Scale
# --------------------------------------------------------------------------- #

def test_scale_two_level_10m_and_huffman_2m():
    t0 = time.perf_counter()
    tree = Tree.two_level(10_000_000)
    t_two_level = time.perf_counter() - t0
    assert tree.num_slots == 10_000_000 + 3163 + 1 - 1
    assert tree.max_depth == 2 and tree.max_branching == 3163
    assert tree.path(9_999_999) == [(0, 3162), (3163, 10_003_162)]
    del tree

    counts = (1e9 / np.arange(1, 2_000_001)).astype(np.int64)  # Zipf's law
    counts = counts[np.random.default_rng(0).permutation(counts.size)]
    t0 = time.perf_counter()
    tree = Tree.huffman(counts)
    t_huffman = time.perf_counter() - t0
    assert tree.num_nodes == 2_000_000 - 1
    assert np.diff(tree.child_begin).max() == 2
    # Frequent classes are shallow.
    top = int(np.argmax(counts))
    assert tree.class_depth[top] <= 5 < tree.max_depth
    # Generous bounds: a shared 2-core machine; typical values are ~1-2 s each.
    assert t_two_level < 30 and t_huffman < 30, (t_two_level, t_huffman)
