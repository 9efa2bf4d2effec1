"""Charts of the mods, decode and varlen suites' result files (issues 10 and 11).

    PYTHONPATH=. python bench/plot_suites.py bench/results/h200/mods.json [decode.json varlen.json ...]

writes ``<name>.png`` beside each JSON; the chart follows the file's ``meta.suite`` (or its
rows' ``suite``). The fwd / fwd_bwd suites have their own plot (bench_attention.py --plot).

- mods: one panel per (d, L) in the file; a group of bars per modifier, one bar per
  (implementation, mode) in TFLOP/s (cuflash, cuflash_block_mask, flex, sdpa; fwd solid,
  fwd_bwd hatched). Above the cuflash family's bar stands cuflash/flex for that mode (> 1:
  cuflash is faster), taken from the best cuflash-family row that is not the dense-mask
  fallback (for document and prefix: the block-mask row). A missing bar is a row with no
  number (SDPA cannot express softcap).
- decode: K/V bytes read per second (TB/s) against the cache length Lk (log x), one panel per
  (batch B, Hq/Hkv); solid lines for the dense cache (cuflash, sdpa_cudnn, sdpa_flash and
  the copy ceiling), dashed cuflash lines for the paged cache at page sizes 16 and 256. Rows
  without a number (skipped: the cache does not fit) are left out.
- varlen: one panel per length mix, a horizontal bar per implementation, TFLOP/s on the real
  (causal) pairs.

matplotlib (Agg) is imported only when a chart is drawn; without it the script says so and
exits 0.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

MODS_IMPLS = ("cuflash", "cuflash_block_mask", "flex", "sdpa")
MODS_MODES = ("fwd", "fwd_bwd")
COLOURS = {"cuflash": "tab:blue", "cuflash_block_mask": "tab:cyan", "flex": "tab:orange",
           "sdpa": "tab:green", "sdpa_cudnn": "tab:green", "sdpa_flash": "tab:red",
           "copy": "tab:gray"}


def suite_of(doc: dict) -> str | None:
    """The suite a results file holds: ``meta.suite`` (``header.suite``), else its rows'."""
    head = doc.get("meta") or doc.get("header") or {}
    if head.get("suite"):
        return head["suite"]
    suites = {r.get("suite") for r in doc.get("rows", [])}
    return suites.pop() if len(suites) == 1 else None


def _ordered(values):
    return list(dict.fromkeys(values))          # first-seen order, as the suite ran them


def best_cuflash(rows: list[dict], mod: str, mode: str) -> dict | None:
    """The cuflash-family row the ratio uses: the fastest cuflash or cuflash_block_mask row
    with a number and no "dense mask" note (the dense-mask row is the fallback, not the path)."""
    fam = [r for r in rows if r["mod"] == mod and r["mode"] == mode and r.get("tflops")
           and r["impl"] in ("cuflash", "cuflash_block_mask")
           and "dense mask" not in (r.get("note") or "")]
    return max(fam, key=lambda r: r["tflops"], default=None)


def plot_mods(plt, rows: list[dict], title: str):
    panels = _ordered((r["d"], r["L"]) for r in rows)
    fig, axes = plt.subplots(len(panels), 1, figsize=(12, 4.2 * len(panels)), squeeze=False)
    bars = [(i, m) for m in MODS_MODES for i in MODS_IMPLS]
    width = 0.85 / len(bars)
    for ax, (d, L) in zip(axes[:, 0], panels):
        pr = [r for r in rows if r["d"] == d and r["L"] == L]
        mods = _ordered(r["mod"] for r in pr)
        cell = {(r["mod"], r["impl"], r["mode"]): r for r in pr}
        for k, (impl, mode) in enumerate(bars):
            xs, ys = [], []
            for x, mod in enumerate(mods):
                r = cell.get((mod, impl, mode))
                if r is not None and r.get("tflops"):
                    xs.append(x + (k - (len(bars) - 1) / 2) * width)
                    ys.append(r["tflops"])
            if xs:
                ax.bar(xs, ys, width, color=COLOURS[impl], label=f"{impl} {mode}",
                       hatch="//" if mode == "fwd_bwd" else None, edgecolor="white")
        for x, mod in enumerate(mods):
            for mode in MODS_MODES:
                best, flex = best_cuflash(pr, mod, mode), cell.get((mod, "flex", mode))
                if best is None or not (flex and flex.get("tflops")):
                    continue
                k = bars.index((best["impl"], mode))
                ax.annotate(f"{best['tflops'] / flex['tflops']:.2f}x",
                            (x + (k - (len(bars) - 1) / 2) * width, best["tflops"]),
                            xytext=(0, 2), textcoords="offset points", ha="center",
                            va="bottom", fontsize=7, rotation=90)
        ax.set_xticks(range(len(mods)), mods)
        ax.set(title=f"d = {d}, L = {L} (label: cuflash/flex)", ylabel="TFLOP/s")
        ax.set_ylim(0, 1.35 * max((r["tflops"] for r in pr if r.get("tflops")), default=1))
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize="x-small", ncol=4)
    fig.suptitle(title)
    return fig


