// cuflash: the parameter block of the inference kernels (decode.cu, combine.cu): the split-KV
// decode (Flash-Decoding), the in-place KV-cache append and the combine of split partials.
//
// These kernels take their own block, DecodeParams, rather than the dense families' Params: a
// KV cache is addressed through a page table and per-row lengths that live on the device
// (cache_seqlens, block_table), and the split partials are workspaces no other family has.
// Putting those ~20 fields into Params would grow every family's argument block for nothing.
// DecodeParams carries the same VariantParams as Params (`var`), and the kernels are templated
// on the same `typename Variant` (they use Variant::kCausal only), so modifiers can reach them.
//
// cuflash/_inference_gpu.py mirrors DecodeParams field for field (DECODE_PARAMS): keep the two in
// step. 8-byte fields first, then VariantParams, then 4-byte fields.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>

// The score pipeline's run-time part (VariantParams) and the Variant the kernels are templated
// on: the one every family shares.
#include "variant.cuh"
#include "last_block.cuh"

namespace cuflash {
namespace decode {

// -inf as a float constant (NVRTC has no <math.h> INFINITY)
#define kNegInf (-__int_as_float(0x7f800000))

struct DecodeParams {
  // -- device pointers (integers: no pointer-width surprises)
  unsigned long long q, k_cache, v_cache, o, lse, o_part, lse_part, cache_seqlens, block_table,
      k_new, v_new;
  // -- element strides. Query rows are packed (head h of the cache, group member g, query i):
  //    q (B, Hkv, G, Lq, d), o (B, Hkv, G, Lq, dv), lse (B, Hkv, G, Lq); column stride 1
  //    for q, o, the caches; k_new / v_new any column stride.
  long long q_b, q_h, q_g, q_row;
  long long o_b, o_h, o_g, o_row;
  long long lse_b, lse_h, lse_g;            // lse row stride 1
  long long k_b, k_h, k_row;                // k_b: batch row (dense) or page (paged)
  long long v_b, v_h, v_row;
  long long kn_b, kn_h, kn_row, kn_col;     // k_new (B, Hkv, Lnew, d)
  long long vn_b, vn_h, vn_row, vn_col;
  long long bt_b;                           // block_table row stride
  VariantParams var;
  // -- 4-byte fields
  int B, Hkv, G, Lq, d, dv;
  int Lnew;          // keys appended by this call (k_new rows), 0 without k_new
  int capacity;      // keys one batch row can hold: Lmax (dense), max_blocks * page_size (paged)
  int paged;         // 1: k_b / v_b step over pages found through block_table
  int page_size;
  int page_shift;    // log2(page_size) when it is a power of two, else -1
  int num_pages;     // num_blocks of a paged cache: page indices are clamped to it
  int num_splits;    // key splits of one (batch row, kv head)
  int row_tiles;     // ceil(G * Lq / ROWS)
  int stream_blocks; // decode_mma's STREAM build: its grid (the flattened key ranges, see
                     // there); num_splits is then the partials' stride. 0 in other builds
  // -- appended last, so that every field above keeps its offset (and the kernels that do not
  //    read it their machine code): the arrival counters of the fused combine
  //    (merge_splits_if_last), one unsigned int per (batch row, KV head, row tile), 0 between
  //    calls: the block that completes a count sets it back to 0 for the next call on the
  //    stream. 0 (unused) when the partials are merged by decode_combine.
  unsigned long long counters;
};

// The number of keys batch row b attends to after this call's append. cache_seqlens lives on
// the device, so the host cannot check it: a value outside [0, capacity - Lnew] is clamped into
// that range here, for the append and for the attention alike. Nothing is ever read or written
// outside the cache.
__device__ __forceinline__ int total_keys(const DecodeParams& p, int b) {
  const int* seqlens = reinterpret_cast<const int*>(p.cache_seqlens);
  const int old = min(max(seqlens[b], 0), p.capacity - p.Lnew);
  return old + p.Lnew;
}

// Where key j (0 <= j < capacity) of batch row b lives: `row` (the batch row of a dense cache,
// or the page found through block_table) and `pos` (the position in it). Page indices read from
// the table are clamped to [0, num_pages) (they are device values the host never sees).
struct KeySlot { int row, pos; };

__device__ __forceinline__ KeySlot key_slot(const DecodeParams& p, int b, int j) {
  if (!p.paged) return {b, j};
  const int slot = p.page_shift >= 0 ? (j >> p.page_shift) : (j / p.page_size);
  const int* table = reinterpret_cast<const int*>(p.block_table);
  const int page = min(max(__ldg(table + b * p.bt_b + slot), 0), p.num_pages - 1);
  return {page, j - slot * p.page_size};
}

// -- 8 consecutive elements of T <-> float
template <typename T> struct Vec8;
template <> struct Vec8<__half> {
  static constexpr int kChunks = 1;        // 16-byte loads per 8 elements
  static __device__ __forceinline__ void to_float(const uint4 (&c)[1], float (&f)[8]) {
    const __half2* h = reinterpret_cast<const __half2*>(&c[0]);
#pragma unroll
    for (int i = 0; i < 4; ++i) { const float2 x = __half22float2(h[i]); f[2 * i] = x.x; f[2 * i + 1] = x.y; }
  }
};
template <> struct Vec8<__nv_bfloat16> {
  static constexpr int kChunks = 1;
  static __device__ __forceinline__ void to_float(const uint4 (&c)[1], float (&f)[8]) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&c[0]);
#pragma unroll
    for (int i = 0; i < 4; ++i) { const float2 x = __bfloat1622float2(h[i]); f[2 * i] = x.x; f[2 * i + 1] = x.y; }
  }
};
template <> struct Vec8<float> {
  static constexpr int kChunks = 2;
  static __device__ __forceinline__ void to_float(const uint4 (&c)[2], float (&f)[8]) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      f[4 * i] = __uint_as_float(c[i].x); f[4 * i + 1] = __uint_as_float(c[i].y);
      f[4 * i + 2] = __uint_as_float(c[i].z); f[4 * i + 3] = __uint_as_float(c[i].w);
    }
  }
};

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// The epilogue both decode kernels share: column c of packed row `row` (group member g, query
// i) of KV head h of batch item b, from the combined running max `mx` (log2 units), the sum of
// exponentials `lsum` and the output sum `osum` of this block's key range. With one split it is
// the result (o in T, lse in natural log); with several, the float32 partials decode_combine
// merges: o_part [(bh * rows_total + row) * num_splits + split][dv], lse_part [...][split].
// `nsplit`: the partials of this group (num_splits, except in decode_mma's STREAM build, where
// groups have their own counts and num_splits is the largest: the stride).
template <typename T>
__device__ __forceinline__ void store_row(const DecodeParams& p, int b, int h, int bh,
                                          int rows_total, int row, int split, int c, float mx,
                                          float lsum, float osum, int nsplit) {
  // lsum == 0: no visible key in this range: output 0 and lse -inf (no 0/0)
  const float out = lsum > 0.f ? osum / lsum : 0.f;
  const float lse = lsum > 0.f ? (mx + __log2f(lsum)) * 0.6931471805599453f : kNegInf;
  const int g = row / p.Lq, i = row % p.Lq;
  if (nsplit == 1) {
    T* o = reinterpret_cast<T*>(p.o);
    o[b * p.o_b + h * p.o_h + g * p.o_g + i * p.o_row + c] = from_float<T>(out);
    if (c == 0)
      reinterpret_cast<float*>(p.lse)[b * p.lse_b + h * p.lse_h + g * p.lse_g + i] = lse;
  } else {
    const long long prow = static_cast<long long>(bh) * rows_total + row;
    reinterpret_cast<float*>(p.o_part)[(prow * p.num_splits + split) * p.dv + c] = out;
    if (c == 0) reinterpret_cast<float*>(p.lse_part)[prow * p.num_splits + split] = lse;
  }
}

