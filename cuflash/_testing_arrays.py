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
    view[...] = cupy.asarray(numpy.ascontiguousarray(x))
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
