"""Fuzz an attention kernel against cuflash's float64 oracle (``pip install cuflash[testing]``).

::

    from hypothesis import given
    from cuflash.testing import attention_cases, assert_attention_close

    @given(attention_cases(dtypes=("float16", "float32"), max_seqlen=96))
    def test_my_kernel(case):                      # case.q, case.k, case.v, case.kwargs
        o, lse = my_attention(case.q, case.k, case.v, **case.kwargs)
        assert_attention_close(o, case, lse=lse)

:func:`attention_cases` draws :class:`AttentionCase` objects: inputs of awkward shapes, layouts
and magnitudes, with the keywords of :func:`cuflash.attention` named in ``features``.
:func:`assert_attention_close` applies the tolerance rule of cuflash's correctness standard:
the max error against the float64 reference may be at most 2x (3x for gradients) the error of
the naive computation in the same dtype, plus a floor for rounding noise (the arithmetic and
its reasons are in the docstring of ``cuflash._tolerance``). docs/testing.md walks through it.

The keyword conventions are cuflash's (``scale`` multiplies ``q @ k.T`` and defaults to
``1/sqrt(d)``; ``causal=True`` or ``'bottom_right'`` aligns the mask to the bottom-right
corner, ``'top_left'`` to the top-left; ``lse`` is the natural log of the softmax denominator,
``-inf`` with output 0 for a row that sees no key). A wrapper around another kernel maps them.
"""

from __future__ import annotations

try:
    from hypothesis import strategies as st
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("cuflash.testing needs Hypothesis: pip install cuflash[testing]") from e

import math
from typing import Any

import numpy

from cuflash import _tolerance
from cuflash._testing_arrays import LAYOUTS, to_device  # noqa: F401  (public names)
from cuflash._testing_case import (CAUSAL_VALUES, DTYPE_NAMES, FEATURES, MASK_MODS,  # noqa: F401
                                   MODIFIERS, SCORE_MODS, AttentionCase, Feature, _dtype,
                                   register_feature)

AttentionCase.__module__ = Feature.__module__ = __name__   # what users import it from

__all__ = ["AttentionCase", "Feature", "FEATURES", "MODIFIERS", "SCORE_MODS", "MASK_MODS",
           "attention_cases", "assert_attention_close", "register_feature"]

#: Lengths that find tiling bugs: 1, primes, tile sizes and tile sizes +- 1.
AWKWARD_LENGTHS = (1, 2, 3, 5, 7, 11, 13, 15, 16, 17, 31, 32, 33, 37, 61, 63, 64, 65, 97, 127,
                   128, 129, 191, 192, 193, 251, 255, 256, 257, 509, 511, 512, 513)
HEAD_DIMS = (1, 2, 3, 5, 8, 16, 24, 31, 32, 33, 40, 48, 63, 64, 65, 72, 80, 96, 111, 127, 128,
             129, 160, 192, 200, 224, 255, 256)
#: Typical |logit| (the scores' standard deviation). 100 and above overflow exp in float32
#: without the max subtraction, 1000 overflows it in float64.
LOGIT_SCALES = (1.0, 0.01, 0.1, 3.0, 10.0, 100.0, 1000.0)
VALUE_SCALES = (1.0, 0.01, 100.0)
#: How an operand covers a batch dim of extent > 1: all of it, extent 1 (broadcast), or a
#: stride-0 view of extent n (``broadcast_to``, as GQA code often hands K and V over).
BATCH_COVER = ("full", "one", "expanded")


# -- the strategy ------------------------------------------------------------------------------

