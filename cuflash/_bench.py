"""Attention benchmark: cuflash side by side with its peers, in one process, on the same inputs.

Run it as ``python -m cuflash bench [options]`` or ``python bench/bench_attention.py [options]``.

What is measured (DESIGN.md, "Benchmarks"):

* Shapes: batch x seqlen = 16k tokens (``B = 16384 // L``), heads x head dim = 2048
  (``H = 2048 // d``), ``L`` in {1024, 4096, 16384}, ``d`` in {64, 128, 256}, causal or not,
  Lq = Lk = L, layout (B, H, L, d) contiguous.
* Implementations, all on the same CuPy arrays (see ``naive_attention`` for bfloat16 in CuPy):
  ``cuflash``; ``naive_cupy`` (matmul, softmax in float32, matmul -- what a CuPy user writes
  today; skipped when its float32 L x L buffer would exceed 40 GB); where importable, PyTorch
  SDPA with one backend forced (``sdpa_flash``, ``sdpa_cudnn``, ``sdpa_efficient``) on tensors
  that share the CuPy memory through DLPack, and ``jax_cudnn``
  (``jax.nn.dot_product_attention(implementation="cudnn")``; JAX wants (B, L, H, d), so a
  transposed copy is made once, outside the timing, and handed over through DLPack).
  A combination an implementation does not support becomes a skipped row with the reason.
* FLOPs by FlashAttention's convention: forward ``4*B*H*Lq*Lk*d``, halved when causal;
  ``fwd_bwd`` counts 3.5x forward (backward = 2.5x forward). TFLOP/s = FLOPs / median time.

Timing:

* cuflash, naive_cupy and PyTorch: CUDA events recorded on CuPy's current stream around every
  call, after a device synchronisation; the median over the calls is reported. PyTorch runs on
  its current stream; both libraries' default stream is the legacy default stream, so the
  events order correctly with PyTorch's kernels. (If either library was switched to another
  stream, PyTorch falls back to the host timing below.)
* JAX dispatches to streams of its own, so it is timed on the host: after a device
  synchronisation, ``perf_counter`` around a batch of calls ending with
  ``block_until_ready()``; the median over batches of (batch time / calls per batch) is
  reported. Batches last >= 20 ms so the final synchronisation is amortised.
* Every point: one untimed call (compilation, autotuning, plan caches), a short untimed
  estimate, then >= 10 timed calls and about ``--budget`` seconds (default 0.5) in all.
* Inputs are random normal, never zeros. When one input set (q, k, v, dO and the output) is
  smaller than twice the L2 cache, several sets are made and the calls rotate among them, so
  no call finds its inputs in L2 from the previous one.

Memory mode (``--memory``): B=1, H=16, d=128, L from 1k to 128k. For each implementation the
peak of device memory allocated *during one call* beyond the inputs and the output. CuPy
allocations (cuflash, naive_cupy) are counted exactly with a ``cupy.cuda.MemoryHook`` that
follows every allocation and release of a fresh memory pool (bytes as the pool rounds them,
to 512 B). PyTorch's are read from ``torch.cuda.max_memory_allocated`` (its inputs are CuPy
memory, so only its output and workspaces show). Each measured call follows an unmeasured
one (compilation, handles, plans), and the output is subtracted, so an implementation's
internal lse buffer counts as extra. Memory that neither allocator sees (cuBLAS and cuDNN
workspaces, loaded kernel images, the driver) is not counted; the device-wide growth of used
memory across the measured call (``cudaMemGetInfo``; 0 when the pools reuse what the warm-up
call took) is recorded beside it as ``device_delta_bytes``.

The logic that does not touch a GPU (shapes, FLOPs, table, JSON, plots) is plain Python and is
tested on the CPU in tests/test_bench_logic.py. Nothing here imports CuPy, PyTorch or JAX at
module import time.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import json
import math
import os
import pathlib
import re
import statistics
import sys
import time
import warnings
from typing import Any, Callable, Iterable, Sequence

__all__ = ["main"]

TOKENS = 16384            # B * L
HIDDEN = 2048             # H * d
ALL_L = (1024, 4096, 16384)
ALL_D = (64, 128, 256)
QUICK_L = (1024, 4096)
QUICK_D = (64, 128)
MODES = ("fwd", "fwd_bwd")
DTYPES = ("bf16", "fp16", "fp32")
IMPLS = ("cuflash", "cuflash_sm80", "naive_cupy", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient",
         "jax_cudnn")
#: cuflash_sm80 only on request: off Hopper it is cuflash itself.
DEFAULT_IMPLS = tuple(i for i in IMPLS if i != "cuflash_sm80")
RATIO_PEERS = ("sdpa_flash", "sdpa_cudnn")
MEMORY_L = (1024, 4096, 16384, 32768, 65536, 131072)
MEMORY_B, MEMORY_H, MEMORY_D = 1, 16, 128

NAIVE_LIMIT_BYTES = 40e9          # float32 L x L scores over all (B, H), perf mode
NAIVE_MEMORY_LIMIT_BYTES = 60e9   # the same, memory mode
L2_BYTES_DEFAULT = 60 * 2**20     # H200; read from the device when there is one
MAX_INPUT_SETS = 16
DEFAULT_BUDGET_S = 0.5
QUICK_BUDGET_S = 0.15
MIN_ITERS = 10
MAX_ITERS = 1000
JAX_MIN_BATCH_S = 0.02


# ---------------------------------------------------------------------------------------------
# Pure logic (unit-tested on the CPU)
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Case:
    """One benchmark point; every implementation is timed on it."""
    dtype: str
    d: int
    L: int
    causal: bool
    mode: str
    B: int
    H: int

    @property
    def key(self) -> tuple:
        return (self.dtype, self.d, self.L, self.causal, self.mode)

    @property
    def flops(self) -> int:
        return attention_flops(self.B, self.H, self.L, self.L, self.d, self.causal, self.mode)


def batch_heads(L: int, d: int, tokens: int = TOKENS, hidden: int = HIDDEN) -> tuple[int, int]:
    """``(B, H)`` with ``B * L = tokens`` and ``H * d = hidden``."""
    if L <= 0 or d <= 0:
        raise ValueError(f"{L=} and {d=} must be positive")
    if L > tokens or tokens % L:
        raise ValueError(f"{L=} must divide {tokens=}")
    if d > hidden or hidden % d:
        raise ValueError(f"{d=} must divide {hidden=}")
    return tokens // L, hidden // d


def attention_flops(B: int, H: int, Lq: int, Lk: int, d: int, causal: bool, mode: str) -> int:
    """FlashAttention's FLOP convention.

    Forward: two matmuls of ``2*Lq*Lk*d`` each per (batch, head): ``4*B*H*Lq*Lk*d``, halved
    when causal (whatever the exact count of visible pairs). ``fwd_bwd``: 3.5x forward
    (backward counted as 2.5x forward). Softmax is not counted.
    """
    fwd = 4 * B * H * Lq * Lk * d
    if causal:
        fwd //= 2          # 4*...*d is even, so this is exact
    if mode == "fwd":
        return fwd
    if mode == "fwd_bwd":
        return fwd * 7 // 2
    raise ValueError(f"unknown {mode=}; expected one of {MODES}")


def tflops(flops: float, ms: float | None) -> float | None:
    """TFLOP/s for ``flops`` done in ``ms`` milliseconds (None when not timed)."""
    if ms is None or ms <= 0:
        return None
    return flops / (ms * 1e-3) / 1e12


def make_cases(dtypes: Sequence[str], ds: Sequence[int], Ls: Sequence[int],
               causals: Sequence[bool], modes: Sequence[str]) -> list[Case]:
    """All points in table order: dtype, d, L, causal, mode."""
    out = []
    for dtype in dtypes:
        for d in ds:
            for L in Ls:
                B, H = batch_heads(L, d)
                for causal in causals:
                    for mode in modes:
                        out.append(Case(dtype, d, L, causal, mode, B, H))
    return out


def naive_scores_bytes(B: int, H: int, Lq: int, Lk: int) -> int:
    """Bytes of the float32 score matrix the naive implementation materialises."""
    return 4 * B * H * Lq * Lk


def naive_fits(B: int, H: int, Lq: int, Lk: int, limit: float = NAIVE_LIMIT_BYTES) -> bool:
    return naive_scores_bytes(B, H, Lq, Lk) <= limit


def n_input_sets(set_bytes: int, l2_bytes: int = L2_BYTES_DEFAULT,
                 cap: int = MAX_INPUT_SETS) -> int:
    """How many input sets to rotate so consecutive calls do not hit L2: enough that together
    they span at least twice the L2 size."""
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


def parse_list(text: str, conv: Callable[[str], Any], allowed: Iterable | None = None) -> list:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"empty list: {text!r}")
    out = []
    for t in items:
        try:
            v = conv(t)
        except (ValueError, KeyError) as e:
            raise argparse.ArgumentTypeError(f"bad item {t!r} in {text!r}: {e}") from None
        if allowed is not None and v not in allowed:
            raise argparse.ArgumentTypeError(
                f"{t!r} not one of {', '.join(map(str, allowed))}")
        out.append(v)
    return out


_BOOLS = {"1": True, "true": True, "yes": True, "y": True, "causal": True,
          "0": False, "false": False, "no": False, "n": False, "noncausal": False}


def parse_bool(text: str) -> bool:
    return _BOOLS[text.lower()]


def row_for(case: Case, impl: str, *, ms: float | None = None, skipped: str | None = None,
            **extra) -> dict:
    """One JSON row. A skipped row has ``ms`` and ``tflops`` null and ``skipped`` the reason.
    Memory rows (mode "memory") have ``ms`` and ``tflops`` null and no ``flops``."""
    timed = case.mode in MODES
    row = {"impl": impl, "dtype": case.dtype, "d": case.d, "L": case.L, "B": case.B,
           "H": case.H, "causal": case.causal, "mode": case.mode,
           "ms": ms if timed and not skipped else None,
           "tflops": tflops(case.flops, ms) if timed and not skipped else None}
    if timed:
        row["flops"] = case.flops
    if skipped is not None:
        row["skipped"] = skipped
    row.update(extra)
    return row


def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def _render(header: list[str], body: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in body)) if body else len(h)
              for i, h in enumerate(header)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in body]
    return "\n".join(lines)


def _impls_in(rows: Sequence[dict]) -> list[str]:
    seen = {r["impl"] for r in rows}
    return [i for i in IMPLS if i in seen] + sorted(seen - set(IMPLS))


def format_table(rows: Sequence[dict]) -> str:
    """The TFLOP/s table: one line per (dtype, d, L, causal, mode), one column per
    implementation, then ``cuflash/<peer>`` ratio columns. ``-``: skipped or not run."""
    rows = [r for r in rows if r.get("mode") != "memory"]
    impls = _impls_in(rows)
    cells: dict[tuple, dict[str, float | None]] = {}
    for r in rows:
        key = (r["dtype"], r["d"], r["L"], r["causal"], r["mode"])
        cells.setdefault(key, {})[r["impl"]] = r.get("tflops")
    header = ["dtype", "d", "L", "causal", "mode"] + impls + [f"cuflash/{p}" for p in RATIO_PEERS]
    body = []
    for key, by_impl in cells.items():
        dtype, d, L, causal, mode = key
        line = [dtype, str(d), str(L), "yes" if causal else "no", mode]
        line += [_fmt(by_impl.get(i)) for i in impls]
        mine = by_impl.get("cuflash")
        for p in RATIO_PEERS:
            peer = by_impl.get(p)
            line.append(_fmt(mine / peer, ".2f") if mine and peer else "-")
        body.append(line)
    return _render(header, body)


def format_memory_table(rows: Sequence[dict]) -> str:
    """Peak extra device memory (MiB) per L, one column per implementation."""
    rows = [r for r in rows if r.get("mode") == "memory"]
    impls = _impls_in(rows)
    cells: dict[tuple, dict[str, int | None]] = {}
    for r in rows:
        key = (r["dtype"], r["B"], r["H"], r["d"], r["L"], r["causal"])
        cells.setdefault(key, {})[r["impl"]] = r.get("peak_extra_bytes")
    header = ["dtype", "B", "H", "d", "L", "causal"] + [f"{i} MiB" for i in impls]
    body = []
    for key, by_impl in cells.items():
        dtype, B, H, d, L, causal = key
        line = [dtype, str(B), str(H), str(d), str(L), "yes" if causal else "no"]
        for i in impls:
            v = by_impl.get(i)
            line.append("-" if v is None else f"{v / 2**20:.1f}")
        body.append(line)
    return _render(header, body)


def format_skips(rows: Sequence[dict]) -> str:
    """One line per (implementation, reason), with how many rows it covers."""
    counts: dict[tuple[str, str], int] = {}
    for r in rows:
        if r.get("skipped"):
            k = (r["impl"], r["skipped"])
            counts[k] = counts.get(k, 0) + 1
    return "\n".join(f"  {impl}: {reason} ({n} row{'s' if n > 1 else ''})"
                     for (impl, reason), n in counts.items())


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._]+", "-", text).strip("-") or "unknown"


def repo_root() -> pathlib.Path | None:
    """The checkout this module runs from, if it is one (it has bench/ next to cuflash/)."""
    root = pathlib.Path(__file__).resolve().parent.parent
    return root if (root / "bench").is_dir() and (root / "cuda_src").is_dir() else None


def default_json_path(gpu_name: str, now: _dt.datetime | None = None,
                      results_dir: pathlib.Path | None = None) -> pathlib.Path:
    """``bench/results/<date>-<gpu>.json`` in the checkout (else under the working directory);
    the date carries the time of day so runs on one day do not overwrite each other."""
    now = now or _dt.datetime.now()
    if results_dir is None:
        root = repo_root()
        results_dir = (root if root is not None else pathlib.Path.cwd()) / "bench" / "results"
    return results_dir / f"{now:%Y-%m-%d-%H%M%S}-{slug(gpu_name)}.json"


def write_json(path: pathlib.Path | str, header: dict, rows: Sequence[dict]) -> pathlib.Path:
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump({"header": header, "rows": list(rows)}, f, indent=1, allow_nan=False)
        f.write("\n")
    return path


def read_json(path: pathlib.Path | str) -> tuple[dict, list[dict]]:
    with open(path) as f:
        doc = json.load(f)
    return doc["header"], doc["rows"]


def plot(rows: Sequence[dict], out_dir: pathlib.Path | str, title: str = "") -> list[pathlib.Path]:
    """TFLOP/s against L, one panel per head dim, one line per implementation; one PNG per
    (dtype, causal, mode). Returns the files written ([] and a note when matplotlib is
    missing)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed; --plot skipped", file=sys.stderr)
        return []
    rows = [r for r in rows if r.get("mode") != "memory"]
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["dtype"], r["causal"], r["mode"]), []).append(r)
    written = []
    for (dtype, causal, mode), grp in groups.items():
        ds = sorted({r["d"] for r in grp})
        fig, axes = plt.subplots(1, len(ds), figsize=(4.2 * len(ds), 3.6), squeeze=False,
                                 sharey=True)
        for ax, d in zip(axes[0], ds):
            for impl in _impls_in(grp):
                pts = sorted((r["L"], r["tflops"]) for r in grp
                             if r["d"] == d and r["impl"] == impl and r.get("tflops"))
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=impl)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("sequence length L")
            ax.set_title(f"d = {d}")
            ax.grid(True, alpha=0.3)
            ax.set_ylim(bottom=0)
        axes[0][0].set_ylabel("TFLOP/s")
        axes[0][-1].legend(fontsize="small")
        kind = "causal" if causal else "noncausal"
        fig.suptitle(f"{title} {dtype} {kind} {mode}".strip())
        fig.tight_layout()
        path = out_dir / f"tflops-{dtype}-{kind}-{mode}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def version_of(dist: str) -> str | None:
    """Installed version of a distribution without importing it (None when absent)."""
    import importlib.metadata as md
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def cuflash_version() -> str:
    try:
        import cuflash
        v = getattr(cuflash, "__version__", None)
        if v:
            return str(v)
    except Exception:       # a broken package must not stop `info` or the header
        pass
    return version_of("cuflash") or "0+unknown"


