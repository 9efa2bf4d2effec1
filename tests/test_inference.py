"""Inference API on the CPU: merge_states, attention_with_kvcache (dense and paged, append),
attention_varlen (and its vjp), their validation, the decode family's registry entry, its
parameter block, the split heuristic, and the decode kernels themselves run by the g++
emulation (tests/_emu_decode.py)."""

from __future__ import annotations

import ml_dtypes
import numpy
import pytest

from cuflash import _families, _inference, _inference_gpu, _jit, _problem, _varlen, reference
from _tolerance import assert_attention_close

BF16 = numpy.dtype(ml_dtypes.bfloat16)
F16, F32, F64 = (numpy.dtype(t) for t in (numpy.float16, numpy.float32, numpy.float64))
H200 = _families.PROFILES["h200"]


def randn(rng, shape, dtype):
    return rng.standard_normal(shape).astype(dtype)


# ---------------------------------------------------------------------------------------------
# merge_states
# ---------------------------------------------------------------------------------------------

def _parts(rng, cuts, dtype=F64, Lq=7, d=16, batch=(2,)):
    q = randn(rng, batch + (Lq, d), F64)
    k = randn(rng, batch + (cuts[-1], d), F64)
    v = randn(rng, batch + (cuts[-1], d), F64)
    full = reference.attention(q, k, v, return_lse=True)
    parts = [reference.attention(q, k[..., a:b, :], v[..., a:b, :], return_lse=True)
             for a, b in zip(cuts[:-1], cuts[1:])]
    return full, [p[0].astype(dtype) for p in parts], [p[1] for p in parts]


@pytest.mark.parametrize("dtype", [F64, F32, F16, BF16])
def test_merge_states_is_attention_over_the_union(dtype):
    rng = numpy.random.default_rng(0)
    (ro, rl), os_, lses = _parts(rng, [0, 5, 5, 23, 40], dtype)
    o, lse = cuflash_merge(os_, [x.astype(numpy.float32 if dtype != F64 else F64) for x in lses])
    assert o.dtype == dtype and lse.dtype == (F64 if dtype == F64 else F32)
    eps = float(ml_dtypes.finfo(dtype).eps)
    assert numpy.abs(o.astype(F64) - ro).max() <= 4 * eps * numpy.abs(ro).max()
    acc_eps = eps if dtype == F64 else 2.0 ** -23      # lse accumulates in float32 / float64
    assert numpy.abs(lse - rl).max() <= 16 * acc_eps * max(1.0, numpy.abs(rl).max())


def cuflash_merge(os_, lses):
    return _inference.merge_states(os_, lses)


def test_merge_states_stacked_equals_list_and_is_associative():
    rng = numpy.random.default_rng(1)
    _, os_, lses = _parts(rng, [0, 4, 9, 30], F32)
    lses = [x.astype(F32) for x in lses]
    o_list, l_list = _inference.merge_states(os_, lses)
    o_stk, l_stk = _inference.merge_states(numpy.stack(os_), numpy.stack(lses))
    assert numpy.array_equal(o_list, o_stk) and numpy.array_equal(l_list, l_stk)
    ab = _inference.merge_states(os_[:2], lses[:2])
    left = _inference.merge_states([ab[0], os_[2]], [ab[1], lses[2]])
    bc = _inference.merge_states(os_[1:], lses[1:])
    right = _inference.merge_states([os_[0], bc[0]], [lses[0], bc[1]])
    for o, lse in (left, right):
        numpy.testing.assert_allclose(o, o_list, rtol=0, atol=4e-7 * numpy.abs(o_list).max())
        numpy.testing.assert_allclose(lse, l_list, rtol=2e-7, atol=0)


