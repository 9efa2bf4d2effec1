#!/usr/bin/env python3
"""The attention benchmark harness: cuflash against its peers, in one process, on the same inputs.

    PYTHONPATH=. python bench/bench_attention.py --suite fwd [--isolated] [--plot]
    python bench/bench_attention.py --list                 # the suites
    python bench/bench_attention.py --load bench/results/h200/fwd.json   # no GPU needed

Suites (``SUITES``; ``--list``): ``fwd``, ``fwd_bwd``, ``fwd_fp32``, ``memory`` run here;
``decode``, ``varlen`` (issue 11) and ``mods`` (issue 10) are scripts of their own beside this
one (bench/suite_<name>.py: their peers and shapes do not fit this harness's grid), and
asking for them here says so; ``scaling`` (multi-GPU) is registered as planned and says so. A suite is a ``Suite`` record: its default shapes, its
peers and the function that runs it; adding one is adding a record.

What is measured (the method; bench/README.md says how to read the results):

* Shapes: B*L = 16k tokens, H*d = 2048, Lq = Lk = L, layout (B, H, L, d) contiguous.
* Implementations on the same CuPy arrays: ``cuflash``; ``cuflash_sm80`` (cuflash with
  ``CUFLASH_FWD=sm80 CUFLASH_BWD=sm80`` set around each call: the mma.sync kernels that every
  sm_80+ GPU other than Hopper runs); ``naive_cupy`` (matmul, float32 softmax, matmul; skipped
  when its float32 scores would pass 40 GB); where importable, PyTorch SDPA with one backend
  forced (``sdpa_flash``, ``sdpa_cudnn``, ``sdpa_efficient``) on DLPack views of the same
  memory, and ``jax_cudnn`` (``jax.nn.dot_product_attention(implementation="cudnn")`` on a
  (B, L, H, d) copy made once, outside the timing). What an implementation does not support
  becomes a skipped row with the reason.
* FLOPs by FlashAttention's convention: forward ``4*B*H*Lq*Lk*d``, halved when causal;
  ``fwd_bwd`` 3.5x forward. TFLOP/s = FLOPs / median time.
* Back-to-back rows (``isolated: false``): after one untimed call and a 3-call estimate, CUDA
  events on CuPy's current stream around each of >= 10 calls (about ``--budget`` seconds),
  median. PyTorch shares the legacy default stream with CuPy, so its kernels order with the
  events; JAX runs on streams of its own and is timed on the host around batches of calls
  that end in ``block_until_ready`` (>= 20 ms a batch), median of batch time / calls.
* Isolated rows (``--isolated``, ``isolated: true``): one call with the GPU idle before it:
  synchronise, sleep ``--idle-ms``, record a start event, make the call, record an end event,
  synchronise; the events bracket the host's work for the call too (the GPU reaches the start
  event at once, being idle, and the end event only after the call's kernels, which the host
  issues at the end of its work). Repeated ``--reps`` times, median. JAX: the same on the host
  clock, ending in ``block_until_ready``.
* Inputs: random normal, never zeros; when one set (q, k, v, o, and dO and the gradients for
  fwd_bwd) is smaller than twice the L2 cache, several sets are made and calls rotate over them.
* Memory suite: B=1, H=16, d=128, L 1k..128k; the peak device memory one forward call takes
  beyond its inputs and output (CuPy: a MemoryHook on a fresh pool; PyTorch:
  ``max_memory_allocated``; workspaces neither allocator sees are not counted,
  ``device_delta_bytes`` records the device-wide change beside it).

Output: a table (TFLOP/s per implementation, ``cuflash/sdpa_flash`` and ``cuflash/sdpa_cudnn``
ratio columns), and ``bench/results/<gpu>/<suite>[_isolated].json`` (``--out`` picks the
folder) with a header (GPU, driver, versions, command line, git commit); ``--plot`` writes a
PNG beside it (matplotlib, imported only then). Rows: ``impl, suite, mode, dtype, d, L,
causal, isolated, tflops, ms`` and ``B, H, flops, iters, input_sets, timing``.

The logic that needs no GPU (suites, cases, rotation, isolated timing with any clock, tables,
JSON) is tested on the CPU in tests/test_bench_harness.py. Nothing imports CuPy, PyTorch or
JAX at module import time. This harness calls only cuflash's public API (and the
``CUFLASH_FWD``/``CUFLASH_BWD`` environment variables the launcher honours); it reuses the
row format, FLOP count, table, JSON reader and plot of ``cuflash/_bench.py`` (the short
``python -m cuflash bench``), so either can ``--load`` the other's files.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as _dt
import math
import os
import pathlib
import re
import statistics
import subprocess
import sys
import time
import warnings
from typing import Any, Callable, Sequence

ROOT = pathlib.Path(__file__).resolve().parent.parent
if (ROOT / "cuflash" / "_bench.py").is_file() and str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))       # run from a checkout: this tree's cuflash

from cuflash._bench import (MODES, IMPL_ORDER, ResultFileError, attention_flops,  # noqa: E402
                            batch_heads, cuflash_version, format_table, make_row,
                            naive_attention, plot, read_json, version_of, write_json)

__all__ = ["main", "SUITES", "Suite", "Case"]

ALL_D = (64, 128, 256)
ALL_L = (1024, 4096, 16384)
ISOLATED_L = (512, 1024)
DTYPES = ("bf16", "fp16", "fp32")
IMPLS = IMPL_ORDER
MEMORY_L = (1024, 4096, 16384, 32768, 65536, 131072)
MEMORY_B, MEMORY_H, MEMORY_D = 1, 16, 128

NAIVE_LIMIT_BYTES = 40e9          # float32 L x L scores over all (B, H)
NAIVE_MEMORY_LIMIT_BYTES = 60e9   # the same, memory suite
L2_BYTES_DEFAULT = 60 * 2**20     # H200; read from the device when there is one
MAX_INPUT_SETS = 16
DEFAULT_BUDGET_S = 0.5
MIN_ITERS = 10
MAX_ITERS = 1000
JAX_MIN_BATCH_S = 0.02
ISOLATED_REPS = 100
ISOLATED_IDLE_MS = 2.0


# ---------------------------------------------------------------------------------------------
# Suites and cases (pure logic, tested on the CPU)
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Case:
    """One benchmark point; every implementation is timed on it."""
    suite: str
    mode: str
    dtype: str
    d: int
    L: int
    causal: bool
    B: int
    H: int
    isolated: bool = False

    @property
    def flops(self) -> int:
        return attention_flops(self.B, self.H, self.L, self.L, self.d, self.causal, self.mode)

    def row(self, impl: str, **kw) -> dict:
        return make_row(impl, self.suite, self.mode, self.dtype, self.d, self.L, self.causal,
                        self.B, self.H, isolated=self.isolated, **kw)


@dataclasses.dataclass(frozen=True)
class Suite:
    """A benchmark suite: its default points, its peers, and the function that runs it.

    ``run(suite, cases, impls, opts) -> rows``; ``planned`` (instead of ``run``) names the
    issue that will bring the suite, so asking for it says so instead of failing obscurely;
    ``script`` (instead of ``run``) names the script in bench/ that runs the suite with options
    of its own (its peers and shapes do not fit this harness's d x L x causal grid).
    """
    name: str
    description: str
    mode: str = "fwd"
    dtypes: tuple = ("bf16",)
    ds: tuple = ALL_D
    Ls: tuple = ALL_L
    causals: tuple = (False, True)
    impls: tuple = ()
    isolated_ok: bool = False
    run: Callable[..., list[dict]] | None = None
    planned: str | None = None
    script: str | None = None

    def cases(self, dtypes=None, ds=None, Ls=None, causals=None,
              isolated: bool = False) -> list[Case]:
        """The points in table order (dtype, d, L, causal); None takes the suite's default
        (under ``isolated``: L in ISOLATED_L)."""
        if isolated and not self.isolated_ok:
            raise ValueError(f"suite {self.name!r} has no isolated mode")
        dtypes = dtypes or self.dtypes
        ds = ds or self.ds
        Ls = Ls or (ISOLATED_L if isolated else self.Ls)
        causals = causals or self.causals
        if self.mode == "memory":
            return [Case(self.name, "memory", dt, MEMORY_D, L, c, MEMORY_B, MEMORY_H)
                    for dt in dtypes for L in Ls for c in causals]
        return [Case(self.name, self.mode, dt, d, L, c, *batch_heads(L, d), isolated=isolated)
                for dt in dtypes for d in ds for L in Ls for c in causals]


def _runner(name: str) -> Callable[..., list[dict]]:
    """Late binding, so the records can sit above the functions they name."""
    return lambda *a, **kw: globals()[name](*a, **kw)


_PEERS = ("cuflash", "naive_cupy", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "jax_cudnn")

SUITES: dict[str, Suite] = {s.name: s for s in (
    Suite("fwd", "forward, bf16 (fp16 by --dtype), d 64/128/256, L 1k/4k/16k, causal and not",
          impls=_PEERS, isolated_ok=True, run=_runner("run_perf")),
    Suite("fwd_bwd", "forward + backward (3.5x forward FLOPs), bf16, d 64/128, L 1k/4k/16k",
          mode="fwd_bwd", ds=(64, 128), impls=tuple(i for i in _PEERS if i != "naive_cupy"),
          isolated_ok=True, run=_runner("run_perf")),
    Suite("fwd_fp32", "float32 forward (the generic kernel) against naive CuPy",
          dtypes=("fp32",), ds=(64, 128), Ls=(1024, 4096), causals=(False,),
          impls=("cuflash", "naive_cupy"), run=_runner("run_perf")),
    Suite("memory", f"peak device memory of one forward beyond inputs and output, B={MEMORY_B}, "
          f"H={MEMORY_H}, d={MEMORY_D}, L 1k..128k", mode="memory", ds=(MEMORY_D,),
          Ls=MEMORY_L, causals=(False,), impls=("cuflash", "naive_cupy", "sdpa_flash",
                                                "sdpa_cudnn", "sdpa_efficient"),
          run=_runner("run_memory")),
    Suite("decode", "split-KV decode against SDPA flash/cuDNN, K/V TB/s", mode="decode",
          script="bench/suite_decode.py"),
    Suite("varlen", "packed variable-length prefill", mode="varlen",
          script="bench/suite_varlen.py"),
    Suite("mods", "modifiers against FlexAttention and SDPA with a dense bias", mode="mods",
          script="bench/suite_mods.py"),
    Suite("scaling", "ring attention across GPUs", mode="scaling",
          planned="the Distributed section of the design (ring attention)"),
)}


def get_suite(name: str) -> Suite:
    """The suite called ``name``; ValueError naming the choices for an unknown or a planned
    one."""
    suite = SUITES.get(name)
    ready = [s.name for s in SUITES.values() if s.run is not None]
    if suite is None:
        raise ValueError(f"unknown suite {name!r}; suites: {', '.join(ready)} "
                         f"(planned: {', '.join(s for s in SUITES if s not in ready)})")
    if suite.script is not None:
        raise ValueError(f"suite {name!r} runs as a script of its own, with its own options: "
                         f"python {suite.script} --help")
    if suite.run is None:
        raise ValueError(f"suite {name!r} is not implemented yet: it comes with {suite.planned}")
    return suite


def naive_fits(B: int, H: int, Lq: int, Lk: int, limit: float = NAIVE_LIMIT_BYTES) -> bool:
    """Whether naive CuPy's float32 score matrix fits under ``limit`` bytes."""
    return 4 * B * H * Lq * Lk <= limit


def n_input_sets(set_bytes: int, l2_bytes: int = L2_BYTES_DEFAULT,
                 cap: int = MAX_INPUT_SETS) -> int:
    """Input sets to rotate so no call finds its inputs in L2: together >= twice the L2."""
    if set_bytes <= 0:
        raise ValueError(f"{set_bytes=} must be positive")
    if set_bytes >= 2 * l2_bytes:
        return 1
    return min(cap, math.ceil(2 * l2_bytes / set_bytes))


def n_iters(est_s: float, budget_s: float = DEFAULT_BUDGET_S,
            lo: int = MIN_ITERS, hi: int = MAX_ITERS) -> int:
    """Timed calls for one point: about ``budget_s`` in all, at least ``lo``, at most ``hi``."""
    if est_s <= 0:
        return hi
    return max(lo, min(hi, int(budget_s / est_s)))


def results_dir_for(gpu_name: str) -> pathlib.Path:
    """``bench/results/<gpu>``: the model token of the name, lower case ("NVIDIA H200" ->
    "h200")."""
    words = [w for w in re.split(r"[^A-Za-z0-9]+", gpu_name)
             if w and w.lower() not in ("nvidia", "geforce", "tesla", "rtx", "quadro")]
    return ROOT / "bench" / "results" / (words[0].lower() if words else "unknown-gpu")


def result_name(suite: str, isolated: bool) -> str:
    return f"{suite}_isolated.json" if isolated else f"{suite}.json"


def render_table(header: list[str], body: list[list[str]]) -> str:
    widths = [max([len(h)] + [len(r[i]) for r in body]) for i, h in enumerate(header)]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths))
                     for r in [header, ["-" * w for w in widths], *body])


