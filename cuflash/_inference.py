"""Inference: attention over a KV cache (dense or paged, with in-place append), the merge of
partial attention states, and packed variable-length sequences (DESIGN.md, "Inference").

Public (wired into ``cuflash`` by the lead): :func:`attention_with_kvcache`,
:func:`merge_states`, :func:`attention_varlen` (in ``_varlen``).

Paths. NumPy arrays run the CPU path: the cache rows of each batch row are gathered (dense:
views; paged: the pages of ``block_table``) and :func:`cuflash.attention` runs on them. CuPy
arrays run the split-KV decode family (``cuda_src/decode.cu`` + ``combine.cu``, launched by
``_inference_gpu``) whenever it applies: float16/bfloat16/float32, head dims multiples of 8,
rows contiguous and 16-byte aligned, at most 64 packed query rows (G query heads x Lq) and
query heads that fold into (one KV-head dim, one group dim). Anything else runs the generic
path on the device: the same per-row gathering as the CPU path, which reads ``cache_seqlens``
back to the host once (a device sync). ``explain_kvcache`` says which path a call takes.
"""

from __future__ import annotations

import inspect
import numbers
import sys
from typing import Any

import numpy

from . import _problem
from ._plan import PlanCache

#: plans of calls that took the decode family, keyed by the raw arguments' layouts (fast path)
_FAST = PlanCache(256)

# _problem._check_scale gained the dtype (a scale must be a normal number of the accumulation
# dtype) in main; take either form so this module works on both sides of that change
_SCALE_TAKES_DTYPE = len(inspect.signature(_problem._check_scale).parameters) == 3


def _check_scale(scale, d: int, dtype) -> float:
    if _SCALE_TAKES_DTYPE:
        return _problem._check_scale(scale, d, dtype)
    return _problem._check_scale(scale, d)

_HALF_OR_FLOAT = ("float16", "bfloat16", "float32", "float64")


# ---------------------------------------------------------------------------------------------
# merge_states
# ---------------------------------------------------------------------------------------------

