"""The compile gate, in CI: every specialisation the dispatcher can select compiles with NVRTC
for sm_70 (the generic kernel only), sm_80 and sm_90a, with no spills and no stack frame, and
the tensor-core kernels really hold tensor-core instructions (HMMA in the SASS).

No GPU is needed: NVRTC and the CUDA headers come from pip (see setup.cfg's ``test`` extra).
"""

from __future__ import annotations

import concurrent.futures

import pytest

from cuflash import _jit, _launch

ARCHS = ("sm_70", "sm_80", "sm_90a")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reports() -> dict[str, list[_jit.CompileReport]]:
    # one process per architecture: ptxas dominates, and CI has two cores
    with concurrent.futures.ProcessPoolExecutor(2) as pool:
        return dict(zip(ARCHS, pool.map(_jit.check_all, [[a] for a in ARCHS])))


def test_dispatcher_lists_every_family() -> None:
    sources = {s for s, _ in _launch.all_specialisations("sm_90a")}
    assert {"fwd_simt.cu", "fwd_sm80.cu", "fwd_sm90.cu", "bwd_simt.cu", "bwd_sm80.cu",
            "bwd_sm90.cu"} <= sources
    # sm_70 gets the generic kernels only: mma.sync m16n8k16 needs sm_80, wgmma sm_90a
    assert ({s for s, _ in _launch.all_specialisations("sm_70")}
            == sources - {"fwd_sm80.cu", "fwd_sm90.cu", "bwd_sm80.cu", "bwd_sm90.cu"})
    assert not {"fwd_sm90.cu", "bwd_sm90.cu"} & {s for s, _ in _launch.all_specialisations("sm_80")}


def test_wgmma_header_is_generated() -> None:
    """cuda_src/wgmma_sm90.cuh is what tools/gen_wgmma_sm90.py writes (no hand edits)."""
    import pathlib
    import subprocess
    import sys
    root = pathlib.Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, str(root / "tools" / "gen_wgmma_sm90.py"), "--check"],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


@pytest.mark.parametrize("arch", ARCHS)
def test_compiles_without_spills(reports, arch: str) -> None:
    rs = reports[arch]
    assert len(rs) == len(_launch.all_specialisations(arch))
    bad = [f"{r.expr}: {r.error or f'{r.spill_stores}/{r.spill_loads} B spilled, {r.stack} B stack'}"
           for r in rs if not r.ok]
    assert not bad, f"{len(bad)} of {len(rs)} specialisations fail on {arch}:\n" + "\n".join(bad[:10])
    assert all(r.registers is not None and 0 < r.registers <= 255 for r in rs)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_tensor_core_kernels_use_tensor_cores(reports, arch: str) -> None:
    for r in reports[arch]:
        assert r.hmma is not None, "nvdisasm is needed to read the SASS"
        if r.source in ("fwd_sm80.cu", "bwd_sm80.cu"):
            assert r.hmma > 0, f"{r.expr} has no HMMA on {arch}"
        elif r.source in ("fwd_sm90.cu", "bwd_sm90.cu"):
            assert r.hgmma > 0, f"{r.expr} has no HGMMA on {arch}"
            assert not [n for n in r.notes if "serializ" in n], f"{r.expr}: {r.notes}"
        elif r.source == "fwd_simt.cu":
            assert r.hmma == 0, f"{r.expr} should be plain FMA code"
