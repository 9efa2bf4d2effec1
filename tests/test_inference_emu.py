"""The decode kernels (cuda_src/decode.cu, combine.cu) run on the CPU by the g++ emulation
(tests/_emu_decode.py), launched with the parameter block and grids of
``cuflash._inference_gpu.DecodeSpec``: against the float64 reference, every split count,
bitwise reproducibility, paged == dense, the device-side clamps, and decode_mma's fused combine
and decode_split's (whichever block of a group finishes last: blocks run in shuffled orders; bitwise equal to
decode_combine's launch; the arrival counters left at 0). Skipped without g++."""

from __future__ import annotations

import ml_dtypes
import numpy
import pytest

from cuflash import _families, _inference, _inference_gpu, _inference_grid, _problem, reference
from _tolerance import assert_attention_close
from test_inference import dense_rows, make_cache

import _emu_decode

pytestmark = pytest.mark.skipif(not _emu_decode.available(), reason="needs g++")

BF16 = numpy.dtype(ml_dtypes.bfloat16)
F16, F32 = numpy.dtype(numpy.float16), numpy.dtype(numpy.float32)
#: a small GPU, so that the heuristic splits small caches (and the emulation stays quick)
SMALL = _families.DeviceInfo(90, 2, 232448, "emulated, 2 SMs")


def heuristic_splits(c) -> int:
    """The split count the heuristic picks for call ``c`` on a GPU of 8 SMs (decode_sm80 fills
    one block an SM, so on SMALL's 2 SMs these cases would need no split)."""
    return _inference_gpu.spec_or_reason(
        c, _families.DeviceInfo(90, 8, 232448, "emulated, 8 SMs")).splits

CASES = [  # dtype, Hkv, G, Lq, d, L, paged, page_size, Lnew, causal, splits
    (BF16, 2, 4, 1, 64, 300, False, 0, 1, False, None),
    (BF16, 2, 4, 1, 128, 200, True, 16, 1, False, 3),
    (F16, 1, 1, 1, 32, 130, True, 7, 0, False, 2),
    (F16, 2, 2, 3, 64, 90, True, 1, 3, True, 4),
    (F32, 1, 8, 2, 128, 70, False, 0, 2, True, 5),     # 16 rows: two row tiles
    (BF16, 1, 2, 1, 256, 40, True, 256, 1, False, 1),
]

#: the tensor-core decode (decode_mma.cu): GQA groups, 2 row tiles, head dims past the bucket's
#: columns, split tails, causal chunked prefill, page 32 and 16
MMA_CASES = [
    (BF16, 2, 4, 1, 128, 333, False, 0, 1, False, 3),
    (F16, 1, 8, 3, 64, 150, True, 32, 3, True, 2),     # 24 rows: two row tiles of 16
    (BF16, 2, 1, 1, 96, 200, True, 16, 0, False, None),  # d = 96 in the 128 bucket
    (F16, 1, 2, 5, 128, 77, False, 0, 5, True, 1),
]

SPLIT_CASE = (BF16, 2, 4, 1, 64, 600, True, 16, 1, False, None)
STRADDLE_CASE = (F16, 1, 4, 1, 64, 60, True, 8, 1, False, 2)
#: decode_mma for d = 32, dv = 112 (test_emulated_tensor_core_decode_with_dv_other_than_d)
_DV_EXPRS = [f"cuflash::decode::decode_mma<__half, 128, cuflash::Variant<false>, {f}>"
             for f in ("false", "true")]
CLAMP_CASE = (F32, 1, 4, 1, 32, 64, True, 8, 2, False, 3)
#: decode_mma's stream grid (d = 128, the bucket with a STREAM build): dense and paged, causal
#: chunked prefill (Lq = 2: 8 rows); the first appends nothing (batch row 0 is empty)
STREAM_CASES = [(BF16, 2, 4, 1, 128, 700, True, 16, 0, False, None),
                (F16, 2, 4, 2, 128, 500, False, 0, 2, True, None)]
