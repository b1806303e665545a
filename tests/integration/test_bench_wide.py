"""python -m tf_hsm.bench.wide: its parts run and report, on small sizes (the figures
themselves are the bench's, in docs/performance.md)."""

import json
import re
import subprocess
import sys

import pytest

import support


def test_memory_case_reports_the_peak_growth_of_one_step():
  for mode in ("sgd_step", "gradient"):
    done = support.run([sys.executable, "-m", "tf_hsm.bench.wide", "--memory-case",
                        f"20000,16,256,{mode}"], timeout=300)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["case"] == "V=20000 D=16 T=256" and result["mode"] == mode
    # The step holds no [T, V] logits (20 MB here); the gradient is the table's size.
    assert result["peak growth GiB"] < 0.2
    assert result["step s"] > 0


def test_interleaved_takes_medians_of_every_method():
  from tf_hsm.bench import wide
  import tensorflow as tf
  calls = []
  methods = {"a": lambda: (calls.append("a"), [tf.constant(1)])[1],
             "b": lambda: (calls.append("b"), [tf.constant(2)])[1]}
  medians = wide.interleaved(methods, 3)
  assert set(medians) == {"a", "b"} and all(m >= 0 for m in medians.values())
  assert calls == ["a", "b"] * 4  # one warm-up round, then three interleaved


def test_unknown_parts_are_refused():
  done = subprocess.run([sys.executable, "-m", "tf_hsm.bench.wide", "--parts", "flat,nope"],
                        capture_output=True, text=True, cwd=support.REPO, timeout=120)
  assert done.returncode == 2 and "unknown parts ['nope']" in done.stderr


def test_heads_are_parsed_and_bad_ones_refused():
  from tf_hsm.bench import wide
  assert wide.parse_heads("32:1024,64:256,32:0") == ((32, 1024), (64, 256), (32, 0))
  assert wide.parse_heads(",".join(f"{b}:{h}" for b, h in wide.HEAD_TREES)) == \
      wide.HEAD_TREES
  for bad in ("32", "32:x", "1:256", "32:-1"):
    done = subprocess.run([sys.executable, "-m", "tf_hsm.bench.wide", "--parts", "head",
                           "--heads", bad], capture_output=True, text=True,
                          cwd=support.REPO, timeout=120)
    assert done.returncode == 2 and f"got '{bad}'" in done.stderr, done.stderr


def test_mixture_part_times_each_mixture_beside_one_tree_and_sampled_softmax():
  import numpy as np  # pylint: disable=import-outside-toplevel
  from tf_hsm.bench import wide
  result = wide.mixture_part(np.random.default_rng(0), 1, wide.parse_mixtures(
      "8:16,3x4:8,3x4+16,3x4+16/3,3x4+16r2"), classes=3000, dim=8, tokens=64)
  shared = ("shared head 16 + three 4-ary", "shared head 16 + three 4-ary, d=3",
            "shared head 16 + three 4-ary, heads of rank 2")
  parts = {f"{m}: {p}" for m in shared for p in ("its head", "one tree, tail tokens")}
  assert set(result["ms"]) == {"one tree 8:16", "mixture of two 8:16",
                               "mixture of three 4:8", *shared, "sampled softmax 1024",
                               *parts}
  assert all(v > 0 for v in result["ms"].values())
  assert set(result["speed vs sampled"]) == set(result["ms"]) - {"sampled softmax 1024"} - parts
  ms = result["ms"]
  for m in shared:  # the mixture's step less its parts (each rounded to 0.1 ms above)
    assert result["shared head's rest"][m] == pytest.approx(
        ms[m] - ms[f"{m}: its head"] - 3 * ms[f"{m}: one tree, tail tokens"], abs=0.3)
  assert wide.parse_mixtures(",".join(map(str, wide.MIXTURE_TREES))) == wide.MIXTURE_TREES
  assert wide.parse_mixtures("32:256,3x16+128,4x8+64/75,2x16+128r16") == (
      (2, 32, 256, False, None, None), (3, 16, 128, True, None, None),
      (4, 8, 64, True, 75, None), (2, 16, 128, True, None, 16))
  assert str(wide.MixtureShape(4, 8, 64, True, 75, 3)) == "4x8+64/75r3"
  with pytest.raises(ValueError, match="tail_dim .75. is of the trees below a shared head"):
    wide.MixtureShape(4, 8, 64, False, 75)
  with pytest.raises(ValueError, match="head_rank .2. is of the trees below a shared head"):
    wide.MixtureShape(4, 8, 64, False, None, 2)
  for bad, message in (("1x16:128", "2-8 trees"), ("9x16:128", "2-8 trees"),
                       ("3x1:4", "a branching of at least 2"),
                       ("ax16:128", "[TREESx]BRANCHING:HEAD or "
                        "[TREESx]BRANCHING+HEAD[/DIM][rRANK] (DIM, RANK >= 1), got "
                        "'ax16:128'"),
                       ("3x16+128r0", "RANK >= 1"), ("3x16:128r4", "got '3x16:128r4'"),
                       ("3x16+0", "a shared head of at least 1"),
                       ("3x16:128/64", "got '3x16:128/64'"), ("3x16+128/0", "DIM, RANK >= 1"),
                       ("3x16", "got '3x16'"), ("x16:128", "got 'x16:128'"),
                       ("", "got ''"), ("3X16:128", "got '3X16:128'")):
    with pytest.raises(ValueError, match=re.escape(message)):
      wide.parse_mixtures(bad)


