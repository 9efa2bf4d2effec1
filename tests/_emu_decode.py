"""Run the inference kernels (cuda_src/decode.cu, decode_mma.cu, combine.cu) on the CPU: their
source, unchanged but for decode.cu's ``extern __shared__`` declaration, compiled with g++
against the host emulation of the CUDA built-ins in tests/emu/ (threads as fibers, shuffles as
warp collectives, shared memory pre-filled with NaN bytes; decode_mma.cu's cp.async, ldmatrix
and mma.sync through tests/_emu_sm80.py's emulation of mma_sm80.cuh, cp.async sources checked
against the arrays registered as readable).

This checks the kernels' logic (split ranges, GQA row packing, paged addressing, the clamps,
the online softmax, the group merge and the combine) without a GPU, launched with the very
parameter block ``cuflash._inference_gpu.DecodeSpec`` builds. It says nothing about speed.
"""

from __future__ import annotations

import ctypes
import shutil
from pathlib import Path

import numpy

from cuflash import _inference_gpu
from cuflash._paths import cuda_src_dir

import _emu_sm80

EMU = Path(__file__).resolve().parent / "emu"

_PRELUDE = r"""
#include "cuda_host.h"
#include <cuda_fp16.h>
#include <cuda_bf16.h>
inline float2 __half22float2(__half2 h) { return {__half2float(h.x), __half2float(h.y)}; }
inline float2 __bfloat1622float2(__nv_bfloat162 h) {
  return {__bfloat162float(h.x), __bfloat162float(h.y)};
}
inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }
inline int __any_sync(unsigned, int pred) {
  ::emu::my_xchg()[0] = pred != 0;
  const int parity = ::emu::warp_sync();
  int any = 0;
  for (int l = 0; l < 32; ++l) any |= int(::emu::lane_xchg(parity, l)[0]);
  return any;
}
// decode_mma.cu's extern __shared__ array (and the buffer every launch runs on)
namespace cuflash { namespace decode { alignas(128) unsigned char smem[::emu::kSmemBytes]; } }
"""

_SMEM_DECL = "extern __shared__ float4 smem_[];"
_SMEM_HOST = "float4* smem_ = reinterpret_cast<float4*>(::emu::st().smem);"


def available() -> bool:
    return shutil.which("g++") is not None and (EMU / "cuda_host.h").exists()


class Library:
    def __init__(self, path: Path, exprs: list[str]):
        self.lib = ctypes.CDLL(str(path))
        self.lib.emu_run.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                                     ctypes.c_uint, ctypes.c_uint]
        self.lib.emu_message.restype = ctypes.c_char_p
        self.lib.emu_readable.argtypes = [ctypes.c_void_p, ctypes.c_ulonglong]
        self.index = {e: i for i, e in enumerate(exprs)}

    def run(self, kernel, params: numpy.ndarray, readable=(), order: int = 0) -> None:
        """Run one ``(source, expr, grid, threads, smem)`` of a DecodeSpec; ``readable``: the
        arrays cp.async may read; ``order``: 0 runs the blocks in blockIdx order, else in an
        order shuffled with that seed (which block of a split group finishes last)."""
        _, expr, grid, threads, smem = kernel
        self.lib.emu_clear_readable()
        for a in readable:
            if a is not None:
                lo, hi = _emu_sm80._span(a)
                self.lib.emu_readable(lo, hi - lo)
        buf = numpy.ascontiguousarray(params).view(numpy.uint8)
        if self.lib.emu_run(self.index[expr], buf.ctypes.data, grid, threads, smem, order):
            raise RuntimeError(f"{expr}: {self.lib.emu_message().decode()}")


def build(exprs: list[str], prelude: str = "") -> Library:
    """g++-compile the kernels ``exprs`` of decode.cu / combine.cu / decode_mma.cu (cached by
    source text); ``prelude``: defines put before decode_mma.cu (its A/B builds, as the plan's
    DecodeSpec.prelude)."""
    src_dir = cuda_src_dir()
    decode = (src_dir / "decode.cu").read_text()
    if _SMEM_DECL not in decode:
        raise RuntimeError("decode.cu's shared-memory declaration changed: update _emu_decode")
    text = (_PRELUDE + decode.replace(_SMEM_DECL, _SMEM_HOST) + (src_dir / "combine.cu").read_text()
            + prelude + (src_dir / "decode_mma.cu").read_text())
    text = _emu_sm80.host_source(text)     # local includes; mma_sm80.cuh -> its emulation
    cases = "\n".join(
        f"    case {i}: body = [&] {{ {e}(P); }}; break;" for i, e in enumerate(exprs))
    text += """
extern "C" int emu_run(int which, const void* params, int grid, int threads, unsigned smem,
                       unsigned order) {
  const auto& P = *static_cast<const cuflash::decode::DecodeParams*>(params);
  std::function<void()> body;
  switch (which) {
%s
    default: return 2;
  }
  std::vector<unsigned> blocks(grid);
  for (int b = 0; b < grid; ++b) blocks[b] = unsigned(b);
  if (order) std::shuffle(blocks.begin(), blocks.end(), std::mt19937(order));
  for (unsigned b : blocks)
    if (!::emu::run_block(threads, {b, 0, 0}, cuflash::decode::smem, smem, body)) return 1;
  return 0;
}
extern "C" const char* emu_message() { return ::emu::st().message; }
extern "C" void emu_readable(const void* lo, unsigned long long n) {
  ::emu::st().readable.push_back({static_cast<const char*>(lo), static_cast<const char*>(lo) + n});
}
extern "C" void emu_clear_readable() { ::emu::st().readable.clear(); }
""" % cases
    so = _emu_sm80.compile_host_library(text, "decode-", [EMU, EMU / "include", src_dir], "decode.cu")
    return Library(so, exprs)


def run_spec(lib: Library, spec, c, order: int = 0, counters=None):
    """Launch a DecodeSpec's kernels on NumPy arrays as the GPU plan does; returns (o, lse).
    ``order``: the split kernel's block order (Library.run); ``counters``: the fused combine's
    arrival counters (spec.groups uint32, 0 between calls: checked), fresh zeros if None."""
    o = numpy.full(spec.out_shape, numpy.nan, c.dtype)
    lse = numpy.full(spec.out_shape[:-1], numpy.nan, numpy.float32)
    o_part = lse_part = None
    if spec.splits > 1:
        o_part = numpy.full(spec.part_rows * c.dv, numpy.nan, numpy.float32)
        lse_part = numpy.full(spec.part_rows, numpy.nan, numpy.float32)
    p = spec.params.copy()
    words = p.reshape(1).view(numpy.uint64)
    for i, value in spec.pointers(c, o, lse, o_part, lse_part):
        words[i] = value
    if spec.fuse:
        if counters is None:
            counters = numpy.zeros(spec.groups, numpy.uint32)
        assert counters.dtype == numpy.uint32 and counters.size == spec.groups
        assert not counters.any(), "the arrival counters must be 0 between calls"
        words[_inference_gpu.COUNTERS_WORD] = counters.ctypes.data
    if spec.append is not None:
        lib.run(spec.append, p)
    if o.size:
        lib.run(spec.split, p, readable=(c.q, c.k_cache, c.v_cache), order=order)
        if spec.fuse:
            assert not counters.any(), "the merging blocks leave the counters at 0"
        if spec.combine is not None:
            lib.run(spec.combine, p)
    return o, lse
