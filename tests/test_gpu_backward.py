"""The GPU backward (cuda_src/bwd_simt.cu) against the float64 reference gradients (``gpu``
marker: skipped without a device).

Inputs keep the memory layout Hypothesis drew for them (strided views keep their NaN-filled
gaps on the device too, so a kernel that reads outside a view gets NaN in its result). The
tolerance is tests/_tolerance_bwd.py's: 3x the error of the naive same-dtype backward (run on
the GPU with CuPy) plus a floor. Kernel specialisations compile on first use (NVRTC, about a
second each); the tests below touch about 40 of them.
"""

from __future__ import annotations

import ml_dtypes
import numpy
import pytest
from hypothesis import example, given, settings, target
from hypothesis import strategies as st

import cuflash
from cuflash import _problem
from _inputs import LAYOUTS, attention_inputs, make_array
from _tolerance_bwd import assert_gradients_close
from test_gpu import to_device

pytestmark = pytest.mark.gpu

BF16 = numpy.dtype(ml_dtypes.bfloat16)
F16 = numpy.dtype(numpy.float16)
F32 = numpy.dtype(numpy.float32)
F64 = numpy.dtype(numpy.float64)
ALL = [F16, BF16, F32, F64]
IDS = ["f16", "bf16", "f32", "f64"]


def run_and_check(q, k, v, *, scale=None, causal=False, do_layout="c", deterministic=False,
                  seed=0):
    """cuflash forward + backward on the GPU against the float64 reference gradients."""
    import cupy
    qd, kd, vd = (to_device(x) for x in (q, k, v))
    o, lse = cuflash.attention(qd, kd, vd, scale=scale, causal=causal, return_lse=True)
    do = make_array(numpy.random.default_rng(seed), o.shape, q.dtype, do_layout)
    dod = to_device(do)
    grads = cuflash.attention_backward(dod, qd, kd, vd, o, lse, scale=scale, causal=causal,
                                       deterministic=deterministic)
    cupy.cuda.Device().synchronize()
    for g, x in zip(grads, (q, k, v)):
        assert isinstance(g, cupy.ndarray) and g.shape == x.shape and g.dtype == x.dtype
        assert g.flags.c_contiguous
    prob = _problem.make_problem(qd, kd, vd, scale=scale, causal=causal)
    ref = cuflash.reference.attention_backward(do, q, k, v, scale=scale, causal=causal)
    return assert_gradients_close(prob, dod, grads, ref, (q.shape, k.shape, v.shape))


# -- every dtype, shape, layout and mask the strategies draw ----------------------------------

@settings(max_examples=min(40, settings().max_examples))
@given(attention_inputs(), st.sampled_from(LAYOUTS))
@example(  # GQA, ragged, bottom-right causal with rows that see no key, d = 111
    dict(q=make_array(numpy.random.default_rng(1), (2, 2, 3, 137, 111), BF16),
         k=make_array(numpy.random.default_rng(2), (2, 2, 1, 101, 111), BF16),
         v=make_array(numpy.random.default_rng(3), (2, 2, 1, 101, 111), BF16),
         scale=None, causal=True, block_m=0, block_n=0, out_layout=None), "c")
def test_matches_reference(inputs, do_layout):
    target(run_and_check(inputs["q"], inputs["k"], inputs["v"], scale=inputs["scale"],
                         causal=inputs["causal"], do_layout=do_layout))


# -- head dims (every bucket, padded ones), ragged lengths, GQA, both alignments -----------------

HEAD_DIMS = [(40, 40), (64, 64), (111, 111), (16, 16), (128, 128), (256, 256), (64, 32), (24, 128)]
LENGTHS = [(113, 203, True), (203, 113, True), (130, 70, "top_left"), (64, 129, False)]
# Each head-dim pair with two of the length configurations (in turn), every dtype: every head-dim
# bucket sees every configuration, at a quarter of the full product's kernel launches.
DIM_CASES = [(d, dv, *LENGTHS[(i + j) % len(LENGTHS)])
             for i, (d, dv) in enumerate(HEAD_DIMS) for j in (0, 2)]


@pytest.mark.parametrize("dtype", ALL, ids=IDS)
@pytest.mark.parametrize("d, dv, Lq, Lk, causal", DIM_CASES)
def test_head_dims_and_lengths(dtype, d, dv, Lq, Lk, causal):
    rng = numpy.random.default_rng(d * 1000 + Lq)
    q = make_array(rng, (2, 2, 2, Lq, d), dtype)
    k = make_array(rng, (2, 2, 1, Lk, d), dtype)    # broadcast over the group axis (GQA)
    v = make_array(rng, (2, 2, 1, Lk, dv), dtype)
    run_and_check(q, k, v, causal=causal)


@pytest.mark.parametrize("dtype", ALL, ids=IDS)
def test_strides_and_broadcasting(dtype):
    """Transposed, strided (NaN gaps) and reversed layouts; q broadcast too; do transposed."""
    rng = numpy.random.default_rng(3)
    q = make_array(rng, (1, 3, 90, 48), dtype, "transposed")        # broadcast over axis 0
    k = make_array(rng, (2, 1, 75, 48), dtype, "strided")           # broadcast over axis 1
    v = make_array(rng, (75, 20), dtype, "reversed")                 # broadcast over both
    run_and_check(q, k, v, causal=True, do_layout="transposed")
    run_and_check(q, k, v, causal=False, do_layout="strided", scale=0.5)


