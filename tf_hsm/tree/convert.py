"""Builders that convert a tree given in another form into the BFS layout.

The forms are a parent array, per-class child-position paths and nested lists.
Each function validates its input and returns ``(child_begin, slot_child,
num_classes)``, which ``Tree._from_layout`` then validates and completes; the
matching `Tree` classmethods document the conventions and errors.
"""

from __future__ import annotations

import itertools

import numpy as np

from tf_hsm.tree.checks import check_int, int_array
from tf_hsm.tree.layout import bfs_layout


def from_parents(parents, num_classes=None):
    """The layout of `Tree.from_parents`: caller's nodes renumbered breadth-first."""
    parents = int_array(parents, "parents")
    n = parents.size
    if n < 2:
        raise ValueError(
            f"parents has {n} entries; a tree needs at least one class and a root")
    has_parent = parents >= 0
    if num_classes is None:
        if not has_parent.any():
            raise ValueError("no entry of parents has a parent: no classes")
        c = int(parents[has_parent].min())
        if c < 1:
            raise ValueError(
                "the smallest parent index is 0, which leaves no classes; "
                "parents must point at internal nodes, entries >= num_classes")
    else:
        c = check_int(num_classes, "num_classes", 1)
        if c >= n:
            raise ValueError(
                f"num_classes = {c} leaves no internal nodes in {n} entries")
    m = n - c

    bad = np.flatnonzero((parents < -1) | (parents >= n))
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"parents[{i}] = {parents[i]} is out of range: must be -1 (root) or "
            f"an internal node index in [{c}, {n})")
    bad = np.flatnonzero(has_parent & (parents < c))
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"parents[{i}] = {parents[i]} is a class; parents must be internal "
            f"nodes, indices in [{c}, {n})")
    bad = np.flatnonzero(~has_parent[:c])
    if bad.size:
        raise ValueError(
            f"class {int(bad[0])} has parent -1; only an internal node can be the root")
    roots = c + np.flatnonzero(~has_parent[c:])
    if roots.size == 0:
        raise ValueError("no root: no internal node has parent -1")
    if roots.size > 1:
        raise ValueError(
            f"several roots (parent -1): entries {roots[:10].tolist()}"
            + (" ..." if roots.size > 10 else ""))

    child = np.flatnonzero(has_parent)  # entry index == child code
    owner = parents[child] - c  # caller's internal node id, 0..M-1
    n_children = np.bincount(owner, minlength=m)
    if (n_children == 0).any():
        i = c + int(np.flatnonzero(n_children == 0)[0])
        raise ValueError(f"internal node at entry {i} has no children")
    # Counting order by owner; stable keeps increasing entry index within a
    # node. A narrow key dtype lets NumPy use radix sort instead of timsort.
    key = owner.astype(np.uint16 if m <= 1 << 16 else
                       np.uint32 if m <= 1 << 32 else np.int64)
    child = child[np.argsort(key, kind="stable")]
    del owner, key
    node_begin = np.zeros(m + 1, np.int64)
    np.cumsum(n_children, out=node_begin[1:])
    child_begin, slot_child, unreachable = bfs_layout(
        c, node_begin, child, int(roots[0]) - c)
    if unreachable.size:
        raise ValueError(
            f"{unreachable.size} internal node(s) are not reachable from the root "
            f"(they form a cycle): entries {(c + unreachable[:10]).tolist()}"
            + (" ..." if unreachable.size > 10 else ""))
    return child_begin, slot_child, c


