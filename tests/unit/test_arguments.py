"""Scalar arguments: used in the computation's dtype (float64 stays float64), and the
wrong type or shape is an error that names the argument."""

import numpy as np
import pytest
import tensorflow as tf

import tf_hsm


@pytest.fixture
def problem(rng):
  tree = tf_hsm.Tree.balanced(20, 3)
  hidden = rng.normal(size=(6, 4))
  weights = rng.normal(size=(tree.num_slots, 4))
  targets = rng.integers(0, 20, 6)
  return tree, hidden, weights, targets


def _sgd(problem, learning_rate):
  tree, hidden, weights, targets = problem
  table = tf.Variable(weights)
  tf_hsm.sgd_step(tf.constant(hidden), table, None, tree, targets, learning_rate)
  return table.numpy()


def _nll(problem, loss_scale):
  tree, hidden, weights, targets = problem
  return tf_hsm.nll_loss(hidden, weights, None, tree, targets, loss_scale=loss_scale)


def _sample(problem, temperature):
  tree, hidden, weights, _ = problem
  return tf_hsm.sample(hidden, weights, None, tree, seed=1, temperature=temperature)


def test_python_scalars_are_float64_in_a_float64_computation(problem):
  np.testing.assert_array_equal(_sgd(problem, 0.1), _sgd(problem, np.float64(0.1)))
  assert _nll(problem, 0.1).numpy() == _nll(problem, np.float64(0.1)).numpy()
  np.testing.assert_array_equal(_sample(problem, 1e-300).numpy(),
                                _sample(problem, np.float64(1e-300)).numpy())


@pytest.mark.parametrize("call,name", [(_sgd, "learning_rate"), (_nll, "loss_scale"),
                                       (_sample, "temperature")])
@pytest.mark.parametrize("bad", ["0.1", True, b"1"])
def test_non_numbers_are_type_errors_naming_the_argument(problem, call, name, bad):
  with pytest.raises(TypeError, match=name):
    call(problem, bad)


@pytest.mark.parametrize("call,name", [(_sgd, "learning_rate"), (_sample, "temperature")])
def test_scalars_of_another_shape_are_value_errors(problem, call, name):
  with pytest.raises(ValueError, match=f"{name} must be a scalar"):
    call(problem, [0.1, 0.2])


def test_loss_scale_that_does_not_broadcast_names_itself(problem):
  with pytest.raises(ValueError, match="loss_scale of shape"):
    _nll(problem, np.ones(5))
  with pytest.raises(ValueError, match="loss_scale of shape"):
    _nll(problem, np.ones((6, 2)))
  assert np.isfinite(_nll(problem, np.ones(6)).numpy())


def test_subnormal_temperature_is_a_clear_error(problem):
  with pytest.raises(ValueError, match="subnormal"):
    _sample(problem, 5e-324)


@pytest.mark.parametrize("build", [
    lambda: tf_hsm.Tree.from_nested([2**70, 1]),
    lambda: tf_hsm.Tree.from_nested([[0, 1], 2**70]),
    lambda: tf_hsm.Tree.balanced(2**70, 2),
    lambda: tf_hsm.Tree.balanced(5, 2**70)])
def test_tree_builders_refuse_ints_beyond_int64(build):
  with pytest.raises(ValueError, match="int64"):
    build()
