"""tf_hsm.bench.quality_torch: the parts that run without PyTorch (the prepared corpus,
the sampler's draws, the summary at equal tokens), and, where PyTorch is installed, the
tree log-probabilities against a float64 reference written from the definition."""

import json

import numpy as np
import pytest

import tf_hsm
from tf_hsm.bench import quality_torch as qt
from tf_hsm.demo import run as demo


def test_prepare_writes_the_demos_split_and_vocabulary(tmp_path):
  text = tmp_path / "corpus.txt"
  rng = np.random.default_rng(0)
  words = [f"w{i}" for i in range(300)]
  docs = [" ".join(rng.choice(words, 400, p=None)) for _ in range(30)]
  text.write_text("\n\n".join(docs))
  meta = qt.prepare(str(text), 0, 10_000_000, str(tmp_path / "c.npz"))
  train, held, counts, saved = qt.load_corpus(str(tmp_path / "c.npz"))
  tokens_train, tokens_held = demo.split_corpus(demo.file_documents(str(text)), 0)
  vocab, expected = demo.build_vocab(tokens_train, 10_000_000, 2)
  np.testing.assert_array_equal(train, demo.encode(tokens_train, vocab))
  np.testing.assert_array_equal(held, demo.encode(tokens_held, vocab))
  np.testing.assert_array_equal(counts, expected)
  assert saved == meta and meta["vocab_size"] == len(vocab)
  assert set(meta["cutoffs"]) == {"planned", "pytorch", "demo"}


def test_log_uniform_candidates_are_unique_first_draws():
  rng = np.random.default_rng(1)
  ids, tries = qt.log_uniform_candidates(rng, 64, 1_000)
  assert len(set(ids.tolist())) == 64 and tries >= 64
  assert ids.min() >= 0 and ids.max() < 1_000
  # The same seed draws the same candidates; the expected count of a candidate in
  # `tries` draws is 1 - (1 - p)^tries with TF's log-uniform p.
  again, again_tries = qt.log_uniform_candidates(np.random.default_rng(1), 64, 1_000)
  np.testing.assert_array_equal(ids, again) and again_tries == tries
  p = np.log((ids + 2.0) / (ids + 1.0)) / np.log(1_001.0)
  np.testing.assert_allclose(np.exp(qt.log_expected_count(ids, tries, 1_000)),
                             1 - (1 - p) ** tries, rtol=1e-12)
  # Frequent (low) ids are drawn more often than rare ones.
  hits = np.zeros(1_000)
  for _ in range(300):
    hits[qt.log_uniform_candidates(rng, 64, 1_000)[0]] += 1
  assert hits[:10].mean() > 5 * hits[-100:].mean()


