"""The softcap's fixed-offset softmax (session 10; online_softmax.cuh ``softcap_offset``,
``ex2_poly_fixed``, ``fixed_offset_softmax_scores``; cuflash._variant ``softcap_offset``),
checked on the CPU from the source: the functions are cut out of the header and compiled with
g++ (the C library's ``fmaf`` is the GPU's FFMA: one rounding), so the numbers are the kernel's.

- ex2_poly_fixed's 2^(s sl2 - mo) keeps ex2.approx's accuracy (relative error < 2.5e-7, the
  bound ex2_poly's test holds) over every score s in [-1, 1] and the caps / key counts the host
  admits, and gives exactly 0 for a masked score (-inf);
- the kernel's offset is the host's (the plan decides the build from it) and meets the
  bounds the header states: the lowest possible row max keeps 24 + lg bits above the float
  range's bottom, and P Lk <= 2^88 where admitted;
- the Variant's C++ spelling and the plan-time switches (the fixed offset; bwd_sm90's plain
  path for the softcap alone, whose kernel code only a GPU runs: tests/test_gpu_modifiers.py).
The emulated forward (tests/test_emulated_sm80.py, ``-m slow``) runs the whole kernel path.
"""

from __future__ import annotations

import ctypes
import math
import pathlib
import shutil
import subprocess

import numpy
import pytest

from cuflash import _variant

SRC = pathlib.Path(__file__).parent.parent / "cuda_src" / "online_softmax.cuh"


def _function(src: str, signature: str) -> str:
    """The text of the function whose definition starts with ``signature`` (to its closing
    brace at column 0)."""
    start = src.index(signature)
    start = src.rindex("\n", 0, start) + 1
    end = src.index("\n}\n", start) + 3
    return src[start:end]


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    if shutil.which("g++") is None:
        pytest.skip("needs g++")
    src = SRC.read_text()
    body = "\n".join(_function(src, s) for s in ("float softcap_offset(float a, int Lk)",
                                                  "float ex2_poly_fixed(float s, float sl2, float c1)"))
    shim = """
#include <cmath>
#include <cstring>
#include <algorithm>
#define __device__
#define __forceinline__ inline
using std::max;
// (fmaf, fminf, floorf: the C library's, fmaf fused with one rounding as FFMA)
static inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(static_cast<unsigned>(x)); }
static inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
static inline unsigned __float_as_uint(float x) { unsigned i; std::memcpy(&i, &x, 4); return i; }
"""
    api = """
extern "C" float c_offset(float a, int Lk) { return softcap_offset(a, Lk); }
extern "C" void c_ex2(const float* s, float* out, int n, float sl2, float mo) {
  for (int i = 0; i < n; ++i) out[i] = ex2_poly_fixed(s[i], sl2, 12582912.f - mo);
}
"""
    tmp = tmp_path_factory.mktemp("fixed")
    (tmp / "f.cpp").write_text(shim + body + api)
    run = subprocess.run(["g++", "-std=c++17", "-O1", "-ffp-contract=off", "-shared", "-fPIC",
                          "-o", str(tmp / "f.so"), str(tmp / "f.cpp")], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    so = ctypes.CDLL(str(tmp / "f.so"))
    so.c_offset.restype = ctypes.c_float
    so.c_offset.argtypes = [ctypes.c_float, ctypes.c_int]
    so.c_ex2.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_float]
    return so


def _sl2(c: float) -> numpy.float32:
    return numpy.float32(c) * numpy.float32(_variant.LOG2E)   # the kernels' p.mod.softcap * log2(e)


CAPS = (0.5, 2.0, 5.0, 20.0, 30.0, 50.0, 52.0)
LKS = (1, 2, 90, 150, 4096, 4097, 16384, 1 << 20, 1 << 22)


def test_the_kernels_offset_is_the_hosts_and_meets_its_bounds(lib):
    for c in CAPS:
        a = float(_sl2(c))
        for Lk in LKS:
            mo_k = lib.c_offset(_sl2(c), Lk)
            mo = _variant.softcap_offset(c, Lk)
            lg = max(1, math.ceil(math.log2(max(Lk, 2))))
            assert mo_k == math.floor(mo_k) and abs(mo_k) < 2 ** 22
            # a row whose every score is the lowest possible, -a: its terms down to 2^-(24 + lg)
            # of the max stay normal floats (x >= -126), and the largest P is at most 2^(a - mo)
            assert -a - mo_k - 24 - lg >= -126, (c, Lk, mo_k)
            if mo is None:
                assert a - mo_k + lg > 88, (c, Lk, mo_k)
            else:
                assert mo == mo_k, (c, Lk, mo, mo_k)
                assert a - mo + lg <= 88
    assert _variant.softcap_offset(50.0, 1 << 22) is not None      # Gemma 2's cap, 4M keys
    assert _variant.softcap_offset(30.0, 1 << 31) is not None
    assert _variant.softcap_offset(100.0, 4096) is None             # the running max instead


@pytest.mark.parametrize("c", CAPS)
def test_ex2_poly_fixed_is_as_accurate_as_ex2_approx(lib, c):
    s = numpy.concatenate([numpy.linspace(-1, 1, 200001, dtype=numpy.float32),
                           numpy.array([-1.0, 1.0, -0.0, 0.0], numpy.float32)])
    sl2 = _sl2(c)
    for Lk in (150, 4096, 16384):
        mo = lib.c_offset(sl2, Lk)
        if _variant.softcap_offset(c, Lk) is None:
            continue
        out = numpy.empty_like(s)
        lib.c_ex2(s.ctypes.data, out.ctypes.data, s.size, sl2, mo)
        exact = numpy.exp2(s.astype(numpy.float64) * float(sl2) - mo)
        err = numpy.abs(out.astype(numpy.float64) / exact - 1).max()
        assert err < 2.5e-7, f"c={c} Lk={Lk} mo={mo}: relative error {err:.3g}"
    masked = numpy.array([-numpy.inf] * 4, numpy.float32)
    out = numpy.empty_like(masked)
    lib.c_ex2(masked.ctypes.data, out.ctypes.data, masked.size, sl2, lib.c_offset(sl2, 4096))
    assert (out == 0).all()


