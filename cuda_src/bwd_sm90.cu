// cuflash: tensor-core backward for float16 / bfloat16 on Hopper (sm_90a): wgmma.
//
// The algorithm and its data flow are bwd_sm80's (FlashAttention-2, Algorithm 2, lines 5-19;
// read that file's header first): one thread block per (batch item, key tile K_j, V_j), K_j and
// V_j loaded once, the block walking the query tiles Q_i that can see K_j with Q_i, dO_i
// double-buffered by cp.async, dK_j and dV_j held in registers for the whole walk, dQ added to
// a float32 buffer in HBM with atomics. What changes is who does the five products. A
// warpgroup (4 warps, 128 threads) owns 64 keys of K_j, V_j and issues, per query tile:
//   S_ij^T  = K_j Q_i^T    HEAD_DIM/16 wgmma m64n{BLOCK_M}k16; A = K, B = Q, both from shared
//   dP_ij^T = V_j dO_i^T   memory, K-major (as Q and K in fwd_sm90);
//   dV_j   += P_ij^T dO_i  BLOCK_M/16 wgmma m64n{HEAD_DIM}k16; A = P^T from registers (the S^T
//   dK_j   += dS_ij^T Q_i  accumulators turned into A fragments, as P in fwd_sm90), B = dO, Q
//                          read MN-major (as V in fwd_sm90);
//   dQ_i   += dS_ij K_j    BLOCK_N/16 wgmma m64n{kDqCols}k16; A = dS^T, which the warpgroups
//                          write to shared memory once (the block's only exchange) and the
//                          tensor cores read MN-major; B = K read MN-major. The warpgroups
//                          split dQ_i's BLOCK_M x HEAD_DIM into 64 x kDqCols slices.
// No ldmatrix: that traffic is what bounds bwd_sm80 on Hopper (bench/NOTES.md). Transposed
// products (S^T, dP^T, keys as the M dimension) put P^T and dS^T in registers in exactly the
// layout dV and dK need as their A operand.
//
// Per query tile: one barrier when Q_i, dO_i have landed (the other stage is then free for
// Q_{i+1}, dO_{i+1}), one when dS^T is complete in shared memory. Inside a warpgroup the
// products run one after the other, and the two barriers keep the warpgroups of a block in
// step, so one's element-wise work (P, dS) is hardly hidden behind the other's wgmma's: the
// next step is warp specialisation (bench/NOTES.md, "Where the remaining gap is").
//
// deterministic=True runs bwd_sm80 (its semaphore-ordered dQ); this kernel has only atomics.
//
// The modifiers (DESIGN.md "Modifiers"; the Variant's hooks, as in bwd_sm80): causal and the
// window bound the walk over the query tiles (query_begin / query_end) and the mask of the
// tiles that cross their diagonals (the plain code path; the sink is in L_i already and needs
// nothing here). ALiBi keeps the plain path too: it is a constant added to the scaled score
// (no gradient), so it changes only P's exponent, by -slope log2(e) |i + diag - j| (one FFMA
// an element, Mod::alibi_exp2), and dS = P o (dP - D) and everything after are as plain. A
// score transform that needs the chain rule or writes a gradient (softcap, bias, score_mod) or
// an element mask (bool array, mask_mod; a block mask's mask_mod alone: the plain path, kMaskBits) takes the
// path of bwd_io::p_ds_pair, the element of P and dS that bwd_sm80 computes too, with the chain
// rule of softcap / score_mod and dL/dbias (ALiBi: in Mod::score there); a block mask skips the
// query tiles it calls empty and the mask_mod of those it calls full. The softcap alone
// (bfloat16's tanh.approx build, no element mask, opt-in: Var::kSoftcapBwdPlain, session 10)
// keeps the plain path: th = tanh(tau S / c) per element, P from it, and the chain rule's
// 1 - th^2 folded into P once P^T is packed for dV. Which modifiers run at which head dim:
// cuflash/_traits.py, BWD_SM90_MODIFIERS.
//
// Requirements the launcher (cuflash/_plan.py, _launch.py) guarantees: as bwd_sm80 (rows of q, k, v,
// dO contiguous and 16-byte aligned, d and dv multiples of 8 or zero-padded to one), d, dv <=
// HEAD_DIM, HEAD_DIM in {64, 128}.
//
// Numerics: exactly bwd_sm80's (dead rows get L = +inf, D = 0 and zeroed Q, dO rows; keys past
// Lk and masked pairs get P = dS = 0 by selection; exp2 is ex2.approx.ftz; the modifiers'
// element is the same function, bwd_io::p_ds_pair), and the same float32 accumulation of every
// product. ALiBi on the plain path adds its term in base-2 units (slope log2(e) rounded once
// to float32) where bwd_sm80 adds it in natural units before multiplying by log2(e): the same
// exponent to float32 rounding; a dead row's exponent stays -inf (-inf minus a finite term),
// so P = 0 there as without it.
#include "common.cuh"
#include "mma_sm80.cuh"
#include "sm80_ops.cuh"
#include "bwd_io.cuh"
#include "online_softmax.cuh"
#include "sm90_ops.cuh"
#include "wgmma_sm90.cuh"

