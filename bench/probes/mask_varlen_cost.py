"""Questions (session 6, bench/NOTES.md "Analysis without a GPU: block masks and varlen"):

1. Why does fwd_sm90 with a block mask (``cuflash.block_mask(mask_mod)``) cost ~2x the analytic
   window per visited key tile (window 1024: 167 / 143 TFLOP/s against 348 / 351)?
2. How much of varlen's gap to dense attention at the mean length (221 against 327 TFLOP/s)
   is the order of its work list, and how much the partial tiles?

No GPU for the first four modes; the last one is the next GPU session's confirmation.

    PYTHONPATH=. python bench/probes/mask_varlen_cost.py tiles    # tiles, walk groups; fit
    PYTHONPATH=. python bench/probes/mask_varlen_cost.py sass     # registers, loop sizes
    PYTHONPATH=. python bench/probes/mask_varlen_cost.py varlen   # makespan model, 132 SMs
    PYTHONPATH=. python bench/probes/mask_varlen_cost.py all
    PYTHONPATH=. python bench/probes/mask_varlen_cost.py gpu [--wg3]   # on the H200 (not run yet)

``tiles`` counts, for the mods suite's masks (bench/suite_mods.py: window 1024, 8 causal
documents, prefix-LM; 128 x 128 map; fwd_sm90's tiles: 128-row blocks of 2 warpgroups and 64-key
tiles for a block mask, 192-row blocks of 3 for the analytic window), the key tiles a block
visits, the warpgroup tiles that are partial (the traced mask_mod runs pair by pair), and the
4-block groups of the map that ``ModVariant::next_tile`` reads; then fits the measured times
(bench/results/h200/mods.json) per block as F + a x visited tiles + g x walk groups.
``varlen`` simulates the one-launch varlen forward's grid (90 work items x 32 heads, batch-major,
in-order dispatch, one block an SM) with per-block cost F + t x key tiles, F and t fitted to
plain causal 4k and 16k and checked on the dense-at-the-mean-length point.

Answers so far (bench/NOTES.md, no GPU yet): (1) the walk is ~0.39 us an SM per 4-block
group read on the loop's critical path (the four loads are serialised in the machine code),
18-31% of a block; the rest is a 1.75x dearer tile (2 warpgroups where 3 compile without
spills, tile_kind's dependent map load and run-time divisions before every S, the mask on every
tile); the per-pair mask_mod on partial tiles is the smallest term. (2) the model puts the
kernel at ~1.17 ms (363 TFLOP/s; longest-first over the whole grid 1.09 ms): the order explains
~7%, the partial tiles none (varlen's pairs fill its tiles better than the dense mean's); the
measured 1.93 ms likely holds the host path after the cu_seqlens read-back, which idles the
GPU (the `gpu` mode's kernel-alone time decides).
"""

from __future__ import annotations

import argparse
import heapq
import math
import sys
from pathlib import Path

import numpy

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

SMS = 132
BN = 64                       # fwd_sm90's key tile at d = 128 (both variants)
MAP = 128                     # cuflash.block_mask's default block (128 x 128)
WINDOW = 1024
H = 16                        # mods suite: H x d = 2048 at d = 128, B x L = 16k
#: measured (bench/results/h200/mods.json, commit 20e07a5): ms of the forward, bf16 d = 128
MODS_MS = {("window", 4096): 0.719616, ("document", 4096): 0.327616, ("prefix", 4096): 1.461152,
           ("window", 16384): 0.929216, ("document", 16384): 0.939424,
           ("prefix", 16384): 5.37088}
ANALYTIC_MS = {("plain", 4096): 0.69568, ("plain", 16384): 2.441376,
               ("window", 4096): 0.345536, ("window", 16384): 0.379968}


# ---------------------------------------------------------------------------------------------
# 1. Tiles of the block-mask and analytic forwards
# ---------------------------------------------------------------------------------------------

def mask_of(name: str, L: int):
    import suite_mods
    return suite_mods.mods_for(L, H)[name].mask_mod


