"""The tf_hsm benchmark: `python -m tf_hsm.bench --help` (see `tf_hsm.bench.cli`).

One module per job:
* cli: the command line, the run's options and the report's metadata (`main`);
* runner: listing the cases, building their trees, probing and timing the methods;
* watchdog: worker processes under an RSS watchdog and a time-out;
* worker: one job in a worker process (`python -m tf_hsm.bench.worker SPEC.json`);
* cases: scenarios, method names, trees, Zipf targets and the work of a case
  (NumPy and `tf_hsm.Tree` only, shared by the driver and the workers);
* methods: the TensorFlow side, each method's timed functions and machine ceilings;
* report: statistics, the markdown table, the JSON file and the plot.

Nothing is imported here, so that `python -m tf_hsm.bench.worker` starts no more
than the worker needs.
"""
