// The work lists of the CUDA log_prob kernels, built on the host for each call
// (PrepareLogProbGpu, PrepareLogProbCandidatesGpu; the contract is in log_prob_gpu.h):
// which visits, slices, waves and tiles the kernels of cc/core/log_prob_gpu.cu run.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "cc/core/log_prob_gpu.h"
#include "cc/core/log_prob_gpu_layout.cuh"

namespace tf_hsm {
namespace gpu {
namespace {

// ---- The work lists (host) ---------------------------------------------------------------
// BuildWork, by phase: the visits, each group's chunks and partials, the slices and their
// waves with each wave's work items, then the workspace's layout and the uploaded words.

// The visits of a call: [begin()[g], begin()[g + 1]) are group g's, each with its hidden
// row and the slot it takes. For log_prob and its gradient they are the plan's entries;
// for candidates, one per distinct hidden row of a group (so a node's logsumexp is
// computed once per row however many of the row's candidates pass through it).
struct Visits {
  const VisitPlan* plan = nullptr;
  bool candidates = false;
  std::vector<int64> group_visits, visit_row, visit_slot;  // candidates only
  std::vector<int64> entry_visit;  // candidates: the visit of each plan entry
  const std::vector<int64>& begin() const { return candidates ? group_visits : plan->group_begin; }
  const std::vector<int64>& row() const { return candidates ? visit_row : plan->entry_token; }
  const std::vector<int64>& slot() const { return candidates ? visit_slot : plan->entry_slot; }
  int64 count() const { return static_cast<int64>(row().size()); }
};

void CollectVisits(const VisitPlan& plan, bool candidates, int64 num_candidates, Visits* v) {
  v->plan = &plan;
  v->candidates = candidates;
  if (!candidates) return;
  const int64 num_groups = plan.num_groups();
  v->group_visits.assign(num_groups + 1, 0);
  v->entry_visit.resize(plan.entry_token.size());
  for (int64 g = 0; g < num_groups; ++g) {
    v->group_visits[g] = static_cast<int64>(v->visit_row.size());
    // Entries are in token order, so a row's candidates in a group are adjacent.
    for (int64 e = plan.group_begin[g]; e < plan.group_begin[g + 1]; ++e) {
      const int64 row = plan.entry_token[e] / num_candidates;
      if (e == plan.group_begin[g] || row != v->visit_row.back()) {
        v->visit_row.push_back(row);
        v->visit_slot.push_back(plan.entry_slot[e]);
      }
      v->entry_visit[e] = static_cast<int64>(v->visit_row.size()) - 1;
    }
  }
  v->group_visits[num_groups] = static_cast<int64>(v->visit_row.size());
}

// Per group: its node's first slot, its slot chunks (how many, and their width) and its
// first partial logsumexp (one partial per (visit, chunk)).
struct Groups {
  std::vector<int64> first, chunks, chunk_slots, partial;
  int64 num_partials = 0;
};

// The width of a node's chunks: kChunkSlots, widened for a node of k children so wide that
// it would otherwise have more than kMaxChunks.
int64 ChunkSlots(int64 k) { return CeilDiv(CeilDiv(k, kChunkSlots), kMaxChunks) * kChunkSlots; }

Groups LayOutGroups(const VisitPlan& plan, const TreeView& tree, const std::vector<int64>& vbegin) {
  const int64 num_groups = plan.num_groups();
  Groups gr;
  gr.first.resize(num_groups);
  gr.chunks.resize(num_groups);
  gr.chunk_slots.resize(num_groups);
  gr.partial.resize(num_groups);
  for (int64 g = 0; g < num_groups; ++g) {
    // The branching is the plan's row count: the node's entries in the tree, scattered over
    // megabytes for a large tree, are read once.
    gr.first[g] = tree.child_begin[plan.group_node[g]];
    const int64 k = plan.group_row[g + 1] - plan.group_row[g];
    const int64 n = vbegin[g + 1] - vbegin[g];
    gr.chunk_slots[g] = k <= kSmallSlots ? kChunkSlots : ChunkSlots(k);
    gr.chunks[g] = k <= kSmallSlots ? 1 : CeilDiv(k, gr.chunk_slots[g]);
    gr.partial[g] = gr.num_partials;
    gr.num_partials += n * gr.chunks[g];
  }
  return gr;
}

// One wave's work items by kernel, before they are appended to the call's item list.
struct WaveLists {
  std::vector<Item> logits_wide, logits_narrow, dw[3], dw_warp;
  struct LevelLists {
    int64 level = -1, visit_begin = 0, visit_end = 0, small_visits = 0;
    std::vector<Item> dh_wide, dh_narrow;
  };
  std::vector<LevelLists> levels;
};

GpuLogProbPlan::Range Append(const std::vector<Item>& src, std::vector<Item>* items) {
  GpuLogProbPlan::Range r;
  r.begin = static_cast<int64>(items->size());
  r.count = static_cast<int64>(src.size());
  items->insert(items->end(), src.begin(), src.end());
  return r;
}

// Cuts each group into slices and the slices into waves whose coefficients fit the
// backward pass's budget (a forward or candidates call is one wave of whole groups), and
// lists each slice's work items: logits tiles, and for the backward the dh tiles of its
// level and the dW tiles (or a warp) of its rows.
class WaveBuilder {
 public:
  WaveBuilder(const Visits& visits, const Groups& groups, const VisitPlan& plan, int64 dim,
              bool has_bias, bool backward, int64 coef_budget, GpuLogProbPlan* gp)
      : visits_(visits), groups_(groups), plan_(plan), dim_(dim), has_bias_(has_bias),
        backward_(backward),
        budget_(backward ? std::max<int64>(coef_budget, 1) : std::numeric_limits<int64>::max()),
        gp_(gp) {
    visit_slice.resize(visits.count());
  }

