"""The GPU forward with the built-in modifiers (window, softcap, alibi_slopes, sink, bias, mask)
against the float64 oracle of tests/_naive_modifiers.py (``gpu`` marker: skipped without a
device; written without one, run on the H200 next).

Every call writes into an output buffer poisoned with NaN first. Each test runs with the
dispatcher's choice and again with each other forward family forced (``CUFLASH_FWD``), so the
one Variant is checked in fwd_sm90, fwd_sm80 and fwd_simt. The gradient tests run with the
dispatcher's backward (on Hopper bwd_sm90 for the modifiers _traits.BWD_SM90_MODIFIERS lists,
bwd_sm80 for the others) and again with bwd_sm80 forced (``CUFLASH_BWD=sm80``), so the one
Variant is checked in both tensor-core backwards. Modifier arrays are handed over with their
broadcast (stride-0) dimensions kept, as users pass them.
"""

from __future__ import annotations

import os

import ml_dtypes
import numpy
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cuflash
import _naive_modifiers as naive

pytestmark = pytest.mark.gpu

BF16 = numpy.dtype(ml_dtypes.bfloat16)
F16 = numpy.dtype(numpy.float16)
BUILT_INS = ("window", "softcap", "alibi_slopes", "sink", "bias", "mask")


@pytest.fixture(params=["default", "sm80", "simt"])
def family(request, monkeypatch):
    """The dispatcher's family, then fwd_sm80 and fwd_simt forced (on Hopper the default is
    fwd_sm90; elsewhere "sm80" repeats the default and is skipped). "sm80" forces bwd_sm80 for
    the backward too (CUFLASH_BWD=sm80); the others leave the backward to the dispatcher."""
    import cupy
    if request.param == "sm80" and cupy.cuda.Device().compute_capability != "90":
        pytest.skip("CUFLASH_FWD=sm80 changes nothing off Hopper")
    if request.param != "default":
        monkeypatch.setenv("CUFLASH_FWD", request.param)
    if request.param == "sm80":
        monkeypatch.setenv("CUFLASH_BWD", "sm80")
    from cuflash import _api
    _api.clear_plans()
    yield request.param
    _api.clear_plans()


@pytest.fixture(params=["default", "sm80"])
def bwd_family(request, monkeypatch):
    """The dispatcher's backward (on Hopper bwd_sm90 where it runs the modifiers), then bwd_sm80
    forced (CUFLASH_BWD=sm80; off Hopper that is the default and is skipped). Yields the list
    of the backward kernel sources the plans built in the test chose."""
    import cupy
    from cuflash import _api
    from _spy import backward_sources
    if request.param == "sm80" and cupy.cuda.Device().compute_capability != "90":
        pytest.skip("CUFLASH_BWD=sm80 changes nothing off Hopper")
    monkeypatch.delenv("CUFLASH_BWD", raising=False)
    if request.param == "sm80":
        monkeypatch.setenv("CUFLASH_BWD", "sm80")
    seen = backward_sources(monkeypatch)
    _api.clear_plans()
    yield seen
    _api.clear_plans()


def to_device(x):
    """A CuPy copy of a NumPy array; stride-0 (broadcast) dimensions stay broadcast."""
    import cupy
    if not isinstance(x, numpy.ndarray):
        return x
    index = tuple(slice(0, 1) if (s == 0 and n > 1) else slice(None)
                  for n, s in zip(x.shape, x.strides))
    return cupy.broadcast_to(cupy.asarray(numpy.ascontiguousarray(x[index]).reshape(
        x[index].shape)), x.shape)


def run_gpu(q, k, v, causal, kw):
    """cuflash.attention on the device, into a poisoned out; NumPy (o, lse) back."""
    import cupy
    batch = numpy.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    out = cupy.full(batch + (q.shape[-2], v.shape[-1]), numpy.nan, q.dtype)
    o, lse = cuflash.attention(to_device(q), to_device(k), to_device(v), causal=causal,
                               return_lse=True, out=out, **{n: to_device(x) for n, x in kw.items()})
    assert o is out
    cupy.cuda.Device().synchronize()
    return cupy.asnumpy(o), cupy.asnumpy(lse)


