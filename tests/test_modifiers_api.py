"""The modifier keywords on the public functions: cuflash.attention, attention_backward,
attention_vjp and cuflash.reference (NumPy on the CPU path), the order of the gradients
(dq, dk, dv, dbias, dsink), and CuPy calls refused with NotImplementedError naming the modifier.
"""

from __future__ import annotations

import numpy
import numpy as np
import pytest

import _naive_modifiers as naive
import cuflash
from cuflash import _modifiers


def _inputs(seed=0, dtype=numpy.float64):
    rng = numpy.random.default_rng(seed)
    q = rng.standard_normal((2, 3, 11, 8)).astype(dtype)
    k = rng.standard_normal((2, 1, 9, 8)).astype(dtype)
    v = rng.standard_normal((2, 1, 9, 5)).astype(dtype)
    kw = dict(window=(4, 1), softcap=3.0, alibi_slopes=numpy.array([0.1, 0.2, 0.4]),
              sink=rng.standard_normal((3,)).astype(numpy.float32),
              bias=rng.standard_normal((3, 11, 9)).astype(numpy.float16),
              mask=rng.random((11, 9)) < 0.85,
              score_mod=lambda s, b, h, i, j: s - 0.05 * np.abs(i - j) * (h + 1),
              mask_mod=lambda b, h, i, j: (i + j) % 5 != 0)
    return rng, q, k, v, kw


def test_attention_and_the_reference_with_every_modifier():
    rng, q, k, v, kw = _inputs()
    o, lse = cuflash.attention(q, k, v, causal=True, return_lse=True, **kw)
    o_ref, lse_ref = cuflash.reference.attention(q, k, v, causal=True, return_lse=True, **kw)
    o_n, lse_n = naive.attention(q, k, v, scale=8 ** -0.5, causal_offset=9 - 11, **kw)
    numpy.testing.assert_allclose(o_ref, o_n, rtol=1e-12, atol=1e-12)
    numpy.testing.assert_allclose(lse_ref, lse_n, rtol=1e-12, atol=1e-12)
    numpy.testing.assert_allclose(o, o_ref, rtol=1e-12, atol=1e-12)
    numpy.testing.assert_allclose(lse, lse_ref, rtol=1e-12, atol=1e-12)
    assert numpy.isfinite(lse).all()                      # the sink: no row ends at -inf


def test_backward_returns_dbias_then_dsink_with_their_shapes_and_dtypes():
    rng, q, k, v, kw = _inputs(1)
    o, lse = cuflash.attention(q, k, v, return_lse=True, **kw)
    do = rng.standard_normal(o.shape)
    grads = cuflash.attention_backward(do, q, k, v, o, lse, **kw)
    assert len(grads) == 5
    dq, dk, dv, dbias, dsink = grads
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    assert dbias.shape == kw["bias"].shape and dbias.dtype == numpy.float16
    assert dsink.shape == kw["sink"].shape and dsink.dtype == numpy.float32
    ref = cuflash.reference.attention_backward(do, q, k, v, **kw)
    assert len(ref) == 5
    for g, r in zip(grads, ref):
        numpy.testing.assert_allclose(g.astype(float), r,
                                      rtol=1e-3 if g.dtype == numpy.float16 else 1e-6,
                                      atol=1e-3 * numpy.abs(r).max())
    only_sink = {"sink": kw["sink"]}
    o2, lse2 = cuflash.attention(q, k, v, return_lse=True, **only_sink)
    assert len(cuflash.attention_backward(do, q, k, v, o2, lse2, **only_sink)) == 4


def test_vjp_passes_the_modifiers_to_both_passes():
    rng, q, k, v, kw = _inputs(2)
    o, pullback = cuflash.attention_vjp(q, k, v, **kw)
    numpy.testing.assert_array_equal(o, cuflash.attention(q, k, v, **kw))
    do = rng.standard_normal(o.shape)
    lse = cuflash.attention(q, k, v, return_lse=True, **kw)[1]
    for a, b in zip(pullback(do), cuflash.attention_backward(do, q, k, v, o, lse, **kw)):
        numpy.testing.assert_array_equal(a, b)
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['windw'\]"):
        cuflash.attention_vjp(q, k, v, windw=(1, 1))