def git_describe() -> str | None:
    """Commit of the checkout this runs from, with "+dirty" when files differ (None outside
    a git checkout), so a result can be tied to the kernel source that produced it."""
    import subprocess
    root = repo_root()
    if root is None:
        return None
    try:
        sha = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=root,
                             capture_output=True, text=True, timeout=10)
        if sha.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=root, capture_output=True, text=True, timeout=10)
        return sha.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


# ---------------------------------------------------------------------------------------------
# GPU side
# ---------------------------------------------------------------------------------------------

class Skip(Exception):
    """This implementation does not run this case; the message says why."""


def _short(exc: BaseException, caught: Sequence[warnings.WarningMessage] = ()) -> str:
    msg = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    # PyTorch explains "No available kernel" in warnings, after headers such as "Flash
    # attention kernel not used because:"; keep the first real explanation.
    for w in caught:
        text = re.sub(r"\s*\(Triggered internally at [^)]*\)\.?", "", str(w.message)).strip()
        text = text.splitlines()[0].strip() if text else ""
        if text and not text.endswith(":") and "runtime disabled" not in text:
            msg += f" [{text}]"
            break
    return msg[:300]


def _np_dtype(name: str):
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
    """Random normal inputs (never zeros), ``n_sets`` independent sets."""
    dt = _np_dtype(dtype_name)
    rs = cp.random.RandomState(seed)
    sets = []
    for _ in range(n_sets):
        q, k, v = (rs.standard_normal(shape, dtype=cp.float32).astype(dt) for _ in range(3))
        do = rs.standard_normal(shape, dtype=cp.float32).astype(dt) if with_grad else None
        sets.append(InputSet(q, k, v, do))
    return sets


