"""The score pipeline of DESIGN.md "Modifiers" on NumPy blocks of scores.

One :class:`ScorePipeline` per problem. Its methods take a block of scores ``s`` of shape
``batch_shape + (i1 - i0, j1 - j0)`` (query rows ``i0 <= i < i1``, keys ``j0 <= j < j1``, absolute
indices) and apply the steps in DESIGN.md's order:

1. ``s = scale * q @ k.T``                      (the caller: it folds the scale into q)
2. softcap ``c``: ``s = c * tanh(s / c)``
3. ALiBi: ``s -= slope * |i + Lk - Lq - j|``
4. bias: ``s += bias[..., i, j]``
5. ``s = score_mod(s, b, h, i, j)``
6. masking: ``s = -inf`` where causal, window, mask or mask_mod hide the pair
7. sink: ``exp(sink)`` joins the softmax denominator (:meth:`row_start`, :meth:`dsink`)

The whole matrix is a block too (``i0 = j0 = 0``, ``i1 = Lq``, ``j1 = Lk``), so the float64
reference and the blocked CPU path run this same code (``_modifiers_cpu``), and the CUDA
Variant implements these same steps (``cuda_src/variant.cuh``).

The backward (:meth:`grad_scores`): with ``t`` the score after step 3+4 (what step 5 reads)
and ``ds`` the gradient with respect to the masked scores, the gradient with respect to the
bias is ``ds * score_mod'(t)`` and with respect to ``scale * q @ k.T`` it is that times
``1 - tanh(s / c)**2``. Where ``ds`` is exactly 0 (a hidden pair, ``P = 0``) the product is 0
without evaluating the derivative there (it may be NaN or Inf at a score of -inf).

User functions run on NumPy arrays: ``b`` and ``h`` of shape ``batch_shape + (1, 1)``, ``q_idx``
``(m, 1)``, ``kv_idx`` ``(1, n)`` (int64), ``score`` the block in the accumulation dtype. The
result is broadcast to the block and converted to that dtype. The derivative of a score_mod is
that of its trace (``_trace``; exact, and the one the GPU uses); a function that cannot be
traced is differentiated by central differences in float64 (documented as such).
"""

from __future__ import annotations

from typing import Any

import numpy

from cuflash import _modifiers
from cuflash._modifiers import Modifiers


def _describe(fn) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


def call_score_mod(fn, s, b, h, qi, kj) -> numpy.ndarray:
    """``fn(s, b, h, qi, kj)`` checked and broadcast to ``s.shape`` in ``s.dtype``."""
    out = fn(s, b, h, qi, kj)
    arr = numpy.asarray(out)
    if arr.dtype.kind not in "iuf":
        raise TypeError(f"score_mod {_describe(fn)} must return numbers, got "
                        f"{type(out).__qualname__} of dtype {arr.dtype}")
    try:
        return numpy.broadcast_to(arr, s.shape).astype(s.dtype)
    except ValueError:
        raise ValueError(f"score_mod {_describe(fn)} returned shape {arr.shape} for a block "
                         f"of scores of shape {s.shape}: it must compute one number per "
                         f"score (elementwise)") from None


def call_mask_mod(fn, b, h, qi, kj, shape) -> numpy.ndarray:
    """``fn(b, h, qi, kj)`` checked to be bool and broadcast to ``shape``."""
    out = fn(b, h, qi, kj)
    arr = numpy.asarray(out)
    if arr.dtype != numpy.bool_:
        raise TypeError(f"mask_mod {_describe(fn)} must return bools (use comparisons, &, |, "
                        f"~), got {type(out).__qualname__} of dtype {arr.dtype}")
    try:
        return numpy.broadcast_to(arr, shape)
    except ValueError:
        raise ValueError(f"mask_mod {_describe(fn)} returned shape {arr.shape} for a block of "
                         f"shape {shape}: it must compute one bool per pair") from None


#: Relative step of the central differences for a score_mod that cannot be traced
FD_STEP = 2.0 ** -20


