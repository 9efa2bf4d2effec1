"""attention_varlen's cached fast path (cuflash/_varlen.py) without a GPU: a stand-in for CuPy
whose "device" arrays are host memory (``FakeCupy``), and stand-ins for the one-launch plans
(``_inference_varlen.forward_plan`` / ``backward_plan``) that count their builds and launches.
What is checked is the host logic: one read-back of both cu_seqlens (none for NumPy ones), a
repeated call builds nothing, other contents or another stream are another plan, validation
errors on a miss, CUFLASH_VARLEN_KERNEL read per call, the vjp's backward cached. The kernels'
results with the real plans: tests/test_gpu_inference.py."""

from __future__ import annotations

import contextlib
import ctypes
import types

import numpy
import pytest

from cuflash import _inference_varlen, _varlen

F32 = numpy.dtype(numpy.float32)


class _Mem:
    def __init__(self, ptr: int, owner=None):
        self.ptr, self.device_id, self.owner = ptr, 0, owner

    def __add__(self, n: int) -> "_Mem":
        return _Mem(self.ptr + n, self.owner)


class FakeCupy(types.ModuleType):
    """The part of CuPy that _varlen, _problem and _api touch, over host memory."""

    def __init__(self):
        super().__init__("cupy")
        mod = self
        self.reads = 0          # memcpyAsync device -> host calls
        self.syncs = 0
        self.stream_ptr = 7

        class ndarray:
            def __init__(self, shape=None, dtype=None, memptr=None, _a=None):
                if _a is None:
                    nbytes = int(numpy.prod(shape)) * numpy.dtype(dtype).itemsize
                    buf = memptr.owner if memptr is not None else numpy.zeros(max(nbytes, 1),
                                                                              numpy.uint8)
                    off = memptr.ptr - buf.ctypes.data if memptr is not None else 0
                    _a = numpy.frombuffer(buf, numpy.uint8, nbytes, off).view(dtype)
                    _a = _a.reshape(shape)
                self._a = _a
                self.data = _Mem(_a.ctypes.data if _a.size else 16, _a)
                self.device = types.SimpleNamespace(id=0)

            shape = property(lambda s: s._a.shape)
            strides = property(lambda s: s._a.strides)
            dtype = property(lambda s: s._a.dtype)
            ndim = property(lambda s: s._a.ndim)
            size = property(lambda s: s._a.size)
            nbytes = property(lambda s: s._a.nbytes)
            flags = property(lambda s: s._a.flags)

            def __getitem__(self, idx):
                return ndarray(_a=self._a[idx])

            def __setitem__(self, idx, value):
                self._a[idx] = value

            def astype(self, dtype):
                return ndarray(_a=self._a.astype(dtype))

        self.ndarray = ndarray
        self.empty = lambda shape, dtype: ndarray(_a=numpy.full(shape, numpy.nan, dtype))
        self.zeros = lambda shape, dtype: ndarray(_a=numpy.zeros(shape, dtype))
        self.broadcast_to = lambda x, shape: ndarray(_a=numpy.broadcast_to(x._a, shape))
        self.asarray = lambda x: ndarray(_a=numpy.array(x))
        self.asnumpy = lambda x: numpy.array(x._a)
        self.ascontiguousarray = lambda x: ndarray(_a=numpy.ascontiguousarray(x._a))

        def memcpy_async(dst, src, n, kind, stream):
            assert kind == 2 and stream == mod.stream_ptr
            mod.reads += 1
            ctypes.memmove(dst, src, n)

        def synchronize():
            mod.syncs += 1

        def alloc(n):
            buf = numpy.zeros(max(n, 1), numpy.uint8)
            return _Mem(buf.ctypes.data, buf)

        runtime = types.SimpleNamespace(getDevice=lambda: 0, memcpyAsync=memcpy_async,
                                        memcpyDeviceToHost=2)
        self.cuda = types.SimpleNamespace(
            runtime=runtime, alloc=alloc, alloc_pinned_memory=lambda n: bytearray(n),
            Device=lambda i=None: contextlib.nullcontext(),
            get_current_stream=lambda: types.SimpleNamespace(ptr=mod.stream_ptr,
                                                             synchronize=synchronize))


