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
  rounded once, so ``floor_o = W * (eps_out + r) + smallest_subnormal(T) + flush`` where
  ``W = max_i sum_j p_ij |v_j|`` (the condition number of the weighted sums);
- GPU kernels may flush subnormal numbers of the accumulation type to zero (the fast ``exp2``
  of the tensor-core kernels does): a weight ``p_j`` below the smallest normal number ``tiny``
  then counts 0, and so does an output element below it, so ``flush = tiny_acc * (1 + Lk *
  max|v|)`` (1.2e-38 per unit of v in float32, nothing that matters in float64: it shows where
  a large sink pushes every weight of a row below 1e-38; the first H200 fuzz campaign with
  modifiers found four such rows);
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
row of ``ds`` (at the scale of ``dO * (p @ |v|)``: O's rounding follows the size of its terms,
not of O, which may cancel); the result is rounded once. ``floor = eps_out * G + r * (G + RSS) +
(eps_out + r) * C + smallest_subnormal`` with ``G`` the largest reference gradient, ``RSS`` the
largest root-sum-square, ``C`` the largest ``D`` term.

**Modifiers** (``Geometry.mods``, ``Geometry.visible``). The naive computation applies them
as a user would, in its own code (``cuflash._testing_modifiers``): softcap, ALiBi, bias and
score_mod on the scaled scores, each result stored in T for half types; then the masks (causal,
window, mask, mask_mod, -inf bias entries); a sink is one more key of score ``sink`` and value
0 in the max-subtracted softmax. ``L`` also bounds the modified scores and the sink (a large
sink is subtracted from every score: its rounding moves every exponent). The naive backward
goes through the chain (``1 - tanh^2`` of the softcap, the derivative of the score_mod) and gives
``dbias`` (ds summed over bias's broadcast dims) and ``dsink = -sum_i p_sink_i D_i``; their
floors have the form above with the chain in the terms, plus the chain factor's own absolute
noise (``2 eps_acc``: ``1 - tanh^2`` of a saturated tanh is 0 in float64, an ulp in float32). ``D`` also carries the underflow of
``O`` stored in T (up to a subnormal spacing per element, times ``sum |dO|``: it matters for
half types, whose O may be below 6e-8 when a large sink takes the probability).

On cuflash's CPU path over thousands of examples the forward error stays below half of its
bound and the backward below 0.6 (with every modifier on, 3,000-example campaigns: below
0.75); errors of a few dozen ulps fail them.

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

from cuflash._testing_arrays import (all_to_shape, broadcast_axes,  # noqa: F401  (here too)
                                     sum_to_shape, to_host64)

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


def flush_noise(dtype: Any, *, Lk: int, max_abs_v: float) -> float:
    """What flushing subnormals of the accumulation type to zero can move an output element
    by: each of ``Lk`` weights ``p_j`` below the smallest normal number, times ``|v_j|``, and
    the element itself (see the module docstring)."""
    tiny = float(numpy.finfo(accumulation_dtype(dtype)).tiny)
    return tiny * (1.0 + Lk * max_abs_v)


def tolerance(naive_err: float, dtype: Any, *, weighted_abs_v: float, logit_bound: float,
              Lk: int, max_abs_v: float = 0.0) -> float:
    """Allowed max abs error of an attention output (``W`` = ``weighted_abs_v``, ``L`` =
    ``logit_bound``, ``max_abs_v`` = max |v|; see the module docstring)."""
    r = relative_noise(dtype, logit_bound=logit_bound, Lk=Lk)
    floor = (weighted_abs_v * (eps(dtype) + r) + float(ml_dtypes.finfo(dtype).smallest_subnormal)
             + flush_noise(dtype, Lk=Lk, max_abs_v=max_abs_v))
    return FORWARD_FACTOR * naive_err + floor


def lse_tolerance(naive_err: float, dtype: Any, *, max_abs_lse: float, logit_bound: float,
                  Lk: int) -> float:
    """Allowed max abs error of the log-sum-exp for inputs of ``dtype``."""
    r = relative_noise(dtype, logit_bound=logit_bound, Lk=Lk)
    return FORWARD_FACTOR * naive_err + eps(accumulation_dtype(dtype)) * max_abs_lse + r


@dataclass
class Geometry:
    """What the rule needs to know about one attention call.

    ``q, k, v`` are the inputs broadcast to ``batch_shape`` (views, array module ``xp``),
    ``shapes`` their own shapes, ``visible`` a NumPy bool array broadcastable to
    ``batch_shape + (Lq, Lk)`` of the pairs the masks keep (None: all), ``mods`` the
    score-changing modifiers (``cuflash._testing_modifiers.NaiveModifiers``, or None).
    """
    q: Any
    k: Any
    v: Any
    xp: Any
    scale: float
    visible: numpy.ndarray | None
    shapes: tuple
    mods: Any = None
    cache: dict = field(default_factory=dict, repr=False)   # float64 work shared by checks

    @property
    def grad_shapes(self) -> tuple:
        """Shapes of dq, dk, dv, then dbias and dsink when on."""
        extra = () if self.mods is None else tuple(
            s for s in (self.mods.bias_shape, self.mods.sink_shape) if s is not None)
        return tuple(self.shapes) + extra

    def visible_full(self) -> numpy.ndarray:
        """``visible`` broadcast to ``batch_shape + (Lq, Lk)`` (all True without masks)."""
        full = self.batch_shape + (self.Lq, self.Lk)
        if self.visible is None:
            return numpy.ones(full, bool)
        return numpy.broadcast_to(self.visible, full)

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
                  visible: numpy.ndarray | None, mods: Any = None) -> Geometry:
    batch = numpy.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    views = [xp.broadcast_to(x, batch + x.shape[-2:]) for x in (q, k, v)]
    return Geometry(*views, xp=xp, scale=float(scale), visible=visible,
                    shapes=(q.shape, k.shape, v.shape), mods=mods)


