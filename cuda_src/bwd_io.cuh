// cuflash: tile I/O of the tensor-core backward kernels (bwd_sm80.cu, bwd_sm90.cu): rows of
// a global matrix into a swizzled shared tile by cp.async, zeroing the dead query rows of a
// tile, and the dK_j, dV_j epilogue; the element of P and dS with the modifiers (p_ds_pair)
// and bwd_sm90's selections of masked pairs (select_visible, mask_bits). `Tile` is any layout
// with kChunks (16-byte chunks a row) and addr(base, row, chunk): SwizzledTile (mma_sm80.cuh)
// or Sm90Tile (sm90_ops.cuh).
#pragma once
#include "last_block.cuh"

namespace cuflash {

namespace bwd_io {

// Rows [row0, row0 + ROWS) x columns [0, cols) of a row-major global matrix (unit column
// stride, 16-byte aligned rows) into a swizzled shared tile by cp.async. Rows >= nrows and the
// 16-byte chunks at or past `cols` land as zeros (src-size 0: nothing is read there).
template <typename Tile, int ROWS, int THREADS, typename T>
__device__ __forceinline__ void cp_async_rows(unsigned sbase, const T* g, long long row_stride,
                                              int row0, int nrows, int cols) {
  constexpr int kChunks = Tile::kChunks;
  constexpr int kIters = (ROWS * kChunks + THREADS - 1) / THREADS;
  if constexpr (THREADS % kChunks == 0) {
    // Each thread copies one chunk column c of rows r0, r0 + kRowStep, ...: one source pointer
    // that steps by kRowStep rows (few registers live across the query loop).
    constexpr int kRowStep = THREADS / kChunks;
    const int c = int(threadIdx.x) % kChunks, r0 = int(threadIdx.x) / kChunks;
    const bool col_ok = c * 8 < cols;
    const T* src = g + (row0 + r0) * row_stride + c * 8;
    const long long step = kRowStep * row_stride;
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
      const int r = r0 + it * kRowStep;
      if ((ROWS % kRowStep == 0) || r < ROWS) {
        const bool ok = col_ok && row0 + r < nrows;
        cp_async_16(Tile::addr(sbase, r, c), ok ? src : g, ok ? 16 : 0);
      }
      src += step;
    }
  } else {
#pragma unroll 4
    for (int it = 0; it < kIters; ++it) {
      const int idx = int(threadIdx.x) + it * THREADS;
      if ((ROWS * kChunks) % THREADS == 0 || idx < ROWS * kChunks) {
        const int r = idx / kChunks, c = idx % kChunks;
        const bool ok = row0 + r < nrows && c * 8 < cols;
        const T* src = ok ? g + (row0 + r) * row_stride + c * 8 : g;
        cp_async_16(Tile::addr(sbase, r, c), src, ok ? 16 : 0);
      }
    }
  }
}

// Zero the rows r of a swizzled shared tile for which dead[r] holds (the dead query rows).
template <typename Tile, int ROWS, int THREADS, typename Dead>
__device__ __forceinline__ void zero_rows(unsigned sbase, Dead dead) {
  constexpr int kChunks = Tile::kChunks;
  for (int idx = int(threadIdx.x); idx < ROWS * kChunks; idx += THREADS) {
    const int r = idx / kChunks, c = idx % kChunks;
    if (dead(r)) st_shared_zero16(Tile::addr(sbase, r, c));
  }
}

// -- 9 of Algorithm 2, the statistics of query tile Q_i into shared memory: thread tid <
// BLOCK_M stages row m0 + tid's L_i * log2(e) into sL2 and D_i into sDi, from the lse and D it
// loaded one tile ahead. A dead row (L_i = -inf: no visible key) or a row past Lq gets
// L = +inf and D = 0, so that P = exp2(S tau log2(e) - inf) = 0 and dS = P (dP - D) = 0 there
// (exp2(-inf - -inf) would be NaN). Returns whether this thread's row is dead (in range).
template <int BLOCK_M>
__device__ __forceinline__ bool stage_stats(float* sL2, float* sDi, int tid, int m0, int Lq,
                                            float lse, float d) {
  const float kInf = __int_as_float(0x7f800000);
  const float kLog2e = 1.4426950408889634f;
  bool dead = false;
  if (tid < BLOCK_M) {
    const bool in = m0 + tid < Lq;
    dead = in && lse == -kInf;
    sL2[tid] = (in && !dead) ? lse * kLog2e : kInf;
    sDi[tid] = (in && !dead) ? d : 0.f;
  }
  return dead;
}

// Row r of query tile m0 takes part in the products and gets a dQ row: it exists (< Lq) and is
// not dead (stage_stats marked it with L = +inf otherwise). Its dQ stays exactly 0 if not.
__device__ __forceinline__ bool row_live(const float* sL2, int m0, int r, int Lq) {
  return m0 + r < Lq && sL2[r] != __int_as_float(0x7f800000);
}

// Zero the dead rows of the tiles Q_i and dO_i (rare: the first rows under the bottom-right
// causal mask with Lq > Lk), so that the 0 of P or dS never meets a NaN or Inf in them
// (0 * NaN = NaN) in dV += P^T dO and dK += dS^T Q. The caller barriers around it.
template <typename Tile, int ROWS, int THREADS>
__device__ __forceinline__ void zero_dead_rows(unsigned sq, unsigned sdo, const float* sL2, int m0, int Lq) {
  const auto is_dead = [&](int r) { return m0 + r < Lq && sL2[r] == __int_as_float(0x7f800000); };
  zero_rows<Tile, ROWS, THREADS>(sq, is_dead);
  zero_rows<Tile, ROWS, THREADS>(sdo, is_dead);
}

// Two adjacent float32 values (columns col, col + 1 of a row of n) to global memory: one 8-byte
// store when both exist and n is even (then col is even and the address 8-byte aligned).
__device__ __forceinline__ void store2(float* row, int col, int n, float x, float y) {
  if ((n & 1) == 0 && col + 1 < n) {
    *reinterpret_cast<float2*>(row + col) = make_float2(x, y);
  } else {
    if (col < n) row[col] = x;
    if (col + 1 < n) row[col + 1] = y;
  }
}

// Columns col, col + 1 of row `row` (of n columns) of dK_j or dV_j at the end of a key tile:
// into the float32 buffer, or, AS_T (kBwdDkOut / kBwdDvOut, see Params::out_flags),
// straight into the gradient in T, rounded once (as the launcher's cast of the buffer
// would): one 4-byte store of the pair where the row length is even.
template <typename T>
__device__ __forceinline__ void store2_grad(unsigned long long base, bool as_t, long long row, int col,
                                            int n, float x, float y) {
  if (!as_t) {
    store2(reinterpret_cast<float*>(base) + row * n, col, n, x, y);
  } else {
    T* const dst = reinterpret_cast<T*>(base) + row * n;
    if ((n & 1) == 0 && col + 1 < n) {
      *reinterpret_cast<unsigned*>(dst + col) = pack2<T>(x, y);
    } else {
      if (col < n) dst[col] = from_acc<T, float>(x);
      if (col + 1 < n) dst[col + 1] = from_acc<T, float>(y);
    }
  }
}

// x = 0 where the pair (key row, query column) of an S^T-layout fragment is masked: column
// 8t + (e & 1) is visible from first[e >> 1] on and, where QUERY_HI (Variant::kKeyLo), up to
// last[e >> 1] (relative columns; see the kernel). Selection, not arithmetic: x may hold Inf
// or NaN there.
template <bool QUERY_HI, int NT>
__device__ __forceinline__ void select_visible(float (&x)[NT][4], const int (&first)[2], const int (&last)[2]) {
#pragma unroll
  for (int t = 0; t < NT; ++t)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int c = 8 * t + (e & 1);
      x[t][e] = (c >= first[e >> 1] && (!QUERY_HI || c <= last[e >> 1])) ? x[t][e] : 0.f;
    }
}

