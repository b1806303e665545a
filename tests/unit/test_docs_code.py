"""Every Python block of README.md and docs/usage.md runs, in order, as a reader would
run them one after the other: what they name is defined in them, or (for what a reader
brings: their data, a PyTorch module) in a small prelude here. Sizes shrink so that the
suite stays fast; nothing else of the code changes. A block that starts a loopback
cluster is self-contained and runs alone, in a process of its own."""

import os
import re

import numpy as np
import pytest

import support

# What the reader brings.
PRELUDE = """
import numpy as np


class _TorchModule:  # stands in for a PyTorch AdaptiveLogSoftmaxWithLoss
  def state_dict(self):
    rng = np.random.default_rng(0)
    return {"head.weight": rng.normal(size=(2002, 256)).astype(np.float32),
            "tail.0.0.weight": rng.normal(size=(64, 256)).astype(np.float32),
            "tail.0.1.weight": rng.normal(size=(18000, 64)).astype(np.float32),
            "tail.1.0.weight": rng.normal(size=(16, 256)).astype(np.float32),
            "tail.1.1.weight": rng.normal(size=(vocab - 20000, 16)).astype(np.float32)}


torch_module = _TorchModule()
warmup_softmax_weights = np.random.default_rng(1).normal(size=(24_000, 64))  # [vocab, D']
"""

# Smaller sizes: (pattern, replacement), applied to every block.
SMALLER = [(r"\b100_000\b", "24_000"), (r"epochs=[35]\b", "epochs=1"),
           (r"size=\(256, 20\)", "size=(16, 20)"), (r"\[32, 20, D\]", "[4, 20, D]"),
           (r"\[32, 20\]", "[4, 20]"), (r"\[32, 20, 5\]", "[4, 20, 5]")]


def _blocks(path):
  text = open(os.path.join(support.REPO, path)).read()
  return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def _starts_a_cluster(block):
  # Such a block starts processes and connects this one to them (a strategy over a
  # cluster changes the process's TensorFlow context): it runs in a process of its own.
  return "LoopbackCluster" in block


@pytest.mark.parametrize("path", ["README.md", "docs/usage.md"])
def test_code_blocks_run(path, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)  # what the blocks write ("exported/") lands there
  namespace = {}
  exec(compile(PRELUDE, "prelude", "exec"), namespace)  # pylint: disable=exec-used
  for number, block in enumerate(_blocks(path), 1):
    if _starts_a_cluster(block):
      continue
    for pattern, replacement in SMALLER:
      block = re.sub(pattern, replacement, block)
    try:
      exec(compile(block, f"{path} block {number}", "exec"), namespace)  # pylint: disable=exec-used
    except Exception as error:  # pylint: disable=broad-except
      pytest.fail(f"{path}, Python block {number} fails: {type(error).__name__}: "
                  f"{error}\n{block}")
  assert np.isfinite(namespace["model"].history.history["loss"]).all()


@pytest.mark.slow
def test_readme_cluster_block_trains_on_a_loopback_cluster(tmp_path):
  """The README's parameter-server `fit`, run as it is written, in a fresh process (its
  own imports; a self-contained block), then its model's losses checked."""
  blocks = [b for b in _blocks("README.md") if _starts_a_cluster(b)]
  assert len(blocks) == 1
  script = tmp_path / "cluster_block.py"
  script.write_text(blocks[0] + """
losses = ps_model.history.history["loss"]
assert len(losses) == 2 and all(np.isfinite(losses)) and losses[1] < losses[0], losses
print("losses", losses)
""")
  out = support.run([script], timeout=300, cwd=tmp_path)
  assert "losses" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]
