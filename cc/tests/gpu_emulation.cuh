// A host emulator for the subset of CUDA that tf_hsm's kernels use, so that the kernels
// (the same source nvcc compiles) can be executed and checked on a machine without a GPU.
// Test code, never part of the op library: cc/gpu_harness.sh --emulate puts it before
// every CUDA source (-include), and cc/core/gpu_compat.cuh maps the kernels' names onto it.
//
// Model: blocks run one after another on the calling thread; inside a block every CUDA
// thread is a fiber with its own stack (started with makecontext/setcontext, then switched
// with _setjmp/_longjmp, which skip the signal-mask system call of swapcontext), switched
// only at SyncThreads(),
// SyncWarp() and shuffles. Between two barriers each thread therefore runs alone, in an
// order set by the schedule (forward, reverse or shuffled per round): a kernel that reads
// shared memory another thread writes without a barrier in between gives different
// results under different schedules, which the harness checks for. Shared memory is a
// function-scope static (one block at a time).
//
// Checked, with a message and abort(): a barrier or shuffle reached after some thread of
// the block (or lane of the warp) has exited, a deadlock (every live thread waiting and
// no barrier can complete), and launch configurations CUDA would reject (more than 1024
// threads, a block that is not whole warps, grid limits).
//
// Also provides the runtime API calls the kernels' host code and the harness use
// (cudaMalloc on the host heap, synchronous copies, events on a steady clock).
#ifndef TF_HSM_CC_TESTS_GPU_EMULATION_CUH_
#define TF_HSM_CC_TESTS_GPU_EMULATION_CUH_

#if defined(_FORTIFY_SOURCE) && _FORTIFY_SOURCE > 0 && defined(__OPTIMIZE__)
#error "build the emulator with -U_FORTIFY_SOURCE: its fibers longjmp between stacks"
#endif

#include <setjmp.h>
#include <ucontext.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

// ---- The runtime API subset --------------------------------------------------------------

struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct uint3 {
  unsigned x, y, z;
};

struct CUstream_st;
typedef CUstream_st* cudaStream_t;
struct CUevent_st {
  std::chrono::steady_clock::time_point time;
};
typedef CUevent_st* cudaEvent_t;

enum cudaError {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorInvalidConfiguration = 9,
};
typedef cudaError cudaError_t;

enum cudaMemcpyKind {
  cudaMemcpyHostToHost = 0,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3,
  cudaMemcpyDefault = 4,
};

namespace tf_hsm_emu {

enum class Schedule { kForward, kReverse, kShuffled };

struct Barrier {
  int arrived = 0;
  std::uint64_t generation = 0;
};

struct Fiber {
  ucontext_t context;  // the entry point, used once per block
  jmp_buf jump;        // where the suspended fiber resumes
  uint3 thread_idx;
  int linear = 0;
  bool started = false;
  bool done = false;
};

struct Emulator {
  Schedule schedule = Schedule::kForward;
  std::mt19937_64 rng{1};
  std::size_t stack_bytes = std::size_t{256} << 10;

