"""The demo's --output-lr-scale: the output layer's steps scaled, every other's not."""

import keras
import numpy as np
import pytest

import tf_hsm
from tf_hsm.demo import optimizer as demo_optimizer
from tf_hsm.demo import run as demo


def _one_step(make_model, scale):
  """{variable path: its change after one training step} of a model made with
  `output_lr_scale=scale`, from the seed's initial values, on a fixed batch."""
  keras.utils.set_random_seed(3)
  model = make_model(scale)
  before = {v.path: np.array(v.numpy(), np.float64) for v in model.trainable_variables}
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 40, (4, 6))
  targets = rng.integers(0, 40, (4, 6))
  model.train_on_batch([tokens, targets], targets)
  return {v.path: np.array(v.numpy(), np.float64) - before[v.path]
          for v in model.trainable_variables}


@pytest.mark.parametrize("output", ["hsm", "full", "sampled", "adaptive"])
def test_the_output_layers_step_is_scaled_and_no_other(output):
  counts = np.arange(40, 0, -1).astype(np.float64)
  tree = tf_hsm.Tree.huffman(counts, branching=4)
  make = {
      "hsm": lambda s: demo.hsm_model(tree, counts, 8, 6, 0.01, output_lr_scale=s),
      "full": lambda s: demo.full_softmax_model(counts, 8, 6, 0.01, output_lr_scale=s),
      "sampled": lambda s: demo.sampled_softmax_model(counts, 8, 6, 0.01, 5,
                                                      output_lr_scale=s),
      "adaptive": lambda s: demo.adaptive_model(counts, 8, 6, 0.01, [10, 20],
                                                output_lr_scale=s),
  }[output]
  plain, scaled = _one_step(make, 1.0), _one_step(make, 3.0)
  layer = {"hsm": "hsm", "full": "hsm", "sampled": "sampled_softmax",
           "adaptive": "adaptive"}[output]
  outputs = [p for p in plain if p.split("/")[0] == layer]
  assert outputs and len(outputs) < len(plain)
  for path, delta in plain.items():
    if path in outputs:
      assert np.abs(delta).max() > 0, path
      np.testing.assert_allclose(scaled[path], 3.0 * delta, rtol=1e-4, atol=1e-9,
                                 err_msg=path)
    else:
      np.testing.assert_array_equal(scaled[path], delta, err_msg=path)


def test_the_scale_survives_the_config_and_bad_scales_are_refused():
  opt = demo_optimizer.lazy_adam(0.01, "hsm", 4.0)
  assert isinstance(opt, demo_optimizer.OutputScaledLazyAdam)
  again = type(opt).from_config(opt.get_config())  # what RebuildTree does
  assert (again.output_layer, again.output_scale) == ("hsm", 4.0)
  assert type(demo_optimizer.lazy_adam(0.01, "hsm")) is tf_hsm.optimizers.LazyAdam
  for bad in (0.0, -1.0, float("inf"), float("nan"), True):
    with pytest.raises(ValueError, match="output_scale"):
      demo_optimizer.OutputScaledLazyAdam(0.01, output_scale=bad)
  with pytest.raises(ValueError, match="output_layer"):
    demo_optimizer.OutputScaledLazyAdam(0.01, output_layer="")
  assert demo.parse_args(["--output-lr-scale", "4"]).output_lr_scale == 4.0
  for bad in ("0", "-2", "nan", "inf"):
    with pytest.raises(SystemExit):
      demo.parse_args(["--output-lr-scale", bad])
