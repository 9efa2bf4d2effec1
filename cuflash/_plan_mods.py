"""The modifiers' part of a plan (``_plan``): which of the call's modifier arrays a kernel
reads, the packing of their run-time block ``Params.mod``, and the device pointers of those
arrays (and of the arrays user functions capture) patched into the parameter block on every
call. A cached plan keeps none of the arrays themselves."""

from __future__ import annotations

import numpy

from . import _launch


def _causal_kinds() -> bool:
    """``CUFLASH_BMASK_CAUSAL_KINDS`` (read at plan time; session 9): "1" (the default) builds a
    causal call's block-mask lists from the kinds of the pairs within the causal bound (the
    diagonal tiles of a causal mask_mod, e.g. documents, become full: no mask_mod there), "0"
    from the mask_mod's kinds alone, as before; for an A/B in one process."""
    import os
    value = os.environ.get("CUFLASH_BMASK_CAUSAL_KINDS", "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"CUFLASH_BMASK_CAUSAL_KINDS={value!r}: expected 0 or 1")
    return value != "0"


class ModifierPatch:
    """The modifiers of a plan (none of their arrays: a cached plan must not keep them alive):
    which arrays there are, ``Params.mod`` packing, and the pointer words patched on every
    call (bias, mask, slopes, sink)."""

    def __init__(self, prob, mods):
        from . import _modifier_params as mp
        mp.check_gpu_layout(mods)
        self.acc = numpy.float64 if prob.dtype == numpy.float64 else numpy.float32
        self.names = [n for n in mp.POINTER_FIELDS if getattr(mods, n) is not None]
        base = _launch.PARAMS.fields["mod"][1]
        self.word = {n: (base + mp.MODIFIER_PARAMS.fields[n][1]) // 8 for n in self.names}
        self.has_bias = mods.bias is not None
        self.block_mask = mods.block_mask is not None
        self.block_word = (base + mp.MODIFIER_PARAMS.fields["block_list"][1]) // 8
        self.list_tiles = None   # (m, n, sub, causal) of the kernel's tiles: set_tiles
        # the causal offset where the kernel bounds every row causally itself (the lists' kinds
        # are then those of the pairs within the bound: _block_mask.causal_fine), else None
        self.causal = prob.causal_offset if prob.causal and _causal_kinds() else None
        self.dbias_word = (base + mp.MODIFIER_PARAMS.fields["dbias"][1]) // 8
        # the captured arrays' pointer words (score_mod's slots first, then mask_mod's)
        cap = base + mp.MODIFIER_PARAMS.fields["captured"][1]
        self.captured_words = [(cap + k * mp.MODIFIER_PARAMS["captured"].base.itemsize) // 8
                               for k in range(4)]

    def set_tiles(self, family: str, traits) -> None:
        """The kernel's tile shape, once the plan has chosen it: a block mask's lists are built
        (once per block mask and shape, ``_block_mask.device_lists``) for these tiles. Row
        slices: a warpgroup's 64 rows (fwd_sm90), a warp's (fwd_sm80), the whole tile (the
        backwards, which read the transpose)."""
        m, n = traits.block_m, traits.block_n
        if family == "fwd_sm90":
            sub = 64
        elif family == "fwd_sm80":
            sub = m // traits["warps"]
        else:
            sub = m
        self.list_tiles = (m, n, sub, self.causal)

    def _lists(self, mods):
        from ._block_mask import device_lists
        return device_lists(mods.block_mask, mods.batch_shape, *self.list_tiles)

    def arrays(self, mods) -> list:
        """The call's modifier arrays (broadcast views), in ``names`` order, then the block
        mask's tile lists on the device: their batch strides join the batch layout's."""
        out = [getattr(mods, n) for n in self.names]
        if self.block_mask:
            out.append(self._lists(mods)[1])
        return out

    def pack_into(self, p, layout, first: int, mods) -> None:
        """Fill ``p["mod"]`` for ``layout`` (whose strides after the ``first`` tensors' are
        this plan's arrays', in ``names`` order); pointers stay 0 until a call."""
        from . import _modifier_params as mp
        if len(layout.outer) > 1:
            raise NotImplementedError(
                "modifiers on the GPU with more than 4 batch dimensions that cannot be merged "
                "(an outer loop of launches) are not implemented; reshape the batch dims")
        arrays = self.arrays(mods)
        strides = {id(x): st for x, st in zip(arrays, layout.strides[first:])}
        from ._variant import traces_of
        score, mask = traces_of(mods)
        p["mod"] = mp.pack(mods, pointer=lambda x: 0, batch_strides=lambda x: strides[id(x)],
                           score_trace=score, mask_trace=mask,
                           block_lists=(self._lists(mods)[0], arrays[-1]) if self.block_mask
                           else None)

    def pointer_arrays(self, mods) -> list:
        """The arrays whose pointers a call patches, slopes and sinks in the accumulation
        type (converted when needed: one value per un-broadcast item)."""
        from ._modifier_params import per_item_acc
        import cupy
        out = []
        for n in self.names:
            x = getattr(mods, n)
            out.append(per_item_acc(x, self.acc, cupy) if n in ("alibi_slopes", "sink") else x)
        return out

    def words(self, arrays, mods=None) -> list[tuple[int, int]]:
        """(word, pointer) of the arrays, then of the captured arrays the user functions of
        ``mods`` read."""
        out = [(self.word[n], x.data.ptr) for n, x in zip(self.names, arrays)]
        if self.block_mask and mods is not None:
            out.append((self.block_word, self._lists(mods)[1].data.ptr))
        if mods is not None and (mods.score_mod is not None or mods.mask_mod is not None):
            from ._variant import traces_of
            caps = [c for t in traces_of(mods) if t is not None for c in t.captures]
            for w, c in zip(self.captured_words, caps):
                if not hasattr(c.array, "data") or not hasattr(c.array.data, "ptr"):
                    raise TypeError(f"{c!r} is read by a function on the GPU: capture a "
                                    f"cupy.ndarray on the inputs' device")
                out.append((w, c.array.data.ptr))
        return out


def dbias_plan(variant, mods, prob, has_bias: bool, family: str = ""):
    """dL/dbias's finishing (session 8; ``CUFLASH_DBIAS_REDUCE=0`` restores the old one, read
    here at plan time): (full, sum).
    full: every (item, i, j) is written by the main kernel (p_ds_pair writes each pair of the
    tiles it visits, 0 where hidden, and nothing bounds the walk: no causal, window or block
    mask), so the float32 buffer is not zeroed (4 bytes a pair less to write).
    sum: (parts, n, dtype) where the bias broadcasts over the leading items only (its
    (H, L, L) over (B, H); none at all) and its dtype is a kernel's T: one bwd_finish_dq
    launch adds the parts slices of n elements in item order and rounds once to the bias's
    dtype (a fixed order: bitwise reproducible), instead of a CuPy sum into a float32 array
    and a cast. None: the CuPy sum (the bias broadcasts over an inner dimension).
    ``family``: bwd_sm90 writes dbias with 32-bit offsets inside an item (bwd_io::p_ds_pair's
    OFFSET32): ValueError for Lq * Lk >= 2**31 there."""
    import math
    import os
    if has_bias and family == "bwd_sm90" and prob.Lq * prob.Lk >= 2**31:
        raise ValueError(f"the GPU backward with a bias needs Lq * Lk < 2**31, not "
                         f"{prob.Lq} * {prob.Lk} (its float32 dbias of one batch item alone "
                         f"would take {4 * prob.Lq * prob.Lk / 2**30:.0f} GiB)")
    value = os.environ.get("CUFLASH_DBIAS_REDUCE", "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"CUFLASH_DBIAS_REDUCE={value!r}: expected 0 or 1")
    if not has_bias or value == "0":
        return False, None
    full = not (variant.causal or variant.window or mods.block_mask is not None)
    from ._problem import broadcast_axes
    acc_shape = tuple(prob.batch_shape) + (prob.Lq, prob.Lk)
    axes = broadcast_axes(tuple(mods.bias_shape), acc_shape)
    dtype = numpy.dtype(mods.bias_dtype)
    if axes != tuple(range(len(axes))) or dtype.name not in ("float16", "bfloat16", "float32"):
        return full, None
    return full, (math.prod(acc_shape[:len(axes)]), math.prod(acc_shape[len(axes):]), dtype)


def dbias_finish(dbias_sum, device_id: int, num_sms: int):
    """bwd_finish_dq as dbias's sum over its broadcast items (``dbias_sum`` = (parts, n,
    dtype): the kernel's float32 slices of n elements added in item order, rounded once
    to the bias's dtype); its VEC4 build (16-byte loads) where n % 4 == 0 (the caller checks
    that dbias starts on 16 bytes: ``dbias_vec4``)."""
    from ._plan_aux import finish_launch
    parts, n, dtype = dbias_sum
    return finish_launch(dtype, "T", n, parts, device_id, num_sms, vec4=dbias_vec4(dbias_sum),
                         name="bwd_sum_dbias")


def dbias_vec4(dbias_sum) -> bool:
    """Whether dbias_finish launches the VEC4 build (whose output must start on 16 bytes)."""
    return dbias_sum[1] % 4 == 0
