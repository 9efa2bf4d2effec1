#!/usr/bin/env python3
"""Question (session 21, issue 10's window): where does an item of fwd_sm90ws's persistent
schedule spend the ~2 key tiles of time it costs beyond its tiles (``window_items.py``: F = 2.1
key tiles an item), and what does the window's masking add? Each phase of each item timed on
the SM's clock. Answer (session 21, ``ws_stamps.json``): ~5,000 cycles (1.7 tiles) an item at
any length, the consumers' boundary (epilogue, the store of O, the next item's number, the
first S and softmax); the window's two masked tiles ~1,870 more (bench/NOTES.md, session 21).

    PYTHONPATH=. python bench/probes/ws_stamps.py [--json out.json] [--rounds 5]

fwd_sm90ws.cu compiled with ``CUFLASH_WS_STAMPS`` (this probe only, through
``suite_common.compile_with_define``): the first thread of each warpgroup writes ``clock64()``
at its phases of each item of its block's first 64 (blocks < 132) into the module's
``cuflash_ws_stamps`` (132 x 4 x 64 x 16 words: the kernel's WS_STAMP and ``stamps_of``). Consumer phases (k):
0 item start, 1 its Work computed (PERSIST 3: two dependent loads of the host's lists), 2 its Q
landed, 3 the first K landed, 4 the first turn taken (PINGPONG), 5 the first S landed, 6 the
first tile's softmax and P done, 7 the key loop done (tiles 2 .. n), 8 the last V landed and
the turn taken, 9 the last P V landed, 10 O staged (epilogue: l, lse, O / l into shared memory),
11 O stored. Producer: 0 item start, 1 its Q buffer free, 2 the first stage free, 3 the item's
copies issued. One call a case (after warm-up) on d 128, bf16, B 1, H 16, Lq 16384, every case
persistent on the host's lists (``CUFLASH_FWD90WS_PERSIST=3``); medians over blocks, consumers
and items 1 .. last - 1 (the first and last item of a block start and end alone). The cases are
also timed (``--rounds``, rotated) with the stamps compiled out, to relate the phases to speed:
the window, plain items of 9 and 72 key tiles, and the window without ping-pong (no turns: does
one consumer's epilogue hold the other?).
"""
from __future__ import annotations

import argparse
import pathlib
import statistics
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from suite_common import arm_orders, compile_with_define, dump_probe, time_arm  # noqa: E402

L, H, D, BLOCK = 16384, 16, 128, 128
PERSIST = {"CUFLASH_FWD90_WS": "1", "CUFLASH_FWD90WS_PERSIST": "3"}
CASES = {   # name: (key length, keywords, environment)
    "window": (L, dict(causal=True, window=(1024, 0)), PERSIST),
    "plain9": (9 * BLOCK, dict(causal=False), PERSIST),
    "plain72": (72 * BLOCK, dict(causal=False), PERSIST),
    "window_pp0": (L, dict(causal=True, window=(1024, 0)),
                   dict(PERSIST, CUFLASH_TILES="fwd_sm90ws:128=128:2:2:0:0")),
}
CONSUMER = ["start", "work", "q", "k0", "turn0", "s0", "softmax0", "loop", "v_turn", "pv_last",
            "staged", "stored"]
PRODUCER = ["start", "qfree", "stage0", "copies"]
STAMP = "CUFLASH_WS_STAMPS"


def stamps_of(module):
    import cupy
    ptr = module.get_global("cuflash_ws_stamps")
    return cupy.ndarray((132, 4, 64, 16), cupy.uint64, ptr)


