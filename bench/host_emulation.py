#!/usr/bin/env python3
"""cuflash's host path on a machine without a GPU: CuPy's device calls replaced by stand-ins, so
the Python work of a call (validation, plan lookup, packing, the fast paths) runs, is timed
and is profiled where there is no device (this machine, CI).

    PYTHONPATH=. python bench/host_emulation.py [--calls 2000] [--json out.json]
        [--profile CASE:DIRECTION]
    PYTHONPATH=. python bench/host_emulation.py --check [--json out.json]

What is replaced (``install``; the process is changed for good: run it as a script or in a
subprocess, never inside a test process): the CUDA runtime's device queries (an H200: cc 9.0,
132 SMs, 227 KB of opt-in shared memory), ``cupy.cuda.alloc`` / ``cupy.empty`` /
``cupy.zeros`` / ``cupy.asarray`` (arrays on one large unowned range of fake device memory: their contents are
never read), ``cupy.cuda.Device`` and the current stream, ``memsetAsync`` and
``cuLaunchKernel`` (no-ops), and NVRTC (``_jit.get_kernel``: a kernel that reports no spills,
so dispatch takes its first choice). Everything cuflash decides on the host is its own code.

What it measures: per case and direction (``fwd``: ``attention``; ``bwd``:
``attention_backward`` with the forward's o and lse), the host time a call of ``--calls`` calls
after 20 warm-up calls (no driver time: a real launch adds ~4-6 us each, bench/host_overhead.py),
``hits``, plan-cache hits a call (one on either path: the fast path's entry, or the general
path's plan), and ``general``, the fraction of calls that took the general path (counted in
``_problem.make_problem``, which the fast paths skip).
Cases: ``plain``, ``window`` (128, 0), ``softcap`` 50, ``block_mask`` (the mods suite's 8
documents at L 256), ``block_mask_causal``, ``score_mod_captured`` (a score_mod that reads a
``cuflash.captured`` array), ``bias`` (a (L, L) bias: no fast path; the general
path's cost).

``--check`` (``check_launches``): per case and direction, the launches of the first call (the
general path) and of the second (the fast path) are recorded (the stand-in of
``cuLaunchKernel`` copies each argument block) and compared word for word, each pointer word
replaced by the role of the array it points to (q, k, v, do, o, lse, the call's own outputs,
else ``workspace``): a fast path that patched a pointer into the wrong word, or launched other
kernels or grids, shows up without a GPU. tests/test_host_emulation.py runs both modes.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time
import types

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

SHAPE = (1, 2, 256, 64)
#: the Launch of each argument block's pointer array (install() registers every Launch made)
LAUNCH_OF: dict = {}
#: where the stand-in of cuLaunchKernel appends (function, grid, block, shared memory, the
#: argument block's bytes) of each launch, while it is a list (``launches``)
RECORD: list | None = None
#: bytes of fake device memory (never touched: an address range for the arrays' pointers)
ARENA, ARENA_BASE = 1 << 36, 1 << 40


def install() -> None:
    """Replace CuPy's device calls with the stand-ins of the module docstring."""
    import math
    import numpy
    import cupy
    from cupy.cuda import driver, memory, runtime

    arena = memory.UnownedMemory(ARENA_BASE, ARENA, None, device_id=0)
    top = [0]

    def alloc(nbytes):
        off = top[0]
        top[0] = (off + max(int(nbytes), 1) + 255) // 256 * 256
        if top[0] > ARENA:                       # wrap: contents are never read
            off, top[0] = 0, (max(int(nbytes), 1) + 255) // 256 * 256
        return memory.MemoryPointer(arena, off)

    def empty(shape, dtype=float, order="C"):
        dtype = numpy.dtype(dtype)
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        return cupy.ndarray(shape, dtype, alloc(math.prod(shape) * dtype.itemsize))

    def asarray(a, dtype=None, order=None):
        if isinstance(a, cupy.ndarray):
            return a if dtype is None or a.dtype == dtype else empty(a.shape, dtype)
        host = numpy.asarray(a, dtype)
        return empty(host.shape, host.dtype)

    class Device:
        def __init__(self, device=0):
            self.id = device

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def synchronize(self):
            pass

    class Stream:
        ptr = 0

    class Kernel:                                # what _launch and _spills read of a kernel
        max_dynamic_shared_size_bytes = 0
        local_size_bytes = 0
        num_regs = 128

        def __init__(self, ptr: int):
            self.kernel = types.SimpleNamespace(ptr=ptr)
    kernels: dict = {}

    def get_kernel(source, expr, device_id, prelude=""):
        """One stand-in a (source, expr, prelude), each with its own function 'pointer'."""
        key = (source, expr, device_id, prelude)
        if key not in kernels:
            kernels[key] = Kernel(len(kernels) + 1)
        return kernels[key]

    from cuflash import _launch
    init = _launch.Launch.__init__

    def registered(self, *args, **kw):          # argv_ptr -> the Launch whose block it is
        init(self, *args, **kw)
        LAUNCH_OF[self.argv_ptr] = self
    _launch.Launch.__init__ = registered

    def launch_kernel(fn, gx, gy, gz, bx, by, bz, smem, stream, argv, extra):
        if RECORD is not None:
            blk = LAUNCH_OF[argv]
            RECORD.append((fn, gx, bx, smem, blk.buf.tobytes()))

    runtime.getDevice = lambda: 0
    runtime.getDeviceCount = lambda: 1
    runtime.getDeviceProperties = lambda i: {
        "name": b"NVIDIA H200 (host emulation)", "major": 9, "minor": 0,
        "multiProcessorCount": 132, "l2CacheSize": 60 << 20}
    runtime.deviceGetAttribute = lambda attr, i: 232448
    runtime.memsetAsync = lambda *args: None
    driver.launchKernel = launch_kernel
    cupy.cuda.alloc = cupy.cuda.memory.alloc = alloc
    cupy.empty, cupy.zeros, cupy.asarray = empty, empty, asarray
    cupy.cuda.Device = Device
    cupy.cuda.get_current_stream = lambda: Stream()
    from cuflash import _jit
    _jit.get_kernel = get_kernel


