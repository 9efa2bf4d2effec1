"""The lab harness (bench/bench_attention.py) and bench/host_overhead.py on the CPU: the suite
registry, the cases, the input rotation and iteration rules, the isolated-call timing with a
fake clock, the reports, ``--load`` of the committed results, and the host-overhead rows."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "h200"


def _load(name: str):
    if str(ROOT / "bench") not in sys.path:
        sys.path.insert(0, str(ROOT / "bench"))       # host_overhead imports bench_attention
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


ba = _load("bench_attention")
ho = _load("host_overhead")


# --- suites and cases -------------------------------------------------------------------------

def test_suite_registry_runs_todays_suites_and_names_the_planned_ones():
    ready = {n for n, s in ba.SUITES.items() if s.run is not None}
    assert ready == {"fwd", "fwd_bwd", "fwd_fp32", "memory"}
    assert {"decode", "varlen", "mods", "scaling"} <= set(ba.SUITES) - ready
    assert ba.get_suite("fwd").name == "fwd"
    with pytest.raises(ValueError, match=r"unknown suite 'nope'; suites: fwd, fwd_bwd"):
        ba.get_suite("nope")
    for name in ("decode", "varlen", "mods"):
        script = f"bench/suite_{name}.py"
        assert ba.SUITES[name].script == script
        with pytest.raises(ValueError, match=f"suite '{name}' runs as a script of its own, "
                                             f"with its own options: python {script} --help"):
            ba.get_suite(name)
    with pytest.raises(ValueError, match="not implemented yet.*ring attention"):
        ba.get_suite("scaling")


def test_suite_peers():
    assert ba.SUITES["fwd"].impls[:4] == ("cuflash", "naive_cupy", "sdpa_flash", "sdpa_cudnn")
    assert "jax_cudnn" in ba.SUITES["fwd"].impls and "sdpa_efficient" in ba.SUITES["fwd"].impls
    assert "naive_cupy" not in ba.SUITES["fwd_bwd"].impls      # it has no backward
    assert ba.SUITES["fwd_fp32"].impls == ("cuflash", "naive_cupy")
    for s in ba.SUITES.values():
        assert set(s.impls) <= set(ba.IMPLS)


def test_default_cases():
    fwd = ba.SUITES["fwd"].cases()
    assert len(fwd) == 3 * 3 * 2
    assert {(c.d, c.L) for c in fwd} == {(d, L) for d in (64, 128, 256)
                                         for L in (1024, 4096, 16384)}
    for c in fwd:
        assert c.B * c.L == 16384 and c.H * c.d == 2048 and c.dtype == "bf16"
        assert c.suite == "fwd" and c.mode == "fwd" and not c.isolated
    fb = ba.SUITES["fwd_bwd"].cases()
    assert len(fb) == 2 * 3 * 2 and {c.mode for c in fb} == {"fwd_bwd"}
    assert fb[0].flops == 4 * 16384 * 1024 * 2048 * 7 // 2
    mem = ba.SUITES["memory"].cases()
    assert [c.L for c in mem] == list(ba.MEMORY_L)
    assert {(c.B, c.H, c.d, c.mode) for c in mem} == {(1, 16, 128, "memory")}
    fp32 = ba.SUITES["fwd_fp32"].cases()
    assert {(c.dtype, c.causal) for c in fp32} == {("fp32", False)} and len(fp32) == 4


def test_isolated_cases():
    iso = ba.SUITES["fwd"].cases(isolated=True)
    assert len(iso) == 3 * 2 * 2
    assert {c.L for c in iso} == {512, 1024} and all(c.isolated for c in iso)
    assert {(c.B, c.H) for c in iso if c.L == 512 and c.d == 128} == {(32, 16)}
    assert iso[0].row("cuflash", ms=1.0)["isolated"] is True
    with pytest.raises(ValueError, match="no isolated mode"):
        ba.SUITES["memory"].cases(isolated=True)


def test_cases_take_overrides_in_table_order():
    cases = ba.SUITES["fwd"].cases(["bf16", "fp16"], [64], [1024, 4096], [True])
    assert [(c.dtype, c.L) for c in cases] == [("bf16", 1024), ("bf16", 4096),
                                               ("fp16", 1024), ("fp16", 4096)]
    with pytest.raises(ValueError, match="must divide"):
        ba.SUITES["fwd"].cases(Ls=[3000])


def test_case_row_has_the_row_fields():
    c = ba.SUITES["fwd_bwd"].cases(ds=[128], Ls=[4096], causals=[True])[0]
    row = c.row("cuflash", ms=2.0, iters=50)
    assert {k: row[k] for k in ("impl", "suite", "mode", "dtype", "d", "L", "causal",
                                "isolated")} == {
        "impl": "cuflash", "suite": "fwd_bwd", "mode": "fwd_bwd", "dtype": "bf16", "d": 128,
        "L": 4096, "causal": True, "isolated": False}
    assert row["tflops"] == pytest.approx(c.flops / 2e-3 / 1e12) and row["ms"] == 2.0


# --- rotation, iterations, paths ---------------------------------------------------------------

def test_input_rotation_spans_twice_l2():
    l2 = 60 * 2**20
    assert ba.n_input_sets(500 * 2**20, l2) == 1
    assert ba.n_input_sets(2 * l2, l2) == 1
    assert ba.n_input_sets(l2, l2) == 2
    assert ba.n_input_sets(10 * 2**20, l2) == 12
    assert ba.n_input_sets(1, l2) == ba.MAX_INPUT_SETS
    for size in (1 * 2**20, 7 * 2**20, 50 * 2**20):
        n = ba.n_input_sets(size, l2)
        assert n * size >= 2 * l2 or n == ba.MAX_INPUT_SETS
    with pytest.raises(ValueError):
        ba.n_input_sets(0)


def test_iteration_count():
    assert ba.n_iters(1.0, 0.5) == ba.MIN_ITERS
    assert ba.n_iters(0.001, 0.5) == 500
    assert ba.n_iters(1e-7, 0.5) == ba.MAX_ITERS
    assert ba.n_iters(0.0) == ba.MAX_ITERS


def test_naive_limit():
    assert ba.naive_fits(1, 32, 16384, 16384)              # 34 GB under 40 GB
    assert not ba.naive_fits(1, 16, 32768, 32768, ba.NAIVE_MEMORY_LIMIT_BYTES)   # 68.7 GB


def test_result_paths():
    assert ba.results_dir_for("NVIDIA H200") == ROOT / "bench" / "results" / "h200"
    assert ba.results_dir_for("NVIDIA GeForce RTX 4090").name == "4090"
    assert ba.results_dir_for("").name == "unknown-gpu"
    assert ba.result_name("fwd", False) == "fwd.json"
    assert ba.result_name("fwd", True) == "fwd_isolated.json"


# --- timing logic with fake clocks -------------------------------------------------------------

class FakeClock:
    """Records the order of operations; each timed call "takes" 1 ms more than the last."""

    def __init__(self):
        self.log = []
        self.n = 0

    def sync(self):
        self.log.append("sync")

    def start(self):
        self.log.append("start")
        return len(self.log)

    def stop(self, token, result):
        self.log.append(("stop", result))
        self.n += 1
        return float(self.n)


def test_isolated_timing_idles_before_every_call_and_brackets_it():
    clock, slept, calls = FakeClock(), [], []

    def fn(i):
        calls.append(i)
        clock.log.append("call")
        return f"r{i}"

    ms = ba.time_isolated(fn, n_sets=2, reps=3, clock=clock, idle_s=0.004,
                          sleep=lambda s: (slept.append(s), clock.log.append("sleep")))
    assert ms == [1.0, 2.0, 3.0]
    assert calls == [0, 1, 0]                     # input sets rotate
    assert slept == [0.004] * 3
    one = ["sync", "sleep", "start", "call"]
    assert clock.log == (one + [("stop", "r0")] + one + [("stop", "r1")] + one
                         + [("stop", "r0")])
    with pytest.raises(ValueError):
        ba.time_isolated(fn, 1, 0, clock)


def test_host_clock_blocks_on_the_result():
    blocked = []
    clock = ba.HostClock(block=blocked.append, sync=lambda: None)
    t = clock.start()
    ms = clock.stop(t, "result")
    assert blocked == ["result"] and ms >= 0


def test_measure_isolated_uses_the_impls_clock():
    class HostImpl(ba.Impl):
        name = "fake"
        timing = "host"

        def __init__(self):
            self.blocked = 0

        def block(self, result):
            self.blocked += 1

        def sync(self):
            pass

    impl = HostImpl()
    case = ba.SUITES["fwd"].cases(ds=[64], Ls=[512], causals=[False], isolated=True)[0]
    opts = ba.Options(reps=5, idle_ms=0.1)
    ms, n = ba.measure(impl, lambda i: i, 1, case, opts)
    assert n == 5 and impl.blocked == 5 and ms >= 0


def test_host_batches_divide_by_calls():
    seen = []
    ms = ba.time_host_batches(lambda i: seen.append(i), n_sets=3, batches=2, per_batch=4,
                              block=lambda r: None, sync=lambda: None)
    assert len(ms) == 2 and seen == [0, 1, 2, 0, 1, 2, 0, 1]


# --- implementations that run on the CPU path ---------------------------------------------------

def test_cuflash_impl_runs_forward_and_backward_on_numpy():
    from cuflash import reference
    rng = np.random.default_rng(0)
    shape = (1, 2, 16, 8)
    s = ba.InputSet(*(rng.standard_normal(shape) for _ in range(4)))
    fwd = ba.Case("fwd", "fwd", "fp32", 8, 16, True, 1, 2)
    o = ba.CuflashImpl().prepare(fwd, [s], 0.3)(0)
    np.testing.assert_allclose(o, reference.attention(s.q, s.k, s.v, scale=0.3, causal=True),
                               rtol=1e-10, atol=1e-10)
    grads = ba.CuflashImpl().prepare(ba.dataclasses.replace(fwd, mode="fwd_bwd"), [s], 0.3)(0)
    want = reference.attention_backward(s.do, s.q, s.k, s.v, scale=0.3, causal=True)
    for g, w in zip(grads, want):
        np.testing.assert_allclose(g, w, rtol=1e-8, atol=1e-8)


def test_cuflash_sm80_sets_the_launcher_env_only_around_the_call(monkeypatch):
    import cuflash
    seen = []
    monkeypatch.delenv("CUFLASH_FWD", raising=False)
    monkeypatch.setenv("CUFLASH_BWD", "auto")
    monkeypatch.setattr(cuflash, "attention", lambda *a, **kw: seen.append(
        (os.environ.get("CUFLASH_FWD"), os.environ.get("CUFLASH_BWD"))))
    case = ba.Case("fwd", "fwd", "bf16", 64, 1024, False, 16, 32)
    ba.CuflashSm80Impl().prepare(case, [ba.InputSet(1, 2, 3, None)], 0.125)(0)
    assert seen == [("sm80", "sm80")]
    assert "CUFLASH_FWD" not in os.environ and os.environ["CUFLASH_BWD"] == "auto"


def test_make_impls_names():
    names = list(ba.IMPLS)
    assert [i.name for i in ba.make_impls(names)] == names
    assert ba.make_impls(["naive_cupy"], memory=True)[0].limit == ba.NAIVE_MEMORY_LIMIT_BYTES


def test_skip_reason_keeps_torchs_real_explanation():
    import warnings

    def w(text):
        return warnings.WarningMessage(text, UserWarning, "x.py", 1)
    caught = [w("Memory efficient kernel not used because: (Triggered internally at /a.cpp:9.)"),
              w("Memory Efficient attention has been runtime disabled. (Triggered internally "
                "at /a.cpp:1.)"),
              w("Expected query, key and value to all be of dtype: {Half, BFloat16}. Got Query "
                "dtype: float (Triggered internally at /b.cpp:2.)")]
    msg = ba.short_error(RuntimeError("No available kernel. Aborting execution."), caught)
    assert msg == ("RuntimeError: No available kernel. Aborting execution. [Expected query, key "
                   "and value to all be of dtype: {Half, BFloat16}. Got Query dtype: float]")


# --- reports, command line, committed results --------------------------------------------------

def test_report_has_memory_and_skips():
    case = ba.SUITES["memory"].cases(Ls=[4096])[0]
    rows = [case.row("cuflash", peak_extra_bytes=2**20),
            case.row("naive_cupy", skipped="too big")]
    text = ba.report({"gpu": "G"}, rows)
    assert "naive_cupy: too big (1 row)" in text
    assert text.splitlines()[-1].split() == ["bf16", "1", "16", "128", "4096", "no", "1.0", "-"]
    assert "TFLOP/s" not in text


def test_main_errors_are_one_line(capsys):
    for argv, why in ((["--suite", "decode"], "bench/suite_decode.py"), (["--suite", "x"], "unknown suite"),
                      (["--suite", "memory", "--isolated"], "no isolated mode"),
                      (["--load", "/nonexistent/r.json"], "No such file")):
        assert ba.main(argv) == 2
        err = capsys.readouterr().err
        assert why in err and len(err.strip().splitlines()) == 1


def test_list(capsys):
    assert ba.main(["--list"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("fwd ") and "planned" in out
    assert "[script: bench/suite_decode.py]" in out


@pytest.mark.parametrize("name, isolated, converted", [
    ("fwd", False, False), ("fwd_bwd", False, False), ("fwd_isolated", True, False),
    ("fwd_fp32", False, True), ("memory", False, True)])
def test_committed_results_are_in_the_row_format(name, isolated, converted, capsys):
    doc = json.loads((RESULTS / f"{name}.json").read_text())
    h = doc["header"]
    suite = name.replace("_isolated", "")
    assert h["gpu"] == "NVIDIA H200" and h["suite"] == suite and h["isolated"] is isolated
    assert {"driver", "cupy", "torch", "git", "command"} <= set(h)
    if converted:     # session 2 files, converted to the row format (bench/NOTES.md)
        assert h["converted_from"].startswith("bench/results/2026-11-29-h200-")
    else:             # measured by bench/bench_attention.py itself
        assert "converted_from" not in h and h["measured_code"]
    for r in doc["rows"]:
        assert r["suite"] == suite and r["isolated"] is isolated
        assert {"impl", "mode", "dtype", "d", "L", "causal", "tflops", "ms"} <= set(r)
        if r.get("tflops"):
            assert r["tflops"] == pytest.approx(r["flops"] / (r["ms"] * 1e9))
    assert ba.main(["--load", str(RESULTS / f"{name}.json")]) == 0
    assert ("converted from" in capsys.readouterr().out) is converted


def test_committed_fwd_bwd_ratios_are_the_session_20_evidence():
    # bench/NOTES.md, "Session 20 ... the suites on the final code": 1.19-1.34x SDPA flash at all
    # 12 bf16 points (session 17: 1.19-1.29; session 16: 1.21-1.27; session 8's file: 1.14-1.24;
    # the text there and this file must agree)
    _, rows = ba.read_json(RESULTS / "fwd_bwd.json")
    by = {(r["impl"], r["d"], r["L"], r["causal"]): r["tflops"] for r in rows}
    ratios = [by[("cuflash", d, L, c)] / by[("sdpa_flash", d, L, c)]
              for d in (64, 128) for L in (1024, 4096, 16384) for c in (False, True)]
    assert len(ratios) == 12 and 1.19 <= min(ratios) and max(ratios) <= 1.34


def test_only_current_results_are_committed():
    names = sorted(p.name for p in (ROOT / "bench" / "results").iterdir())
    # logs/: ignored by git, never committed; cpu/: the CPU path against naive NumPy
    # (bench/cpu_bench.py)
    assert [n for n in names if n != "cpu"] in (["h200"], ["h200", "logs"])
    assert not (ROOT / "bench" / "results" / "EVIDENCE.md").exists()


def test_git_describe_in_checkout():
    import shutil
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    desc = ba.git_describe()
    assert desc is not None and len(desc.split("+")[0]) == 12


def test_env_restores():
    os.environ.pop("CUFLASH_TEST_X", None)
    with ba.env(CUFLASH_TEST_X="1"):
        assert os.environ["CUFLASH_TEST_X"] == "1"
    assert "CUFLASH_TEST_X" not in os.environ
    os.environ["CUFLASH_TEST_X"] = "2"          # None unsets for the block, then restores
    try:
        with ba.env(CUFLASH_TEST_X=None, CUFLASH_TEST_Y="3"):
            assert "CUFLASH_TEST_X" not in os.environ and os.environ["CUFLASH_TEST_Y"] == "3"
        assert os.environ["CUFLASH_TEST_X"] == "2" and "CUFLASH_TEST_Y" not in os.environ
    finally:
        os.environ.pop("CUFLASH_TEST_X", None)


# --- host overhead -----------------------------------------------------------------------------

def test_overhead_row():
    r = ho.overhead_row("cuflash", 2000, [0.030, 0.020, 0.040], [0.031, 0.021, 0.041])
    assert r["impl"] == "cuflash" and r["us_per_call"] == pytest.approx(15.0)
    assert r["us_per_call_drained"] == pytest.approx(15.5) and r["gpu_bound"] is False
    assert r["calls"] == 2000 and r["repeats"] == 3
    slow = ho.overhead_row("x", 1000, [0.010], [0.020])        # the queue took twice as long
    assert slow["gpu_bound"] is True
    with pytest.raises(ValueError):
        ho.overhead_row("x", 0, [1.0], [1.0])
    with pytest.raises(ValueError):
        ho.overhead_row("x", 10, [], [])


def test_time_loop_with_a_fake_clock():
    t = iter([0.0, 0.5, 0.8])
    events = []
    issue, drained = ho.time_loop(lambda: events.append("call"), 3,
                                  sync=lambda: events.append("sync"), clock=lambda: next(t))
    assert (issue, drained) == (0.5, 0.8)
    assert events == ["sync", "call", "call", "call", "sync"]


def test_overhead_table():
    rows = [ho.overhead_row("cuflash", 100, [0.003], [0.003]),
            ho.overhead_row("sdpa_flash", 100, [0.0015], [0.0015]),
            ho.overhead_row("cupy_empty_kernel", 100, [0.0005], [0.002])]
    lines = ho.format_rows(rows).splitlines()
    assert lines[0].split()[:2] == ["impl", "us/call"]
    assert lines[2].split() == ["cuflash", "30.0", "30.0", "2.00", "-", "-", "ok"]
    assert lines[4].split()[-1] == "GPU-BOUND"
    # behind the spin: a GPU time near the back-to-back figure marks the row queue-bound
    row = ho.spin_row(rows[0], 100, [0.002], [0.0029], [True])
    assert row["us_per_call_behind_spin"] == pytest.approx(20.0)
    assert row["gpu_us_per_call"] == pytest.approx(29.0) and row["queue_bound"] is True
    assert ho.format_rows([row]).splitlines()[2].split() == [
        "cuflash", "30.0", "30.0", "-", "20.0", "29.0", "QUEUE-BOUND"]
    short = ho.spin_row(rows[1], 100, [0.001], [0.0001], [True, False][1:])
    assert short["queue_bound"] is False and short["spin_outlasted"] is False
    assert ho.format_rows([short]).splitlines()[2].split()[-3:] == ["spin", "too", "short"]
    with pytest.raises(ValueError):
        ho.spin_row(rows[0], 100, [0.001], [], [])


def test_clock_samples_and_the_clocked_loop():
    # 19,800 cycles in 10,000 ns is 1980 MHz; a sample with no time is dropped
    assert ho.clock_mhz([(19_800, 10_000), (9_000, 10_000), (15_000, 10_000)]) == \
        pytest.approx(1500.0)
    assert ho.clock_mhz([(5, 0), (7_000, 10_000)]) == pytest.approx(700.0)
    with pytest.raises(ValueError):
        ho.clock_mhz([])
    t, events = iter([1.0, 3.0]), []
    issue = ho.clocked_loop(lambda: events.append("call"), 2 * ho.CLOCK_EVERY + 1,
                            lambda i: events.append(("sample", i)),
                            sync=lambda: events.append("sync"), clock=lambda: next(t))
    assert issue == 2.0
    samples = [e for e in events if isinstance(e, tuple)]
    assert samples == [("sample", 0), ("sample", 1), ("sample", 2)]
    assert events[0] == "sync" and events[1] == "call" and events[2] == ("sample", 0)
    assert events.count("call") == 2 * ho.CLOCK_EVERY + 1 and events[-1] == "sync"
    # the table grows three columns when a row carries the clocks
    row = dict(ho.overhead_row("cuflash_backward", 100, [0.003], [0.003]),
               sm_mhz_in_loop=900.0, sm_mhz_behind_spin=1980.0, us_per_call_beside_spin=18.5)
    lines = ho.format_rows([row, ho.overhead_row("x", 100, [0.001], [0.001])]).splitlines()
    assert "MHz in loop" in lines[0] and lines[0].rstrip().endswith("us/call beside spin")
    assert lines[2].split()[-3:] == ["900", "1980", "18.5"]
    assert lines[3].split()[-3:] == ["-", "-", "-"]


def test_behind_spin_issues_every_call_while_the_spin_runs():
    class Ev:
        def __init__(self, name, done=False):
            self.name, self.done = name, done
    log, t = [], iter([1.0, 1.5, 3.0, 3.2])
    issue, gpu, outlasted = ho.behind_spin(
        lambda: log.append("call"), 2, 2,
        spin=lambda s: log.append(f"spin {s * 1e6:.0f}us") or Ev("spun"),
        event=lambda: log.append("event") or Ev("end", True),
        sync=lambda: log.append("sync"),
        elapsed=lambda a, b: (a.name, b.name) == ("spun", "end") and 0.25,
        clock=lambda: next(t))
    assert issue == [0.5, pytest.approx(0.2)] and gpu == [0.25, 0.25]
    assert outlasted == [True, True]
    assert log == ["sync", "spin 400us", "call", "call", "event", "sync"] * 2


def test_host_overhead_without_gpu_fails_clearly(capsys):
    from cuflash import __main__ as cli
    if cli.usable_gpu()[0] is not None:
        pytest.skip("a GPU is present")
    assert ho.main(["--no-json"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


# --- run_perf end to end on the CPU: cuflash's NumPy path, a CuPy stand-in made of NumPy ----------

class _FakeEvent:
    def record(self, stream=None):
        import time
        self.t = time.perf_counter()

    def synchronize(self):
        pass


def _fake_cupy():
    import types
    ns = types.SimpleNamespace

    class RandomState:
        def __init__(self, seed):
            self.rs = np.random.RandomState(seed)

        def standard_normal(self, shape, dtype):
            return self.rs.standard_normal(shape).astype(dtype)

    return ns(float32=np.float32, random=ns(RandomState=RandomState),
              cuda=ns(Device=lambda *a: ns(synchronize=lambda: None, id=0), Event=_FakeEvent,
                      get_elapsed_time=lambda a, b: (b.t - a.t) * 1e3),
              get_default_memory_pool=lambda: ns(free_all_blocks=lambda: None))


class _Unavailable(ba.Impl):
    name = "sdpa_flash"

    def available(self):
        return "ModuleNotFoundError: torch"


class _Failing(ba.Impl):
    name = "sdpa_cudnn"

    def prepare(self, case, sets, scale):
        def fn(i):
            raise RuntimeError("No available kernel.\nmore")
        return fn


def test_run_perf_end_to_end_on_the_cpu(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy())
    monkeypatch.setattr(ba.Impl, "release", lambda self: None)
    cases = [ba.Case("fwd", "fwd", "fp32", 8, 16, False, 1, 2),
             ba.Case("fwd_bwd", "fwd_bwd", "fp32", 8, 16, True, 1, 2),
             ba.Case("fwd", "fwd", "fp32", 8, 32, True, 1, 2, isolated=True)]
    opts = ba.Options(budget_s=0.001, reps=3, idle_ms=0.01)
    rows = ba.run_perf(ba.SUITES["fwd"], cases, [ba.CuflashImpl(), _Unavailable(), _Failing()],
                       opts)
    assert [(r["impl"], r["mode"], r["isolated"]) for r in rows] == [
        (i, m, iso) for m, iso in (("fwd", False), ("fwd_bwd", False), ("fwd", True))
        for i in ("cuflash", "sdpa_flash", "sdpa_cudnn")]
    timed = [r for r in rows if r["impl"] == "cuflash"]
    assert all(r["ms"] > 0 and r["tflops"] > 0 and "skipped" not in r for r in timed)
    assert timed[0]["iters"] >= ba.MIN_ITERS and timed[0]["input_sets"] == ba.MAX_INPUT_SETS
    assert timed[2]["iters"] == 3
    assert all(r["skipped"] == "not available: ModuleNotFoundError: torch"
               for r in rows if r["impl"] == "sdpa_flash")
    assert all(r["skipped"] == "RuntimeError: No available kernel."
               for r in rows if r["impl"] == "sdpa_cudnn")
    assert "cuflash/sdpa_flash" in ba.report({"gpu": "cpu"}, rows)


def test_run_perf_stops_at_the_deadline(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy())
    case = ba.Case("fwd", "fwd", "fp32", 8, 16, False, 1, 2)
    rows = ba.run_perf(ba.SUITES["fwd"], [case], [ba.CuflashImpl()], ba.Options(deadline=0.0))
    assert rows[0]["skipped"].startswith("time budget") and rows[0]["ms"] is None


def test_gpu_run_script_parts(tmp_path):
    import shutil
    import subprocess
    if shutil.which("bash") is None:
        pytest.skip("no bash")
    script = ROOT / "bench" / "gpu_run.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    text = script.read_text()
    for part in ("tests", "gate", "bench", "isolated", "overhead", "sanitize", "correctness",
                 "pending"):
        assert f"part_{part}()" in text
    # the pending part's probes exist (their names: the first word of each quoted entry)
    pending = text[text.index("part_pending()"):text.index("part_sanitize()")]
    probes = re.findall(r'"(\w+\.py) ', pending)
    assert len(probes) == 4 and all((ROOT / "bench" / "probes" / p).is_file() for p in probes)
    assert "HYPOTHESIS_PROFILE=${TESTS_PROFILE:-gpu}" in text and "bench/sanitize.sh" in text
    # the worker count reaches pytest-xdist past setup.cfg's --maxprocesses cap (session 17)
    assert '--maxprocesses "${TESTS_WORKERS:-15}"' in text
    assert "bench/fuzz_merge.py" in text
    assert "-m cuflash check" in text
    env = dict(os.environ, OUT=str(tmp_path))
    r = subprocess.run(["bash", str(script), "nope"], capture_output=True, text=True, env=env)
    assert r.returncode == 2 and "unknown part 'nope'" in r.stderr
    r = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env)
    assert r.returncode == 2 and "Parts" in r.stdout


def test_host_overhead_cpu_state_and_python_reference(tmp_path):
    """The header names the CPU and its mean clock (from /proc/cpuinfo, None where unreadable)
    and the pure-Python reference call runs without CUDA, returning what its lookup found."""
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Some CPU @ 2.00GHz\ncpu MHz\t\t: 2000.000\n"
                    "processor\t: 1\nmodel name\t: Some CPU @ 2.00GHz\ncpu MHz\t\t: 3000.000\n")
    assert ho.cpu_state(str(info)) == {"cpu_model": "Some CPU @ 2.00GHz", "cpu_mhz_mean": 2500.0}
    assert ho.cpu_state(str(tmp_path / "missing")) == {"cpu_model": None, "cpu_mhz_mean": None}
    call = ho.python_reference()
    assert call() == call() == 4 << 40


def test_warm_arms_runs_every_job_under_each_arms_environment_and_reports_failures(monkeypatch,
                                                                                     capsys):
    """suite_common.warm_arms (the probes' compile warm-up): every job once per arm, under
    that arm's environment, FlexAttention's warm-up once beside the first arm, a failure
    printed rather than raised (the timed run reports it)."""
    import types
    sc = _load("suite_common")
    synced = []
    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(
        Device=lambda: types.SimpleNamespace(synchronize=lambda: synced.append(1))))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    seen, flex = [], []

    def job(n):
        def run():
            seen.append((os.environ.get("CUFLASH_TEST_ARM"), n))
            if n == 2:
                raise RuntimeError("no build")
        return run
    envs = {"old": {"CUFLASH_TEST_ARM": "old"}, "new": {"CUFLASH_TEST_ARM": "new"}}
    sc.warm_arms(["old", "new"], envs, [job(1), job(2)], lambda: flex.append(1), workers=2)
    assert sorted(seen) == [("new", 1), ("new", 2), ("old", 1), ("old", 2)]
    assert flex == [1] and len(synced) == 2 and "CUFLASH_TEST_ARM" not in os.environ
    out = capsys.readouterr().out
    assert out.count("warm-up (old): RuntimeError: no build") == 1
    assert out.count("warm-up (new): RuntimeError: no build") == 1


def test_pending_decide_turns_on_what_won_and_nothing_without_data(tmp_path, capsys):
    """bench/pending_decide.py (the decisions after `gpu_run.sh pending`): on synthetic probe
    files, each switch's rule; with no files, nothing is turned on."""
    pd = _load("pending_decide")
    assert pd.decide(tmp_path)[0] == {}

    def dump(name, rows):
        (tmp_path / name).write_text(json.dumps({"meta": {}, "rows": rows}))
    # LEAN: the window gains 6% at every point, the block masks lose 2% at one
    lean = []
    for d in (64, 128):
        for L in (4096, 16384):
            lean += [dict(impl="old", mask="awindow", d=d, L=L, mode="fwd", tflops=300.0),
                     dict(impl="new", mask="awindow", d=d, L=L, mode="fwd", tflops=318.0)]
    for m, d, new in (("document", 64, 130.0), ("document", 128, 98.0), ("prefix", 64, 101.0)):
        lean += [dict(impl="old", mask=m, d=d, L=4096, mode="fwd", tflops=100.0),
                 dict(impl="new", mask=m, d=d, L=4096, mode="fwd", tflops=new)]
    dump("window_lean.json", lean)
    # tile-major +5% fwd+bwd, the forward unchanged, dQ's rows +1%
    pre = []
    for d in (64, 128):
        pre += [dict(impl="old", mask="prefix", d=d, L=4096, mode="fwd_bwd", tflops=300.0),
                dict(impl="tm", mask="prefix", d=d, L=4096, mode="fwd_bwd", tflops=315.0),
                dict(impl="new", mask="prefix", d=d, L=4096, mode="fwd_bwd", tflops=318.2),
                dict(impl="fwd", mask="prefix", d=d, L=4096, mode="fwd", tflops=350.0),
                dict(impl="fwd_tm", mask="prefix", d=d, L=4096, mode="fwd", tflops=350.0)]
    dump("bmask_s11.json", pre)
    # wg1 +10% at documents, -5% at the window: not taken; wg2 +4% everywhere: taken
    wg = []
    for m in ("document", "window"):
        for d in (64, 128):
            wg += [dict(impl="table", mask=m, d=d, L=4096, mode="fwd", tflops=100.0),
                   dict(impl="wg2", mask=m, d=d, L=4096, mode="fwd", tflops=104.0),
                   dict(impl="wg1", mask=m, d=d, L=4096, mode="fwd",
                        tflops=110.0 if m == "document" else 95.0)]
    dump("bmask_short_wg.json", wg)
    # decode: the cuts save 0.5%, "all" no better than "one", the arrival 0.1% (below the bar)
    dec = []
    for B, h, L in ((8, 8, 8192), (8, 8, 65536), (8, 8, 131072), (8, 32, 8192), (64, 8, 8192),
                    (1, 8, 131072)):
        p = dict(B=B, Hq=32, Hkv=h, Lk=L)
        dec += [dict(p, impl="cuflash_old", ms=100.5), dict(p, impl="cuflash", ms=100.0),
                dict(p, impl="cuflash_one", ms=100.0), dict(p, impl="cuflash_early", ms=100.1)]
    dump("decode_ab_s11.json", dec)
    env, why = pd.decide(tmp_path)
    assert env == {"CUFLASH_FWD90_LEAN": "window", "CUFLASH_BMASK_TILE_MAJOR": "both",
                   "CUFLASH_BWD90_DQ_ROWS": "1", "CUFLASH_FWD90_BMASK_SHORT_WG": "2",
                   "CUFLASH_DECODE_EARLY": "one"}
    assert any(line.startswith("LEAN window new/old: 1.060") for line in why)
    assert pd.main([str(tmp_path)]) == 0
    assert "export CUFLASH_DECODE_EARLY=one" in capsys.readouterr().out


def test_time_arm_rows_and_dump_probe(monkeypatch, tmp_path):
    """suite_common.time_arm (one arm of a probe's point): the row under the arm's switches,
    with TFLOP/s from the median and what ``describe`` adds; a failure is a row with its note,
    not an exception. dump_probe writes the probe's file with its meta."""
    sc = _load("suite_common")
    seen = []
    monkeypatch.setattr(sc, "median_event_ms", lambda fn, n, iters, warmup: 2.0)
    monkeypatch.delenv("CUFLASH_PROBE_TEST", raising=False)

    def describe():
        seen.append(os.environ.get("CUFLASH_PROBE_TEST"))
        return {"fwd_kernel": "k"}
    ms, row = sc.time_arm("new", {"CUFLASH_PROBE_TEST": "1"}, lambda i: None, 4e9,
                          {"mask": "m", "d": 64}, describe)
    assert ms == 2.0 and seen == ["1"] and "CUFLASH_PROBE_TEST" not in os.environ
    assert row == {"mask": "m", "d": 64, "impl": "new", "ms": 2.0, "tflops": 2.0,
                   "fwd_kernel": "k"}

    def fails():
        raise RuntimeError("no kernel\nsecond line")
    ms, row = sc.time_arm("old", {}, lambda i: None, 4e9, {"mask": "m"}, fails)
    assert ms is None and row["tflops"] is None and row["note"].startswith("RuntimeError: no kernel")
    path = tmp_path / "p.json"
    sc.dump_probe(str(path), "probe_x", {"old": {}}, [row], complete=False)
    got = json.loads(path.read_text())
    assert got["meta"] == {"probe": "probe_x", "dtype": "bfloat16", "arms": {"old": {}},
                           "complete": False} and got["rows"] == [row]
    sc.dump_probe(None, "probe_x", {}, [], True)       # no --json: nothing written


def test_median_event_ms_warms_for_a_least_time_then_times_iters_calls(monkeypatch):
    """suite_common.median_event_ms: ``warmup`` calls at the least, then more, each
    synchronised, until ``warm_ms`` of wall time has passed (a short kernel's 3 calls left the
    GPU on a ramping clock: NOTES.md, session 12), at most WARM_CALLS; then ``iters`` timed
    calls, the median event interval returned."""
    import types
    sc = _load("suite_common")
    log = []

    class Event:
        def record(self):
            self.at = len(log)

        def synchronize(self):
            log.append("sync")

    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(
        Device=lambda: types.SimpleNamespace(synchronize=lambda: log.append("sync")),
        Event=Event, get_elapsed_time=lambda s, e: float(e.at - s.at)))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    clock = [0.0]
    monkeypatch.setattr(sc.time, "perf_counter", lambda: clock[0])

    def fn(i, ms=1.0):          # a call "takes" ms of wall time
        log.append(i)
        clock[0] += ms / 1e3
    assert sc.median_event_ms(fn, 2, iters=5, warmup=3, warm_ms=10.0) == 1.0
    calls = [x for x in log if x != "sync"]
    assert len(calls) == 10 + 5                 # 10 ms of 1 ms calls, then the 5 timed
    assert calls[:4] == [0, 1, 0, 1]            # cycling over the 2 input sets
    assert log[:6] == [0, 1, 0, "sync", 1, "sync"]   # synchronised one by one from the 3rd
    log.clear()
    assert sc.median_event_ms(lambda i: fn(i, 50.0), 1, iters=3, warmup=3, warm_ms=10.0) == 1.0
    assert len([x for x in log if x != "sync"]) == 3 + 3      # the 3 warm-up calls suffice
    log.clear()
    monkeypatch.setattr(sc, "WARM_CALLS", 7)
    sc.median_event_ms(lambda i: fn(i, 0.0), 1, iters=2, warmup=3, warm_ms=10.0)
    assert len([x for x in log if x != "sync"]) == 7 + 2      # bounded when time stands still


