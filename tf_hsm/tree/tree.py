"""Class trees for hierarchical softmax, in the flat layout that the kernels read.

A `Tree` puts the classes ``0..C-1`` at the leaves of a rooted tree whose internal
nodes are ``0..M-1`` (root ``0``). Every edge of the tree is a *slot*: one row of
the weight table. The kernels never walk pointers; they read a handful of flat
int64 arrays (CSR style), described in docs/design.md ("Tree layout contract"):

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

This module is the public face; the work lives in the modules beside it, one job each:
`tf_hsm.tree.builders` (balanced, two-level, Huffman), `tf_hsm.tree.convert`
(parent arrays, paths, nested lists), `tf_hsm.tree.layout` (validation and the
derived arrays), `tf_hsm.tree.io` (files and configs) and `tf_hsm.tree.checks`
(argument checks). They depend on NumPy only, so trees can be built, inspected and
saved on machines without TensorFlow.
"""

from __future__ import annotations

import numpy as np

from tf_hsm.tree import builders
from tf_hsm.tree import convert
from tf_hsm.tree import io
from tf_hsm.tree import vectors as tree_vectors
from tf_hsm.tree.checks import check_int
from tf_hsm.tree.layout import derive_layout

__all__ = ["Tree"]


def _tree_from_layout(child_begin, slot_child, num_classes):
    # Module-level so that pickle can find it (pickles name it as
    # tf_hsm.tree.tree._tree_from_layout; those written before the package had
    # subpackages as tf_hsm.tree._tree_from_layout, which tf_hsm/tree/__init__.py
    # keeps); rebuilds (and re-validates) a tree from its three defining fields.
    return Tree._from_layout(child_begin, slot_child, num_classes)


# --------------------------------------------------------------------------- #
# The tree
# --------------------------------------------------------------------------- #

