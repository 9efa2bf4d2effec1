#!/usr/bin/env python3
"""Question: does decode_sm80's fixed cost a call come down with session 11's two cuts (the
first K/V copies issued before cache_seqlens arrives; the fused merge's arrival and counter
reset as one atomic), and where does that leave issue 11's >= 1.0x the better peer? (--set
s10: session 10's question, its points and arms, below.)

--set s11 (the default), in one process, plans forgotten (``cuflash._api.clear_plans()``)
between the variants, at issue 11's open points (bf16, d 128, one query token, dense caches:
B 8 32/8 8k / 64k / 128k, B 8 32/32 8k, B 64 32/8 8k, B 1 32/8 128k):
  cuflash_old    CUFLASH_DECODE_EARLY=0 CUFLASH_DECODE_ARRIVE=fence: session 10's code (its
                 machine code exactly: the defines 0);
  cuflash        CUFLASH_DECODE_EARLY=all CUFLASH_DECODE_ARRIVE=wrap, session 11's two cuts
                 (session 12's run of this probe: EARLY=one became the default): the prologue's K/V copies for a full row issued before the
                 row's length arrives (decode_mma.cu's EARLY_KV; re-issued where the real
                 range differs), and the arrival by atomicInc (ARRIVE_WRAP: no atomicExch for
                 the last block's acquire fence to wait on);
  cuflash_early  cuflash with CUFLASH_DECODE_ARRIVE=fence: the early copies alone;
  cuflash_one    cuflash with CUFLASH_DECODE_EARLY=one: the early copies where the grid has one
                 split only;
  cuflash_deep   cuflash with CUFLASH_DECODE_STAGES=long: the 5-stage ring where the grid is
                 at most one block an SM and a block reads >= 512 key iterations (B 8 32/8
                 64k / 128k at 2 splits; session 9 measured the deep ring there +0.2 / +0.65%,
                 and -4% at B 1's short shares, which keep 3 stages); elsewhere as cuflash;
then SDPA cuDNN and SDPA flash (skipped without torch). The last lines print, per point, each
cuflash row's ratio to the better peer (back to back / one call at a time) and its time saved
against cuflash_old (us, back to back).

--set s10: session 10's question: do decode_sm80's session-10 defaults (the split count that
fills one block an SM with the fewest key iterations; the page walk a warp's 32 pages at a time)
beat session 9's, and the peers? And does the slot grid (every resident slot, two blocks an SM)
pay?

At each point of issue 11's decode targets (bf16, d 128, one query token), in one process,
plans forgotten (``cuflash._api.clear_plans()``) between the variants:
  cuflash_old    CUFLASH_DECODE_SPLITS=s9 CUFLASH_DECODE_PAGES=s9: session 9's default (B 1
                 32/8: 14-15 splits, 112-120 blocks; a page-table read a tile, one iteration
                 ahead of its copies);
  cuflash        the default: B 1 32/8 16 splits (128 blocks of 64 / 128 key iterations at
                 64k / 128k; every other point the same count as before); paged: a warp's
                 pages read 32 tiles ahead, a lane a tile (decode_mma.cu's PAGE_WALK);
  cuflash_slots  CUFLASH_DECODE_SPLITS=slots: where the groups are fewer than the SMs, the
                 stream build over k whole groups' worth of blocks, k = floor(264 / groups)
                 (B 1 32/8: 264 blocks, 33 a group; B 1 32/32 and B 8 32/8: 256 blocks, 8 / 4
                 a group), two blocks an SM, balanced key ranges; elsewhere the default;
then SDPA cuDNN and SDPA flash (dense only; skipped without torch). Paged points (pages of 16
and 256, B 8 32/8, Lk 1k and 8k) run cuflash_old and cuflash on the paged cache, and
``cuflash_dense`` (the default on the dense cache of the same point) beside them. Random
N(0, 1) bf16 data; inputs rotate past the L2 as in bench/suite_decode.py (random page
tables, as there). The variants' kernels are compiled first, in parallel processes, into
CuPy's disk cache.

Two timings a row: ``ms`` = suite_decode's (median CUDA-event time around each call, calls
issued back to back), and ``iso_ms`` = one call at a time (device synchronised before each:
the latency a B = 1 decode step sees, launch included). TB/s = K/V bytes / ``ms``. The last
lines print, per dense point, each cuflash row's ratio to the better peer (back to back and
iso), and per paged point each row's ratio to the dense default (>= 0.90 at page 16 and
>= 0.97 at page 256 are issue 11's targets).

    PYTHONPATH=. python bench/probes/decode_ab.py --json decode_ab_s11.json   (s11: ~30-50 s)
    PYTHONPATH=. python bench/probes/decode_ab.py --set s10 --json decode_ab.json  (~40-70 s)
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
import suite_decode as sd  # noqa: E402  (bench/)

POINTS = [  # B, Hq, Hkv, Lk, page size (0: dense)
    (1, 32, 8, 65536, 0), (1, 32, 8, 131072, 0), (8, 32, 8, 8192, 0), (8, 32, 8, 65536, 0),
    (8, 32, 8, 131072, 0), (8, 32, 32, 8192, 0), (64, 32, 8, 8192, 0), (64, 32, 8, 65536, 0),
    (64, 32, 32, 8192, 0), (8, 32, 8, 1024, 16), (8, 32, 8, 1024, 256), (8, 32, 8, 8192, 16),
    (8, 32, 8, 8192, 256)]
MODES = (("cuflash_old", {"CUFLASH_DECODE_SPLITS": "s9", "CUFLASH_DECODE_PAGES": "s9"}),
         ("cuflash", {}),
         ("cuflash_slots", {"CUFLASH_DECODE_SPLITS": "slots"}))
#: session 11's points (dense) and arms (--set s11)
POINTS_S11 = [(8, 32, 8, 8192, 0), (8, 32, 8, 65536, 0), (8, 32, 8, 131072, 0),
              (8, 32, 32, 8192, 0), (64, 32, 8, 8192, 0), (1, 32, 8, 131072, 0)]
_S11 = {"CUFLASH_DECODE_EARLY": "all", "CUFLASH_DECODE_ARRIVE": "wrap"}   # (off by default)
MODES_S11 = (("cuflash_old", {"CUFLASH_DECODE_EARLY": "0", "CUFLASH_DECODE_ARRIVE": "fence"}),
             ("cuflash", _S11),
             ("cuflash_early", {**_S11, "CUFLASH_DECODE_ARRIVE": "fence"}),
             # early copies only where the grid has one split (no serving-cache cost: the
             # lead's question, whether "all" buys enough over it to be the default)
             ("cuflash_one", {**_S11, "CUFLASH_DECODE_EARLY": "one"}),
             ("cuflash_deep", {**_S11, "CUFLASH_DECODE_STAGES": "long"}))
#: the modes run at the paged points
PAGED_MODES = MODES[:2]
SWITCHES = ("CUFLASH_DECODE_MERGE", "CUFLASH_DECODE_STREAM", "CUFLASH_DECODE_L2",
            "CUFLASH_DECODE_ARRIVE", "CUFLASH_DECODE_STAGES", "CUFLASH_DECODE_SPLITS",
            "CUFLASH_DECODE_PAGES", "CUFLASH_DECODE_EARLY")
#: decode_mma's (FUSE, STREAM[, STAGES]) tails of the name expression that the points can use
#: (the 5-stage ring: CUFLASH_DECODE_STAGES=auto / long on an H200)
BUILDS = ("false", "true", "true, true", "false, false, 5", "true, false, 5")


def switches(env: dict):
    """The block with exactly ``env``'s decode switches set (the others unset), plans cleared
    on the way in and out: bench_attention.env."""
    import bench_attention as ba
    return ba.env(**{**dict.fromkeys(SWITCHES), **env})


def precompile(modes, stream: bool = True) -> float:
    """Compile every variant's decode_mma builds (one split, fused, stream) at once, in parallel
    processes that fill CuPy's kernel cache on disk, so that the timed loop does not wait on
    NVRTC a variant after another (~6 s a compile). Returns the seconds it took."""
    import concurrent.futures
    import subprocess
    from cuflash import _inference_grid
    t0 = time.perf_counter()
    expr = "cuflash::decode::decode_mma<__nv_bfloat16, 128, cuflash::Variant<false>, {}>"
    jobs = set()
    for _, env in modes:
        with switches(env):
            for flags in BUILDS:
                if ((flags == "true, true" and not stream)
                        or (flags.endswith(", 5") and "CUFLASH_DECODE_STAGES" not in env)):
                    continue                    # (a build no point of the set runs)
                fused = flags.startswith("true")
                for splits in (1, 2, 0):        # one split, several, the stream grid
                    jobs.add((expr.format(flags), _inference_grid.prelude(fused, splits)))
    code = ("import sys\nfrom cuflash import _jit\n"
            "_jit.get_kernel('decode_mma.cu', sys.argv[1], 0, sys.argv[2])\n")

    def one(job):
        return subprocess.run([sys.executable, "-c", code, *job], capture_output=True,
                              text=True, timeout=240).returncode
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as ex:
        codes = list(ex.map(one, sorted(jobs)))
    if any(codes):
        print(f"precompile: {sum(map(bool, codes))} of {len(jobs)} jobs failed (the timed loop "
              f"compiles those itself)")
    return time.perf_counter() - t0


def isolated_ms(fn, n_sets: int, iters: int = 20, warmup: int = 3) -> float:
    """Median CUDA-event time of one call with the device idle before it."""
    import cupy
    for i in range(warmup):
        fn(i % n_sets)
    ts = []
    for i in range(iters):
        cupy.cuda.Device().synchronize()
        s, e = cupy.cuda.Event(), cupy.cuda.Event()
        s.record()
        fn(i % n_sets)
        e.record()
        e.synchronize()
        ts.append(cupy.cuda.get_elapsed_time(s, e))
    return sorted(ts)[len(ts) // 2]


def summary(rows) -> None:
    """Per dense point: the better peer's time over each cuflash row's (> 1: cuflash faster),
    back to back and one call at a time; per paged point: the dense default's time over each
    paged row's (issue 11: >= 0.90 at page 16, >= 0.97 at page 256)."""
    points = sorted({(r["B"], r["Hq"], r["Hkv"], r["Lk"], r.get("page_size", 0)) for r in rows})
    for pt in points:
        mine = [r for r in rows if (r["B"], r["Hq"], r["Hkv"], r["Lk"], r.get("page_size", 0))
                == pt and r.get("ms")]
        if pt[4]:
            ref = [r for r in mine if r["impl"] == "cuflash_dense"]
            if ref:
                cells = [f"{r['impl'][8:] or 'new'} {ref[0]['ms'] / r['ms']:.3f}"
                         for r in mine if r["impl"] in ("cuflash", "cuflash_old")]
                print(f"B={pt[0]} {pt[1]}/{pt[2]} Lk={pt[3]} page {pt[4]} vs the dense default "
                      f"(>1 faster): " + "; ".join(cells))
            continue
        peers = [r for r in mine if r["impl"].startswith("sdpa")]
        if not peers:
            continue
        best = min(r["ms"] for r in peers)
        best_iso = min(r["iso_ms"] for r in peers)
        old = [r for r in mine if r["impl"] == "cuflash_old"]
        cells = [f"{r['impl'][8:] or 'new'} {best / r['ms']:.3f}/{best_iso / r['iso_ms']:.3f}"
                 + (f" ({(old[0]['ms'] - r['ms']) * 1e3:+.1f} us)" if old and r is not old[0]
                    else "")
                 for r in mine if r["impl"].startswith("cuflash")]
        print(f"B={pt[0]} {pt[1]}/{pt[2]} Lk={pt[3]} vs the better peer (b2b/iso, >1 faster): "
              + "; ".join(cells))


