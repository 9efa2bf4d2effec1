"""The public functions: normalise the arguments, validate them, pick a backend, call it.

CuPy calls go through plans (``_plan``): the first call with given shapes, strides, dtypes,
keywords and device validates, dispatches, compiles and packs; the plan is cached under a key
of exactly those, so a repeated call looks the key up, allocates the outputs, patches the
pointers and launches (the fast path below: a few microseconds of host time). Everything the
key does not hold is either checked again on every call (the current device) or cannot change
the outcome of validation and dispatch.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import numpy

from cuflash import _modifiers, _numpy, _problem
from cuflash._fast import FastBackward, FastForward, FastModified, \
    layout as _layout, modifiers_key as _modifiers_key

#: Plans of forward and backward calls (built on first use; see _plan.PlanCache)
_FWD_PLANS = _BWD_PLANS = None
#: cupy.ndarray once a CuPy call has been seen (the fast path tests ``type(x) is _CUPY``)
_CUPY: Any = None
#: the backward fast path's key function (_fast.backward_key; None where CuPy lacks the flag it
#: reads: every backward call then takes the general path, which is correct, only slower) and
#: cupy.cuda.runtime.getDevice, looked up once
bwd_key: Any = None
#: the forward fast path's key function (_fast.forward_key, or forward_key_strides)
_forward_key: Any = None
_get_device: Any = None


def _caches():
    global _FWD_PLANS, _BWD_PLANS, _CUPY, bwd_key, _forward_key, _get_device
    if _FWD_PLANS is None:
        from cuflash import _fast
        from cuflash._plan import PlanCache
        _FWD_PLANS, _BWD_PLANS = PlanCache(), PlanCache()
        nd = sys.modules["cupy"].ndarray
        _get_device = sys.modules["cupy"].cuda.runtime.getDevice
        flag = _fast.has_contiguous_flag(nd)
        bwd_key = _fast.backward_key if flag else None
        _forward_key = _fast.forward_key if flag else _fast.forward_key_strides
        _CUPY = nd   # (last: the fast paths test it first)
    return _FWD_PLANS, _BWD_PLANS


def clear_plans() -> None:
    """Forget every cached plan (lab code: after changing a ``CUFLASH_*`` override, which is
    read when a plan is built, not on every call)."""
    if _FWD_PLANS is not None:
        _FWD_PLANS.clear()
        _BWD_PLANS.clear()
    # attention_with_kvcache's fast path and decode plans (CUFLASH_DECODE), where imported
    for name, cache in (("cuflash._inference", "_FAST"), ("cuflash._inference_gpu", "_PLANS")):
        if name in sys.modules:
            getattr(sys.modules[name], cache).clear()
    if "cuflash._varlen" in sys.modules:      # attention_varlen's one-launch plans
        sys.modules["cuflash._varlen"].clear_plans()


def attention(q: Any, k: Any, v: Any, *, scale: Any = None, causal: Any = False,
              window: Any = None, softcap: Any = None, alibi_slopes: Any = None,
              sink: Any = None, bias: Any = None, mask: Any = None, score_mod: Any = None,
              mask_mod: Any = None, block_mask: Any = None,
              return_lse: bool = False, out: Any = None, enable_gqa: bool = False) -> Any:
    """Exact softmax attention ``softmax(scale * q @ k.T + mask) @ v``, computed tile by tile.

    The Lq x Lk matrix of scores is never materialised: keys are visited in tiles with an
    online softmax (FlashAttention-2). CuPy arrays run CUDA kernels on the device that holds
    them, on CuPy's current stream; NumPy arrays run a blocked CPU implementation of the same
    algorithm, with the same semantics.

    Parameters
    ----------
    q : array, shape (..., Lq, d)
    k : array, shape (..., Lk, d)
    v : array, shape (..., Lk, dv)
        NumPy or CuPy arrays, or any array with ``__dlpack__`` / ``__cuda_array_interface__``
        / ``__array_interface__`` (PyTorch, JAX, Numba, ...), taken without a copy: GPU
        arrays run on the GPU and come back as CuPy, CPU arrays as NumPy
        (``cuflash._interop``).
        One dtype for all three: float16, bfloat16 (``ml_dtypes.bfloat16``), float32 or
        float64. ``1 <= d, dv <= 256``. The leading (batch) dimensions broadcast by NumPy
        rules, so grouped-query attention is ``q (B, Hkv, G, Lq, d)`` with
        ``k, v (B, Hkv, 1, Lk, d)``. Any strides; CuPy inputs must be on one device.
    scale : real number, optional
        Multiplies ``q @ k.T`` before the softmax; finite and positive. Default ``1/sqrt(d)``.
    causal : bool or {'bottom_right', 'top_left'}, optional
        False (default): every query sees every key. True or 'bottom_right': query ``i`` sees
        key ``j`` iff ``j <= i + Lk - Lq`` (aligned to the bottom-right corner, as in
        FlashAttention; right for a KV cache). 'top_left': iff ``j <= i`` (PyTorch's
        ``is_causal``).
    return_lse : bool, optional
        Also return the log-sum-exp of each row of scaled, masked scores.
    out : array, optional
        Where to write the output: same array type (and device) and exactly the dtype of the
        inputs, shape ``batch_shape + (Lq, dv)``, any strides, sharing no element with q, k, v.
    enable_gqa : bool, optional
        Grouped-query attention in the 4-D layout (PyTorch SDPA's name): q ``(..., Hq, Lq, d)``
        with k, v ``(..., Hkv, Lk, d)``, Hq a multiple of Hkv; query head h uses key/value
        head ``h // (Hq // Hkv)``. A zero-copy view of the 5-D broadcast form; o, lse and
        ``out`` have q's 4-D layout.
    window, softcap, alibi_slopes, sink, bias, mask, score_mod, mask_mod, block_mask
        The modifiers of DESIGN.md, applied in this order to each score: softcap
        ``c * tanh(s / c)``; ALiBi ``s -= slope * |i + Lk - Lq - j|`` (``alibi_slopes``
        broadcasting to the batch shape, e.g. ``(H,)``); ``bias`` (a float array broadcasting to
        ``batch_shape + (Lq, Lk)``, read in place; -inf hides a pair); ``score_mod(score, b, h,
        q_idx, kv_idx)``; then the pairs hidden by ``causal``, ``window=(left, right)`` (key j
        visible iff ``i + Lk - Lq - left <= j <= i + Lk - Lq + right``, None unbounded),
        ``mask`` (bool, broadcastable like bias, True = keep), ``mask_mod(b, h, q_idx, kv_idx)``
        (or the one of ``block_mask``, see :func:`cuflash.block_mask`); ``sink`` (broadcasting
        to the batch shape) adds ``exp(sink)`` to each row's denominator (``lse`` includes it;
        a row with no visible key gets ``o = 0`` and ``lse = sink``). ``b`` is the index along
        the first batch dim and ``h`` the flat index over the others (with one batch dim,
        ``b = 0``; with none, both 0; under ``enable_gqa`` the batch shape is the grouped
        ``(..., Hkv, G)``, so ``h`` is the query head and per-head arrays are given as
        ``(..., Hkv, G)``). User functions are written with operators and NumPy functions;
        arrays they read are wrapped with :func:`cuflash.captured`. NumPy inputs run every
        modifier on the CPU path, CuPy inputs on the GPU kernels (every forward family;
        ``attention_backward`` for float16 / bfloat16 with head dims up to 128, anything else
        raises NotImplementedError naming the modifiers before any GPU work).

    Returns
    -------
    o : array, shape batch_shape + (Lq, dv)
        Dtype of the inputs; ``out`` itself when given, else a new C-contiguous array.
    lse : array, shape batch_shape + (Lq,)
        Only with ``return_lse=True``. float32 (float64 for float64 inputs), C-contiguous.

    Notes
    -----
    - A query row that sees no key (``Lk == 0``, or ``causal`` bottom-right with row
      ``i < Lq - Lk``) gets output exactly 0 and ``lse = -inf``, never NaN.
    - NaN or Inf in a query row or a batch item makes that row or item NaN; it never reaches
      other rows or batch items (a key or value shared by broadcasting reaches all that share
      it, as it should).
    - Empty results (``Lq == 0`` or a batch dimension of 0) are returned without any kernel.
    - Copies: this function never copies an input; broadcasting gives stride-0 views. The GPU
      launcher copies only where a kernel needs a layout, and documents where.
    - Results are deterministic: the same inputs give bitwise the same outputs.

    Raises
    ------
    TypeError
        Inputs that are not NumPy/CuPy arrays, NumPy mixed with CuPy, an unsupported or mixed
        dtype, ``out`` of another array type or dtype, ``scale``, ``causal`` or ``return_lse``
        of the wrong type.
    ValueError
        Fewer than 2 dimensions, mismatched head dims or key lengths, a head dim of 0 or above
        256, batch dims that do not broadcast, inputs on different devices, a non-finite or
        non-positive scale, an unknown causal alignment, ``out`` of the wrong shape or
        overlapping an input.
    """
    plain = (window is None and softcap is None and alibi_slopes is None and sink is None
             and bias is None and mask is None and score_mod is None and mask_mod is None
             and block_mask is None)
    if plain and out is None and type(q) is _CUPY and type(k) is _CUPY and type(v) is _CUPY \
            and enable_gqa is False:
        try:
            fast = _FWD_PLANS.get(_forward_key(q, k, v, scale, causal))
        except TypeError:    # an unhashable argument: validation will say what is wrong
            fast = None
        if fast is not None and return_lse.__class__ is bool \
                and _get_device() == fast.device_id:
            return fast(q, k, v, return_lse)
    fast_mods = None   # the key part of the call's modifiers (_fast.FastModified)
    if not plain and _CUPY is None and "cupy" in sys.modules:
        _caches()   # the process's first call: the names below, so that it makes its entry
    if not plain and out is None and type(q) is _CUPY and type(k) is _CUPY \
            and type(v) is _CUPY and enable_gqa is False and return_lse.__class__ is bool:
        try:
            fast_mods = _modifiers_key(window, softcap, alibi_slopes, sink, bias, mask,
                                       score_mod, mask_mod, block_mask, arrays=True)
            fast = None if fast_mods is None else _FWD_PLANS.get(
                _forward_key(q, k, v, scale, causal) + fast_mods)
        except (TypeError, AttributeError):   # unhashable, not a BlockMask, an array not
            fast, fast_mods = None, None      # CuPy's: validation says
        if fast is not None and _get_device() == fast.device_id:
            return fast.forward(q, k, v, return_lse, (alibi_slopes, sink, bias, mask))

    call = _problem.Call(q, k, v, enable_gqa, out=out)  # any framework's arrays; GQA views
    q, k, v, out = call.q, call.k, call.v, call.out
    prob = _problem.make_problem(q, k, v, scale=scale, causal=causal)
    mods = _modifiers.check_modifiers(
        xp=prob.xp, device_id=prob.device_id, batch_shape=prob.batch_shape, Lq=prob.Lq,
        Lk=prob.Lk, window=window, softcap=softcap, alibi_slopes=alibi_slopes, sink=sink,
        bias=bias, mask=mask, score_mod=score_mod, mask_mod=mask_mod, block_mask=block_mask)
    _problem.check_return_lse(return_lse)
    if out is not None:
        _problem.check_out(prob, out)
    if prob.xp is not numpy:
        _modifiers.check_gpu_support(mods, "attention")

    xp = prob.xp
    with _problem.device_scope(prob):
        o = xp.empty(prob.batch_shape + (prob.Lq, prob.dv), prob.dtype) if out is None else out
        lse = xp.empty(prob.batch_shape + (prob.Lq,), prob.lse_dtype)
        if o.size == 0:
            pass  # Lq == 0 or a batch dimension of 0: nothing to compute
        elif prob.Lk == 0:
            o[...] = 0  # every row sees no key
            lse[...] = -numpy.inf if mods.sink is None else mods.sink[..., None]
        elif xp is numpy:
            _numpy.forward(prob, o, lse, mods=mods)
        else:
            _gpu_forward(prob, q, k, v, scale, causal, o, lse, out is None, mods, fast_mods)
    return (call.output(o), call.lse_out(lse)) if return_lse else call.output(o)


def _mods_key(mods) -> tuple:
    """What a plan depends on in the modifiers: their values and their arrays' layouts."""
    if not mods.features:
        return ()
    # (bias_shape: a bias and its expanded view look alike broadcast; only one dbias is summed)
    key = ("mods", mods.window, mods.softcap, mods.bias_shape) + tuple(
        None if x is None else _layout(x)
        for x in (mods.bias, mods.mask, mods.alibi_slopes, mods.sink))
    if mods.block_mask is not None:   # its tile sizes and counts are packed into the plan
        key += (mods.block_mask.block, mods.block_mask.kind.shape)
    if mods.score_mod is not None or mods.mask_mod is not None:
        # the traced functions (their struct names hash the traces) and the layouts of the
        # arrays they read (packed into the plan; their pointers are patched per call)
        from cuflash._variant import traces_of
        for t in traces_of(mods):
            if t is not None:
                key += (t.struct_name,) + tuple(
                    (c.array.shape, c.array.strides, c.array.dtype) for c in t.captures)
    return key


