"""The demo's optimizer: LazyAdam, its output layer's table trained at a multiple of the
learning rate (`--output-lr-scale`).

At 100K classes the context tree, sampled softmax and full softmax all train better with
their tables at a few times the body's rate, full and sampled softmax most
(docs/planner.md, "The output table's learning rate" and "At 4x for an epoch"). Every
model takes the same flag, so that each is compared at the same scale.
"""

from tf_hsm.keras import optimizers


def _layer_name(variable):
  """The name of the layer that owns `variable`: the first part of its path ("hsm" for
  "hsm/kernel"; a tf.Variable, as Keras hands it to `update_step`, is named
  "hsm/kernel:0")."""
  return (getattr(variable, "path", None) or variable.name).split("/")[0]


class OutputScaledLazyAdam(optimizers.LazyAdam):
  """`tf_hsm.optimizers.LazyAdam` whose steps for the variables of the layer named
  `output_layer` are `output_scale` times the learning rate's (its moments are the
  same; only the step is scaled), every other variable's as LazyAdam's."""

  def __init__(self, learning_rate=0.001, output_layer="hsm", output_scale=1.0, **kwargs):
    super().__init__(learning_rate, **kwargs)
    if not isinstance(output_layer, str) or not output_layer:
      raise ValueError(f"output_layer must be a layer's name, got {output_layer!r}")
    if isinstance(output_scale, bool) or not (float(output_scale) > 0 and
                                              float(output_scale) < float("inf")):
      raise ValueError(f"output_scale must be a positive number, got {output_scale!r}")
    self.output_layer = output_layer
    self.output_scale = float(output_scale)

  def update_step(self, gradient, variable, learning_rate):
    if _layer_name(variable) == self.output_layer:
      learning_rate = learning_rate * self.output_scale
    return super().update_step(gradient, variable, learning_rate)

  def get_config(self):
    # RebuildTree makes the rebuilt model's optimizer from this config.
    return {**super().get_config(), "output_layer": self.output_layer,
            "output_scale": self.output_scale}


def lazy_adam(learning_rate, output_layer, output_scale=1.0):
  """The demo models' optimizer: LazyAdam, or with `output_scale` != 1 an
  `OutputScaledLazyAdam` for the layer named `output_layer`."""
  if output_scale == 1.0:
    return optimizers.LazyAdam(learning_rate)
  return OutputScaledLazyAdam(learning_rate, output_layer=output_layer,
                              output_scale=output_scale)

