"""Do the varlen builds (cuflash/_inference_varlen.py: a family's source with CUFLASH_VARLEN
defined) of every forward and backward table entry compile without spills? No GPU needed.

    PYTHONPATH=. python bench/probes/varlen_compile.py [--arch sm_80] [--family fwd_sm80] [--all]

Compiles, per family and arch, every non-EVEN, non-deterministic table entry the dispatcher can
pick (bf16 for the tensor-core families, every dtype for the simt ones; causal and not) in its
varlen build and prints registers and spill bytes; entries listed in
``_inference_varlen.SPILLS_IN_VARLEN`` for that arch are compiled as the replacement the varlen
path uses. Exit status 1 if any build the varlen path can pick spills. ``--all`` also prints the
clean ones. Answer so far (NVRTC 13, session 5): every one clean after the five replacements
(bench/NOTES.md, "Varlen in the kernels"). The varlen builds are not in the compile gate.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

JOBS = (("sm_80", "fwd_sm80"), ("sm_90a", "fwd_sm80"), ("sm_90a", "fwd_sm90"),
        ("sm_90a", "fwd_simt"), ("sm_80", "bwd_sm80"), ("sm_90a", "bwd_sm80"),
        ("sm_90a", "bwd_sm90"), ("sm_90a", "bwd_simt"))


def exprs_of(fam, arch: str) -> list[str]:
    from cuflash import _inference_varlen as iv
    from cuflash._families import Variant
    cc = 90 if arch == "sm_90a" else int(arch[3:])
    out = set()
    for inst in fam.instances(fam, arch):
        t, flags = inst[0], dict(inst[1])
        if flags.get("even") or flags.get("deterministic"):
            continue
        key = iv._tiles_key(fam, t)
        change, min_cc = iv.SPILLS_IN_VARLEN.get(key, (None, 0))
        if change and cc >= min_cc:
            t = t.replace(**change)
        causal = inst[2] if len(inst) > 2 else None
        dtypes = inst[3] if len(inst) > 3 else sorted(fam.dtypes)
        if fam.tensor_core_rows:
            dtypes = ["bfloat16"]
        for dt in dtypes:
            if fam.name == "bwd_simt" and (t.acc == 8) != (dt == "float64"):
                continue
            for c in ((causal,) if causal is not None else (False, True)):
                out.add(fam.expr(dt, t, Variant(causal=c), **flags))
    return sorted(out)


def main(argv=None) -> int:
    from cuflash import _inference_varlen as iv
    from cuflash import _jit
    from cuflash._families import FAMILIES
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch")
    ap.add_argument("--family")
    ap.add_argument("--all", action="store_true")
    a = ap.parse_args(argv)
    bad = 0
    for arch, name in JOBS:
        if (a.arch and arch != a.arch) or (a.family and name != a.family):
            continue
        fam = FAMILIES[name]
        exprs = exprs_of(fam, arch)
        t0 = time.perf_counter()
        log, lowered, _ = _jit._nvrtc_for(arch).compile(
            iv.varlen_source(fam.source), fam.source, exprs,
            _jit._options(arch, ("--ptxas-options=-v",)))
        if lowered is None:
            print(f"{arch} {name}: does not compile\n{log[:3000]}")
            bad += 1
            continue
        regs = []
        for e in exprs:
            r = _jit._parse_ptxas(log, lowered[e])
            regs.append(r["registers"])
            spill = r["spill_stores"] + r["spill_loads"] + r["stack"]
            bad += bool(spill)
            if spill or a.all:
                print(f"  {arch} {e}: {r['registers']} registers, {spill} spill/stack bytes")
        print(f"{arch} {name}: {len(exprs)} varlen builds, {min(regs)}-{max(regs)} registers "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
