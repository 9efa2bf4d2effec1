"""fwd_sm90's schedule choices that read a problem beyond its tiles (session 10): how many
blocks run the grid (a persistent build's resident grid), when a block takes query tiles in
turn (``persist_wanted``), and the block-mask list length from which its build keeps one block
an SM's registers (``bmask_long_keys``), and whether the analytic window takes its lean build
(``window_lean``, session 11) and a lean block mask reads its list early (``bmask_list_read``,
session 12). Read by the dispatcher (``_families._fwd_sm90_select``)
and the forward plan's launch (``_plan.ForwardPlan``); the reasons are in ``_traits``
(``FWD_SM90_PERSIST_FEATURES``, ``FWD_SM90_BMASK_LONG_KEYS``) and bench/NOTES.md ("The window
and block masks at short lists, forward (session 10)")."""

from __future__ import annotations

import os

from . import _traits


def bmask_long_keys() -> int:
    """``CUFLASH_FWD90_BMASK_LONG`` (plan time; session 10): the mean keys a query block of a
    block mask visits from which fwd_sm90 gives it 1 block an SM (min_blocks) instead of the 2
    kept for short lists (``_traits.FWD_SM90_MIN_BLOCKS_BLOCK_MASK``); "0": never (session 9)."""
    value = os.environ.get("CUFLASH_FWD90_BMASK_LONG", "").strip()
    if value == "":
        return _traits.FWD_SM90_BMASK_LONG_KEYS
    if not value.isdigit():
        raise ValueError(f"CUFLASH_FWD90_BMASK_LONG={value!r}: expected a number of keys (0: off)")
    return int(value)


def short_lists(shape) -> bool:
    """Whether ``shape``'s block mask has short lists: its query blocks visit fewer keys on
    average than ``bmask_long_keys()`` (its table value where the switch turns the long-list
    rule off)."""
    return 0 < shape.bmask_keys < (bmask_long_keys() or _traits.FWD_SM90_BMASK_LONG_KEYS)


