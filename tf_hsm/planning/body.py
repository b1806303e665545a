"""The rest of the model: what the layers before the output layer (the body) cost a
training step, from a Keras model inspected by duck typing (its `layers`, each layer's
class name, `weights` shapes, input and output shapes and a few attributes): no
TensorFlow or Keras is imported here.

    body = body_cost(model, tokens_per_step)          # a `Body`
    body.params, body.flops, body.activations         # elements, forward+backward FLOPs
    body_price(body, "lazy_adam", "float32", machine)  # {"step_seconds", "peak_bytes", ...}

`model` is either the body itself (its output: the hidden states [..., D]) or a model
holding a tf_hsm output layer (a layer whose class is named `HierarchicalSoftmax`,
`HierarchicalSoftmaxMixture` or `AdaptiveSoftmax`): its body is every other layer, its hidden states that layer's
first input. The batch is `tokens_per_step` over the positions of the hidden states
(a [B, S, D] output scores B x S tokens a step).

A model built for sequences of any length (`keras.Input([None])`, as most language
models are) leaves the positions unknown. Where the body's cost does not depend on how
the step's tokens split into sequences (embeddings, dense and normalisation layers: a
position costs the same in any sequence), the step is priced as one sequence of
`tokens_per_step` positions. A recurrent or attention layer costs by the sequence
length (a loop step per position; scores S^2 a sequence), and so does a body whose
unknown positions are not the hidden states' (a history pooled into one vector): there
`sequence_length` must be given, and every unknown position dimension takes it.

Each layer kind's work (forward and backward: 2 FLOPs a multiply-add forward, 4 back):

- Dense, EinsumDense: rows x kernel elements multiply-adds (rows: the input's
  positions; an EinsumDense's kernel taken as a Dense's);
- Embedding: a gather of the output and a scatter of its gradient (bytes, no FLOPs),
  a sparse gradient over the distinct ids of the step;
- LSTM, GRU (gates 4, 3): rows x gates x units x (input + units) multiply-adds, and a
  fixed cost per time step (`RNN_STEP_LOOPS`, forward and backward): the recurrence
  runs one [B, units] product a step, far below the matmul rate;
- MultiHeadAttention: the query, key, value and output projections, and B x heads x S^2
  x (key_dim + value_dim) for the scores and their weighted sum; the scores go through a
  softmax (priced a logit as the machine's softmax cross-entropy);
- LayerNormalization, BatchNormalization, and layers without weights (Dropout, Add,
  Activation, Reshape, pooling): bytes of their output (read and written, forward and
  backward);
- Conv1D: output positions x kernel elements multiply-adds;
- any other layer with weights: priced as a Dense of as many weights (rows x weights
  multiply-adds), with a note.

A step's time is the sum over layers of max(FLOPs / matmul rate (attention's per-head
products at ATTENTION_RATE of it), bytes / read bandwidth) + softmax seconds + time
steps x RNN_STEP_LOOPS + LAYER_LOOPS a layer (in the machine's loop steps), the
optimizer's update of every weight (bytes; `moved_elements`), and FIT_STEP_LOOPS for
Keras' own step. Its peak: weights, gradients, slots, the activations every layer keeps
for the backward, and FIT_BYTES.
"""

import dataclasses

import numpy as np

from tf_hsm.planning import machine as machine_lib
from tf_hsm.planning.costs import DTYPE_BYTES, OPTIMIZERS, Part, moved_elements

