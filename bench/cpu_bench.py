"""The CPU path against naive NumPy (materialised softmax), side by side in one run.

    python bench/cpu_bench.py [--out bench/results/cpu/NAME.json] [--reps 5] [--quick]

For each case (B, H, L, d, dtype, causal) and direction it times, interleaved call by call so
that a busy machine slows both alike:

- ``cuflash``: ``cuflash.attention`` (forward) / ``cuflash.attention_backward`` (backward) on
  NumPy arrays, the blocked CPU path (cuflash/_numpy.py);
- ``naive``: the obvious NumPy code in the same dtype, with the L x L matrix materialised:
  forward ``s = (q * scale) @ k^T; p = softmax(s); o = p @ v``; backward from the same
  arguments as attention_backward (q, k, v, o, lse, do): ``p = exp(s - lse)``,
  ``dv = p^T do``, ``ds = p * (do v^T - rowsum(do * o))``, ``dq = scale ds k``,
  ``dk = scale ds^T q``;
- ``naive_blas1``: the same naive code with NumPy's BLAS set to one thread (cuflash._blas),
  reported because a multi-threaded OpenBLAS can be much slower than one thread on a busy
  machine; the speedup column uses ``naive`` as it runs by default (as-is).

Times are medians of ``--reps`` calls after one warm-up. The JSON records the machine (CPU
count, load average before and after), NumPy's BLAS and the BLAS environment variables as
they were (OPENBLAS_CORETYPE and friends are left as the environment sets them).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

import numpy

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import cuflash  # noqa: E402
from cuflash import _blas  # noqa: E402

CASES = [  # (B, H, L, d, dtype, causal)
    (1, 8, 1024, 64, "float32", False),
    (1, 8, 2048, 64, "float32", False),
    (1, 8, 4096, 64, "float32", False),
    (1, 8, 2048, 64, "float32", True),
    (1, 8, 1024, 64, "float64", False),
    (1, 8, 2048, 64, "float64", False),
    (1, 8, 2048, 64, "float64", True),
    (1, 1, 2048, 64, "float32", False),
    (4, 8, 1024, 128, "float32", False),
]
QUICK = [(1, 8, 1024, 64, "float32", False), (1, 8, 1024, 64, "float64", False)]


def naive_forward(q, k, v, scale, causal):
    s = (q * q.dtype.type(scale)) @ k.swapaxes(-1, -2)
    if causal:
        L = s.shape[-1]
        s[..., numpy.triu_indices(L, 1)[0], numpy.triu_indices(L, 1)[1]] = -numpy.inf
    s -= s.max(axis=-1, keepdims=True)
    numpy.exp(s, out=s)
    s /= s.sum(axis=-1, keepdims=True)
    return s @ v


def naive_backward(do, q, k, v, o, lse, scale, causal):
    sc = q.dtype.type(scale)
    s = (q * sc) @ k.swapaxes(-1, -2)
    if causal:
        L = s.shape[-1]
        s[..., numpy.triu_indices(L, 1)[0], numpy.triu_indices(L, 1)[1]] = -numpy.inf
    s -= lse.astype(q.dtype)[..., None]
    p = numpy.exp(s, out=s)
    dv = p.swapaxes(-1, -2) @ do
    dp = do @ v.swapaxes(-1, -2)
    dp -= numpy.einsum("...c,...c->...", do, o)[..., None]
    dp *= p
    dq = (dp @ k) * sc
    dk = (dp.swapaxes(-1, -2) @ q) * sc
    return dq, dk, dv


def naive_blas1(fn):
    def run(*args):
        with _blas.single_threaded():
            return fn(*args)
    return run


def time_interleaved(fns: dict, reps: int) -> dict:
    for fn in fns.values():
        fn()  # warm-up
    times = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) * 1e3 for name, ts in times.items()}


def rel_err(a, b) -> float:
    a, b = numpy.asarray(a, numpy.float64), numpy.asarray(b, numpy.float64)
    return float(numpy.max(numpy.abs(a - b)) / max(numpy.max(numpy.abs(b)), 1e-300))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="JSON path (default: print only)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="two small cases (a smoke run)")
    args = p.parse_args(argv)
    load_before = os.getloadavg()
    rows = []
    print(f"{'case':<34} {'dir':<4} {'cuflash ms':>10} {'naive ms':>9} {'speedup':>7} "
          f"{'naive1 ms':>9} {'vs naive1':>9}")
    for B, H, L, d, dtype, causal in (QUICK if args.quick else CASES):
        rng = numpy.random.default_rng(0)
        q, k, v, do = (rng.standard_normal((B, H, L, d)).astype(dtype) for _ in range(4))
        scale = 1 / d ** 0.5
        o, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
        label = f"B={B} H={H} L={L} d={d} {dtype}{' causal' if causal else ''}"
        for direction in ("fwd", "bwd"):
            if direction == "fwd":
                fns = {"cuflash": lambda: cuflash.attention(q, k, v, causal=causal),
                       "naive": lambda: naive_forward(q, k, v, scale, causal),
                       "naive_blas1": lambda: naive_blas1(naive_forward)(q, k, v, scale, causal)}
                err = rel_err(o, naive_forward(q, k, v, scale, causal))
            else:
                fns = {"cuflash": lambda: cuflash.attention_backward(do, q, k, v, o, lse,
                                                                     causal=causal),
                       "naive": lambda: naive_backward(do, q, k, v, o, lse, scale, causal),
                       "naive_blas1": lambda: naive_blas1(naive_backward)(do, q, k, v, o, lse,
                                                                          scale, causal)}
                ours = cuflash.attention_backward(do, q, k, v, o, lse, causal=causal)
                theirs = naive_backward(do, q, k, v, o, lse, scale, causal)
                err = max(rel_err(a, b) for a, b in zip(ours, theirs))
            ms = time_interleaved(fns, args.reps)
            row = dict(B=B, H=H, L=L, d=d, dtype=dtype, causal=causal, direction=direction,
                       cuflash_ms=round(ms["cuflash"], 3), naive_ms=round(ms["naive"], 3),
                       naive_blas1_ms=round(ms["naive_blas1"], 3),
                       speedup_vs_naive=round(ms["naive"] / ms["cuflash"], 3),
                       speedup_vs_naive_blas1=round(ms["naive_blas1"] / ms["cuflash"], 3),
                       rel_diff_vs_naive=err)
            rows.append(row)
            print(f"{label:<34} {direction:<4} {ms['cuflash']:10.1f} {ms['naive']:9.1f} "
                  f"{row['speedup_vs_naive']:6.2f}x {ms['naive_blas1']:9.1f} "
                  f"{row['speedup_vs_naive_blas1']:8.2f}x", flush=True)
    blas = {}
    try:
        cfg = numpy.show_config(mode="dicts")
        blas = cfg.get("Build Dependencies", {}).get("blas", {})
    except Exception as e:  # older NumPy
        blas = {"error": str(e)}
    result = {
        "header": {
            "suite": "cpu",
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "cuflash": cuflash.__version__,
            "python": platform.python_version(),
            "numpy": numpy.__version__,
            "blas": blas,
            "blas_env": {k: v for k, v in os.environ.items()
                         if any(t in k for t in ("BLAS", "OMP", "MKL", "NVPL"))},
            "blas_threads_controllable": _blas.available(),
            "cpu": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(),
            "reps": args.reps,
            "note": "timings interleaved call by call; medians; naive = materialised softmax "
                    "in the same dtype; speedup = naive_ms / cuflash_ms",
        },
        "rows": rows,
    }
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
