"""Plans: every host-side decision of a GPU call, made once and cached.

A plan holds what a call with given shapes, strides, dtype, keywords and device needs: the
family and traits the dispatcher chose (with its reasons), the compiled kernels, the grid, and
the parameter blocks with everything but the device pointers packed. Running a plan allocates
the outputs and workspaces, patches the pointers and launches: no validation, no dispatch, no
packing. ``_api`` keeps the plans in a bounded, thread-safe cache (:class:`PlanCache`) keyed by
everything they depend on, so a repeated call costs a dictionary lookup and the launches.
"""

from __future__ import annotations

import dataclasses
import math

import numpy

from . import _families, _fwd_schedule, _launch, _plan_aux, _plan_one
from ._families import Shape
from ._launch import DK_OUT, DQ_OUT, DV_OUT, OWN_D, Launch, batch_layout, pack
from ._plan_cache import PlanCache  # noqa: F401  (the plan caches' type: _api, _inference, _varlen)
from ._plan_mods import ModifierPatch, dbias_finish, dbias_plan, dbias_vec4
from ._variant import variant_params

#: blockIdx -> (batch item, tile) order (common.cuh, grid_tile): 0 batch-major, 1 tile-major.
#: Tile-major under a causal mask puts the heaviest tiles of every batch item first.
CAUSAL_GRID_ORDER = 1

def grid_order(choice, causal: bool, block_mask: bool = False) -> int:
    """Tile-major under a causal mask for the tensor-core families (whose ordering is written
    for it), and for a block mask without causal where ``_variant.bmask_tile_major`` says so
    (by default: prefix-LM's heaviest tiles are the ones numbered 0), else batch-major.
    ``CUFLASH_GRID_ORDER`` overrides it for A/B runs."""
    import os
    from ._variant import bmask_tile_major
    fam = choice.family
    if fam.name in ("fwd_simt", "bwd_simt", "bwd_sm80"):   # batch-major by construction
        return 0
    env = os.environ.get("CUFLASH_GRID_ORDER")
    if env is not None:
        return int(env)
    if causal:
        return CAUSAL_GRID_ORDER
    kind = "bwd" if fam.name.startswith("bwd") else "fwd"
    return 1 if block_mask and bmask_tile_major(kind) else 0


@dataclasses.dataclass(frozen=True)
class Dims:
    """The sizes of a problem, without its arrays (a cached plan must not keep them alive)."""
    batch_shape: tuple[int, ...]
    Lq: int
    Lk: int
    d: int
    dv: int
    dtype: numpy.dtype

    @classmethod
    def of(cls, prob) -> "Dims":
        return cls(prob.batch_shape, prob.Lq, prob.Lk, prob.d, prob.dv, prob.dtype)


def _cupy():
    import cupy
    return cupy


def _stream() -> int:
    return _cupy().cuda.get_current_stream().ptr


#: the 8-byte word of Params::dq in the parameter block (patched where the main kernel rounds dQ)
_DQ_WORD = _launch.PARAMS.fields["dq"][1] // 8


def _checked_choice(kind: str, shape, dev, device_id: int):
    """The dispatcher's choice, checked once per plan against its compile on this GPU
    (``_spills``): a build that uses local memory (or, fwd_sm90's long-list rule, leaves room
    for fewer blocks an SM than it was chosen for) is recorded, and ``choose`` run again picks
    its fallback (fwd_sm90: the other blocks an SM; bwd_sm90's block mask: bwd_sm80 or 64 rows)."""
    check = _families.kept_blocks_spilled if kind == "fwd" else _families.block_mask_bwd_spilled
    choice = _families.choose(kind, shape, dev)
    return _families.choose(kind, shape, dev) if check(choice, shape, device_id) else choice


def _run(launch: Launch, offsets, stream: int, bases: list[int]) -> None:
    """Launch once per outer batch index: the base pointers plus that launch's offsets."""
    if len(offsets) == 1 and not any(offsets[0]):
        launch(stream, bases)
    else:
        for offs in offsets:
            launch(stream, [b + o for b, o in zip(bases, offs)])


