// cuflash: split-KV decode (Flash-Decoding) over a dense or paged KV cache, and the in-place
// append of new keys and values.
//
// decode_split: one block per (batch row b, kv head h, tile of ROWS packed query rows, key split).
// The query rows of a block are the G query heads of h's GQA group times the Lq queries
// (row r = g * Lq + i), so each K/V row read from memory serves all of them. The keys of the
// batch row are cut into num_splits contiguous ranges, one per block; each block runs an online
// softmax over its range and writes a normalised partial (o, lse); combine.cu merges the
// partials in split order (with num_splits == 1 the block writes the result itself), or, in
// the FUSE build, the last block of each group to finish does (merge_splits_if_last).
//
// Why plain FMA and no tensor cores: decode reads every K/V byte once and does 2 * ROWS FLOPs a
// byte-pair (ROWS <= 8), far below the ~100 FLOP/byte at which an H200 stops being
// memory-bound. What matters is keeping enough bytes in flight: a key row is read by LANES =
// HEAD_DIM / 8 lanes, 16 bytes (8 half elements) each; a thread issues the K and V loads of
// kUnroll keys (2 * kUnroll independent 16-byte loads, 128 bytes for half) before using any,
// so a 128-thread block has 16 KB in flight and an SM with 4-6 resident blocks 64-96 KB, well
// above the ~20 KB an SM needs to cover ~600 ns of latency at 4.3 TB/s. Consecutive key groups
// read consecutive key rows, so a warp's loads are contiguous runs of 256+ bytes.
//
// Scores: a lane holds 8 query elements of each row (pre-multiplied by scale * log2(e)) and the
// 8 matching key elements; the LANES partial dot products are summed by an xor butterfly, which
// leaves the same (bitwise) total in every lane of the group, so the whole group runs the same
// online-softmax update. Each key group keeps its own (m, l, acc); the groups of a block are
// merged through shared memory at the end, in a fixed order: results are bitwise reproducible
// for a given split count.
//
// decode_append: writes k_new / v_new rows at positions total_keys(b) - Lnew + t of the cache.
#include "decode_params.cuh"

