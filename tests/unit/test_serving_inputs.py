"""Bad input at tf_hsm.serving's functions and at `export`'s own arguments: temperatures
and seeds (Python and tensor, plain and under XLA), rows without a distribution (NaN,
inf) for both layers' top_k and sample, k, the directory, what is passed as the model;
and an export that stores each variable once."""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tf_hsm
from tf_hsm import serving
from tf_hsm.serving import adaptive as adaptive_serving

SWEEP = settings(max_examples=40, deadline=None, derandomize=True,
                 suppress_health_check=[HealthCheck.too_slow])
TINY = float(np.finfo(np.float32).tiny)
TREE = tf_hsm.Tree.huffman(np.arange(20, 0, -1.0), 3)
DIM = 5
_RNG = np.random.default_rng(7102)
WEIGHTS = _RNG.normal(size=(TREE.num_slots, DIM)).astype(np.float32)
BIASES = _RNG.normal(size=TREE.num_slots).astype(np.float32)


def _adaptive(tail):
  """AdaptiveWeights of 20 classes: a head of 6 and clusters of 6 and 8, flat or trees."""
  trees = None if tail == "flat" else [tf_hsm.Tree.two_level(6), tf_hsm.Tree.balanced(8, 3)]
  rows = [6, 8] if trees is None else [t.num_slots for t in trees]
  return adaptive_serving.AdaptiveWeights(
      20, [6, 12], _RNG.normal(size=(6 + 2, DIM)).astype(np.float32), None,
      [_RNG.normal(size=(DIM, 3)).astype(np.float32) for _ in range(2)],
      [_RNG.normal(size=(r, 3)).astype(np.float32) for r in rows], None, trees)


LAYERS = {
    "hsm": (lambda h, k: serving.top_k(h, WEIGHTS, BIASES, TREE, k),
            lambda h, seed, t: serving.sample(h, WEIGHTS, BIASES, TREE, seed, t)),
}
for _tail in ("flat", "two_level"):
  _w = _adaptive(_tail)
  LAYERS[f"adaptive_{_tail}"] = (
      lambda h, k, w=_w: serving.adaptive_top_k(w, h, k),
      lambda h, seed, t, w=_w: serving.adaptive_sample(w, h, seed, t))


def _usable(t):
  return bool(np.isfinite(t)) and t >= TINY


_TEMPERATURES = st.one_of(st.floats(width=32), st.sampled_from(
    [0.0, -0.0, TINY, TINY / 2, 1e-45, float(np.nextafter(np.float32(TINY), 1, dtype=np.float32))]))


@pytest.mark.parametrize("layer", sorted(LAYERS))
@SWEEP
@given(temperature=_TEMPERATURES)
def test_a_temperature_is_drawn_with_or_refused(layer, temperature):
  _, sample = LAYERS[layer]
  hidden = np.ones((3, DIM), np.float32)
  for value in (float(temperature), tf.constant(temperature, tf.float32)):
    try:
      classes = sample(hidden, 4, value).numpy()
    except (ValueError, tf.errors.InvalidArgumentError) as error:
      assert not _usable(temperature), error
      assert "temperature" in str(error) and "positive and finite" in str(error) or \
          "smallest normal" in str(error)
      continue
    assert _usable(temperature) and ((classes >= 0) & (classes < 20)).all()


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_under_xla_a_bad_temperature_gives_minus_one(layer):
  _, sample = LAYERS[layer]
  hidden = tf.ones((3, DIM))
  fn = tf.function(lambda t: sample(hidden, 4, t), jit_compile=True)
  for t in (0.0, -1.0, np.nan, np.inf, 1e-45):
    np.testing.assert_array_equal(fn(tf.constant(t, tf.float32)), [-1, -1, -1])
  assert ((fn(tf.constant(0.5)).numpy() >= 0)).all()


@pytest.mark.parametrize("seed,error", [
    ([1, 2], ValueError), (np.array([3]), ValueError), (1.5, TypeError), (True, TypeError),
    (tf.constant([1, 2], tf.int64), ValueError)])
def test_a_seed_must_be_one_int(seed, error):
  with pytest.raises(error, match="seed"):
    serving.sample(np.ones((2, DIM), np.float32), WEIGHTS, BIASES, TREE, seed)


@pytest.mark.parametrize("temperature,error", [
    (True, TypeError), (tf.constant(1), TypeError), (tf.constant([1.0, 2.0]), ValueError)])
def test_a_temperature_must_be_one_float(temperature, error):
  with pytest.raises(error, match="temperature"):
    serving.sample(np.ones((2, DIM), np.float32), WEIGHTS, BIASES, TREE, 1, temperature)


@pytest.mark.parametrize("layer", sorted(LAYERS))
@SWEEP
@given(bad=st.lists(st.tuples(st.integers(0, 5), st.integers(0, DIM - 1),
                              st.sampled_from([np.nan, np.inf, -np.inf, 1e30])), max_size=6))
