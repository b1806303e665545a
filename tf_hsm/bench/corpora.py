"""The quality runs' corpora, prepared: `python -m tf_hsm.bench.corpora NAME [NAME ...]`.

Writes each corpus as the demo reads `--corpus` (UTF-8, documents separated by a blank
line, none inside one) and prints what it yields under the demo's tokeniser and split
(`tf_hsm.demo.run`: lower-cased words, identifiers whole, single punctuation marks;
documents shuffled with seed 0, every 10th block of 1,000 tokens held out):

- `stdlib`: the demo's default corpus (the standard library's docstrings);
- `kjv`: the King James Bible, from Debian's `bible-kjv-text` read with `bible-kjv`'s
  `bible` command (`apt-get install -y bible-kjv`), one document per chapter, verse
  numbers and chapter headings removed (docs/demo.md);
- `fortunes`: Debian's `fortunes` package (`apt-get install -y fortunes`): every file of
  /usr/share/games/fortunes, one document per fortune (the '%' lines separate them);
- `linux-comments` (large vocabulary): the comments of every C source and header of the
  Linux kernel as Debian's `linux-source` ships it, one document per file, each distinct
  comment once (licence boilerplate repeats in thousands of files), `SPDX-License`
  lines and the leading `*` of comment lines removed;
- `debian-docs` (large vocabulary): documentation four Debian packages ship: the kernel's
  Documentation/ (.rst and .txt, from the same `linux-source`), Python's manual (the
  reStructuredText sources in `python3-doc`), Perl's manual pages (`perl-doc`'s .pod
  files) and the JDK's Javadoc (the `/** */` comments of `openjdk-17-source`'s Java
  sources, HTML tags and `{@code ...}` braces removed, each distinct comment once), one
  document per file;
- `project-docs` (large vocabulary): the manuals of twenty-two projects, as Debian
  packages ship them, one document per page or file: Go's standard library (the
  comments of `golang-src`'s src/, tests, testdata and cmd/ left out, each distinct
  comment once); the HTML manuals of PostgreSQL, Erlang/OTP, GNU Octave, SciPy and
  Django and Rust's books (`HTML_MANUALS`); the sources of the manuals of pandas,
  scikit-learn, SQLAlchemy, Astropy, statsmodels, SymPy, xarray, ASE, Dask, Celery,
  IPython, PyTables, Sphinx, CMake and Git (`SOURCE_MANUALS`). HTML pages keep the text
  between the site's navigation and its footer, scripts and styles dropped, tags
  removed, entities decoded; stubs (redirects, pages generated from docstrings) and
  pages that repeat others are left out.

The large corpora's packages are fetched with `apt-get download` (207 MB for the first
two, the kernel's source 139 of them; 281 MB for project-docs) into --cache and
unpacked with `dpkg-deb`; run `apt-get update` once first. Their vocabulary is every
type seen at least twice in the training split (the demo's `--min-count 2`, no `--vocab`
cap: `VOCAB_ALL`) over the whole corpus (`--max-tokens 0`): that is what `LARGE` passes
to the demo. OUT/NAME.json records the packages' versions and the statistics
(`corpus_statistics`) at every cap of `CAPS`.
"""

import argparse
import collections
import fnmatch
import glob
import html
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile

FORTUNES = "/usr/share/games/fortunes"
# Where the command writes the corpora, and where the quality runs read the large ones.
DEFAULT_OUT = os.path.join("demo_results", "corpora")
# The demo's arguments that make a large corpus's vocabulary every type seen twice in
# training: the whole corpus, and a --vocab cap above any corpus's type count.
VOCAB_ALL = 10_000_000
LARGE = {"linux-comments": {"max_tokens": 0, "vocab": VOCAB_ALL},
         "debian-docs": {"max_tokens": 0, "vocab": VOCAB_ALL},
         "project-docs": {"max_tokens": 0, "vocab": VOCAB_ALL}}
# Token caps the statistics are also given at (0: the whole corpus): what a shorter
# training run on the same corpus would see.
CAPS = (3_000_000, 6_000_000, 12_000_000, 0)
# Debian's names: a metapackage is followed to the versioned package it depends on (the
# pattern), so a later Debian release fetches its own kernel and Python.
PACKAGES = {"linux": "linux-source", "python": "python3-doc", "perl": "perl-doc",
            "jdk": "openjdk-17-source", "go": "golang-src"}
