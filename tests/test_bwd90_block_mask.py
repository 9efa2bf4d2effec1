"""The d = 128 block-mask backward on bwd_sm90 (session 10; bench/NOTES.md "The d = 128
block-mask backward on bwd_sm90 (session 10)"), without a GPU: the dispatcher's choice and its
switch, the local-memory fallback, the builds of the mods suite's mask_mods (0 spills), and
bwd_io::mask_bits (the element mask as bits, bwd_sm90.cu kMaskBits) compiled for the host with
g++ against brute force and against select_visible's layout. The kernel itself runs in
tests/test_gpu_block_mask_bwd128.py."""
from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy
import pytest

from cuflash import _families, _jit, _trace, _trace_cuda
from cuflash._variant import Variant

ROOT = Path(__file__).resolve().parents[1]
H200 = _families.PROFILES["h200"]


def _documents(size):
    return lambda b, h, q, kv: ((q // size) == (kv // size)) & (q >= kv)


def _shape(mask_mod=_documents(512), d=128, causal=True, deterministic=False, L=4096, **more):
    tr = _trace.trace_mask_mod(mask_mod)
    v = Variant(causal=causal, mask_mod=_trace_cuda.qualified_name(tr), block_mask=True,
                prelude=tr.source, **more)
    return _families.Shape("bfloat16", 64, L, L, d, d, v, deterministic)


def test_a_block_mask_at_d128_runs_bwd_sm90_and_the_switch_restores_bwd_sm80(monkeypatch):
    monkeypatch.delenv("CUFLASH_BWD90_BLOCK_MASK", raising=False)
    for causal in (True, False):
        c = _families.choose("bwd", _shape(causal=causal), H200)
        assert c.family.name == "bwd_sm90" and c.traits.block_m == 64, c.reasons
        assert any("as bits" in r for r in c.reasons)
    # what stays on bwd_sm80: deterministic, a transform beside the mask_mod
    assert _families.choose("bwd", _shape(deterministic=True), H200).family.name == "bwd_sm80"
    assert _families.choose("bwd", _shape(softcap=True), H200).family.name == "bwd_sm80"
    # d = 64: bwd_sm90 either way (the mask as bits in 128-row tiles: the next test)
    c64 = _families.choose("bwd", _shape(d=64), H200)
    assert c64.family.name == "bwd_sm90" and c64.traits.block_m == 128
    monkeypatch.setenv("CUFLASH_BWD90_BLOCK_MASK", "0")
    assert _families.choose("bwd", _shape(), H200).family.name == "bwd_sm80"
    assert _families.choose("bwd", _shape(d=64), H200).family.name == "bwd_sm90"
    monkeypatch.setenv("CUFLASH_BWD90_BLOCK_MASK", "2")
    with pytest.raises(ValueError, match="CUFLASH_BWD90_BLOCK_MASK"):
        _families.choose("bwd", _shape(), H200)


def test_a_build_that_uses_local_memory_goes_back_to_bwd_sm80(monkeypatch):
    monkeypatch.delenv("CUFLASH_BWD90_BLOCK_MASK", raising=False)
    kernels = []

    class Kernel:
        local_size_bytes = 0

    monkeypatch.setattr(_jit, "get_kernel", lambda *a: kernels.append(a) or Kernel)
    from cuflash import _spills
    monkeypatch.setattr(_spills, "BWD90_BLOCK_MASK_SPILLED", set())
    shape = _shape(_documents(7))
    c = _families.choose("bwd", shape, H200)
    assert c.family.name == "bwd_sm90"
    assert not _families.block_mask_bwd_spilled(c, shape, 0) and kernels[-1][1] == c.expr
    Kernel.local_size_bytes = 16
    assert _families.block_mask_bwd_spilled(c, shape, 0)
    again = _families.choose("bwd", shape, H200)
    assert again.family.name == "bwd_sm80"
    assert not _families.block_mask_bwd_spilled(again, shape, 0)
    # d = 64 with CUFLASH_BWD90_BMASK_ROWS=64: not checked (the per-element path, no fallback)
    monkeypatch.setenv("CUFLASH_BWD90_BMASK_ROWS", "64")
    s64 = _shape(_documents(7), d=64)
    assert not _families.block_mask_bwd_spilled(_families.choose("bwd", s64, H200), s64, 0)
    assert len(kernels) == 2


def test_d64_keeps_128_row_tiles_and_goes_back_when_it_spills(monkeypatch):
    """At d = 64 a block mask's mask_mod alone keeps bwd_sm90's 128-row tiles (the mask as 64
    bits; ``CUFLASH_BWD90_BMASK_ROWS=64``: session 9's 64-row tiles, the per-element path);
    with softcap beside it, or without a block mask, 64 rows; a build that used local memory
    goes back to 64 rows."""
    monkeypatch.delenv("CUFLASH_BWD90_BMASK_ROWS", raising=False)
    shape = _shape(_documents(7), d=64)
    c = _families.choose("bwd", shape, H200)
    assert c.family.name == "bwd_sm90" and c.traits.block_m == 128
    assert any("as bits" in r for r in c.reasons)
    assert _families.choose("bwd", _shape(d=64, softcap=True), H200).traits.block_m == 64
    assert _families.choose("bwd", _shape(), H200).traits.block_m == 64      # d = 128: its table's
    tr = _trace.trace_mask_mod(_documents(7))
    no_bm = _families.Shape("bfloat16", 64, 4096, 4096, 64, 64, Variant(
        causal=True, mask_mod=_trace_cuda.qualified_name(tr), prelude=tr.source))
    assert _families.choose("bwd", no_bm, H200).traits.block_m == 64
    monkeypatch.setenv("CUFLASH_BWD90_BMASK_ROWS", "64")
    c64 = _families.choose("bwd", shape, H200)
    assert c64.traits.block_m == 64 and not any("as bits" in r for r in c64.reasons)
    monkeypatch.delenv("CUFLASH_BWD90_BMASK_ROWS")

    class Kernel:
        local_size_bytes = 8

    monkeypatch.setattr(_jit, "get_kernel", lambda *a: Kernel)
    from cuflash import _spills
    monkeypatch.setattr(_spills, "BWD90_BLOCK_MASK_SPILLED", set())
    assert _families.block_mask_bwd_spilled(c, shape, 0)
    again = _families.choose("bwd", shape, H200)
    assert again.family.name == "bwd_sm90" and again.traits.block_m == 64
    assert not _families.block_mask_bwd_spilled(again, shape, 0)
    monkeypatch.setenv("CUFLASH_BWD90_BMASK_ROWS", "96")
    with pytest.raises(ValueError, match="CUFLASH_BWD90_BMASK_ROWS"):
        _families.choose("bwd", _shape(d=64), H200)


def test_the_suites_mask_mods_compile_without_spills_at_d128():
    """The mods suite's window, document and prefix mask_mods (bench/suite_mods.py at L = 4096),
    causal or not: the dispatcher's bwd_sm90 build at d = 128 has 0 spills and no stack on
    sm_90a, and so has the d = 64 128-row build of the suite's own calls
    (bench/probes/bmask_spills.py prints the testing kit's too)."""
    sys.path.insert(0, str(ROOT / "bench"))
    import suite_mods
    exprs, preludes = {}, []
    for name in ("window", "document", "prefix"):
        mod = suite_mods.mods_for(4096, 16)[name]
        for causal in (True, False):
            shape = _shape(mod.mask_mod, causal=causal)
            c = _families.choose("bwd", shape, H200)
            assert c.family.name == "bwd_sm90", c.reasons
            exprs[c.expr] = (name, causal)
            preludes.append(shape.variant.prelude)
        # (and d = 64's 128-row build of the suite's own call: causal as the suite passes it)
        shape = _shape(mod.mask_mod, d=64, causal=mod.mask_causal)
        c = _families.choose("bwd", shape, H200)
        assert c.traits.block_m == 128, c.reasons
        exprs[c.expr] = (name, "d 64")
    fam = _families.FAMILIES["bwd_sm90"]
    nvrtc = _jit._nvrtc_for("sm_90a")
    log, lowered, _ = nvrtc.compile("\n".join(dict.fromkeys(preludes)) + _jit.load_source(fam.source), fam.source,
                                    list(exprs), _jit._options("sm_90a", ("--ptxas-options=-v",)))
    assert lowered is not None, log[:2000]
    for expr, what in exprs.items():
        res = _jit._parse_ptxas(log, lowered[expr])
        assert (res.get("spill_stores"), res.get("spill_loads"), res.get("stack")) == (0, 0, 0), (what, res)


# -- bwd_io::mask_bits on the host -----------------------------------------------------------

HARNESS = r"""
#include <string.h>
#define __device__
#define __forceinline__ inline
struct ModP { int doc; };
struct VarP { int causal_offset; };
struct P { ModP mod; VarP var; int Lq, Lk; };
struct It {};
// documents of m.doc positions, causal within (rows and keys clamped as Variant::pair_visible)
template <bool KEY_LO> struct FakeVar {
  static constexpr bool kKeyLo = KEY_LO;
  static It at_row(const ModP&, const It& it, int, int) { return it; }
  static bool pair_visible(const ModP& m, const It&, int, int i, int j, int Lq, int Lk) {
    i = i < Lq - 1 ? i : Lq - 1;
    j = j < Lk - 1 ? j : Lk - 1;
    return i / m.doc == j / m.doc && j <= i;
  }
};
namespace bwd_io {
%s
}
template <bool KL, int NT>
static void run(const P& p, int q0, int kj0, const int* f, const int* l, int pair_tile,
                unsigned long long* bits, float* sel_bits, float* sel_vis) {
  using Bits = typename bwd_io::MaskWord<4 * NT>::type;
  const int first[2] = {f[0], f[1]}, last[2] = {l[0], l[1]};
  const Bits keep = bwd_io::mask_bits<FakeVar<KL>, NT, Bits>(p, It{}, q0, kj0, first, last, pair_tile != 0);
  *bits = keep;
  float a[NT][4], b[NT][4];
  for (int t = 0; t < NT; ++t)
    for (int e = 0; e < 4; ++e) a[t][e] = b[t][e] = 1.f + t * 4 + e;
  bwd_io::select_bits(a, keep);
  bwd_io::select_visible<KL>(b, first, last);
  memcpy(sel_bits, a, sizeof a);
  memcpy(sel_vis, b, sizeof b);
}
extern "C" void mask_bits_host(int nt, int key_lo, int doc, int Lq, int Lk, int q0, int kj0,
                               const int* f, const int* l, int pair_tile, unsigned long long* bits,
                               float* sb, float* sv) {
  P p{{doc}, {0}, Lq, Lk};
  if (nt == 8) {
    if (key_lo) run<true, 8>(p, q0, kj0, f, l, pair_tile, bits, sb, sv);
    else run<false, 8>(p, q0, kj0, f, l, pair_tile, bits, sb, sv);
  } else {
    if (key_lo) run<true, 16>(p, q0, kj0, f, l, pair_tile, bits, sb, sv);
    else run<false, 16>(p, q0, kj0, f, l, pair_tile, bits, sb, sv);
  }
}
"""


def _host_library():
    src = (ROOT / "cuda_src" / "bwd_io.cuh").read_text()
    start = src.index("// x = 0 where the pair (key row, query column) of an S^T-layout fragment")
    end = src.index("// -- 11 and 14 of Algorithm 2 for one pair")
    tmp = Path(tempfile.mkdtemp(prefix="cuflash_mask_bits_"))
    (tmp / "m.cpp").write_text(HARNESS % src[start:end])
    run = subprocess.run(["g++", "-std=c++17", "-O1", "-shared", "-fPIC", "-o", str(tmp / "m.so"),
                          str(tmp / "m.cpp")], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[:5000]
    return ctypes.CDLL(str(tmp / "m.so"))


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_mask_bits_are_the_bounds_and_the_mask_mod_of_each_element():
    """Thread (g, t4) of warp `warp` in bwd_sm90's S^T fragment: element (t, e) is query m0 +
    2 t4 + 8 t + (e & 1), key kw0 + g + 8 (e >> 1). Its bit is set exactly where the pair is
    within first / last (relative to column 2 t4, as the kernel computes them: causal here, a
    window's left end with key_lo) and, in a tile not known full, the mask_mod keeps it;
    select_bits keeps exactly those elements, and without the mask_mod it selects what
    select_visible selects."""
    lib = _host_library()
    ip = ctypes.POINTER(ctypes.c_int)
    fp = ctypes.POINTER(ctypes.c_float)
    lib.mask_bits_host.argtypes = [ctypes.c_int] * 7 + [ip, ip, ctypes.c_int,
                                                        ctypes.POINTER(ctypes.c_ulonglong), fp, fp]
    rng = numpy.random.default_rng(0)
    doc, Lq, Lk = 37, 300, 290
    for it in range(600):
        nt = 8 if it % 3 else 16       # 64-row tiles (32 bits), 128-row tiles (64 bits, d = 64)
        key_lo, pair_tile = int(rng.integers(2)), int(rng.integers(2))
        m0, kw0 = int(rng.integers(0, 5)) * 64, int(rng.integers(0, 3)) * 128 + 16 * int(rng.integers(4))
        g, t4 = int(rng.integers(8)), int(rng.integers(4))
        keys = [kw0 + g, kw0 + g + 8]
        # causal (key <= query) as first; a window of 40 to the left as last, with key_lo
        first = numpy.array([(1 << 30) if k >= Lk else k - m0 - 2 * t4 for k in keys], numpy.int32)
        last = numpy.array([k + 40 - m0 - 2 * t4 for k in keys], numpy.int32)
        bits = ctypes.c_ulonglong()
        sb, sv = numpy.zeros(4 * nt, numpy.float32), numpy.zeros(4 * nt, numpy.float32)
        lib.mask_bits_host(nt, key_lo, doc, Lq, Lk, m0 + 2 * t4, kw0 + g,
                           first.ctypes.data_as(ip), last.ctypes.data_as(ip), pair_tile,
                           ctypes.byref(bits), sb.ctypes.data_as(fp), sv.ctypes.data_as(fp))
        for t in range(nt):
            for e in range(4):
                qi, kj = m0 + 2 * t4 + 8 * t + (e & 1), kw0 + g + 8 * (e >> 1)
                c = 8 * t + (e & 1)
                vis = c >= first[e >> 1] and (not key_lo or c <= last[e >> 1])
                if pair_tile:
                    qc, kc = min(qi, Lq - 1), min(kj, Lk - 1)
                    vis = vis and qc // doc == kc // doc and kc <= qc
                assert bool((bits.value >> (4 * t + e)) & 1) == vis, (nt, t, e, qi, kj)
                assert sb[4 * t + e] == (1.0 + 4 * t + e if vis else 0.0)
        if not pair_tile:
            assert (sb == sv).all()
