"""Which kernel family, traits and flags the dispatcher picks, forward and backward, and what the
registry lists for the compile gate (CPU only: dispatch needs no GPU, only a DeviceInfo)."""

from __future__ import annotations

import ml_dtypes
import numpy
import pytest

from cuflash import _families, _jit, _plan, _problem, _traits
from cuflash._families import FAMILIES, PROFILES, DeviceInfo, Shape
from cuflash._variant import Variant

BF16, F16 = "bfloat16", "float16"
H200, A100 = PROFILES["h200"], PROFILES["a100"]
RTX = DeviceInfo(89, 128, 101376)          # sm_89: 99 KB of shared memory a block
VOLTA = DeviceInfo(70, 80, 98304)


@pytest.fixture(autouse=True)
def _no_overrides(monkeypatch):
    for var in ("CUFLASH_FWD", "CUFLASH_BWD", "CUFLASH_TILES", "CUFLASH_GRID_ORDER",
                "CUFLASH_FWD90_WS"):
        monkeypatch.delenv(var, raising=False)


def shape(dtype=BF16, d=128, dv=None, *, nbatch=64, Lq=1024, Lk=None, causal=False, det=False):
    return Shape(dtype, nbatch, Lq, Lq if Lk is None else Lk, d, d if dv is None else dv,
                 Variant(causal), det)


def fwd(dev=H200, **kw):
    return _families.choose("fwd", shape(**kw), dev)


def bwd(dev=H200, **kw):
    return _families.choose("bwd", shape(**kw), dev)


# -- forward -----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.parametrize("d, bucket", [(33, 64), (64, 64), (72, 128), (128, 128), (129, 192),
                                       (256, 256)])
def test_forward_hopper_takes_wgmma(dtype, d, bucket):
    # (the warp-specialised build where session 16 measured it faster: d 128 at this shape)
    name = "fwd_sm90ws" if bucket == 128 else "fwd_sm90"
    c = fwd(dtype=dtype, d=d)
    assert c.family.name == name and c.traits.head_dim == bucket
    assert c.expr.startswith(f"cuflash::sm90::{name}<{_families.ctype(dtype)}, {bucket},")
    assert c.traits.smem_bytes <= H200.smem_optin


def _ws_shape(d=128, nbatch=64, L=4096, **variant):
    return Shape("bfloat16", nbatch, L, L, d, d, Variant(**variant))


def test_forward_warp_specialised_where_it_measured_faster(monkeypatch):
    """fwd_sm90ws's default rule (cuflash/_fwd_ws.py, session 16's probe): d 128 on a grid that
    fills the SMs; d 64 without a window where a block walks >= 16 key tiles on average."""
    ws = lambda **kw: _families.choose("fwd", _ws_shape(**kw), H200)   # noqa: E731
    assert ws().family.name == "fwd_sm90ws" and ws(causal=True).family.name == "fwd_sm90ws"
    assert ws(causal=True, softcap=True, sink=True).family.name == "fwd_sm90ws"
    assert ws(causal=True, window=True).family.name == "fwd_sm90ws"
    assert ws(d=64, causal=True, window=True).family.name == "fwd_sm90"
    assert ws(nbatch=2, L=1024).family.name == "fwd_sm90"             # 16 blocks
    assert ws(d=64).family.name == "fwd_sm90ws"                         # 32 tiles a block
    assert ws(d=64, causal=True).family.name == "fwd_sm90ws"            # 16 on average
    assert ws(d=64, causal=True, L=2048, nbatch=128).family.name == "fwd_sm90"   # 8
    assert ws(d=64, L=16384, nbatch=8, causal=True).family.name == "fwd_sm90ws"
    assert ws(d=64, softcap=True, L=16384).family.name == "fwd_sm90ws"  # its spill-free build
    assert ws(d=64, softcap=True, L=16100).family.name == "fwd_sm90"    # predicated: spills
    assert ws(d=64, softcap=True, L=1024, nbatch=256).family.name == "fwd_sm90"   # 8 tiles
    assert ws(d=64, alibi_slopes=True, alibi_raw=False).family.name == "fwd_sm90"   # likewise
    assert ws(d=64, alibi_slopes=True).family.name == "fwd_sm90ws"
    assert ws(d=256).family.name == "fwd_sm90"                          # no tiles
    assert ws(bias="bfloat16").family.name == "fwd_sm90"
    why = "\n".join(ws(d=64, causal=True, window=True).reasons)
    assert "fwd_sm90ws: not used, the window at d = 64 measured" in why and "WS=1 takes it" in why
    monkeypatch.setenv("CUFLASH_FWD90_WS", "1")
    assert ws(d=64, causal=True, window=True).family.name == "fwd_sm90ws"
    assert ws(nbatch=2, L=1024).family.name == "fwd_sm90ws"
    # the d 64 softcap's one build without local memory (softcap alone, whole key tiles:
    # _fwd_ws.softcap_d64_spill_free, session 19), the only one forcing takes; the others spill
    assert ws(d=64, softcap=True, L=1024, nbatch=256).family.name == "fwd_sm90ws"
    assert ws(d=64, softcap=True, L=4000).family.name == "fwd_sm90"     # predicated: 8 bytes
    assert ws(d=64, softcap=True, causal=True).family.name == "fwd_sm90"   # 16 bytes
    assert ws(d=64, softcap=True, sink=True).family.name == "fwd_sm90"
    monkeypatch.setenv("CUFLASH_FWD90_WS", "0")
    assert ws().family.name == "fwd_sm90"
    monkeypatch.setenv("CUFLASH_FWD90_WS", "yes")
    with pytest.raises(ValueError, match="CUFLASH_FWD90_WS='yes': expected 0, 1 or auto"):
        ws()
    monkeypatch.delenv("CUFLASH_FWD90_WS")
    monkeypatch.setenv("CUFLASH_FWD", "sm90ws")
    assert ws(d=64, causal=True).family.name == "fwd_sm90ws"
    monkeypatch.setenv("CUFLASH_FWD", "sm90")
    assert ws().family.name == "fwd_sm90"


