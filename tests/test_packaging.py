"""Packaging: a wheel built from the tree installs into a fresh venv and finds its kernels.

The wheel is built from a copy of the tree (so the checkout gets no build/ or egg-info) with
``pip wheel`` (build isolation: setuptools comes from the package index). It is installed with
``--no-deps --no-index`` into a venv made here; numpy, scipy, ml_dtypes (and CuPy) are lent to
that venv by a ``.pth`` line pointing at this interpreter's copies, so nothing is downloaded
but the build backend, and ``cuflash`` itself can only come from the wheel.
"""
from __future__ import annotations

import configparser
import json
import os
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
KERNEL_SUFFIXES = (".cu", ".cuh")


def _kernel_files() -> set[str]:
    return {p.name for p in (ROOT / "cuda_src").iterdir() if p.suffix in KERNEL_SUFFIXES}


def test_tree_checkout_finds_top_level_cuda_src():
    from cuflash._paths import cuda_src_dir
    assert cuda_src_dir() == ROOT / "cuda_src"
    assert (cuda_src_dir() / "common.cuh").is_file()


def test_setup_cfg_maps_cuda_src_into_the_package():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    assert cfg["metadata"]["name"] == "cuflash"
    assert "cuflash.cuda_src" in cfg["options"]["packages"].split()
    assert "cuflash.cuda_src = cuda_src" in cfg["options"]["package_dir"]
    # every Python subpackage of cuflash must be listed (setup.cfg cannot mix find: and a map)
    listed = set(cfg["options"]["packages"].split())
    for init in (ROOT / "cuflash").rglob("__init__.py"):
        pkg = ".".join(init.parent.relative_to(ROOT).parts)
        assert pkg in listed, f"{pkg} is missing from [options] packages in setup.cfg"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", ".venv*", "venv", "build", "dist", "*.egg-info", "__pycache__", ".hypothesis",
        ".pytest_cache", "tests", "bench", "out", ".whl"))
    out = tmp / "dist"
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet",
                        "--wheel-dir", str(out), str(src)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"pip wheel failed:\n{r.stdout}\n{r.stderr}"
    wheels = list(out.glob("cuflash-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


@pytest.mark.slow
def test_wheel_contents(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    shipped = {n.split("/")[-1] for n in names if n.startswith("cuflash/cuda_src/")}
    assert "common.cuh" in shipped
    assert shipped == _kernel_files()
    for mod in ("__init__.py", "__main__.py", "_paths.py", "_bench.py"):
        assert f"cuflash/{mod}" in names
    tops = {n.split("/")[0] for n in names}
    assert tops == {"cuflash", wheel.name.split("-py3")[0] + ".dist-info"}, tops
    meta = zipfile.ZipFile(wheel).read(
        f"{wheel.name.split('-py3')[0]}.dist-info/METADATA").decode()
    requires = [line.split(": ", 1)[1] for line in meta.splitlines()
                if line.startswith("Requires-Dist: ") and "extra ==" not in line]
    # the plain install is the CPU path: NumPy and ml_dtypes, nothing else (no SciPy, no CuPy)
    assert sorted(r.split(">")[0].split("=")[0].strip() for r in requires) == ["ml_dtypes", "numpy"]
    for extra in ("cuda12", "cuda13"):
        gpu = [line for line in meta.splitlines() if f'extra == "{extra}"' in line]
        assert any("cupy-cuda" in line and ">=14" in line for line in gpu), gpu
        assert not any(lib in line for line in gpu for lib in ("cublas", "cufft", "[ctk]"))
    for extra in ("cuda12", "cuda13", "test"):
        assert f"Provides-Extra: {extra}" in meta


def _lent_dirs() -> list[str]:
    """Directories holding this interpreter's numpy, scipy, ml_dtypes and (if any) cupy."""
    import importlib.util
    dirs = []
    for mod in ("numpy", "scipy", "ml_dtypes", "cupy", "cupy_backends", "cuda", "fastrlock"):
        spec = importlib.util.find_spec(mod)
        if spec and spec.submodule_search_locations:
            d = str(Path(list(spec.submodule_search_locations)[0]).parent)
            if d not in dirs:
                dirs.append(d)
    return dirs


@pytest.mark.slow
def test_wheel_installs_into_fresh_venv_and_finds_kernels(wheel, tmp_path):
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True, clear=True).create(env_dir)
    py = env_dir / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    r = subprocess.run([py, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
                        str(wheel)], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr

    # First, with nothing lent: the kernels are found without importing cuflash (and numpy).
    probe = ("import importlib.util, json, pathlib\n"
             "spec = importlib.util.find_spec('cuflash')\n"
             "pkg = pathlib.Path(list(spec.submodule_search_locations)[0])\n"
             "print(json.dumps([str(pkg), sorted(p.name for p in (pkg/'cuda_src').iterdir())]))\n")
    r = subprocess.run([py, "-c", probe], capture_output=True, text=True, env=env,
                       cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stderr
    pkg, files = json.loads(r.stdout)
    assert Path(pkg).is_relative_to(env_dir)
    assert _kernel_files() <= set(files)

    # Then the real thing, with numpy & co. lent: import cuflash and ask _paths and
    # importlib.resources where the kernels are.
    site = next((env_dir / "lib").glob("python3*/site-packages"))
    (site / "zz_lent_from_test_env.pth").write_text("\n".join(_lent_dirs()) + "\n")
    script = ("import importlib.resources as r, json, cuflash\n"
              "from cuflash._paths import cuda_src_dir\n"
              "d = cuda_src_dir()\n"
              "res = sorted(p.name for p in (r.files('cuflash') / 'cuda_src').iterdir())\n"
              "print(json.dumps([cuflash.__file__, str(d), sorted(p.name for p in d.iterdir()),"
              " res]))\n")
    r = subprocess.run([py, "-c", script], capture_output=True, text=True, env=env,
                       cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stderr
    init, src_dir, files, res_files = json.loads(r.stdout)
    assert Path(init).is_relative_to(env_dir), init
    assert Path(src_dir).is_relative_to(env_dir), src_dir
    assert Path(src_dir).name == "cuda_src"
    assert _kernel_files() <= set(files)
    assert set(files) == set(res_files)

    # And the command line runs from the installed package.
    r = subprocess.run([py, "-m", "cuflash", "info"], capture_output=True, text=True, env=env,
                       cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stderr
    assert str(env_dir) in r.stdout


# -- The README and the user guide stay true ------------------------------------------------

def _python_blocks(path: Path) -> list[str]:
    text = path.read_text()
    blocks, rest = [], text
    while "```python\n" in rest:
        rest = rest.split("```python\n", 1)[1]
        block, rest = rest.split("```", 1)
        blocks.append(block)
    return blocks


@pytest.mark.slow
def test_readme_numpy_example_runs_on_the_cpu(tmp_path):
    """The first example of the README (what a user without a GPU pastes) runs as written."""
    example = _python_blocks(ROOT / "README.md")[0]
    assert "import cupy" not in example
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", example], capture_output=True, text=True,
                       env=env, cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr
    error = r.stdout.split()[-1]
    assert r.stdout.startswith("(2, 8, 1024, 64) float32 max error ")
    assert float(error) < 1e-5


def test_guide_documents_every_public_function():
    import inspect

    import cuflash
    guide = (ROOT / "docs" / "guide.md").read_text()
    functions = [getattr(cuflash, name) for name in cuflash.__all__ if name != "reference"]
    functions += [cuflash.reference.attention, cuflash.reference.attention_backward]
    for fn in functions:
        qualified = ("cuflash.reference." if fn.__module__ == "cuflash.reference" else "cuflash.")
        assert f"`{qualified}{fn.__name__}(" in guide, f"{qualified}{fn.__name__} is not documented"
        for param in inspect.signature(fn).parameters:
            assert param in guide, f"{fn.__name__}'s parameter {param} is not in the guide"
    readme = (ROOT / "README.md").read_text()
    for name in ("attention_backward", "attention_vjp", "enable_gqa", "docs/guide.md"):
        assert name in readme


def test_guide_benchmark_tables_match_the_results():
    """docs/guide.md's tables are docs/bench_table.py's output for bench/results/h200/."""
    sys.path.insert(0, str(ROOT / "docs"))
    try:
        import bench_table
    finally:
        sys.path.pop(0)
    if not list(bench_table.RESULTS.glob("*.json")):
        pytest.skip("no bench/results/h200/*.json in this tree")
    guide = (ROOT / "docs" / "guide.md").read_text()
    assert bench_table.guide_block(guide) == bench_table.block(), (
        "docs/guide.md's benchmark tables are stale: run python docs/bench_table.py --write")


@pytest.mark.gpu
def test_readme_cupy_example_runs_on_the_gpu():
    """The README's second example (bfloat16 CuPy arrays, forward with lse, attention_vjp) runs
    as written; one head of its output and gradients passes the tolerance rule (heads are
    independent; the float64 reference of all 64 heads at L = 4096 would need 8 GiB)."""
    cupy = pytest.importorskip("cupy")
    import ml_dtypes

    from cuflash.testing import AttentionCase, assert_attention_close
    example = _python_blocks(ROOT / "README.md")[1]
    assert "import cupy as cp" in example
    scope: dict = {}
    exec(compile(example, "README.md (CuPy example)", "exec"), scope)
    cupy.cuda.Device().synchronize()
    q, k, v, o, lse = (scope[n] for n in ("q", "k", "v", "o", "lse"))
    dq, dk, dv = scope["dq"], scope["dk"], scope["dv"]
    assert o.dtype == ml_dtypes.bfloat16 and lse.dtype == cupy.float32
    assert [g.shape for g in (dq, dk, dv)] == [q.shape, k.shape, v.shape]
    assert all(bool(cupy.isfinite(g.astype(cupy.float32)).all()) for g in (o, dq, dk, dv))
    head = (slice(0, 1), slice(0, 1))
    case = AttentionCase.from_arrays(q[head], k[head], v[head], do=cupy.ones_like(o[head]),
                                     causal=True)
    assert_attention_close(o[head], case, lse=lse[head],
                           grads=tuple(g[head] for g in (dq, dk, dv)))


def test_no_package_module_exceeds_500_lines():
    """Issue 9's rule: the package holds what users call, in modules a reader can hold (<= 500
    lines); a module that grows past it is split where its parts meet (session 10 split
    _families into _spills and _overrides, _plan into _plan_cache)."""
    package = Path(__file__).resolve().parents[1] / "cuflash"
    long = {p.name: n for p in sorted(package.glob("*.py"))
            if (n := len(p.read_text().splitlines())) > 500}
    assert not long, f"modules over 500 lines: {long}"