def _gpu_forward(prob, q, k, v, scale, causal, o, lse, cacheable: bool, mods=None,
                 fast_mods=None) -> None:
    """The slow path of a CuPy forward: the plan from the cache (or built), run on arrays;
    then the fast path's entry (``FastForward``; ``FastModified``, ``fast_mods`` its key)."""
    fwd, _ = _caches()
    from cuflash._plan import ForwardPlan
    mkey = _mods_key(mods) if mods is not None else ()
    layout_key = (_layout(prob.q), _layout(prob.k), _layout(prob.v), _layout(o), prob.scale,
                  prob.causal_offset if prob.causal else None) + mkey
    plan = fwd.get_or_build(("plan",) + layout_key, lambda: ForwardPlan(prob, o, lse, mods))
    plan(prob.q, prob.k, prob.v, o, lse, mods)
    if not cacheable or plan.copies or not all(type(x) is _CUPY for x in (q, k, v)):
        return
    key = _forward_key(q, k, v, scale, causal)
    if not mkey:
        fwd.put(key, FastForward(plan, o, lse))
    elif fast_mods is not None and FastModified.usable(plan, mods, forward=True):
        fwd.put(key + fast_mods, FastModified(plan, mods, (o, lse), forward=True))


def attention_backward(do: Any, q: Any, k: Any, v: Any, o: Any, lse: Any, *, scale: Any = None,
                       causal: Any = False, window: Any = None, softcap: Any = None,
                       alibi_slopes: Any = None, sink: Any = None, bias: Any = None,
                       mask: Any = None, score_mod: Any = None, mask_mod: Any = None,
                       block_mask: Any = None, deterministic: bool = False,
                       enable_gqa: bool = False) -> tuple[Any, ...]:
    """Gradients of :func:`attention` with respect to q, k and v (FlashAttention-2 backward).

    Only ``o`` and ``lse`` of the forward pass are needed: the attention probabilities are
    recomputed tile by tile from ``lse``, and the Lq x Lk matrix is never materialised.

    Parameters
    ----------
    do : array, shape batch_shape + (Lq, dv)
        The gradient of the loss with respect to the output ``o``. Dtype of the inputs, any
        strides.
    q, k, v : arrays
        The inputs of the forward call, with its rules (see :func:`attention`).
    o, lse : arrays
        What ``attention(q, k, v, ..., return_lse=True)`` returned for the same arguments:
        ``o`` of shape ``batch_shape + (Lq, dv)`` in the inputs' dtype (any strides), ``lse``
        of shape ``batch_shape + (Lq,)`` in float32 (float64 for float64 inputs).
    scale, causal, window, softcap, alibi_slopes, sink, bias, mask, score_mod, mask_mod, block_mask
        As for :func:`attention`; must be those of the forward call.
    enable_gqa : bool, optional
        As for :func:`attention`: q, do, o ``(..., Hq, L, ·)``, lse ``(..., Hq, Lq)`` with k, v
        ``(..., Hkv, Lk, ·)``; dk, dv come back in k's and v's shapes (summed over each
        group's query heads).
    deterministic : bool, optional
        False (default): on the GPU, the key tiles add their dq contributions with atomics, so
        dq may differ in the last bits from run to run. True: bitwise-reproducible results,
        run to run. The CPU path is always deterministic.

    Returns
    -------
    dq, dk, dv : arrays of the inputs' dtype, shapes ``q.shape``, ``k.shape``, ``v.shape``
        New C-contiguous arrays. The gradient of a broadcast input is summed over the
        dimensions broadcasting added (NumPy/JAX semantics): for grouped-query attention,
        ``q (B, Hkv, G, Lq, d)`` with ``k, v (B, Hkv, 1, Lk, d)``, dk and dv are summed over
        the group axis. Sums run in the accumulation dtype (float32, float64 for float64) and
        are rounded once.

    Notes
    -----
    - A query row with no visible key (``lse = -inf``) contributes exactly 0 to every
      gradient and gets a zero dq row, never NaN (its output is the constant 0).
    - Empty problems (``Lq == 0``, ``Lk == 0`` or a batch dimension of 0) return zeros
      without running a backend.
    - GPU memory beyond the outputs: float32 (float64) buffers for D = rowsum(dO * O)
      (``batch_shape + (Lq,)``), dq (``batch_shape + (Lq, d)``), and dk, dv per broadcast
      batch item (``batch_shape + (Lk, d)``, ``batch_shape + (Lk, dv)``) before they are summed
      over broadcast dimensions, so grouped-query attention does materialise per-group dk, dv
      there (summing inside the kernel is future work). ``deterministic=True``: on the
      tensor-core kernel (float16/bfloat16, head dims up to 128, sm_80+) one int32 counter per
      (batch item, 64 query rows), which orders the key tiles' additions to dq; on the generic
      kernel a buffer of ``ceil(Lk / BLOCK_N) * prod(batch_shape) * Lq * d`` accumulator
      values (one partial dq per key tile, summed in key-tile order afterwards), which grows
      with Lq * Lk: see ``cuflash._plan.BackwardPlan``. The tensor-core kernel copies q, k, v or do
      whose rows are not contiguous and 16-byte aligned (as the forward does). ``lse`` is
      copied if it is not C-contiguous (it is small).
    - The CPU path (NumPy inputs) runs the same blocked algorithm; its extra memory is the
      dq and D buffers plus one pair of tiles.

    Raises
    ------
    TypeError, ValueError
        Everything :func:`attention` raises for q, k, v, scale and causal; a ``do``, ``o`` or
        ``lse`` that is not an array of the inputs' type (TypeError), of the wrong dtype
        (TypeError), of the wrong shape or on another device (ValueError); a
        ``deterministic`` that is not a bool (TypeError).
    """
    plain = (window is None and softcap is None and alibi_slopes is None and sink is None
             and bias is None and mask is None and score_mod is None and mask_mod is None
             and block_mask is None)
    if plain and type(q) is _CUPY and type(do) is _CUPY and deterministic.__class__ is bool \
            and enable_gqa is False and bwd_key is not None:
        try:
            fast = _BWD_PLANS.get(bwd_key(do, q, k, v, o, lse, scale, causal, deterministic))
        except (TypeError, AttributeError):   # unhashable, or not CuPy: validation says
            fast = None
        if fast is not None:
            if _get_device() == fast.device_id:
                return fast(do, q, k, v, o, lse)
    fast_mods = None   # the key part of the modifiers (_fast.FastModified; no bias or sink)
    if not plain and _CUPY is None and "cupy" in sys.modules:
        _caches()   # (attention's first call)
    if not plain and type(q) is _CUPY and type(do) is _CUPY and deterministic.__class__ is bool \
            and enable_gqa is False and bwd_key is not None:
        try:
            fast_mods = _modifiers_key(window, softcap, alibi_slopes, sink, bias, mask, score_mod,
                                       mask_mod, block_mask, arrays=sink is None and bias is None)
            fast = None if fast_mods is None else _BWD_PLANS.get(
                bwd_key(do, q, k, v, o, lse, scale, causal, deterministic) + fast_mods)
        except (TypeError, AttributeError):   # unhashable, not CuPy, not a BlockMask
            fast, fast_mods = None, None
        if fast is not None and _get_device() == fast.device_id:
            return fast.backward(do, q, k, v, o, lse, (alibi_slopes, sink, bias, mask))

    call = _problem.Call(q, k, v, enable_gqa, do=do, o=o, lse=lse)
    q, k, v, do, o, lse = call.q, call.k, call.v, call.do, call.o, call.lse
    prob = _problem.make_problem(q, k, v, scale=scale, causal=causal)
    mods = _modifiers.check_modifiers(
        xp=prob.xp, device_id=prob.device_id, batch_shape=prob.batch_shape, Lq=prob.Lq,
        Lk=prob.Lk, window=window, softcap=softcap, alibi_slopes=alibi_slopes, sink=sink,
        bias=bias, mask=mask, score_mod=score_mod, mask_mod=mask_mod, block_mask=block_mask)
    _problem.check_backward_inputs(prob, do, o, lse)
    _problem.check_deterministic(deterministic)
    if prob.xp is not numpy:
        _modifiers.check_gpu_support(mods, "attention_backward", prob.dtype,
                                     max(prob.d, prob.dv))

    xp = prob.xp
    with _problem.device_scope(prob):
        # dbias, dsink (DESIGN.md's order after dq, dk, dv), zero where nothing is computed
        extra = tuple(xp.zeros(shape, dtype) for shape, dtype in
                      ((mods.bias_shape, mods.bias_dtype), (mods.sink_shape, mods.sink_dtype))
                      if shape is not None)
        if 0 in prob.batch_shape or prob.Lq == 0 or prob.Lk == 0:
            # nothing to compute: no query sees a key, or there is nothing to differentiate
            return call.gradients(*(xp.zeros(x.shape, prob.dtype) for x in (q, k, v))) + extra
        dq = xp.empty(q.shape, prob.dtype)
        dk = xp.empty(k.shape, prob.dtype)
        dv = xp.empty(v.shape, prob.dtype)
        if xp is numpy:
            _numpy.backward(prob, do, o, lse, dq, dk, dv,
                            dbias=extra[0] if mods.bias is not None else None,
                            dsink=extra[-1] if mods.sink is not None else None, mods=mods)
            return call.gradients(dq, dk, dv) + extra
        else:
            _gpu_backward(prob, do, o, lse, dq, dk, dv, bool(deterministic),
                          (do, q, k, v, o, lse, scale, causal, deterministic), mods,
                          {"dbias": extra[0] if mods.bias is not None else None,
                           "dsink": extra[-1] if mods.sink is not None else None}, fast_mods)
    return call.gradients(dq, dk, dv) + extra


