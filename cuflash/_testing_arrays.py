"""How cuflash.testing lays out and ships the arrays of a case (private)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy

#: Memory layouts of an operand: C order; Fortran order; stored as (..., d, L) and swapped;
#: every other row and column of a NaN-filled buffer; rows in reverse order (negative stride).
#: Gaps are NaN, so a kernel that reads outside the view gets NaN in its result.
LAYOUTS = ("c", "f", "transposed", "strided", "reversed")


def lay_out(values: numpy.ndarray, layout: str) -> numpy.ndarray:
    if layout in ("c", "asis"):   # asis: an array handed to AttentionCase.from_arrays
        return values
    if layout == "f":
        return numpy.asfortranarray(values)
    if layout == "transposed":
        return values.swapaxes(-1, -2).copy().swapaxes(-1, -2)
    if layout == "strided":
        base = numpy.full(values.shape[:-2] + (2 * values.shape[-2], 2 * values.shape[-1]),
                          numpy.nan, values.dtype)
        base[..., ::2, ::2] = values
        return base[..., ::2, ::2]
    if layout == "reversed":
        return values[..., ::-1, :].copy()[..., ::-1, :]
    raise ValueError(f"unknown layout {layout!r}; known: {LAYOUTS}")


def to_device(x: numpy.ndarray, cupy: Any) -> Any:
    """A CuPy array with the values, shape *and strides* of ``x``; bytes of the span that ``x``
    does not cover are NaN (so a kernel that reads outside the view gets NaN)."""
    if x.size == 0 or 0 in x.strides:
        return cupy.asarray(x)
    lo = sum(min(0, s * (n - 1)) for n, s in zip(x.shape, x.strides))
    hi = sum(max(0, s * (n - 1)) for n, s in zip(x.shape, x.strides)) + x.itemsize
    buf = cupy.full((hi - lo) // x.itemsize, numpy.nan, dtype=x.dtype)
    view = cupy.ndarray(x.shape, x.dtype, memptr=buf.data + (-lo), strides=x.strides)
    view[...] = cupy.asarray(numpy.ascontiguousarray(x).reshape(x.shape))   # 0-d stays 0-d
    return view


@dataclass
class _Operand:
    values: numpy.ndarray      # C-contiguous, extent 1 on the expanded dims
    layout: str
    shape: tuple               # the operand's shape (expanded dims at full extent)
    device: Any = None         # the CuPy array itself, for AttentionCase.from_arrays

    def build(self, xp: Any) -> Any:
        if self.device is not None and xp is not numpy:
            return self.device
        x = lay_out(self.values, self.layout)
        if xp is not numpy:
            x = to_device(x, xp)
        return x if x.shape == self.shape else xp.broadcast_to(x, self.shape)


# -- shapes of gradients (the rule sums and checks them as the gradients are summed) ---------

def to_host64(x: Any) -> numpy.ndarray:
    """A float64 NumPy copy of a NumPy or CuPy array (or of anything ``numpy.asarray`` takes:
    a JAX array, a PyTorch CPU tensor)."""
    if not isinstance(x, numpy.ndarray):
        x = x.get() if hasattr(x, "get") and hasattr(x, "device") else numpy.asarray(x)
    return x.astype(numpy.float64)


def broadcast_axes(shape: tuple[int, ...], full: tuple[int, ...]) -> tuple[int, ...]:
    """The axes of ``full`` that broadcasting added to ``shape`` (leading ones and 1 -> n)."""
    lead = len(full) - len(shape)
    return tuple(range(lead)) + tuple(lead + i for i, n in enumerate(shape)
                                      if n == 1 and full[lead + i] != 1)


def all_to_shape(x: numpy.ndarray, shape: tuple[int, ...]) -> numpy.ndarray:
    """``x`` (bool) reduced with ``all`` over the axes broadcasting added to ``shape``: true
    where every batch item an element of the un-broadcast shape stands for is true."""
    axes = broadcast_axes(tuple(shape), tuple(x.shape))
    if axes:
        x = x.all(axis=axes, keepdims=True)
    return x.reshape(shape)


def sum_to_shape(x: Any, shape: tuple[int, ...], dtype: Any) -> Any:
    """``x`` summed (in its own dtype) over the axes broadcasting added to ``shape``, as
    ``dtype``: the gradient of a broadcast input."""
    axes = broadcast_axes(tuple(shape), tuple(x.shape))
    if axes:
        x = x.sum(axis=axes, keepdims=True)
    return x.reshape(shape).astype(dtype)
