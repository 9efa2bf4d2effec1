"""The command line: one-line errors with exit status 2, arches NVRTC cannot target skipped
with the reason, a progress bar, "no CUDA GPU found"; and the CPU path's BLAS thread control."""

from __future__ import annotations

import io
import json
import types

import pytest

from cuflash import __main__ as cli
from cuflash import _blas
from cuflash._progress import Progress


def run(capsys, *argv):
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("argv, message", [
    (["check", "--arch", "foo"], "--arch 'foo' is not an architecture: use sm_<NN> or sm_<NN>a"),
    (["check", "--arch", "sm80"], "--arch 'sm80' is not an architecture"),
    (["check", "--bogus"], "unrecognized arguments: --bogus"),
    (["demo", "--seed", "x"], "argument --seed: invalid int value: 'x'"),
    (["nope"], "invalid choice: 'nope'"),
    (["demo", "--seed", "-1"], "argument --seed: must be >= 0, got -1"),
    (["info", "--dtype", "fp8"], "argument --dtype: invalid choice: 'fp8'"),
    (["info", "--explain", "4,y,8"], "--explain takes shapes like 4,16,1024,128, got '4,y,8'"),
    (["info", "--explain", "4,8", "--gpu", "tpu"], "unknown device profile 'tpu'"),
    (["info", "--explain", "4,0"], "head dim d (q.shape[-1])=0 is not supported"),
    (["info", "--explain", "4,8", "4,8", "4,8", "4,8"], "at most three shapes"),
])
def test_bad_arguments_are_one_line_and_exit_2(capsys, argv, message):
    rc, out, err = run(capsys, *argv)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("python -m cuflash: error: ")
    assert message in err


def test_bench_load_of_a_missing_file_is_one_line(capsys, tmp_path):
    pytest.importorskip("cuflash._bench")
    rc, out, err = run(capsys, "bench", "--load", str(tmp_path / "missing.json"))
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert str(tmp_path / "missing.json") in err and "No such file or directory" in err


@pytest.mark.parametrize("content", ["{}", "not json", '{"rows": []}'])
def test_bench_load_of_a_wrong_file_is_one_line(capsys, tmp_path, content):
    pytest.importorskip("cuflash._bench")
    path = tmp_path / "r.json"
    path.write_text(content)
    rc, out, err = run(capsys, "bench", "--load", str(path))
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert str(path) in err or "JSON" in err


def test_bench_errors_that_escape_the_suite_are_one_line(monkeypatch, capsys):
    """__main__'s net under the suite: an OSError/KeyError/JSON error it lets through is one
    line with exit 2 (the suite reports its own errors first; this is the net)."""
    import cuflash._bench as bench

    def raising(exc):
        def main(argv):
            raise exc
        return main
    cases = [(FileNotFoundError(2, "No such file or directory", "x.json"),
              "cannot open x.json: No such file or directory"),
             (KeyError("header"), "not a cuflash benchmark result (no 'header' field)"),
             (json.JSONDecodeError("Expecting value", "doc", 0), "not a JSON file")]
    for exc, message in cases:
        monkeypatch.setattr(bench, "main", raising(exc))
        rc, out, err = run(capsys, "bench", "--load", "x.json")
        assert rc == 2 and err.count("\n") == 1 and message in err


def test_version(capsys):
    import cuflash
    rc, out, err = run(capsys, "--version")
    assert rc == 0 and out == f"cuflash {cuflash.__version__}\n"


def test_every_command_is_listed(capsys):
    rc, out, err = run(capsys, "nope")
    assert "choose from 'demo', 'bench', 'check', 'info', 'fuzz'" in err


@pytest.mark.parametrize("argv, message", [
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--load"], "argument --load: expected one argument"),
    (["--budget", "abc"], "argument --budget: must be a finite number of seconds > 0, got abc"),
    (["--budget", "-1"], "must be a finite number of seconds > 0, got -1"),
    (["--budget", "inf"], "must be a finite number of seconds > 0, got inf"),
])
def test_bench_bad_arguments_are_one_line_and_exit_2(capsys, argv, message):
    rc, out, err = run(capsys, "bench", *argv)
    assert rc == 2 and out == "" and "usage:" not in err
    assert err.count("\n") == 1 and err.startswith("python -m cuflash bench: error: ")
    assert message in err


