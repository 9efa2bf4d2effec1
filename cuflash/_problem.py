"""Validation and broadcasting: turn ``attention(q, k, v, ...)`` arguments into one problem.

Every backend (the CPU path in ``_numpy``, the GPU launcher in ``_launch``, the float64
``reference``) starts from the :class:`AttentionProblem` built here, so every entry point
accepts and rejects exactly the same inputs, with the same messages, before any work is done.

Errors follow one rule: ``TypeError`` for array types and dtypes (and arguments of the wrong
Python type), ``ValueError`` for shapes and values. Messages show the offending values.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import numbers
import sys
import types
from typing import Any

import ml_dtypes
import numpy

from cuflash._interop import Call, as_array  # noqa: F401 (Call: the entry points' first step)

#: Largest head dimension (``d`` of q and k, ``dv`` of v) any backend accepts.
MAX_HEAD_DIM = 256

#: The dtypes q, k and v may have (all three the same).
SUPPORTED_DTYPES = tuple(
    numpy.dtype(t) for t in (numpy.float16, ml_dtypes.bfloat16, numpy.float32, numpy.float64)
)

_CAUSAL_ALIGNMENTS = ("bottom_right", "top_left")


@dataclasses.dataclass(frozen=True, eq=False)
class AttentionProblem:
    """One validated forward attention problem, ready for a backend.

    A backend ``forward(prob, o, lse)`` computes, for every batch index ``b`` (C order over
    ``batch_shape``) and query row ``i``::

        s[j]   = scale * dot(q[b, i, :], k[b, j, :])      for the keys j visible to row i
        lse[b, i] = log(sum_j exp(s[j]))                  (-inf when no key is visible)
        o[b, i, :] = sum_j exp(s[j] - lse[b, i]) * v[b, j, :]   (0 when no key is visible)

    writing ``o`` (shape ``batch_shape + (Lq, dv)``, dtype ``dtype``, any strides) and ``lse``
    (C-contiguous, shape ``batch_shape + (Lq,)``, dtype ``lse_dtype``).

    Attributes
    ----------
    xp : module
        ``numpy`` or ``cupy``: the array module of q, k and v.
    dtype : numpy.dtype
        The common dtype of q, k and v, and the dtype of the output.
    batch_shape : tuple of int
        The leading dimensions of q, k and v broadcast together by NumPy rules.
    Lq, Lk, d, dv : int
        Query length, key length, head dimension of q and k, head dimension of v.
    scale : float
        Softmax scale applied to ``q @ k.T``.
    causal : bool
        Whether the causal mask is applied.
    causal_offset : int
        Under ``causal``, key ``j`` is visible to query ``i`` iff ``j <= i + causal_offset``:
        ``Lk - Lq`` for the bottom-right alignment, ``0`` for top-left (and ``0`` when not
        causal, where it is unused).
    q, k, v : array
        The inputs broadcast to ``batch_shape + (L, d)`` with ``xp.broadcast_to``: views (stride
        0 along broadcast dimensions), never copies.
    lse_dtype : numpy.dtype
        float32, or float64 for float64 inputs.
    device_id : int or None
        The CUDA device holding q, k and v (CuPy), or None (NumPy).
    """

    xp: types.ModuleType
    dtype: numpy.dtype
    batch_shape: tuple[int, ...]
    Lq: int
    Lk: int
    d: int
    dv: int
    scale: float
    causal: bool
    causal_offset: int
    q: Any = dataclasses.field(repr=False)
    k: Any = dataclasses.field(repr=False)
    v: Any = dataclasses.field(repr=False)
    lse_dtype: numpy.dtype
    device_id: int | None


def _array_module(x: Any, name: str) -> types.ModuleType:
    """Return ``numpy`` or ``cupy`` for an ndarray of either, else raise TypeError.

    CuPy is never imported here: a CuPy array can only exist if CuPy is already loaded.
    """
    if isinstance(x, numpy.ndarray):
        return numpy
    cupy = sys.modules.get("cupy")
    if cupy is not None and isinstance(x, cupy.ndarray):
        return cupy
    as_array(x, name)  # raises the TypeError that names what is accepted
    raise TypeError(f"{name} must be a numpy.ndarray or cupy.ndarray here, got "
                    f"{type(x).__module__}.{type(x).__qualname__}; pass it through "
                    f"cuflash._interop.as_array first")


def accumulation_dtype(dtype: numpy.dtype) -> numpy.dtype:
    """float64 for float64 inputs, else float32: the dtype scores and sums are computed in."""
    return numpy.dtype(numpy.float64 if dtype == numpy.float64 else numpy.float32)


def positive_real(x: Any, name: str, positive: str = "positive") -> float:
    """``float(x)`` for a finite real number > 0 (bool is not a number here), else TypeError
    (not a real number) or ValueError (not finite, or not > 0), naming ``name`` and the value.
    The rule of ``scale`` and of ``softcap``."""
    if isinstance(x, (bool, numpy.bool_)) or not isinstance(x, numbers.Real):
        raise TypeError(f"{name} must be a real number{' > 0' if positive != 'positive' else ''}"
                        f" or None, got {x!r} of type {type(x).__qualname__}")
    value = float(x)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be finite and {positive}, got {name}={x!r}")
    return value


def _check_scale(scale: Any, d: int, dtype: numpy.dtype) -> float:
    """The softmax scale as a float: finite, positive, and a normal number of the accumulation
    dtype (float32 for float16, bfloat16 and float32 inputs; float64 for float64), since every
    backend multiplies by it in that dtype. A scale that overflows it (float32 with
    ``scale=1e39``) would make every score inf and every output NaN; one that underflows to a
    subnormal or 0 would flatten the softmax. Both are refused rather than computed wrongly.
    """
    if scale is None:
        return 1.0 / math.sqrt(d)
    value = positive_real(scale, "scale")
    acc = accumulation_dtype(dtype)
    info = numpy.finfo(acc)
    if not float(info.tiny) <= value <= float(info.max):
        raise ValueError(f"{scale=} is not a normal {acc} number, the dtype {dtype} inputs are "
                         f"computed in: it must lie in [{float(info.tiny):.6g}, "
                         f"{float(info.max):.6g}]")
    return value


def _check_dtype(x: Any, name: str) -> None:
    if x.dtype in SUPPORTED_DTYPES:
        return
    native = x.dtype.newbyteorder("=")
    if x.dtype.byteorder not in ("=", "|") and native in SUPPORTED_DTYPES:
        order = "big" if x.dtype.byteorder == ">" else "little"
        raise TypeError(f"{name}.dtype={x.dtype.str} is {order}-endian; cuflash needs the "
                        f"machine's byte order ({sys.byteorder}-endian): pass "
                        f"{name}.astype({name}.dtype.newbyteorder('=')) (a copy)")
    raise TypeError(f"{name}.dtype={x.dtype} is not supported; use one of "
                    f"{', '.join(str(t) for t in SUPPORTED_DTYPES)}")


def _check_causal(causal: Any, Lq: int, Lk: int) -> tuple[bool, int]:
    """Return ``(causal, causal_offset)`` for a ``causal=`` argument."""
    if isinstance(causal, (bool, numpy.bool_)):
        alignment = "bottom_right" if causal else None
    elif isinstance(causal, str):
        if causal not in _CAUSAL_ALIGNMENTS:
            raise ValueError(f"causal must be a bool, 'bottom_right' or 'top_left', got {causal=}")
        alignment = causal
    else:
        raise TypeError(f"causal must be a bool, 'bottom_right' or 'top_left', got {causal!r} "
                        f"of type {type(causal).__qualname__}")
    if alignment is None:
        return False, 0
    return True, (Lk - Lq if alignment == "bottom_right" else 0)


def make_problem(q: Any, k: Any, v: Any, *, scale: Any, causal: Any) -> AttentionProblem:
    """Validate the arguments of an attention call and broadcast the inputs.

    Parameters
    ----------
    q, k, v : numpy.ndarray or cupy.ndarray
        ``q (..., Lq, d)``, ``k (..., Lk, d)``, ``v (..., Lk, dv)``, all of one array type and
        one dtype from :data:`SUPPORTED_DTYPES`, with ``1 <= d, dv <= MAX_HEAD_DIM`` and leading
        dimensions that broadcast together; CuPy inputs on one device.
    scale : real number or None
        Finite and positive; None means ``1 / sqrt(d)``. bool is not a scale.
    causal : bool or {'bottom_right', 'top_left'}
        True means 'bottom_right': query i sees key j iff ``j <= i + Lk - Lq`` (FlashAttention's
        alignment); 'top_left': iff ``j <= i`` (PyTorch's ``is_causal``).

    Returns
    -------
    AttentionProblem
        With q, k, v broadcast as views; no input is copied.

    Raises
    ------
    TypeError
        An input that is not a NumPy or CuPy array, NumPy mixed with CuPy, an unsupported
        dtype, dtypes that differ, a scale or causal of the wrong type.
    ValueError
        Fewer than two dimensions, mismatched head dimensions or key lengths, a head dimension
        of 0 or above ``MAX_HEAD_DIM``, batch dimensions that do not broadcast, inputs on
        different devices, a non-finite or non-positive scale, an unknown causal alignment.
    """
    q, k, v = as_array(q, "q"), as_array(k, "k"), as_array(v, "v")  # no-ops for NumPy/CuPy
    xps = {name: _array_module(x, name) for name, x in (("q", q), ("k", k), ("v", v))}
    if len(set(xps.values())) > 1:
        raise TypeError(
            "q, k and v must all be NumPy arrays or all be CuPy arrays, got "
            + ", ".join(f"{name}: {xp.__name__}.ndarray" for name, xp in xps.items())
        )
    xp = xps["q"]

    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_dtype(x, name)
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k and v must have one dtype, got q.dtype={q.dtype}, "
                        f"k.dtype={k.dtype}, v.dtype={v.dtype}")

    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim < 2:
            raise ValueError(f"{name} needs at least 2 dimensions (..., length, head_dim), "
                             f"got {name}.shape={x.shape}")
    Lq, d = q.shape[-2:]
    Lk, dv = v.shape[-2:]
    if k.shape[-1] != d:
        raise ValueError(f"head dims of q and k differ: {q.shape=} and {k.shape=}")
    if k.shape[-2] != Lk:
        raise ValueError(f"k and v must have the same length: {k.shape=} and {v.shape=}")
    for name, size in (("d (q.shape[-1])", d), ("dv (v.shape[-1])", dv)):
        if not 1 <= size <= MAX_HEAD_DIM:
            raise ValueError(f"head dim {name}={size} is not supported: it must be at least 1 "
                             f"and at most MAX_HEAD_DIM={MAX_HEAD_DIM}")
    try:
        batch_shape = numpy.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    except ValueError:
        raise ValueError(f"batch dims of {q.shape=}, {k.shape=} and {v.shape=} do not "
                         f"broadcast{_gqa_hint(q.shape, k.shape, v.shape)}") from None

    device_id = None
    if xp is not numpy:
        device_ids = {name: x.device.id for name, x in (("q", q), ("k", k), ("v", v))}
        if len(set(device_ids.values())) > 1:
            raise ValueError(f"q, k and v must be on one device, got devices {device_ids}")
        device_id = device_ids["q"]

    is_causal, causal_offset = _check_causal(causal, Lq, Lk)
    return AttentionProblem(
        xp=xp,
        dtype=q.dtype,
        batch_shape=tuple(batch_shape),
        Lq=Lq,
        Lk=Lk,
        d=d,
        dv=dv,
        scale=_check_scale(scale, d, q.dtype),
        causal=is_causal,
        causal_offset=causal_offset,
        q=xp.broadcast_to(q, batch_shape + (Lq, d)),
        k=xp.broadcast_to(k, batch_shape + (Lk, d)),
        v=xp.broadcast_to(v, batch_shape + (Lk, dv)),
        lse_dtype=accumulation_dtype(q.dtype),
        device_id=device_id,
    )


def check_out(prob: AttentionProblem, out: Any) -> None:
    """Validate an ``out=`` array for ``prob``.

    ``out`` must be an array of the inputs' array type (and device), of exactly ``prob.dtype``
    and shape ``prob.batch_shape + (Lq, dv)``, writeable, without two elements at one address
    (no stride 0 along a dimension longer than 1, unless it is empty), and sharing no memory
    with q, k or v. Any other strides are allowed.

    Raises
    ------
    TypeError
        ``out`` is not an array of the inputs' array type, or its dtype differs.
    ValueError
        Wrong shape, another device, read-only, self-overlapping, or overlapping an input.
    """
    xp = _array_module(out, "out")
    if xp is not prob.xp:
        raise TypeError(f"out must be a {prob.xp.__name__}.ndarray like q, k and v, got a "
                        f"{xp.__name__}.ndarray")
    if out.dtype != prob.dtype:
        raise TypeError(f"out.dtype={out.dtype} must equal the inputs' dtype {prob.dtype}")
    expected = prob.batch_shape + (prob.Lq, prob.dv)
    if out.shape != expected:
        raise ValueError(f"{out.shape=} must be batch_shape + (Lq, dv) = {expected}")
    if prob.device_id is not None and out.device.id != prob.device_id:
        raise ValueError(f"out is on device {out.device.id} but the inputs are on device "
                         f"{prob.device_id}")
    if xp is numpy and not out.flags.writeable:
        raise ValueError("out is read-only")
    if out.size > 1 and any(stride == 0 and size > 1
                            for size, stride in zip(out.shape, out.strides)):
        raise ValueError(f"out has stride 0 along a dimension longer than 1, so several "
                         f"elements share one address: {out.shape=}, {out.strides=}")
    for name, x in (("q", prob.q), ("k", prob.k), ("v", prob.v)):
        if shares_elements(out, x):
            raise ValueError(f"out overlaps {name} in memory; pass a separate array")


#: Bound on the work of the exact overlap test (NumPy's ``max_work``: candidate solutions of
#: the bounded Diophantine problem it solves). Past it, overlap is assumed.
OVERLAP_MAX_WORK = 1 << 16


def _host_view(x: Any) -> numpy.ndarray:
    """A NumPy array with ``x``'s address, shape, strides and itemsize; never dereferenced.

    Lets NumPy's exact overlap solver reason about CuPy arrays' device addresses.
    """
    if isinstance(x, numpy.ndarray):
        return x

    class Interface:
        __array_interface__ = {"data": (x.data.ptr, False), "shape": x.shape,
                               "strides": x.strides, "typestr": f"|V{x.dtype.itemsize}",
                               "version": 3}
    return numpy.asarray(Interface())


def shares_elements(a: Any, b: Any) -> bool:
    """Whether arrays ``a`` and ``b`` (both NumPy or both CuPy) have an element in common.

    Exact, not a comparison of address ranges: an ``out`` interleaved with an input (every
    other column each) shares no element and is accepted. Disjoint address ranges answer at
    once; otherwise NumPy's exact solver (``numpy.shares_memory``) decides, bounded by
    :data:`OVERLAP_MAX_WORK`; should that bound be reached, the arrays count as overlapping
    (a refusal, never a wrong result).
    """
    if a.size == 0 or b.size == 0:
        return False
    ha, hb = _host_view(a), _host_view(b)
    if not numpy.may_share_memory(ha, hb):  # address ranges disjoint: the common case
        return False
    try:
        return bool(numpy.shares_memory(ha, hb, max_work=OVERLAP_MAX_WORK))
    except numpy.exceptions.TooHardError:
        return True


def check_return_lse(return_lse: Any) -> None:
    """``return_lse`` must be a bool (Python or NumPy); anything else is a TypeError."""
    if not isinstance(return_lse, (bool, numpy.bool_)):
        raise TypeError(f"return_lse must be a bool, got {return_lse!r}")


def device_scope(prob: AttentionProblem) -> contextlib.AbstractContextManager:
    """The context in which to allocate and launch for ``prob``: its CUDA device, if any."""
    if prob.device_id is None:
        return contextlib.nullcontext()
    return prob.xp.cuda.Device(prob.device_id)


# ---------------------------------------------------------------------------------------------
# The backward pass: the extra arguments of attention_backward, and gradients of broadcast
# inputs (summed over the broadcast dimensions)
# ---------------------------------------------------------------------------------------------

_ABSENT = object()


def check_backward_inputs(prob: AttentionProblem, do: Any, o: Any = _ABSENT,
                          lse: Any = _ABSENT) -> None:
    """Validate the arguments ``do`` (and ``o``, ``lse`` unless left out) of a backward call.

    ``do`` and ``o`` must be arrays of the inputs' array type (and device), of exactly
    ``prob.dtype`` and shape ``prob.batch_shape + (Lq, dv)``; any strides, stride 0 included
    (a broadcast ``do`` is fine: it is only read). ``lse`` must be an array of the same type and
    device, of dtype ``prob.lse_dtype`` and shape ``prob.batch_shape + (Lq,)``.

    Raises
    ------
    TypeError
        An argument that is not an array of the inputs' array type, or of the wrong dtype.
    ValueError
        Wrong shape, or another device.
    """
    expected = {"do": prob.batch_shape + (prob.Lq, prob.dv), "o": prob.batch_shape + (prob.Lq, prob.dv),
                "lse": prob.batch_shape + (prob.Lq,)}
    dtypes = {"do": prob.dtype, "o": prob.dtype, "lse": prob.lse_dtype}
    rule = {"do": "batch_shape + (Lq, dv)", "o": "batch_shape + (Lq, dv)",
            "lse": "batch_shape + (Lq,)"}
    for name, x in (("do", do), ("o", o), ("lse", lse)):
        if x is _ABSENT:
            continue
        xp = _array_module(x, name)
        if xp is not prob.xp:
            raise TypeError(f"{name} must be a {prob.xp.__name__}.ndarray like q, k and v, got a "
                            f"{xp.__name__}.ndarray")
        if x.dtype != dtypes[name]:
            what = "the inputs' dtype" if name != "lse" else "the lse dtype of the inputs"
            raise TypeError(f"{name}.dtype={x.dtype} must equal {what} {dtypes[name]}")
        if x.shape != expected[name]:
            raise ValueError(f"{name}.shape={x.shape} must be {rule[name]} = {expected[name]}")
        if prob.device_id is not None and x.device.id != prob.device_id:
            raise ValueError(f"{name} is on device {x.device.id} but the inputs are on device "
                             f"{prob.device_id}")


def check_deterministic(deterministic: Any) -> None:
    """``deterministic`` must be a bool (Python or NumPy); anything else is a TypeError."""
    if not isinstance(deterministic, (bool, numpy.bool_)):
        raise TypeError(f"deterministic must be a bool, got {deterministic!r}")


def broadcast_axes(shape: tuple[int, ...], full_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The axes of ``full_shape`` that broadcasting added to ``shape``.

    ``shape`` broadcasts to ``full_shape`` (NumPy rules). The result holds the leading axes that
    ``shape`` lacks and the axes where ``shape`` has extent 1 and ``full_shape`` does not:
    summing an array of ``full_shape`` over them (keeping dims) gives the gradient for an input
    of ``shape``.
    """
    lead = len(full_shape) - len(shape)
    return tuple(range(lead)) + tuple(lead + i for i, n in enumerate(shape)
                                      if n == 1 and full_shape[lead + i] != 1)


def sum_to_shape(x: Any, shape: tuple[int, ...], dtype: Any) -> Any:
    """``x`` summed over the dimensions broadcasting added to ``shape``, then cast to ``dtype``.

    The gradient of a broadcast input (NumPy/JAX semantics). The sum runs in ``x``'s dtype (the
    accumulation dtype of the caller) and the result is rounded once, to ``dtype``. Works for
    NumPy and CuPy arrays alike; the result is a new C-contiguous array of ``shape``.
    """
    axes = broadcast_axes(tuple(shape), tuple(x.shape))
    if axes:
        x = x.sum(axis=axes, keepdims=True)
    return x.reshape(shape).astype(dtype, copy=True, order="C")


# ---------------------------------------------------------------------------------------------
# The 4-D grouped-query layout (the views themselves: cuflash._interop.Call)
# ---------------------------------------------------------------------------------------------

def _gqa_hint(q_shape: tuple, k_shape: tuple, v_shape: tuple) -> str:
    """The hint for a broadcast failure that looks like the 4-D grouped-query layout."""
    if min(len(q_shape), len(k_shape), len(v_shape)) < 3:
        return ""
    hq, hkv = q_shape[-3], k_shape[-3]
    if v_shape[-3] != hkv or hkv in (0, 1) or hq % hkv:
        return ""
    g = hq // hkv
    return (f"; for grouped-query attention (q with {hq} heads, k and v with {hkv}) pass "
            f"enable_gqa=True, or reshape q to (..., {hkv}, {g}, Lq, d) and k, v to "
            f"(..., {hkv}, 1, Lk, d), which broadcast")

