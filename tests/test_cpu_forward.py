"""The CPU path (``cuflash.attention`` on NumPy arrays) against the float64 reference."""

from __future__ import annotations

import math
import pathlib
import subprocess
import sys
import tracemalloc

import numpy
import pytest
from hypothesis import example, given, target
from hypothesis import strategies as st

import cuflash
from cuflash import _numpy, _problem
from _inputs import CAUSAL, DTYPES, LAYOUTS, make_array, poisoned_out
from cuflash._tolerance import eps
from cuflash.testing import AttentionCase, assert_attention_close, attention_cases

#: The property tests' cases: every dtype, keyword and layout cuflash.testing draws, plus
#: empty sequences (Lq or Lk = 0).
CASES = attention_cases(min_seqlen=0)


def check_against_reference(q, k, v, scale, causal, o, lse) -> float:
    case = AttentionCase.from_arrays(q, k, v, scale=scale, causal=causal)
    return assert_attention_close(o, case, lse=lse, check_dtype=True)


def tile_sizes(data, Lq, Lk):
    """From one row per block to one block for all; at most 16 blocks, to stay fast."""
    return (max(data.draw(st.integers(1, Lq + 1), label="block_m"), math.ceil(Lq / 16)),
            max(data.draw(st.integers(1, Lk + 1), label="block_n"), math.ceil(Lk / 16)))


@given(case=CASES, data=st.data())
def test_forward_matches_reference(case, data):
    """The blocked online softmax, with drawn tile sizes, into a NaN-poisoned strided output."""
    g = case.geometry()
    prob = _problem.make_problem(case.q, case.k, case.v, **{"scale": None, "causal": False,
                                                            **case.kwargs})
    out_layout = data.draw(st.sampled_from(LAYOUTS), label="out_layout")
    o = poisoned_out(g.batch_shape + (g.Lq, g.dv), case.dtype, out_layout)
    lse = numpy.full(g.batch_shape + (g.Lq,), numpy.nan, prob.lse_dtype)
    block_m, block_n = tile_sizes(data, g.Lq, g.Lk)
    _numpy.forward(prob, o, lse, block_m=block_m, block_n=block_n)
    target(assert_attention_close(o, case, lse=lse, check_dtype=True), label="error / tolerance")


@given(case=CASES, return_lse=st.booleans(), out_layout=st.sampled_from((None,) + LAYOUTS))
@example(  # NumPy gives empty arrays stride 0: an empty out= is not self-overlapping
    case=AttentionCase.from_arrays(numpy.ones((0, 1), "f2"), numpy.ones((0, 1), "f2"),
                                   numpy.ones((0, 2), "f2")),
    return_lse=False, out_layout="c")
def test_attention_matches_reference(case, return_lse, out_layout):
    """The public function: empty shapes, out= with any layout, return_lse."""
    g = case.geometry()
    out = None
    if out_layout is not None:
        out = poisoned_out(g.batch_shape + (g.Lq, g.dv), case.dtype, out_layout)
    result = cuflash.attention(case.q, case.k, case.v, return_lse=return_lse, out=out,
                               **case.kwargs)
    if return_lse:
        o, lse = result
        assert lse.flags.c_contiguous
    else:
        o = result
        assert isinstance(o, numpy.ndarray)
        _, lse = cuflash.attention(case.q, case.k, case.v, return_lse=True, **case.kwargs)
    if out is None:
        assert o.flags.c_contiguous
    else:
        assert o is out
    target(assert_attention_close(o, case, lse=lse, check_dtype=True), label="error / tolerance")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_grouped_query_attention_is_broadcasting(dtype):
    """q (B, Hkv, G, Lq, d) with k, v (B, Hkv, 1, Lk, d): each group sees its head's keys."""
    rng = numpy.random.default_rng(1)
    B, Hkv, G, Lq, Lk, d, dv = 2, 3, 4, 9, 13, 16, 8
    q = make_array(rng, (B, Hkv, G, Lq, d), dtype)
    k = make_array(rng, (B, Hkv, 1, Lk, d), dtype, "transposed")
    v = make_array(rng, (B, Hkv, 1, Lk, dv), dtype)
    prob = _problem.make_problem(q, k, v, scale=None, causal=True)
    assert prob.k.strides[2] == prob.v.strides[2] == 0  # a view, not a copy
    o, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    assert o.shape == (B, Hkv, G, Lq, dv)
    check_against_reference(q, k, v, None, True, o, lse)