  dim3 grid_dim, block_dim;
  uint3 block_idx{0, 0, 0};
  std::vector<Fiber> fibers;
  std::vector<char> stacks;
  jmp_buf scheduler;
  Fiber* current = nullptr;
  int threads = 0, live = 0;
  Barrier block_barrier;
  std::vector<Barrier> warp_barriers;
  std::vector<int> warp_live;
  std::vector<std::uint64_t> exchange;  // 32 words per warp, for shuffles
  std::uint64_t progress = 0;
  const std::function<void()>* body = nullptr;
  std::uint64_t launches = 0, blocks = 0;
};

inline Emulator& Emu() {
  static Emulator emulator;
  return emulator;
}

[[noreturn]] inline void Fail(const std::string& what) {
  const Emulator& e = Emu();
  std::fprintf(stderr,
               "GPU EMULATOR ERROR: %s (launch %llu, block (%u, %u, %u), thread %d)\n",
               what.c_str(), static_cast<unsigned long long>(e.launches), e.block_idx.x,
               e.block_idx.y, e.block_idx.z, e.current != nullptr ? e.current->linear : -1);
  std::fflush(stderr);
  std::abort();
}

inline void SetSchedule(Schedule s, std::uint64_t seed = 1) {
  Emu().schedule = s;
  Emu().rng.seed(seed);
}

inline uint3 ThreadIdx() { return Emu().current->thread_idx; }
inline uint3 BlockIdx() { return Emu().block_idx; }
inline dim3 BlockDim() { return Emu().block_dim; }
inline dim3 GridDim() { return Emu().grid_dim; }
inline int LaneId() { return Emu().current->linear % 32; }

// Suspends the current fiber and returns to the scheduler. (_FORTIFY_SOURCE's checked
// longjmp would reject a jump to another stack; the harness builds without it.)
inline void Yield() {
  Emulator& e = Emu();
  if (_setjmp(e.current->jump) == 0) _longjmp(e.scheduler, 1);
}

// Arrives at b, which `expected` threads share; returns once all have arrived.
inline void Wait(Barrier* b, int expected) {
  Emulator& e = Emu();
  ++e.progress;
  if (++b->arrived == expected) {
    b->arrived = 0;
    ++b->generation;
    return;
  }
  const std::uint64_t g = b->generation;
  while (b->generation == g) Yield();
  ++e.progress;
}

inline void SyncThreads() {
  Emulator& e = Emu();
  if (e.live != e.threads) Fail("SyncThreads() after a thread of the block has exited");
  Wait(&e.block_barrier, e.threads);
}

inline void SyncWarp() {
  Emulator& e = Emu();
  const int w = e.current->linear / 32;
  if (e.warp_live[w] != 32) Fail("warp-synchronous call after a lane of the warp has exited");
  Wait(&e.warp_barriers[w], 32);
}

// __shfl_sync(0xffffffff, v, src_lane): every lane of the warp must take part.
template <typename T>
T Shfl(T v, int src_lane) {
  static_assert(sizeof(T) <= sizeof(std::uint64_t), "shuffles move at most 8 bytes");
  Emulator& e = Emu();
  const int w = e.current->linear / 32;
  std::uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  e.exchange[w * 32 + LaneId()] = bits;
  SyncWarp();
  bits = e.exchange[w * 32 + (src_lane & 31)];
  SyncWarp();
  T out;
  std::memcpy(&out, &bits, sizeof(T));
  return out;
}

inline void FiberEntry() {
  Emulator& e = Emu();
  (*e.body)();
  Fiber* f = e.current;
  f->done = true;
  --e.live;
  --e.warp_live[f->linear / 32];
  ++e.progress;
  if (e.block_barrier.arrived > 0) Fail("a thread exited while others wait in SyncThreads()");
  if (e.warp_barriers[f->linear / 32].arrived > 0) {
    Fail("a lane exited while others of its warp wait in a shuffle or SyncWarp()");
  }
  _longjmp(e.scheduler, 1);  // the fiber's stack is abandoned
}

inline void RunBlock() {
  Emulator& e = Emu();
  const int n = e.threads;
  e.live = n;
  e.block_barrier = Barrier();
  e.warp_barriers.assign(n / 32, Barrier());
  e.warp_live.assign(n / 32, 32);
  e.exchange.assign(static_cast<std::size_t>(n), 0);
  for (int t = 0; t < n; ++t) {
    Fiber& f = e.fibers[t];
    f.done = false;
    f.started = false;
    f.linear = t;
    f.thread_idx.x = t % e.block_dim.x;
    f.thread_idx.y = t / e.block_dim.x % e.block_dim.y;
    f.thread_idx.z = t / (e.block_dim.x * e.block_dim.y);
    getcontext(&f.context);
    f.context.uc_stack.ss_sp = e.stacks.data() + static_cast<std::size_t>(t) * e.stack_bytes;
    f.context.uc_stack.ss_size = e.stack_bytes;
    f.context.uc_link = nullptr;
    makecontext(&f.context, FiberEntry, 0);
  }
  std::vector<int> order(n);
  std::iota(order.begin(), order.end(), 0);
  if (e.schedule == Schedule::kReverse) std::reverse(order.begin(), order.end());
  while (e.live > 0) {
    if (e.schedule == Schedule::kShuffled) std::shuffle(order.begin(), order.end(), e.rng);
    const std::uint64_t before = e.progress;
    for (int t : order) {
      Fiber& f = e.fibers[t];
      if (f.done) continue;
      e.current = &f;
      if (_setjmp(e.scheduler) == 0) {
        if (f.started) _longjmp(f.jump, 1);
        f.started = true;
        setcontext(&f.context);
      }
    }
    e.current = nullptr;
    if (e.live > 0 && e.progress == before) {
      Fail("deadlock: every live thread waits at a barrier that cannot complete");
    }
  }
  ++e.blocks;
}

template <typename F>
cudaError_t Launch(dim3 grid, dim3 block, const F& fn) {
  Emulator& e = Emu();
  ++e.launches;
  const long long threads = 1LL * block.x * block.y * block.z;
  if (threads < 1 || threads > 1024) Fail("a block must have 1..1024 threads");
  if (threads % 32 != 0) Fail("the emulator needs blocks of whole warps");
  if (grid.x < 1 || grid.x > 2147483647u || grid.y < 1 || grid.y > 65535 || grid.z < 1 ||
      grid.z > 65535) {
    Fail("grid dimensions out of CUDA's limits");
  }
  const std::function<void()> body = fn;
  e.body = &body;
  e.grid_dim = grid;
  e.block_dim = block;
  e.threads = static_cast<int>(threads);
  e.fibers.resize(static_cast<std::size_t>(threads));
  const std::size_t stack_total = static_cast<std::size_t>(threads) * e.stack_bytes;
  if (e.stacks.size() < stack_total) e.stacks.resize(stack_total);
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        e.block_idx = {x, y, z};
        RunBlock();
      }
  e.body = nullptr;
  return cudaSuccess;
}

}  // namespace tf_hsm_emu

