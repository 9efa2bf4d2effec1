#!/usr/bin/env python3
"""Host time per call, in µs: cuflash forward and backward, PyTorch SDPA flash, an empty CuPy
kernel, in one process on one tiny problem.

    PYTHONPATH=. python bench/host_overhead.py [--calls 2000] [--out DIR] [--profile]

The problem (B=1, H=1, L=64, d=64, bf16) makes every kernel far shorter than the host work,
so the time to issue ``--calls`` calls back to back, after a warm-up, divided by the calls, is
the host (Python + launch) cost of one call: ``us_per_call``. To check that the GPU was not the
bottleneck, the same loop is timed again up to a synchronisation after its last call
(``us_per_call_drained``); when that is more than 25% above ``us_per_call`` the row says
``gpu_bound: true`` and its figure is not a host time. Each figure is the median of
``--repeats`` loops.

That check cannot see a loop whose GPU work per call is as long as its host work (the launch
queue then stays full, and issue and drain both read the GPU's time: session 8 read cuflash's
host time 46% above session 7's with the same code, on a fresh machine whose SM clock idled
at 345 MHz). So each implementation is also timed **behind a spin kernel**: one thread busy-waits
on the GPU (``%globaltimer``) long enough that ``--spin-calls`` calls are all issued while it
runs; their issue time is then host time whatever the GPU's speed (``us_per_call_behind_spin``),
and CUDA events around them, which run once the spin ends, give the GPU time of a call with no
host gaps (``gpu_us_per_call``). ``queue_bound: true`` where the GPU time is >= 90% of the
back-to-back figure: that figure is then the GPU's, and ``us_per_call_behind_spin`` is the
host time to report. ``spin_outlasted: false`` says the spin ended before the issue did (the
behind-spin figure is then not clean).

Implementations: ``cuflash`` (``cuflash.attention``), ``cuflash_backward``
(``cuflash.attention_backward`` with ``o`` and ``lse`` from one forward), ``sdpa_flash``
(``torch.nn.functional.scaled_dot_product_attention`` on DLPack views of the same arrays,
with the flash backend forced once outside the loop and autograd off) and
``cupy_empty_kernel`` (a ``cupy.RawKernel`` with an empty body, one thread): the floor of a
launch from Python; ``cupy_alloc``, ``cupy_memset_async`` and ``cupy_ndarray_on_memptr``: the
pieces a backward call is made of besides its three launches, each alone; ``python_reference``
(no CUDA: a pure-Python call shaped like the fast path's key lookup), the machine's Python
speed, which with the header's ``cpu_model`` / ``cpu_mhz_mean`` makes host times from two
machines comparable. Writes ``bench/results/<gpu>/host_overhead.json`` (rows ``{"impl",
"us_per_call", ...}`` and the header of bench/bench_attention.py) and prints a table.
``--rounds R`` (session 19) times the implementations' back-to-back loops interleaved, in R
rounds of ``--repeats`` loops, the order rotated a round (``measure_rounds``): one host's speed
moved 1.7x between two processes a minute apart, and an implementation timed alone reads its
moment's speed; the rows then add each round's figure and the median of the per-round ratios to
SDPA flash. ``--profile`` also prints the 25 functions with the most own time in cuflash's forward call,
and in its backward call. ``--parts`` also times the pieces of the backward's fast path on its
own cached plan, each alone (rows ``bwd_part_*``: the key of six layouts, the device check, the
stream, the patch and two launches, each raw launch, the three arrays of the result, and the
plan's ``run``), the forward's raw launch (``fwd_part_launch``), and both fast paths copied
step by step (``fwd_step1..4``, ``bwd_step1..4``: key and lookup; + allocation; + launches;
+ result arrays), to say where the host time goes (issue 9: <= 15 / 25 us); and the backward
old vs new (session 12): ``bwd_old_two_launches`` (``CUFLASH_BWD_ONE_LAUNCH=0``: bwd_dot_do_o
and the main kernel) against ``bwd_new_one_launch`` (the default: the main kernel alone), the
same API steps on each plan, with each plan's launches raw (``bwd_part_launch_*``).
"""
from __future__ import annotations

import argparse
import math
import pathlib
import statistics
import sys
import time
from typing import Any, Callable, Sequence

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bench_attention as ba  # noqa: E402  (also puts the checkout's cuflash on sys.path)
from cuflash._bench import write_json  # noqa: E402

SHAPE = (1, 1, 64, 64)
GPU_BOUND_RATIO = 1.25
#: a 1-min load average above this (a quiet 16-core machine reads < 1) marks the run as not
#: quiet: session 7's call 3, right after a test run whose workers lingered, read every host
#: time ~40% high (SDPA's too)
QUIET_LOAD = 2.0


