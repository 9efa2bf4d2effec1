"""The device side of ``attention_with_kvcache``: the split-KV decode plan and its launches.

A call runs up to three kernels on CuPy's current stream, in order:

1. ``decode_append`` (``cuda_src/decode.cu``), when ``k_new`` is given: the new rows into the
   cache, at the clamped ``cache_seqlens[b]``;
2. the decode family chosen by the registry (``_families.choose("decode")``) over
   ``num_splits`` key ranges of every (batch row, KV head, row tile): ``decode_mma``
   (``cuda_src/decode_mma.cu``, tensor cores, sm_80+, half types, d <= 128, page sizes that
   are multiples of 16) or else ``decode_split`` (``cuda_src/decode.cu``);
3. ``decode_combine`` (``cuda_src/combine.cu``), when ``num_splits > 1`` and
   ``CUFLASH_DECODE_FUSE=0`` (A/B runs): the partials merged by their log-sum-exp in split
   order (with one split the decode writes the output itself). By default the decode families
   merge their own splits (their ``fuse`` build: the last block of each (batch row, KV head,
   row tile) to finish merges the group, counted on per-stream arrival counters that the
   merging block sets back to 0), so a call is one launch fewer.

All three take one ``cuflash::decode::DecodeParams`` block (``cuda_src/decode_params.cuh``),
mirrored here by :data:`DECODE_PARAMS`. The split count (``num_splits=None``): enough blocks
to fill ``num_sms x min_blocks`` resident slots (``min_blocks`` from the traits table, or
its ``split_wave`` where set: one block an SM for decode_sm80, as measured on the H200), chosen
as the smallest count whose last wave is at least 85% as full as the best count's, with at
least 4 key iterations a split (fewer keys make the combine cost more than the split saves).
The heuristic sees the cache capacity, not the device-side lengths: each block divides its
batch row's actual keys evenly among the splits, so short rows still use every split. Where
that count is above 1, decode_sm80 then takes ``_inference_grid.balanced_splits`` instead (the
count whose busiest SM reads the fewest key iterations: B 1, 8 KV heads on 132 SMs, 16 splits
rather than 15; ``CUFLASH_DECODE_SPLITS=s9``: the count above, "slots": every resident slot).

A/B switches of decode_sm80, read when a plan is built (``cuflash/_inference_grid.py``):
``CUFLASH_DECODE_STREAM`` (the stream grid: by default where the groups fill every resident slot
and a block's share is long, "0" nowhere, "1" / "all" opt-in), ``CUFLASH_DECODE_STAGES`` (the
deep cp.async ring of grids of at most one block an SM: opt-in, "auto"; unset or "3" session 8's
ring),
``CUFLASH_DECODE_L2`` (L2 hints on the K/V copies, opt-in), ``CUFLASH_DECODE_MERGE=0`` (the
fused merge of session 7, two or three L2 round trips instead of one), ``CUFLASH_DECODE_SPLITS``
(above; "s9", "slots"), ``CUFLASH_DECODE_PAGES=s9`` (the page walk of sessions 7-9),
``CUFLASH_DECODE_EARLY`` (the first K/V copies issued before cache_seqlens arrives, for a full
row: "all"; "one", the default since session 12's H200 run, only with one split; "0" never),
``CUFLASH_DECODE_ARRIVE`` (the fused merge's arrival: "wrap" one atomicInc that also resets the
counter; "fence", the default, session 10's atomicAdd then atomicExch; "release" CUTLASS's
barrier). EARLY and ARRIVE=wrap are session 11's; session 12 timed ARRIVE=wrap no faster
(bench/probes/decode_ab.py, mean 1.001), so it stays off.
"""

from __future__ import annotations

import dataclasses
import math
import os

import numpy

from . import _families, _launch, _traits
from ._inference_grid import (STREAM_HEAD_DIM, balanced_splits, deep_stages, early_mode, prelude,
                              slot_grid, splits_mode, stages_mode, stream_grid, stream_mode,
                              stream_spans)
from ._plan import PlanCache
from ._variant import LOG2E, VARIANT_PARAMS, Variant

