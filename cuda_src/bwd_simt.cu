// cuflash: the generic backward pass (FlashAttention-2, Algorithm 2) on plain CUDA cores.
//
// Runs on every GPU from sm_70 and in every dtype (float16, bfloat16, float32, float64); it
// accumulates in float32 (float64 for float64 inputs). No tensor cores. One kernel, lines 5-19
// of Algorithm 2 (line 4, D = rowsum(dO o O), and the DETERMINISTIC sum of the dQ partials are
// bwd_prep.cu's bwd_dot_do_o and bwd_sum_dq, which the launcher runs before and after it):
//
//   bwd_simt<T, ...>    one thread block per (batch item, key tile K_j, V_j);
//                       it walks the query tiles Q_i that can see K_j, recomputes P_ij from
//                       the stored log-sum-exp L_i, keeps dK_j and dV_j in registers, and adds
//                       dS_ij K_j to dQ_i in HBM (float atomics), or, with DETERMINISTIC,
//                       writes it to a partial-dQ buffer of its own key tile, which
//                       bwd_sum_dq (bwd_prep.cu) sums in key-tile order
//
// What this kernel is, honestly: a correct, simple design, not a fast one. Every operand of the
// five small matrix products (S = Q K^T, dP = dO V^T, dV += P^T dO, dK += dS^T Q,
// dQ += dS K) sits in shared memory in the accumulation type, and each thread owns a small
// register micro-tile of each product, reading its operands one scalar at a time from shared
// memory (conflict-free pitches, but no 16-byte vectors, no register prefetch of the next
// tile, no double buffering). K_j, V_j, Q_i and dO_i must all fit the 64 KB of shared memory
// every sm_70+ GPU grants one block, which keeps the tiles small at large head dims. A
// register-tiled, double-buffered version (like fwd_simt) and the tensor-core backward are
// future work.
//
// Numerics: a row with no visible key has L_i = -inf (the forward's convention). exp(S - L)
// would then be exp(-inf - -inf) = NaN; instead such a row is *dead* here: its Q_i and dO_i
// rows are loaded as 0, its P and dS are 0 by definition (never evaluated), its D is 0, and
// it adds nothing to dQ, so dead rows contribute exactly 0 to dK and dV and get dQ = 0. (Its
// output is the constant 0, so that is the exact gradient.) Masked entries (causal, or keys
// past Lk) get P = dS = 0 the same way, without evaluating exp2.
#include "common.cuh"

