#!/usr/bin/env python3
"""Question (session 11, issue 10): does a block mask with short lists run faster in fwd_sm90
blocks of fewer warpgroups (``CUFLASH_FWD90_BMASK_SHORT_WG``)? The mods suite's 8 causal
documents at 4k ran at 0.64x FlexAttention at d 128 and 0.80x at d 64 (session 11, calls 2-3):
at d 128 a block is 3 warpgroups, 192 query rows, which no document boundary lines up with, so
its tiles hold 0.61 visible pairs each against 0.80 for 128-row blocks and 0.89 for 64-row ones;
and every block's list is short, so its fixed cost weighs (bench/NOTES.md, session 11).

    PYTHONPATH=. python bench/probes/bmask_short_wg.py [--json out.json] [--no-flex]
        [--points document,window,prefix] [--d 64,128] [--L 4096,16384]

One process, the mods suite's shapes (bf16, B = 16384 / L, H = 2048 / d), forward only (the
switch changes nothing else): the suite's causal documents and its window 1024 as a block mask
(both ``causal=True``) and prefix-LM (its lists are long; L 4k only), arms ``table`` (the
table's warpgroups), ``wg2`` and ``wg1`` (at most 2 / 1 warpgroups a block for lists shorter
than ``CUFLASH_FWD90_BMASK_LONG``'s 2048 keys), the first two also with session 10's persistent schedule (``persist``, ``wg2p``:
``CUFLASH_FWD90_PERSIST=auto``, where a block is alone on its SM: d 128; elsewhere the same
build as without; not with 1 warpgroup, whose persistent grid of one block an SM would leave
the SM 4 warps), ``pall`` (``CUFLASH_FWD90_PERSIST=all``: persistent for any Variant,
prefix-LM's long lists too), and
``torch.compile``d FlexAttention as suite_mods times it. Every arm's output is checked against
the table arm's (the kit's rule needs the float64 reference, too slow here: max |difference|
is printed and stored, and must be of bfloat16's rounding). Prints ms / TFLOP/s on visible
pairs per arm and the best arm / Flex; writes ``{"meta", "rows"}`` to --json after each point.
"""
from __future__ import annotations

import argparse
import functools
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "bench" / "probes")]

ARMS = {"table": {"CUFLASH_FWD90_BMASK_SHORT_WG": "table", "CUFLASH_FWD90_PERSIST": "0"},
        "wg2": {"CUFLASH_FWD90_BMASK_SHORT_WG": "2", "CUFLASH_FWD90_PERSIST": "0"},
        "wg1": {"CUFLASH_FWD90_BMASK_SHORT_WG": "1", "CUFLASH_FWD90_PERSIST": "0"},
        # session 10's persistent schedule (opt-in "auto": short lists at 1 block an SM, so d
        # 128 only), never measured on the suite's documents, with each warpgroup count
        "persist": {"CUFLASH_FWD90_BMASK_SHORT_WG": "table", "CUFLASH_FWD90_PERSIST": "auto"},
        "wg2p": {"CUFLASH_FWD90_BMASK_SHORT_WG": "2", "CUFLASH_FWD90_PERSIST": "auto"},
        # ... and for any Variant ("all"): prefix-LM's long lists too, whose d 64 forward at 4k
        # ran at 0.93x Flex (1 block an SM there: nothing overlaps a block's start and end)
        "pall": {"CUFLASH_FWD90_BMASK_SHORT_WG": "table", "CUFLASH_FWD90_PERSIST": "all"}}


def dump(path, rows, complete: bool) -> None:
    from suite_common import dump_probe
    dump_probe(path, "bmask_short_wg", ARMS, rows, complete)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json")
    ap.add_argument("--d", default="64,128")
    ap.add_argument("--L", default="4096,16384")
    ap.add_argument("--points", default="document,window,prefix")
    ap.add_argument("--no-flex", action="store_true")
    a = ap.parse_args(argv)
    import cupy
    import cuflash
    import suite_mods
    from bmask_short import _spec, point_forward
    from window_short import _fwd_choice
    from suite_common import attention_call, time_arm, compile_flex, warm_arms
    torch = compiled = cbm = None
    if not a.no_flex:
        import torch
        from torch.nn.attention.flex_attention import create_block_mask as cbm
        compiled = compile_flex(torch)
    points = [(n, int(d), int(L)) for n in a.points.split(",") for d in a.d.split(",")
              for L in a.L.split(",") if n != "prefix" or int(L) == 4096]
    rows, t0 = [], time.perf_counter()

    warm_arms(list(ARMS), ARMS, [functools.partial(point_forward, *p) for p in points])
    print(f"# kernels compiled ({time.perf_counter() - t0:.0f} s)", flush=True)
    for name, d, L in points:
        B, H, q, k, v = suite_mods.point_qkv(d, L)
        mod, kw, flex_mask = _spec(name, L, H)
        flops = 4 * B * H * d * suite_mods.visible_pairs(mod, L)
        tf, outs = {}, {}

        def describe():      # under the arm's switches, after its timing: its output and kernel
            o = cuflash.attention(q, k, v, **kw).astype(cupy.float32)
            first = outs.setdefault("table", o)          # (the first arm is the table's)
            kernel, grid = _fwd_choice(kw, B * H, L, d)
            return dict(max_abs_diff_vs_table=float(cupy.abs(o - first).max()),
                        fwd_kernel=kernel, fwd_grid=grid)
        fn = attention_call("fwd", q, k, v, None, kw)
        for arm, env in ARMS.items():
            ms, row = time_arm(arm, env, fn, flops, dict(mask=name, d=d, L=L, mode="fwd"),
                               describe, iters=20, warmup=3)
            rows.append(row)
            tf[arm] = row["tflops"]
        if compiled is not None:
            (row,) = suite_mods._flex_point(torch, compiled, cbm, mod, "fwd", d, L, B, H,
                                            [(q, k, v)], None, flops)
            tf["flex"] = row["tflops"]
            rows.append(dict(impl="flex", mask=name, d=d, L=L, mode="fwd", ms=row["ms"],
                             tflops=row["tflops"]))
        best = max((x for x in ARMS), key=lambda x: tf[x] or 0.0)
        print(f"{name:9} d={d:3} L={L:6} " + " ".join(f"{x} {t:6.1f}" for x, t in tf.items() if t)
              + f"  best {best}" + (f" / flex {tf[best] / tf['flex']:.3f}" if tf.get("flex") and tf[best] else "")
              + "  max|o - table's| " + " ".join(f"{r['max_abs_diff_vs_table']:.2e}"
                                                  for r in rows if r.get("mask") == name
                                                  and r["d"] == d and r["L"] == L and "max_abs_diff_vs_table" in r),
              flush=True)
        dump(a.json, rows, complete=False)
        del q, k, v, outs
        cupy.get_default_memory_pool().free_all_blocks()
    dump(a.json, rows, complete=True)
    print(f"# {time.perf_counter() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
