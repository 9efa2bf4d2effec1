"""Array builders for the example-based tests. Property tests draw their cases from
``cuflash.testing.attention_cases``; the layouts here are the same ones (``cuflash.testing``'s
LAYOUTS: gaps in strided layouts are NaN, so an implementation that reads outside the view gets
NaN in its result)."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy

from cuflash._testing_arrays import LAYOUTS, lay_out as _lay_out  # noqa: F401
from cuflash.testing import CAUSAL_VALUES as CAUSAL  # noqa: F401

DTYPES = tuple(numpy.dtype(t) for t in (numpy.float16, ml_dtypes.bfloat16, numpy.float32,
                                        numpy.float64))


def make_array(rng: numpy.random.Generator, shape: tuple[int, ...], dtype: Any,
               layout: str = "c", std: float = 1.0) -> numpy.ndarray:
    """Normal(0, std) values rounded to ``dtype``, in the memory ``layout`` (see LAYOUTS)."""
    return _lay_out((rng.standard_normal(shape) * std).astype(dtype), layout)


def poisoned_out(shape: tuple[int, ...], dtype: Any, layout: str) -> numpy.ndarray:
    """An output buffer full of NaN, so every element left unwritten shows up."""
    out = make_array(numpy.random.default_rng(0), shape, dtype, layout)
    out[...] = numpy.nan
    return out
