"""The fast paths, checked without a GPU: bench/host_emulation.py runs cuflash's host path with
CuPy's device calls replaced by stand-ins (in a subprocess: it changes the process for good) and
counts, per case, the calls that took the general path. Every repeated call whose modifiers
carry no array must take its fast path, forward and backward; a call with a bias never does
(its pointers and dbias stay on the general path: _fast.modifiers_key)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_repeated_calls_take_their_fast_path(tmp_path):
    pytest.importorskip("cupy")
    pytest.importorskip("ml_dtypes")
    out = tmp_path / "emulation.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "host_emulation.py"),
                          "--calls", "40", "--json", str(out)],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    cases = {(r["case"], r["direction"]): r for r in rows}
    assert set(cases) == {(c, d) for c in ("plain", "window", "softcap", "block_mask",
                                           "block_mask_causal", "score_mod_captured", "bias",
                                           "alibi")
                          for d in ("fwd", "bwd")}
    for (case, direction), r in cases.items():
        assert r["hits"] == 1.0, r                     # one lookup a call, found
        # (the backward of a call with a bias keeps the general path: dbias; ALiBi's slopes,
        # which have no gradient, are patched like the forward's arrays, session 17)
        general = case == "bias" and direction == "bwd"
        assert r["general"] == (1.0 if general else 0.0), r
        assert r["host_us"] > 0


def test_fast_paths_launch_what_the_general_path_launches(tmp_path):
    """Per case: the general path's launches (the first call) and the fast path's (the
    second, with modifier arrays of its own) are the same kernels, grids and argument blocks,
    word for word, every pointer word naming the same array (checked to fail on dk and dv
    swapped in FastModified.backward, on k for v in the plain forward's fast path, on
    FastModified's block-list and captured pointers moved by 16 bytes, and on its modifier
    words, or a call's bias / slopes words, left unpatched)."""
    pytest.importorskip("cupy")
    pytest.importorskip("ml_dtypes")
    out = tmp_path / "check.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "host_emulation.py"), "--check",
                          "--json", str(out)], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.is_file(), run.stderr[-3000:]
    assert json.loads(out.read_text())["mismatches"] == []
    assert run.returncode == 0, run.stdout[-3000:]


FIRST_CALLS = r"""
import json, sys
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/bench"]
import host_emulation
host_emulation.install()
import cupy, ml_dtypes, numpy
import cuflash
from cuflash import _problem
general = []
make_problem = _problem.make_problem
_problem.make_problem = lambda *a, **k: general.append(1) or make_problem(*a, **k)
bf16 = numpy.dtype(ml_dtypes.bfloat16)
q, k, v = (cupy.asarray(numpy.zeros((2, 3, 64, 32), bf16)) for _ in range(3))
counts = {}
for name, kw in (("mask", lambda: {"mask": cupy.asarray(numpy.ones((64, 64), bool))}),
                 ("window", lambda: {"window": (16, 0)})):
    counts[name] = []
    for _ in range(3):
        before = len(general)
        o, lse = cuflash.attention(q, k, v, return_lse=True, **kw())
        counts[name].append(len(general) - before)
    if name == "window":
        for _ in range(3):
            before = len(general)
            cuflash.attention_backward(o, q, k, v, o, lse, **kw())
            counts[name].append(len(general) - before)
try:
    cuflash.attention(q, k, v, bias=numpy.zeros((64, 64), bf16))
    counts["numpy_bias"] = "no error"
except Exception as e:
    counts["numpy_bias"] = type(e).__name__
print(json.dumps(counts))
"""


def test_a_process_first_call_with_modifiers_makes_its_entry():
    """The first CuPy call of a process with modifiers (a mask array; a window, forward and
    backward) makes the fast path's entry, so the second call takes it (it did not: the
    names the fast path tests were set by the first call's planning, after the key was
    skipped; session 15's GPU suite, a worker whose first test was the mask case). A NumPy
    bfloat16 bias beside CuPy inputs is validation's TypeError, not the key's ValueError."""
    pytest.importorskip("cupy")
    pytest.importorskip("ml_dtypes")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, "-c", FIRST_CALLS, str(ROOT)], capture_output=True,
                         text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    counts = json.loads(run.stdout.strip().splitlines()[-1])
    assert counts == {"mask": [1, 0, 0], "window": [1, 0, 0, 1, 0, 0],
                      "numpy_bias": "TypeError"}, counts


PLANS_OF_BROADCASTS = r"""
import json, sys
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/bench"]
import host_emulation
host_emulation.install()
import cupy, ml_dtypes, numpy
import cuflash
from cuflash import _plan
made = []
init = _plan.BackwardPlan.__init__
def record(self, *a, **k):
    init(self, *a, **k)
    made.append([self.dq_direct, self.dk_direct, self.dv_direct,
                 None if self.dbias_sum is None else list(self.dbias_sum[:2])])
_plan.BackwardPlan.__init__ = record
# (the emulation cannot run CuPy's sums: what is checked is the plan each call gets)
_plan.BackwardPlan._sum_broadcast = lambda *a: None
_plan.BackwardPlan._modifier_grads = lambda *a: None
bf16 = numpy.dtype(ml_dtypes.bfloat16)
z = lambda *s: cupy.asarray(numpy.zeros(s, bf16))
q, k, v1, do = z(2, 3, 61, 32), z(2, 3, 31, 32), z(1, 1, 31, 32), z(2, 3, 61, 32)
o, lse = cuflash.attention(q, k, v1, return_lse=True)
expanded = cupy.broadcast_to(v1, (2, 3, 31, 32))      # a stride-0 view of v1's shape (2, 3, ...)
shapes = []
for vv in (expanded, v1, expanded):
    shapes.append(list(cuflash.attention_backward(do, q, k, vv, o, lse)[2].shape))
q, k, v, do = z(2, 3, 64, 32), z(2, 3, 64, 32), z(2, 3, 64, 32), z(2, 3, 64, 32)
b1 = z(3, 64, 64)
for b in (cupy.broadcast_to(b1, (2, 3, 64, 64)), b1):
    o, lse = cuflash.attention(q, k, v, return_lse=True, bias=b)
    shapes.append(list(cuflash.attention_backward(do, q, k, v, o, lse, bias=b)[3].shape))
print(json.dumps({"plans": made, "shapes": shapes}))
"""


def test_backward_plans_tell_broadcast_inputs_from_expanded_ones():
    """A v that broadcasts ((1, 1, L, d) against q's (2, 3, L, d)) and one given expanded (a
    stride-0 (2, 3, L, d) view of it) are the same views after broadcasting, but only the
    first's dV is summed over the batch: each gets a plan of its own (the plan key holds the
    gradients' sizes). One plan for both wrote the expanded call's two items of dV straight
    into the other's one-item dv (session 15's GPU suite: test_matches_reference's dV, and
    session 7's). Likewise a bias and its expanded view (dbias summed or not)."""
    pytest.importorskip("cupy")
    pytest.importorskip("ml_dtypes")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, "-c", PLANS_OF_BROADCASTS, str(ROOT)],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["shapes"] == [[2, 3, 31, 32], [1, 1, 31, 32], [2, 3, 31, 32],
                             [2, 3, 64, 64], [3, 64, 64]]
    direct, summed = [True, True, True, None], [True, True, False, None]
    plans = out["plans"]
    assert plans[:2] == [direct, summed], plans          # the third call reuses the first's
    assert len(plans) == 4, plans
    assert plans[2][3] != plans[3][3], plans             # dbias: not summed / summed over B
