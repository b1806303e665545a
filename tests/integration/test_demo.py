"""python -m tf_hsm.demo: the corpus, the vocabulary, the unigram start, and a tiny run."""

import json
import math
import subprocess
import sys

import numpy as np
import pytest

import tf_hsm
from tf_hsm.demo import run as demo
from tf_hsm.keras import mixture as mixture_module

import support

_REPO = support.REPO


def test_stdlib_corpus_is_real_text_and_deterministic():
  documents = demo.stdlib_documents()
  assert documents == demo.stdlib_documents()
  tokens = [t for d in documents for t in demo.tokenize(d)]
  assert len(tokens) > 200_000
  counts = {}
  for t in tokens:
    counts[t] = counts.get(t, 0) + 1
  top = sorted(counts, key=counts.get, reverse=True)[:20]
  assert {"the", "a", "of", "to", "is"} <= set(top)


def test_tokenize():
  assert demo.tokenize("Return the max_depth of a Tree, don't fail!") == [
      "return", "the", "max_depth", "of", "a", "tree", ",", "don't", "fail", "!"]


def test_split_and_vocabulary():
  documents = [f"word{i % 7} common common text{i}" for i in range(300)]
  train, held_out = demo.split_corpus(documents, max_tokens=1000, seed=1)
  assert (train, held_out) == demo.split_corpus(documents, max_tokens=1000, seed=1)
  assert len(train) + len(held_out) == 1000
  assert 0.08 < len(held_out) / 1000 < 0.12
  words, counts = demo.build_vocab(train, size=5, min_count=2)
  assert words[0] == demo.UNK and words[1] == "common" and len(words) == 5
  assert counts.sum() == len(train) and counts[0] > 0  # <unk> occurs in training
  words, _ = demo.build_vocab(train, size=10_000, min_count=2)
  assert not any(w.startswith("text") for w in words)  # each seen once
  ids = demo.encode(["common", "never-seen"], words)
  assert ids.tolist() == [words.index("common"), 0]
  x, y = demo.sequences(np.arange(11, dtype=np.int32), 3)
  assert x.tolist() == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
  assert y.tolist() == [[1, 2, 3], [4, 5, 6], [7, 8, 9]]


@pytest.mark.parametrize("kind", ["two_level", "huffman", "balanced"])
def test_tree_biases_start_at_the_unigram_distribution(kind):
  counts = np.array([50, 0, 7, 300, 1, 1, 12, 40, 3, 9], np.float64)
  tree = demo.make_tree(kind, counts)
  biases = demo.tree_unigram_biases(tree, counts)
  weights = np.zeros((tree.num_slots, 3), np.float32)
  hidden = np.ones((len(counts), 3), np.float32)
  log_probs = tf_hsm.log_prob(hidden, weights, biases.astype(np.float32), tree,
                              np.arange(len(counts)))
  np.testing.assert_allclose(log_probs.numpy(), demo.unigram_log_probs(counts), rtol=1e-5)


