"""Every repository path that the documents, build files, shell scripts and source
comments name exists, so that a moved file leaves no pointer to where it was.

A path is a word with a slash whose first part is an entry of the repository's top
level (`tf_hsm/ops/loader.py`, `cc/BUILD`, `./configure.sh`) or of the naming file's
folder (`core/log_prob.h` in cc/README.md), or a Markdown link's target. It passes when
it exists (a glob such as `cc/core/*.cu` when something matches) or is generated:
ignored by git (`tf_hsm/_hsm_ops.so`, `dist/...`, `.venv/...`, `demo_results/...`) or
under Bazel's output links (`bazel-bin/...`). Prose (`CPU/GPU`, `keras-team/keras#20585`)
names no repository entry, and URLs are dropped, so neither is read as a path. In Python
and C++ files only comments and docstrings are read: the code's strings are checked by
running it.
"""

import glob
import io
import os
import re
import subprocess
import tokenize

import support

ROOT = support.REPO
_URL = re.compile(r"\w+://\S+")
# A slash-separated word; not the tail of a longer one, an absolute path, a $VAR/... or
# an escaped regex (`\./configure\.sh`).
_PATH = re.compile(r"(?<![\w./@$\\-])((?:\.\.?/)*[\w.*-]+(?:/[\w.*-]+)+/?)")
# A Markdown link to a file: [text](target) with a file name or a folder as target.
_LINK = re.compile(r"\]\(([\w./-]+?(?:\.\w+|/))(?:#[\w-]*)?\)")
_C_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)
_WHOLE = re.compile(r"(\.(md|sh|bzl)|(^|/)BUILD|^\.ci/run)$")
_C_SOURCE = re.compile(r"\.(cc|h|cu|cuh)$")


def _files():
  """The files git tracks, and the new ones it does not ignore; third_party/ is vendored."""
  listing = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                           cwd=ROOT, capture_output=True, text=True, check=True).stdout
  return sorted({f for f in listing.split("\n") if f and not f.startswith("third_party/")})


def _python_prose(text):
  """The comments and docstrings (triple-quoted strings) of Python source `text`."""
  words = []
  for token in tokenize.generate_tokens(io.StringIO(text).readline):
    quoted = token.type == tokenize.STRING and token.string.lstrip("rbfuRBFU")[:3] in (
        '"""', "'''")
    if token.type == tokenize.COMMENT or quoted:
      words.append((token.start[0], token.string))
  return words


def _c_prose(text):
  """The comments of C++ or CUDA source `text`, with the line each starts on."""
  return [(text.count("\n", 0, m.start()) + 1, m.group()) for m in _C_COMMENT.finditer(text)]


def _prose(name, text):
  """(line, text) pieces of the file `name` to read paths in: all of it for documents,
  build files and scripts; comments and docstrings for Python and C++."""
  if name.endswith(".py"):
    return _python_prose(text)
  if _C_SOURCE.search(name):
    return _c_prose(text)
  if _WHOLE.search(name) or text.startswith("#!"):
    return [(1, text)]
  return []


def _generated(path):
  """Whether `path` (relative to the repository) is a build output or other generated
  file, which need not exist: under Bazel's links, or ignored by git."""
  if path.split("/")[0].startswith("bazel-"):
    return True
  return subprocess.run(["git", "check-ignore", "-q", "--no-index", path], cwd=ROOT,
                        check=False).returncode == 0


def _exists(path):
  full = os.path.join(ROOT, path)
  return bool(glob.glob(full)) if "*" in path else os.path.exists(full)


def _resolutions(folder, path, top):
  """The repository-relative paths `path`, named in a file in `folder`, may mean: from
  the top level, from `folder`, both, or none (then it is prose)."""
  first = path.split("/")[0]
  bases = []
  if first in top or first == ".":
    bases.append("")
  if first in (".", "..") or os.path.exists(os.path.join(ROOT, folder, first)):
    bases.append(folder)
  # A regex's `.*` (Bazel's per-file flags) reads as a glob's `*`.
  return [os.path.normpath(os.path.join(b, path.replace(".*", "*"))) for b in bases]


def _dangling_in(name, text, top):
  """(line, path) for each path named in file `name` (whose content is `text`) that
  neither exists nor is generated."""
  folder = os.path.dirname(name)
  found = []
  for start, piece in _prose(name, text):
    for offset, line in enumerate(_URL.sub(" ", piece).split("\n")):
      words = [w.rstrip(".,;:") for w in _PATH.findall(line)]
      meant = [(w, _resolutions(folder, w, top)) for w in words]
      found += [(start + offset, w) for w, paths in meant
                if paths and not any(_exists(p) or _generated(p) for p in paths)]
      if name.endswith(".md"):
        found += [(start + offset, target) for target in _LINK.findall(line)
                  if not _exists(os.path.normpath(os.path.join(folder, target)))]
  return found


def test_every_path_named_exists():
  files = _files()
  top = {f.split("/")[0] for f in files}
  dangling = []
  for name in files:
    with open(os.path.join(ROOT, name), encoding="utf-8", errors="replace") as f:
      dangling += [f"{name}:{line}: {path}" for line, path in _dangling_in(name, f.read(), top)]
  assert not dangling, "paths that name no file of the repository:\n" + "\n".join(dangling)


def test_moved_files_are_found_and_prose_is_not():
  top = {"tf_hsm", "tests", "cc", "docs", "configure.sh"}
  doc = ("The loader (tf_hsm/_loader.py, now tf_hsm/ops/loader.py) and tests/test_cc_core.py;\n"
         "[usage](usage.md), [gone](moved.md), see ../configure.sh, ../cc/BUILD, ./cc/BUILD.\n"
         "CPU/GPU, keras-team/keras#20585, https://github.com/a/b/c.py, /proc/cpuinfo,\n"
         "bazel-bin/cc/_hsm_ops.so, tf_hsm/_hsm_ops.so, cc/core/*.cu, cc/nothing/*.cc\n")
  assert _dangling_in("docs/x.md", doc, top) == [
      (1, "tf_hsm/_loader.py"), (1, "tests/test_cc_core.py"), (2, "moved.md"),
      (4, "cc/nothing/*.cc")]
  source = ('"""Reads tf_hsm/tree.py."""\nPATH = "tf_hsm/tree.py"  # see tests/serving_load.py\n')
  assert _dangling_in("tf_hsm/x.py", source, top) == [(1, "tf_hsm/tree.py"),
                                                       (2, "tests/serving_load.py")]
  header = '// Mirrors tf_hsm/tree.py.\nconst char* p = "tf_hsm/tree.py";\n/* see core/log_prob.h */'
  assert _dangling_in("cc/x.h", header, top) == [(1, "tf_hsm/tree.py")]
