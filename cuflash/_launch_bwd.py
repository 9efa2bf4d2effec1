"""GPU launcher of the backward pass (``cuda_src/bwd_simt.cu``): tiles, buffers, launches.

Every dtype runs the generic SIMT backward for now (a tensor-core backward for float16 and
bfloat16 is future work). Three kernels, in this order on CuPy's current stream:

1. ``bwd_dot_do_o<T>``: ``D = rowsum(dO * O)`` into an accumulation-dtype buffer
   ``batch_shape + (Lq,)`` (line 4 of FlashAttention-2's Algorithm 2);
2. ``bwd_simt<T, HEAD_DIM, CAUSAL, DETERMINISTIC, BLOCK_M, BLOCK_N, NTHREADS>``: one block per
   (batch item, key tile); writes dK, dV per batch item and adds dQ (lines 5-19);
3. ``bwd_sum_dq<Acc>`` (``deterministic=True`` only): sums the per-key-tile partial dQ in
   key-tile order.

Memory (Acc = float32, or float64 for float64 inputs), besides the outputs:

* ``D``: ``batch_shape + (Lq,)`` Acc; ``lse`` is copied to a C-contiguous buffer if it is not
  one already (the forward returns it C-contiguous).
* ``dq``: ``batch_shape + (Lq, d)`` Acc, zero-initialised; the key tiles add into it with
  float atomics (``atomicAdd``), so the order of additions, and the last bits of dq, can
  change from run to run.
* ``dk``, ``dv``: ``batch_shape + (Lk, d)`` and ``batch_shape + (Lk, dv)`` Acc, one slice per
  *broadcast* batch item, summed afterwards with CuPy over the dimensions broadcasting added
  (``_problem.sum_to_shape``) and rounded once to the input dtype. So grouped-query attention
  does materialise per-group dk, dv here, G times the size of the result; summing inside the
  kernel is future work.
* ``deterministic=True``: instead of atomics, each key tile writes its dQ contribution to its
  own slice of a buffer ``(num_n_blocks,) + batch_shape + (Lq, d)`` Acc, with
  ``num_n_blocks = ceil(Lk / BLOCK_N)``, and ``bwd_sum_dq`` adds the slices in key-tile order
  0, 1, 2, ...: every kernel then does a fixed sequence of floating-point operations, so dq,
  dk and dv are bitwise reproducible run to run (CuPy's reductions for the broadcast sums are
  deterministic too). The price is that buffer: ``num_n_blocks * prod(batch_shape) * Lq * d``
  Acc values, i.e. it grows with Lq * Lk / BLOCK_N (1k x 1k, 32 heads, d = 128, float32:
  ~0.5 GB at BLOCK_N = 32). A semaphore-ordered accumulation into one dq buffer, as in
  FlashAttention-2's deterministic mode, would keep it O(B * H * Lq * d); future work.

Strides: q, k, v, o and dO are read in place with any strides, broadcast (stride 0) included;
nothing is copied except a non-contiguous ``lse``.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy

from . import _jit
from ._launch import MAX_BATCH_DIMS, LOG2E, _ctype, _elem_strides, merge_batch_dims
from ._problem import AttentionProblem, sum_to_shape
from ._simt_config import HEAD_DIM_BUCKETS, head_dim_bucket

SOURCE = "bwd_simt.cu"
#: Threads of ``bwd_dot_do_o`` and ``bwd_sum_dq`` per block (fixed in the kernels).
AUX_THREADS = 256
DOT_ROWS_PER_BLOCK = AUX_THREADS // 32   # one warp per query row


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


def main_expr(dtype, head_dim: int, causal: bool, deterministic: bool, tiles: BwdTiles) -> str:
    return (f"cuflash::bwd_simt<{_ctype(dtype)}, {head_dim}, {_b(causal)}, {_b(deterministic)}, "
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
# The parameter block (cuflash::BwdParams in cuda_src/common.cuh, field for field)
# ---------------------------------------------------------------------------------------------

_B = MAX_BATCH_DIMS
_TENSORS = ("q", "k", "v", "o", "dout")   # the strided tensors, in BwdParams order
BWD_PARAMS = numpy.dtype([
    ("q", "<u8"), ("k", "<u8"), ("v", "<u8"), ("o", "<u8"), ("dout", "<u8"), ("lse", "<u8"),
    ("dpsum", "<u8"), ("dq_acc", "<u8"), ("dk_acc", "<u8"), ("dv_acc", "<u8"),
    ("q_batch_stride", "<i8", (_B,)), ("k_batch_stride", "<i8", (_B,)),
    ("v_batch_stride", "<i8", (_B,)), ("o_batch_stride", "<i8", (_B,)),
    ("dout_batch_stride", "<i8", (_B,)),
    ("q_row_stride", "<i8"), ("q_col_stride", "<i8"),
    ("k_row_stride", "<i8"), ("k_col_stride", "<i8"),
    ("v_row_stride", "<i8"), ("v_col_stride", "<i8"),
    ("o_row_stride", "<i8"), ("o_col_stride", "<i8"),
    ("dout_row_stride", "<i8"), ("dout_col_stride", "<i8"),
    ("dq_block_stride", "<i8"),
    ("scale", "<f8"), ("scale_log2", "<f8"),
    ("batch_shape", "<i4", (_B,)),
    ("nbatch", "<i4"), ("Lq", "<i4"), ("Lk", "<i4"), ("d", "<i4"), ("dv", "<i4"),
    ("causal_offset", "<i4"), ("num_n_blocks", "<i4"), ("pad_", "<i4"),
], align=True)


@dataclasses.dataclass(frozen=True)
class BwdLaunch:
    """The kernels and geometry of one backward call."""
    main: str
    dot: str
    dq_sum: str
    tiles: BwdTiles
    smem_bytes: int

    def num_n_blocks(self, Lk: int) -> int:
        return -(-int(Lk) // self.tiles.block_n)


def choose(prob: AttentionProblem, deterministic: bool) -> BwdLaunch:
    """The specialisations and tiles of the backward for ``prob``."""
    hd = head_dim_bucket(prob.d, prob.dv)
    acc = _acc_itemsize(prob.dtype)
    tiles = BWD_TILES[(acc, hd)]
    return BwdLaunch(main=main_expr(prob.dtype, hd, prob.causal, deterministic, tiles),
                     dot=dot_expr(prob.dtype), dq_sum=sum_expr(prob.dtype), tiles=tiles,
                     smem_bytes=bwd_smem_bytes(acc, hd, tiles))


@functools.lru_cache(maxsize=None)
def _kernel(expr: str, device_id: int, smem_bytes: int):
    kernel = _jit.get_kernel(SOURCE, expr, device_id)
    if smem_bytes > STATIC_SMEM_LIMIT and kernel.max_dynamic_shared_size_bytes < smem_bytes:
        kernel.max_dynamic_shared_size_bytes = smem_bytes
    return kernel


def backward(prob: AttentionProblem, do, o, lse, dq, dk, dv, *, deterministic: bool) -> None:
    """Write the gradients of ``prob`` into ``dq``, ``dk``, ``dv`` (CuPy arrays of the
    un-broadcast shapes of q, k, v, dtype ``prob.dtype``) on the inputs' GPU, on CuPy's current
    stream. ``prob.Lq``, ``prob.Lk`` and every batch dimension must be >= 1."""
    import cupy
    with cupy.cuda.Device(prob.device_id):
        launch = choose(prob, deterministic)
        acc = numpy.dtype(numpy.float64 if _acc_itemsize(prob.dtype) == 8 else numpy.float32)
        nbatch = math.prod(prob.batch_shape)
        num_n_blocks = launch.num_n_blocks(prob.Lk)
        Lq, Lk, d, d_v = prob.Lq, prob.Lk, prob.d, prob.dv

        lse = cupy.ascontiguousarray(lse)
        dpsum = cupy.empty(prob.batch_shape + (Lq,), acc)
        dq_parts = num_n_blocks if deterministic else 1
        dq_acc = cupy.zeros((dq_parts,) + prob.batch_shape + (Lq, d), acc)
        dk_acc = cupy.empty(prob.batch_shape + (Lk, d), acc)
        dv_acc = cupy.empty(prob.batch_shape + (Lk, d_v), acc)

        tensors = (prob.q, prob.k, prob.v, o, do)
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
        p["dq_block_stride"] = nbatch * Lq * d if deterministic else 0
        p["scale"] = prob.scale
        p["scale_log2"] = prob.scale * LOG2E
        p["batch_shape"] = (1,) * pad + inner
        p["nbatch"] = inner_n
        p["Lq"], p["Lk"], p["d"], p["dv"] = Lq, Lk, d, d_v
        p["causal_offset"] = prob.causal_offset
        p["num_n_blocks"] = num_n_blocks

        dot = _kernel(launch.dot, prob.device_id, 0)
        main = _kernel(launch.main, prob.device_id, launch.smem_bytes)
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
            dot((inner_n * -(-Lq // DOT_ROWS_PER_BLOCK),), (AUX_THREADS,), (p[()],))
            # -- 5-19: one block per (batch item, key tile)
            main((inner_n * num_n_blocks,), (launch.tiles.threads,), (p[()],),
                 shared_mem=launch.smem_bytes)

        if deterministic:
            dq_sum = _kernel(launch.dq_sum, prob.device_id, 0)
            total = dq_acc.size // dq_parts
            summed = cupy.empty(prob.batch_shape + (Lq, d), acc)
            blocks = max(1, min(-(-total // AUX_THREADS), 65535))
            dq_sum((blocks,), (AUX_THREADS,),
                   (dq_acc, summed, numpy.int64(total), numpy.int32(num_n_blocks)))
        else:
            summed = dq_acc[0]
        dq[...] = sum_to_shape(summed, dq.shape, prob.dtype)
        dk[...] = sum_to_shape(dk_acc, dk.shape, prob.dtype)
        dv[...] = sum_to_shape(dv_acc, dv.shape, prob.dtype)
