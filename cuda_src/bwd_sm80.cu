// cuflash: tensor-core backward for float16 / bfloat16 on sm_80 and newer (mma.sync).
//
// FlashAttention-2, Algorithm 2 (lines 5-19; line 4, D = rowsum(dO o O), is bwd_prep.cu's
// bwd_dot_do_o, and the launcher, cuflash/_plan.py, runs it first). One thread block per
// (batch item, key tile K_j, V_j of 16 keys per warp):
//   K_j and V_j arrive once by cp.async into XOR-swizzled shared memory; the block then walks
//   the query tiles Q_i that can see K_j (under the causal mask, from the first one that does),
//   with Q_i, dO_i double-buffered: Q_{i+1} and dO_{i+1} load while the block computes on Q_i;
//   each warp owns 16 keys of K_j and computes the *transposed* products S_ij^T = K_j Q_i^T and
//   dP_ij^T = V_j dO_i^T for them, so that P_ij^T and dS_ij^T come out of the mma accumulators
//   already in the layout of an A operand: dV_j += P_ij^T dO_i and dK_j += dS_ij^T Q_i need no
//   trip through shared memory, and never talk across warps. dK_j and dV_j stay in registers
//   (float32) for the whole walk and are written once, at the end;
//   dQ_i += dS_ij K_j contracts over the keys of all warps, so dS_ij^T goes to shared memory
//   once (the block's only exchange), the warps split the BLOCK_M x HEAD_DIM product, and add
//   it to dQ in HBM (float32): float atomics (red.global.add.f32), or, DETERMINISTIC, plain
//   loads and stores ordered by a per-(batch item, query tile) semaphore (see below);
//   only the tiles that cross the causal diagonal or the end of the keys pay for a mask, and
//   warps whose 16 keys no row of Q_i sees skip their products.
//
// Requirements the launcher guarantees (it copies an input that does not meet them):
//   q, k, v and dO have unit column stride and 16-byte aligned rows; d and dv are multiples of
//   8 or the row is zero-padded to one; d, dv <= HEAD_DIM <= 128 (larger head dims run
//   bwd_simt: dK_j and dV_j in registers take HEAD_DIM registers a thread already).
//
// Numerics (where a NaN could arise, and why it does not):
//   * A query row with no visible key has L_i = -inf (the forward's convention). P = exp(S - L)
//     would be exp(-inf - -inf) = NaN. Such a row is *dead*: its L_i * log2(e) is stored as
//     +inf and its D_i as 0, so P = exp2(S tau log2(e) - inf) = 0 and dS = 0 (dP - 0) = 0;
//     its Q_i and dO_i rows are zeroed in shared memory (the rare tiles that hold one), so
//     that the 0 of P or dS never meets a NaN or Inf in them (0 * NaN = NaN) inside
//     dV += P^T dO, dK += dS^T Q; and its dQ row is never written (it stays exactly 0).
//   * Query rows past Lq are zero-filled by cp.async and get L = +inf and D = 0: P = dS = 0.
//   * Keys past Lk and causally masked (query, key) pairs get P = dS = 0 by selection, not by
//     arithmetic: there S is 0 or finite but L_i can be anything, exp2(S - L) can overflow to
//     Inf, and dP - D can be NaN where dO holds NaN in a row that does not see the key.
//   * exp2 is ex2.approx.ftz (as in the forward): exp2(-inf) = +0.
#include "common.cuh"
#include "mma_sm80.cuh"
#include "sm80_ops.cuh"
#include "bwd_io.cuh"