# project-docs' manuals shipped as their sources (reStructuredText; Git's AsciiDoc):
# package -> (their directory under the package's /usr/share/doc, the sources' suffix,
# the names (glob patterns) of the files and directories left out). A Sphinx manual's
# API pages generated from docstrings (`_GENERATED`) are only directives and names in
# its sources (the docstrings are in the HTML alone); its notebooks are JSON.
_GENERATED = ("generated", "api", "_autosummary", "auto_examples", "reference",
              "*.ipynb.txt")
SOURCE_MANUALS = {
    "python-pandas-doc": ("python-pandas-doc/html/_sources", ".txt", _GENERATED),
    "python-sklearn-doc": ("python-sklearn-doc/html/_sources", ".txt", _GENERATED),
    "python-sqlalchemy-doc": ("python-sqlalchemy-doc/rst", ".rst", ()),
    "python-astropy-doc": ("python-astropy-doc/html/_sources", ".txt", _GENERATED),
    "python-statsmodels-doc": ("python-statsmodels-doc/html/_sources", ".txt",
                               _GENERATED),
    "python-sympy-doc": ("python-sympy-doc/html/_sources", ".txt", _GENERATED),
    "python-xarray-doc": ("python-xarray-doc/html/_sources", ".txt", _GENERATED),
    "python-ase-doc": ("python-ase-doc/html/_sources", ".txt", _GENERATED),
    "python-dask-doc": ("python-dask-doc/html/_sources", ".txt", _GENERATED),
    "python-celery-doc": ("python-celery-doc/html/_sources", ".txt", _GENERATED),
    "python-ipython-doc": ("python-ipython-doc/html/_sources", ".txt", _GENERATED),
    "python-tables-doc": ("python-tables-doc/html/_sources", ".txt", _GENERATED),
    "sphinx-doc": ("sphinx-doc/html/_sources", ".txt", _GENERATED),
    "cmake-doc": ("cmake-data/html/_sources", ".txt", _GENERATED),
    "git-doc": ("git-doc", ".txt", ())}


class HtmlManual(collections.namedtuple("HtmlManual",
                                        "directories start end skip marked_only",
                                        defaults=((), False))):
  """A manual shipped as HTML pages: the directories under /usr/share/doc holding them
  (("",): the whole package), the markers its main text starts and ends at
  (`html_text`), the names (glob patterns) of the pages and directories left out (pages
  that repeat others, indexes), and whether a page without the start marker is left
  out too (where every page of the manual has it, one without is a stub)."""


# Rust's books in rust-doc (mdBook sites; the API references are left out: generated
# pages of signatures, 390 MB). Left out: print.html (a whole book on one page),
# index.html (its first chapter again), the old editions' stubs and the pages of links.
RUST_BOOKS = ("book", "edition-guide", "embedded-book", "nomicon", "reference",
              "rust-by-example", "rustc", "rustdoc", "unstable-book")
_MDBOOK_COPIES = ("print.html", "index.html", "404.html", "README.html", "SUMMARY.html",
                  "first-edition", "second-edition", "2018-edition")
HTML_MANUALS = {
    "python-scipy-doc": HtmlManual(("",), "<main", '<div class="prev-next-info">'),
    "python-django-doc": HtmlManual(("",), '<div id="yui-main"', '<div id="ft"'),
    # PostgreSQL's pages open with a navigation table closed by a rule; Erlang's with a
    # menu of every application before the content; Octave's (Texinfo) with a header
    # of links closed by a rule.
    "postgresql-doc": HtmlManual(("",), "<hr /></div>", '<div class="navfooter"'),
    "erlang-doc": HtmlManual(("",), '<div id="content"', None),
    "octave-doc": HtmlManual(("octave/octave.html",), "<hr>", '<div class="header">',
                             ("*Index.html", "index.html", "Copying.html")),
    "rust-doc": HtmlManual(tuple(f"rust-doc/html/{book}" for book in RUST_BOOKS),
                           "<main>", "</main>", _MDBOOK_COPIES, marked_only=True)}
METAPACKAGES = {"linux-source": re.compile(r"linux-source-[0-9.]+"),
                "python3-doc": re.compile(r"python3\.[0-9]+-doc"),
                "golang-src": re.compile(r"golang-[0-9.]+-src"),
                "postgresql-doc": re.compile(r"postgresql-doc-[0-9]+")}
