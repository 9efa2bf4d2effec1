"""GPU launcher of the backward pass: kernel choice, tiles, buffers, launches.

Three kernel families compute lines 5-19 of FlashAttention-2's Algorithm 2:

``bwd_sm90``  (cuda_src/bwd_sm90.cu)  float16 / bfloat16 on Hopper (compute capability 9.0)
              with ``33 <= max(d, dv) <= 128`` (head-dim buckets 64, 128) and
              ``deterministic=False``: wgmma, the operands read by the tensor cores straight
              from shared memory (``BWD_SM90_TILES``).

``bwd_sm80``  (cuda_src/bwd_sm80.cu)  float16 / bfloat16 on compute capability >= 8.0 with
              ``max(d, dv) <= 128`` (head-dim buckets 32, 64, 96, 128): mma.sync tensor cores,
              ldmatrix, cp.async, dK_j and dV_j in registers. Also needs the device to grant
              the block's shared memory (``BWD_SM80_TILES``: up to 145 KB at d = 128; sm_80
              and sm_90 do, sm_86 / sm_89 grant 99 KB and run bwd_simt above d = 64).
``bwd_simt``  (cuda_src/bwd_simt.cu)  everything else: float32 and float64 (exact paths),
              head dims above 128, GPUs older than sm_80.

``CUFLASH_BWD=simt`` in the environment forces bwd_simt for every call, ``CUFLASH_BWD=sm80``
keeps Hopper on bwd_sm80 (read at each call; to compare them, or to fall back); unset or
``auto`` is the choice above. ``_launch.use_family("sm80")`` (the benchmark's cuflash_sm80)
keeps Hopper on bwd_sm80 too. ``deterministic=True`` runs bwd_sm80 where bwd_sm90 would run:
the ordered dQ accumulation exists there only.

Three kernels run, in this order, on CuPy's current stream:

1. ``bwd_dot_do_o<T>`` (bwd_simt.cu): ``D = rowsum(dO * O)`` into an accumulation-dtype buffer
   ``batch_shape + (Lq,)`` (line 4 of Algorithm 2), rows by grid stride over a few blocks an SM;
2. the main kernel, one block per (batch item, key tile): writes dK, dV per batch item and adds
   dQ (lines 5-19);
3. ``bwd_sum_dq<Acc>`` (bwd_simt with ``deterministic=True`` only): sums the per-key-tile
   partial dQ in key-tile order.

Memory (Acc = float32, or float64 for float64 inputs), besides the outputs:

* ``D``: ``batch_shape + (Lq,)`` Acc; ``lse`` is copied to a C-contiguous buffer if it is not
  one already (the forward returns it C-contiguous).
* ``dq``: ``batch_shape + (Lq, d)`` Acc, zero-initialised; the key tiles add into it with
  float atomics (``atomicAdd``), so the order of additions, and the last bits of dq, can
  change from run to run.
* ``dk``, ``dv``: ``batch_shape + (Lk, d)`` and ``batch_shape + (Lk, dv)`` Acc, one slice per
  *broadcast* batch item, summed afterwards with CuPy over the dimensions broadcasting added
  and rounded once to the input dtype. So grouped-query attention does materialise
  per-group dk, dv here, G times the size of the result; summing inside the kernel is future
  work. Where k (or v) is not broadcast, bwd_sm80 and bwd_sm90 write dk (dv) straight into
  the result in the input dtype instead (``Params::out_flags``): no buffer, no extra pass.
* dq is rounded into the result by one CuPy copy (after the broadcast sum, if any).
* ``deterministic=True``, bwd_sm80 (also on Hopper): the same single dq buffer, plus one int32 semaphore per
  (batch item, query tile of BLOCK_M rows): each key tile adds its dQ contribution with plain
  loads and stores once the key tiles before it have (FlashAttention-2's deterministic mode;
  the ordering argument is in cuda_src/bwd_sm80.cu). Extra memory stays
  ``O(prod(batch_shape) * Lq * d)``; every float operation happens in a fixed order, so dq,
  dk and dv are bitwise reproducible run to run (CuPy's reductions for the broadcast sums are
  deterministic too). The key tiles of a query tile then add one after another, which costs
  time: see bench/bwd_deterministic_cost.py.
* ``deterministic=True``, bwd_simt: instead of atomics, each key tile writes its dQ
  contribution to its own slice of a buffer ``(num_n_blocks,) + batch_shape + (Lq, d)`` Acc,
  with ``num_n_blocks = ceil(Lk / BLOCK_N)``, and ``bwd_sum_dq`` adds the slices in key-tile
  order 0, 1, 2, ...: also bitwise reproducible, but that buffer grows with Lq * Lk / BLOCK_N
  (1k x 1k, 32 heads, d = 128, float32: ~0.5 GB at BLOCK_N = 32).

Strides: bwd_simt reads q, k, v, o and dO in place with any strides, broadcast (stride 0)
included. bwd_sm80 needs each row of q, k, v and dO contiguous and 16-byte aligned with a
head dim that is a multiple of 8 (its cp.async loads are 16-byte chunks); an input that is not
is copied, as the forward does (bwd_sm90 the same) (``_launch._sm80_input``: only its un-broadcast extent, into a
C-contiguous buffer with the head dim zero-padded to a multiple of 8), and broadcast
dimensions stay stride 0. ``o`` is only read by ``bwd_dot_do_o`` and is never copied.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy

from . import _jit
from ._launch import MAX_BATCH_DIMS, LOG2E, PARAMS, _ctype, _elem_strides, merge_batch_dims
from ._problem import AttentionProblem, broadcast_axes
from ._simt_config import HEAD_DIM_BUCKETS, head_dim_bucket

SOURCE = "bwd_simt.cu"
PREP_SOURCE = "bwd_prep.cu"   # bwd_dot_do_o and bwd_sum_dq (the "aux" family)
#: Threads of ``bwd_dot_do_o`` and ``bwd_sum_dq`` per block (fixed in the kernels).
AUX_THREADS = 256
DOT_ROWS_PER_BLOCK = AUX_THREADS // 32   # bwd_dot_do_o: at least one query row a warp ...
DOT_BLOCKS_PER_SM = 8                    # ... and at most a full SM's threads of blocks a pass


# ---------------------------------------------------------------------------------------------
# Tiles
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class BwdTiles:
    """Free tile constants of ``bwd_simt`` (template arguments BLOCK_M, BLOCK_N, NTHREADS)."""
    block_m: int    # query rows per tile Q_i (B_r in the paper)
    block_n: int    # keys per block K_j, V_j (B_c)
    threads: int


#: Keyed by (accumulator itemsize, HEAD_DIM bucket); float16/bfloat16 accumulate and stage in
#: float32, so they share the float32 rows. Why these values:
#: * Shared memory holds K_j, V_j, Q_i and dO_i in full (pitch HEAD_DIM + 1) plus P_ij, dS_ij:
#:   ``Acc * (2 (B_c + B_r)(HEAD_DIM + 1) + 2 B_r (B_c + 1) + 2 B_r)`` bytes, which must stay
#:   under the 64 KB every sm_70+ GPU grants one block. That fixes B_c + B_r ~ 48..96 rows of
#:   float32 at HEAD_DIM 64..128, and forces small tiles at HEAD_DIM 256 and in float64.
#: * Within that, B_c (keys per block) is the larger: each dQ element receives one atomic
#:   addition per key tile, so a large B_c means fewer atomics (and, with
#:   ``deterministic=True``, a smaller partial-dQ buffer).
#: * 256 threads: the accumulators are small (<= 48 registers of Acc values a thread, see the
#:   static_assert in BwdSimtTraits), so 2 blocks (16 warps) per SM fit any GPU's register
#:   file, and more where shared memory allows (4 on sm_90).
#: Not tuned on a GPU yet: this is the correctness-first kernel (see cuda_src/bwd_simt.cu).
BWD_TILES: dict[tuple[int, int], BwdTiles] = {
    # Acc = float (float16, bfloat16, float32)
    (4, 32): BwdTiles(block_m=32, block_n=64, threads=256),    # 42 KB
    (4, 64): BwdTiles(block_m=16, block_n=64, threads=256),    # 50 KB
    (4, 128): BwdTiles(block_m=16, block_n=32, threads=256),   # 54 KB
    (4, 256): BwdTiles(block_m=8, block_n=16, threads=256),    # 51 KB
    # Acc = double (float64)
    (8, 32): BwdTiles(block_m=32, block_n=32, threads=256),    # 51 KB
    (8, 64): BwdTiles(block_m=16, block_n=32, threads=256),    # 59 KB
    (8, 128): BwdTiles(block_m=8, block_n=16, threads=256),    # 52 KB
    (8, 256): BwdTiles(block_m=4, block_n=8, threads=256),     # 50 KB
}

MAX_SMEM_BYTES = 64 * 1024      # must match the static_assert in BwdSimtTraits
STATIC_SMEM_LIMIT = 48 * 1024   # above this the launcher must opt in


def bwd_smem_bytes(acc_itemsize: int, head_dim: int, tiles: BwdTiles) -> int:
    """Dynamic shared memory of one ``bwd_simt`` block; must equal ``BwdSimtTraits::SMEM_BYTES``."""
    m, n = tiles.block_m, tiles.block_n
    return acc_itemsize * (2 * n * (head_dim + 1) + 2 * m * (head_dim + 1) + 2 * m * (n + 1) + 2 * m)


def _acc_itemsize(dtype) -> int:
    return 8 if numpy.dtype(dtype) == numpy.float64 else 4


def _acc_ctype(dtype) -> str:
    return "double" if _acc_itemsize(dtype) == 8 else "float"


def _b(x: bool) -> str:
    return "true" if x else "false"


def _variant(causal: bool) -> str:
    """The score pipeline's template argument (cuda_src/variant.cuh)."""
    return f"cuflash::Variant<{_b(causal)}>"


