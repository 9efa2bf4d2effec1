"""The benchmark's pure logic, on the CPU: shapes, the FLOP convention, the rotation and
iteration rules, the table, the JSON file and the command line."""
from __future__ import annotations

import datetime
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from cuflash import _bench as b
from cuflash import __main__ as cli

ROOT = Path(__file__).resolve().parent.parent


def test_shapes_keep_16k_tokens_and_2048_features():
    for L in b.ALL_L:
        for d in b.ALL_D:
            B, H = b.batch_heads(L, d)
            assert B * L == 16384 and H * d == 2048
    assert b.batch_heads(1024, 64) == (16, 32)
    assert b.batch_heads(16384, 256) == (1, 8)
    with pytest.raises(ValueError):
        b.batch_heads(3000, 64)
    with pytest.raises(ValueError):
        b.batch_heads(1024, 96)


def test_flops_follow_flashattention_convention():
    B, H, L, d = 16, 32, 1024, 64
    fwd = 4 * B * H * L * L * d
    assert b.attention_flops(B, H, L, L, d, False, "fwd") == fwd
    assert b.attention_flops(B, H, L, L, d, True, "fwd") == fwd // 2
    assert b.attention_flops(B, H, L, L, d, False, "fwd_bwd") == fwd * 7 // 2
    assert b.attention_flops(B, H, L, L, d, True, "fwd_bwd") == fwd // 2 * 7 // 2
    # Lq != Lk counts Lq * Lk pairs
    assert b.attention_flops(1, 1, 3, 5, 8, False, "fwd") == 4 * 3 * 5 * 8
    with pytest.raises(ValueError):
        b.attention_flops(1, 1, 1, 1, 1, False, "bwd")


def test_flops_are_the_same_for_every_standard_shape():
    # B*L = 16k and H*d = 2048 make the forward count 4 * 16k * L * 2048 whatever d is
    for L in b.ALL_L:
        counts = {b.Case("bf16", d, L, False, "fwd", *b.batch_heads(L, d)).flops
                  for d in b.ALL_D}
        assert counts == {4 * 16384 * L * 2048}


def test_tflops():
    assert b.tflops(2e12, 1000.0) == pytest.approx(2.0)
    assert b.tflops(1e12, 0.5) == pytest.approx(2000.0)
    assert b.tflops(1e12, None) is None


def test_make_cases_order_and_count():
    cases = b.make_cases(["bf16", "fp16"], [64, 128], [1024, 4096], [False, True],
                         ["fwd", "fwd_bwd"])
    assert len(cases) == 2 * 2 * 2 * 2 * 2
    assert [c.key for c in cases] == sorted(
        [c.key for c in cases], key=lambda k: (["bf16", "fp16"].index(k[0]), k[1], k[2], k[3],
                                               ["fwd", "fwd_bwd"].index(k[4])))
    assert cases[0] == b.Case("bf16", 64, 1024, False, "fwd", 16, 32)


def test_naive_limit():
    # float32 scores: B*H*L*L*4 bytes; d=64, L=16k: 1*32*16384^2*4 = 34 GB fits under 40 GB
    assert b.naive_fits(1, 32, 16384, 16384)
    assert b.naive_scores_bytes(1, 16, 32768, 32768) == 16 * 32768 ** 2 * 4
    assert not b.naive_fits(1, 16, 32768, 32768, b.NAIVE_MEMORY_LIMIT_BYTES)   # 68.7 GB


def test_input_rotation_spans_twice_l2():
    l2 = 60 * 2**20
    assert b.n_input_sets(500 * 2**20, l2) == 1
    assert b.n_input_sets(2 * l2, l2) == 1
    assert b.n_input_sets(l2, l2) == 2
    assert b.n_input_sets(10 * 2**20, l2) == 12
    assert b.n_input_sets(1, l2) == b.MAX_INPUT_SETS
    for size in (1 * 2**20, 7 * 2**20, 50 * 2**20):
        n = b.n_input_sets(size, l2)
        assert n * size >= 2 * l2 or n == b.MAX_INPUT_SETS