_STREAM_EXPRS = [f"cuflash::decode::decode_mma<{T}, 128, cuflash::Variant<{cz}>, true, true{st}>"
                 for T, cz in (("__nv_bfloat16", "false"), ("__half", "true"))
                 for st in ("", ", 5")]
#: decode_mma's deep rings (STAGES 4 and 5: grids of at most one block an SM), even splits and
#: the stream grid: dense one split and three, paged causal chunked prefill (Lq = 2)
DEEP_CASES = [(BF16, 2, 4, 1, 128, 333, False, 0, 0, False, 1),
              (BF16, 2, 4, 1, 128, 333, False, 0, 1, False, 3),
              (F16, 2, 4, 2, 128, 500, True, 16, 2, True, 2)]
_DEEP_EXPRS = [f"cuflash::decode::decode_mma<{T}, 128, cuflash::Variant<{cz}>, {f}, {sg}, {st}>"
               for T, cz in (("__nv_bfloat16", "false"), ("__half", "true"))
               for f, sg in (("false", "false"), ("true", "false"), ("true", "true"))
               for st in (4, 5)]


#: the defines of decode_mma's default builds for grids of several splits (session 10's
#: prologue and arrival: CUFLASH_DECODE_EARLY=one issues the early copies only for one split,
#: and CUFLASH_DECODE_ARRIVE=fence is the default); the early copies and the one-atomic
#: arrival are tests/test_inference_early.py's, bitwise against these)
DEFAULT_PRELUDE = "#define CUFLASH_DECODE_EARLY_KV 0\n#define CUFLASH_DECODE_ARRIVE_WRAP 0\n"


@pytest.fixture(scope="module")
def lib():
    exprs = set()
    for dtype in (BF16, F16, F32):
        T = _families.ctype(dtype)
        exprs |= {f"cuflash::decode::decode_append<{T}>", f"cuflash::decode::decode_combine<{T}>"}
    for dtype, Hkv, G, Lq, d, *_, causal, _s in CASES + MMA_CASES + [SPLIT_CASE, CLAMP_CASE,
                                                                      STRADDLE_CASE]:
        for fam in _families.by_kind("decode"):
            # the generic kernel in both variants (tests flip causal); decode_mma as the case
            for cz in (causal, not causal) if fam.name == "decode" else (causal,):
                v = _families.Variant(causal=cz)
                shape = _families.Shape(dtype.name, 1, G * Lq, 1, d, d, v)
                if fam.rejects(shape, SMALL) is None:
                    t, flags = fam.select(fam, shape, SMALL)[:2]
                    # decode_mma with and without its fused combine (num_splits > 1 or 1)
                    for fuse in (False, True) if "fuse" in flags else (None,):
                        kw = {} if fuse is None else dict(flags, fuse=fuse)
                        exprs.add(fam.expr(dtype.name, t, v, **kw))
    exprs.update(_DV_EXPRS + _STREAM_EXPRS + _DEEP_EXPRS)
    return _emu_decode.build(sorted(exprs), DEFAULT_PRELUDE)


def _call(case, seed=0, seqlens=None, splits="case"):
    dtype, Hkv, G, Lq, d, L, paged, ps, Lnew, causal, n_splits = case
    rng = numpy.random.default_rng(seed)
    q, kc, vc, s, bt, kn, vn = make_cache(rng, dtype, B=3, Hkv=Hkv, G=G, Lq=Lq, d=d, L=L,
                                          Lnew=Lnew, paged=paged, page_size=ps or 16,
                                          seqlens=seqlens)
    c = _inference.check_kvcache(q, kc, vc, s, bt, kn, vn,
                                 n_splits if splits == "case" else splits, None, causal, True)
    return c


