"""A run on a `LoopbackCluster` ends quietly: once its servers have ended, the
process's TensorFlow context no longer tells them of each function it deletes (which
logged "Failed to remove function remotely ... Connection refused" once per function
and server at exit, after a run that went well), and it runs on as a local one."""

import re

import pytest

import support

pytestmark = pytest.mark.slow


def _readme_cluster_block():
  text = open(f"{support.REPO}/README.md").read()
  blocks = [b for b in re.findall(r"```python\n(.*?)```", text, flags=re.S)
            if "LoopbackCluster" in b]
  assert len(blocks) == 1
  return blocks[0]


def test_readme_cluster_block_exits_without_errors(tmp_path):
  script = tmp_path / "cluster_block.py"
  script.write_text(_readme_cluster_block() + """
assert len(ps_model.history.history["loss"]) == 2
# The process goes on with local work once the cluster is closed.
assert float(tf.function(lambda x: 2 * x)(tf.constant(2.0))) == 4.0
print("trained")
""")
  env = support.repo_env()
  env["TF_CPP_MIN_LOG_LEVEL"] = "0"  # a user's default: errors are shown
  out = support.run([script], timeout=300, cwd=tmp_path, env=env)
  assert "trained" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]
  errors = [line for line in out.stderr.splitlines()
            if "Failed to remove function" in line or "Connection refused" in line]
  assert not errors, f"{len(errors)} lines such as: {errors[0]}"
