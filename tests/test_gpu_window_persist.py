"""GPU tests of fwd_sm90's persistent schedule (session 10, bench/NOTES.md "the window at short
lists (session 10)"): the analytic window's EVEN builds run a grid of fewer blocks than query
tiles, each block taking (batch item, Q tile) items in turn with the next item's Q and first
K/V loaded during the current one's last key tile. Results by the kit's rule
(tests/_naive_modifiers.check_result), the switch off and on, grids of 1 to 3 items a block,
rows that see no key (bottom-right causal with Lq > Lk: items with no key tile, whose successor
loads its own Q), and plain attention through ``CUFLASH_FWD90_PERSIST=all``."""
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


def _forward(monkeypatch, persist, grid, d, Lq, Lk, causal, kw):
    import cupy
    from cuflash import _api
    monkeypatch.setenv("CUFLASH_FWD90_PERSIST", persist)
    monkeypatch.setenv("CUFLASH_FWD90_PERSIST_GRID", grid)
    _api.clear_plans()
    # more (batch item, Q tile) items than resident blocks: d 64 (128-row blocks, 2 an SM on
    # 132 SMs) 80 x 4 = 320 > 264; d 128 (192-row blocks, 1 an SM) 64 x 3 = 192 > 132
    batch = (5, 16) if d == 64 else (4, 16)
    rng = numpy.random.default_rng(Lq + Lk + d)
    q = rng.standard_normal(batch + (Lq, d)).astype(BF16)
    k, v = (rng.standard_normal(batch + (Lk, d)).astype(BF16) for _ in range(2))
    o, lse = cuflash.attention(*(cupy.asarray(x) for x in (q, k, v)), causal=causal,
                               return_lse=True, **kw)
    out = cupy.asnumpy(o), cupy.asnumpy(lse)
    _api.clear_plans()
    return q, k, v, out


@pytest.mark.parametrize("persist, grid", [("0", "slots"), ("window", "slots"), ("window", "2"),
                                           ("window", "3")])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("window, causal, Lq, Lk", [
    ((200, 0), True, 512, 512),       # the shape, small: the first tiles see fewer keys
    ((100, 60), False, 512, 512),     # both sides
    ((150, 0), True, 500, 512),       # a partial last Q tile (Q is always predicated)
    ((130, 0), True, 512, 256),       # bottom-right: rows 0..255 see no key (items with no tile)
])
def test_window_persistent(monkeypatch, persist, grid, d, window, causal, Lq, Lk):
    kw = {"window": window}
    q, k, v, (o, lse) = _forward(monkeypatch, persist, grid, d, Lq, Lk, causal, kw)
    naive.check_result(q, k, v, causal, kw, o, lse)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("d", [64, 128])
def test_plain_attention_persistent_opt_in(monkeypatch, causal, d):
    """``CUFLASH_FWD90_PERSIST=all``: plain attention (varying tile lengths under causal) on the
    persistent build is right too."""
    q, k, v, (o, lse) = _forward(monkeypatch, "all", "slots", d, 512, 512, causal, {})
    naive.check_result(q, k, v, causal, {}, o, lse)


def test_the_window_plan_is_persistent(monkeypatch):
    """The dispatcher's choice for the shapes above is the persistent build, with a grid of
    min_blocks blocks an SM (what the tests above exercise): with ``CUFLASH_FWD90_PERSIST=auto``
    at d = 128 (a block alone on its SM), with "window" at d = 64 too; by default never."""
    from cuflash import _api, _families
    from cuflash._variant import Variant
    monkeypatch.delenv("CUFLASH_FWD90_PERSIST", raising=False)
    monkeypatch.delenv("CUFLASH_FWD90_PERSIST_GRID", raising=False)
    _api.clear_plans()
    dev = _families.device_info(0)

    def choice(d, nbatch):
        v = Variant(causal=True, window=True)
        return _families.choose("fwd", _families.Shape("bfloat16", nbatch, 512, 512, d, d, v), dev)

    if choice(128, 64).family.name != "fwd_sm90":
        pytest.skip(f"not a Hopper: {choice(128, 64).family.name}")
    assert choice(128, 64).traits["persist"] == 0 and choice(64, 80).traits["persist"] == 0
    monkeypatch.setenv("CUFLASH_FWD90_PERSIST", "auto")
    assert choice(128, 64).traits["persist"] == 1 and choice(64, 80).traits["persist"] == 0
    assert _families.fwd_sm90_grid(choice(128, 64).traits, 192, dev) == min(192, dev.num_sms)
    monkeypatch.setenv("CUFLASH_FWD90_PERSIST", "window")
    c = choice(64, 80)
    assert c.traits["persist"] == 1
    assert _families.fwd_sm90_grid(c.traits, 320, dev) == min(320, 2 * dev.num_sms)