# Not a C parser: a `//` or `/*` inside a string literal (a URL in a printk) is read as a
# comment too; such text is a small part of the comments and is prose-like anyway.
_COMMENT = re.compile(r"/\*(.*?)\*/|//([^\n]*)", re.S)
_JAVADOC = re.compile(r"/\*\*(.*?)\*/", re.S)
_STAR = re.compile(r"^[ \t]*\*+ ?", re.M)
_HTML_TAG = re.compile(r"<[^>\n]*>")
_INLINE_TAG = re.compile(r"\{@\w+\s*([^{}]*)\}")
_SCRIPT = re.compile(r"<(script|style)\b.*?</\1\s*>", re.S | re.I)
_ANY_TAG = re.compile(r"<[^>]*>")


# ---------------------------------------------------------------------------------------
# Writing a corpus
# ---------------------------------------------------------------------------------------

def write_documents(documents, path):
  """Writes documents as the demo's `file_documents` reads them back: blank lines
  between documents and none inside one (a blank line would split a document).

  Returns:
    The number of documents written.
  """
  kept = 0
  with open(path, "w", encoding="utf-8") as f:
    for document in documents:
      lines = [line.rstrip() for line in document.split("\n") if line.strip()]
      if lines:
        f.write(("\n" if kept else "") + "\n".join(lines) + "\n")
        kept += 1
  return kept


def kjv_documents():
  """The King James Bible, one document per chapter (docs/demo.md's command)."""
  if not shutil.which("bible"):
    raise SystemExit("the `bible` command is missing: apt-get install -y bible-kjv "
                     "(it brings bible-kjv-text)")
  text = subprocess.run(["bible", "gen1:1-rev22:21"], capture_output=True, text=True,
                        check=True).stdout
  lines, prev = [], None
  for number, line in enumerate(text.split("\n")):
    # A chapter heading ("Genesis 1") follows a blank line: dropped.
    heading = (number > 0 and prev == "" and line[:1] not in ("", " ") and
               line.rsplit(" ", 1)[-1].isdigit())
    prev = line
    if heading:
      continue
    stripped = line.lstrip(" ")
    if stripped != line and stripped.split(" ", 1)[0].isdigit() and " " in stripped:
      line = stripped.split(" ", 1)[1]  # the verse number
    lines.append(line)
  # The chapters are the blank-line-separated pieces, as the demo reads the file.
  return re.split(r"\n\s*\n", "\n".join(lines))


def fortunes_documents():
  """Every fortune of /usr/share/games/fortunes, one document each."""
  files = sorted(p for p in glob.glob(os.path.join(FORTUNES, "*"))
                 if os.path.isfile(p) and not os.path.islink(p) and
                 not p.endswith(".dat"))
  if not files:
    raise SystemExit(f"no fortunes under {FORTUNES}: apt-get install -y fortunes")
  documents = []
  for name in files:
    with open(name, encoding="utf-8", errors="replace") as f:
      for fortune in f.read().split("\n%\n"):
        # A file's last separator may stand alone on its line.
        documents.append("\n".join(line for line in fortune.split("\n") if line != "%"))
  return documents


# ---------------------------------------------------------------------------------------
# Debian packages
# ---------------------------------------------------------------------------------------

def _run(cmd, cwd=None):
  if not shutil.which(cmd[0]):
    raise SystemExit(f"`{cmd[0]}` is missing: the large corpora come from Debian "
                     "packages (apt-get download, dpkg-deb)")
  done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
  if done.returncode:
    raise SystemExit(f"`{' '.join(cmd)}` failed (exit {done.returncode}): "
                     f"{done.stderr.strip()[-500:]} (run `apt-get update` once first)")
  return done.stdout


def resolve(package):
  """A metapackage's versioned package (linux-source -> linux-source-6.1), or PACKAGE."""
  if package not in METAPACKAGES:
    return package
  out = _run(["apt-cache", "depends", "--no-recommends", "--no-suggests", package])
  for line in out.split("\n"):
    name = line.strip().partition("Depends: ")[2]
    if METAPACKAGES[package].fullmatch(name):
      return name
  raise SystemExit(f"`apt-cache depends {package}` names no package like "
                   f"{METAPACKAGES[package].pattern}: run `apt-get update` once first")