// The combine of the splits (combine.cu's formula, the same operations in the same order) done
// by the split kernel itself: a FUSE build of decode_mma calls this at its end, after its block
// wrote its partials (store_row), so that a call with num_splits > 1 is one launch, not two
// (a kernel boundary, drain and launch, and the combine's own pass: a few us of a ~76 us call).
//   Every block of group `group` = (batch row, KV head, row tile) arrives once at the group's
// counter after its partials; the block whose arrival brings the count to num_splits holds the
// last partial of the group: it resets the counter to 0 (the next call on the stream finds it
// zeroed: no memset, no launch a call) and merges the num_splits partials of its `nrows` rows
// (packed rows row0 ..) in split order, exactly as decode_combine: bitwise reproducible for a
// given split count, and bitwise the result of the unfused path (tested in the emulation).
//   Memory order: last_block.cuh's (publish_block_writes, then thread 0's arrival; the block
// reads the partials through L2 after the next barrier).
//   `sw`: nrows * (num_splits + 1) floats of shared memory the block no longer reads (the
// weights w_s and 1 / L of each row); `sflag`: one int, also free.
//   Loads: phase A one warp a row, lanes over the splits (lse_s: one round trip); phase B one
// thread a (row, 4 columns), float4 partials, 8 splits unrolled: ~16 KB in flight a block, so
// the merge of 15 splits x 4 rows x 128 columns (30 KB) costs ~2 L2 round trips.
//   `nsplit`: the group's partials (store_row's); the partials' stride is num_splits.
//   PRE > 0 (decode_mma's default, 16): phase B's first PRE partials of each thread's first
// (row, 4 columns) are loaded before phase A, so that their round trip overlaps the lse's: one
// L2 round trip for S <= PRE where phase A then phase B took two or three (the merging block
// is the kernel's last work: its latency is the call's). The same operations in the same
// order: bitwise the result of PRE = 0 (decode_split's, and CUFLASH_DECODE_MERGE=0's).
//   WRAP (decode_mma's default, CUFLASH_DECODE_ARRIVE_WRAP; not decode_split's): the arrival and
// the counter's reset are one atomic, atomicInc(count, nsplit - 1), which wraps the count to 0
// at the last arrival (the one that reads nsplit - 1). Before, the last block then reset it
// with a second atomic (atomicExch) and its acquire fence waited for that write to land: an
// L2 round trip more on the call's last path (the merging block is the kernel's last work).
// The same partials merged in the same order: bitwise the result of WRAP = false.
template <typename T, int THREADS, int PRE = 0, bool WRAP = false>
__device__ __forceinline__ void merge_splits_if_last(const DecodeParams& p, int group, int bh,
                                                     int rows_total, int row0, int nrows,
                                                     float* sw, int* sflag, int nsplit) {
#if defined(CUFLASH_DECODE_RELEASE_ARRIVAL) && CUFLASH_DECODE_RELEASE_ARRIVAL
  // A/B build (CUFLASH_DECODE_ARRIVE=release, a define the host puts before decode_mma.cu):
  // the arrival as CUTLASS's block barrier makes it. The block barrier orders every thread's
  // partial stores before thread 0's release fence (fence.acq_rel, cumulative), which orders
  // them before its arrival; the last arrival's acquire fence then orders the others' stores
  // before the block's reads (after the next barrier). One acq_rel fence by one thread where
  // publish_block_writes has every thread wait on a fence.sc.
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned* count = reinterpret_cast<unsigned*>(p.counters) + group;
    asm volatile("fence.acq_rel.gpu;" ::: "memory");
    const bool last = atomicAdd(count, 1u) == unsigned(nsplit) - 1u;
    if (last) {
      atomicExch(count, 0u);                 // (the counter is left at 0 for the next call)
      asm volatile("fence.acq_rel.gpu;" ::: "memory");
    }
    *sflag = last;
  }
