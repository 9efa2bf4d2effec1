"""Arrays from any framework (zero copy), and grouped-query attention in the 4-D layout.

CPU tests use small producer classes that expose only a protocol (``__array_interface__``,
``__dlpack__``), as another framework's CPU tensor would; the GPU tests (marker ``gpu``) take
real PyTorch / JAX / Numba arrays and skip when the framework is not installed.
"""

from __future__ import annotations

import ctypes

import ml_dtypes
import numpy
import pytest

import cuflash
from cuflash import _interop
from cuflash._problem import make_problem


def rand(*shape, dtype=numpy.float32, seed=0):
    return numpy.random.default_rng(seed).standard_normal(shape).astype(dtype)


class ArrayInterfaceOnly:
    """A CPU array that exposes only ``__array_interface__`` (as many C extensions do)."""

    def __init__(self, a):
        self._a = a  # keeps the memory alive
        self.__array_interface__ = a.__array_interface__


class DLPackOnly:
    """A CPU tensor that exposes only the DLPack protocol."""

    def __init__(self, a, device=(1, 0)):
        self._a, self._device = a, device

    def __dlpack_device__(self):
        return self._device

    def __dlpack__(self, stream=None, **kwargs):
        return self._a.__dlpack__(**kwargs)  # versioned when asked: writeable in NumPy


class Bfloat16DLPack(DLPackOnly):
    """A CPU bfloat16 tensor through DLPack, as PyTorch exports one: dtype code 4 (kDLBfloat).

    NumPy cannot export bfloat16, so the capsule of the same bits as uint16 is re-labelled."""

    dtype = "bfloat16"

    def __dlpack__(self, stream=None, **kwargs):
        versioned = "max_version" in kwargs
        capsule = self._a.view(numpy.uint16).__dlpack__(**kwargs)
        get = ctypes.pythonapi.PyCapsule_GetPointer
        get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
        name = b"dltensor_versioned" if versioned else b"dltensor"
        (ctypes.c_uint8 * 4).from_address(get(capsule, name) + (32 if versioned else 0)
                                          + 20)[0] = 4
        return capsule


#: NumPy >= 2.2 imports a writeable DLPack tensor as a writeable array (an older NumPy makes
#: every one read-only, and cuflash then refuses it as ``out``, saying why)
NUMPY_WRITES_THROUGH_DLPACK = numpy.lib.NumpyVersion(numpy.__version__) >= "2.2.0"


def expect_out_written(call, out_through_dlpack):
    """``call()`` writes into ``out``; with an old NumPy and ``out`` through DLPack it raises
    the ValueError that names the NumPy version instead."""
    if out_through_dlpack and not NUMPY_WRITES_THROUGH_DLPACK:
        with pytest.raises(ValueError, match="imports every DLPack array read-only"):
            call()
        return False
    call()
    return True


def address(a):
    return a.__array_interface__["data"][0]


@pytest.mark.parametrize("wrap", [ArrayInterfaceOnly, DLPackOnly], ids=lambda w: w.__name__)
def test_cpu_protocol_arrays_are_taken_without_a_copy(wrap):
    q, k, v = rand(2, 5, 8), rand(2, 6, 8, seed=1), rand(2, 6, 4, seed=2)
    wq, wk, wv = wrap(q), wrap(k), wrap(v)
    prob = make_problem(wq, wk, wv, scale=None, causal=False)
    assert prob.xp is numpy
    assert [address(x) for x in (prob.q, prob.k, prob.v)] == [address(x) for x in (q, k, v)]
    o = cuflash.attention(wq, wk, wv)
    assert type(o) is numpy.ndarray
    numpy.testing.assert_array_equal(o, cuflash.attention(q, k, v))
    out = numpy.empty((2, 5, 4), numpy.float32)
    if expect_out_written(lambda: cuflash.attention(wq, wk, wv, out=wrap(out)),
                          wrap is DLPackOnly):
        numpy.testing.assert_array_equal(out, o)  # written into the caller's memory