def test_fwd_ws_probe_logic():
    """bench/probes/fwd_ws.py's pure parts: visible pairs (causal, the window), the rotated arm
    orders of --rounds (every arm first once in as many rounds as arms), the --poly points."""
    sys.path.insert(0, str(ROOT / "bench" / "probes"))
    try:
        import fwd_ws
    finally:
        sys.path.pop(0)
    assert fwd_ws.visible_pairs(8, False, None) == 64
    assert fwd_ws.visible_pairs(8, True, None) == 36
    # window of 2 keys back: rows see 1, 2, 3, 3, 3, ...
    assert fwd_ws.visible_pairs(8, True, 2) == 1 + 2 + 3 * 6
    assert fwd_ws.visible_pairs(3, True, 5) == 6          # the window longer than the rows
    orders = fwd_ws.arm_orders(["a", "b", "c"], 3)
    assert [o[0] for o in orders] == ["a", "b", "c"] and all(sorted(o) == ["a", "b", "c"] for o in orders)
    pts = list(fwd_ws.points([64, 128], [4096], poly=True))
    assert [(d, name) for d, _, name, _ in pts] == [(64, "plain"), (64, "softcap"),
                                                     (128, "plain"), (128, "softcap")]
    poly = fwd_ws.poly_arms([8])
    assert {"ws", "sm90", "ws_poly8"} <= set(poly)
    # (both head dims' tiles, on the dispatcher's schedule)
    assert poly["ws_poly8"]["CUFLASH_TILES"].count(":8") == 2
    assert "CUFLASH_FWD90WS_PERSIST" not in poly["ws_poly8"]
    # every ws arm but the persistent ones runs one block a query tile (session 16's schedule)
    assert all(env.get("CUFLASH_FWD90WS_PERSIST") == "0" for a, env in fwd_ws.ARMS.items() if a != "sm90")
    assert [fwd_ws.PERSIST_ARMS[a]["CUFLASH_FWD90WS_PERSIST"]
            for a in ("ws", "ws_p1", "ws_p2", "ws_p3")] == ["0", "1", "2", "3"]
    assert "CUFLASH_FWD90WS_PERSIST" not in fwd_ws.PERSIST_ARMS["ws_auto"]   # (the rule's)


