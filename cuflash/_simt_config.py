"""Launch configuration of the generic SIMT forward kernel (``cuda_src/fwd_simt.cu``).

This module is the one place where the kernel's tile sizes are chosen. They reach the kernel
as template arguments inside the NVRTC name expression::

    cuflash::fwd_simt<T, HEAD_DIM, cuflash::Variant<CAUSAL>, BLOCK_M, BLOCK_N, NTHREADS, KC, VC>

and ``SimtTraits`` in the .cu file derives every other constant from them and
``static_assert``s the rules (thread grid, bank-conflict-free pitches, the 64 KB shared-memory
cap, the register budget), so a bad choice here fails to compile instead of running wrong.
The only formula duplicated on both sides is the shared-memory byte count
(:func:`simt_smem_bytes` here, ``SimtTraits::SMEM_BYTES`` there); the kernel traps if it is
launched with less dynamic shared memory than it needs, so a drift cannot go unnoticed.

Launch contract (for ``_launch.py``)
------------------------------------
* ``block = (threads, 1, 1)``; ``grid = (nbatch * num_m_blocks, 1, 1)`` with
  ``num_m_blocks = ceil(Lq / block_m)``, which also goes into ``Params.num_m_blocks``.
* Dynamic shared memory: ``smem_bytes`` (the kernel has no static shared memory). When it
  exceeds 48 KB (49152 bytes) set ``kernel.max_dynamic_shared_size_bytes = smem_bytes`` before
  launching; every configuration is at most 64 KB, which every GPU from sm_70 grants.
* Strides may be anything (0 for broadcast, non-unit column strides): the kernel uses scalar,
  bounds-checked loads and stores, so there is no contiguity variant to choose.
* Inputs are read through the read-only cache (``__ldg``): ``o`` and ``lse`` must not overlap
  ``q``, ``k`` or ``v``.
"""

from __future__ import annotations

import dataclasses

import numpy

__all__ = [
    "HEAD_DIM_BUCKETS",
    "MIN_BLOCKS_PER_SM",
    "SimtLaunch",
    "SimtTiles",
    "all_simt_specialisations",
    "head_dim_bucket",
    "simt_launch",
    "simt_smem_bytes",
]

# Head-dimension buckets: the kernel is instantiated for HEAD_DIM in this tuple, and handles
# any d, dv <= HEAD_DIM with masked loads and stores.
HEAD_DIM_BUCKETS = (32, 64, 128, 256)

# Largest dynamic shared memory a block may use on every GPU from sm_70 (sm_75 caps it here).
# Must match the static_assert in SimtTraits.
MAX_SMEM_BYTES = 64 * 1024
STATIC_SMEM_LIMIT = 48 * 1024   # above this the launcher must opt in
# __launch_bounds__(NTHREADS, MIN_BLOCKS_PER_SM) in fwd_simt.cu: ptxas keeps each kernel
# within 65536 / (threads * 2) registers (at most 255), so two blocks fit on an SM.
MIN_BLOCKS_PER_SM = 2


@dataclasses.dataclass(frozen=True)
class SimtTiles:
    """Free tile constants of one specialisation (template arguments of ``fwd_simt``).

    block_m:  query rows per thread block (BLOCK_M)
    block_n:  keys per tile of K_j, V_j (BLOCK_N)
    threads:  threads per block (NTHREADS); each owns 4 query rows
    kc:       features of K_j staged per chunk (KC)
    vc:       keys of V_j staged per chunk (VC)
    """

    block_m: int
    block_n: int
    threads: int
    kc: int
    vc: int


