"""The cached entries of ``_api``'s fast path: what a repeated CuPy call of ``attention`` or
``attention_backward`` needs besides its plan (the shapes and dtypes of what it returns, one
allocation for all of them), and the key part of one array (:func:`layout`). Lookup, pointer
patching and the launches cost a few microseconds (``bench/host_overhead.py``)."""

from __future__ import annotations

import sys


def layout(x) -> tuple:
    """What a plan depends on in one array: shape, strides, dtype, device and the 16-byte
    alignment of its start (the tensor-core families read 16-byte chunks)."""
    mem = x.data
    return (x.shape, x.strides, x.dtype, mem.ptr & 15, mem.device_id)


def one_launch(plan) -> bool:
    """Whether a plan is one launch at offset 0 (no outer loop over batch dimensions): its
    Launch then takes a call's pointers as they are."""
    return len(plan.offsets) == 1 and not any(plan.offsets[0])


def direct_backward(plan) -> bool:
    """Whether a backward plan with modifiers is launched with the call's pointers as they are
    (``BackwardPlan.run_modified``): gradients need no broadcast sum, lse is contiguous, no
    input is copied, one launch at one offset."""
    return plan.direct and plan.lse_contiguous and not plan.copies and len(plan.offsets) == 1


#: the modifier keywords that carry an array of the call, in the order a forward entry is
#: handed them (``FastModified.forward``'s ``arrays``) and keyed (:func:`modifiers_key`)
ARRAY_MODIFIERS = ("alibi_slopes", "sink", "bias", "mask")


def forward_key(q, k, v, scale, causal) -> tuple:
    """The fast path's key of a plain forward call (a call with array-free modifiers adds
    :func:`modifiers_key`): what :func:`layout` holds of q, k, v in one flat tuple, a
    C-contiguous array's strides as ``True`` (:func:`backward_key`'s reasoning and its
    AttributeError where CuPy lacks the flag: ``_api`` then uses :func:`forward_key_strides`),
    then the keywords with their types (``causal=1`` never hits an entry made by
    ``causal=True``). The lookup and the store in ``_api`` both build it here."""
    a, b, c = q.data, k.data, v.data
    return (q.shape, q._c_contiguous or q.strides, q.dtype, a.ptr & 15, a.device_id,
            k.shape, k._c_contiguous or k.strides, k.dtype, b.ptr & 15, b.device_id,
            v.shape, v._c_contiguous or v.strides, v.dtype, c.ptr & 15, c.device_id,
            scale, scale.__class__, causal, causal.__class__)


def forward_key_strides(q, k, v, scale, causal) -> tuple:
    """:func:`forward_key` for a CuPy without the contiguity flag: the strides themselves."""
    return (layout(q), layout(k), layout(v), scale, scale.__class__, causal, causal.__class__)


def backward_key(do, q, k, v, o, lse, scale, causal, deterministic) -> tuple:
    """The fast path's key of a backward call: what :func:`layout` holds of each of the six
    arrays, in one flat tuple (one call and one tuple instead of six), then the keywords with
    their types; a C-contiguous array's strides as ``True`` (CuPy's ``_c_contiguous`` flag, a
    tenth of the ``strides`` tuple's cost: the key was the one part of the backward's path
    2.8 us above the forward's, session 10). Two C-contiguous arrays of one shape and dtype
    differ at most in the strides of extent-1 dimensions, which no plan reads (the batch
    layout drops those dimensions; a row or column stride of an extent-1 dimension multiplies
    index 0 only; tensor_core_ready skips them). AttributeError where an array is not a CuPy
    array (the caller then validates), or where CuPy lacks the flag (a private attribute:
    ``_api`` then keeps the backward off its fast path, ``has_contiguous_flag``)."""
    a, b, c, d, e, f = do.data, q.data, k.data, v.data, o.data, lse.data
    return (do.shape, do._c_contiguous or do.strides, do.dtype, a.ptr & 15, a.device_id,
            q.shape, q._c_contiguous or q.strides, q.dtype, b.ptr & 15, b.device_id,
            k.shape, k._c_contiguous or k.strides, k.dtype, c.ptr & 15, c.device_id,
            v.shape, v._c_contiguous or v.strides, v.dtype, d.ptr & 15, d.device_id,
            o.shape, o._c_contiguous or o.strides, o.dtype, e.ptr & 15, e.device_id,
            lse.shape, lse._c_contiguous or lse.strides, lse.dtype, f.ptr & 15, f.device_id,
            scale, scale.__class__, causal, causal.__class__, deterministic)


