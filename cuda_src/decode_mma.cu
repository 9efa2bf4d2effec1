// cuflash: split-KV decode (Flash-Decoding) on the tensor cores, sm_80 and newer, float16 and
// bfloat16, dense caches and paged caches whose page size is a multiple of 16. The other cases
// (float32, sm_70, any page size, head dims above 128) run decode.cu's decode_split.
//
// Why this kernel exists. decode_split does the two products on the FMA pipe: each lane holds 8
// columns of a key row, so a score needs a 16-lane shuffle reduction per packed query row, and
// every cache access recomputes a 64-bit address. Its main loop issues 75 (1 row) to 200 (8
// rows) instructions per 16-byte load (bench/probes/decode_sass.py), against a budget of about
// 60 at 4.3 TB/s (bench/NOTES.md, "decode: the instruction budget"). Here the packed query rows
// (G query heads of a KV head times Lq queries, up to 16) are the M dimension of mma.sync
// m16n8k16: a 16-key tile costs 2 x HEAD_DIM/16 MMAs for S = Q K^T and HEAD_DIM/8 for O += P V,
// whatever the number of rows, and the loads are cp.async straight into shared memory: about
// 10 instructions a 16-byte load, a sixth of the budget.
//
// Layout. One block = 4 warps = one (batch row b, KV head h, tile of 16 packed rows, key split),
// blockIdx.x = ((b * Hkv + h) * row_tiles + tile) * num_splits + split, as decode_split. The
// split's keys [start, end) are cut into block tiles of 64 keys; warp w takes keys
// [key0, key0 + 16) with key0 = start + 64 t + 16 w for t = 0, 1, ..., so the four warps read 64
// consecutive keys (contiguous memory in a dense cache) at a time. Each warp owns a private
// kStages-deep cp.async pipeline of K and V tiles (16 x HEAD_DIM each, swizzled) and its own
// online softmax: no block barrier inside the loop. kStages - 1 tiles are in flight while one
// is computed: 2 x 8 KB a warp at HEAD_DIM 128, 64 KB a block, and 2 blocks an SM (96 KB of
// shared memory each) keep ~128 KB an SM in flight (an H200 needs ~30 KB an SM at 4.3 TB/s).
//
// Softmax. The S fragment of a lane holds 2 rows x 4 keys; the row maximum is a 4-lane
// shuffle. A row's running maximum m (log2 units, scale folded in) only grows; the rescale of
// the accumulator by exp2(m_old - m_new) is skipped when no row of the warp grew (after the
// first tiles of a long cache, almost always: exact, since the factor would be 1). A row whose
// keys are all masked keeps m = -inf; its exponentials are taken against 0 instead (no NaN),
// its p, l and o stay 0. Row sums l are per-lane partials (each lane sums its own keys' p),
// reduced across the quad once at the end.
//
// Results. The four warps are merged through shared memory in warp order, the splits in split
// order, by the split kernel's last block of each group (FUSE builds: merge_splits_if_last) or
// by combine.cu (CUFLASH_DECODE_FUSE=0): bitwise reproducible for a given split count, and the
// two give bitwise the same result. Partials and the direct output use decode_split's layouts.
#include "decode_params.cuh"
#include "mma_sm80.cuh"

// CUFLASH_HOT(c): c, except in the static cost probe (bench/probes/decode_sass.py --hot), which
// compiles the main loop with every branch that a long split takes once or never folded to
// that common case (full tiles, no mask, no rescale), to count the instructions an iteration
// issues in the steady state. Never defined in a build that runs.
#ifdef CUFLASH_SASS_HOT_PATH
#define CUFLASH_HOT(c) true
#else
#define CUFLASH_HOT(c) (c)
#endif
// the probe's dense (0) or paged (1) build; a build that runs reads p.paged
#ifdef CUFLASH_SASS_PAGED
#define CUFLASH_PAGED(p) (CUFLASH_SASS_PAGED)
#else
#define CUFLASH_PAGED(p) ((p).paged)
#endif

