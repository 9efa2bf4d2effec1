"""decode_sm80's grid and copy variants (A/B switches read when a decode plan is built,
``cuflash/_inference_gpu.py``): the stream grid (decode_mma.cu's STREAM build: the groups' key
iterations shared equally by one wave of blocks; by default where the groups fill every
resident slot and a block's share is long), the deep cp.async ring of grids of at most one
block an SM (decode_mma.cu's STAGES; opt-in), the L2 hints of its K/V copies, the split count
(balanced_splits by default; session 9's, or every resident slot: CUFLASH_DECODE_SPLITS) and
the paged caches' page walk (decode_mma.cu's PAGE_WALK by default; CUFLASH_DECODE_PAGES=s9),
the first K/V copies before the rows' lengths arrive (decode_mma.cu's EARLY_KV:
CUFLASH_DECODE_EARLY=one by default since session 12's H200 run; all; 0) and the fused merge's
arrival (one atomicInc: CUFLASH_DECODE_ARRIVE=wrap, off: session 12's run measured it no faster;
release): session 11's two cuts."""

from __future__ import annotations

import math
import os

import numpy

#: the stream grid (``stream_grid``): fewest key iterations a block and a group; the cost of
#: one more piece of a group in a block (its pipeline drain and ramp, epilogue, fence and
#: arrival: ~3 us, ~100 KB of one SM's stream at ~34 GB/s) in K/V bytes; the gain it must
#: promise over the even splits
STREAM_MIN_ITERS, STREAM_MIN_GROUP_ITERS = 16, 32
STREAM_PIECE_BYTES = 96 * 1024
STREAM_MIN_GAIN = 0.02
#: the head-dim bucket with a stream build (decode_mma.cu: at 64 it would spill)
STREAM_HEAD_DIM = 128
#: the default ("auto") stream grid: only where the groups fill every resident slot (two
#: blocks an SM) and a block's share is at least this many key iterations. Measured on the
#: H200 (session 8, call M, CUFLASH_DECODE_STREAM=all against the even splits, K/V TB/s): B 64
#: Hq/Hkv 32/8 Lk 64k (share 1986 iterations) 4.67 against 4.61, 32/32 8k (993) 4.65 against
#: 4.60, 32/8 8k (248) 4.49 against 4.51; fewer groups than slots (B 1, B 8) lost 1-8%: a
#: block's extra pieces (ramp, epilogue, merge: ~3 us each) pay off over long shares only
STREAM_AUTO_MIN_SHARE = 512


def stream_mode() -> str:
    """CUFLASH_DECODE_STREAM: unset or "auto" the stream grid where the groups fill every
    resident slot and a block's share is long (STREAM_AUTO_MIN_SHARE: B = 64 at long caches on
    an H200); "0" the even splits everywhere (session 8's default); "1" the stream grid where
    ``stream_grid``'s cost model predicts a gain; "all" wherever it applies (A/B runs). The
    H200's HBM is saturated by ~96 streaming SMs (bench/NOTES.md, "decode: the stream grid
    (session 8)"), so filling idle SMs of a short grid gains nothing; what the stream grid
    removes at B = 64 is the last wave's ragged tail."""
    value = os.environ.get("CUFLASH_DECODE_STREAM", "").strip().lower()
    if value not in ("", "auto", "0", "1", "all"):
        raise ValueError(f"CUFLASH_DECODE_STREAM={value!r}: expected auto, 0, 1 or all")
    return value or "auto"


#: CUFLASH_DECODE_STAGES=long: the deep ring only where a block reads at least this many key
#: iterations (B 8 32/8 at 2 splits: 512 / 1024 at Lk 64k / 128k, where session 9 measured the
#: deep ring +0.2 / +0.65%; B 1 32/8's 64-128, where it lost 4%, keep 3 stages)
DEEP_MIN_SHARE = 512


def stages_mode() -> int:
    """CUFLASH_DECODE_STAGES: decode_sm80's cp.async ring depth for grids of at most one block
    an SM (decode_mma.cu's STAGES; head-dim bucket 128): unset or "3" session 8's ring
    everywhere (the default: session 9's H200 run, bench/NOTES.md, measured the deep ring 4%
    slower at B = 1, 32/8, Lk 64k and 128k, and within 0.6% at B = 8); "auto" the deepest of
    _traits.DECODE_SM80_DEEP_STAGES that fits the device's shared memory (returns 0); "long"
    the same where a block reads at least DEEP_MIN_SHARE key iterations (returns -1; A/B runs,
    session 11); "4" .. "8" that depth where it fits (A/B runs; the gate compiles 4 and 5)."""
    value = os.environ.get("CUFLASH_DECODE_STAGES", "").strip().lower()
    if value == "":
        return 3
    if value == "auto":
        return 0
    if value == "long":
        return -1
    if value not in tuple(str(i) for i in range(3, 9)):
        raise ValueError(f"CUFLASH_DECODE_STAGES={value!r}: expected auto, long or 3..8")
    return int(value)


