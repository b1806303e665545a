// Inference with a hierarchical softmax on the CPU: exact top-k classes, every class's
// log-probability (optionally for a class range only), ancestral sampling, and the
// log-probabilities of several candidate classes per row.
//
// All four walk the tree from the root through child_begin and slot_child (TopK, Sample,
// LogProbAll) or through the per-class paths (LogProbCandidates). The tree tensors are
// untrusted: every offset is checked before it is read, lazily for the node a search
// actually expands, and a malformed tree gives an error message, never an out-of-bounds
// read or an endless loop. A node's children must have larger node ids than the node
// (true of the BFS layout), which makes every walk finite.
//
// A node's log-softmax is computed as by LogProbForward: logits in tiles of the node's
// contiguous weight rows (simd::DotBlock for a few rows, a row-panel kernel for 16 or more
// rows sharing the node; the bias added after), an online logsumexp over the tiles with
// simd::ExpInPlace, and a class's log-probability summed root first. The two logits
// kernels round differently, so values agree with LogProbForward and with each other to
// rounding, not bit for bit. Every result is independent of the ParallelFor's thread
// count and splitting.
//
// Every function returns "" on success or a message naming the problem; the outputs are
// then unspecified.
#ifndef TF_HSM_CC_CORE_INFERENCE_H_
#define TF_HSM_CC_CORE_INFERENCE_H_

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "cc/core/log_prob.h"
#include "cc/core/tree_view.h"

namespace tf_hsm {

// The k most probable classes of each of num_rows rows of p.hidden, by best-first search:
// a priority queue of tree nodes and classes keyed by the log-probability of the path to
// them, which only falls as the path descends. A node at the top of the queue is expanded
// (its log-softmax pushes its children); a class at the top is final. The search stops
// after k classes, so only nodes whose path log-probability is at least the k-th best
// class's are expanded; children that cannot reach the top k are never queued.
//
// Output row i holds log_probs[i * k + j] and classes[i * k + j] for j < k, sorted by
// decreasing log-probability; equal log-probabilities are ordered by increasing class id,
// and NaN log-probabilities come last. num_expanded[i] is the number of internal nodes
// whose log-softmax was computed for row i (root included). Needs tree.slot_child.
// Rows are searched 16 at a time: a node one row expands is also expanded for the other
// rows of its group that have it queued above their k-th best class so far, so rows share
// the pass over its weights (this changes num_expanded, never the result). A one-node
// tree of the classes in order (Tree.flat) with 16 rows or more goes by blocked products
// instead (cc/core/inference_flat.h: one pass keeps each row's best logits besides its
// log-sum-exp; a row it cannot settle exactly goes to the search); num_expanded is 1.
template <typename T>
std::string TopK(const TreeView& tree, const SoftmaxParams<T>& p, int64 num_rows, int64 k,
                 const ParallelFor& parallel_for, T* log_probs, int64* classes,
                 int64* num_expanded);

// out[i * (class_end - class_begin) + c - class_begin] = log P(c | hidden row i) for the
// classes class_begin <= c < class_end (0 <= class_begin <= class_end <= C). Each needed
// node's log-softmax is computed once per row and accumulated down the tree in one sweep,
// level by level; with a partial range only the nodes on paths to those classes are
// evaluated, so the whole table can be processed in chunks; a chunk equals the slice of
// the full result bit for bit. Rows are processed in blocks of up to 64 that share every
// weight block; the nodes of a level run in parallel. From 16 rows on, a node's logits are
// kept with the rows in the vector lanes, so its logsumexp is lane-wise vector work and a
// run of consecutive classes reaches the output rows through register transposes (the
// logsumexp then uses simd::LogVec; values agree with the per-row path to rounding).
// A one-node tree of the classes in order (Tree.flat, the exact softmax) with 16 rows or
// more goes by blocked products over all rows instead (cc/core/inference_flat.h): each
// packed tile of weight rows serves every row, the logits go straight to the output and
// are finished in place once each row's log-sum-exp is known.
// Needs tree.slot_child, and the paths for a partial range.
//
// With a cache, a call over every class (class_begin = 0, class_end = C) keeps its plan of
// the tree (the checked, ordered nodes and their value rows) for the next: that call
// compares the tree's child_begin and slot_child with copies kept from the call that made
// the plan, value by value and in parallel, and reuses the plan only when they are equal.
// Planning a 1M-class binary tree took ~12 ms of mostly serial work per call; the
// comparison reads twice its 24 MB of tree arrays. Results are the same bits either way.
class SweepPlanCache;
template <typename T>
std::string LogProbAll(const TreeView& tree, const SoftmaxParams<T>& p, int64 num_rows,
                       int64 class_begin, int64 class_end, const ParallelFor& parallel_for,
                       T* out, SweepPlanCache* cache = nullptr);

// LogProbAll's plan of the last tree it was given with this cache (see LogProbAll). Safe
// to share between threads; the plan and the tree copies stay allocated until the next
// plan replaces them or the cache is destroyed. Plans of more than kMaxCachedPlanBytes
// (tree copies included) are not kept.
class SweepPlanCache {
 public:
  static constexpr int64 kMaxCachedPlanBytes = int64{512} << 20;
  struct Entry;  // inference_sweep_plan.h

  SweepPlanCache();
  ~SweepPlanCache();
  SweepPlanCache(const SweepPlanCache&) = delete;
  SweepPlanCache& operator=(const SweepPlanCache&) = delete;

  std::shared_ptr<const Entry> Get() const;
  void Put(std::shared_ptr<const Entry> entry);

 private:
  mutable std::mutex mu_;
  std::shared_ptr<const Entry> entry_;
};

// One class per row by ancestral sampling: from the root, draw a child of the current
// node from softmax(logits / temperature) until a class is reached. The uniform number
// for row i at path depth d is a hash of (seed, i, d) (splitmix64), and the logits use
// the dot-product kernels only, so a row's class depends on its own inputs, its position
// and the seed, never on threads or on the other rows. temperature must be
// positive and finite. A row whose logits at some node contain NaN or +inf, or are all
// -inf (no well-defined distribution), gets class -1; a -inf logit alone masks its child.
// Needs tree.slot_child.
template <typename T>
std::string Sample(const TreeView& tree, const SoftmaxParams<T>& p, int64 num_rows,
                   std::uint64_t seed, T temperature, const ParallelFor& parallel_for,
                   int64* classes);

// out[i * num_candidates + m] = log P(candidates[i * num_candidates + m] | hidden row i).
// The log-sum-exp of a node is computed once per row however many of the row's
// candidates pass through it. Reads the per-class paths; slot_child is not needed.
template <typename T>
std::string LogProbCandidates(const TreeView& tree, const SoftmaxParams<T>& p,
                              int64 num_rows, const int64* candidates, int64 num_candidates,
                              const ParallelFor& parallel_for, T* out);

}  // namespace tf_hsm

#endif  // TF_HSM_CC_CORE_INFERENCE_H_
