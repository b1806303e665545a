"""A step's price on a `Machine`: bytes, peak memory and step time of a `Cost`
(`price`), and the parts of the step time that add up over the tiers of an adaptive
softmax (`step_terms`, `fixed_step_terms`), which the cutoff search sums."""

import numbers
import re

import numpy as np

from tf_hsm.planning import machine as machine_lib
from tf_hsm.planning.costs import (CALLS_PER_STEP, DTYPE_BYTES, OPTIMIZERS,
                                   STEP_WORKSPACE_BYTES, moved_elements, slot_elements)
from tf_hsm.planning.tree_work import tree_step_terms


def parse_bytes(text):
  """'24GiB' -> 24 * 2**30, '12GB' -> 12e9, '512MiB', '1000' (bytes)."""
  match = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]?)(i?)B?\s*", str(text), re.IGNORECASE)
  if not match:
    raise ValueError(f"not a size: {text!r}")
  power = " KMGT".index(match.group(2).upper() or " ")
  base = 1024 if match.group(3) else 1000
  return int(float(match.group(1)) * base**power)


def memory_budget_bytes(budget):
  """`plan`'s memory_budget as bytes: None, a number of bytes, or a size as the command
  line takes it ('24GiB')."""
  if budget is None:
    return None
  value = budget
  if isinstance(budget, str):
    try:
      value = parse_bytes(budget)
    except ValueError:
      pass
  elif isinstance(budget, (np.ndarray, np.generic)) and np.ndim(budget) == 0:
    value = budget.item()
  if isinstance(value, numbers.Real) and not isinstance(value, bool) and value > 0:
    return value
  raise ValueError(f"memory_budget must be bytes > 0 or a size such as '24GiB', '12GB' "
                   f"or '512MiB', got {budget!r}")


def _bytes_and_slot_bytes(parts, optimizer, dtype_bytes):
  """(bytes a step moves for `parts` but their slots', the slots' read and write)."""
  slot = sum(slot_elements(p, optimizer) for p in parts) * dtype_bytes
  moved = sum(moved_elements(p, optimizer) for p in parts) * dtype_bytes
  return moved - slot, slot


def step_terms(cost, optimizer, dtype, machine):
  """The parts of a step's time that add over the pieces of a layer (NumPy arrays
  broadcast): (FLOPs / matmul rate, bytes moved / read bandwidth, softmax, call and
  tree seconds). A step takes max(first, second + hidden states) + third +
  CALLS_PER_STEP calls (`price`); a search over layouts adds them up tier by tier.
  On a machine with a fitted `tree_step`, the work of a tree's table (a two-level
  tail's) is priced by that fit in the third term, not by the roofline: it runs in
  tf_hsm's op, not in a matmul (its fixed cost is the call's)."""
  b = DTYPE_BYTES[dtype]
  fitted = machine.tree_step is not None and any(p.tree for p in cost.parts)
  moved = sum(moved_elements(p, optimizer) for p in cost.parts
              if not (fitted and p.tree)) * b
  flops = cost.flops - (cost.tree_flops if fitted else 0.0)
  other = (cost.softmax_logits * machine.softmax_seconds +
           cost.sampled_logits * machine.sampled_logit_seconds +
           cost.calls * machine.call_seconds)
  if fitted:
    tree_moved, slots = _bytes_and_slot_bytes([p for p in cost.parts if p.tree],
                                              optimizer, b)
    amounts = tree_step_terms(cost.tree_flops, cost.small_node_flops, tree_moved,
                              cost.node_visits, cost.children_scored, slots)[:-1]
    other = other + sum(c * a for c, a in zip(machine.tree_step, amounts))
  return flops / machine.matmul_flops, moved / machine.read_bytes, other


def fixed_step_terms(hidden, tokens_per_step, dtype, machine):
  """What every layer's step adds to `step_terms`: the hidden states and their gradient
  (bytes seconds), and CALLS_PER_STEP calls."""
  moved = 2 * int(tokens_per_step) * int(hidden) * DTYPE_BYTES[dtype]
  return moved / machine.read_bytes, CALLS_PER_STEP * machine.call_seconds


def price(method, cost, hidden, tokens_per_step, optimizer="sgd", dtype="float32",
          machine=None, memory_budget=None, num_shards=1, exact=True):
  """A planner row (a dict of bytes, FLOPs and seconds) for one layer's `Cost`.

  Per step: the touched elements read by the forward and the backward, their gradient
  written, the optimizer's read-modify-write of the elements and their slots (every
  element of a part whose update is dense), plus the hidden states and their gradient.
  Step time: max(FLOPs / matmul rate, bytes / read bandwidth) + the softmax
  cross-entropy's time per logit + CALLS_PER_STEP calls (and the layer's own); for a
  tree's row on a machine with a fitted `tree_step`, that fit's FLOPs, bytes moved, node
  visits and fixed cost instead (its op and sparse update do not run at the roofline).
  The peak adds a tree's index arrays and STEP_WORKSPACE_BYTES to the tensors.
  """
  if optimizer not in OPTIMIZERS:
    raise ValueError(f"optimizer must be one of {sorted(OPTIMIZERS)}, got {optimizer!r}")
  if dtype not in DTYPE_BYTES:
    raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {dtype!r}")
  machine = machine_lib.resolve(machine)
  b = DTYPE_BYTES[dtype]
  slots = OPTIMIZERS[optimizer]
  elements = sum(p.elements for p in cost.parts)
  grad_elements = sum(p.elements if p.dense_grad else p.touched for p in cost.parts)
  param, grad = elements * b, grad_elements * b
  slot = slots * param
  activation_bytes = cost.activations * b
  peak = param + grad + slot + activation_bytes + cost.tree_bytes + STEP_WORKSPACE_BYTES
  table_moved, slot_moved = _bytes_and_slot_bytes(cost.parts, optimizer, b)
  moved = table_moved + slot_moved + 2 * int(tokens_per_step) * int(hidden) * b
  if machine.tree_step is not None and cost.parts and all(p.tree for p in cost.parts):
    # tf_hsm's op and sparse update, as fitted to its steps on this machine.
    seconds = float(np.dot(machine.tree_step,
                           tree_step_terms(cost.flops, cost.small_node_flops,
                                           moved - slot_moved, cost.node_visits,
                                           cost.children_scored, slot_moved)))
  else:
    flop_seconds, byte_seconds, other_seconds = step_terms(cost, optimizer, dtype, machine)
    hidden_seconds, call_seconds = fixed_step_terms(hidden, tokens_per_step, dtype,
                                                    machine)
    seconds = (max(flop_seconds, byte_seconds + hidden_seconds) + other_seconds +
               call_seconds)
  per_shard = (param + slot) / num_shards + (
      grad + activation_bytes + cost.tree_bytes + STEP_WORKSPACE_BYTES
      if num_shards == 1 else 0)
  budget_bytes = per_shard if num_shards > 1 else peak
  return {"method": method, "param_bytes": param, "grad_bytes": grad, "slot_bytes": slot,
          "activation_bytes": activation_bytes, "tree_bytes": cost.tree_bytes,
          "node_visits": cost.node_visits, "small_node_flops": cost.small_node_flops,
          "children_scored": cost.children_scored,
          "peak_bytes": peak,
          "per_shard_bytes": per_shard, "rows_touched": cost.rows_touched,
          "flops": cost.flops, "bytes_moved": moved, "slot_bytes_moved": slot_moved,
          "softmax_logits": cost.softmax_logits, "sampled_logits": cost.sampled_logits,
          "step_seconds": seconds,
          "fits": memory_budget is None or budget_bytes <= memory_budget, "exact": exact}