def _run(lib, c):
    spec = _inference_gpu.spec_or_reason(c, SMALL)
    assert not isinstance(spec, str), spec
    return spec, _emu_decode.run_spec(lib, spec, c)


def _check(c, o, lse):
    for b in range(c.B):
        n = int(c.seqlens[b]) + c.Lnew
        kb = dense_rows(c.k_cache, c.block_table, b, n, c.page_size)
        vb = dense_rows(c.v_cache, c.block_table, b, n, c.page_size)
        cz = "bottom_right" if c.causal else False
        prob = _problem.make_problem(c.q[b], kb, vb, scale=None, causal=cz)
        ro, rl = reference.attention(c.q[b], kb, vb, causal=cz, return_lse=True)
        assert_attention_close(prob, o[b], lse[b], ro, rl)


def _check_block_orders(c, case, outs):
    """Runs of one call under several block orders (``outs``: (o, lse) each): bitwise equal,
    batch row 0 empty where the case has no new keys (o = 0, lse = -inf), within the reference's
    tolerance."""
    for o, lse in outs[1:]:
        assert numpy.array_equal(o.view(numpy.uint16), outs[0][0].view(numpy.uint16))
        assert numpy.array_equal(lse, outs[0][1])
    o, lse = outs[0]
    if case[8] == 0:                    # batch row 0: no key at all
        assert (o[0] == 0).all() and numpy.isneginf(lse[0]).all()
    _check(c, o, lse)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-G{c[2]}-Lq{c[3]}-d{c[4]}-"
                         f"{'paged' + str(c[7]) if c[6] else 'dense'}-s{c[10]}")
def test_emulated_decode_matches_reference_and_appends(lib, case):
    c = _call(case)
    ref = _call(case)                                  # the same inputs, CPU path
    if ref.k_new is not None:
        _inference._append(ref, ref.seqlens)
    spec, (o, lse) = _run(lib, c)
    assert numpy.array_equal(c.k_cache, ref.k_cache) and numpy.array_equal(c.v_cache, ref.v_cache)
    _check(c, o, lse)


@pytest.mark.parametrize("case", MMA_CASES, ids=lambda c: f"{c[0]}-G{c[2]}-Lq{c[3]}-d{c[4]}-"
                         f"{'paged' + str(c[7]) if c[6] else 'dense'}-s{c[10]}")
def test_emulated_tensor_core_decode_matches_reference(lib, case):
    c = _call(case, seed=7)
    spec, (o, lse) = _run(lib, c)
    assert spec.split[0] == "decode_mma.cu", spec.explain()
    _check(c, o, lse)


def test_emulated_generic_decode_where_pages_straddle_tiles(lib):
    """A page size that is not a multiple of 16 keeps the generic decode_split, and says so."""
    c = _call(STRADDLE_CASE)
    spec, (o, lse) = _run(lib, c)
    assert spec.split[0] == "decode.cu"
    assert "page_size=8 is not a multiple of 16" in spec.explain()
    _check(c, o, lse)


def test_emulated_every_split_count_agrees_and_is_reproducible(lib):
    case = SPLIT_CASE
    c = _call(case, seqlens=[0, 333, 599])
    # the heuristic's count on a GPU of 8 SMs (decode_sm80 fills one block an SM, so on SMALL's
    # 2 SMs the 6 blocks of this case need no split), every count up to one past it run on SMALL
    heuristic = heuristic_splits(c)
    assert heuristic > 1
    k_after = None
    for s in range(1, heuristic + 2):
        outs = []
        for _ in range(2):
            c = _call(case, seqlens=[0, 333, 599], splits=s)
            outs.append(_run(lib, c)[1])
            if k_after is None:
                k_after = c.k_cache.copy()
            assert numpy.array_equal(c.k_cache, k_after)
        assert numpy.array_equal(outs[0][0].view(numpy.uint16), outs[1][0].view(numpy.uint16))
        assert numpy.array_equal(outs[0][1], outs[1][1])
        _check(c, *outs[0])


