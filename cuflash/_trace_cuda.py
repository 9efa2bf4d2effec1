"""Printing a trace (``_trace``) as CUDA C++: the struct the Variant takes for a user function.

A score_mod becomes::

    namespace cuflash { namespace user {
    struct ScoreMod_<hash> {   // score_mod <name> (<file>:<line>)
      template <class F> __device__ __forceinline__ static F apply(F score, int b, int h,
                                        int q_idx, int kv_idx, const cuflash::CapturedArray* cap);
      template <class F> __device__ __forceinline__ static F dscore(...same...);  // d apply / d s
    };
    }}

``F`` is the kernel's accumulation type: float for float16, bfloat16 and float32 inputs, double
for float64 (so the float64 path stays exact: the first H200 fuzz campaign with modifiers found
float64 outputs off by float32 roundings when the functions were float-only). A mask_mod is a
``MaskMod_<hash>`` with ``static bool apply(int b, int h, int q_idx, int kv_idx, const
cuflash::CapturedArray* cap)`` and ``F = float`` for its float math. One ``const`` local per
trace node, in order; types ``F`` (scores and float math), ``int`` (indices), ``long long``,
``bool``. ``cap[k]`` is the k-th captured array of the trace (``Trace.captures``); every index
into it is clamped into ``[0, shape - 1]``. Float constants are printed as exact hexadecimal
float64 literals converted to ``F`` (``F(0x1.8p+1)``: in float, the closure's value rounded to
float32 once, at compile time), so the source pins the closure's values. The prelude
(``CapturedArray``, float and double overloads of the math functions, and the helpers that give
NumPy's semantics to ``//``, ``%``, ``**``, ``minimum`` and ``maximum``) is guarded, so several
user functions and ``variant.cuh`` may include it. The hash is of the struct's text: equal
traces give equal sources (and one compiled variant).
"""

from __future__ import annotations

import hashlib
import math
import re

import numpy

from cuflash import _trace

CTYPE = {"f": "F", "i": "int", "l": "long long", "b": "bool"}
LOAD_CTYPE = {"bool": "bool", "int8": "signed char", "uint8": "unsigned char",
              "int16": "short", "uint16": "unsigned short", "int32": "int",
              "uint32": "unsigned int", "int64": "long long", "float32": "float",
              "float64": "double"}