def from_paths(paths):
    """The layout of `Tree.from_paths`: the trie of the paths, one level at a time."""
    if isinstance(paths, np.ndarray) and paths.ndim == 2:
        c, width = paths.shape
        lengths = np.full(c, width, np.int64)
        flat = paths.reshape(-1)
        if flat.dtype.kind not in "iu" and flat.size:
            raise ValueError(f"paths must hold integers, got dtype {paths.dtype}")
        flat = flat.astype(np.int64)
    else:
        try:
            paths = [p if isinstance(p, np.ndarray) else list(p) for p in paths]
        except TypeError:
            raise ValueError("paths must be a sequence of integer sequences") from None
        c = len(paths)
        lengths = np.fromiter((len(p) for p in paths), np.int64, count=c)
        flat = int_array(list(itertools.chain.from_iterable(paths)), "paths")
    if c == 0:
        raise ValueError("paths is empty: a tree needs at least one class")
    if (lengths == 0).any():
        raise ValueError(f"class {int(np.flatnonzero(lengths == 0)[0])} has an empty path")
    offsets = np.zeros(c + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])

    def owner_of(flat_index):
        cls_ = int(np.searchsorted(offsets, flat_index, side="right")) - 1
        return cls_, int(flat_index - offsets[cls_])

    if (flat < 0).any():
        cl, step = owner_of(np.flatnonzero(flat < 0)[0])
        raise ValueError(
            f"path of class {cl} has a negative position {flat[offsets[cl] + step]} "
            f"at step {step}")
    # A node has at most C children, so a position >= C must leave a gap;
    # rejecting it here also keeps the (node, position) keys below small.
    if (flat >= c).any():
        cl, step = owner_of(np.flatnonzero(flat >= c)[0])
        raise ValueError(
            f"path of class {cl} has position {flat[offsets[cl] + step]} at step "
            f"{step}, but that node's child positions must be 0..k-1 with no "
            f"gaps, and there are only {c} classes")

    active = np.arange(c, dtype=np.int64)  # classes whose path goes deeper
    cur = np.zeros(c, np.int64)  # their current internal node (BFS id)
    sizes_parts, codes_parts = [], []
    lo, hi, depth = 0, 1, 0  # nodes of the current level are lo..hi-1
    while active.size:
        pos = flat[offsets[active] + depth]
        ends = lengths[active] == depth + 1
        # Sorting the (node, position) keys of one level lists its slots in
        # BFS slot order: by node, then by position.
        uniq, inv = np.unique((cur - lo) * c + pos, return_inverse=True)
        inv = inv.reshape(-1)
        n_end = np.bincount(inv[ends], minlength=uniq.size)
        n_go = np.bincount(inv[~ends], minlength=uniq.size)
        if (n_end > 1).any():
            u = int(np.flatnonzero(n_end > 1)[0])
            a, b = active[ends & (inv == u)][:2].tolist()
            raise ValueError(f"classes {a} and {b} have the same path")
        clash = (n_end == 1) & (n_go > 0)
        if clash.any():
            u = int(np.flatnonzero(clash)[0])
            a = int(active[ends & (inv == u)][0])
            b = int(active[~ends & (inv == u)][0])
            raise ValueError(
                f"path of class {a} is a prefix of the path of class {b} "
                "(a leaf cannot also be an internal node)")
        unode = uniq // c  # relative to lo
        upos = uniq % c
        per_node = np.bincount(unode, minlength=hi - lo)
        last_pos = upos[np.cumsum(per_node) - 1]
        gap = last_pos + 1 != per_node
        if gap.any():
            g = int(np.flatnonzero(gap)[0])
            cl = int(active[cur == lo + g][0])
            prefix = flat[offsets[cl]:offsets[cl] + depth].tolist()
            used = upos[unode == g].tolist()
            raise ValueError(
                f"the node at path prefix {prefix} has child positions {used[:20]}"
                f"{' ...' if len(used) > 20 else ''}, which are not 0..k-1 "
                "without gaps")
        internal = n_go > 0
        n_new = int(np.count_nonzero(internal))
        codes = np.empty(uniq.size, np.int64)
        codes[inv[ends]] = active[ends]
        codes[internal] = c + hi + np.arange(n_new, dtype=np.int64)
        sizes_parts.append(per_node)
        codes_parts.append(codes)
        go = ~ends
        active = active[go]
        cur = codes[inv[go]] - c
        lo, hi, depth = hi, hi + n_new, depth + 1
    child_begin = np.zeros(hi + 1, np.int64)
    np.cumsum(np.concatenate(sizes_parts), out=child_begin[1:])
    return child_begin, np.concatenate(codes_parts), c


def from_nested(nested):
    """The layout of `Tree.from_nested`: a breadth-first walk of the lists."""
    if not isinstance(nested, (list, tuple)):
        raise ValueError(
            f"nested must be a list or tuple (the root), got {type(nested).__name__}")
    # Breadth-first walk: appending each sub-list to the queue as it is met
    # numbers the internal nodes in BFS order directly.
    queue = [nested]
    seen = {id(nested)}
    sizes = []
    codes = []  # class ids >= 0; internal node m stored as -m until C is known
    head = 0
    while head < len(queue):
        node = queue[head]
        if not node:
            raise ValueError(f"internal node {head} is an empty list: no children")
        sizes.append(len(node))
        for entry in node:
            if isinstance(entry, (list, tuple)):
                if id(entry) in seen:
                    raise ValueError(
                        "the same list object appears twice in nested (or contains "
                        "itself); every node needs its own list")
                seen.add(id(entry))
                queue.append(entry)
                codes.append(-(len(queue) - 1))
            elif isinstance(entry, (int, np.integer)) and not isinstance(
                    entry, (bool, np.bool_)):
                if entry < 0:
                    raise ValueError(f"class {entry} is negative")
                if entry >= 2**63:
                    raise ValueError(f"class {entry} does not fit in int64")
                codes.append(int(entry))
            else:
                raise ValueError(
                    f"entries must be ints (classes) or lists/tuples (nodes), got "
                    f"{entry!r} of type {type(entry).__name__}")
        head += 1
    codes = np.asarray(codes, np.int64)
    leaves = codes[codes >= 0]
    c = leaves.size
    if c == 0:
        raise ValueError("nested holds no classes")
    present = np.bincount(leaves, minlength=c)
    if present.size > c:  # some id >= C, so some id below C is missing
        missing = np.flatnonzero(present[:c] == 0)
        raise ValueError(
            f"classes must be exactly 0..C-1 for C = {c} leaves; class "
            f"{int(np.flatnonzero(present[c:])[0]) + c} is out of range"
            + (f" and class {int(missing[0])} is missing" if missing.size else ""))
    if (present > 1).any():
        raise ValueError(f"class {int(np.flatnonzero(present > 1)[0])} appears more than once")
    codes = np.where(codes >= 0, codes, c - codes)
    child_begin = np.concatenate([[0], np.cumsum(sizes)])
    return child_begin, codes, c
