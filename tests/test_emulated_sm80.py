"""bwd_sm80 (cuda_src/bwd_sm80.cu) on the CPU: the kernel's C++, unchanged, run in the host
emulation of tests/_emu_sm80.py, against the float64 reference gradients with the tolerance of
tests/_tolerance_bwd.py. No GPU needed (g++ is); ``slow``: the first run compiles the kernels
with g++ (about a minute; cached in the temp directory after that).

What this proves: the kernel's tiling, fragment layouts (by the PTX ISA's tables), swizzled
addressing, masks, dead rows, the query/key walk and the semaphore order of
``deterministic=True``. What it cannot: speed, registers, races the GPU memory model allows
(blocks run one after another here). The forward kernel, which is measured correct on the
GPU, runs through the same emulation first, as a check of the emulation itself.
"""

from __future__ import annotations

import types

import ml_dtypes
import numpy
import pytest

import cuflash
from cuflash import _families, _problem
from _inputs import make_array
from _tolerance import assert_attention_close
from _tolerance_bwd import assert_gradients_close

import _emu_sm80 as emu

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not emu.available(), reason="g++ is needed for the emulation")]

BF16 = numpy.dtype(ml_dtypes.bfloat16)
F16 = numpy.dtype(numpy.float16)
DTYPES = [F16, BF16]
IDS = ["f16", "bf16"]

#: (q shape, k shape, v shape, causal, deterministic, layouts of q, k, v): every head-dim
#: bucket, d != dv, d not a multiple of 8 (padded copies), ragged lengths, both causal
#: alignments, rows with no visible key (bottom-right with Lq > Lk), GQA broadcasting,
#: transposed and strided layouts (copied), and full tiles (256 = 2 key tiles x 4 query tiles).
CASES = {
    "gqa-ragged-causal-d40": ((2, 2, 113, 40), (2, 1, 203, 40), (2, 1, 203, 40), True, False, "ccc"),
    "dead-rows-det-d72": ((2, 203, 72), (2, 113, 72), (2, 113, 72), True, True, "ccc"),
    "top-left-d111": ((130, 111), (70, 111), (70, 111), "top_left", False, "ccc"),
    "d32-det": ((2, 64, 32), (2, 129, 32), (2, 129, 32), False, True, "ccc"),
    "d24-dv128-causal": ((100, 24), (150, 24), (150, 128), True, False, "ccc"),
    "d64-dv32-layouts": ((3, 129, 64), (3, 64, 64), (1, 64, 32), False, False, "tsr"),
    "full-tiles-d128-det": ((1, 256, 128), (1, 256, 128), (1, 256, 128), True, True, "ccc"),
}
_LAYOUT = {"c": "c", "t": "transposed", "s": "strided", "r": "reversed"}


def _expr(dtype, q, k, v, causal, det) -> str:
    prob = _problem.make_problem(q, k, v, scale=None, causal=causal)
    return emu.sm80_expr(dtype, emu.sm80_tiles(prob.d, prob.dv), prob.causal, det)


def _arrays(dtype, case, seed=0):
    qs, ks, vs, causal, det, layouts = CASES[case]
    rng = numpy.random.default_rng(seed)
    q, k, v = (make_array(rng, s, dtype, _LAYOUT[lay]) for s, lay in zip((qs, ks, vs), layouts))
    return q, k, v, causal, det


@pytest.fixture(scope="module")
def bwd_lib():
    kernels = sorted({("bwd", _expr(dtype, *_arrays(dtype, case)))
                      for dtype in DTYPES for case in CASES})
    return emu.build("bwd_sm80.cu", kernels)