def test_branching_and_adaptive_layouts():
  """--branching K: Tree.huffman(counts, branching=K) and Tree.balanced(V, K); the
  adaptive softmax's named cutoffs (the planner's layouts)."""
  counts = np.array([90] + list(range(400, 1, -1)), np.float64)  # <unk> ranks 311th
  np.testing.assert_array_equal(demo.make_tree("huffman", counts, branching=8).slot_child,
                                tf_hsm.Tree.huffman(counts, branching=8).slot_child)
  assert demo.make_tree("huffman", counts) == tf_hsm.Tree.huffman(counts)
  assert demo.make_tree("balanced", counts, branching=7) == tf_hsm.Tree.balanced(
      len(counts), 7)
  assert demo.layout_cutoffs("demo", counts, 16, 64) == demo.adaptive_cutoffs(len(counts))
  assert demo.layout_cutoffs([3, 9], counts, 16, 64) == [3, 9]
  assert demo.layout_cutoffs("pytorch", counts, 16, 64, 4.0) == \
      tf_hsm.planning.pytorch_cutoffs(len(counts), 16, 4.0)
  machine = {"matmul_flops": 5e10, "read_bytes": 1e10, "call_seconds": 2e-4}
  ranked = np.sort(counts)[::-1]
  for tail in ("flat", "two_level"):
    assert demo.layout_cutoffs("planned", counts, 64, 256, 4.0, tail, machine) == list(
        tf_hsm.planning.choose_cutoffs(ranked, 64, 256, 4.0, tail, machine,
                                       optimizer="lazy_adam"))
  with pytest.raises(SystemExit):
    demo.parse_args(["--tree", "two_level", "--branching", "8"])
  with pytest.raises(SystemExit):
    demo.parse_args(["--models", "adaptive", "--cutoffs", "ten"])
  with pytest.raises(SystemExit):  # adaptive settings for a run that trains no adaptive
    demo.parse_args(["--models", "hsm", "--tail", "two_level"])
  for flags in (["--max-ppl-increase", "10"],  # a bound for a tree the planner does not pick
                ["--tree", "planned", "--max-ppl-increase", "-1"],
                ["--tree", "context", "--mixture", "3", "--tail-dim", "8"],  # no shared head
                ["--tree", "context", "--mixture", "3", "--head", "4", "--shared-head",
                 "--tail-dim", "0"],
                ["--tree", "context", "--mixture", "3", "--head-rank", "8"],
                ["--tree", "context", "--mixture", "3", "--head", "4", "--shared-head",
                 "--head-rank", "0"]):
    with pytest.raises(SystemExit):
      demo.parse_args(flags)
  assert demo.parse_args(["--tree", "planned", "--max-ppl-increase", "10"]
                         ).max_ppl_increase == 0.1
  args = demo.parse_args(["--models", "adaptive", "--cutoffs", "5,50", "--tail",
                          "two_level", "--div-value", "4"])
  assert args.cutoffs == [5, 50] and args.tail == "two_level" and args.div_value == 4.0


def test_cutoffs_that_leave_no_tail_name_the_flag(tmp_path):
  corpus = tmp_path / "corpus.txt"
  corpus.write_text("\n\n".join(" ".join(f"w{(i * 7 + j) % 40}" for j in range(30))
                                for i in range(60)))
  # PyTorch-style cutoffs at hidden 4 and div value 8: every tail would be 0 wide.
  with pytest.raises(SystemExit, match="--cutoffs pytorch gives no tail cluster"):
    demo.main(["--corpus", str(corpus), "--models", "adaptive", "--cutoffs", "pytorch",
               "--hidden", "4", "--div-value", "8", "--epochs", "1",
               "--out", str(tmp_path / "out")])


def test_run_with_a_k_ary_tree_and_a_two_level_adaptive_tail(tmp_path, capsys):
  corpus = support.zipf_corpus(tmp_path / "corpus.txt")
  out = tmp_path / "results"
  results = demo.main(["--corpus", str(corpus), "--max-tokens", "900", "--epochs", "1",
                       "--hidden", "16", "--seq-len", "5", "--batch", "4", "--quiet",
                       "--tree", "huffman", "--branching", "4", "--models", "hsm,adaptive",
                       "--cutoffs", "4,12", "--tail", "two_level", "--div-value", "4",
                       "--out", str(out)])
  printed = capsys.readouterr().out
  assert "HSM tree: huffman(4)" in printed and "two_level tails, cutoffs [4, 12]" in printed
  assert results["tree"]["branching"] == 4 and results["tree"]["max_depth"] < 5
  assert results["adaptive"] == {"cutoffs": [4, 12], "div_value": 4.0, "tail": "two_level"}
  assert all(np.isfinite(m["held_out_perplexity"]).all() for m in results["models"])