def test_emulated_paged_equals_dense_bitwise(lib):
    dense = (F16, 2, 2, 3, 64, 90, False, 0, 3, True, 3)
    paged = dense[:6] + (True, 16) + dense[8:]
    o1, l1 = _run(lib, _call(dense, seed=4, seqlens=[5, 40, 87]))[1]
    o2, l2 = _run(lib, _call(paged, seed=4, seqlens=[5, 40, 87]))[1]
    assert numpy.array_equal(o1.view(numpy.uint16), o2.view(numpy.uint16))
    assert numpy.array_equal(l1, l2)


def test_emulated_device_values_out_of_range_are_clamped(lib):
    """cache_seqlens and block_table entries the host never checks (device values): clamped
    into range, for the append and the attention alike; nothing outside the cache is read
    (the caches sit inside NaN-filled buffers: a read outside would make the output NaN)."""
    case = CLAMP_CASE
    c = _call(case, seqlens=[3, 10, 20])
    guard = numpy.full((c.k_cache.shape[0] + 4,) + c.k_cache.shape[1:], numpy.nan, F32)
    guard[2:-2] = c.k_cache
    vguard = numpy.full_like(guard, numpy.nan)
    vguard[2:-2] = c.v_cache
    c.k_cache, c.v_cache = guard[2:-2], vguard[2:-2]
    c.seqlens[:] = [-5, 10**6, 20]                 # clamped to 0 and capacity - Lnew
    c.block_table[2, 0] = 10**5                    # clamped to the last page
    c.block_table[2, 1] = -7                       # clamped to page 0
    ref_k, ref_v = c.k_cache.copy(), c.v_cache.copy()
    spec, (o, lse) = _run(lib, c)
    assert numpy.isfinite(o).all() and numpy.isfinite(lse).all()
    assert numpy.isnan(guard[:2]).all() and numpy.isnan(guard[-2:]).all()
    # the same clamps on the host, through the generic path's helpers
    ref = _call(case, seqlens=[3, 10, 20])
    ref.k_cache, ref.v_cache = ref_k, ref_v
    ref.block_table[:] = c.block_table
    clamped = _inference._clamped_seqlens(numpy.array([-5, 10**6, 20]), ref)
    assert list(clamped) == [0, c.capacity - 2, 20]
    _inference._append(ref, clamped)
    assert numpy.array_equal(c.k_cache, ref.k_cache)
    for b in range(3):
        n = int(clamped[b]) + 2
        kb = _inference._cache_rows(ref, ref.k_cache, b, n)
        vb = _inference._cache_rows(ref, ref.v_cache, b, n)
        ro, rl = reference.attention(ref.q[b], kb, vb, return_lse=True)
        prob = _problem.make_problem(ref.q[b], kb, vb, scale=None, causal=False)
        assert_attention_close(prob, o[b], lse[b], ro, rl)


def test_emulated_tensor_core_decode_on_a_sequence_major_cache(lib):
    """A cache stored (B, L, Hkv, d) and passed as its (B, Hkv, 1, L, d) view: key rows Hkv * d
    elements apart (the usual serving layout), K and V of different strides."""
    rng = numpy.random.default_rng(11)
    B, Hkv, G, L, d = 2, 3, 4, 120, 64
    q = rng.standard_normal((B, Hkv, G, 1, d)).astype(BF16)
    kb = rng.standard_normal((B, L, Hkv, 1, d)).astype(BF16)
    vb = rng.standard_normal((B, L, Hkv + 1, 1, d)).astype(BF16)[:, :, 1:]  # V: other strides
    kc, vc = kb.transpose(0, 2, 3, 1, 4), vb.transpose(0, 2, 3, 1, 4)
    s = numpy.array([77, 119], numpy.int32)
    c = _inference.check_kvcache(q, kc, vc, s, None, None, None, 2, None, False, True)
    spec, (o, lse) = _run(lib, c)
    assert spec.split[0] == "decode_mma.cu"
    assert spec.params["k_row"] == Hkv * d and spec.params["v_row"] == (Hkv + 1) * d
    _check(c, o, lse)


