"""The dispatcher's checks of a chosen build against its compile on the GPU, made once per plan
(``_plan``): where a build the tables predict to fit uses local memory, or more registers than
its blocks an SM allow, it is recorded here and ``_families.choose``, run again, picks the
fallback its record names. The records are per process (a compile is per device and NVRTC)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import _traits

if TYPE_CHECKING:
    from ._families import Choice, Shape


#: (Variant, EVEN) of fwd_sm90 block-mask builds whose min_blocks 1 build (the long-list rule,
#: ``bmask_long_keys``) took more than 128 registers on the GPU, so would run 1 block an SM
#: instead of 2: they keep the 2-block build (``kept_blocks_spilled``)
LONG_LISTS_TWO_BLOCKS: set = set()

#: (Variant, EVEN) of fwd_sm90 builds that kept 2 blocks an SM for a block mask and, compiled
#: on the GPU, used local memory (a heavier user mask_mod: spills at the 128-register cap); the
#: dispatcher gives them min_blocks 1 from then on (``kept_blocks_spilled``)
KEPT_BLOCKS_SPILLED: set = set()


def kept_blocks_spilled(choice: "Choice", shape: "Shape", device_id: int) -> bool:
    """Whether ``choice`` is a fwd_sm90 build that kept the table's blocks an SM for a block
    mask's mask_mod (``_traits.FWD_SM90_MIN_BLOCKS_BLOCK_MASK``) and its kernel, compiled now
    for ``device_id`` (memoised: the plan's own compile reuses it), uses local memory; then it
    is recorded, and ``choose`` run again picks min_blocks 1 (0 spills: the suite's mask_mods
    and most of the testing kit's compile without; a mask_mod dividing by a constant that is not
    a power of two spilled 16-32 bytes, session 9). The same for a persistent build (``persist``,
    session 10: a block mask with short lists at min_blocks 1), which ``choose`` then gives up;
    and a build of the long-list rule (min_blocks 1 for lists of >= ``bmask_long_keys()`` keys)
    whose registers leave room for 1 block an SM only is recorded, and ``choose`` keeps 2."""
    t, v = choice.traits, shape.variant
    if choice.family.name != "fwd_sm90" or not (v.block_mask and v.score_path):
        return False
    from . import _jit
    if any("CUFLASH_FWD90_BMASK_LONG" in r for r in choice.reasons):
        # the long-list rule's min_blocks 1 build: it paid where it kept 2 blocks an SM (<= 128
        # registers for 256 threads, as prefix-LM's does); one that takes more goes back to
        # the 2-block build (the suite's prefix with causal=True: 130 registers)
        kernel = _jit.get_kernel(choice.family.source, choice.expr, device_id, v.prelude)
        if kernel.num_regs * t.threads * 2 > 65536:
            LONG_LISTS_TWO_BLOCKS.add((v, bool(choice.flag.get("even"))))
            return True
    if not (t.min_blocks >= 2 or t["persist"]):
        return False
    kernel = _jit.get_kernel(choice.family.source, choice.expr, device_id, v.prelude)
    if not kernel.local_size_bytes:
        return False
    KEPT_BLOCKS_SPILLED.add((v, bool(choice.flag.get("even"))))
    return True


#: Variants whose bwd_sm90 build with the mask as bits (a block mask's mask_mod: d = 128, or
#: d = 64 in 128-row tiles) used local memory on the GPU (``block_mask_bwd_spilled``)
BWD90_BLOCK_MASK_SPILLED: set = set()


def block_mask_bwd_spilled(choice: "Choice", shape: "Shape", device_id: int) -> bool:
    """Whether ``choice`` is such a bwd_sm90 build and its kernel, compiled now for
    ``device_id`` (memoised: the plan's compile reuses it), uses local memory (a mask_mod
    heavier than the suite's; session 10); then it is recorded, and ``choose`` run again picks
    bwd_sm80 at d = 128, the per-element path's 64-row tiles at d = 64."""
    v, t = shape.variant, choice.traits
    if (choice.family.name != "bwd_sm90" or not v.block_mask or not v.mask_mod
            or (t.head_dim not in _traits.BWD_SM90_BLOCK_MASK and t.block_m != 128)):
        return False
    from . import _jit
    if not _jit.get_kernel(choice.family.source, choice.expr, device_id, v.prelude).local_size_bytes:
        return False
    BWD90_BLOCK_MASK_SPILLED.add(v)
    return True