  void AddGroup(int64 level, int64 g) {
    const int64 n = visits_.begin()[g + 1] - visits_.begin()[g];
    const int64 k = plan_.group_row[g + 1] - plan_.group_row[g];
    // Cut by children rather than tokens (kSlotBlock waves) where the group's coefficients
    // exceed the budget and a block of kChunkSlots children for all of its visits fits.
    if (kWideBlocks && backward_ && n * k > budget_ && n * kChunkSlots <= budget_) {
      AddWideGroup(level, g, n, k);
      return;
    }
    for (int64 offset = 0; offset < n;) {
      if (backward_ && used_ > 0 && budget_ - used_ < k) CloseWave();
      const int64 take = backward_ ? std::min(n - offset, std::max<int64>(1, (budget_ - used_) / k))
                                   : n - offset;
      const int64 s = AddSlice(g, k, offset, take);
      const bool small = k <= kSmallSlots, wide = n > kNarrowTokens;
      if (!small) AddLogitsItems(s, groups_.chunks[g], take, wide);
      if (backward_) AddBackwardItems(level, s, k, take, small, wide);
      offset += take;
    }
  }

  // Appends the open wave (if it has visits) to the plan and starts the next one.
  void CloseWave() {
    if (wave_.visit_end == wave_.visit_begin) return;
    wave_.coef_elements = used_;
    wave_.logits_wide = Append(lists_.logits_wide, &items);
    wave_.logits_narrow = Append(lists_.logits_narrow, &items);
    for (const auto& l : lists_.levels) {
      GpuLogProbPlan::Level level;
      level.visit_begin = l.visit_begin;
      level.visit_end = l.visit_end;
      level.small_visits = l.small_visits;
      level.dh_wide = Append(l.dh_wide, &items);
      level.dh_narrow = Append(l.dh_narrow, &items);
      wave_.levels.push_back(level);
    }
    for (int c = 0; c < 3; ++c) wave_.dw[c] = Append(lists_.dw[c], &items);
    wave_.dw_warp = Append(lists_.dw_warp, &items);
    gp_->waves.push_back(wave_);
    const int64 next = wave_.visit_end;
    wave_ = GpuLogProbPlan::Wave();
    wave_.visit_begin = wave_.visit_end = next;
    lists_ = WaveLists();
    used_ = 0;
  }

  std::vector<Slice> slices;
  std::vector<Item> items;
  std::vector<int64> visit_slice;

