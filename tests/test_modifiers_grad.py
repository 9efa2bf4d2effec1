"""Gradients with modifiers on the CPU: the blocked backward (cuflash._numpy.backward)
and the float64 reference backward against central finite differences of the independent
naive forward (tests/_naive_modifiers), on tiny float64 shapes: dq, dk, dv, dbias (summed over
broadcast dimensions) and dsink; rows with no visible key get exactly zero gradients.
"""

from __future__ import annotations

import numpy
import numpy as np
import pytest
from hypothesis import given, strategies as st

import _naive_modifiers as naive
from cuflash import _captured, _modifiers, _modifiers_cpu, _numpy, _problem
from cuflash._block_mask import block_mask

TAB = _captured.captured(numpy.linspace(-1, 1, 24).reshape(3, 8))
SCORE_MODS = {
    "tanh": lambda s, b, h, q, kv: 3.0 * np.tanh(s / 3.0),
    "relpos": lambda s, b, h, q, kv: s * (1 + 0.1 * h) - 0.2 * np.abs(q - kv),
    "quadratic": lambda s, b, h, q, kv: s + 0.1 * s * s + TAB[h % 3, np.minimum(np.abs(q - kv), 7)],
    "exp": lambda s, b, h, q, kv: np.exp(0.3 * s) + np.where(q >= kv, s, -s),
}
MASK_MODS = {"mod3": lambda b, h, q, kv: (q + kv) % 3 != 0,
             "band": lambda b, h, q, kv: (kv <= q + 1) | (h == 0)}


def _loss_and_grads(q, k, v, do, causal, kw, tiles):
    prob = _problem.make_problem(q, k, v, scale=None, causal=causal)
    mods = _modifiers.check_modifiers(xp=numpy, device_id=None, batch_shape=prob.batch_shape,
                                      Lq=prob.Lq, Lk=prob.Lk, **kw)
    o = numpy.empty(prob.batch_shape + (prob.Lq, prob.dv))
    lse = numpy.empty(prob.batch_shape + (prob.Lq,))
    _numpy.forward(prob, o, lse, mods=mods, **tiles)
    grads = [numpy.full(x.shape, numpy.nan) for x in (q, k, v)]
    dbias = numpy.full(mods.bias_shape, numpy.nan) if "bias" in kw else None
    dsink = numpy.full(mods.sink_shape, numpy.nan) if "sink" in kw else None
    _numpy.backward(prob, do, o, lse, *grads, dbias, dsink, mods=mods, **tiles)
    grads += [g for g in (dbias, dsink) if g is not None]
    ref = _modifiers_cpu.reference_backward(prob, mods, do, (q.shape, k.shape, v.shape))
    return prob, lse, grads, ref


def _finite_differences(q, k, v, do, causal_offset, kw, scale):
    kw = dict(kw)
    if "block_mask" in kw:
        kw["mask_mod"] = kw.pop("block_mask").mask_mod
    args = {"q": q, "k": k, "v": v}
    names = ["q", "k", "v"] + [n for n in ("bias", "sink") if n in kw]

    def loss(**over):
        a = {**args, **over}
        extra = {n: over.get(n, kw[n]) for n in kw}
        o, _ = naive.attention(a["q"], a["k"], a["v"], scale=scale, causal_offset=causal_offset,
                               **extra)
        return float((o * do).sum())

    out = []
    for name in names:
        x = args[name] if name in args else kw[name]
        g = numpy.zeros(x.shape)
        for idx in numpy.ndindex(x.shape):
            if not numpy.isfinite(x[idx]):
                continue                        # a -inf bias entry: the pair is hidden
            step = 1e-6 * max(1.0, abs(float(x[idx])))
            up, down = x.copy(), x.copy()
            up[idx] += step
            down[idx] -= step
            g[idx] = (loss(**{name: up}) - loss(**{name: down})) / (2 * step)
        out.append(g)
    return out


