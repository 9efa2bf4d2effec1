#!/usr/bin/env python3
"""Question (session 16, issues 10 and the next wave's warp specialisation): where does the
warp-specialised forward (fwd_sm90ws: a cp.async producer warpgroup, consumers on mbarriers,
FlashAttention-3's intra-warpgroup overlap) beat fwd_sm90, and by how much? Where it does, it
becomes the dispatcher's default there (cuflash/_fwd_ws.py); the window rows answer issue 10's
"window 1024 at 16k >= 0.85x plain causal" with fewer rows a block (128 at d 128, not 192).

    PYTHONPATH=. python bench/probes/fwd_ws.py [--json out.json] [--d 64,128] [--L 1024,4096,16384]
        [--no-peers]

One process; the fwd suite's shapes (bf16, B = 16384 / L, H = 2048 / d): plain, causal, the
window of 1024 keys (causal) at 4k and 16k, softcap 50 at 4k (d 128; at d 64 the ws build of the
softcap spills and fwd_sm90 keeps it). Arms (plan-time switches, plans cleared around each):
``sm90`` (``CUFLASH_FWD90_WS=0``), ``ws`` (``CUFLASH_FWD90_WS=1``: the table's tiles, one block a
query tile), ``ws_pp0`` (the same without the consumers' ping-pong) and ``ws_stages`` (the other
K/V stage count); with ``--persist`` arms sm90, ws, ``ws_p1``, ``ws_p2``, ``ws_p3`` (session 17:
a persistent grid, items round-robin / zigzag / the host's longest-first lists,
``CUFLASH_FWD90WS_PERSIST``) and ``ws_auto`` (the dispatcher's rule for it), ``--arms`` picking
some of them (session 18: ``--persist --d 128 --L 4096,8192,16384 --arms ws_p1,ws_p2,ws_p3
--softcap16k --rounds 5 --no-peers``); with
``--softcap-d64`` adds the softcap at d 64 from 4k (session 19: its one ws build without
local memory, forced by the ws arms, against fwd_sm90's; session 20 measured it 1.04 / 1.10x
fwd_sm90 at 4k / 16k, ``fwd_ws_softcap_d64.json``, and the rule took it); with
``--poly K,..`` instead plain and softcap only (of --d), arms sm90, ws and ``ws_polyK`` (K of
16 eight-column tiles of the softcap's exponentials on the FMA pipe; ``ws_poly0`` none,
``CUFLASH_SOFTCAP_POLY=0``; session 21 asked it of d 64's ws build, which the dispatcher took
in session 20 with none); and, unless --no-peers,
SDPA's cuDNN backend on the plain and causal points (torch, the same arrays through DLPack).
TFLOP/s count visible pairs (4 B H d pairs); each arm is timed ``--rounds`` times a point (3), the
arms' order rotated a round, and the printed figure is the median (rows: one a round). Before
timing, each point's outputs of the two arms are compared (max |ws - sm90|, bf16: different
tile orders, not bitwise). Prints one line a point and writes ``{"meta", "rows"}`` to --json
after every point.

Answer so far (session 16, H200; bench/NOTES.md "Session 16"): with the producer's copies at ~4
instructions each (call 4, ``fwd_ws.json``) fwd_sm90ws is 1.26-1.51x fwd_sm90 at d 128 (plain
16k 646 TFLOP/s, cuDNN 625), 1.03-1.27x at d 64 from 16 key tiles a block, slower for d 64's
short rows and window; ping-pong is worth 3-12% at d 128, 3 stages nothing there (1-3% at d 64);
``--poly`` (call 7, ``fwd_ws_poly.json``): the Variant's share of 4 of 16 tiles stays best
(6-12 lose 2-10%); session 21 (``fwd_ws_poly_d64.json``, ``fwd_ws_poly_d128.json``): 2 beats 4
at d 128 by 1.5-4.4% and 4 beats none at d 64 by 7-8% (the tile table's shares since), and the
``ws`` arm's lead over TILES arms of the same kernel was its place after ``sm90``
(suite_common.arm_orders, now balanced). ``--persist`` (session 17, call 1, ``fwd_ws_persist.json``, d 128): the
persistent grid gains where items are short or equal (window 1.02-1.06 zigzag, plain / causal 1k
1.07 / 1.11 round-robin, softcap 4k 1.07) and loses on long causal items (0.90-0.97), whose
unequal lengths the hardware's block scheduler balances better than a static schedule.
Session 18 (``fwd_ws_persist_s18.json``, 5 rounds, 4k / 8k / 16k): the host's lists (p3) beat
zigzag on the window by 1.9 / 0.8 / 1.1% (now its default) and lose on long causal items like the
other static schedules (causal 0.96 / 0.92 at 8k / 16k, ALiBi 0.96 / 0.97); session 17's
prediction for p3 (causal 4k +4%) measured +0.8%.
"""
from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from suite_common import arm_orders, dump_probe, median_event_ms, time_arm, warm_arms  # noqa: E402

