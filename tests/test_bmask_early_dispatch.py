"""fwd_sm90's block-mask list read at the top of a key tile (session 12,
``CUFLASH_FWD90_BMASK_EARLY``, bench/NOTES.md "the block-mask forward's list read (session 12)"):
which builds the dispatcher gives it (a block mask's lean build: ``lean`` 1 reads early, 3 is
session 11's loop), the switch, and that nothing else changes name. No GPU: the dispatcher on
the H200 profile."""
from __future__ import annotations

import pytest

from cuflash import _families
from cuflash._families import PROFILES, Shape
from cuflash._variant import Variant


@pytest.fixture(autouse=True)
def _fwd_sm90_only(monkeypatch):
    """These are fwd_sm90's builds: keep the dispatcher off fwd_sm90ws, which takes d 128
    (and long d 64) problems by default since session 16."""
    monkeypatch.setenv("CUFLASH_FWD90_WS", "0")


H200 = PROFILES["h200"]


def bmask(d=64, causal=False, keys=2224, **more):
    v = Variant(causal=causal, mask_mod="cuflash::user::prefix", block_mask=True, **more)
    return _families.choose("fwd", Shape("bfloat16", 128, 4096, 4096, d, d, v, False, keys), H200)


def window(d=64):
    return _families.choose("fwd", Shape("bfloat16", 128, 4096, 4096, d, d,
                                         Variant(causal=True, window=True)), H200)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("early", ["", "1"])
def test_the_lean_block_mask_reads_its_list_early_at_d64_by_default(monkeypatch, d, early):
    """Unset: early at d 64 only (session 12's H200 run: d 128's documents lost 7%); "1":
    at every head dim."""
    monkeypatch.setenv("CUFLASH_FWD90_LEAN", "1")
    monkeypatch.setenv("CUFLASH_FWD90_BMASK_EARLY", early)
    lean = 1 if (d == 64 or early == "1") else 3
    for causal in (False, True):
        for keys in (2224, 320):            # long lists (min_blocks 1 at d 64) and short ones
            c = bmask(d, causal, keys)
            assert c.traits["lean"] == lean and c.expr.endswith(f", 0, {lean}>")
            assert any("CUFLASH_FWD90_BMASK_EARLY" in r for r in c.reasons) == (lean == 1)
    monkeypatch.setenv("CUFLASH_FWD90_BMASK_EARLY", "0")   # session 11's lean loop
    c = bmask(d)
    assert c.traits["lean"] == 3 and c.expr.endswith(", 0, 3>")
    assert not any("CUFLASH_FWD90_BMASK_EARLY" in r for r in c.reasons)


def test_only_lean_block_masks_change(monkeypatch):
    monkeypatch.setenv("CUFLASH_FWD90_LEAN", "1")
    for early in ("0", "1"):
        monkeypatch.setenv("CUFLASH_FWD90_BMASK_EARLY", early)
        assert window().traits["lean"] == 1                         # the window: its own loop
        assert _families.choose("fwd", Shape("bfloat16", 128, 4096, 4096, 64, 64,
                                             Variant(causal=True)), H200).expr == (
            "cuflash::sm90::fwd_sm90<__nv_bfloat16, 64, 64, 2, 2, cuflash::Variant<true>, true>")
        assert bmask(softcap=True).traits["lean"] == 0              # not a lean block mask
    for lean in ("0", "window"):                                    # block masks not lean
        monkeypatch.setenv("CUFLASH_FWD90_LEAN", lean)
        assert bmask().traits["lean"] == 0


def test_the_switch_rejects_other_values(monkeypatch):
    monkeypatch.setenv("CUFLASH_FWD90_LEAN", "1")
    monkeypatch.setenv("CUFLASH_FWD90_BMASK_EARLY", "yes")
    with pytest.raises(ValueError, match="CUFLASH_FWD90_BMASK_EARLY"):
        bmask()


def test_lean_3_spells_and_sizes_like_lean_1(monkeypatch):
    """The smem expression a plan asks NVRTC about spells LEAN 3 like 1 (no tile size depends
    on it): the same template string with the last argument changed."""
    monkeypatch.setenv("CUFLASH_FWD90_LEAN", "1")
    monkeypatch.delenv("CUFLASH_FWD90_BMASK_EARLY", raising=False)
    lean1 = _families.choose("fwd", Shape("bfloat16", 128, 4096, 4096, 64, 64, Variant(
        mask_mod="cuflash::user::prefix", block_mask=True), False, 2224), H200)
    t3 = lean1.traits.replace(lean=3)
    fam = _families.FAMILIES["fwd_sm90"]
    e1, e3 = (fam.smem_expr.format(T="__nv_bfloat16", **_families._spelled(dict(t.args)))
              for t in (lean1.traits, t3))
    assert e1.endswith(", 0, 1>::kSmemBytes") and e3 == e1.replace(", 0, 1>::", ", 0, 3>::")
