"""GPU tests of fwd_sm90's lean builds (session 11, ``CUFLASH_FWD90_LEAN``;
bench/NOTES.md "the window's instructions per visible pair (session 11)"): the analytic window's
batch offsets without dividing by batch dims of size 1 (``batch_offsets_short``), K/V pointers
advanced a key tile at a time, each warp's masked key tiles decided once and each of them masked
on the one bound that crosses it. Results by the kit's rule (tests/_naive_modifiers.check_result),
the switch off and on: windows wider and narrower than a 64-key tile (both bounds in one tile),
one-sided windows, a partial last key tile (the predicated build), a partial last Q tile, rows
that see no key, and batch layouts whose dims do not merge (one, two and three batch dims, so
the short decomposition divides, stops early, or runs through every dim); block masks (the
short batch offsets alone)."""
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


def _run(monkeypatch, lean, q, k, v, causal, kw, layout=None, cut=False):
    """(o, lse) as NumPy arrays of cuflash's forward with the switch set; ``layout``: the device
    arrays as (batch..., L, H, d) transposed to (batch..., H, L, d), so that H's stride (d) and
    the outer dims' do not merge into one batch dim; ``cut``: dim 1 sliced to its first 3."""
    import cupy
    from cuflash import _api
    monkeypatch.setenv("CUFLASH_FWD90_LEAN", lean)
    _api.clear_plans()
    if layout == "bshd":
        dev = [cupy.ascontiguousarray(cupy.asarray(x).swapaxes(-3, -2)).swapaxes(-3, -2) for x in (q, k, v)]
    else:
        dev = [cupy.asarray(x) for x in (q, k, v)]
    if cut:
        dev = [x[:, :3] for x in dev]
    o, lse = cuflash.attention(*dev, causal=causal, return_lse=True, **kw)
    _api.clear_plans()
    return cupy.asnumpy(o), cupy.asnumpy(lse)


def _inputs(batch, Lq, Lk, d, seed):
    rng = numpy.random.default_rng(seed)
    q = rng.standard_normal(batch + (Lq, d)).astype(BF16)
    k, v = (rng.standard_normal(batch + (Lk, d)).astype(BF16) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("lean", ["0", "1"])
@pytest.mark.parametrize("d", [64, 96, 128, 256])   # (96: the d 128 build, columns 96..127 unwritten)
@pytest.mark.parametrize("window, causal, Lq, Lk", [
    ((200, 0), True, 512, 512),        # the shape, small
    ((30, 0), True, 512, 512),         # narrower than a key tile: both bounds in one tile
    ((100, 60), False, 512, 512),      # both sides, no causal
    ((None, 40), False, 384, 384),     # the upper bound alone (no far edge)
    ((70, None), False, 384, 384),     # the lower bound alone (every tile to the end)
    ((1000, 37), False, 300, 700),     # a partial last key tile: the predicated build
    ((150, 0), True, 500, 512),        # a partial last Q tile
    ((130, 0), True, 512, 256),        # bottom-right: rows 0..255 see no key
])
def test_window_lean(monkeypatch, lean, d, window, causal, Lq, Lk):
    kw = {"window": window}
    q, k, v = _inputs((2, 3), Lq, Lk, d, Lq + Lk + d)
    o, lse = _run(monkeypatch, lean, q, k, v, causal, kw)
    naive.check_result(q, k, v, causal, kw, o, lse)


@pytest.mark.parametrize("lean", ["0", "1"])
@pytest.mark.parametrize("batch", [(7,), (3, 5), (2, 4, 4)])
def test_window_lean_batch_layouts(monkeypatch, lean, batch):
    """Heads' stride d, the outer dims' L H d (and with three dims, the middle one sliced to 3
    of 4): the launcher keeps the dims apart, so batch item b is decomposed over one, two or
    three dims (with divisions where b reaches a dim's extent)."""
    kw = {"window": (90, 0)}
    q, k, v = _inputs(batch, 256, 256, 64, len(batch))
    o, lse = _run(monkeypatch, lean, q, k, v, True, kw, layout="bshd", cut=len(batch) == 3)
    if len(batch) == 3:
        q, k, v = (x[:, :3] for x in (q, k, v))
    naive.check_result(q, k, v, True, kw, o, lse)


@pytest.mark.parametrize("lean", ["0", "1"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("mask", ["documents", "late_rows"])
@pytest.mark.parametrize("causal", [True, False])
def test_block_mask_lean(monkeypatch, lean, d, mask, causal):
    """A block mask's short lists take the short batch offsets only (the loop is the block
    mask's own): packed documents, and rows 0..255 that see no key (empty lists), over a batch
    of two dims that do not merge (3 x 5: divisions where b reaches 5)."""
    if mask == "documents":
        mm = lambda b, h, q, kv: ((q // 128) == (kv // 128)) & (q >= kv)   # noqa: E731
    else:
        mm = lambda b, h, q, kv: (q >= 256) & (kv <= q) & (q - kv < 300)   # noqa: E731
    kw = {"block_mask": cuflash.block_mask(mm, (1, 1), 512, 512)}
    q, k, v = _inputs((3, 5), 512, 512, d, d + causal)
    o, lse = _run(monkeypatch, lean, q, k, v, causal, kw, layout="bshd")
    naive.check_result(q, k, v, causal, kw, o, lse)


def test_the_window_plan_is_lean(monkeypatch):
    """The dispatcher's fwd_sm90 choice for the window is the LEAN build by default (session
    12's H200 run) as with "1" (what the tests above exercise), session 10's with "0"; plain
    attention never."""
    from cuflash import _api, _families
    from cuflash._variant import Variant
    monkeypatch.delenv("CUFLASH_FWD90_LEAN", raising=False)
    monkeypatch.delenv("CUFLASH_FWD90_PERSIST", raising=False)
    _api.clear_plans()
    dev = _families.device_info(0)

    def choice(window=True):
        v = Variant(causal=True, window=window)
        return _families.choose("fwd", _families.Shape("bfloat16", 6, 512, 512, 64, 64, v), dev)

    if choice().family.name != "fwd_sm90":
        pytest.skip("not a Hopper GPU: the window runs on another family")
    assert choice().traits["lean"] == 1 and choice().expr.endswith(", 0, 1>")
    monkeypatch.setenv("CUFLASH_FWD90_LEAN", "0")
    assert choice().traits["lean"] == 0
    monkeypatch.setenv("CUFLASH_FWD90_LEAN", "1")
    assert choice().traits["lean"] == 1 and choice().expr.endswith(", 0, 1>")
    assert choice(window=False).traits["lean"] == 0