class _Plan:
    """Stands in for ForwardLaunch / BackwardLaunch: counts its launches; the forward writes
    o = 1, lse = 2 through the pointers it is given (so a hit's outputs are the launch's)."""

    def __init__(self, log, o=None, lse=None):
        self.device_id, self.log = 0, log
        self.o_n = None if o is None else (o.size, o.dtype)
        self.lse_n = None if lse is None else (lse.size, lse.dtype)

    def __call__(self, *args):
        self.log.append("launch")
        if self.o_n is not None:
            _, q, k, v, o, lse = args
            numpy.frombuffer((ctypes.c_char * (self.o_n[0] * self.o_n[1].itemsize))
                             .from_address(o), self.o_n[1])[:] = 1
            numpy.frombuffer((ctypes.c_char * (self.lse_n[0] * self.lse_n[1].itemsize))
                             .from_address(lse), self.lse_n[1])[:] = 2


@pytest.fixture
def fake(monkeypatch):
    cp = FakeCupy()
    monkeypatch.setitem(__import__("sys").modules, "cupy", cp)
    monkeypatch.setattr(_varlen, "_FWD", None)
    monkeypatch.setattr(_varlen, "_BWD", None)
    log = []

    def forward_plan(prob, cu_q, cu_k, causal, o, lse):
        if not _inference_varlen.enabled():      # as the real one (why_not)
            return "CUFLASH_VARLEN_KERNEL=0"
        log.append(("build fwd", tuple(cu_q), tuple(cu_k)))
        return _Plan(log, o, lse)

    def backward_plan(prob, cu_q, cu_k, causal, do, o, lse, dq, dk, dv, deterministic):
        log.append(("build bwd", tuple(cu_q), tuple(cu_k)))
        return _Plan(log)

    monkeypatch.setattr(_inference_varlen, "forward_plan", forward_plan)
    monkeypatch.setattr(_inference_varlen, "backward_plan", backward_plan)
    monkeypatch.delenv("CUFLASH_VARLEN_KERNEL", raising=False)
    cp.log = log
    return cp


def _inputs(cp):
    rng = numpy.random.default_rng(0)
    q, k, v = (cp.ndarray(_a=rng.standard_normal((2, 6, 8)).astype(F32)) for _ in range(3))
    cu_q = numpy.array([0, 2, 6], numpy.int32)
    cu_k = numpy.array([0, 1, 6], numpy.int32)
    return q, k, v, cu_q, cu_k


def test_a_repeated_call_reads_cu_seqlens_once_and_builds_nothing(fake):
    q, k, v, cu_q, cu_k = _inputs(fake)
    dq, dk = fake.asarray(cu_q), fake.asarray(cu_k)
    o, lse = _varlen.attention_varlen(q, k, v, dq, dk, causal=True, return_lse=True)
    assert fake.log == [("build fwd", (0, 2, 6), (0, 1, 6)), "launch"]
    assert fake.reads == 2 and fake.syncs == 1         # both arrays, one sync
    assert (o._a == 1).all() and (lse._a == 2).all()
    for _ in range(2):       # hits: one read-back each, no build
        o, lse = _varlen.attention_varlen(q, k, v, dq, dk, causal=True, return_lse=True)
        assert o.shape == (2, 6, 8) and lse.shape == (2, 6) and lse.dtype == F32
        assert (o._a == 1).all() and (lse._a == 2).all()
    assert fake.log[2:] == ["launch", "launch"] and fake.syncs == 3 and fake.reads == 6
    # NumPy cu_seqlens: the same plan, nothing read, no sync
    o = _varlen.attention_varlen(q, k, v, cu_q, cu_k, causal=True)
    assert fake.log[4:] == ["launch"] and fake.syncs == 3 and o.shape == (2, 6, 8)
    # one array given twice is read once
    _varlen.attention_varlen(q, k, v, dq, dq, causal=True)
    assert fake.reads == 7 and fake.syncs == 4