PRELUDE = r"""
#ifndef CUFLASH_USER_FN_PRELUDE
#define CUFLASH_USER_FN_PRELUDE
namespace cuflash {
#ifndef CUFLASH_CAPTURED_ARRAY
#define CUFLASH_CAPTURED_ARRAY
// An array a user function reads (cuflash.captured): pointer, shape, strides in elements.
struct CapturedArray {
    const void* ptr;
    long long shape[4];
    long long stride[4];
};
#endif
namespace user {
// Python/NumPy integer // and %: floor division, remainder with the divisor's sign, 0 for / 0
template <class T> __device__ __forceinline__ T ifloordiv(T a, T b) {
    if (b == 0) return 0;
    T q = a / b;
    return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}
template <class T> __device__ __forceinline__ T imod(T a, T b) {
    if (b == 0) return 0;
    T r = a % b;
    return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r;
}
// integer power; a negative exponent gives 0 unless |a| == 1
template <class T> __device__ __forceinline__ T ipow(T a, T b) {
    if (b < 0) return a == 1 ? 1 : (a == -1 ? ((b & 1) ? -1 : 1) : 0);
    T r = 1;
    while (b > 0) { if (b & 1) r *= a; a *= a; b >>= 1; }
    return r;
}
// the math functions in the accumulation type: f_<name>(float) is <name>f, f_<name>(double) <name>
#define CUFLASH_USER_FN1(name) \
    __device__ __forceinline__ float f_##name(float x) { return name##f(x); } \
    __device__ __forceinline__ double f_##name(double x) { return name(x); }
#define CUFLASH_USER_FN2(name) \
    __device__ __forceinline__ float f_##name(float x, float y) { return name##f(x, y); } \
    __device__ __forceinline__ double f_##name(double x, double y) { return name(x, y); }
CUFLASH_USER_FN1(tanh) CUFLASH_USER_FN1(exp) CUFLASH_USER_FN1(log) CUFLASH_USER_FN1(sqrt)
CUFLASH_USER_FN1(exp2) CUFLASH_USER_FN1(log2) CUFLASH_USER_FN1(log1p) CUFLASH_USER_FN1(expm1)
CUFLASH_USER_FN1(sin) CUFLASH_USER_FN1(cos) CUFLASH_USER_FN1(floor) CUFLASH_USER_FN1(ceil)
CUFLASH_USER_FN1(trunc) CUFLASH_USER_FN1(rint) CUFLASH_USER_FN1(fabs)
CUFLASH_USER_FN2(pow) CUFLASH_USER_FN2(fmod) CUFLASH_USER_FN2(copysign) CUFLASH_USER_FN2(fmin)
CUFLASH_USER_FN2(fmax)
#undef CUFLASH_USER_FN1
#undef CUFLASH_USER_FN2
// NumPy's float divmod (npy_divmodf): floor division and remainder with the divisor's sign
template <class F> __device__ __forceinline__ F ffloordiv(F a, F b) {
    if (b == F(0)) return a / b;
    F mod = f_fmod(a, b);
    F div = (a - mod) / b;
    if (mod != F(0) && ((b < F(0)) != (mod < F(0)))) div -= F(1);
    if (div == F(0)) return f_copysign(F(0), a / b);
    F fl = f_floor(div);
    return (div - fl > F(0.5)) ? fl + F(1) : fl;
}
template <class F> __device__ __forceinline__ F fremainder(F a, F b) {
    F mod = f_fmod(a, b);
    if (b == F(0)) return mod;
    if (mod != F(0)) return ((b < F(0)) != (mod < F(0))) ? mod + b : mod;
    return f_copysign(F(0), b);
}
// NumPy's minimum / maximum propagate NaN (fminf / fmaxf would drop it)
template <class F> __device__ __forceinline__ F fminimum(F a, F b) { return (a <= b || a != a) ? a : b; }
template <class F> __device__ __forceinline__ F fmaximum(F a, F b) { return (a >= b || a != a) ? a : b; }
template <class T> __device__ __forceinline__ T iminimum(T a, T b) { return a <= b ? a : b; }
template <class T> __device__ __forceinline__ T imaximum(T a, T b) { return a >= b ? a : b; }
__device__ __forceinline__ long long clamp_index(long long i, long long n) {
    return i < 0 ? 0 : (i >= n ? n - 1 : i);
}
}  // namespace user
}  // namespace cuflash
#endif
"""

_INF = "__int_as_float(0x7f800000)"


def literal(node) -> str:
    v, kind = node.value, node.kind
    if kind == "b":
        return "true" if v else "false"
    if kind == "i":
        return "(-2147483647 - 1)" if v == -2 ** 31 else (f"({v})" if v < 0 else str(v))
    if kind == "l":
        return "(-9223372036854775807LL - 1)" if v == -2 ** 63 else (
            f"({v}LL)" if v < 0 else f"{v}LL")
    v = float(v)                   # F(v): rounded to float32 once where F is float
    if math.isnan(v):
        return "F(__int_as_float(0x7fffffff))"
    if math.isinf(v):
        return f"F({_INF})" if v > 0 else f"F(-{_INF})"
    return f"F({v.hex()})"


_INFIX = {"add": "+", "subtract": "-", "multiply": "*", "true_divide": "/", "less": "<",
          "less_equal": "<=", "greater": ">", "greater_equal": ">=", "equal": "==",
          "not_equal": "!="}
_FLOAT_FN = {name: f"{'cuflash::user::'}f_{name}" for name in (
    "tanh", "exp", "log", "sqrt", "exp2", "log2", "log1p", "expm1", "sin", "cos", "floor",
    "ceil", "trunc", "rint")}
U = "cuflash::user::"


