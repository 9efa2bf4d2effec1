"""What the suite scripts beside it (suite_mods.py, suite_decode.py, suite_varlen.py) share:
the CUDA-event timing of one call and the results file.

Timing: ``median_event_ms(fn, n_sets)`` calls ``fn(i)`` with ``i`` cycling over ``n_sets``
input sets (so that a call does not find the previous call's inputs in L2), ``warmup`` times,
then ``iters`` times between two CUDA events each, back to back; the median of those
``iters`` event intervals, in ms.
"""
from __future__ import annotations

import json
from typing import Callable


def median_event_ms(fn: Callable[[int], object], n_sets: int = 1, iters: int = 20,
                    warmup: int = 3) -> float:
    import cupy
    for i in range(warmup):
        fn(i % n_sets)
    cupy.cuda.Device().synchronize()
    starts = [cupy.cuda.Event() for _ in range(iters)]
    ends = [cupy.cuda.Event() for _ in range(iters)]
    for i in range(iters):
        starts[i].record()
        fn(i % n_sets)
        ends[i].record()
    ends[-1].synchronize()
    ts = sorted(cupy.cuda.get_elapsed_time(s, e) for s, e in zip(starts, ends))
    return ts[len(ts) // 2]


def finish(meta: dict, rows: list, out: str | None) -> int:
    """Name the device in ``meta``, write ``{"meta", "rows"}`` to ``out`` (if given) and say
    how many rows; the exit status of a suite script."""
    try:
        import cupy
        meta["device"] = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    except Exception:
        pass
    if out:
        with open(out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(f"{len(rows)} rows in {meta['seconds']:.0f} s")
    return 0


def compile_flex(torch):
    """``torch.compile(flex_attention)`` for a benchmark: every (score_mod, mask, shape, grad
    mode) is a recompile, and past dynamo's default limit of 8 it silently runs the unfused
    fallback that materialises the L x L scores (1-13 TFLOP/s on the first H200 run of the
    mods suite), so the limits are raised first."""
    from torch.nn.attention.flex_attention import flex_attention
    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                 "accumulated_cache_size_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, 4096)
    return torch.compile(flex_attention)
