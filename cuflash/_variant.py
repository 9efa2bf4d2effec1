"""The score pipeline of one call, as the kernels see it: the Variant.

DESIGN.md's modifiers (softcap, ALiBi, bias, score_mod, masks, sinks) are one pipeline that
every path shares. On the GPU it is one C++ template parameter, ``cuflash::Variant<...>``
(``cuda_src/variant.cuh``), given to every kernel family, forward and backward: a struct with
the score transform, its derivative, the element mask and the tile classification. What is
known when the kernel is compiled (which modifiers are on) is the template argument; what is
known only per call (the causal offset, the scale) travels in ``Params.var``
(``VariantParams``).

The Variant carries the causal mask (both alignments: the alignment is the run-time
``causal_offset``), the scale and the built-in modifiers (window, softcap, ALiBi, bias, mask,
sink; their values are ``Params.mod``). A modifier that is off is absent from the template
argument, so it costs nothing in the compiled kernel.
"""

from __future__ import annotations

import dataclasses
import math
import os

import numpy

#: log2(e): the kernels compute exp(x) as exp2(x * log2(e)) with the factor folded into the scale
LOG2E = 1.4426950408889634

#: ``cuflash::VariantParams`` (cuda_src/variant.cuh), field for field, aligned as C++ does.
VARIANT_PARAMS = numpy.dtype([
    ("scale", "<f8"),          # tau
    ("scale_log2", "<f8"),     # tau * log2(e)
    ("causal_offset", "<i4"),  # under causal: key j is visible to query i iff j <= i + offset
    ("pad_", "<i4"),
], align=True)


