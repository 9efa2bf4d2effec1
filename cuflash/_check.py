"""``python -m cuflash check``: the offline compile gate's command (see cuflash/__main__.py).

Which architectures an NVRTC here can target (the others are skipped, each with the reason),
the gate itself (``_families.check``, with a progress bar on stderr), and its table.
"""
from __future__ import annotations

import inspect
import re
import sys
from typing import Sequence

DEFAULT_ARCHS = ("sm_70", "sm_80", "sm_90a")


def _short(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"



def _cell(x) -> str:
    return "-" if x is None else str(x)


def format_check_table(reports) -> str:
    header = ["arch", "source", "regs", "spill st", "spill ld", "stack", "smem", "hmma",
              "status", "specialisation"]
    body = []
    for r in reports:
        if r.error:
            status = "ERROR"
        elif r.spill_stores or r.spill_loads:
            status = "SPILL"
        elif r.stack:
            status = "STACK"
        else:
            status = "ok"
        body.append([r.arch, r.source, _cell(r.registers), _cell(r.spill_stores),
                     _cell(r.spill_loads), _cell(r.stack), _cell(r.shared), _cell(r.hmma),
                     status, r.expr])
    widths = [max([len(h)] + [len(row[i]) for row in body]) for i, h in enumerate(header)]
    fmt = lambda cells: "  ".join(  # noqa: E731
        c.ljust(w) if i in (0, 1, 8, 9) else c.rjust(w)
        for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
    return "\n".join([fmt(header), fmt(["-" * w for w in widths])] + [fmt(r) for r in body])


def check_failed(r) -> bool:
    return bool(r.error or r.spill_stores or r.spill_loads or r.stack)


_ARCH = re.compile(r"sm_(\d+)a?")


class UsageError(Exception):
    """A bad command-line argument: printed as one line, exit status 2."""


def targetable_archs(archs: Sequence[str]) -> tuple[list[str], list[str]]:
    """``(kept, skipped)``: the arches an NVRTC found here compiles for, and one line for each
    other arch saying why it is skipped. Raises UsageError for a malformed arch."""
    for arch in archs:
        if not _ARCH.fullmatch(arch):
            raise UsageError(f"--arch {arch!r} is not an architecture: use sm_<NN> or "
                             f"sm_<NN>a, e.g. sm_80 or sm_90a")
    try:
        from cuflash import _jit
        libs = _jit._nvrtc_libraries()
    except Exception as e:        # no NVRTC, or the module changed: let the gate report it
        return list(archs), [] if archs else [f"(NVRTC not inspected: {_short(e)})"]
    if not libs:
        return [], [f"{arch}: no NVRTC found (pip install cuflash[cuda13])" for arch in archs]
    kept, skipped = [], []
    found = ", ".join(f"{v[0]}.{v[1]}" for v in (lib.version for lib in libs))
    for arch in archs:
        num = int(_ARCH.fullmatch(arch).group(1))
        if any(num in lib.archs for lib in libs):
            kept.append(arch)
            continue
        why = f"{arch}: the NVRTC here ({found}) does not target it"
        if num < 75 and not any(lib.version[0] == 12 for lib in libs):
            why += "; NVRTC 12 still does: pip install nvidia-cuda-nvrtc-cu12"
        skipped.append(why)
    return kept, skipped


def gate_function():
    """The compile gate's entry point: ``_jit.check_all`` where a tree still has it (older
    trees; tests stand one in), else the registry's ``_families.check(archs, progress=...)``."""
    from cuflash import _jit
    check_all = getattr(_jit, "check_all", None)
    if check_all is not None:
        return check_all
    from cuflash._families import check
    return check


def run_check_all(check_all, archs: list[str], bar) -> list:
    """``check_all(archs, progress=callback)`` where it takes a progress callback (called as
    ``callback(done, total)``), else ``check_all([arch])`` arch by arch."""
    try:
        params = inspect.signature(check_all).parameters
    except (TypeError, ValueError):
        params = {}
    if "progress" in params:
        return list(check_all(archs, progress=bar.callback))
    bar.update(0, len(archs))
    reports = []
    for arch in archs:
        reports.extend(check_all([arch]))
        bar.advance()
    return reports


def cmd_check(args) -> int:
    archs, skipped = targetable_archs(args.arch or list(DEFAULT_ARCHS))
    for why in skipped:
        print(f"skipped {why}", file=sys.stderr)
    if not archs:
        print("compile gate: no requested architecture can be compiled here", file=sys.stderr)
        return 1
    try:
        check_all = gate_function()
    except Exception as e:        # ImportError, or the lead's module changed
        print(f"compile gate unavailable: {_short(e)}", file=sys.stderr)
        return 2
    from cuflash._progress import Progress
    with Progress(label=f"compiling for {', '.join(archs)}") as bar:
        reports = run_check_all(check_all, archs, bar)
    if not reports:
        print(f"compile gate: nothing to compile for {', '.join(archs)}", file=sys.stderr)
        return 1
    print(format_check_table(reports))
    bad = [r for r in reports if check_failed(r)]
    # Compile errors, each distinct log once (one bug usually breaks many specialisations).
    by_error: dict[str, list] = {}
    for r in bad:
        if r.error:
            by_error.setdefault(str(r.error).strip(), []).append(r)
    for text, rs in by_error.items():
        more = f" and {len(rs) - 1} more" if len(rs) > 1 else ""
        print(f"\n{rs[0].arch} {rs[0].source} {rs[0].expr}{more}:\n  "
              + "\n  ".join(text.splitlines()[:20]))
    print()
    print(f"{len(reports)} compilations ({', '.join(archs)}): "
          + ("all ok, 0 bytes spilled, 0 bytes stack" if not bad else f"{len(bad)} failed")
          + (f"; skipped {len(skipped)} arch(es) this NVRTC cannot target" if skipped else ""))
    return 1 if bad else 0