def deep_stages(blocks: int, num_sms: int, head_dim: int, smem_optin: int,
                mode: int | None = None, share: int | None = None) -> int:
    """The ring depth of a decode_sm80 grid of ``blocks`` blocks: 3 unless the grid is at most
    one block an SM (then a deep ring costs no occupancy: the blocks are one wave either way)
    at head-dim bucket 128; then ``mode`` (stages_mode(): 0 the deepest of
    DECODE_SM80_DEEP_STAGES that fits ``smem_optin``, -1 the same where ``share``, the key
    iterations of a block, is at least DEEP_MIN_SHARE, 3 none, else that depth if it fits)."""
    from ._traits import DECODE_SM80_DEEP_STAGES, decode_sm80_smem
    mode = stages_mode() if mode is None else mode
    if mode == 3 or head_dim != STREAM_HEAD_DIM or not 0 < blocks <= num_sms:
        return 3
    if mode == -1:
        if share is None or share < DEEP_MIN_SHARE:
            return 3
        mode = 0
    for stages in ((mode,) if mode else DECODE_SM80_DEEP_STAGES):
        if decode_sm80_smem(head_dim, stages) <= smem_optin:
            return stages
    return 3


def l2_mode() -> int:
    """CUFLASH_DECODE_L2: decode_mma's K/V copies with an L2 hint (A/B runs; decode_mma.cu's
    cp_async_kv): unset or "0" none (the gate's build), "256b" the 256-byte L2 prefetch,
    "evict_first" that and an evict-first policy. Returns the define's value (0, 1, 2)."""
    value = os.environ.get("CUFLASH_DECODE_L2", "").strip().lower()
    modes = {"": 0, "0": 0, "256b": 1, "evict_first": 2}
    if value not in modes:
        raise ValueError(f"CUFLASH_DECODE_L2={value!r}: expected 0, 256b or evict_first")
    return modes[value]