def test_mixtures_whose_tables_do_not_fit_are_refused_before_they_are_built():
  """At V=1M, D=300 a 16-ary tree's table is 1.28 GB (3.84 with LazyAdam's slots);
  the parts' tables are refused by name where they exceed the memory available, and
  the command says so before importing a table's worth of anything."""
  from tf_hsm.bench import wide
  four = wide.parse_mixtures("4x16+128r16")
  # Four trees over the 999,872 tail classes and sampled softmax's [1M, 300] table.
  tree = 999_872 * 16 / 15 * 300 * 4
  assert wide.tables_bytes(four, trained=True) == pytest.approx(3 * (4 * tree + 1.2e9))
  # Untrained: the lone tree's own table, and the tree a shared head's parts time alone.
  assert wide.tables_bytes(four) == pytest.approx(
      4 * tree + 1.2e9 + 1_000_000 * 16 / 15 * 1200 + tree)
  assert wide.tables_bytes(wide.parse_mixtures("3x16+128/75")) < wide.tables_bytes(
      wide.parse_mixtures("3x16+128"))
  wide.check_tables_fit(four, trained=True, available=20e9)
  with pytest.raises(ValueError, match=r"tables alone hold 19.0 GB with LazyAdam's slots "
                     r"\(GB a mixture: 4x16\+128r16 15.4;.* 18.0 GB available"):
    wide.check_tables_fit(four, trained=True, available=18e9)
  # 8 trees x 20 mixtures with slots: 614 GB, past any machine this runs on.
  done = subprocess.run([sys.executable, "-m", "tf_hsm.bench.wide", "--parts", "trained",
                         "--mixtures", ",".join(["8x16+128"] * 20)], capture_output=True,
                        text=True, cwd=support.REPO, timeout=120)
  assert done.returncode == 2 and "time fewer --mixtures a process" in done.stderr