@dataclasses.dataclass(frozen=True)
class Variant:
    """The compile-time part of the score pipeline: which modifiers are on.

    Hashable and small: it is part of every plan's key and of every kernel's name expression.
    ``bias`` is the bias's C++ element type (``"__half"``, ``"__nv_bfloat16"``, ``"float"``,
    ``"double"``) or None; the other modifier fields are flags (their values are run-time:
    ``Params.mod``, packed by ``_modifier_params.pack``). Plain attention keeps the short
    spelling ``cuflash::Variant<true|false>``, the same C++ type as the long one with every
    modifier off.
    """

    causal: bool = False
    window: bool = False
    softcap: bool = False
    #: the softcap's build in the tensor-core families (variant.cuh ``softcap_of``): True, one
    #: ``tanh.approx`` a score (C++ ``SOFTCAP`` = 1, spelled ``true``); False, session 7's
    #: ``ex2.approx`` and ``rcp.approx`` (``SOFTCAP`` = 2). bfloat16 only: tanh.approx's relative
    #: error (2^-11) is float16's rounding, and an emulation with that error injected fails the
    #: kit's lse bound in float16 (bench/NOTES.md, session 8). ``CUFLASH_SOFTCAP_TANH=0`` keeps
    #: the old build for bfloat16 too (:func:`_switch`); meaningless without ``softcap``.
    softcap_tanh: bool = True
    #: ALiBi alone in the tensor-core forwards: True, scores kept raw, the slope divided by the
    #: scale (C++ ``ALIBI`` = 1, ``true``); False, session 7's natural units (``ALIBI`` = 2).
    #: ``CUFLASH_ALIBI_RAW`` picks it per plan, False for top-left causal with Lq > Lk
    #: (:func:`_alibi_row_offset_ok`); meaningless without ``alibi_slopes``.
    alibi_raw: bool = True
    #: with ``softcap_tanh``: a share of the forward's softmax exponentials on the FMA pipe
    #: (online_softmax.cuh ``ex2_poly``; ``SOFTCAP`` = 1), else none (``SOFTCAP`` = 3);
    #: ``CUFLASH_SOFTCAP_POLY=0`` turns it off
    softcap_poly: bool = True
    #: with ``softcap_tanh``: the forwards' softmax on a fixed offset, no running max and no
    #: rescale of O (online_softmax.cuh ``fixed_offset_softmax_scores``; ``SOFTCAP`` = 4, or 5
    #: without ``softcap_poly``), where :func:`softcap_offset` admits the cap and Lk; False
    #: (the default of a Variant spelled by hand) or ``CUFLASH_SOFTCAP_FIXED=0``: the running max
    softcap_fixed: bool = False
    #: with ``softcap_fixed`` and ``softcap_poly``: the other share of the exponentials on the
    #: FMA pipe (2 of 8 column tiles at d <= 64, 1 at d = 128; ``SOFTCAP`` = 6) instead of the
    #: default's (none and 2): ``CUFLASH_SOFTCAP_SHARE=alt``, an A/B arm
    softcap_share_alt: bool = False
    #: with ``softcap_tanh``, the softcap alone and no mask array or mask_mod: bwd_sm90 computes
    #: it on its plain path (C++ ``SOFTCAP`` + 8, ``kSoftcapBwdPlain``: the chain rule's 1 - th^2
    #: folded into P after P^T is packed for dV), not on the per-element path (bwd_io
    #: ``p_ds_pair``); both at 64-row query tiles (the plain table's 128 at d = 64 spill 160
    #: bytes with it); opt-in, ``CUFLASH_SOFTCAP_BWD=plain``: on the H200 (session 10, call 2)
    #: it was 1.5% (d 64) and 2.5% (d 128) slower over fwd+bwd than the per-element path
    softcap_bwd_plain: bool = False
    alibi_slopes: bool = False
    bias: str | None = None
    mask: bool = False
    sink: bool = False
    block_mask: bool = False          # a block mask classifies the mask_mod's tiles
    #: the traced user functions' structs (``cuflash::user::...``), or None
    score_mod: str | None = None
    mask_mod: str | None = None
    #: their C++ source, compiled before the family's (the struct names hash the traces, so
    #: equal names mean equal source: not compared)
    prelude: str = dataclasses.field(default="", compare=False, repr=False)

    @property
    def modified(self) -> bool:
        """Whether a modifier other than causal is on."""
        return bool(self.window or self.softcap or self.alibi_slopes or self.bias or self.mask
                    or self.sink or self.score_mod or self.mask_mod)

    @property
    def score_path(self) -> bool:
        """Whether scores go through the modifiers' per-element code (everything but causal and
        the window, which only move the mask's bounds): those kernels need more registers, and
        the dispatcher gives them the tile choice with the most (``_families``)."""
        return bool(self.softcap or self.alibi_slopes or self.bias or self.mask or self.sink
                    or self.score_mod or self.mask_mod)

    @property
    def heavy(self) -> bool:
        """A score transform and an element-mask array together (their loads and math side by
        side): fwd_sm80's EVEN build of these spills, so they take the predicated one."""
        return bool((self.softcap or self.alibi_slopes or self.bias or self.score_mod)
                    and (self.mask or self.mask_mod))

    @property
    def cpp(self) -> str:
        """The C++ template argument, e.g. ``cuflash::Variant<true>`` or, with modifiers,
        ``cuflash::Variant<causal, window, softcap, alibi, BiasT, mask, ScoreMod, MaskMod,
        block_mask, sink>`` (cuda_src/variant.cuh)."""
        def b(x) -> str:
            return "true" if x else "false"
        if not self.modified:
            return f"cuflash::Variant<{b(self.causal)}>"
        softcap = ("false" if not self.softcap else "2" if not self.softcap_tanh
                   else (("6" if self.softcap_share_alt else "4") if self.softcap_poly else "5")
                   if self.softcap_fixed
                   else "true" if self.softcap_poly else "3")
        if self.softcap and self.softcap_tanh and self.softcap_bwd_plain:
            softcap = str((1 if softcap == "true" else int(softcap)) + 8)
        alibi = "false" if not self.alibi_slopes else "true" if self.alibi_raw else "2"
        args = [b(self.causal), b(self.window), softcap, alibi,
                self.bias or "void", b(self.mask), self.score_mod or "cuflash::NoScoreMod",
                self.mask_mod or "cuflash::NoMaskMod", b(self.block_mask), b(self.sink)]
        return f"cuflash::Variant<{', '.join(args)}>"

    @property
    def features(self) -> frozenset[str]:
        """The modifiers that are on, by keyword name (a family must support all of them)."""
        return frozenset(name for name, on in (
            ("causal", self.causal), ("window", self.window), ("softcap", self.softcap),
            ("alibi_slopes", self.alibi_slopes), ("bias", self.bias), ("mask", self.mask),
            ("sink", self.sink), ("score_mod", self.score_mod), ("mask_mod", self.mask_mod))
            if on)

    def describe(self) -> str:
        return ", ".join(sorted(self.features)) or "plain softmax"


