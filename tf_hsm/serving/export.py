"""`export`: a SavedModel of a Keras model with a HierarchicalSoftmax, AdaptiveSoftmax or
HierarchicalSoftmaxMixture output layer that runs without tf_hsm (stock TensorFlow, XLA,
TFLite builtins).

The model's layers below the tf_hsm layer are stock Keras layers; `export` cuts the model
at the tf_hsm layer's `hidden` input (`keras.Model(inputs, hidden)`), and serves the
layer itself with `tf_hsm.serving`'s stock-op functions on copies of its weights.
"""

import tensorflow as tf

from tf_hsm.serving import checks
from tf_hsm.serving.served import served_kind, served_layer

__all__ = ["export", "ModelCut", "ServingModule", "LOG_PROB_ALL_MAX_CLASSES"]

# "log_prob_all" is exported only up to this many classes: its output is [..., C] floats
# per row (4 MB a row at 1M classes), and its one matmul reads the whole table.
LOG_PROB_ALL_MAX_CLASSES = 1_000_000

def _find_layer(model, who):
  layers = list(_all_layers(model))
  found = [layer for layer in layers if served_kind(layer) is not None]
  if not found:
    raise ValueError(f"{who} needs a model with a tf_hsm HierarchicalSoftmax, "
                     "AdaptiveSoftmax or HierarchicalSoftmaxMixture layer; found none")
  if len(found) > 1:
    raise ValueError(f"{who} takes a model with one tf_hsm layer; it has {len(found)}: "
                     f"{[l.name for l in found]}")
  return found[0]


def _all_layers(model):
  for layer in model.layers:
    yield layer
    if hasattr(layer, "layers") and layer is not model:
      yield from _all_layers(layer)


def _tf_variables(layers_variables):
  out = []
  for v in layers_variables:
    inner = getattr(v, "value", v)
    out.append(inner if isinstance(inner, tf.Variable) else v)
  return out


def keras_of(model):
  """The Keras package `model` belongs to: tf_keras or Keras 3 (by its classes, so that
  a subclass of `tf_keras.Model` defined elsewhere counts as tf_keras)."""
  if any(cls.__module__.split(".")[0] == "tf_keras" for cls in type(model).__mro__):
    import tf_keras  # pylint: disable=import-outside-toplevel
    return tf_keras
  import keras  # pylint: disable=import-outside-toplevel
  return keras


def _call_arguments(node):
  """(args, kwargs) a functional model's node called its layer with, in either Keras."""
  if hasattr(node, "arguments"):  # Keras 3
    return list(node.arguments.args), dict(node.arguments.kwargs)
  return list(node.call_args), dict(node.call_kwargs)  # tf_keras


def _same_tensor(a, b):
  """Whether two symbolic tensors of a functional model are one (tf_keras may hold
  copies of a tensor, so compare where they come from too)."""
  if a is b:
    return True
  ha, hb = getattr(a, "_keras_history", None), getattr(b, "_keras_history", None)
  return ha is not None and hb is not None and tuple(ha)[0] is tuple(hb)[0] and \
      tuple(ha)[1:] == tuple(hb)[1:]


class ModelCut:
  """A functional model cut at its tf_hsm layer: what `export` and the front ends'
  `inference_model` serve. Works on Keras 3 and tf_keras models; its errors name `who`,
  the function the caller called.

  Attributes:
    layer: the HierarchicalSoftmax, AdaptiveSoftmax or HierarchicalSoftmaxMixture layer.
    kind: "hsm", "adaptive" or "mixture".
    inputs: the model's inputs; target_index: which of them are the layer's targets;
    feature_inputs: the others. hidden: the symbolic hidden states the layer reads.
    encoder: `Model(feature_inputs, hidden)`, in the model's Keras.
    ignore_class: the layer's `ignore_class` (a HierarchicalSoftmax's padding id, which
      its `top_k` never returns), or None.
  """

  def __init__(self, model, who="export"):
    checks.check_model(model, who)
    layer = _find_layer(model, who)
    self.layer, self.kind = layer, served_kind(layer)
    self.ignore_class = _ignore_class(layer)
    nodes = getattr(layer, "_inbound_nodes", [])
    if len(nodes) != 1:
      raise ValueError(f"the tf_hsm layer {layer.name!r} must be called once in the model, "
                       f"it is called {len(nodes)} times")
    args, kwargs = _call_arguments(nodes[0])
    hidden = args[0] if args else kwargs.pop("hidden")
    targets = args[1] if len(args) > 1 else kwargs.get("targets")
    if kwargs.get("mask") is not None:
      raise ValueError("a tf_hsm layer called with an explicit mask cannot be cut out of "
                       "its model: let the mask come from the hidden states")
    self.inputs = list(model.inputs)
    target_index = [i for i, t in enumerate(self.inputs) if _same_tensor(t, targets)]
    if not target_index:
      raise ValueError("the tf_hsm layer's targets must be one of the model's inputs")
    self.target_index = target_index[0]
    outputs = model.outputs
    if len(outputs) != 1 or not _same_tensor(outputs[0],
                                             tf.nest.flatten(nodes[0].outputs)[0]):
      raise ValueError("the model's one output must be the tf_hsm layer's "
                       "log-probabilities")
    self.feature_inputs = [t for i, t in enumerate(self.inputs) if i != self.target_index]
    self.hidden = hidden
    try:
      self.encoder = keras_of(model).Model(self.feature_inputs, hidden)
    except ValueError as e:
      raise ValueError("the tf_hsm layer's hidden input must depend on the model's inputs "
                       f"other than the targets: {e}") from None