 private:
  // A wide group (n visits of a node of k > kChunkSlots children): a kLogSumExp wave over
  // the whole node, then kSlotBlock waves of whole chunks of children, as many as the
  // budget holds for all n visits, each its own slice (the visits keep the first slice).
  void AddWideGroup(int64 level, int64 g, int64 n, int64 k) {
    CloseWave();
    const bool wide = n > kNarrowTokens;
    const int64 s = AddSlice(g, k, 0, n);  // at coefficient 0 of the empty wave
    used_ = 0;  // the log-sum-exp wave keeps nothing
    AddLogitsItems(s, groups_.chunks[g], n, wide);
    wave_.kind = GpuLogProbPlan::Wave::kLogSumExp;
    CloseWave();
    const int64 block = budget_ / n / kChunkSlots * kChunkSlots;
    for (int64 c0 = 0; c0 < k; c0 += block) {
      Slice sl = slices[s];
      sl.first_slot += c0;
      sl.num_slots = std::min(block, k - c0);
      sl.row0 += c0;
      sl.chunk_slots = kChunkSlots;  // a block folds no partials
      sl.num_chunks = CeilDiv(sl.num_slots, kChunkSlots);
      sl.partial0 = 0;
      const int64 b = static_cast<int64>(slices.size());
      slices.push_back(sl);
      wave_.kind = GpuLogProbPlan::Wave::kSlotBlock;
      wave_.visit_begin = sl.visit0;
      wave_.visit_end = sl.visit0 + n;
      AddLogitsItems(b, sl.num_chunks, n, wide);
      AddBackwardItems(level, b, sl.num_slots, n, false, wide);
      used_ = n * sl.num_slots;
      CloseWave();
    }
  }

  // Visits [offset, offset + take) of group g as a new slice of the open wave; its index.
  int64 AddSlice(int64 g, int64 k, int64 offset, int64 take) {
    Slice sl;
    sl.visit0 = visits_.begin()[g] + offset;
    sl.count = take;
    sl.first_slot = groups_.first[g];
    sl.num_slots = k;
    sl.coef = backward_ ? used_ : 0;
    sl.row0 = plan_.group_row[g];
    sl.partial0 = groups_.partial[g] + offset * groups_.chunks[g];
    sl.num_chunks = groups_.chunks[g];
    sl.chunk_slots = groups_.chunk_slots[g];
    sl.offset = offset;
    const int64 s = static_cast<int64>(slices.size());
    slices.push_back(sl);
    for (int64 v = sl.visit0; v < sl.visit0 + take; ++v) visit_slice[v] = s;
    if (backward_) used_ += take * k;
    wave_.visit_end = sl.visit0 + take;
    if (k <= kSmallSlots) wave_.small_visits += take;
    return s;
  }

  // A tile of tokens against each slot chunk (nodes of more than kSmallSlots children).
  void AddLogitsItems(int64 s, int64 chunks, int64 take, bool wide) {
    auto& dst = wide ? lists_.logits_wide : lists_.logits_narrow;
    const int64 bm = wide ? WideTile::BM : NarrowTile::BM;
    for (int64 t0 = 0; t0 < take; t0 += bm)
      for (int64 c = 0; c < chunks; ++c) dst.push_back({s, t0, c});
  }

  // The slice's dh work in its level's lists, and its dW work.
  void AddBackwardItems(int64 level, int64 s, int64 k, int64 take, bool small, bool wide) {
    const Slice& sl = slices[s];
    if (lists_.levels.empty() || lists_.levels.back().level != level) {
      lists_.levels.emplace_back();
      lists_.levels.back().level = level;
      lists_.levels.back().visit_begin = sl.visit0;
    }
    auto& lv = lists_.levels.back();
    lv.visit_end = sl.visit0 + take;
    if (small) {
      lv.small_visits += take;
    } else {
      auto& dst = wide ? lv.dh_wide : lv.dh_narrow;
      const int64 bm = wide ? WideTile::BM : NarrowTile::BM;
      for (int64 t0 = 0; t0 < take; t0 += bm)
        for (int64 d0 = 0; d0 < dim_; d0 += WideTile::BN) dst.push_back({s, t0, d0});
    }
    if (small && take <= kWarpGradTokens) {
      lists_.dw_warp.push_back({s, 0, 0});
      return;
    }
    // Tiles by node size: <= 4, <= 16, > 16 rows.
    static constexpr int64 kRows[3] = {DwTile4::BM, DwTile16::BM, DwTile64::BM};
    static constexpr int64 kCols[3] = {DwTile4::BN, DwTile16::BN, DwTile64::BN};
    const int cfg = k <= kRows[0] ? 0 : (k <= kRows[1] ? 1 : 2);
    const int64 cols = dim_ + (has_bias_ ? 1 : 0);
    for (int64 j0 = 0; j0 < k; j0 += kRows[cfg])
      for (int64 d0 = 0; d0 < cols; d0 += kCols[cfg]) lists_.dw[cfg].push_back({s, j0, d0});
  }