def test_host_overhead_rounds_interleave_and_take_per_round_ratios():
    """host_overhead.measure_rounds (--rounds, session 19): every implementation's loops in each
    round, the order rotated a round; a row's us_per_call the median of all its loops, its
    per-round figures, and the median of its per-round ratios to sdpa_flash (the host's speed
    cancels where it changes between rounds); an implementation that raises is reported and
    dropped, the others still timed."""
    seen = []
    speed = iter([1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 1.5, 1.5, 1.5])   # the host slows, then partly recovers
    cost = {"cuflash": 10.0, "sdpa_flash": 20.0, "broken": 1.0}

    def loop(fn, calls, sync):
        impl = fn()
        seen.append(impl)
        s = next(speed) if impl != "broken" else 1.0
        return cost[impl] * s * calls * 1e-6, cost[impl] * s * calls * 1e-6

    def boom():
        raise RuntimeError("no peer")
    fns = {"cuflash": lambda: "cuflash", "sdpa_flash": lambda: "sdpa_flash", "other": lambda: "other",
           "broken": boom}
    fns["other"] = lambda: "cuflash"   # (a third implementation costing what cuflash costs)
    rows, failed = ho.measure_rounds(fns, 100, 1, 3, lambda: None, loop=loop)
    assert set(failed) == {"broken"} and set(rows) == {"cuflash", "sdpa_flash", "other"}
    assert seen == ["cuflash", "sdpa_flash", "cuflash"] + ["sdpa_flash", "cuflash", "cuflash"] \
        + ["cuflash", "cuflash", "sdpa_flash"]
    assert rows["cuflash"]["us_per_call_rounds"] == pytest.approx([10.0, 20.0, 15.0])
    assert rows["sdpa_flash"]["us_per_call_rounds"] == pytest.approx([20.0, 40.0, 30.0])
    assert rows["cuflash"]["per_round_ratio_to_base"] == pytest.approx(0.5)
    assert rows["cuflash"]["us_per_call"] == pytest.approx(15.0) and rows["cuflash"]["rounds"] == 3
    assert "per-round / sdpa_flash" in ho.format_rows(list(rows.values()))