def persist_wanted(shape, t, dev) -> bool:
    """Whether fwd_sm90 runs ``shape`` persistent (``_traits.FWD_SM90_PERSIST_FEATURES``).
    ``CUFLASH_FWD90_PERSIST`` (plan time): "0" (default: session 10's call 2 measured the d 128
    window 6-8% slower persistent, bench/NOTES.md) never; "auto" where a block is alone on its SM
    (min_blocks 1: d = 128's 3 warpgroups), for the analytic window (with causal or not) and a
    block mask's mask_mod (with causal or not) whose lists are short (fewer than
    ``bmask_long_keys()`` keys a query block): there nothing overlaps a block's prologue and
    epilogue; "window": also the window at 2 blocks an SM (d = 64); "all": any Variant. Only where the grid has more (batch item, Q tile) items than resident blocks and the
    second Q buffer fits."""
    value = os.environ.get("CUFLASH_FWD90_PERSIST", "").strip() or "0"
    if value not in ("auto", "window", "all", "0"):
        raise ValueError(f"CUFLASH_FWD90_PERSIST={value!r}: expected auto, window, all or 0")
    v = shape.variant
    if value == "0" or t.head_dim > _traits.FWD_SM90_PERSIST_MAX_HEAD_DIM:
        return False
    window = v.window and v.features <= _traits.FWD_SM90_PERSIST_FEATURES
    short = (v.block_mask and v.features <= _traits.FWD_SM90_PERSIST_BLOCK_MASK
             and short_lists(shape)
             and t.min_blocks == 1)   # (at 2 blocks an SM, d = 64, its builds spill)
    alone = t.min_blocks == 1
    if not (value == "all" or (value == "window" and window) or (alone and (window or short))):
        return False
    items = shape.nbatch * -(-shape.Lq // t.block_m)
    return (items > fwd_sm90_grid(t.replace(persist=1), items, dev)
            and t.replace(persist=1).smem_bytes <= dev.smem_optin)


def fwd_sm90_grid(t, items: int, dev) -> int:
    """The forward's grid for ``items`` (batch item, Q tile) blocks of work: one block each, or
    for a persistent build (``persist``) ``CUFLASH_FWD90_PERSIST_GRID``: "slots" (default:
    ``min_blocks`` blocks an SM, the resident ones) or k (k items a block: ceil(items / k))."""
    if t.family not in ("fwd_sm90", "fwd_sm90ws") or not t["persist"]:
        return items
    value = os.environ.get("CUFLASH_FWD90_PERSIST_GRID", "").strip() or "slots"
    if value == "slots":
        return max(1, min(items, t.min_blocks * dev.num_sms))
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"CUFLASH_FWD90_PERSIST_GRID={value!r}: expected slots or k >= 1")
    return -(-items // int(value))


def bmask_short_warpgroups() -> int:
    """``CUFLASH_FWD90_BMASK_SHORT_WG`` (plan time; session 11): the most warpgroups (64 query
    rows each) of a fwd_sm90 block for a block mask's mask_mod whose query blocks visit few keys
    (fewer than ``bmask_long_keys()``); "" or "table" (0): the table's. Why fewer may pay: a
    block of 3 warpgroups is 192 rows, which no power-of-two document or prefix boundary lines
    up with, so its lists take the partial tiles of two documents: for the mods suite's 8 causal
    documents at 4k the tiles a 192-row block computes hold 0.61 visible pairs each, 0.80 at
    128 rows and 0.89 at 64 (``bench/NOTES.md``, session 11); and the shorter a block's list,
    the more its fixed cost (Q in, O out) weighs, which more, smaller blocks an SM overlap."""
    value = os.environ.get("CUFLASH_FWD90_BMASK_SHORT_WG", "").strip()
    if value in ("", "table"):
        return 0
    if value not in ("1", "2"):
        raise ValueError(f"CUFLASH_FWD90_BMASK_SHORT_WG={value!r}: expected table, 1 or 2")
    return int(value)


def bmask_short_tiles(t, shape, why: list):
    """fwd_sm90's traits ``t`` for ``shape`` with :func:`bmask_short_warpgroups` applied: a block
    mask's mask_mod (the score path) whose lists are short. Appends the reason to ``why``."""
    wg = bmask_short_warpgroups()
    v = shape.variant
    if not (0 < wg < t["warpgroups"] and v.block_mask and v.score_path
            and short_lists(shape)):
        return t
    why.append(f"{wg} warpgroups a block: the block mask's lists are short ({shape.bmask_keys} "
               "keys a query block on average; CUFLASH_FWD90_BMASK_SHORT_WG)")
    return t.replace(warpgroups=wg)


def window_lean(t, variant, why: list | None = None):
    """fwd_sm90's traits ``t`` with ``lean`` (session 11, bench/NOTES.md "the window's
    instructions per visible pair") where ``variant`` is the analytic window alone (causal or
    not; its blocks see ~17 key tiles, so a block's and a tile's fixed instructions are a large
    share of them: the short batch offsets and the loop's cuts), or a block mask's mask_mod
    alone (causal or not; the short batch offsets only: packed documents at 4k visit 1-8 key
    tiles a query block). ``CUFLASH_FWD90_LEAN`` (plan time): "1" (both: the default), "window",
    "bmask" (one of them) or "0" (session 10's builds, for an A/B in one process). Session 11
    wrote them without a GPU; session 12's H200 run (bench/probes/window_lean.py) timed them at
    1.06-1.08x the old builds at the window's four forward points and 1.00-1.04x at the block
    masks', and the GPU tests passed with them on (bench/NOTES.md, session 12)."""
    value = os.environ.get("CUFLASH_FWD90_LEAN", "").strip() or "1"
    if value not in ("0", "1", "window", "bmask"):
        raise ValueError(f"CUFLASH_FWD90_LEAN={value!r}: expected 1, window, bmask or 0")
    # (the window alone or with causal, a block mask's mask_mod alone or with causal: with a
    # score transform beside the window, d = 64's EVEN builds at min_blocks 1 went from <= 128
    # registers, 2 blocks an SM, to 132-145, one: not given it)
    window = variant.window and variant.features <= _traits.FWD_SM90_PERSIST_FEATURES
    bmask = variant.block_mask and variant.features <= _traits.FWD_SM90_PERSIST_BLOCK_MASK
    if not ((window and value in ("1", "window")) or (bmask and value in ("1", "bmask"))):
        return t
    if why is not None:
        why.append("lean: " + ("the window's fixed costs a block and a tile cut (short batch offsets, "
                               "K/V pointers advanced a tile, one bound's mask a tile" if window else
                               "the short batch offsets of a block-mask query tile")
                   + ": CUFLASH_FWD90_LEAN)")
    return t.replace(lean=1)


def bmask_list_read(t, variant, why: list | None = None):
    """fwd_sm90's traits ``t`` with a block mask's lean build (``lean`` 1, :func:`window_lean`)
    kept as session 11 compiled it (``lean`` 3) where ``CUFLASH_FWD90_BMASK_EARLY`` (plan time)
    is "0"; "1": ``lean`` 1, whose loop reads the list entry two visits ahead at the top of a
    key tile instead of after S's wgmma's are issued (session 12: there ptxas put the load
    inside the softmax and scheduled the exponentials back to back, O's rescale and P's
    conversion after them; prefix-LM at d 64 ran ~6% slower a key tile than plain causal's
    build, bench/NOTES.md "the block-mask forward's list read (session 12)"). Unset (the
    default): "1" where the head-dim bucket is 64, "0" above it, as session 12's H200 run
    measured (bench/probes/bmask_early.py, new / old: d 64 prefix 4k 1.062 (1.020x Flex), window
    1.063, documents 1.003, prefix 16k 1.025, documents 16k 1.035; d 128 documents 4k 0.926,
    prefix 0.993, window 1.008)."""
    value = os.environ.get("CUFLASH_FWD90_BMASK_EARLY", "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"CUFLASH_FWD90_BMASK_EARLY={value!r}: expected 1 or 0")
    if not (variant.block_mask and t["lean"] == 1):
        return t
    if value == "0" or (value == "" and t.head_dim > 64):
        return t.replace(lean=3)
    if why is not None:
        why.append("the list entry read at the top of a key tile (CUFLASH_FWD90_BMASK_EARLY)")
    return t


def item_tiles(Lq: int, Lk: int, block_m: int, block_n: int, causal: bool, causal_offset: int,
               window=None):
    """The key tiles fwd_sm90ws's Q tile ``m`` visits, for m = 0 .. ceil(Lq / block_m) - 1
    (NumPy int64): ``[j0, n_blocks)`` as the kernel computes it from the Variant's key_begin /
    key_end (causal up to the last row's diagonal, a window from the first row's far edge)."""
    import numpy
    m0 = numpy.arange(-(-Lq // block_m), dtype=numpy.int64) * block_m
    end = numpy.full_like(m0, Lk)
    if causal:
        end = numpy.minimum(end, m0 + block_m + causal_offset)
    begin = numpy.zeros_like(m0)
    if window is not None:
        diag = Lk - Lq   # (the window is on the bottom-right diagonal)
        left, right = window
        if right is not None:
            end = numpy.minimum(end, m0 + block_m + diag + right)
        if left is not None:
            begin = numpy.maximum(0, m0 + diag - left) // block_n
    n_blocks = numpy.where(end > 0, -(-end // block_n), 0)
    return numpy.maximum(0, n_blocks - begin)


def lpt_schedule(tiles, nbatch: int, order: int, grid: int):
    """fwd_sm90ws's PERSIST 3 schedule (session 17, written without a GPU): each of ``grid``
    blocks' list of (batch item, Q tile) items, by longest-processing-time-first (the items
    heaviest first, each to the block with the least work so far; a block's items in that
    order), an item's work its key tiles + 1 (its Q load and epilogue, about a tile's time).
    ``tiles``: :func:`item_tiles`; items are numbered as the kernel's block_tile does
    (``grid_order`` ``order``: 1 tile-major, 0 batch-major; tile t is Q tile ntiles - 1 - t).
    Returns int32 [offsets of the grid + 1 lists..., the lists...]: block b's items are
    ``out[grid + 1 + out[b] : grid + 1 + out[b + 1]]``. Every item appears once."""
    import heapq

    import numpy
    tiles = numpy.asarray(tiles, numpy.int64)
    ntiles = len(tiles)
    idx = numpy.arange(nbatch * ntiles, dtype=numpy.int64)
    t = idx // nbatch if order == 1 else idx % ntiles
    work = tiles[ntiles - 1 - t] + 1
    lists = [[] for _ in range(grid)]
    heap = [(0, b) for b in range(grid)]
    for i in idx[numpy.argsort(-work, kind="stable")].tolist():
        load, b = heap[0]
        lists[b].append(i)
        heapq.heapreplace(heap, (load + int(work[i]), b))
    offsets = numpy.cumsum([0] + [len(x) for x in lists])
    return numpy.concatenate([offsets, numpy.fromiter((i for x in lists for i in x), numpy.int64,
                                                       len(idx))]).astype(numpy.int32)
