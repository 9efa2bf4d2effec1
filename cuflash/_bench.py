"""``python -m cuflash bench``: cuflash against naive CuPy and any importable PyTorch SDPA
backend on this GPU, bf16 forward, d 64/128, L 1k/4k, causal and not (B*L = 16k tokens,
H*d = 2048); random normal inputs; CUDA events around back-to-back calls after an untimed one,
median. The lab harness (suites, JAX, isolated calls, memory, committed H200 results) is
``bench/bench_attention.py`` in the source tree; it takes the row format, FLOP count, table,
JSON and plot from here, so ``--load`` prints the results of either. No CuPy/PyTorch import
at module import time.
"""
from __future__ import annotations

import functools
import itertools
import json
import math
import pathlib
import statistics
import sys
import time
from typing import Any, Sequence

from cuflash._cli_common import cuflash_version, version_of  # noqa: F401  (the harness's too)

__all__ = ["main"]

TOKENS = 16384            # B * L
HIDDEN = 2048             # H * d
MODES = ("fwd", "fwd_bwd")
#: column order of the tables; impls not listed here follow in name order
IMPL_ORDER = ("cuflash", "cuflash_sm80", "naive_cupy", "sdpa_flash", "sdpa_cudnn",
              "sdpa_efficient", "jax_cudnn")
RATIO_PEERS = ("sdpa_flash", "sdpa_cudnn")
SHORT_D, SHORT_L = (64, 128), (1024, 4096)


class ResultFileError(ValueError):
    """A results file that is missing, not JSON, or without a header."""


def batch_heads(L: int, d: int, tokens: int = TOKENS, hidden: int = HIDDEN) -> tuple[int, int]:
    """``(B, H)`` with ``B * L = tokens`` and ``H * d = hidden``."""
    if L <= 0 or d <= 0 or tokens % L or hidden % d:
        raise ValueError(f"{L=} must divide {tokens=} and {d=} must divide {hidden=}")
    return tokens // L, hidden // d


def attention_flops(B: int, H: int, Lq: int, Lk: int, d: int, causal: bool, mode: str) -> int:
    """FlashAttention's convention: forward ``4*B*H*Lq*Lk*d`` (two matmuls), halved when
    causal whatever the exact count of visible pairs; ``fwd_bwd`` 3.5x forward (the backward
    counted as 2.5x). Softmax is not counted."""
    if mode not in MODES:
        raise ValueError(f"unknown {mode=}; expected one of {MODES}")
    fwd = 4 * B * H * Lq * Lk * d // (2 if causal else 1)      # 4*...*d is even: exact
    return fwd if mode == "fwd" else fwd * 7 // 2             # both exact integers


def make_row(impl: str, suite: str, mode: str, dtype: str, d: int, L: int, causal: bool,
             B: int, H: int, *, isolated: bool = False, ms: float | None = None,
             skipped: str | None = None, **extra) -> dict:
    """One result row; skipped: ``ms``, ``tflops`` null and ``skipped`` the reason. A mode
    without FLOPs (memory) has null ``tflops`` and no ``flops``."""
    row = {"impl": impl, "suite": suite, "mode": mode, "dtype": dtype, "d": d, "L": L,
           "causal": bool(causal), "isolated": bool(isolated), "B": B, "H": H,
           "ms": None if skipped else ms, "tflops": None}
    if mode in MODES:
        row["flops"] = attention_flops(B, H, L, L, d, causal, mode)
        row["tflops"] = None if skipped or not ms else row["flops"] / (ms * 1e9)
    row.update(extra if skipped is None else dict(extra, skipped=skipped))
    return row


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)       # "-": skipped or not run


def format_table(rows: Sequence[dict]) -> str:
    """TFLOP/s: a line per (mode, dtype, d, L, causal), a column per implementation, then
    ``cuflash/<peer>`` ratios; isolated rows show mode ``fwd/iso``; memory rows left out."""
    rows = [r for r in rows if r.get("mode") in MODES]
    seen = {r["impl"] for r in rows}
    impls = [i for i in IMPL_ORDER if i in seen] + sorted(seen - set(IMPL_ORDER))
    cells: dict[tuple, dict[str, float | None]] = {}
    for r in rows:
        mode = r["mode"] + ("/iso" if r.get("isolated") else "")
        key = (mode, r["dtype"], r["d"], r["L"], r["causal"])
        cells.setdefault(key, {})[r["impl"]] = r.get("tflops")
    header = ["mode", "dtype", "d", "L", "causal"] + impls + [f"cuflash/{p}" for p in RATIO_PEERS]
    body = []
    for (mode, dtype, d, L, causal), by_impl in cells.items():
        line = [mode, dtype, str(d), str(L), "yes" if causal else "no"]
        line += [_fmt(by_impl.get(i), ".1f") for i in impls]
        mine, peers = by_impl.get("cuflash"), [by_impl.get(p) for p in RATIO_PEERS]
        line += [format(mine / p, ".2f") if mine and p else "-" for p in peers]
        body.append(line)
    widths = [max([len(h)] + [len(r[i]) for r in body]) for i, h in enumerate(header)]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths))
                     for r in [header, ["-" * w for w in widths], *body])