def test_no_id_outside_the_classes(layer, bad):
  top_k, sample = LAYERS[layer]
  hidden = np.random.default_rng(len(bad)).normal(size=(6, DIM)).astype(np.float32)
  for row, col, value in bad:
    hidden[row, col] = value
  values, classes = (x.numpy() for x in top_k(hidden, 4))
  drawn = sample(hidden, 9, 1.0).numpy()
  for ids in (classes, drawn):
    assert ((ids == -1) | ((ids >= 0) & (ids < 20))).all()
  # -1 exactly where the row has no ranking (a NaN log-probability), in whole rows.
  np.testing.assert_array_equal(classes == -1, np.isnan(values))
  assert ((classes == -1).all(-1) == (classes == -1).any(-1)).all()
  nan_rows = np.isnan(hidden).any(-1)
  assert (classes[nan_rows] == -1).all() and (drawn[nan_rows] == -1).all()
  finite = np.isfinite(hidden).all(-1)
  assert (classes[finite] >= 0).all() and (drawn[finite] >= 0).all()


def test_a_row_of_minus_inf_logits_draws_minus_one():
  biases = np.full(TREE.num_slots, -np.inf, np.float32)
  drawn = serving.sample(np.ones((2, DIM), np.float32), WEIGHTS, biases, TREE, 1)
  np.testing.assert_array_equal(drawn, [-1, -1])


# --------------------------------------------------------------------------- export


@pytest.fixture(scope="module")
def model():
  tokens = keras.Input([None], dtype="int32", name="tokens")
  targets = keras.Input([None], dtype="int32", name="targets")
  hidden = keras.layers.Embedding(500, 16)(tokens)
  hidden = keras.layers.Dense(DIM)(hidden)
  return keras.Model([tokens, targets], tf_hsm.HierarchicalSoftmax(TREE)(hidden, targets))


@pytest.mark.parametrize("k", [0, -1, 2.5, "3", True, False, None, 1.0, np.float32(2)])
def test_k_must_be_a_positive_int_as_for_inference_model(model, tmp_path, k):
  with pytest.raises(ValueError) as ours:
    serving.export(model, tmp_path / "m", k=k)
  with pytest.raises(ValueError) as theirs:
    tf_hsm.keras.inference_model(model, k=k)
  assert str(ours.value) == str(theirs.value) == f"k must be an int >= 1, got {k!r}"
  assert not (tmp_path / "m").exists()


@pytest.mark.parametrize("name,value", [("sample", "no"), ("sample", None), ("sample", 0),
                                        ("log_prob_all", "no"), ("log_prob_all", 1)])
def test_a_signature_switch_must_be_a_bool(model, tmp_path, name, value):
  """A string such as "no" is true: taken as is it would add the signature."""
  with pytest.raises(TypeError, match=f"{name} must be True or False"):
    serving.export(model, tmp_path / "m", **{name: value})
  assert not (tmp_path / "m").exists()


def test_a_directory_that_cannot_hold_the_export(model, tmp_path):
  with pytest.raises(TypeError, match="directory must be a path"):
    serving.export(model, None)
  for empty in ("", "  "):
    with pytest.raises(ValueError, match="directory must name the folder"):
      serving.export(model, empty)
  a_file = tmp_path / "file"
  a_file.write_text("x")
  with pytest.raises(ValueError, match="is a file"):
    serving.export(model, a_file)
  with pytest.raises(ValueError, match="cannot create the directory"):
    serving.export(model, a_file / "below")
  with pytest.raises(ValueError, match="cannot create the directory"):
    serving.export(model, "/proc/tf_hsm_export")


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write into any directory")
def test_a_directory_without_write_permission(model, tmp_path):
  locked = tmp_path / "locked"
  locked.mkdir()
  locked.chmod(0o500)
  try:
    with pytest.raises(ValueError, match="cannot write to the directory"):
      serving.export(model, locked)
  finally:
    locked.chmod(0o700)


class _Subclassed(keras.Model):
  def __init__(self):
    super().__init__()
    self.dense = keras.layers.Dense(DIM)
    self.hsm = tf_hsm.HierarchicalSoftmax(TREE)

  def call(self, inputs):
    return self.hsm(self.dense(inputs[0]), inputs[1])


def test_only_a_functional_model_is_exported(model, tmp_path):
  sub = _Subclassed()
  sub([np.ones((2, 3), np.float32), np.zeros(2, np.int32)])
  with pytest.raises(TypeError, match="subclassed model .* functional model"):
    serving.export(sub, tmp_path)
  with pytest.raises(TypeError, match="subclassed model"):
    tf_hsm.keras.inference_model(sub, k=2)
  layer = model.layers[-1]
  with pytest.raises(TypeError, match=f"got the layer '{layer.name}' .*wrap it in a "
                     "functional model"):
    serving.export(layer, tmp_path)
  for other in (None, "model.keras", keras.layers.Dense(3)):
    with pytest.raises(TypeError, match="export takes a"):
      serving.export(other, tmp_path)
  assert os.listdir(tmp_path) == []


