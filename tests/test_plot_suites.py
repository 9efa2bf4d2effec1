"""bench/plot_suites.py draws a PNG for each committed suite result (CPU, matplotlib)."""
from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "h200"


def _load():
    spec = importlib.util.spec_from_file_location("plot_suites", ROOT / "bench" / "plot_suites.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("name", ["mods", "decode", "varlen"])
def test_plot_suites_writes_a_png_per_result(tmp_path, name):
    pytest.importorskip("matplotlib")
    src = tmp_path / f"{name}.json"
    shutil.copy(RESULTS / f"{name}.json", src)
    assert _load().main([str(src)]) == 0
    png = tmp_path / f"{name}.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_ratio_uses_the_block_mask_row_not_the_dense_mask_fallback():
    mod = _load()
    rows = json.loads((RESULTS / "mods.json").read_text())["rows"]
    assert mod.suite_of({"rows": rows}) == "mods"
    best = mod.best_cuflash(rows, "document", "fwd")
    assert best["impl"] == "cuflash_block_mask" and "dense mask" not in (best.get("note") or "")
    assert mod.best_cuflash(rows, "plain", "fwd")["impl"] == "cuflash"


def test_unknown_suite_is_skipped(tmp_path):
    pytest.importorskip("matplotlib")
    src = tmp_path / "fwd.json"
    src.write_text(json.dumps({"header": {"suite": "fwd"}, "rows": []}))
    assert _load().main([str(src)]) == 0
    assert not (tmp_path / "fwd.png").exists()
