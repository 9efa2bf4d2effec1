"""The GPU backward (cuda_src/bwd_sm90.cu for float16/bfloat16 with 33 <= d <= 128 on Hopper,
cuda_src/bwd_sm80.cu for the other float16/bfloat16 problems with head dims up to 128 on
sm_80+ and for deterministic=True, cuda_src/bwd_simt.cu for the rest) against the float64
reference gradients (``gpu`` marker: skipped without a device). The tests of the tensor-core kernel check which kernel ran
(``launched``), so a dispatch that silently falls back to bwd_simt cannot pass them.

Inputs keep the memory layout Hypothesis drew for them (strided views keep their NaN-filled
gaps on the device too, so a kernel that reads outside a view gets NaN in its result). The
tolerance is cuflash.testing's: 3x the error of the naive same-dtype backward (run on
the GPU with CuPy) plus a floor. Kernel specialisations compile on first use (NVRTC, about a
second each); the tests below touch about 40 of them.
"""

from __future__ import annotations

import ml_dtypes
import numpy
import pytest
from hypothesis import example, given, target

import cuflash
from _inputs import make_array
from cuflash.testing import AttentionCase, assert_attention_close, attention_cases
from test_gpu_forward import to_device

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
    qd, kd, vd = (to_device(x) for x in (q, k, v))
    shape = numpy.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2]) + (q.shape[-2],
                                                                               v.shape[-1])
    dod = to_device(make_array(numpy.random.default_rng(seed), shape, q.dtype, do_layout))
    case = AttentionCase.from_arrays(qd, kd, vd, do=dod, scale=scale, causal=causal)
    return check_case(case, deterministic=deterministic)


def check_case(case, deterministic=False):
    """Forward, then backward of a CuPy case, by cuflash.testing's rule (3x the naive
    same-dtype backward, run on the GPU, plus a floor)."""
    import cupy
    o, lse = cuflash.attention(case.q, case.k, case.v, return_lse=True, **case.kwargs)
    grads = cuflash.attention_backward(case.do, case.q, case.k, case.v, o, lse,
                                       deterministic=deterministic, **case.kwargs)
    cupy.cuda.Device().synchronize()
    for g, x in zip(grads, (case.q, case.k, case.v)):
        assert isinstance(g, cupy.ndarray) and g.shape == x.shape and g.dtype == x.dtype
        assert g.flags.c_contiguous
    return assert_attention_close(None, case, grads=grads, check_dtype=True)


def check_grads(qd, kd, vd, do, causal, grads):
    case = AttentionCase.from_arrays(qd, kd, vd, do=do, causal=causal)
    return assert_attention_close(None, case, grads=grads, check_dtype=True)


# -- every dtype, shape, layout and mask the strategies draw ----------------------------------

@given(attention_cases(min_seqlen=0, max_seqlen=257))
@example(AttentionCase.make("bfloat16", (2, 2, 3, 137, 111), (2, 2, 1, 101, 111),
                            (2, 2, 1, 101, 111), seed=1, causal=True)
         ).via("GQA, ragged, bottom-right causal with rows that see no key, d = 111")
@example(AttentionCase.make("float16", (2, 1, 5, 1), (1, 2, 256, 1), (2, 1, 256, 96), seed=0)
         ).via("failed (dv) in session 7's gpu-profile run, not reproduced alone: a plan "
               "made for an expanded v and reused for a broadcast one (found in session 15, "
               "test_broadcast_and_expanded_inputs_get_their_own_plans)")
def test_matches_reference(case):
    import cupy
    target(check_case(case.with_xp(cupy)))


# -- head dims (every bucket, padded ones), ragged lengths, GQA, both alignments -----------------

HEAD_DIMS = [(40, 40), (64, 64), (72, 72), (96, 96), (111, 111), (16, 16), (128, 128), (256, 256),
             (64, 32), (24, 128)]
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


@pytest.mark.parametrize("order", ["expanded_first", "broadcast_first"])
def test_broadcast_and_expanded_inputs_get_their_own_plans(order):
    """A v (and a bias) that broadcasts over the batch and the same array given expanded (a
    stride-0 view of the batch's shape) are alike after broadcasting, but only the first's
    gradient is summed. Called one after the other in one process, each must get its own
    plan: one plan for both wrote the expanded call's whole batch of dV into the other's
    one-item dv (session 15: the dV failures of test_matches_reference in sessions 7 and 15,
    which needed an earlier example of the expanded kind in the same worker)."""
    import cupy
    from cuflash import _api
    from cuflash.testing import AttentionCase
    _api.clear_plans()
    rng = numpy.random.default_rng(15)
    q, k, do = (cupy.asarray(make_array(rng, s, BF16)) for s in
                ((2, 3, 61, 31), (2, 3, 31, 31), (2, 3, 61, 31)))
    v1 = cupy.asarray(make_array(rng, (1, 1, 31, 31), BF16))
    b1 = cupy.asarray(make_array(rng, (3, 61, 31), BF16))
    calls = [(cupy.broadcast_to(v1, (2, 3, 31, 31)), cupy.broadcast_to(b1, (2, 3, 61, 31))),
             (v1, b1)]
    for v, bias in (calls if order == "expanded_first" else calls[::-1]) * 2:
        for kw in ({}, {"bias": bias}):
            case = AttentionCase.from_arrays(q, k, v, do=do, **kw)
            o, lse = cuflash.attention(q, k, v, return_lse=True, **kw)
            grads = cuflash.attention_backward(do, q, k, v, o, lse, **kw)
            assert grads[2].shape == v.shape and (not kw or grads[3].shape == bias.shape)
            assert_attention_close(None, case, grads=grads, check_dtype=True)


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