// Memory is host memory; copies and sets are synchronous, which is a valid schedule of
// the asynchronous calls they stand for.
inline cudaError_t cudaMalloc(void** ptr, std::size_t bytes) {
  const std::size_t rounded = (bytes + 255) / 256 * 256;
  *ptr = rounded == 0 ? nullptr : std::aligned_alloc(256, rounded);
  return (*ptr != nullptr || rounded == 0) ? cudaSuccess : cudaErrorMemoryAllocation;
}
template <typename T>
cudaError_t cudaMalloc(T** ptr, std::size_t bytes) {
  return cudaMalloc(reinterpret_cast<void**>(ptr), bytes);
}
inline cudaError_t cudaFree(void* ptr) {
  std::free(ptr);
  return cudaSuccess;
}
inline cudaError_t cudaMemcpy(void* dst, const void* src, std::size_t bytes, cudaMemcpyKind) {
  if (bytes > 0) std::memmove(dst, src, bytes);
  return cudaSuccess;
}
inline cudaError_t cudaMemcpyAsync(void* dst, const void* src, std::size_t bytes,
                                   cudaMemcpyKind kind, cudaStream_t = nullptr) {
  return cudaMemcpy(dst, src, bytes, kind);
}
inline cudaError_t cudaMemset(void* dst, int value, std::size_t bytes) {
  if (bytes > 0) std::memset(dst, value, bytes);
  return cudaSuccess;
}
inline cudaError_t cudaMemsetAsync(void* dst, int value, std::size_t bytes,
                                   cudaStream_t = nullptr) {
  return cudaMemset(dst, value, bytes);
}
inline cudaError_t cudaGetLastError() { return cudaSuccess; }
inline cudaError_t cudaPeekAtLastError() { return cudaSuccess; }
inline const char* cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
  }
  return "unknown error";
}
inline cudaError_t cudaDeviceSynchronize() { return cudaSuccess; }
inline cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }
inline cudaError_t cudaStreamCreate(cudaStream_t* s) {
  *s = nullptr;
  return cudaSuccess;
}
inline cudaError_t cudaStreamDestroy(cudaStream_t) { return cudaSuccess; }
inline cudaError_t cudaEventCreate(cudaEvent_t* e) {
  *e = new CUevent_st();
  return cudaSuccess;
}
inline cudaError_t cudaEventDestroy(cudaEvent_t e) {
  delete e;
  return cudaSuccess;
}
inline cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t = nullptr) {
  e->time = std::chrono::steady_clock::now();
  return cudaSuccess;
}
inline cudaError_t cudaEventSynchronize(cudaEvent_t) { return cudaSuccess; }
inline cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
  *ms = std::chrono::duration<float, std::milli>(end->time - start->time).count();
  return cudaSuccess;
}

#endif  // TF_HSM_CC_TESTS_GPU_EMULATION_CUH_