def test_tiny_run_writes_table_plot_and_json(tmp_path, capsys):
  corpus = tmp_path / "corpus.txt"
  sentences = ["the cat sat on the mat .", "a dog ran to the cat .",
               "the mat is red and the dog is brown ."]
  corpus.write_text("\n\n".join(sentences[i % 3] for i in range(60)))
  out = tmp_path / "results"
  results = demo.main(["--corpus", str(corpus), "--max-tokens", "400", "--epochs", "1",
                       "--vocab", "12", "--hidden", "8", "--seq-len", "5", "--batch", "4",
                       "--tree", "huffman", "--models", "hsm,full,sampled,adaptive",
                       "--out", str(out)])
  printed = capsys.readouterr().out
  for name in ("hsm-huffman", "full", "sampled-12", "adaptive"):
    assert f"== {name}:" in printed
  assert "val_loss:" in printed  # the Keras progress bar
  for name in ("hsm-huffman", "full", "sampled-12", "adaptive"):  # printed as it ends
    assert f"{name} after epoch 1: held-out perplexity " in printed
  for name in ("results.json", "results.md", "perplexity.png"):
    assert (out / name).stat().st_size > 0
  with open(out / "results.json") as f:
    saved = json.load(f)
  assert saved["vocab_size"] == results["vocab_size"] <= 12
  assert [m["name"] for m in saved["models"]] == ["hsm-huffman", "full", "sampled-12",
                                                  "adaptive"]
  for model in saved["models"]:
    assert len(model["held_out_perplexity"]) == 2 and len(model["train_seconds"]) == 1
    assert all(np.isfinite(model["held_out_perplexity"]))
    if model["name"] == "adaptive":  # tails without biases start uniform within a cluster
      assert model["held_out_perplexity"][0] < results["vocab_size"]
      continue
    # The others start from the same unigram model.
    assert model["held_out_perplexity"][0] == pytest.approx(
        saved["models"][0]["held_out_perplexity"][0], rel=0.05)
  assert len((out / "results.md").read_text().strip().split("\n")) == 6  # head, rule, 4 rows


@pytest.mark.parametrize("flags", [[], ["--head", "4", "--rebuild-after-batches", "3",
                                          "--rebuild-from", "rows", "--width", "3"]])
def test_learned_tree_is_rebuilt_once(tmp_path, monkeypatch, flags):
  corpus = tmp_path / "corpus.txt"
  words = [f"w{i}" for i in range(30)]
  corpus.write_text("\n\n".join(" ".join(words[(i * j) % 30] for j in range(12))
                                  for i in range(40)))
  rebuilt = []
  original = demo.learned_tree_callback

  def spy(model, counts, *args):
    callback = original(model, counts, *args)
    rebuild = callback.on_epoch_end

    def on_epoch_end(epoch, logs=None):
      rebuild(epoch, logs)
      rebuilt.append((epoch, model.get_layer("hsm").tree))
    callback.on_epoch_end = on_epoch_end
    return callback

  monkeypatch.setattr(demo, "learned_tree_callback", spy)
  results = demo.main(["--corpus", str(corpus), "--max-tokens", "480", "--epochs", "2",
                       "--vocab", "20", "--hidden", "8", "--seq-len", "5", "--batch", "4",
                       "--tree", "learned", "--models", "hsm", "--quiet",
                       "--out", str(tmp_path / "out")] + flags)
  counts = demo.build_vocab(demo.split_corpus(demo.file_documents(str(corpus)), 480)[0],
                            20, 2)[1]
  start = demo.make_tree("two_level", counts)
  assert [epoch for epoch, _ in rebuilt] == [0, 1]
  # Once: after epoch 1, or (flags) after batch 3 of it, which ends with the new tree.
  assert rebuilt[0][1] != start and rebuilt[1][1] == rebuilt[0][1]
  head = int(flags[1]) if flags else demo.learned_head(len(counts))
  tree = rebuilt[0][1]
  assert np.all(tree.class_depth[np.argsort(-counts, kind="stable")[:head]] == 1)
  if flags:
    assert len(tree.children(0)) <= 4 + 3
  model = results["models"][0]
  assert model["name"] == "hsm-learned"
  assert all(np.isfinite(model["held_out_perplexity"]))
  assert len(model["rebuild_seconds"]) == 2


