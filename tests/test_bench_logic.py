"""``python -m cuflash bench`` (cuflash/_bench.py) on the CPU: the FLOP convention, the row
format, the table with its ratio columns, the JSON file and ``--load``, the naive CuPy
attention (run on NumPy), and the command line. The lab harness bench/bench_attention.py has
its own tests (tests/test_bench_harness.py)."""
from __future__ import annotations

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
    for L in (512, 1024, 4096, 16384):
        for d in (64, 128, 256):
            B, H = b.batch_heads(L, d)
            assert B * L == 16384 and H * d == 2048
    assert b.batch_heads(1024, 64) == (16, 32)
    assert b.batch_heads(16384, 256) == (1, 8)
    for L, d in ((3000, 64), (1024, 96), (0, 64), (1024, -64)):
        with pytest.raises(ValueError, match="must divide"):
            b.batch_heads(L, d)


def test_flops_follow_flashattention_convention():
    B, H, L, d = 16, 32, 1024, 64
    fwd = 4 * B * H * L * L * d
    assert b.attention_flops(B, H, L, L, d, False, "fwd") == fwd
    assert b.attention_flops(B, H, L, L, d, True, "fwd") == fwd // 2
    assert b.attention_flops(B, H, L, L, d, False, "fwd_bwd") == fwd * 7 // 2
    assert b.attention_flops(B, H, L, L, d, True, "fwd_bwd") == fwd // 2 * 7 // 2
    assert b.attention_flops(1, 1, 3, 5, 8, False, "fwd") == 4 * 3 * 5 * 8   # Lq * Lk pairs
    with pytest.raises(ValueError, match="mode"):
        b.attention_flops(1, 1, 1, 1, 1, False, "bwd")


def test_flops_are_the_same_for_every_standard_shape():
    # B*L = 16k and H*d = 2048 make the forward count 4 * 16k * L * 2048 whatever d is
    for L in (1024, 4096, 16384):
        counts = {b.attention_flops(*b.batch_heads(L, d), L, L, d, False, "fwd")
                  for d in (64, 128, 256)}
        assert counts == {4 * 16384 * L * 2048}


def _row(impl, causal=False, **kw):
    return b.make_row(impl, "fwd", "fwd", "bf16", 64, 1024, causal, 16, 32, **kw)


def _rows():
    return [_row("cuflash", ms=0.5, iters=100), _row("sdpa_flash", ms=0.25),
            _row("sdpa_cudnn", skipped="not available: ModuleNotFoundError: torch"),
            _row("cuflash", True, ms=0.4), _row("sdpa_flash", True, ms=0.4),
            _row("sdpa_cudnn", True, skipped="not available: ModuleNotFoundError: torch")]


def test_row_fields():
    rows = _rows()
    for r in rows:
        assert {"impl", "suite", "mode", "dtype", "d", "L", "causal", "isolated", "tflops",
                "ms", "B", "H", "flops"} <= set(r)
    flops = 4 * 16 * 32 * 1024 * 1024 * 64
    assert rows[0]["flops"] == flops
    assert rows[0]["tflops"] == pytest.approx(flops / 0.5e-3 / 1e12)
    assert rows[3]["tflops"] == pytest.approx(flops / 2 / 0.4e-3 / 1e12)
    assert rows[0]["isolated"] is False and rows[0]["iters"] == 100 and "skipped" not in rows[0]
    assert rows[2]["ms"] is None and rows[2]["tflops"] is None
    assert rows[2]["skipped"].startswith("not available")
    assert _row("cuflash", ms=0.3, skipped="x")["ms"] is None     # a skipped row has no time
    iso = b.make_row("cuflash", "fwd", "fwd", "bf16", 64, 512, True, 32, 32, isolated=True,
                     ms=1.0)
    assert iso["isolated"] is True
    mem = b.make_row("cuflash", "memory", "memory", "bf16", 128, 4096, False, 1, 16,
                     peak_extra_bytes=2**20)
    assert mem["tflops"] is None and "flops" not in mem and mem["peak_extra_bytes"] == 2**20