namespace cuflash {
namespace sm90 {

// Every tile constant of bwd_sm90. The free ones (HEAD_DIM bucket, BLOCK_M, WARPGROUPS) are
// template arguments chosen in cuflash/_traits.py (BWD_SM90, with the reasons and
// register counts); the rest follow, and the rules are static_asserts.
//   * BLOCK_N = 64 * WARPGROUPS: the wgmma M of S^T is 64 keys; each warpgroup owns its keys'
//     rows of dK_j, dV_j, so they need no reduction across warpgroups.
//   * Registers: dK_j and dV_j hold HEAD_DIM floats a thread for the whole kernel (64 x
//     HEAD_DIM each over 128 threads), S^T and dP^T another BLOCK_M while a tile is in flight;
//     with the A fragments and addresses that must stay under the 255 a thread may have.
//   * dQ_i: BLOCK_M / 64 row groups of 64 queries (a wgmma M) times WARPGROUPS / (BLOCK_M / 64)
//     column slices of kDqCols features. A 32-column slice starts 64 bytes into K_j's 128-byte
//     swizzle rows: the tensor cores apply the swizzle to the address they compute (bits 4-6
//     ^= bits 7-9), so a start inside a row is read correctly as long as the slice does not
//     cross into the next row (as the 32-byte k16 steps of a K-major operand do). The GPU
//     tests run such a build (CUFLASH_BWD_SM90_TILES=64:64:2:1).
//   * MIN_BLOCKS: blocks per SM the register budget must allow (__launch_bounds__).
template <typename T, int HEAD_DIM, int BLOCK_M, int WARPGROUPS, int MIN_BLOCKS>
struct BwdSm90Traits {
  static constexpr int kThreads = 128 * WARPGROUPS;
  static constexpr int kBlockN = 64 * WARPGROUPS;    // B_c: keys of K_j, 64 per warpgroup
  static constexpr int kBlockM = BLOCK_M;            // B_r: query rows of Q_i
  static constexpr int kKSteps = HEAD_DIM / 16;      // wgmma's of S^T and of dP^T
  static constexpr int kQSteps = BLOCK_M / 16;       // wgmma's of dV and of dK (k = query)
  static constexpr int kNTilesS = BLOCK_M / 8;       // 8-column tiles of S^T, dP^T in a thread
  static constexpr int kNTilesD = HEAD_DIM / 8;      // ... of dK_j, dV_j
  static constexpr int kDqRowGroups = BLOCK_M / 64;
  static constexpr int kDqColSplit = WARPGROUPS / kDqRowGroups;
  static constexpr int kDqCols = HEAD_DIM / kDqColSplit;
  static constexpr int kDqKSteps = kBlockN / 16;     // wgmma's of dQ (k = key)
  static constexpr int kNTilesDq = kDqCols / 8;

  using KVTile = Sm90Tile<kBlockN, HEAD_DIM>;   // K_j, V_j
  using QTile = Sm90Tile<BLOCK_M, HEAD_DIM>;    // Q_i, dO_i (two stages each)
  using DSTile = Sm90Tile<kBlockN, BLOCK_M>;    // dS_ij^T [key][query]
  static constexpr int kStages = 2;
  // Shared memory, bytes from the 1024-aligned base: K | V | (Q, dO) x 2 stages | dS^T |
  // (L_i log2(e), D_i) x 2 stages; + 1024 for aligning the dynamic base up to a swizzle atom.
  static constexpr int kOffK = 0;
  static constexpr int kOffV = KVTile::kBytes;
  static constexpr int kOffQ = 2 * KVTile::kBytes;
  static constexpr int kStageBytes = 2 * QTile::kBytes;   // dO_i follows Q_i in a stage
  static constexpr int kOffDS = kOffQ + kStages * kStageBytes;
  static constexpr int kOffStats = kOffDS + DSTile::kBytes;
  static constexpr int kStatStage = 2 * BLOCK_M;          // floats: L_i log2(e), then D_i
  static constexpr int kSmemBytes = kOffStats + kStages * kStatStage * 4 + 1024;