def test_forward_warp_specialised_persistent_schedule(monkeypatch):
    """fwd_sm90ws's persistent grid (sessions 17-18, _fwd_ws.persist_default): by default the
    host's longest-first lists for the window, round-robin for items of <= 8 key tiles and the
    softcap without causal, none for long causal or plain items, where the grid has more query
    tiles than SMs; d 128 only;
    CUFLASH_FWD90WS_PERSIST forces or turns it off; a grid that would not be smaller than the
    items keeps one block a tile; varlen builds never take it."""
    from cuflash import _inference_varlen
    ws = lambda **kw: _families.choose("fwd", _ws_shape(**kw), H200)   # noqa: E731
    persist = lambda **kw: ws(**kw).traits["persist"]   # noqa: E731
    assert persist(causal=True, window=True) == 3 and persist(window=True) == 3
    why = "\n".join(ws(causal=True, window=True).reasons)
    assert "persistent (longest first, the host's lists): 132 blocks run the 2048 query tiles" in why
    assert persist(causal=True) == 0 and persist() == 0                 # 16 / 32 key tiles
    assert persist(L=1024, nbatch=256) == 1 and persist(causal=True, L=2048, nbatch=128) == 1
    assert persist(L=2048, nbatch=128) == 0                             # 16 key tiles
    assert persist(softcap=True) == 1 and persist(softcap=True, causal=True) == 0
    assert persist(d=64, window=True, L=1024, nbatch=256) == 0          # (its builds spill)
    assert persist(window=True, causal=True, nbatch=5, L=4096) == 3     # 160 tiles > 132 SMs
    monkeypatch.setenv("CUFLASH_FWD90_WS", "1")
    assert persist(window=True, causal=True, nbatch=4, L=4096) == 0     # 128 tiles <= 132 SMs
    assert ws().expr.endswith(", true>")                                # the default build's name
    monkeypatch.setenv("CUFLASH_FWD90WS_PERSIST", "2")
    t = ws(causal=True).traits
    assert t.smem_bytes == t.replace(persist=0).smem_bytes + 128 * 128 * 2 + 24
    assert _families.fwd_sm90_grid(t, 2048, H200) == 132
    assert "persist" not in ws(causal=True).expr.split("Variant")[0]   # (trailing, after EVEN)
    assert ws(causal=True).expr.endswith(", true, 2>")
    monkeypatch.setenv("CUFLASH_FWD90WS_PERSIST", "1")
    assert persist() == 1 and persist(causal=True) == 1 and persist(window=True) == 1
    monkeypatch.setenv("CUFLASH_FWD90WS_PERSIST", "0")
    assert persist(causal=True) == 0
    monkeypatch.setenv("CUFLASH_FWD90WS_PERSIST", "3")                 # the host's lists
    assert persist(causal=True) == 3 and "longest first" in "\n".join(ws(causal=True).reasons)
    assert ws(causal=True).expr.endswith(", true, 3>")
    monkeypatch.setenv("CUFLASH_FWD90WS_PERSIST", "4")
    with pytest.raises(ValueError, match="CUFLASH_FWD90WS_PERSIST='4': expected 0, 1, 2, 3 or auto"):
        ws(causal=True)
    monkeypatch.delenv("CUFLASH_FWD90WS_PERSIST")
    monkeypatch.setenv("CUFLASH_FWD90_PERSIST_GRID", "3")               # a third as many blocks
    assert persist(window=True, causal=True, nbatch=4, L=4096) == 3
    monkeypatch.delenv("CUFLASH_FWD90_PERSIST_GRID")
    monkeypatch.delenv("CUFLASH_FWD90_WS")
    monkeypatch.setenv("CUFLASH_TILES", "fwd_sm90ws:128=128:2:2:1:0")   # persist left out: the rule's
    assert persist(window=True) == 3 and persist(causal=True) == 0
    monkeypatch.setenv("CUFLASH_TILES", "fwd_sm90ws:128=128:2:2:1:0:1")  # ... or set: kept
    assert persist(causal=True) == 1
    monkeypatch.delenv("CUFLASH_TILES")

    class Packed:   # what _inference_varlen.choose reads of a packed problem
        dtype = numpy.dtype("float16")
    choice = ws(causal=True, window=True)
    monkeypatch.setattr(_inference_varlen, "Shape", type("S", (), {"of": staticmethod(lambda p: _ws_shape(causal=True))}))
    _, t, expr, _ = _inference_varlen.choose(Packed(), H200, choice)
    assert t["persist"] == 0 and expr.endswith(", false>"), expr


def test_forward_other_gpus_and_small_heads_take_mma_sync_or_simt():
    assert fwd(d=32).family.name == "fwd_sm80"
    assert fwd(dev=A100).family.name == "fwd_sm80"
    assert fwd(dev=RTX).family.name == "fwd_sm80"
    assert fwd(dev=VOLTA).family.name == "fwd_simt"
    for dtype in ("float32", "float64"):
        assert fwd(dtype=dtype).family.name == "fwd_simt"


def test_forward_even_only_for_whole_key_tiles():
    assert fwd().flag == {"even": True}
    assert fwd(Lq=1000, Lk=1024).flag == {"even": True}     # Q rows: always predicated
    assert fwd(Lq=1024, Lk=1000).flag == {"even": False}
    assert fwd(d=120).flag == {"even": False}                 # padded bucket
    assert fwd(dev=A100, d=64, Lk=1000).flag == {"even": False}
    assert fwd(dev=A100, d=128).flag == {"even": False}       # allow_even=False entry


def test_forward_small_grids_use_smaller_blocks(monkeypatch):
    monkeypatch.setenv("CUFLASH_FWD90_WS", "0")   # (fwd_sm90's rule; fwd_sm90ws has one block size)
    big, small = fwd(nbatch=256), fwd(nbatch=2)
    assert small.family is big.family and small.traits.block_m == 64 < big.traits.block_m
    assert fwd(dev=A100, nbatch=2).traits.block_m == 64 < fwd(dev=A100).traits.block_m


