#!/usr/bin/env python3
"""Question (session 14, issues 10 and 9's backward): how close to HBM do the two passes around
the backward's main kernel run, and which build and grid make them fastest? Session 13 timed
them at the d 128, L 4k causal point (B 4, H 16, bf16): bwd_dot_do_o 0.105 ms for ~268 MB
(the 134 MB float32 dQ accumulator zeroed, dO and O read: ~2.6 TB/s) and bwd_finish_dq 0.078 ms
for ~201 MB (2.6 TB/s), where a device copy moves ~4.3 TB/s: together 8% of that backward and
13% of the sliding window's at 16k. Session 14's builds: bwd_dot_do_o's ROWS (a lane group
loads ROWS rows before reducing any: bytes in flight) and bwd_finish_dq's VEC4 for dQ (16-byte
loads, one 8-byte store), with the grids' blocks an SM.

    PYTHONPATH=. python bench/probes/bwd_passes.py [--json out.json] [--quick]

One process, bf16, random N(0, 1) inputs, the suites' shapes (B x L = 16k tokens, H x d =
2048): d 128 L 4k, d 64 L 4k, d 128 L 16k. Per shape, a backward plan built by a real
``attention_backward`` call (causal), then each kernel launched alone on that plan's argument
blocks with cuflash's workspace of this probe (CUDA events around single launches, median of
30, back to back):

- ``dot``: ROWS in 1 (sessions 1-13), 2, 4, 8 x blocks an SM in 2, 4, 8, 16 (the grid's cap;
  8 before, 16 since this probe's first run): us, TB/s of zeroed + read bytes, and whether D
  is bitwise ROWS = 1's;
- ``finish``: VEC4 off (before) / on x blocks an SM in 2, 4, 8, 16: us, TB/s, dQ bitwise;
- ``copy``: cupy's device-to-device copy of the same bytes as ``dot`` (the ceiling);
- ``bwd``: the whole ``attention_backward`` (fast path, 2 input sets) with the plan's passes
  as built (``new``: _traits.DOT_ROWS, VEC4, _plan_aux's grids) and swapped back to ROWS = 1
  and the scalar finish (``old``; the grids stay the plan's), arms alternated 3 times.

Session 14's run (H200): bench/results/h200/bwd_passes.json, bench/NOTES.md.
"""
from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

SHAPES = [(4, 16, 4096, 128), (4, 32, 4096, 64), (1, 16, 16384, 128)]
ROWS, BLOCKS = (1, 2, 4, 8), (2, 4, 8, 16)


