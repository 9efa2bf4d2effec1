#!/usr/bin/env python3
"""Which of the switches that are off for want of a GPU run (bench/NOTES.md, "Session 11: what
landed without a GPU") the ``pending`` part's measurements say to turn on.

    python bench/pending_decide.py OUT_DIR        # the folder `gpu_run.sh pending` wrote

Reads ``decode_ab_s11.json``, ``window_lean.json``, ``bmask_s11.json`` and
``bmask_short_wg.json`` (any may be missing: its switches stay off) and prints, per switch, the
ratios it was decided on and one line ``export CUFLASH_...=value`` for each switch to turn on.
That line runs the suites under the decision in the same session (the next device call), before
the default in the code is flipped. No GPU needed.

The rules (ratios of TFLOP/s, or of ms for decode, over the same point and process; the bar is
above the ~0.5% that repeated probe runs move):
- ``CUFLASH_FWD90_LEAN``: the window's forward points (d 64 / 128, L 4k / 16k) and the block
  masks' (documents d 64 / 128, prefix d 64 at 4k), new / old, each as a geometric mean: a group
  is on when its mean is >= 1.005 and no point of it is below 0.99; "1" both, else the one.
- ``CUFLASH_BMASK_TILE_MAJOR``: fwd+bwd ``tm`` / ``old`` at the probe's block-mask points; on
  ("both") when the mean is >= 1.005 and the forward's ``fwd_tm`` / ``fwd`` is >= 0.995, "bwd"
  when only the backward gains.
- ``CUFLASH_BWD90_DQ_ROWS``: ``new`` / ``tm``, the same bar; only with the tile-major order on
  (the probe's ``new`` arm has both).
- ``CUFLASH_FWD90_BMASK_SHORT_WG``: ``wg2`` and ``wg1`` over ``table`` at the documents and the
  window's block mask, 4k; the better one when its mean is >= 1.02 and no point is below 0.97.
- ``CUFLASH_DECODE_EARLY`` / ``CUFLASH_DECODE_ARRIVE``: at the probe's six dense points,
  ``old`` / ``cuflash`` time (> 1: the cuts save time); on when the mean is >= 1.002 and no
  point below 0.998. EARLY takes "one" unless "all" (``cuflash``) beats ``cuflash_one`` by
  >= 0.2%: "all" wastes ~64 KB of copies a split where a serving cache's rows are shorter than
  its capacity. ARRIVE "wrap" when ``cuflash_early`` (fence) / ``cuflash`` time is >= 1.002.
"""
from __future__ import annotations

import json
import math
import pathlib
import sys


def _rows(folder: pathlib.Path, name: str) -> list[dict]:
    try:
        return json.loads((folder / name).read_text())["rows"]
    except (OSError, ValueError, KeyError):
        return []


def _value(rows, impl, key, point):
    for r in rows:
        if r.get("impl") == impl and r.get(key) and all(r.get(k) == v for k, v in point.items()):
            return r[key]
    return None


def ratios(rows, a, b, points, key="tflops") -> list[float]:
    """``a`` / ``b`` at each point both have."""
    out = []
    for p in points:
        x, y = _value(rows, a, key, p), _value(rows, b, key, p)
        if x and y:
            out.append(x / y)
    return out


def gmean(xs) -> float | None:
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None


def wins(rs, mean_bar: float, floor: float) -> bool:
    return bool(rs) and gmean(rs) >= mean_bar and min(rs) >= floor


def decide(folder) -> tuple[dict, list[str]]:
    """(the switches to turn on, the lines that say why)."""
    folder = pathlib.Path(folder)
    env, why = {}, []

    def say(name, rs):
        why.append(f"{name}: {', '.join(f'{r:.3f}' for r in rs) or 'no data'}"
                   + (f" (mean {gmean(rs):.3f})" if rs else ""))

    lean = _rows(folder, "window_lean.json")
    win = ratios(lean, "new", "old", [dict(mask="awindow", d=d, L=L, mode="fwd")
                                      for d in (64, 128) for L in (4096, 16384)])
    bm = ratios(lean, "new", "old", [dict(mask=m, d=d, L=4096, mode="fwd") for m, d in
                                     (("document", 64), ("document", 128), ("prefix", 64))])
    say("LEAN window new/old", win)
    say("LEAN block masks new/old", bm)
    on_w, on_b = wins(win, 1.005, 0.99), wins(bm, 1.005, 0.99)
    if on_w or on_b:
        env["CUFLASH_FWD90_LEAN"] = "1" if on_w and on_b else ("window" if on_w else "bmask")

    pre = _rows(folder, "bmask_s11.json")
    pts = [dict(mask=m, d=d, L=4096, mode="fwd_bwd") for m in ("prefix", "document")
           for d in (64, 128)] + [dict(mask="prefix", d=d, L=16384, mode="fwd_bwd") for d in (64, 128)]
    tm = ratios(pre, "tm", "old", pts)
    rows_ = ratios(pre, "new", "tm", pts)
    fwd = ratios(pre, "fwd_tm", "fwd", [dict(mask=m, d=d, L=L, mode="fwd") for m in ("prefix",
                 "document") for d in (64, 128) for L in (4096, 16384)])
    say("TILE_MAJOR fwd+bwd tm/old", tm)
    say("TILE_MAJOR fwd fwd_tm/fwd", fwd)
    say("DQ_ROWS new/tm", rows_)
    if wins(tm, 1.005, 0.99):
        env["CUFLASH_BMASK_TILE_MAJOR"] = "both" if (not fwd or gmean(fwd) >= 0.995) else "bwd"
        if wins(rows_, 1.005, 0.99):
            env["CUFLASH_BWD90_DQ_ROWS"] = "1"

    wg = _rows(folder, "bmask_short_wg.json")
    pts = [dict(mask=m, d=d, L=4096, mode="fwd") for m in ("document", "window") for d in (64, 128)]
    best = None
    for arm, value in (("wg2", "2"), ("wg1", "1")):
        rs = ratios(wg, arm, "table", pts)
        say(f"SHORT_WG {arm}/table", rs)
        if wins(rs, 1.02, 0.97) and (best is None or gmean(rs) > best[0]):
            best = (gmean(rs), value)
    if best:
        env["CUFLASH_FWD90_BMASK_SHORT_WG"] = best[1]

    dec = _rows(folder, "decode_ab_s11.json")
    pts = [dict(B=B, Hq=32, Hkv=h, Lk=L) for B, h, L in ((8, 8, 8192), (8, 8, 65536),
           (8, 8, 131072), (8, 32, 8192), (64, 8, 8192), (1, 8, 131072))]
    cuts = ratios(dec, "cuflash_old", "cuflash", pts, key="ms")
    all_one = ratios(dec, "cuflash_one", "cuflash", pts, key="ms")
    arrive = ratios(dec, "cuflash_early", "cuflash", pts, key="ms")
    say("DECODE old/cuts time", cuts)
    say("DECODE EARLY one/all time", all_one)
    say("DECODE ARRIVE fence/wrap time", arrive)
    if wins(cuts, 1.002, 0.998):
        env["CUFLASH_DECODE_EARLY"] = "all" if wins(all_one, 1.002, 0.995) else "one"
        if wins(arrive, 1.002, 0.998):
            env["CUFLASH_DECODE_ARRIVE"] = "wrap"
    return env, why


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(__doc__.split("\n\n")[1])
        return 2
    env, why = decide(argv[0])
    print("\n".join(f"# {line}" for line in why))
    for k, v in env.items():
        print(f"export {k}={v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