# ---------------------------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------------------------

class ForwardPlan:
    """The forward of one (shapes, strides, dtype, keywords, device).

    ``mods`` (a ``Modifiers`` record, or None) are the call's modifiers: the Variant is
    compiled for those that are on, their values are packed into ``Params.mod``, and their
    arrays' pointers are patched in on every call (``__call__``'s ``mods``, of the same
    layouts)."""

    def __init__(self, prob, o, lse, mods=None):
        dev = _families.device_info(prob.device_id)
        self.device_id = prob.device_id
        self.mods = ModifierPatch(prob, mods) if mods is not None and mods.features else None
        shape = Shape.of(prob, mods=mods)
        self.choice = _checked_choice("fwd", shape, dev, prob.device_id)
        if self.mods is not None and self.mods.block_mask:   # its lists for these tiles
            self.mods.set_tiles(self.choice.family.name, self.choice.traits)
        fam, t = self.choice.family, self.choice.traits
        self.copies = fam.tensor_core_rows and not all(
            _launch.tensor_core_ready(x) for x in (prob.q, prob.k, prob.v))
        self.num_m_blocks = -(-prob.Lq // t.block_m)
        self.lse_row = prob.Lq * lse.itemsize
        self._vp = variant_params(prob)
        self._order = grid_order(self.choice, prob.causal, shape.variant.block_mask)
        self._kernel = _launch.kernel(fam.source, self.choice.expr, prob.device_id, t.smem_bytes,
                                      shape.variant.prelude)
        self.dims = Dims.of(prob)
        # fwd_sm90ws PERSIST 3: the Q tiles' key tiles, and the blocks' item lists on the device
        # by (batch items, grid) (_fwd_schedule.lpt_schedule; made once, read through Params.varlen)
        self._tiles = _fwd_schedule.item_tiles(
            prob.Lq, prob.Lk, t.block_m, t.block_n, prob.causal, prob.causal_offset,
            getattr(mods, "window", None)) if dict(t.args).get("persist") == 3 else None
        self._lists: dict = {}
        self.launch, self.offsets = self._build(prob.q, prob.k, prob.v, o, mods)

    def _build(self, q, k, v, o, mods=None):
        """The launch for inputs laid out as q, k, v, o: (Launch, per-launch pointer offsets)."""
        tensors = {"q": q, "k": k, "v": v, "o": o}
        extra = self.mods.arrays(mods) if self.mods is not None else []
        layout = batch_layout(self.dims.batch_shape, list(tensors.values()) + extra)
        p = pack(self.dims, tensors, layout, self._vp, num_m_blocks=self.num_m_blocks,
                 grid_order=self._order)
        if self.mods is not None:
            self.mods.pack_into(p, layout, len(tensors), mods)
        t = self.choice.traits
        # (one block a (batch item, Q tile), or fewer for fwd_sm90's persistent builds)
        grid = _families.fwd_sm90_grid(t, layout.inner_n * self.num_m_blocks,
                                       _families.device_info(self.device_id))
        if self._tiles is not None:
            if (layout.inner_n, grid) not in self._lists:
                import cupy
                with cupy.cuda.Device(self.device_id):
                    self._lists[layout.inner_n, grid] = cupy.asarray(_fwd_schedule.lpt_schedule(
                        self._tiles, layout.inner_n, self._order, grid))
            p["varlen"] = self._lists[layout.inner_n, grid].data.ptr
        launch = Launch(self._kernel, grid, t.threads, t.smem_bytes, p, name=self.choice.expr)
        # byte offsets of q, k, v, o, lse (the leading words of Params) for each launch
        sizes = [x.itemsize for x in (q, k, v, o)]
        offsets = [[e * n for e, n in zip(offs, sizes)] + [first * self.lse_row]
                   for first, offs in layout.outer]
        return launch, offsets

    def __call__(self, q, k, v, o, lse, mods=None) -> None:
        """Compute into ``o`` and ``lse`` (arrays laid out as at planning) on the current
        stream; q, k, v as given to ``attention`` or broadcast views of them; ``mods`` the
        call's modifiers (laid out as at planning)."""
        if self.copies:   # a layout the cp.async loads cannot read: copy, and pack for it
            q, k, v = (_launch.tensor_core_input(x) for x in (q, k, v))
            launch, offsets = self._build(q, k, v, o, mods)
        else:
            launch, offsets = self.launch, self.offsets
        bases = [q.data.ptr, k.data.ptr, v.data.ptr, o.data.ptr, lse.data.ptr]
        if self.mods is None:
            _run(launch, offsets, _stream(), bases)
            return
        keep = self.mods.pointer_arrays(mods)   # converted slopes / sinks live until launched
        launch(_stream(), bases, extra=self.mods.words(keep, mods))

    def run(self, stream: int, q: int, k: int, v: int, o: int, lse: int) -> None:
        """Launch with raw device pointers (the fast path of ``_api``; not for copies plans)."""
        _run(self.launch, self.offsets, stream, [q, k, v, o, lse])

    def explain(self) -> str:
        return explain_choice(self.choice, self.launch.grid)


# ---------------------------------------------------------------------------------------------
# Backward
# ---------------------------------------------------------------------------------------------

def _align(n: int) -> int:
    return -(-n // 256) * 256


class BackwardPlan:
    """The backward of one (shapes, strides, dtype, keywords, device): D = rowsum(dO o O),
    the main kernel (FA-2 Algorithm 2), and the finishing of dQ (and of dK, dV where they
    must be summed over broadcast dimensions)."""

    def __init__(self, prob, do, o, lse, dq, dk, dv, deterministic: bool, mods=None,
                 fuse_dq: bool = True):
        dev = _families.device_info(prob.device_id)
        self.device_id = prob.device_id
        self.prob = Dims.of(prob)
        self.mods = ModifierPatch(prob, mods) if mods is not None and mods.features else None
        shape = Shape.of(prob, deterministic, mods)
        self.choice = _checked_choice("bwd", shape, dev, prob.device_id)
        if self.mods is not None and self.mods.block_mask:   # its lists for these tiles
            self.mods.set_tiles(self.choice.family.name, self.choice.traits)
        lse_contiguous = lse.flags.c_contiguous
        fam, t = self.choice.family, self.choice.traits
        self.tc = fam.tensor_core_rows
        self.copies = self.tc and not all(
            _launch.tensor_core_ready(x) for x in (prob.q, prob.k, prob.v, do))
        self.acc = numpy.dtype(numpy.float64 if prob.dtype == numpy.float64 else numpy.float32)
        nbatch = math.prod(prob.batch_shape)
        Lq, Lk, d, d_v = prob.Lq, prob.Lk, prob.d, prob.dv
        self.num_n_blocks = -(-Lk // t.block_n)
        self.num_m_blocks = -(-Lq // t.block_m)
        self.parts = self.num_n_blocks if (deterministic and not self.tc) else 1
        # The tensor-core kernels write dk, dv straight into the result where no broadcast
        # dimension needs summing (the result then has every batch item, C-contiguous)
        self.dk_direct = self.tc and dk.size == nbatch * Lk * d
        self.dv_direct = self.tc and dv.size == nbatch * Lk * d_v
        self.dq_direct = dq.size == nbatch * Lq * d
        # dQ rounded by the main kernel itself (one launch fewer: _families.fuse_dq_finish)
        # (fuse_dq=False: a caller that swaps in a main kernel of its own, the varlen build;
        # the flag is chosen for plain attention only, so the layout has no modifier arrays)
        launches = len(batch_layout(prob.batch_shape, [prob.q, prob.k, prob.v, o, do]).outer) \
            if self.choice.flag.get("fuse_dq") else 1
        self.fused_dq = fuse_dq and _families.fuse_dq_finish(self.choice, self.dq_direct,
                                                             launches)
        a = self.acc.itemsize
        # dL/dbias of every (item, i, j), float32: zeroed where some pair is in no tile the
        # kernels visit, else (dbias_full) every element is written and it needs no zeroing
        has_bias = mods is not None and mods.bias is not None
        self.dbias_full, self.dbias_sum = dbias_plan(shape.variant, mods, prob, has_bias,
                                                     fam.name)
        dbias = 4 * nbatch * Lq * Lk if has_bias else 0
        sizes = {"dq_acc": self.parts * nbatch * Lq * d * a,
                 # bwd_sm80's deterministic semaphores, or the fused finishing's counters
                 "dq_sem": 4 * nbatch * self.num_m_blocks if (
                     (deterministic and fam.name == "bwd_sm80") or self.fused_dq) else 0,
                 "dbias": 0 if self.dbias_full else dbias,
                 "dpsum": nbatch * Lq * a,
                 "dbias_full": dbias if self.dbias_full else 0,   # (after the zeroed span)
                 "dk_acc": 0 if self.dk_direct else nbatch * Lk * d * a,
                 "dv_acc": 0 if self.dv_direct else nbatch * Lk * d_v * a,
                 "dq_sum": 0 if self.dq_direct else nbatch * Lq * d * a}
        self.ws_offsets, total = {}, 0
        for name, n in sizes.items():
            self.ws_offsets[name] = total
            total += _align(n)
        self.workspace = max(total, 256)
        # dq_acc, dq_sem and dbias start at 0 (bwd_dot_do_o zeroes them: not a memset, which
        # would cost a driver call per backward); they begin the workspace, so at dq_acc
        self.zeroed = self.ws_offsets["dpsum"]
        self.direct = self.dq_direct and self.dk_direct and self.dv_direct
        self.lse_itemsize = 8 if prob.dtype == numpy.float64 else 4
        self.lse_contiguous = lse_contiguous
        self._vp = variant_params(prob)
        self._order = grid_order(self.choice, prob.causal, shape.variant.block_mask)
        self._main = _launch.kernel(fam.source, self.choice.expr, prob.device_id, t.smem_bytes,
                                    shape.variant.prelude)
        # one launch (small problems, _plan_one.py): D and the zeroing in the main kernel, its
        # workspace kept per stream; else bwd_dot_do_o first, on a fresh workspace a call
        self.one_kernel = _plan_one.usable(self, o, do)
        self.zeroed_ws = _plan_one.ZeroedWorkspaces(self.workspace) if self.one_kernel else None
        self._dot = None if self.one_kernel else _plan_aux.dot_kernel(prob.dtype, prob.device_id)
        # dQ's finishing (bwd_finish_dq): into dq itself, or into a buffer to sum
        self.finish = None if self.fused_dq else _plan_aux.Finish(
            prob.dtype, self.acc, "T" if self.dq_direct else "Acc", nbatch * Lq * d, self.parts,
            prob.device_id, dev.num_sms)
        self.num_sms = dev.num_sms
        self.dbias_finish = None if self.dbias_sum is None else dbias_finish(
            self.dbias_sum, prob.device_id, dev.num_sms)
        self.launch, self.offsets = self._build(prob.q, prob.k, prob.v, o, do, mods)
        # run()'s shortcut: one launch at offset 0, dq, dk, dv written directly
        self._one_launch = (len(self.offsets) == 1 and not any(self.offsets[0])
                            and self.direct and self.mods is None)
        self._ws_words = tuple(self.ws_offsets[n] for n in ("dpsum", "dq_acc", "dq_sem"))
        # ... its launch with the call's pointers (Launch.direct), dq's word after them where
        # the main kernel writes dq itself
        self._go = self.launch.direct(len(_launch.POINTERS), _DQ_WORD if (
            self.one_kernel or self.fused_dq) else None) if self._one_launch else None

    def _build(self, q, k, v, o, do, mods=None):
        """The launches for inputs laid out as q, k, v, o, dO: (Launch of the D kernel and the
        main kernel, per-launch byte offsets of the 11 pointers of Params)."""
        prob, t = self.prob, self.choice.traits
        tensors = {"q": q, "k": k, "v": v, "o": o, "dout": do}
        extra = self.mods.arrays(mods) if self.mods is not None else []
        layout = batch_layout(prob.batch_shape, list(tensors.values()) + extra)
        flags = ((DK_OUT if self.dk_direct else 0) | (DV_OUT if self.dv_direct else 0)
                 | (DQ_OUT if self.fused_dq else 0) | (OWN_D if self.one_kernel else 0))
        n = layout.inner_n
        p = pack(prob, tensors, layout, self._vp, num_m_blocks=self.num_m_blocks,
                 num_n_blocks=self.num_n_blocks, grid_order=self._order, out_flags=flags,
                 dq_block_stride=(math.prod(prob.batch_shape) * prob.Lq * prob.d
                                  if self.parts > 1 else 0))
        if self.mods is not None:
            self.mods.pack_into(p, layout, len(tensors), mods)
        # -- 4: D = rowsum(dO o O) (and the accumulators zeroed), then 5-19: one block per
        #    (batch item, key tile)
        args = numpy.zeros((), _plan_aux.DOT_ARGS)
        # (with an outer loop of launches each would zero from its own offset: _run zeroes the
        # workspace once instead, with a memset)
        args["p"], args["zero_bytes"] = p, (0 if len(layout.outer) > 1 else self.zeroed)
        if self.one_kernel:   # (Params alone: the main kernel's block)
            launch = Launch(self._main, n * self.num_n_blocks, t.threads, t.smem_bytes, p,
                            name=self.choice.expr)
        else:
            launch = Launch(self._dot, _plan_aux.dot_grid(n * prob.Lq, self.num_sms),
                            _plan_aux.AUX_THREADS, 0, args, offsets=_plan_aux.DOT_OFFSETS,
                            name="bwd_dot_do_o").then(
                self._main, n * self.num_n_blocks, t.threads, t.smem_bytes)
        a, Lq, Lk = self.acc.itemsize, prob.Lq, prob.Lk
        sizes = [x.itemsize for x in (q, k, v, o)]
        dk_row = prob.d * (prob.dtype.itemsize if self.dk_direct else a)
        dv_row = prob.dv * (prob.dtype.itemsize if self.dv_direct else a)
        offsets = []   # in _launch.POINTERS order
        for first, offs in layout.outer:    # q, k, v, o, dO, then the modifiers' arrays
            oq, ok, ov, oo, odo = offs[:5]
            offsets.append([oq * sizes[0], ok * sizes[1], ov * sizes[2], oo * sizes[3],
                            first * Lq * self.lse_itemsize, odo * do.itemsize, first * Lq * a,
                            first * Lq * prob.d * a, first * Lk * dk_row, first * Lk * dv_row,
                            first * 4 * self.num_m_blocks])
        return launch, offsets

    def __call__(self, do, q, k, v, o, lse, dq, dk, dv, mods=None, extra_grads=None) -> None:
        """Write the gradients into ``dq``, ``dk``, ``dv`` (arrays of q's, k's, v's shapes, as
        at planning) on the current stream; with modifiers (``mods``, laid out as at planning)
        also ``extra_grads``' ``dbias`` and ``dsink`` (arrays of the bias's and the sink's
        shapes and dtypes), summed over their broadcast dimensions."""
        import cupy
        if self.copies:
            q, k, v, do = (_launch.tensor_core_input(x) for x in (q, k, v, do))
            launches = self._build(q, k, v, o, do, mods)
        else:
            launches = (self.launch, self.offsets)
        if not self.lse_contiguous:
            lse = cupy.ascontiguousarray(lse)
        keep = self.mods.pointer_arrays(mods) if self.mods is not None else None
        ws = self._run(launches, _stream(), do.data.ptr, q.data.ptr, k.data.ptr, v.data.ptr,
                       o.data.ptr, lse.data.ptr, dq.data.ptr, dk.data.ptr, dv.data.ptr, keep, mods)
        self._sum_broadcast(ws, dq, dk, dv)
        if self.mods is not None:
            self._modifier_grads(ws, lse, keep, extra_grads or {})

    def run(self, stream: int, do: int, q: int, k: int, v: int, o: int, lse: int, dq: int,
            dk: int, dv: int) -> None:
        """Launch with raw device pointers (the fast path of ``_api``: plans whose gradients
        need no broadcast sum and whose inputs need no copy)."""
        if not self._one_launch:
            self._run((self.launch, self.offsets), stream, do, q, k, v, o, lse, dq, dk, dv)
            return
        # (_run's steps for one launch and gradients written directly, with the workspace
        # offsets looked up once: host time per call)
        one = self.one_kernel
        ws = self.zeroed_ws.by_stream.get(stream) or self.zeroed_ws.get(stream) if one else None
        if ws is None:   # (one kernel past _plan_one.BUDGET: a fresh workspace, zeroed here)
            ws = _cupy().cuda.alloc(self.workspace)
            if one:
                _cupy().cuda.runtime.memsetAsync(ws.ptr, 0, self.zeroed, stream)
        base = ws.ptr
        dpsum, dq_acc, dq_sem = self._ws_words
        args = (stream, q, k, v, o, lse, do, base + dpsum, base + dq_acc, dk, dv, base + dq_sem)
        if one:
            try:
                self._go(*args, dq)
            except BaseException:
                self.zeroed_ws.reset(stream)
                raise
        elif self.fused_dq:
            self._go(*args, dq)
        else:
            self._go(*args)
            self.finish.to(dq)(stream, (base + dq_acc, dq))

    def run_modified(self, stream: int, do: int, q: int, k: int, v: int, o: int, lse: int,
                     dq: int, dk: int, dv: int, mod_words) -> None:
        """Launch with raw device pointers a plan with modifiers that carry no array of the
        call (``_fast.FastModified``: direct gradients, lse contiguous, no copies), the
        modifiers' pointer words (``ModifierPatch.words``: a block mask's lists, captured
        arrays) computed once by the caller."""
        self._run((self.launch, self.offsets), stream, do, q, k, v, o, lse, dq, dk, dv,
                  mod_words=mod_words)

    def _run(self, launches, stream, do, q, k, v, o, lse, dq, dk, dv, keep=None, mods=None,
             mod_words=None):
        if self.one_kernel:    # (the slow path's first call; run() is the same launch)
            self.run(stream, do, q, k, v, o, lse, dq, dk, dv)
            return None
        ws = _cupy().cuda.alloc(self.workspace)
        base = ws.ptr    # its first self.zeroed bytes are zeroed by bwd_dot_do_o ...
        if len(launches[1]) > 1 and self.zeroed:   # ... or here, before an outer loop
            _cupy().cuda.runtime.memsetAsync(base, 0, self.zeroed, stream)
        off = self.ws_offsets
        words = [
            q, k, v, o, lse, do, base + off["dpsum"], base + off["dq_acc"],
            dk if self.dk_direct else base + off["dk_acc"],
            dv if self.dv_direct else base + off["dv_acc"], base + off["dq_sem"]]
        extra = [(_DQ_WORD, dq)] if self.fused_dq else []   # the main kernel rounds dQ into it
        if keep is None and mod_words is None and not extra:
            _run(*launches, stream, words)
        else:   # (fused_dq: one launch, _families.fuse_dq_finish; modifiers: one, pack_into)
            if keep is not None:
                extra += self.mods.words(keep, mods)
                if self.mods.has_bias:   # the kernel's dL/dbias of every (item, i, j)
                    extra.append((self.mods.dbias_word, base + self._dbias_offset()))
            elif mod_words is not None:
                extra += mod_words
            launches[0](stream, words, extra=extra)
        if not self.fused_dq:
            # dQ from its accumulation buffer, rounded once: into dq itself, or into a buffer
            # that _sum_broadcast sums over the broadcast dimensions (its first bytes)
            dst = dq if self.dq_direct else base + off["dq_sum"]
            self.finish.to(dst)(stream, [base + off["dq_acc"], dst])
        return ws

    def _sum_broadcast(self, ws, dq, dk, dv) -> None:
        """dQ, dK, dV of broadcast inputs: summed over the dimensions broadcasting added."""
        if self.direct:
            return
        import cupy
        prob, off, acc = self.prob, self.ws_offsets, self.acc
        bs = prob.batch_shape

        def view(name, shape):
            return cupy.ndarray(shape, acc, memptr=ws + off[name])
        if not self.dq_direct:
            _sum_into(dq, view("dq_sum", bs + (prob.Lq, prob.d)))
        if not self.dk_direct:
            _sum_into(dk, view("dk_acc", bs + (prob.Lk, prob.d)))
        if not self.dv_direct:
            _sum_into(dv, view("dv_acc", bs + (prob.Lk, prob.dv)))

    def _modifier_grads(self, ws, lse, keep, grads: dict) -> None:
        """dbias (the kernel's per-item float32 values summed over the bias's broadcast dims,
        in a fixed order: bitwise reproducible) and dsink = -sum_i exp(sink - lse_i) D_i (D from
        the workspace), summed likewise; into ``grads["dbias"]``, ``grads["dsink"]``."""
        import cupy
        prob, off = self.prob, self.ws_offsets
        bs = prob.batch_shape
        out = grads.get("dbias")
        if out is not None and self.dbias_sum is not None and out.flags.c_contiguous and (
                out.data.ptr % 16 == 0 or not dbias_vec4(self.dbias_sum)):
            self.dbias_finish(_stream(), (ws.ptr + self._dbias_offset(), out.data.ptr))
        elif out is not None:
            acc = cupy.ndarray(bs + (prob.Lq, prob.Lk), numpy.float32,
                               memptr=ws + self._dbias_offset())
            _sum_into(out, acc)
        if grads.get("dsink") is not None:
            sink = keep[self.mods.names.index("sink")]
            D = cupy.ndarray(bs + (prob.Lq,), self.acc, memptr=ws + off["dpsum"])
            lse = lse.astype(self.acc, copy=False)
            # lse >= sink, so exp(sink - lse) <= 1; a sink of -inf with a row with no key has
            # lse = -inf and exp(-inf - -inf) = NaN there, where D = 0: selected to 0
            w = cupy.exp(sink[..., None].astype(self.acc) - lse)
            w = cupy.where(D == 0, 0, w)
            _sum_into(grads["dsink"], -(w * D).sum(axis=-1))

    def _dbias_offset(self) -> int:
        return self.ws_offsets["dbias_full" if self.dbias_full else "dbias"]

    def explain(self) -> str:
        dq = ("dQ rounded by the main kernel (no bwd_finish_dq launch)" if self.fused_dq
              else "dQ rounded by bwd_finish_dq")
        if self.one_kernel:
            dq += "\none launch: D and the zeroing in the main kernel (no bwd_dot_do_o launch)"
        return explain_choice(self.choice, self.launch.grid) + "\n" + dq


def _sum_into(out, acc) -> None:
    """``out[...] = acc`` summed over the dimensions broadcasting added to ``out.shape``, in
    acc's dtype, rounded once to out's dtype by the copy."""
    from ._problem import broadcast_axes
    axes = broadcast_axes(tuple(out.shape), tuple(acc.shape))
    if axes:
        acc = acc.sum(axis=axes, keepdims=True)
    out[...] = acc.reshape(out.shape)


# ---------------------------------------------------------------------------------------------
# Explaining a choice (python -m cuflash info --explain, cuflash.explain)
# ---------------------------------------------------------------------------------------------

def explain_choice(choice, grid: int | None = None) -> str:
    t = choice.traits
    lines = [f"kernel: {choice.expr}", f"source: cuda_src/{choice.family.source}",
             f"tiles:  {t.describe()}"]
    if grid is not None:
        lines.append(f"grid:   {grid} blocks of {t.threads} threads")
    lines.append("why:")
    lines += ["  " + r for r in choice.reasons]
    return "\n".join(lines)