def _softmax_parts(g: Geometry, s: Any, compute: Any, xp: Any = None) -> tuple[Any, ...]:
    """``(m, e, l, e_sink)`` of a max-subtracted softmax; a row with no visible key subtracts
    0, so its ``e`` is 0 rather than NaN (-inf - -inf). A sink is one more key of score
    ``sink`` and value 0: it takes part in ``m`` and ``l``; ``e_sink`` is its ``e`` (or None)."""
    xp = g.xp if xp is None else xp
    m = s.max(axis=-1, keepdims=True)
    sink = None if g.mods is None else g.mods.sink_of(xp, compute)
    if sink is not None:
        m = xp.maximum(m, sink)
    m = xp.where(m == -numpy.inf, compute(0), m)
    e = xp.exp(s - m)
    l = e.sum(axis=-1, keepdims=True)
    e_sink = None
    if sink is not None:
        e_sink = xp.exp(sink - m)
        l = l + e_sink
    return m, e, l, e_sink


def _modified_scores(g: Geometry, s: Any, xp: Any, compute: Any, stored: Any) -> tuple:
    """Steps 2-6 of the score pipeline on the scaled scores ``s``: ``(masked scores, saved)``."""
    saved: dict = {}
    if g.mods is not None:
        s, saved = g.mods.transform(s, xp, compute, stored)
    if g.visible is not None:
        s = xp.where(xp.asarray(g.visible), s, compute(-numpy.inf))
    return s, saved


def _storage(g: Geometry) -> tuple[Any, Any]:
    """``(compute dtype, stored)``: ``stored(x)`` rounds an intermediate to the half type for
    half inputs (as a framework stores it) and is the identity otherwise."""
    half = g.dtype in HALF_DTYPES
    compute = numpy.float32 if half else g.dtype.type

    def stored(x):
        return x.astype(g.dtype).astype(numpy.float32) if half else x
    return compute, stored


