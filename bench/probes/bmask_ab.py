"""Question: do block masks as tile lists (session 8) beat the walk of main's tree, and where do
they stand against FlexAttention? (bench/NOTES.md "Block masks as tile lists (session 8)".)

    python bench/probes/bmask_ab.py --old OLD_TREE [--json out.json] [--L 4096,16384]
        [--no-flex]

OLD_TREE: a directory holding main's cuflash/ and cuda_src/ (the walk), e.g.
``git archive 3b0b8cb | tar -x -C /tmp/old`` (the commit this branch starts from). Each tree
runs in its own process (two cuflash packages cannot share one); each times, at d = 128, bf16,
the mods suite's shapes (B = 16384 / L, H = 16) and its three block masks (window 1024,
8 documents, prefix-LM; ``cuflash.block_mask`` of 128 x 128, ``causal`` as the suite passes
it), forward and fwd+bwd (``attention_vjp`` + pullback), CUDA-event medians. The new tree also
times fwd+bwd with ``CUFLASH_BWD90_BLOCK_MASK=1`` (the backward on bwd_sm90: opt-in at d = 128
in sessions 8-9, the default since session 10; bench/probes/bmask_bwd128.py compares it with
bwd_sm80 in one process), and FlexAttention (torch.compile'd, as suite_mods does)
unless --no-flex. TFLOP/s on visible pairs (suite_mods.visible_pairs). Prints one line per
point and writes ``{"meta", "rows"}`` to --json. The kernels are compiled on first use (NVRTC
cache on disk): a second run is the timed one if the first ran past 90 s.
"""
import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
NEW_TREE = HERE.parent.parent

CHILD = r"""
import json, os, sys, time
tree, label, lengths, flex_on = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4] == "1"
sys.path.insert(0, tree)
sys.path.insert(0, os.path.join(tree, "bench"))
import numpy, cupy, ml_dtypes
import cuflash
import suite_mods
import bench_attention
from suite_common import median_event_ms, compile_flex
torch = compiled = cbm = None
if flex_on:
    import torch
    from torch.nn.attention.flex_attention import create_block_mask as cbm
    compiled = compile_flex(torch)
d = 128
H = suite_mods.WIDTH // d
bf16 = numpy.dtype(ml_dtypes.bfloat16)
def emit(**row):
    print("ROW " + json.dumps(row), flush=True)
for L in lengths:
    B = max(1, suite_mods.TOKENS // L)
    rng = numpy.random.default_rng(L)
    q, k, v = (cupy.asarray(rng.standard_normal((B, H, L, d)).astype(bf16)) for _ in range(3))
    do = cupy.ones_like(q)
    for name, mod in suite_mods.mods_for(L, H, torch).items():
        if name not in ("window", "document", "prefix"):
            continue
        pairs = suite_mods.visible_pairs(mod, L)
        bm = cuflash.block_mask(mod.mask_mod, (1, 1), L, L)
        kw = {"block_mask": bm, "causal": mod.mask_causal}
        for mode in ("fwd", "fwd_bwd"):
            flops = 4 * B * H * d * pairs * (3.5 if mode == "fwd_bwd" else 1.0)
            runs = [(label, {})]
            if mode == "fwd_bwd" and label == "new":
                runs.append(("new_bwd_sm90", {"CUFLASH_BWD90_BLOCK_MASK": "1"}))
            for impl, env in runs:
                t0 = time.perf_counter()
                try:
                    with bench_attention.env(**env):     # plans cleared on the way in and out
                        if mode == "fwd":
                            ms = median_event_ms(lambda i: cuflash.attention(q, k, v, **kw), 1, 10, 2)
                        else:
                            ms = median_event_ms(lambda i: cuflash.attention_vjp(q, k, v, **kw)[1](do),
                                                 1, 10, 2)
                    emit(impl=impl, mode=mode, mod=name, d=d, L=L, ms=ms, tflops=flops / ms / 1e9,
                         seconds=time.perf_counter() - t0)
                except Exception as exc:
                    emit(impl=impl, mode=mode, mod=name, d=d, L=L, ms=None, tflops=None,
                         note=f"{type(exc).__name__}: {str(exc)[:200]}")
            if flex_on:
                tq = [torch.from_dlpack(x) for x in (q, k, v)]
                fbm = cbm(mod.mask_mod, None, None, L, L, device="cuda")
                try:
                    if mode == "fwd":
                        with torch.no_grad():
                            ms = median_event_ms(lambda i: compiled(*tq, block_mask=fbm), 1, 10, 2)
                    else:
                        leaves = [x.detach().requires_grad_() for x in tq]
                        def step(i):
                            o = compiled(*leaves, block_mask=fbm)
                            o.backward(torch.ones_like(o))
                        ms = median_event_ms(step, 1, 10, 2)
                    emit(impl="flex", mode=mode, mod=name, d=d, L=L, ms=ms, tflops=flops / ms / 1e9)
                except Exception as exc:
                    emit(impl="flex", mode=mode, mod=name, d=d, L=L, ms=None, tflops=None,
                         note=f"{type(exc).__name__}: {str(exc)[:200]}")
    del q, k, v, do
    cupy.get_default_memory_pool().free_all_blocks()
"""


def run_tree(tree: Path, label: str, lengths, flex: bool) -> list[dict]:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", CHILD, str(tree), label, json.dumps(lengths),
                           "1" if flex else "0"], capture_output=True, text=True)
    rows = [json.loads(line[4:]) for line in proc.stdout.splitlines() if line.startswith("ROW ")]
    if proc.returncode:
        print(f"{label} ({tree}) failed:\n{proc.stderr[-3000:]}", file=sys.stderr)
    print(f"# {label}: {tree} ({time.perf_counter() - t0:.0f} s)", flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", help="main's tree (the walk); omitted: the new tree alone")
    ap.add_argument("--json")
    ap.add_argument("--L", default="4096,16384")
    ap.add_argument("--no-flex", action="store_true")
    a = ap.parse_args(argv)
    lengths = [int(x) for x in a.L.split(",")]
    rows = run_tree(NEW_TREE, "new", lengths, not a.no_flex)
    if a.old:
        rows += run_tree(Path(a.old).resolve(), "old", lengths, False)
    table = {}
    for r in rows:
        table.setdefault((r["mod"], r["L"], r["mode"]), {})[r["impl"]] = r["tflops"]
    impls = ["old", "new", "new_bwd_sm90", "flex"]
    print(f"{'mask':9} {'L':>6} {'mode':8} " + " ".join(f"{i:>13}" for i in impls)
          + "   new/old new/flex  (TFLOP/s on visible pairs)")
    for (mod, L, mode), t in sorted(table.items()):
        def f(x):
            return f"{x:13.1f}" if x else f"{'-':>13}"
        r_old = t["new"] / t["old"] if t.get("new") and t.get("old") else None
        r_flex = t["new"] / t["flex"] if t.get("new") and t.get("flex") else None
        print(f"{mod:9} {L:6} {mode:8} " + " ".join(f(t.get(i)) for i in impls)
              + f"   {r_old or 0:7.2f} {r_flex or 0:8.2f}")
    if a.json:
        Path(a.json).write_text(json.dumps({"meta": {"probe": "bmask_ab", "old": a.old,
                                                     "d": 128, "dtype": "bfloat16"},
                                            "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
