"""bench/suite_mods.py's logic on the CPU: each modifier's cuflash keywords compute what its
FlexAttention mask_mod says (the same function, run by cuflash's CPU path on NumPy), and the
visible-pair counts of the FLOP rate are those of the masks. The suite itself runs on the GPU."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import numpy
import pytest

import cuflash

_PATH = pathlib.Path(__file__).resolve().parent.parent / "bench" / "suite_mods.py"
spec = importlib.util.spec_from_file_location("suite_mods", _PATH)
suite = importlib.util.module_from_spec(spec)
sys.modules["suite_mods"] = suite          # (dataclasses look their module up)
spec.loader.exec_module(suite)


@pytest.mark.parametrize("name", ["plain", "full", "window", "document", "prefix", "alibi", "softcap"])
def test_keywords_match_the_flex_functions(name, monkeypatch):
    monkeypatch.setattr(suite, "WINDOW", 5)        # small lengths: a window that matters
    L, H = 48, 2
    mod = suite.mods_for(L, H)[name]
    rng = numpy.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, H, L, 8)) for _ in range(3))
    kw = suite.cuflash_kwargs(mod, L, H, numpy)
    ours = cuflash.attention(q, k, v, **kw)
    # the same function by the reference, with the flex function as a mask_mod
    ref_kw = {n: x for n, x in kw.items() if n not in ("mask", "window")}
    if mod.mask_mod is not None:
        ref_kw["mask_mod"] = mod.mask_mod
    numpy.testing.assert_allclose(ours, cuflash.reference.attention(q, k, v, **ref_kw),
                                  rtol=1e-10, atol=1e-12)
    i = numpy.arange(L)
    keep = (i[None, :] <= i[:, None]) if mod.causal or mod.name == "plain" else \
        numpy.ones((L, L), bool)
    if mod.mask_mod is not None:
        keep = numpy.broadcast_to(mod.mask_mod(0, 0, i[:, None], i[None, :]), (L, L))
    assert suite.visible_pairs(mod, L) == int(keep.sum())


def test_points_and_rows():
    assert suite.TOKENS // 4096 == 4 and suite.WIDTH // 128 == 16
    row = suite._row("cuflash", "fwd", 128, 4096, "window", 2.0, 4e9)
    assert row["tflops"] == pytest.approx(2.0) and row["suite"] == "mods"
    assert set(row) >= {"impl", "suite", "mode", "dtype", "d", "L", "causal", "isolated",
                        "tflops", "ms", "mod"}


def test_warm_jobs_cover_every_timed_point_but_the_dense_bias():
    """The suite compiles each timed point's kernels first (suite_mods.warm_jobs): one job a
    (d, L, modifier, mode), the modifiers the run was narrowed to, never the dense bias."""
    jobs = suite.warm_jobs((64, 128), (4096,), ("fwd", "fwd_bwd"), None)
    points = {(j.args[0].name, j.args[1], j.args[2], j.args[3]) for j in jobs}
    names = set(suite.mods_for(4096, 16)) - {"bias"}
    assert len(jobs) == len(points) == len(names) * 2 * 2
    assert {p[0] for p in points} == names
    assert {(p[1], p[2]) for p in points} == {("fwd", 64), ("fwd_bwd", 64), ("fwd", 128),
                                              ("fwd_bwd", 128)}
    narrowed = suite.warm_jobs((64,), (4096, 16384), ("fwd",), ("window", "bias"))
    assert [(j.args[0].name, j.args[3]) for j in narrowed] == [("window", 4096),
                                                                 ("window", 16384)]


def test_median_rows_keep_the_middle_pass_and_every_figure():
    """--rounds (session 18): one row a point and implementation, the median pass's (the lower
    middle of an even count), every pass's TFLOP/s beside it; a point never timed keeps its
    note."""
    def row(impl, ms, mod="alibi", note=None):   # (4e9 flops: tflops = 4 / ms)
        return suite._row(impl, "fwd", 128, 4096, mod, ms, 4e9, note)
    passes = [[row("cuflash", 5.0), row("flex", None, note="no torch")],
              [row("flex", None, note="no torch"), row("cuflash", 2.0)],
              [row("cuflash", 4.0), row("flex", None, note="no torch")]]
    out = {r["impl"]: r for r in suite.median_rows(passes)}
    assert out["cuflash"]["ms"] == 4.0 and out["cuflash"]["tflops"] == pytest.approx(1.0)
    assert out["cuflash"]["tflops_rounds"] == pytest.approx([0.8, 2.0, 1.0])
    assert out["flex"]["tflops"] is None and out["flex"]["note"] == "no torch"
    two = suite.median_rows([[row("cuflash", 5.0)], [row("cuflash", 2.0)]])
    assert two[0]["ms"] == 5.0                   # (the lower of the two TFLOP/s)
    one = suite.median_rows([[row("cuflash", 5.0), row("cuflash", 2.0, mod="plain")]])
    assert len(one) == 2 and "tflops_rounds" not in one[0]
