"""tf_hsm.serving.export of a HierarchicalSoftmaxMixture model: with a shared head, a
tail projection and a padding id, and without a head; the SavedModel where tf_hsm cannot
be imported (TensorFlow and XLA) against the layer's own values, the sample signature's
frequencies against its distribution, LiteRT with builtins only, and bad input."""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_hsm
from tf_hsm import serving
from tf_hsm.keras.mixture import HierarchicalSoftmaxMixture
from test_serving_export import run_serving, sample_request

DIM = 8
CLASSES = 50
ROWS = 7

# (head ids, tail_dim, ignore_class, head_rank): the shared head with everything it
# takes, the trees' own corrected heads, and no head.
SETTINGS = {"headed": ([4, 0, 17, 9], 5, 9, None), "plain": (None, None, None, None),
            "ranked": ([4, 0, 17, 9], 5, 9, 2)}


@pytest.fixture(scope="module", params=sorted(SETTINGS))
def exported(request, tmp_path_factory):
  head, tail_dim, ignore_class, head_rank = SETTINGS[request.param]
  rng = np.random.default_rng(6303)
  tail = CLASSES - (0 if head is None else len(head))
  trees = [tf_hsm.Tree.huffman(rng.integers(1, 60, tail), branching) for branching in (2, 3, 5)]
  hidden_in = keras.Input([DIM], name="hidden")
  targets = keras.Input([], dtype="int32", name="targets")
  layer = HierarchicalSoftmaxMixture(trees, head=head, tail_dim=tail_dim,
                                     ignore_class=ignore_class, head_rank=head_rank,
                                     name="mixture")
  model = keras.Model([hidden_in, targets], layer(hidden_in, targets))
  for v in layer.weights:
    v.assign(rng.normal(size=v.shape).astype(np.float32))
  folder = tmp_path_factory.mktemp(f"mixture_export_{request.param}")
  path = str(folder / "saved_model")
  serving.export(model, path, k=6, max_exclude=2)
  converter = tf.lite.TFLiteConverter.from_saved_model(path, signature_keys=["top_k"])
  converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS]
  tflite = str(folder / "model.tflite")
  with open(tflite, "wb") as f:
    f.write(converter.convert())
  hidden = rng.normal(size=(ROWS, DIM)).astype(np.float32)
  tgt = rng.integers(0, CLASSES, ROWS).astype(np.int32)
  tgt[0] = -1
  if ignore_class is not None:
    tgt[1] = ignore_class
  values, classes = layer.top_k(hidden, 6)
  return dict(path=path, tflite=tflite, folder=str(folder), hidden=hidden, targets=tgt,
              layer=layer, ignore_class=ignore_class, log_prob=model([hidden, tgt]).numpy(),
              full=layer.log_prob_all(hidden).numpy(), top_values=values.numpy(),
              top_classes=classes.numpy())


def _check_top_k(out, e, name="top_k"):
  np.testing.assert_array_equal(out[f"{name}/classes"], e["top_classes"])
  np.testing.assert_allclose(out[f"{name}/log_probs"], e["top_values"], rtol=1e-5, atol=1e-5)


def test_the_saved_model_runs_where_tf_hsm_cannot_be_imported(exported):
  e = exported
  exclude = np.tile(e["top_classes"][:1, :2], (ROWS, 1)).astype(np.int64)
  requests = {"top_k": {"hidden": e["hidden"]},
              "log_prob": {"hidden": e["hidden"], "targets": e["targets"]},
              "log_prob_all": {"hidden": e["hidden"]},
              "top_k_excluding": {"hidden": e["hidden"], "exclude": exclude}}
  for mode in ("tf", "xla"):
    out = run_serving(mode, e["path"], requests, e["folder"])
    _check_top_k(out, e)
    np.testing.assert_allclose(out["log_prob/log_prob"], e["log_prob"], rtol=1e-5, atol=1e-5)
    assert out["log_prob/log_prob"][0] == 0.0  # padding
    if e["ignore_class"] is not None:
      assert out["log_prob/log_prob"][1] == 0.0
      assert e["ignore_class"] not in out["top_k/classes"]
    np.testing.assert_allclose(out["log_prob_all/log_probs"], e["full"], rtol=1e-5, atol=1e-5)
    values, classes = e["layer"].top_k(e["hidden"], 6, exclude=exclude)
    np.testing.assert_array_equal(out["top_k_excluding/classes"], classes)
    np.testing.assert_allclose(out["top_k_excluding/log_probs"], values, rtol=1e-5, atol=1e-5)


