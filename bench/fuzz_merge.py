#!/usr/bin/env python3
"""Merge the JSON reports of several ``python -m cuflash fuzz`` processes (shards of one
campaign, each with its own ``--seed``) into one report of the same fields.

A campaign of modifiers on the GPU spends most of its time compiling the kernel specialisations
its cases need (NVRTC, one CPU core each); shards in parallel processes share CuPy's on-disk
kernel cache and use every core. bench/gpu_run.sh's ``correctness`` part runs them.

    python bench/fuzz_merge.py OUT.json SHARD.json [SHARD.json ...]

Sums: examples, examples_requested, n_failures, counts, features_fuzzed. Failures are
concatenated, each with its ``shard`` (the shard's seed). ``wall_s`` is the longest shard's
(they ran at once); ``ms_per_example`` is shard time per example; ``worst_error_over_bound`` the
largest; ``seeds`` and ``commands`` list the shards'. Other fields must agree and are kept.
"""
from __future__ import annotations

import json
import sys


def _add(a, b):
    if isinstance(a, dict):
        out = dict(a)
        for k, v in b.items():
            out[k] = _add(out[k], v) if k in out else v
        return out
    return a + b


def merge(reports: list[dict]) -> dict:
    first = reports[0]
    out = {k: v for k, v in first.items() if k not in ("seed", "command")}
    out["seeds"] = [r["seed"] for r in reports]
    out["commands"] = [r.get("command") for r in reports]
    for key in ("examples", "examples_requested", "n_failures"):
        out[key] = sum(r[key] for r in reports)
    out["failures"] = [dict(f, shard=r["seed"]) for r in reports for f in r["failures"]]
    out["passed"] = all(r["passed"] for r in reports)
    out["stopped_early"] = [r["stopped_early"] for r in reports if r["stopped_early"]] or None
    out["wall_s"] = max(r["wall_s"] for r in reports)
    shard_s = sum(r["wall_s"] for r in reports)
    out["ms_per_example"] = round(1e3 * shard_s / max(1, out["examples"]), 2)
    out["shard_seconds"] = round(shard_s, 2)
    out["worst_error_over_bound"] = max(r["worst_error_over_bound"] for r in reports)
    for key in ("counts", "features_fuzzed"):
        acc: dict = {}
        for r in reports:
            acc = _add(acc, r.get(key, {}))
        out[key] = acc
    for key in ("device", "dtypes", "features", "max_seqlen", "grads_share", "cuflash_version"):
        values = {json.dumps(r.get(key), sort_keys=True) for r in reports}
        if len(values) > 1:
            raise SystemExit(f"fuzz_merge: the shards disagree on {key}: {sorted(values)}")
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    reports = []
    for path in argv[1:]:
        with open(path) as f:
            reports.append(json.load(f))
    out = merge(reports)
    with open(argv[0], "w") as f:
        json.dump(out, f, indent=1)
    print(f"{out['examples']} examples in {len(reports)} shards, {out['n_failures']} failures, "
          f"{out['wall_s']} s wall; worst error/bound {out['worst_error_over_bound']}")
    return 1 if out["n_failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