#: What the families that run the modifiers implement (every forward family, bwd_sm80): causal,
#: the built-ins and the traced user functions (a block_mask runs as its mask_mod)
MODIFIER_FEATURES = frozenset({"causal", "window", "softcap", "alibi_slopes", "bias", "mask",
                               "sink", "score_mod", "mask_mod"})

#: Every Variant a family may be compiled for (the compile gate instantiates each).
ALL_VARIANTS = (Variant(causal=False), Variant(causal=True))


def variant_of(prob, mods=None) -> Variant:
    """The Variant of a validated AttentionProblem and its ``Modifiers`` record (None: none)."""
    if mods is None:
        return Variant(causal=bool(prob.causal))
    from ._modifier_params import BIAS_CTYPE
    from . import _trace_cuda
    score, mask = traces_of(mods)
    fixed = _softcap_fixed(prob, mods)
    return Variant(causal=bool(prob.causal), window=mods.window is not None,
                   softcap=mods.softcap is not None,
                   softcap_tanh=mods.softcap is None or (_switch("CUFLASH_SOFTCAP_TANH")
                                                         and prob.dtype.name == "bfloat16"),
                   alibi_raw=mods.alibi_slopes is None or (_switch("CUFLASH_ALIBI_RAW")
                                                           and _alibi_row_offset_ok(prob)),
                   softcap_poly=mods.softcap is None or _switch("CUFLASH_SOFTCAP_POLY"),
                   softcap_fixed=fixed, softcap_share_alt=fixed and _share_alt(),
                   softcap_bwd_plain=_softcap_bwd_plain(prob, mods),
                   alibi_slopes=mods.alibi_slopes is not None,
                   bias=None if mods.bias is None else BIAS_CTYPE[str(mods.bias.dtype)],
                   mask=mods.mask is not None, sink=mods.sink is not None,
                   score_mod=None if score is None else _trace_cuda.qualified_name(score),
                   mask_mod=None if mask is None else _trace_cuda.qualified_name(mask),
                   block_mask=mods.block_mask is not None,
                   prelude=_dq_bounds(prob, mods) + _alibi_prelude(mods)
                   + "".join(t.source for t in (score, mask) if t is not None))


def _alibi_prelude(mods) -> str:
    """``CUFLASH_ALIBI_ROW_OFFSET=0`` (an A/B switch, :func:`_switch`; session 18): ALiBi's
    causal raw-units build adds its distance term to every score again (a FADD and an FFMA a
    score) instead of carrying the row term in the softmax (variant.cuh ``kAlibiRowOffset``)."""
    if mods.alibi_slopes is None or _switch("CUFLASH_ALIBI_ROW_OFFSET"):
        return ""
    return "#define CUFLASH_ALIBI_ROW_OFFSET 0\n"


def _alibi_row_offset_ok(prob) -> bool:
    """Whether a causal ALiBi build in raw units (``ALIBI`` = 1) may take ALiBi's distance
    ``|i + Lk - Lq - j|`` as ``i + Lk - Lq - j`` on every visible pair, as fwd_sm90ws does
    (variant.cuh, ``kAlibiRowOffset``: one FFMA a score): true unless causal is aligned top-left
    with ``Lq > Lk``, whose visible pairs ``j <= i`` include some right of ``i + Lk - Lq``; those
    take the natural-units build (``ALIBI`` = 2), which keeps the absolute value."""
    return not prob.causal or prob.causal_offset <= prob.Lk - prob.Lq


