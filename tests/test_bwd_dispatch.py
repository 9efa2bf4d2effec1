"""Which backward kernel runs, with which tiles (CPU only: ``_launch_bwd.choose`` needs no GPU),
and the launcher's shared-memory formula against the kernel's, through NVRTC."""

from __future__ import annotations

import ml_dtypes
import numpy
import pytest

from cuflash import _jit, _launch_bwd, _problem

BF16 = numpy.dtype(ml_dtypes.bfloat16)
F16 = numpy.dtype(numpy.float16)
H200_OPTIN = 232448        # cudaDevAttrMaxSharedMemoryPerBlockOptin of an H200 (227 KB)
A100_OPTIN = 166912        # 163 KB
RTX_OPTIN = 101376         # sm_86 / sm_89: 99 KB


@pytest.fixture(autouse=True)
def _no_overrides(monkeypatch):
    for name in ("CUFLASH_BWD", "CUFLASH_BWD_SM80_TILES", "CUFLASH_BWD_SM90_TILES",
                 "CUFLASH_GRID_ORDER"):
        monkeypatch.delenv(name, raising=False)


def _choose(dtype, d, dv=None, *, causal=False, det=False, cc=90, optin=H200_OPTIN, Lq=100, Lk=90):
    dv = d if dv is None else dv
    q = numpy.zeros((2, Lq, d), dtype)
    k = numpy.zeros((2, Lk, d), dtype)
    v = numpy.zeros((2, Lk, dv), dtype)
    prob = _problem.make_problem(q, k, v, scale=None, causal=causal)
    return _launch_bwd.choose(prob, det, cc, optin)


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["f16", "bf16"])
@pytest.mark.parametrize("d, dv, bucket", [(1, 1, 32), (32, 32, 32), (40, 40, 64), (64, 32, 64),
                                           (72, 72, 96), (24, 96, 96), (111, 111, 128),
                                           (128, 128, 128)])
@pytest.mark.parametrize("cc, optin", [(80, A100_OPTIN), (90, H200_OPTIN)])
def test_half_types_up_to_d128_take_the_tensor_cores(dtype, d, dv, bucket, cc, optin):
    """bwd_sm80 on sm_80; on Hopper where bwd_sm90 does not run (d <= 32, deterministic)."""
    for causal in (False, True):
        for det in (False, True):
            launch = _choose(dtype, d, dv, causal=causal, det=det, cc=cc, optin=optin)
            if cc == 90 and max(d, dv) > 32 and not det:
                assert launch.source == "bwd_sm90.cu" and launch.tensor_cores and not launch.sm80
                continue
            tiles = _launch_bwd.BWD_SM80_TILES[bucket]
            assert launch.source == "bwd_sm80.cu" and launch.sm80 and launch.tensor_cores
            assert launch.main == _launch_bwd.sm80_expr(dtype, tiles, causal, det)
            assert (launch.block_m, launch.block_n, launch.threads, launch.smem_bytes) == (
                tiles.block_m, tiles.block_n, tiles.threads, tiles.smem_bytes)
            assert launch.dot == _launch_bwd.dot_expr(dtype)


@pytest.mark.parametrize("dtype, d, cc, optin", [
    (numpy.dtype(numpy.float32), 64, 90, H200_OPTIN),   # exact paths
    (numpy.dtype(numpy.float64), 64, 90, H200_OPTIN),
    (BF16, 129, 90, H200_OPTIN),                        # head dims above 128
    (F16, 256, 90, H200_OPTIN),
    (BF16, 64, 75, 65536),                              # no mma.sync m16n8k16 before sm_80
    (BF16, 96, 86, RTX_OPTIN),                          # 113 KB of shared memory: not granted
    (F16, 128, 89, RTX_OPTIN),
])
def test_everything_else_takes_the_generic_kernel(dtype, d, cc, optin):
    launch = _choose(dtype, d, cc=cc, optin=optin)
    assert launch.source == "bwd_simt.cu" and not launch.sm80 and not launch.tensor_cores
    assert launch.main.startswith("cuflash::bwd_simt<")


def test_small_shared_memory_still_takes_the_tensor_cores_where_it_fits():
    assert _choose(BF16, 64, cc=86, optin=RTX_OPTIN).sm80      # 81 KB
    assert _choose(BF16, 32, cc=89, optin=RTX_OPTIN).sm80      # 49 KB


def test_defaults_choose_the_generic_kernel():
    q = numpy.zeros((3, 8, 64), BF16)
    prob = _problem.make_problem(q, q, q, scale=None, causal=False)
    assert _launch_bwd.choose(prob, False).source == "bwd_simt.cu"


