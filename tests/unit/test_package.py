"""The package's shape: the import graph points one way (no cycles, the layers in
order), the NumPy-only parts load without TensorFlow, and every public name and old
module path still resolves."""

import ast
import importlib
import os
import subprocess
import sys

import pytest

from support import REPO

PACKAGE = os.path.join(REPO, "tf_hsm")
# Who may import whom (module-level imports): a subpackage's allowed tf_hsm targets.
# tree <- ops <- distribute <- frontend <- keras, tf_keras; tree <- planning;
# frontend, keras -> planning (AdaptiveSoftmax's cutoffs); frontend -> serving (stock ops,
# the adaptive class order); serving imports nothing
# of tf_hsm (stock TensorFlow only);
# the commands (bench, demo, cluster) import the library, never the reverse.
ALLOWED = {
    "tree": {"tree"},
    "ops": {"tree", "ops"},
    "distribute": {"tree", "ops", "distribute"},
    "planning": {"tree", "planning"},
    "frontend": {"tree", "ops", "distribute", "planning", "serving", "frontend"},
    "keras": {"tree", "ops", "distribute", "frontend", "planning", "keras"},
    "tf_keras": {"tree", "ops", "distribute", "frontend", "planning", "tf_keras"},
    "serving": {"tree", "serving"},
}
LIBRARY = set(ALLOWED)


def _modules():
  for root, _, files in os.walk(PACKAGE):
    for name in files:
      if name.endswith(".py"):
        path = os.path.join(root, name)
        parts = os.path.relpath(path, REPO)[:-3].split(os.sep)
        if parts[-1] == "__init__":
          parts = parts[:-1]
        yield ".".join(parts), path


def _resolve(name, known):
  """The module an import of `name` loads (a name inside a module: that module)."""
  while name not in known and "." in name:
    name = name.rsplit(".", 1)[0]
  return name


def _imports(path, module, known, top_level_only):
  tree = ast.parse(open(path).read())
  nodes = tree.body if top_level_only else list(ast.walk(tree))
  if top_level_only:  # imports under `if` / `try` at module level run at import too
    nodes = [n for stmt in tree.body for n in ast.walk(stmt)
             if not isinstance(stmt, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))]
  targets = set()
  for node in nodes:
    if isinstance(node, ast.Import):
      targets |= {_resolve(a.name, known) for a in node.names}
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      for alias in node.names:
        full = f"{node.module}.{alias.name}"
        targets.add(full if full in known else _resolve(node.module, known))
  return {t for t in targets if t.startswith("tf_hsm") and t != module}


def _graph(top_level_only):
  modules = dict(_modules())
  graph = {}
  for module, path in modules.items():
    edges = set()
    for target in _imports(path, module, modules, top_level_only):
      # Importing a.b.c runs a/__init__ and a/b/__init__ first, unless the importer
      # is inside them (they are running already).
      parts = target.split(".")
      edges |= {".".join(parts[:i]) for i in range(2, len(parts) + 1)
                if not (module + ".").startswith(".".join(parts[:i]) + ".")}
    graph[module] = edges - {"tf_hsm", module}  # the root resolves its names lazily
  return graph


def _cycle(graph):
  state, stack = {}, []

  def visit(node):
    state[node] = "open"
    stack.append(node)
    for nxt in sorted(graph.get(node, ())):
      if state.get(nxt) == "open":
        return stack[stack.index(nxt):] + [nxt]
      if nxt not in state:
        found = visit(nxt)
        if found:
          return found
    state[node] = "done"
    stack.pop()
    return None

  for node in sorted(graph):
    if node not in state:
      found = visit(node)
      if found:
        return found
  return None


@pytest.mark.parametrize("top_level_only", [True, False], ids=["module-level", "all"])
def test_no_import_cycle(top_level_only):
  cycle = _cycle(_graph(top_level_only))
  assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_library_layers_point_one_way():
  wrong = []
  for module, edges in _graph(top_level_only=True).items():
    parts = module.split(".")
    if len(parts) < 2 or parts[1] not in LIBRARY or parts[-1] == "__main__":
      continue  # a command's entry point is imported by nothing: it may run any tool
    for target in edges:
      layer = target.split(".")[1]
      if layer not in ALLOWED[parts[1]]:
        wrong.append(f"{module} imports {target}")
  assert not wrong, "\n".join(wrong)


def test_numpy_parts_load_without_tensorflow():
  # TensorFlow and Keras made unimportable: the tree and the planner still work.
  code = (
      "import sys\n"
      "sys.modules.update(tensorflow=None, keras=None)\n"
      "import numpy as np, tf_hsm, tf_hsm.tree, tf_hsm.planning\n"
      "tree = tf_hsm.Tree.huffman(np.arange(1000, 0, -1), branching=8)\n"
      "machine = dict(matmul_flops=1e11, read_bytes=1e10, call_seconds=1e-4)\n"
      "report = tf_hsm.plan(1000, 64, 256, machine=machine)\n"
      "assert report.rows and callable(tf_hsm.plan)\n"
      "print('ok')\n")
  result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
  assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


def test_plan_stays_the_function_after_the_command_is_imported():
  import tf_hsm  # pylint: disable=import-outside-toplevel
  importlib.import_module("tf_hsm.planning.__main__".rsplit(".", 1)[0])
  assert callable(tf_hsm.plan) and tf_hsm.plan.__module__ == "tf_hsm.planning.candidates"
  with pytest.raises(ModuleNotFoundError):
    importlib.import_module("tf_hsm.plan")


PUBLIC = ["log_prob", "nll_loss", "sgd_step", "top_k", "log_prob_all", "sample",
          "log_prob_candidates", "Tree", "HierarchicalSoftmax", "AdaptiveSoftmax", "plan",
          "optimizers", "losses", "callbacks", "metrics", "distribute", "inference",
          "planner", "baselines", "serving", "keras", "tf_keras", "inference_model"]


@pytest.mark.parametrize("name", PUBLIC)
def test_public_names_resolve(name):
  import tf_hsm  # pylint: disable=import-outside-toplevel
  assert getattr(tf_hsm, name) is not None


@pytest.mark.parametrize("old, new, name", [
    ("tf_hsm.layers", "tf_hsm.keras.layers", "HierarchicalSoftmax"),
    ("tf_hsm.adaptive", "tf_hsm.keras.adaptive", "AdaptiveSoftmax"),
    ("tf_hsm.optimizers", "tf_hsm.keras.optimizers", "LazyAdam"),
    ("tf_hsm.losses", "tf_hsm.keras.losses", "nll"),
    ("tf_hsm.callbacks", "tf_hsm.keras.callbacks", "RebuildTree"),
    ("tf_hsm.metrics", "tf_hsm.keras.metrics", "Perplexity"),
    ("tf_hsm.inference", "tf_hsm.ops.inference", "top_k"),
    ("tf_hsm.planner", "tf_hsm.planning", "recommend_tree"),
    ("tf_hsm.baselines", "tf_hsm.bench.baselines", "full_softmax_log_prob"),
])
def test_old_module_paths_are_the_new_modules(old, new, name):
  module = importlib.import_module(old)
  assert module is importlib.import_module(new)
  assert module.__spec__.name == new and hasattr(module, name)


def test_the_tf_keras_front_end_without_tf_keras_says_how_to_get_it():
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  code = ("import sys; sys.modules['tf_keras'] = None\n"
          "try:\n  import tf_hsm.tf_keras\nexcept ImportError as e:\n  print(e)\n")
  done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                        timeout=300, check=True)
  assert "pip install tf-keras" in done.stdout and "tf_hsm[tf_keras]" in done.stdout