def format_memory_table(rows: Sequence[dict]) -> str:
    """Peak extra device memory (MiB) per L, one column per implementation."""
    rows = [r for r in rows if r.get("mode") == "memory"]
    impls = [i for i in IMPLS if any(r["impl"] == i for r in rows)]
    cells: dict[tuple, dict[str, Any]] = {}
    for r in rows:
        key = (r["dtype"], r["B"], r["H"], r["d"], r["L"], r["causal"])
        cells.setdefault(key, {})[r["impl"]] = r.get("peak_extra_bytes")
    body = []
    for (dtype, B, H, d, L, causal), by_impl in cells.items():
        line = [dtype, str(B), str(H), str(d), str(L), "yes" if causal else "no"]
        line += ["-" if by_impl.get(i) is None else f"{by_impl[i] / 2**20:.1f}" for i in impls]
        body.append(line)
    return render_table(["dtype", "B", "H", "d", "L", "causal"] + [f"{i} MiB" for i in impls], body)


def format_skips(rows: Sequence[dict]) -> str:
    """One line per (implementation, reason), with how many rows it covers."""
    counts: dict[tuple[str, str], int] = {}
    for r in rows:
        if r.get("skipped"):
            k = (r["impl"], r["skipped"])
            counts[k] = counts.get(k, 0) + 1
    return "\n".join(f"  {i}: {why} ({n} row{'s' if n > 1 else ''})"
                     for (i, why), n in counts.items())


