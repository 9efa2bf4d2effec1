"""The modifiers' part of a plan (``_plan``): which of the call's modifier arrays a kernel
reads, the packing of their run-time block ``Params.mod``, and the device pointers of those
arrays (and of the arrays user functions capture) patched into the parameter block on every
call. A cached plan keeps none of the arrays themselves."""

from __future__ import annotations

import numpy

from . import _launch


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
        self.list_tiles = None   # (m, n, sub) of the kernel's tiles: set_tiles
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
        self.list_tiles = (m, n, sub)

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
