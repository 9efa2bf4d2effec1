"""The warp-specialised Hopper forward (fwd_sm90ws, cuda_src/fwd_sm90ws.cu) against the float64
reference (``gpu`` marker; skipped off Hopper, where the family cannot run).

Every test forces it (``CUFLASH_FWD=sm90ws``: the dispatcher starts its search there) and checks
that it really ran, so a problem it declines fails here instead of passing on fwd_sm90. Shapes
cover both head-dim buckets (64: 3 consumers, 128: 2), ragged lengths and padded head dims
(predicated copies), causal in both alignments, the window, softcap, ALiBi and sinks, empty
rows, many blocks, the varlen build, and bitwise repeatability.
"""

from __future__ import annotations

import ml_dtypes
import numpy
import pytest

import cuflash
from _inputs import make_array
from cuflash.testing import AttentionCase

pytestmark = pytest.mark.gpu

BF16 = numpy.dtype(ml_dtypes.bfloat16)
F16 = numpy.dtype(numpy.float16)


@pytest.fixture
def ws(monkeypatch):
    """Force fwd_sm90ws (Hopper only); yields the sources of the forward families the plans chose."""
    import cupy
    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("fwd_sm90ws is sm_90a only")
    from cuflash import _api
    from _spy import forward_sources
    monkeypatch.setenv("CUFLASH_FWD", "sm90ws")
    seen = forward_sources(monkeypatch)
    _api.clear_plans()
    yield seen
    _api.clear_plans()


def _check(case, ws_seen):
    import cupy
    from test_gpu_forward import check_case
    err = check_case(case.with_xp(cupy))
    assert ws_seen and set(ws_seen) == {"fwd_sm90ws.cu"}, ws_seen
    return err


def _arrays(seed, q_shape, k_shape, v_shape, dtype):
    import cupy
    rng = numpy.random.default_rng(seed)
    return tuple(cupy.asarray(make_array(rng, s, dtype)) for s in (q_shape, k_shape, v_shape))


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["f16", "bf16"])
@pytest.mark.parametrize("d, dv", [(40, 40), (64, 64), (96, 96), (128, 128), (64, 128), (128, 40)])
@pytest.mark.parametrize("Lq, Lk, causal", [(113, 203, True), (203, 113, True),
                                            (256, 256, "top_left"), (128, 512, False),
                                            (1, 77, False), (300, 333, True), (640, 640, False)])
def test_buckets_ragged_and_causal(dtype, d, dv, Lq, Lk, causal, ws):
    import cupy
    from test_gpu_forward import run_and_check
    rng = numpy.random.default_rng(d * 1000 + Lq)
    q = make_array(rng, (2, 3, Lq, d), dtype)
    k = make_array(rng, (2, 1, Lk, d), dtype)   # broadcast over the head axis (GQA pattern)
    v = make_array(rng, (2, 1, Lk, dv), dtype)
    run_and_check(q, k, v, causal=causal)
    cupy.cuda.Device().synchronize()
    assert set(ws) == {"fwd_sm90ws.cu"}, ws


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_many_blocks(d, causal, ws):
    """More blocks than SMs, whole tiles (EVEN) and one ragged key length (the predicated build)."""
    from test_gpu_forward import run_and_check
    rng = numpy.random.default_rng(d)
    for Lk in (1024, 1000):
        q, k, v = (make_array(rng, (4, 16, Lk, d), BF16) for _ in range(3))
        run_and_check(q, k, v, causal=causal)
    assert set(ws) == {"fwd_sm90ws.cu"}, ws


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("mods", [
    dict(causal=True, window=(100, None)),
    dict(causal=True, window=(1024, None)),
    dict(window=(37, 59)),
    dict(softcap=50.0),
    dict(causal=True, softcap=30.0),
    dict(causal="bottom_right", alibi_slopes={"shape": (4,), "expanded": (), "scale": 1.0,
                                              "dtype": "float32"}),
    dict(sink={"shape": (4,), "expanded": (), "scale": 1.0, "dtype": "float32"}),
    dict(causal=True, window=(64, 0), softcap=50.0,
         sink={"shape": (4,), "expanded": (), "scale": 1.0, "dtype": "float32"}),
], ids=["window100", "window1024", "window37_59", "softcap", "causal_softcap", "alibi", "sink",
        "window_softcap_sink"])