def main(argv=None) -> int:
    a = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    a.add_argument("--json", help="write the rows here")
    a.add_argument("--max-gb", type=float, default=20.0, help="skip points with more K/V")
    a.add_argument("--set", choices=("s11", "s10"), default="s11",
                   help="session 11's points and arms (default) or session 10's")
    a.add_argument("--no-precompile", action="store_true",
                   help="compile each variant when first timed (sequentially)")
    args = a.parse_args(argv)
    import cupy
    import numpy
    import cuflash._inference as inf
    peers = {}
    for name, backend in (("sdpa_cudnn", "CUDNN_ATTENTION"), ("sdpa_flash", "FLASH_ATTENTION")):
        fn, why = sd._sdpa(backend)
        peers[name] = fn
        if fn is None:
            print(f"{name}: skipped ({why})")
    t_start = time.perf_counter()
    points, modes = (POINTS_S11, MODES_S11) if args.set == "s11" else (POINTS, MODES)
    if not args.no_precompile:
        seconds = precompile(modes, stream=args.set == "s10")
        print(f"precompiled the variants in {seconds:.0f} s", flush=True)
    rows = []
    dense_done = {}
    for B, Hq, Hkv, Lk, ps in points:
        G, D = Hq // Hkv, sd.D
        nbytes = B * Hkv * Lk * D * 4
        if nbytes > args.max_gb * 1e9:
            print(f"B={B} Hq={Hq} Hkv={Hkv} Lk={Lk}: skipped ({nbytes / 1e9:.0f} GB)")
            continue
        n_sets = max(1, min(64, -(-sd.ROTATE_BYTES // nbytes)))
        qs = [sd._fill(cupy, (B, Hq, 1, D), 10 + i) for i in range(n_sets)]
        seqlens = cupy.full((B,), Lk, numpy.int32)
        line = []

        def add(impl, fn, **extra):
            ms, iso = sd._time(fn, n_sets), isolated_ms(fn, n_sets)
            rows.append(dict(B=B, Hq=Hq, Hkv=Hkv, Lk=Lk, page_size=ps, impl=impl, ms=ms,
                             iso_ms=iso, tbps=nbytes / ms / 1e9, **extra))
            line.append(f"{impl} {nbytes / ms / 1e9:.2f} TB/s {ms * 1e3:.1f} us "
                        f"(iso {iso * 1e3:.1f})")

        def q_of(i):     # as bench/suite_decode.py: GQA as (B, Hkv, G, 1, d)
            return qs[i] if G == 1 else qs[i].reshape(B, Hkv, G, 1, D)
        if ps:           # a paged cache, as suite_decode's: pages (B per, Hkv, 1, ps, d)
            per = -(-Lk // ps)
            shape = (B * per, Hkv) + ((1,) if G > 1 else ()) + (ps, D)
            kps = [sd._fill(cupy, shape, 300 + i) for i in range(n_sets)]
            vps = [sd._fill(cupy, shape, 400 + i) for i in range(n_sets)]
            bts = [cupy.asarray(numpy.random.default_rng(i).permutation(B * per)
                                .reshape(B, per).astype(numpy.int32)) for i in range(n_sets)]

            def ours(i):
                return inf.attention_with_kvcache(q_of(i), kps[i], vps[i], cache_seqlens=seqlens,
                                                  block_table=bts[i])
            for impl, env in PAGED_MODES:
                with switches(env):
                    kernel = sd._kernel(inf, q_of(0), kps[0], vps[0], seqlens, bts[0])
                    add(impl, ours, kernel=kernel, env=env)
            del kps, vps, bts
        if not ps or (B, Hq, Hkv, Lk) not in dense_done:
            ks = [sd._fill(cupy, (B, Hkv, Lk, D), 100 + i) for i in range(n_sets)]
            vs = [sd._fill(cupy, (B, Hkv, Lk, D), 200 + i) for i in range(n_sets)]

            def arrays(i):    # GQA as (B, Hkv, G, 1, d) on (B, Hkv, 1, Lk, d)
                if G == 1:
                    return qs[i], ks[i], vs[i]
                return q_of(i), ks[i][:, :, None], vs[i][:, :, None]

            def dense(i):
                return inf.attention_with_kvcache(*arrays(i), cache_seqlens=seqlens)
            for impl, env in (modes if not ps else (("cuflash_dense", {}),)):
                with switches(env):
                    kernel = sd._kernel(inf, *arrays(0), seqlens, None)
                    add(impl, dense, kernel=kernel, env=env, stream="stream grid" in kernel)
            dense_done[B, Hq, Hkv, Lk] = dict(
                next(r for r in rows[::-1] if r["impl"] in ("cuflash", "cuflash_dense")),
                impl="cuflash_dense")
            if not ps and any(peers.values()):
                import torch
                tq, tk, tv = ([torch.from_dlpack(x) for x in xs] for xs in (qs, ks, vs))
                for name, fn in peers.items():
                    if fn is not None:
                        try:
                            add(name, lambda i, fn=fn: fn(tq[i], tk[i], tv[i]))
                        except Exception as exc:      # a backend that refuses the shape
                            rows.append(dict(B=B, Hq=Hq, Hkv=Hkv, Lk=Lk, page_size=0, impl=name,
                                             ms=None, note=f"{type(exc).__name__}: "
                                                           f"{str(exc)[:200]}"))
                del tq, tk, tv
                torch.cuda.empty_cache()
            del ks, vs
        else:     # the dense default of this point was timed already (dense, or other pages)
            rows.append(dict(dense_done[B, Hq, Hkv, Lk], page_size=ps))
            line.append(f"cuflash_dense (timed before) {rows[-1]['tbps']:.2f} TB/s")
        print(f"B={B} Hq={Hq} Hkv={Hkv} Lk={Lk} {'page ' + str(ps) if ps else 'dense'}: "
              + "; ".join(line), flush=True)
        del qs
        cupy.get_default_memory_pool().free_all_blocks()
    summary(rows)
    meta = {"probe": "decode_ab", "set": args.set, "seconds": time.perf_counter() - t_start}
    try:
        meta["device"] = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    except Exception:
        pass
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(f"{len(rows)} rows in {meta['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