def test_bench_without_a_gpu_says_no_cuda_gpu_found(monkeypatch, capsys):
    from cuflash import _cli_common
    why = "no CUDA GPU found (no NVIDIA driver is installed or loaded)"
    monkeypatch.setattr(_cli_common, "usable_gpu", lambda: (None, why))
    rc, out, err = run(capsys, "bench")
    assert rc == 2 and out == "" and err.count("\n") == 1
    assert "bench needs a CUDA GPU: no CUDA GPU found (no NVIDIA driver" in err
    assert "insufficient" not in err


def test_explain_on_a_gpu_id_without_a_gpu_is_one_line(monkeypatch, capsys):
    monkeypatch.setattr(cli, "usable_gpu", lambda: (None, "no CUDA GPU found"))
    rc, out, err = run(capsys, "info", "--explain", "4,8", "--gpu", "7")
    assert rc == 2 and out == "" and err.count("\n") == 1
    assert "--gpu 7: no CUDA GPU found; a device profile needs no GPU" in err


def test_explain_on_a_gpu_id_that_does_not_exist_is_one_line(monkeypatch, capsys):
    runtime = types.SimpleNamespace(getDeviceCount=lambda: 1)
    monkeypatch.setattr(cli, "usable_gpu",
                        lambda: (types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=runtime)),
                                 None))
    rc, out, err = run(capsys, "info", "--explain", "4,8", "--gpu", "3")
    assert rc == 2 and err.count("\n") == 1
    assert "--gpu 3: there is no such device; this machine has 1" in err


def test_fuzz_file_errors_are_one_line(monkeypatch, capsys):
    import cuflash._fuzz as fuzz

    def main(argv):
        raise FileNotFoundError(2, "No such file or directory", "/nowhere/report.json")
    monkeypatch.setattr(fuzz, "main", main)
    rc, out, err = run(capsys, "fuzz", "--report", "/nowhere/report.json")
    assert rc == 2 and err.count("\n") == 1
    assert "fuzz: cannot write /nowhere/report.json: No such file or directory" in err


def test_fuzz_on_a_gpu_without_one_says_no_cuda_gpu_found(monkeypatch, capsys):
    pytest.importorskip("hypothesis")
    import sys
    from cuflash import _cli_common
    monkeypatch.setitem(sys.modules, "cupy", None)          # import cupy: ImportError
    monkeypatch.setattr(_cli_common, "usable_gpu", lambda: (None, "no CUDA GPU found"))
    rc, out, err = run(capsys, "fuzz", "--device", "gpu", "--examples", "1", "--quiet")
    assert rc == 2 and out == ""
    assert "--device gpu, but CuPy cannot use a device: no CUDA GPU found" in err


def fake_nvrtc(version, archs):
    return types.SimpleNamespace(version=version, archs=frozenset(archs))


def test_check_skips_arches_no_nvrtc_here_targets(monkeypatch):
    from cuflash import _jit
    monkeypatch.setattr(_jit, "_nvrtc_libraries", lambda: (fake_nvrtc((13, 0), [75, 80, 90]),))
    kept, skipped = cli.targetable_archs(["sm_70", "sm_80", "sm_90a", "sm_999"])
    assert kept == ["sm_80", "sm_90a"]
    assert skipped == [
        "sm_70: the NVRTC here (13.0) does not target it; NVRTC 12 still does: "
        "pip install nvidia-cuda-nvrtc-cu12",
        "sm_999: the NVRTC here (13.0) does not target it"]
    monkeypatch.setattr(_jit, "_nvrtc_libraries",
                        lambda: (fake_nvrtc((13, 0), [80]), fake_nvrtc((12, 9), [70, 80])))
    assert cli.targetable_archs(["sm_70", "sm_80"]) == (["sm_70", "sm_80"], [])
    monkeypatch.setattr(_jit, "_nvrtc_libraries", lambda: ())
    assert cli.targetable_archs(["sm_80"]) == (
        [], ["sm_80: no NVRTC found (pip install cuflash[cuda13])"])


