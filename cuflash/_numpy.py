"""The CPU path: FlashAttention-2's forward (Algorithm 1) and backward (Algorithm 2) in NumPy.

The same tiling as the CUDA kernels, sized for a CPU: query rows in blocks of ``block_m``,
keys and values in blocks of ``block_n``, large enough that each ``Q_i K_j^T`` and ``P_ij V_j``
is a BLAS-sized matrix product, small enough that the score tile stays in cache (about
:data:`TILE_ELEMENTS` scores). The Lq x Lk score matrix never exists.

Work is split into independent tasks (a group of batch items, and in the forward pass a block
of query rows) run on a thread pool of :data:`THREADS` threads: NumPy releases the GIL in its
element-wise loops and in BLAS, so the exponentials, which NumPy runs on one core, use every
core. Small problems run inline. Within a task everything is vectorised NumPy over the task's
batch items and tile rows; no operation mixes rows or batch items, so NaN or Inf stays in the
row or item where it appears.

Accumulation dtype: float32 for float16, bfloat16 and float32 inputs; float64 for float64.

Modifiers (DESIGN.md "Modifiers") enter through ``cuflash._pipeline.ScorePipeline``, which the
float64 reference runs too: the key tiles a query tile visits (causal and window skip the rest,
so a window of w costs O(L w)), the scores of a tile through softcap, ALiBi, bias, score_mod and
the masks, the start of the online softmax (the sink: ``m = sink, l = 1``) and the backward of
the score transform (dbias, dsink). Without modifiers the code below runs as it always did.
With a ``bias`` the backward runs its tasks one after another (they add into one dbias).

Memory beyond the results: per running task one score tile (``block_m x block_n``, times the
task's batch items) and its row statistics; the forward keeps an accumulation-dtype copy of the
task's query block; the backward keeps accumulation-dtype buffers of dq, dk, dv (of the
broadcast batch shape, before the sum over broadcast dimensions), D and the scaled q of the
running tasks' items: O(batch * L * d), as on the GPU.
"""

from __future__ import annotations

import concurrent.futures
import math
import os
from typing import Callable, Iterable

import numpy

from cuflash import _blas, _modifiers, _pipeline, _problem
from cuflash._modifiers import Modifiers
from cuflash._problem import AttentionProblem

#: Scores in one tile of one task (block_m x block_n x the task's batch items): 2^18 float32
#: scores are 1 MiB, which stays in a core's L2 cache on current CPUs.
TILE_ELEMENTS = 1 << 18
#: Most keys in one tile: longer key tiles barely speed up the products.
MAX_BLOCK_N = 512
#: Threads for the tasks; None means every CPU this process may run on.
THREADS: int | None = None
#: Problems with fewer scores (batch * Lq * Lk) than this run inline, without threads.
INLINE_SCORES = 1 << 20
#: The backward of fewer batch groups than this splits the keys into this many ranges, each
#: task with its own dq buffer (summed in range order: the result depends on the shape only).
KEY_SPLITS = 4


def _threads() -> int:
    if THREADS is not None:
        return max(1, int(THREADS))
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def _run(tasks: Iterable[Callable[[], None]], inline: bool) -> None:
    """Run the tasks: on a thread pool with single-threaded BLAS where BLAS's threads can be
    set (cuflash._blas), else inline, leaving the parallelism to BLAS."""
    tasks = list(tasks)
    workers = 1 if inline else min(_threads(), len(tasks))
    # BLAS on one thread always (where it can be set), so that results never depend on how
    # many threads ran: the same inputs give bitwise the same outputs on any thread count.
    with _blas.single_threaded() as single:
        if workers <= 1 or not single:
            for task in tasks:
                task()
            return
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            for future in [pool.submit(task) for task in tasks]:
                future.result()  # re-raises a task's exception here


