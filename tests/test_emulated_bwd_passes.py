"""The backward's passes around its main kernel (cuda_src/bwd_prep.cu), run on the CPU in the
emulation of tests/_emu_sm80.py: bwd_dot_do_o (D = rowsum(dO o O), and the zeroing of the
accumulators) in its ROWS builds, and bwd_finish_dq in its scalar and VEC4 builds, on the
argument blocks ``cuflash._plan_aux`` packs. What the H200 probe (bench/probes/bwd_passes.py)
checked at three large shapes, here at small ones that reach the paths those do not: a warp's
step of rows crossing into the next batch item, lanes past the head dim, rows without keys,
strides that force the scalar loop, grids of one block and of a few."""

from __future__ import annotations

import ml_dtypes
import numpy
import pytest

from cuflash import _plan_aux, _problem

import _emu_sm80 as emu

pytestmark = pytest.mark.skipif(not emu.available(), reason="needs g++ for the emulation")

_CT = {"bfloat16": "__nv_bfloat16", "float16": "__half", "float32": "float"}
DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float16": numpy.float16, "float32": numpy.float32}
DOT_BUILDS = [(dt, rows) for dt in ("bfloat16", "float16", "float32") for rows in (1, 4)]
FINISH_BUILDS = [(out, vec4) for out in ("bfloat16", "float16", "float32") for vec4 in (False, True)]


def _aligned(nbytes: int, fill: int = 0xFF) -> numpy.ndarray:
    """A byte buffer starting on 256 bytes (as a CuPy allocation does), filled with ``fill``."""
    raw = numpy.full(nbytes + 256, fill, numpy.uint8)
    off = (-raw.ctypes.data) % 256
    return raw[off:off + nbytes]


@pytest.fixture(scope="module")
def lib():
    kernels = [("dot", f"cuflash::bwd_dot_do_o<{_CT[dt]}, {rows}>") for dt, rows in DOT_BUILDS]
    kernels += [("finish", f"cuflash::bwd_finish_dq<float, {_CT[out]}, {str(v).lower()}>")
                for out, v in FINISH_BUILDS]
    return emu.build("bwd_prep.cu", kernels)


