"""``python -m cuflash demo|bench|check|info|fuzz``.

demo   run cuflash.attention on random inputs (GPU if one is usable, else the NumPy CPU path),
       check it against the float64 reference and print errors and times; exit 1 on failure
bench  a short benchmark on this GPU (cuflash/_bench.py; the lab harness is bench/bench_attention.py)
check  the offline compile gate: every kernel specialisation through NVRTC for the given
       architectures, no GPU needed; exit 1 on any error, spill or stack use
info   versions, kernel source directory, devices; info --explain SHAPE: the kernel a call runs
fuzz   a correctness campaign against the float64 reference (``python -m cuflash fuzz --help``)
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Sequence

from cuflash._check import (DEFAULT_ARCHS, UsageError, check_failed,  # noqa: F401
                            cmd_check, format_check_table, gate_function, run_check_all,
                            targetable_archs)
from cuflash._cli_common import (gpu_unavailable_reason, short_error as _short,  # noqa: F401
                                 usable_gpu)


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
        print("times: median of 3 calls on the host (the blocked CPU path, threads over tiles).")
    if failures:
        print(f"demo FAILED: {failures} case(s)")
        return 1
    print("demo passed")
    return 0


# ---------------------------------------------------------------------------------------------
# info
# ---------------------------------------------------------------------------------------------

def cmd_explain(args) -> int:
    """``info --explain Q_SHAPE [K_SHAPE [V_SHAPE]]``: the dispatcher's choice and its reasons
    (``cuflash.explain``), for a device profile or a GPU id; no GPU needed for a profile."""
    import numpy as np
    import cuflash

    def shape(text: str) -> tuple[int, ...]:
        try:
            dims = tuple(int(x) for x in text.replace("x", ",").strip("()").split(",") if x)
        except ValueError:
            raise UsageError(f"--explain takes shapes like 4,16,1024,128, got {text!r}") from None
        if len(dims) < 2 or min(dims) < 0:
            raise UsageError(f"a shape needs at least (length, head_dim), got {text!r}")
        return dims
    shapes = [shape(t) for t in args.explain]
    if len(shapes) > 3:
        raise UsageError("--explain takes at most three shapes: q, k and v")
    q_shape = shapes[0]
    k_shape = shapes[1] if len(shapes) > 1 else q_shape
    v_shape = shapes[2] if len(shapes) > 2 else k_shape
    dtype = _dtype({"bf16": "bfloat16", "fp16": "float16", "fp32": "float32",
                    "fp64": "float64"}.get(args.dtype, args.dtype))
    zero = np.zeros((), dtype)              # stride-0 views: no memory behind the shapes
    q, k, v = (np.broadcast_to(zero, s) for s in (q_shape, k_shape, v_shape))
    causal = {"false": False, "true": True}.get(args.causal, args.causal)
    device = int(args.gpu) if args.gpu.isdigit() else args.gpu
    if isinstance(device, int):               # a real GPU: say why it is not usable, in one line
        cupy, why = usable_gpu()
        if cupy is None:
            raise UsageError(f"--gpu {device}: {why}; a device profile needs no GPU "
                             f"(--gpu h200, h100, a100, l40s or v100)")
        count = cupy.cuda.runtime.getDeviceCount()
        if device >= count:
            raise UsageError(f"--gpu {device}: there is no such device; this machine has {count}")
    try:
        print(cuflash.explain(q, k, v, causal=causal, backward=args.backward,
                              deterministic=args.deterministic, device=device,
                              enable_gqa=args.enable_gqa))
    except (TypeError, ValueError) as e:
        raise UsageError(_short(e)) from None
    return 0


def cmd_info(args) -> int:
    if args.explain:
        return cmd_explain(args)
    import platform
    from cuflash._cli_common import cuflash_version, version_of
    rows = [("cuflash", cuflash_version()), ("python", platform.python_version())]
    for dist in ("numpy", "ml_dtypes"):
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
        why = gpu_unavailable_reason(cupy)
        if why:
            devices.append(why)
        try:
            for i in range(0 if why else rt.getDeviceCount()):
                p = rt.getDeviceProperties(i)
                name = p["name"].decode() if isinstance(p["name"], bytes) else p["name"]
                devices.append(f"device {i}: {name}, compute capability {p['major']}.{p['minor']}"
                               f", {p['multiProcessorCount']} SMs, "
                               f"{p['totalGlobalMem'] / 2**30:.1f} GiB")
        except Exception as e:
            devices.append(f"no usable device ({_short(e)})")
    except ImportError:
        rows.append(("cupy", "not installed: the CPU path only (pip install \"cuflash[cuda13]\" "
                             "or \"cuflash[cuda12]\" for the GPU)"))
    except Exception as e:
        rows.append(("cupy", f"not usable ({_short(e)})"))
    for dist in ("torch", "jax"):
        v = version_of(dist)
        if v:
            rows.append((dist, v))
    w = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{w}}  {v}")
    for line in devices or ["no CUDA GPU found"]:
        print(line)
    return 0


# ---------------------------------------------------------------------------------------------

def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


class _Parser(argparse.ArgumentParser):
    """argparse, with errors as one line (exit 2) instead of usage plus error."""

    def error(self, message: str):
        raise UsageError(f"{message} (see {self.prog} --help)")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m cuflash", description="cuflash command line")
    from cuflash._cli_common import cuflash_version
    p.add_argument("--version", action="version", version=f"cuflash {cuflash_version()}")
    sub = p.add_subparsers(dest="cmd", metavar="{demo,bench,check,info,fuzz}")
    d = sub.add_parser("demo", help="run and check cuflash.attention on random inputs")
    d.add_argument("--cpu", action="store_true", help="use the NumPy CPU path even with a GPU")
    d.add_argument("--seed", type=_non_negative_int, default=0)
    sub.add_parser("bench", help="benchmark suite (options: python -m cuflash bench --help)",
                   add_help=False)
    c = sub.add_parser("check", help="offline compile gate (NVRTC, no GPU needed)")
    c.add_argument("--arch", action="append", default=None,
                   help=f"target such as sm_80 or sm_90a; repeat for several "
                        f"(default: {' '.join(DEFAULT_ARCHS)})")
    i = sub.add_parser("info", help="versions, kernel sources, devices; --explain: which kernel "
                                    "a call runs and why")
    i.add_argument("--explain", nargs="+", metavar="SHAPE",
                   help="q's shape (k's and v's, if they differ), e.g. 4,16,1024,128: print the "
                        "kernel family, tiles and reasons the dispatcher picks")
    i.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32", "fp64"])
    i.add_argument("--causal", default="false", choices=["false", "true", "top_left"])
    i.add_argument("--backward", action="store_true", help="explain attention_backward")
    i.add_argument("--deterministic", action="store_true")
    i.add_argument("--enable-gqa", action="store_true")
    i.add_argument("--gpu", default="h200",
                   help="a device profile (h200, h100, a100, l40s, v100) or a GPU id (default h200)")
    sub.add_parser("fuzz", help="correctness campaign against the float64 reference (options: "
                               "python -m cuflash fuzz --help)", add_help=False)
    return p


def _bench(argv: list[str]) -> int:
    """The suite's own main (cuflash/_bench.py); a bad argument or file is one line, exit 2."""
    from cuflash._bench import main as bench_main
    try:
        return bench_main(argv)
    except OSError as e:                       # a file it cannot read (--load) or write
        name = e.filename or ""
        raise UsageError(f"cannot open {name}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise UsageError(f"not a JSON file: {e}") from None
    except KeyError as e:                      # --load of a JSON without the suite's fields
        raise UsageError(f"not a cuflash benchmark result (no {e} field)") from None
    except (TypeError, ValueError) as e:
        raise UsageError(f"bad benchmark input: {_short(e)}") from None


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] == "bench":        # everything after `bench` is the suite's
            return _bench(argv[1:])
        if argv and argv[0] == "fuzz":         # correctness campaign (cuflash/_fuzz.py)
            from cuflash._fuzz import main as fuzz_main
            try:
                return fuzz_main(argv[1:])
            except OSError as e:               # --report in a folder that does not exist, ...
                raise UsageError(f"fuzz: cannot write {e.filename or ''}: "
                                 f"{e.strerror or _short(e)}") from None
        parser = build_parser()
        args = parser.parse_args(argv)
        if args.cmd is None:
            parser.print_help()
            return 2
        return {"demo": cmd_demo, "check": cmd_check, "info": cmd_info}[args.cmd](args)
    except UsageError as e:
        print(f"python -m cuflash: error: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:                    # --help, --version: argparse printed them
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except KeyboardInterrupt:
        print("python -m cuflash: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:                    # `python -m cuflash demo | head`: stop quietly
        try:                                   # and keep Python's exit flush from failing too
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):          # a stdout without a file descriptor (tests)
            pass
        return 1


if __name__ == "__main__":
    sys.exit(main())