def test_cpu_bfloat16_through_dlpack_is_viewed_not_copied():
    q = rand(3, 8, dtype=ml_dtypes.bfloat16)
    x = _interop.as_array(Bfloat16DLPack(q), "q")
    assert x.dtype == ml_dtypes.bfloat16 and address(x) == address(q)
    numpy.testing.assert_array_equal(x.view(numpy.uint16), q.view(numpy.uint16))
    k, v = rand(4, 8, dtype=ml_dtypes.bfloat16, seed=1), rand(4, 8, dtype=ml_dtypes.bfloat16)
    o = cuflash.attention(Bfloat16DLPack(q), Bfloat16DLPack(k), Bfloat16DLPack(v))
    numpy.testing.assert_array_equal(o.view(numpy.uint16),
                                     cuflash.attention(q, k, v).view(numpy.uint16))
    out = numpy.zeros((3, 8), ml_dtypes.bfloat16)
    if expect_out_written(lambda: cuflash.attention(q, k, v, out=Bfloat16DLPack(out)), True):
        # writeable through DLPack 1.0
        numpy.testing.assert_array_equal(out.view(numpy.uint16), o.view(numpy.uint16))


def test_bfloat16_relabelling_asks_the_producer_for_what_numpy_asked_for():
    """A NumPy < 2.1 asks for no max_version and cannot read a versioned capsule; a newer one
    asks for DLPack 1.0. The bfloat16 re-labeller passes the request on, so both read it."""
    name = ctypes.pythonapi.PyCapsule_GetName
    name.restype, name.argtypes = ctypes.c_char_p, [ctypes.py_object]
    wrapped = _interop._Bfloat16AsUint16(Bfloat16DLPack(rand(3, 8, dtype=ml_dtypes.bfloat16)))
    assert name(wrapped.__dlpack__()) == b"dltensor"
    if numpy.lib.NumpyVersion(numpy.__version__) >= "2.1.0":  # NumPy exports DLPack 1.0
        assert name(wrapped.__dlpack__(max_version=(1, 0))) == b"dltensor_versioned"

    class OldProducer(Bfloat16DLPack):  # knows no keywords at all
        def __dlpack__(self, stream=None):
            return super().__dlpack__()
    old = _interop._Bfloat16AsUint16(OldProducer(rand(3, 8, dtype=ml_dtypes.bfloat16)))
    assert name(old.__dlpack__(max_version=(1, 0), dl_device=None, copy=None)) == b"dltensor"


@pytest.mark.skipif(not NUMPY_WRITES_THROUGH_DLPACK, reason="NumPy < 2.2: every DLPack "
                    "import is read-only (tested above)")
def test_read_only_out_through_dlpack_says_why(monkeypatch):
    q = rand(2, 5, 8)
    frozen = numpy.empty((2, 5, 8), numpy.float32)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match=r"^out \(test_interop.DLPackOnly\) came through "
                                         r"DLPack read-only$"):
        cuflash.attention(q, q, q, out=DLPackOnly(frozen))
    monkeypatch.setattr(numpy, "__version__", "1.25.0")
    with pytest.raises(ValueError, match=r"NumPy 1.25.0 imports every DLPack array read-only "
                                         r"\(NumPy >= 2.2 imports writeable ones\)"):
        cuflash.attention(q, q, q, out=DLPackOnly(frozen))


def test_dlpack_on_another_device_is_a_type_error():
    with pytest.raises(TypeError, match=r"q \(test_interop.DLPackOnly\) is on DLPack device "
                                        r"type 4; cuflash computes on the CPU \(1\) or a CUDA "
                                        r"GPU \(2\)"):
        _interop.as_array(DLPackOnly(rand(2, 2), device=(4, 0)), "q")


