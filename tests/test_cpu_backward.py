"""The backward pass on the CPU: the float64 reference gradients against finite differences,
the blocked CPU backward (FlashAttention-2, Algorithm 2) against the reference, the public
functions ``attention_backward`` and ``attention_vjp``, and their validation."""

from __future__ import annotations

import math
import re
import tracemalloc

import ml_dtypes
import numpy
import pytest
from hypothesis import example, given, target
from hypothesis import strategies as st

import cuflash
from cuflash import _numpy, _problem
from _inputs import CAUSAL, DTYPES, make_array
from cuflash._tolerance import eps
from cuflash.testing import AttentionCase, assert_attention_close, attention_cases

F64 = numpy.dtype(numpy.float64)


def shapes_of(q, k, v):
    return q.shape, k.shape, v.shape


def forward_and_do(q, k, v, scale, causal, rng, do_layout="c"):
    """o and lse from cuflash's forward (as a user has them), and a random do."""
    o, lse = cuflash.attention(q, k, v, scale=scale, causal=causal, return_lse=True)
    do = make_array(rng, o.shape, q.dtype, do_layout)
    return o, lse, do


# -- the reference against central finite differences ----------------------------------------

FD_CASES = [
    # q shape, k shape, v shape, causal
    ((2, 1, 5, 3), (1, 2, 7, 3), (2, 2, 7, 2), False),      # broadcasting both ways, d != dv
    ((2, 1, 5, 3), (1, 2, 7, 3), (2, 2, 7, 2), True),       # Lq < Lk, bottom-right
    ((2, 1, 5, 3), (1, 2, 7, 3), (2, 2, 7, 2), "top_left"),
    ((2, 3, 6, 4), (2, 1, 4, 4), (2, 1, 4, 5), True),       # GQA, Lq > Lk: 2 rows see no key
    ((2, 3, 6, 4), (2, 1, 4, 4), (2, 1, 4, 5), "top_left"),  # GQA, keys all seen
    ((4, 2), (3, 2), (3, 3), False),                        # no batch dims
]


def finite_difference(f, x, h=1e-6):
    """Central differences of the scalar f at every element of x (float64)."""
    grad = numpy.empty_like(x)
    for idx in numpy.ndindex(*x.shape):
        orig = x[idx]
        x[idx] = orig + h
        up = f()
        x[idx] = orig - h
        down = f()
        x[idx] = orig
        grad[idx] = (up - down) / (2 * h)
    return grad


@pytest.mark.parametrize("qs, ks, vs, causal", FD_CASES, ids=[str(c) for c in range(len(FD_CASES))])
def test_reference_gradients_match_finite_differences(qs, ks, vs, causal):
    rng = numpy.random.default_rng(sum(qs) + sum(ks))
    q, k, v = (rng.standard_normal(s) for s in (qs, ks, vs))
    scale = 0.7
    o = cuflash.reference.attention(q, k, v, scale=scale, causal=causal)
    do = rng.standard_normal(o.shape)

    def loss():
        return float((do * cuflash.reference.attention(q, k, v, scale=scale, causal=causal)).sum())

    grads = cuflash.reference.attention_backward(do, q, k, v, scale=scale, causal=causal)
    for name, x, g in zip("qkv", (q, k, v), grads):
        assert g.shape == x.shape and g.dtype == F64
        fd = finite_difference(loss, x)
        # central differences: truncation O(h^2) ~ 1e-12, cancellation ~ 1e-16 / h ~ 1e-10
        numpy.testing.assert_allclose(g, fd, rtol=1e-6, atol=1e-8, err_msg=f"d{name}")
    if causal is True and qs[-2] > ks[-2]:
        assert (grads[0][..., : qs[-2] - ks[-2], :] == 0).all()   # rows that see no key


def test_reference_gradients_definition_by_loop():
    """One small case against the chain rule written out element by element, with math.fsum."""
    rng = numpy.random.default_rng(11)
    Lq, Lk, d, dv, scale = 3, 4, 2, 3, 0.9
    q, k, v = rng.standard_normal((Lq, d)), rng.standard_normal((Lk, d)), rng.standard_normal((Lk, dv))
    do = rng.standard_normal((Lq, dv))
    dq, dk, dvv = (numpy.zeros_like(x) for x in (q, k, v))
    for i in range(Lq):
        keys = [j for j in range(Lk) if j <= i + Lk - Lq]           # causal, bottom-right
        s = [scale * math.fsum(q[i, c] * k[j, c] for c in range(d)) for j in keys]
        w = [math.exp(x - max(s)) for x in s]
        p = [x / math.fsum(w) for x in w]
        dp = [math.fsum(do[i, c] * v[j, c] for c in range(dv)) for j in keys]
        dsum = math.fsum(a * b for a, b in zip(p, dp))
        for t, j in enumerate(keys):
            ds = p[t] * (dp[t] - dsum)
            dq[i] += scale * ds * k[j]
            dk[j] += scale * ds * q[i]
            dvv[j] += p[t] * do[i]
    got = cuflash.reference.attention_backward(do, q, k, v, scale=scale, causal=True)
    for a, b in zip(got, (dq, dk, dvv)):
        numpy.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)


