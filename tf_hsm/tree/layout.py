"""The flat tree layout: validating a BFS layout and deriving every other array from it.

`derive_layout` is the one place a layout is checked; every builder and loader ends
there (through ``Tree._from_layout``). The contract itself is described in
docs/design.md ("Tree layout contract") and in the `tf_hsm.tree` module docstring.
"""

from __future__ import annotations

import typing

import numpy as np

from tf_hsm.tree.checks import check_int, int_array


class Layout(typing.NamedTuple):
    """Every array of a tree (all read-only int64), as `derive_layout` returns them."""

    num_classes: int
    child_begin: np.ndarray
    slot_child: np.ndarray
    slot_node: np.ndarray
    node_slot: np.ndarray
    class_slot: np.ndarray
    node_depth: np.ndarray
    path_begin: np.ndarray
    path_nodes: np.ndarray
    path_slots: np.ndarray
    class_depth: np.ndarray


def concat_ranges(starts, lengths):
    """Returns the concatenation of ``arange(s, s + n)`` for each (s, n) pair.

    The vectorized building block for "all children of these nodes" and "all
    steps of these paths": one `np.repeat` instead of a Python loop.

    Args:
      starts: int64 array of range starts.
      lengths: int64 array of non-negative range lengths, same shape.

    Returns:
      An int64 array of length ``lengths.sum()``.
    """
    total = int(lengths.sum())
    out = np.arange(total, dtype=np.int64)
    if total:
        # Element t of range i sits at output offset(i) + t and must become
        # starts[i] + t: shift every element by starts[i] - offset(i).
        offsets = np.cumsum(lengths) - lengths
        out += np.repeat(starts - offsets, lengths)
    return out


def bfs_layout(num_classes, node_begin, node_codes, root):
    """Renumbers an arbitrarily numbered tree into the BFS layout.

    Builders that create internal nodes in some other order (Huffman creates
    them bottom-up, `from_parents` takes the caller's numbering) describe the
    tree in CSR form with their own node ids; this walks it level by level from
    the root with whole-level NumPy operations, so the Python loop runs once
    per level, not once per node.

    Args:
      num_classes: C.
      node_begin: int64 [M+1]; children of (caller's) node u are
        ``node_codes[node_begin[u]:node_begin[u+1]]``, in child order.
      node_codes: int64 [S]; a class c as c, the caller's node u as C + u.
        Every non-root node must appear exactly once and the root never.
      root: the caller's id of the root.

    Returns:
      ``(child_begin, slot_child, unreachable)``: the BFS layout, and the
      caller's ids of internal nodes not reachable from the root (they sit on
      cycles); the layout is only meaningful when `unreachable` is empty.
    """
    c = num_classes
    m = node_begin.size - 1
    new_id = np.full(m, -1, np.int64)
    new_id[root] = 0
    level = np.array([root], np.int64)
    sizes_parts, codes_parts = [], []
    next_id = 1
    while level.size:
        starts = node_begin[level]
        lengths = node_begin[level + 1] - starts
        codes = node_codes[concat_ranges(starts, lengths)]
        kids = codes[codes >= c] - c
        if (new_id[kids] >= 0).any():
            # Only reachable when a caller breaks the "one parent" precondition;
            # without this guard a cycle through the root would loop forever.
            raise ValueError("internal node reached twice: the input is not a tree")
        # BFS numbering = order of first appearance among the children of the
        # previous level, which is exactly the order of `kids`.
        new_id[kids] = np.arange(next_id, next_id + kids.size)
        next_id += kids.size
        sizes_parts.append(lengths)
        codes_parts.append(codes)
        level = kids
    unreachable = np.flatnonzero(new_id < 0)
    if unreachable.size:
        return None, None, unreachable
    child_begin = np.zeros(m + 1, np.int64)
    np.cumsum(np.concatenate(sizes_parts), out=child_begin[1:])
    slot_child = np.concatenate(codes_parts)
    internal = slot_child >= c
    slot_child[internal] = c + new_id[slot_child[internal] - c]
    return child_begin, slot_child, unreachable


