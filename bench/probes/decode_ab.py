#!/usr/bin/env python3
"""Question: do decode_sm80's session-9 defaults (the deep cp.async ring of grids of at most
one block an SM, the stream grid at B = 64 on long shares) beat session 8's default, and the
peers?

At each point of issue 11's decode table (dense cache, bf16, d 128), in one process, plans
forgotten (``cuflash._api.clear_plans()``) between the variants:
  cuflash_old       CUFLASH_DECODE_STAGES=3 CUFLASH_DECODE_STREAM=0: session 8's default (3
                    stages everywhere, even splits everywhere);
  cuflash           the default: a 5-stage ring (4 where 164 KB of shared memory do not fit)
                    where the grid is at most one block an SM (B 1; B 8 at 32/8: 112-128
                    blocks), the stream grid where the groups fill the resident slots and a
                    block's share is >= 512 key iterations (B 64: 32/8 64k, 32/32 8k);
  cuflash_stages4   CUFLASH_DECODE_STAGES=4: the 4-stage ring there instead;
  cuflash_stages6   CUFLASH_DECODE_STAGES=6: the 6-stage ring there (196 KB; not in the gate);
  cuflash_no_stream CUFLASH_DECODE_STREAM=0: the default's ring, even splits everywhere (the
                    stream grid's own A/B at B 64);
  cuflash_stream    CUFLASH_DECODE_STREAM=all: the stream grid wherever it applies (with the
                    deep ring where it is one block an SM);
  cuflash_release   CUFLASH_DECODE_ARRIVE=release on top of the default (session 8's opt-in
                    arrival: 23.4 us against 36.5 at B 1 8k there, neutral elsewhere);
  cuflash_splits16  (B 1, 32/8 only) the default with num_splits=16: 128 blocks, where the
                    heuristic's 14-15 leave 20-12 SMs idle (session 6: 16 splits 0.6% ahead
                    of 12 at 128k);
then SDPA cuDNN and SDPA flash (skipped without torch). Random N(0, 1) bf16 data; inputs rotate
past the L2 as in bench/suite_decode.py. The variants' kernels are compiled first, in parallel
processes, into CuPy's disk cache.

Two timings a row: ``ms`` = suite_decode's (median CUDA-event time around each call, calls
issued back to back), and ``iso_ms`` = one call at a time (device synchronised before each:
the latency a B = 1 decode step sees, launch included). TB/s = K/V bytes / ``ms``. The last
lines print, per point, each cuflash row's ratio to the better peer (back to back and iso).

    PYTHONPATH=. python bench/probes/decode_ab.py --json decode_ab.json     (~40-60 s on an H200)
"""
from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
import suite_decode as sd  # noqa: E402  (bench/)

POINTS = [  # B, Hq, Hkv, Lk
    (1, 32, 8, 8192), (1, 32, 8, 65536), (1, 32, 8, 131072), (1, 32, 32, 65536),
    (1, 32, 32, 131072), (8, 32, 8, 8192), (8, 32, 8, 65536), (8, 32, 8, 131072),
    (8, 32, 32, 8192), (64, 32, 8, 8192), (64, 32, 8, 65536), (64, 32, 32, 8192)]
MODES = (("cuflash_old", {"CUFLASH_DECODE_STAGES": "3", "CUFLASH_DECODE_STREAM": "0"}),
         ("cuflash", {}),
         ("cuflash_stages4", {"CUFLASH_DECODE_STAGES": "4"}),
         ("cuflash_stages6", {"CUFLASH_DECODE_STAGES": "6"}),
         ("cuflash_no_stream", {"CUFLASH_DECODE_STREAM": "0"}),
         ("cuflash_stream", {"CUFLASH_DECODE_STREAM": "all"}),
         ("cuflash_release", {"CUFLASH_DECODE_ARRIVE": "release"}))
SWITCHES = ("CUFLASH_DECODE_MERGE", "CUFLASH_DECODE_STREAM", "CUFLASH_DECODE_L2",
            "CUFLASH_DECODE_ARRIVE", "CUFLASH_DECODE_STAGES")
#: decode_mma's (FUSE, STREAM, STAGES) tails of the name expression that the points can use
BUILDS = ("false", "true", "true, true") + tuple(
    f"{f}, {st}" for st in (4, 5, 6) for f in ("false, false", "true, false", "true, true"))


def switches(env: dict):
    """The block with exactly ``env``'s decode switches set (the others unset), plans cleared
    on the way in and out: bench_attention.env."""
    import bench_attention as ba
    return ba.env(**{**dict.fromkeys(SWITCHES), **env})


