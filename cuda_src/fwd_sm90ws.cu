// cuflash: warp-specialised tensor-core forward for float16 / bfloat16 on Hopper (sm_90a).
//
// fwd_sm90's algorithm (FlashAttention-2, Algorithm 1, one block per (batch item, BLOCK_M
// query rows), wgmma with Q, K, V read from shared memory and P from registers) with
// FlashAttention-3's division of labour inside the block:
//   - one *producer* warpgroup only copies: Q_i once, then K_j and V_j into a ring of STAGES
//     shared-memory stages, each stage's arrival signalled on an mbarrier by the copies
//     themselves (cp.async.mbarrier.arrive), and a stage refilled once the consumers release it;
//   - CONSUMERS *consumer* warpgroups of 64 query rows each only compute: S = Q K_j^T, the
//     online softmax, O += P V_j, with no copy instruction and no block-wide barrier in the
//     loop: each waits for the tile it needs and releases K_j once S is computed, V_j once
//     P V is; and each overlaps its softmax of S_j with its own P_{j-1} V_{j-1} on the tensor
//     cores (FlashAttention-3's intra-warpgroup pipelining: the key loop below).
//   - PINGPONG: the consumers take turns to issue their products (named barriers), so that one's
//     softmax runs while another's products hold the tensor cores.
// Why: in fwd_sm90 every warpgroup issues its share of the next tile's copies and all of them
// meet at a __syncthreads every key tile, so they move in lockstep, their element-wise work and
// their products alternating instead of overlapping (bench/NOTES.md, "the window forward's
// 0.85 ..."). The producer gives up registers (setmaxnreg.dec) for the consumers
// (setmaxnreg.inc): at 2 consumers that is 232 a consumer thread, room for 128-key tiles at
// d = 128 (S 64, O 64, P 32 registers), where fwd_sm90's 3-warpgroup cap of 168 keeps it at
// 64-key tiles. Measured (H200, session 16): 1.26-1.51x fwd_sm90 at d 128, level with cuDNN
// at 16k; the producer must stay cheap (producer_copy, below), it shares the issue slots.
//
// PERSIST (session 17, below): a grid of one block an SM, each running query tiles in turn.
// Not here (yet): TMA (the copies are cp.async, so Params and the plans stay as they are), block
// masks (the dispatcher keeps those on fwd_sm90), the LEAN builds.
//
// Requirements the launcher guarantees: as fwd_sm90 (rows contiguous and 16-byte aligned, d and
// dv multiples of 8, at most HEAD_DIM, HEAD_DIM % 64 == 0).
#include "common.cuh"
#include "mma_sm80.cuh"
#include "online_softmax.cuh"
#include "sm90_ops.cuh"
#include "wgmma_sm90.cuh"

// CUFLASH_WS_STAMPS (defined only by bench/probes/ws_stamps.py, never by the package): the
// first thread of each warpgroup records clock64() at the phases of each of its block's first
// 64 items (blocks < 132), so the probe can say where an item's time goes; without it
// WS_STAMP is nothing and the machine code is the same.
#ifdef CUFLASH_WS_STAMPS
extern "C" {
__device__ unsigned long long cuflash_ws_stamps[132 * 4 * 64 * 16];
}
#define WS_STAMP(qi, k)                                                                        \
  do {                                                                                         \
    if (threadIdx.x % 128 == 0 && blockIdx.x < 132 && (qi) < 64)                               \
      cuflash_ws_stamps[((blockIdx.x * 4 + threadIdx.x / 128) * 64 + (qi)) * 16 + (k)] = clock64(); \
  } while (0)
#else
#define WS_STAMP(qi, k) \
  do {                  \
  } while (0)
#endif