def test_modifiers(d, mods, ws):
    if d == 64 and "softcap" in mods:
        pytest.skip("fwd_sm90ws declines the softcap at d = 64 on a partial key tile (L 333, "
                    "1500: test_softcap_at_d64_stays_on_fwd_sm90; whole tiles: "
                    "test_softcap_at_d64_whole_tiles)")
    for seed, L in ((1, 333), (2, 1500)):
        case = AttentionCase.make("bfloat16", (2, 4, L, d), (2, 4, L, d), (2, 4, L, d), seed=seed,
                                  **mods)
        _check(case, ws)


@pytest.mark.parametrize("Lq, Lk, d", [(300, 700, 64), (300, 700, 128), (700, 300, 128)])
def test_alibi_top_left(Lq, Lk, d, ws):
    """ALiBi under top-left causal: with Lq <= Lk every visible pair is left of ALiBi's diagonal
    (the row-offset build, variant.cuh kAlibiRowOffset, as bottom-right); with Lq > Lk some are
    right of it, and the host gives the natural-units build (ALIBI = 2: |i + Lk - Lq - j| kept;
    at d = 64 fwd_sm90ws declines that build, so d 128 only)."""
    slopes = {"shape": (4,), "expanded": (), "scale": 1.0, "dtype": "float32"}
    case = AttentionCase.make("bfloat16", (2, 4, Lq, d), (2, 4, Lk, d), (2, 4, Lk, d), seed=7,
                              causal="top_left", alibi_slopes=slopes)
    _check(case, ws)


def test_rows_with_no_visible_key(ws):
    """A window that hides every key from the first rows (Lq > Lk, causal bottom right): o = 0
    and lse = -inf there, as the reference says."""
    case = AttentionCase.make("bfloat16", (1, 2, 500, 128), (1, 2, 200, 128), (1, 2, 200, 128),
                              seed=3, causal="bottom_right", window=(50, None))
    _check(case, ws)


def test_bitwise_repeatable(ws):
    q, k, v = _arrays(5, (2, 8, 2000, 128), (2, 8, 2000, 128), (2, 8, 2000, 128), BF16)
    a, la = cuflash.attention(q, k, v, causal=True, return_lse=True)
    b, lb = cuflash.attention(q, k, v, causal=True, return_lse=True)
    assert (a.view(numpy.uint8) == b.view(numpy.uint8)).all()
    assert (la == lb).all()
    assert set(ws) == {"fwd_sm90ws.cu"}, ws


def test_matches_fwd_sm90_closely(ws, monkeypatch):
    """The same problem on fwd_sm90 (a different tile order, so not bitwise): outputs within
    the bf16 rounding of one another."""
    import cupy
    from cuflash import _api
    q, k, v = _arrays(6, (2, 8, 1536, 128), (2, 8, 1536, 128), (2, 8, 1536, 128), BF16)
    a = cuflash.attention(q, k, v, causal=True).astype(cupy.float32)
    monkeypatch.setenv("CUFLASH_FWD", "sm90")
    _api.clear_plans()
    b = cuflash.attention(q, k, v, causal=True).astype(cupy.float32)
    assert float(cupy.abs(a - b).max()) < 2e-2
    assert ws[0] == "fwd_sm90ws.cu" and ws[-1] == "fwd_sm90.cu", ws


def test_varlen_build(ws):
    """attention_varlen compiles the family again with CUFLASH_VARLEN (each block its
    sequence's tile): per sequence, the dense call's result."""
    import cupy
    lens = [0, 1, 300, 129, 1000, 64]
    cu = numpy.concatenate([[0], numpy.cumsum(lens)]).astype(numpy.int32)
    total = int(cu[-1])
    q, k, v = _arrays(7, (4, total, 128), (4, total, 128), (4, total, 128), BF16)
    got = cuflash.attention_varlen(q, k, v, cupy.asarray(cu), cupy.asarray(cu), causal=True)
    for i, n in enumerate(lens):
        if n == 0:
            continue
        s = slice(int(cu[i]), int(cu[i + 1]))
        want = cuflash.attention(q[:, s], k[:, s], v[:, s], causal=True)
        err = float(cupy.abs(got[:, s].astype(cupy.float32) - want.astype(cupy.float32)).max())
        assert err == 0.0, (n, err)
    assert "fwd_sm90ws.cu" in ws, ws


