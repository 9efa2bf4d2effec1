"""Traits tables: the tile sizes of every kernel family, each with the reason it was chosen.

A :class:`Traits` is one tile configuration of one family: its tile template arguments by name,
in the kernel's order, and what follows from them (rows and keys a block, threads, shared
memory). The C++ traits struct of each family (``Sm80Traits``, ``Sm90Traits``, ...) derives the
same quantities from the same arguments and ``static_assert``s the rules, so a bad entry here
fails to compile instead of running wrong; the shared-memory formulas are the only ones written
on both sides (tests compare them through NVRTC).

Register counts quoted in the reasons are ptxas's (``python -m cuflash check``); timings are in
``bench/NOTES.md``. H200: 132 SMs, 227 KB of shared memory a block, 64K registers an SM.
"""

from __future__ import annotations

import dataclasses
from typing import Callable


@dataclasses.dataclass(frozen=True)
class Traits:
    """One tile configuration of one kernel family."""
    family: str
    args: tuple[tuple[str, int], ...]   # the tile template arguments, by name, in kernel order
    head_dim: int                        # the head-dim bucket: max(d, dv) rounded up
    block_m: int                         # query rows a block (B_r)
    block_n: int                         # keys a tile (B_c)
    threads: int
    smem_bytes: int                      # dynamic shared memory of one block
    min_blocks: int = 1                  # blocks an SM the registers must allow
    split_wave: int = 0                  # decode: blocks an SM its split heuristic fills (0: min_blocks)
    allow_even: bool = True              # fwd_sm80: False where the EVEN build spills
    acc: int = 4                         # bytes of the accumulation type (simt families)
    reason: str = dataclasses.field(default="", compare=False)

    def __getitem__(self, name: str) -> int:
        return dict(self.args)[name]

    def replace(self, **named) -> "Traits":
        """The same family's traits with some tile arguments changed (derived values follow)."""
        extra = {"acc": self.acc} if self.family.endswith("_simt") else {}
        return MAKE[self.family](**{**dict(self.args), **extra, **named}, reason=self.reason)

    def with_values(self, values: tuple[int, ...]) -> "Traits":
        """Replace the arguments after ``head_dim`` by ``values``, in order (CUFLASH_TILES)."""
        names = [n for n, _ in self.args if n != "head_dim"]
        sched = [n for n in ("persist", "lean") if n in names]   # (a schedule, not tiles:
        if 0 < len(names) - len(values) <= len(sched):           # kept where left out)
            values = (*values, *(self[n] for n in sched[len(values) - len(names):]))
        if len(values) != len(names):
            raise ValueError(f"CUFLASH_TILES for {self.family} needs {len(names)} values "
                             f"({':'.join(names)}), got {values}")
        return self.replace(**dict(zip(names, values)))

    def describe(self) -> str:
        return (", ".join(f"{n}={v}" for n, v in self.args)
                + f" -> BLOCK_M={self.block_m}, BLOCK_N={self.block_n}, {self.threads} threads, "
                  f"{self.smem_bytes} B shared memory")


def _traits(family: str, names: tuple[str, ...], values: dict, **derived) -> Traits:
    return Traits(family, tuple((n, int(values[n])) for n in names), **derived)


# ---------------------------------------------------------------------------------------------
# Constructors: one per family, deriving what the kernel's traits struct derives
# ---------------------------------------------------------------------------------------------

def fwd_sm90(head_dim, block_n, warpgroups, min_blocks=1, persist=0, lean=0, reason=""):
    """Sm90Traits: 64 query rows a warpgroup; Q + two stages of K, V, + 1 KB to align;
    ``persist`` (session 10): a block runs several query tiles in turn, with a second Q buffer
    (the next tile's Q lands during this one's last key tile; ``FWD_SM90_PERSIST``);
    ``lean`` (session 11): the analytic window's fixed costs cut (``_fwd_schedule.window_lean``;
    no tile or memory changes)."""
    bm = 64 * warpgroups
    return _traits("fwd_sm90", ("head_dim", "block_n", "warpgroups", "min_blocks", "persist", "lean"),
                   locals(), head_dim=head_dim, block_m=bm, block_n=block_n,
                   threads=128 * warpgroups,
                   smem_bytes=(bm * (2 if persist else 1) + 4 * block_n) * head_dim * 2 + 1024,
                   min_blocks=min_blocks, reason=reason)


