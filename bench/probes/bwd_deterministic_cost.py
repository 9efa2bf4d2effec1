"""Question: what does attention_backward(deterministic=True) cost against the default
(float atomics for dQ)?

Answer so far (bench/NOTES.md, "bwd_sm90", H200, commit 9ea923f): bf16, causal, backward
alone: 2.59-4.24x the default (bwd_sm90 with atomics) and 1.99-2.62x bwd_sm80's own atomics,
because deterministic=True runs bwd_sm80's ordered accumulation, whose key tiles of one query
tile add strictly in turn; float32 (generic kernel) 1.06-1.13x. Open: a deterministic Hopper
backward, or dQ split into a few partial buffers summed in a fixed order.

    PYTHONPATH=. python bench/probes/bwd_deterministic_cost.py   # bf16, float32; d=64/128, L=1k/4k
Medians of CUDA-event timings after a warm-up, the same inputs for both modes, causal.
On Hopper the default 16-bit backward is bwd_sm90 and deterministic=True runs bwd_sm80, so
for bf16 the atomics of both are timed: "atomics ms" is the default (bwd_sm90), "sm80 ms"
bwd_sm80's atomics (CUFLASH_BWD=sm80), and the ratios are against each.
"""
import os

import cupy
import ml_dtypes
import numpy

import cuflash


def median_ms(fn, n=10):
    fn()
    times = []
    for _ in range(n):
        a, b = cupy.cuda.Event(), cupy.cuda.Event()
        a.record(); fn(); b.record(); b.synchronize()
        times.append(cupy.cuda.get_elapsed_time(a, b))
    return float(numpy.median(times))


def sm80_atomics_ms(fn):
    os.environ["CUFLASH_BWD"] = "sm80"
    try:
        return median_ms(fn)
    finally:
        del os.environ["CUFLASH_BWD"]


print(f"{'dtype':8s} {'d':>4s} {'L':>5s} {'atomics ms':>10s} {'determ. ms':>10s} {'ratio':>6s}"
      f" {'sm80 ms':>8s} {'ratio':>6s}")
for dtype in (ml_dtypes.bfloat16, numpy.float32):
    for d in (64, 128):
        for L in (1024, 4096):
            B, H = 16384 // L, 2048 // d
            rng = cupy.random.default_rng(0)
            q, k, v, do = (rng.standard_normal((B, H, L, d), dtype=numpy.float32).astype(dtype)
                           for _ in range(4))
            o, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
            t = [median_ms(lambda det=det: cuflash.attention_backward(
                do, q, k, v, o, lse, causal=True, deterministic=det)) for det in (False, True)]
            line = f"{numpy.dtype(dtype).name:8s} {d:4d} {L:5d} {t[0]:10.2f} {t[1]:10.2f} {t[1] / t[0]:6.2f}"
            if numpy.dtype(dtype).itemsize == 2:
                t80 = sm80_atomics_ms(lambda: cuflash.attention_backward(do, q, k, v, o, lse, causal=True))
                line += f" {t80:8.2f} {t[1] / t80:6.2f}"
            print(line, flush=True)