def test_emulated_tensor_core_decode_with_dv_other_than_d(lib):
    """d = 32, dv = 112 (the 128 bucket): K columns past 32 and V columns past 112 copy
    nothing; o has 112 columns."""
    rng = numpy.random.default_rng(12)
    q, kc, vc, s, bt, kn, vn = make_cache(rng, F16, B=2, Hkv=2, G=4, Lq=1, d=32, dv=112, L=90,
                                          Lnew=1, paged=True, page_size=16, seqlens=[40, 88])
    c = _inference.check_kvcache(q, kc, vc, s, bt, kn, vn, 2, None, False, True)
    spec, (o, lse) = _run(lib, c)
    assert spec.split[0] == "decode_mma.cu" and o.shape[-1] == 112
    _check(c, o, lse)


#: the tensor-core decode's split sweep: GQA 4 (one row tile of 16, 4 rows used), page 16
MMA_SPLIT_CASE = (BF16, 2, 4, 1, 64, 700, True, 16, 1, False, None)


@pytest.mark.parametrize("family", ["decode_mma.cu", "decode.cu"])
def test_emulated_fused_combine_every_split_count_reproducible_and_equal_to_combine(lib, family,
                                                                                    monkeypatch):
    """decode_mma's and decode_split's fused combine (the last block of a group to finish merges its splits), for
    every split count from 1 to one past the heuristic's: bitwise the same whichever block
    finishes last (blocks run in blockIdx order and in shuffled orders), bitwise the result of
    decode_combine's separate launch (CUFLASH_DECODE_FUSE=0), the counters left at 0 for the
    next call (one counter array reused across calls), and within the reference's tolerance."""
    if family == "decode.cu":
        monkeypatch.setenv("CUFLASH_DECODE", "split")     # decode_split where decode_mma runs
    seqlens = [0, 333, 698]
    c = _call(MMA_SPLIT_CASE, seqlens=seqlens)
    heuristic = heuristic_splits(c)
    assert heuristic > 1
    counters = None
    for s in range(1, heuristic + 2):
        outs = []
        for order in (0, 1, 7):
            c = _call(MMA_SPLIT_CASE, seqlens=seqlens, splits=s)
            spec = _inference_gpu.spec_or_reason(c, SMALL)
            assert spec.split[0] == family and spec.fuse == (s > 1)
            assert spec.combine is None
            if s > 1:
                assert "no decode_combine" in spec.explain()
                assert spec.split[1].endswith(", true>")
                if counters is None:
                    counters = numpy.zeros(spec.groups, numpy.uint32)
            outs.append(_emu_decode.run_spec(lib, spec, c, order=order,
                                             counters=counters if s > 1 else None))
        for o, lse in outs[1:]:
            assert numpy.array_equal(o.view(numpy.uint16), outs[0][0].view(numpy.uint16))
            assert numpy.array_equal(lse, outs[0][1])
        _check(c, *outs[0])
        monkeypatch.setenv("CUFLASH_DECODE_FUSE", "0")
        c = _call(MMA_SPLIT_CASE, seqlens=seqlens, splits=s)
        spec = _inference_gpu.spec_or_reason(c, SMALL)
        monkeypatch.delenv("CUFLASH_DECODE_FUSE")
        assert not spec.fuse and (spec.combine is not None) == (s > 1)
        o, lse = _emu_decode.run_spec(lib, spec, c)
        assert numpy.array_equal(o.view(numpy.uint16), outs[0][0].view(numpy.uint16))
        assert numpy.array_equal(lse, outs[0][1])