def test_head_two_level_tree():
  counts = np.array([5, 90, 0, 40, 7, 7, 300, 1, 2, 60, 3, 11], np.float64)
  tree = demo.make_tree("two_level", counts, head=3)
  assert sorted(c for c in tree.children(0) if c < len(counts)) == [1, 6, 9]
  assert tree.max_depth == 2
  np.testing.assert_array_equal(tree.class_depth[[1, 6, 9]], 1)
  assert tree.class_depth[3] == 2  # the fourth most frequent, in a cluster
  assert demo.make_tree("two_level", counts) == demo.make_tree("two_level", counts, 0)


def test_command_line_help():
  result = subprocess.run([sys.executable, "-m", "tf_hsm.demo", "--help"], cwd=_REPO,
                          capture_output=True, text=True, timeout=60, check=False)
  assert result.returncode == 0, result.stderr
  for flag in ("--tree", "--vocab", "--epochs", "--hidden", "--seq-len", "--batch",
               "--max-tokens", "--corpus", "--out"):
    assert flag in result.stdout


def test_planned_tree_is_the_planners_layer(capsys):
  """--tree planned trains plan's recommendation among the exact and hierarchical rows
  (trees rebuilt from vectors included), with the RebuildTree it needs."""
  counts = np.sort(np.random.default_rng(0).zipf(1.3, 3_000).astype(np.float64))[::-1]
  machine = {"matmul_flops": 5e10, "read_bytes": 1e10, "call_seconds": 2e-4,
             "tree_step": (3e-11, 1e-10, 7e-11, 2e-7, 1e-8, 5e-4)}
  trees, rebuild, head, head_rank = demo.planned_tree(counts, 128, 2048, machine=machine)
  out = capsys.readouterr().out
  report = tf_hsm.plan(3_000, 128, 2048, counts=counts, optimizer="lazy_adam",
                       machine=machine, adaptive=())
  assert f"--tree planned: {report.recommended}," in out and "| full softmax |" in out
  assert trees == [report.layer.tree] and rebuild == report.layer.rebuild and head is None
  assert head_rank is None
  # With the training text (the demo passes its training ids), the context tree is a row.
  ids = (np.random.default_rng(1).zipf(1.2, 20_000) - 1) % 3_000
  demo.planned_tree(counts, 128, 2048, machine=machine, token_ids=ids)
  out = capsys.readouterr().out
  assert "| HSM context32/256 |" in out and "| HSM mixture32/256 |" in out
  # A bound on the perplexity reaches the planner: within +0% only full softmax is.
  trees, rebuild, _, _ = demo.planned_tree(counts, 128, 2048, machine=machine,
                                           max_perplexity_increase=0.0)
  assert trees == [tf_hsm.Tree.flat(3_000)] and rebuild is None
  assert "--tree planned: full softmax," in capsys.readouterr().out
  # A pick rebuilt from vectors: its callback rebuilds the model's HSM from the inputs'
  # embeddings.
  picked = tf_hsm.plan(3_000, 128, 2048, counts=counts, optimizer="lazy_adam",
                       machine=dict(machine, matmul_flops=1e8),
                       trees=("vectors32_head256",), adaptive=()).layer
  rebuild = picked.rebuild
  model = demo.hsm_model(picked.tree, counts, 16, 8, 1e-3)
  callback = demo.planned_rebuild_callback(model, rebuild)
  assert callback.layer is model.get_layer("hsm")
  assert callback.vectors is model.get_layer("embedding")


