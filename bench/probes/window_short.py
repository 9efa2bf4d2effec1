#!/usr/bin/env python3
"""Question (session 10, issue 10): does the analytic sliding window reach >= 0.85x plain causal
attention's TFLOP/s (on visible pairs) with fwd_sm90's persistent schedule, and does the
long-list rule give prefix-LM back the 4% the 2-block choice cost it? (bench/NOTES.md "the
window at short lists (session 10) — prediction".)

    PYTHONPATH=. python bench/probes/window_short.py [--json out.json] [--no-flex] [--arms]
        [--points awindow,plain,prefix,document] [--d 64,128] [--L 4096,16384]
        [--modes fwd,fwd_bwd]

One process, the mods suite's shapes (bf16, B = 16384 / L, H = 2048 / d; bench/suite_mods.py):
``awindow`` (the analytic ``window=(1024, 0)``, causal) and ``plain`` (causal, no modifier: the
target's baseline) at every d and L, ``prefix`` (prefix-LM block mask) at d 64 and ``document``
(8 causal documents) at d 64 and 128, L 4k only; forward and fwd+bwd, CUDA-event medians. Arms
(plan-time switches; the plan cache is cleared around each):

- ``old``: ``CUFLASH_FWD90_PERSIST=0`` (one block a query tile, as main 9b6d075) and
  ``CUFLASH_FWD90_BMASK_LONG=0`` (the session-9 2-block rule for every block mask);
- ``new``: the defaults: persistent where a block is alone on its SM (d 128: the window, and
  documents' short lists): min_blocks blocks an SM, each running query tiles in turn with the
  next one's Q and first K/V loaded during the last key tile; block masks whose query blocks
  visit >= 2048 keys on average at min_blocks 1 (prefix at d 64);
- ``pwin``: new with the d 64 window persistent too (``CUFLASH_FWD90_PERSIST=window``; off by
  default: the lead's ncu has the d 64 window issuing as busily as causal, so the schedule may
  not pay where 2 blocks share an SM);
- with ``--arms`` also ``two`` (pwin with 2 query tiles a block instead of a resident grid:
  ``CUFLASH_FWD90_PERSIST_GRID=2``) and ``pall`` (new with plain causal persistent too:
  ``CUFLASH_FWD90_PERSIST=all``; only its ``plain`` rows differ from new);
- ``flex``: ``torch.compile``d FlexAttention with its own block mask (not for ``plain``).

Prints one line per point (ms / TFLOP/s per arm, new/old, new/flex, and for awindow new/plain's
new: the issue's ratio) and writes ``{"meta", "rows"}`` to --json after every point (each
cuflash row names its forward kernel and grid). The kernels are compiled first (NVRTC threads)
while FlexAttention's compiles run; a fresh machine's first run may pass 90 s (Flex's 12
compiles), the second is the timed one (``--no-flex`` skips Flex).
"""
from __future__ import annotations

import argparse
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "bench" / "probes")]

_NEW = {"CUFLASH_FWD90_PERSIST": None, "CUFLASH_FWD90_PERSIST_GRID": None,
        "CUFLASH_FWD90_BMASK_LONG": None}
ARMS = {
    "old": {**_NEW, "CUFLASH_FWD90_PERSIST": "0", "CUFLASH_FWD90_BMASK_LONG": "0"},
    "new": dict(_NEW),
    "pwin": {**_NEW, "CUFLASH_FWD90_PERSIST": "window"},
    "two": {**_NEW, "CUFLASH_FWD90_PERSIST": "window", "CUFLASH_FWD90_PERSIST_GRID": "2"},
    "pall": {**_NEW, "CUFLASH_FWD90_PERSIST": "all"},
}


def _points(a):
    ds, lengths = [int(x) for x in a.d.split(",")], [int(x) for x in a.L.split(",")]
    out = []
    for name in a.points.split(","):
        if name in ("awindow", "plain"):
            out += [(name, d, L) for d in ds for L in lengths]
        else:       # the block masks at 4k: d 64 (the points), documents also at d 128
            out += [(name, 64, 4096)] + ([(name, 128, 4096)] if name == "document" else [])
    return out


