"""The one-launch backward of small problems (cuflash/_plan_one.py, bwd_sm90's ``one_launch``
builds, ``CUFLASH_BWD_ONE_LAUNCH``): D computed by the main kernel and its dQ accumulator and
counters left zeroed for the next call on the stream, against the float64 reference gradients
by cuflash.testing's rule. A workspace left non-zero by a call would add into the next call's
dQ: every test calls one plan several times with different dO and checks each result."""

from __future__ import annotations

import threading

import numpy
import pytest

import cuflash
from _inputs import make_array
from cuflash.testing import AttentionCase, assert_attention_close
from test_gpu_backward import BF16, F16, _hopper_or_skip, setenv
from test_gpu_forward import to_device

pytestmark = pytest.mark.gpu

#: (batch, Lq, Lk, d, dv, causal): one query tile and several, more key tiles than query
#: tiles and the other way round (bottom-right causal with Lq > Lk: rows that see no key),
#: a head dim of the 128 bucket that is not 128, dv != d
SHAPES = [((1, 1), 64, 64, 64, 64, False), ((2, 3), 200, 333, 128, 128, True),
          ((3, 2), 300, 100, 64, 64, True), ((2, 2), 130, 130, 72, 72, "top_left"),
          ((1, 4), 96, 257, 64, 128, False)]


def _plans():
    from cuflash import _api
    return [p for p in _api._BWD_PLANS._d.values() if hasattr(p, "one_kernel")]


def _case(rng, batch, Lq, Lk, d, dv, causal, dtype):
    q = to_device(make_array(rng, batch + (Lq, d), dtype))
    k = to_device(make_array(rng, batch + (Lk, d), dtype))
    v = to_device(make_array(rng, batch + (Lk, dv), dtype))
    do = to_device(make_array(rng, batch + (Lq, dv), dtype))
    return AttentionCase.from_arrays(q, k, v, do=do, causal=causal)


def _backward(case, o, lse, do=None):
    return cuflash.attention_backward(case.do if do is None else do, case.q, case.k, case.v,
                                      o, lse, **case.kwargs)


@pytest.fixture
def one_launch(monkeypatch):
    _hopper_or_skip()
    setenv(monkeypatch, "CUFLASH_BWD_ONE_LAUNCH", "1")
    monkeypatch.delenv("CUFLASH_FUSE_DQ", raising=False)
    yield
    from cuflash import _api
    _api.clear_plans()


@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "f16"])
@pytest.mark.parametrize("batch, Lq, Lk, d, dv, causal", SHAPES)
def test_repeated_calls_match_the_reference(one_launch, dtype, batch, Lq, Lk, d, dv, causal):
    """Four calls of one plan (the first builds it, the others take the fast path), each with
    its own dO, each against the reference; the plan is a one-launch plan."""
    import cupy
    rng = numpy.random.default_rng(31)
    case = _case(rng, batch, Lq, Lk, d, dv, causal, dtype)
    o, lse = cuflash.attention(case.q, case.k, case.v, return_lse=True, **case.kwargs)
    for seed in range(4):
        do = to_device(make_array(numpy.random.default_rng(seed), o.shape, dtype))
        grads = _backward(case, o, lse, do)
        cupy.cuda.Device().synchronize()
        c = AttentionCase.from_arrays(case.q, case.k, case.v, do=do, causal=causal)
        assert_attention_close(None, c, grads=grads, check_dtype=True)
    plans = _plans()
    assert plans and all(p.one_kernel and p._dot is None for p in plans)


def test_old_and_new_paths_in_one_process(monkeypatch):
    """CUFLASH_BWD_ONE_LAUNCH=0 (bwd_dot_do_o, then the main kernel) and =1 (one launch), one
    after the other in one process, both against the reference, with the plans each builds."""
    _hopper_or_skip()
    import cupy
    rng = numpy.random.default_rng(32)
    case = _case(rng, (2, 2), 128, 192, 64, 64, True, BF16)
    o, lse = cuflash.attention(case.q, case.k, case.v, return_lse=True, **case.kwargs)
    for value in ("0", "1", "0", "1"):
        setenv(monkeypatch, "CUFLASH_BWD_ONE_LAUNCH", value)
        for _ in range(2):
            grads = _backward(case, o, lse)
            cupy.cuda.Device().synchronize()
            assert_attention_close(None, case, grads=grads, check_dtype=True)
        assert [p.one_kernel for p in _plans()] == [value == "1"]
    from cuflash import _api
    _api.clear_plans()     # (the plans built under the switch: not for the tests after)


