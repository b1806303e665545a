"""The op library's Python side: the ops and their registered gradients.

- training.py: `log_prob`, `nll_loss`, `sgd_step` (and the gradients);
- adam_step.py: Hsm>AdamStep, Adam's row update fused as `sgd_step` fuses SGD's
  (`tf_hsm.adam_step`, in tf_hsm/keras/adam_step.py, gives it the optimizer's state);
- inference.py: `top_k`, `log_prob_all`, `sample`, `log_prob_candidates`;
- inputs.py: what they share (the tree's tensors, dtype rules, ragged batches);
- compact.py: the same ops on a table held in pieces;
- loader.py: finds, checks and loads the compiled library (cc/).

Start at training.py.
"""

from tf_hsm.ops.inference import log_prob_all, log_prob_candidates, sample, top_k
from tf_hsm.ops.training import log_prob, nll_loss, sgd_step

__all__ = ["log_prob", "log_prob_all", "log_prob_candidates", "nll_loss", "sample",
           "sgd_step", "top_k"]
