"""``python -m cuflash demo|bench|check|info|fuzz``.

demo   run cuflash.attention on random inputs (GPU if one is usable, else the NumPy CPU path),
       check it against the float64 reference and print errors and times; exit 1 on failure
bench  the benchmark suite (cuflash/_bench.py; ``python -m cuflash bench --help``)
check  the offline compile gate: every kernel specialisation through NVRTC for the given
       architectures, no GPU needed; exit 1 on any error, spill or stack use
info   versions, kernel source directory, devices
fuzz   a correctness campaign against the float64 reference (``python -m cuflash fuzz --help``)
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from typing import Sequence

DEFAULT_ARCHS = ("sm_70", "sm_80", "sm_90a")


def _short(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def usable_gpu():
    """``(cupy, None)`` when CuPy imports and sees at least one device, else ``(None, why)``."""
    try:
        import cupy
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:        # no CuPy, no driver, no device: all mean "CPU path"
        return None, _short(e)
    if n <= 0:
        return None, "CUDA reports no device"
    return cupy, None


# ---------------------------------------------------------------------------------------------
# demo
# ---------------------------------------------------------------------------------------------

DEMO_CASES = (  # (dtype name, B, H, L, d, causal)
    ("float32", 2, 4, 512, 64, False),
    ("bfloat16", 2, 4, 512, 64, False),
    ("bfloat16", 2, 4, 512, 64, True),
)


def _dtype(name: str):
    import numpy as np
    if name == "bfloat16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def naive_model_error(q, k, v, ref, scale: float, causal: bool) -> float:
    """Relative max error of the naive same-dtype computation (matmul with float32
    accumulation rounded to the dtype, float32 softmax, probabilities rounded to the dtype,
    matmul), emulated on the host. The demo allows 2x this plus a small floor (DESIGN.md)."""
    import numpy as np
    dt = q.dtype

    def rnd(x):
        return x.astype(dt).astype(np.float32)
    f32 = [a.astype(np.float32) for a in (q, k, v)]
    s = rnd(f32[0] @ np.swapaxes(f32[1], -1, -2)) * np.float32(scale)
    if causal:
        Lq, Lk = s.shape[-2:]
        s = np.where(np.tril(np.ones((Lq, Lk), bool), k=Lk - Lq), s, np.float32(-np.inf))
    s -= s.max(axis=-1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(axis=-1, keepdims=True)
    o = rnd(rnd(p) @ f32[2])
    return rel_error(o, ref)


def rel_error(o, ref) -> float:
    """max |o - ref| / max |ref|, in float64."""
    import numpy as np
    o = np.asarray(o, dtype=np.float64)
    return float(np.max(np.abs(o - ref)) / max(np.max(np.abs(ref)), np.finfo(np.float64).tiny))


def threshold(dtype, naive_err: float) -> float:
    import ml_dtypes      # its finfo knows bfloat16 (eps 2^-7) as well as the NumPy floats
    return 2.0 * naive_err + 4.0 * float(ml_dtypes.finfo(dtype).eps)


def _median_ms(cp, fn, reps: int = 20) -> float:
    """Median of per-call CUDA-event times on CuPy's current stream, after one warm-up."""
    fn()
    cp.cuda.Device().synchronize()
    times = []
    for _ in range(reps):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(cp.cuda.get_elapsed_time(a, b))
    return sorted(times)[len(times) // 2]


def _median_host_ms(fn, reps: int = 3) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def _naive_ms(cp, q, k, v, scale: float, causal: bool) -> float | None:
    """Time of the naive CuPy computation (None, with a note, if CuPy cannot run it)."""
    from cuflash._bench import naive_attention
    L, Lk = q.shape[-2], k.shape[-2]
    try:
        bias = (cp.triu(cp.full((L, Lk), -cp.inf, dtype=cp.float32), k=Lk - L + 1)
                if causal else None)
        return _median_ms(cp, lambda: naive_attention(cp, q, k, v, scale, bias))
    except Exception as e:
        print(f"  (naive CuPy did not run: {_short(e)})")
        return None


def cmd_demo(args) -> int:
    import numpy as np
    import cuflash
    from cuflash import reference

    cp, why = (None, "--cpu given") if args.cpu else usable_gpu()
    if cp is not None:
        dev = cp.cuda.Device()
        props = cp.cuda.runtime.getDeviceProperties(dev.id)
        name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
        print(f"cuflash demo on GPU {dev.id}: {name} (compute capability "
              f"{props['major']}.{props['minor']}), CuPy arrays")
    else:
        print(f"cuflash demo on the CPU path with NumPy arrays (no usable GPU: {why})")

    rng = np.random.default_rng(args.seed)
    header = (f"{'case':<36} {'rel err':>9} {'naive err':>9} {'allowed':>9} "
              f"{'cuflash ms':>10}" + (f" {'naive ms':>9}" if cp is not None else "") + "  result")
    print(header)
    print("-" * len(header))
    failures = 0
    for dname, B, H, L, d, causal in DEMO_CASES:
        dt = _dtype(dname)
        shape = (B, H, L, d)
        q, k, v = (rng.standard_normal(shape, dtype=np.float32).astype(dt) for _ in range(3))
        scale = 1.0 / math.sqrt(d)
        ref = np.asarray(reference.attention(q.astype(np.float64), k.astype(np.float64),
                                             v.astype(np.float64), scale=scale, causal=causal))
        naive_err = naive_model_error(q, k, v, ref, scale, causal)
        allowed = threshold(dt, naive_err)
        label = f"{dname} B={B} H={H} L={L} d={d}{' causal' if causal else ''}"
        naive_ms = None
        try:
            if cp is not None:
                qd, kd, vd = cp.asarray(q), cp.asarray(k), cp.asarray(v)

                def run():
                    return cuflash.attention(qd, kd, vd, scale=scale, causal=causal)
                o = cp.asnumpy(run())
                ms = _median_ms(cp, run)
                naive_ms = _naive_ms(cp, qd, kd, vd, scale, causal)
            else:
                o = cuflash.attention(q, k, v, scale=scale, causal=causal)
                ms = _median_host_ms(lambda: cuflash.attention(q, k, v, scale=scale,
                                                               causal=causal))
        except Exception as e:
            failures += 1
            print(f"{label:<36} FAILED: {_short(e)}")
            continue
        err = rel_error(o, ref)
        ok = bool(np.all(np.isfinite(np.asarray(o, dtype=np.float64)))) and err <= allowed
        failures += not ok
        line = f"{label:<36} {err:9.2e} {naive_err:9.2e} {allowed:9.2e} {ms:10.3f}"
        if cp is not None:
            line += f" {naive_ms:9.3f}" if naive_ms is not None else f" {'-':>9}"
        print(line + ("  ok" if ok else "  FAIL"))
    print()
    print("rel err = max|o - ref| / max|ref| against cuflash.reference (float64); allowed = "
          "2 x the naive same-dtype error + 4 eps.")
    if cp is not None:
        print("times: median of 20 calls, CUDA events; naive = matmul, float32 softmax, matmul "
              "in CuPy.")
    else:
        print("times: median of 3 calls on the host (the CPU path is a specification, not a "
              "fast path).")
    if failures:
        print(f"demo FAILED: {failures} case(s)")
        return 1
    print("demo passed")
    return 0


# ---------------------------------------------------------------------------------------------
# info
# ---------------------------------------------------------------------------------------------

def cmd_info(args) -> int:
    import platform
    from cuflash._bench import cuflash_version, version_of
    rows = [("cuflash", cuflash_version()), ("python", platform.python_version())]
    for dist in ("numpy", "scipy", "ml_dtypes"):
        rows.append((dist, version_of(dist) or "not installed"))
    try:
        from cuflash._paths import cuda_src_dir
        src = cuda_src_dir()
        n = len(list(src.glob("*.cu"))) + len(list(src.glob("*.cuh")))
        rows.append(("kernel sources", f"{src} ({n} files)"))
    except Exception as e:
        rows.append(("kernel sources", f"not found: {_short(e)}"))
    devices = []
    try:
        import cupy
        rows.append(("cupy", cupy.__version__))
        rt = cupy.cuda.runtime

        def ver(v: int) -> str:
            return f"{v // 1000}.{v % 1000 // 10}" if v else "none"
        try:
            rows.append(("CUDA runtime", ver(rt.runtimeGetVersion())))
        except Exception as e:
            rows.append(("CUDA runtime", f"unavailable ({_short(e)})"))
        try:
            rows.append(("CUDA driver", ver(rt.driverGetVersion())))
        except Exception as e:
            rows.append(("CUDA driver", f"unavailable ({_short(e)})"))
        try:
            rows.append(("NVRTC", ".".join(map(str, cupy.cuda.nvrtc.getVersion()))))
        except Exception as e:
            rows.append(("NVRTC", f"unavailable ({_short(e)})"))
        try:
            for i in range(rt.getDeviceCount()):
                p = rt.getDeviceProperties(i)
                name = p["name"].decode() if isinstance(p["name"], bytes) else p["name"]
                devices.append(f"device {i}: {name}, compute capability {p['major']}.{p['minor']}"
                               f", {p['multiProcessorCount']} SMs, "
                               f"{p['totalGlobalMem'] / 2**30:.1f} GiB")
        except Exception as e:
            devices.append(f"no usable device ({_short(e)})")
    except Exception as e:
        rows.append(("cupy", f"not usable ({_short(e)})"))
    for dist in ("torch", "jax"):
        v = version_of(dist)
        if v:
            rows.append((dist, v))
    w = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{w}}  {v}")
    for line in devices or ["no CUDA device"]:
        print(line)
    return 0


