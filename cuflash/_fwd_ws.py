"""The warp-specialised Hopper forward's dispatch (``fwd_sm90ws``, cuda_src/fwd_sm90ws.cu): when
the registry's first forward family takes a problem, with which tiles, and the builds the compile
gate instantiates.

Where (session 16, ``bench/probes/fwd_ws.py``, ``bench/results/h200/fwd_ws.json``: H200, bf16,
TFLOP/s of fwd_sm90ws over fwd_sm90's in one process): at d 128 faster at every point (plain
1.41-1.51, causal 1.26-1.30, window 1024 1.12-1.20, softcap 1.39 at L 1k-16k); at d 64 faster
where a block walks many key tiles (plain 4k 1.16, 16k 1.27, causal 4k 1.03, 16k 1.24) and
slower where it walks few (causal 1k 0.80; plain 1k 1.02) or for the window (0.85-0.93: its
blocks of 192 rows walk 9-10 key tiles), where fwd_sm90's two blocks an SM overlap one's
prologue with the other's loop. So by default: a grid that fills the SMs and, at d 64, no window
and at least ``D64_MIN_TILES`` key tiles a block on average. ``CUFLASH_FWD90_WS=1`` takes every
problem it can run, ``0`` none (``CUFLASH_FWD=sm90ws`` starts the search there, as ``1``)."""

from __future__ import annotations

import os

from . import _traits
from ._fwd_schedule import fwd_sm90_grid

#: the Variants' modifiers the kernel runs: the analytic masks and the per-element transforms
#: without an array of scores (a dense bias / mask and the user functions stay on fwd_sm90,
#: whose register budgets for them were measured; a block mask needs fwd_sm90's list walk)
WS_FEATURES = frozenset({"causal", "window", "softcap", "alibi_slopes", "sink"})
#: at d 64, the mean key tiles (of 128 keys) a block visits from which fwd_sm90ws is the default
D64_MIN_TILES = 16
#: the head-dim buckets with a persistent build (session 17): at d 64 the 3 consumers' 160
#: registers are full, and the item loop's two counters spilled 16-64 bytes (ptxas, NVRTC 13)
PERSIST_BUCKETS = frozenset({128})
#: the mean key tiles an item (a block's Q tile) visits up to which any Variant runs persistent
PERSIST_SHORT_TILES = 8


def ws_switch() -> str:
    """``"1"`` (everywhere it runs), ``"0"`` (nowhere) or ``"auto"`` (the measured rule)."""
    value = os.environ.get("CUFLASH_FWD90_WS", "").strip().lower() or "auto"
    if value not in ("0", "1", "auto"):
        raise ValueError(f"CUFLASH_FWD90_WS={value!r}: expected 0, 1 or auto")
    from ._families import family_override
    return "1" if family_override("fwd") == "sm90ws" else value


