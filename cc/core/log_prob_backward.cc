// The backward pass of log_prob on the CPU (LogProbBackward; declared in log_prob.h):
// BackwardPass, by phases, for the gradient or, as BackwardMode::kSaveForGradient, for the
// forward that saves logits (cc/core/log_prob.cc calls it through RunBackwardPass).
#include "cc/core/log_prob.h"

#include <algorithm>
#include <cstdint>
#include <cmath>
#include <limits>
#include <vector>

#include "cc/core/log_prob_internal.h"
#include "cc/core/simd.h"
#include "cc/core/softmax_util.h"
#include "cc/core/walk_softmax.h"
#include "cc/core/wide_node.h"

namespace tf_hsm {
namespace log_prob_internal {
inline namespace TF_HSM_SIMD_ISA {
namespace {

using walk_softmax::WalkStepCoefficients;

constexpr int64 kTokenTile = 64;   // tokens per work item
// Weight rows per dW work item of a large group: its slots are split into an even number,
// at least four, of near-equal chunks of at most about this many rows, a multiple of 16
// (so a chunk's panels are a slice of the block's). Each chunk reads every token row of
// the group once, so longer chunks read them less often; an even count keeps two threads
// equally busy on a level holding one large node (the root): 64-row chunks left one thread
// three of the root's five chunks at B, and read the 5 MB of hidden rows five times. At
// least four, so that more threads still share such a level (at B, two threads: 4 x 80
// rows measured the same as 2 x 160, 33.1 against 33.0 ms a step).
constexpr int64 kGradSlotTile = 160;
static_assert(16 % simd::Vec<float>::kWidth == 0 && 16 % simd::Vec<double>::kWidth == 0,
              "dW chunks of a multiple of 16 rows start at whole panels");
// Largest tokens x branching block whose logits the one-pass backward keeps per thread.
constexpr int64 kOnePassMaxLogits = int64{1} << 20;

// Walked nodes (kWalkMaxBranching, visit_plan.h) cost a whole batch one pass over the
// tokens (WalkPath) and one over the nodes (the dW pass), however deep the tree.
constexpr int64 kWalkItemEntries = 64;  // visits per dW work item of walked nodes

// Turns logits into coefficients of dz: upstream * (onehot(taken) - softmax), one pass
// over z. The taken entry is (1 - p) * upstream, so that the coefficients for an upstream
// of 1 (what dh is summed with, scaled per token afterwards) times the upstream are these
// to the bit: scaling a product only flips its sign or rounds it once.
template <typename T>
void Coefficients(T* z, int64 n, T lse, T upstream, int64 taken) {
  typedef simd::VecT<T> V;
  constexpr int64 w = simd::Vec<T>::kWidth;
  const V l = simd::Splat<T>(lse), scale = simd::Splat<T>(-upstream);
  const bool has_taken = taken >= 0 && taken < n;
  // The same exp as the vector pass (lane 0 of a splat), so p_taken is the softmax there.
  const T p_taken = has_taken ? simd::ExpVec(simd::Splat<T>(z[taken]) - l)[0] : T(0);
  int64 j = 0;
  for (; j + w <= n; j += w) simd::Store(z + j, simd::ExpVec(simd::Load(z + j) - l) * scale);
  if (j < n) simd::StorePartial(z + j, simd::ExpVec(simd::LoadPartial(z + j, n - j) - l) * scale, n - j);
  if (has_taken) z[taken] = (T(1) - p_taken) * upstream;
}

// z[j] *= upstream: unit coefficients (Coefficients with upstream 1) into the coefficients
// of that upstream, the same bits as computing them directly.
template <typename T>
void ScaleCoefficients(T* z, int64 n, T upstream) {
  for (int64 j = 0; j < n; ++j) z[j] *= upstream;
}

// Backward of a group that fits one token tile, reading the node's weight rows once: the
// logits (kept in z[r * K + j]), the logsumexp and the token's direction are computed
// together by an online softmax (FoldNodeTiles keeping each tile's exponentials), whose
// running sum of exp(z - max) * W rows is rescaled whenever the max grows;
// directions += W[taken] - sum_s p_s W[s], the gradient of the log-probability with
// respect to h (the caller scales it by the upstream gradient). With directions == nullptr
// only the logits and the logsumexps (the same bits). The caller then turns z into dW
// without touching W.
template <typename T>
void NodeBackwardOnePass(const SoftmaxParams<T>& p, const VisitPlan& plan, int64 e0, int64 nt,
                         const NodeBlock<T>& blk, T* z, T* lse, T* directions,
                         std::uint64_t call, const T* saved) {
  const int64 D = p.dim;
  Scratch<T>& s = ThreadScratch<T>();
  const T** rows = Grow(&s.rows, nt);
  T** acc_rows = Grow(&s.out_rows, nt);
  T* acc = directions != nullptr ? Grow(&s.dh_acc, nt * D) : nullptr;
  if (acc != nullptr) std::fill(acc, acc + nt * D, T(0));
  for (int64 r = 0; r < nt; ++r) {
    rows[r] = p.hidden + plan.entry_token[e0 + r] * D;
    acc_rows[r] = acc != nullptr ? acc + r * D : nullptr;
  }
  TileFold<T> fold;
  fold.exps = Grow(&s.exps, kTokenTile * kSlotTile);
  fold.acc_rows = acc_rows;
  fold.acc_dim = D;
  const T* row_sum = FoldNodeTiles(p, rows, nt, blk, z, call, saved, fold, lse,
                                   [&](int64 k0, int64 kb) {
    if (acc == nullptr) return;
    simd::AccumulateRows<T>(acc_rows, nt, fold.exps, kSlotTile,
                            p.weights + (blk.first_slot + k0) * D, D, kb, D);
  });
  if (acc == nullptr) return;
  for (int64 r = 0; r < nt; ++r) {
    const T inv_sum = T(1) / row_sum[r];
    const T* taken = p.weights + plan.entry_slot[e0 + r] * D;
    T* dir = directions + plan.entry_token[e0 + r] * D;
    for (int64 d = 0; d < D; ++d) dir[d] += taken[d] - acc[r * D + d] * inv_sum;
  }
}

// The backward pass over a plan, in phases. Grouped (large) nodes, level by level: per
// token tile, (1) the logits and their log-sum-exp, (2) the coefficients of dz, (3) the
// hidden gradient (the tokens' directions, coef @ W); then (4) the weight-gradient rows,
// or the in-place SGD update, per tile for a group of one tile and per chunk of slots for
// larger ones. Walked (small) nodes, after every grouped level so that each direction
// sums its terms in a fixed order: each token's path (values, unit coefficients,
// direction), dh = upstream * direction, then each walked group's weight rows, summed
// over its tokens in token order.
template <typename T>
class BackwardPass {
 public:
  BackwardPass(const VisitPlan& plan, const TreeView& tree, const SoftmaxParams<T>& p,
               const T* upstream, const ParallelFor& parallel_for,
               const LogProbGrads<T>& grads, const BackwardOptions<T>& options)
      : plan_(plan), tree_(tree), p_(p), D_(p.dim), upstream_(upstream),
        parallel_for_(parallel_for), grads_(grads), options_(options),
        call_(++call_counter),
        saving_(options.mode == BackwardMode::kSaveForGradient),
        sgd_(grads.sgd_update),
        log_prob_(grads.log_prob_from_backward),
        saved_directions_(grads.saved_logits != nullptr ? grads.saved_directions : nullptr),
        walked_(plan.max_walked_branching > 0),
        store_(grads.coefficient_store != nullptr ? *grads.coefficient_store : own_store_) {
    if (saving_ || grads.saved_logits != nullptr) saved_offsets_ = SavedLogitOffsets(plan, tree);
    if (grads.saved_logits != nullptr) saved_walk_ = grads.saved_logits + saved_offsets_.back();
  }

  void Run() {
    ZeroDirections();
    entry_lse_.resize(plan_.entry_token.size());
    if (log_prob_ != nullptr) entry_value_.resize(plan_.entry_token.size());
    coef_offset_.assign(plan_.num_groups() + 1, 0);
    for (int64 level = 0; level < plan_.num_levels(); ++level) GroupedLevel(level);
    if (log_prob_ != nullptr) SumGroupedEntries(plan_, tree_, entry_value_, log_prob_);
    WalkedNodes();
    AddWideDirections();
  }

 private:
  // Where a block of weight-gradient rows goes: the output rows, or for in-place SGD a
  // per-thread scratch block applied to the table when complete (EndRows).
  struct RowBlock {
    T* dw;
    T* db;
  };

  // The grouped nodes' values the forward saved (or the saving pass writes) for entries
  // [offset, ...) of group g.
  const T* SavedLogits(int64 g, int64 offset) const {
    return LogitsAt(grads_.saved_logits, g, offset);
  }
  T* OutLogits(int64 g, int64 offset) const { return LogitsAt(options_.saved_out, g, offset); }
  template <typename U>
  U* LogitsAt(U* base, int64 g, int64 offset) const {
    if (base == nullptr) return nullptr;
    return base + saved_offsets_[g] + offset * BlockOf<T>(tree_, plan_.group_node[g]).size;
  }
  const T* HiddenRow(int64 e) const { return p_.hidden + plan_.entry_token[e] * D_; }
  T Upstream(int64 e) const { return upstream_[plan_.entry_token[e]]; }
  // A token of no steps: padding, with skip_padding (Padding::kSkip).
  bool IsPadding(int64 i) const {
    return plan_.token_step_begin[i + 1] == plan_.token_step_begin[i];
  }
  // A group handled by a single token tile gets its weight rows from the tile's
  // coefficients in hand; larger groups (several tiles) per chunk of slots, afterwards.
  bool WholeGroup(int64 g) const {
    return plan_.group_begin[g + 1] - plan_.group_begin[g] <= kTokenTile;
  }

  // The directions start at zero (megabytes at large batches: filled by all threads; the
  // cost is about a cycle per 4 elements written), unless the forward saved them.
  void ZeroDirections() {
    if (saved_directions_ != nullptr) return;
    T* const hidden = grads_.hidden;
    const int64 D = D_;
    parallel_for_(plan_.num_tokens, std::max<int64>(1, D / 4), [&](int64 begin, int64 end) {
      std::fill(hidden + begin * D, hidden + end * D, T(0));
    });
  }

  // ---- Grouped nodes ----------------------------------------------------------------

  // One level: phases 1-3 (and 4 for one-tile groups) per token tile, then phase 4 per
  // chunk of slots of the larger groups.
  void GroupedLevel(int64 level) {
    const int64 g_begin = plan_.level_begin[level], g_end = plan_.level_begin[level + 1];
    // Keep this level's coefficients for the weight phase when they fit the budget.
    int64 need = 0;
    for (int64 g = g_begin; g < g_end; ++g) {
      coef_offset_[g] = need;
      if (IsWideGroup(plan_, tree_, g)) WideGroup(g);
      if (IsWalked(tree_, plan_.group_node[g]) || IsWideGroup(plan_, tree_, g)) continue;
      need += (plan_.group_begin[g + 1] - plan_.group_begin[g]) *
              BlockOf<T>(tree_, plan_.group_node[g]).size;
    }
    if (need == 0) return;
    const bool keep = !saving_ && need <= options_.coef_budget;
    // Every kept coefficient is written before it is read, so the store is not zeroed
    // (it is megabytes per level, zeroed on one thread).
    coef_store_ = keep ? store_.Reserve(need) : nullptr;

    // Within a level each token is in one tile only, so the rows of the directions are
    // written without races.
    const std::vector<Item> items = TokenTiles(plan_, tree_, g_begin, g_end, kTokenTile);
    int64 total_cost = 0;
    for (const Item& it : items) {
      total_cost += it.count * BlockOf<T>(tree_, plan_.group_node[it.group]).size * D_;
    }
    const int64 cost = items.empty() ? 0 : 4 * total_cost / static_cast<int64>(items.size());
    parallel_for_(static_cast<int64>(items.size()), cost, [&](int64 begin, int64 end) {
      for (int64 i = begin; i < end; ++i) TokenTile(items[i]);
      simd::StreamFence();  // the streamed gradient rows, before other threads read them
    });
    if (!saving_) WeightChunks(g_begin, g_end);
  }

  // Phases 1-3 of one token tile, and 4 when the tile is its whole group.
  void TokenTile(const Item& it) {
    const NodeBlock<T> blk = BlockOf<T>(tree_, plan_.group_node[it.group]);
    T* kept = coef_store_ != nullptr
                  ? coef_store_ + coef_offset_[it.group] + it.offset * blk.size : nullptr;
    T* lse = Grow(&ThreadScratch<T>().lse, it.count);
    // The choice depends on the plan only, never on the budget or the threads.
    if (WholeGroup(it.group) && it.count * blk.size <= kOnePassMaxLogits) {
      OnePassTile(it, blk, kept, lse);
    } else {
      TiledTile(it, blk, kept, lse);
    }
  }

  // A group of one token tile, reading the node's weight rows once: the whole block of
  // logits at once (NodeBackwardOnePass: logits, log-sum-exp and directions), then the
  // coefficients in place and the weight rows from them.
  void OnePassTile(const Item& it, const NodeBlock<T>& blk, T* kept, T* lse) {
    const int64 e0 = plan_.group_begin[it.group] + it.offset, K = blk.size;
    Scratch<T>& s = ThreadScratch<T>();
    T* z = saving_ ? OutLogits(it.group, it.offset)
           : kept != nullptr ? kept : Grow(&s.logits, it.count * K);
    NodeBackwardOnePass(p_, plan_, e0, it.count, blk, z, lse,
                        saved_directions_ != nullptr ? nullptr : grads_.hidden, call_,
                        SavedLogits(it.group, it.offset));
    const T** rows = Grow(&s.rows, it.count);
    for (int64 r = 0; r < it.count; ++r) {
      const int64 e = e0 + r, taken = plan_.entry_slot[e] - blk.first_slot;
      entry_lse_[e] = lse[r];
      if (log_prob_ != nullptr) entry_value_[e] = z[r * K + taken] - lse[r];
      rows[r] = HiddenRow(e);
      if (!saving_) Coefficients(z + r * K, K, lse[r], Upstream(e), taken);
    }
    if (saving_) return;
    for (int64 k0 = 0; k0 < K; k0 += kSlotTile) {
      const int64 kb = std::min(kSlotTile, K - k0);
      const RowBlock block = BeginRows(it.group, k0, kb);
      AccumulateRows(block, kb, z + k0, K, rows, it.count, true, true);
      EndRows(it.group, k0, kb, block);
    }
  }

  // Any other token tile: the log-sum-exp first (NodeLogSumExp, keeping the logits where
  // the level's coefficients are kept), then per tile of slots the logits again (unless
  // kept), the coefficients and the directions, and the weight rows of a one-tile group.
  void TiledTile(const Item& it, const NodeBlock<T>& blk, T* kept, T* lse) {
    const int64 e0 = plan_.group_begin[it.group] + it.offset, nt = it.count;
    Scratch<T>& s = ThreadScratch<T>();
    T* taken = log_prob_ != nullptr ? Grow(&s.taken_logit, nt) : nullptr;
    T* const logits_out = saving_ ? OutLogits(it.group, it.offset) : kept;
    const T* const saved = saving_ ? logits_out : SavedLogits(it.group, it.offset);
    NodeLogSumExp(p_, plan_, e0, nt, blk, logits_out, lse, taken, call_,
                  SavedLogits(it.group, it.offset));
    for (int64 r = 0; r < nt; ++r) {
      entry_lse_[e0 + r] = lse[r];
      if (log_prob_ != nullptr) entry_value_[e0 + r] = taken[r] - lse[r];
    }
    // NodeLogSumExp may have used s.rows; rebuild the row pointers it shares.
    const T** rows = Grow(&s.rows, nt);
    T** out_rows = Grow(&s.out_rows, nt);
    for (int64 r = 0; r < nt; ++r) {
      rows[r] = HiddenRow(e0 + r);
      out_rows[r] = grads_.hidden + plan_.entry_token[e0 + r] * D_;
    }
    T* tile = Grow(&s.tile, kTokenTile * kSlotTile);
    for (int64 k0 = 0; k0 < blk.size; k0 += kSlotTile) {
      const int64 kb = std::min(kSlotTile, blk.size - k0);
      T* z = kept != nullptr ? kept + k0 : tile;
      const int64 ld = kept != nullptr ? blk.size : kSlotTile;
      if (kept == nullptr) Logits(p_, rows, nt, blk, k0, kb, z, ld, call_, saved);
      TileCoefficients(e0, nt, blk, k0, kb, z, ld, lse,
                       saved_directions_ != nullptr ? nullptr : out_rows);
      if (saving_ || !WholeGroup(it.group)) continue;
      const RowBlock block = BeginRows(it.group, k0, kb);
      AccumulateRows(block, kb, z, ld, rows, nt, true, true);
      EndRows(it.group, k0, kb, block);
    }
  }

  // Phases 2 and 3 on a tile of logits z (slots [k0, k0 + kb) of the block, rows of ld):
  // unit coefficients, the directions out_rows += unit coef @ W, then the coefficients
  // scaled by the upstream gradient; or, without out_rows (the forward saved the
  // directions), the coefficients straight away.
  void TileCoefficients(int64 e0, int64 nt, const NodeBlock<T>& blk, int64 k0, int64 kb,
                        T* z, int64 ld, const T* lse, T* const* out_rows) {
    const int64 first = blk.first_slot + k0;
    if (out_rows == nullptr) {
      for (int64 r = 0; r < nt; ++r) {
        Coefficients(z + r * ld, kb, lse[r], Upstream(e0 + r), plan_.entry_slot[e0 + r] - first);
      }
      return;
    }
    for (int64 r = 0; r < nt; ++r) {
      Coefficients(z + r * ld, kb, lse[r], T(1), plan_.entry_slot[e0 + r] - first);
    }
    simd::AccumulateRows<T>(out_rows, nt, z, ld, p_.weights + first * D_, D_, kb, D_);
    if (saving_) return;
    for (int64 r = 0; r < nt; ++r) ScaleCoefficients(z + r * ld, kb, Upstream(e0 + r));
  }

  // Phase 4 for groups spanning several token tiles: per chunk of the node's slots, dW
  // rows = coef^T @ H over the node's tokens (in token order) and db rows = column sums,
  // from the kept coefficients or recomputed. Each chunk owns its output rows.
  void WeightChunks(int64 g_begin, int64 g_end) {
    std::vector<Item> chunks;
    int64 chunk_cost = 0;
    for (int64 g = g_begin; g < g_end; ++g) {
      if (WholeGroup(g) || IsWalked(tree_, plan_.group_node[g]) || IsWideGroup(plan_, tree_, g)) {
        continue;
      }
      const int64 k = BlockOf<T>(tree_, plan_.group_node[g]).size;
      const int64 n = plan_.group_begin[g + 1] - plan_.group_begin[g];
      const int64 pieces =
          std::max<int64>(4, 2 * ((k + 2 * kGradSlotTile - 1) / (2 * kGradSlotTile)));
      const int64 chunk_rows = ((k + pieces - 1) / pieces + 15) / 16 * 16;
      for (int64 k0 = 0; k0 < k; k0 += chunk_rows) {
        const int64 kb = std::min(chunk_rows, k - k0);
        chunks.push_back({g, k0, kb});
        chunk_cost += kb * n * D_ * (coef_store_ != nullptr ? 2 : 4);
      }
    }
    const int64 ccost = chunks.empty() ? 0 : chunk_cost / static_cast<int64>(chunks.size());
    parallel_for_(static_cast<int64>(chunks.size()), ccost, [&](int64 begin, int64 end) {
      for (int64 c = begin; c < end; ++c) WeightChunk(chunks[c]);
    });
  }

  void WeightChunk(const Item& ch) {
    const int64 g = ch.group, k0 = ch.offset, kb = ch.count;
    const NodeBlock<T> blk = BlockOf<T>(tree_, plan_.group_node[g]);
    const RowBlock block = BeginRows(g, k0, kb);
    const int64 e_begin = plan_.group_begin[g], n = plan_.group_begin[g + 1] - e_begin;
    Scratch<T>& s = ThreadScratch<T>();
    T* tile = coef_store_ != nullptr ? nullptr : Grow(&s.tile, kTokenTile * kb);
    for (int64 t0 = 0; t0 < n; t0 += kTokenTile) {
      const int64 nt = std::min(kTokenTile, n - t0);
      const T** rows = Grow(&s.rows, nt);
      for (int64 r = 0; r < nt; ++r) rows[r] = HiddenRow(e_begin + t0 + r);
      if (coef_store_ != nullptr) {
        AccumulateRows(block, kb, coef_store_ + coef_offset_[g] + t0 * blk.size + k0,
                       blk.size, rows, nt, t0 == 0, false);
        continue;
      }
      Logits(p_, rows, nt, blk, k0, kb, tile, kb, call_, SavedLogits(g, t0));
      for (int64 r = 0; r < nt; ++r) {
        const int64 e = e_begin + t0 + r;
        Coefficients(tile + r * kb, kb, entry_lse_[e], Upstream(e),
                     plan_.entry_slot[e] - blk.first_slot - k0);
      }
      AccumulateRows(block, kb, tile, kb, rows, nt, t0 == 0, false);
    }
    EndRows(g, k0, kb, block);
  }

  // ---- Wide groups (cc/core/wide_node.h) -----------------------------------------------

  // A wide group: its log-sum-exps (those the forward kept, or computed by partitions),
  // then per partition of its slots the logits again, the coefficients, the partition's
  // share of the tokens' directions and its weight rows; the shares are summed in
  // partition order into wide_directions_. The saving forward keeps the log-sum-exps only.
  void WideGroup(int64 g) {
    const NodeBlock<T> blk = BlockOf<T>(tree_, plan_.group_node[g]);
    const int64 e0 = plan_.group_begin[g], n = plan_.group_begin[g + 1] - e0;
    T* const lse = entry_lse_.data() + e0;
    std::vector<T> taken(n, T(0));
    const T* const saved = SavedLogits(g, 0);
    if (saved != nullptr) {
      std::copy(saved, saved + n, lse);
    } else {
      WideLogSumExp(p_, plan_, e0, n, blk, parallel_for_, call_, lse, taken.data());
      if (saving_) std::copy(lse, lse + n, OutLogits(g, 0));
    }
    const bool need_taken = saved != nullptr && log_prob_ != nullptr;
    if (!saving_) {
      const std::vector<SlotRange> parts = WidePartitions(blk.size);
      const int64 P = static_cast<int64>(parts.size());
      std::vector<T> shares(P * n * D_, T(0));
      parallel_for_(P, 6 * n * (blk.size / P) * D_, [&](int64 begin, int64 end) {
        for (int64 q = begin; q < end; ++q) {
          WidePartition(g, blk, parts[q], shares.data() + q * n * D_,
                        need_taken ? taken.data() : nullptr);
        }
        simd::StreamFence();
      });
      SumShares(e0, n, P, shares.data());
    }
    if (log_prob_ == nullptr) return;
    for (int64 r = 0; r < n; ++r) entry_value_[e0 + r] = taken[r] - lse[r];
  }

  // One partition's slots [range): per slot tile and token tile, the logits, the
  // coefficients and this partition's share of the directions (share[r * D]), the
  // weight rows of the tile over all the group's tokens; taken[r] gets the entry's own
  // logit where its slot is in the range (when taken is set).
  void WidePartition(int64 g, const NodeBlock<T>& blk, SlotRange range, T* share, T* taken) {
    const int64 e0 = plan_.group_begin[g], n = plan_.group_begin[g + 1] - e0;
    Scratch<T>& s = ThreadScratch<T>();
    const T** rows = Grow(&s.rows, n);
    T** share_rows = Grow(&s.out_rows, n);
    for (int64 r = 0; r < n; ++r) {
      rows[r] = HiddenRow(e0 + r);
      share_rows[r] = share + r * D_;
    }
    T* tile = Grow(&s.tile, kWideTokenTile * kSlotTile);
    for (int64 k0 = range.begin; k0 < range.end; k0 += kSlotTile) {
      const int64 kb = std::min(kSlotTile, range.end - k0);
      const RowBlock block = BeginRows(g, k0, kb);
      for (int64 t0 = 0; t0 < n; t0 += kWideTokenTile) {
        const int64 nt = std::min(kWideTokenTile, n - t0);
        Logits(p_, rows + t0, nt, blk, k0, kb, tile, kb, call_);
        for (int64 r = 0; taken != nullptr && r < nt; ++r) {
          const int64 j = plan_.entry_slot[e0 + t0 + r] - blk.first_slot - k0;
          if (j >= 0 && j < kb) taken[t0 + r] = tile[r * kb + j];
        }
        TileCoefficients(e0 + t0, nt, blk, k0, kb, tile, kb, entry_lse_.data() + e0 + t0,
                         share_rows + t0);
        AccumulateRows(block, kb, tile, kb, rows + t0, nt, t0 == 0, false);
      }
      EndRows(g, k0, kb, block);
    }
  }

  // wide_directions_ += the partitions' shares of entries [e0, e0 + n), summed in
  // partition order.
  void SumShares(int64 e0, int64 n, int64 P, const T* shares) {
    if (wide_directions_.empty()) wide_directions_.assign(plan_.num_tokens * D_, T(0));
    const int64 D = D_;
    parallel_for_(n, P * D, [&](int64 begin, int64 end) {
      for (int64 r = begin; r < end; ++r) {
        T* out = wide_directions_.data() + plan_.entry_token[e0 + r] * D;
        for (int64 d = 0; d < D; ++d) {
          T sum = shares[r * D + d];
          for (int64 q = 1; q < P; ++q) sum += shares[(q * n + r) * D + d];
          out[d] += sum;
        }
      }
    });
  }

  // dh += upstream * the wide groups' directions: last, after dh = upstream * the other
  // directions, so that a gradient from the saving forward's values (which leave the
  // wide groups out) and one from scratch sum alike.
  void AddWideDirections() {
    if (saving_ || wide_directions_.empty()) return;
    const int64 D = D_;
    parallel_for_(plan_.num_tokens, std::max<int64>(1, D / 2), [&](int64 begin, int64 end) {
      for (int64 i = begin; i < end; ++i) {
        if (IsPadding(i)) continue;  // its dh stays 0, whatever its upstream
        const T u = upstream_[i];
        for (int64 d = 0; d < D; ++d) grads_.hidden[i * D + d] += u * wide_directions_[i * D + d];
      }
    });
  }

  // ---- Weight-gradient rows, or the in-place SGD update -------------------------------

  // The rows [k0, k0 + kb) of group g, left as they are (the first accumulation into
  // them overwrites, which gives the bits of zeroing first); the bias rows zeroed.
  RowBlock BeginRows(int64 g, int64 k0, int64 kb) {
    RowBlock out;
    const int64 row0 = plan_.group_row[g] + k0;
    const bool with_bias = p_.biases != nullptr && (sgd_ ? grads_.sgd_biases != nullptr
                                                         : grads_.bias_rows != nullptr);
    if (sgd_) {
      Scratch<T>& s = ThreadScratch<T>();
      out.dw = Grow(&s.sgd_rows, kb * D_);
      out.db = with_bias ? Grow(&s.sgd_bias, kb) : nullptr;
    } else {
      out.dw = grads_.weight_rows + row0 * D_;
      out.db = with_bias ? grads_.bias_rows + row0 : nullptr;
      const int64 first = tree_.child_begin[plan_.group_node[g]] + k0;
      for (int64 j = 0; j < kb; ++j) grads_.row_ids[row0 + j] = first + j;
    }
    if (out.db != nullptr) std::fill(out.db, out.db + kb, T(0));
    return out;
  }

  // block += coef^T @ H over nt tokens (and db += column sums of coef). Rows written by a
  // single call (`only`) go to the gradient output past the caches: they are not read
  // again by this op, and most of them are rows of clusters that got one or two tokens,
  // where writing them is most of the work. Rows that are whole cache lines are streamed
  // by the register-tile kernel; others (D = 300) by StreamTransposed, which writes the
  // block as the one contiguous stretch of the output that it is.
  void AccumulateRows(const RowBlock& block, int64 kb, const T* z, int64 ld,
                      const T* const* rows, int64 nt, bool overwrite, bool only) {
    const int64 D = D_;
    const bool stream = only && !sgd_;
    const bool aligned = D * static_cast<int64>(sizeof(T)) % 64 == 0 &&
                         reinterpret_cast<std::uintptr_t>(block.dw) % 64 == 0;
    if (stream && !aligned && D >= simd::Vec<T>::kWidth) {
      simd::StreamTransposed<T>(block.dw, kb, z, ld, rows, nt, D,
                                Grow(&ThreadScratch<T>().doubled_rows, nt * 2 * D));
    } else {
      simd::AccumulateTransposed<T>(block.dw, D, kb, z, ld, rows, nt, D, overwrite,
                                    stream && aligned);
    }
    if (block.db != nullptr) {
      for (int64 r = 0; r < nt; ++r)
        for (int64 j = 0; j < kb; ++j) block.db[j] += z[r * ld + j];
    }
  }

  // In-place SGD: the finished block applied to the table, W -= lr * dW; or Adam's
  // update of its rows and their moments (LogProbGrads::adam_update).
  void EndRows(int64 g, int64 k0, int64 kb, const RowBlock& block) {
    if (!sgd_) return;
    const int64 first = tree_.child_begin[plan_.group_node[g]] + k0;
    if (grads_.adam_update) {
      AdamRows(first, kb, block);
      return;
    }
    const T lr = grads_.sgd_learning_rate;
    T* w = grads_.sgd_weights + first * D_;
    for (int64 i = 0; i < kb * D_; ++i) w[i] -= lr * block.dw[i];
    if (block.db != nullptr) {
      for (int64 j = 0; j < kb; ++j) grads_.sgd_biases[first + j] -= lr * block.db[j];
    }
  }

  // Rows [first, first + kb) of the table and their moments: AdamRow over the block's
  // weight rows (one call for the block: its rows are contiguous in every variable),
  // then each bias.
  void AdamRows(int64 first, int64 kb, const RowBlock& block) {
    const AdamStep<T>& step = grads_.adam_step;
    const int64 at = first * D_;
    AdamRow<T>(block.dw, kb * D_, step, grads_.sgd_weights + at, grads_.adam_m + at,
               grads_.adam_v + at, nullptr);
    if (block.db != nullptr) {
      AdamRow<T>(block.db, kb, step, grads_.sgd_biases + first, grads_.adam_bias_m + first,
                 grads_.adam_bias_v + first, nullptr);
    }
  }

  // ---- Walked nodes -------------------------------------------------------------------

  // Each token's path (unless the forward saved what it gives), dh, then the walked
  // groups' weight rows.
  void WalkedNodes() {
    const int64 stride = plan_.max_walked_branching;
    const bool keep = saving_ || plan_.num_steps() * stride <= options_.coef_budget;
    const bool own_coefs = keep && !saving_ && saved_walk_ == nullptr;
    std::vector<T> step_coef(own_coefs ? plan_.num_steps() * stride : 0);
    T* const walk_coef = saving_ ? options_.saved_out + saved_offsets_.back() : step_coef.data();
    // With the forward's coefficients the walk is needed only for the values.
    const bool walk_grad = walked_ && saved_walk_ == nullptr;
    if (walk_grad || (walked_ && log_prob_ != nullptr)) {
      WalkOutputs<T> out;
      out.value = log_prob_ != nullptr;
      out.coefficients = walk_grad;
      out.kept_coefs = keep ? walk_coef : nullptr;
      out.stride = stride;
      WalkTokens(out);
    }
    if (saving_) return;
    if (!walk_grad) {
      const T* const directions = saved_directions_ != nullptr ? saved_directions_ : grads_.hidden;
      parallel_for_(plan_.num_tokens, std::max<int64>(1, D_ / 4), [&](int64 begin, int64 end) {
        ScaleRows(begin, end, directions);
      });
    }
    if (!walked_) return;
    // Each step's unit coefficients: the forward's, the walk's, or recomputed per visit.
    WalkedWeightRows(saved_walk_ != nullptr ? saved_walk_ : keep ? step_coef.data() : nullptr);
  }

  // Walks every token's path: its values into log_prob and, with out.coefficients, its
  // direction, then dh while the row is in cache.
  void WalkTokens(WalkOutputs<T> out) {
    const int64 cost = (out.coefficients ? 2 : 1) * WalkCostPerToken(plan_, D_);
    parallel_for_(plan_.num_tokens, cost, [&](int64 begin, int64 end) {
      WalkOutputs<T> token = out;
      for (int64 i = begin; i < end; ++i) {
        token.direction = grads_.hidden + i * D_;
        const T value = WalkPath<T>(plan_, tree_, p_, i, token);
        if (log_prob_ != nullptr) log_prob_[i] += value;
        if (out.coefficients && !saving_) ScaleRows(i, i + 1, grads_.hidden);
      }
    });
  }

  // dh = upstream * direction, rows [begin, end).
  void ScaleRows(int64 begin, int64 end, const T* directions) {
    for (int64 i = begin; i < end; ++i) {
      // A token of no steps (padding) gets 0, whatever its upstream (NaN * 0 is NaN).
      const T g = IsPadding(i) ? T(0) : upstream_[i];
      for (int64 d = 0; d < D_; ++d) grads_.hidden[i * D_ + d] = g * directions[i * D_ + d];
    }
  }

  // Phase 4 of the walked groups, in runs of consecutive walked groups with about
  // kWalkItemEntries visits. coefs: each step's unit coefficients, or null to recompute
  // them per visit.
  void WalkedWeightRows(const T* coefs) {
    std::vector<int64> group_level(plan_.num_groups());
    for (int64 level = 0; level < plan_.num_levels(); ++level) {
      for (int64 g = plan_.level_begin[level]; g < plan_.level_begin[level + 1]; ++g) {
        group_level[g] = level;
      }
    }
    struct GroupRun {
      int64 begin, end;
    };
    std::vector<GroupRun> runs;
    int64 run_begin = -1, run_entries = 0;
    for (int64 g = 0; g < plan_.num_groups(); ++g) {
      if (!IsWalked(tree_, plan_.group_node[g])) continue;
      if (run_begin < 0) run_begin = g;
      run_entries += plan_.group_begin[g + 1] - plan_.group_begin[g];
      if (run_entries >= kWalkItemEntries) {
        runs.push_back({run_begin, g + 1});
        run_begin = -1;
        run_entries = 0;
      }
    }
    if (run_begin >= 0) runs.push_back({run_begin, plan_.num_groups()});
    const int64 stride = plan_.max_walked_branching;
    const int64 run_cost = kWalkItemEntries * stride * D_ * (coefs != nullptr ? 2 : 4);
    parallel_for_(static_cast<int64>(runs.size()), run_cost, [&](int64 begin, int64 end) {
      // The in-place update reads the weight rows again, long after the walk: ask for
      // those of a walked group a few ahead.
      constexpr int64 kSgdRowsAhead = 4;
      for (int64 r = begin; r < end; ++r) {
        for (int64 g = runs[r].begin; g < runs[r].end; ++g) {
          if (!IsWalked(tree_, plan_.group_node[g])) continue;
          if (sgd_ && g + kSgdRowsAhead < runs[r].end) {
            const int64 ahead = plan_.group_node[g + kSgdRowsAhead];
            if (IsWalked(tree_, ahead)) {
              const auto block = BlockOf<T>(tree_, ahead);
              RequestRows(grads_.sgd_weights, block, D_, true);
              if (grads_.adam_update) {
                RequestRows(grads_.adam_m, block, D_, true);
                RequestRows(grads_.adam_v, block, D_, true);
              }
            }
          }
          WalkedGroupRows(g, group_level[g], coefs);
        }
      }
    });
  }

  // One walked group's weight rows: each visit's hidden row, upstream gradient and unit
  // coefficients (recomputed when not kept), then every row summed over the visits.
  void WalkedGroupRows(int64 g, int64 level, const T* coefs) {
    Scratch<T>& s = ThreadScratch<T>();
    const NodeBlock<T> blk = BlockOf<T>(tree_, plan_.group_node[g]);
    const int64 K = blk.size, e0 = plan_.group_begin[g], ne = plan_.group_begin[g + 1] - e0;
    const int64 stride = plan_.max_walked_branching;
    const T* w = p_.weights + blk.first_slot * D_;
    const T* b = p_.biases != nullptr ? p_.biases + blk.first_slot : nullptr;
    const T** h = Grow(&s.rows, ne);
    const T** c = Grow(&s.visit_coefs, ne);
    T* u = Grow(&s.visit_upstream, ne);
    T* recomputed = coefs != nullptr ? nullptr : Grow(&s.walk_coef, ne * K);
    for (int64 v = 0; v < ne; ++v) {
      const int64 i = plan_.entry_token[e0 + v];
      h[v] = p_.hidden + i * D_;
      u[v] = upstream_[i];
      if (coefs != nullptr) {
        c[v] = coefs + (plan_.token_step_begin[i] + level) * stride;
      } else {
        WalkStepCoefficients<T>(h[v], w, b, K, plan_.entry_slot[e0 + v] - blk.first_slot, D_,
                                recomputed + v * K);
        c[v] = recomputed + v * K;
      }
    }
    // The rows need no zeroing: each is written once, 0 + c_1 h_1 + c_2 h_2 + ... in
    // visit order (the bits of adding into zeroed rows).
    const RowBlock block = BeginRows(g, 0, K);
    for (int64 k = 0; k < K; ++k) {
      SumVisits(h, c, u, ne, k, D_, block.dw + k * D_);
      if (block.db != nullptr) {
        T sum = block.db[k];
        for (int64 v = 0; v < ne; ++v) sum += u[v] * c[v][k];
        block.db[k] = sum;
      }
    }
    EndRows(g, 0, K, block);
  }

  // out[0..D) = sum over the visits v of (u[v] * c[v][k]) * h[v], in visit order. A row's
  // sum is kept in registers, kChunk vectors at a time, over all of the group's visits,
  // and stored once: a node near the root gets hundreds of visits, and adding each into
  // the row in memory chained every visit on the previous one's stores.
  // (simd::AccumulateScattered sums the same way, 8 visits per pass over the row, but
  // needs the coefficients gathered per slot: the whole backward at E measured 4-5%
  // slower with it, on one thread and on two.)
  static void SumVisits(const T* const* h, const T* const* c, const T* u, int64 ne, int64 k,
                        int64 D, T* out) {
    using V = simd::VecT<T>;
    constexpr int64 vw = simd::Vec<T>::kWidth;
    constexpr int64 kChunk = 8;
    for (int64 d0 = 0; d0 < D; d0 += kChunk * vw) {
      const int64 n = std::min(kChunk * vw, D - d0);  // elements of this chunk
      V acc[kChunk];
      for (int64 j = 0; j < kChunk; ++j) acc[j] = V{};
      for (int64 v = 0; v < ne; ++v) {
        const T ck = u[v] * c[v][k];
        const T* hv = h[v] + d0;
        for (int64 j = 0; j < kChunk; ++j) {
          if (j * vw + vw <= n) {
            acc[j] = acc[j] + ck * simd::Load(hv + j * vw);
          } else if (j * vw < n) {
            acc[j] = acc[j] + ck * simd::LoadPartial(hv + j * vw, n - j * vw);
          }
        }
      }
      for (int64 j = 0; j < kChunk; ++j) {
        if (j * vw + vw <= n) {
          simd::Store(out + d0 + j * vw, acc[j]);
        } else if (j * vw < n) {
          simd::StorePartial(out + d0 + j * vw, acc[j], n - j * vw);
        }
      }
    }
  }

  const VisitPlan& plan_;
  const TreeView& tree_;
  const SoftmaxParams<T>& p_;
  const int64 D_;
  const T* const upstream_;
  const ParallelFor& parallel_for_;
  const LogProbGrads<T>& grads_;
  const BackwardOptions<T>& options_;
  const std::uint64_t call_;
  const bool saving_;  // BackwardMode::kSaveForGradient
  const bool sgd_;
  T* const log_prob_;  // grads.log_prob_from_backward, or null
  // dh is upstream * (the sum of the directions over the grouped nodes, then the walked
  // ones); the directions are computed here unless the forward saved them.
  const T* const saved_directions_;
  const bool walked_;  // the batch's paths have walked steps
  // Where the forward's logits of each group are (SavedLogitOffsets), and its walked
  // steps' unit coefficients, after them.
  std::vector<int64> saved_offsets_;
  const T* saved_walk_ = nullptr;
  CoefficientStore<T> own_store_;
  CoefficientStore<T>& store_;
  T* coef_store_ = nullptr;          // this level's kept coefficients, or null
  std::vector<int64> coef_offset_;   // per group: its coefficients' offset in the store
  std::vector<T> entry_lse_;         // per grouped entry: its node's log-sum-exp
  std::vector<T> entry_value_;       // per grouped entry: z_taken - lse, with log_prob_
  std::vector<T> wide_directions_;   // [num_tokens, D]: the wide groups' directions, or empty
};

}  // namespace

template <typename T>
void RunBackwardPass(const VisitPlan& plan, const TreeView& tree, const SoftmaxParams<T>& p,
                     const T* upstream, const ParallelFor& parallel_for,
                     const LogProbGrads<T>& grads, const BackwardOptions<T>& options) {
  BackwardPass<T>(plan, tree, p, upstream, parallel_for, grads, options).Run();
}

#define TF_HSM_INSTANTIATE(T)                                                             \
  template void RunBackwardPass<T>(const VisitPlan&, const TreeView&,                       \
                                   const SoftmaxParams<T>&, const T*, const ParallelFor&,    \
                                   const LogProbGrads<T>&, const BackwardOptions<T>&);
TF_HSM_INSTANTIATE(float)
TF_HSM_INSTANTIATE(double)
#undef TF_HSM_INSTANTIATE

}  // namespace TF_HSM_SIMD_ISA
}  // namespace log_prob_internal

using log_prob_internal::BackwardOptions;
using log_prob_internal::BackwardPass;

template <typename T>
void LogProbBackward(const VisitPlan& plan, const TreeView& tree, const SoftmaxParams<T>& p,
                     const T* upstream, const ParallelFor& parallel_for,
                     const LogProbGrads<T>& grads, int64 coef_budget) {
  BackwardOptions<T> options;
  options.coef_budget = coef_budget;
  BackwardPass<T>(plan, tree, p, upstream, parallel_for, grads, options).Run();
}

#define TF_HSM_INSTANTIATE(T)                                                             \
  template void LogProbBackward<T>(const VisitPlan&, const TreeView&,                       \
                                   const SoftmaxParams<T>&, const T*, const ParallelFor&,    \
                                   const LogProbGrads<T>&, int64);
TF_HSM_INSTANTIATE(float)
TF_HSM_INSTANTIATE(double)
#undef TF_HSM_INSTANTIATE

}  // namespace tf_hsm