def test_forward_sm80_non_causal_entries():
    assert fwd(dev=A100, d=64).traits["slices"] == 2
    assert fwd(dev=A100, d=64, causal=True).traits["slices"] == 1


# -- backward ----------------------------------------------------------------------------------

@pytest.mark.parametrize("d, dv, bucket", [(33, 33, 64), (40, 64, 64), (65, 65, 128),
                                           (24, 96, 128), (128, 128, 128)])
@pytest.mark.parametrize("causal", [False, True])
def test_backward_hopper_takes_wgmma(d, dv, bucket, causal):
    c = bwd(d=d, dv=dv, causal=causal)
    assert c.family.name == "bwd_sm90" and c.traits == _traits.BWD_SM90[(bucket, causal)]
    assert _plan.grid_order(c, causal) == int(causal)


@pytest.mark.parametrize("d, bucket", [(1, 32), (32, 32), (40, 64), (72, 96), (111, 128)])
def test_backward_sm80_buckets(d, bucket):
    for det in (False, True):
        c = bwd(dev=A100, d=d, det=det)
        assert c.family.name == "bwd_sm80" and c.traits == _traits.BWD_SM80[bucket]
        assert c.flag == {"deterministic": det}


def test_backward_outside_bwd_sm90():
    assert bwd(d=32).family.name == "bwd_sm80"                 # the 64 bucket would waste half
    assert bwd(d=64, det=True).family.name == "bwd_sm80"       # ordered dQ: bwd_sm80 only
    assert bwd(d=160).family.name == "bwd_simt"
    assert bwd(dev=RTX, d=64).family.name == "bwd_sm80"        # 81 KB fits in 99 KB
    assert bwd(dev=RTX, d=96).family.name == "bwd_simt"        # 113 KB does not
    assert bwd(dtype="float32").family.name == "bwd_simt"
    assert _plan.grid_order(bwd(d=64, det=True, causal=True), True) == 0


def _bwd_mods(d, causal=True, **mods):
    return _families.choose("bwd", Shape(BF16, 64, 4096, 4096, d, d, Variant(causal, **mods), False),
                            H200)


@pytest.mark.parametrize("d, bucket", [(64, 64), (128, 128)])
def test_backward_modifiers_on_hopper_take_wgmma_where_they_fit(d, bucket):
    """bwd_sm90 takes the modifiers _traits.BWD_SM90_MODIFIERS lists for the head-dim bucket
    (64-row query tiles where the per-element code runs), bwd_sm80 the others; the window,
    the sink and ALiBi (the plain path) keep the plain tiles."""
    for feats in frozenset().union(*_traits.BWD_SM90_MODIFIERS[bucket]):
        kw = {"bias": "__nv_bfloat16"} if feats == "bias" else (
            {"score_mod": "cuflash::user::S"} if feats == "score_mod" else (
                {"mask_mod": "cuflash::user::M"} if feats == "mask_mod" else {feats: True}))
        c = _bwd_mods(d, **kw)
        assert c.family.name == "bwd_sm90", (feats, c.reasons)
        assert c.traits.block_m == (_traits.BWD_SM90[(bucket, True)].block_m
                                    if feats in ("window", "sink", "alibi_slopes") else 64)
    assert _bwd_mods(d, window=True).traits == _traits.BWD_SM90[(bucket, True)]
    c = _bwd_mods(d, mask=True)                      # a bool mask array: bwd_sm80 everywhere
    assert c.family.name == "bwd_sm80"
    assert any("bwd_sm90: not used, does not implement mask" in r for r in c.reasons)
    assert _bwd_mods(d, score_mod="cuflash::user::S").family.name == "bwd_sm80"
    # a dense bias (session 8): bwd_sm90 at d = 64 (with softcap, ALiBi, the sink) and at
    # d = 128 without causal (with the sink); bwd_sm80 at d = 128 causal (8 bytes of spill)
    # and with a window
    assert _bwd_mods(d, bias="float").family.name == ("bwd_sm90" if bucket == 64 else "bwd_sm80")
    for causal in (False, True):
        assert _bwd_mods(d, causal, bias="float", window=True).family.name == "bwd_sm80"
    c = _bwd_mods(d, False, bias="float", sink=True)
    assert c.family.name == "bwd_sm90" and c.traits.block_m == 64, c.reasons
    if bucket == 64:
        c = _bwd_mods(d, bias="float", softcap=True, alibi_slopes=True, sink=True)
        assert c.family.name == "bwd_sm90" and c.traits.block_m == 64, c.reasons
    # ALiBi on the plain path, with everything that path combines, at every bucket and both
    # causal settings: the plain table's tiles
    for causal in (False, True):
        c = _bwd_mods(d, causal, alibi_slopes=True, window=True, sink=True)
        assert c.family.name == "bwd_sm90", c.reasons
        assert c.traits == _traits.BWD_SM90[(bucket, causal)]
    if bucket == 128:
        assert _bwd_mods(d, mask_mod="cuflash::user::M").family.name == "bwd_sm80"
        # softcap with ALiBi needs the per-element path, which spills with ALiBi at d = 128
        c = _bwd_mods(d, alibi_slopes=True, softcap=True)
        assert c.family.name == "bwd_sm80"
        assert any("bwd_sm90: not used, does not run alibi_slopes, softcap together" in r
                   for r in c.reasons), c.reasons
        # softcap with the window: since session 8 it spills at d = 128 (8-24 bytes)
        assert _bwd_mods(d, window=True, softcap=True, sink=True).family.name == "bwd_sm80"
        assert _bwd_mods(d, softcap=True, sink=True).family.name == "bwd_sm90"
    else:
        assert _bwd_mods(d, alibi_slopes=True, softcap=True).family.name == "bwd_sm90"
        assert _bwd_mods(d, window=True, softcap=True, sink=True).family.name == "bwd_sm90"


# -- both: overrides and explanations -----------------------------------------------------------

