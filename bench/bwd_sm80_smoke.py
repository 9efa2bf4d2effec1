"""Smoke test and first timing of the tensor-core backward (cuda_src/bwd_sm80.cu) on one GPU.

    PYTHONPATH=. python bench/bwd_sm80_smoke.py [--simt] [--reps 10]

1. Correctness: bwd_sm80 against cuflash.reference.attention_backward (float64) on a few
   shapes (bf16 and fp16, causal and not, ragged, GQA, rows without keys, deterministic),
   with the tolerance of the GPU tests (tests/_tolerance_bwd.py: 3x the naive same-dtype
   backward's error plus a floor). Prints, per case, the kernel that ran, the max relative
   error of dq, dk, dv (max |g - ref| / max |ref|) and PASS or FAIL; deterministic cases
   also check two runs are bitwise equal. Exits 1 if any case fails.
2. Timing: forward + backward, bf16, B*L = 16k tokens, H*d = 2048, d in {64, 128},
   L in {1024, 4096}, causal and not, on random normal inputs; CUDA-event medians after a
   warm-up; PyTorch SDPA's FlashAttention backend on the same inputs (DLPack, zero copy)
   when torch imports. FLOPs: 3.5 x the forward's 4*B*H*L*L*d (halved under causal).
   ``--simt`` also times the generic backward (CUFLASH_BWD=simt; slow, adds ~30 s).

The first call of each specialisation compiles it (NVRTC, a few seconds each).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))   # the tolerance rule of the GPU tests

import cupy  # noqa: E402

import cuflash  # noqa: E402
from cuflash import _launch_bwd, _problem  # noqa: E402

BF16 = numpy.dtype(ml_dtypes.bfloat16)
F16 = numpy.dtype(numpy.float16)

# name: (dtype, q shape, k shape, v shape, causal, deterministic)
CASES = [
    ("bf16 d64 full", BF16, (2, 4, 512, 64), (2, 4, 512, 64), (2, 4, 512, 64), False, False),
    ("fp16 d128 causal", F16, (2, 4, 512, 128), (2, 4, 512, 128), (2, 4, 512, 128), True, False),
    ("bf16 d72 GQA ragged causal", BF16, (2, 2, 3, 333, 72), (2, 2, 1, 517, 72), (2, 2, 1, 517, 72), True, False),
    ("fp16 d96 no-key rows", F16, (1, 8, 700, 96), (1, 8, 300, 96), (1, 8, 300, 96), True, False),
    ("bf16 d111 top_left", BF16, (2, 4, 200, 111), (2, 4, 333, 111), (2, 4, 333, 111), "top_left", False),
    ("fp16 d32 dv64", F16, (4, 4, 256, 32), (4, 4, 300, 32), (4, 4, 300, 64), False, False),
    ("bf16 d64 causal deterministic", BF16, (2, 8, 1024, 64), (2, 8, 1024, 64), (2, 8, 1024, 64), True, True),
    ("fp16 d128 GQA deterministic", F16, (1, 2, 4, 384, 128), (1, 2, 1, 640, 128), (1, 2, 1, 640, 128), False, True),
]


def _spy():
    """Record the main kernel source of each backward call."""
    seen = []
    choose = _launch_bwd.choose

    def spy(*args, **kwargs):
        launch = choose(*args, **kwargs)
        seen.append(launch.source)
        return launch

    _launch_bwd.choose = spy
    return seen


def correctness(cases=CASES, expected=lambda d, dv, det: "bwd_sm80") -> bool:
    """Each case against the float64 reference; ``expected(d, dv, deterministic)`` names the
    kernel that must have run (bench/bwd_sm90_probe.py passes its own)."""
    from _tolerance_bwd import assert_gradients_close
    seen = _spy()
    ok_all = True
    print(f"{'case':32s} {'kernel':12s} {'rel dq':>9s} {'rel dk':>9s} {'rel dv':>9s}  verdict")
    for i, (name, dtype, qs, ks, vs, causal, det) in enumerate(cases):
        rng = numpy.random.default_rng(i)
        q, k, v = ((rng.standard_normal(s)).astype(dtype) for s in (qs, ks, vs))
        qd, kd, vd = (cupy.asarray(x) for x in (q, k, v))
        o, lse = cuflash.attention(qd, kd, vd, causal=causal, return_lse=True)
        do_host = rng.standard_normal(o.shape).astype(dtype)
        do = cupy.asarray(do_host)
        del seen[:]
        grads = cuflash.attention_backward(do, qd, kd, vd, o, lse, causal=causal, deterministic=det)
        cupy.cuda.Device().synchronize()
        kernel = seen[0].removesuffix(".cu") if seen else "?"
        ref = cuflash.reference.attention_backward(do_host, q, k, v, causal=causal)
        rel = [float(numpy.abs(cupy.asnumpy(g).astype(numpy.float64) - r).max() / max(numpy.abs(r).max(), 1e-30))
               for g, r in zip(grads, ref)]
        problems = []
        want = expected(qs[-1], vs[-1], det)
        if kernel != want:
            problems.append(f"ran {kernel}, expected {want}")
        try:
            prob = _problem.make_problem(qd, kd, vd, scale=None, causal=causal)
            assert_gradients_close(prob, do, grads, ref, (q.shape, k.shape, v.shape))
        except AssertionError as exc:
            problems.append(str(exc).splitlines()[0][:200])
        if det:
            again = cuflash.attention_backward(do, qd, kd, vd, o, lse, causal=causal, deterministic=True)
            if not all(bool((a.view(numpy.uint16) == b.view(numpy.uint16)).all()) for a, b in zip(grads, again)):
                problems.append("deterministic runs differ")
        verdict = "PASS" if not problems else "FAIL: " + "; ".join(problems)
        ok_all &= not problems
        print(f"{name:32s} {kernel:12s} {rel[0]:9.2e} {rel[1]:9.2e} {rel[2]:9.2e}  {verdict}", flush=True)
    return ok_all


def _median_ms(fn, reps: int) -> float:
    fn()
    fn()
    ts = []
    for _ in range(reps):
        a, b = cupy.cuda.Event(), cupy.cuda.Event()
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(cupy.cuda.get_elapsed_time(a, b))
    return float(numpy.median(ts))


def timing(reps: int, with_simt: bool) -> None:
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except Exception as exc:   # no torch here: cuflash alone
        torch = None
        print(f"\n(torch not importable, no SDPA column: {type(exc).__name__}: {exc})")
    rows = []
    for d in (64, 128):
        for L in (1024, 4096):
            B, H = 16384 // L, 2048 // d
            rng = cupy.random.default_rng(0)
            q, k, v, do = (rng.standard_normal((B, H, L, d), dtype=numpy.float32).astype(BF16)
                           for _ in range(4))
            for causal in (False, True):
                flops = 3.5 * 4 * B * H * L * L * d / (2 if causal else 1)

                def fwd_bwd():
                    o, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
                    cuflash.attention_backward(do, q, k, v, o, lse, causal=causal)

                t_cf = _median_ms(fwd_bwd, reps)
                t_simt = None
                if with_simt:
                    os.environ["CUFLASH_BWD"] = "simt"
                    t_simt = _median_ms(fwd_bwd, max(3, reps // 3))
                    del os.environ["CUFLASH_BWD"]
                t_sdpa = None
                if torch is not None:
                    tq, tk, tv = (torch.from_dlpack(x).requires_grad_() for x in (q, k, v))
                    tdo = torch.from_dlpack(do)

                    def sdpa():
                        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                            o = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
                        torch.autograd.grad(o, (tq, tk, tv), tdo)

                    try:
                        torch.cuda.synchronize()
                        t_sdpa = _median_ms(sdpa, reps)
                    except Exception as exc:
                        print(f"SDPA flash failed at d={d} L={L}: {type(exc).__name__}: {exc}")
                rows.append((d, L, causal, t_cf, flops / t_cf / 1e9, t_simt, t_sdpa,
                             None if t_sdpa is None else flops / t_sdpa / 1e9))
                print(f"  timed d={d} L={L} causal={causal}", flush=True)
    print(f"\nforward + backward, bf16, B*L = 16384, H*d = 2048 (TFLOP/s = 3.5 x 4BHL^2d / time, /2 causal)")
    head = f"{'d':>4s} {'L':>5s} {'causal':>6s} {'cuflash ms':>10s} {'TFLOP/s':>8s}"
    head += f" {'simt ms':>8s}" if with_simt else ""
    head += f" {'sdpa ms':>8s} {'TFLOP/s':>8s} {'cuflash/sdpa':>12s}"
    print(head)
    for d, L, c, t, tf, ts, tsd, tfsd in rows:
        line = f"{d:4d} {L:5d} {str(c):>6s} {t:10.3f} {tf:8.1f}"
        line += f" {ts:8.2f}" if with_simt else ""
        line += (f" {tsd:8.3f} {tfsd:8.1f} {tsd / t:12.2f}" if tsd else f" {'-':>8s} {'-':>8s} {'-':>12s}")
        print(line)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--simt", action="store_true", help="also time CUFLASH_BWD=simt")
    ap.add_argument("--no-timing", action="store_true")
    a = ap.parse_args()
    dev = cupy.cuda.Device()
    print(f"GPU: {cupy.cuda.runtime.getDeviceProperties(dev.id)['name'].decode()} "
          f"(sm_{dev.compute_capability}), cupy {cupy.__version__}")
    start = time.time()
    ok = correctness()
    print(f"correctness: {'all PASS' if ok else 'FAILURES'} ({time.time() - start:.0f} s)")
    if not a.no_timing:
        timing(a.reps, a.simt)
    print(f"total {time.time() - start:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
