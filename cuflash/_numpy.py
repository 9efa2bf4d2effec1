"""The CPU path: FlashAttention-2's forward pass (Algorithm 1) in NumPy.

This is the executable specification of the tiling the CUDA kernels implement, not a fast
implementation. Query rows are processed in blocks of ``block_m`` (the outer loop over
``Q_i``), keys and values in blocks of ``block_n`` (the inner loop over ``K_j, V_j``), and
the Lq x Lk score matrix never exists: memory is O(Lq * dv) for the output plus
O(batch * block_m * (d + dv + block_n)) for one block. Every batch item is handled at once by
vectorised NumPy over the broadcast batch dimensions; no operation mixes rows or batch items,
so NaN or Inf stays in the row or item where it appears.

Accumulation dtype: float32 for float16, bfloat16 and float32 inputs; float64 for float64.

Modifiers (DESIGN.md "Modifiers": window, softcap, ALiBi, bias, score_mod, mask, mask_mod,
block_mask, sink) enter through one object, ``cuflash._pipeline.ScorePipeline``, which the float64
reference runs too: it gives the key tiles a query tile visits (causal and window skip the rest,
so a window of w costs O(L w)), the masked scores of a tile, the start of the online softmax
(the sink) and the backward of the score transform. Without modifiers the results are those of
the plain algorithm, bit for bit.
"""

from __future__ import annotations

import numpy

from cuflash import _modifiers, _problem
from cuflash._modifiers import Modifiers
from cuflash._pipeline import ScorePipeline, add_tile_to
from cuflash._problem import AttentionProblem

#: Query rows per block (B_r in the paper).
BLOCK_M = 128
#: Keys per block (B_c in the paper).
BLOCK_N = 128


def _pipeline(prob: AttentionProblem, mods: Modifiers | None,
              acc) -> tuple[ScorePipeline, Modifiers]:
    if mods is None:
        mods = _modifiers.no_modifiers(prob.batch_shape, prob.Lq, prob.Lk)
    pipe = ScorePipeline(mods, causal=prob.causal, causal_offset=prob.causal_offset, acc=acc)
    return pipe, mods


def forward(prob: AttentionProblem, o: numpy.ndarray, lse: numpy.ndarray, *,
            mods: Modifiers | None = None, block_m: int = BLOCK_M,
            block_n: int = BLOCK_N) -> None:
    """Write attention output into ``o`` and log-sum-exp into ``lse``.

    Parameters
    ----------
    prob : AttentionProblem
        A NumPy problem (``prob.xp is numpy``).
    o : numpy.ndarray, shape prob.batch_shape + (Lq, dv), dtype prob.dtype
        Overwritten; any strides.
    lse : numpy.ndarray, shape prob.batch_shape + (Lq,), dtype prob.lse_dtype
        Overwritten.
    mods : Modifiers, optional
        The validated modifiers of the call (``cuflash._modifiers.check_modifiers``).
    block_m, block_n : int, optional
        Tile sizes (rows of Q, rows of K and V). Results agree with any tile sizes up to
        rounding; tests use small tiles to exercise the block boundaries on small inputs.

    Notes
    -----
    Rows that see no key get ``o = 0`` and ``lse = -inf`` (``lse = sink`` with a sink: the sink
    is a key every row sees, with score ``sink`` and value 0, so the online softmax starts at
    ``m = sink, l = 1``). Non-finite scores propagate as
    NaN within their row, without floating-point warnings (as on the GPU).
    """
    acc = numpy.float64 if prob.dtype == numpy.float64 else numpy.float32
    pipe, mods = _pipeline(prob, mods, acc)
    neg_inf = acc(-numpy.inf)
    m_start, l_start = pipe.row_start()
    with numpy.errstate(invalid="ignore"):   # inf - inf in a row with Inf scores gives NaN
        for i0 in range(0, prob.Lq, block_m):
            i1 = min(i0 + block_m, prob.Lq)
            # -- load Q_i, with the softmax scale folded in
            q_i = prob.q[..., i0:i1, :].astype(acc) * acc(prob.scale)
            # -- on chip: O_i = 0, l_i = 0, m_i = -inf (m_i = sink, l_i = 1 with a sink)
            o_i = numpy.zeros(prob.batch_shape + (i1 - i0, prob.dv), acc)
            m_i = numpy.broadcast_to(m_start, prob.batch_shape + (i1 - i0,)).copy()
            l_i = numpy.broadcast_to(l_start, prob.batch_shape + (i1 - i0,)).copy()
            # Keys outside [lo, hi) are hidden from every row by causal / window: not visited.
            lo, hi = pipe.key_range(i0, i1)
            for j0 in range(lo - lo % block_n, hi, block_n):
                j1 = min(j0 + block_n, hi)
                j0 = max(j0, lo)
                kind = pipe.tile_kind(i0, i1, j0, j1)   # a block mask may call it empty
                if kind == "empty":
                    continue
                # -- load K_j, V_j
                k_j = prob.k[..., j0:j1, :].astype(acc)
                v_j = prob.v[..., j0:j1, :].astype(acc)
                # -- S_ij = Q_i K_j^T, through the modifiers; -inf where a pair is hidden
                s_ij = pipe.scores(q_i @ k_j.swapaxes(-1, -2), i0, i1, j0, j1, kind=kind)
                # -- update m_i and l_i
                m_new = numpy.maximum(m_i, s_ij.max(axis=-1))
                # A row that has seen no visible key yet has m_new = -inf; subtract 0 instead
                # so that P_ij = exp(-inf) = 0 and the rescale factor is 0, not exp(-inf + inf).
                m_sub = numpy.where(m_new == neg_inf, 0, m_new)
                p_ij = numpy.exp(s_ij - m_sub[..., None])
                alpha = numpy.exp(m_i - m_sub)  # e^{m_i^(j-1) - m_i^(j)}
                l_i = alpha * l_i + p_ij.sum(axis=-1)
                # -- O_i = diag(e^{m_i^(j-1) - m_i^(j)}) O_i + P_ij V_j
                o_i = alpha[..., None] * o_i + p_ij @ v_j
                m_i = m_new
            # -- O_i = diag(l_i)^-1 O_i; L_i = m_i + log(l_i)
            # l_i == 0 exactly when every visible score of the row was -inf, in particular when
            # no key is visible and there is no sink (else its max term added exp(0) = 1): such
            # a row keeps O_i = 0 and gets L_i = -inf.
            no_key = l_i == 0
            l_div = numpy.where(no_key, 1, l_i)
            o[..., i0:i1, :] = (o_i / l_div[..., None]).astype(prob.dtype)
            lse[..., i0:i1] = numpy.where(no_key, neg_inf, m_i + numpy.log(l_div))