@st.composite
def builtin_case(draw, dtypes=(F16, BF16, numpy.dtype(numpy.float32), numpy.dtype(numpy.float64))):
    """q, k, v, causal and built-in modifier keywords: lengths across tile edges (1 .. 200),
    head dims of every kind of kernel, modifier arrays broadcast over some batch dims, -inf in
    a bias, masks with empty rows, sinks of -inf."""
    seed = draw(st.integers(0, 2 ** 32 - 1))
    rng = numpy.random.default_rng(seed)
    dtype = numpy.dtype(draw(st.sampled_from(dtypes)))
    batch = tuple(draw(st.integers(1, 3)) for _ in range(draw(st.integers(0, 2))))
    Lq, Lk = draw(st.integers(1, 200)), draw(st.integers(1, 200))
    d = draw(st.sampled_from([8, 24, 64, 72, 128]))
    dv = draw(st.sampled_from([d, 64]))

    def sub(shape):        # a shape that broadcasts to `shape`
        keep = draw(st.integers(0, len(shape)))
        tail = shape[len(shape) - keep:]
        return tuple(n if draw(st.booleans()) else 1 for n in tail)

    q = rng.standard_normal(batch + (Lq, d)).astype(dtype)
    k = rng.standard_normal(sub(batch) + (Lk, d)).astype(dtype)
    v = rng.standard_normal(sub(batch) + (Lk, dv)).astype(dtype)
    on = draw(st.sets(st.sampled_from(BUILT_INS), min_size=1))
    kw = {}
    bound = st.one_of(st.none(), st.integers(0, 150))
    if "window" in on:
        kw["window"] = (draw(bound), draw(bound))
    if "softcap" in on:
        kw["softcap"] = draw(st.sampled_from([0.5, 2.0, 30.0]))
    if "alibi_slopes" in on:
        kw["alibi_slopes"] = numpy.asarray(rng.uniform(0, 0.2, sub(batch))).astype(
            draw(st.sampled_from([numpy.float32, numpy.float64, numpy.float16])))
    if "sink" in on:
        kw["sink"] = numpy.asarray(rng.standard_normal(sub(batch))).astype(numpy.float32)
        if kw["sink"].size and draw(st.booleans()):
            kw["sink"].flat[0] = -numpy.inf
    if "bias" in on:
        bias = numpy.asarray(rng.standard_normal(sub(batch + (Lq, Lk)))).astype(
            draw(st.sampled_from([numpy.float32, numpy.float16, BF16, numpy.float64])))
        if bias.size and draw(st.booleans()):
            bias[rng.random(bias.shape) < 0.3] = -numpy.inf
        kw["bias"] = bias
    if "mask" in on:
        kw["mask"] = numpy.asarray(rng.random(sub(batch + (Lq, Lk)))
                                   < draw(st.sampled_from([0.05, 0.5, 1.0])))
    causal = draw(st.sampled_from([False, True, "top_left"]))
    return q, k, v, causal, kw