def test_no_keys_with_a_sink_gives_lse_sink():
    q = numpy.ones((3, 4, 2), numpy.float32)
    kv = numpy.ones((3, 0, 2), numpy.float32)
    sink = numpy.array([0.5, -1.0, numpy.inf], numpy.float32)
    o, lse = cuflash.attention(q, kv, kv, sink=sink, return_lse=True)
    assert (o == 0).all() and (lse == sink[:, None]).all()
    grads = cuflash.attention_backward(numpy.ones_like(o), q, kv, kv, o, lse, sink=sink)
    assert len(grads) == 4 and (grads[3] == 0).all() and grads[3].shape == (3,)


def test_public_names_and_errors_through_the_api():
    q = numpy.ones((2, 4, 2))
    doc = cuflash.captured(numpy.array([0, 0, 1]))
    with pytest.raises(IndexError, match="index 3 is out of range"):
        cuflash.attention(q, q, q, mask_mod=lambda b, h, i, j: doc[i] == doc[j])
    with pytest.raises(ValueError, match=r"window left bound must be >= 0"):
        cuflash.attention(q, q, q, window=(-1, 0))
    with pytest.raises(TypeError, match=r"mask must be a bool array"):
        cuflash.reference.attention(q, q, q, mask=numpy.ones((4, 4)))
    bm = cuflash.block_mask(lambda b, h, i, j: i >= j, (2,), 4, 4, block=(2, 2))
    a = cuflash.attention(q + numpy.arange(4)[:, None], q, q, block_mask=bm)
    b = cuflash.attention(q + numpy.arange(4)[:, None], q, q, causal=True)
    numpy.testing.assert_allclose(a, b, rtol=1e-14)


def test_gpu_calls_with_modifiers_are_refused_with_the_names():
    mods = _modifiers.check_modifiers(xp=numpy, device_id=None, batch_shape=(2,), Lq=3, Lk=3,
                                      softcap=2.0, window=(1, 1))
    # the forward kernels run the built-ins; the backward only bwd_sm80 (half types, d <= 128)
    _modifiers.check_gpu_support(mods, "attention")
    _modifiers.check_gpu_support(mods, "attention_backward", numpy.float16, 128)
    for dtype, dmax in ((numpy.float32, 64), (numpy.float16, 256)):
        with pytest.raises(NotImplementedError,
                           match=r"cuflash.attention_backward on CuPy arrays does not implement "
                                 r"softcap, window yet"):
            _modifiers.check_gpu_support(mods, "attention_backward", dtype, dmax)
    user = _modifiers.check_modifiers(xp=numpy, device_id=None, batch_shape=(2,), Lq=3, Lk=3,
                                      softcap=2.0, score_mod=lambda s, b, h, i, j: s)
    _modifiers.check_gpu_support(user, "attention")          # traced into the Variant
    with pytest.raises(NotImplementedError,
                       match=r"cuflash.attention_backward on CuPy arrays does not implement "
                             r"score_mod, softcap yet"):
        _modifiers.check_gpu_support(user, "attention_backward", numpy.float64, 8)
    _modifiers.check_gpu_support(_modifiers.no_modifiers((2,), 3, 3), "attention")   # fine


@pytest.mark.gpu
def test_cupy_calls_with_modifiers_raise_not_implemented_before_gpu_work():
    import cupy
    q = cupy.ones((2, 4, 8), cupy.float16)
    with pytest.raises(NotImplementedError, match="score_mod"):
        q64 = q.astype(cupy.float64)
        cuflash.attention_backward(q64, q64, q64, q64, q64, cupy.zeros((2, 4), cupy.float64),
                                   softcap=30.0, score_mod=lambda s, b, h, i, j: s * 2.0)
    with pytest.raises(NotImplementedError, match="bias"):
        q32 = q.astype(cupy.float32)
        cuflash.attention_backward(q32, q32, q32, q32, q32, cupy.zeros((2, 4), cupy.float32),
                                   bias=cupy.zeros((4, 4), cupy.float16))