def _fwd_choice(kw, nbatch, L, d):
    """(kernel, grid) the dispatcher picks for this point under the current switches."""
    from cuflash import _families, _trace, _trace_cuda
    from cuflash._variant import Variant
    keys = 0
    if "block_mask" in kw:
        tr = _trace.trace_mask_mod(kw["block_mask"].mask_mod)
        v = Variant(causal=kw["causal"], mask_mod=_trace_cuda.qualified_name(tr), block_mask=True,
                    prelude=tr.source)
        keys = kw["block_mask"].mean_row_keys()
    else:
        v = Variant(causal=kw["causal"], window="window" in kw)
    shape = _families.Shape("bfloat16", nbatch, L, L, d, d, v, False, keys)
    dev = _families.device_info(0)
    c = _families.choose("fwd", shape, dev)
    grid = _families.fwd_sm90_grid(c.traits, nbatch * -(-L // c.traits.block_m), dev) \
        if c.family.name == "fwd_sm90" else None
    return c.expr.split(", cuflash::Variant")[0] + (", persist" if c.expr.endswith(", 1>") else ""), grid


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json")
    ap.add_argument("--d", default="64,128")
    ap.add_argument("--L", default="4096,16384")
    ap.add_argument("--points", default="awindow,plain,prefix,document")
    ap.add_argument("--modes", default="fwd,fwd_bwd")
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--arms", action="store_true", help="also two tiles a block, and plain persistent")
    a = ap.parse_args(argv)
    import cupy
    import cuflash
    import suite_mods
    import functools
    from bmask_short import _spec
    from suite_common import (attention_call, bf16_zeros as _bf16_zeros, compile_flex, time_arm,
                              warm_arms)
    torch = compiled = cbm = None
    if not a.no_flex:
        import torch
        from torch.nn.attention.flex_attention import create_block_mask as cbm
        compiled = compile_flex(torch)
    arms = ["old", "new", "pwin"] + (["two", "pall"] if a.arms else [])
    points, modes = _points(a), a.modes.split(",")
    rows, t_start = [], time.perf_counter()

    def one(name, d, L, mode):       # a call on zeros: the compiles of this point
        H = suite_mods.WIDTH // d
        q, k, v = (_bf16_zeros((max(1, suite_mods.TOKENS // L), H, L, d)) for _ in range(3))
        kw = _spec(name, L, H)[1]
        if mode == "fwd":
            cuflash.attention(q, k, v, **kw)
        else:
            cuflash.attention_vjp(q, k, v, **kw)[1](cupy.ones_like(q))

    def flex_warm():
        for name, d, L in points:
            H = suite_mods.WIDTH // d
            mask_mod = _spec(name, L, H)[2]
            if mask_mod is None:
                continue
            q, k, v = (torch.zeros((max(1, suite_mods.TOKENS // L), H, L, d), dtype=torch.bfloat16,
                                   device="cuda") for _ in range(3))
            fbm = cbm(mask_mod, None, None, L, L, device="cuda")
            for mode in modes:
                if mode == "fwd":
                    with torch.no_grad():
                        compiled(q, k, v, score_mod=None, block_mask=fbm)
                else:
                    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
                    compiled(*leaves, score_mod=None, block_mask=fbm).backward(torch.ones_like(q))
        torch.cuda.synchronize()

    # compile first: each arm's points in threads, FlexAttention's beside the first arm's
    warm_arms(arms, ARMS, [functools.partial(one, n, d, L, m) for n, d, L in points for m in modes],
              flex_warm if compiled is not None else None)
    print(f"# kernels compiled ({time.perf_counter() - t_start:.0f} s)", flush=True)
    print(f"{'point':9} {'d':>4} {'L':>6} {'mode':8} " + " ".join(f"{x:>15}" for x in arms + ["flex"])
          + "  new/old new/flex new/plain   (ms / TFLOP/s on visible pairs)", flush=True)
    plain_new = {}
    for name, d, L in sorted(points, key=lambda p: (p[1], p[2], p[0] != "plain")):
        B, H, q, k, v = suite_mods.point_qkv(d, L)
        do = cupy.ones_like(q)
        mod, kw, flex_mask = _spec(name, L, H)
        pairs = suite_mods.visible_pairs(mod, L)
        for mode in modes:
            flops = 4 * B * H * d * pairs * (3.5 if mode == "fwd_bwd" else 1.0)
            got = {}
            fn = attention_call(mode, q, k, v, do, kw)
            for arm in arms:
                ms, row = time_arm(arm, ARMS[arm], fn, flops, dict(mask=name, d=d, L=L, mode=mode),
                                   lambda: dict(zip(("fwd_kernel", "fwd_grid"),
                                                    _fwd_choice(kw, B * H, L, d))))
                rows.append(row)
                if ms:
                    got[arm] = ms
            if compiled is not None and flex_mask is not None:   # as suite_mods times it
                (row,) = suite_mods._flex_point(torch, compiled, cbm, mod, mode, d, L, B, H,
                                                [(q, k, v)], None, flops)
                got["flex"] = row["ms"]
                rows.append(dict(impl="flex", mask=name, d=d, L=L, mode=mode, ms=row["ms"],
                                 tflops=row["tflops"], **({"note": row["note"]} if "note" in row else {})))
            tf = {x: flops / ms / 1e9 for x, ms in got.items() if ms}
            if name == "plain" and "new" in tf:
                plain_new[(d, L, mode)] = tf["new"]

            def cell(x):
                return f"{got[x]:7.3f}/{tf[x]:6.1f}" if x in tf else f"{'-':>15}"

            def ratio(x, y):
                return f"{x / y:.3f}" if x and y else "-"
            r_plain = ratio(tf.get("new"), plain_new.get((d, L, mode))) if name == "awindow" else "-"
            print(f"{name:9} {d:4} {L:6} {mode:8} " + " ".join(cell(x) for x in arms + ["flex"])
                  + f"  {ratio(tf.get('new'), tf.get('old')):>7} {ratio(tf.get('new'), tf.get('flex')):>8}"
                  + f" {r_plain:>9}", flush=True)
            dump(a.json, arms, rows, complete=False)
        del q, k, v, do
        cupy.get_default_memory_pool().free_all_blocks()
    print(f"# {time.perf_counter() - t_start:.0f} s", flush=True)
    dump(a.json, arms, rows, complete=True)
    return 0


def dump(path, arms, rows, complete: bool) -> None:
    from suite_common import dump_probe
    dump_probe(path, "window_short", {k: ARMS[k] for k in arms}, rows, complete)


if __name__ == "__main__":
    sys.exit(main())
