"""The persistent forward's host-made schedule (``cuflash._fwd_schedule``: ``item_tiles``, the key
tiles each Q tile visits as fwd_sm90ws computes them, and ``lpt_schedule``, the blocks' item lists
of its PERSIST 3 build). No GPU: the lists' properties (every item once, in the kernel's
numbering, balanced) and the tile counts against a direct count of visible pairs."""

from __future__ import annotations

import numpy
import pytest

from cuflash._fwd_schedule import item_tiles, lpt_schedule


def _visible_tiles(Lq, Lk, bm, bn, causal, offset, window):
    """Key tiles holding a visible key of some row of each Q tile, from the pairs themselves."""
    i = numpy.arange(Lq)[:, None]
    j = numpy.arange(Lk)[None, :]
    vis = numpy.ones((Lq, Lk), bool)
    if causal:
        vis &= j <= i + offset
    if window is not None:
        left, right = window
        diag = Lk - Lq
        if left is not None:
            vis &= j >= i + diag - left
        if right is not None:
            vis &= j <= i + diag + right
    out = []
    for m0 in range(0, Lq, bm):
        cols = numpy.flatnonzero(vis[m0:m0 + bm].any(axis=0))
        out.append(0 if len(cols) == 0 else cols[-1] // bn - cols[0] // bn + 1)
    return numpy.array(out)


@pytest.mark.parametrize("Lq, Lk, causal, offset, window", [
    (1000, 1000, True, 0, None), (700, 1300, True, 600, None), (1300, 700, True, -600, None),
    (1024, 1024, False, 0, None), (2048, 2048, True, 0, (300, 0)), (900, 1100, False, 0, (37, 59)),
    (1500, 700, True, -800, (50, None)),
])
def test_item_tiles_cover_the_visible_keys(Lq, Lk, causal, offset, window):
    """The kernel's [j0, n_blocks) holds every tile with a visible key (it may hold a few more:
    causal's and the window's bounds are those of the block's first and last rows)."""
    got = item_tiles(Lq, Lk, 128, 128, causal, offset, window)
    want = _visible_tiles(Lq, Lk, 128, 128, causal, offset, window)
    assert len(got) == len(want) == -(-Lq // 128)
    assert (got >= want).all() and (got <= want + 1).all(), (got, want)


@pytest.mark.parametrize("order", [0, 1])
@pytest.mark.parametrize("nbatch, grid", [(64, 132), (3, 132), (5, 7), (1, 1)])
def test_lpt_lists_hold_every_item_once_balanced(order, nbatch, grid):
    tiles = item_tiles(4096, 4096, 128, 128, True, 0)
    ntiles = len(tiles)
    out = lpt_schedule(tiles, nbatch, order, grid)
    assert out.dtype == numpy.int32
    offsets, items = out[:grid + 1], out[grid + 1:]
    assert offsets[0] == 0 and offsets[-1] == len(items) == nbatch * ntiles
    assert (numpy.diff(offsets) >= 0).all()
    assert sorted(items.tolist()) == list(range(nbatch * ntiles))
    # the kernel's numbering (block_tile): order 1 tile-major, order 0 batch-major; tile t is
    # Q tile ntiles - 1 - t, so item 0 is the heaviest under causal
    t = items // nbatch if order == 1 else items % ntiles
    work = tiles[ntiles - 1 - t] + 1
    loads = numpy.array([work[offsets[b]:offsets[b + 1]].sum() for b in range(grid)])
    # LPT: no block more than the largest item above the mean (and each list heaviest first)
    assert loads.max() - loads.mean() <= work.max()
    for b in range(grid):
        w = work[offsets[b]:offsets[b + 1]]
        assert (numpy.diff(w) <= 0).all()