# -- the tensor-core backward (bwd_sm80): it really runs, and agrees with bwd_simt ---------------

@pytest.fixture
def launched(monkeypatch):
    """The source of the main kernel of every backward plan built (the dispatcher's pick; the
    plan cache is cleared first, so every call of the test builds its plan)."""
    from cuflash import _api
    from _spy import backward_sources
    seen = backward_sources(monkeypatch)
    for name in ("CUFLASH_BWD", "CUFLASH_TILES", "CUFLASH_GRID_ORDER"):
        monkeypatch.delenv(name, raising=False)
    _api.clear_plans()
    return seen


def setenv(monkeypatch, name: str, value: str) -> None:
    """Set a CUFLASH_* override and forget the plans built without it (overrides are read when
    a plan is built)."""
    from cuflash import _api
    monkeypatch.setenv(name, value)
    _api.clear_plans()


def _sm80_or_skip():
    import cupy
    cc = int(cupy.cuda.Device().compute_capability)
    if cc < 80:
        pytest.skip(f"bwd_sm80 needs compute capability >= 8.0, this GPU has {cc / 10}")
    from cuflash import _families
    return _families.device_info(cupy.cuda.Device().id).smem_optin


def _hopper_or_skip():
    import cupy
    cc = int(cupy.cuda.Device().compute_capability)
    if cc != 90:
        pytest.skip(f"bwd_sm90 needs compute capability 9.0 (wgmma, sm_90a), this GPU has {cc / 10}")


def _atomic_kernel(d: int, dv: int) -> str:
    """The tensor-core kernel the dispatcher picks for deterministic=False (no override)."""
    import cupy
    hopper = int(cupy.cuda.Device().compute_capability) == 90
    return "bwd_sm90.cu" if hopper and 33 <= max(d, dv) <= 128 else "bwd_sm80.cu"


@pytest.mark.parametrize("family", ["auto", "sm80"])
@pytest.mark.parametrize("dtype", [F16, BF16], ids=["f16", "bf16"])
@pytest.mark.parametrize("d, dv, Lq, Lk, causal", [
    (40, 40, 113, 203, True), (64, 64, 203, 113, True), (72, 72, 130, 70, "top_left"),
    (96, 96, 113, 203, False), (111, 111, 150, 61, True), (128, 128, 256, 256, True),
    (32, 32, 64, 129, False), (24, 128, 100, 150, True)])