# The tile table, keyed by (accumulator itemsize, HEAD_DIM). float16 and bfloat16 accumulate
# in float32 and stage in float32, so they share the float32 rows.
#
# Why these values (H200 numbers; the same shapes are sane on sm_70..sm_90):
# * 256 threads = 8 warps and, at <= 128 registers (__launch_bounds__(NTHREADS, 2)), 2 blocks
#   (16 warps) per SM, enough to hide the global-load latency that the register prefetch does
#   not cover. ptxas (sm_70..sm_90a) gives 114-128 registers, 0 spills, for every float row.
# * Each thread owns a 4 x TN micro-tile of S and a 4 x DN micro-tile of O; with TN = 4 and
#   16-byte shared loads, each k step issues 8 LDS.128 for 64 FMAs, so the FMA pipe (not the
#   shared-memory pipe) is the bound.
# * block_m = block_n = 64 for HEAD_DIM <= 128 in float32: every K/V element fetched feeds 64
#   query rows. Shared memory BLOCK_M*(D+4) + BLOCK_N*(BLOCK_M+4) + 2*stage floats must stay
#   under 64 KB, which forces the small K/V chunks (kc, vc) at HEAD_DIM = 128.
# * HEAD_DIM = 256 (float32): the resident Q tile alone would be 64 KB at block_m = 64, so
#   block_m = 32, and a whole warp (THREADS_N = 32) shares a row so O stays at 4 x 8 per thread.
# * float64: twice the bytes per value, so the tiles shrink to keep shared memory under
#   64 KB and registers (2 per double) under 255 without spills; HEAD_DIM 128 and 256 run
#   128-thread blocks at 180-190 registers (2 blocks, 8 warps per SM).
#
# Measured on the H200 (median of 5, CUDA events; B*L = 16k tokens, H*d = 2048, L = 4096):
#   float32 non-causal  d=32 24.3, d=64 27.4, d=128 27.9, d=256 25.3 TFLOP/s
#                       (naive CuPy SGEMM-softmax-SGEMM: d=32 4.8, d=64 8.9, d=128 16.2)
#   float32 causal      d=64 25.6, d=128 27.0
#   float64 d=64 12.4 (naive 8.4);  bfloat16 inputs (GPUs without the tensor-core kernel) d=64 21.8
# i.e. ~41% of the 67 TFLOP/s fp32 FMA peak. Alternatives tried: d=128 block_n=32 26.2, d=128
# block_m=32 with 128 threads 28.1 (no better); d=64 kc=vc=16 26.0; P~V unrolled by 2 instead
# of 4: d=64 26.6.
_TILES: dict[tuple[int, int], SimtTiles] = {
    # Acc = float (float16, bfloat16, float32)
    (4, 32): SimtTiles(block_m=64, block_n=64, threads=256, kc=32, vc=64),
    (4, 64): SimtTiles(block_m=64, block_n=64, threads=256, kc=32, vc=32),
    (4, 128): SimtTiles(block_m=64, block_n=64, threads=256, kc=16, vc=8),
    (4, 256): SimtTiles(block_m=32, block_n=64, threads=256, kc=32, vc=8),
    # Acc = double (float64)
    (8, 32): SimtTiles(block_m=64, block_n=32, threads=256, kc=32, vc=32),
    (8, 64): SimtTiles(block_m=64, block_n=32, threads=256, kc=16, vc=8),
    (8, 128): SimtTiles(block_m=32, block_n=32, threads=128, kc=32, vc=8),
    (8, 256): SimtTiles(block_m=16, block_n=32, threads=128, kc=32, vc=4),
}

# numpy dtype name -> (C++ type name as NVRTC must see it, accumulator itemsize)
_CTYPES = {
    "float16": ("__half", 4),
    "bfloat16": ("__nv_bfloat16", 4),
    "float32": ("float", 4),
    "float64": ("double", 8),
}