@pytest.mark.parametrize("dtype", [BF16, F32], ids=["bf16", "f32"])
def test_more_batch_dims_than_the_kernel_takes(dtype):
    """Five batch dims that cannot merge (alternating broadcasts): one launch per outer index."""
    rng = numpy.random.default_rng(4)
    q = make_array(rng, (2, 3, 2, 3, 2, 33, 32), dtype)
    k = make_array(rng, (2, 1, 2, 1, 2, 41, 32), dtype)
    v = make_array(rng, (1, 3, 1, 3, 1, 41, 16), dtype)
    run_and_check(q, k, v, causal=True)


# -- properties --------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ALL, ids=IDS)
def test_rows_without_keys_get_exactly_zero_gradients(dtype):
    """Bottom-right causal, Lq > Lk: the first Lq - Lk rows see no key (lse = -inf); their dO
    rows hold NaN, which must not leak anywhere."""
    import cupy
    rng = numpy.random.default_rng(5)
    Lq, Lk = 150, 61
    q, k, v = (cupy.asarray(make_array(rng, s, dtype)) for s in
               ((2, 3, Lq, 64), (2, 3, Lk, 64), (2, 3, Lk, 40)))
    o, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    assert bool((lse[:, :, : Lq - Lk] == -numpy.inf).all())
    do = cupy.asarray(make_array(rng, o.shape, dtype))
    do[:, :, : Lq - Lk] = numpy.nan
    for deterministic in (False, True):
        dq, dk, dv = cuflash.attention_backward(do, q, k, v, o, lse, causal=True,
                                                deterministic=deterministic)
        assert bool((dq[:, :, : Lq - Lk] == 0).all())
        for g in (dq, dk, dv):
            assert bool(cupy.isfinite(g.astype(numpy.float32)).all())


@pytest.mark.parametrize("dtype", ALL, ids=IDS)
def test_deterministic_is_bitwise_reproducible(dtype):
    import cupy
    rng = numpy.random.default_rng(6)
    q = make_array(rng, (2, 2, 2, 300, 64), dtype)
    k, v = (make_array(rng, (2, 2, 1, 257, 64), dtype) for _ in range(2))
    run_and_check(q, k, v, causal=True, deterministic=True)   # and it is correct
    qd, kd, vd = (cupy.asarray(x) for x in (q, k, v))
    o, lse = cuflash.attention(qd, kd, vd, causal=True, return_lse=True)
    do = cupy.asarray(make_array(rng, o.shape, dtype))
    first = cuflash.attention_backward(do, qd, kd, vd, o, lse, causal=True, deterministic=True)
    for _ in range(3):
        again = cuflash.attention_backward(do, qd, kd, vd, o, lse, causal=True, deterministic=True)
        for a, b in zip(first, again):
            assert (a.view(numpy.uint8) == b.view(numpy.uint8)).all()


@pytest.mark.parametrize("dtype", [BF16, F32], ids=["bf16", "f32"])
def test_vjp_pullback_on_the_gpu(dtype):
    import cupy
    rng = numpy.random.default_rng(7)
    q, k, v = (cupy.asarray(make_array(rng, (2, 3, 100, 32), dtype)) for _ in range(3))
    o, pullback = cuflash.attention_vjp(q, k, v, causal=True, deterministic=True)
    do = cupy.asarray(make_array(rng, o.shape, dtype))
    _, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    want = cuflash.attention_backward(do, q, k, v, o, lse, causal=True, deterministic=True)
    for a, b in zip(pullback(do), want):
        assert (a.view(numpy.uint8) == b.view(numpy.uint8)).all()


@pytest.mark.parametrize("dtype", [BF16, F32], ids=["bf16", "f32"])
def test_non_default_stream(dtype):
    import cupy
    rng = numpy.random.default_rng(8)
    q, k, v = (cupy.asarray(make_array(rng, (2, 2, 257, 64), dtype)) for _ in range(3))
    o, lse = cuflash.attention(q, k, v, return_lse=True)
    do = cupy.asarray(make_array(rng, o.shape, dtype))
    expected = cuflash.attention_backward(do, q, k, v, o, lse, deterministic=True)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        got = cuflash.attention_backward(do, q, k, v, o, lse, deterministic=True)
    stream.synchronize()
    for a, b in zip(got, expected):
        assert (a.view(numpy.uint8) == b.view(numpy.uint8)).all()


@pytest.mark.parametrize("dtype", [BF16, F32], ids=["bf16", "f32"])
def test_extra_memory_does_not_grow_with_l_squared(dtype):
    """Without deterministic=True the backward allocates O(L * d) (no Lq x Lk buffer)."""
    import cupy
    L, d = 8192, 64
    rng = numpy.random.default_rng(9)
    q, k, v, do = (cupy.asarray(make_array(rng, (1, 1, L, d), dtype)) for _ in range(4))
    o, lse = cuflash.attention(q, k, v, return_lse=True)
    cuflash.attention_backward(do, q, k, v, o, lse)   # compile and warm up
    cupy.cuda.Device().synchronize()
    pool = cupy.get_default_memory_pool()
    pool.free_all_blocks()
    before = pool.total_bytes()
    grads = cuflash.attention_backward(do, q, k, v, o, lse)
    cupy.cuda.Device().synchronize()
    grown = pool.total_bytes() - before
    one = L * d * 4   # one float32 L x d buffer
    assert grown <= 12 * one, (grown, one, L * L * 4)
    del grads
