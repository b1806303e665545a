"""Runs an exported SavedModel (or its TFLite conversion) in a process that cannot import
tf_hsm: run as `python -I serving_load.py MODE MODEL INPUTS.npz OUTPUTS.npz`.

MODE: "tf" (tf.saved_model.load, the signatures called as they are), "xla" (each
signature called inside tf.function(jit_compile=True)) or "litert" (a .tflite file run by
LiteRT's interpreter; TensorFlow is not imported).

INPUTS.npz holds `<signature>/<input name>` arrays; every signature named there is run
and its outputs written to OUTPUTS.npz as `<signature>/<output name>`. An error of a
signature call is written as `<signature>/error` (its type and message) instead. Keys
may start with a case name, `<case>/<signature>/<input name>`: each case is one call
(many bad inputs in one process), its outputs keyed `<case>/<signature>/...`; in LiteRT
each call gets a fresh interpreter, whose error messages would otherwise pile up.
Before anything else the script takes every sys.path entry holding a tf_hsm package away
(the venv's .pth file puts the repository there) and checks that `import tf_hsm` fails;
at the end it checks that no _hsm_ops.so is among the process's mapped files.
"""

import os
import sys

sys.path[:] = [p for p in sys.path
               if not os.path.isdir(os.path.join(p or os.getcwd(), "tf_hsm"))]

import numpy as np  # noqa: E402


def _no_tf_hsm():
  try:
    import tf_hsm  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
  except ImportError:
    return
  raise SystemExit("tf_hsm is importable in the serving process")


def _maps_clean():
  with open("/proc/self/maps") as f:
    maps = f.read()
  if "_hsm_ops" in maps:
    raise SystemExit("the op library is mapped into the serving process")


def _split(arrays):
  """{call key: {input name: array}}; a call key is `signature` or `case/signature`."""
  by_call = {}
  for key, value in arrays.items():
    call, name = key.rsplit("/", 1)
    by_call.setdefault(call, {})[name] = value
  return by_call


def run_tf(model, requests, jit):
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  loaded = tf.saved_model.load(model)
  results = {}
  for call_key, inputs in requests.items():
    signature = call_key.rsplit("/", 1)[-1]
    fn = loaded.signatures[signature]
    call = tf.function(lambda kw, fn=fn: fn(**kw), jit_compile=True) if jit else \
        (lambda kw, fn=fn: fn(**kw))
    try:
      outputs = call({k: tf.constant(v) for k, v in inputs.items()})
    except Exception as e:  # pylint: disable=broad-except
      results[f"{call_key}/error"] = np.array(f"{type(e).__name__}: {e}"[:2000])
      continue
    for name, value in outputs.items():
      results[f"{call_key}/{name}"] = value.numpy()
  return results


def run_litert(model, requests):
  from ai_edge_litert.interpreter import Interpreter  # pylint: disable=import-outside-toplevel
  results = {}
  for call_key, inputs in requests.items():
    signature = call_key.rsplit("/", 1)[-1]
    try:
      runner = Interpreter(model_path=model).get_signature_runner(signature)
      outputs = runner(**inputs)
    except Exception as e:  # pylint: disable=broad-except
      results[f"{call_key}/error"] = np.array(f"{type(e).__name__}: {e}"[:2000])
      continue
    for name, value in outputs.items():
      results[f"{call_key}/{name}"] = np.array(value)
  if "tensorflow" in sys.modules:
    raise SystemExit("the LiteRT run imported TensorFlow")
  return results


def main(argv):
  mode, model, inputs_path, outputs_path = argv[1:5]
  _no_tf_hsm()
  with np.load(inputs_path) as f:
    requests = _split(dict(f.items()))
  if mode == "litert":
    results = run_litert(model, requests)
  else:
    results = run_tf(model, requests, jit=(mode == "xla"))
  _maps_clean()
  np.savez(outputs_path, **results)
  print("serving_load: ok", mode, sorted(results))


if __name__ == "__main__":
  main(sys.argv)
