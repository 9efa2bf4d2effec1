// cuflash: tensor-core forward for float16 / bfloat16 on sm_80 and newer (mma.sync).
//
// FlashAttention-2, Algorithm 1, one thread block per (batch item, BLOCK_M query rows):
//   each warp owns SLICES x 16 query rows, so the online softmax never talks across warps,
//   and every K/V fragment a warp reads from shared memory feeds SLICES mma's;
//   K_j and V_j tiles arrive by cp.async into XOR-swizzled, double-buffered shared memory:
//   K_{j+1} and V_{j+1} load while the block computes on K_j and V_j, and one barrier per
//   key tile is all the synchronisation there is;
//   S and P live in registers, and P is reused directly as the A operand of P V_j;
//   tiles with no visible pair (the Variant, variant.cuh; causal: beyond the diagonal) are
//   never visited, and only the tiles that straddle the mask boundary
//   or the end of the keys pay for a mask.
//
// Requirements the launcher (cuflash/_plan.py, _launch.py) guarantees:
//   q, k, v have unit column stride, and every row start is 16-byte aligned;
//   d and dv are multiples of 8 (the launcher zero-pads otherwise) and at most HEAD_DIM.
#include "common.cuh"
#include "mma_sm80.cuh"
#include "online_softmax.cuh"

namespace cuflash {

// Tile constants of one specialisation. The per-head-dim choice of BLOCK_N and WARPS, with the
// reason for each, is the table FWD_SM80 in cuflash/_traits.py; here they are derived and
// checked.
template <typename T, int HEAD_DIM, int BLOCK_N, int WARPS, int SLICES, int MIN_BLOCKS>
struct Sm80Traits {
  static constexpr int kHeadDim = HEAD_DIM;
  static constexpr int kWarps = WARPS;
  static constexpr int kThreads = 32 * WARPS;
  static constexpr int kSlices = SLICES;         // 16-row mma M tiles per warp
  static constexpr int kWarpRows = 16 * SLICES;
  static constexpr int kBlockM = kWarpRows * WARPS;
  static constexpr int kBlockN = BLOCK_N;
  static constexpr int kKSteps = HEAD_DIM / 16;  // k16 steps of S = Q K^T
  static constexpr int kNTilesS = BLOCK_N / 8;   // n8 tiles of S (= k8 halves of P V)
  static constexpr int kNTilesO = HEAD_DIM / 8;  // n8 tiles of O
  // Q fragments (HEAD_DIM/4 registers a slice) stay in registers while Q and O together fit
  // in 3 * HEAD_DIM/4 a slice at d <= 128 for one slice, d <= 64 for two; otherwise Q is
  // re-read from shared memory each k-step.
  static constexpr bool kQInRegs = HEAD_DIM * SLICES <= 128;
  // Blocks per SM the registers must allow (__launch_bounds__): 2 caps a 256-thread block at
  // 128 registers a thread.
  static constexpr int kMinBlocks = MIN_BLOCKS;

  using QTile = SwizzledTile<kBlockM, HEAD_DIM>;   // also holds O for the epilogue
  using KVTile = SwizzledTile<kBlockN, HEAD_DIM>;
  static constexpr int kStages = 2;  // K/V buffers: compute on one while the next one loads
  static constexpr int kSmemBytes = QTile::kBytes + 2 * kStages * KVTile::kBytes;

