"""Class trees for hierarchical softmax, in the flat layout that the kernels read.

A `Tree` puts the classes ``0..C-1`` at the leaves of a rooted tree whose internal
nodes are ``0..M-1`` (root ``0``). Every edge of the tree is a *slot*: one row of
the weight table. The kernels never walk pointers; they read a handful of flat
int64 arrays (CSR style), described in DESIGN.md ("Tree layout contract"):

* ``child_begin[M+1]``: the children of internal node ``n`` occupy the slots
  ``child_begin[n] .. child_begin[n+1]-1``, in child order.
* ``slot_child[S]``: the child behind each slot; class ``c`` is coded as ``c``
  and internal node ``m`` as ``C + m``.
* ``path_begin[C+1]``, ``path_nodes[P]``, ``path_slots[P]``: the root-to-leaf
  path of every class, as (node, slot) steps in CSR form.
* ``slot_node[S]``, ``node_slot[M]``, ``class_slot[C]``, ``node_depth[M]``.

Internal nodes are numbered in breadth-first order, children keeping their order,
so a node's number is the order in which it appears in ``slot_child``. The whole
layout therefore follows from ``child_begin``, ``slot_child`` and ``C``: that is
all `Tree.save` stores, and every builder goes through one validating constructor
(`Tree._from_layout`) that derives the rest with vectorized NumPy.

This module depends on NumPy only, so trees can be built, inspected and saved on
machines without TensorFlow.
"""

from __future__ import annotations

import base64
import binascii
import collections.abc
import itertools
import math
import operator
import os
import zipfile
import zlib

import numpy as np

__all__ = ["Tree"]

# Written into every saved file; `Tree.load` refuses files without them, so a
# foreign .npz fails with a clear message instead of a confusing layout error.
_FORMAT_NAME = "tf_hsm.Tree"
_FORMAT_VERSION = 1

_INT64_MAX = np.iinfo(np.int64).max

# How `get_config` writes the layout arrays: differences of consecutive entries
# (most are 1 or small in every builder's trees) as little-endian int64, deflated,
# in base64. A JSON list of a 10M-class tree is ~90 MB and millions of Python ints
# that Keras walks one by one when it loads a layer; this string is ~0.2 MB.
_CONFIG_ENCODING = "int64-delta-zlib-base64"


# --------------------------------------------------------------------------- #
# Small helpers
# --------------------------------------------------------------------------- #


def _check_int(value, name, minimum=None):
    """Returns `value` as a Python int, or raises ValueError.

    Args:
      value: anything; Python and NumPy integers are accepted, bools are not
        (``True`` as a class count is almost certainly a bug).
      name: what to call the value in the error message.
      minimum: smallest allowed value, or None.

    Returns:
      The value as a Python int.

    Raises:
      ValueError: if `value` is not an integer or is below `minimum`.
    """
    if isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    try:
        result = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None
    if minimum is not None and result < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {result}")
    return result


def _encode_ints(values):
    """An int64 array as the `_CONFIG_ENCODING` string."""
    deltas = np.diff(np.asarray(values, np.int64), prepend=np.int64(0))
    return base64.b64encode(zlib.compress(deltas.astype("<i8").tobytes(), 6)).decode("ascii")


def _decode_ints(text, name):
    """Inverse of `_encode_ints`; ValueError naming `name` if `text` is not one."""
    if not isinstance(text, str):
        raise ValueError(f"tree config's {name} must be a string in the "
                         f"{_CONFIG_ENCODING!r} encoding, got {type(text).__name__}")
    try:
        raw = zlib.decompress(base64.b64decode(text.encode("ascii"), validate=True))
    except (binascii.Error, UnicodeEncodeError, zlib.error) as e:
        raise ValueError(f"tree config's {name} is corrupt: {e}") from None
    if len(raw) % 8:
        raise ValueError(f"tree config's {name} is corrupt: {len(raw)} bytes is not "
                         "a whole number of int64 values")
    # Wrapping int64 sums undo wrapping differences, so every int64 array round-trips.
    return np.cumsum(np.frombuffer(raw, "<i8"), dtype=np.int64)


