"""Bad input at the exported signatures, swept: every signature of one small
HierarchicalSoftmax model (features [batch, positions, 6] -> Dense -> the layer) called
with wrong ranks, widths, targets' shapes, targets out of range, seeds and temperatures
of the wrong shape or value, NaN features and empty batches, next to the good inputs
beside each of them; in a process that cannot import tf_hsm (plain and under XLA) and in
LiteRT (top_k and log_prob, TFLite builtins only), each against what docs/serving.md
says that runtime does. Then Hypothesis draws shapes, temperatures and NaN positions
against the SavedModel loaded here.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tf_hsm
from tf_hsm import serving
from test_serving_export import run_serving

WIDTH, K = 6, 3
CLASSES = 30
TINY = float(np.finfo(np.float32).tiny)
SWEEP = settings(max_examples=30, deadline=None, derandomize=True,
                 suppress_health_check=[HealthCheck.too_slow,
                                        HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
  features = keras.Input([None, WIDTH], name="features")
  targets = keras.Input([None], dtype="int32", name="targets")
  hidden = keras.layers.Dense(8, activation="tanh")(features)
  layer = tf_hsm.HierarchicalSoftmax(tf_hsm.Tree.huffman(np.arange(CLASSES, 0, -1.0), 4))
  model = keras.Model([features, targets], layer(hidden, targets))
  folder = tmp_path_factory.mktemp("sweep")
  path = str(folder / "saved_model")
  serving.export(model, path, k=K)
  converter = tf.lite.TFLiteConverter.from_saved_model(path,
                                                       signature_keys=["top_k", "log_prob"])
  converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS]
  tflite = str(folder / "model.tflite")
  with open(tflite, "wb") as f:
    f.write(converter.convert())
  return dict(path=path, tflite=tflite, folder=str(folder),
              loaded=tf.saved_model.load(path), encoder=keras.Model(features, hidden))


# --------------------------------------------------------------------------- the cases

_F = np.random.default_rng(7101).normal(size=(2, 3, WIDTH)).astype(np.float32)
_T = np.arange(6, dtype=np.int32).reshape(2, 3)
_NAN = _F.copy()
_NAN[1, 1, 2] = np.nan


def _sample(temperature=1.0, seed=3, features=_F):
  return {"features": features, "seed": np.asarray(seed, np.int64),
          "temperature": np.asarray(temperature, np.float32)}


def _shape_error(name, *words):
  """Refused, the message naming the input (TensorFlow: the assert; XLA: the spec
  binding or the pack named after the input)."""
  return ("error", (name,) + words)


_PACK = ("error", ("PACK",))           # LiteRT: the pack named after the input
_SCALAR = ("error", ("must_be_a_scalar",))
# (case, signature, inputs, TensorFlow, XLA, LiteRT); LiteRT None: not converted.
CASES = [
    ("good", "top_k", {"features": _F}, "ok", "ok", "ok"),
    ("rank_2", "top_k", {"features": _F[0]}, _shape_error("features", "[?, ?, 6]"),
     _shape_error("features"), _PACK),
    ("rank_4", "top_k", {"features": _F[None]}, _shape_error("features", "[?, ?, 6]"),
     _shape_error("features"), _PACK),
    ("trailing_1", "top_k", {"features": _F[..., None]},
     _shape_error("features", "[?, ?, 6]"), _shape_error("features"), _PACK),
    ("width_5", "top_k", {"features": _F[..., :5]}, _shape_error("features", "[?, ?, 6]"),
     _shape_error("features_must_have_shape_NxNx6"), _PACK),
    ("width_7", "log_prob_all", {"features": np.concatenate([_F, _F[..., :1]], -1)},
     _shape_error("features", "[?, ?, 6]"),
     _shape_error("features_must_have_shape_NxNx6"), None),
    ("width_9_same_size", "top_k", {"features": _F.reshape(2, 2, 9)},
     _shape_error("features", "[?, ?, 6]"),
     _shape_error("features_must_have_shape_NxNx6"), _PACK),
    ("wrong_dtype", "top_k", {"features": _F.astype(np.float64)},
     ("error", ("float",)), ("error", ("double",)), ("error", ("features", "FLOAT64"))),
    ("empty_batch", "top_k", {"features": _F[:0]}, "ok", "ok", "ok"),
    ("no_positions", "log_prob", {"features": _F[:, :0], "targets": _T[:, :0]},
     "ok", "ok", "ok"),
    ("nan_row", "top_k", {"features": _NAN}, "nan_row", "nan_row", "nan_row"),
    ("nan_row", "sample", _sample(features=_NAN), "nan_row", "nan_row", None),
    ("nan_row", "log_prob", {"features": _NAN, "targets": _T}, "nan_row", "nan_row",
     "nan_row"),
    ("nan_row", "log_prob_all", {"features": _NAN}, "nan_row", "nan_row", None),
    ("good_targets", "log_prob", {"features": _F, "targets": _T}, "ok", "ok", "ok"),
    ("last_class_and_padding", "log_prob",
     {"features": _F, "targets": np.array([[CLASSES - 1, -1, -2**31], [0, 1, 2]],
                                          np.int32)}, "ok", "ok", "ok"),
    ("targets_short", "log_prob", {"features": _F, "targets": _T[:, :2]},
     _shape_error("targets", "one class id per position", "[2 3]"),
     _shape_error("targets_must_have_the_positions_shape"), _PACK),
    ("targets_transposed", "log_prob", {"features": _F, "targets": _T.T.copy()},
     _shape_error("targets", "one class id per position"),
     _shape_error("targets_must_have_the_positions_shape"), _PACK),
    ("targets_broadcastable", "log_prob", {"features": _F, "targets": _T[:1]},
     _shape_error("targets", "one class id per position"),
     _shape_error("targets_must_have_the_positions_shape"), _PACK),
    ("targets_rank_3", "log_prob", {"features": _F, "targets": _T[..., None]},
     _shape_error("targets", "[?, ?]"), _shape_error("targets"), _PACK),
    ("targets_too_big", "log_prob", {"features": _F, "targets": _T + CLASSES - 5},
     ("error", ("targets must be class ids < num_classes = 30",)), "nan_big", "nan_big"),
    ("good_sample", "sample", _sample(), "ok", "ok", None),
    ("tiny_normal", "sample", _sample(TINY), "ok", "ok", None),
    ("huge", "sample", _sample(3e38), "ok", "ok", None),
] + [
    (f"temperature_{label}", "sample", _sample(value),
     ("error", ("temperature must be positive and finite",)), "all_minus_1", None)
    for label, value in [("0", 0.0), ("minus_0", -0.0), ("minus_1", -1.0),
                         ("subnormal", 1e-45), ("below_tiny", TINY / 2), ("nan", np.nan),
                         ("inf", np.inf), ("minus_inf", -np.inf)]
] + [
    ("seed_pair", "sample", _sample(seed=[1, 2]), ("error", ("seed",)), _SCALAR, None),
    ("seed_of_one", "sample", _sample(seed=[1]), ("error", ("seed",)), _SCALAR, None),
    ("temperature_pair", "sample", _sample([1.0, 2.0]), ("error", ("temperature",)),
     _SCALAR, None),
]


def _check(case, signature, inputs, expect, out, mode):
  key = f"{case}/{signature}"
  where = f"{mode} {key}: {str(out.get(key + '/error', ''))[:600]}"
  if isinstance(expect, tuple):
    assert key + "/error" in out, where
    message = str(out[key + "/error"])
    for word in expect[1]:
      assert word in message, (word, where)
    return
  assert key + "/error" not in out, where
  if signature in ("top_k", "sample"):
    classes = out[f"{key}/classes"]
    ok = (classes >= 0) & (classes < CLASSES)
    if expect == "all_minus_1":
      assert (classes == -1).all(), where
    elif expect == "nan_row":    # position (1, 1) has a NaN feature
      assert (classes[1, 1] == -1).all() and ok.sum() == ok.size - classes[1, 1].size, where
    else:
      assert ok.all(), where
      lead = inputs["features"].shape[:-1]
      assert classes.shape == (lead + (K,) if signature == "top_k" else lead), where
  else:
    values = out[f"{key}/log_prob" if signature == "log_prob" else f"{key}/log_probs"]
    nan = np.isnan(values)
    if expect == "nan_row":
      assert nan[1, 1].all() and nan.sum() == nan[1, 1].size, where
    elif expect == "nan_big":
      assert np.array_equal(nan, inputs["targets"] >= CLASSES), where
    else:
      assert not nan.any() and (values <= 0).all(), where


@pytest.mark.parametrize("mode", ["tf", "xla", "litert"])
def test_bad_input_at_every_signature(exported, mode):
  column = {"tf": 3, "xla": 4, "litert": 5}[mode]
  cases = [c for c in CASES if c[column] is not None]
  requests = {f"{c[0]}/{c[1]}": c[2] for c in cases}
  model = exported["tflite"] if mode == "litert" else exported["path"]
  out = run_serving(mode, model, requests, exported["folder"])
  for case in cases:
    _check(case[0], case[1], case[2], case[column], out, mode)


# --------------------------------------------------------------------------- Hypothesis

def _call(exported, signature, **inputs):
  fn = exported["loaded"].signatures[signature]
  return fn(**{k: tf.constant(v) for k, v in inputs.items()})


@SWEEP
@given(shape=st.lists(st.integers(0, 3), min_size=0, max_size=3),
       width=st.sampled_from([1, 5, 6, 7, 12]))
def test_any_feature_shape_is_served_or_refused_by_name(exported, shape, width):
  features = np.ones(shape + [width], np.float32)
  try:
    out = _call(exported, "top_k", features=features)
  except tf.errors.InvalidArgumentError as error:
    assert len(shape) != 2 or width != WIDTH
    assert "features must have shape [?, ?, 6], got shape" in str(error)
    return
  assert len(shape) == 2 and width == WIDTH
  assert out["classes"].shape == tuple(shape) + (K,)


@SWEEP
@given(shape=st.lists(st.integers(0, 4), min_size=0, max_size=3))
def test_any_targets_shape_is_served_or_refused_by_name(exported, shape):
  try:
    out = _call(exported, "log_prob", features=_F, targets=np.zeros(shape, np.int32))
  except tf.errors.InvalidArgumentError as error:
    assert shape != [2, 3]
    assert "targets must have" in str(error)
    return
  assert shape == [2, 3] and out["log_prob"].shape == (2, 3)


_FLOATS = st.one_of(st.floats(width=32), st.sampled_from([0.0, -0.0, TINY, TINY / 2,
                                                          np.nextafter(TINY, 0, dtype=np.float32)]))


@SWEEP
@given(temperature=_FLOATS, seed=st.integers(-2**63, 2**63 - 1))
def test_temperature_is_refused_or_drawn_with(exported, temperature, seed):
  usable = np.isfinite(temperature) and temperature >= TINY
  try:
    classes = _call(exported, "sample", **_sample(temperature, seed))["classes"].numpy()
  except tf.errors.InvalidArgumentError as error:
    assert not usable and "temperature must be positive and finite" in str(error)
    return
  assert usable and ((classes >= 0) & (classes < CLASSES)).all()


@pytest.fixture(scope="module")
def xla_sample(exported):
  fn = exported["loaded"].signatures["sample"]
  return tf.function(lambda **kw: fn(**kw), jit_compile=True)


@SWEEP
@given(temperature=_FLOATS)
def test_under_xla_a_bad_temperature_draws_minus_one(exported, xla_sample, temperature):
  usable = np.isfinite(temperature) and temperature >= TINY
  inputs = {k: tf.constant(v) for k, v in _sample(temperature).items()}
  classes = xla_sample(**inputs)["classes"].numpy()
  if usable:
    assert ((classes >= 0) & (classes < CLASSES)).all()
  else:
    assert (classes == -1).all()


@SWEEP
@given(nan=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 2),
                              st.integers(0, WIDTH - 1),
                              st.sampled_from([np.nan, np.inf, -np.inf])), max_size=5))
def test_a_row_without_a_distribution_never_gets_an_id_outside_the_classes(exported, nan):
  features = np.random.default_rng(len(nan)).normal(size=(4, 3, WIDTH)).astype(np.float32)
  for i, j, w, value in nan:
    features[i, j, w] = value
  # Infinite features may or may not give a NaN hidden state (inf - inf in the Dense).
  has_nan = np.isnan(exported["encoder"](features).numpy()).any(-1)
  out = _call(exported, "top_k", features=features)
  classes, values = out["classes"].numpy(), out["log_probs"].numpy()
  drawn = _call(exported, "sample", **_sample(1.0, 5, features))["classes"].numpy()
  for ids in (classes, drawn):
    assert ((ids == -1) | ((ids >= 0) & (ids < CLASSES))).all()
  np.testing.assert_array_equal((classes == -1).all(-1), has_nan)
  np.testing.assert_array_equal(np.isnan(values).all(-1), has_nan)
  np.testing.assert_array_equal(drawn == -1, has_nan)
