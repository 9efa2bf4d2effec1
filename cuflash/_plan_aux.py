"""The backward's launches around its main kernel, bwd_prep.cu's "aux" kernels of the registry:
bwd_dot_do_o (line 4 of FA-2's Algorithm 2, D = rowsum(dO o O), which also zeroes the
accumulators the main kernel adds into) and bwd_finish_dq (dQ from its float32 accumulator,
or dL/dbias summed over the bias's broadcast items, rounded once). Their builds and grids are
decided here, once per plan (``_plan.BackwardPlan``, ``_plan_mods.dbias_finish``).

Both kernels are memory-bound grid-stride loops; the constants below were measured on the H200
by ``bench/probes/bwd_passes.py`` (bench/NOTES.md, session 14)."""

from __future__ import annotations

import numpy

from . import _launch
from ._launch import Launch

#: threads a block of either kernel
AUX_THREADS = 256
#: bwd_dot_do_o's grid: a block per DOT_ROWS_PER_BLOCK query rows (a row a warp at least), at
#: most DOT_BLOCKS_PER_SM blocks an SM; bwd_finish_dq's: at most FINISH_BLOCKS_PER_SM an SM.
#: The cap sets how many waves of blocks a grid-stride loop is. H200, session 14 (the suites'
#: 16k-token points, bf16): 16 an SM beat 2, 4 and 8 for every build (dot ROWS 4: 75 us against
#: 80 at 8; VEC4 finish: 54 against 58), and beat 8 for the scalar builds of before too
DOT_ROWS_PER_BLOCK, DOT_BLOCKS_PER_SM, FINISH_BLOCKS_PER_SM = 8, 16, 16

#: the arguments of bwd_finish_dq(partial, dq, n, parts), packed for Launch
FINISH_ARGS = numpy.dtype([("partial", "<u8"), ("dq", "<u8"), ("n", "<i8"), ("parts", "<i4")],
                          align=True)
FINISH_OFFSETS = tuple(FINISH_ARGS.fields[f][1] for f in FINISH_ARGS.names)

#: the arguments of bwd_dot_do_o(p, zero_bytes): Params (which the main kernel, launched after
#: it from the same block, reads alone), then the bytes of accumulators it zeroes
DOT_ARGS = numpy.dtype([("p", _launch.PARAMS), ("zero_bytes", "<i8")], align=True)
DOT_OFFSETS = tuple(DOT_ARGS.fields[f][1] for f in DOT_ARGS.names)


def dot_kernel(dtype, device_id: int):
    """bwd_dot_do_o's build for inputs of ``dtype`` (its ROWS: ``_traits.DOT_ROWS``)."""
    from ._families import FAMILIES
    fam = FAMILIES["bwd_dot"]
    return _launch.kernel(fam.source, fam.expr(dtype), device_id, 0)


def dot_grid(rows: int, num_sms: int) -> int:
    """bwd_dot_do_o's blocks for ``rows`` query rows (all batch items together)."""
    return max(1, min(-(-rows // DOT_ROWS_PER_BLOCK), DOT_BLOCKS_PER_SM * num_sms))


def finish_launch(dtype, out: str, n: int, parts: int, device_id: int, num_sms: int,
                  vec4: bool, name: str = "bwd_finish_dq") -> Launch:
    """bwd_finish_dq over ``parts`` float32 (or float64) slices of ``n`` elements into an array
    of ``out`` ("T": the inputs' dtype; "Acc": the accumulator's), pointers patched at a call.
    ``vec4``: its VEC4 build (16-byte loads, one 8- or 16-byte store a thread and step,
    bitwise the scalar sums), for n % 4 == 0 and a destination on 16 bytes."""
    from ._families import FAMILIES
    fam = FAMILIES["bwd_finish_dq"]
    args = numpy.zeros((), FINISH_ARGS)
    args["n"], args["parts"] = n, parts
    grid = max(1, min(-(-n // AUX_THREADS), FINISH_BLOCKS_PER_SM * num_sms))
    expr = fam.expr(dtype, out=out, vec4=vec4)
    return Launch(_launch.kernel(fam.source, expr, device_id, 0), grid, AUX_THREADS, 0, args,
                  offsets=FINISH_OFFSETS, name=name)


class Finish:
    """dQ's finishing for one plan: the VEC4 build where the accumulator is float32 and
    n % 4 == 0, else the scalar one. ``to(dst)`` is the Launch for a destination at device
    address ``dst``: every dq a plan is given is a whole CuPy allocation or a 256-byte aligned
    part of one, so the VEC4 build's alignment holds; a destination off 16 bytes would get the
    scalar build (made once, on first need) rather than a misaligned store."""
    __slots__ = ("launch", "vec4", "_scalar", "_args")

    def __init__(self, dtype, acc, out: str, n: int, parts: int, device_id: int, num_sms: int):
        self.vec4 = numpy.dtype(acc) == numpy.float32 and n % 4 == 0
        self._args = (dtype, out, n, parts, device_id, num_sms)
        self.launch = finish_launch(*self._args, vec4=self.vec4)
        self._scalar = None

    def to(self, dst: int) -> Launch:
        if not (dst & 15) or not self.vec4:
            return self.launch
        if self._scalar is None:
            self._scalar = finish_launch(*self._args, vec4=False)
        return self._scalar
