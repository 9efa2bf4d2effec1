"""What the suite scripts beside it (suite_mods.py, suite_decode.py, suite_varlen.py) share:
the CUDA-event timing of one call and the results file.

Timing: ``median_event_ms(fn, n_sets)`` calls ``fn(i)`` with ``i`` cycling over ``n_sets``
input sets (so that a call does not find the previous call's inputs in L2), ``warmup`` times
and for at least ``warm_ms`` ms of wall time, then ``iters`` times between two CUDA events
each, back to back; the median of those ``iters`` event intervals, in ms.
"""
from __future__ import annotations

import json
import time
from typing import Callable

#: the least wall time a timing warms the GPU up for. An idle H200 reads 345 MHz (nvidia-smi,
#: session 12) and its clock rises while it works; 3 calls of a 0.16 ms kernel (the documents
#: mask's forward at 4k) are 0.5 ms of work after seconds of idle (a compile, FlexAttention's
#: torch.compile), and that point read 124-140 TFLOP/s in some processes and 191-214 in others
#: on the same code (bench/NOTES.md, session 12). Calls synchronise one by one past ``warmup``.
WARM_MS = 30.0
#: ... and the most calls that warming may take (a call of ~30 us: ~1000 calls)
WARM_CALLS = 1000


def median_event_ms(fn: Callable[[int], object], n_sets: int = 1, iters: int = 20,
                    warmup: int = 3, warm_ms: float = WARM_MS) -> float:
    import cupy
    start, i = time.perf_counter(), 0
    while i < warmup or (i < WARM_CALLS and (time.perf_counter() - start) * 1e3 < warm_ms):
        fn(i % n_sets)
        i += 1
        if i >= warmup:
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


def compile_with_define(source: str, define_of: Callable[[], str], modules: dict | None = None):
    """Probes only: wrap ``cuflash._jit.get_kernel`` so that ``cuda_src/<source>`` compiles
    after ``#define NAME 1``, NAME = ``define_of()`` read when a plan compiles (an arm's
    environment, say); an empty NAME leaves the package's build. The kernel cache is keyed by
    the prelude, so each define is its own build. ``modules``: each such build is compiled here
    instead and its ``cupy.RawModule`` kept there, by (expr, device, prelude), for a probe that
    reads the module's globals (``probes/ws_stamps.py``). Returns the function that restores
    ``get_kernel``."""
    from cuflash import _jit
    orig = _jit.get_kernel

    def get_kernel(src, expr, device_id, prelude=""):
        name = define_of()
        if src != source or not name:
            return orig(src, expr, device_id, prelude)
        prelude = f"#define {name} 1\n" + prelude
        if modules is None:
            return orig(src, expr, device_id, prelude)
        key = (expr, device_id, prelude)
        if key not in modules:
            import cupy
            with cupy.cuda.Device(device_id):
                arch = _jit.arch_of_device(device_id)
                module = cupy.RawModule(code=prelude + _jit.load_source(src),
                                        options=_jit._options(arch), name_expressions=(expr,))
                kernel = module.get_function(expr)
                kernel.compile()
            modules[key] = (module, kernel)
        return modules[key][1]

    _jit.get_kernel = get_kernel
    return lambda: setattr(_jit, "get_kernel", orig)


def arm_orders(arms: list, rounds: int) -> list:
    """The arms' order in each of ``rounds`` rounds (the probes' rounds, suite_decode's and
    suite_mods' ``--rounds``): at ~650 TFLOP/s the H200's clock sags under sustained load
    (session 16, call 7: the same build read 689 then 584-616 TFLOP/s in five arms in a row),
    so a fixed order favours the first arm; and an arm timed right after a lighter one (fwd_sm90
    before fwd_sm90ws) starts with the clock's headroom (session 21: one kernel object read 6-9%
    faster after the sm90 arm than after a ws arm, d 128 4k; a rotation, which kept the same
    neighbours, gave the arm after sm90 that lead in 5 rounds of 7). So the rounds are a
    balanced Latin square (Williams): every arm first once in ``len(arms)`` rounds, and every
    arm right after every other equally often (in ``len(arms)`` rounds, twice as many when odd)."""
    n = len(arms)
    base, lo, hi = [0], 1, n - 1
    while len(base) < n:   # 0, 1, n - 1, 2, n - 2, ...: each step's difference once
        base.append(lo)
        lo += 1
        if len(base) < n:
            base.append(hi)
            hi -= 1
    rows = [[(b + r) % n for b in base] for r in range(n)]
    if n % 2:
        rows += [row[::-1] for row in rows]
    return [[arms[i] for i in rows[k % len(rows)]] for k in range(rounds)]


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


