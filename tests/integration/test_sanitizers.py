"""The core's C++ tests under AddressSanitizer and UndefinedBehaviorSanitizer
(cc/sanitize.sh): no report, every test passing."""

import os
import shutil
import subprocess

import pytest

import support

ROOT = support.REPO


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_core_tests_pass_under_sanitizers():
  result = subprocess.run(["bash", os.path.join(ROOT, "cc", "sanitize.sh")], cwd=ROOT,
                          capture_output=True, text=True, timeout=1200)
  output = result.stdout + result.stderr
  assert result.returncode == 0, output[-6000:]
  assert "runtime error" not in output and "AddressSanitizer" not in output, output[-6000:]
  assert output.count(", 0 failed") == 2, output[-3000:]
