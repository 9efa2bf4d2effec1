"""``cuflash::ModifierParams`` (cuda_src/modifiers.cuh) from a validated ``Modifiers`` record.

:data:`MODIFIER_PARAMS` mirrors the struct field for field; :func:`pack` fills it. The array
pointers come from a caller-supplied ``pointer(array)`` (``array.data.ptr`` for CuPy, the NumPy
data address in the host tests) and the batch strides from ``batch_strides(array)``: the
element strides of an array broadcast to the batch shape, over the launch's batch dims (at most
4, padded with leading zeros), which the launcher computes with the other tensors' (so dims it
merges are merged for these too).

Copies: ``alibi_slopes`` and ``sink`` are read in the kernel's accumulation type (float32, or
float64 for float64 inputs); one of another dtype is converted (a copy of one value per batch
item) by the caller before packing (:func:`per_item_acc`). ``bias`` and ``mask`` are read in
place through their strides, whatever they are (the column stride times ``Lk - 1`` must fit in
32 bits: :func:`check_gpu_layout`).
"""

from __future__ import annotations

import numpy

from cuflash._modifiers import Modifiers

_CAPTURED = numpy.dtype([("ptr", "<u8"), ("shape", "<i8", (4,)), ("stride", "<i8", (4,))],
                        align=True)

MODIFIER_PARAMS = numpy.dtype(
    [(n, "<u8") for n in ("bias", "mask", "alibi_slopes", "sink", "block_list", "dbias")]
    + [(f"{n}_batch_stride", "<i8", (4,)) for n in ("bias", "mask", "slope", "sink", "block")]
    + [(n, "<i8") for n in ("bias_row", "bias_col", "mask_row", "mask_col")]
    + [("captured", _CAPTURED, (4,))]
    + [("softcap", "<f4"), ("inv_softcap", "<f4")]
    + [(n, "<i4") for n in ("window_left", "window_right", "diag", "heads", "batch_base",
                            "list_tq", "list_tk", "list_bwd", "mask_mod_captured_base", "pad_")],
    align=True)


def per_item_acc(x, acc=numpy.float32, xp=numpy):
    """``x`` (broadcast to the batch shape) as something the kernel reads in its accumulation
    type ``acc``: ``x`` itself when it already has that dtype, else a copy of its un-broadcast
    values in ``acc`` kept broadcast (so a ``(H,)`` slope array costs H values, not B*H)."""
    if x is None or x.dtype == numpy.dtype(acc):
        return x
    # undo broadcast_to: take one element along each stride-0 dim, then broadcast back (astype
    # with order "C", not ascontiguousarray, which turns a 0-d array into a 1-d one)
    index = tuple(slice(0, 1) if s == 0 else slice(None) for s in x.strides)
    return xp.broadcast_to(x[index].astype(acc, order="C"), x.shape)


def per_item_float32(x, xp=numpy):
    """:func:`per_item_acc` in float32."""
    return per_item_acc(x, numpy.float32, xp)


#: the pointer fields of ModifierParams a call patches (the arrays of the built-in modifiers)
POINTER_FIELDS = ("bias", "mask", "alibi_slopes", "sink")