def fetch(package, cache):
  """(unpacked directory, version) of a Debian package, downloaded into CACHE once."""
  os.makedirs(cache, exist_ok=True)
  name = resolve(package)
  debs = glob.glob(os.path.join(cache, f"{name}_*.deb"))
  if not debs:
    _run(["apt-get", "download", name], cwd=cache)
    debs = glob.glob(os.path.join(cache, f"{name}_*.deb"))
  if len(debs) != 1:
    raise SystemExit(f"expected one {name}_*.deb in {cache}, found {len(debs)}: "
                     "remove the stale ones")
  version = _run(["dpkg-deb", "-f", debs[0], "Version"]).strip()
  root = os.path.join(cache, f"{name}_{version}")
  if not os.path.isdir(root):
    _run(["dpkg-deb", "-x", debs[0], root + ".partial"])
    os.rename(root + ".partial", root)  # a run cut short leaves no half-unpacked tree
  return root, f"{name} {version}"


def _one(pattern):
  found = sorted(glob.glob(pattern))
  if len(found) != 1:
    raise SystemExit(f"expected one file matching {pattern}, found {len(found)}")
  return found[0]


def kernel_tarball(cache):
  root, version = fetch(PACKAGES["linux"], cache)
  return _one(os.path.join(root, "usr", "src", "linux-source-*.tar.*")), version


# ---------------------------------------------------------------------------------------
# Extracting the text
# ---------------------------------------------------------------------------------------

def comment_text(body):
  """A comment's text: each line's leading `*` (C and Javadoc style) removed."""
  return _STAR.sub("", body).strip()


def javadoc_text(body):
  """A Javadoc comment's prose: HTML tags and inline-tag braces removed, entities
  decoded ({@code x} -> x, {@link A#b} -> A#b, <p> -> nothing, &lt; -> <)."""
  return html.unescape(_HTML_TAG.sub("", _INLINE_TAG.sub(r"\1", comment_text(body))))


def c_comments(source):
  """The texts of a C file's comments (/* */ and //), in order, SPDX lines dropped."""
  texts = []
  for block, line in _COMMENT.findall(source):
    text = comment_text(block if block else line)
    texts.append("\n".join(t for t in text.split("\n") if "SPDX-License" not in t))
  return texts


def html_text(page, start=None, end=None):
  """A page's text from the first START (when the page has it) to the next END (when it
  follows), scripts and styles dropped, every tag a space, entities decoded: the site's
  navigation before START and its footer from END left out."""
  if start and start in page:
    page = page[page.index(start):]
  if end and end in page:
    page = page[:page.index(end)]
  return html.unescape(_ANY_TAG.sub(" ", _SCRIPT.sub(" ", page)))


def go_comments(root):
  """The comments of Go's standard library under ROOT (its src/): the packages' sources
  (tests, testdata and the toolchain's cmd/ left out), each distinct comment once, one
  document per file."""
  seen = set()
  for path in files_under(root, ".go"):
    parts = os.path.relpath(path, root).split(os.sep)
    if path.endswith("_test.go") or "testdata" in parts or parts[0] == "cmd":
      continue
    with open(path, encoding="utf-8", errors="replace") as f:
      yield distinct(c_comments(f.read()), seen)


_REDIRECT = re.compile(r"<meta[^>]*http-equiv=[\"']?refresh", re.I)


def html_pages(root, start, end, skip=(), marked_only=False):
  """html_text of every .html page under ROOT, in sorted path order, but those SKIP
  names (`tree_texts`), pages that only redirect to another (Texinfo's and mdBook's
  stubs for moved nodes), and with MARKED_ONLY the pages without START."""
  for page in tree_texts(root, ".html", skip):
    if _REDIRECT.search(page) or (marked_only and start not in page):
      continue
    yield html_text(page, start, end)


def distinct(pieces, seen):
  """The pieces not in SEEN (then added to it), as one document."""
  fresh = []
  for piece in pieces:
    piece = piece.strip()
    if piece and piece not in seen:
      seen.add(piece)
      fresh.append(piece)
  return "\n".join(fresh)


def tar_texts(path, keep):
  """(name, text) of the tarball's files whose names KEEP accepts, in archive order,
  read as a stream (the kernel's 1.3 GB unpacked is never written to disk)."""
  with tarfile.open(path, "r|*") as tar:
    for member in tar:
      if member.isfile() and keep(member.name):
        yield member.name, tar.extractfile(member).read().decode("utf-8", "replace")


def kernel_comments(tarball):
  seen = set()
  for _, source in tar_texts(tarball, lambda n: n.endswith((".c", ".h"))):
    yield distinct(c_comments(source), seen)