def test_table_has_impl_and_ratio_columns():
    lines = b.format_table(_rows()).splitlines()
    head = lines[0].split()
    assert head == ["mode", "dtype", "d", "L", "causal", "cuflash", "sdpa_flash", "sdpa_cudnn",
                    "cuflash/sdpa_flash", "cuflash/sdpa_cudnn"]
    assert len(lines) == 2 + 2
    first = lines[2].split()
    assert first[:5] == ["fwd", "bf16", "64", "1024", "no"]
    assert first[5] == f"{4 * 16 * 32 * 1024 * 1024 * 64 / 0.5e-3 / 1e12:.1f}"
    assert first[7] == "-"                 # skipped
    assert first[8] == "0.50"              # cuflash is half as fast as sdpa_flash here
    assert first[9] == "-"                 # no cuDNN number, no ratio
    second = lines[3].split()
    assert second[4] == "yes" and second[8] == "1.00"


def test_table_marks_isolated_rows_and_leaves_out_memory_rows():
    rows = [b.make_row("cuflash", "fwd", "fwd", "bf16", 64, 512, False, 32, 32, isolated=True,
                       ms=0.2),
            b.make_row("sdpa_flash", "fwd", "fwd", "bf16", 64, 512, False, 32, 32,
                       isolated=True, ms=0.1),
            b.make_row("cuflash", "memory", "memory", "bf16", 128, 4096, False, 1, 16,
                       peak_extra_bytes=1)]
    lines = b.format_table(rows).splitlines()
    assert len(lines) == 3
    assert lines[2].split()[0] == "fwd/iso" and lines[2].split()[-2] == "0.50"


def test_json_round_trip_and_nan_refused(tmp_path):
    header = {"gpu": "NVIDIA H200", "command": "python -m cuflash bench"}
    path = b.write_json(tmp_path / "sub" / "r.json", header, _rows())
    doc = json.loads(path.read_text())
    assert set(doc) == {"header", "rows"} and doc["header"] == header
    assert b.read_json(path) == (header, doc["rows"]) == (header, _rows())
    with pytest.raises(ValueError):
        b.write_json(tmp_path / "x.json", {}, [dict(_rows()[0], ms=math.nan)])


def test_load_prints_table_without_gpu(tmp_path, capsys):
    path = b.write_json(tmp_path / "r.json", {"gpu": "Test GPU"}, _rows())
    assert b.main(["--load", str(path)]) == 0
    out = capsys.readouterr().out
    assert "Test GPU" in out and "cuflash/sdpa_cudnn" in out
    assert out.rstrip().splitlines()[-1].split()[:5] == ["fwd", "bf16", "64", "1024", "yes"]


@pytest.mark.parametrize("content, why", [(None, "No such file"), ("{not json", "JSONDecodeError"),
                                          ('{"rows": []}', "not a results file"),
                                          ('[1, 2]', "not a results file"),
                                          ('{"header": {}, "rows": 3}', "not a results file")])
def test_load_bad_file_is_one_line_and_exit_2(tmp_path, capsys, content, why):
    path = tmp_path / "r.json"
    if content is not None:
        path.write_text(content)
    assert b.main(["--load", str(path)]) == 2
    cap = capsys.readouterr()
    assert cap.out == ""
    assert len(cap.err.strip().splitlines()) == 1 and why in cap.err
    assert "Traceback" not in cap.err


def test_load_through_the_cli_has_no_traceback(tmp_path):
    r = _run("-m", "cuflash", "bench", "--load", str(tmp_path / "missing.json"))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_committed_results_load(capsys):
    # the converted H200 results are in the row format --load prints
    for name in ("fwd", "fwd_bwd", "fwd_fp32"):
        assert b.main(["--load", str(ROOT / "bench" / "results" / "h200" / f"{name}.json")]) == 0
        assert "cuflash/sdpa_flash" in capsys.readouterr().out


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    path = b.plot(_rows(), tmp_path / "p.png", "t")
    assert path == tmp_path / "p.png" and path.stat().st_size > 1000


def test_module_is_short():
    # the user-facing command stays short; the lab harness lives in bench/
    assert len((ROOT / "cuflash" / "_bench.py").read_text().splitlines()) < 300


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
                 ["bench/bench_attention.py", "--help"], ["bench/host_overhead.py", "--help"],
                 ["-m", "cuflash", "check", "--help"]):
        r = _run(*args)
        assert r.returncode == 0, r.stderr
        assert "usage:" in r.stdout


def test_bench_without_gpu_fails_clearly(capsys):
    if cli.usable_gpu()[0] is not None:
        pytest.skip("a GPU is present")
    assert b.main([]) == 2
    err = capsys.readouterr().err
    assert "needs a CUDA GPU" in err and len(err.strip().splitlines()) == 1


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


