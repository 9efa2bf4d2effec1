#!/usr/bin/env python3
"""Question (session 10, issue 10): with a block mask, does the d = 128 backward on bwd_sm90
(its mask_mod as bits on the plain path, the new default) beat bwd_sm80 (the default until
session 10), and does fwd+bwd reach FlexAttention? (``--d 64``: the same path in 128-row tiles
against session 9's per-element path in 64-row ones.) (bench/NOTES.md "The d = 128 block-mask
backward on bwd_sm90 (session 10)".)

    PYTHONPATH=. python bench/probes/bmask_bwd128.py [--json out.json] [--L 4096,16384]
        [--masks document,prefix] [--d 128] [--no-flex]

One process, the mods suite's shapes (bf16, B = 16384 / L, H = 2048 / d) and mask_mods
(bench/suite_mods.py: 8 causal documents with ``causal=True``, prefix-LM without; ``window``
also takes the sliding window of 1024), each through one ``cuflash.block_mask`` of 128 x 128
(built once per point, as a user reuses it). Each point times, CUDA-event medians:

- ``old``: fwd+bwd with session 9's backward: ``CUFLASH_BWD90_BLOCK_MASK=0`` (d = 128:
  bwd_sm80) and ``CUFLASH_BWD90_BMASK_ROWS=64`` (d = 64: bwd_sm90's per-element path in
  64-row tiles);
- ``new``: fwd+bwd with the defaults (bwd_sm90, the mask as bits on the plain path: 64-row
  tiles at d = 128, 128-row tiles at d = 64);
- ``new_tm``: ``new`` in tile-major grid order (``CUFLASH_GRID_ORDER=1``, forward and backward:
  what a causal call gets; prefix-LM's call is not causal, so batch-major by default);
- ``fwd``: the forward alone (the same kernel in both arms), so that the backward's share,
  fwd+bwd minus fwd, is printed for old and new (``bwd_tflops``);
- ``flex``: ``torch.compile``d FlexAttention fwd+bwd with its own block mask, as suite_mods
  times it (unless --no-flex).

TFLOP/s on visible pairs (fwd+bwd 3.5 x the forward's 4 B H d pairs, the backward 2.5 x). The
switch is read at plan time; ``bench_attention.env`` clears the plan cache around each arm.
Prints one line per point and rewrites ``{"meta", "rows"}`` to --json after every point (each
cuflash row names the backward family the dispatcher picked: ``bwd_family``). Every kernel is
compiled first, in threads (NVRTC; CuPy's disk cache), while FlexAttention's torch.compile runs
in the main thread; a fresh machine may pass 90 s on a first run, a second is then the timed one.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

ARMS = {"old": {"CUFLASH_BWD90_BLOCK_MASK": "0", "CUFLASH_BWD90_BMASK_ROWS": "64",
                "CUFLASH_GRID_ORDER": None},
        "new": {"CUFLASH_BWD90_BLOCK_MASK": None, "CUFLASH_BWD90_BMASK_ROWS": None,
                "CUFLASH_GRID_ORDER": None},
        # new in tile-major grid order (the order causal calls get): key tile 0 of every head
        # first, so prefix-LM's long blocks (the keys every query sees) start in the first
        # waves instead of the last head's ending the kernel alone (its non-causal call is
        # batch-major); no new kernel, the order is a launch parameter
        "new_tm": {"CUFLASH_BWD90_BLOCK_MASK": None, "CUFLASH_BWD90_BMASK_ROWS": None,
                   "CUFLASH_GRID_ORDER": "1"}}
_MASKS: dict = {}


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
    """The backward family (and its query rows a tile) the dispatcher picks for this point
    under the current switches."""
    from cuflash import _families, _trace, _trace_cuda
    from cuflash._variant import Variant
    tr = _trace.trace_mask_mod(kw["block_mask"].mask_mod)
    v = Variant(causal=kw["causal"], mask_mod=_trace_cuda.qualified_name(tr), block_mask=True,
                prelude=tr.source)
    shape = _families.Shape("bfloat16", nbatch, L, L, d, d, v)
    c = _families.choose("bwd", shape, _families.device_info(0))
    if _families.block_mask_bwd_spilled(c, shape, 0):
        c = _families.choose("bwd", shape, _families.device_info(0))
    return f"{c.family.name} B_r={c.traits.block_m}"


def _warm(points, flex_warm) -> None:
    """Every arm's kernels compiled first, on the timed shapes (zeros), a point a thread (NVRTC
    runs outside the GIL; the switch is process-wide, so the arms one after the other);
    ``flex_warm`` in this thread meanwhile."""
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
    warm_arms(("old", "new"), ARMS,      # (new_tm runs new's kernels)
              [functools.partial(one, d, L, name, suite_mods.WIDTH // d) for name, L, d in points],
              flex_warm, workers=8)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json")
    ap.add_argument("--d", default="128")
    ap.add_argument("--L", default="4096,16384")
    ap.add_argument("--masks", default="document,prefix", help="of document, prefix, window")
    ap.add_argument("--no-flex", action="store_true")
    a = ap.parse_args(argv)
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

    def flex_warm():      # one fwd+bwd call of every FlexAttention point: its compiles
        for name, L, d in points:
            H = suite_mods.WIDTH // d
            mask_mod = suite_mods.mods_for(L, H)[name].mask_mod
            leaves = [torch.zeros((max(1, suite_mods.TOKENS // L), H, L, d), dtype=torch.bfloat16,
                                  device="cuda", requires_grad=True) for _ in range(3)]
            fbm = cbm(mask_mod, None, None, L, L, device="cuda")
            o = compiled(*leaves, score_mod=None, block_mask=fbm)
            o.backward(torch.ones_like(o))
        torch.cuda.synchronize()

    _warm(points, flex_warm if compiled is not None else None)
    print(f"# kernels compiled ({time.perf_counter() - t_start:.0f} s)", flush=True)
    print(f"{'mask':9} {'d':>4} {'L':>6}  {'old fwd+bwd':>15} {'new fwd+bwd':>15} {'new_tm':>15}"
          f" {'flex fwd+bwd':>15}  new/old new/flex  bwd alone old / new / new_tm"
          f"   (ms / TFLOP/s on visible pairs)", flush=True)
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
        try:
            got["fwd"] = median_event_ms(lambda i: cuflash.attention(q, k, v, **kw), 1, 10, 2)
            rows.append(dict(base, impl="new", mode="fwd", ms=got["fwd"], tflops=fwd_flops / got["fwd"] / 1e9))
        except Exception as exc:
            rows.append(dict(base, impl="new", mode="fwd", ms=None, tflops=None,
                             note=f"{type(exc).__name__}: {str(exc)[:300]}"))
        for arm in ARMS:
            try:
                with bench_attention.env(**ARMS[arm]):
                    ms = median_event_ms(lambda i: cuflash.attention_vjp(q, k, v, **kw)[1](do), 1, 10, 2)
                    fam = _bwd_family(kw, B * H, L, d)
                got[arm] = ms
                row = dict(base, impl=arm, mode="fwd_bwd", ms=ms, tflops=3.5 * fwd_flops / ms / 1e9,
                           bwd_family=fam)
                if got.get("fwd") and ms > got["fwd"]:
                    row["bwd_tflops"] = 2.5 * fwd_flops / (ms - got["fwd"]) / 1e9
                rows.append(row)
            except Exception as exc:    # a failing arm is a row, not the end of the run
                rows.append(dict(base, impl=arm, mode="fwd_bwd", ms=None, tflops=None,
                                 note=f"{type(exc).__name__}: {str(exc)[:300]}"))
        if compiled is not None:        # as suite_mods times it
            (row,) = suite_mods._flex_point(torch, compiled, cbm, mod, "fwd_bwd", d, L, B, H,
                                            [(q, k, v)], None, 3.5 * fwd_flops)
            got["flex"] = row["ms"]
            rows.append(dict(base, impl="flex", mode="fwd_bwd", ms=row["ms"], tflops=row["tflops"],
                             **({"note": row["note"]} if "note" in row else {})))

        def cell(x):
            ms = got.get(x)
            return f"{ms:7.3f}/{3.5 * fwd_flops / ms / 1e9:6.1f}" if ms else f"{'-':>14}"

        def bwd(x):
            ms, f = got.get(x), got.get("fwd")
            return f"{2.5 * fwd_flops / (ms - f) / 1e9:6.1f}" if ms and f and ms > f else f"{'-':>6}"
        r_old = got["old"] / got["new"] if got.get("old") and got.get("new") else 0
        r_flex = got["flex"] / got["new"] if got.get("flex") and got.get("new") else 0
        print(f"{name:9} {d:4} {L:6}  {cell('old'):>15} {cell('new'):>15} {cell('new_tm'):>15}"
              f" {cell('flex'):>15}  {r_old:7.2f} {r_flex:8.2f}"
              f"  {bwd('old'):>8} / {bwd('new')} / {bwd('new_tm')}", flush=True)
        dump(a.json, rows, complete=False)
        del q, k, v, do
        cupy.get_default_memory_pool().free_all_blocks()
    print(f"# {time.perf_counter() - t_start:.0f} s", flush=True)
    dump(a.json, rows, complete=True)
    return 0


def dump(path, rows, complete: bool) -> None:
    """--json's file, rewritten after every point (``meta.complete`` false until the end)."""
    if path:
        pathlib.Path(path).write_text(json.dumps({"meta": {"probe": "bmask_bwd128", "dtype": "bfloat16",
                                                           "arms": ARMS, "complete": complete},
                                                  "rows": rows}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
