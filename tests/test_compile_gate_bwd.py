"""The compile gate for the tensor-core backward (cuda_src/bwd_sm80.cu): every specialisation
the launcher can select compiles with NVRTC for sm_80 and sm_90a with no spills and no stack
frame, within the 255-register cap, and holds tensor-core instructions (HMMA in the SASS).

``python -m cuflash check`` and tests/test_compile_gate.py cover the families that
``cuflash._launch.all_specialisations`` lists; until it lists bwd_sm80's
(``_launch_bwd.bwd_specialisations(arch)`` has them), this file is their gate.
"""

from __future__ import annotations

import concurrent.futures

import pytest

from cuflash import _jit, _launch_bwd

ARCHS = ("sm_80", "sm_90a")

pytestmark = pytest.mark.slow


def _compile(arch: str) -> list[_jit.CompileReport]:
    return _jit.compile_offline(_launch_bwd.SM80_SOURCE, _launch_bwd.all_bwd_sm80_specialisations(), arch)


@pytest.fixture(scope="module")
def reports() -> dict[str, list[_jit.CompileReport]]:
    with concurrent.futures.ProcessPoolExecutor(2) as pool:
        return dict(zip(ARCHS, pool.map(_compile, ARCHS)))


@pytest.mark.parametrize("arch", ARCHS)
def test_bwd_sm80_compiles_without_spills(reports, arch: str) -> None:
    rs = reports[arch]
    assert len(rs) == len(_launch_bwd.all_bwd_sm80_specialisations()) > 0
    bad = [f"{r.expr}: {r.error or f'{r.spill_stores}/{r.spill_loads} B spilled, {r.stack} B stack'}"
           for r in rs if not r.ok]
    assert not bad, f"{len(bad)} of {len(rs)} specialisations fail on {arch}:\n" + "\n".join(bad[:10])
    assert all(r.registers is not None and 0 < r.registers <= 255 for r in rs)


@pytest.mark.parametrize("arch", ARCHS)
def test_bwd_sm80_uses_tensor_cores(reports, arch: str) -> None:
    for r in reports[arch]:
        assert r.hmma is not None, "nvdisasm is needed to read the SASS"
        assert r.hmma > 0, f"{r.expr} has no HMMA on {arch}"


@pytest.mark.parametrize("arch", ARCHS)
def test_two_blocks_a_sm_where_the_table_asks(reports, arch: str) -> None:
    """__launch_bounds__(threads, min_blocks) held: registers x threads x min_blocks fit 64K."""
    tiles = {_launch_bwd.sm80_expr(dtype, t, c, det): t
             for t in _launch_bwd.BWD_SM80_TILES.values()
             for dtype in _dtypes() for c in (False, True) for det in (False, True)}
    for r in reports[arch]:
        t = tiles[r.expr]
        assert r.registers * t.threads * t.min_blocks <= 65536, (r.expr, r.registers)


def _dtypes():
    import ml_dtypes
    import numpy
    return (numpy.dtype(numpy.float16), numpy.dtype(ml_dtypes.bfloat16))