def check_gpu_layout(mods: Modifiers) -> None:
    """ValueError for a bias or mask whose column offsets do not fit the kernels' 32-bit
    arithmetic (a column stride times ``Lk - 1`` of 2**31 elements or more)."""
    for name in ("bias", "mask"):
        x = getattr(mods, name)
        if x is not None:
            col = abs(x.strides[-1] // x.itemsize)
            if col * max(mods.Lk - 1, 0) >= 2**31:
                raise ValueError(f"{name} has a column stride of {col} elements with "
                                 f"Lk={mods.Lk}: the GPU kernels need (Lk - 1) * stride < 2**31 "
                                 f"(pass a {name} with a smaller last-axis stride)")


def _window_bound(x, limit: int) -> int:
    """-1 for None; a bound beyond every pair is the same as ``limit`` (keeps it in int32)."""
    return -1 if x is None else min(int(x), limit)


def pack(mods: Modifiers, *, pointer, batch_strides, batch_base: int = 0,
         score_trace=None, mask_trace=None, block_lists=None) -> numpy.void:
    """``ModifierParams`` for one launch.

    ``block_lists`` is ``(TileLists, data)``: the block mask's tile lists for the kernel's tiles
    (``_block_mask.tile_lists``) and their data as the device reads it, broadcast to the batch
    shape; ``score_trace`` / ``mask_trace`` the traces whose captured arrays fill the
    ``captured`` slots (score_mod's first).
    """
    p = numpy.zeros((), MODIFIER_PARAMS)
    Lq, Lk = mods.Lq, mods.Lk
    p["diag"] = Lk - Lq
    from cuflash._modifiers import heads_of
    p["heads"] = heads_of(mods.batch_shape)
    p["batch_base"] = batch_base
    if mods.window is not None:
        p["window_left"] = _window_bound(mods.window[0], Lq + Lk)
        p["window_right"] = _window_bound(mods.window[1], Lq + Lk)
    else:
        p["window_left"] = p["window_right"] = -1
    if mods.softcap is not None:
        p["softcap"] = mods.softcap
        p["inv_softcap"] = 1.0 / mods.softcap
    for name, short in (("bias", "bias"), ("mask", "mask")):
        x = getattr(mods, name)
        if x is not None:
            p[name] = pointer(x)
            p[f"{short}_batch_stride"] = batch_strides(x)
            p[f"{short}_row"] = x.strides[-2] // x.itemsize
            p[f"{short}_col"] = x.strides[-1] // x.itemsize
    for name, short in (("alibi_slopes", "slope"), ("sink", "sink")):
        x = getattr(mods, name)
        if x is not None:
            # the kernel reads the array that `pointer` names in its accumulation type (a
            # plan packs with pointer 0 and patches per_item_acc(x)'s address per call)
            p[name] = pointer(x)
            p[f"{short}_batch_stride"] = batch_strides(x)
    if block_lists is not None:
        lists, data = block_lists
        p["block_list"] = pointer(data)
        p["block_batch_stride"] = batch_strides(data)
        p["list_tq"], p["list_tk"], p["list_bwd"] = lists.tq, lists.tk, lists.bwd
    slot = 0
    for trace in (score_trace, mask_trace):
        if trace is mask_trace:
            p["mask_mod_captured_base"] = slot
        for cap in (trace.captures if trace is not None else ()):
            arr = cap.array
            c = p["captured"][slot]
            c["ptr"] = pointer(arr)
            c["shape"][:arr.ndim] = arr.shape
            c["stride"][:arr.ndim] = [s // arr.itemsize for s in arr.strides]
            slot += 1
    if slot > 4:
        raise TypeError(f"score_mod and mask_mod read {slot} captured arrays together; the "
                        f"kernels take at most 4")
    return p[()]


#: C++ spelling of each bias dtype in the kernels
BIAS_CTYPE = {"float16": "__half", "bfloat16": "__nv_bfloat16", "float32": "float",
              "float64": "double"}


def template_arguments(mods: Modifiers, *, causal: bool, score_trace=None,
                       mask_trace=None) -> str:
    """The template arguments of ``cuflash::ModVariant<...>`` for a call: what is compiled in.

    ``score_trace`` / ``mask_trace`` are the traces of ``mods.score_mod`` / ``mods.mask_mod``
    (their structs' source must precede the kernel's); run-time values go in
    :func:`pack`. Two calls with equal arguments share one compiled kernel.
    """
    from cuflash import _trace_cuda

    def b(x: bool) -> str:
        return "true" if x else "false"

    bias = "void" if mods.bias is None else BIAS_CTYPE[str(mods.bias_dtype)]
    sm = (_trace_cuda.qualified_name(score_trace) if mods.score_mod is not None
          else "cuflash::NoScoreMod")
    mm = (_trace_cuda.qualified_name(mask_trace) if mods.mask_mod is not None
          else "cuflash::NoMaskMod")
    return ", ".join([b(causal), b(mods.window is not None), b(mods.softcap is not None),
                      b(mods.alibi_slopes is not None), bias, b(mods.mask is not None), sm, mm,
                      b(mods.block_mask is not None), b(mods.sink is not None)])