def _expr(node, a: list[str]) -> str:
    op, kind = node.op, node.kind
    ct = CTYPE[kind]
    isf = all(x.kind == "f" for x in node.args) and node.args != ()
    if op == "input":
        return node.value
    if op == "const":
        return literal(node)
    if op == "cast":
        return f"static_cast<{ct}>({a[0]})"
    if op in _INFIX:
        return f"({a[0]} {_INFIX[op]} {a[1]})"
    if op in ("bitwise_and", "bitwise_or", "bitwise_xor"):
        if kind == "b":
            return f"({a[0]} {dict(bitwise_and='&&', bitwise_or='||', bitwise_xor='!=')[op]} {a[1]})"
        return f"({a[0]} {dict(bitwise_and='&', bitwise_or='|', bitwise_xor='^')[op]} {a[1]})"
    if op == "floor_divide":
        return f"{U}ffloordiv<F>({a[0]}, {a[1]})" if isf else f"{U}ifloordiv<{ct}>({a[0]}, {a[1]})"
    if op == "remainder":
        return f"{U}fremainder<F>({a[0]}, {a[1]})" if isf else f"{U}imod<{ct}>({a[0]}, {a[1]})"
    if op == "power":
        return f"{U}f_pow({a[0]}, {a[1]})" if isf else f"{U}ipow<{ct}>({a[0]}, {a[1]})"
    if op in ("minimum", "maximum"):
        return f"{U}f{op}<F>({a[0]}, {a[1]})" if isf else f"{U}i{op}<{ct}>({a[0]}, {a[1]})"
    if op in ("fmin", "fmax"):
        return f"{U}f_{op}({a[0]}, {a[1]})" if isf else f"{U}i{op[1:]}imum<{ct}>({a[0]}, {a[1]})"
    if op in _FLOAT_FN:
        return f"{_FLOAT_FN[op]}({a[0]})"
    if op == "square":
        return f"({a[0]} * {a[0]})"
    if op == "negative":
        return f"(-{a[0]})"
    if op == "absolute":
        return f"{U}f_fabs({a[0]})" if kind == "f" else f"({a[0]} < 0 ? -{a[0]} : {a[0]})"
    if op == "invert":
        return f"(!{a[0]})" if kind == "b" else f"(~{a[0]})"
    if op == "isnan":
        return f"({a[0]} != {a[0]})"
    if op == "isinf":
        return f"({U}f_fabs({a[0]}) == F({_INF}))"
    if op == "isfinite":
        return f"({U}f_fabs({a[0]}) < F({_INF}))"
    if op == "where":
        return f"({a[0]} ? {a[1]} : {a[2]})"
    raise AssertionError(f"no C++ for {op}")   # every op _trace builds is listed above


def _load(node, a: list[str], name: str) -> str:
    arr = f"cap[{node.cap}]"
    offset = " + ".join(f"{U}clamp_index({i}, {arr}.shape[{ax}]) * {arr}.stride[{ax}]"
                        for ax, i in enumerate(a))
    ctype = LOAD_CTYPE[node.value]
    return (f"const {CTYPE[node.kind]} {name} = static_cast<{CTYPE[node.kind]}>("
            f"static_cast<const {ctype}*>({arr}.ptr)[{offset}]);")


def _derivative(node, a: list[str], d: list[str | None], me: str) -> str | None:
    """C++ for d node / d score (mirrors ``_trace_eval._derivative``), None for 0."""
    if node.kind != "f" or not node.has_d:
        return None
    if node.op == "input":
        return "F(1)"
    op = node.op
    dd = [x if x is not None else "F(0)" for x in d]
    if op in ("add", "subtract", "multiply", "true_divide"):
        # only the terms of operands that depend on the score
        first = {"add": d[0], "subtract": d[0], "multiply": d[0] and f"{d[0]} * {a[1]}",
                 "true_divide": d[0] and f"{d[0]} / {a[1]}"}[op]
        second = d[1] and {"add": f"{d[1]}", "subtract": f"-{d[1]}",
                           "multiply": f"{a[0]} * {d[1]}",
                           "true_divide": f"-{a[0]} * {d[1]} / ({a[1]} * {a[1]})"}[op]
        if first and second:
            return f"({first} + {second})"
        return f"({first or second})" if first or second else None
    if op in ("floor_divide", "floor", "ceil", "trunc", "rint", "cast", "load"):
        return None
    if op == "remainder":
        return f"({dd[0]} - {U}ffloordiv<F>({a[0]}, {a[1]}) * {dd[1]})"
    if op == "power":
        terms = []
        if d[0] is not None:
            terms.append(f"{a[1]} * {U}f_pow({a[0]}, {a[1]} - F(1)) * {d[0]}")
        if d[1] is not None:
            terms.append(f"{me} * {U}f_log({a[0]}) * {d[1]}")
        return "(" + " + ".join(terms) + ")"
    if op in ("minimum", "maximum", "fmin", "fmax"):
        cmp = "<=" if op in ("minimum", "fmin") else ">="
        nan = a[0] if op in ("minimum", "maximum") else a[1]
        return f"(({a[0]} {cmp} {a[1]} || {nan} != {nan}) ? {dd[0]} : {dd[1]})"
    if op == "where":
        return f"({a[0]} ? {dd[1]} : {dd[2]})"
    if op == "negative":
        return f"(-{dd[0]})"
    if op == "absolute":
        return f"({a[0]} < F(0) ? -{dd[0]} : {dd[0]})"
    x = a[0]
    ln2 = "F(0x1.62e42fefa39efp-1)"
    rule = {"tanh": f"(F(1) - {me} * {me})", "exp": me, "log": f"(F(1) / {x})",
            "sqrt": f"(F(0.5) / {me})", "exp2": f"({me} * {ln2})",
            "log2": f"(F(1) / ({x} * {ln2}))", "log1p": f"(F(1) / (F(1) + {x}))",
            "expm1": f"{U}f_exp({x})", "sin": f"{U}f_cos({x})", "cos": f"(-{U}f_sin({x}))",
            "square": f"(F(2) * {x})"}
    return f"({rule[op]} * {dd[0]})"


