"""cuflash.block_mask on the CPU: tile kinds against a brute-force evaluation, the index lists
the kernels read, kernel tiles of other sizes, and that the blocked CPU path really skips
empty tiles and does not evaluate the mask_mod on full ones.
"""

from __future__ import annotations

import numpy
import pytest
from hypothesis import given, strategies as st

from cuflash import _captured, _modifiers, _modifiers_cpu, _numpy, _problem
from cuflash._block_mask import EMPTY, FULL, PARTIAL, block_mask

DOC = _captured.captured(numpy.repeat(numpy.arange(8), 40)[None, :].repeat(2, axis=0))
MASK_MODS = [
    lambda b, h, q, kv: q >= kv,
    lambda b, h, q, kv: DOC[b, q] == DOC[b, kv],
    lambda b, h, q, kv: ((q // 7) + (kv // 5) + h) % 3 == 0,
    lambda b, h, q, kv: (kv < 10) | ((q - kv < 20) & (q >= kv)),
    lambda b, h, q, kv: q < 0,
]


def brute_kinds(mm, batch, Lq, Lk, bm, bn, m=None, n=None):
    m, n = m or bm, n or bn
    from _naive_modifiers import batch_index_arrays
    b, h = batch_index_arrays(batch)
    vis = numpy.broadcast_to(mm(b, h, numpy.arange(Lq)[:, None], numpy.arange(Lk)[None, :]),
                             batch + (Lq, Lk))
    Tq, Tk = -(-Lq // m), -(-Lk // n)
    out = numpy.empty(batch + (Tq, Tk), numpy.int8)
    for a in range(Tq):
        for c in range(Tk):
            t = vis[..., a * m:(a + 1) * m, c * n:(c + 1) * n]
            out[..., a, c] = numpy.where(t.all(axis=(-2, -1)), FULL,
                                         numpy.where(t.any(axis=(-2, -1)), PARTIAL, EMPTY))
    return out


@given(st.sampled_from(range(len(MASK_MODS))), st.integers(1, 2), st.integers(1, 3),
       st.integers(0, 300), st.integers(0, 300), st.sampled_from([1, 16, 33, 128]),
       st.sampled_from([1, 8, 64, 128]))
def test_tile_kinds_match_brute_force(which, B, H, Lq, Lk, bm, bn):
    mm = MASK_MODS[which]
    bmask = block_mask(mm, (B, H), Lq, Lk, block=(bm, bn))
    want = brute_kinds(mm, (B, H), Lq, Lk, bm, bn)
    assert bmask.kind.shape == want.shape and (bmask.kind == want).all()
    assert not bmask.kind.flags.writeable and not bmask.full_index.flags.writeable
    # the lists the kernels read
    for kind, count, index in ((PARTIAL, bmask.partial_count, bmask.partial_index),
                               (FULL, bmask.full_count, bmask.full_index)):
        for idx in numpy.ndindex(want.shape[:-1]):
            cols = numpy.flatnonzero(want[idx] == kind)
            assert count[idx] == len(cols)
            assert (index[idx][:len(cols)] == cols).all() and (index[idx][len(cols):] == -1).all()
    kt = want.swapaxes(-1, -2)
    for idx in numpy.ndindex(kt.shape[:-1]):
        rows = numpy.flatnonzero(kt[idx] == FULL)
        assert bmask.q_full_count[idx] == len(rows)
        assert (bmask.q_full_index[idx][:len(rows)] == rows).all()
        rows = numpy.flatnonzero(kt[idx] == PARTIAL)
        assert (bmask.q_partial_index[idx][:len(rows)] == rows).all()


@pytest.mark.parametrize("m, n", [(64, 64), (128, 128), (256, 128), (64, 256), (96, 80)])
def test_kernel_tiles_of_other_sizes(m, n):
    mm = MASK_MODS[0]
    bmask = block_mask(mm, (1, 2), 700, 650)
    got = bmask.tile_kinds(m, n)
    exact = brute_kinds(mm, (1, 2), 700, 650, m, n, m, n)
    assert got.shape == exact.shape
    # never wrong: empty and full only where they truly are; partial may be conservative
    assert ((got == EMPTY) <= (exact == EMPTY)).all() and ((got == FULL) <= (exact == FULL)).all()
    if 128 % m == 0 and 128 % n == 0:       # finer tiles inherit their block's kind
        assert ((got == PARTIAL) <= (bmask.kind.repeat(128 // m, -2).repeat(128 // n, -1)
                                     [..., :got.shape[-2], :got.shape[-1]] == PARTIAL)).all()
    assert (got == EMPTY).any() and (got == FULL).any()


def test_the_blocked_path_skips_empty_tiles_and_full_tiles_skip_the_mask_mod():
    calls = []

    def mm(b, h, q, kv):
        calls.append((int(q.min()), int(q.max()) + 1, int(kv.min()), int(kv.max()) + 1))
        return (q >= kv) & (q - kv < 200)

    Lq = Lk = 512
    bmask = block_mask(mm, (), Lq, Lk, block=(64, 64))
    assert (bmask.kind == FULL).any() and (bmask.kind == EMPTY).any()
    rng = numpy.random.default_rng(0)
    q, k, v = (rng.standard_normal((L, 8)) for L in (Lq, Lk, Lk))
    prob = _problem.make_problem(q, k, v, scale=None, causal=False)
    outs = []
    for kw in (dict(block_mask=bmask), dict(mask_mod=mm)):
        mods = _modifiers.check_modifiers(xp=numpy, device_id=None, batch_shape=(), Lq=Lq,
                                          Lk=Lk, **kw)
        o, lse = numpy.empty((Lq, 8)), numpy.empty(Lq)
        calls.clear()
        _numpy.forward(prob, o, lse, mods=mods, block_m=64, block_n=64)
        outs.append((o, lse, list(calls)))
    (o1, l1, c1), (o2, l2, c2) = outs
    numpy.testing.assert_allclose(o1, o2, rtol=1e-14, atol=1e-14)
    numpy.testing.assert_allclose(l1, l2, rtol=1e-14)
    assert len(c2) == (Lq // 64) * (Lk // 64)              # without: every tile
    partial = int((bmask.kind == PARTIAL).sum())
    assert len(c1) == partial < len(c2)                    # with: partial tiles only
    for i0, i1, j0, j1 in c1:
        assert bmask.kind[i0 // 64, j0 // 64] == PARTIAL


def test_block_mask_errors():
    with pytest.raises(TypeError, match="mask_mod must take 4 positional arguments"):
        block_mask(lambda q, kv: q >= kv, (2,), 8, 8)
    with pytest.raises(TypeError, match="mask_mod .* must return bools"):
        block_mask(lambda b, h, q, kv: q - kv, (2,), 8, 8)
    with pytest.raises(TypeError, match="batch_shape must be a tuple of ints"):
        block_mask(lambda b, h, q, kv: q >= kv, 2, 8, 8)
    with pytest.raises(ValueError, match="Lk must be an int >= 0, got Lk=-1"):
        block_mask(lambda b, h, q, kv: q >= kv, (2,), 8, -1)
    with pytest.raises(ValueError, match=r"block must be a pair of ints > 0, got block=\(0, 8\)"):
        block_mask(lambda b, h, q, kv: q >= kv, (2,), 8, 8, block=(0, 8))


def test_a_broadcast_block_mask_serves_every_head():
    """batch_shape (B, 1): the mask_mod does not depend on h; the map serves (B, H) inputs."""
    mm = MASK_MODS[1]
    bmask = block_mask(mm, (2, 1), 320, 320, block=(64, 64))
    rng = numpy.random.default_rng(1)
    q, k, v = (rng.standard_normal((2, 3, 320, 4)) for _ in range(3))
    prob = _problem.make_problem(q, k, v, scale=None, causal=False)
    res = []
    for kw in (dict(block_mask=bmask), dict(mask_mod=mm)):
        mods = _modifiers.check_modifiers(xp=numpy, device_id=None, batch_shape=(2, 3),
                                          Lq=320, Lk=320, **kw)
        o, lse = numpy.empty((2, 3, 320, 4)), numpy.empty((2, 3, 320))
        _numpy.forward(prob, o, lse, mods=mods, block_m=64, block_n=32)
        res.append(o)
    numpy.testing.assert_allclose(res[0], res[1], rtol=1e-14, atol=1e-14)


# -- the kernels' tile lists (session 8: _block_mask.tile_lists) ---------------------------------

def _decode_lists(tl, batch):
    """(per query tile: [(key tile, [slice kinds])], per key tile: [(query tile, kind)]) of
    every batch item, read back from ``tl.data`` as cuda_src/modifiers.cuh reads it."""
    from cuflash._block_mask import LIST_END, LIST_SHIFT
    ns = tl.m // tl.sub
    fwd, bwd = {}, {}
    for idx in numpy.ndindex(batch):
        row = tl.data[idx]
        starts = [tl.tq + a * (tl.tk + 2) for a in range(tl.tq)]
        fwd[idx] = [[(int(e) >> LIST_SHIFT, [(int(e) >> 2 * s) & 3 for s in range(ns)])
                     for e in row[s0:s0 + row[a]]] for a, s0 in enumerate(starts)]
        # after the count: LIST_END to the row's end (2 past Tk at least)
        assert all((row[s0 + row[a]:s0 + tl.tk + 2] == LIST_END).all()
                   for a, s0 in enumerate(starts))
        starts = [tl.bwd + tl.tk + c * (tl.tq + 2) for c in range(tl.tk)]
        bwd[idx] = [[(int(e) >> LIST_SHIFT, int(e) & 3) for e in row[s0:s0 + row[tl.bwd + c]]]
                    for c, s0 in enumerate(starts)]
        assert all((row[s0 + row[tl.bwd + c]:s0 + tl.tq + 2] == LIST_END).all()
                   for c, s0 in enumerate(starts))
        assert row.size == starts[-1] + tl.tq + 2 if starts else True
    return fwd, bwd


def _check_lists(tl, batch, slices, whole):
    """The lists ``tl`` hold, per query tile, exactly the key tiles where some row slice's kind
    (``slices``, sub-row tiles) is not empty, with those kinds, and per key tile exactly the
    query tiles whose whole tile's kind (``whole``) is not empty, with it."""
    fwd, bwd = _decode_lists(tl, batch)
    ns = tl.m // tl.sub
    for idx in numpy.ndindex(batch):
        for a in range(tl.tq):
            kinds = [slices[idx][s] if s < slices.shape[-2] else numpy.zeros(tl.tk, int)
                     for s in range(a * ns, (a + 1) * ns)]   # slices past Lq: empty
            want = [(c, [int(k[c]) for k in kinds]) for c in range(tl.tk)
                    if any(k[c] != EMPTY for k in kinds)]
            assert fwd[idx][a] == want, (idx, a)
        for c in range(tl.tk):
            want = [(a, int(whole[idx][a, c])) for a in range(tl.tq) if whole[idx][a, c] != EMPTY]
            assert bwd[idx][c] == want, (idx, c)


@given(st.sampled_from(range(len(MASK_MODS))), st.integers(1, 2), st.integers(1, 3),
       st.integers(0, 300), st.integers(0, 300), st.sampled_from([(16, 8), (33, 64), (128, 128)]),
       st.sampled_from([(64, 64, 64), (192, 64, 64), (128, 32, 16), (40, 24, 8), (64, 128, 64)]))
def test_tile_lists_match_brute_force(which, B, H, Lq, Lk, block, tiles):
    """Every kind, empty rows and columns (a mask_mod hiding everything; Lq or Lk 0), map blocks
    that neither equal nor divide the kernel's tiles, Lq and Lk not multiples of either: per
    query tile exactly the key tiles with some row slice not empty, ascending, each slice's
    kind that of its own tile of the map's classification (never empty or full where the pairs
    are not); per key tile exactly the query tiles not empty, with the whole tile's kind."""
    from cuflash._block_mask import kernel_tile_kinds, tile_lists
    mm = MASK_MODS[which]
    m, n, sub = tiles
    bmask = block_mask(mm, (B, H), Lq, Lk, block=block)
    tl = tile_lists(bmask, m, n, sub)
    assert (tl.tq, tl.tk) == (-(-Lq // m), -(-Lk // n))
    assert not tl.data.flags.writeable and tl.data.dtype == numpy.int32
    slices = bmask.tile_kinds(sub, n)                        # the loop's reference
    assert (kernel_tile_kinds(bmask, sub, n) == slices).all()
    whole = bmask.tile_kinds(m, n)
    assert (kernel_tile_kinds(bmask, m, n) == whole).all()
    exact = brute_kinds(mm, (B, H), Lq, Lk, sub, n)
    assert ((slices == EMPTY) <= (exact == EMPTY)).all() and ((slices == FULL) <= (exact == FULL)).all()
    coarse = bmask.coarse_tile_kinds(sub, n)          # the fine grid: never less precise
    assert ((coarse == EMPTY) <= (slices == EMPTY)).all() and ((coarse == FULL) <= (slices == FULL)).all()
    fm, fn = bmask.fine_block
    if sub % fm == 0 and n % fn == 0:                 # tiles of whole fine blocks: exact
        assert (slices == exact).all()
    _check_lists(tl, (B, H), slices, whole)
    if which == 4:                                           # everything hidden: empty lists
        assert not tl.data[..., :tl.tq].any() and not tl.data[..., tl.bwd:tl.bwd + tl.tk].any()


def test_tile_lists_are_built_once_per_tile_shape_and_checked():
    from cuflash._block_mask import host_lists, tile_lists
    bmask = block_mask(MASK_MODS[3], (1, 1), 500, 400)
    a = host_lists(bmask, 192, 64, 64)
    assert host_lists(bmask, 192, 64, 64) is a and host_lists(bmask, 64, 128) is not a
    assert host_lists(bmask, 64, 128).sub == 64
    with pytest.raises(ValueError, match="slices"):
        tile_lists(bmask, 192, 64, 50)
    with pytest.raises(ValueError, match="slices"):
        tile_lists(bmask, 16 * 9, 64, 16)


def brute_causal_kinds(mm, batch, Lq, Lk, m, n, offset):
    """The kinds of the pairs within the causal bound j <= i + offset, tile by tile: full where
    the mask_mod keeps every such pair, empty where it keeps none or there is none; and
    whether the tile holds a pair within the bound."""
    from _naive_modifiers import batch_index_arrays
    b, h = batch_index_arrays(batch)
    i, j = numpy.arange(Lq)[:, None], numpy.arange(Lk)[None, :]
    vis = numpy.broadcast_to(mm(b, h, i, j), batch + (Lq, Lk))
    bound = numpy.broadcast_to(j <= i + offset, batch + (Lq, Lk))
    Tq, Tk = -(-Lq // m), -(-Lk // n)
    out = numpy.empty(batch + (Tq, Tk), numpy.int8)
    inside = numpy.empty(batch + (Tq, Tk), bool)
    for a in range(Tq):
        for c in range(Tk):
            t = vis[..., a * m:(a + 1) * m, c * n:(c + 1) * n]
            w = bound[..., a * m:(a + 1) * m, c * n:(c + 1) * n]
            some = (t & w).any(axis=(-2, -1))
            inside[..., a, c] = w.any(axis=(-2, -1))
            out[..., a, c] = numpy.where(some & (t | ~w).all(axis=(-2, -1)), FULL,
                                         numpy.where(some, PARTIAL, EMPTY))
    return out, inside


@given(st.sampled_from(range(len(MASK_MODS))), st.integers(1, 2), st.integers(1, 2),
       st.integers(0, 260), st.integers(0, 260), st.sampled_from([(16, 8), (33, 64), (128, 128)]),
       st.sampled_from([(64, 64, 64), (192, 64, 64), (128, 32, 16), (40, 24, 8), (64, 128, 64)]))
def test_causal_tile_lists_classify_the_pairs_within_the_bound(which, B, H, Lq, Lk, block, tiles):
    """Session 9: a causal call's lists (``causal`` = its offset Lk - Lq) classify each tile on
    the pairs within the causal bound only (the kernels bound every crossing tile themselves):
    never empty or full where those pairs are not, exact on tiles of whole fine blocks, and
    never less precise than the mask_mod's own kinds; the lists hold exactly the tiles with
    such a pair kept (the backward's transpose the same)."""
    from cuflash._block_mask import kernel_tile_kinds, tile_lists
    mm = MASK_MODS[which]
    m, n, sub = tiles
    off = Lk - Lq
    bmask = block_mask(mm, (B, H), Lq, Lk, block=block)
    slices = kernel_tile_kinds(bmask, sub, n, off)
    exact, inside = brute_causal_kinds(mm, (B, H), Lq, Lk, sub, n, off)
    # (a tile with no pair within the bound may be called anything: the kernel masks it all)
    assert ((slices == EMPTY) & inside <= (exact == EMPTY)).all()
    assert ((slices == FULL) & inside <= (exact == FULL)).all()
    plain = kernel_tile_kinds(bmask, sub, n)
    assert ((plain == FULL) & inside <= (slices == FULL)).all()
    assert ((plain == EMPTY) & inside <= (slices == EMPTY)).all()
    fm, fn = bmask.fine_block
    if sub % fm == 0 and n % fn == 0 and m % fm == 0:
        assert (slices[inside] == exact[inside]).all()
    whole = kernel_tile_kinds(bmask, m, n, off)
    _check_lists(tile_lists(bmask, m, n, sub, off), (B, H), slices, whole)


def test_causal_lists_make_a_causal_documents_mask_all_full():
    """The suite's 8 causal documents at 4k (boundaries every 512 rows): on fwd_sm90's tiles
    (128 x 64, 64-row slices) and bwd_sm90's (64 x 128) no tile is partial once the causal
    bound is the kernel's; the mask_mod's own kinds leave the 64 diagonal slices partial.
    The lists are kept per causal offset."""
    from cuflash._block_mask import host_lists, kernel_tile_kinds
    L = 4096
    bmask = block_mask(lambda b, h, q, kv: ((q // 512) == (kv // 512)) & (q >= kv), (1, 1), L, L)
    assert (kernel_tile_kinds(bmask, 64, 64) == PARTIAL).sum() == 64
    for m, n in ((64, 64), (64, 128), (128, 64)):
        assert not (kernel_tile_kinds(bmask, m, n, 0) == PARTIAL).any()
    a = host_lists(bmask, 128, 64, 64, 0)
    assert host_lists(bmask, 128, 64, 64, 0) is a and host_lists(bmask, 128, 64, 64) is not a
    assert (a.data[..., :a.tq] == host_lists(bmask, 128, 64, 64).data[..., :a.tq]).all()


def test_fwd_sm90_keeps_two_blocks_an_sm_for_a_block_mask_at_d64(monkeypatch):
    """Session 9: at d = 64 a block mask's mask_mod alone (with causal or not) keeps fwd_sm90's
    table min_blocks (2: the 128-register cap) in the EVEN build; the predicated build, softcap
    beside it, ``CUFLASH_FWD90_BMASK_BLOCKS=1`` and a build the GPU found using local memory
    (``kept_blocks_spilled``, which records it) take 1, as before."""
    from cuflash import _families, _jit, _trace, _trace_cuda
    from cuflash._variant import Variant
    tr = _trace.trace_mask_mod(lambda b, h, q, kv: ((q // 512) == (kv // 512)) & (q >= kv))
    dev = _families.PROFILES["h200"]

    def choice(L=4096, causal=True, **more):
        v = Variant(causal=causal, mask_mod=_trace_cuda.qualified_name(tr), block_mask=True,
                    prelude=tr.source, **more)
        shape = _families.Shape("bfloat16", 128, L, L, 64, 64, v)
        return _families.choose("fwd", shape, dev), shape

    c, shape = choice()
    assert c.family.name == "fwd_sm90" and c.traits.min_blocks == 2 and c.flag["even"]
    assert choice(causal=False)[0].traits.min_blocks == 2
    assert choice(L=4000)[0].traits.min_blocks == 1
    assert choice(softcap=True)[0].traits.min_blocks == 1
    monkeypatch.setenv("CUFLASH_FWD90_BMASK_BLOCKS", "1")
    assert choice()[0].traits.min_blocks == 1
    monkeypatch.setenv("CUFLASH_FWD90_BMASK_BLOCKS", "2")
    with pytest.raises(ValueError, match="CUFLASH_FWD90_BMASK_BLOCKS"):
        choice()
    monkeypatch.delenv("CUFLASH_FWD90_BMASK_BLOCKS")
    kernels = []

    class Kernel:
        local_size_bytes = 0

    monkeypatch.setattr(_jit, "get_kernel", lambda *a: kernels.append(a) or Kernel)
    from cuflash import _spills
    monkeypatch.setattr(_spills, "KEPT_BLOCKS_SPILLED", set())
    assert not _families.kept_blocks_spilled(c, shape, 0) and kernels[-1][1] == c.expr
    Kernel.local_size_bytes = 16
    assert _families.kept_blocks_spilled(c, shape, 0)
    again = choice()[0]
    assert again.traits.min_blocks == 1 and not _families.kept_blocks_spilled(again, shape, 0)
    assert len(kernels) == 2        # a build at 1 block an SM is not checked