def fwd_sm90ws(head_dim, block_n, consumers, stages, pingpong=1, poly=0, persist=0, reason=""):
    """WsTraits (fwd_sm90ws.cu): a producer and ``consumers`` warpgroups (turns: ``pingpong``; the
    softcap's exp2 tiles on FMAs: ``poly``, 0 the Variant's); Q, ``stages`` K/V, mbarriers, 1 KB;
    ``persist`` (session 17; 1 round-robin, 2 zigzag, 3 lists): a block runs query tiles in turn."""
    bm, q = 64 * consumers, 2 if persist else 1
    names = ("head_dim", "block_n", "consumers", "stages", "pingpong", "poly", "persist")
    return _traits("fwd_sm90ws", names, locals(), head_dim=head_dim, block_m=bm, block_n=block_n,
                   threads=128 * (consumers + 1), reason=reason, smem_bytes=(
                       (q * bm + 2 * stages * block_n) * head_dim * 2
                       + 8 * (1 + 4 * stages + (3 if persist else 0)) + 1024))


def fwd_sm80(head_dim, block_n, warps, slices, min_blocks=1, allow_even=True, reason=""):
    """Sm80Traits: 16-row slices, SLICES a warp; Q (reused for O) + two stages of K, V."""
    bm = 16 * slices * warps
    return _traits("fwd_sm80", ("head_dim", "block_n", "warps", "slices", "min_blocks"),
                   locals(), head_dim=head_dim, block_m=bm, block_n=block_n, threads=32 * warps,
                   smem_bytes=(bm + 4 * block_n) * head_dim * 2, min_blocks=min_blocks,
                   allow_even=allow_even, reason=reason)


def fwd_simt(head_dim, block_m, block_n, threads, kc, vc, acc=4, reason=""):
    """SimtTraits: with vec = 16 / acc Acc values a 16-byte access, shared memory holds
    sQ (block_m x (head_dim + vec)), sP transposed (block_n x (block_m + vec)) and two staging
    buffers of max(block_n x (kc + vec), vc x head_dim)."""
    vec = 16 // acc
    stage = max(block_n * (kc + vec), vc * head_dim)
    smem = acc * (block_m * (head_dim + vec) + block_n * (block_m + vec) + 2 * stage)
    return _traits("fwd_simt", ("head_dim", "block_m", "block_n", "threads", "kc", "vc"),
                   locals(), head_dim=head_dim, block_m=block_m, block_n=block_n,
                   threads=threads, smem_bytes=smem, min_blocks=2, acc=acc, reason=reason)


def bwd_sm90(head_dim, block_m, warpgroups, min_blocks=1, reason=""):
    """BwdSm90Traits: K_j, V_j; two stages of Q_i, dO_i; dS^T (2-byte); two stages of L_i, D_i
    (float); + 1 KB to align the base to a swizzle atom."""
    bn = 64 * warpgroups
    smem = 2 * bn * head_dim * 2 + 2 * 2 * block_m * head_dim * 2 + bn * block_m * 2 \
        + 2 * 2 * block_m * 4 + 1024
    return _traits("bwd_sm90", ("head_dim", "block_m", "warpgroups", "min_blocks"), locals(),
                   head_dim=head_dim, block_m=block_m, block_n=bn, threads=128 * warpgroups,
                   smem_bytes=smem, min_blocks=min_blocks, reason=reason)


def bwd_sm80(head_dim, block_m, sub_m, warps, min_blocks=1, reason=""):
    """BwdSm80Traits: K_j, V_j; two stages of Q_i, dO_i; dS_ij^T (all 2-byte); two stages of
    L_i, D_i (float)."""
    bn = 16 * warps
    smem = 2 * bn * head_dim * 2 + 2 * 2 * block_m * head_dim * 2 + bn * block_m * 2 \
        + 2 * 2 * block_m * 4
    return _traits("bwd_sm80", ("head_dim", "block_m", "sub_m", "warps", "min_blocks"),
                   locals(), head_dim=head_dim, block_m=block_m, block_n=bn, threads=32 * warps,
                   smem_bytes=smem, min_blocks=min_blocks, reason=reason)


def bwd_simt(head_dim, block_m, block_n, threads, acc=4, reason=""):
    """BwdSimtTraits: K_j, V_j, Q_i, dO_i (pitch head_dim + 1), P_ij, dS_ij and L_i, D_i, all
    in the accumulation type."""
    m, n = block_m, block_n
    smem = acc * (2 * n * (head_dim + 1) + 2 * m * (head_dim + 1) + 2 * m * (n + 1) + 2 * m)
    return _traits("bwd_simt", ("head_dim", "block_m", "block_n", "threads"), locals(),
                   head_dim=head_dim, block_m=block_m, block_n=block_n, threads=threads,
                   smem_bytes=smem, min_blocks=2, acc=acc, reason=reason)


