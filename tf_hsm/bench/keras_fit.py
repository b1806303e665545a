"""A Keras `model.fit` step of an output layer at any size: step time and peak memory.

    python -m tf_hsm.bench.keras_fit --classes 10M --hidden 300 --tokens 3200 \\
        --layer adaptive --tail two_level            # cutoffs from the cost model
    python -m tf_hsm.bench.keras_fit --classes 10M --hidden 300 --tokens 3200 \\
        --layer hsm --tree huffman32
    python -m tf_hsm.bench.keras_fit --classes 1M --hidden 300 --tokens 3200 \\
        --layer hsm --tree vectors32_head256 --optimizer lazy_adam --fused-update
    python -m tf_hsm.bench.keras_fit --classes 1M --hidden 300 --tokens 3200 \\
        --layer mixture --mixture 4x16+128r16 --optimizer lazy_adam --fused-update
    python -m tf_hsm.bench.keras_fit --classes 1M --hidden 300 --tokens 3200 \\
        --layer sampled --optimizer lazy_adam

The model is what a user trains: features -> Dense(hidden) -> the output layer
(`HierarchicalSoftmax` over the named tree of the Zipf(1) counts, `fused_update` with
`--fused-update`; `HierarchicalSoftmaxMixture` of the trees `--mixture` names, as
`python -m tf_hsm.bench.wide --mixtures` takes them, each component with
`fused_update` with `--fused-update`; TF's `sampled_softmax_loss` with 1,024 samples,
the demo's layer; or `AdaptiveSoftmax` with the given or chosen cutoffs), compiled with
`tf_hsm.losses.nll` and `tf_hsm.optimizers.SparseSGD` (or `LazyAdam`), fed by a `tf.data` pipeline of Zipf(1) targets
(`--batches` distinct batches, cycled), and trained with `model.fit` for `--steps` steps.
Printed: the median wall time of the steps after the first two (tracing, first
allocations), the output layer's weights (table and projections), and the process's peak
RSS (and its RSS with TensorFlow's runtime up, before the model) against the bound
1.3 x weights + 1 GiB.
"""

import argparse
import json
import resource
import statistics
import time

import numpy as np

from tf_hsm.bench import worker
from tf_hsm.bench.cases import build_tree, zipf_targets, zipf_weights

GIB = 2**30
SAMPLED = 1024  # TF's sampled softmax's samples, as the bench's other parts take


def _count(text):
  from tf_hsm.planning import parse_count  # pylint: disable=import-outside-toplevel
  return parse_count(text)


def output_layer(args, counts):
  """The output layer, and a description of its layout."""
  import tf_hsm  # pylint: disable=import-outside-toplevel
  fused = ", fused update" if args.fused_update else ""
  if args.layer == "hsm":
    tree = _tree(args.tree, args.classes, counts)
    return (tf_hsm.HierarchicalSoftmax(tree, name="output", fused_update=args.fused_update),
            f"HierarchicalSoftmax {args.tree}{fused}: {tree.num_slots:,} slots, depth "
            f"{tree.max_depth}")
  if args.layer == "mixture":
    shape = args.mixture_shape
    return _mixture(args), f"HierarchicalSoftmaxMixture {shape} ({shape.label()}){fused}"
  if args.layer == "sampled":
    from tf_hsm.demo import run as demo  # pylint: disable=import-outside-toplevel
    return (demo.sampled_softmax_layer(counts, SAMPLED, name="output"),
            f"TF's sampled_softmax_loss, {SAMPLED:,} samples")
  cutoffs = [int(c) for c in args.cutoffs.split(",")] if args.cutoffs else None
  layer = tf_hsm.AdaptiveSoftmax(args.classes, cutoffs, div_value=args.div_value,
                                 tail=args.tail, counts=counts,
                                 tokens_per_step=args.tokens, name="output")
  return layer, f"AdaptiveSoftmax {args.tail}, div {args.div_value:g}"


def _tree(kind, classes, counts):
  """The `--tree` of `classes` classes over the Zipf `counts`."""
  import tf_hsm  # pylint: disable=import-outside-toplevel
  if kind == "two_level":
    return tf_hsm.Tree.two_level(classes, counts=counts)
  if kind.startswith("huffman"):
    return tf_hsm.Tree.huffman(counts, branching=int(kind[len("huffman"):] or 2))
  if kind == "vectors32_head256":
    return build_tree(kind, classes)
  raise ValueError(f"--tree must be two_level, huffmanK or vectors32_head256, got {kind!r}")