def _dot(lib, dtype: str, rows: int, o, do, lse, grid: int):
    """D (float32, one per row) and the zeroed accumulator bytes of one bwd_dot_do_o launch."""
    q = numpy.zeros(o.shape[:-2] + (o.shape[-2], o.shape[-1]), o.dtype)
    prob = _problem.make_problem(q, q, numpy.zeros_like(o), scale=None, causal=False)
    nrows = o[..., 0].size
    D = numpy.full(nrows, numpy.nan, numpy.float32)
    acc = _aligned(4 * o.size + 16 * 3)      # a span of whole 16-byte words, poisoned
    p, _ = emu.pack_params(prob, {"q": q, "k": q, "v": numpy.zeros_like(o), "o": o, "dout": do},
                           lse=lse, dpsum=D, dq_acc=acc)
    args = numpy.zeros((), _plan_aux.DOT_ARGS)
    args["p"], args["zero_bytes"] = p, acc.size
    lib.launch("dot", f"cuflash::bwd_dot_do_o<{_CT[dtype]}, {rows}>", args, grid,
               _plan_aux.AUX_THREADS, 0)
    return D, acc


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("d", [32, 40, 64, 128])
@pytest.mark.parametrize("Lq", [7, 45])
@pytest.mark.parametrize("padded", [False, True])
def test_dot_rows_builds_are_bitwise_the_one_row_loop(lib, dtype, d, Lq, padded):
    """D of the ROWS = 4 build equals ROWS = 1's bit for bit and NumPy's float32 rowsum to its
    rounding, at grids of 1 and 5 blocks; 0 for a row without keys (lse = -inf); the
    accumulators zeroed whole. ``padded``: o and dO are views with 3 rows of padding after
    each batch item, so a warp's step that crosses into the next item must take that item's
    base pointer (with flat rows, row r of the first item's pointer lands right anyway)."""
    rng = numpy.random.default_rng(Lq * 1000 + d)
    t = DTYPES[dtype]
    o, do = (rng.standard_normal((2, 3, Lq + 3 * padded, d)).astype(t)[:, :, :Lq]
             for _ in range(2))
    lse = rng.standard_normal((2, 3, Lq)).astype(numpy.float32)
    lse[1, 2, Lq // 2] = -numpy.inf
    ref = (o.astype(numpy.float64) * do.astype(numpy.float64)).sum(-1).reshape(-1)
    ref[lse.reshape(-1) == -numpy.inf] = 0
    scale = numpy.abs(o.astype(numpy.float64) * do.astype(numpy.float64)).sum(-1).reshape(-1)
    base = None
    for rows in (1, 4):
        for grid in (1, 5):
            D, acc = _dot(lib, dtype, rows, o, do, lse, grid)
            assert not acc.any(), (rows, grid)
            # float32 sums of d products: |error| <= (d + log2(32)) u sum |o do|, u = 2^-24
            assert numpy.all(numpy.abs(D - ref) <= (d + 5) * 2.0**-24 * scale), (rows, grid)
            assert D[lse.reshape(-1) == -numpy.inf] == 0
            if base is None:
                base = D
            assert (D.view(numpy.uint32) == base.view(numpy.uint32)).all(), (rows, grid)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_dot_scalar_path_for_strided_rows(lib, dtype):
    """o with a column stride of 2 takes the scalar loop in every build (no 16-byte chunks):
    the same D from ROWS 1 and 4."""
    rng = numpy.random.default_rng(3)
    t = DTYPES[dtype]
    o = rng.standard_normal((2, 9, 128)).astype(t)[..., ::2]
    do = rng.standard_normal((2, 9, 64)).astype(t)
    lse = numpy.zeros((2, 9), numpy.float32)
    D1, _ = _dot(lib, dtype, 1, o, do, lse, 3)
    D4, _ = _dot(lib, dtype, 4, o, do, lse, 3)
    ref = (o.astype(numpy.float64) * do.astype(numpy.float64)).sum(-1).reshape(-1)
    assert numpy.allclose(D1, ref, rtol=1e-5, atol=1e-5)
    assert (D1.view(numpy.uint32) == D4.view(numpy.uint32)).all()


@pytest.mark.parametrize("out, vec4", FINISH_BUILDS)
@pytest.mark.parametrize("parts", [1, 3])
def test_finish_vec4_is_bitwise_the_scalar_sums(lib, out, vec4, parts):
    """bwd_finish_dq: the slices added in slice order in float32 and rounded once, whatever
    the build (VEC4: 16-byte loads, one 8- or 16-byte store) and the grid."""
    n = 4 * 333
    rng = numpy.random.default_rng(parts)
    partial = _aligned(4 * n * parts).view(numpy.float32)
    partial[:] = rng.standard_normal(n * parts).astype(numpy.float32) * 7
    want = partial[:n].copy()
    for t in range(1, parts):
        want = want + partial[t * n:(t + 1) * n]
    want = want.astype(DTYPES[out])
    for grid in (1, 7):
        dq = _aligned(n * numpy.dtype(DTYPES[out]).itemsize).view(DTYPES[out])
        args = numpy.zeros((), _plan_aux.FINISH_ARGS)
        args["partial"], args["dq"], args["n"], args["parts"] = (partial.ctypes.data,
                                                                 dq.ctypes.data, n, parts)
        lib.launch("finish", f"cuflash::bwd_finish_dq<float, {_CT[out]}, {str(vec4).lower()}>",
                   args, grid, _plan_aux.AUX_THREADS, 0)
        bits = numpy.uint16 if dq.itemsize == 2 else numpy.uint32
        assert (dq.view(bits) == want.view(bits)).all(), grid
