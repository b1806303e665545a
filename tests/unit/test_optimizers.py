"""tf_hsm.optimizers: LazyAdam, SparseAdagrad and SparseSGD against Keras' Adam, Adagrad
and SGD, lazy (touched-rows-only) updates, O(touched rows) graphs, serialization,
model.fit."""

import collections
import functools
import platform
import shutil
import subprocess

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_hsm
from tf_hsm.ops import loader as _loader
from tf_hsm.keras import losses
from tf_hsm.keras import optimizers
from tf_hsm.keras.layers import HierarchicalSoftmax
from tf_hsm.keras.optimizers import LazyAdam
from tf_hsm.keras.optimizers import _merge_duplicates
from tf_hsm.keras.optimizers import SparseAdagrad
from tf_hsm.keras.optimizers import SparseSGD

_ROWS, _DIM = 30, 4
_MomentumSGD = functools.partial(SparseSGD, momentum=0.9)
_KerasMomentumSGD = functools.partial(keras.optimizers.SGD, momentum=0.9)


def _apply(optimizer, gradients, init, sparse=True, use_function=True):
  """Applies a list of (values, indices) gradients to a fresh variable; returns it."""
  variable = keras.Variable(init)

  def step(values, indices):
    grad = tf.IndexedSlices(values, indices, tf.constant(init.shape, tf.int64))
    optimizer.apply([grad if sparse else tf.convert_to_tensor(grad)], [variable])

  if use_function:
    step = tf.function(step)
  for values, indices in gradients:
    step(tf.constant(values), tf.constant(indices, tf.int64))
  return variable


def _slots(optimizer):
  return [v.numpy() for v in optimizer.variables[2:]]  # after iterations, learning_rate


def _gradients(rng, steps, always=(), extra=8, duplicates=True):
  """Random sparse gradients; rows in `always` are touched on every step."""
  out = []
  for _ in range(steps):
    others = rng.choice(np.setdiff1d(np.arange(_ROWS), always), size=extra, replace=False)
    indices = np.concatenate([np.asarray(always, np.int64), others])
    if duplicates:
      indices = np.concatenate([indices, rng.choice(indices, size=4)])
    rng.shuffle(indices)
    out.append((rng.normal(size=(indices.size, _DIM)).astype(np.float32), indices))
  return out


@pytest.mark.parametrize("use_function", [True, False])
def test_sparse_adagrad_equals_keras_adagrad(rng, use_function, row_path):
  init = rng.normal(size=(_ROWS, _DIM)).astype(np.float32)
  grads = _gradients(rng, 8)
  kwargs = dict(learning_rate=0.1, initial_accumulator_value=0.2, epsilon=1e-6)
  mine = SparseAdagrad(**kwargs)
  ref = keras.optimizers.Adagrad(**kwargs)
  ours = _apply(mine, grads, init, use_function=use_function)
  theirs = _apply(ref, grads, init, sparse=False, use_function=use_function)
  # Duplicate rows may be summed in another order: a few ulps at most.
  np.testing.assert_allclose(ours.numpy(), theirs.numpy(), rtol=1e-6, atol=1e-7)
  for a, b in zip(_slots(mine), _slots(ref)):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


@pytest.fixture(params=["fused", "gather_scatter"])
def row_path(request, monkeypatch):
  """Runs a test with the fused row ops (the CPU path) and with the gathers and scatters
  the optimizers use where those do not apply (variables on a GPU)."""
  if request.param == "gather_scatter":
    monkeypatch.setattr(optimizers, "_fused_ops", lambda variables: None)
  return request.param


def _assert_keras_bits(ours, theirs, row_path):
  """Bit for bit on the gather/scatter path, which runs Keras' own TensorFlow ops. The
  fused ops round each operation correctly (bit for bit the formula in NumPy:
  test_fused_rows_are_the_formula_in_numpy_bit_for_bit), which TensorFlow's vectorised
  kernels do not always do, so they agree with Keras to an ulp or two."""
  if row_path == "fused":
    np.testing.assert_allclose(ours, theirs, rtol=2e-6, atol=1e-7)
  else:
    np.testing.assert_array_equal(ours, theirs)


