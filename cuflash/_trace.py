"""Tracing ``score_mod`` / ``mask_mod`` into a CUDA ``__device__`` function.

The user function is called once with symbolic scalars (:class:`Sym`) for its arguments. They
implement the Python operators and NumPy's ``__array_ufunc__`` / ``__array_function__``, so
``score * 2``, ``np.tanh(score)``, ``np.where(q_idx >= kv_idx, score, -np.inf)`` and
``doc[b, q_idx] == doc[b, kv_idx]`` (``doc`` a :func:`cuflash.captured` array) build a graph of
:class:`Sym` nodes instead of computing. The graph is the trace; ``_trace_cuda`` prints it as
C++ and this module also evaluates it on NumPy arrays (:meth:`Trace.evaluate`, with the
kernel's arithmetic: scores in the accumulation type, int32 indices) and differentiates it with respect to
``score`` by forward mode (:meth:`Trace.evaluate_derivative`; the CUDA ``dscore`` is the same
rules printed).

Types: ``f`` (the kernel's accumulation type on the GPU: float32, float64 for float64 inputs),
``i`` (int32: the indices), ``l`` (int64: int64 or uint32
captured values, Python ints beyond int32), ``b`` (bool). Python numbers are weak: ``score * 2``
stays in the score's type, ``q_idx + 1`` stays int32. Two bools are not added (NumPy would OR them).

Constants in the closure become literals: a function that reads a float ``c`` traces to a
source holding ``c``'s value (exactly, rounded to float32 by the compiler where the kernel
computes in float32), so a new ``c`` is a new source (and a new compiled
variant, cached like any other). Anything not listed in ``UFUNCS`` / ``FUNCTIONS`` / the
operators raises ``TypeError`` at trace time, naming the operation and the function, as do
Python control flow on a traced value (``if``, ``and``, ``or``: use ``np.where``, ``&``, ``|``)
and indexing a plain array with a traced index (wrap it with ``cuflash.captured``).
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
import threading
from typing import Any, Callable

import numpy

from cuflash._captured import Captured

#: Most captured arrays one user function may read (the kernels' VariantParams hold 4)
MAX_CAPTURED = 4

_state = threading.local()


def _where_am_i() -> str:
    return getattr(_state, "what", "a traced function")


def _unsupported(what: str) -> TypeError:
    return TypeError(f"{what} is not supported in {_where_am_i()} (traced for the GPU); "
                     f"supported: + - * / // % **, comparisons, & | ^ ~, "
                     f"{', '.join('np.' + n for n in sorted(set(UFUNCS) | set(FUNCTIONS)))}, "
                     f"and captured-array indexing")


class Sym:
    """A symbolic scalar: one node of the trace. ``op`` names the operation, ``args`` its
    operands (Sym), ``kind`` its type (``f``, ``i``, ``l``, ``b``), ``value`` a constant's value
    or an input's name, ``cap`` a load's (slot, Captured)."""

    __slots__ = ("op", "args", "kind", "value", "cap", "has_d")
    __array_priority__ = 1000

    def __init__(self, op: str, args: tuple = (), kind: str = "f", value: Any = None,
                 cap: Any = None):
        self.op, self.args, self.kind, self.value, self.cap = op, args, kind, value, cap
        # does the node depend on the score (so it has a derivative)?
        self.has_d = (op == "input" and value == "score") or any(a.has_d for a in args)

    def __repr__(self) -> str:
        return f"Sym({self.op}, kind={self.kind})"

    # -- operators ------------------------------------------------------------------------
    def __add__(self, o): return _binary("add", self, o)
    def __radd__(self, o): return _binary("add", o, self)
    def __sub__(self, o): return _binary("subtract", self, o)
    def __rsub__(self, o): return _binary("subtract", o, self)
    def __mul__(self, o): return _binary("multiply", self, o)
    def __rmul__(self, o): return _binary("multiply", o, self)
    def __truediv__(self, o): return _binary("true_divide", self, o)
    def __rtruediv__(self, o): return _binary("true_divide", o, self)
    def __floordiv__(self, o): return _binary("floor_divide", self, o)
    def __rfloordiv__(self, o): return _binary("floor_divide", o, self)
    def __mod__(self, o): return _binary("remainder", self, o)
    def __rmod__(self, o): return _binary("remainder", o, self)
    def __pow__(self, o): return _binary("power", self, o)
    def __rpow__(self, o): return _binary("power", o, self)
    def __lt__(self, o): return _binary("less", self, o)
    def __le__(self, o): return _binary("less_equal", self, o)
    def __gt__(self, o): return _binary("greater", self, o)
    def __ge__(self, o): return _binary("greater_equal", self, o)
    def __eq__(self, o): return _binary("equal", self, o)        # noqa: E704
    def __ne__(self, o): return _binary("not_equal", self, o)
    def __and__(self, o): return _binary("bitwise_and", self, o)
    def __rand__(self, o): return _binary("bitwise_and", o, self)
    def __or__(self, o): return _binary("bitwise_or", self, o)
    def __ror__(self, o): return _binary("bitwise_or", o, self)
    def __xor__(self, o): return _binary("bitwise_xor", self, o)
    def __rxor__(self, o): return _binary("bitwise_xor", o, self)
    def __invert__(self): return _unary("invert", self)
    def __neg__(self): return _unary("negative", self)
    def __pos__(self): return self
    def __abs__(self): return _unary("absolute", self)
    __hash__ = object.__hash__

    def __bool__(self):
        raise _unsupported("Python control flow on a traced value (if / and / or / not; use "
                           "np.where, &, |, ~)")

    def __index__(self):
        raise _unsupported("indexing a plain array with a traced index (wrap the array with "
                           "cuflash.captured)")

    def __float__(self):
        raise _unsupported("float() of a traced value")

    def __int__(self):
        raise _unsupported("int() of a traced value")

    def __len__(self):
        raise _unsupported("len() of a traced value (it is a scalar)")

    def __iter__(self):
        raise _unsupported("iterating over a traced value (it is a scalar)")

    def __getitem__(self, item):
        raise _unsupported("indexing a traced value (it is a scalar)")

    def __getattr__(self, name):
        if name.startswith("__"):          # protocol lookups (NumPy's __array__ and the like)
            raise AttributeError(name)
        raise _unsupported(f"the attribute .{name} of a traced value")

    # -- NumPy protocols ------------------------------------------------------------------
    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        if method != "__call__" or kwargs:
            raise _unsupported(f"numpy.{ufunc.__name__}.{method} with {sorted(kwargs)}")
        name = ufunc.__name__
        if name in UFUNCS:
            return UFUNCS[name](*inputs)
        raise _unsupported(f"numpy.{name}")

    def __array_function__(self, func, types, args, kwargs):
        name = func.__name__
        if name in FUNCTIONS and not kwargs:
            return FUNCTIONS[name](*args)
        raise _unsupported(f"numpy.{name}" + (f" with keywords {sorted(kwargs)}" if kwargs
                                              else ""))


# ---------------------------------------------------------------------------------------------
# Building nodes
# ---------------------------------------------------------------------------------------------

INT32 = (-2 ** 31, 2 ** 31 - 1)


def const(x: Any) -> Sym:
    """A Python or NumPy scalar as a constant node (weak types: see the module docstring)."""
    if isinstance(x, Sym):
        return x
    if isinstance(x, (bool, numpy.bool_)):
        return Sym("const", kind="b", value=bool(x))
    if isinstance(x, numbers.Integral):
        v = int(x)
        if INT32[0] <= v <= INT32[1]:
            return Sym("const", kind="i", value=v)
        if -2 ** 63 <= v < 2 ** 63:
            return Sym("const", kind="l", value=v)
        raise _unsupported(f"the integer constant {v} (beyond int64)")
    if isinstance(x, numbers.Real):     # kept exact; float32 where it is printed for the GPU
        return Sym("const", kind="f", value=float(x))
    if isinstance(x, numpy.ndarray) and x.ndim == 0:
        return const(x[()])
    if isinstance(x, (numpy.ndarray, list, tuple)):
        raise _unsupported(f"an array constant of type {type(x).__qualname__} (wrap arrays "
                           f"the function reads with cuflash.captured)")
    raise _unsupported(f"an operand of type {type(x).__module__}.{type(x).__qualname__}")


_RANK = {"b": 0, "i": 1, "l": 2, "f": 3}


def _promote(*kinds: str) -> str:
    return max(kinds, key=_RANK.__getitem__)


def _to(x: Sym, kind: str) -> Sym:
    """``x`` converted to ``kind`` (only ever to a wider kind: b < i < l < f)."""
    if x.kind == kind:
        return x
    if x.op == "const":                     # fold: a literal of the wider kind
        value = float(x.value) if kind == "f" else int(x.value)
        return Sym("const", kind=kind, value=value)
    return Sym("cast", (x,), kind)


ARITH = {"add", "subtract", "multiply", "true_divide", "floor_divide", "remainder", "power",
         "minimum", "maximum", "fmin", "fmax"}
COMPARE = {"less", "less_equal", "greater", "greater_equal", "equal", "not_equal"}
LOGICAL = {"bitwise_and", "bitwise_or", "bitwise_xor", "logical_and", "logical_or",
           "logical_xor"}
FLOAT_UNARY = {"tanh", "exp", "log", "sqrt", "exp2", "log2", "log1p", "expm1", "sin", "cos",
               "floor", "ceil", "trunc", "rint", "square"}


def _binary(op: str, a: Any, b: Any) -> Sym:
    a, b = const(a), const(b)
    if op in ARITH:
        if a.kind == b.kind == "b":
            raise _unsupported(f"numpy.{op} of two bools")
        kind = "f" if op == "true_divide" else _promote(a.kind, b.kind, "i")
        if op == "power" and kind != "f" and b.op == "const" and b.value < 0:
            raise _unsupported("an integer to a negative integer power")
    elif op in COMPARE:
        kind = _promote(a.kind, b.kind)
        return Sym(op, (_to(a, kind), _to(b, kind)), "b")
    elif op in LOGICAL:
        if op.startswith("logical"):       # operands as truth values, then & | ^ on bools
            a = a if a.kind == "b" else _binary("not_equal", a, 0)
            b = b if b.kind == "b" else _binary("not_equal", b, 0)
            op, kind = "bitwise" + op[len("logical"):], "b"
        else:
            kind = _promote(a.kind, b.kind)
            if kind == "f":
                raise _unsupported(f"numpy.{op} (& | ^) on floats")
    else:
        raise _unsupported(f"numpy.{op}")
    return Sym(op, (_to(a, kind), _to(b, kind)), kind)


def _unary(op: str, a: Any) -> Sym:
    a = const(a)
    if op in FLOAT_UNARY:
        return Sym(op, (_to(a, "f"),), "f")
    if op == "invert" and a.kind == "f":
        raise _unsupported("~ on a float")
    if op == "logical_not":
        return Sym("invert", (a if a.kind == "b" else _binary("not_equal", a, 0),), "b")
    if op == "negative" and a.kind == "b":
        raise _unsupported("negating a bool")
    if op in ("isnan", "isinf", "isfinite"):
        return Sym(op, (_to(a, "f"),), "b")
    return Sym(op, (a,), a.kind)


def where(c: Any, x: Any, y: Any) -> Sym:
    c, x, y = const(c), const(x), const(y)
    if c.kind != "b":
        c = _binary("not_equal", c, 0)
    kind = _promote(x.kind, y.kind)
    return Sym("where", (c, _to(x, kind), _to(y, kind)), kind)


def clip(x: Any, lo: Any, hi: Any) -> Sym:
    return _binary("minimum", _binary("maximum", x, lo), hi)


def load(cap: Captured, index: tuple) -> Sym:
    """A read of ``cap[index]`` (clamped on the GPU); records the array in this trace."""
    caps = _state.caps
    slot = next((n for n, c in enumerate(caps) if c is cap), None)
    if slot is None:
        if len(caps) >= MAX_CAPTURED:
            raise _unsupported(f"reading more than {MAX_CAPTURED} captured arrays")
        caps.append(cap)
        slot = len(caps) - 1
    kind = captured_kind(cap.dtype)
    idx = []
    for i in index:
        i = const(i)
        if i.kind not in ("i", "l"):
            raise _unsupported(f"indexing a captured array with a {i.kind!r} value (indices "
                               f"are integers)")
        idx.append(_to(i, "l"))
    return Sym("load", tuple(idx), kind, value=str(cap.dtype), cap=slot)


def captured_kind(dtype: numpy.dtype) -> str:
    """The trace type a captured array's values have on the GPU."""
    dtype = numpy.dtype(dtype)
    if dtype == numpy.bool_:
        return "b"
    if dtype in (numpy.dtype(numpy.float32), numpy.dtype(numpy.float64)):
        return "f"
    if dtype.kind == "i" and dtype.itemsize <= 4 or dtype.kind == "u" and dtype.itemsize <= 2:
        return "i"
    if dtype in (numpy.dtype(numpy.int64), numpy.dtype(numpy.uint32)):
        return "l"
    raise _unsupported(f"a captured array of dtype {dtype} (use bool, int8-int64, uint8-uint32, "
                       f"float32 or float64)")


