#!/usr/bin/env python3
"""Question (session 7, bench/NOTES.md "fwd modifier cost (session 7)"): what do softcap, ALiBi
and block masks cost over plain attention in fwd_sm90 now, and is softcap faster with its
reciprocal on the FMA pipe (1 MUFU operation a score for the softcap instead of 2)?

    PYTHONPATH=. python bench/probes/fwd_mods_ab.py [--out ab.json] [--L 4096,16384]

On the H200 (one device call, ~1-2 min): the forward (bf16, d = 128, B x L = 16k tokens, H = 16,
the mods suite's shapes) of plain non-causal and causal, softcap 50 non-causal, ALiBi causal,
and the suite's window / document / prefix block masks, each timed with CUDA events (median
of 20), in two child processes: the default build and one compiled with
``-DCUFLASH_SOFTCAP_RCP_FMA=1`` (variant.cuh's ``softcap_of``; only the softcap points can
differ). Prints TFLOP/s on visible pairs and the ratio to plain of the same causality. No GPU:
exits with a message.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[1]))   # bench/: suite_common, suite_mods


def child(L_list: list[int]) -> list[dict]:
    import cupy
    import ml_dtypes
    import numpy
    import cuflash
    from cuflash import _jit
    from suite_common import median_event_ms
    import suite_mods
    fma = os.environ.get("AB_RCP_FMA") == "1"
    if fma:
        base = _jit._options
        _jit._options = lambda arch, extra=(): base(arch, tuple(extra) + ("-DCUFLASH_SOFTCAP_RCP_FMA=1",))
    rows, H, d = [], 16, 128
    for L in L_list:
        B = suite_mods.TOKENS // L
        rng = numpy.random.default_rng(0)
        q, k, v = (cupy.asarray(rng.standard_normal((B, H, L, d)).astype(numpy.dtype(ml_dtypes.bfloat16)))
                   for _ in range(3))
        mods = suite_mods.mods_for(L, H)
        points = [("plain", dict(causal=False), L * L), ("plain", dict(causal=True), L * (L + 1) / 2)]
        for name in ("softcap", "alibi"):
            points.append((name, suite_mods.cuflash_kwargs(mods[name], L, H, cupy),
                           suite_mods.visible_pairs(mods[name], L)))
        for name in ("window", "document", "prefix"):   # the suite's block-mask rows
            points.append((name + " (block mask)",
                           dict(block_mask=cuflash.block_mask(mods[name].mask_mod, (1, 1), L, L)),
                           suite_mods.visible_pairs(mods[name], L)))
        for name, kw, pairs in points:
            ms = median_event_ms(lambda i: cuflash.attention(q, k, v, **kw))
            rows.append(dict(L=L, mod=name, causal=bool(kw.get("causal", False)), ms=ms,
                             tflops=4 * B * H * d * pairs / ms / 1e9, rcp_fma=fma))
            print(json.dumps(rows[-1]), flush=True)
        del q, k, v
        cupy.get_default_memory_pool().free_all_blocks()
    return rows


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--L", default="4096,16384")
    ap.add_argument("--out")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    L_list = [int(x) for x in a.L.split(",")]
    if a.child:
        child(L_list)
        return 0
    try:
        import cupy
        cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:   # noqa: BLE001
        print(f"no GPU here ({exc}): nothing measured")
        return 0
    rows = []
    for fma in ("0", "1"):
        env = dict(os.environ, AB_RCP_FMA=fma)
        run = subprocess.run([sys.executable, str(HERE), "--child", "--L", a.L], env=env,
                             capture_output=True, text=True)
        sys.stderr.write(run.stderr[-3000:])
        rows += [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    plain = {(r["L"], r["causal"], r["rcp_fma"]): r["tflops"] for r in rows if r["mod"] == "plain"}
    print(f"{'L':>6} {'modifier':24} {'causal':6} {'rcp on':6} {'TFLOP/s':>8} {'vs plain':>8}")
    for r in rows:
        ref = plain.get((r["L"], r["causal"], r["rcp_fma"]))
        print(f"{r['L']:>6} {r['mod']:24} {str(r['causal']):6} {'FMA' if r['rcp_fma'] else 'MUFU':6} "
              f"{r['tflops']:8.1f} {r['tflops'] / ref if ref else float('nan'):8.2f}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
