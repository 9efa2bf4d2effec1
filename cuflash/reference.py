"""The float64 oracle: attention computed the obvious way, to test every backend against.

It materialises the full Lq x Lk score matrix in float64 NumPy, so use it on small problems.
"""

from __future__ import annotations

from typing import Any

import numpy

from cuflash import _modifiers, _modifiers_cpu, _problem


def logsumexp(s: numpy.ndarray) -> numpy.ndarray:
    """``log(sum(exp(s), axis=-1))`` in float64, without overflow: the row maximum is taken
    out first. A row of only ``-inf`` (no visible key), or an empty row, gives ``-inf``; a row
    with ``+inf`` gives ``+inf``; NaN propagates. Agrees with ``scipy.special.logsumexp``."""
    if s.shape[-1] == 0:
        return numpy.full(s.shape[:-1], -numpy.inf)
    m = s.max(axis=-1)
    with numpy.errstate(invalid="ignore", divide="ignore"):
        shift = numpy.where(numpy.isfinite(m), m, 0.0)  # -inf, +inf and NaN rows: no shift
        return numpy.log(numpy.exp(s - shift[..., None]).sum(axis=-1)) + shift


def attention(q: Any, k: Any, v: Any, *, scale: Any = None, causal: Any = False,
              return_lse: bool = False, out: Any = None, enable_gqa: bool = False,
              **modifiers: Any) -> Any:
    """Attention in float64, with the semantics and validation of :func:`cuflash.attention`.

    Computes ``s = scale * q @ k.T`` with masked entries set to ``-inf``,
    ``lse = logsumexp(s, axis=-1)`` and ``o = exp(s - lse) @ v``, all in float64
    NumPy, with the Lq x Lk matrix materialised. A row with no visible key subtracts 0 instead
    of ``lse = -inf``, so it gets ``o = 0`` and ``lse = -inf`` exactly, as in every backend.

    Parameters
    ----------
    q, k, v, scale, causal, return_lse, out, enable_gqa
        As for :func:`cuflash.attention`, validated by the same code: arrays of any framework
        (as :func:`cuflash.attention` takes them) of float16, bfloat16, float32 or float64.
        GPU inputs are copied to the host.
    **modifiers
        The modifier keywords of :func:`cuflash.attention` (``window``, ``softcap``,
        ``alibi_slopes``, ``sink``, ``bias``, ``mask``, ``score_mod``, ``mask_mod``,
        ``block_mask``), applied by the score pipeline the CPU path runs
        (``cuflash._pipeline``), here on the whole float64 matrix; ``mask_mod`` is evaluated on
        every pair (a block mask only names it). With a sink, ``lse = logaddexp(lse, sink)``.

    Returns
    -------
    o : numpy.ndarray of float64, shape batch_shape + (Lq, dv)
        Without ``out``. With ``out`` (same rules as :func:`cuflash.attention`: the inputs'
        array type and dtype), the result rounded to ``out.dtype`` is written into ``out``
        and ``out`` is returned.
    lse : numpy.ndarray of float64, shape batch_shape + (Lq,)
        Only with ``return_lse=True``.

    Notes
    -----
    Inputs are converted to float64 (a copy, materialising broadcast dimensions); NaN or Inf
    propagates exactly as IEEE arithmetic in these formulas says.
    """
    call = _problem.Call(q, k, v, enable_gqa, out=out)
    q, k, v, out = call.q, call.k, call.v, call.out
    prob = _problem.make_problem(q, k, v, scale=scale, causal=causal)
    mods = _check(prob, modifiers)
    _problem.check_return_lse(return_lse)
    if out is not None:
        _problem.check_out(prob, out)

    # s = the scaled, modified, masked float64 scores, lse = logsumexp(s) (and the sink); a
    # row with no visible key subtracts 0 instead of lse = -inf: _modifiers_cpu.reference_forward
    o, lse = _modifiers_cpu.reference_forward(prob, mods)

    if out is not None:
        with _problem.device_scope(prob):
            out[...] = prob.xp.asarray(o.astype(out.dtype))
        o = out
    return (call.output(o), call.lse_out(lse)) if return_lse else call.output(o)


def _check(prob, modifiers: dict):
    _modifiers.check_keywords(modifiers, "cuflash.reference.attention")
    return _modifiers.check_modifiers(xp=prob.xp, device_id=prob.device_id,
                                      batch_shape=prob.batch_shape, Lq=prob.Lq, Lk=prob.Lk,
                                      **modifiers)


def attention_backward(do: Any, q: Any, k: Any, v: Any, *, scale: Any = None,
                       causal: Any = False, enable_gqa: bool = False,
                       **modifiers: Any) -> tuple[numpy.ndarray, ...]:
    """Gradients of attention in float64, from the analytic formulas on the full matrix.

    With ``s = scale * q @ k.T`` (masked entries ``-inf``), ``p = softmax(s)`` and
    ``o = p @ v`` (all float64, the Lq x Lk matrices materialised)::

        dv = p.T @ do
        dp = do @ v.T
        ds = p * (dp - rowsum(dp * p))          # the softmax's Jacobian-vector product
        dq = scale * ds @ k
        dk = scale * ds.T @ q

    per broadcast batch item, then summed over the dimensions broadcasting added to q, k and v
    (the gradient of a broadcast input, as in NumPy/JAX). A row with no visible key has
    ``p = 0`` and contributes exactly 0 (its output is the constant 0).

    Parameters
    ----------
    do : array, shape batch_shape + (Lq, dv)
        The gradient of the output; the inputs' array type and dtype.
    q, k, v, scale, causal, enable_gqa, **modifiers
        As for :func:`attention`, validated by the same code. With modifiers, ``ds`` goes back
        through score_mod (the derivative of its trace) and softcap (``1 - tanh**2``) before
        ``dq``, ``dk``; ``dbias`` is ``ds`` after score_mod's factor, ``dsink`` is
        ``-sum_i exp(sink - lse_i) rowsum(do * o)_i``.

    Returns
    -------
    dq, dk, dv[, dbias][, dsink] : numpy.ndarray of float64
        Shapes equal to ``q.shape``, ``k.shape``, ``v.shape`` (the un-broadcast inputs), then
        ``bias.shape`` when ``bias`` is given and ``sink.shape`` when ``sink`` is given.
    """
    call = _problem.Call(q, k, v, enable_gqa, do=do)
    q, k, v, do = call.q, call.k, call.v, call.do
    prob = _problem.make_problem(q, k, v, scale=scale, causal=causal)
    mods = _check(prob, modifiers)
    _problem.check_backward_inputs(prob, do)
    do64 = (do if prob.xp is numpy else prob.xp.asnumpy(do)).astype(numpy.float64)
    grads = _modifiers_cpu.reference_backward(prob, mods, do64, (q.shape, k.shape, v.shape))
    return call.gradients(*grads[:3]) + tuple(grads[3:])
