"""How close a result must be to ``cuflash.reference`` (float64): the rule of DESIGN.md.

The public face is :func:`cuflash.testing.assert_attention_close`; this module holds the
arithmetic, so that the rule exists once.

**Forward.** A result for inputs of dtype T passes when its max abs error against the float64
reference is at most ``2 * (max abs error of a naive computation in T) + floor``.

*Naive* is what a user would write with the same array module (NumPy, or CuPy on the GPU):
materialise the scores, take a max-subtracted softmax, multiply by v (:func:`naive_attention`).
For float32 and float64 every step is in that dtype. For float16 and bfloat16 it is what a user
gets on a GPU: the products ``q @ k.T`` and ``p @ v`` accumulate in float32 (as cuBLAS does),
the softmax is taken in float32, and the scores, the probabilities and the output are stored in
T. (The half products are computed as float32 products of the half values, rounded to T
afterwards: the same numbers, and a route CuPy supports for every dtype and batch rank.)

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

**Backward.** Each of dq, dk, dv passes when its max abs error is at most
``3 * (max abs error of a naive backward in the same dtype) + floor``. The naive backward
(:func:`naive_attention_backward`) is what autograd does through the naive forward:
``dv = p.T @ do``, ``dp = do @ v.T``, ``ds = p * (dp - rowsum(dp * p))``,
``dq = scale * ds @ k``, ``dk = scale * ds.T @ q``, each summed over the dimensions broadcasting
added; for half types every intermediate (s, p, dp, ds) and result is stored in T. Its floor
(:func:`gradient_floors`): with ``N`` the longest sum behind one gradient element
(``max(Lq, Lk, d, dv)`` times the batch items summed into it) every term carries
``r = eps_acc * (L + sqrt(N))``; independent errors of the terms add in quadrature (root-sum-
square of the terms, float64); ``D = rowsum(dO * O)`` carries the rounding of ``O`` into a whole
row of ``ds``; the result is rounded once. ``floor = eps_out * G + r * (G + RSS) +
(eps_out + r) * C + smallest_subnormal`` with ``G`` the largest reference gradient, ``RSS`` the
largest root-sum-square, ``C`` the largest ``D`` term.

On cuflash's CPU path over thousands of examples the forward error stays below half of its
bound and the backward below 0.6; errors of a few dozen ulps fail them.

**Exact structure.** Non-finite values are compared in kind: where the reference is -inf (a
row with no visible key) the result must be -inf and the output row exactly 0; where it is NaN
or +inf the result must be NaN or +inf; elsewhere finite. Query rows that see no key get dq
exactly 0, keys no query sees get dk and dv exactly 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import ml_dtypes
import numpy

HALF_DTYPES = (numpy.dtype(numpy.float16), numpy.dtype(ml_dtypes.bfloat16))
#: The multiple of the naive error allowed, forward and backward (FlashAttention's tests).
FORWARD_FACTOR = 2
BACKWARD_FACTOR = 3


def eps(dtype: Any) -> float:
    """Machine epsilon (spacing of floats at 1) of ``dtype``, bfloat16 included."""
    return float(ml_dtypes.finfo(dtype).eps)


def accumulation_dtype(dtype: Any) -> numpy.dtype:
    """What attention accumulates in for inputs of ``dtype``: float64 for float64, else float32."""
    return numpy.dtype(numpy.float64 if numpy.dtype(dtype) == numpy.float64 else numpy.float32)


def relative_noise(dtype: Any, *, logit_bound: float, Lk: int) -> float:
    """``r``: the rounding noise of the logits and of the sums over ``Lk`` keys."""
    return eps(accumulation_dtype(dtype)) * (4 * logit_bound + math.sqrt(Lk))


def tolerance(naive_err: float, dtype: Any, *, weighted_abs_v: float, logit_bound: float,
              Lk: int) -> float:
    """Allowed max abs error of an attention output (``W`` = ``weighted_abs_v``, ``L`` =
    ``logit_bound``; see the module docstring)."""
    r = relative_noise(dtype, logit_bound=logit_bound, Lk=Lk)
    floor = weighted_abs_v * (eps(dtype) + r) + float(ml_dtypes.finfo(dtype).smallest_subnormal)
    return FORWARD_FACTOR * naive_err + floor


def lse_tolerance(naive_err: float, dtype: Any, *, max_abs_lse: float, logit_bound: float,
                  Lk: int) -> float:
    """Allowed max abs error of the log-sum-exp for inputs of ``dtype``."""
    r = relative_noise(dtype, logit_bound=logit_bound, Lk=Lk)
    return FORWARD_FACTOR * naive_err + eps(accumulation_dtype(dtype)) * max_abs_lse + r


def to_host64(x: Any) -> numpy.ndarray:
    """A float64 NumPy copy of a NumPy or CuPy array (or of anything ``numpy.asarray`` takes:
    a JAX array, a PyTorch CPU tensor)."""
    if not isinstance(x, numpy.ndarray):
        x = x.get() if hasattr(x, "get") and hasattr(x, "device") else numpy.asarray(x)
    return x.astype(numpy.float64)


def broadcast_axes(shape: tuple[int, ...], full: tuple[int, ...]) -> tuple[int, ...]:
    """The axes of ``full`` that broadcasting added to ``shape`` (leading ones and 1 -> n)."""
    lead = len(full) - len(shape)
    return tuple(range(lead)) + tuple(lead + i for i, n in enumerate(shape)
                                      if n == 1 and full[lead + i] != 1)


def sum_to_shape(x: Any, shape: tuple[int, ...], dtype: Any) -> Any:
    """``x`` summed (in its own dtype) over the axes broadcasting added to ``shape``, as
    ``dtype``: the gradient of a broadcast input."""
    axes = broadcast_axes(tuple(shape), tuple(x.shape))
    if axes:
        x = x.sum(axis=axes, keepdims=True)
    return x.reshape(shape).astype(dtype)


@dataclass
class Geometry:
    """What the rule needs to know about one attention call.

    ``q, k, v`` are the inputs broadcast to ``batch_shape`` (views, array module ``xp``),
    ``shapes`` their own shapes, ``visible`` a NumPy bool ``(Lq, Lk)`` matrix of the pairs the
    masks keep (None: all).
    """
    q: Any
    k: Any
    v: Any
    xp: Any
    scale: float
    visible: numpy.ndarray | None
    shapes: tuple
    cache: dict = field(default_factory=dict, repr=False)   # float64 work shared by checks

    @property
    def dtype(self) -> numpy.dtype:
        return numpy.dtype(self.q.dtype)

    @property
    def batch_shape(self) -> tuple[int, ...]:
        return tuple(self.q.shape[:-2])

    Lq = property(lambda self: self.q.shape[-2])
    Lk = property(lambda self: self.k.shape[-2])
    d = property(lambda self: self.q.shape[-1])
    dv = property(lambda self: self.v.shape[-1])


def make_geometry(q: Any, k: Any, v: Any, xp: Any, scale: float,
                  visible: numpy.ndarray | None) -> Geometry:
    batch = numpy.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    views = [xp.broadcast_to(x, batch + x.shape[-2:]) for x in (q, k, v)]
    return Geometry(*views, xp=xp, scale=float(scale), visible=visible,
                    shapes=(q.shape, k.shape, v.shape))


def _masked(g: Geometry, s: Any, fill: Any) -> Any:
    if g.visible is None:
        return s
    return g.xp.where(g.xp.asarray(g.visible), s, fill)


def _softmax_parts(g: Geometry, s: Any, compute: Any) -> tuple[Any, Any, Any]:
    """``(m, e, l)`` of a max-subtracted softmax; a row with no visible key subtracts 0, so its
    ``e`` is 0 rather than NaN (-inf - -inf)."""
    xp = g.xp
    m = s.max(axis=-1, keepdims=True)
    m = xp.where(m == -numpy.inf, compute(0), m)
    e = xp.exp(s - m)
    return m, e, e.sum(axis=-1, keepdims=True)


def naive_attention(g: Geometry) -> tuple[Any, Any]:
    """Attention as a user would write it with ``g.xp``, materialising the scores.

    Returns ``(o, lse)`` in ``g.dtype`` and the accumulation dtype. Rows with no visible key
    give 0 and -inf (so that their error is that of the other rows). Needs ``Lk >= 1``.
    """
    xp, half = g.xp, g.dtype in HALF_DTYPES
    compute = numpy.float32 if half else g.dtype.type
    q, k, v = (x.astype(compute) for x in (g.q, g.k, g.v))
    s = (q @ k.swapaxes(-1, -2)) * compute(g.scale)
    if half:
        s = s.astype(g.dtype).astype(numpy.float32)  # scores stored in the half type
    s = _masked(g, s, compute(-numpy.inf))
    m, e, l = _softmax_parts(g, s, compute)
    with numpy.errstate(divide="ignore"):  # log(0) = -inf for rows with no visible key
        lse = (m + xp.log(l))[..., 0]
    p = e / xp.where(l == 0, compute(1), l)
    if half:
        p = p.astype(g.dtype).astype(numpy.float32)  # probabilities stored in the half type
    o = (p @ v).astype(g.dtype)
    return o, lse.astype(accumulation_dtype(g.dtype))


def naive_attention_backward(g: Geometry, do: Any) -> tuple[Any, Any, Any]:
    """dq, dk, dv as autograd of the naive forward computes them, with ``g.xp``, in the
    shapes of the un-broadcast inputs and ``g.dtype``."""
    half = g.dtype in HALF_DTYPES
    compute = numpy.float32 if half else g.dtype.type

    def stored(x):  # an intermediate as autograd stores it: in the half type for half inputs
        return x.astype(g.dtype).astype(numpy.float32) if half else x

    q, k, v, dout = (x.astype(compute) for x in (g.q, g.k, g.v, do))
    s = _masked(g, stored((q @ k.swapaxes(-1, -2)) * compute(g.scale)), compute(-numpy.inf))
    _, e, l = _softmax_parts(g, s, compute)
    p = stored(e / g.xp.where(l == 0, compute(1), l))
    dv = stored(p.swapaxes(-1, -2) @ dout)
    dp = stored(dout @ v.swapaxes(-1, -2))
    ds = stored(p * (dp - (dp * p).sum(axis=-1, keepdims=True)))
    dq = stored((ds @ k) * compute(g.scale))
    dk = stored((ds.swapaxes(-1, -2) @ q) * compute(g.scale))
    return tuple(sum_to_shape(x, shape, g.dtype) for x, shape in zip((dq, dk, dv), g.shapes))


def _reference_p(g: Geometry) -> numpy.ndarray:
    """The attention probabilities in float64 (0 for masked keys and rows with no key)."""
    if "p" not in g.cache:
        g.cache["p"] = _compute_reference_p(g)
    return g.cache["p"]


def _compute_reference_p(g: Geometry) -> numpy.ndarray:
    q, k = (numpy.nan_to_num(to_host64(x), nan=0.0, posinf=0.0, neginf=0.0) for x in (g.q, g.k))
    s = g.scale * (q @ k.swapaxes(-1, -2))
    if g.visible is not None:
        s = numpy.where(g.visible, s, -numpy.inf)
    m = s.max(axis=-1, keepdims=True) if g.Lk else numpy.zeros(s.shape[:-1] + (1,))
    e = numpy.exp(s - numpy.where(m == -numpy.inf, 0.0, m))
    l = e.sum(axis=-1, keepdims=True)
    return e / numpy.where(l == 0, 1.0, l)


def conditioning(g: Geometry) -> tuple[float, float]:
    """``(L, W)`` of the module docstring, in float64 over the finite entries."""
    q, k, v = (numpy.nan_to_num(to_host64(x), nan=0.0, posinf=0.0, neginf=0.0)
               for x in (g.q, g.k, g.v))
    abs_scores = g.scale * (numpy.abs(q) @ numpy.abs(k).swapaxes(-1, -2))
    p = _reference_p(g)
    weighted_abs_v = p @ numpy.abs(v)       # rows of p sum to 1 (or are 0 where no key)
    return float(abs_scores.max(initial=0.0)), float(weighted_abs_v.max(initial=0.0))


def gradient_floors(g: Geometry, do: Any, ref_grads) -> tuple[float, float, float]:
    """The floors of dq, dk, dv (see the module docstring)."""
    p = _reference_p(g)
    q, k, v, dout = (to_host64(x) for x in (g.q, g.k, g.v, do))
    o = p @ v
    ds = p * (dout @ v.swapaxes(-1, -2) - (dout * o).sum(axis=-1, keepdims=True))
    d_rss = numpy.sqrt(((dout * o) ** 2).sum(axis=-1, keepdims=True))   # noise scale of D
    q, k, v, dout = (numpy.abs(x) for x in (q, k, v, dout))
    dp_rss = numpy.sqrt(dout**2 @ v.swapaxes(-1, -2) ** 2)              # noise scale of dP
    a = numpy.abs(ds) + p * dp_rss   # the size of each term of ds, and of its rounding noise
    pd = p * d_rss

    def total(x, shape):  # summed over the broadcast dimensions, like the gradient
        return sum_to_shape(x, shape, numpy.float64)

    qs, ks, vs = g.shapes
    rss = (g.scale * numpy.sqrt(total(a**2 @ k**2, qs)),
           g.scale * numpy.sqrt(total(a.swapaxes(-1, -2) ** 2 @ q**2, ks)),
           numpy.sqrt(total(p.swapaxes(-1, -2) ** 2 @ dout**2, vs)))
    coherent = (g.scale * total(pd @ k, qs), g.scale * total(pd.swapaxes(-1, -2) @ q, ks),
                numpy.zeros(vs))
    logit_bound = g.scale * float((q @ k.swapaxes(-1, -2)).max(initial=0.0))
    nbatch = math.prod(g.batch_shape)
    longest = max(g.Lq, g.Lk, g.d, g.dv)
    e_out, e_acc = eps(g.dtype), eps(accumulation_dtype(g.dtype))
    floors = []
    for ref, rs, co, shape in zip(ref_grads, rss, coherent, g.shapes):
        groups = nbatch // max(1, math.prod(shape[:-2]))   # batch items summed into one element
        r = e_acc * (logit_bound + math.sqrt(longest * groups))
        size = float(numpy.abs(ref).max(initial=0.0))
        floors.append(e_out * size + r * (size + float(rs.max(initial=0.0)))
                      + (e_out + r) * float(co.max(initial=0.0))
                      + float(ml_dtypes.finfo(g.dtype).smallest_subnormal))
    return tuple(floors)


def _kind(x: numpy.ndarray) -> numpy.ndarray:  # 0 finite, 1 -inf, 2 NaN or +inf
    return numpy.where(numpy.isfinite(x), 0, numpy.where(x == -numpy.inf, 1, 2))


def check_nonfinite(name: str, ours: numpy.ndarray, ref: numpy.ndarray, case: str) -> None:
    bad = _kind(ours) != _kind(ref)
    if bad.any():
        idx = tuple(int(i) for i in numpy.argwhere(bad)[0])
        raise AssertionError(f"{name}: non-finite values differ from the reference at "
                             f"{int(bad.sum())} positions, first at index {idx}: result "
                             f"{float(ours[idx])!r}, reference {float(ref[idx])!r}\n{case}")


def _max_err(x: numpy.ndarray, ref: numpy.ndarray, where: Any) -> tuple[float, tuple]:
    """Max of ``|x - ref|`` over ``where``, and its index (NaN if x is NaN there)."""
    err = numpy.abs(numpy.where(where, x, 0.0) - numpy.where(where, ref, 0.0))
    if err.size == 0:
        return 0.0, ()
    nan = numpy.isnan(err)
    idx = (numpy.unravel_index(int(numpy.argmax(nan)), err.shape) if nan.any()
           else numpy.unravel_index(int(numpy.argmax(err)), err.shape))
    return float(err[idx]), tuple(int(i) for i in idx)


def check_bound(name: str, ours: numpy.ndarray, ref: numpy.ndarray, naive: numpy.ndarray,
                where: Any, factor: int, floor: float, what: str, case: str) -> float:
    """Max error of ``ours`` within ``factor * naive error + floor``; returns error / bound."""
    naive_err, _ = _max_err(naive, ref, where)
    if not math.isfinite(naive_err):
        raise AssertionError(f"{name}: the naive baseline is not finite where the reference "
                             f"is; the input is out of range for {what}\n{case}")
    err, idx = _max_err(ours, ref, where)
    bound = factor * naive_err + floor
    if not err <= bound:
        raise AssertionError(
            f"{name}: max abs error {err:.3g} at index {idx} (result {float(ours[idx])!r}, reference "
            f"{float(ref[idx])!r}) exceeds the bound {bound:.3g} = {factor} x naive {what} error "
            f"{naive_err:.3g} + floor {floor:.3g}\n{case}")
    return err / bound if bound > 0 else 0.0


def check_forward(g: Geometry, o: Any, lse: Any, o_ref: numpy.ndarray, lse_ref: numpy.ndarray,
                  case: str) -> float:
    """The forward rule for ``o`` (and ``lse`` unless None); returns the worst error / bound."""
    o64 = to_host64(o)
    lse64 = None if lse is None else to_host64(lse)
    check_nonfinite("o", o64, o_ref, case)
    if lse64 is not None:
        check_nonfinite("lse", lse64, lse_ref, case)
    no_key = (lse_ref == -numpy.inf)[..., None] & (o_ref == 0)
    if (o64[numpy.broadcast_to(no_key, o64.shape)] != 0).any():
        idx = tuple(int(i) for i in numpy.argwhere(no_key & (o64 != 0))[0])
        raise AssertionError(f"o: a row with no visible key is not exactly 0: index {idx} "
                             f"holds {float(o64[idx])!r}\n{case}")
    lse_ok = numpy.isfinite(lse_ref)
    if not lse_ok.any():
        return 0.0   # every row saw no key (or is NaN): all checked exactly above
    naive_o, naive_lse = (to_host64(x) for x in naive_attention(g))
    logit_bound, weighted_abs_v = conditioning(g)
    what = f"{g.dtype} (L={logit_bound:.3g}, W={weighted_abs_v:.3g})"
    worst = check_bound("o", o64, o_ref, naive_o, numpy.isfinite(o_ref), FORWARD_FACTOR,
                        tolerance(0.0, g.dtype, weighted_abs_v=weighted_abs_v,
                                  logit_bound=logit_bound, Lk=g.Lk), what, case)
    if lse64 is not None:
        max_abs_lse = float(numpy.abs(lse_ref[lse_ok]).max())
        worst = max(worst, check_bound(
            "lse", lse64, lse_ref, naive_lse, lse_ok, FORWARD_FACTOR,
            lse_tolerance(0.0, g.dtype, max_abs_lse=max_abs_lse, logit_bound=logit_bound,
                          Lk=g.Lk), what, case))
    return worst


def check_gradients(g: Geometry, do: Any, grads, ref_grads, case: str) -> float:
    """The backward rule for ``grads = (dq, dk, dv)``; returns the worst error / bound."""
    ours = [to_host64(x) for x in grads]
    names = ("dq", "dk", "dv")
    if 0 in g.batch_shape or g.Lq == 0 or g.Lk == 0:
        for name, x in zip(names, ours):   # nothing to differentiate through
            if (x != 0).any():
                raise AssertionError(f"{name} of an empty problem is not exactly 0\n{case}")
        return 0.0
    vis = numpy.ones((g.Lq, g.Lk), bool) if g.visible is None else g.visible
    zero_rows = (~vis.any(axis=1))[:, None], (~vis.any(axis=0))[:, None]
    for name, x, zero in zip(names, ours, (zero_rows[0], zero_rows[1], zero_rows[1])):
        z = numpy.broadcast_to(zero, x.shape)
        if (x[z] != 0).any():
            idx = tuple(int(i) for i in numpy.argwhere(z & (x != 0))[0])
            who = "a query row that sees no key" if name == "dq" else "a key that no query sees"
            raise AssertionError(f"{name}: {who} has a gradient that is not exactly 0: index "
                                 f"{idx} holds {float(x[idx])!r}\n{case}")
        if not numpy.isfinite(x).all():
            idx = tuple(int(i) for i in numpy.argwhere(~numpy.isfinite(x))[0])
            raise AssertionError(f"{name}: not finite at index {idx}: {float(x[idx])!r}\n{case}")
    naive = [to_host64(x) for x in naive_attention_backward(g, do)]
    floors = gradient_floors(g, do, ref_grads)
    worst = 0.0
    for name, x, ref, nv, floor in zip(names, ours, ref_grads, naive, floors):
        if x.size:
            worst = max(worst, check_bound(name, x, ref, nv, True, BACKWARD_FACTOR, floor,
                                           f"{g.dtype} backward", case))
    return worst

