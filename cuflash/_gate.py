"""The compile gate: which specialisations to compile offline, and the compiling.

Every specialisation the dispatcher can select (:func:`specialisations`) is what
``python -m cuflash check`` compiles, for each architecture, with NVRTC and no GPU: 1,033 of
them on sm_70 + sm_80 + sm_90a today (the modifier and varlen builds are compiled on first
use and by their own slow tests, not here), about nine CPU-minutes.

CI's two cores cannot afford that on every run, so the test suite compiles a *covering set*
(:func:`covering`): every specialisation's factors (element type, tile traits, Variant, flags)
are such that

* every combination of everything except the element type and the architecture appears at
  least once — each tile configuration with each Variant and each flag value, which is what
  decides registers, spills and the shape of the code; and
* every element type and every architecture appears with every value of every other factor
  (all pairs), so a template that fails to compile for one type or arch with one option is
  found.

About half of the jobs of one architecture, a quarter over three. What the covering set cannot
see is a spill that one (traits, Variant, flags) row shows only with an element type or on an
architecture it was not compiled for here (float16 vs bfloat16 in the tensor-core families are
the same registers by construction; sm_80 vs sm_90a code of one family differs little). The
whole set stays the release check: ``python -m cuflash check`` (bench/gpu_run.sh runs it on the
GPU machine's 16 cores).
"""

from __future__ import annotations

from typing import Callable, Iterable, NamedTuple


class Spec(NamedTuple):
    source: str
    expr: str
    factors: tuple          # ((name, value), ...), the element type first


def _arch_cc(arch: str) -> int:
    import re
    m = re.fullmatch(r"sm_(\d+)a?", arch)
    if not m:
        raise ValueError(f"unknown architecture {arch!r}: expected e.g. sm_80 or sm_90a")
    return int(m.group(1))


def records(arch: str) -> list[Spec]:
    """Every specialisation the dispatcher can select on ``arch`` (e.g. "sm_90a"), each once,
    with its factors. sm_90 without the ``a`` cannot run the wgmma families."""
    from ._families import REGISTRY
    from ._variant import ALL_VARIANTS
    cc = _arch_cc(arch)
    out: dict[tuple[str, str], Spec] = {}

    def add(fam, dt, traits=None, variant=None, flags=None):
        flags = flags or {}
        expr = fam.expr(dt, traits, variant, **flags)
        factors = (("dtype", dt), ("traits", traits), ("variant", variant),
                   *sorted(flags.items()))
        out.setdefault((fam.source, expr), Spec(fam.source, expr, factors))

    for fam in REGISTRY:
        if not fam.arch_ok(cc) or (fam.min_cc == 90 and arch != "sm_90a"):
            continue
        if fam.kind == "aux":
            for _, flags in (fam.instances(fam, arch) if fam.instances else [(None, {})]):
                for dt in sorted(fam.dtypes):
                    add(fam, dt, flags=flags)
            continue
        for inst in fam.instances(fam, arch):
            traits, flags = inst[0], inst[1]
            causal = inst[2] if len(inst) > 2 else None
            dtypes = inst[3] if len(inst) > 3 else sorted(fam.dtypes)
            for variant in ALL_VARIANTS:
                if causal is not None and variant.causal != causal:
                    continue
                for dt in dtypes:
                    add(fam, dt, traits, variant, flags)
    return list(out.values())


def covering(archs: Iterable[str]) -> list[tuple[str, str, str]]:
    """The covering set over ``archs``: ``(source, expr, arch)`` jobs meeting the rules of the
    module docstring, chosen greedily per source (next: the job that meets the most unmet
    requirements; ties to the earlier one), so that the choice is a function of the registry
    and ``archs`` alone."""
    jobs: dict[str, list[tuple[Spec, str]]] = {}
    for arch in archs:
        for s in records(arch):
            jobs.setdefault(s.source, []).append((s, arch))

    def needs(s: Spec, arch: str) -> set:
        (_, dt), rest = s.factors[0], s.factors[1:]
        return ({("rest", rest), ("dtype", dt, "arch", arch)}
                | {("dtype", dt, f) for f in rest} | {("arch", arch, f) for f in rest})

    chosen: list[tuple[str, str, str]] = []
    for group in jobs.values():
        reqs = [needs(s, arch) for s, arch in group]
        unmet = set().union(*reqs)
        while unmet:
            k = max(range(len(group)), key=lambda i: (len(reqs[i] & unmet), -i))
            s, arch = group[k]
            chosen.append((s.source, s.expr, arch))
            unmet -= reqs[k]
    return chosen


#: The architectures the gate compiles for: the generic families on sm_70 (NVRTC 12), all on
#: sm_80, and the wgmma families on sm_90a.
ARCHS = ("sm_70", "sm_80", "sm_90a")


def specialisations(arch: str, subset: str = "all") -> list[tuple[str, str]]:
    """(source, name expression) pairs to compile on ``arch``: ``subset="all"`` every one the
    dispatcher can select, ``"covering"`` those of the covering set over :data:`ARCHS` (module
    docstring) that fall on ``arch``."""
    if subset == "all":
        return [(s.source, s.expr) for s in records(arch)]
    if subset == "covering":
        _arch_cc(arch)
        return [(src, expr) for src, expr, a in covering(ARCHS) if a == arch]
    raise ValueError(f"subset must be 'all' or 'covering', got {subset!r}")


#: Sources whose SASS the gate reads (tensor-core instruction counts, serialisation notes):
#: the attention families. nvdisasm costs about a quarter of a compile, and nothing is checked
#: in the SASS of the helper kernels (backward prologue/epilogue, decode, combine).
def _reads_sass(source: str) -> bool:
    return source.startswith(("fwd_", "bwd_")) and source != "bwd_prep.cu"


def check(archs: Iterable[str], progress: Callable[[int, int], None] | None = None,
          workers: int | None = None, subset: str = "all"):
    """Compile the specialisations of each arch (the compile gate): a list of
    ``_jit.CompileReport``. Work is spread over ``workers`` processes (default: all cores)."""
    from . import _jit
    archs = tuple(archs)
    if subset == "covering":
        jobs = covering(archs)
    else:
        jobs = [(source, expr, arch) for arch in archs for source, expr in specialisations(arch, subset)]
    return _jit.compile_many(jobs, progress=progress, workers=workers, sass=_reads_sass)


__all__ = ["Spec", "records", "covering", "specialisations", "check"]
