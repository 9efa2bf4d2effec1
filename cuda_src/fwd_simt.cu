// cuflash: the generic forward kernel (FlashAttention-2, Algorithm 1) on plain CUDA cores.
//
// Runs on every GPU from sm_70 and in every dtype (float16, bfloat16, float32, float64); it is
// the exact path for float32 and float64. No tensor cores, no cp.async: a register-tiled SIMT
// GEMM in the style of a classic SGEMM kernel, fused with the online softmax. (It compiles for
// sm_70 with NVRTC 12; NVRTC 13, which cupy-cuda13x brings, starts at sm_75.)
//
// One thread block owns BLOCK_M query rows of one batch item and streams all visible key
// tiles (BLOCK_N keys each) past them. Shared memory holds
//     sQ  BLOCK_M x HEAD_DIM      the query tile, resident for the whole block
//     sP  BLOCK_N x BLOCK_M       P~_ij of the current key tile, transposed (key-major)
//     sS  2 x stage               K and V chunks, double-buffered
// K_j and V_j pass through the two staging buffers in chunks (KC features of all BLOCK_N keys
// of K_j, then VC keys of all HEAD_DIM features of V_j) so that shared memory stays under the
// 64 KB every sm_70+ GPU grants one block; the next chunk is fetched from global memory into
// registers while the current one is multiplied, so one __syncthreads per chunk suffices.
//
// Thread layout: the NTHREADS threads form a THREADS_M x THREADS_N grid. Thread (ty, tx) owns
//     query rows   ty*TM + i                      i < TM        (same rows for S and O)
//     key columns  tx + j*THREADS_N               j < TN        of S_ij (strided: conflict-free)
//     out columns  g*GV*THREADS_N + tx*GV + e      g*GV + e < DN of O_i (16-byte groups)
// The THREADS_N threads of a row group are consecutive lanes of one warp, so row max and row
// sum are warp-shuffle reductions, and every thread keeps its own copy of m_i and l_i for its
// TM rows: all softmax state is per row, so a NaN in one query row cannot reach another.
// (A NaN or Inf in V row j reaches, besides the rows that see key j, the rows of the same
// query tile that mask j inside a diagonal key tile, through 0 * NaN in P~V; tiles wholly
// above the diagonal are never read. The float64 reference spreads it to every row.)
//
// Tile sizes come from the launcher (cuflash/_traits.py, the one place they are chosen)
// as template arguments; SimtTraits derives everything else and static_asserts the rules.
#include "common.cuh"