class Impl:
    """An implementation under test. ``prepare`` returns ``fn(i)`` that runs one call on input
    set ``i`` (or raises Skip); ``timing`` is "events" or "host"."""
    name = ""
    timing = "events"

    def available(self) -> str | None:
        """None when importable, else why not."""
        return None

    def prepare(self, case: Case, sets: list[InputSet], scale: float) -> Callable[[int], Any]:
        raise NotImplementedError

    def sync(self) -> None:
        import cupy as cp
        cp.cuda.Device().synchronize()

    def release(self) -> None:
        """Give cached device memory back after a case."""


class CuflashImpl(Impl):
    name = "cuflash"

    def available(self):
        try:
            import cuflash  # noqa: F401
        except Exception as e:
            return _short(e)
        return None

    def prepare(self, case, sets, scale):
        import cuflash
        causal = case.causal
        if case.mode == "fwd":
            def fn(i):
                s = sets[i]
                return cuflash.attention(s.q, s.k, s.v, scale=scale, causal=causal)
            return fn
        if not hasattr(cuflash, "attention_vjp"):
            raise Skip("cuflash.attention_vjp not implemented yet")

        def fn(i):
            s = sets[i]
            _, pullback = cuflash.attention_vjp(s.q, s.k, s.v, scale=scale, causal=causal)
            return pullback(s.do)
        return fn

    def release(self):
        import cupy as cp
        cp.get_default_memory_pool().free_all_blocks()


