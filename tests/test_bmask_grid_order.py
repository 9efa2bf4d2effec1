"""The grid order of a block mask without causal (session 11, bench/NOTES.md "The prefix-LM
block mask at 4k: tile-major order and dQ in rows (session 11)"): forward and backward run
tile-major by default (``_variant.bmask_tile_major``); ``CUFLASH_BMASK_TILE_MAJOR=bwd`` (plan
time) runs the forward batch-major again, ``none`` both; plain attention and causal calls keep
their orders. Without a GPU: the plan's choice of order, the makespan model that predicts the
gain (bench/probes/bmask_bwd128.py --model), and (``slow``) fwd_sm80 and bwd_sm80 -- whose
blocks map to (batch item, tile) through the same common.cuh grid_tile as fwd_sm90 / bwd_sm90
-- run in the host emulation in both orders with a prefix-LM block mask, against the reference
by the kit's rule. And dQ's additions in rows (bwd_io::red_row_pairs, bwd_sm90's block-mask
builds where d is the head-dim bucket): against red_add2's columns with g++, and the macro
that turns them off (``_variant.DQ_BOUNDS``). The kernels themselves on the GPU:
tests/test_gpu_block_mask_bwd128.py."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy
import pytest

from cuflash import _families, _plan, _problem
from cuflash._families import PROFILES, Shape
from cuflash._variant import Variant

ROOT = Path(__file__).resolve().parents[1]
H200 = PROFILES["h200"]


def _choose(kind, causal, block_mask, d=128, det=False):
    v = Variant(causal=causal, mask_mod="cuflash::user::m" if block_mask else None,
                block_mask=block_mask)
    shape = Shape("bfloat16", 64, 4096, 4096, d, d, v, det) if kind == "bwd" else \
        Shape("bfloat16", 64, 4096, 4096, d, d, v)
    return _families.choose(kind, shape, H200)


def test_a_block_mask_without_causal_runs_tile_major(monkeypatch):
    """``CUFLASH_BMASK_TILE_MAJOR=both`` (session 11; the default since session 12's H200 run;
    "none" session 10's batch-major orders): tile-major for a block mask without causal."""
    for name in ("CUFLASH_BMASK_TILE_MAJOR", "CUFLASH_GRID_ORDER"):
        monkeypatch.delenv(name, raising=False)
    for d in (64, 128):
        bwd, fwd = _choose("bwd", False, True, d), _choose("fwd", False, True, d)
        assert bwd.family.name == "bwd_sm90" and fwd.family.name == "fwd_sm90"
        for c in (fwd, bwd):
            assert _plan.grid_order(c, False, True) == 1          # the default: "both"
        monkeypatch.setenv("CUFLASH_BMASK_TILE_MAJOR", "both")
        for c in (fwd, bwd):
            assert _plan.grid_order(c, False, True) == 1          # the switch
            assert _plan.grid_order(c, False, False) == 0         # plain: unchanged
            assert _plan.grid_order(c, True, True) == 1           # causal: as before
            assert _plan.grid_order(c, True, False) == 1
        monkeypatch.setenv("CUFLASH_BMASK_TILE_MAJOR", "bwd")     # the backward only
        assert _plan.grid_order(bwd, False, True) == 1
        assert _plan.grid_order(fwd, False, True) == 0
        monkeypatch.setenv("CUFLASH_BMASK_TILE_MAJOR", "none")    # session 10's orders
        assert _plan.grid_order(bwd, False, True) == 0
        assert _plan.grid_order(fwd, False, True) == 0
        assert _plan.grid_order(bwd, True, True) == 1
        monkeypatch.setenv("CUFLASH_GRID_ORDER", "0")             # the A/B override wins
        monkeypatch.setenv("CUFLASH_BMASK_TILE_MAJOR", "both")
        assert _plan.grid_order(bwd, False, True) == 0
        monkeypatch.delenv("CUFLASH_GRID_ORDER")
        monkeypatch.delenv("CUFLASH_BMASK_TILE_MAJOR")
    # batch-major by construction (bwd_sm80: deterministic relies on it)
    det = _choose("bwd", False, True, 64, det=True)
    assert det.family.name == "bwd_sm80" and _plan.grid_order(det, False, True) == 0
    monkeypatch.setenv("CUFLASH_BMASK_TILE_MAJOR", "fwd")
    with pytest.raises(ValueError, match="CUFLASH_BMASK_TILE_MAJOR"):
        _plan.grid_order(_choose("bwd", False, True), False, True)


def test_the_makespan_model_puts_tile_major_at_the_bound_for_prefix():
    """The probe's model (132 SMs, one block an SM, block = F + t x query tiles, in grid
    order): batch-major leaves prefix-LM's last batch item's long blocks as the tail; tile-major
    is longest-first there (key tile 0..7 see every query tile, then fewer), within 1% of the
    bound; documents (causal) are tile-major already."""
    sys.path[:0] = [str(ROOT / "bench" / "probes"), str(ROOT / "bench")]
    import bmask_bwd128 as probe
    for d in (64, 128):
        for L in (4096, 16384):
            m = probe.model("prefix", d, L)
            assert m["tm"] < m["bm"] and m["tm"] <= 1.01 * m["bound"], m
            assert m["bm"] - m["tm"] > 0.02 * m["bm"] or L == 16384, m
    # the fit to session 10's measured gain (new_tm - new, fwd+bwd): d 128 4k 0.170 ms
    m = probe.model("prefix", 128, 4096)
    assert 0.10 < (m["bm"] - m["tm"]) / 1e3 < 0.20, m


@pytest.mark.slow
def test_emulated_kernels_are_right_in_either_grid_order():
    """fwd_sm80 and bwd_sm80 (host emulation) with a prefix-LM block mask, not causal, 6 batch
    items of ragged length: o, lse and the gradients right in batch-major and tile-major
    order (every (batch item, tile) run once: dk, dv start as NaN)."""
    import ml_dtypes
    import _emu_sm80 as emu
    import _naive_modifiers as naive
    import cuflash
    from cuflash._block_mask import block_mask
    from _inputs import make_array
    if not emu.available():
        pytest.skip("g++ is needed for the emulation")
    bf16 = numpy.dtype(ml_dtypes.bfloat16)
    L, n = 300, 70
    rng = numpy.random.default_rng(5)
    q, k, v = (make_array(rng, (2, 3, L, 64), bf16) for _ in range(3))
    kw = {"block_mask": block_mask(lambda b, h, qi, kv: (kv < n) | (qi >= kv), (1, 1), L, L)}
    prob = _problem.make_problem(q, k, v, scale=None, causal=False)
    mods = emu.modifiers_of(prob, **kw)
    shape = Shape.of(prob, mods=mods)
    fwd = _families.choose("fwd", shape, PROFILES["a100"])
    bwd = _families.choose("bwd", Shape.of(prob, False, mods), PROFILES["a100"])
    assert bwd.family.name == "bwd_sm80"
    def text(name):
        return shape.variant.prelude + (emu.cuda_src_dir() / name).read_text()
    flib = emu.build("fwd_sm80.cu", [("fwd", fwd.expr)], kernel_text=text("fwd_sm80.cu"))
    blib = emu.build("bwd_sm80.cu", [("bwd", bwd.expr)], kernel_text=text("bwd_sm80.cu"))
    t = fwd.traits
    o_ref, lse_ref = cuflash.reference.attention(q, k, v, causal=False, return_lse=True, **kw)
    o_ref, lse_ref = o_ref.astype(bf16), lse_ref.astype(numpy.float32)
    do = make_array(numpy.random.default_rng(6), o_ref.shape, bf16)
    for order in (0, 1):
        o, lse = emu.fwd_sm80(flib, fwd.expr, q, k, v, block_m=t.block_m, block_n=t.block_n,
                              threads=t.threads, smem_bytes=t.smem_bytes, causal=False,
                              grid_order=order, **kw)
        naive.check_result(q, k, v, False, kw, o, lse)
        grads = emu.bwd_sm80(blib, do, q, k, v, o_ref, lse_ref, causal=False, tiles=bwd.traits,
                             expr=bwd.expr, grid_order=order, **kw)
        naive.check_gradients(grads, q, k, v, o_ref, lse_ref, do, False, kw)


# -- dQ's additions in bwd_sm90's block-mask builds (session 11): bwd_io::red_row_pairs

RED_HARNESS = r"""
#include <cstdint>
#include <stdexcept>
#define __device__
#define __forceinline__ inline
struct float2 { float x, y; };
static inline float2 make_float2(float x, float y) { return {x, y}; }
static inline void atomicAdd(float2* a, float2 v) {
  if (reinterpret_cast<std::uintptr_t>(a) % 8) throw std::runtime_error("misaligned");
  a->x += v.x; a->y += v.y;
}
namespace bwd_io {
@BODY@
}
// row: n floats (8-byte aligned); acc: NT x 4 floats, row h of the fragment, times scale
template <int NT> using Acc = const float[NT][4];
extern "C" int red_row_pairs_host(int nt, float* row, int col0, const float* acc, int h,
                                  float scale) {
  try {
    if (nt == 8) bwd_io::red_row_pairs(row, col0, *reinterpret_cast<Acc<8>*>(acc), h, scale);
    else if (nt == 4) bwd_io::red_row_pairs(row, col0, *reinterpret_cast<Acc<4>*>(acc), h, scale);
    else return 2;
  } catch (...) { return 1; }
  return 0;
}
"""


@pytest.mark.skipif(__import__("shutil").which("g++") is None, reason="needs g++")
def test_red_row_pairs_adds_what_red_add2_adds(tmp_path):
    """Thread (g, t4) of a dQ slice of kDqCols = 8 NT columns from column dq_c0: bwd_sm90's
    red_add2 loop adds tau acc[t][2 h], tau acc[t][2 h + 1] at columns dq_c0 + 8 t + 2 t4 and
    + 1 of its row (every pair inside the row where d = HEAD_DIM); red_row_pairs, called with
    col0 = dq_c0 + 2 t4, adds the same values at the same columns, each pair 8-byte aligned."""
    import ctypes
    import subprocess
    src = (ROOT / "cuda_src" / "bwd_io.cuh").read_text()
    start = src.index("// -- dQ_i += tau dS_ij K_j for one accumulator row")
    end = src.index("// -- dQ's finishing in the main kernel")
    (tmp_path / "r.cpp").write_text(RED_HARNESS.replace("@BODY@", src[start:end]))
    run = subprocess.run(["g++", "-std=c++17", "-O1", "-shared", "-fPIC", "-o",
                          str(tmp_path / "r.so"), str(tmp_path / "r.cpp")],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[:3000]
    lib = ctypes.CDLL(str(tmp_path / "r.so"))
    fp = ctypes.POINTER(ctypes.c_float)
    lib.red_row_pairs_host.argtypes = [ctypes.c_int, fp, ctypes.c_int, fp, ctypes.c_int,
                                       ctypes.c_float]
    rng = numpy.random.default_rng(3)
    # (HEAD_DIM, kDqCols): d = 128, two column slices of 64; d = 64, one of 64; 32-col slices
    for head_dim, cols in ((128, 64), (64, 64), (128, 32)):
        nt = cols // 8
        for dq_c0 in range(0, head_dim, cols):
            for t4 in range(4):
                for h in (0, 1):
                    acc = rng.standard_normal((nt, 4)).astype(numpy.float32)
                    base = rng.standard_normal(head_dim).astype(numpy.float32)
                    row = base.copy()
                    assert row.ctypes.data % 8 == 0
                    rc = lib.red_row_pairs_host(nt, row.ctypes.data_as(fp), dq_c0 + 2 * t4,
                                                acc.ctypes.data_as(fp), h, 0.5)
                    assert rc == 0, "misaligned pair"
                    want = base.copy()
                    for t in range(nt):      # red_add2(dst, dq_c0 + 8 t + 2 t4, d, ...)
                        col = dq_c0 + 8 * t + 2 * t4
                        want[col] += numpy.float32(0.5) * acc[t, 2 * h]
                        want[col + 1] += numpy.float32(0.5) * acc[t, 2 * h + 1]
                    assert (row == want).all(), (head_dim, cols, dq_c0, t4, h)


def test_the_row_pairs_only_where_d_is_the_head_dim_bucket(monkeypatch):
    """The backward's Variant carries ``_variant.DQ_BOUNDS`` (red_add2's bounded additions)
    where a block mask's d is not the bucket bwd_sm90 compiles, and by default (the row
    pairs are ``CUFLASH_BWD90_DQ_ROWS=1``'s until the H200 has run them); never without a
    block mask."""
    import types
    from cuflash import _variant
    monkeypatch.delenv("CUFLASH_BWD90_DQ_ROWS", raising=False)
    bm, none = types.SimpleNamespace(block_mask=object()), types.SimpleNamespace(block_mask=None)

    def prob(d, dv):
        return types.SimpleNamespace(d=d, dv=dv)
    assert _variant._dq_bounds(prob(128, 128), bm) == _variant.DQ_BOUNDS  # the default
    assert _variant._dq_bounds(prob(128, 128), none) == ""
    monkeypatch.setenv("CUFLASH_BWD90_DQ_ROWS", "1")
    assert _variant._dq_bounds(prob(128, 128), bm) == ""
    assert _variant._dq_bounds(prob(64, 64), bm) == ""
    assert _variant._dq_bounds(prob(128, 64), bm) == ""                 # bucket of max(d, dv)
    for d, dv in ((96, 96), (64, 128), (33, 33), (100, 128), (32, 32)):
        assert _variant._dq_bounds(prob(d, dv), bm) == _variant.DQ_BOUNDS, (d, dv)
    assert _variant._dq_bounds(prob(128, 128), none) == ""
    monkeypatch.setenv("CUFLASH_BWD90_DQ_ROWS", "0")
    assert _variant._dq_bounds(prob(128, 128), bm) == _variant.DQ_BOUNDS
    assert _variant._dq_bounds(prob(128, 128), none) == ""
    monkeypatch.setenv("CUFLASH_BWD90_DQ_ROWS", "2")
    with pytest.raises(ValueError, match="CUFLASH_BWD90_DQ_ROWS"):
        _variant._dq_bounds(prob(128, 128), bm)
