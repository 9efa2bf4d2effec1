#!/usr/bin/env python3
"""Question: does a change to the printing of traced user functions (cuflash/_trace_cuda.py)
change the machine code of the kernels that use them? No GPU needed.

Compiles, for every score_mod of the testing kit's library (cuflash._testing_modifiers), the
forward specialisations the dispatcher picks for a bf16 d=128 causal call on sm_90a (fwd_sm90)
and sm_80 (fwd_sm80), a float32 one on fwd_simt and the bf16 backward (bwd_sm80), with the
trace's struct as the prelude, and prints a SHA-256 per (score_mod, family) of its SASS,
normalised by tools/sass_identity.py's ``fingerprint``.

    PYTHONPATH=<tree> python bench/probes/score_mod_sass.py > a.txt   # before and after; diff
"""
from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "tools"))
from sass_identity import fingerprint  # noqa: E402  (tools/: its normalisation of SASS)

from cuflash import _families, _jit, _trace, _trace_cuda
from cuflash._testing_modifiers import SCORE_MODS
from cuflash._variant import Variant

TARGETS = [("fwd_sm90", "sm_90a", "bfloat16"), ("fwd_sm80", "sm_80", "bfloat16"),
           ("fwd_simt", "sm_80", "float32"), ("bwd_sm80", "sm_80", "bfloat16")]


def main() -> int:
    for name, (fn, _) in sorted(SCORE_MODS.items()):
        tr = _trace.trace_score_mod(fn)
        v = Variant(causal=True, score_mod=_trace_cuda.qualified_name(tr), prelude=tr.source)
        for fam_name, arch, dtype in TARGETS:
            fam = _families.FAMILIES[fam_name]
            dev = _families.PROFILES["h200" if arch == "sm_90a" else "a100"]
            shape = _families.Shape(dtype, 16, 1024, 1024, 128, 128, v, False)
            t, flags, _ = fam.select(fam, shape, dev)
            expr = fam.expr(dtype, t, v, **flags)
            nvrtc = _jit._nvrtc_for(arch)
            log, lowered, cubin = nvrtc.compile(tr.source + _jit.load_source(fam.source),
                                                fam.source, [expr], _jit._options(arch))
            if lowered is None:
                print(f"{name:14} {fam_name:9} ERROR {log[:300]}")
                continue
            sections = _jit.sass_sections(cubin) or {}
            mangled = lowered[expr]
            sha = fingerprint(sections.get(mangled, ""), mangled)["sha"][:16]
            print(f"{name:14} {fam_name:9} {sha}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