def test_family_overrides(monkeypatch):
    monkeypatch.setenv("CUFLASH_FWD", "sm80")
    monkeypatch.setenv("CUFLASH_BWD", " SIMT ")
    assert fwd().family.name == "fwd_sm80"
    assert bwd().family.name == "bwd_simt"
    monkeypatch.setenv("CUFLASH_BWD", "sm80")
    assert bwd(d=256).family.name == "bwd_simt"                # falls through
    monkeypatch.setenv("CUFLASH_FWD", "bogus")
    with pytest.raises(ValueError, match=r"CUFLASH_FWD='bogus'.*'auto', 'sm90ws', 'sm90', 'sm80', 'simt'"):
        fwd()


def test_tile_override(monkeypatch):
    monkeypatch.setenv("CUFLASH_TILES", "bwd_sm90:64=64:1:2; fwd_sm80:128=64:4:1:1")
    assert bwd(d=50).expr == ("cuflash::sm90::bwd_sm90<__nv_bfloat16, 64, 64, 1, 2, "
                              "cuflash::Variant<false>, false>")
    assert bwd(d=128).traits == _traits.BWD_SM90[(128, False)]
    assert fwd(dev=A100).traits["warps"] == 4
    monkeypatch.setenv("CUFLASH_TILES", "fwd_sm80:128=64:4")
    with pytest.raises(ValueError, match="needs 4 values"):
        fwd(dev=A100)


def test_dq_finishing_fused_in_one_wave_backwards(monkeypatch):
    """bwd_sm90's fuse_dq build (dQ rounded by the main kernel, no bwd_finish_dq launch) for
    plain attention whose backward is one wave of blocks; the kernel without it above (and for
    the modifiers, and on the other families); CUFLASH_FUSE_DQ=0/1 forces it, anything else is
    an error naming it. A plan drops the launch only where dq is the result itself."""
    import cuflash
    from cuflash._families import fuse_dq_finish
    monkeypatch.delenv("CUFLASH_FUSE_DQ", raising=False)
    small, large = bwd(d=128, nbatch=16), bwd(d=128, nbatch=32)     # 128 and 256 key-tile blocks
    assert small.flag["fuse_dq"] and small.expr.endswith("cuflash::Variant<false>, true>")
    assert not large.flag["fuse_dq"] and large.expr.endswith("cuflash::Variant<false>, false>")
    assert "one wave of blocks: dQ rounded by the main kernel" in "\n".join(small.reasons)
    assert fuse_dq_finish(small, True, 1)
    assert not fuse_dq_finish(small, False, 1) and not fuse_dq_finish(small, True, 2)
    assert not fuse_dq_finish(large, True, 1)
    assert "fuse_dq" not in bwd(d=128, Lq=64, det=True).flag              # bwd_sm80
    windowed = Shape(BF16, 1, 64, 64, 64, 64, Variant(False, window=True))
    assert not _families.choose("bwd", windowed, H200).flag["fuse_dq"]
    q = numpy.broadcast_to(numpy.zeros((), ml_dtypes.bfloat16), (1, 4, 256, 128))
    assert "dQ rounded by the main kernel" in cuflash.explain(q, q, q, backward=True)
    k = numpy.broadcast_to(numpy.zeros((), ml_dtypes.bfloat16), (2, 4, 256, 128))
    assert cuflash.explain(q, k, k, backward=True).endswith("dQ rounded by bwd_finish_dq")
    monkeypatch.setenv("CUFLASH_FUSE_DQ", "0")
    assert not bwd(d=128, Lq=64).flag["fuse_dq"]
    monkeypatch.setenv("CUFLASH_FUSE_DQ", "1")
    assert bwd(d=128, nbatch=64).flag["fuse_dq"]
    monkeypatch.setenv("CUFLASH_FUSE_DQ", "yes")
    with pytest.raises(ValueError, match="CUFLASH_FUSE_DQ='yes': expected 0 or 1"):
        bwd(d=128)


def test_one_launch_backward_for_short_queries(monkeypatch):
    """bwd_sm90's one_launch build (D and the re-zeroing of dQ's accumulator in the main
    kernel: cuflash/_plan_one.py) for fuse_dq problems with at most ONE_LAUNCH_MAX_LQ query
    rows, spelled as a trailing argument; CUFLASH_BWD_ONE_LAUNCH=0/1 forces it (1: wherever
    fuse_dq), anything else is an error naming it."""
    from cuflash._overrides import ONE_LAUNCH_MAX_LQ
    for name in ("CUFLASH_BWD_ONE_LAUNCH", "CUFLASH_FUSE_DQ"):
        monkeypatch.delenv(name, raising=False)
    short = bwd(d=64, nbatch=1, Lq=64)
    assert short.flag["one_launch"] and short.flag["fuse_dq"]
    assert short.expr.endswith("cuflash::Variant<false>, true, true>")
    assert "no bwd_dot_do_o launch" in "\n".join(short.reasons)
    long = bwd(d=64, nbatch=1, Lq=ONE_LAUNCH_MAX_LQ + 1)
    assert long.flag["fuse_dq"] and not long.flag["one_launch"]
    assert long.expr.endswith("cuflash::Variant<false>, true>")
    assert not bwd(d=64, nbatch=256, Lq=256).flag["one_launch"]       # not one wave
    windowed = Shape(BF16, 1, 64, 64, 64, 64, Variant(False, window=True))
    assert not _families.choose("bwd", windowed, H200).flag["one_launch"]
    assert "one_launch" not in bwd(d=64, Lq=64, det=True).flag        # bwd_sm80
    monkeypatch.setenv("CUFLASH_BWD_ONE_LAUNCH", "0")
    assert not bwd(d=64, nbatch=1, Lq=64).flag["one_launch"]
    monkeypatch.setenv("CUFLASH_BWD_ONE_LAUNCH", "1")
    assert bwd(d=64, nbatch=1, Lq=4096).flag["one_launch"]
    monkeypatch.setenv("CUFLASH_BWD_ONE_LAUNCH", "yes")
    with pytest.raises(ValueError, match="CUFLASH_BWD_ONE_LAUNCH='yes': expected 0 or 1"):
        bwd(d=64, nbatch=1, Lq=64)