def kernel_documentation(tarball):
  for _, text in tar_texts(tarball, lambda n: "/Documentation/" in n and
                           n.endswith((".rst", ".txt"))):
    yield text


def files_under(root, suffix):
  """The paths of the files under ROOT ending with SUFFIX, sorted. Directory links are
  not followed: documentation packages link directories to each other (erlang-doc's
  applications' doc/ trees), and following them reads the same pages twice."""
  return sorted(os.path.join(parent, name) for parent, _, names in os.walk(root)
                for name in names if name.endswith(suffix))


def tree_texts(root, suffix, skip=()):
  """The text of every file under ROOT ending with SUFFIX, in sorted path order, but
  those with a name matching a glob pattern of SKIP, or under a directory that does."""
  paths = [p for p in files_under(root, suffix) if not _skipped(p, root, skip)]
  if not paths:
    raise SystemExit(f"no *{suffix} files under {root}")
  for path in paths:
    with open(path, encoding="utf-8", errors="replace") as f:
      yield f.read()


def _skipped(path, root, skip):
  """Whether PATH's name, or a directory's between ROOT and it, matches a pattern of SKIP."""
  parts = os.path.relpath(path, root).split(os.sep)
  return any(fnmatch.fnmatchcase(part, pattern) for part in parts for pattern in skip)


def javadoc(src_zip):
  seen = set()
  with zipfile.ZipFile(src_zip) as z:
    for name in sorted(n for n in z.namelist() if n.endswith(".java")):
      source = z.read(name).decode("utf-8", "replace")
      yield distinct([javadoc_text(b) for b in _JAVADOC.findall(source)], seen)


def linux_comments(cache):
  tarball, version = kernel_tarball(cache)
  return kernel_comments(tarball), [version]


def debian_docs(cache):
  tarball, linux = kernel_tarball(cache)
  python, python_version = fetch(PACKAGES["python"], cache)
  perl, perl_version = fetch(PACKAGES["perl"], cache)
  jdk, jdk_version = fetch(PACKAGES["jdk"], cache)
  # python3.X/ holds the manual (python3.X-doc/html is a link to it).
  sources = _one(os.path.join(python, "usr", "share", "doc", "python3.*[0-9]", "html",
                              "_sources"))
  pods = _one(os.path.join(perl, "usr", "share", "perl", "5*", "pod"))
  documents = (list(kernel_documentation(tarball)) + list(tree_texts(sources, ".txt")) +
               list(tree_texts(pods, ".pod")) +
               list(javadoc(_one(os.path.join(jdk, "usr", "lib", "jvm", "*", "lib",
                                               "src.zip")))))
  return documents, [linux, python_version, perl_version, jdk_version]


def project_docs(cache):
  go, go_version = fetch(PACKAGES["go"], cache)
  documents = list(go_comments(_one(os.path.join(go, "usr", "share", "go-*", "src"))))
  versions = [go_version]
  for package, manual in HTML_MANUALS.items():
    root, version = fetch(package, cache)
    versions.append(version)
    for directory in manual.directories:
      documents += list(html_pages(_doc_directory(root, directory), manual.start,
                                   manual.end, manual.skip, manual.marked_only))
  for package, (directory, suffix, skip) in SOURCE_MANUALS.items():
    root, version = fetch(package, cache)
    versions.append(version)
    documents += list(tree_texts(_doc_directory(root, directory), suffix, skip))
  return documents, versions


def _doc_directory(root, directory):
  """ROOT/usr/share/doc/DIRECTORY, or ROOT itself for the empty DIRECTORY."""
  if not directory:
    return root
  return _one(os.path.join(root, "usr", "share", "doc", directory))


# name: a function of the package cache -> (documents, the packages' versions).
LARGE_CORPORA = {"linux-comments": linux_comments, "debian-docs": debian_docs,
                 "project-docs": project_docs}
NAMES = ("stdlib", "kjv", "fortunes") + tuple(LARGE_CORPORA)