def test_check_with_nothing_to_compile_says_so(monkeypatch, capsys):
    from cuflash import _jit
    monkeypatch.setattr(_jit, "_nvrtc_libraries", lambda: (fake_nvrtc((13, 0), [80]),))
    rc, out, err = run(capsys, "check", "--arch", "sm_70")
    assert rc == 1
    assert "skipped sm_70: the NVRTC here (13.0) does not target it" in err
    assert "no requested architecture can be compiled here" in err


@pytest.mark.parametrize("with_progress", [True, False])
def test_check_all_with_or_without_a_progress_callback(with_progress):
    calls = []

    def check_all_plain(archs):
        calls.append(list(archs))
        return [f"report {a}" for a in archs]

    def check_all_progress(archs, progress=None):
        calls.append(list(archs))
        for i in range(3):
            progress(i + 1, 3)
        return ["r1", "r2", "r3"]

    stream = io.StringIO()
    bar = Progress(label="compiling", stream=stream)
    if with_progress:
        assert cli.run_check_all(check_all_progress, ["sm_80", "sm_90a"], bar) == ["r1", "r2", "r3"]
        assert calls == [["sm_80", "sm_90a"]] and bar.done == 3 and bar.total == 3
    else:
        assert cli.run_check_all(check_all_plain, ["sm_80", "sm_90a"], bar) == [
            "report sm_80", "report sm_90a"]
        assert calls == [["sm_80"], ["sm_90a"]] and bar.done == 2 and bar.total == 2
    assert "compiling [" in stream.getvalue()


class FakeRuntime:
    def __init__(self, driver, error=None, count=1):
        self.driver, self.error, self.count = driver, error, count

    def driverGetVersion(self):
        return self.driver

    def runtimeGetVersion(self):
        return 13000

    def getDeviceCount(self):
        if self.error:
            raise RuntimeError(self.error)
        return self.count


def fake_cupy(runtime):
    return types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=runtime))


@pytest.mark.parametrize("runtime, reason", [
    (FakeRuntime(0, "cudaErrorInsufficientDriver: CUDA driver version is insufficient"),
     "no CUDA GPU found (no NVIDIA driver is installed or loaded)"),
    (FakeRuntime(12040, "cudaErrorNoDevice: no CUDA-capable device is detected"),
     "no CUDA GPU found"),
    (FakeRuntime(12040, "cudaErrorInsufficientDriver: CUDA driver version is insufficient"),
     "the NVIDIA driver (CUDA 12.4) is older than this CuPy's CUDA runtime (13.0)"),
    (FakeRuntime(13000, count=0), "no CUDA GPU found"),
    (FakeRuntime(13000), None),
])
def test_gpu_unavailable_reason(runtime, reason):
    got = cli.gpu_unavailable_reason(fake_cupy(runtime))
    assert got is None or "insufficient" not in got
    assert got == reason if reason is None or reason == "no CUDA GPU found" else reason in got


def test_progress_off_a_terminal_prints_tenths():
    stream = io.StringIO()
    with Progress(total=100, label="work", stream=stream) as bar:
        for _ in range(100):
            bar.advance()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 11  # the start, then 10%, 20%, ..., 100%, and no repeat at close
    assert lines[-1].startswith("work [" + "#" * 30 + "] 100/100 100%")


def test_progress_on_a_terminal_redraws_one_line():
    class Tty(io.StringIO):
        def isatty(self):
            return True
    stream = Tty()
    with Progress(total=4, stream=stream, interval=0) as bar:
        bar.update(2)
        assert bar.line().startswith("[" + "#" * 15 + "." * 15 + "] 2/4  50%")
    text = stream.getvalue()
    assert text.count("\r") >= 2 and text.endswith("\n") and text.count("\n") == 1
    silent = io.StringIO()
    with Progress(total=4, stream=silent, enabled=False) as bar:
        bar.advance(4)
    assert silent.getvalue() == ""


def test_blas_single_threaded_restores_the_thread_count():
    if not _blas.available():
        with _blas.single_threaded() as done:
            assert done is False
        return
    get, set_ = _blas._openblas()
    before = get()
    with _blas.single_threaded() as done:
        assert done is True and get() == 1
        with _blas.single_threaded():
            assert get() == 1
        assert get() == 1
    assert get() == before