// The word that holds N mask bits (mask_bits)
template <int N> struct MaskWord { using type = unsigned; };
template <> struct MaskWord<64> { using type = unsigned long long; };

// x = 0 where bit 4t + e of `keep` is clear (mask_bits). Selection, not arithmetic: x may
// hold Inf or NaN there.
template <int NT, typename Bits>
__device__ __forceinline__ void select_bits(float (&x)[NT][4], Bits keep) {
  static_assert(4 * NT <= 8 * sizeof(Bits), "a bit an element");
#pragma unroll
  for (int t = 0; t < NT; ++t)
#pragma unroll
    for (int e = 0; e < 4; ++e) x[t][e] = ((keep >> (4 * t + e)) & 1u) ? x[t][e] : 0.f;
}

// The analytic bounds and the element mask of a thread's S^T-layout fragment of NT 8-column
// tiles (bwd_sm90; element (t, e) is query q0 + 8t + (e & 1), key kj0 + 8 (e >> 1)) as bits
// 4t + e, set where the pair is visible: first / last as select_visible reads them, and the
// bool array / mask_mod (Var::pair_visible, rows and keys clamped into the problem) where the
// tile is not known full (pair_tile). One register for the whole tile where p_ds_pair keeps
// S and dP of every element waiting for its own evaluation (bwd_sm90.cu: kMaskBits).
template <class Var, int NT, typename Bits, class P, class It>
__device__ __forceinline__ Bits mask_bits(const P& p, const It& item, int q0, int kj0, const int (&first)[2],
                                          const int (&last)[2], bool pair_tile) {
  static_assert(4 * NT <= 8 * sizeof(Bits), "a bit an element");
  Bits keep = 0u;
  auto tile = [&](int t) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int c = 8 * t + (e & 1);
      bool vis = c >= first[e >> 1] && (!Var::kKeyLo || c <= last[e >> 1]);
      if (pair_tile) {
        const int qi = q0 + c, kj = kj0 + 8 * (e >> 1);
        vis = vis && Var::pair_visible(p.mod, Var::at_row(p.mod, item, qi, p.Lq), p.var.causal_offset, qi, kj, p.Lq, p.Lk);
      }
      keep |= static_cast<Bits>(vis) << (4 * t + e);
    }
  };
  if constexpr (NT <= 8) {
#pragma unroll
    for (int t = 0; t < NT; ++t) tile(t);
  } else {   // (128-row tiles, d = 64: a loop, or ptxas hoists 64 evaluations and spills)
#pragma unroll 1
    for (int t = 0; t < NT; ++t) tile(t);
  }
  return keep;
}

