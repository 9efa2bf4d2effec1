"""NumPy's BLAS threads, so that the CPU path can run its own threads over tiles.

The CPU path parallelises over tiles with a thread pool; a multi-threaded BLAS inside each of
those threads oversubscribes the cores (and OpenBLAS's spinning threads make that far slower
than one thread each: measured 2-20x on a 2-core machine). :func:`single_threaded` sets the
OpenBLAS that NumPy loaded to one thread for the duration of a call and restores the previous
count afterwards, as ``threadpoolctl`` does, without the dependency: it finds the loaded
OpenBLAS in ``/proc/self/maps`` (Linux) and calls its ``*_get_num_threads``/
``*_set_num_threads``. Where that is not possible (another OS, another BLAS), it yields False
and the caller keeps BLAS's own threading instead of adding threads on top.

The setting is process-wide while it lasts: other threads' BLAS calls during a cuflash CPU
call run single-threaded too.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import threading
from typing import Iterator

_lock = threading.Lock()
_depth = 0        # nested or concurrent single_threaded() regions
_saved = 0        # the thread count to restore when the last one ends


@functools.cache
def _openblas() -> tuple | None:
    """``(get, set)`` of the OpenBLAS NumPy loaded, or None."""
    import numpy  # noqa: F401  (loads NumPy's BLAS)
    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps
                            if "openblas" in line.lower() and ".so" in line})
    except OSError:
        return None
    for path in paths:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for prefix in ("scipy_openblas", "openblas"):
            for suffix in ("64_", ""):
                get = getattr(lib, f"{prefix}_get_num_threads{suffix}", None)
                set_ = getattr(lib, f"{prefix}_set_num_threads{suffix}", None)
                if get is not None and set_ is not None:
                    get.restype, get.argtypes = ctypes.c_int, []
                    set_.restype, set_.argtypes = None, [ctypes.c_int]
                    return get, set_
    return None


def available() -> bool:
    """Whether BLAS's thread count can be controlled here."""
    return _openblas() is not None


@contextlib.contextmanager
def single_threaded() -> Iterator[bool]:
    """Run the block with NumPy's BLAS on one thread; yields whether that could be done."""
    global _depth, _saved
    blas = _openblas()
    if blas is None:
        yield False
        return
    get, set_ = blas
    with _lock:
        if _depth == 0:
            _saved = get()
            set_(1)
        _depth += 1
    try:
        yield True
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                set_(_saved)
