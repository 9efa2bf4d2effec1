"""Modifiers on the CPU: the blocked path and the float64 reference (cuflash._modifiers_cpu,
through cuflash._pipeline) against the independent implementation of tests/_naive_modifiers,
every modifier and their combinations drawn by Hypothesis; empty rows made by each masking
modifier; a user function reading a captured array; validation errors.
"""

from __future__ import annotations

import ml_dtypes
import numpy
import numpy as np
import pytest
from hypothesis import example, given, strategies as st

import _naive_modifiers as naive
from cuflash import _captured, _modifiers, _modifiers_cpu, _numpy, _problem
from cuflash._block_mask import block_mask

DOC = _captured.captured(numpy.random.default_rng(3).integers(0, 4, size=(2, 64)).cumsum(axis=1))
TAB = _captured.captured(numpy.random.default_rng(4).standard_normal((3, 8)).astype(numpy.float32))

SCORE_MODS = {
    "tanh": lambda s, b, h, q, kv: 5.0 * np.tanh(s / 5.0),
    "relpos": lambda s, b, h, q, kv: s - 0.1 * np.abs(q - kv) + 0.05 * h + 0.1 * b,
    "where": lambda s, b, h, q, kv: np.where(kv % 2 == 0, s, s * 0.5),
    "table": lambda s, b, h, q, kv: s + TAB[h % 3, np.minimum(np.abs(q - kv), 7)],
}
MASK_MODS = {
    "mod3": lambda b, h, q, kv: (q - kv) % 3 != 1,
    "document": lambda b, h, q, kv: DOC[b % 2, q] == DOC[b % 2, kv],
    "band": lambda b, h, q, kv: kv <= q + 2,
    "prefix": lambda b, h, q, kv: (kv < 3) | (q >= kv),
    "heads": lambda b, h, q, kv: (h % 2 == 0) | (q >= kv),
}


def run_cpu(q, k, v, *, scale=None, causal=False, block_m=128, block_n=128, **kw):
    prob = _problem.make_problem(q, k, v, scale=scale, causal=causal)
    mods = _modifiers.check_modifiers(xp=numpy, device_id=None, batch_shape=prob.batch_shape,
                                      Lq=prob.Lq, Lk=prob.Lk, **kw)
    o = numpy.full(prob.batch_shape + (prob.Lq, prob.dv), numpy.nan, prob.dtype)
    lse = numpy.full(prob.batch_shape + (prob.Lq,), numpy.nan, prob.lse_dtype)
    _numpy.forward(prob, o, lse, mods=mods, block_m=block_m, block_n=block_n)
    return prob, mods, o, lse


def naive_kwargs(prob, kw):
    out = {k: v for k, v in kw.items() if k != "block_mask"}
    if "block_mask" in kw and "mask_mod" not in kw:
        out["mask_mod"] = kw["block_mask"].mask_mod
    out["causal_offset"] = prob.causal_offset if prob.causal else None
    return out


