"""Runs the C++ unit tests of the framework-agnostic core (cc/tests/core_test.cc)."""

import os
import subprocess

import support

ROOT = support.REPO
BINARY = os.path.join(ROOT, "bazel-bin", "cc", "core_test")


def test_cc_core():
  assert os.path.exists(BINARY), f"{BINARY} is missing: run ./configure.sh"
  result = subprocess.run([BINARY], capture_output=True, text=True, timeout=600)
  print(result.stdout)
  assert result.returncode == 0, result.stdout + result.stderr
  assert "0 failed" in result.stdout