def test_sparse_adagrad_is_bitwise_keras_adagrad_without_duplicates(rng, row_path):
  init = rng.normal(size=(_ROWS, _DIM)).astype(np.float32)
  grads = _gradients(rng, 6, duplicates=False)
  ours = _apply(SparseAdagrad(0.05), grads, init)
  theirs = _apply(keras.optimizers.Adagrad(0.05), grads, init, sparse=False)
  _assert_keras_bits(ours.numpy(), theirs.numpy(), row_path)
  # Keras' Adagrad given the IndexedSlices itself (unique rows) agrees to an ulp (its
  # sparse path rounds the division differently from its own dense path).
  theirs = _apply(keras.optimizers.Adagrad(0.05), grads, init, sparse=True)
  np.testing.assert_allclose(ours.numpy(), theirs.numpy(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("amsgrad", [False, True])
def test_lazy_adam_equals_adam_on_rows_touched_every_step(rng, amsgrad, row_path):
  init = rng.normal(size=(_ROWS, _DIM)).astype(np.float32)
  always = [0, 3, 7, 11]
  grads = _gradients(rng, 10, always=always)
  kwargs = dict(learning_rate=0.05, beta_1=0.8, beta_2=0.95, epsilon=1e-5, amsgrad=amsgrad)
  mine, ref = LazyAdam(**kwargs), keras.optimizers.Adam(**kwargs)
  ours = _apply(mine, grads, init)
  theirs = _apply(ref, grads, init, sparse=False)
  np.testing.assert_allclose(ours.numpy()[always], theirs.numpy()[always], rtol=1e-6,
                             atol=1e-7)
  for a, b in zip(_slots(mine), _slots(ref)):
    np.testing.assert_allclose(a[always], b[always], rtol=1e-6, atol=1e-7)


def test_lazy_adam_is_bitwise_adam_when_every_row_is_touched(rng, row_path):
  init = rng.normal(size=(_ROWS, _DIM)).astype(np.float32)
  grads = [(rng.normal(size=(_ROWS, _DIM)).astype(np.float32), rng.permutation(_ROWS))
           for _ in range(5)]
  ours = _apply(LazyAdam(0.01), grads, init)
  theirs = _apply(keras.optimizers.Adam(0.01), grads, init, sparse=False)
  _assert_keras_bits(ours.numpy(), theirs.numpy(), row_path)


_SGD_FORMS = [dict(), dict(momentum=0.9), dict(momentum=0.7, nesterov=True)]


@pytest.mark.parametrize("kwargs", _SGD_FORMS)
def test_sparse_sgd_is_bitwise_keras_sgd_on_rows_touched_every_step(rng, kwargs, row_path):
  # Multiplications and subtractions only: TensorFlow's kernels round them correctly
  # too, so both paths give Keras' bits (duplicates included: the dense gradient Keras
  # gets sums them as the optimizer does).
  init = rng.normal(size=(_ROWS, _DIM)).astype(np.float32)
  always = [1, 2, 5, 17]
  grads = _gradients(rng, 8, always=always)
  mine, ref = SparseSGD(0.05, **kwargs), keras.optimizers.SGD(0.05, **kwargs)
  ours = _apply(mine, grads, init)
  theirs = _apply(ref, grads, init, sparse=False)
  np.testing.assert_array_equal(ours.numpy()[always], theirs.numpy()[always])
  for a, b in zip(_slots(mine), _slots(ref)):
    np.testing.assert_array_equal(a[always], b[always])
  if not kwargs:  # without momentum Keras' SGD leaves untouched rows alone too
    np.testing.assert_array_equal(ours.numpy(), theirs.numpy())


def test_sparse_sgd_momentum_is_lazy():
  """A row's momentum neither decays nor moves the row on steps that do not touch it."""
  init = np.zeros((_ROWS, _DIM), np.float32)
  g = np.full((1, _DIM), 2.0, np.float32)
  lr, mu = 0.5, 0.25
  variable = _apply(SparseSGD(lr, momentum=mu), [(g, [3]), (g, [0]), (g, [0]), (g, [3])],
                  init)
  m1 = -lr * 2.0
  m2 = m1 * mu - lr * 2.0
  np.testing.assert_allclose(variable.numpy()[3], m1 + m2, rtol=1e-6)
  keras_variable = _apply(keras.optimizers.SGD(lr, momentum=mu),
                        [(g, [3]), (g, [0]), (g, [0]), (g, [3])], init)
  assert not np.allclose(keras_variable.numpy()[3], m1 + m2)  # Keras' decays in between


@pytest.mark.parametrize("make", [LazyAdam, SparseAdagrad, _MomentumSGD])
def test_untouched_rows_and_slots_are_left_alone(rng, make, row_path):
  init = rng.normal(size=(_ROWS, _DIM)).astype(np.float32)
  optimizer = make(learning_rate=0.1)
  variable = keras.Variable(init)
  optimizer.build([variable])
  before = _slots(optimizer)
  grads = _gradients(rng, 3, extra=5)
  touched = np.unique(np.concatenate([g[1] for g in grads]))
  untouched = np.setdiff1d(np.arange(_ROWS), touched)
  for values, indices in grads:
    optimizer.apply([tf.IndexedSlices(tf.constant(values), tf.constant(indices),
                                      tf.constant([_ROWS, _DIM]))], [variable])
  assert untouched.size > 0
  np.testing.assert_array_equal(variable.numpy()[untouched], init[untouched])
  assert np.all(variable.numpy()[touched] != init[touched])
  for b, a in zip(before, _slots(optimizer)):
    np.testing.assert_array_equal(a[untouched], b[untouched])
    assert np.all(a[touched] != b[touched])


def test_lazy_adam_bias_correction_uses_the_global_step(rng):
  """A row first touched at step 3 gets the step-3 bias correction (as TF-Addons)."""
  init = np.zeros((_ROWS, _DIM), np.float32)
  g = np.full((1, _DIM), 0.5, np.float32)
  lr, b1, b2, eps = 0.1, 0.9, 0.999, 1e-7
  optimizer = LazyAdam(learning_rate=lr, beta_1=b1, beta_2=b2, epsilon=eps)
  grads = [(g, [0]), (g, [0]), (g, [1])]
  variable = _apply(optimizer, grads, init)
  m, v = (1 - b1) * 0.5, (1 - b2) * 0.25
  alpha = lr * np.sqrt(1 - b2**3) / (1 - b1**3)
  np.testing.assert_allclose(variable.numpy()[1], -alpha * m / (np.sqrt(v) + eps), rtol=1e-5)


@pytest.mark.parametrize("make,reference", [(LazyAdam, keras.optimizers.Adam),
                                            (SparseAdagrad, keras.optimizers.Adagrad),
                                            (_MomentumSGD, _KerasMomentumSGD)])
def test_dense_gradients_are_the_parent_optimizer_bit_for_bit(rng, make, reference):
  init = rng.normal(size=(_ROWS, _DIM)).astype(np.float32)
  grads = [(rng.normal(size=(_ROWS, _DIM)).astype(np.float32), np.arange(_ROWS))
           for _ in range(4)]
  ours = _apply(make(0.02), grads, init, sparse=False)
  theirs = _apply(reference(0.02), grads, init, sparse=False)
  np.testing.assert_array_equal(ours.numpy(), theirs.numpy())


@pytest.mark.parametrize("make", [LazyAdam, SparseAdagrad])
def test_duplicate_indices_are_summed(rng, make, row_path):
  init = rng.normal(size=(_ROWS, _DIM)).astype(np.float32)
  values = rng.normal(size=(5, _DIM)).astype(np.float32)
  split = _apply(make(0.1), [(values, [4, 9, 4, 2, 9])], init)
  merged = np.stack([values[0] + values[2], values[1] + values[4], values[3]])
  summed = _apply(make(0.1), [(merged, [4, 9, 2])], init)
  np.testing.assert_allclose(split.numpy(), summed.numpy(), rtol=1e-6, atol=1e-7)


def _graph_tensor_sizes(optimizer, rows, dim, touched):
  variable = keras.Variable(tf.zeros([rows, dim]))
  optimizer.build([variable])

  @tf.function
  def step(values, indices):
    optimizer.apply([tf.IndexedSlices(values, indices, tf.constant([rows, dim], tf.int64))],
                    [variable])

  graph = step.get_concrete_function(tf.TensorSpec([touched, dim]),
                                     tf.TensorSpec([touched], tf.int64)).graph
  sizes = []
  for op in graph.get_operations():
    for out in op.outputs:
      if out.dtype.is_floating and out.shape.is_fully_defined():
        sizes.append(out.shape.num_elements())
  return sizes


@pytest.mark.parametrize("make,reference", [(LazyAdam, keras.optimizers.Adam),
                                            (SparseAdagrad, keras.optimizers.Adagrad),
                                            (_MomentumSGD, _KerasMomentumSGD)])
def test_a_sparse_step_builds_no_table_sized_tensor(make, reference):
  """Per-step work is O(touched rows): no float tensor of the table's size in the graph.

  (Keras' own optimizer, checked the same way, does build them: the check has teeth.)
  """
  rows, dim, touched = 100_003, 3, 5
  assert max(_graph_tensor_sizes(make(), rows, dim, touched)) < rows
  assert max(_graph_tensor_sizes(reference(), rows, dim, touched)) >= rows * dim


@pytest.mark.parametrize("make,kwargs", [(LazyAdam, dict(epsilon=1e-4)),
                                         (SparseAdagrad, dict(epsilon=1e-4)),
                                         (SparseSGD, dict(momentum=0.5, nesterov=True))])
def test_serialization(make, kwargs):
  optimizer = make(learning_rate=0.25, **kwargs)
  config = keras.optimizers.serialize(optimizer)
  assert config["class_name"] == make.__name__ and "tf_hsm" in config["module"] + str(
      config.get("registered_name"))
  restored = keras.optimizers.deserialize(config)
  assert type(restored) is make
  assert restored.get_config() == optimizer.get_config()


@pytest.mark.parametrize("make", [LazyAdam, SparseAdagrad, SparseSGD, _MomentumSGD])
def test_fit_touches_only_the_rows_in_the_batches(rng, make):
  vocab, seq_len = 60, 4
  tree = tf_hsm.Tree.two_level(vocab)
  tokens = keras.Input((seq_len,), dtype="int32")
  targets = keras.Input((seq_len,), dtype="int32")
  embedding = keras.layers.Embedding(vocab, 6)
  hsm = HierarchicalSoftmax(tree)
  model = keras.Model([tokens, targets], hsm(embedding(tokens), targets))
  model.compile(optimizer=make(learning_rate=0.05), loss=losses.nll)
  x = rng.integers(0, vocab // 2, size=(32, seq_len))  # input words from the first half
  y = rng.integers(0, 8, size=(32, seq_len))  # targets in the first clusters only
  table_before, embedding_before = hsm.kernel.numpy(), embedding.embeddings.numpy()
  history = model.fit([x, y], y, batch_size=8, epochs=3, verbose=0)
  assert history.history["loss"][-1] < history.history["loss"][0]
  np.testing.assert_array_equal(embedding.embeddings.numpy()[vocab // 2:],
                                embedding_before[vocab // 2:])
  # A path node's softmax touches all its children's rows.
  visited = {node for c in range(8) for node, _ in tree.path(c)}
  touched = np.concatenate([np.arange(*tree.child_range(n)) for n in sorted(visited)])
  untouched = np.setdiff1d(np.arange(tree.num_slots), touched)
  assert untouched.size > tree.num_slots // 2
  np.testing.assert_array_equal(hsm.kernel.numpy()[untouched], table_before[untouched])
  assert np.all(hsm.kernel.numpy()[touched] != table_before[touched])


def _numpy_merged_rows(indices, grad):
  """The distinct rows of `indices` and their summed gradient rows, each sum started from
  zero and added in the order of `indices` (as tf.math.unsorted_segment_sum adds)."""
  rows = list(dict.fromkeys(indices.tolist()))
  summed = np.zeros((len(rows),) + grad.shape[1:], grad.dtype)
  at = {r: i for i, r in enumerate(rows)}
  for k, r in enumerate(indices.tolist()):
    summed[at[r]] = summed[at[r]] + grad[k]
  return rows, summed


def _numpy_adam_rows(w, m, v, v_hat, indices, grad, alpha, c1, c2, eps):
  """Hsm>SparseAdamRows from its definition: repeated rows summed first, then each
  operation rounded in the dtype, once per distinct row."""
  w, m, v = w.copy(), m.copy(), v.copy()
  v_hat = None if v_hat is None else v_hat.copy()
  for r, g in zip(*_numpy_merged_rows(indices, grad)):
    m[r] = m[r] + (g - m[r]) * c1
    v[r] = v[r] + (g * g - v[r]) * c2
    second = v[r]
    if v_hat is not None:
      v_hat[r] = np.maximum(v_hat[r], v[r])
      second = v_hat[r]
    w[r] = w[r] - (m[r] * alpha) / (np.sqrt(second) + eps)
  return w, m, v, v_hat


def _numpy_sgd_rows(w, m, indices, grad, lr, mu, nesterov):
  w = w.copy()
  m = None if m is None else m.copy()
  for r, g in zip(*_numpy_merged_rows(indices, grad)):
    if m is None:
      w[r] = w[r] - g * lr
      continue
    m[r] = m[r] * mu - g * lr
    w[r] = w[r] + (m[r] * mu - g * lr if nesterov else m[r])
  return w, m


def _numpy_adagrad_rows(w, acc, indices, grad, lr, eps):
  w, acc = w.copy(), acc.copy()
  for r, g in zip(*_numpy_merged_rows(indices, grad)):
    acc[r] = acc[r] + g * g
    w[r] = w[r] - (lr * g) / np.sqrt(acc[r] + eps)
  return w, acc


def _named_rows(rng, layout, n):
  """(number of table rows, n row ids with repeats) for the fused ops' tests.

  "dense": 2,500 ids in 3,000 rows, ~1/3 of the rows named more than once (their sums'
  order of addition matters), enough for the kernel to split them over threads; the ops
  visit Adam's and Adagrad's rows in row order. "sparse": 300 ids drawn from 200 rows
  spread over 60,000, far enough apart (~30 KB a row at D=37) that every op visits them
  in the order given (cc/core/sparse_rows.h, VisitInGradientOrder).
  """
  if layout == "dense":
    return 3000, rng.integers(0, 3000, n)
  named = rng.choice(60000, 200, replace=False)
  return 60000, named[rng.integers(0, named.size, n // 8)]


@pytest.mark.parametrize("layout", ["dense", "sparse"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("amsgrad", [False, True])
def test_fused_rows_are_the_formula_in_numpy_bit_for_bit(rng, dtype, amsgrad, layout):
  dim = 37
  rows, indices = _named_rows(rng, layout, 2500)
  indices = indices.astype(np.int64)
  n = indices.size
  grad = rng.normal(size=(n, dim)).astype(dtype)
  w, m = (rng.normal(size=(rows, dim)).astype(dtype) for _ in range(2))
  v, v_hat = (rng.random(size=(rows, dim)).astype(dtype) for _ in range(2))
  scalars = [dtype(x) for x in (0.01, 0.1, 0.001, 1e-7)]
  expected = _numpy_adam_rows(w, m, v, v_hat if amsgrad else None, indices, grad, *scalars)
  variables = [tf.Variable(x) for x in (w, m, v, v_hat)]
  _loader.ops().hsm_sparse_adam_rows(*[x.handle for x in variables], indices, grad,
                                     *scalars, amsgrad=amsgrad)
  for got, want in zip(variables, expected):
    np.testing.assert_array_equal(got.numpy(), v_hat if want is None else want)

  acc = rng.random(size=(rows, dim)).astype(dtype)
  expected = _numpy_adagrad_rows(w, acc, indices.astype(np.int32), grad, dtype(0.05),
                                 dtype(1e-7))
  variables = [tf.Variable(x) for x in (w, acc)]
  _loader.ops().hsm_sparse_adagrad_rows(*[x.handle for x in variables],
                                        indices.astype(np.int32), grad, dtype(0.05),
                                        dtype(1e-7))
  for got, want in zip(variables, expected):
    np.testing.assert_array_equal(got.numpy(), want)


@pytest.mark.parametrize("layout", ["dense", "sparse"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("kwargs", _SGD_FORMS)
def test_fused_sgd_rows_are_the_formula_in_numpy_bit_for_bit(rng, dtype, kwargs, layout):
  dim = 37
  rows, indices = _named_rows(rng, layout, 2500)
  indices = indices.astype(np.int32)
  n = indices.size
  grad = rng.normal(size=(n, dim)).astype(dtype)
  w, m = (rng.normal(size=(rows, dim)).astype(dtype) for _ in range(2))
  lr, mu = dtype(0.05), dtype(kwargs.get("momentum", 0.0))
  use_momentum = bool(kwargs)
  expected = _numpy_sgd_rows(w, m if use_momentum else None, indices, grad, lr, mu,
                             kwargs.get("nesterov", False))
  variables = [tf.Variable(x) for x in (w, m)]
  _loader.ops().hsm_sparse_sgd_rows(variables[0].handle, variables[1].handle, indices, grad,
                                    lr, mu, use_momentum=use_momentum,
                                    nesterov=kwargs.get("nesterov", False))
  np.testing.assert_array_equal(variables[0].numpy(), expected[0])
  np.testing.assert_array_equal(variables[1].numpy(), m if expected[1] is None else expected[1])


def test_the_cpu_path_runs_the_fused_ops():
  variable = keras.Variable(tf.zeros([10, 3]))
  for make, op in [(LazyAdam, "Hsm>SparseAdamRows"), (SparseAdagrad, "Hsm>SparseAdagradRows"),
                   (SparseSGD, "Hsm>SparseSgdRows"), (_MomentumSGD, "Hsm>SparseSgdRows")]:
    optimizer = make()
    optimizer.build([variable])
    step = tf.function(lambda values, indices, opt=optimizer: opt.apply(
        [tf.IndexedSlices(values, indices, tf.constant([10, 3], tf.int64))], [variable]))
    graph = step.get_concrete_function(tf.TensorSpec([2, 3]),
                                       tf.TensorSpec([2], tf.int64)).graph
    types = {o.type for o in graph.get_operations()}
    types |= {o.type for f in graph._functions.values() for o in f.graph.get_operations()}
    assert op in types, sorted(types)


@pytest.mark.parametrize("make", [LazyAdam, SparseAdagrad, SparseSGD, _MomentumSGD])
def test_a_step_compiled_by_xla_takes_the_gather_scatter_path(rng, make, monkeypatch):
  """XLA has no kernels for the fused row ops: a step compiled with jit_compile=True
  (as Keras compiles one for `model.compile(jit_compile=True)`) updates the rows with
  gathers and scatters, to what that path gives outside XLA."""
  init = rng.normal(size=(_ROWS, _DIM)).astype(np.float32)
  grads = _gradients(rng, 3)

  def run(jit_compile):
    optimizer = make(0.1)
    variable = keras.Variable(init)
    step = tf.function(lambda values, indices: optimizer.apply(
        [tf.IndexedSlices(values, indices, tf.constant(init.shape, tf.int64))], [variable]),
                       jit_compile=jit_compile)
    for values, indices in grads:
      step(tf.constant(values), tf.constant(indices, tf.int64))
    return variable.numpy(), _slots(optimizer)

  compiled, compiled_slots = run(jit_compile=True)
  monkeypatch.setattr(optimizers, "_fused_ops", lambda variables: None)
  expected, expected_slots = run(jit_compile=False)
  # XLA may fuse the elementwise operations differently: equal to rounding.
  np.testing.assert_allclose(compiled, expected, rtol=1e-6, atol=1e-7)
  for a, b in zip(compiled_slots, expected_slots):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
  assert not np.array_equal(compiled, init)


def test_a_keras_model_compiled_with_xla_trains_with_a_sparse_optimizer(rng):
  """Embedding + Dense under model.compile(jit_compile=True): the step is compiled by XLA
  (Keras keeps jit_compile on) and only the embedding rows in the batches move."""
  tokens = keras.Input((3,), dtype="int32")
  hidden = keras.layers.Flatten()(keras.layers.Embedding(_ROWS, _DIM)(tokens))
  model = keras.Model(tokens, keras.layers.Dense(1)(hidden))
  model.compile(optimizer=LazyAdam(0.01), loss="mse", jit_compile=True)
  x = rng.integers(0, _ROWS // 2, size=(16, 3))
  before = model.layers[1].embeddings.numpy()
  model.fit(x, rng.normal(size=(16, 1)), epochs=2, batch_size=8, verbose=0)
  assert model.jit_compile is True
  after = model.layers[1].embeddings.numpy()
  touched = np.unique(x)
  untouched = np.setdiff1d(np.arange(_ROWS), touched)
  np.testing.assert_array_equal(after[untouched], before[untouched])
  assert np.all(after[touched] != before[touched])


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or not shutil.which("objdump"),
                    reason="reads x86-64 code with objdump")
def test_the_row_updates_request_their_rows_in_the_built_library():
  """Each row update asks for the rows it will update a few rows ahead (and, visiting them
  sorted, for the gradient rows). GCC once deleted the loop of requests that the kernels
  pass to the core as a lambda, which no result shows; this reads the op library's code:
  every kernel's functions must hold a prefetch for the variables in each of its two
  visiting orders and one for the gradient (3; there was 1)."""
  library = _loader.loaded_library().path  # the build that runs
  listing = subprocess.run(["objdump", "-d", "--no-show-raw-insn", "-C", library],
                           capture_output=True, text=True, check=True).stdout
  kernels = [kernel + types for kernel in ("SparseSgdRowsOp", "SparseAdamRowsOp",
                                            "SparseAdagradRowsOp")
             for types in ("<float, long>", "<double, int>")]
  prefetches = collections.Counter()
  function = ""
  for line in listing.splitlines():
    if line and not line[0].isspace() and line.endswith(">:"):
      function = line
    elif "prefetch" in line:
      prefetches.update(kernel for kernel in kernels if kernel in function)
  for kernel in kernels:
    assert prefetches[kernel] >= 3, (kernel, prefetches)


def test_fused_row_ops_reject_bad_input():
  ops = _loader.ops()
  var, m, v = (tf.Variable(tf.zeros([5, 2])) for _ in range(3))
  one = tf.constant(0.1)
  grad = tf.ones([2, 2])

  def adam(*handles, indices=(1, 2), gradient=grad):
    ops.hsm_sparse_adam_rows(*handles, tf.constant(indices, tf.int64), gradient, one, one,
                             one, one)

  with pytest.raises(tf.errors.InvalidArgumentError, match=r"indices\[1\] = 5 is not a row"):
    adam(var.handle, m.handle, v.handle, v.handle, indices=(0, 5))
  with pytest.raises(tf.errors.InvalidArgumentError, match=r"indices\[0\] = -1"):
    adam(var.handle, m.handle, v.handle, v.handle, indices=(-1, 0))
  with pytest.raises(tf.errors.InvalidArgumentError, match="gradient must have shape"):
    adam(var.handle, m.handle, v.handle, v.handle, gradient=tf.ones([2, 3]))
  with pytest.raises(tf.errors.InvalidArgumentError, match="must be different variables"):
    adam(var.handle, var.handle, v.handle, v.handle)
  with pytest.raises(tf.errors.InvalidArgumentError, match="v has shape"):
    adam(var.handle, m.handle, tf.Variable(tf.zeros([5, 3])).handle, v.handle)
  with pytest.raises(tf.errors.InvalidArgumentError, match="m has dtype double"):
    adam(var.handle, tf.Variable(tf.zeros([5, 2], tf.float64)).handle, v.handle, v.handle)
  with pytest.raises(tf.errors.InvalidArgumentError, match="learning_rate must be a scalar"):
    ops.hsm_sparse_adagrad_rows(var.handle, m.handle, tf.constant([0], tf.int64),
                                tf.ones([1, 2]), tf.constant([0.1]), one)
  with pytest.raises(tf.errors.InvalidArgumentError, match="must be different variables"):
    ops.hsm_sparse_sgd_rows(var.handle, var.handle, tf.constant([0], tf.int64),
                            tf.ones([1, 2]), one, one, use_momentum=True)
  with pytest.raises(tf.errors.InvalidArgumentError, match="momentum_var has shape"):
    ops.hsm_sparse_sgd_rows(var.handle, tf.Variable(tf.zeros([4, 2])).handle,
                            tf.constant([0], tf.int64), tf.ones([1, 2]), one, one,
                            use_momentum=True)
  with pytest.raises(tf.errors.InvalidArgumentError, match=r"indices\[0\] = 7"):
    ops.hsm_sparse_sgd_rows(var.handle, m.handle, tf.constant([7], tf.int64),
                            tf.ones([1, 2]), one, one)
  np.testing.assert_array_equal(var.numpy(), np.zeros([5, 2]))  # nothing was written


@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
def test_fused_rows_sum_repeats_as_the_merge_before_them_did(rng, index_dtype):
  """The ops' own merge of repeated rows gives the bits of `_merge_duplicates` (tf.unique
  and a segment sum) followed by the ops on distinct rows."""
  rows, dim, n = 2000, 19, 3000
  indices = rng.integers(0, rows, n).astype(index_dtype)
  grad = rng.normal(size=(n, dim)).astype(np.float32)
  start = [rng.normal(size=(rows, dim)).astype(np.float32)] + [
      rng.random(size=(rows, dim)).astype(np.float32) for _ in range(3)]
  merged = _merge_duplicates(tf.IndexedSlices(grad, indices), tf.float32)
  scalars = [np.float32(x) for x in (0.01, 0.1, 0.001, 1e-7)]
  results = []
  for ids, values in [(indices, grad), merged]:
    variables = [tf.Variable(x) for x in start]
    _loader.ops().hsm_sparse_adam_rows(*[x.handle for x in variables], ids, values, *scalars,
                                       amsgrad=True)
    results.append([x.numpy() for x in variables])
  for got, want in zip(*results):
    np.testing.assert_array_equal(got, want)


def test_fused_rows_keep_the_merged_sums_signs_of_zero(rng):
  """A row named once reaches the update as its gradient row itself, not as the merge's
  0 + g: where g is -0 the result must still be the merged sum's bits (+0), which decide
  the sign of a table entry that is -0. Compared as bits (assert_array_equal calls -0
  and +0 equal)."""
  rows, dim = 400, 8
  indices = np.concatenate([np.arange(0, 300), np.arange(0, 50)]).astype(np.int64)
  grad = rng.normal(size=(len(indices), dim)).astype(np.float32)
  grad[::3] = -0.0
  grad[:, ::2] = -0.0
  w = rng.normal(size=(rows, dim)).astype(np.float32)
  w[:, :4] = -0.0
  m = np.full((rows, dim), -0.0, np.float32)
  acc = rng.random(size=(rows, dim)).astype(np.float32)

  def same_bits(got, want):
    np.testing.assert_array_equal(np.asarray(got).view(np.uint32), want.view(np.uint32))

  lr, mu = np.float32(0.05), np.float32(0.9)
  for use_momentum, nesterov in [(False, False), (True, False), (True, True)]:
    want = _numpy_sgd_rows(w, m if use_momentum else None, indices, grad, lr, mu, nesterov)
    variables = [tf.Variable(w), tf.Variable(m)]
    _loader.ops().hsm_sparse_sgd_rows(variables[0].handle, variables[1].handle, indices,
                                      grad, lr, mu, use_momentum=use_momentum,
                                      nesterov=nesterov)
    same_bits(variables[0].numpy(), want[0])
    same_bits(variables[1].numpy(), m if want[1] is None else want[1])
  want = _numpy_adagrad_rows(w, acc, indices, grad, lr, np.float32(1e-7))
  variables = [tf.Variable(w), tf.Variable(acc)]
  _loader.ops().hsm_sparse_adagrad_rows(*[x.handle for x in variables], indices, grad, lr,
                                        np.float32(1e-7))
  for got, expected in zip(variables, want):
    same_bits(got.numpy(), expected)
  scalars = [np.float32(x) for x in (0.01, 0.1, 0.001, 1e-7)]
  want = _numpy_adam_rows(w, m, acc, None, indices, grad, *scalars)
  variables = [tf.Variable(x) for x in (w, m, acc)]
  _loader.ops().hsm_sparse_adam_rows(*[x.handle for x in variables], variables[2].handle,
                                     indices, grad, *scalars, amsgrad=False)
  for got, expected in zip(variables, want[:3]):
    same_bits(got.numpy(), expected)
