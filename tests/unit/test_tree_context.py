"""Trees from left contexts (`tf_hsm.tree.context`, `Tree.from_context`): the context
matrix against one built from the definition, the vectors against an exact SVD, the
tree's nodes against the corpus' word groups, and the errors."""

import numpy as np
import pytest

from tf_hsm import Tree
from tf_hsm.demo import run as demo
from tf_hsm.tree import context


def _dense_reference(ids, num_classes, contexts, lags):
  """sqrt(p(context | class)) per lag block, by counting pairs one at a time."""
  width = contexts + 1
  m = np.zeros((num_classes, lags * width))
  for lag in range(1, lags + 1):
    for word, before in zip(ids[lag:], ids[:-lag]):
      m[word, (lag - 1) * width + min(before, contexts)] += 1
  for lag in range(lags):
    block = m[:, lag * width:(lag + 1) * width]
    block /= np.maximum(block.sum(1, keepdims=True), 1)
  return np.sqrt(m)


def _grouped_corpus(rng, groups=8, words_per_group=40, cues=3, length=60_000):
  """Each word of group g follows one of g's cue words: ids 0..groups*cues-1 are the cues
  (the frequent words), then the groups' words in order."""
  first = groups * cues
  g = rng.integers(0, groups, length)
  cue = g * cues + rng.integers(0, cues, length)
  word = first + g * words_per_group + rng.integers(0, words_per_group, length)
  return np.stack([cue, word], 1).ravel(), first, first + groups * words_per_group


