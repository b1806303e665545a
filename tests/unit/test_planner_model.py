"""tf_hsm.plan(model=...): the body's parameters and FLOPs against hand-computed values,
duck typing (no Keras needed for the planner), the choice by measured quality, and the
planning package's import of no TensorFlow when given no model."""

import subprocess
import sys

import numpy as np
import pytest

import tf_hsm
from tf_hsm import planning as planner
from tf_hsm.planning import body as body_lib
from tf_hsm.planning import candidates
from tf_hsm.planning import quality

from support import REPO

MACHINE = {"matmul_flops": 50e9, "read_bytes": 15e9, "call_seconds": 150e-6,
           "softmax_seconds": 8e-9}


def test_small_keras_model_body_against_hand_computed():
  keras = pytest.importorskip("keras")
  from tf_hsm.keras.layers import HierarchicalSoftmax  # pylint: disable=import-outside-toplevel
  V, E, U, B, S = 1000, 16, 24, 4, 10
  tokens = keras.Input((S,), dtype="int32")
  x = keras.layers.Embedding(V, E)(tokens)
  x = keras.layers.LSTM(U, return_sequences=True)(x)
  x = keras.layers.Dense(32)(x)
  targets = keras.Input((S,), dtype="int32")
  out = HierarchicalSoftmax(tf_hsm.Tree.two_level(V))(x, targets)
  model = keras.Model([tokens, targets], out)
  body = body_lib.body_cost(model, B * S)
  assert body.output_layer == "HierarchicalSoftmax" and body.num_classes == V
  assert body.batch == B and body.hidden == 32
  by_kind = {layer.kind: layer for layer in body.layers}
  assert set(by_kind) == {"Embedding", "LSTM", "Dense"}
  assert by_kind["Embedding"].params == V * E
  assert by_kind["Embedding"].flops == 0
  assert not by_kind["Embedding"].parts[0].dense_grad
  assert by_kind["LSTM"].params == 4 * (E + U + 1) * U
  assert by_kind["LSTM"].flops == 6 * B * S * 4 * U * (E + U)
  assert by_kind["LSTM"].rnn_steps == S
  assert by_kind["Dense"].params == U * 32 + 32
  assert by_kind["Dense"].flops == 6 * B * S * U * 32
  assert body.params == V * E + 4 * (E + U + 1) * U + U * 32 + 32
  report = tf_hsm.plan(model=model, tokens_per_step=B * S, machine=MACHINE,
                       trees=("two_level",), adaptive=())
  assert report.settings["num_classes"] == V and report.settings["hidden"] == 32
  priced = report.body
  assert priced["params"] == body.params and priced["flops"] == body.flops
  for row in report.rows:
    assert row["whole_step_seconds"] == pytest.approx(row["step_seconds"] +
                                                      priced["step_seconds"])
    assert row["whole_peak_bytes"] == pytest.approx(row["peak_bytes"] + priced["peak_bytes"])
  assert "body: " in report.to_markdown() and "whole" in report.to_markdown()
  # The body alone (its output: the hidden states): the same figures, V given.
  alone = keras.Model(tokens, x)
  again = tf_hsm.plan(1000, model=alone, tokens_per_step=B * S, machine=MACHINE,
                      trees=("two_level",), adaptive=())
  assert again.body["flops"] == priced["flops"] and again.body["params"] == body.params
  # The costs the roofline does not see are in the machine's loop steps: a machine
  # whose loop step is twice as long pays twice those; one given without a probe is
  # priced at the default loop step.
  fixed = lambda loop: loop * (S * body_lib.RNN_STEP_LOOPS +
                               len(body.layers) * body_lib.LAYER_LOOPS +
                               body_lib.FIT_STEP_LOOPS)
  steps = {}
  for loop in (None, 5e-6, 10e-6):
    machine = dict(MACHINE, loop_step_seconds=loop)
    steps[loop] = body_lib.body_price(body, "sgd", "float32", machine)["step_seconds"]
  assert steps[10e-6] - steps[5e-6] == pytest.approx(fixed(10e-6) - fixed(5e-6))
  assert steps[None] - steps[5e-6] == pytest.approx(
      fixed(body_lib.DEFAULT_LOOP_STEP_SECONDS) - fixed(5e-6))


