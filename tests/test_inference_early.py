"""decode_mma's fixed cost a call (session 11): the first K/V copies issued before cache_seqlens
arrives (decode_mma.cu's CUFLASH_DECODE_EARLY_KV, the switch CUFLASH_DECODE_EARLY) and the fused
merge's arrival and counter reset as one atomicInc (CUFLASH_DECODE_ARRIVE_WRAP, the switch
CUFLASH_DECODE_ARRIVE; session 12's H200 run made EARLY=one the default, ARRIVE stays "fence"),
in the g++ emulation (tests/_emu_decode.py): their build (the switches on: no defines) against
the build of session 10 (both defines 0, the default for grids of several splits; blocks in order and shuffled, the arrival counters left
at 0 by every call), bitwise, on dense caches whose rows are full (the early copies are the
prologue's), shorter than the capacity (every split but the first moves: they are issued again
over the early ones), shorter than the prologue's keys (one split) or empty, and lengths out of
range (the clamp). The cache past each row's length holds NaN, so that a tile read from the
guessed range and never replaced shows in the output (0 x NaN in O += P V), and every cp.async
source is checked to lie inside the cache (the guessed range never passes the capacity)."""

from __future__ import annotations

import ml_dtypes
import numpy
import pytest

from cuflash import _families, _inference, _inference_grid, _inference_gpu

import _emu_decode
from test_inference import dense_rows, make_cache  # noqa: F401  (dense_rows: via _check)
from test_inference_emu import _check

pytestmark = pytest.mark.skipif(not _emu_decode.available(), reason="needs g++")