namespace cuflash {

// Every tile constant of bwd_sm80. The free ones (BLOCK_M, SUB_M, WARPS, MIN_BLOCKS per
// head-dim bucket) are template arguments chosen in cuflash/_traits.py (BWD_SM80,
// with the reasons and register counts); the rest follow here, and the rules are static_asserts.
//   * BLOCK_N = 16 * WARPS: one 16-row mma M tile of keys per warp. Each warp owns its keys'
//     rows of dK_j and dV_j, so they need no cross-warp reduction; 8 warps give B_c = 128
//     keys, which halves the times Q_i and dO_i are read from L2 (once per key tile) against
//     64-key tiles, and the dQ atomics per query row (once per key tile).
//   * BLOCK_M (B_r) = 64 query rows a tile: every tile pays two barriers and the L_i, D_i
//     loads, which 64 rows amortise (FlashAttention-2's 64 x 128 shape).
//   * SUB_M: dK_j and dV_j hold HEAD_DIM float registers a thread for the whole kernel; S^T
//     and dP^T another SUB_M while a chunk of SUB_M query rows is in flight. At HEAD_DIM = 128
//     a whole 64-row tile would leave too few of the 255 registers for fragments and
//     addresses (ptxas spills), so the warps walk the tile in chunks, re-reading their K_j,
//     V_j fragments once a chunk.
//   * Two stages of Q_i, dO_i: the loads of tile i+1 overlap the five products of tile i.
template <typename T, int HEAD_DIM, int BLOCK_M, int SUB_M, int WARPS, int MIN_BLOCKS>
struct BwdSm80Traits {
  static constexpr int kHeadDim = HEAD_DIM;
  static constexpr int kBlockM = BLOCK_M;         // B_r: query rows of a tile Q_i
  static constexpr int kWarps = WARPS;
  static constexpr int kThreads = 32 * WARPS;
  static constexpr int kBlockN = 16 * WARPS;      // B_c: keys of K_j, 16 per warp
  static constexpr int kKSteps = HEAD_DIM / 16;   // k16 steps of S^T = K Q^T and dP^T = V dO^T
  static constexpr int kSubM = SUB_M;             // query rows of S^T, dP^T held at once
  static constexpr int kSubTiles = SUB_M / 8;     // their n8 tiles (and 2 x k16 steps of dV, dK)
  static constexpr int kDTiles = HEAD_DIM / 8;    // n8 tiles of dK_j, dV_j (feature columns)
  // dQ_i = dS_ij K_j (BLOCK_M x HEAD_DIM): the warps tile it kWarpsM x kWarpsN, each taking
  // 16 query rows and kDqCols features.
  static constexpr int kWarpsM = (BLOCK_M / 16 < WARPS) ? BLOCK_M / 16 : WARPS;
  static constexpr int kWarpsN = WARPS / kWarpsM;
  static constexpr int kDqCols = HEAD_DIM / kWarpsN;
  static constexpr int kDqTiles = kDqCols / 8;
  // ... in passes of at most 4 n8 tiles (16 accumulator registers; the A fragments of dS are
  // re-read each pass), so that dQ's accumulators do not add to the peak of dK_j, dV_j.
  static constexpr int kDqPassTiles = (kDqTiles % 4 == 0) ? 4 : 2;
  static constexpr int kDqPasses = kDqTiles / kDqPassTiles;
  static constexpr int kMinBlocks = MIN_BLOCKS;

  using KVTile = SwizzledTile<kBlockN, HEAD_DIM>;   // K_j, V_j
  using QTile = SwizzledTile<BLOCK_M, HEAD_DIM>;    // Q_i, dO_i (two stages each)
  using DSTile = SwizzledTile<kBlockN, BLOCK_M>;    // dS_ij^T [key][query]
  static constexpr int kStages = 2;
  // Shared memory, bytes: K | V | (Q, dO) x 2 stages | dS^T | (L_i log2(e), D_i) x 2 stages
  static constexpr int kOffK = 0;
  static constexpr int kOffV = KVTile::kBytes;
  static constexpr int kOffQ = 2 * KVTile::kBytes;
  static constexpr int kStageBytes = 2 * QTile::kBytes;   // dO_i follows Q_i in a stage
  static constexpr int kOffDS = kOffQ + kStages * kStageBytes;
  static constexpr int kOffStats = kOffDS + DSTile::kBytes;
  static constexpr int kStatStage = 2 * BLOCK_M;          // floats: L_i log2(e), then D_i
  static constexpr int kSmemBytes = kOffStats + kStages * kStatStage * 4;

