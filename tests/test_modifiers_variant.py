"""cuda_src/modifiers.cuh (the Variant hooks the kernels will call) against cuflash._pipeline.

The header is compiled for the host with g++ (``__device__`` defined away) together with
traced user functions, for several Variant configurations, and each hook is run over every
(batch item, i, j) of a random problem whose ModifierParams come from
``cuflash._modifier_params.pack``: the modified score, the element mask and the backward
chain (dL/ds and dbias) must equal the NumPy pipeline's in float32 up to a few ulps; the tile
classification and the tile ranges must never hide a visible pair nor call a tile full that
has a hidden one. NVRTC compiles the same instantiations for sm_80 and sm_90a.
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

from cuflash import _captured, _jit, _modifier_params, _modifiers, _trace, _trace_cuda
from cuflash._block_mask import LIST_SHIFT, block_mask, tile_lists
from cuflash._pipeline import ScorePipeline

B, H, LQ, LK = 2, 3, 37, 29
CAUSAL_OFFSET = LK - LQ
TAB = _captured.captured(numpy.linspace(-1, 1, 24, dtype=numpy.float32).reshape(3, 8))
DOC = _captured.captured(numpy.repeat(numpy.arange(10), 5)[None].repeat(2, axis=0))


def score_mod(s, b, h, q, kv):
    return s * (1 + 0.1 * h) - 0.05 * np.abs(q - kv) + TAB[h, np.minimum(np.abs(q - kv), 7)] \
        + 0.1 * np.tanh(s)


def mask_mod(b, h, q, kv):
    return (DOC[b, q] == DOC[b, kv]) | (kv < 3 + b)


def score_mod2(s, b, h, q, kv):
    return np.where(q >= kv, s, 0.5 * s) + 0.1 * np.exp(0.1 * s)


def mask_mod2(b, h, q, kv):
    return (q - kv) % 4 != 1


# name -> (template arguments, modifier keywords, causal)
CONFIGS = {
    "plain": ("", {}, False),
    "all": ("true, true, true, true, float, true, SM1, MM1, false, true",
            dict(window=(6, 2), softcap=2.0, alibi=True, bias=numpy.float32, mask=True,
                 score_mod=score_mod, mask_mod=mask_mod, sink=True), True),
    "blockmask": ("false, false, true, false, double, false, SM2, MM2, true, false",
                  dict(softcap=0.5, bias=numpy.float64, score_mod=score_mod2,
                       block_mask=mask_mod2), False),
    # documents of 5 (and the first keys): most tiles of the map empty, walked over
    "blockdoc": ("false, false, false, false, void, false, cuflash::NoScoreMod, MM1, true, false",
                 dict(block_mask=mask_mod), False),
    "bands": ("true, true, false, false, void, false, cuflash::NoScoreMod, "
              "cuflash::NoMaskMod, false, true",
              dict(window=(None, 3), sink=True), True),
    "window_only": ("false, true", dict(window=(4, 0)), False),
    # ALiBi with what bwd_sm90's plain path combines it with (alibi_exp2)
    "alibi_window": ("true, true, false, true", dict(window=(5, 3), alibi=True), True),
}


def _traces():
    return {"SM1": _trace.trace_score_mod(score_mod), "MM1": _trace.trace_mask_mod(mask_mod),
            "SM2": _trace.trace_score_mod(score_mod2), "MM2": _trace.trace_mask_mod(mask_mod2)}


def _source(host: bool) -> str:
    traces = _traces()
    parts = []
    if host:
        parts.append("#include <math.h>\n#include <string.h>\n#define __device__\n"
                     "#define __forceinline__ inline\nstatic inline float __int_as_float(int x)"
                     " { float f; memcpy(&f, &x, 4); return f; }\n"
                     "static inline double __longlong_as_double(long long x)"
                     " { double f; memcpy(&f, &x, 8); return f; }\n")
    parts += [t.source for t in traces.values()]
    parts.append(_jit.load_source("modifiers.cuh") if not host else
                 (Path(__file__).parent.parent / "cuda_src" / "modifiers.cuh").read_text())
    parts += [f"using {n} = {_trace_cuda.qualified_name(t)};" for n, t in traces.items()]
    return "\n".join(parts)


HARNESS = r"""
template <class V>
void run_impl(const cuflash::ModifierParams* m, const int* bshape, int nitems, int Lq, int Lk,
              int off, const float* s, const float* ds, float* score, unsigned char* vis,
              float* grad, float* dbias, float* rs) {
  for (int n = 0; n < nitems; ++n) {
    typename V::Item it = V::item(*m, bshape, n);
    V::row_start(it, rs[2 * n], rs[2 * n + 1]);
    for (int i = 0; i < Lq; ++i)
      for (int j = 0; j < Lk; ++j) {
        const long long x = ((long long)n * Lq + i) * Lk + j;
        score[x] = V::score(*m, it, s[x], i, j);
        vis[x] = V::visible(*m, it, off, i, j);
        float db;
        grad[x] = V::grad(*m, it, s[x], ds[x], i, j, db);
        dbias[x] = db;
      }
  }
}
template <class V>
void tiles_impl(const cuflash::ModifierParams* m, const int* bshape, int nitems, int Lq, int Lk,
                int off, int bm, int bn, int* kinds, int* krange, int* qrange) {
  const int Tq = (Lq + bm - 1) / bm, Tk = (Lk + bn - 1) / bn;
  for (int n = 0; n < nitems; ++n) {
    typename V::Item it = V::item(*m, bshape, n);
    for (int a = 0; a < Tq; ++a)
      for (int c = 0; c < Tk; ++c) {
        const int i1 = (a + 1) * bm < Lq ? (a + 1) * bm : Lq, j1 = (c + 1) * bn < Lk ? (c + 1) * bn : Lk;
        kinds[((long long)n * Tq + a) * Tk + c] = V::tile_kind(*m, it, off, a * bm, i1, c * bn, j1);
      }
  }
  for (int a = 0; a < Tq; ++a)
    V::key_range(*m, off, Lk, a * bm, (a + 1) * bm < Lq ? (a + 1) * bm : Lq, krange[2 * a], krange[2 * a + 1]);
  for (int c = 0; c < Tk; ++c)
    V::query_range(*m, off, Lq, c * bn, (c + 1) * bn < Lk ? (c + 1) * bn : Lk, qrange[2 * c], qrange[2 * c + 1]);
}
// alibi_exp2 over every (batch item, i, j): x = s log2(e) in, the base-2 exponent out
template <class V>
void exp2_impl(const cuflash::ModifierParams* m, const int* bshape, int nitems, int Lq, int Lk,
               const float* s, float* out) {
  for (int n = 0; n < nitems; ++n) {
    typename V::Item it = V::item(*m, bshape, n);
    const float slope2 = V::alibi_slope_log2(it);
    for (int i = 0; i < Lq; ++i)
      for (int j = 0; j < Lk; ++j) {
        const long long x = ((long long)n * Lq + i) * Lk + j;
        out[x] = V::alibi_exp2(s[x] * 1.4426950408889634f, slope2, float(i + m->diag - j));
      }
  }
}
// The block mask's tile lists as the kernels read them (tile_list, list_entry): per query
// tile its count (kc, item x Tq) and entries 0 .. Tk (ke, item x Tq x (Tk + 1), list_entry's
// value: kListEnd past the count or from tile kend on), per key tile the transpose's (qc, qe)
template <class V>
void lists_impl(const cuflash::ModifierParams* m, const int* bshape, int nitems, int Tq, int Tk,
                int kend, int qend, int* kc, int* ke, int* qc, int* qe) {
  for (int n = 0; n < nitems; ++n) {
    typename V::Item it = V::item(*m, bshape, n);
    for (int a = 0; a < Tq; ++a) {
      int count;
      const int* l = V::template tile_list<true>(*m, it, a, count);
      kc[n * Tq + a] = count;
      for (int v = 0; v <= Tk; ++v) ke[((long long)n * Tq + a) * (Tk + 1) + v] = V::list_entry(l, v, kend);
    }
    for (int c = 0; c < Tk; ++c) {
      int count;
      const int* l = V::template tile_list<false>(*m, it, c, count);
      qc[n * Tk + c] = count;
      for (int v = 0; v <= Tq; ++v) qe[((long long)n * Tk + c) * (Tq + 1) + v] = V::list_entry(l, v, qend);
    }
  }
}
"""


def _entry_points() -> str:
    out = [HARNESS]
    for name, (args, _, _) in CONFIGS.items():
        v = f"cuflash::ModVariant<{args}>"
        out.append(
            f'extern "C" void run_{name}(const cuflash::ModifierParams* m, const int* bs, int n,'
            f" int Lq, int Lk, int off, const float* s, const float* ds, float* sc, unsigned"
            f" char* vis, float* g, float* db, float* rs) {{ run_impl<{v}>(m, bs, n, Lq, Lk, off,"
            f" s, ds, sc, vis, g, db, rs); }}\n"
            f'extern "C" void tiles_{name}(const cuflash::ModifierParams* m, const int* bs, int n,'
            f" int Lq, int Lk, int off, int bm, int bn, int* k, int* kr, int* qr) {{"
            f" tiles_impl<{v}>(m, bs, n, Lq, Lk, off, bm, bn, k, kr, qr); }}\n"
            f'extern "C" void lists_{name}(const cuflash::ModifierParams* m, const int* bs, int n,'
            f" int Tq, int Tk, int ke_, int qe_, int* kc, int* ke, int* qc, int* qe) {{"
            f" lists_impl<{v}>(m, bs, n, Tq, Tk, ke_, qe_, kc, ke, qc, qe); }}\n"
            f'extern "C" void exp2_{name}(const cuflash::ModifierParams* m, const int* bs, int n,'
            f" int Lq, int Lk, const float* s, float* out) {{"
            f" exp2_impl<{v}>(m, bs, n, Lq, Lk, s, out); }}")
    return "\n".join(out)


@functools.lru_cache(maxsize=None)
def _library():
    tmp = Path(tempfile.mkdtemp(prefix="cuflash_variant_"))
    (tmp / "v.cpp").write_text(_source(host=True) + _entry_points())
    run = subprocess.run(["g++", "-std=c++17", "-O1", "-shared", "-fPIC", "-o", str(tmp / "v.so"),
                          str(tmp / "v.cpp")], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[:5000]
    return ctypes.CDLL(str(tmp / "v.so"))


def _problem(name):
    """Modifiers, their keep-alive arrays and the float32 pipeline for config ``name``."""
    rng = numpy.random.default_rng(abs(hash(name)) % 2 ** 32)
    _, spec, causal = CONFIGS[name]
    kw = {}
    if "window" in spec:
        kw["window"] = spec["window"]
    if "softcap" in spec:
        kw["softcap"] = spec["softcap"]
    if spec.get("alibi"):
        kw["alibi_slopes"] = rng.uniform(0, 0.5, (H,)).astype(numpy.float32)
    if spec.get("sink"):
        sink = rng.standard_normal((B, 1)).astype(numpy.float32)
        sink[1, 0] = -numpy.inf
        kw["sink"] = sink
    if "bias" in spec:    # a transposed view: the kernel reads it through its strides
        bias = rng.standard_normal((H, LK, LQ)).astype(spec["bias"]).swapaxes(-1, -2)
        bias[0, 3, :] = -numpy.inf
        kw["bias"] = bias
    if spec.get("mask"):
        kw["mask"] = rng.random((B, 1, LQ, LK)) < 0.8
    for key in ("score_mod", "mask_mod"):
        if key in spec:
            kw[key] = spec[key]
    if "block_mask" in spec:
        kw["block_mask"] = block_mask(spec["block_mask"], (B, H), LQ, LK, block=(8, 4))
    mods = _modifiers.check_modifiers(xp=numpy, device_id=None, batch_shape=(B, H), Lq=LQ,
                                      Lk=LK, **kw)
    pipe = ScorePipeline(mods, causal=causal, causal_offset=CAUSAL_OFFSET, acc=numpy.float32)
    return mods, pipe, causal


def _pack(mods, tiles=(8, 4, 8)):
    """ModifierParams of ``mods`` over NumPy arrays; a block mask's lists for kernel tiles
    ``tiles`` = (m, n, sub)."""
    def strides(x):
        st = [s // x.itemsize for s in x.strides[:2]]
        return [0, 0] + st

    traces = {}
    if mods.score_mod is not None:
        traces["score_trace"] = _trace.trace_score_mod(mods.score_mod)
    if mods.mask_mod is not None:
        traces["mask_trace"] = _trace.trace_mask_mod(mods.mask_mod)
    lists = None
    if mods.block_mask is not None:
        tl = tile_lists(mods.block_mask, *tiles)
        lists = (tl, numpy.broadcast_to(tl.data, (B, H) + tl.data.shape[-1:]))
    p = _modifier_params.pack(mods, pointer=lambda x: x.ctypes.data, batch_strides=strides,
                              block_lists=lists, **traces)
    return numpy.array(p), lists


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
@pytest.mark.parametrize("name", CONFIGS)
def test_hooks_compute_what_the_numpy_pipeline_computes(name):
    lib = _library()
    mods, pipe, causal = _problem(name)
    params, keep = _pack(mods)
    rng = numpy.random.default_rng(1)
    s = (rng.standard_normal((B, H, LQ, LK)) * 3).astype(numpy.float32)
    ds = rng.standard_normal((B, H, LQ, LK)).astype(numpy.float32)
    bshape = numpy.array([1, 1, B, H], numpy.int32)
    out = [numpy.zeros(s.shape, t) for t in (numpy.float32, numpy.uint8, numpy.float32,
                                             numpy.float32)]
    rs = numpy.zeros((B * H, 2), numpy.float32)
    ptrs = [x.ctypes.data_as(ctypes.c_void_p) for x in (params, bshape)]
    getattr(lib, f"run_{name}")(ptrs[0], ptrs[1], B * H, LQ, LK, CAUSAL_OFFSET,
                                *(x.ctypes.data_as(ctypes.c_void_p) for x in (s, ds, *out, rs)))
    score, vis, grad, dbias = out
    saved: dict = {}
    want = numpy.broadcast_to(pipe.transform(s, 0, LQ, 0, LK, saved), s.shape)
    want_vis = pipe.visible(0, LQ, 0, LK)
    want_vis = numpy.ones(s.shape, bool) if want_vis is None else numpy.broadcast_to(want_vis,
                                                                                   s.shape)
    assert (vis.astype(bool) == want_vis).all()
    _close(score, want, "score")
    ds_qk, ds_bias = pipe.grad_scores(ds, saved, 0, LQ, 0, LK)
    _close(grad, numpy.broadcast_to(ds_qk, s.shape), "dL/ds")
    _close(dbias, numpy.zeros(s.shape) if ds_bias is None else ds_bias, "dbias")
    m0, l0 = pipe.row_start()
    assert (rs[:, 0] == m0.reshape(-1)).all() and (rs[:, 1] == l0.reshape(-1)).all()
    if name != "plain":
        assert not (vis.all() and numpy.array_equal(score, s))    # the config does something


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
@pytest.mark.parametrize("name", ["alibi_window", "plain"])
def test_alibi_in_the_base2_exponent_is_the_pipelines_score(name):
    """ModVariant::alibi_exp2 (bwd_sm90's plain path: ALiBi added to x = S tau log2(e) in the
    exponent of exp2) gives the NumPy pipeline's ALiBi score times log2(e), to float32
    rounding; without ALiBi it is the identity."""
    lib = _library()
    mods, pipe, causal = _problem(name)
    params, keep = _pack(mods)
    s = (numpy.random.default_rng(3).standard_normal((B, H, LQ, LK)) * 3).astype(numpy.float32)
    out = numpy.zeros(s.shape, numpy.float32)
    bshape = numpy.array([1, 1, B, H], numpy.int32)
    getattr(lib, f"exp2_{name}")(*(x.ctypes.data_as(ctypes.c_void_p) for x in (params, bshape)),
                                 B * H, LQ, LK, *(x.ctypes.data_as(ctypes.c_void_p) for x in (s, out)))
    want = numpy.broadcast_to(pipe.transform(s, 0, LQ, 0, LK, {}), s.shape).astype(
        numpy.float64) * numpy.log2(numpy.e)
    _close(out, want, "ALiBi in the exponent")
    if name == "plain":
        assert (out == s * numpy.float32(numpy.log2(numpy.e))).all()


def _close(ours, ref, what):
    ref = numpy.asarray(ref, numpy.float64)
    same_nonfinite = (numpy.isnan(ours) == numpy.isnan(ref)).all() and \
        (ours[numpy.isinf(ref)] == ref[numpy.isinf(ref)]).all()
    assert same_nonfinite, what
    fin = numpy.isfinite(ref)
    err = numpy.abs(ours[fin] - ref[fin]) / numpy.maximum(1.0, numpy.abs(ref[fin]))
    assert err.max(initial=0) <= 16 * numpy.finfo(numpy.float32).eps, (what, err.max())


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("bm, bn", [(8, 4), (5, 7), (16, 16), (64, 64)])
def test_tile_kinds_and_ranges_never_hide_a_visible_pair(name, bm, bn):
    lib = _library()
    mods, pipe, causal = _problem(name)
    params, keep = _pack(mods)
    Tq, Tk = -(-LQ // bm), -(-LK // bn)
    kinds = numpy.zeros((B * H, Tq, Tk), numpy.int32)
    kr, qr = numpy.zeros((Tq, 2), numpy.int32), numpy.zeros((Tk, 2), numpy.int32)
    bshape = numpy.array([1, 1, B, H], numpy.int32)
    getattr(lib, f"tiles_{name}")(*(x.ctypes.data_as(ctypes.c_void_p) for x in (params, bshape)),
                                  B * H, LQ, LK, CAUSAL_OFFSET, bm, bn,
                                  *(x.ctypes.data_as(ctypes.c_void_p) for x in (kinds, kr, qr)))
    vis = pipe.visible(0, LQ, 0, LK)
    vis = numpy.ones((B, H, LQ, LK), bool) if vis is None else numpy.broadcast_to(
        vis, (B, H, LQ, LK))
    vis = vis.reshape(B * H, LQ, LK)
    for a in range(Tq):
        rows = vis[:, a * bm:(a + 1) * bm]
        lo, hi = kr[a]
        assert not rows[:, :, :lo].any() and not rows[:, :, hi:].any()
        assert (lo, hi) == pipe.key_range(a * bm, min((a + 1) * bm, LQ))
        for c in range(Tk):
            t = rows[:, :, c * bn:(c + 1) * bn]
            k = kinds[:, a, c]
            assert not t[k == 0].any(), (a, c)          # empty: nothing visible
            assert t[k == 2].all(), (a, c)              # full: everything visible
    for c in range(Tk):
        lo, hi = qr[c]
        cols = vis[:, :, c * bn:(c + 1) * bn]
        assert not cols[:, :lo].any() and not cols[:, hi:].any()
        assert (lo, hi) == pipe.query_range(c * bn, min((c + 1) * bn, LK))
    if name in ("bands", "window_only") and (bm, bn) == (8, 4):   # the analytic skips happen
        assert (kinds == 0).any() and (kinds == 1).any()


BLOCK_MASK_CONFIGS = [n for n, (_, kw, _) in CONFIGS.items() if "block_mask" in kw]


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
@pytest.mark.parametrize("name", BLOCK_MASK_CONFIGS)
@pytest.mark.parametrize("tiles", [(8, 4, 8), (8, 4, 2), (5, 7, 5), (16, 16, 4), (3, 64, 1),
                                   (24, 12, 8)])
def test_tile_lists_hold_exactly_the_tiles_the_block_mask_does_not_call_empty(name, tiles):
    """Mod::tile_list / list_entry (the kernels' loops over key tiles in the forward, query
    tiles in the backward) on the lists built for kernel tiles of other sizes than the map's
    blocks (across and inside them; Lq, Lk not multiples): per query tile the key tiles with
    some row slice not empty, ascending, each slice's kind that of the slice's own tile; per
    key tile the query tiles, with the whole tile's kind; kListEnd past the count and from the
    end bound on. A tile left out has no visible pair; a slice called full has every pair
    visible."""
    m, n, sub = tiles
    lib = _library()
    mods, pipe, causal = _problem(name)
    params, keep = _pack(mods, tiles)
    Tq, Tk = -(-LQ // m), -(-LK // n)
    end = 0x7FFFFFFF
    vis = pipe.visible(0, LQ, 0, LK)
    vis = numpy.ones((B, H, LQ, LK), bool) if vis is None else numpy.broadcast_to(
        vis, (B, H, LQ, LK))
    vis = vis.reshape(B * H, LQ, LK)
    bm = mods.block_mask
    sub_kinds = numpy.broadcast_to(bm.tile_kinds(sub, n), (B, H) + (-(-LQ // sub), Tk))
    sub_kinds = sub_kinds.reshape((B * H,) + sub_kinds.shape[-2:])
    tile_kinds = numpy.broadcast_to(bm.tile_kinds(m, n), (B, H, Tq, Tk)).reshape(B * H, Tq, Tk)
    for kend, qend in ((Tk, Tq), (Tk // 2, Tq // 2)):
        kc, qc = numpy.zeros((B * H, Tq), numpy.int32), numpy.zeros((B * H, Tk), numpy.int32)
        ke = numpy.zeros((B * H, Tq, Tk + 1), numpy.int32)
        qe = numpy.zeros((B * H, Tk, Tq + 1), numpy.int32)
        bshape = numpy.array([1, 1, B, H], numpy.int32)
        getattr(lib, f"lists_{name}")(*(x.ctypes.data_as(ctypes.c_void_p) for x in (params, bshape)),
                             B * H, Tq, Tk, kend, qend,
                             *(x.ctypes.data_as(ctypes.c_void_p) for x in (kc, ke, qc, qe)))
        for it in range(B * H):
            for a in range(Tq):
                slices = [sub_kinds[it, s] if s < sub_kinds.shape[1] else numpy.zeros(Tk, int)
                          for s in range(a * (m // sub), (a + 1) * (m // sub))]
                want = [c for c in range(Tk) if any(k[c] for k in slices)]
                assert kc[it, a] == len(want)
                got = [e for e in ke[it, a] if e != end]
                assert [e >> LIST_SHIFT for e in got] == [c for c in want if c < kend], (it, a)
                for e in got:
                    c = e >> LIST_SHIFT
                    assert [(e >> 2 * s) & 3 for s in range(len(slices))] == [k[c] for k in slices]
                for c in set(range(Tk)) - set(want):   # left out: nothing visible
                    assert not vis[it, a * m:(a + 1) * m, c * n:(c + 1) * n].any(), (it, a, c)
                for s, k in enumerate(slices):         # full slices: everything visible
                    r0 = a * m + s * sub
                    for c in numpy.flatnonzero(k == 2):
                        assert vis[it, r0:r0 + sub, c * n:(c + 1) * n].all()
            for c in range(Tk):
                want = [a for a in range(Tq) if tile_kinds[it, a, c]]
                assert qc[it, c] == len(want)
                got = [e for e in qe[it, c] if e != end]
                assert [e >> LIST_SHIFT for e in got] == [a for a in want if a < qend], (it, c)
                assert [e & 3 for e in got] == [tile_kinds[it, e >> LIST_SHIFT, c] for e in got]
    if name == "blockdoc" and tiles == (8, 4, 8):   # the lists leave something out
        assert (kc < Tk).any() and (qc < Tq).any()


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_the_instantiations_compile_with_nvrtc(arch):
    try:
        nvrtc = _jit._nvrtc_for(arch)
    except _jit.KernelCompileError as exc:
        pytest.skip(str(exc))
    kernels = []
    for name, (args, _, _) in CONFIGS.items():
        kernels.append(
            f"__global__ void probe_{name}(const cuflash::ModifierParams m, const int* bs, "
            f"float* out) {{\n"
            f"  using V = cuflash::ModVariant<{args}>;\n"
            f"  typename V::Item it = V::item(m, bs, blockIdx.x);\n"
            f"  float mx, l, db; V::row_start(it, mx, l);\n"
            f"  int lo, hi; V::key_range(m, 0, 64, 0, 16, lo, hi);\n"
            f"  const int i = threadIdx.x, j = threadIdx.y;\n"
            f"  float s = V::score(m, it, out[i], i, j);\n"
            f"  if (V::tile_kind(m, it, 0, 0, 16, lo, hi) == cuflash::kTilePartial && "
            f"!V::visible(m, it, 0, i, j)) s = mx;\n"
            f"  out[i] = s + l + V::grad(m, it, s, out[j], i, j, db) + db"
            f" + probe_lists<V>(m, it, lo, hi);\n}}")
    probe = ("template <class V, class It> __device__ int probe_lists(const cuflash::ModifierParams& m,"
             " const It& it, int lo, int hi) {\n  int c0, c1;\n"
             "  const int* a = V::template tile_list<true>(m, it, lo, c0);\n"
             "  const int* b = V::template tile_list<false>(m, it, hi, c1);\n"
             "  return V::entry_tile(V::list_entry(a, 1, hi))"
             " + V::entry_kind(V::list_entry(b, 0, lo), 1);\n}\n")
    src = _source(host=False) + "\n" + probe + "\n".join(kernels)
    log, lowered, _ = nvrtc.compile(src, "variant_probe.cu",
                                    [f"probe_{n}" for n in CONFIGS], _jit._options(arch))
    assert lowered is not None, log[:5000]


def test_modifier_params_layout_matches_the_struct():
    """MODIFIER_PARAMS mirrors cuflash::ModifierParams field for field."""
    from _layout import assert_struct_matches
    assert_struct_matches("modifiers.cuh", "cuflash", "ModifierParams",
                          _modifier_params.MODIFIER_PARAMS)


@pytest.mark.parametrize("name", ["all", "blockmask", "bands", "window_only", "plain"])
def test_template_arguments_spell_the_configurations(name):
    mods, _, causal = _problem(name)
    traces = _traces()
    got = _modifier_params.template_arguments(
        mods, causal=causal,
        score_trace=traces["SM1" if name == "all" else "SM2"],
        mask_trace=traces["MM1" if name == "all" else "MM2"])
    want = CONFIGS[name][0]
    for alias, tr in traces.items():
        want = want.replace(alias, _trace_cuda.qualified_name(tr))
    defaults = ["false", "false", "false", "false", "void", "false", "cuflash::NoScoreMod",
                "cuflash::NoMaskMod", "false", "false"]
    given_ = [a.strip() for a in want.split(",")] if want else []
    assert got.split(", ") == given_ + defaults[len(given_):]


def test_half_and_bfloat16_bias_compile_with_nvrtc():
    try:
        nvrtc = _jit._nvrtc_for("sm_80")
    except _jit.KernelCompileError as exc:
        pytest.skip(str(exc))
    src = ("#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n" + _jit.load_source("modifiers.cuh")
           + "".join(f"""