def precompile(modes) -> float:
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
                jobs.add((expr.format(flags), _inference_grid.prelude(flags.startswith("true"))))
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
    """Per point: the better peer's time over each cuflash row's (> 1: cuflash faster), back to back
    and one call at a time."""
    points = sorted({(r["B"], r["Hq"], r["Hkv"], r["Lk"]) for r in rows})
    for pt in points:
        mine = [r for r in rows if (r["B"], r["Hq"], r["Hkv"], r["Lk"]) == pt and r.get("ms")]
        peers = [r for r in mine if r["impl"].startswith("sdpa")]
        if not peers:
            continue
        best = min(r["ms"] for r in peers)
        best_iso = min(r["iso_ms"] for r in peers)
        cells = [f"{r['impl'][8:] or 'new'} {best / r['ms']:.3f}/{best_iso / r['iso_ms']:.3f}"
                 for r in mine if r["impl"].startswith("cuflash")]
        print(f"B={pt[0]} {pt[1]}/{pt[2]} Lk={pt[3]} vs the better peer (b2b/iso, >1 faster): "
              + "; ".join(cells))


def main(argv=None) -> int:
    a = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    a.add_argument("--json", help="write the rows here")
    a.add_argument("--max-gb", type=float, default=20.0, help="skip points with more K/V")
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
    if not args.no_precompile:
        print(f"precompiled the variants in {precompile(MODES):.0f} s", flush=True)
    rows = []
    for B, Hq, Hkv, Lk in POINTS:
        G, D = Hq // Hkv, sd.D
        nbytes = B * Hkv * Lk * D * 4
        if nbytes > args.max_gb * 1e9:
            print(f"B={B} Hq={Hq} Hkv={Hkv} Lk={Lk}: skipped ({nbytes / 1e9:.0f} GB)")
            continue
        n_sets = max(1, min(64, -(-sd.ROTATE_BYTES // nbytes)))
        qs = [sd._fill(cupy, (B, Hq, 1, D), 10 + i) for i in range(n_sets)]
        ks = [sd._fill(cupy, (B, Hkv, Lk, D), 100 + i) for i in range(n_sets)]
        vs = [sd._fill(cupy, (B, Hkv, Lk, D), 200 + i) for i in range(n_sets)]
        seqlens = cupy.full((B,), Lk, numpy.int32)

        def arrays(i):    # as bench/suite_decode.py: GQA as (B, Hkv, G, 1, d) on (B, Hkv, 1, Lk, d)
            if G == 1:
                return qs[i], ks[i], vs[i]
            return qs[i].reshape(B, Hkv, G, 1, D), ks[i][:, :, None], vs[i][:, :, None]

        def ours(i):
            return inf.attention_with_kvcache(*arrays(i), cache_seqlens=seqlens)
        line = []

        def add(impl, fn, **extra):
            ms, iso = sd._time(fn, n_sets), isolated_ms(fn, n_sets)
            rows.append(dict(B=B, Hq=Hq, Hkv=Hkv, Lk=Lk, impl=impl, ms=ms, iso_ms=iso,
                             tbps=nbytes / ms / 1e9, **extra))
            line.append(f"{impl} {nbytes / ms / 1e9:.2f} TB/s {ms * 1e3:.1f} us "
                        f"(iso {iso * 1e3:.1f})")
        for impl, env in MODES:
            with switches(env):
                kernel = sd._kernel(inf, *arrays(0), seqlens, None)
                ring = re.search(r"a (\d)-stage cp.async ring", kernel)
                add(impl, ours, kernel=kernel, stream="stream grid" in kernel, env=env,
                    stages=int(ring.group(1)) if ring else 3)
        if B == 1 and Hkv == 8:     # the heuristic's 14-15 splits (112-120 blocks) against 16 (128)
            with switches({}):
                add("cuflash_splits16", lambda i: inf.attention_with_kvcache(
                    *arrays(i), cache_seqlens=seqlens, num_splits=16), env={}, num_splits=16)
        if any(peers.values()):
            import torch
            tq, tk, tv = ([torch.from_dlpack(x) for x in xs] for xs in (qs, ks, vs))
            for name, fn in peers.items():
                if fn is not None:
                    try:
                        add(name, lambda i, fn=fn: fn(tq[i], tk[i], tv[i]))
                    except Exception as exc:      # a backend that refuses the shape
                        rows.append(dict(B=B, Hq=Hq, Hkv=Hkv, Lk=Lk, impl=name, ms=None,
                                         note=f"{type(exc).__name__}: {str(exc)[:200]}"))
            del tq, tk, tv
            torch.cuda.empty_cache()
        print(f"B={B} Hq={Hq} Hkv={Hkv} Lk={Lk}: " + "; ".join(line), flush=True)
        del qs, ks, vs
        cupy.get_default_memory_pool().free_all_blocks()
    summary(rows)
    meta = {"probe": "decode_ab", "seconds": time.perf_counter() - t_start}
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
