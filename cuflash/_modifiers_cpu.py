"""The float64 reference with modifiers: the whole Lq x Lk matrix through the pipeline.

``cuflash.reference`` calls these; the blocked CPU path (``_numpy``) runs the same
:class:`cuflash._pipeline.ScorePipeline` on tiles. The sink is a key every row sees, with score
``sink`` and value 0: ``lse = logaddexp(lse over the keys, sink)``, so a row with no visible key
gets ``o = 0`` and ``lse = sink``.
"""

from __future__ import annotations

from typing import Any

import numpy

from cuflash import _problem
from cuflash._modifiers import Modifiers
from cuflash._pipeline import ScorePipeline


def _logsumexp(s: numpy.ndarray) -> numpy.ndarray:
    from cuflash.reference import logsumexp   # here: reference imports this module
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
