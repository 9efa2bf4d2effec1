#!/usr/bin/env python3
"""Question (session 11, issue 10): does fwd_sm90's lean window build (``CUFLASH_FWD90_LEAN``,
fewer instructions a block and a key tile) bring the analytic sliding window 1024 to >= 0.85x
plain causal attention's TFLOP/s on visible pairs at L 16k? (bench/NOTES.md "the window's
instructions per visible pair (session 11) — prediction".)

    PYTHONPATH=. python bench/probes/window_lean.py [--json out.json] [--d 64,128]
        [--L 4096,16384] [--modes fwd,fwd_bwd] [--arms]

One process, the mods suite's shapes (bf16, B = 16384 / L, H = 2048 / d; bench/suite_mods.py):
``awindow`` (``window=(1024, 0)``, causal) and ``plain`` (causal, no modifier) at every d and L,
and at L 4k the block masks whose query blocks visit few key tiles (their lean build has the
short batch offsets only): ``document`` (8 causal documents) at d 64 and 128, ``prefix`` at d 64
(``--no-bmask`` leaves them out); forward and fwd+bwd (the backward is unchanged; its forward is
the lean one), CUDA-event medians.
Arms (plan-time switches; the plan cache is cleared around each):

- ``old``: ``CUFLASH_FWD90_LEAN=0`` (session 10's builds; main 20120b4);
- ``new``: ``CUFLASH_FWD90_LEAN=1`` (the default since session 12's run of this probe): the lean
  builds for the window and the block masks; plain attention's kernels are the same machine
  code in both arms, so its rows in both are a noise check;
- with ``--arms`` also ``wg2``: new with fwd_sm90's d 128 bucket at 2 warpgroups
  (``CUFLASH_TILES=fwd_sm90:128=64:2:1``; a 128-row window block loads 18 key tiles for a
  warpgroup's 17 against 19 at 192 rows, and a documents block spans fewer documents; plain
  d 128 changes too there, so wg2/plain is over the new arm's 3-warpgroup plain).

Before timing, each masked point's forward of new and old are compared on the timed inputs (the
lean builds mask the same pairs with the same arithmetic: o and lse should match bitwise;
printed as the largest difference). Prints one line per point (ms / TFLOP/s per arm, new/old, and each
arm's TFLOP/s on visible pairs over plain causal's (new arm) at that d and L: for awindow at 16k
the issue's ratio, >= 0.85; for the block masks at 4k only where plain ran at 4k) and
writes ``{"meta", "rows"}`` to --json after every point.
"""
from __future__ import annotations

import argparse
import functools
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "bench" / "probes")]

ARMS = {
    "old": {"CUFLASH_FWD90_LEAN": "0", "CUFLASH_TILES": None},
    "new": {"CUFLASH_FWD90_LEAN": "1", "CUFLASH_TILES": None},
    "wg2": {"CUFLASH_FWD90_LEAN": "1", "CUFLASH_TILES": "fwd_sm90:128=64:2:1"},
}


