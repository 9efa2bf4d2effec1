"""Validation of the modifier keywords (DESIGN.md "Modifiers") into one frozen record.

``check_modifiers`` turns ``window``, ``softcap``, ``alibi_slopes``, ``sink``, ``bias``, ``mask``,
``score_mod``, ``mask_mod`` and ``block_mask`` into a :class:`Modifiers` record for one problem
(its batch shape and lengths are known by then), or raises ``TypeError`` / ``ValueError``
naming the values, before any work is done. What each modifier does to a score is in
``_pipeline`` (NumPy, shared by the CPU path and the reference) and, on the GPU, in the Variant.

Choices where DESIGN.md is silent (each also in the public docstrings):

- ``window=(None, None)`` hides nothing and is recorded as no window.
- ``alibi_slopes`` and ``sink`` are arrays of the inputs' array type and a float dtype (float16,
  bfloat16, float32, float64) whose shape broadcasts *to* the batch shape (it may not enlarge
  it): ``(H,)`` for ``(B, H, L, d)`` inputs, ``(Hkv, G)`` for the GQA shape ``(B, Hkv, G, L, d)``.
  Their values are not inspected (that would cost a device synchronisation on CuPy): a NaN
  slope or sink makes its own rows NaN, as a NaN input does.
- ``bias`` has one of those float dtypes (not necessarily q's); ``dbias`` has ``bias``'s shape
  and dtype. ``mask`` must be ``bool`` (an additive float mask is ``bias=``).
- ``block_mask=bm`` alone means ``mask_mod=bm.mask_mod``; given both, they must be one object.
"""

from __future__ import annotations

import dataclasses
import inspect
import numbers
import sys
from typing import Any, Callable

import ml_dtypes
import numpy

from cuflash._problem import positive_real

#: dtypes accepted for bias, alibi_slopes and sink
FLOAT_DTYPES = tuple(numpy.dtype(t) for t in (numpy.float16, ml_dtypes.bfloat16, numpy.float32,
                                             numpy.float64))

#: Keyword names of the modifiers, in DESIGN.md's pipeline order
KEYWORDS = ("softcap", "alibi_slopes", "bias", "score_mod", "window", "mask", "mask_mod",
            "block_mask", "sink")


@dataclasses.dataclass(frozen=True, eq=False)
class Modifiers:
    """The validated modifiers of one call; every field ``None`` when a modifier is off.

    Attributes
    ----------
    batch_shape, Lq, Lk
        Of the problem the record was validated against.
    window : tuple (left, right) of int or None, or None
        Key j is visible to query i iff ``i + Lk - Lq - left <= j <= i + Lk - Lq + right``
        (a None bound is unbounded).
    softcap : float or None
    alibi_slopes, sink : array or None
        Broadcast to ``batch_shape`` (views, never copies).
    bias, mask : array or None
        Broadcast to ``batch_shape + (Lq, Lk)`` (views: stride 0 along broadcast dimensions).
    bias_shape, sink_shape : tuple or None
        The shapes the user passed: ``dbias`` and ``dsink`` have them.
    bias_dtype, sink_dtype : numpy.dtype or None
    score_mod, mask_mod : callable or None
        ``mask_mod`` is ``block_mask.mask_mod`` when only ``block_mask`` was given.
    block_mask : BlockMask or None
    """

    batch_shape: tuple[int, ...]
    Lq: int
    Lk: int
    window: tuple[int | None, int | None] | None = None
    softcap: float | None = None
    alibi_slopes: Any = dataclasses.field(default=None, repr=False)
    sink: Any = dataclasses.field(default=None, repr=False)
    bias: Any = dataclasses.field(default=None, repr=False)
    mask: Any = dataclasses.field(default=None, repr=False)
    bias_shape: tuple[int, ...] | None = None
    bias_dtype: numpy.dtype | None = None
    sink_shape: tuple[int, ...] | None = None
    sink_dtype: numpy.dtype | None = None
    score_mod: Callable | None = None
    mask_mod: Callable | None = None
    block_mask: Any = None

    @property
    def features(self) -> frozenset[str]:
        """Keyword names of the modifiers that are on (what a kernel family must support)."""
        return frozenset(name for name in KEYWORDS if getattr(self, name) is not None)

    @property
    def transforms_scores(self) -> bool:
        """Whether a step between the scale and the masking changes scores (2-5)."""
        return any(getattr(self, n) is not None
                   for n in ("softcap", "alibi_slopes", "bias", "score_mod"))

    @property
    def masks(self) -> bool:
        """Whether a masking step other than causal is on (window, mask, mask_mod)."""
        return any(getattr(self, n) is not None for n in ("window", "mask", "mask_mod"))

    def extra_gradients(self) -> tuple[str, ...]:
        """Names of the gradients after dq, dk, dv, in DESIGN.md's order."""
        return tuple(n for n, on in (("dbias", self.bias is not None),
                                     ("dsink", self.sink is not None)) if on)


