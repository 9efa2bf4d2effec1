"""Environment overrides of the dispatcher's flags, for tuning runs and A/B comparisons (read per
plan; plans are cached): ``CUFLASH_FUSE_DQ`` and ``CUFLASH_TILES``. ``CUFLASH_FWD`` /
``CUFLASH_BWD`` (the family to start from) live beside the registry: ``_families.family_override``."""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._devices import DeviceInfo
    from ._families import Choice


def fuse_dq_wanted(blocks: int, dev: "DeviceInfo") -> bool:
    """bwd_sm90's ``fuse_dq`` flag: compile in the rounding of dQ by the main kernel
    (bwd_io::finish_dq_at_end), which spares the call bwd_finish_dq's launch, where the whole
    backward is one wave of ``blocks`` (at most one a SM): there the GPU work is short and the
    host's launches are what a call costs. Above, the kernel without it runs: the fence that the
    fused rounding needs makes ptxas track the completion of every dQ atomic of the main loop
    (ATOMG instead of REDG), a cost the separate launch does not have. ``CUFLASH_FUSE_DQ``:
    ``0`` never, ``1`` (tests, A/B runs) always, unset: by the rule."""
    value = os.environ.get("CUFLASH_FUSE_DQ", "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"CUFLASH_FUSE_DQ={value!r}: expected 0 or 1")
    return blocks <= dev.num_sms if value == "" else value == "1"


#: the most query rows for which bwd_sm90's ONE_LAUNCH build computes D = rowsum(dO o O) in
#: every key tile's block (each reads its item's O and dO rows from m_first on). Session 12's
#: H200 run (bench/probes/bwd_one_launch.py, bench/NOTES.md): host time 22.1-22.7 -> 16.7-17.8
#: us a call at every point; GPU time 14.3 -> 12.1 us at L 64, equal at L 128 (d 128, 8 heads:
#: 24.7 both, one call isolated 40.2 -> 38.3 us), but 5.6-6.6% MORE at L 512 (39.6 -> 41.8 us,
#: d 64 causal 2 x 8 heads; 68.1 -> 72.6 us, d 128 16 heads; isolated +1.0 and +3.4 us): there
#: the 4-8 blocks of a head each read its 512 rows of O and dO. So 128, the longest measured
#: without a loss (256 was not measured).
ONE_LAUNCH_MAX_LQ = 128


#: bwd_sm90's flags as the dispatcher can set them (its builds for the compile gate)
BWD_SM90_FLAGS = ({"fuse_dq": False, "one_launch": ""}, {"fuse_dq": True, "one_launch": ""},
                  {"fuse_dq": True, "one_launch": ", true"})


def one_launch_wanted(shape, fuse_dq: bool, why: list) -> str:
    """bwd_sm90's ``one_launch`` flag: compile in line 4 of Algorithm 2 (D) and the re-zeroing
    of dQ's accumulator and counters (bwd_io::block_row_dots, finish_dq_body), so that a plan
    whose layouts allow it (``_plan_one.py``) runs the backward as one launch, without
    bwd_dot_do_o: for the ``fuse_dq`` builds (one wave: host-bound) with at most
    ``ONE_LAUNCH_MAX_LQ`` query rows. ``CUFLASH_BWD_ONE_LAUNCH``: ``0`` never, ``1`` wherever
    fuse_dq (tests, A/B runs), unset: by the rule. The flag as the template spells it: a
    trailing default argument, ``", true"`` where set (the reason appended to ``why``), else
    ``""`` (the build keeps its name)."""
    value = os.environ.get("CUFLASH_BWD_ONE_LAUNCH", "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"CUFLASH_BWD_ONE_LAUNCH={value!r}: expected 0 or 1")
    if not fuse_dq or value == "0" or (value == "" and shape.Lq > ONE_LAUNCH_MAX_LQ):
        return ""
    why.append("short queries: D and the zeroing of dQ's accumulator in the main kernel (no "
               "bwd_dot_do_o launch where the layouts allow: host time)")
    return ", true"


def fuse_dq_finish(choice: "Choice", dq_direct: bool, launches: int) -> bool:
    """Whether a backward plan drops bwd_finish_dq's launch: its kernel was compiled with the
    rounding (the ``fuse_dq`` flag), dq is the result itself (no broadcast dimension to sum
    over) and one launch covers the batch (the counters are per batch item of a launch). A
    kernel with the flag and a plan that cannot use it still runs right (with the launch)."""
    return bool(choice.flag.get("fuse_dq")) and dq_direct and launches == 1


def tile_override(family: str, bucket: int) -> tuple[int, ...] | None:
    """``CUFLASH_TILES="fwd_sm80:64=32:8:1:2;bwd_sm90:128=64:2:1"``: replace the table entry
    of (family, head-dim bucket) by these values of its tile arguments after ``head_dim``, in
    template order. For tuning runs; the compile gate checks the tables, not these."""
    spec = os.environ.get("CUFLASH_TILES", "")
    for item in filter(None, (s.strip() for s in spec.split(";"))):
        m = re.fullmatch(r"(\w+):(\d+)=([\d:]+)", item)
        if not m:
            raise ValueError(f"CUFLASH_TILES entry {item!r}: expected family:bucket=a:b:...")
        if m.group(1) == family and int(m.group(2)) == bucket:
            return tuple(int(x) for x in m.group(3).split(":"))
    return None
