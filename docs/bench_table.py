"""Markdown tables of the H200 benchmark suites, generated from bench/results/h200/*.json
(and of the CPU path against naive NumPy, from the newest bench/results/cpu/*.json).

    python docs/bench_table.py            # print the tables
    python docs/bench_table.py --write    # replace the generated block in docs/guide.md

docs/guide.md carries the output between the markers below, so the guide's numbers are the
JSON's numbers; tests/test_packaging.py checks that they still agree (regenerate with
``--write`` after a new run lands in bench/results/h200/).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "h200"
GUIDE = ROOT / "docs" / "guide.md"
BEGIN = "<!-- bench_table.py: generated from bench/results/h200, do not edit -->"
END = "<!-- end of bench_table.py output -->"

# (suite, our implementation, peers to compare with)
SUITES = [
    ("fwd", "cuflash", ("sdpa_flash", "sdpa_cudnn")),
    ("fwd_bwd", "cuflash", ("sdpa_flash", "sdpa_cudnn")),
    ("fwd_fp32", "cuflash", ("naive_cupy",)),
]


def _key(row: dict) -> tuple:
    return (row["dtype"], row["d"], row["L"], row["causal"])


def suite_table(name: str, ours: str, peers: tuple[str, ...]) -> str | None:
    path = RESULTS / f"{name}.json"
    if not path.is_file():
        return None
    doc = json.loads(path.read_text())
    by_impl: dict[str, dict[tuple, dict]] = {}
    for row in doc["rows"]:
        if row.get("tflops") is not None:
            by_impl.setdefault(row["impl"], {})[_key(row)] = row
    header = doc.get("header", {})
    lines = [f"**{name}** (`bench/results/h200/{name}.json`: {header.get('gpu', '?')}, "
             f"{header.get('date', '?')[:10]}, code {header.get('measured_code') or header.get('git', '?')}); "
             f"TFLOP/s, and cuflash's speed relative to each peer",
             "",
             "| dtype | d | L | causal | B×H | " + f"{ours} | "
             + " | ".join(peers) + " | " + " | ".join(f"÷ {p}" for p in peers) + " |",
             "|" + "---|" * (6 + 2 * len(peers))]
    for key in sorted(by_impl.get(ours, {})):
        row = by_impl[ours][key]
        cells = [row["dtype"], str(row["d"]), str(row["L"]), "yes" if row["causal"] else "no",
                 f"{row['B']}×{row['H']}", f"{row['tflops']:.0f}"]
        ratios = []
        for peer in peers:
            other = by_impl.get(peer, {}).get(key)
            cells.append(f"{other['tflops']:.0f}" if other else "–")
            ratios.append(f"{row['tflops'] / other['tflops']:.2f}×" if other else "–")
        lines.append("| " + " | ".join(cells + ratios) + " |")
    return "\n".join(lines)


def cpu_table() -> str | None:
    """The CPU path against naive NumPy, from the newest bench/results/cpu/*.json."""
    files = sorted((RESULTS.parent / "cpu").glob("*.json"))
    if not files:
        return None
    doc = json.loads(files[-1].read_text())
    h = doc["header"]
    lines = [f"**CPU path** (`bench/results/cpu/{files[-1].name}`: {h['cpus']} CPUs "
             f"({h['cpu']}), NumPy {h['numpy']}, {h['date'][:10]}, load average "
             f"{h['loadavg_before'][0]:.1f} before the run); milliseconds, median of "
             f"{h['reps']} interleaved calls; naive = the score matrix materialised in the "
             f"same dtype; naive, BLAS 1 thread = the same with NumPy's BLAS on one thread",
             "",
             "| B×H | L | d | dtype | causal | pass | cuflash | naive | ÷ naive | "
             "naive, BLAS 1 thread | ÷ that |",
             "|" + "---|" * 11]
    for r in doc["rows"]:
        lines.append(f"| {r['B']}×{r['H']} | {r['L']} | {r['d']} | {r['dtype']} | "
                     f"{'yes' if r['causal'] else 'no'} | {r['direction']} | "
                     f"{r['cuflash_ms']:.0f} | {r['naive_ms']:.0f} | "
                     f"{r['speedup_vs_naive']:.2f}× | {r['naive_blas1_ms']:.0f} | "
                     f"{r['speedup_vs_naive_blas1']:.2f}× |")
    return "\n".join(lines)


def tables() -> str:
    parts = [t for t in (suite_table(*s) for s in SUITES) if t]
    parts += [t for t in (cpu_table(),) if t]
    return "\n\n".join(parts) if parts else "(no results in bench/results/h200/ yet)"


def block() -> str:
    return f"{BEGIN}\n{tables()}\n{END}"


def guide_block(text: str) -> str | None:
    if BEGIN not in text or END not in text:
        return None
    return text[text.index(BEGIN):text.index(END) + len(END)]


def main(argv=None) -> int:
    global RESULTS
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--write", action="store_true", help="update docs/guide.md in place")
    p.add_argument("--results", default=None, help="read the JSON here (default "
                                                      "bench/results/h200)")
    args = p.parse_args(argv)
    if args.results:
        RESULTS = Path(args.results)
    if not args.write:
        print(tables())
        return 0
    text = GUIDE.read_text()
    old = guide_block(text)
    if old is None:
        print(f"{GUIDE}: markers not found", file=sys.stderr)
        return 1
    GUIDE.write_text(text.replace(old, block()))
    print(f"updated {GUIDE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