#: ``cuflash::decode::DecodeParams``, field for field (8-byte fields, VariantParams, 4-byte).
POINTERS = ("q", "k_cache", "v_cache", "o", "lse", "o_part", "lse_part", "cache_seqlens",
            "block_table", "k_new", "v_new")
STRIDES = ("q_b", "q_h", "q_g", "q_row", "o_b", "o_h", "o_g", "o_row", "lse_b", "lse_h", "lse_g",
           "k_b", "k_h", "k_row", "v_b", "v_h", "v_row", "kn_b", "kn_h", "kn_row", "kn_col",
           "vn_b", "vn_h", "vn_row", "vn_col", "bt_b")
INTS = ("B", "Hkv", "G", "Lq", "d", "dv", "Lnew", "capacity", "paged", "page_size", "page_shift",
        "num_pages", "num_splits", "row_tiles", "stream_blocks")
DECODE_PARAMS = numpy.dtype([(n, "<u8") for n in POINTERS] + [(n, "<i8") for n in STRIDES]
                            + [("var", VARIANT_PARAMS)] + [(n, "<i4") for n in INTS]
                            + [("counters", "<u8")], align=True)
_WORD = {n: i for i, n in enumerate(POINTERS)}
#: the 8-byte word of DecodeParams::counters (appended last: patched as an extra word)
COUNTERS_WORD = DECODE_PARAMS.fields["counters"][1] // 8

#: most packed query rows (G x Lq) the decode takes; above, the generic path (prefill-sized)
MAX_ROWS = 64
#: fewest key iterations a split; most splits
MIN_ITERS_PER_SPLIT, MAX_SPLITS = 4, 128

_PLANS = PlanCache(256)


