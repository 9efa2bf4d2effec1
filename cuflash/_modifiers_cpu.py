"""Attention with modifiers on NumPy: the blocked CPU path and the float64 reference.

Both run :class:`cuflash._pipeline.ScorePipeline`: the blocked path on tiles (FlashAttention-2's
Algorithms 1 and 2, as ``_numpy``), the reference on the whole Lq x Lk matrix. With no
modifier they compute exactly what ``_numpy`` and ``reference`` compute.

Tiles: the blocked path visits only the key tiles that causal and window leave visible to a
query tile (``key_range``; a window of w costs O(L w)), skips tiles a block mask calls empty
and does not evaluate the mask_mod on tiles it calls full.

The sink is a key every row sees, with score ``sink`` and value 0: the online softmax starts at
``m = sink``, ``l = 1`` instead of ``-inf, 0``, so a row with no visible key ends with ``o = 0``
and ``lse = sink``, and ``lse`` includes the sink.
"""

from __future__ import annotations

from typing import Any

import numpy

from cuflash import _problem
from cuflash._modifiers import Modifiers
from cuflash._pipeline import ScorePipeline, add_tile_to

BLOCK_M = BLOCK_N = 128


def _acc(prob) -> Any:
    return numpy.float64 if prob.dtype == numpy.float64 else numpy.float32


def forward(prob, mods: Modifiers, o: numpy.ndarray, lse: numpy.ndarray, *,
            block_m: int = BLOCK_M, block_n: int = BLOCK_N) -> None:
    """Write ``o`` and ``lse`` for ``prob`` with ``mods`` (shapes and dtypes as ``_numpy``)."""
    acc = _acc(prob)
    pipe = ScorePipeline(mods, causal=prob.causal, causal_offset=prob.causal_offset, acc=acc)
    neg_inf = acc(-numpy.inf)
    m_start, l_start = pipe.row_start()
    with numpy.errstate(invalid="ignore"):   # inf - inf in a row with Inf scores gives NaN
        for i0 in range(0, prob.Lq, block_m):
            i1 = min(i0 + block_m, prob.Lq)
            q_i = prob.q[..., i0:i1, :].astype(acc) * acc(prob.scale)
            o_i = numpy.zeros(prob.batch_shape + (i1 - i0, prob.dv), acc)
            m_i = numpy.broadcast_to(m_start, prob.batch_shape + (i1 - i0,)).copy()
            l_i = numpy.broadcast_to(l_start, prob.batch_shape + (i1 - i0,)).copy()
            lo, hi = pipe.key_range(i0, i1)
            for j0 in range(lo - lo % block_n, hi, block_n):
                j1 = min(j0 + block_n, hi)
                j0 = max(j0, lo)
                kind = pipe.tile_kind(i0, i1, j0, j1)
                if kind == "empty":
                    continue
                k_j = prob.k[..., j0:j1, :].astype(acc)
                v_j = prob.v[..., j0:j1, :].astype(acc)
                s_ij = pipe.scores(q_i @ k_j.swapaxes(-1, -2), i0, i1, j0, j1, kind=kind)
                m_new = numpy.maximum(m_i, s_ij.max(axis=-1))
                # a row with no visible key yet has m_new = -inf: subtract 0 instead
                m_sub = numpy.where(m_new == neg_inf, 0, m_new)
                p_ij = numpy.exp(s_ij - m_sub[..., None])
                alpha = numpy.exp(m_i - m_sub)
                l_i = alpha * l_i + p_ij.sum(axis=-1)
                o_i = alpha[..., None] * o_i + p_ij @ v_j
                m_i = m_new
            # l_i == 0 exactly when the row saw no key and there is no (finite) sink
            no_key = l_i == 0
            l_div = numpy.where(no_key, 1, l_i)
            o[..., i0:i1, :] = (o_i / l_div[..., None]).astype(prob.dtype)
            lse[..., i0:i1] = numpy.where(no_key, neg_inf, m_i + numpy.log(l_div))


