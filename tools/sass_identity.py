"""Fingerprint the machine code of kernel specialisations, to tell whether two trees run the same
kernels (so that GPU results measured on one are results for the other), and compare their
resources (registers, spills, stack, instruction count) where the code is meant to change. No GPU
needed.

    PYTHONPATH=<tree A> python tools/sass_identity.py a.json [--source fwd_,bwd_]
    PYTHONPATH=<tree B> python tools/sass_identity.py b.json [--source fwd_,bwd_]
    python tools/sass_identity.py --compare a.json b.json      # which machine code differs
    python tools/sass_identity.py --resources a.json b.json    # registers/spills/stack/instrs

Compiles every specialisation the dispatcher can select on sm_80 and sm_90a (``--arch`` to
narrow) whose source starts with one of the --source prefixes (default ``fwd_``: the forward
kernels) with NVRTC, disassembles the cubin with nvdisasm and writes, per (arch, name
expression), a SHA-256 of the function's instruction lines with the address comments removed
its own (mangled) name in its instructions
replaced, its branch labels numbered per function and the compiler's internal subroutines
(``$__internal_<n>_$...``) unnumbered (the rest of a section, e.g. file-level data, is not
deterministic from run to run, and both numberings depend on the program's other functions), the
number of those lines, and ptxas's registers, spill stores and loads and stack frame.

Name expressions are compared after rewriting a spelling map (``SPELLING``: today
``cuflash::Variant<true|false>`` -> ``true|false``, the bool CAUSAL argument the Variant
replaced at the same position, and decode_mma's and decode_split's trailing ``, false`` FUSE
flag, the build before the flag), so the trees before and after a respelling line up. A file
written by an older version of this tool (a plain hash per key) compares too.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys

#: old <- new spellings of name expressions, applied to the keys of both sides before comparing
SPELLING = [(re.compile(r"cuflash::Variant<(true|false)>"), r"\1"),
            # decode_mma's FUSE flag (session 7), false: the build before the flag
            (re.compile(r"(cuflash::decode::decode_mma<[^<>,]*, \d+, (?:true|false)), false>"),
             r"\1>"),
            (re.compile(r"(cuflash::decode::decode_split<[^<>,]*, \d+, \d+, (?:true|false)), "
                        r"false>"), r"\1>")]


def _normalise(key: str) -> str:
    for pattern, repl in SPELLING:
        key = pattern.sub(repl, key)
    return key


def _load(path: str) -> dict[str, dict]:
    raw = json.load(open(path))
    out = {}
    for k, v in raw.items():
        out[_normalise(k)] = v if isinstance(v, dict) or v is None else {"sha": v}
    return out


#: the order in which sources are compiled (the tensor-core kernels first: a run cut short still
#: has them); any other source follows in the dispatcher's order
PRIORITY = ("bwd_sm90.cu", "bwd_sm80.cu", "fwd_sm90.cu", "fwd_sm80.cu", "bwd_prep.cu", "bwd_simt.cu", "fwd_simt.cu")


def fingerprint(section: str, name: str) -> dict:
    """SHA-256 and instruction count of one function's SASS (``name``: its mangled name):
    instruction lines only, addresses dropped, branch labels numbered per function, its own
    name replaced."""
    text = re.sub(r"/\*[0-9a-f]{4,}\*/", "", section)
    # branch labels are numbered across the whole cubin, in the order of its functions (which
    # follows their mangled names): number them per function
    labels: dict[str, str] = {}
    text = re.sub(r"\.L_x_\d+", lambda m: labels.setdefault(m.group(0), f".L{len(labels)}"), text)
    text = text.replace(name, "SELF")   # e.g. RET.REL.NODEC R4 `(<own mangled name>)
    # the compiler's internal subroutines (a division's slow path) are numbered across the
    # program: `$__internal_3_$...` in one program is `$__internal_4_$...` in a program with
    # one more build (session 20: every modifier build of fwd_sm90ws read as changed when the
    # dispatcher added four builds to their program)
    text = re.sub(r"\$__internal_\d+_\$", "$__internal_$", text)
    lines = [line for line in text.splitlines() if line.rstrip().endswith(";")]
    body = "\n".join(lines)
    return {"sha": hashlib.sha256(body.encode()).hexdigest(),
            "instructions": sum(1 for x in lines if "NOP" not in x)}


def fingerprints(prefixes: tuple[str, ...], archs: tuple[str, ...], match: str = "",
                 path: str | None = None) -> dict[str, dict | None]:
    """Fingerprint the selected specialisations; with ``path``, resume from what that JSON file
    already holds and rewrite it after every (arch, source) compiled, so that a run cut short
    keeps what it finished."""
    from cuflash import _families, _jit
    out: dict[str, dict | None] = {}
    if path:
        try:
            out = json.load(open(path))
        except FileNotFoundError:
            pass
    work = []
    for arch in archs:
        # plain attention and the gate's modifier builds (_gate.modifier_records, session 8) in
        # separate NVRTC programs: a function's SASS hash depends on what else the program
        # holds, so the plain kernels keep the program they had before those builds were added
        by_source: dict[tuple[str, bool], list[str]] = {}
        for src, expr in _families.specialisations(arch):
            if src.startswith(prefixes) and re.search(match, _normalise(expr)):
                modified = bool(re.search(r"Variant<[^<>]*,", expr))
                by_source.setdefault((src, modified), []).append(expr)
        work += [(arch, src, exprs) for (src, _), exprs in by_source.items()
                 if not all(f"{arch} {e}" in out for e in exprs)]
    rank = {s: i for i, s in enumerate(PRIORITY)}
    work.sort(key=lambda w: (rank.get(w[1], len(rank)), w[0]))
    for arch, src, exprs in work:
        nvrtc = _jit._nvrtc_for(arch)
        log, lowered, cubin = nvrtc.compile(_jit.load_source(src), src, exprs,
                                            _jit._options(arch, ("--ptxas-options=-v",)))
        if lowered is None:
            raise SystemExit(f"{src} does not compile for {arch}:\n{log}")
        raw = _jit.sass_sections(cubin)
        if raw is None:
            raise SystemExit("nvdisasm is needed (pip install nvidia-cuda-nvdisasm)")
        sections = {name: fingerprint(section, name) for name, section in raw.items()}
        for expr in exprs:
            rec = sections.get(lowered[expr])
            if rec is not None:
                rec = dict(rec, **_jit._parse_ptxas(log, lowered[expr]))
            out[f"{arch} {expr}"] = rec
        print(f"{arch} {src}: {len(exprs)}", flush=True)
        if path:
            with open(path, "w") as f:
                json.dump(out, f, indent=0, sort_keys=True)
    return out


def compare(a: str, b: str) -> int:
    x, y = _load(a), _load(b)
    differ = sorted(k for k in x.keys() | y.keys()
                    if (x.get(k) or {}).get("sha") != (y.get(k) or {}).get("sha") or x.get(k) is None)
    print(f"{len(x)} and {len(y)} specialisations; {len(differ)} differ")
    for k in differ:
        print("  ", k)
    return 1 if differ else 0


def resources(a: str, b: str) -> int:
    """Per specialisation: registers, spills (stores + loads), stack and instruction count, A -> B;
    exit 1 where B spills, has a stack frame, or uses more registers than A."""
    x, y = _load(a), _load(b)
    bad = 0
    print(f"{'specialisation':<100} {'regs':>9} {'spill':>6} {'stack':>6} {'instructions':>13}")
    for k in sorted(x.keys() | y.keys()):
        p, q = x.get(k) or {}, y.get(k) or {}
        sp = lambda r: (r.get("spill_stores") or 0) + (r.get("spill_loads") or 0)  # noqa: E731
        worse = (sp(q) or q.get("stack") or q.get("registers") is None
                 or (p.get("registers") is not None and q["registers"] > p["registers"]))
        bad += bool(worse)
        print(f"{k:<100} {p.get('registers')!s:>3} ->{q.get('registers')!s:>3} {sp(p)}->{sp(q)}"
              f" {p.get('stack')!s}->{q.get('stack')!s} {p.get('instructions')!s:>6}->{q.get('instructions')!s:<6}"
              f"{'  <-- worse' if worse else ''}")
    print(f"{bad} specialisations with more registers, spills or stack")
    return 1 if bad else 0


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", nargs="?", help="where to write this tree's fingerprints")
    ap.add_argument("--source", default="fwd_", help="comma-separated prefixes of the kernel sources to include")
    ap.add_argument("--arch", action="append", help="sm_80 and/or sm_90a (default both)")
    ap.add_argument("--match", default="", help="only name expressions (old spelling) matching this regex")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"))
    ap.add_argument("--resources", nargs=2, metavar=("A", "B"))
    a = ap.parse_args(argv)
    if a.compare:
        return compare(*a.compare)
    if a.resources:
        return resources(*a.resources)
    if not a.json:
        ap.error("give a JSON path to write, or --compare A B, or --resources A B")
    fp = fingerprints(tuple(a.source.split(",")), tuple(a.arch or ("sm_80", "sm_90a")), a.match, a.json)
    print(f"{len(fp)} specialisations")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