def _ignore_class(layer):
  """The layer's `ignore_class` as get_config writes it (None where it has none: an
  AdaptiveSoftmax leaves padding ids out with its class_order)."""
  value = getattr(layer, "ignore_class", None)
  return None if value is None else int(value)


class _Untracked:
  """Holds the encoder out of the SavedModel's object graph: tracked, a Keras 3 model
  would save each of its variables a second time (its Keras variable, besides the
  tf.Variable inside it that the signatures capture and `encoder_variables` holds)."""

  def __init__(self, model):
    self.model = model


def _resources(model):
  """The non-variable resources (lookup tables, assets) reachable from `model`, which
  its traced calls may capture and the SavedModel must then hold."""
  found = []
  for t in tf.train.TrackableView(model).descendants():
    if isinstance(t, tf.saved_model.Asset) or (
        hasattr(t, "_create_resource") and not isinstance(t, tf.Variable)):
      found.append(t)
  return found


class ServingModule(tf.Module):
  """What `export` saves: the encoder's variables and resources (the model up to the
  tf_hsm layer's input: its computation is traced into the signatures), the layer's
  weights as variables, its tree(s) as constants, and the signature functions. Each
  variable is saved once.

  Usable directly in Python too (`module.top_k(inputs...)`)."""

  def __init__(self, model, k=10, log_prob_all=None, sample=True, max_exclude=0):
    super().__init__(name="tf_hsm_serving")
    k, log_prob_all, sample, max_exclude = checks.check_options(
        k, log_prob_all, sample, max_exclude)
    cut = ModelCut(model)
    layer = cut.layer
    self.ignore_class = cut.ignore_class
    self._hidden_rank = len(cut.hidden.shape)
    self._target_index = cut.target_index
    self._encoder = _Untracked(cut.encoder)
    self.encoder_variables = _tf_variables(cut.encoder.weights)
    self.encoder_resources = _resources(cut.encoder)
    inputs = cut.inputs
    self.input_names = [t.name for t in inputs]
    self._model_shapes = [list(t.shape) for t in inputs]
    self._specs = [checks.signature_spec(t) for t in inputs]
    self.served = served_layer(layer)
    self.num_classes, self.dtype = self.served.num_classes, self.served.dtype
    # An AdaptiveSoftmax with a class_order ranks the classes of the order only.
    self.k = min(k, self.served.rankable_classes)
    if log_prob_all is None:
      log_prob_all = self.num_classes <= LOG_PROB_ALL_MAX_CLASSES
    self._signatures = self._make_signatures(log_prob_all, sample, max_exclude)

  # ------------------------------------------------------------------ the computations

  def _hidden(self, features):
    hidden = self._encoder.model(features if len(features) > 1 else features[0])
    mask = getattr(hidden, "_keras_mask", None)
    hidden = tf.convert_to_tensor(hidden)
    if hidden.dtype != self.dtype:
      hidden = tf.cast(hidden, self.dtype)
    return hidden, mask

  def _features(self, kwargs):
    return [kwargs[n] for i, n in enumerate(self.input_names) if i != self._target_index]

  def _top_k(self, hidden, exclude=None):
    return self.served.top_k(hidden, self.k, exclude=self._with_ignored(exclude))

  def _with_ignored(self, exclude):
    """`exclude` ([..., n] int64, or None) with the layer's ignore_class added to every
    row: the layer's top_k never returns it, so neither does the export's."""
    if self.ignore_class is None:
      return exclude
    if exclude is None:  # one id for every row: shape [1, ..., 1]
      return tf.fill([1] * self._hidden_rank, tf.constant(self.ignore_class, tf.int64))
    ignored = tf.fill(tf.concat([tf.shape(exclude)[:-1], [1]], 0),
                      tf.constant(self.ignore_class, tf.int64))
    return tf.concat([exclude, ignored], -1)

  # ------------------------------------------------------------------ signatures

  def _checked(self, tensors, indices):
    """The inputs `indices`, each checked against the model's shape for it."""
    return [checks.conform(x, self._model_shapes[i], self.input_names[i])
            for x, i in zip(tensors, indices)]

  def _top_k_fn(self, *features):
    hidden, _ = self._hidden(self._checked(features, self._feature_indices))
    log_probs, classes = self._top_k(hidden)
    return {"classes": tf.cast(classes, tf.int64), "log_probs": tf.cast(log_probs, tf.float32)}

  def _top_k_excluding_fn(self, *args):
    features, exclude = list(args[:-1]), args[-1]
    hidden, _ = self._hidden(self._checked(features, self._feature_indices))
    dims = [None] * (self._hidden_rank - 1) + [self._max_exclude]
    exclude = checks.conform(exclude, dims, "exclude")
    # Broadcast before the ignored id joins it, so that an error shows the caller's shape.
    exclude = checks.broadcast_rows(exclude, tf.shape(hidden)[:-1], "exclude")
    # The search's width needs n statically; the graph's shapes alone carry it.
    exclude.set_shape(dims)
    log_probs, classes = self._top_k(hidden, exclude)
    return {"classes": tf.cast(classes, tf.int64), "log_probs": tf.cast(log_probs, tf.float32)}

  def _log_prob_fn(self, *tensors):
    tensors = self._checked(tensors, range(len(tensors)))
    name = self.input_names[self._target_index]
    targets = checks.targets_below(tensors[self._target_index], self.num_classes, name)
    hidden, mask = self._hidden(self._features(dict(zip(self.input_names, tensors))))
    targets = checks.same_positions(targets, tf.shape(hidden)[:-1], name)
    if self.ignore_class is not None:  # padding, as the layer reads it: log-prob 0
      targets = tf.where(tf.equal(targets, self.ignore_class), -tf.ones_like(targets),
                         targets)
    if mask is not None:
      targets = tf.where(tf.cast(mask, tf.bool), targets, -tf.ones_like(targets))
    return {"log_prob": self.served.log_prob(hidden, targets)}

  def _log_prob_all_fn(self, *features):
    hidden, _ = self._hidden(self._checked(features, self._feature_indices))
    return {"log_probs": self.served.log_prob_all(hidden)}

  def _sample_fn(self, *args):
    features, seed, temperature = list(args[:-2]), args[-2], args[-1]
    hidden, _ = self._hidden(self._checked(features, self._feature_indices))
    return {"classes": self.served.sample(hidden, seed, temperature)}

  def _make_signatures(self, with_log_prob_all, with_sample, max_exclude):
    all_names = [s.name for s in self._specs]
    self._feature_indices = [i for i in range(len(all_names)) if i != self._target_index]
    feature_specs = [self._specs[i] for i in self._feature_indices]
    extra = ["seed", "temperature"] + (["exclude"] if max_exclude else [])
    for n in all_names + extra:
      if not n.isidentifier():
        raise ValueError(f"input name {n!r} is not usable as a signature key")
    if len(set(all_names)) != len(all_names) or set(extra) & set(all_names):
      raise ValueError(f"the model's input names must be unique and not "
                       f"{'/'.join(extra)}: {all_names}")
    self.top_k = _with_names(self._top_k_fn, feature_specs)
    self.log_prob = _with_names(self._log_prob_fn, self._specs)
    signatures = {"serving_default": self.top_k, "top_k": self.top_k,
                  "log_prob": self.log_prob}
    if with_log_prob_all:
      self.log_prob_all = _with_names(self._log_prob_all_fn, feature_specs)
      signatures["log_prob_all"] = self.log_prob_all
    if with_sample:
      # Scalars declared with an unknown shape, so that their checks are not folded
      # away (checks.conform).
      self.sample = _with_names(self._sample_fn, feature_specs + [
          tf.TensorSpec(None, tf.int64, name="seed"),
          tf.TensorSpec(None, tf.float32, name="temperature")])
      signatures["sample"] = self.sample
    if max_exclude:
      self._max_exclude = max_exclude
      # Every dimension unknown, as the other inputs' (checks.conform checks n).
      self.top_k_excluding = _with_names(self._top_k_excluding_fn, feature_specs + [
          tf.TensorSpec([None] * self._hidden_rank, tf.int64, name="exclude")])
      signatures["top_k_excluding"] = self.top_k_excluding
    return signatures