@st.composite
def modifier_case(draw, dtypes=st.sampled_from([numpy.float32, numpy.float64, numpy.float16,
                                                 ml_dtypes.bfloat16])):
    seed = draw(st.integers(0, 2 ** 32 - 1))
    rng = numpy.random.default_rng(seed)
    nb = draw(st.integers(0, 2))
    batch = tuple(draw(st.integers(1, 3)) for _ in range(nb))
    Lq, Lk = draw(st.integers(1, 24)), draw(st.integers(0, 24))
    d, dv = draw(st.integers(1, 12)), draw(st.integers(1, 12))
    dtype = numpy.dtype(draw(dtypes))

    def sub(shape):        # a shape that broadcasts to `shape`: dims dropped or set to 1
        keep = draw(st.integers(0, len(shape)))
        tail = shape[len(shape) - keep:]
        return tuple(n if draw(st.booleans()) else 1 for n in tail)

    q = rng.standard_normal(sub(batch) + (Lq, d)).astype(dtype)
    k = rng.standard_normal(sub(batch) + (Lk, d)).astype(dtype)
    v = rng.standard_normal(sub(batch) + (Lk, dv)).astype(dtype)
    batch = numpy.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    kw = {}
    on = draw(st.sets(st.sampled_from(["window", "softcap", "alibi_slopes", "sink", "bias",
                                       "mask", "score_mod", "mask_mod", "block_mask"])))
    bound = st.one_of(st.none(), st.integers(0, 8))
    if "window" in on:
        kw["window"] = (draw(bound), draw(bound))
    if "softcap" in on:
        kw["softcap"] = draw(st.sampled_from([0.5, 2.0, 30.0]))
    if "alibi_slopes" in on:
        kw["alibi_slopes"] = numpy.asarray(rng.uniform(0, 0.5, sub(batch))).astype(
            draw(st.sampled_from([numpy.float32, numpy.float64])))
    if "sink" in on:
        kw["sink"] = numpy.asarray(rng.standard_normal(sub(batch))).astype(numpy.float32)
        if draw(st.booleans()):
            kw["sink"].flat[0] = -numpy.inf
    if "bias" in on:
        bias = numpy.asarray(rng.standard_normal(sub(batch + (Lq, Lk)))).astype(
            draw(st.sampled_from([numpy.float32, numpy.float64, numpy.float16])))
        if bias.size and draw(st.booleans()):
            bias[rng.random(bias.shape) < 0.3] = -numpy.inf     # -inf entries act as a mask
        kw["bias"] = bias
    if "mask" in on:
        kw["mask"] = numpy.asarray(rng.random(sub(batch + (Lq, Lk)))
                                   < draw(st.sampled_from([0.2, 0.7, 1.0])))
    if "score_mod" in on:
        kw["score_mod"] = SCORE_MODS[draw(st.sampled_from(sorted(SCORE_MODS)))]
    if "mask_mod" in on or "block_mask" in on:
        mm = MASK_MODS[draw(st.sampled_from(sorted(MASK_MODS)))]
        if "block_mask" in on:
            blk = (draw(st.sampled_from([1, 3, 4, 8, 128])), draw(st.sampled_from([1, 2, 8, 128])))
            kw["block_mask"] = block_mask(mm, batch, Lq, Lk, block=blk)
        if "mask_mod" in on:
            kw["mask_mod"] = mm
    causal = draw(st.sampled_from([False, True, "top_left"]))
    tiles = dict(block_m=draw(st.sampled_from([1, 2, 5, 8, 128])),
                 block_n=draw(st.sampled_from([1, 3, 4, 16, 128])))
    return q, k, v, causal, tiles, kw


def _check_against_naive(q, k, v, causal, tiles, kw):
    prob, mods, o, lse = run_cpu(q, k, v, causal=causal, **tiles, **kw)
    nk = naive_kwargs(prob, kw)
    o_ref, lse_ref = naive.attention(q, k, v, scale=prob.scale, **nk)
    # the reference runs the same pipeline on the whole matrix: equal to float64 rounding
    o64, lse64 = _modifiers_cpu.reference_forward(prob, mods)
    assert ((lse64 == -numpy.inf) == (lse_ref == -numpy.inf)).all()
    live = numpy.isfinite(lse_ref)
    numpy.testing.assert_allclose(lse64[live], lse_ref[live], rtol=1e-12, atol=1e-12)
    numpy.testing.assert_allclose(o64, o_ref, rtol=1e-10, atol=1e-12)
    half = prob.dtype in (numpy.dtype(numpy.float16), numpy.dtype(ml_dtypes.bfloat16))
    o_n, lse_n = naive.attention(q, k, v, scale=prob.scale, **nk,
                                 dtype=numpy.float32 if half else prob.dtype.type,
                                 store=prob.dtype if half else None)
    s_abs = 0.0
    for name in ("bias", "alibi_slopes"):
        if name in kw:
            finite = numpy.abs(kw[name][numpy.isfinite(kw[name])]).astype(float)
            s_abs += float(finite.max(initial=0.0)) * (max(prob.Lq, prob.Lk) if name[0] == "a"
                                                       else 1)
    if "sink" in kw:
        s_abs += float(numpy.abs(kw["sink"][numpy.isfinite(kw["sink"])]).max(initial=0.0))
    L, W = naive.conditioning(q, k, v, s_abs + 3.0, scale=prob.scale, o_kwargs=nk)
    return naive.check_close(o, lse, o_ref, lse_ref, o_n, lse_n.astype(numpy.float64),
                             prob.dtype, L=L, W=W, Lk=prob.Lk + ("sink" in kw))