# The output layers whose inputs are the hidden states, by class name (duck typing).
OUTPUT_LAYERS = ("HierarchicalSoftmax", "HierarchicalSoftmaxMixture", "AdaptiveSoftmax")
# Costs the roofline does not see, in iterations of the machine's loop probe
# (`Machine.loop_step_seconds`: the dispatch of a few small ops, which other jobs on the
# CPU slow as they slow these): a recurrent layer's time step, forward and backward (a
# loop iteration of a few dozen small ops), a layer's own ops in the step (forward,
# backward, its variables' updates), and Keras' own step (the train function, the loss,
# the metrics' updates). Set from `model.fit` steps of the three models of
# `python -m tf_hsm.bench.plan_verify --bodies` (docs/planner.md) on a quiet AMD EPYC
# vCPU, where an iteration took 5.7-5.8 us. DEFAULT_LOOP_STEP_SECONDS prices a machine
# given without a probe: the step of the loaded machine where these costs were first set
# as 0.7, 0.3 and 5 ms. Also set there: the fraction of the matmul rate attention's
# batched per-head products reach (einsums over [S, key_dim] blocks), and what
# `model.fit` holds beyond the model's tensors (its traced train function, the data
# adapter: 45 MiB).
RNN_STEP_LOOPS = 27
LAYER_LOOPS = 11.5
FIT_STEP_LOOPS = 190
DEFAULT_LOOP_STEP_SECONDS = 26e-6
ATTENTION_RATE = 0.2
FIT_BYTES = 45 * 2**20
_GATES = {"LSTM": 4, "GRU": 3, "SimpleRNN": 1, "CuDNNLSTM": 4, "CuDNNGRU": 3}
_NORMS = ("LayerNormalization", "BatchNormalization", "RMSNormalization",
          "GroupNormalization", "UnitNormalization")
_SKIP = ("InputLayer",)
# The layers whose cost depends on the sequence length, not only on the tokens a step.
_BY_LENGTH = tuple(_GATES) + ("Bidirectional", "MultiHeadAttention")


@dataclasses.dataclass
class LayerCost:
  """One body layer's work a step: its weights (`parts`), FLOPs (forward and
  backward), bytes it moves besides its weights, elements it keeps for the backward,
  softmax elements (attention scores), recurrent time steps, and how it was priced."""
  name: str
  kind: str
  parts: list
  flops: float = 0.0
  bytes_elements: float = 0.0
  activations: float = 0.0
  softmax: float = 0.0
  rnn_steps: float = 0.0
  attention_flops: float = 0.0
  priced_as: str = ""

  @property
  def params(self):
    return sum(p.elements for p in self.parts)

  @property
  def total_flops(self):
    return self.flops + self.attention_flops


@dataclasses.dataclass
class Body:
  """The body's layers' costs, the batch and the hidden states' shape, and notes (the
  layers priced by their parameter count, and the like)."""
  layers: list
  batch: int
  hidden_shape: tuple
  notes: list = dataclasses.field(default_factory=list)
  output_layer: str = None  # the tf_hsm layer's class name, when the model held one
  num_classes: int = None  # its num_classes, when it has one
  ignore_class: int = None  # its ignore_class
  has_ignore_class: bool = False  # whether it has one (AdaptiveSoftmax orders classes)

  @property
  def params(self):
    return sum(layer.params for layer in self.layers)

  @property
  def flops(self):
    return sum(layer.total_flops for layer in self.layers)

  @property
  def activations(self):
    return sum(layer.activations for layer in self.layers)

  @property
  def hidden(self):
    return int(self.hidden_shape[-1])


def _prod(values):
  out = 1
  for v in values:
    out *= int(v)
  return out


def _shape(value):
  """A KerasTensor's (or a list of them: the first) shape as a tuple, None for the
  batch."""
  if isinstance(value, (list, tuple)) and value and not isinstance(value[0], (int,
                                                                               type(None))):
    value = value[0]
  if isinstance(value, dict):
    value = next(iter(value.values()))
  shape = getattr(value, "shape", value)
  return tuple(None if d is None else int(d) for d in shape)


def _io_shape(layer, which):
  try:
    return _shape(getattr(layer, which))
  except (AttributeError, ValueError, TypeError, RuntimeError):
    return None


def _weights(layer):
  """(name, elements, trainable) of the layer's own weights."""
  out = []
  trainable = {id(w) for w in getattr(layer, "trainable_weights", [])}
  for w in getattr(layer, "weights", []):
    out.append((getattr(w, "path", None) or getattr(w, "name", "w"),
                float(_prod(w.shape)), id(w) in trainable))
  return out


def _dense_parts(layer):
  return [Part(name, n, n, True) for name, n, trainable in _weights(layer) if trainable]


def _filled(shape, length):
  """`shape` with each unknown dimension but the batch's taken as `length`."""
  return shape[:1] + tuple(length if d is None else d for d in shape[1:])


