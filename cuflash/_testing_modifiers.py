"""The modifiers as features of ``cuflash.testing`` (private): what cases draw, a small library
of realistic ``score_mod`` / ``mask_mod`` functions, and the naive same-dtype score pipeline
of the tolerance rule.

The pipeline here is written from DESIGN.md "Modifiers" and shares nothing with
``cuflash._pipeline`` (the one the CPU path and the reference run), so that the baseline of the
rule does not inherit a bug of the thing it judges:

1. ``s = scale * q @ k.T``  2. softcap ``c * tanh(s / c)``  3. ALiBi ``s -= slope * |i + Lk - Lq - j|``
4. ``s += bias``  5. ``score_mod(s, b, h, i, j)``  6. masks (causal, window, mask, mask_mod,
block_mask's mask_mod, and bias entries of -inf) give ``-inf``  7. the sink joins the softmax
denominator as a key of score ``sink`` and value 0.

Keywords of a case are plain values (what ``repr`` prints and ``to_npz`` saves): array
keywords are *specs*, dicts that say how ``AttentionCase.make`` draws the array; ``score_mod``
and ``mask_mod`` are names in :data:`SCORE_MODS` / :data:`MASK_MODS`; ``block_mask`` is a spec
``{'mask_mod': name, 'block': (bm, bn)}``. :func:`resolve` turns them into what
:func:`cuflash.attention` takes.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy
from hypothesis import strategies as st   # (cuflash.testing checked that it is there)

#: Keywords whose value is an array (drawn by ``AttentionCase.make`` from a spec)
ARRAY_KEYWORDS = ("alibi_slopes", "sink", "bias", "mask")


# -- the library of user functions ---------------------------------------------------------------
# Written with operators and NumPy ufuncs only (what cuflash traces for the GPU). Each score_mod
# comes with its derivative in score. A bias of -inf precedes score_mod: most keep it at -inf
# (the pair stays hidden); tanh_cap and clamp_low map it to a finite score (DESIGN.md's
# order: the pair is visible again).

def rel_pos(score, b, h, q_idx, kv_idx):
    """T5-style relative position bias, linear in the distance."""
    return score - 0.125 * (q_idx - kv_idx)


def head_alibi(score, b, h, q_idx, kv_idx):
    """ALiBi written by hand: a slope per head."""
    return score - (h + 1) * 0.25 * numpy.abs(q_idx - kv_idx)


def tanh_cap(score, b, h, q_idx, kv_idx):
    """Gemma 2's soft cap written as a score_mod."""
    return 2.0 * numpy.tanh(score / 2.0)


def head_temperature(score, b, h, q_idx, kv_idx):
    """A per-head temperature (the derivative differs per head)."""
    return score * (0.5 + 0.5 * (h % 3)) + 0.25 * b


def clamp_low(score, b, h, q_idx, kv_idx):
    """Logits clamped from below (as some models do against underflow): -inf becomes -20."""
    return numpy.maximum(score, -20.0)


def _d_clamp_low(score, b, h, q_idx, kv_idx):
    return (score > -20.0) * 1.0


def _d_const(score, b, h, q_idx, kv_idx):
    return numpy.ones_like(score)


def _d_tanh_cap(score, b, h, q_idx, kv_idx):
    t = numpy.tanh(score / 2.0)
    return 1.0 - t * t


def _d_head_temperature(score, b, h, q_idx, kv_idx):
    return numpy.zeros_like(score) + (0.5 + 0.5 * (h % 3))


#: name -> (score_mod, its derivative with respect to score)
SCORE_MODS: dict[str, tuple[Callable, Callable]] = {
    "rel_pos": (rel_pos, _d_const),
    "head_alibi": (head_alibi, _d_const),
    "tanh_cap": (tanh_cap, _d_tanh_cap),
    "head_temperature": (head_temperature, _d_head_temperature),
    "clamp_low": (clamp_low, _d_clamp_low),
}


def causal_mask(b, h, q_idx, kv_idx):
    """Top-left causal, as FlexAttention examples write it."""
    return q_idx >= kv_idx