def test_each_variable_is_stored_once(model, tmp_path):
  serving.export(model, str(tmp_path), k=3)
  stored = tf.train.list_variables(str(tmp_path / "variables" / "variables"))
  shapes = sorted(tuple(shape) for name, shape in stored if "VARIABLE_VALUE" in name)
  assert shapes == sorted(tuple(v.shape) for v in model.weights)
  assert shapes.count((500, 16)) == 1
  loaded = tf.saved_model.load(str(tmp_path))
  out = loaded.signatures["top_k"](tokens=tf.constant([[1, 2, 3]]))
  expected = tf_hsm.keras.inference_model(model, k=3)(np.array([[1, 2, 3]]))
  np.testing.assert_array_equal(out["classes"], expected["classes"])


def test_the_export_takes_a_path_object_or_bytes(model, tmp_path):
  serving.export(model, tmp_path / "as_path", k=2)
  serving.export(model, os.fsencode(str(tmp_path / "as_bytes")), k=2)
  for name in ("as_path", "as_bytes"):
    assert (tmp_path / name / "saved_model.pb").exists()


@pytest.mark.parametrize("chunk", [64, 3])
def test_a_tiny_temperature_draws_the_most_probable_child(chunk, monkeypatch):
  monkeypatch.setattr(serving.hsm, "CHUNK", chunk)   # 3: the while loop over wide nodes
  flat = tf_hsm.Tree.balanced(20, 20)                 # one node: the most probable class
  weights = _RNG.normal(size=(flat.num_slots, DIM)).astype(np.float32)
  hidden = _RNG.normal(size=(6, DIM)).astype(np.float32)
  best = np.argmax(hidden @ weights.T, -1)
  for seed in range(4):
    for t in (TINY, 1e-30):
      np.testing.assert_array_equal(serving.sample(hidden, weights, None, flat, seed, t), best)


@pytest.mark.parametrize("chunk", [64, 3])
def test_the_tempered_draws_follow_the_distribution(chunk, monkeypatch):
  """The rescaled running max across chunks (CHUNK 3 on 20 children) keeps Gumbel-max
  exact: draws against softmax(z / T)."""
  monkeypatch.setattr(serving.hsm, "CHUNK", chunk)
  flat = tf_hsm.Tree.balanced(20, 20)
  rng = np.random.default_rng(7103)
  weights = rng.normal(size=(flat.num_slots, DIM))
  hidden = np.repeat(rng.normal(size=(1, DIM)), 6000, axis=0)
  z = (hidden[0] @ weights.T) / 0.7
  probs = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
  draws = serving.sample(hidden, weights, None, flat, 11, 0.7).numpy()
  expected = probs * len(draws)
  keep = expected > 5
  observed = np.bincount(draws, minlength=20)
  cells_o = np.append(observed[keep], observed[~keep].sum())
  cells_e = np.append(expected[keep], expected[~keep].sum())
  chi2 = ((cells_o - cells_e) ** 2 / np.maximum(cells_e, 1e-9)).sum()
  dof = len(cells_e) - 1
  assert chi2 < dof + 8 * np.sqrt(2 * dof) + 10, (chi2, dof)


def test_a_lookup_table_in_the_encoder_is_saved(tmp_path):
  """The encoder is not tracked (its variables would be saved twice); its lookup tables
  are saved through `encoder_resources`."""
  words = keras.Input([None], dtype="string", name="words")
  targets = keras.Input([None], dtype="int32", name="targets")
  ids = keras.layers.StringLookup(vocabulary=["a", "b", "c"])(words)
  hidden = keras.layers.Embedding(4, DIM)(ids)
  model = keras.Model([words, targets], tf_hsm.HierarchicalSoftmax(TREE)(hidden, targets))
  module = serving.export(model, tmp_path, k=2)
  assert len(module.encoder_resources) == 1
  loaded = tf.saved_model.load(str(tmp_path))
  text = tf.constant([["a", "never seen", "c"]])
  expected = tf_hsm.keras.inference_model(model, k=2)(text)
  np.testing.assert_array_equal(loaded.signatures["top_k"](words=text)["classes"],
                                expected["classes"])


def test_a_subclassed_tf_keras_model_is_refused(tmp_path):
  tf_keras = pytest.importorskip("tf_keras")

  class Sub(tf_keras.Model):
    def __init__(self):
      super().__init__()
      self.dense = tf_keras.layers.Dense(DIM)

    def call(self, inputs):
      return self.dense(inputs)

  sub = Sub()
  sub(np.ones((2, 3), np.float32))
  with pytest.raises(TypeError, match="Sub is a subclassed model"):
    serving.export(sub, tmp_path)