def test_explain_shows_the_traced_source():
    from cuflash import _api
    q = numpy.ones((2, 4, 8), numpy.float16)
    text = _api.explain(q, q, q, softcap=30.0, score_mod=lambda s, b, h, i, j: s * 2.0,
                        mask_mod=lambda b, h, i, j: i >= j)
    assert "with modifiers: mask_mod, score_mod, softcap" in text
    assert "not implemented yet" not in text        # the forward kernels run all three
    assert "struct ScoreMod_" in text and "struct MaskMod_" in text and "0x1.0" in text
    bad = _api.explain(q, q, q, score_mod=lambda s, b, h, i, j: np.arctan(s))
    assert "cannot be traced for the GPU" in bad and "numpy.arctan" in bad
    with pytest.raises(TypeError, match="unexpected keyword"):
        _api.explain(q, q, q, softcapp=1.0)


@pytest.mark.gpu
def test_the_reference_takes_cupy_inputs_with_modifiers():
    import cupy
    rng, q, k, v, kw = _inputs(3, numpy.float32)
    doc = numpy.array([0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2])
    kw["mask_mod"] = (lambda d: (lambda b, h, i, j: d[i] >= d[j % 11]))(
        cuflash.captured(cupy.asarray(doc)))
    want = cuflash.reference.attention(q, k, v, return_lse=True,
                                       **{**kw, "mask_mod": lambda b, h, i, j:
                                          doc[i] >= doc[j % 11]})
    gkw = {n: (cupy.asarray(x) if isinstance(x, numpy.ndarray) else x) for n, x in kw.items()}
    got = cuflash.reference.attention(*(cupy.asarray(x) for x in (q, k, v)), return_lse=True,
                                      **gkw)
    for a, b in zip(got, want):
        numpy.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("with_bias", [False, True])
def test_the_threaded_cpu_path_splits_batch_items_with_their_modifiers(with_bias):
    """Large enough that the CPU path splits the batch into tasks on threads (each task gets
    the pipeline restricted to its items: b, h, slopes, sink, mask, bias indexed alike)."""
    from cuflash import _numpy
    rng = numpy.random.default_rng(12)
    B, H, L = 4, 8, 256
    assert len(_numpy._batch_groups((B, H), L * L)) > 1
    q, k, v = (rng.standard_normal((B, H, L, 16)) for _ in range(3))
    kw = dict(window=(100, 3), softcap=5.0, alibi_slopes=rng.uniform(0, 0.1, (H,)),
              sink=rng.standard_normal((B, 1)), mask=rng.random((B, 1, L, L)) < 0.9,
              score_mod=lambda s, b, h, i, j: s + 0.01 * h - 0.02 * b,
              mask_mod=lambda b, h, i, j: (i + j + h) % 7 != 0)
    if with_bias:
        kw["bias"] = rng.standard_normal((H, L, L))
    o, lse = cuflash.attention(q, k, v, return_lse=True, **kw)
    o_ref, lse_ref = cuflash.reference.attention(q, k, v, return_lse=True, **kw)
    numpy.testing.assert_allclose(o, o_ref, rtol=1e-10, atol=1e-10)
    numpy.testing.assert_allclose(lse, lse_ref, rtol=1e-10, atol=1e-10)
    do = rng.standard_normal(o.shape)
    grads = cuflash.attention_backward(do, q, k, v, o, lse, **kw)
    ref = cuflash.reference.attention_backward(do, q, k, v, **kw)
    assert len(grads) == len(ref) == (5 if with_bias else 4)
    for g, r in zip(grads, ref):
        numpy.testing.assert_allclose(g, r, rtol=1e-9, atol=1e-9 * numpy.abs(r).max())