def attention_cases(*, dtypes: Any = DTYPE_NAMES, head_dims: Any = None, max_seqlen: int = 128,
                    features: Any = ("scale", "causal"), xp: Any = numpy, min_seqlen: int = 1,
                    max_batch_dims: int = 3, broadcast: bool = True, layouts: Any = LAYOUTS,
                    max_work: int = 2**17) -> st.SearchStrategy:
    """A Hypothesis strategy of :class:`AttentionCase`.

    Parameters
    ----------
    dtypes : names or NumPy dtypes among float16, bfloat16, float32, float64
    head_dims : ints, optional
        Allowed values of d and of dv (drawn independently). Default: 1 to 256, small ones
        and awkward ones (primes, multiples of 8 and 16, 2^n +- 1).
    max_seqlen, min_seqlen : int
        Bounds of Lq and Lk. Lengths are small (<= 8) or awkward: 1, primes, tile sizes
        16, 32, 64, 128, 192, 256, 512 and each +- 1. ``min_seqlen=0`` adds empty sequences.
    features : names in :data:`FEATURES`
        The keywords a case may carry: ``"scale"``, ``"causal"`` (both alignments) and the
        modifiers (:data:`MODIFIERS`): ``"window"``, ``"softcap"``, ``"alibi_slopes"``,
        ``"sink"``, ``"bias"``, ``"mask"``, ``"score_mod"``, ``"mask_mod"``, ``"block_mask"``;
        each modifier is off in half the cases (and shrinks to off). docs/testing.md lists
        what each draws.
    xp : numpy or cupy
        The array module of ``q, k, v, do``; with CuPy the naive baseline runs on the GPU.
    max_batch_dims : int
        0 to this many leading batch dims, extents 1 to 4.
    broadcast : bool
        Let q, k, v drop leading batch dims, have extent 1, or be stride-0 views where the batch
        has more (grouped-query attention is k, v with extent 1 on the group dim).
    layouts : names in :data:`LAYOUTS`
        The memory layouts operands are drawn in.
    max_work : int
        At most this many batch items x Lq x Lk, which keeps the float64 reference at a few
        milliseconds.

    Also drawn: magnitudes from logits ~0.01 to ~1000 (where exp overflows without the max
    subtraction) and values ~0.01 to ~100; a seed for the random normal values (fresh for every
    example, never zeros). Everything shrinks towards a small case of the first dtype: lengths, dims
    and batch towards 1, layouts towards C order, magnitudes towards 1, features off.
    """
    dts = tuple(_dtype(x) for x in ((dtypes,) if isinstance(dtypes, str) else dtypes))
    if not dts:
        raise ValueError("dtypes is empty")
    feats = (features,) if isinstance(features, str) else tuple(features)
    unknown = [f for f in feats if f not in FEATURES]
    if unknown:
        raise ValueError(f"unknown features {unknown}; known: {sorted(FEATURES)}")
    feats = tuple(f for f in FEATURES if f in feats)   # registration order: block_mask last
    bad_layouts = [x for x in layouts if x not in LAYOUTS]
    if bad_layouts or not layouts:
        raise ValueError(f"layouts {list(layouts)} must be a non-empty subset of {LAYOUTS}")
    if not 0 <= min_seqlen <= max_seqlen:
        raise ValueError(f"need 0 <= min_seqlen <= max_seqlen, got {min_seqlen=}, {max_seqlen=}")
    if head_dims is None:
        dims = st.integers(1, 8) | st.sampled_from(HEAD_DIMS)
    else:
        allowed = sorted({int(x) for x in head_dims})
        if not allowed or allowed[0] < 1:
            raise ValueError(f"head_dims must be positive ints, got {head_dims!r}")
        dims = st.sampled_from(allowed)
    small = st.integers(min_seqlen, min(max_seqlen, 8))
    awkward = sorted({n for n in AWKWARD_LENGTHS + (max_seqlen,) if min_seqlen <= n <= max_seqlen})
    lengths = small | st.sampled_from(awkward)
    dtype_st, layout_st = st.sampled_from(dts), st.sampled_from(tuple(layouts))
    bools, seeds, covers = st.booleans(), st.integers(0, 2**32 - 1), st.sampled_from(BATCH_COVER)
    logit_st, value_st = st.sampled_from(LOGIT_SCALES), st.sampled_from(VALUE_SCALES)
    orders = st.sampled_from(("any", "q_longer", "k_longer"))
    ints: dict = {}

    def integers(lo: int, hi: int) -> st.SearchStrategy:   # cached: constructing costs
        return ints.setdefault((lo, hi), st.integers(lo, hi))

    @st.composite
    def cases(draw):
        dtype = draw(dtype_st)
        Lq, Lk = draw(lengths), draw(lengths)
        # a third of the time each, Lq > Lk (rows that see no key under bottom-right causal)
        # and Lq < Lk, so that equal lengths do not hide an alignment bug
        order = draw(orders)
        if order != "any":
            lo, hi = sorted((Lq, Lk))
            if lo == hi:
                lo, hi = (lo - 1, hi) if lo > min_seqlen else (lo, min(hi + 1, max_seqlen))
            Lq, Lk = (hi, lo) if order == "q_longer" else (lo, hi)
        d = draw(dims)
        dv = d if draw(bools) else draw(dims)
        # batch dims, their product bounded by the work budget
        budget = max(1, max_work // max(1, Lq * Lk))
        batch: list[int] = []
        for _ in range(draw(integers(0, max_batch_dims))):
            batch.append(draw(integers(1, max(1, min(4, budget // math.prod(batch))))))
        # grouped-query attention, half the time: the last batch dim is the group of query
        # heads that share one key/value head (k, v have extent 1 there)
        gqa = broadcast and bool(batch) and draw(bools)
        if gqa:
            if len(batch) == 1 and max_batch_dims >= 2:    # (key/value heads, group)
                batch.insert(0, draw(integers(2, 3)))
            batch[-1] = draw(integers(2, max(2, min(4, budget // math.prod(batch[:-1])))))
        shapes, expanded = [], []
        for which, (L, last) in enumerate(((Lq, d), (Lk, d), (Lk, dv))):
            own, exp = list(batch), []
            if gqa and which > 0:
                own[-1] = 1
            if broadcast and batch and not gqa:
                own = own[draw(integers(0, len(batch))):] if draw(bools) else own
                for i, n in enumerate(own):
                    cover = draw(covers) if n > 1 else "full"
                    if cover == "one":
                        own[i] = 1
                    elif cover == "expanded":
                        exp.append(i)
            shapes.append(tuple(own) + (L, last))
            expanded.append(tuple(exp))
        info = dict(Lq=Lq, Lk=Lk, d=d, dv=dv, dtype=dtype,
                    batch_shape=numpy.broadcast_shapes(*(s[:-2] for s in shapes)))
        kwargs: dict = {}
        info["kwargs"] = kwargs
        for name in feats:
            kwargs.update(FEATURES[name].draw(draw, info))
        return AttentionCase.make(
            dtype, *shapes, seed=draw(seeds),
            layouts=tuple(draw(layout_st) for _ in range(4)),
            expanded=tuple(expanded), logit_scale=draw(logit_st),
            value_scale=draw(value_st), xp=xp, **kwargs)

    return cases()


# -- the assertion -----------------------------------------------------------------------------

class _Described:
    def __init__(self, case):
        self.case = case

    def __str__(self) -> str:
        return self.case.describe()


def _check_result(name: str, x: Any, shape: tuple, dtype: Any, case: AttentionCase) -> None:
    if tuple(x.shape) != tuple(shape):
        raise AssertionError(f"{name}: shape {tuple(x.shape)}, expected {tuple(shape)}\n"
                             f"{case.describe()}")
    if dtype is not None and numpy.dtype(x.dtype) != numpy.dtype(dtype):
        raise AssertionError(f"{name}: dtype {x.dtype}, expected {numpy.dtype(dtype)}\n"
                             f"{case.describe()}")


def assert_attention_close(actual: Any, case: AttentionCase, *, lse: Any = None,
                           grads: Any = None, do: Any = None, check_dtype: bool = False) -> float:
    """Assert that a kernel's results for ``case`` pass cuflash's tolerance rule.

    ``actual`` is the output ``o`` (``batch_shape + (Lq, dv)``), ``lse`` the log-sum-exp
    (``batch_shape + (Lq,)``, natural log), ``grads`` the gradients ``(dq, dk, dv)`` (shapes of
    the un-broadcast q, k, v), followed by ``dbias`` (bias's shape) when the case has a bias
    and ``dsink`` (sink's shape) when it has a sink (``case.grad_names``; the three alone are
    accepted too), for the output gradient ``do`` (default ``case.do``). Any of them may be
    None (``actual`` only when ``grads`` is given); arrays are NumPy or CuPy.

    Each passes when its max abs error against the float64 reference is at most 2x (3x for
    gradients) the max error of the naive same-dtype computation, plus a floor of rounding
    noise; non-finite values and exact zeros (rows with no visible key: output 0, lse -inf, dq
    0; keys no query sees: dk, dv 0) must match exactly. With ``check_dtype=True`` the results
    must also have cuflash's dtypes (o and grads the input dtype; lse float32, float64 for
    float64 inputs).

    Raises AssertionError naming the quantity, the worst element's index, its error, the
    baseline's error, the bound and the case. Returns the largest error / bound (at most 1),
    for ``hypothesis.target``.
    """
    if actual is None and grads is None:
        raise TypeError("assert_attention_close needs the output, the gradients or both")
    g = case.geometry()
    text = _Described(case)   # the case's description, written only into a failure message
    batch = g.batch_shape
    worst = 0.0
    if actual is not None:
        _check_result("o", actual, batch + (g.Lq, g.dv), g.dtype if check_dtype else None, case)
        if lse is not None:
            _check_result("lse", lse, batch + (g.Lq,), _tolerance.accumulation_dtype(g.dtype)
                          if check_dtype else None, case)
        if math.prod(batch) and g.Lq:
            o_ref, lse_ref = case.reference()
            worst = _tolerance.check_forward(g, actual, lse, o_ref, lse_ref, text)
    elif lse is not None:
        raise TypeError("lse is checked with the output: pass actual too")
    if grads is not None:
        grads, names = tuple(grads), case.grad_names
        if len(grads) not in (3, len(names)):
            raise TypeError(f"grads must be ({', '.join(names)}){' or (dq, dk, dv)' * (len(names) > 3)}"
                            f" for this case, got {len(grads)} arrays")
        dtypes = (g.dtype,) * 3 + tuple(case.kwargs[n[1:]].dtype for n in names[3:])
        for name, x, shape, dt in zip(names, grads, g.grad_shapes, dtypes):
            _check_result(name, x, shape, dt if check_dtype else None, case)
        if do is None:
            do, ref = case.do, case.reference_grads()
        else:
            ref = case.reference_grads(do)
        do_full = g.xp.broadcast_to(g.xp.asarray(do), batch + (g.Lq, g.dv))
        worst = max(worst, _tolerance.check_gradients(g, do_full, grads, ref[:len(grads)],
                                                      text))
    return worst