# (the ws arms one block a query tile: CUFLASH_FWD90WS_PERSIST=0, session 16's schedule)
WS = {"CUFLASH_FWD90_WS": "1", "CUFLASH_FWD90WS_PERSIST": "0"}
ARMS = {"sm90": {"CUFLASH_FWD90_WS": "0"}, "ws": WS,
        # the table's tiles without the consumers' ping-pong, and with the other stage count
        # (3 at d 128, 2 at d 64: the table has 2 and 3)
        "ws_pp0": dict(WS, CUFLASH_TILES="fwd_sm90ws:128=128:2:2:0:0;fwd_sm90ws:64=128:3:3:0:0"),
        "ws_stages": dict(WS, CUFLASH_TILES="fwd_sm90ws:128=128:2:3:1:0;fwd_sm90ws:64=128:3:2:1:0")}
#: --persist (session 17): the persistent schedules, round-robin (p1) and zigzag (p2)
PERSIST_ARMS = {"sm90": ARMS["sm90"], "ws": WS,
                **{f"ws_p{k}": dict(WS, CUFLASH_FWD90WS_PERSIST=str(k)) for k in (1, 2, 3)},
                # the dispatcher's rule (_fwd_ws.persist_default) on every point ws runs
                "ws_auto": {"CUFLASH_FWD90_WS": "1"}}


#: --alibi (session 18): ALiBi under causal with its row term carried in the softmax (the
#: default, variant.cuh kAlibiRowOffset) against the whole distance term added to every score
#: (CUFLASH_ALIBI_ROW_OFFSET=0, the build before); both on the dispatcher's schedule
ALIBI_ARMS = {"sm90": ARMS["sm90"], "ws": {"CUFLASH_FWD90_WS": "1"},
              "ws_abs": {"CUFLASH_FWD90_WS": "1", "CUFLASH_ALIBI_ROW_OFFSET": "0"}}


def poly_arms(shares):
    """--poly: the table's tiles with K of the 16 eight-column tiles of S taking the softcap's
    exponentials on the FMA pipe (the Variant's share: 4 at d 128, none at d 64; the tile
    argument sets it for every softcap build that may take one, variant.cuh kPolyCapable)."""
    auto = {"CUFLASH_FWD90_WS": "1"}   # (the dispatcher's schedule: persistent where it is)
    return {"sm90": ARMS["sm90"], "ws": auto,
            **{f"ws_poly{k}": dict(auto, CUFLASH_TILES=f"fwd_sm90ws:128=128:2:2:1:{k};"
                                                     f"fwd_sm90ws:64=128:3:3:1:{k}")
               if k else dict(auto, CUFLASH_SOFTCAP_POLY="0")   # (0: no share at all)
               for k in shares}}
TOKENS, WIDTH, WINDOW = 16384, 2048, 1024


def visible_pairs(L: int, causal: bool, window: int | None) -> int:
    if not causal:
        return L * L
    if window is None:
        return L * (L + 1) // 2
    w = window + 1          # keys i - window .. i
    return w * (w + 1) // 2 + (L - w) * w if L > w else L * (L + 1) // 2


