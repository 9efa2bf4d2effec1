"""Varlen in the forward kernel families: all the sequences of ``attention_varlen`` in ONE
launch (helper "inference", issue 11).

How. The forward families (fwd_sm90, fwd_sm80, fwd_simt) are compiled a second time with
``CUFLASH_VARLEN`` defined (the source text prefixed with :data:`VARLEN_DEFINE`; a separate
NVRTC module, so the plain builds are untouched). In that build a block's prologue reads its
work item from a host-made list (``cuda_src/common.cuh``: ``VarlenItem``, ``varlen_view``,
``block_tile``): where its sequence's queries and keys start in the packed arrays, the
sequence's lengths, its Q tile and the causal offset of that sequence; the kernel then runs as
for one sequence (EVEN = false: per-sequence bounds). The list is made on the host because
``attention_varlen`` has ``cu_seqlens`` on the host anyway (it validates them); it is uploaded
once per plan (:func:`forward_plan`, :func:`backward_plan`: ``_varlen`` caches them by the
``cu_seqlens`` contents, so a repeated call neither builds nor uploads it). Items are ordered
heaviest first (visible keys).

Grid: ``nbatch x items`` blocks (``nbatch``: the merged head dims), item-major (block ``bid``
runs item ``bid / nbatch`` for batch item ``bid % nbatch``): the whole grid runs heaviest
first, so its last wave holds the lightest tiles of every head. The parameter block is
``cuflash::Params`` of the packed problem (``Lq``, ``Lk`` the packed totals) with
``varlen_items`` and the ``varlen`` pointer set.

When not: CPU arrays, more than 4 merged batch dims, inputs the tensor-core families cannot
read as they are (the plain path copies them; here the per-sequence loop of ``_varlen`` runs
instead), ``CUFLASH_VARLEN_KERNEL=0`` (A/B runs: force the per-sequence loop).
"""

from __future__ import annotations

import functools
import os

import numpy

from . import _families, _jit, _launch, _problem
from ._families import Shape
from ._variant import variant_params

#: the line that turns a forward family's source into its varlen build
VARLEN_DEFINE = "#define CUFLASH_VARLEN 1\n"
#: int32 words of one cuflash::VarlenItem in the list (6 used, padded to two 16-byte loads)
ITEM_WORDS = 8


def varlen_source(source: str) -> str:
    return VARLEN_DEFINE + _jit.load_source(source)


