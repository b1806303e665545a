"""tf_hsm.serving.top_k's best-first search: exact against the op and log_prob_all on every
tree kind with the dense prefix at every depth, its ties, the fallback for rows it cannot
prove (iterations, frontier and dropped nodes), XLA, and LiteRT with TFLite builtins only."""

import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tf_hsm  # pylint: disable=wrong-import-position
from oracle import random_inputs, trees_of_every_kind  # pylint: disable=wrong-import-position
from tf_hsm import serving  # pylint: disable=wrong-import-position
from tf_hsm.serving import hsm  # pylint: disable=wrong-import-position

_TREES = trees_of_every_kind(np.random.default_rng(63))


def _check(values, classes, full, k, tol):
  """values are the sorted top k of full; classes the top-k set wherever the k-th and
  (k+1)-th values differ by more than tol, and give those values."""
  values, classes = np.asarray(values), np.asarray(classes)
  ranked = -np.sort(-full, -1)
  np.testing.assert_allclose(values, ranked[:, :k], rtol=tol, atol=tol)
  order = np.argsort(-full, -1, kind="stable")
  for row in range(len(full)):
    if k == full.shape[1] or ranked[row, k - 1] - ranked[row, k] > tol:
      assert set(classes[row].tolist()) == set(order[row, :k].tolist()), row
    np.testing.assert_allclose(full[row, classes[row]], values[row], rtol=tol, atol=tol)


@pytest.fixture(params=[0, 30, hsm.PREFIX_SLOTS], ids=["root_only", "prefix30", "default"])
def prefix(request, monkeypatch):
  """The dense prefix at its least (the root), a few levels, and the default."""
  monkeypatch.setattr(hsm, "PREFIX_SLOTS", request.param)
  return request.param


@pytest.mark.parametrize("name,tree", _TREES, ids=[n for n, _ in _TREES])
def test_best_first_matches_the_op(name, tree, prefix, rng):
  del name, prefix
  for dtype, bias in ((np.float32, True), (np.float64, False)):
    hidden, weights, biases, _ = random_inputs(rng, tree, (9,), 5, dtype, bias)
    hidden[:3] *= 4.0          # confident rows next to flat ones
    full = tf_hsm.log_prob_all(hidden, weights, biases, tree).numpy()
    tol = 1e-4 if dtype == np.float32 else 1e-10
    for k in sorted({1, min(4, tree.num_classes), tree.num_classes}):
      values, classes = serving.top_k(hidden, weights, biases, tree, k)
      op_values, _ = tf_hsm.top_k(hidden, weights, biases, tree, k)
      np.testing.assert_allclose(values, op_values, rtol=tol, atol=tol)
      _check(values, classes, full, k, tol)
      # Where the search proves a row, its answer needs no fallback.
      got_v, got_c, proved, _ = hsm._best_first(  # pylint: disable=protected-access
          hsm.stock_tree(tree), tf.constant(hidden), tf.constant(weights),
          None if biases is None else tf.constant(biases), k)
      proved = proved.numpy()
      np.testing.assert_array_equal(got_c.numpy()[proved], classes.numpy()[proved])
      np.testing.assert_allclose(got_v.numpy()[proved], values.numpy()[proved], rtol=tol,
                                 atol=tol)


@pytest.mark.parametrize("limits", [dict(SEARCH_ITERATIONS=1), dict(FRONTIER_START=1, EXPAND=1),
                                    dict(KEEP_NODES=1), dict(EXPAND=1, SEARCH_ITERATIONS=2)],
                         ids=["one_iteration", "small_start", "keep_one", "expand_one"])
def test_rows_the_search_cannot_prove_get_the_exact_path(limits, monkeypatch, rng):
  monkeypatch.setattr(hsm, "PREFIX_SLOTS", 0)
  for name, value in limits.items():
    monkeypatch.setattr(hsm, name, value)
  tree = tf_hsm.Tree.huffman(rng.integers(1, 1000, 300), branching=4)
  hidden, weights, biases, _ = random_inputs(rng, tree, (12,), 6, np.float64)
  hidden[:6] *= 0.05       # nearly uniform rows
  k = 5
  _, _, proved, _ = hsm._best_first(  # pylint: disable=protected-access
      hsm.stock_tree(tree), tf.constant(hidden), tf.constant(weights), tf.constant(biases), k)
  assert not proved.numpy().all()
  values, classes = serving.top_k(hidden, weights, biases, tree, k)
  _check(values, classes, tf_hsm.log_prob_all(hidden, weights, biases, tree).numpy(), k,
         1e-10)