def report(header: dict, rows: Sequence[dict]) -> str:
    """Everything printed for a run or a loaded file: skips, memory table, TFLOP/s table."""
    out = []
    if header.get("converted_from"):
        out.append(f"(converted from {header['converted_from']})")
    skips = format_skips(rows)
    if skips:
        out += ["Skipped:", skips, ""]
    if any(r.get("mode") == "memory" for r in rows):
        out += ["Peak device memory beyond inputs and output (MiB):", format_memory_table(rows),
                ""]
    if any(r.get("mode") in MODES for r in rows):
        how = ("one isolated call, host time included" if any(r.get("isolated") for r in rows)
               else "back-to-back calls")
        out += [f"TFLOP/s on {header.get('gpu', '?')} (FLOPs: fwd 4*B*H*L*L*d, /2 causal; "
                f"fwd_bwd 3.5x fwd; {how}):", format_table(rows)]
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------
# Timing (the clock is a parameter, so the isolated logic is tested with a fake one)
# ---------------------------------------------------------------------------------------------

class EventClock:
    """CUDA events on CuPy's current stream; ``stop`` waits for the end event."""

    def __init__(self):
        import cupy as cp
        self.cp = cp

    def sync(self) -> None:
        self.cp.cuda.Device().synchronize()

    def start(self):
        ev = self.cp.cuda.Event()
        ev.record()
        return ev

    def stop(self, start, result) -> float:
        end = self.cp.cuda.Event()
        end.record()
        end.synchronize()
        return self.cp.cuda.get_elapsed_time(start, end)