def decode(head_dim, rows, min_blocks=1, reason=""):
    """DecodeTraits (cuda_src/decode.cu): 128 threads; a key row is read by head_dim / 8 lanes
    (8 elements, 16 bytes of half, each), so 1024 / head_dim key groups a block, each loading 4
    keys (2 for float32) before using any; ``rows`` packed query rows (GQA group x queries).
    ``block_n`` is the keys of one iteration; ``min_blocks`` the blocks an SM holds at the
    registers ptxas reports (the split heuristic's wave size). Shared memory: every group's
    accumulators, maxima and sums."""
    groups = 128 // (head_dim // 8)
    return _traits("decode", ("head_dim", "rows"), locals(), head_dim=head_dim, block_m=rows,
                   block_n=groups * 4, threads=128, smem_bytes=groups * rows * (head_dim + 2) * 4,
                   min_blocks=min_blocks, reason=reason)


def decode_sm80(head_dim, min_blocks=1, reason=""):
    """DecodeMmaTraits (cuda_src/decode_mma.cu, helper "inference"): 4 warps, 16 packed query
    rows (the MMA's M), 16 keys a warp tile, 64 keys a block iteration; shared memory: the Q
    tile and each warp's 3 stages of (K, V) tiles of 16 x head_dim b16 elements. Its split
    heuristic fills one block an SM (``split_wave``), not the resident ``min_blocks``: one
    block keeps enough bytes in flight to saturate HBM, and more splits only add partials to
    combine (H200, bench/probes/decode_splits.py, session 6: B=1 Lk=128k, 12-16 splits 3.85
    TB/s where the resident-slot count of 29 gave 3.45; B=8 Lk=8k, 2 splits 3.60 against 4's
    3.50; B=64, 1 split 4.44)."""
    return _traits("decode_sm80", ("head_dim",), locals(), head_dim=head_dim, block_m=16,
                   block_n=64, threads=128, smem_bytes=decode_sm80_smem(head_dim),
                   min_blocks=min_blocks, split_wave=1, reason=reason)


#: decode_sm80's deep rings (decode_mma.cu's STAGES), deepest first: for grids of at most one
#: block an SM, the deepest whose shared memory fits the device (5 on an H100 / H200, 4 on an
#: A100); session 8 measured one block an SM of 3 stages (64 KB in flight) ~1-2% below two
#: blocks an SM (128 KB) and cuDNN on the H200 (bench/NOTES.md, "decode (session 9)")
DECODE_SM80_DEEP_STAGES = (5, 4)


def decode_sm80_smem(head_dim: int, stages: int = 3) -> int:
    """DecodeMmaTraits<T, head_dim, stages>::kSmemBytes: the Q tile and 4 warps' rings of
    ``stages`` (K, V) tile pairs of 16 x head_dim b16 elements."""
    tile = 16 * head_dim * 2
    return tile + 4 * stages * 2 * tile


MAKE: dict[str, Callable[..., Traits]] = {f.__name__: f for f in (
    fwd_sm90, fwd_sm90ws, fwd_sm80, fwd_simt, bwd_sm90, bwd_sm80, bwd_simt, decode, decode_sm80)}


# ---------------------------------------------------------------------------------------------
# fwd_sm90 (cuda_src/fwd_sm90.cu), keyed by head-dim bucket (multiples of 64)
# ---------------------------------------------------------------------------------------------
# * A warpgroup owns 64 rows (wgmma's M). While one warpgroup is in its softmax the others'
#   wgmma's keep the tensor cores busy, so an SM should hold several warpgroups: O takes d/2
#   registers a thread, S BLOCK_N/2, P BLOCK_N/4.
# * Independent blocks beat one large block: the warpgroups of a block meet at a barrier every
#   key tile, those of different blocks never do.
# * Fewer warpgroups a block when the grid would leave SMs idle (short Lq, few heads): the
#   dispatcher steps down from the table's count (every count is compiled).
FWD_SM90 = {
    64: fwd_sm90(64, 64, 2, 2, reason=(
        "2 warpgroups a block, 64-key tiles, <= 128 registers so two blocks share an SM "
        "(1.19-1.27x SDPA flash at L = 1k-4k, against 0.87-1.10x for one 3-warpgroup block "
        "with 128-key tiles)")),
    128: fwd_sm90(128, 64, 3, reason=(
        "O is 64 registers, so two blocks an SM do not fit; 3 warpgroups (168-register cap) "
        "with 64-key tiles (1.04-1.40x; 128-key tiles cap the block at 2 warpgroups and were "
        "slower, 0.89-1.10x)")),
    192: fwd_sm90(192, 64, 2, reason="O alone is 96 registers: 64-key tiles, 2 warpgroups"),
    256: fwd_sm90(256, 64, 2, reason=(
        "O alone is 128 registers: 64-key tiles, 2 warpgroups (shared memory: Q 64 KB + "
        "2 x (K + V) 128 KB)")),
}
# fwd_sm90ws (cuda_src/fwd_sm90ws.cu) by head-dim bucket; dispatch in cuflash/_fwd_ws.py
FWD_SM90WS = {
    64: fwd_sm90ws(64, 128, 3, 3, poly=4, reason="3 consumers (192 rows, 160 registers: S 64, O "
                   "32, P 32), 128-key tiles, 3 stages (1-3% over 2); softcap: 4/16 exp2 on FMAs"),
    128: fwd_sm90ws(128, 128, 2, 2, poly=2, reason="2 consumers (128 rows, 232 registers: S 64, O "
                    "64, P 32), 128-key tiles, 2 stages (3 lost 0-12%); softcap: 2/16 exp2 on FMAs"),
}

