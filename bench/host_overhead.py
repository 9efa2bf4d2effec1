"""Host (Python) time of one cuflash.attention call on the GPU path, and where it goes.

    PYTHONPATH=. python bench/host_overhead.py

A tiny problem keeps the kernel far shorter than the host work, so calls/second measures the
Python side: validation, dispatch, the parameter block and CuPy's launch. At L = 1k the
benchmark's kernels take ~0.4 ms, so a host cost near that would starve the GPU.
"""
import cProfile
import pstats
import time

import cupy
import ml_dtypes
import numpy

import cuflash


def main():
    rng = cupy.random.default_rng(0)
    q, k, v = (rng.standard_normal((16, 32, 1024, 64), dtype=numpy.float32).astype(ml_dtypes.bfloat16)
               for _ in range(3))
    small = [x[:1, :1, :16] for x in (q, k, v)]
    for args, label in ((small, "tiny (1,1,16,64)"), ((q, k, v), "bench (16,32,1024,64)")):
        for _ in range(20):
            cuflash.attention(*args)
        cupy.cuda.Device().synchronize()
        n = 300
        t0 = time.perf_counter()
        for _ in range(n):
            cuflash.attention(*args)
        t1 = time.perf_counter()
        cupy.cuda.Device().synchronize()
        t2 = time.perf_counter()
        print(f"{label}: host {1e6 * (t1 - t0) / n:.1f} us/call, with the queue drained "
              f"{1e6 * (t2 - t0) / n:.1f} us/call")
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(300):
        cuflash.attention(*small)
    pr.disable()
    cupy.cuda.Device().synchronize()
    pstats.Stats(pr).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
