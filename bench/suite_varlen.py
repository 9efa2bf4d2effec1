#!/usr/bin/env python3
"""Benchmark suite ``varlen`` (issue 11, item 7): packed variable-length prefill, TFLOP/s on
real pairs.

16k packed tokens (``TOTAL`` = 16384) in mixed lengths between 64 and 8k, bf16, d = 128, 32
query heads (MHA, and GQA 32/8), causal and not. In one process and one run:

- ``cuflash_varlen``: ``cuflash.attention_varlen``, the one-launch varlen build
  (cuflash/_inference_varlen.py), called as a user calls it with CuPy ``cu_seqlens``: since
  session 7 one read-back of both (a device sync inside the events), then the cached plan
  (``_varlen``: validation, work list and upload done by the first call only);
- ``cuflash_varlen_host``: the same call with NumPy ``cu_seqlens`` (no read-back, no sync: the
  host queues ahead of the GPU, as dense ``attention()`` does);
- ``cuflash_varlen_kernel``: the kernel alone, its launch replayed between the events
  (``kernel_alone_ms`` of bench/probes/mask_varlen_cost.py; ``max_diff_vs_call`` its output
  against the call's);
- ``cuflash_varlen_loop``: the same call with ``CUFLASH_VARLEN_KERNEL=0``: one
  ``cuflash.attention`` per sequence (the path before the varlen build);
- ``cuflash_padded``: ``cuflash.attention`` on the padded batch (n_seq, H, Lmax, d): the work a
  dense kernel does without varlen (its result is not the varlen result: padded keys are
  attended; timing only);
- ``cuflash_dense_mean``: ``cuflash.attention`` on a dense batch of TOTAL / mean sequences of the
  mean length: the issue's target is varlen >= 0.9x this;
- ``flex_document``: PyTorch FlexAttention on the packed (1, H, TOTAL, d) tensors with a document
  mask (and the causal mask), ``torch.compile``d, block mask built once outside the timing.

``tflops`` = FLOPs of the real (visible) pairs / time, for every row: 4 x d x Hq x pairs, pairs
= sum over sequences of Lq x Lk (non-causal) or L (L + 1) / 2 (causal); for
``cuflash_dense_mean`` the pairs of its own batch. ``ms`` = median of CUDA-event times over calls
after warm-up. Each mix is checked once first: cuflash_varlen against cuflash_varlen_loop (max
abs difference, in the row as ``max_diff_vs_loop``).

Run: ``PYTHONPATH=. python bench/suite_varlen.py --out $OUT/varlen.json`` (about 2-4 min on an
H200, most of it FlexAttention's compile); ``--no-peers`` skips torch; ``run_varlen_suite()``
returns the rows for bench/bench_attention.py to wire in.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import pathlib as _pathlib

sys.path.insert(0, str(_pathlib.Path(__file__).resolve().parent))
from suite_common import compile_flex, finish, median_event_ms  # noqa: E402  (bench/, beside this file)
sys.path.insert(0, str(_pathlib.Path(__file__).resolve().parent / "probes"))

TOTAL = 16384
D = 128
HEADS = ((32, 32), (32, 8))
CAUSALS = (True, False)


def mixes() -> dict[str, list[int]]:
    """Length mixes of TOTAL tokens, 64..8192 each, deterministic."""
    import numpy
    rng = numpy.random.default_rng(2026)
    mixed, left = [], TOTAL
    while left > 0:                          # log-uniform in [64, 8192], the last one fits
        n = int(round(2 ** rng.uniform(6, 13)))
        n = max(64, min(n, left)) if left >= 64 else left
        mixed.append(n)
        left -= n
    if mixed[-1] < 64:                       # fold a short tail into its neighbour
        tail = mixed.pop()
        mixed[-1] += tail
    return {
        "mixed": mixed,
        "halving": [8192, 4096, 2048, 1024, 512, 256, 128, 64, 64],
        "short": [64] * 64 + [256] * 16 + [512] * 8 + [1024] * 4,
    }


def pairs(lengths, causal: bool) -> int:
    return sum(L * (L + 1) // 2 if causal else L * L for L in lengths)


def _row(impl, mix, lengths, Hq, Hkv, causal, ms, flop_pairs, note=None, **extra):
    row = {"impl": impl, "suite": "varlen", "mode": "varlen", "dtype": "bfloat16", "d": D,
           "mix": mix, "n_seq": len(lengths), "total": sum(lengths), "Lmax": max(lengths),
           "Lmean": sum(lengths) / len(lengths), "Hq": Hq, "Hkv": Hkv, "causal": causal,
           "ms": ms, "pairs": flop_pairs,
           "tflops": None if ms is None else 4 * D * Hq * flop_pairs / (ms * 1e-3) / 1e12}
    if note:
        row["note"] = note
    row.update(extra)
    return row


def _time(fn, iters=20, warmup=3):
    return median_event_ms(lambda i: fn(), 1, iters, warmup)


class _Env:
    """Set an environment variable for a block (CUFLASH_VARLEN_KERNEL, read per call)."""

    def __init__(self, name, value):
        self.name, self.value, self.old = name, value, None

    def __enter__(self):
        self.old = os.environ.get(self.name)
        os.environ[self.name] = self.value

    def __exit__(self, *exc):
        if self.old is None:
            os.environ.pop(self.name, None)
        else:
            os.environ[self.name] = self.old


def _flex(Hq, Hkv, lengths, causal):
    """(call, None) running FlexAttention with a document mask on CuPy arrays, or (None, why)."""
    try:
        import torch
        from torch.nn.attention.flex_attention import create_block_mask
    except Exception as exc:
        return None, f"torch / flex_attention unavailable: {exc}"
    if not torch.cuda.is_available():
        return None, "torch.cuda.is_available() is False"
    doc = torch.repeat_interleave(torch.arange(len(lengths), device="cuda"),
                                  torch.tensor(lengths, device="cuda"))
    start = torch.cumsum(torch.tensor([0] + lengths[:-1], device="cuda"), 0)[doc]

    def mask(b, h, q_idx, kv_idx):
        same = doc[q_idx] == doc[kv_idx]
        if causal:     # per-document positions: q and k of one document share its start
            return same & (kv_idx - start[kv_idx] <= q_idx - start[q_idx])
        return same
    block_mask = create_block_mask(mask, 1, 1, TOTAL, TOTAL, device="cuda")
    compiled = compile_flex(torch)

    def call(q, k, v):
        with torch.no_grad():
            return compiled(q, k, v, block_mask=block_mask, enable_gqa=Hq != Hkv)
    return call, None


def run_varlen_suite(*, heads=HEADS, causals=CAUSALS, mix_names=None, peers=True,
                     log=print) -> list[dict]:
    import cupy
    import ml_dtypes
    import numpy

    import cuflash
    from cuflash import _varlen

    bf16 = ml_dtypes.bfloat16
    rows = []
    all_mixes = mixes()
    for name in mix_names or list(all_mixes):
        lengths = all_mixes[name]
        cu_host = numpy.concatenate([[0], numpy.cumsum(lengths)]).astype(numpy.int32)
        cu = cupy.asarray(cu_host)
        Lmax, n = max(lengths), len(lengths)
        mean = TOTAL // n
        for Hq, Hkv in heads:
            G = Hq // Hkv
            rs = cupy.random.RandomState(1)
            q = rs.standard_normal((Hkv, G, TOTAL, D), dtype=cupy.float32).astype(bf16)
            k = rs.standard_normal((Hkv, 1, TOTAL, D), dtype=cupy.float32).astype(bf16)
            v = rs.standard_normal((Hkv, 1, TOTAL, D), dtype=cupy.float32).astype(bf16)
            for causal in causals:
                t0, first = time.perf_counter(), len(rows)
                real = pairs(lengths, causal)

                def varlen():
                    return _varlen.attention_varlen(q, k, v, cu, cu, causal=causal)

                def varlen_host():
                    return _varlen.attention_varlen(q, k, v, cu_host, cu_host, causal=causal)
                o1 = varlen()
                with _Env("CUFLASH_VARLEN_KERNEL", "0"):
                    o0 = varlen()
                    ms_loop = _time(varlen)
                diff = float(cupy.abs(o1.astype(cupy.float32) - o0.astype(cupy.float32)).max())
                del o0, o1
                from cuflash import _inference_varlen, _problem
                how = _inference_varlen.explain(
                    _problem.make_problem(q, k, v, scale=None, causal=causal), cu_host, cu_host,
                    causal)
                rows.append(_row("cuflash_varlen", name, lengths, Hq, Hkv, causal,
                                 _time(varlen), real, max_diff_vs_loop=diff,
                                 kernel=" | ".join(x.strip() for x in how.splitlines())))
                rows.append(_row("cuflash_varlen_host", name, lengths, Hq, Hkv, causal,
                                 _time(varlen_host), real, note="NumPy cu_seqlens: no read-back"))
                from mask_varlen_cost import kernel_alone_ms
                ms_kernel, why = kernel_alone_ms(q, k, v, cu_host, causal)
                rows.append(_row("cuflash_varlen_kernel", name, lengths, Hq, Hkv, causal,
                                 ms_kernel, real, note="the launch alone, replayed",
                                 **({"max_diff_vs_call": why} if ms_kernel else {"why": why})))
                rows.append(_row("cuflash_varlen_loop", name, lengths, Hq, Hkv, causal,
                                 ms_loop, real))
                # -- the padded batch (n, Hkv, G, Lmax, d), and a dense batch at the mean length
                qp = cupy.zeros((n, Hkv, G, Lmax, D), bf16)
                kp = cupy.zeros((n, Hkv, 1, Lmax, D), bf16)
                vp = cupy.zeros((n, Hkv, 1, Lmax, D), bf16)
                for s, L in enumerate(lengths):
                    a = int(cu_host[s])
                    qp[s, ..., :L, :] = q[..., a:a + L, :]
                    kp[s, ..., :L, :] = k[..., a:a + L, :]
                    vp[s, ..., :L, :] = v[..., a:a + L, :]
                rows.append(_row("cuflash_padded", name, lengths, Hq, Hkv, causal,
                                 _time(lambda: cuflash.attention(qp, kp, vp, causal=causal)),
                                 real, note="padded keys attended: timing only"))
                del qp, kp, vp
                nb = TOTAL // mean
                qd = rs.standard_normal((nb, Hkv, G, mean, D), dtype=cupy.float32).astype(bf16)
                kd = rs.standard_normal((nb, Hkv, 1, mean, D), dtype=cupy.float32).astype(bf16)
                ms = _time(lambda: cuflash.attention(qd, kd, kd, causal=causal))
                rows.append(_row("cuflash_dense_mean", name, [mean] * nb, Hq, Hkv, causal, ms,
                                 pairs([mean] * nb, causal), mean_of=name))
                del qd, kd
                # -- FlexAttention, document mask, on the same packed arrays
                fn, why = _flex(Hq, Hkv, lengths, causal) if peers else (None, "peers off")
                if fn is None:
                    rows.append(_row("flex_document", name, lengths, Hq, Hkv, causal, None, real,
                                     note=why))
                else:
                    import torch
                    tq = torch.from_dlpack(q.reshape(1, Hq, TOTAL, D))
                    tk = torch.from_dlpack(k.reshape(1, Hkv, TOTAL, D))
                    tv = torch.from_dlpack(v.reshape(1, Hkv, TOTAL, D))
                    try:
                        ms = _time(lambda: fn(tq, tk, tv))
                        rows.append(_row("flex_document", name, lengths, Hq, Hkv, causal, ms,
                                         real))
                    except Exception as exc:
                        rows.append(_row("flex_document", name, lengths, Hq, Hkv, causal, None,
                                         real, note=f"{type(exc).__name__}: {str(exc)[:200]}"))
                    del tq, tk, tv
                    torch.cuda.empty_cache()
                cupy.get_default_memory_pool().free_all_blocks()
                log(f"{name} ({n} seqs, Lmax {Lmax}) Hq={Hq} Hkv={Hkv} causal={causal}: "
                    + ", ".join(f"{r['impl']} {r['tflops']:.0f}" for r in rows[first:]
                                if r["tflops"]) + f" TFLOP/s ({time.perf_counter() - t0:.1f} s)")
            del q, k, v
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", help="write the rows here as JSON")
    p.add_argument("--quick", action="store_true", help="the 'mixed' mix, MHA, causal only")
    p.add_argument("--no-peers", action="store_true")
    a = p.parse_args(argv)
    kw = dict(peers=not a.no_peers)
    if a.quick:
        kw.update(mix_names=["mixed"], heads=((32, 32),), causals=(True,))
    t0 = time.perf_counter()
    rows = run_varlen_suite(**kw)
    meta = {"suite": "varlen", "seconds": time.perf_counter() - t0, "total": TOTAL,
            "mixes": {k: v for k, v in mixes().items()}}
    return finish(meta, rows, a.out)


if __name__ == "__main__":
    sys.exit(main())