# ---------------------------------------------------------------------------------------------
# fwd_sm80 (cuda_src/fwd_sm80.cu), keyed by (head-dim bucket, causal): None = either
# ---------------------------------------------------------------------------------------------
# * BLOCK_M = 128 everywhere: every K/V tile brought into shared memory serves 128 query rows,
#   which halves the L2 -> SM traffic of a 64-row tile.
# * One 16-row slice a warp (8 warps) by default: two slices (4 warps x 32 rows) halve the
#   ldmatrix traffic per mma but double the S and O accumulators.
_ONE_SLICE_SMALL = ("one slice a warp, {n}-key tiles keep the kernel at <= 128 registers, so two "
                    "256-thread blocks share an SM and one block's barrier stalls hide behind "
                    "the other's")
FWD_SM80 = {
    (32, None): fwd_sm80(32, 64, 8, 1, 2, reason=_ONE_SLICE_SMALL.format(n=64)),
    (64, None): fwd_sm80(64, 32, 8, 1, 2, reason=_ONE_SLICE_SMALL.format(n=32)
                         + " (causal: two slices measured 0.81-0.95x SDPA flash, one 0.81-0.84x "
                           "but better at 1k-4k)"),
    (64, False): fwd_sm80(64, 64, 4, 2, 2, reason=(
        "two 16-row slices a warp: each K/V fragment feeds two mma's (0.96-1.03x SDPA flash "
        "against 0.85-0.90x with one slice, non-causal)")),
    (96, None): fwd_sm80(96, 64, 8, 1, reason=(
        "O d/2 and Q d/2 registers a thread, S 32 at 64 keys: 200-250 registers, one block an "
        "SM; 64-key tiles amortise the barrier and the softmax bookkeeping")),
    (128, None): fwd_sm80(128, 64, 8, 1, reason="as d = 96: one block an SM, 64-key tiles"),
    (128, False): fwd_sm80(128, 32, 4, 2, 2, allow_even=False, reason=(
        "two slices fit only with 32-key tiles and Q re-read from shared memory (253 "
        "registers); the EVEN build of this configuration spills 20 bytes, so it always runs "
        "predicated")),
    (160, None): fwd_sm80(160, 64, 8, 1, reason="one block an SM, 64-key tiles"),
    (192, None): fwd_sm80(192, 64, 8, 1, reason="one block an SM, 64-key tiles"),
    (224, None): fwd_sm80(224, 32, 8, 1, reason="O alone is 112 registers: 64-key tiles spill"),
    (256, None): fwd_sm80(256, 32, 8, 1, reason="O alone is 128 registers: 64-key tiles spill"),
}


def small_grid(t: Traits) -> Traits:
    """fwd_sm80 with 64-row tiles (4 warps of one slice): twice the blocks of a 128-row
    configuration, same registers a thread; for grids that would leave SMs idle."""
    return fwd_sm80(t.head_dim, t.block_n, 4, 1, t.min_blocks, allow_even=True,
                    reason=t.reason + "; 64-row blocks for a small grid")


# ---------------------------------------------------------------------------------------------
# fwd_simt (cuda_src/fwd_simt.cu), keyed by (accumulator bytes, head-dim bucket)
# ---------------------------------------------------------------------------------------------
# * 256 threads = 8 warps and, at <= 128 registers (__launch_bounds__(NTHREADS, 2)), 2 blocks
#   (16 warps) an SM, enough to hide the global-load latency the register prefetch does not.
# * Each thread owns a 4 x TN micro-tile of S and a 4 x DN micro-tile of O; with TN = 4 and
#   16-byte shared loads, each k step issues 8 LDS.128 for 64 FMAs: the FMA pipe is the bound.
# * Shared memory stays under 64 KB, which every GPU from sm_70 grants a block.
# Measured on the H200 (float32, L = 4096): d=64 27.4, d=128 27.9, d=256 25.3 TFLOP/s, ~41% of
# the 67 TFLOP/s fp32 FMA peak (naive CuPy SGEMM-softmax-SGEMM: d=64 8.9, d=128 16.2).
#: bwd_dot_do_o's ROWS (bwd_prep.cu): the rows a lane group of its 16-bit builds loads before
#: it reduces any (bytes in flight a warp = ROWS x 32 x 32); 1 is the loop of sessions 1-13.
#: Measured on the H200 by bench/probes/bwd_passes.py (bench/NOTES.md, session 14)
DOT_ROWS = 4