namespace cuflash {
namespace sm90 {

// Tile constants of one specialisation; the per-head-dim choice with its reasons is the table
// FWD_SM90WS in cuflash/_traits.py.
template <typename T, int HEAD_DIM, int BLOCK_N, int CONSUMERS, int STAGES, int PERSIST = 0>
struct WsTraits {
  static constexpr int kThreads = 128 * (CONSUMERS + 1);   // + the producer warpgroup
  static constexpr int kBlockM = 64 * CONSUMERS;            // 64 rows a consumer (the wgmma M)
  static constexpr int kKSteps = HEAD_DIM / 16;
  static constexpr int kPVSteps = BLOCK_N / 16;
  static constexpr int kNTilesS = BLOCK_N / 8;
  static constexpr int kNTilesO = HEAD_DIM / 8;
  using QTile = Sm90Tile<kBlockM, HEAD_DIM>;
  using KVTile = Sm90Tile<BLOCK_N, HEAD_DIM>;
  static constexpr int kStageBytes = 2 * KVTile::kBytes;   // K_j then V_j
  // PERSIST: a second Q buffer (after the stages), the next item's Q lands in it
  static constexpr int kQBuffers = PERSIST ? 2 : 1;
  // the mbarriers, after the tiles: Q landed; per stage K landed, V landed, K released, V
  // released; PERSIST: the second buffer's Q landed, each buffer's Q released
  static constexpr int kBarriers = 1 + 4 * STAGES + (PERSIST ? 3 : 0);
  // + 1024: the dynamic shared memory base is aligned up to the 1024-byte swizzle atom
  static constexpr int kSmemBytes = kQBuffers * QTile::kBytes + STAGES * kStageBytes + 8 * kBarriers + 1024;
  // Registers: one block an SM holds the whole file (65536), kLaunchRegs a thread at launch
  // (the __launch_bounds__ cap ptxas compiles to); the producer keeps kProducerRegs (its
  // copies' addresses and the loop: 40, or 32 at 3 consumers, whose S, O and P at d = 64 need
  // the 160 that leaves them) and hands the rest to the consumers.
  static constexpr int kLaunchRegs = (65536 / kThreads) & ~7;
  static constexpr int kProducerRegs = CONSUMERS >= 3 ? 32 : 40;
  static constexpr int kConsumerRegs = ((65536 - 128 * kProducerRegs) / (128 * CONSUMERS)) & ~7;

