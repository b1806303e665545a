"""Packaging for `./configure.sh --wheel`: the tf_hsm package with the op library that
configure.sh built into tf_hsm/ (and its build record), as a platform wheel that pins the
TensorFlow it was built against."""

import os
import re

from setuptools import find_packages, setup
from setuptools.dist import Distribution

HERE = os.path.dirname(os.path.abspath(__file__))


class BinaryDistribution(Distribution):
  """The package holds a compiled library: a wheel for this Python and platform."""

  def has_ext_modules(self):
    return True


def _version():
  with open(os.path.join(HERE, "tf_hsm", "__init__.py")) as f:
    return re.search(r'^__version__ = "([^"]+)"', f.read(), re.M).group(1)


def _tensorflow_requirement():
  """tensorflow==X.Y.* for the X.Y the library was built against (configure.sh records
  it in tf_hsm/_hsm_ops.cpu): custom ops only load into the TensorFlow whose ABI they were
  compiled for."""
  record = os.path.join(HERE, "tf_hsm", "_hsm_ops.cpu")
  if not os.path.exists(os.path.join(HERE, "tf_hsm", "_hsm_ops.so")) or not os.path.exists(
      record):
    raise SystemExit("tf_hsm/_hsm_ops.so is not built: run ./configure.sh --wheel")
  with open(record) as f:
    fields = dict(line.rstrip("\n").split("=", 1) for line in f if "=" in line)
  major_minor = ".".join(fields.get("tensorflow", "").split(".")[:2])
  if not major_minor:
    raise SystemExit("tf_hsm/_hsm_ops.cpu does not say which TensorFlow the library was "
                     "built against: run ./configure.sh --wheel again")
  return f"tensorflow=={major_minor}.*"


setup(
    name="tf_hsm",
    version=_version(),
    description="Hierarchical softmax ops, a Keras layer and sparse optimizers for "
                "TensorFlow",
    packages=find_packages(include=["tf_hsm", "tf_hsm.*"]),
    package_data={"tf_hsm": ["_hsm_ops.so", "_hsm_ops.cpu"]},
    python_requires=">=3.9",
    install_requires=[_tensorflow_requirement(), "numpy"],
    # The demo's plot; the tf_keras front end (tf_hsm.tf_keras), of TensorFlow's version.
    extras_require={"demo": ["matplotlib"],
                    "tf_keras": [_tensorflow_requirement().replace("tensorflow", "tf-keras")]},
    distclass=BinaryDistribution,
    zip_safe=False,
)