class HostClock:
    """perf_counter around a call whose result ``block`` waits for (JAX, or PyTorch on a
    stream other than CuPy's)."""

    def __init__(self, block: Callable[[Any], None], sync: Callable[[], None]):
        self.block, self.sync = block, sync

    def start(self):
        return time.perf_counter()

    def stop(self, start, result) -> float:
        self.block(result)
        return (time.perf_counter() - start) * 1e3


def time_isolated(fn: Callable[[int], Any], n_sets: int, reps: int, clock,
                  idle_s: float = ISOLATED_IDLE_MS / 1e3,
                  sleep: Callable[[float], None] = time.sleep) -> list[float]:
    """Milliseconds of ``reps`` single calls, each after the GPU went idle: synchronise,
    sleep ``idle_s``, start the clock, call, stop the clock (which waits for the call's
    work). The host's time in the call lies inside each measurement."""
    if reps < 1:
        raise ValueError(f"{reps=} must be >= 1")
    out = []
    for i in range(reps):
        clock.sync()
        sleep(idle_s)
        t = clock.start()
        r = fn(i % n_sets)
        out.append(clock.stop(t, r))
        del r
    return out


def time_back_to_back(fn: Callable[[int], Any], n_sets: int, iters: int) -> list[float]:
    """Per-call milliseconds from CUDA events around each of ``iters`` queued calls."""
    import cupy as cp
    cp.cuda.Device().synchronize()
    ev = [(cp.cuda.Event(), cp.cuda.Event()) for _ in range(iters)]
    for it, (a, b) in enumerate(ev):
        a.record()
        fn(it % n_sets)
        b.record()
    ev[-1][1].synchronize()
    return [cp.cuda.get_elapsed_time(a, b) for a, b in ev]


def time_host_batches(fn: Callable[[int], Any], n_sets: int, batches: int, per_batch: int,
                      block: Callable[[Any], None], sync: Callable[[], None]) -> list[float]:
    """Per-call milliseconds from perf_counter around batches of calls."""
    sync()
    out, it = [], 0
    for _ in range(batches):
        t0 = time.perf_counter()
        r = None
        for _ in range(per_batch):
            r = fn(it % n_sets)
            it += 1
        block(r)
        out.append((time.perf_counter() - t0) * 1e3 / per_batch)
    return out


# ---------------------------------------------------------------------------------------------
# Implementations (GPU side)
# ---------------------------------------------------------------------------------------------

class Skip(Exception):
    """This implementation does not run this case; the message says why."""


def short_error(exc: BaseException, caught: Sequence[warnings.WarningMessage] = ()) -> str:
    """``Type: first line``, plus PyTorch's first real explanation from its warnings (it
    explains "No available kernel" there, after headers ending in ':')."""
    text = str(exc).strip()
    msg = f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"
    for w in caught:
        t = re.sub(r"\s*\(Triggered internally at [^)]*\)\.?", "", str(w.message)).strip()
        t = t.splitlines()[0].strip() if t else ""
        if t and not t.endswith(":") and "runtime disabled" not in t:
            msg += f" [{t}]"
            break
    return msg[:300]


def np_dtype(name: str):
    import numpy as np
    if name == "bf16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype({"fp16": np.float16, "fp32": np.float32}[name])


@dataclasses.dataclass
class InputSet:
    q: Any
    k: Any
    v: Any
    do: Any
    cache: dict = dataclasses.field(default_factory=dict)   # per-impl converted views


def make_inputs(cp, shape: tuple, dtype_name: str, n_sets: int, with_grad: bool,
                seed: int) -> list[InputSet]:
    """``n_sets`` independent random normal sets (never zeros: zeros make every kernel
    take its fastest path and the softmax trivial)."""
    dt = np_dtype(dtype_name)
    rs = cp.random.RandomState(seed)
    sets = []
    for _ in range(n_sets):
        q, k, v = (rs.standard_normal(shape, dtype=cp.float32).astype(dt) for _ in range(3))
        do = rs.standard_normal(shape, dtype=cp.float32).astype(dt) if with_grad else None
        sets.append(InputSet(q, k, v, do))
    return sets


@contextlib.contextmanager
def env(**values: str | None):
    """Set environment variables for the block (None: unset one), restoring the old values
    after. cuflash reads its CUFLASH_* overrides when it builds a plan and caches plans, so its
    plan cache is cleared on the way in and out (a private hook: this is lab code)."""
    old = {k: os.environ.get(k) for k in values}
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    _clear_cuflash_plans()
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        _clear_cuflash_plans()


def _clear_cuflash_plans() -> None:
    from cuflash import _api
    _api.clear_plans()


class Impl:
    """An implementation under test. ``prepare`` returns ``fn(i)`` running one call on input
    set ``i`` (or raises Skip); ``timing``: "events" or "host"."""
    name = ""
    timing = "events"

    def available(self) -> str | None:
        """None when it can run here, else why not."""
        return None

    def prepare(self, case: Case, sets: list[InputSet], scale: float) -> Callable[[int], Any]:
        raise NotImplementedError

    def block(self, result) -> None:
        self.sync()

    def sync(self) -> None:
        import cupy as cp
        cp.cuda.Device().synchronize()

    def release(self) -> None:
        import cupy as cp
        cp.get_default_memory_pool().free_all_blocks()