def test_dlpack_that_numpy_cannot_read_is_a_type_error():
    class Broken(DLPackOnly):
        def __dlpack__(self, stream=None, **kwargs):
            raise BufferError("no export today")
    with pytest.raises(TypeError, match=r"k \(test_interop\..*Broken\) cannot be read "
                                        r"through DLPack: no export today"):
        cuflash.attention(rand(2, 2), Broken(rand(2, 2)), rand(2, 2))


def test_numpy_and_cupy_arrays_pass_through_as_they_are():
    a = rand(2, 3)
    assert _interop.as_array(a, "q") is a
    with pytest.raises(TypeError, match="q must be a numpy.ndarray or cupy.ndarray, got "
                                        "numpy.float32"):
        _interop.as_array(numpy.float32(1), "q")


# -- Grouped-query attention in the 4-D layout ----------------------------------------------

def gqa_inputs(B=2, Hq=6, Hkv=2, Lq=7, Lk=9, d=8, dv=5, dtype=numpy.float64):
    return (rand(B, Hq, Lq, d, dtype=dtype), rand(B, Hkv, Lk, d, dtype=dtype, seed=1),
            rand(B, Hkv, Lk, dv, dtype=dtype, seed=2), rand(B, Hq, Lq, dv, dtype=dtype, seed=3))


def repeat_heads(x, G):
    return numpy.repeat(x, G, axis=-3)  # key/value head h // G serves query head h


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("backend", [cuflash, cuflash.reference], ids=["cpu", "reference"])
def test_enable_gqa_equals_repeated_heads(backend, causal):
    q, k, v, _ = gqa_inputs()
    o, lse = backend.attention(q, k, v, causal=causal, return_lse=True, enable_gqa=True)
    o_rep, lse_rep = backend.attention(q, repeat_heads(k, 3), repeat_heads(v, 3), causal=causal,
                                       return_lse=True)
    assert o.shape == (2, 6, 7, 5) and lse.shape == (2, 6, 7)
    numpy.testing.assert_allclose(o, o_rep, rtol=1e-12, atol=1e-12)
    numpy.testing.assert_allclose(lse, lse_rep, rtol=1e-12, atol=1e-12)


def test_enable_gqa_is_a_view_of_the_5d_broadcast_form():
    q, k, v, _ = gqa_inputs()
    call = cuflash._problem.Call(q, k, v, True)
    assert call.q.shape == (2, 2, 3, 7, 8) and call.k.shape == (2, 2, 1, 9, 8)
    assert all(numpy.shares_memory(a, b) for a, b in ((call.q, q), (call.k, k), (call.v, v)))
    numpy.testing.assert_array_equal(call.q.reshape(q.shape), q)
    # and the 5-D form gives the same result as the flag
    numpy.testing.assert_array_equal(cuflash.attention(q, k, v, enable_gqa=True),
                                     cuflash.attention(call.q, call.k, call.v).reshape(2, 6, 7, 5))


def test_enable_gqa_writes_a_strided_4d_out():
    q, k, v, _ = gqa_inputs()
    buffer = numpy.zeros((2, 7, 6, 5))
    out = buffer.transpose(0, 2, 1, 3)  # the (B, L, H, d) layout, viewed as (B, H, L, d)
    result = cuflash.attention(q, k, v, enable_gqa=True, out=out)
    assert result is out
    numpy.testing.assert_array_equal(out, cuflash.attention(q, k, v, enable_gqa=True))


