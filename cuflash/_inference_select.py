"""The decode families' ``select`` and ``instances`` (registry records "decode_sm80" and
"decode" in ``cuflash/_families.py``), kept here so that the registry module stays small.
Imports nothing from the registry: it only reads the traits tables."""

from __future__ import annotations

from . import _traits


# -- decode (helper "inference"): Shape.Lq is the packed query rows of a block's KV head
#    (G query heads x Lq queries), Shape.Lk the cache capacity
def decode_select(fam, shape, dev):
    if shape.d % 8 or shape.dv % 8:
        return f"reads rows in 8-element chunks: d={shape.d} and dv={shape.dv} must be multiples of 8"
    bucket = next(b for b in (32, 64, 128, 256) if b >= shape.dmax)
    rows = next(r for r in (1, 2, 4, 8) if r >= min(shape.Lq, 8))
    t = _traits.TABLES[fam.name][(bucket, rows)]
    tiles = -(-shape.Lq // rows)
    return t, {"fuse": False}, [f"{t.reason}" + (f"; {tiles} row tiles (each reads the keys again)"
                                    if tiles > 1 else "")]


def decode_instances(fam, arch):
    for t in _traits.TABLES[fam.name].values():
        yield t, {}


# -- decode_sm80 (helper "inference"): the tensor-core decode; Shape.Lq = packed rows, any
#    number (tiles of 16); the caller (cuflash/_inference_gpu.py) keeps paged caches whose page
#    size is not a multiple of 16 on "decode"
def decode_sm80_select(fam, shape, dev):
    if shape.d % 8 or shape.dv % 8:
        return f"copies rows in 8-element chunks: d={shape.d} and dv={shape.dv} must be multiples of 8"
    t = _traits.TABLES[fam.name][64 if shape.dmax <= 64 else 128]
    if t.smem_bytes > dev.smem_optin:
        return f"needs {t.smem_bytes} B of shared memory a block, the device has {dev.smem_optin}"
    tiles = -(-shape.Lq // 16)
    # fuse: the splits merged by the kernel's last block of a group; stream: ", true" for the
    # flattened key ranges (decode_mma's STREAM build, a fuse build), "" for even splits (the
    # expression of the builds from before the flag); stages: ", S" for a deep ring (then
    # stream is ", false" or ", true"), "" for 3 stages. All set by the caller
    # (_inference_gpu.spec_or_reason), which knows the split count and the grid
    return t, {"fuse": False, "stream": "", "stages": ""}, [t.reason + (f"; {tiles} row tiles (each reads the keys again)" if tiles > 1 else "")]


def decode_fuse_instances(fam, arch):
    """Each traits entry without and with the fused combine (the ``fuse`` flag: FUSE in
    decode_mma.cu and decode.cu), both selectable (num_splits 1 or more)."""
    for t in _traits.TABLES[fam.name].values():
        for fuse in (False, True):
            yield t, {"fuse": fuse}


def decode_sm80_instances(fam, arch):
    """decode_fuse_instances, plus the STREAM build (fuse and stream: the flattened key ranges
    of _inference_gpu.stream_grid) of the head-dim bucket 128 (_inference_gpu.STREAM_HEAD_DIM:
    at 64, 4 blocks an SM cap the registers at 128 and the stream build spills on sm_80), and
    at 128 each of those with every deep ring (_traits.DECODE_SM80_DEEP_STAGES: grids of at
    most one block an SM)."""
    for t in _traits.TABLES[fam.name].values():
        for fuse, stream in ((False, ""), (True, ""), (True, ", true")):
            if not stream or t.head_dim == 128:
                yield t, {"fuse": fuse, "stream": stream, "stages": ""}
        if t.head_dim == DEEP_HEAD_DIM:
            for stages in _traits.DECODE_SM80_DEEP_STAGES:
                for fuse, stream in ((False, ", false"), (True, ", false"), (True, ", true")):
                    yield t, {"fuse": fuse, "stream": stream, "stages": f", {stages}"}


#: the head-dim bucket with deep-ring builds (decode_mma.cu's STAGES > 3; issue 11's decode
#: targets are d = 128; at 64 a deep ring is untried)
DEEP_HEAD_DIM = 128