def _es(x) -> tuple[int, ...]:
    return tuple(s // x.itemsize for s in x.strides)


def _layout(x):
    return None if x is None else (x.shape, x.strides, x.dtype.str, _ptr(x) % 16)


def num_splits_heuristic(blocks: int, capacity: int, keys_per_iter: int, num_sms: int,
                         min_blocks: int) -> int:
    """Splits for ``blocks`` (batch rows x KV heads x row tiles) over a cache of ``capacity``
    keys: see the module docstring."""
    slots = num_sms * min_blocks
    iters = max(1, -(-capacity // keys_per_iter))
    most = max(1, min(MAX_SPLITS, iters // MIN_ITERS_PER_SPLIT))
    if blocks == 0 or blocks >= 0.8 * slots or most == 1:
        return 1

    def fill(s: int) -> float:            # how full the last wave of blocks * s is, on average
        n = blocks * s
        return n / (-(-n // slots) * slots)
    best = max(fill(s) for s in range(1, most + 1))
    for s in range(1, most + 1):
        if blocks * s >= 0.8 * slots and fill(s) >= 0.85 * best:
            return s
    return most


def _fold_heads(c, q, k, v, kn, vn):
    """The head dims of the call as (one KV-head dim, one group dim), or a reason why not.

    Returns ``(Hkv, G, strides)`` with ``strides[name] = (head stride, group stride)`` in
    elements for q, k, v, o, lse, kn, vn (o, lse: the contiguous outputs)."""
    xp = c.xp
    F = c.mid
    out_mid = [0] * len(F)
    acc = 1
    for i in range(len(F) - 1, -1, -1):        # contiguous o (B, F..., Lq, dv) / lse / dv
        out_mid[i] = acc
        acc *= F[i]
    full = lambda x, tail: _es(xp.broadcast_to(x, (x.shape[0],) + F + tail))[1:1 + len(F)]  # noqa
    per = {"q": full(q, (c.Lq, c.d)), "k": full(k, k.shape[-2:]), "v": full(v, v.shape[-2:]),
           "o": tuple(s * c.Lq * c.dv for s in out_mid), "lse": tuple(s * c.Lq for s in out_mid)}
    if kn is not None:
        per["kn"], per["vn"] = full(kn, kn.shape[-2:]), full(vn, vn.shape[-2:])
    names = list(per)
    shape, strides = _launch.merge_batch_dims(F, [per[n] for n in names])
    heads = [i for i in range(len(shape)) if strides[names.index("k")][i]
             or strides[names.index("v")][i]]
    groups = [i for i in range(len(shape)) if i not in heads]
    if len(heads) > 1 or len(groups) > 1:
        return (f"the head dims {F} fold into {len(heads)} KV-head and {len(groups)} group "
                f"dims; the decode takes one of each")
    pick = lambda n, dims: strides[names.index(n)][dims[0]] if dims else 0  # noqa: E731
    out = {n: (pick(n, heads), pick(n, groups)) for n in names}
    return (shape[heads[0]] if heads else 1), (shape[groups[0]] if groups else 1), out


def _aligned(x, vec: int) -> bool:
    """Rows readable as 16-byte chunks: unit column stride, 16-byte aligned start and strides."""
    es = _es(x)
    if x.shape[-1] > 1 and es[-1] != 1:
        return False
    return _ptr(x) % 16 == 0 and all(s % vec == 0 for n, s in zip(x.shape[:-1], es[:-1])
                                        if n > 1)


def why_not(c):
    """The reason the decode family cannot run call ``c``, or None."""
    if c.dtype.name not in _families.FAMILIES["decode"].dtypes:
        return f"{c.dtype.name}: the decode takes float16, bfloat16 and float32"
    if c.d % 8 or c.dv % 8:
        return f"d={c.d}, dv={c.dv}: the decode reads 8-element chunks"
    if c.B == 0 or 0 in c.mid:
        return "an empty batch or head dim: nothing to launch"
    if c.B > 1 and c.seqlens.strides[0] != 4:
        return "cache_seqlens is not contiguous"
    if c.paged and c.block_table.shape[1] > 1 and c.block_table.strides[1] != 4:
        return "block_table rows are not contiguous"
    vec = 16 // c.dtype.itemsize
    for name, x in (("q", c.q), ("k_cache", c.k_cache), ("v_cache", c.v_cache)):
        if not _aligned(x, vec):
            return f"{name} rows are not contiguous 16-byte aligned chunks ({x.strides=})"
    return None


def _ptr(x) -> int:
    """Device (CuPy) or host (NumPy: the emulation tests) address of an array's first element."""
    return x.ctypes.data if isinstance(x, numpy.ndarray) else x.data.ptr


class DecodeSpec:
    """Everything a call layout decides, no kernels loaded: the parameter block (pointers 0),
    the three kernels' name expressions, grids, threads and shared memory, and the reasons.
    :class:`DecodePlan` loads the kernels; the CPU emulation tests launch the same spec."""

    def __init__(self, c, Hkv, G, st, choice, splits, reasons, fuse=False, stream=0,
                 prelude="", stages=3):
        t = choice.traits
        #: decode_mma's cp.async ring depth (STAGES; 3 but for the deep builds of grids of at
        #: most one block an SM): its shared memory is the launch's
        self.stages = stages
        #: source put before the split kernel's (decode_mma's A/B defines), or ""
        self.prelude = prelude
        #: decode_mma's STREAM build: its grid (``stream_grid``; ``splits`` is then the
        #: partials' stride, the most blocks a group spans); 0: one block a (group, split)
        self.stream = stream
        #: the split kernel merges its own splits (decode_sm80's fuse build); then ``groups``
        #: arrival counters (one a (batch row, KV head, row tile), zeroed once, left zeroed by
        #: every call) must be patched into DecodeParams::counters
        self.fuse = fuse
        self.rows = G * c.Lq
        self.row_tiles = -(-self.rows // t.block_m)
        self.splits = splits
        self.Hkv, self.G = Hkv, G
        self.reasons = reasons
        p = numpy.zeros((), DECODE_PARAMS)
        q, k, v = c.q, c.k_cache, c.v_cache
        p["q_b"], (p["q_h"], p["q_g"]), p["q_row"] = _es(q)[0], st["q"], _es(q)[-2]
        p["o_b"], (p["o_h"], p["o_g"]), p["o_row"] = (math.prod(c.mid) * c.Lq * c.dv, st["o"],
                                                       c.dv)
        p["lse_b"], (p["lse_h"], p["lse_g"]) = math.prod(c.mid) * c.Lq, st["lse"]
        p["k_b"], p["k_h"], p["k_row"] = _es(k)[0], st["k"][0], _es(k)[-2]
        p["v_b"], p["v_h"], p["v_row"] = _es(v)[0], st["v"][0], _es(v)[-2]
        if c.k_new is not None:
            kn, vn = _es(c.k_new), _es(c.v_new)
            p["kn_b"], p["kn_h"], p["kn_row"], p["kn_col"] = kn[0], st["kn"][0], kn[-2], kn[-1]
            p["vn_b"], p["vn_h"], p["vn_row"], p["vn_col"] = vn[0], st["vn"][0], vn[-2], vn[-1]
        if c.paged:
            p["bt_b"] = _es(c.block_table)[0]
        var = numpy.zeros((), VARIANT_PARAMS)
        var["scale"], var["scale_log2"] = c.scale, c.scale * LOG2E
        p["var"] = var
        ps = c.page_size
        for name, value in (("B", c.B), ("Hkv", Hkv), ("G", G), ("Lq", c.Lq), ("d", c.d),
                            ("dv", c.dv), ("Lnew", c.Lnew), ("capacity", c.capacity),
                            ("paged", int(c.paged)), ("page_size", ps),
                            ("page_shift", ps.bit_length() - 1 if c.paged and ps & (ps - 1) == 0
                             else -1),
                            ("num_pages", c.num_blocks), ("num_splits", splits),
                            ("row_tiles", self.row_tiles), ("stream_blocks", stream)):
            p[name] = value
        self.params = p
        T = _families.ctype(c.dtype)
        nrows = c.B * Hkv * self.rows
        # (source, expr, grid, threads, smem) of each kernel, in launch order; None: not run
        self.append = (("decode.cu", f"cuflash::decode::decode_append<{T}>",
                        c.B * Hkv * c.Lnew, 128, 0) if c.Lnew else None)
        self.split = (choice.family.source, choice.expr,
                      stream or c.B * Hkv * self.row_tiles * splits, t.threads,
                      t.smem_bytes if stages == 3 else _traits.decode_sm80_smem(t.head_dim, stages))
        self.combine = (("combine.cu", f"cuflash::decode::decode_combine<{T}>", -(-nrows // 4),
                         128, 0) if splits > 1 and not fuse else None)
        self.groups = c.B * Hkv * self.row_tiles
        self.part_rows = nrows * splits
        self.out_shape = (c.B,) + c.mid + (c.Lq, c.dv)

    def pointers(self, c, o, lse, o_part=None, lse_part=None):
        """(word, address) pairs of one call's arrays."""
        return self.words(c.q, c.k_cache, c.v_cache, c.seqlens, c.block_table, c.k_new,
                          c.v_new, o, lse, o_part, lse_part)

    @staticmethod
    def words(q, k_cache, v_cache, seqlens, block_table, k_new, v_new, o, lse, o_part=None,
              lse_part=None):
        ptr = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "o": o, "lse": lse,
               "cache_seqlens": seqlens, "block_table": block_table, "k_new": k_new,
               "v_new": v_new, "o_part": o_part, "lse_part": lse_part}
        return [(_WORD[n], 0 if x is None else _ptr(x)) for n, x in ptr.items()]

    def explain(self) -> str:
        return "\n".join(self.reasons)


def _fire(launch, stream: int, words: list) -> None:
    """Launch with the leading pointer words patched in (``_launch.Launch``)."""
    launch(stream, words)


class DecodePlan:
    """A DecodeSpec with its kernels loaded on the device."""

    def __init__(self, spec: DecodeSpec, device_id: int, dtype):
        self.spec = spec
        self.device_id = device_id

        def launch(k, name, prelude=""):
            if k is None:
                return None
            source, expr, grid, threads, smem = k
            return _launch.Launch(_launch.kernel(source, expr, device_id, smem, prelude), grid,
                                  threads, smem, spec.params, name=name)
        self.launches = [launch(spec.append, "decode_append"),
                         launch(spec.split, "decode_split", spec.prelude),
                         launch(spec.combine, "decode_combine")]
        # one allocation a call: o, then lse, then the partials (256-byte aligned each)
        self.dtype, self.dv = dtype, spec.out_shape[-1]
        align = lambda n: -(-n // 256) * 256  # noqa: E731
        o_bytes = math.prod(spec.out_shape) * numpy.dtype(dtype).itemsize
        lse_bytes = math.prod(spec.out_shape[:-1]) * 4
        self.lse_at = align(o_bytes)
        self.part_at = self.lse_at + align(lse_bytes)
        parts = spec.part_rows * (self.dv + 1) * 4 if spec.splits > 1 else 0
        self.nbytes = max(256, self.part_at + parts)
        self.nonempty = math.prod(spec.out_shape) > 0
        #: the fused combine's arrival counters, per stream (calls on one stream run in order,
        #: and each leaves them 0 for the next; calls on two streams at once must not share
        #: them): stream -> (array, ((COUNTERS_WORD, address),))
        self._counters = {}

    def _counter_words(self, stream: int):
        """The (word, address) patch of DecodeParams::counters for ``stream``: zeroed once,
        on that stream, at its first call (before the kernel, in stream order)."""
        got = self._counters.get(stream)
        if got is None:
            import cupy
            arr = cupy.zeros(self.spec.groups, numpy.uint32)
            got = self._counters[stream] = (arr, ((COUNTERS_WORD, arr.data.ptr),))
        return got[1]

    def run(self, c):
        return self.run_arrays(c.q, c.k_cache, c.v_cache, c.seqlens, c.block_table, c.k_new,
                               c.v_new)

    def run_arrays(self, q, k_cache, v_cache, seqlens, block_table, k_new, v_new):
        """Allocate the outputs (and partials) at once, patch the pointers, launch. Kept lean:
        this is the whole host cost of a repeated decode call (the fast path)."""
        import cupy
        spec = self.spec
        mem = cupy.cuda.alloc(self.nbytes)
        base = mem.ptr
        o = cupy.ndarray(spec.out_shape, self.dtype, memptr=mem)
        lse = cupy.ndarray(spec.out_shape[:-1], numpy.float32, memptr=mem + self.lse_at)
        # the pointer words of DecodeParams, in POINTERS order
        words = [q.data.ptr, k_cache.data.ptr, v_cache.data.ptr, base, base + self.lse_at,
                 base + self.part_at, base + self.part_at + 4 * spec.part_rows * self.dv,
                 seqlens.data.ptr, 0 if block_table is None else block_table.data.ptr,
                 0 if k_new is None else k_new.data.ptr, 0 if v_new is None else v_new.data.ptr]
        stream = cupy.cuda.get_current_stream().ptr
        append, split, combine = self.launches
        if append is not None:
            _fire(append, stream, words)
        if self.nonempty:
            if spec.fuse:
                split(stream, words, self._counter_words(stream))
            else:
                _fire(split, stream, words)
            if combine is not None:
                _fire(combine, stream, words)
        return o, lse

    def explain(self) -> str:
        return self.spec.explain()


def _forced() -> str:
    """CUFLASH_DECODE: "split" keeps the generic decode_split where decode_mma would run (A/B
    runs of the two kernels in one process); anything else: the registry's choice."""
    return os.environ.get("CUFLASH_DECODE", "auto").strip().lower()


def fuse_wanted() -> bool:
    """CUFLASH_DECODE_FUSE: "0" keeps decode_combine's launch after decode_sm80 (A/B runs of
    the fused combine); unset or "1": decode_sm80 merges its own splits."""
    value = os.environ.get("CUFLASH_DECODE_FUSE", "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"CUFLASH_DECODE_FUSE={value!r}: expected 0 or 1")
    return value != "0"


def _generic_decode(shape, passed_over, why: str):
    """decode.cu's decode_split for ``shape``, as a Choice, after ``passed_over`` (the tensor-
    core family) was found not to fit for a reason only the call knows (``why``)."""
    fam = _families.FAMILIES["decode"]
    traits, flags, more = fam.select(fam, shape, None)
    reasons = [r for r in passed_over.reasons if not r.startswith("  ")][:-1] + [why]
    reasons += [f"{fam.name}: {fam.summary}"] + ["  " + r for r in more]
    return _families.Choice(fam, traits, tuple(sorted(flags.items())),
                            fam.expr(shape.dtype, traits, shape.variant, **flags),
                            tuple(reasons))


def spec_or_reason(c, dev=None):
    """The DecodeSpec of call ``c`` (on ``dev``, default: c's device), or why the decode
    family does not apply."""
    why = why_not(c)
    if why:
        return why
    folded = _fold_heads(c, c.q, c.k_cache, c.v_cache, c.k_new, c.v_new)
    if isinstance(folded, str):
        return folded
    Hkv, G, st = folded
    if G * c.Lq > MAX_ROWS:
        return (f"{G} query heads a KV head x Lq={c.Lq} = {G * c.Lq} rows: above {MAX_ROWS} "
                f"the per-row attention (prefill) is used")
    dev = dev or _families.device_info(c.device_id)
    shape = _families.Shape(c.dtype.name, c.B * Hkv, G * c.Lq, c.capacity, c.d, c.dv,
                            Variant(causal=c.causal))
    choice = _families.choose("decode", shape, dev)
    if choice.family.name == "decode_sm80" and _forced() == "split":
        choice = _generic_decode(shape, choice, "decode_sm80: skipped (CUFLASH_DECODE=split)")
    elif choice.family.name == "decode_sm80" and c.paged and c.page_size % 16:
        choice = _generic_decode(shape, choice,
                                 f"decode_sm80: not used, page_size={c.page_size} is not a "
                                 f"multiple of 16 (its 16-key tiles would straddle pages)")
    t = choice.traits
    tiles = -(-(G * c.Lq) // t.block_m)
    keys_per_iter = t.block_n // (2 if c.dtype.itemsize == 4 else 1)
    if c.num_splits is None:
        # the wave the traits ask for (decode_sm80: one block an SM), else the resident
        # blocks: DecodeTraits::kMinBlocks, one fewer for float32 (two loads a lane and key)
        resident = t.split_wave or (
            t.min_blocks - (1 if c.dtype.itemsize == 4 and t.block_m < 8 else 0))
        splits = num_splits_heuristic(c.B * Hkv * tiles, c.capacity, keys_per_iter,
                                      dev.num_sms, resident)
        why = (f"num_splits={splits} (heuristic: {c.B * Hkv * tiles} blocks a split, "
               f"{dev.num_sms} SMs x {resident} blocks)")
        if t.split_wave and splits > 1 and splits_mode() != "s9":
            most = min(MAX_SPLITS, -(-c.capacity // keys_per_iter) // MIN_ITERS_PER_SPLIT)
            splits = balanced_splits(c.B * Hkv * tiles, c.capacity, keys_per_iter,
                                     dev.num_sms, most) or splits
            why = (f"num_splits={splits} (the fewest key iterations on the busiest of "
                   f"{dev.num_sms} SMs for {c.B * Hkv * tiles} blocks a split; "
                   f"CUFLASH_DECODE_SPLITS=s9: session 9's count)")
    else:
        splits = c.num_splits
        why = f"num_splits={splits} (given)"
    reasons = list(choice.reasons) + [
        f"  Hkv={Hkv}, G={G}, Lq={c.Lq}: {G * c.Lq} packed rows, {tiles} row tiles; {why}",
        f"  {'paged, page_size=' + str(c.page_size) if c.paged else 'dense cache'}, "
        f"capacity {c.capacity} keys"]
    fuse = False
    stream = 0
    if (c.num_splits is None and choice.family.name == "decode_sm80" and fuse_wanted()
            and t.head_dim == STREAM_HEAD_DIM):
        stream = stream_grid(c.B * Hkv * tiles, splits, c.capacity, keys_per_iter,
                             keys_per_iter * (c.d + c.dv) * c.dtype.itemsize, dev.num_sms,
                             t.split_wave or t.min_blocks, t.min_blocks, stream_mode())
    if (c.num_splits is None and choice.family.name == "decode_sm80" and fuse_wanted()
            and t.head_dim == STREAM_HEAD_DIM and splits_mode() == "slots"):
        stream = slot_grid(c.B * Hkv * tiles, c.capacity, keys_per_iter, dev.num_sms,
                           t.min_blocks) or stream
    if stream:
        groups = c.B * Hkv * tiles
        even = splits
        splits = stream_spans(groups, stream)[0]
        flags = dict(choice.flags, fuse=True, stream=", true")
        choice = dataclasses.replace(choice, flags=tuple(sorted(flags.items())),
                                     expr=choice.family.expr(shape.dtype, t, shape.variant,
                                                             **flags))
        fuse = True
        reasons.append(f"  stream grid: {stream} blocks share the {groups} groups' key "
                       f"iterations equally (even splits: {groups * even} blocks on "
                       f"{stream} slots); up to {splits} partials a group, merged by its last "
                       f"block (CUFLASH_DECODE_STREAM=0: the even splits)")
    elif splits > 1:
        if fuse_wanted():
            fuse = True
            flags = dict(choice.flags, fuse=True)
            choice = dataclasses.replace(choice, flags=tuple(sorted(flags.items())),
                                         expr=choice.family.expr(shape.dtype, t, shape.variant,
                                                                 **flags))
            reasons.append(f"  {splits} splits merged by the last block of each (batch row, KV "
                           f"head, row tile) to finish: one launch, no decode_combine")
        else:
            reasons.append(f"  {splits} splits merged by decode_combine (a second launch; "
                           f"CUFLASH_DECODE_FUSE=0)")
    stages = 3
    if choice.family.name == "decode_sm80":
        grid = stream or c.B * Hkv * tiles * splits
        iters = -(-c.capacity // keys_per_iter)           # a block's key iterations (even splits)
        share = None if stream else -(-iters // splits)
        stages = deep_stages(grid, dev.num_sms, t.head_dim, dev.smem_optin, share=share)
    if stages != 3:
        flags = dict(choice.flags, stream=", true" if stream else ", false", stages=f", {stages}")
        choice = dataclasses.replace(choice, flags=tuple(sorted(flags.items())),
                                     expr=choice.family.expr(shape.dtype, t, shape.variant,
                                                             **flags))
        reasons.append(f"  {grid} blocks on {dev.num_sms} SMs, one block an SM: a {stages}-stage "
                       f"cp.async ring ({stages - 1} K/V tiles a warp in flight, "
                       f"{_traits.decode_sm80_smem(t.head_dim, stages) // 1024} KB of shared "
                       f"memory; CUFLASH_DECODE_STAGES=3: session 8's 3)")
    defines = (prelude(fuse, 0 if stream else splits) if choice.family.name == "decode_sm80"
               else "")
    if defines:
        reasons.append("  A/B build: " + defines.replace("#define ", "").strip().replace("\n", ", "))
    return DecodeSpec(c, Hkv, G, st, choice, splits, reasons, fuse, stream, defines, stages)


def decode_plan(c):
    """The cached DecodePlan of call ``c``, or None when the decode family does not apply."""
    key = (c.device_id, _layout(c.q), _layout(c.k_cache), _layout(c.v_cache),
           _layout(c.k_new), _layout(c.v_new), _layout(c.block_table), c.seqlens.strides,
           c.num_splits, c.scale, c.causal, _forced(), fuse_wanted(), stream_mode(), stages_mode(),
           splits_mode(), prelude(), early_mode())
    plan = _PLANS.get(key)
    if plan is None:
        spec = spec_or_reason(c)
        plan = _PLANS.put(key, spec if isinstance(spec, str) else DecodePlan(spec, c.device_id,
                                                                          c.dtype))
    return plan if isinstance(plan, DecodePlan) else None


def explain(c) -> str:
    plan = spec_or_reason(c)
    if isinstance(plan, str):
        return f"generic path (per batch row, cuflash.attention; reads cache_seqlens back): {plan}"
    return plan.explain()