  static_assert(sizeof(T) == 2, "the mma.sync path is for float16 / bfloat16 inputs");
  static_assert(HEAD_DIM % 32 == 0 && HEAD_DIM >= 32 && HEAD_DIM <= 128,
                "head-dim buckets 32..128 (larger head dims run bwd_simt)");
  static_assert(BLOCK_M % 32 == 0 && BLOCK_M >= 32, "dS^T rows are whole 64-byte swizzle rows");
  static_assert(BLOCK_M <= kThreads, "one thread per query row stages L_i and D_i");
  static_assert(WARPS == 2 || WARPS == 4 || WARPS == 8, "2, 4 or 8 warps of 16 keys");
  static_assert(kWarpsM * kWarpsN == WARPS && BLOCK_M % (16 * kWarpsM) == 0 && BLOCK_M == 16 * kWarpsM,
                "the warps tile dQ_i's rows in 16-row slices, one slice per warp row");
  static_assert(HEAD_DIM % kWarpsN == 0 && kDqCols % 16 == 0 && kDqTiles % kDqPassTiles == 0,
                "dQ feature columns in x4 ldmatrix pairs");
  static_assert(MIN_BLOCKS >= 1 && MIN_BLOCKS * kThreads <= 2048, "threads per SM");
  // Per thread, live across the whole query loop: dK_j, dV_j = HEAD_DIM floats; inside it,
  // S^T and dP^T of a chunk = SUB_M floats. Above ~192 of the 255 registers the fragments and
  // addresses no longer fit and ptxas spills (python -m cuflash check shows the counts).
  static_assert(SUB_M % 16 == 0 && BLOCK_M % SUB_M == 0, "query chunks of whole k16 steps");
  static_assert(HEAD_DIM + SUB_M <= 192, "accumulators would crowd out the fragments");
  // 227 KB is the most one block may use on sm_90 (163 KB on sm_80); the launcher checks the
  // device's limit and runs bwd_simt where it is smaller.
  static_assert(kSmemBytes <= 227 * 1024, "shared memory of one block");
  static_assert(kOffDS % 128 == 0 && kOffStats % 128 == 0, "swizzled tiles start on 128 bytes");
};

// Lines 5-19 of Algorithm 2. grid.x = nbatch * num_n_blocks; block = (batch item b, key tile
// n_block) in p.grid_order's order (common.cuh: bwd_block_tile; the launcher passes
// batch-major, 0): a batch item's key tiles are consecutive blocks in key-tile order, the
// heaviest causal tile (key tile 0, seen by every query tile) first, and DETERMINISTIC relies
// on the order (below; tile-major, 1, would keep it too: key tile n - 1 of every batch item
// precedes key tile n).
//
// p.dq_sem (DETERMINISTIC only; 0 otherwise): nbatch * ceil(Lq / BLOCK_M) zeroed ints, one per
// (batch item, query tile). Ordered accumulation of dQ_i: the block of key tile
// n adds its dS_ij K_j to dQ_i (plain loads and stores) only once the counter of (b, i) equals
// n, then increments it. Why n: key tile n visits query tiles i >= i_first(n), and i_first is
// non-decreasing in n, so every key tile n' < n visits each tile key tile n visits, and each
// visit increments the counter once. So every element of dQ receives its contributions in
// key-tile order 0, 1, 2, ..., each a fixed sequence of float operations: bitwise the same
// dQ on every run. Under a block mask a key tile's walk passes over the query tiles the map
// calls empty for it, so the block waits for the count of the key tiles before it that do
// visit Q_i (Q_i's own list of the same tiles, Mod::tile_list: built from the same kinds as
// the transpose lists the key tiles walk), still in key-tile order. No deadlock: the block waited on (key tile n - 1 of the same batch item)
// has the lower block index, and blocks are dispatched in index order, so it is resident or
// done before block n starts; by induction on the block index, the lowest unfinished block
// never waits. Memory stays O(nbatch * Lq * d) (one dQ buffer, no per-key-tile partials).
template <typename T, int HEAD_DIM, int BLOCK_M, int SUB_M, int WARPS, int MIN_BLOCKS, typename Var, bool DETERMINISTIC>
__global__ void __launch_bounds__(32 * WARPS, MIN_BLOCKS)
bwd_sm80(const Params CUFLASH_VARLEN_PARAM(p)) {
  CUFLASH_VARLEN_VIEW(T, p)   // varlen builds: this block's sequence (common.cuh; helper "inference")
  using Tr = BwdSm80Traits<T, HEAD_DIM, BLOCK_M, SUB_M, WARPS, MIN_BLOCKS>;
  using KVTile = typename Tr::KVTile;
  using QTile = typename Tr::QTile;
  using DSTile = typename Tr::DSTile;
  constexpr int kBlockN = Tr::kBlockN, kThreads = Tr::kThreads;

  // The launcher computes kSmemBytes with the same formula (cuflash/_traits.py); a mismatch
  // must fail loudly, never read past the allocation.
  if (dynamic_smem_size() < unsigned(Tr::kSmemBytes)) __trap();
  extern __shared__ __align__(128) unsigned char smem[];
  const unsigned sbase = smem_u32(smem);
  const unsigned sK = sbase + Tr::kOffK, sV = sbase + Tr::kOffV;
  const unsigned sQ = sbase + Tr::kOffQ;       // stage s: Q at sQ + s * kStageBytes, dO after it
  const unsigned sdS = sbase + Tr::kOffDS;
  float* const sStats = reinterpret_cast<float*>(smem + Tr::kOffStats);

  const int tid = int(threadIdx.x), warp = tid / 32, lane = tid % 32;
  const BwdBlockTile tile = bwd_block_tile(p);
  const int n_block = tile.n_block, b = tile.b;
  const int n0 = n_block * kBlockN;
  const BatchOffsets off = batch_offsets(p, b);
  const BatchPtrs<T> gmem = batch_ptrs<T>(p, off);
  const float* const glse = reinterpret_cast<const float*>(p.lse) + (long long)b * p.Lq;
  const float* const gD = reinterpret_cast<const float*>(p.dpsum) + (long long)b * p.Lq;
  float* const gdq = reinterpret_cast<float*>(p.dq_acc) + (long long)b * p.Lq * p.d;
  // tau * log2(e); log2(e) where the Variant's modifiers give natural-unit scores
  // (c log2(e) where p_ds_pair's scores are in units of the softcap c: Var::kCapUnits)
  const float sl2 = Var::kCapUnits ? p.mod.softcap * 1.4426950408889634f
                    : Var::kNatural ? 1.4426950408889634f : float(p.var.scale_log2);
  const float scale = float(p.var.scale);      // tau
  // the modifiers' state of this batch item (slopes, bias / mask rows); empty if unused
  const auto item = Var::template item<float>(p, b);

  // The query tiles that can see K_j: from the one holding the first query that sees a key of
  // K_j (causal: row n0 - causal_offset; its earlier rows get P = 0 from the mask), up to the
  // last query that sees one (a window's left bound; Lq otherwise).
  const int m_first = Var::query_begin(p.var, p.mod, n0) / BLOCK_M * BLOCK_M;
  // (read as Var::kKeyLo ? m_end : p.Lq below: without a window the loop bound stays the
  // parameter itself, and the machine code of plain attention is unchanged)
  const int m_end = Var::kKeyLo ? Var::query_end(p.var, p.mod, n0 + kBlockN, p.Lq) : p.Lq;
  // Within that range a block mask visits only the query tiles of K_j's transpose list
  // (Mod::tile_list<false>): the others' Q_i, dO_i, L_i, D_i are never loaded nor computed.
  // The loop visits m_start (the first entry at or after m_first), then the next: after(m0)
  // (m_walk, from entry e_next, read one tile earlier) is prefetched during m0, and the entry
  // after it read then. Without a block mask: m_first, m_first + BLOCK_M, ... (spelled
  // m0 + BLOCK_M where it was: a named copy of it changed the machine code).
  [[maybe_unused]] const int* list = nullptr;
  [[maybe_unused]] int list_n = 0, v = 0;
  if constexpr (Var::kBlockMask) list = Var::Mod::template tile_list<false>(p.mod, item, n_block, list_n);
  const int m_tiles = ((Var::kKeyLo ? m_end : p.Lq) + BLOCK_M - 1) / BLOCK_M;
  auto entry = [&](int u) { return Var::Mod::list_entry(list, u, m_tiles); };
  if constexpr (Var::kBlockMask)   // (entries before the analytic range: none without causal)
    while (Var::Mod::entry_tile(entry(v)) < m_first / BLOCK_M) ++v;
  int e_cur = Var::kBlockMask ? entry(v) : 0, e_next = Var::kBlockMask ? entry(v + 1) : 0;
  const int m_start = Var::kBlockMask ? BLOCK_M * Var::Mod::entry_tile(e_cur) : m_first;
  int m_walk = m_start;
  auto after = [&](int m0) { return Var::kBlockMask ? m_walk : m0 + BLOCK_M; };

  // -- 6: Load K_j, V_j from HBM to on-chip SRAM (zero past Lk and past d, dv)
  bwd_io::cp_async_rows<KVTile, kBlockN, kThreads>(sK, gmem.k, p.k_row_stride, n0, p.Lk, p.d);
  bwd_io::cp_async_rows<KVTile, kBlockN, kThreads>(sV, gmem.v, p.v_row_stride, n0, p.Lk, p.dv);

  // Q_i, dO_i of the tile at m0 into stage `stage` (cp.async), and its L_i, D_i into registers
  // of the threads tid < BLOCK_M (one row each): they reach shared memory at the top of the
  // iteration that uses them, so their latency hides behind the previous tile's products.
  float lse_next = 0.f, d_next = 0.f;
  auto load_q_tile = [&](int m0, int stage) {
    const unsigned sq = sQ + stage * Tr::kStageBytes;
    bwd_io::cp_async_rows<QTile, BLOCK_M, kThreads>(sq, gmem.q, p.q_row_stride, m0, p.Lq, p.d);
    bwd_io::cp_async_rows<QTile, BLOCK_M, kThreads>(sq + QTile::kBytes, gmem.dout, p.dout_row_stride, m0, p.Lq, p.dv);
    if (tid < BLOCK_M && m0 + tid < p.Lq) {
      lse_next = __ldg(glse + m0 + tid);
      d_next = __ldg(gD + m0 + tid);
    }
  };
  if (m_start < (Var::kKeyLo ? m_end : p.Lq)) load_q_tile(m_start, 0);
  cp_async_commit();

  // -- 7: Initialise dK_j = 0, dV_j = 0 on chip (registers, mma C layout: rows = this warp's
  //       keys kw0 + lane/4 (+8), columns = features; tau is applied to dK_j once, at the end)
  float acc_dk[Tr::kDTiles][4], acc_dv[Tr::kDTiles][4];
#pragma unroll
  for (int t = 0; t < Tr::kDTiles; ++t)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc_dk[t][e] = acc_dv[t][e] = 0.f;

  // ldmatrix addressing (lane's row and 16-byte chunk inside a 16x16 block; see mma_sm80.cuh).
  // A of S^T = K_j Q_i^T and dP^T = V_j dO_i^T: this warp's 16 key rows; matrices keys 0-7 /
  // chunk 2s, keys 8-15 / 2s, keys 0-7 / 2s+1, keys 8-15 / 2s+1 = a0..a3. V_j: + kOffV - kOffK.
  const typename KVTile::FragAddr k_a(sK, 16 * warp + (lane & 15), lane >> 4);
  // B of the same products, (k = feature, n = query) = rows of Q_i (dO_i: + QTile::kBytes):
  // matrices queries 0-7 / chunk 2s, 0-7 / 2s+1, 8-15 / 2s, 8-15 / 2s+1 = b0, b1 of two n8 tiles.
  const typename QTile::FragAddr q_b(sQ, (lane & 7) + ((lane >> 4) << 3), (lane >> 3) & 1);
  // B of dV += P^T dO and dK += dS^T Q, (k = query, n = feature), read transposed: matrices
  // queries 0-7 / chunk 2t, 8-15 / 2t, 0-7 / 2t+1, 8-15 / 2t+1 = b0, b1 of two n8 tiles.
  const typename QTile::FragAddr q_bt(sQ, (lane & 7) + (((lane >> 3) & 1) << 3), lane >> 4);
  // A of dQ = dS K_j, (m = query, k = key), read transposed out of dS^T [key][query]: matrices
  // keys 0-7 / query chunk c, keys 0-7 / c+1, keys 8-15 / c, keys 8-15 / c+1 = a0..a3.
  const typename DSTile::FragAddr ds_at(sdS, (lane & 7) + ((lane >> 4) << 3), (lane >> 3) & 1);
  // B of dQ = dS K_j, (k = key, n = feature), read transposed, as q_bt.
  const typename KVTile::FragAddr k_bt(sK, (lane & 7) + (((lane >> 3) & 1) << 3), lane >> 4);
  constexpr unsigned kVOff = Tr::kOffV - Tr::kOffK;
  constexpr unsigned kDOOff = QTile::kBytes;

  const int kw0 = n0 + 16 * warp;              // this warp's first key
  const int g = lane / 4, t4 = lane % 4;       // mma fragment coordinates
  const int wm = warp % Tr::kWarpsM, wn = warp / Tr::kWarpsM;   // this warp's dQ slice
  const int num_m_blocks = (p.Lq + BLOCK_M - 1) / BLOCK_M;

  // -- 8: for 1 <= i <= T_r (the query tiles that can see K_j):
  int stage = 0;
  for (int m0 = m_start; m0 < (Var::kKeyLo ? m_end : p.Lq); m0 = after(m0), stage ^= 1) {
    const unsigned stage_off = stage * Tr::kStageBytes;
    float* const sL2 = sStats + stage * Tr::kStatStage;   // L_i * log2(e); +inf: no P here
    float* const sDi = sL2 + BLOCK_M;                    // D_i

    // -- 9: Load Q_i, dO_i, L_i, D_i from HBM to on-chip SRAM (issued one tile ahead). A dead
    //       row (L_i = -inf) or a row past Lq gets L = +inf and D = 0 (see Numerics).
    const bool dead = bwd_io::stage_stats<BLOCK_M>(sL2, sDi, tid, m0, p.Lq, lse_next, d_next);
    cp_async_wait<0>();   // this thread's copies of Q_i, dO_i (and K_j, V_j) have landed ...
    // ... and every thread's; and every warp is done with the previous tile (the other stage,
    // dS^T). Dead rows in Q_i (rare: the first rows under the bottom-right causal mask with
    // Lq > Lk) are zeroed, with one more barrier.
    if (__syncthreads_or(dead)) {
      bwd_io::zero_dead_rows<QTile, BLOCK_M, kThreads>(sQ + stage_off, sQ + stage_off + kDOOff, sL2, m0, p.Lq);
      __syncthreads();
    }
    // Prefetch Q_{i+1}, dO_{i+1}, L_{i+1}, D_{i+1} (the next tile visited) into the other stage.
    [[maybe_unused]] int e_here = 0;   // this tile's entry
    if constexpr (Var::kBlockMask) {
      e_here = e_cur;
      m_walk = BLOCK_M * Var::Mod::entry_tile(e_next);
      e_cur = e_next;
      e_next = entry(v + 2);
      ++v;
    }
    if (after(m0) < (Var::kKeyLo ? m_end : p.Lq)) load_q_tile(after(m0), stage ^ 1);
    cp_async_commit();

    // Keys of K_j that some row of Q_i sees: those < key_end. Warps past them have P = dS = 0
    // for the whole tile and skip lines 10-16; dQ skips their 16-key steps.
    const int key_end = Var::key_end(p.var, p.mod, min(m0 + BLOCK_M, p.Lq), p.Lk);
    int kv_warps = min(WARPS, max(0, (key_end - n0 + 15) / 16));
    // A block mask: a (query tile, key tile) its mask_mod hides entirely is skipped like the
    // keys past key_end (P = dS = 0); in one it keeps entirely the mask_mod is not evaluated.
    bool pair_tile = true;
    if constexpr (Var::kBlockMask) {
      pair_tile = Var::Mod::entry_kind(e_here, 0) != kTileFull;   // (never empty: in the list)
    }

    if (warp < kv_warps) {
      // Lines 10-16 in query chunks of SUB_M rows (fewer live accumulators: see the traits).
#pragma unroll 1
      for (int q0 = 0; q0 < BLOCK_M; q0 += SUB_M) {
        // -- 10: On chip, compute S_ij^T = K_j Q_i^T;  13: dP_ij^T = V_j dO_i^T  (this warp's
        //        16 keys x SUB_M queries q0..; fragments c0,c1 = key g, queries 8t + 2t4, +1;
        //        c2,c3 = key g + 8)
        float s[Tr::kSubTiles][4], dp[Tr::kSubTiles][4];
#pragma unroll
        for (int t = 0; t < Tr::kSubTiles; ++t)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[t][e] = dp[t][e] = 0.f;
#pragma unroll
        for (int ks = 0; ks < Tr::kKSteps; ++ks) {
          unsigned a[4];
          ldmatrix_x4(a, k_a.at(0, 2 * ks));
#pragma unroll
          for (int np = 0; np < Tr::kSubTiles / 2; ++np) {
            unsigned bq[4];
            ldmatrix_x4(bq, q_b.at(np * 16, 2 * ks) + stage_off + q0 * QTile::kRowBytes);
            Mma<T>::run(s[2 * np], a, bq[0], bq[1]);
            Mma<T>::run(s[2 * np + 1], a, bq[2], bq[3]);
          }
        }
#pragma unroll
        for (int ks = 0; ks < Tr::kKSteps; ++ks) {
          unsigned a[4];
          ldmatrix_x4(a, k_a.at(0, 2 * ks) + kVOff);
#pragma unroll
          for (int np = 0; np < Tr::kSubTiles / 2; ++np) {
            unsigned bo[4];
            ldmatrix_x4(bo, q_b.at(np * 16, 2 * ks) + stage_off + kDOOff + q0 * QTile::kRowBytes);
            Mma<T>::run(dp[2 * np], a, bo[0], bo[1]);
            Mma<T>::run(dp[2 * np + 1], a, bo[2], bo[3]);
          }
        }

        // -- 11: P_ij = exp(tau S_ij - L_i) = exp2(S_ij tau log2(e) - L_i log2(e))
        //    14: dS_ij = P_ij o (dP_ij - D_i)
        // Masked pairs (keys past Lk; the pairs the Variant masks, causal: key > query +
        // causal_offset) are selected to P = dS = 0; only the chunks that cross the end of the
        // keys or this warp's mask boundary evaluate the mask. first[h], last[h]: this thread's
        // first and last visible query column, relative to its column 2 t4 of the chunk, for
        // its key rows g (h = 0), g + 8 (h = 1).
        const bool need_mask = kw0 + 16 > p.Lk || Var::needs_mask(p.var, p.mod, m0 + q0, m0 + q0 + SUB_M, kw0, kw0 + 16);
        int first[2], last[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int key = kw0 + g + 8 * h;
          first[h] = key >= p.Lk   ? (1 << 30)
                     : Var::kKeyHi ? Var::query_first(p.var, p.mod, key) - m0 - q0 - 2 * t4
                                   : -(1 << 30);
          last[h] = Var::query_last(p.var, p.mod, key) - m0 - q0 - 2 * t4;   // used only where kKeyLo
        }
        Var::transform_tile(p.var, s);
#pragma unroll
        for (int t = 0; t < Tr::kSubTiles; ++t) {
          const float2 l2 = *reinterpret_cast<const float2*>(sL2 + q0 + 8 * t + 2 * t4);
          const float2 di = *reinterpret_cast<const float2*>(sDi + q0 + 8 * t + 2 * t4);
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            // query i, key j of this element; P, dS with the score pipeline (bwd_io.cuh)
            const int qi = m0 + q0 + 8 * t + 2 * t4 + (e & 1), kj = kw0 + g + 8 * (e >> 1);
            bwd_io::p_ds_pair<Var>(p, item, b, scale, sl2, l2, di, t, e, qi, kj, need_mask, first, last,
                                   pair_tile, s[t][e], dp[t][e]);
          }
        }

        // -- 12: dV_j += P_ij^T dO_i;  16: dK_j += dS_ij^T Q_i  (contraction over the queries),
        //        P^T and dS^T taken straight from the accumulators as A operands (rounded to
        //        T); dS^T also goes to shared memory for line 15.
#pragma unroll
        for (int kk = 0; kk < Tr::kSubTiles / 2; ++kk) {
          unsigned ap[4], ads[4];
          ap[0] = pack2<T>(s[2 * kk][0], s[2 * kk][1]);
          ap[1] = pack2<T>(s[2 * kk][2], s[2 * kk][3]);
          ap[2] = pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
          ap[3] = pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
          ads[0] = pack2<T>(dp[2 * kk][0], dp[2 * kk][1]);
          ads[1] = pack2<T>(dp[2 * kk][2], dp[2 * kk][3]);
          ads[2] = pack2<T>(dp[2 * kk + 1][0], dp[2 * kk + 1][1]);
          ads[3] = pack2<T>(dp[2 * kk + 1][2], dp[2 * kk + 1][3]);
          // dS^T rows g, g + 8 of this warp, query chunks c, c + 1 (16 queries), column 2 t4
          const int c = q0 / 8 + 2 * kk;
          st_shared_b32(DSTile::addr(sdS, 16 * warp + g, c) + 4 * t4, ads[0]);
          st_shared_b32(DSTile::addr(sdS, 16 * warp + g + 8, c) + 4 * t4, ads[1]);
          st_shared_b32(DSTile::addr(sdS, 16 * warp + g, c + 1) + 4 * t4, ads[2]);
          st_shared_b32(DSTile::addr(sdS, 16 * warp + g + 8, c + 1) + 4 * t4, ads[3]);
#pragma unroll
          for (int np = 0; np < Tr::kDTiles / 2; ++np) {
            unsigned bo[4], bq[4];
            const unsigned qa = q_bt.at(kk * 16, 2 * np) + stage_off + q0 * QTile::kRowBytes;
            ldmatrix_x4_trans(bo, qa + kDOOff);
            Mma<T>::run(acc_dv[2 * np], ap, bo[0], bo[1]);
            Mma<T>::run(acc_dv[2 * np + 1], ap, bo[2], bo[3]);
            ldmatrix_x4_trans(bq, qa);
            Mma<T>::run(acc_dk[2 * np], ads, bq[0], bq[1]);
            Mma<T>::run(acc_dk[2 * np + 1], ads, bq[2], bq[3]);
          }
        }
      }
    }
    __syncthreads();   // dS_ij^T complete in shared memory

    // -- 15: dQ_i += tau dS_ij K_j (contraction over the keys of K_j; this warp: query rows
    //        16 wm.., features kDqCols wn.., in kDqPasses passes), added to dQ_i in HBM.
    //        Dead rows and rows past Lq are skipped: their dQ stays exactly 0.
    // DETERMINISTIC stages tau dS K_j in float32 in this stage's Q_i, dO_i space (free since
    // the barrier above; BLOCK_M x HEAD_DIM x 4 bytes: exactly the two tiles), its float2
    // column pairs XOR-swizzled by (row % 4) * 8 so that the 8 rows of a store fall in 4 bank
    // groups (2 wavefronts, the minimum for 256 bytes).
    float* const sdq = reinterpret_cast<float*>(smem + Tr::kOffQ + stage_off);
#pragma unroll 1
    for (int pass = 0; pass < Tr::kDqPasses; ++pass) {
      const int col0 = Tr::kDqCols * wn + 8 * Tr::kDqPassTiles * pass;
      float acc_dq[Tr::kDqPassTiles][4];
#pragma unroll
      for (int t = 0; t < Tr::kDqPassTiles; ++t)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_dq[t][e] = 0.f;
#pragma unroll
      for (int ks = 0; ks < WARPS; ++ks) {   // 16 keys a step: the keys of warp ks
        if (ks < kv_warps) {
          unsigned a[4];
          ldmatrix_x4_trans(a, ds_at.at(16 * ks, 2 * wm));
#pragma unroll
          for (int np = 0; np < Tr::kDqPassTiles / 2; ++np) {
            unsigned bk[4];
            ldmatrix_x4_trans(bk, k_bt.at(16 * ks, col0 / 8 + 2 * np));
            Mma<T>::run(acc_dq[2 * np], a, bk[0], bk[1]);
            Mma<T>::run(acc_dq[2 * np + 1], a, bk[2], bk[3]);
          }
        }
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = 16 * wm + g + 8 * h;
#pragma unroll
        for (int t = 0; t < Tr::kDqPassTiles; ++t) {
          const int col = col0 + 8 * t + 2 * t4;
          if (DETERMINISTIC) {
            *reinterpret_cast<float2*>(sdq + r * HEAD_DIM + (col ^ (8 * (r % 4)))) =
                make_float2(scale * acc_dq[t][2 * h], scale * acc_dq[t][2 * h + 1]);
          } else if (bwd_io::row_live(sL2, m0, r, p.Lq)) {
            // float atomics (red.global.add.f32): the order in which the key tiles'
            // additions land varies run to run
            float* const dst = gdq + (long long)(m0 + r) * p.d;
            if (col < p.d) atomicAdd(dst + col, scale * acc_dq[t][2 * h]);
            if (col + 1 < p.d) atomicAdd(dst + col + 1, scale * acc_dq[t][2 * h + 1]);
          }
        }
      }
    }
    if (DETERMINISTIC) {
      // Ordered accumulation (see the kernel comment): wait until key tiles 0 .. n_block - 1
      // have added theirs to dQ_i ...
      int* const sem = reinterpret_cast<int*>(p.dq_sem) + (long long)b * num_m_blocks + m0 / BLOCK_M;
      if (tid == 0) {
        // (the key tiles before K_j that visit Q_i: all of them, or under a window's left
        // bound those from the one holding Q_i's first visible key on)
        const int n_lo = Var::kKeyLo ? Var::key_begin(p.var, p.mod, m0) / kBlockN : 0;
        // (under a block mask only those whose transpose list holds Q_i: the key tiles of
        // [n_lo, n_block) in Q_i's list of the same tiles)
        int n_wait = n_block - n_lo;
        if constexpr (Var::kBlockMask) {
          int count;
          const int* const row = Var::Mod::template tile_list<true>(p.mod, item, m0 / BLOCK_M, count);
          n_wait = 0;
          for (int u = 0; u < count; ++u) {
            const int t = Var::Mod::entry_tile(row[u]);
            n_wait += t >= n_lo && t < n_block;
          }
        }
        while (ld_acquire_gpu(sem) != n_wait) {
        }
      }
      __syncthreads();   // ... (and the staged tile is complete)
      // ... then add ours row by row with plain loads and stores through L2 (.cg: no stale
      // L1 line of another SM's write), 4 columns a thread.
      const bool vec4 = (p.d & 3) == 0;   // then every row of dQ starts 16-byte aligned
      for (int idx = tid; idx < BLOCK_M * (HEAD_DIM / 4); idx += kThreads) {
        const int r = idx / (HEAD_DIM / 4), c = 4 * (idx % (HEAD_DIM / 4));
        if (!bwd_io::row_live(sL2, m0, r, p.Lq) || c >= p.d) continue;
        const float4 add = *reinterpret_cast<const float4*>(sdq + r * HEAD_DIM + (c ^ (8 * (r % 4))));
        float* const dst = gdq + (long long)(m0 + r) * p.d + c;
        if (vec4) {
          float4 cur = __ldcg(reinterpret_cast<const float4*>(dst));
          cur.x += add.x; cur.y += add.y; cur.z += add.z; cur.w += add.w;
          __stcg(reinterpret_cast<float4*>(dst), cur);
        } else {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float x = e == 0 ? add.x : e == 1 ? add.y : e == 2 ? add.z : add.w;
            if (c + e < p.d) __stcg(dst + e, __ldcg(dst + e) + x);
          }
        }
      }
      __threadfence();   // this thread's dQ stores are visible at gpu scope ...
      __syncthreads();   // ... for every thread of the block, before the release
      if (tid == 0) red_release_gpu_add(sem, 1);
    }
  }  // -- 17: end for
  cp_async_wait<0>();  // nothing left in flight (no query tile at all: K_j, V_j were loaded)

  // -- 18: Write dK_j = tau dK_j and dV_j to HBM (bwd_io.cuh)
  bwd_io::store_dk_dv<T>(p, b, kw0 + g, t4, scale, acc_dk, acc_dv);
}

}  // namespace cuflash