def test_tensor_core_backward_runs(launched, monkeypatch, family, dtype, d, dv, Lq, Lk, causal):
    """Every head-dim bucket of bwd_sm80 (32, 64, 96, 128; d not a multiple of 8 is padded) and
    of bwd_sm90 (64, 128; family "auto" on Hopper), ragged lengths, both alignments, rows
    without keys, GQA; deterministic (always bwd_sm80) and not. Family "sm80"
    (CUFLASH_BWD=sm80) keeps Hopper on bwd_sm80."""
    from cuflash import _traits
    optin = _sm80_or_skip()
    if family == "sm80":
        setenv(monkeypatch, "CUFLASH_BWD", "sm80")
    bucket = max(32, -(-max(d, dv) // 32) * 32)
    if _traits.BWD_SM80[bucket].smem_bytes > optin:
        pytest.skip(f"this GPU grants {optin} bytes of shared memory a block: bwd_simt at d={d}")
    rng = numpy.random.default_rng(d + Lq)
    q = make_array(rng, (2, 2, 2, Lq, d), dtype)
    k = make_array(rng, (2, 2, 1, Lk, d), dtype)
    v = make_array(rng, (2, 2, 1, Lk, dv), dtype)
    for det in (False, True):
        run_and_check(q, k, v, causal=causal, deterministic=det)
    atomic = _atomic_kernel(d, dv) if family == "auto" else "bwd_sm80.cu"
    assert launched == [atomic, "bwd_sm80.cu"]


@pytest.mark.parametrize("dtype, d", [(F16, 160), (BF16, 256), (F32, 64)])
def test_other_problems_run_the_generic_backward(launched, dtype, d):
    rng = numpy.random.default_rng(d)
    q, k, v = (make_array(rng, (2, 70, d), dtype) for _ in range(3))
    run_and_check(q, k, v, causal=True)
    assert launched == ["bwd_simt.cu"]


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["f16", "bf16"])
@pytest.mark.parametrize("causal", [False, True])
def test_simt_override_agrees_with_the_tensor_cores(launched, monkeypatch, dtype, causal):
    """CUFLASH_BWD=simt forces bwd_simt; both kernels pass the reference on the same inputs,
    and their results differ by no more than the two tolerances allow."""
    import cupy
    _sm80_or_skip()
    rng = numpy.random.default_rng(11)
    q = make_array(rng, (2, 4, 300, 64), dtype)
    k, v = (make_array(rng, (2, 1, 257, 64), dtype) for _ in range(2))
    qd, kd, vd = (cupy.asarray(x) for x in (q, k, v))
    o, lse = cuflash.attention(qd, kd, vd, causal=causal, return_lse=True)
    do_host = make_array(rng, o.shape, dtype)
    do = cupy.asarray(do_host)
    ref = cuflash.reference.attention_backward(do_host, q, k, v, causal=causal)
    tc = cuflash.attention_backward(do, qd, kd, vd, o, lse, causal=causal)
    setenv(monkeypatch, "CUFLASH_BWD", "simt")
    simt = cuflash.attention_backward(do, qd, kd, vd, o, lse, causal=causal)
    assert launched == [_atomic_kernel(64, 64), "bwd_simt.cu"]
    check_grads(qd, kd, vd, do, causal, tc)
    check_grads(qd, kd, vd, do, causal, simt)
    for a, b, r in zip(tc, simt, ref):
        a, b = (cupy.asnumpy(x).astype(numpy.float64) for x in (a, b))
        assert numpy.abs(a - b).max() <= 2 * max(numpy.abs(a - r).max(), numpy.abs(b - r).max()) + 1e-6


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["f16", "bf16"])
@pytest.mark.parametrize("causal", [False, True])
def test_deterministic_semaphore_under_contention(launched, dtype, causal):
    """16 key tiles adding to each of 8 query tiles of 8 heads: the ordered accumulation is
    bitwise reproducible and agrees with the atomics path within the reference tolerance."""
    import cupy
    _sm80_or_skip()
    rng = numpy.random.default_rng(12)
    q = make_array(rng, (1, 8, 512, 64), dtype)
    k, v = (make_array(rng, (1, 8, 2048, 64), dtype) for _ in range(2))
    qd, kd, vd = (cupy.asarray(x) for x in (q, k, v))
    o, lse = cuflash.attention(qd, kd, vd, causal=causal, return_lse=True)
    do_host = make_array(rng, o.shape, dtype)
    do = cupy.asarray(do_host)
    runs = [cuflash.attention_backward(do, qd, kd, vd, o, lse, causal=causal, deterministic=True)
            for _ in range(3)]
    for again in runs[1:]:
        for a, b in zip(runs[0], again):
            assert (a.view(numpy.uint16) == b.view(numpy.uint16)).all()
    assert all(float(cupy.abs(g.astype(numpy.float32)).max()) > 0 for g in runs[0])
    check_grads(qd, kd, vd, do, causal, runs[0])
    assert set(launched) == {"bwd_sm80.cu"}


def test_deterministic_memory_is_linear_in_sequence_length(launched):
    """bwd_sm80's deterministic=True adds one semaphore per query tile, not a partial dQ per
    key tile (bwd_simt's would be 8192 / 32 x L x d float32 here: 512 MB)."""
    import cupy
    _sm80_or_skip()
    L, d = 8192, 64
    rng = numpy.random.default_rng(13)
    q, k, v, do = (cupy.asarray(make_array(rng, (1, 1, L, d), BF16)) for _ in range(4))
    o, lse = cuflash.attention(q, k, v, return_lse=True)
    cuflash.attention_backward(do, q, k, v, o, lse, deterministic=True)   # compile, warm up
    cupy.cuda.Device().synchronize()
    pool = cupy.get_default_memory_pool()
    pool.free_all_blocks()
    before = pool.total_bytes()
    grads = cuflash.attention_backward(do, q, k, v, o, lse, deterministic=True)
    cupy.cuda.Device().synchronize()
    grown = pool.total_bytes() - before
    one = L * d * 4
    assert grown <= 12 * one, (grown, one)
    assert set(launched) == {"bwd_sm80.cu"}
    del grads


# -- the Hopper backward (bwd_sm90): both ways of writing dk, dv; both grid orders -------------