@pytest.mark.parametrize("value", ["simt", "SIMT", " simt "])
def test_environment_forces_the_generic_kernel(monkeypatch, value):
    monkeypatch.setenv("CUFLASH_BWD", value)
    assert _choose(BF16, 64).source == "bwd_simt.cu"
    assert not _launch_bwd.uses_sm80(F16, 128, 128, 90, H200_OPTIN)
    assert not _launch_bwd.uses_sm90(F16, 128, 128, 90, H200_OPTIN, False)


@pytest.mark.parametrize("value", ["", "auto", "AUTO"])
def test_environment_auto_is_the_default(monkeypatch, value):
    monkeypatch.setenv("CUFLASH_BWD", value)
    assert _choose(BF16, 64).source == "bwd_sm90.cu"
    assert _choose(BF16, 64, cc=80, optin=A100_OPTIN).source == "bwd_sm80.cu"


def test_environment_sm80_keeps_hopper_on_mma_sync(monkeypatch):
    monkeypatch.setenv("CUFLASH_BWD", "sm80")
    assert _choose(BF16, 128).source == "bwd_sm80.cu"
    assert _choose(BF16, 256).source == "bwd_simt.cu"


def test_use_family_sm80_covers_the_backward():
    """The benchmark's cuflash_sm80 (``_launch.use_family("sm80")``) runs bwd_sm80 too."""
    from cuflash import _launch
    with _launch.use_family("sm80"):
        assert _choose(BF16, 128).source == "bwd_sm80.cu"
    assert _choose(BF16, 128).source == "bwd_sm90.cu"


def test_unknown_environment_value_is_an_error(monkeypatch):
    monkeypatch.setenv("CUFLASH_BWD", "sm90")
    with pytest.raises(ValueError, match="CUFLASH_BWD must be 'auto', 'sm80' or 'simt'.*'sm90'"):
        _choose(BF16, 64)


@pytest.mark.parametrize("d, dv, bucket", [(33, 33, 64), (40, 64, 64), (64, 64, 64), (65, 65, 128),
                                           (24, 96, 128), (111, 111, 128), (128, 128, 128)])
@pytest.mark.parametrize("causal", [False, True])
def test_hopper_takes_bwd_sm90(d, dv, bucket, causal):
    for dtype in (F16, BF16):
        launch = _choose(dtype, d, dv, causal=causal)
        tiles = _launch_bwd.BWD_SM90_TILES[(bucket, causal)]
        assert launch.source == "bwd_sm90.cu"
        assert launch.main == _launch_bwd.sm90_expr(dtype, tiles, causal)
        assert (launch.block_m, launch.block_n, launch.threads, launch.smem_bytes) == (
            tiles.block_m, tiles.block_n, tiles.threads, tiles.smem_bytes)
        assert _launch_bwd.grid_order(launch, causal) == (1 if causal else 0)


def test_hopper_outside_bwd_sm90():
    assert _choose(BF16, 32).source == "bwd_sm80.cu"               # d <= 32: the 64 bucket would waste half
    assert _choose(BF16, 64, det=True).source == "bwd_sm80.cu"     # ordered dQ exists in bwd_sm80 only
    assert _choose(BF16, 160).source == "bwd_simt.cu"
    assert _choose(BF16, 64, cc=89, optin=RTX_OPTIN).source == "bwd_sm80.cu"   # wgmma: sm_90a only
    # the other kernels are always batch-major
    for kw in (dict(det=True), dict(d=160)):
        launch = _choose(BF16, kw.pop("d", 64), causal=True, **kw)
        assert _launch_bwd.grid_order(launch, True) == 0


def test_grid_order_override(monkeypatch):
    monkeypatch.setenv("CUFLASH_GRID_ORDER", "0")
    assert _launch_bwd.grid_order(_choose(BF16, 64, causal=True), True) == 0


def test_sm90_tile_override(monkeypatch):
    monkeypatch.setenv("CUFLASH_BWD_SM90_TILES", "64:64:1:2")
    assert _launch_bwd.sm90_tiles(64, True) == _launch_bwd.BwdSm90Tiles(64, 64, 1, 2)
    assert _launch_bwd.sm90_tiles(128, False) == _launch_bwd.BWD_SM90_TILES[(128, False)]
    assert "bwd_sm90<__nv_bfloat16, 64, 64, 1, 2, cuflash::Variant<false>>" in _choose(BF16, 50).main


