#!/usr/bin/env python3
"""Question (session 11, issue 10): do the tile-major grid order (for a block mask without
causal, forward and backward: ``CUFLASH_BMASK_TILE_MAJOR=both``) and dQ's additions in rows
(bwd_sm90's block-mask builds: ``CUFLASH_BWD90_DQ_ROWS=1``) -- both session 11's, both off by
default until this probe has run on an H200 -- bring prefix-LM at L 4k to
FlexAttention, forward and fwd+bwd, d 64 and 128? (Session 10 asked whether bwd_sm90 with the
mask as bits beat bwd_sm80; bench/NOTES.md "The prefix-LM block mask at 4k: tile-major order
and dQ in rows (session 11)".)

    PYTHONPATH=. python bench/probes/bmask_bwd128.py [--json out.json] [--d 64,128]
        [--L 4096] [--L16 prefix] [--flex-L 4096] [--flex-fwd prefix] [--masks document,prefix]
        [--no-flex]
    PYTHONPATH=. python bench/probes/bmask_bwd128.py --model     # no GPU: the makespan model

One process, the mods suite's shapes (bf16, B = 16384 / L, H = 2048 / d) and mask_mods
(bench/suite_mods.py: 8 causal documents with ``causal=True``, prefix-LM without; ``window``
also takes the sliding window of 1024), each through one ``cuflash.block_mask`` of 128 x 128
(built once per point, as a user reuses it). Points: every mask at every d and --L, and the
masks of --L16 at 16k too (only prefix-LM's order changed: documents are causal, tile-major
already). Each point times, CUDA-event medians:

- ``fwd`` / ``fwd_tm``: the forward alone, batch-major (session 10's order,
  ``CUFLASH_BMASK_TILE_MAJOR=none``) / tile-major (``both``: the heaviest query tile of
  every batch item first);
- ``old``: fwd+bwd as session 10 ran it (``CUFLASH_BMASK_TILE_MAJOR=none``, both batch-major;
  ``CUFLASH_BWD90_DQ_ROWS=0``, dQ added through red_add2: machine code identical to 20120b4's);
- ``tm``: both tile-major, the default since session 12's run of this probe (what session 10's ``new_tm`` arm measured with
  ``CUFLASH_GRID_ORDER=1``), dQ as in ``old``;
- ``new``: ``tm`` with dQ's rows added by bwd_io::red_row_pairs (one base
  address a row, 8 unconditional vector reds: no per-pair branch regions);
- ``flex`` / ``flex_fwd``: ``torch.compile``d FlexAttention fwd+bwd / forward with its own
  block mask, as suite_mods times it (at the lengths of --flex-L; the forward for the masks of
  --flex-fwd; unless --no-flex). Session 11's suite run (FINDINGS, 19:30) has Flex's forward
  at every point: documents 4k 192 (d 128) / 155 (d 64), prefix 4k 372 / 349.

``tm`` runs ``old``'s kernels (the order is a launch parameter); ``new``'s backward is its own
build.
TFLOP/s on visible pairs (fwd+bwd 3.5 x the forward's 4 B H d pairs, the backward 2.5 x;
``bwd alone`` = fwd+bwd minus the forward in the arm's order). The switch is read at plan time;
``bench_attention.env`` clears the plan cache around each arm. Prints one line per point and
rewrites ``{"meta", "rows"}`` to --json after every point (each cuflash row names the backward
family the dispatcher picked: ``bwd_family``). Kernels compile first, in threads (NVRTC; CuPy's
disk cache), while FlexAttention's torch.compile runs in the main thread.

``--model``: per point, the backward kernel's makespan in batch-major and tile-major order,
longest-first and the bound (total work / 132 SMs), one block an SM, block = F + t x its query
tiles (t: plain bwd_sm90's per-tile time, F: a block's fixed cost; session 10's fit): what the
order alone is worth.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

_BASE = {"CUFLASH_BWD90_BLOCK_MASK": None, "CUFLASH_BWD90_BMASK_ROWS": None,
         "CUFLASH_GRID_ORDER": None}
#: fwd+bwd arms (read at plan time; the grid order is a launch parameter, dQ's rows a build)
ARMS = {"old": dict(_BASE, CUFLASH_BMASK_TILE_MAJOR="none",      # session 10's code exactly
                    CUFLASH_BWD90_DQ_ROWS="0"),
        "tm": dict(_BASE, CUFLASH_BMASK_TILE_MAJOR="both",       # + tile-major (s10's new_tm)
                   CUFLASH_BWD90_DQ_ROWS="0"),
        "new": dict(_BASE, CUFLASH_BMASK_TILE_MAJOR="both",      # + dQ's rows (session 11's
                    CUFLASH_BWD90_DQ_ROWS="1")}                  # two, off by default)
#: forward-alone arms, and the one in each fwd+bwd arm's order (its ``bwd alone``)
FWD_ARMS = {"fwd": ARMS["old"], "fwd_tm": ARMS["new"]}
FWD_OF = {"old": "fwd", "tm": "fwd_tm", "new": "fwd_tm"}
_MASKS: dict = {}
SMS = 132
#: the model's per-block cost, us (session 10's fit, bench/NOTES.md): t a query tile (plain
#: bwd_sm90's: 64 x 128 at d = 128, 128 x 128 at d = 64), F a block's fixed cost
MODEL_T = {128: 4.09, 64: 4.5}
MODEL_F = {128: 8.0, 64: 6.0}


def query_tiles(name: str, d: int, L: int) -> list[int]:
    """The query tiles bwd_sm90's block of key tile j visits (its transpose list), j = 0.. for
    the suite's mask at length L (128-key tiles; 64 query rows at d = 128, 128 at d = 64)."""
    bm, bn = (64 if d == 128 else 128), 128
    out = []
    for j in range(L // bn):
        k0 = j * bn
        if name == "prefix":      # keys < L / 4: every query; after: the queries >= the key
            out.append(L // bm if k0 + bn <= L // 4 else (L - k0) // bm)
        elif name == "document":  # causal within each of 8 documents
            end = (k0 // (L // 8) + 1) * (L // 8)
            out.append((end - k0) // bm)
        else:
            raise ValueError(name)
    return out


def makespan(costs) -> float:
    """Blocks dispatched in grid order to the first free SM (one block an SM)."""
    import heapq
    free = [0.0] * SMS
    for c in costs:
        heapq.heappush(free, heapq.heappop(free) + c)
    return max(free)


def model(name: str, d: int, L: int) -> dict:
    """The backward kernel's makespan (us) in batch-major (bm), tile-major (tm) and
    longest-first (lpt) order, and the bound (work / SMs)."""
    heads = max(1, 16384 // L) * (2048 // d)
    per = query_tiles(name, d, L)
    cost = [MODEL_F[d] + MODEL_T[d] * n for n in per]
    bm = [c for _ in range(heads) for c in cost]
    tm = [c for c in cost for _ in range(heads)]
    return {"bm": makespan(bm), "tm": makespan(tm), "lpt": makespan(sorted(bm, reverse=True)),
            "bound": sum(bm) / SMS, "blocks": len(bm), "tiles": heads * sum(per),
            "longest": max(cost)}


def print_model() -> None:
    print(f"{'mask':9} {'d':>4} {'L':>6} {'blocks':>7} {'tiles':>7}  {'bm':>7} {'tm':>7} {'lpt':>7}"
          f" {'bound':>7}  tm-bm   (us, 132 SMs; block = F + t x tiles)")
    for name in ("prefix", "document"):
        for d in (128, 64):
            for L in (4096, 16384):
                m = model(name, d, L)
                print(f"{name:9} {d:4} {L:6} {m['blocks']:7} {m['tiles']:7}  {m['bm']:7.0f}"
                      f" {m['tm']:7.0f} {m['lpt']:7.0f} {m['bound']:7.0f}  {m['tm'] - m['bm']:6.0f}")


def _spec(name, L, H):
    """(the suite's Mod, cuflash's keywords) of "document", "prefix" or "window"; the block mask
    built once per (name, L)."""
    import cuflash
    import suite_mods
    mod = suite_mods.mods_for(L, H)[name]
    if (name, L) not in _MASKS:
        _MASKS[name, L] = cuflash.block_mask(mod.mask_mod, (1, 1), L, L)
    return mod, {"block_mask": _MASKS[name, L], "causal": mod.mask_causal}


def _bwd_family(kw, nbatch, L, d) -> str:
    """The backward family (its query rows a tile, its grid order, dQ in rows or not) the
    dispatcher picks for this point under the current switches."""
    from cuflash import _families, _plan, _trace, _trace_cuda
    from cuflash._variant import Variant
    tr = _trace.trace_mask_mod(kw["block_mask"].mask_mod)
    v = Variant(causal=kw["causal"], mask_mod=_trace_cuda.qualified_name(tr), block_mask=True,
                prelude=tr.source)
    shape = _families.Shape("bfloat16", nbatch, L, L, d, d, v)
    c = _families.choose("bwd", shape, _families.device_info(0))
    if _families.block_mask_bwd_spilled(c, shape, 0):
        c = _families.choose("bwd", shape, _families.device_info(0))
    import types
    from cuflash._variant import _dq_bounds
    rows = not _dq_bounds(types.SimpleNamespace(d=d, dv=d),
                          types.SimpleNamespace(block_mask=kw["block_mask"]))
    return (f"{c.family.name} B_r={c.traits.block_m} order={_plan.grid_order(c, kw['causal'], True)}"
            f" dq_rows={int(rows and c.family.name == 'bwd_sm90')}")


def _warm(points, flex_warm) -> None:
    """Every kernel compiled first, on the timed shapes (zeros), a point a thread (NVRTC runs
    outside the GIL; the arms share the kernels); ``flex_warm`` in this thread meanwhile."""
    import functools
    import cupy
    import cuflash
    import suite_mods
    from suite_common import bf16_zeros, warm_arms

    def one(d, L, name, H):
        q, k, v = (bf16_zeros((max(1, suite_mods.TOKENS // L), H, L, d)) for _ in range(3))
        kw = _spec(name, L, H)[1]
        cuflash.attention_vjp(q, k, v, **kw)[1](cupy.ones_like(q))

    for name, L, d in points:              # the block masks (NumPy), before the threads
        _spec(name, L, suite_mods.WIDTH // d)
    warm_arms(("old", "new"), ARMS,      # (tm runs old's kernels)
              [functools.partial(one, d, L, name, suite_mods.WIDTH // d) for name, L, d in points],
              flex_warm, workers=8)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json")
    ap.add_argument("--d", default="64,128")
    ap.add_argument("--L", default="4096")
    ap.add_argument("--L16", default="prefix", help="masks also run at L 16384 ('' for none)")
    ap.add_argument("--flex-L", default="4096", help="lengths FlexAttention runs at")
    ap.add_argument("--flex-fwd", default="prefix",
                    help="masks whose FlexAttention forward is timed too ('' for none)")
    ap.add_argument("--masks", default="document,prefix", help="of document, prefix, window")
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--model", action="store_true", help="the makespan model only (no GPU)")
    a = ap.parse_args(argv)
    if a.model:
        print_model()
        return 0
    import cupy
    import ml_dtypes
    import numpy
    import cuflash
    import bench_attention
    import suite_mods
    from suite_common import compile_flex, median_event_ms
    torch = compiled = cbm = None
    if not a.no_flex:
        import torch
        from torch.nn.attention.flex_attention import create_block_mask as cbm
        compiled = compile_flex(torch)
    t_start = time.perf_counter()
    points = [(name, int(L), int(d)) for d in a.d.split(",") for L in a.L.split(",")
              for name in a.masks.split(",")]
    points += [(name, 16384, int(d)) for d in a.d.split(",") for name in a.L16.split(",")
               if name and (name, 16384, int(d)) not in points]
    flex_L = {int(x) for x in a.flex_L.split(",") if x}
    flex_fwd = {x for x in a.flex_fwd.split(",") if x}

    def flex_warm():      # one forward and one fwd+bwd call of every FlexAttention point
        for name, L, d in points:
            if L not in flex_L:
                continue
            H = suite_mods.WIDTH // d
            mask_mod = suite_mods.mods_for(L, H)[name].mask_mod
            leaves = [torch.zeros((max(1, suite_mods.TOKENS // L), H, L, d), dtype=torch.bfloat16,
                                  device="cuda", requires_grad=True) for _ in range(3)]
            fbm = cbm(mask_mod, None, None, L, L, device="cuda")
            if name in flex_fwd:
                with torch.no_grad():
                    compiled(*(x.detach() for x in leaves), score_mod=None, block_mask=fbm)
            o = compiled(*leaves, score_mod=None, block_mask=fbm)
            o.backward(torch.ones_like(o))
        torch.cuda.synchronize()

    _warm(points, flex_warm if compiled is not None else None)
    print(f"# kernels compiled ({time.perf_counter() - t_start:.0f} s)", flush=True)
    print(f"{'mask':9} {'d':>4} {'L':>6}  {'fwd':>14} {'fwd_tm':>14} {'flex_fwd':>14}  |"
          f" {'old fwd+bwd':>14} {'tm':>14} {'new':>14} {'flex':>14}  new/old new/flex"
          f" fwd_tm/flex  bwd alone old/tm/new  (ms/TFLOP/s on visible pairs)", flush=True)
    rows, bf16 = [], numpy.dtype(ml_dtypes.bfloat16)
    for name, L, d in points:
        H, B = suite_mods.WIDTH // d, max(1, suite_mods.TOKENS // L)
        rng = numpy.random.default_rng(L + d)
        q, k, v = (cupy.asarray(rng.standard_normal((B, H, L, d)).astype(bf16)) for _ in range(3))
        do = cupy.ones_like(q)
        mod, kw = _spec(name, L, H)
        fwd_flops = 4 * B * H * d * suite_mods.visible_pairs(mod, L)
        base = dict(mask=name, d=d, L=L)
        got = {}
        for arm, envs in FWD_ARMS.items():
            try:
                with bench_attention.env(**envs):
                    got[arm] = median_event_ms(lambda i: cuflash.attention(q, k, v, **kw), 1, 10, 2)
                rows.append(dict(base, impl=arm, mode="fwd", ms=got[arm],
                                 tflops=fwd_flops / got[arm] / 1e9))
            except Exception as exc:
                rows.append(dict(base, impl=arm, mode="fwd", ms=None, tflops=None,
                                 note=f"{type(exc).__name__}: {str(exc)[:300]}"))
        for arm in ARMS:
            try:
                with bench_attention.env(**ARMS[arm]):
                    ms = median_event_ms(lambda i: cuflash.attention_vjp(q, k, v, **kw)[1](do), 1, 10, 2)
                    fam = _bwd_family(kw, B * H, L, d)
                got[arm] = ms
                row = dict(base, impl=arm, mode="fwd_bwd", ms=ms, tflops=3.5 * fwd_flops / ms / 1e9,
                           bwd_family=fam)
                f = got.get(FWD_OF[arm])
                if f and ms > f:
                    row["bwd_tflops"] = 2.5 * fwd_flops / (ms - f) / 1e9
                rows.append(row)
            except Exception as exc:    # a failing arm is a row, not the end of the run
                rows.append(dict(base, impl=arm, mode="fwd_bwd", ms=None, tflops=None,
                                 note=f"{type(exc).__name__}: {str(exc)[:300]}"))
        if compiled is not None and L in flex_L:        # as suite_mods times it
            for mode, key, flops in (("fwd", "flex_fwd", fwd_flops),
                                     ("fwd_bwd", "flex", 3.5 * fwd_flops)):
                if mode == "fwd" and name not in flex_fwd:
                    continue
                (row,) = suite_mods._flex_point(torch, compiled, cbm, mod, mode, d, L, B, H,
                                                [(q, k, v)], None, flops)
                got[key] = row["ms"]
                rows.append(dict(base, impl="flex", mode=mode, ms=row["ms"], tflops=row["tflops"],
                                 **({"note": row["note"]} if "note" in row else {})))

        def cell(x):
            ms = got.get(x)
            f = fwd_flops if x in ("fwd", "fwd_tm", "flex_fwd") else 3.5 * fwd_flops
            return f"{ms:6.3f}/{f / ms / 1e9:6.1f}" if ms else f"{'-':>13}"

        def bwd(x):
            ms, f = got.get(x), got.get(FWD_OF[x])
            return f"{2.5 * fwd_flops / (ms - f) / 1e9:6.1f}" if ms and f and ms > f else f"{'-':>6}"

        def ratio(x, y):
            return got[y] / got[x] if got.get(x) and got.get(y) else 0
        print(f"{name:9} {d:4} {L:6}  {cell('fwd'):>14} {cell('fwd_tm'):>14} {cell('flex_fwd'):>14}  |"
              f" {cell('old'):>14} {cell('tm'):>14} {cell('new'):>14} {cell('flex'):>14}"
              f"  {ratio('new', 'old'):7.3f} {ratio('new', 'flex'):8.3f} {ratio('fwd_tm', 'flex_fwd'):8.3f}"
              f"  {bwd('old'):>8} / {bwd('tm')} / {bwd('new')}", flush=True)
        dump(a.json, rows, complete=False)
        del q, k, v, do
        cupy.get_default_memory_pool().free_all_blocks()
    print(f"# {time.perf_counter() - t_start:.0f} s", flush=True)
    dump(a.json, rows, complete=True)
    return 0


def dump(path, rows, complete: bool) -> None:
    """--json's file, rewritten after every point (``meta.complete`` false until the end)."""
    if path:
        pathlib.Path(path).write_text(json.dumps({"meta": {"probe": "bmask_bwd128", "session": 11,
                                                           "dtype": "bfloat16", "arms": ARMS,
                                                           "fwd_arms": FWD_ARMS,
                                                           "complete": complete},
                                                  "rows": rows}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
