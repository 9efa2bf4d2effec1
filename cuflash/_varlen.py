"""``attention_varlen``: sequences packed along the length axis (DESIGN.md, "Inference").

On CuPy: ONE launch of a forward family's varlen build over every (sequence, Q tile), and of
a backward family's over every (sequence, key tile) (``cuflash/_inference_varlen.py``; a block
finds its sequence in a host-made work list). Where that does not apply (NumPy, layouts it
cannot read, ``deterministic=True`` backward, ``CUFLASH_VARLEN_KERNEL=0``): one
:func:`cuflash.attention` (``attention_backward``) per sequence, on views of the packed arrays (``q[..., cu_q[s]:cu_q[s+1], :]``), writing into views of one output; no copy
of the inputs. ``cu_seqlens`` are read back to the host once per call on CuPy (a device sync;
``max_seqlen_*`` do not avoid it here, they are checked against the read-back lengths): they
are validated, and the work list is made from them.
"""

from __future__ import annotations

from typing import Any

import numpy

from . import _problem

_KEYWORDS = ("scale", "causal", "return_lse")


def _host_cu(cu: Any, name: str, total: int, xp) -> numpy.ndarray:
    mod = _problem._array_module(cu, name)
    if mod is not xp:
        raise TypeError(f"{name} must be a {xp.__name__} array like q, got {mod.__name__}")
    if cu.dtype != numpy.int32:
        raise TypeError(f"{name} must be int32, got {name}.dtype={cu.dtype}")
    if cu.ndim != 1 or cu.shape[0] < 1:
        raise ValueError(f"{name} must be 1-D (n_seq + 1,), got {name}.shape={cu.shape}")
    h = numpy.asarray(cu if xp is numpy else xp.asnumpy(cu)).astype(numpy.int64)
    if h[0] != 0:
        raise ValueError(f"{name}[0] must be 0, got {int(h[0])}")
    if h.size > 1 and (numpy.diff(h) < 0).any():
        i = int(numpy.flatnonzero(numpy.diff(h) < 0)[0])
        raise ValueError(f"{name} must be non-decreasing: {name}[{i}]={int(h[i])} > "
                         f"{name}[{i + 1}]={int(h[i + 1])}")
    if h[-1] != total:
        raise ValueError(f"{name}[-1]={int(h[-1])} must equal the packed length {total}")
    return h


def _check_max(value: Any, name: str, lengths: numpy.ndarray) -> None:
    if value is None:
        return
    if isinstance(value, (bool, numpy.bool_)) or not isinstance(value, (int, numpy.integer)):
        raise TypeError(f"{name} must be None or an int, got {value!r}")
    longest = int(lengths.max()) if lengths.size else 0
    if value < longest:
        raise ValueError(f"{name}={value} is below the longest sequence ({longest})")


def _split_kw(kw: dict) -> tuple:
    unknown = sorted(set(kw) - set(_KEYWORDS))
    if unknown:
        raise TypeError(f"attention_varlen got unexpected keywords {unknown}; it takes "
                        f"{list(_KEYWORDS)}")
    return kw.get("scale"), kw.get("causal", False), kw.get("return_lse", False)


def _prepare(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal):
    # validate the packed arrays as one attention call (types, dims, broadcasting, scale)
    prob = _problem.make_problem(q, k, v, scale=scale, causal=causal)
    xp = prob.xp
    cu_q = _host_cu(cu_seqlens_q, "cu_seqlens_q", prob.Lq, xp)
    cu_k = _host_cu(cu_seqlens_k, "cu_seqlens_k", prob.Lk, xp)
    if cu_q.shape != cu_k.shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have one length (n_seq + 1), got "
                         f"{cu_q.shape[0]} and {cu_k.shape[0]}")
    _check_max(max_seqlen_q, "max_seqlen_q", numpy.diff(cu_q))
    _check_max(max_seqlen_k, "max_seqlen_k", numpy.diff(cu_k))
    return prob, cu_q, cu_k


