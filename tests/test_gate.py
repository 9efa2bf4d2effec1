"""The compile gate's covering set (cuflash/_gate.py) meets its two rules on today's registry,
and is a function of the registry alone. Fast: no compiling."""

from __future__ import annotations

import pytest

from cuflash import _families, _gate


@pytest.fixture(scope="module")
def full() -> list[tuple[_gate.Spec, str]]:
    """Every record the two rules apply to: the modifier builds (``_gate.modifier_records``)
    are ``check``'s, with a chosen few in the covering set (test below)."""
    modifier = {(s.source, s.expr) for s in _gate.modifier_records()}
    return [(s, arch) for arch in _gate.ARCHS for s in _gate.records(arch)
            if (s.source, s.expr) not in modifier]


def test_the_modifier_builds_are_checked_and_the_softcap_at_d128_is_covered():
    """``check`` compiles the mods suite's built-in modifier builds of fwd_sm90ws, fwd_sm90 and
    bwd_sm90 at d 64 and 128 (both softcap builds; bwd_sm90's softcap at d = 128 spilled unseen
    in session 7); CI's covering set, the softcap at d = 128 without causal in each family."""
    mods = _gate.modifier_records()
    assert {s.source for s in mods} == {"fwd_sm90ws.cu", "fwd_sm90.cu", "bwd_sm90.cu"}
    assert 40 <= len(mods) <= 140
    every = {(s.source, s.expr) for s in _gate.records("sm_90a")}
    assert {(s.source, s.expr) for s in mods} <= every
    assert any("Variant<false, false, 2, " in s.expr for s in mods)       # the old softcap build
    covered = [(src, e) for src, e, a in _gate.covering(_gate.ARCHS) if (src, e) in
               {(s.source, s.expr) for s in mods}]
    assert sorted({src for src, _ in covered}) == ["bwd_sm90.cu", "fwd_sm90.cu", "fwd_sm90ws.cu"]
    # (the default softcap build on the H200: tanh.approx with the fixed offset, SOFTCAP 4, and
    # the per-element backward; the plain path's + 8 is opt-in since session 10's call 2)
    assert all("Variant<false, false, 4," in e and ", 128, " in e for _, e in covered)


@pytest.fixture(scope="module")
def chosen() -> set[tuple[str, str, str]]:
    jobs = _gate.covering(_gate.ARCHS)
    assert len(jobs) == len(set(jobs)), "a job chosen twice"
    return set(jobs)


def test_covering_is_a_subset_and_much_smaller(chosen):
    every = {(s.source, s.expr, arch) for arch in _gate.ARCHS for s in _gate.records(arch)}
    assert chosen <= every
    assert len(chosen) < len(every) / 2, (len(chosen), len(every))


def test_every_tile_configuration_variant_and_flag_is_compiled(full, chosen):
    """Rule 1: each (source, traits, Variant, flags) row is compiled at least once."""
    rows = {(s.source, s.factors[1:]) for s, _ in full}
    got = {(s.source, s.factors[1:]) for s, arch in full if (s.source, s.expr, arch) in chosen}
    assert rows == got, sorted(map(str, rows - got))[:5]


def test_every_dtype_and_arch_meets_every_option(full, chosen):
    """Rule 2: every element type and every arch with every value of every other factor."""
    def pairs(s, arch):
        (_, dt), rest = s.factors[0], s.factors[1:]
        return ({(s.source, "dtype", dt, f) for f in rest} | {(s.source, "arch", arch, f) for f in rest}
                | {(s.source, dt, arch)})
    need = set().union(*(pairs(s, a) for s, a in full))
    got = set().union(*(pairs(s, a) for s, a in full if (s.source, s.expr, a) in chosen))
    assert need == got, sorted(map(str, need - got))[:5]


def test_every_source_and_arch_of_the_registry_is_in_the_covering_set(full, chosen):
    assert {(s.source, a) for s, a in full} == {(src, a) for src, _, a in chosen}


def test_covering_is_deterministic():
    assert _gate.covering(_gate.ARCHS) == _gate.covering(_gate.ARCHS)


def test_specialisations_by_arch_partition_the_covering_set(chosen):
    per_arch = {(src, e, a) for a in _gate.ARCHS for src, e in _families.specialisations(a, "covering")}
    assert per_arch == chosen


def test_unknown_subset_and_arch_are_rejected():
    with pytest.raises(ValueError, match="subset must be 'all' or 'covering', got 'some'"):
        _families.specialisations("sm_80", "some")
    with pytest.raises(ValueError, match="unknown architecture 'sm80'"):
        _families.specialisations("sm80", "covering")


def test_the_gate_disassembles_the_attention_families_only():
    assert _gate._reads_sass("fwd_sm90.cu") and _gate._reads_sass("bwd_simt.cu")
    assert not any(map(_gate._reads_sass, ("bwd_prep.cu", "decode.cu", "combine.cu")))