def default_declines(shape, t, dev) -> str | None:
    """Why the measured rule keeps ``shape`` on fwd_sm90 (None: it takes fwd_sm90ws)."""
    if shape.variant.window and t.head_dim == 64:
        return "the window at d = 64 measured 0.85-0.93x fwd_sm90's"
    blocks = shape.nbatch * -(-shape.Lq // t.block_m)
    if blocks < dev.num_sms:
        return f"{blocks} blocks leave SMs idle (fwd_sm90 takes fewer rows a block)"
    tiles = shape.Lk / t.block_n / (2 if shape.variant.causal else 1)
    if t.head_dim == 64 and tiles < D64_MIN_TILES:
        return (f"{tiles:.0f} key tiles a block on average (< {D64_MIN_TILES}): at d = 64 "
                "fwd_sm90's two blocks an SM measured faster")
    return None


def fwd_sm90ws_select(fam, shape, dev):
    """(traits, flags, reasons) of ``shape``, or the reason fwd_sm90ws does not take it."""
    switch = ws_switch()
    if switch == "0":
        return "off (CUFLASH_FWD90_WS=0)"
    bucket = -(-shape.dmax // 64) * 64
    if bucket not in _traits.FWD_SM90WS:
        return f"no tiles for head-dim bucket {bucket} (_traits.FWD_SM90WS: {sorted(_traits.FWD_SM90WS)})"
    if shape.variant.block_mask:
        return "a block mask's list walk is fwd_sm90's"
    extra = shape.variant.features - WS_FEATURES
    if extra:
        return f"does not run {', '.join(sorted(extra))} (fwd_sm90's measured register budgets do)"
    from ._families import _table_traits
    t = _table_traits(fam, bucket, bucket)
    even = shape.Lk % t.block_n == 0 and shape.d == bucket and shape.dv == bucket
    v = shape.variant
    if (bucket == 64 and (v.softcap or (v.alibi_slopes and not v.alibi_raw))
            and not softcap_d64_spill_free(v, even)):
        # (the compile gate: 8 bytes for the softcap's predicated build, 16 for its causal
        # ones, 24 for ALiBi's CUFLASH_ALIBI_RAW=0 build, at 3 consumers' 160 registers)
        return "its d = 64 build of these modifiers spills (3 consumers, 160 registers)"
    if t.smem_bytes > dev.smem_optin:
        return f"needs {t.smem_bytes} B of shared memory a block, the device grants {dev.smem_optin}"
    if switch == "auto":
        declined = default_declines(shape, t, dev)
        if declined:
            return declined + " (CUFLASH_FWD90_WS=1 takes it)"
    why = [f"head-dim bucket {bucket}: {t.reason}",
           "EVEN=true: whole key tiles and no padded columns" if even else
           "EVEN=false: the last key tile or the head dim is partial (predicated loads)"]
    return persistent(t, shape, dev, why), {"even": even}, why


def softcap_d64_spill_free(v, even: bool) -> bool:
    """Whether the d = 64 build (3 consumers, 160 registers) of Variant ``v`` is the softcap's
    one that compiles without local memory (session 19, NVRTC 13, sm_90a, float16 and bfloat16,
    the softcap's fixed-offset build): the softcap alone on whole key tiles (EVEN); the
    predicated build spills 8 bytes, the causal ones 16. Measured (session 20,
    ``probes/fwd_ws.py --d 64 --L 4096,16384 --softcap-d64 --rounds 5``, H200, bf16, softcap 50,
    ``fwd_ws_softcap_d64.json``): 348.0 / 377.9 TFLOP/s against fwd_sm90's 334.3 / 344.8 at 4k /
    16k (1.04 / 1.10), so the rule takes it where it takes d = 64 plain attention
    (:func:`default_declines`: a full grid, >= 16 key tiles a block)."""
    return v.features == {"softcap"} and even


def persist_switch() -> str:
    """``CUFLASH_FWD90WS_PERSIST`` (plan time): "0" (one block a query tile), "1" / "2" / "3" (a
    persistent grid, items round-robin / zigzag / by the host's longest-processing-time-first
    lists, ``_fwd_schedule.lpt_schedule``: the window's default since session 18) wherever
    the grid has fewer blocks than items, or "auto" (the default: :func:`persist_default`)."""
    value = os.environ.get("CUFLASH_FWD90WS_PERSIST", "").strip().lower() or "auto"
    if value not in ("0", "1", "2", "3", "auto"):
        raise ValueError(f"CUFLASH_FWD90WS_PERSIST={value!r}: expected 0, 1, 2, 3 or auto")
    return value


def persist_default(shape, t) -> int:
    """The persistent schedule the measured rule gives ``shape`` (0: none). Session 17's probe
    (``bench/probes/fwd_ws.py --persist``, ``fwd_ws_persist.json``; H200, bf16, d 128, TFLOP/s
    over one block a tile, medians of 3 rounds): the window (items of equal length) 1.02 (4k) /
    1.06 (16k) zigzag; items of few key tiles 1.07 (plain 1k, 8 tiles) / 1.11 (causal 1k, 4 on
    average) round-robin; the softcap without causal 1.07 (4k) round-robin. Causal items of
    many tiles lose (4k 0.93-0.97, 16k 0.90-0.92; ALiBi 16k 0.93-0.96): the static schedule
    balances unequal items worse than the hardware's block scheduler, which hands the next
    block (heaviest first) to the first SM free; plain 4k / 16k gain nothing (1.00 / 0.99).
    Session 18 (``fwd_ws_persist_s18.json``, 5 rounds): the window takes the host's lists (3),
    +1.9 / +0.8 / +1.1% over zigzag at 4k / 8k / 16k (its items are equal, so the lists are a
    round-robin whose blocks start on the interior tiles and end on the short first ones); for
    causal items of many tiles they lose as the static schedules do (8k 0.96, 16k 0.92)."""
    v = shape.variant
    if v.window:
        return 3
    tiles = shape.Lk / t.block_n / (2 if v.causal else 1)
    return 1 if tiles <= PERSIST_SHORT_TILES or (v.softcap and not v.causal) else 0


def persistent(t, shape, dev, why: list):
    """``t`` with its ``persist`` schedule (a block runs (batch item, Q tile) items in turn:
    fwd_sm90ws.cu, PERSIST) where :func:`persist_switch` asks for it, the grid
    (``_fwd_schedule.fwd_sm90_grid``: an SM's block, or ``CUFLASH_FWD90_PERSIST_GRID``) holds
    fewer blocks than items and the second Q buffer fits; a ``persist`` from CUFLASH_TILES stays."""
    switch = persist_switch()
    mode = t["persist"] or (0 if switch == "0" else persist_default(shape, t) if switch == "auto"
                            else int(switch))
    if t.head_dim not in PERSIST_BUCKETS:
        mode = 0
    items = shape.nbatch * -(-shape.Lq // t.block_m)
    p = t.replace(persist=mode)
    if not mode or p.smem_bytes > dev.smem_optin or items <= fwd_sm90_grid(p, items, dev):
        return t.replace(persist=0)
    how = {1: "round-robin", 2: "zigzag", 3: "longest first, the host's lists"}[mode]
    why.append(f"persistent ({how}): {fwd_sm90_grid(p, items, dev)} "
               f"blocks run the {items} query tiles in turn, each one's Q and first K/V loaded "
               "during the one before (CUFLASH_FWD90WS_PERSIST)")
    return p


def fwd_sm90ws_instances(fam, arch):
    for t in _traits.FWD_SM90WS.values():
        for persist in (0, 1, 2, 3) if t.head_dim in PERSIST_BUCKETS else (0,):
            for even in (False, True):
                yield t.replace(persist=persist), {"even": even}


TEMPLATE = ("cuflash::sm90::fwd_sm90ws<{T}, {head_dim}, {block_n}, {consumers}, {stages}, "
            "{pingpong}, {poly}, {variant}, {even}{persist}>")
SMEM = "cuflash::sm90::WsTraits<{T}, {head_dim}, {block_n}, {consumers}, {stages}{persist}>::kSmemBytes"
SUMMARY = "Hopper wgmma forward, warp-specialised (a cp.async producer warpgroup, mbarriers)"