  static_assert(sizeof(T) == 2, "wgmma here takes float16 / bfloat16");
  static_assert(HEAD_DIM == 64 || HEAD_DIM == 128, "head-dim buckets 64 and 128");
  static_assert(BLOCK_M % 64 == 0 && BLOCK_M <= 256, "query tiles of whole 64-column blocks (dS^T's)");
  static_assert(WARPGROUPS >= 1 && WARPGROUPS <= 2, "at most 256 threads: registers");
  static_assert(kDqRowGroups <= WARPGROUPS && WARPGROUPS % kDqRowGroups == 0,
                "every warpgroup takes one 64-row group of dQ_i and one column slice");
  static_assert(kDqCols % 32 == 0 && (kDqCols >= 64 || 64 % kDqCols == 0),
                "dQ column slices inside one 128-byte swizzle row, or of whole ones");
  static_assert(MIN_BLOCKS >= 1 && MIN_BLOCKS * kThreads <= 2048, "threads per SM");
  static_assert(BLOCK_M <= kThreads, "one thread per query row stages L_i and D_i");
  static_assert(HEAD_DIM + BLOCK_M <= 192, "accumulators would crowd out fragments and addresses");
  static_assert(kOffV % 1024 == 0 && kOffQ % 1024 == 0 && kStageBytes % 1024 == 0 && kOffDS % 1024 == 0,
                "swizzled tiles start on 1024-byte atoms");
  static_assert(kSmemBytes <= 227 * 1024, "H100/H200 shared memory per block");
};

// The softcap's th = tanh(S tau / c) of a masked pair on the plain path (Var::kSoftcapBwdPlain):
// finite, so that P (1 - th^2) stays 0 x finite = 0 (th = -inf gave 0 x inf = NaN), and so
// negative that P = exp2(th c log2(e) - L log2(e)) is exactly 0 (ex2.approx.ftz of < -126)
// for every cap the host sends this path (c >= 1e-3: th c log2(e) <= -1.4e15); th^2 = 1e36
// is below float's 3.4e38.
constexpr float kHiddenTh = -1e18f;
template <bool B> struct Flag { static constexpr bool value = B; };   // (a compile-time flag as an argument)

// Two float32 values (columns col, col + 1 of a row of n) added to global memory with
// atomics: one 8-byte vector red (sm_90) when both exist and n is even (then the address is
// 8-byte aligned), else one each.
__device__ __forceinline__ void red_add2(float* row, int col, int n, float x, float y) {
  if ((n & 1) == 0 && col + 1 < n) {
    atomicAdd(reinterpret_cast<float2*>(row + col), make_float2(x, y));
  } else {
    if (col < n) atomicAdd(row + col, x);
    if (col + 1 < n) atomicAdd(row + col + 1, y);
  }
}

// Lines 5-19 of Algorithm 2. grid.x = nbatch * num_n_blocks, one block per (batch item b, key
// tile n_block) in p.grid_order's order (common.cuh: bwd_block_tile; the launcher picks
// tile-major under a causal mask).
//   FUSE_DQ: the build that can round dQ itself at the end (where the launcher also sets
// kBwdDqOut; bwd_io::finish_dq_at_end): its fence makes ptxas track every dQ atomic (ATOMG for
// REDG), so the launcher picks it only where a call is short (cuflash/_families.py,
// fuse_dq_wanted) and the other build keeps the machine code it had.
//   ONE_LAUNCH (with FUSE_DQ; where the launcher also sets kBwdOwnD): line 4 (D) computed by
// the block itself for the query rows it visits, and dQ's accumulator and counters left zeroed
// (bwd_io::block_row_dots, finish_dq_body's REZERO): the whole backward is this one launch, for
// problems whose host time is the call's cost (cuflash/_plan_one.py, one_launch_wanted).
template <typename T, int HEAD_DIM, int BLOCK_M, int WARPGROUPS, int MIN_BLOCKS, typename Var,
          bool FUSE_DQ = false, bool ONE_LAUNCH = false>
__global__ void __launch_bounds__(128 * WARPGROUPS, MIN_BLOCKS)
bwd_sm90(const Params CUFLASH_VARLEN_PARAM(p)) {
  CUFLASH_VARLEN_VIEW(T, p)   // varlen builds: this block's sequence (common.cuh; helper "inference")
  using Tr = BwdSm90Traits<T, HEAD_DIM, BLOCK_M, WARPGROUPS, MIN_BLOCKS>;
  using KVTile = typename Tr::KVTile;
  using QTile = typename Tr::QTile;
  using DSTile = typename Tr::DSTile;
  constexpr int kBlockN = Tr::kBlockN, kThreads = Tr::kThreads;

  // The launcher computes kSmemBytes with the same formula (cuflash/_traits.py).
  if (dynamic_smem_size() < unsigned(Tr::kSmemBytes)) __trap();
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const unsigned raw = smem_u32(smem_raw);
  const unsigned sbase = (raw + 1023u) & ~1023u;
  unsigned char* const smem = smem_raw + (sbase - raw);
  const unsigned sK = sbase + Tr::kOffK, sV = sbase + Tr::kOffV;
  const unsigned sQ = sbase + Tr::kOffQ;       // stage s: Q at sQ + s * kStageBytes, dO after it
  const unsigned sdS = sbase + Tr::kOffDS;
  float* const sStats = reinterpret_cast<float*>(smem + Tr::kOffStats);

  const int tid = int(threadIdx.x), wg = tid / 128, warp = (tid / 32) % 4, lane = tid % 32;
  const BwdBlockTile tile = bwd_block_tile(p);
  const int n_block = tile.n_block, b = tile.b;
  const int n0 = n_block * kBlockN;
  const BatchOffsets off = batch_offsets(p, b);
  const BatchPtrs<T> gmem = batch_ptrs<T>(p, off);   // K_j, V_j's (q, dout: see load_q_tile)
  // The modifiers that need the chain rule in dS (softcap, score_mod), write dL/dbias (a
  // bias) or mask element by element (a bool mask, mask_mod) take the path of
  // bwd_io::p_ds_pair below; causal, the window, the sink and ALiBi keep the plain one (the
  // sink is in L_i already, dsink is the launcher's, from D and L; ALiBi is a constant added
  // to the scaled score, so it changes only the exponent of P: Mod::alibi_exp2).
  //   kMaskBits: an element mask with no score transform at HEAD_DIM 128 (a block mask's
  // mask_mod) keeps the plain path, its mask as bits (bwd_io::mask_bits, evaluated while S^T,
  // dP^T are in the tensor cores): the pairwise path holds S^T, dP^T, dK_j, dV_j (192 floats
  // a thread) through the mask_mod and spilled 8-80 bytes at 255 registers (bench/NOTES.md,
  // session 10). HEAD_DIM 64: with the table's 128-row tiles the bits too, 64 of them (a block
  // mask's mask_mod alone); in 64-row tiles (CUFLASH_BWD90_BMASK_ROWS=64) the pairwise path.
  // The softcap alone (Var::kSoftcapBwdPlain): its two steps on the plain path, below.
  constexpr bool kMaskBits = (HEAD_DIM == 128 || BLOCK_M == 128) && Var::kPairMask && !Var::kGrad && !Var::kNatural;
  using MaskWord = typename bwd_io::MaskWord<4 * Tr::kNTilesS>::type;
  constexpr bool kPairwise = ((Var::kGrad && !Var::kSoftcapBwdPlain) || Var::kPairMask) && !kMaskBits;
  static_assert(!(kMaskBits && Var::kSoftcapBwdPlain), "the softcap's plain path has no element mask");
  static_assert(kPairwise || !Var::Mod::kTransforms || Var::Mod::kHasAlibi || Var::kSoftcapBwdPlain,
                "the plain path's only score transforms are ALiBi and the softcap alone");
  // tau * log2(e); log2(e) where the modifiers give natural-unit scores (p_ds_pair)
  // (c log2(e) where p_ds_pair's scores are in units of the softcap c: Var::kCapUnits)
  const float sl2 = Var::kCapUnits ? p.mod.softcap * 1.4426950408889634f
                    : (kPairwise && Var::kNatural) ? 1.4426950408889634f : float(p.var.scale_log2);
  const float scale = float(p.var.scale);      // tau
  // the modifiers' state of this batch item (slopes, bias / mask rows); empty if unused
  const auto item = Var::template item<float>(p, b);
  // ALiBi on the plain path: slope log2(e), the base-2 units of its exponent
  [[maybe_unused]] const float slope_l2 = Var::Mod::alibi_slope_log2(item);

  // The query tiles that can see K_j: from the one holding the first query that sees a key of
  // K_j (causal: row n0 - causal_offset; a window's right bound), up to the last query that
  // sees one (a window's left bound; Lq otherwise).
  const int m_first = Var::query_begin(p.var, p.mod, n0) / BLOCK_M * BLOCK_M;
  // (read as Var::kKeyLo ? m_end : p.Lq below: without a window the loop bound stays the
  // parameter itself, as in bwd_sm80)
  const int m_end = Var::kKeyLo ? Var::query_end(p.var, p.mod, n0 + kBlockN, p.Lq) : p.Lq;
  // Within that range a block mask visits only the query tiles of its transpose list for K_j
  // (Mod::tile_list<false>, as bwd_sm80): the others' Q_i, dO_i, L_i, D_i are never loaded and
  // nothing of them is computed. after(m0), the tile after m0 (m_walk, from entry e_next,
  // read one tile earlier), is prefetched during m0, and the entry after it is read then. The
  // kind comes with the entry. Without a block mask: m_first, m_first + BLOCK_M, ...
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

  // Q_i, dO_i of the tile at m0 into stage `stage` (cp.async), its L_i, D_i into registers of
  // the threads tid < BLOCK_M (one row each), stored to shared memory at the top of the
  // iteration that uses them (as bwd_sm80).
  float lse_next = 0.f, d_next = 0.f;
  // (The pointers are recomputed from p at each call rather than kept: registers are the
  // scarce resource here, see the traits.)
  auto load_q_tile = [&](int m0, int stage) {
    const BatchPtrs<T> gi = batch_ptrs<T>(p, batch_offsets(p, b));
    const unsigned sq = sQ + stage * Tr::kStageBytes;
    bwd_io::cp_async_rows<QTile, BLOCK_M, kThreads>(sq, gi.q, p.q_row_stride, m0, p.Lq, p.d);
    bwd_io::cp_async_rows<QTile, BLOCK_M, kThreads>(sq + QTile::kBytes, gi.dout, p.dout_row_stride, m0, p.Lq, p.dv);
    if (tid < BLOCK_M && m0 + tid < p.Lq) {
      const long long row = (long long)b * p.Lq + m0 + tid;
      lse_next = __ldg(reinterpret_cast<const float*>(p.lse) + row);
      if constexpr (ONE_LAUNCH)   // (written by this kernel: not through the read-only path)
        d_next = reinterpret_cast<const float*>(p.dpsum)[row];
      else
        d_next = __ldg(reinterpret_cast<const float*>(p.dpsum) + row);
    }
  };
  if constexpr (ONE_LAUNCH) {
    // -- 4 for the rows of the query tiles this block visits (kBwdOwnD; else bwd_dot_do_o's)
    if (p.out_flags & kBwdOwnD) {
      const int m_stop = min(p.Lq, ((Var::kKeyLo ? m_end : p.Lq) + BLOCK_M - 1) / BLOCK_M * BLOCK_M);
      bwd_io::block_row_dots<T, HEAD_DIM, kThreads>(p, b, m_start, m_stop);
      __syncthreads();   // the block's D visible to load_q_tile's plain loads
    }
  }
  if (m_start < (Var::kKeyLo ? m_end : p.Lq)) load_q_tile(m_start, 0);
  cp_async_commit();

  // -- 7: Initialise dK_j = 0, dV_j = 0 on chip (wgmma accumulators: rows = this warpgroup's
  //       keys, warp w of it rows 16w.., columns = features; tau is applied to dK_j at the end)
  float acc_dk[Tr::kNTilesD][4], acc_dv[Tr::kNTilesD][4];
#pragma unroll
  for (int t = 0; t < Tr::kNTilesD; ++t)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc_dk[t][e] = acc_dv[t][e] = 0.f;

  // Descriptors at stage 0, k-step 0 (sm90_ops.cuh: make_desc); a k-step or a stage adds a
  // byte offset >> 4 to the start-address field.
  //   A of S^T, dP^T: this warpgroup's 64 rows of K_j, V_j (K-major, k = feature)
  const unsigned long long desc_k = make_desc(sK + wg * 64 * 128, 16, 1024);
  const unsigned long long desc_v = make_desc(sV + wg * 64 * 128, 16, 1024);
  //   B of S^T, dP^T: Q_i, dO_i (K-major, n = query, k = feature)
  const unsigned long long desc_q = make_desc(sQ, 16, 1024);
  const unsigned long long desc_do = make_desc(sQ + QTile::kBytes, 16, 1024);
  //   B of dK += dS^T Q, dV += P^T dO: Q_i, dO_i read MN-major (k = query, n = feature)
  const unsigned long long desc_qt = make_desc(sQ, QTile::kBlockBytes, 1024);
  const unsigned long long desc_dot = make_desc(sQ + QTile::kBytes, QTile::kBlockBytes, 1024);
  //   dQ_i slice of this warpgroup: query rows 64 dq_rg.., features dq_c0..
  const int dq_rg = wg / Tr::kDqColSplit, dq_c0 = (wg % Tr::kDqColSplit) * Tr::kDqCols;
  //   A of dQ: dS^T's 64-query column block dq_rg read MN-major (m = query, k = key)
  const unsigned long long desc_ds = make_desc(sdS + dq_rg * DSTile::kBlockBytes, DSTile::kBlockBytes, 1024);
  //   B of dQ: K_j read MN-major (k = key, n = feature), from feature dq_c0 (column block
  //   dq_c0 / 64, 2 (dq_c0 % 64) bytes into its rows)
  const unsigned long long desc_kt =
      make_desc(sK + (dq_c0 / 64) * KVTile::kBlockBytes + (dq_c0 % 64) * 2, KVTile::kBlockBytes, 1024);
  constexpr unsigned long long kRows16 = (16 * 128) >> 4;   // k16 step of an MN-major operand
  auto kstep = [](int ks, int block_bytes) {                 // k16 step of a K-major operand
    return static_cast<unsigned long long>(((ks / 4) * block_bytes + (ks % 4) * 32) >> 4);
  };

  // -- X^T = A_j B_i^T over the head dim (S^T: A = K, B = Q; dP^T: A = V, B = dO), one commit
  //    group each (the caller waits)
  auto issue_transposed_scores = [&](float (&x)[Tr::kNTilesS][4], unsigned long long desc_a,
                                     unsigned long long desc_b) {
#pragma unroll
    for (int ks = 0; ks < Tr::kKSteps; ++ks)
      Wgmma<T, BLOCK_M>::ss(x, desc_a + kstep(ks, KVTile::kBlockBytes),
                            desc_b + kstep(ks, QTile::kBlockBytes), ks > 0);
    wgmma_commit();
  };
  // -- acc += F B_i over the queries, F from registers (dV: F = P^T, B = dO; dK: F = dS^T, B = Q)
  auto accumulate_over_queries = [&](float (&acc)[Tr::kNTilesD][4], const unsigned (&f)[Tr::kQSteps][4],
                                     unsigned long long desc_b) {
#pragma unroll
    for (int kk = 0; kk < Tr::kQSteps; ++kk)
      Wgmma<T, HEAD_DIM>::rs_t(acc, f[kk], desc_b + kk * kRows16, 1);
  };

  const int kw0 = n0 + 64 * wg + 16 * warp;    // this warp's first key
  const int g = lane / 4, t4 = lane % 4;       // accumulator fragment coordinates

  // -- 8: for 1 <= i <= T_r (the query tiles that can see K_j):
  int stage = 0;
  for (int m0 = m_start; m0 < (Var::kKeyLo ? m_end : p.Lq); m0 = after(m0), stage ^= 1) {
    const unsigned stage_off = stage * Tr::kStageBytes;
    const unsigned long long sdesc = stage_off >> 4;
    float* const sL2 = sStats + stage * Tr::kStatStage;   // L_i * log2(e); +inf: no P here
    float* const sDi = sL2 + BLOCK_M;                    // D_i

    // -- 9: Load Q_i, dO_i, L_i, D_i from HBM to on-chip SRAM (issued one tile ahead). A dead
    //       row (L_i = -inf) or a row past Lq gets L = +inf and D = 0 (see bwd_sm80.cu).
    const bool dead = bwd_io::stage_stats<BLOCK_M>(sL2, sDi, tid, m0, p.Lq, lse_next, d_next);
    cp_async_wait<0>();    // this thread's copies of Q_i, dO_i (and K_j, V_j) have landed ...
    fence_proxy_async();   // ... are visible to the tensor cores' (async proxy) reads ...
    // ... for every thread, and every warpgroup is done with the previous tile (the other
    // stage, dS^T). Dead rows of Q_i, dO_i are zeroed, with one more barrier.
    if (__syncthreads_or(dead)) {
      bwd_io::zero_dead_rows<QTile, BLOCK_M, kThreads>(sQ + stage_off, sQ + stage_off + QTile::kBytes, sL2, m0, p.Lq);
      fence_proxy_async();
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

    // A block mask: in a (query tile, key tile) its mask_mod keeps entirely the mask_mod is not
    // evaluated (the list holds no tile it hides entirely).
    bool pair_tile = true;
    if constexpr (Var::kBlockMask) pair_tile = Var::Mod::entry_kind(e_here, 0) != kTileFull;

    // -- 10: S_ij^T = K_j Q_i^T;  13: dP_ij^T = V_j dO_i^T  (this warpgroup's 64 keys x BLOCK_M
    //        queries; a thread holds keys kw0 + g (+8) x queries 8t + 2 t4 (+1)), two commit
    //        groups so that P can start while dP^T is still in the tensor cores
    float s[Tr::kNTilesS][4], dp[Tr::kNTilesS][4];
    wgmma_fence();
    issue_transposed_scores(s, desc_k, desc_q + sdesc);
    issue_transposed_scores(dp, desc_v, desc_do + sdesc);

    // Masked pairs (keys past Lk; the pairs the Variant masks, causal: key > query +
    // causal_offset) are selected to P = dS = 0; only warps whose 16 keys cross the end of the
    // keys or the tile's mask boundary evaluate the mask. first[h], last[h]: this thread's first
    // and last visible query column, relative to its column 2 t4, for its key rows g (h = 0)
    // and g + 8 (h = 1).
    // (kMaskBits: the element mask where the block mask does not know the tile full: a branch a warp and tile)
    bool need_mask;
    if constexpr (kMaskBits)
      need_mask = kw0 + 16 > p.Lk || pair_tile || Var::needs_bound_mask(p.var, p.mod, m0, m0 + BLOCK_M, kw0, kw0 + 16);
    else
      need_mask = kw0 + 16 > p.Lk || Var::needs_mask(p.var, p.mod, m0, m0 + BLOCK_M, kw0, kw0 + 16);
    int first[2], last[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int key = kw0 + g + 8 * h;
      first[h] = key >= p.Lk ? (1 << 30) : Var::kKeyHi ? Var::query_first(p.var, p.mod, key) - m0 - 2 * t4 : -(1 << 30);
      last[h] = Var::query_last(p.var, p.mod, key) - m0 - 2 * t4;   // used only where kKeyLo
    }

    // (kMaskBits: first / last and the element mask as bits, while S^T, dP^T are computed)
    [[maybe_unused]] MaskWord keep = ~MaskWord(0);
    if constexpr (kMaskBits)
      if (need_mask) keep = bwd_io::mask_bits<Var, Tr::kNTilesS, MaskWord>(p, item, m0 + 2 * t4, kw0 + g, first, last, pair_tile);
    unsigned pa[Tr::kQSteps][4];   // P^T as the A operand of dV (rounded to T)
    unsigned dsa[Tr::kQSteps][4];  // dS^T as the A operand of dK (rounded to T)
    if constexpr (!kPairwise) {
      // -- 11: P_ij = exp(tau S_ij - L_i) = exp2(S_ij tau log2(e) - L_i log2(e)); with ALiBi
      //        exp(tau S_ij - slope |i + diag - j| - L_i), its term added in the exponent
      //        (Mod::alibi_exp2; dist0: the distance of this thread's element (t, e) = (0, 0),
      //        query m0 + 2 t4, key kw0 + g; the others add compile-time constants)
      wgmma_wait<1>();
      fence_regs(s);
      Var::transform_tile(p.var, s);
      [[maybe_unused]] float dist0 = 0.f;
      if constexpr (Var::Mod::kHasAlibi) dist0 = float(m0 + 2 * t4 + p.mod.diag - kw0 - g);
      if constexpr (Var::kSoftcapBwdPlain) {
        // The softcap alone (scores in units of c, sl2 = c log2(e), as the forward), element
        // by element: th = tanh.approx(S tau / c) (a masked pair's: kHiddenTh; the tile's code
        // twice, with and without the mask, behind one uniform branch), P = exp2(th sl2 - L
        // log2(e)), packed into P^T's A fragment of dV, and in S's place P (1 - th^2): dS =
        // P (1 - th^2) o (dP - D) below is dL/d(tau S), the chain rule of c tanh(tau S / c)
        // (Mod::grad_capped's factor), in the registers P has on this path, and P still
        // starts while dP^T is in the tensor cores (the per-element path waits for both).
        // 2 special-function operations a score (tanh, ex2), 4 instructions more than plain.
        // (64-row query tiles, _variant.modifier_tiles: at d = 64 the plain table's 128 spill.)
        const float kcap = scale * p.mod.inv_softcap;
        auto p_and_factor = [&](auto masked) {
#pragma unroll
          for (int t = 0; t < Tr::kNTilesS; ++t) {
            const float2 l2 = *reinterpret_cast<const float2*>(sL2 + 8 * t + 2 * t4);
#pragma unroll
            for (int h = 0; h < 2; ++h) {   // key row g + 8 h: elements 2 h, 2 h + 1
              float th0 = tanh_approx(s[t][2 * h] * kcap), th1 = tanh_approx(s[t][2 * h + 1] * kcap);
              if constexpr (decltype(masked)::value) {
                th0 = (8 * t >= first[h] && (!Var::kKeyLo || 8 * t <= last[h])) ? th0 : kHiddenTh;
                th1 = (8 * t + 1 >= first[h] && (!Var::kKeyLo || 8 * t + 1 <= last[h])) ? th1 : kHiddenTh;
              }
              const float p0 = ex2_approx(fmaf(th0, sl2, -l2.x)), p1 = ex2_approx(fmaf(th1, sl2, -l2.y));
              pa[t / 2][2 * (t % 2) + h] = pack2<T>(p0, p1);   // (p_fragment's layout)
              s[t][2 * h] = fmaf(-p0 * th0, th0, p0);
              s[t][2 * h + 1] = fmaf(-p1 * th1, th1, p1);
            }
          }
        };
        if (need_mask) p_and_factor(Flag<true>{});
        else p_and_factor(Flag<false>{});
      } else {
#pragma unroll
        for (int t = 0; t < Tr::kNTilesS; ++t) {
          const float2 l2 = *reinterpret_cast<const float2*>(sL2 + 8 * t + 2 * t4);
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            float x = fmaf(s[t][e], sl2, -((e & 1) ? l2.y : l2.x));
            if constexpr (Var::Mod::kHasAlibi)   // (a dead row's x = -inf stays -inf: P = 0)
              x = Var::Mod::alibi_exp2(x, slope_l2, dist0 + float(8 * t + (e & 1) - 8 * (e >> 1)));
            s[t][e] = ex2_approx(x);
          }
        }
        if constexpr (kMaskBits) { if (need_mask) bwd_io::select_bits(s, keep); }
        else if (need_mask) bwd_io::select_visible<Var::kKeyLo>(s, first, last);
#pragma unroll
        for (int kk = 0; kk < Tr::kQSteps; ++kk) p_fragment<T>(pa[kk], s, kk);
      }

      // -- 14: dS_ij = P_ij o (dP_ij - D_i)  (0 where P was selected to 0: dP - D can be NaN
      //        there, from a NaN in a dO row that does not see the key)
      wgmma_wait<0>();
      fence_regs(dp);
#pragma unroll
      for (int t = 0; t < Tr::kNTilesS; ++t) {
        const float2 di = *reinterpret_cast<const float2*>(sDi + 8 * t + 2 * t4);
#pragma unroll
        for (int e = 0; e < 4; ++e) dp[t][e] = s[t][e] * (dp[t][e] - ((e & 1) ? di.y : di.x));
      }
      if constexpr (kMaskBits) { if (need_mask) bwd_io::select_bits(dp, keep); }
      else if (need_mask) bwd_io::select_visible<Var::kKeyLo>(dp, first, last);
#pragma unroll
      for (int kk = 0; kk < Tr::kQSteps; ++kk) p_fragment<T>(dsa[kk], dp, kk);
    } else {
      // -- 11, 14 with the modifiers (bwd_io.cuh: p_ds_pair, the element bwd_sm80 computes
      //    too): both products first, since the chain rule of softcap / score_mod needs the
      //    raw S_ij^T next to dP_ij^T (P cannot start while dP^T is in the tensor cores: a
      //    third tile of registers is not there). 16 query columns at a time, each turned
      //    into the A fragments of dV and dK at once (their S^T, dP^T registers free again).
      wgmma_wait<0>();
      fence_regs(s);
      fence_regs(dp);
#pragma unroll
      for (int kk = 0; kk < Tr::kQSteps; ++kk) {   // 16 query columns, then their A fragments
#pragma unroll
        for (int t = 2 * kk; t < 2 * kk + 2; ++t) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            // (L_i, D_i of this element's row read here, not as float2 pairs per tile: ptxas
            // then hoists fewer loads ahead, and softcap, ALiBi at d = 128 do not spill)
            const float l2s = sL2[8 * t + 2 * t4 + (e & 1)], dis = sDi[8 * t + 2 * t4 + (e & 1)];
            const float2 l2 = make_float2(l2s, l2s), di = make_float2(dis, dis);
            const int qi = m0 + 8 * t + 2 * t4 + (e & 1), kj = kw0 + g + 8 * (e >> 1);
            bwd_io::p_ds_pair<Var, true>(p, item, b, scale, sl2, l2, di, t, e, qi, kj, need_mask, first, last,
                                   pair_tile, s[t][e], dp[t][e]);
          }
        }
        p_fragment<T>(pa[kk], s, kk);
        p_fragment<T>(dsa[kk], dp, kk);
      }
    }