class ScorePipeline:
    """The modifiers of one problem applied to blocks of scores (see the module docstring).

    Parameters
    ----------
    mods : Modifiers
    causal : bool
    causal_offset : int
        Under causal, key j is visible to query i iff ``j <= i + causal_offset``.
    acc : numpy dtype
        The dtype blocks are computed in (float32 or float64).
    use_block_mask : bool
        Use ``mods.block_mask`` to classify tiles (the blocked path: skip empty tiles, skip the
        mask_mod on full ones). The reference passes False and evaluates mask_mod everywhere.
    """

    def __init__(self, mods: Modifiers, *, causal: bool, causal_offset: int, acc: Any,
                 use_block_mask: bool = True):
        self.mods = mods
        self.causal, self.causal_offset = bool(causal), int(causal_offset)
        self.acc = numpy.dtype(acc).type
        self.diag = mods.Lk - mods.Lq        # ALiBi and window are on the bottom-right diagonal
        b, h = _modifiers.batch_indices(mods.batch_shape)
        self.b, self.h = b[..., None, None], h[..., None, None]
        self.block_mask = mods.block_mask if use_block_mask else None
        self._dmod = None

    # -- which tiles to visit -----------------------------------------------------------------
    def key_range(self, i0: int, i1: int) -> tuple[int, int]:
        """Keys ``[lo, hi)`` that causal and window leave visible to some row of ``[i0, i1)``."""
        lo, hi = 0, self.mods.Lk
        if i1 <= i0:
            return 0, 0
        if self.causal:
            hi = min(hi, i1 - 1 + self.causal_offset + 1)
        if self.mods.window is not None:
            left, right = self.mods.window
            if right is not None:
                hi = min(hi, i1 - 1 + self.diag + right + 1)
            if left is not None:
                lo = max(lo, i0 + self.diag - left)
        return (lo, hi) if lo < hi else (0, 0)

    def query_range(self, j0: int, j1: int) -> tuple[int, int]:
        """Rows ``[lo, hi)`` to which causal and window leave some key of ``[j0, j1)`` visible."""
        lo, hi = 0, self.mods.Lq
        if j1 <= j0:
            return 0, 0
        if self.causal:
            lo = max(lo, j0 - self.causal_offset)
        if self.mods.window is not None:
            left, right = self.mods.window
            if right is not None:
                lo = max(lo, j0 - self.diag - right)
            if left is not None:
                hi = min(hi, j1 - 1 - self.diag + left + 1)
        return (lo, hi) if lo < hi else (0, 0)

    def tile_kind(self, i0: int, i1: int, j0: int, j1: int) -> str:
        """'empty', 'partial' or 'full' for the mask_mod of the whole tile (all batch items);
        'partial' unless a block mask says otherwise."""
        if self.block_mask is None or self.mods.mask_mod is None:
            return "partial"
        return self.block_mask.classify(i0, i1, j0, j1)

    # -- steps 2-5 ----------------------------------------------------------------------------
    def _indices(self, i0, i1, j0, j1):
        return numpy.arange(i0, i1)[:, None], numpy.arange(j0, j1)[None, :]

    def transform(self, s: numpy.ndarray, i0: int, i1: int, j0: int, j1: int,
                  saved: dict | None = None) -> numpy.ndarray:
        """Steps 2-5 on a block of ``scale * q @ k.T``; ``saved`` collects what the backward
        needs (``tanh`` of the softcap, ``t`` the input of score_mod)."""
        m, acc = self.mods, self.acc
        qi, kj = self._indices(i0, i1, j0, j1)
        if m.softcap is not None:
            th = numpy.tanh(s / acc(m.softcap))
            if saved is not None:
                saved["tanh"] = th
            s = acc(m.softcap) * th
        if m.alibi_slopes is not None:
            slope = numpy.asarray(m.alibi_slopes).astype(acc)[..., None, None]
            s = s - slope * numpy.abs(qi + self.diag - kj).astype(acc)
        if m.bias is not None:
            s = s + m.bias[..., i0:i1, j0:j1].astype(acc)
        if m.score_mod is not None:
            if saved is not None:
                saved["t"] = s
            with numpy.errstate(all="ignore"):   # IEEE results, as on the GPU
                s = call_score_mod(m.score_mod, s, self.b, self.h, qi, kj)
        return s

    # -- step 6 -------------------------------------------------------------------------------
    def visible(self, i0: int, i1: int, j0: int, j1: int, kind: str = "partial"):
        """The pairs of the block that no masking modifier hides: a bool array broadcastable
        to ``batch_shape + (i1 - i0, j1 - j0)``, or None when every pair is visible."""
        m = self.mods
        qi, kj = self._indices(i0, i1, j0, j1)
        vis = None

        def both(a, b):
            return b if a is None else a & b

        if self.causal:
            vis = both(vis, kj <= qi + self.causal_offset)
        if m.window is not None:
            left, right = m.window
            if left is not None:
                vis = both(vis, kj >= qi + self.diag - left)
            if right is not None:
                vis = both(vis, kj <= qi + self.diag + right)
        if m.mask is not None:
            vis = both(vis, m.mask[..., i0:i1, j0:j1])
        if m.mask_mod is not None and kind != "full":
            shape = m.batch_shape + (i1 - i0, j1 - j0)
            vis = both(vis, call_mask_mod(m.mask_mod, self.b, self.h, qi, kj, shape))
        return vis

    def scores(self, s: numpy.ndarray, i0: int, i1: int, j0: int, j1: int,
               saved: dict | None = None, kind: str = "partial") -> numpy.ndarray:
        """Steps 2-6: the masked scores of the block (``-inf`` where hidden)."""
        s = self.transform(s, i0, i1, j0, j1, saved)
        vis = self.visible(i0, i1, j0, j1, kind)
        if vis is not None:
            s = numpy.where(vis, s, self.acc(-numpy.inf))
        return s

    # -- step 7 -------------------------------------------------------------------------------
    def row_start(self) -> tuple[numpy.ndarray, numpy.ndarray]:
        """Initial ``(m, l)`` of the online softmax, of shape ``batch_shape + (1,)``: the sink is
        a key that every row sees with score ``sink`` and value 0 (``m = sink``, ``l = 1``);
        without one (or with ``sink = -inf``) ``m = -inf``, ``l = 0``."""
        shape = self.mods.batch_shape + (1,)
        if self.mods.sink is None:
            return (numpy.full(shape, self.acc(-numpy.inf)), numpy.zeros(shape, self.acc))
        sink = numpy.asarray(self.mods.sink).astype(self.acc)[..., None]
        return sink.copy(), numpy.where(sink == -numpy.inf, self.acc(0), self.acc(1))

    def lse_with_sink(self, lse: numpy.ndarray) -> numpy.ndarray:
        """``logaddexp(lse, sink)`` for a log-sum-exp over the keys alone."""
        if self.mods.sink is None:
            return lse
        return numpy.logaddexp(lse, numpy.asarray(self.mods.sink).astype(lse.dtype)[..., None])

    def dsink(self, D: numpy.ndarray, lse: numpy.ndarray) -> numpy.ndarray | None:
        """``dsink = -sum_i exp(sink - lse_i) D_i`` (``D_i = dO_i . O_i``), summed over the
        broadcast dimensions, in the accumulation dtype, shape ``sink_shape``. A row whose
        ``lse`` is -inf (possible only with ``sink = -inf``) contributes 0."""
        m = self.mods
        if m.sink is None:
            return None
        sink = numpy.asarray(m.sink).astype(self.acc)[..., None]
        dead = lse == -numpy.inf
        with numpy.errstate(invalid="ignore"):
            p_sink = numpy.where(dead, self.acc(0),
                                 numpy.exp(sink - numpy.where(dead, self.acc(0), lse)))
        per_item = -(p_sink * numpy.where(dead, self.acc(0), D)).sum(axis=-1)
        from cuflash import _problem
        return _problem.sum_to_shape(per_item, m.sink_shape, self.acc)

    # -- backward of steps 2-5 -----------------------------------------------------------------
    def grad_scores(self, ds: numpy.ndarray, saved: dict, i0: int, i1: int, j0: int,
                    j1: int) -> tuple[numpy.ndarray, numpy.ndarray | None]:
        """``(ds_qk, ds_bias)``: gradients with respect to ``scale * q @ k.T`` and to the bias
        entries of the block (None without a bias), given ``ds`` with respect to the masked
        scores and what :meth:`scores` saved."""
        m, zero = self.mods, self.acc(0)
        with numpy.errstate(all="ignore"):
            if m.score_mod is not None:
                g = self.score_mod_derivative(saved["t"], i0, i1, j0, j1)
                ds = numpy.where(ds == 0, zero, ds * g)
            ds_bias = ds if m.bias is not None else None
            if m.softcap is not None:
                th = saved["tanh"]
                ds = numpy.where(ds == 0, zero, ds * (1 - th * th))
        return ds, ds_bias

    def score_mod_derivative(self, t, i0, i1, j0, j1) -> numpy.ndarray:
        """d score_mod / d score at ``t``: from the trace, or by central differences."""
        from cuflash import _trace
        qi, kj = self._indices(i0, i1, j0, j1)
        fn = self.mods.score_mod
        if self._dmod is None:
            try:
                self._dmod = _trace.trace_score_mod(fn)
            except TypeError:
                self._dmod = False
        if self._dmod:
            return numpy.broadcast_to(
                self._dmod.evaluate_derivative(t, self.b, self.h, qi, kj), t.shape
            ).astype(self.acc)
        t64 = t.astype(numpy.float64)
        step = FD_STEP * numpy.maximum(1.0, numpy.abs(t64))
        hi = call_score_mod(fn, t64 + step, self.b, self.h, qi, kj)
        lo = call_score_mod(fn, t64 - step, self.b, self.h, qi, kj)
        return ((hi - lo) / (2 * step)).astype(self.acc)


