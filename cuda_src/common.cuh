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
  //    and dpsum batch x Lq); dq_sem: bwd_sm80's deterministic-mode semaphores, or the arrival
  //    counters of dQ's fused finishing (kBwdDqOut) (nbatch x ceil(Lq / BLOCK_M) zeroed ints),
  //    else 0. The forward leaves the backward's fields 0.
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
  // -- varlen (helper "inference"): the number of work items and the device pointer of the
  //    work list (VarlenItem, below) of a varlen build; 0 in every other launch.
  int varlen_items;
  unsigned long long varlen;
  // -- the modifiers' run-time values (modifiers.cuh; all 0 for plain attention, whose kernels
  //    never read them). The varlen fields and these come last, so that the fields above keep
  //    their offsets.
  ModifierParams mod;
  // -- dq, the result itself (C-contiguous batch x Lq x d, in T) where out_flags has kBwdDqOut:
  //    the main kernel rounds dQ into it (bwd_io::finish_dq_at_end); else 0. Last, as the
  //    fields above it.
  unsigned long long dq;
};
// kBwdOwnD (bwd_sm90's ONE_LAUNCH builds): the main kernel computes D = rowsum(dO o O) of its
// query rows itself (bwd_io::block_row_dots) and leaves dq_acc and dq_sem zeroed: no
// bwd_dot_do_o launch before it (cuflash/_plan_one.py)
constexpr int kBwdDkOut = 1, kBwdDvOut = 2, kBwdDqOut = 4, kBwdOwnD = 8;

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

// ---- varlen (helper "inference", issue 11). Sequences packed along the length axis
// (cuflash.attention_varlen) run as ONE launch of a forward family compiled with
// CUFLASH_VARLEN defined (cuflash/_inference_varlen.py prefixes the source with it; the plain
// builds never see it, so their preprocessed text, hence their machine code, is unchanged).
// Grid: nbatch x varlen_items blocks, item-major: block bid runs work item bid / nbatch for
// batch item (head) bid % nbatch, so the whole grid runs in the list's order, heaviest first
// (longest-processing-time-first over every head, not within one: the last wave holds the
// lightest tiles of all heads). The host-made work list holds one item per
// (sequence, tile): where the sequence's queries and keys start in the packed arrays, its
// lengths, the tile (the forward's Q tile, the backward's key tile) and the causal offset of
// that sequence. A kernel's prologue turns its Params into the view of its block's sequence
// (varlen_view: pointers advanced to the sequence, Lq / Lk / causal_offset of the sequence),
// and block_tile / bwd_block_tile return the item's tile; the rest of the kernel is the plain
// one (EVEN = false: per-sequence bounds).
struct VarlenItem { int q0, Lq, k0, Lk, tile, causal_offset; };

#ifdef CUFLASH_VARLEN
// item-major: the batch item of block bid, and its work item (the list's row)
__device__ __forceinline__ unsigned varlen_batch(const Params& p, unsigned bid) {
  return bid % unsigned(p.nbatch);
}
__device__ __forceinline__ VarlenItem varlen_item(const Params& p, unsigned bid) {
  const uint4* w = reinterpret_cast<const uint4*>(p.varlen) + 2 * (bid / unsigned(p.nbatch));
  const uint4 a = __ldg(w), c = __ldg(w + 1);
  return {int(a.x), int(a.y), int(a.z), int(a.w), int(c.x), int(c.y)};
}
#endif

__device__ __forceinline__ BlockTile block_tile(const Params& p, unsigned bid = blockIdx.x) {
#ifdef CUFLASH_VARLEN
  return {static_cast<int>(varlen_batch(p, bid)), varlen_item(p, bid).tile};
#else
  const GridTile t = grid_tile(bid, p.nbatch, p.num_m_blocks, p.grid_order);
  return {t.b, p.num_m_blocks - 1 - t.tile};   // the last Q tile (the heaviest) first
#endif
}

// The (batch item, key tile) of a backward block; grid.x = nbatch * num_n_blocks. Key tile 0
// (under a causal mask the heaviest, seen by every query tile) is tile 0.
struct BwdBlockTile { int b, n_block; };

