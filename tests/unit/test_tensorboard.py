"""`keras.callbacks.TensorBoard` on a tf_hsm model, in both Keras: tensorboard is among
the pinned requirements, at TensorFlow's own release, so the callback that every Keras
tutorial adds writes its logs (without it: `TBNotInstalledError` at `fit`)."""

import os
import re

import numpy as np
import pytest
import tensorflow as tf

import tf_hsm
import support

V, D = 50, 8


def _events(log_dir):
  return [name for _, _, files in os.walk(log_dir) for name in files
          if name.startswith("events.out.tfevents")]


def _fit(keras_module, front_end, log_dir):
  tree = tf_hsm.Tree.huffman(np.arange(V, 0, -1, dtype=float), branching=4)
  tokens = keras_module.Input((None,), dtype="int32")
  targets = keras_module.Input((None,), dtype="int32")
  hidden = keras_module.layers.Embedding(V, D)(tokens)
  model = keras_module.Model([tokens, targets],
                             front_end.HierarchicalSoftmax(tree)(hidden, targets))
  model.compile(optimizer=front_end.optimizers.LazyAdam(0.01), loss=front_end.losses.nll)
  x = np.random.default_rng(0).integers(1, V, (32, 5)).astype(np.int32)
  model.fit([x, x], x, epochs=2, batch_size=16, verbose=0,
            callbacks=[keras_module.callbacks.TensorBoard(log_dir=str(log_dir))])


def test_tensorboard_callback_writes_logs_keras3(tmp_path):
  keras = pytest.importorskip("keras")
  _fit(keras, tf_hsm.keras, tmp_path)
  assert _events(tmp_path)


def test_tensorboard_callback_writes_logs_tf_keras(tmp_path):
  tf_keras = pytest.importorskip("tf_keras")
  _fit(tf_keras, tf_hsm.tf_keras, tmp_path)
  assert _events(tmp_path)


def test_tensorboard_is_pinned_at_tensorflows_release():
  pins = dict(re.findall(r"^([\w-]+)==(\S+)", open(os.path.join(
      support.REPO, "requirements.txt")).read(), flags=re.M))
  assert pins.get("tensorboard") == pins["tensorflow"] == tf.__version__