def kind_map(name: str, L: int) -> numpy.ndarray:
    """The (Tq, Tk) map of cuflash.block_mask (0 empty, 1 partial, 2 full), one batch item."""
    fn, q = mask_of(name, L), numpy.arange(L)
    out = numpy.zeros((L // MAP, L // MAP), numpy.int8)
    for r in range(L // MAP):
        v = numpy.asarray(fn(0, 0, q[r * MAP:(r + 1) * MAP, None], q[None, :]))
        v = v.reshape(MAP, L // MAP, MAP)
        out[r] = numpy.where(v.all(axis=(0, 2)), 2, numpy.where(v.any(axis=(0, 2)), 1, 0))
    return out


def block_mask_counts(name: str, L: int, causal: bool = False) -> dict:
    """Per 128-row block of fwd_sm90 (the suite's call: causal=False, so n_blocks = Lk / 64):
    the key tiles the walk visits, the warpgroup tiles (2 a visited tile: both warpgroups of a
    128-row block read the same map row) that are partial, and the 4-block groups next_tile
    reads (from tile 0 for j0, then after every visited tile, up to n_blocks)."""
    K = kind_map(name, L)
    out = dict(blocks=L // MAP, tiles=0, wg_tiles=0, partial=0, groups=0)
    for r in range(L // MAP):
        row = K[r]
        n_blocks = math.ceil(min(L, (r + 1) * MAP) / BN) if causal else L // BN
        w_end = (min(n_blocks * BN, L) - 1) // MAP + 1
        visited = [t for t in range(n_blocks) if row[t * BN // MAP] != 0]
        out["tiles"] += len(visited)
        out["wg_tiles"] += 2 * len(visited)
        out["partial"] += 2 * sum(row[t * BN // MAP] == 1 for t in visited)
        for t in [0] + [x + 1 for x in visited]:
            if t >= n_blocks:
                continue
            w = t * BN // MAP
            while w < w_end:
                out["groups"] += 1
                if any(row[w + u] != 0 for u in range(4) if w + u < w_end):
                    break
                w += 4
    return out


def analytic_counts(L: int, window: bool, bm: int = 192) -> dict:
    """fwd_sm90 causal (and window (1024, 0)), 3 warpgroups: visited tiles a block, warpgroup
    tiles computed (a warpgroup computes from its first row's window start to its last row's
    diagonal)."""
    out = dict(blocks=math.ceil(L / bm), tiles=0, wg_tiles=0)
    for mb in range(out["blocks"]):
        m0 = mb * bm
        nb = math.ceil(min(L, m0 + bm) / BN)
        jf = max(0, m0 - WINDOW) // BN if window else 0
        out["tiles"] += nb - jf
        for w in range(bm // 64):
            r0 = m0 + 64 * w
            nwg = math.ceil(min(L, r0 + 64) / BN)
            jfw = max(0, r0 - WINDOW) // BN if window else 0
            out["wg_tiles"] += max(0, min(nb, nwg) - max(jf, jfw))
    return out


def visible_pairs(name: str, L: int) -> int:
    import suite_mods
    return suite_mods.visible_pairs(suite_mods.mods_for(L, H)[name], L)


def tiles_report() -> None:
    print("Per block (one block an SM; SM-time = ms x 132 / blocks):")
    rows = []
    for (name, L), ms in sorted(MODS_MS.items(), key=lambda x: (x[0][1], x[0][0])):
        c = block_mask_counts(name, L)
        items = (16384 // L) * H
        per_block = ms * 1e6 * SMS / (items * c["blocks"])
        rows.append((name, L, c, per_block))
        print(f"  block mask {name:9} L={L:5}: {c['tiles'] / c['blocks']:5.1f} tiles, "
              f"{c['partial'] / max(1, c['wg_tiles']):.2f} of warpgroup tiles partial, "
              f"{c['groups'] / c['blocks']:5.1f} walk groups; {per_block / 1e3:5.1f} us a block, "
              f"{per_block / c['wg_tiles'] * c['blocks'] / 1e3:.2f} us a warpgroup tile")
    for (name, L), ms in sorted(ANALYTIC_MS.items(), key=lambda x: (x[0][1], x[0][0])):
        c = analytic_counts(L, name == "window")
        items = (16384 // L) * H
        per_block = ms * 1e6 * SMS / (items * c["blocks"])
        print(f"  analytic   {name:9} L={L:5}: {c['tiles'] / c['blocks']:5.1f} tiles, "
              f"{c['wg_tiles'] / c['blocks']:5.1f} warpgroup tiles; {per_block / 1e3:5.1f} us a "
              f"block, {per_block / c['wg_tiles'] * c['blocks'] / 1e3:.2f} us a warpgroup tile")
    # fit: us a block = F + a tiles + g groups (+ p partial: not identifiable, see NOTES)
    A = numpy.array([[1, c["tiles"] / c["blocks"], c["groups"] / c["blocks"]]
                     for _, _, c, _ in rows])
    y = numpy.array([pb for *_, pb in rows])
    x, *_ = numpy.linalg.lstsq(A, y, rcond=None)
    err = (A @ x - y) / y
    print(f"Fit (6 block-mask points): F = {x[0] / 1e3:.2f} us a block, {x[1] / 1e3:.3f} us a "
          f"visited tile, {x[2] / 1e3:.3f} us a walk group; residuals "
          f"{', '.join(f'{e:+.1%}' for e in err)}")
    A4 = numpy.array([[1, c["tiles"] / c["blocks"], c["groups"] / c["blocks"],
                       c["partial"] / c["blocks"]] for _, _, c, _ in rows])
    x4, *_ = numpy.linalg.lstsq(A4, y, rcond=None)
    print(f"  with a partial-tile term: {x4[3] / 1e3:+.3f} us a partial warpgroup tile "
          f"(not identifiable: the per-pair mask_mod is not what costs)")
    F, a, g = x
    print("Predictions from the fit (same per-tile cost), TFLOP/s:")
    for (name, L), ms in sorted(MODS_MS.items(), key=lambda x: (x[0][1], x[0][0])):
        if name == "prefix":      # its mask_mod is not causal: causal=True would change it
            continue
        items = (16384 // L) * H
        flops = 4 * items * 128 * visible_pairs(name, L)
        out = []
        for label, c, gg in (("causal=True in the call", block_mask_counts(name, L, True), g),
                             ("walk off the critical path", block_mask_counts(name, L), 0.0)):
            t = (F + a * c["tiles"] / c["blocks"] + gg * c["groups"] / c["blocks"]) \
                * items * c["blocks"] / SMS / 1e6
            out.append(f"{label} {flops / t / 1e9:.0f}")
        print(f"  {name:9} L={L:5}: measured {flops / ms / 1e9:.0f}; " + "; ".join(out))


# ---------------------------------------------------------------------------------------------
# 2. Machine code: registers at 2 and 3 warpgroups, the main loop's size
# ---------------------------------------------------------------------------------------------

def hgmma_loop(section: str) -> list[str]:
    """The instructions (NOPs left out) of the longest loop of a function's SASS (nvdisasm
    text) that holds HGMMAs: the key-tile loop of a forward, the query-tile loop of a backward."""
    import re
    ins, labels = [], {}
    for line in section.splitlines():
        m = re.match(r"^(\.L_x_\d+):", line.strip())
        if m:
            labels[m.group(1)] = len(ins)
            continue
        m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", line)
        if m:
            ins.append(m.group(1))
    best = (0, 0)
    for i, t in enumerate(ins):
        m = re.search(r"BRA.*`\((\.L_x_\d+)\)", t)
        if m and labels.get(m.group(1), i + 1) <= i:
            lo = labels[m.group(1)]
            if any("HGMMA" in x for x in ins[lo:i + 1]) and i - lo > best[1] - best[0]:
                best = (lo, i)
    return [x for x in ins[best[0]:best[1] + 1] if "NOP" not in x]


def _main_loop(section: str) -> tuple[int, dict]:
    """Static instructions of the loop that holds the HGMMAs (the key-tile loop), by class."""
    body = hgmma_loop(section)
    count = {}
    for k in ("HGMMA", "MUFU", "LDG.E.U8", "LDGSTS", "BAR.SYNC", "I2F"):
        count[k] = sum(k in x for x in body)
    return len(body), count


def sass_report() -> None:
    from cuflash import _families, _jit, _trace, _trace_cuda
    from cuflash._variant import Variant
    fam, dev = _families.FAMILIES["fwd_sm90"], _families.PROFILES["h200"]
    nvrtc = _jit._nvrtc_for("sm_90a")
    L = 4096
    cases = [("plain causal", Variant(causal=True), None),
             ("window (1024, 0)", Variant(causal=True, window=True), None)]
    for name in ("window", "document", "prefix"):
        tr = _trace.trace_mask_mod(mask_of(name, L))
        v = Variant(causal=False, mask_mod=_trace_cuda.qualified_name(tr), block_mask=True,
                    prelude=tr.source)
        cases += [(f"block mask {name}", v, None), (f"block mask {name}, 3 warpgroups", v, 3)]
    for label, v, wg in cases:
        shape = _families.Shape("bfloat16", 64, L, L, 128, 128, v, False)
        t, flags, _ = fam.select(fam, shape, dev)
        if wg:
            t = t.replace(warpgroups=wg)
        expr = fam.expr("bfloat16", t, v, **flags)
        opts = _jit._options("sm_90a", ("--ptxas-options=-v",))
        log, lowered, cubin = nvrtc.compile(v.prelude + _jit.load_source(fam.source), fam.source,
                                            [expr], opts)
        if lowered is None:
            print(f"  {label}: does not compile\n{log[:500]}")
            continue
        res = _jit._parse_ptxas(log, lowered[expr])
        sections = _jit.sass_sections(cubin) or {}
        n, cls = _main_loop(sections.get(lowered[expr], ""))
        print(f"  {label:34} {t['warpgroups']} warpgroups: {res.get('registers')} registers, "
              f"{res.get('spill_stores', 0) + res.get('spill_loads', 0)} spill bytes; key-tile "
              f"loop {n} instructions (static) {cls}")


# ---------------------------------------------------------------------------------------------
# 3. Varlen: the one-launch grid on 132 SMs
# ---------------------------------------------------------------------------------------------

VARLEN_LENGTHS = [152, 1428, 618, 386, 358, 2965, 5170, 151, 1520, 272, 3364]
VARLEN_HEADS, BM_VARLEN = 32, 192      # fwd_sm90 at d = 128: 3 warpgroups, one block an SM


def makespan(costs) -> float:
    """In-order dispatch of blocks to the first free SM, one block an SM."""
    free = [0.0] * SMS
    heapq.heapify(free)
    end = 0.0
    for c in costs:
        t = heapq.heappop(free) + c
        end = max(end, t)
        heapq.heappush(free, t)
    return end


def key_tiles(L: int, m: int) -> int:
    """Key tiles the block of Q tile m visits (causal, aligned: the last row's diagonal)."""
    return math.ceil(min(L, (m + 1) * BM_VARLEN) / BN)


def dense_grid(L: int, items: int) -> list[int]:
    """fwd_sm90's causal grid (tile-major: the heaviest Q tile of every item first)."""
    nt = math.ceil(L / BM_VARLEN)
    return [key_tiles(L, nt - 1 - t) for t in range(nt) for _ in range(items)]


def fit_dense() -> tuple[float, float]:
    """F, t (us) with makespan(F + t x tiles) = plain causal's measured 4k and 16k times."""
    pts = [(dense_grid(4096, 64), ANALYTIC_MS[("plain", 4096)] * 1e3),
           (dense_grid(16384, 16), ANALYTIC_MS[("plain", 16384)] * 1e3)]
    best = None
    for F in numpy.arange(0.0, 12.0, 0.05):
        lo, hi = 0.1, 5.0
        for _ in range(40):
            mid = (lo + hi) / 2
            slow = makespan([F + mid * x for x in pts[1][0]]) > pts[1][1]
            lo, hi = (lo, mid) if slow else (mid, hi)
        err = abs(makespan([F + lo * x for x in pts[0][0]]) - pts[0][1])
        if best is None or err < best[0]:
            best = (err, F, lo)
    return best[1], best[2]


def varlen_report() -> None:
    from cuflash import _inference_varlen
    F, t = fit_dense()
    print(f"Cost model: F = {F:.2f} us a block + {t:.3f} us a key tile (fitted to plain causal "
          f"4k, 16k)")
    dm = makespan([F + t * x for x in dense_grid(1489, 11 * VARLEN_HEADS)])
    print(f"  check: dense at the mean length (11 x 32 items of 1489): {dm / 1e3:.3f} ms "
          f"(measured 0.612)")
    cu = numpy.concatenate([[0], numpy.cumsum(VARLEN_LENGTHS)])
    wl = _inference_varlen.work_list(cu, cu, BM_VARLEN, True)
    items = [key_tiles(int(w[1]), int(w[4])) for w in wl]
    cost = [F + t * x for x in items]
    current = [c for _ in range(VARLEN_HEADS) for c in cost]         # b = bid / items
    item_major = [c for c in cost for _ in range(VARLEN_HEADS)]      # longest first, grid-wide
    pairs = sum(L * (L + 1) // 2 for L in VARLEN_LENGTHS)
    flops = 4 * VARLEN_HEADS * 128 * pairs
    for label, seq in (("batch-major (sessions 5-6: each head heaviest first)", current),
                       ("item-major (session 7's varlen build: longest first over the grid)",
                        item_major)):
        ms = makespan(seq) / 1e3
        print(f"  {label}: {ms:.3f} ms = {flops / ms / 1e9:.0f} TFLOP/s on real pairs")
    print(f"  lower bound (sum / 132): {sum(current) / SMS / 1e3:.3f} ms; measured 1.929 ms "
          f"(221 TFLOP/s), events around the whole call")
    area = sum(x * BM_VARLEN * BN for x in items)
    dense = dense_grid(1489, 1)
    print(f"  real pairs / computed tile area: varlen {pairs / area:.3f}, dense mean "
          f"{1489 * 1490 // 2 / (sum(dense) * BM_VARLEN * BN):.3f}")


# ---------------------------------------------------------------------------------------------
# 4. On the GPU (next session): the confirmations
# ---------------------------------------------------------------------------------------------

def kernel_alone_ms(q, k, v, cu_host, causal, iters: int = 20) -> tuple:
    """(ms, max |diff|): CUDA-event time of the one-launch varlen forward's kernel alone (its
    ``_inference_varlen.ForwardLaunch`` built once, its work list kept alive, replayed between
    the events: no validation, no read-back, no host work in the timing), and its output against
    ``attention_varlen``'s. (None, why) where the one-launch path does not apply. Shared with
    bench/suite_varlen.py (its ``cuflash_varlen_kernel`` rows)."""
    import cupy
    from cuflash import _inference_varlen, _problem, _varlen
    import suite_common
    prob = _problem.make_problem(q, k, v, scale=None, causal=causal)
    cu_h = numpy.asarray(cu_host).astype(numpy.int64)
    o = cupy.empty(prob.batch_shape + (prob.Lq, prob.dv), prob.dtype)
    lse = cupy.empty(prob.batch_shape + (prob.Lq,), prob.lse_dtype)
    plan = _inference_varlen.forward_plan(prob, cu_h, cu_h, causal, o, lse)
    if isinstance(plan, str):
        return None, plan
    stream = cupy.cuda.get_current_stream().ptr
    ptrs = [x.data.ptr for x in (prob.q, prob.k, prob.v, o, lse)]
    ms = suite_common.median_event_ms(lambda i: plan(stream, *ptrs), 1, iters)
    ref = _varlen.attention_varlen(q, k, v, cu_host, cu_host, causal=causal)
    plan(stream, *ptrs)
    diff = float(cupy.abs(o.astype(cupy.float32) - ref.astype(cupy.float32)).max())
    return ms, diff


def gpu(wg3: bool) -> None:
    """(a) varlen: CUDA events around the whole call (as suite_varlen) against the kernel alone
    (the same launch replayed, its work list kept alive) and the host time of a call after a
    sync; (b) the window / document block masks with causal=False (the suite) and causal=True
    (same function: their mask_mods hold the causality), against the analytic window; with
    --wg3 (a fresh process), fwd_sm90 keeps the table's 3 warpgroups for a Variant whose only
    per-element code is the mask_mod (outputs compared with the 2-warpgroup run are printed)."""
    import time
    import cupy
    import ml_dtypes
    import cuflash
    from cuflash import _families, _varlen
    import suite_common
    import suite_mods
    bf16 = numpy.dtype(ml_dtypes.bfloat16)

    if wg3:
        original = _families.modifier_tiles

        def keep_warpgroups(family, t, variant, why):
            only_mask_mod = variant.mask_mod and not (
                variant.softcap or variant.alibi_slopes or variant.bias or variant.mask
                or variant.sink or variant.score_mod)
            if family == "fwd_sm90" and only_mask_mod:
                why.append("probe: the table's warpgroups kept for a mask_mod alone")
                return t
            return original(family, t, variant, why)
        _families.modifier_tiles = keep_warpgroups

    # (a) varlen, 16k tokens, 32 heads, d = 128, causal
    total = sum(VARLEN_LENGTHS)
    rs = cupy.random.RandomState(1)
    q, k, v = (rs.standard_normal((VARLEN_HEADS, 1, total, 128), dtype=cupy.float32).astype(bf16)
               for _ in range(3))
    cu = cupy.asarray(numpy.concatenate([[0], numpy.cumsum(VARLEN_LENGTHS)]).astype(numpy.int32))
    call_ms = suite_common.median_event_ms(
        lambda i: _varlen.attention_varlen(q, k, v, cu, cu, causal=True))
    cupy.cuda.Device().synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        cupy.cuda.Device().synchronize()
        _varlen.attention_varlen(q, k, v, cu, cu, causal=True)
    cupy.cuda.Device().synchronize()
    host_and_kernel_ms = (time.perf_counter() - t0) / 20 * 1e3
    cu_h = cupy.asnumpy(cu)
    kernel_ms, same = kernel_alone_ms(q, k, v, cu_h, True)
    host_ms = suite_common.median_event_ms(
        lambda i: _varlen.attention_varlen(q, k, v, cu_h, cu_h, causal=True))
    pairs = sum(L * (L + 1) // 2 for L in VARLEN_LENGTHS)
    fl = 4 * VARLEN_HEADS * 128 * pairs / 1e9
    print(f"varlen: whole call (events) {call_ms:.3f} ms = {fl / call_ms:.0f} TFLOP/s; with "
          f"NumPy cu_seqlens (no read-back) {host_ms:.3f} ms = {fl / host_ms:.0f}; kernel "
          f"alone {kernel_ms:.3f} ms = {fl / kernel_ms:.0f}; sync + call + sync "
          f"{host_and_kernel_ms:.3f} ms; replay vs call max |diff| {same}")
    del q, k, v

    # (b) block masks, d = 128, L = 4k and 16k, B x L = 16k, H = 16
    for L in (4096, 16384):
        B = 16384 // L
        rng = numpy.random.default_rng(L)
        x = [cupy.asarray(rng.standard_normal((B, H, L, 128)).astype(bf16)) for _ in range(3)]
        mods = suite_mods.mods_for(L, H)
        ms = suite_common.median_event_ms(lambda i: cuflash.attention(*x, causal=True,
                                                                      window=(WINDOW, 0)))
        fl = 4 * B * H * 128 * visible_pairs("window", L) / 1e9
        print(f"L={L}: analytic window {fl / ms:.0f} TFLOP/s")
        for name in ("window", "document"):
            bm = cuflash.block_mask(mods[name].mask_mod, (1, 1), L, L)
            fl = 4 * B * H * 128 * visible_pairs(name, L) / 1e9
            outs = []
            for causal in (False, True):
                try:
                    ms = suite_common.median_event_ms(
                        lambda i: cuflash.attention(*x, causal=causal, block_mask=bm))
                    outs.append(cuflash.attention(*x, causal=causal, block_mask=bm))
                except Exception as exc:     # report and go on: one point, not the run
                    print(f"  block mask {name:8} causal={causal!s:5}: {type(exc).__name__}: {exc}")
                    continue
                print(f"  block mask {name:8} causal={causal!s:5} {'3 wg' if wg3 else '2 wg'}: "
                      f"{fl / ms:.0f} TFLOP/s")
            if len(outs) < 2:
                continue
            d = float(cupy.abs(outs[0].astype(cupy.float32) - outs[1].astype(cupy.float32)).max())
            print(f"    causal=False vs True max |diff| {d}")
            mine = cupy.asnumpy(outs[0]).astype(numpy.float32)
            numpy.save(f"/tmp/probe_{name}_{L}_{'wg3' if wg3 else 'wg2'}.npy", mine)
            other = Path(f"/tmp/probe_{name}_{L}_{'wg2' if wg3 else 'wg3'}.npy")
            if other.exists():     # the other run's output (same inputs: seeded)
                d = float(numpy.abs(numpy.load(other) - mine).max())
                print(f"    2 vs 3 warpgroups max |diff| {d}")
        del x
        cupy.get_default_memory_pool().free_all_blocks()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("mode", choices=("tiles", "sass", "varlen", "all", "gpu"))
    ap.add_argument("--wg3", action="store_true",
                    help="gpu: 3 warpgroups for mask_mod-only Variants")
    a = ap.parse_args(argv)
    if a.mode == "gpu":
        gpu(a.wg3)
        return 0
    if a.mode in ("tiles", "all"):
        tiles_report()
    if a.mode in ("sass", "all"):
        sass_report()
    if a.mode in ("varlen", "all"):
        varlen_report()
    return 0


if __name__ == "__main__":
    sys.exit(main())