@pytest.mark.parametrize("name,tree", [t for t in _TREES if t[0] in
                                       ("mixed", "huffman", "two_level", "chains", "binary")])
def test_ties_in_increasing_class_order(name, tree, prefix):
  del name, prefix
  hidden = np.ones((2, 3), np.float32)
  weights = np.zeros((tree.num_slots, 3), np.float32)   # every node uniform
  k = min(5, tree.num_classes)
  values, classes = serving.top_k(hidden, weights, None, tree, k)
  op_values, op_classes = tf_hsm.top_k(hidden, weights, None, tree, k)
  np.testing.assert_allclose(values, op_values, rtol=1e-5, atol=1e-6)
  full = tf_hsm.log_prob_all(hidden, weights, None, tree).numpy()
  for row in range(2):
    ranked = np.lexsort((np.arange(full.shape[1]), -full[row]))
    np.testing.assert_array_equal(classes[row], ranked[:k])
    np.testing.assert_array_equal(op_classes[row], ranked[:k])


def _confident_problem(rng, classes=3000, dim=16, batch=32):
  counts = 1.0 / np.arange(1, classes + 1)
  tree = tf_hsm.Tree.huffman(counts, branching=8)
  weights = (rng.standard_normal((tree.num_slots, dim)) / np.sqrt(dim)).astype(np.float32)
  hidden = (rng.standard_normal((batch, dim)) / np.sqrt(dim)).astype(np.float32)
  for row, c in enumerate(rng.choice(classes, size=batch, p=counts / counts.sum())):
    hidden[row] += 3.0 * weights[[s for _, s in tree.path(int(c))]].sum(0)
  return tree, hidden, weights


def test_confident_rows_are_proved_by_the_search(monkeypatch, rng):
  monkeypatch.setattr(hsm, "PREFIX_SLOTS", 100)
  tree, hidden, weights = _confident_problem(rng)
  _, _, proved, steps = hsm._best_first(  # pylint: disable=protected-access
      hsm.stock_tree(tree), tf.constant(hidden), tf.constant(weights), None, 10)
  assert proved.numpy().all() and 0 < int(steps) <= hsm.SEARCH_ITERATIONS
  values, classes = serving.top_k(hidden, weights, None, tree, 10)
  _check(values, classes, tf_hsm.log_prob_all(hidden, weights, None, tree).numpy(), 10, 1e-4)


@pytest.mark.parametrize("k", [40, 100])
@pytest.mark.parametrize("take", ["compare", "sort"])
def test_a_large_k_is_proved_by_the_search_sized_for_it(k, take, monkeypatch, rng):
  # A search sized for k = 10 proved no row at k = 32 on a million classes: every row
  # went to the beams, one row at a time (50x the time); its sizes grow with k. The
  # frontier's taken columns by a compare (small sizes) or by the sorts (large ones).
  monkeypatch.setattr(hsm, "TAKE_BY_COMPARE", 1 << 30 if take == "compare" else 0)
  tree, hidden, weights = _confident_problem(rng, classes=20_000, batch=16)
  hidden *= 0.5           # less peaked: the top k spread over many nodes
  _, _, proved, _ = hsm._best_first(  # pylint: disable=protected-access
      hsm.stock_tree(tree), tf.constant(hidden), tf.constant(weights), None, k)
  assert proved.numpy().mean() >= 0.9, proved.numpy()
  values, classes = serving.top_k(hidden, weights, None, tree, k)
  _check(values, classes, tf_hsm.log_prob_all(hidden, weights, None, tree).numpy(), k, 1e-4)