def corpus_file(corpus, out, cache=None):
  """The demo's `--corpus` argument for CORPUS (None: the standard library), written
  under OUT; a large corpus also writes OUT/CORPUS.packages.json (the packages'
  versions), and is kept: a file already there is used (delete it to make it again)."""
  if corpus == "stdlib":
    return None
  path = os.path.join(out, f"{corpus}.txt")
  if corpus in ("kjv", "fortunes"):
    write_documents((kjv_documents if corpus == "kjv" else fortunes_documents)(), path)
    return path
  if corpus in LARGE_CORPORA:
    os.makedirs(out, exist_ok=True)
    if not os.path.exists(path):
      documents, versions = LARGE_CORPORA[corpus](cache or default_cache())
      write_documents(documents, path + ".partial")
      os.rename(path + ".partial", path)
      with open(os.path.join(out, f"{corpus}.packages.json"), "w") as f:
        json.dump(versions, f)
    return path
  if not os.path.isfile(corpus):
    raise SystemExit(f"no such corpus: {corpus} ({', '.join(NAMES)} or a file)")
  return corpus


def default_cache():
  return os.path.join(DEFAULT_OUT, "debs")


# ---------------------------------------------------------------------------------------
# What a corpus yields
# ---------------------------------------------------------------------------------------

def corpus_statistics(documents, max_tokens=0, min_count=2, seed=0):
  """What the demo trains on, at its split: tokens, word types, the words seen at least
  MIN_COUNT times in training, the classes (those words and `<unk>`: the demo's V with
  no --vocab cap) and the held-out tokens outside them (the demo's `<unk>` rate).

  Returns:
    A dict of ints and the held-out OOV rate (a fraction).
  """
  from tf_hsm.demo import run  # pylint: disable=g-import-not-at-top
  if min_count < 1:
    raise ValueError(f"min_count must be >= 1, got {min_count}")
  train, held_out = run.split_corpus(documents, max_tokens, seed)
  if not train or not held_out:
    raise ValueError(f"{len(train)} training and {len(held_out)} held-out tokens: "
                     "the corpus is too small to split")
  counts = collections.Counter(train)
  words = {w for w, c in counts.items() if c >= min_count and w != run.UNK}
  return {"max_tokens": max_tokens, "tokens": len(train) + len(held_out),
          "train_tokens": len(train), "held_out_tokens": len(held_out),
          "train_types": len(counts), "words": len(words), "classes": len(words) + 1,
          "held_out_oov": sum(t not in words for t in held_out) / len(held_out),
          "corpus_types": len(counts | collections.Counter(held_out))}


def describe(stats):
  cap = f"first {stats['max_tokens']:,} tokens" if stats["max_tokens"] else "all"
  return (f"{cap}: {stats['tokens']:,} tokens ({stats['train_tokens']:,} training), "
          f"{stats['corpus_types']:,} word types ({stats['train_types']:,} in training), "
          f"{stats['words']:,} seen at least twice in training, V={stats['classes']:,} "
          f"classes with <unk>, held-out OOV {100 * stats['held_out_oov']:.2f}%")


def main(argv=None):
  p = argparse.ArgumentParser(prog="python -m tf_hsm.bench.corpora",
                              description=__doc__.split("\n\n")[0])
  p.add_argument("names", nargs="+", metavar="NAME", help=", ".join(NAMES))
  p.add_argument("--out", default=DEFAULT_OUT,
                 help="directory for NAME.txt and NAME.json (default: %(default)s)")
  p.add_argument("--cache", default=None,
                 help="directory for the downloaded .deb files and their unpacked trees "
                      "(default: OUT/debs)")
  args = p.parse_args(argv)
  unknown = [n for n in args.names if n not in NAMES]
  if unknown:
    p.error(f"unknown corpus {', '.join(unknown)}: NAME is one of {', '.join(NAMES)}")
  from tf_hsm.demo import run  # pylint: disable=g-import-not-at-top
  os.makedirs(args.out, exist_ok=True)
  for name in args.names:
    path = corpus_file(name, args.out, args.cache or os.path.join(args.out, "debs"))
    documents = run.file_documents(path) if path else run.stdlib_documents()
    caps = CAPS if name in LARGE_CORPORA else (0,)
    stats = [corpus_statistics(documents, cap) for cap in caps]
    packages = []
    if os.path.exists(os.path.join(args.out, f"{name}.packages.json")):
      with open(os.path.join(args.out, f"{name}.packages.json")) as f:
        packages = json.load(f)
    with open(os.path.join(args.out, f"{name}.json"), "w") as f:
      json.dump({"corpus": name, "file": path, "documents": len(documents),
                 "packages": packages, "statistics": stats}, f, indent=2)
    print(f"{name}: {path or 'the standard library'}, {len(documents):,} documents"
          + (f" ({'; '.join(packages)})" if packages else ""), flush=True)
    for s in stats:
      print("  " + describe(s), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