@given(modifier_case())
def test_every_modifier_and_combination_against_the_naive_implementation(case):
    _check_against_naive(*case)


@pytest.mark.parametrize("name", ["window", "softcap", "alibi_slopes", "sink", "bias", "mask",
                                  "score_mod", "mask_mod", "block_mask"])
def test_each_modifier_alone_changes_the_result(name):
    """Each modifier on its own, float64, against the naive implementation, and it is not a
    no-op (a modifier ignored by the CPU path could not pass)."""
    rng = numpy.random.default_rng(11)
    q, k, v = (rng.standard_normal((2, 3, L, 8)) for L in (20, 17, 17))
    kw = {"window": (3, 1), "softcap": 0.7, "alibi_slopes": numpy.array([0.1, 0.3, 0.5]),
          "sink": numpy.array([0.5, 1.0, 3.0]), "bias": rng.standard_normal((3, 20, 17)),
          "mask": rng.random((20, 17)) < 0.5, "score_mod": SCORE_MODS["relpos"],
          "mask_mod": MASK_MODS["mod3"],
          "block_mask": block_mask(MASK_MODS["band"], (2, 3), 20, 17, block=(4, 8))}
    case = {name: kw[name]}
    _check_against_naive(q, k, v, False, dict(block_m=8, block_n=4), case)
    _, _, o_plain, _ = run_cpu(q, k, v)
    _, _, o_mod, _ = run_cpu(q, k, v, **case)
    assert numpy.abs(o_mod - o_plain).max() > 1e-3


@pytest.mark.parametrize("maker", [
    "causal", "window", "mask", "mask_mod", "block_mask", "bias"])
@pytest.mark.parametrize("with_sink", [False, True])
def test_empty_rows_give_zero_and_minus_inf_or_the_sink(maker, with_sink):
    rng = numpy.random.default_rng(5)
    Lq, Lk = 9, 6
    q, k, v = (rng.standard_normal((2, L, 4)).astype(numpy.float32) for L in (Lq, Lk, Lk))
    dead_rows = numpy.zeros((2, Lq), bool)
    kw: dict = {}
    causal = False
    if maker == "causal":          # bottom-right: rows i < Lq - Lk see no key
        causal, dead_rows[:, :Lq - Lk] = True, True
    elif maker == "window":        # only the diagonal j = i + Lk - Lq
        kw["window"], dead_rows[:, :Lq - Lk] = (0, 0), True
    elif maker == "mask":
        mask = rng.random((2, Lq, Lk)) < 0.8
        mask[:, [1, 4]] = False
        kw["mask"], dead_rows[:, [1, 4]] = mask, True
    elif maker in ("mask_mod", "block_mask"):
        mm = (lambda b, h, qi, kv: (qi % 4 != 2) & (kv >= h))
        dead_rows[:, 2::4] = True
        kw[maker] = mm if maker == "mask_mod" else block_mask(mm, (2,), Lq, Lk, block=(2, 4))
    elif maker == "bias":
        bias = rng.standard_normal((Lq, Lk))
        bias[3] = -numpy.inf
        kw["bias"], dead_rows[:, 3] = bias, True
    if with_sink:
        kw["sink"] = numpy.array([0.25, -1.5])
    prob, mods, o, lse = run_cpu(q, k, v, causal=causal, block_m=4, block_n=4, **kw)
    assert dead_rows.any() and not dead_rows.all()
    assert (o[dead_rows] == 0).all()
    want = (numpy.broadcast_to(kw["sink"][:, None], dead_rows.shape)[dead_rows] if with_sink
            else -numpy.inf)
    assert (lse[dead_rows] == numpy.float32(want)).all()
    assert numpy.isfinite(lse[~dead_rows]).all() and (o[~dead_rows] != 0).any()
    o_ref, lse_ref = _modifiers_cpu.reference_forward(prob, mods)
    assert (o_ref[dead_rows] == 0).all() and (lse_ref[dead_rows] == want).all()


