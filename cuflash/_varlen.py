"""``attention_varlen``: sequences packed along the length axis (DESIGN.md, "Inference").

On CuPy: ONE launch of a forward family's varlen build over every (sequence, Q tile), and of
a backward family's over every (sequence, key tile) (``cuflash/_inference_varlen.py``; a block
finds its sequence in a host-made work list). Where that does not apply (NumPy, layouts it
cannot read, ``deterministic=True`` backward, ``CUFLASH_VARLEN_KERNEL=0``): one
:func:`cuflash.attention` (``attention_backward``) per sequence, on views of the packed arrays
(``q[..., cu_q[s]:cu_q[s+1], :]``), writing into views of one output; no copy of the inputs.

``cu_seqlens`` are needed on the host (they are validated, and the work list is made from
them). NumPy ``cu_seqlens`` with CuPy q, k, v are used as they are: no device sync at all (the
way to call it asynchronously, as FlashAttention's host ``max_seqlen``). CuPy ``cu_seqlens``
are read back once per call, both arrays in one synchronizing copy (:func:`_read_host`), which
waits for the work queued before it on the stream.

Plans (as ``attention()``'s fast path, ``_api``): the one-launch forward and backward are
cached (``_plan.PlanCache``: bounded, thread-safe) under a key of the layouts of q, k, v (and
do, o, lse), the ``cu_seqlens`` CONTENTS, ``max_seqlen_*``, the keywords with their types and
the current stream; a plan holds the validated problem's Launch with its work list already on
the device. A repeated call (same shapes and lengths) reads ``cu_seqlens`` (if on the device),
looks the plan up, allocates the outputs, patches the pointers and launches. A key is only
stored after a call with it passed validation, so a hit skips validation; other lengths are
another key (a miss: the full path, the same errors as ever). The stream is in the key
because the cached work list was allocated from CuPy's pool on it: the pool reuses it only
for later work on that stream, after every kernel that read it.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy

from . import _problem
from ._fast import FastForward, layout as _layout   # (what a plan depends on in one array)

_KEYWORDS = ("scale", "causal", "return_lse")
#: the one-launch plans: forward (_FastVarlen) and backward (_inference_varlen.BackwardLaunch)
_FWD = _BWD = None


def _caches():
    global _FWD, _BWD
    if _FWD is None:
        from ._plan import PlanCache
        _FWD, _BWD = PlanCache(), PlanCache()
    return _FWD, _BWD


def clear_plans() -> None:
    """Forget the cached varlen plans (``cuflash._api.clear_plans`` calls it)."""
    if _FWD is not None:
        _FWD.clear()
        _BWD.clear()


def _read_host(cu_q: Any, cu_k: Any, cupy) -> tuple | None:
    """``(cu_q, cu_k)`` as int32 NumPy arrays: NumPy ones as they are, CuPy ones read back in
    ONE synchronizing copy (both into one pinned buffer on the current stream, then one
    stream sync; the same array given twice is read once). None where either is not a 1-D
    int32 NumPy or CuPy array of at least one element: the full path's validation then says
    what is wrong."""
    for cu in (cu_q, cu_k):
        t = type(cu)
        if (t is not numpy.ndarray and t is not cupy.ndarray) or cu.dtype != numpy.int32 \
                or cu.ndim != 1 or cu.shape[0] < 1:
            return None
    dev = [cu for cu in ((cu_q,) if cu_q is cu_k else (cu_q, cu_k)) if type(cu) is not
           numpy.ndarray]
    if not dev:
        return cu_q, cu_k
    n = sum(x.shape[0] for x in dev)
    pinned = cupy.cuda.alloc_pinned_memory(4 * n)
    buf = numpy.frombuffer(pinned, numpy.int32, n)
    stream = cupy.cuda.get_current_stream()
    at = 0
    for x in dev:
        if not x.flags.c_contiguous:     # a strided view: one element apart, for the copy
            x = cupy.ascontiguousarray(x)
        cupy.cuda.runtime.memcpyAsync(buf.ctypes.data + 4 * at, x.data.ptr, 4 * x.shape[0],
                                      cupy.cuda.runtime.memcpyDeviceToHost, stream.ptr)
        at += x.shape[0]
    stream.synchronize()
    host = buf.copy()        # the pinned block goes back to its pool with ``pinned``
    parts, at = [], 0
    for x in dev:
        parts.append(host[at:at + x.shape[0]])
        at += x.shape[0]
    first = cu_q if type(cu_q) is numpy.ndarray else parts.pop(0)
    if cu_k is cu_q:
        return first, first
    return first, (cu_k if type(cu_k) is numpy.ndarray else parts.pop(0))


def _host_cu(cu: Any, name: str, total: int, xp, host=None) -> numpy.ndarray:
    """The validated ``cu`` on the host (int64); ``host``: its values already read back."""
    mod = _problem._array_module(cu, name)
    if mod is not xp and not (mod is numpy and xp is not numpy):
        raise TypeError(f"{name} must be a {xp.__name__} array like q, got {mod.__name__}")
    if cu.dtype != numpy.int32:
        raise TypeError(f"{name} must be int32, got {name}.dtype={cu.dtype}")
    if cu.ndim != 1 or cu.shape[0] < 1:
        raise ValueError(f"{name} must be 1-D (n_seq + 1,), got {name}.shape={cu.shape}")
    if host is None:
        host = cu if mod is numpy else xp.asnumpy(cu)
    h = numpy.asarray(host).astype(numpy.int64)
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


def _prepare(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal,
             host=None):
    """(problem, host cu_q, host cu_k), validated; ``host``: ``_read_host``'s pair, if read."""
    # validate the packed arrays as one attention call (types, dims, broadcasting, scale)
    prob = _problem.make_problem(q, k, v, scale=scale, causal=causal)
    xp = prob.xp
    hq, hk = host if host is not None else (None, None)
    cu_q = _host_cu(cu_seqlens_q, "cu_seqlens_q", prob.Lq, xp, hq)
    cu_k = _host_cu(cu_seqlens_k, "cu_seqlens_k", prob.Lk, xp, hk)
    if cu_q.shape != cu_k.shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have one length (n_seq + 1), got "
                         f"{cu_q.shape[0]} and {cu_k.shape[0]}")
    _check_max(max_seqlen_q, "max_seqlen_q", numpy.diff(cu_q))
    _check_max(max_seqlen_k, "max_seqlen_k", numpy.diff(cu_k))
    return prob, cu_q, cu_k