def sliding_window(b, h, q_idx, kv_idx):
    """A symmetric window of 3 keys each side."""
    return numpy.abs(q_idx - kv_idx) <= 3


def prefix_lm(b, h, q_idx, kv_idx):
    """Bidirectional on a prefix of 5 keys, causal after."""
    return (kv_idx < 5) | (q_idx >= kv_idx)


def documents(b, h, q_idx, kv_idx):
    """Packed documents of 7 positions each (block diagonal), causal within."""
    return (q_idx // 7 == kv_idx // 7) & (q_idx >= kv_idx)


def dilated(b, h, q_idx, kv_idx):
    """Every other key, on the query's parity."""
    return (q_idx - kv_idx) % 2 == 0


def per_head(b, h, q_idx, kv_idx):
    """Even heads and batch item 1 see every key; the others only keys strictly before the
    query (their row 0 sees no key)."""
    return (h % 2 == 0) | (b == 1) | (kv_idx < q_idx)


#: name -> mask_mod
MASK_MODS: dict[str, Callable] = {
    "causal": causal_mask, "sliding_window": sliding_window, "prefix_lm": prefix_lm,
    "documents": documents, "dilated": dilated, "per_head": per_head,
}


def score_mod_derivative(fn: Callable) -> Callable | None:
    """The library's derivative of ``fn``, or None for a function not in the library."""
    for mod, dmod in SCORE_MODS.values():
        if mod is fn:
            return dmod
    return None


# -- drawing -------------------------------------------------------------------------------------
# Each draw returns {} (the keyword off: what shrinking goes to) or {keyword: plain value}.

#: A requested modifier is on in about 3 cases of 4 (it shrinks to off: 0)
_ON = st.integers(0, 3).map(bool)
_BOUNDS = st.sampled_from((15, 16, 17, 31, 32, 33, 63, 64, 65, 127))
_SOFTCAPS = st.sampled_from((5.0, 0.5, 1.0, 2.0, 20.0, 50.0))
_SLOPE_SCALES = st.sampled_from((1.0, 0.01, 0.1, 4.0))
_SINK_SCALES = st.sampled_from((1.0, 0.1, 10.0, 100.0))
_BIAS_SCALES = st.sampled_from((1.0, 0.01, 0.1, 10.0, 100.0))
_HIDE = st.sampled_from((0.0, 0.1, 0.5, 1.0))
_KEEP = st.sampled_from((0.5, 0.9, 0.1, 0.0, 1.0))
_SCORE_MOD_NAMES = st.sampled_from(tuple(SCORE_MODS))
_MASK_MOD_NAMES = st.sampled_from(tuple(MASK_MODS))
_BLOCKS = st.sampled_from((16, 32, 64, 128, 1, 7))
#: Layouts of bias and mask (bool cannot hold the NaN gaps of "strided")
BIAS_LAYOUTS = ("c", "f", "transposed", "strided", "reversed")
MASK_LAYOUTS = ("c", "f", "transposed", "reversed")


def _param_dtype(draw, info) -> str:
    return draw(st.sampled_from(("float32", info["dtype"].name)))


@functools.lru_cache(maxsize=None)
def _bounds_up_to(n: int) -> st.SearchStrategy:
    """A window bound: None, small, within the keys (so that its edge falls on a key that
    exists), or a tile size +- 1 (built once per n: strategies cost to construct)."""
    return st.none() | st.integers(0, 3) | st.integers(0, max(0, n)) | _BOUNDS


def draw_window(draw, info) -> dict:
    if not draw(_ON):
        return {}
    bounds = _bounds_up_to(max(info["Lq"], info["Lk"]))
    return {"window": (draw(bounds), draw(bounds))}


def draw_softcap(draw, info) -> dict:
    return {"softcap": draw(_SOFTCAPS)} if draw(_ON) else {}


def _per_batch(draw, info, scales) -> dict:
    shape, expanded = draw_array_shape(draw, tuple(info["batch_shape"]) + (1, 1))
    return dict(shape=shape[:-2], expanded=expanded, scale=draw(scales),
                dtype=_param_dtype(draw, info))


def draw_alibi(draw, info) -> dict:
    return {"alibi_slopes": _per_batch(draw, info, _SLOPE_SCALES)} if draw(_ON) else {}


def draw_sink(draw, info) -> dict:
    return {"sink": _per_batch(draw, info, _SINK_SCALES)} if draw(_ON) else {}


def _pairwise(draw, info, layouts) -> dict:
    full = tuple(info["batch_shape"]) + (info["Lq"], info["Lk"])
    shape, expanded = draw_array_shape(draw, full, keep_last=True)
    return dict(shape=shape, expanded=expanded, layout=draw(st.sampled_from(layouts)))


def draw_bias(draw, info) -> dict:
    if not draw(_ON):
        return {}
    spec = _pairwise(draw, info, BIAS_LAYOUTS)
    spec.update(scale=draw(_BIAS_SCALES), hide=draw(_HIDE), dtype=_param_dtype(draw, info))
    return {"bias": spec}


def draw_mask(draw, info) -> dict:
    if not draw(_ON):
        return {}
    spec = _pairwise(draw, info, MASK_LAYOUTS)
    spec.update(keep=draw(_KEEP))
    return {"mask": spec}


def draw_score_mod(draw, info) -> dict:
    return {"score_mod": draw(_SCORE_MOD_NAMES)} if draw(_ON) else {}


def draw_mask_mod(draw, info) -> dict:
    return {"mask_mod": draw(_MASK_MOD_NAMES)} if draw(_ON) else {}


def draw_block_mask(draw, info) -> dict:
    """A block mask of the case's mask_mod (or of a drawn one, without mask_mod=)."""
    if not draw(_ON):
        return {}
    name = info["kwargs"].get("mask_mod") or draw(_MASK_MOD_NAMES)
    return {"block_mask": {"mask_mod": name, "block": (draw(_BLOCKS), draw(_BLOCKS))}}


#: feature name -> draw, in DESIGN.md's pipeline order (block_mask after mask_mod: it reuses it)
DRAWS = {"window": draw_window, "softcap": draw_softcap, "alibi_slopes": draw_alibi,
         "sink": draw_sink, "bias": draw_bias, "mask": draw_mask, "score_mod": draw_score_mod,
         "mask_mod": draw_mask_mod, "block_mask": draw_block_mask}

_HOW_DIM = st.sampled_from(("full", "one", "full", "expanded"))


def draw_array_shape(draw, full: tuple, *, keep_last: bool = False) -> tuple[tuple, tuple]:
    """A shape that broadcasts to ``full`` and its stride-0 dims: leading dims dropped, each
    dim of extent > 1 kept (one time in two: bugs that mix up batch items need a real batch
    dim), made 1 or given as a stride-0 view (``keep_last``: the last dim is always kept)."""
    drop = draw(st.integers(0, max(0, len(full) - 2))) if draw(st.booleans()) else 0
    shape, expanded = list(full[drop:]), []
    for i, n in enumerate(shape):
        if n <= 1 or (keep_last and i == len(shape) - 1):
            continue
        how = draw(_HOW_DIM)
        if how == "one":
            shape[i] = 1
        elif how == "expanded":
            expanded.append(i)
    return tuple(shape), tuple(expanded)


def make_array(spec: dict, rng: numpy.random.Generator, name: str, dtype: Any) -> numpy.ndarray:
    """The values of an array keyword from its spec (C order, extent 1 on the stride-0 dims)."""
    from cuflash._testing_case import _dtype
    shape = tuple(spec["shape"])
    vshape = tuple(1 if i in tuple(spec.get("expanded", ())) else n for i, n in enumerate(shape))
    if name == "mask":
        return rng.random(vshape) < spec.get("keep", 0.5)
    dt = _dtype(spec.get("dtype", dtype))
    if name == "alibi_slopes":   # positive slopes (ALiBi's are 2^-8/H ... 2^-8)
        return numpy.asarray(rng.uniform(0.1, 1.0, vshape) * spec.get("scale", 1.0), dt)
    values = rng.standard_normal(vshape) * spec.get("scale", 1.0)
    if name == "bias" and spec.get("hide", 0.0):   # -inf entries hide their pairs
        values = numpy.where(rng.random(vshape) < spec["hide"], -numpy.inf, values)
    return numpy.asarray(values, dt)   # an array also for shape ()


def resolve(name: str, value: Any, batch_shape: tuple, Lq: int, Lk: int) -> Any:
    """A plain keyword value as :func:`cuflash.attention` takes it (arrays excepted: the case
    builds those)."""
    if name == "score_mod" and isinstance(value, str):
        return SCORE_MODS[value][0]
    if name == "mask_mod" and isinstance(value, str):
        return MASK_MODS[value]
    if name == "block_mask" and isinstance(value, dict):
        import cuflash
        return cuflash.block_mask(MASK_MODS[value["mask_mod"]], batch_shape, Lq, Lk,
                                  block=tuple(value["block"]))
    if name == "window" and isinstance(value, list):
        return tuple(value)
    return value


def plain(value: Any) -> Any:
    """JSON's lists back to tuples (specs and windows, as drawn)."""
    if isinstance(value, list):
        return tuple(plain(x) for x in value)
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    return value


# -- visibility ----------------------------------------------------------------------------------

def batch_indices(batch_shape: tuple) -> tuple[numpy.ndarray, numpy.ndarray]:
    """DESIGN.md's ``b``, ``h`` of every batch item, shaped ``batch_shape + (1, 1)``."""
    n = math.prod(batch_shape)
    flat = numpy.arange(n, dtype=numpy.int64).reshape(batch_shape)
    heads = max(1, math.prod(batch_shape[1:] if len(batch_shape) >= 2 else batch_shape))
    b, h = (flat // heads, flat % heads) if len(batch_shape) >= 2 else (flat * 0, flat)
    return b[..., None, None], h[..., None, None]


def visible(kwargs: dict, Lq: int, Lk: int, batch_shape: tuple) -> numpy.ndarray | None:
    """The pairs window, mask, mask_mod / block_mask and -inf bias entries keep: a NumPy bool
    array broadcastable to ``batch_shape + (Lq, Lk)``, or None (``kwargs`` live, on the host)."""
    i, j = numpy.arange(Lq)[:, None], numpy.arange(Lk)[None, :]
    diag = Lk - Lq
    vis = None

    def both(x):
        return x if vis is None else vis & x

    window = kwargs.get("window")
    if window is not None:
        left, right = window
        if left is not None:
            vis = both(j >= i + diag - left)
        if right is not None:
            vis = both(j <= i + diag + right)
    if kwargs.get("mask") is not None:
        vis = both(numpy.asarray(kwargs["mask"]))
    fn = kwargs.get("mask_mod")
    if fn is None and kwargs.get("block_mask") is not None:
        fn = kwargs["block_mask"].mask_mod
    if fn is not None:
        b, h = batch_indices(batch_shape)
        vis = both(numpy.broadcast_to(numpy.asarray(fn(b, h, i, j)), batch_shape + (Lq, Lk)))
    if kwargs.get("bias") is not None and kwargs.get("score_mod") is None:
        # (after a score_mod a -inf bias hides the pair only if the function keeps -inf: the
        # naive pipeline applies it and finds out)
        vis = both(numpy.asarray(kwargs["bias"]) != -numpy.inf)
    return vis


# -- the naive pipeline ----------------------------------------------------------------------------

@dataclass
class NaiveModifiers:
    """The score-changing modifiers of one case (host arrays, batch-broadcast views)."""
    batch_shape: tuple
    Lq: int
    Lk: int
    softcap: float | None
    alibi: numpy.ndarray | None        # batch_shape
    bias: numpy.ndarray | None         # batch_shape + (Lq, Lk)
    bias_shape: tuple | None
    bias_dtype: Any
    score_mod: Callable | None
    sink: numpy.ndarray | None         # batch_shape
    sink_shape: tuple | None
    sink_dtype: Any

    @classmethod
    def of(cls, kwargs: dict, batch_shape: tuple, Lq: int, Lk: int) -> "NaiveModifiers | None":
        """From live host keywords; None when nothing changes scores or the softmax."""
        if not any(kwargs.get(n) is not None
                   for n in ("softcap", "alibi_slopes", "bias", "score_mod", "sink")):
            return None
        full = batch_shape + (Lq, Lk)

        def host(name, shape):
            x = kwargs.get(name)
            return None if x is None else numpy.broadcast_to(numpy.asarray(x), shape)

        bias, sink = kwargs.get("bias"), kwargs.get("sink")
        return cls(batch_shape, Lq, Lk, kwargs.get("softcap"),
                   host("alibi_slopes", batch_shape), host("bias", full),
                   None if bias is None else tuple(bias.shape),
                   None if bias is None else numpy.dtype(bias.dtype), kwargs.get("score_mod"),
                   host("sink", batch_shape), None if sink is None else tuple(sink.shape),
                   None if sink is None else numpy.dtype(sink.dtype))

    def transform(self, s: Any, xp: Any, compute: Any, stored: Callable) -> tuple[Any, dict]:
        """Steps 2-5 on ``s`` (the scaled scores, ``xp``, dtype ``compute``), each result
        ``stored`` (rounded to the half type for half inputs); returns what the backward needs."""
        saved: dict = {}
        i = xp.arange(self.Lq)[:, None]
        j = xp.arange(self.Lk)[None, :]
        with numpy.errstate(all="ignore"):
            if self.softcap is not None:
                c = compute(self.softcap)
                saved["tanh"] = xp.tanh(s / c)
                s = stored(c * saved["tanh"])
            if self.alibi is not None:
                slope = xp.asarray(self.alibi.astype(compute))[..., None, None]
                s = stored(s - slope * xp.abs(i + (self.Lk - self.Lq) - j).astype(compute))
            if self.bias is not None:
                s = stored(s + xp.asarray(self.bias).astype(compute))
            if self.score_mod is not None:
                b, h = (xp.asarray(x) for x in batch_indices(self.batch_shape))
                saved["t"], saved["bhij"] = s, (b, h, i, j)
                s = stored(xp.broadcast_to(xp.asarray(self.score_mod(s, b, h, i, j)),
                                           s.shape).astype(compute))
        return s, saved

    def chain(self, saved: dict, xp: Any, compute: Any) -> tuple[Any, Any]:
        """``(d score / d (scale q.k), d score / d bias)`` at the saved point (1 where off)."""
        one = compute(1)
        d_mod = one
        if self.score_mod is not None:
            dfn = score_mod_derivative(self.score_mod)
            t, (b, h, i, j) = saved["t"], saved["bhij"]
            with numpy.errstate(all="ignore"):
                if dfn is not None:
                    d_mod = xp.asarray(dfn(t, b, h, i, j)).astype(compute)
                else:    # a function of the user's: central differences in float64
                    t64 = t.astype(numpy.float64)
                    step = 2.0 ** -20 * xp.maximum(1.0, xp.abs(t64))
                    hi, lo = (xp.asarray(self.score_mod(t64 + sgn * step, b, h, i, j))
                              for sgn in (1, -1))
                    d_mod = ((hi - lo) / (2 * step)).astype(compute)
        d_cap = one if self.softcap is None else one - saved["tanh"] * saved["tanh"]
        return d_mod * d_cap, d_mod

    def sink_of(self, xp: Any, compute: Any) -> Any:
        """The sink as ``batch_shape + (1, 1)`` (or None)."""
        return (None if self.sink is None
                else xp.asarray(self.sink.astype(compute))[..., None, None])

    def grad_names(self) -> tuple[str, ...]:
        return tuple(n for n, on in (("dbias", self.bias is not None),
                                     ("dsink", self.sink is not None)) if on)


def grad_names(kwargs: dict) -> tuple[str, ...]:
    """Names of the gradients after dq, dk, dv for these keywords (DESIGN.md's order)."""
    return tuple(n for n, k in (("dbias", "bias"), ("dsink", "sink"))
                 if kwargs.get(k) is not None)