// -- 11 and 14 of Algorithm 2 for one pair, with the score pipeline (DESIGN.md "Modifiers"):
// the element of query qi, key kj of a thread's S_ij^T, dP_ij^T accumulators (bwd_sm80 and
// bwd_sm90 hold them in the same layout: element e of an 8-column tile is query column
// 2 t4 + (e & 1), key row g + 8 (e >> 1)). On entry s = S_ij = q_i . k_j (raw), dp = dP_ij,
// l2 and di = L_i log2(e) and D_i of the columns 2 t4, 2 t4 + 1, `analytic()` = the caller's analytic mask of the pair (causal,
// window, keys past Lk; true where the tile needs none; a callable, evaluated after dS as the
// kernels had it inline, which keeps their machine code); on return s = P_ij and dp = dS_ij = dL/d(tau S_ij),
// both selected to 0 where the pair is hidden.
//   P_ij = exp(score(tau S_ij) - L_i): plain attention folds tau log2(e) into sl2; a Variant
//     with modifiers (kNatural) takes steps 2-5 in natural units and sl2 = log2(e).
//   dS_ij = P_ij o (dP_ij - D_i) is dL/d score; the modifiers' chain rule (softcap,
//     score_mod: Mod::grad) turns it into dL/d(tau S_ij), and a bias gets dL/dbias of the pair
//     (before softcap's chain) in Params::mod.dbias (float32, item x Lq x Lk; the host sums
//     it over the bias's broadcast dims), 0 at a hidden pair, every pair of a visited tile.
// Numerics: a hidden pair is selected, never computed through (its S may give Inf, its dP - D
// NaN from a dO row that does not see the key); Mod::grad is evaluated with dS = 0 there and
// returns 0 (its derivatives may be NaN at a score of -inf). The element mask of a bool array
// / mask_mod (kPairMask) is evaluated only in a tile not known to be full (pair_tile).
template <class Var, bool OFFSET32 = false, class P, class It>
__device__ __forceinline__ void p_ds_pair(const P& p, const It& item, int b, float scale, float sl2,
                                          const float2& l2, const float2& di, const int& t, const int& e,
                                          int qi, int kj, const bool& need_mask, const int (&first)[2],
                                          const int (&last)[2], bool pair_tile, float& s, float& dp) {
  float sx = s, th = 0.f, capped = 0.f;
  if constexpr (Var::Mod::kHasSoftcap) {
    // step 2 as the forward computes it (variant.cuh softcap_of: c tanh.approx(S tau / c), one
    // special-function operation; or the ex2 / rcp build), once: th = tanh(S tau / c) stays for
    // the chain rule (Mod::grad_capped: 1 - th^2, one FFMA), where Mod::score and Mod::grad
    // took two precise tanhf's a pair (each an ex2 and a rcp, and registers enough to spill)
    const float k = softcap_k<Var::kSoftcapTanh>(scale, p.mod.inv_softcap);
    if constexpr (Var::kSoftcapTanh) {
      th = tanh_approx(s * k);
      capped = p.mod.softcap * th;
    } else {
      capped = softcap_of<false>(s, k, p.mod.softcap);
      th = capped * p.mod.inv_softcap;
    }
    const int qc = min(qi, p.Lq - 1), kc = min(kj, p.Lk - 1);
    // (the caller's sl2 is c log2(e) where the score stays in units of c: Var::kCapUnits)
    sx = Var::kCapUnits ? th : Var::Mod::score_after_softcap(p.mod, Var::Mod::at_row(p.mod, item, qc), capped, qc, kc);
  } else if constexpr (Var::kNatural) {
    sx = Var::Mod::score(p.mod, item, sx * scale, min(qi, p.Lq - 1), min(kj, p.Lk - 1));
  }
  const float pij = ex2_approx(fmaf(sx, sl2, -((e & 1) ? l2.y : l2.x)));
  float dsij = pij * (dp - ((e & 1) ? di.y : di.x));
  bool visible = !need_mask || (8 * t + (e & 1) >= first[e >> 1] &&
                                (!Var::kKeyLo || 8 * t + (e & 1) <= last[e >> 1]));
  if constexpr (Var::kPairMask)
    if (pair_tile) visible = visible && Var::pair_visible(p.mod, Var::at_row(p.mod, item, qi, p.Lq), p.var.causal_offset, qi, kj, p.Lq, p.Lk);
  if constexpr (Var::kGrad) {
    // dL/d(tau S) from dL/dS' (0 where dS' is: the chain is never evaluated at a hidden
    // pair); dL/dbias = dL/dS' before softcap's chain, stored per pair (OFFSET32: the pair's
    // offset in item b's Lq x Lk slice in 32 bits, where the launcher checks Lq * Lk < 2^31;
    // bwd_sm90 takes it: the 64-bit offset cost it 4 bytes of spill at d = 128)
    float dbias;
    if constexpr (Var::Mod::kHasSoftcap)
      dsij = visible ? Var::Mod::grad_capped(p.mod, item, th, capped, dsij, min(qi, p.Lq - 1), min(kj, p.Lk - 1), dbias) : 0.f;
    else
      dsij = visible ? Var::Mod::grad(p.mod, item, s * scale, dsij, min(qi, p.Lq - 1), min(kj, p.Lk - 1), dbias) : 0.f;
    if constexpr (Var::kHasBias) {
      if (qi < p.Lq && kj < p.Lk) {
        if constexpr (OFFSET32)
          (p.mod.dbias + (long long)b * p.Lq * p.Lk)[qi * p.Lk + kj] = visible ? dbias : 0.f;
        else
          p.mod.dbias[((long long)b * p.Lq + qi) * p.Lk + kj] = visible ? dbias : 0.f;
      }
    }
  }
  s = visible ? pij : 0.f;
  dp = visible ? dsij : 0.f;
}

