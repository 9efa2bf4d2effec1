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
