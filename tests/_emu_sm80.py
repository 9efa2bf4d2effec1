"""Run the sm_80 tensor-core kernels on the CPU: their C++ source, unchanged, compiled with g++
against a host emulation of the CUDA built-ins they use (tests/emu/, see cuda_host.h there).

The kernels' warp-level instructions (ldmatrix, mma.sync, cp.async) are emulated from the PTX
ISA's fragment tables; everything else (tiling, swizzled addressing, masks, the query/key
walk, the semaphore ordering of ``deterministic=True``, every index) is the kernel's own code.
So this checks a kernel's logic without a GPU; it says nothing about speed, registers or the
GPU memory model. ``fwd_sm80`` (measured correct on the GPU) also runs here, as a check of the
emulation itself.

Needs g++ (C++17, ``_Float16``); :func:`available` says whether it is here.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import math
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy

from cuflash import _launch, _modifier_params, _modifiers, _problem, _traits
from cuflash._families import FAMILIES
from cuflash._paths import cuda_src_dir
from cuflash._traits import Traits
from cuflash._variant import Variant, variant_params

EMU = Path(__file__).resolve().parent / "emu"
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.MULTILINE)
#: headers replaced by their host emulation
_HOST_HEADERS = {"mma_sm80.cuh": "mma_sm80_host.cuh", "sm80_ops.cuh": "sm80_ops_host.cuh"}


def available() -> bool:
    return shutil.which("g++") is not None


#: what mma_sm80_host.cuh emulates; every other top-level definition of mma_sm80.cuh is used
#: verbatim (SwizzledTile, the tile I/O helpers, ...)
_EMULATED = {"smem_u32", "cp_async_16", "cp_async_commit", "cp_async_wait", "ldmatrix_x4",
             "ldmatrix_x4_trans", "Mma", "pack2", "ex2_approx", "rcp_approx", "tanh_approx"}
_ST_SHARED = re.compile(r'asm volatile\("st\.shared\.b32 \[%0\], %1;\\n" ::"r"\((\w+)\), "r"\((\w+)\)\);')


def _top_level_items(body: str) -> list[tuple[str, str]]:
    """(name, text) of each top-level declaration or definition in a namespace body: a tiny
    scanner that skips comments and string literals and matches braces."""
    items, i, n = [], 0, len(body)
    start, depth, head = None, 0, None
    while i < n:
        c = body[i]
        if body.startswith("//", i):
            i = body.find("\n", i)
            i = n if i < 0 else i
            continue
        if body.startswith("/*", i):
            i = body.index("*/", i) + 2
            continue
        if c == '"' or c == "'":
            j = i + 1
            while body[j] != c:
                j += 2 if body[j] == "\\" else 1
            i = j + 1
            continue
        if depth == 0 and start is None:
            if c.isspace():
                i += 1
                continue
            if c == "#":   # preprocessor line at namespace level
                i = body.find("\n", i)
                i = n if i < 0 else i
                continue
            start = i
        if c == "{":
            if depth == 0:
                head = body[start:i]
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                j = i + 1
                while j < n and body[j] in " \t":
                    j += 1
                if j < n and body[j] == ";":
                    i = j
                items.append((_name_of(head), body[start:i + 1]))
                start, head = None, None
        elif c == ";" and depth == 0 and start is not None:
            items.append((_name_of(body[start:i]), body[start:i + 1]))
            start = None
        i += 1
    return items


def _name_of(head: str) -> str:
    head = re.sub(r"^\s*template\s*<[^{;]*?>\s*(?=(struct|class|__device__|__host__|inline|static|constexpr|\w))", "", head)
    m = re.search(r"\b(?:struct|class)\s+(\w+)", head)
    if m:
        return m.group(1)
    m = re.search(r"(\w+)\s*(?:<[^()]*>)?\s*\(", head)
    return m.group(1) if m else head.strip()


def _splice(header: str) -> str:
    """mma_sm80.cuh's definitions that the host header does not emulate, verbatim, with the
    inline-asm shared stores turned into calls of the emulation."""
    a = header.index("namespace cuflash {") + len("namespace cuflash {")
    b = header.rindex("}  // namespace cuflash")
    out = []
    for name, text in _top_level_items(header[a:b]):
        if name in _EMULATED:
            continue
        text = _ST_SHARED.sub(r"::cuflash::emu_detail::st_shared_b32(\1, \2);", text)
        if re.search(r"\basm\b", text):
            # inline asm the emulation does not know: left out, so a kernel that uses it fails
            # to build here, naming it (add its emulation to tests/emu/mma_sm80_host.cuh)
            out.append(f"// {name}: inline asm not emulated (tests/emu/mma_sm80_host.cuh)")
            continue
        out.append(text)
    return "\n\n".join(out)


def host_source(kernel_text: str, headers: dict[str, str] | None = None) -> str:
    """The kernel source with its local includes expanded, the sm_80 wrappers replaced by the
    host emulation. ``headers`` overrides cuda_src/ files by name (e.g. an older version)."""
    headers = headers or {}
    read = lambda name: headers.get(name) or (cuda_src_dir() / name).read_text()  # noqa: E731
    seen: set[str] = set()

    def expand(text: str) -> str:
        def sub(m):
            name = m.group(1)
            if name in seen:
                return ""
            seen.add(name)
            if name in _HOST_HEADERS:
                host = (EMU / _HOST_HEADERS[name]).read_text()
                if name == "mma_sm80.cuh":
                    host = host.replace("// @@SPLICE@@", _splice(read(name)))
                return expand(host)
            if (EMU / name).exists():   # cuda_host.h
                return expand((EMU / name).read_text())
            return expand(read(name))
        return _INCLUDE.sub(sub, text)

    return expand(kernel_text)


_PRELUDE = """#include "cuda_host.h"
namespace cuflash { alignas(128) unsigned char smem[::emu::kSmemBytes]; }
"""


def _entry_points(kernels: list[tuple[str, str]]) -> str:
    """extern "C" launchers: kernels are (kind, name expression). Kinds 'bwd' and 'fwd' take
    one cuflash::Params; 'dot' (bwd_dot_do_o) and 'finish' (bwd_finish_dq) take the argument
    blocks ``cuflash._plan_aux`` packs (DOT_ARGS, FINISH_ARGS), read at their offsets."""
    from cuflash import _plan_aux
    dot_zero = _plan_aux.DOT_OFFSETS[1]
    f_dq, f_n, f_parts = _plan_aux.FINISH_OFFSETS[1:]
    cases = []
    for i, (kind, expr) in enumerate(kernels):
        if kind == "dot":
            call = (f"{expr}(*static_cast<const cuflash::Params*>(params), "
                    f"*reinterpret_cast<const long long*>(a + {dot_zero}));")
        elif kind == "finish":
            call = (f"call_finish(&{expr}, *reinterpret_cast<void* const*>(a), "
                    f"*reinterpret_cast<void* const*>(a + {f_dq}), "
                    f"*reinterpret_cast<const long long*>(a + {f_n}), "
                    f"*reinterpret_cast<const int*>(a + {f_parts}));")
        else:
            call = f"{expr}(*static_cast<const cuflash::Params*>(params));"
        cases.append(f"    case {i}: body = [=] {{ {call} }}; break;")
    return """
