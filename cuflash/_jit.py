"""Run-time compilation of the CUDA sources in ``cuda_src/``.

Two ways in:

* :func:`get_kernel` -- compile one template specialisation for the current GPU with
  ``cupy.RawModule`` (NVRTC), memoised per device.  On compute capability 9.0 the target is
  ``sm_90a`` so that Hopper-only instructions are available.
* :func:`compile_offline` -- compile one specialisation for a *named* architecture with no GPU
  present (NVRTC through ``cupy.cuda.nvrtc``) and return what ptxas reports: registers, spill
  bytes, stack frame, static shared memory, and how many tensor-core instructions the SASS
  holds.  :func:`compile_many` runs it over many specialisations on every core;
  ``cuflash._families.check`` gives it every specialisation the dispatcher can select: the
  compile gate of ``python -m cuflash check``.

Local ``#include "x.cuh"`` lines are expanded here, in Python, before the source reaches NVRTC.
CuPy's on-disk kernel cache keys on the source text only, so an included header that changed
would otherwise hit a stale cache entry.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Callable

from ._paths import cuda_src_dir

__all__ = ["KernelCompileError", "CompileReport", "get_kernel", "compile_offline",
           "compile_many", "arch_of_device", "supported_archs"]

_STD = "-std=c++17"
_INCLUDE_RE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.MULTILINE)


class KernelCompileError(RuntimeError):
    """NVRTC rejected a kernel specialisation; the message carries its log."""


# ---------------------------------------------------------------------------------------------
# Source handling
# ---------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def load_source(name: str) -> str:
    """Return ``cuda_src/<name>`` with local ``#include "..."`` lines expanded once each."""
    root = cuda_src_dir()
    seen: set[str] = set()

    def expand(fname: str) -> str:
        if fname in seen:            # every header is '#pragma once'
            return ""
        seen.add(fname)
        text = (root / fname).read_text()
        return _INCLUDE_RE.sub(lambda m: expand(m.group(1)), text)

    return expand(name)


@functools.lru_cache(maxsize=None)
def _cuda_include_dir() -> str | None:
    """Directory holding cuda_fp16.h / cuda_bf16.h, if pip's or the system's CUDA has one."""
    try:
        from cuda import pathfinder
        found = pathfinder.find_nvidia_header_directory("cudart")
    except Exception:  # pathfinder missing or no headers: NVRTC may still find its own
        found = None
    if found is None:
        for cand in ("/usr/local/cuda/include",):
            if Path(cand, "cuda_fp16.h").exists():
                return cand
    return found


def _options(arch: str, extra: tuple[str, ...] = ()) -> tuple[str, ...]:
    opts = [_STD, f"-arch={arch}", "-DCUFLASH_NVRTC=1"]
    inc = _cuda_include_dir()
    if inc:
        opts.append(f"-I{inc}")
    return tuple(opts) + tuple(extra)


def arch_of_device(device_id: int) -> str:
    """The NVRTC target for a device: ``sm_90a`` on Hopper, else ``sm_<major><minor>``."""
    import cupy
    cc = cupy.cuda.Device(device_id).compute_capability  # e.g. "90"
    return "sm_90a" if cc == "90" else f"sm_{cc}"


# ---------------------------------------------------------------------------------------------
# On the GPU: RawModule, one per (device, source, specialisation)
# ---------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def get_kernel(source: str, expr: str, device_id: int, prelude: str = ""):
    """Compile ``expr`` (a C++ name expression, e.g. ``cuflash::fwd_simt<float, 64, false>``)
    from ``cuda_src/<source>`` (after ``prelude``: the structs traced from user functions that
    a Variant names) for device ``device_id`` and return its ``cupy.RawKernel``."""
    import cupy
    with cupy.cuda.Device(device_id):
        arch = arch_of_device(device_id)
        try:
            module = cupy.RawModule(code=prelude + load_source(source), options=_options(arch),
                                    name_expressions=(expr,))
            kernel = module.get_function(expr)
            kernel.compile()  # surface errors here rather than at the first launch
        except cupy.cuda.compiler.CompileException as exc:
            raise KernelCompileError(
                f"NVRTC failed on {expr} from cuda_src/{source} for {arch}:\n{exc.get_message()}"
            ) from None
    return kernel