  static_assert(sizeof(T) == 2, "wgmma here takes float16 / bfloat16");
  static_assert(HEAD_DIM % 64 == 0 && HEAD_DIM <= 256, "head dims in whole 128-byte column blocks");
  static_assert(BLOCK_N % 16 == 0 && BLOCK_N <= 256, "wgmma N and the k16 steps of P V");
  static_assert(CONSUMERS >= 1 && CONSUMERS <= 3, "at most 4 warpgroups a block");
  static_assert(STAGES >= 2, "a stage computes while the next one loads");
  static_assert(PERSIST >= 0 && PERSIST <= 3, "0: one item a block; 1: round-robin; 2: zigzag; 3: lists");
  static_assert((kBlockM * QTile::kChunks) % 128 == 0 && (BLOCK_N * KVTile::kChunks) % 128 == 0,
                "the producer's 128 threads copy whole rounds of 16-byte chunks");
  static_assert(QTile::kBytes % 1024 == 0 && KVTile::kBytes % 1024 == 0, "atoms stay 1024-aligned");
  static_assert(kSmemBytes <= 227 * 1024, "H100/H200 shared memory per block");
  static_assert(kProducerRegs < kLaunchRegs && kConsumerRegs >= kLaunchRegs && kConsumerRegs <= 256,
                "setmaxnreg moves registers from the producer to the consumers");
  static_assert(128 * kProducerRegs + 128 * CONSUMERS * kConsumerRegs <= kThreads * kLaunchRegs,
                "the consumers take no more than the producer gave up");
};

// The producer's copy of rows [row0, row0 + ROWS) x columns [0, cols) of a row-major global
// tile into a swizzled shared tile, by its 128 threads (tid 0..127); rows >= nrows and columns
// >= cols land as zeros (load_tile's copies, for one warpgroup). Thread tid copies chunk
// c = tid % kChunks of rows r0 = tid / kChunks, r0 + R, r0 + 2R, ... (R = 128 / kChunks rows a
// round, a multiple of the swizzle's 8): its chunk's swizzled position repeats every R rows, so
// the shared address advances by R * 128 bytes and the source by R rows a copy. The producer
// shares its SM sub-partitions' issue slots with the consumers: load_tile's per-copy index
// arithmetic (a division, a swizzle, a 64-bit product: ~37 instructions a copy, 1,200 a key
// tile at d = 128, more than a consumer's whole softmax) cost the consumers their issue slots
// (ncu, session 16: issue slots 50% busy, 0.85 eligible warps a scheduler); here ~4 a copy.
template <typename Tile, int ROWS, bool EVEN, typename T>
__device__ __forceinline__ void producer_copy(unsigned sbase, const T* __restrict__ g, long long row_stride,
                                              int row0, int nrows, int cols, int tid) {
  constexpr int kChunks = Tile::kChunks;
  constexpr int kRows = 128 / kChunks;   // rows a round of the 128 threads
  static_assert(128 % kChunks == 0 && kRows % 8 == 0 && ROWS % kRows == 0,
                "a thread's chunk keeps its swizzled position from round to round");
  const int r0 = tid / kChunks, c = tid % kChunks;
  const unsigned s0 = Tile::addr(sbase, r0, c);
  const T* src = g + (row0 + r0) * row_stride + c * 8;
  const long long step = kRows * row_stride;
  const bool col_ok = EVEN || c * 8 < cols;
#pragma unroll
  for (int k = 0; k < ROWS / kRows; ++k) {
    const bool ok = EVEN || (col_ok && row0 + r0 + k * kRows < nrows);
    cp_async_16(s0 + k * kRows * 128, ok ? src : g, ok ? 16 : 0);
    src += step;
  }
}

// PERSIST (a persistent schedule, session 17): the grid holds fewer blocks than (batch item, Q
// tile) items (one an SM: cuflash/_fwd_schedule.fwd_sm90_grid) and block bid runs its items
// one after another: round qi of gridDim.x items, taken in block order (PERSIST 1) or, on odd
// rounds, in reverse (PERSIST 2: with the items heaviest first, a block that took a heavy one
// in one round takes a light one in the next, so causal blocks end together). The producer
// copies the next item's Q into the other Q buffer and its first K/V into the ring as soon as
// stages free up, the tile counter t running on across items, so the next item's first S
// waits for nothing and a block's prologue and epilogue overlap its neighbour items' loops
// (without it, blocks of few key tiles, causal's and the window's, paid them alone: one block
// an SM). A Q buffer is released (q_free) once its item's epilogue, which stages O over it,
// has been read back. Not for varlen builds (a block's work item is its sequence's).
// Measured (H200, session 17, bench/NOTES.md): the window 1.02-1.06x one block a tile, items of
// <= 8 key tiles 1.07-1.11x, but long causal items 0.90-0.97x: a static schedule leaves blocks
// of unequal items unequal, where one block a tile is handed out heaviest first to whichever SM
// frees up; the dispatcher uses it where it won (cuflash/_fwd_ws.py, persist_default).
// PERSIST 3 (session 17, written without a GPU: measure it first): each block's items from a
// list the host made once a plan (cuflash/_fwd_schedule.lpt_schedule: longest processing time
// first, from each item's key tiles), read through Params::varlen (no varlen build is
// persistent): int32 offsets of the gridDim.x + 1 lists, then the lists.
template <int PERSIST>
__device__ __forceinline__ unsigned ws_item(const Params& p, unsigned qi, unsigned bid, unsigned grid,
                                            unsigned n_items) {
  if constexpr (PERSIST == 3) {
    const int* list = reinterpret_cast<const int*>(p.varlen);
    const int at = __ldg(list + bid) + static_cast<int>(qi);
    return at < __ldg(list + bid + 1) ? static_cast<unsigned>(__ldg(list + grid + 1 + at)) : n_items;
  }
  return (PERSIST == 2 && (qi & 1u)) ? qi * grid + (grid - 1u - bid) : qi * grid + bid;
}

template <typename T, int HEAD_DIM, int BLOCK_N, int CONSUMERS, int STAGES, int PINGPONG, int POLY,
          typename Var, bool EVEN, int PERSIST = 0>
__global__ void __launch_bounds__(128 * (CONSUMERS + 1), 1)
fwd_sm90ws(const Params CUFLASH_VARLEN_PARAM(p)) {
  CUFLASH_VARLEN_VIEW(T, p)   // varlen builds: this block's sequence (common.cuh)
  constexpr bool kLoop = persistent_loop<PERSIST>();   // (never in varlen builds)
  using Tr = WsTraits<T, HEAD_DIM, BLOCK_N, CONSUMERS, STAGES, PERSIST>;
  using QTile = typename Tr::QTile;
  using KVTile = typename Tr::KVTile;
  constexpr int kBlockM = Tr::kBlockM;
  const float kNegInf = -__int_as_float(0x7f800000);
  static_assert(!Var::kBlockMask, "block masks run on fwd_sm90 (their list walk is not here)");

  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const unsigned raw = smem_u32(smem_raw);
  const unsigned sQ0 = (raw + 1023u) & ~1023u;
  const unsigned sKV = sQ0 + QTile::kBytes;   // stage s: K at sKV + s * kStageBytes, V after it
  // PERSIST: the other Q buffer after the stages, the barriers after it
  const unsigned sQ1 = sKV + STAGES * Tr::kStageBytes;
  const unsigned bars = sQ1 + (PERSIST ? QTile::kBytes : 0);
  auto q_buf = [&](unsigned qi) { return kLoop && (qi & 1u) ? sQ1 : sQ0; };
  auto bar_q = [&](unsigned qi) { return kLoop && (qi & 1u) ? bars + 8u * (1 + 4 * STAGES) : bars; };
  auto bar_qfree = [&](unsigned qi) { return bars + 8u * (2 + 4 * STAGES + (qi & 1u)); };
  auto bar_k = [&](int s) { return bars + 8u * (1 + s); };
  auto bar_v = [&](int s) { return bars + 8u * (1 + STAGES + s); };
  auto bar_kfree = [&](int s) { return bars + 8u * (1 + 2 * STAGES + s); };
  auto bar_vfree = [&](int s) { return bars + 8u * (1 + 3 * STAGES + s); };

  const int wg = threadIdx.x / 128;   // 0: the producer; 1..CONSUMERS: consumer wg - 1
  if (threadIdx.x == 0) {
    mbar_init(bar_q(0), 128);   // one arrival a producer thread, made by its copies
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(bar_k(s), 128);
      mbar_init(bar_v(s), 128);
      mbar_init(bar_kfree(s), 128 * CONSUMERS);   // every consumer thread releases K_j ...
      mbar_init(bar_vfree(s), 128 * CONSUMERS);   // ... and V_j
    }
    if constexpr (kLoop) {
      mbar_init(bar_q(1), 128);
      mbar_init(bar_qfree(0), 128 * CONSUMERS);   // ... and, PERSIST, its item's Q buffer
      mbar_init(bar_qfree(1), 128 * CONSUMERS);
    }
  }
  __syncthreads();   // (the barriers initialised before anyone waits on or arrives at them)

