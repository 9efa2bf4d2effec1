#!/usr/bin/env python3
"""Question (sessions 8 and 10, bench/NOTES.md "softcap and ALiBi cost (session 8)", "softcap: a
fixed offset instead of the running max (session 10)"): what do softcap and ALiBi cost over
plain attention of the same shape (issue 10: <= 10%), forward and fwd+bwd, in each build, in
ONE process?

    PYTHONPATH=. python bench/probes/softcap_ab.py [--json out.json] [--d 64,128] [--L 4096]
                                                   [--builds fixed,online,pairwise,...]

On the H200 (~60-80 s at the defaults, d 64 and 128, L 4096; most of it compiling 16 jobs in
14 processes first; --L 4096,16384 adds ~10 s of timing, same kernels): bf16, B x L = 16k tokens,
H x d = 2048 (the mods suite's shapes), softcap 50 not causal against plain not causal, ALiBi
(the suite's geometric slopes) causal against plain causal. Builds (``cuflash._api.clear_plans()``
between):
  "fixed"   session 10's default: tanh.approx, the softmax on a fixed offset (no running max, no
            rescale of O: ``CUFLASH_SOFTCAP_FIXED=1``) with its share of the exponentials on the
            FMA pipe (none at d 64, 2 of 8 column tiles at d 128), bwd_sm90's plain path for
            the softcap (``CUFLASH_SOFTCAP_BWD=plain``); ALiBi on raw scores;
  "online"  session 9's default forward (``CUFLASH_SOFTCAP_FIXED=0``: the running max, 3 / 1 of
            8 exponentials on the FMA pipe), the plain-path backward;
  "pairwise" the fixed offset, the backward on session 9's per-element path
            (``CUFLASH_SOFTCAP_BWD=pairwise``): "online" + "pairwise" is session 9's default;
  "altshare" the fixed offset with the other share (2 of 8 at d 64, 1 at d 128:
            ``CUFLASH_SOFTCAP_SHARE=alt``);
  "fixnopoly" the fixed offset, no exponential on the FMA pipe (``CUFLASH_SOFTCAP_POLY=0``);
  "online"  session 9's default (``CUFLASH_SOFTCAP_FIXED=0``: the running max, 3 / 1 of 8);
  "old"     session 7's ex2 / rcp softcap (``CUFLASH_SOFTCAP_TANH=0``), natural-unit ALiBi
            (``CUFLASH_ALIBI_RAW=0``); not in the default --builds (session 10's call 1 has it).
Each build's softcap forward is also compared with "online"'s and its gradients with
"pairwise"'s on the same inputs (max |o difference|, lse difference relative to max(|lse|, 1),
gradient differences relative to the reference's max |element|: rows with mode "agree"; a
bfloat16 rounding apart, ~1e-2 relative at most, is agreement; a wrong build is off by O(1)).
Forward (``attention``) and fwd+bwd (``attention_vjp`` + pullback), CUDA events, median of 10
after 3 warm-up calls. Prints ms, TFLOP/s (visible pairs; backward 2.5x forward) and the cost,
1 - TFLOP/s / plain's of the same causality (issue 10's "cost over plain", as bench/NOTES.md
states it). No GPU: exits with a message.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[1]))   # bench/: suite_common, suite_mods

_BASE = {"CUFLASH_SOFTCAP_TANH": "1", "CUFLASH_SOFTCAP_POLY": "1", "CUFLASH_SOFTCAP_FIXED": "1",
         "CUFLASH_SOFTCAP_SHARE": "default", "CUFLASH_SOFTCAP_BWD": "plain", "CUFLASH_ALIBI_RAW": "1"}
BUILDS = {"fixed": dict(_BASE),
          "online": dict(_BASE, CUFLASH_SOFTCAP_FIXED="0"),
          "pairwise": dict(_BASE, CUFLASH_SOFTCAP_BWD="pairwise"),
          "altshare": dict(_BASE, CUFLASH_SOFTCAP_SHARE="alt"),
          "fixnopoly": dict(_BASE, CUFLASH_SOFTCAP_POLY="0"),
          "old": dict(_BASE, CUFLASH_SOFTCAP_TANH="0", CUFLASH_ALIBI_RAW="0")}
#: the points (indices into _points) each build times: plain once, ALiBi in fixed and old only
TIMED = {"fixed": (0, 1, 2, 3), "online": (2,), "pairwise": (2,), "altshare": (2,), "fixnopoly": (2,),
         "old": (2, 3)}
DEFAULT_BUILDS = "fixed,online,pairwise,altshare,fixnopoly"


def _points(L: int, H: int, xp):
    import suite_mods
    slopes = xp.asarray(suite_mods.alibi_slopes(H))
    return [("plain", dict(causal=False), L * L),
            ("plain", dict(causal=True), L * (L + 1) / 2),
            ("softcap", dict(causal=False, softcap=suite_mods.SOFTCAP), L * L),
            ("alibi", dict(causal=True, alibi_slopes=slopes), L * (L + 1) / 2)]


def _inputs(d: int, L: int):
    import cupy
    import ml_dtypes
    import numpy
    import suite_mods
    H, B = suite_mods.WIDTH // d, max(1, suite_mods.TOKENS // L)
    rng = numpy.random.default_rng(L + d)
    q, k, v = (cupy.asarray(rng.standard_normal((B, H, L, d)).astype(numpy.dtype(ml_dtypes.bfloat16)))
               for _ in range(3))
    return B, H, q, k, v


def warm_one(job) -> None:
    """One point's forward and fwd+bwd once, in a child process: the kernels land in CuPy's
    on-disk cache, so that the timed process does not compile them one after the other."""
    d, L, build, index = job
    os.environ.update(BUILDS[build])
    sys.path.insert(0, str(HERE.parents[1]))
    import cupy
    import cuflash
    B, H, q, k, v = _inputs(d, L)
    _, kw, _ = _points(L, H, cupy)[index]
    cuflash.attention(q, k, v, **kw)
    cuflash.attention_vjp(q, k, v, **kw)[1](cupy.ones_like(q))
    cupy.cuda.Device().synchronize()


def warm(d_list, L_list, workers: int) -> None:
    import concurrent.futures
    import multiprocessing
    # (the kernels do not depend on L here: the same builds at 4k and 16k, so the shortest)
    jobs = [(d, min(L_list), build, i) for d in d_list for build in BUILDS for i in TIMED[build]]
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        list(pool.map(warm_one, jobs))


def measure(d_list, L_list, json_path=None) -> list[dict]:
    import cupy
    import cuflash
    from cuflash import _api
    from suite_common import median_event_ms
    rows = []
    for d in d_list:
        for L in L_list:
            B, H, q, k, v = _inputs(d, L)
            do = cupy.ones_like(q)
            points = _points(L, H, cupy)
            outs, grads = {}, {}   # the softcap's o, lse and dq, dk, dv per build: they must agree
            for build, env in BUILDS.items():
                os.environ.update(env)
                _api.clear_plans()
                for index, (name, kw, pairs) in enumerate(points):
                    if index not in TIMED[build]:
                        continue      # plain attention has one build, ALiBi two
                    fwd_flop = 4 * B * H * d * pairs
                    if name == "softcap":
                        outs[build] = cuflash.attention(q, k, v, return_lse=True, **kw)
                        grads[build] = cuflash.attention_vjp(q, k, v, **kw)[1](do)
                    for mode in ("fwd", "fwd_bwd"):
                        if mode == "fwd":
                            fn = lambda i: cuflash.attention(q, k, v, **kw)   # noqa: E731
                            flop = fwd_flop
                        else:
                            fn = lambda i: cuflash.attention_vjp(q, k, v, **kw)[1](do)   # noqa: E731
                            flop = 3.5 * fwd_flop
                        ms = median_event_ms(fn, iters=10, warmup=3)
                        rows.append(dict(d=d, L=L, mod=name, causal=kw["causal"], build=build,
                                         mode=mode, ms=ms, tflops=flop / ms / 1e9))
                        print(json.dumps(rows[-1]), flush=True)
                        if json_path:   # after every point: a run cut short keeps what it measured
                            _write(json_path, rows)
            # against session 9's forward ("online") and backward ("pairwise"), same inputs:
            # max |difference| (o), relative to max(|lse|, 1) (lse), to max |reference| (grads)
            ref_o, ref_lse = outs.get("online", outs.get("fixed"))
            ref_g = grads.get("pairwise", grads.get("fixed"))
            f32 = lambda x: x.astype(cupy.float32)   # noqa: E731
            for build in outs:
                o, lse = outs[build]
                row = dict(d=d, L=L, mod="softcap", build=build, mode="agree",
                           fwd_ref="online", bwd_ref="pairwise",
                           max_abs_do=float(cupy.abs(f32(o) - f32(ref_o)).max()),
                           max_rel_dlse=float((cupy.abs(lse - ref_lse) / cupy.maximum(cupy.abs(ref_lse), 1)).max()))
                for n, g, r in zip(("dq", "dk", "dv"), grads[build], ref_g):
                    row[f"max_rel_{n}"] = float(cupy.abs(f32(g) - f32(r)).max() / cupy.abs(f32(r)).max())
                rows.append(row)
                print(json.dumps(row), flush=True)
            del q, k, v, do, outs, grads, ref_o, ref_lse, ref_g
            cupy.get_default_memory_pool().free_all_blocks()
    for env in _BASE:
        os.environ.pop(env, None)
    _api.clear_plans()
    return rows


def _write(path: str, rows: list[dict]) -> None:
    with open(path, "w") as f:
        json.dump({"question": __doc__.split("\n\n")[0], "builds": BUILDS, "rows": rows}, f, indent=1)


def table(rows: list[dict]) -> None:
    plain = {(r["d"], r["L"], r["causal"], r["mode"]): r["tflops"] for r in rows
             if r["mod"] == "plain" and "tflops" in r}
    print(f"{'d':>4} {'L':>6} {'point':16} {'mode':8} {'build':9} {'ms':>8} {'TFLOP/s':>8} {'cost':>7}")
    for r in rows:
        if r["mode"] == "agree":
            continue
        ref = plain.get((r["d"], r["L"], r["causal"], r["mode"]))
        cost = 1 - r["tflops"] / ref if ref and r["mod"] != "plain" else float("nan")
        name = r["mod"] + (" causal" if r["causal"] else "")
        print(f"{r['d']:>4} {r['L']:>6} {name:16} {r['mode']:8} {r['build']:9} {r['ms']:8.3f} "
              f"{r['tflops']:8.1f} {cost:7.1%}")


def main(argv) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--d", default="64,128")
    ap.add_argument("--L", default="4096", help="e.g. 4096,16384 (16k: ~10 s more, same kernels)")
    ap.add_argument("--json")
    ap.add_argument("--builds", default=DEFAULT_BUILDS, help=f"of {', '.join(BUILDS)}")
    ap.add_argument("--warm", type=int, default=14,
                    help="processes compiling the kernels first (0: compile while timing)")
    a = ap.parse_args(argv)
    try:
        import cupy
        cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:   # noqa: BLE001
        print(f"no GPU here ({exc}): nothing measured")
        return 0
    d_list, L_list = [int(x) for x in a.d.split(",")], [int(x) for x in a.L.split(",")]
    chosen = a.builds.split(",")
    for b in chosen:
        if b not in BUILDS:
            ap.error(f"unknown build {b!r}")
    for b in list(BUILDS):   # (the warm-up children look builds up by name in the full table)
        if b not in chosen:
            del BUILDS[b]
    import time
    t0 = time.perf_counter()
    if a.warm:
        warm(d_list, L_list, a.warm)
    t1 = time.perf_counter()
    rows = measure(d_list, L_list, a.json)
    print(f"compile (warm-up processes) {t1 - t0:.0f} s, timing {time.perf_counter() - t1:.0f} s")
    table(rows)
    if a.json:
        _write(a.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
