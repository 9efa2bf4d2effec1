#!/usr/bin/env python3
"""Question (session 8, bench/NOTES.md "softcap and ALiBi cost (session 8)"): what does a score
cost in fwd_sm90's key-tile loop and bwd_sm90's query-tile loop with softcap (the tanh.approx
build and session 7's ex2 / rcp build) and ALiBi (raw scores and session 7's natural units),
against plain attention? No GPU: NVRTC +
nvdisasm, per specialisation the dispatcher picks (bf16, L = 4096, 64 batch items):
registers, spill bytes, and the static instructions of the loop that holds the HGMMAs by class.

    PYTHONPATH=. python bench/probes/softcap_sass.py [--d 64,128] [--json out.json]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys

from cuflash import _families, _jit
from cuflash._variant import Variant

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
from mask_varlen_cost import hgmma_loop  # noqa: E402  (bench/probes/, beside this file)

CLASSES = ("HGMMA", "MUFU", "MUFU.EX2", "MUFU.TANH", "MUFU.RCP", "FFMA", "FMUL", "FADD", "FMNMX",
           "FSEL", "I2F", "IADD", "FSETP")


def main_loop(section: str) -> tuple[int, dict]:
    """Static instructions of the longest loop that holds HGMMAs (mask_varlen_cost.hgmma_loop),
    by class."""
    body = hgmma_loop(section)
    ops = [re.sub(r"^@!?U?P\w+\s+", "", x).split()[0] for x in body]
    count = {k: sum(o == k or o.startswith(k + ".") for o in ops) for k in CLASSES}
    return len(body), count


def cases(d: int):
    yield "plain non-causal", Variant(causal=False)
    yield "plain causal", Variant(causal=True)
    for c in (False, True):
        tag = "causal" if c else "non-causal"
        yield f"softcap fixed {tag}", Variant(causal=c, softcap=True, softcap_fixed=True)
        yield f"softcap fixed bwd-plain {tag}", Variant(causal=c, softcap=True, softcap_fixed=True,
                                                        softcap_bwd_plain=True)
        yield f"softcap fixed alt-share {tag}", Variant(causal=c, softcap=True, softcap_fixed=True,
                                                        softcap_share_alt=True)
        yield f"softcap fixed-only {tag}", Variant(causal=c, softcap=True, softcap_fixed=True, softcap_poly=False)
        yield f"softcap tanh {tag}", Variant(causal=c, softcap=True)
        yield f"softcap tanh-only {tag}", Variant(causal=c, softcap=True, softcap_poly=False)
        yield f"softcap ex2/rcp {tag}", Variant(causal=c, softcap=True, softcap_tanh=False)
        yield f"alibi raw {tag}", Variant(causal=c, alibi_slopes=True)
        yield f"alibi natural {tag}", Variant(causal=c, alibi_slopes=True, alibi_raw=False)


def run(d_list, families=("fwd_sm90", "bwd_sm90")) -> list[dict]:
    rows = []
    dev = _families.PROFILES["h200"]
    for name in families:
        fam = _families.FAMILIES[name]
        for d in d_list:
            exprs = {}
            for label, v in cases(d):
                shape = _families.Shape("bfloat16", 64, 4096, 4096, d, d, v, False)
                picked = fam.select(fam, shape, dev)
                if isinstance(picked, str):
                    print(f"{name} d={d} {label}: runs elsewhere ({picked})")
                    continue
                t, flags, _ = picked
                exprs[fam.expr("bfloat16", t, v, **flags)] = (label, t)
            nvrtc = _jit._nvrtc_for("sm_90a")
            opts = _jit._options("sm_90a", ("--ptxas-options=-v",))
            log, lowered, cubin = nvrtc.compile(_jit.load_source(fam.source), fam.source, list(exprs), opts)
            if lowered is None:
                print(log[:2000])
                continue
            sections = _jit.sass_sections(cubin) or {}
            for e, (label, t) in exprs.items():
                res = _jit._parse_ptxas(log, lowered[e])
                n, cls = main_loop(sections.get(lowered[e], ""))
                tiles = {k: v for k, v in dataclasses.asdict(t).items()} if dataclasses.is_dataclass(t) else str(t)
                row = dict(family=name, d=d, case=label, tiles=tiles, loop=n, **cls,
                           registers=res.get("registers"),
                           spill=(res.get("spill_stores") or 0) + (res.get("spill_loads") or 0),
                           stack=res.get("stack"))
                rows.append(row)
                print(f"{name} d={d:3} {label:26} regs={row['registers']} spill={row['spill']} "
                      f"stack={row['stack']} loop={n} " + " ".join(f"{k}={v}" for k, v in cls.items() if v),
                      flush=True)
    return rows


def main(argv) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--d", default="64,128")
    ap.add_argument("--family", default="fwd_sm90,bwd_sm90")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    rows = run([int(x) for x in a.d.split(",")], a.family.split(","))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