namespace cuflash {
namespace simt {

// blockIdx.x through a volatile read: the compiler cannot merge two reads, so the epilogue
// recomputes its output offsets instead of holding them in registers through the main loop.
__device__ __forceinline__ unsigned block_id() {
  unsigned x;
  asm volatile("mov.u32 %0, %%ctaid.x;" : "=r"(x));
  return x;
}

__device__ __forceinline__ float acc_max(float a, float b) { return fmaxf(a, b); }   // NaN-ignoring
__device__ __forceinline__ double acc_max(double a, double b) { return fmax(a, b); }
__device__ __forceinline__ float acc_log2(float x) { return log2f(x); }
__device__ __forceinline__ double acc_log2(double x) { return log2(x); }

// N consecutive Acc values between shared memory and registers, in 16-byte (or narrower)
// accesses. The shared address must be aligned to the access width (the layouts below are).
template <int N> __device__ __forceinline__ void lds(float (&r)[N], const float* s) {
  if constexpr (N % 4 == 0) {
#pragma unroll
    for (int v = 0; v < N; v += 4) {
      const float4 t = *reinterpret_cast<const float4*>(s + v);
      r[v] = t.x; r[v + 1] = t.y; r[v + 2] = t.z; r[v + 3] = t.w;
    }
  } else if constexpr (N % 2 == 0) {
#pragma unroll
    for (int v = 0; v < N; v += 2) {
      const float2 t = *reinterpret_cast<const float2*>(s + v);
      r[v] = t.x; r[v + 1] = t.y;
    }
  } else {
#pragma unroll
    for (int v = 0; v < N; ++v) r[v] = s[v];
  }
}
template <int N> __device__ __forceinline__ void lds(double (&r)[N], const double* s) {
  if constexpr (N % 2 == 0) {
#pragma unroll
    for (int v = 0; v < N; v += 2) {
      const double2 t = *reinterpret_cast<const double2*>(s + v);
      r[v] = t.x; r[v + 1] = t.y;
    }
  } else {
#pragma unroll
    for (int v = 0; v < N; ++v) r[v] = s[v];
  }
}
template <int N> __device__ __forceinline__ void sts(float* s, const float (&r)[N]) {
  if constexpr (N % 4 == 0) {
#pragma unroll
    for (int v = 0; v < N; v += 4) *reinterpret_cast<float4*>(s + v) = make_float4(r[v], r[v + 1], r[v + 2], r[v + 3]);
  } else {
#pragma unroll
    for (int v = 0; v < N; ++v) s[v] = r[v];
  }
}
template <int N> __device__ __forceinline__ void sts(double* s, const double (&r)[N]) {
  if constexpr (N % 2 == 0) {
#pragma unroll
    for (int v = 0; v < N; v += 2) *reinterpret_cast<double2*>(s + v) = make_double2(r[v], r[v + 1]);
  } else {
#pragma unroll
    for (int v = 0; v < N; ++v) s[v] = r[v];
  }
}

// Butterfly reductions over the WIDTH consecutive lanes of a row group. Every lane ends with
// the same value, bit for bit (a+b == b+a and max is commutative), so all threads of a row
// agree on m_i and l_i. No lane ever mixes values of two different rows.
template <int WIDTH, typename Acc> __device__ __forceinline__ Acc group_max(Acc v) {
#pragma unroll
  for (int o = WIDTH / 2; o > 0; o /= 2) v = acc_max(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
template <int WIDTH, typename Acc> __device__ __forceinline__ Acc group_sum(Acc v) {
#pragma unroll
  for (int o = WIDTH / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// A ROWS x COLS tile of a strided global matrix, element (r, c) at g[(row0 + r) * rs + (col0 + c) * cs],
// spread over NT threads with consecutive threads on consecutive columns (coalesced when
// cs == 1). Element it of thread tid sits at row  r_t + (it / CPT) * RSTEP,  col  c_t + (it % CPT) * NT.
template <int ROWS, int COLS, int NT> struct TileMap {
  static constexpr int RSTEP = NT >= COLS ? NT / COLS : 1;   // rows between a thread's elements
  static constexpr int CPT = NT >= COLS ? 1 : COLS / NT;     // elements per thread in one row
  static constexpr int N = ROWS * COLS / NT;                 // elements per thread
  static_assert(NT >= COLS ? NT % COLS == 0 : COLS % NT == 0, "threads tile the columns");
  static_assert((ROWS * COLS) % NT == 0 && ROWS % RSTEP == 0, "threads tile the rows");
  __device__ static int row(int tid) { return NT >= COLS ? tid / COLS : 0; }
  __device__ static int col(int tid) { return NT >= COLS ? tid % COLS : tid; }
};

// Loads the tile into registers, converted to Acc, with 0 wherever row >= row_end or
// col >= col_end: a zero feature adds nothing to a dot product, and a zero V row is what a
// masked P~ = 0 multiplies (never stale shared memory, which could hold NaN: 0 * NaN = NaN).
template <int ROWS, int COLS, int NT, typename Acc, int N, typename T>
__device__ __forceinline__ void fetch_tile(Acc (&dst)[N], const T* g, long long rs, long long cs,
                                           int row0, int row_end, int col0, int col_end, int tid) {
  using M = TileMap<ROWS, COLS, NT>;
  static_assert(N >= M::N, "register buffer too small");
  const int r = row0 + M::row(tid), c = col0 + M::col(tid);
  const T* ptr = g + r * rs + c * cs;
  const long long rstep = M::RSTEP * rs;
#pragma unroll
  for (int ri = 0; ri < M::N / M::CPT; ++ri) {
    const bool row_ok = r + ri * M::RSTEP < row_end;
#pragma unroll
    for (int ci = 0; ci < M::CPT; ++ci) {
      const bool ok = row_ok && c + ci * NT < col_end;
      dst[ri * M::CPT + ci] = ok ? to_acc<Acc>(ldg(ptr + ci * NT * cs)) : Acc(0);
    }
    ptr += rstep;
  }
}

template <int ROWS, int COLS, int NT, int LD, typename Acc, int N>
__device__ __forceinline__ void stash_tile(Acc* s, const Acc (&src)[N], int tid) {
  using M = TileMap<ROWS, COLS, NT>;
  Acc* const base = s + M::row(tid) * LD + M::col(tid);
#pragma unroll
  for (int ri = 0; ri < M::N / M::CPT; ++ri)
#pragma unroll
    for (int ci = 0; ci < M::CPT; ++ci) base[ri * M::RSTEP * LD + ci * NT] = src[ri * M::CPT + ci];
}

__host__ __device__ constexpr int cmax(int a, int b) { return a > b ? a : b; }
__host__ __device__ constexpr bool is_pow2(int x) { return x > 0 && (x & (x - 1)) == 0; }

}  // namespace simt

// Every tile constant of the kernel. The five free ones are template arguments chosen in
// cuflash/_traits.py (FWD_SIMT; see the table there for why each value); the rest follow here.
template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int NTHREADS, int KC, int VC>
struct SimtTraits {
  using Acc = typename AccOf<T>::type;

  // Acc values in one 16-byte shared-memory access (LDS.128): 4 floats or 2 doubles.
  static constexpr int kVec = 16 / int(sizeof(Acc));

  // Query rows per thread. 4 rows x TN keys is the register micro-tile of S: each k step
  // loads TM + TN vectors for TM*TN*kVec FMAs, enough to keep the FMA pipe ahead of the
  // shared-memory pipe, and the same 4 rows carry O so rescaling by exp(m_old - m_new)
  // needs no communication.
  static constexpr int TM = 4;
  static constexpr int THREADS_M = BLOCK_M / TM;
  static constexpr int THREADS_N = NTHREADS / THREADS_M;   // lanes that share one row group
  static constexpr int TN = BLOCK_N / THREADS_N;           // keys of S per thread
  static constexpr int DN = HEAD_DIM / THREADS_N;          // output columns per thread
  static constexpr int GV = DN < kVec ? DN : kVec;         // width of one output-column group
  static constexpr int NG = DN / GV;                       // output-column groups per thread

  // Leading dimensions (in Acc elements) of the shared tiles, all row-major. A pad of one
  // 16-byte unit makes the row pitch an odd number of units, so the strided rows read by
  // tx = 0..7 (sK, sQ) and written by tx = 0..7 (sP) fall in 8 distinct bank groups.
  static constexpr int LDQ = HEAD_DIM + kVec;   // sQ[m][c]
  static constexpr int LDK = KC + kVec;         // chunk of K_j: sK[n][c], KC features
  static constexpr int LDV = HEAD_DIM;          // chunk of V_j: sV[n][c], read along c only
  static constexpr int LDP = BLOCK_M + kVec;    // sP[n][m], P~_ij transposed

  static constexpr int STAGE = simt::cmax(BLOCK_N * LDK, VC * LDV);   // one staging buffer
  static constexpr int SMEM_ELEMS = BLOCK_M * LDQ + BLOCK_N * LDP + 2 * STAGE;
  static constexpr int SMEM_BYTES = SMEM_ELEMS * int(sizeof(Acc));

  // Unrolling of the two inner loops. S = Q K^T advances one k step (kVec features: TM + TN
  // 16-byte loads, then TM*TN*kVec FMAs) per iteration: unrolling it further lets the scheduler
  // hoist the next steps' loads, which pushes the kernel past 128 registers into spills (or to
  // 1 block/SM). The other warps (16 per SM at 2 blocks of 8) hide the shared-memory latency.
  // P~V unrolls by 4 keys: no spills on sm_70..sm_90a, and 5% faster than 2 on the H200.
  static constexpr int UNROLL_QK = 1;
  static constexpr int UNROLL_PV = 4;

  // Elements each thread fetches per chunk (held in registers until the next barrier).
  static constexpr int K_PER_THREAD = BLOCK_N * KC / NTHREADS;
  static constexpr int V_PER_THREAD = VC * HEAD_DIM / NTHREADS;
  static constexpr int PF = simt::cmax(K_PER_THREAD, V_PER_THREAD);
  static constexpr int Q_PER_THREAD = BLOCK_M * HEAD_DIM / NTHREADS;

  static_assert(simt::is_pow2(HEAD_DIM) && HEAD_DIM >= 32 && HEAD_DIM <= 256, "head-dim bucket");
  static_assert(NTHREADS % 32 == 0 && NTHREADS <= 1024, "whole warps");
  static_assert(BLOCK_M % TM == 0 && NTHREADS % THREADS_M == 0, "thread grid covers the rows");
  static_assert(simt::is_pow2(THREADS_N) && THREADS_N <= 32,
                "a row group is a power-of-two run of lanes inside one warp (shuffle reductions)");
  static_assert(THREADS_M * THREADS_N == NTHREADS, "thread grid");
  static_assert(TN >= 1 && TN * THREADS_N == BLOCK_N, "key columns split evenly");
  static_assert(DN >= 1 && DN * THREADS_N == HEAD_DIM && DN % GV == 0, "output columns split evenly");
  static_assert(TM % kVec == 0, "row vectors of sQ/sP are whole 16-byte units");
  static_assert(simt::is_pow2(KC) && KC % (2 * kVec) == 0 && HEAD_DIM % KC == 0,
                "K chunk: whole 16-byte units, an even number of them (odd pitch with the pad)");
  static_assert((HEAD_DIM / kVec) % 2 == 0 && (BLOCK_M / kVec) % 2 == 0, "odd pitch of sQ and sP");
  static_assert(simt::is_pow2(VC) && BLOCK_N % VC == 0, "V chunks tile the key tile");
  static_assert((BLOCK_N * KC) % NTHREADS == 0 && (VC * HEAD_DIM) % NTHREADS == 0 &&
                (BLOCK_M * HEAD_DIM) % NTHREADS == 0, "every thread fetches the same count");
  static_assert(STAGE % kVec == 0 && (BLOCK_M * LDQ) % kVec == 0 && (BLOCK_N * LDP) % kVec == 0,
                "every shared tile starts 16-byte aligned");
  // 64 KB is the most one block may use on every GPU from sm_70 (sm_75 caps it there); the
  // launcher opts in with max_dynamic_shared_size_bytes above 48 KB.
  static_assert(SMEM_BYTES <= 64 * 1024, "shared memory must fit every sm_70+ GPU");
  // Register budget (Acc values live per thread): O micro-tile + S micro-tile + prefetch.
  static_assert((TM * DN + TM * TN + PF) * int(sizeof(Acc)) / 4 <= 160, "too many live registers");
};

// grid.x = nbatch * num_m_blocks; one block = BLOCK_M query rows of one batch item.
template <typename T, int HEAD_DIM, typename Var, int BLOCK_M, int BLOCK_N, int NTHREADS, int KC, int VC>
// 2 = min_blocks of fwd_simt in cuflash/_traits.py; 1 for a Variant with an element mask array
// (their loads, with a score transform's math, need more than 128 registers)
__global__ void __launch_bounds__(NTHREADS, Var::kPairMask ? 1 : 2)
fwd_simt(const Params CUFLASH_VARLEN_PARAM(p)) {
  CUFLASH_VARLEN_VIEW(T, p)   // varlen builds: this block's sequence (common.cuh; helper "inference")
  using Tr = SimtTraits<T, HEAD_DIM, BLOCK_M, BLOCK_N, NTHREADS, KC, VC>;
  using Acc = typename Tr::Acc;
  constexpr int TM = Tr::TM, TN = Tr::TN, DN = Tr::DN, GV = Tr::GV, NG = Tr::NG;
  constexpr int THREADS_N = Tr::THREADS_N;
  constexpr int LDQ = Tr::LDQ, LDK = Tr::LDK, LDV = Tr::LDV, LDP = Tr::LDP;

  // The launcher computes SMEM_BYTES with the same formula (cuflash/_traits.py); a
  // mismatch must fail loudly, never read past the allocation.
  {
    unsigned dyn;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
    if (dyn < unsigned(Tr::SMEM_BYTES)) __trap();
  }
  extern __shared__ __align__(16) unsigned char smem_raw[];
  Acc* const sQ = reinterpret_cast<Acc*>(smem_raw);
  Acc* const sP = sQ + BLOCK_M * LDQ;
  Acc* const sStage = sP + BLOCK_N * LDP;

  // -- which tile (common.cuh: block_tile): heaviest causal tiles (last query rows) first
  const BlockTile tile = block_tile(p, simt::block_id());
  const int m_block = tile.m_block;
  const BatchOffsets off = batch_offsets(p, tile.b);
  const BatchPtrs<T> gmem = batch_ptrs<T>(p, off);

  const int tid = threadIdx.x;
  const int ty = tid / THREADS_N;   // row group
  const int tx = tid % THREADS_N;   // lane within the row group
  const int m0 = m_block * BLOCK_M;

  // Keys j >= n_end are invisible to every row of this block: past the end (j >= Lk) or masked
  // by the Variant for the block's last real row (causal: above its diagonal, j > i +
  // causal_offset). Such key tiles are never visited.
  const int n_end = Var::key_end(p.var, p.mod, min(m0 + BLOCK_M, p.Lq), p.Lk);
  const int n_blocks = n_end > 0 ? (n_end + BLOCK_N - 1) / BLOCK_N : 0;
  // Under a window, key tiles before the one holding the first row's first visible key are
  // invisible to every row too (0 without a window).
  const int n_first = Var::kKeyLo ? Var::key_begin(p.var, p.mod, m0) / BLOCK_N : 0;
  // the modifiers' state of this batch item (slopes, sink, bias / mask rows); empty if unused
  const auto item = Var::template item<Acc>(p, tile.b);
  constexpr double kLog2e = 1.4426950408889634073599246810018921374266459541529859341354494069;

  // -- Load Q_i from HBM to on-chip SRAM (zero outside Lq x d, so padding adds nothing).
  {
    Acc qreg[Tr::Q_PER_THREAD];
    simt::fetch_tile<BLOCK_M, HEAD_DIM, NTHREADS>(qreg, gmem.q, p.q_row_stride, p.q_col_stride, m0, p.Lq, 0, p.d, tid);
    simt::stash_tile<BLOCK_M, HEAD_DIM, NTHREADS, LDQ>(sQ, qreg, tid);
  }

  // -- On chip, initialise O_i = 0, l_i = 0, m_i = -inf
  Acc acc_o[TM][DN];
  Acc row_m[TM], row_l[TM];
#pragma unroll
  for (int i = 0; i < TM; ++i) {
    row_m[i] = neg_inf<Acc>();
    row_l[i] = Acc(0);
#pragma unroll
    for (int j = 0; j < DN; ++j) acc_o[i][j] = Acc(0);
  }
  if constexpr (Var::kSink) {   // a sink: a key of score `sink` and value 0 (row_m in log2 units)
#pragma unroll
    for (int i = 0; i < TM; ++i) {
      Acc mx, l;
      Var::Mod::row_start(item, mx, l);
      row_m[i] = mx * Acc(kLog2e);
      row_l[i] = l;
    }
  }

  // Staging of K_j and V_j: fetch_* reads one chunk from global memory into registers, stash_*
  // writes it to a staging buffer (see simt::fetch_tile for the zero fill).
  Acc pf[Tr::PF];
  auto fetch_k = [&](int n0, int kc) {
    simt::fetch_tile<BLOCK_N, KC, NTHREADS>(pf, gmem.k, p.k_row_stride, p.k_col_stride, n0, n_end, kc * KC, p.d, tid);
  };
  auto fetch_v = [&](int n0, int vc) {
    simt::fetch_tile<VC, HEAD_DIM, NTHREADS>(pf, gmem.v, p.v_row_stride, p.v_col_stride, n0 + vc * VC, n_end, 0, p.dv, tid);
  };
  auto stash_k = [&](Acc* s) { simt::stash_tile<BLOCK_N, KC, NTHREADS, LDK>(s, pf, tid); };
  auto stash_v = [&](Acc* s) { simt::stash_tile<VC, HEAD_DIM, NTHREADS, LDV>(s, pf, tid); };

  const Acc scale_log2 = Acc(p.var.scale_log2);
  const int num_k_chunks = (p.d + KC - 1) / KC;   // features past d are zero: skip them
  int buf = 0;                                    // staging buffer the next stash writes
  if (n_blocks > n_first) fetch_k(n_first * BLOCK_N, 0);

  // -- for 1 <= j <= T_c: (key tiles left of / on the diagonal only)
  for (int n_block = n_first; n_block < n_blocks; ++n_block) {
    const int n0 = n_block * BLOCK_N;
    const int num_v_chunks = (min(BLOCK_N, n_end - n0) + VC - 1) / VC;

    // -- On chip, compute S_ij = Q_i K_j^T (KC features of K_j per chunk)
    Acc acc_s[TM][TN];
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
      for (int j = 0; j < TN; ++j) acc_s[i][j] = Acc(0);

    for (int kc = 0; kc < num_k_chunks; ++kc) {
      Acc* const sK = sStage + buf * Tr::STAGE;
      stash_k(sK);
      __syncthreads();   // chunk visible to all; (first chunk) sQ visible; buf^1 free again
      if (kc + 1 < num_k_chunks) fetch_k(n0, kc + 1); else fetch_v(n0, 0);
      const Acc* const q_rows = sQ + (ty * TM) * LDQ + kc * KC;
#pragma unroll Tr::UNROLL_QK
      for (int k = 0; k < KC; k += Tr::kVec) {
        Acc a[TM][Tr::kVec], bk[TN][Tr::kVec];
#pragma unroll
        for (int i = 0; i < TM; ++i) simt::lds(a[i], q_rows + i * LDQ + k);
#pragma unroll
        for (int j = 0; j < TN; ++j) simt::lds(bk[j], sK + (tx + j * THREADS_N) * LDK + k);
#pragma unroll
        for (int u = 0; u < Tr::kVec; ++u)
#pragma unroll
          for (int i = 0; i < TM; ++i)
#pragma unroll
            for (int j = 0; j < TN; ++j) acc_s[i][j] = acc_fma(a[i][u], bk[j][u], acc_s[i][j]);
      }
      buf ^= 1;
    }

    // Scores in log2 units: x_ij = transform(s_ij) * scale * log2(e) (the Variant's transform
    // is the identity today). Taking the row max of the scaled scores keeps exp2(x - m) <= 1
    // for any sign of scale.
    // Masked keys get x = -inf, so they contribute exp2(-inf) = 0 and never win the max;
    // the mask overrides whatever the product was (also NaN from a key's NaN).
    // With modifiers (Var::kNatural): x_ij = score(scale * s_ij) * log2(e), steps 2-5 of the
    // score pipeline in natural units; a bool mask / mask_mod hides pairs in the tiles that
    // need a mask.
    const bool need_mask = (n0 + BLOCK_N > n_end) || Var::needs_mask(p.var, p.mod, m0, m0 + BLOCK_M, n0, n0 + BLOCK_N);
#pragma unroll
    for (int i = 0; i < TM; ++i) {
      const int row = m0 + ty * TM + i;
      const auto item_row = Var::at_row(p.mod, item, row, p.Lq);
#pragma unroll
      for (int j = 0; j < TN; ++j) {
        const int col = n0 + tx + j * THREADS_N;
        Acc x;
        if constexpr (Var::kNatural)
          x = Var::score(p.mod, item_row, acc_s[i][j], Acc(p.var.scale), row, col, p.Lq, p.Lk) * Acc(kLog2e);
        else
          x = Var::transform(p.var, acc_s[i][j]) * scale_log2;
        if constexpr (Var::kWindow || Var::kPairMask) {
          if (need_mask) {
            bool hidden = col >= n_end || !Var::visible(p.var, p.mod, row, col);
            if constexpr (Var::kPairMask)
              hidden = hidden || !Var::pair_visible(p.mod, item_row, p.var.causal_offset, row, col, p.Lq, p.Lk);
            if (hidden) x = neg_inf<Acc>();
          }
        } else {
          if (need_mask && (col >= n_end || Var::masked(p.var, row, col))) x = neg_inf<Acc>();
        }
        acc_s[i][j] = x;
      }
    }

#pragma unroll
    for (int i = 0; i < TM; ++i) {
      // -- On chip, compute m~_ij = rowmax(S_ij). The max ignores NaN (fmax), and a NaN
      //    score only ever sits in its own row, whose output it then poisons via P~.
      Acc m_tile = acc_s[i][0];
#pragma unroll
      for (int j = 1; j < TN; ++j) m_tile = simt::acc_max(m_tile, acc_s[i][j]);
      m_tile = simt::group_max<THREADS_N>(m_tile);
      // -- m_i^new = max(m_i, m~_ij)
      const Acc m_new = simt::acc_max(row_m[i], m_tile);
      // Numerics: m_new = -inf when every key seen so far is masked for this row. Subtract 0
      // instead, so that no -inf - (-inf) = NaN arises: P~ = exp2(-inf - 0) = 0 and the
      // rescale factor exp2(m_i - 0) = exp2(-inf) = 0 (m_i is -inf too, l_i and O_i are 0).
      const Acc m_sub = (m_new == neg_inf<Acc>()) ? Acc(0) : m_new;
      // -- P~_ij = exp(S_ij - m_i^new), l~_ij = rowsum(P~_ij)
      Acc l_tile = Acc(0);
#pragma unroll
      for (int j = 0; j < TN; ++j) {
        acc_s[i][j] = fast_exp2(acc_s[i][j] - m_sub);
        l_tile += acc_s[i][j];
      }
      l_tile = simt::group_sum<THREADS_N>(l_tile);
      // -- l_i^new = e^(m_i - m_i^new) l_i + l~_ij;  O_i = diag(e^(m_i - m_i^new)) O_i
      //    (m_i = -inf gives the factor exp2(-inf) = 0 exactly; see m_sub.)
      const Acc alpha = fast_exp2(row_m[i] - m_sub);
      row_l[i] = alpha * row_l[i] + l_tile;
#pragma unroll
      for (int j = 0; j < DN; ++j) acc_o[i][j] *= alpha;
      row_m[i] = m_new;
    }

    // -- Write P~_ij to on-chip SRAM (transposed: sP[key][row]). The last reads of sP (the
    //    previous tile's P~V) are behind this tile's K-chunk barriers; the first V chunk's
    //    barrier below publishes it.
#pragma unroll
    for (int j = 0; j < TN; ++j) {
      Acc col[TM];
#pragma unroll
      for (int i = 0; i < TM; ++i) col[i] = acc_s[i][j];
      simt::sts(sP + (tx + j * THREADS_N) * LDP + ty * TM, col);
    }

    // -- On chip, compute O_i += P~_ij V_j (VC keys of V_j per chunk)
    for (int vc = 0; vc < num_v_chunks; ++vc) {
      Acc* const sV = sStage + buf * Tr::STAGE;
      stash_v(sV);
      __syncthreads();   // chunk visible; (first chunk) P~_ij visible; buf^1 free again
      if (vc + 1 < num_v_chunks) fetch_v(n0, vc + 1);
      else if (n_block + 1 < n_blocks) fetch_k(n0 + BLOCK_N, 0);
      const Acc* const p_rows = sP + (vc * VC) * LDP + ty * TM;
      const Acc* const v_cols = sV + tx * GV;
#pragma unroll Tr::UNROLL_PV
      for (int n = 0; n < VC; ++n) {
        Acc a[TM], bv[NG][GV];
        simt::lds(a, p_rows + n * LDP);
#pragma unroll
        for (int g = 0; g < NG; ++g) simt::lds(bv[g], v_cols + n * LDV + g * GV * THREADS_N);
#pragma unroll
        for (int i = 0; i < TM; ++i)
#pragma unroll
          for (int g = 0; g < NG; ++g)
#pragma unroll
            for (int e = 0; e < GV; ++e) acc_o[i][g * GV + e] = acc_fma(a[i], bv[g][e], acc_o[i][g * GV + e]);
      }
      buf ^= 1;
    }
  }

  // -- O_i = diag(l_i)^-1 O_i, L_i = m_i + log(l_i); write O_i and L_i to HBM
  // (The output offsets are recomputed here rather than kept live through the main loop.)
  const int b = block_tile(p, simt::block_id()).b;
  T* const go = batch_ptrs<T>(p, batch_offsets(p, b)).o;
  Acc* const glse = reinterpret_cast<Acc*>(p.lse) + (long long)b * p.Lq;
  constexpr double kLn2 = 0.69314718055994530941723212145817656807550013436026;
#pragma unroll
  for (int i = 0; i < TM; ++i) {
    const int row = m0 + ty * TM + i;
    if (row >= p.Lq) continue;
    // Numerics: l_i = 0 means no visible key (all masked): the output is exactly 0 and
    // lse = -inf, even if a masked V row held NaN (0 * NaN). A NaN l_i (NaN in this row's
    // scores) fails the test and stays NaN through 1 / l_i.
    const bool empty = (row_l[i] == Acc(0));
    const Acc inv_l = empty ? Acc(0) : Acc(1) / row_l[i];
#pragma unroll
    for (int g = 0; g < NG; ++g)
#pragma unroll
      for (int e = 0; e < GV; ++e) {
        const int c = g * GV * THREADS_N + tx * GV + e;
        if (c < p.dv) {
          const Acc y = empty ? Acc(0) : acc_o[i][g * GV + e] * inv_l;
          go[row * p.o_row_stride + c * p.o_col_stride] = from_acc<T>(y);
        }
      }
    if (tx == 0) {
      // natural-log LSE of scale*s: sum_j exp(scale s_ij) = 2^m_i * l_i
      glse[row] = empty ? neg_inf<Acc>() : (row_m[i] + simt::acc_log2(row_l[i])) * Acc(kLn2);
    }
  }
}

}  // namespace cuflash