    // dS^T to shared memory for line 15: this thread's keys g, g + 8 of warp `warp`, query
    // columns 16 kk + 2 t4 (+1) and 16 kk + 8 + 2 t4 (+1), the same rounded values as dsa
    // (stored before the wgmma's below read dsa: a register a wgmma in flight reads must not
    // be touched, not even read, until it is waited for).
    const int ds_row = 64 * wg + 16 * warp + g;
#pragma unroll
    for (int kk = 0; kk < Tr::kQSteps; ++kk) {
      st_shared_b32(DSTile::addr(sdS, ds_row, 2 * kk) + 4 * t4, dsa[kk][0]);
      st_shared_b32(DSTile::addr(sdS, ds_row + 8, 2 * kk) + 4 * t4, dsa[kk][1]);
      st_shared_b32(DSTile::addr(sdS, ds_row, 2 * kk + 1) + 4 * t4, dsa[kk][2]);
      st_shared_b32(DSTile::addr(sdS, ds_row + 8, 2 * kk + 1) + 4 * t4, dsa[kk][3]);
    }
    // -- 12: dV_j += P_ij^T dO_i;  16: dK_j += dS_ij^T Q_i  (contraction over the queries)
    wgmma_fence();
    accumulate_over_queries(acc_dv, pa, desc_dot + sdesc);
    accumulate_over_queries(acc_dk, dsa, desc_qt + sdesc);
    wgmma_commit();