def test_the_sample_signature_draws_the_mixture_s_distribution(exported):
  e = exported
  draws = 40_000
  hidden = np.repeat(e["hidden"][2:3], draws, 0)
  requests = {"sample": sample_request(11, hidden=hidden)}
  out = run_serving("tf", e["path"], requests, e["folder"])
  drawn = out["sample/classes"]
  assert drawn.min() >= 0 and drawn.max() < CLASSES
  want = np.exp(e["full"][2].astype(np.float64))
  got = np.bincount(drawn, minlength=CLASSES) / draws
  bound = 4.5 * np.sqrt(want * (1 - want) / draws) + 1e-4
  assert np.all(np.abs(got - want) <= bound), np.abs(got - want) / bound
  again = run_serving("tf", e["path"], {"sample": sample_request(11, hidden=hidden[:50])},
                      e["folder"])
  np.testing.assert_array_equal(again["sample/classes"], drawn[:50])


def test_litert_runs_the_top_k_signature(exported):
  e = exported
  out = run_serving("litert", e["tflite"], {"top_k": {"hidden": e["hidden"]}}, e["folder"])
  _check_top_k(out, e)
  with open(e["tflite"], "rb") as f:
    data = f.read()
  assert b"Hsm" not in data and b"Flex" not in data


def test_bad_input_at_the_mixture_s_signatures(exported):
  e = exported
  nan = e["hidden"].copy()
  nan[3, 1] = np.nan

  requests = {"nan/top_k": {"hidden": nan}, "nan/sample": sample_request(hidden=nan),
              "zero/sample": sample_request(temperature=0.0, hidden=e["hidden"]),
              "big/log_prob": {"hidden": e["hidden"],
                               "targets": np.full(ROWS, CLASSES, np.int32)}}
  out = run_serving("tf", e["path"], requests, e["folder"])
  classes = out["nan/top_k/classes"]
  assert (classes[3] == -1).all() and (np.delete(classes, 3, 0) >= 0).all()
  assert np.isnan(out["nan/top_k/log_probs"][3]).all()
  drawn = out["nan/sample/classes"]
  assert drawn[3] == -1 and (np.delete(drawn, 3) >= 0).all() and (drawn < CLASSES).all()
  assert "temperature must be positive and finite" in str(out["zero/sample/error"])
  assert f"targets must be class ids < num_classes = {CLASSES}" in str(
      out["big/log_prob/error"])


def test_a_mixture_with_row_layouts_is_refused(tmp_path):
  trees = [tf_hsm.Tree.huffman(np.arange(1, 9), 2), tf_hsm.Tree.huffman(np.arange(1, 9), 3)]
  components = [tf_hsm.HierarchicalSoftmax(t, row_layout=tf_hsm.distribute.RowLayout(
      t, np.arange(t.num_slots)[::-1], 1)) for t in trees]
  hidden_in = keras.Input([DIM], name="hidden")
  targets = keras.Input([], dtype="int32", name="targets")
  layer = HierarchicalSoftmaxMixture(components)
  model = keras.Model([hidden_in, targets], layer(hidden_in, targets))
  with pytest.raises(ValueError, match="row_layout"):
    serving.export(model, str(tmp_path / "m"))
  assert not os.path.exists(tmp_path / "m" / "saved_model.pb")


