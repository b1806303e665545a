"""The quality runs' corpora (`tf_hsm.bench.corpora`): the text each source gives, the
files the demo reads back, the statistics, and the quality runs' settings for them."""

import io
import json
import os
import re
import shutil
import subprocess
import tarfile
import zipfile

import pytest

from tf_hsm.bench import corpora
from tf_hsm.bench import quality_runs
from tf_hsm.demo import run

_NEEDS_DPKG = pytest.mark.skipif(not shutil.which("dpkg-deb"), reason="needs dpkg-deb")


def test_documents_come_back_as_written(tmp_path):
  """A blank line inside a document would split it when the demo reads the file."""
  path = tmp_path / "c.txt"
  kept = corpora.write_documents(["one\n\ntwo  \n", "", " \n", "three\nfour"], path)
  assert kept == 2
  assert run.file_documents(str(path)) == ["one\ntwo", "three\nfour\n"]


def test_c_comments_drop_stars_and_licence_lines():
  source = ("// SPDX-License-Identifier: GPL-2.0\n/*\n * Resets the PHY.\n *\n"
            " * Return: 0 or -EIO.\n */\nint x; // the count\n/**/")
  texts = corpora.c_comments(source)
  assert texts == ["", "Resets the PHY.\n\nReturn: 0 or -EIO.", "the count", ""]
  seen = set()
  assert corpora.distinct(texts, seen) == "Resets the PHY.\n\nReturn: 0 or -EIO.\nthe count"
  assert corpora.distinct(["the count", "new"], seen) == "new"  # each comment once


def test_javadoc_text_keeps_the_prose():
  body = ("*\n * Returns the {@code size} of a <b>list</b>, see {@link List#size()}.\n"
          " * <p>Never &lt; 0.\n * @return the size\n ")
  assert corpora.javadoc_text(body) == (
      "Returns the size of a list, see List#size().\nNever < 0.\n@return the size")


def test_linked_directories_are_read_once(tmp_path):
  """erlang-doc links its applications' doc/ trees into one another: a page under a
  linked directory is the same page, read once."""
  (tmp_path / "doc").mkdir()
  (tmp_path / "doc" / "a.html").write_text("<p>Processes.</p>")
  os.symlink(tmp_path / "doc", tmp_path / "lib")
  assert corpora.files_under(str(tmp_path), ".html") == [str(tmp_path / "doc" / "a.html")]
  assert [t.split() for t in corpora.html_pages(str(tmp_path), None, None)] == [
      ["Processes."]]


def _tar_xz(path, files):
  with tarfile.open(path, "w:xz") as tar:
    for name, text in files.items():
      data = text.encode()
      info = tarfile.TarInfo(name)
      info.size = len(data)
      tar.addfile(info, io.BytesIO(data))


def test_kernel_comments_and_documentation_from_the_tarball(tmp_path):
  tarball = tmp_path / "linux-source-9.9.tar.xz"
  _tar_xz(tarball, {
      "linux-source-9.9/drivers/a.c": "/* GPL boilerplate */\n/* probes a */ int a;",
      "linux-source-9.9/drivers/b.h": "/* GPL boilerplate */\n// frees b\n",
      "linux-source-9.9/drivers/c.S": "/* assembly: not read */",
      "linux-source-9.9/Documentation/x.rst": "How x works.",
      "linux-source-9.9/Documentation/y.yaml": "schema: not read",
      "linux-source-9.9/README.txt": "not under Documentation"})
  assert list(corpora.kernel_comments(str(tarball))) == [
      "GPL boilerplate\nprobes a", "frees b"]
  assert list(corpora.kernel_documentation(str(tarball))) == ["How x works."]


def test_javadoc_from_the_source_zip(tmp_path):
  path = tmp_path / "src.zip"
  with zipfile.ZipFile(path, "w") as z:
    z.writestr("java.base/java/util/B.java", "/** Second. */ class B {} /* not Javadoc */")
    z.writestr("java.base/java/util/A.java", "/** First. */ class A {}\n/** Second. */")
    z.writestr("java.base/java/util/notes.txt", "/** not a source */")
  assert list(corpora.javadoc(str(path))) == ["First.\nSecond.", ""]


def test_html_text_keeps_the_main_text():
  page = ("<html><head><style>p {x: 1}</style></head><body><div class=nav>Prev Next</div>"
          "<main><h1>Joins</h1><script>var a = '<p>';</script><p>Rows &amp; "
          "columns</p></main><footer>Copyright</footer></body></html>")
  assert corpora.html_text(page, "<main", "<footer").split() == [
      "Joins", "Rows", "&", "columns"]
  # Markers the page lacks leave it whole.
  assert corpora.html_text(page, "<article", "<aside").split() == [
      "Prev", "Next", "Joins", "Rows", "&", "columns", "Copyright"]