def _int_array(values, name, copy=False):
    """Converts `values` to a 1-D int64 array, or raises ValueError.

    Args:
      values: array-like of integers.
      name: what to call it in error messages.
      copy: always return a fresh array (needed before freezing it, so that a
        caller's own array is never made read-only behind its back).

    Returns:
      A 1-D int64 NumPy array.

    Raises:
      ValueError: if `values` is not 1-D or does not hold integers.
    """
    try:
        arr = np.asarray(values)
    except (TypeError, ValueError) as e:  # ragged nesting and the like
        raise ValueError(f"{name} must be a 1-D array of integers: {e}") from None
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        # np.asarray([]) is float64; an empty list is still a valid int array.
        if arr.size == 0:
            return np.zeros(0, np.int64)
        raise ValueError(f"{name} must hold integers, got dtype {arr.dtype}")
    if arr.dtype.kind == "u" and arr.size and arr.max() > _INT64_MAX:
        raise ValueError(f"{name} has values beyond the int64 range")
    return np.array(arr, dtype=np.int64, copy=True) if copy else arr.astype(np.int64, copy=False)


def _counts_array(counts, name="counts"):
    """Validates class counts: 1-D, non-empty, finite and non-negative.

    Integer counts stay int64 so that sums and ties are exact (Huffman's
    tie-breaking must be deterministic); they fall back to float64 only when an
    int64 sum of all of them could overflow. Other real counts become float64.

    Args:
      counts: array-like of non-negative numbers (frequencies or probabilities).
      name: what to call it in error messages.

    Returns:
      A 1-D int64 or float64 array.

    Raises:
      ValueError: if the counts are not a non-empty 1-D array of finite,
        non-negative numbers.
    """
    try:
        arr = np.asarray(counts)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{name} must be a 1-D array of numbers: {e}") from None
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        raise ValueError(f"{name} is empty: a tree needs at least one class")
    if arr.dtype.kind in "iu":
        if arr.dtype.kind == "i" and arr.min() < 0:
            bad = int(np.flatnonzero(arr < 0)[0])
            raise ValueError(f"{name}[{bad}] = {arr[bad]} is negative")
        # An upper bound on any partial sum; past 2^62 we give up exactness.
        if float(arr.max()) * arr.size >= 2.0**62:
            return arr.astype(np.float64)
        return arr.astype(np.int64, copy=False)
    if arr.dtype.kind != "f":
        raise ValueError(f"{name} must hold real numbers, got dtype {arr.dtype}")
    arr = arr.astype(np.float64, copy=False)
    if not np.isfinite(arr).all():
        bad = int(np.flatnonzero(~np.isfinite(arr))[0])
        raise ValueError(f"{name}[{bad}] = {arr[bad]} is not finite")
    if arr.min() < 0:
        bad = int(np.flatnonzero(arr < 0)[0])
        raise ValueError(f"{name}[{bad}] = {arr[bad]} is negative")
    return arr


def _concat_ranges(starts, lengths):
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


def _bfs_layout(num_classes, node_begin, node_codes, root):
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
        codes = node_codes[_concat_ranges(starts, lengths)]
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


def _tree_from_layout(child_begin, slot_child, num_classes):
    # Module-level so that pickle can find it; rebuilds (and re-validates) a
    # tree from its three defining fields.
    return Tree._from_layout(child_begin, slot_child, num_classes)


# --------------------------------------------------------------------------- #
# The tree
# --------------------------------------------------------------------------- #