def test_seeds_far_apart_share_no_stream(exported):
  """Each part's seed comes from (seed, part) through Philox: seeds 2**62 apart draw as
  independently as seeds 1 apart (an arithmetic mix of seed and part would wrap around
  and repeat every tree's draws)."""
  sample = tf.saved_model.load(exported["path"]).signatures["sample"]
  hidden = np.repeat(exported["hidden"][2:3], 20_000, 0)
  temperature = tf.constant(0.5, tf.float32)
  draws = [sample(hidden=hidden, seed=tf.constant(s, tf.int64),
                  temperature=temperature)["classes"].numpy() for s in (3, 4, 3 + 2**62)]
  near, far = np.mean(draws[0] == draws[1]), np.mean(draws[0] == draws[2])
  assert abs(far - near) < 0.05, (near, far)


def _exported_module(model, tmp_path):
  return serving.export(model, str(tmp_path / "saved_model"), k=4)


def test_float64_without_biases_matches_the_layer(rng, tmp_path):
  tail = CLASSES - 3
  trees = [tf_hsm.HierarchicalSoftmax(tf_hsm.Tree.huffman(rng.integers(1, 60, tail), b),
                                      use_bias=False, dtype="float64") for b in (2, 4)]
  hidden_in = keras.Input([DIM], name="hidden", dtype="float64")
  targets = keras.Input([], dtype="int32", name="targets")
  layer = HierarchicalSoftmaxMixture(trees, head=[5, 2, 30], tail_dim=3, dtype="float64")
  model = keras.Model([hidden_in, targets], layer(hidden_in, targets))
  for v in layer.weights:
    v.assign(rng.normal(size=v.shape))
  module = _exported_module(model, tmp_path)
  hidden = rng.normal(size=(5, DIM))
  tgt = rng.integers(-1, CLASSES, 5).astype(np.int32)
  np.testing.assert_allclose(module.log_prob(hidden=hidden, targets=tgt)["log_prob"],
                             model([hidden, tgt]), rtol=1e-12, atol=1e-12)
  np.testing.assert_allclose(module.log_prob_all(hidden=hidden)["log_probs"],
                             layer.log_prob_all(hidden), rtol=1e-12, atol=1e-12)
  np.testing.assert_array_equal(module.top_k(hidden=hidden)["classes"],
                                layer.top_k(hidden, 4)[1])


def test_a_masked_sequence_model_matches_the_layer(rng, tmp_path):
  vocab = CLASSES
  tokens = keras.Input([None], dtype="int32", name="tokens")
  targets = keras.Input([None], dtype="int32", name="targets")
  x = keras.layers.Embedding(vocab, DIM, mask_zero=True)(tokens)
  x = keras.layers.Dense(DIM, activation="tanh")(x)
  trees = [tf_hsm.Tree.huffman(rng.integers(1, 60, vocab), b) for b in (3, 5)]
  layer = HierarchicalSoftmaxMixture(trees, name="mixture")
  model = keras.Model([tokens, targets], layer(x, targets))
  for v in layer.weights:
    v.assign(rng.normal(size=v.shape).astype(np.float32))
  module = _exported_module(model, tmp_path)
  ids = rng.integers(1, vocab, size=(3, 6)).astype(np.int32)
  ids[0, 4:] = 0  # masked positions
  tgt = rng.integers(0, vocab, size=(3, 6)).astype(np.int32)
  want = model([ids, tgt]).numpy()
  got = module.log_prob(tokens=ids, targets=tgt)["log_prob"].numpy()
  assert np.all(want[0, 4:] == 0) and np.all(got[0, 4:] == 0)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  hidden = keras.Model(tokens, x)(ids)
  np.testing.assert_array_equal(module.top_k(tokens=ids)["classes"],
                                layer.top_k(hidden, 4)[1])


