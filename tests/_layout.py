"""One check for every parameter block mirrored in NumPy: NVRTC static_asserts that a C++
struct's sizeof and every field offset equal the NumPy dtype's (no GPU needed)."""

from __future__ import annotations

import numpy
import pytest

from cuflash import _jit


def assert_struct_matches(source: str, namespace: str, struct: str, dtype: numpy.dtype,
                          nested: dict[str, str] | None = None) -> None:
    """``struct`` (in ``namespace``, declared by ``cuda_src/<source>``) has ``dtype``'s size
    and field offsets; ``nested`` maps a field of ``dtype`` to the C++ struct it holds, whose
    offsets are checked too."""
    try:
        nvrtc = _jit._nvrtc_for("sm_80")
    except _jit.KernelCompileError as exc:
        pytest.skip(str(exc))
    checks = []
    for name, dt in [(struct, dtype)] + [(cpp, dtype[field]) for field, cpp in (nested or {}).items()]:
        checks.append(f'static_assert(sizeof({name}) == {dt.itemsize}, "sizeof {name}");')
        checks += [f'static_assert(__builtin_offsetof({name}, {n}) == {off}, "{name}.{n}");'
                   for n, (_, off) in dt.fields.items()]
    opening = "".join(f"namespace {ns} {{ " for ns in namespace.split("::"))
    closing = "}" * len(namespace.split("::"))
    src = (_jit.load_source(source) + f"\n{opening}\n" + "\n".join(checks)
           + f"\n__global__ void layout_probe(const {struct} p) {{}}\n{closing}\n")
    log, lowered, _ = nvrtc.compile(src, "probe.cu", [f"{namespace}::layout_probe"],
                                    _jit._options("sm_80"))
    assert lowered is not None, log[:4000]