  // The block's work item: (batch item, Q tile) and its key tiles [j0, n_blocks), those holding
  // keys one of its rows can see (all, or under the causal mask up to its last row's diagonal,
  // under a window from its first row's far edge). n_blocks <= j0 (every row masked): O = 0
  // and lse = -inf.
  struct Work { int b, m0, j0, n_blocks; BatchOffsets off; BatchPtrs<T> gmem; };
  auto work_at = [&](unsigned it) {
    Work w;
    const BlockTile tile = block_tile(p, it);
    w.b = tile.b;
    w.m0 = tile.m_block * kBlockM;
    w.off = batch_offsets(p, w.b);
    w.gmem = batch_ptrs<T>(p, w.off);
    const int n_end = Var::key_end(p.var, p.mod, w.m0 + kBlockM, p.Lk);
    w.n_blocks = n_end > 0 ? (n_end + BLOCK_N - 1) / BLOCK_N : 0;
    w.j0 = Var::kKeyLo ? Var::key_begin(p.var, p.mod, w.m0) / BLOCK_N : 0;
    return w;
  };
  // The block's qi-th item (blockIdx.x without PERSIST); >= n_items: none left. Each role
  // computes its item's Work after setmaxnreg, from qi alone: only qi and the tile counter stay
  // live from item to item (a Work carried across the loop made the d = 64 builds spill).
  // (Without PERSIST the one item's Work is computed once, before the roles split.)
  const unsigned n_items = unsigned(p.nbatch) * unsigned(p.num_m_blocks);
  auto item_of = [&](unsigned qi) {
    return kLoop ? ws_item<PERSIST>(p, qi, blockIdx.x, gridDim.x, n_items) : blockIdx.x;
  };
  const Work w0 = work_at(blockIdx.x);

