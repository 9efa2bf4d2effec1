// Host emulation of the CUDA built-ins the sm_80 tensor-core kernels use, so that their C++
// (cuda_src/bwd_sm80.cu, fwd_sm80.cu) runs unchanged on a CPU, with g++ (tests/_emu_sm80.py).
//
// A thread block runs as blockDim.x fibers (ucontext) in one OS thread; blocks run one after
// another, in blockIdx order. A fiber runs until it reaches a synchronisation point
// (__syncthreads, or a warp-collective operation: ldmatrix, mma, shuffles), then the next
// fiber runs; the order in which fibers are resumed is shuffled every round, so that a read of
// shared memory that is not ordered by a barrier after the write meets stale data in some
// order. Shared memory starts filled with 0xFF bytes (NaN as float16, bfloat16 and float32).
// A round in which no fiber reaches a barrier or finishes is a deadlock and aborts, and so
// does every out-of-bounds shared-memory access, a misaligned cp.async / ldmatrix address,
// and a cp.async source outside the arrays registered as readable. cp.async copies land at the
// wait that retires them, or (State::eager) when issued.
//
// The warp-level operations follow the PTX ISA's fragment tables (mma.m16n8k16, ldmatrix
// .m8n8 with and without .trans); they live in mma_sm80_host.cuh. What is *not* emulated:
// timing, the memory model beyond program order (a missing __threadfence goes unnoticed), and
// the rounding of the tensor cores' internal accumulation (float32 here, one product at a
// time).
#pragma once
#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <vector>

#define __device__
#define __host__
#define __global__
#define __forceinline__ inline
#define __noinline__   // (after the standard headers, which use it as an attribute name)
#define __launch_bounds__(...)
#define __shared__
#define __align__(n)
#define __restrict__ __restrict

using std::max;
using std::min;

struct uint3_emu { unsigned x, y, z; };
struct float2 { float x, y; };
struct float4 { float x, y, z, w; };
struct uint2 { unsigned x, y; };
struct uint4 { unsigned x, y, z, w; };
inline float2 make_float2(float x, float y) { return {x, y}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }

namespace emu {

struct State;
inline State& st();
[[noreturn]] inline void fail(const char* what);

constexpr int kMaxThreads = 1024;
constexpr size_t kSmemBytes = 232448;   // 227 KB, sm_90's per-block maximum
constexpr size_t kStackBytes = 256 * 1024;

struct Fiber {
  ucontext_t ctx;
  std::vector<char> stack;
  bool done = false;
};

struct State {
  unsigned char* smem = nullptr;   // the kernel's extern __shared__ array
  unsigned dyn_smem = 0;           // dynamic shared memory of this launch
  int nthreads = 0;
  unsigned ngrid = 1;              // blocks of the launch (gridDim.x)
  int cur = 0;
  uint3_emu bid{0, 0, 0};
  ucontext_t sched;
  std::vector<Fiber> fibers;
  std::function<void()> body;
  long progress = 0;               // barrier arrivals and finished fibers
  // block barrier
  int bar_count = 0, bar_gen = 0, bar_or = 0, bar_or_result = 0;
  // warp barriers and exchange buffers (two, by generation parity)
  int wcount[kMaxThreads / 32] = {}, wgen[kMaxThreads / 32] = {};
  uint32_t xchg[2][kMaxThreads][8];
  // readable global ranges for cp.async sources
  std::vector<std::pair<const char*, const char*>> readable;
  // cp.async copies (of data, not zero fills) whose source lies in `watched`: what a kernel
  // loads of one array (a test of the tiles a block mask skips)
  std::vector<std::pair<const char*, const char*>> watched;
  long watched_copies = 0;
  // cp.async copies land when issued (true) or at the wait that retires them (false): both are
  // what the GPU may do, so a kernel must be right under each; landing early catches a copy
  // into a buffer that is still being read
  bool eager = false;
  std::mt19937 rng{12345};
  // cp.async: per thread, the committed groups not yet waited for and the open group
  struct Copy { unsigned dst; const void* src; int bytes; };
  std::vector<std::vector<Copy>> groups[kMaxThreads];
  std::vector<Copy> open[kMaxThreads];
  long spins[kMaxThreads] = {};
  // failure inside a fiber: the message, and the fiber never resumes
  bool in_fiber = false, failed = false;
  char message[512] = {};
};

inline State& st() {
  static State s;
  return s;
}

inline void yield() { swapcontext(&st().fibers[st().cur].ctx, &st().sched); }

[[noreturn]] inline void fail(const char* what) {
  State& s = st();
  std::snprintf(s.message, sizeof s.message, "%s (block %u, thread %d)", what, s.bid.x, s.cur);
  s.failed = true;
  if (s.in_fiber) yield();   // back to the scheduler, never to return here
  std::fprintf(stderr, "emu: %s\n", s.message);
  std::abort();
}

inline uint3_emu thread_idx() { return {unsigned(st().cur), 0, 0}; }

inline int block_sync_or(int pred) {
  State& s = st();
  const int gen = s.bar_gen;
  s.bar_or |= (pred != 0);
  ++s.progress;
  if (++s.bar_count == s.nthreads) {
    s.bar_count = 0;
    s.bar_or_result = s.bar_or;
    s.bar_or = 0;
    ++s.bar_gen;
    return s.bar_or_result;
  }
  while (s.bar_gen == gen) yield();
  return s.bar_or_result;
}

// Warp barrier; returns the generation parity of the exchange buffer this collective uses.
inline int warp_sync() {
  State& s = st();
  const int w = s.cur / 32;
  const int gen = s.wgen[w];
  ++s.progress;
  if (++s.wcount[w] == 32) {
    s.wcount[w] = 0;
    ++s.wgen[w];
  } else {
    while (s.wgen[w] == gen) yield();
  }
  return gen & 1;
}

// The lane's 8 exchange words of the collective it is entering (written before warp_sync).
inline uint32_t* my_xchg() {
  State& s = st();
  return s.xchg[s.wgen[s.cur / 32] & 1][s.cur];
}
inline const uint32_t* lane_xchg(int parity, int lane) {
  State& s = st();
  return s.xchg[parity][(s.cur / 32) * 32 + lane];
}

inline void check_smem(unsigned addr, unsigned bytes) {
  if (size_t(addr) + bytes > st().dyn_smem) fail("shared-memory access past the dynamic allocation");
}

inline void count_watched(const void* p) {
  const char* c = static_cast<const char*>(p);
  for (auto& r : st().watched)
    if (c >= r.first && c < r.second) {
      ++st().watched_copies;
      return;
    }
}

inline void check_readable(const void* p, size_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (auto& r : st().readable)
    if (c >= r.first && c + bytes <= r.second) return;
  fail("cp.async source outside every input array");
}

inline void fiber_main() {
  State& s = st();
  s.body();
  s.fibers[s.cur].done = true;
  ++s.progress;
}

// Run `body` as one block of `nthreads` threads (blockIdx = bid) with `dyn_smem` bytes of
// dynamic shared memory at `smem`. Returns false (message in st().message) on a failure.
inline bool run_block(int nthreads, uint3_emu bid, unsigned char* smem, unsigned dyn_smem,
                      std::function<void()> body) {
  State& s = st();
  s.failed = false;
  s.bid = bid;
  s.cur = -1;
  if (nthreads % 32 || nthreads > kMaxThreads) {
    std::snprintf(s.message, sizeof s.message, "block of %d threads", nthreads);
    return false;
  }
  if (dyn_smem > kSmemBytes) {
    std::snprintf(s.message, sizeof s.message, "dynamic shared memory %u above 227 KB", dyn_smem);
    return false;
  }
  s.smem = smem;
  s.dyn_smem = dyn_smem;
  std::memset(smem, 0xFF, kSmemBytes);
  s.nthreads = nthreads;
  s.body = std::move(body);
  s.bar_count = s.bar_gen = s.bar_or = 0;
  std::fill(std::begin(s.wcount), std::end(s.wcount), 0);
  std::fill(std::begin(s.wgen), std::end(s.wgen), 0);
  if (int(s.fibers.size()) < nthreads) s.fibers.resize(nthreads);
  for (int i = 0; i < nthreads; ++i) {
    Fiber& f = s.fibers[i];
    if (f.stack.empty()) f.stack.resize(kStackBytes);
    f.done = false;
    s.groups[i].clear();
    s.open[i].clear();
    s.spins[i] = 0;
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack.data();
    f.ctx.uc_stack.ss_size = f.stack.size();
    f.ctx.uc_link = &s.sched;
    makecontext(&f.ctx, fiber_main, 0);
  }
  std::vector<int> order(nthreads);
  for (int i = 0; i < nthreads; ++i) order[i] = i;
  for (;;) {
    const long before = s.progress;
    bool any = false;
    std::shuffle(order.begin(), order.end(), s.rng);
    for (int i : order) {
      if (s.fibers[i].done) continue;
      any = true;
      s.cur = i;
      s.in_fiber = true;
      swapcontext(&s.sched, &s.fibers[i].ctx);
      s.in_fiber = false;
      if (s.failed) return false;
    }
    if (!any) break;
    if (s.progress == before) {
      std::snprintf(s.message, sizeof s.message,
                    "deadlock in block %u: no thread reached a barrier or finished in a round", bid.x);
      return false;
    }
  }
  for (int i = 0; i < nthreads; ++i) {
    bool pending = !s.open[i].empty();
    for (auto& grp : s.groups[i]) pending |= !grp.empty();
    if (pending) {
      std::snprintf(s.message, sizeof s.message,
                    "block %u thread %d exited with cp.async copies never waited for", bid.x, i);
      return false;
    }
  }
  return true;
}

}  // namespace emu