@pytest.mark.parametrize("causal", ["bottom_right", "top_left"])
def test_causal_tiling_every_small_geometry(causal):
    """Every Lq, Lk <= 7 with every tile size <= 4: the diagonal crosses tiles every way."""
    rng = numpy.random.default_rng(2)
    for Lq in range(1, 8):
        for Lk in range(1, 8):
            q, k, v = (make_array(rng, (2, L, 3), numpy.float64) for L in (Lq, Lk, Lk))
            prob = _problem.make_problem(q, k, v, scale=None, causal=causal)
            for block_m in range(1, 5):
                for block_n in range(1, 5):
                    o = numpy.full((2, Lq, 3), numpy.nan)
                    lse = numpy.full((2, Lq), numpy.nan)
                    _numpy.forward(prob, o, lse, block_m=block_m, block_n=block_n)
                    check_against_reference(q, k, v, None, causal, o, lse)


@given(dtype=st.sampled_from(DTYPES), Lk=st.integers(0, 20), extra=st.integers(1, 20),
       dv=st.integers(1, 9), seed=st.integers(0, 2**32 - 1))
def test_rows_without_keys_are_exactly_zero(dtype, Lk, extra, dv, seed):
    """Bottom-right causal with Lq > Lk: the first Lq - Lk rows see no key (all rows if Lk == 0)."""
    rng = numpy.random.default_rng(seed)
    Lq = Lk + extra
    q, k, v = (make_array(rng, s, dtype) for s in ((2, Lq, 4), (2, Lk, 4), (2, Lk, dv)))
    with numpy.errstate(over="raise", divide="raise", invalid="raise"):  # no 0/0, inf - inf
        o, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    assert (o[:, :extra] == 0).all() and (lse[:, :extra] == -numpy.inf).all()
    assert numpy.isfinite(o[:, extra:].astype(float)).all()
    assert numpy.isfinite(lse[:, extra:]).all()
    check_against_reference(q, k, v, None, True, o, lse)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("sign", [1, -1])
def test_logits_around_1e4_do_not_overflow(dtype, sign):
    """Logits near +-1e4: exp would overflow or underflow without the running max.

    An extra feature column adds sign * 1e4 to every logit (softmax does not change); the
    normal features vary them by hundreds, so the softmax is sharp but not one-hot.
    """
    rng = numpy.random.default_rng(3)
    Lq, Lk, d, dv, scale = 40, 300, 16, 8, 30.0
    q = rng.standard_normal((2, Lq, d + 1))
    k = rng.standard_normal((2, Lk, d + 1))
    q[..., -1] = math.sqrt(1e4 / scale)
    k[..., -1] = sign * math.sqrt(1e4 / scale)
    q, k = q.astype(dtype), k.astype(dtype)
    v = make_array(rng, (2, Lk, dv), dtype)
    with numpy.errstate(over="raise", divide="raise", invalid="raise"):
        o, lse = cuflash.attention(q, k, v, scale=scale, causal=True, return_lse=True)
    assert numpy.isfinite(o.astype(float)).all() and numpy.isfinite(lse).all()
    assert (abs(lse - sign * 1e4) < 1e3).all()
    check_against_reference(q, k, v, scale, True, o, lse)


@given(dtype=st.sampled_from(DTYPES), causal=st.sampled_from(CAUSAL), data=st.data())
def test_nan_in_a_query_row_stays_in_that_row(dtype, causal, data):
    B, Lq, Lk = 3, data.draw(st.integers(1, 20)), data.draw(st.integers(1, 20))
    rng = numpy.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    q, k, v = (make_array(rng, (B, L, 5), dtype) for L in (Lq, Lk, Lk))
    b, i = data.draw(st.integers(0, B - 1)), data.draw(st.integers(0, Lq - 1))
    q[b, i, data.draw(st.integers(0, 4))] = numpy.nan
    o, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
    offset = Lk - Lq if causal in (True, "bottom_right") else 0
    sees_a_key = (not causal) or i + offset >= 0
    poisoned = numpy.zeros(o.shape[:-1], bool)
    poisoned[b, i] = sees_a_key
    assert (numpy.isnan(lse) == poisoned).all()
    assert (numpy.isnan(o.astype(float)).any(axis=-1) == poisoned).all()
    check_against_reference(q, k, v, None, causal, o, lse)


