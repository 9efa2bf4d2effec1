"""The float64 oracle against formulas written out independently, element by element."""

from __future__ import annotations

import math

import numpy
import pytest
from hypothesis import given

import cuflash
from cuflash import _problem
from _inputs import CAUSAL, DTYPES, make_array, poisoned_out
from cuflash._tolerance import lse_tolerance, tolerance
from cuflash.testing import attention_cases


def direct_attention(q, k, v, scale, causal):
    """Attention row by row with math.exp and math.fsum, from the definition.

    Independent of cuflash: broadcasting by numpy.broadcast_arrays, the default scale and the
    mask alignments written out here.
    """
    batch = numpy.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    q, k, v = (numpy.broadcast_to(x.astype(numpy.float64), batch + x.shape[-2:])
               for x in (q, k, v))
    (Lq, d), (Lk, dv) = q.shape[-2:], v.shape[-2:]
    scale = 1 / math.sqrt(d) if scale is None else scale
    offset = {False: None, True: Lk - Lq, "bottom_right": Lk - Lq, "top_left": 0}[causal]
    o, lse = numpy.empty(batch + (Lq, dv)), numpy.empty(batch + (Lq,))
    for b in numpy.ndindex(*batch):
        for i in range(Lq):
            keys = [j for j in range(Lk) if offset is None or j <= i + offset]
            if not keys:
                o[b + (i,)], lse[b + (i,)] = 0.0, -math.inf
                continue
            s = [scale * math.fsum(q[b + (i, c)] * k[b + (j, c)] for c in range(d)) for j in keys]
            m = max(s)
            w = [math.exp(x - m) for x in s]
            total = math.fsum(w)
            for c in range(dv):
                o[b + (i, c)] = math.fsum(wj * v[b + (j, c)] for wj, j in zip(w, keys)) / total
            lse[b + (i,)] = m + math.log(total)
    return o, lse


@given(case=attention_cases(min_seqlen=0, max_seqlen=6, head_dims=range(1, 6), max_batch_dims=2))
def test_reference_matches_the_definition(case):
    q, k, v = case.q, case.k, case.v
    scale, causal = case.kwargs["scale"], case.kwargs["causal"]
    Lk = k.shape[-2]
    o, lse = cuflash.reference.attention(q, k, v, scale=scale, causal=causal, return_lse=True)
    o_def, lse_def = direct_attention(q, k, v, scale, causal)

    assert o.dtype == lse.dtype == numpy.float64
    assert o.shape == o_def.shape and lse.shape == lse_def.shape
    assert ((lse == -math.inf) == (lse_def == -math.inf)).all()
    assert (o[lse == -math.inf] == 0).all()
    # Both are float64 computations of the same numbers: the rounding noise of float64 bounds
    # the difference (the reference plays the part of the naive computation, error 0 here).
    finite = numpy.isfinite(lse_def)
    if finite.any():
        prob = _problem.make_problem(q, k, v, scale=scale, causal=causal)
        q64, k64, v64 = (x.astype(numpy.float64) for x in (prob.q, prob.k, prob.v))
        logit_bound = prob.scale * float((abs(q64) @ abs(k64).swapaxes(-1, -2)).max())
        tol = tolerance(0.0, numpy.float64, weighted_abs_v=float(abs(v64).max()),
                        logit_bound=logit_bound, Lk=Lk)
        lse_tol = lse_tolerance(0.0, numpy.float64, max_abs_lse=float(abs(lse_def[finite]).max()),
                                logit_bound=logit_bound, Lk=Lk)
        numpy.testing.assert_allclose(o, o_def, rtol=0, atol=tol)
        numpy.testing.assert_allclose(lse[finite], lse_def[finite], rtol=0, atol=lse_tol)


def test_a_hand_computed_example():
    """Two keys, scores 1 and 0: weights e/(e+1) and 1/(e+1)."""
    q = numpy.array([[1.0, 0.0]])
    k = numpy.array([[1.0, 0.0], [0.0, 1.0]])
    v = numpy.array([[1.0, 10.0], [2.0, 20.0]])
    o, lse = cuflash.reference.attention(q, k, v, scale=1.0, return_lse=True)
    e = math.e
    numpy.testing.assert_allclose(o, [[(e + 2) / (e + 1), (10 * e + 20) / (e + 1)]], rtol=1e-15)
    numpy.testing.assert_allclose(lse, [math.log(e + 1)], rtol=1e-15)
    # the default scale is 1/sqrt(d)
    o_default = cuflash.reference.attention(q, k, v)
    o_explicit = cuflash.reference.attention(q, k, v, scale=1 / math.sqrt(2))
    assert (o_default == o_explicit).all()


