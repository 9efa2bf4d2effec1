#!/usr/bin/env python3
"""Question (session 21, issue 10's window 1024 at 16k, 0.77-0.84x plain causal against 0.85):
what does one of fwd_sm90ws's persistent items cost beyond its key tiles, and what does the
window's masking add on top? Sessions 18-20 put ~1.1-1.4 key tiles an item on a "fixed cost"
by subtraction (the tile shape's ceiling 0.889 against the measured ratio) and attacked it three
ways with no gain (chained items, the producer storing O, half tiles); this probe measures it.

    PYTHONPATH=. python bench/probes/window_items.py [--json out.json] [--rounds 5]

One process, d 128, bf16, B 1, H 16, Lq 16384 (2048 items of 128 query rows), every arm on the
window's schedule (``CUFLASH_FWD90_WS=1``, ``CUFLASH_FWD90WS_PERSIST=3``: one block an SM, each
running its items from the host's lists):
  - plain (no mask) with Lk = 1152, 2304, 4608, 9216: items of n = 9, 18, 36, 72 key tiles
    and nothing else; a least-squares line through (n, time) gives the time a key tile (the
    slope) and the fixed cost an item (the intercept, in key tiles: F = intercept / slope);
  - the window 1024 (causal) at Lk = 16384: items of 9 key tiles (the first 8 fewer), two of
    them masked; its time against the line at its tile count is the masking's extra;
  - plain causal at 16384 (the issue's baseline), timed beside on its default schedule (one
    block a query tile; call 1 timed it on the lists, which lose on causal: 0.797 there).
Each arm timed ``--rounds`` times, the points' order rotated a round; medians printed. Reading:
the window reaches 0.85x causal only if F + the masking's extra <= ~0.4 key tiles an item (9
tiles at the 0.889 ceiling, against causal's per-tile rate).
Answer (session 21, ``window_items.json``): F = 2.1 key tiles an item; the window's item read
as a plain 9-tile item there (0.314 ms both), but 6-7% slower in call 2's process, whose stamps
(``ws_stamps.py``) put the difference on its two masked tiles and the rest (~5,000 cycles, 1.7
tiles) on the item's boundary, whatever its length.

``--ab DEFINE``: every point also timed with fwd_sm90ws.cu compiled after ``#define DEFINE 1``
(arm ``before``; ``suite_common.compile_with_define``: its own build, keyed by the prelude), the
points' and arms' order balanced together (arm_orders): a change to the item's fixed cost measured against
the build before it in one process.
"""
from __future__ import annotations

import argparse
import pathlib
import statistics
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from suite_common import arm_orders, compile_with_define, dump_probe, time_arm, warm_arms  # noqa: E402

ENV = {"CUFLASH_FWD90_WS": "1", "CUFLASH_FWD90WS_PERSIST": "3"}
#: the environment variable naming the define of --ab's ``before`` arm (read at plan time)
DEFINE_VAR = "CUFLASH_PROBE_WS_DEFINE"
L, H, D, WINDOW, BLOCK = 16384, 16, 128, 1024, 128
PLAIN_TILES = (9, 18, 36, 72)


def visible(name: str, Lk: int) -> int:
    if name == "window":
        w = WINDOW + 1
        return w * (w + 1) // 2 + (L - w) * w
    if name == "causal":
        return L * (L + 1) // 2
    return L * Lk