def test_trained_part_times_each_mixture_with_its_update_beside_sampled_softmax():
  """The trained part's steps update what they train: a step of a corrected mixture
  below a shared head moves every weight (the trees' rows, the head, its corrections,
  the gate), and sampled softmax's moves its table; both are timed side by side."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  from tf_hsm.bench import cases, wide
  from tf_hsm.keras import optimizers  # pylint: disable=import-outside-toplevel
  result = wide.trained_part(np.random.default_rng(0), 1, wide.parse_mixtures("3x4+16r2"),
                             classes=3000, dim=8, tokens=64)
  assert set(result["ms"]) == {"shared head 16 + three 4-ary, heads of rank 2",
                               "sampled softmax 1024"}
  assert all(v > 0 for v in result["ms"].values()) and "LazyAdam" in result["case"]
  rng = np.random.default_rng(1)
  shape = wide.MixtureShape(2, 4, 16, True, None, 2)
  trees, head = wide.mixture_trees(rng, shape, 3000)
  hidden = tf.constant(rng.normal(size=(64, 8)).astype(np.float32))
  targets = tf.constant(cases.zipf_targets(3000, 64, rng))
  step = wide._mixture_step(trees, hidden, targets, head, None, 2,  # pylint: disable=protected-access
                            optimizers.LazyAdam(0.1))
  variables = step.layer.trainable_variables
  before = [np.asarray(v).copy() for v in variables]
  step()
  step()  # V of the corrections moves from the second (U starts at zero)
  assert all(not np.array_equal(b, np.asarray(v)) for b, v in zip(before, variables))
  table, biases = tf.Variable(tf.zeros([3000, 8])), tf.Variable(tf.zeros([3000]))
  wide._sampled_step(hidden, table, biases, targets, 64,  # pylint: disable=protected-access
                     optimizers.LazyAdam(0.1))()
  assert np.abs(np.asarray(table)).sum() > 0 and np.abs(np.asarray(biases)).sum() > 0


def test_targets_are_zipf_over_the_classes():
  # P(c) = 1/((c+1) H_V): class 0 takes 1/H_V (~7% at V=1M), the last class ~1e-7; a
  # clipped np.random.zipf put most draws on the last class.
  import numpy as np
  from tf_hsm.bench import cases  # the bench's draw
  classes, tokens = 1_000_000, 100_000
  targets = cases.zipf_targets(classes, tokens, np.random.default_rng(3))
  harmonic = np.sum(1.0 / np.arange(1, classes + 1))
  counts = np.bincount(targets, minlength=classes)
  assert targets.min() >= 0 and targets.max() < classes
  assert abs(counts[0] / tokens - 1 / harmonic) < 0.005
  assert counts[classes - 1] <= 5
  head = np.sum(1.0 / np.arange(1, 129)) / harmonic  # the 128 most frequent: ~38%
  assert abs(np.mean(targets < 128) - head) < 0.01


def test_padding_bench_times_the_four_steps_on_one_batch():
  """tf_hsm.bench.padding's case on a small tree: each step's loss is the real tokens'
  summed NLL, the same for padding walked and skipped."""
  from tf_hsm.bench import cases, padding
  import numpy as np
  import tf_hsm
  tree = tf_hsm.Tree.huffman(cases.zipf_weights(60), 4)
  result = padding.padding_case("small", tree, 60, 0.3, 1, np.random.default_rng(3))
  assert set(result["ms"]) == {"no padding", "no padding, skip_padding",
                               "padding walked as class 0", "padding skipped"}
  assert all(v > 0 for v in result["ms"].values())
  assert result["speed-up from skipping"] > 0 and result["case"].endswith("30% padding")
  assert result["same losses"]


def test_padding_bench_refuses_a_fraction_outside_0_1():
  done = subprocess.run([sys.executable, "-m", "tf_hsm.bench.padding", "--padding", "1"],
                        capture_output=True, text=True, cwd=support.REPO, timeout=120)
  assert done.returncode == 2 and "--padding in [0, 1)" in done.stderr


def test_width_part_fits_a_line_through_the_widths():
  from tf_hsm.bench import wide
  import numpy as np
  result = wide.width_part(np.random.default_rng(0), 1, widths=(8, 32), classes=2_000,
                           tokens=64)
  assert set(result["ms"]) == {"D=8 forward", "D=8 forward and backward",
                               "D=32 forward", "D=32 forward and backward"}
  line = result["step ms = a + b D"]
  steps = result["ms"]
  assert abs(line["a"] + 32 * line["b"] - steps["D=32 forward and backward"]) < 0.1