// -- 18 of Algorithm 2: write this thread's rows of dK_j = tau dK_j and dV_j (accumulators in
// the mma.sync / wgmma C layout: rows key0 and key0 + 8, columns 8 t + 2 t4 and + 1) for batch
// item b: float32, one slice per batch item, which the launcher sums over broadcast dimensions,
// or, where there are none, straight to dK, dV in T (Params::out_flags). Keys past Lk are
// skipped; every other key of the tile is written, also those no query sees (0).
template <typename T, int NT>
__device__ __forceinline__ void store_dk_dv(const Params& p, int b, int key0, int t4, float scale,
                                            const float (&dk)[NT][4], const float (&dv)[NT][4]) {
  const bool dk_t = p.out_flags & kBwdDkOut, dv_t = p.out_flags & kBwdDvOut;
  const long long row0 = (long long)b * p.Lk;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int key = key0 + 8 * h;
    if (key < p.Lk) {
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        const int col = 8 * t + 2 * t4;
        store2_grad<T>(p.dk_acc, dk_t, row0 + key, col, p.d, scale * dk[t][2 * h], scale * dk[t][2 * h + 1]);
        store2_grad<T>(p.dv_acc, dv_t, row0 + key, col, p.dv, dv[t][2 * h], dv[t][2 * h + 1]);
      }
    }
  }
}

