"""Host side of the one-launch varlen forward (cuflash/_inference_varlen.py): the work list,
the tile choice of the varlen builds, the fallback reasons, and (NVRTC, no GPU) that the
varlen build compiles where the plain one does. The kernels' results: tests/
test_inference_varlen_emu.py (emulated, ``slow``) and tests/test_gpu_inference.py (GPU)."""

from __future__ import annotations

import ml_dtypes
import numpy
import pytest

from cuflash import _families, _inference_varlen, _problem

BF16 = numpy.dtype(ml_dtypes.bfloat16)
H200, A100 = _families.PROFILES["h200"], _families.PROFILES["a100"]


def _cu(lengths):
    return numpy.concatenate([[0], numpy.cumsum(lengths)]).astype(numpy.int32)


def test_work_list_covers_every_q_tile_once_heaviest_first():
    lq, lk = [130, 0, 1, 64, 5], [10, 7, 300, 64, 0]
    wl = _inference_varlen.work_list(_cu(lq), _cu(lk), 64, False)
    assert wl.dtype == numpy.int32 and wl.shape == (3 + 1 + 1 + 1, 8)
    got = sorted(tuple(r[:6]) for r in wl)
    want = sorted([(0, 130, 0, 10, m, 0) for m in range(3)] + [(130, 1, 17, 300, 0, 0),
                                                               (131, 64, 317, 64, 0, 0),
                                                               (195, 5, 381, 0, 0, 0)])
    assert got == want
    assert list(wl[:, 3]) == sorted(wl[:, 3], reverse=True)   # non-causal work: Lk
    assert (wl[:, 6:] == 0).all()


def test_work_list_causal_offsets_per_sequence_and_order():
    lq, lk = [100, 30], [40, 200]
    br = _inference_varlen.work_list(_cu(lq), _cu(lk), 64, True)       # bottom-right
    tl = _inference_varlen.work_list(_cu(lq), _cu(lk), 64, "top_left")
    assert {tuple(r[[0, 4, 5]]) for r in br} == {(0, 0, -60), (0, 1, -60), (100, 0, 170)}
    assert set(tl[:, 5]) == {0}
    # bottom-right: sequence 1's tile sees 200 keys, sequence 0's tile 1 sees 40, tile 0 sees 4
    assert [tuple(r[[0, 4]]) for r in br] == [(100, 0), (0, 1), (0, 0)]
    assert _inference_varlen.work_list(_cu([0, 0]), _cu([3, 0]), 64, False).shape == (0, 8)


