"""``cuflash.block_mask``: which key tiles of each query tile a ``mask_mod`` hides entirely.

The map is evaluated once (today with NumPy on the host; on the device with CuPy once the GPU
path has it), then reused across calls and layers with the same ``mask_mod``, batch shape and
lengths. For every batch item and every (query tile, key tile) pair of ``block = (bm, bn)``
(default 128 x 128) it records:

- empty (0): the mask_mod hides every pair of the tile: the tile is never loaded;
- partial (1): some pairs visible, some hidden: the kernel evaluates the mask_mod per element;
- full (2): every pair visible: the kernel skips the mask_mod.

The last tile of each axis may be shorter (``Lq % bm``, ``Lk % bn``); it is classified on the
pairs that exist. From this the object derives FlexAttention-style lists, which the kernels
read: per query tile the key tiles that are partial (``partial_count``, ``partial_index``) and
full (``full_count``, ``full_index``), and per key tile the query tiles (``q_partial_*``,
``q_full_*``, for the backward, which walks key tiles). Index lists are ascending; entries past
the count are -1. All arrays are read-only.

Kernels with other tiles: a kernel tile of ``m x n`` is classified from the block-mask tiles it
overlaps (:meth:`BlockMask.tile_kinds`): empty if all of them are empty, full if all are full,
else partial. That is exact whatever the sizes (a pair is visible exactly when the mask_mod
says so, and the classification only ever skips work that is provably empty or provably
full); it is cheapest when ``m`` and ``n`` divide or are multiples of ``bm`` and ``bn``, which
is why 128 x 128 (every cuflash tile divides it or is a multiple of 64 that tiles it) is the
default. A kernel tile that straddles two block-mask tiles is partial unless both agree.

Batch dimensions: ``batch_shape`` has the inputs' number of batch dimensions; a dimension of 1
where the inputs have more means the user promises the mask_mod does not depend on that
index (it is evaluated at index 0, as FlexAttention's ``B=None`` / ``H=None``).
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, Callable

import numpy

from cuflash import _modifiers, _pipeline

EMPTY, PARTIAL, FULL = 0, 1, 2
#: Most booleans evaluated at once (bounds the memory of the evaluation)
_CHUNK = 1 << 24


@dataclasses.dataclass(frozen=True, eq=False)
class BlockMask:
    """A tile map of a ``mask_mod`` (see the module docstring); make it with :func:`block_mask`."""

    mask_mod: Callable
    batch_shape: tuple[int, ...]
    Lq: int
    Lk: int
    block: tuple[int, int]
    kind: numpy.ndarray = dataclasses.field(repr=False)          # batch + (Tq, Tk), int8
    partial_count: numpy.ndarray = dataclasses.field(repr=False)  # batch + (Tq,), int32
    partial_index: numpy.ndarray = dataclasses.field(repr=False)  # batch + (Tq, Tk), int32
    full_count: numpy.ndarray = dataclasses.field(repr=False)
    full_index: numpy.ndarray = dataclasses.field(repr=False)
    q_partial_count: numpy.ndarray = dataclasses.field(repr=False)  # batch + (Tk,)
    q_partial_index: numpy.ndarray = dataclasses.field(repr=False)  # batch + (Tk, Tq)
    q_full_count: numpy.ndarray = dataclasses.field(repr=False)
    q_full_index: numpy.ndarray = dataclasses.field(repr=False)

    @property
    def tiles(self) -> tuple[int, int]:
        """``(Tq, Tk)``: the number of query and key tiles."""
        return self.kind.shape[-2], self.kind.shape[-1]

    def density(self) -> float:
        """The fraction of tiles that are not empty (the work left, roughly)."""
        return float((self.kind != EMPTY).mean()) if self.kind.size else 0.0

    def classify(self, i0: int, i1: int, j0: int, j1: int) -> str:
        """'empty', 'partial' or 'full' for the rows ``[i0, i1)`` and keys ``[j0, j1)`` over all
        batch items (what the blocked CPU path, which handles all items at once, may skip)."""
        bm, bn = self.block
        k = self.kind[..., i0 // bm:(i1 - 1) // bm + 1, j0 // bn:(j1 - 1) // bn + 1]
        if (k == EMPTY).all():
            return "empty"
        if (k == FULL).all():
            return "full"
        return "partial"

    def tile_kinds(self, m: int, n: int) -> numpy.ndarray:
        """The kind (0 empty, 1 partial, 2 full) of every ``m x n`` kernel tile, per batch item:
        shape ``batch_shape + (ceil(Lq / m), ceil(Lk / n))``."""
        bm, bn = self.block
        Tq, Tk = -(-self.Lq // m), -(-self.Lk // n)
        out = numpy.empty(self.batch_shape + (Tq, Tk), numpy.int8)
        for a in range(Tq):
            r0, r1 = a * m // bm, (min((a + 1) * m, self.Lq) - 1) // bm + 1
            rows = self.kind[..., r0:r1, :]
            for c in range(Tk):
                c0, c1 = c * n // bn, (min((c + 1) * n, self.Lk) - 1) // bn + 1
                k = rows[..., c0:c1]
                out[..., a, c] = numpy.where((k == EMPTY).all(axis=(-2, -1)), EMPTY,
                                             numpy.where((k == FULL).all(axis=(-2, -1)), FULL,
                                                         PARTIAL))
        return out


def _lists(kind: numpy.ndarray, value: int) -> tuple[numpy.ndarray, numpy.ndarray]:
    """Per row of ``kind`` (last axis): how many entries equal ``value``, and their ascending
    indices padded with -1."""
    hit = kind == value
    count = hit.sum(axis=-1).astype(numpy.int32)
    cols = numpy.arange(kind.shape[-1], dtype=numpy.int32)
    # stable sort puts the hits first, in ascending order
    order = numpy.argsort(~hit, axis=-1, kind="stable").astype(numpy.int32)
    index = numpy.where(cols < count[..., None], order, numpy.int32(-1))
    return count, index


def _frozen(x: numpy.ndarray) -> numpy.ndarray:
    x = numpy.ascontiguousarray(x)
    x.flags.writeable = False
    return x


def _check_args(mask_mod, batch_shape, Lq, Lk, block):
    _modifiers.check_user_function(mask_mod, "mask_mod")
    if mask_mod is None:
        raise TypeError("block_mask needs a mask_mod function (b, h, q_idx, kv_idx) -> bool")
    if not isinstance(batch_shape, (tuple, list)) or not all(
            isinstance(n, numbers.Integral) and not isinstance(n, bool) and n >= 0
            for n in batch_shape):
        raise TypeError(f"batch_shape must be a tuple of ints >= 0, got {batch_shape!r}")
    for name, x in (("Lq", Lq), ("Lk", Lk)):
        if not isinstance(x, numbers.Integral) or isinstance(x, bool) or x < 0:
            raise ValueError(f"{name} must be an int >= 0, got {name}={x!r}")
    if (not isinstance(block, (tuple, list)) or len(block) != 2
            or not all(isinstance(n, numbers.Integral) and not isinstance(n, bool) and n > 0
                       for n in block)):
        raise ValueError(f"block must be a pair of ints > 0, got {block=}")


def block_mask(mask_mod: Callable, batch_shape: Any, Lq: int, Lk: int, *,
               block: tuple[int, int] = (128, 128)) -> BlockMask:
    """Evaluate ``mask_mod(b, h, q_idx, kv_idx)`` tile by tile and record which tiles are empty,
    partial or full (see the module docstring); pass the result as ``block_mask=`` to reuse
    it. ``b`` and ``h`` have DESIGN.md's meaning for ``batch_shape``.

    Raises
    ------
    TypeError
        ``mask_mod`` not a function of 4 arguments or not returning bools; a batch_shape that
        is not a tuple of ints.
    ValueError
        Negative lengths, a block that is not two positive ints.
    """
    _check_args(mask_mod, batch_shape, Lq, Lk, block)
    batch_shape = tuple(int(n) for n in batch_shape)
    bm, bn = int(block[0]), int(block[1])
    Tq, Tk = -(-Lq // bm), -(-Lk // bn)
    kind = numpy.full(batch_shape + (Tq, Tk), EMPTY, numpy.int8)
    b, h = _modifiers.batch_indices(batch_shape)
    b, h = b[..., None, None], h[..., None, None]
    items = max(1, int(numpy.prod(batch_shape, dtype=numpy.int64)))
    keys_per_chunk = max(bn, (_CHUNK // max(1, items * bm)) // bn * bn)
    for t in range(Tq):
        i0, i1 = t * bm, min((t + 1) * bm, Lq)
        qi = numpy.arange(i0, i1)[:, None]
        for j0 in range(0, Lk, keys_per_chunk):
            j1 = min(j0 + keys_per_chunk, Lk)
            kj = numpy.arange(j0, j1)[None, :]
            vis = _pipeline.call_mask_mod(mask_mod, b, h, qi, kj,
                                          batch_shape + (i1 - i0, j1 - j0))
            starts = numpy.arange(0, j1 - j0, bn)
            any_ = numpy.logical_or.reduceat(vis.any(axis=-2), starts, axis=-1)
            all_ = numpy.logical_and.reduceat(vis.all(axis=-2), starts, axis=-1)
            kind[..., t, j0 // bn:j0 // bn + len(starts)] = numpy.where(
                all_, FULL, numpy.where(any_, PARTIAL, EMPTY))
    pc, pi = _lists(kind, PARTIAL)
    fc, fi = _lists(kind, FULL)
    kt = kind.swapaxes(-1, -2)
    qpc, qpi = _lists(kt, PARTIAL)
    qfc, qfi = _lists(kt, FULL)
    return BlockMask(mask_mod=mask_mod, batch_shape=batch_shape, Lq=int(Lq), Lk=int(Lk),
                     block=(bm, bn), kind=_frozen(kind),
                     partial_count=_frozen(pc), partial_index=_frozen(pi),
                     full_count=_frozen(fc), full_index=_frozen(fi),
                     q_partial_count=_frozen(qpc), q_partial_index=_frozen(qpi),
                     q_full_count=_frozen(qfc), q_full_index=_frozen(qfi))


def device_kind(bm: BlockMask, batch_shape: tuple[int, ...]):
    """``bm.kind`` on the current CUDA device (copied once per device and kept with the block
    mask), broadcast to ``batch_shape + (Tq, Tk)``: what the kernels read (int8 TileKind)."""
    import cupy
    dev = cupy.cuda.runtime.getDevice()
    cache = bm.__dict__.setdefault("_device_kind", {})
    if dev not in cache:
        cache[dev] = cupy.asarray(numpy.ascontiguousarray(bm.kind))
    k = cache[dev]
    return cupy.broadcast_to(k, tuple(batch_shape) + k.shape[-2:])