def test_a_user_function_reading_a_captured_array():
    """Document masking through captured document ids equals an explicit bool mask, and an
    index beyond the array raises IndexError on the CPU path."""
    rng = numpy.random.default_rng(9)
    ids = numpy.array([[0, 0, 0, 1, 1, 2, 2, 2], [0, 1, 1, 1, 1, 1, 1, 2]])
    doc = _captured.captured(ids)
    q, k, v = (rng.standard_normal((2, 3, 8, 4)) for _ in range(3))
    mask = ids[:, None, :, None] == ids[:, None, None, :]
    _, _, o1, lse1 = run_cpu(q, k, v, block_m=3, block_n=3,
                             mask_mod=lambda b, h, i, j: doc[b, i] == doc[b, j])
    _, _, o2, lse2 = run_cpu(q, k, v, mask=mask)
    numpy.testing.assert_allclose(o1, o2, rtol=1e-13, atol=1e-13)
    numpy.testing.assert_allclose(lse1, lse2, rtol=1e-13)
    q9 = rng.standard_normal((2, 3, 9, 4))
    with pytest.raises(IndexError, match="index 8 is out of range for axis 1"):
        run_cpu(q9, q9, q9, mask_mod=lambda b, h, i, j: doc[b, i] == doc[b, j])


def test_window_costs_a_band_of_tiles():
    """The blocked path visits O(L w) key tiles under a window, not O(L^2)."""
    from cuflash._pipeline import ScorePipeline
    mods = _modifiers.check_modifiers(xp=numpy, device_id=None, batch_shape=(), Lq=4096,
                                      Lk=4096, window=(256, 0))
    pipe = ScorePipeline(mods, causal=False, causal_offset=0, acc=numpy.float32)
    visited = sum(-(-(hi - lo) // 128) for lo, hi in
                  (pipe.key_range(i0, i0 + 128) for i0 in range(0, 4096, 128)))
    assert visited <= 32 * 4
    assert pipe.key_range(0, 128) == (0, 128)
    assert pipe.key_range(1024, 1152) == (1024 - 256, 1152)
    assert pipe.query_range(1024, 1152) == (1024, 1152 + 256)


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------

def _check(**kw):
    return _modifiers.check_modifiers(xp=numpy, device_id=None, batch_shape=(2, 3), Lq=5, Lk=7,
                                      **kw)


@pytest.mark.parametrize("kw, error, message", [
    (dict(window=(-1, 0)), ValueError, r"window left bound must be >= 0, got window=\(-1, 0\)"),
    (dict(window=(0, -2)), ValueError, r"right bound must be >= 0"),
    (dict(window=(1.5, 0)), TypeError, r"window left bound must be an int >= 0 or None, got 1.5"),
    (dict(window=(True, 0)), TypeError, r"got True"),
    (dict(window=3), TypeError, r"pair \(left, right\).*got 3"),
    (dict(window=(1, 2, 3)), TypeError, r"got \(1, 2, 3\)"),
    (dict(softcap=0), ValueError, r"softcap must be finite and > 0, got softcap=0"),
    (dict(softcap=-1.0), ValueError, r"softcap=-1.0"),
    (dict(softcap=float("inf")), ValueError, r"softcap=inf"),
    (dict(softcap=True), TypeError, r"softcap must be a real number > 0 or None, got True"),
    (dict(softcap="5"), TypeError, r"got '5'"),
    (dict(alibi_slopes=numpy.ones(4)), ValueError,
     r"alibi_slopes.shape=\(4,\) does not broadcast to the batch shape \(2, 3\)"),
    (dict(alibi_slopes=numpy.ones((2, 3, 1))), ValueError, r"alibi_slopes.shape=\(2, 3, 1\)"),
    (dict(alibi_slopes=numpy.ones(3, int)), TypeError, r"alibi_slopes.dtype=int64"),
    (dict(alibi_slopes=[0.1, 0.2, 0.3]), TypeError, r"alibi_slopes must be a numpy.ndarray"),
    (dict(sink=numpy.ones((3, 2))), ValueError, r"sink.shape=\(3, 2\) does not broadcast"),
    (dict(sink=numpy.ones(3, numpy.complex64)), TypeError, r"sink.dtype=complex64"),
    (dict(bias=numpy.ones((5, 6))), ValueError,
     r"bias.shape=\(5, 6\) does not broadcast to batch_shape \+ \(Lq, Lk\) = \(2, 3, 5, 7\)"),
    (dict(bias=numpy.ones((4, 3, 5, 7))), ValueError, r"bias.shape=\(4, 3, 5, 7\)"),
    (dict(bias=numpy.ones((5, 7), bool)), TypeError, r"bias.dtype=bool"),
    (dict(mask=numpy.ones((5, 7), numpy.float32)), TypeError,
     r"mask must be a bool array \(True = keep\), got x.dtype=dtype\('float32'\); for an "
     r"additive float mask use bias="),
    (dict(mask=numpy.ones((5, 8), bool)), ValueError, r"mask.shape=\(5, 8\)"),
    (dict(score_mod=lambda s, b, h: s), TypeError,
     r"score_mod must take 5 positional arguments \(score, b, h, q_idx, kv_idx\); "),
    (dict(mask_mod=lambda b, h, q, kv, extra: True), TypeError,
     r"mask_mod must take 4 positional arguments"),
    (dict(score_mod=3.0), TypeError, r"score_mod must be a function"),
    (dict(block_mask=object()), TypeError, r"block_mask must be made by cuflash.block_mask"),
    (dict(block_mask=block_mask(lambda b, h, q, kv: q >= kv, (2, 3), 5, 8)), ValueError,
     r"block_mask was built for \(Lq, Lk\) = \(5, 8\), the inputs have \(5, 7\)"),
    (dict(block_mask=block_mask(lambda b, h, q, kv: q >= kv, (3,), 5, 7)), ValueError,
     r"block_mask.batch_shape=\(3,\) does not broadcast"),
    (dict(block_mask=block_mask(lambda b, h, q, kv: q >= kv, (2, 3), 5, 7),
          mask_mod=lambda b, h, q, kv: q >= kv), ValueError, r"is not the function block_mask"),
])
def test_bad_modifiers_raise_naming_the_values(kw, error, message):
    with pytest.raises(error, match=message):
        _check(**kw)


def test_good_modifiers_are_recorded_as_views():
    bias = numpy.ones((3, 1, 7), numpy.float16)
    slopes = numpy.array([0.1, 0.2, 0.3])
    m = _check(window=(None, None), softcap=numpy.float32(2), bias=bias, alibi_slopes=slopes,
               sink=numpy.zeros((2, 1)), mask=numpy.ones((7,), bool))
    assert m.window is None and m.softcap == 2.0
    assert m.bias.shape == (2, 3, 5, 7) and numpy.shares_memory(m.bias, bias)
    assert m.bias.strides[0] == 0 and m.bias_shape == (3, 1, 7) and m.bias_dtype == bias.dtype
    assert numpy.shares_memory(m.alibi_slopes, slopes) and m.sink_shape == (2, 1)
    assert m.features == {"softcap", "bias", "alibi_slopes", "sink", "mask"}
    assert m.extra_gradients() == ("dbias", "dsink")
    bm = block_mask(lambda b, h, q, kv: q >= kv, (1, 3), 5, 7)
    m2 = _check(block_mask=bm, window=(2, None))
    assert m2.mask_mod is bm.mask_mod and m2.window == (2, None)
    with pytest.raises(AttributeError):
        m2.window = None


def test_user_function_results_are_checked_on_numpy():
    q = numpy.ones((4, 2))
    with pytest.raises(ValueError, match=r"score_mod .* returned shape \(3,\)"):
        run_cpu(q, q, q, score_mod=lambda s, b, h, i, j: numpy.ones(3))
    with pytest.raises(TypeError, match=r"mask_mod .* must return bools"):
        run_cpu(q, q, q, mask_mod=lambda b, h, i, j: i - j)
    with pytest.raises(TypeError, match=r"score_mod .* must return numbers"):
        run_cpu(q, q, q, score_mod=lambda s, b, h, i, j: "x")

