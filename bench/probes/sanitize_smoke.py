"""Question: does any kernel family read or write out of bounds, race on shared memory or
misuse a barrier on ragged shapes? (A few small calls of every GPU kernel family, for
compute-sanitizer's memcheck, racecheck and synccheck; ``bash bench/gpu_run.sh sanitize``.)

Answer so far: memcheck "0 errors" and racecheck "0 hazards" on the H200 (commit 311ecc5,
session 3; bench/NOTES.md); synccheck first run with bench/gpu_run.sh.

    compute-sanitizer --tool memcheck --error-exitcode 1 python3 bench/probes/sanitize_smoke.py

Small ragged shapes: partial Q and K tiles, d not a multiple of 8 (padded copy path), causal
both ways, broadcast K/V; the backward with deterministic=False and True. 16-bit cases run
twice on Hopper: with the dispatcher's choice (fwd_sm90, bwd_sm90; bwd_sm80 when
deterministic) and kept on fwd_sm80, bwd_sm80. Exits non-zero if a result is not finite where
it should be.
"""
import os
import sys

import cupy
import ml_dtypes
import numpy

import cuflash

#: the overrides that keep Hopper on the mma.sync kernels (read when a plan is built)
SM80 = {"CUFLASH_FWD": "sm80", "CUFLASH_BWD": "sm80"}


def on_sm80(fn, *args, **kw):
    """``fn(*args, **kw)`` with SM80 set in the environment (and fresh plans), restored after."""
    from cuflash import _api
    old = {k: os.environ.get(k) for k in SM80}
    os.environ.update(SM80)
    _api.clear_plans()
    try:
        return fn(*args, **kw)
    finally:
        _api.clear_plans()
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def main() -> int:
    rng = numpy.random.default_rng(0)
    cases = [  # (dtype, q shape, kv shape, d, dv, causal)
        (numpy.float16, (2, 3, 77), (2, 1, 131), 64, 64, True),
        (ml_dtypes.bfloat16, (1, 2, 130), (1, 2, 70), 111, 96, "top_left"),
        (ml_dtypes.bfloat16, (1, 2, 200), (1, 2, 200), 128, 128, False),
        (ml_dtypes.bfloat16, (1, 2, 300), (1, 2, 300), 256, 256, True),
        (numpy.float16, (2, 1, 90), (2, 1, 150), 32, 32, True),
        (numpy.float32, (2, 2, 65), (2, 1, 97), 40, 72, True),
        (numpy.float64, (1, 1, 33), (1, 1, 45), 256, 16, False),
    ]
    bad = 0
    for dtype, qs, kvs, d, dv, causal in cases:
        q = cupy.asarray(rng.standard_normal(qs + (d,)).astype(dtype))
        k = cupy.asarray(rng.standard_normal(kvs + (d,)).astype(dtype))
        v = cupy.asarray(rng.standard_normal(kvs + (dv,)).astype(dtype))
        o, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
        do = cupy.asarray(rng.standard_normal(o.shape).astype(dtype))
        for det in (False, True):
            grads = cuflash.attention_backward(do, q, k, v, o, lse, causal=causal,
                                               deterministic=det)
            bad += sum(int(not bool(cupy.isfinite(g.astype(numpy.float32)).all())) for g in grads)
        if numpy.dtype(dtype).itemsize == 2:
            # fwd_sm80 and bwd_sm80 (atomics) on Hopper too
            o80, lse80 = on_sm80(cuflash.attention, q, k, v, causal=causal, return_lse=True)
            grads = on_sm80(cuflash.attention_backward, do, q, k, v, o80, lse80, causal=causal)
            bad += int(not bool(cupy.isfinite(o80.astype(numpy.float32)).all()))
            bad += sum(int(not bool(cupy.isfinite(g.astype(numpy.float32)).all())) for g in grads)
        cupy.cuda.Device().synchronize()
        finite = bool(cupy.isfinite(o.astype(numpy.float32)).all())
        print(f"{numpy.dtype(dtype).name:8s} q{qs + (d,)} kv{kvs + (dv,)} causal={causal}: "
              f"{'ok' if finite else 'NOT FINITE'}")
        bad += not finite
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
