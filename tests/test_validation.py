"""Bad input gets a clear error, showing the values, before any backend runs.

Every case runs against both ``cuflash.attention`` and ``cuflash.reference.attention``, which
share the validation layer. CuPy-only cases use CuPy arrays over fake device pointers: CuPy
builds and broadcasts such arrays without a GPU, and validation never touches their memory.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
import sys
import types

import ml_dtypes
import numpy
import pytest

import cuflash
from cuflash import _numpy, _problem
from cuflash._problem import MAX_HEAD_DIM, AttentionProblem, make_problem

ENTRY_POINTS = [cuflash.attention, cuflash.reference.attention]


@pytest.fixture(autouse=True)
def no_backend(monkeypatch):
    """Fail any test here that reaches a backend: errors must come first."""
    def forward(prob, o, lse):
        raise AssertionError("a backend was called")

    monkeypatch.setattr(_numpy, "forward", forward)
    launch = types.ModuleType("cuflash._launch")
    launch.forward = forward
    monkeypatch.setitem(sys.modules, "cuflash._launch", launch)
    monkeypatch.setattr(cuflash, "_launch", launch, raising=False)


def raises(exception, message):
    """pytest.raises for an error whose message contains ``message`` verbatim."""
    return pytest.raises(exception, match=re.escape(message))


@pytest.fixture(params=ENTRY_POINTS, ids=["attention", "reference"])
def entry(request):
    return request.param


def arrays(*shapes, dtype=numpy.float32):
    rng = numpy.random.default_rng(0)
    return [rng.standard_normal(s).astype(dtype) for s in shapes]


_fake_addresses = itertools.count(0x7F0000000000, 1 << 30)


def fake_cupy(shape, dtype=numpy.float32, device=0):
    """A cupy.ndarray on ``device`` over memory that does not exist (never read here)."""
    cupy = pytest.importorskip("cupy")
    memory = cupy.cuda.UnownedMemory(next(_fake_addresses), 1 << 20, None, device_id=device)
    return cupy.ndarray(shape, dtype, memptr=cupy.cuda.MemoryPointer(memory, 0))


# -- TypeError -------------------------------------------------------------------------------

class TorchLike:
    """Quacks like a tensor from another framework; not accepted without conversion."""
    shape, dtype, ndim = (4, 8), numpy.dtype(numpy.float32), 2

    def __array__(self, dtype=None, copy=None):
        return numpy.ones(self.shape, self.dtype)

    def __dlpack__(self, stream=None):
        raise NotImplementedError


@pytest.mark.parametrize("position", ["q", "k", "v"])
@pytest.mark.parametrize("bad", [[[1.0] * 8] * 4, 1.0, numpy.float32(1.0), TorchLike()],
                         ids=["list", "float", "numpy-scalar", "torch-like"])
def test_non_arrays_are_a_type_error(entry, position, bad):
    qkv = dict(zip("qkv", arrays((4, 8), (4, 8), (4, 8))))
    qkv[position] = bad
    with raises(TypeError, f"{position} must be a numpy.ndarray or cupy.ndarray, got "
                           f"{type(bad).__module__}.{type(bad).__qualname__}"):
        entry(**qkv)


def test_numpy_mixed_with_cupy_is_a_type_error(entry):
    q, v = arrays((4, 8), (4, 8))
    with raises(TypeError, "all be NumPy arrays or all be CuPy arrays, got q: numpy.ndarray, "
                           "k: cupy.ndarray, v: numpy.ndarray"):
        entry(q, fake_cupy((4, 8)), v)


@pytest.mark.parametrize("dtype", [numpy.int32, numpy.int8, numpy.uint8, numpy.complex64,
                                   numpy.complex128, numpy.bool_, numpy.longdouble],
                         ids=str)
def test_unsupported_dtypes_are_a_type_error(entry, dtype):
    if numpy.dtype(dtype) in _problem.SUPPORTED_DTYPES:
        pytest.skip(f"{dtype} is float64 on this platform")
    q, k, v = (numpy.ones((4, 8), dtype) for _ in range(3))
    with raises(TypeError, f"q.dtype={numpy.dtype(dtype)} is not supported; use one of "
                           "float16, bfloat16, float32, float64"):
        entry(q, k, v)


def test_dtypes_that_differ_are_a_type_error(entry):
    q, k = arrays((4, 8), (4, 8))
    v = numpy.ones((4, 8), ml_dtypes.bfloat16)
    with raises(TypeError, "q, k and v must have one dtype, got q.dtype=float32, "
                           "k.dtype=float32, v.dtype=bfloat16"):
        entry(q, k, v)


@pytest.mark.parametrize("out_dtype", [numpy.float16, numpy.float64, ml_dtypes.bfloat16])
def test_out_of_another_dtype_is_a_type_error(entry, out_dtype):
    q, k, v = arrays((3, 4, 8), (5, 8), (5, 2))
    with raises(TypeError, f"out.dtype={numpy.dtype(out_dtype)} must equal the inputs' dtype "
                           "float32"):
        entry(q, k, v, out=numpy.empty((3, 4, 2), out_dtype))


def test_out_of_another_array_type_is_a_type_error(entry):
    q, k, v = arrays((4, 8), (5, 8), (5, 2))
    with raises(TypeError, "out must be a numpy.ndarray or cupy.ndarray, got builtins.list"):
        entry(q, k, v, out=[[0.0] * 2] * 4)
    with raises(TypeError, "out must be a numpy.ndarray like q, k and v, got a cupy.ndarray"):
        entry(q, k, v, out=fake_cupy((4, 2)))
    q, k, v = fake_cupy((4, 8)), fake_cupy((5, 8)), fake_cupy((5, 2))
    with raises(TypeError, "out must be a cupy.ndarray like q, k and v, got a numpy.ndarray"):
        entry(q, k, v, out=numpy.empty((4, 2), numpy.float32))


@pytest.mark.parametrize("scale", [True, False, numpy.bool_(True), "0.5", 1j, numpy.array(0.5),
                                   [0.5]], ids=repr)
def test_scale_of_the_wrong_type_is_a_type_error(entry, scale):
    with raises(TypeError, f"scale must be a real number or None, got {scale!r}"):
        entry(*arrays((4, 8), (4, 8), (4, 8)), scale=scale)


@pytest.mark.parametrize("causal", [1, 0, None, 1.0, ["top_left"]], ids=repr)
def test_causal_of_the_wrong_type_is_a_type_error(entry, causal):
    with raises(TypeError, f"causal must be a bool, 'bottom_right' or 'top_left', got {causal!r}"):
        entry(*arrays((4, 8), (4, 8), (4, 8)), causal=causal)


@pytest.mark.parametrize("return_lse", [None, 1, "yes"], ids=repr)
def test_return_lse_of_the_wrong_type_is_a_type_error(entry, return_lse):
    with raises(TypeError, f"return_lse must be a bool, got {return_lse!r}"):
        entry(*arrays((4, 8), (4, 8), (4, 8)), return_lse=return_lse)


# -- ValueError ------------------------------------------------------------------------------

@pytest.mark.parametrize("position", ["q", "k", "v"])
@pytest.mark.parametrize("shape", [(8,), ()], ids=["1-d", "0-d"])
def test_fewer_than_two_dims_is_a_value_error(entry, position, shape):
    qkv = dict(zip("qkv", arrays((4, 8), (4, 8), (4, 8))))
    qkv[position] = numpy.ones(shape, numpy.float32)
    with raises(ValueError, f"{position} needs at least 2 dimensions (..., length, head_dim), "
                            f"got {position}.shape={shape}"):
        entry(**qkv)


def test_head_dims_of_q_and_k_that_differ_are_a_value_error(entry):
    with raises(ValueError, "head dims of q and k differ: q.shape=(2, 4, 8) and "
                            "k.shape=(2, 5, 16)"):
        entry(*arrays((2, 4, 8), (2, 5, 16), (2, 5, 8)))


def test_key_and_value_lengths_that_differ_are_a_value_error(entry):
    with raises(ValueError, "k and v must have the same length: k.shape=(5, 8) and "
                            "v.shape=(6, 8)"):
        entry(*arrays((4, 8), (5, 8), (6, 8)))


@pytest.mark.parametrize("shapes", [
    ((2, 4, 8), (3, 5, 8), (3, 5, 8)),
    ((2, 3, 4, 8), (2, 5, 8), (5, 8)),
    ((2, 3, 4, 8), (3, 5, 8), (3, 1, 5, 8)),
])
def test_batch_dims_that_do_not_broadcast_are_a_value_error(entry, shapes):
    q, k, v = shapes
    with raises(ValueError, f"batch dims of q.shape={q}, k.shape={k} and v.shape={v} do not "
                            "broadcast"):
        entry(*arrays(*shapes))


@pytest.mark.parametrize("d, dv", [(0, 8), (8, 0), (MAX_HEAD_DIM + 1, 8), (8, MAX_HEAD_DIM + 1),
                                   (1024, 1024)])
def test_head_dims_out_of_range_are_a_value_error(entry, d, dv):
    name, size = ("d (q.shape[-1])", d) if not 1 <= d <= MAX_HEAD_DIM else ("dv (v.shape[-1])", dv)
    with raises(ValueError, f"head dim {name}={size} is not supported: it must be at least 1 "
                            "and at most MAX_HEAD_DIM=256"):
        entry(*arrays((4, d), (5, d), (5, dv)))


def test_the_largest_head_dims_are_accepted():
    prob = make_problem(*arrays((2, MAX_HEAD_DIM), (3, MAX_HEAD_DIM), (3, MAX_HEAD_DIM)),
                        scale=None, causal=False)
    assert prob.d == prob.dv == MAX_HEAD_DIM == 256


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -float("inf"), 0, 0.0, -0.0, -1,
                                   numpy.float32(-0.5), numpy.float16("nan"), 1e-400],
                         ids=repr)
def test_scale_that_is_not_finite_and_positive_is_a_value_error(entry, scale):
    with raises(ValueError, f"scale must be finite and positive, got {scale=}"):
        entry(*arrays((4, 8), (4, 8), (4, 8)), scale=scale)


@pytest.mark.parametrize("causal", ["top-left", "causal", "", "BOTTOM_RIGHT"])
def test_unknown_causal_alignment_is_a_value_error(entry, causal):
    with raises(ValueError, f"causal must be a bool, 'bottom_right' or 'top_left', got "
                            f"causal='{causal}'"):
        entry(*arrays((4, 8), (4, 8), (4, 8)), causal=causal)


@pytest.mark.parametrize("shape", [(3, 4, 8), (4, 3, 2), (4, 2), (1, 3, 4, 2), (3, 4, 2, 1)])
def test_out_of_the_wrong_shape_is_a_value_error(entry, shape):
    q, k, v = arrays((3, 4, 8), (5, 8), (5, 2))
    with raises(ValueError, f"out.shape={shape} must be batch_shape + (Lq, dv) = (3, 4, 2)"):
        entry(q, k, v, out=numpy.empty(shape, numpy.float32))


def test_out_overlapping_an_input_is_a_value_error(entry):
    q, k, v = arrays((3, 4, 8), (4, 8), (4, 8))
    with raises(ValueError, "out overlaps q in memory"):
        entry(q, k, v, out=q)
    buffer = numpy.empty((5, 8), numpy.float32)
    v, out = buffer[:4], buffer[None, 1:]  # three rows in common
    with raises(ValueError, "out overlaps v in memory"):
        entry(q[:1], k, v, out=out)
    buffer = numpy.empty((4, 64), numpy.float32)
    v, out = buffer[:, 0:32:2], buffer[None, :, 0:64:4]  # columns 0, 4, ..., 28 in common
    with raises(ValueError, "out overlaps v in memory"):
        entry(q[:1], k, v, out=out)


def test_read_only_or_self_overlapping_out_is_a_value_error(entry):
    q, k, v = arrays((3, 4, 8), (4, 8), (4, 2))
    with raises(ValueError, "out is read-only"):
        entry(q, k, v, out=numpy.broadcast_to(numpy.empty((4, 2), numpy.float32), (3, 4, 2)))
    stride0 = numpy.lib.stride_tricks.as_strided(numpy.empty((4, 2), numpy.float32),
                                                 (3, 4, 2), (0, 8, 4), writeable=True)
    with raises(ValueError, "out has stride 0 along a dimension longer than 1, so several "
                            "elements share one address: out.shape=(3, 4, 2), "
                            "out.strides=(0, 8, 4)"):
        entry(q, k, v, out=stride0)


def test_inputs_on_different_devices_are_a_value_error(entry):
    q, k, v = fake_cupy((4, 8), device=0), fake_cupy((4, 8), device=1), fake_cupy((4, 8), device=0)
    with raises(ValueError, "q, k and v must be on one device, got devices "
                            "{'q': 0, 'k': 1, 'v': 0}"):
        entry(q, k, v)


def test_out_on_another_device_is_a_value_error(entry):
    q, k, v = (fake_cupy((4, 8), device=1) for _ in range(3))
    with raises(ValueError, "out is on device 0 but the inputs are on device 1"):
        entry(q, k, v, out=fake_cupy((4, 8), device=0))


def test_out_overlapping_a_cupy_input_is_a_value_error(entry):
    q, k, v = (fake_cupy((4, 8)) for _ in range(3))
    with raises(ValueError, "out overlaps v in memory"):
        entry(q, k, v, out=v[::-1])


# -- What is accepted, and the problem built from it ----------------------------------------

def test_problem_fields_are_the_launcher_contract():
    assert [f.name for f in dataclasses.fields(AttentionProblem)] == [
        "xp", "dtype", "batch_shape", "Lq", "Lk", "d", "dv", "scale", "causal", "causal_offset",
        "q", "k", "v", "lse_dtype", "device_id"]
    prob = make_problem(*arrays((4, 8), (4, 8), (4, 8)), scale=None, causal=False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        prob.scale = 2.0


@pytest.mark.parametrize("dtype", [numpy.float16, ml_dtypes.bfloat16, numpy.float32,
                                   numpy.float64], ids=str)
def test_problem_of_broadcast_numpy_inputs(dtype):
    q, k, v = arrays((2, 1, 3, 5, 8), (4, 1, 7, 8), (7, 6), dtype=dtype)
    prob = make_problem(q, k, v, scale=None, causal=False)
    assert prob.xp is numpy and prob.device_id is None
    assert prob.dtype == numpy.dtype(dtype)
    assert prob.lse_dtype == (numpy.float64 if dtype == numpy.float64 else numpy.float32)
    assert prob.batch_shape == (2, 4, 3)
    assert (prob.Lq, prob.Lk, prob.d, prob.dv) == (5, 7, 8, 6)
    assert prob.scale == 1 / 8 ** 0.5 and type(prob.scale) is float
    assert (prob.causal, prob.causal_offset) == (False, 0)
    assert prob.q.shape == (2, 4, 3, 5, 8) and prob.k.shape == (2, 4, 3, 7, 8)
    assert prob.v.shape == (2, 4, 3, 7, 6)
    for x, view in ((q, prob.q), (k, prob.k), (v, prob.v)):  # views: no copy
        assert view.__array_interface__["data"][0] == x.__array_interface__["data"][0]
    assert prob.q.strides[1] == 0 and prob.k.strides[0] == prob.k.strides[2] == 0
    assert prob.v.strides[:3] == (0, 0, 0)


@pytest.mark.parametrize("causal, offset", [(False, 0), (True, 3), ("bottom_right", 3),
                                            ("top_left", 0), (numpy.bool_(True), 3),
                                            (numpy.bool_(False), 0)], ids=repr)
def test_causal_alignment_offsets(causal, offset):
    prob = make_problem(*arrays((4, 8), (7, 8), (7, 8)), scale=None, causal=causal)
    assert prob.causal == bool(causal) and prob.causal_offset == offset
    prob = make_problem(*arrays((7, 8), (4, 8), (4, 8)), scale=None, causal=causal)
    top_left = isinstance(causal, str) and causal == "top_left"
    assert prob.causal_offset == (0 if top_left else -offset)


@pytest.mark.parametrize("scale", [2, numpy.int64(3), numpy.float16(0.5), numpy.float32(0.25),
                                   1e-30, 1e30], ids=repr)
def test_real_scales_are_accepted(scale):
    prob = make_problem(*arrays((4, 8), (4, 8), (4, 8)), scale=scale, causal=False)
    assert prob.scale == float(scale) and type(prob.scale) is float


def test_problem_of_cupy_inputs():
    q, k, v = fake_cupy((3, 1, 4, 8), device=1), fake_cupy((5, 8), device=1), \
        fake_cupy((2, 5, 6), ml_dtypes.bfloat16, device=1)
    with pytest.raises(TypeError, match="one dtype"):
        make_problem(q, k, v, scale=None, causal=True)
    v = fake_cupy((2, 5, 6), device=1)
    prob = make_problem(q, k, v, scale=None, causal=True)
    assert prob.xp is sys.modules["cupy"] and prob.device_id == 1
    assert prob.batch_shape == (3, 2) and prob.causal_offset == 1
    assert prob.q.data.ptr == q.data.ptr and prob.q.strides[1] == 0  # a view, not a copy
    assert prob.k.strides[:2] == (0, 0)


# -- Issue 13: byte order, masked arrays, scales that overflow, exact overlap, GQA -----------

@pytest.mark.parametrize("dtype", ["f2", "f4", "f8"])
def test_non_native_byte_order_is_named_as_the_problem(entry, dtype):
    swapped = numpy.dtype(dtype).newbyteorder("S")
    order = "big" if swapped.byteorder == ">" else "little"
    q, k, v = (numpy.ones((4, 8), swapped) for _ in range(3))
    with raises(TypeError, f"q.dtype={swapped.str} is {order}-endian; cuflash needs the "
                           f"machine's byte order ({sys.byteorder}-endian): pass "
                           "q.astype(q.dtype.newbyteorder('=')) (a copy)"):
        entry(q, k, v)
    k = k.astype(k.dtype.newbyteorder("="))
    with raises(TypeError, f"q.dtype={swapped.str} is {order}-endian"):
        entry(q, k, v)


@pytest.mark.parametrize("position", ["q", "k", "v", "out"])
def test_masked_arrays_are_a_type_error(entry, position):
    qkv = dict(zip("qkv", arrays((4, 8), (4, 8), (4, 8))))
    if position == "out":
        qkv["out"] = numpy.ma.masked_array(numpy.empty((4, 8), numpy.float32))
    else:
        qkv[position] = numpy.ma.masked_array(qkv[position], mask=qkv[position] > 0)
    with raises(TypeError, f"{position} is a numpy.ma.MaskedArray: cuflash would ignore its "
                           f"mask; pass {position}.filled(value) or {position}.data"):
        entry(**qkv)


def test_masked_do_is_a_type_error():
    q, k, v = arrays((4, 8), (4, 8), (4, 8))
    o, lse = cuflash.attention(q, k, v, return_lse=True) if False else (q.copy(), q[:, 0].copy())
    do = numpy.ma.masked_array(q.copy())
    with raises(TypeError, "do is a numpy.ma.MaskedArray"):
        cuflash.attention_backward(do, q, k, v, o, lse)
    with raises(TypeError, "do is a numpy.ma.MaskedArray"):
        cuflash.reference.attention_backward(do, q, k, v)


@pytest.mark.parametrize("dtype, scale", [(numpy.float32, 1e39), (numpy.float16, 1e39),
                                          (ml_dtypes.bfloat16, 3.5e38), (numpy.float32, 1e-39),
                                          (numpy.float64, 1e-310)], ids=repr)
def test_scale_outside_the_accumulation_dtype_is_a_value_error(entry, dtype, scale):
    acc = numpy.dtype(numpy.float64 if dtype == numpy.float64 else numpy.float32)
    info = numpy.finfo(acc)
    q, k, v = arrays((4, 8), (4, 8), (4, 8), dtype=dtype)
    with raises(ValueError, f"scale={scale} is not a normal {acc} number, the dtype "
                            f"{numpy.dtype(dtype)} inputs are computed in: it must lie in "
                            f"[{float(info.tiny):.6g}, {float(info.max):.6g}]"):
        entry(q, k, v, scale=scale)


def test_scale_of_float64_inputs_may_exceed_float32():
    prob = make_problem(*arrays((4, 8), (4, 8), (4, 8), dtype=numpy.float64), scale=1e39,
                        causal=False)
    assert prob.scale == 1e39
    prob = make_problem(*arrays((4, 8), (4, 8), (4, 8)), scale=float(numpy.finfo(numpy.float32).max),
                        causal=False)
    assert prob.scale == float(numpy.finfo(numpy.float32).max)


def test_out_interleaved_with_an_input_is_accepted():
    """Overlap means a shared element, not intersecting address ranges."""
    buffer = numpy.zeros((4, 16), numpy.float32)
    q, k, v = arrays((1, 4, 8), (4, 8), (4, 8))
    k, out = buffer[:, ::2], buffer[None, :, 1::2]    # even columns, odd columns
    k[...] = arrays((4, 8))[0]
    assert numpy.may_share_memory(out, k)            # the ranges do intersect
    prob = make_problem(q, k, v, scale=None, causal=False)
    _problem.check_out(prob, out)                    # accepted
    rows = numpy.zeros((4, 16), numpy.float32)
    q4, out4 = rows[None, :, :8], rows[None, :, 8:]        # left and right halves of rows
    _problem.check_out(make_problem(q4, k, v, scale=None, causal=False), out4)


def test_shares_elements_is_exact_and_bounded(monkeypatch):
    buffer = numpy.zeros(64, numpy.float32)
    a, b = buffer[0::2], buffer[1::2]
    assert not _problem.shares_elements(a, b)
    assert _problem.shares_elements(buffer[0::3], buffer[0::2])      # element 0 (and 6, ...)
    assert not _problem.shares_elements(buffer[:32], buffer[32:])  # disjoint ranges
    assert not _problem.shares_elements(buffer[:0], buffer)        # empty
    # Elements of different sizes: a float64 covers two float32 (bytes count, not indices).
    assert _problem.shares_elements(buffer[1:3], buffer.view(numpy.float64)[:1])
    assert not _problem.shares_elements(buffer[2:4], buffer.view(numpy.float64)[:1])
    monkeypatch.setattr(_problem, "OVERLAP_MAX_WORK", 0)            # the bound is reached:
    assert _problem.shares_elements(a, b)                          # refused, never wrong


def test_shares_elements_of_cupy_arrays_uses_device_addresses():
    buffer = fake_cupy((4, 16))
    assert not _problem.shares_elements(buffer[:, ::2], buffer[:, 1::2])
    assert _problem.shares_elements(buffer[:, ::2], buffer[:, ::4])
    assert not _problem.shares_elements(buffer[:2], buffer[2:])


def test_gqa_layout_without_the_flag_says_how(entry):
    q, k, v = arrays((2, 8, 4, 16), (2, 2, 5, 16), (2, 2, 5, 16))
    with raises(ValueError, "batch dims of q.shape=(2, 8, 4, 16), k.shape=(2, 2, 5, 16) and "
                            "v.shape=(2, 2, 5, 16) do not broadcast; for grouped-query "
                            "attention (q with 8 heads, k and v with 2) pass enable_gqa=True, "
                            "or reshape q to (..., 2, 4, Lq, d) and k, v to (..., 2, 1, Lk, d), "
                            "which broadcast"):
        entry(q, k, v)
    q = arrays((2, 7, 4, 16))[0]  # 7 heads: no grouping fits, no hint
    with pytest.raises(ValueError, match=r"do not broadcast$"):
        entry(q, k, v)


@pytest.mark.parametrize("shapes, message", [
    (((8, 4, 16), (3, 5, 16), (3, 5, 16)),
     "enable_gqa=True needs the query heads Hq=8 to be a multiple of the key/value heads "
     "Hkv=3: q.shape=(8, 4, 16), k.shape=(3, 5, 16)"),
    (((8, 4, 16), (2, 5, 16), (4, 5, 16)),
     "k and v must have the same number of heads under enable_gqa=True: k.shape=(2, 5, 16) "
     "and v.shape=(4, 5, 16)"),
    (((4, 16), (2, 5, 16), (2, 5, 16)),
     "enable_gqa=True needs (..., heads, length, head_dim) inputs, got q.shape=(4, 16)"),
    (((8, 4, 16), (0, 5, 16), (0, 5, 16)),
     "enable_gqa=True needs the query heads Hq=8 to be a multiple of the key/value heads Hkv=0"),
])
def test_gqa_shapes_that_do_not_group_are_a_value_error(entry, shapes, message):
    with raises(ValueError, message):
        entry(*arrays(*shapes), enable_gqa=True)


def test_gqa_flag_of_the_wrong_type_is_a_type_error(entry):
    with raises(TypeError, "enable_gqa must be a bool, got 'yes'"):
        entry(*arrays((2, 4, 16), (2, 5, 16), (2, 5, 16)), enable_gqa="yes")


def test_gqa_out_and_backward_arguments_must_have_q_heads():
    q, k, v = arrays((8, 4, 16), (2, 5, 16), (2, 5, 16))
    with raises(ValueError, "out.shape=(2, 4, 16) must have q's 8 heads at axis -3 under "
                            "enable_gqa=True (q.shape=(8, 4, 16))"):
        cuflash.attention(q, k, v, enable_gqa=True, out=numpy.empty((2, 4, 16), numpy.float32))
    do, o = arrays((8, 4, 16), (8, 4, 16))
    with raises(ValueError, "lse.shape=(2, 4) must have q's 8 heads at axis -2 under "
                            "enable_gqa=True"):
        cuflash.attention_backward(do, q, k, v, o, numpy.zeros((2, 4), numpy.float32),
                                   enable_gqa=True)
