"""The cases of ``cuflash.testing`` (private; the public names are re-exported there): the
features a case may carry, their registry, and :class:`AttentionCase`."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import ml_dtypes
import numpy
from hypothesis import strategies as st

from cuflash import _testing_modifiers as _tm
from cuflash import _tolerance, reference
from cuflash._testing_arrays import _Operand

#: The library of realistic user functions cases draw, by name (``score_mod="rel_pos"``)
SCORE_MODS = {name: fn for name, (fn, _) in _tm.SCORE_MODS.items()}
MASK_MODS = dict(_tm.MASK_MODS)
DTYPE_NAMES = ("float16", "bfloat16", "float32", "float64")

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
            if named:   # a library function is saved by name
                keywords[name] = named[0]
        return cls(operands, keywords, xp, {})

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
        def saveable(v):
            try:
                json.dumps(v)
                return not callable(v)
            except TypeError:
                return False
        fns = [n for n, v in self.keywords.items() if not saveable(v)]
        if fns:
            raise TypeError(f"to_npz cannot save the functions of {fns}: only the library's "
                            f"(cuflash.testing.SCORE_MODS, MASK_MODS) are saved, by name, and "
                            f"a block mask as dict(mask_mod=name, block=(bm, bn))")
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