# ---------------------------------------------------------------------------------------------
# check
# ---------------------------------------------------------------------------------------------

def _cell(x) -> str:
    return "-" if x is None else str(x)


def format_check_table(reports) -> str:
    header = ["arch", "source", "regs", "spill st", "spill ld", "stack", "smem", "hmma",
              "status", "specialisation"]
    body = []
    for r in reports:
        if r.error:
            status = "ERROR"
        elif r.spill_stores or r.spill_loads:
            status = "SPILL"
        elif r.stack:
            status = "STACK"
        else:
            status = "ok"
        body.append([r.arch, r.source, _cell(r.registers), _cell(r.spill_stores),
                     _cell(r.spill_loads), _cell(r.stack), _cell(r.shared), _cell(r.hmma),
                     status, r.expr])
    widths = [max([len(h)] + [len(row[i]) for row in body]) for i, h in enumerate(header)]
    fmt = lambda cells: "  ".join(  # noqa: E731
        c.ljust(w) if i in (0, 1, 8, 9) else c.rjust(w)
        for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
    return "\n".join([fmt(header), fmt(["-" * w for w in widths])] + [fmt(r) for r in body])


def check_failed(r) -> bool:
    return bool(r.error or r.spill_stores or r.spill_loads or r.stack)


def cmd_check(args) -> int:
    archs = args.arch or list(DEFAULT_ARCHS)
    try:
        from cuflash._jit import check_all
    except Exception as e:        # ImportError, or the lead's module not there yet
        print(f"compile gate unavailable: {_short(e)}", file=sys.stderr)
        return 2
    reports = list(check_all(archs))
    if not reports:
        print(f"compile gate: nothing to compile for {', '.join(archs)}", file=sys.stderr)
        return 1
    print(format_check_table(reports))
    bad = [r for r in reports if check_failed(r)]
    # Compile errors, each distinct log once (one bug usually breaks many specialisations).
    by_error: dict[str, list] = {}
    for r in bad:
        if r.error:
            by_error.setdefault(str(r.error).strip(), []).append(r)
    for text, rs in by_error.items():
        more = f" and {len(rs) - 1} more" if len(rs) > 1 else ""
        print(f"\n{rs[0].arch} {rs[0].source} {rs[0].expr}{more}:\n  "
              + "\n  ".join(text.splitlines()[:20]))
    print()
    print(f"{len(reports)} compilations ({', '.join(archs)}): "
          + ("all ok, 0 bytes spilled, 0 bytes stack" if not bad else f"{len(bad)} failed"))
    return 1 if bad else 0


# ---------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m cuflash", description="cuflash command line")
    sub = p.add_subparsers(dest="cmd", metavar="{demo,bench,check,info}")
    d = sub.add_parser("demo", help="run and check cuflash.attention on random inputs")
    d.add_argument("--cpu", action="store_true", help="use the NumPy CPU path even with a GPU")
    d.add_argument("--seed", type=int, default=0)
    sub.add_parser("bench", help="benchmark suite (options: python -m cuflash bench --help)",
                   add_help=False)
    c = sub.add_parser("check", help="offline compile gate (NVRTC, no GPU needed)")
    c.add_argument("--arch", action="append", default=None,
                   help=f"target such as sm_80 or sm_90a; repeat for several "
                        f"(default: {' '.join(DEFAULT_ARCHS)})")
    sub.add_parser("info", help="versions, kernel sources, devices")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":           # everything after `bench` is the suite's
        from cuflash._bench import main as bench_main
        return bench_main(argv[1:])
    if argv and argv[0] == "fuzz":            # correctness campaign (cuflash/_fuzz.py)
        from cuflash._fuzz import main as fuzz_main
        return fuzz_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.cmd is None:
        parser.print_help()
        return 2
    return {"demo": cmd_demo, "check": cmd_check, "info": cmd_info}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