def no_modifiers(batch_shape: tuple[int, ...], Lq: int, Lk: int) -> Modifiers:
    return Modifiers(batch_shape=tuple(batch_shape), Lq=Lq, Lk=Lk)


# ---------------------------------------------------------------------------------------------
# One check per keyword
# ---------------------------------------------------------------------------------------------

def _is_int(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, (bool, numpy.bool_))


def check_window(window: Any) -> tuple[int | None, int | None] | None:
    """``None`` or ``(left, right)``, each an int >= 0 or None; ``(None, None)`` is None."""
    if window is None:
        return None
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise TypeError(f"window must be None or a pair (left, right) of ints >= 0 or None, "
                        f"got {window!r}")
    bounds = []
    for side, x in zip(("left", "right"), window):
        if x is None:
            bounds.append(None)
            continue
        if not _is_int(x):
            raise TypeError(f"window {side} bound must be an int >= 0 or None, got {x!r} of "
                            f"type {type(x).__qualname__} in {window=}")
        if x < 0:
            raise ValueError(f"window {side} bound must be >= 0, got {window=}")
        bounds.append(int(x))
    return None if bounds == [None, None] else (bounds[0], bounds[1])


def check_softcap(softcap: Any) -> float | None:
    """``None`` or a finite real number > 0 (bool is not a number here)."""
    if softcap is None:
        return None
    return positive_real(softcap, "softcap", "> 0")


def _array_of(x: Any, name: str, xp: Any, device_id: int | None) -> Any:
    """``x`` as an ndarray of ``xp`` (numpy or cupy) on ``device_id``: other frameworks' arrays
    are taken without a copy (``_interop.as_array``), anything else is a TypeError."""
    from cuflash._interop import as_array
    x = as_array(x, name)
    cupy = sys.modules.get("cupy")
    is_np = isinstance(x, numpy.ndarray)
    is_cp = cupy is not None and isinstance(x, cupy.ndarray)
    if not (is_np or is_cp):
        raise TypeError(f"{name} must be a {xp.__name__}.ndarray like q, k and v, got "
                        f"{type(x).__module__}.{type(x).__qualname__}")
    if (xp is numpy) != is_np:
        raise TypeError(f"{name} must be a {xp.__name__}.ndarray like q, k and v, got a "
                        f"{'numpy' if is_np else 'cupy'}.ndarray")
    if device_id is not None and x.device.id != device_id:
        raise ValueError(f"{name} is on device {x.device.id} but the inputs are on device "
                         f"{device_id}")
    return x


def _float_array(x: Any, name: str, xp: Any, device_id: int | None) -> Any:
    x = _array_of(x, name, xp, device_id)
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name}.dtype={x.dtype} is not supported; use one of "
                        f"{', '.join(str(t) for t in FLOAT_DTYPES)}")
    return x