def test_window_items_probe_logic():
    """bench/probes/window_items.py (session 21): its least-squares line and its pair counts
    (the window's as fwd_ws's)."""
    sys.path.insert(0, str(ROOT / "bench" / "probes"))
    import window_items
    import fwd_ws
    a, b = window_items.fit([(9, 0.3), (18, 0.5), (36, 0.9)])
    assert abs(a - 0.1) < 1e-12 and abs(b - 1 / 45) < 1e-12          # (on the line t = 0.1 + n / 45)
    a, b = window_items.fit([(9, 1.0), (18, 1.0), (36, 4.0)])          # off it: least squares
    assert abs(b - 45 / 378) < 1e-12 and abs(a - (2.0 - 21 * 45 / 378)) < 1e-12
    assert window_items.visible("window", 0) == fwd_ws.visible_pairs(window_items.L, True, 1024)
    assert window_items.visible("causal", 0) == fwd_ws.visible_pairs(window_items.L, True, None)
    assert window_items.visible("plain9", 1152) == window_items.L * 1152


def test_ws_stamps_phases():
    """bench/probes/ws_stamps.py's reading of the stamps (session 21): per-phase medians over
    the interior items of every (block, consumer), the item's whole time from one start to the
    next, the loop's time a tile and the fixed cost in tiles; the producer's phases and lead."""
    sys.path.insert(0, str(ROOT / "bench" / "probes"))
    import ws_stamps
    st = np.zeros((132, 4, 64, 16), dtype=np.uint64)
    steps = [10, 20, 30, 40, 50, 60, 800, 80, 90, 100, 110]   # consumer phases 0 -> 11
    item = sum(steps) + 5                                       # + 5 from stored to next start
    for b in (0, 7):
        for wg in (1, 2):
            for qi in range(6):
                t = 1000 + qi * item
                for k in range(12):
                    st[b, wg, qi, k] = t
                    t += steps[k] if k < 11 else 0
        for qi in range(6):
            st[b, 0, qi, :4] = [1000 + qi * item + x for x in (0, 3, 8, 100)]
    ph = ws_stamps.phases(st, n_tiles=9)
    assert ph["c_start->work"] == 10 and ph["c_softmax0->loop"] == 800 and ph["c_staged->stored"] == 110
    assert ph["c_stored->next_start"] == 5 and ph["c_item"] == item
    assert ph["c_loop_per_tile"] == 100 and ph["c_fixed_tiles"] == item / 100 - 9
    assert ph["p_start->qfree"] == 3 and ph["p_qfree->stage0"] == 5 and ph["p_stage0->copies"] == 92
    assert ph["lead_stage0_to_k0"] == 10 + 20 + 30 - 8


