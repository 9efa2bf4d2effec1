"""Thin adapter: the tolerance rule lives in ``cuflash.testing`` (arithmetic in
``cuflash/_tolerance.py``). This keeps the old call shape, ``(prob, ...)`` with a cuflash
``AttentionProblem``, for tests/test_emulated_sm80.py; new
tests call ``cuflash.testing.assert_attention_close(o, case, lse=..., grads=...)``."""

from __future__ import annotations

from cuflash import _tolerance
from cuflash._tolerance import eps, lse_tolerance, tolerance  # noqa: F401  (re-exported)


def geometry(prob, shapes=None):
    """The rule's view of a problem: its broadcast inputs and its causal mask."""
    import numpy
    visible = None
    if prob.causal:
        visible = (numpy.arange(prob.Lk)[None, :]
                   <= numpy.arange(prob.Lq)[:, None] + prob.causal_offset)
    shapes = shapes or (prob.q.shape, prob.k.shape, prob.v.shape)
    return _tolerance.Geometry(prob.q, prob.k, prob.v, xp=prob.xp, scale=float(prob.scale),
                               visible=visible, shapes=tuple(shapes))


def assert_attention_close(prob, o, lse, o_ref, lse_ref) -> float:
    assert o.dtype == prob.dtype and lse.dtype == prob.lse_dtype, (o.dtype, lse.dtype)
    assert o.shape == o_ref.shape and lse.shape == lse_ref.shape, (o.shape, lse.shape)
    return _tolerance.check_forward(geometry(prob), o, lse, o_ref, lse_ref, "")


def assert_gradients_close(prob, do, grads, ref_grads, shapes=None) -> float:
    shapes = shapes or tuple(r.shape for r in ref_grads)
    for x, shape in zip(grads, shapes):
        assert x.dtype == prob.dtype and x.shape == tuple(shape), (x.dtype, x.shape, shape)
    return _tolerance.check_gradients(geometry(prob, shapes), do, grads, ref_grads, "")
