"""The score pipeline of one call, as the kernels see it: the Variant.

DESIGN.md's modifiers (softcap, ALiBi, bias, score_mod, masks, sinks) are one pipeline that
every path shares. On the GPU it is one C++ template parameter, ``cuflash::Variant<...>``
(``cuda_src/variant.cuh``), given to every kernel family, forward and backward: a struct with
the score transform, its derivative, the element mask and the tile classification. What is
known when the kernel is compiled (which modifiers are on) is the template argument; what is
known only per call (the causal offset, the scale) travels in ``Params.var``
(``VariantParams``).

Today the Variant carries the causal mask (both alignments: the alignment is the run-time
``causal_offset``) and the scale. A modifier that is off is absent from the template argument,
so it costs nothing in the compiled kernel.
"""

from __future__ import annotations

import dataclasses
import math

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
    """

    causal: bool = False

    @property
    def cpp(self) -> str:
        """The C++ template argument, e.g. ``cuflash::Variant<true>``."""
        return f"cuflash::Variant<{'true' if self.causal else 'false'}>"

    @property
    def features(self) -> frozenset[str]:
        """The modifiers that are on, by keyword name (a family must support all of them)."""
        return frozenset(name for name, on in (("causal", self.causal),) if on)

    def describe(self) -> str:
        return ", ".join(sorted(self.features)) or "plain softmax"


#: Every Variant a family may be compiled for (the compile gate instantiates each).
ALL_VARIANTS = (Variant(causal=False), Variant(causal=True))


def variant_of(prob) -> Variant:
    """The Variant of a validated AttentionProblem."""
    return Variant(causal=bool(prob.causal))


def variant_params(prob) -> numpy.void:
    """``VariantParams`` of one problem: the run-time values of its score pipeline."""
    p = numpy.zeros((), VARIANT_PARAMS)
    p["scale"] = prob.scale
    p["scale_log2"] = prob.scale * LOG2E
    p["causal_offset"] = prob.causal_offset
    if not math.isfinite(p["scale_log2"]):   # _problem rejects such scales; keep the kernel safe
        raise ValueError(f"scale={prob.scale} times log2(e) is not finite")
    return p[()]