def backward(prob, mods: Modifiers, do, o, lse, dq, dk, dv, dbias=None, dsink=None, *,
             block_m: int = BLOCK_M, block_n: int = BLOCK_N) -> None:
    """Write dq, dk, dv (and dbias, dsink when the bias, sink are on): Algorithm 2 with the
    pipeline. ``dbias`` has ``mods.bias_shape``, ``dsink`` ``mods.sink_shape``; both are summed
    over broadcast dimensions in the accumulation dtype and rounded once."""
    acc = _acc(prob)
    pipe = ScorePipeline(mods, causal=prob.causal, causal_offset=prob.causal_offset, acc=acc)
    scale = acc(prob.scale)
    no_key = lse == -numpy.inf
    D = numpy.empty(prob.batch_shape + (prob.Lq,), acc)
    for i0 in range(0, prob.Lq, block_m):
        i1 = min(i0 + block_m, prob.Lq)
        D[..., i0:i1] = numpy.einsum("...c,...c->...", do[..., i0:i1, :].astype(acc),
                                     o[..., i0:i1, :].astype(acc))
    D[no_key] = 0
    lse_sub = numpy.where(no_key, acc(numpy.inf), lse).astype(acc)
    dq_acc = numpy.zeros(prob.batch_shape + (prob.Lq, prob.d), acc)
    dbias_acc = numpy.zeros(mods.bias_shape, acc) if mods.bias is not None else None

    with numpy.errstate(invalid="ignore"):
        for j0 in range(0, prob.Lk, block_n):
            j1 = min(j0 + block_n, prob.Lk)
            k_j = prob.k[..., j0:j1, :].astype(acc)
            v_j = prob.v[..., j0:j1, :].astype(acc)
            dk_j = numpy.zeros(prob.batch_shape + (j1 - j0, prob.d), acc)
            dv_j = numpy.zeros(prob.batch_shape + (j1 - j0, prob.dv), acc)
            lo, hi = pipe.query_range(j0, j1)
            # whole tiles from the aligned start (rows outside [lo, hi) are masked): the same
            # tiles, so the same sums in the same order, as _numpy.backward
            for i0 in range(lo - lo % block_m, hi, block_m):
                i1 = min(i0 + block_m, prob.Lq)
                kind = pipe.tile_kind(i0, i1, j0, j1)
                if kind == "empty":
                    continue
                q_i = prob.q[..., i0:i1, :].astype(acc) * scale
                dead = no_key[..., i0:i1, None]
                do_i = numpy.where(dead, acc(0), do[..., i0:i1, :].astype(acc))
                saved: dict = {}
                s_ij = pipe.scores(q_i @ k_j.swapaxes(-1, -2), i0, i1, j0, j1, saved, kind)
                p_ij = numpy.exp(s_ij - lse_sub[..., i0:i1, None])
                dv_j += p_ij.swapaxes(-1, -2) @ do_i
                dp_ij = do_i @ v_j.swapaxes(-1, -2)
                ds_ij = numpy.where(dead, acc(0), p_ij * (dp_ij - D[..., i0:i1, None]))
                ds_ij, ds_bias = pipe.grad_scores(ds_ij, saved, i0, i1, j0, j1)
                if ds_bias is not None:
                    add_tile_to(dbias_acc, ds_bias, i0, i1, j0, j1)
                dq_acc[..., i0:i1, :] += ds_ij @ k_j
                dk_j += ds_ij.swapaxes(-1, -2) @ q_i
            dk[..., j0:j1, :] = _problem.sum_to_shape(dk_j, dk.shape[:-2] + (j1 - j0, prob.d),
                                                      dk.dtype)
            dv[..., j0:j1, :] = _problem.sum_to_shape(dv_j, dv.shape[:-2] + (j1 - j0, prob.dv),
                                                      dv.dtype)
    dq[...] = _problem.sum_to_shape(dq_acc * scale, dq.shape, dq.dtype)
    if dbias is not None:
        dbias[...] = dbias_acc.astype(dbias.dtype)
    if dsink is not None:
        dsink[...] = pipe.dsink(D, lse.astype(acc)).astype(dsink.dtype)


# ---------------------------------------------------------------------------------------------
# The float64 reference: the whole matrix through the same pipeline
# ---------------------------------------------------------------------------------------------

