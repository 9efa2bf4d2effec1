"""Printing a trace (``_trace``) as CUDA C++: the struct the Variant takes for a user function.

A score_mod becomes::

    namespace cuflash { namespace user {
    struct ScoreMod_<hash> {   // score_mod <name> (<file>:<line>)
      __device__ __forceinline__ static float apply(float score, int b, int h, int q_idx,
                                                     int kv_idx, const cuflash::CapturedArray* cap);
      __device__ __forceinline__ static float dscore(...same...);   // d apply / d score
    };
    }}

and a mask_mod a ``MaskMod_<hash>`` with ``static bool apply(int b, int h, int q_idx, int kv_idx,
const cuflash::CapturedArray* cap)``. One ``const`` local per trace node, in order; types
``float`` (scores and float math), ``int`` (indices), ``long long``, ``bool``. ``cap[k]`` is the
k-th captured array of the trace (``Trace.captures``); every index into it is clamped into
``[0, shape - 1]``. Float constants are printed as exact hexadecimal float32 literals, so the
source pins the closure's values. The prelude (``CapturedArray`` and the helpers that give
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

CTYPE = {"f": "float", "i": "int", "l": "long long", "b": "bool"}
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
// NumPy's float divmod (npy_divmodf): floor division and remainder with the divisor's sign
__device__ __forceinline__ float ffloordiv(float a, float b) {
    if (b == 0.0f) return a / b;
    float mod = fmodf(a, b);
    float div = (a - mod) / b;
    if (mod != 0.0f && ((b < 0.0f) != (mod < 0.0f))) div -= 1.0f;
    if (div == 0.0f) return copysignf(0.0f, a / b);
    float fl = floorf(div);
    return (div - fl > 0.5f) ? fl + 1.0f : fl;
}
__device__ __forceinline__ float fremainder(float a, float b) {
    float mod = fmodf(a, b);
    if (b == 0.0f) return mod;
    if (mod != 0.0f) return ((b < 0.0f) != (mod < 0.0f)) ? mod + b : mod;
    return copysignf(0.0f, b);
}
// NumPy's minimum / maximum propagate NaN (fminf / fmaxf would drop it)
__device__ __forceinline__ float fminimum(float a, float b) { return (a <= b || a != a) ? a : b; }
__device__ __forceinline__ float fmaximum(float a, float b) { return (a >= b || a != a) ? a : b; }
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
    v = float(numpy.float32(v))    # the GPU computes in float32: the literal is v's float32
    if math.isnan(v):
        return "__int_as_float(0x7fffffff)"
    if math.isinf(v):
        return _INF if v > 0 else f"(-{_INF})"
    text = v.hex() + "f"
    return f"({text})" if v < 0 or text.startswith("-") else text


_INFIX = {"add": "+", "subtract": "-", "multiply": "*", "true_divide": "/", "less": "<",
          "less_equal": "<=", "greater": ">", "greater_equal": ">=", "equal": "==",
          "not_equal": "!="}
_FLOAT_FN = {"tanh": "tanhf", "exp": "expf", "log": "logf", "sqrt": "sqrtf", "exp2": "exp2f",
             "log2": "log2f", "log1p": "log1pf", "expm1": "expm1f", "sin": "sinf", "cos": "cosf",
             "floor": "floorf", "ceil": "ceilf", "trunc": "truncf", "rint": "rintf"}
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
        return f"{U}ffloordiv({a[0]}, {a[1]})" if isf else f"{U}ifloordiv<{ct}>({a[0]}, {a[1]})"
    if op == "remainder":
        return f"{U}fremainder({a[0]}, {a[1]})" if isf else f"{U}imod<{ct}>({a[0]}, {a[1]})"
    if op == "power":
        return f"powf({a[0]}, {a[1]})" if isf else f"{U}ipow<{ct}>({a[0]}, {a[1]})"
    if op in ("minimum", "maximum"):
        return f"{U}f{op}({a[0]}, {a[1]})" if isf else f"{U}i{op}<{ct}>({a[0]}, {a[1]})"
    if op in ("fmin", "fmax"):
        return f"{op}f({a[0]}, {a[1]})" if isf else f"{U}i{op[1:]}imum<{ct}>({a[0]}, {a[1]})"
    if op in _FLOAT_FN:
        return f"{_FLOAT_FN[op]}({a[0]})"
    if op == "square":
        return f"({a[0]} * {a[0]})"
    if op == "negative":
        return f"(-{a[0]})"
    if op == "absolute":
        return f"fabsf({a[0]})" if kind == "f" else f"({a[0]} < 0 ? -{a[0]} : {a[0]})"
    if op == "invert":
        return f"(!{a[0]})" if kind == "b" else f"(~{a[0]})"
    if op == "isnan":
        return f"({a[0]} != {a[0]})"
    if op == "isinf":
        return f"(fabsf({a[0]}) == {_INF})"
    if op == "isfinite":
        return f"(fabsf({a[0]}) < {_INF})"
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
        return "1.0f"
    op = node.op
    dd = [x if x is not None else "0.0f" for x in d]
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
        return f"({dd[0]} - {U}ffloordiv({a[0]}, {a[1]}) * {dd[1]})"
    if op == "power":
        terms = []
        if d[0] is not None:
            terms.append(f"{a[1]} * powf({a[0]}, {a[1]} - 1.0f) * {d[0]}")
        if d[1] is not None:
            terms.append(f"{me} * logf({a[0]}) * {d[1]}")
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
        return f"({a[0]} < 0.0f ? -{dd[0]} : {dd[0]})"
    x = a[0]
    rule = {"tanh": f"(1.0f - {me} * {me})", "exp": me, "log": f"(1.0f / {x})",
            "sqrt": f"(0.5f / {me})", "exp2": f"({me} * 0x1.62e42fefa39efp-1f)",
            "log2": f"(1.0f / ({x} * 0x1.62e42fefa39efp-1f))", "log1p": f"(1.0f / (1.0f + {x}))",
            "expm1": f"expf({x})", "sin": f"cosf({x})", "cos": f"(-sinf({x}))",
            "square": f"(2.0f * {x})"}
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
                    lines.append(f"const float d{n} = {g};")
    out = trace.output
    result = (dnames.get(id(out), "0.0f") if derivative else names[id(out)])
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
    params = ("float score, " if role == "score_mod" else "") + \
        "int b, int h, int q_idx, int kv_idx, const cuflash::CapturedArray* cap"
    ret = "float" if role == "score_mod" else "bool"
    fns = [("apply", _body(trace, False))]
    if role == "score_mod":
        fns.append(("dscore", _body(trace, True)))
    text = [f"struct {name} {{  // {role} {trace.fn_name.split(' ', 1)[1].split(' (')[0]}",
            f"    static constexpr int num_captured = {len(trace.captures)};"]
    for fname, lines in fns:
        text.append(f"    __device__ __forceinline__ static {ret if fname == 'apply' else 'float'} "
                    f"{fname}({params}) {{")
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
