"""The compile gate, in CI: the specialisations the dispatcher can select compile with NVRTC
for sm_70 (the generic families only), sm_80 and sm_90a, with no spills and no stack frame, and
the tensor-core families really hold tensor-core instructions (HMMA / HGMMA in the SASS).

No GPU is needed: NVRTC and the CUDA headers come from pip (see setup.cfg's ``test`` extra).
The specialisations come from the registry: by default its covering set (cuflash/_gate.py: each
tile configuration with each Variant and flag, every element type and arch paired with every
option; 258 of 1,033), so that CI's two cores finish in about a minute; ``CUFLASH_GATE=all`` compiles
every one, as ``python -m cuflash check`` does (bench/gpu_run.sh runs that on the GPU machine).
Each is compiled once, the work spread over every core (``_jit.compile_many``).
"""

from __future__ import annotations

import os

import pytest

from cuflash import _families, _jit

ARCHS = ("sm_70", "sm_80", "sm_90a")
SUBSET = os.environ.get("CUFLASH_GATE", "covering")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reports() -> dict[str, list[_jit.CompileReport]]:
    out: dict[str, list[_jit.CompileReport]] = {a: [] for a in ARCHS}
    for r in _families.check(ARCHS, subset=SUBSET):
        out[r.arch].append(r)
    return out


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
    assert len(rs) == len(_families.specialisations(arch, SUBSET)) > 0
    bad = [f"{r.expr}: {r.error or f'{r.spill_stores}/{r.spill_loads} B spilled, {r.stack} B stack'}"
           for r in rs if not r.ok]
    assert not bad, f"{len(bad)} of {len(rs)} specialisations fail on {arch}:\n" + "\n".join(bad[:10])
    assert all(r.registers is not None and 0 < r.registers <= 255 for r in rs)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_tensor_core_families_use_tensor_cores(reports, arch: str) -> None:
    for r in reports[arch]:
        if r.source not in ("fwd_sm80.cu", "bwd_sm80.cu", "fwd_sm90.cu", "bwd_sm90.cu",
                            "fwd_simt.cu"):
            continue                    # helper kernels: the gate does not disassemble them
        assert r.hmma is not None, "nvdisasm is needed to read the SASS"
        if r.source in ("fwd_sm80.cu", "bwd_sm80.cu"):
            assert r.hmma > 0, f"{r.expr} has no HMMA on {arch}"
        elif r.source in ("fwd_sm90.cu", "bwd_sm90.cu"):
            assert r.hgmma > 0, f"{r.expr} has no HGMMA on {arch}"
            assert not [n for n in r.notes if "serializ" in n], f"{r.expr}: {r.notes}"
        elif r.source == "fwd_simt.cu":
            assert r.hmma == 0, f"{r.expr} should be plain FMA code"