def main_expr(dtype, head_dim: int, causal: bool, deterministic: bool, tiles: BwdTiles) -> str:
    return (f"cuflash::bwd_simt<{_ctype(dtype)}, {head_dim}, {_variant(causal)}, {_b(deterministic)}, "
            f"{tiles.block_m}, {tiles.block_n}, {tiles.threads}>")


def dot_expr(dtype) -> str:
    return f"cuflash::bwd_dot_do_o<{_ctype(dtype)}>"


def sum_expr(dtype) -> str:
    return f"cuflash::bwd_sum_dq<{_acc_ctype(dtype)}>"


def _dtypes():
    import ml_dtypes
    return tuple(numpy.dtype(t) for t in (numpy.float16, ml_dtypes.bfloat16, numpy.float32,
                                          numpy.float64))


def all_bwd_specialisations() -> list[str]:
    """Every name expression in ``bwd_simt.cu`` the launcher can select (any arch)."""
    out = []
    for dtype in _dtypes():
        out.append(dot_expr(dtype))
        for hd in HEAD_DIM_BUCKETS:
            tiles = BWD_TILES[(_acc_itemsize(dtype), hd)]
            for causal in (False, True):
                for det in (False, True):
                    out.append(main_expr(dtype, hd, causal, det, tiles))
    for acc in ("float", "double"):
        out.append(f"cuflash::bwd_sum_dq<{acc}>")
    return out