@pytest.mark.parametrize("tight", [False, True], ids=["proved", "fallback"])
def test_under_xla_the_same_results(tight, monkeypatch, rng):
  monkeypatch.setattr(hsm, "PREFIX_SLOTS", 0)
  if tight:
    monkeypatch.setattr(hsm, "SEARCH_ITERATIONS", 2)
  tree, hidden, weights = _confident_problem(rng, classes=500, batch=8)
  hidden[:2] *= 0.05

  def run(hidden):
    return serving.top_k(hidden, weights, None, tree, 6)

  eager = run(tf.constant(hidden))
  xla = tf.function(run, jit_compile=True)(tf.constant(hidden))
  np.testing.assert_allclose(xla[0], eager[0], rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(xla[1], eager[1])
  _check(eager[0], eager[1], tf_hsm.log_prob_all(hidden, weights, None, tree).numpy(), 6, 1e-4)


def test_under_xla_with_rows_of_a_lookup(rng):
  """The rows gathered from a table by ids inside the compiled function (an exported
  model's Embedding), whose count XLA does not fold to a constant: the search needs no
  shape at compile time (a scatter's did: "must be a compile-time constant")."""
  tree, hidden, weights = _confident_problem(rng, classes=1000, batch=12)
  ids = tf.constant(np.arange(12, dtype=np.int32).reshape(3, 4))
  table = tf.Variable(hidden)

  @tf.function(input_signature=[tf.TensorSpec([None, None], tf.int32)])
  def run(ids):  # traced for any shape, as an exported signature is
    rows = tf.reshape(tf.nn.embedding_lookup(table, ids), [-1, hidden.shape[1]])
    return serving.top_k(rows, weights, None, tree, 6)

  eager = run(ids)
  xla = tf.function(lambda ids: run(ids), jit_compile=True)(ids)
  np.testing.assert_allclose(xla[0], eager[0], rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(xla[1], eager[1])


_LITERT = """
import sys
import numpy as np
from ai_edge_litert.interpreter import Interpreter
interpreter = Interpreter(model_path=sys.argv[1])
interpreter.allocate_tensors()
interpreter.set_tensor(interpreter.get_input_details()[0]["index"], np.load(sys.argv[2]))
interpreter.invoke()
out = {}
for detail in interpreter.get_output_details():   # classes int64, log_probs float32
  value = interpreter.get_tensor(detail["index"])
  out["classes" if value.dtype == np.int64 else "log_probs"] = value
np.savez(sys.argv[3], **out)
assert "tensorflow" not in sys.modules
"""


@pytest.mark.parametrize("tight", [False, True], ids=["proved", "fallback"])
def test_tflite_builtins_only_in_litert(tight, monkeypatch, rng, tmp_path):
  monkeypatch.setattr(hsm, "PREFIX_SLOTS", 0)
  if tight:
    monkeypatch.setattr(hsm, "SEARCH_ITERATIONS", 2)
  tree, hidden, weights = _confident_problem(rng, classes=400, dim=8, batch=6)
  hidden[:2] *= 0.05
  table = tf.constant(weights)

  @tf.function(input_signature=[tf.TensorSpec([6, 8], tf.float32, name="hidden")])
  def top(hidden):
    values, classes = serving.top_k(hidden, table, None, tree, 5)
    return {"log_probs": values, "classes": classes}

  converter = tf.lite.TFLiteConverter.from_concrete_functions(
      [top.get_concrete_function()], top)
  converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS]
  model = tmp_path / "top_k.tflite"
  model.write_bytes(converter.convert())
  np.save(tmp_path / "hidden.npy", hidden)
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
  done = subprocess.run([sys.executable, "-c", _LITERT, str(model), str(tmp_path / "hidden.npy"),
                         str(tmp_path / "out.npz")], env=env, capture_output=True, text=True,
                        timeout=300, check=False)
  assert done.returncode == 0, done.stderr[-3000:]
  with np.load(tmp_path / "out.npz") as out:
    got_v, got_c = out["log_probs"], out["classes"]
  want_v, want_c = serving.top_k(hidden, weights, None, tree, 5)
  np.testing.assert_allclose(got_v, want_v, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(got_c, want_c)


@pytest.mark.parametrize("jit", [False, True], ids=["graph", "xla"])
def test_a_static_batch_of_one_through_the_fallback(jit, monkeypatch, rng):
  monkeypatch.setattr(hsm, "PREFIX_SLOTS", 0)
  monkeypatch.setattr(hsm, "SEARCH_ITERATIONS", 1)
  tree, hidden, weights = _confident_problem(rng, classes=300, batch=1)

  @tf.function(input_signature=[tf.TensorSpec([1, 16], tf.float32)], jit_compile=jit)
  def top(hidden):
    return serving.top_k(hidden, weights, None, tree, 4)

  values, classes = top(tf.constant(hidden))
  assert values.shape == (1, 4)
  _check(values, classes, tf_hsm.log_prob_all(hidden, weights, None, tree).numpy(), 4, 1e-4)