@given(dtype=st.sampled_from(DTYPES), which=st.sampled_from("kv"), data=st.data())
def test_nan_in_a_batch_item_stays_in_that_item(dtype, which, data):
    """A NaN in k or v of one batch item makes that item NaN and leaves the others alone."""
    B, Lq, Lk = 4, data.draw(st.integers(1, 20)), data.draw(st.integers(1, 300))
    rng = numpy.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    arrays = dict(q=make_array(rng, (B, Lq, 5), dtype), k=make_array(rng, (B, Lk, 5), dtype),
                  v=make_array(rng, (B, Lk, 3), dtype))
    clean = {name: x.copy() for name, x in arrays.items()}
    b, j = data.draw(st.integers(0, B - 1)), data.draw(st.integers(0, Lk - 1))
    arrays[which][b, j, data.draw(st.integers(0, arrays[which].shape[-1] - 1))] = numpy.nan
    o, lse = cuflash.attention(**arrays, return_lse=True)
    others = numpy.arange(B) != b
    assert numpy.isnan(o[b].astype(float)).any(axis=-1).all()  # every row sees key j
    assert numpy.isfinite(o[others].astype(float)).all() and numpy.isfinite(lse[others]).all()
    check_against_reference(clean["q"][others], clean["k"][others], clean["v"][others], None,
                            False, o[others], lse[others])


def test_memory_is_linear_in_sequence_length():
    """The Lq x Lk scores never exist: peak memory is bounded by the tiles, not by L * L.

    The CPU path's tiles hold about ``_numpy.TILE_ELEMENTS`` scores per thread (a few MiB in
    all); at L = 8192 the score matrix is 256 MiB, at 2048 16 MiB.
    """
    rng = numpy.random.default_rng(4)
    peaks = {}
    for L in (2048, 8192):
        q, k, v = (make_array(rng, (L, 16), numpy.float32) for _ in range(3))
        tracemalloc.start()
        try:
            cuflash.attention(q, k, v, causal=True)
            _, peaks[L] = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    score_matrix = 8192 * 8192 * 4
    assert peaks[8192] < score_matrix / 16, f"peak {peaks}; the score matrix is {score_matrix}"
    # 16x the scores, the same tiles: the peak grows by the O(L * d) arrays only
    assert peaks[8192] < peaks[2048] + 8 * 8192 * 16 * 4, f"peak {peaks}"