  static_assert(sizeof(T) == 2, "the mma.sync path is for float16 / bfloat16 inputs");
  static_assert(HEAD_DIM % 32 == 0 && HEAD_DIM <= 256, "head-dim buckets are multiples of 32");
  static_assert(BLOCK_N % 16 == 0, "P V consumes S in k16 slices");
  static_assert(WARPS >= 1 && WARPS <= 8 && kBlockM <= 128, "at most 128 rows a block");
  static_assert(SLICES == 1 || SLICES == 2, "one or two 16-row slices a warp");
  static_assert(MIN_BLOCKS >= 1 && MIN_BLOCKS * kThreads <= 2048, "threads per SM");
};

template <typename T, int HEAD_DIM, int BLOCK_N, int WARPS, int SLICES, int MIN_BLOCKS, typename Var, bool EVEN>
__global__ void __launch_bounds__(32 * WARPS, MIN_BLOCKS)
fwd_sm80(const Params CUFLASH_VARLEN_PARAM(p)) {
  CUFLASH_VARLEN_VIEW(T, p)   // varlen builds: this block's sequence (common.cuh; helper "inference")
  using Tr = Sm80Traits<T, HEAD_DIM, BLOCK_N, WARPS, SLICES, MIN_BLOCKS>;
  constexpr int MS = SLICES;
  using QTile = typename Tr::QTile;
  using KVTile = typename Tr::KVTile;
  constexpr int kBlockM = Tr::kBlockM, kThreads = Tr::kThreads;
  const float kNegInf = -__int_as_float(0x7f800000);

  extern __shared__ __align__(128) unsigned char smem[];
  // Layout: Q | K stage 0 | V stage 0 | K stage 1 | V stage 1
  const unsigned sQ = smem_u32(smem);
  const unsigned sKV = sQ + QTile::kBytes;
  constexpr unsigned kStageBytes = 2 * KVTile::kBytes;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const BlockTile tile = block_tile(p);
  const int b = tile.b;
  const int m0 = tile.m_block * kBlockM;
  const BatchOffsets off = batch_offsets(p, b);
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

  // Key tiles [j_first, n_blocks) hold the keys this Q tile can see (Variant: all of them, or
  // under the causal mask those j <= i + causal_offset of its last row, and under a window
  // those from its first row's left bound on; j_first is 0 without a window). n_blocks can
  // be <= j_first (every row fully masked): the loop is skipped and the epilogue writes O = 0,
  // lse = -inf (or the sink).
  const int n_end = Var::key_end(p.var, p.mod, m0 + kBlockM, p.Lk);
  const int n_blocks = n_end > 0 ? (n_end + BLOCK_N - 1) / BLOCK_N : 0;
  const int j_first = Var::kKeyLo ? Var::key_begin(p.var, p.mod, m0) / BLOCK_N : 0;
  // Within that range a block mask visits only the key tiles of its list for this row block
  // (Mod::tile_list: those some row of the block may see; the others are never loaded nor
  // computed), each with the kind of every warp's rows. The loop visits the list's first entry
  // j0, then the next, and so on: after(j), the tile visited after j (j_walk, from entry
  // e_walk), is prefetched during j, and the entry after it is read in the loop's increment,
  // where S and P are dead (in the body the walk made ptxas spill). `visit` counts the visits
  // and picks the K/V stage, so the tile being loaded never shares the stage being computed
  // on. Without a block mask the walk is j_first, j_first + 1, ... and the stage is j's parity,
  // spelled as they were (j + 1 through a lambda changed the machine code).
  [[maybe_unused]] const int* list = nullptr;
  [[maybe_unused]] int list_n = 0;
  if constexpr (Var::kBlockMask) list = Var::Mod::template tile_list<true>(p.mod, item, tile.m_block, list_n);
  auto entry = [&](int v) { return Var::Mod::list_entry(list, v, n_blocks); };
  int e_cur = Var::kBlockMask ? entry(0) : 0;
  int e_walk = Var::kBlockMask ? entry(1) : 0;
  const int j0 = Var::kBlockMask ? Var::Mod::entry_tile(e_cur) : j_first;
  int j_walk = Var::kBlockMask ? Var::Mod::entry_tile(e_walk) : 0, visit = 0;
  auto after = [&](int j) { return Var::kBlockMask ? j_walk : j + 1; };
  auto advance = [&](int) {   // the tile just reached is j_walk
    if constexpr (Var::kBlockMask) {
      e_cur = e_walk;
      e_walk = entry(visit + 2);
      j_walk = Var::Mod::entry_tile(e_walk);
      ++visit;
    }
  };

  // K_j and V_j into stage `stage`
  auto load_kv = [&](int n0, int stage) {
    const unsigned sK = sKV + stage * kStageBytes;
    load_tile<KVTile, BLOCK_N, kThreads, EVEN>(sK, gmem.k, p.k_row_stride, n0, p.Lk, p.d);
    load_tile<KVTile, BLOCK_N, kThreads, EVEN>(sK + KVTile::kBytes, gmem.v, p.v_row_stride, n0, p.Lk, p.dv);
  };

  // -- 4: Load Q_i (and, 7 for j = 0, K_0 and V_0) from HBM to on-chip SRAM
  load_tile<QTile, kBlockM, kThreads, EVEN>(sQ, gmem.q, p.q_row_stride, m0, p.Lq, p.d);
  if (n_blocks > j0) load_kv(j0 * BLOCK_N, Var::kBlockMask ? 0 : j0 & 1);
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();

  // A-fragment addressing (ldmatrix x4): lanes 0-15 give rows 0-15 of a slice at k-chunk
  // 2s, lanes 16-31 the same rows at chunk 2s + 1; slice ms is 16 rows further on.
  const typename QTile::FragAddr q_frag(sQ, warp * Tr::kWarpRows + (lane & 15), lane >> 4);
  // A bias or an element mask array costs registers for its loads in every tile: those
  // variants give Q's registers back and re-read Q from shared memory each k-step.
  constexpr bool kQInRegs = Tr::kQInRegs && !(Var::Mod::kHasBias || Var::kPairMask);
  unsigned qf[kQInRegs ? MS : 1][kQInRegs ? Tr::kKSteps : 1][4];
  if constexpr (kQInRegs) {
#pragma unroll
    for (int ms = 0; ms < MS; ++ms)
#pragma unroll
      for (int s = 0; s < Tr::kKSteps; ++s) ldmatrix_x4(qf[ms][s], q_frag.at(16 * ms, 2 * s));
  }
  // B-fragment addressing. K (S = Q K^T), matrices: keys 0-7 / chunk 2s, keys 0-7 / 2s+1,
  // keys 8-15 / 2s, keys 8-15 / 2s+1.  V (O += P V, transposed), matrices: keys 0-7 / chunk
  // 2t, keys 8-15 / 2t, keys 0-7 / 2t+1, keys 8-15 / 2t+1.
  // Both address stage 0; stage 1 is kStageBytes further on.
  const typename KVTile::FragAddr k_frag(sKV, (lane & 7) + ((lane >> 4) << 3), (lane >> 3) & 1);
  const typename KVTile::FragAddr v_frag(sKV + KVTile::kBytes, (lane & 7) + (((lane >> 3) & 1) << 3), lane >> 4);

  // -- 5: On chip, initialise O_i = 0, l_i = 0, m_i = -inf. Per-thread state, per slice ms:
  //       rows row0 + 16 ms and row0 + 16 ms + 8.
  float o[MS][Tr::kNTilesO][4];
#pragma unroll
  for (int ms = 0; ms < MS; ++ms)
#pragma unroll
    for (int t = 0; t < Tr::kNTilesO; ++t) o[ms][t][0] = o[ms][t][1] = o[ms][t][2] = o[ms][t][3] = 0.f;
  float m_i[MS][2], l_i[MS][2];  // running row max of the raw scores; running row sum of
#pragma unroll                   // exp2(s*sl2 - m*sl2) over this thread's columns
  for (int ms = 0; ms < MS; ++ms) m_i[ms][0] = m_i[ms][1] = kNegInf, l_i[ms][0] = l_i[ms][1] = 0.f;
#pragma unroll
  for (int ms = 0; ms < MS; ++ms) sink_row_start<Var>(m_i[ms], l_i[ms], item, lane);  // a sink: m = sink, l = 1
  const int row0 = m0 + warp * Tr::kWarpRows + lane / 4;
  const int col_in_tile = 2 * (lane % 4);

  // -- 6: for 1 <= j <= T_c (the key tiles this Q tile can see):
  for (int j = j0; j < n_blocks; j = after(j), advance(j)) {
    const int n0 = j * BLOCK_N;
    const unsigned stage_off = Var::kBlockMask ? (visit & 1) * kStageBytes : (j & 1) * kStageBytes;
    if (j > j0) {
      cp_async_wait<0>();   // K_j and V_j have landed ...
      __syncthreads();      // ... for every thread, and every warp is done with the other stage
    }
    // -- 7: Load K_{j+1} and V_{j+1} (the next tile visited) into the other stage (overlaps all
    //       of this iteration)
    if ((Var::kBlockMask ? j_walk : j + 1) < n_blocks)
      load_kv(Var::kBlockMask ? j_walk * BLOCK_N : n0 + BLOCK_N, Var::kBlockMask ? (visit + 1) & 1 : (j + 1) & 1);
    cp_async_commit();
    // A tile with no visible pair for this warp's rows (causal: wholly past the diagonal of its
    // last row) changes nothing for them (every score masked: alpha = 1, P = 0), so the warp
    // skips its math; it still takes part in the loads and the barrier above.
    if (Var::tile_invisible(p.var, p.mod, m0 + warp * Tr::kWarpRows, m0 + (warp + 1) * Tr::kWarpRows, n0, n0 + BLOCK_N)) continue;
    // A block mask: a tile its mask_mod hides entirely changes nothing either; in a tile it
    // keeps entirely the mask_mod is not evaluated (pair_tile false).
    bool pair_tile = true;
    if constexpr (Var::kBlockMask) {   // (the list entry's kind for this warp's rows; rows past Lq: empty)
      const TileKind kind = Var::Mod::entry_kind(e_cur, warp);
      if (kind == kTileEmpty) continue;
      pair_tile = kind != kTileFull;
    }

    // -- 8: On chip, compute S_ij = Q_i K_j^T
    float s[MS][Tr::kNTilesS][4];
#pragma unroll
    for (int ms = 0; ms < MS; ++ms)
#pragma unroll
      for (int t = 0; t < Tr::kNTilesS; ++t) s[ms][t][0] = s[ms][t][1] = s[ms][t][2] = s[ms][t][3] = 0.f;
#pragma unroll
    for (int ks = 0; ks < Tr::kKSteps; ++ks) {
      unsigned a[MS][4];
#pragma unroll
      for (int ms = 0; ms < MS; ++ms) {
        if constexpr (kQInRegs) {
          a[ms][0] = qf[ms][ks][0]; a[ms][1] = qf[ms][ks][1]; a[ms][2] = qf[ms][ks][2]; a[ms][3] = qf[ms][ks][3];
        } else {
          ldmatrix_x4(a[ms], q_frag.at(16 * ms, 2 * ks));
        }
      }
#pragma unroll
      for (int np = 0; np < Tr::kNTilesS / 2; ++np) {
        unsigned bk[4];
        ldmatrix_x4(bk, k_frag.at(np * 16, 2 * ks) + stage_off);
#pragma unroll
        for (int ms = 0; ms < MS; ++ms) {
          Mma<T>::run(s[ms][2 * np], a[ms], bk[0], bk[1]);
          Mma<T>::run(s[ms][2 * np + 1], a[ms], bk[2], bk[3]);
        }
      }
    }
#pragma unroll
    for (int ms = 0; ms < MS; ++ms) {
      // -- the Variant's score transform (identity without modifiers; else steps 2-5 of the
      //    score pipeline, and a bool mask / mask_mod pair by pair), then the mask: keys past
      //    Lk, and the pairs the Variant masks (causal: keys j > i + causal_offset; a window:
      //    keys outside [i + diag - left, i + diag + right]). Only tiles that cross the end of
      //    the keys or this slice's mask boundary pay for it.
      Var::transform_tile(p.var, s[ms]);
      const int warp_row_first = m0 + warp * Tr::kWarpRows + 16 * ms;
      // (a block mask: the bounds' mask where they cross the tile, the pair masks where its
      // kind is not full)
      const bool need_mask = (!EVEN && n0 + BLOCK_N > p.Lk) ||
                             (Var::kBlockMask ? Var::needs_bound_mask(p.var, p.mod, warp_row_first, warp_row_first + 16, n0, n0 + BLOCK_N)
                                              : Var::needs_mask(p.var, p.mod, warp_row_first, warp_row_first + 16, n0, n0 + BLOCK_N));
      if constexpr (Var::kNatural || Var::kPairMask)
        modify_score_tile<Var>(s[ms], p.var, p.mod, item, row0 + 16 * ms, n0 + col_in_tile, p.Lq, p.Lk,
                               Var::kBlockMask ? pair_tile : need_mask && pair_tile);
      if (need_mask) {
        // the first and last visible key of each of this thread's two rows, relative to this
        // thread's first column in the tile
        int first[2], last[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          last[r] = Var::key_last(p.var, p.mod, row0 + 16 * ms + 8 * r, p.Lk) - (n0 + col_in_tile);
          first[r] = Var::key_first(p.var, p.mod, row0 + 16 * ms + 8 * r) - (n0 + col_in_tile);
        }
        mask_scores<Var::kKeyLo>(s[ms], first, last);
      }
      // -- 9: m_ij = max(m_i, rowmax(S_ij)), P~_ij = exp(S_ij - m_ij), l_i rescaled + rowsum;
      //    10 (first half): O_i = diag(exp(m_i - m_ij)) O_i
      //    (the softcap alone: a fixed offset, no max and no rescale)
      if constexpr (Var::kFixedOffset)
        fixed_offset_softmax_scores<Tr::kNTilesS, Var::template kPolyShare<Tr::kNTilesS, HEAD_DIM>>(s[ms], l_i[ms], sl2, mo);
      else
        online_softmax_step<Var::template kPolyShare<Tr::kNTilesS, HEAD_DIM>>(s[ms], m_i[ms], l_i[ms], o[ms], sl2);
    }

    // -- 10: O_i += P~_ij V_j, with P taken straight from the S accumulators as the A operand
#pragma unroll
    for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
      unsigned a[MS][4];
#pragma unroll
      for (int ms = 0; ms < MS; ++ms) p_fragment<T>(a[ms], s[ms], kk);
#pragma unroll
      for (int np = 0; np < Tr::kNTilesO / 2; ++np) {
        unsigned bv[4];
        ldmatrix_x4_trans(bv, v_frag.at(kk * 16, 2 * np) + stage_off);
#pragma unroll
        for (int ms = 0; ms < MS; ++ms) {
          Mma<T>::run(o[ms][2 * np], a[ms], bv[0], bv[1]);
          Mma<T>::run(o[ms][2 * np + 1], a[ms], bv[2], bv[3]);
        }
      }
    }
  }

