"""Tracing score_mod / mask_mod (cuflash._trace) into CUDA, checked three ways without a GPU:

- the trace evaluated on NumPy (``Trace.evaluate``) against calling the function directly;
- the trace's forward-mode derivative against central differences of the function (float64);
- the generated C++ compiled by NVRTC for sm_80 and sm_90a (it is valid CUDA), and compiled
  for the host by g++ (``__device__`` defined away) and run on the same inputs as the
  interpreter (the C++ computes what the interpreter computes, NaN, Inf and integer corner
  cases included);
plus the errors: every unsupported operation names itself and the function.
"""

from __future__ import annotations

import ctypes
import functools
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy
import numpy as np
import pytest

from cuflash import _captured, _jit, _trace, _trace_cuda

RNG = numpy.random.default_rng(7)
DOC = _captured.captured(numpy.array([[0, 0, 0, 1, 1, 2, 2, 2, 2, 3, 3, 3],
                                      [0, 1, 1, 1, 1, 1, 2, 2, 3, 3, 3, 3]]))
TABLE = _captured.captured(RNG.standard_normal((3, 8)).astype(numpy.float32))
TABLE64 = _captured.captured(RNG.standard_normal((12,)))
FLAGS = _captured.captured(numpy.array([True, False, True, True, False, True, False, True,
                                        True, True, False, False]))
C = 30.0

