// cuflash: tensor-core forward for float16 / bfloat16 on Hopper (sm_90a): wgmma.
//
// The algorithm is fwd_sm80's (FlashAttention-2, Algorithm 1, one block per (batch item,
// BLOCK_M query rows), the same online softmax from online_softmax.cuh); what changes is who
// does the matrix products. A warpgroup (4 warps, 128 threads) owns 64 query rows and issues
//   S_ij  = Q_i K_j^T  as HEAD_DIM/16 wgmma m64n{BLOCK_N}k16, A = Q and B = K from shared memory;
//   O_i  += P_ij V_j   as BLOCK_N/16  wgmma m64n{HEAD_DIM}k16, A = P from registers (the S
//                      accumulators, rescaled and rounded to T) and B = V from shared memory
//                      read transposed.
// No ldmatrix: the tensor cores read K and V straight from shared memory, which is what bounds
// fwd_sm80 (one 512-byte ldmatrix.x4 per two mma.sync's). While one warpgroup is in its
// softmax, the other warpgroups of the SM keep the tensor cores busy with their own wgmma's.
//
// Shared memory: Q_i, and K_j, V_j double-buffered (cp.async, like fwd_sm80), each in
// Sm90Tile's layout, which is wgmma's 128-byte swizzle. One barrier per key tile.
//
// Requirements the launcher (cuflash/_plan.py) guarantees: as fwd_sm80 (rows contiguous and
// 16-byte aligned, d and dv multiples of 8, at most HEAD_DIM), and HEAD_DIM % 64 == 0.
#include "common.cuh"
#include "mma_sm80.cuh"
#include "online_softmax.cuh"
#include "sm90_ops.cuh"
#include "wgmma_sm90.cuh"

namespace cuflash {
namespace sm90 {

// Tile constants of one specialisation; the per-head-dim choice with its reasons is the table
// FWD_SM90 in cuflash/_traits.py.
template <typename T, int HEAD_DIM, int BLOCK_N, int WARPGROUPS, int MIN_BLOCKS, int PERSIST = 0,
          int LEAN = 0>   // (LEAN: the kernel's, below; no tile size depends on it)
struct Sm90Traits {
  static constexpr int kThreads = 128 * WARPGROUPS;
  static constexpr int kBlockM = 64 * WARPGROUPS;   // 64 rows a warpgroup (the wgmma M)
  static constexpr int kKSteps = HEAD_DIM / 16;     // wgmma's of S = Q K^T
  static constexpr int kPVSteps = BLOCK_N / 16;     // wgmma's of O += P V
  static constexpr int kNTilesS = BLOCK_N / 8;      // 8-column tiles of S in a thread
  static constexpr int kNTilesO = HEAD_DIM / 8;     // 8-column tiles of O in a thread
  using QTile = Sm90Tile<kBlockM, HEAD_DIM>;
  using KVTile = Sm90Tile<BLOCK_N, HEAD_DIM>;
  // O is staged for the epilogue in fwd_sm80's row-major swizzled layout, over Q's space
  using OTile = SwizzledTile<kBlockM, HEAD_DIM>;
  // K/V buffers: compute on one while the next loads. (A third stage for FlashAttention-3's
  // intra-warpgroup pipeline measured slower with this barrier-per-tile loop: bench/NOTES.md.)
  static constexpr int kStages = 2;
  static constexpr int kStageBytes = 2 * KVTile::kBytes;   // K_j then V_j
  // PERSIST (a block runs query tiles one after another, fwd_sm90 below): a second Q buffer,
  // after the K/V stages, into which the next tile's Q lands while this one's O is staged
  static constexpr int kQBuffers = PERSIST ? 2 : 1;
  // + 1024: the dynamic shared memory base is aligned up to the 1024-byte swizzle atom
  static constexpr int kSmemBytes = kQBuffers * QTile::kBytes + kStages * kStageBytes + 1024;