def phases(st, n_tiles: int) -> dict:
    """Median cycles of each phase (and the item's whole time) over blocks, consumers and the
    interior items whose stamps were written."""
    import numpy
    st = numpy.asarray(st, dtype=numpy.int64)
    out: dict[str, float] = {}
    cons, prod = st[:, 1:3], st[:, 0]
    valid = (cons[..., 0] > 0) & (cons[..., 11] > 0)          # (block, consumer, item)
    last = valid.sum(axis=2)                                   # items written a (block, consumer)
    items = numpy.arange(64)[None, None, :]
    interior = valid & (items >= 1) & (items < last[..., None] - 1)
    for k in range(1, 12):
        out[f"c_{CONSUMER[k - 1]}->{CONSUMER[k]}"] = float(numpy.median((cons[..., k] - cons[..., k - 1])[interior]))
    nxt = numpy.roll(cons[..., 0], -1, axis=2)
    out["c_stored->next_start"] = float(numpy.median((nxt - cons[..., 11])[interior]))
    out["c_item"] = float(numpy.median((nxt - cons[..., 0])[interior]))
    loop_tiles = max(n_tiles - 1, 1)   # (the loop runs tiles 2 .. n: the first is peeled)
    out["c_loop_per_tile"] = out["c_softmax0->loop"] / loop_tiles
    out["c_fixed_tiles"] = out["c_item"] / out["c_loop_per_tile"] - n_tiles
    pv = (prod[..., 0] > 0) & (prod[..., 3] > 0)
    pint = pv & (numpy.arange(64)[None, :] >= 1) & (numpy.arange(64)[None, :] < pv.sum(axis=1)[:, None] - 1)
    for k in range(1, 4):
        out[f"p_{PRODUCER[k - 1]}->{PRODUCER[k]}"] = float(numpy.median((prod[..., k] - prod[..., k - 1])[pint]))
    # how long before the consumers' first K of an item its copy was issued (the producer's lead)
    lead = cons[..., 3] - prod[:, None, :, 2]
    out["lead_stage0_to_k0"] = float(numpy.median(lead[interior]))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    import cupy
    import ml_dtypes
    import numpy
    import bench_attention
    import cuflash
    from cuflash import _api
    rng = numpy.random.default_rng(0)

    def arr(n):
        return cupy.asarray(rng.standard_normal((1, H, n, D)).astype(ml_dtypes.bfloat16))

    q = arr(L)
    kv = {n: (arr(n), arr(n)) for n in {c[0] for c in CASES.values()}}
    calls = {name: (lambda Lk=Lk, kw=kw: cuflash.attention(q, *kv[Lk], **kw))
             for name, (Lk, kw, _) in CASES.items()}
    rows = []
    # -- timing, the stamps compiled out
    for name, (Lk, kw, env) in CASES.items():   # (compiles each case's kernel)
        with bench_attention.env(**env):
            calls[name]()
    times = {name: [] for name in CASES}
    for rnd, order in enumerate(arm_orders(list(CASES), args.rounds)):
        for name in order:
            Lk, kw, env = CASES[name]
            ms, row = time_arm(name, env, lambda i, f=calls[name]: f(), 0.0,
                               dict(point=name, Lk=Lk, round=rnd))
            rows.append(row)
            if ms:
                times[name].append(ms)
    med = {n: statistics.median(t) for n, t in times.items() if t}
    # -- the stamps
    modules: dict = {}
    restore = compile_with_define("fwd_sm90ws.cu", lambda: STAMP, modules)
    try:
        for name, (Lk, kw, env) in CASES.items():
            n_tiles = 9 if name.startswith("window") else Lk // BLOCK
            with bench_attention.env(**env):
                _api.clear_plans()
                calls[name]()                      # compile, warm
                cupy.cuda.Device().synchronize()
                for m, _ in modules.values():
                    stamps_of(m).fill(0)
                ev = cupy.cuda.Event(), cupy.cuda.Event()
                ev[0].record()
                calls[name]()
                ev[1].record()
                ev[1].synchronize()
                stamped_ms = cupy.cuda.get_elapsed_time(*ev)
                st = [stamps_of(m).get() for m, _ in modules.values()]
                st = [s for s in st if s.any()]
                if len(st) != 1:
                    raise SystemExit(f"{name}: {len(st)} modules wrote stamps")
                ph = phases(st[0], n_tiles)
                used = st[0][st[0] > 0]
                span = int(used.max() - used.min())
            ph.update(ms=med.get(name), stamped_ms=stamped_ms, span_cycles=span,
                      ghz=span / stamped_ms / 1e6, n_tiles=n_tiles)
            rows.append(dict(point=name, impl="stamps", **ph))
            print(f"{name}: {med.get(name, float('nan')):.3f} ms ({stamped_ms:.3f} stamped, "
                  f"~{ph['ghz']:.2f} GHz); item {ph['c_item']:.0f} cycles, a loop tile "
                  f"{ph['c_loop_per_tile']:.0f}, fixed {ph['c_fixed_tiles']:.2f} tiles", flush=True)
            print("   " + "  ".join(f"{k} {v:.0f}" for k, v in ph.items()
                                    if "->" in k or k.startswith("lead")), flush=True)
            dump_probe(args.json, "ws_stamps", {n: c[2] for n, c in CASES.items()}, rows, False)
    finally:
        restore()
        _api.clear_plans()
    dump_probe(args.json, "ws_stamps", {n: c[2] for n, c in CASES.items()}, rows, True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