# -- the CPU backward against the reference ---------------------------------------------------

def check_backward(q, k, v, scale, causal, do, grads) -> float:
    case = AttentionCase.from_arrays(q, k, v, do=do, scale=scale, causal=causal)
    return assert_attention_close(None, case, grads=grads, check_dtype=True)


@given(case=attention_cases(min_seqlen=0), blocks=st.tuples(st.integers(1, 257), st.integers(1, 257)))
@example(  # GQA, ragged, causal bottom-right with rows that see no key, tiles across the diagonal
    case=AttentionCase.make("float16", (2, 2, 3, 37, 40), (2, 2, 1, 29, 40), (2, 2, 1, 29, 24),
                            seed=1, layouts=("c", "transposed", "strided", "reversed"),
                            causal=True),
    blocks=(8, 5)).via("GQA, ragged, bottom-right causal with rows that see no key")
def test_backward_matches_reference(case, blocks):
    """The blocked backward with drawn tile sizes, into NaN-poisoned outputs."""
    q, k, v, do = case.q, case.k, case.v, case.do
    prob = _problem.make_problem(q, k, v, **{"scale": None, "causal": False, **case.kwargs})
    o, lse = cuflash.attention(q, k, v, return_lse=True, **case.kwargs)
    if 0 in prob.batch_shape or prob.Lq == 0 or prob.Lk == 0:
        grads = cuflash.attention_backward(do, q, k, v, o, lse, **case.kwargs)
        assert all((g == 0).all() for g in grads)
    else:
        grads = tuple(numpy.full(x.shape, numpy.nan, q.dtype) for x in (q, k, v))
        # from one row per block to one block for all; at most 16 blocks, to stay fast
        block_m, block_n = (max(min(b, L + 1), math.ceil(L / 16))
                            for b, L in zip(blocks, (prob.Lq, prob.Lk)))
        _numpy.backward(prob, do, o, lse, *grads, block_m=block_m, block_n=block_n)
    target(assert_attention_close(None, case, grads=grads, check_dtype=True),
           label="error / tolerance")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", CAUSAL, ids=str)
def test_public_backward_grouped_query(dtype, causal):
    """GQA: dk, dv are summed over the group axis, equal to the per-group gradients summed."""
    rng = numpy.random.default_rng(5)
    B, Hkv, G, Lq, Lk, d, dv = 2, 2, 3, 19, 13, 16, 8
    q = make_array(rng, (B, Hkv, G, Lq, d), dtype)
    k = make_array(rng, (B, Hkv, 1, Lk, d), dtype, "transposed")
    v = make_array(rng, (B, Hkv, 1, Lk, dv), dtype, "strided")
    o, lse, do = forward_and_do(q, k, v, None, causal, rng)
    dq, dk, dvv = cuflash.attention_backward(do, q, k, v, o, lse, causal=causal)
    assert dq.shape == q.shape and dk.shape == k.shape and dvv.shape == v.shape
    assert all(g.flags.c_contiguous and g.dtype == dtype for g in (dq, dk, dvv))
    check_backward(q, k, v, None, causal, do, (dq, dk, dvv))
    if dtype == F64:  # against materialised per-group copies of k and v, summed by hand
        k_full, v_full = (numpy.broadcast_to(x, (B, Hkv, G) + x.shape[-2:]).copy() for x in (k, v))
        _, dk_full, dv_full = cuflash.attention_backward(do, q, k_full, v_full, o, lse, causal=causal)
        numpy.testing.assert_allclose(dk, dk_full.sum(axis=2, keepdims=True), rtol=1e-12, atol=1e-14)
        numpy.testing.assert_allclose(dvv, dv_full.sum(axis=2, keepdims=True), rtol=1e-12, atol=1e-14)


@given(dtype=st.sampled_from(DTYPES), Lk=st.integers(0, 20), extra=st.integers(1, 20),
       dv=st.integers(1, 9), seed=st.integers(0, 2**32 - 1))
