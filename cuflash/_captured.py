"""``cuflash.captured(array)``: an array that a ``score_mod`` or ``mask_mod`` reads.

A user function sees the array only through this wrapper, indexed with one integer per
dimension (``doc[b, q_idx]``):

- on NumPy (the CPU path, the reference) the indices are integer arrays; an index outside
  ``[0, n)`` along some axis raises ``IndexError`` (negative indices do not wrap, because the GPU
  cannot know what a negative index meant);
- while a function is traced for the GPU the indices are symbolic; the trace records a load
  from the array, which the kernel performs through a pointer with every index clamped into
  ``[0, n - 1]`` (never out of bounds). The pointer, shape and strides travel with the launch,
  so new contents (or a new array of the same dtype and number of dimensions) need no new
  compilation.

Gradients with respect to captured arrays are not computed; a learnable bias goes through
``bias=``.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy

#: Largest number of dimensions of a captured array (the kernels' CapturedArray holds 4)
MAX_NDIM = 4


class Captured:
    """An array read by a user function; make it with :func:`captured`."""

    __slots__ = ("array",)

    def __init__(self, array: Any):
        cupy = sys.modules.get("cupy")
        if not (isinstance(array, numpy.ndarray)
                or (cupy is not None and isinstance(array, cupy.ndarray))):
            raise TypeError(f"captured() takes a numpy.ndarray or cupy.ndarray, got "
                            f"{type(array).__module__}.{type(array).__qualname__}")
        if not 1 <= array.ndim <= MAX_NDIM:
            raise ValueError(f"a captured array needs 1 to {MAX_NDIM} dimensions, got "
                             f"{array.shape=}")
        if array.dtype.kind not in "biuf":
            raise TypeError(f"a captured array holds bools, integers or floats, got "
                            f"{array.dtype=}")
        if array.size == 0:
            raise ValueError(f"a captured array must not be empty, got {array.shape=} (there "
                             f"is no element an index could be clamped to)")
        object.__setattr__(self, "array", array)

    def __setattr__(self, name, value):
        raise AttributeError("Captured is read-only")

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.array.shape)

    @property
    def dtype(self) -> numpy.dtype:
        return self.array.dtype

    @property
    def ndim(self) -> int:
        return self.array.ndim

    def __repr__(self) -> str:
        return f"captured({type(self.array).__module__}.ndarray, shape={self.shape}, " \
               f"dtype={self.dtype})"

    def __getitem__(self, index: Any) -> Any:
        index = index if isinstance(index, tuple) else (index,)
        if len(index) != self.ndim:
            raise TypeError(f"{self!r} is indexed with one integer per dimension "
                            f"({self.ndim}), got {len(index)} indices")
        from cuflash import _trace
        if any(isinstance(i, _trace.Sym) for i in index):
            return _trace.load(self, index)
        arrays = []
        for axis, i in enumerate(index):
            if isinstance(i, (slice, type(Ellipsis))) or i is None:
                raise TypeError(f"{self!r} is indexed with integers only, got {i!r} along "
                                f"axis {axis}")
            a = numpy.asarray(i) if not hasattr(i, "dtype") else i
            if a.dtype.kind not in "iu" or isinstance(i, (bool, numpy.bool_)):
                raise TypeError(f"{self!r} is indexed with integers, got dtype {a.dtype} "
                                f"along axis {axis}")
            n = self.shape[axis]
            bad = (a < 0) | (a >= n)
            if bad.any():
                value = int(a[bad].flat[0]) if a.ndim else int(a)
                raise IndexError(f"index {value} is out of range for axis {axis} of {self!r} "
                                 f"(the GPU clamps it into [0, {n - 1}]; the CPU path raises)")
            arrays.append(a)
        arr = self.array
        if not isinstance(arr, numpy.ndarray):   # a CuPy array read on the host (the reference)
            arr = arr.get()
        return arr[tuple(arrays)]


def captured(array: Any) -> Captured:
    """Wrap ``array`` so that a ``score_mod`` / ``mask_mod`` may read it (see the module doc).

    ``array`` is a NumPy or CuPy array (of the inputs' array type) of bools, integers or
    floats with 1 to 4 dimensions; it is not copied. Index it with one integer per
    dimension. Out-of-range indices raise ``IndexError`` on the CPU and are clamped on the
    GPU. Float values are read as float32 by the kernels; integers keep their width.
    Gradients with respect to it are not computed (use ``bias=`` for a learnable bias).
    """
    return Captured(array)
