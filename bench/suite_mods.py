#!/usr/bin/env python3
"""Benchmark suite ``mods`` (issue 10, item 7): attention with modifiers, cuflash against
``torch.compile``d FlexAttention (the same functions and block mask) and PyTorch SDPA with a
dense bias / mask where SDPA can express the modifier, in one process and one run.

Points: bf16; d 64 and 128; L 4k and 16k (B x L = 16k tokens, H x d = 2048, as the fwd suite);
forward and forward + backward; modifiers (``MODS``):

- ``softcap``  softcap 50, not causal (SDPA cannot express it: no row)
- ``alibi``    ALiBi slopes 2^(-8 (h + 1) / H), causal (SDPA: a dense (1, H, L, L) float bias)
- ``window``   sliding window of 1024 keys, causal (SDPA: a dense (L, L) bool mask)
- ``document`` 8 equal documents, causal within each (FlexAttention: its block mask)
- ``prefix``   prefix-LM: keys of the first L/4 positions are visible to every query, the rest
               causally
- ``bias``     a dense learnable float bias (H, L, L) broadcast over B; fwd+bwd includes dbias
- ``plain``    causal attention without modifiers, the baseline of the causal targets (ALiBi
               within 10%; window's TFLOP/s on visible pairs >= 0.85x plain causal)
- ``full``     attention without modifiers and without causal, the softcap's baseline (within
               10%; session 18: before it, the softcap's cost was read against another run)

Every implementation computes the same function: ``MODS[name]`` holds the one definition of
each modifier, as the cuflash keywords and as the FlexAttention ``score_mod`` / ``mask_mod``
(plain Python operators, so the same functions run on NumPy in the CPU test of this file's
logic, tests/test_modifiers_bench.py). cuflash runs the document and prefix masks from a dense
``mask=`` array, and again (``impl = "cuflash_block_mask"``, forward and fwd+bwd) from the same
mask_mod through ``cuflash.block_mask`` (traced into the kernel; the tiles its map calls empty are
neither loaded nor computed in fwd_sm80 / fwd_sm90 / bwd_sm80), with ``causal=True`` where the
mask_mod is causal itself (window, document: ``Mod.mask_causal``). A point an implementation cannot run is a
row with ``tflops = None`` and the reason (SDPA cannot express softcap). The modifiers' backward
runs on bwd_sm90 on Hopper where ``_traits.BWD_SM90_MODIFIERS`` lists them (softcap, window, sink,
ALiBi; mask_mod at d <= 64), else on bwd_sm80; ``CUFLASH_BWD=sm80`` keeps every row on bwd_sm80.

Method (as bench/suite_decode.py): ``ms`` = median CUDA-event time of one call through the
public function on CuPy's current stream (torch on the same stream through DLPack views, no
copy), after warm-up, inputs rotating over a few sets; ``tflops`` counts the visible pairs only:
forward 4 x B x H x d x pairs, fwd+bwd 3.5x that (FlashAttention's convention, halved causal
generalised to any mask). Rows: ``impl, suite, mode, dtype, d, L, causal, isolated, tflops, ms,
mod`` (+ ``note``).

``--rounds R`` times each (d, L)'s modifiers R times in rotated orders and keeps the median of
each row (``tflops_rounds``: every round's): the issue's cost targets are ratios of two rows
(a modifier over plain), which one pass in a fixed order moved by 5-10% from run to run.

Run: ``PYTHONPATH=. python bench/suite_mods.py --out bench/results/h200/mods.json`` (``--quick``:
d 128, L 4k); ``run_mods_suite()`` returns the rows for bench/bench_attention.py to wire in.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from typing import Callable

import pathlib as _pathlib

sys.path.insert(0, str(_pathlib.Path(__file__).resolve().parent))
from suite_common import (arm_orders, bf16_zeros, compile_flex, finish,  # noqa: E402
                          median_event_ms, warm_arms)   # (bench/, beside this file)

TOKENS, WIDTH = 16384, 2048
WINDOW, SOFTCAP, DOCUMENTS = 1024, 50.0, 8


@dataclasses.dataclass(frozen=True)
class Mod:
    """One modifier of the suite: its FlexAttention functions and cuflash's keywords."""
    name: str
    causal: bool
    score_mod: Callable | None = None      # (score, b, h, q, kv) -> score, FlexAttention's
    mask_mod: Callable | None = None       # (b, h, q, kv) -> bool, FlexAttention's
    sdpa: str | None = None                # "bias" / "mask": how SDPA expresses it, or None
    #: the mask_mod hides every key after the query (window, document): its block-mask row
    #: also passes ``causal=True``, so the kernels bound the walk analytically and read the map
    #: only inside the causal band (the same function; what a user who knows it would write)
    mask_causal: bool = False