class CuflashSm80Impl(CuflashImpl):
    """cuflash with the dispatcher kept on fwd_sm80 (mma.sync) where it would pick fwd_sm90:
    the kernel every sm_80+ GPU other than Hopper runs, measured on the same inputs."""
    name = "cuflash_sm80"

    def prepare(self, case, sets, scale):
        from cuflash import _launch
        inner = super().prepare(case, sets, scale)

        def fn(i):
            with _launch.use_family("sm80"):
                return inner(i)
        return fn


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
            gb = naive_scores_bytes(case.B, case.H, case.L, case.L) / 1e9
            raise Skip(f"float32 scores would take {gb:.0f} GB > {self.limit / 1e9:.0f} GB")
        bias = None
        if case.causal:
            # made once, outside the timing: 0 where visible, -inf above the diagonal
            bias = cp.triu(cp.full((case.L, case.L), -cp.inf, dtype=cp.float32), k=1)

        def fn(i):
            s = sets[i]
            return naive_attention(cp, s.q, s.k, s.v, scale, bias)
        return fn

    def release(self):
        import cupy as cp
        cp.get_default_memory_pool().free_all_blocks()


def batched_matmul(xp, a, b):
    """``xp.matmul(a, b)``, except where CuPy refuses it: CuPy 14.2's batched (ndim > 2)
    matmul rejects bfloat16 ("data type 'E' not understood") while 2-D matmul takes it, so
    there the batch is looped over with 2-D matmuls (cuBLAS, tensor cores) into one output,
    which is what a CuPy user has to write today."""
    try:
        return xp.matmul(a, b)
    except TypeError:
        if a.ndim <= 2 or a.dtype.name != "bfloat16":
            raise
    import numpy as np
    batch = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    a = xp.broadcast_to(a, batch + a.shape[-2:])
    b = xp.broadcast_to(b, batch + b.shape[-2:])
    out = xp.empty(batch + (a.shape[-2], b.shape[-1]), dtype=a.dtype)
    for idx in np.ndindex(*batch):
        xp.matmul(a[idx], b[idx], out=out[idx])
    return out