def has_contiguous_flag(ndarray) -> bool:
    """Whether this CuPy's arrays carry the flag :func:`backward_key` reads."""
    return hasattr(ndarray, "_c_contiguous")


class FastForward:
    """A cached forward: the plan and the shapes of what the call returns. o and lse share one
    allocation (o first, lse at a 256-byte aligned offset), and their arrays are made after
    the launch, where that host work overlaps the kernel. CuPy's functions are looked up once
    and a plan of one launch (no outer loop) is launched directly: host time per call."""
    __slots__ = ("plan", "o_shape", "lse_shape", "dtype", "lse_dtype", "device_id", "nbytes",
                 "lse_offset", "_alloc", "_stream", "_ndarray", "_go")

    def __init__(self, plan, o, lse):
        self.plan, self.device_id = plan, plan.device_id
        self.o_shape, self.dtype = o.shape, o.dtype
        self.lse_shape, self.lse_dtype = lse.shape, lse.dtype
        self.lse_offset = -(-o.nbytes // 256) * 256
        self.nbytes = max(self.lse_offset + lse.nbytes, 1)
        self._bind(plan)

    def _bind(self, plan) -> None:
        """What ``__call__`` uses besides the record: CuPy's functions, and the plan's launch
        where it is one launch at offset 0 (plan.run's own test), which takes the pointers as
        they are (``Launch.direct``: q, k, v, o, lse)."""
        cupy = sys.modules["cupy"]
        self._alloc, self._stream, self._ndarray = (cupy.cuda.alloc, cupy.cuda.get_current_stream,
                                                    cupy.ndarray)
        self._go = plan.launch.direct(5) if one_launch(plan) else plan.run

    def __call__(self, q, k, v, return_lse: bool):
        mem = self._alloc(self.nbytes)
        base, off = mem.ptr, self.lse_offset
        self._go(self._stream().ptr, q.data.ptr, k.data.ptr, v.data.ptr, base, base + off)
        # (memptr by position: ndarray(shape, dtype, memptr); see FastBackward)
        o = self._ndarray(self.o_shape, self.dtype, mem)
        return (o, self._ndarray(self.lse_shape, self.lse_dtype, mem + off)) if return_lse else o


class FastBackward:
    """A cached backward: the plan and the shapes of the gradients. Where the plan needs no
    broadcast sum (``plan.direct``) and lse is contiguous, dq, dk and dv share one allocation (256-byte aligned
    parts) whose arrays are made after the launches."""
    __slots__ = ("plan", "shapes", "dtype", "device_id", "offsets", "nbytes", "shared", "_alloc",
                 "_stream", "_ndarray")

    def __init__(self, plan, dq, dk, dv):
        self.plan, self.device_id = plan, plan.device_id
        cupy = sys.modules["cupy"]   # (looked up once: host time per call)
        self._alloc, self._stream, self._ndarray = (cupy.cuda.alloc, cupy.cuda.get_current_stream,
                                                    cupy.ndarray)
        self.shared = plan.direct and plan.lse_contiguous
        self.shapes, self.dtype = (dq.shape, dk.shape, dv.shape), dq.dtype
        self.offsets, total = [], 0
        for x in (dq, dk, dv):
            self.offsets.append(total)
            total += -(-x.nbytes // 256) * 256
        self.nbytes = max(total, 1)

    def __call__(self, do, q, k, v, o, lse):
        if not self.shared:
            cupy = sys.modules["cupy"]
            dq, dk, dv = (cupy.empty(s, self.dtype) for s in self.shapes)
            self.plan(do, q, k, v, o, lse, dq, dk, dv)
            return dq, dk, dv
        mem = self._alloc(self.nbytes)
        _, ok, ov = self.offsets
        base = mem.ptr
        self.plan.run(self._stream().ptr, do.data.ptr, q.data.ptr, k.data.ptr,
                      v.data.ptr, o.data.ptr, lse.data.ptr, base, base + ok, base + ov)
        sq, sk, sv = self.shapes
        nd, dt = self._ndarray, self.dtype
        # (memptr passed by position, ndarray(shape, dtype, memptr): its keyword parsing cost
        # ~0.3 us an array on this CPU, a fifth of the construction)
        return nd(sq, dt, mem), nd(sk, dt, mem + ok), nd(sv, dt, mem + ov)


def modifiers_key(window, softcap, alibi_slopes, sink, bias, mask, score_mod, mask_mod,
                  block_mask, arrays: bool = False) -> tuple | None:
    """The key part of a call's modifiers for the fast path of calls with modifiers that carry
    no array of their own (``window``, ``softcap``, ``score_mod``, ``mask_mod``,
    ``block_mask``): None where ``alibi_slopes``, ``sink``, ``bias`` or ``mask`` is given
    (without ``arrays``) or a user function's dependencies cannot be keyed
    (``_trace.function_key``). ``arrays`` (the forward's; the backward's where no sink and no
    bias is given, whose gradients are made on the general path): those four are keyed too,
    each by its :func:`layout` (what validation and the
    plan read of it: no value is checked), so a hit may patch their pointers; None where one
    is not a CuPy array (the general path validates it: a NumPy array's ``data`` is a
    memoryview, which for bfloat16 raises ValueError, not a key).

    What validation and the plan depend on, with the values' types (``(128.0, 0)`` equals
    ``(128, 0)`` but is rejected by validation: the key tells them apart): ``window`` and
    ``softcap`` with the classes of their parts; each user function by identity and
    ``function_key`` (what its trace depends on: the same rule as ``_trace.cached_trace``);
    a ``block_mask`` by identity, with its mask_mod's key. An entry holds the call's validated
    ``Modifiers``, which holds the functions and the block mask, so no identity in a live key
    can be reused by another object. TypeError where a value is unhashable."""
    given = (alibi_slopes, sink, bias, mask)
    if not arrays and not (alibi_slopes is None and sink is None and bias is None
                           and mask is None):
        return None
    from cuflash._trace import function_key
    key: tuple = ("mods", window, window.__class__,
                  tuple(x.__class__ for x in window) if window.__class__ is tuple else None,
                  softcap, softcap.__class__)
    fns = (score_mod, mask_mod, None if block_mask is None else block_mask.mask_mod)
    try:
        for fn in fns:
            key += (None,) if fn is None else ((id(fn), function_key(fn)),)
    except (KeyError, AttributeError, ValueError):   # cached_trace's own rule: not keyable
        return None
    if arrays:
        nd = sys.modules["cupy"].ndarray
        if any(x is not None and x.__class__ is not nd for x in given):
            return None
        key += tuple(None if x is None else layout(x) for x in given)
    hash(key)
    return key + (None if block_mask is None else id(block_mask),)


class FastModified:
    """A cached call with modifiers (:func:`modifiers_key`): the plan, the call's validated
    ``Modifiers`` without the call's own arrays (the same for every call of this key) and the
    shapes of what the call returns. Forward: ``(q, k, v, return_lse)``, with the modifier
    arrays of the call (:meth:`usable`); backward: ``(do, q, k, v, o, lse)``, array-free
    modifiers only.

    A forward plan of one launch at offset 0 is launched directly, with the modifiers' pointer
    words fixed for the key (a block mask's lists, the captured arrays a user function reads)
    in ``_extra``, computed once (the lists are kept with the block mask, the captured arrays by
    the functions the key holds), and the call's bias, mask, slopes and sink patched a call. A
    backward plan whose gradients need no broadcast sum, with lse contiguous, is launched the
    same way (``BackwardPlan.run_modified``)."""
    __slots__ = ("plan", "mods", "device_id", "shapes", "dtypes", "_empty", "_launch", "_extra",
                 "_stream", "_arrays")

    def __init__(self, plan, mods, outputs, forward: bool = False):
        self.plan, self.mods, self.device_id = plan, mods, plan.device_id
        self.shapes = tuple(x.shape for x in outputs)
        self.dtypes = tuple(x.dtype for x in outputs)
        cupy = sys.modules["cupy"]
        self._empty, self._stream = cupy.empty, cupy.cuda.get_current_stream
        self._launch = self._extra = None
        self._arrays = ()
        if forward and one_launch(plan):
            self._launch = plan.launch
        elif not forward and direct_backward(plan):
            self._launch = plan.run_modified
        if self._launch is not None:
            # the words fixed for the key (a block mask's lists, captured arrays); the call's
            # own arrays (bias, mask, slopes, sink; the backward's slopes and mask: :meth:`usable`)
            # patched a call, each as (word, index in ARRAY_MODIFIERS)
            self._extra = tuple(plan.mods.words([], mods))
            self._arrays = tuple((plan.mods.word[n], ARRAY_MODIFIERS.index(n))
                                 for n in plan.mods.names)
            if self._arrays:   # the entry keeps no array of a call (a bias can be GBs), but
                import dataclasses  # keeps the functions and the block mask: its key names
                self.mods = dataclasses.replace(   # them by identity, which must stay unused
                    mods, alibi_slopes=None, sink=None, bias=None, mask=None)

    @staticmethod
    def usable(plan, mods, forward: bool) -> bool:
        """Whether a call of these modifiers may have an entry: one with arrays of its own
        (the forward's bias, mask, slopes, sink; the backward's slopes and mask, which have no
        gradient: a bias's and a sink's are made on the general path) only where it is launched
        directly and its slopes and sink are in the accumulation type already (the kernel
        reads them as they are; a conversion a call stays on the general path)."""
        if not mods.features.intersection(ARRAY_MODIFIERS):
            return True
        direct = one_launch(plan) if forward else (
            direct_backward(plan) and mods.bias is None and mods.sink is None)
        return direct and all(getattr(mods, n) is None or getattr(mods, n).dtype == plan.mods.acc
                              for n in ("alibi_slopes", "sink"))

    def forward(self, q, k, v, return_lse: bool, arrays=()):
        """``arrays``: the call's ARRAY_MODIFIERS, of the key's layouts."""
        (so, sl), (do_, dl), empty = self.shapes, self.dtypes, self._empty
        o, lse = empty(so, do_), empty(sl, dl)
        if self._launch is not None:
            extra = self._extra
            if self._arrays:
                extra = extra + tuple((w, arrays[i].data.ptr) for w, i in self._arrays)
            self._launch(self._stream().ptr, [q.data.ptr, k.data.ptr, v.data.ptr, o.data.ptr,
                                              lse.data.ptr], extra=extra)
        else:
            self.plan(q, k, v, o, lse, self.mods)
        return (o, lse) if return_lse else o

    def backward(self, do, q, k, v, o, lse, arrays=()):
        """``arrays``: the call's ARRAY_MODIFIERS, of the key's layouts (slopes and mask only)."""
        empty = self._empty
        dq, dk, dv = (empty(s, t) for s, t in zip(self.shapes, self.dtypes))
        if self._launch is not None:
            extra = self._extra
            if self._arrays:
                extra = extra + tuple((w, arrays[i].data.ptr) for w, i in self._arrays)
            self._launch(self._stream().ptr, do.data.ptr, q.data.ptr, k.data.ptr, v.data.ptr,
                         o.data.ptr, lse.data.ptr, dq.data.ptr, dk.data.ptr, dv.data.ptr, extra)
        else:
            self.plan(do, q, k, v, o, lse, dq, dk, dv, self.mods, {})
        return dq, dk, dv
