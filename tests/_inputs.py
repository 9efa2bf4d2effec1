"""Hypothesis strategies and array builders shared by the CPU tests (and the GPU tests).

Inputs are fresh random normal values for every example (a Hypothesis-drawn seed feeds a
NumPy Generator), never zeros, in one of several memory layouts. Gaps in strided layouts are
filled with NaN, so an implementation that reads outside the view gets NaN in its result.
"""

from __future__ import annotations

import math
from typing import Any

import ml_dtypes
import numpy
from hypothesis import strategies as st

DTYPES = tuple(numpy.dtype(t) for t in (numpy.float16, ml_dtypes.bfloat16, numpy.float32,
                                        numpy.float64))
CAUSAL = (False, True, "bottom_right", "top_left")
#: C order; Fortran order; stored as (..., d, L) and swapped; every other row and column of a
#: NaN-filled buffer; rows in reverse order (negative stride).
LAYOUTS = ("c", "f", "transposed", "strided", "reversed")


def make_array(rng: numpy.random.Generator, shape: tuple[int, ...], dtype: Any,
               layout: str = "c", std: float = 1.0) -> numpy.ndarray:
    """Normal(0, std) values rounded to ``dtype``, in the memory ``layout`` (see LAYOUTS)."""
    values = (rng.standard_normal(shape) * std).astype(dtype)
    if layout == "c":
        return values
    if layout == "f":
        return numpy.asfortranarray(values)
    if layout == "transposed":
        return values.swapaxes(-1, -2).copy().swapaxes(-1, -2)
    if layout == "strided":
        base = numpy.full(shape[:-2] + (2 * shape[-2], 2 * shape[-1]), numpy.nan, dtype)
        base[..., ::2, ::2] = values
        return base[..., ::2, ::2]
    if layout == "reversed":
        return values[..., ::-1, :].copy()[..., ::-1, :]
    raise ValueError(f"unknown {layout=}")


def poisoned_out(shape: tuple[int, ...], dtype: Any, layout: str) -> numpy.ndarray:
    """An output buffer full of NaN, so every element left unwritten shows up."""
    rng = numpy.random.default_rng(0)
    out = make_array(rng, shape, dtype, layout)
    out[...] = numpy.nan
    return out


@st.composite
def attention_inputs(draw, dtypes=st.sampled_from(DTYPES), max_batch_dim: int = 3,
                     min_batch_dim: int = 1) -> dict:
    """Draw an attention call: arrays q, k, v and keywords scale and causal.

    Batch dimensions broadcast (inputs drop leading dims or have 1 where the batch has more,
    the grouped-query pattern among them); lengths from 0 to 300 and head dims from 1 to 256
    (large ones with shorter sequences, to stay fast); q, k, v each in a drawn layout. Also
    drawn: tile sizes ``block_m``, ``block_n`` for the CPU path (at most 16 x 16 tiles) and an
    ``out_layout``.
    """
    dtype = draw(dtypes)
    d = draw(st.integers(1, 16) | st.sampled_from([31, 64, 128, 255, 256]))
    dv = draw(st.integers(1, 16) | st.sampled_from([31, 64, 128, 255, 256]))
    max_len = 64 if max(d, dv) > 16 else 300
    lengths = st.integers(0, 24) | st.integers(25, max_len)
    Lq, Lk = draw(lengths), draw(lengths)
    batch = draw(st.lists(st.integers(min_batch_dim, max_batch_dim), max_size=3))

    def own_batch():  # a batch shape that broadcasts to `batch`
        dims = batch[draw(st.integers(0, len(batch))):]
        return tuple(1 if draw(st.booleans()) else n for n in dims)

    rng = numpy.random.default_rng(draw(st.integers(0, 2**32 - 1), label="seed"))
    q = make_array(rng, own_batch() + (Lq, d), dtype, draw(st.sampled_from(LAYOUTS)))
    k = make_array(rng, own_batch() + (Lk, d), dtype, draw(st.sampled_from(LAYOUTS)))
    v = make_array(rng, own_batch() + (Lk, dv), dtype, draw(st.sampled_from(LAYOUTS)))
    return dict(
        q=q, k=k, v=v,
        scale=draw(st.none() | st.floats(0.05, 4.0)),
        causal=draw(st.sampled_from(CAUSAL)),
        # from one row per block to one block for all; at most 16 blocks, to stay fast
        block_m=max(draw(st.integers(1, Lq + 1)), math.ceil(Lq / 16)),
        block_n=max(draw(st.integers(1, Lk + 1)), math.ceil(Lk / 16)),
        out_layout=draw(st.sampled_from((None,) + LAYOUTS)),
    )
