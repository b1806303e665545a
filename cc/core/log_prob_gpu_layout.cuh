// What the CUDA log_prob kernels (cc/core/log_prob_gpu.cu) and the host code that lays
// out their work (cc/core/log_prob_gpu_work.cu) share: the tile shapes, the thresholds that
// route a node to a warp or a tile, and the slices and work items uploaded to the device.
#ifndef TF_HSM_CC_CORE_LOG_PROB_GPU_LAYOUT_CUH_
#define TF_HSM_CC_CORE_LOG_PROB_GPU_LAYOUT_CUH_

#include "cc/core/gpu_common.cuh"
#include "cc/core/gpu_compat.cuh"
#include "cc/core/gpu_tile.cuh"

namespace tf_hsm {
namespace gpu {
namespace {

// Nodes with at most this many children take a warp per visit, not a GEMM tile.
constexpr int64 kSmallSlots = 32;
// Slots per logits work item; wider nodes are split into chunks whose partial logsumexps
// are combined in a fixed order, so any branching factor fits and big nodes are spread
// over many blocks.
// 128 rather than 256: a 317-child node is then three near-even items, not a full one and
// a quarter, and a wide group is spread over twice the blocks. (Compile-time knob for
// comparing settings in the GPU harness.)
#ifndef TF_HSM_GPU_CHUNK_SLOTS
#define TF_HSM_GPU_CHUNK_SLOTS 128
#endif
constexpr int64 kChunkSlots = TF_HSM_GPU_CHUNK_SLOTS;
// A node of more than kMaxChunks * kChunkSlots children has its chunks widened, by whole
// kChunkSlots, to at most kMaxChunks: a visit keeps at most that many partials, so they
// take at most 2 * kMaxChunks * T values whatever the width (a one-node tree of 1M classes
// keeps 253 a visit, not 7,813), and a group still spreads over kMaxChunks blocks per tile
// of tokens. The width depends on the node alone, so a node's log-sum-exp is folded the
// same way in every call (a candidate gets its forward's bits). (Compile-time knob: the
// emulated harness sets it small so that its small cases widen chunks too.)
#ifndef TF_HSM_GPU_MAX_CHUNKS
#define TF_HSM_GPU_MAX_CHUNKS 256
#endif
constexpr int64 kMaxChunks = TF_HSM_GPU_MAX_CHUNKS;
// Whether the backward cuts a wide group by children (GpuLogProbPlan::Wave::kSlotBlock);
// 0 keeps token ranges only. (Compile-time knob for comparing the two in the harness.)
#ifndef TF_HSM_GPU_WIDE_BLOCKS
#define TF_HSM_GPU_WIDE_BLOCKS 1
#endif
constexpr bool kWideBlocks = TF_HSM_GPU_WIDE_BLOCKS != 0;
// Groups with at most this many tokens use 16-token tiles, the others 64-token tiles.
constexpr int64 kNarrowTokens = 16;
// Weight gradients of small nodes' slices of at most this many tokens: a warp per slice.
constexpr int64 kWarpGradTokens = 16;
constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / kWarpSize;
// Blocks per SM the tiled kernels are compiled for. In float32, tiles of at most 16 x 64
// outputs get four (at most 64 registers a thread): they stream weight rows for few tokens,
// and only more blocks keep enough loads in flight; 64 x 64 tiles get two (128 registers).
// One in float64.
#ifndef TF_HSM_GPU_SMALL_TILE_BLOCKS
#define TF_HSM_GPU_SMALL_TILE_BLOCKS 4
#endif
template <typename T, class C>
constexpr int TileMinBlocks() {
  return sizeof(T) == 4 ? (C::BM * C::BN <= 16 * 64 ? TF_HSM_GPU_SMALL_TILE_BLOCKS : 2) : 1;
}
#define TF_HSM_TILE_BOUNDS TF_HSM_LAUNCH_BOUNDS(kThreads, (TileMinBlocks<T, C>()))

using WideTile = TileConfig<64, 64, 16, 4, 4>;
using NarrowTile = TileConfig<16, 64, 16, 1, 4>;
using DwTile64 = TileConfig<64, 64, 16, 4, 4>;
using DwTile16 = TileConfig<16, 64, 16, 1, 4>;
using DwTile4 = TileConfig<4, 128, 16, 1, 2>;
static_assert(WideTile::kThreads == kThreads && NarrowTile::kThreads == kThreads &&
                  DwTile64::kThreads == kThreads && DwTile16::kThreads == kThreads &&
                  DwTile4::kThreads == kThreads,
              "every tiled kernel runs 256 threads");
static_assert(WideTile::BN == NarrowTile::BN && kChunkSlots % WideTile::BN == 0,
              "both logits tiles fold the same slot tiles, so their results agree");

// Kernels work on "visits": (group, hidden row) pairs whose logsumexp they compute. For
// log_prob and its gradient a visit is a plan entry (a token at a node); for candidates it
// is one distinct hidden row among a group's entries.
//
// A slice is a run of consecutive visits of one group processed together: the whole group,
// or (when the backward pass's coefficient buffer is too small for it) a range of it.
struct Slice {
  int64 visit0;       // first visit
  int64 count;        // visits
  int64 first_slot;   // the node's first child slot
  int64 num_slots;    // the node's children
  int64 coef;         // the slice's [count, num_slots] coefficient block in the buffer
  int64 row0;         // the group's first weight-gradient row (plan.group_row)
  int64 partial0;     // the partial logsumexps of visit0; num_chunks per visit
  int64 num_chunks;
  int64 chunk_slots;  // slots per chunk, a multiple of kChunkSlots
  int64 offset;       // visit0 - the group's first visit (0: the slice starts a group)
};
constexpr int64 kSliceWords = sizeof(Slice) / sizeof(int64);
static_assert(sizeof(Slice) == 10 * sizeof(int64), "Slice is uploaded as int64 words");

// One tile of a tiled kernel: rows from m0, columns (or the slot chunk) n0.
struct Item {
  int64 slice, m0, n0;
};
constexpr int64 kItemWords = sizeof(Item) / sizeof(int64);
static_assert(sizeof(Item) == 3 * sizeof(int64), "Item is uploaded as int64 words");

}  // namespace
}  // namespace gpu
}  // namespace tf_hsm

#endif  // TF_HSM_CC_CORE_LOG_PROB_GPU_LAYOUT_CUH_
