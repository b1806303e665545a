"""Ragged batches: sequences of different lengths, one output per time step. Every op
wrapper runs on the flat values and gives the dense results of those tokens, ragged
alike."""

import numpy as np
import pytest
import tensorflow as tf

import tf_hsm

TREE = tf_hsm.Tree.from_nested([[0, 1, [2, 3, 4]], [5, [6, 7]], 8, [9, 10, 11, 12]])
D = 5
LENGTHS = [3, 0, 4, 1]


@pytest.fixture
def batch():
  rng = np.random.default_rng(3)
  n = sum(LENGTHS)
  flat_h = rng.normal(size=(n, D)).astype(np.float32)
  flat_y = rng.integers(0, TREE.num_classes, size=n)
  weights = tf.Variable(rng.normal(size=(TREE.num_slots, D)).astype(np.float32))
  biases = tf.Variable(rng.normal(size=TREE.num_slots).astype(np.float32))
  ragged = lambda x: tf.RaggedTensor.from_row_lengths(x, LENGTHS)
  return ragged, flat_h, flat_y, weights, biases


def _assert_ragged_like(result, flat_expected):
  assert isinstance(result, tf.RaggedTensor)
  np.testing.assert_array_equal(result.row_lengths().numpy(), LENGTHS)
  np.testing.assert_array_equal(result.flat_values.numpy(), np.asarray(flat_expected))


def test_log_prob_and_its_gradients_are_the_flat_batch_s(batch):
  ragged, flat_h, flat_y, w, b = batch
  h = tf.constant(flat_h)
  with tf.GradientTape(persistent=True) as tape:
    tape.watch(h)
    result = tf_hsm.log_prob(ragged(h), w, b, TREE, ragged(flat_y))
    loss = tf.reduce_sum(result.flat_values)
    flat = tf_hsm.log_prob(h, w, b, TREE, flat_y)
    flat_loss = tf.reduce_sum(flat)
  _assert_ragged_like(result, flat)
  for ours, theirs in zip(tape.gradient(loss, [h, w, b]), tape.gradient(flat_loss, [h, w, b])):
    np.testing.assert_array_equal(tf.convert_to_tensor(ours), tf.convert_to_tensor(theirs))


def test_nll_loss_with_a_ragged_loss_scale(batch):
  ragged, flat_h, flat_y, w, b = batch
  scale = np.linspace(0.1, 1.0, sum(LENGTHS)).astype(np.float32)
  loss = tf_hsm.nll_loss(ragged(flat_h), w, b, TREE, ragged(flat_y), loss_scale=ragged(scale))
  expected = tf_hsm.nll_loss(flat_h, w, b, TREE, flat_y, loss_scale=scale)
  assert loss.shape == ()
  assert loss.numpy() == expected.numpy()
  mean = tf_hsm.nll_loss(ragged(flat_h), w, b, TREE, ragged(flat_y), loss_scale=0.5)
  assert mean.numpy() == tf_hsm.nll_loss(flat_h, w, b, TREE, flat_y, loss_scale=0.5).numpy()


def test_sgd_step_returns_ragged_outputs_and_the_flat_update(batch):
  ragged, flat_h, flat_y, w, b = batch
  w2, b2 = tf.Variable(w), tf.Variable(b)
  log_p, dh = tf_hsm.sgd_step(ragged(flat_h), w, b, TREE, ragged(flat_y), 0.1)
  flat_log_p, flat_dh = tf_hsm.sgd_step(flat_h, w2, b2, TREE, flat_y, 0.1)
  _assert_ragged_like(log_p, flat_log_p)
  assert isinstance(dh, tf.RaggedTensor)
  np.testing.assert_array_equal(dh.flat_values.numpy(), flat_dh.numpy())
  np.testing.assert_array_equal(w.numpy(), w2.numpy())


def test_inference_ops(batch):
  ragged, flat_h, flat_y, w, b = batch
  h = ragged(flat_h)
  for ours, theirs in zip(tf_hsm.top_k(h, w, b, TREE, 3), tf_hsm.top_k(flat_h, w, b, TREE, 3)):
    _assert_ragged_like(ours, theirs)
  _assert_ragged_like(tf_hsm.log_prob_all(h, w, b, TREE), tf_hsm.log_prob_all(flat_h, w, b, TREE))
  _assert_ragged_like(tf_hsm.sample(h, w, b, TREE, seed=4),
                      tf_hsm.sample(flat_h, w, b, TREE, seed=4))
  candidates = np.stack([flat_y, (flat_y + 1) % TREE.num_classes], axis=1)
  _assert_ragged_like(tf_hsm.log_prob_candidates(h, w, b, TREE, ragged(candidates)),
                      tf_hsm.log_prob_candidates(flat_h, w, b, TREE, candidates))


def test_in_a_function_with_ragged_signatures(batch):
  ragged, flat_h, flat_y, w, b = batch
  spec_h = tf.RaggedTensorSpec([None, None, D], tf.float32, ragged_rank=1)
  spec_y = tf.RaggedTensorSpec([None, None], tf.int64, ragged_rank=1)
  fn = tf.function(lambda h, y: tf_hsm.log_prob(h, w, b, TREE, y),
                   input_signature=[spec_h, spec_y])
  _assert_ragged_like(fn(ragged(flat_h), ragged(flat_y)),
                      tf_hsm.log_prob(flat_h, w, b, TREE, flat_y))


def test_targets_must_be_ragged_like_hidden(batch):
  ragged, flat_h, flat_y, w, b = batch
  with pytest.raises(TypeError, match="targets must be one too"):
    tf_hsm.log_prob(ragged(flat_h), w, b, TREE, flat_y)
  with pytest.raises(TypeError, match="targets is a tf.RaggedTensor but hidden is not"):
    tf_hsm.log_prob(flat_h, w, b, TREE, ragged(flat_y))
  other = tf.RaggedTensor.from_row_lengths(flat_y, [2, 1, 4, 1])
  with pytest.raises(tf.errors.InvalidArgumentError, match="same row lengths"):
    tf_hsm.log_prob(ragged(flat_h), w, b, TREE, other)
  nested = tf.RaggedTensor.from_row_lengths(ragged(flat_y), [2, 2])
  with pytest.raises(ValueError, match="ragged rank 2 but hidden has 1"):
    tf_hsm.log_prob(ragged(flat_h), w, b, TREE, nested)
  with pytest.raises(TypeError, match="loss_scale must be one too"):
    tf_hsm.nll_loss(ragged(flat_h), w, b, TREE, ragged(flat_y),
                    loss_scale=np.ones(sum(LENGTHS), np.float32))


def test_a_sparse_tensor_is_refused_by_name(batch):
  ragged, flat_h, flat_y, w, b = batch
  with pytest.raises(TypeError, match="targets must be a dense or ragged tensor"):
    tf_hsm.log_prob(flat_h, w, b, TREE, tf.sparse.from_dense(tf.constant(flat_y)))