@dataclasses.dataclass(frozen=True)
class SimtLaunch:
    """Everything needed to launch one specialisation of ``cuflash::fwd_simt``.

    expr:        NVRTC name expression (pass it in ``name_expressions`` and to
                 ``RawModule.get_function``), e.g.
                 ``cuflash::fwd_simt<float, 64, false, 64, 64, 256, 32, 32>``
    block_m:     query rows per block: ``num_m_blocks = ceil(Lq / block_m)``
    threads:     threads per block (1-D)
    smem_bytes:  dynamic shared memory per block; opt in above 48 KB
    head_dim:    the HEAD_DIM bucket (>= max(d, dv))
    lse_dtype:   dtype of the lse buffer the kernel writes (float32, or float64 for float64)
    """

    expr: str
    block_m: int
    threads: int
    smem_bytes: int
    head_dim: int
    lse_dtype: numpy.dtype

    def num_m_blocks(self, lq: int) -> int:
        return -(-int(lq) // self.block_m)

    def grid(self, nbatch: int, lq: int) -> tuple[int, int, int]:
        return (int(nbatch) * self.num_m_blocks(lq), 1, 1)

    @property
    def needs_smem_opt_in(self) -> bool:
        return self.smem_bytes > STATIC_SMEM_LIMIT

    @property
    def register_budget(self) -> int:
        """Most registers per thread ptxas may use (the compile gate can check it)."""
        return min(255, 65536 // (self.threads * MIN_BLOCKS_PER_SM))


def head_dim_bucket(d: int, dv: int) -> int:
    """Smallest HEAD_DIM bucket holding both ``d`` and ``dv``."""
    need = max(int(d), int(dv))
    if min(int(d), int(dv)) < 1:
        raise ValueError(f"head dimensions must be >= 1, got {d=} and {dv=}")
    for hd in HEAD_DIM_BUCKETS:
        if need <= hd:
            return hd
    raise ValueError(f"head dimension {need} exceeds the largest supported ({HEAD_DIM_BUCKETS[-1]}); got {d=} and {dv=}")


def simt_smem_bytes(acc_itemsize: int, head_dim: int, tiles: SimtTiles) -> int:
    """Dynamic shared memory of one block; must equal ``SimtTraits::SMEM_BYTES``.

    With ``vec = 16 // acc_itemsize`` (Acc values per 16-byte access)::

        acc_itemsize * ( block_m * (head_dim + vec)                       # sQ
                       + block_n * (block_m + vec)                        # sP (transposed)
                       + 2 * max(block_n * (kc + vec), vc * head_dim) )   # K/V staging x2
    """
    vec = 16 // acc_itemsize
    t = tiles
    stage = max(t.block_n * (t.kc + vec), t.vc * head_dim)
    return acc_itemsize * (t.block_m * (head_dim + vec) + t.block_n * (t.block_m + vec) + 2 * stage)


def _ctype(dtype) -> tuple[str, int]:
    dt = numpy.dtype(dtype)
    try:
        return _CTYPES[dt.name]
    except KeyError:
        raise TypeError(f"fwd_simt supports float16, bfloat16, float32 and float64, got {dt}") from None


def _expr(ctype: str, head_dim: int, causal: bool, t: SimtTiles) -> str:
    return (f"cuflash::fwd_simt<{ctype}, {head_dim}, cuflash::Variant<{'true' if causal else 'false'}>, "
            f"{t.block_m}, {t.block_n}, {t.threads}, {t.kc}, {t.vc}>")


def simt_launch(dtype, d: int, dv: int, causal: bool, contiguous: bool = False) -> SimtLaunch:
    """Pick the specialisation of ``fwd_simt`` for one problem.

    ``dtype`` is the dtype of q, k, v and o (numpy float16, ``ml_dtypes.bfloat16``, float32 or
    float64). ``contiguous`` is accepted for interface stability and ignored: the kernel has a
    single, any-stride load path.
    """
    del contiguous
    ctype, acc = _ctype(dtype)
    hd = head_dim_bucket(d, dv)
    tiles = _TILES[(acc, hd)]
    return SimtLaunch(
        expr=_expr(ctype, hd, bool(causal), tiles),
        block_m=tiles.block_m,
        threads=tiles.threads,
        smem_bytes=simt_smem_bytes(acc, hd, tiles),
        head_dim=hd,
        lse_dtype=numpy.dtype(numpy.float64 if acc == 8 else numpy.float32),
    )


def all_simt_specialisations() -> list[str]:
    """Every name expression ``simt_launch`` can return (the compile gate iterates this)."""
    out = []
    for ctype, acc in _CTYPES.values():
        for hd in HEAD_DIM_BUCKETS:
            for causal in (False, True):
                out.append(_expr(ctype, hd, causal, _TILES[(acc, hd)]))
    return out