class _W:
  def __init__(self, *shape):
    self.shape = shape
    self.path = "w"


class _T:
  def __init__(self, *shape):
    self.shape = shape


def _layer(cls_name, inp, out, weights=(), **attrs):
  cls = type(cls_name, (), {})
  layer = cls()
  layer.name = cls_name.lower()
  layer.input, layer.output = _T(*inp), _T(*out)
  layer.weights = list(weights)
  layer.trainable_weights = list(weights)
  for k, v in attrs.items():
    setattr(layer, k, v)
  return layer


def test_duck_typed_layers_attention_conv_and_unknown():
  """Objects that only look like Keras layers: the planner imports no Keras."""
  B, S, D, H, K = 2, 8, 16, 4, 4
  mha = _layer("MultiHeadAttention", (None, S, D), (None, S, D),
               [_W(D, H, K), _W(D, H, K), _W(D, H, K), _W(H, K, D)], num_heads=H,
               key_dim=K, value_dim=K)
  conv = _layer("Conv1D", (None, S, D), (None, S, D), [_W(3, D, D), _W(D)])
  odd = _layer("MyLayer", (None, S, D), (None, S, D), [_W(D, D)])
  norm = _layer("LayerNormalization", (None, S, D), (None, S, D), [_W(D), _W(D)])
  model = type("M", (), {})()
  model.layers = [mha, conv, odd, norm]
  model.output = _T(None, S, D)
  body = body_lib.body_cost(model, B * S)
  mha_cost, conv_cost, odd_cost, norm_cost = body.layers
  assert mha_cost.flops == 6 * (B * S * D * H * 3 * K + B * S * H * K * D)
  assert mha_cost.attention_flops == 6 * B * H * S * S * 2 * K
  assert mha_cost.softmax == B * H * S * S
  assert conv_cost.flops == 6 * B * S * 3 * D * D
  assert odd_cost.flops == 6 * B * S * D * D
  assert norm_cost.flops == 0 and norm_cost.bytes_elements > 0
  assert any("MyLayer" in note and "parameter count" in note for note in body.notes)
  report = tf_hsm.plan(500, model=model, tokens_per_step=B * S, machine=MACHINE,
                       trees=("two_level",), adaptive=())
  assert any("MyLayer" in note for note in report.notes)
  with pytest.raises(ValueError, match="multiple"):
    body_lib.body_cost(model, B * S + 1)


def _row(method, step, quality_ratio, peak=1.0, exact=True):
  return {"method": method, "label": method, "step_seconds": step,
          "whole_step_seconds": step, "peak_bytes": peak, "quality": quality_ratio,
          "quality_evidence": "test", "exact": exact, "fits": True, "rows_touched": 1}


def test_choice_takes_the_most_accurate_within_the_margin():
  full = _row("full softmax", 1.0, 1.0)
  huff = _row("HierarchicalSoftmax huffman(2)", 0.100, 1.135)
  two = _row("HierarchicalSoftmax two_level(counts)", 0.110, 1.043)
  learned = _row("HierarchicalSoftmax learned(head=128, width=79)", 0.118, 1.009)
  slow = _row("AdaptiveSoftmax flat, the demo's cutoffs", 0.125, 1.005)
  best, reason = candidates._choose([full, huff, two, learned, slow], full, True)
  assert best is learned  # 18% over the fastest; the adaptive row is 25% over
  assert "within 20%" in reason and "+0.9%" in reason and "whole step" in reason
  # Equally accurate (within QUALITY_TIE): the faster.
  twin = _row("HierarchicalSoftmax huffman(8)", 0.105, 1.011)
  assert candidates._choose([full, learned, twin], full, True)[0] is twin
  # Unknown quality is not preferred to a measured one...
  mystery = _row("AdaptiveSoftmax two_level, chosen cutoffs", 0.09, None)
  assert candidates._choose([full, mystery, huff], full, True)[0] is huff
  # ... and is the pick, the fastest, when nothing in the margin is measured.
  best, reason = candidates._choose([full, mystery], full, False)
  assert best is mystery and "quality unknown" in reason