@pytest.mark.parametrize("causal", [False, True])
def test_enable_gqa_gradients_sum_over_each_group(causal):
    q, k, v, do = gqa_inputs()
    o, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True, enable_gqa=True)
    dq, dk, dv = cuflash.attention_backward(do, q, k, v, o, lse, causal=causal, enable_gqa=True)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    rq, rk, rv = cuflash.reference.attention_backward(do, q, repeat_heads(k, 3),
                                                      repeat_heads(v, 3), causal=causal)
    numpy.testing.assert_allclose(dq, rq, rtol=1e-10, atol=1e-12)
    numpy.testing.assert_allclose(dk, rk.reshape(2, 2, 3, 9, 8).sum(axis=2), rtol=1e-10,
                                  atol=1e-12)
    numpy.testing.assert_allclose(dv, rv.reshape(2, 2, 3, 9, 5).sum(axis=2), rtol=1e-10,
                                  atol=1e-12)
    ref = cuflash.reference.attention_backward(do, q, k, v, causal=causal, enable_gqa=True)
    for got, want in zip((dq, dk, dv), ref):
        assert got.shape == want.shape
        numpy.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
    o2, pullback = cuflash.attention_vjp(q, k, v, causal=causal, enable_gqa=True)
    numpy.testing.assert_array_equal(o2, o)
    for got, want in zip(pullback(do), (dq, dk, dv)):
        numpy.testing.assert_array_equal(got, want)


def test_enable_gqa_with_equal_heads_is_plain_attention():
    q, k, v, _ = gqa_inputs(Hq=2)
    numpy.testing.assert_array_equal(cuflash.attention(q, k, v, enable_gqa=True),
                                     cuflash.attention(q, k, v))


# -- GPU: real frameworks (the lead runs these on the H200) ---------------------------------

def _check_gpu_result(o, q, k, v, enable_gqa=False, causal=False, lse=None):
    """``o`` (and ``lse``) of a GPU call on framework arrays q, k, v against the float64
    reference, with the project's tolerance rule (tests/_tolerance.py), in the 5-D form."""
    import cupy
    from _tolerance import assert_attention_close
    assert isinstance(o, cupy.ndarray)
    call = cuflash._problem.Call(q, k, v, enable_gqa)
    prob = make_problem(call.q, call.k, call.v, scale=None, causal=causal)
    o_ref, lse_ref = cuflash.reference.attention(call.q, call.k, call.v, causal=causal,
                                                 return_lse=True)
    if lse is None:
        _, lse = cuflash.attention(call.q, call.k, call.v, causal=causal, return_lse=True)
    assert_attention_close(prob, o.reshape(o_ref.shape), lse.reshape(lse_ref.shape), o_ref,
                           lse_ref)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_torch_cuda_tensors(dtype):
    torch = pytest.importorskip("torch")
    import cupy
    t = getattr(torch, dtype)
    q = torch.randn(2, 8, 128, 64, device="cuda", dtype=t)
    k = torch.randn(2, 2, 128, 64, device="cuda", dtype=t)
    v = torch.randn(2, 2, 128, 64, device="cuda", dtype=t)
    with cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
        o, lse = cuflash.attention(q, k, v, enable_gqa=True, causal=True, return_lse=True)
        back = torch.from_dlpack(o)  # the one-line way back, zero copy
    torch.cuda.synchronize()
    assert back.dtype == t and back.device == q.device and back.shape == (2, 8, 128, 64)
    assert back.data_ptr() == o.data.ptr
    _check_gpu_result(o, q, k, v, enable_gqa=True, causal=True, lse=lse)
    out = torch.empty_like(q)
    cuflash.attention(q, k, v, enable_gqa=True, causal=True, out=out)
    torch.cuda.synchronize()
    assert torch.equal(out, back)  # out= written in place through DLPack


def test_torch_cpu_tensors_run_the_cpu_path():
    """No GPU needed: runs wherever PyTorch is installed (the GPU machine; not CI's venv)."""
    torch = pytest.importorskip("torch")
    for t in (torch.float32, torch.bfloat16):
        q, k, v = (torch.randn(2, 4, 16, 8, dtype=t) for _ in range(3))
        o = cuflash.attention(q, k, v)
        assert isinstance(o, numpy.ndarray) and o.shape == (2, 4, 16, 8)
        assert address(_interop.as_array(q, "q")) == q.data_ptr()     # read in place
        as_numpy = [_interop.as_array(x, "x") for x in (q, k, v)]
        numpy.testing.assert_array_equal(o.view(numpy.uint16),
                                         cuflash.attention(*as_numpy).view(numpy.uint16))