def naive_attention(cp, q, k, v, scale: float, bias=None):
    """O = softmax(scale * Q K^T + bias) V with the score matrix materialised in float32:
    matmul in the input dtype (float32 accumulation in cuBLAS), softmax in float32, the
    probabilities cast back to the input dtype, matmul."""
    s = batched_matmul(cp, q, k.swapaxes(-1, -2))
    s = s.astype(cp.float32, copy=False)
    s *= cp.float32(scale)
    if bias is not None:
        s += bias
    s -= s.max(axis=-1, keepdims=True)
    cp.exp(s, out=s)
    s /= s.sum(axis=-1, keepdims=True)
    return batched_matmul(cp, s.astype(q.dtype, copy=False), v)


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
            return _short(e)
        if not torch.cuda.is_available():
            return "torch.cuda.is_available() is False"
        if not hasattr(SDPBackend, self.BACKENDS[self.name]):
            return f"this torch has no SDPBackend.{self.BACKENDS[self.name]}"
        import cupy as cp
        same_stream = (cp.cuda.get_current_stream().ptr == 0
                       and torch.cuda.current_stream().cuda_stream == 0)
        self.timing = "events" if same_stream else "host"
        return None

    def _tensors(self, s: InputSet, grad: bool):
        import torch
        key = ("torch", grad)
        if key not in s.cache:
            # zero copy: the tensors alias the CuPy arrays
            ts = [torch.from_dlpack(a) for a in (s.q, s.k, s.v)]
            if grad:
                ts = [t.requires_grad_(True) for t in ts]
            do = torch.from_dlpack(s.do) if s.do is not None else None
            s.cache[key] = (*ts, do)
        return s.cache[key]

    def prepare(self, case, sets, scale):
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
        sdpa = torch.nn.functional.scaled_dot_product_attention
        backend = getattr(SDPBackend, self.BACKENDS[self.name])
        causal = case.causal
        if case.mode == "fwd":
            def fn(i):
                q, k, v, _ = self._tensors(sets[i], False)
                with torch.no_grad(), sdpa_kernel(backend):
                    return sdpa(q, k, v, is_causal=causal, scale=scale)
            return fn

        def fn(i):
            q, k, v, do = self._tensors(sets[i], True)
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
        # JAX would otherwise grab 75% of the device at import and starve everyone else.
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
        try:
            import jax
            if not any(dev.platform == "gpu" for dev in jax.devices()):
                return "JAX sees no GPU"
        except Exception as e:
            return _short(e)
        return None

    @staticmethod
    def _from_cupy(a):
        import jax.dlpack
        try:
            return jax.dlpack.from_dlpack(a)
        except TypeError:                      # older JAX wants a capsule
            return jax.dlpack.from_dlpack(a.toDlpack())

    def _arrays(self, s: InputSet):
        import cupy as cp
        if "jax" not in s.cache:
            # JAX's layout is (B, L, H, d): one transposed copy per set, outside the timing.
            blhd = [cp.ascontiguousarray(a.transpose(0, 2, 1, 3)) if a is not None else None
                    for a in (s.q, s.k, s.v, s.do)]
            cp.cuda.Device().synchronize()
            s.cache["jax_cupy"] = blhd         # keep the memory alive under the JAX arrays
            s.cache["jax"] = [self._from_cupy(a) if a is not None else None for a in blhd]
        return s.cache["jax"]

    def prepare(self, case, sets, scale):
        import functools
        import jax
        attn = functools.partial(jax.nn.dot_product_attention, scale=scale,
                                 is_causal=case.causal, implementation="cudnn")
        if case.mode == "fwd":
            f = jax.jit(attn)

            def fn(i):
                q, k, v, _ = self._arrays(sets[i])
                return f(q, k, v)
            return fn

        def fwd_bwd(q, k, v, do):
            _, pullback = jax.vjp(attn, q, k, v)
            return pullback(do)
        g = jax.jit(fwd_bwd)

        def fn(i):
            q, k, v, do = self._arrays(sets[i])
            return g(q, k, v, do)
        return fn

    def sync(self):
        import cupy as cp
        cp.cuda.Device().synchronize()

    def release(self):
        import gc
        gc.collect()


