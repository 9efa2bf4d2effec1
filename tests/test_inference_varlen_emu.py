"""The one-launch varlen forward (cuflash/_inference_varlen.py): fwd_sm80's varlen build (the
source with CUFLASH_VARLEN defined) run on the CPU by the g++ emulation of tests/_emu_sm80.py,
launched with the very work list and parameter block the GPU path makes, against the float64
reference per sequence: empty sequences, sequences with queries and no keys, GQA broadcasting,
causal (both alignments), lengths that are not multiples of the tiles. ``slow`` (the first run
compiles fwd_sm80 with g++, ~30 s); the host-side pieces (work list, the tile choice) have
fast tests in tests/test_inference_varlen.py."""

from __future__ import annotations

import ml_dtypes
import numpy
import pytest

from cuflash import _families, _inference_varlen, _launch, _problem, reference
from _tolerance import assert_attention_close

import _emu_sm80

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not _emu_sm80.available(), reason="needs g++")]

BF16 = numpy.dtype(ml_dtypes.bfloat16)
A100 = _families.PROFILES["a100"]

#: (dtype, lengths q, lengths k, d, causal, heads (Hq, Hkv))
CASES = [
    (BF16, [64, 0, 130, 1, 77], [64, 5, 0, 200, 77], 64, False, (4, 2)),
    (BF16, [33, 100, 7], [33, 150, 3], 64, True, (2, 1)),
    (numpy.dtype(numpy.float16), [90, 17], [40, 17], 128, "top_left", (2, 2)),
]


def _inputs(case, seed=0):
    dtype, lq, lk, d, causal, (hq, hkv) = case
    rng = numpy.random.default_rng(seed)
    cu_q = numpy.concatenate([[0], numpy.cumsum(lq)]).astype(numpy.int32)
    cu_k = numpy.concatenate([[0], numpy.cumsum(lk)]).astype(numpy.int32)
    q = rng.standard_normal((hkv, hq // hkv, cu_q[-1], d)).astype(dtype)
    k = rng.standard_normal((hkv, 1, cu_k[-1], d)).astype(dtype)
    v = rng.standard_normal((hkv, 1, cu_k[-1], d)).astype(dtype)
    return q, k, v, cu_q, cu_k


def _run(case):
    q, k, v, cu_q, cu_k = _inputs(case)
    causal = case[4]
    prob = _problem.make_problem(q, k, v, scale=None, causal=bool(causal))
    fam, t, expr, reasons = _inference_varlen.choose(prob, A100)
    assert fam.name == "fwd_sm80" and "false>" in expr.split("Variant")[1]   # never EVEN
    lib = _emu_sm80.build("fwd_sm80.cu", [("fwd", expr)],
                          kernel_text=_inference_varlen.VARLEN_DEFINE
                          + (_emu_sm80.cuda_src_dir() / "fwd_sm80.cu").read_text())
    wl = _inference_varlen.work_list(cu_q, cu_k, t.block_m, causal)
    o = numpy.full(prob.batch_shape + (prob.Lq, prob.dv), numpy.nan, prob.dtype)
    lse = numpy.full(prob.batch_shape + (prob.Lq,), numpy.nan, numpy.float32)
    qb, kb, vb = (numpy.broadcast_to(x, prob.batch_shape + x.shape[-2:]) for x in (q, k, v))
    p, layout = _inference_varlen.params(prob, {"q": qb, "k": kb, "v": vb, "o": o}, wl.shape[0])
    for name, x in (("q", q), ("k", k), ("v", v), ("o", o), ("lse", lse), ("varlen", wl)):
        p[name] = x.ctypes.data
    lib.launch("fwd", expr, p, layout.inner_n * wl.shape[0], t.threads, t.smem_bytes,
               readable=(q, k, v))
    return (q, k, v, cu_q, cu_k), o, lse


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-d{c[3]}-{c[4]}-{len(c[1])}seq")
def test_varlen_build_of_fwd_sm80_matches_reference_per_sequence(case):
    (q, k, v, cu_q, cu_k), o, lse = _run(case)
    causal = case[4]
    for s in range(len(cu_q) - 1):
        sq, sk = slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])
        if cu_q[s] == cu_q[s + 1]:
            continue
        args = (q[..., sq, :], k[..., sk, :], v[..., sk, :])
        if cu_k[s] == cu_k[s + 1]:          # queries, no keys: 0 and -inf
            assert (o[..., sq, :] == 0).all() and (lse[..., sq] == -numpy.inf).all()
            continue
        prob = _problem.make_problem(*args, scale=None, causal=causal)
        ro, rl = reference.attention(*args, causal=causal, return_lse=True)
        assert_attention_close(prob, o[..., sq, :], lse[..., sq], ro, rl)
    assert not numpy.isnan(o.astype(numpy.float32)).any()   # every packed row was written