def test_iteration_count():
    assert b.n_iters(1.0, 0.5) == b.MIN_ITERS
    assert b.n_iters(0.001, 0.5) == 500
    assert b.n_iters(1e-7, 0.5) == b.MAX_ITERS
    assert b.n_iters(0.0) == b.MAX_ITERS


def _rows():
    c1 = b.Case("bf16", 64, 1024, False, "fwd", 16, 32)
    c2 = b.Case("bf16", 64, 1024, True, "fwd", 16, 32)
    return [
        b.row_for(c1, "cuflash", ms=0.5, iters=100, input_sets=1),
        b.row_for(c1, "sdpa_flash", ms=0.25),
        b.row_for(c1, "sdpa_cudnn", skipped="not available: ModuleNotFoundError: torch"),
        b.row_for(c2, "cuflash", ms=0.4),
        b.row_for(c2, "sdpa_flash", ms=0.4),
        b.row_for(c2, "sdpa_cudnn", skipped="not available: ModuleNotFoundError: torch"),
    ]


def test_rows():
    rows = _rows()
    assert rows[0]["tflops"] == pytest.approx(4 * 16 * 32 * 1024 * 1024 * 64 / 0.5e-3 / 1e12)
    assert rows[2]["ms"] is None and rows[2]["tflops"] is None
    assert rows[2]["skipped"].startswith("not available")
    assert "skipped" not in rows[0]
    assert rows[0]["iters"] == 100


def test_table_has_impl_and_ratio_columns():
    text = b.format_table(_rows())
    lines = text.splitlines()
    head = lines[0].split()
    assert head[:5] == ["dtype", "d", "L", "causal", "mode"]
    assert head[5:8] == ["cuflash", "sdpa_flash", "sdpa_cudnn"]
    assert head[8:] == ["cuflash/sdpa_flash", "cuflash/sdpa_cudnn"]
    assert len(lines) == 2 + 2
    first = lines[2].split()
    assert first[:5] == ["bf16", "64", "1024", "no", "fwd"]
    t_cu = 4 * 16 * 32 * 1024 * 1024 * 64 / 0.5e-3 / 1e12
    assert first[5] == f"{t_cu:.1f}"
    assert first[7] == "-"                 # skipped
    assert first[8] == "0.50"              # cuflash is half as fast as sdpa_flash here
    assert first[9] == "-"                 # no cuDNN number, no ratio
    second = lines[3].split()
    assert second[3] == "yes" and second[8] == "1.00"


def test_skips_summary():
    text = b.format_skips(_rows())
    assert text.strip() == "sdpa_cudnn: not available: ModuleNotFoundError: torch (2 rows)"


def test_memory_table():
    case = b.Case("bf16", 128, 4096, False, "memory", 1, 16)
    rows = [b.row_for(case, "cuflash", peak_extra_bytes=2**20),
            b.row_for(case, "naive_cupy", skipped="too big")]
    text = b.format_memory_table(rows)
    last = text.splitlines()[-1].split()
    assert last == ["bf16", "1", "16", "128", "4096", "no", "1.0", "-"]
    assert b.format_table(rows).count("\n") == 1     # memory rows stay out of the TFLOP/s table
    assert rows[0]["ms"] is None and rows[0]["tflops"] is None and "flops" not in rows[0]


def test_json_round_trip(tmp_path):
    header = {"gpu": "NVIDIA H200", "command": "python -m cuflash bench --quick"}
    path = b.write_json(tmp_path / "sub" / "r.json", header, _rows())
    doc = json.loads(path.read_text())
    assert set(doc) == {"header", "rows"}
    assert doc["header"] == header
    skipped = [r for r in doc["rows"] if r.get("skipped")]
    assert len(skipped) == 2 and all(r["ms"] is None for r in skipped)
    for r in doc["rows"]:
        assert {"impl", "dtype", "d", "L", "B", "H", "causal", "mode", "ms", "tflops"} <= set(r)
    assert b.read_json(path) == (header, doc["rows"])