def test_the_variant_spells_the_fixed_builds(monkeypatch):
    V = _variant.Variant
    assert ", 4, false," in V(softcap=True, softcap_fixed=True).cpp
    assert ", 5, false," in V(softcap=True, softcap_fixed=True, softcap_poly=False).cpp
    assert ", 6, false," in V(softcap=True, softcap_fixed=True, softcap_share_alt=True).cpp
    assert ", true, false," in V(softcap=True).cpp                  # the running max, as before
    assert ", 2, false," in V(softcap=True, softcap_tanh=False, softcap_fixed=True).cpp


def _plan_variant(monkeypatch, dtype="bfloat16", Lk=4096, env=(), causal=False, **kw):
    """The Variant a plan takes for one problem (what ``_families.Shape.of`` asks)."""
    import ml_dtypes
    from cuflash import _modifiers, _problem
    for name in ("CUFLASH_SOFTCAP_TANH", "CUFLASH_SOFTCAP_FIXED", "CUFLASH_SOFTCAP_SHARE",
                 "CUFLASH_SOFTCAP_BWD"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env:
        monkeypatch.setenv(name, value)
    t = numpy.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else numpy.dtype(dtype)
    q = numpy.zeros((1, 2, 8, 64), t)
    k = numpy.zeros((1, 2, Lk, 64), t)
    prob = _problem.make_problem(q, k, k, scale=None, causal=causal)
    mods = _modifiers.check_modifiers(xp=numpy, device_id=None, batch_shape=prob.batch_shape,
                                      Lq=prob.Lq, Lk=prob.Lk, **kw)
    return _variant.variant_of(prob, mods)


def test_the_plan_takes_the_fixed_offset_where_admitted(monkeypatch):
    v = _plan_variant(monkeypatch, softcap=50.0)
    assert v.softcap_fixed and not v.softcap_share_alt and ", 4, false," in v.cpp
    assert _plan_variant(monkeypatch, softcap=50.0, env=[("CUFLASH_SOFTCAP_SHARE", "alt")]).softcap_share_alt
    assert not _plan_variant(monkeypatch, softcap=50.0, env=[("CUFLASH_SOFTCAP_FIXED", "0")]).softcap_fixed
    assert not _plan_variant(monkeypatch, softcap=50.0, env=[("CUFLASH_SOFTCAP_TANH", "0")]).softcap_fixed
    assert not _plan_variant(monkeypatch, "float16", softcap=50.0).softcap_fixed     # ex2 / rcp
    assert not _plan_variant(monkeypatch, softcap=100.0).softcap_fixed               # P too large
    slopes = numpy.ones((2,), numpy.float32)
    assert not _plan_variant(monkeypatch, softcap=50.0, alibi_slopes=slopes).softcap_fixed
    assert not _plan_variant(monkeypatch, softcap=50.0, window=(8, 0)).softcap_fixed  # (spills)
    assert not _plan_variant(monkeypatch, alibi_slopes=slopes).softcap_fixed


def test_the_plan_takes_bwd_sm90s_plain_path_for_the_softcap_alone(monkeypatch):
    """Opt-in (``CUFLASH_SOFTCAP_BWD=plain``): session 10's call 2 measured it slower."""
    assert not _plan_variant(monkeypatch, softcap=50.0).softcap_bwd_plain
    assert not _plan_variant(monkeypatch, softcap=50.0, env=[("CUFLASH_SOFTCAP_BWD", "pairwise")]).softcap_bwd_plain
    plain = [("CUFLASH_SOFTCAP_BWD", "plain")]
    v = _plan_variant(monkeypatch, softcap=50.0, env=plain)
    assert v.softcap_bwd_plain and ", 12, false," in v.cpp          # 4 + 8
    v = _plan_variant(monkeypatch, softcap=100.0, env=plain)       # the running max, plain path
    assert v.softcap_bwd_plain and not v.softcap_fixed and ", 9, false," in v.cpp
    assert not _plan_variant(monkeypatch, "float16", softcap=50.0, env=plain).softcap_bwd_plain
    assert not _plan_variant(monkeypatch, softcap=1e-4, env=plain).softcap_bwd_plain   # (kHiddenTh's bound)
    assert not _plan_variant(monkeypatch, softcap=50.0, window=(8, 0), env=plain).softcap_bwd_plain
    mask = numpy.ones((1, 1, 8, 4096), bool)
    assert not _plan_variant(monkeypatch, softcap=50.0, mask=mask, env=plain).softcap_bwd_plain
    assert not _plan_variant(monkeypatch, softcap=50.0, mask=mask).softcap_fixed
    assert _plan_variant(monkeypatch, softcap=50.0, causal=True).softcap_fixed
    slopes = numpy.ones((2,), numpy.float32)
    assert not _plan_variant(monkeypatch, softcap=50.0, alibi_slopes=slopes, env=plain).softcap_bwd_plain
    with pytest.raises(ValueError):
        _plan_variant(monkeypatch, softcap=50.0, env=[("CUFLASH_SOFTCAP_BWD", "yes")])