def _broadcasts_to(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    try:
        return tuple(numpy.broadcast_shapes(tuple(shape), tuple(target))) == tuple(target)
    except ValueError:
        return False


def check_per_batch(x: Any, name: str, xp: Any, device_id: int | None,
                    batch_shape: tuple[int, ...]) -> Any:
    """alibi_slopes / sink: a float array broadcasting to ``batch_shape``; returns the view."""
    if x is None:
        return None
    x = _float_array(x, name, xp, device_id)
    if not _broadcasts_to(x.shape, batch_shape):
        raise ValueError(f"{name}.shape={x.shape} does not broadcast to the batch shape "
                         f"{batch_shape} (one value per batch item, e.g. shape (H,) for "
                         f"(B, H, L, d) inputs)")
    return xp.broadcast_to(x, batch_shape)


def check_pairwise(x: Any, name: str, xp: Any, device_id: int | None,
                   batch_shape: tuple[int, ...], Lq: int, Lk: int) -> Any:
    """bias / mask: an array broadcasting to ``batch_shape + (Lq, Lk)``; returns the view."""
    if x is None:
        return None
    if name == "mask":
        x = _array_of(x, name, xp, device_id)
        if x.dtype != numpy.bool_:
            raise TypeError(f"mask must be a bool array (True = keep), got {x.dtype=}; for an "
                            f"additive float mask use bias= (-inf hides a pair)")
    else:
        x = _float_array(x, name, xp, device_id)
    full = tuple(batch_shape) + (Lq, Lk)
    if not _broadcasts_to(x.shape, full):
        raise ValueError(f"{name}.shape={x.shape} does not broadcast to batch_shape + (Lq, Lk) "
                         f"= {full}")
    return xp.broadcast_to(x, full)   # a view: stride 0 along broadcast dimensions


def _describe(fn: Callable) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


def check_user_function(fn: Any, name: str) -> Callable | None:
    """``score_mod`` takes 5 positional arguments, ``mask_mod`` 4."""
    if fn is None:
        return None
    params = {"score_mod": "(score, b, h, q_idx, kv_idx)", "mask_mod": "(b, h, q_idx, kv_idx)"}
    nargs = 5 if name == "score_mod" else 4
    if not callable(fn):
        raise TypeError(f"{name} must be a function {params[name]}, got {fn!r}")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):   # a builtin without a signature: checked when called
        return fn
    try:
        sig.bind(*range(nargs))
    except TypeError:
        raise TypeError(f"{name} must take {nargs} positional arguments {params[name]}; "
                        f"{_describe(fn)}{sig} does not") from None
    return fn


def check_block_mask(block_mask: Any, mask_mod: Callable | None,
                     batch_shape: tuple[int, ...], Lq: int, Lk: int) -> Callable | None:
    """Check ``block_mask`` against the problem; return the mask_mod of the call."""
    if block_mask is None:
        return mask_mod
    from cuflash._block_mask import BlockMask
    if not isinstance(block_mask, BlockMask):
        raise TypeError(f"block_mask must be made by cuflash.block_mask(...), got "
                        f"{type(block_mask).__qualname__}")
    if mask_mod is not None and mask_mod is not block_mask.mask_mod:
        raise ValueError(f"mask_mod={_describe(mask_mod)} is not the function block_mask was "
                         f"built from ({_describe(block_mask.mask_mod)}); pass one of them")
    if (block_mask.Lq, block_mask.Lk) != (Lq, Lk):
        raise ValueError(f"block_mask was built for (Lq, Lk) = ({block_mask.Lq}, "
                         f"{block_mask.Lk}), the inputs have ({Lq}, {Lk})")
    if (len(block_mask.batch_shape) != len(batch_shape)
            or not _broadcasts_to(block_mask.batch_shape, batch_shape)):
        raise ValueError(f"block_mask.batch_shape={block_mask.batch_shape} does not broadcast "
                         f"to the batch shape {batch_shape} with the same number of "
                         f"dimensions")
    return block_mask.mask_mod