def test_go_comments_leave_tests_and_the_toolchain_out(tmp_path):
  for name, text in {"fmt/print.go": "// Package fmt formats.\npackage fmt // fmt",
                     "fmt/scan.go": "// Package fmt formats.\n/* Scan reads. */",
                     "fmt/print_test.go": "// A test.",
                     "fmt/testdata/x.go": "// Data.",
                     "cmd/compile/main.go": "// Compile compiles."}.items():
    (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / name).write_text(text)
  # Each distinct comment once: the package comment repeated in scan.go is dropped.
  assert list(corpora.go_comments(str(tmp_path))) == ["Package fmt formats.\nfmt",
                                                      "Scan reads."]


@_NEEDS_DPKG
def test_project_docs_from_their_packages(tmp_path, monkeypatch):
  """Every package's text, in its own way, from cached .debs (no download)."""
  cache = tmp_path / "cache"
  cache.mkdir()
  doc = "usr/share/doc"
  _deb(cache, "golang-src", {"usr/share/go-1.19/src/os/file.go": "// File is an open file.",
                             "usr/share/go-1.19/src/cmd/go/main.go": "// The go tool.",
                             "usr/share/go-1.19/test/fixedbugs/a.go": "// ERROR x"})
  _deb(cache, "postgresql-doc", {f"{doc}/pg/html/a.html":
                                 "<div>Prev<hr /></div><p>VACUUM reclaims.</p>"
                                 '<div class="navfooter">Next</div>'})
  _deb(cache, "erlang-doc", {f"{doc}/erlang/a.html":
                             '<div id="menu">kernel stdlib</div><div id="content">'
                             "<p>Processes are cheap.</p></div>"})
  _deb(cache, "octave-doc", {f"{doc}/octave/octave.html/a.html":
                             '<div class="header">Next</div><hr><p>Matrices grow.</p><hr>'
                             '<div class="header">Prev</div>',
                             f"{doc}/octave/octave.html/XREFzeros.html":
                             '<meta http-equiv="Refresh" content="0; url=a.html">zeros',
                             f"{doc}/octave/octave.html/Function-Index.html": "<hr>zeros",
                             f"{doc}/octave/liboctave.html/b.html": "<p>C++ API.</p>"})
  books = ("book", "edition-guide", "embedded-book", "nomicon", "reference",
           "rust-by-example", "rustc", "rustdoc", "unstable-book")
  rust = f"{doc}/rust-doc/html"
  _deb(cache, "rust-doc", {
      f"{rust}/book/a.html": "<nav>Contents</nav><main>Ownership moves.</main><nav>n</nav>",
      f"{rust}/book/print.html": "<main>Ownership moves.</main>",
      f"{rust}/book/index.html": "<main>Ownership moves.</main>",
      f"{rust}/book/second-edition/a.html": "<main>No longer distributed.</main>",
      f"{rust}/book/moved.html": "<p>Old link: see the new chapter.</p>",
      f"{rust}/std/vec.html": "<main>Vec API.</main>",
      **{f"{rust}/{book}/a.html": f"<main>{book}</main>" for book in books[1:]}})
  _deb(cache, "python-scipy-doc", {f"{doc}/python-scipy-doc/html/a.html":
                                   "<nav>Home</nav><main>Sparse arrays.</main>"
                                   '<div class="prev-next-info">next</div>'})
  _deb(cache, "python-django-doc", {f"{doc}/python-django-doc/html/a.html":
                                    '<div id="hd">Home</div><div id="yui-main">'
                                    'Models.</div><div id="ft">(c)</div>'})
  pandas = f"{doc}/python-pandas-doc/html/_sources"
  _deb(cache, "python-pandas-doc", {f"{pandas}/a.rst.txt": "Series are columns.",
                                    f"{pandas}/reference/api/x.rst.txt": ".. autoclass:: x",
                                    f"{pandas}/b.ipynb.txt": '{"cells": []}',
                                    f"{doc}/python-pandas-doc/LICENSE.txt": "licence"})
  _deb(cache, "python-sqlalchemy-doc", {f"{doc}/python-sqlalchemy-doc/rst/a.rst":
                                        "Sessions flush."})
  _deb(cache, "cmake-doc", {f"{doc}/cmake-data/html/_sources/a.rst.txt": "Targets link."})
  others = [p for p in corpora.SOURCE_MANUALS
            if p not in ("python-pandas-doc", "python-sqlalchemy-doc", "cmake-doc")]
  for package in others:
    _deb(cache, package, {f"{doc}/{corpora.SOURCE_MANUALS[package][0]}/a.txt": package})
  monkeypatch.setattr(corpora, "METAPACKAGES", {})
  documents, versions = corpora.project_docs(str(cache))
  # Each manual's main text. Left out: Octave's C++ manual, its redirect and index
  # pages; Rust's API pages, its books' print.html and index.html (a whole book and its
  # first chapter again), the old editions' stubs and a page without <main>; pandas'
  # generated API page and its notebook.
  texts = {p: p for p in others}
  texts.update({"python-pandas-doc": "Series are columns.",
                "python-sqlalchemy-doc": "Sessions flush.", "cmake-doc": "Targets link."})
  assert [" ".join(d.split()) for d in documents] == [
      "File is an open file.", "Sparse arrays.", "Models.", "VACUUM reclaims.",
      "Processes are cheap.", "Matrices grow.", "Ownership moves.", *books[1:],
      *[texts[p] for p in corpora.SOURCE_MANUALS]]
  assert versions[:4] == ["golang-src 1", "python-scipy-doc 1", "python-django-doc 1",
                          "postgresql-doc 1"]


