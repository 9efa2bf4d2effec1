"""The public functions: normalise the arguments, validate them, pick a backend, call it."""

from __future__ import annotations

from typing import Any

import numpy

from cuflash import _numpy, _problem


def attention(q: Any, k: Any, v: Any, *, scale: Any = None, causal: Any = False,
              return_lse: bool = False, out: Any = None) -> Any:
    """Exact softmax attention ``softmax(scale * q @ k.T + mask) @ v``, computed tile by tile.

    The Lq x Lk matrix of scores is never materialised: keys are visited in tiles with an
    online softmax (FlashAttention-2). CuPy arrays run CUDA kernels on the device that holds
    them, on CuPy's current stream; NumPy arrays run a blocked CPU implementation of the same
    algorithm, with the same semantics.

    Parameters
    ----------
    q : numpy.ndarray or cupy.ndarray, shape (..., Lq, d)
    k : array of the same type, shape (..., Lk, d)
    v : array of the same type, shape (..., Lk, dv)
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
        inputs, shape ``batch_shape + (Lq, dv)``, any strides, sharing no memory with q, k, v.

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
    prob = _problem.make_problem(q, k, v, scale=scale, causal=causal)
    _problem.check_return_lse(return_lse)
    if out is not None:
        _problem.check_out(prob, out)

    xp = prob.xp
    with _problem.device_scope(prob):
        o = xp.empty(prob.batch_shape + (prob.Lq, prob.dv), prob.dtype) if out is None else out
        lse = xp.empty(prob.batch_shape + (prob.Lq,), prob.lse_dtype)
        if o.size == 0:
            pass  # Lq == 0 or a batch dimension of 0: nothing to compute
        elif prob.Lk == 0:
            o[...] = 0  # every row sees no key
            lse[...] = -numpy.inf
        elif xp is numpy:
            _numpy.forward(prob, o, lse)
        else:
            from cuflash import _launch  # needs CuPy; imported only for CuPy inputs

            _launch.forward(prob, o, lse)
    return (o, lse) if return_lse else o


def attention_backward(do: Any, q: Any, k: Any, v: Any, o: Any, lse: Any, *, scale: Any = None,
                       causal: Any = False, deterministic: bool = False) -> tuple[Any, Any, Any]:
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
    scale, causal
        As for :func:`attention`; must be those of the forward call.
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
      with Lq * Lk: see ``cuflash._launch_bwd``. The tensor-core kernel copies q, k, v or do
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
    prob = _problem.make_problem(q, k, v, scale=scale, causal=causal)
    _problem.check_backward_inputs(prob, do, o, lse)
    _problem.check_deterministic(deterministic)

    xp = prob.xp
    with _problem.device_scope(prob):
        if 0 in prob.batch_shape or prob.Lq == 0 or prob.Lk == 0:
            # nothing to compute: no query sees a key, or there is nothing to differentiate
            return tuple(xp.zeros(x.shape, prob.dtype) for x in (q, k, v))
        dq = xp.empty(q.shape, prob.dtype)
        dk = xp.empty(k.shape, prob.dtype)
        dv = xp.empty(v.shape, prob.dtype)
        if xp is numpy:
            _numpy.backward(prob, do, o, lse, dq, dk, dv)
        else:
            from cuflash import _launch_bwd  # needs CuPy; imported only for CuPy inputs

            _launch_bwd.backward(prob, do, o, lse, dq, dk, dv, deterministic=bool(deterministic))
    return dq, dk, dv


def attention_vjp(q: Any, k: Any, v: Any, *, scale: Any = None, causal: Any = False,
                  deterministic: bool = False) -> tuple[Any, Any]:
    """The forward pass and its pullback: ``o, pullback = attention_vjp(q, k, v)``.

    ``o`` is ``attention(q, k, v, scale=scale, causal=causal)``; ``pullback(do)`` returns
    ``(dq, dk, dv)`` as :func:`attention_backward` does for that ``do``, using the ``o`` and
    log-sum-exp of this forward pass (kept by the pullback; nothing else is stored). The
    pullback may be called any number of times. Arguments are validated here, before the
    forward pass runs; ``do`` is validated when the pullback is called.
    """
    _problem.check_deterministic(deterministic)
    o, lse = attention(q, k, v, scale=scale, causal=causal, return_lse=True)

    def pullback(do: Any) -> tuple[Any, Any, Any]:
        return attention_backward(do, q, k, v, o, lse, scale=scale, causal=causal,
                                  deterministic=deterministic)

    return o, pullback