    fence_proxy_async();   // generic-proxy stores -> the tensor cores' reads
    __syncthreads();       // dS_ij^T complete in shared memory

    // -- 15: dQ_i += tau dS_ij K_j (contraction over all BLOCK_N keys; this warpgroup's slice),
    //        added to dQ_i in HBM with float atomics (the order in which the key tiles'
    //        additions land varies run to run). Dead rows and rows past Lq are skipped: their
    //        dQ stays exactly 0.
    float acc_dq[Tr::kNTilesDq][4];
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < Tr::kDqKSteps; ++ks)
      Wgmma<T, Tr::kDqCols>::template ss<1, 1>(acc_dq, desc_ds + ks * kRows16, desc_kt + ks * kRows16, ks > 0);
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(acc_dq);
    fence_regs(acc_dv);
    fence_regs(acc_dk);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = 64 * dq_rg + 16 * warp + g + 8 * h;
      if (bwd_io::row_live(sL2, m0, r, p.Lq)) {
        float* const dst = reinterpret_cast<float*>(p.dq_acc) + ((long long)b * p.Lq + m0 + r) * p.d;
#ifndef CUFLASH_BWD90_DQ_BOUNDS
        // (a block mask where d = HEAD_DIM, with CUFLASH_BWD90_DQ_ROWS=1: the launcher defines
        // the macro otherwise, and by default until these additions have run on a GPU)
        if constexpr (Var::kBlockMask) {
          bwd_io::red_row_pairs(dst, dq_c0 + 2 * t4, acc_dq, h, scale);
          continue;
        }
#endif
#pragma unroll
        for (int t = 0; t < Tr::kNTilesDq; ++t)
          red_add2(dst, dq_c0 + 8 * t + 2 * t4, p.d, scale * acc_dq[t][2 * h], scale * acc_dq[t][2 * h + 1]);
      }
    }
  }  // -- 17: end for
  cp_async_wait<0>();  // nothing left in flight (no query tile at all: K_j, V_j were loaded)

  // -- 18: Write dK_j = tau dK_j and dV_j to HBM (bwd_io.cuh)
  bwd_io::store_dk_dv<T>(p, b, kw0 + g, t4, scale, acc_dk, acc_dv);

  // dQ rounded here by the block that adds last to a query tile, where the launcher asks
  // (bwd_io.cuh: no bwd_finish_dq launch then); the statistics' shared memory is free
  static_assert(Tr::kStages * Tr::kStatStage >= kThreads, "an int a thread in the statistics' shared memory");
  if constexpr (FUSE_DQ) {
    if (p.out_flags & kBwdDqOut)
      bwd_io::finish_dq_at_end<T, BLOCK_M, kThreads, ONE_LAUNCH>(p, b, reinterpret_cast<int*>(sStats));
  }
}

}  // namespace sm90
}  // namespace cuflash