  // -- 11: end for.  12-15: l_i over the quad, O_i = diag(l_i)^-1 O_i, L_i = m_i + log(l_i),
  //    written to HBM
  float inv_l[MS][2];
#pragma unroll
  for (int ms = 0; ms < MS; ++ms) {
    if constexpr (Var::kFixedOffset) m_i[ms][0] = m_i[ms][1] = mo;   // lse = (mo + log2 l) ln 2
    finish_rows(inv_l[ms], l_i[ms], m_i[ms], Var::kFixedOffset ? 1.f : sl2, row0 + 16 * ms, p.Lq,
                reinterpret_cast<float*>(p.lse) + static_cast<long long>(b) * p.Lq);
  }

  // Stage O through shared memory (the Q tile's space; this warp's own rows only) so that the
  // global stores are whole 16-byte rows.
  // With Q in registers no __syncwarp is needed: its ldmatrix loads fed this warp's mma.sync
  // (both .aligned, warp-wide), so every lane has read these rows before any lane stages O.
  // compute-sanitizer's racecheck reports the pair as a *warning* (its level for warp-level
  // programming hazards: session 9, fwd_sm80<__half, 32, ...>). A __syncwarp() here would not
  // silence it: ptxas proves the warp converged and emits no instruction for it (the machine
  // code of all 252 fwd_sm80 builds is identical with and without one, tools/sass_identity.py).
  if constexpr (!kQInRegs) __syncwarp();  // this warp's last ldmatrix of Q is done
#pragma unroll
  for (int ms = 0; ms < MS; ++ms)
    stage_o_slice<QTile, T>(sQ, warp * Tr::kWarpRows + 16 * ms, o[ms], inv_l[ms]);
  __syncthreads();
  store_o_tile<QTile, kBlockM, kThreads>(smem, gmem.o, p, off.o, m0);
}

}  // namespace cuflash
