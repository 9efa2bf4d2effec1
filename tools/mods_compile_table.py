"""Registers and spills of the modifier specialisations (issue 10), no GPU needed.

    PYTHONPATH=. python tools/mods_compile_table.py [fwd_sm80,fwd_sm90,fwd_simt,bwd_sm80,bwd_sm90] [out.json]

For each family and arch it compiles, with NVRTC, the specialisation the dispatcher picks (L =
4096, 16 batch items, causal) for each built-in modifier alone and all six at once, at d = 64
and 128, both EVEN builds (forward: Lk = 4096 and 4000) or both backward modes, and prints
registers, spill bytes and stack. docs/modifiers.md holds the table of session 5.
"""

from __future__ import annotations

import json
import sys

from cuflash import _families, _jit
from cuflash._variant import Variant

MODS = {"window": dict(window=True), "softcap": dict(softcap=True),
        "alibi": dict(alibi_slopes=True), "bias": dict(bias="B"), "mask": dict(mask=True),
        "sink": dict(sink=True),
        "all": dict(window=True, softcap=True, alibi_slopes=True, bias="B", mask=True, sink=True)}
TARGETS = [("fwd_sm80", "sm_80", "bfloat16", "__nv_bfloat16"),
           ("fwd_sm80", "sm_90a", "bfloat16", "__nv_bfloat16"),
           ("fwd_sm90", "sm_90a", "bfloat16", "__nv_bfloat16"),
           ("fwd_simt", "sm_80", "float32", "float"),
           ("fwd_simt", "sm_80", "float64", "double"),
           ("bwd_sm80", "sm_80", "bfloat16", "__nv_bfloat16"),
           ("bwd_sm80", "sm_90a", "bfloat16", "__nv_bfloat16"),
           ("bwd_sm90", "sm_90a", "bfloat16", "__nv_bfloat16")]


def main(argv: list[str]) -> int:
    fams = argv[0].split(",") if argv else sorted({t[0] for t in TARGETS})
    rows = []
    for name, arch, dtype, bias in TARGETS:
        if name not in fams:
            continue
        fam = _families.FAMILIES[name]
        dev = _families.PROFILES["h200" if arch == "sm_90a" else "a100"]
        exprs = {}
        for d in (64, 128):
            for alt in (False, True):      # forward: Lk 4096 / 4000; backward: deterministic
                Lk = 4000 if (alt and fam.kind == "fwd") else 4096
                det = alt and fam.kind == "bwd"
                for mod, kw in MODS.items():
                    kw = {k: (bias if v == "B" else v) for k, v in kw.items()}
                    shape = _families.Shape(dtype, 16, 4096, Lk, d, d,
                                            Variant(causal=True, **kw), det)
                    picked = fam.select(fam, shape, dev)
                    if isinstance(picked, str):   # not this family's (bwd_sm90: the registers)
                        print(f"{name:9} {arch:6} {dtype:8} d={d:3} {mod:8} runs elsewhere: {picked}")
                        continue
                    t, flags, _ = picked
                    exprs[fam.expr(dtype, t, shape.variant, **flags)] = (d, flags, mod)
        for r in _jit.compile_offline(fam.source, list(exprs), arch):
            d, flags, mod = exprs[r.expr]
            row = dict(family=name, arch=arch, dtype=dtype, d=d, flags=flags, mod=mod,
                       registers=r.registers, spill_stores=r.spill_stores,
                       spill_loads=r.spill_loads, stack=r.stack, error=r.error, expr=r.expr)
            rows.append(row)
            print(f"{name:9} {arch:6} {dtype:8} d={d:3} {str(flags):24} {mod:8} "
                  f"regs={r.registers} spill={r.spill_stores}/{r.spill_loads} stack={r.stack}"
                  + (f" ERROR {r.error[:300]}" if r.error else ""), flush=True)
    if len(argv) > 1:
        with open(argv[1], "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
