"""Sizing a model's output layer before training, in NumPy: no TensorFlow is imported
unless the machine is measured.

- candidates.py: `plan` (a `Report`: one row per candidate layer, the one to use and
  its `Layer`, ready to construct) and `recommend_tree`; tree_candidates.py: the tree and
  mixture names they take, each priced from its shape, built on demand;
- costs.py: a step's work (`Cost`) for full, sampled, hierarchical and adaptive softmax;
  tree_work.py: what a tree's paths cost a step (`TreeWork`), from its shape alone
  (`huffman_work`, `layout_work`) so that 10M-class trees are priced without building;
- pricing.py: a `Cost`'s bytes, peak and step time on a `Machine`;
- machine.py: `Machine`, the measured rates (cached by machine name, measured only
  when missing or asked); step_fit.py: tf_hsm's
  training step fitted on this machine (measured with TensorFlow);
- cutoffs.py: an adaptive softmax's cutoffs, chosen for the step time, and
  `checked_counts`, the class frequencies' validation;
- body.py: the rest of a Keras model (`plan(model=...)`): its layers' parameters,
  FLOPs, activations and step time, by duck typing (no Keras imported);
- quality.py: each layer's measured perplexity against full softmax (the evidence);
- cli.py, __main__.py: `python -m tf_hsm.planning`.

Start at candidates.py.
"""

from tf_hsm.planning.body import Body, body_cost, body_price
from tf_hsm.planning.candidates import (CONTEXT_TREES, HSM_TREES, MIXTURE_TREES,
                                        QUALITY_MARGIN, QUALITY_TIE, STEP_TIE, TREES,
                                        Layer, Report, plan, recommend_tree)
from tf_hsm.planning.cli import main, parse_bytes, parse_count
from tf_hsm.planning.costs import (CALLS_PER_STEP, DIV_VALUE, DTYPE_BYTES, OPTIMIZERS,
                                   SAMPLED, STEP_WORKSPACE_BYTES, TAILS, Cost, Part,
                                   adaptive_cluster_cost, adaptive_cost,
                                   adaptive_head_cost, flat_softmax_cost, full_softmax_cost,
                                   mixture_cost,
                                   moved_elements, pytorch_cutoffs, sampled_softmax_cost, tail_widths,
                                   tree_cost)
from tf_hsm.planning.cutoffs import checked_counts, choose_cutoffs, step_cost
from tf_hsm.planning.machine import Machine, machine_name
from tf_hsm.planning.quality import EVIDENCE, quality_of
from tf_hsm.planning.pricing import fixed_step_terms, price, step_terms
from tf_hsm.planning.tree_work import (TREE_STEP_TERMS, WALK_MAX_BRANCHING, TreeWork,
                                       huffman_work, layout_work, tree_bytes,
                                       tree_step_terms, work_of_tree)

__all__ = [
    "Body", "CONTEXT_TREES", "EVIDENCE", "HSM_TREES", "MIXTURE_TREES", "QUALITY_MARGIN",
    "QUALITY_TIE", "body_cost",
    "body_price", "quality_of", "CALLS_PER_STEP", "Cost", "DIV_VALUE", "DTYPE_BYTES", "Layer", "Machine", "OPTIMIZERS",
    "Part", "Report", "SAMPLED", "STEP_TIE", "STEP_WORKSPACE_BYTES", "TAILS", "TREES",
    "TREE_STEP_TERMS", "TreeWork", "WALK_MAX_BRANCHING", "adaptive_cluster_cost",
    "adaptive_cost", "adaptive_head_cost", "checked_counts", "choose_cutoffs",
    "fixed_step_terms", "flat_softmax_cost", "full_softmax_cost", "huffman_work", "layout_work",
    "machine_name", "main", "mixture_cost", "moved_elements", "parse_bytes", "parse_count", "plan",
    "price", "pytorch_cutoffs", "recommend_tree", "sampled_softmax_cost", "step_cost",
    "step_terms", "tail_widths", "tree_bytes", "tree_cost", "tree_step_terms",
    "work_of_tree",
]