def test_statistics_of_a_known_corpus():
  """100 documents `a b c uN` (5 tokens with <eos>): blocks of 10 tokens (two
  documents), every 10th held out; only a, b, c and <eos> are seen twice."""
  documents = [f"a b c u{i}" for i in range(100)]
  stats = corpora.corpus_statistics(documents)
  assert stats["tokens"] == 500 and stats["held_out_tokens"] == 50
  assert stats["words"] == 4 and stats["classes"] == 5
  assert stats["train_types"] == 4 + 90 and stats["corpus_types"] == 4 + 100
  assert stats["held_out_oov"] == pytest.approx(10 / 50)
  capped = corpora.corpus_statistics(documents, max_tokens=100)
  assert capped["tokens"] == 100 and capped["max_tokens"] == 100
  assert "first 100 tokens" in corpora.describe(capped)
  assert "V=5 classes with <unk>" in corpora.describe(stats)


def test_statistics_refuse_bad_input():
  with pytest.raises(ValueError, match="min_count must be >= 1"):
    corpora.corpus_statistics(["a b"], min_count=0)
  with pytest.raises(ValueError, match="too small to split"):
    corpora.corpus_statistics(["a"])


def test_fortunes_one_document_each(tmp_path, monkeypatch):
  (tmp_path / "one").write_text("A fortune\n\nof two lines\n%\nSecond\n%\n")
  (tmp_path / "one.dat").write_text("index, not text")
  monkeypatch.setattr(corpora, "FORTUNES", str(tmp_path))
  path = corpora.corpus_file("fortunes", str(tmp_path))
  assert run.file_documents(path) == ["A fortune\nof two lines", "Second\n"]
  monkeypatch.setattr(corpora, "FORTUNES", str(tmp_path / "none"))
  with pytest.raises(SystemExit, match="apt-get install -y fortunes"):
    corpora.fortunes_documents()


def test_metapackages_resolve_to_their_versioned_package(monkeypatch):
  answers = {"linux-source": "linux-source\n  Depends: linux-source-6.1\n",
             "python3-doc": "python3-doc\n  Depends: python3\n  Depends: python3.11-doc\n"}
  monkeypatch.setattr(corpora, "_run", lambda cmd, cwd=None: answers.get(cmd[-1], ""))
  assert corpora.resolve("linux-source") == "linux-source-6.1"
  assert corpora.resolve("python3-doc") == "python3.11-doc"
  assert corpora.resolve("perl-doc") == "perl-doc"  # a real package: as named
  answers["linux-source"] = "linux-source\n  Depends: linux-doc\n"
  with pytest.raises(SystemExit, match="apt-get update"):
    corpora.resolve("linux-source")


def test_a_missing_tool_is_named():
  with pytest.raises(SystemExit, match="`no-such-tool-here` is missing"):
    corpora._run(["no-such-tool-here", "x"])


