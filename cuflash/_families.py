"""The kernel-family registry: one record per family, and the dispatcher that reads it.

A *family* is one CUDA kernel template in ``cuda_src/`` (fwd_sm90ws, fwd_sm90, fwd_sm80,
fwd_simt, bwd_*, decode*, the backward's helpers). Its record says all the package needs to know
about it: source, architectures, dtypes, head dims, features, traits table (tile sizes with their
reasons), template spelling. The dispatcher (:func:`choose`), the launcher, the compile gate and
``python -m cuflash info --explain`` read these records; a new family is a record and a .cu file.

The tile tables themselves, with their reasons, are in ``_traits.py``.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Callable, Iterable

import ml_dtypes
import numpy

from . import _traits
from ._traits import Traits
from ._variant import (ALL_VARIANTS, MODIFIER_FEATURES as FWD_FEATURES, Variant, bwd90_block_mask,
                       modifier_tiles)
from . import _spills  # (and below, names other modules take from here)
from ._fwd_schedule import bmask_list_read, bmask_long_keys, bmask_short_tiles, fwd_sm90_grid, persist_wanted, window_lean  # noqa: F401,E501
from ._overrides import BWD_SM90_FLAGS, fuse_dq_finish, fuse_dq_wanted, one_launch_wanted, tile_override  # noqa: F401,E501
from ._spills import block_mask_bwd_spilled, kept_blocks_spilled  # noqa: F401

HALF = frozenset(("float16", "bfloat16"))
ALL_DTYPES = frozenset(("float16", "bfloat16", "float32", "float64"))
_CTYPE = {"float16": "__half", "bfloat16": "__nv_bfloat16", "float32": "float", "float64": "double"}


def ctype(dtype) -> str:
    """The C++ type of a NumPy dtype as the kernels spell it (``__nv_bfloat16``, ...)."""
    return _CTYPE[numpy.dtype(dtype).name]


def acc_ctype(dtype) -> str:
    """The accumulation type: double for float64, float for everything else."""
    return "double" if numpy.dtype(dtype) == numpy.float64 else "float"


def _bool(x: bool) -> str: return "true" if x else "false"  # noqa: E704


def _spelled(args: dict) -> dict:
    """Tile arguments as a template spells them: fwd_sm90's ``persist`` and ``lean`` are trailing
    default arguments (0), written only when set (both as ``{persist}``): other builds keep their names."""
    if "persist" in args:
        persist, lean = args["persist"], args.pop("lean", 0)
        args["persist"] = f", {persist}, {lean}" if lean else (f", {persist}" if persist else "")
    return args


# Devices: what the dispatcher needs to know about a GPU (_devices.py; named here too)
from ._devices import PROFILES, DeviceInfo, device_info  # noqa: E402,F401


# ---------------------------------------------------------------------------------------------
# What dispatch looks at: the shape of a problem, without its arrays
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Shape:
    """The part of an attention problem that decides the kernel: no arrays, no strides."""
    dtype: str         # numpy dtype name
    nbatch: int        # product of the batch shape
    Lq: int
    Lk: int
    d: int
    dv: int
    variant: Variant
    deterministic: bool = False   # backward only
    #: a block mask's mean keys a 128-row query block visits (its map's non-empty blocks a
    #: row, times their width; 0 without one): fwd_sm90's blocks an SM (session 10)
    bmask_keys: int = 0

    @classmethod
    def of(cls, prob, deterministic: bool = False, mods=None) -> "Shape":
        from ._variant import variant_of
        bm = getattr(mods, "block_mask", None)
        keys = bm.mean_row_keys() if bm is not None else 0
        return cls(prob.dtype.name, math.prod(prob.batch_shape), prob.Lq, prob.Lk, prob.d,
                   prob.dv, variant_of(prob, mods), bool(deterministic), keys)

    @property
    def dmax(self) -> int:
        return max(self.d, self.dv)


# ---------------------------------------------------------------------------------------------
# The family record
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Family:
    """One kernel template in ``cuda_src/`` and what it supports.

    ``template`` spells a specialisation: ``{T}`` (the storage type), ``{Acc}`` (accumulation
    type), ``{variant}`` (``cuflash::Variant<...>``), each tile argument by name
    (``{head_dim}``, ``{block_n}``, ...) and each flag (``{even}``, ``{deterministic}``).
    ``select(family, shape, device)`` picks the traits and flags for one problem (or says why
    it cannot); ``instances(family, arch)`` lists every (traits, flags) the dispatcher can
    select, for the compile gate.
    """
    name: str
    kind: str                        # "fwd", "bwd" or "aux" (helper kernels of the backward)
    source: str                      # file in cuda_src/
    template: str
    min_cc: int = 70
    max_cc: int = 10**6
    dtypes: frozenset = ALL_DTYPES
    head_dims: tuple[int, int] = (1, 256)   # range of max(d, dv)
    features: frozenset = frozenset({"causal"})
    tensor_core_rows: bool = False   # inputs need contiguous, 16-byte aligned rows (cp.async)
    #: the C++ expression of the kernel's own shared-memory size for a traits entry (the tests
    #: static_assert it equals Traits.smem_bytes, the one formula written on both sides)
    smem_expr: str = ""
    select: Callable | None = dataclasses.field(default=None, repr=False, compare=False)
    instances: Callable | None = dataclasses.field(default=None, repr=False, compare=False)
    summary: str = ""

    def expr(self, dtype, traits: Traits | None = None, variant: Variant | None = None,
             **flags) -> str:
        """The NVRTC name expression of one specialisation."""
        values = _spelled(dict(traits.args)) if traits is not None else {}
        values.update({k: _bool(v) if isinstance(v, bool) else v for k, v in flags.items()})
        types = {"T": ctype(dtype), "Acc": acc_ctype(dtype)}
        values = {k: types.get(v, v) for k, v in values.items()}   # a flag may name a type
        return self.template.format(variant=variant.cpp if variant else "", **types, **values)

    def smem_check(self, traits: Traits) -> str:
        """The kernel's own shared-memory size of ``traits`` as a C++ expression."""
        dtype = "float64" if traits.acc == 8 else ("float32" if traits.family.endswith("simt")
                                                   else "float16")
        return self.smem_expr.format(T=ctype(dtype), **_spelled(dict(traits.args)))

    def arch_ok(self, cc: int) -> bool:
        return self.min_cc <= cc <= self.max_cc

    def rejects(self, shape: Shape, device: DeviceInfo) -> str | None:
        """Why this family cannot run ``shape`` on ``device`` (None: it can, table permitting)."""
        if not self.arch_ok(device.cc):
            need = (f"compute capability {self.min_cc / 10:.1f}" if self.max_cc == self.min_cc
                    else f"compute capability >= {self.min_cc / 10:.1f}")
            return f"needs {need}, the device has {device.cc / 10:.1f}"
        if shape.dtype not in self.dtypes:
            return f"takes {'/'.join(sorted(self.dtypes))}, not {shape.dtype}"
        lo, hi = self.head_dims
        if not lo <= shape.dmax <= hi:
            return f"takes max(d, dv) in {lo}..{hi}, not {shape.dmax}"
        missing = shape.variant.features - self.features
        if missing:
            return f"does not implement {', '.join(sorted(missing))}"
        if self.kind == "bwd" and shape.deterministic and "deterministic" not in self.features:
            return "has no deterministic mode"
        return None