def _with_names(fn, specs):
  """A tf.function of `fn` whose arguments carry the spec names: signature inputs are
  keyed by the argument names."""
  arg_names = [s.name for s in specs]
  src = (f"def wrapped({', '.join(arg_names)}):\n"
         f"  return fn({', '.join(arg_names)})\n")
  scope = {"fn": fn}
  exec(src, scope)  # pylint: disable=exec-used
  return tf.function(scope["wrapped"], input_signature=specs)


def export(model, directory, k=10, log_prob_all=None, sample=True, max_exclude=0):
  """Writes a SavedModel of `model` that needs nothing of tf_hsm to load and run.

  Args:
    model: a Keras functional model with one `tf_hsm.HierarchicalSoftmax`,
      `tf_hsm.AdaptiveSoftmax` or `tf_hsm.HierarchicalSoftmaxMixture` layer, called once on the
      model's hidden states and one of the model's inputs as its targets, whose output
      is the model's output. A mixture's "top_k" ranks its "log_prob_all" (every class
      of every tree scored, as the layer's `top_k`).
    directory: the folder to write the SavedModel to (a str or path; created if
      missing, its SavedModel files overwritten if present).
    k: an int >= 1, the number of classes the "top_k" signature returns (clamped to
      num_classes). A HierarchicalSoftmax's `ignore_class` is never among them, nor a
      mixture's (its own with a head, its trees' without), as in the layer's `top_k`
      and `inference_model`.
    log_prob_all: whether to add the "log_prob_all" signature; default: when
      num_classes <= `LOG_PROB_ALL_MAX_CLASSES` (1M).
    sample: whether to add the "sample" signature (inputs plus `seed` int64 and
      `temperature` float32 scalars).
    max_exclude: an int >= 0; when > 0, adds the "top_k_excluding" signature, whose
      `exclude` input holds this many class ids per row (pad with -1).

  Signatures (inputs named as the model's inputs, each checked against the model's
  rank and fixed dimensions; docs/serving.md says what each runtime does with bad
  input):
    "top_k" (also "serving_default"): the inputs other than the targets ->
      {"classes": int64 [..., k], "log_probs": float32 [..., k]}, best first; a row with
      a NaN log-probability gets classes -1 and log_probs NaN.
    "log_prob": all inputs -> {"log_prob": [...]}, what the model returns (targets < 0
      give 0; targets must have the positions' shape; a target >= num_classes is an
      InvalidArgumentError in TensorFlow, NaN under XLA and in TFLite).
    "log_prob_all": inputs other than the targets -> {"log_probs": [..., num_classes]}.
    "sample": inputs other than the targets, seed, temperature -> {"classes": [...]}:
      temperature positive and finite (InvalidArgumentError otherwise; -1 everywhere
      under XLA); a row without a distribution (NaN) gets -1.
    "top_k_excluding" (with max_exclude > 0): "top_k"'s inputs and `exclude`, int64
      [..., max_exclude] class ids per position, each leading dimension the positions'
      or 1 (for every position along it), ids < 0 padding -> "top_k"'s outputs without
      the excluded classes (the top k + max_exclude, the excluded ones dropped; a row
      with fewer than k classes left ends in class -1 with log_prob -inf). An id >=
      num_classes is an InvalidArgumentError in TensorFlow; elsewhere it excludes
      nothing.

  Returns:
    The `ServingModule` that was saved.

  Raises:
    TypeError: `model` is not a functional Keras model (a layer, a subclassed model).
    TypeError: log_prob_all or sample not a bool (log_prob_all: or None).
    ValueError: k is not an int >= 1, max_exclude not an int >= 0, a directory that is
      empty, a file or not writable, or a model that cannot be cut at its tf_hsm layer.
  """
  # Checked before the directory is made (ServingModule checks them for its own callers).
  checks.check_options(k, log_prob_all, sample, max_exclude)
  checks.check_model(model)
  directory = checks.check_directory(directory)
  module = ServingModule(model, k=k, log_prob_all=log_prob_all, sample=sample,
                         max_exclude=max_exclude)
  tf.saved_model.save(module, directory, signatures=module._signatures)
  return module