  if (wg == 0) {
    // ---- producer: per item Q_i, then K_j, V_j for j = j0 .. n_blocks - 1, tile t (counted
    //      over the block's items) into stage t % STAGES
    regs_dec<Tr::kProducerRegs>();
    const int tid = threadIdx.x;
    int t = 0;
    for (unsigned qi = 0; !kLoop || item_of(qi) < n_items; ++qi) {
      WS_STAMP(qi, 0);
      const Work w = kLoop ? work_at(item_of(qi)) : w0;
      // (PERSIST: the buffer's previous item, qi - 2, stored its O from it)
      if (kLoop && qi >= 2) mbar_wait(bar_qfree(qi), ((qi >> 1) - 1) & 1);
      WS_STAMP(qi, 1);
      producer_copy<QTile, kBlockM, false>(q_buf(qi), w.gmem.q, p.q_row_stride, w.m0, p.Lq, p.d, tid);
      mbar_arrive_on_copies(bar_q(qi));
      for (int j = w.j0; j < w.n_blocks; ++j, ++t) {
        const int s = t % STAGES;
        // the stage's previous K (V), tile t - STAGES's, released by every consumer
        const unsigned sK = sKV + s * Tr::kStageBytes;
        if (t >= STAGES) mbar_wait(bar_kfree(s), ((t / STAGES) - 1) & 1);
        if (j == w.j0) WS_STAMP(qi, 2);
        producer_copy<KVTile, BLOCK_N, EVEN>(sK, w.gmem.k, p.k_row_stride, j * BLOCK_N, p.Lk, p.d, tid);
        mbar_arrive_on_copies(bar_k(s));
        if (t >= STAGES) mbar_wait(bar_vfree(s), ((t / STAGES) - 1) & 1);
        producer_copy<KVTile, BLOCK_N, EVEN>(sK + KVTile::kBytes, w.gmem.v, p.v_row_stride, j * BLOCK_N, p.Lk, p.dv, tid);
        mbar_arrive_on_copies(bar_v(s));
      }
      WS_STAMP(qi, 3);
      if constexpr (!kLoop) break;
    }
    cp_async_wait<0>();   // (nothing left in flight when the warpgroup exits)
    return;
  }