def _gpu_backward(prob, do, o, lse, dq, dk, dv, deterministic: bool, raw, mods=None,
                  extra_grads=None, fast_mods=None) -> None:
    _, bwd = _caches()
    from cuflash._plan import BackwardPlan
    mkey = _mods_key(mods) if mods is not None else ()
    # (and the gradients' sizes: an input that broadcasts and its expanded stride-0 view look
    # alike as prob.v, but only the first's gradient is summed: dq/dk/dv_direct of the plan)
    key = ("plan", _layout(do), _layout(prob.q), _layout(prob.k), _layout(prob.v), _layout(o),
           _layout(lse), prob.scale, prob.causal_offset if prob.causal else None,
           deterministic, dq.size, dk.size, dv.size) + mkey
    plan = bwd.get_or_build(key, lambda: BackwardPlan(prob, do, o, lse, dq, dk, dv,
                                                      deterministic, mods))
    plan(do, prob.q, prob.k, prob.v, o, lse, dq, dk, dv, mods, extra_grads)
    rdo, rq, rk, rv, ro, rlse, scale, causal, det = raw
    if plan.copies or not all(type(x) is _CUPY for x in (rdo, rq, rk, rv, ro, rlse)) \
            or det.__class__ is not bool or bwd_key is None:
        return
    key = bwd_key(rdo, rq, rk, rv, ro, rlse, scale, causal, det)
    if not mkey:
        bwd.put(key, FastBackward(plan, dq, dk, dv))
    elif fast_mods is not None and FastModified.usable(plan, mods, forward=False):
        bwd.put(key + fast_mods, FastModified(plan, mods, (dq, dk, dv)))   # (no bias or sink)