class CuflashImpl(Impl):
    name = "cuflash"
    env: dict = {}

    def available(self):
        try:
            import cuflash  # noqa: F401
        except Exception as e:
            return short_error(e)
        return None

    def prepare(self, case, sets, scale):
        import cuflash
        causal = case.causal
        if case.mode == "fwd":
            def call(s):
                return cuflash.attention(s.q, s.k, s.v, scale=scale, causal=causal)
        else:
            def call(s):
                o, lse = cuflash.attention(s.q, s.k, s.v, scale=scale, causal=causal,
                                           return_lse=True)
                return cuflash.attention_backward(s.do, s.q, s.k, s.v, o, lse, scale=scale,
                                                  causal=causal)
        if not self.env:
            return lambda i: call(sets[i])

        def fn(i):
            with env(**self.env):
                return call(sets[i])
        return fn


class CuflashSm80Impl(CuflashImpl):
    """cuflash kept on the mma.sync kernels (fwd_sm80, bwd_sm80) where it would pick the
    Hopper ones, through the CUFLASH_FWD / CUFLASH_BWD overrides. They are read when a plan is
    built, so ``env`` clears the plan cache around each call: this column pays the full host
    path every call (compiled kernels stay cached). Compare it back-to-back at L >= 1k only."""
    name = "cuflash_sm80"
    env = {"CUFLASH_FWD": "sm80", "CUFLASH_BWD": "sm80"}


class NaiveCupyImpl(Impl):
    """matmul, softmax in float32, matmul: what a CuPy user writes today."""
    name = "naive_cupy"

    def __init__(self, limit: float = NAIVE_LIMIT_BYTES):
        self.limit = limit

    def prepare(self, case, sets, scale):
        import cupy as cp
        if case.mode != "fwd":
            raise Skip("no backward")
        if not naive_fits(case.B, case.H, case.L, case.L, self.limit):
            gb = 4 * case.B * case.H * case.L * case.L / 1e9
            raise Skip(f"float32 scores would take {gb:.0f} GB > {self.limit / 1e9:.0f} GB")
        # made once, outside the timing: 0 where visible, -inf above the diagonal
        bias = (cp.triu(cp.full((case.L, case.L), -cp.inf, dtype=cp.float32), k=1)
                if case.causal else None)
        return lambda i: naive_attention(cp, sets[i].q, sets[i].k, sets[i].v, scale, bias)


class SdpaImpl(Impl):
    """torch.nn.functional.scaled_dot_product_attention with one backend forced."""
    BACKENDS = {"sdpa_flash": "FLASH_ATTENTION", "sdpa_cudnn": "CUDNN_ATTENTION",
                "sdpa_efficient": "EFFICIENT_ATTENTION"}

    def __init__(self, name: str):
        self.name = name

    def available(self):
        try:
            import torch
            from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: F401
        except Exception as e:
            return short_error(e)
        if not torch.cuda.is_available():
            return "torch.cuda.is_available() is False"
        if not hasattr(SDPBackend, self.BACKENDS[self.name]):
            return f"this torch has no SDPBackend.{self.BACKENDS[self.name]}"
        import cupy as cp
        same = (cp.cuda.get_current_stream().ptr == 0
                and torch.cuda.current_stream().cuda_stream == 0)
        self.timing = "events" if same else "host"
        return None

    @staticmethod
    def _tensors(s: InputSet, grad: bool):
        import torch
        key = ("torch", grad)
        if key not in s.cache:            # zero copy: the tensors alias the CuPy arrays
            ts = [torch.from_dlpack(a) for a in (s.q, s.k, s.v)]
            if grad:
                ts = [t.requires_grad_(True) for t in ts]
            s.cache[key] = (*ts, torch.from_dlpack(s.do) if s.do is not None else None)
        return s.cache[key]

    def prepare(self, case, sets, scale):
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
        sdpa = torch.nn.functional.scaled_dot_product_attention
        backend = getattr(SDPBackend, self.BACKENDS[self.name])
        causal = case.causal
        if case.mode == "fwd":
            tensors = [self._tensors(s, False) for s in sets]   # outside the timing

            def fn(i):
                q, k, v, _ = tensors[i]
                with torch.no_grad(), sdpa_kernel(backend):
                    return sdpa(q, k, v, is_causal=causal, scale=scale)
            return fn
        tensors = [self._tensors(s, True) for s in sets]

        def fn(i):
            q, k, v, do = tensors[i]
            with sdpa_kernel(backend):
                o = sdpa(q, k, v, is_causal=causal, scale=scale)
            return torch.autograd.grad(o, (q, k, v), do)
        return fn

    def sync(self):
        import torch
        torch.cuda.synchronize()

    def release(self):
        import torch
        torch.cuda.empty_cache()


class JaxCudnnImpl(Impl):
    name = "jax_cudnn"
    timing = "host"

    def available(self):
        # JAX would otherwise take 75% of the device at import and starve the others.
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
        try:
            import jax
            if not any(dev.platform == "gpu" for dev in jax.devices()):
                return "JAX sees no GPU"
        except Exception as e:
            return short_error(e)
        return None

    @staticmethod
    def _from_cupy(a):
        import jax.dlpack
        try:
            return jax.dlpack.from_dlpack(a)
        except TypeError:                      # an older JAX wants a capsule
            return jax.dlpack.from_dlpack(a.toDlpack())

    @staticmethod
    def _arrays(s: InputSet):
        import cupy as cp
        if "jax" not in s.cache:
            # JAX's layout is (B, L, H, d): one transposed copy per set, outside the timing.
            blhd = [cp.ascontiguousarray(a.transpose(0, 2, 1, 3)) if a is not None else None
                    for a in (s.q, s.k, s.v, s.do)]
            cp.cuda.Device().synchronize()
            s.cache["jax_cupy"] = blhd         # keeps the memory alive under the JAX arrays
            s.cache["jax"] = [JaxCudnnImpl._from_cupy(a) if a is not None else None
                              for a in blhd]
        return s.cache["jax"]

    def prepare(self, case, sets, scale):
        import functools
        import jax
        attn = functools.partial(jax.nn.dot_product_attention, scale=scale,
                                 is_causal=case.causal, implementation="cudnn")
        arrays = [self._arrays(s) for s in sets]
        if case.mode == "fwd":
            f = jax.jit(attn)
            return lambda i: f(*arrays[i][:3])

        def fwd_bwd(q, k, v, do):
            _, pullback = jax.vjp(attn, q, k, v)
            return pullback(do)
        g = jax.jit(fwd_bwd)
        return lambda i: g(*arrays[i])

    def block(self, result):
        import jax
        jax.block_until_ready(result)

    def release(self):
        import gc
        gc.collect()
        super().release()


