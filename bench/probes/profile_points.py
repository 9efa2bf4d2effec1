#!/usr/bin/env python3
"""Question (session 8): where does the time of the slow modifier and decode points go?

Runs ONE point of bench/suite_mods.py / bench/suite_decode.py (bf16, the suites' shapes) three
times, so that Nsight Compute can profile the third launch of one kernel:

    ncu --clock-control none -k regex:fwd_sm90 --launch-skip 2 -c 1 --section ... \\
        python bench/probes/profile_points.py document fwd

Points: plain | softcap | alibi | window | document | prefix (block masks as the suite's
``cuflash_block_mask`` rows) | bias | awindow (the analytic ``window=`` keyword, causal, the
suite's own cuflash row) | causal (plain causal attention), each ``fwd`` or ``fwd_bwd`` (d 128, L 4k, B 4, H 16);
``decode B Lk`` (Hq 32 / Hkv 8, d 128, dense cache). ``--time`` instead prints the median
CUDA-event ms of 20 calls (no profiler).
"""
from __future__ import annotations

import argparse
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[1]))   # bench/


def mods_call(name: str, mode: str, L: int, d: int):
    import cupy
    import ml_dtypes
    import numpy
    import cuflash
    import suite_mods
    H, B = 16, suite_mods.TOKENS // L
    rng = numpy.random.default_rng(0)
    bf16 = numpy.dtype(ml_dtypes.bfloat16)
    q, k, v, do = (cupy.asarray(rng.standard_normal((B, H, L, d)).astype(bf16)) for _ in range(4))
    if name == "causal":
        kw = dict(causal=True)
    elif name in ("window", "document", "prefix"):
        mod = suite_mods.mods_for(L, H)[name]
        kw = dict(block_mask=cuflash.block_mask(mod.mask_mod, (1, 1), L, L), causal=mod.mask_causal)
    else:
        mod = suite_mods.mods_for(L, H)["window" if name == "awindow" else name]
        bias = cupy.asarray((rng.standard_normal((H, L, L)) * 0.5).astype(bf16)) if name == "bias" else None
        kw = suite_mods.cuflash_kwargs(mod, L, H, cupy, bias=bias)
    if mode == "fwd":
        return lambda: cuflash.attention(q, k, v, **kw)
    return lambda: cuflash.attention_vjp(q, k, v, **kw)[1](do)


def decode_call(B: int, Lk: int):
    import cupy
    import ml_dtypes
    import numpy
    import cuflash
    Hq, Hkv, d = 32, 8, 128
    rng = numpy.random.default_rng(0)
    bf16 = numpy.dtype(ml_dtypes.bfloat16)
    # GQA: q (B, Hkv, G, 1, d) against a cache (B, Hkv, 1, Lk, d)
    q = cupy.asarray(rng.standard_normal((B, Hkv, Hq // Hkv, 1, d)).astype(bf16))
    kc = cupy.random.standard_normal((B, Hkv, 1, Lk, d), numpy.float32).astype(bf16)
    vc = cupy.random.standard_normal((B, Hkv, 1, Lk, d), numpy.float32).astype(bf16)
    lens = cupy.full((B,), Lk, cupy.int32)
    return lambda: cuflash.attention_with_kvcache(q, kc, vc, cache_seqlens=lens)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("point", nargs="+")
    ap.add_argument("--L", type=int, default=4096)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--time", action="store_true")
    a = ap.parse_args(argv)
    if a.point[0] == "decode":
        fn = decode_call(int(a.point[1]), int(a.point[2]))
    else:
        fn = mods_call(a.point[0], a.point[1] if len(a.point) > 1 else "fwd", a.L, a.d)
    import cupy
    if a.time:
        from suite_common import median_event_ms
        print(f"{' '.join(a.point)} L={a.L} d={a.d}: {median_event_ms(lambda i: fn()):.4f} ms")
        return 0
    for _ in range(3):
        fn()
    cupy.cuda.Device().synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