def merge_states(os: Any, lses: Any) -> tuple[Any, Any]:
    """Merge attention states computed over disjoint key sets into the state of their union.

    ``(o_s, lse_s)`` is attention of the same queries over key set s (``o_s`` normalised,
    ``lse_s`` the natural-log log-sum-exp of its scores). The union's state is::

        lse = log(sum_s exp(lse_s)),   o = sum_s exp(lse_s - lse) * o_s

    computed with the maximum subtracted first (no overflow). The order of the sum is s = 0,
    1, ...: results are deterministic. NumPy and CuPy alike (on CuPy: a few elementwise
    kernels per state; the decode's own combine is the fused ``cuda_src/combine.cu``).

    Parameters
    ----------
    os : array ``(S, ..., L, dv)`` or a sequence of S arrays ``(..., L, dv)``
        float16, bfloat16, float32 or float64, one dtype, one shape.
    lses : array ``(S, ..., L)`` or a sequence of S arrays ``(..., L)``
        Real floating dtype; ``-inf`` where a row saw no key in that set. Values must be
        below ``+inf`` (``+inf`` or NaN make the row NaN).

    Returns
    -------
    o : array ``(..., L, dv)``, the dtype of ``os``
    lse : array ``(..., L)``, float32 (float64 when ``os`` is float64)
        A row whose every ``lse_s`` is ``-inf`` gets ``o = 0`` and ``lse = -inf`` (no NaN).
        Accumulation is float32 (float64 for float64 ``os``).

    Raises
    ------
    TypeError: arrays of another type, NumPy mixed with CuPy, unsupported dtypes.
    ValueError: no state (S = 0), shapes that disagree, arrays on different devices.
    """
    o_list, lse_list = _states(os, "os"), _states(lses, "lses")
    if len(o_list) != len(lse_list):
        raise ValueError(f"os has {len(o_list)} states and lses {len(lse_list)}")
    if not o_list:
        raise ValueError("merge_states needs at least one state, got S = 0")
    xps = {_problem._array_module(x, "os/lses") for x in o_list + lse_list}
    if len(xps) > 1:
        raise TypeError("os and lses must all be NumPy arrays or all be CuPy arrays")
    xp = xps.pop()
    dtypes = {x.dtype for x in o_list}
    if len(dtypes) > 1 or o_list[0].dtype.name not in _HALF_OR_FLOAT:
        raise TypeError(f"os must have one dtype among {_HALF_OR_FLOAT}, got "
                        f"{sorted(str(t) for t in dtypes)}")
    for x in lse_list:
        if x.dtype.kind != "f":
            raise TypeError(f"lses must be real floating arrays, got dtype {x.dtype}")
    shape = o_list[0].shape
    if len(shape) < 1 or any(x.shape != shape for x in o_list):
        raise ValueError(f"os must all have one shape (..., L, dv), got "
                         f"{[x.shape for x in o_list]}")
    if any(x.shape != shape[:-1] for x in lse_list):
        raise ValueError(f"lses must have shape os.shape[:-1] = {shape[:-1]}, got "
                         f"{[x.shape for x in lse_list]}")
    if xp is not numpy and len({x.device.id for x in o_list + lse_list}) > 1:
        raise ValueError("os and lses must be on one device")

    acc = numpy.float64 if o_list[0].dtype == numpy.float64 else numpy.float32
    ctx = xp.cuda.Device(o_list[0].device.id) if xp is not numpy else _nullcontext()
    with ctx:
        lse32 = [x.astype(acc, copy=False) for x in lse_list]
        m = lse32[0]
        for x in lse32[1:]:
            m = xp.maximum(m, x)
        # rows where every state is -inf: exponentials against 0, so -inf - -inf never occurs
        ref = xp.where(m == -numpy.inf, acc(0), m)
        total = xp.zeros(shape[:-1], acc)
        o = xp.zeros(shape, acc)
        for os_, x in zip(o_list, lse32):
            w = xp.exp(x - ref)
            total += w
            o += w[..., None] * os_.astype(acc, copy=False)
        seen = total > 0
        o /= xp.where(seen, total, acc(1))[..., None]
        lse = xp.where(seen, ref + xp.log(xp.where(seen, total, acc(1))), acc(-numpy.inf))
        return o.astype(o_list[0].dtype, copy=False), lse


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _states(x: Any, name: str) -> list:
    if isinstance(x, (list, tuple)):
        return list(x)
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be an array (S, ...) or a list of arrays, got "
                        f"{type(x).__qualname__}")
    _problem._array_module(x, name)
    if x.ndim < 1:
        raise ValueError(f"{name} must have a leading state dimension, got {name}.shape={x.shape}")
    return [x[s] for s in range(x.shape[0])]


# ---------------------------------------------------------------------------------------------
# attention_with_kvcache: validation
# ---------------------------------------------------------------------------------------------

class KVCacheCall:
    """A validated ``attention_with_kvcache`` call (no arrays modified yet)."""

    def __init__(self, **kw):
        self.__dict__.update(kw)