def _mixture(args):
  """`HierarchicalSoftmaxMixture` of the trees of `args.mixture_shape` (a
  `tf_hsm.bench.wide.MixtureShape`, its trees from Gaussian vectors as that bench's)."""
  import tf_hsm  # pylint: disable=import-outside-toplevel
  from tf_hsm.bench import wide  # pylint: disable=import-outside-toplevel
  shape = args.mixture_shape
  trees, head = wide.mixture_trees(np.random.default_rng(args.seed), shape, args.classes)
  components = [tf_hsm.HierarchicalSoftmax(t, fused_update=args.fused_update)
                for t in trees]
  return tf_hsm.HierarchicalSoftmaxMixture(components, head=head, tail_dim=shape.tail_dim,
                                           head_rank=shape.head_rank, name="output")


def _mixture_shape(parser, args):
  """The one `MixtureShape` of `--mixture`, or the parser's error naming what is wrong."""
  from tf_hsm.bench import wide  # pylint: disable=import-outside-toplevel
  try:
    shapes = wide.parse_mixtures(args.mixture)
  except ValueError as e:
    parser.error(str(e).replace("--mixtures", "--mixture"))
  if len(shapes) != 1:
    parser.error(f"--mixture takes one mixture, got {args.mixture!r}")
  shape, = shapes
  if args.classes <= shape.head:
    parser.error(f"--mixture {args.mixture} needs more classes than its head of "
                 f"{shape.head}, got --classes {args.classes}")
  return shape


class _StepTimes:
  """Wall time of each training batch, as `model.fit` runs it."""

  def __init__(self):
    import keras  # pylint: disable=import-outside-toplevel
    times = self.times = []

    class Callback(keras.callbacks.Callback):

      def on_train_batch_begin(self, batch, logs=None):
        self.start = time.perf_counter()

      def on_train_batch_end(self, batch, logs=None):
        times.append(time.perf_counter() - self.start)

    self.callback = Callback()


def run(args):
  """{"layout", "weights_bytes", "step_seconds" (median), "steps", "peak_rss", "bound"}."""
  import keras  # pylint: disable=import-outside-toplevel
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  from tf_hsm.keras import losses, optimizers  # pylint: disable=import-outside-toplevel
  keras.utils.set_random_seed(args.seed)
  tf.constant(0).numpy()  # TensorFlow's runtime up: the baseline RSS
  baseline = _rss()
  # The peak of this run, not of whatever ran in the process before (a test session):
  # VmHWM from here on. (ru_maxrss lags: Linux updates its high-water mark lazily, and
  # it read below the current RSS in a full test run.)
  peak_reset = worker.reset_peak_rss()
  counts = zipf_weights(args.classes)
  start = time.perf_counter()
  layer, layout = output_layer(args, counts)
  build_seconds = time.perf_counter() - start
  features = keras.Input((args.features,), name="features")
  targets = keras.Input((), dtype="int64", name="targets")
  hidden = keras.layers.Dense(args.hidden, activation="tanh", name="hidden")(features)
  model = keras.Model([features, targets], layer(hidden, targets))
  optimizer = (optimizers.LazyAdam(learning_rate=1e-3) if args.optimizer == "lazy_adam"
               else optimizers.SparseSGD(learning_rate=0.1))
  model.compile(optimizer=optimizer, loss=losses.nll)

  rng = np.random.default_rng(args.seed)
  batches = [(rng.standard_normal((args.tokens, args.features)).astype(np.float32),
              zipf_targets(args.classes, args.tokens, args.seed + 1 + i))
             for i in range(args.batches)]
  x = np.concatenate([b[0] for b in batches])
  y = np.concatenate([b[1] for b in batches])
  data = tf.data.Dataset.from_tensor_slices(((x, y), y)).batch(args.tokens).repeat()
  timer = _StepTimes()
  model.fit(data, epochs=1, steps_per_epoch=args.steps, verbose=0, shuffle=False,
            callbacks=[timer.callback])
  steady = timer.times[2:] or timer.times
  peak = max(worker.status_bytes("VmHWM") or 0, _rss())
  weights_bytes = sum(int(np.prod(w.shape)) * np.dtype(w.dtype).itemsize
                      for w in layer.weights)
  if args.layer == "adaptive":
    layout += f", cutoffs {list(layer.cutoffs)}"
  return {"layout": layout, "build_seconds": build_seconds, "weights_bytes": weights_bytes,
          "step_seconds": statistics.median(steady), "steps": timer.times,
          "baseline_rss": baseline, "peak_rss": peak, "bound": 1.3 * weights_bytes + GIB,
          # Where the kernel refuses the reset, the peak is the process's own since it
          # started (in a test session, of everything run before).
          "peak_since": "the baseline" if peak_reset else "the process's start"}


