"""The plan cache and the launcher's host-side pieces, on the CPU (no GPU needed)."""

from __future__ import annotations

import threading

import numpy
import pytest

from cuflash import _launch
from cuflash._plan import PlanCache


def test_cache_is_bounded_and_keeps_the_first_of_a_race():
    cache = PlanCache(maxsize=3)
    for i in range(10):
        assert cache.get_or_build(i, lambda i=i: f"plan {i}") == f"plan {i}"
    assert len(cache) == 3 and cache.get(9) == "plan 9" and cache.get(0) is None
    assert cache.get_or_build(9, lambda: "other") == "plan 9"


def test_cache_under_many_threads_with_cold_keys():
    cache, built = PlanCache(maxsize=64), []
    barrier = threading.Barrier(16)
    results: dict[int, list] = {}

    def build(key):
        built.append(key)
        return ("plan", key)

    def worker(t):
        barrier.wait()
        results[t] = [cache.get_or_build(i % 8, lambda i=i: build(i % 8)) for i in range(200)]

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # every thread saw one and the same plan per key, whoever built it
    for got in results.values():
        assert got == [("plan", i % 8) for i in range(200)]
    assert {cache.get(i) for i in range(8)} == {("plan", i) for i in range(8)}
    assert len(cache) == 8


def test_batch_layout_merges_and_splits():
    x = numpy.zeros((2, 3, 4, 5, 6, 7, 8), numpy.float32)          # 5 batch dims, C order
    lay = _launch.batch_layout(x.shape[:-2], [x])
    assert lay.inner == (1, 1, 1, 2 * 3 * 4 * 5 * 6) and len(lay.outer) == 1   # all merged
    y = x.transpose(1, 0, 3, 2, 4, 5, 6)                             # nothing merges
    lay = _launch.batch_layout(y.shape[:-2], [y])
    assert lay.inner == (2, 5, 4, 6) and len(lay.outer) == 3
    assert [first for first, _ in lay.outer] == [0, 240, 480]
    es = _launch.elem_strides(y)
    assert [offs[0] for _, offs in lay.outer] == [0, es[0], 2 * es[0]]
    b = numpy.broadcast_to(numpy.zeros((1, 4, 1, 6, 7, 8), numpy.float32), (3, 4, 5, 6, 7, 8))
    lay = _launch.batch_layout(b.shape[:-2], [b])
    assert lay.inner == (3, 4, 5, 6) and lay.strides[0] == (0, 6 * 56, 0, 56)


def test_pack_fills_params():
    from cuflash import _problem
    from cuflash._variant import variant_params
    q = numpy.zeros((2, 3, 10, 8), numpy.float32)
    k = numpy.zeros((2, 1, 12, 8), numpy.float32)
    prob = _problem.make_problem(q, k, k, scale=0.5, causal=True)
    o = numpy.zeros((2, 3, 10, 8), numpy.float32)
    t = {"q": prob.q, "k": prob.k, "v": prob.v, "o": o}
    lay = _launch.batch_layout(prob.batch_shape, list(t.values()))
    p = _launch.pack(prob, t, lay, variant_params(prob), num_m_blocks=1)
    assert p["Lq"] == 10 and p["Lk"] == 12 and p["nbatch"] == 6
    assert list(p["batch_shape"]) == [1, 1, 2, 3] and list(p["k_batch_stride"]) == [0, 0, 96, 0]
    assert p["var"]["causal_offset"] == 2 and p["var"]["scale"] == 0.5
    assert abs(p["var"]["scale_log2"] - 0.5 * 1.4426950408889634) < 1e-15
    assert all(p[name] == 0 for name in _launch.POINTERS)
    assert [_launch.word(n) for n in ("q", "dq_sem")] == [0, 10]
    assert _launch.PARAMS.fields["q"][1] == 0 and _launch.PARAMS.fields["dq_sem"][1] == 80


@pytest.mark.parametrize("batch, bias_batch, causal, block_mask, expect", [
    ((4, 16), (16,), False, False, (True, (4, 16 * 6 * 5))),       # (H, L, L) over B
    ((4, 16), (), False, False, (True, (64, 6 * 5))),              # (L, L) over (B, H)
    ((2, 2, 3), (), True, False, (False, (12, 6 * 5))),           # causal: zeroed
    ((4, 16), (4, 16), False, True, (False, (1, 64 * 6 * 5))),    # no broadcast; block mask
    ((4, 16), (1, 16), False, False, (True, (4, 16 * 6 * 5))),    # a size-1 leading dim
    ((4, 16), (4, 1), False, False, (True, None)),                # inner: the CuPy sum
])
def test_dbias_plan(monkeypatch, batch, bias_batch, causal, block_mask, expect):
    """_plan_mods.dbias_plan: the float32 buffer unzeroed where every pair is written (nothing
    bounds the walk), one bwd_finish_dq sum where the bias broadcasts over leading batch dims
    (parts, n); CUFLASH_DBIAS_REDUCE=0 restores the zeroed buffer and the CuPy sum."""
    from types import SimpleNamespace
    from cuflash._plan_mods import dbias_plan as _dbias_plan
    from cuflash._variant import Variant
    import ml_dtypes
    bf16 = numpy.dtype(ml_dtypes.bfloat16)
    prob = SimpleNamespace(batch_shape=batch, Lq=6, Lk=5)
    mods = SimpleNamespace(bias_shape=bias_batch + (6, 5), bias_dtype=bf16,
                           block_mask=object() if block_mask else None)
    var = Variant(causal=causal, bias="__nv_bfloat16")
    monkeypatch.delenv("CUFLASH_DBIAS_REDUCE", raising=False)
    full, total = _dbias_plan(var, mods, prob, True)
    assert (full, total and total[:2]) == expect
    assert total is None or total[2] == bf16
    monkeypatch.setenv("CUFLASH_DBIAS_REDUCE", "0")
    assert _dbias_plan(var, mods, prob, True) == (False, None)
    assert _dbias_plan(var, mods, prob, False) == (False, None)
    mods.bias_dtype = numpy.dtype(numpy.float64)     # no kernel T for it: the CuPy sum
    monkeypatch.delenv("CUFLASH_DBIAS_REDUCE")
    assert _dbias_plan(var, mods, prob, True)[1] is None
    monkeypatch.setenv("CUFLASH_DBIAS_REDUCE", "yes")
    with pytest.raises(ValueError, match="CUFLASH_DBIAS_REDUCE"):
        _dbias_plan(var, mods, prob, True)