namespace cuflash {
namespace decode {

template <typename T, int HEAD_DIM, int ROWS>
struct DecodeTraits {
  static constexpr int kThreads = 128;
  static constexpr int kElems = 8;                          // elements of a row a lane holds
  static constexpr int kLanes = HEAD_DIM / kElems;          // lanes sharing one key row
  static constexpr int kGroups = kThreads / kLanes;         // key rows a block reads at once
  static constexpr int kChunks = Vec8<T>::kChunks;          // 16-byte loads per lane and row
  // keys a key group loads before using any: 2 * kUnroll * kChunks 16-byte loads in flight
  static constexpr int kUnroll = kChunks == 1 ? 4 : 2;
  static constexpr int kKeysPerIter = kGroups * kUnroll;
  // dynamic shared memory: accumulators, maxima and sums of every key group (_traits.decode)
  static constexpr int kSmemBytes = kGroups * ROWS * (HEAD_DIM + 2) * 4;
  // blocks an SM must hold (the register cap through __launch_bounds__): the heuristic's wave
  // size, _traits.DECODE's min_blocks (minus one for float32, whose 8 elements take two 16-byte
  // loads, and 2 or 4 rows on sm_70, which converts half types in software: else they spill).
  // 15-24 warps an SM keep 48-96 KB of loads in flight.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  static constexpr int kSlow = (ROWS == 2 || ROWS == 4) ? 1 : 0;
#else
  static constexpr int kSlow = 0;
#endif
  static constexpr int kMinBlocks =
      (ROWS <= 2 ? 5 : ROWS == 4 ? 4 : 2) - (ROWS < 8 && (sizeof(T) == 4 || kSlow) ? 1 : 0);
  static_assert(HEAD_DIM % kElems == 0 && kLanes >= 1 && kLanes <= 32 && 32 % kLanes == 0,
                "a key row is read by a power-of-two number of lanes within one warp");
  static_assert(ROWS >= 1 && ROWS <= 8, "ROWS * 8 accumulators a thread: more would spill");
  static_assert(kSmemBytes <= 48 * 1024, "no opt-in above 48 KB needed (nor wanted: occupancy)");
};

// Sum over the kLanes lanes of a key group (xor butterfly: every lane gets the same total).
template <int LANES>
__device__ __forceinline__ float group_sum(float x) {
#pragma unroll
  for (int off = LANES / 2; off >= 1; off /= 2) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}

// FUSE: with num_splits > 1 the group's last block merges the splits itself
// (merge_splits_if_last, decode_params.cuh), as decode_mma's FUSE build; without it (one split,
// or CUFLASH_DECODE_FUSE=0) the machine code is the build's from before the flag.
template <typename T, int HEAD_DIM, int ROWS, typename Variant, bool FUSE = false>
__global__ void __launch_bounds__(128, (DecodeTraits<T, HEAD_DIM, ROWS>::kMinBlocks))
decode_split(const DecodeParams p) {
  using Tr = DecodeTraits<T, HEAD_DIM, ROWS>;
  constexpr int E = Tr::kElems, LANES = Tr::kLanes, GROUPS = Tr::kGroups, U = Tr::kUnroll,
                C = Tr::kChunks;
  // dynamic shared memory (Tr::kSmemBytes): the key groups' accumulators, maxima and sums
  extern __shared__ float4 smem_[];
  float (*s_acc)[ROWS][HEAD_DIM] = reinterpret_cast<float (*)[ROWS][HEAD_DIM]>(smem_);
  float (*s_m)[ROWS] = reinterpret_cast<float (*)[ROWS]>(reinterpret_cast<float*>(smem_) + GROUPS * ROWS * HEAD_DIM);
  float (*s_l)[ROWS] = reinterpret_cast<float (*)[ROWS]>(reinterpret_cast<float*>(smem_) + GROUPS * ROWS * (HEAD_DIM + 1));

  const int lane = threadIdx.x % LANES;      // which 8 columns of a row
  const int grp = threadIdx.x / LANES;       // which key rows
  const int col = lane * E;
  const bool k_col = col < p.d, v_col = col < p.dv;   // d, dv are multiples of 8

  // blockIdx.x = ((b * Hkv + h) * row_tiles + tile) * num_splits + split
  const int split = blockIdx.x % p.num_splits;
  const int rest = blockIdx.x / p.num_splits;
  const int tile = rest % p.row_tiles;
  const int bh = rest / p.row_tiles;
  const int b = bh / p.Hkv, h = bh % p.Hkv;
  const int rows_total = p.G * p.Lq;

  const int n = total_keys(p, b);          // keys this batch row attends to
  // Split `split` covers [start, end): ranges of whole iterations, as even as they can be.
  const int iters = (n + Tr::kKeysPerIter - 1) / Tr::kKeysPerIter;
  const int per_split = (iters + p.num_splits - 1) / p.num_splits;
  const int start = min(n, split * per_split * Tr::kKeysPerIter);
  const int end = min(n, start + per_split * Tr::kKeysPerIter);

  // The query rows of this tile, scaled by tau * log2(e); rows past G * Lq are zero and unused.
  float q[ROWS][E];
  int last_key[ROWS];                      // causal: the last key row r sees
  const float sl2 = static_cast<float>(p.var.scale_log2);
  const T* qbase = reinterpret_cast<const T*>(p.q);
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    const int row = tile * ROWS + r;
    const int g = row / p.Lq, i = row % p.Lq;
    last_key[r] = n - p.Lq + i;            // bottom-right: query i sits at position n - Lq + i
    if (row < rows_total && k_col) {
      uint4 c[C];
      const uint4* src = reinterpret_cast<const uint4*>(
          qbase + b * p.q_b + h * p.q_h + g * p.q_g + i * p.q_row + col);
#pragma unroll
      for (int x = 0; x < C; ++x) c[x] = __ldg(src + x);
      Vec8<T>::to_float(c, q[r]);
#pragma unroll
      for (int e = 0; e < E; ++e) q[r][e] *= sl2;
    } else {
#pragma unroll
      for (int e = 0; e < E; ++e) q[r][e] = 0.f;
    }
  }