#define threadIdx (::emu::thread_idx())
#define blockIdx (::emu::st().bid)
#define blockDim (::uint3_emu{unsigned(::emu::st().nthreads), 1u, 1u})
#define gridDim (::uint3_emu{::emu::st().ngrid, 1u, 1u})
#define __syncthreads() ((void)::emu::block_sync_or(0))
#define __syncthreads_or(pred) ::emu::block_sync_or(pred)
#define __trap() ::emu::fail("__trap()")

inline void __syncwarp(unsigned = 0xffffffffu) { ::emu::warp_sync(); }
inline void __threadfence() {}
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline unsigned __float_as_uint(float x) { unsigned i; std::memcpy(&i, &x, 4); return i; }
inline double __longlong_as_double(long long i) { double f; std::memcpy(&f, &i, 8); return f; }
inline float __log2f(float x) { return std::log2(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(static_cast<unsigned>(x)); }
template <typename T> inline T __ldg(const T* p) { return *p; }
template <typename T> inline T __ldcg(const T* p) { return *p; }
template <typename T> inline void __stcg(T* p, T v) { *p = v; }
inline float atomicAdd(float* p, float v) { const float old = *p; *p = old + v; return old; }
inline double atomicAdd(double* p, double v) { const double old = *p; *p = old + v; return old; }
inline unsigned atomicAdd(unsigned* p, unsigned v) { const unsigned old = *p; *p = old + v; return old; }
inline unsigned atomicExch(unsigned* p, unsigned v) { const unsigned old = *p; *p = v; return old; }
inline unsigned atomicInc(unsigned* p, unsigned v) {
  const unsigned old = *p;
  *p = old >= v ? 0u : old + 1u;
  return old;
}
template <typename T> inline T __shfl_xor_sync(unsigned, T v, int mask) {
  static_assert(sizeof(T) == 4, "32-bit shuffles");
  uint32_t* mine = ::emu::my_xchg();
  std::memcpy(mine, &v, 4);
  const int parity = ::emu::warp_sync();
  const int lane = int(threadIdx.x) % 32;
  T out;
  std::memcpy(&out, ::emu::lane_xchg(parity, lane ^ mask), 4);
  return out;
}
template <typename T> inline T __shfl_sync(unsigned, T v, int src_lane) {
  static_assert(sizeof(T) == 4, "32-bit shuffles");
  uint32_t* mine = ::emu::my_xchg();
  std::memcpy(mine, &v, 4);
  const int parity = ::emu::warp_sync();
  T out;
  std::memcpy(&out, ::emu::lane_xchg(parity, src_lane & 31), 4);
  return out;
}