def test_demo_model_pick_meets_the_acceptance():
  """The demo's output layer (V=6,205, D=128, T=2,048, LazyAdam) behind its LSTM body's
  step: the pick is within 1% of the best measured perplexity and 20% of the fastest."""
  counts = 1.0 / np.arange(1, 6206)
  report = tf_hsm.plan(6205, 128, 2048, counts=counts, optimizer="lazy_adam",
                       machine=MACHINE)
  # The body's step as plan(model=...) prices the demo's Embedding -> LSTM(128).
  body_seconds = 0.065
  for row in report.rows:
    row["whole_step_seconds"] = row["step_seconds"] + body_seconds
  exact = [r for r in report.rows if r["exact"]]
  best, _ = candidates._choose(exact, report.rows[0], True)
  fastest = min(r["whole_step_seconds"] for r in exact)
  assert best["whole_step_seconds"] <= 1.2 * fastest
  top = min(r["quality"] for r in report.rows if r["quality"] is not None)
  assert best["quality"] <= top * 1.01
  # No row known to cost > 3% over a cheaper one within 20% of its step.
  for other in exact:
    if other["quality"] is not None and other["quality"] < best["quality"]:
      assert other["whole_step_seconds"] > 1.2 * fastest


def test_every_row_carries_its_quality_or_unknown():
  counts = 1.0 / np.arange(1, 20_001)
  report = tf_hsm.plan(20_000, 128, 2048, counts=counts, machine=MACHINE)
  kinds = {r["label"]: r["quality_kind"] for r in report.rows}
  assert kinds["full softmax"] == "full" and kinds["HSM huffman(2)"] == "huffman2"
  assert kinds["HSM two_level"] == "two_level" and kinds["HSM learned"] == "learned"
  assert kinds["adaptive demo"] == "adaptive_demo"
  # The planner's own adaptive layouts (div 4): measured at the cutoffs it chose.
  assert kinds["adaptive two_level"] == "adaptive_two_level"
  assert kinds["adaptive flat"] == "adaptive_flat"
  assert kinds["adaptive fixed"] == "adaptive_fixed"
  assert report.rows[0]["quality"] == 1.0
  assert all(r["quality"] is not None for r in report.rows)
  # A layout or tree the project has not measured: unknown, and said so.
  other = tf_hsm.plan(20_000, 128, 2048, counts=counts, machine=MACHINE,
                      trees=("huffman5",), adaptive=("flat",), cutoffs=[500, 4000],
                      div_value=2.0)
  unknown = [r["label"] for r in other.rows if r["quality"] is None]
  assert unknown == ["HSM huffman(5)", "adaptive flat"]
  assert any("quality not measured" in note for note in other.notes)
  assert "?" in other.to_markdown()
  assert quality.kind_of("AdaptiveSoftmax two_level, chosen cutoffs [9, 99], div 2",
                         [9, 99], 2.0, 20_000) is None
  for figure in quality.EVIDENCE:
    assert figure.source and figure.perplexity > 0


def test_planning_imports_no_tensorflow_without_a_model():
  code = ("import sys\n"
          "for name in ('tensorflow', 'keras', 'tf_keras'):\n"
          "  sys.modules[name] = None\n"
          "import numpy as np, tf_hsm.planning as p\n"
          "r = p.plan(5000, 64, 512, counts=1.0 / np.arange(1, 5001), machine="
          f"{MACHINE!r})\n"
          "assert r.rows and r.body is None\n"
          "assert not any(m.startswith(('tensorflow', 'keras', 'tf_hsm.keras')) "
          "for m in sys.modules if sys.modules[m] is not None)\n"
          "print('ok')\n")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       cwd=REPO, check=False)
  assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]


def _readme_model(keras, length=None, body=("lstm",)):
  """The README's Keras model (sequences of any length unless `length`), V=1000."""
  from tf_hsm.keras.layers import HierarchicalSoftmax  # pylint: disable=import-outside-toplevel
  tokens = keras.Input([length], dtype="int32")
  targets = keras.Input([length], dtype="int32")
  x = keras.layers.Embedding(1000, 16, mask_zero=True)(tokens)
  if "lstm" in body:
    x = keras.layers.LSTM(24, return_sequences=True)(x)
  if "dense" in body:
    x = keras.layers.Dense(24)(x)
  out = HierarchicalSoftmax(tf_hsm.Tree.two_level(1000))(x, targets)
  return keras.Model([tokens, targets], out)


