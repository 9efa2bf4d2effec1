"""GPU: the plan cache and its fast path (``gpu`` marker: skipped without a device).

A repeated call skips validation, dispatch and packing (``cuflash._api``): these tests check
that what it computes is bitwise what the full path computes, from many threads with cold
caches too, on any stream, and that the cache stays bounded.
"""

from __future__ import annotations

import threading

import ml_dtypes
import numpy
import pytest

import cuflash
from cuflash import _api

pytestmark = pytest.mark.gpu

BF16 = numpy.dtype(ml_dtypes.bfloat16)


def rand(shape, dtype, seed):
    import cupy
    rng = numpy.random.default_rng(seed)
    return cupy.asarray(rng.standard_normal(shape, dtype=numpy.float32).astype(dtype))


def full_path(q, k, v, **kw):
    """The same call through validation and dispatch: ``out=`` always takes the full path."""
    import cupy
    from cuflash import _problem
    prob = _problem.make_problem(q, k, v, scale=kw.get("scale"), causal=kw.get("causal", False))
    out = cupy.full(prob.batch_shape + (prob.Lq, prob.dv), numpy.nan, q.dtype)
    return cuflash.attention(q, k, v, out=out, return_lse=True, **kw)


def poison_pool():
    """Fill recently freed pool memory with NaN, so an output the fast path leaves unwritten
    shows up as NaN (CuPy's pool hands the same blocks out again)."""
    import cupy
    bufs = [cupy.full(n, numpy.nan, numpy.float32) for n in (1 << 16, 1 << 20, 1 << 22)]
    del bufs


CASES = [
    ((2, 4, 100, 64), (2, 4, 120, 64), BF16, dict(causal=True)),
    ((1, 8, 256, 128), (1, 8, 256, 128), numpy.float16, dict(scale=0.3)),
    ((3, 2, 4, 33, 80), (3, 2, 1, 47, 80), BF16, dict(causal="top_left")),   # GQA broadcast
    ((2, 64, 32), (2, 64, 32), numpy.float32, dict()),
    ((6, 5, 4, 3, 2, 17, 16), (6, 5, 4, 3, 2, 19, 16), numpy.float64, dict(causal=True)),  # outer loop
]


@pytest.mark.parametrize("sq, sk, dtype, kw", CASES)
def test_fast_path_is_bitwise_the_full_path(sq, sk, dtype, kw):
    import cupy
    q, k, v = rand(sq, dtype, 1), rand(sk, dtype, 2), rand(sk, dtype, 3)
    ref_o, ref_lse = full_path(q, k, v, **kw)
    for _ in range(3):                       # first call may plan; the others hit the cache
        poison_pool()
        o, lse = cuflash.attention(q, k, v, return_lse=True, **kw)
        assert o.dtype == dtype and o.shape == ref_o.shape
        cupy.testing.assert_array_equal(o, ref_o)
        cupy.testing.assert_array_equal(lse, ref_lse)
    assert not bool(cupy.isnan(ref_o).any())


def test_fast_backward_is_bitwise_the_full_path():
    import cupy
    q, k, v = rand((2, 4, 200, 64), BF16, 4), rand((2, 4, 150, 64), BF16, 5), rand((2, 4, 150, 64), BF16, 6)
    do = rand((2, 4, 200, 64), BF16, 7)
    o, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    first = cuflash.attention_backward(do, q, k, v, o, lse, causal=True, deterministic=True)
    for _ in range(3):
        again = cuflash.attention_backward(do, q, k, v, o, lse, causal=True, deterministic=True)
        for a, b in zip(first, again):
            cupy.testing.assert_array_equal(a, b)