def naive_attention(g: Geometry) -> tuple[Any, Any]:
    """Attention as a user would write it with ``g.xp``, materialising the scores, the
    modifiers applied in DESIGN.md's order (``g.mods``, ``g.visible``).

    Returns ``(o, lse)`` in ``g.dtype`` and the accumulation dtype. Rows with no visible key
    give 0 and -inf (``lse = sink`` with a sink), so that their error is that of the other
    rows. Needs ``Lk >= 1``.
    """
    xp = g.xp
    compute, stored = _storage(g)
    q, k, v = (x.astype(compute) for x in (g.q, g.k, g.v))
    s = stored((q @ k.swapaxes(-1, -2)) * compute(g.scale))   # scores stored in T
    s, _ = _modified_scores(g, s, xp, compute, stored)
    m, e, l, _ = _softmax_parts(g, s, compute)
    with numpy.errstate(divide="ignore"):  # log(0) = -inf for rows with no visible key
        lse = (m + xp.log(l))[..., 0]
    p = stored(e / xp.where(l == 0, compute(1), l))   # probabilities stored in T
    o = (p @ v).astype(g.dtype)
    return o, lse.astype(accumulation_dtype(g.dtype))


def naive_attention_backward(g: Geometry, do: Any) -> tuple[Any, ...]:
    """dq, dk, dv (then dbias, dsink when on) as autograd of the naive forward computes them,
    with ``g.xp``, in the shapes of the un-broadcast inputs and ``g.dtype`` (dbias in the
    bias's dtype, dsink in the sink's)."""
    xp = g.xp
    compute, stored = _storage(g)
    zero = compute(0)
    q, k, v, dout = (x.astype(compute) for x in (g.q, g.k, g.v, do))
    s = stored((q @ k.swapaxes(-1, -2)) * compute(g.scale))
    s, saved = _modified_scores(g, s, xp, compute, stored)
    _, e, l, e_sink = _softmax_parts(g, s, compute)
    l = xp.where(l == 0, compute(1), l)
    p = stored(e / l)
    dv = stored(p.swapaxes(-1, -2) @ dout)
    dp = stored(dout @ v.swapaxes(-1, -2))
    D = (dp * p).sum(axis=-1, keepdims=True)
    ds = stored(p * (dp - D))
    extra = []
    if g.mods is not None:
        d_total, d_bias = g.mods.chain(saved, xp, compute)
        with numpy.errstate(all="ignore"):   # a hidden pair has ds = 0: no chain through it
            if g.mods.bias is not None:
                ds_bias = stored(xp.where(ds == 0, zero, ds * d_bias))
                extra.append(sum_to_shape(ds_bias, g.mods.bias_shape, g.mods.bias_dtype))
            ds = stored(xp.where(ds == 0, zero, ds * d_total))
        if g.mods.sink is not None:
            dsink = -((e_sink / l) * D)[..., 0].sum(axis=-1)
            extra.append(sum_to_shape(dsink, g.mods.sink_shape, g.mods.sink_dtype))
    dq = stored((ds @ k) * compute(g.scale))
    dk = stored((ds.swapaxes(-1, -2) @ q) * compute(g.scale))
    return tuple(sum_to_shape(x, shape, g.dtype)
                 for x, shape in zip((dq, dk, dv), g.shapes)) + tuple(extra)


def _reference_p(g: Geometry) -> numpy.ndarray:
    """The attention probabilities in float64 (0 for masked keys and rows with no key)."""
    if "p" not in g.cache:
        g.cache.update(_compute_reference_p(g))
    return g.cache["p"]


def _compute_reference_p(g: Geometry) -> dict:
    """p; p_sink (the sink's share, or None); the chain factors of the modifiers in float64
    (``d_total``, ``d_bias``: 1 without them); the largest modified |score| seen."""
    q, k = (numpy.nan_to_num(to_host64(x), nan=0.0, posinf=0.0, neginf=0.0) for x in (g.q, g.k))
    s = g.scale * (q @ k.swapaxes(-1, -2))
    s, saved = _modified_scores(g, s, numpy, numpy.float64, lambda x: x)
    finite = numpy.abs(s[numpy.isfinite(s)])
    if g.mods is not None and g.mods.sink is not None:   # the sink is a score too
        sink = numpy.asarray(g.mods.sink, numpy.float64)
        finite = numpy.concatenate([finite.ravel(), numpy.abs(sink[numpy.isfinite(sink)])])
    out = dict(max_score=float(finite.max(initial=0.0)), d_total=1.0, d_bias=1.0)
    if g.mods is not None:
        out["d_total"], out["d_bias"] = (numpy.abs(x) for x in g.mods.chain(
            saved, numpy, numpy.float64))
    if g.Lk == 0:
        s = numpy.full(s.shape[:-1] + (1,), -numpy.inf)
    m, e, l, e_sink = _softmax_parts(g, s, numpy.float64, numpy)
    l = numpy.where(l == 0, 1.0, l)
    out["p"] = (e / l)[..., :g.Lk]
    out["p_sink"] = None if e_sink is None else e_sink / l
    return out


