"""Correctness smoke and tile sweep of the Hopper backward (cuda_src/bwd_sm90.cu) on one H200.

    PYTHONPATH=. python bench/bwd_sm90_probe.py [--variants 64:64:2:1,64:128:2:1] [--reps 10]

1. Correctness: bench/bwd_sm80_smoke.py's cases (ragged, GQA, rows without keys, d not a
   multiple of 8, deterministic) plus d = 64 / 128 cases that cross several key and query
   tiles, each against the float64 reference with the GPU tests' tolerance (GQA cases take
   the float32 dk, dv buffers, the others bwd_sm90's direct bf16/fp16 output); the kernel that
   ran must be bwd_sm90 where the dispatcher should pick it (else bwd_sm80). Every tile
   variant of --variants is checked on the d = 64 / 128 cases too.
2. Timing, bf16 on random normal inputs: backward alone (o and lse from one forward) and
   forward + backward, for bwd_sm90 with the table's tiles and each tile variant
   (CUFLASH_BWD_SM90_TILES), bwd_sm80
   (CUFLASH_BWD=sm80) and PyTorch SDPA flash in the same process; CUDA-event medians.
   B*L = 16k tokens and H*d = 2048 at L = 1k and 4k, B = 1 at 16k. TFLOP/s: backward 2.5x,
   forward + backward 3.5x the forward's 4 B H L^2 d, halved under causal.
Prints tables and writes --json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

import cupy  # noqa: E402

import cuflash  # noqa: E402
from bwd_sm80_smoke import BF16, F16, CASES as SM80_CASES, _median_ms  # noqa: E402
from bwd_sm80_smoke import correctness as smoke_correctness  # noqa: E402

EXTRA = [
    ("bf16 d128 2 key tiles causal", BF16, (2, 3, 700, 128), (2, 3, 700, 128), (2, 3, 700, 128), True, False),
    ("fp16 d64 ragged full", F16, (2, 3, 333, 64), (2, 3, 517, 64), (2, 3, 517, 64), False, False),
    ("bf16 d64 GQA causal", BF16, (1, 2, 4, 600, 64), (1, 2, 1, 600, 64), (1, 2, 1, 600, 64), True, False),
    ("bf16 d100 dv128 ragged", BF16, (2, 2, 390, 100), (2, 2, 270, 100), (2, 2, 270, 128), True, False),
    ("fp16 d48 Lq<Lk top_left", F16, (2, 2, 130, 48), (2, 2, 450, 48), (2, 2, 450, 48), "top_left", False),
    ("bf16 d64 324 tiles top_left", BF16, (4, 9, 200, 64), (4, 9, 1100, 64), (4, 9, 1100, 64), "top_left", False),
    ("fp16 d64 216 tiles causal", F16, (4, 9, 700, 64), (4, 9, 700, 64), (4, 9, 700, 64), True, False),
    ("bf16 d128 216 tiles causal", BF16, (4, 9, 700, 128), (4, 9, 700, 128), (4, 9, 700, 128), True, False),
]


def expected(d: int, dv: int, det: bool) -> str:
    if 33 <= max(d, dv) <= 128 and not det and os.environ.get("CUFLASH_BWD", "") == "":
        return "bwd_sm90"
    return "bwd_sm80" if max(d, dv) <= 128 else "bwd_simt"


def correctness(cases) -> bool:
    return smoke_correctness(cases, expected)


def _with_env(env: dict, fn):
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update({k: v for k, v in env.items() if v is not None})
    for k, v in env.items():
        if v is None:
            os.environ.pop(k, None)
    try:
        return fn()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def timing(variants, reps: int, lengths) -> list[dict]:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    rows = []
    for d in (64, 128):
        for L in lengths:
            B, H = max(1, 16384 // L), 2048 // d
            rng = cupy.random.default_rng(0)
            q, k, v, do = (rng.standard_normal((B, H, L, d), dtype=numpy.float32).astype(BF16) for _ in range(4))
            for causal in (False, True):
                f = 4 * B * H * L * L * d / (2 if causal else 1)
                o, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
                impls = {"sm90": {"CUFLASH_BWD": None, "CUFLASH_BWD_SM90_TILES": None}}
                impls.update({f"sm90 {s}": {"CUFLASH_BWD": None, "CUFLASH_BWD_SM90_TILES": s}
                              for s in variants if int(s.split(":")[0]) == d})
                if causal:   # batch-major instead of the default tile-major order
                    impls["sm90 order0"] = {"CUFLASH_BWD": None, "CUFLASH_BWD_SM90_TILES": None,
                                            "CUFLASH_GRID_ORDER": "0"}
                impls["sm80"] = {"CUFLASH_BWD": "sm80", "CUFLASH_BWD_SM90_TILES": None}
                row = {"d": d, "L": L, "causal": causal, "B": B, "H": H}
                for name, env in impls.items():
                    bwd = lambda: cuflash.attention_backward(do, q, k, v, o, lse, causal=causal)   # noqa: E731

                    def fb():
                        o2, lse2 = cuflash.attention(q, k, v, causal=causal, return_lse=True)
                        cuflash.attention_backward(do, q, k, v, o2, lse2, causal=causal)
                    tb = _with_env(env, lambda: _median_ms(bwd, reps))
                    tfb = _with_env(env, lambda: _median_ms(fb, reps))
                    row[name] = {"bwd_tflops": 2.5 * f / tb / 1e9, "fwd_bwd_tflops": 3.5 * f / tfb / 1e9}
                tq, tk, tv = (torch.from_dlpack(x).requires_grad_() for x in (q, k, v))
                tdo = torch.from_dlpack(do)

                def sdpa():
                    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                        out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
                    torch.autograd.grad(out, (tq, tk, tv), tdo)
                torch.cuda.synchronize()
                row["sdpa_flash"] = {"fwd_bwd_tflops": 3.5 * f / _median_ms(sdpa, reps) / 1e9}
                rows.append(row)
                base = row["sdpa_flash"]["fwd_bwd_tflops"]
                cells = "  ".join(f"{n}: bwd {r['bwd_tflops']:.0f} fb {r['fwd_bwd_tflops']:.0f} ({r['fwd_bwd_tflops'] / base:.2f})"
                                  for n, r in row.items() if isinstance(r, dict) and "bwd_tflops" in r)
                print(f"d={d:3d} L={L:5d} causal={causal!s:5s} sdpa fb {base:.0f} | {cells}", flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default="", help="tile overrides to time besides the table's")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--lengths", default="1024,4096,16384")
    ap.add_argument("--no-timing", action="store_true")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    variants = [s for s in a.variants.split(",") if s]
    start = time.time()
    ok = correctness(SM80_CASES + EXTRA)
    for s in variants:
        print(f"-- tiles {s}")
        ok &= _with_env({"CUFLASH_BWD_SM90_TILES": s}, lambda: correctness(EXTRA[:3] + EXTRA[-3:] + SM80_CASES[:2]))
    print(f"correctness: {'all PASS' if ok else 'FAILURES'} ({time.time() - start:.0f} s)", flush=True)
    rows = [] if a.no_timing else timing(variants, a.reps, [int(x) for x in a.lengths.split(",")])
    if a.json:
        Path(a.json).write_text(json.dumps({"ok": ok, "rows": rows}, indent=1))
    print(f"total {time.time() - start:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
