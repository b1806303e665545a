"""What a PyTorch user would run instead of tf_hsm's CUDA kernels, timed on the same GPU.

For the benchmark scenarios B, C and D (docs/performance.md), F (the exact softmax as a
one-node tree, V=100K D=256 T=1,024 and V=1M D=300 T=3,200, against PyTorch's full
softmax only) and M (V=1M D=300 T=3,200, Zipf(1) targets: PyTorch's sampled softmax
beside the harness's mixture cases, a 16-ary tree and a head of 128), this times one
training step's output layer (forward + backward, float32) of
  - full softmax: logits = h @ W^T + b, cross-entropy, backward (OOM is a result);
  - a gather-based HSM: the children rows of every path node gathered into
    [T, depth, max_branching, D] (padded, masked), logsumexp per node, summed over the path;
  - (M) sampled softmax: 1,024 log-uniform samples, as TF's `sampled_softmax_loss`;
on the trees the CUDA harness uses (two-level ~sqrt(V), Huffman binary on Zipf counts), and,
given the JSON lines of `cc/gpu_harness.sh --time-only --json FILE`, prints tf_hsm's
kernels next to them.

Run on a GPU machine with PyTorch (never imported by the tests; needs no TensorFlow):
  cc/gpu_harness.sh --time-only --json /tmp/hsm.json
  python cc/tests/torch_compare.py --harness-json /tmp/hsm.json [--scenarios B,C,D,F,M]
"""

import argparse
import heapq
import json
import time

import numpy as np