__global__ void probe_{n}(const cuflash::ModifierParams m, const int* bs, float* out) {{
  using V = cuflash::ModVariant<false, false, false, false, {t}>;
  typename V::Item it = V::item(m, bs, blockIdx.x);
  float db;
  out[threadIdx.x] = V::score(m, it, out[threadIdx.x], threadIdx.x, 0)
                     + V::grad(m, it, 1.0f, out[0], threadIdx.x, 0, db) + db;
}}""" for n, t in (("h", "__half"), ("bf", "__nv_bfloat16"))))
    log, lowered, _ = nvrtc.compile(src, "bias_probe.cu", ["probe_h", "probe_bf"],
                                    _jit._options("sm_80"))
    assert lowered is not None, log[:4000]



def test_params_ends_with_the_modifier_params():
    """_launch.PARAMS carries ModifierParams as ``mod``, after every field plain attention
    reads, then only the fused dQ finishing's pointer ``dq``; both mirrored."""
    from cuflash import _launch
    from _layout import assert_struct_matches
    assert _launch.PARAMS.names[-2:] == ("mod", "dq")
    assert_struct_matches("common.cuh", "cuflash", "Params", _launch.PARAMS,
                          nested={"var": "VariantParams", "mod": "ModifierParams"})


#: every built-in modifier on (a bf16 bias for the half kernels, float for fwd_simt's float32)
def _all_builtins(bias: str):
    from cuflash._variant import Variant
    return Variant(causal=True, window=True, softcap=True, alibi_slopes=True, bias=bias,
                   mask=True, sink=True)


