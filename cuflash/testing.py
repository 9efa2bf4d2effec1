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

import json
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import ml_dtypes
import numpy

from cuflash import _tolerance, reference
from cuflash._testing_arrays import LAYOUTS, _Operand, to_device

__all__ = ["AttentionCase", "Feature", "FEATURES", "attention_cases", "assert_attention_close",
           "register_feature"]

DTYPE_NAMES = ("float16", "bfloat16", "float32", "float64")
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


def _dtype(x: Any) -> numpy.dtype:
    if isinstance(x, str) and x == "bfloat16":
        return numpy.dtype(ml_dtypes.bfloat16)
    dt = numpy.dtype(x)
    if dt.name not in DTYPE_NAMES:
        raise ValueError(f"dtype {x!r} is not one of {DTYPE_NAMES}")
    return dt


# -- features: the keywords a case may carry ---------------------------------------------------

@dataclass(frozen=True)
class Feature:
    """One keyword of :func:`cuflash.attention` that cases may use.

    ``draw(draw, info)`` returns the keyword arguments (``info`` holds ``Lq, Lk, d, dv,
    batch_shape, dtype``). ``visible(kwargs, Lq, Lk)`` returns the NumPy bool ``(Lq, Lk)``
    matrix of the query-key pairs the keyword keeps, or None; the naive baseline and the exact
    structure checks use it. A modifier that changes scores (softcap, alibi, bias) will add a
    ``score`` hook here when it lands in cuflash.
    """
    name: str
    draw: Callable[[Callable, dict], dict]
    visible: Callable[[dict, int, int], numpy.ndarray | None] | None = None


_SCALES = st.none() | st.floats(0.05, 4.0)   # built once: strategies cost to construct
CAUSAL_VALUES = (False, True, "bottom_right", "top_left")
_CAUSALS = st.sampled_from(CAUSAL_VALUES)


def _draw_scale(draw, info) -> dict:
    return {"scale": draw(_SCALES)}


def _draw_causal(draw, info) -> dict:
    return {"causal": draw(_CAUSALS)}


def _causal_visible(kwargs, Lq, Lk):
    causal = kwargs.get("causal", False)
    if causal is False:
        return None
    offset = 0 if causal == "top_left" else Lk - Lq
    return numpy.arange(Lk)[None, :] <= numpy.arange(Lq)[:, None] + offset


#: The features that exist, by name. Add one with :func:`register_feature`.
FEATURES: dict[str, Feature] = {}


def register_feature(feature: Feature) -> Feature:
    FEATURES[feature.name] = feature
    return feature


register_feature(Feature("scale", _draw_scale))
register_feature(Feature("causal", _draw_causal, _causal_visible))


# -- a case ------------------------------------------------------------------------------------