@pytest.mark.parametrize("shapes", [
    ((0, 4), (5, 4), (5, 3)),              # Lq == 0
    ((2, 0, 6, 4), (5, 4), (5, 3)),        # a batch dimension of 0
    ((2, 1, 6, 4), (1, 0, 5, 4), (5, 3)),  # a batch dimension of 0 by broadcasting
], ids=["Lq=0", "batch=0", "broadcast-batch=0"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_empty_results_call_no_backend(monkeypatch, shapes, dtype):
    monkeypatch.setattr(_numpy, "forward", _no_backend)
    q, k, v = (numpy.ones(s, dtype) for s in shapes)
    o, lse = cuflash.attention(q, k, v, return_lse=True)
    batch = numpy.broadcast_shapes(*(s[:-2] for s in shapes))
    assert o.shape == batch + (shapes[0][-2], 3) and o.dtype == dtype
    assert lse.shape == batch + (shapes[0][-2],)
    assert lse.dtype == (numpy.float64 if dtype == numpy.float64 else numpy.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_no_keys_gives_zeros_without_a_backend(monkeypatch, dtype):
    monkeypatch.setattr(_numpy, "forward", _no_backend)
    rng = numpy.random.default_rng(5)
    q = make_array(rng, (2, 3, 4), dtype)
    k, v = numpy.ones((0, 4), dtype), numpy.ones((0, 6), dtype)
    out = poisoned_out((2, 3, 6), dtype, "strided")
    o, lse = cuflash.attention(q, k, v, return_lse=True, out=out)
    assert o is out and (o == 0).all() and (lse == -numpy.inf).all()


def _no_backend(prob, o, lse):
    raise AssertionError("a backend was called")


def test_results_are_deterministic():
    rng = numpy.random.default_rng(6)
    q, k, v = (make_array(rng, (3, 200, 32), numpy.float32) for _ in range(3))
    first = cuflash.attention(q, k, v, causal=True, return_lse=True)
    second = cuflash.attention(q, k, v, causal=True, return_lse=True)
    for a, b in zip(first, second):
        assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_inputs_are_not_copied_or_modified(dtype):
    rng = numpy.random.default_rng(7)
    q = make_array(rng, (2, 3, 5, 8), dtype, "transposed")
    k = make_array(rng, (3, 7, 8), dtype, "strided")
    v = make_array(rng, (1, 7, 4), dtype)
    before = [x.copy() for x in (q, k, v)]
    prob = _problem.make_problem(q, k, v, scale=None, causal=False)
    for x, view in ((q, prob.q), (k, prob.k), (v, prob.v)):
        assert numpy.shares_memory(x, view) and view.strides[-2:] == x.strides[-2:]
    assert prob.k.strides[0] == 0 and prob.v.strides[:2] == (0, 0)
    cuflash.attention(q, k, v)
    for x, b in zip((q, k, v), before):
        assert x.tobytes() == b.tobytes()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_tolerance_rejects_a_wrong_result(dtype):
    """The comparison can fail: one element off by 64 ulps (of the largest value) is caught."""
    rng = numpy.random.default_rng(8)
    q, k, v = (make_array(rng, (2, 64, 32), dtype) for _ in range(3))
    o, lse = cuflash.attention(q, k, v, return_lse=True)
    check_against_reference(q, k, v, None, False, o, lse)
    bad_o, bad_lse = o.copy(), lse.copy()
    bad_o[1, 7, 3] += 64 * eps(dtype) * abs(o).max()
    bad_lse[0, 9] += 64 * eps(dtype) * abs(lse).max()
    with pytest.raises(AssertionError, match="o: max abs error"):
        check_against_reference(q, k, v, None, False, bad_o, lse)
    with pytest.raises(AssertionError, match="lse: max abs error"):
        check_against_reference(q, k, v, None, False, o, bad_lse)


def test_cupy_is_optional():
    """Without CuPy, cuflash imports and the whole CPU path runs."""
    script = """
import sys
sys.modules["cupy"] = None  # `import cupy` now raises ImportError
import numpy, cuflash, cuflash.reference
assert cuflash.__version__ == "0.1.0" and cuflash.__all__ == ["attention", "attention_backward", "attention_varlen", "attention_varlen_vjp", "attention_vjp", "attention_with_kvcache", "block_mask", "captured", "explain", "merge_states", "reference"]
q = numpy.random.default_rng(0).standard_normal((2, 5, 8)).astype(numpy.float32)
o, lse = cuflash.attention(q, q, q, causal=True, return_lse=True)
assert numpy.isfinite(o).all() and o.shape == (2, 5, 8)
assert cuflash.reference.attention(q, q, q).shape == (2, 5, 8)
assert sys.modules["cupy"] is None
"""
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120,
                   cwd=pathlib.Path(cuflash.__file__).parent.parent)


def test_reference_logsumexp_matches_scipy_and_its_edge_cases():
    from cuflash.reference import logsumexp
    inf, nan = numpy.inf, numpy.nan
    rows = numpy.array([[0.0, 1.0, 2.0], [1000.0, 1000.0, -1000.0], [-inf, -inf, -inf],
                        [-inf, 0.0, -inf], [inf, 0.0, 1.0], [nan, 0.0, 1.0], [-1e308, -1e308, 0]])
    got = logsumexp(rows)
    want = [numpy.log(numpy.exp([0.0, 1, 2]).sum()), 1000 + numpy.log(2), -inf, 0.0, inf, nan,
            0.0]
    numpy.testing.assert_allclose(got, want, rtol=1e-15)
    assert logsumexp(numpy.zeros((3, 0))).tolist() == [-inf] * 3
    scipy_special = pytest.importorskip("scipy.special")
    x = numpy.random.default_rng(0).standard_normal((4, 5, 33)) * 50
    numpy.testing.assert_allclose(logsumexp(x), scipy_special.logsumexp(x, axis=-1), rtol=1e-14)


def test_cpu_path_threads_and_tiles_do_not_change_results(monkeypatch):
    """One thread or several, inline or pooled, default or tiny tiles: the same values."""
    rng = numpy.random.default_rng(7)
    q, k, v = (make_array(rng, (3, 2, 300, 16), numpy.float32) for _ in range(3))
    do = make_array(rng, (3, 2, 300, 16), numpy.float32)
    monkeypatch.setattr(_numpy, "INLINE_SCORES", 0)        # always use the pool
    results = []
    for threads in (1, 2, 3):
        monkeypatch.setattr(_numpy, "THREADS", threads)
        o, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
        grads = cuflash.attention_backward(do, q, k, v, o, lse, causal=True)
        results.append((o, lse) + grads)
    for other in results[1:]:
        for a, b in zip(other, results[0]):
            assert a.tobytes() == b.tobytes()  # the tasks split work, never reorder a sum
    monkeypatch.setattr(_numpy, "TILE_ELEMENTS", 64)       # many small tiles and groups
    monkeypatch.setattr(_numpy, "MAX_BLOCK_N", 7)
    o2, lse2 = cuflash.attention(q, k, v, causal=True, return_lse=True)
    numpy.testing.assert_allclose(o2, results[0][0], rtol=2e-5, atol=2e-6)
    numpy.testing.assert_allclose(lse2, results[0][1], rtol=2e-6, atol=2e-6)
