"""The one launcher: the parameter block every kernel takes, its packer, the batch layout, and a
launch that costs a few microseconds of host time.

Every kernel family, forward and backward (and the host emulator of the sm80 kernels in the
tests), takes one ``cuflash::Params`` struct by value (``cuda_src/common.cuh``). :data:`PARAMS`
mirrors it field for field; :func:`pack` fills it for a problem, except the device pointers,
which change from call to call and are patched in by :class:`Launch` right before the launch.

Batch dimensions: the kernels index up to ``MAX_BATCH_DIMS`` batch dimensions through strides
(0 where an input is broadcast). :func:`batch_layout` first merges the dimensions that every
tensor walks contiguously; what is left beyond ``MAX_BATCH_DIMS`` becomes an *outer* loop of
launches over pointer offsets (rare; no copies). Forward and backward share this one loop.

Copies: the tensor-core families read rows with 16-byte ``cp.async`` chunks, so they need each
row of q, k, v (and dO) contiguous and 16-byte aligned with a head dim that is a multiple of 8.
An input that is not is copied by :func:`tensor_core_input` (only its own, un-broadcast extent)
into a C-contiguous buffer whose head dim is zero-padded to a multiple of 8: zero columns change
neither ``q @ k.T`` nor the first ``dv`` columns of ``p @ v``. Nothing else is ever copied.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import struct
import threading

import numpy

from . import _jit
from ._modifier_params import MODIFIER_PARAMS
from ._variant import VARIANT_PARAMS

#: kMaxBatchDims in cuda_src/common.cuh
MAX_BATCH_DIMS = 4
#: the strided tensors of Params, in its order
TENSORS = ("q", "k", "v", "o", "dout")
#: the device pointers of Params, in its order (the first words of the struct)
POINTERS = ("q", "k", "v", "o", "lse", "dout", "dpsum", "dq_acc", "dk_acc", "dv_acc", "dq_sem")
#: Params::out_flags (kBwdDkOut, kBwdDvOut): dk_acc / dv_acc is the gradient itself, in T;
#: (kBwdDqOut) the main kernel rounds dQ into Params::dq itself (bwd_sm90's fuse_dq builds)
#: (kBwdOwnD) it computes D itself and leaves dq_acc, dq_sem zeroed (bwd_sm90's one_launch)
DK_OUT, DV_OUT, DQ_OUT, OWN_D = 1, 2, 4, 8

_B = MAX_BATCH_DIMS
#: ``cuflash::Params``, field for field (8-byte fields first, then the Variant's, then 4-byte,
#: then the modifiers' ``ModifierParams``).
PARAMS = numpy.dtype(
    [(name, "<u8") for name in POINTERS]
    + [(f"{t}_batch_stride", "<i8", (_B,)) for t in TENSORS]
    + [(f"{t}_{kind}_stride", "<i8") for t in TENSORS for kind in ("row", "col")]
    + [("dq_block_stride", "<i8"), ("var", VARIANT_PARAMS), ("batch_shape", "<i4", (_B,))]
    + [(name, "<i4") for name in ("nbatch", "Lq", "Lk", "d", "dv", "num_m_blocks",
                                  "num_n_blocks", "grid_order", "out_flags")]
    # varlen builds (cuflash/_inference_varlen.py), then the modifiers' run-time values (0 for
    # plain attention): last, so that nothing above moves
    + [("varlen_items", "<i4"), ("varlen", "<u8"), ("mod", MODIFIER_PARAMS)]
    # dq itself where out_flags has DQ_OUT (the main kernel rounds dQ: no bwd_finish_dq launch)
    + [("dq", "<u8")],
    align=True)
_POINTER_WORD = {name: i for i, name in enumerate(POINTERS)}


def elem_strides(a) -> tuple[int, ...]:
    return tuple(s // a.itemsize for s in a.strides)


# ---------------------------------------------------------------------------------------------
# Batch layout: merged batch dims, the kernels' (<= 4) and the outer loop's
# ---------------------------------------------------------------------------------------------

def merge_batch_dims(shape, strides_per_tensor):
    """Drop extent-1 batch dims and merge neighbours that every tensor walks contiguously.

    ``strides_per_tensor`` is a list of per-tensor stride tuples over ``shape``. Returns
    ``(shape, [strides per tensor])`` with as few dimensions as the layouts allow.
    """
    dims = [(n, [s[i] for s in strides_per_tensor]) for i, n in enumerate(shape) if n != 1]
    merged: list[tuple[int, list[int]]] = []
    for n, st in dims:
        if merged:
            pn, pst = merged[-1]
            if all(ps == s * n for ps, s in zip(pst, st)):
                merged[-1] = (pn * n, st)
                continue
        merged.append((n, st))
    shape_out = tuple(n for n, _ in merged)
    strides_out = [tuple(st[t] for _, st in merged) for t in range(len(strides_per_tensor))]
    return shape_out, strides_out


@dataclasses.dataclass(frozen=True)
class BatchLayout:
    """How the batch items of a problem map onto launches.

    ``inner`` (at most MAX_BATCH_DIMS dims, padded with 1s in front) is what one launch
    covers, with each tensor's element strides ``strides[t]``; ``outer`` is a list with one
    entry per launch: ``(first batch item, element offset of each tensor)``.
    """
    inner: tuple[int, ...]
    strides: tuple[tuple[int, ...], ...]
    outer: tuple[tuple[int, tuple[int, ...]], ...]

    @property
    def inner_n(self) -> int:
        return math.prod(self.inner)


def batch_layout(batch_shape, tensors) -> BatchLayout:
    nb = len(batch_shape)
    shape, strides = merge_batch_dims(batch_shape, [elem_strides(t)[:nb] for t in tensors])
    outer = shape[:-_B] if len(shape) > _B else ()
    inner = shape[len(outer):]
    inner_n = math.prod(inner)
    launches = []
    for idx in numpy.ndindex(*outer):
        first = inner_n * (int(numpy.ravel_multi_index(idx, outer)) if outer else 0)
        launches.append((first, tuple(sum(i * s for i, s in zip(idx, st)) for st in strides)))
    pad = _B - len(inner)
    return BatchLayout((1,) * pad + inner,
                       tuple((0,) * pad + st[len(outer):] for st in strides), tuple(launches))


# ---------------------------------------------------------------------------------------------
# The packer
# ---------------------------------------------------------------------------------------------

def pack(prob, tensors: dict, layout: BatchLayout, variant_params, *, num_m_blocks: int = 0,
         num_n_blocks: int = 0, grid_order: int = 0, out_flags: int = 0,
         dq_block_stride: int = 0) -> numpy.ndarray:
    """Params of one problem, pointers left 0 (a 0-d structured array).

    ``tensors`` maps names of :data:`TENSORS` to the arrays as the kernel will read them (in
    the order ``layout`` was built from)."""
    p = numpy.zeros((), PARAMS)
    for (name, t), st in zip(tensors.items(), layout.strides):
        es = elem_strides(t)
        p[f"{name}_row_stride"], p[f"{name}_col_stride"] = es[-2], es[-1]
        p[f"{name}_batch_stride"] = st
    p["dq_block_stride"] = dq_block_stride
    p["var"] = variant_params
    p["batch_shape"] = layout.inner
    p["nbatch"] = layout.inner_n
    p["Lq"], p["Lk"], p["d"], p["dv"] = prob.Lq, prob.Lk, prob.d, prob.dv
    p["num_m_blocks"], p["num_n_blocks"] = num_m_blocks, num_n_blocks
    p["grid_order"], p["out_flags"] = grid_order, out_flags
    return p


# ---------------------------------------------------------------------------------------------
# Inputs of the tensor-core families
# ---------------------------------------------------------------------------------------------

def tensor_core_ready(x) -> bool:
    """True when ``x`` (batch..., L, d) can be read by the cp.async loads as it is."""
    st = elem_strides(x)
    if x.shape[-1] % 8 or st[-1] != 1 or x.data.ptr % 16:
        return False
    return all(s % 8 == 0 for n, s in zip(x.shape[:-1], st[:-1]) if n > 1)


def tensor_core_input(x):
    """``x`` itself, or a contiguous copy of its un-broadcast extent with the head dim
    zero-padded to a multiple of 8, broadcast back to ``x.shape``."""
    if tensor_core_ready(x):
        return x
    import cupy
    core = x[tuple(slice(0, 1) if (s == 0 and n > 1) else slice(None)
                   for n, s in zip(x.shape[:-2], x.strides[:-2]))]
    d = x.shape[-1]
    buf = cupy.zeros(core.shape[:-1] + (-(-d // 8) * 8,), dtype=x.dtype)
    buf[..., :d] = core
    return cupy.broadcast_to(buf[..., :d], x.shape)


# ---------------------------------------------------------------------------------------------
# The launch
# ---------------------------------------------------------------------------------------------

def kernel(source: str, expr: str, device_id: int, smem_bytes: int, prelude: str = ""):
    """The compiled kernel, with its dynamic shared-memory limit raised where it needs it
    (``prelude``: source compiled before the family's, the Variant's traced functions)."""
    k = _jit.get_kernel(source, expr, device_id, prelude)
    if smem_bytes > 48 * 1024 and k.max_dynamic_shared_size_bytes < smem_bytes:
        k.max_dynamic_shared_size_bytes = smem_bytes
    return k


class Launch:
    """Kernels that take one argument block, issued through ``cuLaunchKernel``.

    The argument block lives in a buffer of this object; ``cuLaunchKernel`` copies it at the
    call, so the buffer can be patched again right after. A call writes the leading 8-byte
    words of the block (the device pointers: Params begins with them) and launches each kernel
    of the Launch in order with that same block (the backward's D = rowsum(dO o O) and main
    kernel share one). A lock makes patch-and-launch atomic for threads sharing one plan.
    ``offsets`` are the byte offsets of the kernel's arguments in the block: one, Params at 0,
    for every family; one per argument for the helper kernels with plain arguments.
    """

    __slots__ = ("name", "kernels", "buf", "_bytes", "_argv", "argv_ptr", "lock",
                 "_launch_kernel")

    def __init__(self, k, grid: int, block: int, smem: int, block_args: numpy.ndarray,
                 offsets=(0,), name: str = ""):
        from cupy.cuda import driver
        self._launch_kernel = driver.launchKernel   # looked up once, not per call
        self.name = name
        self.kernels = [(k.kernel.ptr, int(grid), int(block), int(smem))]
        self.buf = numpy.zeros(-(-block_args.nbytes // 8), numpy.uint64)
        self.buf.view(numpy.uint8)[:block_args.nbytes] = numpy.frombuffer(
            block_args.tobytes(), numpy.uint8)
        self._bytes = memoryview(self.buf).cast("B")   # what _patch writes into
        base = self.buf.ctypes.data
        self._argv = numpy.array([base + o for o in offsets], numpy.uint64)
        self.argv_ptr = self._argv.ctypes.data
        self.lock = threading.Lock()

    def then(self, k, grid: int, block: int, smem: int) -> "Launch":
        """Also launch ``k`` (after the kernels already here) with the same argument block."""
        self.kernels.append((k.kernel.ptr, int(grid), int(block), int(smem)))
        return self

    @property
    def grid(self) -> int:
        return self.kernels[-1][1]

    def __call__(self, stream: int, words: list[int], extra=()) -> None:
        """Write ``words`` over the leading 8-byte words of the block (and each ``(index,
        value)`` of ``extra`` over the 8-byte word ``index``: the modifiers' pointers) and
        launch."""
        lock = self.lock
        lock.acquire()   # (by hand, not ``with``: half the cost, host time per call)
        try:
            _patch(len(words)).pack_into(self._bytes, 0, *words)
            for i, w in extra:   # (a struct pack, not a NumPy item store: host time)
                _WORD.pack_into(self._bytes, 8 * i, w)
            launch = self._launch_kernel
            try:
                for fn, grid, block, smem in self.kernels:   # (inline: host time per call)
                    launch(fn, grid, 1, 1, block, 1, 1, smem, stream, self.argv_ptr, 0)
            except Exception as exc:
                _launch_again(exc, self.kernels, launch, stream, self.argv_ptr)
        finally:
            lock.release()

    def direct(self, n: int, at: int | None = None):
        """``go(stream, w0, .., w(n-1))``: what ``self(stream, [w0, .., w(n-1)])`` does, for
        the fast paths (call it once the Launch is complete: ``then`` adds no kernel to it),
        with what it reads bound once in the closure and the words packed from its arguments
        (no list): 1.16 -> 0.43 us against ``__call__`` on a 2-core EPYC under
        bench/host_emulation.py (session 19), about 2.5x that on the H200 machine's host.
        ``at``: ``go`` takes one word more, written over the 8-byte word ``at`` (bwd_sm90's
        ``dq``, after the pointers)."""
        pack, buf, lock, launch, argv = (_patch(n).pack_into, self._bytes, self.lock,
                                         self._launch_kernel, self.argv_ptr)
        put, off = _WORD.pack_into, 8 * (at or 0)
        kernels = tuple(self.kernels)

        def go(stream, *words):
            lock.acquire()
            try:
                if at is None:
                    pack(buf, 0, *words)
                else:
                    pack(buf, 0, *words[:-1])
                    put(buf, off, words[-1])
                try:
                    for fn, grid, block, smem in kernels:
                        launch(fn, grid, 1, 1, block, 1, 1, smem, stream, argv, 0)
                except Exception as exc:
                    _launch_again(exc, kernels, launch, stream, argv)
            finally:
                lock.release()
        return go


def _launch_again(exc: Exception, kernels, launch, stream: int, argv: int) -> None:
    """After a launch of ``kernels`` failed with ``exc``: a thread that has made no CUDA runtime
    call has no current context (CuPy's pool can hand it memory without one: cupy/cupy#72), and
    cuLaunchKernel is a driver call: make the current device's primary context current, once,
    and launch them (the first kernel failed, so none ran). Free on the path that works. Any
    other failure is raised."""
    if getattr(exc, "status", None) != _CUDA_ERROR_INVALID_CONTEXT:
        raise exc
    from cupy.cuda import runtime
    runtime.setDevice(runtime.getDevice())
    for fn, grid, block, smem in kernels:
        launch(fn, grid, 1, 1, block, 1, 1, smem, stream, argv, 0)


#: cuLaunchKernel's status where the calling thread has no current CUDA context
_CUDA_ERROR_INVALID_CONTEXT = 201


#: one little-endian 8-byte word (Launch's ``extra``)
_WORD = struct.Struct("<Q")


@functools.lru_cache(maxsize=None)
def _patch(n: int) -> struct.Struct:
    """n little-endian 8-byte words (a struct pack is ~3x cheaper than a NumPy slice store of
    a Python list: host time per call)."""
    return struct.Struct(f"<{n}Q")


def word(name: str) -> int:
    """The index of pointer field ``name`` among the first 8-byte words of Params."""
    return _POINTER_WORD[name]