def write_json(path: pathlib.Path | str, header: dict, rows: Sequence[dict]) -> pathlib.Path:
    """``{"header": ..., "rows": [...]}``; NaN or infinity is refused (ValueError)."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps({"header": header, "rows": list(rows)}, indent=1, allow_nan=False)
    path.write_text(text + "\n")
    return path


def read_json(path: pathlib.Path | str) -> tuple[dict, list[dict]]:
    """``(header, rows)`` of a results file, else ResultFileError with a one-line reason."""
    try:
        doc = json.loads(pathlib.Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ResultFileError(f"cannot read {path}: {type(e).__name__}: "
                              f"{getattr(e, 'strerror', None) or e}") from None
    if not (isinstance(doc, dict) and isinstance(doc.get("header"), dict)
            and isinstance(doc.get("rows"), list)):
        raise ResultFileError(f"{path} is not a results file (no 'header' object and 'rows')")
    return doc["header"], doc["rows"]


def plot(rows: Sequence[dict], path: pathlib.Path | str, title: str = "") -> pathlib.Path | None:
    """TFLOP/s against L, one panel per head dim, one line per (implementation, mode, dtype,
    causal), into the PNG ``path``; None (and a note) without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed; no plot", file=sys.stderr)
        return None
    lines: dict[int, dict[tuple, list]] = {}
    for r in rows:
        if r.get("tflops"):
            key = (r["impl"], r["mode"], r["dtype"], "causal" if r["causal"] else "")
            lines.setdefault(r["d"], {}).setdefault(key, []).append((r["L"], r["tflops"]))
    fig, axes = plt.subplots(1, max(1, len(lines)), figsize=(4.5 * max(1, len(lines)), 3.8),
                             squeeze=False, sharey=True)
    for ax, d in zip(axes[0], sorted(lines)):
        for key, pts in sorted(lines[d].items()):
            ax.plot(*zip(*sorted(pts)), marker="o", linestyle="--" if key[3] else "-",
                    label=" ".join(key).strip())
        ax.set(xscale="log", title=f"d = {d}", xlabel="L", ylabel="TFLOP/s")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="xx-small")
    top = max((t for pts in lines.values() for ps in pts.values() for _, t in ps), default=1)
    axes[0][0].set_ylim(0, 1.05 * top)     # shared: every panel's lines fit (not the first's)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return pathlib.Path(path)


def batched_matmul(xp, a, b):
    """``xp.matmul(a, b)``, or where CuPy 14.2 refuses batched bfloat16 (TypeError; 2-D
    works) a loop of 2-D matmuls into one output: what a CuPy user writes today."""
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


def naive_attention(xp, q, k, v, scale: float, bias=None):
    """``softmax(scale * q k^T + bias) v`` with the scores materialised in float32 (what a
    CuPy user writes today). ``bias``: 0 where visible, -inf where masked; a row that is all
    -inf would give NaN (0/0), which the causal bias with Lq <= Lk never produces."""
    s = batched_matmul(xp, q, k.swapaxes(-1, -2)).astype(xp.float32, copy=False)
    s *= xp.float32(scale)
    if bias is not None:
        s += bias
    s -= s.max(axis=-1, keepdims=True)
    xp.exp(s, out=s)
    s /= s.sum(axis=-1, keepdims=True)
    return batched_matmul(xp, s.astype(q.dtype, copy=False), v)


def _median_ms(cp, fn, budget_s: float) -> float:
    """Median ms of back-to-back calls, about ``budget_s`` of them, after an untimed call."""
    for _ in range(2):                      # compile, plan caches; then an estimate
        t0 = time.perf_counter()
        fn()
        cp.cuda.Device().synchronize()
    n = max(5, min(500, int(budget_s / max(time.perf_counter() - t0, 1e-6))))
    ev = [(cp.cuda.Event(), cp.cuda.Event()) for _ in range(n)]
    for a, b in ev:
        a.record()
        fn()
        b.record()
    ev[-1][1].synchronize()
    return statistics.median(cp.cuda.get_elapsed_time(a, b) for a, b in ev)