@dataclass(eq=False)
class AttentionCase:
    """Inputs of one attention call: ``q, k, v`` (NumPy, or CuPy with ``xp=cupy``), the
    keywords ``kwargs``, and ``do``, a random gradient of the output for backward checks.

    Build one outside Hypothesis with :meth:`make` (``repr(case)`` prints that call) or
    :meth:`from_npz`. ``reference()`` and ``reference_grads()`` are the float64 oracle's
    answers (cached); ``describe()`` says what the case is.
    """
    operands: dict                  # "q", "k", "v", "do" -> _Operand
    kwargs: dict
    xp: Any = numpy
    meta: dict = field(default_factory=dict)   # how it was drawn: seed, magnitudes
    _cache: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        for name, op in self.operands.items():
            setattr(self, name, op.build(self.xp))

    @property
    def dtype(self) -> numpy.dtype:
        return self.operands["q"].values.dtype

    @property
    def batch_shape(self) -> tuple:
        return numpy.broadcast_shapes(*(self.operands[n].shape[:-2] for n in "qkv"))

    def _host(self, name: str) -> numpy.ndarray:
        return self.operands[name].build(numpy)

    def geometry(self) -> _tolerance.Geometry:
        """What the tolerance rule needs (built once: it caches float64 work)."""
        if "geometry" not in self._cache:
            self._cache["geometry"] = self._geometry()
        return self._cache["geometry"]

    def _geometry(self) -> _tolerance.Geometry:
        q, v = self.operands["q"].shape, self.operands["v"].shape
        Lq, d, Lk = q[-2], q[-1], v[-2]
        scale = self.kwargs.get("scale")
        scale = 1 / math.sqrt(d) if scale is None else float(scale)
        visible = None
        for feature in FEATURES.values():
            vis = feature.visible(self.kwargs, Lq, Lk) if feature.visible else None
            if vis is not None:
                visible = vis if visible is None else visible & vis
        return _tolerance.make_geometry(self.q, self.k, self.v, self.xp, scale, visible)

    def reference(self) -> tuple[numpy.ndarray, numpy.ndarray]:
        """``(o, lse)`` in float64 from :func:`cuflash.reference.attention`."""
        if "fwd" not in self._cache:
            self._cache["fwd"] = reference.attention(
                *(self._host(n) for n in "qkv"), return_lse=True, **self.kwargs)
        return self._cache["fwd"]

    def reference_grads(self, do: Any = None) -> tuple[numpy.ndarray, ...]:
        """``(dq, dk, dv)`` in float64 for ``do`` (default ``self.do``)."""
        if do is not None:
            return reference.attention_backward(_tolerance.to_host64(do),
                                                *(self._host(n).astype(numpy.float64)
                                                  for n in "qkv"), **self.kwargs)
        if "bwd" not in self._cache:
            self._cache["bwd"] = reference.attention_backward(
                *(self._host(n) for n in ("do", "q", "k", "v")), **self.kwargs)
        return self._cache["bwd"]

    def describe(self) -> str:
        """A few lines a person reads to know the case (and paste to rebuild it)."""
        q, k, v = (self.operands[n].shape for n in "qkv")
        g = self.geometry()
        empty = 0 if g.visible is None else int((~g.visible.any(axis=1)).sum())
        lines = [f"AttentionCase {self.dtype.name}: batch {self.batch_shape}, Lq={q[-2]}, "
                 f"Lk={k[-2]}, d={q[-1]}, dv={v[-1]}, scale={g.scale:.4g}; "
                 f"{empty} of {q[-2]} query rows see no key"]
        for name, op in self.operands.items():
            expanded = [i for i, (a, b) in enumerate(zip(op.values.shape, op.shape)) if a != b]
            lines.append(f"  {name:<2} {str(op.shape):<22} layout {op.layout}"
                         + (f", stride 0 on dims {expanded}" if expanded else ""))
        lines.append(f"  kwargs {self.kwargs}; magnitudes: logits ~{self.meta.get('logit_scale')}"
                     f", values ~{self.meta.get('value_scale')}; seed {self.meta.get('seed')}")
        lines.append(f"  rebuild: cuflash.testing.{self!r}")
        return "\n".join(lines)

    def _repr_pretty_(self, printer, cycle):   # Hypothesis and IPython print this, not fields
        printer.text(repr(self))

    def __repr__(self) -> str:
        ops = self.operands
        shapes = ", ".join(repr(ops[n].shape) for n in "qkv")
        layouts = tuple(ops[n].layout for n in ("q", "k", "v", "do"))
        expanded = tuple(tuple(i for i, (a, b) in enumerate(zip(ops[n].values.shape, ops[n].shape))
                               if a != b) for n in "qkv")
        extra = "".join(f", {k}={v!r}" for k, v in self.kwargs.items())
        m = self.meta
        return (f"AttentionCase.make({self.dtype.name!r}, {shapes}, seed={m.get('seed', 0)}, "
                f"layouts={layouts}, expanded={expanded}, logit_scale={m.get('logit_scale', 1.0)}"
                f", value_scale={m.get('value_scale', 1.0)}{extra})")

    @classmethod
    def make(cls, dtype: Any, q_shape: tuple, k_shape: tuple, v_shape: tuple, *, seed: int = 0,
             layouts: tuple = ("c", "c", "c", "c"), expanded: tuple = ((), (), ()),
             logit_scale: float = 1.0, value_scale: float = 1.0, xp: Any = numpy,
             **kwargs) -> "AttentionCase":
        """A case from its description: random normal values from ``numpy.random.default_rng(
        seed)``, q and k scaled so the logits are about ``logit_scale``, v about ``value_scale``;
        ``layouts`` of q, k, v, do (see LAYOUTS); ``expanded[i]`` the batch dims of q, k, v given
        as stride-0 views; ``kwargs`` the attention keywords."""
        dt = _dtype(dtype)
        scale = kwargs.get("scale")
        d = q_shape[-1]
        scale = 1 / math.sqrt(d) if scale is None else float(scale)
        qk_std = math.sqrt(logit_scale / (scale * math.sqrt(d)))
        batch = numpy.broadcast_shapes(q_shape[:-2], k_shape[:-2], v_shape[:-2])
        do_shape = batch + (q_shape[-2], v_shape[-1])
        rng = numpy.random.default_rng(seed)
        operands = {}
        for name, shape, std, layout, exp in zip(
                ("q", "k", "v", "do"), (q_shape, k_shape, v_shape, do_shape),
                (qk_std, qk_std, value_scale, 1.0), layouts, tuple(expanded) + ((),)):
            vshape = tuple(1 if i in exp else n for i, n in enumerate(shape))
            values = (rng.standard_normal(vshape) * std).astype(dt)
            operands[name] = _Operand(values, layout, tuple(shape))
        meta = dict(seed=seed, logit_scale=logit_scale, value_scale=value_scale)
        return cls(operands, dict(kwargs), xp, meta)

    @classmethod
    def from_arrays(cls, q: Any, k: Any, v: Any, *, do: Any = None, **kwargs) -> "AttentionCase":
        """A case of given arrays (NumPy, or CuPy: then used as they are, strides included)
        and keywords; ``do`` defaults to random normal values (seed 0) of the output's shape.
        :meth:`to_npz` keeps their values, not their strides."""
        xp = numpy
        if not isinstance(q, numpy.ndarray):
            import cupy as xp
        batch = numpy.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
        if do is None:
            do = numpy.random.default_rng(0).standard_normal(
                batch + (q.shape[-2], v.shape[-1])).astype(q.dtype)
            do = do if xp is numpy else xp.asarray(do)
        operands = {}
        for name, x in zip(("q", "k", "v", "do"), (q, k, v, do)):
            host = x if xp is numpy else x.get()
            operands[name] = _Operand(host, "asis", tuple(x.shape),
                                      None if xp is numpy else x)
        return cls(operands, dict(kwargs), xp, {})

    def with_xp(self, xp: Any) -> "AttentionCase":
        """The same case with arrays of module ``xp`` (e.g. a drawn NumPy case on the GPU,
        strides and NaN-filled gaps kept)."""
        return type(self)(dict(self.operands), dict(self.kwargs), xp, dict(self.meta))

    def to_npz(self, path: Any) -> None:
        """Save the case (values, layouts, keywords) to ``path``; :meth:`from_npz` reloads it."""
        arrays = {}
        for name, op in self.operands.items():
            bits = op.values.view(numpy.uint16) if op.values.itemsize == 2 else op.values
            arrays[name] = bits
        meta = dict(meta=self.meta, kwargs=self.kwargs, dtype=self.dtype.name,
                    operands={n: dict(layout=op.layout, shape=list(op.shape))
                              for n, op in self.operands.items()})
        numpy.savez(path, meta=numpy.array(json.dumps(meta)), **arrays)

    @classmethod
    def from_npz(cls, path: Any, *, xp: Any = numpy) -> "AttentionCase":
        with numpy.load(path) as data:
            meta = json.loads(str(data["meta"]))
            dt = _dtype(meta["dtype"])
            operands = {}
            for name, info in meta["operands"].items():
                values = data[name].view(dt) if dt.itemsize == 2 else data[name].astype(dt)
                operands[name] = _Operand(values, info["layout"], tuple(info["shape"]))
        return cls(operands, meta["kwargs"], xp, meta["meta"])


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
        The keywords a case may carry (today ``"scale"`` and ``"causal"``, both alignments).
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
    the un-broadcast q, k, v) for the output gradient ``do`` (default ``case.do``). Any of them
    may be None (``actual`` only when ``grads`` is given); arrays are NumPy or CuPy.

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
        grads = tuple(grads)
        if len(grads) != 3:
            raise TypeError(f"grads must be (dq, dk, dv), got {len(grads)} arrays")
        for name, x, shape in zip(("dq", "dk", "dv"), grads, g.shapes):
            _check_result(name, x, shape, g.dtype if check_dtype else None, case)
        if do is None:
            do, ref = case.do, case.reference_grads()
        else:
            ref = case.reference_grads(do)
        do_full = g.xp.broadcast_to(g.xp.asarray(do), batch + (g.Lq, g.dv))
        worst = max(worst, _tolerance.check_gradients(g, do_full, grads, ref, text))
    return worst
