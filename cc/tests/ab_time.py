"""Times two op libraries on the bench's training scenarios, interleaved.

A change to cc/ that should cost nothing (a refactor, a split) is timed against the
library before it: one worker process per library, both alive at once; for each case both
build the same inputs (tf_hsm.bench.cases: the scenario's trees, Zipf targets, seed 0),
then the driver asks them in turn for a few timed steps, swapping who goes first each
round, so both builds see the same load. Fresh worker pairs (--pairs) spread what one
process's memory layout or thread placement adds. Per case and function (log_prob's
forward, the forward and backward of -mean(log_prob), and sgd_step where the scenario
times it): each build's median and 10th percentile in ms, and new/old.

    cp tf_hsm/_hsm_ops.so /tmp/old_hsm_ops.so          # before the change
    ./configure.sh                                        # after it
    .venv/bin/python cc/tests/ab_time.py --old /tmp/old_hsm_ops.so --scenario B D E

The libraries are loaded as bit_hash.py loads them (a copy of the package with the
library beside it); give one --package, a copy of tf_hsm/ taken once, when the Python
package may change between the two builds.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(os.path.dirname(_HERE))


def _cases(scenarios):
  """(label, scenario, vocab, dim, tokens, tree kind, with sgd_step) for each scenario's
  first vocabulary size, every batch size and every tree."""
  sys.path.insert(0, _REPO)
  from tf_hsm.bench import cases  # pylint: disable=import-outside-toplevel
  out = []
  for name in scenarios:
    s = cases.FULL_SCENARIOS[name]
    for t in s.tokens:
      for kind in s.trees:
        label = f"{name} V={s.vocab[0]} D={s.dim} T={t} {kind}"
        out.append((label, s.vocab[0], s.dim, t, kind, cases.FUSED_SGD in s.methods))
  return out


def _functions(tf, tf_hsm, cases, case):
  """{name: tf.function} for one case, on inputs built as the bench builds them."""
  _, v, d, t, kind, with_sgd = case
  tree = cases.build_tree(kind, v)
  y = tf.constant(cases.zipf_targets(v, t, 0))
  h = tf.random.stateless_normal([t, d], seed=[0, 1])
  w = tf.Variable(tf.raw_ops.StatelessRandomUniform(shape=[tree.num_slots, d], seed=[2, 0],
                                                    dtype=tf.float32))
  b = tf.Variable(tf.zeros([tree.num_slots]))

  def first_row_sum(g):  # the bench's checksum: no table-sized copy to the host is timed
    return tf.reduce_sum((g.values if isinstance(g, tf.IndexedSlices) else g)[:1])

  @tf.function
  def step():
    with tf.GradientTape() as tape:
      tape.watch(h)
      loss = -tf.reduce_mean(tf_hsm.log_prob(h, w, b, tree, y))
    dh, dw, db = tape.gradient(loss, [h, w, b])
    return loss, dh, first_row_sum(dw), first_row_sum(db)

  fns = {"fwd": tf.function(lambda: tf_hsm.log_prob(h, w, b, tree, y)), "fwd+bwd": step}
  if with_sgd:
    w2, b2 = tf.Variable(w), tf.Variable(b)
    fns["sgd_step"] = tf.function(lambda: tf_hsm.sgd_step(h, w2, b2, tree, y, 1e-3))
  return fns


def _worker(lib, package, scenarios):
  """Answers the driver's JSON lines on stdin: {"setup": i} builds case i (and answers its
  function names), {"fn": name, "reps": n} answers n step times in seconds."""
  sys.path.insert(0, _HERE)
  import bit_hash  # pylint: disable=import-outside-toplevel
  tf_hsm = bit_hash._import_tf_hsm(lib, package)  # pylint: disable=protected-access
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  from tf_hsm.bench import cases  # pylint: disable=import-outside-toplevel
  all_cases = _cases(scenarios)
  force = lambda out: tf.nest.map_structure(lambda x: x.numpy(), out)
  fns = {}
  for line in sys.stdin:
    cmd = json.loads(line)
    if "setup" in cmd:
      fns = _functions(tf, tf_hsm, cases, all_cases[cmd["setup"]])
      for fn in fns.values():
        for _ in range(3):  # traced, warm
          force(fn())
      reply = list(fns)
    else:
      reply = []
      for _ in range(cmd["reps"]):
        start = time.perf_counter()
        force(fns[cmd["fn"]]())
        reply.append(time.perf_counter() - start)
    print(json.dumps(reply), flush=True)


def _run_pair(args, libs, samples, pair):
  """One fresh worker per build, every case, args.rounds turns each."""
  cmd = [sys.executable, os.path.abspath(__file__), "--package", args.package, "--scenario",
         *args.scenario, "--worker"]
  procs = {b: subprocess.Popen(cmd + [lib], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL, text=True)
           for b, lib in libs.items()}

  def ask(build, request):
    procs[build].stdin.write(json.dumps(request) + "\n")
    procs[build].stdin.flush()
    answer = procs[build].stdout.readline()
    if not answer:
      raise RuntimeError(f"the {build} worker ended (run it alone to see why)")
    return json.loads(answer)

  for c, case in enumerate(_cases(args.scenario)):
    names = [ask(b, {"setup": c}) for b in libs][0]
    for name in names:
      got = samples.setdefault(f"{case[0]} {name}", {b: [] for b in libs})
      for r in range(args.rounds):
        for b in (("old", "new") if (r + pair) % 2 == 0 else ("new", "old")):
          got[b] += ask(b, {"fn": name, "reps": args.reps})
  for p in procs.values():
    p.stdin.close()
    p.wait()


def _p10(x):
  x = sorted(x)
  return x[int(0.1 * (len(x) - 1))]


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--old", help="the op library before the change")
  parser.add_argument("--new", default=os.path.join(_REPO, "tf_hsm", "_hsm_ops.so"),
                      help="the op library after it (default: tf_hsm/_hsm_ops.so)")
  parser.add_argument("--package", default=os.path.join(_REPO, "tf_hsm"),
                      help="the tf_hsm package directory to load both with")
  parser.add_argument("--scenario", nargs="+", default=["B", "D", "E"],
                      help="bench scenarios (tf_hsm.bench.cases.FULL_SCENARIOS)")
  parser.add_argument("--pairs", type=int, default=2, help="fresh worker pairs, in turn")
  parser.add_argument("--rounds", type=int, default=16, help="turns per case and pair")
  parser.add_argument("--reps", type=int, default=3, help="steps timed per turn")
  parser.add_argument("--out", help="write every sample here (JSON)")
  parser.add_argument("--worker", help=argparse.SUPPRESS)
  args = parser.parse_args()
  args.package = os.path.abspath(args.package)
  if args.worker:
    _worker(args.worker, args.package, args.scenario)
    return
  if not args.old:
    parser.error("--old is required")
  libs = {"old": os.path.abspath(args.old), "new": os.path.abspath(args.new)}
  samples = {}
  for pair in range(args.pairs):
    _run_pair(args, libs, samples, pair)
  if args.out:
    with open(args.out, "w") as f:
      json.dump(samples, f)
  print(f"{'case':52s} {'old med':>8s} {'new med':>8s} {'ratio':>6s} "
        f"{'old p10':>8s} {'new p10':>8s} {'ratio':>6s}")
  for key, got in samples.items():
    mo, mn = statistics.median(got["old"]) * 1e3, statistics.median(got["new"]) * 1e3
    lo, ln = _p10(got["old"]) * 1e3, _p10(got["new"]) * 1e3
    print(f"{key:52s} {mo:8.2f} {mn:8.2f} {mn / mo:6.3f} {lo:8.2f} {ln:8.2f} {ln / lo:6.3f}")


if __name__ == "__main__":
  main()