def _sdpa_peers() -> dict[str, Any]:
    """``{name: fn(q, k, v, causal, scale)}`` per SDPA backend this PyTorch has with CUDA."""
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except Exception:       # no (working) PyTorch: cuflash and naive CuPy only
        return {}
    if not torch.cuda.is_available():
        return {}

    def call(backend, q, k, v, causal, scale):
        with torch.no_grad(), sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(
                *(torch.from_dlpack(x) for x in (q, k, v)), is_causal=causal, scale=scale)
    return {n: functools.partial(call, getattr(SDPBackend, be)) for n, be in (
        ("sdpa_flash", "FLASH_ATTENTION"), ("sdpa_cudnn", "CUDNN_ATTENTION"))
        if hasattr(SDPBackend, be)}


def run_short(budget_s: float) -> list[dict]:
    import cupy as cp
    import ml_dtypes
    import cuflash
    from cuflash._progress import Progress
    peers, rows = _sdpa_peers(), []
    points = list(itertools.product(SHORT_D, SHORT_L, (False, True)))
    bar = Progress(total=len(points) * (2 + len(peers)), label="bench")
    for d, L, causal in points:
        B, H = batch_heads(L, d)
        rs = cp.random.RandomState(0)       # random normal: never time on zeros
        q, k, v = (rs.standard_normal((B, H, L, d), dtype=cp.float32)
                   .astype(ml_dtypes.bfloat16) for _ in range(3))
        scale = 1.0 / math.sqrt(d)
        bias = cp.triu(cp.full((L, L), -cp.inf, dtype=cp.float32), k=1) if causal else None
        fns = {"cuflash": lambda: cuflash.attention(q, k, v, scale=scale, causal=causal),
               "naive_cupy": lambda: naive_attention(cp, q, k, v, scale, bias)}
        for name, peer in peers.items():     # DLPack views of the same memory: zero copy
            fns[name] = functools.partial(peer, q, k, v, causal, scale)
        for name, fn in fns.items():
            args = (name, "short", "fwd", "bf16", d, L, causal, B, H)
            bar.label = f"bench d={d} L={L}{' causal' if causal else ''} {name}"
            try:
                rows.append(make_row(*args, ms=_median_ms(cp, fn, budget_s)))
            except Exception as e:     # unsupported shape, out of memory, ...
                rows.append(make_row(*args, skipped=f"{type(e).__name__}: {e}"[:200]))
            bar.advance()
        del q, k, v, bias, fns
        cp.get_default_memory_pool().free_all_blocks()
    bar.close()
    for r in rows:                     # after the bar: why a cell of the table is "-"
        if r.get("skipped"):
            print(f"skipped d={r['d']} L={r['L']} causal={r['causal']} {r['impl']}: "
                  f"{r['skipped']}", file=sys.stderr)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    from cuflash._cli_common import OneLineParser, positive_seconds, usable_gpu
    p = OneLineParser(prog="python -m cuflash bench", description=__doc__.split(
        ";")[0].replace("``", "") + ". The lab harness is bench/bench_attention.py.")
    p.add_argument("--budget", type=positive_seconds, default=0.3,
                   help="seconds of timed calls a point")
    p.add_argument("--json", type=pathlib.Path, help="also write the rows to this JSON file")
    p.add_argument("--plot", type=pathlib.Path, metavar="PNG", help="write a plot (matplotlib)")
    p.add_argument("--load", type=pathlib.Path, metavar="JSON", help="print a saved results "
                   "file (this command's or the harness's); needs no GPU")
    try:
        args = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as e:                     # a bad argument (one line, above) or --help
        return int(e.code or 0)
    if args.load is not None:
        try:
            header, rows = read_json(args.load)
        except ResultFileError as e:
            print(f"{p.prog}: error: {e}", file=sys.stderr)
            return 2
    else:
        cp, why = usable_gpu()
        if cp is None:
            print(f"{p.prog}: error: bench needs a CUDA GPU: {why}; --load prints a saved "
                  f"results file without one", file=sys.stderr)
            return 2
        name = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["name"]
        header = {"gpu": name.decode() if isinstance(name, bytes) else str(name),
                  "cupy": cp.__version__, "torch": version_of("torch"),
                  "cuflash": cuflash_version(), "command": "python -m cuflash bench"}
        rows = run_short(args.budget)
        if args.json is not None:
            write_json(args.json, header, rows)
    print(f"\nTFLOP/s on {header.get('gpu', '?')} (fwd 4*B*H*L*L*d FLOPs, /2 causal; fwd_bwd "
          f"3.5x; - = skipped or not run):\n{format_table(rows)}")
    if args.plot is not None and plot(rows, args.plot, str(header.get("gpu", ""))):
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0