BF16 = numpy.dtype(ml_dtypes.bfloat16)
F16 = numpy.dtype(numpy.float16)
#: one block an SM on 64 SMs: the splits below stay even splits (no stream grid)
DEV = _families.DeviceInfo(90, 64, 232448, "emulated, 64 SMs")
CASES = [  # dtype, Hkv, G, Lq, d, L, Lnew, causal, splits, stages
    (BF16, 2, 4, 1, 128, 333, 1, False, 1, 3),
    (BF16, 2, 4, 1, 128, 333, 1, False, 3, 3),
    (F16, 1, 4, 2, 64, 200, 2, True, 2, 3),       # causal chunked prefill, the 64 bucket
    (BF16, 2, 4, 1, 128, 333, 0, False, 2, 5),    # the deep ring: 4 tiles a warp early
]
ROWS = {  # batch rows' cache_seqlens: full, short, out of range (device values, clamped to
    #        capacity - Lnew and 0: what the host checks of the inputs sees is the first list)
    "full": lambda L, Lnew: ([L - Lnew] * 3, None),
    "short": lambda L, Lnew: ([5 + L // 2, 0, 40], None),
    "clamped": lambda L, Lnew: ([L - Lnew, 0, L - Lnew - 17], [L + 50, -3, L - Lnew - 17]),
}


def _expr(dtype, d, causal, splits, stages):
    T = _families.ctype(dtype)
    tail = ("true" if splits > 1 else "false") + (f", false, {stages}" if stages > 3 else "")
    return (f"cuflash::decode::decode_mma<{T}, {128 if d > 64 else 64}, "
            f"cuflash::Variant<{'true' if causal else 'false'}>, {tail}>")


#: the defines that compile decode_mma as session 10 did (CUFLASH_DECODE_EARLY=0,
#: CUFLASH_DECODE_ARRIVE=fence)
SESSION_10 = "#define CUFLASH_DECODE_EARLY_KV 0\n#define CUFLASH_DECODE_ARRIVE_WRAP 0\n"


@pytest.fixture(scope="module")
def libs():
    exprs = {_expr(c[0], c[4], c[7], c[8], c[9]) for c in CASES}
    for dtype in (BF16, F16):
        exprs.add(f"cuflash::decode::decode_append<{_families.ctype(dtype)}>")
    exprs = sorted(exprs)
    return (_emu_decode.build(exprs),
            _emu_decode.build(exprs, SESSION_10))


def _call(case, rows):
    dtype, Hkv, G, Lq, d, L, Lnew, causal, splits, _ = case
    rng = numpy.random.default_rng(11)
    host, device = ROWS[rows](L, Lnew)
    q, kc, vc, s, bt, kn, vn = make_cache(rng, dtype, B=3, Hkv=Hkv, G=G, Lq=Lq, d=d, L=L,
                                          Lnew=Lnew, seqlens=host)
    for b in range(3):          # NaN past each row's length (the append writes its keys)
        kc[b, ..., s[b]:, :] = numpy.nan
        vc[b, ..., s[b]:, :] = numpy.nan
    c = _inference.check_kvcache(q, kc, vc, s, bt, kn, vn, splits, None, causal, True)
    if device is not None:
        c.seqlens[:] = device   # the kernel clamps them back to `host`
    return c


@pytest.mark.parametrize("rows", list(ROWS))
@pytest.mark.parametrize("case", CASES, ids=["bf16-s1", "bf16-s3", "f16-causal-s2",
                                             "bf16-s2-stages5"])
def test_emulated_early_copies_equal_session_10_bitwise(libs, case, rows, monkeypatch):
    new, old = libs
    monkeypatch.setenv("CUFLASH_DECODE_EARLY", "all")      # (session 11's build: no defines)
    monkeypatch.setenv("CUFLASH_DECODE_ARRIVE", "wrap")
    monkeypatch.setenv("CUFLASH_DECODE_STAGES", str(case[9]))
    outs = []
    for lib, order in ((old, 0), (new, 0), (new, 5)):
        c = _call(case, rows)
        spec = _inference_gpu.spec_or_reason(c, DEV)
        assert not isinstance(spec, str), spec
        assert spec.split[1] == _expr(case[0], case[4], case[7], case[8], case[9])
        assert spec.prelude == "" and spec.splits == case[8] and spec.stream == 0
        outs.append(_emu_decode.run_spec(lib, spec, c, order=order))
    o0, l0 = outs[0]
    for o, lse in outs[1:]:
        assert numpy.array_equal(o.view(numpy.uint16), o0.view(numpy.uint16))
        assert numpy.array_equal(lse, l0)
    assert not numpy.isnan(o0.astype(numpy.float32)).any()
    c.seqlens[:] = ROWS[rows](case[5], case[6])[0]
    _check(c, o0, l0)


def test_early_switch_puts_its_define_before_decode_mma(monkeypatch):
    """CUFLASH_DECODE_EARLY: "all" no define (session 11's build); "0" the define for every
    grid; unset / "one" (the default since session 12) the define where the grid has several
    splits; a bad value names it. (CUFLASH_DECODE_ARRIVE=wrap: no define of its own here.)"""
    monkeypatch.delenv("CUFLASH_DECODE_PAGES", raising=False)
    monkeypatch.setenv("CUFLASH_DECODE_ARRIVE", "wrap")
    off = "#define CUFLASH_DECODE_EARLY_KV 0\n"
    for env, one, several, stream in (("", "", off, ""), ("all", "", "", ""),
                                      ("0", off, off, off), ("one", "", off, "")):
        monkeypatch.setenv("CUFLASH_DECODE_EARLY", env)
        assert _inference_grid.prelude(True, 1) == one
        assert _inference_grid.prelude(True, 3) == several
        assert _inference_grid.prelude(True, 0) == stream
    c = _call(CASES[1], "full")
    monkeypatch.setenv("CUFLASH_DECODE_EARLY", "one")
    spec = _inference_gpu.spec_or_reason(c, DEV)
    assert spec.prelude == off and "A/B build: CUFLASH_DECODE_EARLY_KV 0" in spec.explain()
    monkeypatch.setenv("CUFLASH_DECODE_EARLY", "late")
    with pytest.raises(ValueError, match="CUFLASH_DECODE_EARLY"):
        _inference_gpu.spec_or_reason(c, DEV)


def test_deep_ring_for_long_shares_only(monkeypatch):
    """CUFLASH_DECODE_STAGES=long (A/B runs): the deep ring where the grid is at most one block
    an SM and a block reads at least DEEP_MIN_SHARE key iterations; 3 stages elsewhere, and
    without the variable (the default)."""
    deep = _inference_grid.deep_stages
    monkeypatch.setenv("CUFLASH_DECODE_STAGES", "long")
    assert _inference_grid.stages_mode() == -1
    assert deep(128, 132, 128, 232448, share=1024) == 5            # B 8 32/8 128k, 2 splits
    assert deep(128, 132, 128, 232448, share=512) == 5
    assert deep(128, 132, 128, 232448, share=128) == 3             # B 1 32/8 128k, 16 splits
    assert deep(128, 132, 128, 232448) == 3                        # (the stream grid: none)
    assert deep(256, 132, 128, 232448, share=1024) == 3            # two blocks an SM
    assert deep(128, 132, 128, 166912, share=1024) == 4            # an A100's shared memory
    monkeypatch.delenv("CUFLASH_DECODE_STAGES")
    assert deep(128, 132, 128, 232448, share=1024) == 3