def _events_us(launch, iters: int = 30) -> float:
    """GPU time of one ``launch()`` (CUDA events around each, median), us."""
    from suite_common import median_event_ms
    return median_event_ms(lambda i: launch(), iters=iters, warmup=3, warm_ms=20) * 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true", help="the first shape only")
    args = ap.parse_args(argv)
    import cupy
    import ml_dtypes
    import cuflash
    from cuflash import _api, _launch
    from cuflash._traits import DOT_ROWS
    from suite_common import finish as write, median_event_ms
    drv = cupy.cuda.driver
    sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
    dev = cupy.cuda.Device().id
    rows_out = []
    t0 = time.perf_counter()
    for B, H, L, d in SHAPES[:1] if args.quick else SHAPES:
        rs = cupy.random.RandomState(L + d)
        sets = [[rs.standard_normal((B, H, L, d), dtype=cupy.float32).astype(ml_dtypes.bfloat16)
                 for _ in range(4)] for _ in range(2)]
        outs = [cuflash.attention(q, k, v, causal=True, return_lse=True) for q, k, v, _ in sets]
        cuflash.attention_backward(sets[0][3], *sets[0][:3], *outs[0], causal=True)
        plan = next(e.plan for e in reversed(list(_api._BWD_PLANS._d.values()))
                    if getattr(e, "plan", None) is not None and e.plan.prob.Lq == L
                    and e.plan.prob.d == d)
        q, k, v, do = sets[0]
        o, lse = outs[0]
        n_rows, n = B * H * L, B * H * L * d
        ws = cupy.cuda.alloc(plan.workspace)
        dq, dk, dv = (cupy.empty_like(x) for x in (q, k, v))
        off = plan.ws_offsets
        stream = cupy.cuda.get_current_stream().ptr
        words = [q.data.ptr, k.data.ptr, v.data.ptr, o.data.ptr, lse.data.ptr, do.data.ptr,
                 ws.ptr + off["dpsum"], ws.ptr + off["dq_acc"], dk.data.ptr, dv.data.ptr,
                 ws.ptr + off["dq_sem"]]
        plan.launch(stream, words)              # D, the main kernel: the argument block patched
        fin = plan.finish.launch
        fin(stream, [ws.ptr + off["dq_acc"], dq.data.ptr])
        cupy.cuda.Device().synchronize()
        acc = ws.ptr + off["dq_acc"]
        acc_copy = cupy.empty(n, cupy.float32)  # dQ's accumulator as the main kernel left it
        cupy.cuda.runtime.memcpy(acc_copy.data.ptr, acc, 4 * n, 3)
        D = cupy.ndarray((n_rows,), cupy.float32, ws + off["dpsum"])
        point = {"B": B, "H": H, "L": L, "d": d}
        zero_bytes = plan.zeroed
        dot_bytes = zero_bytes + 2 * n * 2 + 8 * n_rows
        ref_D = None
        for r in ROWS:
            kern = _launch.kernel("bwd_prep.cu", f"cuflash::bwd_dot_do_o<__nv_bfloat16, {r}>", dev, 0)
            for bps in BLOCKS:
                grid = max(1, min(-(-n_rows // 8), bps * sms))

                def go(kern=kern, grid=grid):
                    drv.launchKernel(kern.kernel.ptr, grid, 1, 1, 256, 1, 1, 0, stream,
                                     plan.launch.argv_ptr, 0)
                us = _events_us(go)
                go()
                if ref_D is None:
                    ref_D = D.copy()
                same = bool((D.view(cupy.uint32) == ref_D.view(cupy.uint32)).all())
                rows_out.append(dict(point, kernel="dot", rows=r, blocks_per_sm=bps, grid=grid,
                                     us=us, tbps=dot_bytes / us * 1e-6, bitwise=same))
                print(f"{B}x{H}x{L}x{d} dot rows {r} bps {bps:2d}: {us:7.1f} us "
                      f"{dot_bytes / us * 1e-6:5.2f} TB/s {'=' if same else 'DIFFERENT'}",
                      flush=True)
        # the accumulator back as the main kernel left it (the dot runs zeroed it)
        cupy.cuda.runtime.memcpy(acc, acc_copy.data.ptr, 4 * n, 3)
        fin_bytes = n * 4 + n * 2
        ref_dq = None
        for vec4 in (False, True):
            kern = _launch.kernel("bwd_prep.cu", "cuflash::bwd_finish_dq<float, __nv_bfloat16, "
                                  f"{'true' if vec4 else 'false'}>", dev, 0)
            for bps in BLOCKS:
                grid = max(1, min(-(-n // 256), bps * sms))

                def go(kern=kern, grid=grid):
                    drv.launchKernel(kern.kernel.ptr, grid, 1, 1, 256, 1, 1, 0, stream,
                                     fin.argv_ptr, 0)
                us = _events_us(go)
                go()
                if ref_dq is None:
                    ref_dq = dq.copy()
                same = bool((dq.view(cupy.uint16) == ref_dq.view(cupy.uint16)).all())
                rows_out.append(dict(point, kernel="finish", vec4=vec4, blocks_per_sm=bps,
                                     grid=grid, us=us, tbps=fin_bytes / us * 1e-6, bitwise=same))
                print(f"{B}x{H}x{L}x{d} finish vec4 {vec4!s:5} bps {bps:2d}: {us:7.1f} us "
                      f"{fin_bytes / us * 1e-6:5.2f} TB/s {'=' if same else 'DIFFERENT'}",
                      flush=True)
        src = cupy.empty(dot_bytes // 2, cupy.uint16)
        dst = cupy.empty_like(src)
        us = _events_us(lambda: cupy.copyto(dst, src))
        rows_out.append(dict(point, kernel="copy", us=us, tbps=2 * dot_bytes / us * 1e-6))
        print(f"{B}x{H}x{L}x{d} copy of {dot_bytes / 1e6:.0f} MB: {us:.1f} us "
              f"{2 * dot_bytes / us * 1e-6:.2f} TB/s (read + write)", flush=True)
        # the whole backward, the plan's passes as built (new) and swapped back (old)
        new_dot = plan.launch.kernels[0]
        new_fin = fin.kernels[0]
        old_dot_k = _launch.kernel("bwd_prep.cu", "cuflash::bwd_dot_do_o<__nv_bfloat16, 1>", dev, 0)
        old_fin_k = _launch.kernel("bwd_prep.cu", "cuflash::bwd_finish_dq<float, __nv_bfloat16, "
                                   "false>", dev, 0)
        old_dot = (old_dot_k.kernel.ptr,) + tuple(new_dot[1:])
        old_fin = (old_fin_k.kernel.ptr,) + tuple(new_fin[1:])
        times = {"old": [], "new": []}
        grads = {}
        for _ in range(3):
            for arm, (dk_, fk_) in (("old", (old_dot, old_fin)), ("new", (new_dot, new_fin))):
                plan.launch.kernels[0], fin.kernels[0] = dk_, fk_

                def call(i):
                    s = sets[i]
                    return cuflash.attention_backward(s[3], *s[:3], *outs[i], causal=True)
                times[arm].append(median_event_ms(call, n_sets=2, iters=20) * 1e3)
                grads[arm] = call(0)
        plan.launch.kernels[0], fin.kernels[0] = new_dot, new_fin
        diff = max(float(cupy.abs(a.astype(cupy.float32) - b.astype(cupy.float32)).max())
                   for a, b in zip(grads["old"], grads["new"]))
        for arm in ("old", "new"):
            rows_out.append(dict(point, kernel="bwd", arm=arm, us=statistics.median(times[arm]),
                                 runs=times[arm]))
        print(f"{B}x{H}x{L}x{d} bwd old {statistics.median(times['old']):.1f} us, new "
              f"{statistics.median(times['new']):.1f} us (new/old "
              f"{statistics.median(times['new']) / statistics.median(times['old']):.4f}); max "
              f"|new - old| over dq, dk, dv {diff:.3g} (dQ's atomics reorder sums)", flush=True)
    meta = {"suite": "bwd_passes", "dot_rows_default": DOT_ROWS,
            "seconds": time.perf_counter() - t0}
    return write(meta, rows_out, args.json)


if __name__ == "__main__":
    sys.exit(main())