def machine_state() -> dict:
    """The load the host times were measured under: the 1-min load average and the number of
    other processes on the GPU (nvidia-smi; -1 where it cannot say). Goes into the header."""
    import os
    import subprocess
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout.split()
        others = sum(1 for pid in out if pid.strip().isdigit() and int(pid) != os.getpid())
    except (OSError, subprocess.SubprocessError):
        others = -1
    return {"load_average_1min": round(os.getloadavg()[0], 2), "other_gpu_processes": others,
            **cpu_state()}


def cpu_state(path: str = "/proc/cpuinfo") -> dict:
    """The host CPU's model and the mean of its cores' current clocks (MHz; None where the
    kernel does not say): cuflash's host path is Python-bound, so its time follows these
    (session 9 read 17 us where session 7 read 12.8 with the same code, the C++-bound SDPA
    and empty-kernel launch moving ~5%)."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return {"cpu_model": None, "cpu_mhz_mean": None}
    models = [line.split(":", 1)[1].strip() for line in text.splitlines()
              if line.startswith("model name")]
    mhz = [float(line.split(":", 1)[1]) for line in text.splitlines()
           if line.startswith("cpu MHz")]
    return {"cpu_model": models[0] if models else None,
            "cpu_mhz_mean": round(sum(mhz) / len(mhz), 1) if mhz else None}


def python_reference() -> Callable[[], Any]:
    """A pure-Python call shaped like the fast path's own work, no CUDA in it: three layout
    tuples read from objects, one key of them looked up in a dict, a few attribute reads.
    Its time is this machine's speed at what cuflash's host path spends most on, so host
    times from different machines can be compared through it."""
    class Mem:
        __slots__ = ("ptr", "device_id")

        def __init__(self):
            self.ptr, self.device_id = 1 << 40, 0

    class Arr:
        __slots__ = ("shape", "strides", "dtype", "data")

        def __init__(self):
            self.shape, self.strides = (1, 1, 64, 64), (8192, 8192, 128, 2)
            self.dtype, self.data = "bfloat16", Mem()

    def layout(x):
        mem = x.data
        return (x.shape, x.strides, x.dtype, mem.ptr & 15, mem.device_id)

    q, k, v = Arr(), Arr(), Arr()
    plans = {(layout(q), layout(k), layout(v), None, type(None), False, bool): Mem()}

    def call():
        key = (layout(q), layout(k), layout(v), None, type(None), False, bool)
        plan = plans.get(key)
        return plan.ptr + q.data.ptr + k.data.ptr + v.data.ptr
    return call


WARMUP = 50


def overhead_row(impl: str, calls: int, issue_s: Sequence[float],
                 drained_s: Sequence[float]) -> dict:
    """One result row from the loop times (seconds for ``calls`` calls): the median issue
    time and the median time to the end of the GPU work, in µs per call."""
    if calls < 1 or not issue_s or not drained_s:
        raise ValueError(f"{calls=} and the loop times must be non-empty ({issue_s=}, "
                         f"{drained_s=})")
    host = statistics.median(issue_s) / calls * 1e6
    drained = statistics.median(drained_s) / calls * 1e6
    return {"impl": impl, "us_per_call": host, "us_per_call_drained": drained, "calls": calls,
            "repeats": len(issue_s), "gpu_bound": drained > GPU_BOUND_RATIO * host}


def time_loop(fn: Callable[[], Any], calls: int, sync: Callable[[], None],
              clock: Callable[[], float] = time.perf_counter) -> tuple[float, float]:
    """Seconds to issue ``calls`` calls, and to the end of their GPU work."""
    sync()
    t0 = clock()
    for _ in range(calls):
        fn()
    t1 = clock()
    sync()
    return t1 - t0, clock() - t0


def measure(impl: str, fn: Callable[[], Any], calls: int, repeats: int,
            sync: Callable[[], None]) -> dict:
    for _ in range(WARMUP):
        fn()
    times = [time_loop(fn, calls, sync) for _ in range(repeats)]
    return overhead_row(impl, calls, [t[0] for t in times], [t[1] for t in times])


#: the implementation each round's ratios are taken against (``measure_rounds``)
BASE_IMPL = "sdpa_flash"


def measure_rounds(fns: dict, calls: int, repeats: int, rounds: int, sync: Callable[[], None],
                   loop: Callable = time_loop) -> tuple[dict, dict]:
    """``--rounds`` (session 19): the back-to-back loops of every implementation in ``rounds``
    rounds, ``repeats`` loops each a round, the order rotated by one a round
    (``suite_common.arm_orders``). One host's speed moved by 1.7x between two processes a
    minute apart in session 19 (python_reference 0.8 and 1.4 us, SDPA flash 17.7 and 28.3 us),
    and within a process an implementation timed alone reads that moment's speed; interleaved,
    each round compares the implementations at one speed. Returns (rows by implementation:
    ``overhead_row`` over all its loops, with ``us_per_call_rounds``, each round's median, and
    ``per_round_ratio_to_base``, the median over rounds of its round median / BASE_IMPL's;
    the failures by implementation: an exception stops that implementation only)."""
    from suite_common import arm_orders
    failed: dict = {}
    for impl, fn in fns.items():
        try:
            for _ in range(WARMUP):
                fn()
        except Exception as e:
            failed[impl] = e
    live = [impl for impl in fns if impl not in failed]
    times: dict = {impl: [] for impl in live}
    for order in arm_orders(live, rounds):
        for impl in order:
            if impl in failed:
                continue
            try:
                times[impl].append([loop(fns[impl], calls, sync) for _ in range(repeats)])
            except Exception as e:
                failed[impl] = e
    rows, per_round = {}, {}
    for impl in live:
        if impl in failed:
            continue
        flat = [t for rnd in times[impl] for t in rnd]
        row = overhead_row(impl, calls, [t[0] for t in flat], [t[1] for t in flat])
        per_round[impl] = [statistics.median(t[0] for t in rnd) / calls * 1e6 for rnd in times[impl]]
        rows[impl] = dict(row, rounds=rounds, us_per_call_rounds=per_round[impl])
    base = per_round.get(BASE_IMPL)
    for impl, row in rows.items():
        if base:
            row["per_round_ratio_to_base"] = statistics.median(
                a / b for a, b in zip(per_round[impl], base))
    return rows, failed


#: a GPU time per call this close to the back-to-back figure means the queue set the pace
QUEUE_BOUND_RATIO = 0.9
SPIN_SOURCE = r"""
extern "C" __global__ void cuflash_spin(long long ns) {
  // one thread busy-waits ns nanoseconds of the GPU's global timer: the calls issued behind
  // it queue up, so their issue time is host time only
  long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
}
"""


#: the SM clock a kernel sees: one thread counts its own cycles (clock64) over CLOCK_NS of the
#: global timer; cycles / ns is the clock in GHz, within the timer's resolution (~1 us on
#: recent GPUs: 10 us of spin read the clock within ~10%)
CLOCK_NS = 10_000
CLOCK_SOURCE = r"""
extern "C" __global__ void cuflash_clock(long long* out, int i, long long ns) {
  long long t0, t, c0 = clock64();
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
  out[2 * i] = clock64() - c0;
  out[2 * i + 1] = t - t0;
}
"""
#: a clock sample every this many calls of a loop (~0.1 us of GPU time a call)
CLOCK_EVERY = 100


def clock_mhz(samples) -> float:
    """The median SM clock in MHz of (cycles, ns) samples."""
    if len(samples) == 0:
        raise ValueError("no clock samples")
    return statistics.median(1e3 * c / ns for c, ns in samples if ns > 0)


def clocked_loop(fn: Callable[[], Any], calls: int, sample: Callable[[int], None],
                 sync: Callable[[], None], clock: Callable[[], float] = time.perf_counter
                 ) -> float:
    """Seconds to issue ``calls`` calls with ``sample(n)`` (a clock sample, n = 0, 1, ...)
    issued after every CLOCK_EVERY-th: the SM clock the calls ran at when issued back to back.
    Session 12 read the backward 26.7 us back to back but 18.4 behind the spin, which runs the
    calls at the clock the spin raised: a GPU left idle between tiny calls may clock down
    until the calls' own GPU time paces the loop."""
    sync()
    t0 = clock()
    for i in range(calls):
        fn()
        if i % CLOCK_EVERY == 0:
            sample(i // CLOCK_EVERY)
    t1 = clock()
    sync()
    return t1 - t0


def spin_and_event(cp, stretch: float = 1.0) -> tuple[Callable[[float], Any], Callable[[], Any]]:
    """``(spin, event)`` for :func:`behind_spin` on CuPy ``cp``: ``spin(seconds)`` enqueues the
    spin kernel for ``stretch`` x ``seconds`` and returns an event recorded after it;
    ``event()`` records one on the current stream."""
    kernel = cp.RawKernel(SPIN_SOURCE, "cuflash_spin")

    def event():
        ev = cp.cuda.Event()
        ev.record()
        return ev

    def spin(seconds: float):
        kernel((1,), (1,), (cp.int64(int(stretch * seconds * 1e9)),))
        return event()
    return spin, event


def spin_row(row: dict, calls: int, issue_s: Sequence[float], gpu_s: Sequence[float],
             outlasted: Sequence[bool]) -> dict:
    """``row`` (overhead_row's) with the behind-spin figures: the median host issue time and
    GPU time of ``calls`` calls issued behind a spin kernel, in µs per call, and the flags."""
    if calls < 1 or not issue_s or len(issue_s) != len(gpu_s) or len(gpu_s) != len(outlasted):
        raise ValueError(f"{calls=} and one issue time, GPU time and flag a loop "
                         f"({issue_s=}, {gpu_s=}, {outlasted=})")
    host = statistics.median(issue_s) / calls * 1e6
    gpu = statistics.median(gpu_s) / calls * 1e6
    return dict(row, us_per_call_behind_spin=host, gpu_us_per_call=gpu,
                queue_bound=gpu >= QUEUE_BOUND_RATIO * row["us_per_call"],
                spin_outlasted=all(outlasted))


def behind_spin(fn: Callable[[], Any], calls: int, repeats: int, spin: Callable[[float], Any],
                event: Callable[[], Any], sync: Callable[[], None],
                elapsed: Callable[[Any, Any], float],
                clock: Callable[[], float] = time.perf_counter) -> tuple[list, list, list]:
    """Issue ``calls`` calls behind a spin kernel, ``repeats`` times: (host seconds, GPU
    seconds between events around the calls, whether the spin was still running when the
    last call was issued). ``spin(seconds)`` enqueues the spin and returns an event recorded
    after it (``.done``: whether it has completed); ``event()`` records one on the current
    stream; ``elapsed(a, b)``: seconds between two completed events."""
    issue, gpu, outlasted = [], [], []
    budget = 200e-6 * calls               # generous: 200 us of host time a call
    for _ in range(repeats):
        sync()
        spun = spin(budget)
        t0 = clock()
        for _ in range(calls):
            fn()
        t1 = clock()
        still = not spun.done
        end = event()
        sync()
        issue.append(t1 - t0)
        gpu.append(elapsed(spun, end))
        outlasted.append(still)
    return issue, gpu, outlasted


def format_rows(rows: Sequence[dict]) -> str:
    ref = next((r["us_per_call"] for r in rows if r["impl"] == "sdpa_flash"), None)
    body = [[r["impl"], f"{r['us_per_call']:.1f}", f"{r['us_per_call_drained']:.1f}",
             f"{r['us_per_call'] / ref:.2f}" if ref else "-",
             f"{r['us_per_call_behind_spin']:.1f}" if "us_per_call_behind_spin" in r else "-",
             f"{r['gpu_us_per_call']:.1f}" if "gpu_us_per_call" in r else "-",
             "GPU-BOUND" if r["gpu_bound"] else "QUEUE-BOUND" if r.get("queue_bound")
             else "ok" if r.get("spin_outlasted", True) else "spin too short"] for r in rows]
    head = ["impl", "us/call", "us/call drained", "/ sdpa_flash", "us/call behind spin",
            "GPU us/call", "check"]
    if any("us_per_call_rounds" in r for r in rows):     # --rounds
        head += ["rounds (us/call)", "per-round / sdpa_flash"]
        for line, r in zip(body, rows):
            line += ([" ".join(f"{x:.1f}" for x in r["us_per_call_rounds"]),
                      f"{r['per_round_ratio_to_base']:.2f}" if "per_round_ratio_to_base" in r
                      else "-"] if "us_per_call_rounds" in r else ["-"] * 2)
    if any("sm_mhz_in_loop" in r for r in rows):     # --clocks
        head += ["MHz in loop", "MHz behind spin", "us/call beside spin"]
        for line, r in zip(body, rows):
            line += ([f"{r['sm_mhz_in_loop']:.0f}", f"{r['sm_mhz_behind_spin']:.0f}",
                      f"{r['us_per_call_beside_spin']:.1f}"] if "sm_mhz_in_loop" in r
                     else ["-"] * 3)
    return ba.render_table(head, body)


def build(q, k, v) -> dict[str, Callable[[], Any]]:
    """The calls to time, on the same (tiny) arrays; a peer that cannot run is left out with
    a note."""
    import cupy as cp
    import cuflash
    fns: dict[str, Callable[[], Any]] = {"cuflash": lambda: cuflash.attention(q, k, v)}
    o, lse = cuflash.attention(q, k, v, return_lse=True)
    do = cp.asarray(cp.random.RandomState(1).standard_normal(o.shape, dtype=cp.float32)
                    .astype(o.dtype))
    fns["cuflash_backward"] = lambda: cuflash.attention_backward(do, q, k, v, o, lse)
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
        tq, tk, tv = (torch.from_dlpack(x) for x in (q, k, v))     # zero copy
        sdpa = torch.nn.functional.scaled_dot_product_attention
        torch.set_grad_enabled(False)
        # entered once for the whole run: the calls themselves carry no context manager
        sdpa_kernel(SDPBackend.FLASH_ATTENTION).__enter__()
        fns["sdpa_flash"] = lambda: sdpa(tq, tk, tv)
    except Exception as e:
        print(f"sdpa_flash left out: {ba.short_error(e)}", file=sys.stderr)
    empty = cp.RawKernel(r'extern "C" __global__ void cuflash_empty() {}', "cuflash_empty")
    fns["cupy_empty_kernel"] = lambda: empty((1,), (1,), ())
    # The pieces a backward call is made of, each alone, to split its host time: a pool
    # allocation, an asynchronous memset of a small workspace, and an array made on existing
    # memory (the fast path makes three).
    mem = cp.cuda.alloc(1 << 16)
    stream = cp.cuda.get_current_stream().ptr
    fns["cupy_alloc"] = lambda: cp.cuda.alloc(1 << 16)
    fns["cupy_memset_async"] = lambda: cp.cuda.runtime.memsetAsync(mem.ptr, 0, 1 << 16, stream)
    fns["cupy_ndarray_on_memptr"] = lambda: cp.ndarray(q.shape, q.dtype, memptr=mem)
    fns["python_reference"] = python_reference()
    return fns


def _fast_backward(cuflash, q, k, v, o, lse, do, one_launch: str):
    """The cached fast-path entry and plan of one backward, built with
    ``CUFLASH_BWD_ONE_LAUNCH=one_launch`` ("" : the default rule), the caches cleared first."""
    import os
    from cuflash import _api, _fast
    old = os.environ.get("CUFLASH_BWD_ONE_LAUNCH")
    if one_launch:
        os.environ["CUFLASH_BWD_ONE_LAUNCH"] = one_launch
    else:
        os.environ.pop("CUFLASH_BWD_ONE_LAUNCH", None)
    try:
        _api.clear_plans()
        cuflash.attention_backward(do, q, k, v, o, lse)
    finally:
        if old is None:
            os.environ.pop("CUFLASH_BWD_ONE_LAUNCH", None)
        else:
            os.environ["CUFLASH_BWD_ONE_LAUNCH"] = old
    return next(f for f in _api._BWD_PLANS._d.values() if isinstance(f, _fast.FastBackward))


def backward_parts(q, k, v) -> dict[str, Callable[[], Any]]:
    """The pieces of ``attention_backward``'s fast path, each callable alone, on the plans that
    a first call caches (``--parts``). The launches get buffers held here, so each piece can
    run any number of times: the main kernel alone is safe (its dQ counters only count; no
    block waits on them; the one-launch build sets them back to 0 itself).
    Old vs new in one process (issue 9): ``bwd_old_two_launches`` and ``bwd_new_one_launch``
    run the same steps as the API's fast path (the key, the lookup, the device check, then the
    cached entry) on the plan built with ``CUFLASH_BWD_ONE_LAUNCH=0`` (bwd_dot_do_o, then the
    main kernel, a fresh workspace a call) and on the default plan (one launch, where the rule
    takes it: ``bwd_new_is_one_launch`` in the header line printed)."""
    import cupy as cp
    import numpy
    import cuflash
    from cuflash import _api, _fast, _plan
    from cupy.cuda import driver
    o, lse = cuflash.attention(q, k, v, return_lse=True)
    do = cp.asarray(cp.random.RandomState(2).standard_normal(o.shape, dtype=cp.float32)
                    .astype(o.dtype))
    old_fast = _fast_backward(cuflash, q, k, v, o, lse, do, "0")
    fast = _fast_backward(cuflash, q, k, v, o, lse, do, "")
    old, plan = old_fast.plan, fast.plan
    print(f"--parts: bwd_new_is_one_launch={plan.one_kernel} ({plan.choice.expr})",
          file=sys.stderr)
    cuflash.attention(q, k, v, return_lse=True)      # the forward's entry, after the clear
    fwd_fast = next(f for f in _api._FWD_PLANS._d.values() if isinstance(f, _fast.FastForward))
    fwd = fwd_fast.plan
    stream = cp.cuda.get_current_stream().ptr
    held = cp.cuda.alloc(fast.nbytes)
    base, (_, ok, ov) = held.ptr, fast.offsets

    def patch(p, ws):
        """Patch plan p's block with held pointers (workspace ws) once: the raw launches below
        then reuse it."""
        dpsum, dq_acc, dq_sem = p._ws_words
        words = (q.data.ptr, k.data.ptr, v.data.ptr, o.data.ptr, lse.data.ptr, do.data.ptr,
                 ws.ptr + dpsum, ws.ptr + dq_acc, base + ok, base + ov, ws.ptr + dq_sem)
        extra = ((_plan._DQ_WORD, base),) if p.fused_dq else ()
        p.launch(stream, words, extra=extra)
        return words, extra
    old_ws = cp.cuda.alloc(old.workspace)
    old_words, old_extra = patch(old, old_ws)
    ws = plan.zeroed_ws.get(stream) if plan.one_kernel else cp.cuda.alloc(plan.workspace)
    words, extra = patch(plan, ws)
    launch = driver.launchKernel

    def raw(kernel, argv_ptr):
        fn, grid, block, smem = kernel
        return lambda: launch(fn, grid, 1, 1, block, 1, 1, smem, stream, argv_ptr, 0)

    def api_like(entry):
        """The API's fast path (key, lookup, device check) running ``entry``."""
        key_of, cache, get_device = _api.bwd_key, _api._BWD_PLANS, cp.cuda.runtime.getDevice

        def call():
            cache.get(key_of(do, q, k, v, o, lse, None, False, False))
            if get_device() == entry.device_id:
                return entry(do, q, k, v, o, lse)
        return call
    layout = _fast.layout
    shapes, dt = fast.shapes, fast.dtype
    parts = {
        "bwd_old_two_launches": api_like(old_fast),
        "bwd_new_one_launch": api_like(fast),
        # the key: session 10's six nested layouts, and the one the API builds now (flat, a
        # C-contiguous array's strides as True: _fast.backward_key)
        "bwd_part_key": lambda: (layout(do), layout(q), layout(k), layout(v), layout(o),
                                 layout(lse), None, type(None), False, bool, False),
        "bwd_part_key_new": lambda: _api.bwd_key(do, q, k, v, o, lse, None, False, False),
        "bwd_part_get_device": cp.cuda.runtime.getDevice,
        "bwd_part_stream": lambda: cp.cuda.get_current_stream().ptr,
        "bwd_part_patch_and_launches_old": lambda: old.launch(stream, old_words, extra=old_extra),
        "bwd_part_patch_and_launch_new": lambda: plan.launch(stream, words, extra=extra),
        "bwd_part_launch_dot": raw(old.launch.kernels[0], old.launch.argv_ptr),
        "bwd_part_launch_main_old": raw(old.launch.kernels[-1], old.launch.argv_ptr),
        "bwd_part_launch_main_new": raw(plan.launch.kernels[-1], plan.launch.argv_ptr),
        "fwd_part_launch": raw(fwd.launch.kernels[0], fwd.launch.argv_ptr),
        "bwd_part_three_arrays": lambda: (cp.ndarray(shapes[0], dt, memptr=held),
                                          cp.ndarray(shapes[1], dt, memptr=held + ok),
                                          cp.ndarray(shapes[2], dt, memptr=held + ov)),
    }
    # ways to make one result array, to compare with the three above (the cost of one
    # ndarray on new memory read 1.6 us back to back but 3 us behind the spin in session 10)
    flat = cp.ndarray((fast.nbytes // dt.itemsize,), dt, memptr=held)
    n0 = math.prod(shapes[0])
    parts["bwd_part_one_array"] = lambda: cp.ndarray(shapes[0], dt, memptr=held)
    parts["bwd_part_one_view"] = lambda: flat[:n0].reshape(shapes[0])
    parts["bwd_part_one_empty"] = lambda: cp.empty(shapes[0], dt)
    parts["bwd_part_memptr_add"] = lambda: held + ok
    # a launch with an empty parameter block, raw: does the 1008-byte block cost launch time?
    empty = cp.RawKernel(r'extern "C" __global__ void cuflash_empty_raw() {}', "cuflash_empty_raw")
    empty((1,), (1,), ())
    none = numpy.zeros(1, numpy.uint64)
    parts["raw_launch_no_params"] = raw((empty.kernel.ptr, 1, 1, 0), none.ctypes.data)
    parts.update(cumulative_steps(q, k, v, do, o, lse, fast, fwd_fast))
    for name, p, entry in (("old", old, old_fast), ("new", plan, fast)):
        if p._one_launch:
            parts[f"bwd_part_run_{name}"] = (
                lambda p=p: p.run(stream, do.data.ptr, q.data.ptr, k.data.ptr, v.data.ptr,
                                  o.data.ptr, lse.data.ptr, base, base + ok, base + ov))
    # alive for the process: the launches use them
    _KEEP.append((o, lse, do, held, old_ws, ws, flat, empty, none, old_fast, fast))
    return parts


_KEEP: list = []


def cumulative_steps(q, k, v, do, o, lse, bwd, fwd) -> dict[str, Callable[[], Any]]:
    """The fast paths of ``attention`` and ``attention_backward`` copied step by step, each
    row one step longer than the last (``*_step1`` .. ``*_step4``; step 4 is the whole path):
    the difference between two rows is what a step costs where it runs, frees of the last
    call's objects included. Rows ``bwd_part_*`` time the pieces out of that context."""
    import cupy as cp
    from cuflash import _api
    layout = _api._layout
    fcache, bcache = _api._FWD_PLANS, _api._BWD_PLANS

    def fwd_step(n):
        def call(scale=None, causal=False):
            key = (layout(q), layout(k), layout(v), scale, scale.__class__, causal,
                   causal.__class__)
            fast = fcache.get(key)
            if cp.cuda.runtime.getDevice() != fast.device_id or n == 1:
                return None
            mem = cp.cuda.alloc(fast.nbytes)
            stream = cp.cuda.get_current_stream().ptr
            if n == 2:
                return mem
            fast.plan.run(stream, q.data.ptr, k.data.ptr, v.data.ptr, mem.ptr,
                          mem.ptr + fast.lse_offset)
            if n == 3:
                return mem
            return cp.ndarray(fast.o_shape, fast.dtype, memptr=mem)
        return call

    def bwd_step(n):
        def call(scale=None, causal=False, det=False):
            fast = bcache.get(_api.bwd_key(do, q, k, v, o, lse, scale, causal, det))
            if cp.cuda.runtime.getDevice() != fast.device_id or n == 1:
                return None
            mem = cp.cuda.alloc(fast.nbytes)
            stream = cp.cuda.get_current_stream().ptr
            if n == 2:
                return mem
            _, ok, ov = fast.offsets
            base = mem.ptr
            fast.plan.run(stream, do.data.ptr, q.data.ptr, k.data.ptr, v.data.ptr, o.data.ptr,
                          lse.data.ptr, base, base + ok, base + ov)
            if n == 3:
                return mem
            sq, sk, sv = fast.shapes
            return (cp.ndarray(sq, fast.dtype, memptr=mem),
                    cp.ndarray(sk, fast.dtype, memptr=mem + ok),
                    cp.ndarray(sv, fast.dtype, memptr=mem + ov))
        return call
    steps = {f"fwd_step{n}": fwd_step(n) for n in (1, 2, 3, 4)}
    if bwd.shared and bwd.plan._one_launch:
        steps.update({f"bwd_step{n}": bwd_step(n) for n in (1, 2, 3, 4)})
    return steps


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=2000, help="calls per timed loop")
    p.add_argument("--repeats", type=int, default=5, help="timed loops per implementation "
                   "(per round with --rounds)")
    p.add_argument("--rounds", type=int, default=1,
                   help="interleave the implementations' back-to-back loops in this many rounds, "
                        "the order rotated a round (measure_rounds); 1: each timed alone")
    p.add_argument("--out", type=pathlib.Path, default=None, metavar="DIR",
                   help="folder for host_overhead.json (default bench/results/<gpu>/)")
    p.add_argument("--spin-calls", type=int, default=200,
                   help="calls per loop behind the spin kernel (<= ~300: a backward is up to "
                        "3 launches and the launch queue holds ~1000)")
    p.add_argument("--no-json", action="store_true")
    p.add_argument("--profile", action="store_true", help="cProfile cuflash's forward and backward calls")
    p.add_argument("--clocks", action="store_true",
                   help="also read the SM clock in each loop (sm_mhz_in_loop, sm_mhz_behind_spin) "
                        "and time the loop beside a spin on a second stream "
                        "(us_per_call_beside_spin: the GPU kept busy, so clocked up)")
    p.add_argument("--parts", action="store_true",
                   help="also time the pieces of the backward's fast path (rows bwd_part_*)")
    args = p.parse_args(argv)
    try:
        import cupy as cp
        import ml_dtypes
        cp.cuda.runtime.getDeviceProperties(0)
    except Exception as e:
        print(f"error: host_overhead needs a CUDA GPU and CuPy: {ba.short_error(e)}",
              file=sys.stderr)
        return 2
    header = ba.device_header(["bench/host_overhead.py", *(argv or sys.argv[1:])])
    header.update(suite="host_overhead", shape=list(SHAPE), dtype="bf16", calls=args.calls,
                  **machine_state())
    if header["load_average_1min"] > QUIET_LOAD or header["other_gpu_processes"] > 0:
        print(f"WARNING: the machine is not quiet (1-min load average "
              f"{header['load_average_1min']:.1f}, {header['other_gpu_processes']} other GPU "
              f"processes): host times will read high", file=sys.stderr)
    rs = cp.random.RandomState(0)        # random normal inputs, never zeros
    q, k, v = (rs.standard_normal(SHAPE, dtype=cp.float32).astype(ml_dtypes.bfloat16)
               for _ in range(3))
    sync = cp.cuda.Device().synchronize
    rows = []
    fns = build(q, k, v)
    if args.parts:
        try:
            fns.update(backward_parts(q, k, v))
        except Exception as e:
            print(f"--parts: FAILED ({ba.short_error(e)})", file=sys.stderr)
    spin, event = spin_and_event(cp)
    clock_kernel = cp.RawKernel(CLOCK_SOURCE, "cuflash_clock")
    clock_buf = cp.zeros(2 * (args.calls // CLOCK_EVERY + 2), cp.int64)

    def sample(i: int) -> None:
        clock_kernel((1,), (1,), (clock_buf, cp.int32(i), cp.int64(CLOCK_NS)))

    def sampled(n: int) -> float:
        return clock_mhz(clock_buf[:2 * n].get().reshape(n, 2))
    side = cp.cuda.Stream(non_blocking=True)
    rounds, failed = ({}, {}) if args.rounds <= 1 else measure_rounds(
        fns, args.calls, args.repeats, args.rounds, sync)
    for impl, e in failed.items():
        print(f"{impl}: FAILED ({ba.short_error(e)})", file=sys.stderr)
    for impl, fn in fns.items():
        if impl in failed:
            continue
        try:
            row = rounds[impl] if rounds else measure(impl, fn, args.calls, args.repeats, sync)
            row = spin_row(row, args.spin_calls, *behind_spin(
                fn, args.spin_calls, args.repeats, spin, event, sync,
                lambda a, b: cp.cuda.get_elapsed_time(a, b) * 1e-3))
            if args.clocks:
                # the clock the calls ran at back to back, and behind the spin (sampled once
                # the spin's calls ran), then the loop again with a spin on a second stream
                # for its whole length (one thread: it keeps the GPU busy, not its SMs)
                issue = clocked_loop(fn, args.calls, sample, sync)
                mhz_loop = sampled(args.calls // CLOCK_EVERY)
                spin(200e-6 * args.spin_calls)
                for _ in range(args.spin_calls):
                    fn()
                sample(0)
                sync()
                mhz_spin = sampled(1)
                with side:
                    spin(2 * row["us_per_call"] * 1e-6 * args.calls + 0.05)
                t0 = time.perf_counter()
                for _ in range(args.calls):
                    fn()
                warm = (time.perf_counter() - t0) / args.calls * 1e6
                sync()
                row.update(us_per_call_clocked=issue / args.calls * 1e6, sm_mhz_in_loop=mhz_loop,
                           sm_mhz_behind_spin=mhz_spin, us_per_call_beside_spin=warm)
            rows.append(row)
        except Exception as e:
            print(f"{impl}: FAILED ({ba.short_error(e)})", file=sys.stderr)
    print(format_rows(rows))
    if any(r.get("queue_bound") for r in rows):
        print("QUEUE-BOUND rows: the GPU time of a call is >= 90% of the back-to-back figure, "
              "which is then the GPU's pace: report 'us/call behind spin' as their host time")
    if any(r["gpu_bound"] for r in rows):
        print(f"GPU-BOUND rows: draining the queue took > {GPU_BOUND_RATIO}x the issue time, "
              "so those figures are not host times")
    if not args.no_json:
        path = (args.out or ba.results_dir_for(header["gpu"])) / "host_overhead.json"
        write_json(path, header, rows)
        print(f"wrote {path}", file=sys.stderr)
    if args.profile:
        for impl in ("cuflash", "cuflash_backward"):
            print_profile(impl, fns[impl], sync)
    return 0


def print_profile(name: str, fn: Callable[[], Any], sync: Callable[[], None], calls: int = 300,
                  top: int = 25) -> None:
    """cProfile's ``top`` functions by own time over ``calls`` calls of ``fn``."""
    import cProfile
    import pstats
    print(f"== cProfile of {calls} calls: {name}")
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(calls):
        fn()
    pr.disable()
    sync()
    pstats.Stats(pr).sort_stats("tottime").print_stats(top)


if __name__ == "__main__":
    sys.exit(main())