def test_mixed_float16_with_a_tail_projection_matches_the_model(rng, tmp_path):
  """The trees take the float32 projection in the layer's call as in log_prob_all (not
  rounded to float16 at their own call), so the export, which computes in float32,
  gives what the model gives."""
  head = [1, 7]
  trees = [tf_hsm.Tree.huffman(rng.integers(1, 60, CLASSES - 2), b) for b in (2, 3)]
  tokens = keras.Input([4], dtype="int32", name="tokens")
  targets = keras.Input([4], dtype="int32", name="targets")
  x = keras.layers.Embedding(CLASSES, DIM, dtype="mixed_float16")(tokens)
  layer = HierarchicalSoftmaxMixture(trees, head=head, tail_dim=3, dtype="mixed_float16")
  model = keras.Model([tokens, targets], layer(x, targets))
  for v in layer.weights:
    v.assign(rng.normal(size=v.shape).astype(np.float32))
  module = _exported_module(model, tmp_path)
  ids = rng.integers(0, CLASSES, size=(3, 4)).astype(np.int32)
  tgt = rng.integers(0, CLASSES, size=(3, 4)).astype(np.int32)
  np.testing.assert_allclose(module.log_prob(tokens=ids, targets=tgt)["log_prob"],
                             model([ids, tgt]), rtol=1e-5, atol=1e-5)


def _litert_runner(tflite_bytes, signature):
  from ai_edge_litert.interpreter import Interpreter  # pylint: disable=import-outside-toplevel
  return Interpreter(model_content=tflite_bytes).get_signature_runner(signature)


def test_one_litert_runner_after_an_empty_batch_and_on_nan_rows(exported):
  """A serving loop keeps one runner: after a batch of zero rows, LiteRT's default
  delegate ranked the next new batch size wrongly (off by up to 3 nats), and its max
  skips NaN, which turned a NaN row into classes 0..k-1 at -inf."""
  e = exported
  with open(e["tflite"], "rb") as f:
    runner = _litert_runner(f.read(), "top_k")
  assert runner(hidden=e["hidden"][:0])["classes"].shape == (0, 6)
  _check_top_k({f"top_k/{n}": v for n, v in runner(hidden=e["hidden"]).items()}, e)
  broken = e["hidden"][:3].copy()
  broken[0, 2], broken[1, 0] = np.nan, np.inf
  out = runner(hidden=broken)
  np.testing.assert_array_equal(out["classes"][:2], -1)
  assert np.all(np.isnan(out["log_probs"][:2]))
  np.testing.assert_array_equal(out["classes"][2], e["top_classes"][2])


def test_a_sequence_mixture_converts_to_litert_builtins(rng, tmp_path):
  # [batch, time, D] hidden states: the gate's new axis was a strided slice that TFLite's
  # builtins do not take.
  hidden_in = keras.Input([None, DIM], name="hidden")
  targets = keras.Input([None], dtype="int32", name="targets")
  trees = [tf_hsm.Tree.huffman(rng.integers(1, 60, CLASSES), b) for b in (3, 5)]
  layer = HierarchicalSoftmaxMixture(trees, name="mixture")
  model = keras.Model([hidden_in, targets], layer(hidden_in, targets))
  for v in layer.weights:
    v.assign(rng.normal(size=v.shape).astype(np.float32))
  path = str(tmp_path / "saved_model")
  serving.export(model, path, k=4)
  hidden = rng.normal(size=(2, 3, DIM)).astype(np.float32)
  tgt = rng.integers(0, CLASSES, size=(2, 3)).astype(np.int32)
  for signature in ("top_k", "log_prob"):
    converter = tf.lite.TFLiteConverter.from_saved_model(path, signature_keys=[signature])
    converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS]
    runner = _litert_runner(converter.convert(), signature)
    if signature == "top_k":
      np.testing.assert_array_equal(runner(hidden=hidden)["classes"],
                                    layer.top_k(hidden, 4)[1])
    else:
      np.testing.assert_allclose(runner(hidden=hidden, targets=tgt)["log_prob"],
                                 model([hidden, tgt]), rtol=1e-5, atol=1e-5)