class Tree:
    """A class tree for hierarchical softmax, stored as flat int64 arrays.

    Build one with a classmethod (`flat`, `balanced`, `two_level`, `huffman`,
    `from_vectors`, `from_context`, `from_parents`, `from_paths`, `from_nested`,
    `from_config`, `load`); the constructor itself is not public, so that every
    tree passes the same validation.

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
            "Tree has no public constructor; use Tree.flat, Tree.balanced, "
            "Tree.two_level, Tree.huffman, Tree.from_vectors, Tree.from_context, "
            "Tree.from_parents, Tree.from_paths, Tree.from_nested, "
            "Tree.from_config or Tree.load")

    # ------------------------------------------------------------------ #
    # The one real constructor
    # ------------------------------------------------------------------ #

    @classmethod
    def _from_layout(cls, child_begin, slot_child, num_classes):
        """Builds a Tree from a BFS layout, validating it and deriving the rest.

        The conditions on the arguments are those of
        `tf_hsm.tree.layout.derive_layout`; the caller's arrays are copied.

        Raises:
          ValueError: naming the first violated condition.
        """
        layout = derive_layout(child_begin, slot_child, num_classes)
        tree = object.__new__(cls)
        tree._num_classes = layout.num_classes
        tree.child_begin = layout.child_begin
        tree.slot_child = layout.slot_child
        tree.slot_node = layout.slot_node
        tree.node_slot = layout.node_slot
        tree.class_slot = layout.class_slot
        tree.node_depth = layout.node_depth
        tree.path_begin = layout.path_begin
        tree.path_nodes = layout.path_nodes
        tree.path_slots = layout.path_slots
        tree._class_depth = layout.class_depth
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
        return cls._from_layout(*builders.balanced(num_classes, branching))

    @classmethod
    def flat(cls, num_classes):
        """The exact softmax as a tree: one node whose children are all the classes.

        ``log_prob`` over it is ``z_c - logsumexp(z)`` with ``z = W h + b``, the full
        softmax. A node this wide is computed as blocked matrix products (tiles of
        children against all of its tokens, the logits recomputed in the gradient from
        each token's log-sum-exp), so no ``[tokens, num_classes]`` logits are ever held:
        the full softmax at a million classes in the memory of its table and gradient.

        Args:
          num_classes: C >= 1.

        Returns:
          A Tree of one node with C children.

        Raises:
          ValueError: if num_classes < 1 (or not an integer).
        """
        c = check_int(num_classes, "num_classes", 1)
        return cls._from_layout(*builders.balanced(c, max(c, 2)))

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
        return cls._from_layout(*builders.two_level(num_classes, counts))

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
        as merged (ascending weight).

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
        return cls._from_layout(*builders.huffman(counts, branching))

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
        return cls._from_layout(*convert.from_parents(parents, num_classes))

    @classmethod
    def from_vectors(cls, vectors, counts=None, branching=2, seed=0, head=0):
        """A tree whose nodes split the classes by the similarity of their vectors.

        Each node takes the classes holding at least 1/k of its mass as leaf children
        (as a Huffman tree puts frequent classes high) and splits the rest into its
        other child slots by recursive bisection along 2-means directions, cutting
        where the mass splits evenly: similar classes share nodes, and paths stay
        about as short as a Huffman tree's for the same branching
        (`tf_hsm/tree/vectors.py`). Deterministic for a seed.

        Args:
          vectors: [num_classes, dim] array (a NumPy memmap is read in chunks, never
            copied whole): class embeddings, output-layer rows, anything whose
            distances say which classes are alike.
          counts: optional class frequencies [num_classes] (uniform if None or all
            zero); a zero count weighs half the smallest positive one.
          branching: children per node, an int >= 2, or a list of ints per level (the
            last one for every deeper level).
          seed: seed of the samples the 2-means directions are fitted on.
          head: how many of the most frequent classes (by `counts`, ties to the lower
            id) are leaf children of the root, next to its `branching` slots that split
            the other classes by similarity; 0 for none. The layout of an adaptive
            softmax: frequent classes get an exact softmax at the root, at the cost of
            scoring head + branching children there for every token.

        Returns:
          A Tree.

        Raises:
          ValueError: malformed vectors (not 2-D, empty, not finite), counts of the
            wrong length or not finite and non-negative, branching < 2, a head that is
            negative, not below the number of classes, or given without counts.
        """
        vectors, counts, branching, seed, head = tree_vectors.checked_arguments(
            vectors, counts, branching, seed, head)
        parents = tree_vectors.parents_from_vectors(vectors, counts, branching, seed,
                                                     head)
        return cls.from_parents(parents, num_classes=vectors.shape[0])

    @classmethod
    def from_context(cls, token_ids, num_classes, counts=None, branching=32, seed=0,
                     head=0, contexts=2000, lags=2, dims=None, side="left", classes=None):
        """A tree from the classes' left contexts in a corpus, built before training.

        `Tree.from_vectors` over `tf_hsm.tree.context.context_vectors(token_ids, ...)`:
        classes that follow the same words share nodes, with no trained model and no
        `RebuildTree` (docs/planner.md, "Trees from contexts"). With side="right", the
        contexts are the words that follow (the left contexts of the reversed corpus):
        a second grouping of the same classes, for `HierarchicalSoftmaxMixture`.

        Args:
          token_ids: 1-D integer array, the training corpus as class ids in order,
            the ids ranked by frequency (0 the most frequent) so that the `contexts`
            told apart are the frequent ones.
          num_classes: the number of classes.
          counts: class frequencies (default: the counts of `token_ids`).
          branching, seed, head: as `Tree.from_vectors`.
          contexts, lags, dims: as `context_vectors`.
          side: "left" (the words before each class) or "right" (the words after).
          classes: optional ids (distinct, increasing, in [0, num_classes)) the tree is
            over: its class j is `classes[j]`, grouped by its contexts among all of
            `token_ids` (the tail trees of `HierarchicalSoftmaxMixture(head=...)`).
            Default: every class.

        Returns:
          A Tree over `num_classes` classes, or `len(classes)`.

        Raises:
          ValueError: as `context_vectors` and `Tree.from_vectors`; a side other than
            "left" or "right"; `classes` not increasing ids within [0, num_classes).
        """
        from tf_hsm.tree import context  # pylint: disable=import-outside-toplevel
        if side not in ("left", "right"):
            raise ValueError(f'side must be "left" or "right", got {side!r}')
        if side == "right":
            token_ids = np.asarray(token_ids)[::-1]
        if counts is not None and np.shape(counts) != (num_classes,):
            raise ValueError(f"counts must have num_classes = {num_classes} entries, "
                             f"got shape {np.shape(counts)}")
        vectors = context.context_vectors(token_ids, num_classes, contexts, lags, dims,
                                          seed)
        if counts is None:
            counts = np.bincount(np.asarray(token_ids, np.int64), minlength=num_classes)
        if classes is not None:
            classes = _checked_subset(classes, num_classes)
            vectors, counts = vectors[classes], np.asarray(counts)[classes]
        return cls.from_vectors(vectors, counts, branching, seed, head)

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
        return cls._from_layout(*convert.from_paths(paths))

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
        return cls._from_layout(*convert.from_nested(nested))

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
        io.save(self, path)

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
        return io.load(path, cls._from_layout)

    def get_config(self):
        """Returns a JSON-serializable dict that `from_config` turns back into the tree.

        The layout arrays are stored as compact strings (see `from_config`), so the
        config of a 10M-class tree stays well under a megabyte for the usual trees.
        """
        return io.config_of(self)

    @classmethod
    def from_config(cls, config):
        """Rebuilds a tree from `get_config` output (validated).

        Args:
          config: dict with keys num_classes, child_begin, slot_child. With
            ``"encoding": "int64-delta-zlib-base64"`` (what `get_config` writes)
            the two arrays are strings; without it they are lists of ints (as
            configs without the encoding hold them, and handy to write by hand).

        Returns:
          A Tree.

        Raises:
          ValueError: if a key is missing, the encoding is unknown or corrupt, or
            the layout is invalid.
        """
        return cls._from_layout(*io.layout_from_config(config))

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
        node = check_int(node, "node")
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
        cls = check_int(cls, "class")
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


def _checked_subset(classes, num_classes):
    """`classes` as an int64 array of increasing ids in [0, num_classes), or ValueError."""
    ids = np.asarray(classes)
    if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError("classes must be a non-empty 1-D array of integer class ids, got "
                         f"shape {ids.shape} of {ids.dtype}")
    ids = ids.astype(np.int64)
    if ids[0] < 0 or ids[-1] >= num_classes or np.any(np.diff(ids) <= 0):
        raise ValueError(f"classes must be increasing ids within [0, {num_classes}), got "
                         f"{ids[:5].tolist()}{'...' if ids.size > 5 else ''}")
    return ids