def test_a_thread_without_a_cuda_context():
    """A new thread whose first CUDA work is a cuflash call on a cached plan, its outputs served
    by CuPy's pool (no runtime call that would make a context current: cupy/cupy#72): the
    launch (a driver call) makes the context current itself. Forward and backward, each in a
    thread of its own; bitwise the main thread's results. (Session 17's probe saw
    CUDA_ERROR_INVALID_CONTEXT from such threads.)"""
    import cupy
    q, k, v = (rand((2, 4, 300, 64), BF16, 40 + i) for i in range(3))
    o, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    do = rand(o.shape, BF16, 44)
    grads = cuflash.attention_backward(do, q, k, v, o, lse, causal=True)
    # the same sizes again, freed: the pool holds blocks a new thread's outputs can take
    cuflash.attention(q, k, v, causal=True, return_lse=True)
    cuflash.attention_backward(do, q, k, v, o, lse, causal=True)
    cupy.cuda.Device().synchronize()
    got, errors = {}, []

    def run(name, fn):
        try:
            got[name] = fn()
            cupy.cuda.get_current_stream().synchronize()
        except BaseException as e:      # reported below: a thread's exception is otherwise lost
            errors.append(e)

    for name, fn in (("fwd", lambda: cuflash.attention(q, k, v, causal=True, return_lse=True)),
                     ("bwd", lambda: cuflash.attention_backward(do, q, k, v, o, lse, causal=True))):
        t = threading.Thread(target=run, args=(name, fn))
        t.start()
        t.join()
    assert not errors, errors
    for want, have in zip((o, lse) + tuple(grads), got["fwd"] + tuple(got["bwd"])):
        assert (want.view(numpy.uint8) == have.view(numpy.uint8)).all()


def test_many_threads_with_cold_caches():
    """16 threads, each on its own stream, call with shapes no one has planned yet."""
    import cupy
    _api._caches()[0].clear()
    _api._caches()[1].clear()
    shapes = [((2, 3, 50 + 7 * i, 64), (2, 3, 40 + 5 * i, 64)) for i in range(8)]
    inputs = [(rand(sq, BF16, 10 * i), rand(sk, BF16, 10 * i + 1), rand(sk, BF16, 10 * i + 2))
              for i, (sq, sk) in enumerate(shapes)]
    cupy.cuda.Device().synchronize()
    results: dict[int, list] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(16)

    def worker(t):
        try:
            with cupy.cuda.Stream(non_blocking=True) as s:
                barrier.wait()
                out = []
                for r in range(4):
                    q, k, v = inputs[(t + r) % 8]
                    out.append(((t + r) % 8, cuflash.attention(q, k, v, causal=bool(r % 2),
                                                               return_lse=True)))
                s.synchronize()
                results[t] = out
        except BaseException as e:      # reported below: a thread's exception is otherwise lost
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for t, out in results.items():
        for r, (i, (o, lse)) in enumerate(out):
            ref_o, ref_lse = full_path(*inputs[i], causal=bool(r % 2))
            cupy.testing.assert_array_equal(o, ref_o)
            cupy.testing.assert_array_equal(lse, ref_lse)


def test_cache_stays_bounded(monkeypatch):
    fwd, _ = _api._caches()
    monkeypatch.setattr(fwd, "maxsize", 6)
    fwd.clear()
    for L in range(10, 40):
        q = rand((1, 2, L, 32), BF16, L)
        cuflash.attention(q, q, q)
        assert len(fwd) <= 6


def test_misaligned_inputs_are_copied_and_repeat_correctly():
    """A view whose rows are not 16-byte aligned takes the tensor-core families' copy; the plan
    repacks for it on every call (no fast path), and the results agree."""
    import cupy
    base = rand((2, 4, 64, 72), BF16, 9)
    q = base[..., 1:65]                                   # rows start 2 bytes in
    ref_o, _ = full_path(q, q, q)
    for _ in range(2):
        cupy.testing.assert_array_equal(cuflash.attention(q, q, q), ref_o)


# --- calls with modifiers that carry no array (_fast.FastModified) ---------------------------

#: read by the score_mods below as a global: function_key keys it by value (a new value, a new
#: trace)
MOD_SCALE = 2.0