def add_tile_to(buf: numpy.ndarray, tile: numpy.ndarray, i0: int, i1: int, j0: int,
                j1: int) -> None:
    """``buf`` (the un-broadcast shape of a pairwise input, e.g. ``bias.shape``) += ``tile``
    (``batch_shape + (i1 - i0, j1 - j0)``), summing over the dimensions broadcasting added."""
    nd = tile.ndim
    shape = (1,) * (nd - buf.ndim) + buf.shape
    view = buf.reshape(shape)
    axes = tuple(ax for ax in range(nd) if shape[ax] == 1 and tile.shape[ax] != 1)
    if axes:
        tile = tile.sum(axis=axes, keepdims=True)
    rows = slice(0, 1) if shape[-2] == 1 else slice(i0, i1)
    cols = slice(0, 1) if shape[-1] == 1 else slice(j0, j1)
    view[..., rows, cols] += tile


def restrict(pipe: ScorePipeline, index: tuple) -> ScorePipeline:
    """``pipe`` for the batch items ``index`` selects (an index tuple over leading batch axes,
    as the CPU path's tasks take them): the modifier arrays and ``b``, ``h`` indexed alike (views),
    so that a block of the group's scores goes through exactly what the whole batch would. A
    block mask keeps classifying over all items (what it calls empty or full is so for every
    item, so for the group's too)."""
    if not index:
        return pipe
    import copy
    import dataclasses
    m = pipe.mods
    sub = {name: getattr(m, name)[index] for name in ("alibi_slopes", "sink", "bias", "mask")
           if getattr(m, name) is not None}
    new = copy.copy(pipe)
    new.mods = dataclasses.replace(m, batch_shape=m.batch_shape[len(index):], **sub)
    new.b, new.h = pipe.b[index], pipe.h[index]
    return new


def group_view(buf: numpy.ndarray, full_ndim: int, index: tuple) -> numpy.ndarray:
    """The part of ``buf`` (an un-broadcast shape, e.g. ``bias.shape``, of an array broadcast to
    ``full_ndim`` dims) that the batch items ``index`` read: index 0 along broadcast axes."""
    view = buf.reshape((1,) * (full_ndim - buf.ndim) + buf.shape)
    return view[tuple(0 if view.shape[a] == 1 else i for a, i in enumerate(index))]