def check_kvcache(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, num_splits,
                  scale, causal, return_lse) -> KVCacheCall:
    arrays = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "cache_seqlens": cache_seqlens}
    for name, x in (("block_table", block_table), ("k_new", k_new), ("v_new", v_new)):
        if x is not None:
            arrays[name] = x
    xps = {name: _problem._array_module(x, name) for name, x in arrays.items()}
    if len(set(xps.values())) > 1:
        raise TypeError("q, the caches, cache_seqlens, block_table, k_new and v_new must all be "
                        "NumPy arrays or all CuPy arrays, got "
                        + ", ".join(f"{n}: {m.__name__}" for n, m in xps.items()))
    xp = xps["q"]
    if (k_new is None) != (v_new is None):
        raise ValueError("k_new and v_new go together: got "
                         + ("k_new without v_new" if v_new is None else "v_new without k_new"))
    dtype = q.dtype
    if dtype not in _problem.SUPPORTED_DTYPES:
        raise TypeError(f"q.dtype={dtype} is not supported; use one of "
                        f"{', '.join(str(t) for t in _problem.SUPPORTED_DTYPES)}")
    for name in ("k_cache", "v_cache", "k_new", "v_new"):
        if name in arrays and arrays[name].dtype != dtype:
            raise TypeError(f"{name}.dtype={arrays[name].dtype} differs from q.dtype={dtype}")
    for name in ("cache_seqlens", "block_table"):
        if name in arrays and arrays[name].dtype != numpy.int32:
            raise TypeError(f"{name} must be int32, got {name}.dtype={arrays[name].dtype}")
    if xp is not numpy:
        devs = {n: x.device.id for n, x in arrays.items()}
        if len(set(devs.values())) > 1:
            raise ValueError(f"all arrays must be on one device, got {devs}")

    if q.ndim < 3:
        raise ValueError(f"q must be (B, ..., Lq, d), got {q.shape=}")
    if k_cache.ndim < 3 or v_cache.ndim != k_cache.ndim:
        raise ValueError(f"k_cache and v_cache must be (B or num_blocks, ..., L, d) with one "
                         f"number of dims, got {k_cache.shape=} and {v_cache.shape=}")
    if k_cache.shape[:-1] != v_cache.shape[:-1]:
        raise ValueError(f"k_cache and v_cache disagree: {k_cache.shape=}, {v_cache.shape=}")
    B, Lq, d = q.shape[0], q.shape[-2], q.shape[-1]
    dv = v_cache.shape[-1]
    if k_cache.shape[-1] != d:
        raise ValueError(f"head dims of q and k_cache differ: {q.shape=}, {k_cache.shape=}")
    for name, size in (("d", d), ("dv", dv)):
        if not 1 <= size <= _problem.MAX_HEAD_DIM:
            raise ValueError(f"head dim {name}={size} must be in 1..{_problem.MAX_HEAD_DIM}")
    c_mid = k_cache.shape[1:-2]
    try:
        mid = tuple(numpy.broadcast_shapes(q.shape[1:-2], c_mid))
    except ValueError:
        raise ValueError(f"the head dims of {q.shape=} and {k_cache.shape=} (between the batch "
                         f"and the length) do not broadcast; GQA is q (B, Hkv, G, Lq, d) with "
                         f"a cache (B, Hkv, 1, Lmax, d)") from None
    if cache_seqlens.shape != (B,):
        raise ValueError(f"cache_seqlens must have shape (B,) = ({B},), got "
                         f"{cache_seqlens.shape=}")
    paged = block_table is not None
    if paged:
        if block_table.ndim != 2 or block_table.shape[0] != B:
            raise ValueError(f"block_table must be (B, max_blocks) = ({B}, ...), got "
                             f"{block_table.shape=}")
        num_blocks, page_size = k_cache.shape[0], k_cache.shape[-2]
        if page_size < 1 or num_blocks < 1:
            raise ValueError(f"a paged cache needs page_size >= 1 and num_blocks >= 1, got "
                             f"{k_cache.shape=}")
        capacity = block_table.shape[1] * page_size
    else:
        if k_cache.shape[0] != B:
            raise ValueError(f"a dense cache is (B, ..., Lmax, d) with B = q.shape[0] = {B}, "
                             f"got {k_cache.shape=}")
        num_blocks, page_size, capacity = 0, 0, k_cache.shape[-2]
    Lnew = 0
    if k_new is not None:
        Lnew = k_new.shape[-2] if k_new.ndim >= 2 else -1
        want_k = (B,) + c_mid + (Lnew, d)
        if k_new.shape != want_k:
            raise ValueError(f"k_new must be (B,) + k_cache's head dims + (Lnew, d) = {want_k}, "
                             f"got {k_new.shape=}")
        if v_new.shape != (B,) + c_mid + (Lnew, dv):
            raise ValueError(f"v_new must be {(B,) + c_mid + (Lnew, dv)}, got {v_new.shape=}")
        if Lnew > capacity:
            raise ValueError(f"k_new appends Lnew={Lnew} keys, more than the cache holds "
                             f"(capacity {capacity} keys a batch row)")
        for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
            if any(s == 0 and n > 1 for n, s in zip(x.shape, x.strides)):
                raise ValueError(f"{name} is a broadcast view (stride 0): it cannot be "
                                 f"appended to, {name}.strides={x.strides}")
            if xp is numpy and not x.flags.writeable:
                raise ValueError(f"{name} is read-only and k_new was given")
    if num_splits is not None and (isinstance(num_splits, (bool, numpy.bool_))
                                   or not isinstance(num_splits, numbers.Integral)):
        raise TypeError(f"num_splits must be None or an int, got {num_splits!r}")
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits=}")
    if isinstance(causal, str):
        if causal != "bottom_right":
            raise ValueError(f"a KV cache aligns causal bottom-right: causal must be a bool or "
                             f"'bottom_right', got {causal=}")
        causal = True
    elif not isinstance(causal, (bool, numpy.bool_)):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    _problem.check_return_lse(return_lse)
    scale = _check_scale(scale, d, dtype)

    if xp is numpy:   # host values: exact checks before any write
        s = cache_seqlens
        if s.size and (s.min() < 0 or s.max() > capacity - Lnew):
            bad = int(numpy.flatnonzero((s < 0) | (s > capacity - Lnew))[0])
            raise ValueError(f"cache_seqlens[{bad}]={int(s[bad])} with Lnew={Lnew} does not fit "
                             f"the cache: 0 <= cache_seqlens <= capacity - Lnew = "
                             f"{capacity - Lnew}")
        if paged:
            need = -(-(s.astype(numpy.int64) + Lnew) // page_size)
            for b in range(B):
                row = block_table[b, :need[b]]
                if row.size and (row.min() < 0 or row.max() >= num_blocks):
                    page = int(row.min() if row.min() < 0 else row.max())
                    raise ValueError(f"block_table[{b}] holds page {page} outside "
                                     f"0..num_blocks-1 = {num_blocks - 1}")
    return KVCacheCall(xp=xp, q=q, k_cache=k_cache, v_cache=v_cache, seqlens=cache_seqlens,
                       block_table=block_table, k_new=k_new, v_new=v_new, B=B, Lq=Lq, d=d,
                       dv=dv, mid=mid, c_mid=c_mid, paged=paged, num_blocks=num_blocks,
                       page_size=page_size, capacity=capacity, Lnew=Lnew,
                       num_splits=None if num_splits is None else int(num_splits),
                       scale=scale, causal=bool(causal), return_lse=bool(return_lse),
                       dtype=dtype, lse_dtype=numpy.dtype(numpy.float64 if dtype == numpy.float64
                                                          else numpy.float32),
                       device_id=None if xp is numpy else q.device.id)


# ---------------------------------------------------------------------------------------------
# attention_with_kvcache
# ---------------------------------------------------------------------------------------------

def attention_with_kvcache(q: Any, k_cache: Any, v_cache: Any, *, cache_seqlens: Any,
                           block_table: Any = None, k_new: Any = None, v_new: Any = None,
                           num_splits: Any = None, scale: Any = None, causal: Any = False,
                           return_lse: bool = False) -> Any:
    """Attention of ``q`` over a KV cache, after appending ``k_new`` / ``v_new`` to it in place.

    For batch row ``b`` let ``n_b = cache_seqlens[b] + Lnew``. The new keys and values are
    written at positions ``cache_seqlens[b] .. n_b - 1``; then the queries attend to the first
    ``n_b`` keys. Under ``causal`` the alignment is bottom-right: query ``i`` sits at position
    ``n_b - Lq + i`` and sees keys ``j <= n_b - Lq + i`` (chunked prefill and decode alike).

    Parameters
    ----------
    q : array ``(B, ..., Lq, d)``
        NumPy or CuPy, float16/bfloat16/float32/float64. The head dims ``...`` broadcast with
        the cache's by NumPy rules: GQA is ``q (B, Hkv, G, Lq, d)`` with a cache
        ``(B, Hkv, 1, Lmax, d)`` (``k_cache[:, :, None]`` is such a view).
    k_cache, v_cache : arrays
        Dense: ``(B, ..., Lmax, d)`` and ``(B, ..., Lmax, dv)``. Paged: ``(num_blocks, ...,
        page_size, d|dv)`` with ``block_table``; any ``page_size >= 1`` (the GPU decode is
        fastest for multiples of 16). Written in place when ``k_new`` is given.
    cache_seqlens : int32 array ``(B,)``
        Keys already in the cache of each batch row; not modified.
    block_table : int32 array ``(B, max_blocks)``, optional
        Page ``block_table[b, p]`` holds keys ``p * page_size ...`` of batch row ``b``.
    k_new, v_new : arrays ``(B, ..., Lnew, d|dv)``, optional, together
        The cache's own head dims (no broadcasting: every cache head gets its own rows).
    num_splits : int, optional
        Key splits of the GPU decode; None picks by a heuristic that fills the SMs. The result
        does not depend on it beyond rounding; for a given value it is bitwise reproducible.
    scale, causal, return_lse
        As for :func:`cuflash.attention` (``causal`` is a bool or ``'bottom_right'``).

    Returns
    -------
    o : array ``(B, ...broadcast head dims, Lq, dv)``, the dtype of ``q`` (and ``lse``
    ``(B, ..., Lq)`` float32, float64 for float64, with ``return_lse=True``). A row that sees
    no key gets 0 and ``lse = -inf``.

    Bounds. Nothing is read or written outside the cache or the page table. On NumPy every
    bound is checked before any write (``ValueError``: cache_seqlens below 0 or above
    ``capacity - Lnew``, pages outside ``0..num_blocks-1``). On CuPy ``cache_seqlens`` and
    ``block_table`` are device values the host does not read (a sync per call would cost more
    than the decode): shapes, dtypes and ``Lnew <= capacity`` are checked, and on the device a
    ``cache_seqlens[b]`` outside ``[0, capacity - Lnew]`` is clamped into it and a page index
    outside ``[0, num_blocks)`` is clamped into it (both for the append and the attention).
    The generic device path (see the module) reads ``cache_seqlens`` back and applies the same
    clamps.
    """
    arrays = (q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new)
    cupy = sys.modules.get("cupy")
    key = None
    if cupy is not None and type(q) is cupy.ndarray:
        # fast path: a call whose arrays have the layouts (and devices) of one that passed
        # validation before, with the same keywords, runs its cached plan directly
        try:
            key = tuple(None if x is None else (x.shape, x.strides, x.dtype,
                                                x.data.ptr % 16, x.data.device_id)
                        for x in arrays) + (num_splits, num_splits.__class__, scale,
                                            scale.__class__, causal, causal.__class__,
                                            return_lse, return_lse.__class__)
            fast = _FAST.get(key)
        except (AttributeError, TypeError):     # not all CuPy, or unhashable: validate
            key = fast = None
        if fast is not None and cupy.cuda.runtime.getDevice() == fast.device_id:
            o, lse = fast.run_arrays(*arrays)
            return (o, lse) if return_lse else o
    c = check_kvcache(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new,
                      num_splits, scale, causal, return_lse)
    xp = c.xp
    out_shape = (c.B,) + c.mid + (c.Lq, c.dv)
    if xp is not numpy:
        from . import _inference_gpu
        with xp.cuda.Device(c.device_id):
            plan = _inference_gpu.decode_plan(c)
            if plan is not None:
                o, lse = plan.run(c)
                if key is not None:
                    _FAST.put(key, plan)
                return (o, lse) if c.return_lse else o
            seqlens = _clamped_seqlens(xp.asnumpy(c.seqlens), c)     # one device sync
            return _generic(c, seqlens, out_shape)
    return _generic(c, c.seqlens.astype(numpy.int64), out_shape)


def _clamped_seqlens(s, c) -> numpy.ndarray:
    """The device's clamp of cache_seqlens, applied on the host for the generic path."""
    return numpy.clip(s.astype(numpy.int64), 0, c.capacity - c.Lnew)


def _page_rows(c, b: int, n: int):
    """Page indices (clamped like the device) and offsets of keys 0..n-1 of batch row b."""
    xp = c.xp
    pos = numpy.arange(n)
    slots = pos // c.page_size
    table = c.block_table[b]
    pages = xp.clip(table[xp.asarray(slots)] if n else table[:0], 0, c.num_blocks - 1)
    return pages, xp.asarray(pos % c.page_size)


def _cache_rows(c, cache, b: int, n: int):
    """Keys 0..n-1 of batch row b: (cache head dims..., n, d); a view for a dense cache."""
    if not c.paged:
        return cache[b, ..., :n, :]
    pages, offs = _page_rows(c, b, n)
    rows = c.xp.moveaxis(cache, -2, 1)[pages, offs]          # (n, heads..., d)
    return c.xp.moveaxis(rows, 0, -2)


def _append(c, seqlens) -> None:
    """Write k_new / v_new at positions seqlens[b] .. seqlens[b] + Lnew - 1 (host seqlens)."""
    xp = c.xp
    for b in range(c.B):
        s = int(seqlens[b])
        for cache, new in ((c.k_cache, c.k_new), (c.v_cache, c.v_new)):
            if not c.paged:
                cache[b, ..., s:s + c.Lnew, :] = new[b]
                continue
            pos = numpy.arange(s, s + c.Lnew)
            table = c.block_table[b]
            pages = xp.clip(table[xp.asarray(pos // c.page_size)], 0, c.num_blocks - 1)
            xp.moveaxis(cache, -2, 1)[pages, xp.asarray(pos % c.page_size)] = \
                xp.moveaxis(new[b], -2, 0)


def _generic(c, seqlens, out_shape):
    """Append, then one :func:`cuflash.attention` per batch row (CPU path, and the device
    path for what the decode family does not cover)."""
    from ._api import attention
    xp = c.xp
    if c.k_new is not None and c.Lnew:
        _append(c, seqlens)
    o = xp.empty(out_shape, c.dtype)
    lse = xp.empty(out_shape[:-1], c.lse_dtype)
    for b in range(c.B):
        n = int(seqlens[b]) + c.Lnew
        kb, vb = _cache_rows(c, c.k_cache, b, n), _cache_rows(c, c.v_cache, b, n)
        ob, lb = attention(c.q[b], kb, vb, scale=c.scale,
                           causal="bottom_right" if c.causal else False, return_lse=True)
        o[b], lse[b] = ob, lb
    return (o, lse) if c.return_lse else o


def explain_kvcache(q, k_cache, v_cache, **kw) -> str:
    """Which path ``attention_with_kvcache`` takes for these arguments on the device, and why
    (the decode family's choice, its split count and tiles, or the reason it does not apply)."""
    kw = dict(kw)
    c = check_kvcache(q, k_cache, v_cache, kw.pop("cache_seqlens"), kw.pop("block_table", None),
                      kw.pop("k_new", None), kw.pop("v_new", None), kw.pop("num_splits", None),
                      kw.pop("scale", None), kw.pop("causal", False), kw.pop("return_lse", False))
    if kw:
        raise TypeError(f"unexpected keywords {sorted(kw)}")
    if c.xp is numpy:
        return "NumPy arrays: the CPU path (per batch row, cuflash.attention on the cache rows)"
    from . import _inference_gpu
    return _inference_gpu.explain(c)


__all__ = ["merge_states", "attention_with_kvcache", "explain_kvcache"]
