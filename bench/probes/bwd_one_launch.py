#!/usr/bin/env python3
"""Question (session 12, issue 9 item 3): does the one-launch backward of small problems
(cuflash/_plan_one.py: D and the zeroing of dQ's accumulator in bwd_sm90's main kernel, no
bwd_dot_do_o launch) bring ``attention_backward``'s host time to <= 25 us, without costing GPU
time where it is taken, and leave the problems it does not take alone?

    PYTHONPATH=. python bench/probes/bwd_one_launch.py [--json out.json] [--calls 300]

One process, bf16, random N(0, 1) inputs; at each point two arms (plan-time switch, the plan
cache cleared around each: ``bench_attention.env``):

- ``old``: ``CUFLASH_BWD_ONE_LAUNCH=0``: bwd_dot_do_o (D, and the workspace zeroed), then the
  main kernel, on a fresh workspace a call (session 11's code path);
- ``new``: the default: one launch where the rule takes the problem (``one_kernel`` in the row).

Per (point, arm): ``host_us``: host time per call, ``--calls`` back-to-back calls issued behind
a spin kernel (bench/host_overhead.py's method: their issue time is host time whatever the
GPU's pace), the median of 3 loops; ``gpu_us``: the GPU time per call of those calls (events
around them, after the spin: no host gaps); ``isolated_us``: one call with the GPU idle before
it (synchronise, event, call, event, synchronise; the median of 30): what a lone call costs;
``max_diff``: the largest |new - old| over dq, dk, dv (atomics make dq differ in the last bits
from run to run; the GPU tests check both against the reference). The first point is
bench/host_overhead.py's shape (1, 1, 64, 64); the last has Lq > 512, which the rule leaves on
two launches (its two arms run the same kernels). Under a minute on an H200 (the kernels
compile first, ~10 NVRTC builds).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "bench" / "probes")]

#: (B, H, L, d, causal)
POINTS = [(1, 1, 64, 64, False), (1, 1, 64, 64, True), (1, 8, 128, 128, False),
          (2, 8, 512, 64, True), (1, 16, 512, 128, False), (1, 8, 1024, 128, True)]
ARMS = {"old": {"CUFLASH_BWD_ONE_LAUNCH": "0"}, "new": {"CUFLASH_BWD_ONE_LAUNCH": None}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--calls", type=int, default=300, help="calls a host-time loop (<= ~300)")
    args = ap.parse_args(argv)
    import cupy
    import ml_dtypes
    import bench_attention
    import cuflash
    from cuflash import _api
    from host_overhead import behind_spin, spin_and_event

    spin, event = spin_and_event(cupy)
    sync = cupy.cuda.Device().synchronize

    rows, t_start = [], time.perf_counter()
    inputs = []
    for (B, H, L, d, causal) in POINTS:
        rs = cupy.random.RandomState(L + d)
        inputs.append(tuple(rs.standard_normal((B, H, L, d), dtype=cupy.float32)
                            .astype(ml_dtypes.bfloat16) for _ in range(4)))

    def warm(qkvd, causal):
        q, k, v, do = qkvd
        o, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
        return cuflash.attention_backward(do, q, k, v, o, lse, causal=causal)
    # every arm's kernels compiled first, the points' in parallel threads (NVRTC outside the GIL)
    from suite_common import warm_arms
    warm_arms(list(ARMS), ARMS, [lambda x=x, c=pt[4]: warm(x, c) for x, pt in zip(inputs, POINTS)])
    print(f"(compiled in {time.perf_counter() - t_start:.0f} s)", flush=True)
    for (B, H, L, d, causal), (q, k, v, do) in zip(POINTS, inputs):
        o, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
        grads = {}
        for arm, env in ARMS.items():
            row = {"point": f"B{B} H{H} L{L} d{d}{' causal' if causal else ''}", "arm": arm,
                   "B": B, "H": H, "L": L, "d": d, "causal": causal}
            try:
                with bench_attention.env(**env):
                    def call():
                        return cuflash.attention_backward(do, q, k, v, o, lse, causal=causal)
                    grads[arm] = [g.copy() for g in call()]        # compile, plan, fast entry
                    plans = [p for p in _api._BWD_PLANS._d.values() if hasattr(p, "one_kernel")]
                    row["one_kernel"] = bool(plans and plans[0].one_kernel)
                    row["kernel"] = plans[0].choice.expr if plans else None
                    for _ in range(20):
                        call()
                    issue, gpu, outlasted = behind_spin(
                        call, args.calls, 3, spin, event, sync,
                        lambda a, b: cupy.cuda.get_elapsed_time(a, b) * 1e-3)
                    row["host_us"] = statistics.median(issue) / args.calls * 1e6
                    row["gpu_us"] = statistics.median(gpu) / args.calls * 1e6
                    row["spin_outlasted"] = all(outlasted)
                    iso = []
                    for _ in range(30):
                        sync()
                        a = event()
                        call()
                        b = event()
                        sync()
                        iso.append(cupy.cuda.get_elapsed_time(a, b) * 1e3)
                    row["isolated_us"] = statistics.median(iso)
            except Exception as exc:       # one arm's failure is a row, not the end of the run
                row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            rows.append(row)
        if "old" in grads and "new" in grads:
            rows[-1]["max_diff"] = max(float(abs(a.astype(cupy.float32) - b.astype(cupy.float32))
                                             .max()) for a, b in zip(grads["old"], grads["new"]))
        for r in rows[-2:]:
            print(json.dumps(r), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"meta": {"probe": "bwd_one_launch", "arms": ARMS, "calls": args.calls,
                                    "complete": False}, "rows": rows}, f, indent=1)
    print(f"{'point':24} {'arm':4} {'one':>4} {'host us':>8} {'gpu us':>8} {'isolated us':>12}")
    for r in rows:
        if "error" in r:
            print(f"{r['point']:24} {r['arm']:4} ERROR {r['error']}")
            continue
        print(f"{r['point']:24} {r['arm']:4} {str(r['one_kernel'])[0]:>4} {r['host_us']:8.1f} "
              f"{r['gpu_us']:8.1f} {r['isolated_us']:12.1f}")
    for old, new in zip(rows[::2], rows[1::2]):
        if "host_us" in old and "host_us" in new:
            print(f"{new['point']:24} new - old: host {new['host_us'] - old['host_us']:+.1f} us, "
                  f"gpu {new['gpu_us'] - old['gpu_us']:+.1f} us, isolated "
                  f"{new['isolated_us'] - old['isolated_us']:+.1f} us, max |diff| "
                  f"{new.get('max_diff', float('nan')):.3g}")
    print(f"({time.perf_counter() - t_start:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": {"probe": "bwd_one_launch", "arms": ARMS, "calls": args.calls,
                                "complete": True}, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
