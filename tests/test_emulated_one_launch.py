"""The device pieces of the one-launch backward (bwd_sm90's ONE_LAUNCH builds: cuflash/_plan_one.py)
in the g++ host emulation (tests/_emu_sm80.py; blocks run one after another, a block's threads
as fibers): ``bwd_io::block_row_dots`` (D = rowsum(dO o O) of a block's query rows) against
NumPy, and ``bwd_io::finish_dq_at_end``'s REZERO (the block that completes a query tile of dQ
rounds it, then leaves its float32 accumulator and arrival counter at 0) over two launches on
one workspace. bwd_sm90 itself needs wgmma (sm_90a), which the emulation does not have; these
are the parts of it the one-launch build adds."""

from __future__ import annotations

import math

import ml_dtypes
import numpy
import pytest

import _emu_sm80 as emu
from _inputs import make_array
from cuflash import _problem

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not emu.available(), reason="g++ is needed for the emulation")]

BF16 = numpy.dtype(ml_dtypes.bfloat16)
F16 = numpy.dtype(numpy.float16)

#: test kernels over the family's own headers (bwd_sm80.cu includes bwd_io.cuh); 256 threads
KERNELS = r"""
#include "bwd_sm80.cu"
namespace cuflash {
// block b: D of rows [num_m_blocks, Lq) of batch item b (num_m_blocks: the first row here)
template <typename T, int HEAD_DIM>
__global__ void emu_row_dots(const Params p) {
  bwd_io::block_row_dots<T, HEAD_DIM, 256>(p, int(blockIdx.x), p.num_m_blocks, p.Lq);
}
// block i = (item b, key tile n) of nbatch x num_n_blocks: adds n + 1 to every dQ accumulator
// element of item b, then arrives at the item's counters as bwd_sm90's ONE_LAUNCH build does
template <typename T, int BLOCK_M>
__global__ void emu_finish_rezero(const Params p) {
  const int b = int(blockIdx.x) / p.num_n_blocks, n = int(blockIdx.x) % p.num_n_blocks;
  float* const acc = reinterpret_cast<float*>(p.dq_acc) + (long long)b * p.Lq * p.d;
  for (long long e = threadIdx.x; e < (long long)p.Lq * p.d; e += 256) atomicAdd(acc + e, float(n + 1));
  bwd_io::finish_dq_at_end<T, BLOCK_M, 256, true>(p, b, reinterpret_cast<int*>(smem));
}
}  // namespace cuflash
"""
CT = {BF16: "__nv_bfloat16", F16: "__half"}


@pytest.fixture(scope="module")
def lib():
    kernels = [("bwd", f"cuflash::emu_row_dots<{CT[t]}, {h}>") for t in (BF16, F16)
               for h in (64, 128)]
    kernels += [("bwd", f"cuflash::emu_finish_rezero<{CT[t]}, 64>") for t in (BF16, F16)]
    return emu.build("bwd_sm80.cu", kernels, kernel_text=KERNELS)


@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "f16"])
@pytest.mark.parametrize("Lq, dv, head_dim, first", [(300, 64, 64, 0), (77, 72, 128, 5),
                                                     (64, 128, 128, 0), (1, 8, 64, 0)])
def test_block_row_dots(lib, dtype, Lq, dv, head_dim, first):
    """Every row from ``first`` on gets rowsum(dO o O) in float32; rows before it and the
    rest of the buffer are not written."""
    rng = numpy.random.default_rng(Lq + dv)
    shape = (2, 3, Lq, dv)
    o, do = (make_array(rng, shape, dtype) for _ in range(2))
    q = make_array(rng, (2, 3, Lq, dv), dtype)
    prob = _problem.make_problem(q, q, q, scale=None, causal=False)
    D = numpy.full(shape[:-1], numpy.nan, numpy.float32)
    p, nbatch = emu.pack_params(prob, {"o": o, "dout": do}, num_m_blocks=first, dpsum=D)
    lib.launch("bwd", f"cuflash::emu_row_dots<{CT[dtype]}, {head_dim}>", p, nbatch, 256, 0)
    want = (o.astype(numpy.float32) * do.astype(numpy.float32)).sum(-1)
    numpy.testing.assert_allclose(D[..., first:], want[..., first:], rtol=1e-5, atol=1e-5)
    assert numpy.isnan(D[..., :first]).all()


@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "f16"])
def test_finish_rezero_leaves_the_workspace_zeroed(lib, dtype):
    """Two launches on one workspace (zeroed once): each rounds dQ = sum over the key tiles of
    (n + 1) into dq, and leaves dq_acc and the counters at 0 for the next."""
    Lq, d, nbatch_shape, n_blocks, block_m = 200, 40, (2, 3), 5, 64
    q = numpy.zeros(nbatch_shape + (Lq, d), dtype)
    prob = _problem.make_problem(q, q, q, scale=None, causal=False)
    m_blocks = -(-Lq // block_m)
    acc = numpy.zeros(nbatch_shape + (Lq, d), numpy.float32)
    sem = numpy.zeros(math.prod(nbatch_shape) * m_blocks, numpy.uint32)
    for _ in range(2):
        dq = numpy.full(nbatch_shape + (Lq, d), numpy.nan, dtype)
        p, nbatch = emu.pack_params(prob, {"q": q}, num_m_blocks=m_blocks,
                                    num_n_blocks=n_blocks, dq_acc=acc, dq_sem=sem)
        p["dq"] = dq.ctypes.data
        lib.launch("bwd", f"cuflash::emu_finish_rezero<{CT[dtype]}, {block_m}>", p,
                   nbatch * n_blocks, 256, 4096)
        assert (dq.astype(numpy.float32) == n_blocks * (n_blocks + 1) / 2).all()
        assert not acc.any() and not sem.any()
