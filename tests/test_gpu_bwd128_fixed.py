"""bench/probes/bwd128_fixed.py's arms (session 12, helper s12-bwd128): the defaults,
``CUFLASH_FUSE_DQ=1`` (bwd_sm90 rounds dQ itself above one wave of blocks) and
``CUFLASH_GRID_ORDER=0`` (batch-major under causal), on scaled-down copies of the probe's
points (more key blocks than an H200 has SMs, as there), each against the float64 reference
gradients by cuflash.testing's rule; and, on the CPU, the probe's makespan model (its
numbers are bench/NOTES.md's)."""

from __future__ import annotations

import pathlib
import sys

import numpy
import pytest

import cuflash
from cuflash import _api
from _inputs import make_array
from cuflash.testing import AttentionCase, assert_attention_close

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench" / "probes"))
import bwd128_fixed  # noqa: E402


def test_model_tail_and_order():
    """No GPU. The model behind the probe: under causal, tile-major order ends within 1% of the
    bound at 4k and 16k (the grid order has nothing left to give), batch-major costs 5-7% at
    4k; the fixed part (P + F x blocks an SM) is the same at both lengths (2048 blocks each)."""
    F, t = 17.0, 3.46
    for L, heads in ((4096, 64), (16384, 16)):
        b = bwd128_fixed.blocks(L, heads, True)
        assert len(b) == 2048
        ms = bwd128_fixed.makespan([F + n * t for n in b])
        bound = sum(F + n * t for n in b) / bwd128_fixed.SMS
        assert ms / bound - 1 < 0.01
    tm = bwd128_fixed.makespan([F + n * t for n in bwd128_fixed.blocks(4096, 64, True)])
    bm = bwd128_fixed.makespan([F + n * t for n in bwd128_fixed.blocks(4096, 64, True, "bm")])
    assert 0.05 < bm / tm - 1 < 0.07
    assert sum(bwd128_fixed.blocks(4096, 64, True)) == 64 * 1056      # (64 - 2j) over j < 32
    assert sum(bwd128_fixed.blocks(4096, 32, True, bm=128)) == 32 * 528   # d 64: 128-row tiles


def _check(q, k, v, do, kw):
    import cupy
    o, lse = cuflash.attention(q, k, v, return_lse=True, **kw)
    grads = cuflash.attention_backward(do, q, k, v, o, lse, **kw)
    cupy.cuda.Device().synchronize()
    case = AttentionCase.from_arrays(q, k, v, do=do, **kw)
    assert_attention_close(None, case, grads=grads, check_dtype=True)
    return [cupy.asnumpy(g.astype(cupy.float32)) for g in grads]


def _use_arm(monkeypatch, arm):
    """The probe's arm's switches set (None: unset), the plans built under others forgotten."""
    from test_gpu_backward import setenv
    for name, value in bwd128_fixed.ARMS[arm].items():
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            setenv(monkeypatch, name, value)
    _api.clear_plans()


@pytest.mark.gpu
@pytest.mark.parametrize("arm", list(bwd128_fixed.ARMS))
@pytest.mark.parametrize("d, causal", [(128, True), (128, False), (64, True)])
def test_probe_arms_match_the_reference(monkeypatch, arm, d, causal):
    """B 2, H 9, L 1024 (144 key blocks of 128: more than one wave on 132 SMs, as at the probe's
    points), bf16: each arm's gradients by the kit's rule."""
    from test_gpu_backward import BF16, _hopper_or_skip
    from test_gpu_forward import to_device
    _hopper_or_skip()
    _use_arm(monkeypatch, arm)
    rng = numpy.random.default_rng(d + int(causal))
    shape = (2, 9, 1024, d)
    q, k, v, do = (to_device(make_array(rng, shape, BF16)) for _ in range(4))
    _check(q, k, v, do, {"causal": causal})
    _api.clear_plans()


@pytest.mark.gpu
@pytest.mark.parametrize("arm", ["old", "bm"])
def test_probe_prefix_block_mask(monkeypatch, arm):
    """The probe's prefix-LM point scaled down (L 1000, prefix 250, d 128, 4 heads: as
    test_gpu_block_mask_bwd128's prefix) as the suite builds it (a 128 x 128 block mask
    without causal), in its default order and batch-major, by the kit's rule."""
    from test_gpu_backward import BF16, _hopper_or_skip
    _hopper_or_skip()
    _use_arm(monkeypatch, arm)

    import cupy
    import _naive_modifiers as naive
    rng = numpy.random.default_rng(5)
    q, k, v = (rng.standard_normal((1, 4, 1000, 128)).astype(BF16) for _ in range(3))
    bm = cuflash.block_mask(lambda b, h, qi, kv: (kv < 250) | (qi >= kv), (1, 1), 1000, 1000)
    qd, kd, vd = (cupy.asarray(x) for x in (q, k, v))
    o, lse = cuflash.attention(qd, kd, vd, return_lse=True, block_mask=bm)
    do = rng.standard_normal(o.shape).astype(BF16)
    grads = cuflash.attention_backward(cupy.asarray(do), qd, kd, vd, o, lse, block_mask=bm)
    o, lse = cupy.asnumpy(o), cupy.asnumpy(lse)
    kw = {"block_mask": bm}
    naive.check_result(q, k, v, False, kw, o, lse)
    naive.check_gradients(tuple(cupy.asnumpy(g) for g in grads), q, k, v, o, lse, do, False, kw)
    _api.clear_plans()