UFUNCS: dict[str, Callable] = {
    **{n: (lambda n: lambda a, b: _binary(n, a, b))(n) for n in ARITH | COMPARE | LOGICAL},
    **{n: (lambda n: lambda a: _unary(n, a))(n) for n in FLOAT_UNARY},
    **{n: (lambda n: lambda a: _unary(n, a))(n)
       for n in ("negative", "absolute", "invert", "logical_not", "isnan", "isinf",
                 "isfinite")},
    "positive": lambda a: const(a),
}
UFUNCS["divide"] = UFUNCS["true_divide"]
FUNCTIONS: dict[str, Callable] = {"where": where, "clip": clip}


# ---------------------------------------------------------------------------------------------
# Tracing a function
# ---------------------------------------------------------------------------------------------

def describe(fn: Callable) -> str:
    name = getattr(fn, "__qualname__", None) or repr(fn)
    code = getattr(fn, "__code__", None)
    where_ = f" ({code.co_filename}:{code.co_firstlineno})" if code is not None else ""
    return f"{name}{where_}"


@dataclasses.dataclass(frozen=True, eq=False)
class Trace:
    """A traced user function: its output node, the captured arrays it reads (in slot order,
    the order of their pointers in the kernel's parameters), and its CUDA source."""

    role: str                 # "score_mod" or "mask_mod"
    fn_name: str
    output: Sym
    captures: tuple[Captured, ...]

    # (struct_name and source are computed once a trace: a trace never changes, and the
    # name, a hash of the generated C++, is part of every modifier call's plan key: generating
    # it again cost ~40% of such a call's host time, bench/probes/mods_host.py)
    @functools.cached_property
    def struct_name(self) -> str:
        from cuflash import _trace_cuda
        return _trace_cuda.struct_name(self)

    @functools.cached_property
    def source(self) -> str:
        """The C++ of the struct the Variant receives (``apply``, and ``dscore`` for a
        score_mod), preceded by the shared prelude (guarded, so several may be included)."""
        from cuflash import _trace_cuda
        return _trace_cuda.source(self)

    def evaluate(self, score=None, b=0, h=0, q_idx=0, kv_idx=0) -> numpy.ndarray:
        """The traced function on NumPy arrays with the kernel's arithmetic (floats in
        ``score``'s dtype: float32 is what the GPU computes for float16, bfloat16 and float32
        inputs, float64 for float64; captured indices clamped)."""
        from cuflash import _trace_eval
        return _trace_eval.evaluate(self, score, b, h, q_idx, kv_idx, derivative=False)

    def evaluate_derivative(self, score, b=0, h=0, q_idx=0, kv_idx=0) -> numpy.ndarray:
        """d output / d score by forward mode on the trace (a score_mod only)."""
        from cuflash import _trace_eval
        return _trace_eval.evaluate(self, score, b, h, q_idx, kv_idx, derivative=True)


