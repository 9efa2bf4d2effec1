"""Where the CUDA sources are.

The canonical directory is the repository's top-level ``cuda_src/``. A wheel ships the same
files as ``cuflash/cuda_src/`` (setup.cfg maps the package ``cuflash.cuda_src`` onto
``cuda_src/``). A tree checkout (``PYTHONPATH=.`` or an editable install) wins, so editing a
kernel in ``cuda_src/`` takes effect without reinstalling.
"""
from __future__ import annotations

import importlib.resources
import pathlib

__all__ = ["cuda_src_dir"]

_MARKER = "common.cuh"


def cuda_src_dir() -> pathlib.Path:
    """Return the directory holding ``common.cuh`` and the ``*.cu`` kernel sources.

    Order: ``<parent of the cuflash package>/cuda_src`` when it holds ``common.cuh`` (a tree
    checkout), else the installed ``cuflash/cuda_src`` found through importlib.resources.
    Raises ``FileNotFoundError`` naming both places when neither has the sources.
    """
    pkg_dir = pathlib.Path(__file__).resolve().parent
    tree = pkg_dir.parent / "cuda_src"
    if (tree / _MARKER).is_file():
        return tree
    installed = importlib.resources.files("cuflash") / "cuda_src"
    # Installed wheels are plain directories (zip_safe = False), so this is a real path.
    installed_path = pathlib.Path(str(installed))
    if (installed_path / _MARKER).is_file():
        return installed_path
    raise FileNotFoundError(
        f"cuflash CUDA sources not found: neither {tree} (tree checkout) nor "
        f"{installed_path} (installed package) contains {_MARKER}"
    )
