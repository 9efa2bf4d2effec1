"""GPU forward kernels against the float64 reference (``gpu`` marker: skipped without a device).

Every call writes into an output buffer poisoned with NaN first, so an element a kernel leaves
unwritten fails the comparison. Inputs keep the memory layout Hypothesis drew for them (strided
views keep their NaN-filled gaps on the device too, so a kernel that reads outside a view gets
NaN in its result).
"""

from __future__ import annotations

import ml_dtypes
import numpy
import pytest
from hypothesis import example, given, target
from hypothesis import strategies as st

import cuflash
from _inputs import make_array
from cuflash import testing
from cuflash.testing import AttentionCase, assert_attention_close, attention_cases

pytestmark = pytest.mark.gpu

BF16 = numpy.dtype(ml_dtypes.bfloat16)
F16 = numpy.dtype(numpy.float16)


def to_device(x: numpy.ndarray):
    """A CuPy array with the same values, shape *and strides* as ``x``; the bytes of the span
    that ``x`` does not cover are NaN, as in the strided layouts of cuflash.testing."""
    import cupy
    return testing.to_device(x, cupy)


def poisoned(shape, dtype, layout="c"):
    import cupy
    if layout == "c":
        return cupy.full(shape, numpy.nan, dtype=dtype)
    if layout == "transposed":  # column-major rows: unit stride on the sequence axis
        return cupy.full(shape[:-2] + shape[-1:] + shape[-2:-1], numpy.nan, dtype).swapaxes(-1, -2)
    base = cupy.full(shape[:-1] + (2 * shape[-1],), numpy.nan, dtype)  # "strided": every other column
    return base[..., ::2]


def run_and_check(q, k, v, *, scale=None, causal=False, out_layout="c"):
    """cuflash on the GPU (into a poisoned ``out``) against the float64 reference."""
    qd, kd, vd = (to_device(x) for x in (q, k, v))
    return check_case(AttentionCase.from_arrays(qd, kd, vd, scale=scale, causal=causal),
                      out_layout)


def check_case(case, out_layout="c"):
    """cuflash.attention on a CuPy case, into a poisoned ``out``, by cuflash.testing's rule
    (the naive baseline runs on the GPU)."""
    import cupy
    g = case.geometry()
    out = poisoned(g.batch_shape + (g.Lq, g.dv), case.dtype, out_layout)
    o, lse = cuflash.attention(case.q, case.k, case.v, return_lse=True, out=out, **case.kwargs)
    assert o is out
    cupy.cuda.Device().synchronize()
    return assert_attention_close(o, case, lse=lse, check_dtype=True)


# -- every dtype, shape, layout and mask the strategies draw (both kernels) --------------------

@given(attention_cases(min_seqlen=0, max_seqlen=257), st.sampled_from(["c", "transposed", "strided"]))
@example(AttentionCase.make("float16", (2, 113, 111), (2, 203, 111), (2, 203, 111), seed=1,
                            causal=True), "c").via("ragged tensor-core case: 113 x 203, d = 111")
@example(AttentionCase.make(
    "bfloat16", (3, 3, 160), (1, 3, 128, 160), (128, 160), seed=30888,
    layouts=("strided", "strided", "c", "reversed"), expanded=((0,), (1,), ()), logit_scale=0.1,
    value_scale=0.01, scale=None, causal="bottom_right", window=(87, None), softcap=50.0,
    alibi_slopes={"shape": (1, 3), "expanded": (), "scale": 1.0, "dtype": "float32"},
    bias={"shape": (1, 3, 3, 128), "expanded": (), "layout": "transposed", "scale": 10.0,
          "hide": 1.0, "dtype": "float32"},
    mask={"shape": (1, 1, 1, 128), "expanded": (), "layout": "reversed", "keep": 0.5},
    score_mod="tanh_cap", mask_mod="dilated", block_mask={"mask_mod": "dilated", "block": (1, 7)}),
    "c").via("session 9's campaign: lse off by ex2_poly's degree-3 fit (test_testing.CAMPAIGN_FAILURES)")