#else
  publish_block_writes();
  if (WRAP) {
    if (threadIdx.x == 0) {  // (the last arrival leaves the counter at 0 for the next call)
      const unsigned top = unsigned(nsplit) - 1u;
      const bool last = atomicInc(reinterpret_cast<unsigned*>(p.counters) + group, top) == top;
      if (last) __threadfence();           // acquire: the other blocks' partials, read below
      *sflag = last;
    }
  } else if (threadIdx.x == 0) {  // (reset: the counter is left at 0 for the next call)
    *sflag = arrive_is_last(reinterpret_cast<unsigned*>(p.counters) + group,
                            unsigned(nsplit), true);
  }
#endif
  __syncthreads();
  if (!*sflag) return;                     // the same for the whole block (shared memory)
  const int S = nsplit, stride = p.num_splits;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const float* lse_part = reinterpret_cast<const float*>(p.lse_part);
  const float* o_part = reinterpret_cast<const float*>(p.o_part);
  float* sinv = sw + nrows * S;
  // -- phase B's first partials (PRE > 0), in registers: static indices only
  float4 pre[PRE > 0 ? PRE : 1];
  if (PRE > 0 && static_cast<int>(threadIdx.x) < nrows * (p.dv / 4)) {
    const int quads = p.dv / 4;
    const int r = threadIdx.x / quads, c = (threadIdx.x % quads) * 4;
    const long long prow = static_cast<long long>(bh) * rows_total + row0 + r;
    const float4* src = reinterpret_cast<const float4*>(o_part + prow * stride * p.dv + c);
#pragma unroll
    for (int s = 0; s < PRE; ++s)
      if (s < S) pre[s] = __ldcg(src + s * quads);
  }
  // -- phase A, a row a warp: M = max_s lse_s (a -inf M, no visible key in any split, is
  //    replaced by 0: no -inf - -inf), w_s = exp(lse_s - M), L = sum_s w_s in split order
  for (int r = warp; r < nrows; r += THREADS / 32) {
    const long long prow = static_cast<long long>(bh) * rows_total + row0 + r;
    float mx = kNegInf;
    for (int s = lane; s < S; s += 32) {  // lse_s kept in sw (one L2 round trip, not two)
      const float x = __ldcg(lse_part + prow * stride + s);
      sw[r * S + s] = x;
      mx = fmaxf(mx, x);
    }
#pragma unroll
    for (int off = 16; off >= 1; off /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
    const float ref = mx == kNegInf ? 0.f : mx;
    for (int s = lane; s < S; s += 32) sw[r * S + s] = __expf(sw[r * S + s] - ref);
    __syncwarp();
    if (lane == 0) {
      float lsum = 0.f;
      for (int s = 0; s < S; ++s) lsum += sw[r * S + s];
      sinv[r] = lsum > 0.f ? 1.f / lsum : 0.f;
      const int g = (row0 + r) / p.Lq, i = (row0 + r) % p.Lq;
      const int b = bh / p.Hkv, h = bh % p.Hkv;
      reinterpret_cast<float*>(p.lse)[b * p.lse_b + h * p.lse_h + g * p.lse_g + i] =
          lsum > 0.f ? ref + __logf(lsum) : kNegInf;
    }
  }
  __syncthreads();
  // -- phase B, a (row, 4 columns) a thread: o = sum_s w_s o_s / L, splits in order
  const int quads = p.dv / 4;              // dv is a multiple of 8
  for (int idx = threadIdx.x; idx < nrows * quads; idx += THREADS) {
    const int r = idx / quads, c = (idx % quads) * 4;
    const long long prow = static_cast<long long>(bh) * rows_total + row0 + r;
    const float4* src = reinterpret_cast<const float4*>(o_part + prow * stride * p.dv + c);
    const float* w = sw + r * S;
    float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
    int s0 = 0;
    if (PRE > 0 && idx == static_cast<int>(threadIdx.x)) {   // the first item: pre[] holds
#pragma unroll                                                 // its first partials
      for (int s = 0; s < PRE; ++s) {
        if (s < S) {
          a0 = fmaf(w[s], pre[s].x, a0);
          a1 = fmaf(w[s], pre[s].y, a1);
          a2 = fmaf(w[s], pre[s].z, a2);
          a3 = fmaf(w[s], pre[s].w, a3);
        }
      }
      s0 = min(S, PRE);
    }
#pragma unroll 8
    for (int s = s0; s < S; ++s) {
      const float4 x = __ldcg(src + s * quads);
      a0 = fmaf(w[s], x.x, a0);
      a1 = fmaf(w[s], x.y, a1);
      a2 = fmaf(w[s], x.z, a2);
      a3 = fmaf(w[s], x.w, a3);
    }
    const float inv = sinv[r];
    const int g = (row0 + r) / p.Lq, i = (row0 + r) % p.Lq;
    const int b = bh / p.Hkv, h = bh % p.Hkv;
    T* o = reinterpret_cast<T*>(p.o) + b * p.o_b + h * p.o_h + g * p.o_g + i * p.o_row + c;
    o[0] = from_float<T>(a0 * inv);
    o[1] = from_float<T>(a1 * inv);
    o[2] = from_float<T>(a2 * inv);
    o[3] = from_float<T>(a3 * inv);
  }
}

}  // namespace decode
}  // namespace cuflash