def test_grid_order_override(monkeypatch):
    monkeypatch.setenv("CUFLASH_GRID_ORDER", "0")
    assert _plan.grid_order(fwd(causal=True), True) == 0


def test_choice_says_why():
    c = bwd(d=64, det=True)
    text = _plan.explain_choice(c)
    assert "bwd_sm90: not used" in text and "bwd_sm80:" in text and c.expr in text


def test_no_family_is_a_clear_error():
    with pytest.raises(ValueError, match="no fwd kernel family"):
        _families.choose("fwd", shape(d=300), H200)


# -- the registry and the compile gate -----------------------------------------------------------

def test_every_choice_is_in_the_gate():
    """Whatever choose() returns (without overrides) is one of the gate's specialisations."""
    listed = {a: {e for _, e in _families.specialisations(a)} for a in ("sm_80", "sm_90a")}
    for dev, arch in ((A100, "sm_80"), (H200, "sm_90a")):
        for dtype in (BF16, F16, "float32", "float64"):
            for d in (8, 40, 64, 100, 128, 200, 256):
                for causal in (False, True):
                    for nb, L in ((1, 100), (64, 1024)):
                        assert fwd(dev, dtype=dtype, d=d, causal=causal, nbatch=nb,
                                   Lq=L).expr in listed[arch]
                        for det in (False, True):
                            assert bwd(dev, dtype=dtype, d=d, causal=causal, det=det,
                                       nbatch=nb, Lq=L).expr in listed[arch]


def test_gate_lists_families_per_arch():
    src = {a: {s for s, _ in _families.specialisations(a)} for a in ("sm_70", "sm_80", "sm_90a")}
    assert src["sm_70"] == {"fwd_simt.cu", "bwd_simt.cu", "bwd_prep.cu",
                           "decode.cu", "combine.cu"}   # inference: plain FMA, any arch
    assert src["sm_80"] == src["sm_70"] | {"fwd_sm80.cu", "bwd_sm80.cu",
                                           "decode_mma.cu"}   # inference: tensor-core decode
    assert src["sm_90a"] == src["sm_80"] | {"fwd_sm90ws.cu", "fwd_sm90.cu", "bwd_sm90.cu"}
    for a in src:
        sp = _families.specialisations(a)
        assert len(sp) == len(set(sp))
    with pytest.raises(ValueError, match="unknown architecture 'foo'"):
        _families.specialisations("foo")


@pytest.mark.parametrize("name", sorted(_traits.TABLES))
def test_traits_smem_match_the_kernel(name):
    """Traits.smem_bytes equals the kernel traits struct's own figure, for every table entry
    (NVRTC static_asserts, no GPU): the one formula written on both sides."""
    fam = FAMILIES[name]
    arch = "sm_90a" if fam.min_cc == 90 else "sm_80"
    try:
        nvrtc = _jit._nvrtc_for(arch)
    except _jit.KernelCompileError as exc:
        pytest.skip(str(exc))
    entries = set(_traits.TABLES[name].values())
    if name == "fwd_sm80":
        entries |= {_traits.small_grid(t) for t in entries}
    if name == "fwd_sm90":   # the persistent builds' second Q buffer (session 10)
        entries |= {t.replace(persist=1) for t in entries
                    if t.head_dim <= _traits.FWD_SM90_PERSIST_MAX_HEAD_DIM}
    checks = [f'static_assert({fam.smem_check(t)} == {t.smem_bytes}, "{t.describe()}");'
              for t in entries]
    src = (_jit.load_source(fam.source) + "\nnamespace cuflash_probe {\n" + "\n".join(checks)
           + "\n__global__ void probe() {}\n}\n")
    log, lowered, _ = nvrtc.compile(src, "probe.cu", ["cuflash_probe::probe"], _jit._options(arch))
    assert lowered is not None, log


def test_params_layout_matches_the_struct():
    """_launch.PARAMS mirrors cuflash::Params (and its VariantParams) field for field."""
    from cuflash import _launch
    from _layout import assert_struct_matches
    assert_struct_matches("common.cuh", "cuflash", "Params", _launch.PARAMS,
                          nested={"var": "VariantParams"})


def test_explain_and_its_command():
    """cuflash.explain and ``python -m cuflash info --explain`` print the choice and why."""
    import cuflash
    from cuflash.__main__ import main
    q = numpy.broadcast_to(numpy.zeros((), ml_dtypes.bfloat16), (4, 16, 1024, 128))
    text = cuflash.explain(q, q, q, causal=True)
    assert "fwd_sm90ws<__nv_bfloat16, 128, 128, 2, 2, 1, 2, cuflash::Variant<true>, true, 1>" in text
    assert "why:" in text and "H200" in text
    text = cuflash.explain(q, q, q, backward=True, deterministic=True, device="a100")
    assert "bwd_sm80<" in text and "bwd_sm90: not used, needs compute capability 9.0" in text
    with pytest.raises(ValueError, match="unknown device profile 'tpu'"):
        cuflash.explain(q, q, q, device="tpu")
    assert main(["info", "--explain", "2,8,512,64", "2,2,512,64", "--enable-gqa"]) == 0
    assert main(["info", "--explain", "2,8,512,64", "2,3,512,64", "--enable-gqa"]) == 2