def _layer_shapes(layer):
  """(input shape, output shape) of a body layer, or a ValueError naming it."""
  kind = type(layer).__name__
  in_shape, out_shape = _io_shape(layer, "input"), _io_shape(layer, "output")
  if in_shape is None or out_shape is None:
    raise ValueError(f"layer {getattr(layer, 'name', kind)!r} ({kind}) has no input or "
                     "output shape: build the model (call it on an Input, or on data) "
                     "before planning it")
  return in_shape, out_shape


def _layer_cost(layer, batch, length, notes):
  kind = type(layer).__name__
  name = getattr(layer, "name", kind)
  in_shape, out_shape = (_filled(s, length) for s in _layer_shapes(layer))
  rows_in = batch * _prod(in_shape[1:-1])
  rows_out = batch * _prod(out_shape[1:-1])
  out_elements = float(batch * _prod(out_shape[1:]))
  weights = _weights(layer)
  params = sum(n for _, n, trainable in weights if trainable)
  cost = LayerCost(name, kind, _dense_parts(layer), priced_as=kind)
  if kind in ("Dense", "EinsumDense"):
    kernel = max((n for _, n, t in weights if t), default=0.0)
    cost.flops = 6.0 * rows_in * kernel
    cost.bytes_elements = 2.0 * (rows_in * in_shape[-1] + out_elements)
    cost.activations = out_elements
  elif kind == "Embedding":
    vocab, width = (int(d) for d in layer.embeddings.shape)
    ids = float(batch * _prod(in_shape[1:]))
    touched = min(float(vocab), ids)  # distinct ids at most: an upper bound
    cost.parts = [Part(name + "/embeddings", float(vocab * width), touched * width, False)]
    cost.bytes_elements = 3.0 * out_elements  # gather, its gradient, the scatter
    cost.activations = 0.0
  elif kind in _GATES or kind in ("Bidirectional",):
    inner = getattr(layer, "forward_layer", None) or layer
    directions = 2 if kind == "Bidirectional" else 1
    rnn_kind = type(getattr(inner, "cell", inner)).__name__.replace("Cell", "")
    gates = _GATES.get(kind if kind in _GATES else rnn_kind, 4)
    units = int(getattr(inner, "units", None) or getattr(inner.cell, "units"))
    steps = int(in_shape[1]) if len(in_shape) > 2 and in_shape[1] else 1
    rows = batch * steps
    cost.flops = directions * 6.0 * rows * gates * units * (in_shape[-1] + units)
    cost.bytes_elements = directions * 4.0 * rows * gates * units
    cost.activations = directions * rows * (gates + 3) * units  # gates, c, h, tanh(c)
    cost.rnn_steps = directions * steps
    cost.priced_as = f"{kind}: {gates} gates x {units} units, {steps} steps"
  elif kind == "MultiHeadAttention":
    heads = int(layer.num_heads)
    key_dim = int(layer.key_dim)
    value_dim = int(getattr(layer, "value_dim", None) or key_dim)
    seq = int(in_shape[1]) if len(in_shape) > 2 else 1
    dim = in_shape[-1]
    projections = rows_in * dim * heads * (2 * key_dim + value_dim) + (
        rows_out * heads * value_dim * out_shape[-1])
    scores = float(batch * heads * seq * seq)
    cost.flops = 6.0 * projections
    # The per-head products, at ATTENTION_RATE of the matmul rate: counted as that many
    # times the FLOPs (`flops` keeps the true count in `attention_flops`).
    cost.attention_flops = 6.0 * scores * (key_dim + value_dim)
    cost.softmax = scores
    cost.bytes_elements = 4.0 * scores + 2.0 * rows_in * heads * (2 * key_dim + value_dim)
    cost.activations = 2.0 * scores + rows_in * heads * (2 * key_dim + 2 * value_dim)
    cost.priced_as = f"MultiHeadAttention: {heads} heads x {key_dim}, {seq} positions"
  elif kind == "Conv1D":
    kernel = max((n for _, n, t in weights if t), default=0.0)
    cost.flops = 6.0 * rows_out * kernel
    cost.bytes_elements = 2.0 * (rows_in * in_shape[-1] + out_elements)
    cost.activations = out_elements
  elif kind in _NORMS or not params:
    cost.bytes_elements = 6.0 * out_elements
    cost.activations = out_elements if kind in _NORMS or kind == "Dropout" else 0.0
    cost.priced_as = kind if kind in _NORMS else f"{kind}: elementwise"
  else:
    cost.flops = 6.0 * rows_in * params
    cost.bytes_elements = 2.0 * (rows_in * in_shape[-1] + out_elements)
    cost.activations = out_elements
    cost.priced_as = f"{kind}: unknown, priced as a Dense of its {params:,.0f} weights"
    notes.append(f"body layer {name!r} ({kind}) is not a kind the planner knows: priced "
                 f"by its parameter count, as a Dense of {params:,.0f} weights over its "
                 f"{rows_in:,} input rows")
  return cost