// -- dQ_i += tau dS_ij K_j for one accumulator row (h: rows g, g + 8 of the wgmma fragment)
// where d is the build's HEAD_DIM (bwd_sm90's block-mask builds; session 11): every column
// pair t (col0 + 8 t, + 1; col0 even) lies inside the row and is 8-byte aligned, so each is one
// 8-byte vector red from the row's one base address -- red_add2's tests of n and of both
// columns, a branch region per pair that ptxas keeps apart with the address recomputed in
// each, are not needed (a predicate per pair instead spilled 20-40 bytes at d = 128).
template <int NT>
__device__ __forceinline__ void red_row_pairs(float* row, int col0, const float (&acc)[NT][4], int h,
                                              float scale) {
  float2* const dst = reinterpret_cast<float2*>(row + col0);
#pragma unroll
  for (int t = 0; t < NT; ++t)
    atomicAdd(dst + 4 * t, make_float2(scale * acc[t][2 * h], scale * acc[t][2 * h + 1]));
}

// -- dQ's finishing in the main kernel (Params::out_flags & kBwdDqOut; the launcher sets it for
// the families whose record says fuses_dq_finish, where dq is the result itself, C-contiguous
// batch x Lq x d): instead of a third launch (bwd_finish_dq, bwd_prep.cu: host time per call),
// the block whose arrival completes a query tile's dQ rounds that tile to T.
//   Every block of batch item b arrives once at each of the item's num_m_blocks counters
// (p.dq_sem: nbatch x num_m_blocks ints, zeroed by bwd_dot_do_o) after all its additions to
// dQ. All of b's key tiles add into every query tile that sees them, so the block whose
// arrival brings a counter to num_n_blocks (b's key tiles) holds the last addition to that
// tile: it reads dq_acc (already scaled by tau) and writes dq = round(dq_acc), in T.
//   Why at the block's end and not per query tile: the fence before an arrival waits until the
// thread's atomics have landed in L2 (~1 us); per tile that wait would stand in the walk of
// every block. At the end it costs once, and the tile is rounded by whichever block of its
// item ends last, which under the tile-major causal order (the lightest key tiles last) is
// spread over the grid's later blocks rather than laid on one.
//   Memory order: last_block.cuh's (publish_block_writes, then an arrival per tile by one
// thread each; the block reads a completed tile through L2 after the next barrier).
//   `sflag`: THREADS ints of shared memory the block no longer needs.
//   Not inlined, and with scalar arguments: the main kernel's register allocation (at the
// 255 limit) then stays as it is without this epilogue; the call costs nothing at the end.
//   REZERO (bwd_sm90's ONE_LAUNCH builds, kBwdOwnD): the block that rounds a tile also sets its
// dq_acc back to 0 (after reading it: each thread the elements it read) and its counter back
// to 0, so the launcher's cached workspace is found zeroed by the next launch on its stream
// (cuflash/_plan_one.py: no zeroing launch). Every counter of every item is completed once a
// launch (each block arrives at all of its item's), so the whole of dq_acc and dq_sem is left 0.
template <typename T, int BLOCK_M, int THREADS, bool REZERO>
__device__ __forceinline__ void finish_dq_body(unsigned* count, float* acc, T* out, int* sflag,
                                               int num_m_blocks, int num_n_blocks, int Lq, int d) {
  publish_block_writes();    // (last_block.cuh: the memory order below)
  const int tid = int(threadIdx.x);
  for (int m_base = 0; m_base < num_m_blocks; m_base += THREADS) {
    const int m = m_base + tid;
    sflag[tid] = m < num_m_blocks && arrive_is_last(count + m, unsigned(num_n_blocks), REZERO);
    __syncthreads();
    const int n = min(THREADS, num_m_blocks - m_base);
    for (int t = 0; t < n; ++t) {
      if (!sflag[t]) continue;   // the same for the whole block (shared memory)
      const int r0 = (m_base + t) * BLOCK_M, r1 = min(r0 + BLOCK_M, Lq);
      const long long e0 = (long long)r0 * d, e1 = (long long)r1 * d;
      if ((d & 3) == 0) {        // 16-byte loads of 4 floats (rows start 16-byte aligned)
        for (long long e = e0 + 4 * tid; e < e1; e += 4 * THREADS) {
          const float4 x = __ldcg(reinterpret_cast<const float4*>(acc + e));
          if constexpr (REZERO) __stcg(reinterpret_cast<float4*>(acc + e), float4{0.f, 0.f, 0.f, 0.f});
          out[e] = from_acc<T, float>(x.x);
          out[e + 1] = from_acc<T, float>(x.y);
          out[e + 2] = from_acc<T, float>(x.z);
          out[e + 3] = from_acc<T, float>(x.w);
        }
      } else {
        for (long long e = e0 + tid; e < e1; e += THREADS) {
          out[e] = from_acc<T, float>(__ldcg(acc + e));
          if constexpr (REZERO) __stcg(acc + e, 0.f);
        }
      }
    }
    __syncthreads();   // sflag is written again
  }
}