SIMT_BUCKETS = (32, 64, 128, 256)


def simt_bucket(dmax: int) -> int:
    for b in SIMT_BUCKETS:
        if dmax <= b:
            return b
    raise ValueError(f"head dim {dmax} exceeds the largest bucket {SIMT_BUCKETS[-1]}")


_F = "64 x 64 tiles: every K/V element feeds 64 query rows"
FWD_SIMT = {
    (4, 32): fwd_simt(32, 64, 64, 256, 32, 64, reason=_F),
    (4, 64): fwd_simt(64, 64, 64, 256, 32, 32, reason=_F),
    (4, 128): fwd_simt(128, 64, 64, 256, 16, 8, reason=_F + "; small K/V chunks keep shared "
                       "memory under 64 KB"),
    (4, 256): fwd_simt(256, 32, 64, 256, 32, 8, reason=(
        "the resident Q tile alone would be 64 KB at 64 rows: 32 rows, a whole warp shares a "
        "row so O stays at 4 x 8 a thread")),
    (8, 32): fwd_simt(32, 64, 32, 256, 32, 32, acc=8, reason="float64: half the keys a tile"),
    (8, 64): fwd_simt(64, 64, 32, 256, 16, 8, acc=8, reason="float64: half the keys a tile"),
    (8, 128): fwd_simt(128, 32, 32, 128, 32, 8, acc=8, reason=(
        "float64: 128-thread blocks at 180-190 registers (2 blocks, 8 warps an SM)")),
    (8, 256): fwd_simt(256, 16, 32, 128, 32, 4, acc=8, reason=(
        "float64: 128-thread blocks at 180-190 registers (2 blocks, 8 warps an SM)")),
}

# ---------------------------------------------------------------------------------------------
# bwd_sm90 (cuda_src/bwd_sm90.cu), keyed by (head-dim bucket, causal)
# ---------------------------------------------------------------------------------------------
# * 2 warpgroups, so B_c = 128 keys a block: Q_i and dO_i cross from L2 once per 128 keys, and
#   dQ receives one atomic addition per 128 keys (one warpgroup of 64 keys with two blocks an SM
#   measured no faster at d = 64). One block of 256 threads an SM: registers allow no more.
# * dK_j and dV_j take HEAD_DIM registers a thread for the whole kernel, S^T and dP^T another
#   B_r: all 8 specialisations sit at 255 registers with 0 spills.
_BWD90_64 = ("B_r = 128 halves the barriers and the L_i, D_i loads per query row and doubles "
             "the wgmma N of S^T, dP^T (8-14% faster than 64 at L >= 4k; no spill since the "
             "causal mask became a separate selection pass)")
_BWD90_128 = "B_r = 64: dK, dV and S^T, dP^T fill 255 registers with no spill"
BWD_SM90 = {
    (64, False): bwd_sm90(64, 128, 2, 1, reason=_BWD90_64),
    (64, True): bwd_sm90(64, 128, 2, 1, reason=_BWD90_64),
    (128, False): bwd_sm90(128, 64, 2, 1, reason=_BWD90_128),
    (128, True): bwd_sm90(128, 64, 2, 1, reason=_BWD90_128),
}