  static_assert(sizeof(T) == 2, "wgmma here takes float16 / bfloat16");
  static_assert(HEAD_DIM % 64 == 0 && HEAD_DIM <= 256, "head dims in whole 128-byte column blocks");
  static_assert(BLOCK_N % 16 == 0 && BLOCK_N <= 256, "wgmma N and the k16 steps of P V");
  static_assert(WARPGROUPS >= 1 && WARPGROUPS <= 3, "at most 192 rows a block");
  static_assert(QTile::kBytes % 1024 == 0 && KVTile::kBytes % 1024 == 0, "atoms stay 1024-aligned");
  static_assert(kSmemBytes <= 227 * 1024, "H100/H200 shared memory per block");
  static_assert(OTile::kBytes <= QTile::kBytes, "O is staged in Q's space");
};

// PERSIST (the analytic window's schedule, session 10): the grid holds fewer blocks than query
// tiles (cuflash/_families.fwd_sm90_grid), and block bid runs the (batch item, Q tile) items
// bid, bid + gridDim.x, ... one after another. During the last key tile of one item the next
// item's Q_i (into the other Q buffer) and its first K_j, V_j (into the stage the last tile
// does not use) are loaded, so the next item's first S waits for nothing, and its epilogue (O
// staged over its own Q buffer, stored) runs while those copies land. Without it a window
// block's Q, K_0, V_0 latency and its epilogue stood between equal-length blocks that start
// and end together on an SM (bench/NOTES.md, "the window at short lists (session 10)").
// With a block mask they are issued once the last tile is (in the last tile, with the list
// walk's registers live, the causal builds spilled 16-40 bytes at d = 128), after the next
// item's first list entry is read; the dispatcher uses it where a block has the registers
// (min_blocks 1: at d = 64's 128-register cap of 2 blocks an SM, the outer loop alone made the
// suite's causal builds spill 16-64 bytes). Not for varlen builds (a block's work item is its
// sequence's): they compile as PERSIST = 0.
// LEAN (short query tiles' fixed costs, session 11; CUFLASH_FWD90_LEAN): a window block sees
// ~17 key tiles, not ~64 as causal attention's at 16k, and a block mask's short lists (packed
// documents at 4k) 1-8, so what a block or a tile pays besides the products is a larger share
// of it (bench/NOTES.md, "the window's instructions per visible pair (session 11)"). Any
// Variant the dispatcher gives it (the window, block masks; never plain attention): the batch
// item's offsets without dividing by batch dims of extent 1 (batch_offsets_short) and O's
// copies to HBM with addresses advanced by constants (store_o_rows). Under a
// window without a block mask or pair mask (kLean below) also: the K/V source pointers
// advanced a tile at a time instead of recomputed from the tile index, which key tiles need
// which bound's mask decided once a warp (two tile indices) instead of a tile, and each masked
// tile tests the one bound that crosses it (the far edge: first; the diagonal: last), not both.
// A block mask's lean build (session 12) also reads the list entry two visits ahead at the top
// of a key tile, right after its barrier, where session 11's read it after S's wgmma's were
// issued: there ptxas scheduled the load inside the softmax and, around it, ran the
// exponentials back to back with O's rescale and P's conversion after them (52 instructions
// between the last MUFU and P V's first wgmma, 9 in plain causal's build); read at the top, the
// softmax compiles to the analytic builds' interleaved schedule and the load has the whole tile
// to land (bench/NOTES.md, "the block-mask forward's list read (session 12)"). LEAN = 3 (bit 1,
// CUFLASH_FWD90_BMASK_EARLY=0) keeps session 11's read: the A/B's old arm.
template <typename T, int HEAD_DIM, int BLOCK_N, int WARPGROUPS, int MIN_BLOCKS, typename Var, bool EVEN,
          int PERSIST = 0, int LEAN = 0>
__global__ void __launch_bounds__(128 * WARPGROUPS, MIN_BLOCKS)
fwd_sm90(const Params CUFLASH_VARLEN_PARAM(p)) {
  CUFLASH_VARLEN_VIEW(T, p)   // varlen builds: this block's sequence (common.cuh; helper "inference")
  constexpr bool kLoop = persistent_loop<PERSIST>();   // (never in varlen builds)
  using Tr = Sm90Traits<T, HEAD_DIM, BLOCK_N, WARPGROUPS, MIN_BLOCKS, PERSIST>;
  using QTile = typename Tr::QTile;
  using KVTile = typename Tr::KVTile;
  constexpr int kBlockM = Tr::kBlockM, kThreads = Tr::kThreads;
  const float kNegInf = -__int_as_float(0x7f800000);

  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const unsigned raw = smem_u32(smem_raw);
  const unsigned sQ0 = (raw + 1023u) & ~1023u;
  const unsigned sKV = sQ0 + QTile::kBytes;   // stage s: K at sKV + s * kStageBytes, V after it
  [[maybe_unused]] const unsigned sQ1 = sKV + Tr::kStages * Tr::kStageBytes;   // PERSIST's other Q

  const int wg = threadIdx.x / 128;                 // warpgroup: rows 64 wg .. 64 wg + 63
  const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  // PERSIST: the item this block runs (bid), which Q buffer holds its Q (qbuf), whether its Q
  // and first K/V were loaded during the previous item (prefetched), and the K/V stage offset
  // that makes its first key tile's stage the one the previous item's last tile left free
  [[maybe_unused]] unsigned bid = blockIdx.x;
  [[maybe_unused]] const unsigned n_items = kLoop ? unsigned(p.nbatch) * unsigned(p.num_m_blocks) : 0u;
  [[maybe_unused]] bool qbuf = false, prefetched = false;
  [[maybe_unused]] int free_stage = 0;
  for (;;) {
  const unsigned sQ = kLoop && qbuf ? sQ1 : sQ0;
  unsigned char* smem = smem_raw + (sQ - raw);
  const BlockTile tile = block_tile(p, bid);
  const int b = tile.b;
  const int m0 = tile.m_block * kBlockM;
  constexpr bool kLean = (LEAN & 1) != 0 && Var::kKeyLo && !Var::kBlockMask && !Var::kPairMask;
  constexpr bool kListTop = LEAN == 1 && Var::kBlockMask;   // (the list read early: above)
  const BatchOffsets off = (LEAN & 1) != 0 ? batch_offsets_short(p, b) : batch_offsets(p, b);
  const BatchPtrs<T> gmem = batch_ptrs<T>(p, off);
  // softmax scale * log2(e); log2(e) where the Variant's modifiers give natural-unit scores
  // (c log2(e) where the scores are in units of the softcap c: Var::kCapUnits; tau log2(e)
  // where ALiBi alone leaves them raw: Var::kAlibiRawUnits)
  const float sl2 = Var::kCapUnits ? p.mod.softcap * 1.4426950408889634f
                    : (Var::kNatural && !Var::kAlibiRawUnits) ? 1.4426950408889634f : static_cast<float>(p.var.scale_log2);
  // the modifiers' state of this batch item (slopes, sink, bias / mask rows); empty if unused
  const auto item = Var::template item<float>(p, b);
  // the softcap alone: the softmax's fixed offset (online_softmax.cuh softcap_offset), base 2
  const float mo = Var::kFixedOffset ? softcap_offset(sl2, p.Lk) : 0.f;

  // Key tiles [0, n_blocks) of the block: those holding keys its rows can see (Variant: all,
  // or under the causal mask those up to its last row's diagonal). n_blocks can be 0
  // (every row fully masked): O = 0 and lse = -inf. A warpgroup's own rows end earlier: it
  // computes on tiles before n_wg only (a tile past what its rows can see changes nothing for
  // them), and takes part in the loads and barriers of all the block's tiles.
  const int wg_row_first = m0 + 64 * wg;
  const int n_end = Var::key_end(p.var, p.mod, m0 + kBlockM, p.Lk);
  const int n_end_wg = Var::key_end(p.var, p.mod, wg_row_first + 64, p.Lk);
  // Under a window the block starts at the first key tile its first row sees (0 otherwise),
  // and a warpgroup computes from its own first row's on.
  const int j_first = Var::kKeyLo ? Var::key_begin(p.var, p.mod, m0) / BLOCK_N : 0;
  const int j_first_wg = Var::kKeyLo ? Var::key_begin(p.var, p.mod, wg_row_first) / BLOCK_N : 0;
  const int n_blocks = n_end > 0 ? (n_end + BLOCK_N - 1) / BLOCK_N : 0;
  const int n_wg = n_end_wg > 0 ? (n_end_wg + BLOCK_N - 1) / BLOCK_N : 0;
  // PERSIST: key tile j (a block mask: visit v) is in stage (j + slot_off) % kStages ((v +
  // slot_off) % kStages; without it j or v, as before), slot_off chosen so that the first
  // tile's stage is the one the previous item left free
  const int slot_off = kLoop ? ((free_stage - (Var::kBlockMask ? 0 : j_first)) & 1) : 0;
  // Within [j_first, n_blocks) a block mask visits only the key tiles of its list for this
  // row block (Mod::tile_list: those some row of the block may see; the others are never
  // loaded nor computed), each with the kind of every warpgroup's 64 rows. The loop visits the
  // list's first entry j0, then the next, and so on: after(j), the tile visited after j
  // (j_walk, from entry e_walk), is prefetched during j; the entry after that is
  // read during j as well (walk_ahead, once on every path through the body: after the S
  // wgmma is issued, so that its load runs while the tensor cores compute S; kListTop: at the
  // top of the tile, after its barrier), so every list load has a whole tile to land. `visit`
  // counts the visits and picks the K/V stage (slot % kStages), so the tile being loaded
  // never shares the stage being computed on. Without a
  // block mask the walk is j_first, j_first + 1, ... and the slot is j, spelled as they were
  // (through a lambda they changed the machine code).
  [[maybe_unused]] const int* list = nullptr;
  [[maybe_unused]] int list_n = 0;
  if constexpr (Var::kBlockMask) list = Var::Mod::template tile_list<true>(p.mod, item, tile.m_block, list_n);
  auto entry = [&](int v) { return Var::Mod::list_entry(list, v, n_blocks); };
  int e_cur = Var::kBlockMask ? entry(0) : 0;
  int e_walk = Var::kBlockMask ? entry(1) : 0;
  const int j0 = Var::kBlockMask ? Var::Mod::entry_tile(e_cur) : j_first;
  int j_walk = Var::kBlockMask ? Var::Mod::entry_tile(e_walk) : 0, visit = 0;
  // PERSIST: the next item of this block (bid + gridDim.x), its Q into the other Q buffer and
  // its first key tile into the stage after this item's last (n_blocks + slot_off)
  [[maybe_unused]] const unsigned next = bid + gridDim.x;
  // (a block mask: once this item's loop is done, where its list walk's registers are free:
  // the next item's first list entry, read here, decides which tile; the stage is visit's,
  // one past the last visit's)
  auto prefetch_next_now = [&]() {
    if constexpr (kLoop) {
      if (next < n_items) {
        const BlockTile nt = block_tile(p, next);
        const int nm0 = nt.m_block * kBlockM;
        const BatchPtrs<T> ng = batch_ptrs<T>(p, batch_offsets(p, nt.b));
        load_tile<QTile, kBlockM, kThreads, false>(qbuf ? sQ0 : sQ1, ng.q, p.q_row_stride, nm0, p.Lq, p.d);
        const int nend = Var::key_end(p.var, p.mod, nm0 + kBlockM, p.Lk);
        const int nblocks = nend > 0 ? (nend + BLOCK_N - 1) / BLOCK_N : 0;
        int nj0 = Var::kKeyLo ? Var::key_begin(p.var, p.mod, nm0) / BLOCK_N : 0;
        if constexpr (Var::kBlockMask) {
          int count;
          const auto nitem = Var::template item<float>(p, nt.b);
          nj0 = Var::Mod::entry_tile(Var::Mod::list_entry(
              Var::Mod::template tile_list<true>(p.mod, nitem, nt.m_block, count), 0, nblocks));
        }
        if (nblocks > nj0) {
          const unsigned sK = sKV + (((Var::kBlockMask ? visit : n_blocks) + slot_off) & 1) * Tr::kStageBytes;
          load_tile<KVTile, BLOCK_N, kThreads, EVEN>(sK, ng.k, p.k_row_stride, nj0 * BLOCK_N, p.Lk, p.d);
          load_tile<KVTile, BLOCK_N, kThreads, EVEN>(sK + KVTile::kBytes, ng.v, p.v_row_stride, nj0 * BLOCK_N, p.Lk, p.dv);
        }
      }
    }
  };

  auto prefetch_next = [&]() {   // at the top of the last key tile
    if constexpr (!Var::kBlockMask) prefetch_next_now();
  };
  auto walk_ahead = [&]() {   // (the current entry is dead by then: its register takes it)
    if constexpr (Var::kBlockMask && !kListTop) e_cur = entry(visit + 2);
  };
  auto after = [&](int j) { return Var::kBlockMask ? j_walk : j + 1; };
  auto advance = [&](int) {   // the tile just reached is j_walk; the entry after it, in e_cur
    if constexpr (Var::kBlockMask) {
      const int e_ahead = e_cur;
      e_cur = e_walk;
      e_walk = e_ahead;
      j_walk = Var::Mod::entry_tile(e_walk);
      ++visit;
    }
  };

  // kLean: the next K and V tile's first rows (the tiles load in order, j0, j0 + 1, ...: one
  // 64-bit add a tensor and tile, where j * BLOCK_N * stride cost ~7 instructions a copy;
  // PERSIST: j0 + 1 where the previous item loaded tile j0)
  [[maybe_unused]] const int kv_row0 = (j0 + (kLoop && prefetched ? 1 : 0)) * BLOCK_N;
  [[maybe_unused]] const T* kv_k = kLean ? gmem.k + static_cast<long long>(kv_row0) * p.k_row_stride : nullptr;
  [[maybe_unused]] const T* kv_v = kLean ? gmem.v + static_cast<long long>(kv_row0) * p.v_row_stride : nullptr;
  auto load_kv = [&](int j, int slot) {   // K_j and V_j into stage slot % Tr::kStages
    const unsigned sK = sKV + (slot % Tr::kStages) * Tr::kStageBytes;
    if constexpr (kLean) {
      load_tile<KVTile, BLOCK_N, kThreads, EVEN>(sK, kv_k, p.k_row_stride, 0, p.Lk - j * BLOCK_N, p.d);
      load_tile<KVTile, BLOCK_N, kThreads, EVEN>(sK + KVTile::kBytes, kv_v, p.v_row_stride, 0, p.Lk - j * BLOCK_N, p.dv);
      kv_k += BLOCK_N * p.k_row_stride;
      kv_v += BLOCK_N * p.v_row_stride;
    } else {
      load_tile<KVTile, BLOCK_N, kThreads, EVEN>(sK, gmem.k, p.k_row_stride, j * BLOCK_N, p.Lk, p.d);
      load_tile<KVTile, BLOCK_N, kThreads, EVEN>(sK + KVTile::kBytes, gmem.v, p.v_row_stride, j * BLOCK_N, p.Lk, p.dv);
    }
  };

  // Descriptors of stage 0 at k-step 0 (this warpgroup's 64 rows of Q); a k-step or a stage
  // adds a compile-time byte offset >> 4 to the start-address field.
  const unsigned long long desc_q = make_desc(sQ + wg * 64 * 128, 16, 1024);
  const unsigned long long desc_k = make_desc(sKV, 16, 1024);
  const unsigned long long desc_v = make_desc(sKV + KVTile::kBytes, KVTile::kBlockBytes, 1024);
  auto stage_of = [](int slot) { return static_cast<unsigned long long>(((slot % Tr::kStages) * Tr::kStageBytes) >> 4); };

  // -- S = Q_i K_j^T: issue (and commit) the wgmma's; the caller waits
  auto issue_s = [&](float (&s)[Tr::kNTilesS][4], int slot) {
#pragma unroll
    for (int ks = 0; ks < Tr::kKSteps; ++ks) {
      const unsigned long long kq = ((ks / 4) * QTile::kBlockBytes + (ks % 4) * 32) >> 4;
      const unsigned long long kk = ((ks / 4) * KVTile::kBlockBytes + (ks % 4) * 32) >> 4;
      Wgmma<T, BLOCK_N>::ss(s, desc_q + kq, desc_k + stage_of(slot) + kk, ks > 0);
    }
    wgmma_commit();
  };
  // -- O_i += P V_j, P (registers) as the A operand; the caller waits
  auto issue_pv = [&](float (&o)[Tr::kNTilesO][4], const unsigned (&pa)[Tr::kPVSteps][4], int slot) {
#pragma unroll
    for (int kk = 0; kk < Tr::kPVSteps; ++kk)
      Wgmma<T, HEAD_DIM>::rs_t(o, pa[kk], desc_v + stage_of(slot) + ((kk * 16 * 128) >> 4), 1);
    wgmma_commit();
  };

  const int row0 = wg_row_first + 16 * warp + lane / 4;   // this thread's rows: row0, row0 + 8
  const int col_in_tile = 2 * (lane % 4);
  // kLean: the key tiles where this warp's 16 rows need a bound's mask, decided once: from
  // j_hi_w on, the tile's last key is past its first row's last visible key (the diagonal,
  // the end of the keys); before j_lo_w, its first key is before its last row's first visible
  // key (the window's far edge). The same tiles as needs_bound_mask's test (and, !EVEN, the
  // tile crossing Lk: key_last is clipped to Lk - 1).
  [[maybe_unused]] int j_hi_w = 0, j_lo_w = 0;
  if constexpr (kLean) {
    const int warp_row_first = wg_row_first + 16 * warp, warp_row_last = warp_row_first + 15;
    j_hi_w = max(Var::key_last(p.var, p.mod, warp_row_first, p.Lk) + 1, 0) / BLOCK_N;
    const int kf = Var::key_first(p.var, p.mod, warp_row_last);
    j_lo_w = kf > 0 ? (kf + BLOCK_N - 1) / BLOCK_N : 0;
  }
  // -- the Variant's score transform (identity today); mask S_ij (keys past Lk, and the pairs
  //    the Variant masks, causal: keys j > i + causal_offset; only tiles that cross the end of
  //    the keys or this warp's mask boundary pay for it), then the online softmax up to, not
  //    including, the rescale of O
  auto softmax = [&](float (&s)[Tr::kNTilesS][4], int j, float (&m_i)[2], float (&l_i)[2], float (&alpha)[2], bool pair_tile) {
    const int n0 = j * BLOCK_N;
    Var::transform_tile(p.var, s);
    if constexpr (kLean) {   // (no pair mask: the modifiers' transforms only)
      if constexpr (Var::kNatural)
        modify_score_tile<Var>(s, p.var, p.mod, item, row0, n0 + col_in_tile, p.Lq, p.Lk, false);
      if (j >= j_hi_w) {   // the diagonal (or the end of the keys): keys past last[r]
        int last[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) last[r] = Var::key_last(p.var, p.mod, row0 + 8 * r, p.Lk) - (n0 + col_in_tile);
        mask_scores<false>(s, last, last);
      }
      if (j < j_lo_w) {    // the window's far edge: keys before first[r]
        int first[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) first[r] = Var::key_first(p.var, p.mod, row0 + 8 * r) - (n0 + col_in_tile);
        mask_scores_before(s, first);
      }
    } else {
      const int warp_row_first = wg_row_first + 16 * warp;
      // (a block mask: the bounds' mask where they cross the tile, the pair masks where its kind
      // is not full; in the predicated build every tile masks, as before: the branch on the
      // bounds spilled 16 bytes at the 168-register cap of 3 warpgroups with causal)
      const bool need_mask = (!EVEN && n0 + BLOCK_N > p.Lk) ||
                             (Var::kBlockMask && EVEN ? Var::needs_bound_mask(p.var, p.mod, warp_row_first, warp_row_first + 16, n0, n0 + BLOCK_N)
                                              : Var::needs_mask(p.var, p.mod, warp_row_first, warp_row_first + 16, n0, n0 + BLOCK_N));
      // the modifiers (steps 2-5 of the score pipeline; a bool mask / mask_mod pair by pair)
      if constexpr (Var::kNatural || Var::kPairMask)
        modify_score_tile<Var>(s, p.var, p.mod, item, row0, n0 + col_in_tile, p.Lq, p.Lk,
                               Var::kBlockMask && EVEN ? pair_tile : need_mask && pair_tile);
      if (need_mask) {
        int first[2], last[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          last[r] = Var::key_last(p.var, p.mod, row0 + 8 * r, p.Lk) - (n0 + col_in_tile);
          first[r] = Var::key_first(p.var, p.mod, row0 + 8 * r) - (n0 + col_in_tile);
        }
        mask_scores<Var::kKeyLo>(s, first, last);
      }
    }
    if constexpr (Var::kFixedOffset)
      fixed_offset_softmax_scores<Tr::kNTilesS, Var::template kPolyShare<Tr::kNTilesS, HEAD_DIM>>(s, l_i, sl2, mo);
    else
      online_softmax_scores<Tr::kNTilesS, Var::template kPolyShare<Tr::kNTilesS, HEAD_DIM>>(s, m_i, l_i, alpha, sl2);
  };

  // -- 4: Load Q_i (and, 7 for j = 0, K_0 and V_0) from HBM to on-chip SRAM
  // (Q is loaded once a block, so it is always predicated: EVEN is about keys, since 64-row
  // warpgroups make BLOCK_M = 192 a common choice that few Lq are multiples of)
  if (!kLoop || !prefetched) {   // (PERSIST: loaded during the previous item's last key tile)
    load_tile<QTile, kBlockM, kThreads, false>(sQ, gmem.q, p.q_row_stride, m0, p.Lq, p.d);
    if (n_blocks > j0) load_kv(j0, Var::kBlockMask ? slot_off : j0 + slot_off);
    cp_async_commit();
  }

  // -- 5: On chip, initialise O_i = 0, l_i = 0, m_i = -inf
  float o[Tr::kNTilesO][4];
#pragma unroll
  for (int t = 0; t < Tr::kNTilesO; ++t) o[t][0] = o[t][1] = o[t][2] = o[t][3] = 0.f;
  float m_i[2] = {kNegInf, kNegInf}, l_i[2] = {0.f, 0.f};
  sink_row_start<Var>(m_i, l_i, item, lane);   // a sink: m = sink, l = 1
  float s[Tr::kNTilesS][4];

  // -- 6: for 1 <= j <= T_c: S_ij (8), the softmax (9), P~_ij V_j (10), one after the other;
  //       K_{j+1}, V_{j+1} load meanwhile (7)
  for (int j = j0; j < n_blocks; j = after(j), advance(j)) {
    cp_async_wait<0>();    // K_j and V_j (and at the first tile, Q_i) have landed ...
    fence_proxy_async();   // ... are visible to the tensor cores' (async proxy) reads ...
    __syncthreads();       // ... for every thread, and every warpgroup is done with the other stage
    // kListTop: this warpgroup's kind of tile j taken from its entry, whose register then
    // receives the entry two visits ahead (walk_ahead's read, here once on every path)
    [[maybe_unused]] TileKind kind_j = kTileFull;
    if constexpr (kListTop) {
      kind_j = Var::Mod::entry_kind(e_cur, wg);
      e_cur = entry(visit + 2);
    }
    if ((Var::kBlockMask ? j_walk : j + 1) < n_blocks)
      load_kv(Var::kBlockMask ? j_walk : j + 1, Var::kBlockMask ? visit + 1 + slot_off : j + 1 + slot_off);
    else
      prefetch_next();   // PERSIST: the next item's Q and first K/V, during this last key tile
    cp_async_commit();
    if (j >= n_wg || (Var::kKeyLo && j < j_first_wg)) {
      walk_ahead();
      continue;
    }
    // A block mask: a tile its mask_mod hides from all of this warpgroup's rows changes
    // nothing for them (rows past Lq included); in one it keeps entirely the mask_mod is not
    // evaluated. The kind is the list entry's, for this warpgroup's slice.
    bool pair_tile = true;
    if constexpr (Var::kBlockMask) {
      const TileKind kind = kListTop ? kind_j : Var::Mod::entry_kind(e_cur, wg);
      if (kind == kTileEmpty) {
        walk_ahead();
        continue;
      }
      pair_tile = kind != kTileFull;
    }

    wgmma_fence();
    issue_s(s, Var::kBlockMask ? visit + slot_off : j + slot_off);
    walk_ahead();
    wgmma_wait<0>();
    fence_regs(s);
    float alpha[2];
    softmax(s, j, m_i, l_i, alpha, pair_tile);
    if constexpr (!Var::kFixedOffset) rescale_rows(o, alpha);   // (a fixed offset: alpha = 1)
    unsigned pa[Tr::kPVSteps][4];
#pragma unroll
    for (int kk = 0; kk < Tr::kPVSteps; ++kk) p_fragment<T>(pa[kk], s, kk);
    fence_regs(o);
    wgmma_fence();
    issue_pv(o, pa, Var::kBlockMask ? visit + slot_off : j + slot_off);
    wgmma_wait<0>();
    fence_regs(o);
  }

  if constexpr (kLoop && Var::kBlockMask) {   // PERSIST: the next item's copies (above)
    if (n_blocks > j0) {
      prefetch_next_now();
      cp_async_commit();
    }
  }

  // -- 11: end for.  12-15: l_i over the quad, O_i = diag(l_i)^-1 O_i, L_i = m_i + log(l_i),
  //    written to HBM
  // with no key tile (every row masked) Q's copy is still pending (O is staged over it).
  // PERSIST: after a key tile the only copies in flight are the next item's (the other Q
  // buffer, the stage the last tile left free), which its first tile waits for
  if (!kLoop || n_blocks <= j0) cp_async_wait<0>();
  float inv_l[2];
  if constexpr (Var::kFixedOffset) m_i[0] = m_i[1] = mo;   // lse = (mo + log2 l) ln 2: mo in base 2
  finish_rows(inv_l, l_i, m_i, Var::kFixedOffset ? 1.f : sl2, row0, p.Lq, reinterpret_cast<float*>(p.lse) + static_cast<long long>(b) * p.Lq);
  // Stage O through shared memory (over Q, which other warpgroups may still be reading: hence
  // the barrier first) so that the global stores are whole 16-byte chunks.
  __syncthreads();
  stage_o_slice<typename Tr::OTile, T>(sQ, 64 * wg + 16 * warp, o, inv_l);
  __syncthreads();
  // (LEAN: the copies' addresses advanced by constants, where the geometry allows)
  constexpr int kOChunks = Tr::OTile::kChunks;
  if constexpr ((LEAN & 1) != 0 && kThreads % kOChunks == 0 && (kThreads / kOChunks) % 8 == 0 &&
                kBlockM % (kThreads / kOChunks) == 0 && kOChunks % 8 == 0)
    store_o_rows<typename Tr::OTile, kBlockM, kThreads>(smem, gmem.o, p, off.o, m0);
  else
    store_o_tile<typename Tr::OTile, kBlockM, kThreads>(smem, gmem.o, p, off.o, m0);
  if constexpr (!kLoop) {
    break;
  } else {   // the next item: its Q and first K/V were loaded if this one had a key tile
    prefetched = n_blocks > j0;
    free_stage = ((Var::kBlockMask ? visit : n_blocks) + slot_off) & 1;
    qbuf = !qbuf;
    bid = next;
    if (bid >= n_items) break;
  }
  }  // items
}

}  // namespace sm90
}  // namespace cuflash