template <typename T, int BLOCK_M, int THREADS>
__device__ __noinline__ void finish_dq_tiles(unsigned* count, const float* acc, T* out, int* sflag,
                                             int num_m_blocks, int num_n_blocks, int Lq, int d) {
  finish_dq_body<T, BLOCK_M, THREADS, false>(count, const_cast<float*>(acc), out, sflag, num_m_blocks, num_n_blocks, Lq, d);
}

template <typename T, int BLOCK_M, int THREADS>
__device__ __noinline__ void finish_dq_tiles_rezero(unsigned* count, float* acc, T* out, int* sflag,
                                                    int num_m_blocks, int num_n_blocks, int Lq, int d) {
  finish_dq_body<T, BLOCK_M, THREADS, true>(count, acc, out, sflag, num_m_blocks, num_n_blocks, Lq, d);
}

template <typename T, int BLOCK_M, int THREADS, bool REZERO = false>
__device__ __forceinline__ void finish_dq_at_end(const Params& p, int b, int* sflag) {
  const long long item = (long long)b * p.Lq * p.d;
  unsigned* const count = reinterpret_cast<unsigned*>(p.dq_sem) + (long long)b * p.num_m_blocks;
  float* const acc = reinterpret_cast<float*>(p.dq_acc) + item;
  T* const out = reinterpret_cast<T*>(p.dq) + item;
  if constexpr (REZERO)
    finish_dq_tiles_rezero<T, BLOCK_M, THREADS>(count, acc, out, sflag, p.num_m_blocks, p.num_n_blocks, p.Lq, p.d);
  else
    finish_dq_tiles<T, BLOCK_M, THREADS>(count, acc, out, sflag, p.num_m_blocks, p.num_n_blocks, p.Lq, p.d);
}

