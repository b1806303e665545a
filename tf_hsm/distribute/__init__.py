"""Training with the table in pieces over `tf.distribute` (sharding.py): the table's
pieces, gradients with respect to a `ShardedVariable`, balanced row layouts, checkpoints
that restore into another number of shards. See docs/distributed.md.
"""

from tf_hsm.distribute.sharding import (RowLayout, balanced_layout, checkpoint, gradients,
                                        pieces, rows_per_shard, split_rows)

__all__ = ["RowLayout", "balanced_layout", "checkpoint", "gradients", "pieces",
           "rows_per_shard", "split_rows"]