#: The modifiers with which fwd_sm90 keeps its table's warpgroups (3 at d = 128) instead of the
#: 2 of other score-path Variants (``_variant.modifier_tiles``): softcap and ALiBi compute their
#: steps a row at a time (variant.cuh's modify_score_tile, 3-5 instructions a score), so every
#: combination of them with causal, window and sink compiles within the 168-register cap of 3
#: warpgroups with 0 spills (session 7: 148-168 registers, bench/NOTES.md "fwd modifier cost
#: (session 7)"); a bias, a mask array and the user functions keep 2 warpgroups (their loads and
#: traced code are not bounded), except a mask_mod with its block mask (next set).
FWD_SM90_FULL_WARPGROUPS = frozenset({"causal", "window", "softcap", "alibi_slopes", "sink"})
#: ... and with a block mask, a mask_mod alone or with causal, softcap, ALiBi: every mask_mod
#: of the testing kit and of the mods suite compiles so at 3 warpgroups with 0 spills (158-168
#: registers, 108 specialisations; without the block mask the documents and dilated ones spill
#: 36-96 bytes, so a mask_mod without a block mask keeps 2). A heavier user mask_mod may reach
#: the cap and spill: correct, slower.
FWD_SM90_FULL_WARPGROUPS_BLOCK_MASK = frozenset({"causal", "softcap", "alibi_slopes", "mask_mod"})
#: ... and, with a block mask, the modifiers with which fwd_sm90 keeps its table's
#: ``min_blocks`` (2 blocks an SM at d = 64, the 128-register cap of 2 warpgroups) instead of
#: the 1 of other score-path Variants (session 9): a block mask's lists at L = 4k are short (a
#: query block of 8 causal documents visits 2-8 key tiles), so a block's fixed cost (Q and the
#: first K/V loaded with nothing to overlap them, the epilogue) is a large part of it, and a
#: second block on the SM is what overlaps it. The mods suite's window, document and prefix
#: mask_mods compile at 124-128 registers, 0 spills, causal or not (at min_blocks 1 the causal
#: document build took 140 registers: one block of 8 warps an SM). Softcap or ALiBi beside a
#: mask_mod keep 1 (more live registers a score). ``CUFLASH_FWD90_BMASK_BLOCKS=1`` restores 1.
FWD_SM90_MIN_BLOCKS_BLOCK_MASK = frozenset({"causal", "mask_mod"})
#: The Variants fwd_sm90 runs PERSISTENT (session 10; ``_families.persist_wanted``,
#: ``CUFLASH_FWD90_PERSIST`` read at plan time: "0" the default since session 10's call 2,
#: "auto", "window", "all"): a grid of ``min_blocks`` blocks an SM, each running (batch item,
#: Q tile) items bid, bid + grid, ...
#: with the next item's Q and first K/V loaded during the current one's last key tile. For the
#: analytic sliding window every block visits the same ~18 key tiles (1024 keys), so each one's
#: prologue (Q, K_0, V_0 from memory) and epilogue (O staged and stored) recur every 18 tiles,
#: not every ~64 as in causal attention at 16k: the window reached 0.76-0.79x plain causal's
#: TFLOP/s on visible pairs (issue 10: >= 0.85x). Measured on the H200 (session 10, call 2) it
#: LOST: the d 128 window 0.92x (4k) and 0.94x (16k) of the non-persistent build, so it is off
#: by default; "auto" takes it where a block is alone on its SM (d = 128): the lead's ncu (session 10, FINDINGS) has the d = 64 window, 2 blocks an SM,
#: issuing as busily as causal (57.4% / 56.3% of slots): its loss is instructions (1.30x a
#: visible pair), which the schedule does not remove. Head dims <= 128 (the second Q buffer:
#: 65 KB a block at d = 64, 161 KB at d = 128; 263 KB at d = 256 does not fit).
FWD_SM90_PERSIST_FEATURES = frozenset({"causal", "window"})
#: ... and, with a block mask whose query blocks visit few keys (``Shape.bmask_keys`` below
#: ``FWD_SM90_BMASK_LONG_KEYS``: 8 causal documents at 4k visit 320 keys a block on average, 5
#: key tiles, and fixed cost was ~45% of such a block in session 9), a mask_mod alone or with
#: causal, at min_blocks 1 (d = 128; the next item's first list entry is read, and its copies
#: issued, once the current item's last tile is: at d = 64's 2 blocks an SM the loop spills).
FWD_SM90_PERSIST_BLOCK_MASK = frozenset({"causal", "mask_mod"})
FWD_SM90_PERSIST_MAX_HEAD_DIM = 128
#: The mean keys a 128-row query block of a block mask visits (``_families.Shape.bmask_keys``)
#: from which fwd_sm90 runs it at 1 block an SM's build (min_blocks 1) instead of the 2 kept for
#: short lists (session 10; ``CUFLASH_FWD90_BMASK_LONG``, "0" = session 9's rule): prefix-LM at
#: 4k (2224 keys) ran 4% slower at min_blocks 2 than at 1 (its build has 128 registers either
#: way: the same 2 blocks an SM, ptxas's schedule differs), prefix at 16k 3.5%; documents at 4k
#: (320 keys) and 16k (1088) and the window as a block mask (~1150) gain from the 2 blocks.
FWD_SM90_BMASK_LONG_KEYS = 2048
#: ... and a dense bias, alone or with causal or the sink (session 8: d = 128 at 3 warpgroups,
#: 168 registers, 0 spills, both EVEN builds; 2 warpgroups left the bias loads' latency
#: with less of the other warpgroups' wgmma to hide behind). CUFLASH_FWD_BIAS_WARPGROUPS=2
#: restores 2 (an A/B switch, _variant.modifier_tiles).
FWD_SM90_FULL_WARPGROUPS_BIAS = frozenset({"causal", "bias", "sink"})