def all_impls() -> list[Impl]:
    return [CuflashImpl(), CuflashSm80Impl(), NaiveCupyImpl(), SdpaImpl("sdpa_flash"), SdpaImpl("sdpa_cudnn"),
            SdpaImpl("sdpa_efficient"), JaxCudnnImpl()]


def _block(result) -> None:
    """Wait for a JAX result (a pytree of arrays)."""
    import jax
    jax.block_until_ready(result)


def time_events(fn: Callable[[int], Any], n_sets: int, iters: int) -> list[float]:
    """Per-call milliseconds from CUDA events on CuPy's current stream."""
    import cupy as cp
    cp.cuda.Device().synchronize()
    starts = [cp.cuda.Event() for _ in range(iters)]
    ends = [cp.cuda.Event() for _ in range(iters)]
    for it in range(iters):
        starts[it].record()
        fn(it % n_sets)
        ends[it].record()
    ends[-1].synchronize()
    return [cp.cuda.get_elapsed_time(s, e) for s, e in zip(starts, ends)]


def time_host(fn: Callable[[int], Any], n_sets: int, batches: int, per_batch: int,
              block: Callable[[Any], None], sync: Callable[[], None]) -> list[float]:
    """Per-call milliseconds from perf_counter around batches of calls (median of batches)."""
    sync()
    out = []
    it = 0
    for _ in range(batches):
        t0 = time.perf_counter()
        r = None
        for _ in range(per_batch):
            r = fn(it % n_sets)
            it += 1
        block(r)
        out.append((time.perf_counter() - t0) * 1e3 / per_batch)
    return out


def measure(impl: Impl, fn: Callable[[int], Any], n_sets: int, budget_s: float) -> tuple[float, int]:
    """Median milliseconds per call and how many calls were timed."""
    block = _block if impl.name.startswith("jax") else (lambda r: impl.sync())
    # untimed estimate: 3 calls
    impl.sync()
    t0 = time.perf_counter()
    r = None
    for i in range(3):
        r = fn(i % n_sets)
    block(r)
    est = (time.perf_counter() - t0) / 3
    del r
    if impl.timing == "events":
        iters = n_iters(est, budget_s)
        return statistics.median(time_events(fn, n_sets, iters)), iters
    per_batch = max(1, math.ceil(JAX_MIN_BATCH_S / max(est, 1e-9)))
    batches = n_iters(est * per_batch, budget_s, hi=200)
    ms = time_host(fn, n_sets, batches, per_batch, block, impl.sync)
    return statistics.median(ms), batches * per_batch


