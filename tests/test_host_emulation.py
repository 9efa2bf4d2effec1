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
        # (the backward of a call with modifier arrays keeps the general path: its gradients)
        general = case in ("bias", "alibi") and direction == "bwd"
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