_ENABLED = None


def _enabled() -> bool:
    """CUFLASH_VARLEN_KERNEL is read on every call (A/B runs switch it between calls): a
    cached one-launch plan serves a call only while the one-launch path is on."""
    global _ENABLED
    if _ENABLED is None:      # _inference_varlen imports the registry: not at import time
        from ._inference_varlen import enabled
        _ENABLED = enabled
    return _ENABLED()


class _FastVarlen(FastForward):
    """A cached one-launch forward: the ``ForwardLaunch`` and the shapes of what the call
    returns; o and lse share one allocation (o first, lse at a 256-byte aligned offset), as
    ``_fast.FastForward``, whose record it is."""
    __slots__ = ()

    def _bind(self, plan) -> None:   # (its __call__ is its own: nothing to look up)
        pass

    def __call__(self, cupy, stream: int, q, k, v):
        mem = cupy.cuda.alloc(self.nbytes)
        self.plan(stream, q.data.ptr, k.data.ptr, v.data.ptr, mem.ptr, mem.ptr + self.lse_offset)
        return (cupy.ndarray(self.o_shape, self.dtype, memptr=mem),
                cupy.ndarray(self.lse_shape, self.lse_dtype, memptr=mem + self.lse_offset))


def _forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, kw) -> tuple:
    """(o, lse, host) of ``attention_varlen``: ``host`` the ``cu_seqlens`` pair read on the
    CuPy path (None on NumPy, or where ``_read_host`` declined)."""
    cupy = sys.modules.get("cupy")
    host = key = None
    if cupy is not None and type(q) is cupy.ndarray and type(k) is cupy.ndarray \
            and type(v) is cupy.ndarray:
        host = _read_host(cu_seqlens_q, cu_seqlens_k, cupy)
        if host is not None and set(kw) <= set(_KEYWORDS):
            scale, causal = kw.get("scale"), kw.get("causal", False)
            stream = cupy.cuda.get_current_stream().ptr
            key = (_layout(q), _layout(k), _layout(v), host[0].tobytes(), host[1].tobytes(),
                   max_seqlen_q, max_seqlen_q.__class__, max_seqlen_k, max_seqlen_k.__class__,
                   scale, scale.__class__, causal, causal.__class__, stream)
            try:
                fast = _caches()[0].get(key)
            except TypeError:     # an unhashable argument: validation will say what is wrong
                fast, key = None, None
            if fast is not None and kw.get("return_lse", False).__class__ is bool \
                    and cupy.cuda.runtime.getDevice() == fast.device_id and _enabled():
                return fast(cupy, stream, q, k, v) + (host,)

    scale, causal, return_lse = _split_kw(kw)
    _problem.check_return_lse(return_lse)
    prob, cu_q, cu_k = _prepare(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                max_seqlen_k, scale, causal, host)
    from ._api import attention
    xp = prob.xp
    with _problem.device_scope(prob):
        o = xp.empty(prob.batch_shape + (prob.Lq, prob.dv), prob.dtype)
        lse = xp.empty(prob.batch_shape + (prob.Lq,), prob.lse_dtype)
        if xp is not numpy and o.size:
            from . import _inference_varlen
            plan = _inference_varlen.forward_plan(prob, cu_q, cu_k, causal, o, lse)
            if not isinstance(plan, str):
                plan(xp.cuda.get_current_stream().ptr, prob.q.data.ptr, prob.k.data.ptr,
                     prob.v.data.ptr, o.data.ptr, lse.data.ptr)
                if key is not None:
                    _caches()[0].put(key, _FastVarlen(plan, o, lse))
                return o, lse, host
        for s in range(cu_q.size - 1):
            qs, qe, ks, ke = int(cu_q[s]), int(cu_q[s + 1]), int(cu_k[s]), int(cu_k[s + 1])
            if qe == qs:
                continue
            _, lse[..., qs:qe] = attention(prob.q[..., qs:qe, :], prob.k[..., ks:ke, :],
                                           prob.v[..., ks:ke, :], scale=scale, causal=causal,
                                           return_lse=True, out=o[..., qs:qe, :])
    return o, lse, host


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

    ``cu_seqlens`` on the host or the device: with CuPy q, k, v they may be CuPy arrays, read
    back to the host once per call (one synchronizing copy of both: the call waits for the
    work queued before it), or **NumPy arrays, the way to call it without a device sync**
    (FlashAttention's host ``max_seqlen`` plays that part there): nothing is read back, and a
    repeated call with the same lengths is a plan-cache lookup and one launch (see the
    module). With NumPy q, k, v they must be NumPy arrays.

    Keywords: ``scale``, ``causal``, ``return_lse`` as for :func:`cuflash.attention`.
    ``max_seqlen_q/k``: optional host ints, checked against the lengths (they do not avoid
    the read-back of CuPy ``cu_seqlens``: pass those as NumPy arrays for that).

    Returns ``o (batch..., total_q, dv)`` (and ``lse (batch..., total_q)`` float32, float64
    for float64, with ``return_lse=True``).
    """
    o, lse, _ = _forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, kw)
    return (o, lse) if kw.get("return_lse", False) else o


def attention_varlen_vjp(q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, *,
                         max_seqlen_q: Any = None, max_seqlen_k: Any = None, scale: Any = None,
                         causal: Any = False, deterministic: bool = False):
    """``o, pullback = attention_varlen_vjp(...)``: the forward of :func:`attention_varlen` and
    its pullback ``pullback(do) -> (dq, dk, dv)`` (the pattern of :func:`cuflash.attention_vjp`):
    on CuPy one launch of the backward family's varlen build over every (sequence, key tile),
    else (NumPy, ``deterministic=True``, layouts it cannot read) one
    :func:`cuflash.attention_backward` per sequence. Gradients have the shapes of
    q, k, v (summed over broadcast dims as attention_backward does). ``cu_seqlens`` are read
    (if on the device) once, by the forward; the one-launch backward is cached as the forward
    is (its key adds the layouts of do, o and lse)."""
    from ._api import attention_backward
    _problem.check_deterministic(deterministic)
    o, lse, host = _forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                            {"scale": scale, "causal": causal, "return_lse": True})
    if host is not None:     # the lengths of this forward, whatever becomes of NumPy arrays
        host = (host[0].copy(), host[1].copy())

    def pullback(do: Any):
        cupy = sys.modules.get("cupy")
        key = None
        if host is not None and deterministic is False and type(do) is cupy.ndarray:
            key = (_layout(do), _layout(q), _layout(k), _layout(v), _layout(o), _layout(lse),
                   host[0].tobytes(), host[1].tobytes(), scale, scale.__class__, causal,
                   causal.__class__, cupy.cuda.get_current_stream().ptr)
            try:
                fast = _caches()[1].get(key)
            except TypeError:
                fast, key = None, None
            if fast is not None and cupy.cuda.runtime.getDevice() == fast.device_id \
                    and _enabled():
                dq, dk, dv = (cupy.zeros(x.shape, x.dtype) for x in (q, k, v))
                fast(do, q, k, v, o, lse, dq, dk, dv)
                return dq, dk, dv
        # validated by the forward already: no error here, and no second read-back
        prob, cu_q, cu_k = _prepare(q, k, v, cu_seqlens_q, cu_seqlens_k, None, None, scale,
                                    causal, host)
        xp = prob.xp
        _problem.check_backward_inputs(prob, do)
        with _problem.device_scope(prob):
            dq, dk, dv = xp.zeros(q.shape, q.dtype), xp.zeros(k.shape, k.dtype), \
                xp.zeros(v.shape, v.dtype)
            if xp is not numpy and dq.size and dk.size:
                from . import _inference_varlen
                plan = _inference_varlen.backward_plan(prob, cu_q, cu_k, causal, do, o, lse, dq,
                                                       dk, dv, deterministic)
                if not isinstance(plan, str):
                    plan(do, prob.q, prob.k, prob.v, o, lse, dq, dk, dv)
                    if key is not None:
                        _caches()[1].put(key, plan)
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