@pytest.mark.parametrize("splits", [1, 2, 5])
@pytest.mark.parametrize("family", ["decode_mma.cu", "decode.cu"])
def test_emulated_fused_combine_with_rows_that_see_no_key(lib, splits, family, monkeypatch):
    """Batch rows of length 0 (nothing appended): every split of them is empty, so every
    partial lse is -inf: the merge gives o = 0 and lse = -inf (no NaN from -inf - -inf); the
    other rows are the reference's. Two row tiles (G x Lq = 24 rows), blocks shuffled."""
    if family == "decode.cu":
        monkeypatch.setenv("CUFLASH_DECODE", "split")
    case = (F16, 1, 8, 3, 64, 150, True, 32, 0, False, splits)
    c = _call(case, seed=3, seqlens=[0, 97, 0])
    spec = _inference_gpu.spec_or_reason(c, SMALL)
    assert spec.split[0] == family and spec.fuse == (splits > 1)
    assert spec.row_tiles == (2 if family == "decode_mma.cu" else 3)   # 24 rows: 16 / 8 a tile
    o, lse = _emu_decode.run_spec(lib, spec, c, order=5)
    for b in (0, 2):
        assert (o[b] == 0).all() and numpy.isneginf(lse[b]).all()
    n = 97
    kb = dense_rows(c.k_cache, c.block_table, 1, n, c.page_size)
    vb = dense_rows(c.v_cache, c.block_table, 1, n, c.page_size)
    prob = _problem.make_problem(c.q[1], kb, vb, scale=None, causal=False)
    ro, rl = reference.attention(c.q[1], kb, vb, return_lse=True)
    assert_attention_close(prob, o[1], lse[1], ro, rl)


@pytest.mark.parametrize("num_sms", [2, 4, 5, 13])
@pytest.mark.parametrize("case", STREAM_CASES, ids=["bf16-paged16", "f16-dense-causal"])
def test_emulated_stream_grid_matches_reference_and_is_reproducible(lib, case, num_sms,
                                                                    monkeypatch):
    """decode_mma's stream grid (CUFLASH_DECODE_STREAM=all, the size limits lowered to these
    short caches): 6 groups (3 batch rows x 2 KV heads) shared by 4, 5 or 13 blocks (one an
    SM) or by 2 x 2 (two an SM once the groups fill the slots), so blocks run pieces of two or
    three groups and groups have 1 to 4 partials of their own counts; a batch row of length 0
    (every piece empty). Within the reference's tolerance, bitwise the same whichever block of
    a group finishes last (blocks shuffled), the counters left at 0, and the block's keys
    (K/V read) only inside the cache (the emulation checks every cp.async source)."""
    monkeypatch.setenv("CUFLASH_DECODE_STREAM", "all")
    monkeypatch.setattr(_inference_grid, "STREAM_MIN_ITERS", 1)
    monkeypatch.setattr(_inference_grid, "STREAM_MIN_GROUP_ITERS", 1)
    dev = _families.DeviceInfo(90, num_sms, 232448, f"emulated, {num_sms} SMs")
    seqlens = [0, 333, case[5] - case[8]]
    counters, outs = None, []
    # one block an SM (4, 5, 13 SMs): the deep ring (5 stages) with CUFLASH_DECODE_STAGES=auto;
    # two (2 SMs): 3; the first and the last run with 3 stages (the default): bitwise equal
    for order, stages in ((0, "3"), (0, "auto"), (1, "auto"), (7, "auto"), (7, "")):
        monkeypatch.setenv("CUFLASH_DECODE_STAGES", stages)
        c = _call(case, seqlens=seqlens)
        spec = _inference_gpu.spec_or_reason(c, dev)
        assert not isinstance(spec, str), spec
        assert spec.stream == num_sms * (2 if num_sms == 2 else 1), spec.explain()
        deep = num_sms > 2 and stages == "auto"
        assert spec.stages == (5 if deep else 3)
        assert spec.split[1].endswith(", true, true, 5>" if deep else ", true, true>")
        assert spec.split[2] == spec.stream
        assert spec.fuse and spec.combine is None and "stream grid" in spec.explain()
        assert spec.splits == _inference_grid.stream_spans(6, spec.stream)[0] > 1
        if counters is None:
            counters = numpy.zeros(spec.groups, numpy.uint32)
        outs.append(_emu_decode.run_spec(lib, spec, c, order=order, counters=counters))
    _check_block_orders(c, case, outs)