def _first_call(impl: Impl, case: Case, sets: list[InputSet], scale: float):
    """prepare + one untimed call; any failure becomes Skip with the reason."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            fn = impl.prepare(case, sets, scale)
            r = fn(0)
            if impl.name.startswith("jax"):
                _block(r)
            else:
                impl.sync()
            del r
        except Skip:
            raise
        except Exception as e:   # unsupported dtype/shape, out of memory, ...
            raise Skip(_short(e, caught)) from None
    return fn


def device_header(argv: Sequence[str]) -> dict:
    import cupy as cp
    import numpy as np
    dev = cp.cuda.Device()
    props = cp.cuda.runtime.getDeviceProperties(dev.id)
    name = props["name"]
    name = name.decode() if isinstance(name, bytes) else str(name)

    def cuda_ver(v: int) -> str:
        return f"{v // 1000}.{v % 1000 // 10}"
    try:
        nvrtc = ".".join(map(str, cp.cuda.nvrtc.getVersion()))
    except Exception:
        nvrtc = None
    return {
        "gpu": name,
        "compute_capability": f"{props['major']}.{props['minor']}",
        "sm_count": props["multiProcessorCount"],
        "l2_bytes": props.get("l2CacheSize"),
        "driver": cuda_ver(cp.cuda.runtime.driverGetVersion()),
        "cuda_runtime": cuda_ver(cp.cuda.runtime.runtimeGetVersion()),
        "nvrtc": nvrtc,
        "cupy": cp.__version__,
        "numpy": np.__version__,
        "torch": version_of("torch"),
        "jax": version_of("jax"),
        "jaxlib": version_of("jaxlib"),
        "cuflash": cuflash_version(),
        "git": git_describe(),
        "python": sys.version.split()[0],
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": " ".join(argv),
    }


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_perf(cases: list[Case], impls: list[Impl], budget_s: float, seed: int,
             l2_bytes: int) -> list[dict]:
    import cupy as cp
    rows = []
    unavailable = {}
    for impl in impls:
        why = impl.available()
        if why:
            unavailable[impl.name] = why
            _progress(f"{impl.name}: not available ({why})")
    for case in cases:
        dt = _np_dtype(case.dtype)
        shape = (case.B, case.H, case.L, case.d)
        grad = case.mode == "fwd_bwd"
        set_bytes = 4 * math.prod(shape) * dt.itemsize * (2 if grad else 1)   # q k v o (+dO, grads)
        n_sets = n_input_sets(set_bytes, l2_bytes)
        sets = make_inputs(cp, shape, case.dtype, n_sets, grad, seed)
        scale = 1.0 / math.sqrt(case.d)
        for impl in impls:
            label = (f"{case.dtype} d={case.d} L={case.L} B={case.B} H={case.H} "
                     f"causal={case.causal} {case.mode} {impl.name}")
            if impl.name in unavailable:
                rows.append(row_for(case, impl.name, skipped=f"not available: {unavailable[impl.name]}"))
                continue
            try:
                fn = _first_call(impl, case, sets, scale)
                ms, iters = measure(impl, fn, n_sets, budget_s)
            except Skip as e:
                rows.append(row_for(case, impl.name, skipped=str(e)))
                _progress(f"{label}: skipped ({e})")
            except Exception as e:     # a failure while timing: report, do not crash the run
                rows.append(row_for(case, impl.name, skipped=f"failed: {_short(e)}"))
                _progress(f"{label}: FAILED ({_short(e)})")
            else:
                row = row_for(case, impl.name, ms=ms, iters=iters, input_sets=n_sets,
                              timing=impl.timing)
                rows.append(row)
                _progress(f"{label}: {ms:.3f} ms  {row['tflops']:.1f} TFLOP/s  "
                          f"({iters} calls, {n_sets} input set{'s' if n_sets > 1 else ''})")
            finally:
                fn = None
                for s in sets:
                    s.cache.clear()
                impl.release()
        del sets
        cp.get_default_memory_pool().free_all_blocks()
    return rows


class _PeakHook:
    """Live bytes handed out by a CuPy memory pool since the hook was entered, and their peak."""

    def __new__(cls):
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


def measure_memory_cupy(fn: Callable[[], Any], pool=None) -> dict:
    """Run ``fn`` once (after a warm-up call) and return the peak CuPy bytes it allocated
    beyond its output, with the pool growth and the device-wide change beside it."""
    import cupy as cp
    dev = cp.cuda.Device()
    out = fn()                      # warm-up: compile, load modules, create handles
    out_bytes = out.nbytes
    del out
    dev.synchronize()
    pool_before = pool.total_bytes() if pool is not None else None
    free_before = cp.cuda.runtime.memGetInfo()[0]
    hook = _PeakHook()
    with hook:
        out = fn()
        dev.synchronize()
    free_after = cp.cuda.runtime.memGetInfo()[0]
    rounded_out = -(-out.nbytes // 512) * 512
    res = {"peak_extra_bytes": max(0, hook.peak - rounded_out),
           "output_bytes": out_bytes,
           "device_delta_bytes": free_before - free_after}
    if pool is not None:
        res["pool_growth_bytes"] = pool.total_bytes() - pool_before
    del out
    return res


def measure_memory_torch(fn: Callable[[], Any]) -> dict:
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
    res = {"peak_extra_bytes": max(0, peak - out_bytes), "output_bytes": out_bytes,
           "device_delta_bytes": free_before - free_after}
    del out
    return res


def run_memory(dtypes: Sequence[str], Ls: Sequence[int], causals: Sequence[bool],
               impls: list[Impl], seed: int) -> list[dict]:
    import cupy as cp
    rows = []
    keep = {"cuflash", "naive_cupy", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient"}
    impls = [NaiveCupyImpl(NAIVE_MEMORY_LIMIT_BYTES) if i.name == "naive_cupy" else i
             for i in impls if i.name in keep]
    unavailable = {i.name: i.available() for i in impls}
    for dtype in dtypes:
        for L in Ls:
            for causal in causals:
                case = Case(dtype, MEMORY_D, L, causal, "memory", MEMORY_B, MEMORY_H)
                shape = (MEMORY_B, MEMORY_H, L, MEMORY_D)
                scale = 1.0 / math.sqrt(MEMORY_D)
                for impl in impls:
                    label = f"memory {dtype} L={L} causal={causal} {impl.name}"
                    if unavailable[impl.name]:
                        rows.append(row_for(case, impl.name,
                                            skipped=f"not available: {unavailable[impl.name]}"))
                        continue
                    pool = cp.cuda.MemoryPool()          # fresh pool: nothing cached from before
                    cp.cuda.set_allocator(pool.malloc)
                    try:
                        sets = make_inputs(cp, shape, dtype, 1, False, seed)
                        fn = impl.prepare(dataclasses.replace(case, mode="fwd"), sets, scale)
                        if isinstance(impl, SdpaImpl):
                            res = measure_memory_torch(lambda: fn(0))
                        else:
                            res = measure_memory_cupy(lambda: fn(0), pool)
                    except Skip as e:
                        rows.append(row_for(case, impl.name, skipped=str(e)))
                        _progress(f"{label}: skipped ({e})")
                    except Exception as e:
                        rows.append(row_for(case, impl.name, skipped=f"failed: {_short(e)}"))
                        _progress(f"{label}: FAILED ({_short(e)})")
                    else:
                        rows.append(row_for(case, impl.name, **res))
                        _progress(f"{label}: peak extra {res['peak_extra_bytes'] / 2**20:.1f} MiB")
                    finally:
                        fn = sets = None
                        impl.release()
                        cp.cuda.set_allocator(cp.get_default_memory_pool().malloc)
                        pool.free_all_blocks()
                        del pool
    return rows


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m cuflash bench",
        description="Time cuflash against naive CuPy, PyTorch SDPA backends and JAX cuDNN "
                    "attention on the same inputs (B*L = 16k tokens, H*d = 2048). Prints a "
                    "TFLOP/s table last and writes JSON under bench/results/. The method "
                    "(timing, FLOPs, memory accounting) is in cuflash/_bench.py's docstring.")
    p.add_argument("--dtype", type=lambda s: parse_list(s, str, DTYPES), default=["bf16"],
                   help="comma list of bf16, fp16, fp32 (default bf16)")
    p.add_argument("--d", type=lambda s: parse_list(s, int, ALL_D), default=None,
                   help=f"comma list of head dims (default {','.join(map(str, ALL_D))})")
    p.add_argument("--L", type=lambda s: parse_list(s, int), default=None,
                   help=f"comma list of sequence lengths (default {','.join(map(str, ALL_L))})")
    p.add_argument("--causal", type=lambda s: parse_list(s, parse_bool), default=None,
                   help="comma list of false,true (default both; memory mode: false)")
    p.add_argument("--mode", type=lambda s: parse_list(s, str, MODES), default=None,
                   help="comma list of fwd, fwd_bwd (default both; --quick: fwd)")
    p.add_argument("--impl", type=lambda s: parse_list(s, str, IMPLS), default=list(DEFAULT_IMPLS),
                   help=f"comma list of implementations from {','.join(IMPLS)} "
                        f"(default: {','.join(DEFAULT_IMPLS)})")
    p.add_argument("--quick", action="store_true",
                   help=f"small subset: d in {QUICK_D}, L in {QUICK_L}, forward only, "
                        f"{QUICK_BUDGET_S} s per point")
    p.add_argument("--budget", type=float, default=None,
                   help=f"seconds of timed calls per point (default {DEFAULT_BUDGET_S})")
    p.add_argument("--seed", type=int, default=0, help="input seed (default 0)")
    p.add_argument("--json", type=pathlib.Path, default=None,
                   help="where to write the JSON (default bench/results/<date>-<gpu>.json)")
    p.add_argument("--no-json", action="store_true", help="do not write JSON")
    p.add_argument("--plot", type=pathlib.Path, default=None, metavar="DIR",
                   help="write TFLOP/s-vs-L PNGs into DIR (needs matplotlib)")
    p.add_argument("--memory", action="store_true",
                   help=f"memory mode: B={MEMORY_B}, H={MEMORY_H}, d={MEMORY_D}, L up to "
                        f"{MEMORY_L[-1]}; peak device memory beyond inputs and output")
    p.add_argument("--load", type=pathlib.Path, default=None, metavar="JSON",
                   help="print the tables (and --plot) of a saved run; needs no GPU")
    return p


def _report(header: dict, rows: list[dict], args) -> None:
    if args.plot is not None:
        for path in plot(rows, args.plot, title=str(header.get("gpu", ""))):
            _progress(f"wrote {path}")
    skips = format_skips(rows)
    if skips:
        print("Skipped:")
        print(skips)
        print()
    if any(r.get("mode") == "memory" for r in rows):
        print("Peak device memory beyond inputs and output (MiB):")
        print(format_memory_table(rows))
        print()
    if any(r.get("mode") != "memory" for r in rows):
        print(f"TFLOP/s ({header.get('gpu', '?')}; FLOPs: fwd 4*B*H*L*L*d, /2 causal; "
              "fwd_bwd 3.5x fwd):")
        print(format_table(rows))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)

    if args.load is not None:
        header, rows = read_json(args.load)
        _report(header, rows, args)
        return 0

    try:
        import cupy as cp
        ndev = cp.cuda.runtime.getDeviceCount()
    except Exception as e:
        print(f"bench needs a CUDA GPU and CuPy: {_short(e)}", file=sys.stderr)
        return 2
    if ndev == 0:
        print("bench needs a CUDA GPU: none found", file=sys.stderr)
        return 2

    header = device_header(["python -m cuflash bench", *argv])
    l2 = header.get("l2_bytes") or L2_BYTES_DEFAULT
    budget = args.budget if args.budget is not None else (
        QUICK_BUDGET_S if args.quick else DEFAULT_BUDGET_S)
    impls = [i for i in all_impls() if i.name in args.impl]

    if args.memory:
        Ls = args.L or list(MEMORY_L)
        rows = run_memory(args.dtype, Ls, args.causal or [False], impls, args.seed)
    else:
        ds = args.d or list(QUICK_D if args.quick else ALL_D)
        Ls = args.L or list(QUICK_L if args.quick else ALL_L)
        causals = args.causal or [False, True]
        modes = args.mode or (["fwd"] if args.quick else list(MODES))
        try:
            cases = make_cases(args.dtype, ds, Ls, causals, modes)
        except ValueError as e:
            print(f"bad shape: {e}", file=sys.stderr)
            return 2
        rows = run_perf(cases, impls, budget, args.seed, l2)

    header["budget_s"] = budget
    if not args.no_json:
        path = args.json or default_json_path(header["gpu"])
        write_json(path, header, rows)
        _progress(f"wrote {path}")
    print()
    _report(header, rows, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