  float m[ROWS], l[ROWS], acc[ROWS][E];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    m[r] = kNegInf;
    l[r] = 0.f;
#pragma unroll
    for (int e = 0; e < E; ++e) acc[r][e] = 0.f;
  }

  const T* kc = reinterpret_cast<const T*>(p.k_cache) + h * p.k_h + col;
  const T* vc = reinterpret_cast<const T*>(p.v_cache) + h * p.v_h + col;
  // Where this iteration's keys live. A key past `end` is read at `end - 1` instead (inside the
  // cache, masked below), so every load is unconditional. Paged: the page-table entries are read
  // one iteration ahead, so the K/V loads never wait for them.
  KeySlot at[U];
  if (start < end) {
#pragma unroll
    for (int u = 0; u < U; ++u) at[u] = key_slot(p, b, min(start + u * GROUPS + grp, end - 1));
  }
  for (int base = start; base < end; base += Tr::kKeysPerIter) {
    // -- issue every load of this iteration before using any (2 * U * C 16-byte loads)
    uint4 kb[U][C], vb[U][C];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const long long ko = at[u].row * p.k_b + at[u].pos * p.k_row;
      const long long vo = at[u].row * p.v_b + at[u].pos * p.v_row;
#pragma unroll
      for (int x = 0; x < C; ++x) {
        // lanes past d (dv) load nothing: zeros (a clamped column instead of the branch costs
        // registers: 4 rows spill at 4 blocks an SM)
        kb[u][x] = k_col ? __ldg(reinterpret_cast<const uint4*>(kc + ko) + x) : make_uint4(0, 0, 0, 0);
        vb[u][x] = v_col ? __ldg(reinterpret_cast<const uint4*>(vc + vo) + x) : make_uint4(0, 0, 0, 0);
      }
    }
    // -- the next iteration's key slots (its page-table reads overlap this iteration's math)
    const int next = base + Tr::kKeysPerIter;
    if (next < end) {
#pragma unroll
      for (int u = 0; u < U; ++u) at[u] = key_slot(p, b, min(next + u * GROUPS + grp, end - 1));
    }
    // -- scores s[r][u] (log2 units), masked keys -inf
    float s[ROWS][U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float kf[E];
      Vec8<T>::to_float(kb[u], kf);
      const int j = base + u * GROUPS + grp;
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        float dot = 0.f;
#pragma unroll
        for (int e = 0; e < E; ++e) dot = fmaf(q[r][e], kf[e], dot);
        dot = group_sum<LANES>(dot);
        const bool visible = j < end && (!Variant::kCausal || j <= last_key[r]);
        s[r][u] = visible ? dot : kNegInf;
      }
    }
    // -- online softmax update of each row. A row that has seen only masked keys keeps
    //    m = -inf; its exponentials are taken against 0 instead, so -inf - -inf (NaN) never
    //    arises and its p, l, acc stay 0.
    float vf[U][E];
#pragma unroll
    for (int u = 0; u < U; ++u) Vec8<T>::to_float(vb[u], vf[u]);
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      float mx = m[r];
#pragma unroll
      for (int u = 0; u < U; ++u) mx = fmaxf(mx, s[r][u]);
      const float ref = mx == kNegInf ? 0.f : mx;
      const float alpha = exp2f(m[r] - ref);
      m[r] = mx;
      float pr[U];
      float psum = 0.f;
#pragma unroll
      for (int u = 0; u < U; ++u) { pr[u] = exp2f(s[r][u] - ref); psum += pr[u]; }
      l[r] = l[r] * alpha + psum;
