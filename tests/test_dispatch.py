"""Which kernel the launcher picks (CPU only: cuflash._launch.choose needs no GPU)."""

from __future__ import annotations

import ml_dtypes
import numpy
import pytest

from cuflash import _launch, _problem

BF16 = numpy.dtype(ml_dtypes.bfloat16)
H200_SMS = 132


def _choose(shape_q, shape_k, dtype=BF16, *, d=128, dv=None, causal=False, cc=90):
    dv = d if dv is None else dv
    q = numpy.zeros(shape_q + (d,), dtype)
    k = numpy.zeros(shape_k + (d,), dtype)
    v = numpy.zeros(shape_k + (dv,), dtype)
    prob = _problem.make_problem(q, k, v, scale=None, causal=causal)
    nbatch = int(numpy.prod(prob.batch_shape))
    return _launch.choose(prob, nbatch, cc, H200_SMS)


@pytest.fixture(autouse=True)
def _no_overrides(monkeypatch):
    for var in ("CUFLASH_FWD", "CUFLASH_SM80_TILES", "CUFLASH_SM90_TILES"):
        monkeypatch.delenv(var, raising=False)
    _launch._tile_override.cache_clear()
    _launch._sm90_override.cache_clear()


@pytest.mark.parametrize("dtype", [BF16, numpy.dtype(numpy.float16)])
@pytest.mark.parametrize("d, bucket", [(33, 64), (64, 64), (72, 128), (128, 128), (129, 192), (256, 256)])
def test_hopper_takes_wgmma_kernel(dtype, d, bucket):
    launch = _choose((4, 16, 1024), (4, 16, 1024), dtype, d=d)
    assert launch.source == "fwd_sm90.cu"
    assert f"fwd_sm90<{_launch._ctype(dtype)}, {bucket}," in launch.expr
    tiles = _launch.sm90_tiles(bucket)
    assert launch.block_m == tiles.block_m and launch.threads == tiles.threads
    assert launch.smem_bytes == tiles.smem_bytes <= 227 * 1024


def test_small_head_dim_and_other_gpus_take_mma_sync():
    assert _choose((4, 16, 1024), (4, 16, 1024), d=32).source == "fwd_sm80.cu"
    assert _choose((4, 16, 1024), (4, 16, 1024), cc=80).source == "fwd_sm80.cu"
    assert _choose((4, 16, 1024), (4, 16, 1024), cc=89).source == "fwd_sm80.cu"
    assert _choose((4, 16, 1024), (4, 16, 1024), cc=75).source == "fwd_simt.cu"


@pytest.mark.parametrize("dtype", [numpy.float32, numpy.float64])
def test_exact_dtypes_stay_on_simt(dtype):
    assert _choose((2, 4, 256), (2, 4, 256), numpy.dtype(dtype)).source == "fwd_simt.cu"


def test_env_keeps_hopper_on_sm80(monkeypatch):
    monkeypatch.setenv("CUFLASH_FWD", "sm80")
    assert _choose((4, 16, 1024), (4, 16, 1024)).source == "fwd_sm80.cu"
    monkeypatch.setenv("CUFLASH_FWD", "bogus")
    with pytest.raises(ValueError, match="CUFLASH_FWD='bogus'"):
        _choose((4, 16, 1024), (4, 16, 1024))


def test_even_only_for_whole_key_tiles():
    assert _choose((4, 16, 1024), (4, 16, 1024)).expr.endswith("true>")
    assert _choose((4, 16, 1000), (4, 16, 1024)).expr.endswith("true>")    # Q rows: always checked
    assert _choose((4, 16, 1024), (4, 16, 1000)).expr.endswith("false>")
    assert _choose((4, 16, 1024), (4, 16, 1024), d=120).expr.endswith("false>")   # padded bucket


def test_small_grids_use_fewer_warpgroups():
    """Few (batch, Q-tile) blocks: smaller blocks, so that all SMs get work."""
    big = _choose((16, 16, 1024), (16, 16, 1024))
    small = _choose((1, 2, 1024), (1, 2, 1024))
    assert small.source == big.source == "fwd_sm90.cu"
    assert small.block_m == 64 < big.block_m
    # the number of blocks never shrinks below what the big tiles would give
    assert 2 * -(-1024 // small.block_m) >= 2 * -(-1024 // big.block_m)


def test_every_table_entry_is_compiled_by_the_gate():
    exprs = {e for s, e in _launch.all_specialisations("sm_90a") if s == "fwd_sm90.cu"}
    for bucket in _launch.SM90_TILES:
        for causal in (False, True):
            t = _launch.sm90_tiles(bucket)
            for w in range(1, t.warpgroups + 1):
                for even in (False, True):
                    import dataclasses
                    expr = _launch.sm90_expr(BF16, dataclasses.replace(t, warpgroups=w), causal, even)
                    assert expr in exprs


def test_grid_order(monkeypatch):
    """Tile-major (heaviest Q tiles of every batch item first) for causal tensor-core grids."""
    causal = _choose((4, 16, 1024), (4, 16, 1024), causal=True)
    plain = _choose((4, 16, 1024), (4, 16, 1024))
    simt = _choose((4, 16, 256), (4, 16, 256), numpy.dtype(numpy.float32), causal=True)
    assert _launch.grid_order(causal, True) == _launch.CAUSAL_GRID_ORDER == 1
    assert _launch.grid_order(plain, False) == 0
    assert _launch.grid_order(simt, True) == 0       # fwd_simt maps blocks its own way
    monkeypatch.setenv("CUFLASH_GRID_ORDER", "0")
    assert _launch.grid_order(causal, True) == 0
