#!/usr/bin/env python3
"""Question: which split count does decode_sm80 want, per shape, on the H200?

The heuristic (cuflash/_inference_select.py) picks num_splits from the SM count and blocks per
SM. On the first H200 run (session 6) it reached 4.49 TB/s at Lk = 128k (B=8, Hq 32 / Hkv 8:
at the peers) but 3.51 at Lk = 8k, where cuDNN reached 3.78. This times ``num_splits`` forced
to each of SPLITS against the heuristic (None) and SDPA cuDNN / flash, dense cache, bf16, d 128,
on the points below, with suite_decode's timing (median CUDA-event time, inputs rotating past
L2). Prints one line per point and writes JSON (``--out``).

    PYTHONPATH=. python bench/probes/decode_splits.py --out decode_splits.json   (~30 s)
        [--points B:Hkv:Lk,...] [--splits 0,1,2,...]   (0: the heuristic's count)
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
import suite_decode as sd  # noqa: E402  (bench/)

POINTS = [(1, 32, 8, 8192), (1, 32, 8, 131072), (8, 32, 8, 8192), (8, 32, 8, 65536),
          (64, 32, 8, 8192), (8, 32, 32, 8192), (64, 32, 32, 8192)]
SPLITS = (None, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32)


def main(argv=None) -> int:
    a = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    a.add_argument("--out")
    a.add_argument("--points", help="comma-separated B:Hkv:Lk (Hq 32), in place of POINTS")
    a.add_argument("--splits", help="comma-separated split counts (0: the heuristic's), in "
                                    "place of SPLITS")
    args = a.parse_args(argv)
    points = POINTS if not args.points else [
        (int(b), 32, int(h), int(lk))
        for b, h, lk in (x.split(":") for x in args.points.split(","))]
    splits = SPLITS if not args.splits else tuple(
        int(x) or None for x in args.splits.split(","))
    import cupy
    import numpy
    import torch
    import cuflash._inference as inf
    peers = {n: sd._sdpa(b)[0] for n, b in (("sdpa_flash", "FLASH_ATTENTION"),
                                            ("sdpa_cudnn", "CUDNN_ATTENTION"))}
    rows = []
    for B, Hq, Hkv, Lk in points:
        G, D = Hq // Hkv, sd.D
        nbytes = B * Hkv * Lk * D * 4
        n_sets = max(1, min(64, -(-sd.ROTATE_BYTES // nbytes)))
        qs = [sd._fill(cupy, (B, Hq, 1, D), 10 + i) for i in range(n_sets)]
        ks = [sd._fill(cupy, (B, Hkv, Lk, D), 100 + i) for i in range(n_sets)]
        vs = [sd._fill(cupy, (B, Hkv, Lk, D), 200 + i) for i in range(n_sets)]
        seqlens = cupy.full((B,), Lk, numpy.int32)
        line = []
        for ns in splits:
            def ours(i, ns=ns):
                return inf.attention_with_kvcache(
                    qs[i].reshape(B, Hkv, G, 1, D), ks[i][:, :, None], vs[i][:, :, None],
                    cache_seqlens=seqlens, num_splits=ns)
            ms = sd._time(ours, n_sets)
            rows.append(dict(B=B, Hq=Hq, Hkv=Hkv, Lk=Lk, impl="cuflash", num_splits=ns, ms=ms,
                             tbps=nbytes / ms / 1e9))
            line.append(f"{ns}:{nbytes / ms / 1e9:.2f}")
        tq, tk, tv = ([torch.from_dlpack(x) for x in xs] for xs in (qs, ks, vs))
        for name, fn in peers.items():
            ms = sd._time(lambda i: fn(tq[i], tk[i], tv[i]), n_sets)
            rows.append(dict(B=B, Hq=Hq, Hkv=Hkv, Lk=Lk, impl=name, ms=ms,
                             tbps=nbytes / ms / 1e9))
            line.append(f"{name}:{nbytes / ms / 1e9:.2f}")
        print(f"B={B} Hq={Hq} Hkv={Hkv} Lk={Lk} TB/s by num_splits: " + " ".join(line),
              flush=True)
        del qs, ks, vs, tq, tk, tv
        cupy.get_default_memory_pool().free_all_blocks()
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