@dataclasses.dataclass(frozen=True)
class Choice:
    """What the dispatcher picked for one problem, and why."""
    family: Family
    traits: Traits
    flags: tuple[tuple[str, bool], ...]
    expr: str
    reasons: tuple[str, ...]          # the chain of decisions, for ``info --explain``

    @property
    def flag(self) -> dict[str, bool]:
        return dict(self.flags)


# Environment overrides (tuning runs, A/B comparisons; read per plan): the rest in _overrides
#: CUFLASH_FWD / CUFLASH_BWD: the family to start the search from ("auto": the best that
#: applies). ``CUFLASH_FWD=sm80`` keeps Hopper on the mma.sync kernel, ``CUFLASH_BWD=simt``
#: forces the generic backward; a family that cannot run the problem falls through to the next.
_FAMILY_ENV = {"fwd": "CUFLASH_FWD", "bwd": "CUFLASH_BWD"}


def family_override(kind: str) -> str:
    if kind not in _FAMILY_ENV:     # e.g. "decode": one family, nothing to override
        return "auto"
    var = _FAMILY_ENV[kind]
    value = os.environ.get(var, "").strip().lower() or "auto"
    allowed = ["auto"] + [f.name.split("_", 1)[1] for f in by_kind(kind)]
    if value not in allowed:
        raise ValueError(f"{var}={value!r}: expected one of {allowed}")
    return value


