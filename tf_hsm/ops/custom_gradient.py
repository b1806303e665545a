"""`custom_gradient`: `tf.custom_gradient` for the op wrappers, without its leak.

Traced into a graph (a `tf.function`, a Keras step), `tf.custom_gradient` registers the
gradient function in TensorFlow's global gradient registry under a new name and never
removes it: the function closes over the graph's tensors, so every traced step stays in
memory with the variables it captured (a `RebuildTree`'s replaced table and optimizer
slots among them: docs/limits.md). Here the registered function holds the graph weakly
and finds the gradient function on the graph itself, so both go when the graph does.
Executing eagerly, `tf.custom_gradient` registers nothing and is used as it is.

Supported: the uses in tf_hsm, a function of tensors returning one tensor (or a flat
list of them) and a gradient function of the upstream gradients, reading no variable
but through its arguments.
"""

import functools
import itertools
import weakref

import tensorflow as tf
from tensorflow.python.eager import record  # pylint: disable=g-direct-tensorflow-import

_ON_GRAPH = "_tf_hsm_gradient_functions"
_NAMES = itertools.count()


def custom_gradient(f):
  """`tf.custom_gradient(f)`, whose traced gradient functions live on their graph."""

  @functools.wraps(f)
  def decorated(*args):
    if tf.executing_eagerly():
      return tf.custom_gradient(f)(*args)
    return _traced(f, args)
  return decorated


def _traced(f, args):
  args = [tf.convert_to_tensor(a) for a in args]
  result, gradient_of = f(*args)
  flat_result = tf.nest.flatten(result)
  count = len(flat_result)

  def gradient(*upstream):
    grads = gradient_of(*upstream[:count])
    grads = list(grads) if isinstance(grads, (list, tuple)) else [grads]
    return [None] * count + grads  # no gradient through the results' own identities

  graph = tf.compat.v1.get_default_graph()
  name = f"TfHsmCustomGradient-{next(_NAMES)}"
  if getattr(graph, _ON_GRAPH, None) is None:
    setattr(graph, _ON_GRAPH, {})
  getattr(graph, _ON_GRAPH)[name] = gradient
  tf.RegisterGradient(name)(_registered(weakref.ref(graph), name))
  # As tf.custom_gradient: tf.gradients finds it by the override, a tape by the record.
  with graph.gradient_override_map({"IdentityN": name}):
    outputs = tf.identity_n(flat_result + args)
  record.record_operation(f.__name__, outputs, flat_result + args, gradient)
  return tf.nest.pack_sequence_as(result, outputs[:count])


def _registered(graph_ref, name):
  """The registry's function for `name`: the graph's, found through a weak reference."""

  def registered(unused_op, *upstream):
    graph = graph_ref()
    if graph is None:
      raise LookupError(f"{name}: the graph it was traced in is gone")
    return getattr(graph, _ON_GRAPH)[name](*upstream)
  return registered