def test_other_contents_keywords_or_stream_are_other_plans(fake):
    q, k, v, cu_q, cu_k = _inputs(fake)
    _varlen.attention_varlen(q, k, v, cu_q, cu_k)
    _varlen.attention_varlen(q, k, v, cu_q, numpy.array([0, 3, 6], numpy.int32))
    _varlen.attention_varlen(q, k, v, cu_q, cu_k, causal=True)
    _varlen.attention_varlen(q, k, v, cu_q, cu_k, causal=numpy.True_)   # not True's plan
    with pytest.raises(TypeError, match="causal must be a bool"):   # no hit of True's either
        _varlen.attention_varlen(q, k, v, cu_q, cu_k, causal=1)
    _varlen.attention_varlen(q, k, v, cu_q, cu_k, max_seqlen_q=4)
    fake.stream_ptr = 8
    _varlen.attention_varlen(q, k, v, cu_q, cu_k)
    builds = [x for x in fake.log if x != "launch"]
    assert len(builds) == 6 and builds[1][2] == (0, 3, 6)
    fake.stream_ptr = 7
    _varlen.attention_varlen(q, k, v, cu_q, cu_k)                   # the first plan again
    assert len([x for x in fake.log if x != "launch"]) == 6


def test_a_miss_validates_as_ever(fake):
    q, k, v, cu_q, cu_k = _inputs(fake)
    _varlen.attention_varlen(q, k, v, cu_q, cu_k)
    with pytest.raises(ValueError, match=r"cu_seqlens_q\[1\]=4 > cu_seqlens_q\[2\]=3"):
        _varlen.attention_varlen(q, k, v, fake.asarray(numpy.array([0, 4, 3, 6], numpy.int32)),
                                 fake.asarray(cu_k))
    with pytest.raises(ValueError, match="max_seqlen_q=3 is below the longest sequence"):
        _varlen.attention_varlen(q, k, v, cu_q, cu_k, max_seqlen_q=3)
    with pytest.raises(TypeError, match="cu_seqlens_k must be int32"):
        _varlen.attention_varlen(q, k, v, cu_q, cu_k.astype(numpy.int64))
    with pytest.raises(TypeError, match="unexpected keywords"):
        _varlen.attention_varlen(q, k, v, cu_q, cu_k, window=3)
    with pytest.raises(TypeError, match="return_lse must be a bool"):
        _varlen.attention_varlen(q, k, v, cu_q, cu_k, return_lse="yes")
    assert len([x for x in fake.log if x != "launch"]) == 1


def test_the_override_is_read_per_call(fake, monkeypatch):
    """A cached one-launch plan does not serve a call made with CUFLASH_VARLEN_KERNEL=0."""
    q, k, v, cu_q, cu_k = _inputs(fake)
    _varlen.attention_varlen(q, k, v, cu_q, cu_k)
    monkeypatch.setenv("CUFLASH_VARLEN_KERNEL", "0")
    calls = []
    import cuflash._api as api
    monkeypatch.setattr(api, "attention", lambda *a, **kw: calls.append(a) or (None, 0))
    _varlen.attention_varlen(q, k, v, cu_q, cu_k)
    assert fake.log.count("launch") == 1 and len(calls) == 2      # the per-sequence loop


def test_the_vjp_reads_once_and_caches_the_backward(fake):
    q, k, v, cu_q, cu_k = _inputs(fake)
    dcq, dck = fake.asarray(cu_q), fake.asarray(cu_k)
    o, pull = _varlen.attention_varlen_vjp(q, k, v, dcq, dck, causal=True)
    assert fake.syncs == 1
    do = fake.ndarray(_a=numpy.ones((2, 6, 8), F32))
    for _ in range(2):
        grads = pull(do)
        assert [g.shape for g in grads] == [(2, 6, 8)] * 3
    _, pull2 = _varlen.attention_varlen_vjp(q, k, v, cu_q, cu_k, causal=True)
    pull2(do)
    assert fake.syncs == 1           # the forward's read-back only
    assert [x[0] for x in fake.log if x != "launch"] == ["build fwd", "build bwd"]
    assert fake.log.count("launch") == 5      # 2 forwards, 3 backwards