def test_explain_with_modifiers_names_the_kernel_built_for_them():
    """With modifiers, explain shows them (and a traced function's source), then the kernel
    the dispatcher picks for their Variant; where the GPU path lacks them (a float32 backward),
    only what it lacks, no kernel."""
    import cuflash
    q = numpy.broadcast_to(numpy.zeros((), ml_dtypes.bfloat16), (4, 16, 1024, 128))
    text = cuflash.explain(q, q, q, causal=True, window=(256, 0))
    assert text.startswith("attention with modifiers: window\nattention: q (4, 16, 1024, 128)")
    assert "kernel: cuflash::sm90::fwd_sm90ws<" in text and "why:" in text
    assert "Variant<true, true" in text                  # causal, window
    assert "Variant<true>" not in cuflash.explain(q, q, q, causal=True, softcap=30.0)
    text = cuflash.explain(q, q, q, backward=True, mask_mod=lambda b, h, i, j: i >= j)
    assert "struct MaskMod_" in text and "kernel: cuflash::bwd_sm80<" in text   # (d 128)
    assert "bwd_sm90: not used, does not implement mask_mod" in text and "dQ rounded by" in text
    text = cuflash.explain(q, q, q, backward=True, device="a100", softcap=30.0)
    assert "kernel: cuflash::bwd_sm80<" in text
    q32 = numpy.zeros((1, 1, 64, 64), numpy.float32)
    text = cuflash.explain(q32, q32, q32, backward=True, softcap=30.0)
    assert "GPU: not implemented yet for softcap" in text and "kernel:" not in text


def test_forward_with_a_bias_keeps_the_table_warpgroups(monkeypatch):
    """fwd_sm90 runs a dense bias (alone, with causal or the sink) at its table's warpgroups
    (3 at d = 128; session 8), CUFLASH_FWD_BIAS_WARPGROUPS=2 gives it 2 as before, and a bias
    with a mask array or softcap keeps 2."""
    def wg(causal=False, env=None, **mods):
        if env is None:
            monkeypatch.delenv("CUFLASH_FWD_BIAS_WARPGROUPS", raising=False)
        else:
            monkeypatch.setenv("CUFLASH_FWD_BIAS_WARPGROUPS", env)
        c = _families.choose("fwd", Shape(BF16, 64, 4096, 4096, 128, 128,
                                          Variant(causal, bias="__nv_bfloat16", **mods), False), H200)
        assert c.family.name == "fwd_sm90", c.reasons
        return c.traits["warpgroups"]
    full = _traits.FWD_SM90[128]["warpgroups"]
    assert full == 3
    assert wg() == wg(True) == wg(sink=True) == full
    assert wg(env="2") == wg(True, env="2") == 2
    assert wg(mask=True) == wg(softcap=True) == 2


def persistent_by_default(monkeypatch) -> tuple[bool, bool]:
    """Whether the window's plan is persistent at d = 64 and d = 128 without the switch (off
    since session 10's call 2: the d 128 window lost 6-8% persistent)."""
    def pick(d):
        v = Variant(causal=True, window=True)
        return _families.choose("fwd", Shape(BF16, 128, 4096, 4096, d, d, v), H200).traits
    return pick(64)["persist"] == 1, pick(128)["persist"] == 1


