#!/usr/bin/env python3
"""Question (session 9, issue 10): do block masks at short tile lists (L = 4k) stop losing to
FlexAttention? (bench/NOTES.md "block masks at short lists (session 9) — prediction".)

    PYTHONPATH=. python bench/probes/bmask_short.py [--json out.json] [--d 64,128]
        [--L 4096,16384] [--masks document,prefix,awindow,plain] [--modes fwd,fwd_bwd]
        [--no-flex] [--arms]

One process, the mods suite's shapes (bf16, B = 16384 / L, H = 2048 / d) and mask_mods
(bench/suite_mods.py: 8 causal documents with ``causal=True``, prefix-LM without; ``window``
the sliding window of 1024 as a block mask), each through its ``cuflash.block_mask`` of
128 x 128; ``awindow`` the analytic ``window=(1024, 0)`` and ``plain`` causal attention (issue
10's window target: awindow >= 0.85x plain causal on visible pairs; the session-9 switches do not
touch them, the ``wg1`` arm does); forward (``attention``) and fwd+bwd (``attention_vjp`` +
pullback), CUDA-event medians, TFLOP/s on visible pairs. Each point runs:

- ``old``: ``CUFLASH_FWD90_BMASK_BLOCKS=1`` and ``CUFLASH_BMASK_CAUSAL_KINDS=0`` (session 8's
  choices: fwd_sm90 at 1 block an SM with a mask_mod, lists from the mask_mod's kinds);
- ``new``: the defaults (2 blocks an SM at d = 64 where the build allows it, a causal call's
  lists classified within the causal bound: the documents' diagonal tiles full);
- with ``--arms`` also ``blocks`` (only the 2 blocks), ``kinds`` (only the causal kinds) and
  ``wg1`` (new with the forward in 64-row blocks of one warpgroup, 4 an SM at d = 64 and 2 at
  d = 128, through ``CUFLASH_TILES``: a tile shape for short lists, opt-in);
- ``flex``: ``torch.compile``d FlexAttention with its own block mask (unless --no-flex; not for
  ``plain``).

The switches are read at plan time; ``bench_attention.env`` clears the plan cache around each
arm. Prints one line per point (ms and TFLOP/s, new/old, new/flex) and writes
``{"meta", "rows"}`` to --json (each cuflash row names its forward kernel: ``fwd_kernel``).
Everything is compiled first: the arms' kernels in parallel threads (NVRTC, cached on disk
by CuPy) while FlexAttention's torch.compile runs in the main thread (inductor's cache on disk);
if a first run passes 90 s, a second one is the timed one (``--no-flex`` skips Flex).
"""
from __future__ import annotations

import argparse
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

_OFF = {"CUFLASH_TILES": None}
ARMS = {
    "old": {"CUFLASH_FWD90_BMASK_BLOCKS": "1", "CUFLASH_BMASK_CAUSAL_KINDS": "0", **_OFF},
    "new": {"CUFLASH_FWD90_BMASK_BLOCKS": None, "CUFLASH_BMASK_CAUSAL_KINDS": None, **_OFF},
    "blocks": {"CUFLASH_FWD90_BMASK_BLOCKS": None, "CUFLASH_BMASK_CAUSAL_KINDS": "0", **_OFF},
    "kinds": {"CUFLASH_FWD90_BMASK_BLOCKS": "1", "CUFLASH_BMASK_CAUSAL_KINDS": None, **_OFF},
    # new, with fwd_sm90 in 64-row blocks of one warpgroup: at d = 64 4 an SM (the same 16
    # warps as 2 x 2, each warpgroup its own block: no shared barrier, 8192 blocks; K/V cross
    # from L2 once per 64 query rows instead of 128; 126-128 registers, 0 spills), at d = 128 2
    # an SM (8 warps instead of one 192-row block's 12, but no block straddles two 512-row
    # documents and no warpgroup idles through another's tiles; 150-163 registers, 0 spills;
    # 3 would need 3 x 81 KB of shared memory). EVEN builds of the suite's mask_mods.
    "wg1": {"CUFLASH_FWD90_BMASK_BLOCKS": None, "CUFLASH_BMASK_CAUSAL_KINDS": None,
            "CUFLASH_TILES": "fwd_sm90:64=64:1:4;fwd_sm90:128=64:1:2"},
}