def _batch_groups(batch_shape: tuple[int, ...], scores_per_item: int) -> list[tuple]:
    """Index tuples over leading batch axes; each selects a group of batch items for a task.

    Items are grouped (the trailing batch axes stay vectorised) while a group's work stays
    below a few tiles, so that many tiny problems do not cost a Python loop each.
    """
    items_per_task = max(1, 4 * TILE_ELEMENTS // max(1, scores_per_item))
    axes = len(batch_shape)
    while axes > 0 and math.prod(batch_shape[axes - 1:]) <= items_per_task:
        axes -= 1
    return list(numpy.ndindex(batch_shape[:axes]))


def _tiles(items: int, Lq: int, Lk: int, block_m: int | None,
           block_n: int | None) -> tuple[int, int]:
    bn = block_n or max(1, min(Lk, MAX_BLOCK_N))
    bm = block_m or max(1, min(Lq, TILE_ELEMENTS // (items * bn)))
    return bm, bn


def _causal_mask(i0: int, i1: int, j0: int, j1: int, offset: int) -> numpy.ndarray:
    """True where key j is hidden from query i: ``j > i + offset``."""
    return numpy.arange(j0, j1)[None, :] > numpy.arange(i0, i1)[:, None] + offset


def _pipeline_of(prob: AttentionProblem, mods: Modifiers | None, acc) -> _pipeline.ScorePipeline:
    if mods is None:
        mods = _modifiers.no_modifiers(prob.batch_shape, prob.Lq, prob.Lk)
    return _pipeline.ScorePipeline(mods, causal=prob.causal, causal_offset=prob.causal_offset,
                                   acc=acc)


def forward(prob: AttentionProblem, o: numpy.ndarray, lse: numpy.ndarray, *,
            mods: Modifiers | None = None, block_m: int | None = None,
            block_n: int | None = None) -> None:
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
        Tile sizes (rows of Q, rows of K and V); default: sized for the cache (module
        docstring). Results agree with any tile sizes up to rounding; tests use small tiles to
        exercise the block boundaries on small inputs.

    Notes
    -----
    Rows that see no key get ``o = 0`` and ``lse = -inf`` (with a sink, ``lse = sink``). Non-finite
    scores propagate as NaN within their row, without floating-point warnings (as on the GPU).
    """
    acc = _problem.accumulation_dtype(prob.dtype).type
    groups = _batch_groups(prob.batch_shape, prob.Lq * prob.Lk)
    items = math.prod(prob.batch_shape[len(groups[0]):]) if groups else 1
    bm, bn = _tiles(items, prob.Lq, prob.Lk, block_m, block_n)
    pipe = _pipeline_of(prob, mods, acc)

    def task(index: tuple, i0: int, i1: int) -> None:
        _forward_rows(prob, acc, prob.q[index], prob.k[index], prob.v[index], o[index],
                      lse[index], i0, i1, bn, _pipeline.restrict(pipe, index))

    tasks = [lambda g=g, i0=i0: task(g, i0, min(i0 + bm, prob.Lq))
             for g in groups for i0 in range(0, prob.Lq, bm)]
    _run(tasks, inline=math.prod(prob.batch_shape) * prob.Lq * prob.Lk < INLINE_SCORES)


def _forward_rows(prob, acc, q, k, v, o, lse, i0: int, i1: int, bn: int, pipe) -> None:
    """Rows i0:i1 of one group of batch items (q, k, v, o, lse indexed by the group)."""
    neg_inf = acc(-numpy.inf)
    batch = q.shape[:-2]
    with numpy.errstate(invalid="ignore", over="ignore"):  # inf - inf in a row with Inf gives NaN
        # -- load Q_i, with the softmax scale folded in (a new array of the accumulation dtype)
        q_i = q[..., i0:i1, :].astype(acc)
        q_i *= acc(prob.scale)
        # -- on chip: O_i = 0, l_i = 0, m_i = -inf (with a sink: m_i = sink, l_i = 1)
        o_i = numpy.zeros(batch + (i1 - i0, prob.dv), acc)
        m_start, l_start = pipe.row_start()
        l_i = numpy.broadcast_to(l_start, batch + (i1 - i0,)).copy()
        m_i = numpy.broadcast_to(m_start, batch + (i1 - i0,)).copy()
        # Keys outside [lo, hi) are hidden from every row by causal (beyond the last row's
        # diagonal) or the window: never visited.
        lo, hi = pipe.key_range(i0, i1)
        for j0 in range(lo - lo % bn, hi, bn):
            j1 = min(j0 + bn, hi)
            j0 = max(j0, lo)
            kind = pipe.tile_kind(i0, i1, j0, j1)   # a block mask may call the tile empty
            if kind == "empty":
                continue
            # -- load K_j, V_j (no copy for inputs of the accumulation dtype)
            k_j = k[..., j0:j1, :].astype(acc, copy=False)
            v_j = v[..., j0:j1, :].astype(acc, copy=False)
            # -- S_ij = Q_i K_j^T (through the modifiers: -inf where a pair is hidden)
            s = q_i @ k_j.swapaxes(-1, -2)
            if pipe.mods.features:
                s = pipe.scores(s, i0, i1, j0, j1, kind=kind)
            elif prob.causal and j1 - 1 > i0 + prob.causal_offset:
                # -- the block crosses the diagonal: mask keys j > i + causal_offset
                numpy.copyto(s, neg_inf, where=_causal_mask(i0, i1, j0, j1, prob.causal_offset))
            # -- m_i^(j) = max(m_i^(j-1), rowmax(S_ij))
            m_new = numpy.maximum(m_i, s.max(axis=-1))
            # A row that has seen no visible key yet has m_new = -inf; subtract 0 instead so
            # that P_ij = exp(-inf) = 0 and the rescale factor is 0, not exp(-inf + inf).
            m_sub = numpy.where(m_new == neg_inf, acc(0), m_new)
            # -- P_ij = exp(S_ij - m_i^(j)), in place
            s -= m_sub[..., None]
            numpy.exp(s, out=s)
            alpha = numpy.exp(m_i - m_sub)  # e^{m_i^(j-1) - m_i^(j)}
            # -- l_i = alpha l_i + rowsum(P_ij);  O_i = diag(alpha) O_i + P_ij V_j
            l_i *= alpha
            l_i += s.sum(axis=-1)
            o_i *= alpha[..., None]
            o_i += s @ v_j
            m_i = m_new
        # -- O_i = diag(l_i)^-1 O_i; L_i = m_i + log(l_i)
        # l_i == 0 exactly when every visible score of the row was -inf, in particular when
        # no key is visible and there is no sink (else its max term added exp(0) = 1): such a
        # row keeps O_i = 0 and gets L_i = -inf.
        no_key = l_i == 0
        l_div = numpy.where(no_key, acc(1), l_i)
        o_i /= l_div[..., None]
        o[..., i0:i1, :] = o_i
        lse[..., i0:i1] = numpy.where(no_key, neg_inf, m_i + numpy.log(l_div))


def backward(prob: AttentionProblem, do: numpy.ndarray, o: numpy.ndarray, lse: numpy.ndarray,
             dq: numpy.ndarray, dk: numpy.ndarray, dv: numpy.ndarray,
             dbias: numpy.ndarray | None = None, dsink: numpy.ndarray | None = None, *,
             mods: Modifiers | None = None, block_m: int | None = None,
             block_n: int | None = None) -> None:
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
        Tile sizes (rows of Q and dO, rows of K and V); default: sized for the cache.

    Notes
    -----
    Tasks are groups of batch items. Within one, the outer loop walks the key tiles
    ``K_j, V_j`` and keeps ``dK_j, dV_j`` on chip; the inner loop walks the query tiles that
    can see them and recomputes ``P_ij = exp(S_ij - L_i)`` from the stored log-sum-exp. ``dQ``
    accumulates across key tiles in an accumulation-dtype buffer.

    A row with no visible key (``lse = -inf``) contributes exactly 0 to every gradient, and its
    dq row is 0: its dO row is treated as 0 (its output is the constant 0, so the true
    gradient through it is 0), and its P and dS are 0 without evaluating exp(-inf + inf).
    """
    acc = _problem.accumulation_dtype(prob.dtype).type
    full = prob.batch_shape
    dq_acc = numpy.empty(full + (prob.Lq, prob.d), acc)
    dk_acc = numpy.empty(full + (prob.Lk, prob.d), acc)
    dv_acc = numpy.empty(full + (prob.Lk, prob.dv), acc)
    do_full = numpy.broadcast_to(do, full + (prob.Lq, prob.dv))
    o_full = numpy.broadcast_to(o, full + (prob.Lq, prob.dv))
    groups = _batch_groups(full, prob.Lq * prob.Lk)
    items = math.prod(full[len(groups[0]):]) if groups else 1
    bm, bn = _tiles(items, prob.Lq, prob.Lk, block_m, block_n)

    # Few groups: split the key tiles into ranges too, so that every thread has work.
    n_tiles = -(-prob.Lk // bn)
    splits = min(KEY_SPLITS, n_tiles) if len(groups) < KEY_SPLITS else 1
    cuts = [min(prob.Lk, (n_tiles * s // splits) * bn) for s in range(splits + 1)]
    ranges = [(a, b) for a, b in zip(cuts, cuts[1:]) if b > a]
    dq_parts = [dq_acc] + [numpy.empty_like(dq_acc) for _ in ranges[1:]]
    pipe = _pipeline_of(prob, mods, acc)
    # dbias: one accumulator of bias's own shape that every task adds into, so tasks run one
    # after another when there is a bias (in a fixed order: the result is deterministic)
    dbias_acc = numpy.zeros(pipe.mods.bias_shape, acc) if pipe.mods.bias is not None else None

    def task(index: tuple, part: int) -> None:
        _backward_items(prob, acc, prob.q[index], prob.k[index], prob.v[index],
                        do_full[index], o_full[index], lse[index], dq_parts[part][index],
                        dk_acc[index], dv_acc[index], bm, bn, ranges[part],
                        _pipeline.restrict(pipe, index),
                        None if dbias_acc is None else
                        _pipeline.group_view(dbias_acc, len(full) + 2, index))

    _run([lambda g=g, r=r: task(g, r) for g in groups for r in range(len(ranges))],
         inline=dbias_acc is not None or math.prod(full) * prob.Lq * prob.Lk < INLINE_SCORES)
    for part in dq_parts[1:]:  # in key order, whatever order the tasks ran in
        dq_acc += part
    dq_acc *= acc(prob.scale)  # -- dQ = tau sum_j dS_ij K_j
    dq[...] = _problem.sum_to_shape(dq_acc, dq.shape, dq.dtype)
    dk[...] = _problem.sum_to_shape(dk_acc, dk.shape, dk.dtype)
    dv[...] = _problem.sum_to_shape(dv_acc, dv.shape, dv.dtype)
    if dbias is not None:
        dbias[...] = dbias_acc.astype(dbias.dtype)
    if dsink is not None:   # -- dsink = -sum_i exp(sink - L_i) D_i, with D_i = rowsum(dO_i o O_i)
        with numpy.errstate(invalid="ignore", over="ignore"):
            D = numpy.einsum("...c,...c->...", do_full.astype(acc, copy=False),
                             o_full.astype(acc, copy=False))
        dsink[...] = pipe.dsink(D, lse.astype(acc, copy=False)).astype(dsink.dtype)


def _backward_items(prob, acc, q, k, v, do, o, lse, dq, dk, dv, bm: int, bn: int,
                    keys: tuple[int, int], pipe, dbias) -> None:
    """The gradients of one group of batch items, for the keys ``keys[0]:keys[1]``, into its
    slices of the accumulators: dk, dv of those keys, and their (unscaled) share of dq."""
    no_key = lse == -numpy.inf                                   # rows with no visible key
    with numpy.errstate(invalid="ignore", over="ignore"):  # inf - inf in a row with Inf: NaN
        # -- Q scaled, dO with the rows of no visible key zeroed, D_i = rowsum(dO_i o O_i)
        q_s = q.astype(acc)
        q_s *= acc(prob.scale)
        do_a = numpy.where(no_key[..., None], acc(0), do.astype(acc, copy=False))
        D = numpy.einsum("...c,...c->...", do_a, o.astype(acc, copy=False))
        # Subtracting +inf for those rows makes their P = exp(s - inf) = 0, never NaN.
        lse_sub = numpy.where(no_key, acc(numpy.inf), lse).astype(acc, copy=False)
        dq[...] = 0
        # -- for 1 <= j <= T_c (this task's key tiles):
        for j0 in range(keys[0], keys[1], bn):
            j1 = min(j0 + bn, keys[1])
            # -- load K_j, V_j; dK_j = 0, dV_j = 0
            k_j = k[..., j0:j1, :].astype(acc, copy=False)
            v_j = v[..., j0:j1, :].astype(acc, copy=False)
            dk_j = dk[..., j0:j1, :]
            dv_j = dv[..., j0:j1, :]
            dk_j[...] = 0
            dv_j[...] = 0
            # Under the causal mask, query rows i < j0 - causal_offset see none of these keys;
            # under a window, rows outside [lo, hi) neither.
            lo, hi = pipe.query_range(j0, j1)
            # -- for 1 <= i <= T_r (the query tiles that see some key of K_j):
            for i0 in range(lo - lo % bm, hi, bm):
                i1 = min(i0 + bm, prob.Lq)
                kind = pipe.tile_kind(i0, i1, j0, j1)   # a block mask may call it empty
                if kind == "empty":
                    continue
                q_i, do_i = q_s[..., i0:i1, :], do_a[..., i0:i1, :]
                # -- S_ij = tau Q_i K_j^T (through the modifiers);  P_ij = exp(S_ij - L_i)
                p = q_i @ k_j.swapaxes(-1, -2)
                saved: dict = {}
                if pipe.mods.features:
                    p = pipe.scores(p, i0, i1, j0, j1, saved, kind)
                elif prob.causal and j1 - 1 > i0 + prob.causal_offset:
                    # -- the tile crosses the diagonal: S = -inf, so P = 0, for keys
                    #    j > i + causal_offset (before exp: a masked score may exceed L_i)
                    numpy.copyto(p, acc(-numpy.inf),
                                 where=_causal_mask(i0, i1, j0, j1, prob.causal_offset))
                p -= lse_sub[..., i0:i1, None]
                numpy.exp(p, out=p)
                # -- dV_j += P_ij^T dO_i
                dv_j += p.swapaxes(-1, -2) @ do_i
                # -- dP_ij = dO_i V_j^T;  dS_ij = P_ij o (dP_ij - D_i), in place
                ds = do_i @ v_j.swapaxes(-1, -2)
                ds -= D[..., i0:i1, None]
                ds *= p
                dead = no_key[..., i0:i1]
                if dead.any():  # 0 * (NaN from a value row) must not reach other rows
                    numpy.copyto(ds, acc(0), where=dead[..., None])
                if pipe.mods.features:
                    # -- back through score_mod and softcap; dbias is dS before softcap's factor
                    ds, ds_bias = pipe.grad_scores(ds, saved, i0, i1, j0, j1)
                    if ds_bias is not None:
                        _pipeline.add_tile_to(dbias, ds_bias, i0, i1, j0, j1)
                # -- dQ_i += dS_ij K_j (tau applied once at the end);  dK_j += dS_ij^T (tau Q_i)
                dq[..., i0:i1, :] += ds @ k_j
                dk_j += ds.swapaxes(-1, -2) @ q_i