def test_quality_runs_commands_and_summary(tmp_path, capsys):
  """`python -m tf_hsm.bench.quality_runs`: one demo command per planner row (the
  balanced tree at ceil(V^(1/3))), and the summary against full softmax's best."""
  from tf_hsm.bench import quality_runs
  corpus = tmp_path / "corpus.txt"
  words = [f"w{i}" for i in range(40)]
  corpus.write_text("\n\n".join(" ".join(words[(i * 7 + j) % 40] for j in range(30))
                                for i in range(60)))
  out = tmp_path / "runs"
  assert quality_runs.main([str(corpus), "--dry-run", "--out", str(out), "--cpu", "-1"]) == 0
  commands = [line[2:].split() for line in capsys.readouterr().out.splitlines()
              if line.startswith("$ ")]
  vocab = len(quality_runs.training_counts(str(corpus)))
  # 40 words: the rows with a head of 256 would hold every word, and are left out.
  assert len(commands) == len(quality_runs.DEFAULT_ROWS) == len(quality_runs.default_rows(vocab))
  by_row = {c[c.index("--out") + 1].rsplit("/", 1)[-1]: c for c in commands}
  assert by_row["balanced"][by_row["balanced"].index("--branching") + 1] == str(
      math.ceil(vocab ** (1 / 3) - 1e-9))
  assert "--branching" in by_row["huffman8"] and "8" in by_row["huffman8"]
  tail = by_row["adaptive_two_level"]
  assert tail[tail.index("--tail") + 1] == "two_level"
  assert all(c[c.index("--corpus") + 1] == str(corpus) for c in commands)
  for row, ppl in (("full", [90.0, 80.0, 81.0]), ("huffman2", [99.0, 88.0, 86.0])):
    (out / row).mkdir(parents=True)
    (out / row / "results.json").write_text(json.dumps({
        "models": [{"name": row, "held_out_perplexity": [200.0] + ppl,
                    "train_cpu_seconds": [3.0, 2.0, 2.2]}],
        "vocab_size": vocab, "tree": None, "adaptive": None, "settings": {}}))
  rows, table = quality_runs.summary(str(out))
  assert [r["row"] for r in rows] == ["full", "huffman2"]
  assert rows[1]["ratio"] == pytest.approx(86.0 / 80.0) and rows[1]["best"] == 86.0
  assert rows[1]["cpu_seconds_per_epoch"] == pytest.approx(2.1) and "+7.5%" in table
  # A timing run: epochs of --time-steps batches, the CPU time scaled to the split's.
  assert quality_runs.main([str(corpus), "--dry-run", "--out", str(out), "--cpu", "-1",
                            "--rows", "vectors32_head256", "--time-steps", "5"]) == 0
  timed = capsys.readouterr().out.split()
  assert timed[timed.index("--steps-per-epoch") + 1] == "5"
  assert timed[timed.index("--head") + 1] == "256" and timed[timed.index("--width") + 1] == "32"
  result = json.loads((out / "full" / "results.json").read_text())
  result.update(settings={"steps_per_epoch": 5}, train_batches_per_epoch=50)
  (out / "full" / "results.json").write_text(json.dumps(result))
  rows, table = quality_runs.summary(str(out))
  assert rows[0]["cpu_seconds_per_epoch"] == pytest.approx(22.0) and "| 22.0* |" in table


def test_full_softmax_is_the_exact_softmax_of_a_one_node_tree():
  """The full-softmax baseline is HierarchicalSoftmax over Tree.flat: its log-probabilities
  are the log-softmax of the logits (no [tokens, vocab] logits held)."""
  counts = np.arange(1, 301)[::-1].astype(np.float64)
  model = demo.full_softmax_model(counts, 8, 5, 0.01)
  layer = model.get_layer("hsm")
  assert layer.tree == tf_hsm.Tree.flat(300)
  tokens = np.arange(10).reshape(2, 5)
  targets = (tokens * 7) % 300
  got = model.predict([tokens, targets], verbose=0)
  hidden = model.get_layer("lstm")(model.get_layer("embedding")(tokens)).numpy()
  w, b = (np.asarray(v, np.float64) for v in layer.weights[:2])
  logits = hidden.astype(np.float64) @ w.T + b
  top = logits.max(-1, keepdims=True)
  log_softmax = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
  np.testing.assert_allclose(got, np.take_along_axis(log_softmax, targets[..., None], -1)[..., 0],
                             rtol=1e-4, atol=1e-4)


def _recorded_trees(monkeypatch):
  """The list that the trees (or lists of trees) `demo.hsm_model` is given go to."""
  trained = []
  real_model = demo.hsm_model
  monkeypatch.setattr(demo, "hsm_model", lambda tree, *a, **k: trained.append(tree) or
                      real_model(tree, *a, **k))
  return trained


