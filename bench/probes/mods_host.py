#!/usr/bin/env python3
"""Question (session 13, issue 10): what does a call with a modifier cost the host, and where
does it go? The mods suite's documents forward at d 64, L 4k read 109 TFLOP/s against
FlexAttention's 153 in session 13 (two processes agreeing), 193 against 156 in session 12 and
143 in session 12's probe of the same kernel: its kernel runs ~0.18 ms, and suite_common's
events around each call count the host's work before the launch whenever the GPU has caught
up, so a host path slower than the kernel reads as a slower kernel, by how slow the lent
machine's CPU is. Only plain calls have a fast path (``_api``: a cached entry, pointers
patched); a call with ``block_mask``, ``window``, ``softcap``... validates, builds its keys and
walks its modifiers every time.

    PYTHONPATH=. python bench/probes/mods_host.py [--json out.json] [--calls 200] [--profile]

One process, bf16, random N(0, 1) inputs, a small shape (B 1, H 2, L 256, d 64: kernels of a
few us, so host time is what the loops see). Per case and direction (``fwd``: ``attention``;
``bwd``: ``attention_backward`` with the forward's o and lse): ``host_us``, the issue time a
call of ``--calls`` calls behind a spin kernel (bench/host_overhead.py's method), the median of
3 loops; ``gpu_us``, the GPU time a call of those calls. Cases: ``plain``, ``window`` (128, 0),
``softcap`` 50, ``block_mask`` (the mods suite's document mask_mod, 8 documents, through
``cuflash.block_mask``), ``block_mask_causal`` (the same with ``causal=True``, as the suite calls
it). ``--profile`` prints cProfile's 30 functions with the most own time for 300 forward calls
and 300 backward calls with the block mask.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "bench" / "probes")]

SHAPE = (1, 2, 256, 64)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args(argv)
    import cupy
    import ml_dtypes
    import cuflash
    from host_overhead import behind_spin, print_profile, spin_and_event
    from suite_mods import _document_of

    # (5x behind_spin's budget: a modifier call may pass its 200 us)
    spin, event = spin_and_event(cupy, stretch=5.0)
    sync = cupy.cuda.Device().synchronize
    B, H, L, d = SHAPE
    rs = cupy.random.RandomState(7)
    q, k, v, do = (rs.standard_normal(SHAPE, dtype=cupy.float32).astype(ml_dtypes.bfloat16)
                   for _ in range(4))
    doc = _document_of(L)
    cases = {"plain": {}, "window": {"window": (128, 0)}, "softcap": {"softcap": 50.0},
             "block_mask": {"block_mask": cuflash.block_mask(doc, (1, 1), L, L)},
             "block_mask_causal": {"block_mask": cuflash.block_mask(doc, (1, 1), L, L),
                                   "causal": True}}
    rows = []
    calls = {}
    for name, kw in cases.items():
        o, lse = cuflash.attention(q, k, v, return_lse=True, **kw)
        calls[name] = {"fwd": lambda kw=kw: cuflash.attention(q, k, v, **kw),
                       "bwd": lambda kw=kw, o=o, lse=lse: cuflash.attention_backward(
                           do, q, k, v, o, lse, **kw)}
        for direction, call in calls[name].items():
            for _ in range(30):
                call()
            issue, gpu, outlasted = behind_spin(
                call, args.calls, 3, spin, event, sync,
                lambda a, b: cupy.cuda.get_elapsed_time(a, b) * 1e-3)
            row = {"case": name, "direction": direction,
                   "host_us": statistics.median(issue) / args.calls * 1e6,
                   "gpu_us": statistics.median(gpu) / args.calls * 1e6,
                   "spin_outlasted": all(outlasted)}
            rows.append(row)
            print(f"{name:18s} {direction}  host {row['host_us']:7.1f} us  "
                  f"gpu {row['gpu_us']:6.1f} us{'' if row['spin_outlasted'] else '  (spin short)'}",
                  flush=True)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(
            {"meta": {"probe": "mods_host", "shape": list(SHAPE), "calls": args.calls},
             "rows": rows}, indent=1))
    if args.profile:
        for direction in ("fwd", "bwd"):
            print_profile(f"block_mask_causal {direction}", calls["block_mask_causal"][direction],
                          sync, top=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
