"""decode_mma's stream grid on the host (no GPU): the arithmetic of its pieces (which blocks
cover which groups' key iterations, cuda_src/decode_mma.cu) and where the cost model of
``cuflash._inference_grid.stream_grid`` runs it on an H200. The kernels themselves: the
emulation (tests/test_inference_emu.py) and the GPU tests (tests/test_gpu_inference.py); here,
on the GPU, decode_sm80's A/B builds (prelude defines) against its default, bitwise, the deep
ring (CUFLASH_DECODE_STAGES) against 3 stages, and the default stream grid (session 9)."""

from __future__ import annotations

import os

import pytest

from cuflash import _families, _inference_gpu, _inference_grid, _traits

H200 = _families.PROFILES["h200"]


def _stream_pieces_brute(groups, blocks):
    """(group, block) pairs whose units overlap (decode_mma.cu's stream grid), the slow way."""
    return {(g, i) for g in range(groups) for i in range(blocks)
            if max(g * blocks, i * groups) < min((g + 1) * blocks, (i + 1) * groups)}


@pytest.mark.parametrize("groups,blocks", [(8, 132), (6, 4), (6, 5), (6, 13), (64, 132),
                                           (512, 264), (7, 7), (1, 3)])
def test_stream_grid_pieces_partition_the_groups(groups, blocks):
    """The stream grid's arithmetic (decode_mma.cu), done on the host: every group is covered
    by consecutive blocks first(g) .. last(g), each block by consecutive groups, the pieces of
    a group partition its key iterations (any length), and stream_spans gives the most
    partials a group (the partials' stride) and the most pieces a block."""
    pairs = _stream_pieces_brute(groups, blocks)
    per_group = [sorted(i for g2, i in pairs if g2 == g) for g in range(groups)]
    for g, blocks_g in enumerate(per_group):
        first, last = g * blocks // groups, ((g + 1) * blocks - 1) // groups
        assert blocks_g == list(range(first, last + 1))
        for iters in (0, 1, 5, 37, 2048):
            ends = []
            for i in blocks_g:
                u0, u1 = i * groups, (i + 1) * groups
                lo, hi = max(u0 - g * blocks, 0), min(u1 - g * blocks, blocks)
                ends.append((lo * iters // blocks, hi * iters // blocks))
            assert ends[0][0] == 0 and ends[-1][1] == iters
            assert all(a[1] == b[0] for a, b in zip(ends, ends[1:]))
    for i in range(blocks):
        gs = sorted(g for g, i2 in pairs if i2 == i)
        u0, u1 = i * groups, (i + 1) * groups
        assert gs == list(range(u0 // blocks, (u1 - 1) // blocks + 1))
    assert _inference_grid.stream_spans(groups, blocks) == (
        max(map(len, per_group)), max(sum(1 for g, i2 in pairs if i2 == i) for i in range(blocks)))


def test_stream_grid_choices_on_an_h200(monkeypatch):
    """Where the stream grid runs on an H200 (bf16, d 128, Hq 32, 1 row tile) under
    CUFLASH_DECODE_STREAM=1 (the per-SM cost model's picks); "auto" (the default) only where
    the groups fill the 264 resident slots and a block's share is >= 512 key iterations (the
    B = 64 points it won in session 8: 32/8 64k, 32/32 8k; not 32/8 8k, share 248); "all"
    wherever it applies; "0" nowhere; never where the even splits fill whole waves or the
    cache is short (bench/NOTES.md, "decode: the merge's round trips, a stream grid, L2
    hints", "decode (session 9)")."""
    assert _inference_grid.stream_mode() == "auto" or "CUFLASH_DECODE_STREAM" in os.environ
    t = _traits.DECODE_SM80[128]
    expect = {  # (B, Hkv, L): blocks under "1"; "all" also takes the zeros marked so
        (1, 8, 8192): 0, (1, 8, 65536): 132, (1, 8, 131072): 132, (1, 32, 65536): 0,
        (1, 32, 131072): 132, (8, 8, 8192): 0, (8, 8, 65536): 132, (8, 32, 8192): 0,
        (64, 8, 8192): 0, (64, 8, 65536): 264, (64, 32, 1024): 0, (1, 8, 1024): 0,
        (64, 32, 8192): 0}
    auto = {(64, 8, 65536): 264, (64, 32, 8192): 264}
    for (B, Hkv, L), blocks in expect.items():
        s = _inference_gpu.num_splits_heuristic(B * Hkv, L, t.block_n, H200.num_sms,
                                                t.split_wave)
        args = (B * Hkv, s, L, t.block_n, t.block_n * 256 * 2, H200.num_sms, t.split_wave,
                t.min_blocks)
        assert _inference_grid.stream_grid(*args) == blocks, (B, Hkv, L)
        assert _inference_grid.stream_grid(*args, mode="0") == 0
        assert _inference_grid.stream_grid(*args, mode="auto") == auto.get((B, Hkv, L), 0)
        every = _inference_grid.stream_grid(*args, mode="all")
        assert every == (0 if L <= 8192 and B == 1 and Hkv == 8 or L == 1024 else
                         H200.num_sms * (t.min_blocks if B * Hkv >= 264 else 1)), (B, Hkv, L)
    monkeypatch.setenv("CUFLASH_DECODE_STREAM", "maybe")
    with pytest.raises(ValueError, match="CUFLASH_DECODE_STREAM"):
        _inference_grid.stream_mode()


def test_deep_ring_choices(monkeypatch):
    """decode_sm80's ring depth (_inference_grid.deep_stages): 3 by default; with
    CUFLASH_DECODE_STAGES=auto 3 unless the grid is at most one
    block an SM at head-dim bucket 128; there the deepest of (5, 4) whose shared memory fits
    (an H200: 5, 164 KB; an A100's 163 KB: 4, 132 KB); CUFLASH_DECODE_STAGES=3 never, a forced
    depth only where it fits; a bad value names the variable."""
    monkeypatch.delenv("CUFLASH_DECODE_STAGES", raising=False)
    deep = _inference_grid.deep_stages
    assert _inference_grid.stages_mode() == 3       # off by default (session 9's H200 run)
    assert deep(100, 132, 128, 232448) == 3
    monkeypatch.setenv("CUFLASH_DECODE_STAGES", "auto")
    assert _inference_grid.stages_mode() == 0
    assert [deep(n, 132, 128, 232448) for n in (0, 1, 120, 128, 132, 133, 264)] == [
        3, 5, 5, 5, 5, 3, 3]
    assert deep(96, 108, 128, 166912) == 4 and deep(96, 108, 64, 166912) == 3
    assert deep(64, 46, 128, 101376) == 3           # 99 KB (sm_86/89): no deep ring fits
    for env, h200, a100 in (("3", 3, 3), ("4", 4, 4), ("6", 6, 3), ("auto", 5, 4)):
        monkeypatch.setenv("CUFLASH_DECODE_STAGES", env)
        assert (deep(100, 132, 128, 232448), deep(100, 108, 128, 166912)) == (h200, a100), env
    assert _traits.decode_sm80_smem(128, 5) == 167936 and _traits.decode_sm80_smem(128) == (
        _traits.DECODE_SM80[128].smem_bytes)
    for bad in ("2", "9", "deep"):
        monkeypatch.setenv("CUFLASH_DECODE_STAGES", bad)
        with pytest.raises(ValueError, match="CUFLASH_DECODE_STAGES"):
            _inference_grid.stages_mode()


@pytest.mark.gpu
@pytest.mark.parametrize("env", [{"CUFLASH_DECODE_MERGE": "0"}, {"CUFLASH_DECODE_L2": "256b"},
                                 {"CUFLASH_DECODE_L2": "evict_first"},
                                 {"CUFLASH_DECODE_ARRIVE": "release"},
                                 {"CUFLASH_DECODE_PAGES": "s9"},
                                 {"CUFLASH_DECODE_EARLY": "all", "CUFLASH_DECODE_ARRIVE": "wrap"},
                                 {"CUFLASH_DECODE_EARLY": "one"}],
                         ids=lambda e: "-".join(f"{k[15:]}={v}" for k, v in e.items()))
def test_ab_builds_equal_the_default_bitwise(env, monkeypatch):
    """decode_sm80's A/B builds (prelude defines: the merge without its prefetch, the L2 hints,
    the release arrival, session 11's early copies and one-atomic arrival, the early copies only
    for one split; the default is session 10's prologue and arrival) compute the same operations in the same order as the default build:
    bitwise its output and lse, with 1 split (no merge), 7 and 19 (the fused merge, 19 past its
    16 prefetched partials), call after call (the counters left at 0), batch row 0 empty."""
    import cupy
    import ml_dtypes
    import numpy
    from cuflash import _api, _inference
    rng = numpy.random.default_rng(5)
    B, Hkv, G, L, d = 3, 8, 4, 4096, 128
    bf16 = ml_dtypes.bfloat16
    q = cupy.asarray(rng.standard_normal((B, Hkv, G, 1, d)).astype(bf16))
    kc = cupy.asarray(rng.standard_normal((B, Hkv, 1, L, d)).astype(bf16))
    vc = cupy.asarray(rng.standard_normal((B, Hkv, 1, L, d)).astype(bf16))
    s = cupy.asarray(numpy.array([0, L, 1234], numpy.int32))

    def run(splits):
        outs = [_inference.attention_with_kvcache(q, kc, vc, cache_seqlens=s, num_splits=splits,
                                                  return_lse=True) for _ in range(2)]
        (o0, l0), (o1, l1) = [(cupy.asnumpy(o).view(numpy.uint16), cupy.asnumpy(lse))
                              for o, lse in outs]
        assert numpy.array_equal(o0, o1) and numpy.array_equal(l0, l1)
        return o0, l0
    try:
        _api.clear_plans()
        want = {n: run(n) for n in (1, 7, 19)}
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        _api.clear_plans()
        c = _inference.check_kvcache(q, kc, vc, s, None, None, None, 7, None, False, True)
        spec = _inference_gpu.spec_or_reason(c)
        assert not isinstance(spec, str) and spec.splits == 7, spec
        # (a fused build; its prelude is empty with both of session 11's cuts on)
        assert spec.prelude == _inference_grid.prelude(True, 7)
        for n, (o, lse) in want.items():
            got = run(n)
            assert numpy.array_equal(got[0], o) and numpy.array_equal(got[1], lse), n
    finally:
        for k in env:
            monkeypatch.delenv(k, raising=False)
        _api.clear_plans()


def test_ab_switches_make_the_prelude(monkeypatch):
    """The A/B switches' defines (by default session 11's early copies for a grid of one split
    only and session 10's arrival, session 12's H200 decision; none with both of session 11's
    cuts on: the gate's builds); the fused merge's only for fused builds; a bad value names the
    variable."""
    for k in ("CUFLASH_DECODE_MERGE", "CUFLASH_DECODE_L2", "CUFLASH_DECODE_ARRIVE",
              "CUFLASH_DECODE_PAGES", "CUFLASH_DECODE_EARLY"):
        monkeypatch.delenv(k, raising=False)
    early = "#define CUFLASH_DECODE_EARLY_KV 0\n"
    assert _inference_grid.prelude(False) == ""                    # (one split: early copies)
    assert _inference_grid.prelude(False, 3) == early
    assert _inference_grid.prelude(True, 3) == early + "#define CUFLASH_DECODE_ARRIVE_WRAP 0\n"
    monkeypatch.setenv("CUFLASH_DECODE_EARLY", "all")
    monkeypatch.setenv("CUFLASH_DECODE_ARRIVE", "wrap")
    assert _inference_grid.prelude(True) == _inference_grid.prelude(False) == ""
    monkeypatch.setenv("CUFLASH_DECODE_PAGES", "window")
    assert _inference_grid.prelude(True) == ""
    monkeypatch.setenv("CUFLASH_DECODE_PAGES", "s9")
    assert _inference_grid.prelude(False) == "#define CUFLASH_DECODE_PAGE_WALK 0\n"
    monkeypatch.delenv("CUFLASH_DECODE_PAGES")
    monkeypatch.setenv("CUFLASH_DECODE_MERGE", "0")
    monkeypatch.setenv("CUFLASH_DECODE_L2", "256b")
    monkeypatch.setenv("CUFLASH_DECODE_ARRIVE", "release")
    assert _inference_grid.prelude(True) == ("#define CUFLASH_DECODE_L2 1\n"
                                             "#define CUFLASH_DECODE_MERGE_PREFETCH 0\n"
                                             "#define CUFLASH_DECODE_RELEASE_ARRIVAL 1\n")
    assert _inference_grid.prelude(False) == "#define CUFLASH_DECODE_L2 1\n"
    for k, bad in (("CUFLASH_DECODE_MERGE", "2"), ("CUFLASH_DECODE_L2", "128b"),
                   ("CUFLASH_DECODE_ARRIVE", "acquire"), ("CUFLASH_DECODE_PAGES", "lane")):
        monkeypatch.setenv(k, bad)
        with pytest.raises(ValueError, match=k):
            _inference_grid.prelude(True)
        monkeypatch.delenv(k)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [0, 16])
def test_deep_ring_equals_three_stages_bitwise(page_size, monkeypatch):
    """decode_sm80's deep cp.async ring (grids of at most one block an SM:
    CUFLASH_DECODE_STAGES=auto) against session 8's 3 stages (the default): the
    same operations in the same order, so bitwise the same output and lse, with 1, 2 and 3
    splits (the fused merge), call after call and on two streams; batch row 2 empty; within
    the reference's tolerance."""
    import cupy
    import numpy
    from cuflash import _api, _inference
    from test_gpu_inference import BF16, _bitwise_repeats, _check_rows, _gpu_call
    case = (BF16, 8, 4, 1, 128, 8192, page_size, 0, False, None)
    host, dev, kw = _gpu_call(case, seqlens=[8192, 5001, 0, 77], B=4)
    results, deep = {}, set()
    try:
        for env in ("3", "auto"):
            monkeypatch.setenv("CUFLASH_DECODE_STAGES", env)
            _api.clear_plans()
            for n in (1, 2, 3):
                kw["num_splits"] = n
                c = _inference.check_kvcache(*dev[:5], None, None, n, None, False, True)
                spec = _inference_gpu.spec_or_reason(c)
                assert not isinstance(spec, str), spec
                assert spec.stages == 3 or env == "auto"
                if spec.stages > 3:
                    deep.add(n)
                    assert spec.split[1].endswith(f", false, {spec.stages}>"), spec.explain()
                results[env, n] = _bitwise_repeats(
                    dev, kw, (cupy.cuda.Stream.null, cupy.cuda.Stream(), cupy.cuda.Stream.null))
    finally:
        monkeypatch.delenv("CUFLASH_DECODE_STAGES", raising=False)
        _api.clear_plans()
    if not deep:
        pytest.skip("this GPU runs these grids (32 to 96 blocks) with more than one block an SM")
    for n in (1, 2, 3):
        (o0, l0), (o1, l1) = results["3", n], results["auto", n]
        assert numpy.array_equal(o0.view(numpy.uint16), o1.view(numpy.uint16)), n
        assert numpy.array_equal(l0, l1), n
    o, lse = results["auto", 3]
    assert (o[2] == 0).all() and numpy.isneginf(lse[2]).all()
    _check_rows(*_without_row(host, o, lse, 2, page_size), 0, False, page_size or 16)


@pytest.mark.gpu
def test_stream_grid_by_default_where_the_groups_fill_the_slots(monkeypatch):
    """The default stream grid (CUFLASH_DECODE_STREAM unset: "auto") where the groups fill every
    resident slot: 40 x 8 = 320 groups (H200: 264 slots), its share threshold lowered to these
    short caches; two blocks an SM, 3 stages, pieces of two groups a block. Against the
    reference, bitwise the same call after call, and within tolerance of the even splits
    (CUFLASH_DECODE_STREAM=0)."""
    import cupy
    import numpy
    from cuflash import _api, _inference
    from test_gpu_inference import BF16, _bitwise_repeats, _check_rows, _gpu_call
    monkeypatch.setattr(_inference_grid, "STREAM_AUTO_MIN_SHARE", 1)
    case = (BF16, 8, 4, 1, 128, 2048, 0, 0, False, None)
    B = 40
    seqlens = [2048 - 37 * (b % 7) for b in range(B)]
    seqlens[3] = 0
    host, dev, kw = _gpu_call(case, seqlens=seqlens, B=B)
    out = {}
    try:
        for mode in ("0", ""):
            monkeypatch.setenv("CUFLASH_DECODE_STREAM", mode)
            _api.clear_plans()
            c = _inference.check_kvcache(*dev[:5], None, None, None, None, False, True)
            spec = _inference_gpu.spec_or_reason(c)
            assert not isinstance(spec, str), spec
            if mode == "" and not spec.stream:
                pytest.skip("this GPU's slots hold the 320 groups: no stream grid")
            assert (spec.stream > 0) == (mode == "") and spec.stages == 3
            out[mode] = _bitwise_repeats(dev, kw, (cupy.cuda.Stream.null,) * 3)
    finally:
        monkeypatch.delenv("CUFLASH_DECODE_STREAM", raising=False)
        _api.clear_plans()
    o, lse = out[""]
    assert (o[3] == 0).all() and numpy.isneginf(lse[3]).all()
    for o, lse in out.values():
        _check_rows(*_without_row(host, o, lse, 3, 0), 0, False, 16)


def _without_row(host, o, lse, row, page_size):
    """(host arrays, o, lse) without batch row ``row`` (one that sees no key), for
    test_gpu_inference._check_rows; a paged cache keeps its pages, its table loses the row."""
    keep = [b for b in range(o.shape[0]) if b != row]
    q, kc, vc, s, bt = host[:5]
    kc, vc, bt = (kc, vc, bt[keep]) if page_size else (kc[keep], vc[keep], None)
    return [q[keep], kc, vc, s[keep], bt], o[keep], lse[keep]


def test_split_counts_on_an_h200(monkeypatch):
    """decode_sm80's split count (bf16, d 128, Hq 32, one row tile) on an H200's 132 SMs:
    CUFLASH_DECODE_SPLITS unset ("balance") fills one block an SM with the fewest key
    iterations a block (B 1, Hkv 8: 16 splits = 128 blocks, where session 9's heuristic, "s9",
    ran 14-15); the other points of issue 11's table as before; "slots" a stream grid of whole
    groups over (nearly) every resident slot; a bad value names the variable."""
    import ml_dtypes
    import numpy
    from cuflash import _inference
    bf16 = numpy.dtype(ml_dtypes.bfloat16)

    def shaped(shape):      # a contiguous array's shape and strides, never read (no memory)
        strides = numpy.cumprod((1,) + shape[:0:-1])[::-1] * bf16.itemsize
        return numpy.lib.stride_tricks.as_strided(numpy.zeros(64, bf16), shape, tuple(strides))
    expect = {  # (B, Hkv, L): (s9, balance, slots' blocks)
        (1, 8, 8192): (14, 16, 0), (1, 8, 65536): (15, 16, 264), (1, 8, 131072): (15, 16, 264),
        (1, 32, 65536): (4, 4, 256), (1, 32, 131072): (4, 4, 256), (8, 8, 8192): (2, 2, 256),
        (8, 8, 65536): (2, 2, 256), (8, 8, 131072): (2, 2, 256), (8, 32, 8192): (1, 1, 0),
        (64, 8, 8192): (1, 1, 0), (1, 8, 1024): (4, 4, 0), (8, 8, 1024): (2, 2, 0)}
    for (B, Hkv, L), (old, new, slots) in expect.items():
        q = shaped((B, Hkv, 32 // Hkv, 1, 128))
        kc = shaped((B, Hkv, 1, L, 128))
        got = {}
        for mode in ("s9", "", "balance", "slots"):
            monkeypatch.setenv("CUFLASH_DECODE_SPLITS", mode)
            c = _inference.check_kvcache(q, kc, kc, numpy.full((B,), L, numpy.int32), None, None,
                                         None, None, None, False, True)
            spec = _inference_gpu.spec_or_reason(c, H200)
            got[mode] = (spec.splits, spec.stream)
        assert got["s9"][0] == old and got[""] == got["balance"] == (new, 0), (B, Hkv, L, got)
        if slots:
            k = slots // (B * Hkv)
            assert got["slots"] == (k, slots), (B, Hkv, L, got)
        else:
            assert got["slots"] == got[""], (B, Hkv, L, got)
        assert _inference_grid.stream_spans(B * Hkv, slots or 1)[1] == 1 or not slots
    monkeypatch.setenv("CUFLASH_DECODE_SPLITS", "all")
    with pytest.raises(ValueError, match="CUFLASH_DECODE_SPLITS"):
        _inference_grid.splits_mode()


def test_balanced_splits_leave_no_split_empty():
    """balanced_splits: one wave of one block an SM, the fewest splits for the fewest key
    iterations a block, never an empty last split, never past ``most``; 0 (the older
    heuristic decides) once the groups fill more than half the SMs."""
    for sms in (8, 13, 108, 132):
        for groups in range(1, sms // 2 + 1):
            for iters in (4, 5, 63, 64, 100, 1024, 2048, 4097):
                most = max(1, min(128, iters // 4))
                s = _inference_grid.balanced_splits(groups, iters * 64, 64, sms, most)
                assert 1 <= s <= min(most, sms // groups), (sms, groups, iters)
                per = -(-iters // s)
                assert (s - 1) * per < iters                       # the last split reads keys
                top = max(1, min(most, sms // groups))
                assert per == -(-iters // top)                     # as few as the most splits
        assert _inference_grid.balanced_splits(sms // 2 + 1, 1 << 20, 64, sms, 128) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [16, 48, 256])
def test_page_walk_equals_the_session9_walk_bitwise(page_size, monkeypatch):
    """decode_mma's page walk (a warp's pages 32 tiles at a time, a lane a tile; the default)
    against sessions 7-9's (a table read a tile, CUFLASH_DECODE_PAGES=s9): the same pages, so
    bitwise the same output and lse, with 1 split (one warp's 64 tiles cross a window) and the
    heuristic's; the latter within the reference's tolerance."""
    import cupy
    from cuflash import _api
    from test_gpu_inference import BF16, _check_rows, _gpu_call, _run_device
    case = (BF16, 8, 4, 1, 128, 4096, page_size, 0, False, None)
    seqlens = [4096, 2000, 4095]
    host, dev, kw = _gpu_call(case, seqlens=seqlens)
    out = {}
    try:
        for mode in ("s9", ""):
            monkeypatch.setenv("CUFLASH_DECODE_PAGES", mode)
            _api.clear_plans()
            for splits in (1, None):
                o, lse = _run_device(dev, dict(kw, num_splits=splits))
                out[mode, splits] = (cupy.asnumpy(o), cupy.asnumpy(lse))
    finally:
        monkeypatch.delenv("CUFLASH_DECODE_PAGES", raising=False)
        _api.clear_plans()
    for splits in (1, None):
        (o0, l0), (o1, l1) = out["s9", splits], out["", splits]
        assert numpy_equal(o0, o1) and numpy_equal(l0, l1), splits
    # (against the reference: pages of 16 and 256 in test_gpu_inference's CASES and its every-
    # split-count test; here one point, the heuristic's split count)
    _check_rows(host, out["", None][0], out["", None][1], 0, False, page_size)


def numpy_equal(a, b) -> bool:
    """Bitwise equality of two arrays (NaN patterns included)."""
    import numpy
    return a.shape == b.shape and numpy.array_equal(a.view(numpy.uint8), b.view(numpy.uint8))
