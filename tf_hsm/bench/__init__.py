"""The tf_hsm benchmark: `python -m tf_hsm.bench --help` (see `tf_hsm.bench.cli`).

One module per job:
* cli: the command line, the run's options and the report's metadata (`main`);
* runner: listing the cases, building their trees, probing and timing the methods;
* watchdog: worker processes under an RSS watchdog and a time-out;
* worker: one job in a worker process (`python -m tf_hsm.bench.worker SPEC.json`);
* cases: scenarios, method names, trees, Zipf targets and the work of a case
  (NumPy and `tf_hsm.Tree` only, shared by the driver and the workers);
* methods: the TensorFlow side, each method's timed functions and machine ceilings;
* report: statistics, the markdown table, the JSON file and the plot;
* baselines: the competitors in TensorFlow (gather, embedding_lookup, map_fn, a dense
  tree, full and sampled softmax), also `tf_hsm.baselines`;
* plan_verify: the planner's figures beside the bench's measurements
  (`python -m tf_hsm.planning --verify`);
* corpora, quality_runs, quality_torch: the planner's quality evidence (the corpora, the
  demo's runs on the CPU, the same runs in PyTorch on a GPU at 100K+ classes);
* adaptive, keras_fit, shards: `python -m tf_hsm.bench.adaptive` (the adaptive softmax
  against PyTorch's), `.keras_fit` (a `model.fit` step at up to 10M classes),
  `.shards` (rows per shard of balanced layouts).

Nothing is imported here, so that `python -m tf_hsm.bench.worker` starts no more
than the worker needs.
"""
