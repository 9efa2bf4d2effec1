"""A plain, independent implementation of attention with modifiers, for the tests.

Written straight from DESIGN.md's "Modifiers" with the whole score matrix materialised and
nothing shared with ``cuflash._pipeline``: ``b``, ``h`` from ``numpy.indices``, the window as
two comparisons, the sink as one more key column (score ``sink``, value 0) in an ordinary
max-subtracted softmax. ``dtype`` float64 is the oracle; float32 (or, for half inputs, float32
with scores and probabilities stored in the half type) is the naive same-dtype computation of
the tolerance rule.

Also the tolerance rule (``check_close``): DESIGN.md's (2x the naive error plus the floor of
``tests/_tolerance.py``), through ``rule()``, the one place to repoint when the rule moves to
``cuflash.testing``.
"""

from __future__ import annotations

import numpy


def rule():
    """The project's tolerance functions (``tolerance``, ``lse_tolerance``, ``eps``)."""
    import _tolerance
    return _tolerance


def batch_index_arrays(batch_shape):
    """(b, h) as DESIGN.md defines them, shaped batch_shape + (1, 1)."""
    idx = numpy.indices(batch_shape, dtype=numpy.int64) if batch_shape else None
    if len(batch_shape) == 0:
        b = h = numpy.zeros((), numpy.int64)
    elif len(batch_shape) == 1:
        b, h = numpy.zeros(batch_shape, numpy.int64), idx[0]
    else:
        b = idx[0]
        h = numpy.zeros(batch_shape, numpy.int64)
        for axis in range(1, len(batch_shape)):
            h = h * batch_shape[axis] + idx[axis]
    return b[..., None, None], h[..., None, None]


def attention(q, k, v, *, scale, causal_offset=None, window=None, softcap=None,
              alibi_slopes=None, sink=None, bias=None, mask=None, score_mod=None,
              mask_mod=None, dtype=numpy.float64, store=None):
    """``(o, lse)``; ``causal_offset`` None means not causal. ``store`` (a half dtype) rounds the
    scores and probabilities to it, as a framework stores them."""
    batch = numpy.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    Lq, Lk = q.shape[-2], k.shape[-2]
    q, k, v = (numpy.broadcast_to(x, batch + x.shape[-2:]).astype(dtype) for x in (q, k, v))
    i, j = numpy.arange(Lq)[:, None], numpy.arange(Lk)[None, :]
    b, h = batch_index_arrays(batch)
    with numpy.errstate(all="ignore"):
        s = (q @ k.swapaxes(-1, -2)) * dtype(scale)
        if store is not None:
            s = s.astype(store).astype(dtype)
        if softcap is not None:
            s = dtype(softcap) * numpy.tanh(s / dtype(softcap))
        if alibi_slopes is not None:
            slope = numpy.broadcast_to(alibi_slopes, batch).astype(dtype)[..., None, None]
            s = s - slope * numpy.abs(i + Lk - Lq - j).astype(dtype)
        if bias is not None:
            s = s + bias.astype(dtype)
        if score_mod is not None:
            s = numpy.broadcast_to(score_mod(s, b, h, i, j), s.shape).astype(dtype)
        keep = numpy.ones(batch + (Lq, Lk), bool)
        if causal_offset is not None:
            keep &= j <= i + causal_offset
        if window is not None:
            left, right = window
            if left is not None:
                keep &= j >= i + Lk - Lq - left
            if right is not None:
                keep &= j <= i + Lk - Lq + right
        if mask is not None:
            keep &= mask
        if mask_mod is not None:
            keep &= numpy.broadcast_to(mask_mod(b, h, i, j), keep.shape)
        s = numpy.where(keep, s, -numpy.inf)
        if sink is not None:     # one more key: score sink, value 0
            col = numpy.broadcast_to(numpy.broadcast_to(sink, batch).astype(dtype)[..., None, None],
                                     batch + (Lq, 1))
            s = numpy.concatenate([s, col], axis=-1)
            v = numpy.concatenate([v, numpy.zeros(batch + (1, v.shape[-1]), dtype)], axis=-2)
        if s.shape[-1] == 0:
            return (numpy.zeros(batch + (Lq, v.shape[-1]), dtype),
                    numpy.full(batch + (Lq,), -numpy.inf, dtype))
        m = s.max(axis=-1, keepdims=True)
        m = numpy.where(m == -numpy.inf, 0, m)
        e = numpy.exp(s - m)
        l = e.sum(axis=-1, keepdims=True)
        p = e / numpy.where(l == 0, 1, l)
        if store is not None:
            p = p.astype(store).astype(dtype)
        o = p @ v
        lse = (m + numpy.log(l))[..., 0]
    return o, lse