@pytest.mark.parametrize("dev", [H200, A100], ids=["h200", "a100"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_choice_is_never_even_and_avoids_spilling_tiles(dev, d, causal):
    q = numpy.zeros((8, 1024, d), BF16)
    prob = _problem.make_problem(q, q, q, scale=None, causal=causal)
    fam, t, expr, reasons = _inference_varlen.choose(prob, dev)
    assert fam.name == ("fwd_sm90" if dev is H200 else "fwd_sm80")
    assert expr.endswith(", false>")                    # EVEN = false
    if fam.name == "fwd_sm80":
        key = (fam.name, t["head_dim"], t["block_n"], t["warps"], t["slices"])
        assert dev.cc < _inference_varlen.SPILLS_IN_VARLEN.get(key, (None, 10**6))[1]


def test_float32_takes_the_simt_varlen_build():
    q = numpy.zeros((2, 100, 64), numpy.float32)
    prob = _problem.make_problem(q, q, q, scale=None, causal=False)
    fam, t, expr, _ = _inference_varlen.choose(prob, H200)
    assert fam.name == "fwd_simt" and "fwd_simt<float, 64" in expr


def test_numpy_and_the_override_keep_the_loop(monkeypatch):
    q = numpy.zeros((2, 10, 16), numpy.float32)
    prob = _problem.make_problem(q, q, q, scale=None, causal=False)
    assert "CPU path" in _inference_varlen.why_not(prob)
    assert "per-sequence loop" in _inference_varlen.explain(prob, _cu([10]), _cu([10]), False)
    monkeypatch.setenv("CUFLASH_VARLEN_KERNEL", "0")
    assert not _inference_varlen.enabled()
    text = _inference_varlen.explain(prob, _cu([4, 6]), _cu([4, 6]), False, dev=H200)
    assert "2 work items" in text and "one launch" in text


@pytest.mark.slow      # NVRTC: a few seconds a family
def test_varlen_build_compiles_without_spills_offline():
    """One fwd_sm90 (sm_90a) and the two replaced fwd_sm80 (sm_80) varlen builds, NVRTC."""
    from cuflash import _jit
    for arch, dev in (("sm_90a", H200), ("sm_80", A100)):
        try:
            nvrtc = _jit._nvrtc_for(arch)
        except _jit.KernelCompileError as exc:
            pytest.skip(str(exc))
        exprs = set()
        for causal in (False, True):
            q = numpy.zeros((1, 64, 64), BF16)     # one batch item: the small-grid tiles too
            fam, t, expr, _ = _inference_varlen.choose(
                _problem.make_problem(q, q, q, scale=None, causal=causal), dev)
            exprs.add(expr)
        source = fam.source
        log, lowered, _ = nvrtc.compile(_inference_varlen.varlen_source(source), source,
                                        sorted(exprs), _jit._options(arch, ("--ptxas-options=-v",)))
        assert lowered is not None, log
        for e in exprs:
            r = _jit._parse_ptxas(log, lowered[e])
            assert r["spill_stores"] == r["spill_loads"] == r["stack"] == 0, (e, r)


def test_bench_varlen_mixes_and_pair_counts():
    """bench/suite_varlen.py's host side: every mix is TOTAL tokens of 64..8192 each."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "bench" / "suite_varlen.py"
    spec = importlib.util.spec_from_file_location("suite_varlen", path)
    sv = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sv)
    for name, lengths in sv.mixes().items():
        assert sum(lengths) == sv.TOTAL, name
        assert all(64 <= n <= 8192 for n in lengths), (name, lengths)
    assert len(set(sv.mixes()["mixed"])) > 3
    assert sv.pairs([3, 4], causal=False) == 25 and sv.pairs([3, 4], causal=True) == 16
    row = sv._row("x", "m", [64, 64], 32, 8, True, 2.0, 100)
    assert row["tflops"] == 4 * 128 * 32 * 100 / 2e-3 / 1e12 and row["n_seq"] == 2


@pytest.mark.slow      # NVRTC
def test_backward_varlen_build_avoids_the_spilling_tile_and_compiles_clean():
    """bwd_sm80 at d = 128: the plain (64-row) tile spills in the varlen build; the varlen
    choice takes 32 rows, which NVRTC compiles with no spill (sm_80)."""
    from cuflash import _jit
    try:
        nvrtc = _jit._nvrtc_for("sm_80")
    except _jit.KernelCompileError as exc:
        pytest.skip(str(exc))
    q = numpy.zeros((4, 512, 128), BF16)
    prob = _problem.make_problem(q, q, q, scale=None, causal=False)
    plain = _families.choose("bwd", _families.Shape.of(prob), A100)
    fam, t, expr, reasons = _inference_varlen.choose(prob, A100, plain)
    assert fam.name == "bwd_sm80" and t["block_m"] == 32 and "varlen build" in reasons[-1]
    log, lowered, _ = nvrtc.compile(_inference_varlen.varlen_source(fam.source), fam.source,
                                    [expr], _jit._options("sm_80", ("--ptxas-options=-v",)))
    assert lowered is not None, log
    r = _jit._parse_ptxas(log, lowered[expr])
    assert r["spill_stores"] == r["spill_loads"] == r["stack"] == 0, r


def test_backward_work_list_is_over_key_tiles():
    lq, lk = [100, 0, 5], [130, 64, 0]
    wl = _inference_varlen.work_list(_cu(lq), _cu(lk), 64, True, keys=True)
    assert sorted(tuple(r[[2, 3, 4]]) for r in wl) == [(0, 130, 0), (0, 130, 1), (0, 130, 2),
                                                        (130, 64, 0)]
    # bottom-right, sequence 0 (offset 30): key tile 2 (keys 128..) is seen by rows >= 98
    work = {int(r[4]): r for r in wl if r[2] == 0}
    assert [int(r[4]) for r in wl][:1] == [0] and work[2][5] == 30