# ---------------------------------------------------------------------------------------------
# The records
# ---------------------------------------------------------------------------------------------

def _table_traits(fam: Family, key, bucket: int) -> Traits:
    t = _traits.TABLES[fam.name][key]
    values = tile_override(fam.name, bucket)
    return t if values is None else t.with_values(values)


def _fwd_sm90_select(fam, shape, dev):
    bucket = -(-shape.dmax // 64) * 64
    t = _table_traits(fam, bucket, bucket)
    why = [f"head-dim bucket {bucket} (max(d, dv) = {shape.dmax} rounded up to 64): {t.reason}"]
    blocks = lambda t: shape.nbatch * -(-shape.Lq // t.block_m)   # noqa: E731
    while t["warpgroups"] > 1 and blocks(t) < t.min_blocks * dev.num_sms:
        t = t.replace(warpgroups=t["warpgroups"] - 1)
        why.append(f"{blocks(t)} blocks would leave SMs idle with more warpgroups: "
                   f"{t['warpgroups']} a block")
    t = modifier_tiles(fam.name, t, shape.variant, why)
    t = bmask_short_tiles(t, shape, why)
    even = shape.Lk % t.block_n == 0 and shape.d == bucket and shape.dv == bucket
    why.append(f"EVEN={_bool(even)}: whole key tiles and no padded columns" if even else
               "EVEN=false: the last key tile or the head dim is partial (predicated loads)")
    if (t.min_blocks > 1 and shape.variant.block_mask and shape.variant.score_path
            and 0 < bmask_long_keys() <= shape.bmask_keys
            and (shape.variant, even) not in _spills.LONG_LISTS_TWO_BLOCKS):
        # (the 2 blocks an SM kept for short lists: prefix-LM at 4k, 34.75 key tiles a block,
        # ran 4% slower so than at min_blocks 1, whose build has the same 128 registers)
        t = t.replace(min_blocks=1)
        why.append(f"min_blocks=1: the block mask's lists are long ({shape.bmask_keys} keys a "
                   f"query block on average, >= {bmask_long_keys()}: CUFLASH_FWD90_BMASK_LONG)")
    if t.min_blocks > 1 and shape.variant.score_path and (
            not even or (shape.variant, even) in _spills.KEPT_BLOCKS_SPILLED):
        # (a block mask's kept blocks an SM, _traits.FWD_SM90_MIN_BLOCKS_BLOCK_MASK: the
        # predicated build of the suite's causal window and prefix spills 24 bytes at 128
        # registers, and a build the GPU found using local memory goes back to one block)
        t = t.replace(min_blocks=1)
        why.append("min_blocks=1: " + ("the predicated build spills at 2 blocks an SM" if not even
                                       else "this mask_mod's build at 2 blocks an SM used local memory"))
    if even and persist_wanted(shape, t, dev) and (shape.variant, even) not in _spills.KEPT_BLOCKS_SPILLED:
        # (the predicated causal window spills 4 bytes)
        t = t.replace(persist=1)
        why.append(f"persistent: {fwd_sm90_grid(t, shape.nbatch * -(-shape.Lq // t.block_m), dev)} "
                   "blocks run the query tiles in turn, each tile's Q and first K/V loaded "
                   "during the one before (short blocks alone on an SM: CUFLASH_FWD90_PERSIST)")
    return bmask_list_read(window_lean(t, shape.variant, why), shape.variant, why), {"even": even}, why


def _fwd_sm90_instances(fam, arch):
    for bucket, t in _traits.TABLES[fam.name].items():
        for w in range(1, t["warpgroups"] + 1):
            for even in (False, True):
                yield t.replace(warpgroups=w), {"even": even}


def _fwd_sm80_select(fam, shape, dev):
    bucket = max(32, -(-shape.dmax // 32) * 32)
    causal = shape.variant.causal
    key = (bucket, causal) if (bucket, causal) in _traits.TABLES[fam.name] else (bucket, None)
    t = _table_traits(fam, key, bucket)
    why = [f"head-dim bucket {bucket}{' (causal)' if key[1] is not None else ''}: {t.reason}"]
    if shape.nbatch * -(-shape.Lq // t.block_m) < t.min_blocks * dev.num_sms:
        t = _traits.small_grid(t)
        why.append(f"few (batch, Q-tile) blocks: {t['warps']} warps of one slice (BLOCK_M = "
                   f"{t.block_m}) for twice the blocks")
    t = modifier_tiles(fam.name, t, shape.variant, why)
    even = (t.allow_even and not shape.variant.heavy and shape.Lq % t.block_m == 0
            and shape.Lk % t.block_n == 0 and shape.d == bucket and shape.dv == bucket)
    why.append(f"EVEN={_bool(even)}")
    return t, {"even": even}, why


def _fwd_sm80_instances(fam, arch):
    table = _traits.TABLES[fam.name]
    for (bucket, causal), t in table.items():
        if causal is None and (bucket, False) in table:
            causal = True           # the non-causal problems of this bucket have their own entry
        for tt in dict.fromkeys((t, _traits.small_grid(t))):
            for even in (False, True) if tt.allow_even else (False,):
                yield tt, {"even": even}, causal


def _simt_select(fam, shape, dev):
    bucket = _traits.simt_bucket(shape.dmax)
    acc = 8 if shape.dtype == "float64" else 4
    t = _traits.TABLES[fam.name][(acc, bucket)]
    why = [f"head-dim bucket {bucket}, {'float64' if acc == 8 else 'float32'} accumulation: "
           f"{t.reason}"]
    flags = {"deterministic": shape.deterministic} if fam.kind == "bwd" else {}
    return t, flags, why


def _simt_instances(fam, arch):
    for (acc, bucket), t in _traits.TABLES[fam.name].items():
        dtypes = ("float64",) if acc == 8 else ("float16", "bfloat16", "float32")
        for det in ((False, True) if fam.kind == "bwd" else (None,)):
            flags = {} if det is None else {"deterministic": det}
            yield t, flags, None, dtypes


def _bwd_tc_select(fam, shape, dev):
    step = 64 if fam.name == "bwd_sm90" else 32     # wgmma: 64-column blocks; mma.sync: 32
    bucket = max(32, -(-shape.dmax // step) * step)
    key = (bucket, shape.variant.causal) if fam.name == "bwd_sm90" else bucket
    bits = False     # bwd_sm90 runs a block mask's mask_mod on its plain path (kMaskBits)
    if fam.name == "bwd_sm90":
        # its modifiers all in one of the bucket's sets (the plain path's, the per-element one's)
        feats, sets = shape.variant.features - {"causal"}, _traits.BWD_SM90_MODIFIERS[bucket]
        if not shape.variant.causal:
            sets = sets + _traits.BWD_SM90_MODIFIERS_NONCAUSAL[bucket]
        if (shape.variant.block_mask and bucket in _traits.BWD_SM90_BLOCK_MASK
                and bwd90_block_mask() and shape.variant not in _spills.BWD90_BLOCK_MASK_SPILLED):
            bits = not any(feats <= s for s in sets)
            sets = sets + (_traits.BWD_SM90_BLOCK_MASK[bucket],)
        if not any(feats <= s for s in sets):
            missing = feats - frozenset().union(*sets)
            what = (f"does not implement {', '.join(sorted(missing))}" if missing else
                    f"does not run {', '.join(sorted(feats))} together")
            return (f"{what} at head-dim bucket {bucket} "
                    f"(registers: _traits.BWD_SM90_MODIFIERS)")
    t = _table_traits(fam, key, bucket)
    if t.smem_bytes > dev.smem_optin:
        return f"needs {t.smem_bytes} B of shared memory a block, the device grants {dev.smem_optin}"
    flags = {"deterministic": shape.deterministic} if "deterministic" in fam.features else {}
    why = [f"head-dim bucket {bucket}: {t.reason}"]
    t = modifier_tiles(fam.name, t, shape.variant, why)
    if fam.name == "bwd_sm90" and t.block_m == 128 and shape.variant.mask_mod:
        bits = shape.variant not in _spills.BWD90_BLOCK_MASK_SPILLED     # (d = 64: 64 bits)
        if not bits:
            t = t.replace(block_m=64)
            why.append("block_m=64: the 128-row build of this mask_mod used local memory")
    if bits:
        why.append("the block mask's mask_mod as bits on the plain path (bwd_sm90.cu kMaskBits; "
                   "at d = 128 CUFLASH_BWD90_BLOCK_MASK=0 runs bwd_sm80)")
    if fam.name == "bwd_sm90":
        # plain attention only (the modifiers' variants are compiled once, without it)
        flags["fuse_dq"] = not (shape.variant.features - {"causal"}) and fuse_dq_wanted(
            shape.nbatch * -(-shape.Lk // t.block_n), dev)
        if flags["fuse_dq"]:
            why.append("one wave of blocks: dQ rounded by the main kernel (no bwd_finish_dq "
                       "launch: host time)")
        flags["one_launch"] = one_launch_wanted(shape, flags["fuse_dq"], why)   # ", true" or ""
    return t, flags, why


def _bwd_sm90_instances(fam, arch):
    for (bucket, causal), t in _traits.TABLES[fam.name].items():
        yield from ((t, dict(flags), causal) for flags in BWD_SM90_FLAGS)


def _bwd_sm80_instances(fam, arch):
    for t in _traits.TABLES[fam.name].values():
        for det in (False, True):
            yield t, {"deterministic": det}


# -- decode, decode_sm80 (helper "inference"): select / instances in _inference_select.py
from . import _fwd_ws as _fws, _inference_select as _isel  # noqa: E402  (fwd_sm90ws: _fwd_ws)


REGISTRY: tuple[Family, ...] = (
    # -- forward, best first
    Family("fwd_sm90ws", "fwd", "fwd_sm90ws.cu", _fws.TEMPLATE, min_cc=90, max_cc=90, dtypes=HALF,
           head_dims=(33, 128), tensor_core_rows=True, features=FWD_FEATURES, smem_expr=_fws.SMEM,
           select=_fws.fwd_sm90ws_select, instances=_fws.fwd_sm90ws_instances, summary=_fws.SUMMARY),
    Family("fwd_sm90", "fwd", "fwd_sm90.cu",
           "cuflash::sm90::fwd_sm90<{T}, {head_dim}, {block_n}, {warpgroups}, {min_blocks}, "
           "{variant}, {even}{persist}>",
           min_cc=90, max_cc=90, dtypes=HALF, head_dims=(33, 256), tensor_core_rows=True,
           features=FWD_FEATURES,
           smem_expr="cuflash::sm90::Sm90Traits<{T}, {head_dim}, {block_n}, {warpgroups}, "
                     "{min_blocks}{persist}>::kSmemBytes",
           select=_fwd_sm90_select, instances=_fwd_sm90_instances,
           summary="Hopper wgmma forward (FA-2 Algorithm 1, operands from shared memory)"),
    Family("fwd_sm80", "fwd", "fwd_sm80.cu",
           "cuflash::fwd_sm80<{T}, {head_dim}, {block_n}, {warps}, {slices}, {min_blocks}, "
           "{variant}, {even}>",
           min_cc=80, dtypes=HALF, tensor_core_rows=True, features=FWD_FEATURES,
           smem_expr="cuflash::Sm80Traits<{T}, {head_dim}, {block_n}, {warps}, {slices}, "
                     "{min_blocks}>::kSmemBytes",
           select=_fwd_sm80_select, instances=_fwd_sm80_instances,
           summary="mma.sync forward for sm_80 and newer (cp.async, ldmatrix)"),
    Family("fwd_simt", "fwd", "fwd_simt.cu",
           "cuflash::fwd_simt<{T}, {head_dim}, {variant}, {block_m}, {block_n}, {threads}, "
           "{kc}, {vc}>",
           features=FWD_FEATURES,
           smem_expr="cuflash::SimtTraits<{T}, {head_dim}, {block_m}, {block_n}, {threads}, "
                     "{kc}, {vc}>::SMEM_BYTES",
           select=_simt_select, instances=_simt_instances,
           summary="generic forward: exact float32/float64, any GPU, any strides"),
    # -- backward, best first
    Family("bwd_sm90", "bwd", "bwd_sm90.cu",
           "cuflash::sm90::bwd_sm90<{T}, {head_dim}, {block_m}, {warpgroups}, {min_blocks}, "
           "{variant}, {fuse_dq}{one_launch}>",
           min_cc=90, max_cc=90, dtypes=HALF, head_dims=(33, 128), tensor_core_rows=True,
           # (per head-dim bucket: _traits.BWD_SM90_MODIFIERS, which select checks)
           features=frozenset({"causal"}).union(
               *(s for sets in _traits.BWD_SM90_MODIFIERS.values() for s in sets)),
           smem_expr="cuflash::sm90::BwdSm90Traits<{T}, {head_dim}, {block_m}, {warpgroups}, "
                     "{min_blocks}>::kSmemBytes",
           select=_bwd_tc_select, instances=_bwd_sm90_instances,
           summary="Hopper wgmma backward (FA-2 Algorithm 2, dQ by atomics)"),
    Family("bwd_sm80", "bwd", "bwd_sm80.cu",
           "cuflash::bwd_sm80<{T}, {head_dim}, {block_m}, {sub_m}, {warps}, {min_blocks}, "
           "{variant}, {deterministic}>",
           min_cc=80, dtypes=HALF, head_dims=(1, 128), tensor_core_rows=True,
           features=FWD_FEATURES | {"deterministic"},
           smem_expr="cuflash::BwdSm80Traits<{T}, {head_dim}, {block_m}, {sub_m}, {warps}, "
                     "{min_blocks}>::kSmemBytes",
           select=_bwd_tc_select, instances=_bwd_sm80_instances,
           summary="mma.sync backward (dQ by atomics, or semaphore-ordered when deterministic)"),
    Family("bwd_simt", "bwd", "bwd_simt.cu",
           "cuflash::bwd_simt<{T}, {head_dim}, {variant}, {deterministic}, {block_m}, "
           "{block_n}, {threads}>",
           features=frozenset({"causal", "deterministic"}),
           smem_expr="cuflash::BwdSimtTraits<{T}, {head_dim}, {block_m}, {block_n}, "
                     "{threads}>::SMEM_BYTES",
           select=_simt_select, instances=_simt_instances,
           summary="generic backward: exact float32/float64, any GPU, any strides"),
    # -- helper kernels of every backward (no tiles, no Variant)
    Family("bwd_dot", "aux", "bwd_prep.cu", f"cuflash::bwd_dot_do_o<{{T}}, {_traits.DOT_ROWS}>",
           summary="D = rowsum(dO o O), line 4 of FA-2 Algorithm 2"),
    Family("bwd_finish_dq", "aux", "bwd_prep.cu", "cuflash::bwd_finish_dq<{Acc}, {out}, {vec4}>",
           instances=lambda fam, arch: ((None, {"out": o, "vec4": v})
                                        for o in ("T", "Acc") for v in (False, True)),
           summary="dQ from its accumulator (bwd_simt's per-key-tile partials in order), rounded once"),
    # -- inference (helper "inference"): split-KV decode over a dense or paged KV cache, its
    #    combine, and the in-place cache append (cuflash/_inference_gpu.py launches them)
    Family("decode_sm80", "decode", "decode_mma.cu",
           "cuflash::decode::decode_mma<{T}, {head_dim}, {variant}, {fuse}{stream}{stages}>",
           min_cc=80, dtypes=HALF, head_dims=(1, 128),
           smem_expr="cuflash::decode::DecodeMmaTraits<{T}, {head_dim}>::kSmemBytes",
           select=_isel.decode_sm80_select, instances=_isel.decode_sm80_instances,
           summary="tensor-core split-KV decode: GQA rows as mma.sync's M, cp.async K/V pipeline"),
    Family("decode", "decode", "decode.cu",
           "cuflash::decode::decode_split<{T}, {head_dim}, {rows}, {variant}, {fuse}>",
           dtypes=frozenset(("float16", "bfloat16", "float32")),
           smem_expr="cuflash::decode::DecodeTraits<{T}, {head_dim}, {rows}>::kSmemBytes",
           select=_isel.decode_select, instances=_isel.decode_fuse_instances,
           summary="split-KV decode (Flash-Decoding), GQA rows packed, dense or paged cache"),
    Family("decode_combine", "aux", "combine.cu", "cuflash::decode::decode_combine<{T}>",
           dtypes=frozenset(("float16", "bfloat16", "float32")),
           summary="merge of the decode's split partials by their log-sum-exp (the decode "
                   "families merge their own; this with CUFLASH_DECODE_FUSE=0)"),
    Family("decode_append", "aux", "decode.cu", "cuflash::decode::decode_append<{T}>",
           summary="in-place append of k_new / v_new to a dense or paged KV cache"),
)

FAMILIES: dict[str, Family] = {f.name: f for f in REGISTRY}


def by_kind(kind: str) -> tuple[Family, ...]:
    return tuple(f for f in REGISTRY if f.kind == kind)


# ---------------------------------------------------------------------------------------------
# The dispatcher
# ---------------------------------------------------------------------------------------------

def choose(kind: str, shape: Shape, device: DeviceInfo) -> Choice:
    """The best family of ``kind`` ("fwd" or "bwd") for ``shape`` on ``device``, its traits and
    flags, with the chain of reasons (the families passed over, and why)."""
    override = family_override(kind)
    reasons = []
    started = override == "auto"
    for fam in by_kind(kind):
        started = started or fam.name.endswith("_" + override)
        if not started:
            reasons.append(f"{fam.name}: skipped ({_FAMILY_ENV[kind]}={override})")
            continue
        why = fam.rejects(shape, device)
        if why is None:
            if kind == "bwd" and fam.name == "bwd_sm90" and shape.deterministic:
                why = "dQ by atomics only (deterministic=True runs bwd_sm80's ordered dQ)"
        picked = None if why else fam.select(fam, shape, device)
        if isinstance(picked, str):
            why = picked
        if why:
            reasons.append(f"{fam.name}: not used, {why}")
            continue
        traits, flags, more = picked
        expr = fam.expr(shape.dtype, traits, shape.variant, **flags)
        reasons.append(f"{fam.name}: {fam.summary}")
        reasons.extend("  " + r for r in more)
        return Choice(fam, traits, tuple(sorted(flags.items())), expr, tuple(reasons))
    raise ValueError(f"no {kind} kernel family runs {shape} on {device}:\n  " + "\n  ".join(reasons))


# ---------------------------------------------------------------------------------------------
# The compile gate (cuflash/_gate.py): every specialisation the dispatcher can select
# ---------------------------------------------------------------------------------------------

def specialisations(arch: str, subset: str = "all") -> list[tuple[str, str]]:
    """Every (source, name expression) the dispatcher can select on ``arch`` (e.g. "sm_90a"),
    each once, or its covering set (``subset="covering"``, see cuflash/_gate.py)."""
    from . import _gate
    return _gate.specialisations(arch, subset)


def check(archs: Iterable[str], progress: Callable[[int, int], None] | None = None,
          workers: int | None = None, subset: str = "all"):
    """Compile the specialisations of each arch (the compile gate, cuflash/_gate.py): a list of
    ``_jit.CompileReport``. Work is spread over ``workers`` processes (default: all cores)."""
    from . import _gate
    return _gate.check(archs, progress=progress, workers=workers, subset=subset)