  const Visits& visits_;
  const Groups& groups_;
  const VisitPlan& plan_;
  const int64 dim_;
  const bool has_bias_, backward_;
  const int64 budget_;
  GpuLogProbPlan* gp_;
  GpuLogProbPlan::Wave wave_;
  WaveLists lists_;
  int64 used_ = 0;  // coefficient elements of the open wave
};

// Byte offsets of the arrays in the workspace: the uploaded arrays first, then the
// device-only scratch. Returns the bytes uploaded.
int64 LayOutWorkspace(int64 value_bytes, int64 num_items, int64 num_entries, GpuLogProbPlan* gp) {
  const bool backward = gp->mode == GpuLogProbPlan::kBackward;
  const int64 num_visits = gp->num_visits;
  int64 cursor = 0;
  auto reserve = [&cursor](int64 bytes) { return Reserve(&cursor, bytes); };
  const int64 w = sizeof(int64);
  gp->slices = reserve(gp->num_slices * kSliceWords * w);
  gp->items = reserve(num_items * kItemWords * w);
  gp->visit_row = reserve(num_visits * w);
  gp->visit_slot = reserve(num_visits * w);
  gp->visit_slice = reserve(num_visits * w);
  if (!backward) {
    gp->token_begin = reserve((gp->num_tokens + 1) * w);
    gp->token_entries = reserve(num_entries * w);
  } else {
    gp->group_row = reserve((gp->num_groups + 1) * w);
    gp->group_first = reserve(gp->num_groups * w);
  }
  if (gp->mode == GpuLogProbPlan::kCandidates) {
    gp->cand_visit = reserve(num_entries * w);
    gp->cand_slot = reserve(num_entries * w);
  }
  const int64 staging_bytes = cursor;
  gp->partial_max = reserve(gp->num_partials * value_bytes);
  gp->partial_sum = reserve(gp->num_partials * value_bytes);
  gp->taken = reserve(num_visits * value_bytes);
  if (backward) {
    gp->lse = reserve(num_visits * value_bytes);
    int64 coef = 0;
    for (const auto& wv : gp->waves) coef = std::max(coef, wv.coef_elements);
    gp->coef = reserve(coef * value_bytes);
  }
  gp->workspace_bytes = cursor;
  return staging_bytes;
}

// Each token's entries in plan order, which is root first: token_begin and token_entries.
void FillTokenEntries(const VisitPlan& plan, int64* begin, int64* entries) {
  const int64 num_entries = static_cast<int64>(plan.entry_token.size());
  const int64 num_tokens = plan.num_tokens;
  for (int64 e = 0; e < num_entries; ++e) ++begin[plan.entry_token[e] + 1];
  for (int64 i = 0; i < num_tokens; ++i) begin[i + 1] += begin[i];
  std::vector<int64> next(begin, begin + num_tokens);
  for (int64 e = 0; e < num_entries; ++e) entries[next[plan.entry_token[e]]++] = e;
}

// The uploaded words, at the offsets LayOutWorkspace chose.
void FillStaging(const VisitPlan& plan, const Visits& visits, const Groups& groups,
                 const WaveBuilder& built, int64 staging_bytes, GpuLogProbPlan* gp) {
  const int64 w = sizeof(int64);
  gp->staging.assign(staging_bytes / w, 0);
  int64* words = gp->staging.data();
  if (!built.slices.empty()) {
    std::memcpy(words + gp->slices / w, built.slices.data(), built.slices.size() * sizeof(Slice));
  }
  if (!built.items.empty()) {
    std::memcpy(words + gp->items / w, built.items.data(), built.items.size() * sizeof(Item));
  }
  std::copy(visits.row().begin(), visits.row().end(), words + gp->visit_row / w);
  std::copy(visits.slot().begin(), visits.slot().end(), words + gp->visit_slot / w);
  std::copy(built.visit_slice.begin(), built.visit_slice.end(), words + gp->visit_slice / w);
  if (gp->mode != GpuLogProbPlan::kBackward) {
    FillTokenEntries(plan, words + gp->token_begin / w, words + gp->token_entries / w);
  } else {
    std::copy(plan.group_row.begin(), plan.group_row.end(), words + gp->group_row / w);
    std::copy(groups.first.begin(), groups.first.end(), words + gp->group_first / w);
  }
  if (gp->mode == GpuLogProbPlan::kCandidates) {
    std::copy(visits.entry_visit.begin(), visits.entry_visit.end(), words + gp->cand_visit / w);
    std::copy(plan.entry_slot.begin(), plan.entry_slot.end(), words + gp->cand_slot / w);
  }
}

// The work of one call, built on the host (see the phases above). Kernels see "visits":
// (group, hidden row) pairs whose logsumexp they compute.
template <typename T>
std::string BuildWork(const VisitPlan& plan, const TreeView& tree, int64 dim, bool has_bias,
                      GpuLogProbPlan::Mode mode, int64 coef_budget, int64 num_candidates,
                      GpuLogProbPlan* out) {
  *out = GpuLogProbPlan();
  GpuLogProbPlan& gp = *out;
  if (dim < 0) return "the hidden size must not be negative";
  const bool candidates = mode == GpuLogProbPlan::kCandidates;
  if (candidates && num_candidates < 1 && plan.num_tokens > 0) {
    return "the number of candidates per row must be positive";
  }
  gp.mode = mode;
  gp.has_bias = has_bias;
  gp.value_bytes = sizeof(T);
  gp.dim = dim;
  gp.num_tokens = plan.num_tokens;
  gp.num_groups = plan.num_groups();
  gp.num_rows = plan.num_rows();
  gp.num_candidates = candidates ? num_candidates : 0;

  Visits visits;
  CollectVisits(plan, candidates, num_candidates, &visits);
  gp.num_visits = visits.count();
  const Groups groups = LayOutGroups(plan, tree, visits.begin());
  gp.num_partials = groups.num_partials;

  WaveBuilder built(visits, groups, plan, dim, has_bias, mode == GpuLogProbPlan::kBackward,
                    coef_budget, &gp);
  for (int64 level = 0; level < plan.num_levels(); ++level) {
    for (int64 g = plan.level_begin[level]; g < plan.level_begin[level + 1]; ++g) {
      built.AddGroup(level, g);
    }
  }
  built.CloseWave();
  gp.num_slices = static_cast<int64>(built.slices.size());

  const int64 num_entries = static_cast<int64>(plan.entry_token.size());
  const int64 staging_bytes =
      LayOutWorkspace(sizeof(T), static_cast<int64>(built.items.size()), num_entries, &gp);
  FillStaging(plan, visits, groups, built, staging_bytes, &gp);
  return "";
}

}  // namespace
}  // namespace gpu

template <typename T>
std::string PrepareLogProbGpu(const VisitPlan& plan, const TreeView& tree, int64 dim,
                              bool has_bias, bool backward, int64 coef_budget,
                              GpuLogProbPlan* out) {
  return gpu::BuildWork<T>(plan, tree, dim, has_bias,
                           backward ? GpuLogProbPlan::kBackward : GpuLogProbPlan::kForward,
                           coef_budget, 0, out);
}

template <typename T>
std::string PrepareLogProbCandidatesGpu(const VisitPlan& plan, const TreeView& tree, int64 dim,
                                        bool has_bias, int64 num_candidates,
                                        GpuLogProbPlan* out) {
  return gpu::BuildWork<T>(plan, tree, dim, has_bias, GpuLogProbPlan::kCandidates, 0,
                           num_candidates, out);
}

#define TF_HSM_INSTANTIATE(T)                                                               \
  template std::string PrepareLogProbGpu<T>(const VisitPlan&, const TreeView&, int64, bool, \
                                            bool, int64, GpuLogProbPlan*);                  \
  template std::string PrepareLogProbCandidatesGpu<T>(const VisitPlan&, const TreeView&,    \
                                                      int64, bool, int64, GpuLogProbPlan*);
TF_HSM_INSTANTIATE(float)
TF_HSM_INSTANTIATE(double)
#undef TF_HSM_INSTANTIATE

}  // namespace tf_hsm