@pytest.mark.parametrize("cap", [50.0, 5.0])
def test_softcap_at_d64_whole_tiles(cap, ws):
    """The d = 64 softcap's build without local memory (softcap alone, whole key tiles: session
    19, _fwd_ws.softcap_d64_spill_free; the rule's since session 20's measurement where a block
    walks >= 16 key tiles) computes the function, a cap that bends most scores included."""
    case = AttentionCase.make("bfloat16", (2, 4, 333, 64), (2, 4, 512, 64), (2, 4, 512, 64),
                              seed=3, softcap=cap)
    _check(case, ws)


@pytest.mark.parametrize("poly", [8, 16])
def test_softcap_at_d64_poly_shares(poly, ws, monkeypatch):
    """The d = 64 softcap build with other shares of its exponentials on the FMA pipe than the
    table's 4 (the tile argument, variant.cuh kPolyCapable: session 21's --poly arms at d 64)
    computes the function, every exponential on the FMA pipe (16 of 16 tiles) included."""
    from cuflash import _api
    monkeypatch.setenv("CUFLASH_TILES", f"fwd_sm90ws:64=128:3:3:1:{poly}")
    _api.clear_plans()
    case = AttentionCase.make("bfloat16", (2, 4, 333, 64), (2, 4, 512, 64), (2, 4, 512, 64),
                              seed=5, softcap=50.0)
    _check(case, ws)


def test_softcap_at_d64_stays_on_fwd_sm90(ws):
    """Its d = 64 softcap builds on a partial key tile spill (3 consumers' 160 registers): the
    dispatcher passes the problem on to fwd_sm90, which computes it right."""
    case = AttentionCase.make("bfloat16", (2, 4, 333, 64), (2, 4, 333, 64), (2, 4, 333, 64),
                              seed=1, softcap=50.0)
    import cupy
    from test_gpu_forward import check_case
    check_case(case.with_xp(cupy))
    assert set(ws) == {"fwd_sm90.cu"}, ws


@pytest.mark.parametrize("tiles", ["fwd_sm90ws:128=128:2:2:0:0", "fwd_sm90ws:128=128:2:3:1:0",
                                   "fwd_sm90ws:64=128:3:2:0:0", "fwd_sm90ws:64=128:3:2:1:0"])
@pytest.mark.parametrize("causal", [False, True])
def test_tile_variants(tiles, causal, ws, monkeypatch):
    """The probe's other arms (no ping-pong; 3 K/V stages) compute the same function."""
    from cuflash import _api
    monkeypatch.setenv("CUFLASH_TILES", tiles)
    _api.clear_plans()
    d = int(tiles.split(":")[1].split("=")[0])
    case = AttentionCase.make("bfloat16", (2, 4, 700, d), (2, 4, 700, d), (2, 4, 700, d),
                              seed=9, causal=causal)
    _check(case, ws)


@pytest.mark.parametrize("mods", [dict(causal=True, window=(300, 0)), dict(softcap=50.0),
                                  dict(causal=True, alibi_slopes={"shape": (4,), "expanded": (),
                                                                  "scale": 1.0, "dtype": "float32"}),
                                  dict(sink={"shape": (4,), "expanded": (), "scale": 1.0,
                                             "dtype": "float32"})],
                         ids=["window", "softcap", "alibi", "sink"])
def test_fwd_sm90_keeps_the_d128_built_ins(mods, monkeypatch):
    """With fwd_sm90ws the default at d 128, fwd_sm90's builds of the built-in modifiers there
    run only with CUFLASH_FWD90_WS=0 (test_gpu_modifiers' default now reaches fwd_sm90ws):
    checked here, so both families stay covered."""
    import cupy
    if cupy.cuda.Device().compute_capability != "90":
        pytest.skip("fwd_sm90 is sm_90a only")
    from cuflash import _api
    from test_gpu_forward import check_case
    from _spy import forward_sources
    monkeypatch.setenv("CUFLASH_FWD90_WS", "0")
    seen = forward_sources(monkeypatch)
    _api.clear_plans()
    case = AttentionCase.make("bfloat16", (2, 4, 900, 128), (2, 4, 900, 128), (2, 4, 900, 128),
                              seed=4, **mods)
    check_case(case.with_xp(cupy))
    _api.clear_plans()
    assert seen and set(seen) == {"fwd_sm90.cu"}, seen