def _forward(q, k, v, causal):
    """o (in the inputs' dtype) and lse (float32) as the GPU forward returns them."""
    o, lse = cuflash.reference.attention(q, k, v, causal=causal, return_lse=True)
    return o.astype(q.dtype), lse.astype(numpy.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference(bwd_lib, dtype, case):
    q, k, v, causal, det = _arrays(dtype, case)
    o, lse = _forward(q, k, v, causal)
    do = make_array(numpy.random.default_rng(1), o.shape, dtype)
    grads = emu.bwd_sm80(bwd_lib, do, q, k, v, o, lse, causal=causal, deterministic=det)
    ref = cuflash.reference.attention_backward(do, q, k, v, causal=causal)
    prob = _problem.make_problem(q, k, v, scale=None, causal=causal)
    assert_gradients_close(prob, do, grads, ref, (q.shape, k.shape, v.shape))
    assert all(numpy.abs(g.astype(numpy.float32)).max() > 0 for g in grads)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_rows_without_keys_ignore_nan(bwd_lib, dtype):
    """Rows that see no key (bottom-right causal, Lq > Lk) with NaN in their q and dO rows: the
    gradients are those of the same problem with finite values there (those rows contribute
    nothing), dq of those rows exactly 0."""
    q, k, v, causal, det = _arrays(dtype, "dead-rows-det-d72")
    o, lse = _forward(q, k, v, causal)
    do = make_array(numpy.random.default_rng(1), o.shape, dtype)
    dead = q.shape[-2] - k.shape[-2]
    q_nan, do_nan = q.copy(), do.copy()
    q_nan[..., :dead, :] = numpy.nan
    do_nan[..., :dead, :] = numpy.nan
    grads = emu.bwd_sm80(bwd_lib, do_nan, q_nan, k, v, o, lse, causal=causal, deterministic=det)
    assert (grads[0][..., :dead, :] == 0).all()
    ref = cuflash.reference.attention_backward(do, q, k, v, causal=causal)
    prob = _problem.make_problem(q, k, v, scale=None, causal=causal)
    assert_gradients_close(prob, do, grads, ref, (q.shape, k.shape, v.shape))


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_deterministic_is_bitwise_reproducible(bwd_lib, dtype):
    q, k, v, causal, det = _arrays(dtype, "full-tiles-d128-det")
    o, lse = _forward(q, k, v, causal)
    do = make_array(numpy.random.default_rng(1), o.shape, dtype)
    first = emu.bwd_sm80(bwd_lib, do, q, k, v, o, lse, causal=causal, deterministic=True)
    again = emu.bwd_sm80(bwd_lib, do, q, k, v, o, lse, causal=causal, deterministic=True)
    for a, b in zip(first, again):
        assert (a.view(numpy.uint16) == b.view(numpy.uint16)).all()


# -- the emulation itself: the GPU-verified forward kernel runs through it correctly ------------

@pytest.mark.parametrize("dtype, d, Lq, Lk, causal", [(BF16, 64, 113, 203, True),
                                                     (F16, 128, 200, 77, False),
                                                     (BF16, 96, 130, 70, "top_left")])
def test_emulation_runs_the_forward_kernel(dtype, d, Lq, Lk, causal):
    rng = numpy.random.default_rng(d)
    q, k, v = (make_array(rng, (2, L, d), dtype) for L in (Lq, Lk, Lk))
    prob = _problem.make_problem(q, k, v, scale=None, causal=causal)
    choice = _families.choose("fwd", _families.Shape.of(prob), _families.PROFILES["a100"])
    tiles, expr = choice.traits, choice.expr
    lib = emu.build("fwd_sm80.cu", [("fwd", expr)])
    o, lse = emu.fwd_sm80(lib, expr, q, k, v, block_m=tiles.block_m, block_n=tiles.block_n, threads=tiles.threads,
                          smem_bytes=tiles.smem_bytes, causal=causal)
    o_ref, lse_ref = cuflash.reference.attention(q, k, v, causal=causal, return_lse=True)
    assert_attention_close(prob, o, lse, o_ref, lse_ref)


def test_emulation_catches_a_wrong_fragment_layout():
    """The same backward with the dS A-fragment addressed like a K fragment must fail: the
    emulation really exercises the layouts."""
    text = (emu.cuda_src_dir() / "bwd_sm80.cu").read_text()
    good = "ds_at(sdS, (lane & 7) + ((lane >> 4) << 3), (lane >> 3) & 1)"
    assert good in text
    bad = text.replace(good, "ds_at(sdS, (lane & 7) + (((lane >> 3) & 1) << 3), lane >> 4)")
    q, k, v, causal, det = _arrays(BF16, "d32-det")
    expr = _expr(BF16, q, k, v, causal, det)
    lib = emu.build("bwd_sm80.cu", [("bwd", expr)], kernel_text=bad)
    o, lse = _forward(q, k, v, causal)
    do = make_array(numpy.random.default_rng(1), o.shape, BF16)
    grads = emu.bwd_sm80(lib, do, q, k, v, o, lse, causal=causal, deterministic=det)
    ref = cuflash.reference.attention_backward(do, q, k, v, causal=causal)
    prob = _problem.make_problem(q, k, v, scale=None, causal=causal)
    with pytest.raises(AssertionError, match="dq: max abs error"):
        assert_gradients_close(prob, do, grads, ref, (q.shape, k.shape, v.shape))


# -- the forward with the built-in modifiers (issue 10): fwd_sm80's Variant code in the emulation

def _modifier_case(name, dtype):
    """(q, k, v, causal, modifier keywords) of one small case; each masking modifier leaves
    some rows with no visible key."""
    rng = numpy.random.default_rng(len(name))
    B, H, d = 2, 2, 64
    # Lq > Lk: the window's diagonal i + Lk - Lq starts below key 0 (rows with no key)
    Lq, Lk = (150, 100) if name in ("window", "sink", "softcap-window", "softcap-50",
                                    "alibi-top-left-tall") else (100, 150)
    q, k, v = (make_array(rng, (B, H, L, d), dtype) for L in (Lq, Lk, Lk))
    bias = rng.standard_normal((H, Lq, Lk)).astype(numpy.float32)   # broadcast over B
    bias[:, 7, :] = -numpy.inf                                      # row 7: no visible key
    bias[:, :, 3] = -numpy.inf
    mask = rng.random((B, 1, Lq, Lk)) < 0.6                          # broadcast over H
    mask[:, :, 11, :] = False
    slopes = rng.uniform(0.0, 0.1, (H,)).astype(numpy.float32)
    sink = rng.standard_normal((H,)).astype(numpy.float16)           # converted per item
    cases = {
        "window": (False, dict(window=(20, 5))),                     # rows < 45 see nothing
        "window-causal-top-left": ("top_left", dict(window=(33, None))),
        "softcap": (True, dict(softcap=2.0)),
        # scores far beyond the cap on both sides and near 0 (q's rows scaled below)
        "softcap-extreme": (False, dict(softcap=2.0)),
        "softcap-window": (False, dict(softcap=2.0, window=(20, 5))),  # rows < 45 see nothing
        # Gemma 2's cap with scores out to +-c (q's rows scaled below): bfloat16's fixed
        # offset (session 10) then has P up to 2^50 (mo = 22 at Lk = 100); rows < 50 see
        # no key (causal from the bottom right, Lq > Lk)
        "softcap-50": (True, dict(softcap=50.0)),
        "alibi": (True, dict(alibi_slopes=slopes)),
        # top-left causal: ALiBi's diagonal right of causal's (Lq < Lk: the raw-units build,
        # whose causal form fwd_sm90ws splits into a row term, variant.cuh kAlibiRowOffset),
        # and left of it (Lq > Lk: the host gives the natural-units build, ALIBI = 2, which
        # fwd_sm80 computes as it computes the raw one, |i + diag - j| kept; the GPU test of the
        # routing is test_gpu_forward_ws.py::test_alibi_top_left)
        "alibi-top-left": ("top_left", dict(alibi_slopes=slopes * 10)),
        "alibi-top-left-tall": ("top_left", dict(alibi_slopes=slopes * 10)),
        "bias": (False, dict(bias=bias.astype(dtype))),
        "mask": (True, dict(mask=mask)),
        "sink": (False, dict(sink=sink, window=(10, 0))),            # rows < 50: lse = sink
        "all": (True, dict(window=(40, 3), softcap=5.0, alibi_slopes=slopes, bias=bias,
                           mask=mask, sink=sink)),
    }
    causal, kw = cases[name]
    if name in ("softcap-extreme", "softcap-50"):
        row_scale = numpy.array([300.0, 30.0, 1.0, 1e-2, 1e-4])[numpy.arange(Lq) % 5]
        q = (q.astype(numpy.float32) * row_scale[:, None]).astype(dtype)
    return q, k, v, causal, kw


MODIFIER_CASES = ["window", "window-causal-top-left", "softcap", "softcap-extreme", "softcap-window",
                  "softcap-50", "alibi", "alibi-top-left", "alibi-top-left-tall", "bias", "mask",
                  "sink", "all"]


@pytest.fixture(scope="module")
def fwd_mods_lib():
    """One g++ library with every specialisation the modifier cases select on an A100."""
    kernels = {}
    for name in MODIFIER_CASES:
        for dtype in DTYPES:
            choice, _ = _modifier_choice(name, dtype)
            kernels[("fwd", choice.expr)] = None
    return emu.build("fwd_sm80.cu", sorted(kernels))


def _modifier_choice(name, dtype):
    q, k, v, causal, kw = _modifier_case(name, dtype)
    prob = _problem.make_problem(q, k, v, scale=None, causal=causal)
    mods = emu.modifiers_of(prob, **kw)
    choice = _families.choose("fwd", _families.Shape.of(prob, mods=mods),
                              _families.PROFILES["a100"])
    return choice, (q, k, v, causal, kw)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("name", MODIFIER_CASES)
def test_forward_with_modifiers_matches_the_oracle(fwd_mods_lib, name, dtype):
    import _naive_modifiers as naive
    choice, (q, k, v, causal, kw) = _modifier_choice(name, dtype)
    assert choice.family.name == "fwd_sm80" and "cuflash::Variant<" in choice.expr
    t = choice.traits
    o, lse = emu.fwd_sm80(fwd_mods_lib, choice.expr, q, k, v, block_m=t.block_m, block_n=t.block_n,
                          threads=t.threads, smem_bytes=t.smem_bytes, causal=causal, **kw)
    assert not numpy.isnan(o.astype(numpy.float32)).any() and not numpy.isnan(lse).any()
    naive.check_result(q, k, v, causal, kw, o, lse)
    o_ref, lse_ref = cuflash.reference.attention(q, k, v, causal=causal, return_lse=True, **kw)
    dead = lse_ref == -numpy.inf
    if name in ("window", "bias", "mask", "softcap-window", "softcap-50"):
        assert dead.any()            # the case has rows with no visible key ...
    assert (lse[dead] == -numpy.inf).all() and (o[dead] == 0).all()   # ... o = 0, lse = -inf
    if name == "sink":               # rows with no visible key but a sink: o = 0, lse = sink
        empty = numpy.isclose(lse_ref, numpy.broadcast_to(kw["sink"].astype(float)[:, None],
                                                           lse_ref.shape))
        assert empty.any() and (o[empty] == 0).all()


# -- the backward with the built-in modifiers: dq, dk, dv, dbias, dsink of bwd_sm80's Variant code

BWD_MODIFIER_CASES = ["window", "softcap", "softcap-extreme", "alibi", "bias", "mask", "sink", "all"]


def _bwd_modifier_case(name, dtype):
    q, k, v, causal, kw = _modifier_case(name, dtype)
    return q[..., :70, :], k[..., :90, :], v[..., :90, :], causal, \
        _shrink(kw, 70, 90, q.shape[-2], k.shape[-2])


def _shrink(kw, Lq, Lk, Lq0, Lk0):
    """The case's modifier arrays cut to Lq x Lk (bias and mask), the rest as they are."""
    out = dict(kw)
    for n in ("bias", "mask"):
        if n in out:
            out[n] = numpy.ascontiguousarray(out[n][..., :Lq, :Lk])
    return out


def _bwd_modifier_choice(name, dtype, det):
    q, k, v, causal, kw = _bwd_modifier_case(name, dtype)
    prob = _problem.make_problem(q, k, v, scale=None, causal=causal)
    mods = emu.modifiers_of(prob, **kw)
    choice = _families.choose("bwd", _families.Shape.of(prob, det, mods),
                              _families.PROFILES["a100"])
    return choice, (q, k, v, causal, kw)


@pytest.fixture(scope="module")
def bwd_mods_lib():
    kernels = {}
    for name in BWD_MODIFIER_CASES:
        for det in (False, True):
            choice, _ = _bwd_modifier_choice(name, BF16, det)
            kernels[("bwd", choice.expr)] = None
    return emu.build("bwd_sm80.cu", sorted(kernels))


@pytest.mark.parametrize("det", [False, True], ids=["atomic", "det"])
@pytest.mark.parametrize("name", BWD_MODIFIER_CASES)
def test_backward_with_modifiers_matches_the_reference(bwd_mods_lib, name, det):
    dtype = BF16
    choice, (q, k, v, causal, kw) = _bwd_modifier_choice(name, dtype, det)
    assert choice.family.name == "bwd_sm80"
    o, lse = cuflash.reference.attention(q, k, v, causal=causal, return_lse=True, **kw)
    o, lse = o.astype(dtype), lse.astype(numpy.float32)
    do = make_array(numpy.random.default_rng(1), o.shape, dtype)
    grads = emu.bwd_sm80(bwd_mods_lib, do, q, k, v, o, lse, causal=causal, deterministic=det,
                         tiles=choice.traits, expr=choice.expr, **kw)
    import _naive_modifiers as naive
    naive.check_gradients(grads, q, k, v, o, lse, do, causal, kw)
    if det:   # bitwise reproducible, dbias and dsink included
        again = emu.bwd_sm80(bwd_mods_lib, do, q, k, v, o, lse, causal=causal,
                             deterministic=True, tiles=choice.traits, expr=choice.expr, **kw)
        for a, b in zip(grads, again):
            assert a.tobytes() == b.tobytes()


# -- user functions (score_mod, mask_mod, a captured array, block masks) traced into the Variant

def _user_case(name):
    from test_modifiers import MASK_MODS, SCORE_MODS
    from cuflash._block_mask import block_mask
    rng = numpy.random.default_rng(11)
    L = 256 if name == "block-halves" else 64
    q, k, v = (make_array(rng, (2, 3, L, 64), BF16) for _ in range(3))
    halves = lambda b, h, q, kv: ((q // 128) == (kv // 128)) & ((q - kv) % 5 != 3)  # noqa: E731
    kw = {"score": dict(score_mod=SCORE_MODS["relpos"]),
          "table": dict(score_mod=SCORE_MODS["table"], softcap=4.0),      # a captured array
          "document": dict(mask_mod=MASK_MODS["document"]),                 # another, as a mask
          "both": dict(score_mod=SCORE_MODS["where"], mask_mod=MASK_MODS["mod3"], sink=None),
          # block masks: tiles the map calls empty are skipped, full ones skip the mask_mod
          # (blocks of 16 x 16 and 32 x 8: smaller than and across the kernels' tiles)
          "block-band": dict(block_mask=block_mask(MASK_MODS["band"], (2, 3), 64, 64,
                                                   block=(16, 16))),
          "block-document": dict(block_mask=block_mask(MASK_MODS["document"], (2, 1), 64, 64,
                                                       block=(32, 8)), softcap=3.0),
          # two documents of 128: whole kernel tiles empty (skipped), partial ones (mod 5)
          "block-halves": dict(block_mask=block_mask(halves, (1, 1), L, L, block=(64, 64))),
          }[name]
    return q, k, v, True, {n: x for n, x in kw.items() if x is not None}


USER_CASES = ["score", "table", "document", "both", "block-band", "block-document",
              "block-halves"]


@pytest.mark.parametrize("name", USER_CASES)
def test_user_functions_in_the_kernels_match_the_oracle(name):
    """The traced structs compiled into fwd_sm80 and bwd_sm80 (their source before the
    family's), captured arrays read through their pointers: o, lse against the oracle, the
    gradients against the reference."""
    import _naive_modifiers as naive
    q, k, v, causal, kw = _user_case(name)
    prob = _problem.make_problem(q, k, v, scale=None, causal=causal)
    mods = emu.modifiers_of(prob, **kw)
    fwd = _families.choose("fwd", _families.Shape.of(prob, mods=mods), _families.PROFILES["a100"])
    shape = _families.Shape.of(prob, mods=mods)
    assert "cuflash::user::" in fwd.expr and shape.variant.prelude
    text = (emu.cuda_src_dir() / "fwd_sm80.cu").read_text()
    lib = emu.build("fwd_sm80.cu", [("fwd", fwd.expr)], kernel_text=shape.variant.prelude + text)
    t = fwd.traits
    o, lse = emu.fwd_sm80(lib, fwd.expr, q, k, v, block_m=t.block_m, block_n=t.block_n, threads=t.threads,
                          smem_bytes=t.smem_bytes, causal=causal, **kw)
    naive.check_result(q, k, v, causal, kw, o, lse)
    bwd = _families.choose("bwd", _families.Shape.of(prob, False, mods), _families.PROFILES["a100"])
    btext = (emu.cuda_src_dir() / "bwd_sm80.cu").read_text()
    blib = emu.build("bwd_sm80.cu", [("bwd", bwd.expr)], kernel_text=shape.variant.prelude + btext)
    o, lse = cuflash.reference.attention(q, k, v, causal=causal, return_lse=True, **kw)
    o, lse = o.astype(BF16), lse.astype(numpy.float32)
    do = make_array(numpy.random.default_rng(1), o.shape, BF16)
    grads = emu.bwd_sm80(blib, do, q, k, v, o, lse, causal=causal, tiles=bwd.traits,
                         expr=bwd.expr, **kw)
    naive.check_gradients(grads, q, k, v, o, lse, do, causal, kw)


# -- block-mask tile skipping (issue 10, item 4): empty tiles are never loaded

def _skip_case(name):
    """(q, k, v, causal, kw) of a block mask whose map calls most tiles empty."""
    from cuflash._block_mask import block_mask
    rng = numpy.random.default_rng(21)
    if name == "documents":          # 4 documents of 128, causal inside (the suite's shape),
        Lq = Lk = 512                # and 16 keys every query sees: a block visits key tile 0,
        causal, batch, block = False, (1, 1), (32, 32)   # then its document's (gaps between)
        mm = lambda b, h, q, kv: (((q // 128) == (kv // 128)) & (q >= kv)) | (kv < 16)  # noqa: E731
    elif name == "window":           # a narrow window as a mask_mod, wider in head 1
        Lq = Lk = 384
        causal, batch, block = False, (1, 2), (128, 128)
        mm = lambda b, h, q, kv: (q >= kv) & (q - kv <= 24 + 40 * h)  # noqa: E731
    else:                            # "ragged-causal": lengths and blocks across the kernels'
        Lq, Lk = 300, 333            # tiles; causal (bottom-right) and the map together
        causal, batch, block = True, (1, 1), (48, 40)
        mm = lambda b, h, q, kv: (q // 70) == (kv // 75)  # noqa: E731
    q = make_array(rng, (2, 2, Lq, 64), BF16)
    k, v = (make_array(rng, (2, 2, Lk, 64), BF16) for _ in range(2))
    return q, k, v, causal, {"block_mask": block_mask(mm, batch, Lq, Lk, block=block)}


def _tiles_visited(bmask, batch_shape, Lq, Lk, bm, bn, causal_offset, keys):
    """(visited, all): the tiles the kernels' walk loads, summed over batch items, as row
    counts of the loaded array (keys: the forward's K rows, one count per (query tile, key
    tile); else the backward's Q rows per (key tile, query tile)), with causal's analytic
    range (causal_offset None: no causal) and the block mask's map; and the same without
    the map (what the kernels loaded before)."""
    from cuflash._block_mask import kernel_tile_kinds
    Tq, Tk = -(-Lq // bm), -(-Lk // bn)
    # (a causal call's lists: the kinds of the pairs within the bound, as the plan builds them)
    lists_causal = emu._causal_of(types.SimpleNamespace(causal=causal_offset is not None,
                                                        causal_offset=causal_offset))
    seen = numpy.broadcast_to(kernel_tile_kinds(bmask, bm, bn, lists_causal) != 0,
                              batch_shape + (Tq, Tk))
    seen = seen.reshape(-1, Tq, Tk)
    visited = total = 0
    for a in range(Tq):
        for c in range(Tk):
            if causal_offset is not None:
                if keys:     # key tiles [0, ceil(min(Lk, i1 + off) / bn)) of query tile a
                    n_end = min(Lk, (a + 1) * bm + causal_offset)
                    inside = c < -(-n_end // bn) if n_end > 0 else False
                else:        # query tiles from the one holding row n0 - off
                    inside = a >= max(0, c * bn - causal_offset) // bm
                if not inside:
                    continue
            rows = min(Lk, (c + 1) * bn) - c * bn if keys else min(Lq, (a + 1) * bm) - a * bm
            total += rows * seen.shape[0]
            visited += rows * int(seen[:, a, c].sum())
    return visited, total


SKIP_CASES = ["documents", "window", "ragged-causal"]


@pytest.mark.parametrize("name", SKIP_CASES)
def test_block_masks_never_load_empty_tiles(name):
    """fwd_sm80 and bwd_sm80 (atomic and deterministic) with a block mask that empties most
    tiles: results against the oracle / reference; the K rows the forward copies and the Q rows
    the backward copies are exactly those of the tiles the map does not call empty (inside the
    causal range), fewer than the whole range; right whether cp.async copies land at their wait
    or when issued (a prefetch into the stage being read would show)."""
    import _naive_modifiers as naive
    q, k, v, causal, kw = _skip_case(name)
    bmask = kw["block_mask"]
    prob = _problem.make_problem(q, k, v, scale=None, causal=causal)
    mods = emu.modifiers_of(prob, **kw)
    off = prob.causal_offset if causal else None
    shape = _families.Shape.of(prob, mods=mods)
    fwd = _families.choose("fwd", shape, _families.PROFILES["a100"])
    assert fwd.family.name == "fwd_sm80"
    lib = emu.build("fwd_sm80.cu", [("fwd", fwd.expr)],
                    kernel_text=shape.variant.prelude + (emu.cuda_src_dir() / "fwd_sm80.cu").read_text())
    t = fwd.traits
    chunks = prob.d // 8       # 16-byte copies a row (d = 64: no padded columns)
    want, everything = _tiles_visited(bmask, prob.batch_shape, prob.Lq, prob.Lk, t.block_m,
                                      t.block_n, off, keys=True)
    assert want < everything
    for eager in (False, True):
        o, lse = emu.fwd_sm80(lib, fwd.expr, q, k, v, block_m=t.block_m, block_n=t.block_n, threads=t.threads,
                              smem_bytes=t.smem_bytes, causal=causal, eager=eager, **kw)
        assert lib.watched_copies == want * chunks, (lib.watched_copies, want * chunks)
        naive.check_result(q, k, v, causal, kw, o, lse)
    o, lse = cuflash.reference.attention(q, k, v, causal=causal, return_lse=True, **kw)
    o, lse = o.astype(BF16), lse.astype(numpy.float32)
    do = make_array(numpy.random.default_rng(1), o.shape, BF16)
    btext = shape.variant.prelude + (emu.cuda_src_dir() / "bwd_sm80.cu").read_text()
    for det, eager in ((False, False), (True, True)):
        bwd = _families.choose("bwd", _families.Shape.of(prob, det, mods), _families.PROFILES["a100"])
        blib = emu.build("bwd_sm80.cu", [("bwd", bwd.expr)], kernel_text=btext)
        want, everything = _tiles_visited(bmask, prob.batch_shape, prob.Lq, prob.Lk,
                                          bwd.traits.block_m, bwd.traits.block_n, off, keys=False)
        assert want < everything
        grads = emu.bwd_sm80(blib, do, q, k, v, o, lse, causal=causal, deterministic=det,
                             tiles=bwd.traits, expr=bwd.expr, eager=eager, **kw)
        assert blib.watched_copies == want * chunks, (det, blib.watched_copies, want * chunks)
        naive.check_gradients(grads, q, k, v, o, lse, do, causal, kw)