def two_level_paths(num_classes, groups):
  """Per-class (node, slot-in-node) paths and per-node (first slot, branching)."""
  bounds = [num_classes * p // groups for p in range(groups + 1)]
  sizes = [b - a for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
  # Node 0 is the root; node g + 1 holds group g (a group of one class is a leaf child).
  node_first, node_k = [0], [len(sizes)]
  paths = [None] * num_classes
  slot = len(sizes)
  c = 0
  for g, size in enumerate(sizes):
    if size == 1:
      paths[c] = [(0, g)]
      c += 1
      continue
    node = len(node_first)
    node_first.append(slot)
    node_k.append(size)
    for j in range(size):
      paths[c] = [(0, g), (node, j)]
      c += 1
    slot += size
  return paths, np.array(node_first), np.array(node_k), slot


def huffman_paths(counts):
  """Binary Huffman tree on counts: per-class paths, per-node (first slot, branching)."""
  heap = [(w, c) for c, w in enumerate(counts)]
  heapq.heapify(heap)
  children = []  # internal node i: its two child codes (>= 0 class, < 0 node -(i+1))
  while len(heap) > 1:
    wa, a = heapq.heappop(heap)
    wb, b = heapq.heappop(heap)
    children.append((a, b))
    heapq.heappush(heap, (wa + wb, -len(children)))
  root = len(children) - 1
  order, new_id = [root], {root: 0}
  for n in order:  # breadth first from the root
    for code in children[n]:
      if code < 0:
        new_id[-code - 1] = len(order)
        order.append(-code - 1)
  node_first = np.arange(len(order)) * 2
  node_k = np.full(len(order), 2)
  paths = [None] * len(counts)
  stack = [(root, [])]
  while stack:
    n, prefix = stack.pop()
    for j, code in enumerate(children[n]):
      step = prefix + [(new_id[n], j)]
      if code >= 0:
        paths[code] = step
      else:
        stack.append((-code - 1, step))
  return paths, node_first, node_k, 2 * len(order)


def padded(paths, node_first, node_k):
  depth = max(len(p) for p in paths)
  c = len(paths)
  first = np.zeros((c, depth), np.int64)
  k = np.zeros((c, depth), np.int64)
  taken = np.zeros((c, depth), np.int64)
  for i, p in enumerate(paths):
    for d, (node, j) in enumerate(p):
      first[i, d], k[i, d], taken[i, d] = node_first[node], node_k[node], j
  return first, k, taken


def sampled_softmax_line(torch, dev, rng, run, hsm, v=1_000_000, d=300, t=3200,
                         num_sampled=1024):
  """Scenario M: one step (forward and backward) of the sampled softmax a PyTorch user
  writes after TF's `sampled_softmax_loss`: `num_sampled` classes drawn log-uniformly,
  shared by the batch, the rows of the targets and the samples gathered at once (as TF
  gathers them), logits less log(num_sampled * P(class)), accidental hits masked,
  cross-entropy over [true, sampled]. TF draws without repeats (`unique=True`) and
  corrects by the expected count of its tries; this draws with repeats: the same work,
  slightly other loss values. With the harness's mixture cases (tf_hsm's kernels)
  beside it."""
  import torch.nn.functional as F  # pylint: disable=import-outside-toplevel
  probs = 1.0 / np.arange(1, v + 1)
  targets = torch.from_numpy(rng.choice(v, size=t, p=probs / probs.sum())).to(dev)
  h = torch.randn(t, d, device=dev, requires_grad=True)
  w = (torch.randn(v, d, device=dev) * 0.05).requires_grad_()
  b = torch.zeros(v, 1, device=dev, requires_grad=True)  # a row a class, as w
  log_range = np.log(v + 1.0)

  def log_expected(ids):  # log(num_sampled * P(id)) under the log-uniform sampler
    ids = ids.double()
    return (torch.log(torch.log((ids + 2) / (ids + 1)) / log_range) +
            np.log(num_sampled)).float()

  target_correction = log_expected(targets)

  def gathered(ids, table, sparse):
    # sparse: the rows' gradient as torch.sparse (F.embedding(sparse=True)), as TF's
    # IndexedSlices; else dense, as table[ids] gives it ([V, D] written each step).
    return F.embedding(ids, table, sparse=True) if sparse else table[ids]

  def sampled_softmax(sparse):
    u = torch.rand(num_sampled, device=dev, dtype=torch.float64)
    sampled = (torch.exp(u * log_range).long() - 1).clamp_(0, v - 1)
    ids = torch.cat([targets, sampled])
    rows, biases = gathered(ids, w, sparse), gathered(ids, b, sparse)[:, 0]
    true_logit = (h * rows[:t]).sum(-1) + biases[:t] - target_correction
    logits = h @ rows[t:].t() + biases[t:] - log_expected(sampled)
    logits = logits.masked_fill(sampled[None, :] == targets[:, None], float("-inf"))
    both = torch.cat([true_logit[:, None], logits], 1)
    F.cross_entropy(both, torch.zeros(t, dtype=torch.long, device=dev)).backward()
    w.grad = b.grad = h.grad = None  # a step's gradients, not their sum over the steps

  line = (f"M V={v} D={d} T={t}: sampled softmax ({num_sampled}), dense gradient "
          f"{run('sampled', lambda: sampled_softmax(False))}, sparse gradient "
          f"{run('sampled', lambda: sampled_softmax(True))}")
  for key in ("mixture_tree16_T3200", "mixture_head129_T3200", "D_two_level_1000_T3200"):
    if key in hsm:
      r = hsm[key]
      line += (f" | tf_hsm {key} {r['forward_ms'] + r['backward_ms']:.3f} ms, host plan "
               f"{r['host_plan_ms']:.2f} ms")
  return line


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--scenarios", default="B,C,D")
  parser.add_argument("--repeats", type=int, default=10)
  parser.add_argument("--warmup", type=int, default=3)
  parser.add_argument("--harness-json", help="JSON lines from gpu_harness --json")
  args = parser.parse_args()

  import torch  # only here: this script is never imported by the tests
  import torch.nn.functional as F

  dev = torch.device("cuda")
  rng = np.random.default_rng(1)
  hsm = {}
  if args.harness_json:
    with open(args.harness_json) as f:
      for line in f:
        r = json.loads(line)
        hsm[r["case"]] = r

  def timed(step):
    for _ in range(args.warmup):
      step()
    torch.cuda.synchronize()
    times = []
    for _ in range(args.repeats):
      start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
      start.record()
      step()
      stop.record()
      torch.cuda.synchronize()
      times.append(start.elapsed_time(stop))
    return float(np.median(times))

  def run(name, fn):
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    try:
      ms = timed(fn)
      peak = torch.cuda.max_memory_allocated() / 2**30
      return f"{ms:9.3f} ms {peak:6.2f} GiB"
    except torch.cuda.OutOfMemoryError:
      return "      OOM            "

  scenarios = {
      "B": (100_000, 512, [640, 2560, 4096], [("two_level_317", 317), ("huffman", None)]),
      "C": (793_471, 512, [320, 2560], [("two_level_891", 891), ("huffman", None)]),
      "D": (1_000_000, 300, [256, 3200, 4096], [("two_level_1000", 1000), ("huffman", None)]),
  }
  print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
        f"TF32 matmul {torch.backends.cuda.matmul.allow_tf32}")
  for s in args.scenarios.split(","):
    if s == "M":
      print(sampled_softmax_line(torch, dev, rng, run, hsm), flush=True)
      continue
    if s == "F":
      for v, d, t, key in [(100_000, 256, 1024, "F_flat_V100K_T1024"),
                           (1_000_000, 300, 3200, "F_flat_V1M_T3200")]:
        h = torch.randn(t, d, device=dev, requires_grad=True)
        targets = torch.from_numpy(rng.integers(0, v, size=t)).to(dev)
        w_full = torch.randn(v, d, device=dev, requires_grad=True)
        b_full = torch.zeros(v, device=dev, requires_grad=True)

        def full_softmax():
          F.cross_entropy(h @ w_full.t() + b_full, targets).backward()

        line = f"F flat V={v} D={d} T={t}: full softmax {run('full', full_softmax)}"
        if key in hsm:
          r = hsm[key]
          line += (f" | tf_hsm kernels {r['forward_ms'] + r['backward_ms']:9.3f} ms "
                   f"(floor {r['forward_floor_ms'] + r['backward_floor_ms']:.3f})")
        print(line, flush=True)
        del w_full, b_full, h
      continue
    v, d, token_counts, trees = scenarios[s]
    counts = 1.0 / np.arange(1, v + 1)
    probs = counts / counts.sum()
    for tree_name, groups in trees:
      t0 = time.time()
      if groups is None:
        paths, node_first, node_k, slots = huffman_paths(counts * 1e9)
      else:
        paths, node_first, node_k, slots = two_level_paths(v, groups)
      first, k, taken = padded(paths, node_first, node_k)
      kmax = int(node_k.max())
      first_t, k_t, taken_t = (torch.from_numpy(x).to(dev) for x in (first, k, taken))
      w_hsm = torch.randn(slots, d, device=dev) * 0.05
      b_hsm = torch.zeros(slots, device=dev)
      w_hsm.requires_grad_(), b_hsm.requires_grad_()
      print(f"{s} {tree_name}: V={v} D={d} depth<={first.shape[1]} K<={kmax} "
            f"(tree built in {time.time() - t0:.1f}s)")
      for t in token_counts:
        h = torch.randn(t, d, device=dev, requires_grad=True)
        targets = torch.from_numpy(rng.choice(v, size=t, p=probs)).to(dev)

        def gather_hsm():
          f, kk, tk = first_t[targets], k_t[targets], taken_t[targets]  # [T, depth]
          j = torch.arange(kmax, device=dev)
          valid = (j < kk[..., None]) & (kk[..., None] > 0)  # [T, depth, K]
          rows = torch.where(valid, f[..., None] + j, torch.zeros_like(f[..., None]))
          logits = torch.einsum("tpkd,td->tpk", w_hsm[rows], h) + b_hsm[rows]
          logits = logits.masked_fill(~valid, float("-inf"))
          lse = torch.logsumexp(logits, -1).masked_fill(kk == 0, 0.0)
          pick = logits.gather(-1, tk[..., None])[..., 0].masked_fill(kk == 0, 0.0)
          (-(pick - lse).sum()).backward()

        line = f"  T={t:5d} gather-HSM {run('gather', gather_hsm)}"
        if tree_name.startswith("two_level"):
          w_full = torch.randn(v, d, device=dev, requires_grad=True)
          b_full = torch.zeros(v, device=dev, requires_grad=True)

          def full_softmax():
            F.cross_entropy(h @ w_full.t() + b_full, targets).backward()

          line += f" | full softmax {run('full', full_softmax)}"
          del w_full, b_full
        # The harness's case names: C's cases at T=320 carry no token count.
        suffix = "" if (s, t) == ("C", 320) else f"_T{t}"
        key = {"two_level_317": "B_two_level_317", "two_level_891": "C_two_level_891",
               "two_level_1000": "D_two_level_1000"}.get(tree_name, f"{s}_huffman") + suffix
        if key in hsm and hsm[key]["tokens"] == t:
          r = hsm[key]
          line += (f" | tf_hsm kernels {r['forward_ms'] + r['backward_ms']:9.3f} ms "
                   f"(floor {r['forward_floor_ms'] + r['backward_floor_ms']:.3f})")
        print(line, flush=True)


if __name__ == "__main__":
  main()