template <typename A, typename O>
static void call_finish(void (*f)(const A*, O*, long long, int), void* partial, void* dq,
                        long long n, int parts) {
  f(static_cast<const A*>(partial), static_cast<O*>(dq), n, parts);
}
extern "C" int emu_launch(int which, const void* params, int grid, int threads, unsigned smem_bytes) {
  std::function<void()> body;
  const char* const a = static_cast<const char*>(params);
  (void)a;
  switch (which) {
%s
    default: return 2;
  }
  ::emu::st().ngrid = unsigned(grid);
  for (int b = 0; b < grid; ++b)
    if (!::emu::run_block(threads, {unsigned(b), 0, 0}, cuflash::smem, smem_bytes, body)) return 1;
  return 0;
}
extern "C" const char* emu_message() { return ::emu::st().message; }
extern "C" void emu_readable(const void* lo, unsigned long long n) {
  ::emu::st().readable.push_back({static_cast<const char*>(lo), static_cast<const char*>(lo) + n});
}
extern "C" void emu_clear_readable() { ::emu::st().readable.clear(); }
extern "C" void emu_watch(const void* lo, unsigned long long n, int eager) {
  ::emu::st().watched.clear();
  if (n) ::emu::st().watched.push_back({static_cast<const char*>(lo), static_cast<const char*>(lo) + n});
  ::emu::st().watched_copies = 0;
  ::emu::st().eager = eager != 0;
}
extern "C" long emu_watched() { return ::emu::st().watched_copies; }
""" % "\n".join(cases)


class Library:
    """One g++-built shared library holding some kernel specialisations."""

    def __init__(self, path: Path, kernels: list[tuple[str, str]]):
        self.lib = ctypes.CDLL(str(path))
        self.lib.emu_launch.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                                        ctypes.c_uint]
        self.lib.emu_message.restype = ctypes.c_char_p
        self.lib.emu_readable.argtypes = [ctypes.c_void_p, ctypes.c_ulonglong]
        self.lib.emu_watch.argtypes = [ctypes.c_void_p, ctypes.c_ulonglong, ctypes.c_int]
        self.lib.emu_watched.restype = ctypes.c_long
        self.index = {k: i for i, k in enumerate(kernels)}
        #: the launches' cp.async copies of data from the array ``watch`` (16 bytes each)
        self.watched_copies = 0

    def launch(self, kind: str, expr: str, params: numpy.ndarray, grid: int, threads: int,
               smem_bytes: int, readable=(), watch=None, eager=False) -> None:
        """Run the grid. ``watch``: an array whose cp.async copies are counted (into
        ``watched_copies``); ``eager``: copies land when issued, not at their wait."""
        self.lib.emu_clear_readable()
        for a in readable:
            lo, hi = _span(a)
            self.lib.emu_readable(lo, hi - lo)
        lo, hi = _span(watch) if watch is not None else (0, 0)
        self.lib.emu_watch(lo, hi - lo, int(eager))
        buf = numpy.ascontiguousarray(params).view(numpy.uint8)
        rc = self.lib.emu_launch(self.index[(kind, expr)], buf.ctypes.data, grid, threads, smem_bytes)
        self.watched_copies = self.lib.emu_watched()
        self.lib.emu_watch(0, 0, 0)
        if rc:
            raise RuntimeError(f"{expr}: {self.lib.emu_message().decode()}")


def _span(a: numpy.ndarray) -> tuple[int, int]:
    """Byte range of the allocation under ``a`` (a padded copy's padding included)."""
    while isinstance(a.base, numpy.ndarray):
        a = a.base
    lo = a.ctypes.data + sum(min(0, s * (n - 1)) for n, s in zip(a.shape, a.strides))
    hi = a.ctypes.data + sum(max(0, s * (n - 1)) for n, s in zip(a.shape, a.strides)) + a.itemsize
    return lo, hi


def build(source_name: str, kernels: list[tuple[str, str]], kernel_text: str | None = None,
          headers: dict[str, str] | None = None) -> Library:
    """Compile ``kernels`` of ``cuda_src/<source_name>`` (or ``kernel_text``) for the host;
    cached on disk by the source text."""
    text = kernel_text if kernel_text is not None else (cuda_src_dir() / source_name).read_text()
    src = host_source(_PRELUDE + text, headers) + _entry_points(kernels)
    return Library(compile_host_library(src, "", [EMU / "include"], source_name), kernels)


def compile_host_library(src: str, prefix: str, includes, what: str) -> Path:
    """The shared library g++ makes of ``src``, cached in the temp directory by the text.
    Safe when several test processes (pytest -n) want the same one at once: each compiles to
    names of its own and the finished library is moved into place in one step."""
    key = hashlib.sha256(src.encode()).hexdigest()[:20]
    cache = Path(tempfile.gettempdir()) / "cuflash-emu"
    cache.mkdir(exist_ok=True)
    so = cache / f"{prefix}{key}.so"
    if not so.exists():
        mine = f"{prefix}{key}.{os.getpid()}"
        cpp = cache / f"{mine}.cpp"
        cpp.write_text(src)
        cmd = ["g++", "-std=c++17", "-O1", "-g0", "-shared", "-fPIC", "-w",
               *(f"-I{i}" for i in includes), str(cpp), "-o", str(cache / f"{mine}.so")]
        run = subprocess.run(cmd, capture_output=True, text=True)
        cpp.unlink()
        if run.returncode:
            raise RuntimeError(f"g++ failed on {what}:\n{run.stderr[:5000]}")
        os.replace(cache / f"{mine}.so", so)
    return so


# ---------------------------------------------------------------------------------------------
# The parameter block: cuflash's own packer (_launch.pack), pointers set to the host arrays
# ---------------------------------------------------------------------------------------------

def _causal_of(prob):
    """The lists' causal offset as ``_plan_mods.ModifierPatch`` chooses it (its switch)."""
    from cuflash._plan_mods import _causal_kinds
    return prob.causal_offset if prob.causal and _causal_kinds() else None


def pack_params(prob, strided: dict, *, num_m_blocks=0, num_n_blocks=0, mods=None,
                list_tiles=None, **buffers):
    """(cuflash::Params as a NumPy scalar, nbatch) for one launch over NumPy arrays: the strided
    tensors ``strided`` (names q, k, v, o, dout), packed by ``cuflash._launch.pack`` as the GPU
    launcher packs them, and the pointers of the host arrays (the contiguous ``buffers``: lse,
    dpsum, dq_acc, dk_acc, dv_acc, dq_sem; None = 0). ``mods`` (a ``Modifiers`` record over
    NumPy arrays, slopes and sinks in float32) fills ``Params.mod`` as ``_plan`` does, with
    their arrays' batch strides from the same merged layout; a block mask's tile lists are
    built for ``list_tiles`` = (m, n, sub, causal offset or None), the kernel's tiles (``_plan_mods.set_tiles``)."""
    names = [n for n in _modifier_params.POINTER_FIELDS
             if mods is not None and getattr(mods, n) is not None]
    extra = [getattr(mods, n) for n in names]
    lists = None
    if mods is not None and mods.block_mask is not None:   # as _plan does, on the host
        from cuflash._block_mask import host_lists
        tl = host_lists(mods.block_mask, *list_tiles)
        lists = (tl, numpy.broadcast_to(tl.data, prob.batch_shape + tl.data.shape[-1:]))
        extra.append(lists[1])
    layout = _launch.batch_layout(prob.batch_shape, list(strided.values()) + extra)
    if len(layout.outer) > 1:
        raise ValueError("the emulation launches one grid: at most 4 merged batch dims")
    p = _launch.pack(prob, strided, layout, variant_params(prob), num_m_blocks=num_m_blocks,
                     num_n_blocks=num_n_blocks)
    if mods is not None:
        strides = {id(x): st for x, st in zip(extra, layout.strides[len(strided):])}
        from cuflash._variant import traces_of
        score, mask = traces_of(mods)
        p["mod"] = _modifier_params.pack(mods, pointer=lambda x: x.ctypes.data,
                                         batch_strides=lambda x: strides[id(x)],
                                         score_trace=score, mask_trace=mask,
                                         block_lists=lists)
    for name, t in strided.items():
        p[name] = t.ctypes.data
    for name, buf in buffers.items():
        p[name] = 0 if buf is None else buf.ctypes.data
    return p, layout.inner_n


def sm80_expr(dtype, tiles: Traits, causal: bool, deterministic: bool) -> str:
    """The registry's spelling of one bwd_sm80 specialisation."""
    return FAMILIES["bwd_sm80"].expr(dtype, tiles, Variant(bool(causal)),
                                     deterministic=deterministic)


def sm80_tiles(d: int, dv: int) -> Traits:
    return _traits.BWD_SM80[max(32, -(-max(d, dv) // 32) * 32)]


# ---------------------------------------------------------------------------------------------
# The backward, launched as cuflash._plan.BackwardPlan launches it
# ---------------------------------------------------------------------------------------------

def sm80_ready(x: numpy.ndarray) -> numpy.ndarray:
    """``x``, or (as ``_launch.tensor_core_input`` does on the GPU) a contiguous copy of its
    un-broadcast extent with the head dim zero-padded to a multiple of 8, broadcast back."""
    st = _launch.elem_strides(x)
    d = x.shape[-1]
    if not (d % 8 or st[-1] != 1 or x.ctypes.data % 16
            or any(s % 8 for n, s in zip(x.shape[:-1], st[:-1]) if n > 1)):
        return x
    core = x[tuple(slice(0, 1) if (s == 0 and n > 1) else slice(None)
                   for n, s in zip(x.shape[:-2], x.strides[:-2]))]
    d8 = -(-d // 8) * 8
    buf = numpy.zeros(core.shape[:-1] + (d8,), dtype=x.dtype)
    buf[..., :d] = core
    return numpy.broadcast_to(buf[..., :d], x.shape)


def bwd_sm80(lib: Library, do, q, k, v, o, lse, *, scale=None, causal=False,
             deterministic=False, tiles: Traits | None = None, expr: str | None = None,
             eager=False, grid_order=0, **modifiers):
    """dq, dk, dv of bwd_sm80 (run in the emulation) for NumPy inputs, summed over broadcast
    dimensions and rounded to the inputs' dtype, as ``cuflash.attention_backward`` returns
    them (then dbias, dsink with those modifiers, as the GPU plan finishes them). ``o`` and
    ``lse`` are the forward's (any source); ``expr`` / ``tiles`` the specialisation (the
    registry's choice on an A100 by default). ``eager``: cp.async copies land when issued;
    ``lib.watched_copies`` counts the copies of Q's data the kernel made. ``grid_order``:
    Params.grid_order (common.cuh grid_tile; the GPU plan passes bwd_sm80 0)."""
    prob = _problem.make_problem(q, k, v, scale=scale, causal=causal)
    mods = modifiers_of(prob, **modifiers)
    shapes = (q.shape, k.shape, v.shape)
    if expr is None:
        from cuflash._families import PROFILES, Shape, choose
        choice = choose("bwd", Shape.of(prob, deterministic, mods), PROFILES["a100"])
        tiles, expr = choice.traits, choice.expr
    tiles = tiles or sm80_tiles(prob.d, prob.dv)
    Lq, Lk, d, dv = prob.Lq, prob.Lk, prob.d, prob.dv
    nbatch = math.prod(prob.batch_shape)
    num_n_blocks = -(-Lk // tiles.block_n)
    num_m_blocks = -(-Lq // tiles.block_m)

    q, k, v, do = (sm80_ready(numpy.broadcast_to(x, x.shape)) for x in (prob.q, prob.k, prob.v, do))
    lse = numpy.ascontiguousarray(numpy.broadcast_to(lse, prob.batch_shape + (Lq,)), numpy.float32)
    # line 4 (bwd_dot_do_o): D = rowsum(dO o O) in float32, 0 for a dead row
    D = (do.astype(numpy.float32) * o.astype(numpy.float32)).sum(-1, dtype=numpy.float32)
    D = numpy.ascontiguousarray(numpy.where(lse == -numpy.inf, 0, D), numpy.float32)
    dq_acc = numpy.zeros(prob.batch_shape + (Lq, d), numpy.float32)
    dk_acc = numpy.full(prob.batch_shape + (Lk, d), numpy.nan, numpy.float32)   # poisoned:
    dv_acc = numpy.full(prob.batch_shape + (Lk, dv), numpy.nan, numpy.float32)  # all written?
    semaphore = numpy.zeros(nbatch * num_m_blocks, numpy.int32)
    dbias_acc = None
    if mods is not None and mods.bias is not None:
        # as the GPU plan: zeroed, or (every pair written, _plan_mods.dbias_plan) poisoned with NaN
        from cuflash._plan_mods import dbias_plan as _dbias_plan
        from cuflash._variant import variant_of
        full = _dbias_plan(variant_of(prob, mods), mods, prob, True)[0]
        dbias_acc = numpy.full(prob.batch_shape + (Lq, Lk), numpy.nan if full else 0.0,
                               numpy.float32)

    p, _ = pack_params(prob, {"q": q, "k": k, "v": v, "o": o, "dout": do},
                       num_m_blocks=num_m_blocks, num_n_blocks=num_n_blocks,
                       lse=lse, dpsum=D, dq_acc=dq_acc, dk_acc=dk_acc, dv_acc=dv_acc,
                       dq_sem=semaphore if deterministic else None, mods=mods,
                       list_tiles=(tiles.block_m, tiles.block_n, tiles.block_m, _causal_of(prob)))
    if dbias_acc is not None:
        p["mod"]["dbias"] = dbias_acc.ctypes.data
    p["grid_order"] = grid_order
    lib.launch("bwd", expr, p, nbatch * num_n_blocks, tiles.threads, tiles.smem_bytes,
               readable=(q, k, v, do), watch=q, eager=eager)
    if deterministic:   # each query tile's counter: one increment per key tile visiting it
        visits = numpy.zeros((nbatch, num_m_blocks), numpy.int32)
        # (a block mask: only the (query tile, key tile) pairs its map does not call empty)
        seen = numpy.ones((nbatch, num_m_blocks, num_n_blocks), bool)
        if mods is not None and mods.block_mask is not None:
            seen = numpy.broadcast_to(mods.block_mask.tile_kinds(tiles.block_m, tiles.block_n) != 0,
                                      prob.batch_shape + seen.shape[1:]).reshape(seen.shape)
        window = mods.window if mods is not None else None
        diag = Lk - Lq
        for n in range(num_n_blocks):
            n0, n1 = n * tiles.block_n, (n + 1) * tiles.block_n
            lo = max(0, n0 - prob.causal_offset) if prob.causal else 0
            hi = Lq
            if window is not None and window[1] is not None:
                lo = max(lo, n0 - diag - window[1])
            if window is not None and window[0] is not None:
                hi = min(hi, max(0, n1 - diag + window[0]))
            first = lo // tiles.block_m
            last = -(-hi // tiles.block_m)
            visits[:, first:last] += seen[:, first:last, n]
        counts = semaphore.reshape(nbatch, num_m_blocks)
        assert (counts == visits).all(), (counts, visits)
    grads = tuple(_problem.sum_to_shape(x, shape, prob.dtype)
                  for x, shape in zip((dq_acc, dk_acc, dv_acc), shapes))
    if mods is not None and mods.bias is not None:
        grads += (_problem.sum_to_shape(dbias_acc, mods.bias_shape, mods.bias_dtype),)
    if mods is not None and mods.sink is not None:
        with numpy.errstate(all="ignore"):
            w = numpy.exp(mods.sink[..., None].astype(numpy.float32) - lse)
        w = numpy.where(D == 0, 0, w)
        grads += (_problem.sum_to_shape(-(w * D).sum(-1), mods.sink_shape, mods.sink_dtype),)
    return grads


# ---------------------------------------------------------------------------------------------
# The forward (the emulation's own check: fwd_sm80 is measured correct on the GPU)
# ---------------------------------------------------------------------------------------------

def modifiers_of(prob, **modifiers):
    """The validated ``Modifiers`` record of NumPy modifier keywords, with alibi_slopes and sink
    in float32 as the GPU plan hands them to the kernels (None when there are none)."""
    if not modifiers:
        return None
    mods = _modifiers.check_modifiers(xp=numpy, device_id=None, batch_shape=prob.batch_shape,
                                      Lq=prob.Lq, Lk=prob.Lk, **modifiers)
    import dataclasses
    return dataclasses.replace(mods, **{n: _modifier_params.per_item_acc(getattr(mods, n))
                                        for n in ("alibi_slopes", "sink")})


def fwd_sm80(lib: Library, expr: str, q, k, v, *, block_m: int, threads: int, smem_bytes: int,
             causal=False, eager=False, block_n: int | None = None, grid_order=0,
             **modifiers):
    """o, lse of one fwd_sm80 specialisation for C-contiguous NumPy inputs (d % 8 == 0), with
    any built-in modifier keywords (``expr`` must be compiled for them; ``block_n``, its key
    tile, with a block mask). ``eager``: cp.async
    copies land when issued; ``lib.watched_copies`` counts the copies of K's data the kernel
    made. ``grid_order``: Params.grid_order (common.cuh grid_tile)."""
    prob = _problem.make_problem(q, k, v, scale=None, causal=causal)
    o = numpy.full(prob.batch_shape + (prob.Lq, prob.dv), numpy.nan, prob.dtype)
    lse = numpy.full(prob.batch_shape + (prob.Lq,), numpy.nan, numpy.float32)
    num_m_blocks = -(-prob.Lq // block_m)
    p, nbatch = pack_params(prob, {"q": prob.q, "k": prob.k, "v": prob.v, "o": o},
                            num_m_blocks=num_m_blocks, lse=lse, mods=modifiers_of(prob, **modifiers),
                            list_tiles=(block_m, block_n, block_m // (threads // 32), _causal_of(prob)))
    p["grid_order"] = grid_order
    lib.launch("fwd", expr, p, nbatch * num_m_blocks, threads, smem_bytes,
               readable=(prob.q, prob.k, prob.v), watch=prob.k, eager=eager)
    return o, lse