def _trace(fn: Callable, role: str) -> Trace:
    names = ("score", "b", "h", "q_idx", "kv_idx")[0 if role == "score_mod" else 1:]
    args = [Sym("input", kind="f" if n == "score" else "i", value=n) for n in names]
    what = f"{role} {describe(fn)}"
    prev = getattr(_state, "what", None), getattr(_state, "caps", None)
    _state.what, _state.caps = what, []
    try:
        with numpy.errstate(all="ignore"):
            try:
                out = fn(*args)
            except IndexError as exc:         # NumPy's own message for a[Sym]
                if "valid indices" not in str(exc):
                    raise
                raise _unsupported("indexing a plain array with a traced index (wrap the "
                                   "array with cuflash.captured)") from None
        caps = tuple(_state.caps)
    finally:
        _state.what, _state.caps = prev
    if isinstance(out, (numpy.ndarray, list, tuple)) and not (
            isinstance(out, numpy.ndarray) and out.ndim == 0):
        raise TypeError(f"{what} returned a non-scalar {type(out).__qualname__}: it must "
                        f"return one value per score")
    try:
        _state.what = what
        out = const(out)
    except TypeError:
        raise TypeError(f"{what} returned {type(out).__qualname__}, not a number") from None
    finally:
        _state.what = prev[0]
    if role == "score_mod":
        if out.kind == "b":
            raise TypeError(f"{what} returned a bool; a score_mod returns a number (a bool "
                            f"condition belongs in a mask_mod)")
        out = _to(out, "f")
    elif out.kind != "b":
        raise TypeError(f"{what} returned a {'float' if out.kind == 'f' else 'int'}; a "
                        f"mask_mod returns a bool (comparisons, &, |, ~)")
    return Trace(role=role, fn_name=what, output=out, captures=caps)


