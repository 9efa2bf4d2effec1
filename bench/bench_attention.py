#!/usr/bin/env python3
"""Attention benchmark: cuflash against naive CuPy, PyTorch SDPA and JAX cuDNN, same inputs.

A thin wrapper: the logic lives in cuflash/_bench.py so that `python -m cuflash bench` works
from an installed wheel too. Run `python bench/bench_attention.py --help` for the options; the
method (shapes, FLOP convention, timing, memory accounting) is in that module's docstring.
"""
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.isfile(os.path.join(_ROOT, "cuflash", "_bench.py")) and _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)       # run from a checkout: use this tree's cuflash

from cuflash._bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