@pytest.mark.parametrize("dtype", [F16, BF16], ids=["f16", "bf16"])
@pytest.mark.parametrize("d, dv", [(64, 64), (128, 128), (111, 72), (33, 48)])
def test_hopper_direct_and_buffered_gradients(launched, dtype, d, dv):
    """k not broadcast and v broadcast over the heads: bwd_sm90 writes dk straight into the
    result in the input dtype (out_flags) and dv through the float32 buffer and CuPy's sum;
    then the other way round. Odd head dims take the element-wise stores."""
    _hopper_or_skip()
    rng = numpy.random.default_rng(d + dv)
    q = make_array(rng, (2, 3, 200, d), dtype)
    k_full, k_bc = make_array(rng, (2, 3, 333, d), dtype), make_array(rng, (2, 1, 333, d), dtype)
    v_full, v_bc = make_array(rng, (2, 3, 333, dv), dtype), make_array(rng, (2, 1, 333, dv), dtype)
    run_and_check(q, k_full, v_bc, causal=False)
    run_and_check(q, k_bc, v_full, causal=True)
    run_and_check(q, k_full, v_full, causal=True)
    assert launched == ["bwd_sm90.cu"] * 3


@pytest.mark.parametrize("order", ["0", "1"])
@pytest.mark.parametrize("d", [64, 128])
def test_hopper_grid_orders(launched, monkeypatch, order, d):
    """Batch-major and tile-major block order (CUFLASH_GRID_ORDER) over 216 key tiles (more
    than one wave of an H200's 132 SMs), causal (its default is tile-major), with a last key
    tile that is not whole."""
    _hopper_or_skip()
    setenv(monkeypatch, "CUFLASH_GRID_ORDER", order)
    rng = numpy.random.default_rng(21)
    q, k, v = (make_array(rng, (4, 9, 700, d), BF16) for _ in range(3))
    run_and_check(q, k, v, causal=True)
    assert launched == ["bwd_sm90.cu"]


@pytest.mark.parametrize("tiles", ["", "bwd_sm90:64=64:2:1"])
def test_hopper_key_tiles_without_query_tiles(launched, monkeypatch, tiles):
    """d = 64 with the table's tiles and with 64-row query tiles: top-left causal with
    Lk > Lq, so that the key tiles past the last query have no query tile at all (their dK, dV
    are zero), bottom-right with rows that see no key, and no mask; 324 key tiles."""
    _hopper_or_skip()
    if tiles:
        setenv(monkeypatch, "CUFLASH_TILES", tiles)
    rng = numpy.random.default_rng(22)
    q = make_array(rng, (4, 9, 200, 64), F16)
    k, v = (make_array(rng, (4, 9, 1100, 64), F16) for _ in range(2))
    run_and_check(q, k, v, causal="top_left")
    run_and_check(k, q, q, causal=True)
    run_and_check(q, k, v, causal=False)
    assert launched == ["bwd_sm90.cu"] * 3


@pytest.mark.parametrize("fuse", ["1", "0"])
def test_hopper_dq_rounded_by_the_main_kernel_or_after_it(launched, monkeypatch, fuse):
    """CUFLASH_FUSE_DQ=1 (the default): bwd_sm90 rounds dQ itself, the block of a batch item
    that arrives last at a query tile's counter converting it; 0: bwd_finish_dq does. Both
    against the reference: more query tiles than key tiles and the other way round, causal
    both alignments (query tiles that no key tile sees keep dQ = 0), an odd head dim (the
    element-wise conversion), 5 x 7 batch items (counters per item), and a broadcast q (its
    gradient is summed: never fused)."""
    _hopper_or_skip()
    from cuflash import _api
    setenv(monkeypatch, "CUFLASH_FUSE_DQ", fuse)
    rng = numpy.random.default_rng(23)
    for (Lq, Lk, d, causal) in [(700, 90, 64, "top_left"), (90, 700, 128, True),
                                (333, 333, 111, False), (257, 129, 72, True)]:
        q = make_array(rng, (5, 7, Lq, d), BF16)
        k, v = (make_array(rng, (5, 7, Lk, d), BF16) for _ in range(2))
        run_and_check(q, k, v, causal=causal)
    plans = [p for p in _api._BWD_PLANS._d.values() if hasattr(p, "fused_dq")]
    assert plans and all(p.fused_dq == (fuse == "1") for p in plans)
    assert all((p.finish is None) == p.fused_dq for p in plans)
    _api.clear_plans()
    q = make_array(rng, (1, 7, 200, 64), BF16)         # q broadcast over the first dim
    k, v = (make_array(rng, (5, 7, 300, 64), BF16) for _ in range(2))
    run_and_check(q, k, v, causal=True)
    plans = [p for p in _api._BWD_PLANS._d.values() if hasattr(p, "fused_dq")]
    assert plans and not any(p.fused_dq for p in plans)
    assert launched == ["bwd_sm90.cu"] * 5