def trace_score_mod(fn: Callable) -> Trace:
    """Trace ``score_mod(score, b, h, q_idx, kv_idx)``; TypeError names what is unsupported."""
    return _trace(fn, "score_mod")


def trace_mask_mod(fn: Callable) -> Trace:
    """Trace ``mask_mod(b, h, q_idx, kv_idx)``; TypeError names what is unsupported."""
    return _trace(fn, "mask_mod")


def topological(out: Sym) -> list[Sym]:
    """The nodes of the trace, each after its operands (iterative: deep traces are fine)."""
    order, seen, stack = [], set(), [(out, False)]
    while stack:
        node, done = stack.pop()
        if done:
            order.append(node)
            continue
        if id(node) in seen:
            continue
        seen.add(id(node))
        stack.append((node, True))
        stack.extend((a, False) for a in reversed(node.args) if id(a) not in seen)
    return order


# ---------------------------------------------------------------------------------------------
# Reusing traces: a key of everything a trace can depend on
# ---------------------------------------------------------------------------------------------

_SCALARS = (int, float, bool, complex, str, bytes, type(None), numpy.generic)
_CACHE: dict = {}
_CACHE_SIZE = 256


def _snapshot(x: Any, depth: int) -> Any:
    """A hashable stand-in for a value a traced function reads, or raise KeyError when the
    value could change without our seeing it (a mutable object of unknown type)."""
    if isinstance(x, _SCALARS):
        return (type(x), x)
    if isinstance(x, Captured):
        return ("captured", id(x))             # the cached trace holds it: the id stays valid
    if isinstance(x, tuple):
        return tuple(_snapshot(e, depth) for e in x)
    if isinstance(x, type(numpy)) or isinstance(x, (numpy.ufunc, type(len))):
        return ("id", id(x))                    # modules, ufuncs and builtins by identity
    if callable(x) and hasattr(x, "__code__") and depth > 0:
        return function_key(x, depth - 1)
    raise KeyError(type(x))