@example(AttentionCase.make(
    "float16", (11, 6), (13, 6), (13, 6), seed=22952, layouts=("f", "c", "c", "transposed"),
    expanded=((), (), ()), logit_scale=0.01, value_scale=1.0, scale=0.2582673330146801,
    causal=True, softcap=50.0, sink={"shape": (), "expanded": (), "scale": 1.0, "dtype": "float16"},
    bias={"shape": (11, 13), "expanded": (), "layout": "c", "scale": 0.1, "hide": 0.5,
          "dtype": "float16"},
    mask={"shape": (1, 13), "expanded": (), "layout": "f", "keep": 0.1},
    mask_mod="per_head", block_mask={"mask_mod": "per_head", "block": (7, 7)}),
    "c").via("session 10's campaign: the float16 softcap's cancellation at small scores (test_testing.CAMPAIGN_FAILURES)")
def test_matches_reference(case, out_layout):
    import cupy
    target(check_case(case.with_xp(cupy), out_layout))


# -- the tensor-core kernels: every head-dim bucket, ragged lengths, both alignments -----------

@pytest.fixture(params=["default", "sm80"])
def family(request, monkeypatch):
    """Run a test with the dispatcher's choice, and again with ``CUFLASH_FWD=sm80``, which
    keeps a Hopper GPU on fwd_sm80 (the kernel every other sm_80+ GPU runs). Elsewhere the two
    are the same kernel, so the second run is skipped."""
    if request.param == "sm80":
        import cupy
        if cupy.cuda.Device().compute_capability != "90":
            pytest.skip("CUFLASH_FWD=sm80 changes nothing off Hopper")
        monkeypatch.setenv("CUFLASH_FWD", "sm80")
    from cuflash import _api
    _api.clear_plans()          # overrides are read when a plan is built
    yield request.param
    _api.clear_plans()


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["f16", "bf16"])
@pytest.mark.parametrize("d, dv", [(32, 32), (40, 40), (64, 64), (72, 72), (96, 96), (111, 111),
                                   (128, 128), (160, 160), (192, 192), (224, 224), (256, 256),
                                   (64, 128), (128, 40)])
@pytest.mark.parametrize("Lq, Lk, causal", [(113, 203, True), (203, 113, True),
                                            (256, 256, "top_left"), (128, 512, False),
                                            (1, 77, False)])
def test_tensor_core_buckets(dtype, d, dv, Lq, Lk, causal, family):
    rng = numpy.random.default_rng(d * 1000 + Lq)
    q = make_array(rng, (2, 3, Lq, d), dtype)
    k = make_array(rng, (2, 1, Lk, d), dtype)   # broadcast over the head axis (GQA pattern)
    v = make_array(rng, (2, 1, Lk, dv), dtype)
    run_and_check(q, k, v, causal=causal)


@pytest.mark.parametrize("dtype", [F16, BF16, numpy.dtype(numpy.float32), numpy.dtype(numpy.float64)],
                         ids=["f16", "bf16", "f32", "f64"])
@pytest.mark.parametrize("causal", [False, True])
def test_full_tiles_many_blocks(dtype, causal, family):
    """Tile-multiple shapes with enough blocks for the large-tile configuration (EVEN path)."""
    rng = numpy.random.default_rng(7)
    q, k, v = (make_array(rng, (8, 16, 512, 128), dtype) for _ in range(3))
    run_and_check(q, k, v, causal=causal)


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["f16", "bf16"])
@pytest.mark.parametrize("d", [40, 64, 72, 128, 200, 256])
def test_ragged_many_blocks(dtype, d, family):
    """Ragged lengths with enough blocks for the 128-row tiles (not the small-grid variant)."""
    rng = numpy.random.default_rng(d)
    q = make_array(rng, (4, 40, 300, d), dtype)
    k, v = (make_array(rng, (4, 40, 333, d), dtype) for _ in range(2))
    run_and_check(q, k, v, causal=True)