def cases(cuflash, L: int) -> dict[str, dict]:
    import cupy
    import ml_dtypes
    import numpy

    def document(b, h, q_idx, kv_idx):
        return (q_idx // (L // 8)) == (kv_idx // (L // 8))
    bm = cuflash.block_mask(document, (1, 1), L, L)
    table = cuflash.captured(cupy.empty((SHAPE[1],), numpy.float32))

    def head_bias(score, b, h, q_idx, kv_idx):       # reads a captured array
        return score + table[h]
    return {"plain": {}, "window": {"window": (128, 0)}, "softcap": {"softcap": 50.0},
            "block_mask": {"block_mask": bm}, "block_mask_causal": {"block_mask": bm,
                                                                     "causal": True},
            "score_mod_captured": {"score_mod": head_bias},
            "bias": {"bias": cupy.empty((L, L), numpy.dtype(ml_dtypes.bfloat16))},
            "alibi": {"alibi_slopes": cupy.empty((SHAPE[1],), numpy.float32), "causal": True}}


def measure(calls: int, profile: str | None = None) -> list[dict]:
    install()
    import cupy
    import ml_dtypes
    import numpy
    import cuflash
    from cuflash import _api, _problem
    validated = [0]                  # calls that took the general path (it validates first)
    make_problem = _problem.make_problem

    def counted(*args, **kw):
        validated[0] += 1
        return make_problem(*args, **kw)
    _problem.make_problem = counted
    bf16 = numpy.dtype(ml_dtypes.bfloat16)
    q, k, v, do = (cupy.empty(SHAPE, bf16) for _ in range(4))
    rows = []
    for name, kw in cases(cuflash, SHAPE[2]).items():
        o, lse = cuflash.attention(q, k, v, return_lse=True, **kw)
        fns = {"fwd": lambda kw=kw: cuflash.attention(q, k, v, **kw),
               "bwd": lambda kw=kw, o=o, lse=lse: cuflash.attention_backward(
                   do, q, k, v, o, lse, **kw)}
        for direction, fn in fns.items():
            for _ in range(20):
                fn()
            if profile == f"{name}:{direction}":
                from host_overhead import print_profile
                print_profile(profile, fn, lambda: None, calls=calls, top=30)
            hits, general = _api._FWD_PLANS.hits + _api._BWD_PLANS.hits, validated[0]
            loops = []
            for _ in range(3):
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                loops.append((time.perf_counter() - t0) / calls * 1e6)
            rows.append({"case": name, "direction": direction,
                         "host_us": statistics.median(loops),
                         "hits": (_api._FWD_PLANS.hits + _api._BWD_PLANS.hits - hits)
                         / (3 * calls),
                         "general": (validated[0] - general) / (3 * calls)})
    return rows


#: what :func:`launches` writes over every device pointer left in an argument block
STALE = 0x5EA1_DEAD_0000_0000


def _pointer_words(nbytes: int) -> list[int]:
    """The 8-byte words of an argument block that hold device pointers: a Params block (alone,
    or bwd_dot_do_o's, which begins with one): its leading pointers, the modifiers' arrays,
    block lists, dL/dbias and captured arrays; bwd_finish_dq's: partial and dq."""
    from cuflash import _launch, _modifier_params as mp, _plan_aux
    if nbytes == _plan_aux.FINISH_ARGS.itemsize:
        return [0, 1]
    if nbytes < _launch.PARAMS.itemsize:
        return []
    base = _launch.PARAMS.fields["mod"][1]
    mod = [(base + mp.MODIFIER_PARAMS.fields[n][1]) // 8
           for n in (*mp.POINTER_FIELDS, "block_list", "dbias")]
    cap = base + mp.MODIFIER_PARAMS.fields["captured"][1]
    size = mp.MODIFIER_PARAMS["captured"].base.itemsize
    return list(range(len(_launch.POINTERS))) + mod + [(cap + k * size) // 8 for k in range(4)]


def launches(fn):
    """``(fn(), the launches it made)``: RECORD's entries while it ran. First every device
    pointer an argument block still holds from an earlier call is overwritten by ``STALE``
    (as another call of the same plan, on other arrays, would have left it): a call that
    launches without patching a pointer it reads records STALE there, not a right-looking
    leftover."""
    import numpy
    global RECORD
    for blk in LAUNCH_OF.values():
        words = blk.buf.view(numpy.uint64)
        at = numpy.array(_pointer_words(words.nbytes), numpy.int64)
        at = at[at < words.size]
        words[at] = numpy.where(words[at] != 0, STALE, 0)   # (0: a pointer the kernel skips)
    RECORD = []
    try:
        result = fn()
    finally:
        record, RECORD = RECORD, None
    return result, record


def normalised(record, names: dict) -> list:
    """Each launch with the device pointers in its argument block replaced by what they point
    to: ``names`` (pointer -> the array's role: q, o, dq, ...), else ``workspace`` (memory a
    call allocated for itself). Two calls of one plan then launch equal records."""
    import numpy
    base = ARENA_BASE
    out = []
    for fn, grid, block, smem, blob in record:
        words = numpy.frombuffer(blob, "<u8")
        labels = tuple(names.get(int(w), "workspace") if base <= int(w) < base + ARENA
                       else None for w in words)
        masked = numpy.where([lab is not None for lab in labels], 0, words)
        out.append((fn, grid, block, smem, masked.tobytes(), labels))
    return out


def difference(general: list, fast: list) -> str | None:
    """Where two normalised launch lists first differ, in words (None: equal)."""
    if not fast:
        return "the fast call launched nothing"
    if len(general) != len(fast):
        return f"{len(general)} launches on the general path, {len(fast)} on the fast one"
    for i, (a, b) in enumerate(zip(general, fast)):
        if a[:4] != b[:4]:
            return f"launch {i}: (kernel, grid, block, smem) {a[:4]} vs {b[:4]}"
        if a[5] != b[5]:
            diff = [(w, x, y) for w, (x, y) in enumerate(zip(a[5], b[5])) if x != y]
            return f"launch {i}: pointer words (word, general, fast) {diff[:6]}"
        if a[4] != b[4]:
            import numpy
            x, y = numpy.frombuffer(a[4], "<u8"), numpy.frombuffer(b[4], "<u8")
            return f"launch {i}: argument words differ at {numpy.nonzero(x != y)[0][:8].tolist()}"
    return None


def check_launches() -> list[str]:
    """Per case, direction and (forward) return_lse: the first call after the caches are
    cleared (the general path) and the second (the fast path, where the case has one) launch
    the same kernels with the same grids and argument blocks, word for word, each pointer word
    naming the same array (its own call's outputs for o, lse, dq, dk, dv, dbias). Returns the
    mismatches, described."""
    install()
    import cupy
    import ml_dtypes
    import numpy
    import cuflash
    from cuflash import _api
    from cuflash._fast import ARRAY_MODIFIERS as ARRAY_KW   # (a call's own arrays)
    bf16 = numpy.dtype(ml_dtypes.bfloat16)
    q, k, v, do = (cupy.empty(SHAPE, bf16) for _ in range(4))
    inputs = {"q": q, "k": k, "v": v, "do": do}
    bad = []

    def names(**arrays):
        return {x.data.ptr: n for n, x in arrays.items() if x is not None}
    for case, kw0 in cases(cuflash, SHAPE[2]).items():
        kw = kw0

        def fresh(run):   # the fast call gets arrays of its own (the same layouts): a fast
            out = dict(kw0)   # path must patch the call's pointers, not keep the first call's
            if run == "fast":
                out.update({n: cupy.empty(kw0[n].shape, kw0[n].dtype) for n in ARRAY_KW
                            if n in kw0})
            return out, {n: out[n] for n in ARRAY_KW if n in out}
        mods = {}
        if "score_mod" in kw:         # its captured arrays (the cell's Captured objects)
            from cuflash._trace import Captured
            cells = [c.cell_contents for c in kw["score_mod"].__closure__ or ()]
            mods.update({f"captured{i}": c.array for i, c in enumerate(cells)
                         if isinstance(c, Captured)})

        def lists():   # a block mask's tile lists on the "device" (made by the first call)
            bm = kw.get("block_mask")
            return {} if bm is None else {
                f"block_lists{i}": x for i, x in enumerate(bm.__dict__.get("_device_lists",
                                                                           {}).values())}
        runs = {}
        for return_lse in (True, False):
            _api.clear_plans()
            for run in ("general", "fast"):
                kw, arrays = fresh(run)
                res, rec = launches(lambda: cuflash.attention(q, k, v, return_lse=return_lse,
                                                              **kw))
                o, lse = res if return_lse else (res, None)
                runs[run] = normalised(rec, names(**inputs, **mods, **arrays, **lists(), o=o,
                                                  lse=lse))
            why = difference(runs["general"], runs["fast"])
            if why:
                bad.append(f"{case} fwd return_lse={return_lse}: {why}")
        o, lse = cuflash.attention(q, k, v, return_lse=True, **kw0)
        _api.clear_plans()
        for run in ("general", "fast"):
            kw, arrays = fresh(run)
            grads, rec = launches(lambda: cuflash.attention_backward(do, q, k, v, o, lse, **kw))
            outs = dict(zip(("dq", "dk", "dv", "dbias"), grads))
            runs[run] = normalised(rec, names(**inputs, **mods, **arrays, **lists(), o=o,
                                              lse=lse, **outs))
        why = difference(runs["general"], runs["fast"])
        if why:
            bad.append(f"{case} bwd: {why}")
    return bad


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--json", default=None)
    ap.add_argument("--profile", default=None, metavar="CASE:DIRECTION",
                    help="also print cProfile's 30 functions with the most own time, e.g. "
                         "block_mask:bwd")
    ap.add_argument("--check", action="store_true",
                    help="instead: compare each case's general-path and fast-path launches, "
                         "word for word (check_launches); exit status 1 on a mismatch")
    args = ap.parse_args(argv)
    if args.check:
        bad = check_launches()
        print("\n".join(bad) if bad else "launches: the fast paths' equal the general path's")
        if args.json:
            pathlib.Path(args.json).write_text(json.dumps({"mismatches": bad}, indent=1))
        return 1 if bad else 0
    rows = measure(args.calls, args.profile)
    for r in rows:
        print(f"{r['case']:18s} {r['direction']}  {r['host_us']:7.1f} us  "
              f"plan-cache hits a call {r['hits']:.2f}  general path {r['general']:.2f}")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(
            {"meta": {"tool": "host_emulation", "shape": list(SHAPE), "calls": args.calls},
             "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