namespace cuflash {
namespace bwd {

__host__ __device__ constexpr bool is_pow2(int x) { return x > 0 && (x & (x - 1)) == 0; }
__host__ __device__ constexpr int cmin(int a, int b) { return a < b ? a : b; }

template <typename Acc> __device__ __forceinline__ Acc pos_inf() { return -neg_inf<Acc>(); }

// One R x C product tile C += A B^T computed by NT threads, each owning a TR x TC micro-tile:
// rows  r0 + i * THREADS_R  (i < TR)  and  columns  c0 + j * THREADS_C  (j < TC), with the
// THREADS_C threads of a row group on consecutive lanes (so consecutive columns). When the
// tile has fewer rows than threads to spare, only the first ACTIVE threads take part.
template <int R, int C, int NT> struct GemmTile {
  static constexpr int THREADS_C = cmin(C, 32);
  static constexpr int THREADS_R = cmin(R, NT / THREADS_C);
  static constexpr int ACTIVE = THREADS_R * THREADS_C;
  static constexpr int TR = R / THREADS_R;
  static constexpr int TC = C / THREADS_C;
  static_assert(is_pow2(R) && is_pow2(C) && is_pow2(NT), "power-of-two tiles and thread counts");
  static_assert(NT % THREADS_C == 0 && ACTIVE <= NT && TR * THREADS_R == R && TC * THREADS_C == C,
                "the threads tile the product exactly");

  __device__ static bool active(int tid) { return tid < ACTIVE; }
  __device__ static int r0(int tid) { return tid / THREADS_C; }
  __device__ static int c0(int tid) { return tid % THREADS_C; }

  // acc[i][j] += sum_{k < k_end} A(r, k) B(c, k) for the thread's rows r and columns c, with
  // A(r, k) = a[r * AR + k * AK] and B(c, k) = b[c * BC + k * BK] in shared memory. The
  // strides are template arguments, so every address is a base plus a constant.
  template <int AR, int AK, int BC, int BK, typename Acc>
  __device__ static void mma(Acc (&acc)[TR][TC], const Acc* a, const Acc* b, int k_end, int tid) {
    a += r0(tid) * AR;
    b += c0(tid) * BC;
#pragma unroll 2
    for (int k = 0; k < k_end; ++k) {
      Acc av[TR], bv[TC];
#pragma unroll
      for (int i = 0; i < TR; ++i) av[i] = a[i * THREADS_R * AR + k * AK];
#pragma unroll
      for (int j = 0; j < TC; ++j) bv[j] = b[j * THREADS_C * BC + k * BK];
#pragma unroll
      for (int i = 0; i < TR; ++i)
#pragma unroll
        for (int j = 0; j < TC; ++j) acc[i][j] = acc_fma(av[i], bv[j], acc[i][j]);
    }
  }
};

template <typename Acc, int TR, int TC> __device__ __forceinline__ void zero(Acc (&x)[TR][TC]) {
#pragma unroll
  for (int i = 0; i < TR; ++i)
#pragma unroll
    for (int j = 0; j < TC; ++j) x[i][j] = Acc(0);
}

// ROWS x COLS elements of a strided global matrix, element (r, c) at g[(row0 + r) * rs + c * cs],
// into shared memory s[r * LD + c], converted to Acc; 0 where row0 + r >= row_end,
// c >= col_end or !live(r). Consecutive threads take consecutive columns (coalesced for
// cs == 1). Zeros matter: a zero feature adds nothing to a dot product, and a zero row
// multiplies a P or dS that is 0 there (stale shared memory could hold NaN, and 0 * NaN = NaN).
template <int ROWS, int COLS, int NT, int LD, typename Acc, typename T, typename Live>
__device__ __forceinline__ void load_tile(Acc* s, const T* g, long long rs, long long cs, int row0,
                                          int row_end, int col_end, Live live, int tid) {
  static_assert(is_pow2(COLS), "column count is a power of two (cheap index split)");
#pragma unroll 2
  for (int e = tid; e < ROWS * COLS; e += NT) {
    const int r = e / COLS, c = e % COLS;
    const int row = row0 + r;
    Acc x = Acc(0);
    if (row < row_end && c < col_end && live(r)) x = to_acc<Acc>(ldg(g + row * rs + c * cs));
    s[r * LD + c] = x;
  }
}

}  // namespace bwd

// Every tile constant of bwd_simt. The three free ones (BLOCK_M, BLOCK_N, NTHREADS) are
// template arguments chosen in cuflash/_traits.py (BWD_SIMT, with the reasons); the rest
// follow here, and the rules are static_asserts, so a bad table entry fails to compile.
template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int NTHREADS>
struct BwdSimtTraits {
  using Acc = typename AccOf<T>::type;

  // Pitches of the shared tiles (Acc elements). An odd pitch puts the rows that consecutive
  // lanes read (K_j and V_j rows in S = Q K^T, dP = dO V^T) in distinct banks; columns are
  // read along the row, which is conflict-free anyway.
  static constexpr int LDH = HEAD_DIM + 1;   // sQ, sdO, sK, sV: [row][feature]
  static constexpr int LDS = BLOCK_N + 1;    // sP, sdS: [query row][key]

  // The five products, as GemmTile shapes (rows x columns of the product):
  using TileS = bwd::GemmTile<BLOCK_M, BLOCK_N, NTHREADS>;     // S_ij and dP_ij (same layout)
  using TileKV = bwd::GemmTile<BLOCK_N, HEAD_DIM, NTHREADS>;   // dK_j and dV_j (registers)
  using TileQ = bwd::GemmTile<BLOCK_M, HEAD_DIM, NTHREADS>;    // dS_ij K_j, the dQ_i update

  // Shared memory: K_j, V_j (resident for the block), Q_i, dO_i (one query tile), P_ij, dS_ij,
  // and L_i * log2(e), D_i.
  static constexpr int SMEM_ELEMS = 2 * BLOCK_N * LDH + 2 * BLOCK_M * LDH + 2 * BLOCK_M * LDS + 2 * BLOCK_M;
  static constexpr int SMEM_BYTES = SMEM_ELEMS * int(sizeof(Acc));