def test_variable_length_model_asks_for_the_sequence_length():
  """The README's model (`keras.Input([None])`, an LSTM): its step depends on how the
  tokens split into sequences, so plan asks for the length; given it, the figures are
  those of the same model built at that length."""
  keras = pytest.importorskip("keras")
  model = _readme_model(keras)
  with pytest.raises(ValueError, match=r"any length.*LSTM.*sequence_length=S"):
    tf_hsm.plan(model=model, tokens_per_step=640, machine=MACHINE, adaptive=())
  report = tf_hsm.plan(model=model, tokens_per_step=640, sequence_length=20,
                       machine=MACHINE, trees=("two_level",), adaptive=())
  fixed = tf_hsm.plan(model=_readme_model(keras, 20), tokens_per_step=640,
                      machine=MACHINE, trees=("two_level",), adaptive=())
  for key in ("params", "flops", "step_seconds", "peak_bytes", "batch"):
    assert report.body[key] == pytest.approx(fixed.body[key]), key
  assert report.body["hidden_shape"] == [None, 20, 24] and report.body["batch"] == 32
  with pytest.raises(ValueError, match="not a multiple"):
    tf_hsm.plan(model=model, tokens_per_step=650, sequence_length=20, machine=MACHINE)
  for bad in (0, -5, 2.5, True):
    with pytest.raises(ValueError, match="sequence_length must be a positive int"):
      tf_hsm.plan(model=model, tokens_per_step=640, sequence_length=bad, machine=MACHINE)
  with pytest.raises(ValueError, match="shapes are all known"):
    tf_hsm.plan(model=_readme_model(keras, 20), tokens_per_step=640, sequence_length=20,
                machine=MACHINE)
  with pytest.raises(ValueError, match="sequence_length is for plan"):
    tf_hsm.plan(1000, 16, 640, sequence_length=20, machine=MACHINE)


def test_variable_length_model_of_per_position_layers_plans_from_the_tokens():
  """Embeddings and dense layers cost the same however the step's tokens split into
  sequences: plan takes them as one sequence of tokens_per_step, says so, and gives
  the figures of any fixed split."""
  keras = pytest.importorskip("keras")
  report = tf_hsm.plan(model=_readme_model(keras, body=("dense",)), tokens_per_step=640,
                       machine=MACHINE, trees=("two_level",), adaptive=())
  assert any("any length" in note for note in report.notes)
  for length in (20, 640):
    fixed = tf_hsm.plan(model=_readme_model(keras, length, body=("dense",)),
                        tokens_per_step=640, machine=MACHINE, trees=("two_level",),
                        adaptive=())
    for key in ("params", "flops", "step_seconds", "peak_bytes"):
      assert report.body[key] == pytest.approx(fixed.body[key]), (key, length)


def test_pooled_history_of_any_length_needs_its_length():
  """A recommender's tower: a history of any length pooled into one vector, one target
  a row. The history's length is not in tokens_per_step (the rows), so it is asked for,
  and every unknown dimension takes it."""
  keras = pytest.importorskip("keras")
  from tf_hsm.keras.layers import HierarchicalSoftmax  # pylint: disable=import-outside-toplevel
  history = keras.Input([None], dtype="int32")
  target = keras.Input([], dtype="int32")
  x = keras.layers.Embedding(1000, 16)(history)
  x = keras.layers.GlobalAveragePooling1D()(x)
  x = keras.layers.Dense(32)(x)
  model = keras.Model([history, target],
                      HierarchicalSoftmax(tf_hsm.Tree.two_level(1000))(x, target))
  with pytest.raises(ValueError, match="not one sequence of the hidden states"):
    body_lib.body_cost(model, 256)
  body = body_lib.body_cost(model, 256, sequence_length=50)
  assert body.batch == 256 and body.hidden_shape == (None, 32)
  embedding = next(layer for layer in body.layers if layer.kind == "Embedding")
  assert embedding.parts[0].touched == 1000 * 16  # 256 x 50 ids touch every row
  assert embedding.bytes_elements == 3.0 * 256 * 50 * 16