def test_merge_states_all_empty_rows_give_zero_and_minus_inf():
    os_ = numpy.full((3, 2, 5, 4), 7.0, F32)          # values of empty states must not leak
    lses = numpy.full((3, 2, 5), -numpy.inf, F32)
    lses[1, 0, 2] = 0.5                               # one row sees keys in one state
    with numpy.errstate(all="raise"):
        o, lse = _inference.merge_states(os_, lses)
    assert not numpy.isnan(o).any() and not numpy.isnan(lse).any()
    assert lse[0, 2] == numpy.float32(0.5) and (o[0, 2] == 7.0).all()
    mask = numpy.ones((2, 5), bool)
    mask[0, 2] = False
    assert (lse[mask] == -numpy.inf).all() and (o[mask] == 0).all()


def test_merge_states_single_state_is_identity_and_order_is_fixed():
    rng = numpy.random.default_rng(2)
    o1 = randn(rng, (1, 3, 8), F32)
    l1 = randn(rng, (1, 3), F32)
    o, lse = _inference.merge_states(o1, l1)
    numpy.testing.assert_allclose(o, o1[0], rtol=1e-6)
    numpy.testing.assert_allclose(lse, l1[0], rtol=1e-6)


def test_merge_states_rejects_bad_input():
    o = numpy.zeros((2, 3, 4), F32)
    lse = numpy.zeros((2, 3), F32)
    with pytest.raises(ValueError, match="at least one state"):
        _inference.merge_states([], [])
    with pytest.raises(ValueError, match="lses must have shape"):
        _inference.merge_states(o, numpy.zeros((2, 4), F32))
    with pytest.raises(ValueError, match="os has 2 states and lses 1"):
        _inference.merge_states(o, lse[:1])
    with pytest.raises(TypeError, match="one dtype"):
        _inference.merge_states(o.astype(numpy.int32), lse)
    with pytest.raises(TypeError, match="real floating"):
        _inference.merge_states(o, lse.astype(numpy.int64))
    with pytest.raises(TypeError, match="os/lses"):        # the message names the argument
        _inference.merge_states([[0.0]], [[0.0]])


# ---------------------------------------------------------------------------------------------
# attention_with_kvcache on the CPU
# ---------------------------------------------------------------------------------------------