def _check_block_mask_forward(mm, batch, L, d, causal, seed):
    """One bfloat16 forward with the block mask of ``mm`` (its map broadcast over ``batch``) on
    random inputs, against the oracle by the kit's rule; returns the block mask."""
    import cupy
    rng = numpy.random.default_rng(seed)
    q, k, v = (rng.standard_normal(batch + (L, d)).astype(BF16) for _ in range(3))
    bm = cuflash.block_mask(mm, (1, 1), L, L)
    o, lse = cuflash.attention(*(cupy.asarray(x) for x in (q, k, v)), causal=causal,
                               return_lse=True, block_mask=bm)
    naive.check_result(q, k, v, causal, {"block_mask": bm}, cupy.asnumpy(o), cupy.asnumpy(lse))
    return bm


@pytest.mark.parametrize("persist", ["0", "auto"])
@pytest.mark.parametrize("mask", ["documents", "late_rows"])
@pytest.mark.parametrize("causal", [True, False])
def test_block_mask_persistent_at_d128(monkeypatch, persist, mask, causal):
    """A block mask with short lists at d = 128 (min_blocks 1: the registers to spare) runs the
    persistent build: the next item's first list entry is read and its Q, K, V loaded once the
    current item's last tile is issued. 64 items x 6 row blocks of 192 > 132 resident blocks.
    ``late_rows``: the first 256 rows see no key (items with an empty list, after which the
    next item loads its own Q and K/V)."""
    from cuflash import _api
    monkeypatch.setenv("CUFLASH_FWD90_PERSIST", persist)
    _api.clear_plans()
    L, d = 1024, 128
    if mask == "documents":
        mm = lambda b, h, q, kv: ((q // 128) == (kv // 128)) & (q >= kv)   # noqa: E731
    else:
        mm = lambda b, h, q, kv: (q >= 256) & (kv <= q) & (q - kv < 300)   # noqa: E731
    _check_block_mask_forward(mm, (4, 16), L, d, causal, seed=7)
    _api.clear_plans()


@pytest.mark.parametrize("causal", [True, False])
def test_prefix_long_lists_keep_two_blocks_an_sm(causal):
    """Prefix-LM at 4k (query blocks visit 2224 keys on average): the long-list rule gives
    fwd_sm90 the min_blocks 1 build only where it still fits 2 blocks an SM; after a call the
    dispatcher's build for it leaves room for two blocks of its threads (at 256 threads: <= 128
    registers; causal=True took 130 at min_blocks 1 on NVRTC 13, so it keeps 2) or has
    min_blocks 2, and the call is right."""
    from cuflash import _families, _jit, _trace, _trace_cuda
    from cuflash._variant import Variant
    L, d = 4096, 64
    mm = lambda b, h, q, kv: (kv < L // 4) | (q >= kv)   # noqa: E731
    bm = _check_block_mask_forward(mm, (1, 2), L, d, causal, seed=3)
    tr = _trace.trace_mask_mod(mm)
    var = Variant(causal=causal, mask_mod=_trace_cuda.qualified_name(tr), block_mask=True,
                  prelude=tr.source)
    c = _families.choose("fwd", _families.Shape("bfloat16", 2, L, L, d, d, var, False,
                                                bm.mean_row_keys()), _families.device_info(0))
    if c.family.name != "fwd_sm90":
        pytest.skip(f"not a Hopper: {c.family.name}")
    kernel = _jit.get_kernel(c.family.source, c.expr, 0, var.prelude)
    # (two blocks of its threads still fit the register file: the guard of
    # _families.kept_blocks_spilled; at B x H = 2 the block has one warpgroup, 128 threads)
    assert c.traits.min_blocks == 2 or kernel.num_regs * c.traits.threads * 2 <= 65536, \
        (c.expr, kernel.num_regs, c.traits.threads)