def test_tile_override(monkeypatch):
    monkeypatch.setenv("CUFLASH_BWD_SM80_TILES", "128:64:32:8:1,64:64:16:4:2")
    assert _launch_bwd.sm80_tiles(128) == _launch_bwd.BwdSm80Tiles(128, 64, 32, 8, 1)
    assert _launch_bwd.sm80_tiles(64).block_n == 64
    assert _launch_bwd.sm80_tiles(96) == _launch_bwd.BWD_SM80_TILES[96]
    assert "bwd_sm80<__nv_bfloat16, 128, 64, 32, 8, 1, cuflash::Variant<true>, false>" in _choose(
        BF16, 100, causal=True, cc=80, optin=A100_OPTIN).main


def test_grid_geometry():
    launch = _choose(BF16, 64, Lq=129, Lk=257, cc=80, optin=A100_OPTIN)   # 128 keys, 64 queries
    assert launch.num_n_blocks(257) == 3 and launch.num_m_blocks(129) == 3
    launch = _choose(BF16, 64, Lq=129, Lk=257)                            # 128 keys, 128 queries
    assert launch.num_n_blocks(257) == 3 and launch.num_m_blocks(129) == 2


def test_specialisations_per_arch():
    sm80 = _launch_bwd.all_bwd_sm80_specialisations()
    sm90 = _launch_bwd.all_bwd_sm90_specialisations()
    assert len(sm80) == len(set(sm80)) == 2 * len(_launch_bwd.BWD_SM80_TILES) * 4
    assert len(sm90) == len(set(sm90)) == 2 * len(_launch_bwd.BWD_SM90_TILES)
    assert not [e for s, e in _launch_bwd.bwd_specialisations("sm_70") if s not in ("bwd_simt.cu", "bwd_prep.cu")]
    for arch in ("sm_80", "sm_86", "sm_90a"):
        listed = _launch_bwd.bwd_specialisations(arch)
        assert [e for s, e in listed if s == "bwd_sm80.cu"] == sm80
        assert [e for s, e in listed if s == "bwd_sm90.cu"] == (sm90 if arch == "sm_90a" else [])
        assert [e for s, e in listed if s in ("bwd_simt.cu", "bwd_prep.cu")] == _launch_bwd.all_bwd_specialisations()
    # every expression choose() can return (without overrides) is listed
    for dtype in (F16, BF16):
        for d in (8, 40, 64, 80, 128):
            for causal in (False, True):
                for det in (False, True):
                    assert _choose(dtype, d, causal=causal, det=det, cc=80, optin=A100_OPTIN).main in sm80
                    assert _choose(dtype, d, causal=causal, det=det).main in sm80 + sm90


def test_smem_bytes_match_the_kernel():
    """BwdSm80Tiles.smem_bytes == BwdSm80Traits::kSmemBytes for every table entry (NVRTC
    static_asserts; the kernel also traps on a launch with less)."""
    try:
        nvrtc = _jit._nvrtc_for("sm_80")
    except _jit.KernelCompileError as exc:
        pytest.skip(str(exc))
    checks = [f"static_assert(BwdSm80Traits<__half, {t.head_dim}, {t.block_m}, {t.sub_m}, "
              f"{t.warps}, {t.min_blocks}>::kSmemBytes == {t.smem_bytes}, \"{t}\");"
              for t in _launch_bwd.BWD_SM80_TILES.values()]
    src = (_jit.load_source("bwd_sm80.cu") + "\nnamespace cuflash {\n" + "\n".join(checks)
           + "\n__global__ void probe() {}\n}\n")
    log, lowered, _ = nvrtc.compile(src, "probe.cu", ["cuflash::probe"], _jit._options("sm_80"))
    assert lowered is not None, log


def test_sm90_smem_bytes_match_the_kernel():
    """BwdSm90Tiles.smem_bytes == BwdSm90Traits::kSmemBytes for every table entry."""
    try:
        nvrtc = _jit._nvrtc_for("sm_90a")
    except _jit.KernelCompileError as exc:
        pytest.skip(str(exc))
    checks = [f"static_assert(sm90::BwdSm90Traits<__half, {t.head_dim}, {t.block_m}, {t.warpgroups}, "
              f"{t.min_blocks}>::kSmemBytes == {t.smem_bytes}, \"{t}\");"
              for t in _launch_bwd.BWD_SM90_TILES.values()]
    src = (_jit.load_source("bwd_sm90.cu") + "\nnamespace cuflash {\n" + "\n".join(checks)
           + "\n__global__ void probe() {}\n}\n")
    log, lowered, _ = nvrtc.compile(src, "probe.cu", ["cuflash::probe"], _jit._options("sm_90a"))
    assert lowered is not None, log