  // ---- consumers (the declarations inside the item loop in session 16's order: without
  //      PERSIST it runs once, and that build's machine code stays as it was measured)
  regs_inc<Tr::kConsumerRegs>();
  int t = 0;   // the key tile's number over the block's items (its stage: t % STAGES)
  for (unsigned qi = 0; !kLoop || item_of(qi) < n_items; ++qi) {
  WS_STAMP(qi, 0);
  const Work w = kLoop ? work_at(item_of(qi)) : w0;
  const unsigned sQ = q_buf(qi);
  const int b = w.b, m0 = w.m0, j0 = w.j0, n_blocks = w.n_blocks;
  const int cw = wg - 1;                              // rows 64 cw .. 64 cw + 63 of the block
  const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  const int wg_row_first = m0 + 64 * cw;
  const int row0 = wg_row_first + 16 * warp + lane / 4;   // this thread's rows: row0, row0 + 8
  const int col_in_tile = 2 * (lane % 4);
  // this warpgroup's own tiles: [j_first_wg, n_wg) (it waits for and releases all the block's)
  const int n_end_wg = Var::key_end(p.var, p.mod, wg_row_first + 64, p.Lk);
  const int n_wg = n_end_wg > 0 ? (n_end_wg + BLOCK_N - 1) / BLOCK_N : 0;
  const int j_first_wg = Var::kKeyLo ? Var::key_begin(p.var, p.mod, wg_row_first) / BLOCK_N : 0;

  const float sl2 = Var::kCapUnits ? p.mod.softcap * 1.4426950408889634f
                    : (Var::kNatural && !Var::kAlibiRawUnits) ? 1.4426950408889634f : static_cast<float>(p.var.scale_log2);
  const auto item = Var::template item<float>(p, b);
  const float mo = Var::kFixedOffset ? softcap_offset(sl2, p.Lk) : 0.f;
  // The softcap's tanh.approx makes the special-function unit the bottleneck (two operations a
  // score): the 8-column tiles of S whose exponentials run on the FMA pipe instead (ex2_poly):
  // the Variant's share (variant.cuh kPolyShare, tuned on fwd_sm90) or, POLY > 0, POLY of them
  // where the Variant's build may take a share at all (kPolyCapable: the tile table's value,
  // or an A/B knob: CUFLASH_TILES' last value).
  constexpr int kVarPoly = Var::template kPolyShare<Tr::kNTilesS, HEAD_DIM>;
  constexpr int kPoly = (Var::kPolyCapable && POLY > 0) ? (POLY < Tr::kNTilesS ? POLY : Tr::kNTilesS) : kVarPoly;

  const unsigned long long desc_q = make_desc(sQ + cw * 64 * 128, 16, 1024);
  const unsigned long long desc_k = make_desc(sKV, 16, 1024);
  const unsigned long long desc_v = make_desc(sKV + KVTile::kBytes, KVTile::kBlockBytes, 1024);
  auto stage_of = [](int s) { return static_cast<unsigned long long>((s * Tr::kStageBytes) >> 4); };

  float o[Tr::kNTilesO][4];
#pragma unroll
  for (int t = 0; t < Tr::kNTilesO; ++t) o[t][0] = o[t][1] = o[t][2] = o[t][3] = 0.f;
  float m_i[2] = {kNegInf, kNegInf}, l_i[2] = {0.f, 0.f};
  sink_row_start<Var>(m_i, l_i, item, lane);
  float s[Tr::kNTilesS][4];

  // -- the key loop, FlashAttention-3's intra-warpgroup overlap: step t issues S_t = Q K_t^T and
  //    then O += P_{t-1} V_{t-1} (P of the step before, still in registers), waits for S_t
  //    only, and runs S_t's softmax while the tensor cores finish P_{t-1} V_{t-1}; O is
  //    rescaled by S_t's alpha once that product has landed. K_t is released as soon as S_t
  //    is computed, V_{t-1} once its product is. This warpgroup computes the tiles [ja, jb)
  //    of the block's [j0, n_blocks) (a contiguous range: causal and the window clip its
  //    ends); for the others it only waits for the copies and releases the stage.
  // PINGPONG: the consumers take turns to issue their products (FlashAttention-3's ping-pong:
  // consumer c waits on named barrier kPingBar + c for its turn, issues S_t and P_{t-1} V_{t-1},
  // then hands the turn to consumer c + 1), so that one's softmax runs while the other's
  // products hold the tensor cores, instead of all of them waiting for the same tile at once.
  // Every consumer then walks the block's whole [j0, n_blocks) (the turns must pair up): a tile
  // its rows do not see is computed and masked (exp2(-inf) = 0 leaves l and O as they were).
  // (PERSIST: every consumer takes n_blocks - j0 + 1 turns an item: they pair up across items)
  constexpr int kPingBar = 1 + CONSUMERS;   // (ids 1..CONSUMERS are the epilogues')
  const int ja = PINGPONG ? j0 : (Var::kKeyLo ? max(j0, j_first_wg) : j0);
  const int jb = PINGPONG ? n_blocks : min(n_blocks, n_wg);
  auto my_turn = [&]() { if constexpr (PINGPONG != 0) named_barrier(kPingBar + cw, 256); };
  auto next_turn = [&]() {
    if constexpr (PINGPONG != 0) named_barrier_arrive(kPingBar + (cw + 1) % CONSUMERS, 256);
  };
  if (qi == 0 && cw == CONSUMERS - 1) next_turn();   // consumer 0 goes first
  unsigned pa[Tr::kPVSteps][4];
  auto skip = [&](int t) {   // a tile outside [ja, jb): its copies landed, the stage released
    mbar_wait(bar_k(t % STAGES), (t / STAGES) & 1);
    mbar_arrive(bar_kfree(t % STAGES));
    mbar_wait(bar_v(t % STAGES), (t / STAGES) & 1);
    mbar_arrive(bar_vfree(t % STAGES));
  };
  // (the loop's body is uniform, its first tile peeled: ptxas keeps wgmma's asynchronous
  // only where every path through the loop has the same groups in flight; with the first tile
  // inside behind a branch it put a wait after every wgmma, 24 a tile at d = 128)
  auto issue_s = [&](int t) {   // S_t = Q_i K_t^T (committed; the caller waits)
    const int st = t % STAGES;
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < Tr::kKSteps; ++ks) {
      const unsigned long long kq = ((ks / 4) * QTile::kBlockBytes + (ks % 4) * 32) >> 4;
      const unsigned long long kk = ((ks / 4) * KVTile::kBlockBytes + (ks % 4) * 32) >> 4;
      Wgmma<T, BLOCK_N>::ss(s, desc_q + kq, desc_k + stage_of(st) + kk, ks > 0);
    }
    wgmma_commit();
  };
  auto issue_pv = [&](int t) {   // O += P_t V_t (committed; the caller waits)
    const int st = t % STAGES;
#pragma unroll
    for (int kk = 0; kk < Tr::kPVSteps; ++kk)
      Wgmma<T, HEAD_DIM>::rs_t(o, pa[kk], desc_v + stage_of(st) + ((kk * 16 * 128) >> 4), 1);
    wgmma_commit();
  };
  // -- the Variant's score pipeline and masks (fwd_sm90's non-lean path, repeated rather than
  //    shared: moving it into one function changed the machine code of 24 fwd_sm90 builds,
  //    plain attention's among them, session 16, tools/sass_identity.py), then the online
  //    softmax of S (key tile j) up to, not including, O's rescale by alpha
  auto softmax = [&](int j, float (&alpha)[2]) {
    const int n0 = j * BLOCK_N;
    Var::transform_tile(p.var, s);
    const int warp_row_first = wg_row_first + 16 * warp;
    const bool need_mask = (!EVEN && n0 + BLOCK_N > p.Lk) ||
                           Var::needs_mask(p.var, p.mod, warp_row_first, warp_row_first + 16, n0, n0 + BLOCK_N);
    float row_off[2];   // ALiBi's row term (Var::kAlibiRowOffset: the other builds' call is as before)
    if constexpr (Var::kAlibiRowOffset)
      modify_score_tile<Var, true>(s, p.var, p.mod, item, row0, n0 + col_in_tile, p.Lq, p.Lk, need_mask,
                                   row_off);
    else if constexpr (Var::kNatural || Var::kPairMask)
      modify_score_tile<Var>(s, p.var, p.mod, item, row0, n0 + col_in_tile, p.Lq, p.Lk, need_mask);
    if (need_mask) {
      int first[2], last[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        last[r] = Var::key_last(p.var, p.mod, row0 + 8 * r, p.Lk) - (n0 + col_in_tile);
        first[r] = Var::key_first(p.var, p.mod, row0 + 8 * r) - (n0 + col_in_tile);
      }
      mask_scores<Var::kKeyLo>(s, first, last);
    }
    if constexpr (Var::kFixedOffset)
      fixed_offset_softmax_scores<Tr::kNTilesS, kPoly>(s, l_i, sl2, mo);
    else if constexpr (Var::kAlibiRowOffset)
      online_softmax_scores<Tr::kNTilesS, kPoly, true>(s, m_i, l_i, alpha, sl2, row_off);
    else
      online_softmax_scores<Tr::kNTilesS, kPoly>(s, m_i, l_i, alpha, sl2);
  };
  auto to_p = [&](const float (&alpha)[2]) {   // O rescaled (its product landed), P in pa
    if constexpr (!Var::kFixedOffset) rescale_rows(o, alpha);
#pragma unroll
    for (int kk = 0; kk < Tr::kPVSteps; ++kk) p_fragment<T>(pa[kk], s, kk);
  };

