#!/usr/bin/env python3
"""Question (session 12, issue 10's remaining misses): where does the d = 128 backward lose
~10% to FlexAttention at L 4k (causal: ~301 vs ~333 TFLOP/s for the backward alone) while it
wins at 16k? bench/NOTES.md "The d 128 backward at 4k (session 12, helper s12-bwd128)" puts
it in a fixed cost of ~0.35-0.43 ms a backward that is the SAME at 4k and 16k (both are 2048
blocks and 16k query tokens a call): the passes around the main kernel (P: the zeroing with
D = rowsum(dO o O), dQ's rounding) and a per-block cost F (15.5 blocks an SM), and asks the GPU
which. This probe measures both, and the two cuts that need no new kernel:

    PYTHONPATH=. python bench/probes/bwd128_fixed.py [--json out.json] [--no-flex]
        [--points d:L:causal,...] [--no-fexp] [--no-prefix]
    PYTHONPATH=. python bench/probes/bwd128_fixed.py --model      # no GPU: the model's numbers

One process, bf16, the mods suite's shapes (B = 16384 / L, H = 2048 / d), random N(0, 1)
inputs, two input sets (a call does not find the last call's inputs in L2). Arms (plan-time
switches; ``bench_attention.env`` clears the plan cache around each):

- ``old``: the defaults;
- ``fuse``: ``CUFLASH_FUSE_DQ=1``: bwd_sm90 rounds dQ itself (the block arriving last at a
  query tile's counter), no bwd_finish_dq launch (session 7's build; by default only where
  the backward is one wave). Plain attention only: a modifier's build ignores it;
- ``bm``: ``CUFLASH_GRID_ORDER=0``: batch-major grid order, forward and backward (tile-major
  under causal is the default): the key tiles of one head run together, so Q_i, dO_i and
  dQ's accumulator rows are shared in L2 by ~32 blocks instead of ~2 at 4k (~8 at 16k). The
  makespan model prices the order's tail alone at +5.7% (4k causal d 128): what ``bm`` gains
  over that is what L2 reuse is worth. Causal points and prefix-LM (tile-major by default);
- ``tm``: ``CUFLASH_GRID_ORDER=1``: tile-major for plain attention without causal (batch-major
  by default): equal blocks, so no tail to gain; what it gains is the lockstep it breaks (a
  head's 32 / 128 key blocks walking the same query tiles, their dQ reds on the same rows).
  Session 10-11's prefix-LM measured tile-major 23-49 us (4k) and 65-119 us (16k) better than
  its tail model: this asks whether plain attention has the same.

Per (point, arm): ``bwd``: attention_backward alone (o, lse from the default forward), the
median of back-to-back calls between CUDA events; ``fwd_bwd``: attention_vjp's forward then
backward; ``dot`` / ``main`` / ``finish``: each kernel of the backward (events between the
launches of the same back-to-back calls: GPU time of each, medians); ``rest``: bwd - the three
(launch gaps, allocations the GPU waits for); ``max_diff``: max |arm - old| over dq, dk, dv
(the atomics reorder dQ's sums: ~1e-3 in bf16 is rounding, not a bug). TFLOP/s on visible
pairs (fwd+bwd 3.5 x 4 B H d pairs, the backward 2.5 x).

``fexp`` (unless --no-fexp): the per-block cost F measured directly. d 128, not causal, the
default arm, three shapes with the same tiles (131,072 of 64 x 128) and the same query tokens
(the passes' bytes) but 1024 / 2048 / 4096 blocks: (B, Lq, Lk) = (2, 8192, 4096), (4, 4096,
4096), (8, 2048, 4096). Batch-major and equal blocks: 8 / 16 / 32 waves of 128 / 64 / 32
tiles, each 1024 tile-times, so main = W x F + 1024 t: the slope over the waves W is F, the
intercept the tiles. Printed: F and t (least squares), and what F x 15.5 blocks an SM is of
the 4k causal backward.
Peers: FlexAttention fwd+bwd at d 128 4k causal and prefix-LM (suite_mods' timing), unless
--no-flex. ~40-60 s on an H200 (the kernels compile first, in threads, beside Flex's two
torch.compile's).
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

_BASE = {"CUFLASH_FUSE_DQ": None, "CUFLASH_GRID_ORDER": None}
ARMS = {"old": dict(_BASE), "fuse": dict(_BASE, CUFLASH_FUSE_DQ="1"),
        "bm": dict(_BASE, CUFLASH_GRID_ORDER="0"), "tm": dict(_BASE, CUFLASH_GRID_ORDER="1")}


def arms_of(name: str, causal: bool) -> list[str]:
    """The arms that differ from ``old`` at a point: causal is tile-major already (tm = old),
    plain without causal batch-major (bm = old), a block mask's build ignores FUSE_DQ."""
    if name == "fexp":
        return ["old"]
    if name == "prefix":
        return ["old", "bm"]
    return ["old", "fuse", "bm"] if causal else ["old", "fuse", "tm"]