class Tree:
    """A class tree for hierarchical softmax, stored as flat int64 arrays.

    Build one with a classmethod (`balanced`, `two_level`, `huffman`,
    `from_parents`, `from_paths`, `from_nested`, `load`); the constructor itself
    is not public, so that every tree passes the same validation.

    Classes ``0..C-1`` are the leaves, internal nodes ``0..M-1`` are numbered in
    breadth-first order from the root ``0``, and every edge is a weight-table row
    ("slot"): ``num_slots = C + M - 1``. A node may mix leaves and internal
    children and may have a single child. All arrays below are read-only int64.

    Attributes:
      child_begin: [M+1] CSR offsets; node n owns slots
        ``child_begin[n] .. child_begin[n+1]-1``.
      slot_child: [S] child at each slot: class c as c, internal node m as C+m.
      slot_node: [S] the internal node that owns each slot.
      node_slot: [M] the slot whose child is node m (-1 for the root).
      class_slot: [C] the slot whose child is class c.
      node_depth: [M] depth of each internal node (root 0).
      path_begin: [C+1] CSR offsets into `path_nodes` / `path_slots`.
      path_nodes: [P] internal node visited at each path step, root first.
      path_slots: [P] slot taken at each path step; it lies in the slot range
        of the matching `path_nodes` entry, and the last slot of class c's path
        has child c.
    """

    def __init__(self, *args, **kwargs):
        del args, kwargs
        raise TypeError(
            "Tree has no public constructor; use Tree.balanced, Tree.two_level, "
            "Tree.huffman, Tree.from_parents, Tree.from_paths, Tree.from_nested "
            "or Tree.load")

    # ------------------------------------------------------------------ #
    # The one real constructor
    # ------------------------------------------------------------------ #

    @classmethod
    def _from_layout(cls, child_begin, slot_child, num_classes):
        """Validates a BFS layout and derives every other array from it.

        Args:
          child_begin: int array [M+1], 0 first, strictly increasing, last S.
          slot_child: int array [S], S = C + M - 1; a permutation of the codes
            ``0..C+M-1`` without the root code C, in which the internal codes
            appear in increasing order (BFS numbering).
          num_classes: C >= 1.

        Returns:
          A new, fully derived Tree.

        Raises:
          ValueError: naming the first violated condition.
        """
        c = _check_int(num_classes, "num_classes", 1)
        child_begin = _int_array(child_begin, "child_begin", copy=True)
        slot_child = _int_array(slot_child, "slot_child", copy=True)

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

        tree = object.__new__(cls)
        tree._num_classes = c
        tree.child_begin = child_begin
        tree.slot_child = slot_child
        tree.slot_node = slot_node
        tree.node_slot = node_slot
        tree.class_slot = class_slot
        tree.node_depth = node_depth
        tree.path_begin = path_begin
        tree.path_nodes = path_nodes
        tree.path_slots = path_slots
        tree._class_depth = class_depth
        _freeze(child_begin, slot_child, slot_node, node_slot, class_slot,
                node_depth, path_begin, path_nodes, path_slots, class_depth)
        return tree

    # ------------------------------------------------------------------ #
    # Builders
    # ------------------------------------------------------------------ #

    @classmethod
    def balanced(cls, num_classes, branching):
        """Builds a complete tree with the given branching factor.

        Consecutive classes are grouped into nodes of `branching` children,
        those nodes again into groups of `branching`, and so on until a single
        root remains; only the last node of each level may be smaller. Every
        class has the same depth ``ceil(log_branching(C))`` (at least 1).

        Args:
          num_classes: C >= 1. With C = 1 the tree is a root with one child.
          branching: children per node, >= 2.

        Returns:
          A Tree.

        Raises:
          ValueError: if num_classes < 1 or branching < 2 (or not integers).
        """
        c = _check_int(num_classes, "num_classes", 1)
        b = _check_int(branching, "branching", 2)
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
        return cls._from_layout(child_begin, np.concatenate(codes_parts), c)

    @classmethod
    def two_level(cls, num_classes, counts=None):
        """Builds a root with about sqrt(C) clusters of classes under it.

        Every class has depth 2, so a class costs about 2*sqrt(C) dot products
        instead of C.

        Without `counts`, K = ceil(sqrt(C)) clusters take consecutive classes,
        with sizes differing by at most one.

        With `counts`, classes are sorted by decreasing count (stable, so ties
        keep class order) and cut into consecutive clusters of roughly equal
        probability mass ("frequency binning"): frequent classes end up in small
        clusters, rare ones in large clusters. Each cut aims at an equal share of
        the mass still unassigned over the clusters still to fill, so a few
        very frequent classes (each heavier than 1/K of the mass) do not use up
        the budget of clusters. No cluster is empty, and no cluster gets more
        than 2*ceil(C/K) classes: without that cap the zero-count (or
        near-zero) tail of a vocabulary would pile up into one cluster with a
        large fraction of all classes, and that cluster's logsumexp would
        dominate the cost of every rare class. The cap can add clusters, so
        the count is about sqrt(C), not exactly ceil(sqrt(C)). Within a
        cluster, classes are in decreasing count order. If all counts are 0,
        the classes are treated as equally frequent.

        Args:
          num_classes: C >= 1.
          counts: optional array [C] of non-negative class frequencies.

        Returns:
          A Tree with class ids preserved (slot_child holds the original ids).

        Raises:
          ValueError: if num_classes < 1, or counts has the wrong length, is
            negative or not finite.
        """
        c = _check_int(num_classes, "num_classes", 1)
        k = math.isqrt(c)
        if k * k < c:
            k += 1
        if counts is None:
            members = np.arange(c, dtype=np.int64)
            base, extra = divmod(c, k)
            sizes = np.full(k, base, np.int64)
            sizes[:extra] += 1
        else:
            w = _counts_array(counts)
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
        return cls._from_layout(child_begin, slot_child, c)

    @classmethod
    def huffman(cls, counts, branching=2):
        """Builds a k-ary Huffman tree: minimum expected depth sum(count * depth).

        Frequent classes get short paths, so a model pays for the frequent
        classes' few dot products and rarely for the deep rare ones.

        When ``(C - 1) % (k - 1) != 0`` a full k-ary tree does not fit, and the
        classic fix pads with zero-count dummy leaves. Those would become
        weight rows and softmax terms, so instead the first merge takes only
        ``2 + (C - 2) % (k - 1)`` items (the same optimal tree, minus the dummies).

        Tie-breaking is deterministic: classes are ordered by (count, class id);
        between a class and a merged node of equal weight the class is taken
        first, merged nodes are taken in creation order. Children are ordered
        as merged (ascending weight). The construction is the O(C) two-queue
        method after one sort, run in batches: all items not heavier than the
        next merged node are grouped in one vectorized step, so the Python loop
        runs about once per "weight doubling", not once per merge.

        Args:
          counts: array [C] of non-negative class frequencies, C >= 1. With C = 1
            the tree is a root with one child.
          branching: k >= 2, the maximum number of children per node.

        Returns:
          A Tree.

        Raises:
          ValueError: if counts is empty, not 1-D, negative or not finite, or
            branching < 2.
        """
        k = _check_int(branching, "branching", 2)
        w = _counts_array(counts)
        n = w.size
        if n == 1:
            return cls._from_layout([0, 1], [0], 1)

        order = np.argsort(w, kind="stable")  # leaf queue: by (count, class id)
        leaf_w = w[order]
        first = 2 + (n - 2) % (k - 1)
        m = 1 + (n - first) // (k - 1)  # number of merges = internal nodes
        s = n + m - 1
        # `stream` lists the items in the order they are consumed by merges:
        # merge u consumes stream[first + k*(u-1) : first + k*u] (merge 0 takes
        # the first `first` items), so it directly is the children CSR in
        # creation order. Merged node u is coded n + u.
        stream = np.empty(s, np.int64)
        merged_w = np.empty(m, w.dtype)  # queue 2, nondecreasing by construction
        stream[:first] = order[:first]
        merged_w[0] = leaf_w[:first].sum()
        li, qi, qn, out = first, 0, 1, first  # heads of both queues, tail, stream fill
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
                sel_w = leaf_w[li:li + take]
                codes = order[li:li + take]
                used_leaves = take
            elif n_leaf == 0:
                sel_w = merged_w[qi:qi + take]
                codes = n + np.arange(qi, qi + take, dtype=np.int64)
                used_leaves = 0
            else:
                cand = np.concatenate((leaf_w[li:la], merged_w[qi:qa]))
                # Stable sort of two sorted runs (timsort: linear); leaves come
                # first on ties because they are first in `cand`.
                sel = np.argsort(cand, kind="stable")[:take]
                sel_w = cand[sel]
                is_leaf = sel < n_leaf
                codes = np.where(is_leaf, order[li + np.minimum(sel, n_leaf - 1)],
                                 n + qi + (sel - n_leaf))
                used_leaves = int(np.count_nonzero(is_leaf))
            stream[out:out + take] = codes
            merged_w[qn:qn + groups] = sel_w.reshape(groups, k).sum(axis=1)
            li += used_leaves
            qi += take - used_leaves
            qn += groups
            out += take
        assert out == s, (out, s)  # every item but the root consumed exactly once

        node_begin = np.empty(m + 1, np.int64)
        node_begin[0] = 0
        node_begin[1:] = first + k * np.arange(m, dtype=np.int64)
        child_begin, slot_child, _ = _bfs_layout(n, node_begin, stream, m - 1)
        return cls._from_layout(child_begin, slot_child, n)

    @classmethod
    def from_parents(cls, parents, num_classes=None):
        """Builds a tree from a parent array.

        Entries ``0..C-1`` of `parents` are the classes, entries ``C..C+M-1`` the
        internal nodes (in any order: they are renumbered breadth-first).
        ``parents[i]`` is the entry index (in ``[C, C+M)``) of i's parent, or -1
        for the single root. Children keep their order of increasing entry
        index, so a node's leaf children come before its internal children.

        Args:
          parents: int array [C+M].
          num_classes: C. When None, C is the smallest parent index >= 0 (every
            entry below the first internal node is a class).

        Returns:
          A Tree.

        Raises:
          ValueError: if there is no root or several, a parent is out of range
            (below -1, past the end, or a class), a class has parent -1, some
            internal nodes are not reachable from the root (a cycle), or an
            internal node has no children.
        """
        parents = _int_array(parents, "parents")
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
            c = _check_int(num_classes, "num_classes", 1)
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
        child_begin, slot_child, unreachable = _bfs_layout(
            c, node_begin, child, int(roots[0]) - c)
        if unreachable.size:
            raise ValueError(
                f"{unreachable.size} internal node(s) are not reachable from the root "
                f"(they form a cycle): entries {(c + unreachable[:10]).tolist()}"
                + (" ..." if unreachable.size > 10 else ""))
        return cls._from_layout(child_begin, slot_child, c)

    @classmethod
    def from_paths(cls, paths):
        """Builds the trie of per-class child-position paths.

        ``paths[c]`` lists, from the root down, the position of the child taken
        at each internal node on the way to class c; e.g. ``[[0, 0], [0, 1],
        [1]]`` is a root with an internal node (holding classes 0 and 1) at
        position 0 and class 2 at position 1. Children are ordered by position.

        Args:
          paths: sequence of C integer sequences, or a 2-D int array [C, depth]
            when all classes have the same depth.

        Returns:
          A Tree.

        Raises:
          ValueError: if there are no paths, a path is empty or holds a negative
            or non-integer position, two classes share a path, a path is a
            prefix of another (a leaf that is also an internal node), or the
            child positions of some node are not exactly 0..k-1.
        """
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
            flat = _int_array(list(itertools.chain.from_iterable(paths)), "paths")
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
        return cls._from_layout(child_begin, np.concatenate(codes_parts), c)

    @classmethod
    def from_nested(cls, nested):
        """Builds a tree from nested lists: lists are internal nodes, ints classes.

        ``[[0, 1], [2, [3, 4]], 5]`` is a root with three children: a node with
        classes 0 and 1, a node with class 2 and a node holding 3 and 4, and
        class 5. Children keep their list order.

        Args:
          nested: a list or tuple (the root) of ints and nested lists/tuples.
            The ints must be exactly 0..C-1, each once.

        Returns:
          A Tree.

        Raises:
          ValueError: on an empty list, an entry that is neither an int nor a
            list/tuple, a negative, missing or repeated class, or a list that
            contains itself.
        """
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
        return cls._from_layout(child_begin, codes, c)

    # ------------------------------------------------------------------ #
    # Persistence
    # ------------------------------------------------------------------ #

    def save(self, path):
        """Writes the tree to a portable .npz file (no pickle).

        Only ``child_begin``, ``slot_child`` and ``num_classes`` are stored, plus
        a format name and version; everything else is re-derived on load. The
        file is written at exactly `path` (NumPy would otherwise append .npz).

        Args:
          path: a file name / os.PathLike, or a writable binary file object.
        """
        payload = dict(
            format=np.array(_FORMAT_NAME),
            version=np.array(_FORMAT_VERSION, np.int64),
            num_classes=np.array(self._num_classes, np.int64),
            child_begin=self.child_begin,
            slot_child=self.slot_child,
        )
        if hasattr(path, "write"):
            np.savez(path, **payload)
        else:
            with open(os.fspath(path), "wb") as f:
                np.savez(f, **payload)

    @classmethod
    def load(cls, path):
        """Reads a tree written by `save`, validating it fully.

        Args:
          path: a file name / os.PathLike, or a readable binary file object.

        Returns:
          The Tree; equal to the one saved.

        Raises:
          ValueError: if the file is not a tf_hsm tree file, was written by a
            newer format version, or holds an invalid layout.
          OSError: if the file cannot be opened (e.g. FileNotFoundError).
        """
        if hasattr(path, "read"):
            return cls._load_from(path, getattr(path, "name", "<file object>"))
        with open(os.fspath(path), "rb") as f:
            return cls._load_from(f, os.fspath(path))

    @classmethod
    def _load_from(cls, f, name):
        try:
            data = np.load(f, allow_pickle=False)
        except (ValueError, OSError, EOFError, zipfile.BadZipFile) as e:
            raise ValueError(f"{name} is not a tf_hsm tree file: {e}") from None
        if not isinstance(data, np.lib.npyio.NpzFile):
            raise ValueError(f"{name} is not a tf_hsm tree file (not an .npz archive)")
        with data:
            needed = {"format", "version", "num_classes", "child_begin", "slot_child"}
            missing = needed - set(data.files)
            if missing:
                raise ValueError(
                    f"{name} is not a tf_hsm tree file: missing {sorted(missing)}")
            try:
                fmt = data["format"]
                version = data["version"]
                num_classes = data["num_classes"]
                child_begin = data["child_begin"]
                slot_child = data["slot_child"]
            except Exception as e:  # corrupt member: zlib, zip, header errors
                raise ValueError(f"{name} is corrupt: {e}") from None
        if fmt.shape != () or str(fmt) != _FORMAT_NAME:
            raise ValueError(f"{name} is not a tf_hsm tree file (format {fmt!r})")
        if version.shape != () or version.dtype.kind not in "iu":
            raise ValueError(f"{name} has an invalid format version {version!r}")
        if int(version) > _FORMAT_VERSION:
            raise ValueError(
                f"{name} uses tree format version {int(version)}; this tf_hsm reads "
                f"up to {_FORMAT_VERSION}")
        if num_classes.shape != () or num_classes.dtype.kind not in "iu":
            raise ValueError(f"{name} has an invalid num_classes {num_classes!r}")
        try:
            return cls._from_layout(child_begin, slot_child, int(num_classes))
        except ValueError as e:
            raise ValueError(f"{name} holds an invalid tree: {e}") from None

    def get_config(self):
        """Returns a JSON-serializable dict that `from_config` turns back into the tree.

        The layout arrays are stored as compact strings (see `from_config`), so the
        config of a 10M-class tree stays well under a megabyte for the usual trees.
        """
        return {
            "num_classes": self._num_classes,
            "encoding": _CONFIG_ENCODING,
            "child_begin": _encode_ints(self.child_begin),
            "slot_child": _encode_ints(self.slot_child),
        }

    @classmethod
    def from_config(cls, config):
        """Rebuilds a tree from `get_config` output (validated).

        Args:
          config: dict with keys num_classes, child_begin, slot_child. With
            ``"encoding": "int64-delta-zlib-base64"`` (what `get_config` writes)
            the two arrays are strings; without it they are lists of ints (the
            format of earlier versions, also handy to write by hand).

        Returns:
          A Tree.

        Raises:
          ValueError: if a key is missing, the encoding is unknown or corrupt, or
            the layout is invalid.
        """
        if not isinstance(config, collections.abc.Mapping):
            raise ValueError(f"tree config must be a dict, got {type(config).__name__}")
        try:
            child_begin, slot_child = config["child_begin"], config["slot_child"]
            num_classes = config["num_classes"]
        except KeyError as e:
            raise ValueError(f"tree config is missing {e}") from None
        encoding = config.get("encoding")
        if encoding is not None:
            if encoding != _CONFIG_ENCODING:
                raise ValueError(
                    f"tree config has an unknown encoding {encoding!r}; this tf_hsm "
                    f"reads {_CONFIG_ENCODING!r} or plain lists")
            child_begin = _decode_ints(child_begin, "child_begin")
            slot_child = _decode_ints(slot_child, "slot_child")
        return cls._from_layout(child_begin, slot_child, num_classes)

    def __reduce__(self):
        # Pickle / copy through the validating constructor, so that an
        # unpickled tree is as checked and read-only as a built one.
        return (_tree_from_layout, (self.child_begin, self.slot_child, self._num_classes))

    # ------------------------------------------------------------------ #
    # Sizes and queries
    # ------------------------------------------------------------------ #

    @property
    def num_classes(self):
        """C, the number of classes (leaves)."""
        return self._num_classes

    @property
    def num_nodes(self):
        """M, the number of internal nodes (softmax groups)."""
        return int(self.child_begin.size - 1)

    @property
    def num_slots(self):
        """S = C + M - 1, the number of edges = rows of the weight table."""
        return int(self.slot_child.size)

    @property
    def num_steps(self):
        """P, the total path length over all classes (len of path_nodes)."""
        return int(self.path_nodes.size)

    @property
    def max_depth(self):
        """The longest root-to-class path, in steps (>= 1)."""
        return int(self._class_depth.max())

    @property
    def max_branching(self):
        """The largest number of children of any internal node."""
        return int(np.diff(self.child_begin).max())

    @property
    def class_depth(self):
        """Read-only int64 array [C]: path length of each class (diff(path_begin))."""
        return self._class_depth

    def _check_node(self, node):
        node = _check_int(node, "node")
        if not 0 <= node < self.num_nodes:
            raise ValueError(f"node {node} is out of range [0, {self.num_nodes})")
        return node

    def child_range(self, node):
        """Returns ``(begin, end)``: the slots of `node`'s children, as Python ints.

        Raises:
          ValueError: if node is not an integer in [0, num_nodes).
        """
        node = self._check_node(node)
        return int(self.child_begin[node]), int(self.child_begin[node + 1])

    def children(self, node):
        """Returns `node`'s children as codes: class c as c, node m as C + m.

        Raises:
          ValueError: if node is not an integer in [0, num_nodes).
        """
        begin, end = self.child_range(node)
        return self.slot_child[begin:end].tolist()

    def path(self, cls):
        """Returns the path of class `cls` as ``[(node, slot), ...]``, root first.

        Raises:
          ValueError: if cls is not an integer in [0, num_classes).
        """
        cls = _check_int(cls, "class")
        if not 0 <= cls < self._num_classes:
            raise ValueError(f"class {cls} is out of range [0, {self._num_classes})")
        begin, end = int(self.path_begin[cls]), int(self.path_begin[cls + 1])
        return list(zip(self.path_nodes[begin:end].tolist(),
                        self.path_slots[begin:end].tolist()))

    def parents(self):
        """Returns the parent array in the `from_parents` convention.

        Entry ``c < C`` is the parent of class c, entry ``C + m`` the parent of
        node m, both given as ``C + parent node``; the root's entry is -1.
        `from_parents` of it rebuilds the same tree up to the order of children
        (it orders leaves before internal nodes, each by increasing number).

        Returns:
          A new int64 array [C + M].
        """
        c, m = self._num_classes, self.num_nodes
        out = np.empty(c + m, np.int64)
        out[:c] = c + self.slot_node[self.class_slot]
        out[c] = -1
        out[c + 1:] = c + self.slot_node[self.node_slot[1:]]
        return out

    def to_paths(self):
        """Returns the per-class child positions, the input of `from_paths`.

        ``Tree.from_paths(tree.to_paths()) == tree``.

        Returns:
          A list of C lists of ints.
        """
        positions = self.path_slots - self.child_begin[self.path_nodes]
        return [p.tolist() for p in np.split(positions, self.path_begin[1:-1])]

    def to_nested(self):
        """Returns the tree as nested lists, the input of `from_nested`.

        ``Tree.from_nested(tree.to_nested()) == tree``. Built without recursion,
        so deep trees do not hit Python's recursion limit.

        Returns:
          The root's list.
        """
        c = self._num_classes
        lists = [[] for _ in range(self.num_nodes)]
        bounds = self.child_begin.tolist()
        codes = self.slot_child.tolist()
        for node, children in enumerate(lists):
            for code in codes[bounds[node]:bounds[node + 1]]:
                children.append(code if code < c else lists[code - c])
        return lists[0]

    def describe(self):
        """Returns a short multi-line summary: sizes, depths and branching."""
        depth = self._class_depth
        fan = np.diff(self.child_begin)
        return (
            f"Tree: {self._num_classes} classes, {self.num_nodes} internal nodes, "
            f"{self.num_slots} slots\n"
            f"  class depth: min {int(depth.min())}, mean {depth.mean():.3f}, "
            f"max {int(depth.max())}\n"
            f"  branching:   min {int(fan.min())}, mean {fan.mean():.3f}, "
            f"max {int(fan.max())}")

    def __eq__(self, other):
        if not isinstance(other, Tree):
            return NotImplemented
        # Everything else is derived from these three.
        return (self._num_classes == other._num_classes
                and np.array_equal(self.child_begin, other.child_begin)
                and np.array_equal(self.slot_child, other.slot_child))

    def __hash__(self):
        # The arrays are read-only, so hashing their contents is safe.
        return hash((self._num_classes, self.child_begin.tobytes(),
                     self.slot_child.tobytes()))

    def __repr__(self):
        return (f"Tree(num_classes={self._num_classes}, num_nodes={self.num_nodes}, "
                f"max_depth={self.max_depth}, max_branching={self.max_branching})")


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
