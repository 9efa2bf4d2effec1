"""The compile gate: which specialisations to compile offline, and the compiling.

Every specialisation the dispatcher can select (:func:`specialisations`) is what
``python -m cuflash check`` compiles, for each architecture, with NVRTC and no GPU: 1,413 of
them on sm_70 + sm_80 + sm_90a today (the mods suite's built-in modifier builds of fwd_sm90ws,
fwd_sm90 and bwd_sm90 included, below; the other modifier and the varlen builds are compiled on first use
and by their own slow tests, not here), about ten CPU-minutes.

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

The modifier builds of the mods suite's built-in modifiers in the wgmma families
(:func:`modifier_records`, about 90 on sm_90a) are in ``check`` but outside the two rules: CI
compiles only the softcap at d = 128 without causal of each (the build that spilled unseen in
session 7).
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
    if cc >= 90 and arch == "sm_90a":
        for spec in modifier_records():
            out.setdefault((spec.source, spec.expr), spec)
    return list(out.values())


#: The wgmma families whose modifier builds the gate compiles (:func:`modifier_records`), and
#: the mods suite's built-in modifiers (bench/suite_mods.py; the user functions need a trace)
MODIFIER_FAMILIES = ("fwd_sm90ws", "fwd_sm90", "bwd_sm90")


def modifier_variants() -> list:
    """The Variants of the mods suite's built-in modifiers, each causal and not: softcap (both
    builds of ``CUFLASH_SOFTCAP_TANH``, the tanh one without ``CUFLASH_SOFTCAP_POLY``, and
    session 10's default, ``CUFLASH_SOFTCAP_FIXED``'s fixed offset with the per-element
    backward; ``CUFLASH_SOFTCAP_BWD=plain``'s opt-in backward is not compiled here: it
    compiled with 0 spills in session 10 and lost on the H200), ALiBi (both of ``CUFLASH_ALIBI_RAW``), the window, a bfloat16 bias. (bwd_sm90
    with softcap at d = 128 spilled 56 bytes in session 7 and nothing compiled it:
    bench/NOTES.md.)"""
    from ._variant import Variant
    out = []
    for causal in (False, True):
        out += [Variant(causal=causal, softcap=True, softcap_fixed=True),
                Variant(causal=causal, softcap=True),
                Variant(causal=causal, softcap=True, softcap_tanh=False),
                Variant(causal=causal, softcap=True, softcap_poly=False),
                Variant(causal=causal, alibi_slopes=True),
                Variant(causal=causal, alibi_slopes=True, alibi_raw=False),
                Variant(causal=causal, window=True),
                Variant(causal=causal, bias="__nv_bfloat16")]
    return out


def modifier_records() -> list[Spec]:
    """The builds of :func:`modifier_variants` that the dispatcher picks on the H200 for
    the ``MODIFIER_FAMILIES``, bfloat16 (float16 has the same registers by construction), d = 64
    and 128, L = 4096 (the forward's EVEN build and, with Lk = 4000, its predicated one); a
    Variant the family sends elsewhere (bwd_sm90 with a bias) is skipped. About 60 builds."""
    from ._families import FAMILIES, PROFILES, Shape
    dev, out = PROFILES["h200"], {}
    for name in MODIFIER_FAMILIES:
        fam = FAMILIES[name]
        for d in (64, 128):
            for variant in modifier_variants():
                for Lk in ((4096, 4000) if fam.kind == "fwd" else (4096,)):
                    picked = fam.select(fam, Shape("bfloat16", 16, 4096, Lk, d, d, variant, False), dev)
                    if isinstance(picked, str):
                        continue
                    traits, flags = picked[0], picked[1]
                    expr = fam.expr("bfloat16", traits, variant, **flags)
                    out.setdefault((fam.source, expr), Spec(
                        fam.source, expr, (("dtype", "bfloat16"), ("traits", traits),
                                           ("variant", variant), *sorted(flags.items()))))
    return list(out.values())


#: The modifier builds CI's covering set compiles (2 cores, no GPU): the softcap at d = 128,
#: not causal, in both families (the build that spilled); the rest is ``check``'s.
def _covering_modifier(spec: Spec) -> bool:
    f = dict(spec.factors)
    v = f["variant"]
    return (v.softcap and v.softcap_tanh and v.softcap_poly and v.softcap_fixed
            and not v.causal
            and getattr(f["traits"], "head_dim", None) == 128)


def covering(archs: Iterable[str]) -> list[tuple[str, str, str]]:
    """The covering set over ``archs``: ``(source, expr, arch)`` jobs meeting the rules of the
    module docstring, chosen greedily per source (next: the job that meets the most unmet
    requirements; ties to the earlier one), so that the choice is a function of the registry
    and ``archs`` alone."""
    jobs: dict[str, list[tuple[Spec, str]]] = {}
    extra: list[tuple[str, str, str]] = []
    modifier = {(s.source, s.expr): s for s in modifier_records()}
    for arch in archs:
        for s in records(arch):
            if (s.source, s.expr) in modifier:     # not in the all-pairs rule: a chosen few
                if _covering_modifier(s):
                    extra.append((s.source, s.expr, arch))
                continue
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
    return chosen + extra


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
