"""`AdaptiveSoftmax(class_order=...)`: one vocabulary whose ids are not sorted by frequency
and whose id 0 is padding. Checked against the layer without an order (itself checked
against PyTorch's definition in test_adaptive.py) in float64, through a model with
`Embedding(mask_zero=True)`, and through the serving export's stock-op functions."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_hsm.keras.adaptive import AdaptiveSoftmax
from tf_hsm.serving import ServingModule

V, D, CUTOFFS = 31, 8, [4, 12]


def _vocabulary(rng):
  """Counts by id with id 0 padding (never counted) and ids in no frequency order."""
  counts = rng.permutation(np.arange(1, V).astype(float) ** 2)
  return np.concatenate([[0.0], counts])


def _pair(rng, tail, dtype="float64"):
  """(the ordered layer, the same weights without an order, the order)."""
  counts = _vocabulary(rng)
  order = AdaptiveSoftmax.frequency_order(counts)
  ordered = AdaptiveSoftmax(V, CUTOFFS, div_value=2.0, tail=tail, counts=counts,
                            class_order=order, head_bias=True, dtype=dtype)
  plain = AdaptiveSoftmax(V - 1, CUTOFFS, div_value=2.0, tail=tail,
                          counts=counts[order], head_bias=True, dtype=dtype)
  for layer in (ordered, plain):
    layer.build((None, D))
  ordered.set_weights([rng.normal(size=w.shape) for w in ordered.get_weights()])
  plain.set_weights(ordered.get_weights())
  return ordered, plain, order


def test_frequency_order_leaves_padding_out_and_breaks_ties_by_id():
  order = AdaptiveSoftmax.frequency_order([0, 5, 9, 5, 1])
  np.testing.assert_array_equal(order, [2, 1, 3, 4])
  np.testing.assert_array_equal(AdaptiveSoftmax.frequency_order([0, 5, 9], padding=()),
                                [2, 1, 0])
  np.testing.assert_array_equal(AdaptiveSoftmax.frequency_order([7, 5, 9], padding=None),
                                [2, 0, 1])
  np.testing.assert_array_equal(AdaptiveSoftmax.frequency_order([7, 5, 9], padding=2),
                                [0, 1])
  for padding in ("0", [0.5], [[0]]):
    with pytest.raises(TypeError, match="padding must be an id or a list of ids"):
      AdaptiveSoftmax.frequency_order([7, 5, 9], padding=padding)
  for padding in (-1, [0, 3]):
    with pytest.raises(ValueError, match=r"padding ids must be ids .* \[0, 3\)"):
      AdaptiveSoftmax.frequency_order([7, 5, 9], padding=padding)
  # Counts the layer would refuse are refused here too (a NaN ranked last unnamed).
  for counts, message in (([7, np.nan, 9], "finite"), ([7, -5, 9], "negative"),
                          ([7, np.inf, 9], "finite"), ([[7, 5, 9]], "1-D")):
    with pytest.raises(ValueError, match=message):
      AdaptiveSoftmax.frequency_order(counts)


@pytest.mark.parametrize("tail", ["flat", "two_level"])
def test_log_probs_are_those_of_the_ranks(rng, tail):
  ordered, plain, order = _pair(rng, tail)
  rank_of = np.full(V, -1)
  rank_of[order] = np.arange(V - 1)
  hidden = tf.constant(rng.normal(size=(6, 5, D)))
  targets = rng.integers(0, V, (6, 5))
  targets[0, :3] = 0  # padding id
  targets[1, 0] = -1
  with tf.GradientTape(persistent=True) as tape:
    tape.watch(hidden)
    out = ordered(hidden, tf.constant(targets))
    ranks = np.where(targets > 0, rank_of[np.maximum(targets, 0)], -1)
    expected = plain(hidden, tf.constant(ranks))
  np.testing.assert_allclose(out.numpy(), expected.numpy(), rtol=1e-12, atol=1e-12)
  np.testing.assert_array_equal(out._keras_mask.numpy(), targets > 0)
  assert (out.numpy()[targets <= 0] == 0).all()
  for mine, theirs in zip(tape.gradient(out, [hidden] + ordered.trainable_weights),
                          tape.gradient(expected, [hidden] + plain.trainable_weights)):
    np.testing.assert_allclose(tf.convert_to_tensor(mine).numpy(),
                               tf.convert_to_tensor(theirs).numpy(), rtol=1e-10,
                               atol=1e-12)


@pytest.mark.parametrize("tail", ["flat", "two_level"])
def test_inference_speaks_in_ids(rng, tail):
  ordered, plain, order = _pair(rng, tail)
  hidden = tf.constant(rng.normal(size=(7, D)))
  by_id = ordered.log_prob_all(hidden).numpy()
  by_rank = plain.log_prob_all(hidden).numpy()
  assert np.isneginf(by_id[:, 0]).all()
  np.testing.assert_allclose(by_id[:, order], by_rank, rtol=1e-12)
  np.testing.assert_allclose(np.exp(by_id).sum(-1), 1.0, rtol=1e-10)
  values, classes = ordered.top_k(hidden, 5)
  expected_values, expected_ranks = plain.top_k(hidden, 5)
  np.testing.assert_array_equal(classes.numpy(), order[expected_ranks.numpy()])
  np.testing.assert_allclose(values.numpy(), expected_values.numpy(), rtol=1e-12)
  drawn = ordered.sample(tf.tile(hidden, [50, 1]), seed=4).numpy()
  np.testing.assert_array_equal(drawn, order[plain.sample(tf.tile(hidden, [50, 1]),
                                                          seed=4).numpy()])
  assert (drawn != 0).all()
  with pytest.raises(ValueError, match=r"k must be in \[1, the number of classes=30\]"):
    ordered.top_k(hidden, V)


def test_counts_by_id_choose_what_sorted_counts_choose(rng):
  counts = _vocabulary(rng)
  order = AdaptiveSoftmax.frequency_order(counts)
  machine = {"matmul_flops": 2e10, "read_bytes": 5e9, "call_seconds": 2e-5}
  by_id = AdaptiveSoftmax(V, counts=counts, class_order=order, tokens_per_step=256,
                          machine=machine)
  by_rank = AdaptiveSoftmax(V - 1, counts=counts[order], tokens_per_step=256,
                            machine=machine)
  for layer in (by_id, by_rank):
    layer.build((None, 64))
  assert by_id.cutoffs == by_rank.cutoffs


@pytest.mark.parametrize("kwargs, message", [
    ({"class_order": [1, 2, 2]}, r"class_order must list each id once: 2"),
    ({"class_order": [1, 31]}, r"class_order\[1\] = 31"),
    ({"class_order": [[1, 2]]}, r"class_order must be a 1-D list"),
    ({"class_order": [1.5, 2.0]}, r"class_order must be a 1-D list of at least 2 int"),
    ({"class_order": [3, 1, 2], "cutoffs": [1, 3]},
     r"each smaller than len\(class_order\)=3"),
    ({"class_order": [1, 2, 3], "counts": np.arange(V, dtype=float), "cutoffs": None},
     r"counts\[class_order\] must be non-increasing.*frequency_order"),
    ({"class_order": [1, 2, 3], "counts": [3.0, 2.0, 1.0], "cutoffs": None},
     r"with a class_order, counts must have one entry per id: shape \[31\]"),
    ({"class_order": None, "counts": np.arange(V, dtype=float), "cutoffs": [2, 9],
      "tail": "two_level"},
     r"counts must be non-increasing.*class_order=AdaptiveSoftmax\.frequency_order"),
    ({"counts": np.arange(V, dtype=float), "cutoffs": [2, 9], "tail": "flat"},
     r"counts must be non-increasing"),
    ({"counts": [3.0, 2.0], "cutoffs": [1], "tail": "flat"},
     r"counts must have shape \[31\]"),
    ({"class_order": [1, 2, 3], "counts": np.arange(V, dtype=float), "cutoffs": [1],
      "tail": "flat"}, r"counts\[class_order\] must be non-increasing"),
])
def test_bad_orders_say_what_is_wrong(kwargs, message):
  kwargs = {"cutoffs": [1], **kwargs}
  with pytest.raises(ValueError, match=message):
    AdaptiveSoftmax(V, **kwargs)


def test_one_vocabulary_with_mask_zero_trains_and_serves(rng, tmp_path):
  """Embedding(mask_zero=True) and the output layer share the ids; 0 is padding."""
  counts = _vocabulary(rng)
  order = AdaptiveSoftmax.frequency_order(counts)
  tokens = keras.Input((None,), dtype="int32", name="tokens")
  targets = keras.Input((None,), dtype="int32", name="targets")
  hidden = keras.layers.Embedding(V, D, mask_zero=True, name="embedding")(tokens)
  layer = AdaptiveSoftmax(V, CUTOFFS, div_value=2.0, counts=counts, class_order=order,
                          tail="two_level", name="adaptive")
  model = keras.Model([tokens, targets], layer(hidden, targets))
  import tf_hsm  # pylint: disable=import-outside-toplevel
  model.compile(optimizer=keras.optimizers.Adam(0.05), loss=tf_hsm.losses.nll)
  x = rng.integers(1, V, (64, 6)).astype(np.int32)
  x[:, 4:] = 0  # padded tails
  y = np.where(x > 0, np.roll(x, -1, 1), 0).astype(np.int32)
  history = model.fit([x, y], y, epochs=4, batch_size=16, verbose=0)
  assert history.history["loss"][-1] < history.history["loss"][0]
  log_probs = model.predict([x, y], verbose=0)
  assert (log_probs[y == 0] == 0).all() and (log_probs[y > 0] < 0).all()
  # The same ids through the serving export's stock ops.
  module = ServingModule(model, k=3)
  served = module.log_prob(tokens=x, targets=y)["log_prob"].numpy()
  np.testing.assert_allclose(served, log_probs, rtol=2e-5, atol=2e-6)
  top = module.top_k(tokens=x[:4])
  values, classes = layer.top_k(model.get_layer("embedding")(x[:4]), 3)
  np.testing.assert_array_equal(top["classes"].numpy(), classes.numpy())
  everything = module.log_prob_all(tokens=x[:2])["log_probs"].numpy()
  assert np.isneginf(everything[..., 0]).all()
  # Saved and loaded, the order comes back from the config.
  path = str(tmp_path / "model.keras")
  model.save(path)
  loaded = keras.models.load_model(path)
  np.testing.assert_array_equal(loaded.get_layer("adaptive").class_order.order, order)
  np.testing.assert_allclose(loaded.predict([x, y], verbose=0), log_probs, rtol=1e-6)


def test_the_config_carries_the_order_compactly(rng):
  ordered, _, order = _pair(rng, "two_level")
  config = ordered.get_config()
  assert set(config["class_order"]) == {"encoding", "ids"}
  assert isinstance(config["class_order"]["ids"], str)
  again = AdaptiveSoftmax.from_config(config)
  np.testing.assert_array_equal(again.class_order.order, order)
  config["class_order"] = {"encoding": config["class_order"]["encoding"], "ids": "@@"}
  with pytest.raises((TypeError, ValueError), match="class_order.s ids is corrupt"):
    AdaptiveSoftmax.from_config(config)
  config["class_order"] = {"ids": []}
  with pytest.raises((TypeError, ValueError),
                     match="class_order must be a list of ids or the dict"):
    AdaptiveSoftmax.from_config(config)