def fit(points):
    """Least squares t = a + b n: (a, b)."""
    n = [p[0] for p in points]
    t = [p[1] for p in points]
    mn, mt = statistics.fmean(n), statistics.fmean(t)
    b = sum((x - mn) * (y - mt) for x, y in zip(n, t)) / sum((x - mn) ** 2 for x in n)
    return mt - b * mn, b


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--ab", help="a define of fwd_sm90ws.cu: arm 'before' compiled with it")
    ap.add_argument("--points", help="comma-separated subset of plain9, plain18, plain36, plain72, "
                                     "window, causal (default all; the fit needs the plain ones)")
    args = ap.parse_args(argv)
    arms = {"ws": ENV}
    if args.ab:
        import os
        compile_with_define("fwd_sm90ws.cu", lambda: os.environ.get(DEFINE_VAR, ""))
        arms["before"] = dict(ENV, **{DEFINE_VAR: args.ab})
    import cupy
    import ml_dtypes
    import numpy
    import cuflash
    rng = numpy.random.default_rng(0)

    def arr(n):
        return cupy.asarray(rng.standard_normal((1, H, n, D)).astype(ml_dtypes.bfloat16))

    q = arr(L)
    kv = {n: (arr(n * BLOCK), arr(n * BLOCK)) for n in PLAIN_TILES}
    kv[L // BLOCK] = (arr(L), arr(L))
    pts = [(f"plain{n}", n, dict(causal=False)) for n in PLAIN_TILES]
    pts += [("window", 9, dict(causal=True, window=(WINDOW, 0))),
            ("causal", L // BLOCK, dict(causal=True))]
    if args.points:
        pts = [pt for pt in pts if pt[0] in args.points.split(",")]
    kv_of = {name: kv[L // BLOCK] if name in ("window", "causal") else kv[n] for name, n, _ in pts}
    jobs = {name: (lambda k=kv_of[name], kw=kw: cuflash.attention(q, *k, **kw)) for name, _, kw in pts}
    warm_arms(list(arms), arms, list(jobs.values()))
    rows, times = [], {(arm, name): [] for arm in arms for name, _, _ in pts}
    for rnd, order in enumerate(arm_orders(list(times), args.rounds)):
        for arm, name in order:
            Lk = kv_of[name][0].shape[2]
            flops = 4.0 * H * D * visible(name, Lk)
            env = dict(arms[arm])
            if name == "causal":   # (the baseline: causal on its own schedule)
                env.pop("CUFLASH_FWD90WS_PERSIST")
            ms, row = time_arm(arm, env, lambda i, f=jobs[name]: f(), flops,
                               dict(point=name, Lk=Lk, round=rnd, d=D, L=L))
            rows.append(row)
            if ms:
                times[arm, name].append(ms)
        dump_probe(args.json, "window_items", arms, rows, False)
    for arm in arms:
        print(f"-- {arm}")
        med = {name: statistics.median(times[arm, name]) for name, _, _ in pts if times[arm, name]}
        if all(f"plain{n}" in med for n in PLAIN_TILES) and {"window", "causal"} <= set(med):
            rows.append(report(arm, med, pts, kv_of))
    if args.ab:
        for name, _, _ in pts:
            if times["ws", name] and times["before", name]:
                r = statistics.median(times["before", name]) / statistics.median(times["ws", name])
                print(f"{name:8s} ws / before (speed): {r:.3f}")
    dump_probe(args.json, "window_items", arms, rows, True)
    return 0


def report(arm, med, pts, kv_of) -> dict:
    """Print one arm's line, its items' fit and each point; the fit's row."""
    a, b = fit([(n, med[f"plain{n}"]) for n in PLAIN_TILES])
    print(f"plain items: {b * 1e3:.3f} us a key tile (the grid's), intercept {a * 1e3:.1f} us "
          f"= F {a / b:.2f} key tiles an item")
    for name, n, _ in pts:
        Lk = kv_of[name][0].shape[2]
        tf = 4.0 * H * D * visible(name, Lk) / med[name] / 1e9
        computed = 4.0 * H * D * (L // BLOCK) * BLOCK * BLOCK * n / med[name] / 1e9 \
            if name != "causal" else float("nan")
        eq = (med[name] - a) / b
        print(f"{name:8s} Lk {Lk:5d} {med[name]:7.3f} ms  {tf:6.1f} TFLOP/s visible  "
              f"{computed:6.1f} computed  line's tiles {eq:6.2f} (n {n})")
    w_c = visible("window", L) / med["window"] / (visible("causal", L) / med["causal"])
    print(f"window / causal (visible TFLOP/s): {w_c:.3f}")
    return dict(impl="fit", arm=arm, us_per_tile=b * 1e3, intercept_us=a * 1e3,
                fixed_tiles=a / b, window_over_causal=w_c)


if __name__ == "__main__":
    sys.exit(main())
