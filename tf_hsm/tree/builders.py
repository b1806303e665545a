"""Builders that compute a tree's shape: balanced, two-level and Huffman trees.

Each function validates its arguments and returns ``(child_begin, slot_child,
num_classes)`` in the BFS layout, which ``Tree._from_layout`` then validates and
completes; the matching `Tree` classmethods document the trees they build.
"""

from __future__ import annotations

import math

import numpy as np

from tf_hsm.tree.checks import check_int, counts_array
from tf_hsm.tree.layout import bfs_layout


def balanced(num_classes, branching):
    """The layout of `Tree.balanced`: levels of `branching` children, filled in order."""
    c = check_int(num_classes, "num_classes", 1)
    b = check_int(branching, "branching", 2)
    # Node counts per level, built bottom-up then reversed to root-first.
    levels = []
    n = c
    while True:
        n = -(-n // b)
        levels.append(n)
        if n == 1:
            break
    levels.reverse()
    first = np.concatenate([[0], np.cumsum(levels)])  # first node id per level
    sizes_parts, codes_parts = [], []
    for lvl, n_nodes in enumerate(levels):
        if lvl + 1 < len(levels):
            n_below = levels[lvl + 1]
            codes = c + first[lvl + 1] + np.arange(n_below, dtype=np.int64)
        else:
            n_below = c
            codes = np.arange(c, dtype=np.int64)
        sizes = np.full(n_nodes, b, np.int64)
        sizes[-1] = n_below - b * (n_nodes - 1)
        sizes_parts.append(sizes)
        codes_parts.append(codes)
    child_begin = np.concatenate([[0], np.cumsum(np.concatenate(sizes_parts))])
    return child_begin, np.concatenate(codes_parts), c


def two_level(num_classes, counts=None):
    """The layout of `Tree.two_level`: a root over about sqrt(C) clusters."""
    c = check_int(num_classes, "num_classes", 1)
    k = math.isqrt(c)
    if k * k < c:
        k += 1
    if counts is None:
        members = np.arange(c, dtype=np.int64)
        base, extra = divmod(c, k)
        sizes = np.full(k, base, np.int64)
        sizes[:extra] += 1
    else:
        w = counts_array(counts)
        if w.size != c:
            raise ValueError(f"counts has {w.size} entries, expected num_classes = {c}")
        # Stable descending sort: negate floats (no overflow, unlike ints).
        w = w.astype(np.float64)
        members = np.argsort(-w, kind="stable")
        sizes = _mass_cuts(w[members], k, 2 * (-(-c // k)))
    n_clusters = sizes.size
    child_begin = np.concatenate([[0, n_clusters], n_clusters + np.cumsum(sizes)])
    slot_child = np.concatenate(
        [c + np.arange(1, n_clusters + 1, dtype=np.int64), members])
    return child_begin, slot_child, c


def _mass_cuts(sorted_w, k, cap):
    """Cuts weights (sorted decreasing) into consecutive, roughly equal-mass runs.

    Each cut aims at (mass still unassigned) / (clusters still to fill), rounded
    to the nearer class boundary, so early heavy classes do not use up the
    cluster budget; runs are never empty and never longer than `cap`. Once the
    remaining mass is zero, the remaining classes are split evenly. One
    searchsorted per cluster: about sqrt(C) cheap Python iterations.

    Args:
      sorted_w: float64 [C], nonincreasing, non-negative.
      k: target number of clusters.
      cap: maximum cluster size.

    Returns:
      int64 array of cluster sizes, summing to C.
    """
    c = sorted_w.size
    cum = np.cumsum(sorted_w)
    total = float(cum[-1])
    sizes = []
    start = 0
    while start < c:
        left = max(k - len(sizes), 1)
        base = float(cum[start - 1]) if start else 0.0
        rest = total - base
        if rest > 0:
            target = base + rest / left
            i = min(int(np.searchsorted(cum, target, side="left")), c - 1)
            end = i + 1
            if i > start and cum[i] - target > target - cum[i - 1]:
                end = i  # the cut before class i is closer to the target
        else:
            end = start - (-(c - start) // left)
        end = min(max(end, start + 1), start + cap, c)
        sizes.append(end - start)
        start = end
    return np.asarray(sizes, np.int64)


def huffman(counts, branching=2):
    """The layout of `Tree.huffman`: a k-ary Huffman tree of `counts` (`huffman_merges`)."""
    k = check_int(branching, "branching", 2)
    w = counts_array(counts)
    n = w.size
    if n == 1:
        return [0, 1], [0], 1

    order = np.argsort(w, kind="stable")  # leaf queue: by (count, class id)
    first, merged_w, batches = huffman_merges(w[order], k)
    m = merged_w.size
    s = n + m - 1
    # `stream` lists the items in the order they are consumed by merges:
    # merge u consumes stream[first + k*(u-1) : first + k*u] (merge 0 takes
    # the first `first` items), so it directly is the children CSR in
    # creation order. Merged node u is coded n + u.
    stream = np.empty(s, np.int64)
    stream[:first] = order[:first]
    out = first
    for _, groups, is_leaf, index in batches:
        take = groups * k
        if is_leaf is True:
            codes = order[index]
        elif is_leaf is False:
            codes = n + np.arange(index.start, index.stop, dtype=np.int64)
        else:
            codes = np.where(is_leaf, order[np.where(is_leaf, index, 0)], n + index)
        stream[out:out + take] = codes
        out += take
    assert out == s, (out, s)  # every item but the root consumed exactly once

    node_begin = np.empty(m + 1, np.int64)
    node_begin[0] = 0
    node_begin[1:] = first + k * np.arange(m, dtype=np.int64)
    child_begin, slot_child, _ = bfs_layout(n, node_begin, stream, m - 1)
    return child_begin, slot_child, n


def huffman_merges(leaf_w, k):
    """The merges of a k-ary Huffman tree over leaf weights sorted ascending, shared by
    the builder (`huffman`) and the planner, which prices the tree from its merges
    without building it (`tf_hsm.planning.tree_work.huffman_work`).

    The O(C) two-queue method, run in batches: all items not heavier than the next
    merged node are grouped in one vectorized step, so the Python loop runs about once
    per "weight doubling", not once per merge. Merge 0 takes the `first` lightest leaves
    (first = 2 + (C - 2) mod (k - 1), so that every later merge takes exactly k items).

    Returns:
      (first, merged_w, batches): `merged_w[u]` is merged node u's weight (the last one
      the root's), filled in as `batches` is consumed. Each batch is `(start, groups,
      is_leaf, index)`: it makes merged nodes start .. start + groups - 1 from the next
      groups * k items in the order they are consumed (k a node); an item is a leaf
      (`index`: its position in `leaf_w`) or an earlier merged node (`index`: its
      number). `is_leaf` is True or False when all the batch's items are of one kind,
      `index` then a slice; otherwise a mask, and `index` an array.
    """
    n = leaf_w.size
    first = 2 + (n - 2) % (k - 1)
    m = 1 + (n - first) // (k - 1)  # number of merges = internal nodes
    merged_w = np.empty(m, leaf_w.dtype)  # queue 2, nondecreasing by construction
    merged_w[0] = leaf_w[:first].sum()
    return first, merged_w, _merge_batches(leaf_w, k, first, merged_w)


def group_sums(values, groups, k, out):
    """`out[g] = values[g*k:(g+1)*k].sum()`: for k=2 one strided add (the same sums)."""
    if k == 2:
        np.add(values[0::2], values[1::2], out=out)
    else:
        out[:] = values.reshape(groups, k).sum(axis=1)


def _merge_batches(leaf_w, k, first, merged_w):
    m = merged_w.size
    li, qi, qn = first, 0, 1  # heads of both queues, tail of the merged one
    while qn < m:
        # Weight of the next merged node = sum of the k smallest items.
        head = np.concatenate((leaf_w[li:li + k], merged_w[qi:min(qi + k, qn)]))
        head.sort()
        w0 = head[:k].sum()
        # Every item not heavier than w0 is consumed before any node merged
        # in this batch (ties: leaves first, older merged nodes first), so
        # these items can be grouped k at a time in sorted order at once.
        la = li + int(np.searchsorted(leaf_w[li:], w0, side="right"))
        qa = qi + int(np.searchsorted(merged_w[qi:qn], w0, side="right"))
        n_leaf, n_merged = la - li, qa - qi
        groups = min((n_leaf + n_merged) // k, m - qn)
        # The k items summed into w0 are all <= w0 (non-negative weights),
        # so a batch always makes progress; guard against an endless loop.
        assert groups > 0, "Huffman batch made no progress"
        take = groups * k
        if n_merged == 0:
            is_leaf, index, used_leaves = True, slice(li, li + take), take
            sel_w = leaf_w[index]
        elif n_leaf == 0:
            is_leaf, index, used_leaves = False, slice(qi, qi + take), 0
            sel_w = merged_w[index]
        else:
            cand = np.concatenate((leaf_w[li:la], merged_w[qi:qa]))
            # Stable sort of two sorted runs (timsort: linear); leaves come
            # first on ties because they are first in `cand`.
            sel = np.argsort(cand, kind="stable")[:take]
            sel_w = cand[sel]
            is_leaf = sel < n_leaf
            index = np.where(is_leaf, li + sel, qi + (sel - n_leaf))
            used_leaves = int(np.count_nonzero(is_leaf))
        group_sums(sel_w, groups, k, merged_w[qn:qn + groups])
        yield qn, groups, is_leaf, index
        li += used_leaves
        qi += take - used_leaves
        qn += groups