def find_output_layer(model):
  """The model's tf_hsm output layer (class name in OUTPUT_LAYERS, also subclasses),
  or None."""
  for layer in getattr(model, "layers", []):
    for cls in type(layer).__mro__:
      if cls.__name__ in OUTPUT_LAYERS:
        return layer
  return None


def body_cost(model, tokens_per_step, sequence_length=None):
  """The `Body` of `model` (a Keras model, built): the body's layers' costs for a step
  of `tokens_per_step` scored outputs, sequences of `sequence_length` positions where
  the model leaves their length unknown (see the module's docstring).

  Raises:
    ValueError: a model without layers or shapes, tokens that are not a multiple of
      the hidden states' positions, and a model of unknown sequence length whose cost
      depends on it, given no `sequence_length`.
  """
  layers = list(getattr(model, "layers", None) or [])
  if not layers:
    raise ValueError(f"model must be a built Keras model with layers, got "
                     f"{type(model).__name__}")
  output = find_output_layer(model)
  if output is not None:
    hidden_shape = _io_shape(output, "input")
    body_layers = [l for l in layers
                   if l is not output and type(l).__name__ not in _SKIP]
  else:
    hidden_shape = _shape(getattr(model, "output"))
    body_layers = [l for l in layers if type(l).__name__ not in _SKIP]
  T = int(tokens_per_step)
  notes = []
  length = _sequence_length(body_layers, hidden_shape, T, sequence_length, notes)
  hidden_shape = _filled(hidden_shape, length)
  positions = _prod(hidden_shape[1:-1])
  if T % positions:
    raise ValueError(f"tokens_per_step={T} is not a multiple of the hidden states' "
                     f"{positions} positions (shape {hidden_shape})")
  batch = T // positions
  costs = [_layer_cost(layer, batch, length, notes) for layer in body_layers]
  num_classes = None
  if output is not None:
    num_classes = getattr(output, "num_classes", None)
    if num_classes is None:
      tree = getattr(output, "tree", None)
      num_classes = getattr(tree, "num_classes", None)
  ignore_class = getattr(output, "ignore_class", None)
  return Body(costs, batch, hidden_shape, notes,
              type(output).__name__ if output is not None else None,
              int(num_classes) if num_classes is not None else None,
              int(ignore_class) if ignore_class is not None else None,
              hasattr(output, "ignore_class"))