def merge_prefetch_wanted() -> bool:
    """CUFLASH_DECODE_MERGE: "0" compiles decode_mma's fused merge as in session 7 (phase A's
    round trip, then phase B's: A/B runs); unset or "1": phase B's first partials loaded with
    phase A's (merge_splits_if_last's PRE, decode_params.cuh)."""
    value = os.environ.get("CUFLASH_DECODE_MERGE", "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"CUFLASH_DECODE_MERGE={value!r}: expected 0 or 1")
    return value != "0"


def arrival_mode() -> str:
    """CUFLASH_DECODE_ARRIVE: decode_mma's fused-merge arrival (decode_params.cuh's
    merge_splits_if_last). "wrap" (session 11): every thread's fence.sc, the block barrier,
    then one atomicInc that arrives and, at the last arrival, wraps the count to 0
    (decode_mma.cu's CUFLASH_DECODE_ARRIVE_WRAP); unset or "fence" (sessions 7-10, the default
    until "wrap" has run on a GPU: session 11 tested it in the g++ emulation only): the same
    arrival by atomicAdd, then the last block's reset by atomicExch, which its acquire fence
    waits for (an L2 round trip more); "release" (A/B runs): one thread's acq_rel fence after
    the block barrier (CUTLASS's barrier)."""
    value = os.environ.get("CUFLASH_DECODE_ARRIVE", "").strip().lower()
    if value not in ("", "wrap", "fence", "release"):
        raise ValueError(f"CUFLASH_DECODE_ARRIVE={value!r}: expected wrap, fence or release")
    return value or "fence"


def release_arrival_wanted() -> bool:
    """CUFLASH_DECODE_ARRIVE=release (arrival_mode)."""
    return arrival_mode() == "release"


def page_walk_wanted() -> bool:
    """CUFLASH_DECODE_PAGES: "s9" compiles decode_mma's page walk of sessions 7-9 (a table read
    a tile, one iteration ahead of its copies: A/B runs); unset or "window": a warp's next 32
    pages read at once, a lane a tile, 32 tiles ahead (decode_mma.cu's
    CUFLASH_DECODE_PAGE_WALK)."""
    value = os.environ.get("CUFLASH_DECODE_PAGES", "").strip().lower()
    if value not in ("", "window", "s9"):
        raise ValueError(f"CUFLASH_DECODE_PAGES={value!r}: expected window or s9")
    return value != "s9"


def early_mode() -> str:
    """CUFLASH_DECODE_EARLY: decode_mma's first K/V copies issued before cache_seqlens arrives
    (decode_mma.cu's CUFLASH_DECODE_EARLY_KV: the prologue's copies of a full row's range, n =
    capacity, issued again where the real range differs). "all": every even-split build of a
    dense cache; "one": only grids of one split (their first copies start at key 0 whatever n;
    with several splits a row shorter than the capacity moves every split but the first, whose
    early copies, ~64 KB a block, are then wasted and waited for): the default since session
    12's H200 run (bench/probes/decode_ab.py: 1.000-1.010x session 10's time at the six dense
    points, mean 1.005; "all" was no faster than "one", mean 1.001); "0": none (session 10's
    machine code, for an A/B in one process)."""
    value = os.environ.get("CUFLASH_DECODE_EARLY", "").strip().lower()
    if value not in ("", "all", "one", "0"):
        raise ValueError(f"CUFLASH_DECODE_EARLY={value!r}: expected all, one or 0")
    return value or "one"


def prelude(fused: bool = True, splits: int = 1) -> str:
    """The defines put before decode_mma.cu for this process's A/B switches (by default those
    of session 10's machine code: CUFLASH_DECODE_EARLY=0 and CUFLASH_DECODE_ARRIVE=fence; ""
    compiles session 11's, the builds the compile gate checks); those of the fused merge only for a ``fused`` build
    (the others would compile the same machine code again); the early copies' (early_mode) for
    a grid of ``splits`` even splits (0: the stream grid, whose build issues none either way:
    "0" compiles its machine code of session 10)."""
    out = "" if page_walk_wanted() else "#define CUFLASH_DECODE_PAGE_WALK 0\n"
    if early_mode() == "0" or (early_mode() == "one" and splits > 1):
        out += "#define CUFLASH_DECODE_EARLY_KV 0\n"
    if l2_mode():
        out += f"#define CUFLASH_DECODE_L2 {l2_mode()}\n"
    if fused and not merge_prefetch_wanted():
        out += "#define CUFLASH_DECODE_MERGE_PREFETCH 0\n"
    if fused and arrival_mode() == "release":
        out += "#define CUFLASH_DECODE_RELEASE_ARRIVAL 1\n"
    if fused and arrival_mode() == "fence":
        out += "#define CUFLASH_DECODE_ARRIVE_WRAP 0\n"
    return out


def splits_mode() -> str:
    """CUFLASH_DECODE_SPLITS: decode_sm80's split count where the caller gives none. Unset or
    "balance" (the default): ``balanced_splits``, the count whose busiest SM reads the fewest
    key iterations (B 1, Hq/Hkv 32/8 on an H200: 16 splits, 128 blocks of 64 / 128 iterations at
    64k / 128k, where session 9's heuristic ran 15: 120 blocks of 69 / 137; measured 0.6-1.2%
    faster there as `cuflash_splits16`, session 9 call 3); "s9" the heuristic of sessions 6-9
    (_inference_gpu.num_splits_heuristic: the first count whose last wave is 85% as full as the
    best); "slots" (A/B runs) the groups' keys split evenly over every resident slot, two
    blocks an SM (``slot_grid``: decode_mma's stream build with whole groups a block)."""
    value = os.environ.get("CUFLASH_DECODE_SPLITS", "").strip().lower()
    if value not in ("", "balance", "s9", "slots"):
        raise ValueError(f"CUFLASH_DECODE_SPLITS={value!r}: expected balance, s9 or slots")
    return value or "balance"


def balanced_splits(groups: int, capacity: int, keys_per_iter: int, num_sms: int,
                    most: int) -> int:
    """The split count of ``groups`` (batch rows x KV heads x row tiles) over a cache of
    ``capacity`` keys in one wave of one block an SM (decode_sm80's split_wave) whose blocks
    read the fewest key iterations: the most splits that fit the wave (floor(SMs / groups),
    at most ``most``), then the fewest splits with that many iterations a split (each split is
    a partial to write and merge; a count whose last split would be empty ties with a smaller
    one). 0 where the groups fill more than half the SMs (session 9's heuristic decides
    there). H200, bf16, d 128, Hq 32: Hkv 8 B 1 -> 16 (128 blocks of 64 / 128 iterations at
    64k / 128k, where session 9's 15 ran 120 blocks of 69 / 137), Hkv 32 B 1 -> 4, Hkv 8 B 8
    -> 2 (128 blocks, as before)."""
    iters = max(1, -(-capacity // keys_per_iter))
    if groups <= 0 or 2 * groups > num_sms:
        return 0
    top = max(1, min(most, num_sms // groups))
    per = -(-iters // top)
    return next(s for s in range(1, top + 1) if -(-iters // s) == per)


def slot_grid(groups: int, capacity: int, keys_per_iter: int, num_sms: int,
              min_blocks: int) -> int:
    """CUFLASH_DECODE_SPLITS=slots: a stream grid of k whole groups' worth of blocks, k =
    floor(resident slots / groups), so that no block spans two groups and each group's keys
    are cut into k balanced ranges (floor(j iters / k) boundaries, whole iterations): the
    groups fill (nearly) every one of the num_sms x min_blocks resident slots, two blocks an
    SM at head-dim 128 (128 KB of K/V in flight an SM, as B 64's grids) where the even splits
    of one block an SM leave 4-12 SMs idle and 64 KB in flight each. 0 where it does not
    apply (the groups fill the slots already, k < 2, or fewer than STREAM_MIN_ITERS key
    iterations a block)."""
    slots = num_sms * min_blocks
    iters = max(1, -(-capacity // keys_per_iter))
    if groups <= 0 or groups >= num_sms:
        return 0
    k = slots // groups
    if k < 2 or iters // k < STREAM_MIN_ITERS:
        return 0
    return k * groups


def stream_spans(groups: int, blocks: int) -> tuple[int, int]:
    """(the most blocks one group overlaps: the partials' stride; the most groups one block
    overlaps) in a stream grid of ``blocks`` over ``groups`` (decode_mma.cu: group g is units
    [g blocks, (g + 1) blocks), block i units [i groups, (i + 1) groups))."""
    g = numpy.arange(groups, dtype=numpy.int64)
    i = numpy.arange(blocks, dtype=numpy.int64)
    per_group = ((g + 1) * blocks - 1) // groups - g * blocks // groups + 1
    per_block = ((i + 1) * groups - 1) // blocks - i * groups // blocks + 1
    return int(per_group.max()), int(per_block.max())


def stream_grid(groups: int, splits: int, capacity: int, keys_per_iter: int, iter_bytes: int,
                num_sms: int, split_wave: int, min_blocks: int, mode: str = "1") -> int:
    """decode_mma's stream grid for ``groups`` (batch rows x KV heads x row tiles) whose even
    split count is ``splits``, or 0 to keep the even splits. The even splits leave part of the
    last wave idle where groups x splits is not a multiple of the slots (B = 1, 8 KV heads:
    15 splits of ceil(iters / 15) iterations, 120 blocks on 132 SMs; B = 64: 3.9 waves); the
    stream grid shares the groups' key iterations equally among exactly one wave of blocks:
    one an SM (``split_wave``) while the groups are fewer than the resident slots, else
    ``min_blocks`` an SM (many groups a block; two resident blocks overlap one's ramp with the
    other's stream). Cost model, key iterations of the busiest SM: even, ceil(groups x splits
    / SMs) blocks of ceil(iters / splits); stream, blocks an SM x (the share + one piece's cost
    (STREAM_PIECE_BYTES) for every group past a block's first). ``mode`` "auto": the stream
    grid where the groups fill the resident slots and the share is at least
    STREAM_AUTO_MIN_SHARE iterations (the measured rule); "1": where the cost model finds it
    STREAM_MIN_GAIN cheaper; "all": wherever it applies (A/B runs)."""
    iters = max(1, -(-capacity // keys_per_iter))
    per_sm = min_blocks if groups >= num_sms * min_blocks else split_wave
    blocks = num_sms * per_sm
    share = groups * iters / blocks
    if (mode == "0" or (groups * splits) % blocks == 0 or share < STREAM_MIN_ITERS
            or iters < STREAM_MIN_GROUP_ITERS):
        return 0
    if mode == "all":
        return blocks
    if mode == "auto":
        return blocks if groups >= num_sms * min_blocks and share >= STREAM_AUTO_MIN_SHARE else 0
    even = -(-groups * splits // num_sms) * -(-iters // splits)
    pieces = stream_spans(groups, blocks)[1]
    stream = per_sm * (math.ceil(share) + (pieces - 1) * STREAM_PIECE_BYTES / iter_bytes)
    return blocks if stream <= (1 - STREAM_MIN_GAIN) * even else 0