#pragma unroll
      for (int e = 0; e < E; ++e) {
        float a = acc[r][e] * alpha;
#pragma unroll
        for (int u = 0; u < U; ++u) a = fmaf(pr[u], vf[u][e], a);
        acc[r][e] = a;
      }
    }
  }

  // -- merge the key groups of the block: each group rescales to the block's max, then the
  //    groups are summed in group order (fixed: reproducible)
  if (lane == 0) {
#pragma unroll
    for (int r = 0; r < ROWS; ++r) { s_m[grp][r] = m[r]; s_l[grp][r] = l[r]; }
  }
  __syncthreads();
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    float mx = kNegInf;
#pragma unroll
    for (int g2 = 0; g2 < GROUPS; ++g2) mx = fmaxf(mx, s_m[g2][r]);
    const float ref = mx == kNegInf ? 0.f : mx;
    const float f = exp2f(m[r] - ref);
#pragma unroll
    for (int e = 0; e < E; ++e) s_acc[grp][r][col + e] = acc[r][e] * f;
  }
  __syncthreads();

  const int ncols = p.dv;
  for (int idx = threadIdx.x; idx < ROWS * ncols; idx += Tr::kThreads) {
    const int r = idx / ncols, c = idx % ncols;
    const int row = tile * ROWS + r;
    if (row >= rows_total) continue;
    float mx = kNegInf;
#pragma unroll
    for (int g2 = 0; g2 < GROUPS; ++g2) mx = fmaxf(mx, s_m[g2][r]);
    const float ref = mx == kNegInf ? 0.f : mx;
    float lsum = 0.f, osum = 0.f;
#pragma unroll
    for (int g2 = 0; g2 < GROUPS; ++g2) {
      const float f = exp2f(s_m[g2][r] - ref);
      lsum = fmaf(s_l[g2][r], f, lsum);
      osum += s_acc[g2][r][c];
    }
    store_row<T>(p, b, h, bh, rows_total, row, split, c, mx, lsum, osum, p.num_splits);
  }
  // -- the combine of the splits, by the group's last block: the accumulators' region holds the
  //    weights (ROWS x (num_splits + 1) floats <= 516 ROWS bytes, of >= 4 KB ROWS), the maxima's
  //    the flag (s_m, s_l, s_acc are read for the last time above; the fence's barrier orders it)
  if (FUSE && p.num_splits > 1)
    merge_splits_if_last<T, Tr::kThreads>(p, rest, bh, rows_total, tile * ROWS,
                                          min(ROWS, rows_total - tile * ROWS),
                                          reinterpret_cast<float*>(smem_),
                                          reinterpret_cast<int*>(&s_l[0][0]), p.num_splits);
}

// One block of 128 threads per (batch row, kv head, appended row t); threads over the columns. Writes
// k_new[b, h, t] to cache position total_keys(b) - Lnew + t (through block_table when paged).
template <typename T>
__global__ void __launch_bounds__(128)
decode_append(const DecodeParams p) {
  const int t = blockIdx.x % p.Lnew;
  const int bh = blockIdx.x / p.Lnew;
  const int b = bh / p.Hkv, h = bh % p.Hkv;
  const int pos = total_keys(p, b) - p.Lnew + t;
  const T* kn = reinterpret_cast<const T*>(p.k_new) + b * p.kn_b + h * p.kn_h + t * p.kn_row;
  const T* vn = reinterpret_cast<const T*>(p.v_new) + b * p.vn_b + h * p.vn_h + t * p.vn_row;
  const KeySlot at = key_slot(p, b, pos);
  T* kc = reinterpret_cast<T*>(p.k_cache) + h * p.k_h + at.row * p.k_b + at.pos * p.k_row;
  T* vc = reinterpret_cast<T*>(p.v_cache) + h * p.v_h + at.row * p.v_b + at.pos * p.v_row;
  // (not unrolled: unrolled, ptxas spills the float/double builds at its own 32-register pick)
#pragma unroll 1
  for (int c = threadIdx.x; c < p.d; c += 128) kc[c] = kn[c * p.kn_col];
#pragma unroll 1
  for (int c = threadIdx.x; c < p.dv; c += 128) vc[c] = vn[c * p.vn_col];
}

}  // namespace decode
}  // namespace cuflash
