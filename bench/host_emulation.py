#!/usr/bin/env python3
"""cuflash's host path on a machine without a GPU: CuPy's device calls replaced by stand-ins, so
the Python work of a call (validation, plan lookup, packing, the fast paths) runs, is timed
and is profiled where there is no device (this machine, CI).

    PYTHONPATH=. python bench/host_emulation.py [--calls 2000] [--json out.json]
        [--profile CASE:DIRECTION]

What is replaced (``install``; the process is changed for good: run it as a script or in a
subprocess, never inside a test process): the CUDA runtime's device queries (an H200: cc 9.0,
132 SMs, 227 KB of opt-in shared memory), ``cupy.cuda.alloc`` / ``cupy.empty`` /
``cupy.zeros`` / ``cupy.asarray`` (arrays on one large unowned range of fake device memory: their contents are
never read), ``cupy.cuda.Device`` and the current stream, ``memsetAsync`` and
``cuLaunchKernel`` (no-ops), and NVRTC (``_jit.get_kernel``: a kernel that reports no spills,
so dispatch takes its first choice). Everything cuflash decides on the host is its own code.

What it measures: per case and direction (``fwd``: ``attention``; ``bwd``:
``attention_backward`` with the forward's o and lse), the host time a call of ``--calls`` calls
after 20 warm-up calls (no driver time: a real launch adds ~4-6 us each, bench/host_overhead.py),
``hits``, plan-cache hits a call (one on either path: the fast path's entry, or the general
path's plan), and ``general``, the fraction of calls that took the general path (counted in
``_problem.make_problem``, which the fast paths skip).
Cases: ``plain``, ``window`` (128, 0), ``softcap`` 50, ``block_mask`` (the mods suite's 8
documents at L 256), ``block_mask_causal``, ``bias`` (a (L, L) bias: no fast path; the general
path's cost). tests/test_host_emulation.py runs it and checks that every array-free case's
repeated calls take their fast path.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

SHAPE = (1, 2, 256, 64)
#: bytes of fake device memory (never touched: an address range for the arrays' pointers)
ARENA = 1 << 36


def install() -> None:
    """Replace CuPy's device calls with the stand-ins of the module docstring."""
    import math
    import numpy
    import cupy
    from cupy.cuda import driver, memory, runtime

    arena = memory.UnownedMemory(1 << 40, ARENA, None, device_id=0)
    top = [0]

    def alloc(nbytes):
        off = top[0]
        top[0] = (off + max(int(nbytes), 1) + 255) // 256 * 256
        if top[0] > ARENA:                       # wrap: contents are never read
            off, top[0] = 0, (max(int(nbytes), 1) + 255) // 256 * 256
        return memory.MemoryPointer(arena, off)

    def empty(shape, dtype=float, order="C"):
        dtype = numpy.dtype(dtype)
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        return cupy.ndarray(shape, dtype, alloc(math.prod(shape) * dtype.itemsize))

    def asarray(a, dtype=None, order=None):
        if isinstance(a, cupy.ndarray):
            return a if dtype is None or a.dtype == dtype else empty(a.shape, dtype)
        host = numpy.asarray(a, dtype)
        return empty(host.shape, host.dtype)

    class Device:
        def __init__(self, device=0):
            self.id = device

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def synchronize(self):
            pass

    class Stream:
        ptr = 0

    class Kernel:                                # what _launch and _spills read of a kernel
        class kernel:
            ptr = 1
        max_dynamic_shared_size_bytes = 0
        local_size_bytes = 0
        num_regs = 128

    runtime.getDevice = lambda: 0
    runtime.getDeviceCount = lambda: 1
    runtime.getDeviceProperties = lambda i: {
        "name": b"NVIDIA H200 (host emulation)", "major": 9, "minor": 0,
        "multiProcessorCount": 132, "l2CacheSize": 60 << 20}
    runtime.deviceGetAttribute = lambda attr, i: 232448
    runtime.memsetAsync = lambda *args: None
    driver.launchKernel = lambda *args: None
    cupy.cuda.alloc = cupy.cuda.memory.alloc = alloc
    cupy.empty, cupy.zeros, cupy.asarray = empty, empty, asarray
    cupy.cuda.Device = Device
    cupy.cuda.get_current_stream = lambda: Stream()
    from cuflash import _jit
    _jit.get_kernel = lambda *args, **kw: Kernel()


def cases(cuflash, L: int) -> dict[str, dict]:
    import cupy
    import ml_dtypes
    import numpy

    def document(b, h, q_idx, kv_idx):
        return (q_idx // (L // 8)) == (kv_idx // (L // 8))
    bm = cuflash.block_mask(document, (1, 1), L, L)
    return {"plain": {}, "window": {"window": (128, 0)}, "softcap": {"softcap": 50.0},
            "block_mask": {"block_mask": bm}, "block_mask_causal": {"block_mask": bm,
                                                                     "causal": True},
            "bias": {"bias": cupy.empty((L, L), numpy.dtype(ml_dtypes.bfloat16))}}


def measure(calls: int, profile: str | None = None) -> list[dict]:
    install()
    import cupy
    import ml_dtypes
    import numpy
    import cuflash
    from cuflash import _api, _problem
    validated = [0]                  # calls that took the general path (it validates first)
    make_problem = _problem.make_problem

    def counted(*args, **kw):
        validated[0] += 1
        return make_problem(*args, **kw)
    _problem.make_problem = counted
    bf16 = numpy.dtype(ml_dtypes.bfloat16)
    q, k, v, do = (cupy.empty(SHAPE, bf16) for _ in range(4))
    rows = []
    for name, kw in cases(cuflash, SHAPE[2]).items():
        o, lse = cuflash.attention(q, k, v, return_lse=True, **kw)
        fns = {"fwd": lambda kw=kw: cuflash.attention(q, k, v, **kw),
               "bwd": lambda kw=kw, o=o, lse=lse: cuflash.attention_backward(
                   do, q, k, v, o, lse, **kw)}
        for direction, fn in fns.items():
            for _ in range(20):
                fn()
            if profile == f"{name}:{direction}":
                from host_overhead import print_profile
                print_profile(profile, fn, lambda: None, calls=calls, top=30)
            hits, general = _api._FWD_PLANS.hits + _api._BWD_PLANS.hits, validated[0]
            loops = []
            for _ in range(3):
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                loops.append((time.perf_counter() - t0) / calls * 1e6)
            rows.append({"case": name, "direction": direction,
                         "host_us": statistics.median(loops),
                         "hits": (_api._FWD_PLANS.hits + _api._BWD_PLANS.hits - hits)
                         / (3 * calls),
                         "general": (validated[0] - general) / (3 * calls)})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--json", default=None)
    ap.add_argument("--profile", default=None, metavar="CASE:DIRECTION",
                    help="also print cProfile's 30 functions with the most own time, e.g. "
                         "block_mask:bwd")
    args = ap.parse_args(argv)
    rows = measure(args.calls, args.profile)
    for r in rows:
        print(f"{r['case']:18s} {r['direction']}  {r['host_us']:7.1f} us  "
              f"plan-cache hits a call {r['hits']:.2f}  general path {r['general']:.2f}")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(
            {"meta": {"tool": "host_emulation", "shape": list(SHAPE), "calls": args.calls},
             "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