def _derive_paths(level_start, node_parent, node_slot, slot_node, class_node,
                  class_slot, class_depth, path_begin):
    """Computes the per-class path arrays, top-down one tree level at a time.

    Writing paths by climbing from every class at once scatters each step over
    the whole path array (a cache miss per step: several seconds for 2M
    Huffman classes). Instead, the paths from the root to all nodes of a level are kept
    as one dense [nodes, depth] block (BFS makes a level contiguous and a
    parent's row is one row of the previous block); a class's path is its
    parent's row plus one step, so each class's path is written as one
    contiguous row, and classes are written in increasing order. Only slots
    are carried; the nodes are one gather at the end (a slot's owner).

    Args:
      level_start: Python list; level d holds nodes level_start[d] ..
        level_start[d+1]-1.
      node_parent: [M-1] parent of nodes 1..M-1 (nondecreasing).
      node_slot: [M] slot leading to each node.
      slot_node: [S] owner of each slot.
      class_node: [C] parent node of each class.
      class_slot: [C] slot leading to each class.
      class_depth: [C] path lengths.
      path_begin: [C+1] CSR offsets.

    Returns:
      ``(path_nodes, path_slots)``, int64 arrays [P].
    """
    c = class_node.size
    n_levels = len(level_start) - 1
    num_steps = int(path_begin[-1])
    path_nodes = np.empty(num_steps, np.int64)
    path_slots = np.empty(num_steps, np.int64)
    uniform = bool(class_depth.min() == class_depth.max())
    if not uniform:
        # Classes grouped by depth, in class order within a group (stable),
        # so that each group's rows are written in increasing position order.
        # A narrow key lets NumPy radix-sort.
        key = class_depth.astype(np.uint8 if n_levels < 1 << 8 else
                                 np.uint16 if n_levels < 1 << 16 else np.int64)
        by_depth = np.argsort(key, kind="stable")
        del key
        group_start = np.zeros(n_levels + 2, np.int64)
        np.cumsum(np.bincount(class_depth, minlength=n_levels + 1), out=group_start[1:])
    anc_slots = np.empty((1, 0), np.int64)  # row i: slots to node level_start[d] + i
    for d in range(n_levels):
        lo, hi = level_start[d], level_start[d + 1]
        if d:
            rows = node_parent[lo - 1:hi - 1] - level_start[d - 1]
            new_slots = np.empty((hi - lo, d), np.int64)
            new_slots[:, :d - 1] = anc_slots[rows]
            new_slots[:, d - 1] = node_slot[lo:hi]
            anc_slots = new_slots
            del new_slots, rows
        if uniform:
            if class_depth[0] != d + 1:
                continue
            classes = slice(None)
            k = c
        else:
            classes = by_depth[group_start[d + 1]:group_start[d + 2]]
            k = classes.size
            if k == 0:
                continue
        rows = class_node[classes] - lo
        # When every class has this depth, the rows are back to back in
        # path_slots: fill it in place through a 2-D view.
        block = (path_slots.reshape(k, d + 1) if uniform
                 else np.empty((k, d + 1), np.int64))
        block[:, :d] = anc_slots[rows]
        block[:, d] = class_slot[classes]
        del rows
        if not uniform:
            # Row i goes to path_begin[class i] + 0..d (all rows have length d+1).
            at = path_begin[classes][:, None] + np.arange(d + 1, dtype=np.int64)
            path_slots[at] = block
            del at
        del block
    np.take(slot_node, path_slots, out=path_nodes)
    return path_nodes, path_slots


def _freeze(*arrays):
    # Kernels and users share these arrays; read-only stops a caller from
    # silently corrupting a tree that other ops still hold.
    for arr in arrays:
        arr.flags.writeable = False