def test_dbias_plan_refuses_32_bit_overflow_on_bwd_sm90():
    """bwd_sm90 writes dbias with 32-bit offsets inside an item: Lq * Lk >= 2**31 is a
    ValueError naming the lengths (bwd_sm80 keeps 64-bit offsets: accepted)."""
    from types import SimpleNamespace
    from cuflash._plan_mods import dbias_plan
    from cuflash._variant import Variant
    prob = SimpleNamespace(batch_shape=(1,), Lq=65536, Lk=32768)
    mods = SimpleNamespace(bias_shape=(65536, 32768), bias_dtype=numpy.float32, block_mask=None)
    var = Variant(causal=False, bias="float")
    with pytest.raises(ValueError, match="65536 \\* 32768"):
        dbias_plan(var, mods, prob, True, "bwd_sm90")
    assert dbias_plan(var, mods, prob, True, "bwd_sm80")[0]


@pytest.mark.parametrize("acc, n, vec4", [(numpy.float32, 4096, True), (numpy.float32, 4098, False),
                                          (numpy.float64, 4096, False)])
def test_finish_takes_vec4_where_it_may_and_the_scalar_build_off_16_bytes(monkeypatch, acc, n,
                                                                          vec4):
    """dQ's finishing (_plan_aux.Finish): the VEC4 build for a float32 accumulator and
    n % 4 == 0; a destination off 16 bytes gets the scalar build (made once), never the VEC4
    build's 8- or 16-byte stores."""
    from cuflash import _plan_aux
    made = []

    def fake(dtype, out, n_, parts, device_id, num_sms, vec4, name="bwd_finish_dq"):
        made.append(vec4)
        return ("launch", vec4)
    monkeypatch.setattr(_plan_aux, "finish_launch", fake)
    fin = _plan_aux.Finish(numpy.float16, acc, "T", n, 1, 0, 132)
    assert fin.vec4 is vec4 and made == [vec4]
    assert fin.to(1 << 20) == ("launch", vec4)
    assert fin.to((1 << 20) + 8) == ("launch", False)
    assert fin.to((1 << 20) + 2) == ("launch", False)
    assert made == ([True, False] if vec4 else [False])   # the scalar build made once


def test_aux_grids():
    """bwd_dot_do_o's grid: a block per 8 rows, capped at DOT_BLOCKS_PER_SM an SM."""
    from cuflash import _plan_aux
    assert _plan_aux.dot_grid(1, 132) == 1
    assert _plan_aux.dot_grid(8 * 100, 132) == 100
    assert _plan_aux.dot_grid(1 << 30, 132) == _plan_aux.DOT_BLOCKS_PER_SM * 132


def test_launch_makes_a_context_current_where_the_thread_has_none(monkeypatch):
    """``_launch.Launch``: cuLaunchKernel fails with CUDA_ERROR_INVALID_CONTEXT (201) in a thread
    that has made no runtime call (cupy/cupy#72); the launch then makes the current device's
    primary context current (cudaSetDevice) and launches once more. Any other driver error
    propagates, and nothing is retried."""
    import struct

    import numpy
    from cupy.cuda import runtime
    from cuflash import _launch

    class DriverError(Exception):
        def __init__(self, status):
            self.status = status

    calls, contexts = [], []

    def launch_kernel(*args):
        calls.append(args[0])
        if not contexts:
            raise DriverError(201)

    monkeypatch.setattr(runtime, "getDevice", lambda: 3)
    monkeypatch.setattr(runtime, "setDevice", lambda d: contexts.append(d))
    buf = numpy.zeros(4, numpy.uint64)
    launch = _launch.Launch.__new__(_launch.Launch)
    launch._launch_kernel, launch.kernels, launch.buf = launch_kernel, [(11, 1, 128, 0), (12, 1, 128, 0)], buf
    launch._bytes, launch.argv_ptr, launch.lock = memoryview(buf).cast("B"), 0, threading.Lock()
    launch(0, [7, 8])
    assert contexts == [3] and calls == [11, 11, 12]
    assert struct.unpack_from("<2Q", launch._bytes) == (7, 8)

    # the fast paths' bound form (Launch.direct, session 19): the same words, the same kernels,
    # the same retry; ``at``: one word more, written at that 8-byte word
    calls.clear(), contexts.clear()
    launch.direct(2)(0, 5, 6)
    assert contexts == [3] and calls == [11, 11, 12]
    assert struct.unpack_from("<4Q", launch._bytes) == (5, 6, 0, 0)
    calls.clear()
    launch.direct(2, at=3)(0, 1, 2, 9)
    assert calls == [11, 12] and struct.unpack_from("<4Q", launch._bytes) == (1, 2, 0, 9)

    def broken(*args):
        raise DriverError(700)
    launch._launch_kernel = broken
    with pytest.raises(DriverError):
        launch(0, [7, 8])
    with pytest.raises(DriverError):
        launch.direct(2)(0, 7, 8)
    assert contexts == [3] and not launch.lock.locked()