@settings(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(builtin_case())
def test_builtin_modifiers_match_the_oracle(family, case):
    q, k, v, causal, kw = case
    o, lse = run_gpu(q, k, v, causal, kw)
    naive.check_result(q, k, v, causal, kw, o, lse)


def _case(dtype, Lq=150, Lk=100, d=64, seed=0):
    rng = numpy.random.default_rng(seed)
    return tuple(rng.standard_normal((2, 3, L, dd)).astype(dtype)
                 for L, dd in ((Lq, d), (Lk, d), (Lk, d)))


@pytest.mark.parametrize("dtype", [F16, BF16, numpy.dtype(numpy.float32)], ids=str)
@pytest.mark.parametrize("how", ["window", "bias", "mask", "window+sink"])
def test_rows_with_no_visible_key(family, dtype, how):
    """Each masking modifier empties some rows: o = 0 and lse = -inf there (lse = sink with a
    sink), exactly; the other rows match the oracle."""
    q, k, v = _case(dtype)            # Lq > Lk: the window's diagonal starts below key 0
    Lq, Lk = q.shape[-2], k.shape[-2]
    kw = {}
    empty = numpy.zeros((2, 3, Lq), bool)
    if "window" in how:
        kw["window"] = (4, 2)         # row i sees keys i - 54 .. i - 48
        empty[..., :48] = True
    if how == "bias":
        bias = numpy.zeros((3, Lq, Lk), numpy.float32)
        bias[:, 17] = -numpy.inf
        kw["bias"] = bias
        empty[:, :, 17] = True
    if how == "mask":
        mask = numpy.ones((2, 1, Lq, Lk), bool)
        mask[1, :, 99] = False
        kw["mask"] = mask
        empty[1, :, 99] = True
    if "sink" in how:
        kw["sink"] = numpy.array([0.5, -1.0, 2.0], numpy.float32)
    o, lse = run_gpu(q, k, v, False, kw)
    assert (o[empty] == 0).all()
    if "sink" in how:
        assert (lse == numpy.broadcast_to(kw["sink"][:, None], lse.shape))[empty].all()
    else:
        assert (lse[empty] == -numpy.inf).all()
    naive.check_result(q, k, v, False, kw, o, lse)


def test_new_modifier_arrays_reuse_the_plan_and_are_read(family):
    """A second call with other bias / slope / mask arrays of the same layouts hits the cached
    plan and reads the new arrays (pointers patched per call), and a plain call afterwards
    is plain attention (the fast path holds no modifier)."""
    import cupy
    from cuflash import _api
    q, k, v = _case(F16, 96, 96)
    rng = numpy.random.default_rng(5)
    for seed in range(2):
        kw = dict(bias=rng.standard_normal((96, 96)).astype(numpy.float16),
                  alibi_slopes=rng.uniform(0, 0.1, (3,)).astype(numpy.float16),
                  mask=rng.random((2, 3, 96, 96)) < 0.8)
        o, lse = run_gpu(q, k, v, True, kw)
        naive.check_result(q, k, v, True, kw, o, lse)
    misses = _api._FWD_PLANS.misses
    o, lse = run_gpu(q, k, v, True, kw)
    assert _api._FWD_PLANS.misses == misses
    o, lse = run_gpu(q, k, v, True, {})
    naive.check_result(q, k, v, True, {}, o, lse)
    cupy.cuda.Device().synchronize()


@pytest.mark.parametrize("dtype", [F16, BF16], ids=str)
def test_sliding_window_skips_tiles_and_stays_exact_at_length(family, dtype):
    """A window of 128 over 4096 keys (causal): the result matches the oracle on rows spread
    over the sequence (the band's tiles only are visited)."""
    rng = numpy.random.default_rng(3)
    q, k, v = (rng.standard_normal((1, 2, 4096, 64)).astype(dtype) for _ in range(3))
    o, lse = run_gpu(q, k, v, True, dict(window=(128, 0)))
    # rows of q only: the window makes every row depend on its 129 keys alone
    for start in (0, 2000, 4032):
        lo = max(0, start - 128)
        sl = slice(start, start + 64)
        oq, ok_, ov = q[..., sl, :], k[..., lo:start + 64, :], v[..., lo:start + 64, :]
        # the same rows as a smaller problem: shift the window's diagonal with Lk - Lq
        kw = dict(window=(128, 0))
        naive.check_result(oq, ok_, ov, True, kw, o[..., sl, :], lse[..., sl])


@pytest.mark.parametrize("dtype", [F16, BF16], ids=str)
@pytest.mark.parametrize("how", ["softcap-saturating", "alibi-far", "softcap+alibi+sink"])
def test_score_transforms_at_d128_over_several_query_blocks(family, dtype, how):
    """softcap and ALiBi at d = 128 across several query blocks and a partial last key tile
    (fwd_sm90 runs them with 3 warpgroups, 192-row blocks, and computes them a row at a time:
    c - 2c / (2^{x k2} + 1) with ex2 / rcp.approx, and a float distance per row): scores far
    past the cap on both sides (q scaled by 8, cap 5: tanh saturates to +-1), ALiBi distances
    up to 650 with slopes up to 1, against the oracle."""
    rng = numpy.random.default_rng(7)
    Lq, Lk = 600, 650
    q = (8 * rng.standard_normal((2, 2, Lq, 128))).astype(dtype)
    k, v = (rng.standard_normal((2, 2, Lk, 128)).astype(dtype) for _ in range(2))
    slopes = rng.uniform(0.05, 1.0, (2,)).astype(numpy.float32)
    kw, causal = {
        "softcap-saturating": (dict(softcap=5.0), False),
        "alibi-far": (dict(alibi_slopes=slopes), False),
        "softcap+alibi+sink": (dict(softcap=5.0, alibi_slopes=slopes,
                                    sink=rng.standard_normal((2,)).astype(numpy.float32)), True),
    }[how]
    o, lse = run_gpu(q, k, v, causal, kw)
    naive.check_result(q, k, v, causal, kw, o, lse)


def run_gpu_backward(q, k, v, causal, kw, deterministic=False, seed=1):
    """cuflash's forward and backward on the device; NumPy (o, lse, do, grads) back."""
    import cupy
    dev = {n: to_device(x) for n, x in kw.items()}
    qd, kd, vd = (to_device(x) for x in (q, k, v))
    o, lse = cuflash.attention(qd, kd, vd, causal=causal, return_lse=True, **dev)
    do = numpy.random.default_rng(seed).standard_normal(o.shape).astype(q.dtype)
    grads = cuflash.attention_backward(cupy.asarray(do), qd, kd, vd, o, lse, causal=causal,
                                       deterministic=deterministic, **dev)
    cupy.cuda.Device().synchronize()
    return cupy.asnumpy(o), cupy.asnumpy(lse), do, tuple(cupy.asnumpy(g) for g in grads)


@settings(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(builtin_case(dtypes=(F16, BF16)), st.booleans())
def test_builtin_modifier_gradients_match_the_reference(bwd_family, case, deterministic):
    """dq, dk, dv, then dbias and dsink (DESIGN.md's order, the shapes and dtypes of bias and
    sink, summed over their broadcast dims) of the tensor-core backwards' Variant code: the
    dispatcher's (on Hopper bwd_sm90 for d = 64, 72, 128 with the modifiers it runs and
    deterministic=False) and bwd_sm80 forced."""
    q, k, v, causal, kw = case
    o, lse, do, grads = run_gpu_backward(q, k, v, causal, kw, deterministic)
    naive.check_gradients(grads, q, k, v, o, lse, do, causal, kw)


@pytest.mark.parametrize("how", ["window", "bias", "mask", "window+sink"])
def test_gradients_of_rows_with_no_visible_key_are_zero(bwd_family, how):
    """A row that a masking modifier empties contributes nothing: its dq is exactly 0 (and
    with a sink, dsink gets exp(sink - lse) D = 0 from it: D = dO . O = 0)."""
    q, k, v = _case(BF16)
    Lq, Lk = q.shape[-2], k.shape[-2]
    kw, empty = {}, numpy.zeros((2, 3, Lq), bool)
    if "window" in how:
        kw["window"] = (4, 2)
        empty[..., :48] = True
    if how == "bias":
        bias = numpy.zeros((3, Lq, Lk), numpy.float32)
        bias[:, 17] = -numpy.inf
        kw["bias"], empty[:, :, 17] = bias, True
    if how == "mask":
        mask = numpy.ones((2, 1, Lq, Lk), bool)
        mask[1, :, 99] = False
        kw["mask"], empty[1, :, 99] = mask, True
    if "sink" in how:
        kw["sink"] = numpy.array([0.5, -1.0, 2.0], numpy.float32)
    o, lse, do, grads = run_gpu_backward(q, k, v, False, kw)
    assert (grads[0][empty] == 0).all()
    naive.check_gradients(grads, q, k, v, o, lse, do, False, kw)


#: (keywords, head dim, causal) that the dispatcher gives bwd_sm90 on Hopper: the benchmarks'
#: softcap (not causal) and sliding window (causal) at d = 128, a sink with the window, ALiBi,
#: both causal alignments and none
def _bwd_sm90_cases():
    rng = numpy.random.default_rng(4)
    slopes = rng.uniform(0, 0.2, (3,)).astype(numpy.float32)
    return {
        "softcap-128": (dict(softcap=20.0), 128, False),
        "softcap-small-64": (dict(softcap=0.5), 64, True),
        "window-128": (dict(window=(100, 0)), 128, True),
        "window-both-64": (dict(window=(40, 30)), 64, False),
        "window+sink-128": (dict(window=(64, 0), sink=rng.standard_normal((3,)).astype(numpy.float32)),
                            128, True),
        "softcap+window+sink-64": (dict(softcap=5.0, window=(90, 10),
                                        sink=rng.standard_normal((2, 3)).astype(numpy.float32)),
                                   64, "top_left"),
        "softcap+sink-72": (dict(softcap=5.0, sink=rng.standard_normal((2, 3)).astype(numpy.float32)),
                            72, "top_left"),
        "alibi-64": (dict(alibi_slopes=slopes), 64, True),
        "alibi+window+softcap-64": (dict(alibi_slopes=slopes, window=(50, None), softcap=10.0), 64, False),
        # ALiBi on the plain path (session 7): every head-dim bucket, with causal (both
        # alignments), a window reaching past the diagonal (|i + diag - j| on both sides) and
        # the sink
        "alibi-128": (dict(alibi_slopes=slopes), 128, True),
        "alibi-top-left-128": (dict(alibi_slopes=slopes), 128, "top_left"),
        "alibi-not-causal-128": (dict(alibi_slopes=slopes), 128, False),
        "alibi+window-128": (dict(alibi_slopes=slopes, window=(100, 20)), 128, False),
        "alibi+window+sink-128": (dict(alibi_slopes=slopes, window=(64, 0),
                                       sink=rng.standard_normal((3,)).astype(numpy.float32)),
                                  128, True),
        "alibi+window-72": (dict(alibi_slopes=slopes, window=(40, None)), 72, True),
    }


@pytest.mark.parametrize("name", sorted(_bwd_sm90_cases()))
def test_modifier_gradients_on_bwd_sm90(bwd_family, name):
    """The modifiers bwd_sm90 runs (_traits.BWD_SM90_MODIFIERS), bf16, over lengths across its
    tile edges (Lq = 300, Lk = 230: rows without keys under the window and the bottom-right
    causal mask): the gradients match the reference, and the kernel is bwd_sm90 on Hopper
    (bwd_sm80 where it is forced). float16 runs in the Hypothesis test above."""
    import cupy
    kw, d, causal = _bwd_sm90_cases()[name]
    rng = numpy.random.default_rng(d)
    q = rng.standard_normal((2, 3, 300, d)).astype(BF16)
    k = rng.standard_normal((2, 3, 230, d)).astype(BF16)
    v = rng.standard_normal((2, 3, 230, d)).astype(BF16)
    o, lse, do, grads = run_gpu_backward(q, k, v, causal, kw)
    naive.check_gradients(grads, q, k, v, o, lse, do, causal, kw)
    hopper = cupy.cuda.Device().compute_capability == "90"
    forced = os.environ.get("CUFLASH_BWD") == "sm80"
    assert bwd_family == ["bwd_sm90.cu" if hopper and not forced else "bwd_sm80.cu"]


def _check_softcap_rows(dtype, d, causal, cap, seed):
    """softcap=cap forward and gradients against the oracle (the kit's rule) on q rows scaled
    by 300 and 30 (far beyond the cap on both sides), 1 (around it), 1e-2 and 1e-4 (near 0),
    one kind each 5 rows; Lq 250 > Lk 190 (rows with no key under bottom-right causal). Plans
    are cleared around it: the callers' switches are read at plan time."""
    from cuflash import _api
    _api.clear_plans()
    rng = numpy.random.default_rng(seed)
    Lq, Lk = 250, 190
    row_scale = numpy.array([300.0, 30.0, 1.0, 1e-2, 1e-4])[numpy.arange(Lq) % 5]
    q = (rng.standard_normal((2, 2, Lq, d)) * row_scale[:, None]).astype(dtype)
    k, v = (rng.standard_normal((2, 2, Lk, d)).astype(dtype) for _ in range(2))
    kw = dict(softcap=cap)
    o, lse = run_gpu(q, k, v, causal, kw)
    naive.check_result(q, k, v, causal, kw, o, lse)
    o, lse, do, grads = run_gpu_backward(q, k, v, causal, kw)
    naive.check_gradients(grads, q, k, v, o, lse, do, causal, kw)
    _api.clear_plans()


@pytest.mark.parametrize("tanh, poly", [("1", "1"), ("1", "0"), ("0", "1")],
                         ids=["tanh.approx+ex2_poly", "tanh.approx", "ex2-rcp"])
@pytest.mark.parametrize("dtype", [F16, BF16], ids=str)
@pytest.mark.parametrize("d, causal", [(128, False), (64, True)])
def test_softcap_at_extreme_magnitudes(bwd_family, monkeypatch, tanh, poly, dtype, d, causal):
    """softcap in both builds of the tensor-core kernels (CUFLASH_SOFTCAP_TANH: tanh.approx for
    bfloat16, with or without a share of the forward's exponentials on the FMA pipe
    (CUFLASH_SOFTCAP_POLY), or ex2 / rcp, which float16 always takes; bench/NOTES.md "softcap
    and ALiBi cost (session 8)"), forward and backward,
    on rows whose scores lie far beyond the cap on both sides (q rows scaled by 30 and 300, cap
    2: tanh saturates to +-1 and its derivative 1 - tanh^2 to 0), around the cap (scale 1)
    and near 0 (scaled by 1e-2 and 1e-4: tanh linear, relative error of tanh.approx at its
    smallest arguments), one row kind each 5 rows, against the oracle with the kit's rule."""
    monkeypatch.setenv("CUFLASH_SOFTCAP_TANH", tanh)
    monkeypatch.setenv("CUFLASH_SOFTCAP_POLY", poly)
    _check_softcap_rows(dtype, d, causal, 2.0, seed=11)


@pytest.mark.parametrize("fixed, bwd", [("1", "plain"), ("0", "plain"), ("1", "pairwise")],
                         ids=["fixed+bwd-plain", "running-max+bwd-plain", "fixed+bwd-pairwise"])
@pytest.mark.parametrize("cap", [2.0, 50.0])
@pytest.mark.parametrize("d, causal", [(128, False), (64, True)])
def test_softcap_fixed_offset_and_bwd_plain_path(bwd_family, monkeypatch, fixed, bwd, cap, d, causal):
    """Session 10's softcap builds (bfloat16; bench/NOTES.md "softcap: a fixed offset instead of
    the running max"): the forwards' softmax on a fixed offset (CUFLASH_SOFTCAP_FIXED; at cap
    50, P up to 2^51 at these Lk) and bwd_sm90's plain path for the softcap alone
    (CUFLASH_SOFTCAP_BWD), each against the other build, on rows scaled to reach the cap on
    both sides and to stay near 0, with rows that see no key (Lq > Lk under causal, bottom
    right), forward and gradients against the oracle with the kit's rule."""
    monkeypatch.setenv("CUFLASH_SOFTCAP_FIXED", fixed)
    monkeypatch.setenv("CUFLASH_SOFTCAP_BWD", bwd)
    _check_softcap_rows(BF16, d, causal, cap, seed=12)


@pytest.mark.parametrize("slopes, causal, window", [
    ((2, 3), True, None),          # one slope a query head (hkv, g)
    ((2, 1), True, (80, 0)),       # one a KV head, broadcast over its group (stride 0)
    ((3,), False, (60, 30)),       # one a group index, broadcast over B and the KV heads
], ids=["per-query-head", "per-kv-head+window", "per-group+window"])
def test_alibi_gradients_on_bwd_sm90_with_gqa(bwd_family, slopes, causal, window):
    """ALiBi at d = 128 on bwd_sm90's plain path with GQA: q (B, Hkv, G, L, d), k and v
    broadcast over the group axis (dk, dv summed over it), slopes broadcast against the batch
    shape in three ways, rows without keys (Lq > Lk, bottom-right causal). The gradients match
    the reference by the kit's rule; the kernel is bwd_sm90 on Hopper."""
    import cupy
    rng = numpy.random.default_rng(11)
    q = rng.standard_normal((2, 2, 3, 300, 128)).astype(BF16)
    k = rng.standard_normal((2, 2, 1, 230, 128)).astype(BF16)
    v = rng.standard_normal((2, 2, 1, 230, 128)).astype(BF16)
    kw = dict(alibi_slopes=rng.uniform(0.01, 0.5, slopes).astype(numpy.float32))
    if window is not None:
        kw["window"] = window
    o, lse, do, grads = run_gpu_backward(q, k, v, causal, kw)
    naive.check_gradients(grads, q, k, v, o, lse, do, causal, kw)
    hopper = cupy.cuda.Device().compute_capability == "90"
    forced = os.environ.get("CUFLASH_BWD") == "sm80"
    assert bwd_family == ["bwd_sm90.cu" if hopper and not forced else "bwd_sm80.cu"]


def test_deterministic_gradients_are_bitwise_reproducible():
    """deterministic=True: dq, dk, dv, dbias (a broadcast bias: summed over B) and dsink are
    the same bits run after run."""
    q, k, v = _case(BF16, 200, 200, 64)
    rng = numpy.random.default_rng(9)
    kw = dict(bias=rng.standard_normal((3, 200, 200)).astype(BF16), window=(64, 16),
              softcap=20.0, sink=rng.standard_normal((3,)).astype(numpy.float32))
    first = run_gpu_backward(q, k, v, True, kw, deterministic=True)[3]
    for _ in range(3):
        again = run_gpu_backward(q, k, v, True, kw, deterministic=True)[3]
        for a, b in zip(first, again):
            assert a.tobytes() == b.tobytes()


def test_float32_backward_with_modifiers_is_refused_before_gpu_work():
    """The generic backward (bwd_simt) does not implement the modifiers yet: NotImplementedError
    naming them, never gradients computed without them."""
    import cupy
    q = cupy.ones((2, 4, 8), cupy.float32)
    lse = cupy.zeros((2, 4), cupy.float32)
    with pytest.raises(NotImplementedError, match="softcap"):
        cuflash.attention_backward(q, q, q, q, q, lse, softcap=30.0)


def _user_functions(xp):
    """score_mod / mask_mod pairs reading arrays captured on ``xp`` (the device for cuflash,
    NumPy for the oracle): the same functions over the same values."""
    rng = numpy.random.default_rng(2)
    table = cuflash.captured(xp.asarray(rng.standard_normal((3, 8)).astype(numpy.float32)))
    doc = cuflash.captured(xp.asarray(rng.integers(0, 3, (2, 200)).cumsum(axis=1)))
    return {
        "relpos": dict(score_mod=lambda s, b, h, q, kv: s - 0.1 * numpy.abs(q - kv) + 0.05 * h),
        "table": dict(score_mod=lambda s, b, h, q, kv:
                      s + table[h % 3, numpy.minimum(numpy.abs(q - kv), 7)], softcap=5.0),
        "document": dict(mask_mod=lambda b, h, q, kv: doc[b, q] == doc[b, kv]),
        "both": dict(score_mod=lambda s, b, h, q, kv: numpy.where(kv % 2 == 0, s, s * 0.5),
                     mask_mod=lambda b, h, q, kv: (q - kv) % 3 != 1),
        # a block mask: two documents of 100 (whole tiles empty: skipped), holes inside
        "block": dict(block_mask=_HALVES),
    }


_HALVES = cuflash.block_mask(lambda b, h, q, kv: ((q // 100) == (kv // 100)) & ((q - kv) % 7 != 3),
                             (1, 1), 200, 200, block=(32, 64))


@pytest.mark.parametrize("dtype", [F16, BF16, numpy.dtype(numpy.float32)], ids=str)
@pytest.mark.parametrize("name", ["relpos", "table", "document", "both", "block"])
def test_user_functions_match_the_oracle(family, dtype, name):
    """score_mod / mask_mod traced into the Variant of every forward family, captured arrays
    read on the device through their pointers; the backward (bwd_sm80, half types) too."""
    import cupy
    q, k, v = _case(dtype, 200, 200)
    kw_dev, kw_host = _user_functions(cupy)[name], _user_functions(numpy)[name]
    o, lse = run_gpu(q, k, v, True, kw_dev)
    naive.check_result(q, k, v, True, kw_host, o, lse)
    if dtype != numpy.dtype(numpy.float32):
        o, lse, do, grads = run_gpu_backward(q, k, v, True, kw_dev)
        naive.check_gradients(grads, q, k, v, o, lse, do, True, kw_host)


# Block masks that empty most tiles (issue 10, item 4): documents of 192, causal inside, and 16
# keys every query sees (a query tile visits key tile 0, then its document's: the walk jumps);
# a narrow window as a mask_mod, wider in each head.
_SKIP_MASKS = {
    "documents": cuflash.block_mask(
        lambda b, h, q, kv: (((q // 192) == (kv // 192)) & (q >= kv)) | (kv < 16),
        (1, 1), 1000, 1000),
    "window": cuflash.block_mask(lambda b, h, q, kv: (q >= kv) & (q - kv <= 40 + 60 * h),
                                 (1, 3), 1000, 1000, block=(64, 64)),
}


@pytest.mark.parametrize("dtype", [F16, BF16], ids=str)
@pytest.mark.parametrize("name", list(_SKIP_MASKS))
def test_block_masks_that_empty_most_tiles(family, dtype, name):
    """The forward's key-tile walk and the backward's query-tile walk leave out the tiles the
    map calls empty (their loads too): o, lse against the oracle in every forward family;
    gradients of bwd_sm80 in both modes, the deterministic ones bitwise reproducible."""
    q, k, v = _case(dtype, 1000, 1000)
    kw = {"block_mask": _SKIP_MASKS[name]}
    o, lse = run_gpu(q, k, v, False, kw)
    naive.check_result(q, k, v, False, kw, o, lse)
    if family == "default":
        for det in (False, True):
            o, lse, do, grads = run_gpu_backward(q, k, v, False, kw, deterministic=det)
            naive.check_gradients(grads, q, k, v, o, lse, do, False, kw)
        again = run_gpu_backward(q, k, v, False, kw, deterministic=True)[3]
        assert all(a.tobytes() == b.tobytes() for a, b in zip(grads, again))


# Block masks as tile lists (session 8): the map's blocks (48 x 80) are neither the kernels'
# tiles nor divide them, Lq and Lk are not multiples of either, and within one 192-row block
# of fwd_sm90 the 64-row slices of its warpgroups differ (rows with (q // 64) % 3 != 1 before
# 600 see nothing: empty slices beside partial and full ones; their rows are dead, o = 0 and
# lse = -inf). Documents of 130 make whole tiles empty and others full.
_SLICES = cuflash.block_mask(
    lambda b, h, q, kv: (((q // 64) % 3 == 1) | (q >= 600)) & ((q // 130) == (kv // 130)),
    (1, 1), 700, 650, block=(48, 80))


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_block_mask_lists_on_the_kernels_own_tiles(family, d, causal):
    """The forward reads each warpgroup's (warp's) kind from its list entry and the backward
    (bwd_sm90 at d = 64 and 128, bwd_sm80 elsewhere) the transpose list, with causal's bounds
    on top: o, lse against the oracle; gradients (both modes) against the reference."""
    q, k, v = _case(BF16, 700, 650, d=d)
    kw = {"block_mask": _SLICES}
    o, lse = run_gpu(q, k, v, causal, kw)
    naive.check_result(q, k, v, causal, kw, o, lse)
    if family in ("default", "sm80"):
        for det in (False, True):
            o, lse, do, grads = run_gpu_backward(q, k, v, causal, kw, deterministic=det)
            naive.check_gradients(grads, q, k, v, o, lse, do, causal, kw)
