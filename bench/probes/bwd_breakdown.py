"""Question: where does the GPU time of one backward go at small L: D = rowsum(dO o O), the
main kernel, or the rest (the dq zero fill and cast, and the host's time between launches)?

Answer so far (bench/NOTES.md, "bwd_sm90 v1.3"; H200, commit 311ecc5): the D kernel went from
0.26 ms to 0.08 ms at every shape; the main kernel is ~50-60% of a synchronised backward at
L = 1k and ~94% at 16k; "rest" is still 0.32-0.48 ms at 1k: the dq zero fill and cast (~0.1 ms
of memory traffic) and the host time of the call. Open: fusing the dq cast into the last key
tile; what the plan cache (issue 9) takes off "rest".

    PYTHONPATH=. python bench/probes/bwd_breakdown.py     # bf16, B*L = 16k tokens, H*d = 2048

It wraps the one launcher's launch (``cuflash._launch.Launch.__call__``, private) with CUDA
events, named by the kernel each Launch runs.

For each d in {64, 128}, L in {1k, 16k}, causal and not: medians over --reps backward calls
(after 3 untimed), in ms and as shares of the whole backward; the forward once for o, lse.
Each backward is timed alone (synchronised), so "rest" also holds the time the GPU waits for
the host between launches (the Python of the call), which a stream of calls would hide.
"""
import argparse

import cupy
import ml_dtypes
import numpy

import cuflash
from cuflash import _launch

ap = argparse.ArgumentParser()
ap.add_argument("--reps", type=int, default=15)
a = ap.parse_args()

spans: dict[str, list] = {}
_launch_call = _launch.Launch.__call__


def timed_launch(self, stream, *pointers):
    e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
    e0.record()
    _launch_call(self, stream, *pointers)
    e1.record()
    spans.setdefault("dot" if "dot_do_o" in self.name else "main", []).append((e0, e1))


_launch.Launch.__call__ = timed_launch
print(f"{'d':>4s} {'L':>6s} {'causal':>6s} {'bwd ms':>8s} {'main':>12s} {'dot':>12s} {'rest':>12s}")
for d in (64, 128):
    for L in (1024, 16384):
        B, H = max(1, 16384 // L), 2048 // d
        rng = cupy.random.default_rng(0)
        q, k, v, do = (rng.standard_normal((B, H, L, d), dtype=numpy.float32).astype(ml_dtypes.bfloat16)
                       for _ in range(4))
        for causal in (False, True):
            o, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
            tot, main, dot = [], [], []
            for i in range(3 + a.reps):
                spans.clear()
                e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
                e0.record()
                cuflash.attention_backward(do, q, k, v, o, lse, causal=causal)
                e1.record()
                e1.synchronize()
                if i >= 3:
                    tot.append(cupy.cuda.get_elapsed_time(e0, e1))
                    main.append(sum(cupy.cuda.get_elapsed_time(x, y) for x, y in spans["main"]))
                    dot.append(sum(cupy.cuda.get_elapsed_time(x, y) for x, y in spans["dot"]))
            t, m, dd = (float(numpy.median(x)) for x in (tot, main, dot))
            r = t - m - dd
            print(f"{d:4d} {L:6d} {str(causal):>6s} {t:8.3f} {m:7.3f} {m / t:4.0%} {dd:7.3f} {dd / t:4.0%} {r:7.3f} {r / t:4.0%}",
                  flush=True)