  WS_STAMP(qi, 1);
  mbar_wait(bar_q(qi), (qi >> 1) & 1);   // (also before the epilogue writes O over Q, when there is no key tile)
  WS_STAMP(qi, 2);
  for (int j = j0; j < min(ja, n_blocks); ++j, ++t) skip(t);
  if (ja < jb) {
    {   // the first tile: S_t alone
      float alpha[2];
      mbar_wait(bar_k(t % STAGES), (t / STAGES) & 1);
      WS_STAMP(qi, 3);
      fence_proxy_async();   // the copies' generic-proxy writes -> the tensor cores' reads
      my_turn();
      WS_STAMP(qi, 4);
      issue_s(t);
      next_turn();
      wgmma_wait<0>();
      WS_STAMP(qi, 5);
      fence_regs(s);
      mbar_arrive(bar_kfree(t % STAGES));
      softmax(ja, alpha);
      to_p(alpha);
      WS_STAMP(qi, 6);
      ++t;
    }
    for (int j = ja + 1; j < jb; ++j, ++t) {
      const int st = t % STAGES, sp = (t - 1) % STAGES;
      float alpha[2];
      mbar_wait(bar_k(st), (t / STAGES) & 1);
      mbar_wait(bar_v(sp), ((t - 1) / STAGES) & 1);
      fence_proxy_async();
      my_turn();
      issue_s(t);            // S_t, then P_{t-1} V_{t-1} behind it
      fence_regs(o);
      wgmma_fence();
      issue_pv(t - 1);
      next_turn();
      wgmma_wait<1>();       // S_t (the older group) done; P_{t-1} V_{t-1} may still run
      fence_regs(s);
      mbar_arrive(bar_kfree(st));
      softmax(j, alpha);
      wgmma_wait<0>();       // P_{t-1} V_{t-1} landed: pa and o are free
      fence_regs(o);
      mbar_arrive(bar_vfree(sp));
      to_p(alpha);
    }
    // the last tile's P V
    WS_STAMP(qi, 7);
    mbar_wait(bar_v((t - 1) % STAGES), ((t - 1) / STAGES) & 1);
    fence_proxy_async();
    fence_regs(o);
    my_turn();
    WS_STAMP(qi, 8);
    wgmma_fence();
    issue_pv(t - 1);
    next_turn();
    wgmma_wait<0>();
    fence_regs(o);
    mbar_arrive(bar_vfree((t - 1) % STAGES));
    WS_STAMP(qi, 9);
  }
  for (int j = max(jb, ja); j < n_blocks; ++j, ++t) skip(t);