def backward(prob: AttentionProblem, do: numpy.ndarray, o: numpy.ndarray, lse: numpy.ndarray,
             dq: numpy.ndarray, dk: numpy.ndarray, dv: numpy.ndarray,
             dbias: numpy.ndarray | None = None, dsink: numpy.ndarray | None = None, *,
             mods: Modifiers | None = None, block_m: int = BLOCK_M,
             block_n: int = BLOCK_N) -> None:
    """FlashAttention-2's backward pass (Algorithm 2): write the gradients into dq, dk, dv.

    Parameters
    ----------
    prob : AttentionProblem
        A NumPy problem with ``prob.Lq, prob.Lk >= 1``.
    do, o : numpy.ndarray, shape prob.batch_shape + (Lq, dv), dtype prob.dtype
        The gradient of the output and the output of the forward pass; any strides.
    lse : numpy.ndarray, shape prob.batch_shape + (Lq,), dtype prob.lse_dtype
        The log-sum-exp of the forward pass (``-inf`` for rows with no visible key).
    dq, dk, dv : numpy.ndarray of prob.dtype
        Overwritten. Their shapes are those of the *un-broadcast* inputs q, k, v (each
        broadcasts to ``prob.batch_shape + (L, d)``): the gradient of a broadcast input is
        summed over the dimensions broadcasting added, in the accumulation dtype, and rounded
        once.
    dbias, dsink : numpy.ndarray, optional
        Overwritten when the bias, the sink are on: shapes ``mods.bias_shape``,
        ``mods.sink_shape`` (the un-broadcast ones), summed over the dimensions broadcasting
        added in the accumulation dtype and rounded once. ``dsink = -sum_i exp(sink - lse_i) D_i``.
    mods : Modifiers, optional
        The validated modifiers of the call.
    block_m, block_n : int, optional
        Tile sizes (rows of Q and dO, rows of K and V).

    Notes
    -----
    The outer loop walks the key tiles ``K_j, V_j`` and keeps ``dK_j, dV_j`` on chip; the inner
    loop walks the query tiles that can see them and recomputes ``P_ij = exp(S_ij - L_i)``
    from the stored log-sum-exp. ``dQ`` accumulates across key tiles in an accumulation-dtype
    buffer of ``batch_shape + (Lq, d)``. Memory: that buffer, ``D`` (``batch_shape + (Lq,)``)
    and O(batch * (block_m + block_n) * (d + dv) + batch * block_m * block_n) for one pair of
    tiles; the Lq x Lk matrix never exists. ``dK_j, dV_j`` are reduced over broadcast
    dimensions tile by tile, so per-group copies of dK and dV never exist either.

    A row with no visible key (``lse = -inf``) contributes exactly 0 to every gradient, and its
    dq row is 0: its dO row is treated as 0 (its output is the constant 0, so the true
    gradient through it is 0), and its P and dS are 0 without evaluating exp(-inf + inf).
    """
    acc = numpy.float64 if prob.dtype == numpy.float64 else numpy.float32
    pipe, mods = _pipeline(prob, mods, acc)
    scale = acc(prob.scale)
    no_key = lse == -numpy.inf
    # -- D_i = rowsum(dO_i o O_i) (zero for rows with no visible key), one query tile at a time
    D = numpy.empty(prob.batch_shape + (prob.Lq,), acc)
    for i0 in range(0, prob.Lq, block_m):
        i1 = min(i0 + block_m, prob.Lq)
        D[..., i0:i1] = numpy.einsum("...c,...c->...", do[..., i0:i1, :].astype(acc),
                                     o[..., i0:i1, :].astype(acc))
    D[no_key] = 0
    # Subtracting +inf for those rows makes their P = exp(s - inf) = 0, never NaN.
    lse_sub = numpy.where(no_key, acc(numpy.inf), lse).astype(acc)
    dq_acc = numpy.zeros(prob.batch_shape + (prob.Lq, prob.d), acc)
    dbias_acc = numpy.zeros(mods.bias_shape, acc) if mods.bias is not None else None

    with numpy.errstate(invalid="ignore"):  # inf - inf in a row with Inf scores gives NaN
        # -- for 1 <= j <= T_c:
        for j0 in range(0, prob.Lk, block_n):
            j1 = min(j0 + block_n, prob.Lk)
            # -- load K_j, V_j; initialise dK_j = 0, dV_j = 0 on chip
            k_j = prob.k[..., j0:j1, :].astype(acc)
            v_j = prob.v[..., j0:j1, :].astype(acc)
            dk_j = numpy.zeros(prob.batch_shape + (j1 - j0, prob.d), acc)
            dv_j = numpy.zeros(prob.batch_shape + (j1 - j0, prob.dv), acc)
            lo, hi = pipe.query_range(j0, j1)
            # -- for the query tiles that see some key of K_j (causal / window: rows [lo, hi)),
            #    whole tiles from the aligned start (rows outside [lo, hi) are masked)
            for i0 in range(lo - lo % block_m, hi, block_m):
                i1 = min(i0 + block_m, prob.Lq)
                kind = pipe.tile_kind(i0, i1, j0, j1)
                if kind == "empty":
                    continue
                # -- load Q_i (with the softmax scale folded in), dO_i, L_i, D_i
                q_i = prob.q[..., i0:i1, :].astype(acc) * scale
                dead = no_key[..., i0:i1, None]
                do_i = numpy.where(dead, acc(0), do[..., i0:i1, :].astype(acc))
                # -- S_ij = tau Q_i K_j^T through the modifiers (-inf where hidden, before exp:
                #    a masked score may exceed L_i);  P_ij = exp(S_ij - L_i)
                saved: dict = {}
                s_ij = pipe.scores(q_i @ k_j.swapaxes(-1, -2), i0, i1, j0, j1, saved, kind)
                p_ij = numpy.exp(s_ij - lse_sub[..., i0:i1, None])
                # -- dV_j += P_ij^T dO_i
                dv_j += p_ij.swapaxes(-1, -2) @ do_i
                # -- dP_ij = dO_i V_j^T;  dS_ij = P_ij o (dP_ij - D_i)
                dp_ij = do_i @ v_j.swapaxes(-1, -2)
                ds_ij = numpy.where(dead, acc(0), p_ij * (dp_ij - D[..., i0:i1, None]))
                # -- back through softcap / score_mod; dbias is dS before the softcap's factor
                ds_ij, ds_bias = pipe.grad_scores(ds_ij, saved, i0, i1, j0, j1)
                if ds_bias is not None:
                    add_tile_to(dbias_acc, ds_bias, i0, i1, j0, j1)
                # -- dQ_i += tau dS_ij K_j (tau applied once at the end);  dK_j += tau dS_ij^T Q_i
                dq_acc[..., i0:i1, :] += ds_ij @ k_j
                dk_j += ds_ij.swapaxes(-1, -2) @ q_i
            # -- write dK_j, dV_j (summed over the dimensions broadcasting added to k and v)
            dk[..., j0:j1, :] = _problem.sum_to_shape(dk_j, dk.shape[:-2] + (j1 - j0, prob.d),
                                                      dk.dtype)
            dv[..., j0:j1, :] = _problem.sum_to_shape(dv_j, dv.shape[:-2] + (j1 - j0, prob.dv),
                                                      dv.dtype)
    dq[...] = _problem.sum_to_shape(dq_acc * scale, dq.shape, dq.dtype)
    if dbias is not None:
        dbias[...] = dbias_acc.astype(dbias.dtype)
    if dsink is not None:
        dsink[...] = pipe.dsink(D, lse.astype(acc)).astype(dsink.dtype)
