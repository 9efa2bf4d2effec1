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
  int pad_;
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
template <typename T>
__device__ __forceinline__ void store_row(const DecodeParams& p, int b, int h, int bh,
                                          int rows_total, int row, int split, int c, float mx,
                                          float lsum, float osum) {
  // lsum == 0: no visible key in this range: output 0 and lse -inf (no 0/0)
  const float out = lsum > 0.f ? osum / lsum : 0.f;
  const float lse = lsum > 0.f ? (mx + __log2f(lsum)) * 0.6931471805599453f : kNegInf;
  const int g = row / p.Lq, i = row % p.Lq;
  if (p.num_splits == 1) {
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

}  // namespace decode
}  // namespace cuflash