  // -- epilogue: l_i over the quad, O_i = diag(l_i)^-1 O_i, L_i = m_i + log(l_i); O staged
  //    through this warpgroup's own rows of Q's tile (no other warpgroup reads them; its own
  //    last wgmma has finished) so that the global stores are whole 16-byte chunks
  float inv_l[2];
  if constexpr (Var::kFixedOffset) m_i[0] = m_i[1] = mo;
  finish_rows(inv_l, l_i, m_i, Var::kFixedOffset ? 1.f : sl2, row0, p.Lq, reinterpret_cast<float*>(p.lse) + static_cast<long long>(b) * p.Lq);
#pragma unroll
  for (int t = 0; t < Tr::kNTilesO; ++t) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int srow = 64 * cw + 16 * warp + lane / 4 + 8 * r;
      const int col = t * 8 + col_in_tile;
      const unsigned addr = QTile::addr(sQ, srow, col / 8) + 2u * (col % 8);
      const unsigned val = pack2<T>(o[t][2 * r] * inv_l[r], o[t][2 * r + 1] * inv_l[r]);
      asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(val));
    }
  }
  named_barrier(1 + cw, 128);   // this warpgroup's rows staged
  WS_STAMP(qi, 10);
  T* out = w.gmem.o;
  const bool vec = p.o_col_stride == 1 && p.o_row_stride % 8 == 0 && w.off.o % 8 == 0 &&
                   p.o % 16 == 0 && p.dv % 8 == 0;
  const unsigned char* stile = smem_raw + (sQ - raw);
  constexpr int kChunks = QTile::kChunks;
  for (int idx = threadIdx.x % 128; idx < 64 * kChunks; idx += 128) {
    const int r = 64 * cw + idx / kChunks, c = idx % kChunks;
    const int gi = m0 + r;
    if (gi >= p.Lq || c * 8 >= p.dv) continue;
    const unsigned char* src = stile + 16 * QTile::chunk_offset(r, c);
    if (vec) {
      *reinterpret_cast<uint4*>(out + gi * p.o_row_stride + c * 8) = *reinterpret_cast<const uint4*>(src);
    } else {
      const T* e = reinterpret_cast<const T*>(src);
      for (int u = 0; u < 8 && c * 8 + u < p.dv; ++u) out[gi * p.o_row_stride + (c * 8 + u) * p.o_col_stride] = e[u];
    }
  }
  WS_STAMP(qi, 11);
  if constexpr (!kLoop) break;
  // PERSIST: the staged rows are read back (in registers, stored): the buffer is free for the
  // item after the next one
  mbar_arrive(bar_qfree(qi));
  }
}

}  // namespace sm90
}  // namespace cuflash
