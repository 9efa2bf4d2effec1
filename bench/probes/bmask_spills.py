#!/usr/bin/env python3
"""Question (session 8): do the block-mask builds the dispatcher picks for the mods suite's own
mask_mods (window 1024, 8 documents, prefix-LM) spill? The compile gate enumerates the registry's
specialisations and the built-in modifiers, not traced mask_mods, so it cannot say.

    PYTHONPATH=. python bench/probes/bmask_spills.py [--d 128] [--families bwd_sm90,bwd_sm80,fwd_sm90,fwd_sm80] [--json out.json]

No GPU: traces each mask_mod, asks ``_families.choose`` for the suite's shape (B x H = 64,
L = 4096, bf16; causal and not; deterministic and not for the backwards), compiles the chosen
build with NVRTC for the family's arch (sm_90a for the sm90 families, sm_80 for the sm80 ones)
and prints registers, spill bytes and a fingerprint of the machine code
(tools/sass_identity.py's), e.g. to check that a refactor leaves these builds unchanged.
Session 8: bwd_sm90 at d = 128 spilled 4-40 bytes in all six, so that path became opt-in; at
d = 64, 0. Session 10: with the mask as bits (bwd_sm90.cu kMaskBits) 0 in all six, and the
default (``CUFLASH_BWD90_BLOCK_MASK=0`` shows bwd_sm80's builds instead). ``--kit``: the testing
kit's mask_mods (cuflash._testing_modifiers.MASK_MODS) instead of the suite's.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "tools")]

ARCH = {"bwd_sm90": ("sm_90a", "h200"), "fwd_sm90": ("sm_90a", "h200"),
        "bwd_sm80": ("sm_80", "a100"), "fwd_sm80": ("sm_80", "a100")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--L", type=int, default=4096)
    ap.add_argument("--families", default="bwd_sm90,bwd_sm80,fwd_sm90,fwd_sm80")
    ap.add_argument("--kit", action="store_true",
                    help="the testing kit's mask_mods (cuflash._testing_modifiers.MASK_MODS) "
                         "instead of the suite's")
    ap.add_argument("--mods", default="window,document,prefix",
                    help="the suite's mask_mods to compile (default: all three)")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    import cuflash
    import sass_identity
    import suite_mods
    import types
    from cuflash import _families, _jit, _trace, _trace_cuda, _variant
    from cuflash._variant import Variant
    out = {}
    for fam_name in a.families.split(","):
        arch, profile = ARCH[fam_name]
        fam, dev = _families.FAMILIES[fam_name], _families.PROFILES[profile]
        nvrtc = _jit._nvrtc_for(arch)
        direction = "bwd" if fam_name.startswith("bwd") else "fwd"
        if a.kit:
            from cuflash import _testing_modifiers
            mods = dict(_testing_modifiers.MASK_MODS)
        else:
            mods = {n: suite_mods.mods_for(a.L, 16)[n].mask_mod for n in a.mods.split(",")}
        for name, mask_mod in mods.items():
            tr = _trace.trace_mask_mod(mask_mod)
            # the keys its query blocks visit (session 10: fwd_sm90's blocks an SM and schedule)
            keys = cuflash.block_mask(mask_mod, (1, 1), a.L, a.L).mean_row_keys()
            for causal in (False, True):
                for det in ((False, True) if direction == "bwd" else (False,)):
                    # the prelude a plan gives it: dQ's bounded additions (session 11's
                    # CUFLASH_BWD90_DQ_ROWS, off by default) before the traced source
                    bounds = _variant._dq_bounds(types.SimpleNamespace(d=a.d, dv=a.d),
                                                 types.SimpleNamespace(block_mask=True))
                    v = Variant(causal=causal, mask_mod=_trace_cuda.qualified_name(tr),
                                block_mask=True, prelude=bounds + tr.source)
                    shape = _families.Shape("bfloat16", 64, a.L, a.L, a.d, a.d, v, det, keys)
                    choice = _families.choose(direction, shape, dev)
                    key = f"{arch} {fam_name} d={a.d} {name} causal={causal} deterministic={det}"
                    if choice.family is not fam:
                        print(f"{key}: not chosen ({choice.family.name} is)")
                        continue
                    log, lowered, cubin = nvrtc.compile(
                        v.prelude + _jit.load_source(fam.source), fam.source, [choice.expr],
                        _jit._options(arch, ("--ptxas-options=-v",)))
                    if lowered is None:
                        print(f"{key}: does not compile\n{log[:400]}")
                        continue
                    fn = lowered[choice.expr]
                    res = _jit._parse_ptxas(log, fn)
                    fp = sass_identity.fingerprint((_jit.sass_sections(cubin) or {}).get(fn, ""), fn)
                    out[key] = dict(fp, registers=res.get("registers"),
                                    spill_bytes=res.get("spill_stores", 0) + res.get("spill_loads", 0),
                                    stack=res.get("stack", 0))
                    print(f"{key} {choice.expr.split(', cuflash::Variant')[0].split('<')[1]}"
                          f"{''.join(f' {k}' for k in ('persist', 'lean') if dict(choice.traits.args).get(k))}: {res.get('registers')} registers, "
                          f"{out[key]['spill_bytes']} spill bytes, {out[key]['stack']} stack, "
                          f"sha {fp.get('sha', '')[:12]}",
                          flush=True)
    if a.json:
        json.dump(out, open(a.json, "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
