"""dL/dbias on the GPU (session 8): the float32 per-item values of the main kernel summed over
the bias's broadcast dimensions, against the float64 oracle (``gpu`` marker: written without a
device, run on the H200 next).

The plan (cuflash/_plan_mods.py, ``dbias_plan``) skips zeroing the float32 buffer where every
pair is in a tile the kernels visit (no causal, window or block mask) and sums a bias that
broadcasts over leading batch dimensions with one bwd_finish_dq launch (items added in order,
rounded once to the bias's dtype); a bias broadcast over an inner dimension keeps the CuPy sum.
``CUFLASH_DBIAS_REDUCE=0`` restores the old path (zeroed buffer, CuPy sum): both are checked.
The dispatcher's backward (on Hopper bwd_sm90 at d = 64 and at d = 128 without causal,
bwd_sm80 for causal at d = 128) and bwd_sm80 forced (the ``bwd_family`` fixture of
test_gpu_modifiers) both run.
"""

from __future__ import annotations

import ml_dtypes
import numpy
import pytest

import _naive_modifiers as naive
from test_gpu_modifiers import bwd_family, run_gpu_backward  # noqa: F401  (a fixture)

pytestmark = pytest.mark.gpu

BF16 = numpy.dtype(ml_dtypes.bfloat16)

#: (batch shape of q, k, v; bias shape): the bias broadcast over 1, 2 and 3 leading batch
#: dimensions (one bwd_finish_dq launch), over none, over a size-1 leading one, and over an
#: inner one (the CuPy sum)
SHAPES = {
    "over-1": ((2, 3), (3,)),
    "over-2": ((2, 3), ()),
    "over-3": ((2, 2, 3), ()),
    "over-none": ((2, 3), (2, 3)),
    "size-1-lead": ((2, 3), (1, 3)),
    "inner": ((2, 3), (2, 1)),
}


def _inputs(batch, bias_batch, d, bias_dtype=BF16, Lq=300, Lk=230, seed=0):
    rng = numpy.random.default_rng(seed)
    q, k, v = (rng.standard_normal(batch + (L, d)).astype(BF16) for L in (Lq, Lk, Lk))
    bias = rng.standard_normal(bias_batch + (Lq, Lk)).astype(bias_dtype)
    return q, k, v, bias


@pytest.fixture(params=["new", "old"])
def reduce_switch(request, monkeypatch):
    """CUFLASH_DBIAS_REDUCE unset (the new path, the default the other tests run) and = 0
    (the zeroed buffer and CuPy sum)."""
    from cuflash import _api
    if request.param == "old":
        monkeypatch.setenv("CUFLASH_DBIAS_REDUCE", "0")
    else:
        monkeypatch.delenv("CUFLASH_DBIAS_REDUCE", raising=False)
    _api.clear_plans()
    yield request.param
    _api.clear_plans()


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("name", sorted(SHAPES))
def test_dbias_summed_over_broadcast_dims(bwd_family, name, d, causal):
    """dq, dk, dv and dbias (the bias's shape and dtype) match the reference by the kit's rule,
    with every pair written (not causal: the buffer is not zeroed) and with tiles skipped
    (causal, bottom-right: rows without keys, tiles no block visits)."""
    batch, bias_batch = SHAPES[name]
    q, k, v, bias = _inputs(batch, bias_batch, d)
    kw = dict(bias=bias)
    o, lse, do, grads = run_gpu_backward(q, k, v, causal, kw)
    assert grads[3].shape == bias.shape and grads[3].dtype == bias.dtype
    naive.check_gradients(grads, q, k, v, o, lse, do, causal, kw)


@pytest.mark.parametrize("name", ["over-1", "inner"])
def test_dbias_of_a_float32_bias(reduce_switch, name):
    """A float32 bias (not q's dtype): dbias in float32 (bwd_finish_dq<float, float>)."""
    batch, bias_batch = SHAPES[name]
    q, k, v, bias = _inputs(batch, bias_batch, 64, bias_dtype=numpy.float32, seed=3)
    kw = dict(bias=bias)
    o, lse, do, grads = run_gpu_backward(q, k, v, False, kw)
    assert grads[3].dtype == numpy.float32
    naive.check_gradients(grads, q, k, v, o, lse, do, False, kw)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("name", ["over-1", "over-3", "inner"])
def test_dbias_deterministic_is_bitwise_reproducible(reduce_switch, name, d):
    """deterministic=True: dbias (and dq, dk, dv) are the same bits run after run."""
    batch, bias_batch = SHAPES[name]
    q, k, v, bias = _inputs(batch, bias_batch, d, seed=5)
    first = run_gpu_backward(q, k, v, False, dict(bias=bias), deterministic=True)[3]
    for _ in range(2):
        again = run_gpu_backward(q, k, v, False, dict(bias=bias), deterministic=True)[3]
        for a, b in zip(first, again):
            assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("name", ["over-1", "inner"])
def test_dbias_old_and_new_paths(reduce_switch, name, causal):
    """Both paths of the switch (CUFLASH_DBIAS_REDUCE) give dbias by the kit's rule."""
    batch, bias_batch = SHAPES[name]
    q, k, v, bias = _inputs(batch, bias_batch, 64, seed=4)
    kw = dict(bias=bias)
    o, lse, do, grads = run_gpu_backward(q, k, v, causal, kw)
    naive.check_gradients(grads, q, k, v, o, lse, do, causal, kw)


def test_dbias_with_softcap_alibi_sink_on_bwd_sm90_at_d64(bwd_family):
    """The d = 64 set bwd_sm90 runs with a bias (softcap, ALiBi, the sink), not causal and
    causal: the gradients (dbias, dsink too) match the reference; bwd_sm90 on Hopper."""
    import os
    import cupy
    rng = numpy.random.default_rng(8)
    q, k, v, bias = _inputs((2, 3), (3,), 64, seed=8)
    kw = dict(bias=bias, softcap=10.0, sink=rng.standard_normal((3,)).astype(numpy.float32),
              alibi_slopes=rng.uniform(0.01, 0.2, (3,)).astype(numpy.float32))
    for causal in (False, True):
        o, lse, do, grads = run_gpu_backward(q, k, v, causal, kw)
        naive.check_gradients(grads, q, k, v, o, lse, do, causal, kw)
    hopper = cupy.cuda.Device().compute_capability == "90"
    forced = os.environ.get("CUFLASH_BWD") == "sm80"
    assert set(bwd_family) == {"bwd_sm90.cu" if hopper and not forced else "bwd_sm80.cu"}