def _spec(name, L, H):
    """(the suite's Mod: visible pairs, cuflash's keywords, FlexAttention's mask_mod or None) of
    one of the probe's masks: "document", "prefix", "window" (the suite's mask_mods through
    ``cuflash.block_mask``), "awindow" (the analytic ``window=(1024, 0)``, causal: the suite's
    window row, the issue's 0.85x-of-plain-causal target; Flex with the window's mask_mod),
    "plain" (causal, no modifier: that target's baseline; no Flex)."""
    import cuflash
    import suite_mods
    mods = suite_mods.mods_for(L, H)
    if name == "awindow":
        return mods["window"], {"window": (suite_mods.WINDOW, 0), "causal": True}, mods["window"].mask_mod
    if name == "plain":
        return mods["plain"], {"causal": True}, None
    mod = mods[name]
    bm = cuflash.block_mask(mod.mask_mod, (1, 1), L, L)
    return mod, {"block_mask": bm, "causal": mod.mask_causal}, mod.mask_mod


def point_forward(name, d, L):
    """One forward call of the mods suite's point (``name`` as ``_spec`` knows it, d, L) on
    zeros of its shapes: that point's compiles, for ``suite_common.warm_arms``."""
    import cuflash
    import suite_mods
    from suite_common import bf16_zeros
    H = suite_mods.WIDTH // d
    q = bf16_zeros((max(1, suite_mods.TOKENS // L), H, L, d))
    cuflash.attention(q, q, q, **_spec(name, L, H)[1])


def _fwd_kernel(kw, nbatch, L, d) -> str:
    """The forward kernel the dispatcher picks for this point under the current switches."""
    from cuflash import _families, _trace, _trace_cuda
    from cuflash._variant import Variant
    if "block_mask" in kw:
        tr = _trace.trace_mask_mod(kw["block_mask"].mask_mod)
        v = Variant(causal=kw["causal"], mask_mod=_trace_cuda.qualified_name(tr), block_mask=True,
                    prelude=tr.source)
    else:
        v = Variant(causal=kw["causal"], window="window" in kw)
    shape = _families.Shape("bfloat16", nbatch, L, L, d, d, v)
    expr = _families.choose("fwd", shape, _families.device_info(0)).expr
    return expr.split(", cuflash::Variant")[0]


def _warm(arms, ds, lengths, masks, modes, flex_warm=None) -> None:
    """Compile every arm's kernels first, the points of one arm in parallel threads (NVRTC
    runs outside the GIL; the switches are process-wide, so the arms one after the other) on the
    timed points' shapes (zeros): the grid decides the tiles and each L traces its own
    mask_mod constants. ``flex_warm`` (FlexAttention's torch.compile of every point) runs in
    this thread while the first arm's kernels compile in the others."""
    import functools
    import cupy
    import cuflash
    import suite_mods
    from suite_common import bf16_zeros as _bf16_zeros, warm_arms

    def one(d, L, name, mode):
        H = suite_mods.WIDTH // d      # the timed points' batch: the grid decides the tiles
        q, k, v = (_bf16_zeros((suite_mods.TOKENS // L, H, L, d)) for _ in range(3))
        kw = _spec(name, L, H)[1]
        if mode == "fwd":
            cuflash.attention(q, k, v, **kw)
        else:
            cuflash.attention_vjp(q, k, v, **kw)[1](cupy.ones_like(q))

    warm_arms(arms, ARMS, [functools.partial(one, d, L, n, m) for d in ds for L in lengths
                           for n in masks for m in modes], flex_warm)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json")
    ap.add_argument("--d", default="64,128")
    ap.add_argument("--L", default="4096,16384")
    ap.add_argument("--masks", default="document,prefix,awindow,plain",
                    help="of document, prefix, window (block masks), awindow, plain")
    ap.add_argument("--modes", default="fwd,fwd_bwd")
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--arms", action="store_true", help="also each switch alone")
    a = ap.parse_args(argv)
    import cupy
    import ml_dtypes
    import numpy
    import suite_mods
    from suite_common import attention_call, compile_flex, time_arm
    torch = compiled = cbm = None
    if not a.no_flex:
        import torch
        from torch.nn.attention.flex_attention import create_block_mask as cbm
        compiled = compile_flex(torch)
    arms = ["old", "new"] + (["blocks", "kinds", "wg1"] if a.arms else [])
    bf16 = numpy.dtype(ml_dtypes.bfloat16)
    rows, t_start = [], time.perf_counter()
    ds, lengths = [int(x) for x in a.d.split(",")], [int(x) for x in a.L.split(",")]
    masks, modes = a.masks.split(","), a.modes.split(",")

    def flex_warm():      # one call of every FlexAttention point: its compiles
        for d in ds:
            H = suite_mods.WIDTH // d
            for L in lengths:
                q, k, v = (torch.zeros((suite_mods.TOKENS // L, H, L, d), dtype=torch.bfloat16,
                                       device="cuda") for _ in range(3))
                for name in masks:
                    mask_mod = _spec(name, L, H)[2]
                    if mask_mod is None:
                        continue
                    fbm = cbm(mask_mod, None, None, L, L, device="cuda")
                    for mode in modes:
                        if mode == "fwd":       # (called as suite_mods._flex_point calls it)
                            with torch.no_grad():
                                compiled(q, k, v, score_mod=None, block_mask=fbm)
                        else:
                            leaves = [x.detach().requires_grad_() for x in (q, k, v)]
                            o = compiled(*leaves, score_mod=None, block_mask=fbm)
                            o.backward(torch.ones_like(o))
                del q, k, v
        torch.cuda.synchronize()

    _warm(arms, ds, lengths, masks, modes, flex_warm if compiled is not None else None)
    print(f"# kernels compiled ({time.perf_counter() - t_start:.0f} s)", flush=True)
    print(f"{'mask':9} {'d':>4} {'L':>6} {'mode':8} " + " ".join(f"{x:>15}" for x in arms + ["flex"])
          + "  new/old new/flex   (ms / TFLOP/s on visible pairs)", flush=True)
    for d in ds:
        H = suite_mods.WIDTH // d
        for L in lengths:
            B = max(1, suite_mods.TOKENS // L)
            rng = numpy.random.default_rng(L + d)
            q, k, v = (cupy.asarray(rng.standard_normal((B, H, L, d)).astype(bf16)) for _ in range(3))
            do = cupy.ones_like(q)
            for name in masks:
                mod, kw, flex_mask = _spec(name, L, H)
                pairs = suite_mods.visible_pairs(mod, L)
                for mode in modes:
                    flops = 4 * B * H * d * pairs * (3.5 if mode == "fwd_bwd" else 1.0)
                    got = {}
                    fn = attention_call(mode, q, k, v, do, kw)
                    for arm in arms:
                        ms, row = time_arm(arm, ARMS[arm], fn, flops,
                                           dict(mask=name, d=d, L=L, mode=mode),
                                           lambda: {"fwd_kernel": _fwd_kernel(kw, B * H, L, d)})
                        rows.append(row)
                        if ms:
                            got[arm] = ms
                    if compiled is not None and flex_mask is not None:   # as suite_mods times it
                        (row,) = suite_mods._flex_point(torch, compiled, cbm, mod, mode, d, L, B, H,
                                                        [(q, k, v)], None, flops)
                        got["flex"] = row["ms"]
                        rows.append(dict(impl="flex", mask=name, d=d, L=L, mode=mode, ms=row["ms"],
                                         tflops=row["tflops"], **({"note": row["note"]} if "note" in row else {})))

                    def cell(x):
                        ms = got.get(x)
                        return f"{ms:7.3f}/{flops / ms / 1e9:6.1f}" if ms else f"{'-':>15}"
                    r_old = got["old"] / got["new"] if got.get("old") and got.get("new") else 0
                    r_flex = got["flex"] / got["new"] if got.get("flex") and got.get("new") else 0
                    print(f"{name:9} {d:4} {L:6} {mode:8} " + " ".join(cell(x) for x in arms + ["flex"])
                          + f"  {r_old:7.2f} {r_flex:8.2f}", flush=True)
                    dump(a.json, arms, rows, complete=False)
            del q, k, v, do
            cupy.get_default_memory_pool().free_all_blocks()
    print(f"# {time.perf_counter() - t_start:.0f} s", flush=True)
    dump(a.json, arms, rows, complete=True)
    return 0


def dump(path, arms, rows, complete: bool) -> None:
    from suite_common import dump_probe
    dump_probe(path, "bmask_short", {k: ARMS[k] for k in arms}, rows, complete)


if __name__ == "__main__":
    sys.exit(main())