def derive_layout(child_begin, slot_child, num_classes):
    """Validates a BFS layout and derives every other array from it.

    Args:
      child_begin: int array [M+1], 0 first, strictly increasing, last S.
      slot_child: int array [S], S = C + M - 1; a permutation of the codes
        ``0..C+M-1`` without the root code C, in which the internal codes
        appear in increasing order (BFS numbering).
      num_classes: C >= 1.

    Returns:
      A `Layout` of fresh, read-only arrays (the caller's arrays are copied,
      never frozen).

    Raises:
      ValueError: naming the first violated condition.
    """
    c = check_int(num_classes, "num_classes", 1)
    child_begin = int_array(child_begin, "child_begin", copy=True)
    slot_child = int_array(slot_child, "slot_child", copy=True)

    # ---- validation: structure of child_begin --------------------------
    if child_begin.size < 2:
        raise ValueError("child_begin needs at least 2 entries: a tree has a root")
    m = child_begin.size - 1
    s = c + m - 1
    if child_begin[0] != 0:
        raise ValueError(f"child_begin[0] must be 0, got {child_begin[0]}")
    sizes = np.diff(child_begin)
    if (sizes <= 0).any():
        bad = int(np.flatnonzero(sizes <= 0)[0])
        raise ValueError(
            f"internal node {bad} has no children (child_begin must be "
            f"strictly increasing, got child_begin[{bad}:{bad + 2}] = "
            f"{child_begin[bad:bad + 2].tolist()})")
    if child_begin[-1] != s:
        raise ValueError(
            f"child_begin[-1] = {child_begin[-1]}, but a tree with {c} classes "
            f"and {m} internal nodes has C + M - 1 = {s} slots")
    if slot_child.size != s:
        raise ValueError(f"slot_child has {slot_child.size} entries, expected {s}")

    # ---- validation: every class and non-root node is a child once -----
    out_of_range = (slot_child < 0) | (slot_child >= c + m)
    if out_of_range.any():
        bad = int(np.flatnonzero(out_of_range)[0])
        raise ValueError(
            f"slot_child[{bad}] = {slot_child[bad]} is outside [0, C + M) = "
            f"[0, {c + m})")
    counts = np.bincount(slot_child, minlength=c + m)
    if counts[c]:
        raise ValueError(f"the root (code {c}) appears as a child in slot_child")
    if (counts > 1).any():
        bad = int(np.flatnonzero(counts > 1)[0])
        what = f"class {bad}" if bad < c else f"internal node {bad - c}"
        raise ValueError(f"{what} is the child of {counts[bad]} slots")
    del counts  # with S = C+M-1 codes, no duplicates and no root: a permutation

    # ---- validation: BFS numbering --------------------------------------
    internal_slots = np.flatnonzero(slot_child >= c)
    if not np.array_equal(slot_child[internal_slots], np.arange(c + 1, c + m)):
        raise ValueError(
            "internal nodes are not numbered in BFS order: their codes must "
            "appear in slot_child as C+1, C+2, ..., C+M-1, in that order")
    slot_node = np.repeat(np.arange(m, dtype=np.int64), sizes)
    node_parent = slot_node[internal_slots]  # parent of nodes 1..M-1
    # A node's parent must come before it, otherwise BFS would number the
    # node before reaching it (this also rules out cycles such as a node
    # that is its own child).
    late = node_parent >= np.arange(1, m)
    if late.any():
        bad = int(np.flatnonzero(late)[0]) + 1
        raise ValueError(
            f"internal node {bad} is a child of node {node_parent[bad - 1]}, "
            "which is not numbered before it (not BFS order, or a cycle)")

    # ---- derived arrays -------------------------------------------------
    node_slot = np.empty(m, np.int64)
    node_slot[0] = -1
    node_slot[1:] = internal_slots
    del internal_slots
    leaf_slots = np.flatnonzero(slot_child < c)
    class_slot = np.empty(c, np.int64)
    class_slot[slot_child[leaf_slots]] = leaf_slots
    del leaf_slots

    # In BFS order each level is a contiguous node range and node_parent is
    # nondecreasing, so the next level ends right after the last node whose
    # parent lies in the current one: one searchsorted per level.
    node_depth = np.empty(m, np.int64)
    level_start = [0]  # level d is nodes level_start[d] .. level_start[d+1]-1
    lo, hi = 0, 1
    while lo < m:
        node_depth[lo:hi] = len(level_start) - 1
        level_start.append(hi)
        lo, hi = hi, 1 + int(np.searchsorted(node_parent, hi))

    class_node = slot_node[class_slot]
    class_depth = node_depth[class_node] + 1
    path_begin = np.zeros(c + 1, np.int64)
    np.cumsum(class_depth, out=path_begin[1:])
    path_nodes, path_slots = _derive_paths(
        level_start, node_parent, node_slot, slot_node, class_node,
        class_slot, class_depth, path_begin)
    del class_node, node_parent

    _freeze(child_begin, slot_child, slot_node, node_slot, class_slot,
            node_depth, path_begin, path_nodes, path_slots, class_depth)
    return Layout(c, child_begin, slot_child, slot_node, node_slot, class_slot,
                  node_depth, path_begin, path_nodes, path_slots, class_depth)