#: The modifiers bwd_sm90 runs, per head-dim bucket: a Variant runs there when its modifiers
#: (besides causal) all lie in one of the bucket's sets, each of which compiles with 0 spills in
#: every combination (bench/NOTES.md "bwd_sm90 modifiers", session 6, and "bwd_sm90 ALiBi at
#: d=128", session 7); any other runs bwd_sm80. A set per code path (and one for the bias):
#: * the plain path (``_BWD90_PLAIN``), every bucket at the plain table's tiles: the window
#:   (bounds of the query-tile walk and the selection mask), the sink (in L_i already) and
#:   ALiBi (a constant added to the scaled score: one FFMA in P's exponent, no gradient; d = 64
#:   at B_r = 128: 254-255 registers, d = 128: 254-255, 0 spills);
#: * the per-element path (bwd_io::p_ds_pair, 64-row query tiles, ``_variant.modifier_tiles``)
#:   of softcap's chain rule and mask_mod: at d = 64 S^T, dP^T, dK_j and dV_j are 128
#:   registers a thread and the built-in transforms and a mask_mod (with or without a block
#:   mask) fit; at d = 128 they are 192 and softcap (with the window and the sink) fits, with
#:   ALiBi it spills (8-44 bytes), so softcap with ALiBi at d = 128 stays on bwd_sm80. What
#:   spills (4 to 120 bytes) stays on bwd_sm80 everywhere: the arrays read pair by pair (a bias,
#:   24 bytes with a window at d = 64; a bool mask array, 8; their 64-bit addresses per query
#:   row of the transposed tile), a score_mod (the one reading a captured table: 12-68 bytes),
#:   at d = 128 a mask_mod.
#: * the dense bias (session 8; its (item, i, j) bias reads and dbias stores per pair are
#:   p_ds_pair's, the per-element path's tiles): at d = 64 a third set, with softcap, ALiBi, the
#:   sink, causal or not (226-255 registers, 0 spills, sm_90a bf16); at d = 128 only without
#:   causal (``BWD_SM90_MODIFIERS_NONCAUSAL``), alone or with the sink (255, 0 spills; causal
#:   spills 8 bytes, with ALiBi 4). With a window it spills (24 bytes at d = 64): bwd_sm80.
_BWD90_PLAIN = frozenset({"window", "sink", "alibi_slopes"})
#: (Session 8: softcap with the window at d = 128 runs bwd_sm80 too: with the softcap computed
#: once and its tanh kept for the chain rule, the window's bounds spill 8-24 bytes there.)
BWD_SM90_MODIFIERS = {
    64: (_BWD90_PLAIN, frozenset({"window", "softcap", "alibi_slopes", "sink", "mask_mod"}),
         frozenset({"bias", "softcap", "alibi_slopes", "sink"})),
    128: (_BWD90_PLAIN, frozenset({"softcap", "sink"})),
}
#: ... and the sets a bucket adds for Variants without causal (the bias at d = 128)
BWD_SM90_MODIFIERS_NONCAUSAL = {64: (), 128: (frozenset({"bias", "sink"}),)}
#: ... and with a block mask (session 8), at d = 128 a mask_mod alone (with causal): bwd_sm80 on a
#: Hopper runs mma.sync where bwd_sm90 runs wgmma, and a block mask's backward was the suite's
#: fwd+bwd gap to FlexAttention (0.60-0.72x at d = 128, session 9). Session 10: the mask_mod's
#: mask is kept as bits on the plain path (bwd_sm90.cu kMaskBits; the per-element path spilled
#: 8-80 bytes at 255 registers), and the suite's window, document and prefix mask_mods and the
#: testing kit's compile at 254-255 registers with 0 spills, causal or not (sm_90a, bf16), but
#: the kit's documents (a division by 7: 8-20 bytes) -- a build that uses local memory on the
#: GPU goes back to bwd_sm80 (``_spills.block_mask_bwd_spilled``). ``CUFLASH_BWD90_BLOCK_MASK=0``
#: (read at plan time) restores bwd_sm80. At d = 64 the mask_mod is in the per-element set above;
#: with a block mask it keeps the table's 128-row tiles and takes the bits too (64 of them;
#: ``_variant.modifier_tiles``, 254-255 registers, 0 spills for the suite's and the kit's;
#: ``CUFLASH_BWD90_BMASK_ROWS=64``: session 9's 64-row per-element path, 215-219 registers).
BWD_SM90_BLOCK_MASK = {128: frozenset({"mask_mod"})}

# ---------------------------------------------------------------------------------------------
# bwd_sm80 (cuda_src/bwd_sm80.cu), keyed by head-dim bucket (multiples of 32, at most 128:
# above, dK_j and dV_j alone would fill the registers)
# ---------------------------------------------------------------------------------------------
# * 8 warps, so B_c = 128 keys a block; B_r = 64 query rows a tile (FA-2's 64 x 128 shape):
#   the block pays two barriers a tile and the L_i, D_i loads, which 64 rows amortise.
# * sub_m: the query rows of S^T, dP^T a warp holds at once; smaller chunks re-read the warp's
#   K_j, V_j fragments more often.
BWD_SM80 = {
    32: bwd_sm80(32, 64, 16, 8, 2, reason=(
        "16-row chunks keep it under 128 registers (122-127), so two blocks share an SM "
        "(32-row chunks spill 12 bytes at that cap)")),
    64: bwd_sm80(64, 64, 64, 8, 1, reason="the whole 64-row tile fits (233-255 registers)"),
    96: bwd_sm80(96, 64, 32, 8, 1, reason="32-row chunks (242-247 registers)"),
    128: bwd_sm80(128, 64, 16, 8, 1, reason=(
        "16-row chunks (247-255 registers); 32-row chunks spill 8-24 bytes at the 255 cap")),
}

