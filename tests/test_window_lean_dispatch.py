"""fwd_sm90's lean builds (session 11, ``CUFLASH_FWD90_LEAN``; bench/NOTES.md "the window's
instructions per visible pair"): which Variants the dispatcher gives it (the analytic window,
block masks), how it is spelled (a trailing template argument after PERSIST, so every other
build keeps its name), and the switch. No GPU: the dispatcher on the H200 profile."""
from __future__ import annotations

import pytest

from cuflash import _families, _jit, _traits
from cuflash._families import FAMILIES, PROFILES, Shape
from cuflash._variant import Variant


@pytest.fixture(autouse=True)
def _fwd_sm90_only(monkeypatch):
    """These are fwd_sm90's builds: keep the dispatcher off fwd_sm90ws, which takes d 128
    (and long d 64) problems by default since session 16."""
    monkeypatch.setenv("CUFLASH_FWD90_WS", "0")


H200 = PROFILES["h200"]


def choice(d=64, L=4096, **v):
    return _families.choose("fwd", Shape("bfloat16", 32, L, L, d, d, Variant(**v)), H200)


def test_the_window_is_lean_with_the_switch(monkeypatch):
    """On by default since session 12's H200 run, as with ``CUFLASH_FWD90_LEAN=1``; "0" gives
    no Variant the lean builds (session 10's names)."""
    monkeypatch.delenv("CUFLASH_FWD90_PERSIST", raising=False)
    monkeypatch.setenv("CUFLASH_FWD90_LEAN", "0")
    for d in (64, 128):
        assert choice(d, causal=True, window=True).traits["lean"] == 0
        assert bmask(d).traits["lean"] == 0
    monkeypatch.delenv("CUFLASH_FWD90_LEAN")
    for d in (64, 128):
        assert choice(d, causal=True, window=True).traits["lean"] == 1
        assert bmask(d).traits["lean"] == (1 if d == 64 else 3)   # (3: d 128's list read)
    for d in (64, 128, 256):
        for L in (4096, 4000):          # the EVEN build and the predicated one
            for causal in (True, False):
                c = choice(d, L, causal=causal, window=True)
                assert c.family.name == "fwd_sm90" and c.traits["lean"] == 1
                assert c.expr.endswith(", 0, 1>") and any("lean" in r for r in c.reasons)
    # a score transform beside the window: not lean (d 64's registers past 128, one block an SM)
    assert choice(causal=True, window=True, softcap=True).traits["lean"] == 0
    assert choice(window=True, alibi_slopes=True).traits["lean"] == 0
    # plain attention keeps its name; the element masks and block masks are not lean
    assert choice(causal=True).expr == ("cuflash::sm90::fwd_sm90<__nv_bfloat16, 64, 64, 2, 2, "
                                        "cuflash::Variant<true>, true>")
    assert choice(causal=True).traits["lean"] == 0
    assert choice(causal=True, window=True, mask=True).traits["lean"] == 0


def bmask(d=64, causal=True):
    v = Variant(causal=causal, mask_mod="cuflash::user::documents", block_mask=True)
    return _families.choose("fwd", Shape("bfloat16", 32, 4096, 4096, d, d, v, False, 320), H200)


def test_the_switch(monkeypatch):
    monkeypatch.setenv("CUFLASH_FWD90_LEAN", "1")
    assert bmask().traits["lean"] == 1 and bmask(128, False).traits["lean"] == 3   # (short offsets;
    # 3 at d 128: session 11's list read, CUFLASH_FWD90_BMASK_EARLY's default there)
    monkeypatch.setenv("CUFLASH_FWD90_LEAN", "window")
    assert choice(causal=True, window=True).traits["lean"] == 1 and bmask().traits["lean"] == 0
    monkeypatch.setenv("CUFLASH_FWD90_LEAN", "bmask")
    assert choice(causal=True, window=True).traits["lean"] == 0 and bmask().traits["lean"] == 1
    monkeypatch.setenv("CUFLASH_FWD90_LEAN", "0")
    c = choice(causal=True, window=True)
    assert c.traits["lean"] == 0 and c.expr.endswith("false, false>, true>")   # session 10's name
    assert bmask().traits["lean"] == 0
    monkeypatch.setenv("CUFLASH_FWD90_LEAN", "yes")
    with pytest.raises(ValueError, match="CUFLASH_FWD90_LEAN"):
        choice(causal=True, window=True)


def test_lean_with_the_persistent_schedule_and_tile_overrides(monkeypatch):
    monkeypatch.setenv("CUFLASH_FWD90_LEAN", "1")
    monkeypatch.setenv("CUFLASH_FWD90_PERSIST", "window")
    c = _families.choose("fwd", Shape("bfloat16", 128, 4096, 4096, 64, 64,
                                      Variant(causal=True, window=True)), H200)
    assert c.traits["persist"] == 1 and c.traits["lean"] == 1 and c.expr.endswith(", true, 1, 1>")
    monkeypatch.delenv("CUFLASH_FWD90_PERSIST")
    # CUFLASH_TILES may leave the schedule's arguments out (persist, lean), or give persist
    monkeypatch.setenv("CUFLASH_TILES", "fwd_sm90:128=64:2:1")
    c = choice(128, causal=True, window=True)
    assert c.traits["warpgroups"] == 2 and c.traits["lean"] == 1 and c.expr.endswith(", 2, 1, "
           "cuflash::Variant<true, true, false, false, void, false, cuflash::NoScoreMod, "
           "cuflash::NoMaskMod, false, false>, true, 0, 1>")
    monkeypatch.setenv("CUFLASH_TILES", "fwd_sm90:128=64:2:1:0")
    assert choice(128, causal=True, window=True).traits["lean"] == 1


def test_lean_traits_smem_match_the_kernel():
    """LEAN spelled after PERSIST (also with it) names the same Sm90Traits figure as without:
    Traits.smem_bytes against the kernel's own, through NVRTC static_asserts (no GPU)."""
    fam = FAMILIES["fwd_sm90"]
    try:
        nvrtc = _jit._nvrtc_for("sm_90a")
    except _jit.KernelCompileError as exc:
        pytest.skip(str(exc))
    entries = {t.replace(lean=1) for t in _traits.TABLES["fwd_sm90"].values()}
    entries |= {t.replace(persist=1) for t in entries if t.head_dim <= _traits.FWD_SM90_PERSIST_MAX_HEAD_DIM}
    assert all(", 1>" in fam.smem_check(t) for t in entries)
    checks = [f'static_assert({fam.smem_check(t)} == {t.smem_bytes}, "{t.describe()}");' for t in entries]
    src = (_jit.load_source(fam.source) + "\nnamespace cuflash_probe {\n" + "\n".join(checks)
           + "\n__global__ void probe() {}\n}\n")
    log, lowered, _ = nvrtc.compile(src, "probe.cu", ["cuflash_probe::probe"], _jit._options("sm_90a"))
    assert lowered is not None, log