def conditioning(g: Geometry) -> tuple[float, float]:
    """``(L, W)`` of the module docstring, in float64 over the finite entries (``L`` also
    bounds the scores the modifiers made)."""
    q, k, v = (numpy.nan_to_num(to_host64(x), nan=0.0, posinf=0.0, neginf=0.0)
               for x in (g.q, g.k, g.v))
    abs_scores = g.scale * (numpy.abs(q) @ numpy.abs(k).swapaxes(-1, -2))
    p = _reference_p(g)
    weighted_abs_v = p @ numpy.abs(v)       # rows of p sum to 1 (or are 0 where no key)
    return (max(float(abs_scores.max(initial=0.0)), g.cache["max_score"]),
            float(weighted_abs_v.max(initial=0.0)))


def gradient_floors(g: Geometry, do: Any, ref_grads) -> tuple[float, ...]:
    """The floors of dq, dk, dv, then dbias and dsink when on (see the module docstring)."""
    p = _reference_p(g)
    d_total, d_bias, p_sink = g.cache["d_total"], g.cache["d_bias"], g.cache["p_sink"]
    q, k, v, dout = (to_host64(x) for x in (g.q, g.k, g.v, do))
    o = p @ v
    ds = p * (dout @ v.swapaxes(-1, -2) - (dout * o).sum(axis=-1, keepdims=True))
    # noise scale of D: O's rounding error scales with p @ |v| (not |O|, which cancels)
    d_rss = numpy.sqrt(((dout * (p @ numpy.abs(v))) ** 2).sum(axis=-1, keepdims=True))
    # O stored in T is off by up to a subnormal spacing where it underflows: D moves by that
    # times sum |dO| (matters for half types, where O can be below 6e-8)
    tiny = float(ml_dtypes.finfo(g.dtype).smallest_subnormal)
    d_rss = d_rss + tiny / eps(g.dtype) * numpy.abs(dout).sum(axis=-1, keepdims=True)
    q, k, v, dout = (numpy.abs(x) for x in (q, k, v, dout))
    dp_rss = numpy.sqrt(dout**2 @ v.swapaxes(-1, -2) ** 2)              # noise scale of dP
    a0 = numpy.abs(ds) + p * dp_rss  # the size of each term of ds, and of its rounding noise
    a, pd = a0 * d_total, p * d_rss * d_total   # through softcap and score_mod
    e_acc = eps(accumulation_dtype(g.dtype))

    def total(x, shape):  # summed over the broadcast dimensions, like the gradient
        return sum_to_shape(x, shape, numpy.float64)

    qs, ks, vs = g.shapes[:3]
    # a chain factor (1 - tanh^2, a score_mod's derivative) computed from rounded values is off
    # by a few eps_acc in absolute terms: near saturation (a factor ~0) that is all there is
    mods = g.mods
    cn = 2 * e_acc if mods is not None and (mods.softcap or mods.score_mod) else 0.0
    chain = [cn * g.scale * total(a0 @ k, qs), cn * g.scale * total(a0.swapaxes(-1, -2) @ q, ks),
             0.0]
    if mods is not None and mods.bias is not None:   # dbias goes through the score_mod only
        chain.append((2 * e_acc if mods.score_mod else 0.0) * total(a0, mods.bias_shape))
    chain.append(0.0)                                 # dsink: no chain
    rss = [g.scale * numpy.sqrt(total(a**2 @ k**2, qs)),
           g.scale * numpy.sqrt(total(a.swapaxes(-1, -2) ** 2 @ q**2, ks)),
           numpy.sqrt(total(p.swapaxes(-1, -2) ** 2 @ dout**2, vs))]
    coherent = [g.scale * total(pd @ k, qs), g.scale * total(pd.swapaxes(-1, -2) @ q, ks),
                numpy.zeros(vs)]
    out_eps = [eps(g.dtype)] * 3
    if g.mods is not None and g.mods.bias is not None:
        rss.append(numpy.sqrt(total((a0 * d_bias) ** 2, g.mods.bias_shape)))
        coherent.append(total(p * d_rss * d_bias, g.mods.bias_shape))
        out_eps.append(max(eps(g.mods.bias_dtype), eps(g.dtype)))
    if p_sink is not None:
        rss.append(numpy.sqrt(total(((p_sink * d_rss) ** 2)[..., 0].sum(axis=-1),
                                    g.mods.sink_shape)))
        coherent.append(total((p_sink * d_rss)[..., 0].sum(axis=-1), g.mods.sink_shape))
        out_eps.append(max(eps(g.mods.sink_dtype), eps(g.dtype)))
    logit_bound = max(g.scale * float((q @ k.swapaxes(-1, -2)).max(initial=0.0)),
                      g.cache["max_score"])
    nbatch = math.prod(g.batch_shape)
    longest = max(g.Lq, g.Lk, g.d, g.dv)
    floors = []
    for ref, rs, co, ch, shape, e_out in zip(ref_grads, rss, coherent, chain, g.grad_shapes,
                                             out_eps):
        groups = max(1, nbatch // max(1, math.prod(shape[:-2])))   # items summed into one
        r = e_acc * (logit_bound + math.sqrt(longest * groups))
        size = float(numpy.abs(ref).max(initial=0.0))
        floors.append(e_out * size + r * (size + float(numpy.max(rs, initial=0.0)))
                      + (e_out + r) * float(numpy.max(co, initial=0.0))
                      + float(numpy.max(ch, initial=0.0))
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
    # a row with no visible key (by the masks; or lse -inf) is exactly 0, with a sink too
    no_key = ((lse_ref == -numpy.inf)[..., None] & (o_ref == 0)) \
        | (~g.visible_full().any(axis=-1))[..., None]
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
    max_abs_v = float(numpy.abs(to_host64(g.v)).max(initial=0.0))
    worst = check_bound("o", o64, o_ref, naive_o, numpy.isfinite(o_ref), FORWARD_FACTOR,
                        tolerance(0.0, g.dtype, weighted_abs_v=weighted_abs_v,
                                  logit_bound=logit_bound, Lk=g.Lk, max_abs_v=max_abs_v),
                        what, case)
    if lse64 is not None:
        max_abs_lse = float(numpy.abs(lse_ref[lse_ok]).max())
        worst = max(worst, check_bound(
            "lse", lse64, lse_ref, naive_lse, lse_ok, FORWARD_FACTOR,
            lse_tolerance(0.0, g.dtype, max_abs_lse=max_abs_lse, logit_bound=logit_bound,
                          Lk=g.Lk), what, case))
    return worst


def check_gradients(g: Geometry, do: Any, grads, ref_grads, case: str) -> float:
    """The backward rule for ``grads = (dq, dk, dv[, dbias][, dsink])``; returns the worst
    error / bound."""
    ours = [to_host64(x) for x in grads]
    names = ("dq", "dk", "dv") + (() if g.mods is None else g.mods.grad_names())
    if 0 in g.batch_shape or g.Lq == 0 or g.Lk == 0:
        for name, x in zip(names, ours):   # nothing to differentiate through
            if (x != 0).any():
                raise AssertionError(f"{name} of an empty problem is not exactly 0\n{case}")
        return 0.0
    vis = g.visible_full()
    no_key, unseen = ~vis.any(axis=-1), ~vis.any(axis=-2)   # batch + (Lq,), batch + (Lk,)
    zeros = [all_to_shape(z, shape[:-1])[..., None]
             for z, shape in zip((no_key, unseen, unseen), g.shapes)]
    for name, x, zero in zip(names, ours, zeros + [None] * (len(ours) - 3)):
        z = False if zero is None else numpy.broadcast_to(zero, x.shape)
        if zero is not None and (x[z] != 0).any():
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