def test_json_rejects_nan(tmp_path):
    rows = [dict(_rows()[0], ms=math.nan)]
    with pytest.raises(ValueError):
        b.write_json(tmp_path / "x.json", {}, rows)


def test_default_json_path():
    now = datetime.datetime(2026, 11, 29, 10, 30, 5)
    p = b.default_json_path("NVIDIA H200 NVL", now, Path("/r"))
    assert p == Path("/r/2026-11-29-103005-NVIDIA-H200-NVL.json")
    p = b.default_json_path("NVIDIA H200", now)
    assert p.parent == ROOT / "bench" / "results"


def test_parse_lists():
    parser = b.build_parser()
    a = parser.parse_args(["--dtype", "bf16,fp16", "--d", "64", "--L", "1024,4096",
                           "--causal", "false,true", "--mode", "fwd", "--impl",
                           "cuflash,naive_cupy", "--quick"])
    assert a.dtype == ["bf16", "fp16"] and a.d == [64] and a.L == [1024, 4096]
    assert a.causal == [False, True] and a.mode == ["fwd"]
    assert a.impl == ["cuflash", "naive_cupy"] and a.quick
    for bad in (["--dtype", "fp8"], ["--d", "96"], ["--impl", "flash3"], ["--causal", "maybe"],
                ["--mode", "bwd"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)


def test_load_prints_table_without_gpu(tmp_path, capsys):
    path = b.write_json(tmp_path / "r.json", {"gpu": "Test GPU"}, _rows())
    assert b.main(["--load", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.rstrip().splitlines()[-1].split()[:5] == ["bf16", "64", "1024", "yes", "fwd"]
    assert "Skipped:" in out and "cuflash/sdpa_cudnn" in out


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    files = b.plot(_rows(), tmp_path)
    assert sorted(f.name for f in files) == ["tflops-bf16-causal-fwd.png",
                                             "tflops-bf16-noncausal-fwd.png"]
    assert all(f.stat().st_size > 1000 for f in files)


def test_naive_attention_matches_reference_on_numpy():
    # the same function times naive CuPy on a GPU; here it runs on NumPy arrays
    import numpy as np
    from cuflash import reference
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((2, 3, 16, 8)) for _ in range(3))
    bias = np.triu(np.full((16, 16), -np.inf, dtype=np.float32), k=1)
    o = b.naive_attention(np, q, k, v, 0.3, bias)
    ref = reference.attention(q, k, v, scale=0.3, causal=True)
    np.testing.assert_allclose(o, ref, rtol=1e-5, atol=1e-5)


def _run(*args):
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def test_command_line_help():
    for args in (["-m", "cuflash", "--help"], ["-m", "cuflash", "bench", "--help"],
                 ["bench/bench_attention.py", "--help"], ["-m", "cuflash", "check", "--help"]):
        r = _run(*args)
        assert r.returncode == 0, r.stderr
        assert "usage:" in r.stdout


def test_bench_without_gpu_fails_clearly(capsys):
    if cli.usable_gpu()[0] is not None:
        pytest.skip("a GPU is present")
    assert b.main(["--quick", "--no-json"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_demo_thresholds():
    import ml_dtypes
    import numpy as np
    assert cli.threshold(np.dtype(np.float32), 1e-6) == pytest.approx(2e-6 + 4 * 2.0 ** -23)
    assert cli.threshold(np.dtype(ml_dtypes.bfloat16), 0.0) == pytest.approx(4 * 2.0 ** -7)


class _Report:
    def __init__(self, **kw):
        base = dict(source="fwd_simt.cu", expr="cuflash::fwd_simt<float, 64>", arch="sm_80",
                    registers=96, spill_stores=0, spill_loads=0, stack=0, shared=16384,
                    hmma=None, error=None)
        base.update(kw)
        self.__dict__.update(base)


def test_check_table_and_verdict(monkeypatch, capsys):
    good = _Report()
    spill = _Report(arch="sm_90a", spill_stores=8)
    err = _Report(arch="sm_70", error="error: identifier \"x\" is undefined\nmore")
    text = cli.format_check_table([good, spill, err])
    lines = text.splitlines()
    assert lines[0].split()[:2] == ["arch", "source"]
    assert "ok" in lines[2] and "SPILL" in lines[3] and "ERROR" in lines[4]
    assert not cli.check_failed(good) and cli.check_failed(spill) and cli.check_failed(err)
    assert cli.check_failed(_Report(stack=16))

    import cuflash._jit as jit
    monkeypatch.setattr(jit, "check_all", lambda archs: [good], raising=False)
    assert cli.main(["check", "--arch", "sm_80"]) == 0
    monkeypatch.setattr(jit, "check_all", lambda archs: [good, spill], raising=False)
    assert cli.main(["check", "--arch", "sm_80", "--arch", "sm_90a"]) == 1
    monkeypatch.setattr(jit, "check_all", lambda archs: [], raising=False)
    assert cli.main(["check"]) == 1
    capsys.readouterr()


def test_batched_matmul_loops_where_cupy_refuses_bfloat16():
    # CuPy 14.2: matmul of bfloat16 arrays with ndim > 2 raises TypeError, 2-D works
    import types

    import ml_dtypes
    import numpy as np

    calls = []

    def matmul(a, b, out=None):
        calls.append(a.ndim)
        if a.ndim > 2 and a.dtype == ml_dtypes.bfloat16:
            raise TypeError("data type 'E' not understood")
        return np.matmul(a, b, out=out)

    xp = types.SimpleNamespace(matmul=matmul, broadcast_to=np.broadcast_to, empty=np.empty)
    rng = np.random.default_rng(0)
    a = rng.standard_normal((2, 3, 4, 5)).astype(ml_dtypes.bfloat16)
    bm = rng.standard_normal((1, 3, 5, 6)).astype(ml_dtypes.bfloat16)    # broadcast batch
    out = b.batched_matmul(xp, a, bm)
    assert out.shape == (2, 3, 4, 6) and out.dtype == ml_dtypes.bfloat16
    want = np.matmul(a.astype(np.float32), bm.astype(np.float32))
    np.testing.assert_allclose(out.astype(np.float32), want, rtol=2**-7, atol=1e-2)
    assert calls.count(2) == 6
    f32 = a.astype(np.float32)
    with pytest.raises(TypeError):         # other dtypes are not silently looped
        b.batched_matmul(types.SimpleNamespace(
            matmul=lambda x, y: (_ for _ in ()).throw(TypeError("no"))), f32, f32)


def test_skip_reason_keeps_torchs_real_explanation():
    import warnings

    def w(text):
        return warnings.WarningMessage(text, UserWarning, "x.py", 1)
    caught = [w("Memory efficient kernel not used because: (Triggered internally at /a.cpp:9.)"),
              w("Memory Efficient attention has been runtime disabled. (Triggered internally "
                "at /a.cpp:1.)"),
              w("Expected query, key and value to all be of dtype: {Half, BFloat16}. Got Query "
                "dtype: float (Triggered internally at /b.cpp:2.)")]
    msg = b._short(RuntimeError("No available kernel. Aborting execution."), caught)
    assert msg == ("RuntimeError: No available kernel. Aborting execution. [Expected query, key "
                   "and value to all be of dtype: {Half, BFloat16}. Got Query dtype: float]")


def test_git_describe_in_checkout():
    import shutil
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    desc = b.git_describe()
    assert desc is not None and len(desc.split("+")[0]) == 12
