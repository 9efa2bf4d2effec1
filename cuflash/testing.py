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

from cuflash import _testing_modifiers as _tm
from cuflash import _tolerance, reference
from cuflash._testing_arrays import LAYOUTS, _Operand, to_device

__all__ = ["AttentionCase", "Feature", "FEATURES", "MODIFIERS", "SCORE_MODS", "MASK_MODS",
           "attention_cases", "assert_attention_close", "register_feature"]

#: The library of realistic user functions cases draw, by name (``score_mod="rel_pos"``)
SCORE_MODS = {name: fn for name, (fn, _) in _tm.SCORE_MODS.items()}
MASK_MODS = dict(_tm.MASK_MODS)

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

    ``draw(draw, info)`` returns the keyword arguments, ``{}`` for the keyword off (``info``
    holds ``Lq, Lk, d, dv, batch_shape, dtype`` and ``kwargs``, the keywords drawn so far).
    ``visible(kwargs, Lq, Lk, batch_shape)`` returns a NumPy bool array, broadcastable to
    ``batch_shape + (Lq, Lk)``, of the query-key pairs the keyword keeps, or None (``kwargs``
    are the case's live keywords on the host); the naive baseline and the exact structure
    checks use it. The score-changing modifiers (softcap, alibi_slopes, bias, score_mod, sink)
    are applied by the rule's naive pipeline (``cuflash._testing_modifiers``) by keyword name.
    """
    name: str
    draw: Callable[[Callable, dict], dict]
    visible: Callable[[dict, int, int, tuple], numpy.ndarray | None] | None = None


_SCALES = st.none() | st.floats(0.05, 4.0)   # built once: strategies cost to construct
CAUSAL_VALUES = (False, True, "bottom_right", "top_left")
_CAUSALS = st.sampled_from(CAUSAL_VALUES)


def _draw_scale(draw, info) -> dict:
    return {"scale": draw(_SCALES)}


def _draw_causal(draw, info) -> dict:
    return {"causal": draw(_CAUSALS)}


def _causal_visible(kwargs, Lq, Lk, batch_shape=()):
    causal = kwargs.get("causal", False)
    if causal is False:
        return None
    offset = 0 if causal == "top_left" else Lk - Lq
    return numpy.arange(Lk)[None, :] <= numpy.arange(Lq)[:, None] + offset


#: The features that exist, by name, in the order cases draw them. Add one with
#: :func:`register_feature`.
FEATURES: dict[str, Feature] = {}
#: The modifiers of DESIGN.md (features too; off unless named in ``features``)
MODIFIERS = tuple(_tm.DRAWS)


def register_feature(feature: Feature) -> Feature:
    FEATURES[feature.name] = feature
    return feature


register_feature(Feature("scale", _draw_scale))
register_feature(Feature("causal", _draw_causal, _causal_visible))
# one visibility for all the masking modifiers (window, mask, mask_mod, block_mask, -inf bias)
for _name, _draw_mod in _tm.DRAWS.items():
    register_feature(Feature(_name, _draw_mod))


# -- a case ------------------------------------------------------------------------------------

@dataclass(eq=False)
class AttentionCase:
    """Inputs of one attention call: ``q, k, v`` (NumPy, or CuPy with ``xp=cupy``), the
    keywords ``kwargs``, and ``do``, a random gradient of the output for backward checks.

    ``kwargs`` holds what :func:`cuflash.attention` takes (arrays of ``xp`` for ``bias``,
    ``mask``, ``alibi_slopes``, ``sink``; functions for ``score_mod``, ``mask_mod``; a
    ``BlockMask``); ``keywords`` the same as plain values: array specs (how :meth:`make` draws
    them), names in :data:`SCORE_MODS` / :data:`MASK_MODS`, which ``repr`` prints.

    Build one outside Hypothesis with :meth:`make` (``repr(case)`` prints that call) or
    :meth:`from_npz`. ``reference()`` and ``reference_grads()`` are the float64 oracle's
    answers (cached); ``describe()`` says what the case is.
    """
    operands: dict                  # "q", "k", "v", "do", array keywords -> _Operand
    keywords: dict
    xp: Any = numpy
    meta: dict = field(default_factory=dict)   # how it was drawn: seed, magnitudes
    _cache: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        for name in ("q", "k", "v", "do"):
            setattr(self, name, self.operands[name].build(self.xp))
        self.kwargs = self._live(self.xp)

    def _live(self, xp: Any) -> dict:
        """The keywords as cuflash.attention takes them, arrays of ``xp``."""
        Lq, Lk = self.operands["q"].shape[-2], self.operands["k"].shape[-2]
        live = {}
        for name, value in self.keywords.items():
            if name in _tm.ARRAY_KEYWORDS and name in self.operands:
                live[name] = self.operands[name].build(xp)
            elif name == "block_mask" and isinstance(value, dict):
                if "block_mask" not in self._cache:   # one object: mask_mod is its function
                    self._cache["block_mask"] = _tm.resolve(name, value, self.batch_shape, Lq, Lk)
                live[name] = self._cache["block_mask"]
            else:
                live[name] = _tm.resolve(name, value, self.batch_shape, Lq, Lk)
        return live

    def host_kwargs(self) -> dict:
        """``kwargs`` with NumPy arrays (what the float64 reference takes)."""
        return self.kwargs if self.xp is numpy else self._live(numpy)

    @property
    def dtype(self) -> numpy.dtype:
        return self.operands["q"].values.dtype

    @property
    def batch_shape(self) -> tuple:
        return numpy.broadcast_shapes(*(self.operands[n].shape[:-2] for n in "qkv"))

    @property
    def grad_names(self) -> tuple[str, ...]:
        """The gradients :func:`cuflash.attention_backward` returns for this case: ``dq, dk,
        dv``, then ``dbias`` with a bias and ``dsink`` with a sink."""
        return ("dq", "dk", "dv") + _tm.grad_names(self.kwargs)

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
        host, batch = self.host_kwargs(), self.batch_shape
        visible = _tm.visible(host, Lq, Lk, batch)   # window, mask, mask_mod, -inf bias
        for feature in FEATURES.values():
            vis = feature.visible(host, Lq, Lk, batch) if feature.visible else None
            if vis is not None:
                visible = vis if visible is None else visible & vis
        mods = _tm.NaiveModifiers.of(host, batch, Lq, Lk)
        return _tolerance.make_geometry(self.q, self.k, self.v, self.xp, scale, visible, mods)

    def reference(self) -> tuple[numpy.ndarray, numpy.ndarray]:
        """``(o, lse)`` in float64 from :func:`cuflash.reference.attention`."""
        if "fwd" not in self._cache:
            self._cache["fwd"] = reference.attention(
                *(self._host(n) for n in "qkv"), return_lse=True, **self.host_kwargs())
        return self._cache["fwd"]

    def reference_grads(self, do: Any = None) -> tuple[numpy.ndarray, ...]:
        """``(dq, dk, dv[, dbias][, dsink])`` in float64 for ``do`` (default ``self.do``)."""
        if do is not None:
            return reference.attention_backward(_tolerance.to_host64(do),
                                                *(self._host(n).astype(numpy.float64)
                                                  for n in "qkv"), **self.host_kwargs())
        if "bwd" not in self._cache:
            self._cache["bwd"] = reference.attention_backward(
                *(self._host(n) for n in ("do", "q", "k", "v")), **self.host_kwargs())
        return self._cache["bwd"]

    def describe(self) -> str:
        """A few lines a person reads to know the case (and paste to rebuild it)."""
        q, k, v = (self.operands[n].shape for n in "qkv")
        g = self.geometry()
        empty = 0 if g.visible is None else int((~numpy.broadcast_to(
            g.visible, g.batch_shape + (g.Lq, g.Lk)).any(axis=-1)).sum())
        lines = [f"AttentionCase {self.dtype.name}: batch {self.batch_shape}, Lq={q[-2]}, "
                 f"Lk={k[-2]}, d={q[-1]}, dv={v[-1]}, scale={g.scale:.4g}; "
                 f"{empty} of {math.prod(g.batch_shape) * q[-2]} query rows see no key"]
        for name, op in self.operands.items():
            expanded = [i for i, (a, b) in enumerate(zip(op.values.shape, op.shape)) if a != b]
            lines.append(f"  {name:<2} {str(op.shape):<22} layout {op.layout}"
                         + (f", stride 0 on dims {expanded}" if expanded else ""))
        lines.append(f"  kwargs {self.keywords}; magnitudes: logits ~{self.meta.get('logit_scale')}"
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
        extra = "".join(f", {k}={v!r}" for k, v in self.keywords.items())
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
        as stride-0 views; ``kwargs`` the attention keywords, plain: an array keyword (``bias``,
        ``mask``, ``alibi_slopes``, ``sink``) is a spec ``dict(shape=..., expanded=(stride-0
        dims), layout=..., dtype=..., scale=...)`` plus ``hide`` (bias: share of -inf entries)
        or ``keep`` (mask: share of True), drawn from the same generator after q, k, v, do;
        ``score_mod``/``mask_mod`` name a function of :data:`SCORE_MODS`/:data:`MASK_MODS`;
        ``block_mask=dict(mask_mod=name, block=(bm, bn))``."""
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
        for name in _tm.ARRAY_KEYWORDS:   # after q, k, v, do: older cases rebuild alike
            spec = kwargs.get(name)
            if spec is not None:
                if not isinstance(spec, dict) or "shape" not in spec:
                    raise TypeError(f"AttentionCase.make takes {name}= as a spec dict(shape=..., "
                                    f"...), got {type(spec).__qualname__}; wrap arrays with "
                                    f"AttentionCase.from_arrays")
                operands[name] = _Operand(_tm.make_array(spec, rng, name, dt),
                                          spec.get("layout", "c"), tuple(spec["shape"]))
        meta = dict(seed=seed, logit_scale=logit_scale, value_scale=value_scale)
        return cls(operands, dict(kwargs), xp, meta)

    @classmethod
    def from_arrays(cls, q: Any, k: Any, v: Any, *, do: Any = None, **kwargs) -> "AttentionCase":
        """A case of given arrays (NumPy, or CuPy: then used as they are, strides included)
        and keywords (arrays and functions as cuflash.attention takes them); ``do`` defaults to
        random normal values (seed 0) of the output's shape. :meth:`to_npz` keeps their values,
        not their strides (and cannot save a function that is not in the library)."""
        xp = numpy
        if not isinstance(q, numpy.ndarray):
            import cupy as xp
        batch = numpy.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
        if do is None:
            do = numpy.random.default_rng(0).standard_normal(
                batch + (q.shape[-2], v.shape[-1])).astype(q.dtype)
            do = do if xp is numpy else xp.asarray(do)
        operands = {}
        keywords = dict(kwargs)
        arrays = [(n, kwargs[n]) for n in _tm.ARRAY_KEYWORDS if kwargs.get(n) is not None]
        for name, x in [("q", q), ("k", k), ("v", v), ("do", do)] + arrays:
            host = x if xp is numpy else x.get()
            operands[name] = _Operand(host, "asis", tuple(x.shape),
                                      None if xp is numpy else x)
            if name in keywords:
                keywords[name] = {"shape": tuple(x.shape), "given": True}
        for name, table in (("score_mod", SCORE_MODS), ("mask_mod", MASK_MODS)):
            named = [n for n, fn in table.items() if fn is keywords.get(name)]
            keywords[name] = named[0] if named else keywords.get(name)
        return cls(operands, {n: v for n, v in keywords.items() if v is not None}, xp, {})

    def with_xp(self, xp: Any) -> "AttentionCase":
        """The same case with arrays of module ``xp`` (e.g. a drawn NumPy case on the GPU,
        strides and NaN-filled gaps kept)."""
        return type(self)(dict(self.operands), dict(self.keywords), xp, dict(self.meta))

    def to_npz(self, path: Any) -> None:
        """Save the case (values, layouts, keywords) to ``path``; :meth:`from_npz` reloads it."""
        arrays = {}
        for name, op in self.operands.items():
            bits = op.values.view(numpy.uint16) if op.values.itemsize == 2 else op.values
            arrays[name] = bits
        fns = [n for n, v in self.keywords.items() if callable(v)]
        if fns:
            raise TypeError(f"to_npz cannot save the functions of {fns}: only the library's "
                            f"(cuflash.testing.SCORE_MODS, MASK_MODS) are saved, by name")
        meta = dict(meta=self.meta, kwargs=self.keywords, dtype=self.dtype.name,
                    operands={n: dict(layout=op.layout, shape=list(op.shape),
                                      dtype=op.values.dtype.name)
                              for n, op in self.operands.items()})
        numpy.savez(path, meta=numpy.array(json.dumps(meta)), **arrays)

    @classmethod
    def from_npz(cls, path: Any, *, xp: Any = numpy) -> "AttentionCase":
        with numpy.load(path) as data:
            meta = json.loads(str(data["meta"]))
            dt = _dtype(meta["dtype"])
            operands = {}
            for name, info in meta["operands"].items():
                odt = info.get("dtype", dt.name)
                if odt == "bool":
                    values = data[name].astype(bool)
                else:
                    odt = _dtype(odt)
                    values = data[name].view(odt) if odt.itemsize == 2 else data[name].astype(odt)
                operands[name] = _Operand(values, info["layout"], tuple(info["shape"]))
        keywords = {n: _tm.plain(v) for n, v in meta["kwargs"].items()}
        return cls(operands, keywords, xp, meta["meta"])


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