def alibi_slopes(H: int):
    """ALiBi's geometric slopes 2^(-8 (h + 1) / H) (Press et al.), float32 NumPy."""
    import numpy
    return (2.0 ** (-8.0 * (numpy.arange(H) + 1) / H)).astype(numpy.float32)


def _window(b, h, q, kv):
    return (q >= kv) & (q - kv <= WINDOW)


def _document_of(L: int):
    size = L // DOCUMENTS
    return lambda b, h, q, kv: ((q // size) == (kv // size)) & (q >= kv)


def _prefix_of(L: int):
    prefix = L // 4
    return lambda b, h, q, kv: (kv < prefix) | (q >= kv)


def _softcap(score, b, h, q, kv):
    import torch
    return SOFTCAP * torch.tanh(score / SOFTCAP)


def mods_for(L: int, H: int, torch=None) -> dict[str, Mod]:
    """The suite's modifiers at length L with H heads (``torch``: the module, for the ALiBi
    score_mod's slope tensor; without it that score_mod is None)."""
    alibi = None
    if torch is not None:
        slopes = torch.as_tensor(alibi_slopes(H), device="cuda")

        def alibi(score, b, h, q, kv):
            return score - slopes[h] * (q - kv).abs()

    return {
        "plain": Mod("plain", True, sdpa="causal"),
        "full": Mod("full", False, sdpa="full"),
        "softcap": Mod("softcap", False, score_mod=_softcap),
        "alibi": Mod("alibi", True, score_mod=alibi, sdpa="bias"),
        "window": Mod("window", True, mask_mod=_window, sdpa="mask", mask_causal=True),
        "document": Mod("document", False, mask_mod=_document_of(L), sdpa="mask",
                        mask_causal=True),
        "prefix": Mod("prefix", False, mask_mod=_prefix_of(L), sdpa="mask"),
        "bias": Mod("bias", False, sdpa="bias"),
    }


def point_qkv(d: int, L: int):
    """(B, H, q, k, v) of the suite's point at head dim d and length L as the probes time it:
    B x L = 16k tokens, H x d = 2048, bfloat16 CuPy arrays of standard normals seeded L + d."""
    import cupy
    import ml_dtypes
    import numpy
    H, B = WIDTH // d, max(1, TOKENS // L)
    rng = numpy.random.default_rng(L + d)
    bf16 = numpy.dtype(ml_dtypes.bfloat16)
    q, k, v = (cupy.asarray(rng.standard_normal((B, H, L, d)).astype(bf16)) for _ in range(3))
    return B, H, q, k, v


def visible_pairs(mod: Mod, L: int) -> int:
    """Query/key pairs the modifier leaves visible (the FLOP count's pairs), per (b, h)."""
    import numpy
    if mod.name in ("full", "softcap", "bias"):
        return L * L
    if mod.name in ("plain", "alibi"):
        return L * (L + 1) // 2
    total = 0
    q = numpy.arange(L)
    for start in range(0, L, 1024):       # rows in chunks: L x 1024 booleans at a time
        rows = q[start:start + 1024, None]
        total += int(numpy.count_nonzero(mod.mask_mod(0, 0, rows, q[None, :])))
    return total


def cuflash_kwargs(mod: Mod, L: int, H: int, xp, bias=None) -> dict:
    """The cuflash keywords of ``mod`` (arrays of module ``xp``): the document and prefix masks
    as a dense bool (L, L) mask, broadcast over (B, H)."""
    kw = {"causal": mod.causal}
    if mod.name == "softcap":
        kw["softcap"] = SOFTCAP
    elif mod.name == "alibi":
        kw["alibi_slopes"] = xp.asarray(alibi_slopes(H))
    elif mod.name == "window":
        kw["window"] = (WINDOW, 0)
    elif mod.name in ("document", "prefix"):
        i = xp.arange(L)
        kw["mask"] = mod.mask_mod(0, 0, i[:, None], i[None, :])   # causality included
    elif mod.name == "bias":
        kw["bias"] = bias
    return kw


def _row(impl, mode, d, L, mod, ms, flops, note=None, causal=None):
    row = {"impl": impl, "suite": "mods", "mode": mode, "dtype": "bfloat16", "d": d, "L": L,
           "causal": causal, "isolated": False, "mod": mod,
           "tflops": None if ms is None else flops / (ms * 1e-3) / 1e12, "ms": ms}
    if note:
        row["note"] = note
    return row


def _time(fn, n_sets, iters=20, warmup=3):
    return median_event_ms(fn, n_sets, iters, warmup)


def _note(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"


def _torch():
    try:
        import torch
    except Exception as exc:
        return None, f"torch unavailable: {exc}"
    if not torch.cuda.is_available():
        return None, "torch.cuda.is_available() is False"
    return torch, None


def warm_jobs(ds, lengths, modes, names) -> list:
    """One zero-argument call a (d, L, modifier, mode) point: cuflash's call of that point on
    zeros of the timed shapes (never timed), so that its kernels compile in parallel threads
    before the timed loop, which otherwise compiled them one after the other (session 8's run
    stopped at its time limit mostly compiling). The dense bias is skipped (its array is the
    point's, up to 8 GB); its kernels compile in the timed loop's warm-up."""
    import functools
    jobs = []
    for d in ds:
        H = WIDTH // d
        for L in lengths:
            for name, mod in mods_for(L, H).items():
                if name != "bias" and (not names or name in names):
                    jobs += [functools.partial(_warm_point, mod, mode, d, L, H) for mode in modes]
    return jobs


def _warm_point(mod, mode, d, L, H):
    import cupy
    import cuflash
    q = bf16_zeros((max(1, TOKENS // L), H, L, d))
    kws = [cuflash_kwargs(mod, L, H, cupy)]
    if mod.mask_mod is not None:
        kws.append({"block_mask": cuflash.block_mask(mod.mask_mod, (1, 1), L, L),
                    "causal": mod.mask_causal})
    for kw in kws:
        if mode == "fwd":
            cuflash.attention(q, q, q, **kw)
        else:
            cuflash.attention_vjp(q, q, q, **kw)[1](q)


def median_rows(timed: list[list[dict]]) -> list[dict]:
    """One row per implementation and point from ``rounds`` passes (``timed``: the rows of each
    pass, in any order): the pass whose TFLOP/s is the median (the lower middle of an even
    count), with every pass's figure in ``tflops_rounds``; a point no pass timed keeps its first
    row (its note says why)."""
    by_key: dict = {}
    for rows in timed:
        for r in rows:
            by_key.setdefault((r["impl"], r["mode"], r["d"], r["L"], r["mod"]), []).append(r)
    out = []
    for rs in by_key.values():
        ok = sorted((r for r in rs if r["tflops"] is not None), key=lambda r: r["tflops"])
        if not ok:
            out.append(rs[0])
            continue
        row = dict(ok[(len(ok) - 1) // 2])
        if len(rs) > 1:
            row["tflops_rounds"] = [r["tflops"] for r in rs]
        out.append(row)
    return out


def run_mods_suite(ds=(64, 128), lengths=(4096, 16384), modes=("fwd", "fwd_bwd"),
                   names=None, peers=True, n_sets=2, log=print, warm=True,
                   on_point=None, rounds=1) -> list[dict]:
    """Every (d, L, mode, modifier) point for cuflash, FlexAttention and SDPA; the rows
    (``warm``: compile cuflash's kernels of every point first, in parallel: :func:`warm_jobs`;
    ``on_point(rows)`` after each point: the script writes its JSON so far, so a run cut by a
    time limit keeps what it measured, as session 17's call 3 did not). ``rounds`` > 1: each
    (d, L)'s modifiers are timed that many times, their order rotated by one a round, and each
    row is the median (:func:`median_rows`): a modifier's cost over plain attention is a ratio of
    two rows, and one pass in a fixed order moved such a ratio by 5-10% between runs (session
    18: plain causal d 128 4k read 527 and 517 in two runs, 447-461 in an interleaved probe)."""
    import cupy
    import numpy
    import cuflash
    torch, torch_why = _torch() if peers else (None, "peers off")
    flex = compiled = create_block_mask = None
    flex_why = torch_why
    if torch is not None:
        try:
            from torch.nn.attention.flex_attention import create_block_mask
            compiled = compile_flex(torch)
            flex = True
        except Exception as exc:
            flex_why = _note(exc)
    rows: list[dict] = []
    import ml_dtypes
    bf16 = numpy.dtype(ml_dtypes.bfloat16)
    if warm:
        warm_arms(("default",), {"default": {}}, warm_jobs(ds, lengths, modes, names))
    for d in ds:
        H = WIDTH // d
        for L in lengths:
            B = max(1, TOKENS // L)
            rng = numpy.random.default_rng(L + d)
            sets = []
            for _ in range(n_sets):
                q, k, v = (cupy.asarray(rng.standard_normal((B, H, L, d)).astype(bf16))
                           for _ in range(3))
                sets.append((q, k, v))
            bias = cupy.asarray((rng.standard_normal((H, L, L)) * 0.5).astype(bf16)) \
                if "bias" in (names or ("bias",)) and H * L * L * 2 <= 8e9 else None
            items = [(name, mod) for name, mod in mods_for(L, H, torch).items()
                     if not names or name in names]
            done, timed = len(rows), []
            for rnd, order in enumerate(arm_orders(items, rounds)):
                timed.append([])
                for name, mod in order:
                    pairs = visible_pairs(mod, L)
                    for mode in modes:
                        flops = 4 * B * H * d * pairs * (3.5 if mode == "fwd_bwd" else 1.0)
                        t0 = time.perf_counter()
                        point = _cuflash_point(cuflash, cupy, mod, mode, d, L, H, sets, bias, flops)
                        if flex:
                            point += _flex_point(torch, compiled, create_block_mask, mod, mode, d,
                                                 L, B, H, sets, bias, flops)
                        else:
                            point.append(_row("flex", mode, d, L, name, None, flops, flex_why))
                        if torch is not None:
                            point += _sdpa_point(torch, mod, mode, d, L, B, H, sets, bias, flops)
                        else:
                            point.append(_row("sdpa", mode, d, L, name, None, flops, torch_why))
                        timed[-1] += point
                        log((f"[round {rnd + 1}/{rounds}] " if rounds > 1 else "")
                            + f"{name:8} {mode:7} d={d} L={L}: " + ", ".join(
                                f"{r['impl']} {r['tflops']:.0f}" if r["tflops"] else f"{r['impl']} -"
                                for r in point) + f" TFLOP/s ({time.perf_counter() - t0:.0f} s)")
                        rows[done:] = median_rows(timed) if rounds > 1 else timed[0]
                        if on_point is not None:
                            on_point(rows)
            del sets, bias
            cupy.get_default_memory_pool().free_all_blocks()
    return rows


def _cuflash_point(cuflash, cupy, mod, mode, d, L, H, sets, bias, flops):
    out = []
    if mod.name == "bias" and bias is None:
        return [_row("cuflash", mode, d, L, mod.name, None, flops, "bias larger than 8 GB")]
    kw = cuflash_kwargs(mod, L, H, cupy, bias=bias)
    try:
        if mode == "fwd":
            ms = _time(lambda i: cuflash.attention(*sets[i], **kw), len(sets))
        else:
            dos = [cupy.ones_like(s[0]) for s in sets]

            def step(i):
                o, pullback = cuflash.attention_vjp(*sets[i], **kw)
                return pullback(dos[i])
            ms = _time(step, len(sets))
        note = "dense mask= array" if "mask" in kw else None
        out.append(_row("cuflash", mode, d, L, mod.name, ms, flops, note, kw.get("causal")))
    except Exception as exc:
        out.append(_row("cuflash", mode, d, L, mod.name, None, flops, _note(exc)))
    if mod.mask_mod is not None:   # the user-function path: the mask_mod traced, its block mask
        bkw = {"block_mask": cuflash.block_mask(mod.mask_mod, (1, 1), L, L),
               "causal": mod.mask_causal}
        try:
            if mode == "fwd":
                ms = _time(lambda i: cuflash.attention(*sets[i], **bkw), len(sets))
            else:
                dos = [cupy.ones_like(s[0]) for s in sets]
                ms = _time(lambda i: cuflash.attention_vjp(*sets[i], **bkw)[1](dos[i]), len(sets))
            out.append(_row("cuflash_block_mask", mode, d, L, mod.name, ms, flops,
                            causal=mod.mask_causal))
        except Exception as exc:
            out.append(_row("cuflash_block_mask", mode, d, L, mod.name, None, flops, _note(exc),
                            causal=mod.mask_causal))
    return out


def _flex_point(torch, compiled, create_block_mask, mod, mode, d, L, B, H, sets, bias, flops):
    tq = [[torch.from_dlpack(x) for x in s] for s in sets]
    try:
        bm = None
        mask_mod = mod.mask_mod
        if mask_mod is None and mod.causal:
            mask_mod = lambda b, h, q, kv: q >= kv   # noqa: E731
        if mask_mod is not None:
            bm = create_block_mask(mask_mod, None, None, L, L, device="cuda")
        score_mod = mod.score_mod
        tb = None
        if mod.name == "bias":
            tb = torch.from_dlpack(bias).detach().requires_grad_(mode == "fwd_bwd")
            score_mod = lambda s, b, h, q, kv: s + tb[h, q, kv]   # noqa: E731
        if mode == "fwd":
            with torch.no_grad():
                ms = _time(lambda i: compiled(*tq[i], score_mod=score_mod, block_mask=bm),
                           len(sets))
        else:
            leaves = [[x.detach().requires_grad_() for x in s] for s in tq]

            def step(i):
                o = compiled(*leaves[i], score_mod=score_mod, block_mask=bm)
                o.backward(torch.ones_like(o))
            ms = _time(step, len(sets))
        return [_row("flex", mode, d, L, mod.name, ms, flops)]
    except Exception as exc:
        return [_row("flex", mode, d, L, mod.name, None, flops, _note(exc))]


def _sdpa_point(torch, mod, mode, d, L, B, H, sets, bias, flops):
    if mod.sdpa is None:
        return [_row("sdpa", mode, d, L, mod.name, None, flops, "SDPA cannot express it")]
    tq = [[torch.from_dlpack(x) for x in s] for s in sets]
    F = torch.nn.functional
    try:
        kw = {}   # (sdpa "full": no mask at all)
        if mod.sdpa == "causal":
            kw["is_causal"] = True
        elif mod.sdpa == "mask":
            i = torch.arange(L, device="cuda")
            kw["attn_mask"] = mod.mask_mod(0, 0, i[:, None], i[None, :])
        elif mod.name == "alibi":
            if H * L * L * 2 > 8e9:
                return [_row("sdpa", mode, d, L, mod.name, None, flops, "dense bias > 8 GB")]
            i = torch.arange(L, device="cuda")
            slopes = torch.as_tensor(alibi_slopes(H), device="cuda")
            dist = (i[:, None] - i[None, :]).abs().to(torch.float32)
            causal = i[None, :] <= i[:, None]
            b = torch.where(causal, -slopes[:, None, None] * dist, float("-inf"))
            kw["attn_mask"] = b.to(torch.bfloat16)[None]
        elif mod.name == "bias":
            if bias is None:
                return [_row("sdpa", mode, d, L, mod.name, None, flops, "bias larger than 8 GB")]
            kw["attn_mask"] = torch.from_dlpack(bias)[None].detach().requires_grad_(
                mode == "fwd_bwd")
        if mode == "fwd":
            with torch.no_grad():
                ms = _time(lambda i: F.scaled_dot_product_attention(*tq[i], **kw), len(sets))
        else:
            leaves = [[x.detach().requires_grad_() for x in s] for s in tq]

            def step(i):
                o = F.scaled_dot_product_attention(*leaves[i], **kw)
                o.backward(torch.ones_like(o))
            ms = _time(step, len(sets))
        return [_row("sdpa", mode, d, L, mod.name, ms, flops)]
    except Exception as exc:
        return [_row("sdpa", mode, d, L, mod.name, None, flops, _note(exc))]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", help="write the rows here as JSON")
    p.add_argument("--quick", action="store_true", help="d 128, L 4k only")
    p.add_argument("--d", help="comma-separated head dims (default 64,128)")
    p.add_argument("--L", help="comma-separated lengths (default 4096,16384)")
    p.add_argument("--mods", help="comma-separated subset of " + ", ".join(
        ("plain", "full", "softcap", "alibi", "window", "document", "prefix", "bias")))
    p.add_argument("--modes", default="fwd,fwd_bwd")
    p.add_argument("--no-peers", action="store_true")
    p.add_argument("--rounds", type=int, default=1,
                   help="time each (d, L)'s modifiers this many times in rotated orders; rows are "
                        "medians (tflops_rounds holds each round's)")
    p.add_argument("--no-warm", action="store_true",
                   help="compile each point's kernels in the timed loop instead of first")
    a = p.parse_args(argv)
    kw = dict(peers=not a.no_peers, modes=tuple(a.modes.split(",")), warm=not a.no_warm,
              names=tuple(a.mods.split(",")) if a.mods else None, rounds=a.rounds)
    if a.quick:
        kw.update(ds=(128,), lengths=(4096,))
    if a.d:
        kw["ds"] = tuple(int(x) for x in a.d.split(","))
    if a.L:
        kw["lengths"] = tuple(int(x) for x in a.L.split(","))
    t0 = time.perf_counter()

    def so_far(rows):   # (complete: False until the last point; finish() writes the whole)
        if a.out:
            with open(a.out, "w") as f:
                json.dump({"meta": {"suite": "mods", "seconds": time.perf_counter() - t0,
                                    "complete": False}, "rows": rows}, f, indent=1)
    rows = run_mods_suite(**kw, on_point=so_far)
    meta = {"suite": "mods", "seconds": time.perf_counter() - t0, "complete": True}
    return finish(meta, rows, a.out)


if __name__ == "__main__":
    sys.exit(main())
