"""How close a result must be to ``cuflash.reference`` (float64): the rule of DESIGN.md.

A result for inputs of dtype T passes when its max abs error against the float64 reference is

    at most  2 * (max abs error of a naive computation in T)  +  floor.

*Naive* is what a user would write with the same array module: materialise the scores, take a
max-subtracted softmax, multiply by v (:func:`naive_attention`). For float32 and float64 every
step is in that dtype. For float16 and bfloat16 it is what a user gets on a GPU: the products
``q @ k.T`` and ``p @ v`` accumulate in float32 (as cuBLAS does), the softmax is taken in
float32, and the scores, the probabilities and the output are stored in T.

The *floor* is the rounding noise of any algorithm of this precision, so that a lucky naive
result (an error of exactly 0 on a tiny input, or a float64 naive that does what the float64
reference does) cannot make the bound impossible. With ``eps_out`` and ``eps_acc`` the machine
epsilons of the output dtype and of the accumulation dtype (float32 for half types, else T):

- ``L = scale * max_ij sum_c |q_ic| |k_jc|`` bounds every logit given its operands (the
  condition number of the dot products): a logit carries a few roundings at that magnitude,
  ``4 eps_acc L``; a sum of ``Lk`` terms (the softmax denominator, the weighted sum of values,
  accumulated tile by tile) carries ``sqrt(Lk) eps_acc``, as independent rounding errors add.
  Together, the relative noise ``r = eps_acc * (4 L + sqrt(Lk))``;
- a logit error ``e`` moves an output row by about ``e * sum_j p_j |v_j|``, and the output is
  rounded once, so ``floor_o = W * (eps_out + r) + smallest_subnormal(T)`` where
  ``W = max_i sum_j p_ij |v_j|`` (the condition number of the weighted sums);
- the log-sum-exp inherits ``r`` and is rounded once: ``floor_lse = eps_acc * max|lse| + r``.

On the CPU path over thousands of Hypothesis examples (tests/test_cpu.py) the error stays
below half of this bound, and errors of a few dozen ulps fail it (test_the_tolerance_rejects_a_
wrong_result).

Non-finite values are compared exactly, in kind: where the reference is -inf (a row with no
visible key) the result must be -inf too, and its output row exactly 0; where the reference is
NaN or +inf the result must be NaN or +inf (IEEE arithmetic lets an Inf logit come out as
either, depending on the order of operations); elsewhere the result must be finite.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import ml_dtypes
import numpy

from cuflash._problem import AttentionProblem

HALF_DTYPES = (numpy.dtype(numpy.float16), numpy.dtype(ml_dtypes.bfloat16))


def eps(dtype: Any) -> float:
    """Machine epsilon (spacing of floats at 1) of ``dtype``, bfloat16 included."""
    return float(ml_dtypes.finfo(dtype).eps)


def accumulation_dtype(dtype: Any) -> numpy.dtype:
    """What cuflash accumulates in for inputs of ``dtype``: float64 for float64, else float32."""
    return numpy.dtype(numpy.float64 if numpy.dtype(dtype) == numpy.float64 else numpy.float32)


def relative_noise(dtype: Any, *, logit_bound: float, Lk: int) -> float:
    """``r``: the rounding noise of the logits and of the sums over ``Lk`` keys."""
    return eps(accumulation_dtype(dtype)) * (4 * logit_bound + math.sqrt(Lk))


def tolerance(naive_err: float, dtype: Any, *, weighted_abs_v: float, logit_bound: float,
              Lk: int) -> float:
    """Allowed max abs error of an attention output for inputs of ``dtype``.

    ``weighted_abs_v`` is ``W = max_i sum_j p_ij |v_j|`` and ``logit_bound`` is ``L``; see the
    module docstring.
    """
    r = relative_noise(dtype, logit_bound=logit_bound, Lk=Lk)
    floor = weighted_abs_v * (eps(dtype) + r) + float(ml_dtypes.finfo(dtype).smallest_subnormal)
    return 2 * naive_err + floor


def lse_tolerance(naive_err: float, dtype: Any, *, max_abs_lse: float, logit_bound: float,
                  Lk: int) -> float:
    """Allowed max abs error of the log-sum-exp for inputs of ``dtype``."""
    r = relative_noise(dtype, logit_bound=logit_bound, Lk=Lk)
    return 2 * naive_err + eps(accumulation_dtype(dtype)) * max_abs_lse + r


def to_host64(x: Any) -> numpy.ndarray:
    """A float64 NumPy copy of a NumPy or CuPy array."""
    return (x if isinstance(x, numpy.ndarray) else x.get()).astype(numpy.float64)


def naive_attention(prob: AttentionProblem) -> tuple[Any, Any]:
    """Attention as a user would write it with ``prob.xp``, materialising the scores.

    Returns ``(o, lse)`` in ``prob.dtype`` and ``prob.lse_dtype``. Rows with no visible key
    give 0 and -inf (so that their error is that of the other rows). Needs ``prob.Lk >= 1``.
    """
    xp = prob.xp
    half = prob.dtype in HALF_DTYPES
    compute = numpy.float32 if half else prob.dtype.type
    q, k, v = (x.astype(compute) for x in (prob.q, prob.k, prob.v))
    s = (q @ k.swapaxes(-1, -2)) * compute(prob.scale)
    if half:
        s = s.astype(prob.dtype).astype(numpy.float32)  # scores stored in the half type
    if prob.causal:
        visible = xp.arange(prob.Lk)[None, :] <= xp.arange(prob.Lq)[:, None] + prob.causal_offset
        s = xp.where(visible, s, compute(-numpy.inf))
    m = s.max(axis=-1, keepdims=True)
    m = xp.where(m == -numpy.inf, compute(0), m)
    e = xp.exp(s - m)
    l = e.sum(axis=-1, keepdims=True)
    with numpy.errstate(divide="ignore"):  # log(0) = -inf for rows with no visible key
        lse = (m + xp.log(l))[..., 0]
    p = e / xp.where(l == 0, compute(1), l)
    if half:
        p = p.astype(prob.dtype).astype(numpy.float32)  # probabilities stored in the half type
    o = (p @ v).astype(prob.dtype)
    return o, lse.astype(prob.lse_dtype)


def _conditioning(prob: AttentionProblem) -> tuple[float, float]:
    """``(L, W)`` of the module docstring, in float64 over the finite entries."""
    q, k, v = (numpy.nan_to_num(to_host64(x), nan=0.0, posinf=0.0, neginf=0.0)
               for x in (prob.q, prob.k, prob.v))
    abs_scores = prob.scale * (numpy.abs(q) @ numpy.abs(k).swapaxes(-1, -2))
    s = prob.scale * (q @ k.swapaxes(-1, -2))
    if prob.causal:
        i, j = numpy.arange(prob.Lq)[:, None], numpy.arange(prob.Lk)[None, :]
        s = numpy.where(j <= i + prob.causal_offset, s, -numpy.inf)
    m = s.max(axis=-1, keepdims=True)
    p = numpy.exp(s - numpy.where(m == -numpy.inf, 0.0, m))
    with numpy.errstate(invalid="ignore"):  # 0/0 in rows with no visible key: ignored
        weighted_abs_v = (p @ numpy.abs(v)) / p.sum(axis=-1, keepdims=True)
    return float(abs_scores.max()), float(numpy.nanmax(weighted_abs_v))


def _check_nonfinite(name: str, ours: numpy.ndarray, ref: numpy.ndarray) -> None:
    def kind(x):  # 0 finite, 1 -inf, 2 NaN or +inf
        return numpy.where(numpy.isfinite(x), 0, numpy.where(x == -numpy.inf, 1, 2))

    bad = kind(ours) != kind(ref)
    if bad.any():
        idx = tuple(int(i) for i in numpy.argwhere(bad)[0])
        raise AssertionError(f"{name}: non-finite values differ from the reference at "
                             f"{bad.sum()} positions, first {idx}: ours {ours[idx]!r}, "
                             f"reference {ref[idx]!r}")


def _max_err(x: numpy.ndarray, ref: numpy.ndarray, where: numpy.ndarray) -> tuple[float, tuple]:
    """Max of ``|x - ref|`` over ``where``, and its index (NaN if x is NaN there)."""
    err = numpy.abs(numpy.where(where, x, 0.0) - numpy.where(where, ref, 0.0))
    idx = numpy.unravel_index(numpy.argmax(err), err.shape)
    return float(err[idx]), tuple(int(i) for i in idx)


def _check_bound(name: str, ours: numpy.ndarray, ref: numpy.ndarray, naive: numpy.ndarray,
                 where: numpy.ndarray, tol_of: Callable[[float], float], what: str) -> float:
    naive_err, _ = _max_err(naive, ref, where)
    if not numpy.isfinite(naive_err):
        raise AssertionError(f"{name}: the naive baseline is not finite where the reference "
                             f"is; the test input is out of range for {what}")
    err, idx = _max_err(ours, ref, where)
    tol = tol_of(naive_err)
    if not err <= tol:
        raise AssertionError(
            f"{name}: max abs error {err:.3g} at {idx} (ours {ours[idx]!r}, reference "
            f"{ref[idx]!r}) exceeds {tol:.3g} = 2 x naive error {naive_err:.3g} + floor "
            f"{tol_of(0.0):.3g} ({what})")
    return err / tol


def assert_attention_close(prob: AttentionProblem, o: Any, lse: Any,
                           o_ref: numpy.ndarray, lse_ref: numpy.ndarray) -> float:
    """Assert that ``o`` and ``lse`` for ``prob`` match the float64 reference.

    ``o`` and ``lse`` may be NumPy or CuPy; ``o_ref`` and ``lse_ref`` come from
    ``cuflash.reference.attention(..., return_lse=True)``. Checks dtypes and shapes, the
    non-finite pattern, exact zeros in rows with no visible key, then the error bounds.

    Returns the largest ratio of error to tolerance (at most 1), for ``hypothesis.target``.
    """
    assert o.dtype == prob.dtype, (o.dtype, prob.dtype)
    assert lse.dtype == prob.lse_dtype, (lse.dtype, prob.lse_dtype)
    assert o.shape == o_ref.shape == prob.batch_shape + (prob.Lq, prob.dv), (o.shape, o_ref.shape)
    assert lse.shape == lse_ref.shape == prob.batch_shape + (prob.Lq,), (lse.shape, lse_ref.shape)
    o64, lse64 = to_host64(o), to_host64(lse)
    _check_nonfinite("o", o64, o_ref)
    _check_nonfinite("lse", lse64, lse_ref)
    no_key = (lse_ref == -numpy.inf)[..., None] & (o_ref == 0)
    if (o64[no_key] != 0).any():
        raise AssertionError("o: a row with no visible key is not exactly 0")

    o_ok, lse_ok = numpy.isfinite(o_ref), numpy.isfinite(lse_ref)
    if not lse_ok.any():
        return 0.0  # every row saw no key (or is NaN): all checked exactly above
    naive_o, naive_lse = (to_host64(x) for x in naive_attention(prob))
    logit_bound, weighted_abs_v = _conditioning(prob)
    max_abs_lse = float(numpy.abs(lse_ref[lse_ok]).max())
    what = f"{prob.dtype}, L={logit_bound:.3g}, W={weighted_abs_v:.3g}"
    return max(
        _check_bound("o", o64, o_ref, naive_o, o_ok,
                     lambda e: tolerance(e, prob.dtype, weighted_abs_v=weighted_abs_v,
                                         logit_bound=logit_bound, Lk=prob.Lk), what),
        _check_bound("lse", lse64, lse_ref, naive_lse, lse_ok,
                     lambda e: lse_tolerance(e, prob.dtype, max_abs_lse=max_abs_lse,
                                             logit_bound=logit_bound, Lk=prob.Lk), what),
    )