def _logsumexp(s: numpy.ndarray) -> numpy.ndarray:
    from cuflash.reference import logsumexp   # here: reference will import this module
    return logsumexp(s)


def _float64(prob, x) -> numpy.ndarray:
    return (x if prob.xp is numpy else prob.xp.asnumpy(x)).astype(numpy.float64)


def _host(mods: Modifiers) -> Modifiers:
    """``mods`` with its arrays on the host (the reference computes in NumPy)."""
    import dataclasses
    swap = {}
    for name in ("alibi_slopes", "sink", "bias", "mask"):
        x = getattr(mods, name)
        if x is not None and not isinstance(x, numpy.ndarray):
            swap[name] = x.get()
    return dataclasses.replace(mods, **swap) if swap else mods


def reference_scores(prob, mods: Modifiers, saved: dict | None = None):
    """``(pipe, s)``: the masked float64 scores of the whole problem."""
    mods = _host(mods)
    pipe = ScorePipeline(mods, causal=prob.causal, causal_offset=prob.causal_offset,
                         acc=numpy.float64, use_block_mask=False)
    q64, k64 = _float64(prob, prob.q), _float64(prob, prob.k)
    s = prob.scale * (q64 @ k64.swapaxes(-1, -2))
    return pipe, pipe.scores(s, 0, prob.Lq, 0, prob.Lk, saved)


def reference_forward(prob, mods: Modifiers) -> tuple[numpy.ndarray, numpy.ndarray]:
    """``(o, lse)`` in float64, the Lq x Lk matrix materialised."""
    pipe, s = reference_scores(prob, mods)
    v64 = _float64(prob, prob.v)
    with numpy.errstate(invalid="ignore", divide="ignore"):
        lse = _logsumexp(s)
        lse = pipe.lse_with_sink(lse)
        shift = numpy.where(lse == -numpy.inf, 0.0, lse)   # a row with no visible key
        o = numpy.exp(s - shift[..., None]) @ v64
    return o, lse


def reference_backward(prob, mods: Modifiers, do, shapes=None) -> tuple[numpy.ndarray, ...]:
    """``dq, dk, dv`` (then ``dbias``, ``dsink`` when on) in float64 from the analytic formulas:
    ``dq, dk, dv`` are summed to ``shapes`` (the un-broadcast q, k, v shapes; default: the
    broadcast ones), 
    ``ds = p * (dp - rowsum(dp * p))`` through :meth:`ScorePipeline.grad_scores`,
    ``dsink = -sum_i p_sink_i D_i``."""
    saved: dict = {}
    pipe, s = reference_scores(prob, mods, saved)
    q64, k64, v64 = (_float64(prob, x) for x in (prob.q, prob.k, prob.v))
    do64 = _float64(prob, do)
    with numpy.errstate(invalid="ignore", divide="ignore"):
        lse = _logsumexp(s)
        lse = pipe.lse_with_sink(lse)
        dead = (lse == -numpy.inf)[..., None]
        p = numpy.where(dead, 0.0, numpy.exp(s - numpy.where(dead, 0.0, lse[..., None])))
        do64 = numpy.where(dead, 0.0, do64)
        dv = p.swapaxes(-1, -2) @ do64
        dp = do64 @ v64.swapaxes(-1, -2)
        D = (dp * p).sum(axis=-1)
        ds, ds_bias = pipe.grad_scores(p * (dp - D[..., None]), saved, 0, prob.Lq, 0, prob.Lk)
        dq = prob.scale * (ds @ k64)
        dk = prob.scale * (ds.swapaxes(-1, -2) @ q64)
    shapes = shapes or (dq.shape, dk.shape, dv.shape)
    grads = [_problem.sum_to_shape(g, shape, numpy.float64)
             for g, shape in zip((dq, dk, dv), shapes)]
    if ds_bias is not None:
        grads.append(_problem.sum_to_shape(ds_bias, mods.bias_shape, numpy.float64))
    if mods.sink is not None:
        grads.append(pipe.dsink(D, lse))
    return tuple(grads)