def _context_run(tmp_path, seed, *flags):
  """demo.main with --tree context and `flags` on a small corpus: (results, its training
  counts, its training ids, the vocabulary's size)."""
  corpus = support.zipf_corpus(tmp_path / "corpus.txt", seed=seed)
  results = demo.main(["--corpus", str(corpus), "--max-tokens", "900", "--epochs", "1",
                       "--hidden", "16", "--seq-len", "5", "--batch", "4", "--quiet",
                       "--tree", "context", "--branching", "4", *flags,
                       "--models", "hsm", "--out", str(tmp_path / "out")])
  train = demo.split_corpus(demo.file_documents(str(corpus)), 900)[0]
  names, counts = demo.build_vocab(train, 10000, 2)
  return results, counts, demo.encode(train, names), len(names)


def test_run_with_a_shared_head(tmp_path, capsys, monkeypatch):
  """--mixture 3 --head H --shared-head --tail-dim D --head-rank R trains
  HierarchicalSoftmaxMixture(head=..., tail_dim=D, head_rank=R): the H most frequent
  words one softmax (corrected at rank R per tree), the three context trees over the
  other words, scoring a D-wide projection."""
  trained = _recorded_trees(monkeypatch)
  built = []
  real_mixture = mixture_module.HierarchicalSoftmaxMixture
  monkeypatch.setattr(mixture_module, "HierarchicalSoftmaxMixture",
                      lambda *a, **k: built.append(real_mixture(*a, **k)) or built[-1])
  results, counts, ids, classes = _context_run(tmp_path, 3, "--head", "3", "--mixture", "3",
                                               "--shared-head", "--tail-dim", "8",
                                               "--head-rank", "2")
  (mixture,) = built
  assert mixture.tail_dim == 8 and mixture.tail_projection.shape == (16, 8)
  assert mixture.head_rank == 2 and mixture.head_correction_out.shape == (3, 2, 4)
  out = capsys.readouterr().out
  assert "the 3 most frequent words a head shared by the trees" in out
  assert "scoring the hidden state's projection to 8 dimensions" in out
  assert "each tree's head corrected at rank 2" in out
  (trees,) = trained
  head = np.argsort(-counts, kind="stable")[:3]
  tail = np.setdiff1d(np.arange(classes), head)
  for tree, side, seed in zip(trees, ("left", "right", "left"), (0, 0, 1)):
    assert tree == tf_hsm.Tree.from_context(ids, classes, counts, branching=4, side=side,
                                            seed=seed, classes=tail)
  assert results["models"][0]["name"] == \
      "hsm-context-mixture-shared-head-tail-dim-8-head-rank-2"
  assert results["tree"]["shared_head"] == 3
  assert np.all(np.isfinite(results["models"][0]["held_out_perplexity"]))


def test_run_with_a_tree_from_contexts(tmp_path, capsys, monkeypatch):
  """--tree context trains on Tree.from_context of the training ids, from the start."""
  trained = _recorded_trees(monkeypatch)
  results, counts, ids, classes = _context_run(tmp_path, 1, "--head", "3")
  expected = tf_hsm.Tree.from_context(ids, classes, counts, branching=4, head=3)
  assert "HSM tree: context" in capsys.readouterr().out
  ((tree,),) = trained
  np.testing.assert_array_equal(tree.slot_child, expected.slot_child)
  np.testing.assert_array_equal(tree.child_begin, expected.child_begin)
  assert len(tree.children(0)) >= 3  # the head's words and the root's slots
  assert results["models"][0]["name"] == "hsm-context"
  assert np.all(np.isfinite(results["models"][0]["held_out_perplexity"]))