def _deb(cache, name, files, version="1"):
  """Builds CACHE/NAME_VERSION_all.deb holding FILES (path -> text)."""
  root = cache.parent / f"src_{name}"
  (root / "DEBIAN").mkdir(parents=True)
  (root / "DEBIAN" / "control").write_text(
      f"Package: {name}\nVersion: {version}\nArchitecture: all\nMaintainer: x <x@x>\n"
      "Description: test\n")
  for path, text in files.items():
    (root / path).parent.mkdir(parents=True, exist_ok=True)
    (root / path).write_text(text)
  subprocess.run(["dpkg-deb", "--build", str(root), str(cache / f"{name}_{version}_all.deb")],
                 check=True, capture_output=True)


@_NEEDS_DPKG
def test_fetch_unpacks_a_cached_package_once(tmp_path):
  """A .deb already in the cache is not downloaded again; it is unpacked once."""
  cache = tmp_path / "cache"
  cache.mkdir()
  _deb(cache, "tiny-doc", {"usr/share/doc/a.txt": "text"}, version="1.2-3")
  unpacked, version = corpora.fetch("tiny-doc", str(cache))
  assert version == "tiny-doc 1.2-3"
  assert open(os.path.join(unpacked, "usr", "share", "doc", "a.txt")).read() == "text"
  assert corpora.fetch("tiny-doc", str(cache)) == (unpacked, version)
  (cache / "tiny-doc_1.2-4_all.deb").write_bytes(b"")
  with pytest.raises(SystemExit, match="expected one tiny-doc_"):
    corpora.fetch("tiny-doc", str(cache))


def test_unknown_corpora_are_refused(tmp_path, capsys):
  with pytest.raises(SystemExit, match="no such corpus: nowhere.txt"):
    corpora.corpus_file("nowhere.txt", str(tmp_path))
  with pytest.raises(SystemExit) as exit_info:
    corpora.main(["wikipedia", "--out", str(tmp_path)])
  assert exit_info.value.code == 2
  assert "unknown corpus wikipedia" in capsys.readouterr().err


def test_main_writes_the_statistics(tmp_path, monkeypatch):
  (tmp_path / "one").write_text("\n%\n".join(f"a b c u{i}" for i in range(100)))
  monkeypatch.setattr(corpora, "FORTUNES", str(tmp_path))
  out = tmp_path / "out"
  assert corpora.main(["fortunes", "--out", str(out)]) == 0
  with open(out / "fortunes.json") as f:
    result = json.load(f)
  assert result["documents"] == 100 and result["statistics"][0]["classes"] == 5


def test_quality_runs_train_large_corpora_on_their_whole_vocabulary(tmp_path):
  assert quality_runs.corpus_settings("linux-comments") == {
      "max_tokens": 0, "vocab": corpora.VOCAB_ALL}
  assert quality_runs.corpus_settings("kjv") == {"max_tokens": run.DEFAULTS["max_tokens"],
                                                 "vocab": run.DEFAULTS["vocab"]}
  large = quality_runs.command("huffman8", "c.txt", str(tmp_path), 100, None,
                               quality_runs.corpus_settings("debian-docs"))
  assert large[large.index("--max-tokens") + 1] == "0"
  assert large[large.index("--vocab") + 1] == str(corpora.VOCAB_ALL)
  small = quality_runs.command("huffman8", "c.txt", str(tmp_path), 100, None,
                               quality_runs.corpus_settings("kjv"))
  assert "--vocab" not in small and "--max-tokens" not in small
  # The whole vocabulary: every word seen twice, beyond the demo's 10,000 cap.
  corpus = tmp_path / "big.txt"
  corpora.write_documents([" ".join(f"w{i} w{i}" for i in range(j, j + 50))
                           for j in range(0, 12_000, 50)], corpus)
  counts = quality_runs.training_counts(str(corpus), {"max_tokens": 0,
                                                      "vocab": corpora.VOCAB_ALL})
  assert len(counts) > run.DEFAULTS["vocab"]


def test_quality_runs_prepare_a_large_corpus_once(tmp_path, monkeypatch, capsys):
  """`quality_runs linux-comments --dry-run`: the corpus is made once where the corpora
  command keeps it, and every row's demo command trains on all of it."""
  made = []

  def fake(cache):
    made.append(cache)
    return [" ".join(f"w{i} w{i}" for i in range(j, j + 20)) for j in range(0, 600, 20)], \
        ["linux-source-9.9 9.9.1-1"]

  monkeypatch.chdir(tmp_path)
  monkeypatch.setitem(corpora.LARGE_CORPORA, "linux-comments", fake)
  for _ in range(2):
    assert quality_runs.main(["linux-comments", "--dry-run", "--cpu", "-1",
                              "--rows", "full,balanced"]) == 0
  assert made == [os.path.join(corpora.DEFAULT_OUT, "debs")]
  path = os.path.join(corpora.DEFAULT_OUT, "linux-comments.txt")
  with open(os.path.join(corpora.DEFAULT_OUT, "linux-comments.packages.json")) as f:
    assert json.load(f) == ["linux-source-9.9 9.9.1-1"]
  commands = [line[2:].split() for line in capsys.readouterr().out.splitlines()
              if line.startswith("$ ")]
  assert len(commands) == 4
  for cmd in commands:
    assert cmd[cmd.index("--corpus") + 1] == path
    assert cmd[cmd.index("--max-tokens") + 1] == "0"
  balanced = commands[1]
  # The words seen twice in training (539 of 600: the held-out blocks take the rest) and
  # <unk>: V=540, branching ceil(540^(1/3)) = 9 (the demo's 10,000 cap would not bind).
  assert balanced[balanced.index("--branching") + 1] == "9"