def function_key(fn: Callable, depth: int = 3) -> tuple:
    """What the trace of ``fn`` depends on: its code, defaults, closure cells and the globals
    its code names (numbers by value, so a new float constant is a new key; captured arrays by
    identity; functions it calls, recursively). KeyError when some value is of a type whose
    changes could go unseen (then the function is traced on every call)."""
    code = fn.__code__
    cells = tuple(_snapshot(c.cell_contents, depth) for c in (fn.__closure__ or ()))
    names = []
    g = getattr(fn, "__globals__", {})
    for name in code.co_names:
        if name in g:
            names.append((name, _snapshot(g[name], depth)))
    return (code, _snapshot(fn.__defaults__ or (), depth), cells, tuple(names))


def cached_trace(fn: Callable, role: str) -> Trace:
    """``trace_score_mod`` / ``trace_mask_mod``, reusing an earlier trace of ``fn`` when nothing
    it reads has changed (see :func:`function_key`)."""
    tracer = trace_score_mod if role == "score_mod" else trace_mask_mod
    try:
        key = (role, id(fn), function_key(fn))
    except (KeyError, AttributeError, ValueError):   # unknown values, or a cell not yet set
        return tracer(fn)
    hit = _CACHE.get(key)
    if hit is not None and hit[0] is fn:
        return hit[1]
    trace = tracer(fn)
    if len(_CACHE) >= _CACHE_SIZE:
        _CACHE.pop(next(iter(_CACHE)))
    _CACHE[key] = (fn, trace)                        # holding fn keeps id(fn) unique
    return trace
