#!/usr/bin/env python3
"""Question: does the backward's dV of a broadcast v read device memory it has not written?

Twice a gpu-profile run of test_gpu_backward.py::test_matches_reference failed on dV alone, with
v broadcast over a batch dimension (so dV goes through the float32 per-item buffer of the
workspace and a CuPy sum over the broadcast dims), in a worker that had run other tests before,
and the shrunk case failed again on Hypothesis's replay in that worker while fresh processes
never showed it:

- session 7: float16, q (2, 1, 5, 1), k (1, 2, 256, 1), v (2, 1, 256, 96), C layouts;
- session 15: bfloat16, q (1, 2, 2, 8), k (1, 2, 2, 8), v (1, 1, 2, 8), causal, q, v and dO
  transposed, k Fortran order (result -0.613 against -2.522 at dv[0, 0, 0, 2]).

A read before a write (or an accumulation into memory assumed zero) gives the right answer on
fresh memory and a wrong one on a pool block that holds an earlier call's values. Phases, each
over both cases for ``--iters`` iterations (forward, backward, the kit's check, dV compared
bitwise with the phase's first iteration):

- ``fresh``: nothing before each call;
- ``nan``: freed pool blocks of 256 B to 16 MB filled with NaN before each call;
- ``finite``: the same blocks filled with 1.5 (a stale value that stays finite, as an earlier
  call's would);
- ``sweep``: ``--sweep`` random small cases with k or v broadcast over a head or batch
  dimension (every dtype, the kit's layouts, causal or not), each after a ``finite`` fill;
- ``nopool``: CuPy's pool off (every allocation a fresh cudaMalloc): run it under
  ``compute-sanitizer --tool initcheck`` (``--phases nopool --iters 1``), which reports every
  read of device memory that nothing wrote.

    PYTHONPATH=. python bench/probes/dv_stale.py --json out/dv_stale.json [--sweep 300]
    PYTHONPATH=. compute-sanitizer --tool initcheck python bench/probes/dv_stale.py \\
        --phases nopool --iters 1

Reading it: failures only after ``finite`` / ``nan`` fills (and the record says dV), or an
initcheck report on the backward's kernels or the sum: a stale read, and the record names the
case. None anywhere: the state is not the pool's (a cached plan, the context).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import traceback

import numpy

CASES = {
    "s15_bf16_transposed": dict(dtype="bfloat16", shapes=((1, 2, 2, 8), (1, 2, 2, 8), (1, 1, 2, 8)),
                                layouts=("transposed", "f", "transposed", "transposed"),
                                causal=True),
    "s7_f16_c": dict(dtype="float16", shapes=((2, 1, 5, 1), (1, 2, 256, 1), (2, 1, 256, 96)),
                     layouts=("c", "c", "c", "c"), causal=False),
}
POOL_SIZES = [1 << n for n in range(8, 25, 2)]   # 256 B .. 16 MB


def fill_pool(value: float) -> None:
    """Allocate and free blocks of many sizes holding ``value``: CuPy's pool hands them out
    again to the next allocations of those sizes."""
    import cupy
    bufs = [cupy.full(n // 4, value, numpy.float32) for n in POOL_SIZES for _ in range(2)]
    del bufs


def make_case(spec: dict, seed: int = 0):
    import cupy
    from cuflash.testing import AttentionCase
    return AttentionCase.make(spec["dtype"], *spec["shapes"], seed=seed,
                              layouts=spec["layouts"], causal=spec["causal"]).with_xp(cupy)


def run_and_check(case) -> tuple[object, str | None]:
    """(dV, None) or (dV, the check's first line) for one forward + backward."""
    import cupy
    import cuflash
    from cuflash.testing import assert_attention_close
    o, lse = cuflash.attention(case.q, case.k, case.v, return_lse=True, **case.kwargs)
    grads = cuflash.attention_backward(case.do, case.q, case.k, case.v, o, lse, **case.kwargs)
    cupy.cuda.Device().synchronize()
    try:
        assert_attention_close(None, case, grads=grads, check_dtype=True)
        return grads[2], None
    except AssertionError as e:
        return grads[2], str(e).splitlines()[0]


def phase_fixed(name: str, iters: int, fill) -> list[dict]:
    import cupy
    rows = []
    for cname, spec in CASES.items():
        case = make_case(spec)
        first = None
        fails, differ = [], 0
        for i in range(iters):
            if fill is not None:
                fill()
            dv, err = run_and_check(case)
            dv = cupy.asnumpy(dv)
            if first is None:
                first = dv
            elif not numpy.array_equal(dv.view(numpy.uint8), first.view(numpy.uint8)):
                differ += 1
            if err:
                fails.append((i, err))
        rows.append(dict(phase=name, case=cname, iters=iters, failures=len(fails),
                         first_failures=fails[:3], dv_differs_from_first=differ))
        print(f"{name:7s} {cname:22s} {iters} iterations: {len(fails)} failed, dV differs "
              f"from the first in {differ}" + (f"; {fails[0][1]}" if fails else ""), flush=True)
    return rows


def phase_sweep(n: int, seed: int) -> list[dict]:
    """Random small cases with k or v broadcast (stride 0) over a batch dimension."""
    from cuflash.testing import AttentionCase, LAYOUTS
    import cupy
    rng = numpy.random.default_rng(seed)
    dtypes = ["float16", "bfloat16", "float32", "float64"]
    failures, done = [], 0
    for i in range(n):
        B, H = int(rng.integers(1, 3)), int(rng.integers(1, 5))
        Lq, Lk = (int(rng.choice([1, 2, 3, 5, 16, 17, 64, 65, 130, 257])) for _ in range(2))
        d = int(rng.choice([1, 8, 16, 40, 64, 72, 96, 111, 128]))
        dv = int(rng.choice([d, 8, 96]))
        q = (B, H, Lq, d)
        kv_h = 1 if rng.random() < 0.7 else H
        kv_b = 1 if rng.random() < 0.5 else B
        k = (kv_b, kv_h, Lk, d)
        v = (kv_b, kv_h, Lk, dv) if rng.random() < 0.8 else (B, H, Lk, dv)
        if k[:2] == (B, H) and v[:2] == (B, H):
            v = (1, 1, Lk, dv)
        layouts = tuple(str(rng.choice(list(LAYOUTS))) for _ in range(4))
        causal = [False, True, "top_left"][int(rng.integers(0, 3))]
        spec = dict(dtype=dtypes[int(rng.integers(0, 4))], shapes=(q, k, v), layouts=layouts,
                    causal=causal)
        try:
            case = AttentionCase.make(spec["dtype"], q, k, v, seed=i, layouts=layouts,
                                      causal=causal).with_xp(cupy)
        except (TypeError, ValueError):   # a case the kit cannot build: not the question
            continue
        fill_pool(1.5)
        try:
            _, err = run_and_check(case)
        except Exception as e:            # the API rejecting it counts as a failure here
            err = f"{type(e).__name__}: {e}"
        done += 1
        if err:
            failures.append(dict(spec=spec, seed=i, error=err))
            print(f"sweep   FAILED {spec} seed {i}: {err}", flush=True)
    print(f"sweep   {done} cases after a finite fill: {len(failures)} failed", flush=True)
    return [dict(phase="sweep", cases=done, failures=len(failures),
                 first_failures=failures[:10])]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--phases", default="fresh,nan,finite,sweep")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--sweep", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    import cupy
    rows, t0 = [], time.time()
    for ph in a.phases.split(","):
        try:
            if ph == "fresh":
                rows += phase_fixed(ph, a.iters, None)
            elif ph == "nan":
                rows += phase_fixed(ph, a.iters, lambda: fill_pool(float("nan")))
            elif ph == "finite":
                rows += phase_fixed(ph, a.iters, lambda: fill_pool(1.5))
            elif ph == "sweep":
                rows += phase_sweep(a.sweep, a.seed)
            elif ph == "nopool":
                cupy.cuda.set_allocator(None)
                rows += phase_fixed(ph, a.iters, None)
            else:
                raise SystemExit(f"unknown phase {ph!r}")
        except Exception:
            traceback.print_exc()
            rows.append(dict(phase=ph, error=traceback.format_exc()[-2000:]))
    print(f"{time.time() - t0:.0f} s", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"probe": "dv_stale", "rows": rows}, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