def _fwd_choice(kw, nbatch, L, d) -> str:
    """The forward kernel's template arguments the dispatcher picks under the current switches."""
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
    c = _families.choose("fwd", _families.Shape("bfloat16", nbatch, L, L, d, d, v, False, keys),
                         _families.device_info(0))
    head, tail = c.expr.split(", cuflash::Variant")[0], c.expr.rsplit(">", 2)[-2]
    return head + " ..." + tail


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json")
    ap.add_argument("--d", default="64,128")
    ap.add_argument("--L", default="4096,16384")
    ap.add_argument("--modes", default="fwd,fwd_bwd")
    ap.add_argument("--arms", action="store_true", help="also d 128 at 2 warpgroups (wg2)")
    ap.add_argument("--no-bmask", action="store_true", help="without the block-mask points")
    a = ap.parse_args(argv)
    import cupy
    import cuflash
    import bench_attention
    import suite_mods
    from bmask_short import _spec
    from suite_common import attention_call, bf16_zeros, time_arm, warm_arms
    arms = ["old", "new"] + (["wg2"] if a.arms else [])
    ds, lengths, modes = [int(x) for x in a.d.split(",")], [int(x) for x in a.L.split(",")], a.modes.split(",")
    points = [(n, d, L) for d in ds for L in lengths for n in ("plain", "awindow")]
    if not a.no_bmask:   # the block masks' short lists at 4k (the lead's FINDINGS, 19:30)
        points += [(n, d, 4096) for n, d in (("document", 64), ("document", 128), ("prefix", 64))
                   if d in ds]
    rows, t_start = [], time.perf_counter()

    def one(name, d, L, mode):       # a call on zeros: the compiles of this point
        H = suite_mods.WIDTH // d
        q, k, v = (bf16_zeros((max(1, suite_mods.TOKENS // L), H, L, d)) for _ in range(3))
        kw = _spec(name, L, H)[1]
        if mode == "fwd":
            cuflash.attention(q, k, v, **kw)
        else:
            cuflash.attention_vjp(q, k, v, **kw)[1](cupy.ones_like(q))

    warm_arms(arms, ARMS, [functools.partial(one, n, d, L, m) for n, d, L in points for m in modes])
    print(f"# kernels compiled ({time.perf_counter() - t_start:.0f} s)", flush=True)
    print(f"{'point':8} {'d':>4} {'L':>6} {'mode':8} " + " ".join(f"{x:>15}" for x in arms)
          + "  new/old  " + " ".join(f"{x + '/plain':>10}" for x in arms)
          + "   (ms / TFLOP/s on visible pairs; /plain: the new arm's plain causal)", flush=True)
    plain = {}
    for name, d, L in points:
        B, H, q, k, v = suite_mods.point_qkv(d, L)
        do = cupy.ones_like(q)
        mod, kw, _ = _spec(name, L, H)
        pairs = suite_mods.visible_pairs(mod, L)
        if name != "plain":          # the lean build's outputs against the old build's
            out = {}
            for arm in arms:
                with bench_attention.env(**ARMS[arm]):
                    o, lse = cuflash.attention(q, k, v, return_lse=True, **kw)
                    out[arm] = (o.astype(cupy.float32), lse)
            for arm in arms[1:]:
                do_ = float(cupy.abs(out[arm][0] - out["old"][0]).max())
                dl = float(cupy.abs(out[arm][1] - out["old"][1]).max())
                print(f"# {name} d {d} L {L}: {arm} vs old, max |o diff| {do_:.3g}, max |lse diff| {dl:.3g}",
                      flush=True)
                rows.append(dict(check=f"{arm}_vs_old", mask=name, d=d, L=L, o_max_diff=do_, lse_max_diff=dl))
            del out
        for mode in modes:
            flops = 4 * B * H * d * pairs * (3.5 if mode == "fwd_bwd" else 1.0)
            got = {}
            fn = attention_call(mode, q, k, v, do, kw)
            for arm in arms:
                ms, row = time_arm(arm, ARMS[arm], fn, flops, dict(mask=name, d=d, L=L, mode=mode),
                                   lambda: {"fwd_kernel": _fwd_choice(kw, B * H, L, d)})
                rows.append(row)
                if ms:
                    got[arm] = ms
            tf = {x: flops / ms / 1e9 for x, ms in got.items() if ms}
            if name == "plain" and "new" in tf:
                plain[(d, L, mode)] = tf["new"]

            def ratio(x, y):
                return f"{x / y:.3f}" if x and y else "-"
            print(f"{name:8} {d:4} {L:6} {mode:8} "
                  + " ".join(f"{got[x]:7.3f}/{tf[x]:6.1f}" if x in tf else f"{'-':>15}" for x in arms)
                  + f"  {ratio(tf.get('new'), tf.get('old')):>7}  "
                  + " ".join(f"{ratio(tf.get(x), plain.get((d, L, mode))) if name != 'plain' else '-':>10}"
                             for x in arms), flush=True)
            dump(a.json, arms, rows, complete=False)
        del q, k, v, do
        cupy.get_default_memory_pool().free_all_blocks()
    print(f"# {time.perf_counter() - t_start:.0f} s", flush=True)
    dump(a.json, arms, rows, complete=True)
    return 0


def dump(path, arms, rows, complete: bool) -> None:
    from suite_common import dump_probe
    dump_probe(path, "window_lean", {k: ARMS[k] for k in arms}, rows, complete)


if __name__ == "__main__":
    sys.exit(main())
