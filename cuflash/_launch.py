"""GPU launcher: pick a kernel family, its tiles and grid, build the parameter block, launch.

Families
--------
``fwd_sm80``  (cuda_src/fwd_sm80.cu)  float16 / bfloat16 on compute capability >= 8.0:
              mma.sync tensor cores, cp.async, ldmatrix.  Head dims bucketed to multiples of 32.
``fwd_sm90``  (cuda_src/fwd_sm90.cu)  float16 / bfloat16 on Hopper (compute capability 9.0),
              max(d, dv) > 32: wgmma from shared memory, same algorithm and softmax as
              fwd_sm80.  Head dims bucketed to multiples of 64.
``fwd_simt``  (cuda_src/fwd_simt.cu)  everything else: float32 and float64 (exact paths, no
              tensor cores), and 16-bit inputs on GPUs older than sm_80.

Copies
------
No input is copied by the generic kernel: it reads any strides, including the stride-0
dimensions that broadcasting produces.  The tensor-core kernel needs each q/k/v row to be
contiguous and 16-byte aligned with a head dim that is a multiple of 8; an input that is not
is copied (only its own, un-broadcast extent) into a C-contiguous buffer whose head dim is
zero-padded to a multiple of 8.  Zero columns change neither ``q @ k.T`` nor the first ``dv``
columns of ``p @ v``.  The output and lse are written in place with any strides.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import re

import numpy

from . import _jit
from ._problem import AttentionProblem

MAX_BATCH_DIMS = 4          # kMaxBatchDims in cuda_src/common.cuh
LOG2E = 1.4426950408889634


# ---------------------------------------------------------------------------------------------
# Tiles of the tensor-core kernel, one entry per head-dim bucket
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Sm80Tiles:
    """Tiles of ``fwd_sm80`` for one head-dim bucket (template arguments, in this order)."""
    head_dim: int   # bucket: max(d, dv) rounded up to a multiple of 32
    block_n: int    # keys per K/V tile
    warps: int      # warps per block
    slices: int     # 16-row mma tiles per warp: BLOCK_M = 16 * slices * warps
    min_blocks: int = 1  # blocks per SM the register budget must allow (__launch_bounds__)
    allow_even: bool = True  # False: always the predicated kernel (its EVEN twin spills)

    @property
    def block_m(self) -> int:
        return 16 * self.slices * self.warps

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def smem_bytes(self) -> int:
        # Sm80Traits::kSmemBytes: Q tile (reused for O) + two stages of K and V, 2-byte elements
        return (self.block_m + 4 * self.block_n) * self.head_dim * 2


#: Why these tiles (H200: 228 KB shared memory and 64K registers per SM; register counts are
#: ptxas's for sm_90a, see `python -m cuflash check`; timings in bench/NOTES.md):
#: * BLOCK_M = 128 everywhere: every K/V tile brought into shared memory serves 128 query
#:   rows, which halves the L2 -> SM traffic of a 64-row tile.
#: * One 16-row slice a warp (8 warps) by default: two slices (4 warps x 32 rows) halve the
#:   ldmatrix traffic per mma, since each K/V fragment feeds two mma's, but double the S and O
#:   accumulators; only d <= 64 affords that without spilling, and there it measured faster
#:   without the causal mask only (0.96-1.03x SDPA flash against 0.85-0.90x, non-causal;
#:   0.81-0.95x against 0.81-0.84x causal at 4k and worse at 1k-4k).
#: * d <= 64, one slice: 32-64 keys a tile keep the kernel at <= 128 registers, so two
#:   256-thread blocks share an SM and one block's barrier stalls are hidden by the other's.
#: * d = 96..192: O takes d/2 registers per thread, Q in registers up to d/2 more (d <= 128),
#:   S 32 at 64 keys; 200-250 registers, so one block per SM, and 64 keys a tile amortise the
#:   barrier and the softmax bookkeeping.
#: * d = 224, 256: O alone is 112-128 registers; 64-key tiles spill, so 32 keys a tile.
SM80_TILES: dict[int, Sm80Tiles] = {
    32: Sm80Tiles(32, 64, 8, 1, 2),
    64: Sm80Tiles(64, 32, 8, 1, 2),   # causal; see SM80_TILES_NON_CAUSAL
    96: Sm80Tiles(96, 64, 8, 1),
    128: Sm80Tiles(128, 64, 8, 1),
    160: Sm80Tiles(160, 64, 8, 1),
    192: Sm80Tiles(192, 64, 8, 1),
    224: Sm80Tiles(224, 32, 8, 1),
    256: Sm80Tiles(256, 32, 8, 1),
}
#: Entries that differ when there is no causal mask. At d = 128 two slices fit only with
#: 32-key tiles and Q re-read from shared memory (253 registers); the unpredicated (EVEN)
#: build of that configuration spills 20 bytes, so it always runs the predicated one.
SM80_TILES_NON_CAUSAL: dict[int, Sm80Tiles] = {
    64: Sm80Tiles(64, 64, 4, 2, 2),
    128: Sm80Tiles(128, 32, 4, 2, 2, allow_even=False),
}
#: With few (batch, Q-tile) blocks the grid would leave SMs idle: then 4 warps of one slice
#: (BLOCK_M = 64) doubles the number of blocks (same register budget per thread).
SMALL_GRID_WARPS = 4



def small_grid(tiles: Sm80Tiles) -> Sm80Tiles:
    """64-row tiles (4 warps of one slice): twice the blocks of a 128-row configuration."""
    return dataclasses.replace(tiles, warps=SMALL_GRID_WARPS, slices=1, allow_even=True)


def sm80_tiles(bucket: int, causal: bool) -> Sm80Tiles:
    """The tiles of ``fwd_sm80`` for one head-dim bucket, with or without the causal mask."""
    if bucket in _tile_override():
        return _tile_override()[bucket]
    if not causal and bucket in SM80_TILES_NON_CAUSAL:
        return SM80_TILES_NON_CAUSAL[bucket]
    return SM80_TILES[bucket]


@functools.lru_cache(maxsize=None)
def _tile_override() -> dict[int, Sm80Tiles]:
    """Tile sweeps: ``CUFLASH_SM80_TILES="64:32:8:1:2,128:64:4:2:1"`` (head_dim:block_n:warps:
    slices:min_blocks) replaces table entries. For tuning runs only; read once per process."""
    import os
    spec = os.environ.get("CUFLASH_SM80_TILES", "")
    entries = [Sm80Tiles(*map(int, item.split(":"))) for item in spec.split(",") if item]
    return {t.head_dim: t for t in entries}


# ---------------------------------------------------------------------------------------------
# Tiles of the Hopper kernel
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Sm90Tiles:
    """Tiles of ``fwd_sm90`` for one head-dim bucket (template arguments, in this order)."""
    head_dim: int    # bucket: max(d, dv) rounded up to a multiple of 64
    block_n: int     # keys per K/V tile (the N of the S = Q K^T wgmma)
    warpgroups: int  # 64 query rows each: BLOCK_M = 64 * warpgroups
    min_blocks: int = 1

    @property
    def block_m(self) -> int:
        return 64 * self.warpgroups

    @property
    def threads(self) -> int:
        return 128 * self.warpgroups

    @property
    def smem_bytes(self) -> int:
        # Sm90Traits::kSmemBytes: Q + two stages of K and V + 1 KB to align the base
        return (self.block_m + 4 * self.block_n) * self.head_dim * 2 + 1024


#: Why these tiles (H200: 227 KB of shared memory a block, 64K registers an SM; registers are
#: ptxas's, `python -m cuflash check`; ratios are to SDPA flash in the same run, bench/NOTES.md):
#: * A warpgroup owns 64 rows (wgmma's M). While one warpgroup is in its softmax the others'
#:   wgmma's keep the tensor cores busy, so an SM should hold several warpgroups: O takes d/2
#:   registers a thread, S BLOCK_N/2, P BLOCK_N/4.
#: * Independent blocks beat one large block: the warpgroups of a block meet at a barrier every
#:   key tile, those of different blocks never do. d = 64: 2 warpgroups a block, 64-key tiles,
#:   <= 128 registers so that two blocks share an SM (1.19-1.27x at L = 1k-4k, against
#:   0.87-1.10x for one 3-warpgroup block with 128-key tiles).
#: * d = 128: O is 64 registers, so two blocks an SM do not fit; 3 warpgroups (168-register
#:   cap) with 64-key tiles (1.04-1.40x; 128-key tiles cap the block at 2 warpgroups and were
#:   slower, 0.89-1.10x).
#: * d = 192, 256: O alone is 96-128 registers, so 64-key tiles and 2 warpgroups
#:   (shared memory: Q 64 KB + 2 x (K + V) 128 KB at d = 256).
SM90_TILES: dict[int, Sm90Tiles] = {
    64: Sm90Tiles(64, 64, 2, 2),
    128: Sm90Tiles(128, 64, 3),
    192: Sm90Tiles(192, 64, 2),
    256: Sm90Tiles(256, 64, 2),
}
#: fwd_sm90 takes head dims above this; at d <= 32 the 64-column blocks would be half padding.
SM90_MIN_HEAD_DIM = 33


def sm90_tiles(bucket: int) -> Sm90Tiles:
    """The tiles of ``fwd_sm90`` for one head-dim bucket (the same with and without the causal
    mask, unlike fwd_sm80's)."""
    return _sm90_override().get(bucket, SM90_TILES[bucket])


@functools.lru_cache(maxsize=None)
def _sm90_override() -> dict[int, Sm90Tiles]:
    """Tile sweeps: ``CUFLASH_SM90_TILES="128:64:3:1"`` (head_dim:block_n:warpgroups:
    min_blocks) replaces table entries. For tuning runs only; read once per process."""
    import os
    spec = os.environ.get("CUFLASH_SM90_TILES", "")
    entries = [Sm90Tiles(*map(int, item.split(":"))) for item in spec.split(",") if item]
    return {t.head_dim: t for t in entries}


def sm90_expr(dtype, tiles: Sm90Tiles, causal: bool, even: bool) -> str:
    return (f"cuflash::sm90::fwd_sm90<{_ctype(dtype)}, {tiles.head_dim}, {tiles.block_n}, "
            f"{tiles.warpgroups}, {tiles.min_blocks}, cuflash::Variant<{_bool(causal)}>, {_bool(even)}>")


def _sm90_grid_tiles(tiles: Sm90Tiles, nbatch: int, Lq: int, num_sms: int) -> Sm90Tiles:
    """Fewer warpgroups a block when the grid would leave SMs idle (short Lq, few heads)."""
    while tiles.warpgroups > 1 and nbatch * -(-Lq // tiles.block_m) < tiles.min_blocks * num_sms:
        tiles = dataclasses.replace(tiles, warpgroups=tiles.warpgroups - 1)
    return tiles


_CTYPE = {numpy.dtype(numpy.float16): "__half", numpy.dtype(numpy.float32): "float",
          numpy.dtype(numpy.float64): "double"}


def _ctype(dtype) -> str:
    import ml_dtypes
    dtype = numpy.dtype(dtype)
    if dtype == numpy.dtype(ml_dtypes.bfloat16):
        return "__nv_bfloat16"
    return _CTYPE[dtype]


def _bool(x: bool) -> str:
    return "true" if x else "false"


def sm80_expr(dtype, tiles: Sm80Tiles, causal: bool, even: bool) -> str:
    return (f"cuflash::fwd_sm80<{_ctype(dtype)}, {tiles.head_dim}, {tiles.block_n}, "
            f"{tiles.warps}, {tiles.slices}, {tiles.min_blocks}, cuflash::Variant<{_bool(causal)}>, {_bool(even)}>")


def all_specialisations(arch: str) -> list[tuple[str, str]]:
    """Every (source, name expression) the dispatcher can select on ``arch``."""
    from ._simt_config import all_simt_specialisations
    out = [("fwd_simt.cu", e) for e in all_simt_specialisations()]
    # -- the backward (cuflash/_launch_bwd.py): the generic kernel on every arch, bwd_sm80 from
    #    sm_80 on
    from ._launch_bwd import bwd_specialisations
    out += bwd_specialisations(arch)
    cc = int(re.match(r"sm_(\d+)", arch).group(1))
    if cc >= 80:
        import ml_dtypes
        for dtype in (numpy.float16, ml_dtypes.bfloat16):
            for causal in (False, True):
                for bucket in SM80_TILES:
                    tiles = sm80_tiles(bucket, causal)
                    for t in (tiles, small_grid(tiles)):
                        for even in (False, True) if t.allow_even else (False,):
                            out.append(("fwd_sm80.cu", sm80_expr(dtype, t, causal, even)))
    if arch == "sm_90a":
        import ml_dtypes
        for dtype in (numpy.float16, ml_dtypes.bfloat16):
            for causal in (False, True):
                for bucket in SM90_TILES:
                    tiles = sm90_tiles(bucket)
                    variants = {dataclasses.replace(tiles, warpgroups=w)
                                for w in range(1, tiles.warpgroups + 1)}
                    for t in sorted(variants, key=lambda t: (t.warpgroups, t.min_blocks)):
                        for even in (False, True):
                            out.append(("fwd_sm90.cu", sm90_expr(dtype, t, causal, even)))
    return out


# ---------------------------------------------------------------------------------------------
# The parameter block of every kernel, forward and backward (cuflash::Params in
# cuda_src/common.cuh, field for field; ``var`` is cuflash::VariantParams, cuda_src/variant.cuh)
# ---------------------------------------------------------------------------------------------

_B = MAX_BATCH_DIMS
VARIANT_PARAMS = numpy.dtype([
    ("scale", "<f8"), ("scale_log2", "<f8"), ("causal_offset", "<i4"), ("pad_", "<i4"),
], align=True)
PARAMS = numpy.dtype([
    ("q", "<u8"), ("k", "<u8"), ("v", "<u8"), ("o", "<u8"), ("lse", "<u8"), ("dout", "<u8"),
    ("dpsum", "<u8"), ("dq_acc", "<u8"), ("dk_acc", "<u8"), ("dv_acc", "<u8"), ("dq_sem", "<u8"),
    ("q_batch_stride", "<i8", (_B,)), ("k_batch_stride", "<i8", (_B,)),
    ("v_batch_stride", "<i8", (_B,)), ("o_batch_stride", "<i8", (_B,)),
    ("dout_batch_stride", "<i8", (_B,)),
    ("q_row_stride", "<i8"), ("q_col_stride", "<i8"),
    ("k_row_stride", "<i8"), ("k_col_stride", "<i8"),
    ("v_row_stride", "<i8"), ("v_col_stride", "<i8"),
    ("o_row_stride", "<i8"), ("o_col_stride", "<i8"),
    ("dout_row_stride", "<i8"), ("dout_col_stride", "<i8"),
    ("dq_block_stride", "<i8"),
    ("var", VARIANT_PARAMS),
    ("batch_shape", "<i4", (_B,)),
    ("nbatch", "<i4"), ("Lq", "<i4"), ("Lk", "<i4"), ("d", "<i4"), ("dv", "<i4"),
    ("num_m_blocks", "<i4"), ("num_n_blocks", "<i4"),
    ("grid_order", "<i4"), ("out_flags", "<i4"),
], align=True)
FWD_PARAMS = PARAMS   # the forward fills its part; the backward's fields stay 0


def _elem_strides(a) -> tuple[int, ...]:
    return tuple(s // a.itemsize for s in a.strides)


def merge_batch_dims(shape, strides_per_tensor):
    """Drop extent-1 batch dims and merge neighbours that every tensor walks contiguously.

    ``strides_per_tensor`` is a list of per-tensor stride tuples over ``shape``.  Returns
    ``(shape, [strides per tensor])`` with as few dimensions as the layouts allow.
    """
    dims = [(n, [s[i] for s in strides_per_tensor]) for i, n in enumerate(shape) if n != 1]
    merged: list[tuple[int, list[int]]] = []
    for n, st in dims:
        if merged:
            pn, pst = merged[-1]
            if all(ps == s * n for ps, s in zip(pst, st)):
                merged[-1] = (pn * n, st)
                continue
        merged.append((n, st))
    shape_out = tuple(n for n, _ in merged)
    strides_out = [tuple(st[t] for _, st in merged) for t in range(len(strides_per_tensor))]
    return shape_out, strides_out


# ---------------------------------------------------------------------------------------------
# Inputs for the tensor-core kernel
# ---------------------------------------------------------------------------------------------

def _sm80_ready(x) -> bool:
    """True when ``x`` (batch..., L, d) can be read by fwd_sm80 as it is."""
    st = _elem_strides(x)
    d = x.shape[-1]
    if d % 8 or st[-1] != 1 or x.data.ptr % 16:
        return False
    return all(s % 8 == 0 for n, s in zip(x.shape[:-1], st[:-1]) if n > 1)


def _sm80_input(x):
    """``x`` itself, or a contiguous copy of its un-broadcast extent with the head dim
    zero-padded to a multiple of 8, broadcast back to ``x.shape``."""
    if _sm80_ready(x):
        return x
    import cupy
    core = x[tuple(slice(0, 1) if (s == 0 and n > 1) else slice(None)
                   for n, s in zip(x.shape[:-2], x.strides[:-2]))]
    d = x.shape[-1]
    d8 = -(-d // 8) * 8
    buf = cupy.zeros(core.shape[:-1] + (d8,), dtype=x.dtype)
    buf[..., :d] = core
    return cupy.broadcast_to(buf[..., :d], x.shape)


# ---------------------------------------------------------------------------------------------
# Dispatch
# ---------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _device_info(device_id: int) -> tuple[int, int]:
    import cupy
    dev = cupy.cuda.Device(device_id)
    return int(dev.compute_capability), dev.attributes["MultiProcessorCount"]


@dataclasses.dataclass(frozen=True)
class Launch:
    source: str
    expr: str
    block_m: int
    threads: int
    smem_bytes: int


#: ``CUFLASH_FWD=sm80`` keeps Hopper on the mma.sync kernel (tests and A/B runs cover both).
FAMILIES = ("auto", "sm80")
_family_override: str | None = None


@contextlib.contextmanager
def use_family(family: str):
    """Within the block, dispatch as if ``CUFLASH_FWD=family`` (the benchmark's cuflash_sm80)."""
    global _family_override
    if family not in FAMILIES:
        raise ValueError(f"{family=}: expected one of {FAMILIES}")
    saved, _family_override = _family_override, family
    try:
        yield
    finally:
        _family_override = saved


def _family() -> str:
    import os
    if _family_override is not None:
        return _family_override
    fam = os.environ.get("CUFLASH_FWD", "auto")
    if fam not in FAMILIES:
        raise ValueError(f"CUFLASH_FWD={fam!r}: expected one of {FAMILIES}")
    return fam


def choose(prob: AttentionProblem, nbatch: int, cc: int, num_sms: int) -> Launch:
    """The kernel, tiles and block geometry for ``prob`` on a GPU of compute capability cc."""
    import ml_dtypes
    half_types = (numpy.dtype(numpy.float16), numpy.dtype(ml_dtypes.bfloat16))
    dmax = max(prob.d, prob.dv)
    if prob.dtype in half_types and cc == 90 and dmax >= SM90_MIN_HEAD_DIM and _family() == "auto":
        bucket = -(-dmax // 64) * 64
        tiles = _sm90_grid_tiles(sm90_tiles(bucket), nbatch, prob.Lq, num_sms)
        # EVEN: whole key tiles and no padded columns (Q rows are always predicated)
        even = prob.Lk % tiles.block_n == 0 and prob.d == bucket and prob.dv == bucket
        return Launch("fwd_sm90.cu", sm90_expr(prob.dtype, tiles, prob.causal, even),
                      tiles.block_m, tiles.threads, tiles.smem_bytes)
    if prob.dtype in half_types and cc >= 80:
        bucket = max(32, -(-max(prob.d, prob.dv) // 32) * 32)
        tiles = sm80_tiles(bucket, prob.causal)
        if nbatch * -(-prob.Lq // tiles.block_m) < tiles.min_blocks * num_sms:
            tiles = small_grid(tiles)
        even = (tiles.allow_even and prob.Lq % tiles.block_m == 0
                and prob.Lk % tiles.block_n == 0 and prob.d == bucket and prob.dv == bucket)
        return Launch("fwd_sm80.cu", sm80_expr(prob.dtype, tiles, prob.causal, even),
                      tiles.block_m, tiles.threads, tiles.smem_bytes)
    from ._simt_config import simt_launch
    sl = simt_launch(prob.dtype, prob.d, prob.dv, prob.causal)
    return Launch("fwd_simt.cu", sl.expr, sl.block_m, sl.threads, sl.smem_bytes)


#: block_tile() in cuda_src/common.cuh: 0 = batch-major, 1 = tile-major (heaviest Q tiles of
#: every batch item first). The tensor-core kernels take 1 under the causal mask.
CAUSAL_GRID_ORDER = 1


def grid_order(launch: "Launch", causal: bool) -> int:
    """How the kernel maps blockIdx.x to (batch item, Q tile); ``CUFLASH_GRID_ORDER`` overrides
    it for A/B runs. fwd_simt always uses batch-major order."""
    import os
    if launch.source == "fwd_simt.cu":
        return 0
    env = os.environ.get("CUFLASH_GRID_ORDER")
    if env is not None:
        return int(env)
    return CAUSAL_GRID_ORDER if causal else 0


def forward(prob: AttentionProblem, o, lse) -> None:
    """Compute ``prob`` into ``o`` and ``lse`` (see AttentionProblem) on the inputs' GPU,
    on CuPy's current stream."""
    import cupy
    with cupy.cuda.Device(prob.device_id):
        cc, num_sms = _device_info(prob.device_id)
        q, k, v = prob.q, prob.k, prob.v
        nbatch = math.prod(prob.batch_shape)
        launch = choose(prob, nbatch, cc, num_sms)
        if launch.source in ("fwd_sm80.cu", "fwd_sm90.cu"):
            q, k, v = _sm80_input(q), _sm80_input(k), _sm80_input(v)
        kernel = _jit.get_kernel(launch.source, launch.expr, prob.device_id)
        if launch.smem_bytes > 48 * 1024 and kernel.max_dynamic_shared_size_bytes < launch.smem_bytes:
            kernel.max_dynamic_shared_size_bytes = launch.smem_bytes

        nb = len(prob.batch_shape)
        tensors = (q, k, v, o)
        shape, strides = merge_batch_dims(prob.batch_shape, [_elem_strides(t)[:nb] for t in tensors])
        # Leading dims past MAX_BATCH_DIMS: one launch per index of those (rare; no copies).
        outer = shape[:-MAX_BATCH_DIMS] if len(shape) > MAX_BATCH_DIMS else ()
        inner = shape[len(outer):]
        num_m_blocks = -(-prob.Lq // launch.block_m)
        inner_n = math.prod(inner)

        p = numpy.zeros((), dtype=FWD_PARAMS)
        for name, t in zip("qkvo", tensors):
            st = _elem_strides(t)
            p[f"{name}_row_stride"], p[f"{name}_col_stride"] = st[-2], st[-1]
        p["var"]["scale"], p["var"]["scale_log2"] = prob.scale, prob.scale * LOG2E
        p["batch_shape"] = (1,) * (MAX_BATCH_DIMS - len(inner)) + inner
        p["nbatch"] = inner_n
        p["Lq"], p["Lk"], p["d"], p["dv"] = prob.Lq, prob.Lk, prob.d, prob.dv
        p["var"]["causal_offset"] = prob.causal_offset
        p["num_m_blocks"] = num_m_blocks
        p["grid_order"] = grid_order(launch, prob.causal)
        pad = MAX_BATCH_DIMS - len(inner)
        for name, st in zip("qkvo", strides):
            p[f"{name}_batch_stride"] = (0,) * pad + st[len(outer):]
        grid = (inner_n * num_m_blocks,)
        for idx in numpy.ndindex(*outer):
            for name, t, st in zip("qkvo", tensors, strides):
                p[name] = t.data.ptr + t.itemsize * sum(i * s for i, s in zip(idx, st))
            p["lse"] = lse.data.ptr + lse.itemsize * prob.Lq * inner_n * (
                numpy.ravel_multi_index(idx, outer) if outer else 0)
            kernel(grid, (launch.threads,), (p[()],), shared_mem=launch.smem_bytes)