def bf16_zeros(shape):
    """A CuPy bfloat16 array of zeros: the probes' compile warm-ups (never timed)."""
    import cupy
    import ml_dtypes
    import numpy
    return cupy.asarray(numpy.zeros(shape, ml_dtypes.bfloat16))


def _warm_report(what: str, fn: Callable[[], object]) -> None:
    try:
        fn()
    except Exception as exc:     # the timed run reports it
        print(f"# warm-up ({what}): {type(exc).__name__}: {str(exc)[:200]}", flush=True)


def warm_arms(arms, envs: dict, jobs: list, flex_warm: Callable[[], object] | None = None,
              workers: int = 16) -> None:
    """Compile every arm's kernels before timing: each arm's ``jobs`` (zero-argument calls, one
    a point, on the timed shapes) in ``workers`` threads under its environment ``envs[arm]``
    (NVRTC runs outside the GIL; the switches are process-wide, so the arms one after the
    other), and ``flex_warm`` (FlexAttention's torch.compile) in this thread while the first
    arm's kernels compile. A failure is printed; the timed run reports it."""
    from concurrent.futures import ThreadPoolExecutor
    import cupy
    import bench_attention
    for i, arm in enumerate(arms):
        with bench_attention.env(**envs[arm]):
            with ThreadPoolExecutor(workers) as pool:
                futures = [pool.submit(job) for job in jobs]
                if i == 0 and flex_warm is not None:
                    _warm_report("flex", flex_warm)
                for f in futures:
                    _warm_report(arm, f.result)
        cupy.cuda.Device().synchronize()


def attention_call(mode: str, q, k, v, do, kw: dict) -> Callable[[int], object]:
    """The call a probe times at one point: ``cuflash.attention`` (``mode`` "fwd") or its
    forward and pullback (``attention_vjp`` then the pullback of ``do``: "fwd_bwd")."""
    import cuflash
    if mode == "fwd":
        return lambda i: cuflash.attention(q, k, v, **kw)
    return lambda i: cuflash.attention_vjp(q, k, v, **kw)[1](do)


def time_arm(arm: str, env: dict, fn: Callable[[int], object], flops: float, row: dict,
             describe: Callable[[], dict] | None = None, iters: int = 10,
             warmup: int = 2) -> tuple[float | None, dict]:
    """One arm of a probe's point: ``fn`` timed (``median_event_ms``, one input set) under the
    arm's switches (``bench_attention.env``: plans cleared around it). Returns (ms, the row:
    ``row`` with impl, ms, tflops and what ``describe()`` adds, under the same switches, e.g.
    the kernel the dispatcher picked); a failing arm is (None, a row with its note), not the end
    of the run."""
    import bench_attention
    try:
        with bench_attention.env(**env):
            ms = median_event_ms(fn, 1, iters, warmup)
            more = describe() if describe else {}
        return ms, dict(row, impl=arm, ms=ms, tflops=flops / ms / 1e9, **more)
    except Exception as exc:
        return None, dict(row, impl=arm, ms=None, tflops=None,
                          note=f"{type(exc).__name__}: {str(exc)[:300]}")


def dump_probe(path: str | None, probe: str, arms: dict, rows: list, complete: bool) -> None:
    """A probe's --json file, rewritten after every point: a run cut by the device's time limit
    keeps the points it finished (``meta.complete`` false until the end)."""
    if path:
        with open(path, "w") as f:
            json.dump({"meta": {"probe": probe, "dtype": "bfloat16", "arms": arms,
                                "complete": complete}, "rows": rows}, f, indent=1)