#: bwd_sm90's block-mask builds add dQ_i's rows with bwd_io::red_row_pairs (session 11); this
#: macro, defined before their source, gives them red_add2's bounded additions back
DQ_BOUNDS = "#define CUFLASH_BWD90_DQ_BOUNDS 1\n"


def _dq_bounds(prob, mods) -> str:
    """``DQ_BOUNDS`` where a block mask's backward must bound dQ's columns: d is not the head-dim
    bucket bwd_sm90 compiles (HEAD_DIM = max(d, dv) rounded up to 64: the row pairs need every
    column pair of a HEAD_DIM-column slice inside the row), or ``CUFLASH_BWD90_DQ_ROWS=0``
    (read at plan time; the default: session 10's bounded additions) -- "1" gives the row pairs
    where d = HEAD_DIM, off by default: session 12's H200 run timed them at 0.99-1.01x the
    bounded additions (bench/probes/bmask_bwd128.py, mean 1.004); else "". (In the Variant's prelude: the forward's builds
    compile it unused.)"""
    import os
    value = os.environ.get("CUFLASH_BWD90_DQ_ROWS", "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"CUFLASH_BWD90_DQ_ROWS={value!r}: expected 0 or 1")
    if mods.block_mask is None:
        return ""
    bucket = max(32, -(-max(prob.d, prob.dv) // 64) * 64)
    return DQ_BOUNDS if value != "1" or prob.d != bucket else ""


def softcap_offset(softcap: float, Lk: int) -> float | None:
    """The fixed offset (base 2) of the forwards' softmax under a softcap alone, as the kernels
    compute it (online_softmax.cuh ``softcap_offset``, float32), or None where that build could
    overflow: scores lie in [-a, a], a = c log2(e); the offset mo = min(floor(a), floor(102 -
    lg - a)), lg = ceil(log2 Lk), keeps every term within 2^-(24 + lg) of a row's max a normal
    float even when that max is -a, and P <= 2^(a - mo). Admitted where P Lk <= 2^88, so that O
    = sum P v overflows only for |v| > 2^40 (bfloat16 values beyond 1e12); c = 50 (Gemma 2)
    up to Lk = 2^22, c = 30 up to any Lk."""
    a = numpy.float32(softcap) * numpy.float32(LOG2E)
    if not (numpy.isfinite(a) and a > 0):
        return None
    lg = max(int(Lk), 2) - 1
    lg = lg.bit_length()                      # ceil(log2 Lk), as 32 - __clz(Lk - 1)
    mo = min(math.floor(a), math.floor(numpy.float32(102 - lg) - a))
    return float(mo) if float(a) - mo + lg <= 88 else None


def _softcap_fixed(prob, mods) -> bool:
    """Whether a plan takes the fixed-offset softmax (:attr:`Variant.softcap_fixed`): the softcap
    alone on tanh.approx (:func:`_softcap_alone_tanh`), the cap and Lk admitted by
    :func:`softcap_offset`, and ``CUFLASH_SOFTCAP_FIXED`` not 0."""
    return (_softcap_alone_tanh(prob, mods) and _switch("CUFLASH_SOFTCAP_FIXED")
            and softcap_offset(mods.softcap, prob.Lk) is not None)


def _softcap_alone_tanh(prob, mods) -> bool:
    """The softcap on tanh.approx (bfloat16, ``CUFLASH_SOFTCAP_TANH`` not 0) and no other score
    transform nor a sink (C++ ``kCapUnits``: scores in units of the cap), with causal or not
    but no other mask: session 10 keeps the builds of the window, mask arrays, mask_mods and
    block masks with the softcap as they were (fwd_sm80's EVEN build at d = 64 with the window
    spilled 12 bytes with the fixed offset; the others were not compiled with it)."""
    if mods.softcap is None or prob.dtype.name != "bfloat16" or not _switch("CUFLASH_SOFTCAP_TANH"):
        return False
    return (mods.alibi_slopes is None and mods.bias is None and mods.sink is None
            and mods.score_mod is None and mods.window is None and mods.mask is None
            and mods.mask_mod is None and mods.block_mask is None)


def _softcap_bwd_plain(prob, mods) -> bool:
    """Whether bwd_sm90 takes the softcap on its plain path (:attr:`Variant.softcap_bwd_plain`):
    the softcap alone on tanh.approx (no mask array nor mask_mod either: the plain path masks
    by bounds only), a cap of at least 1e-3 (a masked pair's th, -1e18, must give P = 0:
    bwd_sm90.cu ``kHiddenTh``), and ``CUFLASH_SOFTCAP_BWD=plain`` (opt-in: measured slower
    than the per-element path, bench/NOTES.md "Session 10, call 2")."""
    if not _softcap_alone_tanh(prob, mods):
        return False
    value = os.environ.get("CUFLASH_SOFTCAP_BWD", "").strip()
    if value not in ("", "plain", "pairwise"):
        raise ValueError(f"CUFLASH_SOFTCAP_BWD={value!r}: expected plain or pairwise")
    return value == "plain" and mods.softcap >= 1e-3


def _share_alt() -> bool:
    """``CUFLASH_SOFTCAP_SHARE``: "alt" gives the fixed-offset softcap the other share of the
    exponentials on the FMA pipe (:attr:`Variant.softcap_share_alt`, an A/B arm); unset or
    "default", its own."""
    value = os.environ.get("CUFLASH_SOFTCAP_SHARE", "").strip()
    if value not in ("", "default", "alt"):
        raise ValueError(f"CUFLASH_SOFTCAP_SHARE={value!r}: expected default or alt")
    return value == "alt"


def _switch(var: str) -> bool:
    """An A/B switch of the tensor-core kernels' modifier code (bench/NOTES.md "softcap and
    ALiBi cost (session 8)"), read when a plan is made (``cuflash._api.clear_plans()`` between
    two settings in one process); ``1`` or unset: the session-8 build.
    ``CUFLASH_SOFTCAP_TANH=0``: the softcap on ``ex2.approx`` and ``rcp.approx`` (two special-
    function operations a score) instead of ``tanh.approx`` (one).
    ``CUFLASH_SOFTCAP_POLY=0``: no share of the forward's exponentials on the FMA pipe beside
    ``tanh.approx``.
    ``CUFLASH_SOFTCAP_FIXED=0``: the forwards' softmax keeps its running max under a softcap
    alone instead of the fixed offset (session 10).
    ``CUFLASH_ALIBI_RAW=0``: ALiBi alone in natural units (one FMUL a score more) instead of
    the raw scores with the slope divided by the scale.
    ``CUFLASH_ALIBI_ROW_OFFSET=0``: that build under causal adds ALiBi's whole distance term to
    every score instead of carrying its row term in fwd_sm90ws's softmax (session 18)."""
    value = os.environ.get(var, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{var}={value!r}: expected 0 or 1")
    return value != "0"


def traces_of(mods) -> tuple:
    """The traces of ``mods.score_mod`` and ``mods.mask_mod`` (None where absent), reused
    while nothing the functions read changes (``_trace.cached_trace``). A ``block_mask``
    contributes its mask_mod (the kernels read its map too: empty tiles are never loaded)."""
    from . import _trace
    return tuple(None if fn is None else _trace.cached_trace(fn, role)
                 for fn, role in ((mods.score_mod, "score_mod"), (mods.mask_mod, "mask_mod")))


def variant_params(prob) -> numpy.void:
    """``VariantParams`` of one problem: the run-time values of its score pipeline."""
    p = numpy.zeros((), VARIANT_PARAMS)
    p["scale"] = prob.scale
    p["scale_log2"] = prob.scale * LOG2E
    p["causal_offset"] = prob.causal_offset
    if not math.isfinite(p["scale_log2"]):   # _problem rejects such scales; keep the kernel safe
        raise ValueError(f"scale={prob.scale} times log2(e) is not finite")
    return p[()]


def _bias_full_warpgroups() -> bool:
    """``CUFLASH_FWD_BIAS_WARPGROUPS`` (read at plan time; session 8): "full" (the default)
    lets a dense bias keep fwd_sm90's table warpgroups (``_traits.FWD_SM90_FULL_WARPGROUPS_BIAS``),
    "2" gives it 2 as before, for an A/B in one process."""
    import os
    value = os.environ.get("CUFLASH_FWD_BIAS_WARPGROUPS", "").strip()
    if value not in ("", "full", "2"):
        raise ValueError(f"CUFLASH_FWD_BIAS_WARPGROUPS={value!r}: expected full or 2")
    return value != "2"


def _bmask_keep_blocks() -> bool:
    """``CUFLASH_FWD90_BMASK_BLOCKS`` (read at plan time; session 9): "table" (the default) lets
    a block mask's mask_mod keep fwd_sm90's table ``min_blocks`` (2 at d = 64:
    ``_traits.FWD_SM90_MIN_BLOCKS_BLOCK_MASK``), "1" gives it 1 as before, for an A/B in one
    process."""
    import os
    value = os.environ.get("CUFLASH_FWD90_BMASK_BLOCKS", "").strip()
    if value not in ("", "table", "1"):
        raise ValueError(f"CUFLASH_FWD90_BMASK_BLOCKS={value!r}: expected table or 1")
    return value != "1"


def bwd90_block_mask() -> bool:
    """``CUFLASH_BWD90_BLOCK_MASK`` (read at plan time): "1" (the default since session 10) runs
    a block mask's mask_mod at d = 128 on bwd_sm90 (``_traits.BWD_SM90_BLOCK_MASK``), "0" on
    bwd_sm80 as before, for an A/B in one process."""
    import os
    value = os.environ.get("CUFLASH_BWD90_BLOCK_MASK", "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"CUFLASH_BWD90_BLOCK_MASK={value!r}: expected 0 or 1")
    return value != "0"


def bmask_tile_major(kind: str) -> bool:
    """``CUFLASH_BMASK_TILE_MAJOR`` (read at plan time; session 11): which launches of a block
    mask WITHOUT causal run in tile-major grid order (``_plan.grid_order``; a causal call is
    tile-major already). "both": the backward's, whose key tile 0 of every batch
    item then starts first -- prefix-LM's long blocks (the prefix's keys, seen by every query)
    in the first waves, not the last batch item's ending the kernel alone (bench/NOTES.md,
    session 11: that tail was 0.15 ms at 4k, d = 128) -- and the forward's (its last query
    tile, prefix-LM's heaviest, of every batch item first): the default since session 12's
    H200 run (bench/probes/bmask_bwd128.py: fwd+bwd 1.00-1.05x batch-major, forward 1.02-1.07x,
    GPU tests passed); "bwd": the backward's only; "none": batch-major, as in session 10, for
    an A/B in one process. ``kind``: "fwd" or "bwd"."""
    import os
    value = os.environ.get("CUFLASH_BMASK_TILE_MAJOR", "").strip() or "both"
    if value not in ("bwd", "both", "none"):
        raise ValueError(f"CUFLASH_BMASK_TILE_MAJOR={value!r}: expected both, bwd or none")
    return value == "both" or value == kind


def _bwd90_bmask_rows(variant: Variant) -> bool:
    """``CUFLASH_BWD90_BMASK_ROWS`` (read at plan time; session 10): "128" (the default) lets
    bwd_sm90 keep its table's 128-row query tiles at d = 64 for a block mask's mask_mod alone,
    which then takes the plain path with its mask as 64 bits (bwd_sm90.cu kMaskBits); "64"
    gives it the per-element path's 64-row tiles as in session 9, for an A/B in one process. A
    build that uses local memory goes back to 64 rows (``_spills.block_mask_bwd_spilled``)."""
    import os
    value = os.environ.get("CUFLASH_BWD90_BMASK_ROWS", "").strip()
    if value not in ("", "64", "128"):
        raise ValueError(f"CUFLASH_BWD90_BMASK_ROWS={value!r}: expected 64 or 128")
    return (value != "64" and variant.block_mask
            and variant.features <= frozenset({"causal", "mask_mod"}))


def modifier_tiles(family: str, t, variant: Variant, why: list[str]):
    """The traits a family's table gives plain attention, adjusted for a Variant whose
    per-element score code needs registers (``score_path``): one block an SM (255 registers a
    thread; a block mask's mask_mod in fwd_sm90 keeps the table's blocks an SM:
    ``_traits.FWD_SM90_MIN_BLOCKS_BLOCK_MASK``); fwd_sm90 at most 2 warpgroups (unless every modifier is in
    ``_traits.FWD_SM90_FULL_WARPGROUPS``: softcap, ALiBi and the sink keep 3, and a block
    mask's mask_mod with them: ``FWD_SM90_FULL_WARPGROUPS_BLOCK_MASK``); a ``heavy`` one
    32-key tiles (fwd_sm80, fwd_sm90);
    bwd_sm80 query chunks of at most 32 rows; bwd_sm90 query tiles of 64 rows where the
    per-element code runs (S^T and dP^T of 128 rows with it spill; not for a sink alone, nor
    for a block mask's mask_mod alone, whose mask then goes as bits: ``_bwd90_bmask_rows``). The table's choices spill with them (the compile
    table of docs/modifiers.md). Appends the reason to ``why``."""
    if not variant.score_path:
        return t
    from . import _traits
    named = {}
    if t.min_blocks > 1 and not (
            family == "fwd_sm90" and variant.block_mask
            and variant.features <= _traits.FWD_SM90_MIN_BLOCKS_BLOCK_MASK and _bmask_keep_blocks()):
        named["min_blocks"] = 1
    elif t.min_blocks > 1:
        why.append(f"block mask ({variant.describe()}): min_blocks={t.min_blocks} kept, so a "
                   "second block overlaps each block's fixed cost (short tile lists)")
    if family == "fwd_sm90" and t["warpgroups"] > 2 and not (
            variant.features <= _traits.FWD_SM90_FULL_WARPGROUPS or (
                variant.block_mask and variant.features <= _traits.FWD_SM90_FULL_WARPGROUPS_BLOCK_MASK)
            or (variant.features <= _traits.FWD_SM90_FULL_WARPGROUPS_BIAS and _bias_full_warpgroups())):
        named["warpgroups"] = 2
    if family in ("fwd_sm80", "fwd_sm90") and variant.heavy and t.block_n > 32:
        named["block_n"] = 32
    if family == "bwd_sm80" and t["sub_m"] > 32:
        named["sub_m"] = 32
    # (bwd_sm90's per-element path, bwd_io::p_ds_pair; a sink or ALiBi without those does not
    # take it: the backward sees the sink in L_i, and ALiBi is a term of P's exponent on the
    # plain path)
    if family == "bwd_sm90" and t.block_m > 64 and (
            variant.softcap or variant.bias or variant.mask or variant.score_mod
            or variant.mask_mod) and not _bwd90_bmask_rows(variant):
        named["block_m"] = 64
    if family not in ("fwd_sm80", "fwd_sm90", "bwd_sm80", "bwd_sm90") or not named:
        return t
    new = dataclasses.replace(t.replace(**named), allow_even=t.allow_even)
    why.append(f"modifiers ({variant.describe()}): " + ", ".join(
        f"{k}={v}" for k, v in named.items()) + " for the registers of the per-element score "
        "code")
    return new
