"""Helpers the tests share: where the repository is, gradients as dense arrays,
subprocesses bounded in time that are always stopped, and a tiny corpus for the demo."""

import os
import subprocess
import sys

import numpy as np

TESTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS)


def dense(grad, shape=None, sparse=False):
  """A gradient as a dense NumPy array: a `tf.IndexedSlices` scattered into zeros of
  `shape` (its dense shape when None) with duplicate rows summed, a tensor as is, None
  as zeros of `shape`. With `sparse`, anything but an IndexedSlices fails the test."""
  is_slices = hasattr(grad, "indices") and hasattr(grad, "values")
  assert is_slices or not sparse, f"expected a tf.IndexedSlices, got {type(grad).__name__}"
  if grad is None:
    return np.zeros(shape)
  if not is_slices:
    return np.asarray(grad)
  values = grad.values
  if shape is None:
    shape = tuple(int(d) for d in grad.dense_shape)
  out = np.zeros(shape, values.dtype.as_numpy_dtype)
  np.add.at(out, np.asarray(grad.indices), np.asarray(values))
  return out


def taped_log_prob(hidden, weights, biases, tree, targets):
  """tf_hsm.log_prob under a GradientTape: (log_prob, d_hidden, d_weights, d_biases) as
  NumPy arrays, the gradients of the sum (upstream 1) dense."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import tf_hsm  # pylint: disable=g-import-not-at-top
  h, w, b = tf.constant(hidden), tf.Variable(weights), tf.Variable(biases)
  with tf.GradientTape() as tape:
    tape.watch(h)
    lp = tf_hsm.log_prob(h, w, b, tree, targets)
  gh, gw, gb = tape.gradient(lp, [h, w, b])
  return lp.numpy(), gh.numpy(), dense(gw, w.shape), dense(gb, b.shape)


def repo_env(**extra):
  """The environment with the repository first on PYTHONPATH and TensorFlow quiet."""
  path = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH", "")) if p)
  return dict(os.environ, PYTHONPATH=path, TF_CPP_MIN_LOG_LEVEL="3", **extra)


def run(command, timeout, cwd=REPO, env=None, check=True):
  """Runs `command` (a list; a .py file first runs under this Python) and returns the
  `subprocess.CompletedProcess` with text output; the process is killed if it outlives
  `timeout` seconds. With `check`, a non-zero exit fails the test with its output."""
  command = [str(c) for c in command]
  if command[0].endswith(".py"):
    command = [sys.executable] + command
  process = subprocess.Popen(command, cwd=cwd, env=env or repo_env(), text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
  try:
    out, err = process.communicate(timeout=timeout)
  finally:
    if process.poll() is None:
      process.kill()
      process.communicate()
  result = subprocess.CompletedProcess(command, process.returncode, out, err)
  if check:
    assert result.returncode == 0, (command, out[-2000:], err[-4000:])
  return result


def zipf_corpus(path, seed=0, num_words=30, documents=80, length=12):
  """Writes a corpus of `documents` documents of `length` words w0, w1, ... drawn with
  probabilities falling linearly in the rank, blank lines between them; returns `path`."""
  words = [f"w{i}" for i in range(num_words)]
  probs = np.arange(num_words, 0, -1, dtype=np.float64)
  rng = np.random.default_rng(seed)
  path.write_text("\n\n".join(" ".join(rng.choice(words, length, p=probs / probs.sum()))
                               for _ in range(documents)))
  return path


def zipf_ids(classes=3_000, tokens=40_000, seed=0):
  """(token ids, their counts): a training text of Zipf(1.2) class ids, wrapped into
  [0, classes), the planner's `token_ids` and `counts`."""
  ids = (np.random.default_rng(seed).zipf(1.2, tokens) - 1) % classes
  return ids, np.bincount(ids, minlength=classes).astype(np.float64)


def trained_and_reloaded(model, inputs, targets, path, fit_scope=None):
  """Fits a compiled `model` 12 epochs (inside `fit_scope()` if given), checks that the
  loss fell by 30% and every weight moved, saves it to `path` (a .keras file) and checks
  that the loaded model predicts the same: the loaded model."""
  import contextlib  # pylint: disable=import-outside-toplevel
  import keras  # pylint: disable=import-outside-toplevel
  start = [np.asarray(w) for w in model.weights]
  with (fit_scope or contextlib.nullcontext)():
    history = model.fit(inputs, targets, batch_size=8, epochs=12, verbose=0)
  assert history.history["loss"][-1] < 0.7 * history.history["loss"][0]
  assert all(not np.array_equal(s, np.asarray(w)) for s, w in zip(start, model.weights))
  model.save(path)
  again = keras.models.load_model(path)
  np.testing.assert_array_equal(again.predict(inputs, verbose=0),
                                model.predict(inputs, verbose=0))
  return again


def layer_results(layers, hidden, targets, mask, k, seed):
  """For each layer (a Keras 3 layer and its tf_keras twin, say), on one batch: (output,
  its Keras mask, the gradients of the output's sum for hidden and the layer's trainable
  weights, top_k(hidden, k), log_prob_all(hidden), sample(hidden, seed=seed))."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  results = []
  for layer in layers:
    with tf.GradientTape() as tape:
      tape.watch(hidden)
      out = layer(hidden, targets, mask=mask)
    grads = tape.gradient(out, [hidden] + list(layer.trainable_weights))
    results.append((out, out._keras_mask, grads, layer.top_k(hidden, k),  # pylint: disable=protected-access
                    layer.log_prob_all(hidden), layer.sample(hidden, seed=seed)))
  return results
