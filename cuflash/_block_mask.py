"""``cuflash.block_mask``: which key tiles of each query tile a ``mask_mod`` hides entirely.

The map is evaluated once (today with NumPy on the host; on the device with CuPy once the GPU
path has it), then reused across calls and layers with the same ``mask_mod``, batch shape and
lengths. For every batch item and every (query tile, key tile) pair of ``block = (bm, bn)``
(default 128 x 128) it records:

- empty (0): the mask_mod hides every pair of the tile: the tile is never loaded;
- partial (1): some pairs visible, some hidden: the kernel evaluates the mask_mod per element;
- full (2): every pair visible: the kernel skips the mask_mod.

The last tile of each axis may be shorter (``Lq % bm``, ``Lk % bn``); it is classified on the
pairs that exist. From this the object derives FlexAttention-style lists: per query tile the
key tiles that are partial (``partial_count``, ``partial_index``) and full (``full_count``,
``full_index``), and per key tile the query tiles (``q_partial_*``, ``q_full_*``). Index lists
are ascending; entries past the count are -1. All arrays are read-only. The GPU kernels read
the same lists on their OWN tiles (:func:`tile_lists`: per row block of the kernel the key tiles
to visit with the kind of each row slice, per key tile the query tiles), built once per kernel
tile shape and kept with the block mask.

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
#: a block of :func:`causal_fine` with no pair within the causal bound (never in a list)
OUTSIDE = 3
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
    #: the same classification on a finer grid (``fine_block``, at most 32 x 32, dividing
    #: ``block``), recorded from the same evaluation: the kernels' tiles (64 rows a warpgroup,
    #: 64-key tiles) are classified from it, so a 64 x 64 tile under a partial 128 x 128 block
    #: (the diagonal of a causal document) can still be full or empty
    fine: numpy.ndarray | None = dataclasses.field(repr=False, default=None)
    fine_block: tuple[int, int] | None = None

    @property
    def tiles(self) -> tuple[int, int]:
        """``(Tq, Tk)``: the number of query and key tiles."""
        return self.kind.shape[-2], self.kind.shape[-1]

    def density(self) -> float:
        """The fraction of tiles that are not empty (the work left, roughly)."""
        return float((self.kind != EMPTY).mean()) if self.kind.size else 0.0

    def mean_row_keys(self) -> int:
        """The keys a query row block of the map visits, on average over blocks and batch
        items (its non-empty blocks times their width): how long the kernels' lists are
        (fwd_sm90's blocks an SM, ``_families.Shape.bmask_keys``)."""
        if not self.kind.size:
            return 0
        return int(round(float((self.kind != EMPTY).sum(-1).mean()) * self.block[1]))

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
        shape ``batch_shape + (ceil(Lq / m), ceil(Lk / n))`` (from the fine grid:
        :func:`kernel_tile_kinds`)."""
        return kernel_tile_kinds(self, m, n)

    def coarse_tile_kinds(self, m: int, n: int) -> numpy.ndarray:
        """:meth:`tile_kinds` from the ``block`` grid alone (a tile loop: the reference)."""
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
    fm, fn = _fine(bm), _fine(bn)
    fine = numpy.full(batch_shape + (-(-Lq // fm), -(-Lk // fn)), EMPTY, numpy.int8)
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
            # the fine grid's kinds (rows first: the column pass then reads 32x fewer values)
            rs, cs = numpy.arange(0, i1 - i0, fm), numpy.arange(0, j1 - j0, fn)
            r_any, r_all = (u.reduceat(vis, rs, axis=-2)
                            for u in (numpy.logical_or, numpy.logical_and))
            f_any = numpy.logical_or.reduceat(r_any, cs, axis=-1)
            f_all = numpy.logical_and.reduceat(r_all, cs, axis=-1)
            fine[..., i0 // fm:i0 // fm + len(rs), j0 // fn:j0 // fn + len(cs)] = numpy.where(
                f_all, FULL, numpy.where(f_any, PARTIAL, EMPTY))
    # the block grid's kinds from the fine grid's (its blocks tile each block exactly)
    if fine.size:
        rb, cb = numpy.arange(0, fine.shape[-2], bm // fm), numpy.arange(0, fine.shape[-1], bn // fn)
        f_nonempty, f_full = fine != EMPTY, fine == FULL
        any_ = numpy.logical_or.reduceat(numpy.logical_or.reduceat(f_nonempty, rb, axis=-2), cb, axis=-1)
        all_ = numpy.logical_and.reduceat(numpy.logical_and.reduceat(f_full, rb, axis=-2), cb, axis=-1)
        kind[...] = numpy.where(all_, FULL, numpy.where(any_, PARTIAL, EMPTY))
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
                     q_full_count=_frozen(qfc), q_full_index=_frozen(qfi),
                     fine=_frozen(fine), fine_block=(fm, fn))


def _fine(b: int) -> int:
    """The fine grid's side along a block side of ``b``: its largest divisor <= 32."""
    return max(x for x in range(1, min(b, 32) + 1) if b % x == 0)


# ---------------------------------------------------------------------------------------------
# The kernels' tile lists (FlexAttention's kv_num_blocks / kv_indices on the kernel's tiles)
# ---------------------------------------------------------------------------------------------

#: a list entry is ``tile << LIST_SHIFT | kinds``: the kind (2 bits, EMPTY / PARTIAL / FULL) of
#: each of up to 8 row slices of the block (slice s in bits 2s, 2s + 1); cuda_src/modifiers.cuh
LIST_SHIFT = 16
MAX_SLICES = 8


def causal_fine(bm: BlockMask, offset: int) -> numpy.ndarray:
    """The fine grid's kinds of the pairs a causal bound leaves visible (key j for query i iff
    j <= i + offset; the kernels apply that bound themselves whenever a tile crosses it): full
    where the mask_mod keeps every such pair, empty where it keeps none, ``OUTSIDE`` where
    there is none (a kernel tile's kind disregards those blocks: :func:`kernel_tile_kinds`).
    A block wholly inside the bound keeps its kind; one wholly past it is OUTSIDE; one the bound
    crosses and the fine grid calls partial is evaluated again, its pairs restricted to the
    bound (the diagonal of a causal mask_mod, e.g. documents: full, so a kernel that is told
    ``causal`` skips the mask_mod there). Kept with the block mask, per offset (session 9)."""
    cache = bm.__dict__.setdefault("_causal_fine", {})
    if offset in cache:
        return cache[offset]
    fine, (fm, fn) = bm.fine, bm.fine_block
    R, C = fine.shape[-2:]
    row_lo, col_lo = numpy.arange(R) * fm, numpy.arange(C) * fn
    row_hi = numpy.minimum(row_lo + fm, bm.Lq) - 1
    col_hi = numpy.minimum(col_lo + fn, bm.Lk) - 1
    inside = col_hi[None, :] <= row_lo[:, None] + offset     # every pair within the bound
    past = col_lo[None, :] > row_hi[:, None] + offset        # no pair within it
    out = numpy.where(past, OUTSIDE, fine).astype(numpy.int8)
    cross = ~inside & ~past                                  # per row: one contiguous run
    b, h = _modifiers.batch_indices(bm.batch_shape)
    b, h = b[..., None, None], h[..., None, None]
    for r in numpy.flatnonzero(cross.any(axis=1)):
        cs = numpy.flatnonzero(cross[r])
        c0, c1 = int(cs[0]), int(cs[-1]) + 1
        old = fine[..., r, c0:c1]
        if not (old == PARTIAL).any():
            continue
        i0, i1, j0, j1 = int(row_lo[r]), int(row_hi[r]) + 1, int(col_lo[c0]), int(col_hi[c1 - 1]) + 1
        qi, kj = numpy.arange(i0, i1)[:, None], numpy.arange(j0, j1)[None, :]
        vis = _pipeline.call_mask_mod(bm.mask_mod, b, h, qi, kj, bm.batch_shape + (i1 - i0, j1 - j0))
        bound = kj <= qi + offset
        cols = numpy.arange(0, j1 - j0, fn)
        full = numpy.logical_and.reduceat((vis | ~bound).all(axis=-2), cols, axis=-1)
        some = numpy.logical_or.reduceat((vis & bound).any(axis=-2), cols, axis=-1)
        out[..., r, c0:c1] = numpy.where(old == PARTIAL,
                                         numpy.where(full, FULL, numpy.where(some, PARTIAL, EMPTY)), old)
    out.flags.writeable = False
    cache[offset] = out
    return out


def kernel_tile_kinds(bm: BlockMask, m: int, n: int, causal: int | None = None) -> numpy.ndarray:
    """The kind of every ``m x n`` kernel tile (:meth:`BlockMask.tile_kinds`) from the fine
    grid's blocks (the ``block`` grid's for a BlockMask without one): their non-empty and
    non-full blocks counted over each kernel tile's rectangle by 2-D prefix sums (a tile is
    empty iff it covers no non-empty block, full iff it covers no non-full one; exact, never
    wrong, for any sizes). ``causal``: the causal offset of a kernel that applies the causal
    bound itself; the kinds are then those of the pairs within it (:func:`causal_fine`)."""
    kind, (Bm, Bn) = ((bm.fine, bm.fine_block) if bm.fine is not None else (bm.kind, bm.block))
    if causal is not None and bm.fine is not None:
        kind = causal_fine(bm, int(causal))
    Tq, Tk = -(-bm.Lq // m), -(-bm.Lk // n)
    a = numpy.arange(Tq)
    c = numpy.arange(Tk)
    r0, r1 = a * m // Bm, (numpy.minimum((a + 1) * m, bm.Lq) - 1) // Bm + 1
    c0, c1 = c * n // Bn, (numpy.minimum((c + 1) * n, bm.Lk) - 1) // Bn + 1

    def rect(x):   # per tile: the number of blocks of the map where x holds
        P = numpy.zeros(x.shape[:-2] + (x.shape[-2] + 1, x.shape[-1] + 1), numpy.int64)
        P[..., 1:, 1:] = x.astype(numpy.int64).cumsum(-2).cumsum(-1)
        R0, R1, C0, C1 = r0[:, None], r1[:, None], c0[None, :], c1[None, :]
        return P[..., R1, C1] - P[..., R0, C1] - P[..., R1, C0] + P[..., R0, C0]

    out = numpy.full(kind.shape[:-2] + (Tq, Tk), PARTIAL, numpy.int8)
    inside = kind != OUTSIDE
    out[rect((kind != FULL) & inside) == 0] = FULL
    out[rect((kind != EMPTY) & inside) == 0] = EMPTY
    return out


#: the entry after a list's last: its tile is past every loop's end (modifiers.cuh kListEnd)
LIST_END = 0x7FFFFFFF


def _compact(visit: numpy.ndarray, entry: numpy.ndarray) -> tuple[numpy.ndarray, numpy.ndarray]:
    """Per row (last axis): how many tiles ``visit`` holds, and their ``entry`` values in
    ascending tile order followed by LIST_END up to 2 past the row's length (a loop reads the
    entry after next without comparing with the count)."""
    count = visit.sum(axis=-1).astype(numpy.int32)
    order = numpy.argsort(~visit, axis=-1, kind="stable")
    packed = numpy.take_along_axis(entry, order, axis=-1)
    packed = numpy.concatenate([packed, numpy.zeros(packed.shape[:-1] + (2,), packed.dtype)], -1)
    cols = numpy.arange(packed.shape[-1])
    return count, numpy.where(cols < count[..., None], packed, LIST_END).astype(numpy.int32)


@dataclasses.dataclass(frozen=True)
class TileLists:
    """The lists of one kernel tile shape, one int32 row per batch item of the map (``data``,
    ``batch_shape + (size,)``), laid out as cuda_src/modifiers.cuh reads them:

    - ``[0, Tq)``: per query tile (``m`` rows) the number of key tiles (``n`` keys) to visit;
    - ``[Tq, Tq + Tq (Tk + 2))``: their entries, row a at ``Tq + a (Tk + 2)``, ascending, then
      LIST_END to the row's end; an entry is ``key tile << LIST_SHIFT`` | the kind of each
      ``sub``-row slice of the query tile;
    - ``[bwd, bwd + Tk)``: per key tile the number of query tiles to visit (the transpose);
    - ``[bwd + Tk, bwd + Tk + Tk (Tq + 2))``: their entries, key tile c at
      ``bwd + Tk + c (Tq + 2)``: ``query tile << LIST_SHIFT`` | the kind of the whole (m x n)
      tile, then LIST_END.

    A tile is visited iff some slice of it is not empty; the kinds are those of
    :func:`kernel_tile_kinds` (exact for any map block and kernel tile: empty and full only
    where every map block under it is). Rows past Lq are empty slices."""
    m: int
    n: int
    sub: int
    tq: int
    tk: int
    bwd: int
    data: numpy.ndarray


def tile_lists(bm: BlockMask, m: int, n: int, sub: int | None = None,
               causal: int | None = None) -> TileLists:
    """The lists of ``m x n`` kernel tiles with ``sub``-row slices (``m`` by default; ``m`` a
    multiple of ``sub``, at most 8 slices). See :class:`TileLists`. ``causal``: the causal
    offset of a kernel that bounds every row causally itself (its kinds: those of the pairs
    within the bound, :func:`causal_fine`), or None."""
    sub = m if sub is None else sub
    if m % sub or m // sub > MAX_SLICES:
        raise ValueError(f"tile_lists: {m} rows in slices of {sub} (at most {MAX_SLICES})")
    Tq, Tk = -(-bm.Lq // m), -(-bm.Lk // n)
    if max(Tq, Tk) >= 1 << (31 - LIST_SHIFT):
        raise ValueError(f"block mask over {Tq} x {Tk} tiles: the kernels' lists take fewer "
                         f"than {1 << (31 - LIST_SHIFT)} a side")
    batch = bm.kind.shape[:-2]
    ns = m // sub
    ks = kernel_tile_kinds(bm, sub, n, causal).astype(numpy.int32)  # batch + (Ts, Tk)
    pad = Tq * ns - ks.shape[-2]
    ks = numpy.concatenate([ks, numpy.zeros(batch + (pad, Tk), numpy.int32)], axis=-2)
    ks = ks.reshape(batch + (Tq, ns, Tk))
    bits = (ks << (2 * numpy.arange(ns))[:, None]).sum(axis=-2)      # batch + (Tq, Tk)
    tiles_k = numpy.arange(Tk, dtype=numpy.int32) << LIST_SHIFT
    fc, fe = _compact(bits != 0, tiles_k + bits)
    kt = kernel_tile_kinds(bm, m, n, causal).astype(numpy.int32).swapaxes(-1, -2)   # batch + (Tk, Tq)
    tiles_q = numpy.arange(Tq, dtype=numpy.int32) << LIST_SHIFT
    bc, be = _compact(kt != EMPTY, tiles_q + kt)
    parts = [fc, fe.reshape(batch + (Tq * (Tk + 2),)), bc, be.reshape(batch + (Tk * (Tq + 2),))]
    data = numpy.concatenate(parts, axis=-1).astype(numpy.int32)
    data.flags.writeable = False
    return TileLists(m=m, n=n, sub=sub, tq=Tq, tk=Tk, bwd=Tq + Tq * (Tk + 2), data=data)


def host_lists(bm: BlockMask, m: int, n: int, sub: int | None = None,
               causal: int | None = None) -> TileLists:
    """:func:`tile_lists`, built once per (block mask, tile shape, causal offset or None) and
    kept with the block mask."""
    cache = bm.__dict__.setdefault("_tile_lists", {})
    key = (m, n, m if sub is None else sub, causal)
    if key not in cache:
        cache[key] = tile_lists(bm, m, n, sub, causal)
    return cache[key]


def device_lists(bm: BlockMask, batch_shape: tuple[int, ...], m: int, n: int,
                 sub: int | None = None, causal: int | None = None):
    """(:class:`TileLists`, its ``data`` on the current CUDA device broadcast to
    ``batch_shape + (size,)``): uploaded once per device and tile shape, kept with the block
    mask (what a plan's kernels read)."""
    import cupy
    dev = cupy.cuda.runtime.getDevice()
    # the broadcast view is kept too (a call looks it up 2-3 times: host time)
    views = bm.__dict__.setdefault("_device_views", {})
    key = (dev, m, n, sub, causal, tuple(batch_shape))
    hit = views.get(key)
    if hit is None:
        lists = host_lists(bm, m, n, sub, causal)
        cache = bm.__dict__.setdefault("_device_lists", {})
        up = (dev, lists.m, lists.n, lists.sub, causal)
        if up not in cache:
            cache[up] = cupy.asarray(lists.data)
        d = cache[up]
        hit = views[key] = (lists, cupy.broadcast_to(d, tuple(batch_shape) + d.shape[-1:]))
    return hit
