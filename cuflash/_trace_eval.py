"""An interpreter of traces (``_trace``) on NumPy arrays, value and forward-mode derivative.

It computes what the generated CUDA computes, operation by operation, with the same types
(floats in the score's dtype: float32 as on the GPU, float64 for the reference; indices int32;
captured indices clamped into range) and the same derivative rules as ``_trace_cuda``:

- ``d score = 1``; constants, indices, ints and bools have derivative 0;
- ``minimum(a, b)`` takes a's derivative where it takes a (``a <= b`` or a NaN), ``maximum``
  likewise (``a >= b``); ``where(c, x, y)`` takes ``c ? dx : dy``; ``|a|`` takes ``-da`` where
  ``a < 0``; ``floor``, ``ceil``, ``trunc``, ``rint``, ``//`` are flat (0).

So the CPU path's score_mod derivative is the GPU's, and the tests compare both the value with
calling the function directly and the derivative with finite differences.
"""

from __future__ import annotations

import math

import numpy

from cuflash import _trace

LN2 = math.log(2.0)


def _types(score):
    f = score.dtype.type if score is not None and score.dtype.kind == "f" else numpy.float32
    return {"f": f, "i": numpy.int32, "l": numpy.int64, "b": numpy.bool_}


def _ipow(a, b):
    """Integer power as the generated ``ipow``: 0 for a negative exponent unless |a| == 1."""
    pos = numpy.power(a, numpy.maximum(b, 0))
    odd = (b % 2) != 0
    neg = numpy.where(a == 1, 1, numpy.where(a == -1, numpy.where(odd, -1, 1), 0))
    return numpy.where(b < 0, neg, pos).astype(pos.dtype)


_BINARY = {
    "add": numpy.add, "subtract": numpy.subtract, "multiply": numpy.multiply,
    "true_divide": numpy.true_divide, "floor_divide": numpy.floor_divide,
    "remainder": numpy.remainder, "minimum": numpy.minimum, "maximum": numpy.maximum,
    "fmin": numpy.fmin, "fmax": numpy.fmax, "less": numpy.less, "less_equal": numpy.less_equal,
    "greater": numpy.greater, "greater_equal": numpy.greater_equal, "equal": numpy.equal,
    "not_equal": numpy.not_equal, "bitwise_and": numpy.bitwise_and,
    "bitwise_or": numpy.bitwise_or, "bitwise_xor": numpy.bitwise_xor,
}
_UNARY = {n: getattr(numpy, n) for n in _trace.FLOAT_UNARY | {"negative", "absolute", "invert",
                                                             "isnan", "isinf", "isfinite"}}


def _value(node, vals, types, inputs):
    op, args = node.op, [vals[id(a)] for a in node.args]
    t = types[node.kind]
    if op == "input":
        return numpy.asarray(inputs[node.value]).astype(t)
    if op == "const":
        return t(node.value)
    if op == "cast":
        return numpy.asarray(args[0]).astype(t)
    if op == "power":
        return numpy.power(*args) if node.kind == "f" else _ipow(*args)
    if op in _BINARY:
        return numpy.asarray(_BINARY[op](*args)).astype(t)
    if op in _UNARY:
        return numpy.asarray(_UNARY[op](*args)).astype(t)
    if op == "where":
        return numpy.where(*args).astype(t)
    if op == "load":
        cap = inputs["captures"][node.cap]
        arr = cap.array if isinstance(cap.array, numpy.ndarray) else cap.array.get()
        idx = tuple(numpy.clip(i, 0, n - 1) for i, n in zip(args, arr.shape))
        return numpy.asarray(arr[idx]).astype(t)
    raise AssertionError(f"no rule for {op}")   # every op _trace builds is listed above


def _derivative(node, vals, ds, types):
    """d node / d score, given the operands' values and derivatives (None = 0)."""
    if node.kind != "f" or not node.has_d:
        return None
    f = types["f"]
    if node.op == "input":
        return f(1)
    a = [vals[id(x)] for x in node.args]
    d = [ds.get(id(x)) if x.kind == "f" else None for x in node.args]
    z = f(0)

    def dd(i):
        return z if d[i] is None else d[i]

    op = node.op
    if op == "cast":
        return None
    if op in ("add", "subtract", "multiply", "true_divide"):
        # only the terms of operands that depend on the score (as the C++: no 0 * NaN)
        terms = []
        if d[0] is not None:
            terms.append({"add": lambda: d[0], "subtract": lambda: d[0],
                          "multiply": lambda: d[0] * a[1],
                          "true_divide": lambda: d[0] / a[1]}[op]())
        if d[1] is not None:
            terms.append({"add": lambda: d[1], "subtract": lambda: -d[1],
                          "multiply": lambda: a[0] * d[1],
                          "true_divide": lambda: -a[0] * d[1] / (a[1] * a[1])}[op]())
        return None if not terms else (terms[0] if len(terms) == 1 else terms[0] + terms[1])
    if op in ("floor_divide", "floor", "ceil", "trunc", "rint"):
        return z
    if op == "remainder":
        return dd(0) - numpy.floor_divide(a[0], a[1]) * dd(1)
    if op == "power":
        out = z
        if d[0] is not None:
            out = out + a[1] * numpy.power(a[0], a[1] - f(1)) * d[0]
        if d[1] is not None:
            out = out + numpy.power(a[0], a[1]) * numpy.log(a[0]) * d[1]
        return out
    if op in ("minimum", "maximum", "fmin", "fmax"):
        ge = a[0] <= a[1] if op in ("minimum", "fmin") else a[0] >= a[1]
        pick_a = ge | numpy.isnan(a[0]) if op in ("minimum", "maximum") else ge | numpy.isnan(a[1])
        return numpy.where(pick_a, dd(0), dd(1))
    if op == "where":
        return numpy.where(a[0], dd(1), dd(2))
    if op == "negative":
        return -dd(0)
    if op == "absolute":
        return numpy.where(a[0] < 0, -dd(0), dd(0))
    x = a[0]
    rule = {"tanh": lambda: f(1) - vals[id(node)] * vals[id(node)],
            "exp": lambda: vals[id(node)], "log": lambda: f(1) / x,
            "sqrt": lambda: f(0.5) / vals[id(node)], "exp2": lambda: vals[id(node)] * f(LN2),
            "log2": lambda: f(1) / (x * f(LN2)), "log1p": lambda: f(1) / (f(1) + x),
            "expm1": lambda: numpy.exp(x), "sin": lambda: numpy.cos(x),
            "cos": lambda: -numpy.sin(x), "square": lambda: f(2) * x}
    if op in rule:
        return rule[op]() * dd(0)
    if op == "load":
        return None
    raise AssertionError(f"no derivative rule for {op}")


def evaluate(trace, score, b, h, q_idx, kv_idx, *, derivative: bool):
    types = _types(None if score is None else numpy.asarray(score))
    inputs = {"score": score, "b": b, "h": h, "q_idx": q_idx, "kv_idx": kv_idx,
              "captures": trace.captures}
    vals: dict = {}
    ds: dict = {}
    with numpy.errstate(all="ignore"):      # IEEE results, as on the GPU
        for node in _trace.topological(trace.output):
            vals[id(node)] = _value(node, vals, types, inputs)
            if derivative:
                g = _derivative(node, vals, ds, types)
                if g is not None:
                    ds[id(node)] = numpy.asarray(g).astype(types["f"])
    if not derivative:
        return vals[id(trace.output)]
    g = ds.get(id(trace.output))
    if g is None:                           # the output does not depend on the score
        return numpy.zeros(numpy.shape(vals[id(trace.output)]), types["f"])
    return g