namespace cuflash {
namespace decode {

// STAGES: the depth of each warp's cp.async ring. 3 (the builds from before the argument): 2
// blocks an SM at HEAD_DIM 128, 2 x 2 x 4 = 16 tiles (128 KB) in flight an SM. The deep builds
// (4, 5: _traits.decode_sm80_stages, for grids of at most one block an SM, where only one
// block's 3 - 1 = 2 tiles a warp, 64 KB, were in flight) keep STAGES - 1 tiles a warp in flight:
// 96 KB at 4 (132 KB of shared memory: fits an A100), 128 KB at 5 (164 KB: an H100 / H200).
template <typename T, int HEAD_DIM, int STAGES = 3>
struct DecodeMmaTraits {
  static constexpr int kWarps = 4;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kRows = 16;                 // packed query rows: the MMA's M
  static constexpr int kKeys = 16;                 // keys a warp tile: one k16 step of P V
  static constexpr int kKeysPerIter = kKeys * kWarps;
  static constexpr int kStages = STAGES;
  static_assert(STAGES >= 3 && STAGES <= 8, "the ring holds the tile computed and 2..7 in flight");
  using Tile = SwizzledTile<kKeys, HEAD_DIM>;      // K or V tile (and the Q tile: 16 rows too)
  static constexpr int kTileBytes = Tile::kBytes;
  // a warp's region: kStages x (K tile, V tile); reused at the end for its O (float, padded
  // rows), maxima and sums
  static constexpr int kORowFloats = HEAD_DIM + 8;
  static constexpr int kWarpBytes = kStages * 2 * kTileBytes;
  static constexpr int kEpilogueBytes = (kRows * kORowFloats + 2 * kRows) * 4;
  static constexpr int kSmemBytes = kTileBytes + kWarps * kWarpBytes;   // Q tile, then warps
  // blocks an SM (__launch_bounds__; _traits.DECODE_SM80's min_blocks): 2 at HEAD_DIM 128
  // (96 KB + 4 KB a block), 4 at 64
  static constexpr int kMinBlocks = HEAD_DIM <= 64 ? 4 : 2;
  static_assert(HEAD_DIM == 64 || HEAD_DIM == 128, "head-dim buckets 64 and 128");
  static_assert(kEpilogueBytes <= kWarpBytes, "a warp's epilogue fits in its pipeline region");
  static_assert(sizeof(T) == 2, "tensor-core operands are 16-bit");
};

// An opaque identity: the value is kept in a register instead of being recomputed (ptxas
// cannot rematerialise what an asm statement produced).
__device__ __forceinline__ void pin(unsigned& x) { asm volatile("" : "+r"(x)); }
__device__ __forceinline__ void pin(int& x) { asm volatile("" : "+r"(x)); }
__device__ __forceinline__ void pin(long long& x) { asm volatile("" : "+l"(x)); }

// Where a lane's copies of the warp tile at key0 start, given lane_k / lane_v, the offsets of
// its KV head, first row and chunk inside a tile. A tile never straddles a page (page_size % 16 == 0, key0 % 16 == 0).
template <typename T>
struct TileSrc { const T* k; const T* v; };

// The page holding key0 (clamped into [0, num_pages): a device value), or 0 for a dense cache.
// Read one iteration before the tile is issued, so the copies never wait for the table.
__device__ __forceinline__ int page_of(const DecodeParams& p, int b, int key0) {
  if (!CUFLASH_PAGED(p)) return 0;
  const int slot = p.page_shift >= 0 ? (key0 >> p.page_shift) : (key0 / p.page_size);
  const int* table = reinterpret_cast<const int*>(p.block_table);
  return min(max(__ldg(table + b * p.bt_b + slot), 0), p.num_pages - 1);
}

template <typename T>
__device__ __forceinline__ TileSrc<T> tile_src(const DecodeParams& p, int b, int key0, int page,
                                               long long lane_k, long long lane_v) {
  long long ko, vo;
  if (CUFLASH_PAGED(p)) {
    const int pos = p.page_shift >= 0 ? (key0 & (p.page_size - 1)) : (key0 % p.page_size);
    ko = page * p.k_b + pos * p.k_row;
    vo = page * p.v_b + pos * p.v_row;
  } else {
    ko = b * p.k_b + key0 * p.k_row;
    vo = b * p.v_b + key0 * p.v_row;
  }
  return {reinterpret_cast<const T*>(p.k_cache) + ko + lane_k,
          reinterpret_cast<const T*>(p.v_cache) + vo + lane_v};
}

// The K/V copies. CUFLASH_DECODE_L2 (a define the host puts before this source when the
// environment variable CUFLASH_DECODE_L2 asks for it; A/B runs, no build of the gate): 1, the
// L2 fetches the 256-byte block around each copy (.L2::256B: a K/V row is 256 bytes at d 128,
// read by the next lanes anyway: bigger DRAM bursts); 2, the same with an evict-first policy
// (the cache is read once a call: its lines should not push out the partials and counters).
// Without the define, cp_async_16's plain cp.async.cg (the machine code from before).
__device__ __forceinline__ void cp_async_kv(unsigned dst, const void* src, int src_bytes) {
#if defined(CUFLASH_DECODE_L2) && CUFLASH_DECODE_L2 == 1
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n"
               ::"r"(dst), "l"(src), "r"(src_bytes));
#elif defined(CUFLASH_DECODE_L2) && CUFLASH_DECODE_L2 == 2
  unsigned long long policy;
  asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  asm volatile("cp.async.cg.shared.global.L2::cache_hint.L2::256B [%0], [%1], 16, %2, %3;\n"
               ::"r"(dst), "l"(src), "r"(src_bytes), "l"(policy));
#else
  cp_async_16(dst, src, src_bytes);
#endif
}

// The fused merge's partials loaded ahead of its weights (merge_splits_if_last's PRE): 16
// splits a thread; 0 (the merge of session 7) where the host defines it so
// (CUFLASH_DECODE_MERGE=0, A/B runs).
#ifndef CUFLASH_DECODE_MERGE_PREFETCH
#define CUFLASH_DECODE_MERGE_PREFETCH 16
#endif
// The fused merge's arrival and counter reset as one atomic (merge_splits_if_last's WRAP): 1 by
// default; 0 (the arrival of sessions 7-10) where the host defines it so
// (CUFLASH_DECODE_ARRIVE=fence, A/B runs).
#ifndef CUFLASH_DECODE_ARRIVE_WRAP
#define CUFLASH_DECODE_ARRIVE_WRAP 1
#endif

// The page walk of a paged cache (CUFLASH_DECODE_PAGE_WALK, 1 by default; 0 where the host
// defines it so, CUFLASH_DECODE_PAGES=s9: A/B runs): 1, lane j of a warp holds the page of the
// warp's tile 32 i + j for the window i the copies are in, and the page of tile 32 (i + 1) + j
// (read when window i opens: 32 tiles ahead); a tile's page is a shuffle, so the prologue
// waits on one table read (all lanes at once) and the loop never on one. 0 (sessions 7-9):
// each tile's page read one iteration before its copies are issued (with pages of 16, a
// read a tile, and a miss in L2 every other iteration: the copies then wait on it).
#ifndef CUFLASH_DECODE_PAGE_WALK
#define CUFLASH_DECODE_PAGE_WALK 1
#endif

// The first K/V copies issued before cache_seqlens[b] arrives (CUFLASH_DECODE_EARLY_KV, 1 by
// default; 0 where the host defines it so, CUFLASH_DECODE_EARLY=0: the machine code of session
// 10, A/B runs). The length n of a batch row is a device value: reading it is one DRAM round
// trip (the rows' lengths are evicted from L2 by the previous call's K/V stream), and before,
// the first copies waited for it, then made their own round trip. Every key range of the even
// splits of a dense cache is known from n; the copies of the prologue (S - 1 tiles a warp) are
// issued for the range of a full row, n = capacity (with one split: key 0 on, whatever n, as
// long as n reaches the prologue's last key), then compared with the range of the real n:
// where they differ (a row shorter than the capacity, several splits; or n below the
// prologue's last key), the copies are left to land (wait_group 0) and those of the real range
// issued over them, the copies session 10 issued. Either way the tiles the loop reads are the
// same bytes: bitwise the result of 0. (Never masked instead: rows past n are the cache's
// unwritten slots, possibly NaN, and a masked key's p = 0 times a NaN V row is NaN in O.)
// Not for paged caches (the page walk reads its table from n's tiles) nor the STREAM build
// (its blocks' first group is no split's).
#ifndef CUFLASH_DECODE_EARLY_KV
#define CUFLASH_DECODE_EARLY_KV 1
#endif

// Issue the cp.async copies of one warp tile: keys [key0, key0 + 16), `valid` of which exist
// (the others land as zeros and read nothing), K into shared `ks` and V into `ks + kTileBytes`.
// `src`: this lane's first row; it copies rows lane_row + i * kRowStep, i < kPasses, to the
// shared offsets soff[i]. Columns past d (dv): k_bytes (v_bytes) 0, and the lane's chunk was
// clamped to 0 by the caller, so its address stays inside the row.
template <typename T, int HEAD_DIM>
__device__ __forceinline__ void issue_tile(const TileSrc<T>& src, unsigned ks, const unsigned (&soff)[16 / (32 / (HEAD_DIM / 8))],
                                           long long kstep, long long vstep, int valid, int lane_row,
                                           int k_bytes, int v_bytes) {
  constexpr int kRowStep = 32 / (HEAD_DIM / 8);    // rows one pass of the warp covers
  constexpr int kPasses = 16 / kRowStep;
  constexpr unsigned kTileBytes = SwizzledTile<16, HEAD_DIM>::kBytes;
  if (CUFLASH_HOT(valid >= 16)) {                  // every tile but a split's last
#pragma unroll
    for (int i = 0; i < kPasses; ++i) {
      cp_async_kv(ks + soff[i], src.k + i * kstep, k_bytes);
      cp_async_kv(ks + kTileBytes + soff[i], src.v + i * vstep, v_bytes);
    }
  } else {
    // rows past `valid` read nothing; their address is the tile's row 0 (inside the cache)
    const T* k0 = src.k - lane_row * (kstep / kRowStep);
    const T* v0 = src.v - lane_row * (vstep / kRowStep);
#pragma unroll
    for (int i = 0; i < kPasses; ++i) {
      const bool in = lane_row + i * kRowStep < valid;
      cp_async_kv(ks + soff[i], in ? src.k + i * kstep : k0, in ? k_bytes : 0);
      cp_async_kv(ks + kTileBytes + soff[i], in ? src.v + i * vstep : v0, in ? v_bytes : 0);
    }
  }
}

// A load the compiler keeps where it is written and whose value it cannot move (its uses come
// after it in the order of the source): cache_seqlens[b] for CUFLASH_DECODE_EARLY_KV.
__device__ __forceinline__ int load_opaque(const int* ptr) {
#ifdef __CUDA_ARCH__
  int x;
  asm volatile("ld.global.s32 %0, [%1];" : "=r"(x) : "l"(ptr));
  return x;
#else
  return *ptr;    // the host emulation (tests/_emu_decode.py)
#endif
}

// The key range [start, end) of a block of a row of n keys: its split's (num_splits even
// ranges of whole iterations) or, STREAM, its units [lo, hi) of den (whole iterations:
// consecutive fractions of a group share their boundary, a partition).
struct KeyRange { int start, end; };
template <bool STREAM, int KEYS_PER_ITER>
__device__ __forceinline__ KeyRange key_range(const DecodeParams& p, int n, int split, int lo,
                                              int hi, long long den) {
  const int iters = (n + KEYS_PER_ITER - 1) / KEYS_PER_ITER;
  int start, end;
  if (STREAM) {
    start = min(n, static_cast<int>(static_cast<long long>(lo) * iters / den) * KEYS_PER_ITER);
    end = min(n, static_cast<int>(static_cast<long long>(hi) * iters / den) * KEYS_PER_ITER);
  } else {
    const int per_split = (iters + p.num_splits - 1) / p.num_splits;
    start = min(n, split * per_split * KEYS_PER_ITER);
    end = min(n, start + per_split * KEYS_PER_ITER);
  }
  return {start, end};
}

// The kernel. Without STREAM: blockIdx.x = ((b * Hkv + h) * row_tiles + tile) * num_splits +
// split, one group and split a block (num_splits even key ranges of every group).
//   STREAM (a FUSE build, opt-in: CUFLASH_DECODE_STREAM, cuflash/_inference_grid.py; for where
// the even splits leave SMs idle, e.g. B = 1, 8 KV heads: 15 splits = 120 blocks on 132 SMs):
// the grid is stream_blocks (e.g. one block an SM) and the groups' key iterations are cut into stream_blocks equal shares, "stream-K"
// style: think of the groups laid end to end, group g as units [g den, (g + 1) den) with den =
// stream_blocks, and block i as units [i Gt, (i + 1) Gt), Gt = the number of groups. Block i
// runs, in group order, the piece of every group its units overlap; a group's partials are the
// blocks that overlap it, in block order (first = floor(g den / Gt)), so each group has its own
// count (floor(Gt / den) + 1 or 2 blocks; num_splits is the largest: the partials' stride) and
// the last of them to finish merges them. Every block reads the same number of keys (to a key
// iteration) when the batch rows are equally long; a group's fraction is of its own length, so
// short rows still spread over their blocks. Bitwise reproducible for a given grid.
//   FUSE: with more than one partial in a group, the block that writes the group's last
// partial merges them itself (merge_splits_if_last, decode_params.cuh) and decode_combine is
// not launched. A template flag rather than a run-time test, so that the build without it (one
// split: the host compiles FUSE only for num_splits > 1) keeps its machine code exactly; the
// loop over a block's groups (one trip without STREAM) likewise folds away there.
//   STAGES: the ring's depth (DecodeMmaTraits); the launch bounds stay those of 3 stages (the
// register cap of 2 blocks an SM at 128: the deep builds run one block an SM, by shared memory).
template <typename T, int HEAD_DIM, typename Variant, bool FUSE = false, bool STREAM = false,
          int STAGES = 3>
__global__ void __launch_bounds__(128, (DecodeMmaTraits<T, HEAD_DIM>::kMinBlocks))
decode_mma(const DecodeParams p) {
  static_assert(!STREAM || FUSE, "the stream build merges its own partials");
  static_assert(!STREAM || HEAD_DIM == 128, "at 64, 4 blocks an SM: 128 registers, it spills");
  using Tr = DecodeMmaTraits<T, HEAD_DIM, STAGES>;
  using Tile = typename Tr::Tile;
  constexpr int S = Tr::kStages, KSTEPS = HEAD_DIM / 16, NO = HEAD_DIM / 8;
  constexpr int kChunks = HEAD_DIM / 8;
  extern __shared__ __align__(128) unsigned char smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const unsigned q_s = smem_u32(smem);
  unsigned warp_s = q_s + Tr::kTileBytes + warp * Tr::kWarpBytes;
  pin(warp_s);
  // stage s of this warp: K tile at warp_s + 2 s kTileBytes, V tile right after it

  // STREAM: this block's units [u0, u1) and the groups they overlap; else one trip
  long long den = 1, groups = 1, u0 = 0, u1 = 1;
  int g_first = 0, g_last = 0;
  if (STREAM) {
    den = p.stream_blocks;
    groups = static_cast<long long>(p.B) * p.Hkv * p.row_tiles;
    u0 = static_cast<long long>(blockIdx.x) * groups;
    u1 = u0 + groups;
    g_first = static_cast<int>(u0 / den);
    g_last = static_cast<int>((u1 - 1) / den);
  }
  for (int g = g_first; g <= g_last; ++g) {
  // (the loop body keeps the indentation of the one-group kernel it was)
  // STREAM: the previous group's epilogue and merge read the shared memory this one refills;
  // the piece of group g: units [lo, hi) of its den, partial `piece` of `pieces`
  int piece = 0, pieces = 0, lo = 0, hi = 0;
  if (STREAM) {
    if (g > g_first) __syncthreads();
    const long long gu = g * den;                             // the group's first unit
    lo = static_cast<int>(max(u0 - gu, 0ll));
    hi = static_cast<int>(min(u1 - gu, den));
    const int first = static_cast<int>(gu / groups);
    piece = blockIdx.x - first;
    pieces = static_cast<int>((gu + den - 1) / groups) - first + 1;
  }
  // blockIdx.x = ((b * Hkv + h) * row_tiles + tile) * num_splits + split without STREAM
  const int split = STREAM ? piece : blockIdx.x % p.num_splits;
  const int rest = STREAM ? g : blockIdx.x / p.num_splits;
#define CUFLASH_NSPLIT (STREAM ? pieces : p.num_splits)   // (read where used, as before the flag)
  const int tile = rest % p.row_tiles;
  const int bh = rest / p.row_tiles;
  const int b = bh / p.Hkv, h = bh % p.Hkv;
  const int rows_total = p.G * p.Lq;

#if CUFLASH_DECODE_EARLY_KV
  // n's load issued now, its value read after the early copies (an opaque load: the compiler
  // would otherwise compute n's range where the load is, and wait for it before any copy)
  int n_loaded = load_opaque(reinterpret_cast<const int*>(p.cache_seqlens) + b);
#else
  const int n = total_keys(p, b);
  const KeyRange range = key_range<STREAM, Tr::kKeysPerIter>(p, n, split, lo, hi, den);
  const int start = range.start, end = range.end;
  // this warp's tiles: key0 = start + 64 t + 16 warp < end
  const int first = start + warp * Tr::kKeys;
  const int ntiles = first < end ? (end - first + Tr::kKeysPerIter - 1) / Tr::kKeysPerIter : 0;
#endif

  // -- the Q tile (16 packed rows; rows past G * Lq and columns past d are zeros), one group
  //    with this warp's first K/V tile
  {
    const T* qb = reinterpret_cast<const T*>(p.q) + b * p.q_b + h * p.q_h;
    for (int idx = threadIdx.x; idx < 16 * kChunks; idx += Tr::kThreads) {
      const int r = idx / kChunks, c = idx % kChunks;
      const int row = tile * 16 + r;
      const bool ok = row < rows_total && c * 8 < p.d;
      const int g = row / p.Lq, i = row % p.Lq;
      cp_async_16(Tile::addr(q_s, r, c), ok ? qb + g * p.q_g + i * p.q_row + c * 8 : qb, ok ? 16 : 0);
    }
  }
  // this lane's copy slot in a tile: rows ld_row + i * kRowStep, chunk ld_chunk (clamped to 0
  // past d / dv, where it copies nothing), and the shared offsets of its rows
  constexpr int kRowStep = 32 / kChunks, kPasses = 16 / kRowStep;
  const int ld_row = lane / kChunks, ld_chunk = lane % kChunks;
  const bool k_col = ld_chunk * 8 < p.d, v_col = ld_chunk * 8 < p.dv;
  int k_bytes = k_col ? 16 : 0, v_bytes = v_col ? 16 : 0;
  long long lane_k = h * p.k_h + ld_row * p.k_row + (k_col ? ld_chunk * 8 : 0);
  long long lane_v = h * p.v_h + ld_row * p.v_row + (v_col ? ld_chunk * 8 : 0);
  const long long kstep = kRowStep * p.k_row, vstep = kRowStep * p.v_row;
  unsigned soff[kPasses];
#pragma unroll
  for (int i = 0; i < kPasses; ++i) soff[i] = Tile::addr(0u, ld_row + i * kRowStep, ld_chunk);
  // computed once: ptxas would otherwise recompute them from threadIdx in every iteration
  // (~50 instructions a tile at HEAD_DIM 128), registers being plentiful here
  pin(lane_k);
  pin(lane_v);
  pin(k_bytes);
  pin(v_bytes);
#pragma unroll
  for (int i = 0; i < kPasses; ++i) pin(soff[i]);
#if CUFLASH_DECODE_EARLY_KV
  // the prologue's copies for a full row (n = capacity), before n is known (below); `early`:
  // they are the copies of the real range (the same first tile, the same keys covered up to
  // the prologue's last: kSpan), else (rare) they land and the real ones are issued over them
  bool early = false;
  int first_g = 0, end_g = 0;
  constexpr int kSpan = (S - 2) * Tr::kKeysPerIter + Tr::kKeys;
  if (!STREAM && !CUFLASH_PAGED(p)) {
    const KeyRange range_g =
        key_range<STREAM, Tr::kKeysPerIter>(p, p.capacity, split, lo, hi, den);
    first_g = range_g.start + warp * Tr::kKeys;
    end_g = range_g.end;
#pragma unroll
    for (int s = 0; s < S - 1; ++s) {
      const int key0 = first_g + s * Tr::kKeysPerIter;
      if (key0 < end_g)
        issue_tile<T, HEAD_DIM>(tile_src<T>(p, b, key0, 0, lane_k, lane_v),
                                warp_s + 2 * s * Tr::kTileBytes, soff, kstep, vstep, end_g - key0,
                                ld_row, k_bytes, v_bytes);
      cp_async_commit();
    }
  }
  // n (total_keys's clamp) and the range: from here on the copies wait for cache_seqlens
  pin(n_loaded);
  const int n = min(max(n_loaded, 0), p.capacity - p.Lnew) + p.Lnew;
  const KeyRange range = key_range<STREAM, Tr::kKeysPerIter>(p, n, split, lo, hi, den);
  const int start = range.start, end = range.end;
  // this warp's tiles: key0 = start + 64 t + 16 warp < end
  const int first = start + warp * Tr::kKeys;
  const int ntiles = first < end ? (end - first + Tr::kKeysPerIter - 1) / Tr::kKeysPerIter : 0;
  if (!STREAM && !CUFLASH_PAGED(p)) {
    early = first_g == first && min(end_g, first_g + kSpan) == min(end, first + kSpan);
    if (!early) cp_async_wait<0>();         // the wrong range's copies landed: overwrite them
  }
#endif
#if CUFLASH_DECODE_PAGE_WALK
  // paged: the pages of this warp's tiles [0, 32) (pwin, lane j: tile j) and [32, 64) (pnext)
  int pwin = 0, pnext = 0;
  if (CUFLASH_PAGED(p)) {
    pwin = lane < ntiles ? page_of(p, b, first + lane * Tr::kKeysPerIter) : 0;
    pnext = 32 + lane < ntiles ? page_of(p, b, first + (32 + lane) * Tr::kKeysPerIter) : 0;
  }
#endif
#if CUFLASH_DECODE_EARLY_KV
  if (!early) {                             // (else the copies above are the prologue's)
#endif
#pragma unroll
  for (int s = 0; s < S - 1; ++s) {
    if (s < ntiles) {
      const int key0 = first + s * Tr::kKeysPerIter;
#if CUFLASH_DECODE_PAGE_WALK
      const int pg = CUFLASH_PAGED(p) ? __shfl_sync(0xffffffffu, pwin, s) : 0;
#else
      const int pg = page_of(p, b, key0);
#endif
      issue_tile<T, HEAD_DIM>(tile_src<T>(p, b, key0, pg, lane_k, lane_v),
                              warp_s + 2 * s * Tr::kTileBytes, soff, kstep, vstep, end - key0,
                              ld_row, k_bytes, v_bytes);
    }
    cp_async_commit();
  }
#if CUFLASH_DECODE_EARLY_KV
  }
#endif
  cp_async_wait<S - 2>();                   // the Q tile (and stage 0) landed
  __syncthreads();

  // Q as A fragments (rows lane/4, +8; k 2 (lane%4).., +8), k-step kk
  unsigned qa[KSTEPS][4];
  {
    const typename Tile::FragAddr fa(q_s, (lane % 8) + ((lane / 8) % 2) * 8, lane / 16);
#pragma unroll
    for (int kk = 0; kk < KSTEPS; ++kk) ldmatrix_x4(qa[kk], fa.at(0, 2 * kk));
  }
  // ldmatrix addresses inside a K tile (B of S = Q K^T: keys lane%8 + 8 (lane/16), chunk
  // (lane/8)%2) and a V tile (B of O += P V, transposed: keys lane%8 + 8 ((lane/8)%2), chunk lane/16)
  const int k_row = (lane % 8) + (lane / 16) * 8, k_chunk = (lane / 8) % 2;
  const int v_row = (lane % 8) + ((lane / 8) % 2) * 8, v_chunk = lane / 16;

  // the packed rows this lane's fragments hold (lane/4 and lane/4 + 8), as query indices i:
  // causal (bottom-right) query i sees keys j <= n - Lq + i
  int last_key[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = tile * 16 + lane / 4 + 8 * r;
    last_key[r] = n - p.Lq + row % p.Lq;
  }
  const float sl2 = static_cast<float>(p.var.scale_log2);

  float o[NO][4];
#pragma unroll
  for (int t = 0; t < NO; ++t) o[t][0] = o[t][1] = o[t][2] = o[t][3] = 0.f;
  float m[2] = {kNegInf, kNegInf}, l[2] = {0.f, 0.f};

  // shared offsets (from warp_s) of the stage read now and of the stage refilled now
  unsigned rd = 0, wr = (S - 1) * 2 * Tr::kTileBytes;
  constexpr unsigned kRing = S * 2 * Tr::kTileBytes;
#if CUFLASH_DECODE_PAGE_WALK
  int page = 0;
#else
  // the page of the next tile to issue (tile S - 1), read ahead
  int page = S - 1 < ntiles ? page_of(p, b, first + (S - 1) * Tr::kKeysPerIter) : 0;
#endif
  for (int t = 0; t < ntiles; ++t) {
    const int key0 = first + t * Tr::kKeysPerIter;
    __syncwarp();                           // every lane is done with the stage refilled now
    if (t + S - 1 < ntiles) {
      const int knext = key0 + (S - 1) * Tr::kKeysPerIter;
#if CUFLASH_DECODE_PAGE_WALK
      if (CUFLASH_PAGED(p)) {               // tile u = t + S - 1 (warp-uniform branches)
        const int u = t + S - 1;
        if ((u & 31) == 0) {                // window u / 32 opens: read the one after it
          pwin = pnext;
          pnext = u + 32 + lane < ntiles
                      ? page_of(p, b, first + (u + 32 + lane) * Tr::kKeysPerIter) : 0;
        }
        page = __shfl_sync(0xffffffffu, pwin, u & 31);
      }
#endif
      issue_tile<T, HEAD_DIM>(tile_src<T>(p, b, knext, page, lane_k, lane_v), warp_s + wr, soff,
                              kstep, vstep, end - knext, ld_row, k_bytes, v_bytes);
#if !CUFLASH_DECODE_PAGE_WALK
      if (t + S < ntiles) page = page_of(p, b, knext + Tr::kKeysPerIter);
#endif
    }
    cp_async_commit();
    cp_async_wait<S - 1>();                 // tile t landed (this lane's copies)
    __syncwarp();                           // ... and every lane's
    const unsigned ks = warp_s + rd;
    const unsigned vs = ks + Tr::kTileBytes;
    rd = rd + 2 * Tr::kTileBytes == kRing ? 0u : rd + 2 * Tr::kTileBytes;
    wr = wr + 2 * Tr::kTileBytes == kRing ? 0u : wr + 2 * Tr::kTileBytes;

    // -- S = Q K^T: two n8 tiles (keys 0-7, 8-15)
    float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
    {
      const typename Tile::FragAddr fk(ks, k_row, k_chunk);
#pragma unroll
      for (int kk = 0; kk < KSTEPS; ++kk) {
        unsigned kb[4];
        ldmatrix_x4(kb, fk.at(0, 2 * kk));
        Mma<T>::run(s[0], qa[kk], kb[0], kb[1]);
        Mma<T>::run(s[1], qa[kk], kb[2], kb[3]);
      }
    }
    // -- masks: keys past `end` (the split's last tile), keys after a row's last (causal)
    if (!CUFLASH_HOT(!(key0 + 16 > end || (Variant::kCausal && key0 + 15 > n - p.Lq)))) {
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int j = key0 + nt * 8 + 2 * (lane % 4) + (e % 2);
          if (j >= end || (Variant::kCausal && j > last_key[e / 2])) s[nt][e] = kNegInf;
        }
    }
    // -- online softmax, rows lane/4 (e = 0, 1) and lane/4 + 8 (e = 2, 3)
    float alpha[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx = fmaxf(fmaxf(s[0][2 * r], s[0][2 * r + 1]), fmaxf(s[1][2 * r], s[1][2 * r + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      // scores in log2 units: s * scale * log2(e); -inf stays -inf (scale > 0)
      const float mnew = fmaxf(m[r], mx * sl2);
      const float ref = mnew == kNegInf ? 0.f : mnew;
      alpha[r] = ex2_approx(m[r] - ref);    // m = -inf: 0 (l, o are 0 then anyway)
      m[r] = mnew;
      float sum = 0.f;
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float pe = ex2_approx(fmaf(s[nt][2 * r + e], sl2, -ref));
          s[nt][2 * r + e] = pe;
          sum += pe;
        }
      l[r] = fmaf(l[r], alpha[r], sum);
    }
    // the accumulator's rescale, skipped when no row of the warp changed its maximum
    if (!CUFLASH_HOT(!__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f))) {
#pragma unroll
      for (int nt = 0; nt < NO; ++nt) {
        o[nt][0] *= alpha[0]; o[nt][1] *= alpha[0];
        o[nt][2] *= alpha[1]; o[nt][3] *= alpha[1];
      }
    }
    // -- O += P V: P as the A fragment of one k16 step
    unsigned pa[4] = {pack2<T>(s[0][0], s[0][1]), pack2<T>(s[0][2], s[0][3]),
                      pack2<T>(s[1][0], s[1][1]), pack2<T>(s[1][2], s[1][3])};
    {
      const typename Tile::FragAddr fv(vs, v_row, v_chunk);
#pragma unroll
      for (int nt = 0; nt < NO; nt += 2) {
        unsigned vb[4];
        ldmatrix_x4_trans(vb, fv.at(0, nt));
        Mma<T>::run(o[nt], pa, vb[0], vb[1]);
        Mma<T>::run(o[nt + 1], pa, vb[2], vb[3]);
      }
    }
  }
  cp_async_wait<0>();                       // (only empty groups are left; the emulation checks)

  // -- the row sums over the quad; this warp's O, m, l into its own region (as floats)
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
  }
  __syncwarp();
  float* wo = reinterpret_cast<float*>(smem + Tr::kTileBytes + warp * Tr::kWarpBytes);
  float* wm = wo + Tr::kRows * Tr::kORowFloats;
  float* wl = wm + Tr::kRows;
#pragma unroll
  for (int nt = 0; nt < NO; ++nt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float2* dst = reinterpret_cast<float2*>(wo + (lane / 4 + 8 * r) * Tr::kORowFloats + nt * 8 + 2 * (lane % 4));
      *dst = make_float2(o[nt][2 * r], o[nt][2 * r + 1]);
    }
  if (lane % 4 == 0) {
#pragma unroll
    for (int r = 0; r < 2; ++r) { wm[lane / 4 + 8 * r] = m[r]; wl[lane / 4 + 8 * r] = l[r]; }
  }
  __syncthreads();

  // -- merge the warps in warp order; normalise; write the output or the split's partial
  const int ncols = p.dv;
  for (int idx = threadIdx.x; idx < 16 * ncols; idx += Tr::kThreads) {
    const int r = idx / ncols, c = idx % ncols;
    const int row = tile * 16 + r;
    if (row >= rows_total) continue;
    const float* base = reinterpret_cast<const float*>(smem + Tr::kTileBytes);
    constexpr int kWarpFloats = Tr::kWarpBytes / 4;
    const int mo = Tr::kRows * Tr::kORowFloats;
    float mx = kNegInf;
#pragma unroll
    for (int w = 0; w < Tr::kWarps; ++w) mx = fmaxf(mx, base[w * kWarpFloats + mo + r]);
    const float ref = mx == kNegInf ? 0.f : mx;
    float lsum = 0.f, osum = 0.f;
#pragma unroll
    for (int w = 0; w < Tr::kWarps; ++w) {
      const float* wb = base + w * kWarpFloats;
      const float f = ex2_approx(wb[mo + r] - ref);
      lsum = fmaf(wb[mo + Tr::kRows + r], f, lsum);
      osum = fmaf(wb[r * Tr::kORowFloats + c], f, osum);
    }
    store_row<T>(p, b, h, bh, rows_total, row, split, c, mx, lsum, osum, CUFLASH_NSPLIT);
  }
  // -- the combine of the splits, by the group's last block (the Q tile's region holds the
  //    flag, the warps' regions the weights: nothing reads either any more)
  if (FUSE && CUFLASH_NSPLIT > 1)
    merge_splits_if_last<T, Tr::kThreads, CUFLASH_DECODE_MERGE_PREFETCH,
                         CUFLASH_DECODE_ARRIVE_WRAP != 0>(
        p, rest, bh, rows_total, tile * 16, min(16, rows_total - tile * 16),
        reinterpret_cast<float*>(smem + Tr::kTileBytes), reinterpret_cast<int*>(smem), CUFLASH_NSPLIT);
#undef CUFLASH_NSPLIT
  }
}

}  // namespace decode
}  // namespace cuflash
