#!/usr/bin/env python3
"""Question (session 12, issue 10): does fwd_sm90's block-mask loop run faster with its list
entry read at the top of a key tile (``CUFLASH_FWD90_BMASK_EARLY=1``, the new default) than
after S's wgmma's are issued (``0``: session 11's lean build)? Prefix-LM at d 64, L 4k ran at
338 TFLOP/s on visible pairs against FlexAttention's 350 and plain causal's 360 (session 12,
with ``CUFLASH_FWD90_LEAN=1``, ``CUFLASH_BMASK_TILE_MAJOR=both``), ~6% slower a computed key tile
than plain causal with 2% more instructions; ptxas had put the entry's load inside the softmax
and run the exponentials back to back around it (bench/NOTES.md, "the block-mask forward's
list read (session 12)").

    PYTHONPATH=. python bench/probes/bmask_early.py [--json out.json] [--no-flex]
        [--points prefix:64:4096,...] [--flex prefix:64:4096,document:64:4096]

One process, the mods suite's shapes (bf16, B = 16384 / L, H = 2048 / d), forward only (the
switch changes nothing else). Arms ``old`` / ``new`` (both with LEAN=1 and TILE_MAJOR=both, the
session's defaults, so the result does not depend on the merge order); the analytic ``plain``
causal points are plain attention (one arm, the per-tile reference). FlexAttention (as
suite_mods times it) at the ``--flex`` points only (each is a torch.compile). Every new arm's
output is compared with the old arm's (expected bitwise equal: the same entries and the same
arithmetic, only the schedule differs). Prints ms / TFLOP/s on visible pairs, new/old, new/Flex;
writes ``{"meta", "rows"}`` to --json after each point. ~30-50 s on a fresh H200, most of it
compiling (12 builds in 16 threads, Flex's 2 compiles meanwhile).
"""
from __future__ import annotations

import argparse
import functools
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "bench" / "probes")]

_BASE = {"CUFLASH_FWD90_LEAN": "1", "CUFLASH_BMASK_TILE_MAJOR": "both"}
ARMS = {"old": dict(_BASE, CUFLASH_FWD90_BMASK_EARLY="0"),
        "new": dict(_BASE, CUFLASH_FWD90_BMASK_EARLY="1")}
POINTS = ("prefix:64:4096,document:64:4096,window:64:4096,prefix:128:4096,document:128:4096,"
          "window:128:4096,prefix:64:16384,document:64:16384,plain:64:4096,plain:64:16384")


def dump(path, rows, complete: bool) -> None:
    from suite_common import dump_probe
    dump_probe(path, "bmask_early", ARMS, rows, complete)


def _kernel(kw, nbatch, L, d) -> str:
    """The forward build the dispatcher picks under the current switches, without its Variant
    (tiles, then EVEN, PERSIST, LEAN)."""
    from window_short import _fwd_choice
    return _fwd_choice(kw, nbatch, L, d)[0]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json")
    ap.add_argument("--points", default=POINTS, help="name:d:L, comma-separated")
    ap.add_argument("--flex", default="prefix:64:4096,document:64:4096",
                    help="the points with a FlexAttention row (each a torch.compile)")
    ap.add_argument("--no-flex", action="store_true")
    a = ap.parse_args(argv)
    import cupy
    import cuflash
    import suite_mods
    from bmask_short import _spec, point_forward
    from suite_common import attention_call, compile_flex, time_arm, warm_arms
    points = [(n, int(d), int(L)) for n, d, L in (p.split(":") for p in a.points.split(","))]
    flex_points = set() if a.no_flex else {tuple(p.split(":")) for p in a.flex.split(",") if p}
    torch = compiled = cbm = None
    if flex_points:
        import torch
        from torch.nn.attention.flex_attention import create_block_mask as cbm
        compiled = compile_flex(torch)
    rows, t0 = [], time.perf_counter()

    warm_arms(list(ARMS), ARMS, [functools.partial(point_forward, *p) for p in points])
    print(f"# kernels compiled ({time.perf_counter() - t0:.0f} s)", flush=True)
    for name, d, L in points:
        B, H, q, k, v = suite_mods.point_qkv(d, L)
        mod, kw, _ = _spec(name, L, H)
        flops = 4 * B * H * d * suite_mods.visible_pairs(mod, L)
        tf, outs = {}, {}

        def describe(arm):   # under the arm's switches, after its timing: output and kernel
            o = cuflash.attention(q, k, v, **kw).astype(cupy.float32)
            first = outs.setdefault("old", o)
            return dict(max_abs_diff_vs_old=float(cupy.abs(o - first).max()),
                        fwd_kernel=_kernel(kw, B * H, L, d))
        fn = attention_call("fwd", q, k, v, None, kw)
        for arm, env in (ARMS.items() if name != "plain" else [("new", ARMS["new"])]):
            _, row = time_arm(arm, env, fn, flops, dict(mask=name, d=d, L=L, mode="fwd"),
                              functools.partial(describe, arm), iters=20, warmup=3)
            rows.append(row)
            tf[arm] = row["tflops"]
        if compiled is not None and (name, str(d), str(L)) in flex_points:
            (row,) = suite_mods._flex_point(torch, compiled, cbm, mod, "fwd", d, L, B, H,
                                            [(q, k, v)], None, flops)
            tf["flex"] = row["tflops"]
            rows.append(dict(impl="flex", mask=name, d=d, L=L, mode="fwd", ms=row["ms"],
                             tflops=row["tflops"]))
        diff = [r["max_abs_diff_vs_old"] for r in rows[-3:] if r.get("mask") == name
                and r["d"] == d and r["L"] == L and r.get("impl") == "new"
                and "max_abs_diff_vs_old" in r]

        def ratio(x, y):
            return f" {x}/{y} {tf[x] / tf[y]:.3f}" if tf.get(x) and tf.get(y) else ""
        print(f"{name:9} d={d:3} L={L:6} " + " ".join(f"{x} {t:6.1f}" for x, t in tf.items() if t)
              + ratio("new", "old") + ratio("new", "flex") + ratio("old", "flex")
              + (f"  max|new - old| {diff[0]:.1e}" if diff and name != "plain" else ""), flush=True)
        dump(a.json, rows, complete=False)
        del q, k, v, outs
        cupy.get_default_memory_pool().free_all_blocks()
    dump(a.json, rows, complete=True)
    print(f"# {time.perf_counter() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
