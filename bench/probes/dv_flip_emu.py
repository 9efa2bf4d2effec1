"""Question (CPU, no GPU): which part of the backward can give session 7's one wrong dv element
(bench/NOTES.md, "The one wrong dv element (session 8)") while dq and dk pass?

1. The test's rule on perturbed exact gradients: an error in P (Q, K, L_i), in dO or in a whole
   row's L_i shows in dq first (dq is checked before dv and its bound is tight here), so the
   failure needs an error that only the dV product, dV's accumulators or what follows them saw.
2. The reported value is the reference with one float16 exponent bit cleared (x / 16).
3. bwd_sm80 (CUFLASH_BWD=sm80: its tile I/O, bwd_io.cuh, is bwd_sm90's) in the g++ emulation at
   the exact case, with shared memory filled with 0xFF (NaN) and the float32 dK, dV buffers
   with NaN before the kernel: an uninitialised read would show.

    PYTHONPATH=. python bench/probes/dv_flip_emu.py      # ~1 min (g++ compiles the kernel)
"""
import sys

import numpy

import cuflash
from cuflash import _problem
from cuflash._families import PROFILES, Shape, choose
from cuflash.testing import AttentionCase, assert_attention_close

SHAPES = ((2, 1, 5, 1), (1, 2, 256, 1), (2, 1, 256, 96))
case = AttentionCase.make("float16", *SHAPES, seed=0)
q, k, v, do = (case._host(n).astype(numpy.float64) for n in ("q", "k", "v", "do"))
B = (2, 2)
Q, K, V = (numpy.broadcast_to(x, B + x.shape[2:]) for x in (q, k, v))
S = numpy.einsum("bhid,bhjd->bhij", Q, K)                    # scale 1 / sqrt(1) = 1
L = numpy.log(numpy.exp(S).sum(-1))
P = numpy.exp(S - L[..., None])
D = (do * numpy.einsum("bhij,bhjc->bhic", P, V)).sum(-1)    # rowsum(dO o O), O exact


def grads(P, dO=do):
    dS = P * (numpy.einsum("bhic,bhjc->bhij", dO, V) - D[..., None])
    return (numpy.einsum("bhij,bhjd->bhid", dS, K).sum(1, keepdims=True),
            numpy.einsum("bhij,bhid->bhjd", dS, Q).sum(0, keepdims=True),
            numpy.einsum("bhij,bhic->bhjc", P, dO).sum(1, keepdims=True))


def verdict(g):
    try:
        return f"passes ({assert_attention_close(None, case, grads=tuple(x.astype(numpy.float16) for x in g)):.3f})"
    except AssertionError as e:
        return "FAILS: " + str(e).split("\n")[0][:120]


exact = grads(P)
print("largest |dv|:", numpy.unravel_index(numpy.abs(exact[2]).argmax(), exact[2].shape),
      float(exact[2][1, 0, 212, 79]), "/ 16 =", float(numpy.float16(exact[2][1, 0, 212, 79]) / 16))
P1 = P.copy(); P1[1, 1, 4, 212] = 0.0305          # one P element (its dv error: -0.476 -> -0.030)
P2 = P.copy(); P2[1, 1, 4] *= 0.176                # one row's L_i off by 1.7
do3 = do.copy(); do3[1, 1, 4, 79] = -0.553         # one dO element
rows = [("exact", exact), ("P element, every product", grads(P1)),
        ("P element, dV only", exact[:2] + grads(P1)[2:]), ("L_i of a row", grads(P2)),
        ("dO element, every product", grads(P, do3)), ("dO element, dV only", exact[:2] + grads(P, do3)[2:])]
for name, g in rows:
    print(f"{name:28s} {verdict(g)}")

sys.path.insert(0, "tests")
import _emu_sm80 as emu   # noqa: E402
if not emu.available():
    sys.exit("g++ not found: the emulation part is skipped")
o, lse = cuflash.attention(*(case._host(n) for n in ("q", "k", "v")), return_lse=True)
prob = _problem.make_problem(case._host("q"), case._host("k"), case._host("v"), scale=None, causal=False)
expr = choose("bwd", Shape.of(prob, False, None), PROFILES["a100"]).expr
lib = emu.build("bwd_sm80.cu", [("bwd", expr)])
for eager in (False, True):
    g = emu.bwd_sm80(lib, case._host("do"), case._host("q"), case._host("k"), case._host("v"), o, lse, eager=eager)
    print(f"emulated {expr} (eager copies: {eager}): {verdict(g)}")