@pytest.mark.parametrize("ranked", [False, True])
def test_run_with_a_planned_mixture(tmp_path, capsys, monkeypatch, ranked):
  """--tree planned trains a recommended mixture (the planner's trees: a list of two) as
  HierarchicalSoftmaxMixture, below its shared head with the trees' corrections where
  the plan has them. (The planner's mixture rows need more classes than this corpus
  has: `tests/unit/test_planner_mixture.py` has their recommendation.)"""
  trained = _recorded_trees(monkeypatch)
  planned, built = [], []
  real_mixture = mixture_module.HierarchicalSoftmaxMixture
  monkeypatch.setattr(mixture_module, "HierarchicalSoftmaxMixture",
                      lambda *a, **k: built.append(real_mixture(*a, **k)) or built[-1])

  def plan_a_mixture(counts, hidden, tokens, token_ids=None, **kwargs):
    del hidden, tokens, kwargs
    head = np.argsort(-np.asarray(counts), kind="stable")[:3] if ranked else None
    tail = None if head is None else np.setdiff1d(np.arange(len(counts)), head)
    planned.append([tf_hsm.Tree.from_context(token_ids, len(counts), counts, branching=4,
                                             side=side, classes=tail)
                    for side in ("left", "right")])
    return planned[-1], None, head, 2 if ranked else None

  monkeypatch.setattr(demo, "planned_tree", plan_a_mixture)
  corpus = support.zipf_corpus(tmp_path / "corpus.txt", seed=2)
  results = demo.main(["--corpus", str(corpus), "--max-tokens", "900", "--epochs", "1",
                       "--hidden", "16", "--seq-len", "5", "--batch", "4", "--quiet",
                       "--tree", "planned", "--models", "hsm", "--out", str(tmp_path / "o")])
  assert "mixed with a tree from right contexts" in capsys.readouterr().out
  assert trained == planned and len(trained[0]) == 2
  assert built[0].head_rank == (2 if ranked else None)
  assert results["models"][0]["name"] == "hsm-planned-mixture" + (
      "-shared-head-head-rank-2" if ranked else "")
  assert np.all(np.isfinite(results["models"][0]["held_out_perplexity"]))


@pytest.mark.parametrize("flags,sides,seeds,said", [
    (["--mixture"], ("left", "right"), (0, 0), "mixed with a tree from right contexts"),
    (["--mixture", "3"], ("left", "right", "left"), (0, 0, 1), "and 1 more from other seeds")])
def test_run_with_a_mixture_of_context_trees(tmp_path, capsys, monkeypatch, flags, sides,
                                             seeds, said):
  """--mixture [N] trains HierarchicalSoftmaxMixture over the left- and right-context
  trees, then left and right again clustered from other seeds."""
  trained = _recorded_trees(monkeypatch)
  results, counts, ids, classes = _context_run(tmp_path, 2, *flags)
  assert said in capsys.readouterr().out
  (trees,) = trained
  assert len(trees) == len(sides)
  for tree, side, seed in zip(trees, sides, seeds):
    expected = tf_hsm.Tree.from_context(ids, classes, counts, branching=4, side=side,
                                        seed=seed)
    np.testing.assert_array_equal(tree.slot_child, expected.slot_child)
  assert not np.array_equal(trees[-1].slot_child, trees[-2].slot_child)
  assert results["models"][0]["name"] == "hsm-context-mixture"
  assert results["tree"]["mixture_num_slots"] == trees[1].num_slots
  assert np.all(np.isfinite(results["models"][0]["held_out_perplexity"]))


def test_init_seed_keeps_the_held_out_split_and_changes_the_initial_values(tmp_path):
  corpus = support.zipf_corpus(tmp_path / "corpus.txt", seed=3)
  common = ["--corpus", str(corpus), "--max-tokens", "900", "--epochs", "1", "--hidden",
            "16", "--seq-len", "5", "--batch", "4", "--quiet", "--tree", "huffman",
            "--models", "hsm"]
  runs = [demo.main(common + flags + ["--out", str(tmp_path / str(i))])
          for i, flags in enumerate(([], ["--init-seed", "0"], ["--init-seed", "1"]))]
  first = [r["models"][0] for r in runs]
  assert len({m["held_out_tokens"] for m in first}) == 1
  assert first[0]["held_out_perplexity"] == first[1]["held_out_perplexity"]
  assert first[0]["held_out_perplexity"][0] != first[2]["held_out_perplexity"][0]