def _sequence_length(body_layers, hidden_shape, tokens, sequence_length, notes):
  """The length every unknown position dimension takes (None where there is none):
  `sequence_length`, or the step's tokens as one sequence where the body's cost does
  not depend on the split."""
  def unknown(shape):
    return sum(d is None for d in shape[1:])

  shapes = [s for layer in body_layers for s in _layer_shapes(layer)]
  if not any(unknown(s) for s in shapes + [hidden_shape]):
    if sequence_length is not None:
      raise ValueError(f"sequence_length={sequence_length!r} was given, but the model's "
                       f"shapes are all known (hidden states {hidden_shape}): it is for "
                       "a model built for sequences of any length (keras.Input([None]))")
    return None
  if sequence_length is not None:
    if isinstance(sequence_length, bool) or not isinstance(
        sequence_length, (int, np.integer)) or sequence_length < 1:
      raise ValueError(f"sequence_length must be a positive int, got {sequence_length!r}")
    return int(sequence_length)
  by_length = [f"{getattr(l, 'name', '?')!r} ({type(l).__name__})" for l in body_layers
               if type(l).__name__ in _BY_LENGTH]
  if (by_length or unknown(hidden_shape) != 1 or
      any(unknown(s) > 1 for s in shapes)):
    why = (f"its layer {by_length[0]} costs by the sequence length" if by_length else
           "its unknown dimensions are not one sequence of the hidden states")
    raise ValueError(
        f"the model takes sequences of any length (hidden states {hidden_shape}) and "
        f"{why}: give the length of a step's sequences, plan(..., sequence_length=S), "
        f"with tokens_per_step={tokens} a multiple of it (the batch times S)")
  known = _prod(d for d in hidden_shape[1:-1] if d is not None)
  if tokens % known:
    raise ValueError(f"tokens_per_step={tokens} is not a multiple of the hidden states' "
                     f"{known} positions a sequence step (shape {hidden_shape})")
  notes.append(f"the model takes sequences of any length: planned as the step's "
               f"{tokens:,} tokens in one sequence (its layers cost the same at any "
               "batch and length)")
  return tokens // known


def body_price(body, optimizer="sgd", dtype="float32", machine=None):
  """The body's figures a step on `machine`: params, FLOPs, activation bytes, bytes
  moved, step seconds, peak bytes (weights, gradients, slots, activations), and a row
  per layer."""
  if optimizer not in OPTIMIZERS:
    raise ValueError(f"optimizer must be one of {sorted(OPTIMIZERS)}, got {optimizer!r}")
  machine = machine_lib.resolve(machine)
  loop_step = machine.loop_step_seconds or DEFAULT_LOOP_STEP_SECONDS
  rnn_step, layer_seconds = RNN_STEP_LOOPS * loop_step, LAYER_LOOPS * loop_step
  fit_step = FIT_STEP_LOOPS * loop_step
  b = DTYPE_BYTES[dtype]
  slots = OPTIMIZERS[optimizer]
  seconds = 0.0
  moved_total = 0.0
  layers = []
  for layer in body.layers:
    moved = (layer.bytes_elements + sum(moved_elements(p, optimizer)
                                        for p in layer.parts)) * b
    flop_seconds = (layer.flops + layer.attention_flops / ATTENTION_RATE) / (
        machine.matmul_flops)
    s = (max(flop_seconds, moved / machine.read_bytes) +
         layer.softmax * machine.softmax_seconds + layer.rnn_steps * rnn_step +
         layer_seconds)
    seconds += s
    moved_total += moved
    layers.append({"name": layer.name, "kind": layer.kind, "priced_as": layer.priced_as,
                   "params": layer.params, "flops": layer.total_flops,
                   "activation_bytes": layer.activations * b, "bytes_moved": moved,
                   "step_seconds": s})
  params = body.params * b
  grads = sum((p.elements if p.dense_grad else p.touched)
              for layer in body.layers for p in layer.parts) * b
  activation_bytes = body.activations * b
  seconds += fit_step
  return {"params": body.params, "param_bytes": params, "grad_bytes": grads,
          "slot_bytes": slots * params, "flops": body.flops,
          "activation_bytes": activation_bytes, "bytes_moved": moved_total,
          "step_seconds": seconds, "fit_step_seconds": fit_step,
          "peak_bytes": params + grads + slots * params + activation_bytes + FIT_BYTES,
          "batch": body.batch, "hidden_shape": list(body.hidden_shape),
          "layers": layers}


def describe(priced):
  """One line: the body's parameters, FLOPs, activations and step time."""
  return (f"body: {priced['params']:,.0f} parameters, {priced['flops'] / 1e9:,.2f} GFLOP "
          f"a step, activations {priced['activation_bytes'] / 2**20:,.1f} MiB, "
          f"{priced['step_seconds'] * 1e3:,.1f} ms a step predicted "
          f"(batch {priced['batch']:,}, hidden states {tuple(priced['hidden_shape'])})")