# ---------------------------------------------------------------------------------------------
# Offline: NVRTC for a named arch, no GPU needed
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class CompileReport:
    """What ptxas said about one specialisation for one architecture."""
    source: str
    expr: str
    arch: str
    registers: int | None = None
    spill_stores: int | None = None
    spill_loads: int | None = None
    stack: int | None = None
    shared: int | None = None       # static shared memory, bytes
    hmma: int | None = None         # HMMA + HGMMA instructions in the SASS (None: not disassembled)
    hgmma: int | None = None        # of which HGMMA (Hopper's wgmma)
    notes: tuple[str, ...] = ()     # ptxas remarks on this entry, e.g. serialised wgmma
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and not self.spill_stores and not self.spill_loads and not self.stack


class _Nvrtc:
    """One libnvrtc, called through ctypes (the offline gate needs no GPU and no CuPy module).

    ``cupy.cuda.nvrtc`` is not used here: its ``getCUBIN`` drops the last byte of the image,
    and it is bound to one NVRTC, while the gate may need two: NVRTC 13 (cupy-cuda13x's) has
    dropped sm_70, which NVRTC 12 (pip's ``nvidia-cuda-nvrtc-cu12``) still compiles.
    """

    def __init__(self, path: str):
        libdir = Path(path).parent
        for builtins in sorted(libdir.glob("libnvrtc-builtins.so.*")):  # NVRTC dlopens it by name
            ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)
            break
        self.lib = lib = ctypes.CDLL(path)
        P, S, C = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p
        lib.nvrtcCreateProgram.argtypes = [ctypes.POINTER(P), C, C, ctypes.c_int, P, P]
        lib.nvrtcAddNameExpression.argtypes = [P, C]
        lib.nvrtcCompileProgram.argtypes = [P, ctypes.c_int, ctypes.POINTER(C)]
        lib.nvrtcGetProgramLogSize.argtypes = [P, ctypes.POINTER(S)]
        lib.nvrtcGetProgramLog.argtypes = [P, C]
        lib.nvrtcGetLoweredName.argtypes = [P, C, ctypes.POINTER(C)]
        lib.nvrtcGetCUBINSize.argtypes = [P, ctypes.POINTER(S)]
        lib.nvrtcGetCUBIN.argtypes = [P, C]
        lib.nvrtcDestroyProgram.argtypes = [ctypes.POINTER(P)]
        n = ctypes.c_int()
        lib.nvrtcGetNumSupportedArchs(ctypes.byref(n))
        archs = (ctypes.c_int * n.value)()
        lib.nvrtcGetSupportedArchs(archs)
        self.archs = frozenset(archs)
        major, minor = ctypes.c_int(), ctypes.c_int()
        lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
        self.version = (major.value, minor.value)

    def _check(self, status: int, what: str) -> None:
        if status != 0:
            raise KernelCompileError(f"{what} failed with NVRTC status {status}")

    def compile(self, src: str, name: str, exprs: list[str], options: tuple[str, ...]):
        """Return ``(log, None, None)`` on a compile error, else ``(log, lowered names, cubin)``."""
        prog = ctypes.c_void_p()
        self._check(self.lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), name.encode(),
                                                0, None, None), "nvrtcCreateProgram")
        try:
            for e in exprs:
                self._check(self.lib.nvrtcAddNameExpression(prog, e.encode()), "nvrtcAddNameExpression")
            opts = (ctypes.c_char_p * len(options))(*(o.encode() for o in options))
            status = self.lib.nvrtcCompileProgram(prog, len(options), opts)
            size = ctypes.c_size_t()
            self.lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            buf = ctypes.create_string_buffer(size.value)
            self.lib.nvrtcGetProgramLog(prog, buf)
            log = buf.value.decode(errors="replace")
            if status != 0:
                return log, None, None
            lowered = {}
            for e in exprs:
                out = ctypes.c_char_p()
                self._check(self.lib.nvrtcGetLoweredName(prog, e.encode(), ctypes.byref(out)),
                            "nvrtcGetLoweredName")
                lowered[e] = out.value.decode()
            self._check(self.lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "nvrtcGetCUBINSize")
            cubin = ctypes.create_string_buffer(size.value)
            self._check(self.lib.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
            return log, lowered, cubin.raw
        finally:
            self.lib.nvrtcDestroyProgram(ctypes.byref(prog))


@functools.lru_cache(maxsize=None)
def _nvrtc_libraries() -> tuple[_Nvrtc, ...]:
    """The NVRTCs found here, newest first: CuPy's (through cuda.pathfinder) and pip's NVRTC 12."""
    paths = []
    try:
        from cuda import pathfinder
        paths.append(pathfinder.load_nvidia_dynamic_lib("nvrtc").abs_path)
    except Exception:  # no NVRTC 13 here
        pass
    try:
        import importlib.util
        spec = importlib.util.find_spec("nvidia.cuda_nvrtc")
        for root in (spec.submodule_search_locations or []) if spec else []:
            paths.extend(str(p) for p in Path(root, "lib").glob("libnvrtc.so.12"))
    except ImportError:
        pass
    libs = []
    for path in paths:
        try:
            libs.append(_Nvrtc(path))
        except OSError:
            continue
    return tuple(libs)


def _nvrtc_for(arch: str) -> _Nvrtc:
    num = int(re.match(r"sm_(\d+)", arch).group(1))
    libs = _nvrtc_libraries()
    for lib in libs:
        if num in lib.archs:
            return lib
    found = ", ".join(f"NVRTC {v[0]}.{v[1]}" for v in (lib.version for lib in libs)) or "none"
    hint = ("; NVRTC 13 dropped sm_70, NVRTC 12 still compiles it: pip install "
            "nvidia-cuda-nvrtc-cu12" if num < 75 else "")
    raise KernelCompileError(f"no NVRTC here compiles for {arch} (found: {found}){hint}")


def supported_archs(archs) -> tuple[list[str], dict[str, str]]:
    """Split ``archs`` into those an NVRTC here can target and the others, with the reason
    each of those is skipped."""
    ok, skipped = [], {}
    for arch in archs:
        try:
            _nvrtc_for(arch)
            ok.append(arch)
        except KernelCompileError as exc:
            skipped[arch] = str(exc)
    return ok, skipped


_PTXAS_FN = re.compile(r"Compiling entry function '(\S+)' for")
_PTXAS_STACK = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_REGS = re.compile(r"Used (\d+) registers")
_PTXAS_SMEM = re.compile(r"(\d+) bytes smem")


def _parse_ptxas(log: str, lowered: str) -> dict:
    """Pick the ptxas lines that belong to the entry ``lowered`` out of an NVRTC log."""
    out: dict = {}
    current = None
    for line in log.splitlines():
        m = _PTXAS_FN.search(line)
        if m:
            current = m.group(1)
            continue
        if current != lowered:
            continue
        if (m := _PTXAS_STACK.search(line)):
            out["stack"], out["spill_stores"], out["spill_loads"] = map(int, m.groups())
        if (m := _PTXAS_REGS.search(line)):
            out["registers"] = int(m.group(1))
            sm = _PTXAS_SMEM.search(line)
            out["shared"] = int(sm.group(1)) if sm else 0
    return out


def sass_sections(cubin: bytes) -> dict[str, str] | None:
    """The SASS of each function in ``cubin``, by mangled name, as nvdisasm prints it (None:
    no nvdisasm here, or one that cannot read this cubin, e.g. nvdisasm 13 and sm_70 code)."""
    try:
        from cuda import pathfinder
        tool = pathfinder.find_nvidia_binary_utility("nvdisasm")
    except Exception:
        tool = None
    tool = tool or shutil.which("nvdisasm")
    if not tool:
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        run = subprocess.run([tool, f.name], capture_output=True, text=True)
    if run.returncode != 0:
        return None
    return {section.split(",", 1)[0]: section
            for section in re.split(r"^\s*\.section\s+\.text\.", run.stdout, flags=re.MULTILINE)[1:]}


def _tensor_core_ops_per_function(cubin: bytes) -> dict[str, tuple[int, int]] | None:
    """(HMMA + HGMMA, HGMMA) instruction counts of each function in ``cubin`` (None: no
    nvdisasm)."""
    sections = sass_sections(cubin)
    if sections is None:
        return None
    return {name: (len(re.findall(r"\b(?:HMMA|HGMMA)\b", text)), len(re.findall(r"\bHGMMA\b", text)))
            for name, text in sections.items()}


def compile_offline(source: str, exprs, arch: str, sass: bool = True) -> list[CompileReport]:
    """Compile the name expressions ``exprs`` from ``cuda_src/<source>`` for ``arch`` (e.g.
    ``"sm_90a"``) with NVRTC, no GPU needed, and report ptxas's resource usage and the
    tensor-core instruction count of each.  One NVRTC program holds them all (the C++ front
    end runs once); if it fails, each is compiled alone so the error lands on its own report.
    ``sass=False`` skips the disassembly (``hmma``/``hgmma`` stay None).
    """
    exprs = [exprs] if isinstance(exprs, str) else list(exprs)
    try:
        nvrtc = _nvrtc_for(arch)
    except KernelCompileError as exc:
        return [CompileReport(source, e, arch, error=str(exc)) for e in exprs]
    log, lowered, cubin = nvrtc.compile(load_source(source), source, exprs,
                                        _options(arch, ("--ptxas-options=-v",)))
    if lowered is None:
        if len(exprs) == 1:
            return [CompileReport(source, exprs[0], arch, error=log.strip())]
        return [r for e in exprs for r in compile_offline(source, [e], arch, sass)]
    tc = _tensor_core_ops_per_function(cubin) if sass else None
    reports = []
    for e in exprs:
        hmma, hgmma = (None, None) if tc is None else tc.get(lowered[e], (0, 0))
        # ptxas names the function in remarks such as "wgmma.mma_async instructions are
        # serialized due to ..." (a wgmma kernel that runs at a fraction of its speed)
        notes = tuple(line.strip() for line in log.splitlines()
                      if lowered[e] in line and "Compiling entry" not in line and "Function properties" not in line)
        reports.append(CompileReport(source, e, arch, hmma=hmma, hgmma=hgmma, notes=notes,
                                     **_parse_ptxas(log, lowered[e])))
    return reports


def compile_many(jobs, progress=None, workers: int | None = None,
                 sass: Callable[[str], bool] | None = None) -> list[CompileReport]:
    """Compile ``jobs``, a list of ``(source, expr, arch)``, each once, and return one report
    per job in the same order. Jobs are grouped into NVRTC programs of a few specialisations of
    one source and arch (the C++ front end runs once a program) and the programs spread over
    ``workers`` processes (default: every core). ``progress(done, total)`` is called as
    specialisations finish. ``sass(source)`` says whether to disassemble a source's cubins
    (default: all)."""
    import concurrent.futures
    import os
    unique = list(dict.fromkeys(jobs))
    groups: dict[tuple[str, str], list[str]] = {}
    for source, expr, arch in unique:
        groups.setdefault((source, arch), []).append(expr)
    workers = workers or os.cpu_count() or 1
    # The C++ front end runs once per NVRTC program and costs seconds on the large sources, so
    # programs hold as many specialisations as balance allows: about four tasks per worker
    # over all groups (a group of one source and arch is split only where it is large).
    chunk = max(4, -(-len(unique) // (4 * workers)))
    tasks = [(source, exprs[i:i + chunk], arch, sass is None or sass(source))
             for (source, arch), exprs in groups.items() for i in range(0, len(exprs), chunk)]
    tasks.sort(key=lambda t: -len(t[1]))        # the largest first, so the last ones are short
    done: dict[tuple[str, str, str], CompileReport] = {}

    def collect(reports):
        for r in reports:
            done[(r.source, r.expr, r.arch)] = r
        if progress is not None:
            progress(len(done), len(unique))

    if workers <= 1 or len(tasks) <= 1:
        for t in tasks:
            collect(compile_offline(*t))
    else:
        with concurrent.futures.ProcessPoolExecutor(min(workers, len(tasks))) as pool:
            for fut in concurrent.futures.as_completed(
                    [pool.submit(compile_offline, *t) for t in tasks]):
                collect(fut.result())
    return [done[j] for j in jobs]