def check_modifiers(*, xp: Any, device_id: int | None, batch_shape: tuple[int, ...], Lq: int,
                    Lk: int, window: Any = None, softcap: Any = None, alibi_slopes: Any = None,
                    sink: Any = None, bias: Any = None, mask: Any = None, score_mod: Any = None,
                    mask_mod: Any = None, block_mask: Any = None) -> Modifiers:
    """Validate every modifier keyword of one call (see the module docstring).

    Raises
    ------
    TypeError
        An argument of the wrong Python type, array type or dtype (a float ``mask``), a
        user function with the wrong number of parameters, a ``block_mask`` not made by
        ``cuflash.block_mask``.
    ValueError
        A negative window bound, a softcap that is not finite and > 0, an array that does not
        broadcast, an array on another device, a ``block_mask`` for other lengths or another
        ``mask_mod``.
    """
    batch_shape = tuple(batch_shape)
    # other frameworks' arrays as NumPy / CuPy views (their shapes are what dbias, dsink take)
    from cuflash._interop import as_array
    bias, sink = (None if x is None else as_array(x, n) for x, n in ((bias, "bias"),
                                                                     (sink, "sink")))
    score_mod = check_user_function(score_mod, "score_mod")
    mask_mod = check_user_function(mask_mod, "mask_mod")
    return Modifiers(
        batch_shape=batch_shape, Lq=Lq, Lk=Lk,
        window=check_window(window),
        softcap=check_softcap(softcap),
        alibi_slopes=check_per_batch(alibi_slopes, "alibi_slopes", xp, device_id, batch_shape),
        sink=check_per_batch(sink, "sink", xp, device_id, batch_shape),
        bias=check_pairwise(bias, "bias", xp, device_id, batch_shape, Lq, Lk),
        mask=check_pairwise(mask, "mask", xp, device_id, batch_shape, Lq, Lk),
        bias_shape=None if bias is None else tuple(bias.shape),
        bias_dtype=None if bias is None else bias.dtype,
        sink_shape=None if sink is None else tuple(sink.shape),
        sink_dtype=None if sink is None else sink.dtype,
        score_mod=score_mod,
        mask_mod=check_block_mask(block_mask, mask_mod, batch_shape, Lq, Lk),
        block_mask=block_mask,
    )


def batch_indices(batch_shape: tuple[int, ...], xp: Any = numpy) -> tuple[Any, Any]:
    """``(b, h)`` of every batch item as int arrays of ``batch_shape`` (DESIGN.md's meaning).

    ``b`` is the index along ``batch_shape[0]`` and ``h`` the flat (C order) index over
    ``batch_shape[1:]`` when there are at least two batch dims; with one, ``b = 0`` and ``h`` its
    index; with none, both are 0. Equivalently, with ``H = prod(batch_shape[1:])`` for two or
    more dims and ``prod(batch_shape)`` otherwise, ``b = flat // H`` and ``h = flat % H`` for the
    flat C-order batch index: the formula the kernels use (``heads_of`` gives ``H``).
    """
    n = int(numpy.prod(batch_shape, dtype=numpy.int64))
    flat = xp.arange(n, dtype=xp.int64).reshape(batch_shape)
    H = heads_of(batch_shape)
    return flat // H, flat % H


def heads_of(batch_shape: tuple[int, ...]) -> int:
    """``H`` of :func:`batch_indices` (at least 1)."""
    dims = batch_shape[1:] if len(batch_shape) >= 2 else batch_shape
    return max(1, int(numpy.prod(dims, dtype=numpy.int64)))