def conditioning(q, k, v, s_final_absmax, *, scale, o_kwargs):
    """``(L, W)`` of the tolerance rule: the logit bound (``scale * max |q| |k|`` plus the
    largest finite modified score) and ``max_i sum_j p_ij |v_j|`` from the float64 oracle."""
    q64, k64, v64 = (x.astype(numpy.float64) for x in (q, k, v))
    L = float(scale * (numpy.abs(q64) @ numpy.abs(k64).swapaxes(-1, -2)).max(initial=0.0))
    W, _ = attention(q, k, numpy.abs(v64), scale=scale, **o_kwargs)
    return L + s_final_absmax, float(numpy.nanmax(W, initial=0.0))


def check_close(o, lse, o_ref, lse_ref, o_naive, lse_naive, dtype, *, L, W, Lk):
    """DESIGN.md's rule: exact where the reference is -inf (o = 0, lse = -inf), else an error
    at most 2x the naive same-dtype error plus the floor. Returns the largest error/tolerance."""
    T = rule()
    o64, lse64 = o.astype(numpy.float64), lse.astype(numpy.float64)
    dead = lse_ref == -numpy.inf
    assert (lse64[dead] == -numpy.inf).all(), "lse is not -inf where no key is visible"
    assert (o64[dead] == 0).all(), "o is not exactly 0 where no key is visible"
    assert numpy.isfinite(lse64[~dead]).all() and numpy.isfinite(o64[~dead]).all()
    live = ~dead
    if not live.any():
        return 0.0
    worst = 0.0
    for name, ours, ref, naive, tol_of in (
            ("o", o64[live], o_ref[live], o_naive[live],
             lambda e: T.tolerance(e, dtype, weighted_abs_v=W, logit_bound=L, Lk=max(Lk, 1))),
            ("lse", lse64[live], lse_ref[live], lse_naive[live],
             lambda e: T.lse_tolerance(e, dtype, max_abs_lse=float(numpy.abs(lse_ref[live]).max()),
                                       logit_bound=L, Lk=max(Lk, 1)))):
        naive_err = float(numpy.abs(naive.astype(numpy.float64) - ref).max())
        err = float(numpy.abs(ours - ref).max())
        tol = tol_of(naive_err)
        assert err <= tol, f"{name}: error {err:.3g} > {tol:.3g} (naive {naive_err:.3g}, {dtype})"
        worst = max(worst, err / tol)
    return worst


def check_result(q, k, v, causal, kw, o, lse, scale=None) -> float:
    """``(o, lse)`` of any implementation (CPU path, emulated or real GPU kernel; NumPy arrays)
    for ``attention(q, k, v, causal=causal, **kw)`` against this module's float64 oracle, with
    the tolerance of DESIGN.md from this module's naive same-dtype computation. Returns the
    largest error / tolerance."""
    import ml_dtypes
    from cuflash import _problem
    prob = _problem.make_problem(q, k, v, scale=scale, causal=causal)
    nk = {key: val for key, val in kw.items() if key != "block_mask"}
    if "block_mask" in kw and "mask_mod" not in kw:
        nk["mask_mod"] = kw["block_mask"].mask_mod
    nk["causal_offset"] = prob.causal_offset if prob.causal else None
    o_ref, lse_ref = attention(q, k, v, scale=prob.scale, **nk)
    half = prob.dtype in (numpy.dtype(numpy.float16), numpy.dtype(ml_dtypes.bfloat16))
    o_n, lse_n = attention(q, k, v, scale=prob.scale, **nk,
                           dtype=numpy.float32 if half else prob.dtype.type,
                           store=prob.dtype if half else None)
    s_abs = 0.0
    for name in ("bias", "alibi_slopes"):
        if name in kw:
            x = numpy.asarray(kw[name]).astype(numpy.float64)
            finite = numpy.abs(x[numpy.isfinite(x)])
            s_abs += float(finite.max(initial=0.0)) * (max(prob.Lq, prob.Lk) if name[0] == "a"
                                                       else 1)
    if "sink" in kw:
        x = numpy.asarray(kw["sink"]).astype(numpy.float64)
        s_abs += float(numpy.abs(x[numpy.isfinite(x)]).max(initial=0.0))
    L, W = conditioning(q, k, v, s_abs + 3.0, scale=prob.scale, o_kwargs=nk)
    return check_close(o, lse, o_ref, lse_ref, o_n, lse_n.astype(numpy.float64),
                       prob.dtype, L=L, W=W, Lk=prob.Lk + ("sink" in kw))


def check_gradients(grads, q, k, v, o, lse, do, causal, kw) -> float:
    """Gradients of any implementation (NumPy arrays: dq, dk, dv[, dbias][, dsink]) against the
    float64 reference, by the kit's rule (``cuflash.testing.assert_attention_close``: 3x the
    naive same-dtype backward's error plus the floors of rounding noise, exact zeros where no
    key is visible, DESIGN.md), with the dtypes cuflash returns. ``o`` and ``lse`` are the
    implementation's forward results, which it differentiated through: they are checked by
    ``check_result``. Returns the largest error / bound."""
    from cuflash.testing import AttentionCase, assert_attention_close
    case = AttentionCase.from_arrays(q, k, v, do=do, causal=causal, **kw)
    return assert_attention_close(None, case, grads=tuple(grads), check_dtype=True)