def make_cache(rng, dtype, *, B=3, Hkv=2, G=4, Lq=1, d=16, dv=None, L=50, Lnew=2, paged=False,
               page_size=8, seqlens=None):
    """q (B, Hkv, G, Lq, d), a cache (B, Hkv, 1, L, d) or its paged form, seqlens, k_new."""
    dv = dv or d
    q = randn(rng, (B, Hkv, G, Lq, d), dtype)
    kd = randn(rng, (B, Hkv, 1, L, d), dtype)
    vd = randn(rng, (B, Hkv, 1, L, dv), dtype)
    s = (rng.integers(0, L - Lnew + 1, B) if seqlens is None else numpy.asarray(seqlens)
         ).astype(numpy.int32)
    kn = randn(rng, (B, Hkv, 1, Lnew, d), dtype) if Lnew else None
    vn = randn(rng, (B, Hkv, 1, Lnew, dv), dtype) if Lnew else None
    if not paged:
        return q, kd, vd, s, None, kn, vn
    per = -(-L // page_size)
    nb = B * per + 2
    bt = rng.permutation(nb)[:B * per].reshape(B, per).astype(numpy.int32)
    kp = randn(rng, (nb, Hkv, 1, page_size, d), dtype)      # pages nobody owns hold noise
    vp = randn(rng, (nb, Hkv, 1, page_size, dv), dtype)
    for b in range(B):
        for j in range(L):
            kp[bt[b, j // page_size], :, :, j % page_size] = kd[b, :, :, j]
            vp[bt[b, j // page_size], :, :, j % page_size] = vd[b, :, :, j]
    return q, kp, vp, s, bt, kn, vn


def dense_rows(cache, bt, b, n, page_size):
    """Keys 0..n-1 of batch row b, from a dense cache or through the page table."""
    if bt is None:
        return cache[b, ..., :n, :]
    if n == 0:
        return cache[0, ..., :0, :]
    return numpy.stack([cache[bt[b, j // page_size], ..., j % page_size, :] for j in range(n)], -2)


def check_against_reference(q, kc, vc, s, bt, Lnew, o, lse, causal, page_size, scale=None):
    for b in range(q.shape[0]):
        n = int(s[b]) + Lnew
        kb, vb = dense_rows(kc, bt, b, n, page_size), dense_rows(vc, bt, b, n, page_size)
        c = "bottom_right" if causal else False
        prob = _problem.make_problem(q[b], kb, vb, scale=scale, causal=c)
        ro, rl = reference.attention(q[b], kb, vb, scale=scale, causal=c, return_lse=True)
        assert_attention_close(prob, o[b], lse[b], ro, rl)


@pytest.mark.parametrize("paged,page_size", [(False, 0), (True, 8), (True, 5), (True, 1)])
@pytest.mark.parametrize("causal,Lq", [(False, 1), (True, 3)])
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_kvcache_cpu_matches_reference_and_appends(paged, page_size, causal, Lq, dtype):
    rng = numpy.random.default_rng(3)
    q, kc, vc, s, bt, kn, vn = make_cache(rng, dtype, Lq=Lq, paged=paged, page_size=page_size or 8,
                                          seqlens=[0, 17, 48])
    k0, v0 = kc.copy(), vc.copy()
    o, lse = _inference.attention_with_kvcache(q, kc, vc, cache_seqlens=s, block_table=bt,
                                               k_new=kn, v_new=vn, causal=causal,
                                               return_lse=True)
    assert o.shape == q.shape and o.dtype == dtype and lse.shape == q.shape[:-1]
    ps = page_size or 8
    written = numpy.zeros(kc.shape[:1] + kc.shape[-2:-1], bool)   # (batch/page, position)
    for b in range(q.shape[0]):
        for t in range(2):
            pos = int(s[b]) + t
            at = (b, pos) if bt is None else (bt[b, pos // ps], pos % ps)
            assert numpy.array_equal(kc[at[0], :, :, at[1]], kn[b, :, :, t])
            assert numpy.array_equal(vc[at[0], :, :, at[1]], vn[b, :, :, t])
            written[at] = True
    by_row = (0, 3, 1, 2, 4)                  # (batch/page, position, heads..., d)
    assert numpy.array_equal(kc.transpose(by_row)[~written], k0.transpose(by_row)[~written])
    assert numpy.array_equal(vc.transpose(by_row)[~written], v0.transpose(by_row)[~written])
    check_against_reference(q, kc, vc, s, bt, 2, o, lse, causal, ps)


def test_kvcache_cpu_paged_equals_dense_bitwise():
    rng = numpy.random.default_rng(4)
    args = dict(B=2, L=40, Lq=2, seqlens=[11, 30])
    q, kd, vd, s, _, kn, vn = make_cache(numpy.random.default_rng(5), F32, **args)
    q2, kp, vp, s2, bt, kn2, vn2 = make_cache(numpy.random.default_rng(5), F32, paged=True,
                                              page_size=16, **args)
    del rng
    od = _inference.attention_with_kvcache(q, kd, vd, cache_seqlens=s, k_new=kn, v_new=vn,
                                           causal=True)
    op = _inference.attention_with_kvcache(q2, kp, vp, cache_seqlens=s2, block_table=bt,
                                           k_new=kn2, v_new=vn2, causal=True)
    assert numpy.array_equal(od, op)


def test_kvcache_cpu_without_append_empty_rows_and_plain_heads():
    rng = numpy.random.default_rng(6)
    q = randn(rng, (2, 4, 3, 16), F32)                   # Hq = Hkv = 4, Lq = 3
    kc, vc = randn(rng, (2, 4, 20, 16), F32), randn(rng, (2, 4, 20, 16), F32)
    s = numpy.array([0, 2], numpy.int32)
    o, lse = _inference.attention_with_kvcache(q, kc, vc, cache_seqlens=s, causal=True,
                                               return_lse=True)
    assert (o[0] == 0).all() and (lse[0] == -numpy.inf).all()      # no key at all
    assert (lse[1, :, 0] == -numpy.inf).all() and (o[1, :, 0] == 0).all()   # query 0 at -1
    ro, rl = reference.attention(q[1], kc[1, :, :2], vc[1, :, :2], causal=True, return_lse=True)
    assert_attention_close(_problem.make_problem(q[1], kc[1, :, :2], vc[1, :, :2], scale=None,
                                                 causal=True), o[1], lse[1], ro, rl)


def _kv_error(exc, match, **over):
    rng = numpy.random.default_rng(7)
    q, kc, vc, s, bt, kn, vn = make_cache(rng, F32, paged=over.pop("paged", False), seqlens=[1, 2, 3])
    args = dict(q=q, k_cache=kc, v_cache=vc, cache_seqlens=s, block_table=bt, k_new=kn, v_new=vn)
    args.update(over)
    k0 = kc.copy()
    with pytest.raises(exc, match=match):
        _inference.attention_with_kvcache(args.pop("q"), args.pop("k_cache"), args.pop("v_cache"),
                                          **args)
    assert numpy.array_equal(kc, k0), "nothing may be written before an error"


def test_kvcache_rejects_bad_input_before_writing():
    rng = numpy.random.default_rng(8)
    _kv_error(ValueError, "k_new without v_new", v_new=None)
    _kv_error(ValueError, "v_new without k_new", k_new=None)
    _kv_error(ValueError, "k_cache and v_cache disagree", v_cache=numpy.zeros((3, 2, 1, 49, 16), F32))
    _kv_error(TypeError, "cache_seqlens must be int32", cache_seqlens=numpy.array([1, 2, 3]))
    _kv_error(ValueError, r"cache_seqlens must have shape \(B,\)", cache_seqlens=numpy.array([1, 2], numpy.int32))
    _kv_error(ValueError, r"cache_seqlens\[2\]=49 with Lnew=2 does not fit",
              cache_seqlens=numpy.array([1, 2, 49], numpy.int32))
    _kv_error(ValueError, r"cache_seqlens\[0\]=-1", cache_seqlens=numpy.array([-1, 2, 3], numpy.int32))
    _kv_error(ValueError, "more than the cache holds", k_new=randn(rng, (3, 2, 1, 51, 16), F32),
              v_new=randn(rng, (3, 2, 1, 51, 16), F32))
    _kv_error(ValueError, "k_new must be", k_new=randn(rng, (3, 2, 4, 2, 16), F32))
    _kv_error(TypeError, "differs from q.dtype", k_new=randn(rng, (3, 2, 1, 2, 16), F64))
    _kv_error(ValueError, "dense cache is", k_cache=numpy.zeros((2, 2, 1, 50, 16), F32),
              v_cache=numpy.zeros((2, 2, 1, 50, 16), F32))
    _kv_error(ValueError, "do not broadcast", q=randn(rng, (3, 3, 4, 1, 16), F32))
    _kv_error(ValueError, "broadcast view", k_cache=numpy.broadcast_to(
        numpy.zeros((3, 1, 1, 50, 16), F32), (3, 2, 1, 50, 16)))
    _kv_error(TypeError, "num_splits", num_splits=2.0)
    _kv_error(ValueError, "num_splits must be >= 1", num_splits=0)
    _kv_error(ValueError, "bottom-right", causal="top_left")
    # paged: table shape, page out of range (host-known)
    bad = numpy.zeros((3, 7), numpy.int32)
    bad[1, 0] = 99
    _kv_error(ValueError, r"block_table\[1\] holds page 99 outside", paged=True, block_table=bad)
    bad[1, 0] = -3
    _kv_error(ValueError, r"block_table\[1\] holds page -3", paged=True, block_table=bad)
    _kv_error(ValueError, r"block_table must be \(B, max_blocks\)", paged=True,
              block_table=numpy.zeros((2, 7), numpy.int32))
    _kv_error(TypeError, "block_table must be int32", paged=True,
              block_table=numpy.zeros((3, 7), numpy.int64))


def test_kvcache_page_out_of_range_beyond_the_used_pages_is_fine():
    """Only the pages that hold keys 0 .. n_b - 1 must be valid (unused table slots may hold
    anything, as FlashAttention's callers leave them)."""
    rng = numpy.random.default_rng(9)
    q, kc, vc, s, bt, kn, vn = make_cache(rng, F32, paged=True, page_size=8, seqlens=[1, 2, 3])
    bt[:, -1] = 10**6
    _inference.attention_with_kvcache(q, kc, vc, cache_seqlens=s, block_table=bt, k_new=kn,
                                      v_new=vn)


# ---------------------------------------------------------------------------------------------
# attention_varlen on the CPU
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True, "top_left"])
@pytest.mark.parametrize("dtype", [F32, F16])
def test_varlen_matches_reference_per_sequence(causal, dtype):
    rng = numpy.random.default_rng(10)
    lq, lk = [3, 0, 5, 1, 4], [6, 2, 0, 1, 9]
    cu_q = numpy.concatenate([[0], numpy.cumsum(lq)]).astype(numpy.int32)
    cu_k = numpy.concatenate([[0], numpy.cumsum(lk)]).astype(numpy.int32)
    q = randn(rng, (2, 1, cu_q[-1], 16), dtype)
    k = randn(rng, (2, 3, cu_k[-1], 16), dtype)
    v = randn(rng, (2, 3, cu_k[-1], 8), dtype)
    o, lse = _varlen.attention_varlen(q, k, v, cu_q, cu_k, causal=causal, return_lse=True,
                                      max_seqlen_q=5)
    assert o.shape == (2, 3, cu_q[-1], 8)
    for s in range(len(lq)):
        sq, sk = slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])
        if lq[s] == 0:
            continue
        args = (q[..., sq, :], k[..., sk, :], v[..., sk, :])
        prob = _problem.make_problem(*args, scale=None, causal=causal)
        ro, rl = reference.attention(*args, causal=causal, return_lse=True)
        assert_attention_close(prob, o[..., sq, :], lse[..., sq], ro, rl)


def test_varlen_vjp_matches_reference_backward():
    rng = numpy.random.default_rng(11)
    cu_q = numpy.array([0, 4, 4, 9], numpy.int32)
    cu_k = numpy.array([0, 3, 8, 8], numpy.int32)
    q, k, v = (randn(rng, (2, n, 8), F64) for n in (9, 8, 8))
    o, pullback = _varlen.attention_varlen_vjp(q, k, v, cu_q, cu_k, causal=True)
    do = randn(rng, o.shape, F64)
    dq, dk, dv = pullback(do)
    for s in range(3):
        sq, sk = slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])
        if cu_q[s] == cu_q[s + 1] or cu_k[s] == cu_k[s + 1]:
            assert (dq[:, sq] == 0).all() and (dk[:, sk] == 0).all()
            continue
        r = reference.attention_backward(do[:, sq], q[:, sq], k[:, sk], v[:, sk], causal=True)
        for got, want in zip((dq[:, sq], dk[:, sk], dv[:, sk]), r):
            numpy.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)


def test_varlen_rejects_bad_cu_seqlens():
    q = numpy.zeros((2, 6, 8), F32)
    k = numpy.zeros((2, 5, 8), F32)
    good_q, good_k = numpy.array([0, 2, 6], numpy.int32), numpy.array([0, 1, 5], numpy.int32)
    run = lambda cq, ck, **kw: _varlen.attention_varlen(q, k, k, cq, ck, **kw)  # noqa: E731
    run(good_q, good_k)
    with pytest.raises(TypeError, match="cu_seqlens_q must be int32"):
        run(good_q.astype(numpy.int64), good_k)
    with pytest.raises(ValueError, match="non-decreasing"):
        run(numpy.array([0, 4, 3, 6], numpy.int32), numpy.array([0, 1, 2, 5], numpy.int32))
    with pytest.raises(ValueError, match=r"cu_seqlens_k\[0\] must be 0"):
        run(good_q, numpy.array([1, 1, 5], numpy.int32))
    with pytest.raises(ValueError, match=r"cu_seqlens_q\[-1\]=5 must equal the packed length 6"):
        run(numpy.array([0, 2, 5], numpy.int32), good_k)
    with pytest.raises(ValueError, match="one length"):
        run(good_q, numpy.array([0, 5], numpy.int32))
    with pytest.raises(ValueError, match="max_seqlen_q=3 is below the longest sequence"):
        run(good_q, good_k, max_seqlen_q=3)
    with pytest.raises(TypeError, match="unexpected keywords"):
        run(good_q, good_k, window=3)
    with pytest.raises(ValueError, match="1-D"):
        run(good_q.reshape(3, 1), good_k)


def test_varlen_read_host_keeps_numpy_cu_seqlens_and_declines_what_validation_rejects():
    """_read_host (the CuPy path's one read-back): NumPy int32 arrays come back as they are
    (nothing read, no sync); anything but a 1-D int32 NumPy / CuPy array of >= 1 element gives
    None, and the full path's validation then raises what it always raised."""
    import types
    fake_cupy = types.SimpleNamespace(ndarray=type("DeviceArray", (), {}))
    cq, ck = numpy.array([0, 2, 6], numpy.int32), numpy.array([0, 1, 5], numpy.int32)
    hq, hk = _varlen._read_host(cq, ck, fake_cupy)
    assert hq is cq and hk is ck
    for bad in (cq.astype(numpy.int64), cq.reshape(3, 1), cq[:0], [0, 2, 6]):
        assert _varlen._read_host(bad, ck, fake_cupy) is None
        assert _varlen._read_host(cq, bad, fake_cupy) is None


def test_varlen_numpy_cu_seqlens_validate_for_device_inputs():
    """With CuPy q, k, v (xp = cupy) NumPy cu_seqlens are accepted, with the same checks and
    messages; the values checked are the read-back ones when given (``host``)."""
    import types
    cupy_like = types.ModuleType("cupy")
    good = numpy.array([0, 2, 6], numpy.int32)
    assert list(_varlen._host_cu(good, "cu_seqlens_q", 6, cupy_like)) == [0, 2, 6]
    with pytest.raises(ValueError, match=r"cu_seqlens_q\[1\]=4 > cu_seqlens_q\[2\]=3"):
        _varlen._host_cu(numpy.array([0, 4, 3, 6], numpy.int32), "cu_seqlens_q", 6, cupy_like)
    with pytest.raises(ValueError, match=r"cu_seqlens_k\[-1\]=5 must equal the packed length 6"):
        _varlen._host_cu(numpy.array([0, 2, 5], numpy.int32), "cu_seqlens_k", 6, cupy_like)
    with pytest.raises(TypeError, match="cu_seqlens_q must be int32"):
        _varlen._host_cu(good.astype(numpy.int64), "cu_seqlens_q", 6, cupy_like)
    # the values validated (and returned) are the host copy's: no second read
    got = _varlen._host_cu(good, "cu_seqlens_q", 6, cupy_like,
                           host=numpy.array([0, 3, 6], numpy.int32))
    assert list(got) == [0, 3, 6]
    with pytest.raises(ValueError, match=r"cu_seqlens_q\[0\] must be 0, got 1"):
        _varlen._host_cu(good, "cu_seqlens_q", 6, cupy_like,
                         host=numpy.array([1, 3, 6], numpy.int32))


def test_varlen_clear_plans_without_a_gpu():
    from cuflash import _api
    _api.clear_plans()          # the varlen caches are made on first GPU use: None here
    _varlen.clear_plans()


# ---------------------------------------------------------------------------------------------
# The decode family: registry, parameter block, split heuristic
# ---------------------------------------------------------------------------------------------

def test_decode_params_layout_matches_the_struct():
    """DECODE_PARAMS mirrors cuflash::decode::DecodeParams (and its VariantParams)."""
    from _layout import assert_struct_matches
    assert_struct_matches("decode_params.cuh", "cuflash::decode", "DecodeParams",
                          _inference_gpu.DECODE_PARAMS, nested={"var": "VariantParams"})


def test_decode_choice_is_in_the_gate():
    listed = {e for _, e in _families.specialisations("sm_90a")}
    for dtype in ("float16", "bfloat16", "float32"):
        for d in (32, 64, 96, 128, 256):
            for rows in (1, 3, 4, 8, 12, 64):
                for causal in (False, True):
                    shape = _families.Shape(dtype, 64, rows, 4096, d, d,
                                            _families.Variant(causal=causal))
                    ch = _families.choose("decode", shape, H200)
                    assert ch.expr in listed
                    assert ch.traits.block_m >= min(rows, 8)
                    if "fuse" in ch.flag:       # decode_sm80 with several splits: fused
                        assert ch.family.expr(dtype, ch.traits, shape.variant,
                                              **dict(ch.flag, fuse=True)) in listed
    with pytest.raises(ValueError, match="multiples of 8"):
        _families.choose("decode", _families.Shape("float16", 1, 1, 10, 12, 12,
                                                   _families.Variant()), H200)


@pytest.mark.parametrize("B,Hkv,L", [(1, 8, 1024), (8, 8, 8192), (8, 8, 131072), (64, 8, 65536),
                                     (1, 32, 131072), (64, 32, 1024)])
def test_split_heuristic_fills_the_gpu(B, Hkv, L):
    t = _families.choose("decode", _families.Shape("bfloat16", B * Hkv, 4, L, 128, 128,
                                                   _families.Variant()), H200).traits
    s = _inference_gpu.num_splits_heuristic(B * Hkv, L, t.block_n, H200.num_sms, t.min_blocks)
    slots = H200.num_sms * t.min_blocks
    assert 1 <= s <= _inference_gpu.MAX_SPLITS
    assert s == 1 or -(-L // t.block_n) // s >= _inference_gpu.MIN_ITERS_PER_SPLIT
    if B * Hkv >= slots:
        assert s == 1
    elif -(-L // t.block_n) >= 4 * slots:          # enough keys: the splits fill the slots
        assert B * Hkv * s >= 0.8 * slots


def test_split_heuristic_edge_cases():
    h = _inference_gpu.num_splits_heuristic
    assert h(0, 4096, 32, 132, 4) == 1          # nothing to launch (Lq = 0)
    assert h(1, 0, 32, 132, 4) == 1             # an empty cache
    assert h(1, 100, 32, 132, 4) == 1           # 4 iterations: one split
    assert h(1, 1 << 20, 32, 132, 4) == _inference_gpu.MAX_SPLITS   # 1 block: as many as allowed
    assert h(8, 1 << 17, 32, 132, 4) == 57      # 456 of 528 slots: the first count >= 85% full


def test_decode_spec_on_the_host_for_the_benchmark_shapes():
    """The plan of the benchmark's calls (no GPU: the spec, not the kernels): the decode family
    applies, GQA rows are packed, the grid and the split count are what the docs say."""
    for B, Hq, Hkv, L, paged in ((8, 32, 8, 8192, False), (1, 32, 8, 131072, True),
                                 (64, 32, 32, 1024, False)):
        G = Hq // Hkv
        q = numpy.zeros((B, Hkv, G, 1, 128), BF16)
        if paged:
            kc = numpy.zeros((B * L // 16, Hkv, 1, 16, 128), BF16)
            bt = numpy.arange(B * L // 16, dtype=numpy.int32).reshape(B, -1)
        else:
            kc, bt = numpy.zeros((B, Hkv, 1, L, 128), BF16), None
        s = numpy.full((B,), L, numpy.int32)
        c = _inference.check_kvcache(q, kc, kc, s, bt, None, None, None, None, False, True)
        spec = _inference_gpu.spec_or_reason(c, H200)
        assert not isinstance(spec, str), spec
        assert (spec.Hkv, spec.G, spec.rows) == (Hkv, G, G)
        # the tensor-core decode on an H200: 16 packed rows a tile, whatever G
        # (fused: with several splits the kernel merges them itself, no decode_combine)
        # (no stream grid at these shapes: tests/test_inference_stream.py); 3 stages (the deep
        # ring for grids of at most one block an SM is opt-in: CUFLASH_DECODE_STAGES=auto)
        fused = "true" if spec.splits > 1 else "false"
        deep = False
        # (the prelude: session 11's early copies for a grid of one split only, the default
        # since session 12's H200 run, and session 10's arrival; no other A/B define)
        assert spec.stream == 0 and spec.stages == (5 if deep else 3)
        assert spec.prelude == ("" if spec.splits == 1 else
                                "#define CUFLASH_DECODE_EARLY_KV 0\n"
                                "#define CUFLASH_DECODE_ARRIVE_WRAP 0\n")
        assert spec.split[:2] == ("decode_mma.cu", "cuflash::decode::decode_mma<__nv_bfloat16, "
                                  f"128, cuflash::Variant<false>, {fused}"
                                  f"{', false, 5' if deep else ''}>")
        assert spec.split[4] == (4096 + 4 * spec.stages * 2 * 4096)
        assert spec.row_tiles == 1
        assert spec.split[2] == B * Hkv * spec.splits
        assert spec.combine is None and spec.fuse == (spec.splits > 1)
        assert spec.groups == B * Hkv
        assert spec.params["paged"] == int(paged)
        assert spec.params["page_shift"] == (4 if paged else -1)


def test_explain_kvcache_says_the_path():
    rng = numpy.random.default_rng(12)
    q, kc, vc, s, bt, kn, vn = make_cache(rng, F32, seqlens=[1, 2, 3])
    assert "CPU path" in _inference.explain_kvcache(q, kc, vc, cache_seqlens=s)
    with pytest.raises(TypeError, match="unexpected keywords"):
        _inference.explain_kvcache(q, kc, vc, cache_seqlens=s, window=2)


def test_pointer_words_are_in_struct_order():
    """DecodePlan.run_arrays patches words by index: the order of DecodeParams' pointers."""
    assert _inference_gpu.POINTERS == ("q", "k_cache", "v_cache", "o", "lse", "o_part",
                                       "lse_part", "cache_seqlens", "block_table", "k_new",
                                       "v_new")
    assert list(_inference_gpu.DECODE_PARAMS.names[:11]) == list(_inference_gpu.POINTERS)


def test_cuflash_decode_split_forces_the_generic_kernel(monkeypatch):
    """CUFLASH_DECODE=split (A/B runs): decode_split where decode_mma would run, said so."""
    B, Hkv, G, L = 2, 2, 4, 256
    q = numpy.zeros((B, Hkv, G, 1, 128), BF16)
    kc = numpy.zeros((B, Hkv, 1, L, 128), BF16)
    s = numpy.full((B,), L, numpy.int32)
    c = _inference.check_kvcache(q, kc, kc, s, None, None, None, None, None, False, True)
    assert _inference_gpu.spec_or_reason(c, H200).split[0] == "decode_mma.cu"
    monkeypatch.setenv("CUFLASH_DECODE", "split")
    spec = _inference_gpu.spec_or_reason(c, H200)
    assert spec.split[0] == "decode.cu" and "CUFLASH_DECODE=split" in spec.explain()