def test_arm_orders_balance_first_places_and_neighbours():
    """suite_common.arm_orders (session 21): every arm first once in len(arms) rounds, and each
    ordered pair of neighbours equally often over the square (len(arms) rounds, 2 len(arms)
    when odd): an arm timed after a lighter one starts with the clock's headroom."""
    from collections import Counter
    sc = _load("suite_common")
    for n in range(1, 8):
        arms = [f"a{i}" for i in range(n)]
        rows = sc.arm_orders(arms, 2 * n + 1)
        assert len(rows) == 2 * n + 1 and all(sorted(r) == arms for r in rows)
        assert [r[0] for r in rows[:n]] == arms
        square = rows[: n if n % 2 == 0 else 2 * n]
        pairs = Counter((r[i], r[i + 1]) for r in square for i in range(n - 1))
        assert len(pairs) == n * (n - 1) and len(set(pairs.values())) <= 1


def test_compile_with_define_wraps_one_source(monkeypatch):
    """suite_common.compile_with_define (the probes' A/B of a kernel define, session 21): the
    define goes before that source's prelude only while define_of() names one; other sources
    and an empty name reach get_kernel as they came; restore() puts get_kernel back."""
    from cuflash import _jit
    sc = _load("suite_common")
    seen = []
    fake = lambda src, expr, dev, prelude="": seen.append((src, prelude)) or "kernel"  # noqa: E731
    monkeypatch.setattr(_jit, "get_kernel", fake)
    name = ["X_AB"]
    restore = sc.compile_with_define("fwd_sm90ws.cu", lambda: name[0])
    assert _jit.get_kernel("fwd_sm90ws.cu", "e", 0, "P;") == "kernel"
    _jit.get_kernel("fwd_sm90.cu", "e", 0, "P;")
    name[0] = ""
    _jit.get_kernel("fwd_sm90ws.cu", "e", 0, "P;")
    assert seen == [("fwd_sm90ws.cu", "#define X_AB 1\nP;"), ("fwd_sm90.cu", "P;"),
                    ("fwd_sm90ws.cu", "P;")]
    restore()
    assert _jit.get_kernel is fake
