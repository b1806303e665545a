"""The wheel: built from this checkout's library (as `./configure.sh --wheel` does, there
for a portable x86-64 level), installed with pip into a fresh virtual environment that
holds only TensorFlow and the wheel's dependencies, and used from outside the checkout:
a Keras training step and an inference call."""

import os
import sys
import textwrap

import pytest

import support

ROOT = support.REPO

SMOKE = textwrap.dedent("""
    import numpy as np, keras, tf_hsm
    assert "site-packages" in tf_hsm.__file__, tf_hsm.__file__
    tree = tf_hsm.Tree.huffman(np.arange(1, 201, dtype=np.float64), branching=4)
    x = keras.Input((8,))
    y = keras.Input((), dtype="int64")
    model = keras.Model([x, y], tf_hsm.HierarchicalSoftmax(tree)(keras.layers.Dense(16)(x), y))
    model.compile(optimizer=tf_hsm.optimizers.LazyAdam(0.01), loss=tf_hsm.losses.nll)
    rng = np.random.default_rng(0)
    features = rng.normal(size=(64, 8)).astype(np.float32)
    targets = rng.integers(0, 200, 64)
    losses = model.fit([features, targets], targets, epochs=3, batch_size=32,
                       verbose=0).history["loss"]
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0], losses
    weights = rng.normal(size=(tree.num_slots, 16)).astype(np.float32)
    log_probs, classes = tf_hsm.top_k(rng.normal(size=(5, 16)).astype(np.float32), weights,
                                      None, tree, 3)
    assert classes.shape == (5, 3)
    print("wheel ok", losses)
""")


def _run(command, cwd, timeout):
  # Not the checkout's path: the wheel must run from where pip put it.
  return support.run(command, timeout, cwd=cwd, env=dict(
      os.environ, TF_CPP_MIN_LOG_LEVEL="2", PIP_DISABLE_PIP_VERSION_CHECK="1"))


@pytest.mark.slow
def test_wheel_installs_and_runs_outside_the_checkout(tmp_path):
  dist = tmp_path / "dist"
  _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
        "-w", str(dist), "."], ROOT, 300)
  wheels = list(dist.glob("tf_hsm-*.whl"))
  assert len(wheels) == 1, wheels
  name = wheels[0].name
  assert name.startswith("tf_hsm-") and "-cp3" in name and "linux_x86_64" in name, name
  venv = tmp_path / "venv"
  _run([sys.executable, "-m", "venv", str(venv)], tmp_path, 120)
  python = str(venv / "bin" / "python")
  _run([python, "-m", "pip", "install", "-q", str(wheels[0])], tmp_path, 900)
  listed = _run([python, "-m", "pip", "list", "--format=freeze"], tmp_path, 60).stdout
  assert "tensorflow==" in listed and "tf-hsm==" in listed.lower().replace("_", "-")
  outside = tmp_path / "elsewhere"
  outside.mkdir()
  (outside / "smoke.py").write_text(SMOKE)
  assert "wheel ok" in _run([python, "smoke.py"], outside, 300).stdout
