"""`python -m tf_hsm.cluster`: a loopback ParameterServerStrategy cluster of processes
(`LoopbackCluster`, which the tests use too) and a training run on it (loopback.py)."""

from tf_hsm.cluster.loopback import (LoopbackCluster, main, partitioned_table,
                                     peak_rss_bytes, report, serve, train, zipf_tree)

__all__ = ["LoopbackCluster", "main", "partitioned_table", "peak_rss_bytes", "report",
           "serve", "train", "zipf_tree"]
