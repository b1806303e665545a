"""The demo's command line: values that would train a wrong model, or crash it, are
refused with the flag named, before anything is trained."""

import pytest

from tf_hsm.demo import run as demo


@pytest.mark.parametrize("flags, named", [
    (["--learning-rate", "-1"], "--learning-rate must be a positive number"),
    (["--learning-rate", "0"], "--learning-rate must be a positive number"),
    (["--learning-rate", "nan"], "--learning-rate must be a positive number"),
    (["--output-lr-scale", "inf"], "--output-lr-scale must be a positive number"),
    (["--max-tokens", "-5"], "--max-tokens must be >= 0"),
    (["--seed", "-1"], "--seed must be in"),
    (["--seed", str(2**32)], "--seed must be in"),
    (["--init-seed", "-1"], "--init-seed must be in"),
    (["--tree", "huffman", "--mixture"], "--mixture applies to --tree context"),
    (["--tree", "context", "--mixture", "1"], "--mixture takes at least 2 trees, got 1"),
    (["--tree", "context", "--mixture", "0"], "--mixture takes at least 2 trees, got 0"),
    (["--tree", "context", "--head", "64", "--shared-head"],
     "--shared-head takes --mixture N and --head H"),
    (["--tree", "context", "--mixture", "3", "--shared-head"],
     "--shared-head takes --mixture N and --head H"),
])
def test_bad_values_are_refused_by_name(flags, named, capsys):
  with pytest.raises(SystemExit):
    demo.parse_args(flags)
  assert named in capsys.readouterr().err


def test_edges_that_are_fine_are_kept():
  args = demo.parse_args(["--max-tokens", "0", "--seed", str(2**32 - 1),
                          "--learning-rate", "1e-4"])
  assert (args.max_tokens, args.seed, args.learning_rate) == (0, 2**32 - 1, 1e-4)


def test_a_corpus_that_cannot_be_read_is_named(tmp_path):
  latin = tmp_path / "latin.txt"
  latin.write_bytes("déjà vu\n".encode("latin-1") * 40)
  for path, said in ((tmp_path / "missing.txt", "cannot read the corpus"),
                     (latin, "is not UTF-8 text")):
    with pytest.raises(SystemExit) as stop:
      demo.main(["--corpus", str(path), "--out", str(tmp_path / "out")])
    assert str(stop.value).startswith("--corpus: ") and said in str(stop.value)


def test_a_missing_matplotlib_is_named_before_training(monkeypatch):
  # A wheel does not bring matplotlib (the plot's): the demo says so at once, where it
  # trained every model and then lost the run to an ImportError at the plot.
  import sys  # pylint: disable=import-outside-toplevel
  monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises
  monkeypatch.setattr(demo, "train", lambda *a, **k: pytest.fail("trained first"))
  with pytest.raises(ImportError, match=r"pip install matplotlib .*tf_hsm\[demo\]"):
    demo.main(["--epochs", "1"])