def _record(tmp_path, corpus, row, perplexities, every=1_000):
  checkpoints = [{"tokens": 1_024 * (k * every // 1_024 + (k > 0)), "step": k,
                  "perplexity": p} for k, p in enumerate(perplexities)]
  checkpoints.append({"tokens": checkpoints[-1]["tokens"] + 500, "step": None,
                      "perplexity": perplexities[-1] - 1})
  record = {"row": row, "corpus": corpus, "vocab_size": 100, "train_tokens": 9_000,
            "eval_tokens": 500, "eval_every": every, "checkpoints": checkpoints,
            "tree": None}
  (tmp_path / f"{corpus}.{row}.json").write_text(json.dumps(record))


def test_summary_compares_rows_at_the_last_checkpoint_all_reached(tmp_path):
  _record(tmp_path, "a", "full", [100, 50, 40, 30])
  _record(tmp_path, "a", "sampled", [100, 52, 44])
  _record(tmp_path, "a", "huffman8", [100, 55, 48, 36])
  found, table = qt.summary(str(tmp_path))
  assert set(found["a"]) == {"full", "sampled", "huffman8"}
  lines = {}
  for line in table.splitlines():  # the first table's rows: at equal tokens
    lines.setdefault(line.split(" | ")[0], line)
  assert "| 44.00 (" in lines["| sampled"] and "+10.0%" in lines["| sampled"]
  assert "| 48.00 (" in lines["| huffman8"] and "+20.0%" in lines["| huffman8"]
  assert "| full | 50.00 | 40.00 | 30.00 |" in table  # by training tokens (0 left out)


def _reference(tree, weight, bias, hidden, targets):
  """log P(target) from the definition: each path step's log-softmax, float64."""
  out = np.zeros(len(targets))
  begin = tree.child_begin
  for t, c in enumerate(targets):
    for k in range(tree.path_begin[c], tree.path_begin[c + 1]):
      node, slot = tree.path_nodes[k], tree.path_slots[k]
      logits = weight[begin[node]:begin[node + 1]] @ hidden[t] + bias[begin[node]:
                                                                      begin[node + 1]]
      top = logits.max()
      out[t] += logits[slot - begin[node]] - top - np.log(np.exp(logits - top).sum())
  return out


def test_tree_log_prob_matches_the_definition():
  torch = pytest.importorskip("torch")
  rng = np.random.default_rng(2)
  for classes in (2, 9, 300):
    counts = rng.zipf(1.3, classes).astype(np.float64)
    for tree in (tf_hsm.Tree.flat(classes), tf_hsm.Tree.huffman(counts, 8),
                 tf_hsm.Tree.huffman(counts, 2), tf_hsm.Tree.two_level(classes, counts),
                 tf_hsm.Tree.from_vectors(rng.normal(size=(classes, 4)), counts, 4,
                                          head=1)):
      weight = rng.normal(size=(tree.num_slots, 5))
      bias, hidden = rng.normal(size=tree.num_slots), rng.normal(size=(40, 5))
      targets = rng.integers(0, classes, 40)
      arrays = qt.TreeArrays(torch, tree, "cpu")
      w = torch.tensor(weight, requires_grad=True)
      got = qt.tree_log_prob(torch, arrays, w, torch.tensor(bias), torch.tensor(hidden),
                             torch.tensor(targets))
      np.testing.assert_allclose(got.detach().numpy(),
                                 _reference(tree, weight, bias, hidden, targets),
                                 rtol=1e-10, atol=1e-10)
      got.sum().backward()
      i, j, eps = rng.integers(tree.num_slots), rng.integers(5), 1e-6
      up, down = weight.copy(), weight.copy()
      up[i, j] += eps
      down[i, j] -= eps
      numeric = (_reference(tree, up, bias, hidden, targets).sum() -
                 _reference(tree, down, bias, hidden, targets).sum()) / (2 * eps)
      assert abs(numeric - float(w.grad[i, j])) < 1e-5


def test_context_tree_is_the_demos_and_is_kept_beside_the_corpus(tmp_path):
  rng = np.random.default_rng(3)
  ids = rng.zipf(1.2, 6_000) % 400
  counts = np.bincount(ids, minlength=400).astype(np.float64)
  corpus = tmp_path / "c.npz"
  np.savez(corpus, train=ids.astype(np.uint32), held_out=ids[:50].astype(np.uint32),
           counts=counts, meta=np.array(json.dumps({"corpus": "c"})))
  tree = qt.context_tree(str(corpus), 8, 16)
  assert tree == tf_hsm.Tree.from_context(ids, 400, counts, branching=8, head=16)
  path = tmp_path / "c.context8_head16.tree.npz"
  assert qt.context_tree_path(str(corpus), 8, 16) == str(path) and path.exists()
  tf_hsm.Tree.flat(3).save(str(path))  # read, not built again, when it is there
  assert qt.context_tree(str(corpus), 8, 16) == tf_hsm.Tree.flat(3)


@pytest.mark.parametrize("flag", ["--hidden=0", "--hidden=-3", "--output-lr-scale=0",
                                  "--output-lr-scale=nan", "--output-lr-scale=inf"])
def test_run_rejects_a_bad_width_or_scale(flag, capsys):
  with pytest.raises(SystemExit):
    qt.main(["run", "c.npz", flag])
  assert "must be a positive" in capsys.readouterr().err


def test_lazy_adam_scales_only_the_output_layers_steps():
  torch = pytest.importorskip("torch")
  model = torch.nn.Module()
  model.embedding = torch.nn.Embedding(6, 3)
  model.weight = torch.nn.Parameter(torch.zeros(5, 3))
  model.bias = torch.nn.Parameter(torch.zeros(5))
  before = model.embedding.weight.detach().clone()
  optimizer = qt.LazyAdam(torch, model, 0.01, output_scale=4.0)
  # Adam's first step moves each element with a gradient by lr g / (|g| + eps).
  loss = (model.embedding(torch.tensor([1])).sum() * 2 +
          (model.weight[2] * torch.tensor([1.0, -1.0, 3.0])).sum() - model.bias[4])
  loss.backward()
  optimizer.apply()
  step = lambda scale, g: -scale * 0.01 * g / (abs(g) + 1e-7)
  np.testing.assert_allclose(model.weight.detach()[2].numpy(),
                             [step(4, 1.0), step(4, -1.0), step(4, 3.0)], rtol=1e-5)
  np.testing.assert_allclose(model.bias.detach().numpy(), [0, 0, 0, 0, step(4, -1.0)],
                             rtol=1e-5)
  moved = (model.embedding.weight.detach() - before).numpy()
  np.testing.assert_allclose(moved[1], [step(1, 2.0)] * 3, rtol=1e-4)
  assert not moved[[0, 2, 3, 4, 5]].any()  # rows without a gradient stay
  assert not model.weight.detach()[[0, 1, 3, 4]].any()
