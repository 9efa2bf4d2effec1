"""GPU tests of the block-mask choices of session 9 (bench/NOTES.md "block masks at short lists
(session 9)"): fwd_sm90 at d = 64 keeps 2 blocks an SM for a block mask's mask_mod, and a causal
call's tile lists are classified on the pairs within the causal bound (the diagonal tiles of a
causal documents mask become full: no mask_mod there, the kernels' causal bound masks them).
Results by the kit's rule (tests/_naive_modifiers.check_result / check_gradients)."""
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


def _documents(size):
    return lambda b, h, q, kv: ((q // size) == (kv // size)) & (q >= kv)


def _run(q, k, v, causal, bm, backward=True):
    import cupy
    qd, kd, vd = (cupy.asarray(x) for x in (q, k, v))
    o, lse = cuflash.attention(qd, kd, vd, causal=causal, return_lse=True, block_mask=bm)
    out = [cupy.asnumpy(o), cupy.asnumpy(lse)]
    if backward:
        do = numpy.random.default_rng(1).standard_normal(o.shape).astype(q.dtype)
        grads = cuflash.attention_backward(cupy.asarray(do), qd, kd, vd, o, lse, causal=causal,
                                           block_mask=bm)
        out += [do, tuple(cupy.asnumpy(g) for g in grads)]
    cupy.cuda.Device().synchronize()
    return out


@pytest.mark.parametrize("blocks, kinds", [("table", "1"), ("1", "0")], ids=["new", "old"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("d", [64, 128])
def test_documents_with_the_session9_switches(monkeypatch, d, causal, blocks, kinds):
    """The suite's causal documents (boundaries every 128 rows here, so every kernel tile is
    full or empty once the causal bound is the kernel's) on a grid large enough for 2-warpgroup
    blocks at d = 64 (48 items x 8 row blocks), the switches on and off: o, lse, dq, dk, dv."""
    from cuflash import _api
    monkeypatch.setenv("CUFLASH_FWD90_BMASK_BLOCKS", blocks)
    monkeypatch.setenv("CUFLASH_BMASK_CAUSAL_KINDS", kinds)
    _api.clear_plans()
    L = 1024
    rng = numpy.random.default_rng(d)
    batch = (3, 16) if d == 64 else (2, 8)     # d 64: 48 items x 8 row blocks >= 2 x 132
    q, k, v = (rng.standard_normal(batch + (L, d)).astype(BF16) for _ in range(3))
    bm = cuflash.block_mask(_documents(128), (1, 1), L, L)
    kw = {"block_mask": bm}
    o, lse, do, grads = _run(q, k, v, causal, bm)
    naive.check_result(q, k, v, causal, kw, o, lse)
    naive.check_gradients(grads, q, k, v, o, lse, do, causal, kw)
    _api.clear_plans()


def test_a_mask_mod_that_spills_at_two_blocks_runs_at_one():
    """The testing kit's documents (// 7: ptxas spills 16-32 bytes at 128 registers, session 9)
    at d = 64, EVEN, 2-warpgroup blocks (64 items x 8 row blocks fill the SMs twice): after a
    call the dispatcher's build for it uses no local memory
    (``_families.kept_blocks_spilled`` took it back to one block an SM), and the call is
    right."""
    from cuflash import _families, _jit, _trace, _trace_cuda
    from cuflash._variant import Variant
    L = 1024
    mm = _documents(7)
    rng = numpy.random.default_rng(0)
    q, k, v = (rng.standard_normal((4, 16, L, 64)).astype(BF16) for _ in range(3))
    bm = cuflash.block_mask(mm, (1, 1), L, L)
    o, lse = _run(q, k, v, True, bm, backward=False)
    naive.check_result(q, k, v, True, {"block_mask": bm}, o, lse)
    tr = _trace.trace_mask_mod(mm)
    shape = _families.Shape("bfloat16", 64, L, L, 64, 64,
                            Variant(causal=True, mask_mod=_trace_cuda.qualified_name(tr),
                                    block_mask=True, prelude=tr.source))
    choice = _families.choose("fwd", shape, _families.device_info(0))
    if _families.kept_blocks_spilled(choice, shape, 0):
        choice = _families.choose("fwd", shape, _families.device_info(0))
    kernel = _jit.get_kernel(choice.family.source, choice.expr, 0, tr.source)
    assert kernel.local_size_bytes == 0, choice.expr


@pytest.mark.parametrize("wg", ["1", "2"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("mask", ["documents", "window"])
def test_short_lists_in_blocks_of_fewer_warpgroups(monkeypatch, mask, d, wg):
    """``CUFLASH_FWD90_BMASK_SHORT_WG`` (session 11): fwd_sm90 blocks of at most 1 or 2
    warpgroups for a block mask with short lists. Documents of 320 rows (a boundary inside 64-,
    128- and 192-row blocks alike) and a window of 200 keys, causal, forward and gradients by
    the kit's rule, and the dispatcher really picked that many warpgroups."""
    from cuflash import _api, _families, _trace, _trace_cuda
    from cuflash._variant import Variant
    monkeypatch.setenv("CUFLASH_FWD90_BMASK_SHORT_WG", wg)
    _api.clear_plans()
    L = 1024
    mm = _documents(320) if mask == "documents" else (lambda b, h, q, kv: (q >= kv) & (q - kv <= 200))
    rng = numpy.random.default_rng(d + int(wg))
    q, k, v = (rng.standard_normal((2, 8, L, d)).astype(BF16) for _ in range(3))
    bm = cuflash.block_mask(mm, (1, 1), L, L)
    kw = {"block_mask": bm}
    o, lse, do, grads = _run(q, k, v, True, bm)
    naive.check_result(q, k, v, True, kw, o, lse)
    naive.check_gradients(grads, q, k, v, o, lse, do, True, kw)
    tr = _trace.trace_mask_mod(mm)
    shape = _families.Shape("bfloat16", 16, L, L, d, d,
                            Variant(causal=True, mask_mod=_trace_cuda.qualified_name(tr),
                                    block_mask=True, prelude=tr.source), False,
                            bm.mean_row_keys())
    choice = _families.choose("fwd", shape, _families.device_info(0))
    assert choice.family.name == "fwd_sm90" and choice.traits["warpgroups"] <= int(wg)
    _api.clear_plans()