def test_a_few_bytes_outside_utf8_are_replaced_and_said(tmp_path):
  """A stray Latin-1 byte in a long UTF-8 text is read as U+FFFD with a warning that
  says where; a file mostly outside UTF-8, or none at all, is an error naming it."""
  path = tmp_path / "mixed.txt"
  path.write_bytes("naïve words here\n".encode("utf-8") * 200 + b"caf\xe9 au lait\n\nend")
  said = []
  documents = run.file_documents(str(path), warn=said.append)
  assert documents[0].endswith("caf\ufffd au lait") and documents[1] == "end"
  assert len(said) == 1 and "1 places" in said[0] and f"byte {200 * 18 + 3:,}" in said[0]
  assert not said[0].count("\ufffd")
  clean = tmp_path / "clean.txt"
  clean.write_text("real \ufffd kept\n", encoding="utf-8")  # a U+FFFD of its own
  assert run.file_documents(str(clean), warn=said.append) == ["real \ufffd kept\n"]
  assert len(said) == 1
  latin = tmp_path / "latin.txt"
  latin.write_bytes("café résumé naïve\n".encode("latin-1") * 50)
  with pytest.raises(ValueError, match=r"latin.txt is not UTF-8 text: 200 places.*iconv"):
    run.file_documents(str(latin))
  with pytest.raises(ValueError, match=r"cannot read the corpus .*missing.txt"):
    run.file_documents(str(tmp_path / "missing.txt"))


def test_rows_with_a_head_run_by_default_on_a_large_vocabulary(tmp_path):
  """The planner's trees with a head of 256 (from vectors, from contexts) are measured
  by default where the vocabulary is large enough to hold them; the context row is the
  demo's --tree context with the planner's arguments."""
  small, large = quality_runs.default_rows(300), quality_runs.default_rows(5_000)
  assert "context32_head256" not in small and "vectors32_head256" not in small
  assert set(large) == set(quality_runs.ROWS) and set(small) < set(large)
  cmd = quality_runs.command("context32_head256", "c.txt", str(tmp_path), 5_000, None)
  assert cmd[cmd.index("--tree") + 1] == "context"
  assert cmd[cmd.index("--branching") + 1] == "32" and cmd[cmd.index("--head") + 1] == "256"
  from tf_hsm.planning import quality  # pylint: disable=import-outside-toplevel
  assert quality_runs.ROWS["context32_head256"][0] in quality.KINDS


def test_the_planners_mixtures_are_rows_of_the_runs(tmp_path):
  """Every mixture the planner prices is a row the bench can measure, as the demo's
  --mixture over the context trees of its branching and head."""
  from tf_hsm.planning import candidates, quality  # pylint: disable=import-outside-toplevel
  for name in candidates.MIXTURE_TREES:
    assert quality_runs.ROWS[name][0] == name and name in quality.KINDS
    assert name in quality_runs.default_rows(5_000)
    cmd = quality_runs.command(name, "c.txt", str(tmp_path), 5_000, None)
    shape, kind, head, rank = re.fullmatch(r"mixture(.+)_(head|shared)(\d+)(?:_rank(\d+))?",
                                           name).groups()
    count, _, k = shape.rpartition("x")
    assert ("--shared-head" in cmd) == (kind == "shared")
    assert (cmd[cmd.index("--head-rank") + 1] == rank) if rank else "--head-rank" not in cmd
    assert "--mixture" in cmd and cmd[cmd.index("--tree") + 1] == "context"
    after = cmd[cmd.index("--mixture") + 1:][:1]
    assert after == [count] if count else not (after and after[0].isdigit())
    assert cmd[cmd.index("--branching") + 1] == k and cmd[cmd.index("--head") + 1] == head