  static_assert(bwd::is_pow2(HEAD_DIM) && HEAD_DIM >= 32 && HEAD_DIM <= 256, "head-dim bucket");
  static_assert(NTHREADS % 32 == 0 && NTHREADS <= 1024, "whole warps");
  static_assert(BLOCK_M <= NTHREADS, "one thread per query row loads L_i and D_i");
  // 64 KB is the most one block may use on every GPU from sm_70 (sm_75 caps it there); the
  // launcher opts in with max_dynamic_shared_size_bytes above 48 KB.
  static_assert(SMEM_BYTES <= 64 * 1024, "shared memory must fit every sm_70+ GPU");
  // Register budget (Acc values live per thread across the query loop and inside it): dK_j and
  // dV_j, S and dP, the dQ update. At <= 128 registers two blocks of 256 threads fit an SM
  // (__launch_bounds__(NTHREADS, 2)); ptxas gives 72-119 registers, 0 spills, 0 stack on
  // sm_70..sm_90a (python -m cuflash check). The inner loops unroll by 2: by 4, the hoisted
  // shared-memory loads pushed every specialisation to the 128 cap and spilled on sm_70.
  static_assert((2 * TileKV::TR * TileKV::TC + 2 * TileS::TR * TileS::TC + TileQ::TR * TileQ::TC) *
                    int(sizeof(Acc)) / 4 <= 96, "too many live accumulator registers");
};

// Lines 5-19 of Algorithm 2. grid.x = nbatch * num_n_blocks; one block = the key tile K_j, V_j
// (BLOCK_N keys) of one batch item, in p.grid_order's order (common.cuh: bwd_block_tile).
// Heaviest blocks first under a causal mask: key tile 0 is seen by every query tile, and comes
// first.
template <typename T, int HEAD_DIM, typename Var, bool DETERMINISTIC, int BLOCK_M, int BLOCK_N, int NTHREADS>
__global__ void __launch_bounds__(NTHREADS, 2)   // 2 blocks per SM: see BwdSimtTraits' register budget
bwd_simt(const Params CUFLASH_VARLEN_PARAM(p)) {
  CUFLASH_VARLEN_VIEW(T, p)   // varlen builds: this block's sequence (common.cuh; helper "inference")
  using Tr = BwdSimtTraits<T, HEAD_DIM, BLOCK_M, BLOCK_N, NTHREADS>;
  using Acc = typename Tr::Acc;
  using TileS = typename Tr::TileS;
  using TileKV = typename Tr::TileKV;
  using TileQ = typename Tr::TileQ;
  constexpr int LDH = Tr::LDH, LDS = Tr::LDS;

  // The launcher computes SMEM_BYTES with the same formula (cuflash/_traits.py); a
  // mismatch must fail loudly, never read past the allocation.
  {
    unsigned dyn;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
    if (dyn < unsigned(Tr::SMEM_BYTES)) __trap();
  }
  extern __shared__ __align__(16) unsigned char smem_raw[];
  Acc* const sK = reinterpret_cast<Acc*>(smem_raw);
  Acc* const sV = sK + BLOCK_N * LDH;
  Acc* const sQ = sV + BLOCK_N * LDH;
  Acc* const sdO = sQ + BLOCK_M * LDH;
  Acc* const sP = sdO + BLOCK_M * LDH;
  Acc* const sdS = sP + BLOCK_M * LDS;
  Acc* const sL = sdS + BLOCK_M * LDS;   // L_i * log2(e); +inf marks a dead row (or row >= Lq)
  Acc* const sD = sL + BLOCK_M;          // D_i

  const int tid = threadIdx.x;
  const BwdBlockTile tile = bwd_block_tile(p);
  const int n_block = tile.n_block, b = tile.b;
  const int n0 = n_block * BLOCK_N;
  const BatchOffsets off = batch_offsets(p, b);
  const BatchPtrs<T> gmem = batch_ptrs<T>(p, off);
  const Acc* const glse = reinterpret_cast<const Acc*>(p.lse) + (long long)b * p.Lq;
  const Acc* const gD = reinterpret_cast<const Acc*>(p.dpsum) + (long long)b * p.Lq;
  Acc* const gdq = reinterpret_cast<Acc*>(p.dq_acc) + n_block * p.dq_block_stride + (long long)b * p.Lq * p.d;

  const auto all_rows = [](int) { return true; };
  // -- 6: Load K_j, V_j from HBM to on-chip SRAM (zero past Lk and past d, dv)
  bwd::load_tile<BLOCK_N, HEAD_DIM, NTHREADS, LDH>(sK, gmem.k, p.k_row_stride, p.k_col_stride, n0, p.Lk, p.d, all_rows, tid);
  bwd::load_tile<BLOCK_N, HEAD_DIM, NTHREADS, LDH>(sV, gmem.v, p.v_row_stride, p.v_col_stride, n0, p.Lk, p.dv, all_rows, tid);

  // -- 7: Initialise dK_j = 0, dV_j = 0 on chip (registers; the softmax scale tau is applied
  //       to dK_j once, at the end)
  Acc acc_dk[TileKV::TR][TileKV::TC], acc_dv[TileKV::TR][TileKV::TC];
  bwd::zero(acc_dk);
  bwd::zero(acc_dv);

  const Acc scale_log2 = Acc(p.var.scale_log2);
  const Acc log2e = Acc(1.4426950408889634073599246810018921374266459541529859);
  const int n_valid = min(BLOCK_N, p.Lk - n0);   // keys of K_j that exist
  // The query tiles that can see K_j: from the one holding the first query that sees a key of
  // K_j (causal: row n0 - causal_offset; rows before it in that tile get P = 0 from the mask).
  const int m_first = Var::query_begin(p.var, n0) / BLOCK_M * BLOCK_M;

  // -- 8: for 1 <= i <= T_r (the query tiles that can see K_j):
  for (int m0 = m_first; m0 < p.Lq; m0 += BLOCK_M) {
    __syncthreads();   // the previous tile's reads of sQ, sdO, sP, sdS, sL, sD are done

    // -- 9: Load Q_i, dO_i, L_i, D_i from HBM to on-chip SRAM. Dead rows (L_i = -inf) and rows
    //       past Lq load as zeros and get L = +inf as a marker.
    const auto live = [&](int r) { return ldg(glse + m0 + r) != neg_inf<Acc>(); };
    bwd::load_tile<BLOCK_M, HEAD_DIM, NTHREADS, LDH>(sQ, gmem.q, p.q_row_stride, p.q_col_stride, m0, p.Lq, p.d, live, tid);
    bwd::load_tile<BLOCK_M, HEAD_DIM, NTHREADS, LDH>(sdO, gmem.dout, p.dout_row_stride, p.dout_col_stride, m0, p.Lq, p.dv, live, tid);
    if (tid < BLOCK_M) {
      const int row = m0 + tid;
      const Acc lse = row < p.Lq ? ldg(glse + row) : neg_inf<Acc>();
      const bool dead = (lse == neg_inf<Acc>());
      sL[tid] = dead ? bwd::pos_inf<Acc>() : lse * log2e;
      sD[tid] = dead ? Acc(0) : ldg(gD + row);
    }
    __syncthreads();

    if (TileS::active(tid)) {
      // -- 10: On chip, compute S_ij = Q_i K_j^T;  13: dP_ij = dO_i V_j^T (same micro-tile)
      Acc acc_s[TileS::TR][TileS::TC], acc_dp[TileS::TR][TileS::TC];
      bwd::zero(acc_s);
      bwd::zero(acc_dp);
      TileS::template mma<LDH, 1, LDH, 1>(acc_s, sQ, sK, p.d, tid);
      TileS::template mma<LDH, 1, LDH, 1>(acc_dp, sdO, sV, p.dv, tid);
      // -- 11: P_ij = exp(tau S_ij - L_i) = exp2(S_ij tau log2(e) - L_i log2(e))
      //    14: dS_ij = P_ij o (dP_ij - D_i)
      // Numerics: P and dS are 0, not evaluated, where the key is masked or past Lk and in
      // dead rows (sL = +inf), so no exp2(-inf - -inf) and no 0 * NaN can arise there.
#pragma unroll
      for (int i = 0; i < TileS::TR; ++i) {
        const int r = TileS::r0(tid) + i * TileS::THREADS_R;
        const int row = m0 + r;
        const Acc l2 = sL[r], d_i = sD[r];
        const bool row_live = l2 != bwd::pos_inf<Acc>();
#pragma unroll
        for (int j = 0; j < TileS::TC; ++j) {
          const int c = TileS::c0(tid) + j * TileS::THREADS_C;
          const int col = n0 + c;
          // (the Variant's answer first, outside the && chain: inside it, the inlined call
          // reordered the machine code; tools/sass_identity.py)
          const bool var_visible = Var::visible(p.var, row, col);
          const bool visible = row_live && c < n_valid && var_visible;
          const Acc pij = visible ? fast_exp2(acc_fma(Var::transform(p.var, acc_s[i][j]), scale_log2, -l2)) : Acc(0);
          sP[r * LDS + c] = pij;
          sdS[r * LDS + c] = visible ? pij * (acc_dp[i][j] - d_i) : Acc(0);
        }
      }
    }
    __syncthreads();   // P_ij and dS_ij visible to all

    const int m_valid = min(BLOCK_M, p.Lq - m0);   // rows past Lq hold P = dS = 0: skip them
    if (TileKV::active(tid)) {
      // -- 12: dV_j += P_ij^T dO_i;  16: dK_j += dS_ij^T Q_i   (contraction over the query rows)
      TileKV::template mma<1, LDS, 1, LDH>(acc_dv, sP, sdO, m_valid, tid);
      TileKV::template mma<1, LDS, 1, LDH>(acc_dk, sdS, sQ, m_valid, tid);
    }
    if (TileQ::active(tid)) {
      // -- 15: dQ_i += tau dS_ij K_j (contraction over the keys of K_j), added to HBM: float
      //        atomics by default (the order of the key tiles' additions varies run to run);
      //        DETERMINISTIC: stored into this key tile's own partial dQ, summed in key-tile
      //        order by bwd_sum_dq. Dead rows are skipped: their dQ stays exactly 0.
      Acc acc_dq[TileQ::TR][TileQ::TC];
      bwd::zero(acc_dq);
      TileQ::template mma<LDS, 1, 1, LDH>(acc_dq, sdS, sK, n_valid, tid);
      const Acc scale = Acc(p.var.scale);
#pragma unroll
      for (int i = 0; i < TileQ::TR; ++i) {
        const int r = TileQ::r0(tid) + i * TileQ::THREADS_R;
        const int row = m0 + r;
        if (row >= p.Lq || sL[r] == bwd::pos_inf<Acc>()) continue;
#pragma unroll
        for (int j = 0; j < TileQ::TC; ++j) {
          const int c = TileQ::c0(tid) + j * TileQ::THREADS_C;
          if (c >= p.d) continue;
          Acc* const dst = gdq + (long long)row * p.d + c;
          if (DETERMINISTIC) *dst = scale * acc_dq[i][j];
          else atomicAdd(dst, scale * acc_dq[i][j]);
        }
      }
    }
  }  // -- 17: end for

  // -- 18: Write dK_j = tau dK_j and dV_j to HBM (accumulation-dtype buffers, one per batch
  //        item; the launcher sums them over broadcast dimensions). Every key of K_j is
  //        written, also those no query sees (0).
  if (TileKV::active(tid)) {
    const Acc scale = Acc(p.var.scale);
    Acc* const gdk = reinterpret_cast<Acc*>(p.dk_acc) + (long long)b * p.Lk * p.d;
    Acc* const gdv = reinterpret_cast<Acc*>(p.dv_acc) + (long long)b * p.Lk * p.dv;
#pragma unroll
    for (int i = 0; i < TileKV::TR; ++i) {
      const int r = TileKV::r0(tid) + i * TileKV::THREADS_R;
      if (r >= n_valid) continue;
      const long long row = n0 + r;
#pragma unroll
      for (int j = 0; j < TileKV::TC; ++j) {
        const int c = TileKV::c0(tid) + j * TileKV::THREADS_C;
        if (c < p.d) gdk[row * p.d + c] = scale * acc_dk[i][j];
        if (c < p.dv) gdv[row * p.dv + c] = acc_dv[i][j];
      }
    }
  }
}

}  // namespace cuflash
