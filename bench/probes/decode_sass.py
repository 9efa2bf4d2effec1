"""Static cost of the decode kernels' main loop, no GPU needed: compile name expressions with
NVRTC, disassemble with nvdisasm, find the loop that issues the most global loads (a backward
branch to an earlier label; the innermost such loop with the most loads), and count its
instructions by kind.

    python bench/probes/decode_sass.py                      # the default decode table
    python bench/probes/decode_sass.py --expr 'cuflash::decode::decode_split<...>' --arch sm_80
    python bench/probes/decode_sass.py --dump NAME_SUBSTRING  # print that loop's SASS

Per specialisation: registers, spills, the loop's instruction count, its 16-byte global loads
(LDG.E.128 / LDGSTS.128: bytes loaded a thread an iteration), HMMA, SHFL, MUFU, and the ratio
"instructions per 16-byte load" (warp instructions issued per 512 bytes a warp brings in). The
budget it is judged against is in bench/NOTES.md ("decode: the instruction budget").
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

KINDS = {
    "ld16": r"\b(?:LDG\.E\.(?:EL\.)?(?:LTC\w+\.)?128|LDG\.E\.128\.\w+|LDGSTS\.E\.(?:BYPASS\.)?(?:LTC\w+\.)?128)\b",
    "ldg": r"\bLDG\b",
    "ldgsts": r"\bLDGSTS\b",
    "lds": r"\bLDS\b|\bLDSM\b",
    "hmma": r"\bHMMA\b",
    "ffma": r"\bFFMA\b",
    "hfma2": r"\bHFMA2\b|\bHMUL2\b|\bHADD2\b",
    "shfl": r"\bSHFL\b",
    "mufu": r"\bMUFU\b",
    "bar": r"\bBAR\b|\bDEPBAR\b|\bLDGDEPBAR\b",
}


def _sass(arch: str, source: str, exprs: list[str], defines: tuple[str, ...] = ()):
    from cuflash import _jit
    nvrtc = _jit._nvrtc_for(arch)
    log, lowered, cubin = nvrtc.compile(_jit.load_source(source), source, exprs,
                                        _jit._options(arch, ("--ptxas-options=-v",)
                                                      + tuple(f"-D{d}" for d in defines)))
    if lowered is None:
        raise SystemExit(f"{source} does not compile for {arch}:\n{log}")
    sections = _jit.sass_sections(cubin)
    if sections is None:
        raise SystemExit("nvdisasm is needed (pip install nvidia-cuda-nvdisasm)")
    return log, lowered, sections


def _instructions(section: str):
    """[(label or None, text)] in order: labels as their own entries."""
    out = []
    for line in section.splitlines():
        m = re.match(r"^\s*(\.L_x_\d+):", line)
        if m:
            out.append((m.group(1), None))
            continue
        m = re.match(r"^\s*/\*[0-9a-f]{4}\*/\s+(.*?);", line)
        if m and "NOP" not in m.group(1):
            out.append((None, m.group(1)))
    return out


def main_loop(section: str):
    """The instructions of the loop with the most global loads (innermost on ties)."""
    ins = _instructions(section)
    where = {lab: i for i, (lab, _) in enumerate(ins) if lab}
    best = None
    for i, (_, text) in enumerate(ins):
        if text is None or "BRA" not in text:
            continue
        m = re.search(r"(\.L_x_\d+)", text)
        if not m or where.get(m.group(1), i) >= i:
            continue
        body = [t for _, t in ins[where[m.group(1)]:i + 1] if t is not None]
        loads = sum(1 for t in body if re.search(r"\bLDG|\bLDGSTS", t))
        key = (loads, -len(body))
        if loads and (best is None or key > best[0]):
            best = (key, body)
    return best[1] if best else []


def report(arch: str, source: str, exprs: list[str], dump: str | None = None,
           defines: tuple[str, ...] = ()):
    from cuflash import _jit
    log, lowered, sections = _sass(arch, source, exprs, defines)
    rows = []
    for e in exprs:
        res = _jit._parse_ptxas(log, lowered[e])
        body = main_loop(sections[lowered[e]])
        counts = {k: sum(1 for t in body if re.search(p, t)) for k, p in KINDS.items()}
        n = len(body)
        per = n / counts["ld16"] if counts["ld16"] else float("nan")
        rows.append((e, res.get("registers"), (res.get("spill_stores") or 0)
                     + (res.get("spill_loads") or 0), n, counts, per))
        if dump and dump in e:
            print(f"--- {arch} {e}: main loop, {n} instructions")
            print("\n".join(body))
    return rows


DEFAULT = [
    ("decode.cu", "cuflash::decode::decode_split<{T}, {d}, {rows}, cuflash::Variant<false>>")
]


def default_exprs():
    out = []
    for T in ("__nv_bfloat16", "__half"):
        for d in (64, 128):
            for rows in (1, 4, 8):
                out.append(DEFAULT[0][1].format(T=T, d=d, rows=rows))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", action="append", help="default: sm_90a and sm_80")
    ap.add_argument("--source", default="decode.cu")
    ap.add_argument("--expr", action="append")
    ap.add_argument("--dump")
    ap.add_argument("--hot", action="store_true",
                    help="decode_mma.cu: fold the once-a-split branches to their common case "
                         "(CUFLASH_SASS_HOT_PATH): the steady-state iteration")
    ap.add_argument("--paged", type=int, choices=(0, 1),
                    help="decode_mma.cu: compile the dense (0) or paged (1) addressing only")
    a = ap.parse_args(argv)
    defines = (("CUFLASH_SASS_HOT_PATH",) if a.hot else ()) + (
        (f"CUFLASH_SASS_PAGED={a.paged}",) if a.paged is not None else ())
    exprs = a.expr or default_exprs()
    for arch in a.arch or ["sm_90a", "sm_80"]:
        rows = report(arch, a.source, exprs, a.dump, defines)
        print(f"{arch}: {'specialisation':<78} regs spill loop  16B-ld hmma ffma hfma2 shfl mufu "
              f"ins/16B")
        for e, regs, spill, n, c, per in rows:
            short = e.replace("cuflash::", "").replace("__nv_bfloat16", "bf16").replace("__half", "f16")
            print(f"  {short:<84} {regs:>4} {spill:>5} {n:>5} {c['ld16']:>6} {c['hmma']:>4} "
                  f"{c['ffma']:>4} {c['hfma2']:>5} {c['shfl']:>4} {c['mufu']:>4} {per:>7.1f}")


if __name__ == "__main__":
    main()