def test_fwd_sm90_runs_the_window_persistent(monkeypatch):
    """Session 10: the analytic window (with causal or not, nothing else) runs fwd_sm90's
    persistent build (``persist``: a second Q buffer, a grid of min_blocks blocks an SM) where
    its EVEN build has more (batch item, Q tile) items than resident blocks, with
    ``CUFLASH_FWD90_PERSIST=auto`` where a block is alone on its SM (d = 128), with "window" at
    d = 64 too; "0" (the default) never, "all" any Variant; ``CUFLASH_FWD90_PERSIST_GRID`` k items a block. Plain
    attention keeps its name expression."""
    for var in ("CUFLASH_FWD90_PERSIST", "CUFLASH_FWD90_PERSIST_GRID"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("CUFLASH_FWD90_WS", "0")   # (fwd_sm90's schedule; d 128 is fwd_sm90ws's)
    assert persistent_by_default(monkeypatch) == (False, False)
    monkeypatch.setenv("CUFLASH_FWD90_PERSIST", "auto")
    assert persistent_by_default(monkeypatch) == (False, True)
    monkeypatch.setenv("CUFLASH_FWD90_PERSIST", "window")

    def choice(d=64, L=4096, nbatch=128, window=True, causal=True):
        v = Variant(causal=causal, window=window)
        return _families.choose("fwd", Shape(BF16, nbatch, L, L, d, d, v), H200)

    c = choice()
    assert c.traits["persist"] == 1 and c.traits.min_blocks == 2
    assert c.expr.endswith(", true, 1, 1>")   # (PERSIST, and LEAN: the default since session 12)
    assert c.traits.smem_bytes == (2 * 128 + 4 * 64) * 64 * 2 + 1024
    assert _families.fwd_sm90_grid(c.traits, 128 * 32, H200) == 2 * 132
    assert choice(d=128).traits["persist"] == 1 and choice(d=128).traits.smem_bytes <= H200.smem_optin
    assert choice(causal=False).traits["persist"] == 1
    for other in (choice(window=False), choice(d=256), choice(L=4000), choice(nbatch=1, L=1024)):
        assert other.traits["persist"] == 0 and not other.expr.endswith((", true, 1>", ", false, 1>", ", 1, 1>"))
    assert choice(window=False).expr == "cuflash::sm90::fwd_sm90<__nv_bfloat16, 64, 64, 2, 2, cuflash::Variant<true>, true>"
    monkeypatch.setenv("CUFLASH_FWD90_PERSIST_GRID", "2")
    assert _families.fwd_sm90_grid(c.traits, 4096, H200) == 2048
    assert _families.fwd_sm90_grid(choice(window=False).traits, 4096, H200) == 4096
    monkeypatch.setenv("CUFLASH_FWD90_PERSIST", "0")
    assert choice().traits["persist"] == 0 and choice(d=128).traits["persist"] == 0
    monkeypatch.setenv("CUFLASH_FWD90_PERSIST", "all")
    assert choice(window=False).traits["persist"] == 1
    monkeypatch.setenv("CUFLASH_FWD90_PERSIST", "yes")
    with pytest.raises(ValueError, match="CUFLASH_FWD90_PERSIST"):
        choice()
    # CUFLASH_TILES may leave the schedule out (it is not a tile)
    monkeypatch.setenv("CUFLASH_FWD90_PERSIST", "window")
    monkeypatch.setenv("CUFLASH_TILES", "fwd_sm90:64=64:1:4")
    assert choice().traits["warpgroups"] == 1 and choice().traits["persist"] == 1


def test_fwd_sm90_block_mask_long_lists_take_one_block(monkeypatch):
    """Session 10: a block mask whose query blocks visit >= FWD_SM90_BMASK_LONG_KEYS keys on
    average (prefix-LM at 4k: 2224) runs the min_blocks 1 build at d = 64; short lists (the
    documents: 320 at 4k, 1088 at 16k) keep 2; ``CUFLASH_FWD90_BMASK_LONG`` sets the bound, 0
    turns the rule off. Shape.of reads the keys from the block mask's map."""
    import cuflash
    from cuflash import _trace, _trace_cuda
    monkeypatch.delenv("CUFLASH_FWD90_BMASK_LONG", raising=False)
    L = 4096
    prefix = lambda b, h, q, kv: (kv < L // 4) | (q >= kv)            # noqa: E731
    docs = lambda b, h, q, kv: ((q // 512) == (kv // 512)) & (q >= kv)  # noqa: E731
    assert cuflash.block_mask(prefix, (1, 1), L, L).mean_row_keys() == 2224
    assert cuflash.block_mask(docs, (1, 1), L, L).mean_row_keys() == 320
    tr = _trace.trace_mask_mod(prefix)

    def blocks(keys):
        v = Variant(causal=False, mask_mod=_trace_cuda.qualified_name(tr), block_mask=True,
                    prelude=tr.source)
        shape = Shape(BF16, 128, L, L, 64, 64, v, False, keys)
        return _families.choose("fwd", shape, H200).traits.min_blocks

    assert blocks(2224) == 1 and blocks(320) == 2 and blocks(1088) == 2
    monkeypatch.setenv("CUFLASH_FWD90_BMASK_LONG", "0")
    assert blocks(2224) == 2
    monkeypatch.setenv("CUFLASH_FWD90_BMASK_LONG", "300")
    assert blocks(320) == 1
    monkeypatch.setenv("CUFLASH_FWD90_BMASK_LONG", "long")
    with pytest.raises(ValueError, match="CUFLASH_FWD90_BMASK_LONG"):
        blocks(320)


def test_fwd_sm90_block_mask_persistent_where_registers_allow(monkeypatch):
    """Session 10: a block mask's mask_mod (with causal or not) with short lists runs fwd_sm90's
    persistent build (``CUFLASH_FWD90_PERSIST=auto``; off by default) where the build has min_blocks 1 (d = 128: 168-register cap, 0 spills);
    at d = 64 its 2 blocks an SM (128 registers) stay unpersisted (the outer loop spills there);
    long lists, CUFLASH_FWD90_PERSIST=0, and a recorded spill leave it off."""
    from cuflash import _trace, _trace_cuda
    for var in ("CUFLASH_FWD90_BMASK_LONG", "CUFLASH_FWD90_BMASK_BLOCKS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("CUFLASH_FWD90_PERSIST", "auto")   # (off by default since call 2)
    tr = _trace.trace_mask_mod(lambda b, h, q, kv: ((q // 512) == (kv // 512)) & (q >= kv))
    v = Variant(causal=True, mask_mod=_trace_cuda.qualified_name(tr), block_mask=True,
                prelude=tr.source)

    def traits(d=128, keys=320, L=4096):
        return _families.choose("fwd", Shape(BF16, 128, L, L, d, d, v, False, keys), H200).traits

    assert traits()["persist"] == 1 and traits().min_blocks == 1
    assert traits(d=64)["persist"] == 0 and traits(d=64).min_blocks == 2
    assert traits(keys=2224)["persist"] == 0 and traits(keys=0)["persist"] == 0
    assert traits(L=4000)["persist"] == 0            # EVEN builds only
    monkeypatch.setenv("CUFLASH_FWD90_PERSIST", "0")
    assert traits()["persist"] == 0
    monkeypatch.setenv("CUFLASH_FWD90_PERSIST", "all")
    assert traits(keys=2224)["persist"] == 1
    monkeypatch.delenv("CUFLASH_FWD90_PERSIST")
    assert traits()["persist"] == 0                  # the default
    monkeypatch.setenv("CUFLASH_FWD90_PERSIST", "auto")
    from cuflash import _spills
    monkeypatch.setattr(_spills, "KEPT_BLOCKS_SPILLED", {(v, True)})
    assert traits()["persist"] == 0


def test_long_list_rule_keeps_two_blocks_where_its_build_is_heavier(monkeypatch):
    """The long-list rule's min_blocks 1 build runs only where it still fits 2 blocks an SM
    (<= 128 registers at 256 threads): ``kept_blocks_spilled`` loads it (the plan's compile) and
    records a heavier one, after which ``choose`` keeps the 2-block build."""
    from cuflash import _jit, _trace, _trace_cuda
    for var in ("CUFLASH_FWD90_PERSIST", "CUFLASH_FWD90_BMASK_LONG", "CUFLASH_FWD90_BMASK_BLOCKS"):
        monkeypatch.delenv(var, raising=False)
    tr = _trace.trace_mask_mod(lambda b, h, q, kv: (kv < 1024) | (q >= kv))
    v = Variant(causal=True, mask_mod=_trace_cuda.qualified_name(tr), block_mask=True,
                prelude=tr.source)
    shape = Shape(BF16, 128, 4096, 4096, 64, 64, v, False, 2224)

    class Kernel:
        local_size_bytes, num_regs = 0, 128

    monkeypatch.setattr(_jit, "get_kernel", lambda *a: Kernel)
    from cuflash import _spills
    monkeypatch.setattr(_spills, "LONG_LISTS_TWO_BLOCKS", set())
    c = _families.choose("fwd", shape, H200)
    assert c.traits.min_blocks == 1 and not _families.kept_blocks_spilled(c, shape, 0)
    Kernel.num_regs = 130
    assert _families.kept_blocks_spilled(c, shape, 0)
    again = _families.choose("fwd", shape, H200)
    assert again.traits.min_blocks == 2 and not _families.kept_blocks_spilled(again, shape, 0)


def test_fwd_sm90_block_mask_short_lists_in_fewer_warpgroups(monkeypatch):
    """Session 11: ``CUFLASH_FWD90_BMASK_SHORT_WG`` caps fwd_sm90's warpgroups a block for a
    block mask's mask_mod whose lists are short (below ``CUFLASH_FWD90_BMASK_LONG``'s bound):
    the 3-warpgroup (192-row) d = 128 blocks of the causal documents become 2 or 1; long lists
    (prefix-LM at 4k) and the table's default keep the table's; anything else is a ValueError."""
    from cuflash import _trace, _trace_cuda
    monkeypatch.delenv("CUFLASH_FWD90_BMASK_LONG", raising=False)
    docs = lambda b, h, q, kv: ((q // 512) == (kv // 512)) & (q >= kv)  # noqa: E731
    tr = _trace.trace_mask_mod(docs)

    def warpgroups(d, keys):
        v = Variant(causal=True, mask_mod=_trace_cuda.qualified_name(tr), block_mask=True,
                    prelude=tr.source)
        return _families.choose("fwd", Shape(BF16, 64, 4096, 4096, d, d, v, False, keys),
                                H200).traits["warpgroups"]

    for value in ("", "table"):
        monkeypatch.setenv("CUFLASH_FWD90_BMASK_SHORT_WG", value)
        assert (warpgroups(128, 320), warpgroups(64, 320)) == (3, 2)
    monkeypatch.setenv("CUFLASH_FWD90_BMASK_SHORT_WG", "2")
    assert (warpgroups(128, 320), warpgroups(64, 320), warpgroups(128, 2224)) == (2, 2, 3)
    monkeypatch.setenv("CUFLASH_FWD90_BMASK_SHORT_WG", "1")
    assert (warpgroups(128, 320), warpgroups(64, 1088), warpgroups(64, 2224)) == (1, 1, 2)
    monkeypatch.setenv("CUFLASH_FWD90_BMASK_SHORT_WG", "3")
    with pytest.raises(ValueError, match="CUFLASH_FWD90_BMASK_SHORT_WG"):
        warpgroups(128, 320)


def test_backward_fast_key_of_contiguous_arrays_without_a_gpu():
    """_fast.backward_key (no GPU: CuPy arrays on unowned memory): C-contiguous arrays of one
    shape, dtype and alignment give one key whatever the strides of their extent-1 dimensions;
    another layout, dtype or 16-byte alignment gives another."""
    cupy = pytest.importorskip("cupy")
    from cupy.cuda import memory
    from cuflash import _fast
    mem = memory.UnownedMemory(1 << 20, 1 << 20, None, device_id=0)

    def arr(shape, off=0, strides=None, dtype=BF16):
        return cupy.ndarray(shape, numpy.dtype(dtype), memptr=memory.MemoryPointer(mem, off),
                            strides=strides)
    a = arr((1, 1, 64, 64))
    b = arr((1, 1, 64, 64), strides=(4 * 8192, 8192, 128, 2))      # a slice of a larger array
    lse = arr((1, 1, 64), dtype=numpy.float32)

    def key(x):
        return _fast.backward_key(x, x, x, x, x, lse, None, False, False)
    assert _fast.has_contiguous_flag(cupy.ndarray)
    assert b.flags.c_contiguous and key(a) == key(b) and a.strides != b.strides
    t = arr((1, 1, 64, 64), strides=(8192, 8192, 2, 128))           # transposed rows
    assert key(t) != key(a)
    assert key(arr((1, 1, 64, 64), off=8)) != key(a)                # 16-byte alignment
    assert key(arr((1, 1, 64, 64), dtype=numpy.float16)) != key(a)


def test_modifiers_fast_key():
    """_fast.modifiers_key: None where a modifier carries an array or a user function cannot
    be keyed; values that compare equal but validate differently ((32.0, 0) and (32, 0),
    True and 1.0) give different keys; a user function is keyed by identity and by what its
    trace depends on; a block mask by identity, with its mask_mod's key."""
    from cuflash import _fast

    def key(**kw):
        full = dict(window=None, softcap=None, alibi_slopes=None, sink=None, bias=None,
                    mask=None, score_mod=None, mask_mod=None, block_mask=None)
        full.update(kw)
        return _fast.modifiers_key(**full)
    arr = numpy.zeros(4, numpy.float32)
    for name in ("alibi_slopes", "sink", "bias", "mask"):
        assert key(**{name: arr}) is None and key(window=(3, 0), **{name: arr}) is None
    assert key(window=(32, 0)) == key(window=(32, 0))
    assert key(window=(32, 0)) != key(window=(32.0, 0))
    assert key(window=(32, 0)) != key(window=(numpy.int64(32), 0))
    assert key(window=(32, None)) != key(window=(32, 0))
    assert key(softcap=1.0) != key(softcap=True) and key(softcap=2.0) != key(softcap=2)
    with pytest.raises(TypeError):
        key(window=[32, 0])             # unhashable: the caller takes the general path

    state = {"c": 2.0}

    def f(s, b, h, q, kv):
        return s * 2.0

    def g(s, b, h, q, kv):
        return s * 2.0
    assert key(score_mod=f) == key(score_mod=f) != key(score_mod=g)
    assert key(score_mod=f) != key(mask_mod=f)

    def reads_dict(s, b, h, q, kv):     # a dict read: its changes could go unseen
        return s * state["c"]
    assert key(score_mod=reads_dict) is None

    class BM:                           # stands in for cuflash.block_mask's result
        mask_mod = staticmethod(lambda b, h, q, kv: q >= kv)
    a, b = BM(), BM()
    assert key(block_mask=a) == key(block_mask=a) != key(block_mask=b)
    assert key(block_mask=a) != key(block_mask=a, window=(1, 0))
