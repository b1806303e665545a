"""The shared head of `HierarchicalSoftmaxMixture(head=...)`: one exact softmax over the
frequent classes and a tail slot, ahead of the mixture of tail trees (the formulas and
the class map are `tf_hsm.frontend.mixture`'s, shared by both Keras).

`tail_classes(head, num_classes)` gives the classes to build the tail trees over
(`Tree.from_context(..., classes=tail)`), in increasing id order.
"""

from tf_hsm.frontend.mixture import ClassMap, checked_head, tail_classes

__all__ = ["ClassMap", "checked_head", "tail_classes"]