def _doc_mask(b, h, q_idx, kv_idx):
    return (q_idx // 64) == (kv_idx // 64)


def _scaled(s, b, h, q_idx, kv_idx):
    return s * MOD_SCALE


def _fast_entries(cache):
    from cuflash._fast import FastModified
    return [e for e in cache._d.values() if isinstance(e, FastModified)]


MOD_CASES = [dict(window=(40, 0), causal=True), dict(softcap=5.0),
             dict(window=(None, 17), softcap=2.5),
             dict(block_mask="doc"), dict(block_mask="doc", causal=True),
             dict(score_mod=_scaled)]


@pytest.mark.parametrize("kw", MOD_CASES, ids=lambda kw: "-".join(sorted(kw)))
def test_modifier_fast_path_is_bitwise_the_full_path(kw, monkeypatch):
    """A repeated call with modifiers that carry no array takes the cached entry (forward and
    backward: no call validates again, counted in _problem.make_problem); what it returns is
    bitwise what the full path (``out=``; the first call) did."""
    from cuflash import _problem
    validated = []
    make_problem = _problem.make_problem
    monkeypatch.setattr(_problem, "make_problem",
                        lambda *a, **k: validated.append(1) or make_problem(*a, **k))
    import cupy
    shape = (2, 3, 192, 64)
    q, k, v, do = (rand(shape, BF16, 20 + i) for i in range(4))
    kw = dict(kw)
    if kw.get("block_mask") == "doc":
        kw["block_mask"] = cuflash.block_mask(_doc_mask, (1, 1), 192, 192)
    _api.clear_plans()
    ref_o, ref_lse = full_path(q, k, v, **kw)
    ref_grads = cuflash.attention_backward(do, q, k, v, ref_o, ref_lse, deterministic=True, **kw)
    cuflash.attention(q, k, v, return_lse=True, **kw)       # (the forward's entry)
    validated.clear()
    for _ in range(3):
        poison_pool()
        o, lse = cuflash.attention(q, k, v, return_lse=True, **kw)
        cupy.testing.assert_array_equal(o, ref_o)
        cupy.testing.assert_array_equal(lse, ref_lse)
        cupy.testing.assert_array_equal(cuflash.attention(q, k, v, **kw), ref_o)
        grads = cuflash.attention_backward(do, q, k, v, o, lse, deterministic=True, **kw)
        assert len(grads) == 3
        for a, b in zip(grads, ref_grads):
            assert a.shape == b.shape and a.dtype == b.dtype
            cupy.testing.assert_array_equal(a, b)
    assert not bool(cupy.isnan(ref_o).any())
    assert validated == []                  # every call of the loop took its entry
    assert len(_fast_entries(_api._FWD_PLANS)) == 1
    assert len(_fast_entries(_api._BWD_PLANS)) == 1


def _array_case(name: str, seed: int) -> dict:
    """Modifier arrays of one layout and new values for each seed."""
    import cupy
    L, H = 192, 3
    rng = numpy.random.default_rng(seed)
    return {
        "bias": lambda: dict(bias=rand((L, L), BF16, seed)),
        "bias_float32_full": lambda: dict(bias=rand((2, H, L, L), numpy.float32, seed)),
        "mask": lambda: dict(mask=cupy.asarray(rng.random((L, L)) < 0.7)),
        "alibi": lambda: dict(alibi_slopes=cupy.asarray(rng.random(H, numpy.float32)),
                              causal=True),
        "alibi_bf16": lambda: dict(alibi_slopes=rand((H,), BF16, seed), causal=True),
        "sink_bf16": lambda: dict(sink=rand((H,), BF16, seed)),
        "bias_window": lambda: dict(bias=rand((L, L), BF16, seed), window=(50, 0)),
        "bias_score_mod": lambda: dict(bias=rand((L, L), BF16, seed), score_mod=_scaled),
    }[name]()


@pytest.mark.parametrize("case", ["bias", "bias_float32_full", "mask", "alibi", "alibi_bf16",
                                  "sink_bf16", "bias_window", "bias_score_mod"])
def test_forward_fast_path_patches_each_calls_modifier_arrays(case, monkeypatch):
    """A forward with modifier arrays (bias, mask, slopes, sink) takes its entry on repeated
    calls (no validation), and each call reads its own arrays: new values of the same layout
    give bitwise the full path's result on them. Slopes and sinks of bfloat16 (converted to
    float32 a call) keep the general path: no entry, validated every call, the same bits."""
    entry = not case.endswith("_bf16")
    import cupy
    from cuflash import _problem
    validated = []
    make_problem = _problem.make_problem
    monkeypatch.setattr(_problem, "make_problem",
                        lambda *a, **k: validated.append(1) or make_problem(*a, **k))
    q, k, v = (rand((2, 3, 192, 64), BF16, 50 + i) for i in range(3))
    _api.clear_plans()
    cuflash.attention(q, k, v, **_array_case(case, 0))          # (the entry)
    for seed in (1, 2, 3):
        kw = _array_case(case, seed)
        poison_pool()
        before = len(validated)
        o, lse = cuflash.attention(q, k, v, return_lse=True, **kw)
        assert len(validated) == before + (0 if entry else 1)    # the entry, not validation
        ref_o, ref_lse = full_path(q, k, v, **kw)
        cupy.testing.assert_array_equal(o, ref_o)
        cupy.testing.assert_array_equal(lse, ref_lse)
        assert not bool(cupy.isnan(o).any())
    entries = _fast_entries(_api._FWD_PLANS)
    assert len(entries) == int(entry)
    for e in entries:   # no array of a call kept; the function its key names by id kept alive
        assert e.mods.bias is None and e.mods.mask is None and e.mods.alibi_slopes is None
        assert e.mods.score_mod is (_scaled if case == "bias_score_mod" else None)


@pytest.mark.parametrize("case", ["mask", "alibi", "alibi_bf16"])
def test_backward_fast_path_patches_each_calls_slopes_and_mask(case, monkeypatch):
    """A backward with ALiBi slopes or a mask (arrays without a gradient; session 17) takes its
    entry on repeated calls (no validation) and reads each call's own arrays: bitwise the
    general path's gradients on them (deterministic). Slopes of bfloat16 (converted a call)
    keep the general path. (A bias or a sink, whose gradients are made there, always does.)"""
    entry = not case.endswith("_bf16")
    import cupy
    from cuflash import _problem
    validated = []
    make_problem = _problem.make_problem
    monkeypatch.setattr(_problem, "make_problem",
                        lambda *a, **k: validated.append(1) or make_problem(*a, **k))
    q, k, v, do = (rand((2, 3, 192, 64), BF16, 60 + i) for i in range(4))
    _api.clear_plans()
    kw0 = _array_case(case, 0)
    o, lse = cuflash.attention(q, k, v, return_lse=True, **kw0)
    cuflash.attention_backward(do, q, k, v, o, lse, deterministic=True, **kw0)   # (the entry)
    for seed in (1, 2, 3):
        kw = _array_case(case, seed)
        o, lse = cuflash.attention(q, k, v, return_lse=True, **kw)
        poison_pool()
        before = len(validated)
        grads = cuflash.attention_backward(do, q, k, v, o, lse, deterministic=True, **kw)
        assert len(validated) == before + (0 if entry else 1)    # the entry, not validation
        _api._caches()[1].clear()                                # the general path's plan
        ref = cuflash.attention_backward(do, q, k, v, o, lse, deterministic=True, **kw)
        assert len(grads) == len(ref) == 3
        for a, b in zip(grads, ref):
            cupy.testing.assert_array_equal(a, b)
            assert not bool(cupy.isnan(a).any())
    assert len(_fast_entries(_api._BWD_PLANS)) == int(entry)
    for e in _fast_entries(_api._BWD_PLANS):   # no array of a call kept
        assert e.mods.mask is None and e.mods.alibi_slopes is None


def test_modifier_fast_path_sees_what_validation_and_tracing_see(monkeypatch):
    """After an entry exists: a value validation rejects still raises (a float window bound
    equals an int one, and hashes alike), a user function whose global changed is traced
    again (the full path's new result, not the entry's), and a bias takes an entry of its
    own, which an array of another kind or shape does not hit."""
    import cupy
    shape = (1, 2, 128, 64)
    q, k, v = (rand(shape, BF16, 30 + i) for i in range(3))
    _api.clear_plans()
    for _ in range(2):
        cuflash.attention(q, k, v, window=(32, 0))
        cuflash.attention(q, k, v, softcap=1.0)
    with pytest.raises(TypeError):
        cuflash.attention(q, k, v, window=(32.0, 0))
    with pytest.raises(TypeError):
        cuflash.attention(q, k, v, softcap=True)
    a = cuflash.attention(q, k, v, score_mod=_scaled)
    cupy.testing.assert_array_equal(cuflash.attention(q, k, v, score_mod=_scaled), a)
    monkeypatch.setitem(globals(), "MOD_SCALE", 0.5)
    b = cuflash.attention(q, k, v, score_mod=_scaled)
    ref, _ = full_path(q, k, v, score_mod=_scaled)
    cupy.testing.assert_array_equal(b, ref)
    assert bool((a != b).any())
    n = len(_fast_entries(_api._FWD_PLANS))
    assert n == 4          # window, softcap, the two traces of _scaled
    bias = rand((128, 128), BF16, 40)
    for _ in range(2):
        cuflash.attention(q, k, v, bias=bias)
    assert len(_fast_entries(_api._FWD_PLANS)) == n + 1    # (the forward keys a bias's layout)
    with pytest.raises(TypeError):                          # a NumPy bias: not an entry's
        cuflash.attention(q, k, v, bias=cupy.asnumpy(bias))
    with pytest.raises(ValueError):                         # a bias that does not broadcast
        cuflash.attention(q, k, v, bias=rand((128, 64), BF16, 41))