__device__ __forceinline__ BwdBlockTile bwd_block_tile(const Params& p) {
#ifdef CUFLASH_VARLEN
  return {static_cast<int>(varlen_batch(p, blockIdx.x)), varlen_item(p, blockIdx.x).tile};
#else
  const GridTile t = grid_tile(blockIdx.x, p.nbatch, p.num_n_blocks, p.grid_order);
  return {t.b, t.tile};
#endif
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

// The same offsets with fewer instructions (fwd_sm90's LEAN builds, session 11: the window, a
// block mask's short lists, whose query tiles see few key tiles): b is decomposed from the innermost dim outwards, a dim divides only where the
// rest of b reaches its extent (else the index is the rest itself), and the walk stops once
// the rest is 0 (the outer dims' indices are 0: they add nothing). The launcher merges what it
// can, so the usual (B, H) batch is one dim of B H: one compare, no division, where
// batch_offsets pays four signed divisions and modulos and sixteen 64-bit products (~150
// instructions a warp, the dims of extent 1 included). b >= 0 and extents >= 1, so unsigned
// arithmetic gives the same indices.
__device__ __forceinline__ BatchOffsets batch_offsets_short(const Params& p, int b) {
  BatchOffsets off{0, 0, 0, 0, 0};
  unsigned rest = static_cast<unsigned>(b);
#pragma unroll
  for (int i = kMaxBatchDims - 1; i >= 0; --i) {
    const unsigned n = static_cast<unsigned>(p.batch_shape[i]);
    unsigned idx = rest;
    if (rest >= n) {
      idx = rest % n;
      rest /= n;
    } else {
      rest = 0;
    }
    off.q += static_cast<long long>(idx) * p.q_batch_stride[i];
    off.k += static_cast<long long>(idx) * p.k_batch_stride[i];
    off.v += static_cast<long long>(idx) * p.v_batch_stride[i];
    off.o += static_cast<long long>(idx) * p.o_batch_stride[i];
    off.dout += static_cast<long long>(idx) * p.dout_batch_stride[i];
    if (rest == 0) break;
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

// The Params of block `bid`'s sequence in a varlen build (see VarlenItem): q, k, v, o, dO
// advanced to the sequence's first rows; the per-row buffers that the kernels index as
// `buf + (b * Lq + row) * width` (lse, D, dQ's accumulator; dK, dV's with Lk) advanced so that
// with the sequence's Lq (Lk) they land on row q0 (k0) of batch item b's packed rows (packed
// lengths: in.Lq, in.Lk); the sequence's Lq, Lk and causal offset. The forward's backward-only
// pointers are 0 and stay unused. Not for the deterministic modes (dq_sem, dq_block_stride:
// the host never builds those in varlen). In a kernel: `fwd(const Params
// CUFLASH_VARLEN_PARAM(p))` and `CUFLASH_VARLEN_VIEW(T, p)` as its first statement; both expand
// to nothing new in a plain build.
#ifdef CUFLASH_VARLEN
template <typename T, typename Acc>
__device__ __forceinline__ Params varlen_view(const Params& in, unsigned bid) {
  using u64 = unsigned long long;
  const VarlenItem it = varlen_item(in, bid);
  // packed row of row 0: b * packed length + q0 - b * sequence length. The differences are >= 0
  // (a sequence is part of the packed length): 32-bit unsigned factors, a 64 x 32-bit product
  // (as 64 x 64 bits, item-major's b spilled fwd_sm90 d 64 causal and bwd_simt float64 d 256)
  const u64 b = varlen_batch(in, bid);
  const u64 qrow = b * static_cast<unsigned>(in.Lq - it.Lq) + it.q0;
  const u64 krow = b * static_cast<unsigned>(in.Lk - it.Lk) + it.k0;
  Params p = in;
  p.q += sizeof(T) * static_cast<u64>(it.q0 * in.q_row_stride);
  p.k += sizeof(T) * static_cast<u64>(it.k0 * in.k_row_stride);
  p.v += sizeof(T) * static_cast<u64>(it.k0 * in.v_row_stride);
  p.o += sizeof(T) * static_cast<u64>(it.q0 * in.o_row_stride);
  p.dout += sizeof(T) * static_cast<u64>(it.q0 * in.dout_row_stride);
  p.lse += sizeof(Acc) * qrow;
  p.dpsum += sizeof(Acc) * qrow;
  p.dq_acc += sizeof(Acc) * qrow * in.d;
  p.dk_acc += ((in.out_flags & kBwdDkOut) ? sizeof(T) : sizeof(Acc)) * krow * in.d;
  p.dv_acc += ((in.out_flags & kBwdDvOut) ? sizeof(T) : sizeof(Acc)) * krow * in.dv;
  p.Lq = it.Lq;
  p.Lk = it.Lk;
  p.var.causal_offset = it.causal_offset;
  return p;
}
#define CUFLASH_VARLEN_PARAM(p) p##_packed
#define CUFLASH_VARLEN_VIEW(T, p) \
  const ::cuflash::Params p = \
      ::cuflash::varlen_view<T, typename ::cuflash::AccOf<T>::type>(p##_packed, blockIdx.x);
#else
#define CUFLASH_VARLEN_PARAM(p) p
#define CUFLASH_VARLEN_VIEW(T, p)
#endif

// Whether a forward build with schedule argument PERSIST runs its block's items in a loop
// (fwd_sm90's and fwd_sm90ws's persistent grids): never in a varlen build, whose block's work
// item is its sequence's.
template <int PERSIST>
__device__ constexpr bool persistent_loop() {
#ifdef CUFLASH_VARLEN
  return false;
#else
  return PERSIST != 0;
#endif
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

// Line 4 of Algorithm 2's pieces (D = rowsum(dO o O): bwd_prep.cu's bwd_dot_do_o, and
// bwd_io::block_row_dots in bwd_sm90's one-launch builds), so that both add in one order and
// give the same bits: the products of two 16-byte chunks of T added to `sum` element by element,
// and the butterfly sum over a group of `group` lanes (a power of two <= 32; every lane of the
// group gets it).
template <typename T, typename Acc>
__device__ __forceinline__ Acc chunk_dot(const uint4& x, const uint4& y, Acc sum) {
  const T* const xv = reinterpret_cast<const T*>(&x);
  const T* const yv = reinterpret_cast<const T*>(&y);
#pragma unroll
  for (int e = 0; e < 16 / int(sizeof(T)); ++e) sum = acc_fma(to_acc<Acc>(xv[e]), to_acc<Acc>(yv[e]), sum);
  return sum;
}
template <typename Acc>
__device__ __forceinline__ Acc group_sum(Acc sum, int group) {
  for (int o = group / 2; o > 0; o /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  return sum;
}

__device__ __forceinline__ float fast_exp2(float x) { return exp2f(x); }
__device__ __forceinline__ double fast_exp2(double x) { return exp2(x); }

template <typename Acc> __device__ __forceinline__ Acc neg_inf() { return -__int_as_float(0x7f800000); }
template <> __device__ __forceinline__ double neg_inf<double>() { return -__longlong_as_double(0x7ff0000000000000LL); }

}  // namespace cuflash