def work_list(cu_q, cu_k, block: int, causal, keys: bool = False) -> numpy.ndarray:
    """The (items, 8) int32 work list: (q0, Lq, k0, Lk, tile, causal_offset, 0, 0) for every Q
    tile (``keys``: every key tile, the backward's) of ``block`` rows of every sequence that has
    such rows, heaviest (most visible pairs) first, ties in sequence order. ``causal``: the
    ``causal=`` argument (its offset is per sequence)."""
    items, work = [], []
    for s in range(len(cu_q) - 1):
        q0, k0 = int(cu_q[s]), int(cu_k[s])
        lq, lk = int(cu_q[s + 1]) - q0, int(cu_k[s + 1]) - k0
        is_causal, off = _problem._check_causal(causal, lq, lk)
        for m in range(-(-(lk if keys else lq) // block)):
            items.append((q0, lq, k0, lk, m, off, 0, 0))
            if keys:          # queries that see key tile m: rows i >= first key - off
                first_row = max(0, m * block - off) if is_causal else 0
                work.append(max(0, lq - first_row))
            else:
                last_row = min(lq, (m + 1) * block) - 1
                work.append(max(0, min(lk, last_row + off + 1)) if is_causal else lk)
    order = sorted(range(len(items)), key=lambda i: -work[i])
    out = numpy.zeros((len(items), ITEM_WORDS), numpy.int32)
    if items:
        out[:] = [items[i] for i in order]
    return out


#: Tiles whose varlen build spills (the view's per-sequence Lq, Lk, causal offset and pointers
#: live in registers where the plain build reads the parameter bank): (family, head_dim, then
#: fwd_sm80's block_n, warps, slices or bwd_sm80's block_m, sub_m, warps) -> (the tile
#: arguments to use instead, the lowest compute capability where it spills). NVRTC 13, bf16
#: (f16 the same), spill bytes of the plain tile -> registers of the replacement, no spill:
#:   fwd_sm80 (64, 64, 4, 2): 56 (sm_80), 40 (sm_90a) -> block_n 32: 204-232
#:   fwd_sm80 (64, 32, 8, 1) causal small grid: 12 -> 4 warps: 143-145
#:   fwd_sm80 (128, 32, 4, 2): 16 on sm_90a only (0 at 255 on sm_80) -> 1 slice: 218-223
#:   fwd_sm80 (256, 32, 8, 1): 24 on sm_90a only -> 4 warps: 241-246
#:   bwd_sm80 (128, 64, 16, 8) non-causal: 8 (sm_80) -> block_m 32: 253-255
#: (fwd_sm80 and bwd_sm80 run on sm_90a only for d <= 32 or with CUFLASH_FWD/BWD overrides.)
#: Every other table entry's varlen build compiles without spills (bench/NOTES.md).
SPILLS_IN_VARLEN = {("fwd_sm80", 64, 64, 4, 2): ({"block_n": 32}, 80),
                    ("fwd_sm80", 64, 32, 8, 1): ({"warps": 4}, 80),
                    ("fwd_sm80", 128, 32, 4, 2): ({"slices": 1}, 90),
                    ("fwd_sm80", 256, 32, 8, 1): ({"warps": 4}, 90),
                    ("bwd_sm80", 128, 64, 16, 8): ({"block_m": 32}, 80)}


def _tiles_key(fam, t):
    if fam.name == "fwd_sm80":
        return (fam.name, t["head_dim"], t["block_n"], t["warps"], t["slices"])
    if fam.name == "bwd_sm80":
        return (fam.name, t["head_dim"], t["block_m"], t["sub_m"], t["warps"])
    return None


def choose(prob, dev, choice=None):
    """(family, traits, varlen name expression, reasons) for the packed problem ``prob``: the
    forward's, or the backward's given its plain ``choice``."""
    choice = choice or _families.choose("fwd", Shape.of(prob), dev)
    t = choice.traits
    change, min_cc = SPILLS_IN_VARLEN.get(_tiles_key(choice.family, t), (None, 0))
    reasons = list(choice.reasons)
    if change and dev.cc >= min_cc:
        t = t.replace(**change)
        reasons.append(f"  varlen build: {change} (the plain tiles spill there)")
    if dict(t.args).get("persist"):
        t = t.replace(persist=0)       # (a block's work item is its sequence's: no persistent grid)
    flags = dict(choice.flags)
    if "even" in flags:
        flags["even"] = False          # per-sequence bounds: never the EVEN build
    if "fuse_dq" in flags:
        flags["fuse_dq"] = False       # its counters are per batch item, not per sequence
        flags["one_launch"] = ""       # (and it runs with bwd_dot_do_o: _plan_one.py)
    expr = choice.family.expr(prob.dtype.name, t, Shape.of(prob).variant, **flags)
    return choice.family, t, expr, tuple(reasons)


@functools.lru_cache(maxsize=None)
def _kernel(source: str, expr: str, device_id: int, smem_bytes: int):
    """The varlen build of ``expr`` (its own RawModule), shared-memory limit raised as needed."""
    import cupy
    with cupy.cuda.Device(device_id):
        arch = _jit.arch_of_device(device_id)
        try:
            module = cupy.RawModule(code=varlen_source(source), options=_jit._options(arch),
                                    name_expressions=(expr,))
            k = module.get_function(expr)
            k.compile()
        except cupy.cuda.compiler.CompileException as exc:
            raise _jit.KernelCompileError(
                f"NVRTC failed on the varlen build of {expr} from cuda_src/{source} for "
                f"{arch}:\n{exc.get_message()}") from None
    if smem_bytes > 48 * 1024 and k.max_dynamic_shared_size_bytes < smem_bytes:
        k.max_dynamic_shared_size_bytes = smem_bytes
    return k


def enabled() -> bool:
    return os.environ.get("CUFLASH_VARLEN_KERNEL", "1").strip() not in ("0", "off", "loop")


def why_not(prob) -> str | None:
    """Why the one-launch varlen forward cannot run ``prob`` (None: it can)."""
    if prob.xp is numpy:
        return "NumPy arrays: the CPU path"
    if not enabled():
        return "CUFLASH_VARLEN_KERNEL=0"
    return None


def params(prob, tensors: dict, items: int):
    """(Params of the packed problem with varlen_items set, BatchLayout), or a reason."""
    layout = _launch.batch_layout(prob.batch_shape, list(tensors.values()))
    if len(layout.outer) > 1:
        return f"{len(prob.batch_shape)} batch dims that do not merge into 4: one grid only"
    p = _launch.pack(prob, tensors, layout, variant_params(prob))
    p["varlen_items"] = items
    return p, layout


class ForwardLaunch:
    """A built one-launch varlen forward: the ``Launch`` (Params packed, the work list's device
    pointer in it) and the work list on the device, alive as long as this object (a cached
    plan keeps it; the kernel only reads it)."""
    __slots__ = ("launch", "work", "device_id")

    def __init__(self, launch, work, device_id: int):
        self.launch, self.work, self.device_id = launch, work, device_id

    def __call__(self, stream: int, q: int, k: int, v: int, o: int, lse: int) -> None:
        """Launch on ``stream`` with these device pointers (arrays laid out as at planning)."""
        self.launch(stream, [q, k, v, o, lse])


def forward_plan(prob, cu_q, cu_k, causal, o, lse):
    """The :class:`ForwardLaunch` of the packed forward of ``prob`` into ``o`` / ``lse``
    (CuPy; ``cu_q``, ``cu_k`` on the host), or the reason it cannot run (nothing uploaded)."""
    why = why_not(prob)
    if why:
        return why
    import cupy
    dev = _families.device_info(prob.device_id)
    fam, t, expr, _ = choose(prob, dev)
    if fam.tensor_core_rows and not all(_launch.tensor_core_ready(x)
                                        for x in (prob.q, prob.k, prob.v)):
        return "q, k or v rows are not 16-byte aligned contiguous chunks (cp.async)"
    wl = work_list(cu_q, cu_k, t.block_m, causal)
    if not wl.shape[0]:
        return "no sequence has queries"
    packed = params(prob, {"q": prob.q, "k": prob.k, "v": prob.v, "o": o}, wl.shape[0])
    if isinstance(packed, str):
        return packed
    p, layout = packed
    wl_dev = cupy.asarray(wl)
    p["varlen"] = wl_dev.data.ptr
    kernel = _kernel(fam.source, expr, prob.device_id, t.smem_bytes)
    launch = _launch.Launch(kernel, layout.inner_n * wl.shape[0], t.threads, t.smem_bytes, p,
                            name=expr + " (varlen)")
    return ForwardLaunch(launch, wl_dev, prob.device_id)


def forward(prob, cu_q, cu_k, causal, o, lse) -> str | None:
    """Run the packed forward into ``o`` / ``lse`` (CuPy) in one launch; returns None, or the
    reason it did not run (then nothing was launched)."""
    plan = forward_plan(prob, cu_q, cu_k, causal, o, lse)
    if isinstance(plan, str):
        return plan
    import cupy
    plan(cupy.cuda.get_current_stream().ptr, prob.q.data.ptr, prob.k.data.ptr,
         prob.v.data.ptr, o.data.ptr, lse.data.ptr)
    # the list must outlive the kernel: CuPy frees it into its pool, reused only by later
    # work on this stream, which runs after the kernel
    return None


def _set_varlen(launch, items: int, ptr: int) -> None:
    """Write varlen_items / varlen into a Launch's parameter block (Params at offset 0)."""
    raw = launch.buf.view(numpy.uint8)
    n_at, p_at = (_launch.PARAMS.fields[f][1] for f in ("varlen_items", "varlen"))
    raw[n_at:n_at + 4] = numpy.frombuffer(numpy.int32(items).tobytes(), numpy.uint8)
    raw[p_at:p_at + 8] = numpy.frombuffer(numpy.uint64(ptr).tobytes(), numpy.uint8)


class BackwardLaunch:
    """A built one-launch varlen backward: the packed problem's ``_plan.BackwardPlan`` with
    its main launch swapped for the backward family's varlen build, and the work list on the
    device (alive as long as this object)."""
    __slots__ = ("plan", "work", "device_id")

    def __init__(self, plan, work, device_id: int):
        self.plan, self.work, self.device_id = plan, work, device_id

    def __call__(self, do, q, k, v, o, lse, dq, dk, dv) -> None:
        """Gradients into ``dq``, ``dk``, ``dv`` (arrays laid out as at planning; q, k, v as
        given or their broadcast views, which have the same pointers)."""
        self.plan(do, q, k, v, o, lse, dq, dk, dv)


def backward_plan(prob, cu_q, cu_k, causal, do, o, lse, dq, dk, dv, deterministic):
    """The :class:`BackwardLaunch` of the packed problem (CuPy; ``cu_q``, ``cu_k`` on the
    host): D = rowsum(dO o O), the dQ finish and the sums over broadcast dims are the plain
    plan's (``_plan.BackwardPlan`` of the packed problem), its main launch the backward
    family's varlen build over every (sequence, key tile). Or the reason it cannot run."""
    why = why_not(prob)
    if why:
        return why
    if deterministic:
        return "deterministic=True: its ordered dQ is per (batch item, Q tile) of one sequence"
    import cupy

    from . import _plan
    # (fuse_dq=False: the varlen build that replaces the main kernel does not round dQ, so
    # the plan keeps bwd_finish_dq's launch)
    plan = _plan.BackwardPlan(prob, do, o, lse, dq, dk, dv, False, fuse_dq=False)
    if plan.copies or len(plan.offsets) > 1:
        return "inputs the plan copies, or more than 4 merged batch dims"
    dev = _families.device_info(prob.device_id)
    fam, t, expr, _ = choose(prob, dev, plan.choice)
    wl = work_list(cu_q, cu_k, t.block_n, causal, keys=True)
    if not wl.shape[0]:
        return "no sequence has keys"
    wl_dev = cupy.asarray(wl)
    kernel = _kernel(fam.source, expr, prob.device_id, t.smem_bytes)
    nbatch = int(numpy.prod(prob.batch_shape))
    plan.launch.kernels[1] = (kernel.kernel.ptr, nbatch * wl.shape[0], t.threads, t.smem_bytes)
    _set_varlen(plan.launch, wl.shape[0], wl_dev.data.ptr)
    return BackwardLaunch(plan, wl_dev, prob.device_id)


def backward(prob, cu_q, cu_k, causal, do, o, lse, dq, dk, dv, deterministic) -> str | None:
    """dq, dk, dv of the packed problem (CuPy) with ONE launch of the backward family's varlen
    build (:func:`backward_plan`, built and run once). Returns None, or why it did not run."""
    plan = backward_plan(prob, cu_q, cu_k, causal, do, o, lse, dq, dk, dv, deterministic)
    if isinstance(plan, str):
        return plan
    plan(do, prob.q, prob.k, prob.v, o, lse, dq, dk, dv)
    return None


def explain(prob, cu_q, cu_k, causal, dev=None) -> str:
    """What the one-launch varlen forward would run (no GPU needed with ``dev``)."""
    why = why_not(prob) if dev is None else None
    if why:
        return f"per-sequence loop: {why}"
    dev = dev or _families.device_info(prob.device_id)
    fam, t, expr, reasons = choose(prob, dev)
    wl = work_list(cu_q, cu_k, t.block_m, causal)
    return "\n".join([f"varlen build of {expr}: {wl.shape[0]} work items (sequence, Q tile) "
                      f"x {int(numpy.prod(prob.batch_shape))} batch items, one launch"]
                     + list(reasons))