def attention_varlen(q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, *,
                     max_seqlen_q: Any = None, max_seqlen_k: Any = None, **kw) -> Any:
    """Attention of packed variable-length sequences.

    ``q (..., total_q, d)``, ``k (..., total_k, d)``, ``v (..., total_k, dv)`` (NumPy or CuPy,
    the dtypes and broadcasting of :func:`cuflash.attention`; FlashAttention's ``(total, H, d)``
    layout is ``x.transpose(1, 0, 2)`` away). ``cu_seqlens_q/k``: int32 ``(n_seq + 1,)``,
    non-decreasing, first 0, last the total; sequence s owns query rows ``cu_q[s]:cu_q[s+1]``
    and key rows ``cu_k[s]:cu_k[s+1]``. Positions restart at 0 in every sequence (``causal``
    aligns each sequence's own queries and keys); empty sequences are allowed (a sequence with
    queries and no keys gives 0 and ``lse = -inf``).

    Keywords: ``scale``, ``causal``, ``return_lse`` as for :func:`cuflash.attention`.
    ``max_seqlen_q/k``: optional host ints, checked against the lengths; on CuPy the
    ``cu_seqlens`` are read back to the host once per call either way (see the module).

    Returns ``o (batch..., total_q, dv)`` (and ``lse (batch..., total_q)`` float32, float64
    for float64, with ``return_lse=True``).
    """
    scale, causal, return_lse = _split_kw(kw)
    _problem.check_return_lse(return_lse)
    prob, cu_q, cu_k = _prepare(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                max_seqlen_k, scale, causal)
    from ._api import attention
    xp = prob.xp
    with _problem.device_scope(prob):
        o = xp.empty(prob.batch_shape + (prob.Lq, prob.dv), prob.dtype)
        lse = xp.empty(prob.batch_shape + (prob.Lq,), prob.lse_dtype)
        if xp is not numpy and o.size:
            from . import _inference_varlen
            if _inference_varlen.forward(prob, cu_q, cu_k, causal, o, lse) is None:
                return (o, lse) if return_lse else o
        for s in range(cu_q.size - 1):
            qs, qe, ks, ke = int(cu_q[s]), int(cu_q[s + 1]), int(cu_k[s]), int(cu_k[s + 1])
            if qe == qs:
                continue
            _, lse[..., qs:qe] = attention(prob.q[..., qs:qe, :], prob.k[..., ks:ke, :],
                                           prob.v[..., ks:ke, :], scale=scale, causal=causal,
                                           return_lse=True, out=o[..., qs:qe, :])
    return (o, lse) if return_lse else o


def attention_varlen_vjp(q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, *,
                         max_seqlen_q: Any = None, max_seqlen_k: Any = None, scale: Any = None,
                         causal: Any = False, deterministic: bool = False):
    """``o, pullback = attention_varlen_vjp(...)``: the forward of :func:`attention_varlen` and
    its pullback ``pullback(do) -> (dq, dk, dv)`` (the pattern of :func:`cuflash.attention_vjp`):
    on CuPy one launch of the backward family's varlen build over every (sequence, key tile),
    else (NumPy, ``deterministic=True``, layouts it cannot read) one
    :func:`cuflash.attention_backward` per sequence. Gradients have the shapes of
    q, k, v (summed over broadcast dims as attention_backward does)."""
    from ._api import attention_backward
    _problem.check_deterministic(deterministic)
    o, lse = attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                              max_seqlen_k=max_seqlen_k, scale=scale, causal=causal,
                              return_lse=True)
    prob, cu_q, cu_k = _prepare(q, k, v, cu_seqlens_q, cu_seqlens_k, None, None, scale, causal)
    xp = prob.xp

    def pullback(do: Any):
        _problem.check_backward_inputs(prob, do)
        with _problem.device_scope(prob):
            dq, dk, dv = xp.zeros(q.shape, q.dtype), xp.zeros(k.shape, k.dtype), \
                xp.zeros(v.shape, v.dtype)
            if xp is not numpy and dq.size and dk.size:
                from . import _inference_varlen
                if _inference_varlen.backward(prob, cu_q, cu_k, causal, do, o, lse, dq, dk, dv,
                                              deterministic) is None:
                    return dq, dk, dv
            for s in range(cu_q.size - 1):
                qs, qe, ks, ke = (int(cu_q[s]), int(cu_q[s + 1]), int(cu_k[s]),
                                  int(cu_k[s + 1]))
                if qe == qs or ke == ks:
                    continue      # no query, or no key: every gradient of the sequence is 0
                g = attention_backward(do[..., qs:qe, :], q[..., qs:qe, :], k[..., ks:ke, :],
                                       v[..., ks:ke, :], o[..., qs:qe, :], lse[..., qs:qe],
                                       scale=scale, causal=causal, deterministic=deterministic)
                dq[..., qs:qe, :], dk[..., ks:ke, :], dv[..., ks:ke, :] = g
        return dq, dk, dv

    return o, pullback
