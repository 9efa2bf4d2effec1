// cuflash: the steps of the backward pass around the main kernel, shared by every backward
// family (bwd_simt, bwd_sm80, bwd_sm90; the registry's "aux" family):
//
//   bwd_dot_do_o<T>          line 4 of Algorithm 2: D = rowsum(dO o O), run before the main
//                            kernel; it also zeroes the workspace's accumulators (one launch
//                            instead of a memset and a launch: host time per call)
//   bwd_finish_dq<Acc, Out>  after it: dQ from its accumulation buffer, rounded to the output
//                            type once (bwd_simt's DETERMINISTIC mode: the sum of the
//                            per-key-tile partials, in key-tile order)
#include "common.cuh"

namespace cuflash {

// Line 4 of Algorithm 2: D = rowsum(dO o O) in Acc, C-contiguous batch x Lq. A group of G
// lanes reads a row and reduces it with shuffles in a fixed order (so D is bitwise
// reproducible); a warp holds 32 / G rows at a time and walks the nbatch * Lq rows with a
// grid stride (any grid works; the launcher starts a few blocks per SM). D = 0 for a dead row
// (L_i = -inf).
//   Vector path, when every row of o and dO has unit column stride and starts on 16 bytes
//   (pointers, row and batch strides; the common case: o from the forward, dO copied so by the
//   tensor-core launchers) and dv is a multiple of 16 / sizeof(T): each lane loads 16 bytes a
//   step, G = the power of two that covers dv in one step (at most 32: d = 64 in bf16 is 8
//   lanes, 4 rows a warp). Otherwise (any strides; float64, whose vector path spills on
//   sm_70) one element a lane and step, G = 32.
// (Uniform over the grid, so every lane of a warp takes the same path to the shuffles.)
//   ROWS > 1 (session 14; 16-bit T only): in the vector path where one 16-byte chunk a lane
// covers a row (group * kVec >= dv: every dv <= 256), a lane group loads ROWS rows before it
// reduces any, so each warp has ROWS times the bytes in flight (bwd_io::block_row_dots' pattern),
// and the rows of a warp's step share the batch item's base pointers (one batch_offsets a step,
// not one a row, where the step stays inside one item). Each row's sum is the same
// chunk_dot + group_sum, so D is bitwise the ROWS = 1 result.
//   First, the `zero_bytes` bytes from p.dq_acc are zeroed: the accumulators the main kernel
// adds into (dQ's, the semaphores, dL/dbias: the launcher lays them out first in its
// workspace, 256-byte aligned, so the span is whole 16-byte words). The main kernel runs after
// this one on the same stream, so it sees them zeroed.
template <typename T, int ROWS = 1>
__global__ void __launch_bounds__(256) bwd_dot_do_o(const Params p, long long zero_bytes) {
  static_assert(ROWS >= 1 && ROWS <= 8, "rows a lane group loads before reducing");
  using Acc = typename AccOf<T>::type;
  {
    uint4* const z = reinterpret_cast<uint4*>(p.dq_acc);
    const long long words = zero_bytes / 16;
#pragma unroll 1   // unrolled, the float64 build spilled 4 bytes on sm_70
    for (long long e = blockIdx.x * 256LL + threadIdx.x; e < words; e += gridDim.x * 256LL)
      z[e] = make_uint4(0u, 0u, 0u, 0u);
  }
  constexpr int kVec = 16 / int(sizeof(T));
  bool vec = sizeof(T) < 8 && p.o_col_stride == 1 && p.dout_col_stride == 1 && p.dv % kVec == 0 &&
             ((p.o | p.dout) & 15) == 0 && p.o_row_stride % kVec == 0 && p.dout_row_stride % kVec == 0;
#pragma unroll
  for (int i = 0; i < kMaxBatchDims; ++i)
    vec = vec && p.o_batch_stride[i] % kVec == 0 && p.dout_batch_stride[i] % kVec == 0;
  int group = 32;   // lanes a row
  if (vec)
    while (group > 1 && (group / 2) * kVec >= p.dv) group /= 2;
  const int lane = int(threadIdx.x) % 32, gl = lane % group;
  const int rows_per_warp = 32 / group;
  const long long total = (long long)p.nbatch * p.Lq;
  const long long warp0 = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / 32;
  const long long stride = (long long)gridDim.x * blockDim.x / 32 * rows_per_warp;
  if constexpr (ROWS > 1 && sizeof(T) == 2) {   // (float32's ROWS build spilled 4 bytes)
    if (vec && group * kVec >= p.dv) {   // (uniform over the grid)
      const bool lane_cols = gl * kVec < p.dv;
      const long long step = rows_per_warp * ROWS;   // rows a warp covers a step
      Acc* const dst = reinterpret_cast<Acc*>(p.dpsum);
      const Acc* const lse = reinterpret_cast<const Acc*>(p.lse);
#pragma unroll 1
      for (long long first = warp0 * step; first < total; first += stride * ROWS) {
        // the step's batch item and its base pointers, once (rows past it: their own)
        const int b0 = int(first / p.Lq);
        const long long i0 = (long long)b0 * p.Lq;
        const BatchPtrs<T> g0 = batch_ptrs<T>(p, batch_offsets(p, b0));
        uint4 x[ROWS], y[ROWS];
#pragma unroll
        for (int u = 0; u < ROWS; ++u) {
          const long long r = first + u * rows_per_warp + lane / group;
          x[u] = y[u] = uint4{0u, 0u, 0u, 0u};
          if (r < total && lane_cols) {
            BatchPtrs<T> g = g0;
            long long i = r - i0;
            if (i >= p.Lq) {   // (the step crosses into the next item: rare)
              g = batch_ptrs<T>(p, batch_offsets(p, int(r / p.Lq)));
              i = r % p.Lq;
            }
            x[u] = __ldg(reinterpret_cast<const uint4*>(g.dout + i * p.dout_row_stride) + gl);
            y[u] = __ldg(reinterpret_cast<const uint4*>(g.o + i * p.o_row_stride) + gl);
          }
        }
#pragma unroll
        for (int u = 0; u < ROWS; ++u) {
          const Acc sum = group_sum(chunk_dot<T>(x[u], y[u], Acc(0)), group);
          const long long r = first + u * rows_per_warp + lane / group;
          if (gl == 0 && r < total) dst[r] = (lse[r] == neg_inf<Acc>()) ? Acc(0) : sum;
        }
      }
      return;
    }
  }
  for (long long first = warp0 * rows_per_warp; first < total; first += stride) {
    const long long r = first + lane / group;   // this lane group's row (b, i)
    Acc sum = Acc(0);
    if (r < total) {
      const int b = int(r / p.Lq), i = int(r % p.Lq);
      const BatchPtrs<T> gmem = batch_ptrs<T>(p, batch_offsets(p, b));
      const T* const go = gmem.o + i * p.o_row_stride;
      const T* const gdo = gmem.dout + i * p.dout_row_stride;
      if (vec) {
        for (int c = gl * kVec; c < p.dv; c += group * kVec) {
          sum = chunk_dot<T>(__ldg(reinterpret_cast<const uint4*>(gdo + c)),
                             __ldg(reinterpret_cast<const uint4*>(go + c)), sum);
        }
      } else {
        for (int c = gl; c < p.dv; c += group)
          sum = acc_fma(to_acc<Acc>(ldg(gdo + c * p.dout_col_stride)),
                             to_acc<Acc>(ldg(go + c * p.o_col_stride)), sum);
      }
    }
    sum = group_sum(sum, group);
    if (gl == 0 && r < total) {
      const Acc lse = reinterpret_cast<const Acc*>(p.lse)[r];
      reinterpret_cast<Acc*>(p.dpsum)[r] = (lse == neg_inf<Acc>()) ? Acc(0) : sum;
    }
  }
}

// dQ from its accumulation buffer: dq[e] = partial[e] + partial[n + e] + ... (`parts` slices of
// n elements, added in slice order, so the result is bitwise the same on every run; one slice
// except in bwd_simt's DETERMINISTIC mode, where slice t is key tile t's dQ), rounded once to
// Out: the input dtype T where dq is the result itself, Acc where the launcher still has to sum
// it over broadcast dimensions. Grid-stride over the n = nbatch * Lq * d elements.
//   VEC4: the same sums four elements a thread and step, with 16-byte loads of the float32
// slices and one 8- or 16-byte store of the four results (n % 4 == 0, both pointers on 16
// bytes: the launcher's conditions): dQ of the 16-bit and float32 inputs (session 14), and
// dL/dbias summed over the bias's broadcast batch items (cuflash/_plan_mods.py, dbias_finish),
// gigabytes at L = 4k, where the loads in flight a thread decide the bandwidth. Bitwise the
// scalar result. (A float64 Acc takes the scalar loop whatever VEC4 says.)
template <typename Acc, typename Out, bool VEC4 = false>
__global__ void __launch_bounds__(256) bwd_finish_dq(const Acc* partial, Out* dq, long long n, int parts) {
  if constexpr (VEC4 && sizeof(Acc) == 4) {
    static_assert(sizeof(Out) == 2 || sizeof(Out) == 4, "16-bit or float32 results");
    const float4* const p4 = reinterpret_cast<const float4*>(partial);
    const long long n4 = n / 4;
    for (long long e = blockIdx.x * 256LL + threadIdx.x; e < n4; e += gridDim.x * 256LL) {
      float4 sum = p4[e];
      for (int t = 1; t < parts; ++t) {
        const float4 x = p4[t * n4 + e];
        sum.x += x.x; sum.y += x.y; sum.z += x.z; sum.w += x.w;
      }
      if constexpr (sizeof(Out) == 2) {   // four 16-bit results: one 8-byte store
        alignas(8) Out out[4] = {from_acc<Out, float>(sum.x), from_acc<Out, float>(sum.y),
                                 from_acc<Out, float>(sum.z), from_acc<Out, float>(sum.w)};
        reinterpret_cast<uint2*>(dq)[e] = *reinterpret_cast<const uint2*>(out);
      } else {                             // float32 (a sum still to be summed): one 16 bytes
        reinterpret_cast<float4*>(dq)[e] = sum;
      }
    }
  } else {
    for (long long e = blockIdx.x * 256LL + threadIdx.x; e < n; e += gridDim.x * 256LL) {
      Acc sum = partial[e];
      for (int t = 1; t < parts; ++t) sum += partial[t * n + e];
      dq[e] = from_acc<Out, Acc>(sum);
    }
  }
}

}  // namespace cuflash
