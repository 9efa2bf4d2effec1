"""Pieces the command lines share (``python -m cuflash`` and its bench and fuzz): whether
CuPy can use a GPU here and if not why, in a user's words ("no CUDA GPU found" rather than
CUDA's "driver version is insufficient" on a machine without a driver); an argparse whose bad
argument is one line with exit status 2. Imports CuPy only when asked."""
from __future__ import annotations

import argparse
import math
import sys


class OneLineParser(argparse.ArgumentParser):
    """argparse with a bad argument as one line on stderr and exit status 2 (SystemExit),
    not the usage block followed by the error."""

    def error(self, message: str):
        print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)


def positive_seconds(text: str) -> float:
    """An argparse type: a finite number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds > 0, got {text}")
    return value


def short_error(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def gpu_unavailable_reason(cupy) -> str | None:
    """Why CuPy cannot use a GPU here, in a user's words, or None when it can.

    Without an NVIDIA driver CUDA says "CUDA driver version is insufficient for CUDA runtime
    version" (the driver version reads as 0); that is reported as no GPU found. A real but
    old driver is reported with both versions.
    """
    rt = cupy.cuda.runtime
    try:
        driver = rt.driverGetVersion()
    except Exception as e:
        return f"no CUDA GPU found (the NVIDIA driver cannot be queried: {short_error(e)})"
    if driver == 0:
        return "no CUDA GPU found (no NVIDIA driver is installed or loaded)"
    try:
        n = rt.getDeviceCount()
    except Exception as e:
        text = str(e)
        if "NoDevice" in text or "no CUDA-capable device" in text:
            return "no CUDA GPU found"
        if "InsufficientDriver" in text:
            def ver(v: int) -> str:
                return f"{v // 1000}.{v % 1000 // 10}"
            return (f"the NVIDIA driver (CUDA {ver(driver)}) is older than this CuPy's CUDA "
                    f"runtime ({ver(rt.runtimeGetVersion())}): update the driver or install "
                    f"the CuPy build for it (cuflash[cuda12])")
        return f"CUDA is not usable: {short_error(e)}"
    return None if n > 0 else "no CUDA GPU found"


def usable_gpu():
    """``(cupy, None)`` when CuPy imports and sees at least one device, else ``(None, why)``."""
    try:
        import cupy
    except Exception as e:        # no CuPy: the CPU path
        return None, f"CuPy is not installed ({short_error(e)}); pip install cuflash[cuda13]"
    why = gpu_unavailable_reason(cupy)
    return (None, why) if why else (cupy, None)


def version_of(dist: str) -> str | None:
    """Installed version of a distribution without importing it (None when absent)."""
    import importlib.metadata as md
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def cuflash_version() -> str:
    try:
        import cuflash
        return str(cuflash.__version__)
    except Exception:       # a broken package must not stop `info` or a results header
        return version_of("cuflash") or "0+unknown"