@pytest.mark.parametrize("poly", [8, 16])
@pytest.mark.parametrize("causal", [False, True])
def test_softcap_poly_shares(poly, causal, ws, monkeypatch):
    """The probe's --poly arms (more of the softcap's exponentials on the FMA pipe: ex2_poly)
    compute the same function (within the kit's tolerance)."""
    from cuflash import _api
    monkeypatch.setenv("CUFLASH_TILES", f"fwd_sm90ws:128=128:2:2:1:{poly}")
    _api.clear_plans()
    case = AttentionCase.make("bfloat16", (2, 4, 700, 128), (2, 4, 700, 128), (2, 4, 700, 128),
                              seed=11, causal=causal, softcap=50.0)
    _check(case, ws)


@pytest.mark.parametrize("persist", [1, 2, 3])
@pytest.mark.parametrize("d", [96, 128])
@pytest.mark.parametrize("mods", [dict(causal=True), dict(causal=False),
                                  dict(causal=True, window=(300, 0)),
                                  dict(causal="bottom_right", window=(50, None)),
                                  dict(causal=True, alibi_slopes={"shape": (6,), "expanded": (),
                                                                  "scale": 1.0, "dtype": "float32"},
                                       sink={"shape": (6,), "expanded": (), "scale": 1.0,
                                             "dtype": "float32"})],
                         ids=["causal", "plain", "window", "empty_rows", "alibi_sink"])
def test_persistent_schedules(persist, d, mods, ws, monkeypatch):
    """The persistent grids (session 17: a block runs query tiles in turn, round-robin, zigzag
    or the host's lists, two Q buffers handed over on mbarriers) compute the same function: grids of a third
    as many blocks as items (CUFLASH_FWD90_PERSIST_GRID=3; every block runs 2-3 items, unequal
    under causal and the window), a ragged key length (the predicated build) and whole tiles,
    rows with no key (Lq > Lk, bottom-right window), a padded head dim (96). The plan's
    reasons say it was persistent (the 128 bucket only: _fwd_ws.PERSIST_BUCKETS)."""
    import cupy
    from cuflash import _api
    monkeypatch.setenv("CUFLASH_FWD90WS_PERSIST", str(persist))
    monkeypatch.setenv("CUFLASH_FWD90_PERSIST_GRID", "3")
    _api.clear_plans()
    for seed, (Lq, Lk) in enumerate([(1100, 1100), (1280, 1024), (1500, 700)]):
        if "window" not in mods and Lq > Lk and mods.get("causal") is True:
            continue   # (top-left causal with Lq > Lk: rows past Lk see all keys, covered above)
        case = AttentionCase.make("bfloat16", (2, 6, Lq, d), (2, 6, Lk, d), (2, 6, Lk, d),
                                  seed=seed, **mods)
        _check(case, ws)
        arrays = case.with_xp(cupy)
        assert "persistent" in cuflash.explain(arrays.q, arrays.k, arrays.v, **arrays.kwargs)


@pytest.mark.parametrize("mods", [dict(causal=True), dict(causal=True, window=(1024, 0)),
                                  dict(softcap=50.0), dict(causal=True, window=(300, 0), sink=True)],
                         ids=["causal", "window", "softcap", "window_sink"])
def test_persistent_bitwise_equals_one_block_a_tile(mods, ws, monkeypatch):
    """Each query tile's arithmetic does not depend on the block that runs it: the persistent
    grid's output is bitwise the one-block-a-tile grid's, for every schedule, causal, the window,
    the softcap's fixed offset and a sink's start of each item's rows."""
    import cupy
    from cuflash import _api
    q, k, v = _arrays(12, (3, 8, 2048, 128), (3, 8, 2048, 128), (3, 8, 2048, 128), BF16)
    kw = dict(mods)
    if kw.pop("sink", False):
        kw["sink"] = cupy.linspace(-1.0, 2.0, 8, dtype="float32")
    got = {}
    for persist in ("0", "1", "2", "3"):
        monkeypatch.setenv("CUFLASH_FWD90WS_PERSIST", persist)
        _api.clear_plans()
        got[persist] = cuflash.attention(q, k, v, return_lse=True, **kw)
    a, la = got["0"]
    for persist, (b, lb) in got.items():
        assert (a.view(numpy.uint8) == b.view(numpy.uint8)).all() and (la == lb).all(), persist