@pytest.mark.parametrize("Lq, Lk", [(2, 3), (3, 3), (4, 2), (1, 5), (5, 1)])
@pytest.mark.parametrize("causal", CAUSAL)
def test_mask_geometry(Lq, Lk, causal):
    """With q = 0 every visible key weighs the same, and v = identity shows which are visible.

    Bottom-right: query i sees key j iff j <= i + Lk - Lq; top-left: iff j <= i.
    """
    q = numpy.zeros((Lq, 3))
    k = make_array(numpy.random.default_rng(0), (Lk, 3), numpy.float64)
    v = numpy.eye(Lk)
    o, lse = cuflash.reference.attention(q, k, v, causal=causal, return_lse=True)
    i, j = numpy.arange(Lq)[:, None], numpy.arange(Lk)[None, :]
    visible = {False: numpy.ones((Lq, Lk), bool), True: j <= i + Lk - Lq,
               "bottom_right": j <= i + Lk - Lq, "top_left": j <= i}[causal]
    count = visible.sum(axis=1)
    expected = numpy.where(visible, 1.0 / numpy.maximum(count, 1)[:, None], 0.0)
    numpy.testing.assert_allclose(o, expected, rtol=1e-15, atol=0)
    log_count = numpy.log(numpy.maximum(count, 1))
    numpy.testing.assert_allclose(lse, numpy.where(count > 0, log_count, -numpy.inf), rtol=1e-15)


def test_rows_without_keys():
    """Lk == 0, and bottom-right causal with Lq > Lk: exactly 0 and -inf, no NaN."""
    rng = numpy.random.default_rng(1)
    q = make_array(rng, (2, 5, 4), numpy.float32)
    k, v = numpy.ones((0, 4), numpy.float32), numpy.ones((0, 3), numpy.float32)
    with numpy.errstate(over="raise", divide="raise", invalid="raise"):
        o, lse = cuflash.reference.attention(q, k, v, return_lse=True)
    assert o.shape == (2, 5, 3) and (o == 0).all() and (lse == -numpy.inf).all()

    k, v = make_array(rng, (3, 4), numpy.float32), make_array(rng, (3, 3), numpy.float32)
    with numpy.errstate(over="raise", divide="raise", invalid="raise"):
        o, lse = cuflash.reference.attention(q, k, v, causal=True, return_lse=True)
    assert (o[:, :2] == 0).all() and (lse[:, :2] == -numpy.inf).all()
    assert numpy.isfinite(o[:, 2:]).all() and numpy.isfinite(lse[:, 2:]).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_out_receives_the_rounded_result(dtype):
    rng = numpy.random.default_rng(2)
    q, k, v = (make_array(rng, (2, 6, 4), dtype) for _ in range(3))
    out = poisoned_out((2, 6, 4), dtype, "strided")
    o, lse = cuflash.reference.attention(q, k, v, causal="top_left", out=out, return_lse=True)
    expected = cuflash.reference.attention(q, k, v, causal="top_left")
    assert o is out and lse.dtype == numpy.float64
    assert (out == expected.astype(dtype)).all()


def test_return_lse_false_returns_only_the_output():
    rng = numpy.random.default_rng(3)
    q, k, v = (make_array(rng, (3, 4), numpy.float32) for _ in range(3))
    o = cuflash.reference.attention(q, k, v)
    assert isinstance(o, numpy.ndarray) and o.shape == (3, 4) and o.dtype == numpy.float64


@pytest.mark.gpu
def test_reference_accepts_cupy_arrays():
    import cupy

    rng = numpy.random.default_rng(4)
    q, k, v = (make_array(rng, (2, 5, 8), numpy.float32) for _ in range(3))
    o, lse = cuflash.reference.attention(*(cupy.asarray(x) for x in (q, k, v)), causal=True,
                                         return_lse=True)
    o_np, lse_np = cuflash.reference.attention(q, k, v, causal=True, return_lse=True)
    assert isinstance(o, numpy.ndarray) and isinstance(lse, numpy.ndarray)
    assert (o == o_np).all() and (lse == lse_np).all()
    out = cupy.full((2, 5, 8), numpy.nan, numpy.float32)
    assert cuflash.reference.attention(*(cupy.asarray(x) for x in (q, k, v)), causal=True,
                                       out=out) is out
    assert (out.get() == o_np.astype(numpy.float32)).all()