def _rss():
  """This process's resident bytes now."""
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * resource.getpagesize()


def main(argv=None):
  parser = argparse.ArgumentParser(prog="python -m tf_hsm.bench.keras_fit",
                                   description=__doc__.split("\n\n")[0])
  parser.add_argument("--classes", type=_count, default=10_000_000)
  parser.add_argument("--hidden", type=_count, default=300)
  parser.add_argument("--tokens", type=_count, default=3200)
  parser.add_argument("--features", type=int, default=64,
                      help="width of the model's input (default: %(default)s)")
  parser.add_argument("--layer", choices=("hsm", "mixture", "sampled", "adaptive"),
                      default="adaptive")
  parser.add_argument("--tree", default="huffman32",
                      help="two_level, huffmanK or vectors32_head256 (hsm)")
  parser.add_argument("--mixture", default="4x16+128r16",
                      help="the mixture's trees, as bench.wide's --mixtures takes one "
                           "(mixture; default: %(default)s)")
  parser.add_argument("--optimizer", choices=("sparse_sgd", "lazy_adam"),
                      default="sparse_sgd")
  parser.add_argument("--fused-update", action="store_true",
                      help="HierarchicalSoftmax(fused_update=True), of each tree of a "
                           "mixture (hsm, mixture; lazy_adam)")
  parser.add_argument("--tail", choices=("flat", "two_level"), default="two_level")
  parser.add_argument("--cutoffs", default=None,
                      help="e.g. 2000,20000 (adaptive; default: from the cost model)")
  parser.add_argument("--div-value", type=float, default=4.0)
  parser.add_argument("--steps", type=int, default=12)
  parser.add_argument("--batches", type=int, default=4)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--json", action="store_true",
                      help="then the result as one JSON line (steps, bytes, the layout)")
  args = parser.parse_args(argv)
  if args.steps < 3:
    parser.error("--steps must be at least 3 (the first two are not counted)")
  if args.fused_update and (args.layer not in ("hsm", "mixture") or
                            args.optimizer != "lazy_adam"):
    parser.error("--fused-update is for --layer hsm or mixture with --optimizer lazy_adam")
  args.mixture_shape = _mixture_shape(parser, args) if args.layer == "mixture" else None
  result = run(args)
  _print(args, result)
  if args.json:
    print(json.dumps(result), flush=True)


def _print(args, result):
  print(f"V={args.classes:,} D={args.hidden} T={args.tokens:,}: {result['layout']} "
        f"(built in {result['build_seconds']:.1f} s)")
  full_width = args.classes * (args.hidden + 1) * 4
  print(f"output layer weights {result['weights_bytes'] / GIB:.2f} GiB, "
        f"{result['weights_bytes'] / full_width:.3f} x a full-width [V, D+1] float32 table "
        f"({full_width / GIB:.2f} GiB)")
  print("steps (s): " + ", ".join(f"{t:.3f}" for t in result["steps"]))
  print(f"model.fit step, median of steps 3-{args.steps}: {result['step_seconds']:.3f} s")
  print(f"peak RSS since {result['peak_since']} {result['peak_rss'] / GIB:.2f} GiB "
        f"(TensorFlow's runtime before the "
        f"model: {result['baseline_rss'] / GIB:.2f} GiB); bound 1.3 x weights + 1 GiB = "
        f"{result['bound'] / GIB:.2f} GiB: "
        + ("within" if result["peak_rss"] <= result["bound"] else "OVER"))


if __name__ == "__main__":
  main()