def _body(trace, derivative: bool) -> list[str]:
    names: dict = {}
    dnames: dict = {}
    lines = []
    for n, node in enumerate(_trace.topological(trace.output)):
        a = [names[id(x)] for x in node.args]
        if node.op in ("input", "const"):
            names[id(node)] = _expr(node, a)
        else:
            name = f"t{n}"
            names[id(node)] = name
            lines.append(_load(node, a, name) if node.op == "load"
                         else f"const {CTYPE[node.kind]} {name} = {_expr(node, a)};")
        if derivative:
            d = [dnames.get(id(x)) for x in node.args]
            g = _derivative(node, a, d, names[id(node)])
            if g is not None:
                if node.op == "input":
                    dnames[id(node)] = g
                else:
                    dnames[id(node)] = f"d{n}"
                    lines.append(f"const F d{n} = {g};")
    out = trace.output
    result = (dnames.get(id(out), "F(0)") if derivative else names[id(out)])
    return _live(lines, f"return {result};")


_NAME = re.compile(r"\b([td]\d+)\b")


def _live(lines: list[str], ret: str) -> list[str]:
    """``lines`` without the locals ``ret`` does not need (``dscore`` recomputes values, only
    those its derivative reads are kept; no unused-variable warnings)."""
    need = set(_NAME.findall(ret))
    kept = [ret]
    for line in reversed(lines):
        lhs, rhs = line.split(" = ", 1)
        if lhs.split()[-1] in need:
            need.update(_NAME.findall(rhs))
            kept.append(line)
    return kept[::-1]


def _struct_text(trace, name: str) -> str:
    role = trace.role
    score = role == "score_mod"
    params = ("F score, " if score else "") + \
        "int b, int h, int q_idx, int kv_idx, const cuflash::CapturedArray* cap"
    fns = [("apply", _body(trace, False))]
    if score:
        fns.append(("dscore", _body(trace, True)))
    text = [f"struct {name} {{  // {role} {trace.fn_name.split(' ', 1)[1].split(' (')[0]}",
            f"    static constexpr int num_captured = {len(trace.captures)};"]
    if not score:   # a mask_mod's float math (if any) is in float
        text.append("    using F = float;")
    for fname, lines in fns:
        text.append(f"    {'template <class F> ' if score else ''}__device__ __forceinline__ "
                    f"static {'F' if score else 'bool'} {fname}({params}) {{")
        text += [f"        {line}" for line in lines]
        text.append("    }")
    text.append("};")
    return "\n".join(text)


def struct_name(trace) -> str:
    base = "ScoreMod" if trace.role == "score_mod" else "MaskMod"
    digest = hashlib.sha1(_struct_text(trace, base).encode()).hexdigest()[:16]
    return f"{base}_{digest}"


def qualified_name(trace) -> str:
    return f"cuflash::user::{struct_name(trace)}"


def source(trace) -> str:
    name = struct_name(trace)
    return (PRELUDE + "namespace cuflash { namespace user {\n" + _struct_text(trace, name)
            + "\n}}  // namespace cuflash::user\n")
