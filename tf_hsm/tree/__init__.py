"""The class tree, in NumPy only: `Tree` (tree.py) and its builders (builders.py: balanced,
two-level, Huffman; vectors.py: from class vectors; convert.py: parents, paths, nested
lists), its flat layout (layout.py, the arrays the kernels read), files and configs
(io.py), argument checks (checks.py) and how its rows split over shards (shards.py).

Nothing here imports TensorFlow: trees are built, inspected and saved anywhere.
Start at tree.py.
"""

from tf_hsm.tree.tree import Tree, _tree_from_layout  # noqa: F401 (pickles name it here)

__all__ = ["Tree"]