#: Modifiers the GPU kernel families implement today, per public function (issue 10 adds
#: them direction by direction): the forward families run the built-ins through the Variant
_BUILT_INS = frozenset({"window", "softcap", "alibi_slopes", "bias", "mask", "sink"})
GPU_FEATURES: dict[str, frozenset[str]] = {
    # user functions traced into the Variant; a block_mask runs its mask_mod (its tiles are
    # not skipped on the GPU yet)
    "attention": _BUILT_INS | {"score_mod", "mask_mod", "block_mask"},
    # bwd_sm80 and, on Hopper, bwd_sm90 for what _traits.BWD_SM90_MODIFIERS lists (float16 /
    # bfloat16, head dims <= 128): see BACKWARD_DTYPES
    "attention_backward": _BUILT_INS | {"score_mod", "mask_mod", "block_mask"},
}
#: dtypes whose GPU backward runs the modifiers (bwd_sm80, bwd_sm90; bwd_simt not yet)
BACKWARD_DTYPES = frozenset({"float16", "bfloat16"})


def gpu_missing_features(features, what: str, dtype=None, dmax: int = 0) -> list[str]:
    """The modifier names among ``features`` that ``what``'s GPU path ("attention" or
    "attention_backward") does not implement yet, for inputs of ``dtype`` and head dim
    ``dmax`` where the families differ by them. The one rule: the API's NotImplementedError
    and the fuzz campaign's choice of features both ask it."""
    supported = GPU_FEATURES.get(what, frozenset())
    if what == "attention_backward" and dtype is not None and (
            numpy.dtype(dtype).name not in BACKWARD_DTYPES or dmax > 128):
        supported = frozenset()
    return sorted(frozenset(features) - supported)


def gpu_missing(mods: Modifiers, what: str, dtype=None, dmax: int = 0) -> list[str]:
    """The modifiers of ``mods`` that ``what``'s GPU path does not implement yet."""
    return gpu_missing_features(mods.features, what, dtype, dmax)


def check_gpu_support(mods: Modifiers, what: str, dtype=None, dmax: int = 0) -> None:
    """NotImplementedError, before any GPU work, for a CuPy call with a modifier no kernel
    family implements yet: never a result computed without it. The backward runs them for
    float16 / bfloat16 with head dims up to 128 (bwd_sm80)."""
    missing = gpu_missing(mods, what, dtype, dmax)
    if missing:
        raise NotImplementedError(
            f"cuflash.{what} on CuPy arrays does not implement {', '.join(missing)} yet for "
            f"{numpy.dtype(dtype).name if dtype is not None else 'these inputs'} with head dim "
            f"{dmax} (the GPU backward runs the modifiers for float16 / bfloat16 with head dims "
            f"up to 128); the same call on NumPy arrays runs them on the CPU path, and "
            f"cuflash.reference.{what} computes them in float64")


def explain(mods: Modifiers, what: str, dtype=None, dmax: int = 0) -> str:
    """What ``cuflash.explain`` says of a call with modifiers: which are on, where they run
    (for inputs of ``dtype`` and head dim ``dmax`` where given), and the CUDA source traced
    from the user functions (what the GPU Variant will compile)."""
    from cuflash import _trace
    lines = [f"{what} with modifiers: {', '.join(sorted(mods.features))}"]
    missing = gpu_missing(mods, what, dtype, dmax)
    if missing:
        on = f" for {numpy.dtype(dtype).name} inputs with head dim {dmax}" if dtype else ""
        lines.append(f"GPU: not implemented yet for {', '.join(missing)}{on} "
                     f"(NotImplementedError); NumPy inputs run them on the CPU path")
    for role, fn in (("score_mod", mods.score_mod), ("mask_mod", mods.mask_mod)):
        if fn is None:
            continue
        try:
            trace = _trace.cached_trace(fn, role)
        except TypeError as exc:
            lines.append(f"{role}: cannot be traced for the GPU: {exc}")
            continue
        lines.append(f"{role}: traced to {trace.struct_name} "
                     f"({len(trace.captures)} captured arrays):")
        lines.append(trace.source)
    return "\n".join(lines)


def check_keywords(kw: dict, where: str) -> None:
    """Only modifier keywords in ``kw`` (functions that take ``**modifiers``)."""
    unknown = sorted(set(kw) - set(KEYWORDS))
    if unknown:
        raise TypeError(f"{where}() got unexpected keyword arguments {unknown}")