// Line 4 of Algorithm 2 inside the main kernel (bwd_sm90's ONE_LAUNCH builds, kBwdOwnD: no
// bwd_dot_do_o launch): D_i = rowsum(dO_i o O_i) of rows [r0, r1) of batch item b into
// p.dpsum, by the block's THREADS threads; the caller barriers before reading them back (plain
// loads: the block's own writes). Every key tile of an item writes the D of the rows it visits,
// the same bits (one order of additions), so the blocks' overlapping writes agree.
//   The launcher's conditions (cuflash/_plan_one.py): o and dO rows of unit column stride
// starting on 16 bytes, dv a multiple of 8. A group of G lanes (the power of two that covers
// HEAD_DIM in 16-byte chunks) holds a row, one chunk a lane, reduced with shuffles, as
// bwd_dot_do_o's vector path; kUnroll rows a group are loaded before any is reduced (the
// loads of a block's rows in flight together: at 512 rows, 2-4 L2 round trips, not 16-32).
// A row past r1 is not written (its lanes load nothing and add zeros); a dead row (L_i = -inf)
// gets any finite D, which stage_stats replaces by 0.
template <typename T, int HEAD_DIM, int THREADS>
__device__ __forceinline__ void block_row_dots(const Params& p, int b, int r0, int r1) {
  constexpr int kVec = 16 / int(sizeof(T));
  constexpr int kChunks = (HEAD_DIM + kVec - 1) / kVec;
  constexpr int G = kChunks <= 1 ? 1 : kChunks <= 2 ? 2 : kChunks <= 4 ? 4 : kChunks <= 8 ? 8 : kChunks <= 16 ? 16 : 32;
  constexpr int kRowsPass = THREADS / G, kUnroll = 8;
  static_assert(kChunks <= 32 && THREADS % 32 == 0, "a row in one warp");
  const BatchPtrs<T> gmem = batch_ptrs<T>(p, batch_offsets(p, b));
  const int gl = int(threadIdx.x) % G, row = int(threadIdx.x) / G;
  const bool lane_cols = gl * kVec < p.dv;
  float* const dst = reinterpret_cast<float*>(p.dpsum) + (long long)b * p.Lq;
#pragma unroll 1
  for (int first = r0; first < r1; first += kRowsPass * kUnroll) {   // (uniform: the shuffles)
    uint4 x[kUnroll], y[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int r = first + u * kRowsPass + row;
      x[u] = y[u] = uint4{0u, 0u, 0u, 0u};
      if (r < r1 && lane_cols) {
        x[u] = __ldg(reinterpret_cast<const uint4*>(gmem.dout + r * p.dout_row_stride) + gl);
        y[u] = __ldg(reinterpret_cast<const uint4*>(gmem.o + r * p.o_row_stride) + gl);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {   // (common.cuh's pieces: bwd_dot_do_o's bits)
      const float sum = group_sum(chunk_dot<T>(x[u], y[u], 0.f), G);
      const int r = first + u * kRowsPass + row;
      if (gl == 0 && r < r1) dst[r] = sum;
    }
  }
}

}  // namespace bwd_io

}  // namespace cuflash