def make_impls(names: Sequence[str], memory: bool = False) -> list[Impl]:
    table: dict[str, Callable[[], Impl]] = {
        "cuflash": CuflashImpl, "cuflash_sm80": CuflashSm80Impl,
        "naive_cupy": lambda: NaiveCupyImpl(NAIVE_MEMORY_LIMIT_BYTES if memory
                                            else NAIVE_LIMIT_BYTES),
        "sdpa_flash": lambda: SdpaImpl("sdpa_flash"), "sdpa_cudnn": lambda: SdpaImpl("sdpa_cudnn"),
        "sdpa_efficient": lambda: SdpaImpl("sdpa_efficient"), "jax_cudnn": JaxCudnnImpl}
    return [table[n]() for n in names]


# ---------------------------------------------------------------------------------------------
# Running suites
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Options:
    budget_s: float = DEFAULT_BUDGET_S
    seed: int = 0
    l2_bytes: int = L2_BYTES_DEFAULT
    reps: int = ISOLATED_REPS
    idle_ms: float = ISOLATED_IDLE_MS
    deadline: float = math.inf          # time.monotonic() after which points are skipped


def progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _first_call(impl: Impl, case: Case, sets: list[InputSet], scale: float):
    """prepare + one untimed call (compilation, autotuning, plan caches); any failure
    becomes Skip with the reason."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            fn = impl.prepare(case, sets, scale)
            impl.block(fn(0))
        except Skip:
            raise
        except Exception as e:   # unsupported dtype/shape, out of memory, ...
            raise Skip(short_error(e, caught)) from None
    return fn


def measure(impl: Impl, fn: Callable[[int], Any], n_sets: int, case: Case,
            opts: Options) -> tuple[float, int]:
    """Median milliseconds per call, and how many calls were timed."""
    if case.isolated:
        clock = EventClock() if impl.timing == "events" else HostClock(impl.block, impl.sync)
        ms = time_isolated(fn, n_sets, opts.reps, clock, opts.idle_ms / 1e3)
        return statistics.median(ms), opts.reps
    impl.sync()
    t0 = time.perf_counter()
    r = None
    for i in range(3):                   # untimed estimate
        r = fn(i % n_sets)
    impl.block(r)
    est = (time.perf_counter() - t0) / 3
    del r
    if impl.timing == "events":
        iters = n_iters(est, opts.budget_s)
        return statistics.median(time_back_to_back(fn, n_sets, iters)), iters
    per_batch = max(1, math.ceil(JAX_MIN_BATCH_S / max(est, 1e-9)))
    batches = n_iters(est * per_batch, opts.budget_s, hi=200)
    ms = time_host_batches(fn, n_sets, batches, per_batch, impl.block, impl.sync)
    return statistics.median(ms), batches * per_batch


def run_perf(suite: Suite, cases: list[Case], impls: list[Impl], opts: Options) -> list[dict]:
    """Time every implementation on every case (back-to-back or isolated per the case)."""
    import cupy as cp
    rows = []
    unavailable = {i.name: i.available() for i in impls}
    for name, why in unavailable.items():
        if why:
            progress(f"{name}: not available ({why})")
    for case in cases:
        if time.monotonic() > opts.deadline:
            rows += [case.row(i.name, skipped="time budget (--max-seconds) spent")
                     for i in impls]
            continue
        dt = np_dtype(case.dtype)
        shape = (case.B, case.H, case.L, case.d)
        grad = case.mode == "fwd_bwd"
        set_bytes = 4 * math.prod(shape) * dt.itemsize * (2 if grad else 1)
        n_sets = n_input_sets(set_bytes, opts.l2_bytes)
        sets = make_inputs(cp, shape, case.dtype, n_sets, grad, opts.seed)
        scale = 1.0 / math.sqrt(case.d)
        for impl in impls:
            label = (f"{case.mode}{'/iso' if case.isolated else ''} {case.dtype} d={case.d} "
                     f"L={case.L} B={case.B} H={case.H} causal={case.causal} {impl.name}")
            if unavailable[impl.name]:
                rows.append(case.row(impl.name,
                                     skipped=f"not available: {unavailable[impl.name]}"))
                continue
            fn = None
            try:
                fn = _first_call(impl, case, sets, scale)
                ms, iters = measure(impl, fn, n_sets, case, opts)
            except Skip as e:
                rows.append(case.row(impl.name, skipped=str(e)))
                progress(f"{label}: skipped ({e})")
            except Exception as e:     # a failure while timing: report, do not stop the run
                rows.append(case.row(impl.name, skipped=f"failed: {short_error(e)}"))
                progress(f"{label}: FAILED ({short_error(e)})")
            else:
                rows.append(case.row(impl.name, ms=ms, iters=iters, input_sets=n_sets,
                                     timing=impl.timing))
                progress(f"{label}: {ms:.3f} ms  {rows[-1]['tflops']:.1f} TFLOP/s  "
                         f"({iters} calls, {n_sets} input set{'s' if n_sets > 1 else ''})")
            finally:
                fn = None
                for s in sets:
                    s.cache.clear()
                impl.release()
        del sets
        cp.get_default_memory_pool().free_all_blocks()
    return rows


def _peak_hook():
    """A CuPy MemoryHook counting live bytes handed out since it was entered, and the peak."""
    import cupy as cp

    class Hook(cp.cuda.MemoryHook):
        name = "cuflash_bench_peak"

        def __init__(self):
            self.live = 0
            self.peak = 0

        def malloc_postprocess(self, **kw):
            if kw.get("mem_ptr"):
                self.live += kw["mem_size"]
                self.peak = max(self.peak, self.live)

        def free_postprocess(self, **kw):
            self.live -= kw["mem_size"]
    return Hook()


def memory_cupy(fn: Callable[[], Any], pool) -> dict:
    """Peak CuPy bytes of one call beyond its output (after a warm-up call)."""
    import cupy as cp
    out = fn()
    out_bytes = out.nbytes
    del out
    cp.cuda.Device().synchronize()
    pool_before = pool.total_bytes()
    free_before = cp.cuda.runtime.memGetInfo()[0]
    hook = _peak_hook()
    with hook:
        out = fn()
        cp.cuda.Device().synchronize()
    free_after = cp.cuda.runtime.memGetInfo()[0]
    rounded_out = -(-out.nbytes // 512) * 512     # the pool rounds to 512 B
    return {"peak_extra_bytes": max(0, hook.peak - rounded_out), "output_bytes": out_bytes,
            "device_delta_bytes": free_before - free_after,
            "pool_growth_bytes": pool.total_bytes() - pool_before}


def memory_torch(fn: Callable[[], Any]) -> dict:
    """Peak PyTorch bytes of one call beyond its output (after a warm-up call)."""
    import cupy as cp
    import torch
    out = fn()
    out_bytes = out.numel() * out.element_size()
    del out
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    free_before = cp.cuda.runtime.memGetInfo()[0]
    out = fn()
    torch.cuda.synchronize()
    free_after = cp.cuda.runtime.memGetInfo()[0]
    peak = torch.cuda.max_memory_allocated() - base
    return {"peak_extra_bytes": max(0, peak - out_bytes), "output_bytes": out_bytes,
            "device_delta_bytes": free_before - free_after}


def run_memory(suite: Suite, cases: list[Case], impls: list[Impl], opts: Options) -> list[dict]:
    """One forward call per (case, implementation), on a fresh CuPy pool; JAX allocates
    through its own allocator, which neither count sees, so it is skipped."""
    import cupy as cp
    rows = []
    unavailable = {i.name: ("its allocations are not counted (CuPy and PyTorch only)"
                            if i.name.startswith("jax") else i.available()) for i in impls}
    for case in cases:
        shape = (case.B, case.H, case.L, case.d)
        scale = 1.0 / math.sqrt(case.d)
        for impl in impls:
            label = f"memory {case.dtype} L={case.L} causal={case.causal} {impl.name}"
            if unavailable[impl.name]:
                rows.append(case.row(impl.name,
                                     skipped=f"not available: {unavailable[impl.name]}"))
                continue
            pool = cp.cuda.MemoryPool()          # fresh pool: nothing cached from before
            cp.cuda.set_allocator(pool.malloc)
            fn = sets = None
            try:
                sets = make_inputs(cp, shape, case.dtype, 1, False, opts.seed)
                fn = impl.prepare(dataclasses.replace(case, mode="fwd"), sets, scale)
                res = (memory_torch(lambda: fn(0)) if isinstance(impl, SdpaImpl)
                       else memory_cupy(lambda: fn(0), pool))
            except Skip as e:
                rows.append(case.row(impl.name, skipped=str(e)))
                progress(f"{label}: skipped ({e})")
            except Exception as e:
                rows.append(case.row(impl.name, skipped=f"failed: {short_error(e)}"))
                progress(f"{label}: FAILED ({short_error(e)})")
            else:
                rows.append(case.row(impl.name, **res))
                progress(f"{label}: peak extra {res['peak_extra_bytes'] / 2**20:.1f} MiB")
            finally:
                fn = sets = None
                impl.release()
                cp.cuda.set_allocator(cp.get_default_memory_pool().malloc)
                pool.free_all_blocks()
    return rows


def git_describe() -> str | None:
    """Commit of the checkout, "+dirty" when tracked files differ (None outside git)."""
    try:
        sha = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT,
                             capture_output=True, text=True, timeout=10)
        if sha.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=ROOT, capture_output=True, text=True, timeout=10)
        return sha.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def device_header(argv: Sequence[str]) -> dict:
    """GPU, driver and library versions, git commit, date and command line of this run."""
    import cupy as cp
    import numpy as np
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    name = props["name"]
    name = name.decode() if isinstance(name, bytes) else str(name)

    def cuda_ver(v: int) -> str:
        return f"{v // 1000}.{v % 1000 // 10}"
    try:
        nvrtc = ".".join(map(str, cp.cuda.nvrtc.getVersion()))
    except Exception:
        nvrtc = None
    return {
        "gpu": name, "compute_capability": f"{props['major']}.{props['minor']}",
        "sm_count": props["multiProcessorCount"], "l2_bytes": props.get("l2CacheSize"),
        "driver": cuda_ver(cp.cuda.runtime.driverGetVersion()),
        "cuda_runtime": cuda_ver(cp.cuda.runtime.runtimeGetVersion()), "nvrtc": nvrtc,
        "cupy": cp.__version__, "numpy": np.__version__, "torch": version_of("torch"),
        "jax": version_of("jax"), "jaxlib": version_of("jaxlib"), "cuflash": cuflash_version(),
        "git": git_describe(), "python": sys.version.split()[0],
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": " ".join(argv)}


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------

def _list_arg(conv: Callable[[str], Any], allowed: Sequence | None = None):
    def parse(text: str) -> list:
        out = []
        for t in (t.strip() for t in text.split(",")):
            if not t:
                continue
            try:
                v = conv(t)
            except (ValueError, KeyError):
                raise argparse.ArgumentTypeError(f"bad item {t!r} in {text!r}") from None
            if allowed is not None and v not in allowed:
                raise argparse.ArgumentTypeError(
                    f"{t!r} not one of {', '.join(map(str, allowed))}")
            out.append(v)
        if not out:
            raise argparse.ArgumentTypeError(f"empty list: {text!r}")
        return out
    return parse


_BOOLS = {"1": True, "true": True, "yes": True, "causal": True,
          "0": False, "false": False, "no": False, "noncausal": False}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bench/bench_attention.py",
        description="Time cuflash against its peers in one process on the same inputs. "
                    "The method is in this file's docstring; bench/README.md says what to run.")
    p.add_argument("--suite", default="fwd", help="suite to run (--list shows them)")
    p.add_argument("--list", action="store_true", help="list the suites and exit")
    p.add_argument("--isolated", action="store_true",
                   help="time single calls with the GPU idle before each (host time included)")
    p.add_argument("--dtype", type=_list_arg(str, DTYPES), help="comma list of bf16,fp16,fp32")
    p.add_argument("--d", type=_list_arg(int, ALL_D), help="comma list of head dims")
    p.add_argument("--L", type=_list_arg(int), help="comma list of sequence lengths")
    p.add_argument("--causal", type=_list_arg(lambda s: _BOOLS[s.lower()]),
                   help="comma list of false,true")
    p.add_argument("--impl", type=_list_arg(str, IMPLS),
                   help=f"comma list from {','.join(IMPLS)} (default: the suite's peers)")
    p.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S,
                   help="seconds of timed calls per point (back-to-back)")
    p.add_argument("--reps", type=int, default=ISOLATED_REPS, help="isolated calls per point")
    p.add_argument("--idle-ms", type=float, default=ISOLATED_IDLE_MS,
                   help="idle gap before each isolated call")
    p.add_argument("--max-seconds", type=float, default=None,
                   help="skip the points left after this many seconds (rows say so)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=pathlib.Path, default=None, metavar="DIR",
                   help="folder for <suite>[_isolated].json (default bench/results/<gpu>/)")
    p.add_argument("--json", type=pathlib.Path, default=None, help="exact JSON path instead")
    p.add_argument("--no-json", action="store_true", help="write no JSON")
    p.add_argument("--plot", action="store_true", help="write a PNG beside the JSON")
    p.add_argument("--load", type=pathlib.Path, metavar="JSON",
                   help="print a saved results file (and --plot it beside); needs no GPU")
    return p


def list_suites() -> str:
    return "\n".join(f"{s.name:9s} {s.description}"
                     + ("" if s.run else f" [script: {s.script}]" if s.script else f" [planned: {s.planned}]")
                     + (" [--isolated]" if s.isolated_ok else "") for s in SUITES.values())


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.list:
        print(list_suites())
        return 0
    if args.load is not None:
        try:
            header, rows = read_json(args.load)
        except ResultFileError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(report(header, rows))
        if args.plot:
            plot(rows, args.load.with_suffix(".png"), str(header.get("gpu", "")))
        return 0
    try:
        suite = get_suite(args.suite)
        cases = suite.cases(args.dtype, args.d, args.L, args.causal, args.isolated)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        import cupy as cp
        if cp.cuda.runtime.getDeviceCount() == 0:
            raise RuntimeError("no CUDA device")
    except Exception as e:
        print(f"error: the benchmark needs a CUDA GPU and CuPy: {short_error(e)}",
              file=sys.stderr)
        return 2
    header = device_header(["bench/bench_attention.py", *argv])
    header.update(suite=suite.name, isolated=args.isolated, budget_s=args.budget,
                  **({"reps": args.reps, "idle_ms": args.idle_ms} if args.isolated else {}))
    opts = Options(budget_s=args.budget, seed=args.seed,
                   l2_bytes=header.get("l2_bytes") or L2_BYTES_DEFAULT, reps=args.reps,
                   idle_ms=args.idle_ms,
                   deadline=time.monotonic() + (args.max_seconds or math.inf))
    impls = make_impls(args.impl or suite.impls, memory=suite.mode == "memory")
    rows = suite.run(suite, cases, impls, opts)
    path = None
    if not args.no_json:
        path = args.json or ((args.out or results_dir_for(header["gpu"]))
                             / result_name(suite.name, args.isolated))
        write_json(path, header, rows)
        progress(f"wrote {path}")
    print()
    print(report(header, rows))
    if args.plot and path is not None and suite.mode in MODES:
        if plot(rows, path.with_suffix(".png"), f"{header['gpu']} {suite.name}"):
            progress(f"wrote {path.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