@st.composite
def grad_case(draw):
    rng = numpy.random.default_rng(draw(st.integers(0, 2 ** 32 - 1)))
    H = draw(st.integers(1, 3))
    Lq, Lk, d = draw(st.integers(1, 5)), draw(st.integers(1, 5)), draw(st.integers(1, 3))
    q = rng.standard_normal((2, H, Lq, d))
    k = rng.standard_normal((draw(st.sampled_from([1, 2])), H, Lk, d))   # broadcast batch
    v = rng.standard_normal((2, 1 if draw(st.booleans()) else H, Lk, 2))
    do = rng.standard_normal((2, H, Lq, 2))
    on = draw(st.sets(st.sampled_from(["window", "softcap", "alibi_slopes", "sink", "bias",
                                       "mask", "score_mod", "mask_mod", "block_mask"]),
                      min_size=1))
    kw = {}
    if "window" in on:
        kw["window"] = (draw(st.one_of(st.none(), st.integers(0, 3))),
                        draw(st.one_of(st.none(), st.integers(0, 3))))
    if "softcap" in on:
        kw["softcap"] = draw(st.sampled_from([0.5, 2.0]))
    if "alibi_slopes" in on:
        kw["alibi_slopes"] = rng.uniform(0, 0.5, (H,))
    if "sink" in on:
        kw["sink"] = rng.standard_normal(draw(st.sampled_from([(H,), (2, 1), (2, H)])))
    if "score_mod" in on:
        kw["score_mod"] = SCORE_MODS[draw(st.sampled_from(sorted(SCORE_MODS)))]
    if "bias" in on:
        shape = draw(st.sampled_from([(Lq, Lk), (H, 1, Lk), (2, H, Lq, Lk), (1, Lk)]))
        bias = rng.standard_normal(shape)
        # -inf hides a pair, unless a score_mod turns -inf into +inf or NaN (then the row is
        # NaN, as IEEE arithmetic says, and there is no derivative to compare)
        if draw(st.booleans()) and kw.get("score_mod") not in (SCORE_MODS["quadratic"],
                                                              SCORE_MODS["exp"]):
            bias.flat[0] = -numpy.inf
        kw["bias"] = bias
    if "mask" in on:
        kw["mask"] = rng.random((Lq, Lk)) < 0.7
    if "mask_mod" in on:
        kw["mask_mod"] = MASK_MODS[draw(st.sampled_from(sorted(MASK_MODS)))]
    elif "block_mask" in on:
        kw["block_mask"] = block_mask(MASK_MODS["band"], (2, H), Lq, Lk, block=(2, 2))
    causal = draw(st.sampled_from([False, True, "top_left"]))
    tiles = dict(block_m=draw(st.sampled_from([1, 2, 128])),
                 block_n=draw(st.sampled_from([1, 3, 128])))
    return q, k, v, do, causal, kw, tiles


@given(grad_case())
def test_gradients_match_finite_differences(case):
    q, k, v, do, causal, kw, tiles = case
    prob, lse, grads, ref = _loss_and_grads(q, k, v, do, causal, kw, tiles)
    fd = _finite_differences(q, k, v, do, prob.causal_offset if prob.causal else None, kw,
                             prob.scale)
    names = ["dq", "dk", "dv"] + [n for n, key in (("dbias", "bias"), ("dsink", "sink"))
                                  if key in kw]
    assert len(grads) == len(ref) == len(fd) == len(names)
    for name, g, r, f in zip(names, grads, ref, fd):
        assert g.shape == r.shape == f.shape, (name, g.shape, r.shape, f.shape)
        big = max(1.0, float(numpy.abs(f).max()))
        # blocked vs reference: the same formulas in float64, different order of sums
        numpy.testing.assert_allclose(g, r, rtol=0, atol=1e-12 * big, err_msg=name)
        # analytic vs central differences (step 1e-6: truncation and rounding ~1e-9)
        numpy.testing.assert_allclose(r, f, rtol=0, atol=2e-7 * big, err_msg=name)


@pytest.mark.parametrize("with_sink", [False, True])
def test_rows_with_no_visible_key_get_zero_gradients(with_sink):
    rng = numpy.random.default_rng(2)
    q, k, v, do = (rng.standard_normal((2, L, 3)) for L in (6, 4, 4, 6))
    mask = rng.random((6, 4)) < 0.8
    mask[[0, 3]] = False
    bias = rng.standard_normal((2, 6, 4))
    kw = {"mask": mask, "bias": bias}
    if with_sink:
        kw["sink"] = numpy.array([0.5, -0.5])
    prob, lse, grads, ref = _loss_and_grads(q, k, v, do, False, kw, dict(block_m=2, block_n=2))
    dq, dk, dv, dbias = grads[:4]
    assert (dq[:, [0, 3]] == 0).all() and (dbias[:, [0, 3]] == 0).all()
    assert (dbias[:, ~mask] == 0).all() and (dbias[:, mask] != 0).all()
    if with_sink:
        assert (lse[:, [0, 3]] == kw["sink"][:, None]).all()
        assert numpy.isfinite(grads[4]).all() and (grads[4] != 0).all()


def test_a_score_mod_that_cannot_be_traced_is_differentiated_numerically():
    """np.arctan is not traceable (the GPU would refuse it); the CPU path still runs it and
    takes its derivative by central differences."""
    rng = numpy.random.default_rng(8)
    q, k, v, do = (rng.standard_normal((2, L, 3)) for L in (5, 4, 4, 5))
    kw = {"score_mod": lambda s, b, h, i, j: 2.0 * np.arctan(s) + 0.1 * j,
          "bias": rng.standard_normal((5, 4))}
    prob, lse, grads, ref = _loss_and_grads(q, k, v, do, False, kw, dict(block_m=2, block_n=3))
    fd = _finite_differences(q, k, v, do, None, kw, prob.scale)
    for g, r, f in zip(grads, ref, fd):
        big = max(1.0, float(numpy.abs(f).max()))
        # central differences with a step of 2**-20 (relative) carry ~1e-10 of rounding noise
        numpy.testing.assert_allclose(g, r, rtol=0, atol=1e-8 * big)
        numpy.testing.assert_allclose(r, f, rtol=0, atol=2e-7 * big)