# ---------------------------------------------------------------------------------------------
# bwd_simt (cuda_src/bwd_simt.cu), keyed by (accumulator bytes, head-dim bucket)
# ---------------------------------------------------------------------------------------------
# * Shared memory holds K_j, V_j, Q_i and dO_i in full plus P_ij, dS_ij, under the 64 KB every
#   sm_70+ GPU grants: B_c + B_r ~ 48..96 rows of float32 at HEAD_DIM 64..128.
# * Within that, B_c is the larger: each dQ element receives one atomic addition per key tile
#   (and with deterministic=True, one partial per key tile).
# * 256 threads: small accumulators (<= 48 registers of Acc values), 2+ blocks an SM.
# This is the correctness-first kernel: not tuned on a GPU.
_B = "B_c > B_r: fewer dQ additions; shared memory under 64 KB"
BWD_SIMT = {
    (4, 32): bwd_simt(32, 32, 64, 256, reason=_B),
    (4, 64): bwd_simt(64, 16, 64, 256, reason=_B),
    (4, 128): bwd_simt(128, 16, 32, 256, reason=_B),
    (4, 256): bwd_simt(256, 8, 16, 256, reason=_B),
    (8, 32): bwd_simt(32, 32, 32, 256, acc=8, reason=_B),
    (8, 64): bwd_simt(64, 16, 32, 256, acc=8, reason=_B),
    (8, 128): bwd_simt(128, 8, 16, 256, acc=8, reason=_B),
    (8, 256): bwd_simt(256, 4, 8, 256, acc=8, reason=_B),
}


# ---------------------------------------------------------------------------------------------
# decode (cuda_src/decode.cu, helper "inference"), keyed by (head-dim bucket, packed rows)
# ---------------------------------------------------------------------------------------------
# * Memory-bound: what matters is bytes in flight. A 128-thread block issues 2 x 4 x 16 bytes a
#   thread (K and V of 4 keys) before using any: 16 KB a block; at the blocks an SM below, 32-96
#   KB an SM, against the ~20 KB that 4.3 TB/s x ~600 ns needs over 132 SMs.
# * rows = the query rows a block packs (G query heads of a KV head x Lq queries), rounded up
#   to a power of two: every K/V byte is read once per group, not once per query head.
# * min_blocks: resident blocks an SM, the kernel's __launch_bounds__ (DecodeTraits::kMinBlocks;
#   ptxas on sm_90a, bf16, d = 128: 94 / 96 / 128 / 254 registers for 1 / 2 / 4 / 8 rows, no
#   spills): 5 / 5 / 4 / 2. The split heuristic fills num_sms x min_blocks slots.
_D = "head-dim bucket {0}: {1} lanes a key row, {2} keys an iteration; {3} rows packed"
DECODE = {
    (hd, rows): decode(hd, rows, {1: 5, 2: 5, 4: 4, 8: 2}[rows],
                       reason=_D.format(hd, hd // 8, 128 // (hd // 8) * 4, rows))
    for hd in (32, 64, 128, 256) for rows in (1, 2, 4, 8)
}

# decode_sm80 (cuda_src/decode_mma.cu, helper "inference"), keyed by head-dim bucket. The packed
# query rows are the M of mma.sync; K/V tiles stream through cp.async, 2 of 3 stages in flight a
# warp. ptxas (NVRTC 13, sm_90a / sm_80, bf16): 185 / 174 registers at 128, 121 / 116 at 64, no
# spills; min_blocks from shared memory (100 KB a block at 128, 52 KB at 64): 2 and 4 blocks an
# SM, ~128 KB of K/V in flight an SM either way. Steady-state loop: 14-18 instructions a 16-byte
# copy (bench/probes/decode_sass.py --hot; bench/NOTES.md "decode: the instruction budget").
_DM = "head-dim bucket {0}: 16 packed rows as the MMA's M, 64 keys an iteration, {1} blocks an SM"
DECODE_SM80 = {hd: decode_sm80(hd, mb, reason=_DM.format(hd, mb)) for hd, mb in ((64, 4), (128, 2))}

TABLES = {"fwd_sm90": FWD_SM90, "fwd_sm90ws": FWD_SM90WS, "fwd_sm80": FWD_SM80,
          "fwd_simt": FWD_SIMT, "bwd_sm90": BWD_SM90, "bwd_sm80": BWD_SM80, "bwd_simt": BWD_SIMT,
          "decode": DECODE, "decode_sm80": DECODE_SM80}
