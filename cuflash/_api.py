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
