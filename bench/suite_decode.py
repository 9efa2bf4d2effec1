#!/usr/bin/env python3
"""Benchmark suite ``decode`` (issue 11): one query token over a KV cache, K/V TB/s.

cuflash ``attention_with_kvcache`` (split-KV decode, dense and paged caches) against PyTorch SDPA
(flash and cuDNN backends, ``enable_gqa=True``, on DLPack views of the same CuPy arrays: no
copy) and the measured copy ceiling, in one process and one run.

Shapes: B in {1, 8, 64}; (Hq, Hkv) in {(32, 8), (32, 32)}; d = 128; bf16; Lk in {1k, 8k, 64k,
128k}; cuflash dense, paged with pages of 16 and 256 (peers dense only: SDPA has no page table).
Configurations whose K/V would exceed ``--max-gb`` (default 40 GB) are reported as skipped.

Method:
- ``tbps`` = bytes of K and V read (B x Hkv x Lk x d x 2 bytes x 2) / time. For the copy
  ceiling (``impl = "copy"``: ``cupy.copyto`` of a buffer of those bytes) it is the bytes read
  plus written / time, the HBM traffic a read-only kernel can at best match.
- ``ms`` = median over calls of CUDA-event time around each call on CuPy's current stream
  (torch runs on the same, legacy default stream), after warm-up. Each call goes through the
  public function (validation and plan lookup included), as a user would call it.
- The dense arms (cuflash, SDPA flash, cuDNN) are timed ``--rounds`` times each (3), their order
  rotated by one a round, and a row's ``ms`` is the median of the rounds (``ms_rounds``): the
  three read within ~1% of each other at Lk >= 8k, where one fixed order favours whichever arm
  the clock favours (session 12's single pass read cuflash 0.991-0.997x cuDNN at four points).
- ``isolated`` = True: inputs rotate over enough copies (>= 256 MB in all) that K/V are never
  served from the 50 MB L2 by the previous call.

``--ab`` adds ``cuflash_split`` rows: the generic decode_split kernel (``CUFLASH_DECODE=split``)
on the same dense caches, the before of decode_mma.cu.

Run standalone: ``PYTHONPATH=. python bench/suite_decode.py --out decode.json`` (about 2-3 min on
an H200); ``run_decode_suite()`` returns the rows for bench/bench_attention.py to wire in.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import pathlib as _pathlib

sys.path.insert(0, str(_pathlib.Path(__file__).resolve().parent))
from suite_common import arm_orders, finish, median_event_ms  # noqa: E402  (bench/, beside this file)

D = 128
BATCHES = (1, 8, 64)
HEADS = ((32, 8), (32, 32))
LENGTHS = (1024, 8192, 65536, 131072)
LAYOUTS = ((False, 0), (True, 16), (True, 256))
ROTATE_BYTES = 256 << 20


def _row(impl, B, Hq, Hkv, Lk, paged, page_size, ms, nbytes, note=None, **extra):
    row = {"impl": impl, "suite": "decode", "mode": "decode", "dtype": "bfloat16", "d": D,
           "B": B, "Hq": Hq, "Hkv": Hkv, "Lk": Lk, "paged": paged, "page_size": page_size,
           "isolated": True, "tbps": None if ms is None else nbytes / (ms * 1e-3) / 1e12,
           "ms": ms}
    if note:
        row["note"] = note
    row.update(extra)
    return row


def _time(fn, n_sets, iters=30, warmup=5):
    return median_event_ms(fn, n_sets, iters, warmup)


def _time_rounds(fns: dict, n_sets: int, rounds: int) -> dict:
    """Each arm of ``fns`` timed ``rounds`` times, the arms' order rotated by one a round (a
    fixed order favours one arm while the clock moves; ratios of ~1% are read from these), as
    {name: (median over rounds of each round's median ms, the rounds' ms in arm order)}."""
    per = {name: [] for name in fns}
    for order in arm_orders(list(fns), rounds):
        for name in order:
            per[name].append(_time(fns[name], n_sets))
    return {name: (statistics.median(t), t) for name, t in per.items()}


def _sdpa(backend_name):
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except Exception as exc:         # no torch here
        return None, f"torch unavailable: {exc}"
    if not torch.cuda.is_available():
        return None, "torch.cuda.is_available() is False"
    backend = getattr(SDPBackend, backend_name)

    def call(q, k, v):
        with torch.no_grad(), sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    return call, None


def _fill(cupy, shape, seed):
    """bf16 values ~N(0, 1) without a float32 temporary of the whole array (caches of 30 GB)."""
    import ml_dtypes
    x = cupy.empty(shape, ml_dtypes.bfloat16)
    flat = x.reshape(-1)
    rs = cupy.random.RandomState(seed)
    step = 1 << 28
    for i in range(0, flat.size, step):
        n = min(step, flat.size - i)
        flat[i:i + n] = rs.standard_normal(n, dtype=cupy.float32).astype(ml_dtypes.bfloat16)
    return x


def _kernel(inf, q, k_cache, v_cache, seqlens, block_table) -> str:
    """The decode plan's explanation in one line: which kernel (decode_mma or decode_split),
    its split count, or why the generic path ran."""
    text = inf.explain_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens,
                               block_table=block_table)
    return " | ".join(line.strip() for line in text.splitlines())


def run_decode_suite(*, batches=BATCHES, heads=HEADS, lengths=LENGTHS, layouts=LAYOUTS,
                     max_gb=40.0, peers=True, ab=False, rounds=3, log=print) -> list[dict]:
    import cupy
    import numpy

    import cuflash._inference as inf

    rows = []
    flash, flash_why = _sdpa("FLASH_ATTENTION") if peers else (None, "peers off")
    cudnn, cudnn_why = _sdpa("CUDNN_ATTENTION") if peers else (None, "peers off")
    pool = cupy.get_default_memory_pool()
    for B in batches:
        for Hq, Hkv in heads:
            G = Hq // Hkv
            for Lk in lengths:
                nbytes = B * Hkv * Lk * D * 2 * 2
                if nbytes > max_gb * 1e9:
                    for paged, ps in layouts:
                        rows.append(_row("cuflash", B, Hq, Hkv, Lk, paged, ps, None, nbytes,
                                         note=f"skipped: K/V {nbytes / 1e9:.0f} GB > {max_gb} GB"))
                    continue
                n_sets = max(1, min(64, -(-ROTATE_BYTES // nbytes)))
                t0, first = time.perf_counter(), len(rows)
                # -- the copy ceiling for these bytes
                src = cupy.empty(nbytes // 2, numpy.uint16)
                dst = cupy.empty_like(src)
                ms = _time(lambda i: cupy.copyto(dst, src), 1)
                rows.append(_row("copy", B, Hq, Hkv, Lk, False, 0, ms, 2 * nbytes))
                del src, dst
                pool.free_all_blocks()
                # -- dense: cuflash and the peers on the same arrays
                qs = [_fill(cupy, (B, Hq, 1, D), 10 + i) for i in range(n_sets)]
                ks = [_fill(cupy, (B, Hkv, Lk, D), 100 + i) for i in range(n_sets)]
                vs = [_fill(cupy, (B, Hkv, Lk, D), 200 + i) for i in range(n_sets)]
                seqlens = cupy.full((B,), Lk, numpy.int32)

                def ours(i, qs=qs, ks=ks, vs=vs):
                    if G == 1:
                        return inf.attention_with_kvcache(qs[i], ks[i], vs[i],
                                                          cache_seqlens=seqlens)
                    return inf.attention_with_kvcache(
                        qs[i].reshape(B, Hkv, G, 1, D), ks[i][:, :, None], vs[i][:, :, None],
                        cache_seqlens=seqlens)
                q0, k0, v0 = ((qs[0], ks[0], vs[0]) if G == 1 else
                              (qs[0].reshape(B, Hkv, G, 1, D), ks[0][:, :, None],
                               vs[0][:, :, None]))
                fns, notes = {"cuflash": ours}, {}
                tq = tk = tv = None
                for name, fn, why in (("sdpa_flash", flash, flash_why),
                                      ("sdpa_cudnn", cudnn, cudnn_why)):
                    if fn is None:
                        notes[name] = why
                        continue
                    import torch
                    if tq is None:
                        tq = [torch.from_dlpack(x) for x in qs]
                        tk = [torch.from_dlpack(x) for x in ks]
                        tv = [torch.from_dlpack(x) for x in vs]
                    try:
                        fn(tq[0], tk[0], tv[0])
                    except Exception as exc:   # a backend that refuses the shape
                        notes[name] = f"{type(exc).__name__}: {str(exc)[:200]}"
                        continue
                    fns[name] = lambda i, fn=fn, tq=tq, tk=tk, tv=tv: fn(tq[i], tk[i], tv[i])
                timed = _time_rounds(fns, n_sets, rounds)
                for name, (ms, per_round) in timed.items():
                    extra = {"ms_rounds": per_round} if rounds > 1 else {}
                    if name == "cuflash":
                        extra["kernel"] = _kernel(inf, q0, k0, v0, seqlens, None)
                    rows.append(_row(name, B, Hq, Hkv, Lk, False, 0, ms, nbytes, **extra))
                if ab:     # the generic decode_split on the same arrays (before / after), not
                    # interleaved: the override is read when a plan is built (env clears plans)
                    import bench_attention
                    with bench_attention.env(CUFLASH_DECODE="split"):
                        rows.append(_row("cuflash_split", B, Hq, Hkv, Lk, False, 0,
                                         _time(ours, n_sets), nbytes,
                                         kernel=_kernel(inf, q0, k0, v0, seqlens, None)))
                for name, why in notes.items():
                    rows.append(_row(name, B, Hq, Hkv, Lk, False, 0, None, nbytes, note=why))
                if tq is not None:
                    del tq, tk, tv
                    torch.cuda.empty_cache()
                del ks, vs
                pool.free_all_blocks()
                # -- paged caches
                for paged, ps in layouts:
                    if not paged:
                        continue
                    per = -(-Lk // ps)
                    kps, vps, bts = [], [], []
                    for i in range(n_sets):
                        shape = (B * per, Hkv) + ((1,) if G > 1 else ()) + (ps, D)
                        kps.append(_fill(cupy, shape, 300 + i))
                        vps.append(_fill(cupy, kps[-1].shape, 400 + i))
                        perm = numpy.random.default_rng(i).permutation(B * per)
                        bts.append(cupy.asarray(perm.reshape(B, per).astype(numpy.int32)))

                    def ours_paged(i, kps=kps, vps=vps, bts=bts):
                        q = qs[i] if G == 1 else qs[i].reshape(B, Hkv, G, 1, D)
                        return inf.attention_with_kvcache(q, kps[i], vps[i],
                                                          cache_seqlens=seqlens,
                                                          block_table=bts[i])
                    ms = _time(ours_paged, n_sets)
                    q0 = qs[0] if G == 1 else qs[0].reshape(B, Hkv, G, 1, D)
                    rows.append(_row("cuflash", B, Hq, Hkv, Lk, True, ps, ms, nbytes,
                                     kernel=_kernel(inf, q0, kps[0], vps[0], seqlens, bts[0])))
                    del kps, vps, bts
                    pool.free_all_blocks()
                del qs
                pool.free_all_blocks()
                log(f"B={B} Hq={Hq} Hkv={Hkv} Lk={Lk}: " + ", ".join(
                    f"{r['impl']}{'/p' + str(r['page_size']) if r['paged'] else ''} "
                    f"{r['tbps']:.2f} TB/s" for r in rows[first:] if r["tbps"])
                    + f"  ({time.perf_counter() - t0:.1f} s)")
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", help="write the rows here as JSON")
    p.add_argument("--quick", action="store_true", help="B=8, Hq 32 / Hkv 8, Lk 8k and 128k")
    p.add_argument("--max-gb", type=float, default=40.0)
    p.add_argument("--no-peers", action="store_true")
    p.add_argument("--ab", action="store_true",
                   help="also time the generic decode_split (CUFLASH_DECODE=split) on the dense "
                        "caches: rows impl 'cuflash_split'")
    p.add_argument("--rounds", type=int, default=3,
                   help="timings of each dense arm (cuflash, SDPA flash, cuDNN) a point, the arms' "
                        "order rotated a round; rows hold the median and ms_rounds")
    a = p.parse_args(argv)
    kw = dict(max_gb=a.max_gb, peers=not a.no_peers, ab=a.ab, rounds=a.rounds)
    if a.quick:
        kw.update(batches=(8,), heads=((32, 8),), lengths=(8192, 131072))
    t0 = time.perf_counter()
    rows = run_decode_suite(**kw)
    meta = {"suite": "decode", "seconds": time.perf_counter() - t0}
    return finish(meta, rows, a.out)


if __name__ == "__main__":
    sys.exit(main())
