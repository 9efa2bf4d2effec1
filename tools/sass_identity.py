"""Fingerprint the machine code of kernel specialisations, to tell whether two trees run the same
kernels (so that GPU results measured on one are results for the other). No GPU needed.

    PYTHONPATH=<tree A> python tools/sass_identity.py a.json [--source fwd_]
    PYTHONPATH=<tree B> python tools/sass_identity.py b.json [--source fwd_]
    python tools/sass_identity.py --compare a.json b.json

Compiles every specialisation the dispatcher can select on sm_80 and sm_90a whose source
starts with --source (default ``fwd_``: the forward kernels) with NVRTC, disassembles the cubin
with nvdisasm and writes, per (arch, name expression), a SHA-256 of the function's instruction
lines with the address comments removed (the rest of a section, e.g. file-level data, is not
deterministic from run to run). --compare lists the specialisations whose hashes differ.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import subprocess
import sys
import tempfile


def fingerprints(prefix: str) -> dict[str, str | None]:
    from cuda import pathfinder

    from cuflash import _jit, _launch
    tool = pathfinder.find_nvidia_binary_utility("nvdisasm")
    out: dict[str, str | None] = {}
    for arch in ("sm_80", "sm_90a"):
        by_source: dict[str, list[str]] = {}
        for src, expr in _launch.all_specialisations(arch):
            if src.startswith(prefix):
                by_source.setdefault(src, []).append(expr)
        for src, exprs in by_source.items():
            nvrtc = _jit._nvrtc_for(arch)
            log, lowered, cubin = nvrtc.compile(_jit.load_source(src), src, exprs, _jit._options(arch))
            if lowered is None:
                raise SystemExit(f"{src} does not compile for {arch}:\n{log}")
            with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                f.write(cubin)
                f.flush()
                sass = subprocess.run([tool, f.name], capture_output=True, text=True, check=True).stdout
            sections = {}
            for section in re.split(r"^\s*\.section\s+\.text\.", sass, flags=re.MULTILINE)[1:]:
                name = section.split(",", 1)[0]
                text = re.sub(r"/\*[0-9a-f]{4,}\*/", "", section)
                body = "\n".join(line for line in text.splitlines() if line.rstrip().endswith(";"))
                sections[name] = hashlib.sha256(body.encode()).hexdigest()
            for expr in exprs:
                out[f"{arch} {expr}"] = sections.get(lowered[expr])
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", nargs="?", help="where to write this tree's fingerprints")
    ap.add_argument("--source", default="fwd_", help="prefix of the kernel sources to include")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"))
    a = ap.parse_args(argv)
    if a.compare:
        x, y = (json.load(open(p)) for p in a.compare)
        differ = sorted(k for k in x.keys() | y.keys() if x.get(k) != y.get(k) or x.get(k) is None)
        print(f"{len(x)} and {len(y)} specialisations; {len(differ)} differ")
        for k in differ:
            print("  ", k)
        return 1 if differ else 0
    if not a.json:
        ap.error("give a JSON path to write, or --compare A B")
    fp = fingerprints(a.source)
    with open(a.json, "w") as f:
        json.dump(fp, f, indent=0, sort_keys=True)
    print(f"{len(fp)} specialisations")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