@pytest.mark.slow
@pytest.mark.parametrize("family, arch, dtype, bias", [
    ("fwd_sm80", "sm_80", "bfloat16", "__nv_bfloat16"),
    ("fwd_sm90", "sm_90a", "bfloat16", "__nv_bfloat16"),
    ("fwd_simt", "sm_80", "float32", "float"),
])
def test_every_builtin_modifier_at_once_compiles_without_spills(family, arch, dtype, bias):
    """One specialisation per forward family with all built-in modifiers on (the compile gate
    keeps its default set, without modifier variants): NVRTC compiles it with 0 spills and no
    stack, for the tile choice the dispatcher makes at d = 128 (64 for fwd_simt)."""
    from cuflash import _families
    fam = _families.FAMILIES[family]
    dev = _families.PROFILES["h200" if arch == "sm_90a" else "a100"]
    d = 64 if family == "fwd_simt" else 128
    shape = _families.Shape(dtype, 16, 4096, 4096, d, d, _all_builtins(bias))
    traits, flags, _ = fam.select(fam, shape, dev)
    expr = fam.expr(dtype, traits, shape.variant, **flags)
    (report,) = _jit.compile_offline(fam.source, [expr], arch)
    assert report.error is None, report.error[:3000]
    assert report.ok, report


@pytest.mark.slow
def test_bwd_sm90_compiles_every_built_in_combination_it_claims_without_spills():
    """_traits.BWD_SM90_MODIFIERS is what the dispatcher sends to bwd_sm90 on Hopper: every
    combination of the built-ins of each of a bucket's sets (causal and not, bf16, the
    dispatcher's tiles at L = 4096) compiles with 0 spills and no stack for sm_90a (the user
    functions depend on the user's code: bench/NOTES.md has the sweep with sample ones)."""
    import itertools
    from cuflash import _families, _traits
    from cuflash._variant import Variant
    fam, dev = _families.FAMILIES["bwd_sm90"], _families.PROFILES["h200"]
    exprs = {}
    every = [(bucket, feats, (True, False)) for bucket, sets in _traits.BWD_SM90_MODIFIERS.items()
             for feats in sets]
    every += [(bucket, feats, (False,)) for bucket, sets in _traits.BWD_SM90_MODIFIERS_NONCAUSAL.items()
              for feats in sets]
    for bucket, feats, causals in every:
        built = sorted(feats - {"score_mod", "mask_mod"})
        for n, causal in itertools.product(range(1, len(built) + 1), causals):
            for combo, tanh in itertools.product(itertools.combinations(built, n), (True, False)):
                # (softcap at d = 128 without causal spilled 56 bytes until session 8 took
                # its tanh once; both softcap builds, CUFLASH_SOFTCAP_TANH, are compiled)
                if not tanh and "softcap" not in combo:
                    continue
                kw = {f: ("__nv_bfloat16" if f == "bias" else True) for f in combo}
                shape = _families.Shape("bfloat16", 16, 4096, 4096, bucket, bucket,
                                        Variant(causal=causal, softcap_tanh=tanh, **kw))
                choice = _families.choose("bwd", shape, dev)
                assert choice.family is fam, (combo, choice.reasons)
                exprs[choice.expr] = (bucket, causal, combo, tanh)
                if combo == ("softcap",) and tanh:   # session 10's default: the plain path
                    shape = _families.Shape("bfloat16", 16, 4096, 4096, bucket, bucket, Variant(
                        causal=causal, softcap=True, softcap_fixed=True, softcap_bwd_plain=True))
                    choice = _families.choose("bwd", shape, dev)
                    assert choice.family is fam, (combo, choice.reasons)
                    exprs[choice.expr] = (bucket, causal, combo, "plain path")
    reports = _jit.compile_offline(fam.source, list(exprs), "sm_90a", sass=False)
    bad = [(exprs[r.expr], r.error or (r.registers, r.spill_stores, r.spill_loads, r.stack))
           for r in reports if not r.ok]
    assert not bad, bad


