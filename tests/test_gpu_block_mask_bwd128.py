"""GPU tests of the block-mask backward on bwd_sm90 with the mask as bits (session 10,
bench/NOTES.md "The d = 128 block-mask backward on bwd_sm90 (session 10)"): a block mask's
mask_mod at d = 128 runs
bwd_sm90 by default, its mask kept as bits on the plain path (bwd_sm90.cu kMaskBits), with
``CUFLASH_BWD90_BLOCK_MASK=0`` the switch back to bwd_sm80; a mask_mod whose build uses local
memory there goes back to bwd_sm80 (``_families.block_mask_bwd_spilled``). At d = 64 the same
path in 128-row tiles (``CUFLASH_BWD90_BMASK_ROWS=64``: session 9's 64-row ones). Results and
gradients by the kit's rule (tests/_naive_modifiers.check_result / check_gradients)."""
from __future__ import annotations

import ml_dtypes
import numpy
import pytest

import cuflash
import _naive_modifiers as naive

pytestmark = pytest.mark.gpu

BF16 = numpy.dtype(ml_dtypes.bfloat16)
L = 1000     # not a multiple of the tiles: rows past Lq, keys past Lk, partial tiles


def _documents(size):
    return lambda b, h, q, kv: ((q // size) == (kv // size)) & (q >= kv)


def _prefix(n):
    return lambda b, h, q, kv: (kv < n) | (q >= kv)


def _window(n):
    return lambda b, h, q, kv: (q >= kv) & (q - kv <= n)


def _choice(mask_mod, causal, dtype="bfloat16", d=128):
    """The backward the dispatcher picks on device 0 for this block mask at head dim d (after the
    plan's local-memory check), and its kernel's local memory."""
    from cuflash import _families, _jit, _trace, _trace_cuda
    from cuflash._variant import Variant
    tr = _trace.trace_mask_mod(mask_mod)
    v = Variant(causal=causal, mask_mod=_trace_cuda.qualified_name(tr), block_mask=True,
                prelude=tr.source)
    shape = _families.Shape(dtype, 4, L, L, d, d, v)
    dev = _families.device_info(0)
    choice = _families.choose("bwd", shape, dev)
    if _families.block_mask_bwd_spilled(choice, shape, 0):
        choice = _families.choose("bwd", shape, dev)
    kernel = _jit.get_kernel(choice.family.source, choice.expr, 0, tr.source)
    return choice, kernel.local_size_bytes


def _check(mask_mod, causal, dtype=BF16, seed=0, d=128):
    import cupy
    rng = numpy.random.default_rng(seed)
    q, k, v = (rng.standard_normal((1, 4, L, d)).astype(dtype) for _ in range(3))
    bm = cuflash.block_mask(mask_mod, (1, 1), L, L)
    kw = {"block_mask": bm}
    qd, kd, vd = (cupy.asarray(x) for x in (q, k, v))
    o, lse = cuflash.attention(qd, kd, vd, causal=causal, return_lse=True, block_mask=bm)
    do = rng.standard_normal(o.shape).astype(dtype)
    grads = cuflash.attention_backward(cupy.asarray(do), qd, kd, vd, o, lse, causal=causal,
                                       block_mask=bm)
    o, lse = cupy.asnumpy(o), cupy.asnumpy(lse)
    naive.check_result(q, k, v, causal, kw, o, lse)
    naive.check_gradients(tuple(cupy.asnumpy(g) for g in grads), q, k, v, o, lse, do, causal, kw)


MASKS = {"documents96": _documents(96), "prefix100": _prefix(100), "window200": _window(200)}


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", list(MASKS))
def test_d128_block_mask_backward_on_bwd_sm90(name, causal):
    """The suite's kinds of mask_mod (documents, prefix-LM, sliding window) at boundaries that
    cut the kernels' tiles (full, partial and empty tiles in every list), d = 128: the backward
    runs bwd_sm90 with no local memory, and o, lse, dq, dk, dv are right."""
    from cuflash import _api
    _api.clear_plans()
    choice, local = _choice(MASKS[name], causal)
    assert choice.family.name == "bwd_sm90" and local == 0, choice.expr
    _check(MASKS[name], causal)


def test_d128_block_mask_backward_float16():
    """The same path in float16 (documents, causal)."""
    choice, local = _choice(MASKS["documents96"], True, "float16")
    assert choice.family.name == "bwd_sm90" and local == 0, choice.expr
    _check(MASKS["documents96"], True, dtype=numpy.dtype(numpy.float16), seed=1)


def test_the_switch_back_to_bwd_sm80(monkeypatch):
    """``CUFLASH_BWD90_BLOCK_MASK=0`` (plan time) runs the d = 128 block-mask backward on
    bwd_sm80 again, and it is right."""
    from cuflash import _api
    monkeypatch.setenv("CUFLASH_BWD90_BLOCK_MASK", "0")
    _api.clear_plans()
    assert _choice(MASKS["documents96"], True)[0].family.name == "bwd_sm80"
    _check(MASKS["documents96"], True, seed=2)
    monkeypatch.delenv("CUFLASH_BWD90_BLOCK_MASK")
    _api.clear_plans()


def test_a_mask_mod_that_spills_goes_back_to_bwd_sm80():
    """The testing kit's documents (// 7: its bwd_sm90 build spills 8-20 bytes at 255
    registers, session 10): after the plan's check the dispatcher's build is bwd_sm80, or
    bwd_sm90 where this GPU's compile of it uses no local memory, and the call is right.
    (bwd_sm80's build of this mask_mod itself used 8 bytes of local memory on the H200's NVRTC
    13 in session 10, as it did when it was session 9's default: the fallback is the old path,
    not a spill-free one.)"""
    from cuflash import _api
    _api.clear_plans()
    choice, local = _choice(_documents(7), True)
    assert choice.family.name == "bwd_sm80" or local == 0, (choice.expr, local)
    _check(_documents(7), True, seed=3)


@pytest.mark.parametrize("rows", ["128", "64"])
@pytest.mark.parametrize("name, causal", [("documents96", True), ("prefix100", False),
                                          ("window200", True)])
def test_d64_block_mask_backward_in_128_row_tiles(monkeypatch, name, causal, rows):
    """At d = 64 bwd_sm90 keeps 128-row tiles for a block mask's mask_mod, the mask as 64 bits
    on the plain path (the suite's calls: documents and the window causal, prefix not), with no
    local memory; ``CUFLASH_BWD90_BMASK_ROWS=64`` gives session 9's 64-row tiles; o, lse, dq,
    dk, dv right either way."""
    from cuflash import _api
    monkeypatch.setenv("CUFLASH_BWD90_BMASK_ROWS", rows)
    _api.clear_plans()
    choice, local = _choice(MASKS[name], causal, d=64)
    assert choice.family.name == "bwd_sm90" and choice.traits.block_m == int(rows), choice.expr
    assert local == 0, choice.expr
    _check(MASKS[name], causal, seed=4, d=64)
    monkeypatch.delenv("CUFLASH_BWD90_BMASK_ROWS")
    _api.clear_plans()


@pytest.mark.parametrize("d", [128, 64])
@pytest.mark.parametrize("order", ["both", "bwd", "none", ""])
def test_prefix_lm_in_tile_major_grid_order(monkeypatch, order, d):
    """Session 11: ``CUFLASH_BMASK_TILE_MAJOR`` (plan time) "both" runs a block mask without
    causal tile-major, forward and backward (key tile 0 / the last query tile of each of the
    4 heads first; ``_plan.grid_order``; unset: "both", the default since session 12); "bwd"
    the backward only; "none" both batch-major as in session 10: bwd_sm90 with no local
    memory, o, lse, dq, dk, dv right in each order."""
    from cuflash import _api, _plan
    if order:
        monkeypatch.setenv("CUFLASH_BMASK_TILE_MAJOR", order)
    else:
        monkeypatch.delenv("CUFLASH_BMASK_TILE_MAJOR", raising=False)
    monkeypatch.delenv("CUFLASH_GRID_ORDER", raising=False)
    _api.clear_plans()
    choice, local = _choice(MASKS["prefix100"], False, d=d)
    assert choice.family.name == "bwd_sm90" and local == 0, choice.expr
    assert _plan.grid_order(choice, False, True) == (0 if order == "none" else 1)
    _check(MASKS["prefix100"], False, seed=5, d=d)
    monkeypatch.delenv("CUFLASH_BMASK_TILE_MAJOR", raising=False)
    _api.clear_plans()


@pytest.mark.parametrize("rows, d, causal", [("1", 128, False), ("", 128, False), ("1", 64, True),
                                             ("", 64, True), ("1", 96, False)])
def test_dq_additions_in_rows_and_bounded(monkeypatch, rows, d, causal):
    """Session 11: with ``CUFLASH_BWD90_DQ_ROWS=1`` (plan time; off by default: session 12
    timed it at 0.99-1.01x) and d the head-dim bucket, bwd_sm90's block-mask builds add dQ's rows with
    bwd_io::red_row_pairs (no bounds); by default, and for a d below the bucket (96:
    HEAD_DIM 128), ``CUFLASH_BWD90_DQ_BOUNDS`` is defined and they are added as in session 10
    (red_add2). o, lse, dq, dk, dv right each way."""
    from cuflash import _api
    if rows:
        monkeypatch.setenv("CUFLASH_BWD90_DQ_ROWS", rows)
    else:
        monkeypatch.delenv("CUFLASH_BWD90_DQ_ROWS", raising=False)
    _api.clear_plans()
    _check(MASKS["prefix100"] if not causal else MASKS["documents96"], causal, seed=6, d=d)
    monkeypatch.delenv("CUFLASH_BWD90_DQ_ROWS", raising=False)
    _api.clear_plans()
