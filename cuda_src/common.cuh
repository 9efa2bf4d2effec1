// cuflash: shared definitions for every kernel family.
//
// Every kernel, forward and backward (and bwd_prep.cu's), receives one Params struct by value.
// The Python side builds it as a NumPy structured scalar whose aligned layout matches this
// struct field for field, so keep the two in step: 8-byte fields first, then 4-byte ones.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include "variant.cuh"

// A half / bfloat16 bias element as float (modifiers.cuh's load_as finds these by argument-
// dependent lookup).
__device__ __forceinline__ float cuflash_bias_to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float cuflash_bias_to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

namespace cuflash {

// Leading (batch) dimensions after the launcher has merged every pair it can; dimension
// kMaxBatchDims-1 is the innermost. Unused dimensions have extent 1 and stride 0.
constexpr int kMaxBatchDims = 4;

struct Params {
  // -- device pointers (as integers so the struct has no pointer-width surprises): the inputs
  //    q, k, v; the forward's outputs o, lse (the backward reads them); the backward's dout = dO,
  //    dpsum = D = rowsum(dO o O) and the accumulation-dtype gradient buffers (C-contiguous:
  //    dq_acc batch x Lq x d (times num_n_blocks for bwd_simt's deterministic mode), dk_acc
  //    batch x Lk x d, dv_acc batch x Lk x dv, or dk, dv themselves in T: see out_flags; lse
  //    and dpsum batch x Lq); dq_sem: bwd_sm80's deterministic-mode semaphores (nbatch x
  //    ceil(Lq / BLOCK_M) zeroed ints), else 0. The forward leaves the backward's fields 0.
  unsigned long long q, k, v, o, lse, dout, dpsum, dq_acc, dk_acc, dv_acc, dq_sem;
  // -- element strides of each batch dimension (0 where a tensor is broadcast)
  long long q_batch_stride[kMaxBatchDims], k_batch_stride[kMaxBatchDims], v_batch_stride[kMaxBatchDims],
            o_batch_stride[kMaxBatchDims], dout_batch_stride[kMaxBatchDims];
  // -- element strides of the sequence (row) and feature (column) dimensions
  long long q_row_stride, q_col_stride, k_row_stride, k_col_stride, v_row_stride, v_col_stride,
            o_row_stride, o_col_stride, dout_row_stride, dout_col_stride;
  // -- elements between the dQ partials of consecutive key tiles (bwd_simt deterministic), else 0
  long long dq_block_stride;
  // -- the score pipeline's run-time part: scale tau, tau * log2(e), causal offset (variant.cuh)
  VariantParams var;
  // -- 4-byte fields
  int batch_shape[kMaxBatchDims];
  int nbatch;                      // product of batch_shape
  int Lq, Lk, d, dv;
  int num_m_blocks, num_n_blocks;  // ceil(Lq / BLOCK_M), ceil(Lk / BLOCK_N) of the launched kernel
  int grid_order;                  // how blockIdx.x maps to (batch item, tile): see grid_tile()
  // -- kBwdDkOut | kBwdDvOut (tensor-core backward only): dk_acc / dv_acc is the gradient
  //    itself, in the input dtype T (no broadcast dimension to sum over), written directly
  //    instead of through a float32 buffer
  int out_flags;
  // -- the modifiers' run-time values (modifiers.cuh; all 0 for plain attention, whose kernels
  //    never read them). Last, so that the fields above keep their offsets.
  ModifierParams mod;
};
constexpr int kBwdDkOut = 1, kBwdDvOut = 2;

// Block i of nbatch * ntiles as (batch item, tile index), for the forward (block_tile, below)
// and the backward (bwd_block_tile):
//   grid_order 0: batch-major: the tiles of one batch item are adjacent, so blocks that run
//                 together share that item's K and V (forward) or Q and dO (backward) in L2;
//   grid_order 1: tile-major: tile 0 of every batch item first, then tile 1, ...; with the
//                 heaviest tile numbered 0, the last wave of a causal grid holds the lightest
//                 tiles (longest-processing-time-first scheduling) instead of whole batch items.
struct GridTile { int b, tile; };

__device__ __forceinline__ GridTile grid_tile(unsigned i, int nbatch, int ntiles, int order) {
  if (order == 1) return {static_cast<int>(i % unsigned(nbatch)), static_cast<int>(i / unsigned(nbatch))};
  return {static_cast<int>(i / unsigned(ntiles)), static_cast<int>(i % unsigned(ntiles))};
}

// The (batch item, Q tile) of forward block `bid` (blockIdx.x); grid.x = nbatch * num_m_blocks.
// The last Q tile (under a causal mask the one that sees the most keys) is tile 0.
struct BlockTile { int b, m_block; };

__device__ __forceinline__ BlockTile block_tile(const Params& p, unsigned bid = blockIdx.x) {
  const GridTile t = grid_tile(bid, p.nbatch, p.num_m_blocks, p.grid_order);
  return {t.b, p.num_m_blocks - 1 - t.tile};   // the last Q tile (the heaviest) first
}

// The (batch item, key tile) of a backward block; grid.x = nbatch * num_n_blocks. Key tile 0
// (under a causal mask the heaviest, seen by every query tile) is tile 0.
struct BwdBlockTile { int b, n_block; };

__device__ __forceinline__ BwdBlockTile bwd_block_tile(const Params& p) {
  const GridTile t = grid_tile(blockIdx.x, p.nbatch, p.num_n_blocks, p.grid_order);
  return {t.b, t.tile};
}

// Element offsets of batch item `b` (C order over batch_shape) in each strided tensor (dout:
// the backward's; the forward's is unused and folds away).
struct BatchOffsets { long long q, k, v, o, dout; };

__device__ __forceinline__ BatchOffsets batch_offsets(const Params& p, int b) {
  BatchOffsets off{0, 0, 0, 0, 0};
#pragma unroll
  for (int i = kMaxBatchDims - 1; i >= 0; --i) {
    const int idx = b % p.batch_shape[i];
    b /= p.batch_shape[i];
    off.q += idx * p.q_batch_stride[i];
    off.k += idx * p.k_batch_stride[i];
    off.v += idx * p.v_batch_stride[i];
    off.o += idx * p.o_batch_stride[i];
    off.dout += idx * p.dout_batch_stride[i];
  }
  return off;
}

// The typed base pointers of batch item b's strided tensors: with block_tile / bwd_block_tile
// and batch_offsets, the prologue of every kernel.
template <typename T> struct BatchPtrs {
  const T* q;
  const T* k;
  const T* v;
  T* o;
  const T* dout;
};

template <typename T>
__device__ __forceinline__ BatchPtrs<T> batch_ptrs(const Params& p, const BatchOffsets& off) {
  return {reinterpret_cast<const T*>(p.q) + off.q, reinterpret_cast<const T*>(p.k) + off.k,
          reinterpret_cast<const T*>(p.v) + off.v, reinterpret_cast<T*>(p.o) + off.o,
          reinterpret_cast<const T*>(p.dout) + off.dout};
}

// -- conversions between storage types and accumulation types
template <typename T> struct AccOf { using type = float; };
template <> struct AccOf<double> { using type = double; };

template <typename Acc, typename T> __device__ __forceinline__ Acc to_acc(T x) { return static_cast<Acc>(x); }
template <> __device__ __forceinline__ float to_acc<float, __half>(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ float to_acc<float, __nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T, typename Acc> __device__ __forceinline__ T from_acc(Acc x) { return static_cast<T>(x); }
template <> __device__ __forceinline__ __half from_acc<__half, float>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_acc<__nv_bfloat16, float>(float x) { return __float2bfloat16_rn(x); }

// Read-only loads through the texture path, and the fused multiply-add of the SIMT kernels'
// products, in the accumulation type.
template <typename T> __device__ __forceinline__ T ldg(const T* p) { return __ldg(p); }
__device__ __forceinline__ float acc_fma(float a, float b, float c) { return fmaf(a, b, c); }
__device__ __forceinline__ double acc_fma(double a, double b, double c) { return fma(a, b, c); }

__device__ __forceinline__ float fast_exp2(float x) { return exp2f(x); }
__device__ __forceinline__ double fast_exp2(double x) { return exp2(x); }

template <typename Acc> __device__ __forceinline__ Acc neg_inf() { return -__int_as_float(0x7f800000); }
template <> __device__ __forceinline__ double neg_inf<double>() { return -__longlong_as_double(0x7ff0000000000000LL); }

}  // namespace cuflash