@pytest.mark.parametrize("smem,stages", [(232448, 5), (166912, 4)], ids=["h200", "a100"])
@pytest.mark.parametrize("case", DEEP_CASES, ids=["bf16-dense-s1", "bf16-dense-s3",
                                                  "f16-paged16-causal-s2"])
def test_emulated_deep_ring_equals_three_stages_bitwise(lib, case, smem, stages, monkeypatch):
    """decode_mma's deep cp.async ring (STAGES 4 or 5, the deepest whose shared memory fits:
    grids of at most one block an SM, here 6 x splits blocks on 64 SMs) runs the same
    operations in the same order as the 3-stage ring: bitwise its output and lse (blocks in
    order and shuffled, the fused merge's counters left at 0), within the reference's
    tolerance, and K/V read only inside the cache (every cp.async source is checked); batch
    row 0 has a split tail of 5 keys, row 1 no key where nothing is appended. Off by default
    (3 stages), CUFLASH_DECODE_STAGES=auto turns it on, a depth forces it,
    a bad value names the variable."""
    dev = _families.DeviceInfo(90, 64, smem, "emulated, 64 SMs")
    seqlens = [5 + case[5] // 2, 0, case[5] - case[8]]
    outs, counters = {}, None
    for env, order in (("", 0), ("auto", 0), ("auto", 7), (str(stages), 1)):
        monkeypatch.setenv("CUFLASH_DECODE_STAGES", env)
        c = _call(case, seqlens=seqlens)
        spec = _inference_gpu.spec_or_reason(c, dev)
        assert not isinstance(spec, str), spec
        want = 3 if env == "" else stages
        assert spec.stages == want and spec.stream == 0, spec.explain()
        assert spec.split[1].endswith(f", false, {want}>" if want > 3 else
                                      (", true>" if case[-1] > 1 else ", false>"))
        assert spec.split[4] == 4096 * (1 + 8 * want) <= smem
        if want > 3:
            assert f"a {want}-stage cp.async ring" in spec.explain()
        if spec.fuse and counters is None:
            counters = numpy.zeros(spec.groups, numpy.uint32)
        outs[env, order] = _emu_decode.run_spec(lib, spec, c, order=order,
                                                counters=counters if spec.fuse else None)
    o0, l0 = outs["", 0]
    for o, lse in outs.values():
        assert numpy.array_equal(o.view(numpy.uint16), o0.view(numpy.uint16))
        assert numpy.array_equal(lse, l0)
    if case[8] == 0:                    # batch row 1: no key at all
        assert (o0[1] == 0).all() and numpy.isneginf(l0[1]).all()
    _check(c, o0, l0)
    monkeypatch.setenv("CUFLASH_DECODE_STAGES", "2")
    with pytest.raises(ValueError, match="CUFLASH_DECODE_STAGES"):
        _inference_gpu.spec_or_reason(_call(case, seqlens=seqlens), dev)


@pytest.mark.parametrize("family", ["decode_mma.cu", "decode.cu"])
def test_emulated_fused_merge_past_its_prefetched_splits_equals_combine(lib, family, monkeypatch):
    """19 splits: more than the 16 partials decode_mma's merge loads ahead with the lse
    (merge_splits_if_last's PRE), so its phase B continues past them; decode_split's merge
    (PRE = 0) alike. Bitwise the result of decode_combine's launch (CUFLASH_DECODE_FUSE=0)."""
    if family == "decode.cu":
        monkeypatch.setenv("CUFLASH_DECODE", "split")
    seqlens = [0, 333, 698]
    outs = []
    for fuse in ("1", "0"):
        monkeypatch.setenv("CUFLASH_DECODE_FUSE", fuse)
        c = _call(MMA_SPLIT_CASE, seqlens=seqlens, splits=19)
        spec = _inference_gpu.spec_or_reason(c, SMALL)
        assert spec.split[0] == family and spec.fuse == (fuse == "1") and spec.splits == 19
        outs.append(_emu_decode.run_spec(lib, spec, c, order=3))
    assert numpy.array_equal(outs[0][0].view(numpy.uint16), outs[1][0].view(numpy.uint16))
    assert numpy.array_equal(outs[0][1], outs[1][1])
    _check(c, *outs[0])


@pytest.mark.parametrize("page_size", [16, 48, 256])
def test_emulated_page_walk_past_its_window_equals_dense_bitwise(lib, page_size):
    """decode_mma's page walk (CUFLASH_DECODE_PAGE_WALK: a warp's pages read 32 tiles at a
    time, a lane a tile, the next 32 when a window opens): splits of 34-69 tiles a warp, so
    the copies cross one or two window shifts; pages of 16 (one a tile), 48 (not a power of
    two: the division) and 256 (four iterations a page); batch rows ending mid-tile and
    mid-window. Bitwise the dense cache's result, one split and two (fused merge)."""
    for splits in (1, 2):
        dense = (BF16, 1, 4, 1, 128, 4400, False, 0, 1, False, splits)
        paged = dense[:6] + (True, page_size) + dense[8:]
        seqlens = [4399, 2200, 4111]
        o1, l1 = _run(lib, _call(dense, seed=9, seqlens=seqlens))[1]
        spec, (o2, l2) = _run(lib, _call(paged, seed=9, seqlens=seqlens))
        assert "PAGE_WALK" not in spec.prelude and spec.splits == splits   # the default walk
        assert numpy.array_equal(o1.view(numpy.uint16), o2.view(numpy.uint16))
        assert numpy.array_equal(l1, l2)


@pytest.mark.parametrize("num_sms", [7, 13])
@pytest.mark.parametrize("case", STREAM_CASES, ids=["bf16-paged16", "f16-dense-causal"])
def test_emulated_slot_grid_matches_reference_and_is_reproducible(lib, case, num_sms,
                                                                  monkeypatch):
    """CUFLASH_DECODE_SPLITS=slots: decode_mma's stream build over k whole groups' worth of
    blocks (6 groups on 7 SMs x 2 slots: k = 2, 12 blocks; on 13: k = 4, 24), so no block
    spans two groups and each group's keys are cut into k balanced ranges; a batch row of
    length 0 (its appended keys only, in the causal case). Within the reference's tolerance,
    bitwise the same whichever block of a group finishes last, the counters left at 0."""
    monkeypatch.setenv("CUFLASH_DECODE_SPLITS", "slots")
    monkeypatch.setattr(_inference_grid, "STREAM_MIN_ITERS", 1)
    dev = _families.DeviceInfo(90, num_sms, 232448, f"emulated, {num_sms} SMs")
    k = 2 * num_sms // 6
    seqlens = [0, 333, case[5] - case[8]]
    counters, outs = None, []
    for order in (0, 1, 7):
        c = _call(case, seqlens=seqlens)
        spec = _inference_gpu.spec_or_reason(c, dev)
        assert not isinstance(spec, str), spec
        assert (spec.stream, spec.splits, spec.stages) == (6 * k, k, 3), spec.explain()
        assert _inference_grid.stream_spans(6, spec.stream) == (k, 1)
        if counters is None:
            counters = numpy.zeros(spec.groups, numpy.uint32)
        outs.append(_emu_decode.run_spec(lib, spec, c, order=order, counters=counters))
    _check_block_orders(c, case, outs)