def test_jax_cpu_arrays_run_the_cpu_path():
    """JAX CPU arrays, bfloat16 included, read in place; the result back in one line
    (``jnp.from_dlpack``; ``jnp.asarray`` for bfloat16, which NumPy cannot export). Runs
    wherever JAX is installed; no GPU needed."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    cpu = jax.devices("cpu")[0]
    for dtype in (jnp.float32, jnp.bfloat16):
        q, k, v = (jax.device_put(jax.random.normal(key, (2, 4, 32, 16), dtype), cpu)
                   for key in jax.random.split(jax.random.PRNGKey(0), 3))
        o = cuflash.attention(q, k, v, causal=True)
        assert isinstance(o, numpy.ndarray) and o.dtype == numpy.dtype(dtype)
        assert address(_interop.as_array(q, "q")) == q.unsafe_buffer_pointer()
        ref = cuflash.attention(*(numpy.asarray(x) for x in (q, k, v)), causal=True)
        numpy.testing.assert_array_equal(o.view(numpy.uint8), ref.view(numpy.uint8))
        back = jnp.asarray(o) if dtype == jnp.bfloat16 else jnp.from_dlpack(o)
        assert back.dtype == dtype and back.shape == o.shape
    with pytest.raises(ValueError, match=r"out \(.*\) came through DLPack read-only"):
        cuflash.attention(q, k, v, out=jnp.zeros_like(q))      # JAX arrays are immutable


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_jax_gpu_arrays(dtype):
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("JAX sees no GPU")
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    q, k, v = (jax.random.normal(key, (2, 4, 128, 64), getattr(jnp, dtype)) for key in keys)
    o = cuflash.attention(q, k, v)
    back = jax.dlpack.from_dlpack(o)
    assert back.shape == (2, 4, 128, 64) and back.dtype == q.dtype
    _check_gpu_result(o, q, k, v)


@pytest.mark.gpu
def test_numba_device_arrays():
    cuda = pytest.importorskip("numba.cuda")
    q, k, v = (cuda.to_device(rand(2, 64, 32, seed=s)) for s in range(3))
    o = cuflash.attention(q, k, v)
    _check_gpu_result(o, q, k, v)

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [numpy.float16, ml_dtypes.bfloat16, numpy.float32])
@pytest.mark.parametrize("causal", [False, True])
def test_enable_gqa_on_the_gpu(dtype, causal):
    """4-D GQA on CuPy arrays: forward, lse, out= and backward against the float64 reference,
    with the project's tolerance rules (tests/_tolerance.py, tests/_tolerance_bwd.py)."""
    import cupy
    from _tolerance_bwd import assert_gradients_close
    q, k, v, do = gqa_inputs(B=2, Hq=8, Hkv=2, Lq=200, Lk=333, d=64, dv=64, dtype=dtype)
    qd, kd, vd, dod = (cupy.asarray(x) for x in (q, k, v, do))
    o, lse = cuflash.attention(qd, kd, vd, causal=causal, return_lse=True, enable_gqa=True)
    assert o.shape == (2, 8, 200, 64) and lse.shape == (2, 8, 200)
    _check_gpu_result(o, qd, kd, vd, enable_gqa=True, causal=causal, lse=lse)
    out = cupy.empty((2, 200, 8, 64), o.dtype).transpose(0, 2, 1, 3)
    assert cuflash.attention(qd, kd, vd, causal=causal, out=out, enable_gqa=True) is out
    assert bool((out == o).all())
    grads = cuflash.attention_backward(dod, qd, kd, vd, o, lse, causal=causal, enable_gqa=True)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    call = cuflash._problem.Call(qd, kd, vd, True, do=dod)
    prob = make_problem(call.q, call.k, call.v, scale=None, causal=causal)
    refs = cuflash.reference.attention_backward(call.do, call.q, call.k, call.v, causal=causal)
    assert_gradients_close(prob, call.do, tuple(g.reshape(r.shape) for g, r in zip(grads, refs)),
                           refs)