def test_check_uses_the_registry_gate_with_progress(monkeypatch, capsys):
    """check runs the registry's gate (``_families.check``) with a progress callback, only for
    the arches an NVRTC here targets, and prints the table and the summary."""
    from cuflash import _families, _jit
    monkeypatch.setattr(_jit, "_nvrtc_libraries", lambda: (fake_nvrtc((13, 0), [80, 90]),))
    seen = {}

    def check(archs, progress=None, workers=None):
        seen["archs"] = list(archs)
        progress(1, 2)
        progress(2, 2)
        return [_jit.CompileReport(arch=a, source="fwd_simt.cu", expr=f"k<{a}>", registers=32,
                                   spill_stores=0, spill_loads=0, stack=0, shared=0)
                for a in archs]
    monkeypatch.setattr(_families, "check", check)
    rc, out, err = run(capsys, "check", "--arch", "sm_70", "--arch", "sm_80")
    assert rc == 0 and seen["archs"] == ["sm_80"]
    assert "skipped sm_70: the NVRTC here (13.0) does not target it" in err
    assert "compiling for sm_80 [" in err and "2/2 100%" in err
    assert "1 compilations (sm_80): all ok" in out and "skipped 1 arch(es)" in out


def test_bench_plot_fits_every_panel(monkeypatch, tmp_path):
    """The panels share a y axis; its range fits the highest line of any panel (it used to
    be the first panel's, which cut the d = 128 lines off the H200 plots)."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt
    from cuflash import _bench
    rows = [_bench.make_row("cuflash", "t", "fwd", "bf16", d, 1024, False, 16, 32, ms=ms)
            for d, ms in ((64, 1.0), (128, 0.1))]
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    _bench.plot(rows, tmp_path / "p.png")
    highest = max(r["tflops"] for r in rows)
    assert [ax.get_ylim()[1] >= highest for ax in figures[0].axes] == [True, True]


def test_output_piped_into_a_closed_reader_is_no_traceback():
    """``python -m cuflash demo | head -2``: the reader closes the pipe early; no
    BrokenPipeError traceback, exit status 1."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    read_end, write_end = os.pipe()
    os.close(read_end)                               # the reader has gone
    script = ("import sys, cuflash.__main__ as m; m.cmd_info = lambda a: print('y' * 2**16) "
              "or 0; sys.exit(m.main(['info']))")
    try:
        r = subprocess.run([sys.executable, "-c", script], cwd=Path(__file__).parent.parent,
                           stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(write_end)
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr and "BrokenPipe" not in r.stderr


def test_bench_suite_draws_a_progress_bar_and_lists_skips_after_it(monkeypatch, capsys):
    """run_short (the GPU suite) on a stand-in for CuPy built from NumPy, with the timing
    stubbed: one bar over every (point, implementation), then the skip reasons."""
    import sys

    import numpy as np

    from cuflash import _bench
    fake_cupy = types.SimpleNamespace(
        float32=np.float32, inf=np.inf, triu=np.triu, full=np.full,
        random=types.SimpleNamespace(RandomState=lambda seed: types.SimpleNamespace(
            standard_normal=lambda shape, dtype: np.zeros(shape, dtype))),
        get_default_memory_pool=lambda: types.SimpleNamespace(free_all_blocks=lambda: None))
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy)
    monkeypatch.setattr(_bench, "_sdpa_peers", lambda: {})
    monkeypatch.setattr(_bench, "batch_heads", lambda L, d: (1, 1))

    def timed(cp, fn, budget_s):
        if fn.__code__.co_names[-1:] == ("naive_attention",):
            raise MemoryError("out of memory")
        return 1.0
    monkeypatch.setattr(_bench, "_median_ms", timed)
    rows = _bench.run_short(0.01)
    points = len(_bench.SHORT_D) * len(_bench.SHORT_L) * 2
    assert len(rows) == 2 * points
    assert [r["impl"] for r in rows[:2]] == ["cuflash", "naive_cupy"]
    assert all(r["ms"] == 1.0 for r in rows[::2]) and all(r["skipped"] for r in rows[1::2])
    err = capsys.readouterr().err
    assert f"] {2 * points}/{2 * points} 100%" in err
    skips = [line for line in err.splitlines() if line.startswith("skipped ")]
    assert len(skips) == points and skips[0].endswith("naive_cupy: MemoryError: out of memory")
    assert err.index(f"{2 * points}/{2 * points}") < err.index(skips[0])