#: (d, L, causal) of plain attention
POINTS = [(d, L, c) for d in (128, 64) for L in (4096, 16384) for c in (True, False)]
#: (B, Lq, Lk) at d 128, H 16, not causal: equal tiles and query tokens, 1024 / 2048 / 4096 blocks
FEXP = [(2, 8192, 4096), (4, 4096, 4096), (8, 2048, 4096)]
SMS = 132


# -- the model (no GPU): block = F + t x tiles, one block an SM, dispatched in grid order to
#    the first free SM; P the passes. Fit to bench/results/h200/fwd_bwd.json minus fwd.json.
def makespan(costs) -> float:
    import heapq
    free = [0.0] * SMS
    for c in costs:
        heapq.heappush(free, heapq.heappop(free) + c)
    return max(free)


def blocks(L: int, heads: int, causal: bool, order: str = "tm", bm: int = 64) -> list[int]:
    """Query tiles (B_r = bm rows) of each 128-key block, in grid order."""
    nk, nq = L // 128, L // bm
    per = [nq - (128 // bm) * j if causal else nq for j in range(nk)]
    if order == "tm":
        return [n for n in per for _ in range(heads)]
    return [n for _ in range(heads) for n in per]


def print_model() -> None:
    meas = {(True, 4096): 2212, (True, 16384): 7420, (False, 4096): 3915, (False, 16384): 14560}
    P = 150.0   # zeroing + D (~80 us) and bwd_finish_dq (~70 us, session 8's ncu) at 16k tokens
    best = None
    for F in range(0, 31):
        for t100 in range(300, 420):
            t = t100 / 100
            err = sum(((P + makespan([F + n * t for n in
                                      blocks(L, 64 if L == 4096 else 16, c, "tm" if c else "bm")]))
                       / T - 1) ** 2 for (c, L), T in meas.items())
            if best is None or err < best[0]:
                best = (err, F, t)
    _, F, t = best
    print(f"fit (P = {P:.0f} us fixed): F = {F} us a block, t = {t} us a 64 x 128 tile")
    print(f"{'causal':>6} {'L':>6} {'measured':>9} {'model':>6} {'bound':>6} {'P+15.5F':>8}"
          f" {'tiles':>6} {'tail':>5}  (us, backward alone, d 128)")
    for (c, L), T in meas.items():
        b = blocks(L, 64 if L == 4096 else 16, c, "tm" if c else "bm")
        ms = makespan([F + n * t for n in b])
        bound = sum(F + n * t for n in b) / SMS
        print(f"{str(c):>6} {L:6} {T:9} {P + ms:6.0f} {P + bound:6.0f} {P + len(b) * F / SMS:8.0f}"
              f" {sum(b) * t / SMS:6.0f} {ms - bound:5.0f}")
    for F_ in (F, 5):
        b_tm, b_bm = blocks(4096, 64, True), blocks(4096, 64, True, "bm")
        tm, bmk = makespan([F_ + n * t for n in b_tm]), makespan([F_ + n * t for n in b_bm])
        print(f"4k causal, F = {F_}: tile-major {tm:.0f}, batch-major {bmk:.0f} (+{bmk / tm - 1:.1%}:"
              f" the order's tail alone)")


# -- the GPU run
def kernel_spans():
    """Patch cuflash's Launch so that every kernel it issues is bracketed by CUDA events; returns
    (the list the spans go to as (kind, e0, e1), a function that restores the launcher)."""
    import cupy
    from cuflash import _launch
    spans: list = []
    orig = _launch.Launch.__call__

    def call(self, stream, words, extra=()):
        with self.lock:
            _launch._patch(len(words)).pack_into(self._bytes, 0, *words)
            for i, w in extra:
                _launch._WORD.pack_into(self._bytes, 8 * i, w)
            for pos, (fn, grid, block, smem) in enumerate(self.kernels):
                kind = ("finish" if "finish" in self.name else
                        "dot" if "dot_do_o" in self.name and pos == 0 else "main")
                e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
                e0.record(cupy.cuda.ExternalStream(stream) if stream else None)
                self._launch_kernel(fn, grid, 1, 1, block, 1, 1, smem, stream, self.argv_ptr, 0)
                e1.record(cupy.cuda.ExternalStream(stream) if stream else None)
                spans.append((kind, e0, e1))

    _launch.Launch.__call__ = call
    return spans, lambda: setattr(_launch.Launch, "__call__", orig)


def time_calls(fn, spans, iters: int):
    """Median ms of back-to-back calls, and the median ms of each kernel kind in them. Warmed
    for 3 calls and >= 30 ms of wall time first (suite_common.WARM_MS: an idle H200's clock
    is low after the compiles)."""
    import cupy
    import statistics
    start, i = time.perf_counter(), 0
    while i < 3 or (i < 200 and time.perf_counter() - start < 0.03):
        fn(i)
        i += 1
        cupy.cuda.Device().synchronize()
    spans.clear()
    starts = [cupy.cuda.Event() for _ in range(iters)]
    ends = [cupy.cuda.Event() for _ in range(iters)]
    for i in range(iters):
        starts[i].record()
        fn(i)
        ends[i].record()
    ends[-1].synchronize()
    total = statistics.median(cupy.cuda.get_elapsed_time(s, e) for s, e in zip(starts, ends))
    kinds: dict = {}
    for kind, e0, e1 in spans:
        kinds.setdefault(kind, []).append(cupy.cuda.get_elapsed_time(e0, e1))
    per = {k: statistics.median(v) * len(v) / iters for k, v in kinds.items()}   # ms a call
    spans.clear()
    return total, per


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json")
    ap.add_argument("--points", default="", help="d:L:causal,... (default: d 64, 128; L 4k, 16k; both)")
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--no-fexp", action="store_true")
    ap.add_argument("--no-prefix", action="store_true")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--model", action="store_true", help="the makespan model only (no GPU)")
    a = ap.parse_args(argv)
    if a.model:
        print_model()
        return 0
    import functools
    import cupy
    import ml_dtypes
    import numpy
    import bench_attention
    import cuflash
    import suite_mods
    from suite_common import bf16_zeros, compile_flex, warm_arms

    t_start = time.perf_counter()
    points = ([(int(d), int(L), c in ("1", "True", "true")) for d, L, c in
               (x.split(":") for x in a.points.split(","))] if a.points else list(POINTS))
    cases = [("plain", d, L, c, max(1, suite_mods.TOKENS // L), L, L) for d, L, c in points]
    if not a.no_prefix:
        cases.append(("prefix", 128, 4096, False, 4, 4096, 4096))
    if not a.no_fexp:
        cases += [("fexp", 128, Lq, False, B, Lq, Lk) for B, Lq, Lk in FEXP]
    masks: dict = {}

    def kwargs(name, L, H, causal):
        if name != "prefix":
            return {"causal": causal}
        if L not in masks:
            mod = suite_mods.mods_for(L, H)["prefix"]
            masks[L] = (mod, cuflash.block_mask(mod.mask_mod, (1, 1), L, L))
        return {"block_mask": masks[L][1], "causal": False}

    torch = compiled = cbm = None
    if not a.no_flex:
        import torch
        from torch.nn.attention.flex_attention import create_block_mask as cbm
        compiled = compile_flex(torch)
    flex_points = [] if compiled is None else [("plain", 128, 4096), ("prefix", 128, 4096)]

    def flex_warm():
        for name, d, L in flex_points:
            H, B = suite_mods.WIDTH // d, suite_mods.TOKENS // L
            mod = suite_mods.mods_for(L, H)[name]
            mm = mod.mask_mod or (lambda b, h, q, kv: q >= kv)
            leaves = [torch.zeros((B, H, L, d), dtype=torch.bfloat16, device="cuda",
                                  requires_grad=True) for _ in range(3)]
            o = compiled(*leaves, score_mod=None, block_mask=cbm(mm, None, None, L, L, device="cuda"))
            o.backward(torch.ones_like(o))
        torch.cuda.synchronize()

    def warm_one(name, d, L, causal, B, Lq, Lk):
        H = suite_mods.WIDTH // d
        q = bf16_zeros((B, H, Lq, d))
        k, v = bf16_zeros((B, H, Lk, d)), bf16_zeros((B, H, Lk, d))
        cuflash.attention_vjp(q, k, v, **kwargs(name, L, H, causal))[1](cupy.ones_like(q))

    for name, d, L, causal, B, Lq, Lk in cases:      # block masks (NumPy) before the threads
        kwargs(name, L, suite_mods.WIDTH // d, causal)
    warm_arms(tuple(ARMS), ARMS, [functools.partial(warm_one, *c) for c in cases],
              flex_warm if compiled is not None else None, workers=8)
    print(f"# kernels compiled ({time.perf_counter() - t_start:.0f} s)", flush=True)
    print(f"{'case':6} {'d':>4} {'L':>6} {'causal':>6} {'arm':>5}  {'bwd ms':>7} {'TF/s':>6}"
          f" {'fwd+bwd':>8} {'TF/s':>6}  {'dot':>6} {'main':>7} {'finish':>6} {'rest':>6}"
          f"  {'bwd/old':>7} {'max_diff':>8}", flush=True)
    spans, restore = kernel_spans()
    rows, bf16 = [], ml_dtypes.bfloat16
    try:
        for name, d, L, causal, B, Lq, Lk in cases:
            H = suite_mods.WIDTH // d
            rs = cupy.random.RandomState(L + d + int(causal))   # (suite_varlen's way)

            def rand(n):
                return rs.standard_normal((B, H, n, d), dtype=cupy.float32).astype(bf16)
            sets = [(rand(Lq), rand(Lk), rand(Lk), rand(Lq)) for _ in range(2)]
            kw = kwargs(name, L, H, causal)
            if name == "prefix":
                pairs = suite_mods.visible_pairs(masks[L][0], L)
            else:
                pairs = Lq * (Lq + 1) // 2 if causal else Lq * Lk
            fwd_flops = 4 * B * H * d * pairs
            with bench_attention.env(**ARMS["old"]):
                fwd = [cuflash.attention(q, k, v, return_lse=True, **kw) for q, k, v, _ in sets]
            base = dict(case=name, d=d, L=L, Lq=Lq, Lk=Lk, B=B, H=H, causal=causal)
            ref = None
            got = {}
            for arm in arms_of(name, causal):
                envs = ARMS[arm]
                try:
                    with bench_attention.env(**envs):
                        def bwd(i):
                            q, k, v, do = sets[i % 2]
                            o, lse = fwd[i % 2]
                            return cuflash.attention_backward(do, q, k, v, o, lse, **kw)
                        grads = [g.astype(cupy.float32) for g in bwd(0)]
                        ms, per = time_calls(bwd, spans, a.iters)
                        fb, _ = time_calls(lambda i: cuflash.attention_vjp(
                            *sets[i % 2][:3], **kw)[1](sets[i % 2][3]), spans, a.iters)
                    if ref is None:
                        ref, diff = grads, 0.0
                    else:
                        diff = max(float(cupy.abs(x - y).max()) for x, y in zip(grads, ref))
                    got[arm] = ms
                    rest = ms - sum(per.values())
                    row = dict(base, arm=arm, bwd_ms=ms, bwd_tflops=2.5 * fwd_flops / ms / 1e9,
                               fwd_bwd_ms=fb, fwd_bwd_tflops=3.5 * fwd_flops / fb / 1e9,
                               dot_ms=per.get("dot"), main_ms=per.get("main"),
                               finish_ms=per.get("finish"), rest_ms=rest, max_diff=diff)
                    rows.append(row)
                    print(f"{name:6} {d:4} {L:6} {str(causal):>6} {arm:>5}  {ms:7.3f}"
                          f" {row['bwd_tflops']:6.1f} {fb:8.3f} {row['fwd_bwd_tflops']:6.1f}"
                          f"  {per.get('dot', 0):6.3f} {per.get('main', 0):7.3f}"
                          f" {per.get('finish', 0):6.3f} {rest:6.3f}"
                          f"  {got['old'] / ms if 'old' in got else 0:7.3f} {diff:8.2e}", flush=True)
                except Exception as exc:      # a failing arm is a row, not the end of the run
                    rows.append(dict(base, arm=arm, note=f"{type(exc).__name__}: {str(exc)[:300]}"))
                    print(f"{name:6} {d:4} {L:6} {arm:>5}  {type(exc).__name__}: {str(exc)[:120]}",
                          flush=True)
            if (name, d, L) in flex_points and (name != "plain" or causal):
                mod = suite_mods.mods_for(L, H)[name]
                (frow,) = suite_mods._flex_point(torch, compiled, cbm, mod, "fwd_bwd", d, L, B, H,
                                                 [s[:3] for s in sets], None, 3.5 * fwd_flops)
                rows.append(dict(base, arm="flex", fwd_bwd_ms=frow["ms"], fwd_bwd_tflops=frow["tflops"],
                                 **({"note": frow["note"]} if "note" in frow else {})))
                print(f"{name:6} {d:4} {L:6} {str(causal):>6} {'flex':>5}  {'':7} {'':6}"
                      f" {frow['ms'] or 0:8.3f} {frow['tflops'] or 0:6.1f}", flush=True)
            dump(a.json, rows, complete=False)
            del sets, fwd, ref
            cupy.get_default_memory_pool().free_all_blocks()
    finally:
        restore()
    fx = [r for r in rows if r["case"] == "fexp" and r.get("main_ms")]
    if len(fx) >= 2:   # main = W x F + 1024 t, W = the waves
        W = numpy.array([-(-r["B"] * r["H"] * (r["Lk"] // 128) // SMS) for r in fx], float)
        y = numpy.array([r["main_ms"] * 1e3 for r in fx])
        F, c = numpy.polyfit(W, y, 1)
        fit = {"F_us": float(F), "t_us": float(c / 1024), "blocks_an_sm_4k": 2048 / SMS,
               "F_share_of_4k_causal_us": float(F * 2048 / SMS)}
        rows.append(dict(case="fexp_fit", **fit))
        print(f"# F = {F:.1f} us a block, t = {c / 1024:.3f} us a tile (main = W F + 1024 t);"
              f" 15.5 blocks an SM x F = {F * 2048 / SMS:.0f} us of the 4k backward", flush=True)
    print(f"# {time.perf_counter() - t_start:.0f} s", flush=True)
    dump(a.json, rows, complete=True)
    return 0


def dump(path, rows, complete: bool) -> None:
    if path:
        pathlib.Path(path).write_text(json.dumps(
            {"meta": {"probe": "bwd128_fixed", "session": 12, "dtype": "bfloat16", "arms": ARMS,
                      "complete": complete}, "rows": rows}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