def plot_decode(plt, rows: list[dict], title: str):
    rows = [r for r in rows if r.get("tbps")]
    panels = sorted({(r["B"], r["Hq"], r["Hkv"]) for r in rows})
    ncol = min(3, max(1, len(panels)))
    nrow = -(-max(1, len(panels)) // ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(5 * ncol, 3.8 * nrow), squeeze=False,
                             sharey=True)
    for ax, (B, hq, hkv) in zip(axes.flat, panels):
        lines: dict[tuple, list] = {}
        for r in rows:
            if (r["B"], r["Hq"], r["Hkv"]) == (B, hq, hkv):
                key = (r["impl"], r.get("page_size", 0) if r.get("paged") else 0)
                lines.setdefault(key, []).append((r["Lk"], r["tbps"]))
        for (impl, page), pts in sorted(lines.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            ax.plot(*zip(*sorted(pts)), marker="o", color=COLOURS.get(impl),
                    linestyle="--" if page else "-", alpha=0.6 if page == 16 else 1.0,
                    label=f"{impl} paged {page}" if page else impl)
        ax.set(xscale="log", title=f"B = {B}, Hq/Hkv = {hq}/{hkv}", xlabel="Lk",
               ylabel="TB/s (K/V read)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="xx-small")
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.suptitle(title)
    return fig


def plot_varlen(plt, rows: list[dict], title: str):
    mixes = _ordered(r["mix"] for r in rows)
    fig, axes = plt.subplots(1, len(mixes), figsize=(6 * len(mixes), 3.6), squeeze=False,
                             sharex=True)
    for ax, mix in zip(axes[0], mixes):
        mr = [r for r in rows if r["mix"] == mix and r.get("tflops")]
        names = [r["impl"] for r in mr]
        ax.barh(range(len(mr)), [r["tflops"] for r in mr],
                color=["tab:blue" if n.startswith("cuflash") else "tab:orange" for n in names])
        for y, r in enumerate(mr):
            ax.annotate(f"{r['tflops']:.0f}", (r["tflops"], y), xytext=(2, 0),
                        textcoords="offset points", va="center", fontsize=7)
        ax.set_yticks(range(len(mr)), names, fontsize=8)
        ax.invert_yaxis()
        ax.set(title=f"mix: {mix}", xlabel="TFLOP/s (real pairs)")
        ax.grid(True, axis="x", alpha=0.3)
    fig.suptitle(title)
    return fig


CHARTS = {"mods": plot_mods, "decode": plot_decode, "varlen": plot_varlen}


def plot_file(plt, path: Path) -> Path | None:
    """Draw ``path``'s chart into ``path`` with suffix .png; None (and a note) if its suite
    has no chart here."""
    doc = json.loads(path.read_text())
    suite = suite_of(doc)
    if suite not in CHARTS:
        print(f"{path}: suite {suite!r} has no chart here (known: {', '.join(CHARTS)})",
              file=sys.stderr)
        return None
    head = doc.get("meta") or doc.get("header") or {}
    title = f"{suite} suite, {head.get('device') or head.get('gpu') or ''}".rstrip(", ")
    fig = CHARTS[suite](plt, doc["rows"], title)
    fig.tight_layout()
    out = path.with_suffix(".png")
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed; no plots written", file=sys.stderr)
        return 0
    for name in argv:
        out = plot_file(plt, Path(name))
        if out is not None:
            print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
