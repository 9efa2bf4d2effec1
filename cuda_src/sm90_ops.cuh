// cuflash: what the Hopper kernels (fwd_sm90.cu, bwd_sm90.cu) share besides the generated
// wgmma wrappers: the async-proxy and wgmma fences, the 128-byte-swizzle tile layout the
// tensor cores read, and its matrix descriptors.
#pragma once

namespace cuflash {
namespace sm90 {

__device__ __forceinline__ void fence_proxy_async() {  // generic-proxy smem writes -> wgmma reads
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Keep the compiler from moving accesses of wgmma accumulators across the asynchronous
// wgmma's (an empty asm that "writes" each register).
template <int N> __device__ __forceinline__ void fence_regs(float (&d)[N][4]) {
#pragma unroll
  for (int t = 0; t < N; ++t)
#pragma unroll
    for (int i = 0; i < 4; ++i) asm volatile("" : "+f"(d[t][i])::"memory");
}

// mbarriers (PTX ISA "Parallel Synchronization and Communication Instructions: mbarrier"),
// for the warp-specialised forward (fwd_sm90ws.cu): an 8-byte object in shared memory whose
// phase completes once `count` arrivals have been made; a waiter names the phase's parity.
__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// Spin until the phase of parity `parity` has completed (try_wait suspends the thread for a
// system-chosen time before it returns false, so the loop does not hammer the barrier).
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
  asm volatile(
      "{\n.reg .pred done;\nWAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n}\n" ::"r"(bar), "r"(parity) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// An arrival made when every cp.async this thread has issued so far has landed (.noinc: the
// arrival counts towards the barrier's expected count, which mbar_init set to include it).
__device__ __forceinline__ void mbar_arrive_on_copies(unsigned bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
// Give up (dec) or take (inc) registers for this warpgroup (setmaxnreg: a multiple of 8 in
// 24..256; every warp of the warpgroup executes it).
template <int N> __device__ __forceinline__ void regs_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N> __device__ __forceinline__ void regs_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}
// A barrier of `threads` threads on hardware barrier `id` (0 is __syncthreads'): one
// warpgroup's epilogue without stopping the others.
__device__ __forceinline__ void named_barrier(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// ... and an arrival at one without waiting (the other threads of the count sync on it)
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// A ROWS x COLS tile of 2-byte elements in wgmma's 128-byte-swizzle layout: the columns are
// cut into 64-element (128-byte) column blocks stored one after the other (kBlockBytes apart);
// inside a block, row r is the 128 bytes at r * 128, and its 16-byte chunk c sits at chunk
// c ^ (r % 8). The XOR is the hardware's (address bits 4-6 ^= bits 7-9), so a block must start
// on a 1024-byte boundary. Eight rows (1024 bytes) make one swizzle atom.
template <int ROWS, int COLS> struct Sm90Tile {
  static constexpr int kChunks = COLS / 8;        // 16-byte chunks a row
  static constexpr int kBlockBytes = ROWS * 128;  // one 64-column block
  static constexpr int kBytes = ROWS * COLS * 2;
  static_assert(COLS % 64 == 0, "whole 128-byte column blocks");
  static_assert(ROWS % 8 == 0, "whole 1024-byte swizzle atoms");
  __device__ static __forceinline__ int chunk_offset(int row, int chunk) {  // in 16-byte units
    return (chunk / 8) * (kBlockBytes / 16) + row * 8 + ((chunk % 8) ^ (row % 8));
  }
  __device__ static __forceinline__ unsigned addr(unsigned base, int row, int chunk) {
    return base + 16u * static_cast<unsigned>(chunk_offset(row, chunk));
  }
};

// Matrix descriptor (PTX ISA, "Matrix Descriptor Format"): start address, leading and stride
// byte offsets (all >> 4), swizzle mode 1 = 128-byte. With that swizzle:
//   K-major operand (Q as A, K as B): rows of the operand are 128-byte rows of one column
//     block; 8-row groups are SBO = 1024 bytes apart; LBO is unused (1 by convention); the k16
//     step inside a block moves the start by 32 bytes and the next block by kBlockBytes.
//   MN-major operand (.trans; V as B in the forward; dO, Q, K as B and dS^T as A in the
//     backward): along M or N 64 elements are contiguous and the next 64 are LBO =
//     kBlockBytes on; along K rows are 128 bytes apart, 8-row groups SBO = 1024 bytes; the
//     k16 step moves the start by 16 rows = 2048 bytes.
__device__ __forceinline__ unsigned long long make_desc(unsigned saddr, unsigned lbo, unsigned sbo) {
  return static_cast<unsigned long long>((saddr & 0x3FFFF) >> 4) |
         (static_cast<unsigned long long>(lbo >> 4) << 16) |
         (static_cast<unsigned long long>(sbo >> 4) << 32) | (1ull << 62);
}

}  // namespace sm90
}  // namespace cuflash
