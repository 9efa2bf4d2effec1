"""GPU tests of fwd_sm90's block-mask list read at the top of a key tile (session 12,
``CUFLASH_FWD90_BMASK_EARLY``; bench/NOTES.md "the block-mask forward's list read (session
12)"): the lean block-mask build reads the list entry two visits ahead right after the tile's
barrier (``LEAN`` 1) instead of after S's wgmma's are issued (``LEAN`` 3, session 11's loop).
Results by the kit's rule (tests/_naive_modifiers.check_result), the switch on and off: prefix-LM
(long lists, empty tiles for one warpgroup on the diagonal, partial ones), packed documents
(short lists), rows that see no key (empty lists), causal or not, d 64 and 128, whole and partial
last key tiles (the EVEN and the predicated build), on grids that fill the SMs."""
from __future__ import annotations

import ml_dtypes
import numpy
import pytest

import cuflash
import _naive_modifiers as naive

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _fwd_sm90_only(monkeypatch):
    """These are fwd_sm90's builds: keep the dispatcher off fwd_sm90ws, which takes d 128
    (and long d 64) problems by default since session 16."""
    monkeypatch.setenv("CUFLASH_FWD90_WS", "0")


BF16 = numpy.dtype(ml_dtypes.bfloat16)

MASKS = {
    "prefix": lambda L: (lambda b, h, q, kv: (kv < L // 4) | (q >= kv)),
    "documents": lambda L: (lambda b, h, q, kv: ((q // 128) == (kv // 128)) & (q >= kv)),
    "late_rows": lambda L: (lambda b, h, q, kv: (q >= 256) & (kv <= q) & (q - kv < 300)),
}


def _choice(L, d, causal, mm):
    """The dispatcher's fwd_sm90 choice for the point (None off Hopper)."""
    from cuflash import _families, _trace, _trace_cuda
    from cuflash._variant import Variant
    tr = _trace.trace_mask_mod(mm)
    v = Variant(causal=causal, mask_mod=_trace_cuda.qualified_name(tr), block_mask=True,
                prelude=tr.source)
    keys = cuflash.block_mask(mm, (1, 1), L, L).mean_row_keys()
    c = _families.choose("fwd", _families.Shape("bfloat16", 32, L, L, d, d, v, False, keys),
                         _families.device_info(0))
    return c if c.family.name == "fwd_sm90" else None


#: (d, mask, causal, L): the suite's three kinds of lists at d 64, two at d 128, a predicated
#: build of each d (L 1000: the last key tile partial); one compile per case and switch value
CASES = [(64, "prefix", False, 1024), (64, "prefix", True, 1000), (64, "documents", True, 1024),
         (64, "late_rows", False, 1024), (128, "prefix", False, 1024),
         (128, "documents", True, 1000)]


@pytest.mark.parametrize("early", ["1", "0"])
@pytest.mark.parametrize("d, mask, causal, L", CASES)
def test_block_mask_list_read_early(monkeypatch, early, d, mask, causal, L):
    import cupy
    from cuflash import _api
    monkeypatch.setenv("CUFLASH_FWD90_LEAN", "1")
    monkeypatch.setenv("CUFLASH_FWD90_BMASK_EARLY", early)
    _api.clear_plans()
    mm = MASKS[mask](L)
    c = _choice(L, d, causal, mm)
    if c is not None:   # (the build the call below runs: lean 1 reads the list early)
        assert c.traits["lean"] == (1 if early == "1" else 3)
    bm = cuflash.block_mask(mm, (1, 1), L, L)
    kw = {"block_mask": bm}
    rng = numpy.random.default_rng(L + d)
    q, k, v = (rng.standard_normal((4, 8, L, d)).astype(BF16) for _ in range(3))
    o, lse = cuflash.attention(*(cupy.asarray(x) for x in (q, k, v)), causal=causal,
                               return_lse=True, **kw)
    o, lse = cupy.asnumpy(o), cupy.asnumpy(lse)
    _api.clear_plans()
    naive.check_result(q, k, v, causal, kw, o, lse)


def test_early_and_late_reads_agree_bitwise(monkeypatch):
    """The two reads visit the same tiles with the same kinds and the same arithmetic: the
    suite's prefix-LM at d 64 (4 x 32 heads, L 2048: long lists, 2 blocks an SM) gives the same
    o and lse bit for bit."""
    import cupy
    from cuflash import _api
    L = 2048
    bm = cuflash.block_mask(MASKS["prefix"](L), (1, 1), L, L)
    rng = numpy.random.default_rng(7)
    q, k, v = (cupy.asarray(rng.standard_normal((4, 32, L, 64)).astype(BF16)) for _ in range(3))
    out = {}
    monkeypatch.setenv("CUFLASH_FWD90_LEAN", "1")
    for early in ("0", "1"):
        monkeypatch.setenv("CUFLASH_FWD90_BMASK_EARLY", early)
        _api.clear_plans()
        o, lse = cuflash.attention(q, k, v, return_lse=True, block_mask=bm)
        out[early] = (cupy.asnumpy(o), cupy.asnumpy(lse))
    _api.clear_plans()
    assert numpy.array_equal(out["0"][0].view(numpy.uint16), out["1"][0].view(numpy.uint16))
    assert numpy.array_equal(out["0"][1], out["1"][1])