#: (dtype, lengths q, lengths k, d, causal, heads): a sequence with queries and no keys, one
#: with keys and no queries (its dK, dV must be written as 0), GQA (dK, dV summed over G)
BWD_CASES = [
    (BF16, [70, 0, 20, 33], [50, 40, 0, 33], 64, True, (2, 1)),
    (numpy.dtype(numpy.float16), [17, 129], [130, 64], 128, False, (2, 2)),
]


@pytest.mark.parametrize("case", BWD_CASES, ids=lambda c: f"{c[0]}-d{c[3]}-{c[4]}")
def test_varlen_build_of_bwd_sm80_matches_reference_per_sequence(case):
    from _tolerance_bwd import assert_gradients_close
    q, k, v, cu_q, cu_k = _inputs(case, seed=3)
    causal = case[4]
    dtype = q.dtype
    # o, lse per sequence from the reference, as the GPU forward returns them
    o = numpy.zeros(q.shape[:-1] + (v.shape[-1],), dtype)
    lse = numpy.full(q.shape[:-1], -numpy.inf, numpy.float32)
    for s in range(len(cu_q) - 1):
        sq, sk = slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])
        if cu_q[s] < cu_q[s + 1] and cu_k[s] < cu_k[s + 1]:
            ro, rl = reference.attention(q[..., sq, :], k[..., sk, :], v[..., sk, :],
                                         causal=causal, return_lse=True)
            o[..., sq, :], lse[..., sq] = ro.astype(dtype), rl
    do = numpy.random.default_rng(4).standard_normal(o.shape).astype(dtype)

    prob = _problem.make_problem(q, k, v, scale=None, causal=bool(causal))
    plain = _families.choose("bwd", _families.Shape.of(prob), A100)
    fam, t, expr, _ = _inference_varlen.choose(prob, A100, plain)
    assert fam.name == "bwd_sm80"
    lib = _emu_sm80.build("bwd_sm80.cu", [("bwd", expr)],
                          kernel_text=_inference_varlen.VARLEN_DEFINE
                          + (_emu_sm80.cuda_src_dir() / "bwd_sm80.cu").read_text())
    wl = _inference_varlen.work_list(cu_q, cu_k, t.block_n, causal, keys=True)
    bs = prob.batch_shape
    qb, kb, vb = (numpy.broadcast_to(x, bs + x.shape[-2:]) for x in (q, k, v))
    D = (do.astype(numpy.float32) * o.astype(numpy.float32)).sum(-1, dtype=numpy.float32)
    D = numpy.ascontiguousarray(numpy.where(lse == -numpy.inf, 0, D), numpy.float32)
    dq_acc = numpy.zeros(bs + (prob.Lq, prob.d), numpy.float32)
    dk_acc = numpy.full(bs + (prob.Lk, prob.d), numpy.nan, numpy.float32)   # all written?
    dv_acc = numpy.full(bs + (prob.Lk, prob.dv), numpy.nan, numpy.float32)
    p, nbatch = _emu_sm80.pack_params(prob, {"q": qb, "k": kb, "v": vb, "o": o, "dout": do},
                                      lse=lse, dpsum=D, dq_acc=dq_acc, dk_acc=dk_acc,
                                      dv_acc=dv_acc, dq_sem=None)
    p["varlen_items"], p["varlen"] = wl.shape[0], wl.ctypes.data
    lib.launch("bwd", expr, p, nbatch * wl.shape[0], t.threads, t.smem_bytes,
               readable=(q, k, v, do))
    assert not numpy.isnan(dk_acc).any() and not numpy.isnan(dv_acc).any()
    grads = [_problem.sum_to_shape(x, shape, dtype)
             for x, shape in zip((dq_acc, dk_acc, dv_acc), (q.shape, k.shape, v.shape))]
    for s in range(len(cu_q) - 1):
        sq, sk = slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])
        if cu_q[s] == cu_q[s + 1] or cu_k[s] == cu_k[s + 1]:   # no pairs: every gradient 0
            assert (grads[0][..., sq, :] == 0).all()
            assert (grads[1][..., sk, :] == 0).all() and (grads[2][..., sk, :] == 0).all()
            continue
        args = (q[..., sq, :], k[..., sk, :], v[..., sk, :])
        ref = reference.attention_backward(do[..., sq, :], *args, causal=causal)
        ps = _problem.make_problem(*args, scale=None, causal=causal)
        assert_gradients_close(ps, do[..., sq, :],
                               (grads[0][..., sq, :], grads[1][..., sk, :], grads[2][..., sk, :]),
                               ref, (args[0].shape, args[1].shape, args[2].shape))