def points(ds, Ls, poly=False, alibi=False, softcap_d64=False):
    if alibi:   # ALiBi's cost over causal attention of the same shape (issue 10: <= 10%)
        for d in ds:
            for L in Ls:
                yield d, L, "causal", dict(causal=True)
                yield d, L, "alibi", dict(causal=True, alibi_slopes="mods")
        return
    if poly:   # the softcap's cost over plain attention of the same shape (issue 10: <= 10%)
        for d in ds:
            for L in Ls:
                yield d, L, "plain", dict(causal=False)
                yield d, L, "softcap", dict(softcap=50.0)
        return
    for d in ds:
        for L in Ls:
            for causal in (False, True):
                yield d, L, "plain" if not causal else "causal", dict(causal=causal)
            if L >= 4096:
                yield d, L, "window", dict(causal=True, window=(WINDOW, 0))
            if (L == 4096 and d == 128) or (softcap_d64 and d == 64 and L >= 4096):
                yield d, L, "softcap", dict(softcap=50.0)
            if L >= 4096 and d == 128:   # (the mods suite's ALiBi: causal, slopes 2^-8h/H)
                yield d, L, "alibi", dict(causal=True, alibi_slopes="mods")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json")
    ap.add_argument("--d", default="64,128")
    ap.add_argument("--L", default="1024,4096,16384")
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--rounds", type=int, default=3,
                    help="timings of each arm a point, in rotated orders; the line shows medians")
    ap.add_argument("--persist", action="store_true",
                    help="arms sm90, ws, ws_p1, ws_p2: the persistent schedules (session 17)")
    ap.add_argument("--arms", help="comma-separated subset of the arms (sm90 and ws always)")
    ap.add_argument("--softcap16k", action="store_true", help="also the softcap at 16k (d 128)")
    ap.add_argument("--alibi", action="store_true",
                    help="causal and ALiBi points only, arms sm90, ws, ws_abs "
                         "(CUFLASH_ALIBI_ROW_OFFSET=0)")
    ap.add_argument("--softcap-d64", action="store_true",
                    help="also the softcap at d 64 from 4k (session 19: its whole-tile ws build, "
                         "forced by the ws arms, against fwd_sm90's, the default)")
    ap.add_argument("--poly", help="comma-separated shares (tiles of 16) for the softcap A/B: "
                                   "plain and softcap points only, arms sm90, ws, ws_polyK")
    args = ap.parse_args(argv)
    global ARMS
    if args.poly:
        ARMS = poly_arms([int(k) for k in args.poly.split(",")])
    elif args.persist:
        ARMS = PERSIST_ARMS
    elif args.alibi:
        ARMS = ALIBI_ARMS
    if args.arms:
        ARMS = {a: e for a, e in ARMS.items() if a in ("sm90", "ws") or a in args.arms.split(",")}
    import cupy
    import ml_dtypes
    import numpy
    import cuflash
    ds = [int(x) for x in args.d.split(",")]
    Ls = [int(x) for x in args.L.split(",")]
    pts = list(points(ds, Ls, bool(args.poly), args.alibi, args.softcap_d64))
    if args.softcap16k:
        pts.append((128, 16384, "softcap", dict(softcap=50.0)))
    rng = numpy.random.default_rng(0)
    arrays = {}
    for d, L, _, _ in pts:
        if (d, L) not in arrays:
            shape = (TOKENS // L, WIDTH // d, L, d)
            arrays[d, L] = tuple(cupy.asarray(rng.standard_normal(shape).astype(ml_dtypes.bfloat16))
                                 for _ in range(3))
    for d, _, _, kw in pts:
        if kw.get("alibi_slopes") == "mods":   # (the mods suite's slopes, one a head)
            h = WIDTH // d
            kw["alibi_slopes"] = cupy.asarray(2.0 ** (-8.0 * numpy.arange(1, h + 1) / h), dtype=cupy.float32)
    t0 = time.perf_counter()
    jobs = [(lambda a=arrays[d, L], kw=kw: cuflash.attention(*a, **kw)) for d, L, _, kw in pts]
    warm_arms(list(ARMS), ARMS, jobs)
    torch = None
    if not args.no_peers:
        try:
            import torch
            from torch.nn.attention import SDPBackend, sdpa_kernel
        except Exception as exc:       # pragma: no cover - a machine without torch
            print(f"# no peers: {exc}")
            torch = None
    rows = []
    for d, L, name, kw in pts:
        q, k, v = arrays[d, L]
        B, H = TOKENS // L, WIDTH // d
        flops = 4.0 * B * H * d * visible_pairs(L, kw.get("causal", False),
                                                kw.get("window", (None,))[0])
        row = dict(d=d, L=L, mod=name, causal=bool(kw.get("causal")))
        outs = {}
        import bench_attention
        for arm, env in ARMS.items():
            with bench_attention.env(**env):
                outs[arm] = cuflash.attention(q, k, v, **kw).astype(cupy.float32)
        times = {arm: [] for arm in ARMS}
        for rnd, order in enumerate(arm_orders(list(ARMS), args.rounds)):
            for arm in order:
                ms_, r = time_arm(arm, ARMS[arm], lambda i: cuflash.attention(q, k, v, **kw), flops,
                                  dict(row, round=rnd))
                rows.append(r)
                if ms_:
                    times[arm].append(ms_)
        ms = {a: (statistics.median(t) if t else None) for a, t in times.items()}
        diff = float(cupy.abs(outs["ws"] - outs["sm90"]).max())
        tf = {a: (flops / m / 1e9 if m else float("nan")) for a, m in ms.items()}
        line = (f"d {d:3d} L {L:5d} {name:8s} " + " ".join(f"{a} {tf[a]:6.1f}" for a in ARMS)
                + f"  ws/sm90 {tf['ws'] / tf['sm90']:.3f}  max|diff| {diff:.2e}")
        rows[-1]["max_abs_diff_vs_sm90"] = diff
        if torch is not None and name in ("plain", "causal"):
            tq, tk, tv = (torch.from_dlpack(x) for x in (q, k, v))
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                f = lambda i: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
                    tq, tk, tv, is_causal=kw["causal"])
                try:
                    f(0)
                    cms = median_event_ms(f, 1, 10, 2)
                    rows.append(dict(row, impl="sdpa_cudnn", ms=cms, tflops=flops / cms / 1e9))
                    line += f"  cuDNN {flops / cms / 1e9:6.1f} (ws/cuDNN {tf['ws'] * cms * 1e9 / flops:.3f})"
                except Exception as exc:
                    line += f"  cuDNN: {type(exc).__name__}"
        print(line, flush=True)
        dump_probe(args.json, "fwd_ws", ARMS, rows, False)
    dump_probe(args.json, "fwd_ws", ARMS, rows, True)
    print(f"# {len(rows)} rows in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