# -- properties of the GPU path -------------------------------------------------------------

def _random_device(shape, dtype, seed=0):
    import cupy
    return cupy.asarray(make_array(numpy.random.default_rng(seed), shape, dtype))


@pytest.mark.parametrize("dtype", [F16, BF16, numpy.dtype(numpy.float32), numpy.dtype(numpy.float64)],
                         ids=["f16", "bf16", "f32", "f64"])
def test_bitwise_deterministic(dtype):
    q, k, v = (_random_device((2, 4, 300, 64), dtype, s) for s in range(3))
    a, la = cuflash.attention(q, k, v, causal=True, return_lse=True)
    b, lb = cuflash.attention(q, k, v, causal=True, return_lse=True)
    assert (a.view(numpy.uint8) == b.view(numpy.uint8)).all()
    assert (la == lb).all()


@pytest.mark.parametrize("dtype", [BF16, numpy.dtype(numpy.float32)], ids=["bf16", "f32"])
def test_non_default_stream(dtype):
    import cupy
    q, k, v = (_random_device((2, 2, 257, 64), dtype, s) for s in range(3))
    expected = cuflash.attention(q, k, v)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        out = cupy.full_like(expected, numpy.nan)
        got = cuflash.attention(q, k, v, out=out)
    stream.synchronize()
    assert got is out
    assert (got.view(numpy.uint8) == expected.view(numpy.uint8)).all()


@pytest.mark.parametrize("dtype", [F16, BF16, numpy.dtype(numpy.float32), numpy.dtype(numpy.float64)],
                         ids=["f16", "bf16", "f32", "f64"])
def test_nan_stays_in_its_batch_item(dtype):
    import cupy
    q, k, v = (_random_device((3, 2, 130, 64), dtype, s) for s in range(3))
    clean = cuflash.attention(q, k, v)
    k_bad = k.copy()
    k_bad[1, 0, 5, 3] = numpy.nan
    dirty = cuflash.attention(q, k_bad, v)
    assert bool(cupy.isnan(dirty[1, 0]).all())
    for b, h in [(0, 0), (0, 1), (1, 1), (2, 0), (2, 1)]:
        assert (dirty[b, h].view(numpy.uint8) == clean[b, h].view(numpy.uint8)).all()


@pytest.mark.parametrize("dtype", [BF16, numpy.dtype(numpy.float32)], ids=["bf16", "f32"])
def test_input_through_dlpack(dtype):
    import cupy
    q, k, v = (_random_device((1, 2, 200, 64), dtype, s) for s in range(3))
    qd = cupy.from_dlpack(q)
    assert qd.data.ptr == q.data.ptr
    a = cuflash.attention(qd, k, v)
    b = cuflash.attention(q, k, v)
    assert (a.view(numpy.uint8) == b.view(numpy.uint8)).all()


@pytest.mark.parametrize("dtype", [BF16, numpy.dtype(numpy.float32)], ids=["bf16", "f32"])
def test_extra_memory_does_not_grow_with_l_squared(dtype):
    """Pool growth during a call is at most the output and lse (no Lq x Lk buffer)."""
    import cupy
    L, d = 8192, 64
    q, k, v = (_random_device((1, 1, L, d), dtype, s) for s in range(3))
    pool = cupy.get_default_memory_pool()
    cuflash.attention(q, k, v)  # compile and warm up
    cupy.cuda.Device().synchronize()
    pool.free_all_blocks()
    before = pool.total_bytes()
    o, lse = cuflash.attention(q, k, v, return_lse=True)
    cupy.cuda.Device().synchronize()
    grown = pool.total_bytes() - before
    assert grown <= 2 * (o.nbytes + lse.nbytes), (grown, o.nbytes, lse.nbytes, L * L * 4)
