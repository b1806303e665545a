// Inference with a hierarchical softmax on a CUDA GPU: the contracts of LogProbAll, Sample
// and TopK (inference.h), computed by the kernels in inference_gpu.cu. Plain C++, like
// log_prob_gpu.h: no CUDA or TensorFlow header is needed to include it.
//
// How a call goes: Prepare*Gpu validates the whole tree on the host (child_begin and
// slot_child must be in host memory; the TensorFlow kernels declare them HostMemory),
// builds the list of nodes to evaluate and sizes a workspace; the caller allocates
// workspace_bytes of device memory (16-byte aligned) and calls the matching *Gpu function
// with device pointers. One asynchronous upload of the tree, then the kernels run on the
// given stream; nothing synchronises with the host.
//
// The kernels:
//  - LogProbAllGpu: rows are processed in waves whose buffers fit `budget` elements. For a
//    wave, one tiled product computes the logits of every slot of every needed node (all
//    nodes, or those on paths to class_range) for every row into a [rows, slots] buffer
//    (each logit one fma chain over D, then the bias). Then the needed nodes are normalised
//    level by level, parents before children: a group of threads per (row, node), as many
//    as the level's widest node needs up to a warp, folds the node's logits into an online
//    logsumexp (a fixed-shape reduction) and stores the node's base, its log-probability
//    minus that logsumexp (its parent's base plus its own logit, 0 for the root). Last, a
//    thread per (row, class) writes base of the class's node + the class's logit, in class
//    order so that the writes are contiguous whatever the tree's layout. (Per call, a
//    kernel first derives each class's node and slot from slot_child.) One launch per
//    level: a tree with thousands of levels pays thousands of launches.
//  - SampleGpu: one thread block per row walking down from the root. At each node the
//    logits are computed in parallel into a per-block scratch row, then one thread runs
//    exactly the CPU core's PickSlot: NaN or +inf logits or all -inf give class -1,
//    exp((z - max) / temperature) in T, cumulative sum in double in slot order, compared
//    with u * total where u = Uniform(seed, row, depth) is the CPU core's splitmix64 hash.
//    The result depends only on the row, its position and the seed. The logits and exp
//    round differently from the CPU core's, so a class can differ from the CPU's only
//    when u falls within rounding of a cumulative boundary (the harness allows 1% of rows).
//  - TopKGpu: NOT the CPU core's best-first search. Rows are processed in waves: the
//    LogProbAll kernels write every class's log-probability of the wave's rows to the
//    workspace, then a selection takes each row's top k in the output order (larger
//    log-probability first, equal values by increasing class id, NaN last). For k up to
//    256 a block per (row, chunk of 2,048 classes) keeps its chunk's best k (k rounds of a
//    block-wide arg-best, each taking the best strictly after the previous), and the
//    candidates are reduced the same way until one chunk per row is left. Larger k: a
//    block per row runs k rounds over all C classes, O(k * C) per row, slow for k near C.
//    num_expanded[i] is the number of internal nodes evaluated: always num_nodes.
// Determinism: no atomics; every output is written by one thread from values combined in
// a fixed order, so results are bitwise reproducible run to run. No size aborts: any
// branching factor, depth, k and batch works (waves keep the workspace bounded; at least
// one row per wave).
// Numerics: float32 accumulation for float, expf/logf; LogProbAll and TopK values agree
// with the CPU core to rounding. NaN in a row's logits reaches only that row.
#ifndef TF_HSM_CC_CORE_INFERENCE_GPU_H_
#define TF_HSM_CC_CORE_INFERENCE_GPU_H_

#include <cstdint>
#include <string>
#include <vector>

#include "cc/core/log_prob.h"
#include "cc/core/tree_view.h"

struct CUstream_st;

namespace tf_hsm {

// Default bound (elements of T) on the per-wave buffers of LogProbAll and TopK: 256 MB in
// float32. At a million classes that is 64 rows of logits a wave (32 for TopK, which also
// keeps the wave's log-probabilities); fewer rows a wave read the weight table more often.
constexpr int64 kDefaultGpuInferenceBudget = int64{1} << 26;

struct GpuInferencePlan {
  enum Mode { kLogProbAll, kSample, kTopK };
  Mode mode = kLogProbAll;
  bool has_bias = false;
  int64 value_bytes = 0;
  int64 dim = 0;
  int64 num_rows = 0, num_classes = 0, num_nodes = 0, num_slots = 0;
  int64 class_begin = 0, class_end = 0;  // LogProbAll (TopK: all classes)
  int64 k = 0;                           // TopK
  int64 num_positions = 0;               // needed nodes, in increasing id order
  int64 max_branching = 0;
  int64 wave_rows = 0;                   // rows per wave (LogProbAll, TopK)
  int64 sample_blocks = 0;               // Sample: blocks, each with a scratch row

  int64 num_zslots = 0;                  // the needed nodes' slots
  bool zslot_identity = true;            // every slot is needed, in order
  // The needed nodes' positions in runs of equal (depth, threads per node): run r is
  // [segment_begin[r], segment_begin[r + 1]) with segment_lanes[r] threads per (row, node).
  std::vector<int64> segment_begin;
  std::vector<int> segment_lanes;

  std::vector<int64> staging;  // uploaded to the start of the workspace (int64 words)
  // Byte offsets within the workspace.
  int64 child_begin = 0, slot_child = 0, nodes = 0, position = 0;
  int64 zslot = 0, zbegin = 0;
  int64 class_pos = 0, class_zslot = 0, parent_pos = 0, node_zslot = 0;
  int64 node_values = 0, zvalues = 0, all_values = 0, scratch = 0;
  // TopK: the selection steps' candidates, ping-ponged between two buffers.
  int64 candidate_values[2] = {0, 0}, candidate_ids[2] = {0, 0};
  int64 workspace_bytes = 0;
};

// LogProbAll(tree, p, num_rows, class_begin, class_end) of inference.h. budget bounds the
// node-value buffer (elements; at least one row's worth is always used).
template <typename T>
std::string PrepareLogProbAllGpu(const TreeView& tree, int64 num_rows, int64 dim, bool has_bias,
                                 int64 class_begin, int64 class_end, int64 budget,
                                 GpuInferencePlan* out);
template <typename T>
std::string LogProbAllGpu(const GpuInferencePlan& plan, const SoftmaxParams<T>& p, T* out,
                          void* workspace, CUstream_st* stream);

// Sample of inference.h (classes[i], -1 where the row's distribution is undefined).
template <typename T>
std::string PrepareSampleGpu(const TreeView& tree, int64 num_rows, int64 dim, bool has_bias,
                             GpuInferencePlan* out);
template <typename T>
std::string SampleGpu(const GpuInferencePlan& plan, const SoftmaxParams<T>& p,
                      std::uint64_t seed, T temperature, int64* classes, void* workspace,
                      CUstream_st* stream);

// TopK of inference.h by exhaustive evaluation and selection (see above). budget bounds the
// per-wave buffers (elements; at least one row's worth is always used).
template <typename T>
std::string PrepareTopKGpu(const TreeView& tree, int64 num_rows, int64 dim, bool has_bias,
                           int64 k, int64 budget, GpuInferencePlan* out);
template <typename T>
std::string TopKGpu(const GpuInferencePlan& plan, const SoftmaxParams<T>& p, T* log_probs,
                    int64* classes, int64* num_expanded, void* workspace, CUstream_st* stream);

}  // namespace tf_hsm

#endif  // TF_HSM_CC_CORE_INFERENCE_GPU_H_