def test_context_matrix_matches_the_definition(rng):
  for _ in range(3):
    num_classes = int(rng.integers(5, 60))
    ids = rng.integers(0, num_classes, int(rng.integers(1, 400)))
    contexts, lags = int(rng.integers(1, num_classes + 3)), int(rng.integers(1, 4))
    m = context._context_matrix(  # pylint: disable=protected-access
        ids, num_classes, contexts, lags)
    ref = _dense_reference(ids, num_classes, contexts, lags)
    eye = np.eye(m.shape[1])
    np.testing.assert_allclose(m.dot(eye), ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(m.tdot(np.eye(num_classes)), ref.T, rtol=1e-12, atol=1e-12)


def test_products_by_chunks_match_one_product(rng, monkeypatch):
  """Chunks that cut a row's nonzeros apart add up to the whole product."""
  ids = rng.integers(0, 40, 3000)
  m = context._context_matrix(ids, 40, 10, 2)  # pylint: disable=protected-access
  x, q = rng.standard_normal((22, 5)), rng.standard_normal((40, 5))
  whole = m.dot(x), m.tdot(q)
  monkeypatch.setattr(context, "_CHUNK_VALUES", 7 * 5)
  np.testing.assert_allclose(m.dot(x), whole[0], rtol=1e-12, atol=1e-12)
  np.testing.assert_allclose(m.tdot(q), whole[1], rtol=1e-12, atol=1e-12)
  np.testing.assert_allclose(m.dot(np.eye(22)), _dense_reference(ids, 40, 10, 2),
                             rtol=1e-12, atol=1e-12)


def test_vectors_span_the_leading_principal_directions(rng):
  ids, _, seen = _grouped_corpus(rng)
  num_classes = seen + 200  # classes never seen: their rows are zero before centring
  vectors = context.context_vectors(ids, num_classes, contexts=30, lags=2, dims=8)
  ref = _dense_reference(ids, num_classes, 30, 2)
  ref -= ref.mean(0)
  u, s, _ = np.linalg.svd(ref, full_matrices=False)
  exact = u[:, :8] * s[:8]
  assert vectors.shape == (num_classes, 8) and vectors.dtype == np.float64
  # The corpus has 8 leading directions (the cues against the words, then the groups), a
  # gap after them: equal up to rotations within them, the same Gram matrix.
  # A randomized SVD with one power iteration: within 0.1% of the exact one.
  np.testing.assert_allclose(np.sort(np.linalg.norm(vectors, axis=0))[::-1], s[:8],
                             rtol=1e-3)
  np.testing.assert_allclose(vectors @ vectors.T, exact @ exact.T, atol=1e-3 * s[0] ** 2)


def test_from_context_puts_each_group_under_its_own_nodes(rng):
  ids, first, num_classes = _grouped_corpus(rng)
  tree = Tree.from_context(ids, num_classes, branching=8, contexts=30, dims=8)
  by_vectors = Tree.from_vectors(
      context.context_vectors(ids, num_classes, contexts=30, dims=8),
      np.bincount(ids, minlength=num_classes), 8)
  np.testing.assert_array_equal(tree.slot_child, by_vectors.slot_child)
  # A frequency tree mixes the groups; contexts keep nearly every node to one group.
  assert _pure_nodes(tree, first, num_classes) >= 0.9 * 8


def test_words_absent_from_the_text_do_not_make_a_chain(rng):
  # A vocabulary larger than the text's words: 2,000 ids never occur (count 0, alike
  # vectors); split in balance below the others, not one at a time (a chain 2,000 deep
  # before).
  ids, _, num_classes = _grouped_corpus(rng)
  tree = Tree.from_context(ids, num_classes + 2000, branching=2, contexts=30, dims=8)
  assert tree.max_depth <= 2 + int(np.ceil(np.log2(num_classes + 2000)))


def _pure_nodes(tree, first, num_classes):
  """Nodes of 4 or more of the groups' words whose words are all of one group."""
  group_of = (np.arange(num_classes) - first) // 40
  pure = 0
  for n in range(tree.num_nodes):
    children = tree.slot_child[tree.child_begin[n]:tree.child_begin[n + 1]]
    words = children[(children >= first) & (children < num_classes)]
    if words.size >= 4:
      pure += np.bincount(group_of[words]).max() == words.size
  return pure


def test_right_contexts_are_the_reversed_corpus_left_ones(rng):
  ids, first, num_classes = _grouped_corpus(rng)
  pairs = ids.reshape(-1, 2)[:, ::-1].ravel()  # each word now comes before its cue
  right = Tree.from_context(pairs, num_classes, branching=8, contexts=30, dims=8,
                            side="right")
  left_of_reversed = Tree.from_context(pairs[::-1].copy(), num_classes, branching=8,
                                       contexts=30, dims=8)
  np.testing.assert_array_equal(right.slot_child, left_of_reversed.slot_child)
  assert _pure_nodes(right, first, num_classes) >= 0.9 * 8
  # Their left contexts are other groups' words: no better than a frequency tree's.
  assert _pure_nodes(Tree.from_context(pairs, num_classes, branching=8, contexts=30,
                                       dims=8), first, num_classes) < 0.5 * 8
  with pytest.raises(ValueError, match='side must be "left" or "right"'):
    Tree.from_context(ids, num_classes, side="both")


def test_default_width_is_64_or_what_the_classes_allow(rng):
  ids = rng.integers(0, 500, 5000)
  assert context.context_vectors(ids, 500).shape == (500, context.DIMS) == (500, 64)
  assert context.context_vectors(ids[ids < 20], 20).shape == (20, 20)


def test_bad_arguments_name_the_problem():
  ids = np.array([0, 1, 2, 1])
  with pytest.raises(ValueError, match="1-D integer"):
    context.context_vectors(ids.reshape(2, 2), 3)
  with pytest.raises(ValueError, match="1-D integer"):
    context.context_vectors(ids.astype(np.float32), 3)
  with pytest.raises(ValueError, match=r"token_ids must lie in \[0, 2\)"):
    context.context_vectors(ids, 2, dims=1)
  with pytest.raises(ValueError, match="lie in"):
    context.context_vectors(np.array([0, -1]), 3, dims=1)
  with pytest.raises(ValueError, match="dims must be at most"):
    context.context_vectors(ids, 3, contexts=1, lags=1, dims=3)
  for name in ("contexts", "lags", "dims"):
    with pytest.raises(ValueError, match=name):
      context.context_vectors(ids, 3, **{name: 0})
  with pytest.raises(ValueError, match="num_classes"):
    context.context_vectors(ids, True)
  for few in ([], [1]):
    with pytest.raises(ValueError, match="at least 2 tokens"):
      context.context_vectors(few, 3)
  with pytest.raises(ValueError, match="below 2"):
    context.context_vectors(ids, 3, lags=2**61)
  with pytest.raises(ValueError, match="counts must have num_classes = 3 entries"):
    Tree.from_context(ids, 3, counts=np.ones(4))


def test_the_demo_takes_a_context_tree():
  args = demo.parse_args(["--tree", "context", "--branching", "16", "--head", "100"])
  assert (args.tree, args.branching, args.head) == ("context", 16, 100)
  with pytest.raises(SystemExit):
    demo.parse_args(["--tree", "context", "--branching", "1"])