SCORE_MODS = {
    "softcap": lambda s, b, h, q, kv: C * np.tanh(s / C),
    "alibi": lambda s, b, h, q, kv: s - 0.25 * (h + 1) * np.abs(q - kv),
    "where": lambda s, b, h, q, kv: np.where(q >= kv, s, s * 0.5 - 1),
    "int_ops": lambda s, b, h, q, kv: s + (q // 3) * 0.5 - (kv % 4) + (q - kv) // -2
    + (kv - q) % -3,
    "softplus": lambda s, b, h, q, kv: np.log(np.exp(s * 0.1) + 1.0),
    "clip": lambda s, b, h, q, kv: np.clip(s, -2, 2) + np.maximum(s, 0) - np.minimum(0.5, s),
    "power": lambda s, b, h, q, kv: s ** 2 * 0.01 + s ** 3 * 0.001 - (q % 2) ** 2 + 2 ** (s * 0.1),
    "table": lambda s, b, h, q, kv: s + TABLE[h, np.minimum(np.abs(q - kv), 7)],
    "doc_gate": lambda s, b, h, q, kv: s * (DOC[b, q] == DOC[b, kv]) + TABLE64[kv] * s,
    "divide": lambda s, b, h, q, kv: s / (1 + np.abs(q - kv)) + s % 1.5 - s // 2.5,
    "sqrt": lambda s, b, h, q, kv: np.sqrt(np.abs(s) + 1) * np.exp2(s * 0.1) - np.log2(2 + s * s),
    "trig": lambda s, b, h, q, kv: np.sin(s) * np.cos(0.5 * s) + np.expm1(0.1 * s)
    + np.log1p(s * s) + np.square(s) * 0.01,
    "flat": lambda s, b, h, q, kv: np.floor(s) + np.ceil(s * 0.5) + np.rint(s) + np.trunc(-s),
    "constant": lambda s, b, h, q, kv: 2.0,
    "numpy_scalar": lambda s, b, h, q, kv: np.float32(0.5) * s + np.int64(3) - np.float64(2.5),
    "flags": lambda s, b, h, q, kv: np.where(FLAGS[kv] & ~FLAGS[q], -s, s),
}
MASK_MODS = {
    "causal": lambda b, h, q, kv: q >= kv,
    "document": lambda b, h, q, kv: (DOC[b, q] == DOC[b, kv]) & (q - kv < 3),
    "prefix_lm": lambda b, h, q, kv: (kv < 4) | (q >= kv),
    "xor": lambda b, h, q, kv: ~(q % 2 == 0) ^ (kv > 2),
    "logical": lambda b, h, q, kv: np.logical_and(q > 1, np.logical_not(kv == 0))
    | np.logical_or(h == 1, b == 1),
    "float_test": lambda b, h, q, kv: np.exp(q * 0.1) > 1.2 + kv * 0.05,
    "flags": lambda b, h, q, kv: FLAGS[q] | (kv == 3),
    "always": lambda b, h, q, kv: True,
}


def grid(n_scores: int = 1):
    """Broadcastable NumPy arguments: b in {0, 1}, h in {0, 1, 2}, q, kv in [0, 12)."""
    b = numpy.arange(2).reshape(2, 1, 1, 1)
    h = numpy.arange(3).reshape(1, 3, 1, 1)
    q = numpy.arange(12).reshape(12, 1)
    kv = numpy.arange(12).reshape(1, 12)
    s = (RNG.standard_normal((2, 3, 12, 12)) * 4).astype(numpy.float32)
    return s, b, h, q, kv


@pytest.mark.parametrize("name", SCORE_MODS)
def test_score_mod_trace_evaluates_like_the_function(name):
    fn = SCORE_MODS[name]
    tr = _trace.trace_score_mod(fn)
    s, b, h, q, kv = grid()
    with numpy.errstate(all="ignore"):
        direct = numpy.broadcast_to(numpy.asarray(fn(s, b, h, q, kv), numpy.float64), s.shape)
    ours = numpy.broadcast_to(tr.evaluate(s, b, h, q, kv), s.shape)
    assert ours.dtype == numpy.float32
    # The trace computes in float32 like the GPU; NumPy promotes int64 indices to float64.
    numpy.testing.assert_allclose(ours, direct, rtol=2e-6, atol=2e-6 * numpy.abs(direct).max(),
                                  equal_nan=True)


@pytest.mark.parametrize("name", MASK_MODS)
def test_mask_mod_trace_evaluates_like_the_function(name):
    fn = MASK_MODS[name]
    tr = _trace.trace_mask_mod(fn)
    _, b, h, q, kv = grid()
    direct = numpy.broadcast_to(fn(b, h, q, kv), (2, 3, 12, 12))
    ours = numpy.broadcast_to(tr.evaluate(None, b, h, q, kv), (2, 3, 12, 12))
    assert ours.dtype == numpy.bool_
    assert (ours == direct).all()
    assert direct.any() and (name == "always" or not direct.all())   # the test can fail


@pytest.mark.parametrize("name", SCORE_MODS)
def test_score_mod_derivative_matches_finite_differences(name):
    fn = SCORE_MODS[name]
    tr = _trace.trace_score_mod(fn)
    s, b, h, q, kv = grid()
    s = s.astype(numpy.float64)
    eps = 1e-6
    with numpy.errstate(all="ignore"):
        fd = (numpy.asarray(fn(s + eps, b, h, q, kv), float)
              - numpy.asarray(fn(s - eps, b, h, q, kv), float)) / (2 * eps)
    fd = numpy.broadcast_to(fd, s.shape)
    ours = numpy.broadcast_to(tr.evaluate_derivative(s, b, h, q, kv), s.shape)
    # kinks (floor, %, //, minimum, abs) are where central differences are not a derivative
    smooth = numpy.ones(s.shape, bool)
    for kink in (numpy.floor(s), numpy.floor(s * 0.5), numpy.floor(s / 1.5),
                 numpy.floor(s / 2.5), numpy.rint(s)):
        smooth &= numpy.floor(s - 1e-4) == numpy.floor(s + 1e-4)
        smooth &= numpy.abs(s - numpy.round(s * 2) / 2) > 1e-4
        smooth &= numpy.abs(s % 1.5) > 1e-4
    smooth &= (numpy.abs(s) > 1e-4) & (numpy.abs(s - 2) > 1e-4) & (numpy.abs(s + 2) > 1e-4)
    assert smooth.mean() > 0.9
    numpy.testing.assert_allclose(ours[smooth], fd[smooth], rtol=1e-5, atol=1e-5)


def test_closure_constants_are_part_of_the_source_and_captured_contents_are_not():
    def make(c):
        return lambda s, b, h, q, kv: c * np.tanh(s / c)
    a, a2, b = (_trace.trace_score_mod(make(c)) for c in (30.0, 30.0, 50.0))
    assert a.source == a2.source and a.struct_name == a2.struct_name
    assert a.source != b.source and a.struct_name != b.struct_name
    assert f"F({(50.0).hex()})" in b.source     # the exact value, F = the accumulation type
    t1 = _captured.captured(numpy.zeros((4,), numpy.int32))
    t2 = _captured.captured(numpy.arange(9, dtype=numpy.int32))
    s1 = _trace.trace_mask_mod(lambda b, h, q, kv: t1[q] == t1[kv]).source
    s2 = _trace.trace_mask_mod(lambda b, h, q, kv: t2[q] == t2[kv]).source
    assert s1 == s2      # a captured array is a pointer: new contents or length, same source
    t3 = _captured.captured(numpy.arange(9, dtype=numpy.int64))
    assert _trace.trace_mask_mod(lambda b, h, q, kv: t3[q] == t3[kv]).source != s1


def test_captured_indexing_on_numpy_raises_index_error_out_of_range():
    doc = _captured.captured(numpy.arange(6).reshape(2, 3))
    assert doc[numpy.array(1), numpy.array([0, 2])].tolist() == [3, 5]
    with pytest.raises(IndexError, match=r"index 3 is out of range for axis 1"):
        doc[0, numpy.arange(4)]
    with pytest.raises(IndexError, match=r"index -1 is out of range for axis 0"):
        doc[numpy.array([-1]), 0]
    with pytest.raises(TypeError, match="one integer per dimension"):
        doc[0]
    with pytest.raises(TypeError, match="integers"):
        doc[0, 1.5]
    with pytest.raises(TypeError, match="integers only"):
        doc[0, :]
    with pytest.raises(TypeError, match="numpy.ndarray or cupy.ndarray"):
        _captured.captured([1, 2, 3])
    with pytest.raises(ValueError, match="empty"):
        _captured.captured(numpy.zeros((0,), int))


def test_clamped_loads_in_the_trace():
    table = _captured.captured(numpy.array([10, 20, 30], numpy.int32))
    tr = _trace.trace_score_mod(lambda s, b, h, q, kv: s + table[q - 2])
    q = numpy.arange(7)
    assert tr.evaluate(numpy.zeros(7, numpy.float32), 0, 0, q, 0).tolist() == \
        [10, 10, 10, 20, 30, 30, 30]


def _arctan(s, b, h, q, kv):
    return np.arctan(s)


def _branch(s, b, h, q, kv):
    if s > 0:
        return s
    return -s


PLAIN = numpy.arange(5.0)

ERRORS = [
    (_arctan, "score_mod", r"numpy\.arctan is not supported in score_mod _arctan \("),
    (_branch, "score_mod", r"Python control flow .* in score_mod _branch"),
    (lambda s, b, h, q, kv: s + PLAIN[q], "score_mod", r"wrap the array with cuflash.captured"),
    (lambda s, b, h, q, kv: s + PLAIN, "score_mod", r"array constant"),
    (lambda s, b, h, q, kv: (s, s), "score_mod", r"returned a non-scalar tuple"),
    (lambda s, b, h, q, kv: s > 0, "score_mod", r"returned a bool"),
    (lambda s, b, h, q, kv: np.sum(s), "score_mod", r"numpy\.sum is not supported"),
    (lambda s, b, h, q, kv: s.astype(np.float16), "score_mod", r"attribute \.astype"),
    (lambda s, b, h, q, kv: __import__("math").tanh(s), "score_mod", r"float\(\)"),
    (lambda s, b, h, q, kv: s << 2, "score_mod", r"unsupported operand|not supported"),
    (lambda s, b, h, q, kv: (q > 0) + (kv > 0), "score_mod", r"numpy.add of two bools"),
    (lambda s, b, h, q, kv: s & 1, "score_mod", r"on floats"),
    (lambda b, h, q, kv: q * 1.0, "mask_mod", r"returned a float; a mask_mod returns a bool"),
    (lambda b, h, q, kv: TABLE[q * 0.5, kv], "mask_mod", r"indexing a captured array with"),
    (lambda b, h, q, kv: _captured.captured(numpy.zeros(3, numpy.float16))[q] > 0, "mask_mod",
     r"dtype float16"),
    (lambda b, h, q, kv: np.add(q, kv, dtype=np.int64) > 0, "mask_mod",
     r"numpy.add.__call__ with \['dtype'\]"),
]


@pytest.mark.parametrize("fn, role, message", ERRORS)
def test_trace_errors_name_the_operation_and_the_function(fn, role, message):
    tracer = _trace.trace_score_mod if role == "score_mod" else _trace.trace_mask_mod
    with pytest.raises(TypeError, match=message):
        tracer(fn)


def test_too_many_captured_arrays():
    caps = [_captured.captured(numpy.arange(3)) for _ in range(5)]
    with pytest.raises(TypeError, match="more than 4 captured arrays"):
        _trace.trace_mask_mod(lambda b, h, q, kv: (caps[0][q] + caps[1][q] + caps[2][q]
                                                   + caps[3][q] + caps[4][q]) > 0)


# ---------------------------------------------------------------------------------------------
# The generated C++: NVRTC (valid CUDA) and g++ (the same numbers as the interpreter)
# ---------------------------------------------------------------------------------------------

def _all_traces():
    return ([(n, _trace.trace_score_mod(f)) for n, f in SCORE_MODS.items()]
            + [(n, _trace.trace_mask_mod(f)) for n, f in MASK_MODS.items()])


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_generated_sources_compile_with_nvrtc(arch):
    try:
        nvrtc = _jit._nvrtc_for(arch)
    except _jit.KernelCompileError as exc:
        pytest.skip(str(exc))
    parts, calls = [], []
    for n, (name, tr) in enumerate(_all_traces()):
        parts.append(tr.source)
        q = _trace_cuda.qualified_name(tr)
        if tr.role == "score_mod":
            calls.append(f"out[{n}] = {q}::apply(out[{n}], 1, 2, i, i + 1, cap) "
                         f"+ {q}::dscore(out[{n}], 1, 2, i, i + 1, cap);")
        else:
            calls.append(f"out[{n}] = {q}::apply(1, 2, i, i + 1, cap) ? 1.0f : 0.0f;")
    src = ("\n".join(parts) + "\n__global__ void probe(float* out, const cuflash::CapturedArray*"
           " cap) {\n  int i = threadIdx.x;\n  " + "\n  ".join(calls) + "\n}\n")
    log, lowered, _ = nvrtc.compile(src, "trace_probe.cu", ["probe"], _jit._options(arch))
    assert lowered is not None, log[:4000]


HOST_PRELUDE = r"""
#include <math.h>
#include <string.h>
#define __device__
#define __forceinline__ inline
static inline float __int_as_float(int x) { float f; memcpy(&f, &x, 4); return f; }
"""


@functools.lru_cache(maxsize=None)
def _host_library():
    """All test traces compiled for the host by g++: run_<n>(count, s, b, h, q, kv, cap, out)."""
    traces = _all_traces()
    parts = [HOST_PRELUDE]
    for n, (name, tr) in enumerate(traces):
        parts.append(tr.source)
        q = _trace_cuda.qualified_name(tr)
        args = "const int* b, const int* h, const int* qi, const int* kv"
        if tr.role == "score_mod":
            parts.append(
                f'extern "C" void run_{n}(int count, const float* s, {args}, '
                f"const cuflash::CapturedArray* cap, float* out, float* dout) {{\n"
                f"  for (int i = 0; i < count; ++i) {{\n"
                f"    out[i] = {q}::apply(s[i], b[i], h[i], qi[i], kv[i], cap);\n"
                f"    dout[i] = {q}::dscore(s[i], b[i], h[i], qi[i], kv[i], cap);\n  }}\n}}\n")
        else:
            parts.append(
                f'extern "C" void run_{n}(int count, const float* s, {args}, '
                f"const cuflash::CapturedArray* cap, float* out, float* dout) {{\n"
                f"  for (int i = 0; i < count; ++i)\n"
                f"    out[i] = {q}::apply(b[i], h[i], qi[i], kv[i], cap) ? 1.0f : 0.0f;\n}}\n")
    tmp = Path(tempfile.mkdtemp(prefix="cuflash_trace_"))
    (tmp / "t.cpp").write_text("\n".join(parts))
    run = subprocess.run(["g++", "-std=c++17", "-O1", "-shared", "-fPIC", "-o", str(tmp / "t.so"),
                          str(tmp / "t.cpp")], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[:4000]
    return traces, ctypes.CDLL(str(tmp / "t.so"))


CAPTURED_ARRAY = numpy.dtype([("ptr", "<u8"), ("shape", "<i8", 4), ("stride", "<i8", 4)])


def _captured_block(captures):
    block = numpy.zeros(max(1, len(captures)), CAPTURED_ARRAY)
    keep = []
    for n, cap in enumerate(captures):
        arr = cap.array
        keep.append(arr)
        block[n]["ptr"] = arr.ctypes.data
        block[n]["shape"][:arr.ndim] = arr.shape
        block[n]["stride"][:arr.ndim] = [st // arr.itemsize for st in arr.strides]
    return block, keep


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_generated_cpp_computes_what_the_interpreter_computes():
    traces, lib = _host_library()
    s, b, h, q, kv = grid()
    shape = s.shape
    # corner cases among the scores: infinities, NaN, zeros of both signs, large values
    s.flat[:8] = [numpy.inf, -numpy.inf, numpy.nan, 0.0, -0.0, 1e30, -1e30, 2.5]
    # out-of-range indices too: the C++ and the interpreter clamp them alike
    bb, hh, qq, kk = (numpy.ascontiguousarray(numpy.broadcast_to(x, shape), numpy.int32)
                      for x in (b, h, q, kv))
    qq.flat[:4], kk.flat[4:8] = [-5, 40, 11, -1], [13, -2, 0, 99]
    for n, (name, tr) in enumerate(traces):
        block, keep = _captured_block(tr.captures)
        out = numpy.zeros(shape, numpy.float32)
        dout = numpy.zeros(shape, numpy.float32)
        ptr = [x.ctypes.data_as(ctypes.c_void_p) for x in (s, bb, hh, qq, kk, block, out, dout)]
        getattr(lib, f"run_{n}")(ctypes.c_int(s.size), *ptr)
        value = numpy.broadcast_to(tr.evaluate(s, bb, hh, qq, kk), shape).astype(numpy.float32)
        _same(out, value, f"{name} value")
        if tr.role == "score_mod":
            d = numpy.broadcast_to(tr.evaluate_derivative(s, bb, hh, qq, kk), shape)
            _same(dout, d.astype(numpy.float32), f"{name} derivative")


def _same(ours, ref, what):
    """Equal up to a few float32 ulps (libm and NumPy's float32 functions may differ by
    that), with NaN and Inf in the same places."""
    assert (numpy.isnan(ours) == numpy.isnan(ref)).all(), what
    fin = numpy.isfinite(ref)
    assert (ours[~fin & ~numpy.isnan(ref)] == ref[~fin & ~numpy.isnan(ref)]).all(), what
    scale = numpy.maximum(numpy.abs(ref[fin]), 1.0)
    err = numpy.abs(ours[fin] - ref[fin]) / scale
    assert err.max(initial=0) <= 8 * numpy.finfo(numpy.float32).eps, (what, err.max())


def test_cached_traces_follow_what_the_function_reads():
    import types

    def make(value):
        return lambda s, b, h, q, kv: s * value

    f = make(2.0)
    t1 = _trace.cached_trace(f, "score_mod")
    assert _trace.cached_trace(f, "score_mod") is t1          # nothing changed: reused
    g = make(3.0)
    assert _trace.cached_trace(g, "score_mod").source != t1.source
    # a global float read by name: a new value is a new trace
    ns = {"np": np, "SCALE": 2.0}
    exec("def k(s, b, h, q, kv):\n    return s * SCALE", ns)
    a = _trace.cached_trace(ns["k"], "score_mod")
    ns["SCALE"] = 4.0
    b = _trace.cached_trace(ns["k"], "score_mod")
    assert a is not b and a.source != b.source
    assert "F(0x1.0000000000000p+2)" in b.source
    # a global of a mutable unknown type: traced every time (never stale)
    ns["CFG"] = types.SimpleNamespace(scale=2.0)
    exec("def m(s, b, h, q, kv):\n    return s * CFG.scale", ns)
    x = _trace.cached_trace(ns["m"], "score_mod")
    ns["CFG"].scale = 5.0
    y = _trace.cached_trace(ns["m"], "score_mod")
    assert x is not y and x.source != y.source
    # a captured array: the same object reuses the trace, a new one gets its own (its pointer)
    d1 = _captured.captured(numpy.arange(4))
    d2 = _captured.captured(numpy.arange(4))
    ns.update(DOC=d1)
    exec("def mm(b, h, q, kv):\n    return DOC[q] == DOC[kv]", ns)
    p = _trace.cached_trace(ns["mm"], "mask_mod")
    assert _trace.cached_trace(ns["mm"], "mask_mod") is p and p.captures[0] is d1
    ns["DOC"] = d2
    r = _trace.cached_trace(ns["mm"], "mask_mod")
    assert r.captures[0] is d2 and r.source == p.source


# ---------------------------------------------------------------------------------------------
# Random expressions: the trace is the function, whatever it is built from
# ---------------------------------------------------------------------------------------------

from hypothesis import example, given, strategies as st  # noqa: E402

_FLOAT_UNARY = [np.tanh, np.exp, np.abs, np.sqrt, np.sin, np.floor, np.square, np.negative,
                lambda x: np.log(np.abs(x) + 1)]
_BINARY = [np.add, np.subtract, np.multiply, np.true_divide, np.minimum, np.maximum,
           lambda a, b: a % (np.abs(b) + 1), lambda a, b: a // (np.abs(b) + 1),
           lambda a, b: np.where(a > b, a, b * 0.5)]
_INT_BINARY = [np.add, np.subtract, np.multiply, lambda a, b: a // (np.abs(b) + 1),
               lambda a, b: a % (np.abs(b) + 2), np.minimum, np.maximum]


@st.composite
def expressions(draw, depth=3):
    """A random function of (s, b, h, q, kv) built from the supported operations."""
    if depth == 0 or draw(st.integers(0, 3)) == 0:
        leaf = draw(st.sampled_from(["s", "h", "q", "kv", "const", "iconst"]))
        if leaf == "const":
            c = draw(st.floats(-3, 3, allow_nan=False, width=32))
            if draw(st.booleans()):
                return lambda s, b, h, q, kv: c * s
            return lambda s, b, h, q, kv: c
        if leaf == "iconst":
            n = draw(st.integers(-5, 5))
            return lambda s, b, h, q, kv: n
        return {"s": lambda s, b, h, q, kv: s, "h": lambda s, b, h, q, kv: h,
                "q": lambda s, b, h, q, kv: q, "kv": lambda s, b, h, q, kv: kv}[leaf]
    kind = draw(st.sampled_from(["unary", "binary", "int", "where"]))
    a = draw(expressions(depth - 1))
    if kind == "unary":
        f = draw(st.sampled_from(_FLOAT_UNARY))
        return lambda s, b, h, q, kv: f(a(s, b, h, q, kv) * 1.0)
    b_ = draw(expressions(depth - 1))
    if kind == "binary":
        g = draw(st.sampled_from(_BINARY))
        return lambda s, b, h, q, kv: g(a(s, b, h, q, kv) * 1.0, b_(s, b, h, q, kv))
    if kind == "int":
        g = draw(st.sampled_from(_INT_BINARY))
        return lambda s, b, h, q, kv: s * 0 + g(q - kv, h + 1)
    c = draw(expressions(depth - 1))
    return lambda s, b, h, q, kv: np.where((q >= kv) | (a(s, b, h, q, kv) < 0),
                                           b_(s, b, h, q, kv), c(s, b, h, q, kv))


@given(expressions())
# found by this test: float constants were rounded to float32 in the trace itself, so the
# float64 reference (and its score_mod derivative) computed with tanh(1.0f), not tanh(1.0)
@example(lambda s, b, h, q, kv: np.tanh(1 * 1.0) + s * 0.1)
def test_random_expressions_trace_to_the_function(fn):
    """In float64 (the reference's arithmetic) the trace computes exactly what the function
    computes on NumPy arrays, operation for operation."""
    tr = _trace.trace_score_mod(fn)
    s, b, h, q, kv = grid()
    s = s.astype(numpy.float64)
    with numpy.errstate(all="ignore"):
        direct = numpy.broadcast_to(numpy.asarray(fn(s, b, h, q, kv), numpy.float64), s.shape)
    ours = numpy.broadcast_to(tr.evaluate(s, b, h, q, kv), s.shape)
    numpy.testing.assert_allclose(ours, direct, rtol=1e-13, atol=1e-13, equal_nan=True)