def test_rows_without_keys_get_exactly_zero_gradients(dtype, Lk, extra, dv, seed):
    """Bottom-right causal with Lq > Lk: the first Lq - Lk rows see no key, lse = -inf."""
    rng = numpy.random.default_rng(seed)
    Lq = Lk + extra
    q, k, v = (make_array(rng, s, dtype) for s in ((2, Lq, 4), (2, Lk, 4), (2, Lk, dv)))
    o, lse, do = forward_and_do(q, k, v, None, True, rng)
    do[:, :extra] = numpy.nan   # ignored: those outputs are constant 0
    with numpy.errstate(over="raise", divide="raise"):
        dq, dk, dvv = cuflash.attention_backward(do, q, k, v, o, lse, causal=True)
    assert (dq[:, :extra] == 0).all()
    for g in (dq, dk, dvv):
        assert numpy.isfinite(g.astype(numpy.float64)).all()
    do[:, :extra] = 0
    check_backward(q, k, v, None, True, do, (dq, dk, dvv))


@pytest.mark.parametrize("causal", ["bottom_right", "top_left"])
def test_causal_tiling_every_small_geometry(causal):
    """Every Lq, Lk <= 6 with every tile size <= 3: the diagonal crosses tiles every way."""
    rng = numpy.random.default_rng(2)
    for Lq in range(1, 7):
        for Lk in range(1, 7):
            q, k, v = (make_array(rng, (2, L, 3), F64) for L in (Lq, Lk, Lk))
            prob = _problem.make_problem(q, k, v, scale=None, causal=causal)
            o, lse, do = forward_and_do(q, k, v, None, causal, rng)
            ref = cuflash.reference.attention_backward(do, q, k, v, causal=causal)
            for block_m in range(1, 4):
                for block_n in range(1, 4):
                    grads = tuple(numpy.full(x.shape, numpy.nan) for x in (q, k, v))
                    _numpy.backward(prob, do, o, lse, *grads, block_m=block_m, block_n=block_n)
                    for g, r in zip(grads, ref):
                        numpy.testing.assert_allclose(g, r, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("shapes", [
    ((0, 4), (5, 4), (5, 3)),              # Lq == 0
    ((3, 4), (0, 4), (0, 3)),              # Lk == 0
    ((2, 0, 6, 4), (5, 4), (5, 3)),        # a batch dimension of 0
    ((2, 1, 6, 4), (1, 0, 5, 4), (5, 3)),  # a batch dimension of 0 by broadcasting
], ids=["Lq=0", "Lk=0", "batch=0", "broadcast-batch=0"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_empty_problems_give_zeros_without_a_backend(monkeypatch, shapes, dtype):
    monkeypatch.setattr(_numpy, "backward", _no_backend)
    q, k, v = (numpy.ones(s, dtype) for s in shapes)
    o, lse = cuflash.attention(q, k, v, return_lse=True)
    grads = cuflash.attention_backward(numpy.ones_like(o), q, k, v, o, lse)
    for g, x in zip(grads, (q, k, v)):
        assert g.shape == x.shape and g.dtype == dtype and (g == 0).all()


def _no_backend(*args, **kwargs):
    raise AssertionError("a backend was called")


# -- attention_vjp, determinism, memory --------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_vjp_pullback_equals_attention_backward(dtype):
    rng = numpy.random.default_rng(6)
    q = make_array(rng, (2, 3, 33, 16), dtype)
    k, v = (make_array(rng, (2, 1, 47, 16), dtype) for _ in range(2))
    o, pullback = cuflash.attention_vjp(q, k, v, scale=0.3, causal="top_left")
    o2, lse = cuflash.attention(q, k, v, scale=0.3, causal="top_left", return_lse=True)
    assert o.tobytes() == o2.tobytes()
    for seed in (1, 2):  # the pullback may be called again
        do = make_array(numpy.random.default_rng(seed), o.shape, dtype)
        got = pullback(do)
        want = cuflash.attention_backward(do, q, k, v, o2, lse, scale=0.3, causal="top_left")
        for a, b in zip(got, want):
            assert a.dtype == dtype and a.tobytes() == b.tobytes()


def test_cpu_backward_is_deterministic_either_way():
    rng = numpy.random.default_rng(7)
    q, k, v = (make_array(rng, (3, 150, 32), numpy.float32) for _ in range(3))
    o, lse, do = forward_and_do(q, k, v, None, True, rng)
    runs = [cuflash.attention_backward(do, q, k, v, o, lse, causal=True, deterministic=det)
            for det in (False, True, numpy.bool_(True))]
    for run in runs[1:]:
        for a, b in zip(run, runs[0]):
            assert a.tobytes() == b.tobytes()


def _backward_peaks(threads: int, monkeypatch) -> dict[int, int]:
    """Peak traced bytes of one causal backward at L = 1024 and 4096 (d = 16, float32)."""
    monkeypatch.setattr(cuflash._numpy, "THREADS", threads)
    rng = numpy.random.default_rng(4)
    peaks = {}
    for L in (1024, 4096):
        q, k, v = (make_array(rng, (L, 16), numpy.float32) for _ in range(3))
        o, lse, do = forward_and_do(q, k, v, None, True, rng)
        tracemalloc.start()
        try:
            cuflash.attention_backward(do, q, k, v, o, lse, causal=True)
            _, peaks[L] = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    return peaks


def test_backward_memory_is_linear_in_sequence_length(monkeypatch):
    """No Lq x Lk matrix: peak memory is bounded by the tiles (a few MiB) plus O(L * d).

    On one thread the peak is a function of the shapes alone (measured 3.8 MB at L = 1024 and
    6.1 MB at L = 4096): 16x the scores, the same tiles, so the peak grows by the O(L * d)
    buffers only, far from 16x. On two threads it depends on which tasks happen to overlap
    (4.3-6.0 MB at L = 1024 over three runs), so there it is bounded by two tasks' worth of
    the one-thread peak, not compared across lengths.
    """
    score_matrix = 4096 * 4096 * 4
    one = _backward_peaks(1, monkeypatch)
    assert one[4096] < 2.5 * one[1024], f"one thread: peak {one}"
    two = _backward_peaks(2, monkeypatch)
    for L in one:
        assert two[L] < 2 * one[L], f"two threads: peak {two}, one thread: {one}"
    assert two[4096] < score_matrix / 4, f"two threads: peak {two}; the score matrix is {score_matrix}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_tolerance_rejects_a_wrong_gradient(dtype):
    """One element off by 100 ulps (of the largest value) fails the comparison.

    (The bound on this input: ~4 ulps for float16/bfloat16, 30-60 for float32/float64; see
    tests/_tolerance_bwd.py.)"""
    rng = numpy.random.default_rng(8)
    q, k, v = (make_array(rng, (2, 64, 32), dtype) for _ in range(3))
    o, lse, do = forward_and_do(q, k, v, None, False, rng)
    grads = cuflash.attention_backward(do, q, k, v, o, lse)
    check_backward(q, k, v, None, False, do, grads)
    for which in range(3):
        bad = [g.copy() for g in grads]
        bad[which][1, 7, 3] += 100 * eps(dtype) * abs(bad[which].astype(numpy.float64)).max()
        with pytest.raises(AssertionError, match=f"{'d' + 'qkv'[which]}: max abs error"):
            check_backward(q, k, v, None, False, do, bad)


# -- validation: do, o, lse, deterministic -----------------------------------------------------

ENTRY_POINTS = ["backward", "vjp", "reference"]


@pytest.fixture(autouse=False)
def no_backend(monkeypatch):
    monkeypatch.setattr(_numpy, "backward", _no_backend)


def _inputs(dtype=numpy.float32):
    rng = numpy.random.default_rng(0)
    q = rng.standard_normal((3, 1, 4, 8)).astype(dtype)   # batch_shape (3, 2), Lq 4, dv 6
    k = rng.standard_normal((2, 5, 8)).astype(dtype)
    v = rng.standard_normal((2, 5, 6)).astype(dtype)
    o, lse = cuflash.attention(q, k, v, return_lse=True)
    return q, k, v, numpy.ones_like(o), o, lse


def call(entry, do, q, k, v, o, lse, **kw):
    if entry == "backward":
        return cuflash.attention_backward(do, q, k, v, o, lse, **kw)
    if entry == "reference":
        return cuflash.reference.attention_backward(do, q, k, v, **kw)
    _, pullback = cuflash.attention_vjp(q, k, v, **kw)
    return pullback(do)


def raises(exception, message):
    return pytest.raises(exception, match=re.escape(message))


@pytest.mark.usefixtures("no_backend")
@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_do_of_the_wrong_kind_is_an_error(entry):
    q, k, v, do, o, lse = _inputs()
    with raises(TypeError, "do must be a numpy.ndarray or cupy.ndarray, got builtins.list"):
        call(entry, do.tolist(), q, k, v, o, lse)
    with raises(TypeError, "do.dtype=float64 must equal the inputs' dtype float32"):
        call(entry, do.astype(numpy.float64), q, k, v, o, lse)
    with raises(TypeError, "do.dtype=bfloat16 must equal the inputs' dtype float32"):
        call(entry, do.astype(ml_dtypes.bfloat16), q, k, v, o, lse)
    with raises(ValueError, "do.shape=(3, 2, 4, 5) must be batch_shape + (Lq, dv) = (3, 2, 4, 6)"):
        call(entry, do[..., :5], q, k, v, o, lse)
    with raises(ValueError, "do.shape=(2, 4, 6) must be batch_shape + (Lq, dv) = (3, 2, 4, 6)"):
        call(entry, do[0], q, k, v, o, lse)


@pytest.mark.usefixtures("no_backend")
def test_o_and_lse_of_the_wrong_kind_are_errors():
    q, k, v, do, o, lse = _inputs()
    with raises(TypeError, "o must be a numpy.ndarray or cupy.ndarray, got builtins.NoneType"):
        cuflash.attention_backward(do, q, k, v, None, lse)
    with raises(TypeError, "o.dtype=float16 must equal the inputs' dtype float32"):
        cuflash.attention_backward(do, q, k, v, o.astype(numpy.float16), lse)
    with raises(ValueError, "o.shape=(3, 2, 3, 6) must be batch_shape + (Lq, dv) = (3, 2, 4, 6)"):
        cuflash.attention_backward(do, q, k, v, o[..., 1:, :], lse)
    with raises(TypeError, "lse.dtype=float64 must equal the lse dtype of the inputs float32"):
        cuflash.attention_backward(do, q, k, v, o, lse.astype(numpy.float64))
    with raises(ValueError, "lse.shape=(3, 2, 4, 1) must be batch_shape + (Lq,) = (3, 2, 4)"):
        cuflash.attention_backward(do, q, k, v, o, lse[..., None])
    with raises(TypeError, "lse must be a numpy.ndarray or cupy.ndarray, got builtins.float"):
        cuflash.attention_backward(do, q, k, v, o, 0.0)
    q64, k64, v64, do64, o64, lse64 = _inputs(numpy.float64)
    with raises(TypeError, "lse.dtype=float32 must equal the lse dtype of the inputs float64"):
        cuflash.attention_backward(do64, q64, k64, v64, o64, lse64.astype(numpy.float32))


@pytest.mark.usefixtures("no_backend")
@pytest.mark.parametrize("deterministic", [None, 1, "yes"], ids=repr)
def test_deterministic_of_the_wrong_type_is_a_type_error(deterministic):
    q, k, v, do, o, lse = _inputs()
    with raises(TypeError, f"deterministic must be a bool, got {deterministic!r}"):
        cuflash.attention_backward(do, q, k, v, o, lse, deterministic=deterministic)
    with raises(TypeError, f"deterministic must be a bool, got {deterministic!r}"):
        cuflash.attention_vjp(q, k, v, deterministic=deterministic)


@pytest.mark.usefixtures("no_backend")
@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_forward_validation_applies_to_the_backward(entry):
    q, k, v, do, o, lse = _inputs()
    with raises(ValueError, "head dims of q and k differ"):
        call(entry, do, q, k[..., :4], v, o, lse)
    with raises(ValueError, "scale must be finite and positive, got scale=-1.0"):
        call(entry, do, q, k, v, o, lse, scale=-1.0)
    with raises(TypeError, "causal must be a bool, 'bottom_right' or 'top_left', got 1"):
        call(entry, do, q, k, v, o, lse, causal=1)


def test_cupy_arguments_mixed_with_numpy_are_errors():
    cupy = pytest.importorskip("cupy")
    from test_validation import fake_cupy
    q, k, v = fake_cupy((3, 4, 8)), fake_cupy((5, 8)), fake_cupy((5, 6))
    do, o = fake_cupy((3, 4, 6)), fake_cupy((3, 4, 6))
    lse = fake_cupy((3, 4))
    with raises(TypeError, "do must be a cupy.ndarray like q, k and v, got a numpy.ndarray"):
        cuflash.attention_backward(numpy.ones((3, 4, 6), numpy.float32), q, k, v, o, lse)
    with raises(TypeError, "lse must be a cupy.ndarray like q, k and v, got a numpy.ndarray"):
        cuflash.attention_backward(do, q, k, v, o, numpy.ones((3, 4), numpy.float32))
    with raises(ValueError, "o is on device 1 but the inputs are on device 0"):
        cuflash.attention_backward(do, q, k, v, fake_cupy((3, 4, 6), device=1), lse)
    assert isinstance(q, cupy.ndarray)
