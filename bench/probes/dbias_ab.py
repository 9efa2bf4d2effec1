#!/usr/bin/env python3
"""A/B of the dense learnable bias (session 8, bench/NOTES.md "dbias and the bias forward"):
bias (H, L, L) bf16 broadcast over B, not causal, forward and fwd+bwd with dbias, d 64 and 128,
L 4k (16k only where the bias fits 8 GB, as suite_mods: it does not at B x L = 16k, H x d =
2048), cuflash in four configurations in one process (plans cleared between), then
FlexAttention and SDPA as bench/suite_mods.py measures them (its helpers, its FLOP count).

Configurations (environment read at plan time):
  old        CUFLASH_BWD=sm80 CUFLASH_DBIAS_REDUCE=0 CUFLASH_FWD_BIAS_WARPGROUPS=2 (main's path)
  reduce     CUFLASH_BWD=sm80 CUFLASH_FWD_BIAS_WARPGROUPS=2: dbias not zeroed, summed by one
             bwd_finish_dq launch into the bias's dtype
  bwd_sm90   CUFLASH_FWD_BIAS_WARPGROUPS=2: + the bias backward on bwd_sm90
  new        defaults: + the forward at fwd_sm90's table warpgroups (3 at d = 128)

Run: ``PYTHONPATH=. python bench/probes/dbias_ab.py --json out.json`` (``--no-peers`` skips
FlexAttention / SDPA and their torch.compile time; ``--L 4096,16384``). A fresh machine has no
compiled kernels: first one process per configuration (and one for the peers) makes one call
of each point at once, filling CuPy's and Inductor's on-disk caches in parallel, so the timed
pass below compiles nothing (``--no-warm`` skips that).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import suite_mods as sm  # noqa: E402  (bench/)

CONFIGS = {
    "old": {"CUFLASH_BWD": "sm80", "CUFLASH_DBIAS_REDUCE": "0", "CUFLASH_FWD_BIAS_WARPGROUPS": "2"},
    "reduce": {"CUFLASH_BWD": "sm80", "CUFLASH_FWD_BIAS_WARPGROUPS": "2"},
    "bwd_sm90": {"CUFLASH_FWD_BIAS_WARPGROUPS": "2"},
    "new": {},
}
KEYS = sorted({k for c in CONFIGS.values() for k in c})


def _configure(env: dict) -> None:
    from cuflash import _api
    for k in KEYS:
        os.environ.pop(k, None)
    os.environ.update(env)
    _api.clear_plans()


def _warm(a) -> None:
    """One process a configuration (its environment) and one for the peers, at once."""
    import subprocess
    base = [sys.executable, __file__, "--d", a.d, "--L", a.L, "--warm-only"]
    procs = []
    for name, env in CONFIGS.items():
        e = {k: v for k, v in os.environ.items() if k not in KEYS}
        procs.append(subprocess.Popen(base + [name], env={**e, **env}))
    if not a.no_peers:
        procs.append(subprocess.Popen(base + ["peers"]))
    for proc in procs:
        proc.wait()


def _warm_only(what: str, ds, Ls) -> int:
    """One call of each point (bias fwd, fwd+bwd) for cuflash in this process's environment,
    or for FlexAttention / SDPA (``peers``): the compiles, nothing timed."""
    import cupy
    import ml_dtypes
    import numpy
    import cuflash
    bf16 = numpy.dtype(ml_dtypes.bfloat16)
    torch = compiled = None
    if what == "peers":
        torch, _ = sm._torch()
        if torch is None:
            return 0
        compiled = sm.compile_flex(torch)
    for d in ds:
        H = sm.WIDTH // d
        for L in Ls:
            B = max(1, sm.TOKENS // L)
            if H * L * L * 2 > 8e9:
                continue
            x = cupy.zeros((B, H, L, d), bf16)
            bias = cupy.zeros((H, L, L), bf16)
            if what != "peers":
                cuflash.attention(x, x, x, bias=bias)
                cuflash.attention_vjp(x, x, x, bias=bias)[1](x)
            else:
                tx = torch.from_dlpack(x)
                tb = torch.from_dlpack(bias)
                with torch.no_grad():
                    compiled(tx, tx, tx, score_mod=lambda s, b, h, q, kv: s + tb[h, q, kv])
                leaves = [tx.detach().clone().requires_grad_() for _ in range(3)]
                tbg = tb.detach().clone().requires_grad_()
                o = compiled(*leaves, score_mod=lambda s, b, h, q, kv: s + tbg[h, q, kv])
                o.backward(torch.ones_like(o))
            cupy.cuda.Device().synchronize()
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--d", default="64,128")
    p.add_argument("--L", default="4096")
    p.add_argument("--no-peers", action="store_true")
    p.add_argument("--no-warm", action="store_true")
    p.add_argument("--warm-only", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.warm_only:
        return _warm_only(a.warm_only, [int(x) for x in a.d.split(",")],
                          [int(x) for x in a.L.split(",")])
    t_warm = time.perf_counter()
    if not a.no_warm:
        _warm(a)
    print(f"(warm-up: {time.perf_counter() - t_warm:.0f} s)", flush=True)
    import cupy
    import ml_dtypes
    import numpy
    import cuflash
    bf16 = numpy.dtype(ml_dtypes.bfloat16)
    torch, why = (None, "peers off") if a.no_peers else sm._torch()
    compiled = cbm = None
    if torch is not None:
        try:
            from torch.nn.attention.flex_attention import create_block_mask as cbm
            compiled = sm.compile_flex(torch)
        except Exception as exc:
            why = sm._note(exc)
    rows, t0 = [], time.perf_counter()
    for d in (int(x) for x in a.d.split(",")):
        H = sm.WIDTH // d
        for L in (int(x) for x in a.L.split(",")):
            B = max(1, sm.TOKENS // L)
            rng = numpy.random.default_rng(L + d)
            sets = [tuple(cupy.asarray(rng.standard_normal((B, H, L, d)).astype(bf16))
                          for _ in range(3)) for _ in range(2)]
            bias = (cupy.asarray((rng.standard_normal((H, L, L)) * 0.5).astype(bf16))
                    if H * L * L * 2 <= 8e9 else None)
            mod = sm.mods_for(L, H)["bias"]
            for mode in ("fwd", "fwd_bwd"):
                flops = 4 * B * H * d * L * L * (3.5 if mode == "fwd_bwd" else 1.0)
                for name, env in CONFIGS.items():
                    _configure(env)
                    for r in sm._cuflash_point(cuflash, cupy, mod, mode, d, L, H, sets, bias, flops):
                        r["impl"] = f"cuflash_{name}"
                        rows.append(r)
                _configure({})
                if compiled is not None:
                    rows += sm._flex_point(torch, compiled, cbm, mod, mode, d, L, B, H, sets,
                                           bias, flops)
                if torch is not None:
                    rows += sm._sdpa_point(torch, mod, mode, d, L, B, H, sets, bias, flops)
                for r in rows:
                    if r["d"] == d and r["L"] == L and r["mode"] == mode and "_shown" not in r:
                        r["_shown"] = True
                        val = (f"{r['ms']:8.3f} ms {r['tflops']:6.1f} TFLOP/s" if r["ms"]
                               else f"- ({r.get('note', '')})")
                        print(f"d={d:3} L={L:5} {mode:7} {r['impl']:18} {val}", flush=True)
            del sets, bias
            cupy.get_default_memory_pool().free_all_blocks()
    for r in rows:
        r.pop("_shown", None)
    if torch is None:
        print(f"peers: {why}")
    print(f"({time.perf_counter() - t0:.0f} s)")
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps({"probe": "dbias_ab", "configs": CONFIGS,
                                                    "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