def attention_vjp(q: Any, k: Any, v: Any, *, scale: Any = None, causal: Any = False,
                  deterministic: bool = False, enable_gqa: bool = False,
                  **modifiers: Any) -> tuple[Any, Any]:
    """The forward pass and its pullback: ``o, pullback = attention_vjp(q, k, v)``.

    ``o`` is ``attention(q, k, v, scale=scale, causal=causal)``; ``pullback(do)`` returns
    ``(dq, dk, dv)`` as :func:`attention_backward` does for that ``do``, using the ``o`` and
    log-sum-exp of this forward pass (kept by the pullback; nothing else is stored). The
    pullback may be called any number of times. Arguments are validated here, before the
    forward pass runs; ``do`` is validated when the pullback is called.
    """
    _problem.check_deterministic(deterministic)
    _modifiers.check_keywords(modifiers, "attention_vjp")
    o, lse = attention(q, k, v, scale=scale, causal=causal, return_lse=True,
                       enable_gqa=enable_gqa, **modifiers)

    def pullback(do: Any) -> tuple[Any, ...]:
        return attention_backward(do, q, k, v, o, lse, scale=scale, causal=causal,
                                  deterministic=deterministic, enable_gqa=enable_gqa,
                                  **modifiers)

    return o, pullback


def explain(q: Any, k: Any, v: Any, *, scale: Any = None, causal: Any = False,
            backward: bool = False, deterministic: bool = False, device: Any = None,
            enable_gqa: bool = False, **modifiers: Any) -> str:
    """Which kernel a call would run, with which tiles, and why: the dispatcher's reasoning.

    ``q, k, v`` are arrays (NumPy or CuPy; only their shapes and dtypes matter) with the
    keywords of :func:`attention`. ``device``: a CUDA device id, a profile name (``"h200"``,
    ``"h100"``, ``"a100"``, ``"l40s"``, ``"v100"``) or None (the device holding CuPy inputs, else
    the H200 profile). With ``backward=True`` it explains :func:`attention_backward` (with
    ``deterministic``). Nothing is compiled or launched; no GPU is needed for a profile.
    ``python -m cuflash info --explain 4,16,1024,128`` prints the same. Modifier keywords
    are validated; the text names them, shows the CUDA source traced from ``score_mod`` /
    ``mask_mod``, then the kernel chosen for them (its Variant is in the name expression), or
    what the GPU path lacks. (A plan may still fall back at its first call where the chosen
    build spills on the real device: ``_spills``; this reads the tables only.)
    """
    from cuflash import _families
    from cuflash._plan import explain_choice
    call = _problem.Call(q, k, v, enable_gqa)
    prob = _problem.make_problem(call.q, call.k, call.v, scale=scale, causal=causal)
    _modifiers.check_keywords(modifiers, "explain")
    mods = _modifiers.check_modifiers(xp=prob.xp, device_id=prob.device_id,
                                      batch_shape=prob.batch_shape, Lq=prob.Lq, Lk=prob.Lk,
                                      **modifiers)
    what, dmax = ("attention_backward" if backward else "attention"), max(prob.d, prob.dv)
    if mods.features and _modifiers.gpu_missing(mods, what, prob.dtype, dmax):
        return _modifiers.explain(mods, what, prob.dtype, dmax)   # (it names what is missing)
    _problem.check_deterministic(deterministic)
    if device is None:
        device = prob.device_id if prob.device_id is not None else "h200"
    if isinstance(device, str):
        try:
            dev = _families.PROFILES[device.lower()]
        except KeyError:
            raise ValueError(f"unknown device profile {device!r}; known: "
                             f"{', '.join(_families.PROFILES)}") from None
    elif isinstance(device, int) and not isinstance(device, bool):
        dev = _families.device_info(device)
    else:
        raise TypeError(f"device must be a profile name, a device id or None, got {device!r}")
    pre = _modifiers.explain(mods, what, prob.dtype, dmax) + "\n" if mods.features else ""
    try:
        shape = _families.Shape.of(prob, bool(deterministic), mods if mods.features else None)
        choice = _families.choose("bwd" if backward else "fwd", shape, dev)
    except (TypeError, ValueError) as exc:   # (a function that cannot be traced: pre says
        if not pre:                            # so; no family runs these modifiers here)
            raise
        return pre.rstrip("\n") if isinstance(exc, TypeError) else pre + str(exc)
    t = choice.traits
    blocks = shape.nbatch * (-(-prob.Lk // t.block_n) if backward else -(-prob.Lq // t.block_m))
    head = (f"{what}: q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}, {prob.dtype}, "
            f"{'causal ' + ('bottom-right' if prob.causal_offset == prob.Lk - prob.Lq else 'top-left') if prob.causal else 'not causal'}"
            f"{', deterministic' if deterministic and backward else ''}; on {dev.name or dev.arch} "
            f"(sm_{dev.cc}, {dev.num_sms} SMs)")
    text = pre + head + "\n" + explain_choice(choice, blocks)
    if backward:    # dq is the result itself unless q is broadcast (its gradient then summed)
        q_whole = math.prod(prob.batch_shape) * prob.Lq * prob.d == math.prod(q.shape)
        fused = _families.fuse_dq_finish(choice, q_whole, 1)
        text += ("\ndQ rounded by the main kernel (no bwd_finish_dq launch)" if fused
                 else "\ndQ rounded by bwd_finish_dq")
    return text
