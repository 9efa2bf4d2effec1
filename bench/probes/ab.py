"""Question: is source tree A faster than source tree B, in one run on one GPU? (A/B timing of
cuflash trees against SDPA flash, each tree in its own process.)

Answer so far: it decided fwd_sm80 v2's copy loop (unrolled by 4 beats rolled; bench/NOTES.md,
"fwd_sm80 v2"), and it is the tool for the no-regression check of a refactor: run the old and
the new tree in one call; ratios to SDPA flash are comparable, absolute TFLOP/s across runs
less so (run-to-run spread up to ~7%, NOTES.md).

    python bench/probes/ab.py TREE [TREE ...] [--d 64,128] [--L 4096] [--causal both]
        [--mode fwd|fwd_bwd] [--rounds 1] [--json out.json]

Each TREE is a directory holding cuflash/ and cuda_src/ (e.g. an old commit's `git archive`),
optionally followed by @TILES, a CUFLASH_SM80_TILES setting for that process.
bf16, B*L = 16k tokens, H*d = 2048, CUDA-event medians; SDPA flash is timed in every
process so each tree has its own same-run reference. ``--mode fwd_bwd`` times a forward and
its backward (cuflash.attention + attention_backward; SDPA's forward and torch.autograd.grad),
FLOPs 3.5x the forward's as in bench_attention.py. ``--rounds N`` runs the trees N times in
turn (A B A B ...: a drift of the machine's speed lands on both).

Session 15's question for ``--mode fwd_bwd``: the d 128 fwd_bwd points of the suite read 2-7%
below session 8's file with the same bwd_sm90 machine code: the lease, or the code?

    git archive 3b0b8cb cuflash cuda_src | (mkdir -p /tmp/s8 && tar -x -C /tmp/s8)
    python bench/probes/ab.py /tmp/s8 . --mode fwd_bwd --d 64,128 --L 4096,16384 --rounds 2
"""
import argparse
import json
import os
import subprocess
import sys

CHILD = r"""
import sys, json, numpy, cupy, torch, ml_dtypes
sys.path.insert(0, sys.argv[1])
import cuflash
from torch.nn.attention import sdpa_kernel, SDPBackend
ds, Ls, causals = json.loads(sys.argv[2])
mode = sys.argv[3]
def med(fn, n=30):
    for _ in range(3): fn()
    ts = []
    for _ in range(n):
        a, b = cupy.cuda.Event(), cupy.cuda.Event()
        a.record(); fn(); b.record(); b.synchronize()
        ts.append(cupy.cuda.get_elapsed_time(a, b))
    return float(numpy.median(ts))
for d in ds:
    for L in Ls:
        B, H = 16384 // L, 2048 // d
        rng = cupy.random.default_rng(0)
        q, k, v, do = (rng.standard_normal((B, H, L, d), dtype=numpy.float32).astype(ml_dtypes.bfloat16) for _ in range(4))
        tq, tk, tv = (torch.from_dlpack(x).requires_grad_(mode == "fwd_bwd") for x in (q, k, v))
        tdo = torch.from_dlpack(do)
        sdpa = torch.nn.functional.scaled_dot_product_attention
        for c in causals:
            fl = 4 * B * H * L * L * d / (2 if c else 1) * (3.5 if mode == "fwd_bwd" else 1)
            if mode == "fwd_bwd":
                def ours():
                    o, lse = cuflash.attention(q, k, v, causal=c, return_lse=True)
                    cuflash.attention_backward(do, q, k, v, o, lse, causal=c)
                def peer():
                    torch.autograd.grad(sdpa(tq, tk, tv, is_causal=c), (tq, tk, tv), tdo)
            else:
                def ours():
                    cuflash.attention(q, k, v, causal=c)
                def peer():
                    sdpa(tq, tk, tv, is_causal=c)
            t1 = med(ours)
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                t2 = med(peer)
            print(json.dumps(dict(tree=sys.argv[1] + "@" + __import__("os").environ.get("CUFLASH_SM80_TILES", ""), mode=mode, d=d, L=L, causal=c, cuflash=fl / t1 / 1e9, sdpa_flash=fl / t2 / 1e9)), flush=True)
"""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trees", nargs="+")
    ap.add_argument("--d", default="64,128,256")
    ap.add_argument("--L", default="4096,16384")
    ap.add_argument("--causal", default="both")
    ap.add_argument("--mode", choices=("fwd", "fwd_bwd"), default="fwd")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--json")
    a = ap.parse_args()
    causals = {"both": [False, True], "false": [False], "true": [True]}[a.causal]
    cfg = json.dumps([[int(x) for x in a.d.split(",")], [int(x) for x in a.L.split(",")], causals])
    rows = []
    for rnd in range(a.rounds):
        for spec in a.trees:
            tree, _, tiles = spec.partition("@")
            env = dict(os.environ, CUFLASH_SM80_TILES=tiles)
            out = subprocess.run([sys.executable, "-c", CHILD, tree, cfg, a.mode],
                                 capture_output=True, text=True, env=env)
            if out.returncode:
                print(out.stderr[-3000:])
            rows += [dict(json.loads(line), round=rnd) for line in out.stdout.splitlines()
                     if line.startswith("{")]
    print(f"{a.mode}: {'tree':24s} {'round':>5s} {'d':>4s} {'L':>6s} {'causal':>6s} "
          f"{'cuflash':>8s} {'flash':>8s} {'ratio':>6s}")
    for r in rows:
        print(f"{'':{len(a.mode) + 2}s}{r['tree']:24s} {r['round']:5d} {r['d']:4d} {r['L']:6d} "
              f"{str(r['causal']):>6s} {r['cuflash']:8.1f} {r['sdpa_flash']:8.1f} "
              f"{r['cuflash'] / r['sdpa_flash']:6.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"probe": "ab", "mode": a.mode, "trees": a.trees, "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