def test_the_plans_pack_and_patch_the_modifiers_as_the_emulation_does():
    """_plan's modifier packing (the GPU path, which CI cannot launch) gives the Params.mod the
    emulated kernels were checked with, and its patch words land on the pointer fields."""
    import sys
    sys.path.insert(0, str(Path(__file__).parent))
    import _emu_sm80 as emu
    from cuflash import _launch, _plan, _problem
    rng = numpy.random.default_rng(0)
    q = rng.standard_normal((2, 3, 40, 16)).astype(numpy.float16)
    k = rng.standard_normal((1, 3, 50, 16)).astype(numpy.float16)
    kw = dict(bias=rng.standard_normal((3, 40, 50)).astype(numpy.float32), window=(7, None),
              mask=rng.random((2, 1, 40, 50)) < 0.5, softcap=3.0,
              alibi_slopes=numpy.ones(3, numpy.float32), sink=numpy.zeros((2, 3), numpy.float32),
              score_mod=lambda s, b, h, i, j: s + TAB[h % 3, 1])
    prob = _problem.make_problem(q, k, k, scale=None, causal=True)
    mods = emu.modifiers_of(prob, **kw)
    o = numpy.empty((2, 3, 40, 16), numpy.float16)
    ours = _plan.ModifierPatch(prob, mods)
    tensors = {"q": prob.q, "k": prob.k, "v": prob.v, "o": o}
    layout = _launch.batch_layout(prob.batch_shape, list(tensors.values()) + ours.arrays(mods))
    p = _launch.pack(prob, tensors, layout, emu.variant_params(prob))
    ours.pack_into(p, layout, len(tensors), mods)
    ref, _ = emu.pack_params(prob, dict(tensors), mods=mods)
    for name in MODIFIER_FIELDS_COMPARED:
        assert (p["mod"][name] == ref["mod"][name]).all(), name
    assert (p["mod"]["captured"]["shape"] == ref["mod"]["captured"]["shape"]).all()
    assert (p["mod"]["captured"]["stride"] == ref["mod"]["captured"]["stride"]).all()
    # the words a call patches are the pointer fields
    buf = numpy.zeros(-(-p.nbytes // 8), numpy.uint64)
    words = [(ours.word[n], 1000 + i) for i, n in enumerate(ours.names)]
    words += [(ours.dbias_word, 7), (ours.captured_words[0], 9)]
    for w, val in words:
        buf[w] = val
    back = numpy.frombuffer(buf.tobytes()[:p.nbytes], _launch.PARAMS)[0]["mod"]
    assert [int(back[n]) for n in ours.names] == [1000, 1001, 1002, 1003]
    assert int(back["dbias"]) == 7 and int(back["captured"][0]["ptr"]) == 9


MODIFIER_FIELDS_COMPARED = ("bias_batch_stride", "mask_batch_stride", "slope_batch_stride",
                            "sink_batch_stride", "bias_row", "bias_col", "mask_row", "mask_col",
                            "softcap", "inv_softcap", "window_left", "window_right", "diag",
                            "heads", "batch_base", "mask_mod_captured_base")


def test_ex2_poly_is_as_accurate_as_ex2_approx():
    """online_softmax.cuh's ex2_poly (2^x on the FMA pipe, for a share of the softcap's softmax
    exponentials): its coefficients, read from the source and evaluated in float32 by Horner's
    rule, keep the relative error of 2^f on [-1/2, 1/2] under 2.5e-7. The row sum l, so lse,
    carries it unrounded (session 9's campaign found lse 10x off its bound with the degree-3
    fit's 7.5e-5)."""
    import pathlib
    import re
    src = (pathlib.Path(__file__).parent.parent / "cuda_src" / "online_softmax.cuh").read_text()
    body = src[src.index("float ex2_poly(float x)"):]
    body = body[:body.index("return")]
    line = body[body.index("const float p"):body.index(";", body.index("const float p"))]
    coeffs = [float(c) for c in re.findall(r"([0-9]*\.[0-9]+)f", line)]
    assert len(coeffs) == 6, f"expected a degree-5 fit, read {coeffs} from {line!r}"
    # fmaf(fmaf(c5, f, c4), f, c3) ...: the first literal is the highest power
    f = numpy.linspace(-0.5, 0.5, 100001).astype(numpy.float32)
    p = numpy.full_like(f, numpy.float32(coeffs[0]))
    for c in coeffs[1:]:
        p = (p.astype(numpy.float64) * f + numpy.float32(c)).astype(numpy.float32)
    err = numpy.abs(p.astype(numpy.float64) / numpy.exp2(f.astype(numpy.float64)) - 1).max()
    assert err < 2.5e-7, f"ex2_poly's relative error {err:.3g} (coefficients {coeffs})"


@pytest.mark.parametrize("causal, Lq, Lk, raw", [
    (True, 40, 24, True), ("bottom_right", 24, 40, True), ("top_left", 24, 40, True),
    ("top_left", 24, 24, True), ("top_left", 40, 24, False), (False, 40, 24, True)])
def test_alibi_raw_units_only_where_the_row_offset_holds(causal, Lq, Lk, raw, monkeypatch):
    """ALiBi's raw-units build (``ALIBI`` = 1) under causal may assume every visible pair lies
    left of the ALiBi diagonal (fwd_sm90ws carries its row term in the softmax, variant.cuh
    ``kAlibiRowOffset``); top-left causal with Lq > Lk breaks that, so the host gives it the
    natural-units build (``ALIBI`` = 2), which keeps |i + Lk - Lq - j|. ``CUFLASH_ALIBI_ROW_OFFSET=0``
    puts the A/B switch in the Variant's prelude."""
    from cuflash import _problem, _variant
    monkeypatch.delenv("CUFLASH_ALIBI_RAW", raising=False)
    monkeypatch.delenv("CUFLASH_ALIBI_ROW_OFFSET", raising=False)
    q = numpy.zeros((1, 2, Lq, 16), numpy.float32)
    k = numpy.zeros((1, 2, Lk, 16), numpy.float32)
    prob = _problem.make_problem(q, k, k, scale=None, causal=causal)
    mods = _modifiers.check_modifiers(xp=numpy, device_id=None, batch_shape=prob.batch_shape,
                                      Lq=Lq, Lk=Lk, alibi_slopes=numpy.ones((2,), numpy.float32))
    v = _variant.variant_of(prob, mods)
    assert v.alibi_raw is raw
    assert (", true, void," if raw else ", 2, void,") in v.cpp
    assert "CUFLASH_ALIBI_ROW_OFFSET" not in v.prelude
    monkeypatch.setenv("CUFLASH_ALIBI_ROW_OFFSET", "0")
    assert "#define CUFLASH_ALIBI_ROW_OFFSET 0\n" in _variant.variant_of(prob, mods).prelude