# ---------------------------------------------------------------------------------------------
# The tensor-core backward (cuda_src/bwd_sm80.cu)
# ---------------------------------------------------------------------------------------------

SM80_SOURCE = "bwd_sm80.cu"
#: Largest head dim (max(d, dv)) bwd_sm80 takes; above it dK_j and dV_j alone would fill the
#: registers (HEAD_DIM floats a thread), so larger head dims run bwd_simt.
SM80_MAX_HEAD_DIM = 128


@dataclasses.dataclass(frozen=True)
class BwdSm80Tiles:
    """Tiles of ``bwd_sm80`` for one head-dim bucket (template arguments, in this order)."""
    head_dim: int    # bucket: max(d, dv) rounded up to a multiple of 32, at most 128
    block_m: int     # query rows per tile Q_i (B_r)
    sub_m: int       # query rows of S^T, dP^T a warp holds at once (divides block_m)
    warps: int       # warps per block; each owns 16 keys: B_c = 16 * warps
    min_blocks: int  # blocks per SM the register budget must allow (__launch_bounds__)

    @property
    def block_n(self) -> int:
        return 16 * self.warps

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory of one block; must equal ``BwdSm80Traits::kSmemBytes``:
        K_j, V_j; two stages of Q_i, dO_i; dS_ij^T (all 2-byte); two stages of L_i, D_i."""
        hd, m, n = self.head_dim, self.block_m, self.block_n
        return 2 * n * hd * 2 + 2 * 2 * m * hd * 2 + n * m * 2 + 2 * 2 * m * 4


#: Why these tiles (register counts are ptxas's for sm_80 / sm_90a, ``python -m cuflash check``;
#: none is tuned on a GPU yet, so CUFLASH_BWD_SM80_TILES can replace any entry):
#: * 8 warps, so B_c = 128 keys a block: Q_i and dO_i cross from L2 once per key tile, and dQ
#:   receives one atomic addition per key tile, so larger B_c means half the traffic of 64.
#: * B_r = 64 query rows a tile: the block pays two barriers per tile and L_i, D_i loads;
#:   64 rows amortise them (FlashAttention-2's 64 x 128 shape).
#: * sub_m: dK_j and dV_j take HEAD_DIM registers a thread for the whole kernel, S^T and dP^T
#:   another sub_m while a chunk of sub_m query rows is in flight; smaller chunks re-read this
#:   warp's K_j, V_j fragments more often (BLOCK_M / sub_m times a tile). d = 64: the whole
#:   64-row tile fits (233-255 registers, no spill). d = 96: 32-row chunks (242-247).
#:   d = 128: 32-row chunks spill 8-24 bytes in some specialisations at the 255-register cap,
#:   16-row chunks none (247-255 registers).
#: * d = 32: with 16-row chunks the kernel stays under 128 registers (122-127), so two blocks
#:   (16 warps) share an SM (32-row chunks spill 12 bytes at that cap).
#: Several specialisations sit at 255 registers with no spill: a new ptxas may tip them over;
#: the compile gate (tests/test_compile_gate_bwd.py) says so.
BWD_SM80_TILES: dict[int, BwdSm80Tiles] = {
    32: BwdSm80Tiles(32, 64, 16, 8, 2),
    64: BwdSm80Tiles(64, 64, 64, 8, 1),
    96: BwdSm80Tiles(96, 64, 32, 8, 1),
    128: BwdSm80Tiles(128, 64, 16, 8, 1),
}


def sm80_bucket(d: int, dv: int) -> int:
    """The head-dim bucket of bwd_sm80: max(d, dv) rounded up to a multiple of 32 (>= 32)."""
    return max(32, -(-max(d, dv) // 32) * 32)


def sm80_tiles(bucket: int) -> BwdSm80Tiles:
    """The tiles of ``bwd_sm80`` for one head-dim bucket (or CUFLASH_BWD_SM80_TILES's)."""
    return _sm80_tile_override().get(bucket, BWD_SM80_TILES[bucket])


def _sm80_tile_override() -> dict[int, BwdSm80Tiles]:
    """Tile sweeps: ``CUFLASH_BWD_SM80_TILES="128:64:32:8:1,64:64:32:8:1"`` (head_dim:block_m:
    sub_m:warps:min_blocks) replaces table entries. For tuning runs only (the compile gate checks
    the table, not these)."""
    import os
    spec = os.environ.get("CUFLASH_BWD_SM80_TILES", "")
    entries = [BwdSm80Tiles(*map(int, item.split(":"))) for item in spec.split(",") if item]
    return {t.head_dim: t for t in entries}


def sm80_expr(dtype, tiles: BwdSm80Tiles, causal: bool, deterministic: bool) -> str:
    return (f"cuflash::bwd_sm80<{_ctype(dtype)}, {tiles.head_dim}, {tiles.block_m}, "
            f"{tiles.sub_m}, {tiles.warps}, {tiles.min_blocks}, {_variant(causal)}, {_b(deterministic)}>")


def all_bwd_sm80_specialisations() -> list[str]:
    """Every name expression in ``bwd_sm80.cu`` the launcher can select (sm_80 and newer)."""
    import ml_dtypes
    return [sm80_expr(numpy.dtype(dtype), BWD_SM80_TILES[hd], causal, det)
            for dtype in (numpy.float16, ml_dtypes.bfloat16)
            for hd in sorted(BWD_SM80_TILES)
            for causal in (False, True)
            for det in (False, True)]


# ---------------------------------------------------------------------------------------------
# The Hopper backward (cuda_src/bwd_sm90.cu)
# ---------------------------------------------------------------------------------------------

SM90_SOURCE = "bwd_sm90.cu"
#: Head dims bwd_sm90 takes: from 33 (below, the 64-wide bucket would waste half the products;
#: bwd_sm80 runs them, as fwd_sm80 does in the forward) to 128 (dK_j, dV_j fill the registers).
SM90_MIN_HEAD_DIM, SM90_MAX_HEAD_DIM = 33, 128


@dataclasses.dataclass(frozen=True)
class BwdSm90Tiles:
    """Tiles of ``bwd_sm90`` for one head-dim bucket (template arguments, in this order)."""
    head_dim: int     # bucket: 64 or 128
    block_m: int      # query rows per tile Q_i (B_r); a multiple of 64
    warpgroups: int   # each owns 64 keys: B_c = 64 * warpgroups
    min_blocks: int   # blocks per SM the register budget must allow (__launch_bounds__)

    @property
    def block_n(self) -> int:
        return 64 * self.warpgroups

    @property
    def threads(self) -> int:
        return 128 * self.warpgroups

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory of one block; must equal ``BwdSm90Traits::kSmemBytes``:
        K_j, V_j; two stages of Q_i, dO_i; dS_ij^T (all 2-byte); two stages of L_i, D_i; and
        1024 bytes to align the base to a swizzle atom."""
        hd, m, n = self.head_dim, self.block_m, self.block_n
        return 2 * n * hd * 2 + 2 * 2 * m * hd * 2 + n * m * 2 + 2 * 2 * m * 4 + 1024


#: Keyed by (head-dim bucket, causal). Why these tiles (register counts are ptxas's for
#: sm_90a, ``python -m cuflash check``; timings bench/results/*-s3-bwd_sm90-probe*.json):
#: * 2 warpgroups, so B_c = 128 keys a block, as bwd_sm80: Q_i and dO_i cross from L2 once
#:   per 128 keys, and dQ receives one atomic addition per 128 keys. (One warpgroup of 64 keys
#:   with two blocks an SM measured no faster at d = 64.)
#: * B_r: dK_j and dV_j take HEAD_DIM registers a thread for the whole kernel, S^T and dP^T
#:   another B_r. d = 128: B_r = 64 (255 registers, no spill). d = 64: B_r = 128 halves the
#:   barriers and the L_i, D_i loads per query row and doubles the wgmma N of S^T, dP^T
#:   (probe 1: 8-14% faster than 64 at L >= 4k; 255 registers, no spill, since the causal
#:   mask became a separate selection pass: bench/NOTES.md).
#: * One block of 256 threads per SM: the registers allow no more.
#: CUFLASH_BWD_SM90_TILES can replace the entries of a bucket for a tuning run.
BWD_SM90_TILES: dict[tuple[int, bool], BwdSm90Tiles] = {
    (64, False): BwdSm90Tiles(64, 128, 2, 1),
    (64, True): BwdSm90Tiles(64, 128, 2, 1),
    (128, False): BwdSm90Tiles(128, 64, 2, 1),
    (128, True): BwdSm90Tiles(128, 64, 2, 1),
}


def sm90_bucket(d: int, dv: int) -> int:
    """The head-dim bucket of bwd_sm90: max(d, dv) rounded up to a multiple of 64."""
    return -(-max(d, dv) // 64) * 64


def sm90_tiles(bucket: int, causal: bool) -> BwdSm90Tiles:
    """The tiles of ``bwd_sm90`` for one head-dim bucket (or CUFLASH_BWD_SM90_TILES's:
    ``"64:128:2:1,128:64:2:1"``, head_dim:block_m:warpgroups:min_blocks, for both causal
    values; tuning runs only, the compile gate checks the table)."""
    import os
    spec = os.environ.get("CUFLASH_BWD_SM90_TILES", "")
    entries = [BwdSm90Tiles(*map(int, item.split(":"))) for item in spec.split(",") if item]
    return {t.head_dim: t for t in entries}.get(bucket, BWD_SM90_TILES[(bucket, bool(causal))])


def sm90_expr(dtype, tiles: BwdSm90Tiles, causal: bool) -> str:
    return (f"cuflash::sm90::bwd_sm90<{_ctype(dtype)}, {tiles.head_dim}, {tiles.block_m}, "
            f"{tiles.warpgroups}, {tiles.min_blocks}, {_variant(causal)}>")


def all_bwd_sm90_specialisations() -> list[str]:
    """Every name expression in ``bwd_sm90.cu`` the launcher can select (sm_90a)."""
    import ml_dtypes
    return [sm90_expr(numpy.dtype(dtype), BWD_SM90_TILES[key], key[1])
            for dtype in (numpy.float16, ml_dtypes.bfloat16)
            for key in sorted(BWD_SM90_TILES)]


def bwd_specialisations(arch: str) -> list[tuple[str, str]]:
    """Every (source, name expression) of the backward the launcher can select on ``arch``
    (e.g. ``"sm_90a"``): bwd_simt's everywhere, bwd_sm80's from sm_80 on, bwd_sm90's on
    sm_90a."""
    import re
    out = [(PREP_SOURCE if e.startswith(("cuflash::bwd_dot_do_o", "cuflash::bwd_sum_dq")) else SOURCE, e)
           for e in all_bwd_specialisations()]
    if int(re.match(r"sm_(\d+)", arch).group(1)) >= 80:
        out += [(SM80_SOURCE, e) for e in all_bwd_sm80_specialisations()]
    if arch == "sm_90a":
        out += [(SM90_SOURCE, e) for e in all_bwd_sm90_specialisations()]
    return out


# ---------------------------------------------------------------------------------------------
# The parameter block: cuflash::Params (PARAMS in _launch.py), shared with the forward
# ---------------------------------------------------------------------------------------------

_B = MAX_BATCH_DIMS
_TENSORS = ("q", "k", "v", "o", "dout")   # the strided tensors, in Params order
DK_OUT, DV_OUT = 1, 2                      # Params::out_flags (kBwdDkOut, kBwdDvOut)
BWD_PARAMS = PARAMS   # cuflash::Params: one parameter block for forward and backward


@dataclasses.dataclass(frozen=True)
class BwdLaunch:
    """The kernels and geometry of one backward call."""
    source: str       # SOURCE (bwd_simt.cu), SM80_SOURCE or SM90_SOURCE: the main kernel's
    main: str
    dot: str          # bwd_dot_do_o, always from bwd_prep.cu
    dq_sum: str       # bwd_sum_dq (bwd_simt with deterministic=True only)
    block_m: int
    block_n: int
    threads: int
    smem_bytes: int

    @property
    def sm80(self) -> bool:
        return self.source == SM80_SOURCE

    @property
    def tensor_cores(self) -> bool:
        """bwd_sm80 or bwd_sm90: cp.async loads, 16-byte rows (see the module docstring)."""
        return self.source in (SM80_SOURCE, SM90_SOURCE)

    def num_n_blocks(self, Lk: int) -> int:
        return -(-int(Lk) // self.block_n)

    def num_m_blocks(self, Lq: int) -> int:
        return -(-int(Lq) // self.block_m)


def kernel_family() -> str:
    """``CUFLASH_BWD`` from the environment: ``"auto"`` (unset or empty), ``"sm80"`` or
    ``"simt"``; ``"sm80"`` also inside ``_launch.use_family("sm80")``."""
    import os
    from . import _launch
    value = os.environ.get("CUFLASH_BWD", "").strip().lower() or "auto"
    if value not in ("auto", "sm80", "simt"):
        raise ValueError(f"CUFLASH_BWD must be 'auto', 'sm80' or 'simt' (or unset), got {value!r}")
    if value == "auto" and _launch._family_override == "sm80":
        return "sm80"
    return value


def _half(dtype) -> bool:
    import ml_dtypes
    return numpy.dtype(dtype) in (numpy.dtype(numpy.float16), numpy.dtype(ml_dtypes.bfloat16))


def uses_sm80(dtype, d: int, dv: int, cc: int, smem_optin: int) -> bool:
    """Whether the backward of a (dtype, d, dv) problem can run bwd_sm80 on a GPU of compute
    capability ``cc`` (e.g. 90) that grants ``smem_optin`` bytes of shared memory a block."""
    if kernel_family() == "simt" or cc < 80 or not _half(dtype):
        return False
    if max(d, dv) > SM80_MAX_HEAD_DIM:
        return False
    return sm80_tiles(sm80_bucket(d, dv)).smem_bytes <= smem_optin


def uses_sm90(dtype, d: int, dv: int, cc: int, smem_optin: int, deterministic: bool) -> bool:
    """Whether the backward runs bwd_sm90 (Hopper, fp16/bf16, 33 <= max(d, dv) <= 128,
    atomics for dQ)."""
    if kernel_family() != "auto" or cc != 90 or not _half(dtype) or deterministic:
        return False
    if not SM90_MIN_HEAD_DIM <= max(d, dv) <= SM90_MAX_HEAD_DIM:
        return False
    return max(sm90_tiles(sm90_bucket(d, dv), c).smem_bytes for c in (False, True)) <= smem_optin


def choose(prob: AttentionProblem, deterministic: bool, cc: int = 0,
           smem_optin: int = 0) -> BwdLaunch:
    """The specialisations and tiles of the backward for ``prob`` on a GPU of compute
    capability ``cc`` granting ``smem_optin`` bytes of shared memory a block (the defaults
    select bwd_simt)."""
    dot, dq_sum = dot_expr(prob.dtype), sum_expr(prob.dtype)
    if uses_sm90(prob.dtype, prob.d, prob.dv, cc, smem_optin, deterministic):
        t = sm90_tiles(sm90_bucket(prob.d, prob.dv), prob.causal)
        return BwdLaunch(SM90_SOURCE, sm90_expr(prob.dtype, t, prob.causal),
                         dot, dq_sum, t.block_m, t.block_n, t.threads, t.smem_bytes)
    if uses_sm80(prob.dtype, prob.d, prob.dv, cc, smem_optin):
        t = sm80_tiles(sm80_bucket(prob.d, prob.dv))
        return BwdLaunch(SM80_SOURCE, sm80_expr(prob.dtype, t, prob.causal, deterministic),
                         dot, dq_sum, t.block_m, t.block_n, t.threads, t.smem_bytes)
    hd = head_dim_bucket(prob.d, prob.dv)
    acc = _acc_itemsize(prob.dtype)
    tiles = BWD_TILES[(acc, hd)]
    return BwdLaunch(SOURCE, main_expr(prob.dtype, hd, prob.causal, deterministic, tiles),
                     dot, dq_sum, tiles.block_m, tiles.block_n, tiles.threads,
                     bwd_smem_bytes(acc, hd, tiles))


@functools.lru_cache(maxsize=None)
def _kernel(source: str, expr: str, device_id: int, smem_bytes: int):
    kernel = _jit.get_kernel(source, expr, device_id)
    if smem_bytes > STATIC_SMEM_LIMIT and kernel.max_dynamic_shared_size_bytes < smem_bytes:
        kernel.max_dynamic_shared_size_bytes = smem_bytes
    return kernel


@functools.lru_cache(maxsize=None)
def _smem_optin(device_id: int) -> int:
    """Bytes of shared memory one block may opt in to on the device."""
    import cupy
    rt = cupy.cuda.runtime
    return int(rt.deviceGetAttribute(rt.cudaDevAttrMaxSharedMemoryPerBlockOptin, device_id))


def backward(prob: AttentionProblem, do, o, lse, dq, dk, dv, *, deterministic: bool) -> None:
    """Write the gradients of ``prob`` into ``dq``, ``dk``, ``dv`` (CuPy arrays of the
    un-broadcast shapes of q, k, v, dtype ``prob.dtype``) on the inputs' GPU, on CuPy's current
    stream. ``prob.Lq``, ``prob.Lk`` and every batch dimension must be >= 1."""
    import cupy
    from ._launch import _device_info, _sm80_input
    with cupy.cuda.Device(prob.device_id):
        cc, num_sms = _device_info(prob.device_id)
        launch = choose(prob, deterministic, cc, _smem_optin(prob.device_id))
        acc = numpy.dtype(numpy.float64 if _acc_itemsize(prob.dtype) == 8 else numpy.float32)
        nbatch = math.prod(prob.batch_shape)
        num_n_blocks = launch.num_n_blocks(prob.Lk)
        num_m_blocks = launch.num_m_blocks(prob.Lq)
        Lq, Lk, d, d_v = prob.Lq, prob.Lk, prob.d, prob.dv

        q, k, v = prob.q, prob.k, prob.v
        if launch.tensor_cores:   # 16-byte rows for cp.async (a copy only where a layout lacks them)
            q, k, v, do = (_sm80_input(x) for x in (q, k, v, do))
        lse = cupy.ascontiguousarray(lse)
        dpsum = cupy.empty(prob.batch_shape + (Lq,), acc)
        dq_parts = num_n_blocks if (deterministic and not launch.tensor_cores) else 1
        dq_acc = cupy.zeros((dq_parts,) + prob.batch_shape + (Lq, d), acc)
        # The tensor-core kernels write dk, dv straight into the result where no broadcast
        # dimension needs summing (the result then has every batch item, C-contiguous)
        dk_direct = launch.tensor_cores and dk.size == nbatch * Lk * d
        dv_direct = launch.tensor_cores and dv.size == nbatch * Lk * d_v
        dk_acc = dk if dk_direct else cupy.empty(prob.batch_shape + (Lk, d), acc)
        dv_acc = dv if dv_direct else cupy.empty(prob.batch_shape + (Lk, d_v), acc)
        # bwd_sm80, deterministic: one counter per (batch item, query tile), zeroed
        semaphore = (cupy.zeros(nbatch * num_m_blocks, numpy.int32)
                     if deterministic and launch.sm80 else None)

        tensors = (q, k, v, o, do)
        nb = len(prob.batch_shape)
        shape, strides = merge_batch_dims(prob.batch_shape,
                                          [_elem_strides(t)[:nb] for t in tensors])
        # Leading dims past MAX_BATCH_DIMS: one launch per index of those (rare; no copies).
        outer = shape[:-MAX_BATCH_DIMS] if len(shape) > MAX_BATCH_DIMS else ()
        inner = shape[len(outer):]
        inner_n = math.prod(inner)

        p = numpy.zeros((), dtype=BWD_PARAMS)
        for name, t in zip(_TENSORS, tensors):
            st = _elem_strides(t)
            p[f"{name}_row_stride"], p[f"{name}_col_stride"] = st[-2], st[-1]
        pad = MAX_BATCH_DIMS - len(inner)
        for name, st in zip(_TENSORS, strides):
            p[f"{name}_batch_stride"] = (0,) * pad + st[len(outer):]
        p["dq_block_stride"] = nbatch * Lq * d if dq_parts > 1 else 0
        p["var"]["scale"], p["var"]["scale_log2"] = prob.scale, prob.scale * LOG2E
        p["batch_shape"] = (1,) * pad + inner
        p["nbatch"] = inner_n
        p["Lq"], p["Lk"], p["d"], p["dv"] = Lq, Lk, d, d_v
        p["var"]["causal_offset"] = prob.causal_offset
        p["num_m_blocks"], p["num_n_blocks"] = num_m_blocks, num_n_blocks
        p["out_flags"] = (DK_OUT if dk_direct else 0) | (DV_OUT if dv_direct else 0)
        p["grid_order"] = grid_order(launch, prob.causal)

        dot = _kernel(PREP_SOURCE, launch.dot, prob.device_id, 0)
        main = _kernel(launch.source, launch.main, prob.device_id, launch.smem_bytes)
        for idx in numpy.ndindex(*outer):
            for name, t, st in zip(_TENSORS, tensors, strides):
                p[name] = t.data.ptr + t.itemsize * sum(i * s for i, s in zip(idx, st))
            first = inner_n * (numpy.ravel_multi_index(idx, outer) if outer else 0)  # batch item
            p["lse"] = lse.data.ptr + lse.itemsize * first * Lq
            p["dpsum"] = dpsum.data.ptr + dpsum.itemsize * first * Lq
            p["dq_acc"] = dq_acc.data.ptr + dq_acc.itemsize * first * Lq * d
            p["dk_acc"] = dk_acc.data.ptr + dk_acc.itemsize * first * Lk * d
            p["dv_acc"] = dv_acc.data.ptr + dv_acc.itemsize * first * Lk * d_v
            # -- 4: D = rowsum(dO o O)
            dot_blocks = min(-(-inner_n * Lq // DOT_ROWS_PER_BLOCK), DOT_BLOCKS_PER_SM * num_sms)
            dot((max(1, dot_blocks),), (AUX_THREADS,), (p[()],))   # rows by grid stride
            # -- 5-19: one block per (batch item, key tile)
            grid = (inner_n * num_n_blocks,)
            p["dq_sem"] = 0 if semaphore is None else semaphore.data.ptr + 4 * first * num_m_blocks
            main(grid, (launch.threads,), (p[()],), shared_mem=launch.smem_bytes)

        if dq_parts > 1:
            dq_sum = _kernel(PREP_SOURCE, launch.dq_sum, prob.device_id, 0)
            total = dq_acc.size // dq_parts
            summed = cupy.empty(prob.batch_shape + (Lq, d), acc)
            blocks = max(1, min(-(-total // AUX_THREADS), 65535))
            dq_sum((blocks,), (AUX_THREADS,),
                   (dq_acc, summed, numpy.int64(total), numpy.int32(num_n_blocks)))
        else:
            summed = dq_acc[0]
        _sum_into(dq, summed)
        if not dk_direct:
            _sum_into(dk, dk_acc)
        if not dv_direct:
            _sum_into(dv, dv_acc)


def grid_order(launch: BwdLaunch, causal: bool) -> int:
    """How bwd_sm90 maps blockIdx.x to (batch item, key tile) (common.cuh: bwd_block_tile):
    tile-major (1) under a causal mask, so that the heaviest key tiles of all batch items run
    first, else batch-major (0); ``CUFLASH_GRID_ORDER`` overrides it for A/B runs, as in the
    forward. The other kernels are always batch-major (bwd_sm80's deterministic ordering
    argument is written for that order)."""
    import os
    if launch.source != SM90_SOURCE:
        return 0
    env = os.environ.get("CUFLASH_GRID_ORDER")
    if env is not None:
        return int(env)
    return 1 if causal else 0


def _sum_into(out, acc) -> None:
    """``out[...] = acc`` summed over the dimensions broadcasting added to ``out.shape``, in
    acc's dtype, rounded once to out's dtype by the copy (one pass over acc where nothing is
    summed)."""
    axes = broadcast_axes(tuple(out.shape), tuple(acc.shape))
    if axes:
        acc = acc.sum(axis=axes, keepdims=True)
    out[...] = acc.reshape(out.shape)