def test_two_streams_and_threads(one_launch):
    """Calls interleaved on two non-blocking streams without synchronising in between (a
    workspace a stream), then two threads each with its own stream: every result against the
    reference."""
    import cupy
    rng = numpy.random.default_rng(33)
    case = _case(rng, (2, 2), 256, 256, 128, 128, False, BF16)
    o, lse = cuflash.attention(case.q, case.k, case.v, return_lse=True, **case.kwargs)
    cupy.cuda.Device().synchronize()
    streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(2)]
    results = []
    for _ in range(3):
        for s in streams:
            with s:
                results.append(_backward(case, o, lse))
    for s in streams:
        s.synchronize()
    for grads in results:
        assert_attention_close(None, case, grads=grads, check_dtype=True)
    (plan,) = _plans()
    assert plan.one_kernel and len(plan.zeroed_ws.by_stream) >= 2
    # (past MAX_STREAMS workspaces, the threads' streams below take fresh ones and a memset)

    out, errors = {}, []

    def worker(i):
        try:
            s = cupy.cuda.Stream(non_blocking=True)
            with s:
                out[i] = [_backward(case, o, lse) for _ in range(3)]
            s.synchronize()
        except BaseException as e:   # reported below
            errors.append(e)
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for grads in (g for i in out for g in out[i]):
        assert_attention_close(None, case, grads=grads, check_dtype=True)


def test_reset_workspace_and_unusable_layouts(one_launch):
    """A stream's workspace zeroed again (what a launch that raises does) between calls; an o
    whose rows the kernel cannot read 16 bytes at a time keeps the two launches."""
    import cupy
    rng = numpy.random.default_rng(34)
    case = _case(rng, (1, 2), 64, 64, 64, 64, False, BF16)
    o, lse = cuflash.attention(case.q, case.k, case.v, return_lse=True, **case.kwargs)
    for _ in range(2):
        grads = _backward(case, o, lse)
        (plan,) = _plans()
        plan.zeroed_ws.reset(cupy.cuda.get_current_stream().ptr)
        cupy.cuda.Device().synchronize()
        assert_attention_close(None, case, grads=grads, check_dtype=True)
    from cuflash import _api
    _api.clear_plans()
    wide = cupy.zeros(o.shape[:-1] + (o.shape[-1] + 1,), o.dtype)   # rows of 65: 130 bytes
    wide[..., :-1] = o
    grads = _backward(case, wide[..., :-1], lse)
    cupy.cuda.Device().synchronize()
    assert_attention_close(None, case, grads=grads, check_dtype=True)
    assert [p.one_kernel for p in _plans()] == [False]


def test_past_the_budget_a_fresh_workspace_is_zeroed(one_launch, monkeypatch):
    """With no bytes left in _plan_one.BUDGET, a one-launch plan takes a fresh workspace a call
    and zeroes its accumulators with a memset: still one kernel, still right, call after call."""
    import cupy
    from cuflash import _plan_one
    monkeypatch.setattr(_plan_one, "BUDGET", 0)
    rng = numpy.random.default_rng(35)
    case = _case(rng, (2, 3), 100, 150, 64, 64, True, BF16)
    o, lse = cuflash.attention(case.q, case.k, case.v, return_lse=True, **case.kwargs)
    for _ in range(3):
        grads = _backward(case, o, lse)
        cupy.cuda.Device().synchronize()
        assert_attention_close(None, case, grads=grads, check_dtype=True)
    (plan,) = _plans()
    assert plan.one_kernel and not plan.zeroed_ws.by_stream


def test_fast_path_key_ignores_strides_of_extent_one_dims(one_launch):
    """The backward's fast-path key (_fast.backward_key) holds a C-contiguous array's strides
    as True: inputs whose extent-1 dimensions have other strides (slices of larger arrays) take
    the plan that contiguous inputs cached, and their gradients are right."""
    import cupy
    rng = numpy.random.default_rng(36)
    case = _case(rng, (1, 1), 64, 64, 64, 64, False, BF16)
    o, lse = cuflash.attention(case.q, case.k, case.v, return_lse=True)
    _backward(case, o, lse)                                      # plans and caches
    big = [cupy.empty((2, 2, 64, 64), BF16) for _ in range(4)]
    views = []
    for b, x in zip(big, (case.q, case.k, case.v, case.do)):
        b[:1, :1] = x
        views.append(b[:1, :1])
    assert all(x.flags.c_contiguous and x.strides != case.q.strides for x in views)
    vq, vk, vv, vdo = views
    cupy.cuda.Device().synchronize()
    from cuflash import _api
    hits = _api._BWD_PLANS.hits
    grads = cuflash.attention_backward(vdo, vq, vk, vv, o, lse)
    assert _api._BWD_PLANS.hits == hits + 1                       # the fast path's lookup
    cupy.cuda.Device().synchronize()
    assert_attention_close(None, case, grads=grads, check_dtype=True)
